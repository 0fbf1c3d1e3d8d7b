"""``cellcache demo``: a simulated serving session, checked token by token.

Sequences arrive over time, prefill in chunks and decode interleaved in one batch; some
fork with ``seq_clone(upto=...)`` (parallel sampling), some ``rewind`` (rejected
speculative tokens), some finish with ``seq_rm``; when the pool is full the longest
sequence is preempted. Every step runs the reference consumer (:mod:`cellcache.attention`)
through the cache on every layer and checks every token's output against a dense
per-sequence computation with no cache (its own history, its own window).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from . import attention
from .config import CacheConfig, LayerConfig, storage_dtype
from .registry import build

TOLERANCE = 1e-4

LAYERS = (LayerConfig(2, 16, 0), LayerConfig(2, 16, 8), LayerConfig(2, 16, 0), LayerConfig(2, 16, 32))
N_HEADS = 4          # grouped-query: 2 query heads per KV head


@dataclass
class Seq:
    sid: int
    target: int                      # finishes when it reaches this many tokens
    prompt_left: int                 # prompt tokens not yet prefilled
    length: int = 0                  # tokens in the cache (= cache.pos(sid))
    k: list = field(default_factory=list)   # per layer [max_len, n_kv_heads, head_dim] float32
    v: list = field(default_factory=list)


class Progress:
    """A one-line progress bar on stderr (a line per 10% when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.enabled = total, enabled
        self.tty = sys.stderr.isatty()
        self.last = -1

    def update(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        if self.tty:
            filled = 30 * done // self.total
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total} {note}")
            if done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif 10 * done // self.total != self.last:
            self.last = 10 * done // self.total
            print(f"demo: {done}/{self.total} steps {note}", file=sys.stderr, flush=True)


def run(backend: str = "auto", seqs: int = 32, steps: int = 300, seed: int = 0,
        capacity: int = 2048, max_write: int = 64, dtype: str = "bfloat16",
        progress: bool = True) -> dict:
    """Runs a session; returns the summary dict (``mismatches`` 0 when every token matched)."""
    rng = np.random.default_rng(seed)
    cfg = CacheConfig(capacity=capacity, layers=LAYERS, max_write=max_write,
                      initial_capacity=64, dtype=dtype, max_seqs=seqs)
    cache = build(backend, "batched-cell", cfg)
    st = storage_dtype(dtype)
    max_len = 160
    live: dict[int, Seq] = {}
    stats = {"forks": 0, "rewinds": 0, "finished": 0, "preempted": 0, "tokens": 0,
             "mismatches": 0, "arrivals": 0}
    max_err = 0.0
    prepare_us: list[float] = []
    peak = 0
    bar = Progress(steps, progress)

    def new_seq(sid: int, prompt: int) -> Seq:
        s = Seq(sid, target=int(rng.integers(prompt + 4, max_len)), prompt_left=prompt)
        s.k = [np.zeros((max_len, la.n_kv_heads, la.head_dim), np.float32) for la in LAYERS]
        s.v = [np.zeros((max_len, la.n_kv_heads, la.head_dim), np.float32) for la in LAYERS]
        return s

    for step_no in range(steps):
        # arrivals
        for _ in range(int(rng.integers(0, 3))):
            sid = cache.seq_new()
            if sid is None:
                break
            live[sid] = new_seq(sid, int(rng.integers(3, 48)))
            stats["arrivals"] += 1
        if not live:
            continue
        # the batch: one token per decoding sequence, prefill chunks for the rest
        batch: list[int] = []
        for s in rng.permutation(list(live)):
            seq = live[int(s)]
            room = max_write - len(batch)
            if room <= 0:
                break
            n = 1 if seq.prompt_left == 0 else min(int(rng.integers(4, 17)), seq.prompt_left, room)
            batch += [seq.sid] * n
        rng.shuffle(batch)           # interleave; each sequence's tokens keep their order
        while not cache.declare_step(batch):
            victim = max(live.values(), key=lambda q: q.length)
            cache.seq_rm(victim.sid)
            del live[victim.sid]
            stats["preempted"] += 1
            batch = [s for s in batch if s != victim.sid]
            if not batch:
                break
        if not batch:
            continue
        t0 = time.perf_counter()
        step = cache.prepare_step()
        prepare_us.append((time.perf_counter() - t0) * 1e6)
        width = step.width
        positions = step.positions
        # the forward, through the cache, layer by layer
        for li, layer in enumerate(LAYERS):
            q = rng.standard_normal((width, N_HEADS, layer.head_dim), dtype=np.float32)
            k = rng.standard_normal((width, layer.n_kv_heads, layer.head_dim), dtype=np.float32)
            v = rng.standard_normal((width, layer.n_kv_heads, layer.head_dim), dtype=np.float32)
            attention.write_kv(cache, li, k, v, width)
            out = attention.attend(cache, li, q, width)
            for i in range(width):  # the dense oracle sees the stored (rounded) K/V
                seq, p = live[int(step.seq_ids[i])], int(positions[i])
                seq.k[li][p] = k[i].astype(st).astype(np.float32)
                seq.v[li][p] = v[i].astype(st).astype(np.float32)
            for i in range(width):
                seq, p = live[int(step.seq_ids[i])], int(positions[i])
                ref = attention.dense_attention(q[i], seq.k[li], seq.v[li], p, layer.window)
                err = float(np.max(np.abs(out[i] - ref)))
                max_err = max(max_err, err)
                if not err <= TOLERANCE:
                    stats["mismatches"] += 1
        cache.commit_step()
        stats["tokens"] += width
        for sid in set(int(s) for s in step.seq_ids):
            seq = live[sid]
            n = int(np.count_nonzero(step.seq_ids == sid))
            seq.length += n
            seq.prompt_left = max(0, seq.prompt_left - n)
        peak = max(peak, cfg.capacity - cache.free_cells)
        # after the step: forks, rewinds, finishes
        for sid in list(live):
            seq = live[sid]
            if seq.prompt_left:
                continue
            if seq.length >= seq.target:
                cache.seq_rm(sid)
                del live[sid]
                stats["finished"] += 1
                continue
            r = rng.random()
            if r < 0.03 and seq.length > 1:
                upto = int(rng.integers(1, seq.length + 1))
                child = cache.seq_clone(sid, upto=upto)
                if child is not None:
                    c = new_seq(child, 0)
                    c.length = upto
                    c.k = [a.copy() for a in seq.k]
                    c.v = [a.copy() for a in seq.v]
                    live[child] = c
                    stats["forks"] += 1
            elif r < 0.10 and seq.length > 1:
                back = int(rng.integers(1, min(4, seq.length) + 1))
                assert cache.rewind(sid, seq.length - back)
                seq.length -= back
                stats["rewinds"] += 1
        for sid, seq in live.items():
            if cache.pos(sid) != seq.length:
                stats["mismatches"] += 1
        bar.update(step_no + 1, f"live {len(live)} cells {cfg.capacity - cache.free_cells}")
    m = cache.metrics()
    return {
        "backend": m["backend"],
        "steps": steps,
        "tokens": stats["tokens"],
        "arrivals": stats["arrivals"],
        "forks": stats["forks"],
        "rewinds": stats["rewinds"],
        "finished": stats["finished"],
        "preempted": stats["preempted"],
        "growths": m["growth_count"],
        "rows": m["flat_capacity"],
        "peak_cells": peak,
        "max_error": max_err,
        "median_prepare_us": statistics.median(prepare_us) if prepare_us else 0.0,
        "mismatches": stats["mismatches"],
    }


def summary_line(s: dict) -> str:
    return (f"demo [{s['backend']}]: {s['steps']} steps, {s['tokens']} tokens, "
            f"{s['arrivals']} arrivals, {s['forks']} forks, {s['rewinds']} rewinds, "
            f"{s['finished']} finished, {s['preempted']} preempted, {s['growths']} growths "
            f"({s['rows']} rows), peak {s['peak_cells']} cells, max error {s['max_error']:.2e}, "
            f"median prepare {s['median_prepare_us']:.0f} us, {s['mismatches']} mismatches")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="cellcache demo",
        description="Simulated serving session through the cache, every token checked "
                    "against a dense per-sequence computation. Exit code 1 on any mismatch.")
    p.add_argument("--backend", choices=["auto", "host", "cuda"], default="auto",
                   help="cache backend (default: auto = cuda when a device is usable)")
    p.add_argument("--seqs", type=int, default=32, help="most live sequences (max_seqs; default 32)")
    p.add_argument("--steps", type=int, default=300, help="forward steps to run (default 300)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--capacity", type=int, default=2048, help="cells in the pool (default 2048)")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="bfloat16")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.seqs < 1 or args.steps < 1:
        p.error("--seqs and --steps must be at least 1")
    summary = run(args.backend, args.seqs, args.steps, args.seed, capacity=args.capacity,
                  dtype=args.dtype, progress=not args.quiet)
    print(json.dumps(summary, indent=2) if args.json else summary_line(summary))
    return 1 if summary["mismatches"] else 0
