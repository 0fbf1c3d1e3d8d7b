"""Every refusal of the table: the clear error (or False / None) and nothing changed."""

import numpy as np
import pytest

from cellcache import CellTable, InvalidArgument, InvalidState, ReferenceTable

from .helpers import TABLES, make, snapshot, step

BAD_IDS = [
    (-1, "outside \\[0, max_seqs=4\\)"),
    (4, "outside \\[0, max_seqs=4\\)"),
    (2**70, "outside"),
    (1.0, "not an int"),
    ("1", "not an int"),
    (True, "not an int"),
    (None, "not an int"),
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


def test_numpy_integer_ids_are_accepted(busy):
    assert busy.pos(np.int64(0)) == busy.pos(0)
    assert busy.declare_step(np.array([0, 1], dtype=np.int32)) is True
    assert busy.declare_step(np.array([0, 1], dtype=np.int64)) is True
    assert busy.declared == [0, 1]


@pytest.mark.parametrize("ids,exc,match", [
    ([], InvalidArgument, "at least one token"),
    ([0] * 5, InvalidArgument, "wider than max_write=4"),
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
    for bad in (-1, 1.5, "2"):
        with pytest.raises(InvalidArgument, match="upto"):
            busy.seq_clone(0, upto=bad)
    assert snapshot(busy) == before


@pytest.mark.parametrize("cls", TABLES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("args,match", [
    ((0, 4, None), "capacity=0 is outside"),
    ((-5, 4, None), "capacity=-5 is outside"),
    ((8, 0, None), "max_seqs=0 is outside"),
    ((8, 4, 0), "max_write=0 is outside \\[1, 8\\]"),
    ((8, 4, 9), "max_write=9 is outside \\[1, 8\\]"),
    ((8.0, 4, None), "capacity=8.0 is not an int"),
])
def test_bad_table_shape(cls, args, match):
    with pytest.raises(InvalidArgument, match=match):
        cls(*args)


def test_cell_table_fill_masks_refusals():
    t = CellTable(8, 4)
    a = t.seq_new()
    step(t, [a, a, a])
    ids = np.array([a, a], dtype=np.int64)
    pos = np.array([1, 2], dtype=np.int64)
    out = np.zeros((2, 8), dtype=np.bool_)
    out[:] = True
    with pytest.raises(InvalidArgument, match="cannot hold"):
        t.fill_masks(ids, pos, 3, [0], [np.zeros((1, 8), np.bool_)])
    with pytest.raises(InvalidArgument, match="read_len=9"):
        t.fill_masks(ids, pos, 9, [0], [out])
    with pytest.raises(InvalidArgument, match="positions has 1"):
        t.fill_masks(ids, pos[:1], 3, [0], [out])
    with pytest.raises(InvalidArgument, match="window=-1"):
        t.fill_masks(ids, pos, 3, [-1], [out])
    with pytest.raises(InvalidArgument, match="2 windows but 1"):
        t.fill_masks(ids, pos, 3, [0, 1], [out])
    with pytest.raises(InvalidArgument, match="outside \\[0, max_seqs=4\\)"):
        t.fill_masks(np.array([a, 9], dtype=np.int64), pos, 3, [0], [out])
    assert out.all()                           # nothing written by a refused fill


def test_cell_address_refusals():
    t = CellTable(8, 4)
    with pytest.raises(InvalidArgument, match="cell 8 is outside"):
        t.cell_pos_at(8)
    with pytest.raises(InvalidArgument, match="cell -1 is outside"):
        t.cell_owners_at(-1)


def test_reference_and_table_refuse_alike():
    """The same bad call raises the same class with the same message in both tables."""
    calls = [
        lambda t: t.pos(9), lambda t: t.seq_rm("x"), lambda t: t.declare_step([]),
        lambda t: t.declare_step([2]), lambda t: t.place(), lambda t: t.undo_place(),
        lambda t: t.seq_clone(0, upto=-3), lambda t: t.rewind(0, 1.5),
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
