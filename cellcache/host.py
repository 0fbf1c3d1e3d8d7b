"""The host backend: numpy step buffers and pools; masks and the paged view filled by the
Cython table.

It is the embedded default on machines without a GPU and the oracle the CUDA backend is
tested against.
"""

from __future__ import annotations

import mmap
import sys
from typing import Any

import numpy as np

from .cache import CellCache, CopyPools, PoolKey, Pools, check_allocator
from .config import CacheConfig
from .errors import InvalidArgument, OutOfMemory

__all__ = ["HostAllocator", "HostCellCache", "MappedHostPools"]

# Linux: reserve address space without committing swap for it (Python < 3.13 lacks the name)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


class HostAllocator:
    """Zeroed numpy byte arrays; a failed allocation raises OutOfMemory."""

    def allocate(self, nbytes: int, what: str) -> np.ndarray:
        try:
            return np.zeros(nbytes, dtype=np.uint8)
        except MemoryError as e:
            raise OutOfMemory(f"could not allocate {nbytes} bytes for {what}") from e

    def release(self, allocation: np.ndarray) -> None:
        pass  # numpy frees it with the last reference


class MappedHostPools:
    """Pools at fixed addresses: each is an anonymous mapping of ``capacity + 1`` rows made
    when the cache is built (the last row is the sink). Pages are committed as they are
    first touched, so growth allocates and copies nothing, and never moves a pool."""

    moves = False

    def __init__(self, row_bytes: dict[PoolKey, int], capacity: int):
        self.row_bytes = row_bytes
        self.capacity = capacity
        self.rows = 0
        self.maps: dict[PoolKey, mmap.mmap] = {}
        for key, nbytes in row_bytes.items():
            size = (capacity + 1) * nbytes
            try:
                self.maps[key] = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                                           | _MAP_NORESERVE)
            except (OSError, OverflowError, ValueError, MemoryError) as e:
                self.close()
                raise OutOfMemory(
                    f"could not reserve {size} bytes of address space for pool layer_{key[0]}_"
                    f"{key[1]} ({capacity + 1} rows): {e}") from e

    @property
    def sink(self) -> int:
        return self.capacity

    def plan(self, rows: int) -> int:
        return rows

    def apply(self, plan: int, live_rows: int, stream: int) -> bool:
        self.rows = plan
        return False

    def cancel(self, plan: int) -> None:
        pass

    def close(self) -> None:
        """Unmaps the reservations; only for pools no array views yet (a failed build)."""
        maps, self.maps = self.maps, {}
        for m in maps.values():
            m.close()


def _zeros(shape: Any, dtype: Any, what: str) -> np.ndarray:
    try:
        return np.zeros(shape, dtype)
    except MemoryError as e:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        raise OutOfMemory(f"could not allocate {nbytes} bytes for the step buffer {what}") from e


