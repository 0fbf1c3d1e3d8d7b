#!/usr/bin/env python3
"""Runs prepare_step for one benchmark case in a loop, for a profiler to look at (ncu).

  ncu --clock-control none -k regex:'apply_step|build_step' --launch-skip 20 --launch-count 4 \\
      python3 tools/profile_step.py --width 64 --read-len 131072 --windows 2 --max-seqs 1024

``--decode`` runs serving's decode step instead: ``--width`` sequences (their prompts
covering ``--read-len`` cells between them) each take one token a step, through the paged
view with no masks, and it prints prepare_step's host median and the CUDA engine's host
phases a step (zero unless the extension was built with ``CELLCACHE_PROFILE=1``):

  python3 tools/profile_step.py --decode --width 256 --max-seqs 528 --read-len 131072
"""

from __future__ import annotations

import sys

import numpy as np
from _common import NO_GPU_EXIT, require_gpu

from cellcache._cli import Parser, in_range, run_main

__all__ = ["NO_GPU_EXIT", "main"]


def main(argv=None, probe=None) -> int:
    p = Parser(prog="profile_step", description=__doc__)
    p.add_argument("--width", type=in_range(1, 4096), default=64)
    p.add_argument("--read-len", type=in_range(128, 1 << 30), default=131072)
    p.add_argument("--windows", type=in_range(1, 3), default=2)
    p.add_argument("--max-seqs", type=in_range(1, 1 << 16), default=1024)
    p.add_argument("--live", type=in_range(1, 1 << 16), default=256)
    p.add_argument("--format", choices=["bool", "bits", "none"], default="bool")
    p.add_argument("--steps", type=in_range(1, 100000), default=40)
    p.add_argument("--decode", action="store_true",
                   help="serving's decode step: --width sequences, one token each a step (paged, "
                        "no masks); prints the host median and the engine's phases")
    args = p.parse_args(argv)
    if args.decode and args.width > args.max_seqs:
        p.error(f"--decode needs --width <= --max-seqs (one sequence a row): {args.width} > {args.max_seqs}")
    if (code := require_gpu("profile_step", probe)) is not None:
        return code
    if args.decode:
        return decode(args, np.random.default_rng(0))
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


def decode(args, rng) -> int:
    """The --decode loop (see the module docstring)."""
    import time

    from bench_gpu import fill_to

    from cellcache.config import CacheConfig, LayerConfig
    from cellcache.cuda.backend import CudaCellCache
    from cellcache.cuda.driver import check, cu

    cap = args.read_len + args.width * (args.steps + 1) + 64
    cap += (-cap) % 16
    cache = CudaCellCache(CacheConfig(capacity=cap, layers=[LayerConfig(2, 64)] * 2,
                                      max_write=max(2048, args.width), initial_capacity=cap,
                                      max_seqs=args.max_seqs, mask_format="none", paged=True))
    stream = 0
    try:
        seqs = fill_to(cache, args.read_len, args.width, rng)
        stream = int(check(cu.cuStreamCreate(1), "cuStreamCreate"))
        host, decl = [], []
        cache.phase_ns(True)
        for i in range(args.steps):
            t0 = time.perf_counter()
            assert cache.declare_step(seqs)
            t1 = time.perf_counter()
            cache.prepare_step(stream=stream)
            t2 = time.perf_counter()
            cache.commit_step()
            if i % 8 == 7:
                check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
            decl.append(t1 - t0)
            host.append(t2 - t1)
        check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
        phases = {k: round(v / args.steps / 1e3, 1) for k, v in cache.phase_ns(True).items()}
    finally:
        if stream:                            # before the cache's context goes with it
            check(cu.cuStreamDestroy(stream), "cuStreamDestroy")
        cache.close()
    print(f"profile_step: {args.steps} decode steps of {args.width} rows ({args.max_seqs} ids, "
          f"{args.read_len} cells read): prepare_step host median {1e6 * np.median(host):.1f} us, "
          f"declare_step {1e6 * np.median(decl):.1f} us; engine phases a step (us) {phases}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main("profile_step", main))
