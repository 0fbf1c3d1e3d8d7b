"""One radix tree over int32 token bytes, shared by the prefix cache
(:class:`cellcache.prefix.PrefixCache`, whose nodes carry sequences, pins and eviction
keys) and the prompts admission is reading (:class:`PendingPrompts`, whose nodes carry
counts).

::

    added: a b c d e f,  a b c d x y,  a b z

    root
     └─ [a b]              a node holds the tokens of positions [start, end) under its
         ├─ [c d]          parent, keyed there by its first token's 4 bytes
         │   ├─ [e f]
         │   └─ [x y]
         └─ [z]

    walk(a b c d x q)  -> ([x y], 5): the longest common prefix with any path is 5
                          tokens, ending 1 token into [x y]
    split([x y], 5)    -> [c d] ─ [x] ─ [y]: the upper part [x] is returned
    cut([z])           -> [a b] keeps [c d] alone (nodes are not merged back)

A node keeps its tokens as bytes (``segb``) and, made once when first needed, as a
read-only int32 array over them (``seg``); a walk costs a dict probe and a
``bytes.startswith`` per node, and numpy only at the node where the match ends, not Python
work per token. Keys are the int32 bytes of token ids
(``np.asarray(tokens, np.int32).tobytes()``). The tree counts its nodes (the root aside)
and the tokens they hold.
"""

from __future__ import annotations

import array
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

import numpy as np

from .errors import InvalidArgument

__all__ = ["PendingPrompts", "PromptNode", "RadixNode", "RadixTree", "as_tokens"]

_I32 = np.dtype(np.int32)
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1


def as_tokens(tokens: object, name: str = "tokens") -> np.ndarray:
    """``tokens`` (token ids: a list, tuple, range or 1-D integer array) as a 1-D int32
    array, the tree's keys once ``tobytes()``; no copy for an int32 array. Raises
    InvalidArgument for anything else, or ids outside ``[-2**31, 2**31)``."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise InvalidArgument(
                f"{name} is a {tokens.ndim}-D array of {tokens.dtype}; give a 1-D integer array "
                "or a list of ints")
        if tokens.dtype == _I32:
            return tokens
        if tokens.size and (int(tokens.min()) < _I32_MIN or int(tokens.max()) > _I32_MAX):
            raise InvalidArgument(f"{name} has ids outside [-2**31, 2**31); token ids are int32")
        return tokens.astype(_I32)
    if not isinstance(tokens, (list, tuple, range)):
        raise InvalidArgument(
            f"{name} of type {type(tokens).__name__} is not a sequence of token ids; give a "
            "list, tuple, range or 1-D integer array")
    if len(tokens) == 0:
        return np.zeros(0, _I32)
    if bool in set(map(type, tokens)):                # (array.array takes True as 1)
        raise InvalidArgument(f"{name} holds a bool; token ids are ints, as everywhere in cellcache")
    try:
        arr = np.frombuffer(array.array("q", tokens), np.int64)   # refuses floats, strings, np.bool_
    except (OverflowError, TypeError):
        raise InvalidArgument(
            f"{name} must be a flat sequence of int token ids in [-2**31, 2**31)") from None
    if int(arr.min()) < _I32_MIN or int(arr.max()) > _I32_MAX:
        raise InvalidArgument(f"{name} has ids outside [-2**31, 2**31); token ids are int32")
    return arr.astype(_I32)


class RadixNode:
    """A node of a :class:`RadixTree`: the tokens of positions ``[start, end)`` under its
    ``parent`` (None for the root, which holds none), ``children`` keyed by the first
    token's 4 bytes. Kinds of node that carry more subclass it and override :meth:`head`."""

    __slots__ = ("_view", "children", "end", "parent", "segb", "start")

    def __init__(self, segb: bytes, start: int, parent: Any):
        self.segb = segb                                 # the tokens as int32 bytes
        self._view: np.ndarray | None = None             # seg, made when first needed
        self.start = start
        self.end = start + (len(segb) >> 2)
        self.parent = parent
        self.children: dict[bytes, Any] = {}             # first token's 4 bytes -> child

    @property
    def seg(self) -> np.ndarray:
        """The tokens as a read-only int32 array (a view of ``segb``, no copy)."""
        v = self._view
        if v is None:
            v = self._view = np.frombuffer(self.segb, _I32)
        return v

    @property
    def n_tokens(self) -> int:
        return self.end - self.start

    def path(self) -> np.ndarray:
        """The tokens of positions ``[0, end)``, a new int32 array."""
        parts = []
        node = self
        while node is not None and node.end > 0:
            parts.append(node.segb)
            node = node.parent
        return np.frombuffer(b"".join(reversed(parts)), _I32)

    def line(self) -> set:
        """This node and every node above it, the root included."""
        out = set()
        node = self
        while node is not None:
            out.add(node)
            node = node.parent
        return out

    def trim(self, m: int) -> None:
        """Drops positions ``[start, m)`` (``start < m < end``): the node keeps ``[m, end)``."""
        self.segb = self.segb[4 * (m - self.start):]
        self._view = None
        self.start = m

    def head(self, m: int) -> RadixNode:
        """A new node of this kind for positions ``[start, m)`` of this one (``start < m <
        end``), carrying what it carries: what :meth:`RadixTree.split` links above it.
        Not yet linked; its parent is this node's."""
        return RadixNode(self.segb[:4 * (m - self.start)], self.start, self.parent)


