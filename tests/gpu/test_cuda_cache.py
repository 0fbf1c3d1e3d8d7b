"""The CUDA backend against the host backend, on the device machine."""

from __future__ import annotations

import numpy as np
import pytest

from cellcache import (
    CacheConfig, CudaError, HostCellCache, InvalidState, LayerConfig, OutOfMemory,
)
from cellcache.cuda import driver as drv
from cellcache.cuda.backend import CudaCellCache
from cellcache.cuda.driver import check, cu


def both(cfg):
    return HostCellCache(cfg), CudaCellCache(cfg)


def compare_step(host, dev, step, cfg):
    w = step.width
    for name in ("cells", "positions"):
        np.testing.assert_array_equal(dev.buffer(name).copy_to_host()[:w],
                                      host.buffer(name)[:w], err_msg=name)
    assert int(dev.buffer("read_len").copy_to_host()[0]) == int(host.buffer("read_len")[0])
    r = step.read_len
    for win in cfg.windows:
        got = dev.buffer(f"mask_w{win}").copy_to_host()[0, 0, :w, :r]
        np.testing.assert_array_equal(got, host.buffer(f"mask_w{win}")[0, 0, :w, :r],
                                      err_msg=f"mask_w{win}")


def compare_pools(host, dev, cfg):
    live = host.used_end
    for name in (n for n in host.buffer_names if n.startswith("layer_")):
        got = dev.buffer(name).copy_to_host()
        assert got.shape == host.buffer(name).shape
        np.testing.assert_array_equal(got[:live], host.buffer(name)[:live], err_msg=name)


@pytest.mark.parametrize("max_seqs", [64, 300])
def test_differential_session(max_seqs):
    rng = np.random.default_rng(max_seqs)
    layers = [LayerConfig(2, 8, 0), LayerConfig(1, 8, 4), LayerConfig(2, 4, 128)]
    # 3000 cells: rows not 16-byte aligned (the kernel's byte-store path); 4096: vector stores
    cfg = CacheConfig(capacity=3000 if max_seqs == 64 else 4096, layers=layers, max_write=48,
                      initial_capacity=16, max_seqs=max_seqs, dtype="bfloat16")
    host, dev = both(cfg)
    steps = grew = 0
    for it in range(2500):
        live = host.live_seqs()
        r = rng.random()
        if r < 0.06 or not live:
            s = host.seq_new()
            assert dev.seq_new() == s
        elif r < 0.09:
            s = int(rng.choice(live))
            upto = None if rng.random() < 0.5 else int(rng.integers(0, host.pos(s) + 1))
            assert dev.seq_clone(s, upto) == host.seq_clone(s, upto)
        elif r < 0.12:
            s = int(rng.choice(live))
            assert dev.seq_rm(s) == host.seq_rm(s)
        elif r < 0.17:
            s = int(rng.choice(live))
            p = max(0, host.pos(s) - int(rng.integers(0, 6)))
            assert dev.rewind(s, p) == host.rewind(s, p)
        elif r < 0.172:
            host.clear()
            dev.clear()
        else:
            if rng.random() < 0.2:      # prefill chunk
                ids = [int(rng.choice(live))] * int(rng.integers(2, 40))
            else:                        # decode batch
                ids = [int(x) for x in rng.choice(live, size=int(rng.integers(1, 48)))]
            ok = host.declare_step(ids)
            assert dev.declare_step(ids) == ok
            if not ok:
                victim = max(live, key=host.pos)
                assert host.seq_rm(victim) and dev.seq_rm(victim)
                continue
            hs = host.prepare_step()
            ds = dev.prepare_step()
            assert hs.cells.tolist() == ds.cells.tolist() and hs.grew == ds.grew
            compare_step(host, dev, ds, cfg)
            for li, layer in enumerate(layers):
                shape = (hs.width, layer.n_kv_heads, layer.head_dim)
                k = rng.standard_normal(shape).astype(np.float32)
                v = rng.standard_normal(shape).astype(np.float32)
                host_pool = host.buffer(f"layer_{li}_k")
                host_pool[hs.cells] = k.astype(host_pool.dtype)
                host.buffer(f"layer_{li}_v")[hs.cells] = v.astype(host_pool.dtype)
                dev.write_kv(li, k, v, hs.width)
            host.commit_step()
            dev.commit_step()
            steps += 1
            grew += hs.grew
            if hs.grew or steps % 50 == 0:
                compare_pools(host, dev, cfg)
        if it % 200 == 0:
            assert dev._table.snapshot() == host._table.snapshot()
    dev.check_invariants()
    assert steps > 1500 and grew >= 3
    assert dev.metrics()["growth_count"] == host.metrics()["growth_count"]
    dev.close()


