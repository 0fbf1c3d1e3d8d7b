"""The radix tree shared by the prefix cache and the pending prompts: walks, splits, links
and unlinks on a drawn tree, and PendingPrompts (lcp after adds and removes of overlapping
prompts, the splits they make, the counts per node) against a plain list of prompts."""

from __future__ import annotations

import numpy as np
import pytest

from cellcache import InvalidArgument
from cellcache.radix import PendingPrompts, PromptNode, RadixNode, RadixTree, as_tokens

A, B, C, D, E, F, X, Y, Z, Q = range(10, 20)


def qb(*tokens: int) -> bytes:
    return np.array(tokens, np.int32).tobytes()


def tokens_of(node: RadixNode) -> list[int]:
    return node.seg.tolist()


def drawn() -> tuple[RadixTree, dict[str, RadixNode]]:
    """The tree of radix.py's docstring, linked by hand::

        root
         └─ [a b]
             ├─ [c d]
             │   ├─ [e f]
             │   └─ [x y]
             └─ [z]
    """
    tree: RadixTree = RadixTree(RadixNode(b"", 0, None))
    ab = tree.add(RadixNode(qb(A, B), 0, tree.root))
    cd = tree.add(RadixNode(qb(C, D), 2, ab))
    ef = tree.add(RadixNode(qb(E, F), 4, cd))
    xy = tree.add(RadixNode(qb(X, Y), 4, cd))
    z = tree.add(RadixNode(qb(Z), 2, ab))
    tree.check()
    return tree, {"ab": ab, "cd": cd, "ef": ef, "xy": xy, "z": z}


# -- the tree -----------------------------------------------------------------------------------

def test_the_drawn_tree_counts_its_nodes_and_tokens():
    tree, n = drawn()
    assert (tree.nodes, tree.tokens) == (5, 9)
    assert [tokens_of(x) for x in tree][0] == [A, B]          # a parent before its children
    assert {id(x) for x in tree} == {id(x) for x in n.values()}
    assert n["xy"].path().tolist() == [A, B, C, D, X, Y]
    assert n["xy"].line() == {n["xy"], n["cd"], n["ab"], tree.root}


@pytest.mark.parametrize("query, node, length", [
    ((), None, 0),                              # the empty query: the root
    ((Q,), None, 0),                            # no child starts with q
    ((A,), "ab", 1),                            # ends inside [a b]
    ((A, B), "ab", 2),                          # ends at [a b]'s end
    ((A, Q), "ab", 1),                          # differs inside [a b]
    ((A, B, C, D, X, Q), "xy", 5),              # the docstring's walk
    ((A, B, C, D, E, F, A, B), "ef", 6),        # runs past a leaf
    ((A, B, Z), "z", 3),
    ((A, B, Q), "ab", 2),                       # at a branch point, no child takes q
])
def test_walk_finds_the_longest_common_prefix(query, node, length):
    tree, n = drawn()
    got, m = tree.walk(qb(*query))
    assert m == length
    assert got is (tree.root if node is None else n[node])
    assert got.start < m <= got.end or (got is tree.root and m == 0)


def test_split_puts_the_head_above_and_keeps_the_counts():
    tree, n = drawn()
    upper = tree.split(n["xy"], 5)
    tree.check()
    assert tokens_of(upper) == [X] and tokens_of(n["xy"]) == [Y]
    assert (upper.start, upper.end, n["xy"].start, n["xy"].end) == (4, 5, 5, 6)
    assert upper.parent is n["cd"] and n["xy"].parent is upper
    assert list(upper.children.values()) == [n["xy"]]
    assert (tree.nodes, tree.tokens) == (6, 9)                # one node more, no token more
    assert tree.walk(qb(A, B, C, D, X))[0] is upper
    assert tree.walk(qb(A, B, C, D, X, Y, Q)) == (n["xy"], 6)
    assert n["xy"].path().tolist() == [A, B, C, D, X, Y]


def test_cut_takes_the_subtree_out_of_the_counts():
    tree, n = drawn()
    tree.cut(n["z"])
    assert (tree.nodes, tree.tokens) == (4, 8) and n["z"].parent is None
    tree.cut(n["cd"])                                          # with its two children
    tree.check()
    assert (tree.nodes, tree.tokens) == (1, 2)
    assert tree.walk(qb(A, B, C, D)) == (n["ab"], 2)
    assert [x for x in tree] == [n["ab"]]


def test_check_catches_a_count_that_drifted():
    tree, _ = drawn()
    tree.tokens += 1
    with pytest.raises(AssertionError):
        tree.check()


