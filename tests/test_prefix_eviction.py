"""PrefixCache eviction: it never takes a running sequence's cell, stops once enough is
free, follows the policy (a failing user policy falls back to LRU), keeps pinned prefixes
(the tail below the deepest pin goes) and the tree's id budget."""

from __future__ import annotations

import pytest

from cellcache import InvalidState, PrefixCache
from tests.helpers_prefix import World, assert_same, make_cache, setup, state


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


def test_storable_tells_whether_give_stores_the_tokens():
    """``storable`` (what load_prefix asks before it places a file's positions for the
    tree) agrees with what give then does, over random trees at their id budget, pins
    held: a leaf branching inside the path of the tokens (a shared system prompt) releases
    no id, one cut under a branch does, a node of the path adopting a sequence makes the
    new leaf extend it; evictions between the two never turn True into False."""
    import random

    seen = set()
    for trial in range(300):
        rnd = random.Random(trial)
        cache, prefix, w, _ = setup(tree_seqs=rnd.randint(1, 4), capacity=2048, max_seqs=64)

        def toks(rnd=rnd, top=1 + trial % 3, most=4 + trial % 9):
            return [rnd.randint(0, top) for _ in range(rnd.randint(1, most))]

        pins = []
        for _ in range(25):
            op = rnd.random()
            if op < 0.5:
                t = toks()
                prefix.give(w.new(t), t)
            elif op < 0.6:
                t = toks()
                if n := prefix.pin(t):
                    pins.append((t, n))
            elif op < 0.7 and pins:
                prefix.unpin(*pins.pop(rnd.randrange(len(pins))))
            else:
                q = toks()
                if prefix.peek(q) == len(q):
                    continue
                held = prefix.pin(q)
                told = prefix.storable(q)
                evicted = rnd.random() < 0.3
                if evicted:
                    prefix.evict(rnd.randint(1, 10))
                prefix.give(w.new(q), q)
                stored = prefix.peek(q) == len(q)
                assert stored if told else (evicted or not stored), (trial, told, stored)
                seen.add((told, stored))
                if held:
                    prefix.unpin(q, held)
            prefix.check_invariants()
    assert {(True, True), (False, False)} <= seen
