"""The per-cache step engine, at C speed: staging, two launches, events.

Built as ``cellcache.cuda._engine``. Per step the engine does O(width + changed cells) host
work: it writes the step (header, ids, positions, cells, the paged view's runs) and the
table's change records into pinned staging that the device reads directly, launches
``apply_step`` and ``build_step``, and records an event. Two staging slots alternate; a slot
is rewritten only after the event behind its last launch has completed.

The kernels' ABI (limits, staging layout, ``cc_step_params``) comes from ``cuda/abi.h``; the
driver entry points and ``check`` (the one error path) from ``cellcache.cuda._launch``, set
once per process. What the engine reads and launches is set up by the CUDA backend and
handed over by name in an :class:`EngineResources`; the engine owns none of it.
"""

cimport cython
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.string cimport memcpy, memset

from cellcache._table cimport CellTable
from cellcache._views cimport plan_runs
from cellcache.cuda._launch cimport (
    CUcontext,
    CUevent,
    CUfunction,
    CUresult,
    CUstream,
    check,
    cu_ctx_set_current,
    cu_event_record,
    cu_event_sync,
    cu_launch,
    cu_stream_is_capturing,
    cu_stream_wait_event,
)

import numpy as np

from cellcache.errors import InvalidArgument

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

#: limits shared with the step kernels (one source: cuda/abi.h)
MAX_WINDOWS = CC_MAX_WINDOWS
STEP_THREADS = CC_STEP_THREADS
MASK_COLS = CC_MASK_COLS
MASK_MAX_ROWS = CC_MASK_MAX_ROWS
#: bytes of the parameter block the kernels read
PARAMS_BYTES = sizeof(cc_step_params)
#: whether write_step records its host phases (built with CELLCACHE_PROFILE=1)
PROFILED = bool(CC_PROFILE)
MASK_FORMATS = {"none": CC_MASKS_NONE, "bool": CC_MASKS_BOOL, "bits": CC_MASKS_BITS}


cdef inline int64_t cdiv(int64_t a, int64_t b) noexcept nogil:
    return (a + b - 1) // b


def staging_words(int64_t max_write, int64_t owner_words, int64_t records):
    """int64 words of one staging slot holding a step and ``records`` change records."""
    return CC_OFF_RECORDS(max_write) + records * (2 + owner_words)


def step_params(*, int64_t capacity, int64_t owner_words, int64_t bit_words, int64_t max_write,
                int64_t n_windows, int64_t paged, int64_t mask_format, int64_t mask_row_bytes,
                uint64_t pos, uint64_t owners, uint64_t seqbits,
                uint64_t cells, uint64_t positions, uint64_t read_len, uint64_t width,
                uint64_t seq_ids, windows, masks,
                uint64_t qo_indptr=0, uint64_t kv_indptr=0, uint64_t kv_indices=0,
                uint64_t run_seq=0, uint64_t run_last=0, uint64_t run_kv=0):
    """The parameter block (``cc_step_params`` of ``cuda/abi.h``) as bytes.

    One keyword per field, by the field's name (an unknown or missing name is a TypeError);
    the paged view's addresses default to 0 (no paged view). ``windows`` and ``masks`` hold
    at most MAX_WINDOWS ints each; the entries after them are 0.
    """
    cdef cc_step_params p
    cdef int k
    if len(windows) > CC_MAX_WINDOWS or len(masks) > CC_MAX_WINDOWS:
        raise ValueError(f"at most {CC_MAX_WINDOWS} windows")
    memset(&p, 0, sizeof(cc_step_params))
    p.capacity, p.owner_words, p.bit_words, p.max_write = capacity, owner_words, bit_words, max_write
    p.n_windows, p.paged, p.mask_format, p.mask_row_bytes = n_windows, paged, mask_format, mask_row_bytes
    p.pos, p.owners, p.seqbits = pos, owners, seqbits
    p.cells, p.positions, p.read_len, p.width = cells, positions, read_len, width
    p.seq_ids = seq_ids
    p.qo_indptr, p.kv_indptr, p.kv_indices = qo_indptr, kv_indptr, kv_indices
    p.run_seq, p.run_last, p.run_kv = run_seq, run_last, run_kv
    for k in range(len(windows)):
        p.windows[k] = windows[k]
    for k in range(len(masks)):
        p.masks[k] = masks[k]
    return (<char*>&p)[:sizeof(cc_step_params)]