def test_as_tokens_is_the_trees_key():
    assert as_tokens([1, 2, 3]).tobytes() == qb(1, 2, 3)
    arr = np.array([4, 5], np.int32)
    assert as_tokens(arr) is arr                               # no copy for int32
    assert as_tokens(np.array([7], np.int64)).dtype == np.int32
    for bad in ([2**31], [True], [1.0], "ab", np.zeros((1, 1), np.int32)):
        with pytest.raises(InvalidArgument):
            as_tokens(bad)


# -- pending prompts ------------------------------------------------------------------------------

def counts(pending: PendingPrompts) -> dict[tuple[int, ...], int]:
    """Every node's path and count."""
    return {tuple(x.path().tolist()): x.count for x in pending.tree}


def test_overlapping_prompts_split_and_count():
    p = PendingPrompts()
    p.add(qb(A, B, C, D))
    assert counts(p) == {(A, B, C, D): 1}
    p.add(qb(A, B, X, Y))                                     # splits [a b c d] after b
    assert counts(p) == {(A, B): 2, (A, B, C, D): 1, (A, B, X, Y): 1}
    p.add(qb(A, B))                                           # ends at the split: no new node
    p.add(qb(A, B, C, D))                                     # a duplicate
    assert counts(p) == {(A, B): 4, (A, B, C, D): 2, (A, B, X, Y): 1}
    assert p.size == 4 and p.tree.root.count == 4
    p.tree.check()
    assert p.lcp(qb(A, B, C, Q)) == 3
    assert p.lcp(qb(A, B, X, Y, Z)) == 4
    assert p.lcp(qb(Q)) == 0 and p.lcp(b"") == 0


def test_removing_prompts_takes_out_what_no_prompt_runs_through():
    p = PendingPrompts()
    for t in [(A, B, C, D), (A, B, X, Y), (A, B, C, D), (A, B)]:
        p.add(qb(*t))
    p.remove(qb(A, B, X, Y))
    assert counts(p) == {(A, B): 3, (A, B, C, D): 2}
    assert p.lcp(qb(A, B, X, Y)) == 2                         # [x y] went
    p.remove(qb(A, B, C, D))                                  # one of the duplicates
    assert p.lcp(qb(A, B, C, D)) == 4 and p.size == 2
    p.remove(qb(A, B))
    assert counts(p) == {(A, B): 1, (A, B, C, D): 1}          # (nodes are not merged back)
    p.remove(qb(A, B, C, D))
    assert counts(p) == {} and p.size == 0 and p.tree.root.count == 0
    assert (p.tree.nodes, p.tree.tokens) == (0, 0)
    assert p.lcp(qb(A, B, C, D)) == 0


def test_the_empty_prompt_counts_but_holds_no_node():
    p = PendingPrompts()
    p.add(b"")
    assert p.size == 1 and p.tree.nodes == 0 and p.lcp(qb(A)) == 0
    p.remove(b"")
    assert p.size == 0 and p.tree.root.count == 0


def test_pending_prompts_against_a_plain_list():
    """After every add or remove: lcp of a query is its longest common prefix with any live
    prompt, each node counts the live prompts through it, and the structure holds."""
    rng = np.random.default_rng(7)
    p, live = PendingPrompts(), []

    def draw() -> np.ndarray:
        stem = [1, 2, 3, 4, 5, 6][:int(rng.integers(0, 7))]
        return np.array(stem + rng.integers(0, 3, size=int(rng.integers(0, 5))).tolist(), np.int32)

    def lcp(a: np.ndarray, b: np.ndarray) -> int:
        m = min(len(a), len(b))
        eq = a[:m] == b[:m]
        return m if eq.all() else int(eq.argmin())

    for _ in range(1500):
        if live and rng.random() < 0.45:
            p.remove(live.pop(int(rng.integers(0, len(live)))).tobytes())
        else:
            live.append(draw())
            p.add(live[-1].tobytes())
        q = draw()
        assert p.lcp(q.tobytes()) == max((lcp(q, x) for x in live), default=0)
        assert p.size == len(live) == p.tree.root.count
        p.tree.check()
        for path, count in counts(p).items():
            assert count == sum(x[:len(path)].tolist() == list(path) for x in live) > 0


def test_a_prompt_node_head_carries_the_count():
    node = PromptNode(qb(A, B, C), 0, None, count=3)
    upper = node.head(2)
    assert tokens_of(upper) == [A, B] and upper.count == 3 and upper.end == 2
