"""The scheduler the Generator runs: :class:`~.base.BaseScheduler` (every serving decision)
with the host-speed path of consecutive lean decode steps added as a subclass, as vLLM's
``AsyncScheduler`` is to its ``Scheduler``. :class:`Scheduler` keeps, with each lean plan
scheduled ahead, a record of its rows (:class:`_Steady`), so that the next plan over the
same rows, and applying it, skip the per-row work; the tokens such steps apply wait in a
backlog (:class:`_Backlog`, an int32 matrix) until something reads them.

::

    schedule_decode(after)   after's record still holds (epoch unchanged): the same rows,
                             one token further (less those ending by length, the last ones)
                             -> declare; no walk over the rows
    apply_decode(plan, ids)  no eos among the ids, no request stop tokens: the ids go to the
                             backlog's row of this step; rows reaching max_new_tokens end
                             (their held tokens counted, given to the prefix cache together)
    sync() / flush()         the backlog appended to the requests' and sequences' lists

Every other path (:class:`~.base.BaseScheduler`'s) calls :meth:`Scheduler.sync` first, and
so does reading a request's ``outputs`` or ``token_times``. The decisions, the tokens and
the order of the callbacks are the base scheduler's.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat
from time import perf_counter
from typing import Any

import numpy as np

from ..cache import CellCache
from ..prefix import PrefixCache
from ..radix import PendingPrompts
from .base import ADMISSION_POLICIES, STATS, BaseScheduler, HoldInterrupts, read_clock
from .plan import Job, Outcome, Seq, StepPlan
from .requests import defer
from .sampler import SampleSpec

__all__ = ["ADMISSION_POLICIES", "BACKLOG_STEPS", "STATS", "HoldInterrupts", "Job", "Outcome",
           "PendingPrompts", "Scheduler", "Seq", "StepPlan", "read_clock"]

_I32 = np.dtype(np.int32)


def _consume(it: Any) -> None:
    """Runs an iterator to its end at C speed (the backlog's appends)."""
    deque(it, maxlen=0)


class _Hook:
    """What every request the scheduler ran reads through (``Request._sync``): calls ``fn``,
    the scheduler's flush while a backlog holds tokens, else nothing. Arming and releasing
    it is one assignment, however many requests share it; released, it refers to nothing,
    so a finished request does not keep the generator alive."""

    __slots__ = ("fn",)

    def __init__(self) -> None:
        self.fn: Callable[[], None] | None = None

    def __call__(self) -> None:
        fn = self.fn
        if fn is not None:
            fn()


class _Backlog:
    """Tokens of steady steps applied but not appended yet: :meth:`Scheduler._apply_steady`
    writes each step's ids into one int32 matrix (step j at ``ids[j]``, row i at
    ``ids[j, i]``) and keeps the step's time, instead of appending them, one by one, to
    every row's three lists (output, token times, sequence tokens) and counting them in its
    ``in_cache``, which would touch 4 x rows objects a step. :meth:`Scheduler.flush`
    appends and counts them; every path but the steady one calls it first (through
    :meth:`Scheduler.sync`), and so does reading a request's ``outputs`` or ``token_times``.
    The steady steps never do (unless ``ids`` is full, :data:`BACKLOG_STEPS` steps): the
    lists are built when they are read.

    Rows that end by length are the last ones (see :meth:`Scheduler.schedule_decode`): they
    leave the drawing rows (``live``) and keep their tokens here (``counts``: the steps
    each holds) until a flush; their ``in_cache`` counts them at once, and they get their
    tokens as an array (for the prefix cache) from their tokens before the backlog
    (``base``) and their column of ``ids``. The backlog goes on with the rows before them,
    as the steady records made after do (``origin``); a step's ids may so be longer than
    the rows still drawing: row i's token is at [i] still."""

    __slots__ = ("outs", "times", "tokens", "seqs", "origin", "base", "ids", "stamps", "live",
                 "counts")

    def __init__(self, fast: _Steady, seqs: list[Seq], width: int):
        self.outs, self.times, self.tokens = fast.outs, fast.times, fast.tokens
        self.seqs = seqs
        self.origin = fast.origin
        n = len(seqs)
        self.ids = np.empty((width, n), dtype=_I32)        # step j's ids at [j] (row i at [j, i])
        self.stamps: list[float] = []                      # step j's time (one a step held)
        self.live = n                                      # rows [0, live) still draw
        self.counts = [0] * n                              # an ended row's steps held
        self.base = [len(t) for t in fast.tokens]          # each row's tokens before the backlog


#: Most steady steps whose tokens wait in a backlog before they are appended (the steady
#: steps flush only a full backlog; reading a request's lists or any other path flushes it).
BACKLOG_STEPS = 4096


@dataclass(eq=False)
class _Steady:
    """What an ahead lean plan (:meth:`Scheduler.schedule_decode` with ``after``) knows about
    its rows, so that the next such plan over the same rows, and applying it, skip the
    per-row checks: valid while the scheduler's ``epoch`` (bumped whenever a sequence is
    freed or a request ended) is the one it was built at."""

    epoch: int
    sids: list[int]
    outs: list[list[int]]                 # the rows' output lists (req.outputs[s.index])
    times: list[list[float]]              # their token_times lists
    tokens: list[list[int]]               # the sequences' token lists (Seq.tokens)
    hooked: list[tuple[int, Job, int]]    # (row, job, continuation) of requests with on_token
    min_left: int                         # min over rows of max_new_tokens - len(outputs), at planning
    used: int                             # the rows' kv entries with this step's token
    stops: bool                           # some row's request has its own stop tokens
    left: np.ndarray                      # each row's max_new_tokens - len(outputs), at planning:
    #                                       2 ends the row by length with this plan's token
    # [True] once every row's request reads through the scheduler's hook: one list shared
    # by the records made from this one (their rows are these or fewer, applied after)
    hooked_rows: list[bool] = field(default_factory=lambda: [False])
    # the output lists of the record this one descends from (made by the general loop): the
    # records made from it keep a prefix of its rows, which one backlog serves throughout
    origin: list[list[int]] | None = None


class Scheduler(BaseScheduler):
    """:class:`~.base.BaseScheduler` with the steady path of lean steps scheduled ahead
    (module docstring): the same decisions, the same tokens, the same callbacks in the same
    order; the requests' lists may lag the applied tokens until read.

    Example
    -------
    >>> sched = Scheduler(cache, None, max_batch=16, prefill_chunk=8)    # doctest: +SKIP
    >>> nxt = sched.schedule_decode(after=plan)   # plan's ids still on the device  # doctest: +SKIP
    """

    def __init__(self, cache: CellCache, prefix: PrefixCache | None, **kw: Any):
        super().__init__(cache, prefix, **kw)
        # (epoch before, after) the finishes a steady apply foresaw (see drop_ended)
        self._foreseen: tuple[int, int] | None = None
        self._backlog: _Backlog | None = None
        self._hook = _Hook()                  # armed (its fn: flush) while a backlog is held
        # a request's outputs read from another thread syncs while the stepping thread runs
        self._backlog_lock = threading.RLock()
        #: Time (s) and tokens of the backlog's flushes: the lists built for the steady
        #: steps, whenever that happened (a read, a non-steady path, the end of a run)
        self.flush_s = 0.0
        self.flushed_tokens = 0

    def sync(self) -> None:
        """Appends the tokens (and times) that steady steps deferred to their lists (the
        requests' ``outputs`` and ``token_times``, the sequences' ``tokens``) and lets the
        requests go: every path but the steady one calls it first."""
        if self._backlog is None:
            return
        with self._backlog_lock:
            with HoldInterrupts() as held:        # all of it or (interrupted before) none
                self._flush_held()
                if self._backlog is not None:
                    self._backlog = None
                    self._hook.fn = None
        if held.hit:
            raise KeyboardInterrupt

    def flush(self) -> None:
        """The appends of :meth:`sync`, the requests kept (what reading a request's
        ``outputs`` or ``token_times`` calls, from any thread)."""
        b = self._backlog
        if b is None or (not b.stamps and b.live == len(b.outs)):
            return
        with self._backlog_lock:
            with HoldInterrupts() as held:
                self._flush_held()
        if held.hit:
            raise KeyboardInterrupt

    def _flush_held(self) -> None:
        """flush's work, under the backlog's lock with Ctrl-C held: an interrupt half-way
        would append some rows' tokens and later append them again. Appends every row's
        held tokens to its lists (and counts a drawing row's in its ``in_cache``; an ended
        row's were counted when it ended), then keeps only the drawing rows, none held."""
        b = self._backlog
        if b is None:
            return
        k, live, n = len(b.stamps), b.live, len(b.outs)
        if not k and live == n:
            return
        t = perf_counter()
        rows = b.ids[:k, :n].T.tolist()            # row i's tokens, in order
        stamps = b.stamps
        times: Any = repeat(stamps, n)
        if live < n:                               # ended rows: only the steps each held
            counts = b.counts
            for i in range(live, n):
                del rows[i][counts[i]:]
            times = [stamps] * live + [stamps[:counts[i]] for i in range(live, n)]
        _consume(map(list.extend, b.outs, rows))
        _consume(map(list.extend, b.tokens, rows))
        _consume(map(list.extend, b.times, times))
        for s in b.seqs[:live]:
            s.in_cache += k
        if live < n:
            b.outs, b.times, b.tokens, b.seqs = b.outs[:live], b.times[:live], b.tokens[:live], b.seqs[:live]
            b.counts = b.counts[:live]
        b.base = [len(x) for x in b.tokens]
        b.stamps = []
        self.flushed_tokens += sum(map(len, rows))
        self.flush_s += perf_counter() - t

    def _end_rows(self, m: int) -> tuple[list[int], np.ndarray]:
        """Rows ``[m, live)`` of the backlog end by length: their held tokens are counted in
        their ``in_cache`` and stay held (appended to their lists by a flush); the backlog
        goes on with the rows before them. The caller holds the backlog's lock and Ctrl-C
        (as :meth:`_flush_held`'s callers do). Returns each ending row's tokens before the
        backlog (its list's length) and their held tokens, a row each."""
        b = self._backlog
        assert b is not None
        k = len(b.stamps)
        held = b.ids[:k, m:b.live].T.copy()
        bases = b.base[m:b.live]
        for i in range(m, b.live):
            s = b.seqs[i]
            assert len(s.tokens) == b.base[i]      # (its list is appended only by a flush)
            s.in_cache += k
            b.counts[i] = k
        b.live = m
        return bases, held

    def schedule_decode(self, after: StepPlan | None = None) -> StepPlan | None:
        """:meth:`BaseScheduler.schedule_decode`; after a plan with a steady record that still
        holds, made from the record (:meth:`_steady_decode`). A plan made after ``after``
        by the general loop gets a record."""
        if after is not None and after.fast is not None:
            plan = self._steady_decode(after)
            if plan is not None:
                return plan
            f = after.fast
            if f.epoch == self.epoch and int(f.left.max()) <= 2:
                return None                    # every row ends by length with after's token
        plan = super().schedule_decode(after)
        if plan is not None and after is not None:
            plan.fast = self._record(plan)
        return plan

    def _record(self, plan: StepPlan) -> _Steady:
        """The steady record of an ahead lean plan the general loop made (every row one
        token ahead of its applied ones)."""
        rows = plan.seqs
        reqs = [s.job.req for s in rows]
        lefts = [s.draws_left() for s in rows]
        fast = _Steady(
            self.epoch, [s.sid for s in rows], [r.outputs[s.index] for r, s in zip(reqs, rows)],  # type: ignore[misc]
            [r.token_times[s.index] for r, s in zip(reqs, rows)], [s.tokens for s in rows],
            [(i, s.job, s.index) for i, (r, s) in enumerate(zip(reqs, rows)) if r.on_token is not None],
            min(lefts), sum(s.in_cache + 2 for s in rows), any(r.sampling.stop for r in reqs),
            np.array(lefts, dtype=np.int64))
        fast.origin = fast.outs
        return fast

    def _steady_decode(self, after: StepPlan) -> StepPlan | None:
        """:meth:`schedule_decode` after ``after`` when nothing ended since it was planned
        (same epoch): the same rows, each one token further, without visiting them one by
        one, less those that end by length in ``after`` (:meth:`_steady_less`). None when
        that does not hold (the general loop decides)."""
        fast = after.fast
        assert fast is not None
        if fast.epoch != self.epoch:
            return None
        if fast.min_left <= 2:
            return self._steady_less(after, fast)
        n = len(fast.sids)
        if n > self.kv.free_cells:
            return None
        used = fast.used + n
        if used > self.kv.max_kv:
            return None
        if not self.kv.declare(fast.sids):
            return None
        # `after`'s rows, owners, logit rows and (greedy) sample spec, shared: nothing changes a
        # plan's lists once it is made (drop_ended replaces them). Copied field by field rather
        # than built through StepPlan(), whose default lists and SampleSpec would be dropped
        plan = StepPlan.__new__(StepPlan)
        plan.__dict__.update(after.__dict__)
        plan.admitted, plan.tokens, plan.children, plan.prefix_fed = [], [], {}, False
        prev = after.spec
        if prev.random:                        # each slot's token number moves on
            plan.spec = SampleSpec(rows=prev.rows, temperature=prev.temperature, top_k=prev.top_k,
                                   top_p=prev.top_p, seed=prev.seed, index=prev.index,
                                   position=[p + 1 for p in prev.position], draft=prev.draft,
                                   dense=n, random=True)
        plan.fast = _Steady(fast.epoch, fast.sids, fast.outs, fast.times, fast.tokens, fast.hooked,
                            fast.min_left - 1, used, fast.stops, fast.left - 1, fast.hooked_rows,
                            fast.origin)
        return plan

    def _steady_less(self, after: StepPlan, fast: _Steady) -> StepPlan | None:
        """:meth:`_steady_decode` when some of ``after``'s rows end by length with its token
        (their ``left`` is 2 at its planning): the other rows, in order, each one token
        further; exactly the plan the general loop would make (it skips those rows too).
        The rows that end are the last ones (:meth:`schedule_decode` orders the rows by the
        tokens they may still draw), so the record's lists are cut, not filtered. None
        (nothing declared: the general loop decides) when no row goes on, the rows that end
        are not the last ones, or the step does not fit."""
        left = fast.left - 1                   # one token (the step before `after`) applied since
        keep = left > 1
        idx = np.flatnonzero(keep)
        m = int(idx.size)
        if not m or idx[-1] != m - 1 or m > self.kv.free_cells:
            return None
        rows = after.seqs[:m]
        # the rows' tokens in the cache: their in_cache, and the steps the backlog holds for
        # them (each of these rows has a token in every one: a backlog of their record's
        # origin keeps a prefix of its rows)
        with self._backlog_lock:               # (a reader's flush moves tokens from one to the other)
            b = self._backlog
            if b is not None and b.origin is not fast.origin:
                self.flush()
            held = len(b.stamps) if b is not None and b.origin is fast.origin else 0
            # their kv entries with this step's token: each row's in_cache + held + 2, had
            # from the record's (every row's in_cache + held + 1, after's token counted) less
            # the ending rows' (fewer than the kept ones, as a rule), without a walk of these
            ending = after.seqs[m:]
            used = fast.used - sum(s.in_cache for s in ending) - (held + 1) * len(ending) + m
        if used > self.kv.max_kv:
            return None
        sids = fast.sids[:m]
        if not self.kv.declare(sids):
            return None
        plan = StepPlan(after.rows[:m], [], True, lean=True, seqs=rows, ahead=True)
        plan.prefix_fed = True                 # row j feeds from after's slot j
        plan.logit_rows = list(range(m))
        # after's owners are (seqs[i], _ONE, i, -1), as every steady plan's (drop_ended
        # changes a plan's owners only when its record has gone stale): their first m
        plan.owners = after.owners[:m]
        spec, prev = plan.spec, after.spec
        spec.rows = plan.logit_rows
        spec.dense, spec.random = m, prev.random
        if prev.random:
            spec.temperature, spec.top_k = prev.temperature[:m], prev.top_k[:m]
            spec.top_p, spec.seed = prev.top_p[:m], prev.seed[:m]
            spec.index, spec.draft = prev.index[:m], prev.draft[:m]
            spec.position = [p + 1 for p in prev.position[:m]]
            # the sampled rows may be the ones that ended: then the steps on draw greedily
            spec.random = any(t > 0 for t in spec.temperature)
        kept = left[:m]
        plan.fast = _Steady(
            fast.epoch, sids, fast.outs[:m], fast.times[:m], fast.tokens[:m],
            [h for h in fast.hooked if h[0] < m], int(kept.min()), used, fast.stops, kept,
            fast.hooked_rows, fast.origin)
        return plan

    def drop_ended(self, plan: StepPlan) -> None:
        """:meth:`BaseScheduler.drop_ended`, for nothing when the plan's steady record still
        holds (or only the finishes the step before foresaw happened)."""
        fast = plan.fast
        if fast is not None and fast.epoch == self.epoch:
            return                             # nothing was freed or ended since it was planned
        if fast is not None and self._foreseen == (fast.epoch, self.epoch):
            # only the rows that ended by length in the step before, which this plan left out
            # when it was made (it was planned from that step's record): still steady
            fast.epoch = self.epoch
            return
        super().drop_ended(plan)

    def apply_decode(self, plan: StepPlan, ids: Any, deliver: bool = True) -> list[tuple[Job, int, int]]:
        """:meth:`BaseScheduler.apply_decode`; a plan whose steady record holds and whose
        requests have no stop tokens of their own goes through :meth:`_apply_steady`."""
        fast = plan.fast
        if fast is not None and fast.epoch == self.epoch and not fast.stops:
            events = self._apply_steady(plan, fast, ids, deliver)
            if events is not None:
                return events
        return super().apply_decode(plan, ids, deliver)

    def _apply_steady(self, plan: StepPlan, fast: _Steady, ids: Any,
                      deliver: bool) -> list[tuple[Job, int, int]] | None:
        """:meth:`apply_decode` of a steady plan (nothing ended since it was planned, no row
        reaches ``max_new_tokens``, no request stop tokens): every row takes its token, row i
        slot i, kept in the backlog (:class:`_Backlog`) until a flush appends it. None,
        changing nothing, when a drawn token is an end-of-sequence id (the general loop
        ends those rows)."""
        n = len(fast.sids)
        arr = np.asarray(ids)[:n]
        if self.eos and np.isin(arr, np.fromiter(self.eos, np.int64, len(self.eos))).any():
            return None
        now = self.now()
        seqs = plan.seqs
        # the tokens go to the backlog (appended to the rows' lists by flush)
        with self._backlog_lock:               # (a reader's sync may run meanwhile)
            b = self._backlog
            if b is None or b.origin is not fast.origin or b.live != n:
                self.sync()                    # another set of rows
                if not fast.hooked_rows[0]:    # (rows of a record made from a hooked one are)
                    defer((s.job.req for s in seqs), self._hook)
                    fast.hooked_rows[0] = True
                # as many steps as any row may still draw (a record made later draws fewer)
                b = _Backlog(fast, seqs, min(BACKLOG_STEPS, int(fast.left.max()) + 2))
                self._backlog = b
                self._hook.fn = self.flush
            elif len(b.stamps) >= len(b.ids):
                self.flush()
            b.ids[len(b.stamps), :n] = arr     # (arr: a view of a buffer the next step reuses)
            b.stamps.append(now)
        # no prompt to store: every row was applied in the step before this one (its rows are
        # among that step's, nothing ended since), which stored any prompt it completed
        self.stats["tokens_out"] += n
        events = []
        if deliver or fast.hooked:
            toks = arr.tolist()
            events = ([(s.job, s.index, tok) for s, tok in zip(seqs, toks)] if deliver
                      else [(job, k, toks[i]) for i, job, k in fast.hooked])
        if fast.min_left <= 2:                 # rows whose max_new_tokens this token reaches
            ending = np.flatnonzero(fast.left <= 2).tolist()   # (not empty: min_left <= 2)
            m = ending[0]
            # the last rows (schedule_decode's order): they leave the backlog's drawing rows,
            # their tokens still held, and it goes on with the others (the next steady
            # record's rows); with no row left it holds the ended rows' tokens until a flush
            last = ending == list(range(m, n))
            if last:
                with self._backlog_lock:
                    with HoldInterrupts() as hold:   # (all of it or none, as sync)
                        bases, held = self._end_rows(m)
                if hold.hit:
                    raise KeyboardInterrupt
            else:
                self.sync()
            before = self.epoch
            if last:
                self._finish_held(seqs[m:], bases, held)
            else:
                for i in ending:
                    self.finish(seqs[i], "length")
            self.running = [s for s in self.running if s.sid is not None]
            # the plan made after this one (from its record) left exactly these rows out
            self._foreseen = (before, self.epoch)
        return events

    def _finish_held(self, ended: list[Seq], bases: list[int], held: np.ndarray) -> None:
        """:meth:`finish` (``"length"``) of the rows :meth:`_end_rows` ended (``bases``,
        ``held``: what it returned), their held tokens counted already (no sync). The prefix
        cache takes the rows whose prompt they lend in one call (:meth:`KVManager.give_lent`,
        given each row's tokens past its prompt); the others are freed one by one. An
        exception from it (a user's ``on_event``) is raised once every row is ended, as
        :meth:`free` does (an Exception: when the step is complete)."""
        kv = self.kv
        done = [False] * len(ended)
        error: BaseException | None = None
        picked = [j for j, s in enumerate(ended) if kv.lends(s)]   # (the others one by one)
        if picked:
            tails = []
            for j in picked:
                s, base, row = ended[j], bases[j], held[j]
                start, n = len(s.req.prompt), s.in_cache
                # tokens [start, n): its list's up to base, then its held ones
                if n <= base:
                    tails.append(np.array(s.tokens[start:n], dtype=_I32))
                else:
                    tails.append(np.concatenate((np.array(s.tokens[start:base], dtype=_I32),
                                                 row[:n - base])))
            given, error = kv.give_lent([ended[j] for j in picked], tails)
            for j, g in zip(picked, given):
                done[j] = g
        for j, s in enumerate(ended):
            self.epoch += 1
            if done[j]:                        # the tree took its id
                kv.let_go(s, False)
            else:                              # (its whole token array only for a store)
                arr = np.concatenate((s.tokens_array(bases[j]), held[j])) if kv.caching else None
                kv.release(s, True, arr)
            self._ended(s, "length")
        if isinstance(error, Exception):
            self.later.append(error)
        elif error is not None:
            raise error
