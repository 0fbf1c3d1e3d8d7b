"""Views of a placed step, beside the cell table: masks, run planning, the paged view.

The table (:mod:`cellcache._table`) keeps cells, owners and position maps; what a placed step
looks like to a forward is built here, as free functions that take the table, the way
:mod:`cellcache.reference` keeps ``mask_rows`` and ``paged_view`` beside ``ReferenceTable``
(and llama.cpp keeps ``llama-kv-cells.h`` apart from mask building). They read the table's
arrays directly through the declarations in ``cellcache/_table.pxd``: no copies, no calls.

The public ``def`` functions validate and raise; the ``cdef`` helpers trust their caller
(the CUDA engine cimports :func:`plan_runs`), and the bounds-checked build checks what each
assumes. Threads: like the table's methods, each function holds the GIL throughout and
resolves all caller input (ints, arrays, lists) before it reads the table, so it sees one
state of the table and writes only its caller's arrays.
"""

from libc.stdint cimport int32_t, int64_t, uint8_t
from libc.string cimport memcpy, memset

from cellcache._table cimport CC_ASSUME, CellTable, overlaps, seq_is_live

import numpy as np

from ._checks import CAPACITY_LIMIT as _CAPACITY_LIMIT
from ._checks import check_int, check_seq_id
from .errors import InvalidArgument


cdef CellTable _table_arg(object table):
    # table as a CellTable; InvalidArgument otherwise.
    if not isinstance(table, CellTable):
        raise InvalidArgument(f"table must be a CellTable, not {type(table).__name__}")
    return <CellTable>table


cdef const int64_t[::1] _in_vector(object a, str name) except *:
    # a as a read-only view of a contiguous 1-D int64 array; InvalidArgument otherwise.
    if not isinstance(a, np.ndarray) or a.dtype != np.int64 or a.ndim != 1 \
            or not a.flags.c_contiguous:
        raise InvalidArgument(f"{name} must be a contiguous 1-D int64 array")
    return a


# -- masks ------------------------------------------------------------------------------------
cdef void fill_mask_rows(CellTable t, const int64_t* seq_ids, const int64_t* positions,
                         int64_t width, int64_t read_len, int64_t window,
                         uint8_t* out, int64_t row_stride, bint bits) noexcept:
    # Row i of out (stride row_stride bytes) gets the mask rule for query i over columns
    # [0, read_len): one byte per column, or one bit (little-endian, bits past read_len
    # in the last byte zero). The cells a query sees are exactly its sequence's positions
    # (p - window, p], found through the position map: O(window) per row (O(p) for 0).
    # Assumes read_len <= capacity and every seq_ids[i] in [0, max_seqs).
    cdef int64_t i, q, q0, q1, s, p, c
    cdef uint8_t* row
    cdef int64_t* seq_map
    cdef int64_t nbytes = (read_len + 7) // 8 if bits else read_len
    CC_ASSUME(read_len <= t.capacity, "fill_mask_rows: read_len past capacity")
    for i in range(width):
        row = out + i * row_stride
        memset(row, 0, nbytes)
        s = seq_ids[i]
        p = positions[i]
        if not seq_is_live(t, s):
            continue
        seq_map = t.seq_map[s]
        q1 = p if p < t.seq_pos_[s] - 1 else t.seq_pos_[s] - 1
        q0 = 0 if window == 0 or p < window else p - window + 1   # never overflows
        for q in range(q0, q1 + 1):
            c = seq_map[q]
            if c < read_len:
                if bits:
                    row[c >> 3] |= <uint8_t>(1 << (c & 7))
                else:
                    row[c] = 1


