"""The host backend: numpy step buffers and pools; masks filled by the Cython table.

It is the embedded default on machines without a GPU and the oracle the CUDA backend is
tested against.
"""

from __future__ import annotations

import numpy as np

from .cache import CellCache
from .errors import OutOfMemory

__all__ = ["HostAllocator", "HostCellCache"]


class HostAllocator:
    """Zeroed numpy byte arrays; a failed allocation raises OutOfMemory."""

    def allocate(self, nbytes: int, what: str) -> np.ndarray:
        try:
            return np.zeros(nbytes, dtype=np.uint8)
        except MemoryError as e:
            raise OutOfMemory(f"could not allocate {nbytes} bytes for {what}") from e

    def release(self, allocation: np.ndarray) -> None:
        pass  # numpy frees it with the last reference


class HostCellCache(CellCache):
    """The cache on numpy arrays; ``buffer(name)`` returns the array itself.

    Example
    -------
    >>> from cellcache import CacheConfig, LayerConfig, HostCellCache
    >>> cache = HostCellCache(CacheConfig(capacity=64, layers=[LayerConfig(2, 8)], max_write=8))
    >>> a = cache.seq_new()
    >>> cache.declare_step([a, a])
    True
    >>> step = cache.prepare_step()
    >>> cache.buffer("cells")[:step.width].tolist(), int(cache.buffer("read_len")[0])
    ([0, 1], 2)
    >>> cache.commit_step()
    """

    backend = "host"

    def _default_allocator(self) -> HostAllocator:
        return HostAllocator()

    def _init_step_buffers(self) -> None:
        cfg = self.config
        self._buffers: dict[str, np.ndarray] = {
            "cells": np.zeros(cfg.max_write, np.int64),
            "positions": np.zeros(cfg.max_write, np.int64),
            "read_len": np.zeros(1, np.int64),
        }
        self._mask_rows = []
        self._windows = list(cfg.windows)
        for w in cfg.windows:
            mask = np.zeros((1, 1, cfg.max_write, cfg.capacity), dtype=np.bool_)
            self._buffers[f"mask_w{w}"] = mask
            self._mask_rows.append(mask.reshape(cfg.max_write, cfg.capacity))
        self._pools_changed()

    def _pools_changed(self) -> None:
        dtype = self.config.np_dtype
        for name in self._pool_names():
            layer = self.config.layers[int(name.split("_")[1])]
            shape = (self._rows, layer.n_kv_heads, layer.head_dim)
            if self._rows:
                self._buffers[name] = self._allocations[name].view(dtype).reshape(shape)
            else:
                self._buffers[name] = np.zeros(shape, dtype)

    def _copy_rows(self, src: np.ndarray, dst: np.ndarray, nbytes: int, stream: int) -> None:
        dst[:nbytes] = src[:nbytes]

    def _write_step(self, width: int, read_len: int, stream: int) -> None:
        b = self._buffers
        b["cells"][:width] = self._cells[:width]
        b["positions"][:width] = self._positions[:width]
        b["read_len"][0] = read_len
        self._table.fill_masks(self._seq_ids[:width], self._positions[:width], read_len,
                               self._windows, self._mask_rows)

    def buffer(self, name: str) -> np.ndarray:
        """The named buffer (see ``buffer_names``): the live numpy array, not a copy."""
        with self._lock:
            try:
                return self._buffers[name]
            except (KeyError, TypeError):
                raise self._unknown_buffer(name) from None
