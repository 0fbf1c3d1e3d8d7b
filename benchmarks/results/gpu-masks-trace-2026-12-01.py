"""Per-block timeline of build_step_bits at the bench's 1M-cell bit-mask step (the script
behind gpu-masks-trace-s11-2026-12-01.json). Run from the repository root on the GPU machine:

    git apply benchmarks/results/gpu-masks-trace-stamps-2026-12-01.patch   # in a scratch copy
    nvcc -ptx -arch=sm_80 -Icuda cuda/step.cu -o .gpu/step_trace.ptx         # then revert
    python3 benchmarks/results/gpu-masks-trace-2026-12-01.py out.npy [target_blocks]

The stamped PTX is loaded in place of the shipped step.ptx; block b's %globaltimer at its
start, after the ids barrier, when its rows start and when they are made, and its SM, are
read back after each of 10 steps."""
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
mods = {}
orig = drv.load_module
def load(name):
    if name != "step":
        return orig(name)
    data = open(".gpu/step_trace.ptx", "rb").read() + b"\0"
    image = np.frombuffer(data, dtype=np.uint8)
    m = check(cu.cuModuleLoadData(image.ctypes.data), "load")
    mods["step"] = m
    return m
drv.load_module = load
stream = int(check(cu.cuStreamCreate(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)), "cuStreamCreate"))
ts = B.spin_stream(stream)
rng = np.random.default_rng(0)
ev = B.Events()
tb = int(sys.argv[2]) if len(sys.argv) > 2 else 0
width, read_len, n_windows, max_seqs, n_live = 64, 1 << 20, 2, 64, 64
cfg = B.step_config(width, read_len, n_windows, max_seqs, "bits")
cache = CudaCellCache(cfg)
if tb:
    cache._engine.target_blocks = tb
seqs = B.fill_to(cache, read_len - width, n_live, rng)
ptr, size = check(cu.cuModuleGetGlobal(mods["step"], b"cc_trace"), "glob")
out = []
dev = []
for i in range(30):
    ids = [int(x) for x in rng.choice(seqs, size=width)]
    dev.append(B.device_step_us(cache, ids, stream, ts, ev))
    if i >= 20:
        h = np.zeros(16384 * 5, dtype=np.uint64)
        check(cu.cuMemcpyDtoH(h.ctypes.data, ptr, h.nbytes), "dtoh")
        out.append(h.reshape(-1, 5))
print("device us median", statistics.median(dev[5:]))
nb = None
for k, h in enumerate(out):
    n = int((h[:, 0] > 0).sum()) if nb is None else nb
    nb = n
    t = h[:n].astype(np.int64)
    base = t[:, 0].min()
    rel = (t[:, :4] - base) / 1000.0
    dur = rel[:, 3] - rel[:, 0]
    med = np.median
    print(f"step {k}: blocks {n} start p50 {med(rel[:, 0]):.2f} max {rel[:, 0].max():.2f}; "
          f"t1-t0 med {med(rel[:, 1] - rel[:, 0]):.2f} t2-t1 med {med(rel[:, 2] - rel[:, 1]):.2f} "
          f"t3-t2 med {med(rel[:, 3] - rel[:, 2]):.2f}; end max {rel[:, 3].max():.2f} "
          f"p50 {med(rel[:, 3]):.2f}; dur med {med(dur):.2f} max {dur.max():.2f}")
np.save(sys.argv[1], np.stack(out))
