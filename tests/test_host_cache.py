"""SPEC §4-6 on the host backend: growth, buffers, protocol, rollback, registry, config."""

from __future__ import annotations

import numpy as np
import pytest

import cellcache as cc
from cellcache import (
    CacheConfig, HostCellCache, InvalidArgument, InvalidState, LayerConfig, OutOfMemory,
)
from cellcache.host import HostAllocator
from cellcache.reference import ReferenceTable

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
        "pool_ids": [id(cache.buffer(n)) for n in cache.buffer_names if n.startswith("layer")],
    }


def assert_same(a, b):
    assert a["table"] == b["table"]
    assert a["metrics"] == b["metrics"]
    assert a["pool_ids"] == b["pool_ids"]
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


def test_growth_sequence_from_the_spec():
    cache = HostCellCache(config())
    a = cache.seq_new()
    assert cache.rows == 0 and cache.metrics()["allocated_bytes"] == 0
    rows, grew = [], []
    for width in (3, 2, 9, 9, 9):
        step = run_step(cache, [a] * width)
        rows.append(cache.rows)
        grew.append(step.grew)
    assert rows == [4, 8, 16, 32, 32]
    assert grew == [True, True, True, True, False]
    m = cache.metrics()
    assert m["growth_count"] == 3
    assert m["flat_capacity"] == 32 and m["logical_length"] == 32
    assert m["allocated_bytes"] == 2 * 32 * (2 * 4 + 1 * 8) * 4
    assert m["free_cells"] == 0 and m["live_seqs"] == 1
    before = state(cache)
    assert cache.declare_step([a]) is False
    assert_same(state(cache), before)


def test_first_step_allocates_needed_when_larger_than_initial():
    cache = HostCellCache(config(initial_capacity=2))
    a = cache.seq_new()
    run_step(cache, [a] * 7)
    assert cache.rows == 7
    assert cache.buffer("layer_1_k").shape == (7, 1, 8)


def test_rows_are_copied_on_growth_and_step_buffers_never_move():
    cache = HostCellCache(config())
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
        # every live row holds what was written for its (seq, pos), across growths
        t = cache._table
        for layer in range(2):
            for kv in "kv":
                pool = cache.buffer(f"layer_{layer}_{kv}")
                for c in range(cache.used_end):
                    s = t.cell_owners_at(c)[0]
                    np.testing.assert_allclose(pool[c], value(layer, kv, s, t.cell_pos_at(c)))
    assert len(set(pool_ptrs)) == 4     # rows 4 -> 8 -> 16 -> 32: the pools moved each time


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
    with pytest.raises(InvalidArgument, match="width"):
        cache.prepare_step(width="2")
    with pytest.raises(InvalidState, match="no step is declared"):
        cache.prepare_step()
    assert_same(state(cache), before)
    cache.declare_step([a, a])
    before = state(cache)
    with pytest.raises(InvalidState, match="step width 3 differs from the declared step's 2"):
        cache.prepare_step(width=3)
    with pytest.raises(InvalidArgument, match="stream"):
        cache.prepare_step(stream="default")
    assert_same(state(cache), before)
    assert cache.prepare_step(width=2).width == 2


def test_streams_are_accepted_in_every_documented_form():
    cache = HostCellCache(config())
    a = cache.seq_new()

    class Torchish:
        cuda_stream = 0

    class Cupyish:
        ptr = 0

    class Coreish:
        handle = 0

    for stream in (None, 0, Torchish(), Cupyish(), Coreish()):
        run_step(cache, [a], stream=stream)
    with pytest.raises(InvalidArgument, match="negative"):
        cc.cache.stream_handle(-1)


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


def test_clear_keeps_storage():
    cache = HostCellCache(config())
    a = cache.seq_new()
    run_step(cache, [a] * 9)
    pools = [cache.buffer(n) for n in cache.buffer_names if n.startswith("layer")]
    cache.declare_step([a])
    cache.clear()
    assert cache.rows == 9 and cache.used_end == 0 and cache.live_seqs() == []
    assert [cache.buffer(n) for n in cache.buffer_names if n.startswith("layer")] == pools
    with pytest.raises(InvalidState, match="no step is declared"):
        cache.prepare_step()
    a = cache.seq_new()
    step = run_step(cache, [a] * 9)
    assert not step.grew and step.cells.tolist() == list(range(9))


