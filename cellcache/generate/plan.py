"""The contract between the scheduler, the runner and the sampler: :class:`StepPlan` (what a
step feeds and draws), :class:`Outcome` (what it does to one sequence), and the serving
state they name, :class:`Job` (a request) and :class:`Seq` (one continuation). Each serving
rule is one method here, called everywhere it applies: the tokens a sequence has left to
feed (:attr:`Seq.to_feed`), the tokens it may still draw (:meth:`Seq.draws_left`), the
cells it still claims (:meth:`Seq.claim`), whether its next draw forks it
(:meth:`Seq.forks_next`) and why a drawn token ends it (:meth:`Seq.end_reason`, from
:meth:`~cellcache.generate.requests.Request.end_reason`). Nothing here touches torch or
the cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .requests import Request
from .sampler import SampleSpec

__all__ = ["ONE", "Job", "Outcome", "Seq", "StepPlan"]

#: a lean plan's feed of every row: one token (read only for its length; the values are in
#: ``plan.tokens``, or on the device for a plan scheduled ahead)
ONE: list[int] = [0]


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

    @property
    def to_feed(self) -> int:
        """Tokens it knows and the cache does not hold yet: 1 when it decodes (its last
        token is fed next), more while a prompt (or a preempted sequence) is read."""
        return len(self.tokens) - self.in_cache

    def draws_left(self) -> int:
        """The tokens it may still draw before it ends by length."""
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
            more += (sp.n - 1) * (sp.max_new_tokens - 1)
        return more

    def end_reason(self, n_out: int, tok: int, eos: set[int]) -> str | None:
        """Why it ends once it has ``n_out`` tokens, the last ``tok`` (None: it goes on)."""
        return self.job.req.end_reason(n_out, tok, eos)

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
    fast: Any = None                      # an ahead lean plan's steady record (steady.py)
    # ahead: its rows feed from the first slots of the previous plan's draws, in order (rows
    # that ended there were its last ones); False: every slot in order, or look them up
    prefix_fed: bool = False

    @property
    def width(self) -> int:
        """Tokens the forward carries."""
        return sum(len(feed) for _, feed in self.rows)

    def token_sids(self) -> list[int]:
        """The cache id of every token of the step, in order (what ``declare_step`` takes)."""
        return [s.sid for s, feed in self.rows for _ in feed]  # type: ignore[misc]

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
