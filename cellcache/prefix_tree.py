"""The prefix cache's tree: a :class:`cellcache.radix.RadixTree` whose nodes carry what
the cache keeps per prefix (the leaf's sequence, pins by depth, eviction keys), with the
walks over them that need no cache verb: touching a path, pinning, counting what eviction
may take, and checking the leaves. Which sequence is the cache's or a lender's, and every
cache verb, stay in :class:`cellcache.prefix.PrefixCache`."""

from __future__ import annotations

from collections.abc import Container

from .radix import RadixNode, RadixTree

__all__ = ["PrefixNode", "PrefixTree"]


class PrefixNode(RadixNode):
    """A node of the tree: the tokens of positions ``[start, end)`` under its parent.

    Eviction policies read (never change) ``start``, ``end``, ``last_access`` (the prefix
    cache's operation clock when a match or insert last went through the node), ``hits``
    (matches and inserts through it), ``priority`` (the highest an insert through it gave)
    and ``created``.
    """

    __slots__ = ("created", "hits", "last_access", "pins", "priority", "seq")

    parent: PrefixNode | None
    children: dict[bytes, PrefixNode]

    def __init__(self, segb: bytes, start: int, parent: PrefixNode | None, clock: int,
                 priority: float = 0.0):
        super().__init__(segb, start, parent)
        self.seq: int | None = None                      # the leaf's sequence: owned or lent
        self.last_access = clock
        self.created = clock
        self.hits = 0
        self.priority = priority
        self.pins: dict[int, int] | None = None          # depth -> count, depth in (start, end]

    def head(self, m: int) -> PrefixNode:
        """The upper part of a split at m: the node's keys, and its pins at depths <= m
        (moved)."""
        upper = PrefixNode(self.segb[:4 * (m - self.start)], self.start, self.parent,
                           self.created, self.priority)
        upper.last_access = self.last_access
        upper.hits = self.hits
        if self.pins:
            up = {d: c for d, c in self.pins.items() if d <= m}
            if up:
                upper.pins = up
                self.pins = {d: c for d, c in self.pins.items() if d > m} or None
        return upper

    def __repr__(self) -> str:
        return f"PrefixNode([{self.start}, {self.end}), seq={self.seq}, children={len(self.children)})"


class PrefixTree(RadixTree[PrefixNode]):
    """The tree of cached prefixes; ``pins`` counts the pins its nodes hold."""

    __slots__ = ("pins",)

    def __init__(self, clock: int):
        super().__init__(PrefixNode(b"", 0, None, clock))
        self.pins = 0

    @staticmethod
    def leaf_under(node: PrefixNode) -> PrefixNode:
        """A leaf at or under ``node`` (its sequence holds ``node``'s path)."""
        while node.seq is None:
            node = next(iter(node.children.values()))
        return node

    @staticmethod
    def touch(node: PrefixNode, clock: int, priority: float | None = None) -> None:
        """Marks the path down to ``node`` used at ``clock`` (one hit more), raising its
        priority to ``priority`` where that is higher."""
        while node.parent is not None:
            node.last_access = clock
            node.hits += 1
            if priority is not None and priority > node.priority:
                node.priority = priority
            node = node.parent

    def pin(self, node: PrefixNode, depth: int) -> None:
        """One pin more of the prefix ``[0, depth)``, which ends in ``node``."""
        if node.pins is None:
            node.pins = {}
        node.pins[depth] = node.pins.get(depth, 0) + 1
        self.pins += 1

    def unpin(self, node: PrefixNode, depth: int) -> bool:
        """One pin less of the prefix ``[0, depth)`` ending in ``node``; False (nothing
        changed) when it holds none."""
        if not node.pins or node.pins.get(depth, 0) == 0:
            return False
        node.pins[depth] -= 1
        if node.pins[depth] == 0:
            del node.pins[depth]
        self.pins -= 1
        return True

    def evictable_tokens(self, lent: Container[int | None], limit: int | None) -> int:
        """Tokens in subtrees that hold no pin and no leaf of ``lent``, and below the
        deepest pin of a pinned node whose subtree holds no other; counting stops at
        ``limit``."""
        total = 0
        blocked: set[int] = set()
        for node in reversed(list(self)):       # every child before its parent
            if id(node) in blocked or node.seq in lent:
                blocked.add(id(node.parent))
                continue
            if node.pins:                       # its tail below the deepest pin
                total += node.end - max(node.pins)
                blocked.add(id(node.parent))
            else:
                total += node.n_tokens
            if limit is not None and total >= limit:
                return limit
        return total

    def check_leaves(self) -> dict[int, PrefixNode]:
        """Asserts the structure (:meth:`check`), one sequence per leaf and none elsewhere,
        and the pins; returns the leaves by sequence."""
        self.check()
        assert self.root.seq is None and not self.root.pins
        seen: dict[int, PrefixNode] = {}
        pins = 0
        for node in self:
            assert (node.seq is None) == bool(node.children)
            if node.seq is not None:
                assert node.seq not in seen
                seen[node.seq] = node
            if node.pins:
                assert all(node.start < d <= node.end and c > 0 for d, c in node.pins.items())
                pins += sum(node.pins.values())
        assert pins == self.pins
        return seen
