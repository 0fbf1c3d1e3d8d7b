"""The eviction order (cellcache.prefix_policy.EvictionOrder): with a built-in policy the first
pop is a scan and the heap is built only for a second, so it must give the order a full sort
of (key, given order) gives, pushes interleaved; a user's policy that fails falls back to LRU."""

from __future__ import annotations

import heapq

from hypothesis import given, settings
from hypothesis import strategies as st

from cellcache.prefix_policy import POLICIES, EvictionOrder, lru


class Leaf:
    """What a policy reads of a prefix node."""

    def __init__(self, n: int, last_access: int, hits: int, priority: float):
        self.n, self.last_access, self.hits, self.priority = n, last_access, hits, priority


leaf = st.builds(Leaf, st.integers(0, 10**6), st.integers(0, 5), st.integers(0, 3),
                 st.sampled_from([0.0, 1.0, -2.5]))


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(POLICIES)), leaves=st.lists(leaf, max_size=25),
       extra=st.lists(leaf, max_size=6), ops=st.lists(st.sampled_from("pp+"), max_size=40))
def test_pops_follow_the_key_then_the_given_order_with_pushes_between(name, leaves, extra, ops):
    key = POLICIES[name]
    order = EvictionOrder(key, leaves, fail=lambda e: (_ for _ in ()).throw(e))
    ref = [(key(x), t, x) for t, x in enumerate(leaves)]
    heapq.heapify(ref)
    tie, pushed, got, want = len(leaves), iter(extra), [], []
    for op in ops:
        nxt = next(pushed, None) if op == "+" else None
        if nxt is not None:
            order.push(nxt)
            heapq.heappush(ref, (key(nxt), tie, nxt))
            tie += 1
        elif op == "p":
            assert bool(order) == bool(ref)
            if ref:
                got.append(order.pop())
                want.append(heapq.heappop(ref)[2])
    assert [id(x) for x in got] == [id(x) for x in want]
    assert bool(order) == bool(ref)


def test_a_failing_user_policy_falls_back_to_lru_and_reports_once():
    leaves = [Leaf(i, last_access=5 - i, hits=0, priority=0.0) for i in range(5)]
    failures: list[BaseException] = []

    def bad(node):
        if node.n == 3:
            raise RuntimeError("the user's policy")
        return -node.n

    order = EvictionOrder(bad, leaves, failures.append)
    assert [order.pop().n for _ in range(5)] == [4, 3, 2, 1, 0]     # LRU: oldest access first
    assert len(failures) == 1 and order.key is lru
