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

from ..cache import (
    CellCache,
    CopyPools,
    PoolKey,
    Pools,
    check_allocator,
    release_quietly,
    stream_handle,
)
from ..config import CacheConfig
from ..errors import InvalidArgument, InvalidState, OutOfMemory
from . import _dlpack, _engine, _launch
from . import driver as drv
from .driver import check, cu
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

# DLPack (code, bits) by numpy dtype name
_DLPACK = {"int64": (0, 64), "int32": (0, 32), "uint8": (1, 8), "bool": (6, 8),
           "float16": (2, 16), "float32": (2, 32), "bfloat16": (4, 16)}
_GROWTH = ("auto", "map", "copy")
CU_MEMHOSTALLOC_PORTABLE = 0x01
CU_MEMHOSTALLOC_DEVICEMAP = 0x02


def _release(fn: Any, handle: Any) -> None:
    """Releases one resource through the one error path (the undo stack's callbacks)."""
    check(fn(handle), fn.__name__)


class DeviceBuffer:
    """A named device buffer of the cache: ``ptr``, ``shape``, ``dtype``, ``nbytes``,
    ``__cuda_array_interface__`` (not for bfloat16, which has no typestr), DLPack
    (``torch.from_dlpack(buf)`` works for every dtype, ordered after the last step's writes
    on the consumer's stream) and ``copy_to_host()``.
    """

    def __init__(self, cache: CudaCellCache, name: str, ptr: int, shape: tuple, dtype: Any,
                 backed_rows: Any = None):
        self._cache = cache
        self._backed_rows = backed_rows     # pools: how many leading rows have memory now
        self.name, self.ptr, self.shape, self.dtype = name, int(ptr), tuple(shape), np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"DeviceBuffer({self.name!r}, ptr=0x{self.ptr:x}, shape={self.shape}, dtype={self.dtype})"

    @property
    def __cuda_array_interface__(self) -> dict:
        if self.dtype.name == "bfloat16":
            raise AttributeError("bfloat16 has no __cuda_array_interface__ typestr; use DLPack")
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False),
                "version": 3, "strides": None}

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        if copy:
            raise BufferError("cellcache buffers are exported without copying")
        if stream is not None and not isinstance(stream, int):
            raise InvalidArgument(f"stream of type {type(stream).__name__} is not a DLPack stream")
        if stream != -1:       # DLPack: make the producer's work visible on the consumer's stream
            self._cache._order_consumer(0 if stream is None else stream)
        code, bits = _DLPACK[self.dtype.name]
        return _dlpack.dlpack_capsule(self, self.ptr, self.shape, code, bits,
                                      self._cache.config.device)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_dlpack.KDL_CUDA, self._cache.config.device)

    def copy_to_host(self) -> np.ndarray:
        """A numpy copy, after all work queued on the device so far (masks as numpy.bool_).

        A pool's copy holds the rows that have memory behind them: ``[0, cache.rows)``.
        """
        shape = self.shape
        if self._backed_rows is not None:
            shape = (min(shape[0], self._backed_rows()),) + shape[1:]
        out = np.empty(shape, dtype=self.dtype)
        if out.nbytes:
            self._cache._ctx.make_current()
            check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
            check(cu.cuMemcpyDtoH(out.ctypes.data, self.ptr, out.nbytes), "cuMemcpyDtoH")
        return out


