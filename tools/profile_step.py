#!/usr/bin/env python3
"""Runs prepare_step for one benchmark case, for a profiler to look at (ncu, nsys).

  ncu --clock-control none -k regex:'fill_masks|apply_delta' --launch-skip 20 --launch-count 4 \\
      python3 tools/profile_step.py --width 64 --read-len 131072 --windows 2 --max-seqs 1024
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--read-len", type=int, default=131072)
    p.add_argument("--windows", type=int, default=2, choices=[1, 2, 3])
    p.add_argument("--max-seqs", type=int, default=1024)
    p.add_argument("--live", type=int, default=256)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)
    from cellcache.cuda.driver import device_usable

    if not device_usable():
        print("profile_step: no CUDA driver or no CUDA device")
        return 3
    from cellcache.config import CacheConfig, LayerConfig
    from cellcache.cuda.backend import CudaCellCache
    from cellcache.cuda.bench import fill_to
    from cellcache.cuda.driver import check, cu

    rng = np.random.default_rng(0)
    windows = [0, 4096, 128][: args.windows]
    cap = args.read_len + args.width + 64
    cap += (-cap) % 16
    cache = CudaCellCache(CacheConfig(capacity=cap, layers=[LayerConfig(1, 8, w) for w in windows],
                                      max_write=max(64, args.width), initial_capacity=cap,
                                      max_seqs=args.max_seqs))
    seqs = fill_to(cache, args.read_len - args.width, min(args.live, args.max_seqs), rng)
    stream = int(check(cu.cuStreamCreate(1), "cuStreamCreate"))
    for _ in range(args.steps):
        ids = [int(x) for x in rng.choice(seqs, size=args.width)]
        assert cache.declare_step(ids)
        cache.prepare_step(stream=stream)
        cache.commit_step()
        check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
        for s in set(ids):
            cache.rewind(s, cache.pos(s) - ids.count(s))
    cache.close()
    print("profile_step: done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
