"""PrefixCache on the host backend: each operation, the drawn walk of the module docstring,
clears underneath, events, and refusals (nothing changes). Eviction and pins are in
test_prefix_eviction.py, lending in test_prefix_lend.py, the state machine in
test_prefix_machine.py; tests/helpers_prefix.py keeps the truth of which token each cell holds.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from cellcache import CellCacheError, InvalidArgument, InvalidState, PrefixCache
from cellcache.prefix import PrefixNode, prefix_key
from tests.helpers_prefix import World, assert_same, make_cache, setup, state

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


def test_on_event_can_be_set_later_and_refuses_what_is_not_callable():
    cache = make_cache()
    prefix = PrefixCache(cache)
    w = World(cache)
    s = w.new([1, 2])
    prefix.insert(s, [1, 2])                         # no callback: nothing queued
    events: list = []
    prefix.on_event = events.append
    s = w.new([3, 4])
    prefix.insert(s, [3, 4])
    assert [(e.kind, e.length) for e in events] == [("stored", 2)]
    before = prefix.prefixes()
    with pytest.raises(InvalidArgument, match="not callable"):
        prefix.on_event = 5                          # type: ignore[assignment]
    assert prefix.on_event == events.append and prefix.prefixes() == before
    prefix.on_event = None
    s = w.new([5, 6])
    prefix.insert(s, [5, 6])
    assert len(events) == 1
    prefix.check_invariants()


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


@pytest.mark.parametrize("tokens", BAD_TOKENS, ids=lambda t: re.sub(r" at 0x[0-9a-f]+", "", repr(t)))
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
