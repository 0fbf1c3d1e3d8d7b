"""``cellcache demo``: a simulated serving session, checked token by token.

Sequences arrive over time, prefill in chunks mixed with decode tokens in each step, fork,
rewind and finish; when the pool is full the longest sequence is preempted. Every step runs
the reference consumer (:mod:`cellcache.attention`) through the cache on every layer and
checks every token's output against attention over that sequence's own history with no
cache (:mod:`cellcache.session`).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from . import attention
from ._cli import Parser, in_range
from .buckets import default_buckets
from .config import CacheConfig, LayerConfig
from .errors import CellCacheError
from .registry import build
from .session import Session, SessionConfig

TOLERANCE = 1e-4
MAX_WRITE = 64
LAYERS = (LayerConfig(2, 16, 0), LayerConfig(2, 16, 8), LayerConfig(2, 16, 0), LayerConfig(2, 16, 32))
N_HEADS = 4          # grouped-query: 2 query heads per KV head
VIEWS: dict[str, dict[str, Any]] = {"bool": dict(mask_format="bool"), "bits": dict(mask_format="bits"),
         "paged": dict(mask_format="none", paged=True)}


def run(backend: str = "auto", seqs: int = 32, steps: int = 300, seed: int = 0,
        capacity: int = 2048, dtype: str = "bfloat16", view: str = "bool", pad: bool = False,
        progress: bool = True) -> dict:
    """Runs a session; returns the summary dict (``mismatches`` 0 when every token matched)."""
    extra = dict(VIEWS[view])
    if extra.get("paged"):
        # a step lists at most MAX_WRITE runs, each at most one sequence's length: sized so,
        # the paged view never refuses the session's steps, whatever the capacity
        extra["max_kv"] = MAX_WRITE * SessionConfig.max_len
    cfg = CacheConfig(capacity=capacity, layers=LAYERS, max_write=MAX_WRITE, initial_capacity=64,
                      dtype=dtype, max_seqs=seqs, **extra)
    buckets = default_buckets(MAX_WRITE) if pad else None
    with build(backend, "batched-cell", cfg) as cache:
        session = Session(cache, attention.reference_forward,
                          SessionConfig(n_heads=N_HEADS, tolerance=TOLERANCE, buckets=buckets), seed)
        summary = session.run(steps, progress, label="demo")
    summary["view"] = view
    return summary


def summary_line(s: dict) -> str:
    return (f"demo [{s['backend']}, {s['view']}]: {s['steps']} steps, {s['tokens']} tokens, "
            f"{s['arrivals']} arrivals, {s['forks']} forks, {s['rewinds']} rewinds, "
            f"{s['finished']} finished, {s['preempted']} preempted, {s['growths']} growths "
            f"({s['rows']} rows), peak {s['peak_cells']} cells, max error {s['max_error']:.2e}, "
            f"median prepare {s['median_prepare_us']:.0f} us, {s['mismatches']} mismatches")


def main(argv: list[str] | None = None) -> int:
    p = Parser(
        prog="cellcache demo",
        description="Simulated serving session through the cache, every token checked "
                    "against attention over its own sequence with no cache. Exit code 1 on "
                    "any mismatch, 2 on bad usage or when the cache refuses (one line on "
                    "stderr, e.g. --backend cuda where CUDA is not usable).")
    p.add_argument("--backend", choices=["auto", "host", "cuda"], default="auto",
                   help="cache backend (default: auto = cuda when a device is usable)")
    p.add_argument("--seqs", type=in_range(1, 1 << 16), default=32,
                   help="most live sequences (max_seqs; default 32)")
    p.add_argument("--steps", type=in_range(1, 10_000_000), default=300,
                   help="forward steps to run (default 300)")
    p.add_argument("--seed", type=in_range(0, 2**63 - 1), default=0, help="random seed (default 0)")
    p.add_argument("--capacity", type=in_range(MAX_WRITE, 1 << 24), default=2048,
                   help=f"cells in the pool, at least the step width {MAX_WRITE} (default 2048)")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="bfloat16")
    p.add_argument("--view", choices=list(VIEWS), default="bool",
                   help="what attention reads: bool masks, bit-packed masks, or the paged view")
    p.add_argument("--pad", action="store_true",
                   help="pad every step to a power-of-two width bucket (padding writes the sink)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        summary = run(args.backend, args.seqs, args.steps, args.seed, capacity=args.capacity,
                      dtype=args.dtype, view=args.view, pad=args.pad, progress=not args.quiet)
    except CellCacheError as e:        # e.g. --backend cuda without a driver: one line
        print(f"{p.prog}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2) if args.json else summary_line(summary))
    return 1 if summary["mismatches"] else 0
