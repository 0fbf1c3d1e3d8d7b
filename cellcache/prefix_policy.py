"""Which cached leaf of a prefix cache eviction takes first.

A policy maps a leaf (a :class:`cellcache.prefix.PrefixNode`, whose ``start``, ``end``,
``last_access``, ``hits``, ``priority`` and ``created`` it reads and never changes) to a
key; the smallest key goes first, ties in the order the leaves were given. A policy the
user passes is user code: when it raises, or its keys do not compare with one another, the
order falls back to LRU for the rest of the operation, and the exception goes to the
caller's ``fail`` (raised once the operation is whole).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any

from .errors import InvalidArgument

__all__ = ["POLICIES", "EvictionOrder", "evictable", "policy_key"]


def lru(node: Any) -> Any:
    return node.last_access


def lfu(node: Any) -> Any:
    return (node.hits, node.last_access)


def priority(node: Any) -> Any:
    return (node.priority, node.last_access)


#: Eviction policies by name: each maps a leaf to a key, the smallest key goes first.
POLICIES: dict[str, Callable[[Any], Any]] = {"lru": lru, "lfu": lfu, "priority": priority}


#: The built-in policies: their keys are reals (or tuples of them), always comparable.
_COMPARABLE = frozenset(POLICIES.values())


def policy_key(policy: object) -> Callable[[Any], Any]:
    """The key function of ``policy``: a name in :data:`POLICIES` or a callable; raises
    InvalidArgument for anything else."""
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise InvalidArgument(
                f"policy={policy!r} is not one of {', '.join(POLICIES)} or a callable")
        return POLICIES[policy]
    if callable(policy):
        return policy
    raise InvalidArgument(f"policy of type {type(policy).__name__} is not a name or a callable")


def evictable(node: Any, protect: Any) -> bool:
    """Whether eviction may take (the tail of) owned leaf ``node``: not in ``protect``, and
    unpinned or pinned only above its end (its tail below the deepest pin goes)."""
    return (node.seq is not None and node not in protect
            and (not node.pins or max(node.pins) < node.end))


class EvictionOrder:
    """Leaves by a policy's key, smallest first: :meth:`pop` the next, :meth:`push` one
    that became a leaf meanwhile. A key that fails goes to ``fail`` and LRU orders what is
    left (see the module's docstring).

    An eviction usually takes one or two leaves of hundreds: with a built-in policy (keys
    that always compare) the first :meth:`pop` is a ``min`` over the leaves as given, and
    the heap is built only for a second (sorting every leaf took ~210 us at 1,000 leaves,
    an admission's worth of host time in a server whose prefix cache is full). A user's
    policy is sorted at once, which compares every key."""

    __slots__ = ("fail", "first", "heap", "key", "pending", "tie")

    def __init__(self, key: Callable[[Any], Any], leaves: Iterable[Any],
                 fail: Callable[[BaseException], None]):
        self.fail = fail
        self.key = key
        leaves = list(leaves)
        self.tie = len(leaves)
        self.first = True
        #: the leaves in their given order (then the pushed ones) until a heap is needed
        self.pending: list[Any] | None = leaves if key in _COMPARABLE else None
        self.heap: list[tuple[Any, int, Any]] = []
        if self.pending is not None:
            return
        try:
            heap = [(key(leaf), tie, leaf) for tie, leaf in enumerate(leaves)]
            heap.sort()                     # (a user's keys must compare with one another: all are)
        except Exception as e:              # the user's policy: LRU for this operation
            fail(e)
            self.key = lru
            heap = sorted((lru(leaf), tie, leaf) for tie, leaf in enumerate(leaves))
        self.heap = heap

    def __bool__(self) -> bool:
        return bool(self.heap) if self.pending is None else bool(self.pending)

    def pop(self) -> Any:
        pending = self.pending
        if pending is not None:
            if self.first:                  # the smallest key, the first of equals
                self.first = False
                leaf = min(pending, key=self.key)
                pending.remove(leaf)        # (nodes compare by identity)
                return leaf
            self.heap = list(zip(map(self.key, pending), range(len(pending)), pending))
            heapq.heapify(self.heap)
            self.pending = None
        return heapq.heappop(self.heap)[2]

    def push(self, leaf: Any) -> None:
        if self.pending is not None:
            self.pending.append(leaf)       # (after every leaf given: its tie is the largest)
            self.tie += 1
            return
        try:
            heapq.heappush(self.heap, (self.key(leaf), self.tie, leaf))
        except Exception as e:              # the user's policy: LRU from here on
            self.fail(e)
            self.key = lru
            rest = {id(x): (t, x) for _, t, x in self.heap}   # (a failed push may have added it)
            rest[id(leaf)] = (self.tie, leaf)
            self.heap = sorted((lru(x), t, x) for t, x in rest.values())
        self.tie += 1