N = TypeVar("N", bound=RadixNode)


class RadixTree(Generic[N]):
    """The structure over nodes of one kind: longest match, split, link, unlink. ``nodes``
    and ``tokens`` count the nodes under the root and the tokens they hold."""

    __slots__ = ("nodes", "root", "tokens")

    def __init__(self, root: N):
        assert root.end == 0 and root.parent is None and not root.children
        self.root = root
        self.nodes = 0
        self.tokens = 0

    def walk(self, qb: bytes) -> tuple[N, int]:
        """The node holding the longest common prefix of the query (int32 bytes ``qb``)
        with any path, and its length n in tokens: ``node.start < n <= node.end``, or
        ``(root, 0)``."""
        node: Any = self.root
        nq = len(qb) >> 2
        d = 0
        while d < nq:
            b = 4 * d
            child = node.children.get(qb[b:b + 4])
            if child is None:
                return node, d
            if qb.startswith(child.segb, b):
                node = child
                d = child.end
                continue
            # the match ends in this node: where the query ends, or at the first difference
            m = child.end - child.start
            if nq - d < m:
                if child.segb.startswith(qb[b:]):
                    return child, nq
                m = nq - d
            # a difference lies in the first m tokens, so argmin finds the first False
            eq = np.frombuffer(qb, _I32, m, b) == child.seg[:m]
            return child, d + int(eq.argmin())
        return node, d

    def split(self, node: N, m: int) -> N:
        """Cuts ``node`` at position m (``start < m < end``): its :meth:`~RadixNode.head`
        takes its place under the parent, the node keeps ``[m, end)`` below it. Returns the
        upper part."""
        upper: Any = node.head(m)
        node.parent.children[node.segb[:4]] = upper
        node.trim(m)
        node.parent = upper
        upper.children[node.segb[:4]] = node
        self.nodes += 1
        return upper

    def add(self, node: N) -> N:
        """Links a new node (no children yet) under its ``parent``, where it starts
        (``node.start == parent.end``) and no child starts with its first token. Returns
        it."""
        node.parent.children[node.segb[:4]] = node
        self.nodes += 1
        self.tokens += node.end - node.start
        return node

    def cut(self, node: N) -> None:
        """Unlinks ``node``, and the nodes under it, from its parent (``node.parent`` becomes
        None)."""
        del node.parent.children[node.segb[:4]]
        node.parent = None
        if node.children:
            gone = [node, *_below(node)]
            self.nodes -= len(gone)
            self.tokens -= sum(x.end - x.start for x in gone)
        else:
            self.nodes -= 1
            self.tokens -= node.end - node.start

    def __iter__(self) -> Iterator[N]:
        """Every node but the root, each before the nodes under it."""
        return _below(self.root)

    def check(self) -> None:
        """Asserts the structure (links, positions, keys) and the counts."""
        nodes = tokens = 0
        assert self.root.parent is None and self.root.end == 0
        for node in self:
            parent = node.parent
            assert parent is not None and parent.children.get(node.segb[:4]) is node
            assert node.start == parent.end and node.end > node.start
            assert len(node.segb) == 4 * (node.end - node.start)
            nodes += 1
            tokens += node.end - node.start
        assert nodes == self.nodes and tokens == self.tokens, (nodes, self.nodes, tokens, self.tokens)


