"""A hypothesis state machine on the whole host cache: verbs, padded steps and the paged view
against the reference, with an "allocation fails" rule. A refused prepare_step (a failed
growth) must change nothing, and the retry must succeed."""

from __future__ import annotations

import os

import hypothesis.strategies as st
import numpy as np
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cellcache import CacheConfig, HostCellCache, LayerConfig, OutOfMemory, ReferenceTable
from cellcache.reference import mask_rows, paged_view

from .helpers import FailingAllocator, assert_same, state

EXAMPLES = max(20, int(os.environ.get("CELLCACHE_MACHINE_EXAMPLES", "1000")) // 5)


class CacheMachine(RuleBasedStateMachine):
    @initialize(capacity=st.sampled_from([5, 17, 64, 65, 130]), max_seqs=st.sampled_from([2, 5, 66]),
                initial=st.integers(1, 8), fmt=st.sampled_from(["bool", "bits", "none"]))
    def build(self, capacity, max_seqs, initial, fmt):
        self.alloc = FailingAllocator()
        cfg = CacheConfig(capacity=capacity, layers=[LayerConfig(1, 2, 0), LayerConfig(1, 2, 3)],
                          max_write=min(capacity, 9), initial_capacity=initial, dtype="float32",
                          max_seqs=max_seqs, paged=True, mask_format=fmt)
        self.cache = HostCellCache(cfg, allocator=self.alloc)
        self.ref = ReferenceTable(capacity, max_seqs, cfg.max_write)
        self.prepared = False

    def live(self):
        return self.ref.live_seqs()

    @rule()
    def seq_new(self):
        assert self.cache.seq_new() == self.ref.seq_new()

    @precondition(lambda self: self.live())
    @rule(pick=st.integers(0, 99), upto=st.one_of(st.none(), st.integers(0, 20)))
    def seq_clone(self, pick, upto):
        s = self.live()[pick % len(self.live())]
        assert self.cache.seq_clone(s, upto) == self.ref.seq_clone(s, upto)

    @precondition(lambda self: self.live())
    @rule(pick=st.integers(0, 99))
    def seq_rm(self, pick):
        s = self.live()[pick % len(self.live())]
        assert self.cache.seq_rm(s) == self.ref.seq_rm(s)

    @precondition(lambda self: self.live())
    @rule(pick=st.integers(0, 99), back=st.integers(0, 4))
    def rewind(self, pick, back):
        s = self.live()[pick % len(self.live())]
        p = max(0, self.ref.pos(s) - back)
        assert self.cache.rewind(s, p) == self.ref.rewind(s, p)

    @precondition(lambda self: self.live())
    @rule(picks=st.lists(st.integers(0, 99), min_size=1, max_size=9))
    def declare(self, picks):
        ids = [self.live()[p % len(self.live())] for p in picks][: self.ref.max_write]
        assert self.cache.declare_step(ids) == self.ref.declare_step(ids)

    @rule(k=st.integers(0, 3))
    def fail_an_allocation(self, k):
        self.alloc.fail_at = self.alloc.calls + k

    @precondition(lambda self: self.ref.declared is not None)
    @rule(extra=st.integers(0, 3))
    def prepare(self, extra):
        ids = list(self.ref.declared)
        w = len(ids)
        pad = min(self.cache.config.max_write, w + extra)
        before = state(self.cache)
        try:
            step = self.cache.prepare_step(pad_to=pad)
        except OutOfMemory:
            assert_same(state(self.cache), before)
            self.alloc.fail_at = None
            step = self.cache.prepare_step(pad_to=pad)
        self.alloc.fail_at = None
        cells, positions, read_len = self.ref.place()
        assert step.cells.tolist() == cells and step.positions.tolist() == positions
        assert step.read_len == read_len and self.cache.rows >= read_len
        b = self.cache.buffer
        assert b("cells")[w:pad].tolist() == [self.cache.sink] * (pad - w)
        for window in self.cache.config.windows if self.cache.config.mask_format != "none" else ():
            expect = np.array(mask_rows(self.ref.cell_pos, self.ref.cell_owners, ids, positions,
                                        read_len, window), bool).reshape(w, read_len)
            m = b(f"mask_w{window}")
            got = (m[0, 0, :w, :read_len] if m.dtype == np.bool_
                   else np.unpackbits(m[:w], axis=1, bitorder="little")[:, :read_len].astype(bool))
            assert (got == expect).all()
        qo, kv, indices, _ = paged_view(self.ref.cell_pos, self.ref.cell_owners, ids, positions,
                                        pad, self.cache.sink)
        assert b("qo_indptr")[:pad + 1].tolist() == qo and b("kv_indptr")[:pad + 1].tolist() == kv
        assert b("kv_indices")[:len(indices)].tolist() == indices
        self.prepared = True

    @precondition(lambda self: self.prepared)
    @rule()
    def commit(self):
        self.cache.commit_step()
        self.prepared = False

    @rule()
    def clear(self):
        self.cache.clear()
        self.ref.clear()
        self.prepared = False

    @invariant()
    def agree(self):
        if hasattr(self, "cache"):
            self.cache.check_invariants()
            assert self.cache.table.snapshot() == self.ref.snapshot()
            # exactly the current pools are held: growth released what it replaced
            assert self.alloc.live == (4 if self.cache.rows else 0)


CacheMachine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=30, deadline=None)
test_cache_machine = CacheMachine.TestCase
