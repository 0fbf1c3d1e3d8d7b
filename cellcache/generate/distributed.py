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
                            failures (the request ends with "error" everywhere); skipped
                            when no live request streams (on_token) and the generator
                            stays busy: see RankSync.handover

**Sampling on every rank** (vLLM's workers do the same): the logits are bit-identical on
every rank and a token depends only on its logits and its key (seed, continuation, output
index), so every rank draws the same ids. That is checked, never assumed: when a step's
ids reach the host, each rank folds them into a running checksum (a hash of ids times
their slot, mod 2**61 - 1) that every hand-over compares (``[c, -c]`` in the all_reduce
MAX: equal iff ``max(c) == -max(-c)``; at once when the step lands in debug mode). Ids that
differ raise InvalidState on every rank naming the step ("the ranks' sampled ids
diverged"), at the next hand-over after they landed (the step's end, or the next step's
start when the end needs none), before any later decision reads them; the generator refuses
every later step (build new ones). A sampler that raises does so on every rank (same
inputs): each rolls its step back as one process does.

**Collectives per step**: one in a steady decode step without streams (the step's start
hand-over; the end's is needed only when a callback may have queued something one process
applies at once, or when the generator may go idle), two with streams (on_token), one more
when the step grows the pools (the growth agreement), one broadcast per hand-over that
carries requests; debug mode adds its digests and keeps both hand-overs. (Before: declare,
prepare twice, commit, the draws' broadcast and both hand-overs; rank 0 sampled
synchronously and the others waited for its ids, so the ranks ran serially and the
asynchronous step path was off.)

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
A rank that stops answering or dies: the others' hand-over (or the model's collective they
wait in) ends within the group's timeout, or at once when its connection closes; a
hand-over raises InvalidState on one line naming the rank (:meth:`TPCache.collective`), and
``gen.cache.peer_error(e)`` turns the backend's error from the model's collectives into the
same (what a CLI prints); every later step raises it at once.

**Teardown.** With NCCL (2.26 and later) a communicator is not destroyed while a CUDA graph
that captured one of its kernels lives: ``destroy_process_group()`` waits for the decode
graphs to go. Drop every Generator (its runner holds the graphs) before it; nothing here
keeps one alive (the RankSync holds its Generator weakly: no reference cycle, so the last
reference going frees the graphs at once, without a garbage collection).

Multi-node works the same way through torchrun's rendezvous (``torchrun --nnodes M
--nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m cellcache generate
--tp M*N ...``); nothing here is node-specific (untested: one host here). Tensor
parallelism across nodes is rarely worth it: the rowwise all-reduces then cross the slow link.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch.distributed as dist

