"""``CudaCellCache``: the cache on a CUDA device through the raw driver API.

The table lives on the host (Cython); the device keeps a mirror of it (``pos`` as int32,
owner words word-major, and the same bits sequence-major) that each step's change records
update, and the kernels in ``cuda/step.cu`` build every step buffer from that mirror on the
step's stream. See :mod:`cellcache.cuda._engine` for the per-step path and
:mod:`cellcache.cuda.pools` for the pools.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from .._checks import check_int
from ..buffers import mask_row_bytes, step_buffers
from ..cache import CellCache, stream_handle
from ..config import CacheConfig
from ..errors import InvalidArgument, InvalidState, OutOfMemory
from ..pools import CopyPools, PoolKey, Pools, check_allocator, check_growth, release_quietly
from . import _dlpack, _engine, _launch
from . import driver as drv
from .driver import check, cu
from .kernels import AttentionKernels
from .pools import (
    DeviceAllocation,
    DeviceAllocator,
    MappedPools,
    VmmOps,
    check_device_allocation,
    vmm_supported,
)
from .probe import require_cuda

__all__ = ["CudaCellCache", "DeviceBuffer"]

# DLPack (code, bits) by numpy dtype name; 8-bit K/V pools go out as bytes (uint8), which
# every consumer takes (cellcache.torch views them as torch.float8_e4m3fn)
_DLPACK = {"int64": (0, 64), "int32": (0, 32), "uint8": (1, 8), "bool": (6, 8),
           "float16": (2, 16), "float32": (2, 32), "bfloat16": (4, 16), "float8_e4m3fn": (1, 8)}
CU_MEMHOSTALLOC_PORTABLE = 0x01
CU_MEMHOSTALLOC_DEVICEMAP = 0x02


def _release(fn: Any, handle: Any) -> None:
    """Releases one resource through the one error path (the undo stack's callbacks)."""
    check(fn(handle), fn.__name__)


class DeviceBuffer:
    """A named device buffer of the cache: ``ptr``, ``shape``, ``dtype``, ``nbytes``,
    ``__cuda_array_interface__`` (not for bfloat16 or float8, which have no typestr), DLPack
    (``torch.from_dlpack(buf)`` works for every dtype, 8-bit pools coming out as uint8
    bytes, ordered after the last step's writes on the consumer's stream) and
    ``copy_to_host()``.
    """

    def __init__(self, cache: CudaCellCache, name: str, ptr: int, shape: tuple, dtype: Any,
                 backed_rows: Any = None):
        self._cache = cache
        self._backed_rows = backed_rows     # pools: how many leading rows have memory now
        self.name, self.ptr, self.shape, self.dtype = name, int(ptr), tuple(shape), np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def _check_live(self) -> None:
        if self._cache.closed:
            raise InvalidState(f"buffer {self.name!r}: its cache is closed and its memory released")

    def __repr__(self) -> str:
        return f"DeviceBuffer({self.name!r}, ptr=0x{self.ptr:x}, shape={self.shape}, dtype={self.dtype})"

    @property
    def __cuda_array_interface__(self) -> dict:
        if self.dtype.name in ("bfloat16", "float8_e4m3fn"):
            raise AttributeError(f"{self.dtype.name} has no __cuda_array_interface__ typestr; use DLPack")
        self._check_live()
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False),
                "version": 3, "strides": None}

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        if copy:
            raise BufferError("cellcache buffers are exported without copying")
        self._check_live()
        if stream is not None and not isinstance(stream, int):
            raise InvalidArgument(f"stream of type {type(stream).__name__} is not a DLPack stream")
        if stream != -1:       # DLPack: make the producer's work visible on the consumer's stream
            self._cache.order_after_step(0 if stream is None else stream)
        code, bits = _DLPACK[self.dtype.name]
        return _dlpack.dlpack_capsule(self, self.ptr, self.shape, code, bits,
                                      self._cache.config.device)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_dlpack.KDL_CUDA, self._cache.config.device)

    def copy_to_host(self) -> np.ndarray:
        """A numpy copy, after all work queued on the device so far (masks as numpy.bool_).

        A pool's copy holds the rows that have memory behind them: ``[0, cache.rows)``.
        InvalidState once the cache is closed (its memory is released).
        """
        self._check_live()
        shape = self.shape
        if self._backed_rows is not None:
            shape = (min(shape[0], self._backed_rows()),) + shape[1:]
        out = np.empty(shape, dtype=self.dtype)
        if out.nbytes:
            self._cache.read_device(self.ptr, out)
        return out


