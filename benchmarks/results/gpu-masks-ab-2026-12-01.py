"""A/B of step PTX variants in one process (the script behind gpu-masks-ab-s11-*.json): the
device time of one step (events around prepare_step, queued behind a spin) at three bit-mask
shapes, each variant with its own cache filled alike, rounds interleaved. Run from the
repository root on the GPU machine: python3 <this file> out.json a.ptx b.ptx ..."""
import json
import statistics
import sys

import numpy as np

sys.path.insert(0, "tools")
import bench_gpu as B  # noqa: E402

from cellcache.cuda import CudaCellCache
from cellcache.cuda import driver as drv
from cellcache.cuda.driver import Context, check, cu

check(cu.cuInit(0), "cuInit")
ctx = Context(0)
cur = {"ptx": None}
orig = drv.load_module
def load(name):
    if name != "step" or cur["ptx"] is None:
        return orig(name)
    data = open(cur["ptx"], "rb").read() + b"\0"
    image = np.frombuffer(data, dtype=np.uint8)
    return check(cu.cuModuleLoadData(image.ctypes.data), "load")
drv.load_module = load
stream = int(check(cu.cuStreamCreate(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)), "cuStreamCreate"))
ts = B.spin_stream(stream)
ev = B.Events()
variants = sys.argv[2:]
def make(ptx, width, read_len, n_windows, max_seqs, n_live, fmt, seed):
    cur["ptx"] = ptx
    cfg = B.step_config(width, read_len, n_windows, max_seqs, fmt)
    cache = CudaCellCache(cfg)
    cur["ptx"] = None
    seqs = B.fill_to(cache, read_len - width, n_live, np.random.default_rng(seed))
    return cache, seqs
out = {}
CASES = [(64, 1 << 20, 2, 64, 64, "bits"), (64, 1 << 20, 2, 1024, 256, "bits"),
         (64, 131072, 2, 1024, 256, "bits")]
for case in CASES:
    caches = [make(v, *case, seed=1) for v in variants]
    res = {v: [] for v in variants}
    rng = np.random.default_rng(2)
    for _round in range(6):
        for v, (cache, seqs) in zip(variants, caches):
            for i in range(23):
                us = B.device_step_us(cache, [int(x) for x in rng.choice(seqs, size=case[0])],
                                      stream, ts, ev)
                if i >= 3:
                    res[v].append(us)
    for cache, _ in caches:
        cache.close()
    name = "_".join(map(str, case))
    out[name] = {v: statistics.median(x) for v, x in res.items()}
    print(name, {v.split("/")[-1]: round(statistics.median(x), 2) for v, x in res.items()}, flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