cdef int _wait(CUevent event) except -1:
    # Waits for ``event`` with the interpreter lock released: the step's host work waits here
    # for the GPU, and other threads (a server's receiver and sender) run meanwhile.
    cdef CUresult r
    with nogil:
        r = cu_event_sync(event)
    return check(r, b"cuEventSynchronize")


cdef tuple _pair(str name, values):
    # The two entries of one per-slot resource, checked as addresses (uint64).
    if len(values) != 2:
        raise ValueError(f"{name} has {len(values)} entries; the engine alternates exactly 2 slots")
    cdef uint64_t a = values[0], b = values[1]
    return (a, b)


cdef class EngineResources:
    """What the CUDA backend set up for one cache's step engine, by name.

    Handles and addresses are ints. The engine reads them and owns none of them: the
    backend's undo stack releases them after the engine's last use.

    Example
    -------
    >>> EngineResources(ctx=ctx, fn_apply=apply, fn_build=build, params=params,
    ...                 slot_words=words, host_slots=(h0, h1), dev_slots=(d0, d1),
    ...                 slot_events=(e0, e1), commit_event=e2, sm_count=132,
    ...                 paged=True, masks=True)                 # doctest: +SKIP
    """

    cdef readonly uint64_t ctx            # CUcontext the engine makes current
    cdef readonly uint64_t fn_apply       # CUfunction apply_step
    cdef readonly uint64_t fn_build       # CUfunction build_step
    cdef readonly uint64_t params         # device address of the cc_step_params block
    cdef readonly int64_t slot_words      # int64 words of one staging slot
    cdef readonly tuple host_slots        # the two pinned, mapped staging slots (host) ...
    cdef readonly tuple dev_slots         # ... and where the device reads them
    cdef readonly tuple slot_events       # CUevent behind each slot's last launch
    cdef readonly uint64_t commit_event   # CUevent recorded behind each committed forward
    cdef readonly int64_t sm_count        # the device's SMs (sizes the mask grid)
    cdef readonly bint paged              # build the paged view (runs, indptrs, kv_indices)
    cdef readonly bint masks              # build the masks (mask_format is not "none")

    # A cdef class's __init__ shows Python no signature; the docstring's first lines give it
    # one (Argument Clinic's form, which inspect and stubtest read), so no embedded one.
    @cython.embedsignature(False)
    def __init__(self, *, uint64_t ctx, uint64_t fn_apply, uint64_t fn_build, uint64_t params,
                 int64_t slot_words, host_slots, dev_slots, slot_events,
                 uint64_t commit_event, int64_t sm_count, bint paged, bint masks):
        """__init__($self, /, *, ctx, fn_apply, fn_build, params, slot_words, host_slots,
dev_slots, slot_events, commit_event, sm_count, paged, masks)
--

Every resource by name; each of ``host_slots``, ``dev_slots`` and ``slot_events`` holds
the two slots' entries.
"""
        self.ctx, self.fn_apply, self.fn_build, self.params = ctx, fn_apply, fn_build, params
        self.slot_words = slot_words
        self.host_slots = _pair("host_slots", host_slots)
        self.dev_slots = _pair("dev_slots", dev_slots)
        self.slot_events = _pair("slot_events", slot_events)
        self.commit_event = commit_event
        self.sm_count = sm_count
        self.paged, self.masks = paged, masks

    def __repr__(self):
        return (f"EngineResources(ctx=0x{self.ctx:x}, params=0x{self.params:x}, "
                f"slot_words={self.slot_words}, sm_count={self.sm_count}, "
                f"paged={self.paged}, masks={self.masks})")


