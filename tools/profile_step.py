#!/usr/bin/env python3
"""Runs prepare_step for one benchmark case in a loop, for a profiler to look at (ncu).

  ncu --clock-control none -k regex:'apply_step|build_step' --launch-skip 20 --launch-count 4 \\
      python3 tools/profile_step.py --width 64 --read-len 131072 --windows 2 --max-seqs 1024
"""

from __future__ import annotations

import sys

import numpy as np
from _common import require_gpu

from cellcache._cli import Parser, in_range


def main(argv=None) -> int:
    p = Parser(prog="profile_step", description=__doc__)
    p.add_argument("--width", type=in_range(1, 4096), default=64)
    p.add_argument("--read-len", type=in_range(128, 1 << 30), default=131072)
    p.add_argument("--windows", type=in_range(1, 3), default=2)
    p.add_argument("--max-seqs", type=in_range(1, 1 << 16), default=1024)
    p.add_argument("--live", type=in_range(1, 1 << 16), default=256)
    p.add_argument("--format", choices=["bool", "bits", "none"], default="bool")
    p.add_argument("--steps", type=in_range(1, 100000), default=40)
    args = p.parse_args(argv)
    if (code := require_gpu("profile_step")) is not None:
        return code
    from bench_gpu import fill_to

    from cellcache.config import CacheConfig, LayerConfig
    from cellcache.cuda.backend import CudaCellCache
    from cellcache.cuda.driver import check, cu

    rng = np.random.default_rng(0)
    windows = [0, 4096, 128][: args.windows]
    cap = args.read_len + args.width + 64
    cap += (-cap) % 16
    cache = CudaCellCache(CacheConfig(capacity=cap, layers=[LayerConfig(1, 8, w) for w in windows],
                                      max_write=max(64, args.width), initial_capacity=cap,
                                      max_seqs=args.max_seqs, mask_format=args.format,
                                      paged=args.format == "none"))
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