def test_verb_on_declared_sequence_cancels_declaration():
    cache = HostCellCache(config())
    a, b = cache.seq_new(), cache.seq_new()
    run_step(cache, [a, b])
    cache.declare_step([a, b])
    cache.rewind(b, 0)
    with pytest.raises(InvalidState, match="no step is declared"):
        cache.prepare_step()


def test_buffers_by_name():
    cache = HostCellCache(config())
    assert cache.buffer_names == ["cells", "positions", "read_len", "mask_w0", "mask_w2",
                                  "layer_0_k", "layer_0_v", "layer_1_k", "layer_1_v"]
    assert cache.buffer("mask_w2").shape == (1, 1, 9, 32)
    assert cache.buffer("mask_w2").dtype == np.bool_
    assert cache.buffer("cells").dtype == np.int64
    assert cache.buffer("layer_1_v").shape == (0, 1, 8)     # nothing before the first step
    with pytest.raises(InvalidArgument, match="no buffer named 'mask_w1'; buffers are: cells"):
        cache.buffer("mask_w1")


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
    cfg = config(capacity=48, max_write=8, max_seqs=70, initial_capacity=3)
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
            step = cache.prepare_step()
            cells, positions, read_len = ref.place()
            assert step.cells.tolist() == cells and step.positions.tolist() == positions
            assert int(cache.buffer("read_len")[0]) == read_len == step.read_len
            w = len(ids)
            assert cache.buffer("cells")[:w].tolist() == cells
            assert cache.buffer("positions")[:w].tolist() == positions
            for window in cfg.windows:
                expect = np.array(ref.masks(ids, positions, read_len, window), dtype=bool)
                got = cache.buffer(f"mask_w{window}")[0, 0, :w, :read_len]
                np.testing.assert_array_equal(got, expect.reshape(w, read_len))
            cache.commit_step()
        cache.check_invariants()
        assert cache._table.snapshot() == ref.snapshot()


# -- registry ---------------------------------------------------------------------------------

def test_registry_builds_host_and_auto():
    for kind in ("batched-cell", "batched"):
        assert isinstance(cc.build("host", kind, config()), HostCellCache)
    auto = cc.build("auto", "batched", config())
    from cellcache.registry import resolve_backend
    assert auto.backend == resolve_backend("auto")


def test_registry_errors_name_what_exists():
    with pytest.raises(InvalidArgument, match="unknown backend 'tpu'; registered backends: auto, host"):
        cc.build("tpu", "batched", config())
    with pytest.raises(InvalidArgument, match="unknown kind 'paged' for backend 'host'; its kinds: batched-cell, batched"):
        cc.build("host", "paged", config())
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
    (dict(capacity="8"), "capacity='8' is not an int"),
    (dict(layers=[]), "layers is empty"),
    (dict(layers=[(2, 4)]), "layers\\[0\\]=\\(2, 4\\) is not a LayerConfig"),
    (dict(layers="abc"), "not a sequence of LayerConfig"),
    (dict(max_write=0), "max_write=0 is outside \\[1, 32\\]"),
    (dict(max_write=33), "max_write=33 is outside \\[1, 32\\]"),
    (dict(dtype="int8"), "dtype='int8' is not one of float16, bfloat16, float32"),
    (dict(max_seqs=0), "max_seqs=0 is outside"),
    (dict(device=-1), "device=-1 is outside"),
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


def test_initial_capacity_is_clamped():
    assert config(initial_capacity=0).initial_capacity == 1
    assert config(initial_capacity=1000).initial_capacity == 32
    assert config(layers=[LayerConfig(1, 1, 5), LayerConfig(1, 1, 0), LayerConfig(1, 1, 5)]).windows == (0, 5)


def test_cache_rejects_non_config():
    with pytest.raises(InvalidArgument, match="not a CacheConfig"):
        HostCellCache({"capacity": 8})
