"""The CUDA backend against the host backend and the reference: random sessions compared
buffer by buffer, the demo on CUDA, the paged kernels against the reference view.

Nothing here imports cuda-bindings at collection: without it (or a driver, or a device)
every test is skipped by the conftest, never errored.
"""

from __future__ import annotations

import numpy as np
import pytest

from cellcache import (
    CacheConfig,
    HostCellCache,
    LayerConfig,
    StepTooLarge,
    attention,
)

from ..helpers import compare_step, cuda, live_rows_equal


@pytest.mark.parametrize("max_seqs,fmt,growth", [
    (64, "bool", "map"), (300, "bits", "map"), (70, "bool", "copy"), (65, "none", "map"),
])
def test_differential_session(max_seqs, fmt, growth):
    CudaCellCache, *_ = cuda()
    rng = np.random.default_rng(max_seqs)
    layers = [LayerConfig(2, 8, 0), LayerConfig(1, 8, 4), LayerConfig(2, 4, 128)]
    # 3000 cells: rows not 16-byte aligned (byte stores); 4096: vector stores
    cfg = CacheConfig(capacity=3000 if max_seqs == 64 else 4096, layers=layers, max_write=48,
                      initial_capacity=16, max_seqs=max_seqs, dtype="bfloat16", paged=True,
                      mask_format=fmt)
    from cellcache.host import HostAllocator

    host = HostCellCache(cfg, allocator=HostAllocator() if growth == "copy" else None)
    dev = CudaCellCache(cfg, growth=growth)
    steps = grew = 0
    for it in range(900):
        live = host.live_seqs()
        r = rng.random()
        if r < 0.06 or not live:
            assert dev.seq_new() == host.seq_new()
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
            if rng.random() < 0.2:
                ids = [int(rng.choice(live))] * int(rng.integers(2, 40))
            else:
                ids = [int(x) for x in rng.choice(live, size=int(rng.integers(1, 48)))]
            try:
                ok = host.declare_step(ids)
            except StepTooLarge:         # kv lists past max_kv: both refuse, nothing declared
                with pytest.raises(StepTooLarge):
                    dev.declare_step(ids)
                assert dev.table.declared is None
                continue
            assert dev.declare_step(ids) == ok
            if not ok:
                victim = max(live, key=host.pos)
                assert host.seq_rm(victim) and dev.seq_rm(victim)
                continue
            pad = int(rng.integers(len(ids), 49))
            hs, ds = host.prepare_step(pad_to=pad), dev.prepare_step(pad_to=pad)
            assert ds.grew == hs.grew == (growth == "copy" and hs.grew or steps == 0)
            compare_step(host, dev, hs, ds, cfg)
            for li, layer in enumerate(layers):
                shape = (hs.width, layer.n_kv_heads, layer.head_dim)
                k = rng.standard_normal(shape).astype(np.float32)
                v = rng.standard_normal(shape).astype(np.float32)
                attention.write_kv(host, li, k, v, hs.width, pad)
                attention.write_kv(dev, li, k, v, ds.width, pad)
            host.commit_step()
            dev.commit_step()
            steps += 1
            grew += hs.grew
            if hs.grew or steps % 50 == 0:
                live_rows_equal(host, dev)
        if it % 200 == 0:
            assert dev.table.snapshot() == host.table.snapshot()
    dev.check_invariants()
    assert steps > 600 and dev.metrics()["growth_count"] >= 3
    assert grew == (1 + dev.metrics()["growth_count"] if growth == "copy" else 1)
    assert dev.metrics()["growth_count"] == host.metrics()["growth_count"]
    dev.close()


