"""Several threads doing verbs while one drives steps: invariants hold, nothing leaks."""

import threading

import numpy as np

from cellcache import CacheConfig, HostCellCache, InvalidState, LayerConfig

from .test_host_cache import FailingAllocator


def test_verbs_and_steps_from_many_threads():
    alloc = FailingAllocator()
    cfg = CacheConfig(capacity=512, layers=[LayerConfig(1, 4, 0), LayerConfig(1, 4, 3)],
                      max_write=16, initial_capacity=8, max_seqs=100, dtype="float32")
    cache = HostCellCache(cfg, allocator=alloc)
    errors = []
    stop = threading.Event()

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
            for s in mine:
                assert cache.seq_rm(s)
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    def steps():
        rng = np.random.default_rng(99)
        n = 0
        try:
            while not stop.is_set():
                live = cache.live_seqs()
                if not live:
                    continue
                ids = [int(x) for x in rng.choice(live, size=int(rng.integers(1, 17)))]
                try:
                    if not cache.declare_step(ids):
                        continue
                    step = cache.prepare_step()
                except InvalidState:
                    continue          # a verb thread removed or rewound one of the ids
                # only this thread writes step buffers, so they still hold this step
                assert step.read_len == int(cache.buffer("read_len")[0])
                assert cache.buffer("cells")[:step.width].tolist() == step.cells.tolist()
                cache.commit_step()
                n += 1
            steps.count = n
        except Exception as e:  # noqa: BLE001
            errors.append(e)

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
    assert steps.count > 0
    cache.check_invariants()
    assert cache.live_seqs() == []
    assert cache.free_cells == cfg.capacity and cache.used_end == 0
    assert alloc.live == 4                 # exactly the current pools: old ones were released
