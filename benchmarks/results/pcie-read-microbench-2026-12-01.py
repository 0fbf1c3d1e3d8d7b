"""What reading mapped pinned host memory costs a kernel on the H200 (the script that wrote
pcie-read-microbench-2026-12-01.json, run from the repository root as `python3 <this file>
out.json`; needs nvcc): the kernels of pcie-read-microbench-2026-12-01.cu timed by CUPTI
(torch.profiler) and by CUDA events queued behind a spin, and a 2 KB host-to-device copy."""
import ctypes
import json
import statistics
import subprocess
import sys

import torch
from cuda.bindings import driver as cu
from torch.profiler import ProfilerActivity, profile


def ck(r):
    if isinstance(r, tuple):
        assert int(r[0]) == 0, r
        return r[1] if len(r) == 2 else r[1:]
    assert int(r) == 0, r

subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-o", "/tmp/mb.cubin",
                "benchmarks/results/pcie-read-microbench-2026-12-01.cu"], check=True)
torch.zeros(1, device="cuda")
with open("/tmp/mb.cubin", "rb") as fh:
    mod = ck(cu.cuModuleLoadData(fh.read()))
names = ["k_empty", "k_h1", "k_h4dep", "k_h4pages", "k_hpar", "k_hpar4k", "k_d4dep"]
fns = {n: ck(cu.cuModuleGetFunction(mod, n.encode())) for n in names}
host = ck(cu.cuMemHostAlloc(1 << 16, 0x01 | 0x02))
ctypes.memset(int(host), 0, 1 << 16)
hdev = int(ck(cu.cuMemHostGetDevicePointer(host, 0)))
dev = torch.zeros(1 << 14, dtype=torch.int64, device="cuda")
stream = torch.cuda.current_stream()
s = stream.cuda_stream
hp, dp = ctypes.c_uint64(hdev), ctypes.c_uint64(dev.data_ptr())
args = (ctypes.c_void_p * 2)(ctypes.addressof(hp), ctypes.addressof(dp))
dst = torch.empty(2048, dtype=torch.uint8, device="cuda")
src = torch.zeros(2048, dtype=torch.uint8).pin_memory()

def launch(n):
    ck(cu.cuLaunchKernel(fns[n], 1, 1, 1, 256, 1, 1, 0, s, ctypes.addressof(args), 0))

res = {}
for n in names + ["memcpy2k"]:
    f = (lambda: dst.copy_(src, non_blocking=True)) if n == "memcpy2k" else (lambda n=n: launch(n))
    ev = []
    for i in range(50):
        torch.cuda._sleep(1_000_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        b.synchronize()
        if i >= 10:
            ev.append(1000 * a.elapsed_time(b))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(30):
            torch.cuda._sleep(200_000)
            f()
        torch.cuda.synchronize()
    d = [e.time_range.end - e.time_range.start for e in prof.events()
         if e.device_type == torch.autograd.DeviceType.CUDA and "spin" not in e.name]
    res[n] = {"events_us": statistics.median(ev), "cupti_us": statistics.median(d) if d else None}
    print(f"{n:10s} events behind a spin {res[n]['events_us']:6.2f} us   "
          f"kernel/copy duration {res[n]['cupti_us']} us", flush=True)
with open(sys.argv[1], "w") as fh:
    json.dump(res, fh, indent=1)
