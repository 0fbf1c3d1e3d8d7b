"""Every cache verb of serving, decided on the host without a model.

::

    waiting --admit (prefix match/pin, seq_new, evict)--> running
    schedule():  decode rows -> drafts -> prompt chunks -> admissions   (token budget,
                 free cells, max_kv) -> declare_step -> StepPlan (rows, tokens, logit
                 rows, the SampleSpec of every token to draw)
    ... the caller prepares the step, runs a forward, samples (one host copy of ids) ...
    decide(plan, output, take) -> Outcomes          (verify walk, forks, stop checks;
                                                     nothing changed yet)
    update_from_output(outcomes) -> events           (tokens appended, rejected drafts
                                                     rewound, forks cloned, finished
                                                     sequences stored and freed)
    rollback(plan, commit)                           (a failed step: everything as before)

:class:`Scheduler` owns the queues (``waiting``, ``running``), the prefix cache's pins and
stores, the tree of prompts being read, preemption and the ``stats`` counters. It never
runs user code and never touches torch: tests drive it with a fake forward
(``tests/test_scheduler.py``). The facade (:class:`cellcache.generate.Generator`) adds
requests, threads, drafts, the forward and the sampler around it.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]
import math
import signal
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat
from time import perf_counter
from typing import Any

import numpy as np

from ..cache import CellCache
from ..errors import CellCacheError, StepTooLarge
from ..prefix import PrefixCache
from ..radix import PendingPrompts
from .requests import Request, defer, real_number
from .sampler import SamplerOutput, SampleSpec

__all__ = ["ADMISSION_POLICIES", "Job", "Outcome", "PendingPrompts", "Scheduler", "Seq", "StepPlan"]

#: Which waiting sequence admission considers first: ``"fifo"`` (arrival order) or
#: ``"lpm"`` (longest cached prefix first, SGLang's policy; preempted sequences still first).
ADMISSION_POLICIES = ("fifo", "lpm")
_I32 = np.dtype(np.int32)
#: a lean plan's feed of every row: one token (read only for its length; the values are in
#: ``plan.tokens``, or on the device for a plan scheduled ahead)
_ONE: list[int] = [0]

#: Stats counters (every key starts at 0).
STATS = ("steps", "tokens_in", "tokens_out", "preempted", "forks", "drafted", "accepted",
         "graph_steps", "prompt_tokens", "cached_tokens", "computed_tokens")


@dataclass(eq=False)
class Job:
    """The serving state of one request, shared by its continuations."""

    req: Request
    closed: bool = False          # cancelled or failed: no callback of it runs again
    forked: bool = False          # continuations 1.. were made
    counted: bool = False         # its prompt is in stats["prompt_tokens"]


@dataclass(eq=False)
class Seq:
    """One continuation of a request."""

    job: Job
    index: int                       # which continuation of its request
    tokens: list[int]                # prompt + output so far
    sid: int | None = None           # cache id while running
    in_cache: int = 0                # tokens[:in_cache] are in the cache
    drafts: list[int] = field(default_factory=list)
    stamp: int = -1                  # admission order: the highest is preempted first
    # prefix cache: pins this sequence holds ((tokens, n) for unpin), whether its prompt was
    # stored since it was admitted, its prompt's bytes while it is being read (the pending
    # prompts), and tokens as int32 (rebuilt when tokens grew)
    pins: list[tuple[np.ndarray, int]] = field(default_factory=list)
    stored: bool = False
    pending: bytes | None = None
    arr: np.ndarray | None = None

    @property
    def req(self) -> Request:
        return self.job.req


@dataclass(eq=False)
class Outcome:
    """What a step does to one planned sequence, decided before anything is applied."""

    seq: Seq
    feed: list[int]
    keep: int                         # the sequence's in_cache after the step
    tokens: list[int] = field(default_factory=list)           # emitted, in order
    accepted: int = 0
    forks: list[tuple[Seq, int]] = field(default_factory=list)  # new continuations, first token


@dataclass(eq=False)
class StepPlan:
    """A declared step: what the forward carries and what is drawn from its logits."""

    rows: list[tuple[Seq, list[int]]]     # (sequence, tokens it feeds), in the step's order
    admitted: list[Seq]                   # sequences given a cache id for this step
    decode_only: bool                     # every row one sequence's next token, nothing else
    cached: int = 0                       # tokens the admissions found in the prefix cache
    tokens: list[int] = field(default_factory=list)        # the forward's input ids
    logit_rows: list[int] = field(default_factory=list)    # rows whose logits are drawn from
    # (sequence, feed, its first slot or None, its verify group or -1); forks: its children
    owners: list[tuple[Seq, list[int], int | None, int]] = field(default_factory=list)
    children: dict[int, list[Seq]] = field(default_factory=dict)
    spec: SampleSpec = field(default_factory=SampleSpec)
    # a lean decode step (:meth:`Scheduler.schedule_decode`): row i is seqs[i]'s next token,
    # drawn at slot i; no drafts, forks, admissions or prompt chunks
    lean: bool = False
    seqs: list[Seq] = field(default_factory=list)
    prompt_last: int = 0                  # lean rows that feed their prompt's last token
    ahead: bool = False                   # scheduled before the previous step's ids arrived:
    #                                       ``tokens`` is empty, the ids are fed on the device
    fast: _Steady | None = None           # an ahead lean plan's steady-state record
    # ahead: its rows feed from the first slots of the previous plan's draws, in order (rows
    # that ended there were its last ones); False: every slot in order, or look them up
    prefix_fed: bool = False


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

    # _signal: the functions behind the signal module's, without its enum conversions (which
    # cost tens of microseconds a call, twice a step)
    def __enter__(self) -> HoldInterrupts:
        if threading.current_thread() is threading.main_thread() \
                and _signal.getsignal(_SIGINT) is signal.default_int_handler:
            self._old = _signal.signal(_SIGINT, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            _signal.signal(_SIGINT, self._old)
            self._old = None


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
    ``in_cache``: that touches 4 x rows objects a step, the largest host cost of a steady
    step. :meth:`Scheduler.flush` appends and counts them; every path but the steady one
    calls it first (through :meth:`Scheduler.sync`), and so does reading a request's
    ``outputs`` or ``token_times``. The steady steps never do (unless ``ids`` is full,
    :data:`BACKLOG_STEPS` steps): the lists are built when they are read.

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


def _left_of(s: Seq) -> int:
    """The tokens s may still draw before it ends by length."""
    req = s.job.req
    return req.sampling.max_new_tokens - len(req.outputs[s.index])


def ends(req: Request, n_out: int, tok: int, eos: set[int]) -> str | None:
    """Why a continuation with n_out tokens, the last tok, ends (None: it goes on)."""
    if tok in eos or tok in req.sampling.stop:
        return "stop"
    if n_out >= req.sampling.max_new_tokens:
        return "length"
    return None


def read_clock(clock: Callable[[], Any]) -> float:
    """A reading of a user's clock as a float; InvalidArgument when it is not a finite real
    number (:func:`~cellcache.generate.requests.real_number`'s rule)."""
    return real_number(clock(), "the clock's reading")


class Scheduler:
    """Admission, chunking under a token budget, preemption, forks and draft rewinds over
    ``cache`` (module docstring). ``max_batch``: rows a step (the token budget, at most the
    cache's ``max_write``); ``prefill_chunk``: prompt tokens one sequence reads a step;
    ``reserve``, ``admission`` and the prefix cache as :class:`cellcache.generate.Generator`
    documents them; ``clock`` stamps finished requests and token times.

    Example (no model: the caller stands in for the forward and the sampler)
    -------
    >>> sched = Scheduler(cache, None, max_batch=16, prefill_chunk=8)          # doctest: +SKIP
    >>> sched.waiting.append(sched.new_seq(Job(request), 0, list(request.prompt)))  # doctest: +SKIP
    >>> plan = sched.schedule()                 # declared: prepare, forward, sample  # doctest: +SKIP
    >>> sched.update_from_output(sched.decide(plan, output)[0])               # doctest: +SKIP
    """

    def __init__(self, cache: CellCache, prefix: PrefixCache | None, *, max_batch: int,
                 prefill_chunk: int, reserve: float = 1.0, eos: set[int] | None = None,
                 admission: str = "fifo", clock: Callable[[], float] | None = None):
        import time

        self.cache = cache
        self.prefix = prefix
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.reserve = reserve
        self.eos: set[int] = set(eos or ())
        self.admission = admission
        self.clock = clock or time.perf_counter
        self.waiting: list[Seq] = []          # no cache id yet (new, or preempted)
        self.running: list[Seq] = []
        self.pending = PendingPrompts()
        # errors of user code called in the middle of the bookkeeping (a prefix cache's
        # on_event, the clock), raised once the step is complete
        self.later: list[BaseException] = []
        self._last_time = 0.0                 # the clock's last good reading
        #: Jobs whose request finished since the caller last emptied the list (the
        #: Generator lets them go: nothing of it keeps a finished request).
        self.ended_jobs: list[Job] = []
        self.stats: dict[str, int] = dict.fromkeys(STATS, 0)
        #: Bumped whenever a sequence is freed or a request ended: a lean plan's steady
        #: record (:class:`_Steady`) holds only while it is unchanged.
        self.epoch = 0
        # (epoch before, after) the finishes a steady apply foresaw (see drop_ended)
        self._foreseen: tuple[int, int] | None = None
        self._stamps = 0
        self._backlog: _Backlog | None = None
        self._hook = _Hook()                  # armed (its fn: flush) while a backlog is held
        # a request's outputs read from another thread syncs while the stepping thread runs
        self._backlog_lock = threading.RLock()
        #: Time (s) and tokens of the backlog's flushes: the lists built for the steady
        #: steps, whenever that happened (a read, a non-steady path, the end of a run)
        self.flush_s = 0.0
        self.flushed_tokens = 0

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

    # -- sequences ----------------------------------------------------------------------------------
    @staticmethod
    def new_seq(job: Job, index: int, tokens: list[int]) -> Seq:
        return Seq(job, index, tokens)

    def tokens_of(self, s: Seq) -> np.ndarray:
        """s's tokens as int32 (tokens only grow: extended, not rebuilt)."""
        self.sync()
        return self._tokens_of(s)

    @staticmethod
    def _tokens_of(s: Seq, n: int | None = None) -> np.ndarray:
        """:meth:`tokens_of` of a sequence none of whose first ``n`` tokens (default: all)
        wait in the backlog: those tokens, kept in ``s.arr``."""
        if n is None:
            n = len(s.tokens)
        arr = s.arr
        if arr is None or len(arr) != n:
            if arr is None or len(arr) > n:
                arr = np.array(s.tokens[:n], dtype=_I32)
            else:
                arr = np.concatenate([arr, np.array(s.tokens[len(arr):n], dtype=_I32)])
            s.arr = arr
        return arr

    def free(self, s: Seq, store: bool = False, flushed: bool = False,
             arr: np.ndarray | None = None) -> None:
        """Gives back s's cache id and cells; s is then a sequence to be read from scratch.
        ``store``: s ends, its tokens in the cache go to the prefix cache first. ``flushed``:
        the caller counted s's held tokens in its ``in_cache`` (:meth:`_end_rows`), and the
        backlog stays as it is; ``arr``: then s's tokens as int32 (its list may lack the
        held ones)."""
        if not flushed:
            self.sync()
        self._leaving(s)
        pc = self.prefix
        sid = s.sid
        mine = sid is not None                # the id is still s's to remove
        try:
            if pc is not None and store and sid is not None and s.in_cache > 0:
                if arr is not None:
                    s.arr = arr                # (rebuilt from the list if it is shorter)
                else:
                    arr = self._tokens_of(s)
                tokens = arr[:s.in_cache]
                # the tree takes the id itself (or removes it): no clone, and the stored
                # cells keep their owners (a clone and a removal would change each twice)
                owned = pc.owns(sid)          # (only after cache.clear() underneath)
                mine = False
                try:
                    pc.give(sid, tokens)
                except BaseException:
                    # a refusal changed nothing; an on_event callback raises after the store
                    mine = owned or (sid in self.cache.live_seqs() and not pc.owns(sid))
                    raise
        except Exception as e:                # as _pcall: raised once the step is complete
            self.later.append(e)
        finally:            # a BaseException from a user's on_event (Ctrl-C) still frees s
            self._let_go(s, mine)

    def _leaving(self, s: Seq) -> None:
        """The start of :meth:`free`: the plans made before no longer hold (``epoch``), and
        a prompt s was reading is no longer pending."""
        self.epoch += 1
        if s.pending is not None:
            self.pending.remove(s.pending)
            s.pending = None

    def _let_go(self, s: Seq, mine: bool) -> None:
        """The end of :meth:`free`: s's pins go, and its id (``mine``: still s's, removed
        here); s is left a sequence to be read from scratch."""
        pc = self.prefix
        sid = s.sid
        if s.pins:
            if pc is not None:
                for arr, n in s.pins:
                    try:
                        pc.unpin(arr, n)
                    except CellCacheError:        # the tree was cleared or forgotten meanwhile
                        pass
            s.pins = []
        s.stored = False
        if mine and sid is not None:
            try:                          # a prompt it lends: the tree's own copy first
                if pc is not None:
                    self._pcall(False, pc.reclaim, sid)
            finally:
                self.cache.seq_rm(sid)
        s.sid, s.in_cache = None, 0
        if s.drafts:
            s.drafts = []

    def _declare(self, sids: Any) -> bool:
        """Declares a step of ``sids``' tokens; False (nothing declared) when the cache has
        no room for it now or the paged view cannot take it (StepTooLarge)."""
        try:
            return self.cache.declare_step(sids)
        except StepTooLarge:
            return False

    # -- the prefix cache --------------------------------------------------------------------------
    def _pcall(self, default: Any, fn: Callable, *args: Any, **kw: Any) -> Any:
        """A prefix-cache operation that changes it. An exception (from a user's ``on_event``:
        the prefix cache is consistent when it propagates) is kept in ``later`` (raised when
        the step is complete); ``default`` stands for the lost result."""
        try:
            return fn(*args, **kw)
        except Exception as e:
            self.later.append(e)
            return default

    def _evict(self, cells: int) -> int:
        """Asks the prefix cache for ``cells`` cells; returns those freed."""
        if self.prefix is None or cells <= 0:
            return 0
        before = self.cache.free_cells
        self._pcall(0, self.prefix.evict, cells)
        return self.cache.free_cells - before

    def _evict_for(self, arr: np.ndarray, hit: int, cells: int, partial: bool) -> int:
        """Evicts for a waiting sequence (tokens ``arr``) that would hit ``hit`` tokens,
        keeping those: ``cells`` cells, or (``partial`` False) nothing unless the prefix cache
        can give them all. Returns the cells freed."""
        pc = self.prefix
        if pc is None or cells <= 0:
            return 0
        held = pc.pin(arr, max_len=hit) if hit else 0
        try:
            if not partial and pc.evictable_tokens(cells) < cells:
                return 0
            return self._evict(cells)
        finally:
            if held:
                try:
                    pc.unpin(arr, held)
                except CellCacheError:                # the tree was forgotten meanwhile
                    pass

    def _obtain(self, w: Seq, arr: np.ndarray, hit: int) -> tuple[int | None, int]:
        """A cache id for w: a clone holding its cached prefix (pinned) when ``hit``, else a
        new one; a prefix-cache leaf is evicted when no id is free. (None, 0) if none is had."""
        pc = self.prefix
        for attempt in range(2):
            if hit and pc is not None:
                sid, n = self._pcall((None, 0), pc.match, arr, max_len=len(arr) - 1, pin=True)
                if sid is not None:
                    if n:
                        w.pins.append((arr, n))
                    return sid, n
            sid = self.cache.seq_new()
            if sid is not None:
                return sid, 0
            if pc is None or attempt:
                break
            self._pcall(0, pc.evict, n_ids=1)
        return None, 0

    def _store_prompt(self, s: Seq) -> None:
        """s's prompt has been placed: stored in the prefix cache, and kept there while s
        runs. s lends it (no clone: no cell changes owner); ending s gives the tree s
        itself, and freeing it otherwise (preempted, cancelled) reclaims the prompt first.
        A prompt s lends needs no pin (a lent leaf is never evicted, nor the path above
        it); one the tree held already (nothing lent) is pinned, as a hit is."""
        pc = self.prefix
        assert pc is not None and s.sid is not None
        p = self.tokens_of(s)[:len(s.req.prompt)]
        if not self._pcall(0, pc.lend, s.sid, p):
            n = pc.pin(p)
            if n:
                s.pins.append((p, n))
        s.stored = True
        if s.pending is not None:
            self.pending.remove(s.pending)
            s.pending = None

    # -- ending sequences and requests --------------------------------------------------------------
    def finish(self, s: Seq, reason: str, flushed: bool = False,
               arr: np.ndarray | None = None) -> None:
        """Ends continuation s (already out of the queues, or about to be) with reason
        (``flushed``, ``arr``: as :meth:`free`)."""
        self.free(s, store=True, flushed=flushed, arr=arr)
        self._ended(s, reason)

    def _finish_held(self, ended: list[Seq], bases: list[int], held: np.ndarray) -> None:
        """:meth:`finish` (``"length"``) of the rows :meth:`_end_rows` ended (``bases``,
        ``held``: what it returned). The prefix cache takes the rows whose prompt they lend
        in one call (:meth:`PrefixCache.give_lent`, given each row's tokens past its
        prompt); the others are finished one by one. An exception from it (a user's
        ``on_event``) is raised once every row is ended, as :meth:`free` does (an Exception:
        when the step is complete)."""
        pc = self.prefix
        done = [False] * len(ended)
        error: BaseException | None = None
        if pc is not None:
            picked, sids, starts, tails = [], [], [], []
            for j, (s, base, row) in enumerate(zip(ended, bases, held)):
                start, n = len(s.req.prompt), s.in_cache
                if s.sid is None or not s.stored or start >= n:
                    continue                   # (finished below, one by one)
                picked.append(j)
                sids.append(s.sid)
                starts.append(start)
                # tokens [start, n): its list's up to base, then its held ones
                if n <= base:
                    tails.append(np.array(s.tokens[start:n], dtype=_I32))
                else:
                    tails.append(np.concatenate((np.array(s.tokens[start:base], dtype=_I32),
                                                 row[:n - base])))
            try:
                given = pc.give_lent(sids, starts, tails)
            except BaseException as e:         # (raised once the tree took every row it gives)
                error = e
                given = [pc.owns(sid) for sid in sids]
            for j, g in zip(picked, given):
                done[j] = g
        for j, s in enumerate(ended):
            if done[j]:                        # free's start and end: the tree took its id
                self._leaving(s)
                self._let_go(s, False)
                self._ended(s, "length")
            else:                              # (its whole token array only for a store)
                arr = None if pc is None else np.concatenate((self._tokens_of(s, bases[j]), held[j]))
                self.finish(s, "length", flushed=True, arr=arr)
        if isinstance(error, Exception):
            self.later.append(error)
        elif error is not None:
            raise error

    def _ended(self, s: Seq, reason: str) -> None:
        """The end of :meth:`finish`, s freed: its request's finish reasons (and time)."""
        req = s.req
        reasons = req.finish_reasons
        reasons[s.index] = reason
        if req.sampling.n > 1 and s.index == 0 and not s.job.forked:   # its continuations never started
            for k in range(1, req.sampling.n):
                if reasons[k] is None:
                    reasons[k] = reason
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
        if req.finished is None:
            req.finished = self.now()
            self.ended_jobs.append(job)
        self._free_all(ending)

    def _free_all(self, seqs: list[Seq]) -> None:
        """Frees (and stores) every sequence of ``seqs``, even when one free raises (a
        BaseException from a user's ``on_event``); the first such exception propagates
        once all are freed."""
        first: BaseException | None = None
        for s in seqs:
            try:
                self.free(s, store=True)
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    # -- admission and preemption ---------------------------------------------------------------
    @staticmethod
    def _remaining(s: Seq, have: int) -> int:
        """Cells continuation s still claims once ``have`` of its tokens are in the cache:
        up to len(prompt) + max_new_tokens - 1 in all, and its other continuations' own
        tokens while they are not forked yet."""
        sp = s.req.sampling
        more = max(0, len(s.req.prompt) + sp.max_new_tokens - 1 - have)
        if s.index == 0 and sp.n > 1 and not s.job.forked:
            more += (sp.n - 1) * (sp.max_new_tokens - 1)
        return more

    def _preempt(self) -> None:
        """Frees the most recently admitted running sequence and requeues it at the head of
        the queue; it is read again (prompt and output so far) when admitted."""
        v = max(self.running, key=lambda s: s.stamp)
        self.running.remove(v)
        self.free(v)
        self.waiting.insert(0, v)
        self.stats["preempted"] += 1

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
        preempted = False
        while self.running or self.waiting:
            free = self.cache.free_cells
            decoding = [s for s in self.running if len(s.tokens) - s.in_cache == 1]
            need = min(len(decoding), self.max_batch) if decoding else int(bool(self.running))
            if need > free:
                free += self._evict(need - free)      # cached prefixes before running requests
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
            width = sum(len(feed) for _, feed in plan.rows)
            if self._declare([s.sid for s, feed in plan.rows for _ in feed]):
                self._layout(plan)
                return plan
            # the plan fits the free cells and max_kv; only cells taken behind the
            # generator's back (another user of the cache) get here
            self._unadmit(plan.admitted)
            if self._evict(width - self.cache.free_cells) > 0:
                continue
            if len(self.running) > 1:
                self._preempt()
                preempted = True
            elif self.running:
                self.finish(self.running.pop(), "capacity")
            else:
                self.finish(self.waiting.pop(0), "capacity")
        return None

    # -- the lean decode step ---------------------------------------------------------------------
    def schedule_decode(self, after: StepPlan | None = None) -> StepPlan | None:
        """The common step without the general planner: every running sequence feeds its
        next token, nothing waits, no drafts or forks, and the free cells, the budget and
        ``max_kv`` hold every row (so no eviction, preemption or admission would happen).
        Returns the declared lean plan, exactly what :meth:`schedule` would plan, or None
        when the general path is needed (nothing declared).

        ``after``: a lean plan whose outcomes are not applied yet (asynchronous scheduling;
        nothing was admitted since, so the running sequences are among its own): its
        sequences still running each feed the token it is drawing (not known on the host: the plan's
        ``tokens`` are None, the caller feeds the ids on the device), except those that
        reach ``max_new_tokens`` with it. A sequence that ends on a stop token in ``after``
        still has its row here; the caller drops it when ``after``'s ids arrive.

        A plan made without ``after`` orders its rows by the tokens each may still draw,
        most first (stable), and the plans made after it keep that order: the rows that end
        by length are the last ones (the asynchronous generator feeds the others from a
        prefix of the ids in flight). The synchronous generator orders them the same way,
        so that the two run every step's callbacks in the same order.
        """
        if after is not None and after.fast is not None:
            plan = self._steady_decode(after)
            if plan is not None:
                return plan
            f = after.fast
            if f.epoch == self.epoch and int(f.left.max()) <= 2:
                return None                    # every row ends by length with after's token
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
            seqs = sorted(seqs, key=_left_of, reverse=True)
        cfg = self.cache.config
        kv = cfg.max_kv if cfg.paged else 1 << 62
        rows: list[Seq] = []
        sids: list[int] = []
        tokens: list[int] = []
        lefts: list[int] = []
        random = False
        stops = False
        last = 0
        used = 0
        min_left = 1 << 62
        for s in seqs:
            job = s.job
            req = job.req
            sp = req.sampling
            if after is None:
                toks = s.tokens
                if len(toks) - s.in_cache != 1 or s.drafts or (sp.n > 1 and not job.forked):
                    return None
                if len(toks) == len(req.prompt):
                    last += 1
                tokens.append(toks[-1])
            else:
                if job.closed or s.sid is None:
                    continue                   # cancelled or failed meanwhile
                if req.draft is not None:
                    return None                # it will propose drafts: a synchronous step
                left = sp.max_new_tokens - len(req.outputs[s.index])
                if left <= 1:
                    continue                   # ends by length in `after`
                if left < min_left:
                    min_left = left
                lefts.append(left)
                if sp.stop:
                    stops = True
            used += s.in_cache + ahead + 1
            if used > kv:
                return None
            random |= sp.temperature > 0
            rows.append(s)
            sids.append(s.sid)                 # type: ignore[arg-type]
        n = len(rows)
        if not n or n > self.cache.free_cells:
            return None
        if not self._declare(sids):
            return None
        plan = StepPlan([(s, _ONE) for s in rows], [], True, lean=True, seqs=rows, prompt_last=last,
                        ahead=after is not None)
        plan.tokens = tokens
        plan.logit_rows = list(range(n))
        plan.owners = [(s, _ONE, i, -1) for i, s in enumerate(rows)]
        spec = plan.spec
        spec.rows = plan.logit_rows
        spec.dense, spec.random = n, random
        if random:                             # the sampler reads every slot's parameters
            for s in rows:
                req = s.job.req
                sp = req.sampling
                spec.temperature.append(sp.temperature)
                spec.top_k.append(sp.top_k)
                spec.top_p.append(sp.top_p)
                spec.seed.append(sp.seed if sp.seed is not None else req.id)
                spec.index.append(s.index)
                spec.position.append(len(req.outputs[s.index]) + ahead)
                spec.draft.append(-1)
        if after is not None:
            reqs = [s.job.req for s in rows]
            plan.fast = _Steady(
                self.epoch, sids, [r.outputs[s.index] for r, s in zip(reqs, rows)],
                [r.token_times[s.index] for r, s in zip(reqs, rows)], [s.tokens for s in rows],
                [(i, s.job, s.index) for i, (r, s) in enumerate(zip(reqs, rows)) if r.on_token is not None],
                min_left, used, stops, np.array(lefts, dtype=np.int64))
            plan.fast.origin = plan.fast.outs
        return plan

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
        if n > self.cache.free_cells:
            return None
        cfg = self.cache.config
        used = fast.used + n
        if cfg.paged and used > cfg.max_kv:
            return None
        if not self._declare(fast.sids):
            return None
        # `after`'s rows, owners, logit rows and (greedy) sample spec, shared: nothing changes a
        # plan's lists once it is made (drop_ended replaces them). Copied field by field rather
        # than built through StepPlan(): its default lists and SampleSpec cost ~15 allocations
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
        if not m or idx[-1] != m - 1 or m > self.cache.free_cells:
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
        cfg = self.cache.config
        if cfg.paged and used > cfg.max_kv:
            return None
        sids = fast.sids[:m]
        if not self._declare(sids):
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
        """Removes from a lean plan (not applied yet) the rows of sequences that ended or
        were freed meanwhile: their cells went with them, and their tokens are not drawn."""
        fast = plan.fast
        if fast is not None and fast.epoch == self.epoch:
            return                             # nothing was freed or ended since it was planned
        if fast is not None and self._foreseen == (fast.epoch, self.epoch):
            # only the rows that ended by length in the step before, which this plan left out
            # when it was made (it was planned from that step's record): still steady
            fast.epoch = self.epoch
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
        fast = plan.fast
        if fast is not None and fast.epoch == self.epoch and not fast.stops:
            events = self._apply_steady(plan, fast, ids, deliver)
            if events is not None:
                return events
        self.sync()
        events = []
        toks = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        now = self.now()
        eos = self.eos
        pc = self.prefix
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
            if deliver or req.on_token is not None:
                events.append((job, k, tok))
            if pc is not None and not s.stored and s.in_cache >= len(req.prompt):
                self._store_prompt(s)
            sp = req.sampling
            if tok in eos or (sp.stop and tok in sp.stop):
                self.finish(s, "stop")
                ended = True
            elif len(out) >= sp.max_new_tokens:
                self.finish(s, "length")
                ended = True
        self.stats["tokens_out"] += emitted
        if ended:
            self.running = [s for s in self.running if s.sid is not None]
        return events

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

    def _order_lpm(self) -> None:
        """Longest cached prefix first (stable: FIFO among equals); preempted sequences (read
        before) keep the head."""
        pc = self.prefix
        if pc is None or len(self.waiting) < 2:
            return

        def key(w: Seq) -> tuple[int, int]:
            arr = self.tokens_of(w)
            return (int(w.stamp < 0), -pc.peek(arr, max_len=len(arr) - 1))

        self.waiting.sort(key=key)

    def _plan(self, free: int, decoding: list[Seq], admit: bool) -> StepPlan | None:
        """The step's rows within the token budget, the free cells and max_kv: one token for
        each decoding sequence, their drafts as far as room remains, prompt chunks of
        running sequences, then admissions (FIFO or ``lpm``; see the Generator's docstring
        for ``reserve`` and the prefix cache). The prefix cache evicts for the running
        sequences' rows, and for an admission only when it can give all it lacks."""
        budget, cells = self.max_batch, free
        kv = self.cache.config.max_kv if self.cache.config.paged else 1 << 62
        pc = self.prefix
        if pc is not None and cells < budget:         # room for the running rows first
            want = len(decoding) + sum(min(len(s.tokens) - s.in_cache, self.prefill_chunk)
                                       for s in self.running if len(s.tokens) - s.in_cache > 1)
            got = self._evict(min(want, budget) - cells)
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
        cached = 0
        for s in self.running:                        # 3. prompt chunks and recomputes
            pending = len(s.tokens) - s.in_cache
            if pending <= 1:
                continue
            n = min(pending, self.prefill_chunk, budget, cells, kv - s.in_cache)
            if n < 1:
                continue
            rows.append((s, s.tokens[s.in_cache:s.in_cache + n]))
            budget, cells, kv = budget - n, cells - n, kv - s.in_cache - n
            decode_only = False
        admitted: list[Seq] = []
        if admit and self.waiting:                    # 4. admissions
            planned = {id(s): len(feed) for s, feed in rows}
            avail = free - sum(max(planned.get(id(s), 0),
                                   math.ceil(self.reserve * self._remaining(s, s.in_cache)))
                               for s in self.running)
            idle = not self.running
            if self.admission == "lpm":
                self._order_lpm()
            i = 0
            while i < len(self.waiting) and budget > 0:
                w = self.waiting[i]
                arr = self.tokens_of(w)
                L = len(arr)
                hit = pc.peek(arr, max_len=L - 1) if pc is not None else 0
                # a prompt being read shares more with w than the cache: w waits for it to be
                # stored (only while something else runs in this step)
                if self.pending.size and rows and self.pending.lcp(arr.tobytes()) > hit:
                    i += 1
                    continue
                growth = math.ceil(self.reserve * self._remaining(w, L))
                own = L - hit + growth                # a hit's cells are allocated already
                if not (idle and not admitted) and own > avail:
                    got = self._evict_for(arr, hit, own - avail, partial=False)
                    cells, avail = cells + got, avail + got
                    if own > avail:
                        break                         # FIFO: nothing overtakes it for room
                n = min(L - hit, self.prefill_chunk, budget, kv - hit)
                if n > cells:
                    got = self._evict_for(arr, hit, n - cells, partial=True)
                    cells, avail = cells + got, avail + got
                if min(n, cells) < 1:
                    break
                sid, hit = self._obtain(w, arr, hit)
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
                avail -= L - hit + growth
                decode_only = False
                cached += hit
                if pc is not None and hit < len(w.req.prompt):
                    w.pending = self.tokens_of(w)[:len(w.req.prompt)].tobytes()
                    self.pending.add(w.pending)
        if not rows:
            return None
        return StepPlan(rows, admitted, decode_only, cached)

    def _layout(self, plan: StepPlan) -> None:
        """The declared plan's input ids, logit rows and sample slots: each sequence's last
        fed token draws when it reaches the end of what the sequence knows (its continuations
        too, at a request's first token with ``n > 1``); a verify run draws at every row."""
        spec = plan.spec
        row = 0
        for s, feed in plan.rows:
            plan.tokens += feed
            end = row + len(feed)
            if s.in_cache + len(feed) < len(s.tokens):           # a prompt chunk: nothing drawn
                plan.owners.append((s, feed, None, -1))
                row = end
                continue
            req, sp = s.req, s.req.sampling
            seed = sp.seed if sp.seed is not None else req.id
            n_out = len(req.outputs[s.index])
            first = len(spec)
            if s.drafts:
                for j in range(len(feed)):
                    spec.add(len(plan.logit_rows) + j, sp.temperature, sp.top_k, sp.top_p, seed,
                             s.index, n_out + j, s.drafts[j] if j < len(s.drafts) else -1)
                plan.logit_rows += range(row, end)
                spec.groups.append((first, len(s.drafts)))
                plan.owners.append((s, feed, first, len(spec.groups) - 1))
            else:
                lrow = len(plan.logit_rows)
                spec.add(lrow, sp.temperature, sp.top_k, sp.top_p, seed, s.index, n_out)
                if s.index == 0 and sp.n > 1 and not s.job.forked:   # the first token forks
                    kids = [self.new_seq(s.job, k, list(req.prompt)) for k in range(1, sp.n)]
                    for child in kids:
                        spec.add(lrow, sp.temperature, sp.top_k, sp.top_p, seed, child.index, 0)
                    plan.children[id(s)] = kids
                plan.logit_rows.append(end - 1)
                plan.owners.append((s, feed, first, -1))
            row = end

    def _unadmit(self, admitted: list[Seq]) -> None:
        """Takes back this step's admissions: ids freed, back at the queue's head in order."""
        for s in reversed(admitted):
            if s in self.running:
                self.running.remove(s)
            self.free(s)
            self.waiting.insert(0, s)

    def _rewind(self, s: Seq, keep: int) -> None:
        """Drops s's cells from position ``keep`` on; a refusal (which would mean the cache and
        the generator disagree) requeues s to be read from scratch instead."""
        assert s.sid is not None
        if self.prefix is not None and s.stored and keep < len(s.req.prompt):
            self._pcall(False, self.prefix.reclaim, s.sid)   # (below a prompt it lends)
        if self.cache.rewind(s.sid, keep):
            s.in_cache = keep
        else:
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
                self.cache.commit_step()
        finally:
            admitted = {id(s) for s in plan.admitted}
            for s, _ in plan.rows:
                s.drafts = []
                if id(s) not in admitted and s.sid is not None:
                    self._rewind(s, s.in_cache)
            self._unadmit(plan.admitted)

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
                if ends(req, n_out + len(toks), tok, self.eos):
                    break
            return Outcome(s, feed, before + 1 + accepted, toks, accepted)
        out = Outcome(s, feed, before + len(feed), [take(s, first)])
        for j, child in enumerate(plan.children.get(id(s), ()), 1):
            out.forks.append((child, take(child, first + j)))
        return out

    def update_from_output(self, outcomes: list[Outcome]) -> list[tuple[Job, int, int]]:
        """Advances every sequence by its outcome (no user code runs); returns the tokens
        to deliver, in order, as (job, continuation, token)."""
        self.sync()
        events: list[tuple[Job, int, int]] = []
        pc = self.prefix
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
                reason = ends(req, len(out), tok, self.eos)
            if o.tokens and req.first_token is None:
                req.first_token = now
            st["tokens_out"] += len(o.tokens)
            st["accepted"] += o.accepted
            if reason is None and o.keep < s.in_cache + len(o.feed):
                self._rewind(s, o.keep)               # the rejected drafts
            else:
                s.in_cache = o.keep
            if pc is not None and not s.stored and s.sid is not None \
                    and s.in_cache >= len(req.prompt):
                self._store_prompt(s)                 # its prompt is whole in the cache now
            if o.forks:
                s.job.forked = True
            for child, tok in o.forks:                # clones share the prompt's cells
                req.outputs[child.index].append(tok)
                req.token_times[child.index].append(now)
                child.tokens.append(tok)
                events.append((s.job, child.index, tok))
                st["tokens_out"] += 1
                child_reason = ends(req, 1, tok, self.eos)
                if child_reason is not None:
                    self.finish(child, child_reason)
                    continue
                sid = None if s.sid is None else self.cache.seq_clone(s.sid, len(req.prompt))
                if sid is None and pc is not None and s.sid is not None:
                    self._pcall(0, pc.evict, n_ids=1)
                    sid = self.cache.seq_clone(s.sid, len(req.prompt))
                if sid is None:                       # no free id: reads its prompt later
                    self.waiting.append(child)
                    continue
                child.sid, child.in_cache, child.stamp = sid, len(req.prompt), self._stamps
                self._stamps += 1
                st["forks"] += 1
                self.running.append(child)
                if pc is not None:                    # the prompt it shares stays cached
                    p = self.tokens_of(s)[:len(req.prompt)]
                    n = pc.pin(p)
                    if n:
                        child.pins.append((p, n))
                    child.stored = True
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
            n_tok = len(s.tokens)                     # before the sequence's own next token
            end = s.in_cache + len(feed)
            st["computed_tokens"] += max(0, min(end, n_tok - 1) - s.in_cache) + int(
                n_tok == len(s.req.prompt) and s.in_cache < n_tok <= end)
        for s in plan.admitted:
            if not s.job.counted:
                s.job.counted = True
                st["prompt_tokens"] += len(s.req.prompt)
