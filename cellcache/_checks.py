"""Argument checks shared by the reference, the Cython table and the caches.

They live in one place so that both tables refuse the same inputs with the same words.
"""

from __future__ import annotations

import operator

from .errors import InvalidArgument

#: ``pos`` of a free cell; shared by the reference and the Cython table.
POS_FREE = -1


def check_seq_id(value: object, max_seqs: int) -> int:
    """Return ``value`` as an int in ``[0, max_seqs)``, or raise ``InvalidArgument``."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidArgument(
            f"sequence id {value!r} is not an int; ids are ints in [0, max_seqs={max_seqs})"
        )
    seq = operator.index(value)
    if not 0 <= seq < max_seqs:
        raise InvalidArgument(f"sequence id {seq} is outside [0, max_seqs={max_seqs})")
    return seq


def check_int(value: object, name: str, lo: int, hi: int | None = None) -> int:
    """Return ``value`` as an int in ``[lo, hi]`` (``hi`` None: no upper bound)."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidArgument(f"{name}={value!r} is not an int")
    v = operator.index(value)
    if v < lo or (hi is not None and v > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise InvalidArgument(f"{name}={v} is outside {bound}")
    return v


def check_table_shape(capacity: object, max_seqs: object, max_write: object) -> tuple[int, int, int]:
    """Validate the three sizes a table is built from; ``max_write`` None means capacity."""
    cap = check_int(capacity, "capacity", 1, 2**40)
    seqs = check_int(max_seqs, "max_seqs", 1, 2**20)
    mw = cap if max_write is None else check_int(max_write, "max_write", 1, cap)
    return cap, seqs, mw
