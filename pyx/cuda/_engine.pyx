"""The per-step CUDA path, at C speed: staging, two launches, events.

Built as ``cellcache.cuda._engine``. No CUDA header is needed: the few hot driver entry
points are declared here with plain C types and filled from ``cuGetProcAddress``
(:func:`set_entry_points`); the kernels' ABI comes from ``cuda/abi.h``. Every failed
driver result goes to :func:`cellcache.cuda.driver.raise_cuda_error`, the one error path.

Per step the engine does O(width + changed cells) host work: it writes the step (header,
ids, positions, cells, the paged view's runs) and the table's change records into pinned
staging that the device reads directly, launches ``apply_step`` and ``build_step``, and
records an event. Two staging slots alternate; a slot is rewritten only after the event
behind its last launch has completed.
"""

from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid, PyCapsule_New
from cpython.ref cimport Py_DECREF, Py_INCREF
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

from cellcache._table cimport CellTable

import numpy as np

from .driver import raise_cuda_error

cdef extern from "cuda/abi.h":
    int CC_MAX_WINDOWS, CC_MASK_COLS, CC_MASK_MAX_ROWS, CC_STEP_THREADS, CC_PAGED_WORDS
    int CC_APPLY_THREADS, CC_MASKS_NONE, CC_MASKS_BOOL, CC_MASKS_BITS
    int CC_HDR_WIDTH, CC_HDR_PAD_TO, CC_HDR_READ_LEN, CC_HDR_N_RUNS, CC_HDR_SINK, CC_HDR_WORDS
    int64_t CC_OFF_SEQ(int64_t mw)
    int64_t CC_OFF_POS(int64_t mw)
    int64_t CC_OFF_CELLS(int64_t mw)
    int64_t CC_OFF_QO(int64_t mw)
    int64_t CC_OFF_KV(int64_t mw)
    int64_t CC_OFF_RUN_SEQ(int64_t mw)
    int64_t CC_OFF_RUN_LAST(int64_t mw)
    int64_t CC_OFF_RECORDS(int64_t mw)
    ctypedef struct cc_step_params:
        int64_t capacity, owner_words, bit_words, max_write
        int64_t n_windows, paged, mask_format, mask_row_bytes
        uint64_t pos, owners, seqbits
        uint64_t cells, positions, read_len, width
        uint64_t seq_ids
        uint64_t qo_indptr, kv_indptr, kv_indices
        uint64_t run_seq, run_last, run_kv
        int64_t windows[16]
        uint64_t masks[16]
    int CC_ATTN_THREADS, CC_PREFILL_K, CC_PREFILL_PAIRS
    ctypedef struct cc_paged_args:
        const int32_t* qo_indptr
        const int32_t* kv_indptr
        const int32_t* kv_indices
        const long long* width
        int64_t q_s_tok, q_s_head, o_s_tok, o_s_head
        int32_t n_rows, n_heads, n_kv_heads, head_dim, window
        float scale

cdef extern from *:
    """
    #ifdef CELLCACHE_PROFILE
    #include <time.h>
    static inline long long cc_now_ns(void) {
        struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
        return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    }
    #define CC_PROFILE 1
    #else
    static inline long long cc_now_ns(void) { return 0; }
    #define CC_PROFILE 0
    #endif
    """
    int64_t cc_now_ns() noexcept nogil
    bint CC_PROFILE

#: limits shared with the kernels (one source: cuda/abi.h)
MAX_WINDOWS = CC_MAX_WINDOWS
STEP_THREADS = CC_STEP_THREADS
MASK_COLS = CC_MASK_COLS
MASK_MAX_ROWS = CC_MASK_MAX_ROWS
#: bytes of the parameter block the kernels read
PARAMS_BYTES = sizeof(cc_step_params)
ATTN_THREADS = CC_ATTN_THREADS
PREFILL_K = CC_PREFILL_K
PREFILL_PAIRS = CC_PREFILL_PAIRS
#: whether write_step records its host phases (built with CELLCACHE_PROFILE=1)
PROFILED = bool(CC_PROFILE)
MASK_FORMATS = {"none": CC_MASKS_NONE, "bool": CC_MASKS_BOOL, "bits": CC_MASKS_BITS}

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

cdef fn_launch_t cu_launch = NULL
cdef fn_event_record_t cu_event_record = NULL
cdef fn_event_sync_t cu_event_sync = NULL
cdef fn_stream_wait_event_t cu_stream_wait_event = NULL
cdef fn_ctx_set_current_t cu_ctx_set_current = NULL
cdef fn_stream_is_capturing_t cu_stream_is_capturing = NULL

