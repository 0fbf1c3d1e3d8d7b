"""The Generator across the ranks of a ``torch.distributed`` group (``Generator(tp=...)``):
one schedule, decided the same way on every rank, with rank 0 deciding whatever is not
deterministic (which requests arrive, cancels, callbacks).

::

    every rank, in lockstep (gen.step() / gen.run() on all of them)
    ------------------------------------------------------------------------------------------
    step start   hand-over  one all_reduce: rank 0's queue counts, the draws' checksum, the
                            cache's deferred state; then, only when rank 0 queued something,
                            its requests/cancels broadcast: every rank queues the same
                            requests (mirrors: same ids, prompts, sampling) and cancels
    schedule     the scheduler's cache verbs on a deferred tp.TPCache (local; growth agreed)
    forward      the model's own collectives (transformers' TP plan); graphs on every rank
    sample       every rank samples its own logits (identical after the TP plan gathers the
                 head's output) with the same keyed sampler: the same ids, no broadcast;
                 Sampler.launch's asynchronous Draw, so async_steps works as in one process
    apply        update_from_output: the same on every rank
    deliver      on_token callbacks on rank 0 only (a callback's failure is recorded)
    step end     hand-over  again: requests and cancels made during the step, callback
                            failures (the request ends with "error" everywhere)

**Sampling on every rank** (vLLM's workers do the same): the logits are bit-identical on
every rank and a token depends only on its logits and its key (seed, continuation, output
index), so every rank draws the same ids. That is checked, never assumed: when a step's
ids reach the host, each rank folds them into a running checksum (a hash of ids times
their slot, mod 2**61 - 1) that every hand-over compares (``[c, -c]`` in the all_reduce
MAX: equal iff ``max(c) == -max(-c)``; at once when the step lands in debug mode). Ids that
differ raise InvalidState on every rank naming the step ("the ranks' sampled ids
diverged"), at the end of the step() call that applied them, before any later decision
reads them; the generator refuses every later step (build new ones). A sampler that raises
does so on every rank (same inputs): each rolls its step back as one process does.

**Collectives per step**: two in a steady decode step (the two hand-overs), one more when
the step grows the pools (the growth agreement), one broadcast per hand-over that carries
requests; debug mode adds its digests. (Before: declare, prepare twice, commit, the draws'
broadcast and both hand-overs; rank 0 sampled synchronously and the others waited for its
ids, so the ranks ran serially and the asynchronous step path was off.)

**Contract.** Every rank builds its Generator with the same arguments and the same model
weights at the same point, then calls :meth:`Generator.step` / :meth:`Generator.run` the
same number of times (``gen.run()`` on every rank is the usual loop: ``step()`` returns the
same value on every rank, so ``while gen.step()`` ends together). Requests are added and
cancelled on rank 0 only (:meth:`Generator.add` / :meth:`Generator.cancel` raise
InvalidState on the others): they join at the next step boundary on every rank. Every rank
ends up with the same :class:`Request` objects (same ids, outputs and finish reasons, each
rank's own timings): ``gen.run()`` returns them everywhere, so any rank can read the
outputs, but only rank 0 runs ``on_token`` (streams) and should print. ``draft`` callables
are refused (proposals are user code on one rank; not broadcast yet). A prefix cache's
``policy`` and ``on_event`` run on every rank and must behave the same on each.

Differences from one process, all at step boundaries: a cancel takes effect at the next
boundary (the request stops being delivered at once on rank 0); an exception from an
``on_token`` callback ends its request with ``"error"`` on every rank at the step's end,
where every rank raises (rank 0 the callback's exception, the others InvalidState naming
it); ``busy`` counts only what every rank knows (requests queued on rank 0 and not yet
handed over are not in it).

Costs: each hand-over is one all_reduce of 15 int64s on the TPCache's gloo group (host
values; no device round trip with NCCL), plus one pickled broadcast when rank 0 has
requests, cancels or callback failures to hand over.

A rank's own failure after the step's agreement (a CUDA error, a signal, a bug: never an
allocation, which is agreed first) is raised on that rank at once; the others learn at the
next hand-over, raise the same error class naming the rank, and refuse from then on (if
they are waiting inside the model's collectives meanwhile, the group's timeout ends it).

Multi-node works the same way through torchrun's rendezvous (``torchrun --nnodes M
--nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m cellcache generate
--tp M*N ...``); nothing here is node-specific (untested: one host here). Tensor
parallelism across nodes is rarely worth it: the rowwise all-reduces then cross the slow link.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import InvalidArgument, InvalidState
from ..tp import TPCache
from .requests import Request
from .sampler import Draw, SamplerOutput, SampleSpec
from .scheduler import Job, Scheduler, Seq

__all__ = ["RankSync", "is_sharded", "tp_world"]

_MOD = (1 << 61) - 1              # the draws' running checksum is kept mod this prime


def tp_world(tp: Any) -> int | None:
    """The world size ``Generator(tp=...)`` asks for, or None for one process.

    ``None``, ``False`` or ``1``: one process (no group needed, none used). ``True``: the
    world of the initialized process group. An int N > 1: the initialized world, which must
    be N. InvalidArgument for anything else, InvalidState without a process group."""
    if tp is None or tp is False or (type(tp) is int and tp == 1):
        return None
    if not (tp is True or type(tp) is int) or (type(tp) is int and tp < 1):
        raise InvalidArgument(f"tp={tp!r} is not True, False, None or a world size >= 1")
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidState(f"tp={tp!r} needs an initialized torch.distributed process group: run "
                           "under torchrun and call torch.distributed.init_process_group() first")
    world = dist.get_world_size()
    if tp is not True and tp != world:
        raise InvalidArgument(f"tp={tp} but the process group has {world} ranks: tensor parallelism "
                              "runs over the whole world; give tp=True or tp={world}")
    return world if world > 1 else None


def is_sharded(model: Any) -> bool:
    """Whether ``model``'s weights are DTensors (a TP plan was applied already)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:                               # pragma: no cover - torch without DTensor
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


