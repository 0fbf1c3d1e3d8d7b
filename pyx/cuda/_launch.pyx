"""The process-wide driver entry points and kernel launches with packed arguments.

Built as ``cellcache.cuda._launch``. No CUDA header is needed: the few hot driver entry
points are declared in ``cellcache/cuda/_launch.pxd`` with plain C types and filled from
``cuGetProcAddress`` once per process (:func:`set_entry_points`); the step engine
(``cellcache.cuda._engine``) cimports those same pointers and ``check``. Every failed driver
result goes to :func:`cellcache.cuda.driver.raise_cuda_error`, the one error path.

:func:`launch` issues one kernel whose arguments are packed back to back in one bytes
object (the attention kernels of :mod:`cellcache.cuda.kernels`); :func:`paged_args` packs
their ``cc_paged_args`` block, laid out by ``cuda/abi.h``.
"""

from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.string cimport memset

from .driver import raise_cuda_error

cdef extern from "cuda/abi.h":
    int CC_ATTN_THREADS, CC_PREFILL_K, CC_PREFILL_PAIRS
    ctypedef struct cc_paged_args:
        const int32_t* qo_indptr
        const int32_t* kv_indptr
        const int32_t* kv_indices
        const long long* width
        int64_t q_s_tok, q_s_head, o_s_tok, o_s_head
        int32_t n_rows, n_heads, n_kv_heads, head_dim, window
        float scale

#: launch limits of the attention kernels (one source: cuda/abi.h)
ATTN_THREADS = CC_ATTN_THREADS
PREFILL_K = CC_PREFILL_K
PREFILL_PAIRS = CC_PREFILL_PAIRS

#: the entry points the Cython modules need, by the driver's base name
ENTRY_POINTS = ("cuLaunchKernel", "cuEventRecord", "cuEventSynchronize", "cuStreamWaitEvent",
                "cuCtxSetCurrent", "cuStreamIsCapturing", "cuMemcpyDtoHAsync")


def set_entry_points(dict pointers):
    """Installs the driver entry points (``{name: address}``, every name of ENTRY_POINTS)."""
    global cu_launch, cu_event_record, cu_event_sync, cu_stream_wait_event
    global cu_ctx_set_current, cu_stream_is_capturing, cu_memcpy_dtoh_async
    missing = [n for n in ENTRY_POINTS if not pointers.get(n)]
    if missing:
        raise RuntimeError(f"driver entry points not resolved: {', '.join(missing)}")
    cu_launch = <fn_launch_t><size_t>pointers["cuLaunchKernel"]
    cu_event_record = <fn_event_record_t><size_t>pointers["cuEventRecord"]
    cu_event_sync = <fn_event_sync_t><size_t>pointers["cuEventSynchronize"]
    cu_stream_wait_event = <fn_stream_wait_event_t><size_t>pointers["cuStreamWaitEvent"]
    cu_ctx_set_current = <fn_ctx_set_current_t><size_t>pointers["cuCtxSetCurrent"]
    cu_stream_is_capturing = <fn_stream_is_capturing_t><size_t>pointers["cuStreamIsCapturing"]
    cu_memcpy_dtoh_async = <fn_memcpy_dtoh_async_t><size_t>pointers["cuMemcpyDtoHAsync"]


def entry_points_set():
    """Whether :func:`set_entry_points` has run in this process."""
    return cu_launch != NULL


cdef int raise_result(CUresult r, const char* what) except -1:
    raise_cuda_error(r, what.decode())
    return -1       # raise_cuda_error always raises; this keeps the contract if it did not


def paged_args(uint64_t qo_indptr, uint64_t kv_indptr, uint64_t kv_indices, uint64_t width,
               int64_t q_s_tok, int64_t q_s_head, int64_t o_s_tok, int64_t o_s_head,
               int32_t n_rows, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
               int32_t window, float scale):
    """The paged attention kernels' argument block (``cc_paged_args``) as bytes."""
    cdef cc_paged_args a
    memset(&a, 0, sizeof(cc_paged_args))
    a.qo_indptr = <const int32_t*><size_t>qo_indptr
    a.kv_indptr = <const int32_t*><size_t>kv_indptr
    a.kv_indices = <const int32_t*><size_t>kv_indices
    a.width = <const long long*><size_t>width
    a.q_s_tok, a.q_s_head, a.o_s_tok, a.o_s_head = q_s_tok, q_s_head, o_s_tok, o_s_head
    a.n_rows, a.n_heads, a.n_kv_heads, a.head_dim, a.window = n_rows, n_heads, n_kv_heads, head_dim, window
    a.scale = scale
    return (<char*>&a)[:sizeof(cc_paged_args)]


def launch(uint64_t fn, tuple grid, unsigned int block, unsigned int smem, uint64_t stream,
           bytes args, tuple offsets):
    """cuLaunchKernel of ``fn`` with the kernel's arguments packed in ``args`` (argument k
    starts at byte ``offsets[k]``, each aligned as the kernel expects)."""
    cdef void* ptrs[32]
    cdef const char* base = args
    cdef int k
    if cu_launch == NULL:
        raise RuntimeError("driver entry points not set; call set_entry_points() first")
    if len(offsets) > 32:
        raise ValueError("at most 32 kernel arguments")
    for k in range(len(offsets)):
        ptrs[k] = <void*>(base + <size_t>offsets[k])
    check(cu_launch(<CUfunction><size_t>fn, grid[0], grid[1], grid[2], block, 1, 1, smem,
                    <CUstream>stream, ptrs, NULL), b"cuLaunchKernel")
    return None


def copy_to_host(uint64_t dst, uint64_t src, size_t nbytes, uint64_t stream, uint64_t event):
    """``cuMemcpyDtoHAsync`` of ``nbytes`` from device address ``src`` to host address ``dst``
    on ``stream``, then ``cuEventRecord(event, stream)`` (the sampler's one copy of a step's
    ids and its done marker: two driver calls at C cost)."""
    if cu_memcpy_dtoh_async == NULL:
        raise RuntimeError("driver entry points not set; call set_entry_points() first")
    check(cu_memcpy_dtoh_async(<void*><size_t>dst, src, nbytes, <CUstream>stream),
          b"cuMemcpyDtoHAsync")
    check(cu_event_record(<CUevent>event, <CUstream>stream), b"cuEventRecord")
    return None
