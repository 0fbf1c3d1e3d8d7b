"""The Generator across the ranks of a ``torch.distributed`` group (``Generator(tp=...)``):
one schedule, decided the same way on every rank, with rank 0 deciding whatever is not
deterministic.

::

    every rank, in lockstep (gen.step() / gen.run() on all of them)
    ------------------------------------------------------------------------------------------
    step start   hand-over  rank 0's add()/cancel() queues ──broadcast──▶ every rank queues the
                            same requests (mirrors: same ids, prompts, sampling) and cancels
    schedule     the scheduler's cache verbs on a tp.TPCache (deterministic; growth, refusals
                 and allocation failures agreed there)
    forward      the model's own collectives (transformers' TP plan); graphs on every rank
    sample       rank 0 draws ──broadcast the ids──▶ every rank decides with rank 0's tokens
    apply        update_from_output: the same on every rank
    deliver      on_token callbacks on rank 0 only (a callback's failure is recorded)
    step end     hand-over  again: requests and cancels made during the step, callback
                            failures (the request ends with "error" everywhere)

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

Costs: the hand-overs are one broadcast of three ints each when nothing was queued (the
requests themselves go as one pickled object when there are some); the draws one
broadcast of the step's ids (int64). All on the TPCache's gloo group (host values; no
device round trip with NCCL).

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
from .sampler import SamplerOutput, SampleSpec
from .scheduler import Job, Scheduler, Seq

__all__ = ["RankSync", "is_sharded", "tp_world"]


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
    ``sampler``); the Generator hands it rank 0's queued requests at each boundary."""

    def __init__(self, gen: Any, cache: TPCache):
        self.gen = gen
        self.rank, self.world = cache.rank, cache.world
        self.group = cache.agreement_group            # gloo: host values, bounded by its timeout
        self.src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        self._lock = threading.Lock()                 # rank 0: what callbacks and threads record
        self._cancels: list[Job] = []                 # rank 0: cancelled, not handed over yet
        self._cancelled: set[int] = set()             # their request ids (callbacks skipped)
        self._failures: list[tuple[int, int | None, BaseException]] = []   # rank 0: callbacks
        self._jobs: dict[int, Job] = {}               # request id -> job, every rank
        gen.sampler = _RankZeroSampler(gen.sampler, self)

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
        counts = torch.tensor([len(incoming), len(cancels), len(failures)], dtype=torch.int64)
        dist.broadcast(counts, self.src, group=self.group)
        if not counts.any():
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

    def draws(self, sampler: Any, logits: torch.Tensor, spec: SampleSpec) -> SamplerOutput:
        """Rank 0 samples; its ids (and accepted counts) are broadcast: every rank decides with
        rank 0's tokens. A sampling failure on rank 0 is raised there and as InvalidState on
        the others (each rolls its step back)."""
        n, g = len(spec), len(spec.groups)
        if n + g == 0:
            return SamplerOutput(np.zeros(0, np.int64), np.zeros(0, np.int64))
        buf = torch.zeros(1 + n + g, dtype=torch.int64)
        error: BaseException | None = None
        out: SamplerOutput | None = None
        if self.rank == 0:
            try:
                out = sampler(logits, spec)
                buf[1:1 + n] = torch.from_numpy(np.asarray(out.ids, dtype=np.int64))
                buf[1 + n:] = torch.from_numpy(np.asarray(out.accepted, dtype=np.int64))
            except BaseException as e:  # noqa: BLE001 - the others are told, then it is raised
                error = e
                buf[0] = 1
        dist.broadcast(buf, self.src, group=self.group)
        if error is not None:
            raise error
        if buf[0]:
            raise InvalidState("sampling failed on rank 0 (its step raised there); this rank "
                               "rolled its step back too")
        if out is not None:
            return out
        ids = buf[1:1 + n].numpy().copy()
        device_ids = torch.from_numpy(ids).to(logits.device, non_blocking=False)
        return SamplerOutput(ids, buf[1 + n:].numpy().copy(), device_ids)


class _RankZeroSampler:
    """The Generator's sampler under TP: ``__call__`` is :meth:`RankSync.draws`; everything
    else (``device``, ``copies``, ...) is the wrapped sampler's."""

    def __init__(self, inner: Any, sync: RankSync):
        self._inner, self._sync = inner, sync

    def __call__(self, logits: torch.Tensor, spec: SampleSpec) -> SamplerOutput:
        return self._sync.draws(self._inner, logits, spec)

    def launch(self, logits: torch.Tensor, spec: SampleSpec) -> Any:
        """:meth:`Sampler.launch` under TP: the draws agreed at once (rank 0's ids broadcast
        over the host group), handed back as a finished ``Draw``. (Overlapping the next
        step with the copy would broadcast ``device_ids`` on the device group instead.)"""
        from . import sampler as _sampler

        return _sampler.Draw(self._sync.draws(self._inner, logits, spec))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

