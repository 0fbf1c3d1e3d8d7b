#!/usr/bin/env python3
"""Build cuda/*.cu into the shipped PTX (cellcache/ptx/) with a pinned NVRTC, or check it.

  python3 tools/build_ptx.py            build (needs the pinned NVRTC, see below)
  python3 tools/build_ptx.py --check    exit 1 unless the shipped PTX matches the sources:
                                        source and PTX hashes, PTX ISA <= 8.0, the target
                                        (sm_80; sm_90a for *_sm90a.cu),
                                        and, where the pinned NVRTC is installed, a fresh
                                        build (compared up to register numbering)

The compiler is NVRTC 12.0.140 from the PyPI wheel ``nvidia-cuda-nvrtc-cu12==12.0.140``
(``pip install -r tools/ptx-requirements.txt``), driven through ctypes: no CUDA toolkit, no
GPU and no cuda-bindings are needed. NVRTC 12.0 emits PTX ISA 8.0, which every driver from
CUDA 12.0 (R525) on can load, for target sm_80 (Ampere and newer); a file named
``*_sm90a.cu`` holds Hopper-only kernels (wgmma, setmaxnreg) and is built for compute_90a
(target sm_90a, the same ISA 8.0). The headers the kernels
include (``cuda/*.h``) are handed to NVRTC by name, so no file system path enters the PTX,
and each file is compiled in a fresh process with address randomisation off (NVRTC 12.0 can
number virtual registers differently from run to run otherwise). The check compares a
rebuild with the shipped PTX after renumbering registers in order of appearance, so it
fails on any change of instructions, operands or control flow, and on nothing else. The
manifest records, per kernel file, the hashes of
its source (with every header) and of its PTX, the ISA, the compiler and the lowest driver.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "cuda"
OUT = ROOT / "cellcache" / "ptx"
COMPILER = "nvrtc 12.0.140"
TARGET = "compute_80"
OPTIONS = [f"--gpu-architecture={TARGET}", "--std=c++17"]
MAX_ISA = (8, 0)          # loads on every driver from CUDA 12.0 on
PTX_TARGET = "sm_80"
#: files named *<suffix>.cu: (NVRTC architecture, the PTX's .target)
ARCH_SUFFIXES = {"_sm90a": ("compute_90a", "sm_90a")}


def arch_of(src: Path) -> tuple[str, str]:
    """(NVRTC architecture, PTX target) of a kernel file: sm_80 unless its name says otherwise."""
    for suffix, arch in ARCH_SUFFIXES.items():
        if src.stem.endswith(suffix):
            return arch
    return TARGET, PTX_TARGET


def options_of(src: Path) -> list[str]:
    return [f"--gpu-architecture={arch_of(src)[0]}", *OPTIONS[1:]]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sources() -> list[Path]:
    return sorted(SRC.glob("*.cu"))


def headers() -> list[Path]:
    return sorted(SRC.glob("*.h"))


def source_hash(src: Path) -> str:
    """The hash of a kernel file and every header beside it (any header change rebuilds)."""
    h = hashlib.sha256(src.read_bytes())
    for header in headers():
        h.update(header.name.encode() + b"\0" + header.read_bytes())
    return h.hexdigest()


def driver_for_isa(isa: str) -> str:
    """The CUDA version whose driver first loads PTX of this ISA.

    ISA 7.x shipped with CUDA 11.x (7.0 with 11.0 ... 7.8 with 11.8), ISA 8.0-8.5 with CUDA
    12.0-12.4 (8.0 with 12.0, 8.1 with 12.1, 8.2 with 12.2, 8.3 with 12.3, 8.4 and 8.5 with
    12.4), 8.6 with 12.7, 8.7 with 12.8, 8.8 with 12.9, and ISA 9.0 with CUDA 13.0.
    """
    major, minor = (int(x) for x in isa.split("."))
    if major == 7:
        return f"11.{minor}"
    if major == 8:
        table = {0: "12.0", 1: "12.1", 2: "12.2", 3: "12.3", 4: "12.4", 5: "12.4", 6: "12.7",
                 7: "12.8", 8: "12.9"}
        if minor in table:
            return table[minor]
    if major == 9 and minor == 0:
        return "13.0"
    raise ValueError(f"no known CUDA release for PTX ISA {isa}")


def ptx_isa(ptx: bytes) -> str:
    m = re.search(rb"^\.version ([0-9]+\.[0-9]+)", ptx, re.M)
    return m.group(1).decode() if m else "unknown"


def ptx_target(ptx: bytes) -> str:
    m = re.search(rb"^\.target (\S+)", ptx, re.M)
    return m.group(1).decode() if m else "unknown"


def find_nvrtc() -> Path | None:
    """libnvrtc.so.12 of the pinned wheel, if installed."""
    spec = importlib.util.find_spec("nvidia.cuda_nvrtc")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        lib = Path(location) / "lib" / "libnvrtc.so.12"
        if lib.exists():
            return lib
    return None


class Nvrtc:
    """The few NVRTC calls a build needs, through ctypes."""

    def __init__(self, path: Path):
        # the builtins library is found beside libnvrtc by soname: load it first, globally
        for builtins in sorted(path.parent.glob("libnvrtc-builtins.so*")):
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
        self.path = path
        self.lib = lib = ctypes.CDLL(str(path))
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = f"{major.value}.{minor.value}"
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            msg = self.lib.nvrtcGetErrorString(code) if hasattr(self, "lib") else b"?"
            raise RuntimeError(f"{what} failed: {msg.decode() if msg else code}")

    def compile(self, src: Path) -> bytes:
        lib = self.lib
        hdrs = headers()
        prog = ctypes.c_void_p()
        names = (ctypes.c_char_p * len(hdrs))(*[h.name.encode() for h in hdrs])
        texts = (ctypes.c_char_p * len(hdrs))(*[h.read_bytes() for h in hdrs])
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), src.read_bytes(),
                                           src.name.encode(), len(hdrs), texts, names),
                    "nvrtcCreateProgram")
        try:
            options = options_of(src)
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            code = lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            if code != 0:
                raise RuntimeError(f"NVRTC could not compile {src.name}:\n{log.value.decode()}")
            self._check(lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
            ptx = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
            return ptx.raw.rstrip(b"\0")
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def compile_fresh(lib: Path, src: Path) -> bytes:
    """One file's PTX from NVRTC in a process of its own, without address randomisation."""
    # -I -S: no site-packages, no environment, so the process holds the same libraries
    # wherever it runs; env -i and setarch -R: the same addresses for them
    cmd = [sys.executable, "-I", "-S", str(Path(__file__).resolve()), "--nvrtc", str(lib),
           "--compile-one", str(src)]
    if sys.platform.startswith("linux") and shutil.which("setarch"):
        cmd = ["env", "-i", "setarch", platform.machine(), "-R", *cmd]
    r = subprocess.run(cmd, capture_output=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr.decode())
    return r.stdout


