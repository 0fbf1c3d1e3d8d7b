"""Shared-prefix (cascade) attention on the tensor-core kernels: decode rows whose sequences
share leading cells (forks, clones at any point, nested sharing) grouped on the device, the
shared cells read once a group, against the float64 reference over the same paged view and
against the same launch without grouping: groups of every size from one row (no group) to
every row, nested sharing, thresholds, windows (never grouped), padding rows, mixed steps,
8-bit pools, and a captured graph replayed over a step grouped differently.

Nothing here imports cuda-bindings at collection: without it (or a driver, or a device)
every test is skipped by the conftest, never errored.
"""

from __future__ import annotations

import numpy as np
import pytest

from ..helpers_cascade import Families
from .test_cuda_tensor_core import WINDOW, Rig


class Shared:
    """A Rig whose sequences are rebuilt as families that share prefixes."""

    def __init__(self, dtype: str, head_dim: int, group: int, seed: int = 0,
                 kv_dtype: str | None = None, n_seqs: int = 44):
        self.rig = Rig(dtype, head_dim, group, n_seqs=n_seqs, hist=(1, 1), capacity=60000,
                       max_write=1024, seed=seed, kv_dtype=kv_dtype)
        self.t = self.rig.cache.table
        for s in self.rig.seqs:
            self.t.seq_rm(s)
        self.rng = self.rig.rng
        self.fam = Families(self.t, self.rng)

    def new(self, n):
        return self.fam.new(n)

    def forks(self, src, k, own=(1, 60), upto=None):
        return self.fam.forks(src, k, own=own, upto=upto)

    def run(self, ids, pad, cascade, window=0, decode=True):
        """One step; the cascade launch checked against the reference and against the same
        launch without grouping; returns the plan's header of the cascade launch."""
        rig, torch = self.rig, self.rig.torch
        st, view, k_pool, v_pool, q = rig.step(ids, pad)
        base = torch.full_like(q, float("nan"))
        rig.run(view, pad, q, k_pool, v_pool, base, window, decode=decode)
        out = torch.full_like(q, float("nan"))
        rig.run(view, pad, q, k_pool, v_pool, out, window, decode=decode, cascade=cascade, share=True)
        hdr = rig.tc.plan_header()
        rig.check(st, view, k_pool, v_pool, q, window, out=out, what=f"cascade={cascade} w{window}")
        w = len(ids)
        diff = float((out[:w].double() - base[:w].double()).abs().max())
        tol = 3e-2 if q.dtype == torch.bfloat16 else 5e-3
        assert diff <= tol, f"cascade against no grouping: {diff:.3g}"
        return hdr

    def close(self):
        self.rig.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim,group", [(64, 7), (128, 4), (80, 1), (96, 8), (256, 2), (128, 16)])
def test_cascade_group_sizes(dtype, head_dim, group):
    """One root's forks as groups of 1, 2, 3, 17 and every row (with padding rows after
    them): grouped exactly when two or more rows share at least the threshold, and every
    row equal to the reference and to the ungrouped launch."""
    pytest.importorskip("torch")
    sh = Shared(dtype, head_dim, group, seed=head_dim + group)
    try:
        root = sh.new(700)
        kids = sh.forks(root, 40)
        lone = sh.new(400)
        for k in (1, 2, 3, 17, 40):
            ids = [int(lone)] + [int(s) for s in kids[:k]]
            hdr = sh.run(ids, len(ids) + 3, cascade=128)
            assert hdr["grouped"] == (1 if k >= 2 else 0), (k, hdr)
            assert (hdr["shared_units"] > 0) == (k >= 2), (k, hdr)
        # a threshold above what they share: no group
        hdr = sh.run([int(s) for s in kids[:8]], 8, cascade=768)
        assert hdr["grouped"] == 0
    finally:
        sh.close()


