# Declarations of cellcache._table (source: pyx/_table.pyx), for cimport by the table's views
# (cellcache._views) and the CUDA engine. The views read the arrays below directly (live_bits,
# seq_pos_, seq_map): no copies, no calls.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t

from cellcache._bitset cimport bit

cdef extern from *:
    """
    #ifdef CELLCACHE_DEBUG
    #include <stdio.h>
    #include <stdlib.h>
    #define CC_ASSUME(cond, what) do { if (!(cond)) { \\
        fprintf(stderr, "cellcache: broken assumption: %s\\n", what); abort(); } } while (0)
    #else
    #define CC_ASSUME(cond, what) ((void)0)
    #endif
    """
    # what a cdef helper assumes; checked (abort with the message) only in the debug build
    void CC_ASSUME(bint cond, const char* what) noexcept nogil


cdef class CellTable:
    cdef readonly int64_t capacity
    cdef readonly int64_t max_seqs
    cdef readonly int64_t max_write
    cdef readonly int64_t owner_words    # ceil(max_seqs / 64): 64-bit words of one owner bitset
    cdef int64_t n_free_words            # ceil(capacity / 64)
    cdef int64_t n_sum_words             # ceil(n_free_words / 64)

    # per cell; owners are word-major: the bit of seq s for cell c is in
    # owners[(s >> 6) * capacity + c], so one sequence's bits for a run of cells are contiguous
    cdef int64_t* cell_pos
    cdef uint64_t* owners
    cdef int32_t* n_owners
    # free bitmap (bit set = free) and two summaries with one bit per bitmap word:
    # sum_free (the word has a free cell), sum_used (the word has an occupied cell)
    cdef uint64_t* free_bits
    cdef uint64_t* sum_free
    cdef uint64_t* sum_used
    cdef int64_t used_count_
    cdef int64_t used_end_

    # per sequence: a live sequence owns exactly one cell at each position in [0, seq_pos_[s]),
    # and seq_map[s][q] is the cell of position q (seq_map_cap[s] entries allocated)
    cdef uint64_t* live_bits
    cdef int64_t n_live
    cdef int64_t* seq_pos_
    cdef int64_t** seq_map
    cdef int64_t* seq_map_cap

    # the declared step (step_width ids in step_seq while has_step) and its marks
    cdef int64_t* step_seq
    cdef int64_t step_width
    cdef bint has_step
    cdef uint8_t* seq_declared
    cdef int64_t* ids_in             # a declaration's ids, collected before any state changes
    cdef int64_t* scratch            # per-sequence counters, all zero between calls
    # what the last placement did, for undo_place
    cdef int64_t* placed_cells
    cdef int64_t n_placed
    cdef int64_t undo_used_end
    cdef int64_t* undo_pos           # seq_pos_ of each placed token's sequence before placement

    # optional change log for a device mirror: cells whose pos or owner words changed
    cdef bint track_changes
    cdef uint8_t* cell_dirty
    cdef int64_t* dirty_cells
    cdef readonly int64_t n_dirty

    cdef void _reset(self) noexcept
    cdef void _mark(self, int64_t c) noexcept
    cdef void _mark_all(self) noexcept
    cdef uint64_t _valid(self, int64_t w) noexcept
    cdef void _update_summaries(self, int64_t w) noexcept
    cdef bint _is_live(self, int64_t s) noexcept
    cdef int64_t _seq(self, object value) except -1
    cdef Py_ssize_t _collect(self, object seq_ids) except -1
    cdef object _declare_collected(self, Py_ssize_t n)
    cdef void _drop_declaration(self) noexcept
    cdef int _check_sequence(self, int64_t s) except -1
    cdef void _set_free(self, int64_t c) noexcept
    cdef int64_t _next_free(self, int64_t c) noexcept
    cdef int64_t _last_used_below(self, int64_t e) noexcept
    cdef void _shrink_used_end(self) noexcept
    cdef void _drop_from(self, int64_t seq, int64_t position) noexcept
    cdef int _ensure_map(self, int64_t seq, int64_t n) except -1
    cdef void _free_map(self, int64_t seq) noexcept
    cdef int64_t _lowest_non_live(self) noexcept
    cdef void _cancel_if_declared(self, int64_t seq) noexcept
    cdef int64_t _place(self, int64_t* cells, int64_t* positions, int64_t* seq_ids) except -1
    cdef int64_t _export_changes(self, int64_t* records, int64_t max_n) noexcept


cdef inline bint seq_is_live(CellTable t, int64_t s) noexcept:
    # Whether id s (0 <= s < t.max_seqs) is live.
    CC_ASSUME(0 <= s < t.max_seqs, "seq_is_live: id outside [0, max_seqs)")
    return (t.live_bits[s >> 6] & bit(s)) != 0


cdef inline bint overlaps(const void* a, size_t na, const void* b, size_t nb) noexcept:
    # Whether the byte ranges [a, a + na) and [b, b + nb) share a byte.
    return (na != 0 and nb != 0 and <const char*>a < <const char*>b + nb
            and <const char*>b < <const char*>a + na)
