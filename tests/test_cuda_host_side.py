"""The CUDA backend's pieces that need no GPU: shipped PTX, the kernel ABI, DLPack capsules,
entry points, the probe, and the import graph."""

import ctypes
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cellcache import CudaError
from cellcache.cuda import _engine, probe
from cellcache.registry import resolve_backend

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "build_ptx.py"


def load_build_ptx():
    spec = importlib.util.spec_from_file_location("build_ptx", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_shipped_ptx_matches_the_kernel_sources():
    """Hashes, ISA and target always; the bytes too where the pinned NVRTC is installed
    (tools/test.sh installs it, so CI rebuilds byte for byte)."""
    r = subprocess.run([sys.executable, str(TOOL), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_shipped_ptx_loads_on_every_cuda_12_driver():
    m = json.loads((ROOT / "cellcache" / "ptx" / "manifest.json").read_text())
    assert set(m["kernels"]) == {p.stem for p in (ROOT / "cuda").glob("*.cu")}
    assert m["min_driver_cuda"] == "12.0" and m["compiler"] == "nvrtc 12.0.140"
    for name in m["kernels"]:
        head = (ROOT / "cellcache" / "ptx" / f"{name}.ptx").read_text()[:2000]
        assert re.search(r"^\.version 8\.0$", head, re.M), name
        assert re.search(r"^\.target sm_80$", head, re.M), name


def _tree_copy(tmp_path):
    for part in ("cuda", "tools", "cellcache/ptx"):
        shutil.copytree(ROOT / part, tmp_path / part)
    return tmp_path


@pytest.mark.parametrize("edit,expect", [
    (lambda t: (t / "cuda" / "step.cu").write_text((t / "cuda" / "step.cu").read_text() + "\n// x\n"),
     "step.cu (or a header) changed"),
    (lambda t: (t / "cuda" / "abi.h").write_text((t / "cuda" / "abi.h").read_text() + "\n// x\n"),
     "attention.cu (or a header) changed"),
], ids=["kernel", "header"])
def test_ptx_check_notices_a_changed_source(tmp_path, edit, expect):
    tree = _tree_copy(tmp_path)
    edit(tree)
    r = subprocess.run([sys.executable, str(tree / "tools" / "build_ptx.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and expect in r.stderr, r.stderr


def test_ptx_check_refuses_an_isa_newer_than_8_0(tmp_path):
    """PTX rebuilt by a newer compiler (ISA 9.0, CUDA 13 drivers only) must fail the check
    even with the manifest updated to match it."""
    tree = _tree_copy(tmp_path)
    ptx = tree / "cellcache" / "ptx" / "step.ptx"
    text = ptx.read_text().replace(".version 8.0", ".version 9.0", 1)
    ptx.write_text(text)
    manifest = json.loads((tree / "cellcache" / "ptx" / "manifest.json").read_text())
    import hashlib

    manifest["kernels"]["step"]["ptx_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    (tree / "cellcache" / "ptx" / "manifest.json").write_text(json.dumps(manifest))
    r = subprocess.run([sys.executable, str(tree / "tools" / "build_ptx.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "step.ptx is PTX ISA 9.0; at most 8.0" in r.stderr, r.stderr


@pytest.mark.parametrize("isa,cuda", [
    ("7.0", "11.0"), ("7.4", "11.4"), ("7.8", "11.8"), ("8.0", "12.0"), ("8.3", "12.3"),
    ("8.5", "12.4"), ("8.6", "12.7"), ("8.7", "12.8"), ("8.8", "12.9"), ("9.0", "13.0"),
])
def test_driver_for_isa_names_the_cuda_release(isa, cuda):
    assert load_build_ptx().driver_for_isa(isa) == cuda


def test_driver_for_isa_refuses_an_unknown_isa():
    with pytest.raises(ValueError, match="no known CUDA release for PTX ISA 9.9"):
        load_build_ptx().driver_for_isa("9.9")


def test_kernel_abi_has_one_source():
    """The engine takes its limits from cuda/abi.h; no Python or kernel file restates them."""
    header = (ROOT / "cuda" / "abi.h").read_text()
    values = dict(re.findall(r"^#define (CC_[A-Z_]+) (\d+)", header, re.M))
    assert _engine.MAX_WINDOWS == int(values["CC_MAX_WINDOWS"])
    assert _engine.STEP_THREADS == int(values["CC_STEP_THREADS"])
    assert _engine.MASK_COLS == int(values["CC_MASK_COLS"])
    assert _engine.ATTN_THREADS == int(values["CC_ATTN_THREADS"])
    assert _engine.PREFILL_PAIRS == int(values["CC_PREFILL_PAIRS"])
    # every field of cc_step_params is 8 bytes: 22 scalars and two windows arrays
    assert _engine.PARAMS_BYTES == 8 * (22 + 2 * _engine.MAX_WINDOWS)
    for path in list((ROOT / "cuda").glob("*.cu")) + list((ROOT / "cellcache").rglob("*.py")):
        text = path.read_text()
        for name in ("MAX_WINDOWS", "MASK_MAX_ROWS"):
            assert not re.search(rf"^\s*(#define\s+)?{name}\s*=?\s*\d+", text, re.M), (path, name)


def test_paged_args_pack_every_field():
    blob = _engine.paged_args(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 0.5)
    import struct

    assert len(blob) == 4 * 8 + 4 * 8 + 5 * 4 + 4
    assert struct.unpack("=8q5if", blob) == (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 0.5)


class Owner:
    pass


def test_dlpack_capsule_keeps_its_owner_alive_until_released():
    owner = Owner()
    before = sys.getrefcount(owner)
    cap = _engine.dlpack_capsule(owner, 0x1000, (2, 3), 2, 32, 0)
    assert sys.getrefcount(owner) == before + 1
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype = ctypes.c_char_p
    get_name.argtypes = [ctypes.py_object]
    assert get_name(cap) == b"dltensor"
    del cap                                       # never consumed: the capsule frees it
    assert sys.getrefcount(owner) == before


def test_entry_points_must_all_be_given():
    with pytest.raises(RuntimeError, match="not resolved: cuLaunchKernel"):
        _engine.set_entry_points({n: 1 for n in _engine.ENTRY_POINTS if n != "cuLaunchKernel"})


def test_import_cellcache_loads_no_cuda_module():
    code = ("import sys, cellcache; print(sorted(m for m in sys.modules "
            "if m.startswith('cuda') or m.startswith('cellcache.cuda')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_auto_without_a_device_loads_no_cuda_bindings():
    code = ("import sys, cellcache; c = cellcache.build('auto', 'batched', cellcache.CacheConfig("
            "capacity=8, layers=[cellcache.LayerConfig(1, 8)], max_write=4)); "
            "print(c.backend, sorted(m for m in sys.modules if m.startswith('cuda.bindings') "
            "or m.startswith('cellcache.cuda.') and m != 'cellcache.cuda.probe'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    backend, loaded = r.stdout.split(" ", 1)
    if backend == "host":            # no device: auto asked the ctypes probe alone
        assert loaded.strip() == "[]", loaded


# -- the probe, each "absent" cause simulated --------------------------------------------------

class FakeDriver:
    def __init__(self, init=0, count=1, count_code=0):
        self._init, self._count, self._count_code = init, count, count_code

    def cuInit(self, flags):
        return self._init

    def cuDeviceGetCount(self, ptr):
        ctypes.cast(ptr, ctypes.POINTER(ctypes.c_int))[0] = self._count
        return self._count_code


@pytest.fixture
def bindings_present(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(probe.importlib.util, "find_spec",
                        lambda name, *a: object() if name.startswith("cuda") else real(name, *a))


def test_probe_without_cuda_bindings(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(probe.importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("cuda") else real(name, *a))
    assert probe.cuda_usable() == (False, "cuda-bindings is not installed (pip install 'cellcache[cuda]')")


def test_probe_without_a_driver_library(monkeypatch, bindings_present):
    def missing():
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(probe, "_load_driver", missing)
    ok, why = probe.cuda_usable()
    assert not ok and why.startswith("no CUDA driver (libcuda.so.1 cannot be loaded")


@pytest.mark.parametrize("driver,why", [
    (FakeDriver(init=34), "no CUDA driver (libcuda.so.1 is the toolkit's stub)"),
    (FakeDriver(init=100), "no CUDA device"),
    (FakeDriver(count=0), "no CUDA device"),
], ids=["stub", "no-device", "zero-devices"])
def test_probe_absent_causes(monkeypatch, bindings_present, driver, why):
    monkeypatch.setattr(probe, "_load_driver", lambda: driver)
    assert probe.cuda_usable() == (False, why)


@pytest.mark.parametrize("driver,match", [
    (FakeDriver(init=999), "cuInit failed with CUresult 999"),
    (FakeDriver(count_code=3), "cuDeviceGetCount failed with CUresult 3"),
], ids=["init-fails", "count-fails"])
def test_probe_other_failures_raise(monkeypatch, bindings_present, driver, match):
    monkeypatch.setattr(probe, "_load_driver", lambda: driver)
    with pytest.raises(CudaError, match=match):
        probe.cuda_usable()


def test_probe_present(monkeypatch, bindings_present):
    monkeypatch.setattr(probe, "_load_driver", lambda: FakeDriver(count=2))
    assert probe.cuda_usable() == (True, "")


def test_auto_follows_the_probe(monkeypatch):
    monkeypatch.setattr(probe, "cuda_usable", lambda: (False, "no CUDA device"))
    assert resolve_backend("auto") == "host"
    monkeypatch.setattr(probe, "cuda_usable", lambda: (True, ""))
    assert resolve_backend("auto") == "cuda"


def test_canonical_ptx_ignores_register_numbers_and_nothing_else():
    b = load_build_ptx()
    one = (b".visible .entry f(\n.reg .f32 %f<9>;\nmov.f32 %f5, 0f0;\n"
           b"add.f32 %f6, %f5, %f5;\nst.f32 [%rd1], %f6;\n}")
    two = (b".visible .entry f(\n.reg .f32 %f<7>;\nmov.f32 %f3, 0f0;\n"
           b"add.f32 %f4, %f3, %f3;\nst.f32 [%rd1], %f4;\n}")
    assert b.canonical(one) == b.canonical(two)
    assert b.canonical(one) != b.canonical(two.replace(b"add.f32", b"sub.f32"))
    assert b.canonical(one) != b.canonical(two.replace(b"%f4, %f3, %f3", b"%f4, %f3, %f4"))


def test_ptx_check_rebuilds_and_notices_a_changed_instruction(tmp_path):
    b = load_build_ptx()
    if b.find_nvrtc() is None:
        pytest.skip("the pinned NVRTC is not installed (tools/test.sh installs it)")
    import hashlib

    tree = _tree_copy(tmp_path)
    ptx = tree / "cellcache" / "ptx" / "step.ptx"
    text = ptx.read_bytes().replace(b"add.s64", b"sub.s64", 1)
    ptx.write_bytes(text)
    manifest = json.loads((tree / "cellcache" / "ptx" / "manifest.json").read_text())
    manifest["kernels"]["step"]["ptx_sha256"] = hashlib.sha256(text).hexdigest()
    (tree / "cellcache" / "ptx" / "manifest.json").write_text(json.dumps(manifest))
    r = subprocess.run([sys.executable, str(tree / "tools" / "build_ptx.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "rebuilding step.cu with nvrtc 12.0.140 gives different PTX" in r.stderr