def fill_masks(table, seq_ids, positions, read_len, windows, outs, pad_to=None, bits=False):
    """Writes each window's mask rows for a step placed in ``table``.

    ``seq_ids`` and ``positions`` (int64 arrays of the step's ``width`` tokens) and
    ``read_len`` describe the step; ``outs[k]`` (C-contiguous bool or uint8, shape
    ``[rows >= pad_to, cols]``) receives window ``windows[k]``: rows ``[0, width)``,
    columns ``[0, read_len)`` (``cols >= read_len``), or with ``bits`` bytes
    ``[0, ceil(read_len / 8))`` (``cols >= ceil(read_len / 8)``). Rows ``[width, pad_to)``
    are padding: they get row 0's mask. Everything else keeps its stale value.
    Windows are ints in ``[0, 2**40]``; ``seq_ids`` and ``positions`` must not share
    memory with any of ``outs`` (InvalidArgument).

    Example
    -------
    >>> from cellcache import CellTable
    >>> t = CellTable(8, max_seqs=2)
    >>> a = t.seq_new()
    >>> t.declare_step([a, a])
    True
    >>> cells, positions, read_len = t.place()
    >>> out = np.zeros((2, read_len), np.bool_)
    >>> fill_masks(t, np.array([a, a], np.int64), positions, read_len, [0], [out])
    >>> out.astype(int).tolist()
    [[1, 0], [1, 1]]
    """
    cdef CellTable t = _table_arg(table)
    cdef const int64_t[::1] ids = _in_vector(seq_ids, "seq_ids")
    cdef const int64_t[::1] pos = _in_vector(positions, "positions")
    cdef int64_t width = ids.shape[0], k, s, rl, pad, nbytes, size
    cdef uint8_t[:, ::1] out
    cdef list wins = [], views = []
    if pos.shape[0] != width:
        raise InvalidArgument(f"positions has {pos.shape[0]} entries; seq_ids has {width}")
    if width == 0:
        raise InvalidArgument("a step needs at least one token; got none")
    rl = check_int(read_len, "read_len", 0, t.capacity)
    pad = width if pad_to is None else check_int(pad_to, "pad_to", width, 1 << 40)
    for k in range(width):
        if not 0 <= ids[k] < t.max_seqs:
            check_seq_id(int(ids[k]), t.max_seqs)
    if not isinstance(windows, (list, tuple)) or not isinstance(outs, (list, tuple)):
        raise InvalidArgument("windows and outs must be lists (or tuples) of equal length")
    if len(windows) != len(outs):
        raise InvalidArgument(f"{len(windows)} windows but {len(outs)} output arrays")
    nbytes = (rl + 7) // 8 if bits else rl
    for k in range(len(windows)):
        wins.append(check_int(windows[k], "window", 0, _CAPACITY_LIMIT))
        arr = outs[k]
        if not isinstance(arr, np.ndarray) or arr.dtype not in (np.bool_, np.uint8) \
                or arr.ndim != 2 or not arr.flags.c_contiguous or not arr.flags.writeable:
            raise InvalidArgument(
                f"outs[{k}] must be a writable C-contiguous 2-D bool or uint8 array")
        out = arr.view(np.uint8)
        if out.shape[0] < pad or out.shape[1] < nbytes:
            raise InvalidArgument(
                f"mask array of shape ({out.shape[0]}, {out.shape[1]}) cannot hold "
                f"{pad} rows x {nbytes} {'bytes' if bits else 'columns'}")
        # the fill reads ids and positions row by row while it writes: an overlap
        # would feed it its own output
        size = out.shape[0] * out.shape[1]
        if size and (overlaps(&ids[0], 8 * width, &out[0, 0], size)
                     or overlaps(&pos[0], 8 * width, &out[0, 0], size)):
            raise InvalidArgument(
                f"seq_ids or positions share memory with outs[{k}]; give arrays that do "
                "not overlap the masks")
        views.append(out)
    for k in range(len(wins)):
        out = views[k]
        fill_mask_rows(t, &ids[0], &pos[0], width, rl, wins[k], &out[0, 0], out.shape[1], bits)
        for s in range(width, pad):
            memcpy(&out[s, 0], &out[0, 0], nbytes)


