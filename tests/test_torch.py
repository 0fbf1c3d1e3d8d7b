"""cellcache.torch on the host backend: zero-copy views of every buffer and dtype, and an
attention whose outputs equal attention over each sequence's own history (with padding,
bool and bit masks)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cellcache as cc  # noqa: E402
import cellcache.torch as cct  # noqa: E402
from cellcache.session import Session, SessionConfig  # noqa: E402

LAYERS = (cc.LayerConfig(2, 16, 0), cc.LayerConfig(2, 16, 8))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_as_tensor_views_every_buffer_without_copying(dtype):
    cache = cc.HostCellCache(cc.CacheConfig(capacity=64, layers=LAYERS, max_write=8, dtype=dtype,
                                            paged=True, mask_format="bits"))
    for name in cache.buffer_names:
        buf = cache.buffer(name)
        t = cct.as_tensor(buf)
        assert t.data_ptr() == buf.ctypes.data and tuple(t.shape) == buf.shape, name
    k = cct.as_tensor(cache.layer(0).k)
    assert k.dtype == cct.torch_dtype(dtype)
    k[3, 1, 2] = 1.5                                   # writes land in the cache's own array
    assert float(cache.layer(0).k[3, 1, 2]) == 1.5
    with pytest.raises(cc.InvalidArgument, match="buffer of type list"):
        cct.as_tensor([1, 2])


@pytest.mark.parametrize("fmt", ["bool", "bits"])
def test_attention_through_torch_matches_each_sequence(fmt):
    cfg = cc.CacheConfig(capacity=512, layers=LAYERS, max_write=32, initial_capacity=16,
                         dtype="float32", max_seqs=16, mask_format=fmt)
    cache = cc.HostCellCache(cfg)
    view = cct.TorchView(cache)

    def forward(cache, step, qkv):
        outs = []
        for li, (q, k, v) in enumerate(qkv):
            T = step.pad_to
            qt, kt = torch.zeros((T, 4, 16)), torch.full((T, 2, 16), float("nan"))
            vt = kt.clone()
            qt[:step.width] = torch.from_numpy(q)
            kt[:step.width] = torch.from_numpy(k)
            vt[:step.width] = torch.from_numpy(v)
            outs.append(cct.attention(view, li, qt, kt, vt, step=step)[:step.width].numpy())
        return outs

    s = Session(cache, forward, SessionConfig(n_heads=4, buckets=[4, 8, 16, 32]), seed=1).run(60)
    assert s["mismatches"] == 0 and s["growths"] >= 2 and len(s["per_bucket"]) >= 2


def test_attention_refusals():
    cache = cc.HostCellCache(cc.CacheConfig(capacity=64, layers=LAYERS, max_write=8, dtype="float32"))
    view = cct.TorchView(cache)
    a = cache.seq_new()
    cache.declare_step([a, a])
    step = cache.prepare_step()
    q, k = torch.zeros((2, 4, 16)), torch.zeros((2, 2, 16))
    cache.layer(0).k[:] = 7.0
    before = cache.layer(0).k.copy()
    for kwargs, match in [
        (dict(q=q, k=k[:, :1], v=k[:, :1]), "k, v \\[T, 2, 16\\]"),
        (dict(q=torch.zeros((9, 4, 16)), k=torch.zeros((9, 2, 16)), v=torch.zeros((9, 2, 16))),
         "9 rows is more than max_write=8"),
    ]:
        with pytest.raises(cc.InvalidArgument, match=match):
            cct.attention(view, 0, step=step, **kwargs)
    for backend, match in [("paged", "needs a CUDA cache"), ("prefill", "needs step= of a CUDA"),
                           ("flashinfer", "needs step= of a CUDA"), ("magic", "is not one of")]:
        with pytest.raises(cc.InvalidArgument, match=match):
            cct.attention(view, 0, q, k, k, step=step, backend=backend)
    with pytest.raises(cc.InvalidArgument, match="needs step="):
        cct.attention(view, 0, q, k, k)
    np.testing.assert_array_equal(cache.layer(0).k, before)        # nothing was written
    with pytest.raises(cc.InvalidArgument, match="cache of type int"):
        cct.TorchView(5)