#: the entry points this module needs, by the driver's base name
ENTRY_POINTS = ("cuLaunchKernel", "cuEventRecord", "cuEventSynchronize", "cuStreamWaitEvent",
                "cuCtxSetCurrent", "cuStreamIsCapturing")


def set_entry_points(dict pointers):
    """Installs the driver entry points (``{name: address}``, every name of ENTRY_POINTS)."""
    global cu_launch, cu_event_record, cu_event_sync, cu_stream_wait_event
    global cu_ctx_set_current, cu_stream_is_capturing
    missing = [n for n in ENTRY_POINTS if not pointers.get(n)]
    if missing:
        raise RuntimeError(f"driver entry points not resolved: {', '.join(missing)}")
    cu_launch = <fn_launch_t><size_t>pointers["cuLaunchKernel"]
    cu_event_record = <fn_event_record_t><size_t>pointers["cuEventRecord"]
    cu_event_sync = <fn_event_sync_t><size_t>pointers["cuEventSynchronize"]
    cu_stream_wait_event = <fn_stream_wait_event_t><size_t>pointers["cuStreamWaitEvent"]
    cu_ctx_set_current = <fn_ctx_set_current_t><size_t>pointers["cuCtxSetCurrent"]
    cu_stream_is_capturing = <fn_stream_is_capturing_t><size_t>pointers["cuStreamIsCapturing"]


def entry_points_set():
    """Whether :func:`set_entry_points` has run in this process."""
    return cu_launch != NULL


cdef inline int check(CUresult r, const char* what) except -1:
    # The Cython side of the one error path.
    if r != 0:
        raise_cuda_error(r, what.decode())
    return 0


cdef inline int64_t cdiv(int64_t a, int64_t b) noexcept nogil:
    return (a + b - 1) // b


def staging_words(int64_t max_write, int64_t owner_words, int64_t records):
    """int64 words of one staging slot holding a step and ``records`` change records."""
    return CC_OFF_RECORDS(max_write) + records * (2 + owner_words)


def fill_params(dict f):
    """The parameter block (``cc_step_params``) as bytes, from ``{field: int}``; ``windows``
    and ``masks`` are lists of at most MAX_WINDOWS ints; a missing address is 0."""
    cdef cc_step_params p
    cdef int k
    windows, masks = f["windows"], f["masks"]
    if len(windows) > CC_MAX_WINDOWS or len(masks) > CC_MAX_WINDOWS:
        raise ValueError(f"at most {CC_MAX_WINDOWS} windows")
    memset(&p, 0, sizeof(cc_step_params))
    p.capacity, p.owner_words, p.bit_words = f["capacity"], f["owner_words"], f["bit_words"]
    p.max_write, p.n_windows, p.paged = f["max_write"], f["n_windows"], f["paged"]
    p.mask_format, p.mask_row_bytes = f["mask_format"], f["mask_row_bytes"]
    p.pos, p.owners, p.seqbits = f["pos"], f["owners"], f["seqbits"]
    p.cells, p.positions, p.read_len, p.width = f["cells"], f["positions"], f["read_len"], f["width"]
    p.seq_ids = f["seq_ids"]
    p.qo_indptr, p.kv_indptr = f.get("qo_indptr", 0), f.get("kv_indptr", 0)
    p.kv_indices = f.get("kv_indices", 0)
    p.run_seq, p.run_last, p.run_kv = f.get("run_seq", 0), f.get("run_last", 0), f.get("run_kv", 0)
    for k in range(len(windows)):
        p.windows[k] = windows[k]
    for k in range(len(masks)):
        p.masks[k] = masks[k]
    return (<char*>&p)[:sizeof(cc_step_params)]


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
    if len(offsets) > 32:
        raise ValueError("at most 32 kernel arguments")
    for k in range(len(offsets)):
        ptrs[k] = <void*>(base + <size_t>offsets[k])
    check(cu_launch(<CUfunction><size_t>fn, grid[0], grid[1], grid[2], block, 1, 1, smem,
                    <CUstream>stream, ptrs, NULL), b"cuLaunchKernel")
    return None


