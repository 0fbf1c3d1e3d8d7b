"""K/V pool storage, backend-neutral: the :class:`Pools` protocol the cache grows through, and
:class:`CopyPools`, growth by copying into larger storage (the backends' fallback where they
cannot map memory in place).

Growth is all or nothing, in two phases the cache drives (``cellcache.cache``, prepare_step
steps 3 and 5)::

    plan(rows)     every allocation the growth needs, checked    OutOfMemory: nothing changed
    apply(plan)    live rows copied, the pools switched, the old storage retired
    cancel(plan)   a plan not applied gives everything back

A pool is keyed by ``(layer, "k" | "v")`` (:data:`PoolKey`) and has ``rows + 1`` rows, the
last one the sink that padding rows write to.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import InvalidArgument

__all__ = ["GROWTH_MODES", "Allocator", "CopyPools", "PoolKey", "PoolReleaseWarning", "Pools",
           "check_allocator", "check_growth", "release_quietly"]

#: A pool's key: (layer index, "k" or "v").
PoolKey = tuple[int, str]
#: How a backend's pools grow: ``"map"`` (fixed addresses, reserved up front), ``"copy"``
#: (larger storage, live rows copied: the pools move) or ``"auto"`` (map where possible).
GROWTH_MODES = ("auto", "map", "copy")


class Allocator(Protocol):
    """Where copy-growth pool storage comes from; tests wrap one to fail at a chosen call.

    The host backend needs a writable contiguous 1-D uint8 numpy array of at least
    ``nbytes`` bytes; the CUDA backend an object with an int device address ``ptr`` and
    ``nbytes`` >= the request. Anything else is refused with InvalidArgument before the
    pools change (and given back through ``release``).
    """

    def allocate(self, nbytes: int, what: str) -> Any:
        """Returns an allocation of ``nbytes`` bytes, or raises OutOfMemory."""

    def release(self, allocation: Any) -> None:
        """Gives an allocation back (the backend ensures no queued work still reads it)."""


class PoolReleaseWarning(RuntimeWarning):
    """Giving back a retired (or abandoned) pool allocation failed.

    The growth that retired it had already succeeded, so the cache stays as the growth left
    it; the allocation is kept and given back again at the next growth (and at ``close()``
    where the backend has one).
    """


class Pools(Protocol):
    """The K/V pools of a cache: one per (layer, "k"|"v"), ``rows`` cell rows plus the sink.

    Growth is two-phase so that a failure changes nothing: :meth:`plan` acquires everything
    a growth needs (raising OutOfMemory, nothing changed), :meth:`apply` finishes it once
    the cache has ordered the stream after earlier forwards, :meth:`cancel` gives a plan
    back. ``apply`` either raises with the pools unchanged or switches them and returns;
    ``cancel`` of a plan that was applied does nothing.
    """

    rows: int
    moves: bool          # whether a growth changes the pools' addresses

    @property
    def sink(self) -> int:
        """The row padding writes to: the last row of every pool's view."""

    def plan(self, rows: int) -> Any: ...
    def apply(self, plan: Any, live_rows: int, stream: int) -> bool: ...
    def cancel(self, plan: Any) -> None: ...
    def close(self) -> None: ...

    def sleep(self) -> None:
        """Gives the pools' memory back (nothing is in them; queued work has finished)."""

    def wake(self) -> None:
        """Takes memory for the rows the pools had at :meth:`sleep` (or leaves it to the next
        step's growth); a failure (MemoryError) takes nothing and leaves them asleep."""


@dataclass
class _CopyPlan:
    rows: int
    new: dict                   # PoolKey -> allocation, every one checked
    stream: int | None = None   # set once copies into ``new`` may be queued
    applied: bool = False


