"""Argument checks and limits shared by the reference, the Cython table and the caches.

They live in one place so that both tables refuse the same inputs with the same words, and
so that every limit has one source.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Mapping, Set, Sized

import numpy as np

from .errors import InvalidArgument

#: ``pos`` of a free cell; shared by the reference and the Cython table (a test checks).
POS_FREE = -1
#: Largest ``max_seqs`` a table accepts.
MAX_SEQS_LIMIT = 1 << 20
#: Largest ``capacity`` a table accepts.
CAPACITY_LIMIT = 1 << 40


def _index(value: object) -> int | None:
    """``value`` as an int when it is an integer (not a bool), else None."""
    if type(value) is int:                    # the common case, first (bool is not int here)
        return value
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:  # e.g. a 1-element array: it has __index__ but refuses it
        return None


def check_int(value: object, name: str, lo: int, hi: int | None = None) -> int:
    """Returns ``value`` as an int in ``[lo, hi]`` (``hi`` None: no upper bound)."""
    v = _index(value)
    if v is None:
        raise InvalidArgument(f"{name} of type {type(value).__name__} is not an int")
    if v < lo or (hi is not None and v > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise InvalidArgument(f"{name}={v} is outside {bound}")
    return v


def check_any_int(value: object, name: str) -> int:
    """Returns ``value`` as an int of any size; refuses non-integers."""
    v = _index(value)
    if v is None:
        raise InvalidArgument(f"{name} of type {type(value).__name__} is not an int")
    return v


def check_seq_id(value: object, max_seqs: int) -> int:
    """Returns ``value`` as an int in ``[0, max_seqs)``, or raises ``InvalidArgument``."""
    seq = _index(value)
    if seq is None:
        raise InvalidArgument(
            f"sequence id of type {type(value).__name__} is not an int; ids are ints in "
            f"[0, max_seqs={max_seqs})")
    if not 0 <= seq < max_seqs:
        raise InvalidArgument(f"sequence id {seq} is outside [0, max_seqs={max_seqs})")
    return seq


def check_table_shape(capacity: object, max_seqs: object, max_write: object) -> tuple[int, int, int]:
    """Validates the three sizes a table is built from; ``max_write`` None means capacity."""
    cap = check_int(capacity, "capacity", 1, CAPACITY_LIMIT)
    seqs = check_int(max_seqs, "max_seqs", 1, MAX_SEQS_LIMIT)
    mw = cap if max_write is None else check_int(max_write, "max_write", 1, cap)
    return cap, seqs, mw


_NOT_IDS = (str, bytes, bytearray, memoryview, Mapping, Set)


def step_ids(seq_ids: object, max_write: int, max_seqs: int) -> list[int]:
    """The ids of a declared step as a list of ints, checked in the documented order.

    Accepts a list, tuple, range, 1-D integer numpy array or any other iterable of ints
    (at most ``max_write + 1`` items are consumed, so an endless iterator is refused, not
    materialised). Refuses strings, bytes, mappings and sets (not an ordered list of ids),
    then an empty step, then one wider than ``max_write``, then any bad id.
    """
    not_ids = InvalidArgument(
        f"seq_ids of type {type(seq_ids).__name__} is not a sequence of ids; give a list, "
        "tuple or 1-D integer array of sequence ids")
    if seq_ids is None or isinstance(seq_ids, _NOT_IDS):
        raise not_ids
    if isinstance(seq_ids, np.ndarray):
        if seq_ids.ndim != 1 or seq_ids.dtype.kind not in "iu":
            raise InvalidArgument(
                f"seq_ids is a {seq_ids.ndim}-D array of {seq_ids.dtype}; give a 1-D integer array")
        items: list = seq_ids[: max_write + 1].tolist()
        n: int | None = len(seq_ids)
    else:
        if not isinstance(seq_ids, Iterable):
            raise not_ids
        try:
            items = list(itertools.islice(iter(seq_ids), max_write + 1))
        except TypeError:
            raise not_ids from None
        n = len(seq_ids) if isinstance(seq_ids, (list, tuple, range)) else None
    if not items:
        raise InvalidArgument("a step needs at least one token; got none")
    if len(items) > max_write:
        wide = f"{n} tokens" if n is not None else f"more than {max_write} tokens"
        raise InvalidArgument(f"a step of {wide} is wider than max_write={max_write}")
    return [check_seq_id(s, max_seqs) for s in items]


def _longer(value: Sized, limit: int) -> bool:
    """Whether ``value`` holds more than ``limit`` items, asked lazily: a length past
    ``sys.maxsize`` (a ``range(2**70)``'s, whose len() raises OverflowError) is more; a
    ``__len__`` that raises or answers no length (a float, a negative) tells nothing (False:
    the caller counts what it reads, as for an iterable of no length; list() too ignores
    a len() TypeError)."""
    try:
        return len(value) > limit
    except OverflowError:
        return True
    except Exception:
        return False


def bounded_list(value: Iterable, what: str, items: str, limit: int | None) -> list:
    """``value``'s items as a list; with ``limit``, InvalidArgument instead when it holds
    more: a list or tuple is taken whole, anything else is asked its length first when it
    has one, and is read for at most ``limit + 1`` items (an iterator may never end; so may
    a subclass of list or tuple's own ``__iter__``)."""
    if limit is None or type(value) in (list, tuple):
        return list(value)
    if isinstance(value, Sized) and _longer(value, limit):
        raise InvalidArgument(f"{what} holds more than {limit} {items}")
    # (an iterator, or an iterable of no length, may never end: read one past the limit)
    out = list(itertools.islice(value, limit + 1))
    if len(out) > limit:
        raise InvalidArgument(f"{what} yields more than {limit} {items}")
    return out
