#!/usr/bin/env python3
"""Shared-prefix (cascade) attention against the same launch without grouping, side by side
in one run: the tensor-core kernels over decode steps whose rows share leading cells.

::

    python3 tools/bench_cascade.py                  # every case, 24 layers a step
    python3 tools/bench_cascade.py --layers 1 --reps 50

Each case builds one CUDA cache whose sequences are families (a root of ``shared`` tokens,
forked ``per`` times at its end, each fork then given its own tokens, uniform in
``own``), one decode step of every fork in family order, random pools and q in bf16, and
times a CUDA graph of ``--layers`` attention launches (the first finds the step's shares
and plans the step, the others reuse both: a served step's attention) with grouping off and on
(``cascade=cellcache.torch.CASCADE_MIN_SHARED``), by CUDA events around each replay,
alternating, the median of ``--reps``. The largest |difference| between the two outputs is
printed beside them (each is checked against a float64 reference by
tests/gpu/test_cascade_gpu.py). Cases: the shared-prompt workload's decode step (512 rows
of 2048 shared + 128-256 own) at Qwen2-0.5B's and Llama-3.1-8B's heads, a GRPO-like step
(64 prompts of 1024 x 16 samples, 0-512 own), and a step where nothing is shared (what
grouping costs when it finds nothing). Prints a table and writes JSON.
"""

from __future__ import annotations

import json
import statistics
import sys

import numpy as np
from _common import RESULTS, log, require_gpu, run_record

from cellcache._cli import Parser, in_range, output_file, run_main

#: (name, families, forks a family, shared tokens, own tokens (lo, hi), q heads, kv heads, head_dim)
CASES = (
    ("shared prompt 512 x (2048 + 128-256), 14q/2kv d64 (Qwen2-0.5B)", 1, 512, 2048, (128, 256), 14, 2, 64),
    ("shared prompt 512 x (2048 + 128-256), 32q/8kv d128 (Llama-3.1-8B)", 1, 512, 2048, (128, 256),
     32, 8, 128),
    ("GRPO-like 64 x 16 x (1024 + 0-512), 14q/2kv d64", 64, 16, 1024, (1, 512), 14, 2, 64),
    ("nothing shared 256 x 512-768, 14q/2kv d64", 256, 1, 0, (512, 768), 14, 2, 64),
)


