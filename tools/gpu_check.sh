#!/usr/bin/env bash
# Everything the GPU work needs seen on the device machine, in one call:
#   build in place, the GPU tests, the graph demo in both modes, the demo on CUDA, and
#   (unless --no-bench) the GPU benchmark sections and the serving benchmark. The whole run
#   takes longer than one device call (10 minutes): with --no-bench it fits.
# Logs go to $OUT (or ./gpu-out). Usage: bash tools/gpu_check.sh [--no-bench] [pytest args]
# FlashInfer, when carried in .whl/ (wheels, or a wheel's files as .tar.xz to fit the 64 MiB
# a call carries), is installed to /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
bench=1
if [ "${1:-}" = "--no-bench" ]; then bench=0; shift; fi
mkdir -p /tmp/site
for t in .whl/*.tar.xz; do [ -e "$t" ] && tar xJf "$t" -C /tmp/site; done
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, numpy, Cython, torch; print(sys.version.split()[0], numpy.__version__, Cython.__version__, torch.__version__)'
} 2>&1 | tee "$out/env.log"
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3 | tee "$out/build.log" || exit 1
rc=0
python3 -m pytest -q -m gpu tests/gpu "$@" 2>&1 | tee "$out/gpu-tests.log"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
for mode in "" "--torch"; do
  python3 tools/capture_graph.py --steps 1000 --seed 5 --quiet $mode 2>&1 | tee -a "$out/capture-graph.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
done
for view in bool paged; do
  python3 -m cellcache demo --backend cuda --steps 200 --quiet --view $view --pad 2>&1 | tee -a "$out/demo-cuda.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
done
if [ "$bench" = 1 ]; then
  python3 tools/bench.py --section all-gpu --reps 60 --json "$out/gpu-bench.json" 2>&1 | tee "$out/bench.log"
  python3 tools/bench_serve.py --json "$out/serve.json" 2>&1 | tee "$out/serve.log"
fi
exit "$rc"
