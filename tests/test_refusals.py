"""Every refusal of the table: the library's own error (or False / None) and nothing changed.

Includes the inputs a probe of the public API found leaking builtin errors, being accepted as
garbage, or (with hostile callbacks) leaving the table inconsistent.
"""

import array
import itertools

import numpy as np
import pytest

from cellcache import CellTable, InvalidArgument, InvalidState, OutOfMemory, ReferenceTable
from cellcache._views import fill_masks, fill_paged

from .helpers import TABLES, make, snapshot, step

BAD_IDS = [
    (-1, "outside \\[0, max_seqs=4\\)"),
    (4, "outside \\[0, max_seqs=4\\)"),
    (2**70, "outside"),
    (1.0, "of type float is not an int"),
    ("1", "of type str is not an int"),
    (True, "of type bool is not an int"),
    (None, "of type NoneType is not an int"),
    (np.array([0]), "of type ndarray is not an int"),
    (np.float64(1), "of type float64 is not an int"),
]


@pytest.fixture(params=TABLES, ids=lambda c: c.__name__)
def busy(request):
    """A table with some state: two live sequences, a fork, a hole, a declaration."""
    t = make(request.param, 12, max_seqs=4, max_write=4)
    a, b = t.seq_new(), t.seq_new()
    step(t, [a, a, b, b])
    t.seq_clone(a, upto=1)
    t.rewind(b, 1)
    assert t.declare_step([a, b]) is True
    return t


@pytest.mark.parametrize("bad,match", BAD_IDS)
@pytest.mark.parametrize("verb,declares", [
    (lambda t, s: t.seq_clone(s), False),
    (lambda t, s: t.seq_rm(s), False),
    (lambda t, s: t.rewind(s, 0), False),
    (lambda t, s: t.pos(s), False),
    (lambda t, s: t.seq_len(s), False),
    (lambda t, s: t.declare_step([0, s]), True),
], ids=["seq_clone", "seq_rm", "rewind", "pos", "seq_len", "declare_step"])
def test_bad_sequence_id(busy, verb, declares, bad, match):
    before = snapshot(busy)
    with pytest.raises(InvalidArgument, match=match):
        verb(busy, bad)
    if declares:
        before["declared"] = None              # every declare_step first drops the old one
    assert snapshot(busy) == before


def test_numpy_and_sequence_ids_are_accepted(busy):
    assert busy.pos(np.int64(0)) == busy.pos(0)
    for ids in (np.array([0, 1], dtype=np.int32), np.array([0, 1], dtype=np.int64),
                np.array([0, 1], dtype=np.uint8), (0, 1), range(2), iter([0, 1]),
                array.array("q", [0, 1]), [np.int64(0), np.int32(1)]):
        assert busy.declare_step(ids) is True
        assert busy.declared == [0, 1]


NOT_IDS = [
    (5, "seq_ids of type int is not a sequence of ids"),
    (np.int64(0), "seq_ids of type int64 is not a sequence of ids"),
    (np.array(0), "seq_ids is a 0-D array of int64"),
    (np.zeros((2, 2), np.int64), "seq_ids is a 2-D array of int64"),
    (np.array([0.0, 1.0]), "seq_ids is a 1-D array of float64"),
    (np.array([True, False]), "seq_ids is a 1-D array of bool"),
    (b"\x00\x00", "seq_ids of type bytes is not a sequence of ids"),
    (bytearray(b"\x00"), "seq_ids of type bytearray is not a sequence of ids"),
    ("01", "seq_ids of type str is not a sequence of ids"),
    ({0: 1}, "seq_ids of type dict is not a sequence of ids"),
    ({0, 1}, "seq_ids of type set is not a sequence of ids"),
    (None, "seq_ids of type NoneType is not a sequence of ids"),
    ([], "a step needs at least one token; got none"),
    ([0] * 5, "a step of 5 tokens is wider than max_write=4"),
    (itertools.repeat(0), "a step of more than 4 tokens is wider than max_write=4"),
    ([0, 1.5], "sequence id of type float is not an int"),
]