class RankSync:
    """Keeps a Generator's ranks in lockstep (the module docstring): installed by
    ``Generator(tp=...)`` as ``gen.tp``; ``rank`` and ``world`` are public. It reads the
    Generator only through public names (``requests``, ``scheduler``, ``clock``,
    ``sampler``, ``stats``); the Generator hands it rank 0's queued requests at each
    boundary. It switches the cache to deferred agreement (:meth:`TPCache.defer`): its
    hand-overs are the per-step rounds that settle it."""

    def __init__(self, gen: Any, cache: TPCache):
        self.gen = gen
        self.cache = cache
        self.rank, self.world = cache.rank, cache.world
        self.group = cache.agreement_group            # gloo: host values, bounded by its timeout
        self.src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        self._lock = threading.Lock()                 # rank 0: what callbacks and threads record
        self._cancels: list[Job] = []                 # rank 0: cancelled, not handed over yet
        self._cancelled: set[int] = set()             # their request ids (callbacks skipped)
        self._failures: list[tuple[int, int | None, BaseException]] = []   # rank 0: callbacks
        self._jobs: dict[int, Job] = {}               # request id -> job, every rank
        self._checksum = 0                            # every draw landed so far, hashed
        self._landed = 0                              # steps whose draws landed
        self._agreed = 0                              # ... as of the last agreement
        cache.defer()                                 # the hand-overs settle every step
        gen.sampler = _RankSampler(gen.sampler, self)

    # -- rank 0's side of add()/cancel() -----------------------------------------------------
    def adding(self, on_token: Callable | None, draft: Callable | None) -> Callable | None:
        """Checks an add() (rank 0 only, no drafts); returns the callback to store: one that
        records a failure instead of raising, and skips a cancelled or failed request."""
        if self.rank != 0:
            raise InvalidState(f"add() on rank {self.rank}: with tensor parallelism requests are "
                               "added on rank 0 only; the other ranks follow at the next step")
        if draft is not None:
            raise InvalidArgument("draft callables are not supported with tensor parallelism (a "
                                  "draft is user code on rank 0 only): add the request without one")
        if on_token is None:
            return None
        fn = on_token

        def guarded(req: Request, k: int, tok: int) -> None:
            if req.id in self._cancelled:
                return
            try:
                fn(req, k, tok)
            except BaseException as e:                # the request's own code: ends it everywhere
                with self._lock:
                    self._cancelled.add(req.id)
                    self._failures.append((req.id, k, e))

        return guarded

    def cancel(self, job: Job) -> bool:
        """Rank 0: records a cancel for the next step boundary (no callback of the request
        runs from now on); False when the request is already done."""
        if self.rank != 0:
            raise InvalidState(f"cancel() on rank {self.rank}: with tensor parallelism requests are "
                               "cancelled on rank 0 only; the other ranks follow at the next step")
        if job.req.done:
            return False
        with self._lock:
            self._cancelled.add(job.req.id)
            self._cancels.append(job)
        return True

    # -- every rank -----------------------------------------------------------------------------
    def handover(self, incoming: list[Seq]) -> None:
        """At a step boundary, on every rank: rank 0's ``incoming`` (the Generator's queue,
        empty elsewhere), cancels and callback failures, broadcast and applied the same way
        everywhere. Raises (on every rank, once everything is applied) when a callback
        failed: rank 0 its exception, the others InvalidState naming it."""
        gen = self.gen
        cancels: list[Job] = []
        failures: list[tuple[int, int | None, BaseException]] = []
        if self.rank == 0:
            with self._lock:
                cancels, self._cancels = self._cancels, []
                failures, self._failures = self._failures, []
        elif incoming:
            raise InvalidState(f"rank {self.rank} has requests of its own queued; add them on rank 0")
        counts = [len(incoming), len(cancels), len(failures)]
        try:                                          # rank 0's counts (the others give 0s),
            counts = self._agree(counts)              # the draws' checksums, the cache's state
        except BaseException:
            if self.rank == 0:                        # not handed over: kept for a later try
                with self._lock:
                    self._cancels[:0], self._failures[:0] = cancels, failures
            raise
        if not any(counts):
            return
        payload: list[Any] = [None]
        if self.rank == 0:
            payload = [([(s.req.id, s.req.prompt, s.req.sampling) for s in incoming],
                        [job.req.id for job in cancels],
                        [(rid, k, f"{type(e).__name__}: {e}") for rid, k, e in failures])]
        dist.broadcast_object_list(payload, self.src, group=self.group)
        new, cancel_ids, failed = payload[0]
        if self.rank != 0:
            incoming = [self._mirror(rid, prompt, sampling) for rid, prompt, sampling in new]
        for s in incoming:
            self._jobs[s.req.id] = s.job
        gen.scheduler.waiting.extend(incoming)
        for rid in cancel_ids:
            job = self._jobs[rid]
            if not job.req.done:
                gen.scheduler.end(job, "cancelled")
        first: BaseException | None = None
        for i, (rid, k, text) in enumerate(failed):
            job = self._jobs[rid]
            exc = failures[i][2] if self.rank == 0 else InvalidState(
                f"request {rid}'s on_token raised on rank 0 ({text}); it ended with 'error' on "
                f"every rank")
            if job.req.error is None:
                job.req.error = exc
            if not job.req.done:
                gen.scheduler.end(job, "error", k)
            first = first or exc
        if self.rank == 0:
            with self._lock:                          # handed over: ended, nothing left to skip
                self._cancelled -= set(cancel_ids) | {rid for rid, _, _ in failed}
        if first is not None:
            raise first

    def _mirror(self, rid: int, prompt: list[int], sampling: Any) -> Seq:
        """Ranks other than 0: the request rank 0 added, as add() queues it (same id)."""
        gen = self.gen
        n = sampling.n
        req = Request(rid, list(prompt), sampling, None, None, 0,
                      outputs=[[] for _ in range(n)], arrived=gen.clock(),
                      finish_reasons=[None] * n, token_times=[[] for _ in range(n)])
        if len(gen.requests) != rid:
            raise InvalidState(f"rank {self.rank} has {len(gen.requests)} requests and rank 0 sent "
                               f"request {rid}: the ranks' generators differ (build them the same way)")
        gen.requests.append(req)
        return Scheduler.new_seq(Job(req), 0, list(prompt))

    # -- the draws: every rank samples; their checksums are compared --------------------------------
    def landed(self, out: SamplerOutput) -> None:
        """A step's draws reached the host (every rank, in the same order): folds them into
        the running checksum the next agreement compares (at once in debug mode)."""
        ids = np.asarray(out.ids).astype(np.uint64, copy=False)
        accepted = np.asarray(out.accepted).astype(np.uint64, copy=False)
        with np.errstate(over="ignore"):              # wrapping: the same on every rank
            h = int((ids * np.arange(1, ids.size + 1, dtype=np.uint64)).sum(dtype=np.uint64))
            h ^= int((accepted * np.arange(3, 2 * accepted.size + 3, 2, dtype=np.uint64))
                     .sum(dtype=np.uint64)) << 1
        self._checksum = (self._checksum * 1_000_003 + h % _MOD + ids.size) % _MOD
        self._landed += 1
        if self.cache.debug:
            self._agree([0, 0, 0])

    def _agree(self, counts: list[int]) -> list[int]:
        """The one collective of a hand-over (the cache's :meth:`TPCache.exchange`): the max of
        the counts (rank 0's: the others give 0s) and of ``[checksum, -checksum]``; raises
        InvalidState on every rank, the wrapper refusing from then on, when the checksums
        differ (equal iff ``max(c) == -max(-c)``)."""
        if self.rank != 0:
            counts = [0, 0, 0]
        got = self.cache.exchange([*counts, self._checksum, -self._checksum])
        if got[3] != -got[4]:
            first, last = self._agreed + 1, self._landed
            steps = f"step {last}" if first >= last else f"steps {first} to {last}"
            reason = (f"the ranks' sampled ids diverged at {steps} (counting the steps whose draws "
                      f"landed; the generator's step {self.gen.stats['steps']}): rank {self.rank}'s "
                      f"checksum {self._checksum}, the ranks' range [{-got[4]}, {got[3]}]")
            self.cache.mark_diverged(reason)
            raise InvalidState(f"{reason}; the ranks' outputs differ from there: build new generators")
        self._agreed = self._landed
        return got[:3]