_REGISTER = re.compile(rb"%[a-z]+[0-9]+")


def canonical(ptx: bytes) -> bytes:
    """The PTX with comments and register declarations dropped and every virtual register
    renumbered in order of first appearance within its function."""
    out, names = [], {}
    for line in ptx.splitlines():
        s = line.strip()
        if not s or s.startswith(b"//") or s.startswith(b".reg "):
            continue
        if s.startswith((b".visible .entry", b".entry", b".func", b".visible .func")):
            names = {}

        def rename(m, names=names):
            return b"%v" + str(names.setdefault(m.group(0), len(names))).encode()

        out.append(_REGISTER.sub(rename, s))
    return b"\n".join(out)


def build(nvrtc: Nvrtc) -> dict:
    OUT.mkdir(parents=True, exist_ok=True)
    kernels = {}
    for src in sources():
        ptx = compile_fresh(nvrtc.path, src)
        (OUT / f"{src.stem}.ptx").write_bytes(ptx)
        kernels[src.stem] = {"source": f"cuda/{src.name}", "arch": arch_of(src)[0],
                             "source_sha256": source_hash(src),
                             "ptx_sha256": sha256(ptx), "ptx_isa": ptx_isa(ptx),
                             "ptx_target": ptx_target(ptx)}
        print(f"build_ptx: {src.name} -> cellcache/ptx/{src.stem}.ptx "
              f"(ISA {kernels[src.stem]['ptx_isa']}, {len(ptx)} bytes)")
    newest = max((k["ptx_isa"] for k in kernels.values()), key=lambda v: tuple(map(int, v.split("."))))
    # "target" / "options": every file's but those a suffix gives another arch (their "arch")
    manifest = {"compiler": COMPILER,
                "target": TARGET, "options": OPTIONS, "min_driver_cuda": driver_for_isa(newest),
                "kernels": kernels}
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def check(nvrtc: Nvrtc | None, only: set[str] | None = None) -> list[str]:
    """What is wrong with the shipped PTX (empty: nothing). The hashes, ISA and target of
    every kernel always; with ``nvrtc`` each kernel rebuilt (``only``: those stems)."""
    problems = []
    path = OUT / "manifest.json"
    if not path.exists():
        return ["cellcache/ptx/manifest.json is missing: run tools/build_ptx.py"]
    manifest = json.loads(path.read_text())
    names = {src.stem for src in sources()}
    if names != set(manifest.get("kernels", {})):
        problems.append(f"kernel files {sorted(names)} != manifest {sorted(manifest.get('kernels', {}))}")
    if manifest.get("compiler") != COMPILER:
        problems.append(f"manifest compiler {manifest.get('compiler')!r} is not the pinned {COMPILER!r}")
    for src in sources():
        entry = manifest["kernels"].get(src.stem)
        if entry is None:
            continue
        if source_hash(src) != entry["source_sha256"]:
            problems.append(f"{src.name} (or a header) changed since its PTX was built: "
                            "run tools/build_ptx.py")
        ptx_path = OUT / f"{src.stem}.ptx"
        ptx = ptx_path.read_bytes() if ptx_path.exists() else b""
        if sha256(ptx) != entry["ptx_sha256"]:
            problems.append(f"{ptx_path.name} does not match the manifest")
        isa = ptx_isa(ptx)
        if isa == "unknown" or tuple(map(int, isa.split("."))) > MAX_ISA:
            problems.append(f"{ptx_path.name} is PTX ISA {isa}; at most "
                            f"{MAX_ISA[0]}.{MAX_ISA[1]} loads on every CUDA 12 driver")
        if ptx_target(ptx) != arch_of(src)[1]:
            problems.append(f"{ptx_path.name} targets {ptx_target(ptx)}, not {arch_of(src)[1]}")
    if nvrtc is not None and not problems:
        todo = [src for src in sources() if only is None or src.stem in only]
        # one NVRTC process a file, side by side (tc_attention.cu alone takes ~15 s)
        with concurrent.futures.ThreadPoolExecutor(max(1, min(len(todo), os.cpu_count() or 1))) as pool:
            fresh = list(pool.map(lambda src: compile_fresh(nvrtc.path, src), todo))
        for src, ptx in zip(todo, fresh):
            if canonical(ptx) != canonical((OUT / f"{src.stem}.ptx").read_bytes()):
                problems.append(f"rebuilding {src.name} with {COMPILER} gives different PTX")
    return problems


