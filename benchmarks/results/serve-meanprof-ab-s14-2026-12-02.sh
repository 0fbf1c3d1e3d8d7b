# A/B in one GPU call (issue #20): the session's starting tree (8db971e, its own Cython build)
# against the tree under test, eager, in processes that alternate, each one run of meanprof.
# Before the call: git archive -o .gpu/base14.tar 8db971e setup.py pyproject.toml pyx cuda cellcache tools
# The base is built in /tmp/base beside the tree's own build (the Cython differs this time).
set -x
rm -rf /tmp/base && mkdir -p /tmp/base && tar -x -C /tmp/base -f .gpu/base14.tar
(cd /tmp/base && python3 setup.py -q build_ext --inplace > /tmp/base-build.log 2>&1; echo "base build rc $?")
for i in $(seq "${PAIRS:-2}"); do
  (cd /tmp/base && REPS=1 python3 "$OLDPWD"/benchmarks/results/meanprof-s13-2026-12-01.py base$i) 2>&1 | grep -v Warn > "$OUT"/ab-base$i.log
  REPS=1 python3 benchmarks/results/meanprof-s13-2026-12-01.py new$i 2>&1 | grep -v Warn > "$OUT"/ab-new$i.log
done
