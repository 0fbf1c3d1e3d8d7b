"""The few hot CUDA driver calls, at C speed, through entry points resolved at run time.

No CUDA header is needed to build this module: it declares its own function-pointer types
with plain C types, and :mod:`cellcache.cuda.driver` fills them from
``cuGetProcAddress`` (cuda-bindings) before a :class:`StepEngine` is built.

Per step the engine does O(width + changed cells) host work: it writes the step's header
(seq ids, positions, cells) and the table's change records into pinned staging, issues one
host-to-device copy, and launches ``apply_delta`` (when anything changed) and
``fill_masks``. Two staging slots alternate; a slot is reused only after the event recorded
behind its copy has completed.
"""

from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid, PyCapsule_New
from cpython.ref cimport Py_DECREF, Py_INCREF
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

from ._table cimport CellTable

ctypedef int CUresult
ctypedef void* CUstream
ctypedef void* CUevent
ctypedef void* CUcontext
ctypedef void* CUfunction
ctypedef unsigned long long CUdeviceptr

ctypedef CUresult (*fn_memcpy_htod_async_t)(CUdeviceptr, const void*, size_t, CUstream) noexcept nogil
ctypedef CUresult (*fn_launch_t)(CUfunction, unsigned int, unsigned int, unsigned int,
                                 unsigned int, unsigned int, unsigned int, unsigned int,
                                 CUstream, void**, void**) noexcept nogil
ctypedef CUresult (*fn_event_record_t)(CUevent, CUstream) noexcept nogil
ctypedef CUresult (*fn_event_sync_t)(CUevent) noexcept nogil
ctypedef CUresult (*fn_stream_wait_event_t)(CUstream, CUevent, unsigned int) noexcept nogil
ctypedef CUresult (*fn_ctx_set_current_t)(CUcontext) noexcept nogil
ctypedef CUresult (*fn_stream_is_capturing_t)(CUstream, int*) noexcept nogil

cdef fn_memcpy_htod_async_t cu_memcpy_htod_async = NULL
cdef fn_launch_t cu_launch = NULL
cdef fn_event_record_t cu_event_record = NULL
cdef fn_event_sync_t cu_event_sync = NULL
cdef fn_stream_wait_event_t cu_stream_wait_event = NULL
cdef fn_ctx_set_current_t cu_ctx_set_current = NULL
cdef fn_stream_is_capturing_t cu_stream_is_capturing = NULL

#: the entry points this module needs, by the driver's base name
ENTRY_POINTS = ("cuMemcpyHtoDAsync", "cuLaunchKernel", "cuEventRecord", "cuEventSynchronize",
                "cuStreamWaitEvent", "cuCtxSetCurrent", "cuStreamIsCapturing")

cdef enum:
    MAX_ROWS_PER_BLOCK = 64   # MAX_ROWS in cuda/step.cu
    COLS_PER_THREAD = 16      # COLS in cuda/step.cu
    THREADS = 128             # __launch_bounds__ of fill_masks


def set_entry_points(dict pointers):
    """Installs the driver entry points (``{name: address}``, every name of ENTRY_POINTS)."""
    global cu_memcpy_htod_async, cu_launch, cu_event_record, cu_event_sync
    global cu_stream_wait_event, cu_ctx_set_current, cu_stream_is_capturing
    missing = [n for n in ENTRY_POINTS if not pointers.get(n)]
    if missing:
        raise RuntimeError(f"driver entry points not resolved: {', '.join(missing)}")
    cu_memcpy_htod_async = <fn_memcpy_htod_async_t><size_t>pointers["cuMemcpyHtoDAsync"]
    cu_launch = <fn_launch_t><size_t>pointers["cuLaunchKernel"]
    cu_event_record = <fn_event_record_t><size_t>pointers["cuEventRecord"]
    cu_event_sync = <fn_event_sync_t><size_t>pointers["cuEventSynchronize"]
    cu_stream_wait_event = <fn_stream_wait_event_t><size_t>pointers["cuStreamWaitEvent"]
    cu_ctx_set_current = <fn_ctx_set_current_t><size_t>pointers["cuCtxSetCurrent"]
    cu_stream_is_capturing = <fn_stream_is_capturing_t><size_t>pointers["cuStreamIsCapturing"]


cdef int check(CUresult r, str what) except -1:
    if r != 0:
        from cellcache.cuda.driver import raise_cuda_error
        raise_cuda_error(r, what)
    return 0


cdef inline int64_t now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec * 1000000000 + ts.tv_nsec


cdef inline int64_t cdiv(int64_t a, int64_t b) noexcept nogil:
    return (a + b - 1) // b