class CudaCellCache(CellCache):
    """The cache on a CUDA device (the device's primary context, shared with PyTorch).

    ``growth``: ``"map"`` reserves each pool's addresses for ``capacity + 1`` rows and maps
    memory as it grows (pools never move; ``Step.grew`` only on the first step); ``"copy"``
    allocates larger pools and copies (``Step.grew`` on every growth; ``allocator`` gives
    the storage: an object with an int device address ``ptr`` and ``nbytes``, checked before
    the pools switch); ``"auto"`` (default) maps where the device supports it and the full
    address range can be reserved, else grows by copy.

    Besides the step buffers and pools the cache owns what consumers build on it:
    :meth:`attention_kernels` (loaded on first use) and named device :meth:`scratch`, both
    released at :meth:`close` with everything else (as is whatever :meth:`on_close` ties to
    it).

    Without a usable driver, device or matching cuda-bindings the constructor raises
    :class:`cellcache.CudaError` with the probe's one-line reason
    (:func:`cellcache.cuda.probe.require_cuda`).

    Example
    -------
    >>> cache = CudaCellCache(CacheConfig(capacity=4096, layers=[LayerConfig(8, 128)],
    ...                                   max_write=64))              # doctest: +SKIP
    >>> a = cache.seq_new(); cache.declare_step([a] * 5)              # doctest: +SKIP
    >>> step = cache.prepare_step(stream=torch.cuda.current_stream()) # doctest: +SKIP
    >>> k_pool = torch.from_dlpack(cache.layer(0).k)                  # doctest: +SKIP
    """

    backend = "cuda"

    def __init__(self, config: CacheConfig, growth: str = "auto", allocator: Any = None):
        if not isinstance(config, CacheConfig):
            raise InvalidArgument(f"config of type {type(config).__name__} is not a CacheConfig")
        if config.capacity > (1 << 31) - 2:
            raise InvalidArgument(
                f"capacity={config.capacity} is outside [1, 2**31 - 2] for the CUDA backend "
                "(the device mirror and the paged view keep cells as int32)")
        if config.mask_format != "none" and len(config.windows) > _engine.MAX_WINDOWS:
            raise InvalidArgument(
                f"{len(config.windows)} distinct windows; the CUDA backend builds at most "
                f"{_engine.MAX_WINDOWS} masks per step")
        check_growth(growth)
        check_allocator(allocator)
        self._growth, self._allocator_arg = growth, allocator
        self._retired: list[tuple[Any, Any]] = []
        self._attention_kernels: AttentionKernels | None = None   # built on first use
        self._scratch: dict[str, tuple[int, int]] = {}           # name -> (ptr, nbytes)
        require_cuda()              # no driver, no device, wrong cuda-bindings: one CudaError
        try:
            super().__init__(config)    # a failure releases what was acquired (the undo stack)
        except MemoryError as e:
            if isinstance(e, OutOfMemory):
                raise
            raise OutOfMemory(f"building the CUDA cache ran out of host memory ({e!r})") from e

    # -- set-up ------------------------------------------------------------------------------
    def _open(self) -> None:
        self._ctx = drv.Context(self.config.device)
        self._undo.callback(self._ctx.release)

    def _tracks_changes(self) -> bool:
        return True

    def _make_pools(self) -> Pools:
        use_copy = self._growth == "copy" or self._allocator_arg is not None
        if not use_copy:
            supported = vmm_supported(self._ctx)
            if self._growth == "map" and not supported:
                raise InvalidArgument(
                    "growth='map' but this device does not support virtual memory management; "
                    "use growth='auto' or 'copy'")
            use_copy = not supported
        if not use_copy:
            try:
                return MappedPools(self._row_bytes, self.config.capacity,
                                   VmmOps(self.config.device), self._undo)
            except OutOfMemory:
                if self._growth == "map":
                    raise
                # the full address range cannot be reserved: grow by copy (Step.grew on
                # every growth), as on devices without virtual memory management
        allocator = self._allocator_arg or DeviceAllocator(self._ctx)
        return CopyPools(self._row_bytes, allocator, self._copy_rows, self._retire,
                         check_device_allocation)

    def _alloc(self, nbytes: int, what: str, fill: int | None = 0) -> int:
        """Device memory for the cache's lifetime, zeroed (or 32-bit ``fill``ed)."""
        ptr = int(check(cu.cuMemAlloc(max(int(nbytes), 1)), f"cuMemAlloc({nbytes}) for {what}"))
        self._undo.callback(_release, cu.cuMemFree, ptr)
        if fill is not None and nbytes:
            if fill == 0:
                check(cu.cuMemsetD8(ptr, 0, nbytes), "cuMemsetD8")
            else:
                check(cu.cuMemsetD32(ptr, fill, nbytes // 4), "cuMemsetD32")
        return ptr

    def _init_step_buffers(self) -> None:
        if isinstance(self._pools, CopyPools):
            # registered after the cache registered the pools' close: runs before it
            self._undo.callback(self._free_retired)
        self._ctx.make_current()
        self._load_kernels()
        self._alloc_step_buffers()
        self._alloc_mirror()
        self._alloc_staging()
        self._write_params()
        check(cu.cuCtxSynchronize(), "cuCtxSynchronize")        # zeroed before first use
        resources = _engine.EngineResources(
            ctx=self._ctx.handle, fn_apply=int(self._fn_apply), fn_build=int(self._fn_build),
            params=self._params, slot_words=self._slot_words,
            host_slots=tuple(self._host_slots), dev_slots=tuple(self._dev_slots),
            slot_events=tuple(int(e) for e in self._events[:2]),
            commit_event=int(self._events[2]), sm_count=self._ctx.sm_count,
            paged=self.config.paged, masks=self.config.mask_format != "none")
        self._engine = _engine.StepEngine(self._table, resources, self._seq_ids, self._positions,
                                          self._cells)
        self._build_buffers()

    def _load_kernels(self) -> None:
        if not _launch.entry_points_set():
            _launch.set_entry_points(drv.entry_points(_launch.ENTRY_POINTS))
        module = drv.load_module("step")
        self._undo.callback(_release, cu.cuModuleUnload, module)
        self._fn_apply = drv.function(module, "apply_step")
        # bit masks have a kernel of their own (same arguments and grid: cuda/step.cu)
        bits = self.config.mask_format == "bits"
        self._fn_build = drv.function(module, "build_step_bits" if bits else "build_step")
        if bits:
            # its resident blocks are bounded by the SM's shared memory: ask for the largest
            # shared-memory carveout, a hint the driver may refine
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
            check(cu.cuFuncSetAttribute(self._fn_build, attr, 100), "cuFuncSetAttribute")

    def _alloc_step_buffers(self) -> None:
        """The step buffers as :func:`cellcache.buffers.step_buffers` describes them, then
        the engine's own device arrays (step ids; the paged view's runs)."""
        mw = self.config.max_write
        p = {}
        for spec in step_buffers(self.config):
            assert spec.fill == 0 or spec.dtype.itemsize == 4, spec   # cuMemsetD32 fills
            p[spec.name] = self._alloc(spec.nbytes, spec.name, fill=spec.fill)
        p["seq_ids"] = self._alloc(8 * mw, "seq_ids")
        if self.config.paged:
            for name in ("run_seq", "run_last", "run_kv"):
                p[name] = self._alloc(8 * mw, name)
        self._ptrs = p

    def _alloc_mirror(self) -> None:
        cfg = self.config
        cap, words = cfg.capacity, self._table.owner_words
        self._bit_words = (cap + 63) // 64
        self._mirror = {
            "pos": self._alloc(4 * cap, "device mirror (pos)", fill=0xFFFFFFFF),
            "owners": self._alloc(8 * words * cap, "device mirror (owners)"),
            "seqbits": self._alloc(8 * cfg.max_seqs * self._bit_words, "device mirror (bits)"),
        }
        self._mirror_bytes = 4 * cap + 8 * words * cap + 8 * cfg.max_seqs * self._bit_words

    def _alloc_staging(self) -> None:
        mw, words = self.config.max_write, self._table.owner_words
        records = min(max(2 * mw, 8192), max(64, (64 << 20) // (8 * (2 + words))))
        self._slot_words = _engine.staging_words(mw, words, records)
        self._host_slots, self._dev_slots = [], []
        for _ in range(2):
            host = int(check(cu.cuMemHostAlloc(8 * self._slot_words, CU_MEMHOSTALLOC_PORTABLE
                                               | CU_MEMHOSTALLOC_DEVICEMAP), "cuMemHostAlloc"))
            self._undo.callback(_release, cu.cuMemFreeHost, host)
            self._host_slots.append(host)
            self._dev_slots.append(int(check(cu.cuMemHostGetDevicePointer(host, 0),
                                             "cuMemHostGetDevicePointer")))
        self._events = []
        flags = int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        for _ in range(3):
            event = check(cu.cuEventCreate(flags), "cuEventCreate")
            self._undo.callback(_release, cu.cuEventDestroy, event)
            self._events.append(event)

    def _write_params(self) -> None:
        cfg, p = self.config, self._ptrs
        masks, mirror = cfg.mask_format != "none", self._mirror
        blob = _engine.step_params(
            capacity=cfg.capacity, owner_words=self._table.owner_words,
            bit_words=self._bit_words, max_write=cfg.max_write,
            n_windows=len(cfg.windows) if masks else 0, paged=int(cfg.paged),
            mask_format=_engine.MASK_FORMATS[cfg.mask_format],
            mask_row_bytes=mask_row_bytes(cfg),
            pos=mirror["pos"], owners=mirror["owners"], seqbits=mirror["seqbits"],
            cells=p["cells"], positions=p["positions"], read_len=p["read_len"],
            width=p["width"], seq_ids=p["seq_ids"],
            windows=list(cfg.windows) if masks else [],
            masks=[p[f"mask_w{w}"] for w in cfg.windows] if masks else [],
            # the paged view's addresses; 0 (the default) without it
            **{k: p[k] for k in ("qo_indptr", "kv_indptr", "kv_indices", "run_seq", "run_last",
                                 "run_kv") if k in p})
        self._params = self._alloc(len(blob), "step parameters", fill=None)
        data = np.frombuffer(blob, dtype=np.uint8)
        check(cu.cuMemcpyHtoD(self._params, data.ctypes.data, len(blob)), "cuMemcpyHtoD")

    def _build_buffers(self) -> None:
        for spec in step_buffers(self.config):
            self._buffers[spec.name] = DeviceBuffer(self, spec.name, self._ptrs[spec.name],
                                                    spec.shape, spec.dtype)
        self._pools_changed()

    def _pool_ptr(self, key: PoolKey) -> int:
        pools = self._pools
        if isinstance(pools, MappedPools):
            return pools.ptr(key)
        assert isinstance(pools, CopyPools)
        allocation = pools.allocations.get(key)
        return int(allocation.ptr) if allocation is not None else 0

    def _pools_changed(self) -> None:
        pools = self._pools
        mapped = isinstance(pools, MappedPools)
        sink = pools.sink if (mapped or pools.rows) else None     # None: no storage yet
        backed = (lambda: 0 if self._asleep else pools.rows) if mapped else None
        for key in self._row_bytes:
            spec = self._pool_view(key, sink)
            self._buffers[spec.name] = DeviceBuffer(self, spec.name, self._pool_ptr(key),
                                                    spec.shape, spec.dtype, backed)

    # -- the step --------------------------------------------------------------------------------
    def _resolve_stream(self, stream: object) -> int:
        handle = stream_handle(stream)
        if self._engine.is_capturing(handle):
            raise InvalidState(
                f"stream 0x{handle:x} is being captured; call prepare_step before capture "
                "begins (the step allocates, copies and launches outside the graph)")
        return handle

    def _before_step(self, stream: int) -> None:
        self._engine.order_after_commit(stream)
        self._reap()

    def _copy_rows(self, src: DeviceAllocation, dst: DeviceAllocation, nbytes: int,
                   stream: int) -> None:
        if nbytes:
            check(cu.cuMemcpyDtoDAsync(int(dst.ptr), int(src.ptr), nbytes, stream),
                  "cuMemcpyDtoDAsync")

    def _retire(self, allocation: DeviceAllocation, stream: int) -> None:
        """Queues ``allocation``'s release after the work now on ``stream`` (an event that
        :meth:`_reap` polls). Raises with nothing queued when the event cannot be made."""
        event = check(cu.cuEventCreate(int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)), "cuEventCreate")
        try:
            check(cu.cuEventRecord(event, stream), "cuEventRecord")
        except BaseException:
            with contextlib.suppress(Exception):
                check(cu.cuEventDestroy(event), "cuEventDestroy")
            raise
        self._retired.append((allocation, event))

    def _reap(self) -> None:
        """Frees retired pools whose last reader has finished. An allocator whose release
        raises gets a PoolReleaseWarning and the allocation stays queued for the next reap
        (or close); each entry leaves the queue only once released, so none is freed twice."""
        if not self._retired:                   # mapped pools never retire anything
            return
        allocator = self._pools.allocator                           # type: ignore[attr-defined]
        for entry in list(self._retired):
            allocation, event = entry
            code, _ = check(cu.cuEventQuery(event), "cuEventQuery", allowed=(drv.CUDA_ERROR_NOT_READY,))
            if code == 0 and release_quietly(allocator, allocation):
                self._retired.remove(entry)
                check(cu.cuEventDestroy(event), "cuEventDestroy")

    def _free_retired(self) -> None:
        """At close: waits for and releases every retired pool (a failing release warns)."""
        retired, self._retired = self._retired, []
        allocator = getattr(self._pools, "allocator", None)
        for allocation, event in retired:
            check(cu.cuEventSynchronize(event), "cuEventSynchronize")
            release_quietly(allocator, allocation)
            check(cu.cuEventDestroy(event), "cuEventDestroy")

    def _write_step(self, width: int, pad_to: int, read_len: int, stream: int) -> tuple:
        return self._engine.write_step(width, pad_to, read_len, self._pools.sink, stream)

    def _commit(self, stream: int) -> None:
        self._engine.commit(stream)

    def order_after_step(self, stream: int) -> None:
        """Makes ``stream`` (a raw handle) wait for the last step's buffer writes: what a
        buffer's consumer is owed (DLPack's contract, :meth:`DeviceBuffer.__dlpack__`)."""
        with self._lock:
            self._check_open()
            self._engine.order_after_step(stream)

    def read_device(self, ptr: int, out: np.ndarray) -> None:
        """Copies ``out.nbytes`` bytes from device address ``ptr`` into ``out`` once all work
        queued on the device so far is done (the cache's context made current): what
        :meth:`DeviceBuffer.copy_to_host` reads through."""
        self._ctx.make_current()
        check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        check(cu.cuMemcpyDtoH(out.ctypes.data, ptr, out.nbytes), "cuMemcpyDtoH")

    # -- parts built on demand --------------------------------------------------------------------
    def attention_kernels(self) -> AttentionKernels:
        """cellcache's attention kernels (:class:`cellcache.cuda.kernels.AttentionKernels`)
        for this cache's dtype, loaded in the cache's context on first use and released at
        :meth:`close`."""
        with self._lock:
            self._check_open()
            if self._attention_kernels is None:
                self._ctx.make_current()
                kernels = AttentionKernels(self.config.dtype, self._ctx.sm_count)
                self._undo.callback(kernels.close)
                self._attention_kernels = kernels
            return self._attention_kernels

    def scratch(self, name: str, nbytes: int) -> int:
        """The device address of at least ``nbytes`` bytes of scratch named ``name``, owned
        by the cache: allocated on first use, replaced by a larger allocation when asked for
        more (the old one is freed at once: the caller makes sure no queued work still reads
        it), freed at :meth:`close`. For a consumer's temporaries (the reference consumer's
        K/V upload)."""
        nbytes = check_int(nbytes, "nbytes", 0)
        with self._lock:
            self._check_open()
            ptr, size = self._scratch.get(name, (0, 0))
            if size < nbytes or not ptr:
                self._ctx.make_current()
                new = int(check(cu.cuMemAlloc(max(nbytes, 1)), f"cuMemAlloc({nbytes}) for scratch {name}"))
                if ptr:
                    check(cu.cuMemFree(ptr), "cuMemFree")
                else:
                    self._undo.callback(self._free_scratch, name)
                self._scratch[name] = ptr, size = new, nbytes
            return ptr

    def _free_scratch(self, name: str) -> None:
        ptr, _ = self._scratch.pop(name, (0, 0))
        if ptr:
            check(cu.cuMemFree(ptr), "cuMemFree")

    def phase_ns(self, reset: bool = True) -> dict[str, int]:
        """Host nanoseconds ``prepare_step`` spent so far staging, launching ``apply_step``,
        launching ``build_step`` and recording events (all zero unless the extension was
        built with ``CELLCACHE_PROFILE=1``); ``reset`` zeroes the counters."""
        with self._lock:
            self._check_open()
            return self._engine.phase_ns(reset)

    def metrics(self) -> dict:
        with self._lock:
            m = super().metrics()
            m["device_mirror_bytes"] = self._mirror_bytes
            m["staging_bytes"] = 16 * self._slot_words
            m["records_sent"] = self._engine.records_sent
            m["launches"] = self._engine.launches
            m["retired_pending"] = len(self._retired)
            if isinstance(self._pools, MappedPools):
                m["mapped_bytes"] = self._pools.mapped_bytes
            return m

    def _before_sleep(self) -> None:
        """Every queued work of the context has finished (a forward on a caller's stream
        may still be writing K/V into the pools sleep unmaps)."""
        self._ctx.make_current()
        check(cu.cuCtxSynchronize(), "cuCtxSynchronize")

    # -- teardown --------------------------------------------------------------------------------
    def _before_close(self) -> None:
        """close() waits for this cache's own recorded work (events, never a caller's
        stream); then every device, pinned and mapped allocation is released."""
        self._ctx.make_current()
        self._engine.synchronize()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown or a dead context
            pass
