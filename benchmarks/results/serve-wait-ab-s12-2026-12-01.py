"""In-process A/B of how the generator waits for a step's sampled ids (runs alternate):
spin = torch's Event.synchronize (the driver's wait), poll = a Python loop on Event.query."""
import json
import os
import sys
import time

import torch

from cellcache.generate import random_model
from cellcache.generate import sampler as SM

sys.path.insert(0, "tools")
import bench_serve as B  # noqa: E402

_orig = SM.Draw.result


def poll_result(self):
    if self._out is None:
        ev = self._event
        while not ev.query():
            pass
    return _orig(self)


VARIANTS = {"spin": lambda: setattr(SM.Draw, "result", _orig),
            "poll": lambda: setattr(SM.Draw, "result", poll_result)}
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
compile_ = len(sys.argv) > 2 and sys.argv[2] == "compile"
w = dict(B.WORKLOADS["default"], max_batch_tokens=8192, prefill_chunk=2048, async_steps=None,
         compile=compile_, attention="auto")
model = random_model("qwen2-0.5b", torch.bfloat16, "cuda", 0)
work = B.build_workload("default", w, model.config.vocab_size, 0)
cap = w["requests"] * (w["prompt_len"] + w["new_tokens"]) + 4096
t0 = time.time()
B.ours(model, work["prompts"][:8], 8, "together", cap, w, "cuda")       # warm-up
print(f"[{time.time() - t0:.0f}s] warm", flush=True)
res = {k: [] for k in VARIANTS}
for rep in range(reps):
    for k in (list(VARIANTS) if rep % 2 == 0 else list(VARIANTS)[::-1]):
        VARIANTS[k]()
        r = B.ours(model, work["prompts"], w["new_tokens"], "together", cap, w, "cuda")
        VARIANTS["spin"]()
        d = r["decode_host_us_distribution"]
        res[k].append({"mean": r["decode_host_us_per_step_total"], "median": d["median"],
                       "phase_median": d.get("phase_median"), "tok_s": r["tokens_per_s"],
                       "probe": r["cpu_probe_us"]})
        print(f"[{time.time() - t0:.0f}s] {k}: host mean {r['decode_host_us_per_step_total']:.0f} us, "
              f"median {d['median']:.0f}, phases {d.get('phase_median')}, {r['tokens_per_s']:.0f} tok/s, "
              f"probe {r['cpu_probe_us']}", flush=True)
for k, v in res.items():
    print(k, "means", [round(x["mean"]) for x in v], "medians", [round(x["median"]) for x in v])
out = os.environ.get("OUT", ".")
with open(f"{out}/s12-wait.json", "w") as f:
    json.dump(res, f, indent=1)
