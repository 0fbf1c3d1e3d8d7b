"""A hypothesis state machine: random verbs and steps through CellTable and the reference.

After every call the two must agree on the result (or raise the same error with the same
words) and on the whole observable state; every placed step's masks (bool and bit-packed,
padded) and paged view must agree; the Cython table's change log must name every cell whose
pos or owners changed; check_invariants() runs after every call.

Capacities cross the free bitmap's 64-cell words and 4096-cell summary words: small random
ones, and 63, 64, 65, 129, 4097 and 8200 with most cells filled up front so that placement
and used_end searches must cross full words.
"""

from __future__ import annotations

import os

import hypothesis.strategies as st
import numpy as np
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cellcache import CellTable, ReferenceTable
from cellcache._views import fill_masks, fill_paged
from cellcache.reference import mask_rows, packed_rows, paged_view

EXAMPLES = int(os.environ.get("CELLCACHE_MACHINE_EXAMPLES", "1000"))
WINDOWS = [0, 1, 2, 3, 5]
BOUNDARY_CAPACITIES = [63, 64, 65, 129, 4097, 8200]


def _normal(value):
    if isinstance(value, tuple):
        return tuple(_normal(v) for v in value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def ref_state(t: ReferenceTable) -> tuple:
    """The reference's observable state in one pass over its cells."""
    pos = np.array(t.cell_pos, dtype=np.int64)
    words = np.zeros(((t.max_seqs + 63) // 64, t.capacity), dtype=np.uint64)
    seq_pos = [0] * t.max_seqs
    for c in np.flatnonzero(pos >= 0).tolist():
        for s in t.cell_owners[c]:
            words[s >> 6, c] |= np.uint64(1 << (s & 63))
            seq_pos[s] = max(seq_pos[s], t.cell_pos[c] + 1)
    used = np.flatnonzero(pos >= 0)
    used_end = int(used[-1]) + 1 if used.size else 0
    return pos, words, t.live_seqs(), used_end, int(t.capacity - used.size), seq_pos, t.declared


def fast_state(t: CellTable) -> tuple:
    t.check_invariants()
    return (t.positions_array(), t.owner_words_array(), t.live_seqs(), t.used_end, t.free_cells,
            [t.pos(s) for s in range(t.max_seqs)], t.declared)


def same_state(a: tuple, b: tuple) -> bool:
    return (np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
            and all(x == y for x, y in zip(a[2:], b[2:])))


class TableMachine(RuleBasedStateMachine):
    @initialize(
        small=st.integers(1, 48),
        boundary=st.one_of(st.none(), st.sampled_from(BOUNDARY_CAPACITIES)),
        max_seqs=st.sampled_from([1, 2, 3, 64, 65, 130]),
        write_frac=st.floats(0.05, 1.0),
        left_free=st.integers(0, 140),
    )
    def build(self, small, boundary, max_seqs, write_frac, left_free):
        capacity = small if boundary is None else boundary
        if capacity > 256:
            max_seqs = min(max_seqs, 65)
        max_write = max(1, int(capacity * write_frac))
        self.fast = CellTable(capacity, max_seqs, max_write, track_changes=True)
        self.ref = ReferenceTable(capacity, max_seqs, max_write)
        self.max_seqs = max_seqs
        if boundary is not None and max_seqs > 1:
            # a filler sequence takes all but left_free cells, in max_write steps, so the
            # free cells sit past full bitmap words (and full summary words at 4097, 8200)
            for t in (self.fast, self.ref):
                s = t.seq_new()
                left = capacity - min(capacity, left_free)
                while left > 0:
                    n = min(left, max_write)
                    assert t.declare_step([s] * n)
                    t.place()
                    left -= n
        self.fast.take_changes()
        self.last = ref_state(self.ref)

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
        position = self.ref.pos(s) - back if s < self.max_seqs else 0
        self.both(lambda t: t.rewind(s, position))

    @rule(raws=st.lists(st.integers(0, 200), min_size=0, max_size=12), live_only=st.booleans(),
          form=st.sampled_from(["list", "tuple", "int64", "int32", "iter"]))
    def declare(self, raws, live_only, form):
        live = self.ref.live_seqs()
        if live_only and live:
            ids = [live[r % len(live)] for r in raws]
        else:
            ids = [self.seq(r) for r in raws]

        def given():
            if form == "tuple":
                return tuple(ids)
            if form in ("int64", "int32"):
                return np.array(ids, dtype=form)
            if form == "iter":
                return iter(ids)
            return list(ids)

        self.both(lambda t: t.declare_step(given()))

    @precondition(lambda self: bool(self.ref.live_seqs()))
    @rule(pick=st.integers(0, 200))
    def declare_full_width(self, pick):
        """A whole max_write prefill of one sequence (as a numpy array)."""
        live = self.ref.live_seqs()
        s = live[pick % len(live)]
        ids = np.full(self.ref.max_write, s, dtype=np.int64)
        self.both(lambda t: t.declare_step(ids))

    @precondition(lambda self: self.ref.declared is not None)
    @rule(windows=st.lists(st.sampled_from(WINDOWS), min_size=1, max_size=3, unique=True),
          undo=st.booleans(), extra_pad=st.integers(0, 3), data=st.data())
    def place(self, windows, undo, extra_pad, data):
        ids = list(self.ref.declared)
        self.both(lambda t: t.step_kv_entries())
        _, (cells, positions, read_len) = self.both(lambda t: t.place())
        width = len(ids)
        pad = min(self.fast.max_write, width + extra_pad)
        rows = sorted({0, width - 1, *data.draw(st.lists(st.integers(0, width - 1), max_size=4))})
        sids = np.array(ids, np.int64)
        pos = np.array(positions, np.int64)
        for w in windows:
            expect = mask_rows(self.ref.cell_pos, self.ref.cell_owners, [ids[r] for r in rows],
                               [positions[r] for r in rows], read_len, w)
            out = np.full((pad, max(read_len, 1)), 7, np.uint8)
            fill_masks(self.fast, sids, pos, read_len, [w], [out], pad_to=pad)
            assert out[rows, :read_len].astype(bool).tolist() == expect
            assert (out[width:pad, :read_len] == out[0, :read_len]).all()
            nbytes = (read_len + 7) // 8
            bits = np.full((pad, max(nbytes, 1)), 0xA5, np.uint8)
            fill_masks(self.fast, sids, pos, read_len, [w], [bits], pad_to=pad, bits=True)
            assert [bytes(bits[r, :nbytes]) for r in rows] == packed_rows(expect)
            assert (bits[width:pad, :nbytes] == bits[0, :nbytes]).all()
        sink = self.fast.capacity
        qo, kv, indices, runs = paged_view(self.ref.cell_pos, self.ref.cell_owners, ids,
                                           positions, pad, sink)
        qo_f, kv_f = np.zeros(pad + 1, np.int32), np.zeros(pad + 1, np.int32)
        idx_f = np.full(len(indices) + 1, -9, np.int32)
        got = fill_paged(self.fast, sids, pos, pad, sink, qo_f, kv_f, idx_f)
        assert got == (runs, len(indices))
        assert qo_f.tolist() == qo and kv_f.tolist() == kv
        assert idx_f[:len(indices)].tolist() == indices and idx_f[len(indices)] == -9
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
        now = ref_state(self.ref)
        assert same_state(fast_state(self.fast), now)
        # every cell whose pos or owners changed since the last look is in the change log
        changed = np.flatnonzero((now[0] != self.last[0]) | (now[1] != self.last[1]).any(axis=0))
        logged = set(self.fast.take_changes().tolist())
        assert set(changed.tolist()) <= logged, sorted(set(changed.tolist()) - logged)
        self.last = now


TableMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=40, deadline=None
)
test_table_machine = TableMachine.TestCase
