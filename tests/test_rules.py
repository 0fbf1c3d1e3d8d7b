"""Hand-drawn walks through the table's rules, run against the Cython table and the reference alike."""

import pytest

from cellcache import POS_FREE, CellTable, InvalidArgument, InvalidState, ReferenceTable
from cellcache._checks import POS_FREE as CHECKS_POS_FREE

from .helpers import TABLES, make, mask_strings, snapshot, step

F = POS_FREE


@pytest.fixture(params=TABLES, ids=lambda c: c.__name__)
def table_cls(request):
    return request.param


def test_pos_free_is_shared():
    assert POS_FREE == CHECKS_POS_FREE == -1


def test_issue_example_two_steps(table_cls):
    t = make(table_cls, 16, max_write=8)
    a, b = t.seq_new(), t.seq_new()
    assert (a, b) == (0, 1)
    ids = [a, a, a, b, b]
    cells, positions, read_len = step(t, ids)
    assert cells == [0, 1, 2, 3, 4]
    assert positions == [0, 1, 2, 0, 1]
    assert read_len == 5
    assert mask_strings(t, ids, positions, read_len, 0) == [
        "10000", "11000", "11100", "00010", "00011"]
    assert mask_strings(t, ids, positions, read_len, 2) == [
        "10000", "11000", "01100", "00010", "00011"]
    # cells: 0 1 2 3 4 5 6
    # pos:   0 1 2 0 1 1 3     seq: a a a b b b a
    cells, positions, read_len = step(t, [b, a])
    assert cells == [5, 6] and positions == [2, 3] and read_len == 7
    assert mask_strings(t, [b, a], positions, read_len, 0) == ["0001110", "1110001"]
    assert (t.pos(a), t.pos(b)) == (4, 3)
    assert (t.seq_len(a), t.seq_len(b)) == (4, 3)
    snapshot(t)


def test_clone_shares_cells_and_keeps_later_ones_with_src(table_cls):
    t = make(table_cls, 16)
    a = t.seq_new()
    step(t, [a] * 5)                      # cells 0..4 = a@0..4
    c = t.seq_clone(a, upto=3)
    assert c == 1
    s = snapshot(t)
    assert s["owners"][:6] == [[0, 1], [0, 1], [0, 1], [0], [0], []]
    assert (t.pos(c), t.seq_len(c)) == (3, 3)
    # the clone continues from position 3 in a fresh cell; a is untouched
    cells, positions, read_len = step(t, [c, a])
    assert cells == [5, 6] and positions == [3, 5] and read_len == 7
    assert mask_strings(t, [c, a], positions, read_len, 0) == ["1110010", "1111101"]
    d = t.seq_clone(a)                    # all of a
    assert t.seq_len(d) == 6 and t.pos(d) == 6
    assert t.seq_clone(a, upto=0) == 3 and t.seq_len(3) == 0 and t.pos(3) == 0
    snapshot(t)


def test_clone_refusals_return_none(table_cls):
    t = make(table_cls, 8, max_seqs=2)
    a = t.seq_new()
    before = snapshot(t)
    assert t.seq_clone(a) is None            # a owns no cell
    assert t.seq_clone(1) is None            # 1 is not live
    assert snapshot(t) == before
    step(t, [a])
    b = t.seq_clone(a)
    assert b == 1
    before = snapshot(t)
    assert t.seq_clone(a) is None            # no free id
    assert snapshot(t) == before


def test_rm_frees_unshared_cells_and_releases_id(table_cls):
    t = make(table_cls, 16)
    a, b = t.seq_new(), t.seq_new()
    step(t, [a, a, b, b, a])                 # a:0,1,4  b:2,3
    c = t.seq_clone(a)                       # c shares 0,1,4
    assert t.seq_rm(a) is True
    s = snapshot(t)
    assert s["pos"][:5] == [0, 1, 0, 1, 2]   # shared cells survive with c
    assert s["owners"][:5] == [[c], [c], [b], [b], [c]]
    assert t.live_seqs() == [b, c]
    assert t.seq_rm(c) is True
    s = snapshot(t)
    assert s["pos"][:5] == [F, F, 0, 1, F]
    assert t.used_end == 4                    # tail shrinks past trailing free cells
    assert t.free_cells == 14
    assert t.seq_new() == 0                   # released ids are reused, lowest first
    assert t.seq_rm(5) is False


def test_rewind_keeps_id_live_even_at_zero(table_cls):
    t = make(table_cls, 16)
    a, b = t.seq_new(), t.seq_new()
    step(t, [a, a, a, b, a])                  # a: 0,1,2,4 at pos 0..3; b: 3
    assert t.rewind(a, 2) is True
    s = snapshot(t)
    assert s["pos"][:5] == [0, 1, F, 0, F]
    assert t.pos(a) == 2 and t.used_end == 4
    assert t.rewind(a, 2) is True             # rewinding to pos(a) is allowed, changes nothing
    assert snapshot(t)["pos"] == s["pos"]
    assert t.rewind(a, 0) is True
    assert t.live_seqs() == [a, b] and t.pos(a) == 0 and t.seq_len(a) == 0
    cells, positions, _ = step(t, [a])        # the hole at 0 is refilled
    assert cells == [0] and positions == [0]


