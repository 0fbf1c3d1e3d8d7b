"""In-process A/B of the serving host time (the script that wrote serve-order-ab-2026-12-01.json,
run from the repository root on the H200 as `python3 <this file> 4 out.json`, tree 1ead309):
runs alternate between variants in ONE process (one compile, one window of the machine's
state), so the host's drift hits both alike. The variants: lean steps' rows in the
scheduler's own order ("old-order": every row keeps its admission order, so rows that end
by length leave from the middle and the rest are gathered on the device) or ordered by
tokens left ("new-order", 1ead309)."""
import json
import statistics
import sys
import time

import torch

import cellcache.generate.scheduler as S
from cellcache.generate import random_model

sys.path.insert(0, "tools")
import bench_serve as B  # noqa: E402

real_left = S._left_of
VARIANTS = {"old-order": lambda: setattr(S, "_left_of", lambda s: 0),
            "new-order": lambda: setattr(S, "_left_of", real_left)}
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 4
out = sys.argv[2] if len(sys.argv) > 2 else "ab.json"
w = dict(B.WORKLOADS["default"], max_batch_tokens=8192, prefill_chunk=2048, async_steps=None,
         compile=True, attention="auto")
model = random_model("qwen2-0.5b", torch.bfloat16, "cuda", 0)
work = B.build_workload("default", w, model.config.vocab_size, 0)
cap = w["requests"] * (w["prompt_len"] + w["new_tokens"]) + 4096
B.ours(model, work["prompts"][:8], 8, "together", cap, w, "cuda")       # warm-up (compile)
res = {k: [] for k in VARIANTS}
t0 = time.time()
for rep in range(reps):
    order = list(VARIANTS) if rep % 2 == 0 else list(VARIANTS)[::-1]
    for k in order:
        VARIANTS[k]()
        r = B.ours(model, work["prompts"], w["new_tokens"], "together", cap, w, "cuda")
        d = r["decode_host_us_distribution"]
        tail = r["decode_host_costliest"]
        res[k].append({"mean": r["decode_host_us_per_step_total"], "median": d["median"],
                       "phase_median": d["phase_median"], "tok_s": r["tokens_per_s"],
                       "tail": tail[:4]})
        print(f"[{time.time()-t0:.0f}s] {k}: host mean {r['decode_host_us_per_step_total']:.0f} us, "
              f"median {d['median']:.0f}, tok/s {r['tokens_per_s']:.0f}; tail forward "
              f"{[x['forward'] for x in tail[:4]]}", flush=True)
for k, v in res.items():
    print(k, "mean of means", round(statistics.mean(x["mean"] for x in v), 1),
          "median of means", round(statistics.median(x["mean"] for x in v), 1))
json.dump(res, open(out, "w"), indent=1)
