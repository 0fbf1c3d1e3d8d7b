cd "$(dirname "$0")/.."
t=$(date +%s)
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "built in $(( $(date +%s) - t )) s"
timeout 100 python3 -m pytest -q tests/gpu/test_sampler_gpu.py > $OUT/gpu-tests-sampler.log 2>&1; echo "sampler tests rc $?"; tail -3 $OUT/gpu-tests-sampler.log
# base: this build's package with HEAD's three Python files
rm -rf /tmp/base && mkdir -p /tmp/base && cp -r cellcache tools /tmp/base/ && cp -r .gpu/base12/cellcache/. /tmp/base/cellcache/
python3 -c "import sys; sys.path.insert(0, '/tmp/base'); import cellcache.generate.scheduler as s, inspect; print('base ok', s.__file__, 'StepPlan.__new__' not in inspect.getsource(s))" 
B="--workload default --arrival none --skip off,hf-batch,staggered,hf-static --repeat 2"
for i in 1 2 3; do
  for v in new base; do
    if [ $v = base ]; then R=/tmp/base; else R=$PWD; fi
    timeout 150 python3 $R/tools/bench_serve.py $B --json $OUT/ab-$v$i.json > $OUT/ab-$v$i.log 2>&1
    echo "$v$i rc $? $(grep -h 'host per decode step' $OUT/ab-$v$i.log | grep -o 'host per decode step [0-9]* us' | tr '\n' ' ') $(grep -h 'median of each phase' $OUT/ab-$v$i.log | tail -1)"
    [ $(( $(date +%s) - t )) -gt 370 ] && break 2
  done
done
timeout 110 python3 -m pytest -q tests/gpu/test_hf_gpu.py > $OUT/gpu-tests-hf.log 2>&1; echo "hf tests rc $?"; tail -3 $OUT/gpu-tests-hf.log
