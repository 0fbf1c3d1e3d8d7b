"""Pools on the device: growth by mapping and by copy, failures at every driver call changing
nothing, poisoned pools under padded replays, graphs surviving growth.

Nothing here imports cuda-bindings at collection: without it (or a driver, or a device)
every test is skipped by the conftest, never errored.
"""

from __future__ import annotations

import numpy as np
import pytest

from cellcache import (
    CacheConfig,
    LayerConfig,
    OutOfMemory,
    attention,
)

from ..helpers import cuda


def test_out_of_memory_growth_changes_nothing_and_a_smaller_step_succeeds():
    CudaCellCache, *_ = cuda()
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
        snap = dev.table.snapshot()
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
    assert dev.table.snapshot() == snap
    after = dev.metrics()
    for key in ("flat_capacity", "growth_count", "allocated_bytes", "logical_length", "mapped_bytes"):
        assert after[key] == metrics[key], key
    assert dev.table.declared == [a] * 64                  # the declaration survives
    assert dev.declare_step([a] * 8)                        # a smaller step fits the pools
    step = dev.prepare_step()
    dev.commit_step()
    assert not step.grew and step.read_len == rows
    dev.close()


def test_mapped_growth_with_a_failure_at_every_driver_call():
    """Each create/map/set-access call of a growth failing in turn: OutOfMemory or CudaError,
    everything the attempt made is gone, and the retry succeeds."""
    CudaCellCache, driver, check, cu = cuda()
    from cellcache.cuda import pools as pools_mod

    cfg = CacheConfig(capacity=1 << 15, layers=[LayerConfig(8, 128), LayerConfig(8, 128, 64)],
                      max_write=1024, initial_capacity=1, dtype="bfloat16")
    calls = {"n": 0, "fail_at": None, "live": 0}

    class Flaky(pools_mod.VmmOps):
        def _maybe_fail(self, what):
            calls["n"] += 1
            if calls["n"] == calls["fail_at"]:
                code = int(cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
                driver.raise_cuda_error(code, f"injected {what}")

        def create(self, size):
            self._maybe_fail("cuMemCreate")
            handle = super().create(size)
            calls["live"] += 1
            return handle

        def map(self, va, size, handle):
            self._maybe_fail("cuMemMap")
            super().map(va, size, handle)

        def set_access(self, va, size):
            self._maybe_fail("cuMemSetAccess")
            super().set_access(va, size)

        def release(self, handle):
            calls["live"] -= 1
            super().release(handle)

    import cellcache.cuda.backend as backend

    real = backend.VmmOps
    backend.VmmOps = Flaky
    try:
        dev = CudaCellCache(cfg)
    finally:
        backend.VmmOps = real
    per_granule = dev._pools.granularity // (8 * 128 * 2)
    a = dev.seq_new()
    left = per_granule                         # fill exactly one granule of every pool
    while left:
        n = min(left, cfg.max_write)
        assert dev.declare_step([a] * n)
        dev.prepare_step()
        dev.commit_step()
        left -= n
    assert dev.rows == per_granule
    first = calls["n"]
    assert dev.declare_step([a])               # one more row: each of the 4 pools maps a granule
    per_growth = 3 * 4
    for k in range(1, per_growth + 1):
        calls["fail_at"] = calls["n"] + k
        before = (dev.table.snapshot(), dev.metrics(), calls["live"])
        with pytest.raises(OutOfMemory, match="injected"):
            dev.prepare_step()
        assert (dev.table.snapshot(), dev.metrics(), calls["live"]) == before
    calls["fail_at"] = None
    step = dev.prepare_step()
    dev.commit_step()
    assert not step.grew and dev.rows == 2 * per_granule and calls["n"] - first > per_growth
    dev.close()
    assert calls["live"] == 0


def test_forced_copy_growth_moves_pools_and_reports_it():
    CudaCellCache, *_ = cuda()
    cfg = CacheConfig(capacity=512, layers=[LayerConfig(2, 8)], max_write=256, initial_capacity=8)
    dev = CudaCellCache(cfg, growth="copy")
    a = dev.seq_new()
    ptrs, grew = [], []
    for width in (32, 32, 64, 128, 256):              # rows 32, 64, 128, 256, 512
        dev.declare_step([a] * width)
        grew.append(dev.prepare_step().grew)
        dev.commit_step()
        ptrs.append(dev.layer(0).k.ptr)
    assert grew == [True] * 5 and len(set(ptrs)) == 5 and dev.metrics()["pools_move"]
    assert dev.layer(0).k.shape == (dev.rows + 1, 2, 8)
    dev.close()


def test_poisoned_pools_and_padded_replays():
    """Every row outside the live cells is NaN, the sink included; padded steps through
    captured graphs leave every live row's bytes as they were (but the step's own new
    cells) and give finite outputs equal to attention over each sequence's history."""
    torch = pytest.importorskip("torch")
    CudaCellCache, *_ = cuda()
    import cellcache.torch as cct

    cfg = CacheConfig(capacity=2048, layers=[LayerConfig(2, 64, 0), LayerConfig(2, 64, 16)],
                      max_write=32, initial_capacity=2048, dtype="bfloat16", max_seqs=32,
                      paged=True, mask_format="none")
    dev = CudaCellCache(cfg)
    view = cct.TorchView(dev)
    rng = np.random.default_rng(0)
    seqs = [dev.seq_new() for _ in range(6)]
    hist = {s: {li: ([], []) for li in range(2)} for s in seqs}
    stream = torch.cuda.Stream()
    q_buf = torch.zeros((32, 4, 64), dtype=torch.bfloat16, device="cuda")
    k_buf = torch.zeros((32, 2, 64), dtype=torch.bfloat16, device="cuda")
    v_buf = torch.zeros((32, 2, 64), dtype=torch.bfloat16, device="cuda")
    graphs, outs = {}, {}
    for it in range(40):
        ids = [int(s) for s in rng.choice(seqs, size=int(rng.integers(1, 9)))]
        if it < 6:
            ids = [seqs[it]] * 12                      # prefill
        assert dev.declare_step(ids)
        bucket = 8 if len(ids) <= 8 else 16
        step = dev.prepare_step(stream=stream, pad_to=bucket)
        with torch.cuda.stream(stream):
            # poison every row that no live sequence owns (freed, unused, the sink)
            live = torch.zeros(cfg.capacity + 1, dtype=torch.bool, device="cuda")
            pos = torch.as_tensor(dev.table.positions_array(), device="cuda")
            live[:cfg.capacity] = pos >= 0
            before = []
            for li in range(2):
                k, v, _ = view.layer(li)
                k[~live] = float("nan")
                v[~live] = float("nan")
                before.append((k.clone(), v.clone()))
            q = rng.standard_normal((len(ids), 4, 64)).astype(np.float32)
            kv = rng.standard_normal((2, len(ids), 2, 64)).astype(np.float32)
            q_buf.zero_()
            k_buf.fill_(float("nan"))
            v_buf.fill_(float("nan"))
            q_buf[:len(ids)] = torch.from_numpy(q).to("cuda", torch.bfloat16)
            k_buf[:len(ids)] = torch.from_numpy(kv[0]).to("cuda", torch.bfloat16)
            v_buf[:len(ids)] = torch.from_numpy(kv[1]).to("cuda", torch.bfloat16)
        if bucket not in graphs:
            with torch.cuda.stream(stream):
                for li in range(2):
                    cct.attention(view, li, q_buf[:bucket], k_buf[:bucket], v_buf[:bucket])
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                outs[bucket] = [cct.attention(view, li, q_buf[:bucket], k_buf[:bucket], v_buf[:bucket])
                                for li in range(2)]
            graphs[bucket] = g
        with torch.cuda.stream(stream):
            graphs[bucket].replay()
        stream.synchronize()
        new = set(step.cells.tolist())
        for li in range(2):
            k, v, window = view.layer(li)
            kb, vb = before[li]
            keep = live.clone()
            keep[list(new)] = False
            for a, b in ((k, kb), (v, vb)):
                assert torch.equal(a[keep].view(torch.int16), b[keep].view(torch.int16))
            out = outs[bucket][li][:len(ids)].float().cpu().numpy()
            assert np.isfinite(out).all()
            kq = kv[0].astype(dev.config.np_dtype).astype(np.float32)
            vq = kv[1].astype(dev.config.np_dtype).astype(np.float32)
            for i, s in enumerate(ids):
                hk, hv = hist[s][li]
                hk.append(kq[i])
                hv.append(vq[i])
            for i, s in enumerate(ids):
                p = int(step.positions[i])
                hk, hv = hist[s][li]
                ref = attention.dense_attention(q[i].astype(dev.config.np_dtype).astype(np.float32),
                                                np.stack(hk), np.stack(hv), p, window)
                np.testing.assert_allclose(out[i], ref, atol=2e-2, rtol=0)
        dev.commit_step()
    dev.close()


def test_graph_captured_before_five_growths_is_right_after_them():
    torch = pytest.importorskip("torch")
    CudaCellCache, *_ = cuda()
    import cellcache.torch as cct

    cfg = CacheConfig(capacity=1 << 14, layers=[LayerConfig(2, 64)], max_write=64,
                      initial_capacity=64, dtype="bfloat16", max_seqs=8, paged=True,
                      mask_format="none")
    dev = CudaCellCache(cfg)
    view = cct.TorchView(dev)
    stream = torch.cuda.Stream()
    a, b = dev.seq_new(), dev.seq_new()
    q = torch.randn((64, 4, 64), device="cuda").bfloat16()
    k = torch.randn((64, 2, 64), device="cuda").bfloat16()
    v = torch.randn((64, 2, 64), device="cuda").bfloat16()
    dev.declare_step([a] * 64)
    dev.prepare_step(stream=stream)
    with torch.cuda.stream(stream):
        cct.attention(view, 0, q, k, v)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        out = cct.attention(view, 0, q, k, v)
    dev.commit_step()
    growths = []
    history = {a: [(k.float().cpu(), v.float().cpu())], b: []}
    for it in range(40):
        s = a if it % 2 else b
        dev.declare_step([s] * 64)
        step = dev.prepare_step(stream=stream)
        growths.append(step.grew)
        with torch.cuda.stream(stream):
            q.normal_()
            k.normal_()
            v.normal_()
            g.replay()
        stream.synchronize()
        history[s].append((k.float().cpu(), v.float().cpu()))
        hk = torch.cat([h[0] for h in history[s]]).numpy()
        hv = torch.cat([h[1] for h in history[s]]).numpy()
        o = out.float().cpu().numpy()
        for i in (0, 31, 63):
            p = int(step.positions[i])
            ref = attention.dense_attention(q[i].float().cpu().numpy(), hk, hv, p, 0)
            np.testing.assert_allclose(o[i], ref, atol=2e-2, rtol=0)
        dev.commit_step()
    assert dev.metrics()["growth_count"] >= 5 and not any(growths)
    dev.close()

