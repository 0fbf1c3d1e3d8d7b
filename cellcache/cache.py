"""The backend-neutral cache: cell table + K/V pools + step buffers + one re-entrant lock.

A backend (host, cuda) supplies the storage: an allocator, the step buffers, how live
pool rows are copied on growth, how the step buffers are written, and what a commit does.
Everything the spec says about order, growth and rollback is decided here, once.
"""

from __future__ import annotations

import operator
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ._checks import check_int
from ._table import CellTable
from .config import CacheConfig
from .errors import InvalidArgument, InvalidState, OutOfMemory

__all__ = ["Allocator", "CellCache", "Step", "stream_handle"]


@dataclass(frozen=True)
class Step:
    """What ``prepare_step`` placed: host copies of the step's buffers.

    ``grew`` is True when the pools' addresses changed (the first step, or a growth):
    captured graphs that read the pools must be recaptured.
    """

    width: int
    read_len: int
    cells: np.ndarray
    positions: np.ndarray
    seq_ids: np.ndarray
    grew: bool


class Allocator(Protocol):
    """Where pool storage comes from; tests wrap one to fail at a chosen allocation."""

    def allocate(self, nbytes: int, what: str) -> Any:
        """Returns an allocation of ``nbytes`` bytes, or raises OutOfMemory."""

    def release(self, allocation: Any) -> None:
        """Gives an allocation back (the backend ensures no queued work still reads it)."""


def stream_handle(stream: object) -> int:
    """The raw handle of a stream given as None (0), an int, or an object with
    ``cuda_stream`` (torch), ``handle`` or ``ptr`` (cupy, cuda.core)."""
    if stream is None:
        return 0
    value: Any = stream
    for attr in ("cuda_stream", "handle", "ptr"):
        if hasattr(stream, attr):
            value = getattr(stream, attr)
            break
    if isinstance(value, bool):
        value = None
    try:
        handle = operator.index(value)
    except TypeError:
        try:  # cuda.bindings' CUstream and friends convert through int()
            handle = int(value)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            raise InvalidArgument(
                f"stream {stream!r} is not a stream: give None, an int handle, or an object "
                "with .cuda_stream (torch), .handle or .ptr (cupy, cuda.core)"
            ) from None
    if handle < 0:
        raise InvalidArgument(f"stream handle {handle} is negative")
    return handle


