"""Growth of the host pools, mapped and by copy: rows double up to capacity, live rows
survive, step buffers never move, mapped pools keep one full view; an allocator failing at any
allocation of a growth raises OutOfMemory, changes nothing and the retry succeeds."""

from __future__ import annotations

import numpy as np
import pytest

from cellcache import HostCellCache, OutOfMemory
from cellcache.host import HostAllocator

from .helpers import FailingAllocator, assert_same, config, run_step, state, write_rows


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
        t = cache.table
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
        assert cache.table.declared == [a] * 5  # the declaration survives
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
