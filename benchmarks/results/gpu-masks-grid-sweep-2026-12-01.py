"""Device time of one step against the mask grid's target block count (the engine's
target_blocks; 8 an SM by default), the script behind gpu-masks-grid-sweep-s11-*.json. Run
from the repository root on the GPU machine: python3 <this file> out.json"""
import json
import statistics
import sys

import numpy as np

sys.path.insert(0, "tools")
import bench_gpu as B  # noqa: E402

from cellcache.cuda import CudaCellCache
from cellcache.cuda.driver import Context, check, cu

check(cu.cuInit(0), "cuInit")
ctx = Context(0)
stream = int(check(cu.cuStreamCreate(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)), "cuStreamCreate"))
ts = B.spin_stream(stream)
rng = np.random.default_rng(0)
ev = B.Events()
out = {}
def case(width, read_len, n_windows, max_seqs, n_live, fmt, targets, rounds=4, reps=25):
    cfg = B.step_config(width, read_len, n_windows, max_seqs, fmt)
    cache = CudaCellCache(cfg)
    seqs = B.fill_to(cache, read_len - width, n_live, rng)
    eng = cache._engine
    res = {t: [] for t in targets}
    for _round in range(rounds):
        for t in targets:
            for i in range(reps + 3):
                ids = [int(x) for x in rng.choice(seqs, size=width)]
                eng.target_blocks = t
                us = B.device_step_us(cache, ids, stream, ts, ev)
                if i >= 3:
                    res[t].append(us)
    cache.close()
    name = f"{fmt}_{read_len}_{width}"
    out[name] = {t: statistics.median(v) for t, v in res.items()}
    print(name, {t: round(statistics.median(v), 2) for t, v in res.items()}, flush=True)
case(64, 1 << 20, 2, 64, 64, "bits", [512, 1024, 1056, 2048, 2560, 4096])

case(64, 1 << 20, 2, 64, 64, "bits", [512, 1056, 2048, 4096])
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=1)
