"""How fast each of the machine's vCPUs runs pure Python, over time: bench_serve's CPU probe
(median of 7 runs of a fixed piece of list and dict work) on every vCPU in turn (the
process pinned to it), round after round, with the guest's steal time from /proc/stat.
``python3 benchmarks/results/cpuscan-s13-2026-12-01.py [seconds]`` prints about 20 rounds'
min / median / max over the vCPUs and writes every reading to ``$OUT/cpuscan.json``."""
import json
import os
import statistics
import sys
import time


def work():
    xs = []
    d = {}
    for i in range(4000):
        xs.append(i)
        d[i & 63] = i
    return len(xs)


def probe(n=7):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        work()
        ts.append(time.perf_counter() - t)
    return round(1e6 * statistics.median(ts), 1)


def stat():
    """Per-CPU jiffies: user nice system idle iowait irq softirq steal."""
    with open("/proc/stat") as f:
        rows = (line.split() for line in f)
        return {p[0]: [int(x) for x in p[1:9]] for p in rows if p[0].startswith("cpu")}


cpus = sorted(os.sched_getaffinity(0))
res = {"cpus": cpus, "rounds": []}
s0 = stat()
t0 = time.time()
dur = float(sys.argv[1]) if len(sys.argv) > 1 else 40
while time.time() - t0 < dur:
    row = {}
    for c in cpus:
        os.sched_setaffinity(0, {c})
        row[c] = probe()
    s1 = stat()
    steal = s1["cpu"][7] - s0["cpu"][7]
    busy = sum(s1["cpu"][:3]) - sum(s0["cpu"][:3])
    s0 = s1
    res["rounds"].append({"t": round(time.time() - t0, 1), "probe": row, "steal": steal, "busy": busy,
                          "load": open("/proc/loadavg").read().split()[:3]})
os.sched_setaffinity(0, set(cpus))
for r in res["rounds"][::max(1, len(res["rounds"]) // 20)]:
    v = list(r["probe"].values())
    print(r["t"], "steal", r["steal"], "min/med/max", min(v), statistics.median(v), max(v), flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "cpuscan.json"), "w") as f:
    json.dump(res, f)