class _CheckedDraw:
    """A launched step's draws under TP (what :meth:`Sampler.launch` returns, wrapped):
    ``device_ids`` at once; :meth:`result` lands them and folds them into the ranks'
    checksum, once."""

    __slots__ = ("_draw", "_sync", "_out", "device_ids")

    def __init__(self, draw: Draw, sync: RankSync):
        self._draw, self._sync = draw, sync
        self._out: SamplerOutput | None = None
        self.device_ids = draw.device_ids

    def result(self) -> SamplerOutput:
        if self._out is None:
            out = self._draw.result()
            self._sync.landed(out)
            self._out = out
        return self._out


class _RankSampler:
    """The Generator's sampler under TP: every rank samples its own (identical) logits with
    the same sampler (``inner``), so the draws are the same everywhere without a broadcast;
    :meth:`launch` is the inner sampler's asynchronous launch, its Draw wrapped to be
    checked. Everything else (``device``, ``copies``, ...) is the inner sampler's."""

    def __init__(self, inner: Any, sync: RankSync):
        self.inner, self._sync = inner, sync

    def __call__(self, logits: torch.Tensor, spec: SampleSpec) -> SamplerOutput:
        return self.launch(logits, spec).result()

    def launch(self, logits: torch.Tensor, spec: SampleSpec, greedy: torch.Tensor | None = None) -> Any:
        """:meth:`Sampler.launch` on this rank, the Draw checked when it lands."""
        # (greedy only when given: a sampler with the older two-argument launch still works)
        draw = self.inner.launch(logits, spec) if greedy is None else self.inner.launch(logits, spec, greedy)
        return _CheckedDraw(draw, self._sync)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
