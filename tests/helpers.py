"""Helpers shared by the CPU tests."""

from __future__ import annotations

import numpy as np

from cellcache import CellTable, ReferenceTable

TABLES = [CellTable, ReferenceTable]


def make(table_cls, capacity, max_seqs=64, max_write=None):
    return table_cls(capacity, max_seqs, max_write)


def snapshot(table) -> dict:
    """The observable state; the Cython table is also checked for internal invariants."""
    if isinstance(table, CellTable):
        table.check_invariants()
    return table.snapshot()


def mask_strings(table, seq_ids, positions, read_len, window) -> list[str]:
    """Mask rows of a placed step as '0'/'1' strings of length read_len."""
    if isinstance(table, ReferenceTable):
        rows = table.masks(list(seq_ids), list(positions), read_len, window)
        return ["".join("1" if x else "0" for x in row) for row in rows]
    width = len(seq_ids)
    out = np.full((width, max(read_len, 1)), 7, dtype=np.uint8)  # poisoned: every cell written?
    table.fill_masks(
        np.asarray(seq_ids, dtype=np.int64), np.asarray(positions, dtype=np.int64),
        read_len, [window], [out])
    assert set(np.unique(out[:, :read_len]).tolist()) <= {0, 1}
    return ["".join(str(int(x)) for x in row[:read_len]) for row in out]


def step(table, seq_ids):
    """declare + place; returns (cells, positions, read_len) as lists."""
    assert table.declare_step(seq_ids) is True
    cells, positions, read_len = table.place()
    return [int(c) for c in cells], [int(p) for p in positions], int(read_len)
