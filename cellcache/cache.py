"""The backend-neutral cache: cell table + K/V pools + step buffers + one re-entrant lock.

A backend (host, cuda) supplies the storage: the pools (a :class:`cellcache.pools.Pools`),
the step buffers, how the step buffers are written and what a commit does. Everything about
order, growth, padding and rollback is decided here, once::

    declare_step(ids)          table: ids checked, step declared (paged: its kv lists fit)
    prepare_step(...)
      1. resolve caller input  width, pad_to, stream: caller code runs here and only here
      2. check the declaration nothing declared / width differs -> InvalidState
      3. plan growth           pools.plan(rows): every allocation a growth needs, or
                               OutOfMemory with nothing changed (no commit either)
      4. commit the last step  a prepared, uncommitted step is committed now
      5. apply growth          copy or map live rows (ordered after committed forwards)
      6. place                 table: cells claimed, positions continue each sequence
      7. write buffers         backend: cells, positions, read_len, width, masks, paged view;
                               a failure undoes the placement
    forward                    the runner reads the buffers, writes K/V at cells
    commit_step()              later growth and frees wait for that forward
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import numpy as np

from ._checks import check_int
from ._table import CellTable
from .buffers import BufferSpec, buffer_names, pool_spec, step_buffer_bytes
from .config import CacheConfig
from .errors import InvalidArgument, InvalidState, OutOfMemory, StepTooLarge
from .pools import PoolKey, Pools

__all__ = ["CellCache", "LayerBuffers", "Step", "stream_handle"]

_Cache = TypeVar("_Cache", bound="CellCache")


@dataclass(frozen=True)
class Step:
    """What ``prepare_step`` placed: host copies of the step's buffers.

    ``width`` real tokens; the forward runs at ``pad_to`` rows (``padded`` of them padding,
    whose K/V go to the sink row and whose outputs are to be discarded). ``grew`` is True
    when the pools' addresses changed (the first step, or a growth by copy): graphs that
    read the pools must be recaptured. ``rows`` is the pools' row count after the step.
    With the paged view, ``qo_indptr`` and ``kv_indptr`` are host copies of entries
    ``[0, n_requests]``: ``n_runs`` real runs, then one request per padding row.
    """

    width: int
    read_len: int
    cells: np.ndarray
    positions: np.ndarray
    seq_ids: np.ndarray
    grew: bool
    pad_to: int
    rows: int
    n_runs: int = 0
    qo_indptr: np.ndarray | None = None
    kv_indptr: np.ndarray | None = None

    @property
    def padded(self) -> int:
        """Padding rows: ``pad_to - width``."""
        return self.pad_to - self.width

    @property
    def n_requests(self) -> int:
        """Requests of the paged view: real runs plus one per padding row."""
        return self.n_runs + self.padded


class LayerBuffers(NamedTuple):
    """One layer's buffers: its K and V pools, its window and its mask (None without
    masks)."""

    k: Any
    v: Any
    window: int
    mask: Any


def stream_handle(stream: object) -> int:
    """The raw handle of a stream given as None (0), an int, or an object with
    ``cuda_stream`` (torch), ``handle`` or ``ptr`` (cupy, cuda.core)."""
    if stream is None:
        return 0
    if type(stream) is int and 0 <= stream < 1 << 64:
        return stream
    value: Any = stream
    for attr in ("cuda_stream", "handle", "ptr"):
        if hasattr(stream, attr):
            value = getattr(stream, attr)
            break
    handle = None
    # (numpy's floats and bools are no ints either, though int() takes them)
    if not isinstance(value, (bool, np.bool_, float, np.floating, complex, np.complexfloating, str, bytes)):
        try:
            handle = operator.index(value)
        except TypeError:
            try:  # cuda.bindings' CUstream and friends convert through int()
                handle = int(value)
            except (TypeError, ValueError, OverflowError):
                handle = None
    if handle is None:
        raise InvalidArgument(
            f"stream of type {type(stream).__name__} is not a stream: give None, an int handle, "
            "or an object with .cuda_stream (torch), .handle or .ptr (cupy, cuda.core)")
    if not 0 <= handle < 1 << 64:
        raise InvalidArgument(f"stream handle {handle} is outside [0, 2**64)")
    return handle


class CellCache:
    """The cache over some storage backend. Use a backend class
    (:class:`cellcache.HostCellCache`, ``cellcache.cuda.CudaCellCache``) or
    :func:`cellcache.build`.

    Every public method takes the cache's re-entrant lock, so any mix of calls from any
    threads is safe; one thread should drive the steps (declare, prepare, forward, commit).

    The cache owns what hangs off it: its pools, step buffers and backend resources, and
    whatever consumers tie to it with :meth:`on_close`. :meth:`close` (or leaving a
    ``with cache:`` block) releases all of it once, in reverse order of acquisition; after
    that every method and property but the configuration (``config``, ``capacity``,
    ``max_seqs``, ``backend``, ``buffer_names``), ``closed`` and ``lock`` raises
    InvalidState.
    """

    backend = "abstract"

    def __init__(self, config: CacheConfig):
        if not isinstance(config, CacheConfig):
            raise InvalidArgument(f"config of type {type(config).__name__} is not a CacheConfig")
        self.config = config
        self._lock = threading.RLock()
        self._closed = True                     # until built
        # everything the cache acquires, released in reverse order at close (or when the
        # build fails): backend resources, the pools, parts built later, consumers' on_close
        self._undo = contextlib.ExitStack()
        self._buffers: dict[str, Any] = {}      # by name; the backend fills it (pools too)
        self._row_bytes = {(i, kv): pool_spec(config, i, kv, 0).row_bytes
                           for i in range(len(config.layers)) for kv in "kv"}
        self._growth_count = 0
        mw = config.max_write
        self._cells = np.zeros(mw, np.int64)       # placement output (host)
        self._positions = np.zeros(mw, np.int64)
        self._seq_ids = np.zeros(mw, np.int64)
        self._prepared: Step | None = None
        self._pools_generation = 0
        self._clears = 0
        self._asleep = False
        self._prepared_stream = 0
        self._steps = 0
        try:
            self._open()
            self._table = CellTable(config.capacity, config.max_seqs, config.max_write,
                                    track_changes=self._tracks_changes())
            self._pools: Pools = self._make_pools()
            self._undo.callback(self._pools.close)
            self._init_step_buffers()
        except BaseException:
            with contextlib.suppress(Exception):
                self._undo.close()
            raise
        self._closed = False

    # -- backend hooks ---------------------------------------------------------------------
    def _open(self) -> None:
        """Acquires what the rest of the build needs (CUDA: the device context), registering
        its release on ``self._undo``."""

    def _tracks_changes(self) -> bool:
        return False

    def _make_pools(self) -> Pools:
        """The pools (no rows yet); the cache closes them at close."""
        raise NotImplementedError

    def _init_step_buffers(self) -> None:
        """Allocates the step buffers of :func:`cellcache.buffers.step_buffers` into
        ``self._buffers`` (releases registered on ``self._undo``), then the pool views."""
        raise NotImplementedError

    def _before_close(self) -> None:
        """Waits for the cache's own queued work before anything is released."""

    def _resolve_stream(self, stream: object) -> int:
        """The stream's handle; refuses a bad or unusable stream without side effects."""
        return stream_handle(stream)

    def _before_step(self, stream: int) -> None:
        """Orders the step after earlier committed work (called once the step will run)."""

    def _before_sleep(self) -> None:
        """Waits until no queued work can touch the pools (CUDA: the whole context)."""

    def _pools_changed(self) -> None:
        """Called after the pools' rows or addresses changed (the backend rebuilds views)."""

    def _write_step(self, width: int, pad_to: int, read_len: int, stream: int) -> tuple:
        """Writes the step buffers; returns (n_runs, qo_indptr, kv_indptr) for the Step."""
        raise NotImplementedError

    def _commit(self, stream: int) -> None:
        pass

    def _pool_view(self, key: PoolKey, sink: int | None) -> BufferSpec:
        """A pool's view: rows ``[0, sink]`` (the sink last), or no rows while the pool has
        no storage (``sink`` None)."""
        spec = pool_spec(self.config, key[0], key[1], 0 if sink is None else sink)
        return spec if sink is not None else dataclasses.replace(spec, shape=(0,) + spec.shape[1:])

    # -- lifetime ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidState(f"this {type(self).__name__} is closed")

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (then every method raises InvalidState)."""
        return self._closed

    def close(self) -> None:
        """Releases everything the cache owns, once: first what was tied to it later
        (:meth:`on_close` callbacks, parts built on demand; newest first), then the step
        buffers, the pools and the backend's resources. CUDA waits for the cache's own
        recorded work first (never a caller's stream). Idempotent; afterwards every method
        raises InvalidState. Host arrays a caller still holds stay valid until dropped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._prepared = None
            self._before_close()
            self._buffers = {}
            self._undo.close()

    def on_close(self, callback: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        """Calls ``callback(*args, **kwargs)`` when the cache closes, before the cache
        releases its own storage (callbacks run newest first): how a consumer ties what it
        made for this cache (device scratch, graphs, kernels) to the cache's lifetime. On
        CUDA the cache's context is current and its own work has finished by then.
        InvalidState once closed."""
        if not callable(callback):
            raise InvalidArgument(f"callback of type {type(callback).__name__} is not callable")
        with self._lock:
            self._check_open()
            self._undo.callback(callback, *args, **kwargs)

    # -- sleep -------------------------------------------------------------------------------
    @property
    def asleep(self) -> bool:
        """Whether the pools' memory is given back (:meth:`sleep`) and not yet taken again."""
        self._check_open()
        return self._asleep

    def sleep(self) -> None:
        """Gives the K/V pools' memory back and keeps everything else: the table, the step
        buffers, the sequence ids and, where the pools are mapped (CUDA with virtual memory
        management, the host's ``growth="map"``), the pools' addresses, so views and captured
        graphs stay valid for :meth:`wake`. Copy-growth pools are released and have no rows
        until the next step allocates them, elsewhere, as a first step does
        (``pools_generation`` changes at both and that ``Step.grew`` is True: views are
        rebuilt, graphs recaptured).

        Nothing may be in the pools: InvalidState while any cell is owned (free the
        sequences, or :meth:`clear`) or a step is declared or prepared; nothing changes
        then. On CUDA it first waits for every queued work of the device context (a forward
        still writing K/V). While asleep, :meth:`declare_step` and :meth:`prepare_step` raise
        InvalidState; the rest of the table's verbs work (a sequence made then has no cells).
        Idempotent.
        """
        with self._lock:
            self._check_open()
            if self._asleep:
                return
            t = self._table
            if t.used_count or t.declared_width or self._prepared is not None:
                what = (f"{t.used_count} cells are owned" if t.used_count
                        else "a step is declared or prepared")
                raise InvalidState(f"cannot sleep: {what}, and sleeping discards the K/V; free the "
                                   "sequences (or clear()) and finish the step first")
            self._before_sleep()
            try:
                self._pools.sleep()
            finally:
                # (even when it failed part way: what was given back is mapped again by wake(),
                # and no step may run on pools that are partly gone)
                self._asleep = True
                if self._pools.moves:
                    self._pools_generation += 1
                self._pools_changed()

    def wake(self) -> None:
        """Takes memory for the pools again after :meth:`sleep`: mapped pools get fresh
        memory at the addresses they had (graphs captured before :meth:`sleep` replay as
        they are); copy pools get theirs at the next step. The K/V content is not kept
        (nothing was in the pools). OutOfMemory (CudaError for another driver
        failure) leaves the cache asleep with nothing taken; the call can be retried.
        Idempotent."""
        with self._lock:
            self._check_open()
            if not self._asleep:
                return
            try:
                self._pools.wake()
            except MemoryError as e:
                if isinstance(e, OutOfMemory):
                    raise OutOfMemory(f"{e}; the cache is still asleep, wake() can be retried") from e
                raise OutOfMemory(f"waking the pools ran out of memory ({e!r}); the cache is "
                                  "still asleep, wake() can be retried") from e
            self._asleep = False

    def _check_awake(self) -> None:
        if self._asleep:
            raise InvalidState("the cache is asleep (its pools have no memory); call wake() first")

    def __enter__(self: _Cache) -> _Cache:
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def lock(self) -> threading.RLock:
        """The re-entrant lock every method takes: hold it (``with cache.lock:``) to make a
        sequence of calls atomic against other threads (e.g. declare, prepare, commit)."""
        return self._lock

    @property
    def table(self) -> CellTable:
        """The cell table, for queries (``snapshot()``, ``seq_cell_at``, ``positions_array``,
        ``declared``, ...) by tests and tools.

        Verbs go through the cache: the table's own verbs (``declare_step``, ``place``,
        ``seq_rm``, ...) bypass the cache's lock, its growth, its step buffers and, on CUDA,
        its device mirror's ordering. The property cannot be set.
        """
        with self._lock:
            self._check_open()
            return self._table

    # -- names -------------------------------------------------------------------------------
    @property
    def buffer_names(self) -> list[str]:
        """Every buffer a forward may read or write, by name (see
        :func:`cellcache.buffers.buffer_names`)."""
        return buffer_names(self.config)

    def buffer(self, name: str) -> Any:
        """The named buffer (see ``buffer_names``): the backend's own object (a numpy array
        on the host, a ``DeviceBuffer`` on CUDA), live, not a copy."""
        with self._lock:
            self._check_open()
            try:
                return self._buffers[name]
            except (KeyError, TypeError):
                raise self._unknown_buffer(name) from None

    def _unknown_buffer(self, name: object) -> InvalidArgument:
        shown = repr(name) if isinstance(name, str) else f"of type {type(name).__name__}"
        return InvalidArgument(
            f"no buffer named {shown}; buffers are: {', '.join(self.buffer_names)}")

    def layer(self, index: int) -> LayerBuffers:
        """Layer ``index``'s K pool, V pool, window and mask buffer (None without masks),
        so a forward needs no buffer names."""
        with self._lock:
            self._check_open()
            i = check_int(index, "layer", 0, len(self.config.layers) - 1)
            window = self.config.layers[i].window
            mask = None if self.config.mask_format == "none" else self.buffer(f"mask_w{window}")
            return LayerBuffers(self.buffer(f"layer_{i}_k"), self.buffer(f"layer_{i}_v"),
                                window, mask)

    # -- verbs -------------------------------------------------------------------------------
    def seq_new(self) -> int | None:
        """Returns the lowest id that is not live, now live; None when every id is live."""
        with self._lock:
            self._check_open()
            return self._table.seq_new()

    def seq_clone(self, src: int, upto: int | None = None) -> int | None:
        """Returns a new id co-owning src's cells with ``pos < upto`` (all if None), or None
        (src not live, src owns no cell, or no free id). Nothing is copied."""
        with self._lock:
            self._check_open()
            return self._table.seq_clone(src, upto)

    def seq_rm(self, seq: int) -> bool:
        """Drops seq everywhere, frees cells left unowned and releases its id; False if not
        live."""
        with self._lock:
            self._check_open()
            return self._table.seq_rm(seq)

    def rewind(self, seq: int, position: int) -> bool:
        """Drops seq's claim on positions >= position (the id stays live); False if seq is
        not live or position is outside ``[0, pos(seq)]``."""
        with self._lock:
            self._check_open()
            return self._table.rewind(seq, position)

    def pos(self, seq: int) -> int:
        """One past the newest position seq owns; 0 if empty or not live."""
        with self._lock:
            self._check_open()
            return self._table.pos(seq)

    def seq_len(self, seq: int) -> int:
        """Cells seq owns (0 if not live)."""
        with self._lock:
            self._check_open()
            return self._table.seq_len(seq)

    def live_seqs(self) -> list[int]:
        """The live ids, ascending."""
        with self._lock:
            self._check_open()
            return self._table.live_seqs()

    def clear(self) -> None:
        """Frees every cell, releases every id, drops the declaration; pools are kept.

        A prepared step is committed first, so its forward stays ordered before later
        growth and frees.
        """
        with self._lock:
            self._check_open()
            if self._prepared is not None:
                self._commit_locked()
            self._table.clear()
            self._clears += 1

    @property
    def free_cells(self) -> int:
        """Cells no sequence owns."""
        with self._lock:
            self._check_open()
            return self._table.free_cells

    @property
    def used_end(self) -> int:
        """One past the highest occupied cell (the next step's read_len before placement)."""
        with self._lock:
            self._check_open()
            return self._table.used_end

    @property
    def capacity(self) -> int:
        return self.config.capacity

    @property
    def max_seqs(self) -> int:
        return self.config.max_seqs

    @property
    def rows(self) -> int:
        """Cell rows each pool has now (0 before the first step)."""
        self._check_open()
        return self._pools.rows

    @property
    def sink(self) -> int:
        """The pool row padding rows write to (the last row of every pool's view)."""
        self._check_open()
        return self._pools.sink

    @property
    def prepared_step(self) -> Step | None:
        """The step prepared and not yet committed (None when there is none): the only step
        whose forward may write K/V at its ``cells``."""
        self._check_open()
        return self._prepared

    @property
    def clears(self) -> int:
        """Counts the calls of :meth:`clear`: a holder of sequence ids (a prefix cache) that
        reads another count knows its ids were released, and maybe given out again."""
        self._check_open()
        return self._clears

    @property
    def pools_generation(self) -> int:
        """Counts the times the pools' addresses changed (the first step; every copy
        growth): views over the pools built at another generation are out of date."""
        self._check_open()
        return self._pools_generation

    def check_invariants(self) -> None:
        """The cell table's invariants (tests call this after every operation)."""
        with self._lock:
            self._check_open()
            self._table.check_invariants()

    def __copy__(self):
        raise InvalidState("a cache owns its storage and cannot be copied; build another")

    def __deepcopy__(self, memo):
        raise InvalidState("a cache owns its storage and cannot be copied; build another")

    def __reduce_ex__(self, protocol):
        raise InvalidState("a cache owns its storage and cannot be pickled; build another")

    # -- steps -------------------------------------------------------------------------------
    def declare_step(self, seq_ids) -> bool:
        """Declares the next forward's tokens, one sequence id per token in the forward's
        order. Returns False (nothing declared) when fewer cells are free than tokens.

        Raises InvalidArgument (not a sequence of ids, empty, wider than max_write, bad id),
        InvalidState (an id not live), or with the paged view :class:`StepTooLarge` when the
        step's kv lists would exceed ``max_kv`` (nothing declared).
        """
        with self._lock:
            self._check_open()
            self._check_awake()
            ok = self._table.declare_step(seq_ids)
            if ok and self.config.paged:
                need = self._table.step_kv_entries()
                if need > self.config.max_kv:
                    self._table.undeclare()
                    raise StepTooLarge(
                        f"the step's kv lists need {need} entries; the paged view holds "
                        f"max_kv={self.config.max_kv}: split the step or build the cache "
                        "with a larger max_kv")
            return ok

    def prepare_step(self, width: int | None = None, stream: object = None, *,
                     pad_to: int | None = None,
                     agree: Callable[[BaseException | None], None] | None = None) -> Step:
        """Grows the pools if needed, places the declared step and writes the step buffers.

        ``width`` (default: the declared count) must equal the declared count. ``pad_to``
        (default ``width``) is the width the forward runs at, ``width <= pad_to <=
        max_write``: rows ``[width, pad_to)`` write K/V to the sink row, see row 0's mask and
        position, and their outputs are to be discarded. ``stream``: None (the backend's
        default), an int handle, or an object with ``cuda_stream``, ``handle`` or ``ptr``.

        Checks, in order: a closed or sleeping cache (InvalidState); ``width`` outside ``[1, max_write]``
        or ``pad_to`` outside ``[width, max_write]`` or a bad stream (InvalidArgument);
        nothing declared or ``width`` != the declared count (InvalidState); growth
        (OutOfMemory). Every refusal changes nothing; a failure after placement undoes it,
        so the same call can be retried. A prepared step not yet committed is committed once
        growth has succeeded.

        ``agree`` (how :mod:`cellcache.tp` makes several ranks take one decision) is called
        once, when every check has passed and growth is planned but nothing has changed yet:
        ``agree(None)``, or ``agree(error)`` when a check or the growth plan raised. It returns
        to go on (``error`` is then raised) or raises to refuse: the growth plan is given back,
        nothing has changed, and its exception propagates. It must not call the cache.
        """
        with self._lock:
            self._check_open()
            try:
                self._check_awake()
                width, pad_to, handle, planned = self._plan_step(width, pad_to, stream)
            except BaseException as e:
                if agree is not None:
                    agree(e)
                raise
            if agree is not None:
                try:
                    agree(None)
                except BaseException:
                    if planned is not None:
                        self._pools.cancel(planned)
                    raise
            # 4-5. the implicit commit, then growth (only once nothing can run short)
            grew = self._apply_growth(planned, handle)
            # 6-7. placement and buffers
            read_len = self._table.place_into(self._cells, self._positions, self._seq_ids)
            try:
                n_runs, qo, kv = self._write_step(width, pad_to, read_len, handle)
                step = Step(width, int(read_len), self._cells[:width].copy(),
                            self._positions[:width].copy(), self._seq_ids[:width].copy(), grew,
                            pad_to, self._pools.rows, n_runs, qo, kv)
            except BaseException as e:
                self._table.undo_place()
                if isinstance(e, MemoryError) and not isinstance(e, OutOfMemory):
                    raise OutOfMemory(
                        f"writing the step ran out of memory ({e!r}); the placement was undone, "
                        "the declared step can be retried") from e
                raise
            self._prepared = step
            self._prepared_stream = handle
            self._steps += 1
            return step

    def _plan_step(self, width: int | None, pad_to: int | None,
                   stream: object) -> tuple[int, int, int, Any]:
        """Phases 1-3 of prepare_step, changing nothing: (width, pad_to, stream handle, the
        pools' growth plan or None when they have the rows)."""
        mw = self.config.max_write
        # 1. caller input, all of it, before anything is read or changed
        if width is not None:
            width = check_int(width, "width", -(1 << 62), 1 << 62)
            if not 1 <= width <= mw:
                raise InvalidArgument(f"step width {width} is outside [1, max_write={mw}]")
        if pad_to is not None:
            pad_to = check_int(pad_to, "pad_to", -(1 << 62), 1 << 62)
            if not 1 <= pad_to <= mw:
                raise InvalidArgument(f"pad_to={pad_to} is outside [width, max_write={mw}]")
        handle = self._resolve_stream(stream)
        # 2. the declaration
        declared = self._table.declared_width
        if declared == 0:
            raise InvalidState("no step is declared; call declare_step() first")
        if width is None:
            width = declared
        elif width != declared:
            raise InvalidState(
                f"step width {width} differs from the declared step's {declared} tokens")
        if pad_to is None:
            pad_to = width
        elif pad_to < width:
            raise InvalidArgument(f"pad_to={pad_to} is outside [width={width}, max_write={mw}]")
        # 3. the growth plan: everything it allocates, or OutOfMemory with nothing changed
        planned = self._plan_growth(min(self.config.capacity, self._table.used_end + width))
        return width, pad_to, handle, planned

    def commit_step(self) -> None:
        """Marks the prepared step's forward as queued: later growth and frees wait for it."""
        with self._lock:
            self._check_open()
            if self._prepared is None:
                raise InvalidState("no step is prepared; call prepare_step() first")
            self._commit_locked()

    def _commit_locked(self) -> None:
        self._commit(self._prepared_stream)
        self._prepared = None

    def unprepare_step(self) -> None:
        """Takes back the prepared step before its forward runs: its cells are free again,
        its sequences' positions are as before and the step is declared again, as a failed
        ``prepare_step`` leaves it; the pools keep any growth. (:mod:`cellcache.tp` uses it
        when another rank failed to prepare the same step.)

        InvalidState when no step is prepared, or a verb or declaration has run since it was
        (it can no longer be taken back); nothing changes then.
        """
        with self._lock:
            self._check_open()
            if self._prepared is None:
                raise InvalidState("no step is prepared; nothing to take back")
            self._table.undo_place()
            self._prepared = None
            self._steps -= 1

    def undeclare(self) -> None:
        """Drops the declared step, if any: what a refused ``declare_step`` leaves."""
        with self._lock:
            self._check_open()
            self._table.undeclare()

    def _plan_growth(self, needed: int) -> Any:
        """The pools' plan for ``needed`` rows (everything the growth allocates), or None when
        they have them; OutOfMemory (InvalidArgument for storage the backend refuses) with
        nothing changed.

        The first step allocates ``max(initial_capacity, needed)`` rows; later, when
        ``needed > rows``, rows become ``min(capacity, max(needed, 2 * rows))``.
        """
        pools = self._pools
        if needed <= pools.rows:
            return None
        cfg = self.config
        if pools.rows == 0:
            rows = max(cfg.initial_capacity, needed)
        else:
            rows = min(cfg.capacity, max(needed, 2 * pools.rows))
        try:
            return pools.plan(rows)
        except MemoryError as e:
            raise OutOfMemory(
                f"growing the pools from {pools.rows} to {rows} rows failed ({e}); nothing "
                "changed, the declared step can be retried") from e
        except InvalidArgument as e:     # the allocator returned storage the backend refuses
            raise InvalidArgument(
                f"growing the pools from {pools.rows} to {rows} rows failed: {e}; nothing "
                "changed") from e

    def _apply_growth(self, plan: Any, stream: int) -> bool:
        """Commits an uncommitted step, orders this one after it and applies ``plan`` (from
        :meth:`_plan_growth`; None: no growth); True if the pools' addresses changed."""
        pools = self._pools
        if plan is None:
            if self._prepared is not None:
                self._commit_locked()
            self._before_step(stream)
            return False
        first = pools.rows == 0
        old_rows = pools.rows
        moved = False
        try:
            if self._prepared is not None:
                self._commit_locked()
            self._before_step(stream)
            moved = pools.apply(plan, self._table.used_end, stream)
        except BaseException:
            pools.cancel(plan)       # gives back what the plan holds; nothing once applied
            raise
        finally:
            if pools.rows != old_rows:   # switched (even if interrupted after): new views
                if not first:
                    self._growth_count += 1
                if first or pools.moves:
                    self._pools_generation += 1
                self._pools_changed()
        return first or moved

    # -- metrics ------------------------------------------------------------------------------
    def metrics(self) -> dict:
        """Counters: logical_length (= used_end), flat_capacity (pool rows), growth_count,
        allocated_bytes (K/V pool rows in use), step_buffer_bytes, free_cells, live_seqs,
        and more."""
        with self._lock:
            self._check_open()
            t = self._table
            rows = self._pools.rows
            return {
                "backend": self.backend,
                "logical_length": t.used_end,
                "flat_capacity": rows,
                "growth_count": self._growth_count,
                "allocated_bytes": 0 if self._asleep else rows * sum(self._row_bytes.values()),
                "step_buffer_bytes": step_buffer_bytes(self.config),
                "free_cells": t.free_cells,
                "used_cells": t.used_count,
                "live_seqs": len(t.live_seqs()),
                "capacity": self.config.capacity,
                "max_seqs": self.config.max_seqs,
                "windows": list(self.config.windows),
                "pools_move": self._pools.moves,
                "asleep": self._asleep,
                "steps": self._steps,
            }
