"""The CUDA cache owns what hangs off it: its attention kernels and named scratch (built on
first use), and what consumers tie to it with on_close(); close() releases all of it, newest
first, with the cache's context current, and afterwards every method raises InvalidState.

Nothing here imports cuda-bindings at collection: without it (or a driver, or a device)
every test is skipped by the conftest, never errored.
"""

from __future__ import annotations

import pytest

from cellcache import InvalidState

from ..helpers import cuda, small_config


def test_kernels_scratch_and_on_close_are_released_at_close():
    CudaCellCache, _, check, cu = cuda()
    dev = CudaCellCache(small_config(paged=True))
    kern = dev.attention_kernels()
    assert dev.attention_kernels() is kern and kern.module is not None
    first = dev.scratch("t", 1000)
    assert dev.scratch("t", 500) == first              # large enough: kept
    bigger = dev.scratch("t", 1 << 20)                  # replaced while the old one lived
    assert bigger not in (0, first)
    mine = int(check(cu.cuMemAlloc(4096), "cuMemAlloc"))
    order = []
    dev.on_close(lambda: order.append(("kernels loaded", kern.module is not None)))
    dev.on_close(lambda: (order.append("freed mine"), check(cu.cuMemFree(mine), "cuMemFree")))
    dev.close()
    assert order == ["freed mine", ("kernels loaded", True)]      # newest first, before the cache's own
    assert kern.module is None                          # the kernels went with the cache
    dev.close()
    for call in (dev.attention_kernels, lambda: dev.scratch("t", 1), lambda: dev.on_close(print),
                 dev.seq_new, dev.metrics, lambda: dev.phase_ns(), lambda: dev.table):
        with pytest.raises(InvalidState, match="CudaCellCache is closed"):
            call()


def test_with_block_closes():
    CudaCellCache, *_ = cuda()
    with CudaCellCache(small_config()) as dev:
        a = dev.seq_new()
        dev.declare_step([a] * 3)
        dev.prepare_step()
        dev.commit_step()
    assert dev.closed
    with pytest.raises(InvalidState, match="closed"):
        dev.buffer("cells")


def test_torch_view_uses_the_caches_kernels():
    pytest.importorskip("torch")
    import cellcache.torch as cct

    CudaCellCache, *_ = cuda()
    dev = CudaCellCache(small_config(paged=True, mask_format="none"))
    view = cct.TorchView(dev)
    assert view.kernels() is dev.attention_kernels()
    dev.close()
