"""The cache on the host backend: growth, buffers, padding, the paged view, protocol,
rollback, refusals with "nothing changed", registry and config."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import cellcache as cc
from cellcache import (
    CacheConfig,
    HostCellCache,
    InvalidArgument,
    InvalidState,
    LayerConfig,
    OutOfMemory,
    StepTooLarge,
)
from cellcache.host import HostAllocator
from cellcache.reference import ReferenceTable, mask_rows, paged_view

LAYERS = [LayerConfig(2, 4, 0), LayerConfig(1, 8, 2)]


def config(**kw):
    base = dict(capacity=32, layers=LAYERS, max_write=9, initial_capacity=4, dtype="float32")
    base.update(kw)
    return CacheConfig(**base)


class FailingAllocator(HostAllocator):
    """Fails the allocation numbered ``fail_at`` (0-based, counted from construction)."""

    def __init__(self, fail_at=None):
        self.fail_at = fail_at
        self.calls = 0
        self.live = 0

    def allocate(self, nbytes, what):
        n = self.calls
        self.calls += 1
        if n == self.fail_at:
            raise OutOfMemory(f"injected failure at allocation {n} ({what})")
        self.live += 1
        return super().allocate(nbytes, what)

    def release(self, allocation):
        self.live -= 1


def state(cache):
    """Everything observable: table, pools, step buffers, declaration, metrics."""
    cache.check_invariants()
    return {
        "table": cache._table.snapshot(),
        "metrics": cache.metrics(),
        "buffers": {n: cache.buffer(n).copy() for n in cache.buffer_names},
        "pool_ptrs": [cache.buffer(n).ctypes.data for n in cache.buffer_names if n.startswith("layer")],
        "rows": (cache.rows, cache.sink),
    }


def assert_same(a, b):
    assert a["table"] == b["table"]
    assert a["metrics"] == b["metrics"]
    assert a["pool_ptrs"] == b["pool_ptrs"]
    assert a["rows"] == b["rows"]
    for name in a["buffers"]:
        np.testing.assert_array_equal(a["buffers"][name], b["buffers"][name], err_msg=name)


def run_step(cache, ids, **kw):
    assert cache.declare_step(ids) is True
    step = cache.prepare_step(**kw)
    cache.commit_step()
    return step


def write_rows(cache, step, value_fn):
    for layer in range(len(cache.config.layers)):
        for kv in "kv":
            pool = cache.buffer(f"layer_{layer}_{kv}")
            for c, p, s in zip(step.cells, step.positions, step.seq_ids):
                pool[c] = value_fn(layer, kv, int(s), int(p))


@pytest.mark.parametrize("growth", ["mapped", "copy"])
def test_growth_sequence(growth):
    cache = HostCellCache(config(), allocator=HostAllocator() if growth == "copy" else None)
    a = cache.seq_new()
    assert cache.rows == 0 and cache.metrics()["allocated_bytes"] == 0
    rows, grew = [], []
    for width in (3, 2, 9, 9, 9):
        step = run_step(cache, [a] * width)
        rows.append(cache.rows)
        grew.append(step.grew)
        assert step.rows == cache.rows
    assert rows == [4, 8, 16, 32, 32]
    # mapped pools never move: only the first step reports grew
    assert grew == ([True, True, True, True, False] if growth == "copy"
                    else [True, False, False, False, False])
    m = cache.metrics()
    assert m["growth_count"] == 3 and m["pools_move"] == (growth == "copy")
    assert m["flat_capacity"] == 32 and m["logical_length"] == 32
    assert m["allocated_bytes"] == 2 * 32 * (2 * 4 + 1 * 8) * 4
    assert m["free_cells"] == 0 and m["live_seqs"] == 1
    before = state(cache)
    assert cache.declare_step([a]) is False
    assert_same(state(cache), before)


def test_first_step_allocates_needed_when_larger_than_initial():
    cache = HostCellCache(config(initial_capacity=2), allocator=HostAllocator())
    a = cache.seq_new()
    run_step(cache, [a] * 7)
    assert cache.rows == 7 and cache.sink == 7
    assert cache.buffer("layer_1_k").shape == (8, 1, 8)      # 7 rows and the sink


@pytest.mark.parametrize("growth", ["mapped", "copy"])
def test_live_rows_survive_growth_and_step_buffers_never_move(growth):
    cache = HostCellCache(config(), allocator=HostAllocator() if growth == "copy" else None)
    a, b = cache.seq_new(), cache.seq_new()
    value = lambda layer, kv, s, p: (100 * layer + 10 * (kv == "v") + s + p / 100)  # noqa: E731
    fixed = {n: cache.buffer(n).ctypes.data for n in cache.buffer_names if not n.startswith("layer")}
    pool_ptrs = []
    for ids in ([a, b, a], [b, b], [a] * 9, [b] * 9):
        step = run_step(cache, ids)
        write_rows(cache, step, value)
        pool_ptrs.append(cache.buffer("layer_0_k").ctypes.data)
        for n, ptr in fixed.items():
            assert cache.buffer(n).ctypes.data == ptr, n
        t = cache._table
        for layer in range(2):
            for kv in "kv":
                pool = cache.buffer(f"layer_{layer}_{kv}")
                for c in range(cache.used_end):
                    s = t.cell_owners_at(c)[0]
                    np.testing.assert_allclose(pool[c], value(layer, kv, s, t.cell_pos_at(c)))
    # rows 4 -> 8 -> 16 -> 32: copy growth moved the pools each time, mapped pools never
    assert len(set(pool_ptrs)) == (4 if growth == "copy" else 1)


def test_mapped_pools_have_fixed_full_views():
    cache = HostCellCache(config(capacity=4000, max_write=64))
    k = cache.buffer("layer_0_k")
    assert k.shape == (4001, 2, 4) and cache.sink == 4000      # every cell row and the sink
    a = cache.seq_new()
    step = run_step(cache, [a] * 3, pad_to=5)
    assert cache.buffer("layer_0_k").ctypes.data == k.ctypes.data
    assert step.cells.tolist() == [0, 1, 2]
    assert cache.buffer("cells")[:5].tolist() == [0, 1, 2, 4000, 4000]


def test_injected_failure_at_every_allocation_of_a_growth():
    # 2 layers x (K, V) = 4 allocations per growth; the first growth is allocations 4..7.
    for k in range(4):
        alloc = FailingAllocator()
        cache = HostCellCache(config(), allocator=alloc)
        a = cache.seq_new()
        step = run_step(cache, [a] * 3)
        write_rows(cache, step, lambda layer, kv, s, p: p + 1)
        assert cache.declare_step([a] * 5) is True
        alloc.fail_at = alloc.calls + k
        before = state(cache)
        live_before = alloc.live
        with pytest.raises(OutOfMemory, match=f"from 4 to 8 rows failed \\(injected failure at "
                                              f"allocation {alloc.fail_at} .*nothing changed"):
            cache.prepare_step()
        assert_same(state(cache), before)
        assert alloc.live == live_before        # what the attempt allocated was released
        assert cache._table.declared == [a] * 5  # the declaration survives
        step = cache.prepare_step()             # the retry succeeds
        cache.commit_step()
        assert step.grew and cache.rows == 8 and cache.metrics()["growth_count"] == 1
        assert cache.buffer("layer_0_k")[:3, 0, 0].tolist() == [1, 2, 3]


def test_injected_failure_at_the_first_allocation():
    for k in range(4):
        alloc = FailingAllocator(fail_at=k)
        cache = HostCellCache(config(), allocator=alloc)
        a = cache.seq_new()
        cache.declare_step([a, a])
        before = state(cache)
        with pytest.raises(OutOfMemory):
            cache.prepare_step()
        assert_same(state(cache), before)
        assert cache.rows == 0 and alloc.live == 0
        assert cache.prepare_step().grew


def test_failed_growth_does_not_commit_the_previous_step(monkeypatch):
    """The implicit commit of an uncommitted step waits until growth cannot fail."""
    alloc = FailingAllocator()
    cache = HostCellCache(config(), allocator=alloc)
    commits = []
    monkeypatch.setattr(cache, "_commit", lambda stream: commits.append(stream))
    a = cache.seq_new()
    cache.declare_step([a] * 3)
    first = cache.prepare_step()                       # prepared, not committed
    cache.declare_step([a] * 5)                        # needs a growth 4 -> 8
    alloc.fail_at = alloc.calls
    with pytest.raises(OutOfMemory, match="nothing changed"):
        cache.prepare_step()
    assert commits == [] and cache.prepared_step is first
    cache.prepare_step()                               # succeeds: commits the first, then grows
    assert commits == [0]


def test_failure_after_placement_rolls_back(monkeypatch):
    cache = HostCellCache(config(initial_capacity=32))     # no growth: only the claims change
    a, b = cache.seq_new(), cache.seq_new()
    run_step(cache, [a, b, a])
    cache.seq_rm(b)
    cache.declare_step([a, a])
    before = state(cache)

    def broken(*args, **kw):
        raise RuntimeError("mask fill failed")

    monkeypatch.setattr(cache, "_write_step", broken)
    with pytest.raises(RuntimeError, match="mask fill failed"):
        cache.prepare_step()
    assert_same(state(cache), before)
    monkeypatch.undo()
    step = cache.prepare_step()
    assert step.cells.tolist() == [1, 3] and step.positions.tolist() == [2, 3]


def test_prepare_step_checks_in_order():
    cache = HostCellCache(config())
    a = cache.seq_new()
    before = state(cache)
    with pytest.raises(InvalidArgument, match=r"step width 0 is outside \[1, max_write=9\]"):
        cache.prepare_step(width=0)        # width is checked before the declaration
    with pytest.raises(InvalidArgument, match="step width 10"):
        cache.prepare_step(width=10)
    with pytest.raises(InvalidArgument, match="width of type str"):
        cache.prepare_step(width="2")
    with pytest.raises(InvalidState, match="no step is declared"):
        cache.prepare_step()
    assert_same(state(cache), before)
    cache.declare_step([a, a])
    before = state(cache)
    with pytest.raises(InvalidState, match="step width 3 differs from the declared step's 2"):
        cache.prepare_step(width=3)
    for bad, match in [("default", "stream of type str"), (1.5, "stream of type float"),
                       ("7", "stream of type str"), (float("inf"), "stream of type float"),
                       (-1, "stream handle -1 is outside"), (2**64, "is outside \\[0, 2\\*\\*64\\)"),
                       (True, "stream of type bool")]:
        with pytest.raises(InvalidArgument, match=match):
            cache.prepare_step(stream=bad)
    for pad, match in [(1, "pad_to=1 is outside \\[width=2, max_write=9\\]"),
                       (10, "pad_to=10 is outside"), (0, "pad_to=0 is outside"),
                       (2.0, "pad_to of type float")]:
        with pytest.raises(InvalidArgument, match=match):
            cache.prepare_step(pad_to=pad)
    assert_same(state(cache), before)
    assert cache.prepare_step(width=2).width == 2


def test_caller_code_runs_before_the_step_is_read():
    """A stream whose property re-declares: the step prepared is the one declared when the
    call acts, consistently (width, growth and placement agree)."""
    cache = HostCellCache(config(initial_capacity=2))
    a, b = cache.seq_new(), cache.seq_new()
    cache.declare_step([a])

    class Sneaky:
        @property
        def cuda_stream(self):
            cache.declare_step([b] * 8)
            return 0

    step = cache.prepare_step(stream=Sneaky())
    assert step.width == 8 and step.seq_ids.tolist() == [b] * 8
    assert cache.rows >= cache.used_end == 8
    cache.check_invariants()
    cache.commit_step()
    step = run_step(cache, [a] * 9)            # later growth still works
    assert cache.rows >= cache.used_end == 17

    class SneakyWidth:
        def __index__(self):
            cache.declare_step([a] * 3)
            return 3

    cache.declare_step([a])
    assert cache.prepare_step(width=SneakyWidth()).width == 3
    cache.check_invariants()


def test_streams_are_accepted_in_every_documented_form():
    cache = HostCellCache(config())
    a = cache.seq_new()

    class Torchish:
        cuda_stream = 0

    class Cupyish:
        ptr = 0

    class Coreish:
        handle = 0

    for stream in (None, 0, Torchish(), Cupyish(), Coreish(), np.uint64(0)):
        run_step(cache, [a], stream=stream)


def test_commit_without_step():
    cache = HostCellCache(config())
    with pytest.raises(InvalidState, match="no step is prepared"):
        cache.commit_step()
    a = cache.seq_new()
    run_step(cache, [a])
    before = state(cache)
    with pytest.raises(InvalidState, match="no step is prepared"):
        cache.commit_step()
    assert_same(state(cache), before)


def test_clear_commits_a_prepared_step_and_keeps_storage(monkeypatch):
    cache = HostCellCache(config())
    commits = []
    monkeypatch.setattr(cache, "_commit", lambda stream: commits.append(stream))
    a = cache.seq_new()
    run_step(cache, [a] * 9)
    commits.clear()
    cache.declare_step([a])
    cache.prepare_step()
    pools = [cache.buffer(n) for n in cache.buffer_names if n.startswith("layer")]
    cache.clear()
    assert commits == [0]                      # its forward stays ordered before what follows
    assert cache.rows == 18 and cache.used_end == 0 and cache.live_seqs() == []
    assert all(cache.buffer(n) is p for n, p in zip(
        [n for n in cache.buffer_names if n.startswith("layer")], pools))
    with pytest.raises(InvalidState, match="no step is prepared"):
        cache.commit_step()
    a = cache.seq_new()
    step = run_step(cache, [a] * 9)
    assert not step.grew and step.cells.tolist() == list(range(9))


def test_stale_regions_are_left_as_they_were():
    cache = HostCellCache(config(capacity=16, max_write=6, initial_capacity=16))
    a, b = cache.seq_new(), cache.seq_new()
    run_step(cache, [a, a, b, b, a])
    cells = cache.buffer("cells").copy()
    mask = cache.buffer("mask_w0").copy()
    cache.seq_rm(b)
    cache.rewind(a, 1)                    # read_len falls to 1
    step = run_step(cache, [a])
    assert step.read_len == 2 and step.cells.tolist() == [1]
    assert cache.buffer("cells")[1:5].tolist() == cells[1:5].tolist()
    new = cache.buffer("mask_w0")[0, 0]
    assert new[0, :2].tolist() == [True, True]
    np.testing.assert_array_equal(new[0, 2:], mask[0, 0, 0, 2:])   # columns past read_len
    np.testing.assert_array_equal(new[1:], mask[0, 0, 1:])          # rows past width


@pytest.mark.parametrize("fmt", ["bool", "bits"])
def test_padded_step(fmt):
    """Padding rows: cells name the sink, positions and mask rows mirror row 0, `width`
    holds the real width; the sink is no mask column and no entry of a real request."""
    cache = HostCellCache(config(capacity=24, max_write=8, initial_capacity=24, paged=True,
                                 mask_format=fmt))
    a, b = cache.seq_new(), cache.seq_new()
    run_step(cache, [a, a, b])
    step = run_step(cache, [b, a, b], pad_to=7)
    assert (step.width, step.pad_to, step.padded, step.n_runs, step.n_requests) == (3, 7, 4, 3, 7)
    sink = cache.sink
    assert sink == 24
    assert cache.buffer("cells")[:7].tolist() == step.cells.tolist() + [sink] * 4
    assert cache.buffer("positions")[:7].tolist() == [1, 2, 2, 1, 1, 1, 1]
    assert int(cache.buffer("width")[0]) == 3 and int(cache.buffer("read_len")[0]) == 6
    for w in cache.config.windows:
        m = cache.buffer(f"mask_w{w}")
        rows = m[0, 0, :7, :6] if fmt == "bool" else np.unpackbits(m[:7], axis=1, bitorder="little")[:, :6]
        for r in range(3, 7):
            assert rows[r].tolist() == rows[0].tolist()
    qo, kv = step.qo_indptr.tolist(), step.kv_indptr.tolist()
    assert qo == [0, 1, 2, 3, 4, 5, 6, 7]
    indices = cache.buffer("kv_indices")
    real = indices[:kv[3]].tolist()
    assert sink not in real and indices[kv[3]:kv[7]].tolist() == [sink] * 4


def test_forward_of_padded_steps_matches_unpadded():
    """The reference consumer run padded (NaN K/V written at the sink) gives, on the real
    rows, exactly what the same session gives unpadded, and no live row changes."""
    from cellcache import attention
    from cellcache.session import Session, SessionConfig

    results = []
    for buckets in (None, [4, 8]):
        cfg = config(capacity=96, max_write=8, max_seqs=12, paged=True)
        cache = HostCellCache(cfg)
        s = Session(cache, attention.reference_forward,
                    SessionConfig(n_heads=4, max_len=40, prompt=(3, 12), buckets=buckets), seed=5)
        results.append(s.run(60))
    assert results[0]["mismatches"] == results[1]["mismatches"] == 0
    assert results[1]["per_bucket"] and set(results[1]["per_bucket"]) <= {4, 8}
    assert results[0]["max_error"] == results[1]["max_error"]


def test_verb_on_declared_sequence_cancels_declaration():
    cache = HostCellCache(config())
    a, b = cache.seq_new(), cache.seq_new()
    run_step(cache, [a, b])
    cache.declare_step([a, b])
    cache.rewind(b, 0)
    with pytest.raises(InvalidState, match="no step is declared"):
        cache.prepare_step()


def test_buffers_by_name_and_layers():
    cache = HostCellCache(config(), allocator=HostAllocator())
    assert cache.buffer_names == ["cells", "positions", "read_len", "width", "mask_w0", "mask_w2",
                                  "layer_0_k", "layer_0_v", "layer_1_k", "layer_1_v"]
    assert cache.buffer("mask_w2").shape == (1, 1, 9, 32)
    assert cache.buffer("mask_w2").dtype == np.bool_
    assert cache.buffer("cells").dtype == np.int64
    assert cache.buffer("layer_1_v").shape == (0, 1, 8)     # nothing before the first step
    lay = cache.layer(1)
    assert lay.window == 2 and lay.mask is cache.buffer("mask_w2") and lay.k is cache.buffer("layer_1_k")
    before = state(cache)
    for bad, match in [("mask_w1", "no buffer named 'mask_w1'; buffers are: cells"),
                       (3, "no buffer named of type int")]:
        with pytest.raises(InvalidArgument, match=match):
            cache.buffer(bad)
    for bad, match in [(2, "layer=2 is outside \\[0, 1\\]"), ("0", "layer of type str")]:
        with pytest.raises(InvalidArgument, match=match):
            cache.layer(bad)
    assert_same(state(cache), before)
    bits = HostCellCache(config(mask_format="bits"))
    assert bits.buffer("mask_w0").shape == (9, 4) and bits.buffer("mask_w0").dtype == np.uint8
    none = HostCellCache(config(mask_format="none", paged=True))
    assert "mask_w0" not in none.buffer_names and none.layer(0).mask is None
    assert none.buffer("kv_indices").shape == (none.config.max_kv + 9,)
    assert none.buffer("kv_last_page_len").tolist() == [1] * 9


@pytest.mark.parametrize("dtype,np_name", [("float16", "float16"), ("bfloat16", "bfloat16"),
                                           ("float32", "float32")])
def test_pool_dtypes(dtype, np_name):
    cache = HostCellCache(config(dtype=dtype))
    a = cache.seq_new()
    run_step(cache, [a])
    assert cache.buffer("layer_0_k").dtype.name == np_name
    assert cache.metrics()["allocated_bytes"] == 2 * 4 * 16 * cache.buffer("layer_0_k").itemsize


def test_host_cache_matches_the_reference_over_a_random_session():
    rng = np.random.default_rng(7)
    cfg = config(capacity=48, max_write=8, max_seqs=70, initial_capacity=3, paged=True)
    cache = HostCellCache(cfg)
    ref = ReferenceTable(48, 70, 8)
    for _ in range(300):
        r = rng.random()
        live = ref.live_seqs()
        if r < 0.15 or not live:
            assert cache.seq_new() == ref.seq_new()
        elif r < 0.25:
            s = int(rng.choice(live))
            upto = int(rng.integers(0, ref.pos(s) + 2))
            assert cache.seq_clone(s, upto) == ref.seq_clone(s, upto)
        elif r < 0.35:
            s = int(rng.choice(live))
            assert cache.seq_rm(s) == ref.seq_rm(s)
        elif r < 0.45:
            s = int(rng.choice(live))
            p = int(rng.integers(0, ref.pos(s) + 1))
            assert cache.rewind(s, p) == ref.rewind(s, p)
        else:
            ids = [int(x) for x in rng.choice(live, size=int(rng.integers(1, 9)))]
            ok = cache.declare_step(ids)
            assert ok == ref.declare_step(ids)
            if not ok:
                continue
            w = len(ids)
            pad = int(rng.integers(w, 9))
            step = cache.prepare_step(pad_to=pad)
            cells, positions, read_len = ref.place()
            assert step.cells.tolist() == cells and step.positions.tolist() == positions
            assert int(cache.buffer("read_len")[0]) == read_len == step.read_len
            assert cache.buffer("cells")[:w].tolist() == cells
            assert cache.buffer("positions")[:w].tolist() == positions
            for window in cfg.windows:
                expect = np.array(mask_rows(ref.cell_pos, ref.cell_owners, ids, positions,
                                            read_len, window), dtype=bool)
                got = cache.buffer(f"mask_w{window}")[0, 0, :w, :read_len]
                np.testing.assert_array_equal(got, expect.reshape(w, read_len))
            qo, kv, indices, runs = paged_view(ref.cell_pos, ref.cell_owners, ids, positions,
                                               pad, cache.sink)
            assert step.n_runs == runs and step.qo_indptr.tolist() == qo[:runs + pad - w + 1]
            assert cache.buffer("qo_indptr")[:pad + 1].tolist() == qo
            assert cache.buffer("kv_indptr")[:pad + 1].tolist() == kv
            assert cache.buffer("kv_indices")[:len(indices)].tolist() == indices
            cache.commit_step()
        cache.check_invariants()
        assert cache._table.snapshot() == ref.snapshot()


def test_paged_view_too_large_is_refused_at_declare():
    cache = HostCellCache(config(capacity=32, max_write=8, paged=True, max_kv=10))
    a, b = cache.seq_new(), cache.seq_new()
    run_step(cache, [a] * 6)
    before = state(cache)
    # a's run ends at position 7 (8 entries), b's at 2 (3 entries): 11 > 10
    with pytest.raises(StepTooLarge, match="need 11 entries; the paged view holds max_kv=10"):
        cache.declare_step([a, a, b, b, b])
    assert_same(state(cache), before)
    assert cache._table.declared is None
    assert isinstance(StepTooLarge("x"), InvalidArgument)
    assert cache.declare_step([a, a, b]) is True           # 8 + 1 entries fit


# -- refusals of the cache object itself ---------------------------------------------------------

def test_copying_a_cache_is_refused():
    cache = HostCellCache(config())
    a = cache.seq_new()
    run_step(cache, [a, a])
    before = state(cache)
    for attempt in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(InvalidState, match="cannot be"):
            attempt(cache)
    assert_same(state(cache), before)


def test_bad_allocator_is_refused_at_construction():
    with pytest.raises(InvalidArgument, match="allocator of type int has no allocate"):
        HostCellCache(config(), allocator=5)


def test_step_buffers_too_large_for_memory_raise_out_of_memory():
    with pytest.raises(OutOfMemory, match="could not"):
        HostCellCache(CacheConfig(capacity=1 << 26, layers=[LayerConfig(1, 1)], max_write=1 << 26,
                                  initial_capacity=1))


# -- registry ---------------------------------------------------------------------------------

def test_registry_builds_host_and_auto():
    for kind in ("batched-cell", "batched"):
        assert isinstance(cc.build("host", kind, config()), HostCellCache)
    auto = cc.build("auto", "batched", config())
    from cellcache.registry import resolve_backend
    assert auto.backend == resolve_backend("auto")


def test_registry_errors_name_what_exists():
    with pytest.raises(InvalidArgument, match="unknown backend 'tpu'; registered backends: auto, host, cuda"):
        cc.build("tpu", "batched", config())
    with pytest.raises(InvalidArgument,
                       match="unknown kind 'paged' for backend 'host'; its kinds: batched-cell, batched"):
        cc.build("host", "paged", config())
    with pytest.raises(InvalidArgument, match="kind of type list is not a non-empty string"):
        cc.build("host", ["batched"], config())
    with pytest.raises(InvalidArgument, match="backend of type NoneType"):
        cc.build(None, "batched", config())
    with pytest.raises(InvalidArgument, match="already registered; registered: host: batched-cell, batched"):
        cc.register_builder("host", "batched", HostCellCache)
    with pytest.raises(InvalidArgument, match="reserved"):
        cc.register_builder("auto", "x", HostCellCache)
    with pytest.raises(InvalidArgument, match="not callable"):
        cc.register_builder("mine", "x", 3)
    from cellcache.registry import registered
    assert "mine" not in registered()


def test_register_new_builder(monkeypatch):
    from cellcache import registry
    monkeypatch.setattr(registry, "_BUILDERS", dict(registry._BUILDERS))
    cc.register_builder("host", "custom", lambda cfg: ("built", cfg.capacity))
    assert cc.build("host", "custom", config()) == ("built", 32)


# -- config -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,match", [
    (dict(capacity=0), "capacity=0 is outside"),
    (dict(capacity="8"), "capacity of type str is not an int"),
    (dict(layers=[]), "layers is empty"),
    (dict(layers=[(2, 4)]), "layers\\[0\\]=\\(2, 4\\) is not a LayerConfig"),
    (dict(layers="abc"), "layers of type str is not a sequence of LayerConfig"),
    (dict(max_write=0), "max_write=0 is outside \\[1, 32\\]"),
    (dict(max_write=33), "max_write=33 is outside \\[1, 32\\]"),
    (dict(dtype="int8"), "dtype='int8' is not one of float16, bfloat16, float32"),
    (dict(dtype=np.int8), "is not one of float16, bfloat16, float32"),
    (dict(max_seqs=0), "max_seqs=0 is outside"),
    (dict(device=-1), "device=-1 is outside"),
    (dict(paged=1), "paged of type int is not a bool"),
    (dict(max_kv=0), "max_kv=0 is outside"),
    (dict(max_kv=2**31), "max_kv=2147483648 is outside"),
    (dict(mask_format="dense"), "mask_format='dense' is not one of bool, bits, none"),
    # the paged view's indices are int32: the sink (= capacity) and max_kv + max_write fit it
    (dict(capacity=2**31, paged=True), r"capacity=2147483648 is outside \[1, 2\*\*31 - 1\] with "
                                       r"paged=True \(the paged view's cell indices are int32\)"),
    (dict(capacity=2**40, paged=True), "capacity=1099511627776 is outside"),
    (dict(capacity=2**31 - 1, max_write=2**31 - 1, paged=True),
     r"max_write=2147483647 is outside \[1, 2\*\*31 - 2\] with paged=True"),
    (dict(paged=True, max_kv=2**31 - 9), r"max_kv=2147483639 is outside \[1, 2147483638\]"),
    (dict(paged=True, max_kv=2**64), "max_kv=18446744073709551616 is outside"),
])
def test_config_errors(kw, match):
    with pytest.raises(InvalidArgument, match=match):
        config(**kw)


@pytest.mark.parametrize("kw,match", [
    (dict(n_kv_heads=0, head_dim=4), "n_kv_heads=0"),
    (dict(n_kv_heads=1, head_dim=0), "head_dim=0"),
    (dict(n_kv_heads=1, head_dim=4, window=-1), "window=-1"),
])
def test_layer_config_errors(kw, match):
    with pytest.raises(InvalidArgument, match=match):
        LayerConfig(**kw)


def test_config_normalises_what_it_is_given():
    assert config(initial_capacity=0).initial_capacity == 1
    assert config(initial_capacity=1000).initial_capacity == 32
    assert config(layers=[LayerConfig(1, 1, 5), LayerConfig(1, 1, 0), LayerConfig(1, 1, 5)]).windows == (0, 5)
    a, b = config(dtype=np.dtype("float16")), config(dtype="float16")
    assert a == b and hash(a) == hash(b) and a.dtype == "float16"
    assert config(paged=True).max_kv == 4 * 32 + 9 and config(paged=True, max_kv=7).kv_entries == 7


def test_config_limits_of_the_paged_view():
    big = config(capacity=2**31 - 1, paged=True)
    assert big.capacity == 2**31 - 1 and big.max_kv == 2**31 - 1 - 9
    assert config(capacity=2**35).capacity == 2**35          # without the paged view: fine


def test_cache_rejects_non_config():
    with pytest.raises(InvalidArgument, match="config of type dict is not a CacheConfig"):
        HostCellCache({"capacity": 8})
