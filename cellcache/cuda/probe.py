"""Is a CUDA backend usable here? Answered with ctypes alone, without importing cuda-bindings.

"No" has exactly three causes, each recognised by what it is: cuda-bindings is not installed
(no ``cuda.bindings`` module), there is no driver (the loader cannot open the driver
library, or it is the toolkit's stub), or there is no device (``CUDA_ERROR_NO_DEVICE`` or a
count of zero). Any other failure raises :class:`cellcache.CudaError`.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys

from ..errors import CudaError

__all__ = ["DRIVER_LIBRARY", "cuda_usable"]

DRIVER_LIBRARY = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_STUB_LIBRARY = 34


def _load_driver():
    loader = ctypes.WinDLL if sys.platform == "win32" else ctypes.CDLL
    return loader(DRIVER_LIBRARY)


def cuda_usable() -> tuple[bool, str]:
    """(True, "") when cuda-bindings is installed and the driver reports a device; else
    (False, why) for the three "absent" causes. Raises CudaError for any other failure."""
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        return False, "cuda-bindings is not installed (pip install 'cellcache[cuda]')"
    try:
        lib = _load_driver()
    except OSError as e:
        return False, f"no CUDA driver ({DRIVER_LIBRARY} cannot be loaded: {e})"
    code = int(lib.cuInit(0))
    if code == CUDA_ERROR_STUB_LIBRARY:
        return False, f"no CUDA driver ({DRIVER_LIBRARY} is the toolkit's stub)"
    if code == CUDA_ERROR_NO_DEVICE:
        return False, "no CUDA device"
    if code != 0:
        raise CudaError(f"cuInit failed with CUresult {code}", code=code)
    count = ctypes.c_int(0)
    code = int(lib.cuDeviceGetCount(ctypes.byref(count)))
    if code != 0:
        raise CudaError(f"cuDeviceGetCount failed with CUresult {code}", code=code)
    if count.value == 0:
        return False, "no CUDA device"
    return True, ""
