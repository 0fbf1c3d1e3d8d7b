# Declarations of cellcache._views (source: pyx/_views.pyx), for cimport by the CUDA engine.
from libc.stdint cimport int64_t, uint8_t

from cellcache._table cimport CellTable


cdef void fill_mask_rows(CellTable t, const int64_t* seq_ids, const int64_t* positions,
                         int64_t width, int64_t read_len, int64_t window,
                         uint8_t* out, int64_t row_stride, bint bits) noexcept
cdef int64_t plan_runs(const int64_t* seq_ids, const int64_t* positions,
                       int64_t width, int64_t pad_to, int64_t* qo_indptr,
                       int64_t* kv_indptr, int64_t* run_seq, int64_t* run_last) noexcept nogil
