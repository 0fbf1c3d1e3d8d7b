"""Where the masks step's device time goes (the script that wrote gpu-masks-profile-*-2026-12-01.json,
run from the repository root on the H200 as `python3 <this file> out.json`): kernel
durations and the gap between them from CUPTI (torch.profiler) for the minimal step and the
bit-mask 1M cases of `tools/bench.py --section gpu` (its `measure`), and the event-timing
floor of 0, 1 and 2 tiny kernels queued behind a spin."""
import json
import statistics
import sys

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from cellcache.cuda.driver import Context, check, cu

sys.path.insert(0, "tools")
import bench_gpu as B  # noqa: E402

check(cu.cuInit(0), "cuInit")
ctx = Context(0)
stream = int(check(cu.cuStreamCreate(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)), "cuStreamCreate"))
ts = torch.cuda.ExternalStream(stream)
rng = np.random.default_rng(0)
med = statistics.median
res = {}
# the event floor: n tiny kernels between two events, queued behind a spin
x = torch.zeros(1, device="cuda")
ev = B.Events()
for n in (0, 1, 2):
    t = []
    for i in range(60):
        B.hold(ts)
        check(cu.cuEventRecord(ev.a, stream), "rec")
        with torch.cuda.stream(ts):
            for _ in range(n):
                x.add_(1)
        check(cu.cuEventRecord(ev.b, stream), "rec")
        if i >= 10:
            t.append(ev.elapsed_us())
    res[f"event_floor_{n}_kernels_us"] = med(t)
    print(f"{n} tiny kernels between events behind a spin: {med(t):.2f} us", flush=True)
cases = {"minimal": ((1, 64, 1, 64, 1), "bool"), "bits1m": ((64, 1 << 20, 2, 64, 64), "bits"),
         "bits1m_1024": ((64, 1 << 20, 2, 1024, 256), "bits"),
         "bool128k": ((64, 131072, 2, 1024, 256), "bool")}
for name, (args, fmt) in cases.items():
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        r = B.measure(*args, reps=40, stream=stream, rng=rng, fmt=fmt, baseline=False)
    ks = sorted([(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA], key=lambda k: k[0])
    apply_d, build_d, gap, span = [], [], [], []
    for i, (s, e, n) in enumerate(ks):
        if n.startswith("apply_step") and i + 1 < len(ks) and ks[i + 1][2].startswith("build_step"):
            s2, e2, _ = ks[i + 1]
            apply_d.append(e - s)
            build_d.append(e2 - s2)
            gap.append(s2 - e)
            span.append(e2 - s)
    names = sorted({n for _, _, n in ks})
    row = {"event_device_us": r["device_us"], "n": len(apply_d),
           "apply_us": med(apply_d) if apply_d else None,
           "build_us": med(build_d) if build_d else None, "gap_us": med(gap) if gap else None,
           "span_us": med(span) if span else None, "kernels": names}
    res[name] = row
    print(name, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
with open(sys.argv[1], "w") as f:
    json.dump(res, f, indent=1)