cdef class StepEngine:
    """Writes a placed step into the device step buffers (see the module docstring).

    Everything it touches is allocated by the CUDA backend and handed over as device or
    host addresses; the engine owns none of it.
    """

    cdef CellTable table
    cdef CUcontext ctx
    cdef CUfunction fn_apply
    cdef CUfunction fn_build
    cdef uint64_t params            # device address of the cc_step_params block
    cdef int64_t max_write
    cdef int64_t owner_words
    cdef int64_t slot_words
    cdef bint paged
    cdef bint masks
    cdef int64_t* host_slot[2]      # pinned, mapped: the device reads them at dev_slot
    cdef uint64_t dev_slot[2]
    cdef CUevent slot_event[2]
    cdef bint slot_pending[2]
    cdef int slot
    cdef bint written
    cdef CUevent commit_event
    cdef bint committed
    cdef CUstream commit_stream
    cdef int64_t target_blocks
    cdef const int64_t* seq_ids
    cdef const int64_t* positions
    cdef const int64_t* cells
    cdef object keep
    cdef readonly int64_t records_sent
    cdef readonly int64_t launches
    cdef int64_t phase[4]           # host ns staging, launching apply, launching build, event

    def __init__(self, CellTable table, uint64_t ctx, uint64_t fn_apply, uint64_t fn_build,
                 uint64_t params, int64_t slot_words, tuple host_slots, tuple dev_slots,
                 tuple slot_events, uint64_t commit_event, int64_t sm_count, bint paged,
                 bint masks, seq_ids, positions, cells):
        cdef const int64_t[::1] v_ids = seq_ids
        cdef const int64_t[::1] v_pos = positions
        cdef const int64_t[::1] v_cells = cells
        cdef int k
        self.table = table
        self.keep = (seq_ids, positions, cells)
        self.seq_ids, self.positions, self.cells = &v_ids[0], &v_pos[0], &v_cells[0]
        self.ctx = <CUcontext><size_t>ctx
        self.fn_apply = <CUfunction><size_t>fn_apply
        self.fn_build = <CUfunction><size_t>fn_build
        self.params = params
        self.max_write = table.max_write
        self.owner_words = table.owner_words
        self.slot_words = slot_words
        self.paged, self.masks = paged, masks
        for k in range(2):
            self.host_slot[k] = <int64_t*><size_t>host_slots[k]
            self.dev_slot[k] = dev_slots[k]
            self.slot_event[k] = <CUevent><size_t>slot_events[k]
            self.slot_pending[k] = False
        self.commit_event = <CUevent><size_t>commit_event
        self.target_blocks = 8 * sm_count
        if staging_words(self.max_write, self.owner_words, 1) > slot_words:
            raise ValueError("staging slot too small for one step and one change record")

    cpdef int is_capturing(self, uint64_t stream) except -1:
        """1 when ``stream`` is being captured into a graph (active or invalidated)."""
        cdef int status = 0
        check(cu_ctx_set_current(self.ctx), b"cuCtxSetCurrent")
        check(cu_stream_is_capturing(<CUstream>stream, &status), b"cuStreamIsCapturing")
        return 1 if status != 0 else 0

    cpdef int order_after_commit(self, uint64_t stream) except -1:
        """Makes ``stream`` wait for the last committed forward when that ran elsewhere."""
        if self.committed and <CUstream>stream != self.commit_stream:
            check(cu_stream_wait_event(<CUstream>stream, self.commit_event, 0), b"cuStreamWaitEvent")
        return 0

    cpdef int order_after_step(self, uint64_t stream) except -1:
        """Makes ``stream`` wait for the last step's buffer writes (a consumer elsewhere)."""
        if self.written:
            check(cu_ctx_set_current(self.ctx), b"cuCtxSetCurrent")
            check(cu_stream_wait_event(<CUstream>stream, self.slot_event[self.slot], 0),
                  b"cuStreamWaitEvent")
        return 0

    cpdef int commit(self, uint64_t stream) except -1:
        """Records the commit event on ``stream`` (behind the step's forward)."""
        check(cu_ctx_set_current(self.ctx), b"cuCtxSetCurrent")
        check(cu_event_record(self.commit_event, <CUstream>stream), b"cuEventRecord")
        self.committed = True
        self.commit_stream = <CUstream>stream
        return 0

    cpdef int synchronize(self) except -1:
        """Waits for every launch and commit this engine recorded (teardown)."""
        cdef int k
        check(cu_ctx_set_current(self.ctx), b"cuCtxSetCurrent")
        for k in range(2):
            if self.slot_pending[k]:
                check(cu_event_sync(self.slot_event[k]), b"cuEventSynchronize")
                self.slot_pending[k] = False
        if self.committed:
            check(cu_event_sync(self.commit_event), b"cuEventSynchronize")
        return 0

    cdef int64_t* _acquire(self) except NULL:
        # The next staging slot, once the launch that last read it has completed.
        self.slot ^= 1
        if self.slot_pending[self.slot]:
            check(cu_event_sync(self.slot_event[self.slot]), b"cuEventSynchronize")
            self.slot_pending[self.slot] = False
        return self.host_slot[self.slot]

    def write_step(self, int64_t width, int64_t pad_to, int64_t read_len, int64_t sink,
                   uint64_t stream):
        """Uploads the step and the table's changes; writes every step buffer on ``stream``.

        Returns the paged view's real run count, and with the view, host copies of
        ``qo_indptr`` and ``kv_indptr`` entries ``[0, runs + padding]`` (int32).
        """
        cdef int64_t n_runs
        try:
            n_runs = self._write_step(width, pad_to, read_len, sink, <CUstream>stream)
        except BaseException:
            self.table._mark_all()     # the mirror may have missed records: resend them all
            raise
        if not self.paged:
            return n_runs, None, None
        cdef int64_t n = n_runs + pad_to - width + 1, i
        cdef int64_t* buf = self.host_slot[self.slot]
        qo = np.empty(n, np.int32)
        kv = np.empty(n, np.int32)
        cdef int32_t[::1] q = qo, k = kv
        for i in range(n):
            q[i] = <int32_t>buf[CC_OFF_QO(self.max_write) + i]
            k[i] = <int32_t>buf[CC_OFF_KV(self.max_write) + i]
        return n_runs, qo, kv

    cdef int64_t _write_step(self, int64_t width, int64_t pad_to, int64_t read_len,
                             int64_t sink, CUstream stream) except -1:
        cdef int64_t mw = self.max_write
        cdef int64_t rec_off = CC_OFF_RECORDS(mw)
        cdef int64_t room = (self.slot_words - rec_off) // (2 + self.owner_words)
        cdef int64_t n, n_runs = 0, gx = 0, gy = 0, rpb = 1, ty, mask_blocks = 0, chunks = 0
        cdef int64_t grid, threads_needed
        cdef int64_t* buf
        cdef bint last
        cdef uint64_t dslot, drec
        cdef int32_t rpb32
        cdef void* args[7]
        cdef int64_t t0 = 0
        check(cu_ctx_set_current(self.ctx), b"cuCtxSetCurrent")
        if self.masks:
            gx = cdiv(read_len, CC_STEP_THREADS * CC_MASK_COLS)
            ty = cdiv(self.target_blocks, gx)
            rpb = cdiv(pad_to, ty)
            rpb = 1 if rpb < 1 else (CC_MASK_MAX_ROWS if rpb > CC_MASK_MAX_ROWS else rpb)
            gy = cdiv(pad_to, rpb)
            mask_blocks = gx * gy
        if self.paged:
            chunks = cdiv(cdiv(read_len, 64), CC_STEP_THREADS * CC_PAGED_WORDS)
        rpb32 = <int32_t>rpb
        while True:
            if CC_PROFILE:
                t0 = cc_now_ns()
            buf = self._acquire()
            buf[CC_HDR_WIDTH] = width
            buf[CC_HDR_PAD_TO] = pad_to
            buf[CC_HDR_READ_LEN] = read_len
            buf[CC_HDR_SINK] = sink
            memcpy(buf + CC_OFF_SEQ(mw), self.seq_ids, width * 8)
            memcpy(buf + CC_OFF_POS(mw), self.positions, width * 8)
            memcpy(buf + CC_OFF_CELLS(mw), self.cells, width * 8)
            if self.paged:
                n_runs = self.table._plan_runs(
                    self.seq_ids, self.positions, width, pad_to, buf + CC_OFF_QO(mw),
                    buf + CC_OFF_KV(mw), buf + CC_OFF_RUN_SEQ(mw), buf + CC_OFF_RUN_LAST(mw))
            buf[CC_HDR_N_RUNS] = n_runs
            n = self.table._export_changes(buf + rec_off, room)
            last = self.table.n_dirty == 0
            dslot = self.dev_slot[self.slot]
            drec = dslot + rec_off * 8
            if CC_PROFILE:
                self.phase[0] += cc_now_ns() - t0
                t0 = cc_now_ns()
            threads_needed = n * self.owner_words
            if threads_needed < pad_to + 1:
                threads_needed = pad_to + 1
            args[0] = &self.params
            args[1] = &dslot
            args[2] = &drec
            args[3] = &n
            check(cu_launch(self.fn_apply, <unsigned int>cdiv(threads_needed, CC_APPLY_THREADS),
                            1, 1, CC_APPLY_THREADS, 1, 1, 0, stream, args, NULL),
                  b"cuLaunchKernel(apply_step)")
            self.launches += 1
            self.records_sent += n
            if CC_PROFILE:
                self.phase[1] += cc_now_ns() - t0
                t0 = cc_now_ns()
            grid = mask_blocks + n_runs * chunks
            if last and grid > 0:
                args[0] = &self.params
                args[1] = &pad_to
                args[2] = &read_len
                args[3] = &gx
                args[4] = &mask_blocks
                args[5] = &rpb32
                args[6] = &chunks
                check(cu_launch(self.fn_build, <unsigned int>grid, 1, 1, CC_STEP_THREADS, 1, 1,
                                0, stream, args, NULL), b"cuLaunchKernel(build_step)")
                self.launches += 1
            if CC_PROFILE:
                self.phase[2] += cc_now_ns() - t0
                t0 = cc_now_ns()
            check(cu_event_record(self.slot_event[self.slot], stream), b"cuEventRecord")
            self.slot_pending[self.slot] = True
            self.written = True
            if CC_PROFILE:
                self.phase[3] += cc_now_ns() - t0
            if last:
                return n_runs

    def phase_ns(self, bint reset=True):
        """Host ns spent so far staging, launching apply_step, launching build_step and
        recording events (all zero unless built with CELLCACHE_PROFILE=1)."""
        out = {name: self.phase[k] for k, name in
               enumerate(("stage", "launch_apply", "launch_build", "event"))}
        if reset:
            for k in range(4):
                self.phase[k] = 0
        return out