class HostCellCache(CellCache):
    """The cache on numpy arrays; ``buffer(name)`` returns the array itself.

    By default the pools are fixed-address mappings of ``capacity + 1`` rows (the last is
    the sink row) that commit memory as rows are touched: they never move, so
    ``Step.grew`` is True only on the first step. Where that address range cannot be
    reserved (an address-space limit such as ``ulimit -v``, a huge capacity) the cache grows
    by copy instead, as with an allocator (``metrics()["pools_move"]`` says which). With
    ``allocator`` (an object with ``allocate(nbytes, what)`` returning a writable contiguous
    1-D uint8 array of at least ``nbytes`` bytes, and ``release(allocation)``) the pools grow
    by copying into larger allocations from it, ``rows + 1`` rows each, all or nothing: an
    allocation that fails or is refused gives back the attempt's others and changes nothing;
    a ``release`` of the old pools that raises after a growth is a
    :class:`cellcache.cache.PoolReleaseWarning` and is retried at the next growth. Memory
    exhausted while building raises :class:`OutOfMemory`.

    Example
    -------
    >>> from cellcache import CacheConfig, LayerConfig, HostCellCache
    >>> cache = HostCellCache(CacheConfig(capacity=64, layers=[LayerConfig(2, 8)], max_write=8))
    >>> a = cache.seq_new()
    >>> cache.declare_step([a, a])
    True
    >>> step = cache.prepare_step(pad_to=4)
    >>> cache.buffer("cells")[:step.pad_to].tolist(), int(cache.buffer("read_len")[0])
    ([0, 1, 64, 64], 2)
    >>> cache.commit_step()
    """

    backend = "host"

    def __init__(self, config: CacheConfig, allocator: Any = None):
        self._allocator = check_allocator(allocator)
        try:
            super().__init__(config)
        except MemoryError as e:          # numpy's, Python's: the library's own error
            if isinstance(e, OutOfMemory):
                raise
            raise OutOfMemory(f"building the host cache ran out of memory ({e!r})") from e

    def _make_pools(self) -> Pools:
        allocator = self._allocator
        if allocator is None:
            try:
                return MappedHostPools(self._row_bytes, self.config.capacity)
            except OutOfMemory:
                # no room to reserve every row up front (an address-space limit, a huge
                # capacity): grow by copy instead; Step.grew then reports each move
                allocator = HostAllocator()
        return CopyPools(self._row_bytes, allocator, _copy_rows,
                         lambda allocation, stream: allocator.release(allocation),
                         _check_allocation)

    def _init_step_buffers(self) -> None:
        cfg = self.config
        mw, cap = cfg.max_write, cfg.capacity
        b: dict[str, np.ndarray] = {
            "cells": _zeros(mw, np.int64, "cells"),
            "positions": _zeros(mw, np.int64, "positions"),
            "read_len": _zeros(1, np.int64, "read_len"),
            "width": _zeros(1, np.int64, "width"),
        }
        self._mask_rows: list[np.ndarray] = []
        if cfg.mask_format != "none":
            for w in cfg.windows:
                if cfg.mask_format == "bool":
                    mask = _zeros((1, 1, mw, cap), np.bool_, f"mask_w{w}")
                    self._mask_rows.append(mask.reshape(mw, cap))
                else:
                    mask = _zeros((mw, (cap + 7) // 8), np.uint8, f"mask_w{w}")
                    self._mask_rows.append(mask)
                b[f"mask_w{w}"] = mask
        if cfg.paged:
            b["qo_indptr"] = _zeros(mw + 1, np.int32, "qo_indptr")
            b["kv_indptr"] = _zeros(mw + 1, np.int32, "kv_indptr")
            b["kv_indices"] = _zeros(cfg.kv_entries + mw, np.int32, "kv_indices")
            b["kv_last_page_len"] = _zeros(mw, np.int32, "kv_last_page_len")
            b["kv_last_page_len"][:] = 1
        self._buffers = b
        self._windows = list(cfg.windows)
        self._pools_changed()

    def _pools_changed(self) -> None:
        dtype = self.config.np_dtype
        pools = self._pools
        for (i, kv), nbytes in self._row_bytes.items():
            layer = self.config.layers[i]
            if isinstance(pools, MappedHostPools):
                raw = np.frombuffer(pools.maps[(i, kv)], dtype=np.uint8)
            elif isinstance(pools, CopyPools) and pools.rows:
                raw = pools.allocations[(i, kv)][:(pools.rows + 1) * nbytes]
            else:
                raw = np.zeros(0, np.uint8)
            rows = raw.nbytes // nbytes
            self._buffers[f"layer_{i}_{kv}"] = raw.view(dtype).reshape(
                rows, layer.n_kv_heads, layer.head_dim)

    def _write_step(self, width: int, pad_to: int, read_len: int, stream: int) -> tuple:
        b = self._buffers
        sink = self._pools.sink
        b["cells"][:width] = self._cells[:width]
        b["cells"][width:pad_to] = sink
        b["positions"][:width] = self._positions[:width]
        b["positions"][width:pad_to] = self._positions[0]
        b["read_len"][0] = read_len
        b["width"][0] = width
        if self._mask_rows:
            self._table.fill_masks(self._seq_ids[:width], self._positions[:width], read_len,
                                   self._windows, self._mask_rows, pad_to=pad_to,
                                   bits=self.config.mask_format == "bits")
        if not self.config.paged:
            return 0, None, None
        n_runs, _ = self._table.fill_paged(self._seq_ids[:width], self._positions[:width],
                                           pad_to, sink, b["qo_indptr"], b["kv_indptr"],
                                           b["kv_indices"])
        n = n_runs + pad_to - width
        return n_runs, b["qo_indptr"][:n + 1].copy(), b["kv_indptr"][:n + 1].copy()

    def buffer(self, name: str) -> np.ndarray:
        """The named buffer (see ``buffer_names``): the live numpy array, not a copy."""
        with self._lock:
            try:
                return self._buffers[name]
            except (KeyError, TypeError):
                raise self._unknown_buffer(name) from None


def _copy_rows(src: np.ndarray, dst: np.ndarray, nbytes: int, stream: int) -> None:
    dst[:nbytes] = src[:nbytes]


def _check_allocation(allocation: Any, nbytes: int, what: str) -> None:
    """Refuses (InvalidArgument) an allocation the pools cannot view as ``nbytes`` bytes."""
    if (isinstance(allocation, np.ndarray) and allocation.dtype == np.uint8
            and allocation.ndim == 1 and allocation.flags.c_contiguous
            and allocation.flags.writeable and allocation.size >= nbytes):
        return
    if isinstance(allocation, np.ndarray):
        flags = allocation.flags
        shown = (f"a {'' if flags.writeable else 'read-only '}"
                 f"{'' if flags.c_contiguous else 'non-contiguous '}array of dtype "
                 f"{allocation.dtype} and shape {allocation.shape}")
    else:
        shown = f"an object of type {type(allocation).__name__}"
    raise InvalidArgument(
        f"the allocator returned {shown} for {what}; it must return a writable contiguous "
        f"1-D uint8 array of at least {nbytes} bytes")
