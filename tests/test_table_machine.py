"""A hypothesis state machine: random verbs and steps through CellTable and the reference.

After every call the two must agree on the result (or raise the same error with the same
words), on the whole observable state, and on the masks of every placed step; the Cython
table's check_invariants() runs after every call too.
"""

from __future__ import annotations

import os

import hypothesis.strategies as st
import numpy as np
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cellcache import CellTable, ReferenceTable

from .helpers import mask_strings

EXAMPLES = int(os.environ.get("CELLCACHE_MACHINE_EXAMPLES", "1000"))
WINDOWS = [0, 1, 2, 3, 5]


def _normal(value):
    if isinstance(value, tuple):
        return tuple(_normal(v) for v in value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


class TableMachine(RuleBasedStateMachine):
    @initialize(
        capacity=st.integers(1, 48),
        max_seqs=st.sampled_from([1, 2, 3, 64, 65, 130]),
        write_frac=st.floats(0.05, 1.0),
    )
    def build(self, capacity, max_seqs, write_frac):
        max_write = max(1, int(capacity * write_frac))
        self.fast = CellTable(capacity, max_seqs, max_write)
        self.ref = ReferenceTable(capacity, max_seqs, max_write)
        self.max_seqs = max_seqs

    def both(self, call):
        """Calls ``call`` on both tables; asserts they return or raise the same."""
        outcomes = []
        for table in (self.fast, self.ref):
            try:
                outcomes.append(("ok", _normal(call(table))))
            except Exception as e:  # noqa: BLE001 - compared below
                outcomes.append(("raise", type(e), str(e)))
        assert outcomes[0] == outcomes[1], outcomes
        return outcomes[0]

    def seq(self, raw: int) -> int:
        # Mostly valid ids; max_seqs itself now and then, which both must refuse.
        return raw % (self.max_seqs + 1)

    @rule()
    def seq_new(self):
        self.both(lambda t: t.seq_new())

    @rule(raw=st.integers(0, 200), upto=st.one_of(st.none(), st.integers(-1, 40)))
    def seq_clone(self, raw, upto):
        s = self.seq(raw)
        self.both(lambda t: t.seq_clone(s, upto))

    @rule(raw=st.integers(0, 200))
    def seq_rm(self, raw):
        s = self.seq(raw)
        self.both(lambda t: t.seq_rm(s))

    @rule(raw=st.integers(0, 200), back=st.integers(-1, 6))
    def rewind(self, raw, back):
        s = self.seq(raw)
        if s < self.max_seqs:
            position = self.ref.pos(s) - back
        else:
            position = 0
        self.both(lambda t: t.rewind(s, position))

    @rule(raws=st.lists(st.integers(0, 200), min_size=0, max_size=12), live_only=st.booleans())
    def declare(self, raws, live_only):
        live = self.ref.live_seqs()
        if live_only and live:
            ids = [live[r % len(live)] for r in raws]
        else:
            ids = [self.seq(r) for r in raws]
        self.both(lambda t: t.declare_step(ids))

    @precondition(lambda self: self.ref.declared is not None)
    @rule(windows=st.lists(st.sampled_from(WINDOWS), min_size=1, max_size=3, unique=True),
          undo=st.booleans())
    def place(self, windows, undo):
        ids = list(self.ref.declared)
        outcome = self.both(lambda t: t.place())
        _, (cells, positions, read_len) = outcome
        for w in windows:
            assert mask_strings(self.fast, ids, positions, read_len, w) == mask_strings(
                self.ref, ids, positions, read_len, w)
        if undo:
            self.both(lambda t: t.undo_place())

    @rule()
    def undo_place(self):
        self.both(lambda t: t.undo_place())

    @rule()
    def clear(self):
        self.both(lambda t: t.clear())

    @invariant()
    def agree(self):
        if not hasattr(self, "fast"):
            return
        self.fast.check_invariants()
        assert self.fast.snapshot() == self.ref.snapshot()
        assert self.fast.used_count == self.ref.used_count


TableMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=40, deadline=None
)
test_table_machine = TableMachine.TestCase
