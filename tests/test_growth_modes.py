"""HostCellCache(growth=...): "map" (fixed addresses, the default where the range can be
reserved), "copy" (pools that move at every growth, as on CUDA without virtual memory
management) and "auto" (map, else copy): same table, same buffers, same live rows."""

from __future__ import annotations

import numpy as np
import pytest

from cellcache import HostCellCache, InvalidArgument, OutOfMemory
from cellcache.host import HostAllocator, MappedHostPools

from .helpers import config, run_step, write_rows


def walk(cache):
    """Steps that grow the pools 4 -> 8 -> 16 -> 32 rows, every row written; returns the
    steps and the pools' first address after each."""
    a, b = cache.seq_new(), cache.seq_new()
    steps, ptrs = [], []
    for ids in ([a] * 3, [b] * 4, [a, b] * 4, [a] * 9, [b] * 6):
        step = run_step(cache, ids, pad_to=len(ids) + 1 if len(ids) < 9 else None)
        write_rows(cache, step, lambda layer, kv, s, p: 100 * s + p + (layer if kv == "k" else -layer))
        steps.append(step)
        ptrs.append(cache.layer(0).k.ctypes.data)
    return steps, ptrs


def test_copy_growth_moves_the_pools_and_keeps_every_live_row():
    mapped, copied = HostCellCache(config(), growth="map"), HostCellCache(config(), growth="copy")
    m_steps, m_ptrs = walk(mapped)
    c_steps, c_ptrs = walk(copied)
    assert [s.grew for s in m_steps] == [True, False, False, False, False]
    assert [s.grew for s in c_steps] == [True, True, True, True, False]
    assert len(set(m_ptrs)) == 1 and len(set(c_ptrs)) == 4          # copy growth moves them
    assert mapped.metrics()["pools_move"] is False and copied.metrics()["pools_move"] is True
    assert (mapped.rows, copied.rows) == (32, 32) and (mapped.sink, copied.sink) == (32, 32)
    assert mapped.table.snapshot() == copied.table.snapshot()
    live = np.flatnonzero(copied.table.positions_array() >= 0)
    for name in mapped.buffer_names:
        m, c = mapped.buffer(name), copied.buffer(name)
        if name.startswith("layer_"):
            np.testing.assert_array_equal(m[live], c[live], err_msg=name)
        else:
            np.testing.assert_array_equal(m, c, err_msg=name)
    m_metrics, c_metrics = mapped.metrics(), copied.metrics()
    m_metrics.pop("pools_move"), c_metrics.pop("pools_move")
    assert m_metrics == c_metrics
    assert copied.pools_generation == 4 and mapped.pools_generation == 1


def test_copy_growth_takes_a_user_allocator():
    class Counting(HostAllocator):
        calls = 0

        def allocate(self, nbytes, what):
            Counting.calls += 1
            return super().allocate(nbytes, what)

    cache = HostCellCache(config(), growth="copy", allocator=Counting())
    walk(cache)
    assert Counting.calls == 4 * 4                  # 4 allocations (2 layers x K, V) per move


def test_growth_is_checked():
    with pytest.raises(InvalidArgument, match="growth='fast' is not one of auto, map, copy"):
        HostCellCache(config(), growth="fast")
    with pytest.raises(InvalidArgument, match="growth=None is not one of"):
        HostCellCache(config(), growth=None)        # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="growth='map' maps the pools and uses no allocator"):
        HostCellCache(config(), growth="map", allocator=HostAllocator())


def test_map_refuses_where_auto_falls_back_to_copy(monkeypatch):
    def no_room(self, row_bytes, capacity):
        raise OutOfMemory("injected: no address space")

    monkeypatch.setattr(MappedHostPools, "__init__", no_room)
    with pytest.raises(OutOfMemory, match="injected"):
        HostCellCache(config(), growth="map")
    cache = HostCellCache(config())                  # auto
    assert cache.metrics()["pools_move"] is True
    assert [s.grew for s in walk(cache)[0]] == [True, True, True, True, False]