cdef class StepEngine:
    """Writes a placed step into the device step buffers (see the module docstring).

    Everything it touches on the device is set up by the CUDA backend and handed over in
    ``resources``; the engine owns none of it.
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
    cdef int64_t mask_target        # blocks the mask grid aims at (target_blocks)
    cdef const int64_t* seq_ids
    cdef const int64_t* positions
    cdef const int64_t* cells
    cdef object keep
    cdef readonly int64_t records_sent
    cdef readonly int64_t launches
    cdef int64_t phase[4]           # host ns staging, launching apply, launching build, event

    def __init__(self, CellTable table not None, EngineResources resources not None, seq_ids,
                 positions, cells):
        # seq_ids, positions, cells: the cache's host arrays of the declared step (int64,
        # max_write entries each), read at every write_step; the engine keeps them alive.
        cdef const int64_t[::1] v_ids = seq_ids
        cdef const int64_t[::1] v_pos = positions
        cdef const int64_t[::1] v_cells = cells
        cdef int k
        self.table = table
        self.keep = (seq_ids, positions, cells)
        self.seq_ids, self.positions, self.cells = &v_ids[0], &v_pos[0], &v_cells[0]
        self.ctx = <CUcontext><size_t>resources.ctx
        self.fn_apply = <CUfunction><size_t>resources.fn_apply
        self.fn_build = <CUfunction><size_t>resources.fn_build
        self.params = resources.params
        self.max_write = table.max_write
        self.owner_words = table.owner_words
        self.slot_words = resources.slot_words
        self.paged, self.masks = resources.paged, resources.masks
        for k in range(2):
            self.host_slot[k] = <int64_t*><size_t>resources.host_slots[k]
            self.dev_slot[k] = resources.dev_slots[k]
            self.slot_event[k] = <CUevent><size_t>resources.slot_events[k]
            self.slot_pending[k] = False
        self.commit_event = <CUevent><size_t>resources.commit_event
        self.mask_target = 8 * resources.sm_count
        if staging_words(self.max_write, self.owner_words, 1) > resources.slot_words:
            raise ValueError("staging slot too small for one step and one change record")

    @property
    def target_blocks(self):
        """How many blocks the mask grid aims at (8 an SM): rows are split into row groups
        until the grid reaches it. Settable (an int in [1, 2**31 - 1]) for grid sweeps; a
        bad value raises InvalidArgument and leaves it as it was."""
        return self.mask_target

    @target_blocks.setter
    def target_blocks(self, value):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(f"target_blocks must be an int, not {type(value).__name__}")
        if not 1 <= value <= 2**31 - 1:
            raise InvalidArgument(f"target_blocks must be in [1, 2**31 - 1], got {value}")
        self.mask_target = value

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
                _wait(self.slot_event[k])
                self.slot_pending[k] = False
        if self.committed:
            _wait(self.commit_event)
        return 0

    cdef int64_t* _acquire(self) except NULL:
        # The next staging slot, once the launch that last read it has completed.
        self.slot ^= 1
        if self.slot_pending[self.slot]:
            _wait(self.slot_event[self.slot])
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
        cdef int64_t ow = self.owner_words, paged = 1 if self.paged else 0
        # the kernels' arguments (addresses of the locals above, whose values a pass sets);
        # apply_step gets every size, so it reads the staging in one PCIe round trip
        cdef void* apply_args[12]
        cdef void* build_args[7]
        apply_args[:] = [&self.params, &dslot, &drec, &n, &ow, &mw, &width, &pad_to, &n_runs,
                         &read_len, &sink, &paged]
        build_args[:] = [&self.params, &pad_to, &read_len, &gx, &mask_blocks, &rpb32, &chunks]
        cdef int64_t t0 = 0
        check(cu_ctx_set_current(self.ctx), b"cuCtxSetCurrent")
        if self.masks:
            gx = cdiv(read_len, CC_STEP_THREADS * CC_MASK_COLS)
            ty = cdiv(self.mask_target, gx)
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
                n_runs = plan_runs(
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
            check(cu_launch(self.fn_apply, <unsigned int>cdiv(threads_needed, CC_APPLY_THREADS),
                            1, 1, CC_APPLY_THREADS, 1, 1, 0, stream, apply_args, NULL),
                  b"cuLaunchKernel(apply_step)")
            self.launches += 1
            self.records_sent += n
            if CC_PROFILE:
                self.phase[1] += cc_now_ns() - t0
                t0 = cc_now_ns()
            grid = mask_blocks + n_runs * chunks
            if last and grid > 0:
                check(cu_launch(self.fn_build, <unsigned int>grid, 1, 1, CC_STEP_THREADS, 1, 1,
                                0, stream, build_args, NULL), b"cuLaunchKernel(build_step)")
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
