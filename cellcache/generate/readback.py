"""The step's one device-to-host copy of sampled ids: pinned buffers, events, the driver copy.

::

    ids [m] int64 (device) --cuMemcpyDtoHAsync on the stream--> pinned buffer (turn 0 or 1)
                           --event recorded behind it-------->  Pending.wait(): sync + numpy copy

:class:`Readback` queues the copy without waiting; :meth:`Pending.wait` waits for it the first
time it is asked. Two pinned buffers (and their events) are used in turn, so a step's copy can
be queued while the previous step's has not been read yet (asynchronous scheduling). On the
CPU the copy is a numpy copy, done at once.

The copy and its event go through the CUDA driver (cuda-bindings, or cellcache's Cython entry
points once a CUDA cache of this process has set them) rather than torch's ``copy_`` and
``Event.record``: ``copy_`` into a pinned buffer records an event of its own, and the driver's
two calls are the fewest a step can make. Without cuda-bindings, or when the stream is another
device's than the current one, torch's calls do it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["Pending", "Readback"]


class Pending:
    """A queued copy to the host: :meth:`wait` returns the host array (waits the first time;
    the array is the caller's, not the pinned buffer a later step writes again)."""

    __slots__ = ("_host", "_event")

    def __init__(self, host: np.ndarray, event: Any = None):
        self._host, self._event = host, event

    def wait(self) -> np.ndarray:
        event = self._event
        if event is not None:
            event.synchronize()
            self._host = self._host.copy()
            self._event = None
        return self._host


class Readback:
    """Copies int64 device tensors to the host, one asynchronous copy a call (``copies``
    counts them), into one of two pinned buffers used in turn (CUDA).

    ``stream``: the torch stream the copies are queued on, behind the work that produced
    the ids; None: the device's current stream at each call.

    Example
    -------
    >>> Readback("cpu").copy(torch.tensor([3, 1])).wait().tolist()
    [3, 1]
    """

    def __init__(self, device: Any = "cpu", stream: Any = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = stream
        self.copies = 0
        # pinned landing buffers and their events (CUDA): two, used in turn
        self._host: list[torch.Tensor | None] = [None, None]
        self._host_np: list[tuple[np.ndarray, int] | None] = [None, None]  # (numpy, address)
        self._events: list[Any] = [None, None]
        self._turn = 0
        # each buffer's last (length, its first `length` entries as numpy, the buffer's
        # address): a copy of the same length as the last one skips even the numpy slice, a
        # new length slices numpy, not torch (torch calls are the costlier on the host)
        self._views: list[tuple[int, np.ndarray, int] | None] = [None, None]
        # (cuda.bindings.driver, check) for the driver path; None: not looked up yet,
        # False: cuda-bindings is not installed (torch's calls then)
        self._driver: Any = None
        self._stream_of: tuple[Any, int, int] | None = None   # (torch stream, handle, device)
        self._c_copy: Callable[[int, int, int, int, int], None] | None = None

    def __del__(self) -> None:
        # the pinned buffers go back to torch's cache with the readback: not while a driver
        # copy into them (a Pending dropped unread) may still run
        try:
            for event in getattr(self, "_events", ()):
                if isinstance(event, _DriverEvent):
                    event.synchronize()
        except Exception:  # noqa: BLE001 - at interpreter exit the driver (or this module) may be gone
            pass

    def copy(self, out: torch.Tensor) -> Pending:
        """Queues the copy of ``out`` (1-D, integer, on this readback's device) to the host."""
        self.copies += 1
        if not self.cuda:
            return Pending(out.numpy().copy())
        m = out.numel()
        self._turn ^= 1
        turn = self._turn
        view = self._views[turn]
        if view is None or view[0] != m:
            buf = self._host[turn]
            if buf is None or buf.numel() < m:
                if self._driver is None:
                    self._driver = _driver_calls()
                old = self._events[turn]
                with torch.cuda.device(self.device):   # (the event's context: the device's)
                    event = _DriverEvent(*self._driver) if self._driver else torch.cuda.Event()
                buf = torch.empty(max(m, 1024), dtype=torch.int64, pin_memory=True)
                if isinstance(old, _DriverEvent):
                    # torch's pinned-memory cache does not see a driver copy: the old buffer
                    # goes back to it only once its last copy (maybe of a dropped Pending) is done
                    old.synchronize()
                self._host[turn], self._events[turn] = buf, event
                self._host_np[turn] = (buf.numpy(), buf.data_ptr())
            whole = self._host_np[turn]
            assert whole is not None
            view = self._views[turn] = (m, whole[0][:m], whole[1])
        event = self._events[turn]
        stream = self.stream
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        if not isinstance(event, _DriverEvent):
            self._host[turn][:m].copy_(out, non_blocking=True)   # type: ignore[index]
            event.record(stream)
            return Pending(view[1], event)
        so = self._stream_of
        if so is None or so[0] is not stream:
            so = self._stream_of = (stream, int(stream.cuda_stream), stream.device_index)
        if so[2] == torch.cuda.current_device():
            # the driver's current context is the current device's: the two calls straight
            if out.dtype != torch.int64 or not out.is_contiguous():
                out = out.to(torch.int64).contiguous()
            self._copy_ids(view[2], out.data_ptr(), 8 * m, so[1], event)
        else:                                  # another device's: its context made current
            with torch.cuda.device(so[2]):
                self._host[turn][:m].copy_(out, non_blocking=True)   # type: ignore[index]
                event.record(so[1])
        return Pending(view[1], event)

    def copy_again(self, n: int, src: int) -> Pending | None:
        """:meth:`copy` of ``n`` contiguous int64 ids at device address ``src`` that a
        :meth:`copy` has taken before (the caller knows the tensor is the same): the driver's
        copy and event straight, when the buffer of this turn is sized for them and the
        readback's own stream is on the current device; None otherwise (call :meth:`copy`)."""
        turn = self._turn ^ 1
        view, event, so = self._views[turn], self._events[turn], self._stream_of
        if view is None or view[0] != n or not isinstance(event, _DriverEvent) or so is None \
                or so[0] is not self.stream or so[2] != torch.cuda.current_device():
            return None
        self._turn = turn
        self.copies += 1
        self._copy_ids(view[2], src, 8 * n, so[1], event)
        return Pending(view[1], event)

    def _copy_ids(self, dst: int, src: int, nbytes: int, stream: int, event: _DriverEvent) -> None:
        """The driver's copy of ``nbytes`` from device ``src`` to pinned ``dst`` on ``stream``,
        then ``event`` recorded behind it: from Cython once the CUDA backend has set the
        driver's entry points (a cache of this process built its kernels), else through
        cuda-bindings."""
        copy = self._c_copy
        if copy is None:
            copy = _c_copy()
            if copy is not None:
                self._c_copy = copy
        if copy is not None:
            copy(dst, src, nbytes, stream, event.ptr)
            return
        cu, check = self._driver
        check(cu.cuMemcpyDtoHAsync(dst, src, nbytes, stream), "cuMemcpyDtoHAsync (the sampled ids)")
        event.record(stream)


def _c_copy() -> Callable[[int, int, int, int, int], None] | None:
    """``cellcache.cuda._launch.copy_to_host`` once the driver's entry points are set in
    this process, else None."""
    try:
        from ..cuda import _launch
    except ImportError:
        return None
    return _launch.copy_to_host if _launch.entry_points_set() else None


def _driver_calls() -> Any:
    """(cuda.bindings.driver, cellcache's result check), or False without cuda-bindings."""
    try:
        from ..cuda.driver import check, cu
    except ImportError:
        return False
    return cu, check


class _DriverEvent:
    """A CUDA event made and recorded through the driver, waited for as torch's is: the
    copy-done marker on the driver path (``record`` takes a stream handle)."""

    __slots__ = ("_cu", "_check", "handle", "ptr")

    def __init__(self, cu: Any, check: Any):
        self._cu, self._check = cu, check
        self.handle = check(cu.cuEventCreate(int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)),
                            "cuEventCreate (the sampler's copy event)")
        self.ptr = int(self.handle)           # (its address, for the Cython copy)

    def record(self, stream: int) -> None:
        self._check(self._cu.cuEventRecord(self.handle, stream), "cuEventRecord (the sampled ids)")

    def synchronize(self) -> None:
        self._check(self._cu.cuEventSynchronize(self.handle), "cuEventSynchronize (the sampled ids)")

    def __del__(self) -> None:
        handle, self.handle = getattr(self, "handle", None), None
        if handle is not None:
            try:
                self._cu.cuEventDestroy(handle)
            except Exception:  # noqa: BLE001 - at interpreter exit the bindings may be gone
                pass
