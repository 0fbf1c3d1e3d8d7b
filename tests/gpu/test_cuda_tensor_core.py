"""The tensor-core paged attention kernels (cuda/tc_attention.cu) against a float64 reference
read from the same paged view: head_dim x dtype x group x window x padded/unpadded x decode /
prefill / mixed steps x every kernel variant the module builds (each with the work list run by
run and heaviest first), kv splits on and off, the refusals, and work list + attention + merge
captured in a CUDA graph and replayed over another step of the same padded rows.

Nothing here imports cuda-bindings at collection: without it (or a driver, or a device)
every test is skipped by the conftest, never errored.
"""

from __future__ import annotations

import numpy as np
import pytest

from cellcache import CacheConfig, LayerConfig

from ..helpers import cuda

HEAD_DIMS = (64, 80, 96, 128, 256)
GROUPS = (1, 2, 4, 7, 8, 16)
N_KV = 2
WINDOW = 37                  # small, and not a multiple of any tile


def _reference(step_view: dict, q: np.ndarray, k: np.ndarray, v: np.ndarray, G: int,
               window: int, scale: float) -> np.ndarray:
    """float64 attention of the real rows: run r's query i (of qo_len) over its list of L
    cells sees entries (hi - window, hi], hi = L - qo_len + i (window 0: [0, hi])."""
    qo, kv, idx, width = (step_view[n] for n in ("qo_indptr", "kv_indptr", "kv_indices", "width"))
    H, D = q.shape[1], q.shape[2]
    out = np.zeros((width, H, D))
    r = 0
    while r + 1 < len(qo) and qo[r] < width:
        q0, q1 = int(qo[r]), int(qo[r + 1])
        cells = idx[kv[r]:kv[r + 1]]
        L, n = len(cells), q1 - q0
        kk = np.repeat(k[cells], G, axis=1)             # [L, H, D]
        vv = np.repeat(v[cells], G, axis=1)
        s = np.einsum("qhd,khd->hqk", q[q0:q1], kk) * scale
        hi = L - n + np.arange(n)
        keys = np.arange(L)
        vis = keys[None, :] <= hi[:, None]
        if window > 0:
            vis &= keys[None, :] > (hi - window)[:, None]
        s = np.where(vis[None], s, -np.inf)
        s -= s.max(axis=2, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=2, keepdims=True)
        out[q0:q1] = np.einsum("hqk,khd->qhd", p, vv)
        r += 1
    return out