cdef class StepEngine:
    """Writes a placed step into the device step buffers (see the module docstring).

    Everything it touches is allocated by the Python side and handed over as integer
    handles in ``h``; the engine owns none of it.
    """

    cdef CellTable table
    cdef CUcontext ctx
    cdef CUfunction fn_delta
    cdef CUfunction fn_masks
    cdef CUfunction fn_scatter
    cdef int64_t capacity
    cdef int64_t owner_words
    cdef int64_t rec_words
    cdef int64_t slot_words
    cdef CUdeviceptr dev_pos
    cdef CUdeviceptr dev_owners
    cdef CUdeviceptr dev_seqbits
    cdef int64_t bit_words
    cdef CUdeviceptr cells_out
    cdef CUdeviceptr positions_out
    cdef CUdeviceptr read_len_out
    cdef CUdeviceptr windows_dev
    cdef CUdeviceptr masks_dev
    cdef int32_t n_windows
    cdef int64_t* host_slot[2]
    cdef CUdeviceptr dev_slot[2]
    cdef CUevent slot_event[2]
    cdef bint slot_pending[2]
    cdef int slot
    cdef CUevent commit_event
    cdef bint committed
    cdef CUstream commit_stream
    cdef int64_t target_blocks
    cdef const int64_t* seq_ids
    cdef const int64_t* positions
    cdef const int64_t* cells
    cdef object keep
    cdef readonly int64_t records_sent
    cdef readonly int64_t copies
    cdef readonly int64_t launches
    cdef int64_t phase[5]      # host ns spent staging, copying, launching delta, masks, events

    def __init__(self, CellTable table, dict h, seq_ids, positions, cells):
        cdef const int64_t[::1] v_ids = seq_ids
        cdef const int64_t[::1] v_pos = positions
        cdef const int64_t[::1] v_cells = cells
        self.table = table
        self.keep = (seq_ids, positions, cells)
        self.seq_ids = &v_ids[0]
        self.positions = &v_pos[0]
        self.cells = &v_cells[0]
        self.ctx = <CUcontext><size_t>h["ctx"]
        self.fn_delta = <CUfunction><size_t>h["apply_delta"]
        self.fn_masks = <CUfunction><size_t>h["fill_masks"]
        self.fn_scatter = <CUfunction><size_t>h["scatter_rows"]
        self.capacity = table.capacity
        self.owner_words = table.owner_words
        self.rec_words = 2 + table.owner_words
        self.slot_words = h["slot_bytes"] // 8
        self.dev_pos = h["dev_pos"]
        self.dev_owners = h["dev_owners"]
        self.dev_seqbits = h["dev_seqbits"]
        self.bit_words = (table.capacity + 63) // 64
        self.cells_out = h["cells"]
        self.positions_out = h["positions"]
        self.read_len_out = h["read_len"]
        self.windows_dev = h["windows"]
        self.masks_dev = h["masks"]
        self.n_windows = h["n_windows"]
        for k in range(2):
            self.host_slot[k] = <int64_t*><size_t>h["host_slots"][k]
            self.dev_slot[k] = h["dev_slots"][k]
            self.slot_event[k] = <CUevent><size_t>h["slot_events"][k]
            self.slot_pending[k] = False
        self.commit_event = <CUevent><size_t>h["commit_event"]
        self.target_blocks = 8 * h["sm_count"]
        if 3 * table.max_write + 2 + self.rec_words > self.slot_words:
            raise ValueError("staging slot too small for one step and one change record")

    cpdef int is_capturing(self, uint64_t stream) except -1:
        """1 when ``stream`` is being captured into a graph (active or invalidated)."""
        cdef int status = 0
        check(cu_ctx_set_current(self.ctx), "cuCtxSetCurrent")
        check(cu_stream_is_capturing(<CUstream>stream, &status), "cuStreamIsCapturing")
        return 1 if status != 0 else 0

    cpdef int order_after_commit(self, uint64_t stream) except -1:
        """Makes ``stream`` wait for the last committed forward when that ran elsewhere."""
        if self.committed and <CUstream>stream != self.commit_stream:
            check(cu_stream_wait_event(<CUstream>stream, self.commit_event, 0), "cuStreamWaitEvent")
        return 0

    cpdef int commit(self, uint64_t stream) except -1:
        check(cu_ctx_set_current(self.ctx), "cuCtxSetCurrent")
        check(cu_event_record(self.commit_event, <CUstream>stream), "cuEventRecord")
        self.committed = True
        self.commit_stream = <CUstream>stream
        return 0

    cpdef int synchronize(self) except -1:
        """Waits for every copy and commit this engine recorded (teardown, host reads)."""
        cdef int k
        check(cu_ctx_set_current(self.ctx), "cuCtxSetCurrent")
        for k in range(2):
            if self.slot_pending[k]:
                check(cu_event_sync(self.slot_event[k]), "cuEventSynchronize")
                self.slot_pending[k] = False
        if self.committed:
            check(cu_event_sync(self.commit_event), "cuEventSynchronize")
        return 0

    cdef int64_t* _acquire(self) except NULL:
        # The next staging slot, once the copy that last read it has completed.
        self.slot ^= 1
        if self.slot_pending[self.slot]:
            check(cu_event_sync(self.slot_event[self.slot]), "cuEventSynchronize")
            self.slot_pending[self.slot] = False
        return self.host_slot[self.slot]

    cpdef int write_step(self, int64_t width, int64_t read_len, uint64_t stream) except -1:
        """Uploads the step and the table's changes; writes every step buffer on ``stream``."""
        try:
            self._write_step(width, read_len, <CUstream>stream)
        except BaseException:
            self.table._mark_all()     # the mirror may have missed records: resend them all
            raise
        return 0

    cdef int _write_step(self, int64_t width, int64_t read_len, CUstream stream) except -1:
        cdef int64_t header = 3 * width
        cdef int64_t rec_off = header + (header & 1)          # records 16-byte aligned
        cdef int64_t room = (self.slot_words - rec_off) // self.rec_words
        cdef int64_t n, nbytes, gx, gy, ty, rpb
        cdef int64_t* buf
        cdef bint last
        cdef CUdeviceptr dslot, drec
        cdef int32_t width32 = <int32_t>width
        cdef int32_t n_windows = self.n_windows
        cdef int32_t rpb32
        cdef void* args[14]
        cdef int64_t t0, t1
        check(cu_ctx_set_current(self.ctx), "cuCtxSetCurrent")
        while True:
            t0 = now_ns()
            buf = self._acquire()
            memcpy(buf, self.seq_ids, width * 8)
            memcpy(buf + width, self.positions, width * 8)
            memcpy(buf + 2 * width, self.cells, width * 8)
            n = self.table._export_changes(buf + rec_off, room)
            last = self.table.n_dirty == 0
            nbytes = (rec_off + n * self.rec_words) * 8
            dslot = self.dev_slot[self.slot]
            t1 = now_ns(); self.phase[0] += t1 - t0; t0 = t1
            check(cu_memcpy_htod_async(dslot, buf, nbytes, stream), "cuMemcpyHtoDAsync")
            t1 = now_ns(); self.phase[1] += t1 - t0; t0 = t1
            self.copies += 1
            self.records_sent += n
            if n:
                drec = dslot + rec_off * 8
                args[0] = &drec
                args[1] = &n
                args[2] = &self.owner_words
                args[3] = &self.capacity
                args[4] = &self.dev_pos
                args[5] = &self.dev_owners
                args[6] = &self.dev_seqbits
                args[7] = &self.bit_words
                check(cu_launch(self.fn_delta, <unsigned int>cdiv(n * self.owner_words, 256),
                                1, 1, 256, 1, 1, 0,
                                stream, args, NULL), "cuLaunchKernel(apply_delta)")
                self.launches += 1
            t1 = now_ns(); self.phase[2] += t1 - t0; t0 = t1
            if last:
                gx = cdiv(read_len, THREADS * COLS_PER_THREAD)
                ty = cdiv(self.target_blocks, gx)
                rpb = cdiv(width, ty)
                rpb = 1 if rpb < 1 else (MAX_ROWS_PER_BLOCK if rpb > MAX_ROWS_PER_BLOCK else rpb)
                gy = cdiv(width, rpb)
                rpb32 = <int32_t>rpb
                args[0] = &dslot
                args[1] = &width32
                args[2] = &read_len
                args[3] = &self.dev_pos
                args[4] = &self.dev_seqbits
                args[5] = &self.bit_words
                args[6] = &self.capacity
                args[7] = &self.windows_dev
                args[8] = &self.masks_dev
                args[9] = &n_windows
                args[10] = &self.cells_out
                args[11] = &self.positions_out
                args[12] = &self.read_len_out
                args[13] = &rpb32
                check(cu_launch(self.fn_masks, <unsigned int>gx, <unsigned int>gy, 1, THREADS, 1, 1,
                                0, stream, args, NULL), "cuLaunchKernel(fill_masks)")
                self.launches += 1
            t1 = now_ns(); self.phase[3] += t1 - t0; t0 = t1
            check(cu_event_record(self.slot_event[self.slot], stream), "cuEventRecord")
            self.phase[4] += now_ns() - t0
            self.slot_pending[self.slot] = True
            if last:
                return 0

    def phase_ns(self, bint reset=True):
        """Host nanoseconds spent so far in staging, the copy, the delta launch, the mask
        launch and event records (a profile of write_step); ``reset`` zeroes them."""
        out = {name: self.phase[k] for k, name in
               enumerate(("stage", "copy", "launch_delta", "launch_masks", "event"))}
        if reset:
            for k in range(5):
                self.phase[k] = 0
        return out

    cpdef int scatter_rows(self, uint64_t src, int64_t width, uint64_t pool, int64_t row_bytes,
                           uint64_t stream) except -1:
        """Writes ``width`` rows from ``src`` into ``pool`` at the ``cells`` step buffer."""
        cdef int32_t w32 = <int32_t>width
        cdef void* args[5]
        cdef int64_t gx = cdiv(row_bytes, 256)
        if gx > 64:
            gx = 64
        args[0] = &self.cells_out
        args[1] = &w32
        args[2] = &src
        args[3] = &pool
        args[4] = &row_bytes
        check(cu_ctx_set_current(self.ctx), "cuCtxSetCurrent")
        check(cu_launch(self.fn_scatter, <unsigned int>gx, <unsigned int>width, 1, 256, 1, 1, 0,
                        <CUstream>stream, args, NULL), "cuLaunchKernel(scatter_rows)")
        return 0


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