@pytest.mark.parametrize("ids,match", NOT_IDS, ids=[repr(i)[:24] for i, _ in NOT_IDS])
def test_declare_refuses_what_is_not_a_step(busy, ids, match):
    before = snapshot(busy)
    with pytest.raises(InvalidArgument, match=match):
        busy.declare_step(ids)
    before["declared"] = None
    assert snapshot(busy) == before


def test_declare_reads_at_most_max_write_plus_one_items():
    consumed = []

    def ids():
        for k in itertools.count():
            consumed.append(k)
            yield 0

    t = CellTable(8, 2, 4)
    t.seq_new()
    with pytest.raises(InvalidArgument, match="more than 4 tokens"):
        t.declare_step(ids())
    assert len(consumed) == 5


@pytest.mark.parametrize("ids,exc,match", [
    ([0, 3], InvalidState, "sequence 3 is not live; call seq_new"),
])
def test_declare_refusals_declare_nothing(busy, ids, exc, match):
    before = snapshot(busy)
    with pytest.raises(exc, match=match):
        busy.declare_step(ids)
    before["declared"] = None
    assert snapshot(busy) == before
    with pytest.raises(InvalidState, match="no step is declared"):
        busy.place()
    assert snapshot(busy) == before


class Hostile:
    """An id whose __index__ runs table verbs from inside the call it is an argument of."""

    def __init__(self, table, value, action):
        self.table, self.value, self.action = table, value, action

    def __index__(self):
        self.action(self.table)
        return self.value


@pytest.mark.parametrize("action", [
    lambda t: t.declare_step([1, 1]),
    lambda t: t.seq_rm(1),
    lambda t: t.rewind(0, 0),
    lambda t: t.clear(),
], ids=["declare", "seq_rm", "rewind", "clear"])
def test_reentrant_callbacks_leave_a_consistent_table(action):
    """Caller code runs before the call changes anything, so whatever it does, the table's
    invariants hold and the outcome is that of the outer call on the state it left."""
    for cls in TABLES:
        t = make(cls, 16, max_seqs=4, max_write=4)
        a, b = t.seq_new(), t.seq_new()
        step(t, [a, b, a])
        try:
            t.declare_step([a, Hostile(t, b, action)])
        except (InvalidState, InvalidArgument):
            pass
        snapshot(t)                          # check_invariants on the Cython table
        try:
            t.declare_step([Hostile(t, a, action)])
        except InvalidState:                 # the callback released the id
            assert a not in t.live_seqs()
        snapshot(t)


def test_declare_returns_false_when_cells_are_short():
    for cls in TABLES:
        t = make(cls, 4, max_write=4)
        a = t.seq_new()
        step(t, [a, a])
        assert t.declare_step([a]) is True
        before = snapshot(t)
        assert t.declare_step([a, a, a]) is False
        before["declared"] = None
        assert snapshot(t) == before
        assert t.declare_step([a, a]) is True


def test_place_without_declaration(busy):
    busy.place()
    before = snapshot(busy)
    with pytest.raises(InvalidState, match="declare_step"):
        busy.place()
    assert snapshot(busy) == before


def test_undo_without_place(busy):
    before = snapshot(busy)
    with pytest.raises(InvalidState, match="nothing was placed"):
        busy.undo_place()
    assert snapshot(busy) == before


def test_clone_bad_upto(busy):
    before = snapshot(busy)
    for bad, match in ((-1, "upto=-1 is outside"), (1.5, "upto of type float"),
                       ("2", "upto of type str"), (True, "upto of type bool")):
        with pytest.raises(InvalidArgument, match=match):
            busy.seq_clone(0, upto=bad)
    assert snapshot(busy) == before


def test_rewind_outside_the_sequence_returns_false(busy):
    before = snapshot(busy)
    for position in (-1, busy.pos(0) + 1, 2**63, 2**80, -(2**80)):
        assert busy.rewind(0, position) is False
    assert snapshot(busy) == before
    with pytest.raises(InvalidArgument, match="position of type float"):
        busy.rewind(0, 1.0)
    assert snapshot(busy) == before