class CudaCellCache(CellCache):
    """The cache on a CUDA device (the device's primary context, shared with PyTorch).

    ``growth``: ``"map"`` reserves each pool's addresses for ``capacity + 1`` rows and maps
    memory as it grows (pools never move; ``Step.grew`` only on the first step); ``"copy"``
    allocates larger pools and copies (``Step.grew`` on every growth; ``allocator`` gives
    the storage: an object with an int device address ``ptr`` and ``nbytes``, checked before
    the pools switch); ``"auto"`` (default) maps where the device supports it and the full
    address range can be reserved, else grows by copy.

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
        if growth not in _GROWTH:
            raise InvalidArgument(f"growth={growth!r} is not one of {', '.join(_GROWTH)}")
        check_allocator(allocator)
        self._closed = True
        self._growth, self._allocator_arg = growth, allocator
        self._retired: list[tuple[Any, Any]] = []
        self._undo = contextlib.ExitStack()     # every resource, released in reverse order
        require_cuda()              # no driver, no device, wrong cuda-bindings: one CudaError
        try:
            self._ctx = drv.Context(config.device)
            self._undo.callback(self._ctx.release)
            super().__init__(config)
        except BaseException as e:
            with contextlib.suppress(Exception):
                self._undo.close()
            if isinstance(e, MemoryError) and not isinstance(e, OutOfMemory):
                raise OutOfMemory(f"building the CUDA cache ran out of host memory ({e!r})") from e
            raise
        self._closed = False

    # -- set-up ------------------------------------------------------------------------------
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
        pools = CopyPools(self._row_bytes, allocator, self._copy_rows, self._retire,
                          check_device_allocation)
        self._undo.callback(pools.close)
        self._undo.callback(self._free_retired)
        return pools

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
        self._fn_build = drv.function(module, "build_step")

    def _alloc_step_buffers(self) -> None:
        cfg = self.config
        mw, cap = cfg.max_write, cfg.capacity
        p = {name: self._alloc(8 * n, name)
             for name, n in (("cells", mw), ("positions", mw), ("read_len", 1), ("width", 1),
                             ("seq_ids", mw))}
        self._mask_row_bytes = 0
        if cfg.mask_format != "none":
            self._mask_row_bytes = cap if cfg.mask_format == "bool" else (cap + 7) // 8
            for w in cfg.windows:
                p[f"mask_w{w}"] = self._alloc(mw * self._mask_row_bytes, f"mask_w{w}")
        if cfg.paged:
            for name, n in (("qo_indptr", mw + 1), ("kv_indptr", mw + 1),
                            ("kv_indices", cfg.kv_entries + mw)):
                p[name] = self._alloc(4 * n, name)
            p["kv_last_page_len"] = self._alloc(4 * mw, "kv_last_page_len", fill=1)
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
            mask_row_bytes=self._mask_row_bytes,
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
        cfg = self.config
        mw, cap, p = cfg.max_write, cfg.capacity, self._ptrs
        b = {name: DeviceBuffer(self, name, p[name], shape, dtype) for name, shape, dtype in (
            ("cells", (mw,), np.int64), ("positions", (mw,), np.int64),
            ("read_len", (1,), np.int64), ("width", (1,), np.int64))}
        for w in cfg.windows if cfg.mask_format != "none" else ():
            shape = (1, 1, mw, cap) if cfg.mask_format == "bool" else (mw, (cap + 7) // 8)
            dtype = np.bool_ if cfg.mask_format == "bool" else np.uint8
            b[f"mask_w{w}"] = DeviceBuffer(self, f"mask_w{w}", p[f"mask_w{w}"], shape, dtype)
        if cfg.paged:
            for name, n in (("qo_indptr", mw + 1), ("kv_indptr", mw + 1),
                            ("kv_indices", cfg.kv_entries + mw), ("kv_last_page_len", mw)):
                b[name] = DeviceBuffer(self, name, p[name], (n,), np.int32)
        self._buffers = b
        self._pools_changed()

    def _pool_ptr(self, key: PoolKey) -> int:
        pools = self._pools
        if isinstance(pools, MappedPools):
            return pools.ptr(key)
        assert isinstance(pools, CopyPools)
        allocation = pools.allocations.get(key)
        return int(allocation.ptr) if allocation is not None else 0

    def _pools_changed(self) -> None:
        cfg, pools = self.config, self._pools
        mapped = isinstance(pools, MappedPools)
        rows = pools.sink + 1 if (mapped or pools.rows) else 0
        backed = (lambda: pools.rows) if mapped else None
        for (i, kv) in self._row_bytes:
            layer = cfg.layers[i]
            name = f"layer_{i}_{kv}"
            self._buffers[name] = DeviceBuffer(self, name, self._pool_ptr((i, kv)),
                                               (rows, layer.n_kv_heads, layer.head_dim),
                                               cfg.np_dtype, backed)

    # -- the step --------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidState("this CudaCellCache is closed")

    def _resolve_stream(self, stream: object) -> int:
        self._check_open()
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

    def _order_consumer(self, stream: int) -> None:
        """Makes ``stream`` wait for the last step's buffer writes (DLPack's contract)."""
        with self._lock:
            self._check_open()
            self._engine.order_after_step(stream)

    # -- buffers ---------------------------------------------------------------------------------
    def buffer(self, name: str) -> DeviceBuffer:
        """The named device buffer (see ``buffer_names``)."""
        with self._lock:
            self._check_open()
            try:
                return self._buffers[name]
            except (KeyError, TypeError):
                raise self._unknown_buffer(name) from None

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

    # -- teardown --------------------------------------------------------------------------------
    def close(self) -> None:
        """Waits for this cache's own recorded work (events, never a caller's stream) and
        releases every device, pinned and mapped allocation. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._ctx.make_current()
            self._engine.synchronize()
            self._undo.close()

    def __enter__(self) -> CudaCellCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown or a dead context
            pass
