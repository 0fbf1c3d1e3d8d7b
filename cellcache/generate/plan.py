"""The contract between the scheduler, the runner and the sampler: :class:`StepPlan` (what a
step feeds and draws), :class:`SampleSpec` (what each of its slots draws with),
:class:`SamplerOutput` (the draws back on the host), :class:`Outcome` (what a step does to
one sequence), and the serving
state they name, :class:`Job` (a request) and :class:`Seq` (one continuation). Each serving
rule is one method here, called everywhere it applies: the tokens a sequence has left to
feed (:attr:`Seq.to_feed`), the tokens it may still draw (:meth:`Seq.draws_left`), the
cells it still claims (:meth:`Seq.claim`), whether its next draw forks it
(:meth:`Seq.forks_next`) and why a drawn token ends it (:meth:`Seq.end_reason`, from
:meth:`~cellcache.generate.requests.Request.end_reason`). :class:`TokenStore` keeps the
tokens of consecutive steady decode steps as arrays, read through each row's
:class:`StoredRow` until the row settles into its lists. Nothing here touches torch or
the cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .requests import Request, Sampling

__all__ = ["ONE", "Job", "Outcome", "SampleSpec", "SamplerOutput", "Seq", "SlotExtra", "StepPlan",
           "StoredRow", "TokenStore"]

#: a lean plan's feed of every row: one token (read only for its length; the values are in
#: ``plan.tokens``, or on the device for a plan scheduled ahead)
ONE: list[int] = [0]


@dataclass
class SampleSpec:
    """What a step samples: one slot per token to draw, in the order the caller reads them.

    ``rows[i]``: the logits row slot i draws from (several slots may share one: the
    continuations of ``n > 1`` draw their first tokens from the prompt's last row).
    ``temperature``/``top_k``/``top_p``: the slot's request's :class:`Sampling` values.
    ``seed``/``index``/``position``: the slot's key (request seed, continuation, output
    token number); read only for slots with temperature > 0. ``groups``: verify runs as
    ``(first slot, drafts)``: slots ``first .. first + drafts`` check the drafts ``draft[first
    + j]``; the output's ``accepted[g]`` is how many leading slots of group g drew their draft.
    """

    rows: list[int] = field(default_factory=list)
    temperature: list[float] = field(default_factory=list)
    top_k: list[int] = field(default_factory=list)
    top_p: list[float] = field(default_factory=list)
    seed: list[int] = field(default_factory=list)
    index: list[int] = field(default_factory=list)
    #: (a steady decode's plan made from the one before: an int64 array, one step further)
    position: list[int] | np.ndarray = field(default_factory=list)
    draft: list[int] = field(default_factory=list)
    groups: list[tuple[int, int]] = field(default_factory=list)
    #: set by a caller that knows: slot i draws from row i for ``dense`` rows (None: look)
    dense: int | None = None
    #: set by a caller that knows whether some slot has temperature > 0 (None: look)
    random: bool | None = None
    #: the slots whose request uses the server knobs (:meth:`Sampling.processed`), in slot
    #: order; empty on the common path, where the sampler does nothing more
    extras: list[SlotExtra] = field(default_factory=list)
    #: rows whose log-probabilities are asked for without a draw (prompt log-probabilities):
    #: (logits row, the token whose log-probability is wanted, top alternatives)
    prompt_rows: list[tuple[int, int, int]] = field(default_factory=list)
    #: a lean plan launched ahead (slot i draws row i): the ids its rows were fed, on the
    #: device (the previous step's draws, not on the host yet), which the extras' penalties
    #: count beside their ``tokens``; None: every token a slot's penalties count is on the host
    fed: Any = None

    def add(self, row: int, temperature: float, top_k: int, top_p: float, seed: int, index: int,
            position: int, draft: int = -1) -> int:
        """Appends a slot; returns its number."""
        self.rows.append(row)
        self.temperature.append(temperature)
        self.top_k.append(top_k)
        self.top_p.append(top_p)
        self.seed.append(seed)
        self.index.append(index)
        pos = self.position
        if not isinstance(pos, list):
            pos = self.position = pos.tolist()
        pos.append(position)
        self.draft.append(draft)
        return len(self.rows) - 1

    def __len__(self) -> int:
        return len(self.rows)

    def next_step(self) -> SampleSpec:
        """The spec of the same slots one token further (a steady decode's next plan): the
        lists shared (nothing changes a plan's lists once it is made; the sampler keeps
        what it derives from them while they compare equal), each slot's position one on
        as an int64 array."""
        return SampleSpec(rows=self.rows, temperature=self.temperature, top_k=self.top_k,
                          top_p=self.top_p, seed=self.seed, index=self.index,
                          position=np.add(self.position, 1), draft=self.draft,
                          dense=len(self.rows), random=True, extras=self.extras)

    def identity(self, n_rows: int) -> bool:
        """Whether slot i draws from row i for every one of ``n_rows`` rows."""
        if self.dense is not None:
            return self.dense == n_rows
        return len(self.rows) == n_rows and self.rows == list(range(n_rows))

    def any_random(self) -> bool:
        """Whether some slot samples (temperature > 0)."""
        return self.random if self.random is not None else any(t > 0 for t in self.temperature)

    def reads_logits(self, n_rows: int) -> bool:
        """Whether drawing this spec from a step's ``n_rows`` logits rows reads the logits
        rather than only each row's argmax (:attr:`cellcache.runner.ModelRunner.greedy`):
        some slot samples, uses a server knob (log-probabilities among them) or draws from
        another row than its own, or prompt log-probabilities are asked for."""
        return bool(self.extras or self.prompt_rows) or not self.identity(n_rows) or self.any_random()


@dataclass(eq=False)
class SlotExtra:
    """The server knobs of one slot (its request's :class:`Sampling` has some):
    ``banned``: ids whose logits are -inf (end-of-sequence and stop ids before
    ``min_new_tokens``); ``tokens``: what the penalties count (prompt and output so far,
    drafts before the slot included; ``tokens[n_prompt:]`` is the output), None without
    penalties."""

    slot: int
    sampling: Sampling
    banned: tuple[int, ...] = ()
    tokens: np.ndarray | None = None
    n_prompt: int = 0


@dataclass
class SamplerOutput:
    """Host copies of a step's draws: ``ids[i]`` is slot i's token, ``accepted[g]`` the
    accepted drafts of verify group g. ``device_ids`` stays on the device (a later step
    could feed it without a host round trip). ``logprobs``: None, or (logprob ``[L]``,
    top ids ``[L, K]``, top logprobs ``[L, K]``) for the slots of the spec's extras that ask
    for log-probabilities, in order, then its ``prompt_rows``."""

    ids: np.ndarray
    accepted: np.ndarray
    device_ids: Any = None                # a torch.Tensor, on the device
    logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


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
    # its row of a TokenStore while one holds its drawn tokens (see hold)
    row: StoredRow | None = None
    # preempted with its K/V kept in host memory (a generate.spill.Spill): restored, not
    # recomputed, when it is admitted again
    spill: Any = None

    @property
    def req(self) -> Request:
        return self.job.req

    @property
    def to_feed(self) -> int:
        """Tokens it knows and the cache does not hold yet: 1 when it decodes (its last
        token is fed next), more while a prompt (or a preempted sequence) is read."""
        return len(self.tokens) - self.in_cache

    def draws_left(self) -> int:
        """The tokens it may still draw before it ends by length (0 from the start for a
        request that draws nothing, ``max_new_tokens`` 0: it ends once its prompt is read)."""
        req = self.job.req
        return req.sampling.max_new_tokens - len(req.outputs[self.index])

    def forks_next(self) -> bool:
        """Whether its next draw is its request's first token with ``n > 1``: the other
        continuations are made from it then."""
        return self.index == 0 and self.job.req.sampling.n > 1 and not self.job.forked

    def claim(self, have: int) -> int:
        """Cells it still claims once ``have`` of its tokens are in the cache: up to
        :meth:`Sampling.cells_needed` in all, and its other continuations' own tokens while
        they are not forked yet."""
        req = self.job.req
        sp = req.sampling
        more = max(0, sp.cells_needed(len(req.prompt)) - have)
        if self.forks_next():
            more += (sp.n - 1) * max(0, sp.max_new_tokens - 1)
        return more

    def end_reason(self, n_out: int, tok: int, eos: set[int]) -> str | None:
        """Why it ends once it has ``n_out`` tokens, the last ``tok`` (None: it goes on)."""
        return self.job.req.end_reason(n_out, tok, eos)

    def hold(self, row: StoredRow) -> None:
        """From now on its tokens, its ``in_cache`` and its request's lists of it read
        through ``row`` (their values before, then the row's stored steps) until
        :meth:`settle`. Nothing may append to its lists meanwhile."""
        self.row = row
        self.job.req.store_row(self.index, row)
        self.__class__ = _HeldSeq

    def settle(self, ids: list[int], times: list[float]) -> None:
        """Ends :meth:`hold`: ``ids`` and ``times`` (its row's stored tokens and their
        times, all of them) are appended to its lists and counted in its ``in_cache``.
        Readers on other threads see every token throughout (the row answers until the
        lists are whole)."""
        row = self.row
        assert row is not None and len(ids) == row.count()
        row.end = len(ids)
        row.out.extend(ids)
        row.times.extend(times)
        row.tokens.extend(ids)
        self.job.req.unstore_row(self.index, row.out, row.times)
        self.in_cache = row.in_cache + len(ids)
        self.__class__ = Seq                  # (before the row goes: a reader may be reading)
        self.row = None

    def tokens_array(self, n: int | None = None) -> np.ndarray:
        """Its first ``n`` tokens (default: all) as int32, kept in ``arr`` (tokens only
        grow: extended, not rebuilt)."""
        if n is None:
            n = len(self.tokens)
        arr = self.arr
        if arr is None or len(arr) != n:
            if arr is None or len(arr) > n:
                arr = np.array(self.tokens[:n], dtype=np.int32)
            else:
                arr = np.concatenate([arr, np.array(self.tokens[len(arr):n], dtype=np.int32)])
            self.arr = arr
        return arr


@dataclass(eq=False)
class Outcome:
    """What a step does to one planned sequence, decided before anything is applied."""

    seq: Seq
    feed: list[int]
    keep: int                         # the sequence's in_cache after the step
    tokens: list[int] = field(default_factory=list)           # emitted, in order
    accepted: int = 0
    drafted: int = 0                  # draft tokens the verify row fed
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
    fast: Any = None                      # an ahead lean plan's steady record (scheduler.py)
    # ahead: its rows feed from the first slots of the previous plan's draws, in order (rows
    # that ended there were its last ones); False: every slot in order, or look them up
    prefix_fed: bool = False
    # the prompt token each of ``spec.prompt_rows`` gives the log-probability of: (request,
    # its index in the prompt)
    prompt_lp: list[tuple[Request, int]] = field(default_factory=list)
    # a general plan made ahead (:meth:`~.base.BaseScheduler.schedule_ahead`): its first
    # ``len(fed_slots)`` rows feed the token the step before draws at that slot (on the
    # device; ``tokens`` holds a stand-in), and ``shift`` gives each sequence of the step
    # before as that step leaves it, by id: (its in_cache, tokens it draws there: 0 or 1)
    fed_slots: list[int] = field(default_factory=list)
    shift: dict[int, tuple[int, int]] | None = None

    @property
    def flies(self) -> bool:
        """Whether the step may be left in flight (asynchronous steps): the next one can be
        planned before its draws are known. Not a verify run (accepted drafts are decided
        on the host), nor a step whose first tokens fork a request's continuations."""
        return self.lean or not (self.children or self.spec.groups)

    @property
    def width(self) -> int:
        """Tokens the forward carries."""
        return sum(len(feed) for _, feed in self.rows)

    def token_sids(self) -> list[int] | np.ndarray:
        """The cache id of every token of the step, in order (what ``declare_step`` takes): a
        list where each row feeds one token, else an int64 array (a mixed step's 8K tokens
        as a list cost ~5x the array's time, on the host time of every mixed step)."""
        sids = [s.sid for s, _ in self.rows]
        lens = [len(feed) for _, feed in self.rows]
        if len(lens) == sum(lens):
            return sids  # type: ignore[return-value]
        return np.repeat(np.array(sids, np.int64), lens)

    def logit_contexts(self) -> list[tuple[Request, int, tuple[int, ...] | int]]:
        """For each of the step's logits rows, in order, ``(request, continuation, context)``:
        the token ids whose next-token logits the row holds (what the sequence had in the
        cache, then its feed up to that row), or, for a row of a plan scheduled ahead (its
        token still on the device), the int length of that context (``Generator.on_logits``
        states the contract). Called before the step is applied."""
        if self.lean:
            if self.ahead:                    # in the cache, the token fed by the step before,
                return [(s.job.req, s.index, s.in_cache + 2) for s in self.seqs]   # and its draw
            return [(s.job.req, s.index, tuple(s.tokens)) for s in self.seqs]
        owner: list[tuple[Seq, list[int], int]] = []      # each fed row's (seq, feed, offset)
        for s, feed in self.rows:
            owner += [(s, feed, j) for j in range(len(feed))]
        out: list[tuple[Request, int, tuple[int, ...] | int]] = []
        shift = self.shift
        for r in self.logit_rows:
            s, feed, j = owner[r]
            if shift is not None:             # made ahead: every context by its length
                out.append((s.job.req, s.index, shift.get(id(s), (s.in_cache, 0))[0] + j + 1))
            else:
                out.append((s.job.req, s.index, tuple(s.tokens[:s.in_cache]) + tuple(feed[:j + 1])))
        return out

    def lean_rows(self, rows: list[Seq], ahead: bool, prompt_last: int = 0) -> None:
        """Makes this (empty) plan a lean one over ``rows``: row i feeds one token and draws
        at slot i."""
        n = len(rows)
        self.rows = [(s, ONE) for s in rows]
        self.lean, self.seqs, self.prompt_last, self.ahead = True, rows, prompt_last, ahead
        self.logit_rows = list(range(n))
        self.owners = [(s, ONE, i, -1) for i, s in enumerate(rows)]
        self.spec.rows = self.logit_rows
        self.spec.dense = n


class _HeldSeq(Seq):
    """A :class:`Seq` whose drawn tokens a :class:`TokenStore` holds (:meth:`Seq.hold` makes
    it one, :meth:`Seq.settle` a plain Seq again): ``tokens`` and ``in_cache`` count the
    row's stored steps. A class of its own, so that a plain Seq's attributes (read on every
    path, many times a step) stay plain ones."""

    @property
    def tokens(self) -> list[int]:
        row = self.row
        assert row is not None
        return row.tokens_list()

    @tokens.setter
    def tokens(self, value: list[int]) -> None:
        self.__dict__["tokens"] = value

    @property
    def in_cache(self) -> int:
        row = self.row
        assert row is not None
        return row.in_cache + row.count()

    @in_cache.setter
    def in_cache(self, value: int) -> None:
        self.__dict__["in_cache"] = value


class TokenStore:
    """What consecutive steady decode steps drew for a fixed set of rows (running
    continuations), as arrays rather than appended to every row's lists: step j's ids at
    ``ids[j, :live]`` (row i at ``ids[j, i]``), its time at ``stamps[j]``, ``k`` steps
    written, one store a step (:meth:`write`). Row i's sequence and request read through
    its :class:`StoredRow`, from any thread, without the scheduler. Rows ``[live, n)``
    have settled (ended, or handed to another path): the store goes on without them.

    Example
    -------
    >>> store = TokenStore(2, 4); store.write(np.array([5, 6]), 0.5); store.k
    1
    """

    __slots__ = ("ids", "stamps", "k", "live")

    def __init__(self, n: int, width: int):
        self.ids = np.empty((max(1, width), n), dtype=np.int32)
        self.stamps = np.empty(max(1, width), dtype=np.float64)
        self.k = 0
        self.live = n

    def write(self, ids: np.ndarray, now: float) -> None:
        """Stores one step's ids of the drawing rows (``ids[i]``: row i's, ``len(ids) ==
        live``) and its time. The count is published last: a reader that reads ``k`` first
        never reads past what was written."""
        j = self.k
        if j == len(self.stamps):
            self._grow()
        self.ids[j, :len(ids)] = ids
        self.stamps[j] = now
        self.k = j + 1

    def _grow(self) -> None:
        """Twice the steps; the arrays are replaced whole (a reader holding the old ones
        reads what they held)."""
        k, w = self.k, 2 * len(self.stamps)
        ids = np.empty((w, self.ids.shape[1]), dtype=np.int32)
        ids[:k] = self.ids[:k]
        stamps = np.empty(w, dtype=np.float64)
        stamps[:k] = self.stamps[:k]
        self.ids, self.stamps = ids, stamps

    def column(self, i: int, n: int) -> list[int]:
        """Row i's first ``n`` stored ids."""
        return self.ids[:n, i].tolist()

    def times(self, n: int) -> list[float]:
        """The first ``n`` steps' times."""
        return self.stamps[:n].tolist()


@dataclass(eq=False)
class StoredRow:
    """Column ``col`` of a :class:`TokenStore` as its sequence and request read it: their
    lists' first entries (``out[:n_out]``, ``times[:n_out]``, ``tokens[:n_tok]``, which
    only :meth:`Seq.settle` extends) and then the stored steps; ``in_cache`` its sequence's
    count before them. ``end`` freezes the steps that are its own once it settled."""

    store: TokenStore
    col: int
    out: list[int]
    times: list[float]
    tokens: list[int]
    n_out: int
    n_tok: int
    in_cache: int
    end: int | None = None

    def count(self) -> int:
        """Its stored steps. The store's count is read first: a row settles (``end`` set)
        before the store writes a step without it."""
        k = self.store.k
        end = self.end
        return k if end is None else end

    def ids(self) -> list[int]:
        """Its request's output list: the tokens before the store, then its stored ones."""
        n = self.count()
        return self.out[:self.n_out] + self.store.column(self.col, n)

    def token_times(self) -> list[float]:
        """Its request's token times, as :meth:`ids`."""
        n = self.count()
        return self.times[:self.n_out] + self.store.times(n)

    def tokens_list(self) -> list[int]:
        """Its sequence's tokens (prompt and outputs), as :meth:`ids`."""
        n = self.count()
        return self.tokens[:self.n_tok] + self.store.column(self.col, n)