@pytest.mark.parametrize("cls", TABLES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("args,match", [
    ((0, 4, None), "capacity=0 is outside"),
    ((-5, 4, None), "capacity=-5 is outside"),
    ((8, 0, None), "max_seqs=0 is outside"),
    ((8, 4, 0), "max_write=0 is outside \\[1, 8\\]"),
    ((8, 4, 9), "max_write=9 is outside \\[1, 8\\]"),
    ((8.0, 4, None), "capacity of type float is not an int"),
    ((2**41, 4, None), "capacity=2199023255552 is outside"),
])
def test_bad_table_shape(cls, args, match):
    with pytest.raises(InvalidArgument, match=match):
        cls(*args)


def test_a_table_that_failed_to_build_does_not_exist():
    with pytest.raises(OutOfMemory, match="could not allocate"):
        CellTable(2**40, 2**20, 4)            # the owner bitsets alone: 2**54 bytes
    t = CellTable(8, 2, 4)
    t.__init__(16, 2, 4)                      # a second __init__ changes nothing
    assert t.capacity == 8
    t.check_invariants()


def test_cell_table_fill_masks_refusals():
    t = CellTable(8, 4)
    a = t.seq_new()
    step(t, [a, a, a])
    ids = np.array([a, a], dtype=np.int64)
    pos = np.array([1, 2], dtype=np.int64)
    out = np.ones((2, 8), dtype=np.bool_)
    for args, match in [
        ((ids, pos, 3, [0], [np.zeros((1, 8), np.bool_)]), "cannot hold"),
        ((ids, pos, 9, [0], [out]), "read_len=9 is outside"),
        ((ids, pos[:1], 3, [0], [out]), "positions has 1"),
        ((ids, pos, 3, [-1], [out]), "window=-1"),
        ((ids, pos, 3, [0, 1], [out]), "2 windows but 1"),
        ((np.array([a, 9], dtype=np.int64), pos, 3, [0], [out]), "outside \\[0, max_seqs=4\\)"),
        (([a, a], pos, 3, [0], [out]), "seq_ids must be a contiguous 1-D int64 array"),
        ((ids.astype(np.int32), pos, 3, [0], [out]), "seq_ids must be"),
        ((ids, pos, 3, [0], [out.astype(np.float32)]), "outs\\[0\\] must be"),
        ((ids, pos, 3, [0], [out[:, ::2]]), "outs\\[0\\] must be"),
        ((ids, pos, 3, 0, [out]), "lists"),
        ((ids, pos, 3, [0], [out], 1), "pad_to=1 is outside"),
    ]:
        with pytest.raises(InvalidArgument, match=match):
            fill_masks(t, *args)
    assert out.all()                           # nothing written by a refused fill


def test_place_into_refusals():
    t = CellTable(8, 4)
    a = t.seq_new()
    t.declare_step([a, a])
    before = snapshot(t)
    good = np.zeros(2, np.int64)
    for cells, positions, match in [
        (np.zeros(1, np.int64), good, "fewer entries"),
        (np.zeros(2, np.int32), good, "cells must be a writable"),
        ([0, 0], good, "cells must be"),
        (good, np.zeros((2, 1), np.int64), "positions must be"),
        (np.zeros(4, np.int64)[::2], good, "cells must be"),
    ]:
        with pytest.raises(InvalidArgument, match=match):
            t.place_into(cells, positions)
    ro = np.zeros(2, np.int64)
    ro.flags.writeable = False
    with pytest.raises(InvalidArgument, match="cells must be a writable"):
        t.place_into(ro, good)
    assert snapshot(t) == before


def test_place_into_reads_the_declaration_after_the_outputs_resolve():
    """An output whose resolution runs caller code (an ndarray subclass's property) that
    declares a wider step: the width is the one declared when placement starts, so the
    wider step is refused as too wide for the outputs, nothing placed (it used to place 8
    entries into a 1-entry array and crash the interpreter later)."""
    width = 8
    t = CellTable(width, max_seqs=4, max_write=width)
    a = t.seq_new()
    assert t.declare_step([a])

    class Redeclares(np.ndarray):
        fired = False

        @property
        def dtype(self):
            if not Redeclares.fired:
                Redeclares.fired = True
                assert t.declare_step([a] * width)
            return np.ndarray.dtype.__get__(self)

    cells = np.zeros(1, np.int64).view(Redeclares)
    before = snapshot(t)
    before["declared"] = [a] * width            # what the callback declared
    with pytest.raises(InvalidArgument, match="fewer entries than the declared step's 8"):
        t.place_into(cells, np.zeros(1, np.int64))
    assert Redeclares.fired and snapshot(t) == before
    assert t.place_into(np.zeros(width, np.int64), np.zeros(width, np.int64)) == width


@pytest.mark.parametrize("table", TABLES, ids=lambda c: c.__name__)
def test_declare_step_takes_strided_and_broadcast_int64_arrays(table):
    """A non-contiguous int64 vector is a sequence of ids like any other (the Cython table's
    fast path used to raise numpy's ValueError for it)."""
    t = make(table, 16, max_seqs=4, max_write=8)
    a, b = t.seq_new(), t.seq_new()
    assert t.declare_step(np.array([a, 9, b, 9], np.int64)[::2])
    assert t.declared == [a, b]
    assert t.declare_step(np.broadcast_to(np.int64(a), (3,)))
    assert t.declared == [a, a, a]
    before = snapshot(t)
    before["declared"] = None                    # every declare_step first drops the old one
    with pytest.raises(InvalidArgument, match="outside"):
        t.declare_step(np.array([a, 0, 7, 0], np.int64)[::2])
    assert snapshot(t) == before


def test_cell_address_refusals():
    t = CellTable(8, 4)
    for c, match in [(8, "cell=8 is outside"), (-1, "cell=-1 is outside"),
                     (2**64, "cell=18446744073709551616 is outside"),
                     (True, "cell of type bool"), (1.0, "cell of type float")]:
        with pytest.raises(InvalidArgument, match=match):
            t.cell_pos_at(c)
        with pytest.raises(InvalidArgument, match=match):
            t.cell_owners_at(c)


def test_paged_view_refusals():
    t = CellTable(8, 4, 4)
    a = t.seq_new()
    assert t.declare_step([a, a])
    _, positions, _ = t.place()
    ids = np.array([a, a], np.int64)
    made = []

    def buf(n):                           # poisoned outputs: a refusal must write none of them
        made.append(np.full(n, -7, np.int32))
        return made[-1]

    before = snapshot(t)
    for args, match in [
        ((ids, positions, 1, 8, buf(5), buf(5), buf(8)), "pad_to=1 is outside"),
        ((ids, positions, 5, 8, buf(6), buf(6), buf(8)), "pad_to=5 is outside"),
        ((ids, positions, 2, 8, buf(2), buf(3), buf(8)), "qo_indptr must be"),
        ((ids, positions, 2, 8, buf(3), buf(3), buf(1)), "kv_indices holds 1 entries; the step needs 2"),
        ((ids, positions + 5, 2, 8, buf(3), buf(3), buf(8)), "is not placed"),
        ((ids, positions, 2, 8, buf(3).astype(np.int64), buf(3), buf(8)), "qo_indptr must be"),
    ]:
        with pytest.raises(InvalidArgument, match=match):
            fill_paged(t, *args)
    assert all((a == -7).all() for a in made) and snapshot(t) == before


def test_reference_and_table_refuse_alike():
    """The same bad call raises the same class with the same message in both tables."""
    calls = [
        lambda t: t.pos(9), lambda t: t.seq_rm("x"), lambda t: t.declare_step([]),
        lambda t: t.declare_step([2]), lambda t: t.place(), lambda t: t.undo_place(),
        lambda t: t.seq_clone(0, upto=-3), lambda t: t.rewind(0, 1.5),
        lambda t: t.declare_step(7), lambda t: t.declare_step(itertools.repeat(0)),
        lambda t: t.declare_step(np.zeros((1, 1), np.int64)), lambda t: t.declare_step(b"ab"),
        lambda t: t.declare_step([0] * 9), lambda t: t.declare_step([0, None]),
    ]
    for call in calls:
        errors = []
        for cls in (CellTable, ReferenceTable):
            t = cls(8, 4, 4)
            t.seq_new()
            with pytest.raises(Exception) as info:
                call(t)
            errors.append((type(info.value), str(info.value)))
        assert errors[0] == errors[1]


OVERLAP_CHILD = r"""
import numpy as np
from cellcache import CellTable, InvalidArgument
from cellcache._views import fill_masks

def refused(call, match):
    try:
        call()
    except InvalidArgument as e:
        assert match in str(e), e
    else:
        raise AssertionError("accepted")

# place_into with one array for two outputs: placement reads back positions it wrote, so the
# cells written over them sent it past a sequence's map (heap corruption, then abort)
t = CellTable(4096, 4, 64)
a, b = t.seq_new(), t.seq_new()
for s in (a, b):
    t.declare_step([s] * 64)
    t.place()
t.declare_step([a] * 64)
before = t.snapshot()
buf = np.zeros(64, np.int64)
two = np.zeros(128, np.int64)
for args in [(buf, buf), (two[:64], two[32:96]), (buf, np.zeros(64, np.int64), buf),
             (np.zeros(64, np.int64), buf, buf[::1])]:
    refused(lambda: t.place_into(*args), "share memory" if len(args) == 2 else "shares memory")
    assert t.snapshot() == before
t.check_invariants()
assert t.place_into(two[:64], two[64:]) == 192            # adjacent, not overlapping: fine
# fill_masks reading ids and positions out of the mask it is filling (SIGSEGV)
t = CellTable(4096, 4, 16)
a = t.seq_new()
t.declare_step([a] * 16)
cells, positions, read_len = t.place()
before = t.snapshot()
out = np.zeros((16, 4096), np.uint8)
ids = out[0, :128].view(np.int64)
pos = out[1, :128].view(np.int64)
ids[:], pos[:] = a, 15
for args in [(ids, pos), (np.full(16, a), pos), (ids, positions)]:
    refused(lambda: fill_masks(t, *args, read_len, [0], [out]), "share memory with outs[0]")
    refused(lambda: fill_masks(t, *args, read_len, [0, 2], [np.zeros((16, 4096), np.bool_), out]),
            "share memory with outs[1]")
    assert t.snapshot() == before
assert (ids == a).all() and (pos == 15).all()              # nothing written
# windows the fill cannot take: InvalidArgument, not OverflowError or a crash
for w, match in [(2**64, "window=18446744073709551616 is outside [0, 1099511627776]"),
                 (2**63, "is outside"), (2**40 + 1, "is outside"), (-1, "window=-1 is outside"),
                 (1.5, "window of type float"), ("8", "window of type str"), (None, "of type NoneType"),
                 (True, "window of type bool")]:
    refused(lambda: fill_masks(t, np.full(16, a), positions, read_len, [w], [out]), match)
    assert t.snapshot() == before
# extreme positions with the largest window stay inside the table
fresh = np.zeros((16, 4096), np.uint8)
fill_masks(t, np.full(16, a), np.full(16, -2**63), read_len, [2**40], [fresh])
assert fresh.sum() == 0
fill_masks(t, np.full(16, a), np.full(16, 2**63 - 1), read_len, [2**40, 0], [fresh, out])
assert fresh.sum() == 0                                    # the window is far past the cells
assert out[:, :16].all()                                   # full history: every cell
print("ok")
"""


def test_overlapping_arrays_and_bad_windows_are_refused_in_a_child():
    """Calls that crashed the interpreter (SIGSEGV / heap corruption) now raise
    InvalidArgument with the table unchanged; a child process so a regression cannot take
    the test run down."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", OVERLAP_CHILD], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout, r.stderr[-2000:])