@pytest.mark.parametrize("cascade", [128, 512])
def test_cascade_nested_and_interior_clones(cascade):
    """A system prompt shared by all, two documents shared by some, forks of each and a
    clone part-way into a document, unrelated sequences between them; grouping breaks where
    the share falls below the threshold, and a mixed step (prompt chunks between decode rows)
    groups only its decode rows."""
    pytest.importorskip("torch")
    sh = Shared("bfloat16", 128, 4, seed=cascade)
    try:
        s = sh.new(300)
        d1, d2 = sh.forks(s, 2, own=(400, 400))
        f1 = sh.forks(d1, 3)
        f2 = sh.forks(d2, 2)
        fi = sh.forks(d1, 2, upto=650)
        u1, u2 = sh.new(500), sh.new(900)
        ids = [u1, *f1, *fi, d1, *f2, d2, s, u2]
        hdr = sh.run([int(x) for x in ids], len(ids) + 7, cascade=cascade)
        assert hdr["grouped"] == 1
        mixed = [int(u1)] * 37 + [int(x) for x in f1] + [int(u2)] * 50 + [int(x) for x in f2] + [int(d2)]
        hdr = sh.run(mixed, len(mixed) + 2, cascade=cascade, decode=False)
        assert hdr["grouped"] == 1
        # a windowed layer never groups
        sh.run([int(x) for x in ids], len(ids), cascade=cascade, window=WINDOW)
    finally:
        sh.close()


def test_cascade_8bit_pools():
    """Grouping over 8-bit (e4m3) pools: the shared pass runs the e4m3 prefill variant."""
    pytest.importorskip("torch")
    sh = Shared("bfloat16", 128, 4, seed=5, kv_dtype="float8_e4m3fn")
    try:
        root = sh.new(1000)
        kids = sh.forks(root, 24)
        hdr = sh.run([int(x) for x in kids], 32, cascade=256)
        assert hdr["grouped"] == 1
    finally:
        sh.close()


def test_cascade_graph_replays_another_grouping():
    """Share + plan + both passes + merge captured once; replayed over a step of the same
    padded rows whose rows group differently (and one where nothing groups)."""
    torch = pytest.importorskip("torch")
    sh = Shared("bfloat16", 64, 7, seed=9)
    rig = sh.rig
    try:
        a, b = sh.new(900), sh.new(1300)
        fa, fb = sh.forks(a, 20), sh.forks(b, 10)
        lone = [sh.new(int(n)) for n in sh.rng.integers(200, 900, size=6)]
        pad = 48
        first = [int(x) for x in fa + fb]
        st, view, k_pool, v_pool, q = rig.step(first, pad)
        out = torch.empty_like(q)
        rig.run(view, pad, q, k_pool, v_pool, out, 0, decode=True, cascade=128, share=True)   # warm-up
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
            rig.run(view, pad, q, k_pool, v_pool, out, 0, decode=True, cascade=128, share=True)
        graph.replay()
        rig.check(st, view, k_pool, v_pool, q, 0, out=out, what="replay 1")
        assert rig.tc.plan_header()["grouped"] == 1
        mixed_order = [int(x) for x in (fb[:5] + lone[:3] + fa[:7] + lone[3:] + fa[7:12] + fb[5:])]
        for ids in (mixed_order, [int(x) for x in lone + fa[:1]]):
            st2, view2, k2, v2, q2 = rig.step(ids, pad)
            assert view2.paged_pointers() == view.paged_pointers()
            q.copy_(q2)
            out.fill_(float("nan"))
            graph.replay()
            rig.check(st2, view2, k2, v2, q, 0, out=out, what=f"replay over {len(ids)} rows")
            assert rig.tc.plan_header()["grouped"] == (1 if ids is mixed_order else 0)
        del graph
    finally:
        sh.close()


def test_cascade_refuses_a_bad_threshold():
    """cascade must be 0 or a positive multiple of 128: refused before anything is launched."""
    torch = pytest.importorskip("torch")
    from cellcache.errors import InvalidArgument

    sh = Shared("bfloat16", 64, 2, seed=1, n_seqs=4)
    try:
        s = sh.new(10)
        st, view, k_pool, v_pool, q = sh.rig.step([int(s)], 1)
        out = torch.full_like(q, 7.0)
        for bad in (-128, 100):
            with pytest.raises(InvalidArgument, match="cascade"):
                sh.rig.run(view, 1, q, k_pool, v_pool, out, 0, cascade=bad)
        torch.cuda.synchronize()
        assert bool((out == 7.0).all())
    finally:
        sh.close()


