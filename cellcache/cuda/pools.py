"""K/V pools on the device: fixed addresses through virtual memory management, or copy
growth where the device cannot map.

:class:`MappedPools` reserves, when the cache is built, each pool's address range for
``capacity + 1`` rows (the last row is the sink) with ``cuMemAddressReserve``, and backs it
with physical memory as the pool grows: ``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess``
of whole allocation granules. A growth copies nothing and moves nothing, so a graph
captured once stays valid. A growth maps everything it needs in :meth:`plan`; if any call
fails, whatever the attempt created is unmapped and released, and the error propagates
(``OutOfMemory`` for a full device) with the pools as they were.

:class:`DeviceAllocator` is the allocator of the copy fallback (``cellcache.pools.CopyPools``
with device copies), used where ``CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED``
is 0, where reserving the address range fails with ``growth="auto"``, or when the cache is
built with ``growth="copy"``. :func:`check_device_allocation` is what copy pools require of
any allocator's allocation before they switch to it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidArgument, OutOfMemory
from ..pools import PoolKey
from .driver import Context, check, cu

__all__ = ["DeviceAllocation", "DeviceAllocator", "MappedPools", "VmmOps", "check_device_allocation",
           "vmm_supported"]


class DeviceAllocation:
    """``nbytes`` of device memory at ``ptr`` (from cuMemAlloc)."""

    __slots__ = ("nbytes", "ptr")

    def __init__(self, ptr: int, nbytes: int):
        self.ptr, self.nbytes = ptr, nbytes


def check_device_allocation(allocation: Any, nbytes: int, what: str) -> None:
    """Refuses (InvalidArgument) an allocation copy pools cannot use as ``nbytes`` bytes of
    device memory: it needs an int device address ``ptr`` (non-zero) and ``nbytes`` at
    least the request."""
    ptr = _as_int(getattr(allocation, "ptr", None))
    size = _as_int(getattr(allocation, "nbytes", None))
    if ptr is not None and 0 < ptr < 1 << 64 and size is not None and size >= nbytes:
        return
    raise InvalidArgument(
        f"the allocator returned {type(allocation).__name__} (ptr={getattr(allocation, 'ptr', None)!r}, "
        f"nbytes={getattr(allocation, 'nbytes', None)!r}) for {what}; it must return an "
        f"object with an int device address .ptr and .nbytes >= {nbytes}")


def _as_int(value: Any) -> int | None:
    if value is None or isinstance(value, (bool, float, str, bytes)):
        return None
    try:
        return int(value)              # ints, numpy ints, cuda-bindings' CUdeviceptr
    except (TypeError, ValueError, OverflowError):
        return None


class DeviceAllocator:
    """cuMemAlloc / cuMemFree in the cache's context; a full device raises OutOfMemory."""

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def allocate(self, nbytes: int, what: str) -> DeviceAllocation:
        self.ctx.make_current()
        ptr = check(cu.cuMemAlloc(max(int(nbytes), 1)),
                    f"cuMemAlloc({nbytes}) for {what} on device {self.ctx.device_ordinal}")
        return DeviceAllocation(int(ptr), int(nbytes))

    def release(self, allocation: DeviceAllocation) -> None:
        self.ctx.make_current()
        check(cu.cuMemFree(allocation.ptr), "cuMemFree")


def vmm_supported(ctx: Context) -> bool:
    """Whether the device supports virtual memory management (mapped pools)."""
    return ctx.attribute("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED") != 0


class VmmOps:
    """The driver calls mapped pools make, one method each, so tests can fail any one."""

    def __init__(self, device_ordinal: int):
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device_ordinal
        self.prop = prop
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device_ordinal
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.access = access

    def granularity(self) -> int:
        flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(check(cu.cuMemGetAllocationGranularity(self.prop, flag),
                         "cuMemGetAllocationGranularity"))

    def reserve(self, size: int, alignment: int) -> int:
        return int(check(cu.cuMemAddressReserve(size, alignment, 0, 0), f"cuMemAddressReserve({size})"))

    def free_range(self, va: int, size: int) -> None:
        check(cu.cuMemAddressFree(va, size), "cuMemAddressFree")

    def create(self, size: int) -> Any:
        return check(cu.cuMemCreate(size, self.prop, 0), f"cuMemCreate({size})")

    def map(self, va: int, size: int, handle: Any) -> None:
        check(cu.cuMemMap(va, size, 0, handle, 0), f"cuMemMap({size})")

    def set_access(self, va: int, size: int) -> None:
        check(cu.cuMemSetAccess(va, size, [self.access], 1), f"cuMemSetAccess({size})")

    def unmap(self, va: int, size: int) -> None:
        check(cu.cuMemUnmap(va, size), "cuMemUnmap")

    def release(self, handle: Any) -> None:
        check(cu.cuMemRelease(handle), "cuMemRelease")


@dataclass
class _Pool:
    va: int                  # base of the reserved range
    size: int                # reserved bytes, a multiple of the granularity
    sink_lo: int             # first byte of the granule range holding the sink row
    hi: int = 0              # bytes [0, hi) are mapped
    sink_mapped: bool = False
    chunks: list = field(default_factory=list)   # (offset, size, handle) of every mapping
    slept: tuple[int, bool] | None = None        # (hi, sink_mapped) kept by sleep() for wake()


