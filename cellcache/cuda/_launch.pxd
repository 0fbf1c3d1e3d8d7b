# Declarations of cellcache.cuda._launch (source: pyx/cuda/_launch.pyx), for cimport by the
# step engine: the driver's types in plain C, the one copy of the hot entry points, check().

ctypedef int CUresult
ctypedef void* CUstream
ctypedef void* CUevent
ctypedef void* CUcontext
ctypedef void* CUfunction

ctypedef CUresult (*fn_launch_t)(CUfunction, unsigned int, unsigned int, unsigned int,
                                 unsigned int, unsigned int, unsigned int, unsigned int,
                                 CUstream, void**, void**) noexcept nogil
ctypedef CUresult (*fn_event_record_t)(CUevent, CUstream) noexcept nogil
ctypedef CUresult (*fn_event_sync_t)(CUevent) noexcept nogil
ctypedef CUresult (*fn_stream_wait_event_t)(CUstream, CUevent, unsigned int) noexcept nogil
ctypedef CUresult (*fn_ctx_set_current_t)(CUcontext) noexcept nogil
ctypedef CUresult (*fn_stream_is_capturing_t)(CUstream, int*) noexcept nogil
ctypedef CUresult (*fn_memcpy_dtoh_async_t)(void*, unsigned long long, size_t, CUstream) noexcept nogil

# Process-wide, NULL until set_entry_points() has run (the CUDA backend runs it before it
# builds an engine). Modules that cimport these share this one copy.
cdef fn_launch_t cu_launch
cdef fn_event_record_t cu_event_record
cdef fn_event_sync_t cu_event_sync
cdef fn_stream_wait_event_t cu_stream_wait_event
cdef fn_ctx_set_current_t cu_ctx_set_current
cdef fn_stream_is_capturing_t cu_stream_is_capturing
cdef fn_memcpy_dtoh_async_t cu_memcpy_dtoh_async


# Raises the failed driver result ``r`` through cellcache.cuda.driver.raise_cuda_error;
# returns -1 with the exception set.
cdef int raise_result(CUresult r, const char* what) except -1


cdef inline int check(CUresult r, const char* what) except -1:
    # The Cython side of the one error path: success costs one compare.
    if r != 0:
        return raise_result(r, what)
    return 0