# -- DLPack --------------------------------------------------------------------------------------

cdef extern from *:
    """
    typedef struct { int device_type; int device_id; } cc_DLDevice;
    typedef struct { unsigned char code; unsigned char bits; unsigned short lanes; } cc_DLDataType;
    typedef struct {
        void* data; cc_DLDevice device; int ndim; cc_DLDataType dtype;
        long long* shape; long long* strides; unsigned long long byte_offset;
    } cc_DLTensor;
    typedef struct cc_DLManagedTensor {
        cc_DLTensor dl_tensor; void* manager_ctx;
        void (*deleter)(struct cc_DLManagedTensor*);
    } cc_DLManagedTensor;
    """
    ctypedef struct cc_DLDevice:
        int device_type
        int device_id
    ctypedef struct cc_DLDataType:
        unsigned char code
        unsigned char bits
        unsigned short lanes
    ctypedef struct cc_DLTensor:
        void* data
        cc_DLDevice device
        int ndim
        cc_DLDataType dtype
        long long* shape
        long long* strides
        unsigned long long byte_offset
    ctypedef struct cc_DLManagedTensor:
        cc_DLTensor dl_tensor
        void* manager_ctx
        void (*deleter)(cc_DLManagedTensor*) noexcept


cdef void _dl_deleter(cc_DLManagedTensor* m) noexcept with gil:
    if m == NULL:
        return
    Py_DECREF(<object>m.manager_ctx)
    free(m.dl_tensor.shape)
    free(m)


