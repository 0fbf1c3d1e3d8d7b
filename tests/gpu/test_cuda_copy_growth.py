"""Copy growth on the device with a user allocator (issue 15, item 8): an allocation that
fails or is refused changes nothing (table, pool addresses and contents, rows, sink), the
live pools are never freed by a failed growth, and a release that raises after the switch
keeps the growth (PoolReleaseWarning) and is retried."""

from __future__ import annotations

import numpy as np
import pytest

from cellcache import CacheConfig, InvalidArgument, LayerConfig, OutOfMemory
from cellcache.pools import PoolReleaseWarning

from ..helpers import cuda

CFG = dict(capacity=512, layers=[LayerConfig(2, 8), LayerConfig(1, 16, 4)], max_write=64,
           initial_capacity=8, dtype="float32")
PER_GROWTH = 4


class Small:
    """An allocation that claims fewer bytes than asked for."""

    def __init__(self, inner, nbytes):
        self.inner, self.ptr, self.nbytes = inner, inner.ptr, nbytes


def make():
    CudaCellCache, *_ = cuda()
    from cellcache.cuda.pools import DeviceAllocator

    class Allocator(DeviceAllocator):
        def __init__(self, ctx):
            super().__init__(ctx)
            self.calls, self.fail_at, self.small_at = 0, None, None
            self.fail_release = 0
            self.live = set()

        def allocate(self, nbytes, what):
            n = self.calls
            self.calls += 1
            if n == self.fail_at:
                raise OutOfMemory(f"injected failure at allocation {n}")
            allocation = super().allocate(nbytes, what)
            self.live.add(allocation.ptr)
            return Small(allocation, nbytes - 1) if n == self.small_at else allocation

        def release(self, allocation):
            if self.fail_release:
                self.fail_release -= 1
                raise RuntimeError("injected release failure")
            inner = getattr(allocation, "inner", allocation)
            self.live.remove(inner.ptr)
            super().release(inner)

    from cellcache.cuda import driver

    ctx = driver.Context(0)
    alloc = Allocator(ctx)
    dev = CudaCellCache(CacheConfig(**CFG), allocator=alloc)
    a = dev.seq_new()
    assert dev.declare_step([a] * 6)
    step = dev.prepare_step()
    dev.commit_step()
    k = dev.layer(0).k
    data = np.arange(6 * 2 * 8, dtype=np.float32).reshape(6, 2, 8) + 1
    from cellcache.cuda.driver import check, cu

    check(cu.cuCtxSynchronize(), "sync")
    for i, c in enumerate(step.cells):
        check(cu.cuMemcpyHtoD(k.ptr + int(c) * 64, data[i].ctypes.data, 64), "HtoD")
    assert dev.declare_step([a] * 5)                  # needs 11 rows: a growth 8 -> 16
    return dev, alloc, ctx, a, data


def observe(dev):
    return (dev.table.snapshot(), dev.metrics(), dev.rows, dev.sink,
            [dev.buffer(n).ptr for n in dev.buffer_names if n.startswith("layer_")],
            dev.layer(0).k.copy_to_host()[:6].tolist())


@pytest.mark.parametrize("k", range(PER_GROWTH))
@pytest.mark.parametrize("how", ["oom", "too-small"])
def test_a_failed_or_refused_device_allocation_changes_nothing(how, k):
    dev, alloc, ctx, a, data = make()
    live = set(alloc.live)
    if how == "oom":
        alloc.fail_at = alloc.calls + k
    else:
        alloc.small_at = alloc.calls + k
    before = observe(dev)
    with pytest.raises(OutOfMemory if how == "oom" else InvalidArgument, match="nothing changed"):
        dev.prepare_step()
    assert observe(dev) == before
    assert alloc.live == live                           # the attempt gave back all it took
    step = dev.prepare_step()
    dev.commit_step()
    assert step.grew and dev.rows == 16
    np.testing.assert_array_equal(dev.layer(0).k.copy_to_host()[:6], data)
    dev.close()
    assert alloc.live == set()
    ctx.release()


def test_a_release_that_raises_keeps_the_growth_and_is_retried():
    dev, alloc, ctx, a, data = make()
    old = set(alloc.live)
    alloc.fail_release = PER_GROWTH                     # every release of the old pools fails once
    step = dev.prepare_step()
    dev.commit_step()
    assert step.grew and dev.rows == 16 and dev.sink == 16
    assert dev.layer(0).k.shape == (17, 2, 8)
    np.testing.assert_array_equal(dev.layer(0).k.copy_to_host()[:6], data)
    dev._engine.synchronize()                           # the old pools' readers are done
    with pytest.warns(PoolReleaseWarning, match="injected release failure"):
        assert dev.declare_step([a])
        dev.prepare_step()                              # the reap: every release fails, kept
        dev.commit_step()
    assert old <= alloc.live and dev.metrics()["retired_pending"] == PER_GROWTH
    assert dev.declare_step([a])
    dev.prepare_step()                                  # the next reap releases them
    dev.commit_step()
    assert not old & alloc.live and dev.metrics()["retired_pending"] == 0
    dev.close()
    assert alloc.live == set()
    ctx.release()
