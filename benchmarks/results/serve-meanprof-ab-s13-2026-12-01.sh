# A/B in one GPU call (issue #20): the session's starting Python (26ac58f) against the tree
# under test, eager, in processes that alternate, each one run of meanprof over one build.
# Before the call: git archive -o .gpu/base13.tar 26ac58f cellcache tools
# (the Cython extensions are the same in both trees: the base copy keeps the fresh build's)
set -x
rm -rf /tmp/base && mkdir -p /tmp/base && cp -r cellcache tools /tmp/base/ && tar -x -C /tmp/base -f .gpu/base13.tar
for i in $(seq "${PAIRS:-2}"); do
  (cd /tmp/base && REPS=1 python3 "$OLDPWD"/benchmarks/results/meanprof-s13-2026-12-01.py base$i) 2>&1 | grep -v Warn > "$OUT"/ab-base$i.log
  REPS=1 python3 benchmarks/results/meanprof-s13-2026-12-01.py new$i 2>&1 | grep -v Warn > "$OUT"/ab-new$i.log
done
