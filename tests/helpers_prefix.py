"""What the prefix cache's tests share: a host cache, the caller's side of it (``World``), and
the whole observable state of a prefix cache (``state``, ``assert_same``).

The cache stores no token ids, so the tests keep the truth: ``World.cell_token[c]`` is the
token a step wrote into cell c. "A sequence holds tokens" means: for every position q, the
cell at q (the table's position map) has ``pos == q`` and was written with ``tokens[q]``.
"""

from __future__ import annotations

import numpy as np

from cellcache import CacheConfig, LayerConfig, PrefixCache, build
from cellcache.prefix import PrefixEvent


def make_cache(capacity=256, max_seqs=16, max_write=16):
    return build("host", "batched", CacheConfig(
        capacity=capacity, layers=[LayerConfig(1, 2)], max_write=max_write, max_seqs=max_seqs,
        dtype="float32", mask_format="none", initial_capacity=capacity))


class World:
    """The caller's side: sequences it owns, their tokens, and which token each cell holds."""

    def __init__(self, cache):
        self.cache = cache
        self.cell_token: dict[int, int] = {}
        self.tokens: dict[int, list[int]] = {}   # caller sequence -> its tokens

    def write(self, seq: int, toks, evict_with=None) -> int:
        """Writes toks after seq's tokens in steps of max_write; where cells run short asks
        ``evict_with`` (a PrefixCache) first. Returns how many tokens were written."""
        toks = list(toks)
        done = 0
        mw = self.cache.config.max_write
        while done < len(toks):
            k = min(mw, len(toks) - done)
            if not self.cache.declare_step([seq] * k):
                if evict_with is not None:
                    evict_with.evict(k - self.cache.free_cells)
                if not self.cache.declare_step([seq] * k):
                    break
            step = self.cache.prepare_step()
            self.cache.commit_step()
            start = int(step.positions[0])
            assert start == len(self.tokens.get(seq, ()))      # positions continue seq
            for c, q in zip(step.cells.tolist(), step.positions.tolist()):
                self.cell_token[c] = toks[done + q - start]
            self.tokens.setdefault(seq, []).extend(toks[done:done + k])
            done += k
        return done

    def adopt(self, seq: int, toks) -> None:
        """seq (from PrefixCache.match) holds toks already."""
        self.tokens[seq] = list(toks)

    def new(self, toks, evict_with=None) -> int | None:
        s = self.cache.seq_new()
        if s is None:
            return None
        self.tokens[s] = []
        self.write(s, toks, evict_with)
        return s

    def holds(self, seq: int, toks) -> None:
        """seq's positions [0, len(toks)) are cells written with toks, at those positions."""
        table = self.cache.table
        cell_pos = table.positions_array()
        for q, tok in enumerate(toks):
            c = table.seq_cell_at(seq, q)
            assert c >= 0, (seq, q)
            assert cell_pos[c] == q, (seq, q, c, cell_pos[c])
            assert self.cell_token[c] == tok, (seq, q, c, self.cell_token[c], tok)

    def snapshot(self) -> dict:
        """Every caller sequence's length and cells in position order."""
        table = self.cache.table
        return {s: (self.cache.pos(s), [table.seq_cell_at(s, q) for q in range(self.cache.pos(s))])
                for s in self.tokens}


def state(prefix: PrefixCache) -> tuple:
    """The whole observable state of a prefix cache and its cache."""
    return (prefix.prefixes(), prefix.metrics(), prefix.cache.table.snapshot(),
            prefix.cache.live_seqs())


def assert_same(a, b) -> None:
    pa, ma, ta, la = a
    pb, mb, tb, lb = b
    assert pa == pb and ma == mb and la == lb
    assert ta.keys() == tb.keys()
    for k in ta:
        va, vb = ta[k], tb[k]
        if isinstance(va, np.ndarray):
            np.testing.assert_array_equal(va, vb)
        else:
            assert va == vb, k


def setup(tree_seqs=None, **kw):
    cache = make_cache(**kw)
    events: list[PrefixEvent] = []
    prefix = PrefixCache(cache, max_seqs=tree_seqs, on_event=events.append)
    return cache, prefix, World(cache), events
