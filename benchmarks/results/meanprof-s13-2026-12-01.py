"""Where the MEAN host time of a decode step goes (issue #20), default serving workload on
the GPU (eager or compiled, async, prefix cache on): each function below, timed by a
perf_counter wrapper (~0.3 us a call of its own), totalled over the run's decode regime
(from the first step with no prompt left to read) and divided by the decode steps.

Run from the repository root (or from a copy of another tree's Python, to compare):
``REPS=2 python3 benchmarks/results/meanprof-s13-2026-12-01.py [compile] [tag]``. Prints the
phase means and medians and the functions' us a step; writes ``$OUT/meanprof-<tag>.json``."""
import gc
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, "tools")
import bench_serve as BS  # noqa: E402

from cellcache import cache as C  # noqa: E402
from cellcache import hf as H  # noqa: E402
from cellcache import prefix as P  # noqa: E402
from cellcache.cuda import backend as CB  # noqa: E402
from cellcache.generate import Sampling, random_model  # noqa: E402
from cellcache.generate import engine as E  # noqa: E402
from cellcache.generate import sampler as SM  # noqa: E402
from cellcache.generate import scheduler as S  # noqa: E402

comp = "compile" in sys.argv
tag = sys.argv[-1] if len(sys.argv) > 1 and sys.argv[-1] != "compile" else "x"
w = dict(BS.WORKLOADS["default"], max_batch_tokens=8192, prefill_chunk=2048, async_steps=None,
         compile=comp, attention="auto")
model = random_model("qwen2-0.5b", torch.bfloat16, "cuda", 0)
work = BS.build_workload("default", w, model.config.vocab_size, 0)
cap = 256 * (512 + 256) + 4096
BS.ours(model, work["prompts"][:8], 8, "together", cap, w, "cuda")   # warm-up: kernels
spent: dict[str, list[float]] = defaultdict(list)   # each timed call's seconds, by function
on = [False]
# the interpreter's collections in the window: (steps landed before it, generation, us)
collections: list[tuple[int, int, float]] = []
gc_t0 = [0.0]
step_log: list[list] = [[]]           # the run's step log (steps landed so far)


def on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        gc_t0[0] = time.perf_counter()
    else:
        collections.append((len(step_log[0]), info["generation"],
                            round(1e6 * (time.perf_counter() - gc_t0[0]), 1)))


def wrap(cls, name):
    f = getattr(cls, name)
    label = f"{cls.__name__}.{name}"

    def timed(*a, **k):
        if not on[0]:
            return f(*a, **k)
        t0 = time.perf_counter()
        out = f(*a, **k)                  # (a call that raises is left out of the totals)
        spent[label].append(time.perf_counter() - t0)
        return out
    setattr(cls, name, timed)


for cls, names in [
        (S.Scheduler, ["schedule_decode", "_steady_decode", "_steady_less", "apply_decode", "_apply_steady",
                       "count_step", "drop_ended", "_flush_held", "finish", "free", "tokens_of", "sync",
                       "_end_rows", "_finish_held", "_let_go", "_ended"]),
        (P.PrefixCache, ["give", "unpin", "give_lent"]),
        (C.CellCache, ["declare_step", "prepare_step", "_plan_step", "commit_step"]),
        (CB.CudaCellCache, ["_write_step"]),
        (H.ModelRunner, ["forward", "_replay", "_launch"]),
        (torch.cuda.CUDAGraph, ["replay"]),
        (SM.Sampler, ["launch", "_copy_out", "_copy_greedy"]),
        (SM.Draw, ["result"]),
        (E.Generator, ["_fed", "_launch", "_land", "_step_ahead", "_book"])]:
    for n in names:
        if hasattr(cls, n):
            wrap(cls, n)
out = {}
for rep in range(int(os.environ.get("REPS", "2"))):
    gen = BS.make_gen(model, w, True, cap, 256 + 8)
    for p in work["prompts"]:
        gen.add(p, Sampling(max_new_tokens=256))
    probe0 = BS.cpu_probe()
    while gen.waiting or any(len(s.tokens) - s.in_cache > 1 for s in gen.running):
        gen.step()
    gen.step_log = []
    spent.clear()
    collections.clear()
    step_log[0] = gen.step_log
    gc.callbacks.append(on_gc)
    on[0] = True
    t0 = time.perf_counter()
    while gen.step():
        pass
    torch.cuda.synchronize()
    on[0] = False
    gc.callbacks.remove(on_gc)
    wall = time.perf_counter() - t0
    acc = {k: sum(v) for k, v in spent.items()}
    calls = {k: len(v) for k, v in spent.items()}
    dec = [p for k, n, p in gen.step_log if k == "decode"]
    nd = len(dec)
    ph = [k for k in dec[0] if k != "wait"]
    tot = [1e6 * sum(p[k] for k in ph) for p in dec]
    r = {"probe": [probe0, BS.cpu_probe()], "decode_steps": nd,
         "mixed_in_window": sum(k != "decode" for k, _, _ in gen.step_log),
         "mean": round(statistics.mean(tot), 1), "median": round(statistics.median(tot), 1),
         "phase_mean": {k: round(1e6 * sum(p[k] for p in dec) / nd, 1) for k in ph},
         "phase_median": {k: round(1e6 * statistics.median(p[k] for p in dec), 1) for k in ph},
         "wall_ms": round(1e3 * wall, 1),
         "gc": list(collections),
         "fn_us_per_step": {k: round(1e6 * v / nd, 1) for k, v in sorted(acc.items(), key=lambda kv: -kv[1])},
         "fn_us_per_call": {k: round(1e6 * v / calls[k], 1) for k, v in acc.items()},
         "fn_calls": dict(calls)}
    print(f"[{tag} rep {rep}] driver_replays {getattr(gen.runner, 'driver_replays', None)} "
          f"replays {gen.runner.replays}", flush=True)
    print(f"[{tag} rep {rep}] probe {r['probe']} mean {r['mean']} median {r['median']} steps {nd}",
          flush=True)
    print("  phase_mean", r["phase_mean"])
    print("  phase_median", r["phase_median"])
    print("  gc (steps before, generation, us)", r["gc"])
    for k, v in r["fn_us_per_step"].items():
        print(f"    {k:34s} {v:7.1f} us/step  {r['fn_us_per_call'][k]:8.1f} us/call  x{calls[k]}")
    out[f"rep{rep}"] = r
    del gen
name = f"meanprof-{tag}{'-compile' if comp else ''}.json"
with open(os.path.join(os.environ.get("OUT", "."), name), "w") as f:
    json.dump(out, f, indent=1)
