"""The CUDA driver through cuda-bindings: the one error path, the primary context, PTX.

Every driver result, from Python here or from the Cython step engine, becomes an exception
in :func:`raise_cuda_error` and nowhere else: ``CUDA_ERROR_OUT_OF_MEMORY`` is
:class:`OutOfMemory` (with the device's free and total bytes), anything else
:class:`CudaError` naming the result. :func:`check` unwraps a cuda-bindings result through
it. Everything here is off the hot path (set-up, growth, teardown).
"""

from __future__ import annotations

import json
import threading
from importlib import resources
from typing import Any

import numpy as np

from ..errors import CudaError, InvalidArgument, OutOfMemory

try:
    from cuda.bindings import driver as cu
except ImportError as e:  # pragma: no cover - the registry checks first
    raise ImportError(
        "the CUDA backend needs cuda-bindings: pip install 'cellcache[cu12]' (drivers for "
        "CUDA 12.0+, R525+) or 'cellcache[cu13]' (CUDA 13.0+, R580+)") from e

__all__ = ["Context", "check", "cu", "entry_points", "function", "load_module", "manifest",
           "raise_cuda_error"]

ENTRY_POINT_VERSION = 12000     # the hot entry points' ABI is the same from CUDA 12.0 on
CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600
_init_lock = threading.Lock()
_initialised = False


def error_name(code: int) -> str:
    """The driver's name of a result code (``CUresult N`` when it has none)."""
    try:
        err, name = cu.cuGetErrorName(cu.CUresult(code))
        if int(err) == 0 and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - an unknown code still gets a message
        pass
    return f"CUresult {code}"


def raise_cuda_error(code: int, what: str) -> None:
    """Raises the exception for driver result ``code`` of the call described by ``what``."""
    name = error_name(code)
    if name == "CUDA_ERROR_OUT_OF_MEMORY":
        detail = ""
        try:
            err, free, total = cu.cuMemGetInfo()
            if int(err) == 0:
                detail = f"; {int(free)} of {int(total)} bytes free"
        except Exception:  # noqa: BLE001 - the OOM is the error to report
            pass
        raise OutOfMemory(f"{what} failed: {name} ({code}){detail}")
    raise CudaError(f"{what} failed: {name} ({code})", code=code, name=name)


def check(result: Any, what: str, allowed: tuple[int, ...] = ()) -> Any:
    """Unwraps a cuda-bindings result: raises unless its code is 0 or in ``allowed``.

    ``result`` is what a cuda-bindings call returns: a CUresult or a tuple whose first item
    is one. Returns the remaining item (or tuple of items), or None; with ``allowed``, the
    code comes first.
    """
    if isinstance(result, tuple):
        code, rest = int(result[0]), result[1:]
    else:
        code, rest = int(result), ()
    if code != 0 and code not in allowed:
        raise_cuda_error(code, what)
    value = None if not rest else rest[0] if len(rest) == 1 else rest
    return (code, value) if allowed else value


def capturing(stream: int) -> bool:
    """Whether ``stream`` is being captured into a graph (so nothing may be allocated for it)."""
    status = check(cu.cuStreamIsCapturing(stream), "cuStreamIsCapturing")
    return int(status) != int(cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE)


def init() -> None:
    """cuInit, once per process."""
    global _initialised
    with _init_lock:
        if not _initialised:
            check(cu.cuInit(0), "cuInit")
            _initialised = True


def driver_version() -> int:
    init()
    return int(check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))


class Context:
    """The device's primary context (the one PyTorch uses), retained for our lifetime."""

    def __init__(self, device: int):
        init()
        count = check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        if not 0 <= device < count:
            raise InvalidArgument(f"device={device} is outside [0, {count}) on this machine")
        self.device_ordinal = device
        self.device = check(cu.cuDeviceGet(device), "cuDeviceGet")
        self.ctx = check(cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self.handle = int(self.ctx)
        self._released = False
        self.make_current()
        self.sm_count = self.attribute("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT")

    def attribute(self, name: str) -> int:
        attr = getattr(cu.CUdevice_attribute, name)
        return int(check(cu.cuDeviceGetAttribute(attr, self.device), f"cuDeviceGetAttribute({name})"))

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
        pfn = check(cu.cuGetProcAddress(name.encode(), ENTRY_POINT_VERSION, flags),
                    f"cuGetProcAddress({name})")
        if isinstance(pfn, tuple):
            pfn = pfn[0]
        out[name] = int(pfn)
        if not out[name]:
            raise CudaError(f"the driver has no entry point {name} for CUDA {ENTRY_POINT_VERSION}")
    return out


def manifest() -> dict:
    """The shipped PTX's manifest (compiler, ISA, target, minimum driver, hashes)."""
    return json.loads(resources.files("cellcache").joinpath("ptx/manifest.json").read_text())


# what cuModuleLoadData answers for PTX this driver cannot take (INVALID_IMAGE: bytes that are
# neither PTX nor a cubin, INVALID_SOURCE: PTX the JIT rejects)
_LOAD_ERRORS = ("CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "CUDA_ERROR_INVALID_PTX",
                "CUDA_ERROR_NO_BINARY_FOR_GPU", "CUDA_ERROR_JIT_COMPILER_NOT_FOUND",
                "CUDA_ERROR_INVALID_IMAGE", "CUDA_ERROR_INVALID_SOURCE")


def load_module(name: str, ptx: bytes | None = None) -> Any:
    """``cuModuleLoadData`` of the shipped ``ptx/<name>.ptx`` (or of ``ptx``, PTX built from
    other sources, to compare kernels); a CudaError naming the driver the PTX needs and the
    one present when the driver cannot load the shipped PTX, or the driver's error for ``ptx``."""
    given = ptx is not None
    if ptx is None:
        ptx = resources.files("cellcache").joinpath(f"ptx/{name}.ptx").read_bytes()
    data = bytes(ptx)
    image = np.frombuffer(data + b"\0", dtype=np.uint8)   # NUL-terminated, alive through the call
    code, module = check(cu.cuModuleLoadData(image.ctypes.data), f"cuModuleLoadData({name}.ptx)",
                         allowed=tuple(int(getattr(cu.CUresult, n)) for n in _LOAD_ERRORS))
    if code != 0 and given:
        errname = error_name(code)
        raise CudaError(f"the driver cannot load the PTX given for {name}: {errname}", code=code,
                        name=errname)
    if code != 0:
        info = manifest()
        have = driver_version()
        errname = error_name(code)
        target = info["kernels"][name].get("ptx_target", "sm_80")
        if target.endswith("a"):              # arch-specific PTX (sm_90a): one GPU generation only
            cc = target[3:-1]
            raise CudaError(f"the driver cannot load cellcache's PTX ({name}.ptx, built for {target}): "
                            f"{errname}. It runs only on GPUs of compute capability "
                            f"{cc[:-1]}.{cc[-1]}.", code=code, name=errname)
        raise CudaError(
            f"the driver cannot load cellcache's PTX ({name}.ptx, PTX ISA "
            f"{info['kernels'][name]['ptx_isa']}, built by {info['compiler']} for "
            f"{target}): {errname}. "
            f"It needs a driver for CUDA "
            f"{info['min_driver_cuda']} or newer; this driver supports CUDA "
            f"{have // 1000}.{have % 1000 // 10}.", code=code, name=errname)
    return module


def function(module: Any, name: str) -> Any:
    return check(cu.cuModuleGetFunction(module, name.encode()), f"cuModuleGetFunction({name})")
