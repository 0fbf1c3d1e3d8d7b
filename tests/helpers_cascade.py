"""Sequences that share prefixes, for the shared-prefix attention tests (host and GPU)."""

from __future__ import annotations

import numpy as np


class Families:
    """Roots and forks of them on a cell table, their tokens placed in interleaved chunks
    (so that cells spread out): ``new(n)``, ``forks(src, k, own=, upto=)``, ``grow``."""

    def __init__(self, table, rng: np.random.Generator, chunk: int = 90):
        self.t, self.rng, self.chunk = table, rng, chunk

    def grow(self, seqs, lens) -> None:
        """``lens`` tokens (one number, or one a sequence) for each of ``seqs``."""
        left = dict(zip(seqs, (int(n) for n in np.broadcast_to(lens, len(seqs)))))
        while any(left.values()):
            for s in self.rng.permutation(list(left)):
                k = int(min(left[s], self.rng.integers(1, self.chunk)))
                if k:
                    assert self.t.declare_step([int(s)] * k)
                    self.t.place()
                    left[s] -= k

    def new(self, n: int) -> int:
        s = self.t.seq_new()
        self.grow([s], n)
        return s

    def forks(self, src: int, k: int, own=(1, 60), upto: int | None = None) -> list[int]:
        """k clones of ``src`` (to ``upto``), each given its own tokens, uniform in ``own``."""
        out = [self.t.seq_clone(src, upto=upto) for _ in range(k)]
        assert None not in out
        self.grow(out, self.rng.integers(own[0], own[1] + 1, size=k))
        return out