cdef void _capsule_destructor(object capsule) noexcept:
    cdef cc_DLManagedTensor* m
    if PyCapsule_IsValid(capsule, b"dltensor"):       # never consumed: we still own it
        m = <cc_DLManagedTensor*>PyCapsule_GetPointer(capsule, b"dltensor")
        _dl_deleter(m)


KDL_CUDA = 2


def dlpack_capsule(owner, uint64_t ptr, tuple shape, int code, int bits, int device_id):
    """A legacy ``dltensor`` capsule over device memory at ``ptr`` (C-contiguous, no strides).

    ``owner`` is kept alive until the consumer releases the tensor.
    """
    cdef cc_DLManagedTensor* m = <cc_DLManagedTensor*>malloc(sizeof(cc_DLManagedTensor))
    cdef int i, ndim = len(shape)
    if m == NULL:
        raise MemoryError()
    m.dl_tensor.shape = <long long*>malloc(sizeof(long long) * (ndim if ndim else 1))
    if m.dl_tensor.shape == NULL:
        free(m)
        raise MemoryError()
    for i in range(ndim):
        m.dl_tensor.shape[i] = shape[i]
    m.dl_tensor.data = <void*><size_t>ptr
    m.dl_tensor.device.device_type = KDL_CUDA
    m.dl_tensor.device.device_id = device_id
    m.dl_tensor.ndim = ndim
    m.dl_tensor.dtype.code = code
    m.dl_tensor.dtype.bits = bits
    m.dl_tensor.dtype.lanes = 1
    m.dl_tensor.strides = NULL
    m.dl_tensor.byte_offset = 0
    Py_INCREF(owner)
    m.manager_ctx = <void*>owner
    m.deleter = _dl_deleter
    return PyCapsule_New(m, b"dltensor", _capsule_destructor)
