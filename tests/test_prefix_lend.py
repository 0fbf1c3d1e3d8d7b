"""PrefixCache lending: a lent leaf counts in the budget and is never evicted, giving
lenders together is giving them one by one, reclaims keep the prompt."""

from __future__ import annotations

import numpy as np
import pytest

from cellcache import InvalidArgument, PrefixCache
from tests.helpers_prefix import World, assert_same, make_cache, setup, state


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
