"""Is a CUDA backend usable here? Answered with ctypes alone, without importing cuda-bindings.

"No" has exactly three causes, each recognised by what it is: cuda-bindings is not installed
(no ``cuda.bindings`` module), there is no driver (the loader cannot open the driver
library, or it is the toolkit's stub), or there is no device (``CUDA_ERROR_NO_DEVICE`` or a
count of zero). Any other failure raises :class:`cellcache.CudaError`, among them a driver
too old for the installed cuda-bindings (cuda-bindings 13 needs a CUDA 13 driver, R580+; the
message names the extra to install instead) or for cellcache's PTX (CUDA 12.0, R525+).

Every explicit CUDA path (``build("cuda", ...)``, ``CudaCellCache(...)``, the CLIs'
``--backend cuda``) goes through :func:`require_cuda`, so "not usable" is one ``CudaError``
with the same one-line reason ``"auto"`` acts on.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import sys

from ..errors import CudaError

__all__ = ["DRIVER_LIBRARY", "EXTRAS", "cuda_usable", "require_cuda"]

DRIVER_LIBRARY = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_STUB_LIBRARY = 34
#: cellcache's extras by CUDA major: (extra, cuda-bindings requirement, oldest driver branch).
EXTRAS = {12: ("cu12", "cuda-bindings>=12.6,<13", "R525"),
          13: ("cu13", "cuda-bindings>=13,<14", "R580")}
#: The oldest CUDA the shipped PTX (ISA 8.0) loads on, as cuDriverGetVersion reports it.
MIN_DRIVER = 12000
INSTALL_HINT = ("pip install 'cellcache[cu12]' (drivers for CUDA 12.0+, R525+) or "
                "'cellcache[cu13]' (CUDA 13.0+, R580+)")


def _load_driver():
    loader = ctypes.WinDLL if sys.platform == "win32" else ctypes.CDLL
    return loader(DRIVER_LIBRARY)


def _bindings_version() -> str | None:
    """The installed cuda-bindings' version (from its metadata, nothing imported), or None
    when no distribution says (a source checkout)."""
    try:
        return importlib.metadata.version("cuda-bindings")
    except importlib.metadata.PackageNotFoundError:
        return None


def _cuda_name(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def _check_versions(driver: int) -> None:
    """Raises CudaError when the driver (cuDriverGetVersion's ``driver``) cannot run the
    shipped PTX or the installed cuda-bindings, naming the extra that fits the driver."""
    have = _cuda_name(driver)
    if driver < MIN_DRIVER:
        raise CudaError(
            f"this driver supports CUDA {have}; cellcache needs a driver for CUDA 12.0 or "
            "newer (R525+)")
    version = _bindings_version()
    try:
        major = int(version.split(".")[0]) if version else None
    except ValueError:
        major = None
    if major is None or major <= driver // 1000:
        return
    fits = max(m for m in EXTRAS if m <= driver // 1000)
    extra, requirement, _ = EXTRAS[fits]
    need = EXTRAS.get(major, (None, None, "a newer driver"))[2]
    raise CudaError(
        f"cuda-bindings {version} needs a driver for CUDA {major}.0 or newer ({need}+); this "
        f"driver supports CUDA {have}: pip install 'cellcache[{extra}]' ({requirement}), or "
        "upgrade the driver")


def cuda_usable() -> tuple[bool, str]:
    """(True, "") when cuda-bindings is installed, the driver reports a device and can run
    the installed cuda-bindings; else (False, why) for the three "absent" causes. Raises
    CudaError for any other failure (a driver too old for cuda-bindings or the PTX too)."""
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        return False, f"cuda-bindings is not installed ({INSTALL_HINT})"
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
    version = ctypes.c_int(0)
    code = int(lib.cuDriverGetVersion(ctypes.byref(version)))
    if code != 0:
        raise CudaError(f"cuDriverGetVersion failed with CUresult {code}", code=code)
    _check_versions(version.value)
    return True, ""


def require_cuda() -> None:
    """Returns when the CUDA backend is usable here; else raises CudaError with the probe's
    one-line reason (what ``"auto"`` would have fallen back on)."""
    ok, why = cuda_usable()
    if not ok:
        raise CudaError(f"the CUDA backend is not usable here: {why}")
