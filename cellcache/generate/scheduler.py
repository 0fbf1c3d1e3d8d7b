"""The scheduler the Generator runs: :class:`~.base.BaseScheduler` (every serving decision)
with the host-speed path of consecutive lean decode steps added as a subclass, as vLLM's
``AsyncScheduler`` is to its ``Scheduler``. :class:`Scheduler` keeps, with each lean plan
scheduled ahead, a record of its rows (:class:`_Steady`), so that the next plan over the
same rows, and applying it, skip the per-row work; the tokens such steps apply go to a
:class:`~.plan.TokenStore` (int32 arrays, one store a step) that the rows' requests and
sequences read through until the rows settle into their lists.

::

    schedule_decode(after)   after's record still holds (epoch unchanged): the same rows,
                             one token further (less those ending by length, the last ones)
                             -> declare; no walk over the rows
    apply_decode(plan, ids)  no eos among the ids, no request stop tokens: the ids go to the
                             store's step; rows reaching max_new_tokens settle (their lists
                             whole) and end (given to the prefix cache together)
    sync()                   every stored row settles into its lists (what the other paths,
                             which append to the lists, call first)

Every other path (:class:`~.base.BaseScheduler`'s) calls :meth:`Scheduler.sync` first.
Reading a request's ``outputs`` or ``token_times`` never runs the scheduler: a stored row
answers with the lists it had and its stored steps. The decisions, the tokens and the order
of the callbacks are the base scheduler's.
"""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter
from typing import Any

import numpy as np

from ..cache import CellCache
from ..prefix import PrefixCache
from ..radix import PendingPrompts
from .base import ADMISSION_POLICIES, STATS, BaseScheduler, HoldInterrupts, read_clock
from .plan import Job, Outcome, Seq, StepPlan, StoredRow, TokenStore

__all__ = ["ADMISSION_POLICIES", "STATS", "HoldInterrupts", "Job", "Outcome", "PendingPrompts",
           "Scheduler", "Seq", "StepPlan", "read_clock"]

#: Steps a new token store has room for at most (it doubles when a run goes on longer).
STORE_STEPS = 1024


@dataclass(eq=False)
class _Steady:
    """What an ahead lean plan (:meth:`Scheduler.schedule_decode` with ``after``) knows about
    its rows, so that the next such plan over the same rows, and applying it, skip the
    per-row checks: valid while the scheduler's ``epoch`` (bumped whenever a sequence is
    freed or a request ended) is the one it was built at."""

    epoch: int
    sids: list[int]
    hooked: list[tuple[int, Job, int]]    # (row, job, continuation) of requests with on_token
    min_left: int                         # min over rows of max_new_tokens - len(outputs), at planning
    used: int                             # the rows' kv entries with this step's token
    stops: bool                           # some row's request has its own stop tokens
    left: np.ndarray                      # each row's max_new_tokens - len(outputs), at planning:
    #                                       2 ends the row by length with this plan's token
    # the sids of the record this one descends from (made by the general loop): the records
    # made from it keep a prefix of its rows, which one token store serves throughout
    origin: list[int] | None = None
    # some row's draws change with its tokens (penalties, or min_new_tokens not reached): the
    # general loop plans each step (the spec's extras are rebuilt), not the record
    history: bool = False