# -- runs and the paged view ----------------------------------------------------------------
cdef int64_t plan_runs(const int64_t* seq_ids, const int64_t* positions,
                       int64_t width, int64_t pad_to, int64_t* qo_indptr,
                       int64_t* kv_indptr, int64_t* run_seq, int64_t* run_last) noexcept nogil:
    # The paged view's runs for a placed step of width tokens padded to pad_to: writes
    # qo_indptr and kv_indptr [0, pad_to] (entries past the last run repeat its end) and,
    # per real run, its sequence and last position; each padding row is a run of one
    # entry (the sink). Returns the real run count. Reads no table: a run is a maximal
    # stretch of consecutive tokens of one sequence, its kv list positions [0, last].
    cdef int64_t i, r = 0, kv = 0, total
    qo_indptr[0] = 0
    kv_indptr[0] = 0
    for i in range(width):
        if i + 1 == width or seq_ids[i + 1] != seq_ids[i]:
            run_seq[r] = seq_ids[i]
            run_last[r] = positions[i]
            kv += positions[i] + 1
            r += 1
            qo_indptr[r] = i + 1
            kv_indptr[r] = kv
    total = r
    for i in range(width, pad_to):
        kv += 1
        total += 1
        qo_indptr[total] = i + 1
        kv_indptr[total] = kv
    for i in range(total + 1, pad_to + 1):
        qo_indptr[i] = pad_to
        kv_indptr[i] = kv
    return r


def fill_paged(table, seq_ids, positions, pad_to, sink, qo_indptr, kv_indptr, kv_indices):
    """Writes the paged view of a step placed in ``table``; returns (real runs, kv entries).

    ``qo_indptr`` and ``kv_indptr`` (int32, ``>= pad_to + 1`` entries) get entries
    ``[0, pad_to]``; ``kv_indices`` (int32) gets each real run's cells at positions
    ``[0, last]`` in position order, then one ``sink`` entry per padding row.
    """
    cdef CellTable t = _table_arg(table)
    cdef const int64_t[::1] ids = _in_vector(seq_ids, "seq_ids")
    cdef const int64_t[::1] pos = _in_vector(positions, "positions")
    cdef int64_t width = ids.shape[0], pad, snk, n_runs, r, q, k, s, n_kv, i
    cdef int32_t[::1] qo, kvp, kvi
    if pos.shape[0] != width or width == 0:
        raise InvalidArgument(f"positions has {pos.shape[0]} entries; seq_ids has {width}")
    pad = check_int(pad_to, "pad_to", width, t.max_write)
    snk = check_int(sink, "sink", 0, 2**31 - 1)
    for name, arr, n in (("qo_indptr", qo_indptr, pad + 1), ("kv_indptr", kv_indptr, pad + 1),
                         ("kv_indices", kv_indices, 0)):
        if not isinstance(arr, np.ndarray) or arr.dtype != np.int32 or arr.ndim != 1 \
                or not arr.flags.c_contiguous or not arr.flags.writeable or arr.shape[0] < n:
            raise InvalidArgument(
                f"{name} must be a writable contiguous 1-D int32 array of >= {n} entries")
    qo, kvp, kvi = qo_indptr, kv_indptr, kv_indices
    for k in range(width):
        s = ids[k]
        if not 0 <= s < t.max_seqs or not seq_is_live(t, s) or not 0 <= pos[k] < t.seq_pos_[s]:
            raise InvalidArgument(f"token {k} (sequence {s}, position {pos[k]}) is not placed")
    run_seq = np.empty(width, np.int64)
    run_last = np.empty(width, np.int64)
    qo64 = np.empty(pad + 1, np.int64)
    kv64 = np.empty(pad + 1, np.int64)
    cdef int64_t[::1] rs = run_seq, rl = run_last, q64 = qo64, k64 = kv64
    n_runs = plan_runs(&ids[0], &pos[0], width, pad, &q64[0], &k64[0], &rs[0], &rl[0])
    n_kv = k64[pad]
    if kvi.shape[0] < n_kv:
        raise InvalidArgument(f"kv_indices holds {kvi.shape[0]} entries; the step needs {n_kv}")
    for i in range(pad + 1):
        qo[i] = <int32_t>q64[i]
        kvp[i] = <int32_t>k64[i]
    k = 0
    for r in range(n_runs):
        s = rs[r]
        for q in range(rl[r] + 1):
            kvi[k] = <int32_t>t.seq_map[s][q]
            k += 1
    kvi[k:k + pad - width] = <int32_t>snk
    return n_runs, n_kv