def case(name, families, per, shared, own, H, Hkv, D, layers, reps, rng) -> dict:
    import torch

    import cellcache.torch as cct
    from cellcache import CacheConfig, LayerConfig
    from cellcache.cuda.backend import CudaCellCache
    from cellcache.cuda.tc import TensorCoreAttention

    rows = families * per
    owns = rng.integers(own[0], own[1] + 1, size=rows)
    cap = families * shared + int(owns.sum()) + rows + 64
    cfg = CacheConfig(capacity=cap, layers=[LayerConfig(Hkv, D)], max_write=max(rows, 1024),
                      initial_capacity=cap, dtype="bfloat16", max_seqs=rows + families + 2, paged=True,
                      mask_format="none", max_kv=rows * (shared + 1) + int(owns.sum()) + 64)
    cache = CudaCellCache(cfg)
    t = cache.table
    seqs = []
    for _ in range(families):
        root = t.seq_new()
        left = shared
        while left:
            n = min(left, 1024)
            assert t.declare_step([root] * n)
            t.place()
            left -= n
        if shared:
            seqs += [t.seq_clone(root) for _ in range(per)]
            t.seq_rm(root)
        else:
            seqs.append(root)
    left = {s: int(n) for s, n in zip(seqs, owns)}
    while any(left.values()):                          # interleaved: own cells spread out
        for s in rng.permutation(seqs):
            n = min(left[int(s)], int(rng.integers(16, 128)))
            if n:
                assert t.declare_step([int(s)] * n)
                t.place()
                left[int(s)] -= n
    assert cache.declare_step([int(s) for s in seqs])
    cache.prepare_step()
    cache.commit_step()
    view = cct.TorchView(cache)
    k, v, _ = view.layer(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    k.copy_(torch.randn(k.shape, generator=gen, device="cuda"))
    v.copy_(torch.randn(v.shape, generator=gen, device="cuda"))
    q = torch.randn((rows, H, D), generator=gen, device="cuda").bfloat16()
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    tc = TensorCoreAttention("bfloat16", sm)
    stream = torch.cuda.Stream()
    strides = (H * D, D)
    outs = {"off": torch.empty_like(q), "on": torch.empty_like(q)}
    cascade = cct.CASCADE_MIN_SHARED

    def step(side):
        for layer in range(layers):
            tc.run(view.paged_pointers(), rows, q.data_ptr(), strides, k.data_ptr(), v.data_ptr(),
                   outs[side].data_ptr(), strides, H, Hkv, D, 0, stream.cuda_stream, decode=True,
                   cascade=cascade if side == "on" else 0, share=layer == 0, fresh=layer == 0)

    graphs = {}
    for side in outs:
        with torch.cuda.stream(stream):
            step(side)                                 # scratch allocated outside the capture
        stream.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            step(side)
        graphs[side] = g
    header = tc.plan_header()
    times: dict[str, list[float]] = {s: [] for s in graphs}
    for i in range(reps + 2):
        for side in (("off", "on") if i % 2 == 0 else ("on", "off")):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                a.record()
                graphs[side].replay()
                b.record()
            b.synchronize()
            if i >= 2:
                times[side].append(a.elapsed_time(b) / layers)
    diff = float((outs["on"].float() - outs["off"].float()).abs().max())
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    entries = int(view.paged["kv_indptr"][rows].item())
    res = {"case": name, "rows": rows, "heads": [H, Hkv, D], "kv_entries": entries,
           "shared_per_family": shared, "off_ms": off, "on_ms": on, "on_vs_off": on / off,
           "off_TBps": entries * Hkv * D * 4 / (off * 1e-3) / 1e12, "max_abs_diff": diff,
           "grouped": header["grouped"], "shared_units": header["shared_units"],
           "own_units": header["units"]}
    log(f"[cascade] {name}: off {off:.3f} ms, on {on:.3f} ms a layer ({on / off:.2f}x), "
        f"max |diff| {diff:.2e}, plan {header}")
    del graphs
    tc.close()
    cache.close()
    return res


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="bench_cascade", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=in_range(1, 128), default=24, help="attention launches a graph (a step)")
    p.add_argument("--reps", type=in_range(3, 500), default=20, help="timed replays a side (median)")
    p.add_argument("--only", default="", help="comma-separated case numbers (1-based) to run")
    p.add_argument("--json", type=output_file, default=None, help="default benchmarks/results/cascade.json")
    args = p.parse_args(argv)
    words = [x for x in args.only.split(",") if x]
    if not all(x.isdigit() and 1 <= int(x) <= len(CASES) for x in words):
        p.error(f"--only {args.only!r}: comma-separated case numbers from 1 to {len(CASES)}")
    only = {int(x) for x in words}
    if (code := require_gpu("bench_cascade")) is not None:
        return code
    rng = np.random.default_rng(0)
    out = {**run_record("cascade", ["python3", "tools/bench_cascade.py", *(argv or sys.argv[1:])], "cuda"),
           "layers": args.layers, "reps": args.reps, "cases": []}
    path = args.json or RESULTS / "cascade.json"
    for i, c in enumerate(CASES, 1):
        if only and i not in only:
            continue
        out["cases"].append(case(*c, args.layers, args.reps, rng))
        path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"{'case':<70} {'off ms':>8} {'on ms':>8} {'on/off':>7} {'max |diff|':>11}")
    for r in out["cases"]:
        print(f"{r['case']:<70} {r['off_ms']:>8.3f} {r['on_ms']:>8.3f} {r['on_vs_off']:>6.2f}x "
              f"{r['max_abs_diff']:>11.2e}")
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main("bench_cascade", main))
