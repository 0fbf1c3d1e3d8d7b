"""Radix trees over int32 token bytes."""

from __future__ import annotations

import numpy as np

__all__ = ["PendingPrompts"]

_I32 = np.dtype(np.int32)


class PendingPrompts:
    """Prompts being read (admitted, not yet stored in the prefix cache), as a radix tree of
    int32 token bytes with a count per node: :meth:`lcp` is the longest common prefix of a
    query with any of them. Admission defers a prompt that shares more with one being read
    than with the prefix cache: it is admitted once that one is stored, and reads only what
    it does not share (so a shared prefix is computed once, even by requests that arrive
    together)."""

    __slots__ = ("root", "size")

    def __init__(self) -> None:
        self.root: list = [b"", {}, 0]       # [segment bytes, children by first 4 bytes, count]
        self.size = 0

    @staticmethod
    def _common(seg: bytes, qb: bytes, b: int) -> int:
        """Bytes (a multiple of 4) that seg shares with qb from offset b."""
        if qb.startswith(seg, b):
            return len(seg)
        m = min(len(seg), len(qb) - b) // 4
        eq = np.frombuffer(seg, _I32, m) == np.frombuffer(qb, _I32, m, b)
        return 4 * (m if eq.all() else int(eq.argmin()))

    def add(self, qb: bytes) -> None:
        node = self.root
        node[2] += 1
        self.size += 1
        b = 0
        while b < len(qb):
            key = qb[b:b + 4]
            child = node[1].get(key)
            if child is None:
                node[1][key] = [qb[b:], {}, 1]
                return
            k = self._common(child[0], qb, b)
            if k < len(child[0]):                     # split the child at k
                seg = child[0]
                upper = [seg[:k], {seg[k:k + 4]: child}, child[2]]
                child[0] = seg[k:]
                node[1][key] = upper
                child = upper
            child[2] += 1
            node = child
            b += k

    def remove(self, qb: bytes) -> None:
        node = self.root
        node[2] -= 1
        self.size -= 1
        b = 0
        while b < len(qb):
            key = qb[b:b + 4]
            child = node[1][key]
            child[2] -= 1
            if child[2] == 0:
                del node[1][key]
                return
            node = child
            b += len(child[0])

    def lcp(self, qb: bytes) -> int:
        node, b = self.root, 0
        while b < len(qb):
            child = node[1].get(qb[b:b + 4])
            if child is None:
                break
            k = self._common(child[0], qb, b)
            b += k
            if k < len(child[0]):
                break
            node = child
        return b // 4
