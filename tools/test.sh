#!/usr/bin/env bash
# The project's test command (README, .ci/run). What a newcomer gets, from scratch:
#   1. a fresh virtual environment, everything installed from the project's own files
#      (pip install -e '.[test,hf]'), newest packages, except that torch is pinned to a
#      CPU build where pip's find-links offer one for this Python (the tests need torch
#      only on the CPU; a CUDA build from the index is several GB);
#   2. the linters the project configures: ruff, mypy on the package, cython-lint on pyx/;
#   3. pytest, every test once; among them the shipped PTX rebuilt with the pinned NVRTC and
#      compared (tests/test_cuda_host_side.py, through tools/build_ptx.py --check; the
#      compiler required on Linux x86_64, where its wheel exists);
#   4. pytest again, the tests marked ``cython`` (tests/conftest.py: those whose subject is
#      the compiled code), against a bounds-checked build of the Cython extensions
#      (CELLCACHE_CYTHON_DEBUG=1: bounds checks and the table's assumption checks).
# GPU tests skip where there is no cuda-bindings, driver or device. 13 to 26 minutes on a
# 2-core machine (docs/design/testing.md), most of it the first pass.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
venv=${CELLCACHE_TEST_VENV:-$work/venv}

echo "== fresh virtual environment in $venv"
python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
python -m pip install -q --upgrade pip
constraints="$work/constraints.txt"
python - "$constraints" <<'PY'
"""Writes torch==V+cpu when a find-links folder holds a CPU wheel of torch for this Python."""
import os, subprocess, sys
from pathlib import Path
from pip._vendor.packaging.tags import sys_tags
from pip._vendor.packaging.utils import parse_wheel_filename
cfg = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
folders = os.environ.get("PIP_FIND_LINKS", "").split()
for line in cfg.splitlines():
    key, _, value = line.partition("=")
    if key.endswith("find-links"):
        folders += value.strip("'\"").split()
ours, best = set(sys_tags()), None
for folder in folders:
    folder = folder.removeprefix("file://")
    for whl in Path(folder).glob("torch-*+cpu-*.whl") if os.path.isdir(folder) else []:
        name, version, _, tags = parse_wheel_filename(whl.name)
        if tags & ours and (best is None or version > best):
            best = version
Path(sys.argv[1]).write_text(f"torch=={best}\n" if best else "")
print(f"torch: {'the local CPU build ' + str(best) if best else 'newest from the index'}")
PY
python -m pip install -q -c "$constraints" -e '.[test,hf]'
python -m pip list --format=freeze | grep -iE '^(numpy|cython|torch|transformers|cuda-bindings|hypothesis|ml.dtypes)=' || true

echo "== linters"
ruff check .
mypy
cython-lint pyx

echo "== tests"
if [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then export CELLCACHE_REQUIRE_NVRTC=1; fi
python -m pytest -q -p no:cacheprovider

echo "== bounds-checked build (CELLCACHE_CYTHON_DEBUG=1)"
mkdir -p "$work/tree"
git ls-files -z | xargs -0 -I{} cp --parents {} "$work/tree"
cd "$work/tree"
CELLCACHE_CYTHON_DEBUG=1 python setup.py -q build_ext --inplace >/dev/null
python -c 'import cellcache, os; assert os.path.dirname(cellcache.__file__).startswith(os.getcwd()), cellcache.__file__'
CELLCACHE_MACHINE_EXAMPLES=${CELLCACHE_DEBUG_EXAMPLES:-200} python -m pytest -q -p no:cacheprovider -m cython
cd "$root"