def test_plan_kept_for_the_step_layers():
    """``fresh=False``: the later layers of a step reuse the first layer's work list (each
    attention launch puts its counter back); a launch whose plan inputs differ (another
    window, another variant) plans again even so, and every output matches the reference."""
    torch = pytest.importorskip("torch")
    sh = Shared("bfloat16", 128, 4, seed=21)
    rig = sh.rig
    try:
        root = sh.new(900)
        kids = sh.forks(root, 12)
        lone = [sh.new(int(n)) for n in sh.rng.integers(100, 1500, size=5)]
        ids = [int(x) for x in lone[:2] + kids + lone[2:]]
        pad = len(ids) + 4
        st, view, k_pool, v_pool, q = rig.step(ids, pad)
        calls = [dict(window=0, cascade=128, share=True, fresh=True),
                 dict(window=0, cascade=128, fresh=False),
                 dict(window=0, cascade=128, fresh=False),
                 dict(window=WINDOW, fresh=False),            # another window: planned again
                 dict(window=0, cascade=128, fresh=False),     # and again
                 dict(window=0, cascade=128, fresh=False, variant="m1w4k64s3"),
                 dict(window=0, fresh=False)]                 # cascade off: planned again
        for j, c in enumerate(calls):
            window = c.pop("window")
            qj = (q.float() * (1 + 0.1 * j)).to(q.dtype)    # each "layer" its own q and out
            out = torch.full_like(q, float("nan"))
            rig.run(view, pad, qj, k_pool, v_pool, out, window, decode=True, **c)
            rig.check(st, view, k_pool, v_pool, qj, window, out=out, what=f"call {j} {c}")
    finally:
        sh.close()


def _tiny_generator(heads: int, kv_heads: int, capacity: int, max_seqs: int):
    """A 2-layer llama of head_dim 64 (random fp16 weights, vocab 512) on the GPU and a
    Generator over it (no prefix cache, no stop token): (config, generator)."""
    import torch
    import transformers

    from cellcache.generate import Generator

    cfg = transformers.AutoConfig.for_model("llama", hidden_size=64 * heads, intermediate_size=64 * heads,
                                            num_hidden_layers=2, num_attention_heads=heads,
                                            num_key_value_heads=kv_heads, vocab_size=512)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float16).to("cuda").eval()
    return cfg, Generator(model, capacity=capacity, max_batch_tokens=512, max_seqs=max_seqs, eos=[],
                          prefix_cache=False)


def _launches(graph) -> tuple[int, int, int]:
    """(tc_share, tc_attend, tc_merge) launches of one replay of ``graph``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        graph.replay()
        torch.cuda.synchronize()
    names = [e.name for e in p.events() if e.device_type.name == "CUDA"]
    return tuple(sum(n.startswith(k) for n in names) for k in ("tc_share", "tc_attend", "tc_merge"))


def test_runner_replays_the_graph_without_the_shared_pass_where_rows_cannot_group():
    """A runner's decode bucket holds two graphs, captured from one step into one memory
    pool: with the shared-prefix pass (``graphs``: it replays any step) and without it
    (``flat_graphs``: no ``tc_share``, one attention launch a layer); both merge in every
    layer (six rows are far fewer than ``unsplit_rows``: no graph without the merge). A step
    of forks of one 300-token prompt replays the first, and its rows group; a step of
    unrelated sequences (or of forks that share only a first token) replays the second. Each
    step's logits equal an eager forward of the same histories (clones), which groups by the
    same rule. With grouping off the bucket holds one graph."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import cellcache.torch as cct

    cfg, gen = _tiny_generator(4, 2, capacity=8192, max_seqs=32)
    cache, runner = gen.cache, gen.runner
    rng = np.random.default_rng(2)

    def prompt(n, first=None):
        s = cache.seq_new() if first is None else cache.seq_clone(first, upto=1)
        tokens = rng.integers(0, 512, size=n).tolist()
        assert cache.declare_step([s] * n)
        runner.forward(cache.prepare_step(), tokens, [n - 1])
        cache.commit_step()
        return s

    root = prompt(300)
    bos = prompt(1)
    sets = {"forks": [root] * 6, "lone": [prompt(int(n)) for n in rng.integers(260, 400, size=6)],
            "bos": [prompt(300, first=bos) for _ in range(6)]}
    nxt = rng.integers(0, 512, size=6).tolist()
    tc = runner.view.tensor_cores()

    def step(srcs, graph):
        seqs = [cache.seq_clone(s) for s in srcs]
        assert cache.declare_step(seqs)
        pad_to, decode = runner.padding(True, len(seqs), len(seqs), len(seqs)) if graph else (None, False)
        st = cache.prepare_step(stream=runner.stream_handle, pad_to=pad_to)
        out = runner.forward(st, nxt, decode=decode).clone()
        grouped = tc.plan_header()["grouped"]
        kernels = None
        if graph:                                 # each graph's launches, over this step
            kernels = {k: _launches(g[st.pad_to][0]) for k, g in
                       (("graphs", runner.graphs), ("flat", runner.flat_graphs))}
        cache.commit_step()
        for s in seqs:
            cache.seq_rm(s)
        return out, grouped, pad_to, kernels

    eagers = {}
    for name, srcs in sets.items():
        eager, eager_grouped, _, _ = eagers[name] = step(srcs, graph=False)
        replays, flat_replays = runner.replays, runner.flat_replays
        out, grouped, T, kernels = step(srcs, graph=True)
        assert runner.replays == replays + 1 and T in runner.graphs and T in runner.flat_graphs
        assert runner.flat_replays == flat_replays + (name != "forks")
        assert runner.lean_replays == 0 and T not in runner.lean_graphs
        assert grouped == eager_grouped == (1 if name == "forks" else 0), name
        assert float((out - eager).abs().max()) <= 2e-2, name
        layers = cfg.num_hidden_layers
        assert kernels == {"graphs": (1, 2 * layers, layers), "flat": (0, layers, layers)}, kernels
    cascade = cct.CASCADE_MIN_SHARED
    try:
        cct.CASCADE_MIN_SHARED = 0                          # grouping off: one graph a bucket
        runner.drop_graphs()
        out, grouped, T, kernels = step(sets["forks"], graph=True)
        assert runner.flat_graphs[T] is runner.graphs[T] and grouped == 0
        assert kernels["graphs"][:2] == (0, layers), kernels          # no shared-prefix pass
        assert float((out - eagers["forks"][0]).abs().max()) <= 2e-2
    finally:
        cct.CASCADE_MIN_SHARED = cascade
    cache.check_invariants()
    cache.close()


