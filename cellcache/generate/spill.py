"""Preempted sequences' K/V kept in host memory instead of recomputed (the host tier).

::

    preempt v     every pool's rows of v's cells gathered on the device (position order;
                  on CUDA one launch of the row mover of cuda/fused.cu for all pools)
                  into one staging buffer -> one copy into pinned host memory -> v's
                  cells freed; v waits with its Spill
    admit v       the prefix cache's hit cloned as usual -> the positions past the hit
                  declared, prepared and committed (max_write a step), their cells noted
                  -> one copy back to the device (each pool's slice where the hit leaves
                  less than half of the spill) -> the rows scattered into the noted cells
                  (one launch for all pools on CUDA); v then feeds only its last token (or
                  the rest of its prompt)

A spill is taken only within ``budget`` bytes (the Generator's ``spill_bytes``); past it,
or when a restore finds no room, the sequence is read again as before. Every copy is
queued on the runner's stream, in order with the forwards: the gather runs after the
forwards that wrote the rows, a forward that writes the freed cells again runs after the
gather, a restore's copy up runs after the copy down; nothing waits on the host (the index
arrays go up from pinned memory, the arena's ranges are reused only by copies on the same
stream).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..cache import CellCache
from ..errors import OutOfMemory
from ..seqstate import cells_by_position, place_positions
from ..torch import TorchView

__all__ = ["PrefixTier", "Spill", "Spiller"]


class PinnedArena:
    """Pinned host memory for spills, kept once allocated: slabs of ``slab`` bytes (a larger
    request gets a slab of its own size), each a first-fit list of free ranges. Pinning is
    the slow part of a host copy (page-locking runs at a few GB/s): it happens once per
    slab, not once per spill. At most ``limit`` bytes of slabs."""

    ALIGN = 512

    def __init__(self, limit: int, slab: int = 1 << 30, pin: bool = True):
        self.limit, self.slab, self.pin = limit, slab, pin
        self.slabs: list[torch.Tensor] = []
        self.free: list[list[tuple[int, int]]] = []      # per slab: (offset, size), sorted

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.slabs)

    def alloc(self, n: int) -> tuple[int, int] | None:
        """(slab, offset) of ``n`` free bytes, or None when the limit is reached."""
        n = -(-n // self.ALIGN) * self.ALIGN
        for i, ranges in enumerate(self.free):
            for j, (off, size) in enumerate(ranges):
                if size >= n:
                    ranges[j:j + 1] = [(off + n, size - n)] if size > n else []
                    return i, off
        size = max(n, min(self.slab, self.limit))
        if self.nbytes + size > self.limit and self.slabs:
            return None
        self.slabs.append(torch.empty(size, dtype=torch.uint8, pin_memory=self.pin))
        self.free.append([(n, size - n)] if size > n else [])
        return len(self.slabs) - 1, 0

    def release(self, slab: int, off: int, n: int) -> None:
        n = -(-n // self.ALIGN) * self.ALIGN
        ranges = self.free[slab]
        ranges.append((off, n))
        ranges.sort()
        merged: list[tuple[int, int]] = []
        for o, z in ranges:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + z)
            else:
                merged.append((o, z))
        self.free[slab] = merged


@dataclass
class Spill:
    """One sequence's K/V in host memory: ``positions`` (int64, increasing; a window may
    have let some go) of ``length`` tokens, and every pool's rows at them in one host
    buffer (``host``, uint8: the pools one after another, each ``[n, heads, dim]``). A
    restore places positions up to :attr:`end`: ``stop`` when set (a kept prefix longer than
    the prompt that found it: its first ``stop`` positions), else ``length``."""

    positions: np.ndarray
    length: int
    host: torch.Tensor | None
    nbytes: int
    where: tuple[int, int] | None = None       # (slab, offset) in the arena (CUDA)
    stop: int | None = None

    @property
    def end(self) -> int:
        """The positions a restore places end here."""
        return self.length if self.stop is None else self.stop


class Spiller:
    """Takes and gives back :class:`Spill` copies for one cache within ``budget`` bytes of
    host memory (pinned on CUDA), queued on ``stream`` (CUDA; default: the current one).
    ``stats``: ``spilled`` (sequences), ``spilled_tokens``, ``restored_tokens``, ``spill_s``
    and ``restore_s`` (copy time, seconds: on CUDA the device's, counted as the copies
    finish; :meth:`settle` waits for them), ``spill_host_s`` and ``restore_host_s`` (the
    host's time in :meth:`take` and :meth:`give`, placing the positions included),
    ``spill_bytes_moved`` and ``restored_bytes``; ``held`` bytes held now.

    A copy goes through one device staging buffer as large as the spill: each pool's rows
    gathered into their part of it, then one device-to-host copy (and back: one
    host-to-device copy, then each pool's part scattered into the cells), so the bytes cross
    the bus in one transfer whatever the number of layers. On CUDA the gather and each
    scatter are one launch for every pool (:meth:`FusedKernels.move_rows`), where a
    pool-by-pool ``index_select``/``index_copy_`` would launch two kernels a layer, each
    moving a few hundred KiB. A restore places its positions first and moves the rows
    after the last step, so the copy up and the scatter run back to back on the device.
    """

    def __init__(self, cache: CellCache, view: TorchView, budget: int,
                 stream: torch.cuda.Stream | None = None):
        self.cache, self.view, self.budget = cache, view, budget
        self.held = 0
        self._lock = threading.Lock()     # held and the arena: the prefix level's hook may copy
        self.arena = PinnedArena(budget) if view.cuda else None
        #: the stream every copy is queued on (the runner's: in order with the forwards; a
        #: restore's scatter lands after its placement's commits, so a forward on another
        #: stream would not be ordered after it)
        self.stream = (stream or torch.cuda.current_stream(view.device)) if view.cuda else None
        self._timing: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._table: tuple[int, Any] | None = None    # (view generation, _mover's answer)
        if self.stream is not None:
            # the cache's close waits for its own work only: the copies queued on the stream
            # must not outlive the pools they read and write
            cache.on_close(self.stream.synchronize)
        self.stats: dict[str, float] = dict.fromkeys(
            ("spilled", "spilled_tokens", "restored_tokens", "spill_s", "restore_s",
             "spill_bytes_moved", "restored_bytes", "spill_host_s", "restore_host_s"), 0)

    def _pools(self) -> list[torch.Tensor]:
        view = self.view
        if view.stale():
            view.refresh()
        # as bytes: a copy needs no dtype (8-bit pools' rows come back to the cache whose
        # scales they were written with)
        return [p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p
                for i in range(len(self.cache.config.layers)) for p in view.layer(i)[:2]]

    def _mover(self, pools: list[torch.Tensor]) -> tuple[Any, torch.Tensor, list[int], int] | None:
        """CUDA: (the fused kernels, the pools' table on the device, each pool's row bytes,
        the widest vector the pools take) for :meth:`FusedKernels.move_rows` over ``pools``
        (this view's, just refreshed), kept until the pools move (the view's generation);
        None on the host, for a pool whose rows are not contiguous, or where the kernels do
        not load (then each pool is copied by torch)."""
        if not self.view.cuda:
            return None
        generation = self.view.generation
        kept = self._table                    # (read once: the prefix level's hook may copy too)
        if kept is not None and kept[0] == generation:
            return kept[1]
        mover: tuple[Any, torch.Tensor, list[int], int] | None = None
        rows = [p[0].numel() * p.element_size() for p in pools]
        if all(p.stride(0) * p.element_size() == b and p[0].is_contiguous() for p, b in zip(pools, rows)):
            from ..cuda.driver import CudaError
            from ..cuda.fused import fused_kernels

            device = pools[0].device
            try:
                kernels = fused_kernels(device.index if device.index is not None
                                        else torch.cuda.current_device())
            except CudaError:
                kernels = None
            if kernels is not None:
                vec = 16 if all(b % 16 == 0 and p.data_ptr() % 16 == 0 for p, b in zip(pools, rows)) else 1
                cum = np.concatenate([[0], np.cumsum(rows)[:-1]])
                table = np.stack([[p.data_ptr() for p in pools], rows, cum], axis=1).astype(np.int64)
                mover = (kernels, self._up(table, device), rows, vec)
        self._table = (generation, mover)
        return mover

    def _move(self, mover: tuple[Any, torch.Tensor, list[int], int], stage: torch.Tensor,
              stage_rows: int, pool_idx: torch.Tensor, stage_idx: torch.Tensor | None,
              to_stage: bool) -> None:
        """One launch of the row mover on the stream: ``len(pool_idx)`` rows of every pool
        into ``stage`` (a spill's layout of ``stage_rows`` rows) or out of it."""
        kernels, table, rows, vec = mover
        assert self.stream is not None
        if stage.data_ptr() % 16:
            vec = 1
        kernels.move_rows(table.data_ptr(), len(rows), rows, stage.data_ptr(), stage_rows,
                          pool_idx.data_ptr(), 0 if stage_idx is None else stage_idx.data_ptr(),
                          pool_idx.numel(), to_stage, vec, self.stream.cuda_stream)

    def _up(self, a: np.ndarray, device: torch.device) -> torch.Tensor:
        """``a`` on ``device`` without a host wait (through pinned memory, which torch's
        host allocator keeps until the copy ran)."""
        t = torch.from_numpy(np.ascontiguousarray(a))
        if not self.view.cuda:
            return t
        return t.pin_memory().to(device, non_blocking=True)

    def _timed(self, kind: str) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        if not self.view.cuda:
            return None
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with self._lock:
            self._collect(wait=False)
            self._timing.append((kind, a, b))
        return a, b

    def _collect(self, wait: bool) -> None:
        """Adds the device time of finished copies to ``spill_s``/``restore_s`` (lock held)."""
        left = []
        for kind, a, b in self._timing:
            if wait:
                b.synchronize()
            if b.query():
                try:
                    self.stats[kind] += a.elapsed_time(b) / 1e3
                except RuntimeError:          # a copy that failed before its end was recorded
                    pass
            else:
                left.append((kind, a, b))
        self._timing = left

    def settle(self) -> dict[str, float]:
        """Waits for the copies queued so far and returns :attr:`stats` (``spill_s`` and
        ``restore_s``: on CUDA device seconds from the first copy or gather to the last,
        queued back to back; host seconds on the host, placing the positions included)."""
        with self._lock:
            self._collect(wait=True)
        return self.stats

    @staticmethod
    def _parts(buf: torch.Tensor, pools: list[torch.Tensor], n: int) -> list[torch.Tensor]:
        """``buf`` (uint8) cut into one ``[n, heads, dim]`` view per pool, in pool order."""
        out, off = [], 0
        for p in pools:
            size = n * p[0].numel() * p.element_size()
            out.append(buf[off:off + size].view(p.dtype).view(n, *p.shape[1:]))
            off += size
        return out

    def bytes_for(self, length: int) -> int:
        """The host bytes a copy of ``length`` positions takes at most."""
        return length * sum(p[0].numel() * p.element_size() for p in self._pools())

    def take(self, sid: int, length: int) -> Spill | None:
        """A host copy of positions ``[0, length)`` of sequence ``sid`` (queued after the
        forwards that wrote them), or None when it does not fit the budget left."""
        import time

        cells, positions = cells_by_position(self.cache, sid, below=length)
        pools = self._pools()
        n = len(cells)
        nbytes = n * sum(p[0].numel() * p.element_size() for p in pools)
        where = None
        with self._lock:                              # the budget (and the arena) held first
            if not n or self.held + nbytes > self.budget:
                return None
            if self.arena is not None:
                where = self.arena.alloc(nbytes)
                if where is None:
                    return None
            self.held += nbytes
        t = time.perf_counter()
        cuda = self.view.cuda
        try:
            with torch.cuda.stream(self.stream) if cuda else contextlib.nullcontext():
                index = self._up(cells, pools[0].device)
                if where is not None and self.arena is not None:
                    host = self.arena.slabs[where[0]][where[1]:where[1] + nbytes]
                else:
                    host = torch.empty(nbytes, dtype=torch.uint8)
                stage = torch.empty(nbytes, dtype=torch.uint8, device=pools[0].device) if cuda else host
                mover = self._mover(pools)
                # timed: the gather and the copy down, queued back to back (what comes before
                # them is the host's, counted in spill_host_s)
                events = self._timed("spill_s")
                if events is not None:
                    events[0].record()
                if mover is not None:
                    self._move(mover, stage, n, index, None, True)
                else:
                    for p, part in zip(pools, self._parts(stage, pools, n)):
                        torch.index_select(p, 0, index, out=part)
                if cuda:
                    host.copy_(stage, non_blocking=True)
                if events is not None:
                    events[1].record()
        except (torch.OutOfMemoryError, RuntimeError):
            with self._lock:
                self.held -= nbytes
                if where is not None and self.arena is not None:
                    self.arena.release(*where, nbytes)
            return None                               # no room to stage or pin: read it again
        st = self.stats
        st["spilled"] += 1
        st["spilled_tokens"] += n
        st["spill_host_s"] += time.perf_counter() - t
        if not cuda:
            st["spill_s"] += time.perf_counter() - t
        st["spill_bytes_moved"] += nbytes
        return Spill(positions, length, host, nbytes, where)

    def drop(self, spill: Spill) -> None:
        """Gives a spill's host memory back to the budget."""
        with self._lock:
            if spill.host is not None:
                self.held -= spill.nbytes
                spill.host = None
                if spill.where is not None and self.arena is not None:
                    self.arena.release(*spill.where, spill.nbytes)

    def give(self, spill: Spill, sid: int, start: int) -> None:
        """Places positions ``[start, spill.end)`` of ``sid`` (which holds ``[0, start)``)
        with the spilled K/V: declared, prepared and committed ``max_write`` at a time, the
        copies queued on the stream. OutOfMemory (no cells, a growth failing) with ``sid``
        back at ``start`` positions; the spill is dropped either way."""
        import time

        t = time.perf_counter()
        cache = self.cache
        cuda = self.view.cuda
        try:
            with torch.cuda.stream(self.stream) if cuda else contextlib.nullcontext():
                pools = self._pools()
                device = pools[0].device
                # each position's row in the spill, counted from the first at or past start
                lo_row, hi_row = np.searchsorted(spill.positions, (start, spill.end))
                have = np.full(spill.length, -1, dtype=np.int64)
                have[spill.positions] = np.arange(len(spill.positions)) - lo_row
                assert spill.host is not None
                n = len(spill.positions)
                # the positions placed first, each step's (cell, row) pairs kept: the rows
                # go in after the last step, so the device moves the bytes back to back
                # (the copy up, then one scatter) instead of between the steps' host work
                dst: list[np.ndarray] = []
                src: list[np.ndarray] = []

                def write(lo: int, w: int, step_cells: np.ndarray) -> None:
                    rows = have[lo:lo + w]
                    some = rows >= 0
                    if some.any():
                        dst.append(step_cells[some])
                        src.append(rows[some])

                # a growth's copy is ordered before the rows go in (the same stream)
                place_positions(cache, sid, start, spill.end, write, self.stream)
                if dst:
                    cells_to = np.concatenate(dst)
                    rows_from = np.concatenate(src)
                    # (no cell gets two rows: a placement only takes cells, and windows
                    # mask positions without freeing them, so every noted cell is distinct)
                    # the rows that go up, [lo_row, hi_row): in one copy of the whole spill
                    # when they are at least half of it (on the host: no copy at all), else
                    # each pool's slice (a copy a pool) packed as a spill of their count
                    m = int(hi_row - lo_row)
                    whole = 2 * m >= n or not cuda
                    if whole:
                        rows_from = rows_from + lo_row
                    now = self._pools()                   # (a growth may have moved the pools)
                    mover = self._mover(now)
                    idx = self._up(np.stack([cells_to, rows_from]).astype(np.int64), device)
                    events = self._timed("restore_s")
                    if events is not None:
                        events[0].record()
                    if whole:
                        stage, m = spill.host.to(device, non_blocking=True), n
                    else:
                        stage = torch.empty(m * (spill.nbytes // n), dtype=torch.uint8, device=device)
                        for src_part, dst_part in zip(self._parts(spill.host, pools, n),
                                                      self._parts(stage, pools, m)):
                            dst_part.copy_(src_part[lo_row:hi_row], non_blocking=True)
                    if mover is not None:
                        self._move(mover, stage, m, idx[0], idx[1], False)
                    else:
                        for p, d in zip(now, self._parts(stage, now, m)):
                            p.index_copy_(0, idx[0], d.index_select(0, idx[1]))
                    if events is not None:
                        events[1].record()
        except BaseException as e:
            if cache.pos(sid) > start:
                cache.rewind(sid, start)
            if isinstance(e, (torch.OutOfMemoryError, RuntimeError)) and not isinstance(e, OutOfMemory):
                raise OutOfMemory(f"restoring a spilled sequence failed ({e})") from e
            raise
        finally:
            self.drop(spill)
            self.stats["restore_host_s"] += time.perf_counter() - t
        st = self.stats
        st["restored_tokens"] += spill.end - start
        placed = int(((spill.positions >= start) & (spill.positions < spill.end)).sum())
        st["restored_bytes"] += spill.nbytes * placed // max(1, len(spill.positions))
        if not cuda:
            st["restore_s"] += time.perf_counter() - t


class PrefixTier:
    """The prefix cache's second level in host memory: a prefix it evicts is copied to the
    host through ``spiller`` (its budget, shared with preempted sequences) just before its
    cells are freed (``PrefixCache.before_evict``), and an admission whose prompt starts with
    a kept prefix longer than the prefix cache's hit gets it back (``find``: the spill then
    restores like a preempted sequence's, past the hit). A prefix found leaves the tier (the
    prefix cache stores it again when its request ends). When the budget is full, the
    least recently stored prefixes go first, and only when that makes room; preempted
    sequences' copies are never dropped for them. ``stats``: ``stored`` (prefixes kept),
    ``stored_tokens``, ``found`` (admissions served), ``dropped`` (let go for room or by
    ``clear``). A lock orders the hook (which runs on whatever thread evicts) against the
    engine's finds."""

    def __init__(self, spiller: Spiller):
        self.spiller = spiller
        self.entries: dict[bytes, Spill] = {}           # insertion order: least recent first
        self.lengths: dict[int, int] = {}               # prefix length -> entries of it
        self.nbytes = 0                                 # host bytes the entries hold
        self.lock = threading.RLock()
        self.stats: dict[str, int] = dict.fromkeys(("stored", "stored_tokens", "found", "dropped"), 0)

    def __len__(self) -> int:
        return len(self.entries)

    def _forget(self, key: bytes) -> Spill:
        spill = self.entries.pop(key)
        n = self.lengths[spill.length] - 1
        if n:
            self.lengths[spill.length] = n
        else:
            del self.lengths[spill.length]
        self.nbytes -= spill.nbytes
        return spill

    def _drop_first(self) -> None:
        self.spiller.drop(self._forget(next(iter(self.entries))))
        self.stats["dropped"] += 1

    def make_room(self, nbytes: int) -> bool:
        """Drops the least recent prefixes until ``nbytes`` more fit the budget; False (nothing
        dropped) when they would not fit even with every prefix gone."""
        with self.lock:
            sp = self.spiller
            if sp.held - self.nbytes + nbytes > sp.budget:
                return False
            while self.entries and sp.held + nbytes > sp.budget:
                self._drop_first()
            return sp.held + nbytes <= sp.budget

    def store(self, seq: int, length: int, tokens: np.ndarray) -> None:
        """A copy of positions ``[0, length)`` of ``seq`` (prefix ``tokens``), if the budget
        holds it once older prefixes made room (the eviction hook)."""
        key = np.ascontiguousarray(tokens[:length], dtype=np.int32).tobytes()
        with self.lock:
            if length < 1:
                return
            if key in self.entries:                     # kept already: now the most recent
                self.entries[key] = self.entries.pop(key)
                return
            if not self.make_room(self.spiller.bytes_for(length)):
                return
            spill = self.spiller.take(seq, length)
            if spill is None:
                return
            self.entries[key] = spill
            self.lengths[length] = self.lengths.get(length, 0) + 1
            self.nbytes += spill.nbytes
            self.stats["stored"] += 1
            self.stats["stored_tokens"] += length

    def find(self, tokens: np.ndarray, hit: int, below: int | None = None) -> Spill | None:
        """The kept prefix that gives ``tokens`` the most positions past ``hit`` (shorter than
        the prompt, whose last token is fed, and than ``below``), taken out of the tier; None
        when none does. A kept prefix of ``tokens`` is found by its key; when none is, one that
        ``tokens`` run into (the same prompt again, its kept history longer) by a scan of the
        keys, most recent first, if the whole prompt can be placed: it is restored up to the
        prompt's last token (``Spill.stop``; the rest goes with it)."""
        arr = np.ascontiguousarray(tokens, dtype=np.int32)
        top = len(arr) if below is None else min(len(arr), below)
        m = top - 1                                   # the most positions a restore may place
        with self.lock:
            exact = None
            for n in sorted(self.lengths, reverse=True):
                if hit < n < top and arr[:n].tobytes() in self.entries:
                    exact = arr[:n].tobytes()
                    break
            if exact is None and m > hit and top == len(arr):
                # (the whole prompt but its last token: a history cut for want of room would
                # lose its tail for a few positions)
                want = arr[:m].tobytes()
                for key in reversed(self.entries):
                    if len(key) > len(want) and key.startswith(want):
                        self.stats["found"] += 1
                        spill = self._forget(key)
                        spill.stop = m
                        return spill
            if exact is not None:
                self.stats["found"] += 1
                return self._forget(exact)
        return None

    def find_whole(self, tokens: np.ndarray) -> bytes | None:
        """The key of the kept prefix that holds all of ``tokens``: ``tokens`` itself, else the
        most recent that runs on past them; None when none does. Nothing changes."""
        want = np.ascontiguousarray(tokens, dtype=np.int32).tobytes()
        with self.lock:
            return want if want in self.entries else next(
                (k for k in reversed(self.entries) if len(k) > len(want) and k.startswith(want)), None)

    def take_whole(self, tokens: np.ndarray) -> tuple[bytes, Spill] | None:
        """The kept prefix that holds all of ``tokens`` (:meth:`find_whole`'s, then restored
        up to their end), taken out of the tier with its key (:meth:`put_back` returns it);
        None when none does. What ``save_prefix`` brings back to the prefix cache."""
        n = len(tokens)
        with self.lock:
            key = self.find_whole(tokens)
            if key is None:
                return None
            spill = self._forget(key)
            if len(key) // 4 > n:                  # (keys: int32 tokens' bytes) longer: cut
                spill.stop = n
            return key, spill

    def put_back(self, key: bytes, spill: Spill) -> None:
        """A prefix :meth:`take_whole` took, kept again (the most recent) as it was; let go
        instead when the key is kept again meanwhile."""
        with self.lock:
            spill.stop = None
            if key in self.entries:
                self.spiller.drop(spill)
                self.stats["dropped"] += 1
                return
            self.entries[key] = spill
            self.lengths[spill.length] = self.lengths.get(spill.length, 0) + 1
            self.nbytes += spill.nbytes

    def drop_oldest(self) -> bool:
        """Lets the least recently stored prefix go (room for a preempted sequence); False
        when none is kept."""
        with self.lock:
            if not self.entries:
                return False
            self._drop_first()
            return True

    def clear(self) -> None:
        """Lets every kept prefix go (the weights changed, or the model sleeps)."""
        with self.lock:
            while self.entries:
                self._drop_first()
