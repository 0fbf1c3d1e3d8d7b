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
from .errors import OutOfMemory

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
            except (OSError, OverflowError, ValueError) as e:
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
        pass          # the mappings go with the last array that views them


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
    ``Step.grew`` is True only on the first step. With ``allocator`` (an object with
    ``allocate(nbytes, what)`` and ``release(allocation)``) the pools instead grow by
    copying into larger allocations from it, ``rows + 1`` rows each.

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
        super().__init__(config)

    def _make_pools(self) -> Pools:
        if self._allocator is None:
            return MappedHostPools(self._row_bytes, self.config.capacity)
        return CopyPools(self._row_bytes, self._allocator, _copy_rows,
                         lambda allocation, stream: self._allocator.release(allocation))

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
                raw = pools.allocations[(i, kv)]
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