def _below(node: Any) -> Iterator[Any]:
    """The nodes under ``node``, each before the nodes under it."""
    stack = list(node.children.values())
    while stack:
        x = stack.pop()
        yield x
        stack.extend(x.children.values())


class PromptNode(RadixNode):
    """A node of :class:`PendingPrompts`: ``count`` prompts run through it."""

    __slots__ = ("count",)

    def __init__(self, segb: bytes, start: int, parent: PromptNode | None, count: int = 0):
        self.segb = segb                    # (RadixNode's fields set here: one call less
        self._view = None                   # for a node made on every admission)
        self.start = start
        self.end = start + (len(segb) >> 2)
        self.parent = parent
        self.children: dict[bytes, PromptNode] = {}
        self.count = count

    def head(self, m: int) -> PromptNode:
        return PromptNode(self.segb[:4 * (m - self.start)], self.start, self.parent, self.count)


class PendingPrompts:
    """Prompts being read (admitted, not yet stored in the prefix cache), as a radix tree of
    int32 token bytes with a count per node: :meth:`lcp` is the longest common prefix of a
    query with any of them. Admission defers a prompt that shares more with one being read
    than with the prefix cache: it is admitted once that one is stored, and reads only what
    it does not share (so a shared prefix is computed once, even by requests that arrive
    together).

    Example
    -------
    >>> import numpy as np
    >>> pending = PendingPrompts()
    >>> pending.add(np.array([1, 2, 3, 4], np.int32).tobytes())
    >>> pending.lcp(np.array([1, 2, 9], np.int32).tobytes()), pending.size
    (2, 1)
    """

    __slots__ = ("size", "tree")

    def __init__(self) -> None:
        self.tree: RadixTree[PromptNode] = RadixTree(PromptNode(b"", 0, None))
        self.size = 0                                    # prompts added and not removed

    def add(self, qb: bytes) -> None:
        """Adds a prompt (its int32 bytes); the same prompt may be added more than once."""
        tree = self.tree
        node, m = tree.walk(qb)
        if m < node.end:
            node = tree.split(node, m)
        if 4 * m < len(qb):
            node = tree.add(PromptNode(qb[4 * m:], m, node))
        x: PromptNode | None = node
        while x is not None:
            x.count += 1
            x = x.parent
        self.size += 1

    def remove(self, qb: bytes) -> None:
        """Removes one of the prompts added as ``qb``: nodes no prompt runs through any more
        leave the tree."""
        node = self.tree.root
        node.count -= 1
        self.size -= 1
        b, nb = 0, len(qb)
        while b < nb:                        # by keys alone: qb is a path of the tree
            node = node.children[qb[b:b + 4]]
            node.count -= 1
            if node.count == 0:
                self.tree.cut(node)
                return
            b = 4 * node.end

    def lcp(self, qb: bytes) -> int:
        """The longest common prefix, in tokens, of ``qb`` with any prompt added and not
        removed (0 when there is none)."""
        return self.tree.walk(qb)[1]