def test_runner_leaves_the_merge_out_where_no_run_can_split():
    """A decode bucket whose steps can have enough runs that none is split along kv (``live``:
    the layers' ``unsplit_rows``, small at 8 kv heads) gets a third graph, without the
    shared-prefix pass and without the merge (``lean_graphs``), captured at its first step of
    at least that many rows that cannot group and replayed by the later ones
    (``lean_replays``, counted in ``flat_replays`` too); a step of the bucket with fewer rows
    replays the graph without the pass (which merges), a step of forks the grouped one. Each
    step's logits equal an eager forward of the same histories (clones) that launches the
    merge in every layer (a Grouping that promises no live rows)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import cellcache.torch as cct

    cfg, gen = _tiny_generator(16, 8, capacity=65536, max_seqs=256)
    cache, runner = gen.cache, gen.runner
    runner.mixed_buckets = []                   # (the references run eagerly at any width)
    tc = runner.view.tensor_cores()
    live = tc.unsplit_rows(8, 64, decode=True)
    T = runner.bucket(live)
    # a device whose grid needs more rows than the test has fails here, never skips: lone
    # sequences and their clones, or forks of one root and theirs, must fit in max_seqs
    assert 0 < live and 2 * live + 1 <= cache.max_seqs and T == 1 << (live - 1).bit_length(), (live, T)
    rng = np.random.default_rng(4)

    def prompt(n):
        s = cache.seq_new()
        assert cache.declare_step([s] * n)
        runner.forward(cache.prepare_step(), rng.integers(0, 512, size=n).tolist(), [n - 1])
        cache.commit_step()
        return s

    lone = [prompt(int(n)) for n in rng.integers(260, 400, size=live)]
    root = prompt(300)
    nxt = rng.integers(0, 512, size=live).tolist()
    layers = cfg.num_hidden_layers

    def counters():
        return runner.replays, runner.flat_replays, runner.lean_replays

    def step(srcs, graph, profiled=False):
        """One decode step of clones of ``srcs``, replayed or eager (with the merge); its
        logits, bucket, whether its rows grouped and (``profiled``) each graph's launches."""
        seqs = [cache.seq_clone(s) for s in srcs]
        n = len(seqs)
        assert cache.declare_step(seqs)
        pad_to, decode = runner.padding(True, n, n, n) if graph else (None, False)
        st = cache.prepare_step(stream=runner.stream_handle, pad_to=pad_to)
        eager = runner.eager
        token = None if graph else cct.GROUPING.set(cct.Grouping(False))
        try:
            out = runner.forward(st, nxt[:n], decode=decode).clone()
        finally:
            if token is not None:
                cct.GROUPING.reset(token)
        assert runner.eager == eager + (not graph)
        grouped = tc.plan_header()["grouped"]
        kernels = None
        if profiled:
            flavors = {"graphs": runner.graphs, "flat": runner.flat_graphs, "lean": runner.lean_graphs}
            kernels = {k: _launches(g[pad_to][0]) for k, g in flavors.items()}
        cache.commit_step()
        for s in seqs:
            cache.seq_rm(s)
        return out, pad_to, grouped, kernels

    ref = step(lone, graph=False)[0]
    before = counters()
    out, pad_to, grouped, kernels = step(lone, graph=True, profiled=True)
    assert pad_to == T and grouped == 0 and runner.flat_graphs[T] is not runner.graphs[T]
    assert counters() == (before[0] + 1, before[1] + 1, before[2] + 1)
    assert float((out - ref).abs().max()) <= 2e-2
    assert kernels == {"graphs": (1, 2 * layers, layers), "flat": (0, layers, layers),
                       "lean": (0, layers, 0)}, kernels
    lean = runner.lean_graphs[T][0]
    before = counters()
    out = step(lone, graph=True)[0]                  # the same graph again, not captured anew
    assert counters() == (before[0] + 1, before[1] + 1, before[2] + 1) and runner.lean_graphs[T][0] is lean
    assert float((out - ref).abs().max()) <= 2e-2
    small = T // 2 + 1                               # the bucket's fewest rows
    if small < live:
        ref = step(lone[:small], graph=False)[0]
        before = counters()
        out, pad_to, _, _ = step(lone[:small], graph=True)
        assert pad_to == T and counters() == (before[0] + 1, before[1] + 1, before[2])
        assert float((out - ref).abs().max()) <= 2e-2
    ref = step([root] * live, graph=False)[0]
    before = counters()
    out, pad_to, grouped, _ = step([root] * live, graph=True)
    assert pad_to == T and grouped == 1 and counters() == (before[0] + 1, before[1], before[2])
    assert float((out - ref).abs().max()) <= 2e-2
    cache.check_invariants()
    cache.close()


