"""A simulated serving session over any cache and any forward, checked token by token.

Sequences arrive over time and prefill in chunks mixed with decode tokens in one step (each
sequence's tokens keep their order; sequences interleave); some fork with
``seq_clone(upto=...)`` (parallel sampling), some ``rewind`` (rejected speculative tokens),
some finish; when cells run short the longest sequence is preempted. Every step is padded
to its width bucket when buckets are given.

The forward is pluggable: a callable ``forward(cache, step, qkv) -> outputs`` that writes
each layer's K/V rows through the cache and returns each layer's attention outputs for the
step's real rows. The session draws q/k/v at random, keeps every sequence's stored (rounded)
K/V history, and checks every output against :func:`cellcache.attention.dense_attention`
over that history alone, with no cache: what the forward computed through cells, masks or
the paged view must equal attention over the sequence's own past. ``cellcache demo``,
``tools/capture_graph.py`` and the tests all run through :class:`Session`.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from . import attention
from .buckets import bucket_for, check_buckets
from .config import storage_dtype

__all__ = ["Forward", "Progress", "Session", "SessionConfig"]

#: forward(cache, step, qkv) -> per-layer outputs [width, n_heads, head_dim] (float32)
Forward = Callable[..., Sequence[np.ndarray]]


@dataclass
class SessionConfig:
    """The workload. ``buckets``: widths steps are padded to (the smallest that fits), or
    None for no padding. ``n_heads``: query heads per layer (a multiple of its kv heads)."""

    n_heads: int = 4
    max_len: int = 160                 # a sequence finishes before this many tokens
    prompt: tuple[int, int] = (3, 48)  # prompt length range [lo, hi)
    chunk: tuple[int, int] = (4, 17)   # prefill chunk range [lo, hi)
    arrivals: tuple[int, int] = (0, 3) # new sequences per step, range [lo, hi)
    max_live: int | None = None        # at most this many live sequences (None: max_seqs)
    p_fork: float = 0.03
    p_rewind: float = 0.07
    decode_only_every: int = 0         # every k-th step only decodes (0: never)
    buckets: Sequence[int] | None = None
    tolerance: float = 1e-4
    q_dtype: str | None = None         # round q to this dtype (a forward that reads it so)


@dataclass
class _SimSeq:
    target: int
    prompt_left: int
    length: int = 0
    k: list = field(default_factory=list)    # per layer [max_len, n_kv_heads, head_dim] float32
    v: list = field(default_factory=list)


class Progress:
    """A one-line progress bar on stderr (a line per 10% when stderr is not a terminal)."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label, self.enabled = max(1, total), label, enabled
        self.tty = sys.stderr.isatty()
        self.last = -1

    def update(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        if self.tty:
            filled = 30 * done // self.total
            sys.stderr.write(f"\r{self.label}: [{'#' * filled}{'.' * (30 - filled)}] "
                             f"{done}/{self.total} {note}  ")
            if done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif 10 * done // self.total != self.last:
            self.last = 10 * done // self.total
            print(f"{self.label}: {done}/{self.total} steps {note}", file=sys.stderr, flush=True)


class Session:
    """Drives ``cache`` through the workload with ``forward`` (see the module docstring)."""

    def __init__(self, cache, forward: Forward, config: SessionConfig | None = None,
                 seed: int = 0, stream: object = None):
        self.cache, self.forward = cache, forward
        self.cfg = config or SessionConfig()
        self.rng = np.random.default_rng(seed)
        self.stream = stream
        self.layers = cache.config.layers
        self.store = storage_dtype(cache.config.dtype)
        self.live: dict[int, _SimSeq] = {}
        self.max_write = cache.config.max_write
        self.buckets: list[int] | None = None
        if self.cfg.buckets is not None:
            self.buckets = check_buckets(self.cfg.buckets, self.max_write)
            self.max_write = self.buckets[-1]
        self.stats = {"steps": 0, "tokens": 0, "arrivals": 0, "forks": 0, "rewinds": 0,
                      "finished": 0, "preempted": 0, "mismatches": 0, "pos_mismatches": 0}
        self.max_error = 0.0
        self.per_bucket: dict[int, int] = {}
        self.prepare_us: list[float] = []
        self.peak = 0
        self._step_no = 0

    # -- bookkeeping ---------------------------------------------------------------------------
    def _new(self, prompt: int) -> _SimSeq:
        cfg = self.cfg
        s = _SimSeq(target=int(self.rng.integers(prompt + 4, cfg.max_len)), prompt_left=prompt)
        s.k = [np.zeros((cfg.max_len, la.n_kv_heads, la.head_dim), np.float32) for la in self.layers]
        s.v = [np.zeros((cfg.max_len, la.n_kv_heads, la.head_dim), np.float32) for la in self.layers]
        return s

    def _arrivals(self) -> None:
        cfg = self.cfg
        room = (cfg.max_live or self.cache.config.max_seqs) - len(self.live)
        for _ in range(min(room, int(self.rng.integers(*cfg.arrivals)))):
            sid = self.cache.seq_new()
            if sid is None:
                break
            self.live[sid] = self._new(int(self.rng.integers(*self.cfg.prompt)))
            self.stats["arrivals"] += 1

    def _batch(self) -> list[int]:
        cfg = self.cfg
        decode_only = cfg.decode_only_every and self._step_no % cfg.decode_only_every == 0
        batch: list[int] = []
        for s in self.rng.permutation(list(self.live)):
            seq = self.live[int(s)]
            room = self.max_write - len(batch)
            if room <= 0:
                break
            if seq.prompt_left == 0:
                batch.append(int(s))
            elif not decode_only:
                n = min(int(self.rng.integers(*cfg.chunk)), seq.prompt_left, room)
                batch += [int(s)] * n
        # interleave: shuffle the slots, then give each sequence its tokens in order
        order = self.rng.permutation(len(batch))
        return [batch[i] for i in order]

    def _declare(self, batch: list[int]) -> list[int]:
        while batch and not self.cache.declare_step(batch):
            victim = max(self.live, key=lambda s: self.live[s].length)
            assert self.cache.seq_rm(victim)
            del self.live[victim]
            self.stats["preempted"] += 1
            batch = [s for s in batch if s != victim]
        return batch

    def _pad_to(self, width: int) -> int | None:
        return None if self.buckets is None else bucket_for(width, self.buckets)

    def _draw(self, width: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        rng, out = self.rng, []
        q_dtype = storage_dtype(self.cfg.q_dtype) if self.cfg.q_dtype else None
        for la in self.layers:
            q = rng.standard_normal((width, self.cfg.n_heads, la.head_dim), dtype=np.float32)
            if q_dtype is not None:
                q = q.astype(q_dtype).astype(np.float32)
            out.append((q,
                        rng.standard_normal((width, la.n_kv_heads, la.head_dim), dtype=np.float32),
                        rng.standard_normal((width, la.n_kv_heads, la.head_dim), dtype=np.float32)))
        return out

    def _check(self, step, qkv, outputs) -> None:
        tol = self.cfg.tolerance
        for li, layer in enumerate(self.layers):
            q, out = qkv[li][0], outputs[li]
            for i in range(step.width):
                seq, p = self.live[int(step.seq_ids[i])], int(step.positions[i])
                ref = attention.dense_attention(q[i], seq.k[li], seq.v[li], p, layer.window)
                err = float(np.max(np.abs(np.asarray(out[i], dtype=np.float32) - ref)))
                self.max_error = max(self.max_error, err)
                if not err <= tol:
                    self.stats["mismatches"] += 1

    def _after_step(self) -> None:
        cfg, rng = self.cfg, self.rng
        for sid in list(self.live):
            seq = self.live[sid]
            if seq.prompt_left:
                continue
            if seq.length >= seq.target:
                assert self.cache.seq_rm(sid)
                del self.live[sid]
                self.stats["finished"] += 1
                continue
            r = rng.random()
            room = (cfg.max_live or self.cache.config.max_seqs) > len(self.live)
            if r < cfg.p_fork and seq.length > 1 and room:
                upto = int(rng.integers(1, seq.length + 1))
                child = self.cache.seq_clone(sid, upto=upto)
                if child is not None:
                    c = _SimSeq(target=seq.target, prompt_left=0, length=upto,
                             k=[a.copy() for a in seq.k], v=[a.copy() for a in seq.v])
                    self.live[child] = c
                    self.stats["forks"] += 1
            elif r < cfg.p_fork + cfg.p_rewind and seq.length > 1:
                back = int(rng.integers(1, min(4, seq.length) + 1))
                assert self.cache.rewind(sid, seq.length - back)
                seq.length -= back
                self.stats["rewinds"] += 1

    # -- one step -----------------------------------------------------------------------------
    def step(self):
        """One step: arrivals, a batch, declare (preempting), prepare (padded), the forward and
        its check, commit, then finishes, forks and rewinds. Returns the Step or None."""
        self._step_no += 1
        self._arrivals()
        if not self.live:
            return None
        batch = self._declare(self._batch())
        if not batch:
            return None
        pad_to = self._pad_to(len(batch))
        t0 = time.perf_counter()
        step = self.cache.prepare_step(stream=self.stream, pad_to=pad_to)
        self.prepare_us.append((time.perf_counter() - t0) * 1e6)
        qkv = self._draw(step.width)
        for li in range(len(self.layers)):        # the oracle sees the stored (rounded) K/V
            for i in range(step.width):
                seq, p = self.live[int(step.seq_ids[i])], int(step.positions[i])
                seq.k[li][p] = qkv[li][1][i].astype(self.store).astype(np.float32)
                seq.v[li][p] = qkv[li][2][i].astype(self.store).astype(np.float32)
        outputs = self.forward(self.cache, step, qkv)
        self._check(step, qkv, outputs)
        self.cache.commit_step()
        self.stats["steps"] += 1
        self.stats["tokens"] += step.width
        self.per_bucket[step.pad_to] = self.per_bucket.get(step.pad_to, 0) + 1
        for sid in {int(s) for s in step.seq_ids}:
            seq = self.live[sid]
            n = int(np.count_nonzero(step.seq_ids == sid))
            seq.length += n
            seq.prompt_left = max(0, seq.prompt_left - n)
        self.peak = max(self.peak, self.cache.capacity - self.cache.free_cells)
        self._after_step()
        for sid, seq in self.live.items():
            if self.cache.pos(sid) != seq.length:
                self.stats["pos_mismatches"] += 1
        return step

    def run(self, steps: int, progress: bool = False, label: str = "session") -> dict:
        """Runs ``steps`` steps; returns the summary (``mismatches`` 0 when all matched)."""
        bar = Progress(steps, label, progress)
        for k in range(steps):
            self.step()
            bar.update(k + 1, f"live {len(self.live)} cells {self.cache.capacity - self.cache.free_cells}")
        return self.summary()

    def summary(self) -> dict:
        m = self.cache.metrics()
        return {
            "backend": m["backend"], **self.stats,
            "mismatches": self.stats["mismatches"] + self.stats["pos_mismatches"],
            "growths": m["growth_count"], "rows": m["flat_capacity"], "peak_cells": self.peak,
            "max_error": self.max_error,
            "median_prepare_us": statistics.median(self.prepare_us) if self.prepare_us else 0.0,
            "per_bucket": dict(sorted(self.per_bucket.items())),
        }