class Rig:
    """A CUDA cache with one layer, sequences with histories, and the kernels; with
    ``kv_dtype`` 8-bit pools and random per-kv-head scales (``kv_scale``: K's then V's)."""

    def __init__(self, dtype: str, head_dim: int, group: int, n_seqs: int = 6,
                 hist=(1, 300), capacity: int = 8192, max_write: int = 512, seed: int = 0,
                 kv_dtype: str | None = None):
        import torch

        CudaCellCache, *_ = cuda()
        import cellcache.torch as cct
        from cellcache.cuda.tc import TensorCoreAttention

        self.torch, self.cct = torch, cct
        self.rng = np.random.default_rng(seed)
        self.D, self.G, self.H = head_dim, group, group * N_KV
        cfg = CacheConfig(capacity=capacity, layers=[LayerConfig(N_KV, head_dim)],
                          max_write=max_write, initial_capacity=capacity, dtype=dtype,
                          max_seqs=n_seqs + 2, paged=True, mask_format="none", kv_dtype=kv_dtype)
        self.cache = CudaCellCache(cfg)
        self.kv8 = cfg.kv8
        self.kv_scale = torch.as_tensor(self.rng.uniform(0.05, 3.0, size=(2, N_KV)), dtype=torch.float32,
                                        device="cuda")
        self.tdt = cct.torch_dtype(dtype)
        t = self.cache.table
        self.seqs = [t.seq_new() for _ in range(n_seqs)]
        lens = self.rng.integers(hist[0], hist[1] + 1, size=n_seqs)
        done = np.zeros(n_seqs, dtype=np.int64)
        while (done < lens).any():                     # interleaved chunks: cells spread out
            for j in self.rng.permutation(n_seqs):
                n = int(min(lens[j] - done[j], self.rng.integers(1, 40)))
                if n > 0:
                    assert t.declare_step([self.seqs[j]] * n)
                    t.place()
                    done[j] += n
        sm = torch.cuda.get_device_properties(0).multi_processor_count
        self.tc = TensorCoreAttention(dtype, sm, kv_dtype=kv_dtype)

    def step(self, ids: list[int], pad_to: int):
        """Prepares and commits one step; random pools (sink row NaN: never read) and q."""
        torch = self.torch
        c = self.cache
        assert c.declare_step(ids)
        st = c.prepare_step(pad_to=pad_to)
        c.commit_step()
        view = self.cct.TorchView(c)
        k_pool, v_pool, _ = view.layer(0)
        gen = torch.Generator(device="cuda").manual_seed(int(self.rng.integers(1 << 30)))
        # 8-bit pools: values that stand for N(0, 1) under the heads' scales (0.05 to 3: stored
        # values from e4m3's subnormals to ~80)
        div = (1.0 / self.kv_scale)[:, None, :, None] if self.kv8 else torch.ones((2, 1, 1, 1), device="cuda")
        k_pool.copy_(torch.randn(k_pool.shape, generator=gen, device="cuda") * div[0])
        v_pool.copy_(torch.randn(v_pool.shape, generator=gen, device="cuda") * div[1])
        if self.kv8:          # the largest e4m3 value (the kernels read NaN bytes as finite):
            k_pool.view(torch.uint8)[c.sink] = 0x7E    # a key that would win every softmax and a
            v_pool.view(torch.uint8)[c.sink] = 0x7E    # value far off every output, if read
        else:
            k_pool[c.sink] = float("nan")
            v_pool[c.sink] = float("nan")
        q = torch.randn((pad_to, self.H, self.D), generator=gen, device="cuda").to(self.tdt)
        return st, view, k_pool, v_pool, q

    def host_view(self, view, pad_to: int) -> dict:
        p = view.paged
        kv = p["kv_indptr"][:pad_to + 1].cpu().numpy().astype(np.int64)
        return {"qo_indptr": p["qo_indptr"][:pad_to + 1].cpu().numpy().astype(np.int64),
                "kv_indptr": kv,
                "kv_indices": p["kv_indices"][:int(kv[-1])].cpu().numpy().astype(np.int64),
                "width": int(view.width.reshape(-1)[0].item())}

    def run(self, view, rows, q, k_pool, v_pool, out, window, **choice):
        """One launch; ``choice``: decode / variant / split / order (and the other keywords) for
        TensorCoreAttention.run; returns whether it launched the merge."""
        torch = self.torch
        if self.kv8:
            choice.setdefault("kv_scale", self.kv_scale.data_ptr())
        return self.tc.run(view.paged_pointers(), rows, q.data_ptr(), (q.stride(0), q.stride(1)),
                           k_pool.data_ptr(), v_pool.data_ptr(), out.data_ptr(),
                           (out.stride(0), out.stride(1)), self.H, N_KV, self.D, window,
                           torch.cuda.current_stream().cuda_stream, **choice)

    def choices(self) -> list[dict]:
        """Every variant built for this head_dim, twice: the list run by run without extra
        splits, and heaviest first with the more splits (every split path of the merge)."""
        return [{"variant": v, "split": split, "order": order}
                for v in sorted(self.tc.variants[self.D]) for split, order in ((1, 0), (4, 1))]

    def check(self, st, view, k_pool, v_pool, q, window, out=None, what="", choices=None):
        """Compares ``out`` (or, without it, a fresh launch of every choice in ``choices``,
        default the table's) with the float64 reference, computed once."""
        torch = self.torch
        rows = q.shape[0]
        torch.cuda.synchronize()
        hv = self.host_view(view, rows)
        w = hv["width"]
        scale = 1.0 / np.sqrt(self.D)
        real = k_pool.shape[0] - 1                      # the sink is NaN: not in the reference
        kf = k_pool[:real].double()
        vf = v_pool[:real].double()
        if self.kv8:                                    # what the stored values stand for
            kf = kf * self.kv_scale[0].double()[:, None]
            vf = vf * self.kv_scale[1].double()[:, None]
        kf, vf = kf.cpu().numpy(), vf.cpu().numpy()
        want = _reference(hv, q.double().cpu().numpy(), kf, vf, self.G, window, scale)
        tol = 3e-2 if self.tdt == torch.bfloat16 else 5e-3
        want_d = torch.as_tensor(want, device="cuda")    # compared on the device: many variants
        runs = [(None, out)] if out is not None else [(c, None) for c in (choices or [{}])]
        for choice, o in runs:
            if o is None:
                o = torch.full_like(q, float("nan"))
                self.run(view, rows, q, k_pool, v_pool, o, window, **choice)
            tag = f"{what} {choice}" if choice else what
            got = o.double()
            assert bool(torch.isfinite(got).all()), f"{tag}: non-finite output"
            assert not bool(got[w:].any()), f"{tag}: padding rows not zero"
            err = float((got[:w] - want_d).abs().max()) if w else 0.0
            assert err <= tol, f"{tag}: max abs error {err:.3g} > {tol}"

    def close(self):
        self.tc.close()
        self.cache.close()