def test_bit_masks_over_scattered_words():
    """Bit masks where 64-cell words are not runs, compared with the host backend: words two
    sequences interleave (each owns 32 cells: all 64 compared) and words a step's many
    sequences share (each owns one or two: only those compared), in several 2048-column
    tiles (the kernel orders them last first), beside run words, with windows."""
    CudaCellCache, *_ = cuda()
    rng = np.random.default_rng(5)
    layers = [LayerConfig(1, 8, 0), LayerConfig(1, 8, 5), LayerConfig(1, 8, 700)]
    cfg = CacheConfig(capacity=8192, layers=layers, max_write=64, initial_capacity=8192,
                      max_seqs=40, dtype="bfloat16", mask_format="bits")
    host, dev = HostCellCache(cfg), CudaCellCache(cfg)
    seqs = [host.seq_new() for _ in range(36)]
    assert [dev.seq_new() for _ in range(36)] == seqs
    a, b = seqs[0], seqs[1]
    plan = ([[a, b] * 32] * 20                                       # interleaved: dense words
            + [[int(rng.choice(seqs))] * 64 for _ in range(30)]     # runs
            + [[int(x) for x in rng.permutation(seqs)[:32]] * 2 for _ in range(20)]  # sparse
            + [[a, b] * 32] * 10)
    checked = 0
    for i, ids in enumerate(plan + [[a] * 3 + [b] * 3 + seqs[2:20]] * 4):
        assert host.declare_step(ids) and dev.declare_step(ids)
        hs, ds = host.prepare_step(), dev.prepare_step()
        if i < len(plan):    # placed in order on fresh cells, so the words are as planned
            assert hs.cells.tolist() == list(range(64 * i, 64 * i + 64))
        compare_step(host, dev, hs, ds, cfg)
        checked += hs.read_len > 4096
        host.commit_step()
        dev.commit_step()
    assert checked >= 20
    dev.close()


@pytest.mark.parametrize("view", ["bool", "bits", "paged"])
def test_demo_on_cuda_has_no_mismatch(view):
    from cellcache import demo

    s = demo.run(backend="cuda", seqs=8, steps=40, seed=1, capacity=256, view=view, pad=True,
                 progress=False)
    assert s["backend"] == "cuda" and s["mismatches"] == 0 and s["tokens"] > 100


def test_paged_kernels_against_the_reference_view():
    """cellcache's paged kernels over a random session: every row equals the reference
    consumer reading the host cache's paged view (same session on both backends)."""
    torch = pytest.importorskip("torch")
    CudaCellCache, *_ = cuda()
    import cellcache.torch as cct
    from cellcache.session import Session, SessionConfig

    for dtype, hd, heads in (("bfloat16", 128, (32, 8)), ("float16", 64, (14, 2)), ("float32", 32, (4, 4))):
        layers = (LayerConfig(heads[1], hd, 0), LayerConfig(heads[1], hd, 16))
        cfg = CacheConfig(capacity=2048, layers=layers, max_write=64, initial_capacity=64,
                          dtype=dtype, max_seqs=24, paged=True, mask_format="none")
        dev = CudaCellCache(cfg)
        view = cct.TorchView(dev)
        tdt = cct.torch_dtype(dtype)

        def forward(cache, step, qkv, heads=heads, hd=hd, tdt=tdt, view=view):
            outs = []
            for li, (q, k, v) in enumerate(qkv):
                T = step.pad_to
                qt = torch.zeros((T, heads[0], hd), dtype=tdt, device="cuda")
                kt = torch.full((T, heads[1], hd), float("nan"), dtype=tdt, device="cuda")
                vt = kt.clone()
                qt[:step.width] = torch.from_numpy(q).to("cuda", tdt)
                kt[:step.width] = torch.from_numpy(k).to("cuda", tdt)
                vt[:step.width] = torch.from_numpy(v).to("cuda", tdt)
                o = cct.attention(view, li, qt, kt, vt)
                outs.append(o[:step.width].float().cpu().numpy())
            return outs

        s = Session(dev, forward, SessionConfig(n_heads=heads[0], max_len=400, prompt=(8, 300),
                                                chunk=(8, 60), buckets=[1, 4, 16, 64],
                                                tolerance=2e-2 if dtype != "float32" else 1e-4,
                                                q_dtype=dtype), seed=7)
        summary = s.run(50)
        assert summary["mismatches"] == 0, (dtype, summary)
        dev.close()

