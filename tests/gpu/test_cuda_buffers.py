"""Device buffers as consumers see them: torch interop in bfloat16, self-description, the PTX
loader's message for an old driver.

Nothing here imports cuda-bindings at collection: without it (or a driver, or a device)
every test is skipped by the conftest, never errored.
"""

from __future__ import annotations

import numpy as np
import pytest

from cellcache import (
    CudaError,
)

from ..helpers import cuda, small_config


def test_torch_interop_bfloat16_pools_and_masks():
    torch = pytest.importorskip("torch")
    CudaCellCache, *_ = cuda()
    dev = CudaCellCache(small_config())
    a = dev.seq_new()
    dev.declare_step([a] * 5)
    step = dev.prepare_step(stream=torch.cuda.current_stream())
    dev.commit_step()
    buf = dev.layer(1).k
    k = torch.from_dlpack(buf)
    assert k.dtype == torch.bfloat16 and tuple(k.shape) == buf.shape == (257, 2, 8)
    assert k.data_ptr() == buf.ptr and k.device.type == "cuda"
    k[step.cells.tolist()] = torch.arange(5 * 16, dtype=torch.bfloat16, device="cuda").reshape(5, 2, 8)
    torch.cuda.synchronize()
    host = np.empty((5, 2, 8), dtype=dev.config.np_dtype)
    from cellcache.cuda.driver import check, cu
    check(cu.cuMemcpyDtoH(host.ctypes.data, buf.ptr, host.nbytes), "cuMemcpyDtoH")
    assert host.astype(np.float32).ravel().tolist() == list(range(80))
    mask = torch.from_dlpack(dev.buffer("mask_w3"))
    assert mask.dtype == torch.bool and mask[0, 0, 4, :5].tolist() == [False, False, True, True, True]
    cells = torch.as_tensor(dev.buffer("cells"), device="cuda")   # __cuda_array_interface__
    assert cells.dtype == torch.int64 and cells[:5].tolist() == [0, 1, 2, 3, 4]
    assert not hasattr(buf, "__cuda_array_interface__")          # bfloat16: DLPack only
    del k, mask, cells
    dev.close()


def test_buffers_describe_themselves():
    CudaCellCache, *_ = cuda()
    dev = CudaCellCache(small_config(dtype="float16", paged=True))
    assert dev.layer(0).k.shape == (257, 2, 8)                   # fixed from the start
    a = dev.seq_new()
    dev.declare_step([a])
    dev.prepare_step()
    dev.commit_step()
    b = dev.buffer("mask_w0")
    assert b.shape == (1, 1, 16, 256) and b.dtype == np.bool_ and b.nbytes == 16 * 256
    cai = dev.buffer("layer_0_v").__cuda_array_interface__
    assert cai["typestr"] == "<f2" and cai["shape"] == (257, 2, 8) and cai["data"][0] != 0
    assert dev.buffer("mask_w0").__dlpack_device__() == (2, 0)
    assert dev.buffer("kv_last_page_len").copy_to_host().tolist() == [1] * 16
    m = dev.metrics()
    assert m["backend"] == "cuda" and m["flat_capacity"] == 16 and not m["pools_move"]
    assert m["allocated_bytes"] == 2 * 16 * 2 * (2 * 8) * 2 and m["mapped_bytes"] > 0
    dev.close()


def test_unloadable_ptx_names_the_driver_needed(monkeypatch):
    _, drv, *_ = cuda()
    from importlib import resources as res

    real = res.files

    class Fake:
        def __init__(self, inner):
            self.inner = inner

        def joinpath(self, name):
            if name.endswith("step.ptx"):
                class P:
                    def read_bytes(self):
                        return b".version 99.0\n.target sm_90\n.address_size 64\n"
                return P()
            return self.inner.joinpath(name)

    monkeypatch.setattr(drv.resources, "files", lambda pkg: Fake(real(pkg)))
    with pytest.raises(CudaError, match="needs a driver for CUDA 12.0 or newer; this driver supports CUDA"):
        drv.load_module("step")



@pytest.mark.parametrize("extra", [dict(mask_format="bool"), dict(mask_format="bits"),
                                   dict(mask_format="bits", paged=True, max_kv=100),
                                   dict(mask_format="none", paged=True)])
@pytest.mark.parametrize("growth", ["auto", "copy"])
def test_device_buffers_follow_the_schema(extra, growth):
    """Every device buffer is what cellcache.buffers says: name, shape, dtype, bytes and
    initial value; pools are pool_spec's at the cache's sink (none before copy pools exist)."""
    from cellcache.buffers import buffer_names, pool_spec, step_buffer_bytes, step_buffers

    CudaCellCache, *_ = cuda()
    cfg = small_config(**extra)
    dev = CudaCellCache(cfg, growth=growth)
    assert dev.buffer_names == buffer_names(cfg)
    for s in step_buffers(cfg):
        buf = dev.buffer(s.name)
        assert (buf.shape, buf.dtype, buf.nbytes) == (s.shape, s.dtype, s.nbytes), s.name
        assert np.all(buf.copy_to_host() == s.fill), s.name
    assert dev.metrics()["step_buffer_bytes"] == step_buffer_bytes(cfg)
    if growth == "copy":
        assert dev.layer(0).k.shape == (0, 2, 8)
    a = dev.seq_new()
    dev.declare_step([a] * 3)
    dev.prepare_step()
    dev.commit_step()
    for i in range(len(cfg.layers)):
        for kv in "kv":
            spec = pool_spec(cfg, i, kv, dev.sink)
            buf = dev.buffer(spec.name)
            assert (buf.shape, buf.dtype) == (spec.shape, spec.dtype), spec.name
    dev.close()
