"""The CUDA backend against the host backend and the reference, on the device machine.

Nothing here imports cuda-bindings at collection: without it (or a driver, or a device)
every test is skipped by the conftest, never errored.
"""

from __future__ import annotations

import numpy as np
import pytest

from cellcache import (
    CacheConfig,
    CudaError,
    HostCellCache,
    InvalidState,
    LayerConfig,
    OutOfMemory,
    StepTooLarge,
    attention,
)


def cuda():
    """(CudaCellCache, driver module, check, cu), imported when a test runs."""
    from cellcache.cuda import driver
    from cellcache.cuda.backend import CudaCellCache

    return CudaCellCache, driver, driver.check, driver.cu


def compare_step(host, dev, hs, ds, cfg):
    assert hs.cells.tolist() == ds.cells.tolist() and hs.positions.tolist() == ds.positions.tolist()
    assert (hs.n_runs, hs.pad_to) == (ds.n_runs, ds.pad_to)
    pad, r = ds.pad_to, ds.read_len
    for name in ("cells", "positions"):
        np.testing.assert_array_equal(dev.buffer(name).copy_to_host()[:pad], host.buffer(name)[:pad],
                                      err_msg=name)
    for name in ("read_len", "width"):
        assert int(dev.buffer(name).copy_to_host()[0]) == int(host.buffer(name)[0]), name
    if cfg.mask_format != "none":
        for win in cfg.windows:
            got = dev.buffer(f"mask_w{win}").copy_to_host()
            want = host.buffer(f"mask_w{win}")
            if cfg.mask_format == "bool":
                np.testing.assert_array_equal(got[0, 0, :pad, :r], want[0, 0, :pad, :r],
                                              err_msg=f"mask_w{win}")
            else:
                nb = (r + 7) // 8
                np.testing.assert_array_equal(got[:pad, :nb], want[:pad, :nb], err_msg=f"mask_w{win}")
    if cfg.paged:
        assert ds.qo_indptr.tolist() == hs.qo_indptr.tolist()
        assert ds.kv_indptr.tolist() == hs.kv_indptr.tolist()
        for name in ("qo_indptr", "kv_indptr"):
            np.testing.assert_array_equal(dev.buffer(name).copy_to_host()[:pad + 1],
                                          host.buffer(name)[:pad + 1], err_msg=name)
        n_kv = int(hs.kv_indptr[-1])
        np.testing.assert_array_equal(dev.buffer("kv_indices").copy_to_host()[:n_kv],
                                      host.buffer("kv_indices")[:n_kv], err_msg="kv_indices")


def live_rows_equal(host, dev):
    """Every live cell's K/V row agrees (host pools vs device pools)."""
    t = host._table
    live = np.flatnonzero(t.positions_array() >= 0)
    for i in range(len(host.config.layers)):
        lay_h, lay_d = host.layer(i), dev.layer(i)
        for kv in "kv":
            got = getattr(lay_d, kv).copy_to_host()
            want = getattr(lay_h, kv)
            np.testing.assert_array_equal(got[live], want[live], err_msg=f"layer {i} {kv}")


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
                assert dev._table.declared is None
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
            assert dev._table.snapshot() == host._table.snapshot()
    dev.check_invariants()
    assert steps > 600 and dev.metrics()["growth_count"] >= 3
    assert grew == (1 + dev.metrics()["growth_count"] if growth == "copy" else 1)
    assert dev.metrics()["growth_count"] == host.metrics()["growth_count"]
    dev.close()


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
    for key in ("flat_capacity", "growth_count", "allocated_bytes", "logical_length", "mapped_bytes"):
        assert after[key] == metrics[key], key
    assert dev._table.declared == [a] * 64                  # the declaration survives
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
        before = (dev._table.snapshot(), dev.metrics(), calls["live"])
        with pytest.raises(OutOfMemory, match="injected"):
            dev.prepare_step()
        assert (dev._table.snapshot(), dev.metrics(), calls["live"]) == before
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


def small_config(**kw):
    base = dict(capacity=256, layers=[LayerConfig(2, 8, 0), LayerConfig(2, 8, 3)],
                max_write=16, initial_capacity=16, dtype="bfloat16")
    base.update(kw)
    return CacheConfig(**base)


def test_stream_destroyed_before_teardown():
    CudaCellCache, _, check, cu = cuda()
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
    CudaCellCache, *_ = cuda()
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


def test_dlpack_orders_the_consumer_stream_after_the_step():
    """A consumer on another stream gets the step's writes: __dlpack__(stream=s) makes s wait."""
    torch = pytest.importorskip("torch")
    CudaCellCache, *_ = cuda()
    dev = CudaCellCache(small_config(capacity=1 << 16, max_write=64, initial_capacity=1024))
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    a = dev.seq_new()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(200_000_000)               # the step's kernels queue behind this
    dev.declare_step([a] * 64)
    dev.prepare_step(stream=producer)
    with torch.cuda.stream(consumer):
        cells = torch.from_dlpack(dev.buffer("cells"))    # torch passes consumer's handle
        seen = cells[:64].clone()
    torch.cuda.synchronize()
    assert seen.tolist() == list(range(64))
    dev.commit_step()
    dev.close()


def test_clear_commits_the_prepared_step():
    CudaCellCache, *_ = cuda()
    dev = CudaCellCache(small_config())
    a = dev.seq_new()
    dev.declare_step([a] * 4)
    dev.prepare_step()
    dev.clear()
    with pytest.raises(InvalidState, match="no step is prepared"):
        dev.commit_step()
    assert dev._engine.synchronize() == 0           # the commit event was recorded
    dev.close()


def test_prepare_on_a_capturing_stream_is_refused():
    CudaCellCache, _, check, cu = cuda()
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
            pos = torch.as_tensor(dev._table.positions_array(), device="cuda")
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


@pytest.mark.parametrize("view", ["bool", "bits", "paged"])
def test_demo_on_cuda_has_no_mismatch(view):
    from cellcache import demo

    s = demo.run(backend="cuda", seqs=8, steps=40, seed=1, capacity=256, view=view, pad=True,
                 progress=False)
    assert s["backend"] == "cuda" and s["mismatches"] == 0 and s["tokens"] > 100


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
