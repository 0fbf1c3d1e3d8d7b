"""The executable spec of the cell table: plain Python, slow and obvious.

Every rule is written the most literal way: a cell is a ``pos`` and a ``set`` of owners,
"the lowest free cell" is found by looking at every cell from 0 up, ``pos(seq)`` is
recomputed from the cells each time it is asked. Nothing here is fast, and nothing is
clever, so that a reader can check it against the contract line by line. The Cython
:class:`cellcache.CellTable` must agree with it on every call; the tests and the benchmarks
use it as the oracle.

Example
-------
>>> t = ReferenceTable(capacity=16, max_seqs=4)
>>> a, b = t.seq_new(), t.seq_new()
>>> t.declare_step([a, a, b])
True
>>> t.place()
([0, 1, 2], [0, 1, 0], 3)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ._checks import POS_FREE, check_any_int, check_int, check_seq_id, check_table_shape, step_ids
from .errors import InvalidState

__all__ = ["POS_FREE", "ReferenceTable", "mask_rows", "packed_rows", "paged_view"]


class ReferenceTable:
    """The cell table, one Python object per cell.

    ``max_write`` bounds a declared step (None: ``capacity``).
    """

    def __init__(self, capacity: int, max_seqs: int = 64, max_write: int | None = None):
        self.capacity, self.max_seqs, self.max_write = check_table_shape(
            capacity, max_seqs, max_write
        )
        self.cell_pos: list[int] = [POS_FREE] * self.capacity
        self.cell_owners: list[set[int]] = [set() for _ in range(self.capacity)]
        self.live: set[int] = set()
        self.declared: list[int] | None = None
        # What the last place() did, so that undo_place() can take it back.
        self._placed: tuple[list[int], list[int]] | None = None

    # -- queries -------------------------------------------------------------------------
    @property
    def used_count(self) -> int:
        return sum(1 for p in self.cell_pos if p != POS_FREE)

    @property
    def free_cells(self) -> int:
        return self.capacity - self.used_count

    @property
    def used_end(self) -> int:
        """One past the highest occupied cell; 0 when every cell is free."""
        occupied = [c for c, p in enumerate(self.cell_pos) if p != POS_FREE]
        return occupied[-1] + 1 if occupied else 0

    def live_seqs(self) -> list[int]:
        return sorted(self.live)

    def pos(self, seq: int) -> int:
        """One past the newest position ``seq`` owns; 0 if it owns nothing or is not live."""
        seq = check_seq_id(seq, self.max_seqs)
        owned = [self.cell_pos[c] for c in range(self.capacity) if seq in self.cell_owners[c]]
        return max(owned) + 1 if owned else 0

    def seq_len(self, seq: int) -> int:
        """How many cells ``seq`` owns."""
        seq = check_seq_id(seq, self.max_seqs)
        return sum(1 for owners in self.cell_owners if seq in owners)

    def seq_cells(self, seq: int) -> list[int]:
        """The cells ``seq`` owns, ascending."""
        seq = check_seq_id(seq, self.max_seqs)
        return [c for c in range(self.capacity) if seq in self.cell_owners[c]]

    # -- verbs -----------------------------------------------------------------------------
    def seq_new(self) -> int | None:
        """Returns the lowest id that is not live, now live and owning nothing; None if all are."""
        for seq in range(self.max_seqs):
            if seq not in self.live:
                self.live.add(seq)
                self._placed = None
                return seq
        return None

    def seq_clone(self, src: int, upto: int | None = None) -> int | None:
        """Returns a new id co-owning src's cells with ``pos < upto`` (all if None), or None."""
        src = check_seq_id(src, self.max_seqs)
        if upto is not None:
            upto = check_int(upto, "upto", 0, 2**62)
        if src not in self.live or self.seq_len(src) == 0:
            return None
        new = self.seq_new()
        if new is None:
            return None
        for c in range(self.capacity):
            if src in self.cell_owners[c] and (upto is None or self.cell_pos[c] < upto):
                self.cell_owners[c].add(new)
        return new

    def seq_rm(self, seq: int) -> bool:
        """Drops seq from every cell and releases its id; False if it is not live."""
        seq = check_seq_id(seq, self.max_seqs)
        if seq not in self.live:
            return False
        self._cancel_declaration_of(seq)
        self._drop(seq, 0)
        self.live.remove(seq)
        return True

    def rewind(self, seq: int, position: int) -> bool:
        """Drops seq's claim on positions >= position; False if not live or out of [0, pos]."""
        seq = check_seq_id(seq, self.max_seqs)
        position = check_any_int(position, "position")
        if seq not in self.live or not 0 <= position <= self.pos(seq):
            return False
        self._cancel_declaration_of(seq)
        self._drop(seq, position)
        return True

    def clear(self) -> None:
        """Frees every cell, releases every id and drops the declaration."""
        self.cell_pos = [POS_FREE] * self.capacity
        self.cell_owners = [set() for _ in range(self.capacity)]
        self.live.clear()
        self.declared = None
        self._placed = None

    def _drop(self, seq: int, position: int) -> None:
        for c in range(self.capacity):
            if seq in self.cell_owners[c] and self.cell_pos[c] >= position:
                self.cell_owners[c].discard(seq)
                if not self.cell_owners[c]:
                    self.cell_pos[c] = POS_FREE

    def _cancel_declaration_of(self, seq: int) -> None:
        self._placed = None
        if self.declared is not None and seq in self.declared:
            self.declared = None

    # -- steps -----------------------------------------------------------------------------
    def declare_step(self, seq_ids: Iterable[int]) -> bool:
        """Declares the next step's tokens; False (nothing declared) if too few cells are free.

        Refuses, in order: something that is not a sequence of ids, an empty step, one wider
        than max_write, a bad id, an id that is not live.
        """
        self.declared = None
        self._placed = None
        ids = step_ids(seq_ids, self.max_write, self.max_seqs)
        for seq in ids:
            if seq not in self.live:
                raise InvalidState(f"sequence {seq} is not live; call seq_new() first")
        if self.free_cells < len(ids):
            return False
        self.declared = ids
        return True

    def undeclare(self) -> None:
        """Drops the declaration, if any."""
        self.declared = None
        self._placed = None

    def step_kv_entries(self) -> int:
        """Entries the paged view needs for the declared step: per run, its last position + 1."""
        if self.declared is None:
            return 0
        ids = self.declared
        seen = {s: self.pos(s) for s in dict.fromkeys(ids)}   # (each sequence once)
        total = 0
        for i, s in enumerate(ids):
            seen[s] += 1
            if i + 1 == len(ids) or ids[i + 1] != s:
                total += seen[s]
        return total

    def place(self) -> tuple[list[int], list[int], int]:
        """Places the declared tokens: returns (cells, positions, read_len).

        The i-th token takes the i-th lowest free cell; its position continues its sequence.
        """
        if self.declared is None:
            raise InvalidState("no step is declared; call declare_step() first")
        ids = self.declared
        next_pos = {seq: self.pos(seq) for seq in set(ids)}
        positions = []
        for seq in ids:
            positions.append(next_pos[seq])
            next_pos[seq] += 1
        free = [c for c in range(self.capacity) if self.cell_pos[c] == POS_FREE]
        cells = free[: len(ids)]
        for c, seq, p in zip(cells, ids, positions):
            self.cell_pos[c] = p
            self.cell_owners[c] = {seq}
        self._placed = (list(ids), cells)
        self.declared = None
        return cells, positions, self.used_end

    def undo_place(self) -> None:
        """Takes back the last place(): its cells are free again and the step is declared."""
        if self._placed is None:
            raise InvalidState("nothing was placed since the last verb or declaration")
        ids, cells = self._placed
        for c in cells:
            self.cell_pos[c] = POS_FREE
            self.cell_owners[c] = set()
        self.declared = ids
        self._placed = None

    def masks(
        self, seq_ids: Sequence[int], positions: Sequence[int], read_len: int, window: int
    ) -> list[list[bool]]:
        """The mask rows of a placed step for one window (see :func:`mask_rows`)."""
        return mask_rows(self.cell_pos, self.cell_owners, seq_ids, positions, read_len, window)

    # -- observation -------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """The whole observable state, for comparing tables and for "nothing changed"."""
        return {
            "pos": list(self.cell_pos),
            "owners": [sorted(o) for o in self.cell_owners],
            "live": self.live_seqs(),
            "used_end": self.used_end,
            "free_cells": self.free_cells,
            "seq_pos": [self.pos(s) if s in self.live else 0 for s in range(self.max_seqs)],
            "seq_len": [self.seq_len(s) if s in self.live else 0 for s in range(self.max_seqs)],
            "declared": None if self.declared is None else list(self.declared),
        }


