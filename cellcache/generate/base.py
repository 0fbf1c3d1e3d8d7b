"""Every serving decision, made on the host without a model (the plain scheduler).

::

    waiting --admit (prefix hit, cache id, evictions)--> running
    schedule():  decode rows -> drafts -> prompt chunks -> admissions   (token budget,
                 free cells, max_kv) -> declare -> StepPlan (rows, tokens, logit rows,
                 the SampleSpec of every token to draw)
    ... the caller prepares the step, runs a forward, samples (one host copy of ids) ...
    decide(plan, output, take) -> Outcomes          (verify walk, forks, stop checks;
                                                     nothing changed yet)
    update_from_output(outcomes) -> events           (tokens appended, rejected drafts
                                                     rewound, forks cloned, finished
                                                     sequences stored and freed)
    rollback(plan, commit)                           (a failed step: everything as before)
    schedule_decode(after) / apply_decode(plan, ids) (the lean decode step: every running
                                                     sequence's next token, nothing else)

:class:`BaseScheduler` owns the queues (``waiting``, ``running``), preemption and the ``stats``
counters; every cache and prefix-cache verb goes through its :class:`~.kv.KVManager`
(``kv``), and every serving rule (tokens to feed, cells claimed, the stop rule) is a method
of the plan's objects (:mod:`.plan`). It never runs user code and never touches torch:
tests drive it with a fake forward (``tests/test_scheduler_*.py``).
:class:`~.scheduler.Scheduler` (the Generator's) adds the host-speed path of consecutive
lean steps as a subclass.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]
import math
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..cache import CellCache
from ..prefix import PrefixCache
from ..radix import PendingPrompts
from .kv import KVManager
from .plan import Job, Outcome, SamplerOutput, SampleSpec, Seq, SlotExtra, StepPlan
from .requests import real_number

__all__ = ["ADMISSION_POLICIES", "STATS", "BaseScheduler", "HoldInterrupts", "read_clock"]

#: Which waiting sequence admission considers first: ``"fifo"`` (arrival order) or
#: ``"lpm"`` (longest cached prefix first, SGLang's policy; preempted sequences still first).
ADMISSION_POLICIES = ("fifo", "lpm")

#: Stats counters (every key starts at 0).
STATS = ("steps", "tokens_in", "tokens_out", "preempted", "forks", "drafted", "accepted",
         "graph_steps", "prompt_tokens", "cached_tokens", "computed_tokens", "spilled",
         "restored_tokens", "l2_found")

_SIGINT = int(signal.SIGINT)


class HoldInterrupts:
    """Holds Ctrl-C back while the generator's bookkeeping runs (on the main thread, with
    Python's default SIGINT handler): an interrupt there would leave sequences half
    advanced. ``hit`` tells the caller to raise KeyboardInterrupt once the state is whole.
    Inside another hold it does nothing (the outer one, whose handler is installed, keeps
    the interrupt)."""

    def __init__(self) -> None:
        self.hit = False
        self._old: Any = None

    def _handler(self, signum: int, frame: Any) -> None:
        self.hit = True

    # _signal: the functions behind the signal module's, without its enum conversions (run
    # twice a step)
    def __enter__(self) -> HoldInterrupts:
        if threading.current_thread() is threading.main_thread() \
                and _signal.getsignal(_SIGINT) is signal.default_int_handler:
            self._old = _signal.signal(_SIGINT, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            _signal.signal(_SIGINT, self._old)
            self._old = None


def read_clock(clock: Callable[[], Any]) -> float:
    """A reading of a user's clock as a float; InvalidArgument when it is not a finite real
    number (:func:`~cellcache.generate.requests.real_number`'s rule)."""
    return real_number(clock(), "the clock's reading")


class BaseScheduler:
    """Admission, chunking under a token budget, preemption, forks and draft rewinds over
    ``cache`` (module docstring). ``max_batch``: rows a step (the token budget, at most the
    cache's ``max_write``); ``prefill_chunk``: prompt tokens one sequence reads a step;
    ``reserve``, ``admission`` and the prefix cache as :class:`cellcache.generate.Generator`
    documents them; ``clock`` stamps finished requests and token times.

    Example (no model: the caller stands in for the forward and the sampler)
    -------
    >>> sched = BaseScheduler(cache, None, max_batch=16, prefill_chunk=8)      # doctest: +SKIP
    >>> sched.waiting.append(sched.new_seq(Job(request), 0, list(request.prompt)))  # doctest: +SKIP
    >>> plan = sched.schedule()                 # declared: prepare, forward, sample  # doctest: +SKIP
    >>> sched.update_from_output(sched.decide(plan, output)[0])               # doctest: +SKIP
    """

    def __init__(self, cache: CellCache, prefix: PrefixCache | None, *, max_batch: int,
                 prefill_chunk: int, reserve: float = 1.0, eos: set[int] | None = None,
                 admission: str = "fifo", clock: Callable[[], float] | None = None,
                 max_running: int | None = None):
        import time

        self.max_batch = max_batch
        #: Sequences admitted to run at once at most (None: as many as the cache has ids);
        #: a request's continuations forked when its prompt ends may pass it by ``n - 1``.
        self.max_running = max_running
        self.prefill_chunk = prefill_chunk
        self.reserve = reserve
        self.eos: set[int] = set(eos or ())
        self.admission = admission
        self.clock = clock or time.perf_counter
        self.waiting: list[Seq] = []          # no cache id yet (new, or preempted)
        self.running: list[Seq] = []
        # errors of user code called in the middle of the bookkeeping (a prefix cache's
        # on_event, the clock), raised once the step is complete
        self.later: list[BaseException] = []
        #: The door to the cache and the prefix cache.
        self.kv = KVManager(cache, prefix, self.later)
        self._last_time = 0.0                 # the clock's last good reading
        #: Jobs whose request finished since the caller last emptied the list (the
        #: Generator lets them go: nothing of it keeps a finished request).
        self.ended_jobs: list[Job] = []
        #: Jobs with text streams a continuation of which ended since the caller last
        #: emptied the list (the Generator closes their texts).
        self.ended_streams: list[Job] = []
        self.stats: dict[str, int] = dict.fromkeys(STATS, 0)
        #: Bumped whenever a sequence is freed or a request ended: what was planned before
        #: about the running sequences may no longer hold.
        self.epoch = 0
        self._stamps = 0

    @property
    def cache(self) -> CellCache:
        return self.kv.cache

    @property
    def prefix(self) -> PrefixCache | None:
        return self.kv.prefix

    @property
    def pending(self) -> PendingPrompts:
        """The prompts being read (with a prefix cache on)."""
        return self.kv.pending

    def now(self) -> float:
        """The clock's time. A clock that raises (or returns something that is not a real
        number) is user code failing in the middle of the bookkeeping: its exception is kept
        in ``later`` (raised when the step is complete) and the clock's last good reading
        stands in, so no state is left half changed."""
        try:
            self._last_time = t = read_clock(self.clock)
        except BaseException as e:
            self.later.append(e)
            return self._last_time
        return t

    def sync(self) -> None:
        """Makes the requests' and sequences' lists plain lists holding every token the
        scheduler applied (a subclass may keep some in arrays, read through): every path
        calls it first, as it appends to them."""

    def flush(self) -> None:
        """What the Generator calls before it hands its sequences out: nothing to do here
        or in a subclass (a sequence whose tokens an array store holds reads through it)."""

    # -- sequences ----------------------------------------------------------------------------------
    @staticmethod
    def new_seq(job: Job, index: int, tokens: list[int]) -> Seq:
        return Seq(job, index, tokens)

    def tokens_of(self, s: Seq) -> np.ndarray:
        """s's tokens as int32."""
        self.sync()
        return s.tokens_array()

    def free(self, s: Seq, store: bool = False) -> None:
        """Gives back s's cache id and cells; s is then a sequence to be read from scratch.
        ``store``: s ends, its tokens in the cache go to the prefix cache first."""
        self.sync()
        self.epoch += 1
        self.kv.release(s, store)

    # -- ending sequences and requests --------------------------------------------------------------
    def finish(self, s: Seq, reason: str) -> None:
        """Ends continuation s (already out of the queues, or about to be) with reason."""
        self.free(s, store=True)
        self._ended(s, reason)

    def _ended(self, s: Seq, reason: str) -> None:
        """The end of :meth:`finish`, s freed: its request's finish reasons (and time)."""
        req = s.req
        reasons = req.finish_reasons
        if s.forks_next():                    # its continuations never started
            for k in range(1, req.sampling.n):
                if reasons[k] is None:
                    reasons[k] = reason
        reasons[s.index] = reason
        if req.streams_text:
            self.ended_streams.append(s.job)
        if req.finished is None and None not in reasons:
            req.finished = self.now()
            self.ended_jobs.append(s.job)

    def end(self, job: Job, reason: str, index: int | None = None) -> None:
        """Ends every unfinished continuation of job's request (and continuation ``index``,
        finished or not) with reason; frees their cells; no callback of it runs again."""
        self.sync()
        job.closed = True
        self.epoch += 1
        req = job.req
        ending = []
        for queue in (self.running, self.waiting):
            mine = [s for s in queue if s.job is job]
            if mine:
                queue[:] = [s for s in queue if s.job is not job]
                ending += mine
        for k, r in enumerate(req.finish_reasons):    # ended first: whatever a free raises
            if r is None or k == index:
                req.finish_reasons[k] = reason
        if req.streams_text:
            self.ended_streams.append(job)
        if req.finished is None:
            req.finished = self.now()
            self.ended_jobs.append(job)
        self._free_all(ending)

    def end_one(self, job: Job, index: int, reason: str) -> None:
        """Ends continuation ``index`` of job's request alone with ``reason`` (a stop string
        found in its text): freed (its tokens stored in the prefix cache) and out of the
        queues; the request's other continuations go on. One that ended already (in the
        step that applied the same token) takes ``reason`` instead of its own."""
        self.sync()
        for queue in (self.running, self.waiting):
            for i, s in enumerate(queue):
                if s.job is job and s.index == index:
                    del queue[i]
                    self.finish(s, reason)
                    return
        reasons = job.req.finish_reasons
        if reasons[index] is not None:
            reasons[index] = reason

    def raise_interrupt(self) -> None:
        """Raises (and forgets) the first KeyboardInterrupt or SystemExit that user code
        raised into ``later`` during a call outside a step (``cancel()``: no step end to
        raise it at); Exceptions stay for the next step, as they would within one."""
        for i, e in enumerate(self.later):
            if not isinstance(e, Exception):
                del self.later[i]
                raise e

    def _free_all(self, seqs: list[Seq]) -> None:
        """Frees (and stores) every sequence of ``seqs``, even when one free raises (what a
        user's ``on_event`` raises is kept in ``later`` instead); the first such exception
        propagates once all are freed."""
        first: BaseException | None = None
        for s in seqs:
            try:
                self.free(s, store=True)
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    # -- admission and preemption ---------------------------------------------------------------
    def _preempt(self) -> None:
        """Frees the most recently admitted running sequence and requeues it at the head of
        the queue; it is read again (prompt and output so far) when admitted."""
        v = max(self.running, key=lambda s: s.stamp)
        self.kv.spill(v)                  # (a host copy of its K/V, when the tier holds it)
        self.running.remove(v)
        spill, v.spill = v.spill, None
        self.free(v)
        v.spill = spill
        self.waiting.insert(0, v)
        self.stats["preempted"] += 1
        self.stats["spilled"] += spill is not None

    def schedule(self) -> StepPlan | None:
        """Chooses and declares the step's rows; None when nothing is left to run.

        Where cells run short the prefix cache evicts first; then it preempts (most recent
        first) until every running sequence's next token has a cell; a sequence that cannot
        get one even alone, or a waiting one that cannot be admitted into an idle cache
        (every free cell or id held outside the generator), ends with "capacity". Each pass
        evicts, preempts or ends a sequence, or declares a step: it returns. The plan
        depends only on the state after the previous step's update_from_output.
        """
        self.sync()
        if self.running and not self.waiting:
            plan = self.schedule_decode()
            if plan is not None:
                return plan
        kv = self.kv
        preempted = False
        while self.running or self.waiting:
            free = kv.free_cells
            decoding = [s for s in self.running if s.to_feed == 1]
            need = min(len(decoding), self.max_batch) if decoding else int(bool(self.running))
            if need > free:
                free += kv.evict(need - free)         # cached prefixes before running requests
            if need > free:
                if len(self.running) > 1:
                    self._preempt()
                    preempted = True                  # and nothing is admitted in this step
                else:
                    self.finish(self.running.pop(), "capacity")
                continue
            plan = self._plan(free, decoding, admit=not preempted)
            if plan is None:
                self.finish(self.waiting.pop(0), "capacity")
                continue
            if kv.declare(plan.token_sids()):
                self._layout(plan)
                return plan
            # the plan fits the free cells and max_kv; only cells taken behind the
            # generator's back (another user of the cache) get here
            self._unadmit(plan.admitted)
            if kv.evict(plan.width - kv.free_cells) > 0:
                continue
            if len(self.running) > 1:
                self._preempt()
                preempted = True
            elif self.running:
                self.finish(self.running.pop(), "capacity")
            else:
                self.finish(self.waiting.pop(0), "capacity")
        return None

    def schedule_ahead(self, after: StepPlan) -> StepPlan | None:
        """A general step (prompt chunks, admissions) planned while ``after`` is still on
        the device, its draws not known on the host (asynchronous steps): the plan
        :meth:`schedule` would make once ``after`` is applied, supposing no sequence ends on
        a stop token there. Its first rows are the sequences ``after`` draws for, which go on
        (those reaching ``max_new_tokens`` with it do not), each feeding the token drawn
        there, on the device (:attr:`StepPlan.fed_slots`); then the prompt chunks ``after``
        leaves; then admissions, as :meth:`schedule` admits. A row whose sequence ends in
        ``after`` after all (a stop token, a cancel) is dropped when ``after`` lands
        (:meth:`drop_ended`): its room was not given to an admission one step sooner, as
        the synchronous step would.

        With no row but the tokens in flight (nothing to read, no room to admit), the lean
        plan :meth:`schedule_decode` makes after a lean ``after``, else None.

        None, declaring nothing (the caller lands ``after`` alone and plans the next step
        once it has landed), where that step could be another: ``after`` forks or verifies
        drafts; a running sequence is not in it; a row would be deferred or preempted for
        (cached prefixes are evicted for the rows, as :meth:`schedule` does); a row feeding
        a token in flight has penalties (which count that token on the host); a request
        proposes drafts; an admission would be restored from the host tier (a preempted
        sequence's copy; with the prefix cache's host level on, any admission: it looks
        there), or wait for a prompt being read (``after`` may complete it: the prefix cache
        then gives it).

        What still differs from the plan made once ``after`` has landed: the sequences that
        ``after`` ends on a stop token keep their rows (a token of the budget and a cell
        each), and the cells of every sequence ``after`` ends are not free yet, so with room
        short an admission may come a step later."""
        self.sync()
        if not after.flies:                           # (a verify run, or a fork)
            return None
        kv_ = self.kv
        shift: dict[int, tuple[int, int]] = {}
        fed: list[tuple[Seq, int]] = []               # (sequence, its slot in `after`)
        chunks: list[Seq] = []
        for s, feed, slot, _ in after.owners:
            if s.job.closed or s.sid is None:
                continue                              # cancelled or failed meanwhile
            req = s.job.req
            if req.draft is not None:
                return None                           # it will propose drafts
            in_cache = s.in_cache + len(feed)
            if slot is None:                          # a prompt chunk: the next one goes on
                shift[id(s)] = (in_cache, 0)
                if in_cache < len(s.tokens):
                    chunks.append(s)
                # (else a prompt read whole that draws nothing, max_new_tokens 0: it ends
                # by length in `after`)
                continue
            shift[id(s)] = (in_cache, 1)
            if s.draws_left() <= 1:
                continue                              # ends by length in `after`
            sp = req.sampling
            if sp.repetition_penalty != 1.0 or sp.presence_penalty or sp.frequency_penalty:
                return None
            fed.append((s, slot))
        if any(id(s) not in shift for s in self.running):
            return None                               # a row `after` left out
        leaving = len(shift) - len(fed) - len(chunks)  # (ending by length in `after`)
        budget, cells = self.max_batch, kv_.free_cells
        kv = kv_.max_kv
        if kv_.caching and cells < budget:            # room for the running rows first, as _plan
            want = len(fed) + sum(min(len(s.tokens) - shift[id(s)][0], self.prefill_chunk)
                                  for s in chunks)
            cells += kv_.evict(min(want, budget) - cells)
        if len(fed) > min(budget, cells):
            return None                               # (the step after it lands preempts)
        free = cells
        rows: list[tuple[Seq, list[int]]] = []
        for s, _ in fed:                              # 1. the tokens in flight
            in_cache = shift[id(s)][0]
            if in_cache + 1 > kv:
                return None                           # deferred: the paged view is full
            rows.append((s, [0]))                     # (a stand-in: fed on the device)
            budget, cells, kv = budget - 1, cells - 1, kv - in_cache - 1
        for s in chunks:                              # 2. prompt chunks
            in_cache = shift[id(s)][0]
            n = min(len(s.tokens) - in_cache, self.prefill_chunk, budget, cells, kv - in_cache)
            if n < 1:
                continue
            rows.append((s, s.tokens[in_cache:in_cache + n]))
            budget, cells, kv = budget - n, cells - n, kv - in_cache - n
        admitted: list[Seq] = []
        cached = 0
        if self.waiting:                              # 3. admissions
            planned = {id(s): len(feed) for s, feed in rows}
            avail = free - sum(max(planned.get(id(s), 0), self._claim(s, shift[id(s)][0]))
                               for s in self.running)
            cached = self._admit(rows, admitted, budget, cells, kv, avail, False, ahead=True,
                                 leaving=leaving)
            if cached < 0:                            # it may share a prompt `after` completes
                self._unadmit(admitted)
                return None
        if len(rows) == len(fed):                     # nothing but the tokens in flight:
            return self.schedule_decode(after) if after.lean else None   # (admissions wait for room)
        plan = StepPlan(rows, admitted, False, cached, ahead=True, shift=shift,
                        fed_slots=[slot for _, slot in fed])
        if not kv_.declare(plan.token_sids()):        # (cells taken behind the generator's back)
            self._unadmit(admitted)
            return None
        self._layout(plan)
        return plan

    def _order_lpm(self) -> None:
        """Longest cached prefix first (stable: FIFO among equals); preempted sequences (read
        before) keep the head."""
        if not self.kv.caching or len(self.waiting) < 2:
            return

        def key(w: Seq) -> tuple[int, int]:
            return (int(w.stamp < 0), -self.kv.hit(self.tokens_of(w)))

        self.waiting.sort(key=key)

    def _plan(self, free: int, decoding: list[Seq], admit: bool) -> StepPlan | None:
        """The step's rows within the token budget, the free cells and max_kv: one token for
        each decoding sequence, their drafts as far as room remains, prompt chunks of
        running sequences, then admissions (FIFO or ``lpm``; see the Generator's docstring
        for ``reserve`` and the prefix cache). The prefix cache evicts for the running
        sequences' rows, and for an admission only when it can give all it lacks."""
        kv_ = self.kv
        budget, cells = self.max_batch, free
        kv = kv_.max_kv
        if kv_.caching and cells < budget:            # room for the running rows first
            want = len(decoding) + sum(min(s.to_feed, self.prefill_chunk)
                                       for s in self.running if s.to_feed > 1)
            got = kv_.evict(min(want, budget) - cells)
            cells, free = cells + got, free + got
        chosen: list[Seq] = []
        for s in decoding:                            # 1. every running sequence's next token
            if budget == 0 or cells == 0:
                break
            if s.in_cache + 1 > kv:                   # deferred: the paged view is full
                continue
            chosen.append(s)
            budget, cells, kv = budget - 1, cells - 1, kv - s.in_cache - 1
        rows: list[tuple[Seq, list[int]]] = []
        decode_only = True
        for s in chosen:                              # 2. drafts, as far as they fit
            room = min(len(s.drafts), budget, cells, kv)
            s.drafts = s.drafts[:room]
            budget, cells, kv = budget - room, cells - room, kv - room
            rows.append((s, [s.tokens[-1]] + s.drafts))
            decode_only &= room == 0
        for s in self.running:                        # 3. prompt chunks and recomputes
            pending = s.to_feed
            if pending <= 1:
                continue
            n = min(pending, self.prefill_chunk, budget, cells, kv - s.in_cache)
            if n < 1:
                continue
            rows.append((s, s.tokens[s.in_cache:s.in_cache + n]))
            budget, cells, kv = budget - n, cells - n, kv - s.in_cache - n
            decode_only = False
        admitted: list[Seq] = []
        cached = 0
        if admit and self.waiting:                    # 4. admissions
            planned = {id(s): len(feed) for s, feed in rows}
            avail = free - sum(max(planned.get(id(s), 0), self._claim(s, s.in_cache))
                               for s in self.running)
            cached = self._admit(rows, admitted, budget, cells, kv, avail, not self.running)
            decode_only &= not admitted
        if not rows:
            return None
        return StepPlan(rows, admitted, decode_only, cached)

    def _admit(self, rows: list[tuple[Seq, list[int]]], admitted: list[Seq], budget: int,
               cells: int, kv: int, avail: int, idle: bool, ahead: bool = False,
               leaving: int = 0) -> int:
        """Admits waiting sequences into the step whose other rows are ``rows`` (appended to,
        as ``admitted``) within the token ``budget``, the free ``cells``, the ``kv`` entries
        left and ``avail`` (the free cells the running sequences do not claim); ``idle``: no
        sequence runs (the first admission takes what it needs). Returns the tokens found
        in the prefix cache.

        ``ahead``: the step is planned before the previous one's outcomes are applied
        (:meth:`schedule_ahead`; ``leaving`` of the running sequences end by length there,
        which ``max_running`` does not count). -1 is returned, before anything is evicted for
        the sequence concerned (the caller takes this step's admissions back), where the step
        planned after that one lands could admit otherwise: the sequence would be restored
        from the host tier or looked up there, or would wait for a prompt being read."""
        kv_ = self.kv
        cached = 0
        if self.admission == "lpm":
            self._order_lpm()
        i = 0
        while i < len(self.waiting) and budget > 0:
            if self.max_running is not None and len(self.running) - leaving >= self.max_running:
                break
            w = self.waiting[i]
            if ahead and (w.spill is not None or kv_.l2 is not None):
                return -1                         # (its host copy: once the step has landed)
            arr = self.tokens_of(w)
            L = len(arr)
            # (a prompt whose log-probabilities are still missing is read whole: a hit's
            # tokens are never computed)
            whole = w.req.prompt_logprobs is not None and w.req.prompt_logprobs_missing()
            hit = 0 if whole else kv_.hit(arr)
            # a prompt being read shares more with w than the cache: w waits for it to be
            # stored (only while something else runs in this step)
            if (rows or ahead) and kv_.waits_for(arr, hit):
                if ahead:                         # (maybe a prompt the step in flight completes:
                    return -1                     # decided once it has landed)
                i += 1
                continue
            growth = self._claim(w, L)
            own = L - hit + growth                # a hit's cells are allocated already
            if not (idle and not admitted) and own > avail:
                got = kv_.evict_for(arr, hit, own - avail, partial=False)
                cells, avail = cells + got, avail + got
                if own > avail:
                    break                         # FIFO: nothing overtakes it for room
            n = min(L - hit, self.prefill_chunk, budget, kv - hit)
            if n > cells:
                got = kv_.evict_for(arr, hit, n - cells, partial=True)
                cells, avail = cells + got, avail + got
            if min(n, cells) < 1:
                break
            sid, hit = kv_.obtain(w, arr, hit)
            restored = 0
            if sid is not None and w.spill is None and kv_.l2 is not None and not whole:
                # a longer prefix the prefix cache evicted, if it can be placed now (a
                # fresh request never waits for room for one)
                w.spill = kv_.l2.find(arr, hit, hit + min(cells, kv - hit))
                self.stats["l2_found"] += w.spill is not None
            if sid is not None and w.spill is not None:   # preempted, its K/V on the host
                r = w.spill.end - hit
                if r <= 0 or (r + 1 > min(cells, kv - hit) and idle and not admitted):
                    kv_.drop_spill(w)             # cached already, or never room: read it
                elif r + 1 > min(cells, kv - hit):
                    w.sid = sid
                    self.free(w)                  # waits for room, its copy kept
                    break
                else:
                    try:
                        restored = kv_.restore(w, sid, hit)
                    except BaseException:
                        w.sid = sid
                        self.free(w)              # its id and pins: nothing is lost
                        raise
                    hit, cells = hit + restored, cells - restored
                    self.stats["restored_tokens"] += restored
            n = min(L - hit, self.prefill_chunk, budget, cells, kv - hit)
            if sid is None or n < 1:
                w.sid = sid
                self.free(w)                      # its pin too
                break
            self.waiting.pop(i)
            w.sid, w.in_cache, w.drafts, w.stamp = sid, hit, [], self._stamps
            self._stamps += 1
            self.running.append(w)
            admitted.append(w)
            rows.append((w, w.tokens[hit:hit + n]))
            budget, cells, kv = budget - n, cells - n, kv - hit - n
            avail -= L - (hit - restored) + growth
            cached += hit - restored
            kv_.reading(w, hit)
        return cached

    def _claim(self, s: Seq, have: int) -> int:
        """The cells admission sets aside for s once ``have`` of its tokens are in the cache:
        ``reserve`` times what it still claims (:meth:`Seq.claim`)."""
        return math.ceil(self.reserve * s.claim(have))

    def _layout(self, plan: StepPlan) -> None:
        """The declared plan's input ids, logit rows and sample slots: each sequence's last
        fed token draws when it reaches the end of what the sequence knows (its continuations
        too, at a request's first token with ``n > 1``), unless it may draw nothing
        (``max_new_tokens`` 0); a verify run draws at every row.
        A request that asks for prompt log-probabilities gets a logit row for every prompt
        token it feeds (but its last) while some are missing; a slot whose request uses the
        server knobs (:meth:`Sampling.processed`) gets a :class:`~.plan.SlotExtra`."""
        spec = plan.spec
        shift = plan.shift
        row = 0
        for s, feed in plan.rows:
            plan.tokens += feed
            end = row + len(feed)
            req, sp = s.req, s.req.sampling
            # (a plan made ahead: its sequences as the step in flight leaves them)
            in_cache, drawn = (s.in_cache, 0) if shift is None else shift.get(id(s), (s.in_cache, 0))
            if req.prompt_logprobs is not None and in_cache < len(req.prompt) - 1 \
                    and req.prompt_logprobs_missing():
                self._prompt_rows(plan, s, feed, row, in_cache)
            # a prompt chunk, or the prompt of a request that draws nothing: nothing drawn
            if len(s.tokens) + drawn - in_cache > len(feed) or s.draws_left() <= drawn:
                plan.owners.append((s, feed, None, -1))
                row = end
                continue
            seed = sp.seed if sp.seed is not None else req.id
            n_out = len(req.outputs[s.index]) + drawn
            first = len(spec)
            extra = sp.server_knobs and sp.processed(n_out)   # (one attribute without knobs)
            if s.drafts:
                for j in range(len(feed)):
                    slot = spec.add(len(plan.logit_rows) + j, sp.temperature, sp.top_k, sp.top_p, seed,
                                    s.index, n_out + j, s.drafts[j] if j < len(s.drafts) else -1)
                    if extra:
                        self._extra(spec, slot, s, n_out + j, s.drafts[:j])
                plan.logit_rows += range(row, end)
                spec.groups.append((first, len(s.drafts)))
                plan.owners.append((s, feed, first, len(spec.groups) - 1))
            else:
                lrow = len(plan.logit_rows)
                slot = spec.add(lrow, sp.temperature, sp.top_k, sp.top_p, seed, s.index, n_out)
                if extra:
                    self._extra(spec, slot, s, n_out)
                if s.forks_next():                    # the first token forks
                    kids = [self.new_seq(s.job, k, list(req.prompt)) for k in range(1, sp.n)]
                    for child in kids:
                        slot = spec.add(lrow, sp.temperature, sp.top_k, sp.top_p, seed, child.index, 0)
                        if extra:
                            self._extra(spec, slot, s, 0)
                    plan.children[id(s)] = kids
                plan.logit_rows.append(end - 1)
                plan.owners.append((s, feed, first, -1))
            row = end

    @staticmethod
    def _prompt_rows(plan: StepPlan, s: Seq, feed: list[int], row: int, in_cache: int) -> None:
        """Logit rows for the prompt tokens s feeds (from its token ``in_cache`` on) whose
        next token is a prompt token too: their log-probabilities
        (``Sampling.prompt_logprobs``) come with the step's draws."""
        req = s.req
        prompt, top = req.prompt, req.sampling.prompt_logprobs
        assert top is not None
        for j in range(len(feed)):
            pos = in_cache + j
            if pos + 1 >= len(prompt):
                break
            plan.spec.prompt_rows.append((len(plan.logit_rows), prompt[pos + 1], top))
            plan.logit_rows.append(row + j)
            plan.prompt_lp.append((req, pos + 1))

    def _extra(self, spec: SampleSpec, slot: int, s: Seq, n_out: int, drafts: Sequence[int] = ()) -> None:
        """The server knobs of ``slot`` (s's request, drawing its output token ``n_out``
        after ``drafts``): the ids masked before ``min_new_tokens``, and the tokens its
        penalties count (none for a fork's first token: ``n_out`` 0 with its prompt only)."""
        sp = s.req.sampling
        n_prompt = len(s.req.prompt)
        banned: tuple[int, ...] = ()
        if n_out < sp.min_new_tokens:
            banned = tuple(sorted(set(sp.stop) | (set() if sp.ignore_eos else self.eos)))
        tokens = None
        if sp.repetition_penalty != 1.0 or sp.presence_penalty or sp.frequency_penalty:
            # (the tokens the host has: in a plan scheduled ahead, all but the one fed on the
            # device, which SampleSpec.fed holds)
            arr = s.tokens_array()[:n_prompt + n_out - len(drafts)]
            tokens = np.concatenate([arr, np.asarray(drafts, dtype=arr.dtype)]) if drafts else arr
        spec.extras.append(SlotExtra(slot, sp, banned, tokens, n_prompt))

    def _unadmit(self, admitted: list[Seq]) -> None:
        """Takes back this step's admissions: ids freed, back at the queue's head in order
        (but those whose request ended meanwhile: a cancel while the step was in flight)."""
        for s in reversed(admitted):
            if s.job.closed:
                continue                              # ended: freed and let go already
            if s in self.running:
                self.running.remove(s)
            self.free(s)
            self.waiting.insert(0, s)

    def _rewind(self, s: Seq, keep: int) -> None:
        """Drops s's cells from position ``keep`` on; a refusal (which would mean the cache and
        the generator disagree) requeues s to be read from scratch instead."""
        if not self.kv.rewind(s, keep):
            self.free(s)
            if s in self.running:
                self.running.remove(s)
            self.waiting.insert(0, s)

    def rollback(self, plan: StepPlan, commit: bool) -> None:
        """Undoes a declared or prepared step whose forward or sampling raised: every planned
        sequence back to the cells it had, this step's admissions requeued (their prefix
        hits dropped and unpinned). ``commit``: a step was prepared and not committed yet."""
        self.sync()
        self.epoch += 1
        try:
            if commit:                                # the forward may have been queued
                self.kv.commit_step()
        finally:
            admitted = {id(s) for s in plan.admitted}
            for s, _ in plan.rows:
                s.drafts = []
                if id(s) not in admitted and s.sid is not None:
                    self._rewind(s, s.in_cache)
            self._unadmit(plan.admitted)

    # -- the lean decode step ---------------------------------------------------------------------
    def schedule_decode(self, after: StepPlan | None = None) -> StepPlan | None:
        """The common step without the general planner: every running sequence feeds its
        next token and draws one, nothing waits, no drafts or forks, and the free cells, the
        budget and ``max_kv`` hold every row (so no eviction, preemption or admission would
        happen).
        Returns the declared lean plan, exactly what :meth:`schedule` would plan, or None
        when the general path is needed (nothing declared).

        ``after``: a lean plan whose outcomes are not applied yet (asynchronous scheduling;
        nothing was admitted since, so the running sequences are among its own): its
        sequences still running each feed the token it is drawing (not known on the host:
        the plan's ``tokens`` are empty, the caller feeds the ids on the device), except
        those that reach ``max_new_tokens`` with it. A sequence that ends on a stop token in
        ``after`` still has its row here; the caller drops it when ``after``'s ids arrive.

        A plan made without ``after`` orders its rows by the tokens each may still draw,
        most first (stable), and the plans made after it keep that order: the rows that end
        by length are the last ones (the asynchronous generator feeds the others from a
        prefix of the ids in flight). The synchronous generator orders them the same way,
        so that the two run every step's callbacks in the same order.
        """
        self.sync()
        ahead = 0 if after is None else 1
        seqs = self.running if after is None else after.seqs
        n = len(seqs)
        if not n or n > self.max_batch:
            return None
        if after is None:
            # the rows that end by length soonest last (stable): the steps after this one keep
            # its order, so the rows that end leave from the end and the rest feed on from a
            # prefix of the ids in flight (no gather on the device, no index upload)
            seqs = sorted(seqs, key=Seq.draws_left, reverse=True)
        kv = self.kv.max_kv
        rows: list[Seq] = []
        sids: list[int] = []
        tokens: list[int] = []
        random = False
        knobs = False
        last = 0
        used = 0
        for s in seqs:
            job = s.job
            req = job.req
            sp = req.sampling
            if after is None:
                if s.to_feed != 1 or s.drafts or s.forks_next():
                    return None
                if len(s.tokens) == len(req.prompt):
                    if not sp.max_new_tokens:
                        return None            # its prompt's last token draws nothing
                    last += 1
                tokens.append(s.tokens[-1])
            else:
                if job.closed or s.sid is None:
                    continue                   # cancelled or failed meanwhile
                if req.draft is not None:
                    return None                # it will propose drafts: a synchronous step
                if s.draws_left() <= 1:
                    continue                   # ends by length in `after`
            used += s.in_cache + ahead + 1
            if used > kv:
                return None
            random |= sp.temperature > 0
            knobs |= sp.server_knobs
            rows.append(s)
            sids.append(s.sid)                 # type: ignore[arg-type]
        n = len(rows)
        if not n or n > self.kv.free_cells:
            return None
        if not self.kv.declare(sids):
            return None
        plan = StepPlan([], [], True)
        plan.lean_rows(rows, after is not None, last)
        plan.tokens = tokens
        spec = plan.spec
        spec.random = random
        if random:                             # the sampler reads every slot's parameters
            position = spec.position
            assert isinstance(position, list)  # (a new plan's)
            for s in rows:
                req = s.job.req
                sp = req.sampling
                spec.temperature.append(sp.temperature)
                spec.top_k.append(sp.top_k)
                spec.top_p.append(sp.top_p)
                spec.seed.append(sp.seed if sp.seed is not None else req.id)
                spec.index.append(s.index)
                position.append(len(req.outputs[s.index]) + ahead)
                spec.draft.append(-1)
        if knobs:                              # the server knobs' slots: slot i is row i
            for i, s in enumerate(rows):
                if s.job.req.sampling.server_knobs:
                    # (ahead: its fed token, which the penalties count too, is on the device)
                    self._extra(spec, i, s, len(s.job.req.outputs[s.index]) + ahead)
        return plan

    def drop_ended(self, plan: StepPlan) -> None:
        """Removes from a plan made ahead (not applied yet) the rows of sequences that ended
        or were freed meanwhile: their cells went with them, and their tokens are not drawn
        (a general plan's draws keep their slots)."""
        if not plan.lean:                             # a general plan made ahead
            rows = [(s, feed) for s, feed in plan.rows if s.sid is not None and not s.job.closed]
            if len(rows) < len(plan.rows):
                plan.rows = rows
                plan.owners = [o for o in plan.owners if o[0].sid is not None and not o[0].job.closed]
                plan.tokens = [t for _, feed in rows for t in feed]
            return
        keep = [i for i, s in enumerate(plan.seqs) if s.sid is not None and not s.job.closed]
        if len(keep) == len(plan.seqs):
            return
        plan.seqs = [plan.seqs[i] for i in keep]
        plan.rows = [plan.rows[i] for i in keep]
        plan.owners = [plan.owners[i] for i in keep]
        if not plan.ahead:
            plan.tokens = [plan.tokens[i] for i in keep]

    def apply_decode(self, plan: StepPlan, ids: Any, deliver: bool = True) -> list[tuple[Job, int, int]]:
        """:meth:`decide` + :meth:`update_from_output` for a lean plan: owner k's token is
        ``ids[slot]`` (a 1-D array of the step's draws). Rows whose sequence ended or was
        freed meanwhile are skipped. Returns the tokens to deliver (``deliver`` False: only
        those of requests with an ``on_token``)."""
        self.sync()
        events = []
        toks = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        now = self.now()
        eos = self.eos
        kv = self.kv
        ended = False
        emitted = 0
        for s, _, slot, _ in plan.owners:
            job = s.job
            if job.closed or s.sid is None:
                continue
            tok = toks[slot]  # type: ignore[index]
            req = job.req
            k = s.index
            out = req.outputs[k]
            out.append(tok)
            req.token_times[k].append(now)
            s.tokens.append(tok)
            s.in_cache += 1
            emitted += 1
            if req.first_token is None:
                req.first_token = now
            if deliver or req.hooked:
                events.append((job, k, tok))
            if not s.stored:
                kv.placed(s)
            reason = req.end_reason(len(out), tok, eos)
            if reason is not None:
                self.finish(s, reason)
                ended = True
        self.stats["tokens_out"] += emitted
        if ended:
            self.running = [s for s in self.running if s.sid is not None]
        return events

    # -- the step's outcome ---------------------------------------------------------------------------
    def decide(self, plan: StepPlan, output: SamplerOutput,
               take: Callable[[Seq, int], int] | None = None
               ) -> tuple[list[Outcome], list[tuple[Job, Exception]]]:
        """Every planned sequence's outcome from the step's draws; nothing changes yet.

        ``take(seq, slot)`` reads slot's token (default: ``output.ids[slot]``); an Exception
        it raises is that request's own failure (returned in the failed list; the others'
        outcomes stand); anything else propagates. A verify run emits its accepted drafts
        and the next drawn token, cut at a stop."""
        self.sync()
        ids = output.ids
        if take is None:
            def take(s: Seq, slot: int) -> int:
                return int(ids[slot])
        outcomes: list[Outcome] = []
        failed: dict[int, tuple[Job, Exception]] = {}
        for s, feed, first, group in plan.owners:
            if first is None or id(s.job) in failed:
                outcomes.append(Outcome(s, feed, s.in_cache + len(feed)))
                continue
            try:
                outcomes.append(self._decide(plan, s, feed, first, group, output, take))
            except Exception as e:
                failed[id(s.job)] = (s.job, e)
        return outcomes, list(failed.values())

    def _decide(self, plan: StepPlan, s: Seq, feed: list[int], first: int, group: int,
                output: SamplerOutput, take: Callable[[Seq, int], int]) -> Outcome:
        req, before = s.req, s.in_cache
        if group >= 0:
            n_out = len(req.outputs[s.index])
            acc = int(output.accepted[group])
            toks: list[int] = []
            accepted = 0
            for j in range(acc + 1):
                tok = take(s, first + j)
                toks.append(tok)
                if j == acc:                          # the first rejected draft's place, or the bonus
                    break
                accepted += 1
                if s.end_reason(n_out + len(toks), tok, self.eos):
                    break
            return Outcome(s, feed, before + 1 + accepted, toks, accepted, len(feed) - 1)
        out = Outcome(s, feed, before + len(feed), [take(s, first)])
        for j, child in enumerate(plan.children.get(id(s), ()), 1):
            out.forks.append((child, take(child, first + j)))
        return out

    def update_from_output(self, outcomes: list[Outcome]) -> list[tuple[Job, int, int]]:
        """Advances every sequence by its outcome (no user code runs); returns the tokens
        to deliver, in order, as (job, continuation, token)."""
        self.sync()
        events: list[tuple[Job, int, int]] = []
        kv = self.kv
        now = self.now()
        st = self.stats
        for o in outcomes:
            s, req = o.seq, o.seq.req
            if s.job.closed or s.sid is None:         # its request failed in sampling
                continue
            s.drafts = []
            out = req.outputs[s.index]
            times = req.token_times[s.index]
            reason = None
            for tok in o.tokens:
                out.append(tok)
                times.append(now)
                s.tokens.append(tok)
                events.append((s.job, s.index, tok))
                reason = s.end_reason(len(out), tok, self.eos)
            if o.tokens and req.first_token is None:
                req.first_token = now
            st["tokens_out"] += len(o.tokens)
            st["accepted"] += o.accepted
            st["drafted"] += o.drafted
            if reason is None and o.keep < s.in_cache + len(o.feed):
                self._rewind(s, o.keep)               # the rejected drafts
            else:
                s.in_cache = o.keep
            kv.placed(s)                              # its prompt may be whole in the cache now
            if not o.tokens and s.in_cache == len(s.tokens) and s.draws_left() < 1:
                reason = "length"                     # max_new_tokens 0: its prompt is read
            if o.forks:
                s.job.forked = True
            for child, tok in o.forks:                # clones share the prompt's cells
                req.outputs[child.index].append(tok)
                req.token_times[child.index].append(now)
                child.tokens.append(tok)
                events.append((s.job, child.index, tok))
                st["tokens_out"] += 1
                child_reason = child.end_reason(1, tok, self.eos)
                if child_reason is not None:
                    self.finish(child, child_reason)
                    continue
                if not kv.fork(s, child):             # no free id: reads its prompt later
                    self.waiting.append(child)
                    continue
                child.stamp = self._stamps
                self._stamps += 1
                st["forks"] += 1
                self.running.append(child)
            if reason is not None:
                self.finish(s, reason)
        self.running = [s for s in self.running if s.sid is not None]
        return events

    def count_step(self, plan: StepPlan, graph: bool) -> None:
        """The stats of an applied step: rows fed, prompt tokens computed and cached."""
        st = self.stats
        st["steps"] += 1
        st["tokens_in"] += len(plan.rows) if plan.lean else len(plan.tokens)
        st["graph_steps"] += int(graph)
        st["cached_tokens"] += plan.cached
        if plan.lean:                                 # one token a row: only a prompt's last
            st["computed_tokens"] += plan.prompt_last
            return
        for s, feed in plan.rows:                     # prompt tokens and recomputes: every row
            if s.sid is None:                         # (freed while the step was in flight)
                continue
            n_tok = len(s.tokens)                     # before the sequence's own next token
            end = s.in_cache + len(feed)
            st["computed_tokens"] += max(0, min(end, n_tok - 1) - s.in_cache) + int(
                n_tok == len(s.req.prompt) and s.in_cache < n_tok <= end)
        for s in plan.admitted:
            if not s.job.counted:
                s.job.counted = True
                st["prompt_tokens"] += len(s.req.prompt)
                s.req.cached_tokens = s.in_cache      # (its prefix-cache hit: not applied yet)