class CopyPools:
    """Pools that grow by allocating larger storage and copying the live rows (then the
    addresses change). Each pool has ``rows + 1`` rows; the last is the sink.

    ``copy(src, dst, nbytes, stream)``, ``retire(allocation, stream)`` and
    ``check(allocation, nbytes, what)`` are the backend's: a copy on the step's stream, a
    release once no queued work reads the allocation, and a check that an allocation is
    what the backend can use (InvalidArgument otherwise).

    All or nothing: every allocation is made and checked in :meth:`plan` (a failure gives
    back all of them); :meth:`apply` copies into the new storage, then switches; only then
    are the old allocations retired. A retire that raises cannot undo a growth that has
    happened: it is reported as a :class:`PoolReleaseWarning` and the allocation is retired
    again at the next growth (or released at :meth:`close`). The live pools are never given
    back by a failed growth.
    """

    moves = True

    def __init__(self, row_bytes: dict[PoolKey, int], allocator: Any, copy: Any, retire: Any,
                 check: Any):
        self.row_bytes = row_bytes
        self.allocator = allocator
        self._copy, self._retire, self._check = copy, retire, check
        self.rows = 0
        self.allocations: dict[PoolKey, Any] = {}
        self.unreleased: list[Any] = []     # retired allocations whose retire raised

    @property
    def sink(self) -> int:
        return self.rows

    def plan(self, rows: int) -> _CopyPlan:
        plan = _CopyPlan(rows, {})
        try:
            for key, nbytes in self.row_bytes.items():
                what = f"pool layer_{key[0]}_{key[1]}"
                allocation = self.allocator.allocate((rows + 1) * nbytes, what)
                plan.new[key] = allocation      # given back on failure, even if refused
                self._check(allocation, (rows + 1) * nbytes, what)
        except BaseException:
            self.cancel(plan)
            raise
        return plan

    def apply(self, plan: _CopyPlan, live_rows: int, stream: int) -> bool:
        if self.allocations:
            plan.stream = stream
            for key, nbytes in self.row_bytes.items():
                self._copy(self.allocations[key], plan.new[key], live_rows * nbytes, stream)
        # the switch: nothing below may raise back into the cache
        old = list(self.allocations.values()) + self.unreleased
        plan.applied = True
        self.allocations, self.rows, self.unreleased = plan.new, plan.rows, []
        self._retire_all(old, stream)
        return True

    def _retire_all(self, allocations: list[Any], stream: int) -> None:
        """Retires each allocation; one whose retire raises is kept in ``unreleased`` (an
        interrupt keeps the rest too) and reported, never raised into the growth."""
        pending = list(allocations)
        while pending:
            allocation = pending.pop(0)
            try:
                self._retire(allocation, stream)
            except Exception as e:  # noqa: BLE001 - the growth has happened; keep and report
                self.unreleased.append(allocation)
                warnings.warn(
                    f"releasing a retired pool allocation failed ({type(e).__name__}: {e}); the "
                    "growth succeeded, the allocation is kept and released again at the next "
                    "growth", PoolReleaseWarning, stacklevel=2)
            except BaseException:
                self.unreleased += [allocation, *pending]
                raise

    def cancel(self, plan: _CopyPlan) -> None:
        if plan.applied:
            return
        new, plan.new = list(plan.new.values()), {}
        if plan.stream is not None:          # copies into them may be queued
            self._retire_all(new, plan.stream)
        else:
            for allocation in new:
                release_quietly(self.allocator, allocation)

    def sleep(self) -> None:
        """Releases the storage (the caller has waited for queued work): no rows, so the next
        step allocates anew, at new addresses, as the first step of a cache does."""
        self.close()
        self.rows = 0

    def wake(self) -> None:
        pass                                # (the next step's growth allocates)

    def close(self) -> None:
        """Releases every allocation (the caller has waited for queued work)."""
        held = list(self.allocations.values()) + self.unreleased
        self.allocations, self.unreleased = {}, []
        for allocation in held:
            release_quietly(self.allocator, allocation)


def release_quietly(allocator: Any, allocation: Any) -> bool:
    """``allocator.release(allocation)``; a failure is a PoolReleaseWarning (the caller is
    already unwinding or closing) and False."""
    try:
        allocator.release(allocation)
    except Exception as e:  # noqa: BLE001 - reported, never raised over the real outcome
        warnings.warn(f"releasing a pool allocation failed ({type(e).__name__}: {e})",
                      PoolReleaseWarning, stacklevel=3)
        return False
    return True


def check_allocator(allocator: Any) -> Any:
    """``allocator`` when it has ``allocate(nbytes, what)`` and ``release(allocation)``
    (or is None); InvalidArgument otherwise."""
    if allocator is not None and not (callable(getattr(allocator, "allocate", None))
                                      and callable(getattr(allocator, "release", None))):
        raise InvalidArgument(
            f"allocator of type {type(allocator).__name__} has no allocate(nbytes, what) "
            "and release(allocation) methods")
    return allocator


def check_growth(growth: object) -> str:
    """``growth`` when it is one of :data:`GROWTH_MODES`; InvalidArgument otherwise."""
    if not isinstance(growth, str) or growth not in GROWTH_MODES:
        raise InvalidArgument(f"growth={growth!r} is not one of {', '.join(GROWTH_MODES)}")
    return growth
