"""The CUDA driver through cuda-bindings: one ``check()``, the primary context, PTX loading.

Everything here is off the hot path (set-up, allocation, growth, teardown). The per-step
calls go through :mod:`cellcache._driver`, which gets its entry points from
:func:`entry_points`.
"""

from __future__ import annotations

import json
import threading
from importlib import resources
from typing import Any

import numpy as np

from ..errors import CudaError, OutOfMemory

try:
    from cuda.bindings import driver as cu
except ImportError as e:  # pragma: no cover - exercised where cuda-bindings is absent
    raise ImportError(
        "the CUDA backend needs cuda-bindings: pip install 'cellcache[cuda]'") from e

__all__ = ["Context", "check", "cu", "device_usable", "entry_points", "load_module",
           "raise_cuda_error"]

ENTRY_POINT_VERSION = 12000     # these entry points' ABI is the same from CUDA 12.0 on
_init_lock = threading.Lock()
_initialised = False


def _code(result: Any) -> int:
    return int(result)


def error_name(code: int) -> str:
    try:
        err, name = cu.cuGetErrorName(cu.CUresult(code))
        if int(err) == 0 and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - an unknown code still gets a message
        pass
    return f"CUresult {code}"


def raise_cuda_error(code: int, what: str) -> None:
    """Raises the exception for a failed driver call (OutOfMemory for CUDA_ERROR_OUT_OF_MEMORY)."""
    name = error_name(code)
    if name == "CUDA_ERROR_OUT_OF_MEMORY":
        raise OutOfMemory(f"{what} failed: {name} ({code})")
    raise CudaError(f"{what} failed: {name} ({code})", code=code, name=name)


def check(result: Any, what: str) -> Any:
    """The one choke point: unwraps a cuda-bindings result, raising on any error.

    ``result`` is what a cuda-bindings call returns: a CUresult or a tuple whose first item
    is one. Returns the remaining item (or tuple of items), or None.
    """
    if isinstance(result, tuple):
        code, rest = _code(result[0]), result[1:]
    else:
        code, rest = _code(result), ()
    if code != 0:
        raise_cuda_error(code, what)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def init() -> None:
    global _initialised
    with _init_lock:
        if not _initialised:
            check(cu.cuInit(0), "cuInit")
            _initialised = True


def device_usable() -> bool:
    """True when a driver and at least one device are present.

    False only for "no driver" (libcuda cannot be loaded) and "no device"
    (CUDA_ERROR_NO_DEVICE, or zero devices); every other failure raises.
    """
    try:
        result = cu.cuInit(0)
    except RuntimeError as e:
        if "libcuda" in str(e):
            return False
        raise
    code = _code(result[0] if isinstance(result, tuple) else result)
    if code == _code(cu.CUresult.CUDA_ERROR_NO_DEVICE):
        return False
    if code != 0:
        raise_cuda_error(code, "cuInit")
    return check(cu.cuDeviceGetCount(), "cuDeviceGetCount") > 0


def driver_version() -> int:
    init()
    return int(check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))


class Context:
    """The device's primary context (the one PyTorch uses), retained for our lifetime."""

    def __init__(self, device: int):
        init()
        count = check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        if not 0 <= device < count:
            from ..errors import InvalidArgument

            raise InvalidArgument(f"device={device} is outside [0, {count}) on this machine")
        self.device_ordinal = device
        self.device = check(cu.cuDeviceGet(device), "cuDeviceGet")
        self.ctx = check(cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self.handle = int(self.ctx)
        self.make_current()
        self.sm_count = int(check(cu.cuDeviceGetAttribute(
            cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.device),
            "cuDeviceGetAttribute"))
        self._released = False

    def make_current(self) -> None:
        check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def release(self) -> None:
        if not self._released:
            self._released = True
            check(cu.cuDevicePrimaryCtxRelease(self.device), "cuDevicePrimaryCtxRelease")


def entry_points(names: tuple[str, ...]) -> dict[str, int]:
    """Addresses of the named driver functions (legacy default stream semantics)."""
    init()
    flags = int(cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_LEGACY_STREAM)
    out = {}
    for name in names:
        result = cu.cuGetProcAddress(name.encode(), ENTRY_POINT_VERSION, flags)
        pfn = check(result, f"cuGetProcAddress({name})")
        if isinstance(pfn, tuple):
            pfn = pfn[0]
        out[name] = int(pfn)
        if not out[name]:
            raise CudaError(f"the driver has no entry point {name} for CUDA {ENTRY_POINT_VERSION}")
    return out


def manifest() -> dict:
    return json.loads(resources.files("cellcache").joinpath("ptx/manifest.json").read_text())


_LOAD_ERRORS = ("CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "CUDA_ERROR_INVALID_PTX",
                "CUDA_ERROR_NO_BINARY_FOR_GPU", "CUDA_ERROR_JIT_COMPILER_NOT_FOUND")


def load_module(name: str) -> Any:
    """``cuModuleLoadData`` of the shipped ``ptx/<name>.ptx``; a clear CudaError if the driver
    cannot load it (naming the driver version the PTX needs and the one present)."""
    data = resources.files("cellcache").joinpath(f"ptx/{name}.ptx").read_bytes() + b"\0"
    image = np.frombuffer(data, dtype=np.uint8)      # NUL-terminated, alive through the call
    result = cu.cuModuleLoadData(image.ctypes.data)
    code = _code(result[0])
    if code != 0:
        errname = error_name(code)
        if errname in _LOAD_ERRORS:
            info = manifest()
            have = driver_version()
            raise CudaError(
                f"the driver cannot load cellcache's PTX ({name}.ptx, PTX ISA "
                f"{info['kernels'][name]['ptx_isa']}, built by nvcc {info['nvcc']} for "
                f"{info['target']}): {errname}. It needs a driver for CUDA "
                f"{info['min_driver_cuda']} or newer; this driver supports CUDA "
                f"{have // 1000}.{have % 1000 // 10}.", code=code, name=errname)
        raise_cuda_error(code, f"cuModuleLoadData({name}.ptx)")
    return result[1]


def function(module: Any, name: str) -> Any:
    return check(cu.cuModuleGetFunction(module, name.encode()), f"cuModuleGetFunction({name})")