def test_rewind_refusals(table_cls):
    t = make(table_cls, 8)
    a = t.seq_new()
    step(t, [a, a, a])
    before = snapshot(t)
    assert t.rewind(a, 4) is False            # past pos(a) = 3
    assert t.rewind(a, -1) is False
    assert t.rewind(5, 0) is False            # not live
    assert snapshot(t) == before
    with pytest.raises(InvalidArgument, match="position"):
        t.rewind(a, "1")
    assert snapshot(t) == before


def test_rewind_of_shared_prefix_keeps_cells_of_others(table_cls):
    t = make(table_cls, 8)
    a = t.seq_new()
    step(t, [a] * 4)
    b = t.seq_clone(a)
    t.rewind(a, 1)
    s = snapshot(t)
    assert s["owners"][:4] == [[a, b], [b], [b], [b]]
    assert t.pos(a) == 1 and t.pos(b) == 4 and t.free_cells == 4


def test_hole_refill_in_ascending_order(table_cls):
    t = make(table_cls, 16)
    a, b, c = t.seq_new(), t.seq_new(), t.seq_new()
    step(t, [a, b, a, b, c, a, b])            # a:0,2,5 b:1,3,6 c:4
    t.seq_rm(b)                                # holes 1,3,6
    cells, positions, read_len = step(t, [c, c, c, c, a])
    # the 5 lowest free cells: 1,3,6,7,8 (reachable up to used_end + width - 1 = 6 + 4 = 10)
    assert cells == [1, 3, 6, 7, 8]
    assert positions == [1, 2, 3, 4, 3]
    assert read_len == 9
    assert mask_strings(t, [c, c, c, c, a], positions, read_len, 2) == [
        "010010000", "010100000", "000100100", "000000110", "000001001"]


def test_tail_shrink_walks_back_over_old_holes(table_cls):
    t = make(table_cls, 300)
    a, b = t.seq_new(), t.seq_new()
    step(t, [a] * 10)
    step(t, [b] * 250)                         # cells 10..259
    step(t, [a])                                # cell 260
    t.rewind(b, 0)
    assert t.used_end == 261
    t.rewind(a, 10)                             # frees 260; used_end falls past the hole
    assert t.used_end == 10
    snapshot(t)


def test_windows_and_positions_across_steps(table_cls):
    t = make(table_cls, 32)
    a = t.seq_new()
    for _ in range(3):
        step(t, [a, a])
    cells, positions, read_len = step(t, [a])
    assert positions == [6] and read_len == 7
    assert mask_strings(t, [a], positions, read_len, 0) == ["1111111"]
    assert mask_strings(t, [a], positions, read_len, 3) == ["0000111"]
    assert mask_strings(t, [a], positions, read_len, 1) == ["0000001"]
    assert mask_strings(t, [a], positions, read_len, 100) == ["1111111"]


def test_id_exhaustion_and_reuse(table_cls):
    t = make(table_cls, 8, max_seqs=3)
    assert [t.seq_new() for _ in range(3)] == [0, 1, 2]
    before = snapshot(t)
    assert t.seq_new() is None
    assert snapshot(t) == before
    t.seq_rm(1)
    assert t.seq_new() == 1
    assert t.seq_new() is None


@pytest.mark.parametrize("max_seqs", [1, 64, 65, 4096])
def test_max_seqs_edges(table_cls, max_seqs):
    if table_cls is not CellTable and max_seqs == 4096:
        capacity = 8                           # the reference's pos(seq) is O(capacity)
    else:
        capacity = 16
    t = make(table_cls, capacity, max_seqs=max_seqs)
    ids = [t.seq_new() for _ in range(max_seqs)]
    assert ids == list(range(max_seqs))
    assert t.seq_new() is None
    last = max_seqs - 1
    cells, positions, read_len = step(t, [last, 0, last])
    assert cells == [0, 1, 2]
    if last:
        assert positions == [0, 0, 1]
        expected = ["100", "010", "101"]
    else:
        assert positions == [0, 1, 2]
        expected = ["100", "110", "111"]
    assert mask_strings(t, [last, 0, last], positions, read_len, 0) == expected
    t.seq_rm(0)
    if max_seqs > 1:
        c = t.seq_new()
        assert c == 0
        t.seq_rm(c)
    c = t.seq_clone(last)
    if last:
        assert c == 0 and t.seq_len(0) == 2
    else:
        assert c is None                       # the only id is gone; nothing to clone
    with pytest.raises(InvalidArgument, match=f"max_seqs={max_seqs}"):
        t.pos(max_seqs)
    snapshot(t)


