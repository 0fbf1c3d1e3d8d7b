"""The cell table at C speed: flat arrays, owner bitsets, a two-level free bitmap.

Same contract as :mod:`cellcache.reference`; the tests drive both side by side. The public
``def`` methods validate and raise; the ``cdef`` helpers trust their caller, and the
bounds-checked build (``CELLCACHE_CYTHON_DEBUG=1``) checks what each helper assumes.

Threads: every method runs with the GIL held from its first state change to its last, and
resolves all caller input (ids, ints, arrays, iterables) before the first state change, so
no other thread and no callback (``__index__``, ``__iter__``) can observe or change a
half-done operation. Each call is atomic; a sequence of calls is not (use one lock around
it, as :class:`cellcache.CellCache` does).

Costs: placement finds each free cell through the free bitmap a word at a time, skipping
full words through a summary with one bit per word. Every live sequence owns exactly one
cell at each position in ``[0, pos)``, so a per-sequence map from position to cell makes
``seq_clone`` cost the positions it shares, ``rewind`` the positions it drops and ``seq_rm``
the sequence's length, however its cells are spread over the pool; ``used_end`` shrinks by
searching the bitmap backwards, a word (or 4096 cells) at a time.

What a placed step looks like from the table (its masks, its runs, its paged view) is not
here: :mod:`cellcache._views` builds those from the arrays this table declares in its
``.pxd``, walking each query's window through the same position maps.
"""

from cpython.list cimport PyList_GET_ITEM
from cpython.tuple cimport PyTuple_GET_ITEM
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.stdlib cimport calloc, free, realloc
from libc.string cimport memset

from ._bitset cimport bit, bits_below, bits_from, cc_clz64, cc_ctz64

import numpy as np

from ._checks import POS_FREE as _POS_FREE_PY
from ._checks import (
    check_any_int,
    check_int,
    check_seq_id,
    check_table_shape,
    step_ids,
)
from .errors import InvalidArgument, InvalidState, OutOfMemory

cdef enum:
    POS_FREE = -1   # same value as cellcache._checks.POS_FREE

if _POS_FREE_PY != POS_FREE:
    raise ImportError("POS_FREE differs between cellcache._checks and cellcache._table")

cdef uint64_t ALL = ~(<uint64_t>0)
cdef object _np_ndarray = np.ndarray
cdef object _np_int64 = np.dtype(np.int64)


cdef void* _calloc(size_t n, size_t size, str what) except NULL:
    # n zeroed elements of size bytes (at least one); OutOfMemory naming what on failure.
    cdef void* p
    if n == 0:
        n = 1
    p = calloc(n, size)
    if p == NULL:
        raise OutOfMemory(f"could not allocate {n * size} bytes for the cell table's {what}")
    return p


#: Largest size (bytes) of the per-cell arrays that placement writes lazily (owner words,
#: owner counts, change marks) that a table touches when it is built, so that the steps do
#: not pay the kernel's first-write faults; a larger table leaves them to the steps.
cdef size_t PREFAULT_BYTES = 256 << 20


cdef inline uint64_t bits_upto(int64_t i) noexcept nogil:
    # Mask of bits [0, i % 64] of a word.
    return (bit(i) << 1) - 1


cdef inline bint _is_exact_int64_vector(object a):
    # (contiguous too: the fast path reads it as a typed contiguous view; a strided or
    # broadcast array goes the general way)
    return type(a) is _np_ndarray and a.ndim == 1 and a.dtype == _np_int64 and a.flags.c_contiguous