@dataclass
class _Plan:
    rows: int
    mapped: list = field(default_factory=list)   # (key, offset, size, handle), in order made
    hi: dict = field(default_factory=dict)


class MappedPools:
    """Pools at fixed device addresses, grown by mapping (see the module docstring).

    The reserved ranges are released through ``undo`` (the cache's undo stack); the owner
    calls :meth:`close` before that to unmap what was mapped (the cache registers it).
    """

    moves = False

    def __init__(self, row_bytes: dict[PoolKey, int], capacity: int, ops: VmmOps,
                 undo: Any):
        self.row_bytes, self.capacity, self.ops = row_bytes, capacity, ops
        self.rows = 0
        self.granularity = g = ops.granularity()
        self.pools: dict[PoolKey, _Pool] = {}
        with contextlib.ExitStack() as reserved:   # a failure frees what was reserved so far
            for key, nbytes in row_bytes.items():
                size = -(-(capacity + 1) * nbytes // g) * g
                if size >= 1 << 63:
                    raise OutOfMemory(
                        f"pool layer_{key[0]}_{key[1]} would need {size} bytes of address space "
                        f"({capacity + 1} rows of {nbytes} bytes); no device has that much")
                va = ops.reserve(size, g)
                reserved.callback(ops.free_range, va, size)
                self.pools[key] = _Pool(va, size, (capacity * nbytes) // g * g)
            undo.push(reserved.pop_all())    # the ranges are freed when ``undo`` closes

    @property
    def sink(self) -> int:
        return self.capacity

    def ptr(self, key: PoolKey) -> int:
        return self.pools[key].va

    @property
    def mapped_bytes(self) -> int:
        return sum(size for p in self.pools.values() for _, size, _ in p.chunks)

    def plan(self, rows: int) -> _Plan:
        plan = _Plan(rows)
        g = self.granularity
        try:
            for key, nbytes in self.row_bytes.items():
                p = self.pools[key]
                want = min(-(-rows * nbytes // g) * g, p.sink_lo)
                if want > p.hi:
                    self._map(plan, key, p.hi, want - p.hi)
                plan.hi[key] = max(want, p.hi)
                if not p.sink_mapped:
                    self._map(plan, key, p.sink_lo, p.size - p.sink_lo)
        except BaseException:
            self.cancel(plan)
            raise
        return plan

    def _map(self, plan: _Plan, key: PoolKey, offset: int, size: int) -> None:
        ops, va = self.ops, self.pools[key].va + offset
        handle = ops.create(size)
        try:
            ops.map(va, size, handle)
        except BaseException:
            ops.release(handle)
            raise
        plan.mapped.append((key, offset, size, handle))
        ops.set_access(va, size)

    def apply(self, plan: _Plan, live_rows: int, stream: int) -> bool:
        for key, offset, size, handle in plan.mapped:
            self.pools[key].chunks.append((offset, size, handle))
        for key, p in self.pools.items():
            p.hi = plan.hi[key]
            p.sink_mapped = True
        self.rows = plan.rows
        plan.mapped = []
        return False

    def cancel(self, plan: _Plan) -> None:
        for key, offset, size, handle in reversed(plan.mapped):
            self.ops.unmap(self.pools[key].va + offset, size)
            self.ops.release(handle)
        plan.mapped = []

    def sleep(self) -> None:
        """Unmaps and releases every mapping (the caller has waited for queued work) and
        keeps the reserved ranges: the pools' addresses stay, with no memory behind them,
        until :meth:`wake`."""
        for p in self.pools.values():
            if p.slept is None:
                p.slept = (p.hi, p.sink_mapped)
        self.close()

    def wake(self) -> None:
        """Maps fresh memory where :meth:`sleep` unmapped it, one mapping per pool's rows
        and one for its sink; a failure unmaps and releases what it made (the error
        propagates, the pools stay asleep)."""
        if any(p.chunks for p in self.pools.values()):
            self.close()                    # what a failed sleep left mapped goes first
        plan = _Plan(self.rows)
        try:
            for key, p in self.pools.items():
                hi, sink = p.slept or (0, False)
                if hi:
                    self._map(plan, key, 0, hi)
                if sink:
                    self._map(plan, key, p.sink_lo, p.size - p.sink_lo)
        except BaseException:
            self.cancel(plan)
            raise
        for key, offset, size, handle in plan.mapped:
            self.pools[key].chunks.append((offset, size, handle))
        for p in self.pools.values():
            p.hi, p.sink_mapped = p.slept or (0, False)
            p.slept = None

    def close(self) -> None:
        """Unmaps and releases every mapping (the caller has waited for queued work)."""
        for p in self.pools.values():
            while p.chunks:                 # (one that raises stays listed: a retry finds it)
                offset, size, handle = p.chunks[-1]
                self.ops.unmap(p.va + offset, size)
                self.ops.release(handle)
                p.chunks.pop()
            p.hi, p.sink_mapped = 0, False
