"""``CudaCellCache``: the cache on a CUDA device through the raw driver API (SPEC §7).

The table lives on the host (Cython); the device keeps a mirror of it (``pos`` as int32,
owner words word-major, and the same bits sequence-major for the masks) that each step's
uploaded change records update, and the kernels
in ``cuda/step.cu`` build ``cells``, ``positions``, ``read_len`` and every window's mask
from that mirror on the step's stream. See :mod:`cellcache._driver` for the per-step path.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _driver
from ..cache import CellCache, stream_handle
from ..config import CacheConfig
from ..errors import InvalidArgument, InvalidState, OutOfMemory
from ..registry import register_builder, set_cuda_probe
from . import driver as drv
from .driver import check, cu

__all__ = ["CudaCellCache", "DeviceAllocation", "DeviceAllocator", "DeviceBuffer", "register"]

# DLPack (code, bits) by numpy dtype name
_DLPACK = {"int64": (0, 64), "bool": (6, 8), "float16": (2, 16), "float32": (2, 32),
           "bfloat16": (4, 16)}
_entry_points_set = False
MAX_WINDOWS = 16          # MAX_WINDOWS in cuda/step.cu


class DeviceAllocation:
    """``nbytes`` of device memory at ``ptr`` (from cuMemAlloc)."""

    __slots__ = ("nbytes", "ptr")

    def __init__(self, ptr: int, nbytes: int):
        self.ptr, self.nbytes = ptr, nbytes


class DeviceAllocator:
    """cuMemAlloc / cuMemFree in the cache's context; out of memory raises OutOfMemory."""

    def __init__(self, ctx: drv.Context):
        self.ctx = ctx

    def allocate(self, nbytes: int, what: str) -> DeviceAllocation:
        self.ctx.make_current()
        result = cu.cuMemAlloc(max(int(nbytes), 1))
        code = int(result[0])
        if code != 0:
            name = drv.error_name(code)
            if name == "CUDA_ERROR_OUT_OF_MEMORY":
                free, total = check(cu.cuMemGetInfo(), "cuMemGetInfo")
                raise OutOfMemory(
                    f"could not allocate {nbytes} bytes on device {self.ctx.device_ordinal} "
                    f"for {what}: {name} ({free} of {total} bytes free)")
            drv.raise_cuda_error(code, f"cuMemAlloc({nbytes}) for {what}")
        return DeviceAllocation(int(result[1]), int(nbytes))

    def release(self, allocation: DeviceAllocation) -> None:
        self.ctx.make_current()
        check(cu.cuMemFree(allocation.ptr), "cuMemFree")


class DeviceBuffer:
    """A named device buffer of the cache: ``ptr``, ``shape``, ``dtype``, ``nbytes``,
    ``__cuda_array_interface__`` (not for bfloat16, which has no typestr), DLPack
    (``torch.from_dlpack(buf)`` works for every dtype) and ``copy_to_host()``.

    A pool buffer is valid until the pools grow (``Step.grew``): fetch it again then.
    """

    def __init__(self, cache: CudaCellCache, name: str, ptr: int, shape: tuple, dtype: np.dtype):
        self._cache = cache
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
        code, bits = _DLPACK[self.dtype.name]
        return _driver.dlpack_capsule(self, self.ptr, self.shape, code, bits,
                                      self._cache.config.device)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_driver.KDL_CUDA, self._cache.config.device)

    def copy_to_host(self) -> np.ndarray:
        """A numpy copy, after all work queued on the device so far (masks as numpy.bool_)."""
        out = np.empty(self.shape, dtype=self.dtype)
        if self.nbytes:
            self._cache._ctx.make_current()
            check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
            check(cu.cuMemcpyDtoH(out.ctypes.data, self.ptr, self.nbytes), "cuMemcpyDtoH")
        return out