cdef class CellTable:
    """The cell table at C speed: a pool of per-token cells shared by many sequences.

    Parameters
    ----------
    capacity : int
        Number of cells (>= 1).
    max_seqs : int
        Sequence ids are ``[0, max_seqs)``; any value from 1 to 2**20 works.
    max_write : int or None
        Most tokens in one declared step (None: ``capacity``).
    track_changes : bool
        Keep a log of the cells whose ``pos`` or owners changed, for a device mirror
        (:meth:`take_changes`).

    Example
    -------
    >>> t = CellTable(16, max_seqs=4)
    >>> a = t.seq_new()
    >>> t.declare_step([a, a])
    True
    >>> cells, positions, read_len = t.place()
    >>> cells.tolist(), positions.tolist(), read_len
    ([0, 1], [0, 1], 2)
    """

    def __cinit__(self, capacity, max_seqs=64, max_write=None, *, bint track_changes=False):
        # Everything is allocated here, so a table either exists whole or not at all.
        cdef int64_t c
        self.capacity, self.max_seqs, self.max_write = check_table_shape(
            capacity, max_seqs, max_write)
        self.owner_words = (self.max_seqs + 63) // 64
        self.n_free_words = (self.capacity + 63) // 64
        self.n_sum_words = (self.n_free_words + 63) // 64
        cdef size_t cap = <size_t>self.capacity
        cdef size_t ns = <size_t>self.max_seqs
        cdef size_t mw = <size_t>self.max_write
        self.cell_pos = <int64_t*>_calloc(cap, sizeof(int64_t), "positions")
        self.owners = <uint64_t*>_calloc(cap * <size_t>self.owner_words, 8, "owner bitsets")
        self.n_owners = <int32_t*>_calloc(cap, sizeof(int32_t), "owner counts")
        self.free_bits = <uint64_t*>_calloc(<size_t>self.n_free_words, 8, "free bitmap")
        self.sum_free = <uint64_t*>_calloc(<size_t>self.n_sum_words, 8, "free summary")
        self.sum_used = <uint64_t*>_calloc(<size_t>self.n_sum_words, 8, "used summary")
        self.live_bits = <uint64_t*>_calloc(<size_t>self.owner_words, 8, "live ids")
        self.seq_pos_ = <int64_t*>_calloc(ns, sizeof(int64_t), "sequence positions")
        self.seq_map = <int64_t**>_calloc(ns, sizeof(int64_t*), "sequence maps")
        self.seq_map_cap = <int64_t*>_calloc(ns, sizeof(int64_t), "sequence maps")
        self.seq_declared = <uint8_t*>_calloc(ns, 1, "declaration marks")
        self.scratch = <int64_t*>_calloc(ns, sizeof(int64_t), "scratch")
        self.step_seq = <int64_t*>_calloc(mw, sizeof(int64_t), "declaration")
        self.ids_in = <int64_t*>_calloc(mw, sizeof(int64_t), "declaration")
        self.placed_cells = <int64_t*>_calloc(mw, sizeof(int64_t), "undo log")
        self.undo_pos = <int64_t*>_calloc(mw, sizeof(int64_t), "undo log")
        self.track_changes = track_changes
        if track_changes:
            self.cell_dirty = <uint8_t*>_calloc(cap, 1, "change log")
            self.dirty_cells = <int64_t*>_calloc(cap, sizeof(int64_t), "change log")
        for c in range(self.capacity):
            self.cell_pos[c] = POS_FREE
        # the other per-cell arrays are touched now too, when they are not huge: placement
        # writes each new cell's owner word, count and mark, and a page written for the first
        # time costs the kernel a fault, which would otherwise land on the steps that first
        # move into cells never used before (most of such a step's placement time)
        cdef size_t lazy = cap * (8 * <size_t>self.owner_words + 4 + (1 if track_changes else 0))
        if lazy <= PREFAULT_BYTES:
            memset(self.owners, 0, cap * 8 * <size_t>self.owner_words)
            memset(self.n_owners, 0, cap * sizeof(int32_t))
            if track_changes:
                memset(self.cell_dirty, 0, cap)
        self._reset()

    def __init__(self, capacity, max_seqs=64, max_write=None, *, bint track_changes=False):
        # Everything happened in __cinit__; this carries the signature for readers and stubs.
        pass

    def __dealloc__(self):
        cdef int64_t s
        if self.seq_map != NULL:
            for s in range(self.max_seqs):
                free(self.seq_map[s])
        free(self.seq_map)
        free(self.seq_map_cap)
        free(self.cell_pos)
        free(self.owners)
        free(self.n_owners)
        free(self.free_bits)
        free(self.sum_free)
        free(self.sum_used)
        free(self.live_bits)
        free(self.seq_pos_)
        free(self.seq_declared)
        free(self.scratch)
        free(self.step_seq)
        free(self.ids_in)
        free(self.placed_cells)
        free(self.undo_pos)
        free(self.cell_dirty)
        free(self.dirty_cells)

    def __reduce__(self):
        raise TypeError("a CellTable owns raw memory and cannot be pickled or copied")

    cdef void _reset(self) noexcept:
        # Everything free, no id live, nothing declared. Cells at or past used_end are
        # already free and unowned, so only [0, used_end) is rewritten.
        cdef int64_t c, w, s, end = self.used_end_
        for c in range(end):
            if self.cell_pos[c] != POS_FREE:
                self._mark(c)
            self.cell_pos[c] = POS_FREE
            self.n_owners[c] = 0
        for w in range(self.owner_words):
            memset(self.owners + w * self.capacity, 0, end * 8)
        memset(self.free_bits, 0xFF, self.n_free_words * 8)
        if self.capacity & 63:
            self.free_bits[self.n_free_words - 1] = bits_below(self.capacity)
        memset(self.sum_free, 0xFF, self.n_sum_words * 8)
        if self.n_free_words & 63:
            self.sum_free[self.n_sum_words - 1] = bits_below(self.n_free_words)
        memset(self.sum_used, 0, self.n_sum_words * 8)
        memset(self.live_bits, 0, self.owner_words * 8)
        for s in range(self.max_seqs):
            self.seq_pos_[s] = 0
            self._free_map(s)
            self.seq_declared[s] = 0
        self.n_live = 0
        self.used_count_ = 0
        self.used_end_ = 0
        self.step_width = 0
        self.has_step = False
        self.n_placed = 0

    # -- bitmap helpers (trust the caller) ------------------------------------------------
    cdef void _mark(self, int64_t c) noexcept:
        # Logs cell c (0 <= c < capacity) as changed, once, when change tracking is on.
        CC_ASSUME(0 <= c < self.capacity, "_mark: cell outside [0, capacity)")
        if self.track_changes and not self.cell_dirty[c]:
            self.cell_dirty[c] = 1
            self.dirty_cells[self.n_dirty] = c
            self.n_dirty += 1

    cdef void _mark_all(self) noexcept:
        # Logs every cell (a mirror that may have missed records is rebuilt from scratch).
        cdef int64_t c
        if self.track_changes:
            for c in range(self.capacity):
                self._mark(c)

    cdef uint64_t _valid(self, int64_t w) noexcept:
        # Bits of bitmap word w (0 <= w < n_free_words) that stand for real cells.
        CC_ASSUME(0 <= w < self.n_free_words, "_valid: word outside the bitmap")
        if w == self.n_free_words - 1 and (self.capacity & 63):
            return bits_below(self.capacity)
        return ALL

    cdef void _update_summaries(self, int64_t w) noexcept:
        # Makes both summary bits of bitmap word w agree with the word.
        cdef uint64_t word = self.free_bits[w]
        cdef int64_t sw = w >> 6
        CC_ASSUME(0 <= w < self.n_free_words, "_update_summaries: word outside the bitmap")
        if word:
            self.sum_free[sw] |= bit(w)
        else:
            self.sum_free[sw] &= ~bit(w)
        if (~word) & self._valid(w):
            self.sum_used[sw] |= bit(w)
        else:
            self.sum_used[sw] &= ~bit(w)

    cdef void _set_free(self, int64_t c) noexcept:
        # Marks cell c free in the bitmap and its summaries (pos and owners are the caller's).
        CC_ASSUME(0 <= c < self.capacity, "_set_free: cell outside [0, capacity)")
        self.free_bits[c >> 6] |= bit(c)
        self._update_summaries(c >> 6)

    cdef int64_t _next_free(self, int64_t c) noexcept:
        # The lowest free cell >= c (c >= 0), or -1 when there is none.
        cdef int64_t w = c >> 6, sw, ww
        cdef uint64_t m
        CC_ASSUME(c >= 0, "_next_free: negative start")
        if c >= self.capacity:
            return -1
        m = self.free_bits[w] & bits_from(c)
        if m:
            return (w << 6) + cc_ctz64(m)
        ww = w + 1
        if ww >= self.n_free_words:
            return -1
        sw = ww >> 6
        m = self.sum_free[sw] & bits_from(ww)
        while True:
            if m:
                ww = (sw << 6) + cc_ctz64(m)
                CC_ASSUME(self.free_bits[ww] != 0, "_next_free: summary names a full word")
                return (ww << 6) + cc_ctz64(self.free_bits[ww])
            sw += 1
            if sw >= self.n_sum_words:
                return -1
            m = self.sum_free[sw]

    cdef int64_t _last_used_below(self, int64_t e) noexcept:
        # The highest occupied cell < e (e <= capacity), or -1 when there is none.
        cdef int64_t c, w, sw, ww
        cdef uint64_t m
        CC_ASSUME(e <= self.capacity, "_last_used_below: end past capacity")
        if e <= 0:
            return -1
        c = e - 1
        w = c >> 6
        m = (~self.free_bits[w]) & bits_upto(c)
        if m:
            return (w << 6) + 63 - cc_clz64(m)
        ww = w - 1
        while ww >= 0:
            sw = ww >> 6
            m = self.sum_used[sw] & bits_upto(ww)
            if m:
                ww = (sw << 6) + 63 - cc_clz64(m)
                CC_ASSUME(((~self.free_bits[ww]) & self._valid(ww)) != 0,
                          "_last_used_below: summary names an empty word")
                return (ww << 6) + 63 - cc_clz64((~self.free_bits[ww]) & self._valid(ww))
            ww = (sw << 6) - 1
        return -1

    cdef void _shrink_used_end(self) noexcept:
        # Moves used_end down past trailing free cells (after cells were freed).
        if self.used_end_ > 0 and self.cell_pos[self.used_end_ - 1] == POS_FREE:
            self.used_end_ = self._last_used_below(self.used_end_) + 1

    cdef int64_t _lowest_non_live(self) noexcept:
        # The lowest id that is not live, or -1 when every id is live.
        cdef int64_t w, s
        cdef uint64_t m
        for w in range(self.owner_words):
            m = ~self.live_bits[w]
            if m:
                s = (w << 6) + cc_ctz64(m)
                return s if s < self.max_seqs else -1
        return -1

    cdef bint _is_live(self, int64_t s) noexcept:
        # Whether id s (0 <= s < max_seqs) is live.
        CC_ASSUME(0 <= s < self.max_seqs, "_is_live: id outside [0, max_seqs)")
        return (self.live_bits[s >> 6] & bit(s)) != 0

    cdef void _cancel_if_declared(self, int64_t seq) noexcept:
        # A verb is about to change seq's cells: drop the declaration if it names seq, and
        # end the chance to undo the last placement.
        self.n_placed = 0
        if self.has_step and self.seq_declared[seq]:
            self._drop_declaration()

    cdef void _drop_from(self, int64_t seq, int64_t position) noexcept:
        # Drops live seq's claim on its positions [position, pos), freeing cells left with no
        # owner. A sequence's cells come in runs, so the free bits of one bitmap word are
        # gathered in a register and written (with the word's summaries) once per run.
        cdef uint64_t* ow = self.owners + (seq >> 6) * self.capacity
        cdef int64_t* cell_pos = self.cell_pos
        cdef int32_t* n_owners = self.n_owners
        cdef int64_t* seq_map = self.seq_map[seq]
        cdef uint64_t nb = ~bit(seq), acc = 0
        cdef int64_t q, c, w, cur_w = -1, top = self.seq_pos_[seq], freed = 0
        cdef int32_t left
        cdef bint track = self.track_changes
        CC_ASSUME(self._is_live(seq), "_drop_from: sequence not live")
        CC_ASSUME(0 <= position, "_drop_from: negative position")
        if position >= top:
            return
        for q in range(position, top):
            c = seq_map[q]
            CC_ASSUME((ow[c] & bit(seq)) != 0, "_drop_from: map names a cell seq does not own")
            ow[c] &= nb
            left = n_owners[c] - 1
            n_owners[c] = left
            if left == 0:
                cell_pos[c] = POS_FREE
                w = c >> 6
                if w != cur_w:
                    if acc:
                        self.free_bits[cur_w] |= acc
                        self._update_summaries(cur_w)
                    cur_w = w
                    acc = 0
                acc |= bit(c)
                freed += 1
            if track:
                self._mark(c)
        if acc:
            self.free_bits[cur_w] |= acc
            self._update_summaries(cur_w)
        self.seq_pos_[seq] = position
        if freed:
            self.used_count_ -= freed
            self._shrink_used_end()

    cdef int _ensure_map(self, int64_t seq, int64_t n) except -1:
        # Room for n positions in seq's map (grown by doubling); OutOfMemory, nothing
        # changed, on failure.
        cdef int64_t cap = self.seq_map_cap[seq]
        cdef int64_t* grown
        if n <= cap:
            return 0
        if cap < 16:
            cap = 16
        while cap < n:
            cap *= 2
        grown = <int64_t*>realloc(self.seq_map[seq], <size_t>cap * sizeof(int64_t))
        if grown == NULL:
            raise OutOfMemory(f"could not grow the position map of sequence {seq} to {cap} entries")
        self.seq_map[seq] = grown
        self.seq_map_cap[seq] = cap
        return 0

    cdef void _free_map(self, int64_t seq) noexcept:
        # Releases seq's position map.
        free(self.seq_map[seq])
        self.seq_map[seq] = NULL
        self.seq_map_cap[seq] = 0

    cdef int64_t _seq(self, object value) except -1:
        # value as an id in [0, max_seqs); InvalidArgument otherwise. Runs no caller code for
        # a plain int.
        cdef int64_t s
        if type(value) is int:
            try:
                s = value
            except OverflowError:
                return check_seq_id(value, self.max_seqs)
            if 0 <= s < self.max_seqs:
                return s
        return check_seq_id(value, self.max_seqs)

    cdef void _drop_declaration(self) noexcept:
        # Nothing declared, no mark left, no placement to undo.
        cdef int64_t i
        if self.has_step:
            for i in range(self.step_width):
                self.seq_declared[self.step_seq[i]] = 0
        self.has_step = False
        self.step_width = 0
        self.n_placed = 0

    # -- queries ----------------------------------------------------------------------------
    @property
    def used_count(self):
        """Occupied cells."""
        return self.used_count_

    @property
    def used_end(self):
        """One past the highest occupied cell; 0 when every cell is free."""
        return self.used_end_

    @property
    def free_cells(self):
        """Free cells."""
        return self.capacity - self.used_count_

    @property
    def declared(self):
        """The declared step's sequence ids, or None."""
        if not self.has_step:
            return None
        return [self.step_seq[i] for i in range(self.step_width)]

    @property
    def declared_width(self):
        """Tokens in the declared step; 0 when nothing is declared."""
        return self.step_width if self.has_step else 0

    def live_seqs(self):
        """The live ids, ascending."""
        return [s for s in range(self.max_seqs) if self._is_live(s)]

    def pos(self, seq):
        """One past the newest position seq owns; 0 if it owns nothing or is not live."""
        cdef int64_t s = self._seq(seq)
        return self.seq_pos_[s] if self._is_live(s) else 0

    def seq_len(self, seq):
        """How many cells seq owns (0 if not live); always equal to ``pos(seq)``."""
        cdef int64_t s = self._seq(seq)
        return self.seq_pos_[s] if self._is_live(s) else 0

    def seq_cells(self, seq):
        """The cells seq owns, ascending."""
        cdef int64_t s = self._seq(seq)
        if not self._is_live(s):
            return []
        return sorted([self.seq_map[s][q] for q in range(self.seq_pos_[s])])

    def seq_cell_at(self, seq, position):
        """The cell holding ``position`` of seq; -1 when seq does not own that position."""
        cdef int64_t s = self._seq(seq)
        q = check_any_int(position, "position")
        if not self._is_live(s) or not 0 <= q < self.seq_pos_[s]:
            return -1
        return self.seq_map[s][<int64_t>q]

    def rows_share_cell(self, seq_ids, position):
        """Whether two consecutive entries of ``seq_ids`` (a step's sequence a row: a 1-D
        int64 array) are different live sequences holding the same cell at ``position`` (an
        int >= 0): what any grouping of decode rows by at least ``position + 1`` leading
        cells in common needs (shared-prefix attention, ``cellcache.torch.may_group``).
        InvalidArgument for anything but a 1-D int64 array of ids in ``[0, max_seqs)``, or a
        bad position."""
        cdef const int64_t[:] ids
        cdef Py_ssize_t i, n
        cdef int64_t s, c, q, prev = -1, prev_cell = -1
        if type(seq_ids) is not _np_ndarray or seq_ids.dtype != _np_int64 or seq_ids.ndim != 1:
            raise InvalidArgument(f"seq_ids must be a 1-D int64 array, not {type(seq_ids).__name__}"
                                  + (f" of {seq_ids.dtype}, {seq_ids.ndim}-D"
                                     if isinstance(seq_ids, _np_ndarray) else ""))
        q = check_int(position, "position", 0, (1 << 62))
        ids = seq_ids
        n = ids.shape[0]
        for i in range(n):
            if not 0 <= ids[i] < self.max_seqs:
                raise InvalidArgument(f"seq_ids[{i}] = {ids[i]} is outside [0, {self.max_seqs})")
        for i in range(n):
            s = ids[i]
            c = self.seq_map[s][q] if self._is_live(s) and self.seq_pos_[s] > q else -1
            if c >= 0 and s != prev and c == prev_cell:
                return True
            prev, prev_cell = s, c
        return False

    def cell_pos_at(self, c):
        """``pos`` of cell c (``POS_FREE`` when free)."""
        cdef int64_t cell = check_int(c, "cell", 0, self.capacity - 1)
        return self.cell_pos[cell]

    def cell_owners_at(self, c):
        """The owners of cell c, ascending."""
        cdef int64_t cell = check_int(c, "cell", 0, self.capacity - 1)
        return [s for s in range(self.max_seqs)
                if self.owners[(s >> 6) * self.capacity + cell] & bit(s)]

    # -- verbs --------------------------------------------------------------------------------
    def seq_new(self):
        """Returns the lowest id that is not live, now live and owning nothing; None if all are."""
        cdef int64_t s = self._lowest_non_live()
        if s < 0:
            return None
        self.live_bits[s >> 6] |= bit(s)
        self.n_live += 1
        self.n_placed = 0
        return s

    def seq_clone(self, src, upto=None):
        """Returns a new id co-owning src's cells with ``pos < upto`` (all if None).

        Returns None when src is not live, owns no cell, or every id is live. Nothing is
        copied but the position map: the new id's bit is set on the shared cells. Costs the
        number of positions shared.
        """
        cdef int64_t s = self._seq(src)
        cdef int64_t limit = -1 if upto is None else check_int(upto, "upto", 0, 2**62)
        cdef int64_t new, q, c, n
        cdef uint64_t* ow_new
        cdef uint64_t b_new
        cdef int64_t* src_map
        cdef int64_t* new_map
        cdef int32_t* n_owners = self.n_owners
        cdef bint track = self.track_changes
        if not self._is_live(s) or self.seq_pos_[s] == 0:
            return None
        new = self._lowest_non_live()
        if new < 0:
            return None
        n = self.seq_pos_[s]
        if 0 <= limit < n:
            n = limit
        self._ensure_map(new, n)
        self.live_bits[new >> 6] |= bit(new)
        self.n_live += 1
        self.n_placed = 0
        ow_new = self.owners + (new >> 6) * self.capacity
        b_new = bit(new)
        src_map = self.seq_map[s]
        new_map = self.seq_map[new]
        for q in range(n):
            c = src_map[q]
            new_map[q] = c
            ow_new[c] |= b_new
            n_owners[c] += 1
            if track:
                self._mark(c)
        self.seq_pos_[new] = n
        return new

    def seq_rm(self, seq):
        """Drops seq from every cell, frees cells left unowned, releases the id.

        Returns False (nothing changed) when seq is not live.
        """
        cdef int64_t s = self._seq(seq)
        if not self._is_live(s):
            return False
        self._cancel_if_declared(s)
        self._drop_from(s, 0)
        self.live_bits[s >> 6] &= ~bit(s)
        self.n_live -= 1
        self._free_map(s)
        return True

    def rewind(self, seq, position):
        """Drops seq's claim on positions >= position; the id stays live, even at 0.

        Returns False (nothing changed) when seq is not live or position is outside
        ``[0, pos(seq)]``; a position that is not an int raises InvalidArgument.
        """
        cdef int64_t s = self._seq(seq)
        p = check_any_int(position, "position")
        if not self._is_live(s) or not 0 <= p <= self.seq_pos_[s]:
            return False
        self._cancel_if_declared(s)
        self._drop_from(s, <int64_t>p)
        return True

    def clear(self):
        """Frees every cell, releases every id and drops the declaration."""
        self._reset()

    # -- steps --------------------------------------------------------------------------------
    def declare_step(self, seq_ids):
        """Declares the next step: one sequence id per token, in the forward's order.

        ``seq_ids`` is a list, tuple, range, 1-D integer array or other iterable of ids (at
        most ``max_write + 1`` items are read). Returns False (nothing declared) when fewer
        cells are free than tokens. Raises InvalidArgument (not a sequence of ids, empty,
        wider than max_write, bad id) or InvalidState (an id not live). Any earlier
        declaration is dropped, whatever the outcome.
        """
        cdef Py_ssize_t n
        try:
            n = self._collect(seq_ids)
        except BaseException:
            self._drop_declaration()
            raise
        return self._declare_collected(n)

    cdef Py_ssize_t _collect(self, object seq_ids) except -1:
        # Reads the ids into ids_in and returns how many; changes no other state. Caller code
        # (iterators, __index__) runs only inside step_ids(), before ids_in is written.
        cdef Py_ssize_t i, n
        cdef int64_t s
        cdef const int64_t[::1] view
        cdef list ids
        if type(seq_ids) is list or type(seq_ids) is tuple:
            n = len(seq_ids)
            if 0 < n <= self.max_write:
                for i in range(n):
                    # (borrowed: nothing here runs caller code, the GIL is held throughout)
                    item = <object>(PyList_GET_ITEM(seq_ids, i) if type(seq_ids) is list
                                    else PyTuple_GET_ITEM(seq_ids, i))
                    if type(item) is not int:
                        break
                    try:
                        s = item
                    except OverflowError:
                        break
                    if not 0 <= s < self.max_seqs:
                        break
                    self.ids_in[i] = s
                else:
                    return n
        elif _is_exact_int64_vector(seq_ids):
            view = seq_ids
            n = view.shape[0]
            if 0 < n <= self.max_write:
                for i in range(n):
                    if not 0 <= view[i] < self.max_seqs:
                        break
                    self.ids_in[i] = view[i]
                else:
                    return n
        ids = step_ids(seq_ids, self.max_write, self.max_seqs)
        n = len(ids)
        for i in range(n):
            self.ids_in[i] = ids[i]
        return n

    cdef object _declare_collected(self, Py_ssize_t n):
        # Declares ids_in[:n] (each in [0, max_seqs)) after dropping the old declaration.
        cdef Py_ssize_t i
        self._drop_declaration()
        for i in range(n):
            CC_ASSUME(0 <= self.ids_in[i] < self.max_seqs, "_declare_collected: bad id")
            if not self._is_live(self.ids_in[i]):
                raise InvalidState(f"sequence {self.ids_in[i]} is not live; call seq_new() first")
        if self.capacity - self.used_count_ < n:
            return False
        for i in range(n):
            self.step_seq[i] = self.ids_in[i]
            self.seq_declared[self.ids_in[i]] = 1
        self.step_width = n
        self.has_step = True
        return True

    def undeclare(self):
        """Drops the declaration, if any (what every declare_step does first)."""
        self._drop_declaration()

    def step_kv_entries(self):
        """Entries the paged view needs for the declared step (0 when nothing is declared).

        One run per maximal stretch of consecutive tokens of one sequence; a run's list
        holds its sequence's cells at positions ``[0, last]``, ``last`` the run's last
        position, so it has ``last + 1`` entries.
        """
        cdef int64_t i, s, total = 0
        if not self.has_step:
            return 0
        for i in range(self.step_width):
            s = self.step_seq[i]
            self.scratch[s] += 1
            if i + 1 == self.step_width or self.step_seq[i + 1] != s:
                total += self.seq_pos_[s] + self.scratch[s]
        for i in range(self.step_width):
            self.scratch[self.step_seq[i]] = 0
        return total

    cdef int64_t _place(self, int64_t* cells, int64_t* positions, int64_t* seq_ids) except -1:
        # Places the declared step into cells[:n], positions[:n] (and seq_ids[:n] when not
        # NULL); returns read_len. Every map is grown before the first cell is claimed, so an
        # OutOfMemory changes nothing.
        cdef int64_t i, j, n = self.step_width, s, c, p, w, cap = self.capacity
        cdef uint64_t m, taken
        cdef int64_t* step_seq = self.step_seq
        cdef int64_t* seq_pos = self.seq_pos_
        cdef int64_t* scratch = self.scratch
        cdef int64_t* cell_pos = self.cell_pos
        cdef uint64_t* owners = self.owners
        cdef int32_t* n_owners = self.n_owners
        cdef uint64_t* free_bits = self.free_bits
        if not self.has_step:
            raise InvalidState("no step is declared; call declare_step() first")
        for i in range(n):
            s = step_seq[i]
            positions[i] = seq_pos[s] + scratch[s]
            scratch[s] += 1
        try:
            for i in range(n):
                self._ensure_map(step_seq[i], positions[i] + 1)
        finally:
            for i in range(n):
                scratch[step_seq[i]] = 0
        # the n lowest free cells, a bitmap word at a time (its summaries once a word)
        i = 0
        c = self._next_free(0)
        while i < n:
            CC_ASSUME(c >= 0, "_place: declare_step saw enough free cells")
            w = c >> 6
            m = free_bits[w] & bits_from(c)
            taken = 0
            while m and i < n:
                j = cc_ctz64(m)
                cells[i] = (w << 6) + j
                i += 1
                taken |= (<uint64_t>1) << j
                m &= m - 1
            free_bits[w] &= ~taken
            self._update_summaries(w)
            if i < n:
                c = self._next_free((w + 1) << 6)
        self.undo_used_end = self.used_end_
        for i in range(n):
            c = cells[i]
            s = step_seq[i]
            p = positions[i]
            if seq_ids != NULL:
                seq_ids[i] = s
            self.undo_pos[i] = seq_pos[s]
            cell_pos[c] = p
            owners[(s >> 6) * cap + c] |= bit(s)
            n_owners[c] = 1
            self._mark(c)
            self.seq_map[s][p] = c
            if p + 1 > seq_pos[s]:
                seq_pos[s] = p + 1
            self.placed_cells[i] = c
            self.seq_declared[s] = 0
        self.used_count_ += n
        if c + 1 > self.used_end_:
            self.used_end_ = c + 1
        self.n_placed = n
        self.has_step = False
        return self.used_end_

    def place_into(self, cells, positions, seq_ids=None):
        """Places the declared step into ``cells[:width]`` and ``positions[:width]`` (and its
        ids into ``seq_ids[:width]`` when given): writable contiguous int64 arrays.

        Returns read_len (``used_end`` after placement). The step is consumed; see
        :meth:`undo_place`.
        """
        cdef int64_t[::1] c_view, p_view, s_view
        cdef Py_ssize_t n
        c_view = _out_vector(cells, "cells")
        p_view = _out_vector(positions, "positions")
        if seq_ids is not None:
            s_view = _out_vector(seq_ids, "seq_ids")
        # the declaration is read only now: resolving the outputs can run the caller's code
        # (an ndarray subclass's properties, another thread taking the GIL) that declares
        # another step, and a width read before it would place past the outputs' end
        n = self.step_width
        if not self.has_step:
            raise InvalidState("no step is declared; call declare_step() first")
        if c_view.shape[0] < n or p_view.shape[0] < n or (
                seq_ids is not None and s_view.shape[0] < n):
            raise InvalidArgument(
                f"output arrays hold fewer entries than the declared step's {n}")
        # placement reads back what it wrote (positions, then cells), so the outputs' first
        # n entries must not share memory
        if overlaps(&c_view[0], 8 * n, &p_view[0], 8 * n):
            raise InvalidArgument("cells and positions share memory; give separate arrays")
        if seq_ids is not None and (overlaps(&s_view[0], 8 * n, &c_view[0], 8 * n)
                                    or overlaps(&s_view[0], 8 * n, &p_view[0], 8 * n)):
            raise InvalidArgument(
                "seq_ids shares memory with cells or positions; give separate arrays")
        return self._place(&c_view[0], &p_view[0], NULL if seq_ids is None else &s_view[0])

    def place(self):
        """Places the declared step: returns (cells, positions, read_len), arrays of int64."""
        if not self.has_step:
            raise InvalidState("no step is declared; call declare_step() first")
        cells = np.empty(self.step_width, dtype=np.int64)
        positions = np.empty(self.step_width, dtype=np.int64)
        read_len = self.place_into(cells, positions)
        return cells, positions, read_len

    def undo_place(self):
        """Takes back the last placement: its cells are free again and the step is declared.

        Only valid straight after :meth:`place` (any verb or declaration in between makes
        it an InvalidState).
        """
        cdef int64_t i, c, s
        if self.n_placed == 0:
            raise InvalidState("nothing was placed since the last verb or declaration")
        for i in range(self.n_placed):
            c = self.placed_cells[i]
            s = self.step_seq[i]
            self.owners[(s >> 6) * self.capacity + c] &= ~bit(s)
            self.n_owners[c] = 0
            self.cell_pos[c] = POS_FREE
            self._set_free(c)
            self._mark(c)
        for i in range(self.n_placed - 1, -1, -1):
            s = self.step_seq[i]
            self.seq_pos_[s] = self.undo_pos[i]
            self.seq_declared[s] = 1
        self.used_count_ -= self.n_placed
        self.used_end_ = self.undo_used_end
        self.step_width = self.n_placed
        self.has_step = True
        self.n_placed = 0

    # -- change log for a device mirror -------------------------------------------------------------
    @property
    def n_changes(self):
        """Cells in the change log (0 unless built with track_changes)."""
        return self.n_dirty

    cdef int64_t _export_changes(self, int64_t* records, int64_t max_n) noexcept:
        # Pops up to max_n logged cells into records of (2 + owner_words) int64 each:
        # {cell, pos, owner word 0, ...}; returns how many were written.
        cdef int64_t n = 0, c, w, stride = 2 + self.owner_words
        cdef int64_t* rec
        while self.n_dirty > 0 and n < max_n:
            self.n_dirty -= 1
            c = self.dirty_cells[self.n_dirty]
            self.cell_dirty[c] = 0
            rec = records + n * stride
            rec[0] = c
            rec[1] = self.cell_pos[c]
            for w in range(self.owner_words):
                rec[2 + w] = <int64_t>self.owners[w * self.capacity + c]
            n += 1
        return n

    def take_changes(self):
        """The cells whose pos or owners changed since the last call, ascending; clears the log."""
        cdef int64_t i
        cells = np.array([self.dirty_cells[i] for i in range(self.n_dirty)], dtype=np.int64)
        for i in range(self.n_dirty):
            self.cell_dirty[self.dirty_cells[i]] = 0
        self.n_dirty = 0
        cells.sort()
        return cells

    # -- observation -----------------------------------------------------------------------------
    def snapshot(self):
        """The whole observable state, in the same form as ReferenceTable.snapshot()."""
        return {
            "pos": [self.cell_pos[c] for c in range(self.capacity)],
            "owners": [self.cell_owners_at(c) for c in range(self.capacity)],
            "live": self.live_seqs(),
            "used_end": self.used_end_,
            "free_cells": self.capacity - self.used_count_,
            "seq_pos": [self.pos(s) for s in range(self.max_seqs)],
            "seq_len": [self.seq_len(s) for s in range(self.max_seqs)],
            "declared": self.declared,
        }

    def positions_array(self):
        """A copy of every cell's pos, as an int64 array of length capacity."""
        out = np.empty(self.capacity, dtype=np.int64)
        cdef int64_t[::1] v = out
        cdef int64_t c
        for c in range(self.capacity):
            v[c] = self.cell_pos[c]
        return out

    def owner_words_array(self):
        """A copy of the owner bitsets, uint64 of shape [owner_words, capacity] (word-major)."""
        out = np.empty((self.owner_words, self.capacity), dtype=np.uint64)
        cdef uint64_t[:, ::1] v = out
        cdef int64_t w, c
        for w in range(self.owner_words):
            for c in range(self.capacity):
                v[w, c] = self.owners[w * self.capacity + c]
        return out

    def check_invariants(self):
        """Verifies every invariant; raises AssertionError naming the first broken one.

        pos/owner agreement, owner counts, the free bitmap and its summaries, used_count and
        used_end, owners all live, declaration marks, and for every live sequence that it
        owns exactly one cell at each position in [0, pos) and that its map names them.
        """
        cdef int64_t c, w, s, used = 0, end = 0, n, p, marked = 0
        cdef int32_t cnt
        cdef bint free_bit
        cdef uint64_t word, valid
        for c in range(self.capacity):
            cnt = 0
            for w in range(self.owner_words):
                word = self.owners[w * self.capacity + c]
                while word:
                    s = (w << 6) + cc_ctz64(word)
                    word &= word - 1
                    if s >= self.max_seqs or not self._is_live(s):
                        raise AssertionError(f"cell {c} is owned by sequence {s}, not live")
                    cnt += 1
            if cnt != self.n_owners[c]:
                raise AssertionError(f"cell {c}: owner count {self.n_owners[c]} but {cnt} bits")
            free_bit = (self.free_bits[c >> 6] & bit(c)) != 0
            if (self.cell_pos[c] == POS_FREE) != (cnt == 0):
                raise AssertionError(f"cell {c}: pos {self.cell_pos[c]} with {cnt} owners")
            if self.cell_pos[c] < POS_FREE:
                raise AssertionError(f"cell {c}: pos {self.cell_pos[c]} is negative")
            if free_bit != (cnt == 0):
                raise AssertionError(f"cell {c}: free bit {free_bit} with {cnt} owners")
            if cnt:
                used += 1
                end = c + 1
        if self.capacity & 63 and self.free_bits[self.n_free_words - 1] & ~bits_below(self.capacity):
            raise AssertionError("free bitmap has bits past capacity")
        for w in range(self.n_free_words):
            valid = self._valid(w)
            if ((self.sum_free[w >> 6] & bit(w)) != 0) != (self.free_bits[w] != 0):
                raise AssertionError(f"free summary disagrees with bitmap word {w}")
            if ((self.sum_used[w >> 6] & bit(w)) != 0) != (((~self.free_bits[w]) & valid) != 0):
                raise AssertionError(f"used summary disagrees with bitmap word {w}")
        if used != self.used_count_:
            raise AssertionError(f"used_count {self.used_count_} but {used} cells are occupied")
        if end != self.used_end_:
            raise AssertionError(f"used_end {self.used_end_} but the highest used cell ends at {end}")
        n = 0
        for s in range(self.max_seqs):
            marked += self.seq_declared[s] != 0
            if not self._is_live(s):
                if self.seq_pos_[s] or self.seq_map[s] != NULL:
                    raise AssertionError(f"sequence {s} is not live but has a position map")
                if self.seq_declared[s]:
                    raise AssertionError(f"sequence {s} is not live but is marked declared")
                continue
            n += 1
            self._check_sequence(s)
        if n != self.n_live:
            raise AssertionError(f"n_live {self.n_live} but {n} ids are live")
        for s in range(self.max_seqs):
            if self.scratch[s]:
                raise AssertionError(f"scratch counter of sequence {s} is not zero")
        if self.has_step:
            for p in range(self.step_width):
                if not self._is_live(self.step_seq[p]):
                    raise AssertionError(f"declared sequence {self.step_seq[p]} is not live")
                if not self.seq_declared[self.step_seq[p]]:
                    raise AssertionError(f"declared sequence {self.step_seq[p]} is not marked")
            if marked != len(set(self.declared)):
                raise AssertionError(f"{marked} sequences marked declared; the step names "
                                     f"{len(set(self.declared))}")
        elif marked:
            raise AssertionError(f"{marked} sequences marked declared with nothing declared")
        if self.track_changes:
            for c in range(self.n_dirty):
                if not self.cell_dirty[self.dirty_cells[c]]:
                    raise AssertionError(f"change log entry {c} is not flagged")

    cdef int _check_sequence(self, int64_t s) except -1:
        cdef uint64_t* ow = self.owners + (s >> 6) * self.capacity
        cdef uint64_t b = bit(s)
        cdef int64_t c, q, count = 0, n = self.seq_pos_[s]
        if n > self.seq_map_cap[s]:
            raise AssertionError(f"sequence {s}: pos {n} past its map's {self.seq_map_cap[s]}")
        for q in range(n):
            c = self.seq_map[s][q]
            if not 0 <= c < self.capacity:
                raise AssertionError(f"sequence {s}: position {q} maps to cell {c}")
            if self.cell_pos[c] != q or not (ow[c] & b):
                raise AssertionError(
                    f"sequence {s}: position {q} maps to cell {c}, which holds pos "
                    f"{self.cell_pos[c]} and {'has' if ow[c] & b else 'lacks'} its bit")
        for c in range(self.capacity):
            if ow[c] & b:
                count += 1
        if count != n:
            raise AssertionError(f"sequence {s} owns {count} cells but pos is {n}")
        return 0


cdef int64_t[::1] _out_vector(object a, str name) except *:
    # a as a writable view of a contiguous 1-D int64 array; InvalidArgument otherwise.
    if not isinstance(a, np.ndarray) or a.dtype != np.int64 or a.ndim != 1 \
            or not a.flags.c_contiguous or not a.flags.writeable:
        raise InvalidArgument(f"{name} must be a writable contiguous 1-D int64 array")
    return a
