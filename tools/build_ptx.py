#!/usr/bin/env python3
"""Build cuda/*.cu to PTX in cellcache/ptx/ and write the manifest; or check them.

  python3 tools/build_ptx.py            build (needs nvcc)
  python3 tools/build_ptx.py --check    exit 1 if the shipped PTX does not match the sources:
                                        source hashes always; the PTX bytes too when the local
                                        nvcc is the one recorded in the manifest
  python3 tools/build_ptx.py --if-stale build only when a source hash differs (setup.py)

The manifest records, per kernel file, the source's sha256, the PTX's sha256, the nvcc
version and the target, so a driver that cannot load the PTX can be named in the error.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "cuda"
OUT = ROOT / "cellcache" / "ptx"
TARGET = "compute_80"
FLAGS = ["-ptx", f"-arch={TARGET}", "-O3", "-std=c++17"]   # no -lineinfo: it embeds the absolute path


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release ([0-9.]+), V([0-9.]+)", out)
    return m.group(2) if m else out.strip().splitlines()[-1]


def compile_one(nvcc: str, src: Path, dst: Path) -> None:
    subprocess.run([nvcc, *FLAGS, str(src), "-o", str(dst)], check=True)


def sources() -> list[Path]:
    return sorted(SRC.glob("*.cu"))


def build(nvcc: str, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    version = nvcc_version(nvcc)
    kernels = {}
    for src in sources():
        dst = out_dir / (src.stem + ".ptx")
        compile_one(nvcc, src, dst)
        ptx = dst.read_bytes()
        m = re.search(rb"^\.version ([0-9.]+)", ptx, re.M)
        kernels[src.stem] = {
            "source": f"cuda/{src.name}",
            "source_sha256": sha256(src.read_bytes()),
            "ptx_sha256": sha256(ptx),
            "ptx_isa": m.group(1).decode() if m else "unknown",
        }
        print(f"build_ptx: {src.name} -> {dst.relative_to(out_dir.parent.parent) if out_dir == OUT else dst.name}")
    manifest = {"nvcc": version, "target": TARGET, "flags": FLAGS,
                "min_driver_cuda": driver_for_isa(kernels), "kernels": kernels}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def driver_for_isa(kernels: dict) -> str:
    """The CUDA version whose driver first loads the newest PTX ISA here (ISA 9.0: CUDA 13.0)."""
    isa = max((k["ptx_isa"] for k in kernels.values()), default="0.0")
    major, minor = (int(x) for x in isa.split("."))
    if major >= 9:
        return f"{major + 4}.{minor}"      # ISA 9.x ships with CUDA 13.x
    return f"12.{minor}" if major == 8 else "11.0"


def check(nvcc: str | None) -> list[str]:
    problems = []
    manifest_path = OUT / "manifest.json"
    if not manifest_path.exists():
        return ["cellcache/ptx/manifest.json is missing: run tools/build_ptx.py"]
    manifest = json.loads(manifest_path.read_text())
    names = {src.stem for src in sources()}
    if names != set(manifest["kernels"]):
        problems.append(f"kernel files {sorted(names)} != manifest {sorted(manifest['kernels'])}")
    for src in sources():
        entry = manifest["kernels"].get(src.stem)
        if entry is None:
            continue
        if sha256(src.read_bytes()) != entry["source_sha256"]:
            problems.append(f"{src.name} changed since its PTX was built: run tools/build_ptx.py")
        ptx = OUT / f"{src.stem}.ptx"
        if not ptx.exists() or sha256(ptx.read_bytes()) != entry["ptx_sha256"]:
            problems.append(f"{ptx.name} does not match the manifest")
    if nvcc and not problems and nvcc_version(nvcc) == manifest["nvcc"]:
        with tempfile.TemporaryDirectory() as tmp:
            for src in sources():
                dst = Path(tmp) / (src.stem + ".ptx")
                compile_one(nvcc, src, dst)
                if dst.read_bytes() != (OUT / dst.name).read_bytes():
                    problems.append(f"{dst.name}: rebuilding {src.name} gives different PTX")
    return problems


def stale() -> bool:
    try:
        manifest = json.loads((OUT / "manifest.json").read_text())
    except (OSError, ValueError):
        return True
    return any(
        manifest["kernels"].get(src.stem, {}).get("source_sha256") != sha256(src.read_bytes())
        for src in sources())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true", help="verify the shipped PTX against cuda/*.cu")
    g.add_argument("--if-stale", action="store_true", help="build only if a source changed")
    p.add_argument("--nvcc", default=shutil.which("nvcc"), help="nvcc to use (default: from PATH)")
    args = p.parse_args(argv)
    if args.check:
        problems = check(args.nvcc)
        for msg in problems:
            print(f"build_ptx --check: {msg}", file=sys.stderr)
        if not problems:
            print("build_ptx --check: shipped PTX matches cuda/*.cu")
        return 1 if problems else 0
    if args.if_stale and not stale():
        return 0
    if not args.nvcc:
        print("build_ptx: nvcc not found; the shipped PTX is used as it is", file=sys.stderr)
        return 0 if args.if_stale else 1
    build(args.nvcc, OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
