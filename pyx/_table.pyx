"""The cell table at C speed: flat arrays, owner bitsets, a two-level free bitmap.

Same contract as :mod:`cellcache.reference` (SPEC §3); the tests drive both side by side.
The public ``def`` methods validate and raise; the ``cdef ... nogil`` helpers trust them.

Costs: placement finds each free cell through the free bitmap a word at a time, skipping
full words through a summary with one bit per word. Every live sequence owns exactly one
cell at each position in ``[0, pos)``, so a per-sequence map from position to cell makes
``seq_clone`` cost the positions it shares, ``rewind`` the positions it drops and ``seq_rm``
the sequence's length, however its cells are spread over the pool; ``used_end`` shrinks by
searching the bitmap backwards, a word (or 4096 cells) at a time. The host mask fill walks
each query's window through the same map.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport INT64_MAX, int32_t, int64_t, uint8_t, uint64_t
from libc.stdlib cimport calloc, free, realloc
from libc.string cimport memset

from ._bitset cimport bit, bits_below, bits_from, cc_clz64, cc_ctz64

import numpy as np

from ._checks import POS_FREE as _POS_FREE_PY
from ._checks import check_int, check_seq_id, check_table_shape
from .errors import InvalidArgument, InvalidState, OutOfMemory

cdef enum:
    POS_FREE = -1   # same value as cellcache._checks.POS_FREE (a test checks)

assert _POS_FREE_PY == POS_FREE

cdef uint64_t ALL = ~(<uint64_t>0)


cdef void* _calloc(size_t n, size_t size, str what) except NULL:
    cdef void* p
    if n == 0:
        n = 1
    p = calloc(n, size)
    if p == NULL:
        raise OutOfMemory(f"could not allocate {n * size} bytes for the cell table's {what}")
    return p


cdef inline uint64_t bits_upto(int64_t i) noexcept nogil:
    # Mask of bits [0, i % 64] of a word.
    return (bit(i) << 1) - 1


cdef class CellTable:
    """The cell table of SPEC §3 at C speed.

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

    def __init__(self, capacity, max_seqs=64, max_write=None, *, bint track_changes=False):
        cdef int64_t c
        if self.cell_pos != NULL:
            raise InvalidState("a CellTable is initialised once")
        self.capacity, self.max_seqs, self.max_write = check_table_shape(
            capacity, max_seqs, max_write
        )
        self.owner_words = (self.max_seqs + 63) // 64
        self.n_free_words = (self.capacity + 63) // 64
        self.n_sum_words = (self.n_free_words + 63) // 64
        cdef size_t cap = <size_t>self.capacity
        cdef size_t ns = <size_t>self.max_seqs
        self.cell_pos = <int64_t*>_calloc(cap, sizeof(int64_t), "positions")
        self.owners = <uint64_t*>_calloc(cap * <size_t>self.owner_words, 8, "owner bitsets")
        self.n_owners = <int32_t*>_calloc(cap, sizeof(int32_t), "owner counts")
        self.free_bits = <uint64_t*>_calloc(<size_t>self.n_free_words, 8, "free bitmap")
        self.sum_free = <uint64_t*>_calloc(<size_t>self.n_sum_words, 8, "free summary")
        self.sum_used = <uint64_t*>_calloc(<size_t>self.n_sum_words, 8, "used summary")
        self.live_bits = <uint64_t*>_calloc(<size_t>self.owner_words, 8, "live ids")
        self.seq_cells_ = <int64_t*>_calloc(ns, sizeof(int64_t), "sequence summaries")
        self.seq_pos_ = <int64_t*>_calloc(ns, sizeof(int64_t), "sequence summaries")
        self.seq_map = <int64_t**>_calloc(ns, sizeof(int64_t*), "sequence maps")
        self.seq_map_cap = <int64_t*>_calloc(ns, sizeof(int64_t), "sequence maps")
        self.seq_declared = <uint8_t*>_calloc(ns, 1, "declaration marks")
        self.scratch = <int64_t*>_calloc(ns, sizeof(int64_t), "scratch")
        self.decl = <int64_t*>_calloc(<size_t>self.max_write, sizeof(int64_t), "declaration")
        self.placed_cells = <int64_t*>_calloc(<size_t>self.max_write, sizeof(int64_t), "undo")
        self.undo_summary = <int64_t*>_calloc(<size_t>self.max_write * 2, sizeof(int64_t), "undo")
        self.track_changes = track_changes
        if track_changes:
            self.cell_dirty = <uint8_t*>_calloc(cap, 1, "change log")
            self.dirty_cells = <int64_t*>_calloc(cap, sizeof(int64_t), "change log")
        for c in range(self.capacity):
            self.cell_pos[c] = POS_FREE
        self._reset()

    def __dealloc__(self):
        cdef int64_t s
        if self.seq_map != NULL:
            for s in range(self.max_seqs):
                free(self.seq_map[s])
        free(self.seq_map); free(self.seq_map_cap)
        free(self.cell_pos); free(self.owners); free(self.n_owners)
        free(self.free_bits); free(self.sum_free); free(self.sum_used); free(self.live_bits)
        free(self.seq_cells_); free(self.seq_pos_)
        free(self.seq_declared); free(self.scratch); free(self.decl)
        free(self.placed_cells); free(self.undo_summary)
        free(self.cell_dirty); free(self.dirty_cells)

    cdef void _reset_cells(self, int64_t end) noexcept nogil:
        # Frees cells [0, end) and clears the owner words of that range.
        cdef int64_t c, w
        for c in range(end):
            self.cell_pos[c] = POS_FREE
            self.n_owners[c] = 0
        for w in range(self.owner_words):
            memset(self.owners + w * self.capacity, 0, end * 8)

    cdef void _reset(self) noexcept nogil:
        # Everything free, no id live, nothing declared. Cells at or past used_end are
        # already free and unowned, so only [0, used_end) needs rewriting.
        cdef int64_t c, w, s
        if self.track_changes:
            for c in range(self.used_end_):
                if self.cell_pos[c] != POS_FREE:
                    self._mark(c)
        self._reset_cells(self.used_end_)
        memset(self.free_bits, 0xFF, self.n_free_words * 8)
        if self.capacity & 63:
            self.free_bits[self.n_free_words - 1] = bits_below(self.capacity)
        memset(self.sum_free, 0xFF, self.n_sum_words * 8)
        if self.n_free_words & 63:
            self.sum_free[self.n_sum_words - 1] = bits_below(self.n_free_words)
        memset(self.sum_used, 0, self.n_sum_words * 8)
        memset(self.live_bits, 0, self.owner_words * 8)
        for s in range(self.max_seqs):
            self.seq_cells_[s] = 0
            self.seq_pos_[s] = 0
            self._free_map(s)
            self.seq_declared[s] = 0
        self.n_live = 0
        self.used_count_ = 0
        self.used_end_ = 0
        self.n_decl = 0
        self.declared_ = False
        self.n_placed = 0

    # -- bitmap helpers (trust the caller) ------------------------------------------------
    cdef void _mark(self, int64_t c) noexcept nogil:
        if self.track_changes and not self.cell_dirty[c]:
            self.cell_dirty[c] = 1
            self.dirty_cells[self.n_dirty] = c
            self.n_dirty += 1

    cdef uint64_t _valid(self, int64_t w) noexcept nogil:
        # Bits of bitmap word w that stand for real cells.
        if w == self.n_free_words - 1 and (self.capacity & 63):
            return bits_below(self.capacity)
        return ALL

    cdef void _update_summaries(self, int64_t w) noexcept nogil:
        cdef uint64_t word = self.free_bits[w]
        cdef int64_t sw = w >> 6
        if word:
            self.sum_free[sw] |= bit(w)
        else:
            self.sum_free[sw] &= ~bit(w)
        if (~word) & self._valid(w):
            self.sum_used[sw] |= bit(w)
        else:
            self.sum_used[sw] &= ~bit(w)

    cdef void _set_free(self, int64_t c) noexcept nogil:
        self.free_bits[c >> 6] |= bit(c)
        self._update_summaries(c >> 6)

    cdef void _set_used(self, int64_t c) noexcept nogil:
        self.free_bits[c >> 6] &= ~bit(c)
        self._update_summaries(c >> 6)

    cdef int64_t _next_free(self, int64_t c) noexcept nogil:
        # The lowest free cell >= c, or -1.
        cdef int64_t w = c >> 6, sw, ww
        cdef uint64_t m
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
                return (ww << 6) + cc_ctz64(self.free_bits[ww])
            sw += 1
            if sw >= self.n_sum_words:
                return -1
            m = self.sum_free[sw]

    cdef int64_t _last_used_below(self, int64_t e) noexcept nogil:
        # The highest occupied cell < e, or -1.
        cdef int64_t c, w, sw, ww
        cdef uint64_t m
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
                return (ww << 6) + 63 - cc_clz64((~self.free_bits[ww]) & self._valid(ww))
            ww = (sw << 6) - 1
        return -1

    cdef void _shrink_used_end(self) noexcept nogil:
        if self.used_end_ > 0 and self.cell_pos[self.used_end_ - 1] == POS_FREE:
            self.used_end_ = self._last_used_below(self.used_end_) + 1

    cdef int64_t _lowest_non_live(self) noexcept nogil:
        cdef int64_t w, s
        cdef uint64_t m
        for w in range(self.owner_words):
            m = ~self.live_bits[w]
            if m:
                s = (w << 6) + cc_ctz64(m)
                return s if s < self.max_seqs else -1
        return -1

    cdef bint _is_live(self, int64_t s) noexcept nogil:
        return (self.live_bits[s >> 6] & bit(s)) != 0

    cdef void _cancel_if_declared(self, int64_t seq) noexcept nogil:
        cdef int64_t i
        self.n_placed = 0
        if self.declared_ and self.seq_declared[seq]:
            for i in range(self.n_decl):
                self.seq_declared[self.decl[i]] = 0
            self.declared_ = False
            self.n_decl = 0

    cdef void _drop_from(self, int64_t seq, int64_t position) noexcept nogil:
        # Drops seq's claim on its positions [position, pos), freeing cells left unowned.
        # A sequence's cells come in runs, so the free bits of one bitmap word are gathered
        # in a register and written (with the word's summaries) once per run, not per cell.
        cdef uint64_t* ow = self.owners + (seq >> 6) * self.capacity
        cdef int64_t* cell_pos = self.cell_pos
        cdef int32_t* n_owners = self.n_owners
        cdef int64_t* seq_map = self.seq_map[seq]
        cdef uint64_t nb = ~bit(seq), acc = 0
        cdef int64_t q, c, w, cur_w = -1, top = self.seq_pos_[seq], freed = 0
        cdef int32_t left
        cdef bint track = self.track_changes
        if position >= top:
            return
        for q in range(position, top):
            c = seq_map[q]
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
        self.seq_cells_[seq] = position
        self.seq_pos_[seq] = position
        if freed:
            self.used_count_ -= freed
            self._shrink_used_end()

    cdef int _ensure_map(self, int64_t seq, int64_t n) except -1:
        # Room for n positions in seq's map (grown by doubling); OutOfMemory on failure.
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

    cdef void _free_map(self, int64_t seq) noexcept nogil:
        free(self.seq_map[seq])
        self.seq_map[seq] = NULL
        self.seq_map_cap[seq] = 0

    cdef int64_t _seq(self, object value) except -1:
        # Fast path for plain ints; anything else goes through the shared check.
        cdef int64_t s
        if type(value) is int:
            try:
                s = value
            except OverflowError:
                return check_seq_id(value, self.max_seqs)
            if 0 <= s < self.max_seqs:
                return s
        return check_seq_id(value, self.max_seqs)

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
        if not self.declared_:
            return None
        return [self.decl[i] for i in range(self.n_decl)]

    def live_seqs(self):
        """The live ids, ascending."""
        return [s for s in range(self.max_seqs) if self._is_live(s)]

    def pos(self, seq):
        """One past the newest position seq owns; 0 if it owns nothing or is not live."""
        cdef int64_t s = self._seq(seq)
        return self.seq_pos_[s] if self._is_live(s) else 0

    def seq_len(self, seq):
        """How many cells seq owns (0 if not live)."""
        cdef int64_t s = self._seq(seq)
        return self.seq_cells_[s] if self._is_live(s) else 0

    def seq_cells(self, seq):
        """The cells seq owns, ascending."""
        cdef int64_t s = self._seq(seq)
        if not self._is_live(s):
            return []
        return sorted([self.seq_map[s][q] for q in range(self.seq_pos_[s])])

    def seq_cell_at(self, seq, position):
        """The cell holding ``position`` of seq; -1 when seq does not own that position."""
        cdef int64_t s = self._seq(seq)
        cdef int64_t q = check_int(position, "position", -(2**62), 2**62)
        if not self._is_live(s) or not 0 <= q < self.seq_pos_[s]:
            return -1
        return self.seq_map[s][q]

    def cell_pos_at(self, int64_t c):
        """``pos`` of cell c (``POS_FREE`` when free)."""
        if not 0 <= c < self.capacity:
            raise InvalidArgument(f"cell {c} is outside [0, capacity={self.capacity})")
        return self.cell_pos[c]

    def cell_owners_at(self, int64_t c):
        """The owners of cell c, ascending."""
        if not 0 <= c < self.capacity:
            raise InvalidArgument(f"cell {c} is outside [0, capacity={self.capacity})")
        return [s for s in range(self.max_seqs)
                if self.owners[(s >> 6) * self.capacity + c] & bit(s)]

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
        if not self._is_live(s) or self.seq_cells_[s] == 0:
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
        with nogil:
            for q in range(n):
                c = src_map[q]
                new_map[q] = c
                ow_new[c] |= b_new
                n_owners[c] += 1
                if track:
                    self._mark(c)
        self.seq_cells_[new] = n
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
        with nogil:
            self._drop_from(s, 0)
        self.live_bits[s >> 6] &= ~bit(s)
        self.n_live -= 1
        self._free_map(s)
        return True

    def rewind(self, seq, position):
        """Drops seq's claim on positions >= position; the id stays live, even at 0.

        Returns False (nothing changed) when seq is not live or position is outside
        ``[0, pos(seq)]``.
        """
        cdef int64_t s = self._seq(seq)
        cdef int64_t p = check_int(position, "position", -(2**62), 2**62)
        if not self._is_live(s) or p < 0 or p > self.seq_pos_[s]:
            return False
        self._cancel_if_declared(s)
        with nogil:
            self._drop_from(s, p)
        return True

    def clear(self):
        """Frees every cell, releases every id and drops the declaration."""
        self._reset()

    # -- steps --------------------------------------------------------------------------------
    def declare_step(self, seq_ids):
        """Declares the next step: one sequence id per token, in the forward's order.

        Returns False (nothing declared) when fewer cells are free than tokens. Raises
        InvalidArgument (empty, wider than max_write, bad id) or InvalidState (an id not
        live). Any earlier declaration is dropped first, whatever the outcome.
        """
        cdef Py_ssize_t i, n
        cdef int64_t s
        cdef const int64_t[::1] view
        self._drop_declaration()
        if isinstance(seq_ids, (list, tuple)):
            ids = seq_ids
        else:
            try:
                view = seq_ids
            except (TypeError, ValueError, BufferError):
                ids = list(seq_ids)
            else:
                return self._declare_view(view)
        n = len(ids)
        self._check_width(n)
        for i in range(n):
            self.decl[i] = self._seq(ids[i])
        return self._declare_checked(n)

    cdef object _declare_view(self, const int64_t[::1] view):
        cdef Py_ssize_t i, n = view.shape[0]
        self._check_width(n)
        for i in range(n):
            if not 0 <= view[i] < self.max_seqs:
                check_seq_id(int(view[i]), self.max_seqs)
            self.decl[i] = view[i]
        return self._declare_checked(n)

    cdef int _check_width(self, Py_ssize_t n) except -1:
        if n == 0:
            raise InvalidArgument("a step needs at least one token; got an empty list")
        if n > self.max_write:
            raise InvalidArgument(
                f"a step of {n} tokens is wider than max_write={self.max_write}")
        return 0

    cdef object _declare_checked(self, Py_ssize_t n):
        cdef Py_ssize_t i
        for i in range(n):
            if not self._is_live(self.decl[i]):
                raise InvalidState(f"sequence {self.decl[i]} is not live; call seq_new() first")
        if self.capacity - self.used_count_ < n:
            return False
        for i in range(n):
            self.seq_declared[self.decl[i]] = 1
        self.n_decl = n
        self.declared_ = True
        return True

    cdef void _drop_declaration(self) noexcept:
        cdef int64_t i
        if self.declared_:
            for i in range(self.n_decl):
                self.seq_declared[self.decl[i]] = 0
        self.declared_ = False
        self.n_decl = 0
        self.n_placed = 0

    @property
    def declared_width(self):
        """Tokens in the declared step; 0 when nothing is declared."""
        return self.n_decl if self.declared_ else 0

    cdef int64_t _place(self, int64_t* cells, int64_t* positions, int64_t* seq_ids) except -1:
        # Places the declared step into cells[:n], positions[:n] (and seq_ids[:n] when not
        # NULL); returns read_len. Nothing is claimed until every cell is found.
        cdef int64_t i, n = self.n_decl, s, c
        cdef int64_t* u
        if not self.declared_:
            raise InvalidState("no step is declared; call declare_step() first")
        with nogil:
            for i in range(n):
                s = self.decl[i]
                positions[i] = self.seq_pos_[s] + self.scratch[s]
                self.scratch[s] += 1
            for i in range(n):
                self.scratch[self.decl[i]] = 0
        for i in range(n):
            self._ensure_map(self.decl[i], positions[i] + 1)
        with nogil:
            c = -1
            for i in range(n):
                s = self.decl[i]
                c = self._next_free(c + 1)
                cells[i] = c
                u = self.undo_summary + 2 * i
                u[0] = self.seq_cells_[s]
                u[1] = self.seq_pos_[s]
        if c < 0:  # declare_step saw enough free cells and nothing claims cells since
            raise AssertionError("placement found too few free cells")
        self.undo_used_end = self.used_end_
        with nogil:
            for i in range(n):
                c = cells[i]
                s = self.decl[i]
                if seq_ids != NULL:
                    seq_ids[i] = s
                self.cell_pos[c] = positions[i]
                self.owners[(s >> 6) * self.capacity + c] |= bit(s)
                self.n_owners[c] = 1
                self._set_used(c)
                self._mark(c)
                self.seq_map[s][positions[i]] = c
                self.seq_cells_[s] += 1
                if positions[i] + 1 > self.seq_pos_[s]:
                    self.seq_pos_[s] = positions[i] + 1
                self.placed_cells[i] = c
                self.seq_declared[s] = 0
            self.used_count_ += n
            if c + 1 > self.used_end_:
                self.used_end_ = c + 1
        self.n_placed = n
        self.declared_ = False
        return self.used_end_

    def place_into(self, int64_t[::1] cells not None, int64_t[::1] positions not None,
                   int64_t[::1] seq_ids=None):
        """Places the declared step into ``cells[:width]`` and ``positions[:width]`` (and its
        ids into ``seq_ids[:width]`` when given).

        Returns read_len (``used_end`` after placement). The step is consumed; see
        :meth:`undo_place`.
        """
        cdef Py_ssize_t n = self.n_decl
        if cells.shape[0] < n or positions.shape[0] < n or (
                seq_ids is not None and seq_ids.shape[0] < n):
            raise InvalidArgument(
                f"output arrays hold fewer entries than the declared step's {n}")
        if n == 0:
            raise InvalidState("no step is declared; call declare_step() first")
        return self._place(&cells[0], &positions[0], NULL if seq_ids is None else &seq_ids[0])

    def place(self):
        """Places the declared step: returns (cells, positions, read_len), arrays of int64."""
        if not self.declared_:
            raise InvalidState("no step is declared; call declare_step() first")
        cells = np.empty(self.n_decl, dtype=np.int64)
        positions = np.empty(self.n_decl, dtype=np.int64)
        read_len = self.place_into(cells, positions)
        return cells, positions, read_len

    def undo_place(self):
        """Takes back the last placement: its cells are free again and the step is declared.

        Only valid straight after :meth:`place` (any verb or declaration in between makes
        it an InvalidState).
        """
        cdef int64_t i, c, s
        cdef int64_t* u
        if self.n_placed == 0:
            raise InvalidState("nothing was placed since the last verb or declaration")
        for i in range(self.n_placed):
            c = self.placed_cells[i]
            s = self.decl[i]
            self.owners[(s >> 6) * self.capacity + c] &= ~bit(s)
            self.n_owners[c] = 0
            self.cell_pos[c] = POS_FREE
            self._set_free(c)
            self._mark(c)
        for i in range(self.n_placed - 1, -1, -1):
            s = self.decl[i]
            u = self.undo_summary + 2 * i
            self.seq_cells_[s] = u[0]
            self.seq_pos_[s] = u[1]
            self.seq_declared[s] = 1
        self.used_count_ -= self.n_placed
        self.used_end_ = self.undo_used_end
        self.declared_ = True
        self.n_placed = 0

    # -- masks ---------------------------------------------------------------------------------
    cdef void fill_mask_rows(self, const int64_t* seq_ids, const int64_t* positions,
                             int64_t width, int64_t read_len, int64_t window,
                             uint8_t* out, int64_t row_stride) noexcept nogil:
        # Row i of out (stride row_stride) gets the mask rule for query i over [0, read_len).
        # The cells a query sees are exactly its sequence's positions (p - window, p], found
        # through the position map: O(window) per row (O(p) for window 0).
        cdef int64_t i, q, q0, q1, s, p, c
        cdef uint8_t* row
        cdef int64_t* seq_map
        for i in range(width):
            row = out + i * row_stride
            memset(row, 0, read_len)
            s = seq_ids[i]
            p = positions[i]
            if not self._is_live(s):
                continue
            seq_map = self.seq_map[s]
            q1 = p if p < self.seq_pos_[s] - 1 else self.seq_pos_[s] - 1
            q0 = 0 if window == 0 else p - window + 1
            if q0 < 0:
                q0 = 0
            for q in range(q0, q1 + 1):
                c = seq_map[q]
                if c < read_len:
                    row[c] = 1

    def fill_masks(self, const int64_t[::1] seq_ids not None,
                   const int64_t[::1] positions not None, int64_t read_len,
                   windows, outs):
        """Writes each window's mask rows ``[0, width)`` x cols ``[0, read_len)``.

        ``seq_ids`` and ``positions`` are the placed step's tokens; ``outs[k]`` is a
        C-contiguous bool or uint8 array of shape ``[rows >= width, cols >= read_len]`` for
        ``windows[k]``. Columns past read_len and rows past width are left as they were.
        """
        cdef int64_t width = seq_ids.shape[0], k, w, s
        cdef uint8_t[:, ::1] out
        if positions.shape[0] != width:
            raise InvalidArgument(
                f"positions has {positions.shape[0]} entries; seq_ids has {width}")
        if not 0 <= read_len <= self.capacity:
            raise InvalidArgument(f"read_len={read_len} is outside [0, {self.capacity}]")
        for k in range(width):
            s = seq_ids[k]
            if not 0 <= s < self.max_seqs:
                check_seq_id(int(s), self.max_seqs)
        if len(windows) != len(outs):
            raise InvalidArgument(f"{len(windows)} windows but {len(outs)} output arrays")
        for k in range(len(windows)):
            w = check_int(windows[k], "window", 0)
            arr = outs[k]
            if getattr(arr, "dtype", None) is not None and arr.dtype == np.bool_:
                arr = arr.view(np.uint8)
            out = arr
            if out.shape[0] < width or out.shape[1] < read_len:
                raise InvalidArgument(
                    f"mask array of shape ({out.shape[0]}, {out.shape[1]}) cannot hold "
                    f"{width} rows x {read_len} columns")
            with nogil:
                self.fill_mask_rows(&seq_ids[0], &positions[0], width, read_len, w,
                                    &out[0, 0], out.shape[1])

    # -- change log for a device mirror -------------------------------------------------------------
    @property
    def n_changes(self):
        """Cells in the change log (0 unless built with track_changes)."""
        return self.n_dirty

    cdef int64_t _export_changes(self, int64_t* records, int64_t max_n) noexcept nogil:
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

    cdef void _mark_all(self) noexcept nogil:
        # Logs every cell (a mirror that may have missed changes is rebuilt from scratch).
        cdef int64_t c
        if self.track_changes:
            for c in range(self.capacity):
                self._mark(c)

    def take_changes(self):
        """The cells whose pos or owners changed since the last call, ascending; clears the log."""
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
        used_end, owners all live, and for every live sequence its cell count, newest
        position, span, and that it owns exactly one cell at each position in [0, pos).
        """
        cdef int64_t c, w, s, used = 0, end = 0, n, p
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
            if not self._is_live(s):
                if self.seq_cells_[s] or self.seq_pos_[s] or self.seq_map[s] != NULL:
                    raise AssertionError(f"sequence {s} is not live but has a summary")
                if self.seq_declared[s]:
                    raise AssertionError(f"sequence {s} is not live but is declared")
                continue
            n += 1
            self._check_sequence(s)
        if n != self.n_live:
            raise AssertionError(f"n_live {self.n_live} but {n} ids are live")
        for s in range(self.max_seqs):
            if self.scratch[s]:
                raise AssertionError(f"scratch counter of sequence {s} is not zero")
        if self.declared_:
            for p in range(self.n_decl):
                if not self._is_live(self.decl[p]):
                    raise AssertionError(f"declared sequence {self.decl[p]} is not live")

    cdef int _check_sequence(self, int64_t s) except -1:
        cdef uint64_t* ow = self.owners + (s >> 6) * self.capacity
        cdef uint64_t b = bit(s)
        cdef int64_t c, q, count = 0, n = self.seq_pos_[s]
        if self.seq_cells_[s] != n:
            raise AssertionError(f"sequence {s}: {self.seq_cells_[s]} cells but pos is {n}")
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