def mask_rows(
    cell_pos: Sequence[int],
    cell_owners: Sequence[Iterable[int]],
    seq_ids: Sequence[int],
    positions: Sequence[int],
    read_len: int,
    window: int,
) -> list[list[bool]]:
    """The mask rule: row i, column j < read_len is True when query i attends cell j.

    ``attend = pos[j] >= 0 and s in owners[j] and pos[j] <= p and (W == 0 or pos[j] > p - W)``
    for the query's sequence ``s`` and position ``p``.
    """
    rows = []
    for s, p in zip(seq_ids, positions):
        row = []
        for j in range(read_len):
            pj = cell_pos[j]
            row.append(
                pj >= 0
                and s in cell_owners[j]
                and pj <= p
                and (window == 0 or pj > p - window)
            )
        rows.append(row)
    return rows


def packed_rows(rows: Sequence[Sequence[bool]]) -> list[bytes]:
    """Mask rows as bit-packed bytes: bit j % 8 of byte j // 8 is column j (little-endian
    within a byte), ceil(len(row) / 8) bytes a row, bits past the row's end zero."""
    out = []
    for row in rows:
        data = bytearray((len(row) + 7) // 8)
        for j, on in enumerate(row):
            if on:
                data[j // 8] |= 1 << (j % 8)
        out.append(bytes(data))
    return out


def paged_view(
    cell_pos: Sequence[int],
    cell_owners: Sequence[Iterable[int]],
    seq_ids: Sequence[int],
    positions: Sequence[int],
    pad_to: int,
    sink: int,
) -> tuple[list[int], list[int], list[int], int]:
    """The paged view of a placed step: (qo_indptr, kv_indptr, kv_indices, real runs).

    One request per maximal run of consecutive tokens of one sequence; its kv list is the
    sequence's cells with position <= the run's last position, in position order. Then one
    request of one entry (``sink``) per padding row; both indptrs have ``pad_to + 1``
    entries, those past the last request repeating its end.
    """
    qo, kv, indices = [0], [0], []
    width = len(seq_ids)
    runs = 0
    for i in range(width):
        if i + 1 < width and seq_ids[i + 1] == seq_ids[i]:
            continue
        s, last = seq_ids[i], positions[i]
        mine = sorted((cell_pos[c], c) for c in range(len(cell_pos))
                      if s in cell_owners[c] and 0 <= cell_pos[c] <= last)
        indices += [c for _, c in mine]
        qo.append(i + 1)
        kv.append(len(indices))
        runs += 1
    for i in range(width, pad_to):
        indices.append(sink)
        qo.append(i + 1)
        kv.append(len(indices))
    while len(qo) < pad_to + 1:
        qo.append(pad_to)
        kv.append(len(indices))
    return qo, kv, indices, runs
