#!/usr/bin/env bash
# The project's test command (README, .ci/run): install, run the suite, then run it once more
# against a bounds-checked build of the Cython extensions (CELLCACHE_CYTHON_DEBUG=1).
# Runs on a clean clone of a machine without a GPU; GPU tests skip there.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e '.[test]'
python3 -m pytest -q

# Bounds-checked pass: build a debug copy of the extensions in a scratch tree and run the
# suite from there (the copy's own cellcache/ comes first on sys.path).
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
git ls-files -z | xargs -0 -I{} cp --parents {} "$scratch"
(
  cd "$scratch"
  echo "== bounds-checked build (CELLCACHE_CYTHON_DEBUG=1)"
  CELLCACHE_CYTHON_DEBUG=1 python3 setup.py -q build_ext --inplace >/dev/null
  python3 -c 'import cellcache, os; assert os.path.dirname(cellcache.__file__).startswith(os.getcwd()), cellcache.__file__'
  CELLCACHE_MACHINE_EXAMPLES=${CELLCACHE_DEBUG_EXAMPLES:-200} python3 -m pytest -q -p no:cacheprovider
)