from ..errors import InvalidArgument, InvalidState
from ..tp import TPCache
from .requests import Request
from .sampler import SamplerOutput
from .scheduler import Job, Seq

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
    ``Generator(tp=...)`` as ``gen.tp``; ``rank`` and ``world`` are public. It holds the
    Generator weakly and reads it through public names (``requests``, ``scheduler``,
    ``clock``, ``stats``, ``busy``); the Generator hands it rank 0's queued requests at each
    boundary and every step's draws as they land (:meth:`landed`). It switches the cache to deferred agreement
    (:meth:`TPCache.defer`): its hand-overs are the per-step rounds that settle it."""

    def __init__(self, gen: Any, cache: TPCache):
        # weakly: the Generator holds this (gen.tp), and a cycle would keep a generator that
        # went out of scope, its runner and CUDA graphs alive until a garbage collection. NCCL
        # (2.26+) will not destroy a communicator while a CUDA graph that captured one of its
        # kernels lives: destroy_process_group() after the generator's last use (the CLI, the
        # bench) then blocked forever.
        self._gen = weakref.ref(gen)
        self.cache = cache
        self.rank, self.world = cache.rank, cache.world
        self.group = cache.agreement_group            # gloo: host values, bounded by its timeout
        self.src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        self._lock = threading.Lock()                 # rank 0: what callbacks and threads record
        self._cancels: list[Job] = []                 # rank 0: cancelled, not handed over yet
        self._cancelled: set[int] = set()             # their request ids (callbacks skipped)
        self._failures: list[tuple[int, int | None, BaseException]] = []   # rank 0: callbacks
        # request id -> job, every rank, while the job lives (the Generator lets finished
        # requests go; a cancel or failure of one handed over after that finds nothing)
        self._jobs: weakref.WeakValueDictionary[int, Job] = weakref.WeakValueDictionary()
        self._checksum = 0                            # every draw landed so far, hashed
        self._landed = 0                              # steps whose draws landed
        self._agreed = 0                              # ... as of the last agreement
        self._handed = 0                              # ... as of the last hand-over
        self._held: list[Seq] = []                    # rank 0: queued, not handed over yet
        self._streamed: dict[int, Job] = {}           # every rank: live requests with on_token
        self._callbacks = False                       # ... some live at this step's start
        self.exchanges = 0                            # hand-over rounds run
        self.skipped = 0                              # step ends that needed none (see handover)
        cache.defer()                                 # the hand-overs settle every step

    @property
    def gen(self) -> Any:
        """The Generator this keeps in lockstep (held weakly)."""
        gen = self._gen()
        if gen is None:
            raise InvalidState("the generator of this RankSync is gone")
        return gen

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
    def handover(self, incoming: list[Seq], end: bool | None = None) -> None:
        """At a step boundary, on every rank: rank 0's ``incoming`` (the Generator's queue,
        empty elsewhere), cancels and callback failures, broadcast and applied the same way
        everywhere. Raises (on every rank, once everything is applied) when a callback
        failed: rank 0 its exception, the others InvalidState naming it.

        ``end``: whether this is the hand-over at the end of a step (after its callbacks);
        None infers it: a step's draws landed since the last hand-over (only a step's end
        sees one; the same on every rank).
        **A step's end needs no round** when every rank knows, from state they share, that
        nothing rank 0 could have queued during the step must be applied before the step
        returns: no live request had an ``on_token`` callback at the step's start (only
        callbacks add, cancel or fail during a step in a way one process applies at once),
        and the generator stays busy (``step()`` returns True whatever rank 0 queued), and
        not in debug mode. What another thread queued on rank 0 meanwhile joins at the next
        step's start, before anything is scheduled: the schedule is the same as one
        process's (which applies it at the step's end, before the same next schedule). The
        draws' checksums and the cache's deferred state are then compared at the next
        step's start, still before any later decision reads the draws. So a steady decode
        step without streams runs one round, not two. Every rank takes the same decision
        (the round carries which hand-over it is: ranks that disagree raise InvalidState
        instead of pairing two different hand-overs). Inferred, a step that raised on every
        rank after its draws landed and before its end makes the next call's start count as
        an end: at worst what rank 0 queued between those calls joins one step later."""
        gen = self.gen
        if end is None:
            end = self._landed != self._handed
        self._handed = self._landed
        if self.rank != 0 and incoming:
            raise InvalidState(f"rank {self.rank} has requests of its own queued; add them on rank 0")
        if end and not self._callbacks and not self.cache.debug and gen.busy:
            if incoming:                              # rank 0: joins at the next step's start
                self._held.extend(incoming)
            self.skipped += 1
            return
        cancels: list[Job] = []
        failures: list[tuple[int, int | None, BaseException]] = []
        if self.rank == 0:
            if self._held:
                incoming, self._held = self._held + list(incoming), []
            with self._lock:
                cancels, self._cancels = self._cancels, []
                failures, self._failures = self._failures, []
        counts = [len(incoming), len(cancels), len(failures)]
        try:                                          # rank 0's counts (the others give 0s),
            counts = self._agree(counts, 2 if end else 1)   # the draws' checksums, the cache's state
        except BaseException:
            if self.rank == 0:                        # not handed over: kept for a later try
                self._held[:0] = incoming
                with self._lock:
                    self._cancels[:0], self._failures[:0] = cancels, failures
            raise
        try:
            if any(counts):
                self._apply(incoming, cancels, failures)
        finally:
            if not end:                               # what the step's end decides from
                self._callbacks = self._streams_live()

    def _streams_live(self) -> bool:
        """Whether a live request has an ``on_token`` callback (on rank 0; every rank knows
        which from the hand-over), dropping the ones done."""
        streamed = self._streamed
        if not streamed:
            return False
        done = [rid for rid, job in streamed.items() if job.req.done]
        for rid in done:
            del streamed[rid]
        return bool(streamed)

    def _apply(self, incoming: list[Seq], cancels: list[Job],
               failures: list[tuple[int, int | None, BaseException]]) -> None:
        """The hand-over's payload, broadcast from rank 0 and applied on every rank."""
        gen = self.gen
        payload: list[Any] = [None]
        if self.rank == 0:
            payload = [([(s.req.id, s.req.prompt, s.req.sampling, s.req.on_token is not None)
                         for s in incoming],
                        [job.req.id for job in cancels],
                        [(rid, k, f"{type(e).__name__}: {e}") for rid, k, e in failures])]
        with self.cache.collective("the hand-over's broadcast"):
            dist.broadcast_object_list(payload, self.src, group=self.group)
        new, cancel_ids, failed = payload[0]
        if self.rank != 0:
            incoming = [self._mirror(rid, prompt, sampling) for rid, prompt, sampling, _ in new]
        for s, (rid, _, _, streamed) in zip(incoming, new):
            self._jobs[rid] = s.job
            if streamed:
                self._streamed[rid] = s.job
        gen.scheduler.waiting.extend(incoming)
        for rid in cancel_ids:
            job = self._jobs.get(rid)
            if job is not None and not job.req.done:
                gen.scheduler.end(job, "cancelled")
        first: BaseException | None = None
        for i, (rid, k, text) in enumerate(failed):
            job = self._jobs.get(rid)
            exc = failures[i][2] if self.rank == 0 else InvalidState(
                f"request {rid}'s on_token raised on rank 0 ({text}); it ended with 'error' on "
                f"every rank")
            if job is not None:
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
        return self.gen.mirror(rid, prompt, sampling)

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
            self._agree([0, 0, 0], 3)

    def _agree(self, counts: list[int], kind: int = 3) -> list[int]:
        """The one collective of a hand-over (the cache's :meth:`TPCache.exchange`): the max of
        the counts (rank 0's: the others give 0s), of ``[checksum, -checksum]`` and of
        ``[kind, -kind]`` (1: a step's start, 2: its end, 3: debug's check of landed draws);
        raises InvalidState on every rank, the wrapper refusing from then on, when the
        checksums differ (equal iff ``max(c) == -max(-c)``) or the ranks ran different
        hand-overs."""
        if self.rank != 0:
            counts = [0, 0, 0]
        got = self.cache.exchange([*counts, self._checksum, -self._checksum, kind, -kind])
        self.exchanges += 1
        if got[5] != -got[6]:
            reason = (f"the ranks ran different hand-overs at once (rank {self.rank}: kind {kind}, "
                      f"the generator's step {self.gen.stats['steps']}); their steps are out of step")
            self.cache.mark_diverged(reason)
            raise InvalidState(f"{reason}: build new generators")
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
