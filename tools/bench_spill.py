#!/usr/bin/env python3
"""Preemption with the host tier against preemption by recompute: one workload served by
two Generators in one process, the cache sized to a share of the working set, and the
copies' bandwidth against the device's measured host<->device bandwidth.

::

    python3 tools/bench_spill.py                                  # qwen2.5-0.5b, trt-1000 shape
    python3 tools/bench_spill.py --model llama-3.1-8b --requests 256
    python3 tools/bench_spill.py --device cpu --model tiny --quick   (a smoke run)

The workload is tools/bench_workloads.py's (``--workload``, ``--requests``), every request at
once, EOS ignored. The cache holds ``--share`` (default 0.5) of the working set (every
prompt and output token) and admission reserves nothing (``reserve=0``), so sequences are
admitted greedily and preempted as they grow: the preemption-heavy case. Sides, alternating
``--repeat`` times, each its median: ``recompute`` (``spill_bytes=0``: a preempted sequence
is read again) and ``spill`` (``--spill-gib`` of pinned host memory). The host tier's copy
bandwidth (bytes moved / seconds in the spill and restore copies) is printed beside a plain
pinned copy of 1 GiB each way. The spill side's figures count only when the end-to-end
agreement check passes (``tapped_run`` of tools/bench_serve.py on the spill Generator).

Targets (issue 44): spill side >= 1.5x the recompute side; the copies >= 85% of the measured
bandwidth.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, log, require_gpu, run_record
from bench_serve import not_checked, tapped_run
from bench_workloads import WORKLOADS, build_workload, load_model, serve

from cellcache._cli import Parser, in_range, output_file, run_main

TARGET_SPEEDUP = 1.5
TARGET_BANDWIDTH_SHARE = 0.85


def pinned_bandwidth(nbytes: int = 1 << 30) -> dict[str, float]:
    """Bytes a second of one pinned host -> device copy and one back, ``nbytes`` each (best
    of 3)."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        out[name] = nbytes / best
    return out


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="bench_spill", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="trt-1000")
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--requests", type=in_range(1, 1 << 20), default=256)
    p.add_argument("--share", type=float, default=0.5, help="the cache's share of the working set")
    p.add_argument("--spill-gib", type=float, default=32.0, help="the spill side's host memory, GiB")
    p.add_argument("--repeat", type=in_range(1, 9), default=1, help="runs of each side, alternating")
    p.add_argument("--check-requests", type=in_range(1, 1 << 16), default=4)
    p.add_argument("--no-check", action="store_true", help="skip the agreement check (figures do not count)")
    p.add_argument("--quick", action="store_true", help="lengths divided by 16: a smoke run")
    p.add_argument("--seed", type=in_range(0, 2**31 - 1), default=0)
    p.add_argument("--json", type=output_file, default=None,
                   help="default benchmarks/results/spill-<model>.json")
    args = p.parse_args(argv)
    if not 0 < args.share <= 1:
        p.error(f"--share {args.share} is outside (0, 1]")
    if not 0 < args.spill_gib <= 4096:
        p.error(f"--spill-gib {args.spill_gib} is outside (0, 4096]")
    from cellcache.generate import RANDOM_MODELS

    if not Path(args.model).is_dir() and args.model not in RANDOM_MODELS:
        p.error(f"--model {args.model!r}: neither a directory nor one of {', '.join(sorted(RANDOM_MODELS))}")
    if args.device == "cuda" and (code := require_gpu("bench_spill")) is not None:
        return code
    import torch

    from cellcache.generate import Generator, Sampling

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model, model_name = load_model(args.model, dtype, args.device, args.seed)
    prompts, lengths = build_workload(args.workload, args.requests, model.config.vocab_size, args.seed)
    if args.quick:
        prompts = [q[:max(2, len(q) // 16)] for q in prompts]
        lengths = [max(2, k // 16) for k in lengths]
    temperature = WORKLOADS[args.workload]["temperature"]
    working = sum(len(q) + k for q, k in zip(prompts, lengths))
    longest = max(len(q) + k for q, k in zip(prompts, lengths))
    capacity = max(int(args.share * working), 2 * longest)
    spill_bytes = int(args.spill_gib * (1 << 30))
    kw: dict[str, Any] = {"capacity": capacity, "max_seqs": len(prompts), "eos": [], "reserve": 0.0}
    if args.quick:
        kw.update(max_batch_tokens=64, prefill_chunk=32)
    gens = {"recompute": Generator(model, **kw), "spill": Generator(model, spill_bytes=spill_bytes, **kw)}
    for name, gen in gens.items():
        log(f"[spill] warm-up: {name}")
        gen.warmup()
        serve(gen, prompts[:4], [min(4, k) for k in lengths[:4]], temperature)
    runs: dict[str, list[dict]] = {name: [] for name in gens}
    for r in range(args.repeat):
        for name, gen in gens.items():
            log(f"[spill] run {r + 1}/{args.repeat}: {name}")
            before = dict(gen.stats)
            sp = gen.scheduler.kv.spiller
            moved = dict(sp.settle()) if sp is not None else {}
            reqs, seconds = serve(gen, prompts, lengths, temperature)
            st = {k: gen.stats[k] - before[k] for k in ("preempted", "spilled", "restored_tokens",
                                                       "computed_tokens")}
            out = sum(len(q.outputs[0]) for q in reqs)
            run = {"seconds": seconds, "output_tokens": out, "tokens_per_s": out / seconds, **st}
            if sp is not None:
                run.update({k: v - moved[k] for k, v in sp.settle().items()})
            runs[name].append(run)
            log(f"[spill]   {out / seconds:,.0f} tok/s, {st['preempted']} preempted, "
                f"{st['restored_tokens']} tokens restored, {st['computed_tokens']} computed")
    med = {name: statistics.median(x["tokens_per_s"] for x in rs) for name, rs in runs.items()}
    speedup = med["spill"] / med["recompute"]
    res: dict[str, Any] = {
        **run_record(f"spill-{model_name}", ["python3", "tools/bench_spill.py",
                                             *(argv if argv is not None else sys.argv[1:])], args.device),
        "workload": {"name": args.workload, "model": model_name, "requests": len(prompts),
                     "working_set_tokens": working, "capacity": capacity, "share": args.share,
                     "reserve": 0.0, "spill_bytes": spill_bytes},
        "runs": runs, "tokens_per_s": med, "speedup": speedup,
        "targets": {"speedup": TARGET_SPEEDUP, "bandwidth_share": TARGET_BANDWIDTH_SHARE}}
    spill_runs = runs["spill"]
    moved = sum(x["spill_bytes_moved"] for x in spill_runs)
    out_s = sum(x["spill_s"] for x in spill_runs)
    bw: dict[str, Any] = {"spill_bytes": moved,
                          "spill_bytes_per_s": moved / out_s if out_s else None}
    restored_bytes = sum(x["restored_bytes"] for x in spill_runs)
    in_s = sum(x["restore_s"] for x in spill_runs)
    bw["restore_bytes_per_s"] = restored_bytes / in_s if in_s else None
    if args.device == "cuda":
        bw["pinned"] = pinned_bandwidth()
        if bw["spill_bytes_per_s"]:
            bw["spill_share"] = bw["spill_bytes_per_s"] / bw["pinned"]["d2h"]
        if bw["restore_bytes_per_s"]:
            bw["restore_share"] = bw["restore_bytes_per_s"] / bw["pinned"]["h2d"]
    res["bandwidth"] = bw
    if args.no_check:
        res["agreement"] = not_checked()
    else:
        from cellcache.generate.agreement import reference_models

        log(f"[spill] agreement check: {args.check_requests} requests of the spill run against HF")
        sps = [Sampling(max_new_tokens=k, temperature=temperature, seed=i) for i, k in enumerate(lengths)]
        res["agreement"] = tapped_run(gens["spill"], prompts, sps, reference_models(model),
                                      args.check_requests, args.seed)
    for gen in gens.values():
        gen.cache.close()
    gib = 1 << 30
    print(f"{args.workload}, {model_name}, {len(prompts)} requests, cache {capacity:,} cells = "
          f"{args.share:g} x the working set, reserve 0, {res['device']}")
    print(f"{'side':<12} {'output tok/s':>12} {'preempted':>10} {'restored':>10} {'computed':>10}")
    for name, rs in runs.items():
        x = rs[len(rs) // 2]
        print(f"{name:<12} {med[name]:>12,.0f} {x['preempted']:>10,} {x['restored_tokens']:>10,} "
              f"{x['computed_tokens']:>10,}")
    print(f"spill / recompute: {speedup:.2f}x (target >= {TARGET_SPEEDUP}x)")
    fmt = lambda v: "-" if v is None else f"{v / gib:.1f} GiB/s"
    line = f"copies: spill {fmt(bw['spill_bytes_per_s'])}, restore {fmt(bw['restore_bytes_per_s'])}"
    if "pinned" in bw:
        line += (f"; a pinned 1 GiB copy: d2h {fmt(bw['pinned']['d2h'])}, h2d {fmt(bw['pinned']['h2d'])} "
                 f"(target >= {100 * TARGET_BANDWIDTH_SHARE:.0f}%: spill "
                 f"{100 * bw.get('spill_share', 0):.0f}%, restore {100 * bw.get('restore_share', 0):.0f}%)")
    print(line)
    print(f"agreement: {res['agreement']['summary']}")
    path = args.json or RESULTS / (f"spill-{model_name}" + ("-cpu" if args.device == "cpu" else "")
                                   + ("-quick" if args.quick else "") + ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1, default=str) + "\n")
    log(f"wrote {path}")
    return 1 if res["agreement"].get("passed") is False else 0


if __name__ == "__main__":
    sys.exit(run_main("bench_spill", main))