def test_out_of_memory_growth_changes_nothing_and_a_smaller_step_succeeds():
    layers = [LayerConfig(256, 1024, 0) for _ in range(4)]          # 1 MiB per row per pool
    cfg = CacheConfig(capacity=1 << 17, layers=layers, max_write=64, initial_capacity=64,
                      dtype="float32")
    dev = CudaCellCache(cfg)
    a = dev.seq_new()
    assert dev.declare_step([a] * 56)
    dev.prepare_step()
    dev.commit_step()
    error = None
    for _ in range(4096):
        assert dev.declare_step([a] * 64)
        rows, used = dev.rows, dev.used_end
        snap = dev._table.snapshot()
        metrics = dev.metrics()
        try:
            dev.prepare_step()
        except OutOfMemory as e:
            error = e
            break
        dev.commit_step()
    assert error is not None, "the device never ran out of memory"
    assert f"growing the pools from {rows} to {2 * rows} rows failed" in str(error)
    assert "CUDA_ERROR_OUT_OF_MEMORY" in str(error) and "nothing changed" in str(error)
    assert dev.rows == rows and dev.used_end == used == rows - 8
    assert dev._table.snapshot() == snap
    after = dev.metrics()
    for key in ("flat_capacity", "growth_count", "allocated_bytes", "logical_length"):
        assert after[key] == metrics[key], key
    assert dev._table.declared == [a] * 64                  # the declaration survives
    assert dev.declare_step([a] * 8)                        # a smaller step fits the pools
    step = dev.prepare_step()
    dev.commit_step()
    assert not step.grew and step.read_len == rows
    dev.close()


def small_config(**kw):
    base = dict(capacity=256, layers=[LayerConfig(2, 8, 0), LayerConfig(2, 8, 3)],
                max_write=16, initial_capacity=16, dtype="bfloat16")
    base.update(kw)
    return CacheConfig(**base)


def test_stream_destroyed_before_teardown():
    dev = CudaCellCache(small_config())
    stream = check(cu.cuStreamCreate(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)), "cuStreamCreate")
    a = dev.seq_new()
    for _ in range(3):
        dev.declare_step([a] * 10)
        dev.prepare_step(stream=int(stream))
        dev.commit_step()
    check(cu.cuStreamDestroy(stream), "cuStreamDestroy")
    dev.close()
    dev.close()                                     # idempotent
    with pytest.raises(InvalidState, match="closed"):
        dev.buffer("cells")


def test_two_streams_are_ordered_by_commit():
    torch = pytest.importorskip("torch")
    dev = CudaCellCache(small_config(capacity=1 << 16, max_write=64, initial_capacity=1024))
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    a, b = dev.seq_new(), dev.seq_new()
    dev.declare_step([a] * 64)
    dev.prepare_step(stream=s1)
    mask = torch.from_dlpack(dev.buffer("mask_w3"))
    with torch.cuda.stream(s1):
        torch.cuda._sleep(200_000_000)              # a slow "forward" still reading the mask
        seen = mask.clone()
    dev.commit_step()
    dev.declare_step([b] * 64)
    dev.prepare_step(stream=s2)                     # must wait for the forward on s1
    torch.cuda.synchronize()
    first = seen[0, 0, :64, :64].cpu().numpy()
    assert first[5, 3:6].all() and not first[5, :3].any()   # step one's window-3 rows
    later = mask[0, 0, :64, 64:128].cpu().numpy()
    assert later[5, 3:6].all()
    dev.close()


