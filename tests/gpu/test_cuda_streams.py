"""Streams and ordering: teardown after the caller's stream is gone, commits ordering two
streams, DLPack consumers, clear(), capture refusal.

Nothing here imports cuda-bindings at collection: without it (or a driver, or a device)
every test is skipped by the conftest, never errored.
"""

from __future__ import annotations

import pytest

from cellcache import (
    InvalidState,
)

from ..helpers import cuda, small_config


def test_stream_destroyed_before_teardown():
    CudaCellCache, _, check, cu = cuda()
    dev = CudaCellCache(small_config())
    stream = check(cu.cuStreamCreate(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)), "cuStreamCreate")
    a = dev.seq_new()
    for _ in range(3):
        dev.declare_step([a] * 10)
        dev.prepare_step(stream=int(stream))
        dev.commit_step()
    check(cu.cuStreamDestroy(stream), "cuStreamDestroy")
    dev.close()
    dev.close()                                     # idempotent
    with pytest.raises(InvalidState, match="closed"):
        dev.buffer("cells")


def test_two_streams_are_ordered_by_commit():
    torch = pytest.importorskip("torch")
    CudaCellCache, *_ = cuda()
    dev = CudaCellCache(small_config(capacity=1 << 16, max_write=64, initial_capacity=1024))
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    a, b = dev.seq_new(), dev.seq_new()
    dev.declare_step([a] * 64)
    dev.prepare_step(stream=s1)
    mask = torch.from_dlpack(dev.buffer("mask_w3"))
    with torch.cuda.stream(s1):
        torch.cuda._sleep(200_000_000)              # a slow "forward" still reading the mask
        seen = mask.clone()
    dev.commit_step()
    dev.declare_step([b] * 64)
    dev.prepare_step(stream=s2)                     # must wait for the forward on s1
    torch.cuda.synchronize()
    first = seen[0, 0, :64, :64].cpu().numpy()
    assert first[5, 3:6].all() and not first[5, :3].any()   # step one's window-3 rows
    later = mask[0, 0, :64, 64:128].cpu().numpy()
    assert later[5, 3:6].all()
    dev.close()


def test_dlpack_orders_the_consumer_stream_after_the_step():
    """A consumer on another stream gets the step's writes: __dlpack__(stream=s) makes s wait."""
    torch = pytest.importorskip("torch")
    CudaCellCache, *_ = cuda()
    dev = CudaCellCache(small_config(capacity=1 << 16, max_write=64, initial_capacity=1024))
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    a = dev.seq_new()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(200_000_000)               # the step's kernels queue behind this
    dev.declare_step([a] * 64)
    dev.prepare_step(stream=producer)
    with torch.cuda.stream(consumer):
        cells = torch.from_dlpack(dev.buffer("cells"))    # torch passes consumer's handle
        seen = cells[:64].clone()
    torch.cuda.synchronize()
    assert seen.tolist() == list(range(64))
    dev.commit_step()
    dev.close()


def test_clear_commits_the_prepared_step():
    CudaCellCache, *_ = cuda()
    dev = CudaCellCache(small_config())
    a = dev.seq_new()
    dev.declare_step([a] * 4)
    dev.prepare_step()
    dev.clear()
    with pytest.raises(InvalidState, match="no step is prepared"):
        dev.commit_step()
    assert dev._engine.synchronize() == 0           # the commit event was recorded
    dev.close()


def test_prepare_on_a_capturing_stream_is_refused():
    CudaCellCache, _, check, cu = cuda()
    dev = CudaCellCache(small_config())
    a = dev.seq_new()
    dev.declare_step([a] * 4)
    dev.prepare_step()
    dev.commit_step()
    stream = check(cu.cuStreamCreate(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)), "cuStreamCreate")
    dev.declare_step([a] * 4)
    snap = dev.table.snapshot()
    check(cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
          "cuStreamBeginCapture")
    try:
        with pytest.raises(InvalidState, match="being captured"):
            dev.prepare_step(stream=int(stream))
    finally:
        graph = check(cu.cuStreamEndCapture(stream), "cuStreamEndCapture")
        check(cu.cuGraphDestroy(graph), "cuGraphDestroy")
    assert dev.table.snapshot() == snap
    step = dev.prepare_step(stream=int(stream))      # outside capture it works
    dev.commit_step()
    assert step.positions.tolist() == [4, 5, 6, 7]
    check(cu.cuStreamDestroy(stream), "cuStreamDestroy")
    dev.close()

