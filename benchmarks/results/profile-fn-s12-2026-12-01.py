"""Where a steady 256-row decode step's host time goes, by function (inclusive, median a
step), on the GPU: profile_serve's generator (eager or compiled, async), each function below
wrapped by a perf_counter timer (~0.3 us a call of its own)."""
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, "tools")
import profile_serve as PS  # noqa: E402

from cellcache import cache as C  # noqa: E402
from cellcache import hf as H  # noqa: E402
from cellcache.cuda import backend as CB  # noqa: E402
from cellcache.generate import engine as E  # noqa: E402
from cellcache.generate import sampler as SM
from cellcache.generate import scheduler as S

acc: dict[str, float] = defaultdict(float)
calls: dict[str, int] = defaultdict(int)


def wrap(cls, name, label=None):
    f = getattr(cls, name)
    label = label or f"{cls.__name__}.{name}"

    def w(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[label] += time.perf_counter() - t
            calls[label] += 1
    setattr(cls, name, w)


compile_ = "compile" in sys.argv
gen = PS.build(256, 400, 8, "async", "qwen2-0.5b", "cuda", compile_)
while any(len(s.tokens) - s.in_cache > 1 for s in gen.running) or gen.waiting:
    gen.step()
for _ in range(5):
    gen.step()
for cls, names in [
        (S.Scheduler, ["schedule_decode", "_steady_decode", "apply_decode", "_apply_steady",
                       "count_step", "drop_ended", "_flush_held"]),
        (C.CellCache, ["declare_step", "prepare_step", "_plan_step", "_apply_growth", "commit_step"]),
        (CB.CudaCellCache, ["_resolve_stream", "_write_step", "_commit"]),
        (H.ModelRunner, ["forward", "_replay", "_check_attached"]),
        (torch.cuda.CUDAGraph, ["replay"]),
        (SM.Sampler, ["launch", "_copy_out"]),
        (SM.Draw, ["result"]),
        (S.HoldInterrupts, ["__enter__", "__exit__"]),
        (E.Generator, ["_fed", "_drain", "_launch", "_land", "_step_ahead"])]:
    for n in names:
        wrap(cls, n)
per_step = defaultdict(list)
host = []
N = int(os.environ.get("STEPS", "300"))
gen.step_log = []
for _i in range(N):
    acc.clear()
    gen.step()
    for k, v in acc.items():
        per_step[k].append(1e6 * v)
for _kind, _n, prof in gen.step_log:
    host.append(1e6 * sum(v for k, v in prof.items() if k != "wait"))
ph = defaultdict(list)
for _kind, _n, prof in gen.step_log:
    for k, v in prof.items():
        ph[k].append(1e6 * v)
res = {"host_median": statistics.median(host), "host_mean": statistics.mean(host),
       "phases": {k: round(statistics.median(v), 1) for k, v in ph.items()},
       "functions": {k: {"median_us": round(statistics.median(v), 1), "calls_per_step": calls[k] / N}
                     for k, v in sorted(per_step.items(), key=lambda kv: -statistics.median(kv[1]))}}
print(f"compile={compile_}: host median {res['host_median']:.0f} mean {res['host_mean']:.0f}; "
      f"phases {res['phases']}")
for k, v in res["functions"].items():
    print(f"  {k:40s} {v['median_us']:8.1f} us  x{v['calls_per_step']:.2f}")
out = os.environ.get("OUT", ".")
with open(f"{out}/s12-fn-{'compile' if compile_ else 'eager'}.json", "w") as f:
    json.dump(res, f, indent=1)
