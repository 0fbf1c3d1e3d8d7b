"""FlashInfer's own kernels over the cache's paged view.

Nothing here imports cuda-bindings at collection: without it (or a driver, or a device)
every test is skipped by the conftest, never errored.
"""

from __future__ import annotations

import pytest

from cellcache import (
    CacheConfig,
    LayerConfig,
)

from ..helpers import cuda


def test_flashinfer_reads_the_cache_directly():
    """FlashInfer's paged prefill/decode kernel run on the cache's own buffers (pools viewed
    as [rows, 1, n_kv_heads, head_dim]) equals the dense reference over randomized sessions
    with forks, rewinds and windows."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("flashinfer")
    CudaCellCache, *_ = cuda()
    import cellcache.torch as cct
    from cellcache.session import Session, SessionConfig

    layers = (LayerConfig(2, 64, 0), LayerConfig(2, 64, 8))
    cfg = CacheConfig(capacity=1024, layers=layers, max_write=32, initial_capacity=64,
                      dtype="bfloat16", max_seqs=24, paged=True, mask_format="none")
    dev = CudaCellCache(cfg)
    view = cct.TorchView(dev)

    def forward(cache, step, qkv):
        outs = []
        for li, (q, k, v) in enumerate(qkv):
            T = step.pad_to
            qt = torch.zeros((T, 4, 64), dtype=torch.bfloat16, device="cuda")
            kt = torch.zeros((T, 2, 64), dtype=torch.bfloat16, device="cuda")
            vt = torch.zeros((T, 2, 64), dtype=torch.bfloat16, device="cuda")
            qt[:step.width] = torch.from_numpy(q).to("cuda", torch.bfloat16)
            kt[:step.width] = torch.from_numpy(k).to("cuda", torch.bfloat16)
            vt[:step.width] = torch.from_numpy(v).to("cuda", torch.bfloat16)
            o = cct.attention(view, li, qt, kt, vt, step=step, backend="flashinfer")
            outs.append(o[:step.width].float().cpu().numpy())
        return outs

    s = Session(dev, forward, SessionConfig(n_heads=4, max_len=120, buckets=[8, 16, 32],
                                            tolerance=2e-2, q_dtype="bfloat16"), seed=4)
    summary = s.run(60)
    assert summary["mismatches"] == 0 and summary["forks"] + summary["rewinds"] > 0
    dev.close()