def test_flashinfer_reads_the_cascade_levels():
    """cellcache.cascade's two levels, planned by FlashInfer's MultiLevelCascadeAttentionWrapper
    over the same pools (page size 1), give the reference attention (skipped where FlashInfer
    is not installed, as the other FlashInfer tests)."""
    torch = pytest.importorskip("torch")
    flashinfer = pytest.importorskip("flashinfer")
    from cellcache.cascade import cascade_levels

    sh = Shared("bfloat16", 128, 4, seed=33)
    rig = sh.rig
    try:
        root = sh.new(1100)
        kids = sh.forks(root, 9)
        lone = sh.new(700)
        ids = [int(lone)] + [int(x) for x in kids]
        c = rig.cache
        assert c.declare_step(ids)
        st = c.prepare_step()
        view = rig.cct.TorchView(c)
        lv = cascade_levels(view, min_shared=256)
        c.commit_step()
        assert lv.groups == [(1, 9, 1024)]
        k_pool, v_pool, _ = view.layer(0)
        gen = torch.Generator(device="cuda").manual_seed(5)
        k_pool.copy_(torch.randn(k_pool.shape, generator=gen, device="cuda"))
        v_pool.copy_(torch.randn(v_pool.shape, generator=gen, device="cuda"))
        q = torch.randn((len(ids), rig.H, rig.D), generator=gen, device="cuda").bfloat16()
        work = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        wrapper = flashinfer.MultiLevelCascadeAttentionWrapper(2, work, "NHD")
        wrapper.plan(*lv.flashinfer_args(), rig.H, k_pool.shape[1], rig.D, 1, causal=True,
                     q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        out = wrapper.run(q, (k_pool[:, None], v_pool[:, None]))
        rig.check(st, view, k_pool, v_pool, q, 0, out=out, what="FlashInfer cascade")
    finally:
        sh.close()
