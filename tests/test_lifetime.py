"""The cache owns what hangs off it: close() (idempotent, also by leaving a ``with`` block)
releases the pools, the step buffers and whatever consumers tied to it with on_close(),
newest first; afterwards every method raises InvalidState. ``table`` is a read-only window
on the cell table; ``lock`` makes a sequence of calls atomic."""

from __future__ import annotations

import pytest

import cellcache.host as host
from cellcache import HostCellCache, InvalidArgument, InvalidState, OutOfMemory
from cellcache.cache import CellCache
from cellcache.host import HostAllocator, MappedHostPools

from .helpers import config, run_step

#: What stays readable after close: what the cache was built from, and whether it is closed.
DESCRIPTIONS = {"config", "capacity", "max_seqs", "backend", "buffer_names", "closed", "close",
                "lock"}

#: One call of every other public attribute of CellCache.
CALLS = {
    "seq_new": lambda c: c.seq_new(),
    "seq_clone": lambda c: c.seq_clone(0),
    "seq_rm": lambda c: c.seq_rm(0),
    "rewind": lambda c: c.rewind(0, 0),
    "pos": lambda c: c.pos(0),
    "seq_len": lambda c: c.seq_len(0),
    "live_seqs": lambda c: c.live_seqs(),
    "clear": lambda c: c.clear(),
    "free_cells": lambda c: c.free_cells,
    "used_end": lambda c: c.used_end,
    "rows": lambda c: c.rows,
    "sink": lambda c: c.sink,
    "prepared_step": lambda c: c.prepared_step,
    "pools_generation": lambda c: c.pools_generation,
    "clears": lambda c: c.clears,
    "check_invariants": lambda c: c.check_invariants(),
    "declare_step": lambda c: c.declare_step([0]),
    "prepare_step": lambda c: c.prepare_step(),
    "commit_step": lambda c: c.commit_step(),
    "unprepare_step": lambda c: c.unprepare_step(),
    "undeclare": lambda c: c.undeclare(),
    "buffer": lambda c: c.buffer("cells"),
    "layer": lambda c: c.layer(0),
    "metrics": lambda c: c.metrics(),
    "table": lambda c: c.table,
    "on_close": lambda c: c.on_close(print),
    "asleep": lambda c: c.asleep,
    "sleep": lambda c: c.sleep(),
    "wake": lambda c: c.wake(),
}


class CountingAllocator(HostAllocator):
    def __init__(self):
        self.live = 0

    def allocate(self, nbytes, what):
        self.live += 1
        return super().allocate(nbytes, what)

    def release(self, allocation):
        self.live -= 1


def test_every_public_method_is_listed():
    public = {n for n in dir(HostCellCache(config())) if not n.startswith("_")}
    assert public == set(CALLS) | DESCRIPTIONS
    assert set(CALLS) <= set(dir(CellCache))


@pytest.mark.parametrize("growth", ["map", "copy"])
def test_after_close_every_method_raises(growth):
    cache = HostCellCache(config(), growth=growth)
    a = cache.seq_new()
    run_step(cache, [a] * 3)
    cache.declare_step([a])
    cache.prepare_step()                       # closed with a step prepared
    cache.close()
    cache.close()                              # idempotent
    assert cache.closed
    for name, call in CALLS.items():
        with pytest.raises(InvalidState, match="HostCellCache is closed"):
            call(cache)
        assert cache.closed, name
    with pytest.raises(InvalidState, match="closed"), cache:
        pass
    assert cache.capacity == 32 and cache.config.max_write == 9 and cache.backend == "host"
    assert "cells" in cache.buffer_names


def test_with_block_closes_also_on_error():
    with HostCellCache(config()) as cache:
        assert not cache.closed
    assert cache.closed
    with pytest.raises(RuntimeError, match="the forward failed"), HostCellCache(config()) as cache:
        raise RuntimeError("the forward failed")
    assert cache.closed


def test_on_close_runs_newest_first_before_the_pools_go():
    alloc = CountingAllocator()
    cache = HostCellCache(config(), allocator=alloc)
    a = cache.seq_new()
    run_step(cache, [a] * 5)                   # copy pools: 4 allocations live
    seen = []
    cache.on_close(lambda: seen.append(("first", alloc.live)))
    cache.on_close(seen.append, ("second", "args are passed"))
    with pytest.raises(InvalidArgument, match="not callable"):
        cache.on_close(42)
    cache.close()
    assert seen == [("second", "args are passed"), ("first", 4)]
    assert alloc.live == 0                     # the copy pools were given back
    cache.close()
    assert len(seen) == 2                      # once


def test_close_unmaps_the_mapped_pools_and_held_arrays_stay_valid(monkeypatch):
    closed = []
    real = MappedHostPools.close
    monkeypatch.setattr(MappedHostPools, "close", lambda self: (closed.append(self), real(self)))
    cache = HostCellCache(config())
    a = cache.seq_new()
    run_step(cache, [a] * 3)
    kept = cache.layer(0).k                    # a caller keeps a pool view
    kept[:3] = 7
    cache.close()
    assert len(closed) == 1 and closed[0].maps == {}
    assert (kept[:3] == 7).all()               # still mapped while the array lives


def test_a_failed_build_releases_what_it_acquired(monkeypatch):
    closed = []
    real = MappedHostPools.close
    monkeypatch.setattr(MappedHostPools, "close", lambda self: (closed.append(self), real(self)))
    def no_memory(shape, dtype, what):
        raise OutOfMemory(f"injected: no memory for {what}")

    monkeypatch.setattr(host, "_zeros", no_memory)        # the step buffers fail
    with pytest.raises(OutOfMemory, match="injected"):
        HostCellCache(config())
    assert len(closed) == 1                    # the pools were reserved, then unmapped


def test_table_is_a_read_only_window():
    cache = HostCellCache(config())
    a = cache.seq_new()
    run_step(cache, [a] * 3)
    t = cache.table
    assert t.snapshot() == cache.table.snapshot() and t.pos(a) == 3
    assert [t.seq_cell_at(a, q) for q in range(3)] == [0, 1, 2]
    with pytest.raises(AttributeError):
        cache.table = t                        # type: ignore[misc]


def test_lock_makes_a_sequence_of_calls_atomic():
    import threading

    cache = HostCellCache(config())
    a = cache.seq_new()
    with cache.lock:
        other = threading.Thread(target=cache.seq_new)
        other.start()
        other.join(timeout=0.2)
        assert other.is_alive() and cache.live_seqs() == [a]   # waits for the lock
    other.join()
    assert cache.live_seqs() == [a, a + 1]