class Scheduler(BaseScheduler):
    """:class:`~.base.BaseScheduler` with the steady path of lean steps scheduled ahead
    (module docstring): the same decisions, the same tokens, the same callbacks in the same
    order; a steady step stores its tokens once for all its rows.

    Example
    -------
    >>> sched = Scheduler(cache, None, max_batch=16, prefill_chunk=8)    # doctest: +SKIP
    >>> nxt = sched.schedule_decode(after=plan)   # plan's ids still on the device  # doctest: +SKIP
    """

    def __init__(self, cache: CellCache, prefix: PrefixCache | None, **kw: Any):
        super().__init__(cache, prefix, **kw)
        # (epoch before, after) the finishes a steady apply foresaw (see drop_ended)
        self._foreseen: tuple[int, int] | None = None
        self._store: TokenStore | None = None
        self._rows: list[Seq] = []            # the store's drawing rows, in its order
        self._origin: list[int] | None = None  # the steady records the store serves (origin)
        #: Time (s) and tokens of the rows settled from the store into their lists (when a
        #: row ends, another path runs, or the run ends)
        self.flush_s = 0.0
        self.flushed_tokens = 0

    def sync(self) -> None:
        """Settles every row the token store holds into its lists (the requests'
        ``outputs`` and ``token_times``, the sequences' ``tokens`` and ``in_cache``): every
        path but the steady one calls it first, as it appends to them. Nothing to do when
        no row is stored."""
        if self._store is None:
            return
        with HoldInterrupts() as held:           # all of it or (interrupted before) none
            self._settle(0)
            self._store = None
            self._origin = None
        if held.hit:
            raise KeyboardInterrupt

    def stored_rows(self) -> list[Seq]:
        """The sequences whose drawn tokens the token store holds (read through it)."""
        return list(self._rows)

    def stored_steps(self) -> int:
        """Steps the token store holds (0 with none)."""
        return 0 if self._store is None else self._store.k

    def _settle(self, m: int) -> None:
        """The store's rows ``[m, live)`` settle into their lists; it goes on with rows
        ``[0, m)``. The caller holds Ctrl-C (a row half appended would be appended again)."""
        store = self._store
        assert store is not None
        rows = self._rows[m:]
        if not rows:
            return
        t = perf_counter()
        k = store.k
        cols = store.ids[:k, m:store.live].T.tolist()
        times = store.times(k)
        for s, ids in zip(rows, cols):
            s.settle(ids, times)
        del self._rows[m:]
        store.live = m
        self.flushed_tokens += k * len(rows)
        self.flush_s += perf_counter() - t

    def _hold(self, seqs: list[Seq], fast: _Steady) -> TokenStore:
        """A token store for ``seqs`` (a steady record's rows), every one read through it."""
        store = TokenStore(len(seqs), min(STORE_STEPS, int(fast.left.max()) + 2))
        for i, s in enumerate(seqs):
            out, times = s.job.req.own_row(s.index)    # (n continuations: n reads, not n^2)
            tokens = s.tokens
            s.hold(StoredRow(store, i, out, times, tokens, len(out), len(tokens), s.in_cache))
        self._store, self._rows, self._origin = store, list(seqs), fast.origin
        return store

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
            self.epoch, [s.sid for s in rows],  # type: ignore[misc]
            [(i, s.job, s.index) for i, (r, s) in enumerate(zip(reqs, rows)) if r.hooked],
            min(lefts), sum(s.in_cache + 2 for s in rows), any(r.sampling.stop for r in reqs),
            np.array(lefts, dtype=np.int64))
        fast.origin = fast.sids
        fast.history = any(e.tokens is not None or e.banned for e in plan.spec.extras)
        return fast

    def _steady_decode(self, after: StepPlan) -> StepPlan | None:
        """:meth:`schedule_decode` after ``after`` when nothing ended since it was planned
        (same epoch): the same rows, each one token further, without visiting them one by
        one, less those that end by length in ``after`` (:meth:`_steady_less`). None when
        that does not hold (the general loop decides)."""
        fast = after.fast
        assert fast is not None
        if fast.epoch != self.epoch or fast.history:
            return None                        # (penalties, min_new_tokens: rebuilt each step)
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
            plan.spec = prev.next_step()
        plan.fast = _Steady(fast.epoch, fast.sids, fast.hooked, fast.min_left - 1, used, fast.stops,
                            fast.left - 1, fast.origin)
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
        # their kv entries with this step's token: each row's in_cache + 2 (in_cache counts a
        # stored row's steps), had from the record's (every row's in_cache + 1, after's token
        # counted) less the ending rows' (fewer than the kept ones, as a rule)
        ending = after.seqs[m:]
        used = fast.used - sum(s.in_cache for s in ending) - len(ending) + m
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
        if prev.extras:                        # (slot i is row i: the first m keep theirs)
            spec.extras = [e for e in prev.extras if e.slot < m]
        if prev.random:
            spec.temperature, spec.top_k = prev.temperature[:m], prev.top_k[:m]
            spec.top_p, spec.seed = prev.top_p[:m], prev.seed[:m]
            spec.index, spec.draft = prev.index[:m], prev.draft[:m]
            spec.position = np.add(prev.position[:m], 1)
            # the sampled rows may be the ones that ended: then the steps on draw greedily
            spec.random = any(t > 0 for t in spec.temperature)
        kept = left[:m]
        plan.fast = _Steady(
            fast.epoch, sids, [h for h in fast.hooked if h[0] < m], int(kept.min()), used,
            fast.stops, kept, fast.origin)
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
        slot i, written to the token store (:class:`~.plan.TokenStore`) at once. None,
        changing nothing, when a drawn token is an end-of-sequence id (the general loop
        ends those rows)."""
        n = len(fast.sids)
        arr = np.asarray(ids)[:n]
        if self.eos and np.isin(arr, np.fromiter(self.eos, np.int64, len(self.eos))).any():
            return None
        now = self.now()
        seqs = plan.seqs
        store = self._store
        if store is None or self._origin is not fast.origin or store.live != n:
            self.sync()                        # another set of rows
            store = self._hold(seqs, fast)
        store.write(arr, now)                  # (arr: a view of a buffer the next step reuses)
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
            # the last rows (schedule_decode's order): they settle into their lists and the
            # store goes on with the others (the next steady record's rows)
            last = ending == list(range(m, n))
            if last:
                with HoldInterrupts() as hold:     # (all of it or none, as sync)
                    self._settle(m)
                if hold.hit:
                    raise KeyboardInterrupt
            else:
                self.sync()
            before = self.epoch
            if last:
                self._finish_settled(seqs[m:])
            else:
                for i in ending:
                    self.finish(seqs[i], "length")
            self.running = [s for s in self.running if s.sid is not None]
            # the plan made after this one (from its record) left exactly these rows out
            self._foreseen = (before, self.epoch)
        return events

    def _finish_settled(self, ended: list[Seq]) -> None:
        """:meth:`finish` (``"length"``) of rows that settled out of the token store while
        it goes on with others (no sync). The prefix cache takes the rows whose prompt they
        lend in one call (:meth:`KVManager.give_lent`, given each row's tokens past its
        prompt); the others are freed one by one. An exception from it (a user's
        ``on_event``, KeyboardInterrupt too) is kept in ``later``: the step raises it once
        it is complete."""
        kv = self.kv
        done = [False] * len(ended)
        error: BaseException | None = None
        picked = [j for j, s in enumerate(ended) if kv.lends(s)]   # (the others one by one)
        if picked:
            # tokens [prompt, in_cache) of each
            tails = [ended[j].tokens_array()[len(ended[j].req.prompt):ended[j].in_cache]
                     for j in picked]
            given, error = kv.give_lent([ended[j] for j in picked], tails)
            for j, g in zip(picked, given):
                done[j] = g
        for j, s in enumerate(ended):
            self.epoch += 1
            if done[j]:                        # the tree took its id
                kv.let_go(s, False)
            else:
                kv.release(s, True)
            self._ended(s, "length")
        if error is not None:
            self.later.append(error)
