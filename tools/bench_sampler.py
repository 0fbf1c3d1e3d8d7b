#!/usr/bin/env python3
"""The sampler's device time a step, side by side in one run: greedy slots, random slots at a
temperature alone through the fused draw (``sample_rows``), the same through torch's ops
(``sampler.FUSED_DRAW = False``), and random slots with top-p (always torch's ops).

::

    python3 tools/bench_sampler.py                      # 256 rows x Qwen2's 151,936 ids
    python3 tools/bench_sampler.py --rows 64 --vocab 128256 --reps 50
    python3 tools/bench_sampler.py --device cpu --rows 8 --vocab 1000 --reps 3   (a smoke run)

Each case launches ``Sampler.launch`` on the same float32 logits ``--reps`` times after a
warm-up and reads the median (CUDA: events around each launch, on the sampler's stream; CPU:
the wall clock of the launch and its result), and the host's time in the launch itself (the
wall clock until ``launch`` returns, before its result is waited for: what a generator's
``sample`` phase costs the host a step; each slot its own seed and continuation index, as
a request with ``n`` continuations draws). It prints a table (ms a step, and each case
against the fused draw, host µs a launch; the last case launches the specs a steady decode
plans, each sharing the one before's lists with its positions one step on, as a generator's
decode steps do) and writes JSON (``--json``; default
``benchmarks/results/sampler.json``, ``sampler-cpu.json`` on the CPU). The fused and torch
draws are compared id for id first: the run fails (exit 1) when they differ in more than
one slot in a thousand (a draw may move only where ``u`` times the sum lands within
rounding of a boundary).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

from _common import RESULTS, log, require_gpu, run_record

from cellcache._cli import Parser, in_range, output_file, run_main


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="bench_sampler", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=in_range(1, 1 << 16), default=256, help="slots a step (default 256)")
    p.add_argument("--vocab", type=in_range(2, 1 << 20), default=151936, help="ids (default Qwen2's 151,936)")
    p.add_argument("--reps", type=in_range(1, 10000), default=20, help="timed launches a case (default 20)")
    p.add_argument("--temperature", type=float, default=0.6, help="of the random slots (default 0.6)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--seed", type=in_range(0, 2**31 - 1), default=0)
    p.add_argument("--json", type=output_file, default=None)
    args = p.parse_args(argv)
    if not 0 < args.temperature < float("inf"):
        p.error(f"--temperature {args.temperature} must be a positive number")
    if args.device == "cuda" and (code := require_gpu("bench_sampler")) is not None:
        return code
    if args.device == "cuda":
        from cellcache.cuda.fused import SAMPLE_MAX_VOCAB

        if args.vocab > SAMPLE_MAX_VOCAB:
            p.error(f"--vocab {args.vocab}: the fused draw takes at most {SAMPLE_MAX_VOCAB} ids")
    import torch

    from cellcache.generate import Sampler, SampleSpec
    from cellcache.generate import sampler as sampler_mod

    dev = "cuda:0" if args.device == "cuda" else "cpu"
    g = torch.Generator().manual_seed(args.seed)
    logits = (torch.randn((args.rows, args.vocab), generator=g) * 3).to(dev)
    sampler = Sampler(dev)

    def spec_of(temperature: float, top_p: float) -> SampleSpec:
        spec = SampleSpec()
        for i in range(args.rows):
            spec.add(i, temperature, 0, top_p, args.seed + i // 16, i % 16, 100)
        return spec

    # (name, temperature, top_p, fused, each launch a steady decode's next spec)
    cases: list[tuple[str, float, float, bool, bool]] = [
        ("greedy", 0.0, 1.0, True, False),
        ("temperature, fused draw", args.temperature, 1.0, True, False),
        ("temperature, torch's ops", args.temperature, 1.0, False, False),
        ("temperature and top-p 0.9", args.temperature, 0.9, True, False),
        ("fused, steady decode specs", args.temperature, 1.0, True, True),
    ]

    def draw(spec: SampleSpec, fused: bool) -> Any:
        sampler_mod.FUSED_DRAW = fused
        try:
            return sampler.launch(logits, spec).result().ids
        finally:
            sampler_mod.FUSED_DRAW = True

    spec = spec_of(args.temperature, 1.0)
    a, b = draw(spec, True), draw(spec, False)
    differ = int((a != b).sum())
    res: dict[str, Any] = {
        **run_record("sampler" + ("-cpu" if args.device == "cpu" else ""),
                     ["python3", "tools/bench_sampler.py", *(argv if argv is not None else sys.argv[1:])],
                     args.device),
        "rows": args.rows, "vocab": args.vocab, "reps": args.reps, "temperature": args.temperature,
        "fused_vs_torch_differing_slots": differ, "cases": {}}
    for name, t, top_p, fused, moving in cases:
        log(f"[sampler] {name}")
        spec = spec_of(t, top_p)
        draw(spec, fused)                                    # warm-up
        times, host = [], []
        for _ in range(args.reps):
            if moving:
                spec = spec.next_step()            # (a steady decode's next plan)
            sampler_mod.FUSED_DRAW = fused
            try:
                if args.device == "cuda":
                    stream = torch.cuda.current_stream()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                    t0 = time.perf_counter()
                    pending = sampler.launch(logits, spec)
                    host.append(1e6 * (time.perf_counter() - t0))
                    end.record(stream)
                    pending.result()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
                else:
                    t0 = time.perf_counter()
                    pending = sampler.launch(logits, spec)
                    host.append(1e6 * (time.perf_counter() - t0))
                    pending.result()
                    times.append(1e3 * (time.perf_counter() - t0))
            finally:
                sampler_mod.FUSED_DRAW = True
        res["cases"][name] = {"ms_median": statistics.median(times), "ms_min": min(times),
                              "host_us_median": statistics.median(host)}
    base = res["cases"]["temperature, fused draw"]["ms_median"]
    print(f"sampler, {args.rows} rows x {args.vocab:,} ids, float32 logits, {res['device']}; "
          f"median of {args.reps}")
    print(f"{'case':<28} {'ms a step':>10} {'/ fused':>8} {'host us':>8}")
    for name, c in res["cases"].items():
        ratio = c["ms_median"] / base
        print(f"{name:<28} {c['ms_median']:>10.3f} {ratio:>7.2f}x {c['host_us_median']:>8.0f}")
    ok = differ <= max(0, args.rows // 1000)
    print(f"fused and torch's draws: {differ} of {args.rows} slots differ ({'ok' if ok else 'FAILED'})")
    res["passed"] = ok
    path = args.json or RESULTS / f"{res['benchmark']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2) + "\n")
    log(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_main("bench_sampler", main))
