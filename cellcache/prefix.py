"""A prefix cache over a cell cache: a radix tree of token ids whose paths are held by
sequences the prefix cache owns. A hit is ``seq_clone(upto)``: owner bits on cells that
already hold the prefix, nothing copied, at any token boundary.

::

    inserted: a b c d e f g h   (by a caller's sequence, cloned into s1)
              a b c d x y       (cloned into s2)
              a b z             (cloned into s3)

    root
     └─ [a b]              internal  covered by any descendant leaf's sequence (s1, s2 or s3)
         ├─ [c d]          internal  covered by s1 or s2
         │   ├─ [e f g h]  leaf  owns s1: pos(s1) = 8, s1 holds positions 0..7 = a..h
         │   └─ [x y]      leaf  owns s2: pos(s2) = 6, s2 holds positions 0..5 = a b c d x y
         └─ [z]            leaf  owns s3: pos(s3) = 3

    match(a b c d x q)  -> walks root, [a b], [c d], 1 token into [x y]: n = 5,
                           returns seq_clone(s2, upto=5), a new sequence the caller owns
    evict [x y]         -> its parent keeps another child: seq_rm(s2) (the id is released;
                           cells shared with a running sequence stay that sequence's)
    evict [e f g h]     -> its parent [c d] becomes a leaf: rewind(s1, 4) and [c d] adopts s1
                           (nothing is copied, no id is needed)

Rules the tree keeps:

- One sequence per leaf, none on internal nodes and the root. An owned leaf's sequence
  holds exactly its path: ``pos(seq) == leaf.end``, position ``q`` holds the path's token
  ``q``; a lent leaf's (below) holds its path and maybe more. An internal node's prefix is
  held by every descendant leaf's sequence, so the ids the tree needs are its owned leaves
  (at most ``max_seqs``, a budget the caller chooses so that running requests keep enough
  ids).
- Every prefix of a stored path is cached: ``match`` finds the longest common prefix with
  any path, ending anywhere inside a node. Node boundaries are insertion ends and branch
  points; eviction takes whole leaves, least valuable first by the policy, never a pinned
  prefix: a leaf pinned only above its end loses its tail below the deepest pin (split
  there), so a request holding a short hit into a long cached path never keeps the rest.
- ``insert(seq, tokens)`` clones the caller's sequence (``upto=len(tokens)``) into one new
  owned sequence for the new leaf. When the caller's sequence came from ``match`` (the
  usual path: match, compute the tail, insert), its prefix cells are the tree's own and the
  clone shares them; when the caller computed the shared part itself, the new leaf holds
  its own copy of those cells until one of the two leaves is evicted. When the new leaf
  extends an old leaf, the old leaf's sequence is dropped (the new one covers its path).
  ``give(seq, tokens)`` is the same for a caller that ends ``seq``: the leaf takes ``seq``
  itself (no clone, no cell changes owner), or ``seq`` is removed when nothing is stored.
- ``lend(seq, tokens)`` is the same for a caller that goes on running ``seq``: the new leaf
  names ``seq`` itself, still the caller's (``pos(seq) >= leaf.end``), so storing a prompt
  changes no cell's owner. A lent leaf is never evicted. It stays lent until a longer path
  covers it, or its lender gives ``seq`` (then the leaf is the tree's), or calls
  ``reclaim(seq)``, which a lender must call before it removes ``seq`` or rewinds it below
  the lent prefix: the tree then clones ``seq`` into an id of its own, or, with no cache id
  to be had, drops the lent leaf (a ``"dropped"`` event; its pins go with it). A lent leaf
  counts in ``max_seqs`` like an owned one: the id its reclaim will need.
- Eviction drops only the prefix cache's owner bits: a cell that a caller's sequence also
  owns stays allocated and keeps its contents, so no running sequence loses a cell.
- Ownership: sequences the prefix cache owns (``owned_seqs()``) must not be touched by
  anyone else. ``cache.clear()`` releases them (and the lenders'): call
  :meth:`PrefixCache.invalidate` after it. Otherwise the next operation that changes the
  tree sees the cache's count of clears moved (``CellCache.clears``) and forgets the whole
  tree without touching the cache (``metrics()["invalidations"]``); over a cache that keeps
  no such count, an owned sequence no longer live or of another length is what tells, and
  an id reused in between with the very same length (or, lent, at least as long) cannot
  be told apart, hence the rule.

A server uses it so (``prompt`` an int32 array)::

    seq, n = prefix.match(prompt, max_len=len(prompt) - 1, pin=True)   # admission
    if seq is None:
        seq, n = cache.seq_new(), 0          # (prefix.evict(n_ids=1) first if no id is free)
    ...                                      # prefill prompt[n:], the forward commits
    prefix.insert(seq, prompt)               # once positions [0, len(prompt)) are placed
    ...                                      # when a step does not fit:
    prefix.evict(needed - cache.free_cells)  #   before preempting a running request
    ...                                      # when the request ends (or is preempted):
    if n:
        prefix.unpin(prompt, n)              # its cached prefix is evictable again

Pinning is optional: eviction never takes a running sequence's cells anyway, but evicting
the prefix a running request shares frees nothing and loses the entry.

Tokens are ints in ``[-2**31, 2**31)``, stored as int32 in a :class:`cellcache.radix.RadixTree`
(a lookup is a dict probe and a memcmp per node, not Python work per token). Pass tokens as
a 1-D int32 numpy array on hot paths: a list is converted first, which costs Python work
per token, more than the lookup itself.

The tree and its per-node state live in ``prefix_tree.py`` (over ``radix.py``'s tree, which
the pending prompts share), the eviction order in ``prefix_policy.py``, events in ``prefix_events.py``.

Each call is atomic under the prefix cache's own lock; each cache verb it makes is atomic
under the cache's. Drive the prefix cache from the thread that drives the steps, between
forwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ._checks import check_int, check_seq_id
from .errors import InvalidArgument, InvalidState
from .prefix_events import Operations, PrefixEvent, prefix_key
from .prefix_policy import POLICIES, EvictionOrder, evictable, policy_key
from .prefix_tree import PrefixNode, PrefixTree
from .radix import as_tokens

__all__ = ["POLICIES", "PrefixCache", "PrefixEvent", "PrefixNode", "prefix_key"]

_I32 = np.dtype(np.int32)


class PrefixCache:
    """Cached prompt prefixes over a :class:`cellcache.CellCache`, shared by cloning.

    Parameters
    ----------
    cache
        The cell cache (any backend). The prefix cache uses only its verbs (``seq_clone``,
        ``seq_rm``, ``rewind``, ``pos``, ``live_seqs``, ``free_cells``).
    policy
        Which unpinned leaf eviction takes first: ``"lru"`` (default), ``"lfu"``,
        ``"priority"`` (lowest ``insert(priority=)`` first, then LRU), or a callable
        ``key(node: PrefixNode) -> comparable`` (smallest first). A callable that raises,
        or whose keys do not compare with one another, is user code failing: that
        operation evicts by LRU instead and the exception propagates once it has finished
        (the tree and the cache are consistent), as ``on_event``'s does.
    max_seqs
        Most sequence ids the tree holds at once (one per leaf); default a quarter of the
        cache's ``max_seqs`` (at least 1). An insert that needs one more evicts a leaf.
    on_event
        ``on_event(event: PrefixEvent)``, called after each operation for each prefix
        stored, evicted or dropped. An exception from it propagates once the operation has
        finished (the tree and the cache are consistent).

    Example
    -------
    >>> from cellcache import CacheConfig, LayerConfig, PrefixCache, build
    >>> cache = build("host", "batched", CacheConfig(capacity=256, layers=[LayerConfig(1, 8)],
    ...                                               max_write=16, mask_format="none"))
    >>> prefix = PrefixCache(cache)
    >>> prompt = [5, 6, 7, 8, 9]
    >>> s = cache.seq_new()
    >>> cache.declare_step([s] * len(prompt))    # the prompt's forward: prepare, run, commit
    True
    >>> step = cache.prepare_step(); cache.commit_step()
    >>> prefix.insert(s, prompt)
    5
    >>> t, n = prefix.match([5, 6, 7, 1], max_len=3)   # keep one token to feed
    >>> n, cache.pos(t)
    (3, 3)
    """

    def __init__(self, cache: Any, policy: str | Callable[[PrefixNode], Any] = "lru", *,
                 max_seqs: int | None = None,
                 on_event: Callable[[PrefixEvent], Any] | None = None):
        for verb in ("seq_clone", "seq_rm", "rewind", "pos", "live_seqs", "max_seqs"):
            if not hasattr(cache, verb):
                raise InvalidArgument(
                    f"cache of type {type(cache).__name__} has no {verb}; give a CellCache")
        key = policy_key(policy)
        if on_event is not None and not callable(on_event):
            raise InvalidArgument(f"on_event of type {type(on_event).__name__} is not callable")
        if max_seqs is None:
            max_seqs = max(1, cache.max_seqs // 4)
        self.max_seqs = check_int(max_seqs, "max_seqs", 1, cache.max_seqs)
        self.cache = cache
        self.policy = policy
        self._key = key
        #: Called as ``before_evict(seq, length, tokens)`` just before an eviction frees the
        #: cells of a stored prefix: ``seq`` (the prefix cache's sequence) holds positions
        #: ``[0, length)`` of the prefix ``tokens`` (int32), which a host tier may copy
        #: (:class:`cellcache.generate.spill.PrefixTier`); inside the operation, on the thread
        #: that evicts. An exception it raises is dropped: the eviction goes on. None: off.
        self.before_evict: Callable[[int, int, np.ndarray], Any] | None = None
        self._op = Operations(on_event)           # the lock, and the events to deliver
        self._clock = 0
        self._shape = 0
        self._reset()
        self._stats = dict.fromkeys(
            ("matches", "hits", "hit_tokens", "no_id", "inserts", "stored_tokens",
             "insert_skipped", "evictions", "evicted_tokens", "evicted_cells",
             "invalidations", "reclaims", "dropped"), 0)

    @property
    def on_event(self) -> Callable[[PrefixEvent], Any] | None:
        """The callback events go to (None: none is queued); settable, as at construction."""
        return self._op.on_event

    @on_event.setter
    def on_event(self, fn: Callable[[PrefixEvent], Any] | None) -> None:
        if fn is not None and not callable(fn):
            raise InvalidArgument(f"on_event of type {type(fn).__name__} is not callable")
        with self._op.lock:
            self._op.on_event = fn

    def _reset(self) -> None:
        self._tree = PrefixTree(self._clock)
        self._owned: dict[int, PrefixNode] = {}   # owned sequence -> its leaf
        self._lent: dict[int, PrefixNode] = {}    # a caller's sequence lending a leaf -> it
        self._clears = self._cache_clears()       # the cache's clear() count the tree is of
        self._shape += 1                          # bumped whenever nodes are removed

    # -- lookup ------------------------------------------------------------------------------
    def _query(self, tokens: object, max_len: object) -> tuple[np.ndarray, bytes]:
        arr = as_tokens(tokens)
        if max_len is not None:
            ml = check_int(max_len, "max_len", 0, None)
            if ml < len(arr):
                arr = arr[:ml]
        return arr, arr.tobytes()

    def peek(self, tokens: Any, *, max_len: int | None = None) -> int:
        """The length of the longest cached prefix of ``tokens[:max_len]``; clones nothing,
        changes nothing (admission policies use it)."""
        arr, qb = self._query(tokens, max_len)
        with self._op.lock:
            return self._tree.walk(qb)[1]

    def match(self, tokens: Any, *, max_len: int | None = None,
              pin: bool = False) -> tuple[int | None, int]:
        """A new live sequence that owns the longest cached prefix of ``tokens[:max_len]``.

        Returns ``(seq_id, n)``: the caller owns ``seq_id`` (positions ``[0, n)`` hold
        ``tokens[:n]``) and feeds ``tokens[n:]``; ``(None, 0)`` on a miss or when no id is
        free. ``n == len(tokens)`` is possible: a caller that needs the logits of the last
        token passes ``max_len=len(tokens) - 1`` so that one token is left to feed.
        ``pin=True`` also pins the prefix (see :meth:`unpin`).
        """
        arr, qb = self._query(tokens, max_len)
        if not isinstance(pin, (bool, np.bool_)):
            raise InvalidArgument(f"pin of type {type(pin).__name__} is not a bool")
        with self._op:
            self._fresh()
            self._clock += 1
            st = self._stats
            st["matches"] += 1
            node, n = self._tree.walk(qb)
            if n == 0:
                return None, 0
            leaf = self._tree.leaf_under(node)
            if not self._intact(leaf):
                self._invalidate_locked()
                return (None, 0)
            sid = self.cache.seq_clone(leaf.seq, n)
            if sid is None:
                st["no_id"] += 1
                return None, 0
            if sid in self._owned or sid in self._lent:   # an id the tree names was free: cleared underneath
                self.cache.seq_rm(sid)
                self._invalidate_locked()
                return (None, 0)
            st["hits"] += 1
            st["hit_tokens"] += n
            self._tree.touch(node, self._clock)
            if pin:
                self._tree.pin(node, n)
            return sid, n

    # -- pins --------------------------------------------------------------------------------
    def pin(self, tokens: Any, *, max_len: int | None = None) -> int:
        """Pins the longest cached prefix of ``tokens[:max_len]`` and returns its length n
        (0: nothing pinned). A pinned prefix is never evicted until :meth:`unpin`; pins are
        counted, and dropped by :meth:`clear` and :meth:`invalidate`."""
        arr, qb = self._query(tokens, max_len)
        with self._op.lock:
            node, n = self._tree.walk(qb)
            if n:
                self._tree.pin(node, n)
            return n

    def unpin(self, tokens: Any, n: int) -> None:
        """Takes back one pin of ``tokens[:n]`` (as ``match(pin=True)`` or :meth:`pin`
        returned n). Raises InvalidState when that prefix holds no pin (nothing changes)."""
        arr, qb = self._query(tokens, None)
        n = check_int(n, "n", 1, len(arr))
        with self._op.lock:
            node, d = self._tree.walk(qb[:4 * n])
            if d != n or not self._tree.unpin(node, n):
                raise InvalidState(
                    f"the first {n} tokens hold no pin; pin them with match(pin=True) or pin()")

    # -- insert ------------------------------------------------------------------------------
    def insert(self, seq_id: int, tokens: Any, *, priority: float = 0.0) -> int:
        """Stores ``tokens`` (which the caller's sequence ``seq_id`` holds at positions
        ``[0, len(tokens))``) in the tree; the caller keeps its sequence.

        Returns the number of tokens newly cached: 0 when the whole of ``tokens`` was
        already cached, or when no id could be had (the tree's ``max_seqs`` reached and no
        leaf evictable, or every cache id live). ``priority`` (a real number) is the new
        leaf's, and raises the priority of the cached path to it (the ``"priority"``
        policy evicts the lowest first).

        Raises InvalidArgument (a bad id or tokens, an id the prefix cache owns, a bad
        priority) or InvalidState (``seq_id`` not live, or ``pos(seq_id) < len(tokens)``);
        a refusal changes nothing. The tokens are the caller's word: the tree cannot see
        token ids in cells.
        """
        return self._store(seq_id, tokens, priority, "insert")

    def give(self, seq_id: int, tokens: Any, *, priority: float = 0.0) -> int:
        """:meth:`insert`, and the caller's sequence goes with it: what a caller ending
        ``seq_id`` calls instead of ``insert`` then ``seq_rm``.

        Where insert makes a new leaf, the tree takes ``seq_id`` itself as that leaf's
        sequence (rewound to ``len(tokens)`` first) instead of a clone of it; otherwise
        (everything already cached, no id to be had) it removes ``seq_id`` with ``seq_rm``.
        Either way the caller no longer holds ``seq_id`` once it returns. The cells of the
        stored tokens then change no owner, where insert + seq_rm changes every one of them
        twice (the clone, then the removal): less work for the cache and its device mirror.

        A lender (see :meth:`lend`) gives as well: tokens that run on past its lent leaf
        extend it (the lent leaf's path is then covered, nothing changes owner); otherwise
        the tree keeps its lent leaf with ``seq_id`` itself, rewound to the leaf's end (no
        new id: the leaf already counts in the budget) and stores nothing more.

        Returns and refuses as :meth:`insert` does; after a refusal nothing has changed and
        the caller still holds ``seq_id``.
        """
        return self._store(seq_id, tokens, priority, "give")

    def give_lent(self, seqs: Any, starts: Any, tails: Any) -> list[bool]:
        """:meth:`give` (priority 0) of callers' sequences that lend a leaf (see :meth:`lend`)
        and ran on past it, under one lock and one check of the tree: what a generator
        ending a step's rows calls. ``starts[i]`` is the length of the prefix ``seqs[i]``
        lends, ``tails[i]`` the tokens it holds after it (positions ``[starts[i],
        starts[i] + len(tails[i]))``): :meth:`give` of the prefix, then the tail.

        Returns whether each row was given. A row is not (False, nothing changed for it:
        give it with :meth:`give`) when its sequence lends no leaf ending at ``starts[i]``
        (an id the tree owns lends none), its tail is empty, or the sequence holds fewer
        positions than the two together. A row given is left as :meth:`give` would have
        left it (the same tree, counters and events), except that the lent prefix is not
        compared with the leaf's tokens: the lender lent them.

        Raises InvalidArgument, changing nothing, for ``seqs``, ``starts`` and ``tails`` that
        are not lists (or tuples) of one length, a bad id, a start that is not an int >= 0,
        or a tail that is not token ids. An exception from ``on_event`` propagates once every
        row is done (a row given is one whose id the tree :meth:`owns` now)."""
        if not all(isinstance(x, (list, tuple)) for x in (seqs, starts, tails)) \
                or not len(seqs) == len(starts) == len(tails):
            raise InvalidArgument("seqs, starts and tails must be lists (or tuples) of one length")
        ms = self.cache.max_seqs
        ids = [check_seq_id(s, ms) for s in seqs]
        ends = [check_int(m, "start", 0, None) for m in starts]
        arrs = [as_tokens(t, "tail") for t in tails]
        given = []
        with self._op:
            self._fresh()
            lent, owned, cache, st = self._lent, self._owned, self.cache, self._stats
            for s, m, arr in zip(ids, ends, arrs):
                mine = lent.get(s)
                k = len(arr)
                # rewind refuses (False, nothing changed) unless s is live with pos >= m + k;
                # as give's, it drops a declared step naming s
                if mine is None or mine.end != m or not k or not cache.rewind(s, m + k):
                    given.append(False)
                    continue
                # give's path for it: s itself becomes the new leaf's sequence, the lent
                # leaf above it is covered (no id changes hands, no budget check: it counts)
                self._clock += 1
                st["inserts"] += 1
                leaf = PrefixNode(arr.tobytes(), m, mine, self._clock)
                leaf.seq = s
                mine.seq = None
                del lent[s]
                self._tree.add(leaf)
                owned[s] = leaf
                self._tree.touch(leaf, self._clock, 0.0)
                st["stored_tokens"] += k
                if self._op.on_event is not None:
                    self._op.events.append(PrefixEvent("stored", leaf.path(), k))
                given.append(True)
        return given

    def lend(self, seq_id: int, tokens: Any, *, priority: float = 0.0) -> int:
        """:meth:`insert` for a caller that goes on running ``seq_id`` (a request's prompt,
        stored once placed): the new leaf names ``seq_id`` itself, no clone, so no cell
        changes owner. The leaf counts in the tree's ``max_seqs`` budget as an owned one
        does (the id a clone needs if the lender leaves early): where the caller sizes the
        cache with the tree's ids beside its own, :meth:`reclaim` finds one unless the
        caller's sequences have taken them.

        The caller keeps ``seq_id`` and may extend it, but must call :meth:`reclaim`
        before it removes ``seq_id`` or rewinds it below ``len(tokens)`` (or end it with
        :meth:`give`). A lent leaf is never evicted (it would free no cell). It stops
        being lent when a longer stored path covers it; a sequence lends one leaf at a
        time (lending again reclaims the first, unless the new tokens extend it).

        Returns and refuses as :meth:`insert` does (0 when the tokens were all cached:
        nothing is lent then).
        """
        return self._store(seq_id, tokens, priority, "lend")

    def reclaim(self, seq_id: int) -> bool:
        """What a lender calls before it removes ``seq_id`` or rewinds it below its lent
        leaf: the tree clones ``seq_id`` (up to the leaf's end) into an id of its own (the
        leaf already counts in the budget), evicting a leaf off the path where the cache
        has no free id; with none to be had it drops the lent leaf (a ``"dropped"`` event;
        pins on its tokens go with it: their ``unpin`` then raises InvalidState).

        Returns whether the prefix stays cached; False also when ``seq_id`` lends nothing
        (nothing changes). Raises InvalidArgument for a bad id.
        """
        s = check_seq_id(seq_id, self.cache.max_seqs)
        if s not in self._lent:
            return False
        with self._op:
            self._fresh()
            if s not in self._lent:           # the tree was forgotten
                return False
            return self._reclaim_locked(s, adopt=False)

    def lent_seqs(self) -> list[int]:
        """The callers' sequence ids lending a leaf (see :meth:`lend`), ascending."""
        with self._op.lock:
            return sorted(self._lent)

    def _cache_clears(self) -> int | None:
        """The cache's count of ``clear()`` calls (None: a cache that keeps none)."""
        return getattr(self.cache, "clears", None)

    def _fresh(self) -> None:
        """What every changing operation does first: after a ``cache.clear()`` underneath
        (the cache's count of them moved) the tree is forgotten, none of its ids being its
        own or its lenders' any more (an id given out again, as long as a lent leaf or
        exactly as long as an owned one, cannot be told apart otherwise); an empty tree
        only takes the new count."""
        c = self._cache_clears()
        if c != self._clears:
            if self._owned or self._lent:
                self._invalidate_locked()     # (its reset takes the count)
            else:
                self._clears = c

    def _intact(self, leaf: PrefixNode, pos: int | None = None) -> bool:
        """Whether leaf's sequence still holds its path as far as its length tells: an
        owned one exactly (``pos == end``), a lent one at least (``pos >= end``). ``pos``:
        the sequence's position when the caller has just read it."""
        p = self.cache.pos(leaf.seq) if pos is None else pos
        return p == leaf.end if leaf.seq in self._owned else p >= leaf.end

    def _reclaim_locked(self, s: int, adopt: bool) -> bool:
        """Ends s's lend: its leaf gets an id of the tree's, a clone of s (``adopt``: s
        itself, rewound to the leaf's end: the caller gives s away), or is dropped. The
        leaf already counts in the budget; a clone needs a free cache id, had by evicting a
        leaf off its path where none is. Whatever raises meanwhile (a policy key), the lend
        has ended: no leaf names s any more."""
        leaf = self._lent.pop(s)
        self._stats["reclaims"] += 1
        tree = self._tree
        keep = None
        try:
            if self.cache.pos(s) >= leaf.end:
                if adopt:
                    keep = s if self.cache.rewind(s, leaf.end) else None
                else:
                    keep = self.cache.seq_clone(s, leaf.end)
                    if keep is None:
                        self._evict_locked(0, 1, leaf.line())
                        if self._tree is tree:
                            keep = self.cache.seq_clone(s, leaf.end)
        except BaseException:
            if self._tree is tree:
                self._drop(leaf)
            raise
        if keep is not None and not adopt and (keep in self._owned or keep in self._lent):
            self.cache.seq_rm(keep)           # an id the tree names was free: cleared underneath
            self._invalidate_locked()
            return False
        if self._tree is not tree:            # eviction found the cache cleared underneath
            return False
        if keep is not None:
            leaf.seq = keep
            self._owned[keep] = leaf
            return True
        self._drop(leaf)
        return False

    def _drop(self, leaf: PrefixNode) -> None:
        """Removes a leaf whose sequence goes (a lent one with no id to keep it), and the
        nodes above it left with neither children nor a sequence."""
        node = leaf
        root = self._tree.root
        while True:
            parent = node.parent
            assert parent is not None
            if self._op.on_event is not None:
                self._op.events.append(PrefixEvent("dropped", node.path(), node.n_tokens))
            self._tree.cut(node)
            node.seq = None
            if node.pins:
                self._tree.pins -= sum(node.pins.values())
                node.pins = None
            st = self._stats
            st["evictions"] += 1
            st["evicted_tokens"] += node.n_tokens
            st["dropped"] += 1
            if parent is root or parent.children:
                break
            node = parent
        self._shape += 1

    def _store(self, seq_id: int, tokens: Any, priority: float, mode: str) -> int:
        s = check_seq_id(seq_id, self.cache.max_seqs)
        arr = as_tokens(tokens)
        if isinstance(priority, (bool, np.bool_)) or not isinstance(
                priority, (int, float, np.integer, np.floating)) or priority != priority:
            raise InvalidArgument(f"priority={priority!r} is not a real number")
        priority = float(priority)
        give = mode == "give"
        n = len(arr)
        with self._op:
            self._fresh()
            if s in self._owned:
                raise InvalidArgument(
                    f"sequence {s} is owned by the prefix cache; insert a sequence of yours")
            p = self.cache.pos(s)
            if (n == 0 or p < n) and s not in self.cache.live_seqs():
                raise InvalidState(f"sequence {s} is not live; call seq_new() first")
            if p < n:
                raise InvalidState(
                    f"sequence {s} holds positions [0, {p}); inserting {n} tokens needs "
                    f"pos(seq) >= {n}")
            if n == 0:
                if give:
                    self._release(s)
                return 0
            self._clock += 1
            self._stats["inserts"] += 1
            qb = arr.tobytes()
            node, m = self._tree.walk(qb)
            mine = self._lent.get(s)
            if mine is not None and mode != "insert" and not (node is mine and m == mine.end < n):
                # s lends a leaf these tokens do not run on from: the tree keeps it first
                # (given: with s itself, which stores nothing more)
                kept = self._reclaim_locked(s, adopt=give)
                if give and kept:
                    self._tree.touch(mine, self._clock, priority)
                    return 0
                node, m = self._tree.walk(qb)
            if m == n:
                self._tree.touch(node, self._clock, priority)
                if give:
                    self.cache.seq_rm(s)
                return 0
            checked = None                  # a leaf found intact just now
            if give and (self._owned or self._lent):
                # the tree must still be the cache's before it takes s: insert's clone
                # would meet a released id, give checks a leaf (the one over the path, or
                # any): after cache.clear() underneath, s would join a tree forgotten later
                leaf = self._tree.leaf_under(
                    node if m else next(iter((self._owned or self._lent).values())))
                if self._intact(leaf, p if leaf.seq == s else None):
                    checked = leaf
                else:
                    self._invalidate_locked()
                    node, m = self._tree.walk(qb)
            shape = self._shape
            new = self._take_id(qb, n, node, m, s, mode, checked)
            if new is None:
                self._stats["insert_skipped"] += 1
                if give:
                    self._release(s)
                return 0
            if give:
                # always, even at pos n: like seq_rm, it drops a declared step naming s and
                # ends the undo of a placement, which would otherwise move the leaf's sequence
                self.cache.rewind(s, n)
            elif mode == "insert" and (new in self._owned or new in self._lent):
                self._invalidate_locked()   # an id the tree names was free: cleared underneath
            # evictions for the id keep the cached path but may have made a leaf of its end
            # (or, finding the cache cleared underneath, forgotten the tree): walk again
            if self._shape != shape:
                node, m = self._tree.walk(qb)
            if node.start < m < node.end:
                node = self._tree.split(node, m)
            old = node.seq                  # a leaf extended: its sequence is covered now
            if old is not None:
                node.seq = None
                if self._lent.get(old) is node:
                    del self._lent[old]     # a lender's: it keeps its sequence
                    old = None
                else:
                    del self._owned[old]
            leaf = PrefixNode(qb[4 * m:], m, node, self._clock, priority)
            leaf.seq = new
            self._tree.add(leaf)
            (self._lent if mode == "lend" else self._owned)[new] = leaf
            self._tree.touch(leaf, self._clock, priority)
            if old is not None:
                self.cache.seq_rm(old)
            self._stats["stored_tokens"] += n - m
            if self._op.on_event is not None:
                self._op.events.append(PrefixEvent("stored", arr.copy(), n - m))
            return n - m

    def _release(self, s: int) -> None:
        """Removes caller sequence s (given away with nothing to store), keeping a leaf it
        lends with s itself first."""
        if s in self._lent and self._reclaim_locked(s, adopt=True):
            return
        self.cache.seq_rm(s)

    def _take_id(self, qb: bytes, n: int, node: PrefixNode, m: int, s: int,
                 mode: str = "insert", checked: PrefixNode | None = None) -> int | None:
        """A clone of caller sequence s (``upto=n``), evicting leaves off the cached path for
        an id where the tree's budget or the cache's ids run out; None when none is had.
        ``mode`` "give" or "lend": s itself once the tree's budget has room for it (no new
        id; a lent leaf counts in the budget: the id it needs if its lender leaves early)."""
        covers = node.seq is not None and m == node.end   # (its leaf's id goes: no new one)
        if not covers and len(self._owned) + len(self._lent) >= self.max_seqs:
            path = node.line()
            self._evict_locked(0, 1, path)
            node, m = self._tree.walk(qb)
            covers = node.seq is not None and m == node.end
            if not covers and len(self._owned) + len(self._lent) >= self.max_seqs:
                return None
        if covers and node is not checked and not self._intact(node):
            self._invalidate_locked()
        if mode != "insert":
            return s
        new = self.cache.seq_clone(s, n)
        if new is None:
            self._evict_locked(0, 1, node.line())
            new = self.cache.seq_clone(s, n)
        return new

    # -- eviction ----------------------------------------------------------------------------
    def evict(self, n_cells: int = 0, *, n_ids: int = 0) -> int:
        """Evicts unpinned leaves (and the unpinned tails of leaves pinned above their end),
        the policy's smallest key first, until at least
        ``n_cells`` cells have been freed and ``n_ids`` sequence ids released, or no leaf is
        left to evict. Returns the cells freed.

        Only the prefix cache's owner bits are dropped: cells a caller's sequence also owns
        stay (and count as not freed). A leaf whose parent is left childless hands its
        sequence to the parent (``rewind`` to the parent's end), so it frees cells but no
        id; ids come back as leaves under a branching node (or the root) go.
        """
        n_cells = check_int(n_cells, "n_cells", 0, None)
        n_ids = check_int(n_ids, "n_ids", 0, None)
        with self._op:
            self._fresh()
            freed = self._evict_locked(n_cells, n_ids, ())
            return freed

    def evictable_tokens(self, limit: int | None = None) -> int:
        """Tokens in subtrees that hold no pin, and below the deepest pin of a pinned node
        whose subtree holds no other: what :meth:`evict` can take now, and so about
        the cells it can free (a leaf holding its own copy of a prefix frees more; cells that
        a caller's sequence shares without a pin are counted but stay). Counting stops once
        ``limit`` is reached. O(nodes), nothing changes: an admission policy asks it only
        when free cells run short. A lent leaf (see :meth:`lend`) counts as pinned."""
        lim = None if limit is None else check_int(limit, "limit", 0, None)
        with self._op.lock:
            if not (self._tree.pins or self._lent) or lim is not None and lim <= 0:
                cached = self._tree.tokens
                return cached if lim is None else min(cached, lim)
            if lim is not None:
                # the owned leaves alone count as the whole walk counts them (a leaf is never
                # blocked by a child): an admission short of a few cells stops after a few
                # leaves instead of listing every node (144 us at 1,000 leaves)
                some = 0
                for leaf in self._owned.values():
                    some += leaf.end - max(leaf.pins) if leaf.pins else leaf.n_tokens
                    if some >= lim:
                        return lim
            return self._tree.evictable_tokens(self._lent, lim)

    def storable(self, tokens: Any) -> bool:
        """Whether :meth:`give` (or :meth:`insert`) of ``tokens`` now would store them:
        they are cached whole already, their new leaf extends a leaf (no new id), the tree's
        ``max_seqs`` has an id left, or the eviction those make for one (leaves off the
        path of ``tokens``, pins kept) would release one. False: the store would be skipped
        (its eviction of tails that release no id done all the same). O(leaves), nothing
        changes: what a caller that places ``tokens`` for the tree first asks
        (:func:`cellcache.generate.load_prefix`). Evictions meanwhile, which release ids
        or make leaves of nodes, never turn True into False."""
        arr, qb = self._query(tokens, None)
        with self._op.lock:
            node, m = self._tree.walk(qb)
            if m == len(arr) or (node.seq is not None and m == node.end) \
                    or len(self._owned) + len(self._lent) < self.max_seqs:
                return True
            protect = node.line()
            root = self._tree.root
            for leaf in self._owned.values():
                if leaf.pins or not evictable(leaf, protect):
                    continue                # (pinned above its end: the part left adopts it)
                x = leaf
                while True:                 # up the nodes its sequence passes to as each goes
                    parent = x.parent
                    assert parent is not None
                    if parent is root or len(parent.children) > 1:
                        return True         # cut under a branch (or the root): its id is released
                    if parent is node and m == node.end:
                        return True         # node adopts the sequence: the new leaf extends it
                    if parent in protect or parent.pins:
                        break               # the parent keeps the sequence: no id
                    x = parent
            return False

    def _evict_locked(self, n_cells: int, n_ids: int, protect: Any) -> int:
        if n_cells <= 0 and n_ids <= 0:
            return 0
        cache = self.cache
        owned = self._owned.values()
        # (no pin anywhere and nothing protected: every owned leaf is evictable, unfiltered)
        # (evictable() inlined: a call a leaf was most of the cost with pins held)
        leaves = list(owned) if not protect and not self._tree.pins else \
            [leaf for leaf in owned
             if (not leaf.pins or max(leaf.pins) < leaf.end) and leaf not in protect]
        order = EvictionOrder(self._key, leaves, self._op.fail)
        freed = ids = 0
        tree = self._tree
        root = tree.root
        adopted_here: set[int] = set()      # parents that took a leaf's sequence in this call
        while order and (freed < n_cells or ids < n_ids):
            leaf = order.pop()
            seq = leaf.seq
            assert seq is not None
            if cache.pos(seq) != leaf.end:
                self._invalidate_locked()
                break
            if leaf.pins:                   # pinned above its end: the tail below goes alone
                tree.split(leaf, max(leaf.pins))
            # (a parent adopted in this call holds a prefix of what its leaf handed the hook)
            if self.before_evict is not None and id(leaf) not in adopted_here:
                try:
                    self.before_evict(seq, leaf.end, leaf.path())
                except Exception:  # noqa: BLE001 - a host copy failing loses only that copy
                    pass
            if self._op.on_event is not None:
                self._op.events.append(PrefixEvent("evicted", leaf.path(), leaf.n_tokens))
            before = cache.free_cells
            parent = leaf.parent
            assert parent is not None
            tree.cut(leaf)
            del self._owned[seq]
            self._shape += 1
            leaf.seq = None
            adopted = parent is not root and not parent.children
            if adopted:                     # the parent becomes a leaf and takes the sequence
                ok = cache.rewind(seq, parent.end)
                assert ok
                parent.seq = seq
                self._owned[seq] = parent
                adopted_here.add(id(parent))
            else:
                cache.seq_rm(seq)
                ids += 1
            got = cache.free_cells - before
            freed += got
            st = self._stats
            st["evictions"] += 1
            st["evicted_tokens"] += leaf.n_tokens
            st["evicted_cells"] += got
            if adopted and evictable(parent, protect):
                order.push(parent)          # (the tree is whole here: a failing key may raise)
        return freed

    # -- whole tree --------------------------------------------------------------------------
    def validate(self) -> bool:
        """Checks that every owned sequence is live and as long as its leaf; if one is not
        (``cache.clear()`` ran underneath), forgets the tree as :meth:`invalidate` does and
        returns False."""
        with self._op:
            ok = self._valid()
            if not ok:
                self._invalidate_locked()
            return ok

    def _valid(self) -> bool:
        if not (self._owned or self._lent):
            return True
        if self._clears != self._cache_clears():
            return False
        live = set(self.cache.live_seqs())
        pos = self.cache.pos
        return (all(s in live and pos(s) == leaf.end for s, leaf in self._owned.items())
                and all(s in live and pos(s) >= leaf.end for s, leaf in self._lent.items()))

    def clear(self) -> int:
        """Drops every cached prefix and pin, releasing the owned sequences (lent ones stay
        their callers'); returns the cells freed (cells a caller's sequence also owns
        stay). If the cache was cleared
        underneath, forgets the tree instead (see :meth:`invalidate`) and returns 0."""
        with self._op:
            if not self._valid():
                self._invalidate_locked()
                return 0
            before = self.cache.free_cells
            for s in self._owned:
                self.cache.seq_rm(s)
            freed = self.cache.free_cells - before
            if self._op.on_event is not None and self._tree.tokens:
                self._op.events.append(PrefixEvent("cleared", np.zeros(0, _I32), self._tree.tokens))
            self._reset()
            return freed

    def invalidate(self) -> None:
        """Forgets the whole tree without touching the cache: call it after
        ``cache.clear()``, which released the sequences the prefix cache owned."""
        with self._op:
            self._invalidate_locked()

    def _invalidate_locked(self) -> None:
        if self._owned or self._lent:
            self._stats["invalidations"] += 1
            if self._op.on_event is not None:
                self._op.events.append(PrefixEvent("invalidated", np.zeros(0, _I32), self._tree.tokens))
        self._reset()

    # -- queries -----------------------------------------------------------------------------
    def owns(self, seq: Any) -> bool:
        """Whether ``seq`` is one of the sequence ids the prefix cache owns (a leaf's)."""
        with self._op.lock:
            return seq in self._owned

    def owned_seqs(self) -> list[int]:
        """The sequence ids the prefix cache owns, ascending (one per leaf)."""
        with self._op.lock:
            return sorted(self._owned)

    def prefixes(self) -> list[tuple[tuple[int, ...], int]]:
        """Every leaf's path and the sequence that holds it (owned or lent), as ``(tokens,
        seq)``, sorted by tokens. Every prefix of a path is cached. O(cached tokens): for
        tests and tools."""
        with self._op.lock:
            leaves = [*self._owned.items(), *self._lent.items()]
            return sorted((tuple(leaf.path().tolist()), s) for s, leaf in leaves)

    def metrics(self) -> dict:
        """Counters: ``cached_tokens`` (tokens in the tree), ``nodes``, ``leaves`` (owned
        and lent), ``lent`` (leaves a caller's sequence lends), ``pins``, ``max_seqs``; since
        construction: ``matches``, ``hits``
        (matches that cloned), ``hit_tokens``, ``no_id`` (hits lost for want of an id),
        ``inserts``, ``stored_tokens``, ``insert_skipped``, ``evictions`` (leaves),
        ``evicted_tokens``, ``evicted_cells`` (cells freed by eviction), ``invalidations``,
        ``reclaims`` (lends ended by :meth:`reclaim`, or by a lender's ``give`` or ``lend``
        that did not run on from its leaf), ``dropped`` (nodes those removed for want of an
        id; evictions and evicted tokens count them too)."""
        with self._op.lock:
            return {"cached_tokens": self._tree.tokens, "nodes": self._tree.nodes,
                    "leaves": len(self._owned) + len(self._lent), "lent": len(self._lent),
                    "pins": self._tree.pins, "max_seqs": self.max_seqs,
                    **self._stats}

    def check_invariants(self) -> None:
        """Asserts the tree's structure, that every owned sequence holds its leaf's length
        and every lent one at least that (tests call it after every operation)."""
        with self._op.lock:
            seen = self._tree.check_leaves()
            assert not self._owned.keys() & self._lent.keys()
            assert seen == {**self._owned, **self._lent}, (seen, self._owned, self._lent)
            assert len(self._owned) + len(self._lent) <= self.max_seqs
            live = set(self.cache.live_seqs())
            for s, leaf in self._owned.items():
                assert s in live and self.cache.pos(s) == leaf.end, (s, leaf)
            for s, leaf in self._lent.items():
                assert s in live and self.cache.pos(s) >= leaf.end, (s, leaf)

    def __repr__(self) -> str:
        return (f"PrefixCache(cached_tokens={self._tree.tokens}, nodes={self._tree.nodes}, "
                f"leaves={len(self._owned) + len(self._lent)}, lent={len(self._lent)}, "
                f"policy={self.policy!r})")
