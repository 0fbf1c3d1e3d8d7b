#!/usr/bin/env bash
# The project's test command (README, .ci/run). What a newcomer gets, from scratch:
#   1. a fresh virtual environment, everything installed from the project's own files
#      (pip install -e '.[test,hf]'), newest packages (tools/ci-constraints.txt only steers
#      pip to the CPU build of torch where this machine image keeps one);
#   2. the linters the project configures: ruff, mypy on the package, cython-lint on pyx/;
#   3. the shipped PTX rebuilt with the pinned NVRTC and compared (tools/build_ptx.py);
#   4. pytest;
#   5. pytest again against a bounds-checked build of the Cython extensions
#      (CELLCACHE_CYTHON_DEBUG=1: bounds checks and the table's assumption checks).
# GPU tests skip where there is no cuda-bindings, driver or device.
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
python -m pip install -q -c tools/ci-constraints.txt -e '.[test,hf]'
python -m pip list --format=freeze | grep -iE '^(numpy|cython|torch|transformers|cuda-bindings|hypothesis|ml.dtypes)=' || true

echo "== linters"
ruff check .
mypy
cython-lint pyx

echo "== shipped PTX"
require=""
if [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then require="--require-compiler"; fi
python tools/build_ptx.py --check $require

echo "== tests"
python -m pytest -q -p no:cacheprovider

echo "== bounds-checked build (CELLCACHE_CYTHON_DEBUG=1)"
mkdir -p "$work/tree"
git ls-files -z | xargs -0 -I{} cp --parents {} "$work/tree"
cd "$work/tree"
CELLCACHE_CYTHON_DEBUG=1 python setup.py -q build_ext --inplace >/dev/null
python -c 'import cellcache, os; assert os.path.dirname(cellcache.__file__).startswith(os.getcwd()), cellcache.__file__'
CELLCACHE_MACHINE_EXAMPLES=${CELLCACHE_DEBUG_EXAMPLES:-200} python -m pytest -q -p no:cacheprovider
cd "$root"