class CellCache:
    """The cache of SPEC §3-5 over some storage backend. Use a backend class
    (:class:`cellcache.HostCellCache`, ``CudaCellCache``) or :func:`cellcache.build`.

    Every public method takes the cache's re-entrant lock.
    """

    backend = "abstract"

    def __init__(self, config: CacheConfig, allocator: Allocator | None = None):
        if not isinstance(config, CacheConfig):
            raise InvalidArgument(f"config={config!r} is not a CacheConfig")
        self.config = config
        self._lock = threading.RLock()
        self._table = CellTable(config.capacity, config.max_seqs, config.max_write,
                                track_changes=self._tracks_changes())
        self._allocator = allocator if allocator is not None else self._default_allocator()
        self._rows = 0
        self._growth_count = 0
        self._allocations: dict[str, Any] = {}      # pool name -> allocation
        self._row_bytes = [layer.row_elems * config.np_dtype.itemsize for layer in config.layers]
        self._cells = np.zeros(config.max_write, np.int64)       # placement output (host)
        self._positions = np.zeros(config.max_write, np.int64)
        self._seq_ids = np.zeros(config.max_write, np.int64)
        self._prepared: Step | None = None
        self._prepared_stream = 0
        self._steps = 0
        self._init_step_buffers()

    # -- backend hooks ---------------------------------------------------------------------
    def _tracks_changes(self) -> bool:
        return False

    def _default_allocator(self) -> Allocator:
        raise NotImplementedError

    def _init_step_buffers(self) -> None:
        raise NotImplementedError

    def _resolve_stream(self, stream: object) -> int:
        """The stream's handle; refuses a bad or unusable stream without side effects."""
        return stream_handle(stream)

    def _before_step(self, stream: int) -> None:
        """Orders the step after earlier committed work (called once the step will run)."""

    def _copy_rows(self, src: Any, dst: Any, nbytes: int, stream: int) -> None:
        raise NotImplementedError

    def _retire(self, allocation: Any, stream: int) -> None:
        """Release an old pool once no queued work can read it."""
        self._allocator.release(allocation)

    def _pools_changed(self) -> None:
        """Called after the pools moved (the backend rebuilds its views)."""

    def _write_step(self, width: int, read_len: int, stream: int) -> None:
        raise NotImplementedError

    def _commit(self, stream: int) -> None:
        pass

    def buffer(self, name: str) -> Any:
        raise NotImplementedError

    # -- names -------------------------------------------------------------------------------
    @property
    def buffer_names(self) -> list[str]:
        """Every buffer a forward may read or write, by name."""
        names = ["cells", "positions", "read_len"]
        names += [f"mask_w{w}" for w in self.config.windows]
        for i in range(len(self.config.layers)):
            names += [f"layer_{i}_k", f"layer_{i}_v"]
        return names

    def _unknown_buffer(self, name: object) -> InvalidArgument:
        return InvalidArgument(
            f"no buffer named {name!r}; buffers are: {', '.join(self.buffer_names)}")

    def _pool_names(self) -> list[str]:
        return [n for n in self.buffer_names if n.startswith("layer_")]

    # -- verbs (SPEC §3) -----------------------------------------------------------------------
    def seq_new(self) -> int | None:
        """Returns the lowest id that is not live, now live; None when every id is live."""
        with self._lock:
            return self._table.seq_new()

    def seq_clone(self, src: int, upto: int | None = None) -> int | None:
        """Returns a new id co-owning src's cells with ``pos < upto`` (all if None), or None."""
        with self._lock:
            return self._table.seq_clone(src, upto)

    def seq_rm(self, seq: int) -> bool:
        """Drops seq everywhere and releases its id; False if not live."""
        with self._lock:
            return self._table.seq_rm(seq)

    def rewind(self, seq: int, position: int) -> bool:
        """Drops seq's claim on positions >= position; False if not live or out of range."""
        with self._lock:
            return self._table.rewind(seq, position)

    def pos(self, seq: int) -> int:
        with self._lock:
            return self._table.pos(seq)

    def seq_len(self, seq: int) -> int:
        with self._lock:
            return self._table.seq_len(seq)

    def live_seqs(self) -> list[int]:
        with self._lock:
            return self._table.live_seqs()

    def clear(self) -> None:
        """Frees every cell, releases every id, drops the declaration; pools are kept."""
        with self._lock:
            self._table.clear()
            self._prepared = None

    @property
    def free_cells(self) -> int:
        with self._lock:
            return self._table.free_cells

    @property
    def used_end(self) -> int:
        with self._lock:
            return self._table.used_end

    @property
    def capacity(self) -> int:
        return self.config.capacity

    @property
    def max_seqs(self) -> int:
        return self.config.max_seqs

    @property
    def rows(self) -> int:
        """Rows each pool has now (0 before the first step)."""
        return self._rows

    def check_invariants(self) -> None:
        """The cell table's invariants (tests call this after every operation)."""
        with self._lock:
            self._table.check_invariants()

    # -- steps (SPEC §5) -------------------------------------------------------------------------
    def declare_step(self, seq_ids) -> bool:
        """Declares the next forward's tokens; False (nothing declared) when cells are short."""
        with self._lock:
            return self._table.declare_step(seq_ids)

    def prepare_step(self, width: int | None = None, stream: object = None) -> Step:
        """Grows the pools if needed, places the declared step and writes the step buffers.

        Checks, in order: ``width`` outside ``[1, max_write]`` (InvalidArgument); nothing
        declared or ``width`` != the declared count (InvalidState); growth (OutOfMemory,
        nothing changed); placement; buffer writes. A failure after placement rolls the
        placement back, so the same step can be retried. A step prepared and not committed
        is committed first.
        """
        with self._lock:
            mw = self.config.max_write
            if width is not None:
                width = check_int(width, "width", -(1 << 62), 1 << 62)
                if not 1 <= width <= mw:
                    raise InvalidArgument(f"step width {width} is outside [1, max_write={mw}]")
            declared = self._table.declared_width
            if declared == 0:
                raise InvalidState("no step is declared; call declare_step() first")
            if width is None:
                width = declared
            elif width != declared:
                raise InvalidState(
                    f"step width {width} differs from the declared step's {declared} tokens")
            handle = self._resolve_stream(stream)
            if self._prepared is not None:
                self._commit_locked()
            self._before_step(handle)
            grew = self._grow(min(self.config.capacity, self._table.used_end + width), handle)
            read_len = self._table.place_into(self._cells, self._positions, self._seq_ids)
            try:
                self._write_step(width, read_len, handle)
            except BaseException:
                self._table.undo_place()
                raise
            step = Step(width, int(read_len), self._cells[:width].copy(),
                        self._positions[:width].copy(), self._seq_ids[:width].copy(), grew)
            self._prepared = step
            self._prepared_stream = handle
            self._steps += 1
            return step

    def commit_step(self) -> None:
        """Marks the prepared step's forward as queued: later growth and frees wait for it."""
        with self._lock:
            if self._prepared is None:
                raise InvalidState("no step is prepared; call prepare_step() first")
            self._commit_locked()

    def _commit_locked(self) -> None:
        self._commit(self._prepared_stream)
        self._prepared = None

    def _grow(self, needed: int, stream: int) -> bool:
        """Gives the pools ``needed`` rows (SPEC §4), all or nothing; True if they moved."""
        if needed <= self._rows:
            return False
        cfg = self.config
        if self._rows == 0:
            rows = max(cfg.initial_capacity, needed)
        else:
            rows = min(cfg.capacity, max(needed, 2 * self._rows))
        names = self._pool_names()
        new: dict[str, Any] = {}
        try:
            for name in names:
                layer = int(name.split("_")[1])
                new[name] = self._allocator.allocate(rows * self._row_bytes[layer], name)
            live = self._table.used_end
            if self._rows:
                for name in names:
                    layer = int(name.split("_")[1])
                    self._copy_rows(self._allocations[name], new[name],
                                    live * self._row_bytes[layer], stream)
        except BaseException as e:
            for allocation in new.values():
                self._allocator.release(allocation)
            if isinstance(e, MemoryError):
                raise OutOfMemory(
                    f"growing the pools from {self._rows} to {rows} rows failed ({e}); "
                    "nothing changed, the declared step can be retried") from e
            raise
        old = self._allocations
        self._allocations = new
        if self._rows:
            self._growth_count += 1
        self._rows = rows
        for allocation in old.values():
            self._retire(allocation, stream)
        self._pools_changed()
        return True

    # -- metrics ------------------------------------------------------------------------------
    def _step_buffer_bytes(self) -> int:
        cfg = self.config
        return 8 * (2 * cfg.max_write + 1) + len(cfg.windows) * cfg.max_write * cfg.capacity

    def metrics(self) -> dict:
        """Counters: logical_length (= used_end), flat_capacity (pool rows), growth_count,
        allocated_bytes (K/V pools), step_buffer_bytes, free_cells, live_seqs, and more."""
        with self._lock:
            t = self._table
            return {
                "backend": self.backend,
                "logical_length": t.used_end,
                "flat_capacity": self._rows,
                "growth_count": self._growth_count,
                "allocated_bytes": 2 * self._rows * sum(self._row_bytes),
                "step_buffer_bytes": self._step_buffer_bytes(),
                "free_cells": t.free_cells,
                "used_cells": t.used_count,
                "live_seqs": len(t.live_seqs()),
                "capacity": self.config.capacity,
                "max_seqs": self.config.max_seqs,
                "windows": list(self.config.windows),
                "steps": self._steps,
            }
