"""Threads: a bare CellTable hammered from 8 threads never crashes the interpreter; on a
cache, several threads doing verbs while one drives steps keep every invariant."""

import subprocess
import sys
import textwrap
import threading

import numpy as np

from cellcache import CacheConfig, HostCellCache, InvalidState, LayerConfig

from .helpers import FailingAllocator

MIN_STEPS = 20


def test_verbs_and_steps_from_many_threads():
    """Four verb threads and one step thread on one cache. The verb threads keep one
    sequence each alive after their random walk until the step thread has committed
    MIN_STEPS steps, so the test needs no luck from the scheduler (it used to fail whenever
    the verb threads finished before the step thread ran)."""
    alloc = FailingAllocator()
    cfg = CacheConfig(capacity=512, layers=[LayerConfig(1, 4, 0), LayerConfig(1, 4, 3)],
                      max_write=16, initial_capacity=8, max_seqs=100, dtype="float32")
    cache = HostCellCache(cfg, allocator=alloc)
    errors = []
    stop = threading.Event()
    enough = threading.Event()          # set by the step thread after MIN_STEPS steps
    count = [0]

    def verbs(seed):
        rng = np.random.default_rng(seed)
        mine = []
        try:
            for _ in range(400):
                r = rng.random()
                if r < 0.3 or not mine:
                    s = cache.seq_new()
                    if s is not None:
                        mine.append(s)
                elif r < 0.45:
                    c = cache.seq_clone(mine[0], upto=int(rng.integers(0, 8)))
                    if c is not None:
                        mine.append(c)
                elif r < 0.65:
                    s = mine[int(rng.integers(len(mine)))]
                    cache.rewind(s, max(0, cache.pos(s) - int(rng.integers(0, 3))))
                elif r < 0.8:
                    assert cache.seq_rm(mine.pop(int(rng.integers(len(mine)))))
                else:
                    cache.check_invariants()
            while len(mine) > 1:
                assert cache.seq_rm(mine.pop())
            while not mine:               # ids freed by other threads come back
                s = cache.seq_new()
                if s is not None:
                    mine.append(s)
            # keep one sequence for the step thread until it has stepped enough; the
            # timeout only turns a broken step thread into a failure instead of a hang
            assert enough.wait(timeout=300), "the step thread made no progress"
            assert cache.seq_rm(mine.pop())
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    def steps():
        rng = np.random.default_rng(99)
        try:
            while not stop.is_set():
                live = cache.live_seqs()
                if not live:
                    continue
                ids = [int(x) for x in rng.choice(live, size=int(rng.integers(1, 17)))]
                try:
                    if not cache.declare_step(ids):
                        for s in set(ids):    # full: make room (a verb like any other)
                            cache.rewind(s, 0)
                        continue
                    step = cache.prepare_step()
                except InvalidState:
                    continue          # a verb thread removed or rewound one of the ids
                # only this thread writes step buffers, so they still hold this step
                assert step.read_len == int(cache.buffer("read_len")[0])
                assert cache.buffer("cells")[:step.width].tolist() == step.cells.tolist()
                cache.commit_step()
                count[0] += 1
                if count[0] >= MIN_STEPS:
                    enough.set()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
            enough.set()

    workers = [threading.Thread(target=verbs, args=(i,)) for i in range(4)]
    driver = threading.Thread(target=steps)
    driver.start()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    driver.join()
    assert not errors, errors
    assert count[0] >= MIN_STEPS
    cache.check_invariants()
    assert cache.live_seqs() == []
    assert cache.free_cells == cfg.capacity and cache.used_end == 0
    assert alloc.live == 4                 # exactly the current pools: old ones were released


HAMMER = textwrap.dedent("""
    import random, sys, threading
    from cellcache import CellTable, InvalidArgument, InvalidState
    t = CellTable(4096, max_seqs=64, max_write=512, track_changes=True)
    def work(seed):
        rng = random.Random(seed)
        for _ in range(4000):
            live = t.live_seqs()
            r = rng.random()
            try:
                if r < 0.2 or not live:
                    t.seq_new()
                elif r < 0.3:
                    t.seq_clone(rng.choice(live), upto=rng.randrange(0, 600))
                elif r < 0.4:
                    t.seq_rm(rng.choice(live))
                elif r < 0.55:
                    s = rng.choice(live)
                    t.rewind(s, max(0, t.pos(s) - rng.randrange(0, 300)))
                elif r < 0.9:
                    s = rng.choice(live)
                    if t.declare_step([s] * rng.randrange(1, 512)):
                        t.place()
                else:
                    t.take_changes()
            except (InvalidState, InvalidArgument):
                pass        # another thread changed the table between our calls
    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for th in threads: th.start()
    for th in threads: th.join()
    t.check_invariants()
    print("ok", len(t.live_seqs()))
""")


def test_bare_table_from_eight_threads_never_crashes():
    """Verbs that grow and free position maps from 8 threads at once (this used to
    segfault); run in a child so that a crash fails the test instead of the suite."""
    r = subprocess.run([sys.executable, "-c", HAMMER], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.startswith("ok")
