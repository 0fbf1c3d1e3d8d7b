"""Sleep and wake of a cache: the pools' memory given back and taken again, their addresses
kept where they are mapped (views and graphs stay valid), moved and reported where they grow
by copy; every refusal is InvalidState with nothing changed, a failed wake leaves the cache
asleep. The device's pools (MappedPools) are driven here through fake driver calls; the GPU
tests run them on the device."""

from __future__ import annotations

import numpy as np
import pytest

from cellcache import CacheConfig, HostCellCache, InvalidState, LayerConfig, OutOfMemory
from cellcache.pools import CopyPools


def rss_mib() -> float:
    """This process's resident memory (Linux /proc), MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / (1 << 20)


def config(capacity: int = 1 << 14, max_write: int = 1024) -> CacheConfig:
    return CacheConfig(capacity=capacity, layers=[LayerConfig(8, 128) for _ in range(4)],
                       max_write=max_write, dtype="float32")


def fill(cache: HostCellCache, rows: int) -> int:
    """One sequence of ``rows`` cells with K/V 1.0 written; returns its id."""
    a = cache.seq_new()
    left = rows
    while left:
        n = min(left, cache.config.max_write)
        assert cache.declare_step([a] * n)
        step = cache.prepare_step()
        for i in range(len(cache.config.layers)):
            lay = cache.layer(i)
            lay.k[step.cells] = 1.0
            lay.v[step.cells] = 1.0
        cache.commit_step()
        left -= n
    return a


def state(cache: HostCellCache) -> tuple:
    return (cache.table.snapshot(), cache.rows, cache.pools_generation, cache.asleep,
            {k: v for k, v in cache.metrics().items() if k != "steps"})


@pytest.mark.parametrize("growth", ["map", "copy"])
def test_sleep_gives_the_memory_back_and_wake_serves_steps_again(growth):
    cache = HostCellCache(config(capacity=1 << 15), growth=growth)
    a = fill(cache, 1 << 15)                       # 4 layers x 2 x 32K rows x 4 KiB = 1 GiB
    # (a pool array a caller holds keeps copy pools' storage alive: only the mapped one here)
    k0 = cache.layer(0).k if growth == "map" else None
    rows, generation = cache.rows, cache.pools_generation
    cache.seq_rm(a)
    before = rss_mib()
    cache.sleep()
    assert cache.asleep and cache.metrics()["asleep"] and cache.metrics()["allocated_bytes"] == 0
    released = before - rss_mib()
    assert released > 0.9 * 1024, released          # the pools' 1 GiB left the process
    cache.sleep()                                   # idempotent
    cache.wake()
    cache.wake()                                    # idempotent
    assert not cache.asleep
    if growth == "map":
        # same addresses: the pool arrays taken before sleep are still the pools
        assert cache.rows == rows and cache.pools_generation == generation
        assert np.shares_memory(cache.layer(0).k, k0)
        assert float(np.abs(cache.layer(0).k).sum()) == 0.0  # nothing kept: zeros
    else:
        # released: no rows until the next step allocates them elsewhere
        assert cache.rows == 0 and cache.pools_generation == generation + 1
    b = cache.seq_new()
    assert cache.declare_step([b] * 8)
    step = cache.prepare_step()
    cache.commit_step()
    assert step.grew == (growth == "copy")          # a runner recaptures after moved pools
    assert cache.pools_generation == generation + 2 * (growth == "copy")
    assert list(step.cells) == list(range(8))
    assert cache.declare_step([b])
    assert not cache.prepare_step().grew            # reported once
    cache.commit_step()
    cache.check_invariants()
    cache.close()


def test_sleep_refuses_while_cells_are_owned_or_a_step_is_declared_or_prepared():
    cache = HostCellCache(config())
    a = fill(cache, 64)
    before = state(cache)
    with pytest.raises(InvalidState, match="64 cells are owned"):
        cache.sleep()
    assert state(cache) == before
    cache.seq_rm(a)
    b = cache.seq_new()
    assert cache.declare_step([b] * 4)
    before = state(cache)
    with pytest.raises(InvalidState, match="a step is declared or prepared"):
        cache.sleep()
    assert state(cache) == before
    cache.prepare_step()
    with pytest.raises(InvalidState, match="4 cells are owned"):
        cache.sleep()
    cache.commit_step()
    cache.seq_rm(b)
    cache.sleep()
    assert cache.asleep
    cache.close()


def test_steps_are_refused_while_asleep_and_the_table_still_works():
    cache = HostCellCache(config())
    cache.sleep()
    a = cache.seq_new()                             # the table's verbs work
    before = state(cache)
    with pytest.raises(InvalidState, match="asleep"):
        cache.declare_step([a])
    with pytest.raises(InvalidState, match="asleep"):
        cache.prepare_step()
    assert state(cache) == before
    assert cache.seq_len(a) == 0 and cache.live_seqs() == [a]
    cache.wake()
    assert cache.declare_step([a])                  # awake: steps again
    cache.prepare_step()
    cache.commit_step()


def test_a_prepare_step_refused_while_asleep_tells_the_agree_hook():
    cache = HostCellCache(config())
    a = cache.seq_new()
    assert cache.declare_step([a])
    cache.prepare_step()
    cache.commit_step()
    cache.seq_rm(a)
    cache.sleep()
    seen = []
    with pytest.raises(InvalidState, match="asleep"):
        cache.prepare_step(agree=seen.append)
    assert len(seen) == 1 and isinstance(seen[0], InvalidState)


class FailingAllocator:
    """Zeroed arrays until ``fail`` allocations from now; then OutOfMemory."""

    def __init__(self):
        self.fail: int | None = None
        self.live = 0

    def allocate(self, nbytes, what):
        if self.fail is not None:
            self.fail -= 1
            if self.fail < 0:
                raise OutOfMemory(f"injected: {what}")
        self.live += 1
        return np.zeros(nbytes, np.uint8)

    def release(self, allocation):
        self.live -= 1


@pytest.mark.parametrize("fail_at", range(8))
def test_copy_pools_take_memory_at_the_next_step_and_a_failure_there_changes_nothing(fail_at):
    alloc = FailingAllocator()
    cache = HostCellCache(config(), growth="copy", allocator=alloc)
    cache.seq_rm(fill(cache, 600))
    assert isinstance(cache._pools, CopyPools) and alloc.live == 8
    cache.sleep()
    assert alloc.live == 0
    cache.wake()
    assert not cache.asleep and alloc.live == 0 and cache.rows == 0
    a = cache.seq_new()
    assert cache.declare_step([a] * 4)
    before = state(cache)
    alloc.fail = fail_at
    with pytest.raises(OutOfMemory, match="injected"):
        cache.prepare_step()
    assert state(cache) == before and alloc.live == 0   # what the attempt took is given back
    alloc.fail = None
    assert cache.prepare_step().grew and alloc.live == 8
    cache.commit_step()
    cache.close()
    assert alloc.live == 0


# -- the device's mapped pools, through fake driver calls ---------------------------------------
class FakeVmm:
    """VmmOps in host bookkeeping: handles are ints, mappings a dict; ``fail_at`` makes the
    n-th create/map/set_access from now raise OutOfMemory."""

    granularity_bytes = 1 << 16

    def __init__(self):
        self.next_va = 1 << 40
        self.handles: set[int] = set()
        self.mapped: dict[int, tuple[int, int]] = {}   # va -> (size, handle)
        self.reserved: dict[int, int] = {}
        self.calls = 0
        self.fail_at: int | None = None
        self._h = 0

    def _maybe_fail(self, what):
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            raise OutOfMemory(f"injected {what}")

    def granularity(self):
        return self.granularity_bytes

    def reserve(self, size, alignment):
        va, self.next_va = self.next_va, self.next_va + size
        self.reserved[va] = size
        return va

    def free_range(self, va, size):
        del self.reserved[va]

    def create(self, size):
        self._maybe_fail("cuMemCreate")
        self._h += 1
        self.handles.add(self._h)
        return self._h

    def map(self, va, size, handle):
        self._maybe_fail("cuMemMap")
        assert all(va + size <= v or v + s <= va for v, (s, _) in self.mapped.items()), "overlap"
        self.mapped[va] = (size, handle)

    def set_access(self, va, size):
        self._maybe_fail("cuMemSetAccess")

    def unmap(self, va, size):
        self._maybe_fail("cuMemUnmap")
        assert self.mapped.pop(va)[0] == size

    def release(self, handle):
        self.handles.remove(handle)


def mapped_pools(rows: int):
    import contextlib

    pools_mod = pytest.importorskip("cellcache.cuda.pools")
    ops, undo = FakeVmm(), contextlib.ExitStack()
    row_bytes = {(0, "k"): 1024, (0, "v"): 1024, (1, "k"): 512, (1, "v"): 512}
    pools = pools_mod.MappedPools(row_bytes, 1 << 12, ops, undo)
    for target in (rows // 4, rows):                 # two growths: two chunks a pool
        pools.apply(pools.plan(target), 0, 0)
    return pools, ops, undo


def test_mapped_pools_sleep_unmaps_everything_and_wake_maps_the_same_ranges():
    pools, ops, undo = mapped_pools(1000)
    ptrs = {k: pools.ptr(k) for k in pools.pools}
    covered = {k: (p.hi, p.sink_mapped) for k, p in pools.pools.items()}
    assert pools.mapped_bytes > 0 and len(ops.mapped) == 12  # 2 growth chunks + the sink each
    pools.sleep()
    assert pools.mapped_bytes == 0 and not ops.mapped and not ops.handles
    assert len(ops.reserved) == 4 and pools.rows == 1000       # the addresses stay reserved
    pools.wake()
    assert {k: pools.ptr(k) for k in pools.pools} == ptrs
    assert {k: (p.hi, p.sink_mapped) for k, p in pools.pools.items()} == covered
    assert len(ops.mapped) == 8                                # one for the rows, one for the sink
    assert sum(s for s, _ in ops.mapped.values()) == pools.mapped_bytes
    pools.apply(pools.plan(2000), 0, 0)                        # grows on from there
    pools.close()
    undo.close()
    assert not ops.mapped and not ops.handles and not ops.reserved


@pytest.mark.parametrize("fail_at", range(1, 25))
def test_mapped_pools_wake_failing_at_every_driver_call_gives_back_what_it_made(fail_at):
    pools, ops, undo = mapped_pools(1000)
    pools.sleep()
    ops.calls, ops.fail_at = 0, fail_at
    with pytest.raises(OutOfMemory, match="injected"):
        pools.wake()
    assert not ops.mapped and not ops.handles and pools.mapped_bytes == 0
    ops.fail_at = None
    pools.wake()                                     # the retry maps everything
    assert len(ops.mapped) == 8
    pools.close()
    undo.close()


@pytest.mark.parametrize("fail_at", range(1, 13))
def test_a_sleep_failing_part_way_is_asleep_and_wake_maps_everything_again(fail_at):
    pools, ops, undo = mapped_pools(1000)
    covered = {k: (p.hi, p.sink_mapped) for k, p in pools.pools.items()}
    ops.calls, ops.fail_at = 0, fail_at
    with pytest.raises(OutOfMemory, match="injected cuMemUnmap"):
        pools.sleep()
    assert ops.mapped                                 # some mappings left behind
    ops.fail_at = None
    pools.wake()                                      # they go first, then everything is mapped
    assert {k: (p.hi, p.sink_mapped) for k, p in pools.pools.items()} == covered
    assert len(ops.mapped) == 8 and len(ops.handles) == 8
    pools.close()
    undo.close()
    assert not ops.mapped and not ops.handles


def test_a_cache_whose_pools_fail_to_sleep_refuses_steps_until_it_wakes():
    cache = HostCellCache(config())
    cache.seq_rm(fill(cache, 64))
    real = cache._pools.sleep

    def broken():
        raise OSError("injected madvise failure")

    cache._pools.sleep = broken
    with pytest.raises(OSError, match="injected"):
        cache.sleep()
    assert cache.asleep                               # no step on pools that may be half gone
    with pytest.raises(InvalidState, match="asleep"):
        cache.declare_step([cache.seq_new()])
    cache._pools.sleep = real
    cache.wake()
    assert cache.declare_step([cache.live_seqs()[0]])
    cache.prepare_step()
    cache.commit_step()
    cache.close()
