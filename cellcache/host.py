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

from ._views import fill_masks, fill_paged
from .buffers import step_buffers
from .cache import CellCache
from .config import CacheConfig
from .errors import InvalidArgument, OutOfMemory
from .pools import CopyPools, PoolKey, Pools, check_allocator, check_growth

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

    def sleep(self) -> None:
        """Gives the pages back to the system (``madvise(MADV_DONTNEED)``) and keeps the
        mappings: their addresses stay, and a row touched again reads zeros. Where the
        platform has no MADV_DONTNEED nothing is given back."""
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if advice is None:
            return
        for m in self.maps.values():
            m.madvise(advice)

    def wake(self) -> None:
        pass            # pages are committed again as they are touched

    def close(self) -> None:
        """Unmaps the reservations. A mapping that arrays still view (a caller kept a pool)
        is unmapped when the last of them is dropped instead."""
        maps, self.maps = self.maps, {}
        for m in maps.values():
            try:
                m.close()
            except BufferError:
                pass        # exported to live arrays: freed with the last one


def _zeros(shape: Any, dtype: Any, what: str) -> np.ndarray:
    try:
        return np.zeros(shape, dtype)
    except MemoryError as e:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        raise OutOfMemory(f"could not allocate {nbytes} bytes for the step buffer {what}") from e


class HostCellCache(CellCache):
    """The cache on numpy arrays; ``buffer(name)`` returns the array itself.

    ``growth``: ``"map"`` makes each pool a fixed-address mapping of ``capacity + 1`` rows
    (the last is the sink row) that commits memory as rows are touched: pools never move,
    so ``Step.grew`` is True only on the first step; ``"copy"`` grows by allocating larger
    pools (``rows + 1`` rows each) and copying the live rows, so the pools move at every
    growth and ``Step.grew`` reports each move (what CUDA does on devices without virtual
    memory management: a runner can be tested against moving pools on the host);
    ``"auto"`` (default) maps, and grows by copy where the address range cannot be reserved
    (an address-space limit such as ``ulimit -v``, a huge capacity).
    ``metrics()["pools_move"]`` says which.

    ``allocator`` (copy growth; an object with ``allocate(nbytes, what)`` returning a
    writable contiguous 1-D uint8 array of at least ``nbytes`` bytes, and
    ``release(allocation)``) gives the copy pools' storage (default: zeroed numpy arrays);
    with ``growth="auto"`` it selects copy growth. Growth is all or nothing: an allocation
    that fails or is refused gives back the attempt's others and changes nothing; a
    ``release`` of the old pools that raises after a growth is a
    :class:`cellcache.pools.PoolReleaseWarning` and is retried at the next growth (and at
    ``close()``). Memory exhausted while building raises :class:`OutOfMemory`.

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

    def __init__(self, config: CacheConfig, growth: str = "auto", allocator: Any = None):
        self._growth = check_growth(growth)
        self._allocator = check_allocator(allocator)
        if growth == "map" and allocator is not None:
            raise InvalidArgument("growth='map' maps the pools and uses no allocator; give the "
                                  "allocator with growth='copy' (or 'auto')")
        try:
            super().__init__(config)
        except MemoryError as e:          # numpy's, Python's: the library's own error
            if isinstance(e, OutOfMemory):
                raise
            raise OutOfMemory(f"building the host cache ran out of memory ({e!r})") from e

    def _make_pools(self) -> Pools:
        allocator = self._allocator
        if allocator is None and self._growth != "copy":
            try:
                return MappedHostPools(self._row_bytes, self.config.capacity)
            except OutOfMemory:
                if self._growth == "map":
                    raise
                # no room to reserve every row up front (an address-space limit, a huge
                # capacity): grow by copy instead; Step.grew then reports each move
        allocator = allocator or HostAllocator()
        return CopyPools(self._row_bytes, allocator, _copy_rows,
                         lambda allocation, stream: allocator.release(allocation),
                         _check_allocation)

    def _init_step_buffers(self) -> None:
        self._mask_rows: list[np.ndarray] = []      # each mask as [max_write, row bytes]
        self._windows: list[int] = []
        for spec in step_buffers(self.config):
            buf = _zeros(spec.shape, spec.dtype, spec.name)
            if spec.fill:
                buf[...] = spec.fill
            if spec.role == "mask":
                self._mask_rows.append(buf.reshape(self.config.max_write, -1))
                self._windows.append(spec.window)  # type: ignore[arg-type]
            self._buffers[spec.name] = buf
        self._pools_changed()

    def _pools_changed(self) -> None:
        pools = self._pools
        for key, nbytes in self._row_bytes.items():
            if isinstance(pools, MappedHostPools):
                raw = np.frombuffer(pools.maps[key], dtype=np.uint8)
            elif isinstance(pools, CopyPools) and pools.rows:
                raw = pools.allocations[key][:(pools.rows + 1) * nbytes]
            else:
                raw = np.zeros(0, np.uint8)
            view_rows = raw.nbytes // nbytes
            spec = self._pool_view(key, view_rows - 1 if view_rows else None)
            self._buffers[spec.name] = raw.view(spec.dtype).reshape(spec.shape)

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
            fill_masks(self._table, self._seq_ids[:width], self._positions[:width], read_len,
                       self._windows, self._mask_rows, pad_to=pad_to,
                       bits=self.config.mask_format == "bits")
        if not self.config.paged:
            return 0, None, None
        n_runs, _ = fill_paged(self._table, self._seq_ids[:width], self._positions[:width],
                               pad_to, sink, b["qo_indptr"], b["kv_indptr"], b["kv_indices"])
        n = n_runs + pad_to - width
        return n_runs, b["qo_indptr"][:n + 1].copy(), b["kv_indptr"][:n + 1].copy()


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
