"""The scheduler's one door to memory (vLLM's ``KVCacheManager``): the cache's verbs and the
prefix cache's, behind a handful of serving verbs.

::

    find what is cached      hit(tokens) / waits_for(tokens, hit) / reading(seq, hit)
    room for a step          evict(cells) / evict_for(...) / obtain(seq, ...) / declare(sids)
                             fork(parent, child) / rewind(seq, keep) / commit_step()
    cache what was computed  placed(seq) (a prompt whole in the cache is stored and lent)
    free                     release(seq, store) / give_lent(seqs, tails) / let_go(seq, mine)

:class:`KVManager` owns the pending prompts (a prompt being read, which a waiting request
sharing more of it waits for) and the rule for a user's ``on_event`` failing inside the
prefix cache: the exception is kept in ``later`` (raised by the caller once its step is
whole) and the verb goes on as if it had returned its default. The scheduler decides which
sequence gets what; it never calls the cache or the prefix cache itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..cache import CellCache
from ..errors import CellCacheError, OutOfMemory, StepTooLarge
from ..prefix import PrefixCache
from ..radix import PendingPrompts
from .plan import Seq

__all__ = ["KVManager"]


class KVManager:
    """Memory for the sequences of one scheduler: ``cache`` (its ids and cells) and
    ``prefix`` (None: no prefix cache). ``later`` collects the exceptions a prefix-cache
    callback raised in the middle of a verb.

    Example
    -------
    >>> kv = KVManager(cache, prefix, later=[])                     # doctest: +SKIP
    >>> sid, hit = kv.obtain(seq, seq.tokens_array(), kv.hit(seq.tokens_array()))  # doctest: +SKIP
    """

    def __init__(self, cache: CellCache, prefix: PrefixCache | None, later: list[BaseException]):
        self.cache = cache
        self.prefix = prefix
        self.later = later
        #: prompts being read with a prefix cache on (a radix tree of their tokens)
        self.pending = PendingPrompts()
        #: Keeps preempted sequences' K/V in host memory (a generate.spill.Spiller), or None:
        #: they are read again.
        self.spiller: Any = None
        #: The prefix cache's host level (a generate.spill.PrefixTier over the spiller), or None.
        self.l2: Any = None

    # -- what the cache holds ------------------------------------------------------------------
    @property
    def caching(self) -> bool:
        """Whether finished prefixes are kept (a prefix cache is on)."""
        return self.prefix is not None

    @property
    def free_cells(self) -> int:
        return self.cache.free_cells

    @property
    def max_kv(self) -> int:
        """Most kv entries a step may read (the paged view's bound; unbounded without it)."""
        cfg = self.cache.config
        return cfg.max_kv if cfg.paged else 1 << 62

    def hit(self, arr: np.ndarray) -> int:
        """Tokens of ``arr`` (a sequence's, int32) the prefix cache holds, all but the last at
        most (a sequence feeds at least one token); 0 without a prefix cache."""
        pc = self.prefix
        return pc.peek(arr, max_len=len(arr) - 1) if pc is not None else 0

    def waits_for(self, arr: np.ndarray, hit: int) -> bool:
        """Whether a prompt being read shares more with ``arr`` than the ``hit`` the cache
        gives it (it is better admitted once that prompt is stored)."""
        return bool(self.pending.size) and self.pending.lcp(arr.tobytes()) > hit

    def reading(self, s: Seq, hit: int) -> None:
        """s, just admitted with ``hit`` cached tokens, reads the rest of its prompt: pending
        until it is stored (only with a prefix cache)."""
        n = len(s.req.prompt)
        if self.prefix is not None and hit < n:
            s.pending = s.tokens_array()[:n].tobytes()
            self.pending.add(s.pending)

    def done_reading(self, s: Seq) -> None:
        """s's prompt is no longer being read (stored, or s let go)."""
        if s.pending is not None:
            self.pending.remove(s.pending)
            s.pending = None

    # -- room for a step -----------------------------------------------------------------------
    def _pcall(self, default: Any, fn: Callable, *args: Any, **kw: Any) -> Any:
        """A prefix-cache operation that changes it. An exception (from a user's ``on_event``:
        the prefix cache is consistent when it propagates), KeyboardInterrupt and SystemExit
        too, is kept in ``later`` (raised once the step is whole: raised here, it stopped a
        step's apply half-way, its later rows placed in the cache but not advanced);
        ``default`` stands for the lost result."""
        try:
            return fn(*args, **kw)
        except BaseException as e:
            self.later.append(e)
            return default

    def evict(self, cells: int) -> int:
        """Asks the prefix cache for ``cells`` cells; returns those freed."""
        if self.prefix is None or cells <= 0:
            return 0
        before = self.cache.free_cells
        self._pcall(0, self.prefix.evict, cells)
        return self.cache.free_cells - before

    def evict_for(self, arr: np.ndarray, hit: int, cells: int, partial: bool) -> int:
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
            return self.evict(cells)
        finally:
            if held:
                try:
                    pc.unpin(arr, held)
                except CellCacheError:                # the tree was forgotten meanwhile
                    pass

    def obtain(self, w: Seq, arr: np.ndarray, hit: int) -> tuple[int | None, int]:
        """A cache id for w: a clone holding its cached prefix (pinned) when ``hit``, else a
        new one; a prefix-cache leaf is evicted when no id is free. Returns (id, tokens it
        holds), or (None, 0) when no id is had."""
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

    # -- the host tier -------------------------------------------------------------------------
    def spill(self, s: Seq) -> None:
        """s, running and about to be freed, keeps a host copy of its K/V when a spiller is
        on and its budget holds it (s.spill; None otherwise)."""
        sp = self.spiller
        if sp is not None and s.sid is not None and s.in_cache > 0:
            # evicted prefixes make room for a preempted sequence, never the other way (and
            # only when that makes room: a copy failing for another reason keeps them)
            if self.l2 is not None:
                self.l2.make_room(sp.bytes_for(s.in_cache))
            s.spill = sp.take(s.sid, s.in_cache)

    def restore(self, s: Seq, sid: int, start: int) -> int:
        """Places s's spilled positions past ``start`` (``sid`` holds ``[0, start)``); returns
        the tokens restored, 0 when it failed (the spill is gone either way; ``sid`` back at
        ``start``)."""
        spill, s.spill = s.spill, None
        try:
            self.spiller.give(spill, sid, start)
        except OutOfMemory:
            return 0
        return spill.end - start

    def drop_spill(self, s: Seq) -> None:
        """s's host copy, if any, goes (s ends, or is read again instead)."""
        if s.spill is not None:
            if self.spiller is not None:
                self.spiller.drop(s.spill)
            s.spill = None

    def declare(self, sids: Any) -> bool:
        """Declares a step of ``sids``' tokens; False (nothing declared) when the cache has
        no room for it now or the paged view cannot take it (StepTooLarge)."""
        try:
            return self.cache.declare_step(sids)
        except StepTooLarge:
            return False

    def commit_step(self) -> None:
        """The prepared step's forward is queued (or may have been)."""
        self.cache.commit_step()

    def fork(self, s: Seq, child: Seq) -> bool:
        """Gives ``child`` (a new continuation of s's request) a clone of s's prompt cells
        (a prefix-cache leaf evicted when no id is free), the prompt pinned in the prefix
        cache; False (nothing changed) when no id is had."""
        n = len(s.req.prompt)
        if s.sid is None:
            return False
        sid = self.cache.seq_clone(s.sid, n)
        pc = self.prefix
        if sid is None and pc is not None:
            self._pcall(0, pc.evict, n_ids=1)
            sid = self.cache.seq_clone(s.sid, n)
        if sid is None:
            return False
        child.sid, child.in_cache = sid, n
        if pc is not None:                            # the prompt it shares stays cached
            p = s.tokens_array()[:n]
            if child.arr is None:
                # its tokens' array (what it stores when it ends) starts as the prompt's: a
                # view, as arrays here only ever grow by copy, not built again from its list
                child.arr = p
            held = pc.pin(p)
            if held:
                child.pins.append((p, held))
            child.stored = True
        return True

    def rewind(self, s: Seq, keep: int) -> bool:
        """Drops s's cells from position ``keep`` on (s's in_cache then ``keep``); False when
        the cache refuses (the cache and the scheduler disagree: s is to be read again)."""
        assert s.sid is not None
        if self.prefix is not None and s.stored and keep < len(s.req.prompt):
            self._pcall(False, self.prefix.reclaim, s.sid)   # (below a prompt it lends)
        if self.cache.rewind(s.sid, keep):
            s.in_cache = keep
            return True
        return False

    # -- cache what was computed ---------------------------------------------------------------
    def placed(self, s: Seq) -> None:
        """s's tokens in the cache grew: once its prompt is whole there it is stored in the
        prefix cache and kept there while s runs. s lends it (no clone: no cell changes
        owner); ending s gives the tree s itself, and freeing it otherwise (preempted,
        cancelled) reclaims the prompt first. A prompt s lends needs no pin (a lent leaf is
        never evicted, nor the path above it). Of a prompt the tree held already, s shares
        only its hit (pinned since its admission); the tree's copy of the rest, which s
        computed again, stays evictable: pinned, it held cells s never reads, and a request
        that fitted alone ended short with ``capacity``."""
        pc = self.prefix
        if pc is None or s.stored or s.sid is None or s.in_cache < len(s.req.prompt):
            return
        self._pcall(0, pc.lend, s.sid, s.tokens_array()[:len(s.req.prompt)])
        s.stored = True
        self.done_reading(s)

    # -- free ----------------------------------------------------------------------------------
    def release(self, s: Seq, store: bool) -> None:
        """Gives back s's cache id and cells; s is then a sequence to be read from scratch.
        ``store``: s ends, its tokens in the cache go to the prefix cache first. An
        exception from a user's ``on_event`` (KeyboardInterrupt too) is kept in ``later``,
        s freed all the same."""
        self.done_reading(s)
        if store:                             # it ends: a host copy has no use
            self.drop_spill(s)
        pc = self.prefix
        sid = s.sid
        mine = sid is not None                # the id is still s's to remove
        try:
            if pc is not None and store and sid is not None and s.in_cache > 0:
                tokens = s.tokens_array()[:s.in_cache]
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
        except BaseException as e:        # (raised by the step once it is whole)
            self.later.append(e)
        finally:
            self.let_go(s, mine)

    def lends(self, s: Seq) -> bool:
        """Whether ending s can go through :meth:`give_lent`: it lends its prompt to the
        prefix cache and holds tokens past it."""
        return self.prefix is not None and s.sid is not None and s.stored \
            and len(s.req.prompt) < s.in_cache

    def give_lent(self, seqs: list[Seq], tails: list[np.ndarray]
                  ) -> tuple[list[bool], BaseException | None]:
        """Ends sequences that :meth:`lends` in one call: the prefix cache takes each one's
        id and its tokens past its prompt (``tails[j]``, int32). Returns whether it took
        each (a sequence it took is then let go with ``let_go(s, False)``) and the exception
        a user's ``on_event`` raised (after the tree took every one it gives), if any."""
        pc = self.prefix
        assert pc is not None
        sids = [s.sid for s in seqs]
        try:
            return pc.give_lent(sids, [len(s.req.prompt) for s in seqs], tails), None
        except BaseException as e:
            return [pc.owns(sid) for sid in sids], e

    def let_go(self, s: Seq, mine: bool) -> None:
        """s's pins go, and its id (``mine``: still s's, removed here; a prompt it lends is
        reclaimed first); s is left a sequence to be read from scratch."""
        self.done_reading(s)
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
