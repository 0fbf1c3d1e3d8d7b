#!/usr/bin/env bash
# Everything the GPU issues need seen on the device machine, in one call:
#   build in place, GPU tests, the CPU suite under the device's Python, the GPU benchmark.
# Logs go to $OUT (or ./gpu-out); usage: bash tools/gpu_check.sh [--no-bench] [pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
bench=1
if [ "${1:-}" = "--no-bench" ]; then bench=0; shift; fi
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, numpy, Cython; print(sys.version.split()[0], numpy.__version__, Cython.__version__)'
} 2>&1 | tee "$out/env.log"
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3 | tee "$out/build.log" || exit 1
python3 -m pytest -q -m gpu tests/gpu "$@" 2>&1 | tee "$out/gpu-tests.log"
rc=${PIPESTATUS[0]}
python3 -m pytest -q -p no:cacheprovider tests --ignore=tests/gpu --deselect tests/test_stubs.py 2>&1 | tail -3 | tee "$out/cpu-tests.log"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
if [ "$bench" = 1 ]; then
  python3 tools/bench.py --section gpu --reps 100 --json "$out/gpu-bench.json" 2>&1 | tee "$out/bench.log"
fi
exit "$rc"