def test_clear_frees_everything(table_cls):
    t = make(table_cls, 8)
    a, b = t.seq_new(), t.seq_new()
    step(t, [a, b, a])
    t.declare_step([b])
    t.clear()
    s = snapshot(t)
    assert s == make(table_cls, 8).snapshot()
    assert t.seq_new() == 0


def test_verb_on_declared_sequence_cancels_the_declaration(table_cls):
    t = make(table_cls, 8)
    a, b, c = t.seq_new(), t.seq_new(), t.seq_new()
    step(t, [a, b])
    assert t.declare_step([a, a]) is True
    t.seq_rm(c)                                # c not declared: the declaration stays
    assert t.declared == [a, a]
    t.seq_clone(a)                             # clone does not change a: stays
    assert t.declared == [a, a]
    t.rewind(b, 0)
    assert t.declared == [a, a]
    t.rewind(a, 1)                             # touches a: cancelled
    assert t.declared is None
    with pytest.raises(InvalidState, match="declare_step"):
        t.place()
    assert t.declare_step([a, b]) is True
    t.seq_rm(b)
    assert t.declared is None


def test_undo_place_restores_table_and_declaration(table_cls):
    t = make(table_cls, 8)
    a, b = t.seq_new(), t.seq_new()
    step(t, [a, b, a])
    t.rewind(b, 0)                              # hole at 1
    assert t.declare_step([b, a, b]) is True
    before = snapshot(t)
    t.place()
    t.undo_place()
    assert snapshot(t) == before
    cells, positions, _ = t.place()            # the restored declaration places again
    assert list(cells) == [1, 3, 4] and list(positions) == [0, 2, 1]
    t.seq_new()                                 # any verb ends the chance to undo
    before = snapshot(t)
    with pytest.raises(InvalidState, match="placed"):
        t.undo_place()
    assert snapshot(t) == before


def test_queries_agree_with_the_reference():
    t, ref = CellTable(16, 4), ReferenceTable(16, 4)
    for table in (t, ref):
        a, b = table.seq_new(), table.seq_new()
        step(table, [a, b, a, b, a])
        table.seq_clone(a, upto=2)
        table.rewind(b, 1)
    for s in range(4):
        assert t.seq_cells(s) == ref.seq_cells(s)
        assert [t.seq_cell_at(s, q) for q in range(t.pos(s))] == [
            c for q in range(ref.pos(s)) for c in ref.seq_cells(s) if ref.cell_pos[c] == q]
    assert t.seq_cell_at(0, 3) == -1 and t.seq_cell_at(3, 0) == -1
    assert t.positions_array().tolist() == ref.cell_pos
    words = t.owner_words_array()
    assert words.shape == (1, 16)
    assert [[s for s in range(4) if int(words[0, c]) >> s & 1] for c in range(16)] == [
        sorted(o) for o in ref.cell_owners]


def test_change_log_names_every_cell_whose_pos_or_owners_changed():
    """What the CUDA mirror is fed: checked here without a GPU."""
    t = CellTable(16, 4, track_changes=True)
    quiet = CellTable(16, 4)
    a = t.seq_new()
    step(t, [a, a, a])
    assert t.n_changes == 3 and t.take_changes().tolist() == [0, 1, 2]
    assert t.n_changes == 0 and t.take_changes().tolist() == []
    b = t.seq_clone(a, upto=2)
    assert t.take_changes().tolist() == [0, 1]             # b's bit was added there
    t.rewind(a, 1)
    assert t.take_changes().tolist() == [1, 2]             # 1 loses a's bit, 2 is freed
    t.seq_rm(b)
    t.declare_step([a])
    t.place()
    t.undo_place()
    # rm b: 0 loses b's bit, 1 is freed; placed at 1 and taken back: still one entry
    assert t.take_changes().tolist() == [0, 1]
    step(t, [a, a])                                          # cells 1, 2
    assert t.take_changes().tolist() == [1, 2]
    t.clear()
    assert t.take_changes().tolist() == [0, 1, 2]            # every occupied cell
    a2 = quiet.seq_new()
    step(quiet, [a2])
    assert quiet.n_changes == 0                            # no log unless asked for


@pytest.mark.parametrize("capacity,first", [(200, 1), (200, 64), (200, 70), (8200, 4096), (8200, 4100),
                                            (8200, 4031)])
def test_used_end_shrinks_across_bitmap_words(table_cls, capacity, first):
    # cells:  [0, first) held by a  |  [first, first + 10) held by b  |  free
    # removing b must bring used_end back to `first` wherever the word boundaries fall
    # (64-cell bitmap words, 4096-cell summary words)
    t = make(table_cls, capacity, max_write=capacity)
    a, b = t.seq_new(), t.seq_new()
    step(t, [a] * first)
    step(t, [b] * 10)
    assert t.used_end == first + 10
    t.seq_rm(b)
    assert t.used_end == first
    t.rewind(a, first - 1)
    assert t.used_end == first - 1
    c = t.seq_new()
    step(t, [c] * 3)                       # the lowest free cells: the one a gave back, then up
    assert t.used_end == first + 2
    snapshot(t)
