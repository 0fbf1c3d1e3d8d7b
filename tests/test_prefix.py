"""PrefixCache on the host backend: each operation, the drawn walk of the module docstring,
refusals (nothing changes), and a hypothesis state machine of the tree against a plain
reference (the set of maximal cached token tuples), with running caller sequences that
fork, rewind and go away while the tree holds their prefixes.

The cache stores no token ids, so the tests keep the truth: ``World.cell_token[c]`` is the
token a step wrote into cell c. "A sequence holds tokens" means: for every position q, the
cell at q (the table's position map) has ``pos == q`` and was written with ``tokens[q]``.
"""

from __future__ import annotations

import os

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cellcache import (
    CacheConfig,
    CellCacheError,
    InvalidArgument,
    InvalidState,
    LayerConfig,
    PrefixCache,
    build,
)
from cellcache.prefix import PrefixEvent, PrefixNode, prefix_key

EXAMPLES = max(20, int(os.environ.get("CELLCACHE_MACHINE_EXAMPLES", "1000")) // 5)


def make_cache(capacity=256, max_seqs=16, max_write=16):
    return build("host", "batched", CacheConfig(
        capacity=capacity, layers=[LayerConfig(1, 2)], max_write=max_write, max_seqs=max_seqs,
        dtype="float32", mask_format="none", initial_capacity=capacity))


class World:
    """The caller's side: sequences it owns, their tokens, and which token each cell holds."""

    def __init__(self, cache):
        self.cache = cache
        self.cell_token: dict[int, int] = {}
        self.tokens: dict[int, list[int]] = {}   # caller sequence -> its tokens

    def write(self, seq: int, toks, evict_with=None) -> int:
        """Writes toks after seq's tokens in steps of max_write; where cells run short asks
        ``evict_with`` (a PrefixCache) first. Returns how many tokens were written."""
        toks = list(toks)
        done = 0
        mw = self.cache.config.max_write
        while done < len(toks):
            k = min(mw, len(toks) - done)
            if not self.cache.declare_step([seq] * k):
                if evict_with is not None:
                    evict_with.evict(k - self.cache.free_cells)
                if not self.cache.declare_step([seq] * k):
                    break
            step = self.cache.prepare_step()
            self.cache.commit_step()
            start = int(step.positions[0])
            assert start == len(self.tokens.get(seq, ()))      # positions continue seq
            for c, q in zip(step.cells.tolist(), step.positions.tolist()):
                self.cell_token[c] = toks[done + q - start]
            self.tokens.setdefault(seq, []).extend(toks[done:done + k])
            done += k
        return done

    def adopt(self, seq: int, toks) -> None:
        """seq (from PrefixCache.match) holds toks already."""
        self.tokens[seq] = list(toks)

    def new(self, toks, evict_with=None) -> int | None:
        s = self.cache.seq_new()
        if s is None:
            return None
        self.tokens[s] = []
        self.write(s, toks, evict_with)
        return s

    def holds(self, seq: int, toks) -> None:
        """seq's positions [0, len(toks)) are cells written with toks, at those positions."""
        table = self.cache.table
        cell_pos = table.positions_array()
        for q, tok in enumerate(toks):
            c = table.seq_cell_at(seq, q)
            assert c >= 0, (seq, q)
            assert cell_pos[c] == q, (seq, q, c, cell_pos[c])
            assert self.cell_token[c] == tok, (seq, q, c, self.cell_token[c], tok)

    def snapshot(self) -> dict:
        """Every caller sequence's length and cells in position order."""
        table = self.cache.table
        return {s: (self.cache.pos(s), [table.seq_cell_at(s, q) for q in range(self.cache.pos(s))])
                for s in self.tokens}


def state(prefix: PrefixCache) -> tuple:
    """The whole observable state of a prefix cache and its cache."""
    return (prefix.prefixes(), prefix.metrics(), prefix.cache.table.snapshot(),
            prefix.cache.live_seqs())


def assert_same(a, b) -> None:
    pa, ma, ta, la = a
    pb, mb, tb, lb = b
    assert pa == pb and ma == mb and la == lb
    assert ta.keys() == tb.keys()
    for k in ta:
        va, vb = ta[k], tb[k]
        if isinstance(va, np.ndarray):
            np.testing.assert_array_equal(va, vb)
        else:
            assert va == vb, k


def setup(tree_seqs=None, **kw):
    cache = make_cache(**kw)
    events: list[PrefixEvent] = []
    prefix = PrefixCache(cache, max_seqs=tree_seqs, on_event=events.append)
    return cache, prefix, World(cache), events


# -- operations ------------------------------------------------------------------------------

def test_insert_then_match_clones_the_longest_prefix():
    cache, prefix, w, events = setup()
    toks = list(range(100, 110))
    a = w.new(toks)
    assert prefix.insert(a, toks) == 10
    assert len(prefix.owned_seqs()) == 1 and a not in prefix.owned_seqs()
    [(path, s)] = prefix.prefixes()
    assert path == tuple(toks) and cache.pos(s) == 10
    w.holds(s, toks)
    # a longer prompt: the 10 cached tokens come by clone, the caller feeds the rest
    t, n = prefix.match(toks + [1, 2])
    assert n == 10 and cache.pos(t) == 10 and t not in prefix.owned_seqs()
    w.holds(t, toks)
    # the whole prompt cached: max_len keeps one token to feed
    t2, n2 = prefix.match(toks, max_len=len(toks) - 1)
    assert n2 == 9 and cache.pos(t2) == 9
    assert prefix.match(toks)[1] == 10
    assert prefix.match([7, 8, 9]) == (None, 0)
    assert prefix.match([]) == (None, 0)
    assert prefix.match(toks, max_len=0) == (None, 0)
    assert prefix.peek(toks + [5]) == 10 and prefix.peek(toks[:4] + [0]) == 4
    m = prefix.metrics()
    assert m["cached_tokens"] == 10 and m["nodes"] == 1 and m["leaves"] == 1
    assert m["hit_tokens"] == 10 + 9 + 10 and m["hits"] == 3 and m["matches"] == 6
    assert [(e.kind, e.length, e.n) for e in events] == [("stored", 10, 10)]
    prefix.check_invariants()
    cache.check_invariants()


def test_a_hit_ends_at_any_token():
    cache, prefix, w, _ = setup()
    toks = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    a = w.new(toks)
    prefix.insert(a, toks)
    cells = [cache.table.seq_cell_at(a, q) for q in range(10)]
    for k in range(1, 11):
        t, n = prefix.match(toks[:k] + [99])
        assert n == k and cache.pos(t) == k
        # the hit is owner bits on the same cells: nothing was copied
        assert [cache.table.seq_cell_at(t, q) for q in range(k)] == cells[:k]
        cache.seq_rm(t)
    assert cache.free_cells == cache.capacity - 10


def test_inputs_of_every_integer_kind_agree():
    cache, prefix, w, _ = setup()
    toks = [5, 6, 7, 8]
    prefix.insert(w.new(toks), np.array(toks, dtype=np.uint16))
    for q in (toks, tuple(toks), range(5, 9), np.array(toks, np.int64), np.array(toks, np.int32),
              np.array([5, 0, 6, 0, 7, 0, 8], np.int32)[::2], np.array(toks, ">i4")):
        assert prefix.peek(q) == 4
        t, n = prefix.match(q)
        assert n == 4
        cache.seq_rm(t)
    assert prefix.peek([5, 6, -7]) == 2 and prefix.peek([-(2**31), 2**31 - 1]) == 0


def test_the_drawn_tree():
    """The picture of cellcache/prefix.py, asserted node by node."""
    cache, prefix, w, events = setup()
    a, b, c, d, e, f, g, h, x, y, z, q = range(1, 13)
    s1 = w.new([a, b, c, d, e, f, g, h])
    prefix.insert(s1, [a, b, c, d, e, f, g, h])
    t, n = prefix.match([a, b, c, d, x, y], max_len=5)     # a b c d from the tree
    assert n == 4
    w.adopt(t, [a, b, c, d])
    w.write(t, [x, y])
    prefix.insert(t, [a, b, c, d, x, y])
    u, n = prefix.match([a, b, z])
    assert n == 2
    w.adopt(u, [a, b])
    w.write(u, [z])
    prefix.insert(u, [a, b, z])
    for s in (s1, t, u):
        cache.seq_rm(s)
    (p1, o1), (p2, o2), (p3, o3) = prefix.prefixes()
    assert (p1, p2, p3) == ((a, b, c, d, e, f, g, h), (a, b, c, d, x, y), (a, b, z))
    assert (cache.pos(o1), cache.pos(o2), cache.pos(o3)) == (8, 6, 3)
    # root - [a b] - {[c d] - {[e f g h], [x y]}, [z]}: 5 nodes, 3 leaves
    m = prefix.metrics()
    assert (m["nodes"], m["leaves"], m["cached_tokens"]) == (5, 3, 8 + 2 + 1)
    # the three sequences share the cells of a b (and o1, o2 those of c d): 11 cells in all
    assert cache.free_cells == cache.capacity - 11
    k, n = prefix.match([a, b, c, d, x, q])
    assert n == 5 and cache.table.seq_cell_at(k, 4) == cache.table.seq_cell_at(o2, 4)
    cache.seq_rm(k)
    # LRU: [e f g h] is the least recent (only the first match went through it), then [z]
    events.clear()
    assert prefix.evict(1) == 4                          # [c d] keeps its child [x y]
    assert prefix.owned_seqs() == sorted([o2, o3]) and o1 not in cache.live_seqs()
    assert prefix.evict(1) == 1                          # [a b] keeps its child [c d]
    assert prefix.owned_seqs() == [o2] and o3 not in cache.live_seqs()
    assert [(e.kind, e.tokens.tolist(), e.n) for e in events] == [
        ("evicted", [a, b, c, d, e, f, g, h], 4), ("evicted", [a, b, z], 1)]
    # [x y] goes: [c d] is left childless and adopts o2, rewound to 4: no id released
    assert prefix.evict(1) == 2
    assert prefix.owned_seqs() == [o2] and cache.pos(o2) == 4
    assert prefix.prefixes() == [((a, b, c, d), o2)]
    w.holds(o2, [a, b, c, d])
    assert prefix.evict(100) == 4                        # [c d], then [a b]: the tree is empty
    assert prefix.prefixes() == [] and cache.free_cells == cache.capacity
    assert prefix.metrics()["nodes"] == 0 and prefix.metrics()["evicted_tokens"] == 11
    prefix.check_invariants()


def test_extending_a_leaf_moves_its_id():
    cache, prefix, w, _ = setup()
    s = w.new([1, 2, 3])
    prefix.insert(s, [1, 2, 3])
    [old] = prefix.owned_seqs()
    w.write(s, [4, 5])
    assert prefix.insert(s, [1, 2, 3, 4, 5]) == 2
    [new] = prefix.owned_seqs()
    assert old not in cache.live_seqs() and cache.pos(new) == 5
    # two nodes, [1 2 3] internal with child [4 5]: still one id
    assert prefix.metrics()["nodes"] == 2 and prefix.metrics()["leaves"] == 1
    assert prefix.insert(s, [1, 2]) == 0 and prefix.insert(s, [1, 2, 3, 4, 5]) == 0
    cache.seq_rm(s)
    assert cache.free_cells == cache.capacity - 5
    prefix.check_invariants()


def test_give_hands_the_sequence_to_the_tree_without_changing_a_stored_cell():
    cache, prefix, w, events = setup()
    s = w.new([1, 2, 3, 4, 5])
    cells = [cache.table.seq_cell_at(s, q) for q in range(5)]

    def owners(cs):
        snap = cache.table.snapshot()["owners"]
        return [sorted(snap[c]) for c in cs]

    assert prefix.give(s, [1, 2, 3]) == 3
    assert prefix.owned_seqs() == [s] and cache.pos(s) == 3          # rewound, not cloned
    assert owners(cells) == [[s], [s], [s], [], []]                 # only the rewound cells changed
    assert [e.kind for e in events] == ["stored"]
    w.holds(s, [1, 2, 3])
    # the same store through insert + seq_rm: every stored cell changes owner
    b = w.new([7, 8])
    b_cells = [cache.table.seq_cell_at(b, q) for q in range(2)]
    assert prefix.insert(b, [7, 8]) == 2
    cache.seq_rm(b)
    [leaf] = [t for p, t in prefix.prefixes() if p == (7, 8)]
    assert leaf != b and owners(b_cells) == [[leaf], [leaf]]
    prefix.check_invariants()


def test_give_extends_a_leaf_and_takes_over_from_its_id():
    cache, prefix, w, _ = setup()
    s = w.new([1, 2, 3])
    assert prefix.insert(s, [1, 2, 3]) == 3
    [old] = prefix.owned_seqs()
    w.write(s, [4, 5])
    assert prefix.give(s, [1, 2, 3, 4, 5]) == 2
    assert prefix.owned_seqs() == [s] and old not in cache.live_seqs()
    assert prefix.metrics()["leaves"] == 1 and cache.free_cells == cache.capacity - 5
    prefix.check_invariants()


def test_give_removes_the_sequence_when_nothing_is_stored():
    cache, prefix, w, _ = setup(tree_seqs=1)
    a = w.new([1, 2, 3])
    assert prefix.insert(a, [1, 2, 3]) == 3
    cache.seq_rm(a)
    b = w.new([1, 2, 3])                      # the same tokens, computed again: all cached
    assert prefix.give(b, [1, 2, 3]) == 0
    assert b not in cache.live_seqs() and prefix.metrics()["leaves"] == 1
    c = w.new([7, 8])                         # the tree's one id is pinned: no room
    prefix.pin([1, 2, 3])
    skipped = prefix.metrics()["insert_skipped"]
    assert prefix.give(c, [7, 8]) == 0
    assert c not in cache.live_seqs() and prefix.metrics()["insert_skipped"] == skipped + 1
    d = w.new([5])
    assert prefix.give(d, []) == 0 and d not in cache.live_seqs()
    assert cache.free_cells == cache.capacity - 3
    prefix.check_invariants()


def test_give_ends_the_sequences_pending_step_as_seq_rm_would():
    """A step declared for the given sequence, or its placement not yet committed, must not
    reach the tree's leaf: give drops them as insert + seq_rm did (InvalidState after)."""
    cache, prefix, w, _ = setup()
    s = w.new([1, 2, 3])
    assert cache.declare_step([s])
    assert prefix.give(s, [1, 2, 3]) == 3
    with pytest.raises(InvalidState):
        cache.prepare_step()
    t = cache.seq_new()
    assert cache.declare_step([t] * 2)
    cache.prepare_step()
    assert prefix.give(t, [4, 5]) == 2
    with pytest.raises(InvalidState):
        cache.unprepare_step()
    assert cache.pos(s) == 3 and cache.pos(t) == 2
    assert prefix.owns(s) and prefix.owns(t) and not prefix.owns(99) and not prefix.owns("x")
    prefix.check_invariants()


def test_give_after_a_cache_clear_underneath_forgets_the_old_tree_first():
    cache, prefix, w, events = setup()
    a = w.new([1, 2, 3])
    prefix.insert(a, [1, 2, 3])
    cache.seq_rm(a)
    cache.clear()                             # without invalidate()
    w = World(cache)
    s = w.new([9, 9, 9, 9])
    assert prefix.give(s, [9, 9, 9, 9]) == 4
    assert prefix.metrics()["invalidations"] == 1 and "invalidated" in [e.kind for e in events]
    assert prefix.owned_seqs() == [s] == cache.live_seqs()        # nothing left behind
    assert prefix.validate() is True
    prefix.check_invariants()


def test_an_independent_copy_of_a_cached_prompt_is_not_stored_twice():
    cache, prefix, w, _ = setup()
    a, b = w.new([1, 2, 3, 4]), w.new([1, 2, 3, 4])      # same prompt, computed twice
    assert prefix.insert(a, [1, 2, 3, 4]) == 4
    assert prefix.insert(b, [1, 2, 3, 4]) == 0
    assert prefix.metrics()["leaves"] == 1
    # a branch from b's own cells: the new leaf's sequence holds b's copy of 1 2
    w.write(b, [9])
    b2 = cache.seq_clone(b, 2)
    w.tokens[b2] = [1, 2]
    w.write(b2, [7])
    assert prefix.insert(b2, [1, 2, 7]) == 1
    for path, s in prefix.prefixes():
        w.holds(s, path)
    prefix.check_invariants()


def test_eviction_never_takes_a_running_sequences_cell():
    cache, prefix, w, _ = setup()
    run = w.new(list(range(20)))                           # a running request
    prefix.insert(run, list(range(12)))
    other = w.new([50, 51, 52])
    prefix.insert(other, [50, 51, 52])
    cache.seq_rm(other)                                   # only the tree holds 50 51 52
    before = w.snapshot()
    free = cache.free_cells
    freed = prefix.evict(1000)
    assert freed == 3 == cache.free_cells - free          # the 12 shared cells stay
    assert w.snapshot() == before
    w.holds(run, list(range(20)))
    assert prefix.prefixes() == [] and prefix.metrics()["evicted_cells"] == 3


def test_evict_stops_once_enough_is_free():
    cache, prefix, w, _ = setup()
    for i in range(4):
        s = w.new([i] * 5)
        prefix.insert(s, [i] * 5)
        cache.seq_rm(s)
    assert prefix.evict(0) == 0 and prefix.metrics()["leaves"] == 4
    assert prefix.evict(6) == 10                           # two whole leaves
    assert [p for p, _ in prefix.prefixes()] == [(2,) * 5, (3,) * 5]
    assert prefix.evict(n_ids=1) == 5 and prefix.metrics()["leaves"] == 1


@pytest.mark.parametrize("policy, want", [
    ("lru", (1,) * 3), ("lfu", (0,) * 3), ("priority", (3,) * 4),
    (lambda node: -node.last_access, (2,) * 3),          # a custom key: most recent first
])
def test_policies(policy, want):
    cache = make_cache()
    prefix = PrefixCache(cache, policy)
    w = World(cache)
    for i, prio in zip(range(4), (5, 5, 5, 0)):
        s = w.new([i] * (3 + (i == 3)))
        prefix.insert(s, [i] * (3 + (i == 3)), priority=prio)
        cache.seq_rm(s)
    # last use: 1 < 0 < 3 < 2; uses (insert + matches): 0: 2, 1: 4, 2: 3, 3: 2
    for i in (1, 1, 1, 0, 2, 3, 2):
        cache.seq_rm(prefix.match([i] * 3)[0])
    assert prefix.evict(1) == len(want)
    assert want not in [p for p, _ in prefix.prefixes()]
    assert len(prefix.prefixes()) == 3


def test_pins_keep_a_prefix_until_unpinned():
    cache, prefix, w, _ = setup()
    toks = list(range(1, 9))
    prefix.insert(w.new(toks), toks)
    t, n = prefix.match(toks[:6] + [0], pin=True)
    assert n == 6 and prefix.metrics()["pins"] == 1
    assert prefix.pin(toks) == 8
    # a branch at 4 splits the pinned node: the pin at 6 stays with the lower part
    u, _ = prefix.match(toks[:4] + [77])
    w.adopt(u, toks[:4])
    w.write(u, [77])
    prefix.insert(u, toks[:4] + [77])
    prefix.check_invariants()
    prefix.evict(1000)
    assert [p for p, _ in prefix.prefixes()] == [tuple(toks)]
    prefix.unpin(toks, 8)
    prefix.evict(1000)
    assert [p for p, _ in prefix.prefixes()] == [tuple(toks[:6])]   # pinned at 6: its tail went
    before = state(prefix)
    with pytest.raises(InvalidState):
        prefix.unpin(toks, 8)
    with pytest.raises(InvalidState):
        prefix.unpin(toks, 5)
    assert_same(state(prefix), before)
    prefix.unpin(toks[:6] + [0], 6)
    prefix.evict(1000)
    assert prefix.prefixes() == [] and prefix.metrics()["pins"] == 0
    prefix.check_invariants()


def test_eviction_takes_the_tail_of_a_leaf_pinned_above_its_end():
    """A request holding a short hit into a long cached path pins only that hit: the rest of
    the leaf is evictable (its cells freed, the hit kept, an "evicted" event for the tail);
    a leaf pinned at its end keeps everything."""
    cache, prefix, w, events = setup()
    toks = list(range(1, 21))
    prefix.insert(w.new(toks), toks)
    for s in list(w.tokens):
        cache.seq_rm(s)
    free = cache.free_cells
    t, n = prefix.match(toks[:5] + [0], pin=True)          # the caller holds 5 of the 20
    assert n == 5
    assert prefix.evictable_tokens() == 15 and prefix.evictable_tokens(4) == 4
    events.clear()
    assert prefix.evict(1) == 15                           # the whole tail: one leaf
    assert cache.free_cells == free + 15
    assert [p for p, _ in prefix.prefixes()] == [tuple(toks[:5])]
    assert [(e.kind, e.length, e.n) for e in events] == [("evicted", 20, 15)]
    prefix.check_invariants()
    assert prefix.evict(1000) == 0 and prefix.evictable_tokens() == 0   # the hit stays pinned
    cache.seq_rm(t)
    prefix.unpin(toks, 5)
    assert prefix.evictable_tokens() == 5
    # pinned at its end: nothing to take
    u = w.new(toks[:8])
    prefix.insert(u, toks[:8])
    cache.seq_rm(u)
    assert prefix.pin(toks[:8]) == 8
    before = state(prefix)
    assert prefix.evict(1000) == 0
    assert_same(state(prefix), before)
    prefix.check_invariants()


def test_a_pin_at_a_split_point_stays_with_the_upper_part():
    cache, prefix, w, _ = setup()
    toks = [1, 2, 3, 4, 5, 6]
    prefix.insert(w.new(toks), toks)
    assert prefix.pin(toks[:4]) == 4
    u, n = prefix.match(toks[:4] + [9])
    w.adopt(u, toks[:4])
    w.write(u, [9])
    prefix.insert(u, toks[:4] + [9])                       # splits at 4, the pin's depth
    prefix.check_invariants()
    for s in list(w.tokens):
        cache.seq_rm(s)
    prefix.evict(1000)                                    # both leaves go, [1 2 3 4] stays
    assert prefix.prefixes()[0][0] == (1, 2, 3, 4) and len(prefix.prefixes()) == 1
    prefix.unpin(toks, 4)
    prefix.evict(1000)
    assert prefix.prefixes() == []


def test_the_tree_keeps_to_its_id_budget():
    cache, prefix, w, _ = setup(tree_seqs=2)
    for i in range(3):
        s = w.new([i] * 4)
        assert prefix.insert(s, [i] * 4) == 4
        cache.seq_rm(s)
        assert prefix.metrics()["leaves"] <= 2
    assert [p for p, _ in prefix.prefixes()] == [(1,) * 4, (2,) * 4]
    # extending a leaf needs no more ids
    s = w.new([2] * 4 + [5])
    assert prefix.insert(s, [2] * 4 + [5]) == 1
    # every leaf pinned: a new prompt is not stored
    prefix.pin([1] * 4)
    prefix.pin([2] * 5)
    t = w.new([8, 8])
    assert prefix.insert(t, [8, 8]) == 0
    assert prefix.metrics()["insert_skipped"] == 1 and prefix.peek([8, 8]) == 0
    prefix.check_invariants()


def test_the_budget_spares_the_path_being_extended():
    cache, prefix, w, _ = setup(tree_seqs=2)
    for i in (1, 2):
        s = w.new([i] * 4)
        prefix.insert(s, [i] * 4)
    # a branch inside the least recent leaf needs an id: the other leaf gives it up
    s = w.new([1, 1, 9])
    assert prefix.insert(s, [1, 1, 9]) == 1
    assert [p for p, _ in prefix.prefixes()] == [(1, 1, 1, 1), (1, 1, 9)]
    prefix.check_invariants()


def test_a_path_keeps_the_highest_priority_given():
    cache = make_cache()
    prefix = PrefixCache(cache, "priority")
    w = World(cache)
    s = w.new([1, 1, 2, 2])
    prefix.insert(s, [1, 1], priority=5)
    prefix.insert(s, [1, 1, 2, 2], priority=0)            # [1 1] keeps 5
    t = w.new([7])
    prefix.insert(t, [7], priority=3)
    cache.seq_rm(s)
    cache.seq_rm(t)
    assert prefix.evict(1) == 2                           # [2 2] (0); [1 1] adopts its id
    assert prefix.evict(1) == 1                           # [7] (3) before [1 1] (5)
    assert [p for p, _ in prefix.prefixes()] == [(1, 1)]


def test_when_every_cache_id_is_live():
    cache, prefix, w, _ = setup(max_seqs=3, tree_seqs=2)
    a = w.new([1, 1])
    prefix.insert(a, [1, 1])                              # ids: a, tree
    b = w.new([2, 2])                                     # ids: a, b, tree: all live
    assert prefix.match([1, 1, 1]) == (None, 0)
    assert prefix.metrics()["no_id"] == 1
    # insert needs an id: the tree gives up its leaf (not on b's path) to get one
    assert prefix.insert(b, [2, 2]) == 2
    assert [p for p, _ in prefix.prefixes()] == [(2, 2)]
    assert len(cache.live_seqs()) == 3
    prefix.check_invariants()


def test_insert_keeps_a_callers_declaration():
    cache, prefix, w, _ = setup()
    s = w.new([1, 2, 3])
    assert cache.declare_step([s, s])
    prefix.insert(s, [1, 2, 3])
    assert cache.table.declared == [s, s]
    cache.prepare_step()
    cache.commit_step()


def test_clear():
    cache, prefix, w, events = setup()
    run = w.new([1, 2, 3, 4])
    prefix.insert(run, [1, 2, 3, 4])
    s = w.new([5, 6])
    prefix.insert(s, [5, 6])
    cache.seq_rm(s)
    prefix.pin([1, 2])
    events.clear()
    assert prefix.clear() == 2                             # run keeps 1 2 3 4
    assert prefix.prefixes() == [] and prefix.owned_seqs() == []
    assert prefix.metrics()["pins"] == 0 and prefix.metrics()["cached_tokens"] == 0
    assert [(e.kind, e.n) for e in events] == [("cleared", 6)]
    assert cache.live_seqs() == [run]
    w.holds(run, [1, 2, 3, 4])
    assert prefix.clear() == 0
    prefix.check_invariants()


def test_a_cache_clear_underneath_is_detected_and_nothing_is_touched():
    cache, prefix, w, events = setup()
    toks = [4, 5, 6, 7]
    s = w.new(toks)
    prefix.insert(s, toks)
    [owned] = prefix.owned_seqs()
    cache.clear()
    w = World(cache)
    # the caller reuses the ids the tree owned, with other lengths
    mine = [w.new([9] * (i + 1)) for i in range(3)]
    assert owned in mine
    before = w.snapshot()
    assert prefix.match(toks) == (None, 0)
    assert prefix.prefixes() == [] and prefix.metrics()["invalidations"] == 1
    assert events[-1].kind == "invalidated" and events[-1].n == 4
    assert w.snapshot() == before and sorted(cache.live_seqs()) == sorted(mine)
    prefix.check_invariants()
    # the documented way: invalidate() right after cache.clear()
    prefix.insert(mine[2], [9, 9, 9])
    cache.clear()
    prefix.invalidate()
    assert prefix.prefixes() == [] and cache.live_seqs() == []
    # validate() finds it too
    s = World(cache).new([1])
    prefix.insert(s, [1])
    cache.clear()
    assert prefix.validate() is False and prefix.prefixes() == []
    assert prefix.validate() is True


def test_a_reused_id_with_the_same_length_is_caught_by_the_clone():
    cache, prefix, w, _ = setup()
    a = w.new([1, 1])
    prefix.insert(a, [1, 1])                               # the tree owns 1
    b = w.new([2, 2, 2])
    prefix.insert(b, [2, 2, 2])                            # the tree owns 3
    assert prefix.owned_seqs() == [1, 3]
    cache.clear()
    w = World(cache)
    mine = [w.new([9]), w.new([9, 9]), w.new([9])]        # 1 is as long as the tree's leaf
    before = w.snapshot()
    # the length check passes by coincidence; the clone then gets id 3, which the tree
    # thought it held: the tree is stale, the clone is dropped and the tree forgotten
    assert prefix.match([1, 1, 5]) == (None, 0)
    assert prefix.metrics()["invalidations"] == 1 and prefix.prefixes() == []
    assert w.snapshot() == before and sorted(cache.live_seqs()) == mine
    prefix.check_invariants()


def test_detected_by_evict_and_insert_too():
    for act in ("evict", "insert", "clear"):
        cache, prefix, w, _ = setup()
        s = w.new([1, 2])
        prefix.insert(s, [1, 2])
        cache.clear()
        w = World(cache)
        mine = w.new([3, 3, 3])
        before = w.snapshot()
        if act == "evict":
            assert prefix.evict(5) == 0
        elif act == "insert":
            w.write(mine, [3])
            before = w.snapshot()
            assert prefix.insert(mine, [3, 3, 3, 3]) == 4   # stored in a fresh tree
        else:
            assert prefix.clear() == 0
        assert w.snapshot() == before
        assert prefix.metrics()["invalidations"] == 1
        prefix.check_invariants()


def test_events_carry_keys_a_router_can_compute():
    cache, prefix, w, events = setup()
    prompt = [11, 12, 13, 14, 15]
    s = w.new(prompt)
    prefix.insert(s, prompt)
    [ev] = events
    assert ev.kind == "stored" and ev.length == 5 and ev.n == 5
    assert ev.key == prefix_key(prompt) == prefix_key(np.array(prompt, np.int64))
    assert ev.key != prefix_key(prompt[:4])
    t, n = prefix.match(prompt[:3] + [0])
    w.adopt(t, prompt[:3])
    w.write(t, [0])
    prefix.insert(t, prompt[:3] + [0])
    assert (events[-1].kind, events[-1].length, events[-1].n) == ("stored", 4, 1)


def test_a_failing_callback_propagates_after_the_operation():
    cache = make_cache()
    calls = []

    def boom(ev):
        calls.append(ev.kind)
        raise RuntimeError("router down")

    prefix = PrefixCache(cache, on_event=boom)
    w = World(cache)
    for i in range(2):
        s = w.new([i, i])
        with pytest.raises(RuntimeError, match="router down"):
            prefix.insert(s, [i, i])
        cache.seq_rm(s)
    assert prefix.metrics()["leaves"] == 2
    with pytest.raises(RuntimeError):
        prefix.evict(100)
    assert calls == ["stored", "stored", "evicted", "evicted"]   # both delivered
    assert prefix.prefixes() == [] and cache.free_cells == cache.capacity
    prefix.check_invariants()


def test_a_failing_policy_leaves_the_tree_whole():
    cache = make_cache()
    events = []

    def key(node):
        if node.end == 2:
            raise ZeroDivisionError("policy bug")
        return node.last_access

    prefix = PrefixCache(cache, key, on_event=events.append)
    w = World(cache)
    s = w.new([1, 2, 3, 4])
    prefix.insert(s, [1, 2])
    prefix.insert(s, [1, 2, 3, 4])                        # [1 2] - [3 4]: one sequence
    cache.seq_rm(s)
    events.clear()
    with pytest.raises(ZeroDivisionError):
        prefix.evict(3)                                   # [3 4] goes, then [1 2]'s key fails
    # the eviction went on by LRU ([1 2] too: 3 cells asked), then the policy's error
    assert [(e.kind, e.length) for e in events] == [("evicted", 4), ("evicted", 2)]
    assert prefix.prefixes() == [] and cache.free_cells == cache.capacity
    prefix.check_invariants()


@pytest.mark.parametrize("policy", [lambda node: object(), lambda node: None if node.seg[0] < 2 else 1,
                                    lambda node: 1 / 0], ids=["incomparable", "mixed", "raises"])
def test_a_failing_policy_evicts_by_lru_and_raises_once_the_operation_is_whole(policy):
    """A user's policy that raises or gives keys that do not compare: the operation frees
    what was asked (by LRU), then the error propagates; the next operation runs as usual."""
    cache = make_cache(capacity=64)
    prefix = PrefixCache(cache, policy, max_seqs=8)
    w = World(cache)
    for i in range(4):
        s = w.new([i] * 6)
        prefix.insert(s, [i] * 6)
        cache.seq_rm(s)
    free = cache.free_cells
    with pytest.raises((TypeError, ZeroDivisionError)):
        prefix.evict(12)
    assert cache.free_cells - free >= 12
    assert [p for p, _ in prefix.prefixes()] == [(2,) * 6, (3,) * 6]      # the oldest went
    prefix.check_invariants()
    assert prefix.match([3] * 6)[1] == 6


def test_lent_leaves_count_in_the_budget_and_are_never_evicted():
    cache, prefix, w, events = setup(tree_seqs=2)
    a, b = w.new([1, 2, 3]), w.new([4, 5])
    assert prefix.lend(a, [1, 2, 3]) == 3 and prefix.lend(b, [4, 5]) == 2
    assert prefix.lent_seqs() == [a, b] and prefix.owned_seqs() == []
    assert cache.live_seqs() == [a, b]                     # no clone
    assert prefix.evictable_tokens() == 0 and prefix.evict(100, n_ids=2) == 0
    c = w.new([7, 7])
    skipped = prefix.metrics()["insert_skipped"]
    assert prefix.insert(c, [7, 7]) == 0                   # the budget is the lenders'
    assert prefix.metrics()["insert_skipped"] == skipped + 1
    # the lender ends: its leaf extended, the sequence the tree's (no owner changes)
    assert prefix.give(a, [1, 2, 3]) == 0 and prefix.owned_seqs() == [a]
    w.write(b, [6])
    assert prefix.give(b, [4, 5, 6]) == 1 and prefix.owned_seqs() == [a, b]
    assert prefix.lent_seqs() == [] and prefix.metrics()["reclaims"] == 1
    prefix.check_invariants()


def _lenders():
    """A prefix cache whose callers lend prompts and ran on past them (the first two share
    their first token), a caller lending nothing, and one lending a prompt run on by 1."""
    cache, prefix, w, events = setup(tree_seqs=8, capacity=512, max_seqs=32)
    rows = []
    for prompt, more in [([1, 2, 3], [4, 5]), ([1, 7], [8, 9, 10]), ([6, 6, 6, 6], [2])]:
        s = w.new(prompt + more)
        assert prefix.lend(s, prompt) == len(prompt) - (prompt[0] == 1 and prompt[1] == 7)
        rows.append((s, prompt, more))
    lone = w.new([9, 9, 9])
    events.clear()
    return cache, prefix, w, events, rows, lone


def test_giving_lenders_together_is_giving_them_one_by_one():
    """``give_lent`` (what the generator calls for the rows a step ends) leaves the tree,
    its counters, the cache and the events exactly as ``give`` of each row in turn."""
    one = _lenders()
    together = _lenders()
    cache, prefix, w, events, rows, _ = one
    assert [prefix.give(s, p + m) for s, p, m in rows] == [2, 3, 1]
    cache2, prefix2, w2, events2, rows2, _ = together
    assert prefix2.give_lent([s for s, _, _ in rows2], [len(p) for _, p, _ in rows2],
                             [np.array(m, np.int32) for _, _, m in rows2]) == [True] * 3
    assert_same(state(prefix), state(prefix2))
    assert [(e.kind, e.tokens.tolist(), e.n) for e in events] == \
        [(e.kind, e.tokens.tolist(), e.n) for e in events2]
    prefix2.check_invariants()
    for s, p, m in rows2:
        w2.holds(s, p + m)


def test_rows_that_giving_together_does_not_take_are_left_as_they_were():
    """Rows ``give_lent`` does not take (the caller gives them one by one) are left as they
    were: a sequence lending nothing, an id the tree owns, a start that is not its leaf's
    end, an empty tail, a tail past the sequence's position; the rows it takes beside them
    are given."""
    cache, prefix, w, events, rows, lone = _lenders()
    (a, pa, ma), (b, pb, mb), (c, pc, mc) = rows
    owned = w.new([3, 3])
    prefix.insert(owned, [3, 3])
    [tree_id] = prefix.owned_seqs()
    events.clear()
    before = state(prefix)
    cases = [(lone, 3, ma), (tree_id, 2, [1]), (a, len(pa) - 1, ma), (a, len(pa), []),
             (a, len(pa), ma + [1])]
    assert prefix.give_lent([s for s, _, _ in cases], [m for _, m, _ in cases],
                            [t for _, _, t in cases]) == [False] * 5
    assert_same(before, state(prefix))
    assert events == []
    # taken beside one it does not take: only that row changed nothing
    assert prefix.give_lent([lone, c], (3, len(pc)), [ma, mc]) == [False, True]
    assert prefix.lent_seqs() == [a, b] and c in prefix.owned_seqs()
    assert lone in cache.live_seqs() and cache.pos(lone) == 3
    prefix.check_invariants()


@pytest.mark.parametrize("args", [
    ("no list", [1], [[1]]),
    ([0], [1, 2], [[1]]),                                  # lengths differ
    ([0], [1], "tails"),
    ([None], [1], [[1]]),                                  # a bad id
    ([99], [1], [[1]]),
    ([0], [-1], [[1]]),                                    # a bad start
    ([0], [1.5], [[1]]),
    ([0], [1], [[1.5]]),                                   # a tail that is not token ids
    ([0], [1], [np.zeros((1, 1), np.int32)]),
    ([0], [1], [[True]]),                                  # bools are not token ids
    ([0, 1], [3, 1], [[4], [2**40]]),                      # the second row's: nothing given
])
def test_giving_together_refuses_bad_input_and_changes_nothing(args):
    cache, prefix, w, events, rows, lone = _lenders()
    before = state(prefix)
    with pytest.raises(InvalidArgument):
        prefix.give_lent(*args)
    assert_same(before, state(prefix))
    assert events == []


def test_a_reclaim_whose_policy_raises_still_keeps_the_prompt():
    """No cache id free for the clone, and the policy's key raises while evicting for one:
    that eviction goes on by LRU (the owned leaf goes, its id is free), the lent prompt is
    cloned into it, then the error propagates; once the lender removes its sequence the
    tree's own id holds the prompt (a new sequence given the lender's id is not taken for
    it)."""
    cache = make_cache(max_seqs=3)
    events = []

    def key(node):
        raise ZeroDivisionError("policy bug")

    prefix = PrefixCache(cache, key, max_seqs=3, on_event=events.append)
    w = World(cache)
    o = w.new([1, 1])
    prefix.give(o, [1, 1])                                 # an owned leaf: evictable
    a, other = w.new([5, 6, 7, 8]), w.new([3])             # every cache id live
    prefix.lend(a, [5, 6, 7, 8])
    events.clear()
    with pytest.raises(ZeroDivisionError):
        prefix.reclaim(a)
    assert prefix.lent_seqs() == [] and [e.kind for e in events] == ["evicted"]
    assert [p for p, _ in prefix.prefixes()] == [(5, 6, 7, 8)]
    assert prefix.owned_seqs() == [o]                      # the freed id
    cache.seq_rm(a)
    del w.tokens[a]
    prefix.check_invariants()
    w.holds(o, [5, 6, 7, 8])
    d = w.new([0, 0, 0, 0, 0])                             # a's id again
    assert d == a and prefix.peek([5, 6, 7, 8, 0]) == 4     # (no id free to match)
    assert other in cache.live_seqs()


def test_a_cache_clear_underneath_forgets_lent_leaves_too():
    cache, prefix, w, _ = setup()
    a = w.new([1, 2, 3])
    prefix.lend(a, [1, 2, 3])
    n = cache.clears
    cache.clear()
    assert cache.clears == n + 1
    w = World(cache)
    b = w.new([9, 9, 9, 9])                                # the lender's id, and longer
    assert b == a
    assert prefix.match([1, 2, 3, 4]) == (None, 0)
    assert prefix.metrics()["invalidations"] == 1 and prefix.prefixes() == []
    prefix.check_invariants()
    assert prefix.lend(b, [9, 9, 9]) == 3                  # a new tree of the cache's
    assert prefix.match([9, 9, 9, 1])[1] == 3


# -- refusals: the library's error, nothing changed ----------------------------------------

BAD_TOKENS = [None, "abc", b"ab", 5, [1.5], ["a"], [[1, 2]], [None], [2**31], [-(2**31) - 1],
              [2**70], np.array([1.0, 2.0]), np.zeros((2, 2), np.int32), np.array([True]),
              np.array([2**40]), {1, 2}, {1: 2}, iter([1, 2])]


@pytest.fixture
def loaded():
    cache, prefix, w, events = setup(max_seqs=8)
    s = w.new([1, 2, 3, 4])
    prefix.insert(s, [1, 2, 3, 4])
    prefix.pin([1, 2])
    return cache, prefix, w, s


@pytest.mark.parametrize("tokens", BAD_TOKENS, ids=repr)
def test_tokens_that_are_not_int_ids(loaded, tokens):
    cache, prefix, w, s = loaded
    before = state(prefix)
    for call in (lambda: prefix.insert(s, tokens), lambda: prefix.give(s, tokens),
                 lambda: prefix.lend(s, tokens), lambda: prefix.match(tokens),
                 lambda: prefix.peek(tokens), lambda: prefix.pin(tokens),
                 lambda: prefix.unpin(tokens, 1)):
        with pytest.raises(InvalidArgument):
            call()
        assert_same(state(prefix), before)


def test_a_reclaim_of_a_sequence_lending_nothing_changes_nothing(loaded):
    cache, prefix, w, s = loaded
    before = state(prefix)
    assert prefix.reclaim(s) is False and prefix.reclaim(prefix.owned_seqs()[0]) is False
    assert_same(state(prefix), before)


@pytest.mark.parametrize("call, error", [
    (lambda p, s: p.insert(None, [1]), InvalidArgument),
    (lambda p, s: p.insert(1.0, [1]), InvalidArgument),
    (lambda p, s: p.insert(True, [1]), InvalidArgument),
    (lambda p, s: p.insert(-1, [1]), InvalidArgument),
    (lambda p, s: p.insert(8, [1]), InvalidArgument),
    (lambda p, s: p.insert(p.owned_seqs()[0], [1, 2]), InvalidArgument),     # the tree's own
    (lambda p, s: p.insert(5, [1]), InvalidState),                           # not live
    (lambda p, s: p.insert(5, []), InvalidState),
    (lambda p, s: p.insert(s, [1, 2, 3, 4, 5]), InvalidState),              # holds only 4
    (lambda p, s: p.insert(s, [1, 2], priority="high"), InvalidArgument),
    (lambda p, s: p.insert(s, [1, 2], priority=float("nan")), InvalidArgument),
    (lambda p, s: p.insert(s, [1, 2], priority=True), InvalidArgument),
    (lambda p, s: p.give(None, [1]), InvalidArgument),
    (lambda p, s: p.give(8, [1]), InvalidArgument),
    (lambda p, s: p.give(p.owned_seqs()[0], [1, 2]), InvalidArgument),       # the tree's own
    (lambda p, s: p.give(5, [1]), InvalidState),                             # not live
    (lambda p, s: p.give(5, []), InvalidState),
    (lambda p, s: p.give(s, [1, 2, 3, 4, 5]), InvalidState),                # holds only 4
    (lambda p, s: p.give(s, [1, 2], priority=float("nan")), InvalidArgument),
    (lambda p, s: p.lend(None, [1]), InvalidArgument),
    (lambda p, s: p.lend(8, [1]), InvalidArgument),
    (lambda p, s: p.lend(p.owned_seqs()[0], [1, 2]), InvalidArgument),       # the tree's own
    (lambda p, s: p.lend(5, [1]), InvalidState),                             # not live
    (lambda p, s: p.lend(s, [1, 2, 3, 4, 5]), InvalidState),                # holds only 4
    (lambda p, s: p.lend(s, [1, 2], priority=float("nan")), InvalidArgument),
    (lambda p, s: p.reclaim(None), InvalidArgument),
    (lambda p, s: p.reclaim(8), InvalidArgument),
    (lambda p, s: p.reclaim(1.0), InvalidArgument),
    (lambda p, s: p.match([1, True], max_len=2), InvalidArgument),          # bools are not ids
    (lambda p, s: p.match((False,)), InvalidArgument),
    (lambda p, s: p.peek([np.bool_(True)]), InvalidArgument),
    (lambda p, s: p.pin([1, True]), InvalidArgument),
    (lambda p, s: p.insert(s, [1, 2, True]), InvalidArgument),
    (lambda p, s: p.give(s, [True]), InvalidArgument),
    (lambda p, s: p.lend(s, [1, False]), InvalidArgument),
    (lambda p, s: p.unpin([1, True], 2), InvalidArgument),
    (lambda p, s: p.match(np.array([True, False])), InvalidArgument),
    (lambda p, s: p.match([1, 2], max_len=-1), InvalidArgument),
    (lambda p, s: p.match([1, 2], max_len=1.5), InvalidArgument),
    (lambda p, s: p.match([1, 2], pin=1), InvalidArgument),
    (lambda p, s: p.peek([1, 2], max_len="2"), InvalidArgument),
    (lambda p, s: p.evict(-1), InvalidArgument),
    (lambda p, s: p.evict(1.0), InvalidArgument),
    (lambda p, s: p.evict(n_ids=-2), InvalidArgument),
    (lambda p, s: p.unpin([1, 2], 0), InvalidArgument),
    (lambda p, s: p.unpin([1, 2], 3), InvalidArgument),
    (lambda p, s: p.unpin([1, 2, 3], 3), InvalidState),                     # no pin at 3
    (lambda p, s: p.unpin([9, 9], 2), InvalidState),                        # not cached
])
def test_refusals_change_nothing(loaded, call, error):
    cache, prefix, w, s = loaded
    before = state(prefix)
    with pytest.raises(error) as info:
        call(prefix, s)
    assert isinstance(info.value, CellCacheError)
    assert_same(state(prefix), before)
    prefix.check_invariants()


@pytest.mark.parametrize("kw", [dict(policy="fifo"), dict(policy=3), dict(max_seqs=0),
                                dict(max_seqs=17), dict(max_seqs=2.0), dict(on_event=5)],
                         ids=repr)
def test_bad_construction(kw):
    with pytest.raises(InvalidArgument):
        PrefixCache(make_cache(), **kw)


def test_not_a_cache():
    with pytest.raises(InvalidArgument):
        PrefixCache(object())


def test_the_node_a_policy_sees():
    cache = make_cache()
    seen: list[PrefixNode] = []

    def key(node):
        seen.append(node)
        return node.last_access

    prefix = PrefixCache(cache, key)
    w = World(cache)
    s = w.new([1, 2, 3])
    prefix.insert(s, [1, 2, 3], priority=2)
    prefix.evict(1)
    [node] = seen
    assert (node.start, node.end, node.n_tokens, node.priority, node.hits) == (0, 3, 3, 2.0, 1)
    assert node.path().tolist() == [1, 2, 3]


# -- the state machine -------------------------------------------------------------------------

def lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixMachine(RuleBasedStateMachine):
    """The tree against the set of maximal cached tuples ``self.ref``; callers' sequences are
    checked to hold their tokens after every step (so eviction never took their cells)."""

    @initialize(policy=st.sampled_from(["lru", "lfu", "priority"]), tree_seqs=st.integers(1, 4),
                cache_seqs=st.sampled_from([5, 9]), capacity=st.sampled_from([40, 96]),
                toks=st.lists(st.integers(0, 3), min_size=1, max_size=12))
    def build(self, policy, tree_seqs, cache_seqs, capacity, toks):
        self.cache = make_cache(capacity, cache_seqs, max_write=8)
        self.events: list[PrefixEvent] = []
        self.prefix = PrefixCache(self.cache, policy, max_seqs=min(tree_seqs, cache_seqs),
                                  on_event=self.events.append)
        self.world = World(self.cache)
        self.ref: set[tuple[int, ...]] = set()
        self.pins: list[tuple[tuple[int, ...], int]] = []
        # one prompt cached to start from
        s = self.world.new(toks)
        assert self.prefix.insert(s, toks) == len(toks)
        self.apply_events()
        self.ref_add(tuple(toks))

    # the reference ---------------------------------------------------------------------------
    def ref_lcp(self, toks) -> int:
        return max((lcp(p, toks) for p in self.ref), default=0)

    def ref_add(self, path: tuple) -> None:
        if any(p[:len(path)] == path for p in self.ref):
            return
        self.ref = {p for p in self.ref if path[:len(p)] != p}
        self.ref.add(path)

    def apply_events(self) -> list[PrefixEvent]:
        """Replays evicted/invalidated events on the reference; returns the stored ones."""
        stored = []
        for ev in self.events:
            toks = tuple(ev.tokens.tolist())
            assert ev.key == prefix_key(toks)
            if ev.kind in ("evicted", "dropped"):
                assert toks in self.ref, (toks, self.ref)
                on_it = [(pin, n) for pin, n in self.pins
                         if len(toks) - ev.n < n <= len(toks) and toks[:n] == pin]
                if ev.kind == "evicted":
                    assert not on_it, "a pinned prefix was evicted"
                else:                     # a lent leaf its lender reclaimed without an id
                    self.pins = [p for p in self.pins if p not in on_it]
                self.ref.remove(toks)
                rest = toks[:len(toks) - ev.n]
                if rest and not any(p[:len(rest)] == rest for p in self.ref):
                    self.ref.add(rest)
            elif ev.kind in ("cleared", "invalidated"):
                self.ref = set()
                self.pins = []
            else:
                assert ev.kind == "stored"
                stored.append(ev)
        self.events.clear()
        return stored

    def callers(self) -> list[int]:
        return sorted(self.world.tokens)

    def pick(self, i: int) -> int:
        c = self.callers()
        return c[i % len(c)]

    def lent_len(self, s: int) -> int:
        """The length of the leaf caller s lends (0: none)."""
        if s not in self.prefix.lent_seqs():
            return 0
        [n] = [len(p) for p, t in self.prefix.prefixes() if t == s]
        return n

    def reclaimed(self, s: int) -> None:
        """s's lend ended by reclaim: the prefix kept (owned now) or dropped (events)."""
        n = self.lent_len(s)
        path = tuple(self.world.tokens[s][:n])
        kept = self.prefix.reclaim(s)
        dropped = [ev for ev in self.events if ev.kind == "dropped"]
        self.apply_events()
        assert s not in self.prefix.lent_seqs()
        event("reclaim: kept" if kept else "reclaim: nothing lent" if not n else "reclaim: dropped")
        if kept:
            assert not dropped and any(p == path and self.prefix.owns(t)
                                       for p, t in self.prefix.prefixes())
        elif n:
            assert dropped and dropped[0].tokens.tolist() == list(path)

    # caller sequences -------------------------------------------------------------------------
    @rule(toks=st.lists(st.integers(0, 3), min_size=1, max_size=12))
    def new_caller(self, toks):
        s = self.world.new(toks, evict_with=self.prefix)
        self.apply_events()
        if s is None:
            assert len(self.cache.live_seqs()) == self.cache.max_seqs

    @precondition(lambda self: self.world.tokens)
    @rule(i=st.integers(0, 50), toks=st.lists(st.integers(0, 3), min_size=1, max_size=10))
    def extend(self, i, toks):
        self.world.write(self.pick(i), toks, evict_with=self.prefix)
        self.apply_events()

    @precondition(lambda self: self.world.tokens)
    @rule(i=st.integers(0, 50), upto=st.integers(0, 20))
    def fork(self, i, upto):
        s = self.pick(i)
        t = self.cache.seq_clone(s, upto)
        if t is not None:
            self.world.tokens[t] = self.world.tokens[s][:upto]

    @precondition(lambda self: self.world.tokens)
    @rule(i=st.integers(0, 50), back=st.integers(0, 6))
    def rewind(self, i, back):
        s = self.pick(i)
        p = max(0, self.cache.pos(s) - back)
        if p < self.lent_len(s):               # the lend contract: reclaim first
            self.reclaimed(s)
        assert self.cache.rewind(s, p)
        del self.world.tokens[s][p:]

    @precondition(lambda self: self.world.tokens)
    @rule(i=st.integers(0, 50))
    def remove(self, i):
        s = self.pick(i)
        if self.lent_len(s):
            self.reclaimed(s)
        assert self.cache.seq_rm(s)
        del self.world.tokens[s]

    # the prefix cache -------------------------------------------------------------------------
    def store(self, i, k, prio, verb):
        """insert, give (the caller's sequence goes to the tree, its leaf, or away) or lend
        (the new leaf names the caller's sequence, which goes on)."""
        s = self.pick(i)
        toks = tuple(self.world.tokens[s][: k % (len(self.world.tokens[s]) + 1)])
        skipped = self.prefix.metrics()["insert_skipped"]
        lent = self.lent_len(s)
        got = getattr(self.prefix, verb)(s, np.array(toks, np.int64), priority=prio)
        stored = self.apply_events()
        give = verb == "give"
        if give:
            del self.world.tokens[s]
        event(f"{verb}: stored" if got else f"{verb}: cached or skipped")
        if lent:
            event(f"{verb} by a lender")
        if got:
            [ev] = stored
            assert ev.tokens.tolist() == list(toks) and ev.n == got
            assert got == len(toks) - self.ref_lcp(toks)
            self.ref_add(toks)
            assert not give or (self.prefix.owns(s) and self.cache.pos(s) == len(toks))
            if verb == "lend":
                assert s in self.prefix.lent_seqs() and self.lent_len(s) == len(toks)
        else:
            assert not stored
            # given: removed, or (a lender whose leaf the tokens do not run on from) the
            # tree's now, holding that leaf
            assert not give or s not in self.cache.live_seqs() or (
                lent and self.prefix.owns(s) and self.cache.pos(s) == lent)
            assert (not toks or self.ref_lcp(toks) == len(toks)
                    or self.prefix.metrics()["insert_skipped"] == skipped + 1)

    @precondition(lambda self: self.world.tokens)
    @rule(i=st.integers(0, 50), k=st.integers(0, 30), prio=st.integers(0, 2))
    def insert(self, i, k, prio):
        self.store(i, k, prio, "insert")

    @precondition(lambda self: self.world.tokens)
    @rule(i=st.integers(0, 50), k=st.integers(0, 30), prio=st.integers(0, 2))
    def give(self, i, k, prio):
        self.store(i, k, prio, "give")

    @precondition(lambda self: self.world.tokens)
    @rule(i=st.integers(0, 50), k=st.integers(0, 30), prio=st.integers(0, 2))
    def lend(self, i, k, prio):
        self.store(i, k, prio, "lend")

    @precondition(lambda self: self.world.tokens)
    @rule(i=st.integers(0, 50))
    def reclaim(self, i):
        self.reclaimed(self.pick(i))

    def query(self, source, i, cut, tail):
        if source == 0 and self.ref:
            base = sorted(self.ref)[i % len(self.ref)]
        elif source == 1 and self.world.tokens:
            base = tuple(self.world.tokens[self.pick(i)])
        else:
            base = ()
        return (base if cut is None else base[: cut % (len(base) + 1)]) + tuple(tail)

    @rule(source=st.integers(0, 2), i=st.integers(0, 50), cut=st.none() | st.integers(0, 40),
          tail=st.lists(st.integers(0, 3), max_size=4), max_len=st.none() | st.integers(0, 30),
          pin=st.booleans())
    def match(self, source, i, cut, tail, max_len, pin):
        q = self.query(source, i, cut, tail)
        limited = q if max_len is None else q[:max_len]
        want = self.ref_lcp(limited)
        assert self.prefix.peek(list(q), max_len=max_len) == want
        seq, n = self.prefix.match(np.array(q, np.int32), max_len=max_len, pin=pin)
        assert not self.apply_events()
        event("match: hit" if seq is not None else "match: no id" if want else "match: miss")
        if seq is None:
            assert n == 0
            assert want == 0 or len(self.cache.live_seqs()) == self.cache.max_seqs
            return
        assert n == want > 0 and self.cache.pos(seq) == n
        assert seq not in self.world.tokens and seq not in self.prefix.owned_seqs()
        self.world.tokens[seq] = list(limited[:n])
        if pin:
            self.pins.append((limited[:n], n))

    @rule(source=st.integers(0, 2), i=st.integers(0, 50), cut=st.none() | st.integers(0, 40),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=8),
          keep=st.sampled_from(["running", "insert + remove", "give", "lend",
                                "lend + give"]))
    def serve(self, source, i, cut, tail, keep):
        """A generator's request: match (one token left to feed), compute the rest, insert
        (or lend); the request keeps running or finishes (insert then seq_rm, or give;
        lent: runs on a few tokens, then gives)."""
        q = self.query(source, i, cut, tail)
        want = self.ref_lcp(q[:-1])
        seq, n = self.prefix.match(list(q), max_len=len(q) - 1)
        if seq is None:
            assert n == 0 and (want == 0 or len(self.cache.live_seqs()) == self.cache.max_seqs)
            seq = self.world.new([], evict_with=self.prefix)
            self.apply_events()
            if seq is None:
                return
        else:
            assert n == want
            self.world.adopt(seq, q[:n])
        event("serve: hit" if n else "serve: miss")
        done = self.world.write(seq, q[n:], evict_with=self.prefix)
        self.apply_events()
        if keep == "give":
            self.give(self.callers().index(seq), n + done, 0)
            return
        if keep.startswith("lend"):
            self.lend(self.callers().index(seq), n + done, 0)
            if keep == "lend + give" and seq in self.world.tokens:
                more = self.world.write(seq, tail, evict_with=self.prefix)
                self.apply_events()
                self.give(self.callers().index(seq), n + done + more, 0)
            return
        self.insert(self.callers().index(seq), n + done, 0)
        if keep != "running":
            self.remove(self.callers().index(seq))

    @precondition(lambda self: self.pins)
    @rule(i=st.integers(0, 50))
    def unpin(self, i):
        toks, n = self.pins.pop(i % len(self.pins))
        self.prefix.unpin(list(toks), n)

    @rule(n_cells=st.integers(0, 40), n_ids=st.integers(0, 2))
    def evict(self, n_cells, n_ids):
        before = self.world.snapshot()
        free = self.cache.free_cells
        owned = len(self.prefix.owned_seqs())
        freed = self.prefix.evict(n_cells, n_ids=n_ids)
        self.apply_events()
        assert freed == self.cache.free_cells - free
        assert self.world.snapshot() == before           # no caller sequence lost a cell
        released = owned - len(self.prefix.owned_seqs())
        if freed < n_cells or released < n_ids:
            # it stopped short: every leaf left is pinned
            assert all(leaf.pins for leaf in self.prefix._owned.values())

    @rule(how=st.sampled_from(["clear", "cache.clear + invalidate", "cache.clear + validate"]))
    def reset(self, how):
        if how == "clear":
            free = self.cache.free_cells
            freed = self.prefix.clear()
            assert freed == self.cache.free_cells - free
        else:
            self.cache.clear()
            self.world = World(self.cache)
            if how.endswith("invalidate"):
                self.prefix.invalidate()
            else:
                assert self.prefix.validate() == (not self.ref)
        self.apply_events()
        assert self.ref == set() and self.pins == []
        assert self.prefix.prefixes() == [] and self.prefix.owned_seqs() == []

    # after every step -------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if not hasattr(self, "prefix"):
            return
        self.prefix.check_invariants()
        self.cache.check_invariants()
        leaves = self.prefix.prefixes()
        assert {p for p, _ in leaves} == self.ref
        owned = set(self.prefix.owned_seqs())
        assert not owned & set(self.world.tokens)
        assert set(self.prefix.lent_seqs()) <= set(self.world.tokens)
        assert len(owned) <= self.prefix.max_seqs
        # every cached node's cells hold exactly its tokens at its positions
        for path, s in leaves:
            self.world.holds(s, path)
        # every caller sequence still holds its tokens
        for s, toks in self.world.tokens.items():
            assert self.cache.pos(s) == len(toks)
            self.world.holds(s, toks)
        m = self.prefix.metrics()
        assert m["cached_tokens"] == len({p[:k] for p in self.ref for k in range(1, len(p) + 1)})
        assert m["pins"] == len(self.pins)


PrefixMachine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=40,
                                           deadline=None)
TestPrefixMachine = PrefixMachine.TestCase
