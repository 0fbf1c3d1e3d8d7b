"""Copy growth is all or nothing, whatever a user allocator does (issue 15, item 8).

Every allocation of a growth is made and checked before the pools switch; a refusal gives all
of them back and changes nothing (table, pool identity and contents, rows, sink, buffers), and
the same step then succeeds. A ``release`` of the old pools that raises after the switch
cannot undo a growth that happened: the cache is consistent with the new pools, the failure is
a PoolReleaseWarning, and the allocation is given back again at the next growth. The live
pools are never given back by a failed growth (on CUDA that would free memory in use).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from cellcache import HostCellCache, InvalidArgument, OutOfMemory
from cellcache.host import HostAllocator
from cellcache.pools import CopyPools, PoolReleaseWarning

from .helpers import assert_same, config, run_step, state, write_rows

ALLOCATIONS_PER_GROWTH = 4          # config(): 2 layers x (K, V)


class Allocator(HostAllocator):
    """Counts live allocations by identity; ``bad`` maps an allocation number (0-based) to
    what to return instead, ``fail_release`` makes release raise for the allocations it
    names (by number)."""

    def __init__(self):
        self.calls = 0
        self.numbers: dict[int, int] = {}         # id(allocation) -> its number
        self.live: dict[int, object] = {}
        self.bad: dict[int, object] = {}
        self.fail_at: int | None = None
        self.fail_release: set[int] = set()
        self.released: list[int] = []

    def allocate(self, nbytes, what):
        n = self.calls
        self.calls += 1
        if n == self.fail_at:
            raise OutOfMemory(f"injected failure at allocation {n} ({what})")
        maker = self.bad.get(n)
        allocation = maker(nbytes) if maker is not None else super().allocate(nbytes, what)
        self.numbers[id(allocation)] = n
        self.live[n] = allocation
        return allocation

    def release(self, allocation):
        n = self.numbers[id(allocation)]
        if n in self.fail_release:
            raise RuntimeError(f"injected release failure of allocation {n}")
        assert n in self.live, f"allocation {n} released twice"
        del self.live[n]
        self.released.append(n)


def grown_cache(alloc):
    """A cache with copy pools of 4 rows holding 3 written rows, and a declared step of 5
    tokens that needs a growth 4 -> 8."""
    cache = HostCellCache(config(), allocator=alloc)
    a = cache.seq_new()
    step = run_step(cache, [a] * 3)
    write_rows(cache, step, lambda layer, kv, s, p: p + 1)
    assert cache.declare_step([a] * 5) is True
    return cache, a


BAD = {
    "too-small": lambda n: np.zeros(n - 1, np.uint8),
    "2-D": lambda n: np.zeros((n, 1), np.uint8),
    "float32": lambda n: np.zeros(n // 4, np.float32),
    "int8": lambda n: np.zeros(n, np.int8),
    "read-only": lambda n: np.frombuffer(bytes(n), np.uint8),
    "strided": lambda n: np.zeros(2 * n, np.uint8)[::2],
    "bytearray": lambda n: bytearray(n),
    "None": lambda n: None,
}


@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
@pytest.mark.parametrize("k", range(ALLOCATIONS_PER_GROWTH))
def test_an_allocation_of_the_wrong_shape_or_dtype_changes_nothing(bad, k):
    alloc = Allocator()
    cache, a = grown_cache(alloc)
    alloc.bad = {alloc.calls + k: BAD[bad]}
    before = state(cache)
    live_before = dict(alloc.live)
    with pytest.raises(InvalidArgument, match=r"growing the pools from 4 to 8 rows failed: the "
                                              r"allocator returned .* for pool layer_\d_[kv]; it must "
                                              r"return a writable contiguous 1-D uint8 array.*nothing "
                                              r"changed"):
        cache.prepare_step()
    assert_same(state(cache), before)
    assert alloc.live == live_before                 # the attempt gave back all it took
    assert cache.table.declared == [a] * 5
    step = cache.prepare_step()                      # the same step, retried, succeeds
    cache.commit_step()
    assert step.grew and cache.rows == 8 and cache.sink == 8
    assert cache.buffer("layer_1_v")[:3, 0, 0].tolist() == [1, 2, 3]


def test_a_larger_allocation_is_used_for_its_leading_bytes():
    alloc = Allocator()
    cache, a = grown_cache(alloc)
    alloc.bad = {alloc.calls + k: (lambda n: np.zeros(n + 100, np.uint8))
                 for k in range(ALLOCATIONS_PER_GROWTH)}
    cache.prepare_step()
    cache.commit_step()
    assert cache.buffer("layer_0_k").shape == (9, 2, 4) and cache.sink == 8


@pytest.mark.parametrize("k", range(ALLOCATIONS_PER_GROWTH))
def test_allocate_raising_on_the_kth_allocation_changes_nothing(k):
    alloc = Allocator()
    cache, a = grown_cache(alloc)
    alloc.fail_at = alloc.calls + k
    before = state(cache)
    live_before = dict(alloc.live)
    with pytest.raises(OutOfMemory, match="from 4 to 8 rows failed .*nothing changed"):
        cache.prepare_step()
    assert_same(state(cache), before)
    assert alloc.live == live_before
    cache.prepare_step()
    cache.commit_step()
    assert cache.rows == 8 and cache.buffer("layer_0_k")[:3, 0, 0].tolist() == [1, 2, 3]


def test_release_raising_after_the_switch_keeps_the_growth_and_warns():
    alloc = Allocator()
    cache, a = grown_cache(alloc)
    old = set(alloc.live)                            # the 4-row pools, live now
    alloc.fail_release = set(old)
    old_ptrs = state(cache)["pool_ptrs"]
    with pytest.warns(PoolReleaseWarning, match="injected release failure"):
        step = cache.prepare_step()
    cache.commit_step()
    # the growth happened, and everything agrees with it
    assert step.grew and step.rows == 8 and cache.rows == 8 and cache.sink == 8
    assert cache.metrics()["growth_count"] == 1 and cache.metrics()["flat_capacity"] == 8
    for name in cache.buffer_names:
        if name.startswith("layer_"):
            assert cache.buffer(name).shape[0] == 9, name           # 8 rows and the sink
    assert not set(state(cache)["pool_ptrs"]) & set(old_ptrs)       # the views moved
    assert cache.buffer("layer_0_k")[:3, 0, 0].tolist() == [1, 2, 3]  # live rows copied
    assert cache.buffer("cells")[:5].tolist() == step.cells.tolist()
    assert len(cache._pools.unreleased) == 4
    assert old <= set(alloc.live)                                   # not given back yet
    cache.check_invariants()
    # the next growth gives them back once release works again
    alloc.fail_release = set()
    run_step(cache, [a] * 8)
    assert cache.rows == 16 and cache._pools.unreleased == []
    assert not old & set(alloc.live)
    assert len(alloc.live) == ALLOCATIONS_PER_GROWTH                 # only the 16-row pools


def test_release_failing_again_is_retried_at_every_growth():
    alloc = Allocator()
    cache, a = grown_cache(alloc)
    alloc.fail_release = set(alloc.live)
    with pytest.warns(PoolReleaseWarning):
        cache.prepare_step()
    cache.commit_step()
    with pytest.warns(PoolReleaseWarning):           # still failing: kept again, not lost
        run_step(cache, [a] * 8)
    assert cache.rows == 16 and len(cache._pools.unreleased) == 4
    assert len(alloc.live) == 3 * ALLOCATIONS_PER_GROWTH - 4      # the 8-row pools went back


def test_a_failing_release_while_unwinding_keeps_the_first_error():
    """allocate fails at the last allocation and release fails for one given back: the
    OutOfMemory is what the caller sees, the release failure a warning, nothing changed."""
    alloc = Allocator()
    cache, a = grown_cache(alloc)
    first_new = alloc.calls
    alloc.fail_at = first_new + ALLOCATIONS_PER_GROWTH - 1
    alloc.fail_release = {first_new}
    before = state(cache)
    with pytest.warns(PoolReleaseWarning), pytest.raises(OutOfMemory, match="injected failure"):
        cache.prepare_step()
    assert_same(state(cache), before)
    alloc.fail_release = set()
    cache.prepare_step()
    cache.commit_step()
    assert cache.rows == 8


def test_an_interrupt_after_the_switch_leaves_a_consistent_cache(monkeypatch):
    """Even a KeyboardInterrupt inside the retire (after the switch) cannot leave rows and
    views disagreeing, nor give the new (live) pools back."""
    alloc = Allocator()
    cache, a = grown_cache(alloc)
    pools = cache._pools

    def interrupted(allocation, stream):
        raise KeyboardInterrupt

    monkeypatch.setattr(pools, "_retire", interrupted)
    table_before = cache.table.snapshot()
    with pytest.raises(KeyboardInterrupt):
        cache.prepare_step()
    assert cache.rows == 8 and cache.sink == 8
    assert len(alloc.live) == 2 * ALLOCATIONS_PER_GROWTH            # the new pools stay live
    assert len(pools.unreleased) == ALLOCATIONS_PER_GROWTH           # the old kept for later
    for (i, kv), allocation in pools.allocations.items():
        view = cache.buffer(f"layer_{i}_{kv}")
        assert view.shape[0] == 9 and np.shares_memory(view, allocation)
    assert cache.table.snapshot() == table_before                  # nothing placed
    monkeypatch.undo()
    step = cache.prepare_step()                                     # the retry succeeds
    cache.commit_step()
    assert not step.grew and cache.buffer("layer_0_k")[:3, 0, 0].tolist() == [1, 2, 3]


# -- the same machinery as the CUDA backend drives it (device copies queued on a stream) -----

class FakeDevice:
    """Allocations are ints (addresses); copies and retires are logged; either can fail."""

    def __init__(self):
        self.next = 0x1000
        self.live: set[int] = set()
        self.log: list[tuple] = []
        self.fail_copy_at: int | None = None
        self.fail_retire = False

    # allocator
    def allocate(self, nbytes, what):
        self.next += 0x1000
        self.live.add(self.next)
        return Alloc(self.next, nbytes)

    def release(self, allocation):
        self.live.remove(allocation.ptr)
        self.log.append(("release", allocation.ptr))

    # backend hooks
    def copy(self, src, dst, nbytes, stream):
        copies = sum(1 for e in self.log if e[0] == "copy")
        if copies == self.fail_copy_at:
            raise RuntimeError("injected copy failure")
        self.log.append(("copy", src.ptr, dst.ptr, stream))

    def retire(self, allocation, stream):
        if self.fail_retire:
            raise RuntimeError("injected cuEventCreate failure")
        self.log.append(("retire", allocation.ptr, stream))
        self.release(allocation)


class Alloc:
    def __init__(self, ptr, nbytes):
        self.ptr, self.nbytes = ptr, nbytes


def device_pools(dev):
    from cellcache.cuda.pools import check_device_allocation

    pools = CopyPools({(0, "k"): 64, (0, "v"): 64}, dev, dev.copy, dev.retire, check_device_allocation)
    pools.apply(pools.plan(4), 0, stream=7)
    return pools


def test_device_copy_failure_retires_the_new_storage_on_the_stream_and_keeps_the_live_pools():
    pytest.importorskip("cuda.bindings")
    dev = FakeDevice()
    pools = device_pools(dev)
    live = dict(pools.allocations)
    dev.fail_copy_at = 1                           # the second copy fails
    plan = pools.plan(8)
    with pytest.raises(RuntimeError, match="injected copy failure"):
        pools.apply(plan, 3, stream=9)
    pools.cancel(plan)
    assert pools.allocations == live and pools.rows == 4
    assert {a.ptr for a in live.values()} == dev.live                 # live pools untouched
    retired = [e for e in dev.log if e[0] == "retire"]
    assert [e[2] for e in retired[-2:]] == [9, 9]                      # after the queued copy


def test_device_retire_failure_after_the_switch_keeps_the_growth():
    pytest.importorskip("cuda.bindings")
    dev = FakeDevice()
    pools = device_pools(dev)
    old = {a.ptr for a in pools.allocations.values()}
    dev.fail_retire = True
    with pytest.warns(PoolReleaseWarning, match="cuEventCreate"):
        assert pools.apply(pools.plan(8), 3, stream=9) is True
    assert pools.rows == 8 and {a.ptr for a in pools.unreleased} == old
    assert old <= dev.live                                             # never freed unordered
    dev.fail_retire = False
    pools.apply(pools.plan(16), 8, stream=9)
    assert pools.unreleased == [] and not old & dev.live
    pools.close()
    assert dev.live == set()


@pytest.mark.parametrize("allocation,ok", [
    (Alloc(0x1000, 64), True), (Alloc(0x1000, 100), True), (Alloc(np.uint64(0x1000), np.int64(64)), True),
    (Alloc(0x1000, 63), False), (Alloc(0, 64), False), (Alloc(-5, 64), False), (Alloc(2**64, 64), False),
    (Alloc(1.5, 64), False), (Alloc("0x1000", 64), False), (Alloc(0x1000, None), False), (object(), False),
])
def test_device_allocations_are_checked(allocation, ok):
    pytest.importorskip("cuda.bindings")
    from cellcache.cuda.pools import check_device_allocation

    if ok:
        check_device_allocation(allocation, 64, "pool layer_0_k")
    else:
        with pytest.raises(InvalidArgument, match="for pool layer_0_k; it must return an object with "
                                                  "an int device address .ptr and .nbytes >= 64"):
            check_device_allocation(allocation, 64, "pool layer_0_k")


def test_no_warning_on_an_ordinary_growth():
    alloc = Allocator()
    cache, a = grown_cache(alloc)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.prepare_step()
    cache.commit_step()
    assert len(alloc.live) == ALLOCATIONS_PER_GROWTH