class Parser(argparse.ArgumentParser):
    """cellcache._cli.Parser's one-line usage errors (exit code 2), kept here: this tool runs
    where the package's extensions are not built yet, and ``import cellcache`` needs them."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="build_ptx", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="verify the shipped PTX against cuda/*")
    p.add_argument("--nvrtc", type=Path, default=None,
                   help="libnvrtc.so.12 to use (default: the nvidia-cuda-nvrtc-cu12 wheel)")
    p.add_argument("--require-compiler", action="store_true",
                   help="with --check: fail when the pinned NVRTC is not installed")
    p.add_argument("--only", action="append", metavar="STEM",
                   help="with --check: rebuild only this kernel file (repeatable; default: all)")
    p.add_argument("--compile-one", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    lib = args.nvrtc or find_nvrtc()
    try:
        nvrtc = Nvrtc(lib) if lib else None
    except OSError as e:                      # not a library, not there, not this machine's
        p.error(f"--nvrtc {lib}: cannot load it ({e})" if args.nvrtc else f"cannot load {lib}: {e}")
    if args.compile_one:
        assert nvrtc is not None
        sys.stdout.buffer.write(nvrtc.compile(args.compile_one))
        return 0
    if nvrtc is not None and nvrtc.version != "12.0":
        print(f"build_ptx: {lib} is NVRTC {nvrtc.version}, not the pinned {COMPILER}", file=sys.stderr)
        return 1
    if args.check:
        if nvrtc is None and args.require_compiler:
            print("build_ptx --check: the pinned NVRTC is not installed "
                  "(pip install -r tools/ptx-requirements.txt)", file=sys.stderr)
            return 1
        stems = {src.stem for src in sources()}
        if args.only and not set(args.only) <= stems:
            p.error(f"--only {sorted(set(args.only) - stems)}: the kernel files are {sorted(stems)}")
        problems = check(nvrtc, set(args.only) if args.only else None)
        for msg in problems:
            print(f"build_ptx --check: {msg}", file=sys.stderr)
        if not problems:
            rebuilt = "rebuilt, same instructions" if nvrtc else "hashes only: NVRTC not installed"
            print(f"build_ptx --check: shipped PTX matches cuda/* ({rebuilt})")
        return 1 if problems else 0
    if nvrtc is None:
        print("build_ptx: the pinned NVRTC is not installed: pip install -r "
              "tools/ptx-requirements.txt", file=sys.stderr)
        return 1
    build(nvrtc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
