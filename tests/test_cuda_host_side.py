"""The CUDA backend's pieces that need no GPU: shipped PTX, DLPack capsules, entry points,
registry wiring."""

import ctypes
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cellcache import _driver
from cellcache.registry import registered, resolve_backend

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_ptx_matches_the_kernel_sources():
    """Source hashes always; the PTX bytes too when this nvcc is the manifest's."""
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "build_ptx.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_ptx_check_notices_a_changed_source(tmp_path):
    # A copy of the tree with one kernel edited must fail the check.
    for part in ("cuda", "tools", "cellcache/ptx"):
        shutil.copytree(ROOT / part, tmp_path / part)
    src = tmp_path / "cuda" / "kv.cu"
    src.write_text(src.read_text() + "\n// edited\n")
    r = subprocess.run([sys.executable, str(tmp_path / "tools" / "build_ptx.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "kv.cu changed since its PTX was built" in r.stderr


def test_manifest_names_what_a_driver_needs():
    import json

    m = json.loads((ROOT / "cellcache" / "ptx" / "manifest.json").read_text())
    assert set(m["kernels"]) == {p.stem for p in (ROOT / "cuda").glob("*.cu")}
    assert m["min_driver_cuda"] and m["target"].startswith("compute_")


class Owner:
    pass


def test_dlpack_capsule_keeps_its_owner_alive_until_released():
    owner = Owner()
    before = sys.getrefcount(owner)
    cap = _driver.dlpack_capsule(owner, 0x1000, (2, 3), 2, 32, 0)
    assert sys.getrefcount(owner) == before + 1
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype = ctypes.c_char_p
    get_name.argtypes = [ctypes.py_object]
    assert get_name(cap) == b"dltensor"
    del cap                                       # never consumed: the capsule frees it
    assert sys.getrefcount(owner) == before


def test_entry_points_must_all_be_given():
    with pytest.raises(RuntimeError, match="not resolved: cuLaunchKernel"):
        _driver.set_entry_points({n: 1 for n in _driver.ENTRY_POINTS if n != "cuLaunchKernel"})


def test_cuda_backend_is_registered_and_auto_falls_back_without_a_device():
    pytest.importorskip("cuda.bindings")
    from cellcache.cuda.driver import device_usable

    assert registered()["cuda"] == ["batched-cell", "batched"]
    assert resolve_backend("auto") == ("cuda" if device_usable() else "host")