def test_prepare_on_a_capturing_stream_is_refused():
    dev = CudaCellCache(small_config())
    a = dev.seq_new()
    dev.declare_step([a] * 4)
    dev.prepare_step()
    dev.commit_step()
    stream = check(cu.cuStreamCreate(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)), "cuStreamCreate")
    dev.declare_step([a] * 4)
    snap = dev._table.snapshot()
    check(cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
          "cuStreamBeginCapture")
    try:
        with pytest.raises(InvalidState, match="being captured"):
            dev.prepare_step(stream=int(stream))
    finally:
        graph = check(cu.cuStreamEndCapture(stream), "cuStreamEndCapture")
        check(cu.cuGraphDestroy(graph), "cuGraphDestroy")
    assert dev._table.snapshot() == snap
    step = dev.prepare_step(stream=int(stream))      # outside capture it works
    dev.commit_step()
    assert step.positions.tolist() == [4, 5, 6, 7]
    check(cu.cuStreamDestroy(stream), "cuStreamDestroy")
    dev.close()


def test_torch_interop_bfloat16_pools_and_masks():
    torch = pytest.importorskip("torch")
    dev = CudaCellCache(small_config())
    a = dev.seq_new()
    dev.declare_step([a] * 5)
    step = dev.prepare_step(stream=torch.cuda.current_stream())
    dev.commit_step()
    buf = dev.buffer("layer_1_k")
    k = torch.from_dlpack(buf)
    assert k.dtype == torch.bfloat16 and tuple(k.shape) == buf.shape == (16, 2, 8)
    assert k.data_ptr() == buf.ptr and k.device.type == "cuda"
    k[step.cells.tolist()] = torch.arange(5 * 16, dtype=torch.bfloat16, device="cuda").reshape(5, 2, 8)
    torch.cuda.synchronize()
    host = buf.copy_to_host()
    assert host.dtype.name == "bfloat16"
    assert host[:5].astype(np.float32).ravel().tolist() == list(range(80))
    mask = torch.from_dlpack(dev.buffer("mask_w3"))
    assert mask.dtype == torch.bool and mask[0, 0, 4, :5].tolist() == [False, False, True, True, True]
    cells = torch.as_tensor(dev.buffer("cells"), device="cuda")   # __cuda_array_interface__
    assert cells.dtype == torch.int64 and cells[:5].tolist() == [0, 1, 2, 3, 4]
    assert not hasattr(buf, "__cuda_array_interface__")          # bfloat16: DLPack only
    del k, mask, cells
    dev.close()


def test_unloadable_ptx_names_the_driver_needed(monkeypatch):
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
    with pytest.raises(CudaError, match="needs a driver for CUDA 13.0 or newer; this driver supports CUDA"):
        drv.load_module("step")


def test_buffers_describe_themselves():
    dev = CudaCellCache(small_config(dtype="float16"))
    assert dev.buffer("layer_0_k").shape == (0, 2, 8)           # nothing before the first step
    a = dev.seq_new()
    dev.declare_step([a])
    dev.prepare_step()
    dev.commit_step()
    b = dev.buffer("mask_w0")
    assert b.shape == (1, 1, 16, 256) and b.dtype == np.bool_ and b.nbytes == 16 * 256
    cai = dev.buffer("layer_0_v").__cuda_array_interface__
    assert cai["typestr"] == "<f2" and cai["shape"] == (16, 2, 8) and cai["data"][0] != 0
    assert dev.buffer("mask_w0").__dlpack_device__() == (2, 0)
    m = dev.metrics()
    assert m["backend"] == "cuda" and m["flat_capacity"] == 16
    assert m["allocated_bytes"] == 2 * 16 * 2 * (2 * 8) * 2
    dev.close()


def test_demo_on_cuda_has_no_mismatch():
    from cellcache import demo

    s = demo.run(backend="cuda", seqs=8, steps=40, seed=1, capacity=256, progress=False)
    assert s["backend"] == "cuda" and s["mismatches"] == 0 and s["tokens"] > 100