class CudaCellCache(CellCache):
    """The cache on a CUDA device (the device's primary context, shared with PyTorch).

    Example
    -------
    >>> cache = CudaCellCache(CacheConfig(capacity=4096, layers=[LayerConfig(8, 128)],
    ...                                   max_write=64))              # doctest: +SKIP
    >>> a = cache.seq_new(); cache.declare_step([a] * 5)              # doctest: +SKIP
    >>> step = cache.prepare_step(stream=torch.cuda.current_stream()) # doctest: +SKIP
    >>> k_pool = torch.from_dlpack(cache.buffer("layer_0_k"))         # doctest: +SKIP
    """

    backend = "cuda"

    def __init__(self, config: CacheConfig, allocator: Any = None):
        if isinstance(config, CacheConfig) and config.capacity >= 2**31:
            raise InvalidArgument(
                f"capacity={config.capacity} is outside [1, 2**31 - 1] for the CUDA backend "
                "(the device mirror keeps positions as int32)")
        if isinstance(config, CacheConfig) and len(config.windows) > MAX_WINDOWS:
            raise InvalidArgument(
                f"{len(config.windows)} distinct windows; the CUDA backend builds at most "
                f"{MAX_WINDOWS} masks per step")
        self._closed = True
        self._owned: list[DeviceAllocation] = []
        self._host_slots: list[int] = []
        self._events: list[Any] = []
        self._modules: list[Any] = []
        self._retired: list[tuple[DeviceAllocation, Any]] = []
        self._scratch: DeviceAllocation | None = None
        self._ctx = drv.Context(config.device if isinstance(config, CacheConfig) else 0)
        try:
            super().__init__(config, allocator)
        except BaseException:
            self._free_all()
            raise
        self._closed = False

    # -- set-up ------------------------------------------------------------------------------
    def _tracks_changes(self) -> bool:
        return True

    def _default_allocator(self) -> DeviceAllocator:
        return DeviceAllocator(self._ctx)

    def _alloc(self, nbytes: int, what: str, fill: int | None = 0, fill32: bool = False) -> int:
        alloc = DeviceAllocator(self._ctx).allocate(nbytes, what)
        self._owned.append(alloc)
        if fill is not None and nbytes:
            if fill32:
                check(cu.cuMemsetD32(alloc.ptr, fill, nbytes // 4), "cuMemsetD32")
            else:
                check(cu.cuMemsetD8(alloc.ptr, fill, nbytes), "cuMemsetD8")
        return alloc.ptr

    def _init_step_buffers(self) -> None:
        global _entry_points_set
        cfg = self.config
        mw, cap, W = cfg.max_write, cfg.capacity, self._table.owner_words
        if not _entry_points_set:
            _driver.set_entry_points(drv.entry_points(_driver.ENTRY_POINTS))
            _entry_points_set = True
        self._ctx.make_current()
        step_mod = drv.load_module("step")
        self._modules.append(step_mod)
        kv_mod = drv.load_module("kv")
        self._modules.append(kv_mod)
        fns = {name: int(drv.function(step_mod, name)) for name in ("apply_delta", "fill_masks")}
        fns["scatter_rows"] = int(drv.function(kv_mod, "scatter_rows"))
        self._ptrs: dict[str, int] = {
            "cells": self._alloc(8 * mw, "cells"),
            "positions": self._alloc(8 * mw, "positions"),
            "read_len": self._alloc(8, "read_len"),
        }
        for w in cfg.windows:
            self._ptrs[f"mask_w{w}"] = self._alloc(mw * cap, f"mask_w{w}")
        dev_pos = self._alloc(4 * cap, "device mirror (pos)", fill=0xFFFFFFFF, fill32=True)
        dev_owners = self._alloc(8 * W * cap, "device mirror (owners)")
        bit_words = (cap + 63) // 64
        dev_seqbits = self._alloc(8 * cfg.max_seqs * bit_words, "device mirror (sequence bits)")
        windows = np.array(cfg.windows, dtype=np.int64)
        mask_ptrs = np.array([self._ptrs[f"mask_w{w}"] for w in cfg.windows], dtype=np.uint64)
        windows_dev = self._alloc(windows.nbytes, "windows", fill=None)
        masks_dev = self._alloc(mask_ptrs.nbytes, "mask pointers", fill=None)
        check(cu.cuMemcpyHtoD(windows_dev, windows.ctypes.data, windows.nbytes), "cuMemcpyHtoD")
        check(cu.cuMemcpyHtoD(masks_dev, mask_ptrs.ctypes.data, mask_ptrs.nbytes), "cuMemcpyHtoD")
        records = min(max(2 * mw, 8192), max(64, (64 << 20) // (8 * (2 + W))))
        self._slot_bytes = 8 * (3 * mw + 2 + records * (2 + W))
        dev_slots = [self._alloc(self._slot_bytes, "staging", fill=None) for _ in range(2)]
        for _ in range(2):
            ptr = check(cu.cuMemAllocHost(self._slot_bytes), "cuMemAllocHost")
            self._host_slots.append(int(ptr))
        flags = int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        for _ in range(3):
            self._events.append(check(cu.cuEventCreate(flags), "cuEventCreate"))
        check(cu.cuCtxSynchronize(), "cuCtxSynchronize")      # zeroed before first use
        self._mirror_bytes = 4 * cap + 8 * W * cap + 8 * cfg.max_seqs * bit_words
        self._engine = _driver.StepEngine(self._table, {
            "ctx": self._ctx.handle, **fns, "slot_bytes": self._slot_bytes,
            "dev_pos": dev_pos, "dev_owners": dev_owners, "dev_seqbits": dev_seqbits,
            "cells": self._ptrs["cells"], "positions": self._ptrs["positions"],
            "read_len": self._ptrs["read_len"], "windows": windows_dev, "masks": masks_dev,
            "n_windows": len(cfg.windows), "host_slots": self._host_slots,
            "dev_slots": dev_slots, "slot_events": [int(e) for e in self._events[:2]],
            "commit_event": int(self._events[2]), "sm_count": self._ctx.sm_count,
        }, self._seq_ids, self._positions, self._cells)
        self._buffers: dict[str, DeviceBuffer] = {}
        self._build_buffers()

    def _build_buffers(self) -> None:
        cfg = self.config
        mw, cap = cfg.max_write, cfg.capacity
        b = {
            "cells": DeviceBuffer(self, "cells", self._ptrs["cells"], (mw,), np.int64),
            "positions": DeviceBuffer(self, "positions", self._ptrs["positions"], (mw,), np.int64),
            "read_len": DeviceBuffer(self, "read_len", self._ptrs["read_len"], (1,), np.int64),
        }
        for w in cfg.windows:
            b[f"mask_w{w}"] = DeviceBuffer(self, f"mask_w{w}", self._ptrs[f"mask_w{w}"],
                                           (1, 1, mw, cap), np.bool_)
        for name in self._pool_names():
            layer = cfg.layers[int(name.split("_")[1])]
            alloc = self._allocations.get(name)
            b[name] = DeviceBuffer(self, name, alloc.ptr if alloc else 0,
                                   (self._rows, layer.n_kv_heads, layer.head_dim), cfg.np_dtype)
        self._buffers = b

    def _pools_changed(self) -> None:
        if hasattr(self, "_engine"):
            self._build_buffers()

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
            check(cu.cuMemcpyDtoDAsync(dst.ptr, src.ptr, nbytes, stream), "cuMemcpyDtoDAsync")

    def _retire(self, allocation: DeviceAllocation, stream: int) -> None:
        event = check(cu.cuEventCreate(int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)), "cuEventCreate")
        check(cu.cuEventRecord(event, stream), "cuEventRecord")
        self._retired.append((allocation, event))

    def _reap(self) -> None:
        """Frees retired pools whose last reader has finished."""
        keep = []
        for allocation, event in self._retired:
            code = int(cu.cuEventQuery(event)[0])
            if code == 0:
                self._allocator.release(allocation)
                check(cu.cuEventDestroy(event), "cuEventDestroy")
            elif drv.error_name(code) == "CUDA_ERROR_NOT_READY":
                keep.append((allocation, event))
            else:
                drv.raise_cuda_error(code, "cuEventQuery")
        self._retired = keep

    def _write_step(self, width: int, read_len: int, stream: int) -> None:
        self._engine.write_step(width, read_len, stream)

    def _commit(self, stream: int) -> None:
        self._engine.commit(stream)

    # -- buffers ---------------------------------------------------------------------------------
    def buffer(self, name: str) -> DeviceBuffer:
        """The named device buffer (see ``buffer_names``)."""
        with self._lock:
            self._check_open()
            try:
                return self._buffers[name]
            except (KeyError, TypeError):
                raise self._unknown_buffer(name) from None

    def write_kv(self, layer: int, k: np.ndarray, v: np.ndarray, width: int,
                 stream: object = None) -> None:
        """Writes host K and V rows (``[width, n_kv_heads, head_dim]``) at ``cells[:width]``
        with the ``scatter_rows`` kernel, as a forward would (tests and the demo)."""
        with self._lock:
            self._check_open()
            cfg = self.config.layers[layer]
            row_bytes = cfg.row_elems * self.config.np_dtype.itemsize
            handle = stream_handle(stream)
            if self._scratch is None:
                most = max(la.row_elems for la in self.config.layers) * self.config.np_dtype.itemsize
                self._scratch = DeviceAllocator(self._ctx).allocate(
                    2 * self.config.max_write * most, "write_kv scratch")
                self._owned.append(self._scratch)
            for i, rows in enumerate((k, v)):
                src = np.ascontiguousarray(rows[:width], dtype=self.config.np_dtype)
                dst = self._scratch.ptr + i * self.config.max_write * row_bytes
                check(cu.cuStreamSynchronize(handle), "cuStreamSynchronize")
                check(cu.cuMemcpyHtoD(dst, src.ctypes.data, src.nbytes), "cuMemcpyHtoD")
                pool = self._buffers[f"layer_{layer}_{'kv'[i]}"]
                self._engine.scatter_rows(dst, width, pool.ptr, row_bytes, handle)

    def metrics(self) -> dict:
        m = super().metrics()
        m["device_mirror_bytes"] = self._mirror_bytes
        m["staging_bytes"] = 2 * self._slot_bytes
        m["records_sent"] = self._engine.records_sent
        m["retired_pending"] = len(self._retired)
        return m

    # -- teardown --------------------------------------------------------------------------------
    def close(self) -> None:
        """Waits for this cache's own recorded work (events, never a caller's stream) and frees
        every device and pinned allocation. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._ctx.make_current()
            self._engine.synchronize()
            for allocation, event in self._retired:
                check(cu.cuEventSynchronize(event), "cuEventSynchronize")
                self._allocator.release(allocation)
                check(cu.cuEventDestroy(event), "cuEventDestroy")
            self._retired = []
            for allocation in self._allocations.values():
                self._allocator.release(allocation)
            self._allocations = {}
            self._free_all()

    def _free_all(self) -> None:
        self._ctx.make_current()
        for alloc in self._owned:
            cu.cuMemFree(alloc.ptr)
        self._owned = []
        for ptr in self._host_slots:
            cu.cuMemFreeHost(ptr)
        self._host_slots = []
        for event in self._events:
            cu.cuEventDestroy(event)
        self._events = []
        for module in self._modules:
            cu.cuModuleUnload(module)
        self._modules = []
        self._ctx.release()

    def __enter__(self) -> CudaCellCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown or a dead context
            pass


def register() -> None:
    """Registers backend 'cuda' for kinds 'batched-cell' and 'batched' (once)."""
    from ..registry import registered

    if "cuda" in registered():
        return
    for kind in ("batched-cell", "batched"):
        register_builder("cuda", kind, CudaCellCache)
    set_cuda_probe(drv.device_usable)