def _steps(rng, seqs):
    """(kind, ids, pad_to): decode, prefill, mixed steps, padded and not."""
    dec = [int(s) for s in rng.permutation(seqs)]
    pre = []
    for s in rng.choice(seqs, size=2, replace=False):
        pre += [int(s)] * int(rng.integers(60, 140))
    mixed = []
    order = [int(s) for s in rng.permutation(seqs)]
    for j, s in enumerate(order):                       # decode rows between prefill chunks
        n = int(rng.integers(2, 70)) if j % 2 else 1
        mixed += [s] * n
    return [("decode", dec, len(dec) + 5), ("prefill", pre, len(pre)),
            ("mixed", mixed, len(mixed) + 13), ("mixed", mixed[:len(mixed) // 2 + 1],
                                                 len(mixed) // 2 + 1)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_tensor_core_sweep(dtype, head_dim):
    """Every (group, window, padded, step kind, variant, list order) for one dtype and
    head_dim; long histories (kv splits and merge) for some groups, short ones (<= 100
    entries: no split, the smallest split is two tiles of 64) for others. The table's
    defaults are among the variants; decode=True picks a built one."""
    pytest.importorskip("torch")
    for gi, group in enumerate(GROUPS):
        hist = (1, 300) if gi % 2 == 0 else (1, 100)
        rig = Rig(dtype, head_dim, group, hist=hist, seed=head_dim * 31 + gi)
        try:
            choices = rig.choices()
            assert len(choices) >= 4 and rig.tc.describe(head_dim, decode=True)["variant"]
            for kind, ids, pad in _steps(rig.rng, rig.seqs):
                st, view, k_pool, v_pool, q = rig.step(ids, pad)
                for window in (0, WINDOW):
                    rig.check(st, view, k_pool, v_pool, q, window, choices=choices,
                              what=f"{dtype} d{head_dim} G{group} {kind} pad {pad - len(ids)} w{window}")
        finally:
            rig.close()


def test_tensor_core_strided_views_and_refusals():
    """q/out as strided views (stride multiples of 8 work); misaligned strides, a scale <= 0,
    unsupported head dims and groups are refused before any launch."""
    torch = pytest.importorskip("torch")
    from cellcache.cuda import tc
    from cellcache.errors import InvalidArgument

    rig = Rig("bfloat16", 128, 4, seed=5)
    try:
        ids = [int(s) for s in rig.seqs]
        st, view, k_pool, v_pool, q = rig.step(ids, len(ids) + 3)
        rows = q.shape[0]
        big = torch.randn((rows, rig.H + 3, 136), device="cuda").to(rig.tdt)  # (tok, head) strides
        qs = big[:, 1:1 + rig.H, 8:8 + 128]
        qs.copy_(q)
        ob = torch.full((rows, rig.H + 1, 144), float("nan"), device="cuda", dtype=rig.tdt)
        out = ob[:, 1:, :128]
        rig.run(view, rows, qs, k_pool, v_pool, out, 0)
        rig.check(st, view, k_pool, v_pool, q, 0, out=out, what="strided views")
        odd = torch.zeros((rows, rig.H, 132), device="cuda", dtype=rig.tdt)[:, :, :128]
        with pytest.raises(InvalidArgument):
            rig.run(view, rows, q, k_pool, v_pool, odd, 0)          # token stride 132*H: no
        with pytest.raises(InvalidArgument):
            rig.run(view, rows, q, k_pool, v_pool, out, 0, scale=0.0)  # the scale must be > 0
        assert not tc.aligned(q.data_ptr() + 2, (rig.H * 128, 128), k_pool.data_ptr(),
                              v_pool.data_ptr(), out.data_ptr(), (8, 8))
        assert not tc.supports("bfloat16", 24, 4) and not tc.supports("float32", 128, 4)
        assert not tc.supports("float16", 128, 65) and tc.supports("float16", 80, 7)
    finally:
        rig.close()


def test_tensor_core_merge_left_out_where_no_run_can_split():
    """``live_rows``: a decode step of at least ``unsplit_rows`` runs, launched with that
    promise and without grouping, leaves the merge out (run returns False) and gives the bits
    of the same launch with the merge (live_rows 0: True), padded or not (the attention launch
    zeroes the padding rows), windowed or not; the later layers of the step that keep its plan
    (``fresh=False``) find the counter put back without a merge. A grouped launch keeps the
    merge whatever it is promised. A live_rows that is not an int in [0, rows] is refused
    before anything is launched."""
    torch = pytest.importorskip("torch")
    from cellcache.cuda.tc import TensorCoreAttention
    from cellcache.errors import InvalidArgument

    sm = torch.cuda.get_device_properties(0).multi_processor_count
    probe = TensorCoreAttention("bfloat16", sm)
    try:
        live = probe.unsplit_rows(N_KV, 64, decode=True)     # a run each: one unit a kv head
    finally:
        probe.close()
    assert 0 < live <= 2048, live
    rig = Rig("bfloat16", 64, 4, n_seqs=live, hist=(1, 300), capacity=live * 300 + 4096,
              max_write=max(512, live + 8), seed=23)
    try:
        ids = [int(s) for s in rig.seqs]
        for pad in (live, live + 5):
            st, view, k_pool, v_pool, q = rig.step(ids, pad)
            for window in (0, WINDOW):
                tag = f"pad {pad - live} w{window}"
                merged = torch.full_like(q, float("nan"))
                assert rig.run(view, pad, q, k_pool, v_pool, merged, window, decode=True) is True
                assert rig.tc.plan_header()["split"] == 0
                out = torch.full_like(q, float("nan"))
                assert not rig.run(view, pad, q, k_pool, v_pool, out, window, decode=True, live_rows=live)
                torch.cuda.synchronize()
                assert torch.equal(out, merged), tag
                rig.check(st, view, k_pool, v_pool, q, window, out=out, what=f"no merge, {tag}")
            for j in range(3):                                # three "layers" of one plan
                qj = (q.float() * (1 + 0.1 * j)).to(q.dtype)
                out = torch.full_like(q, float("nan"))
                assert rig.run(view, pad, qj, k_pool, v_pool, out, 0, decode=True, live_rows=live,
                               fresh=j == 0) is False
                rig.check(st, view, k_pool, v_pool, qj, 0, out=out, what=f"layer {j} without the merge")
            out = torch.full_like(q, float("nan"))
            assert rig.run(view, pad, q, k_pool, v_pool, out, 0, decode=True, live_rows=live,
                           cascade=128, share=True) is True
            rig.check(st, view, k_pool, v_pool, q, 0, out=out, what="grouping on")
        out = torch.full_like(q, 7.0)
        for bad in (-1, pad + 1, True, 1.5, None):
            with pytest.raises(InvalidArgument, match="live_rows"):
                rig.run(view, pad, q, k_pool, v_pool, out, 0, decode=True, live_rows=bad)
        torch.cuda.synchronize()
        assert bool((out == 7.0).all())
    finally:
        rig.close()


def test_a_graph_captured_after_an_eager_forward_of_its_step_keeps_the_merge():
    """A caller's graph captured from the step it has just run eagerly (torch's warm-up, then
    the capture: one attention plan for both) replays any step of its rows. The eager
    forward left the merge out (the step's own runs rule a split out); the capture decides
    again and keeps it, so a replay over two runs, which the device plan splits along kv,
    gives the reference."""
    torch = pytest.importorskip("torch")
    import cellcache.torch as cct
    from cellcache.cuda.tc import TensorCoreAttention

    sm = torch.cuda.get_device_properties(0).multi_processor_count
    probe = TensorCoreAttention("bfloat16", sm)
    try:
        live = probe.unsplit_rows(N_KV, 64, decode=True)
    finally:
        probe.close()
    rig = Rig("bfloat16", 64, 4, n_seqs=live, hist=(300, 600), capacity=live * 600 + 4096,
              max_write=max(512, live + 8), seed=31)
    c, tv = rig.cache, cct.TorchView(rig.cache)
    try:
        ids = [int(s) for s in rig.seqs]
        assert c.declare_step(ids)
        st = c.prepare_step(pad_to=live)
        k_pool, v_pool, _ = tv.layer(0)
        gen = torch.Generator(device="cuda").manual_seed(5)
        k_pool.copy_(torch.randn(k_pool.shape, generator=gen, device="cuda"))
        v_pool.copy_(torch.randn(v_pool.shape, generator=gen, device="cuda"))
        k_pool[c.sink] = float("nan")
        v_pool[c.sink] = float("nan")
        q = torch.randn((live, rig.H, 64), generator=gen, device="cuda").to(torch.bfloat16)
        kv = torch.zeros((live, N_KV, 64), dtype=torch.bfloat16, device="cuda")   # (shape only)
        out = torch.full_like(q, float("nan"))
        cct.attention(tv, 0, q, kv, kv, out=out, write=False)
        plan = tv.plan(st)
        assert plan.kernels and plan.live_rows == live        # the eager forward: no merge
        rig.check(st, tv, k_pool, v_pool, q, 0, out=out, what="eager")
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        with torch.cuda.graph(graph, stream=stream):
            cct.attention(tv, 0, q, kv, kv, out=out, write=False)
        assert tv.plan(st) is plan and plan.live_rows == 0     # the capture: the merge kept
        c.commit_step()
        assert c.declare_step(ids[:2])
        st2 = c.prepare_step(pad_to=live)
        q.copy_(torch.randn(q.shape, generator=gen, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        assert tv.tensor_cores().plan_header()["split"] == 1   # (the merge had work)
        rig.check(st2, tv, k_pool, v_pool, q, 0, out=out, what="replay over two runs")
        c.commit_step()
        del graph
    finally:
        rig.close()


def test_scratch_that_must_grow_inside_a_capture_is_refused_and_changes_nothing():
    """A launch whose scratch (work list, partials) outgrows what the kernels hold, on a stream
    being captured, raises InvalidState (nothing may be allocated there) and leaves every
    scratch pointer and size as they were: the tensor-core kernels' sm_80 path (a decode
    launch), the table's prefill choice (on Hopper the sm_90a work list) and the CUDA-core
    prefill's work list, each on kernels that ran only a 16-row step before. Outside the
    capture the same launch grows it and gives the reference."""
    torch = pytest.importorskip("torch")
    from cellcache.cuda.tc import TensorCoreAttention
    from cellcache.errors import InvalidState

    rig = Rig("bfloat16", 128, 4, n_seqs=8, seed=41)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    kern = rig.cache.attention_kernels()
    tc_fields = ("_plan", "_plan_bytes", "_part", "_part_bytes", "_cpart", "_cpart_bytes",
                 "_plan90", "_plan90_bytes", "_share", "_share_bytes")
    cc_fields = ("_tiles", "_tiles_bytes", "_workspace", "_workspace_bytes")

    def scratch() -> tuple:
        return ({f: getattr(rig.tc, f) for f in tc_fields}, list(rig.tc._live),
                {f: getattr(kern, f) for f in cc_fields}, list(kern._retired))

    def launch(decode, view, rows, q, k_pool, v_pool, out):
        if decode is not None:                      # the tensor-core kernels
            rig.run(view, rows, q, k_pool, v_pool, out, 0, decode=decode)
            return
        kern.prefill(view.paged_pointers(), rows, q.data_ptr(), (q.stride(0), q.stride(1)),
                     k_pool.data_ptr(), v_pool.data_ptr(), out.data_ptr(), (out.stride(0), out.stride(1)),
                     rig.H, N_KV, rig.D, 0, torch.cuda.current_stream().cuda_stream)

    try:
        ids = [int(s) for s in rig.seqs]
        rows = 512
        for what, decode in (("tensor cores, decode", True), ("tensor cores, prefill", False),
                             ("CUDA cores, prefill", None)):
            if decode is not None:                  # fresh kernels: scratch for 16 rows only
                rig.tc.close()
                rig.tc = TensorCoreAttention("bfloat16", sm)
            st, view, k_pool, v_pool, q = rig.step(ids, 16)
            launch(decode, view, 16, q, k_pool, v_pool, torch.empty_like(q))
            st, view, k_pool, v_pool, q = rig.step([s for s in ids for _ in range(60)], rows)
            out = torch.full_like(q, float("nan"))
            torch.cuda.synchronize()
            before = scratch()
            graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            with pytest.raises(InvalidState, match="being captured"):
                with torch.cuda.graph(graph, stream=stream):
                    launch(decode, view, rows, q, k_pool, v_pool, out)
            del graph
            assert scratch() == before, what
            assert bool(out.isnan().all()), what                    # nothing ran
            launch(decode, view, rows, q, k_pool, v_pool, out)      # outside a capture: it grows
            assert scratch() != before, what
            rig.check(st, view, k_pool, v_pool, q, 0, out=out, what=f"{what} after the refusal")
    finally:
        rig.close()


def test_tensor_core_kernels_from_given_ptx():
    """A module from PTX bytes (to compare a kernel built from other sources, `bench.py
    --baseline-ptx`): the shipped PTX given as bytes computes the same output bit for bit;
    bytes that are not PTX, or not bytes, are refused with the library's error and the
    running module is untouched."""
    torch = pytest.importorskip("torch")
    from importlib import resources

    from cellcache.cuda.tc import TensorCoreAttention
    from cellcache.errors import CudaError, InvalidArgument

    rig = Rig("bfloat16", 64, 7, seed=11)
    try:
        ids = [int(s) for s in rig.seqs]
        st, view, k_pool, v_pool, q = rig.step(ids, len(ids))
        rows = q.shape[0]
        out = torch.full_like(q, float("nan"))
        rig.run(view, rows, q, k_pool, v_pool, out, 0, decode=True)
        sm = torch.cuda.get_device_properties(0).multi_processor_count
        ptx = resources.files("cellcache").joinpath("ptx/tc_attention.ptx").read_bytes()
        other = TensorCoreAttention("bfloat16", sm, ptx=ptx)
        try:
            alt = torch.full_like(q, float("nan"))
            shipped, rig.tc = rig.tc, other
            try:
                rig.run(view, rows, q, k_pool, v_pool, alt, 0, decode=True)
            finally:
                rig.tc = shipped
            torch.cuda.synchronize()
            assert torch.equal(alt, out)
        finally:
            other.close()
        with pytest.raises(CudaError, match="PTX given for tc_attention"):
            TensorCoreAttention("bfloat16", sm, ptx=b"not ptx at all")
        with pytest.raises(InvalidArgument, match="ptx must be bytes"):
            TensorCoreAttention("bfloat16", sm, ptx="tc_attention.ptx")  # type: ignore[arg-type]
        again = torch.full_like(q, float("nan"))
        rig.run(view, rows, q, k_pool, v_pool, again, 0, decode=True)
        torch.cuda.synchronize()
        assert torch.equal(again, out)
        rig.check(st, view, k_pool, v_pool, q, 0, out=out, what="given PTX")
    finally:
        rig.close()


def test_tensor_core_graph_replays_a_mixed_step():
    """Work list + attention + merge of a 2048-row mixed step captured once, replayed over
    another step of the same padded rows (different runs, lengths and width)."""
    torch = pytest.importorskip("torch")
    G, D, rows = 4, 128, 2048
    rig = Rig("bfloat16", D, G, n_seqs=24, hist=(1, 1500), capacity=80000, max_write=rows, seed=11)
    try:
        rng = rig.rng

        def mixed(width):
            ids, seqs = [], [int(s) for s in rng.permutation(rig.seqs)]
            j = 0
            while len(ids) < width:
                s = seqs[j % len(seqs)]
                n = 1 if j % 3 else int(rng.integers(100, 600))
                if ids and ids[-1] == s:
                    n = 0
                ids += [s] * min(n, width - len(ids))
                j += 1
            return ids

        for decode in (False, True):                     # the table's two choices for d128
            st, view, k_pool, v_pool, q = rig.step(mixed(2000), rows)
            out = torch.empty_like(q)
            rig.tc.reserve(rows, rig.H, N_KV, D, decode=decode)
            for window in (0, WINDOW):                   # eager (and warm-up)
                rig.run(view, rows, q, k_pool, v_pool, out, window, decode=decode)
                rig.check(st, view, k_pool, v_pool, q, window, out=out,
                          what=f"decode={decode} eager w{window}")
            stream = torch.cuda.Stream()
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                rig.run(view, rows, q, k_pool, v_pool, out, 0, decode=decode)
            graph.replay()
            rig.check(st, view, k_pool, v_pool, q, 0, out=out, what=f"decode={decode} replay 1")
            # another step: the pools are the same tensors (fixed capacity), q refilled in place
            st2, view2, k2, v2, q2 = rig.step(mixed(1500), rows)
            assert k2.data_ptr() == k_pool.data_ptr() and view2.paged_pointers() == view.paged_pointers()
            q.copy_(q2)
            out.fill_(float("nan"))
            graph.replay()
            rig.check(st2, view2, k2, v2, q, 0, out=out, what=f"decode={decode} replay 2")
            del graph
    finally:
        rig.close()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_tensor_core_sweep_8bit_kv(dtype, head_dim):
    """The e4m3 variants (8-bit pools, per-kv-head scales) against the float64 reference over
    the values the stored bytes stand for: every group, window, step kind, padding, variant
    and list order, as the 16-bit sweep."""
    pytest.importorskip("torch")
    for gi, group in enumerate(GROUPS):
        hist = (1, 300) if gi % 2 == 0 else (1, 100)
        rig = Rig(dtype, head_dim, group, hist=hist, seed=head_dim * 37 + gi, kv_dtype="float8_e4m3fn")
        try:
            choices = rig.choices()
            assert len(choices) >= 4 and rig.tc.kv8
            for kind, ids, pad in _steps(rig.rng, rig.seqs):
                st, view, k_pool, v_pool, q = rig.step(ids, pad)
                assert k_pool.element_size() == 1
                for window in (0, WINDOW):
                    rig.check(st, view, k_pool, v_pool, q, window, choices=choices,
                              what=f"e4m3 {dtype} d{head_dim} G{group} {kind} pad {pad - len(ids)} w{window}")
        finally:
            rig.close()


def test_tensor_core_8bit_kv_refuses_without_scales():
    """An 8-bit launch without the scales' address is refused before anything runs."""
    pytest.importorskip("torch")
    from cellcache.errors import InvalidArgument

    rig = Rig("bfloat16", 64, 2, seed=3, kv_dtype="float8_e4m3fn")
    try:
        ids = [int(s) for s in rig.seqs]
        st, view, k_pool, v_pool, q = rig.step(ids, len(ids))
        out = rig.torch.full_like(q, 7.0)
        with pytest.raises(InvalidArgument, match="kv_scale"):
            rig.run(view, len(ids), q, k_pool, v_pool, out, 0, kv_scale=0)
        rig.torch.cuda.synchronize()
        assert bool((out == 7.0).all())
    finally:
        rig.close()
