#!/usr/bin/env python3
"""The workloads other engines publish figures on, served by cellcache, with those figures
printed beside ours (different GPU or precision: the table says so) and the targets of
issue 42. One workload and one model an invocation; prints a table and writes JSON.

::

    python3 tools/bench_workloads.py --workload nano-vllm --model qwen2.5-0.5b
    python3 tools/bench_workloads.py --workload trt-1000 --model llama-3.1-8b
    python3 tools/bench_workloads.py --workload sharegpt --model /models/llama --arrival poisson --load 0.7
    python3 tools/bench_workloads.py --device cpu --model tiny --quick          (a smoke run)

Workloads (``--workload``; ``--requests`` scales any of them), EOS ignored so every request
generates its own length:

- ``nano-vllm``: nano-vllm's ``bench.py``: 256 requests, prompt and output lengths uniform in
  [100, 1024], prompt tokens uniform in [0, 10000], Python's ``random`` seeded 0 in its order
  (every prompt, then every output length), temperature 0.6.
- ``trt-1000``, ``trt-128``: TensorRT-LLM's perf-overview shapes, 1000 prompt + 1000 output
  tokens (1024 requests) and 128 + 128 (4096 requests), greedy.
- ``sharegpt``: a ShareGPT-like length mix: 1000 requests, prompt lengths lognormal (median
  170, sigma 1.0, in [4, 4096]) and output lengths lognormal (median 150, sigma 0.9, in
  [4, 2048]), greedy.

Arrivals (``--arrival``): ``together`` (every request at once: throughput) or ``poisson`` at
``--rate`` requests a second, or at ``--load`` times the rate the run "together" completed
requests at (run first, in the same invocation): TTFT p50/p99 against the target p99 <= 3x
p50 at 70% load. Models (``--model``): a built-in random one (``RANDOM_MODELS``), or a local
directory, with weights (loaded) or with a ``config.json`` alone (random weights).

The figures count only when the end-to-end agreement check passes (``--check-requests``
requests chosen at random while the whole workload is served once more, all at once, compared
with HF's own forward: ``tools/bench_serve.py``'s ``tapped_run``; ``--no-check`` skips it
and the JSON says the figures do not count).
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from typing import Any

import numpy as np
from _common import RESULTS, cell_bytes, log, require_gpu, run_record
from bench_serve import not_checked, tapped_run

from cellcache._cli import Parser, in_range, output_file, run_main

#: name -> requests, and how prompt and output lengths are drawn
WORKLOADS: dict[str, dict[str, Any]] = {
    "nano-vllm": {"requests": 256, "lengths": "nano-vllm", "temperature": 0.6},
    "trt-1000": {"requests": 1024, "lengths": (1000, 1000), "temperature": 0.0},
    "trt-128": {"requests": 4096, "lengths": (128, 128), "temperature": 0.0},
    "sharegpt": {"requests": 1000, "lengths": "lognormal", "temperature": 0.0},
}

#: Published figures to print beside ours: (workload, model) -> [(engine, conditions, output tok/s)]
ANCHORS: dict[tuple[str, str], list[tuple[str, str, float]]] = {
    ("nano-vllm", "qwen2.5-0.5b"): [("vLLM 0.10.2", "A800, bf16", 17_700.0)],
    ("nano-vllm", "llama-3.2-1b"): [("vLLM 0.10.2", "A800, bf16", 12_600.0)],
    ("trt-1000", "llama-3.1-8b"): [("TensorRT-LLM", "H200, FP8 weights", 17_700.0)],
    ("trt-128", "llama-3.1-8b"): [("TensorRT-LLM", "H200, FP8 weights", 27_900.0)],
}

#: Issue 42's targets on the H200, output tokens/s
TARGETS: dict[tuple[str, str], float] = {
    ("nano-vllm", "qwen2.5-0.5b"): 50_000.0,
    ("nano-vllm", "llama-3.2-1b"): 35_000.0,
    ("trt-1000", "llama-3.1-8b"): 14_000.0,
    ("trt-128", "llama-3.1-8b"): 22_000.0,
}
TTFT_P99_OVER_P50 = 3.0


def build_workload(name: str, n: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, output lengths) of ``n`` requests of workload ``name``."""
    spec = WORKLOADS[name]["lengths"]
    if spec == "nano-vllm":                           # its bench.py, call for call
        r = random.Random(seed)
        prompts = [[r.randint(0, min(10000, vocab - 1)) for _ in range(r.randint(100, 1024))]
                   for _ in range(n)]
        return prompts, [r.randint(100, 1024) for _ in range(n)]
    rng = np.random.default_rng(seed)
    if spec == "lognormal":
        plen = np.clip(np.rint(rng.lognormal(math.log(170), 1.0, n)), 4, 4096).astype(int)
        olen = np.clip(np.rint(rng.lognormal(math.log(150), 0.9, n)), 4, 2048).astype(int)
    else:
        plen, olen = np.full(n, spec[0]), np.full(n, spec[1])
    prompts = [rng.integers(0, vocab, size=int(k)).tolist() for k in plen]
    return prompts, [int(k) for k in olen]


def load_model(spec: str, dtype: Any, device: str, seed: int) -> tuple[Any, str]:
    """(model, its name for the record): a built-in random model, or a local directory with
    weights (loaded) or a config alone (random weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from cellcache.generate import random_model

    if not os.path.isdir(spec):
        return random_model(spec, dtype, device, seed), spec
    name = os.path.basename(os.path.normpath(spec))
    files = os.listdir(spec)
    if any(f.endswith((".safetensors", ".bin")) for f in files):
        return AutoModelForCausalLM.from_pretrained(spec, dtype=dtype).to(device).eval(), name
    config = AutoConfig.from_pretrained(spec)
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval(), f"{name} (random weights)"


def cells_that_fit(model, device: str, wanted: int, share: float = 0.85, kv_bytes: int | None = None) -> int:
    """Cells for ``wanted`` tokens, at most what ``share`` of the free GPU memory holds at
    ``kv_bytes`` a stored K or V element (default the model's dtype's)."""
    if device != "cuda":
        return wanted
    import torch

    per_cell = cell_bytes(model.config, kv_bytes or model.dtype.itemsize)
    free, _ = torch.cuda.mem_get_info()
    return max(4096, min(wanted, int(share * free) // per_cell))


def serve(gen, prompts: list[list[int]], lengths: list[int], temperature: float, offsets=None):
    """Every request served (at ``offsets`` seconds, else all at once); (requests, seconds)."""
    from cellcache.generate import Sampling, serve_arrivals

    sps = [Sampling(max_new_tokens=k, temperature=temperature, seed=i) for i, k in enumerate(lengths)]
    t0 = time.perf_counter()
    if offsets is None:
        reqs = [gen.add(p, sp) for p, sp in zip(prompts, sps)]
        gen.run()
    else:
        reqs = serve_arrivals(gen, prompts, offsets, sps)
    if gen.runner.device.type == "cuda":
        import torch

        torch.cuda.synchronize()
    return reqs, time.perf_counter() - t0


def build_parser() -> Parser:
    p = Parser(prog="bench_workloads", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="nano-vllm")
    p.add_argument("--model", default="qwen2.5-0.5b",
                   help="a built-in random model, or a local directory (weights, or config.json alone)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--requests", type=in_range(1, 1 << 20), default=None)
    p.add_argument("--arrival", choices=["together", "poisson"], default="together")
    p.add_argument("--rate", type=float, default=None, help="poisson: requests a second")
    p.add_argument("--load", type=float, default=0.7,
                   help="poisson without --rate: this times the rate 'together' completes requests at")
    p.add_argument("--capacity", type=in_range(64, 1 << 31), default=None,
                   help="cells (default: the workload's tokens, at most 85%% of the free GPU memory)")
    p.add_argument("--max-seqs", type=in_range(1, 1 << 16), default=512)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--native", action="store_true",
                   help="cellcache's own forward of the model (Generator(native=True))")
    p.add_argument("--kv-dtype", choices=["fp8_e4m3"], default=None,
                   help="K/V stored in 8 bits (Generator(kv_dtype=...); default: the model's dtype)")
    p.add_argument("--no-check", action="store_true", help="skip the agreement check (figures do not count)")
    p.add_argument("--check-requests", type=in_range(1, 1 << 16), default=4)
    p.add_argument("--quick", action="store_true", help="16 requests, lengths divided by 16: a smoke run")
    p.add_argument("--seed", type=in_range(0, 2**31 - 1), default=0)
    p.add_argument("--json", type=output_file, default=None,
                   help="where the result goes (default benchmarks/results/workload-<workload>-<model>.json)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    from cellcache.generate import RANDOM_MODELS

    if not os.path.isdir(args.model) and args.model not in RANDOM_MODELS:
        p.error(f"--model {args.model!r}: neither a directory nor one of {', '.join(sorted(RANDOM_MODELS))}")
    if args.rate is not None and not 0 < args.rate < math.inf:
        p.error(f"--rate {args.rate} must be a positive number")
    if not 0 < args.load <= 4:
        p.error(f"--load {args.load} must be in (0, 4]")
    if args.device == "cuda" and (code := require_gpu("bench_workloads")) is not None:
        return code
    import torch

    from cellcache.generate import Generator, Sampling, latency_summary, poisson_arrivals

    spec = WORKLOADS[args.workload]
    n = args.requests or (16 if args.quick else spec["requests"])
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model, model_name = load_model(args.model, dtype, args.device, args.seed)
    models = None
    if not args.no_check:
        from cellcache.generate.agreement import reference_models

        # on the host until the check: the cache sized after them gets the GPU's memory (an
        # 8B model's float32 and bf16 copies would hold 48 GB of it through the timed runs)
        models = reference_models(model, device="cpu")
    prompts, lengths = build_workload(args.workload, n, model.config.vocab_size, args.seed)
    if args.quick:
        prompts = [q[:max(2, len(q) // 16)] for q in prompts]
        lengths = [max(2, k // 16) for k in lengths]
    temperature = spec["temperature"]
    wanted = sum(len(q) + k for q, k in zip(prompts, lengths)) + 4096
    capacity = args.capacity or cells_that_fit(model, args.device, wanted,
                                               kv_bytes=1 if args.kv_dtype else None)
    words = ["python3", "tools/bench_workloads.py", *(argv if argv is not None else sys.argv[1:])]
    stem = f"workload-{args.workload}-{os.path.basename(os.path.normpath(args.model))}"
    if args.native:
        stem += "-native"
    if args.kv_dtype:
        stem += "-kv8"
    if args.device == "cpu":
        stem += "-cpu"
    if args.quick:
        stem += "-quick"
    res: dict[str, Any] = {**run_record(stem, words, args.device),
                           "workload": {"name": args.workload, "model": model_name, "requests": n,
                                        "prompt_tokens": sum(map(len, prompts)),
                                        "output_tokens": sum(lengths), "temperature": temperature,
                                        "capacity": capacity, "max_seqs": args.max_seqs}}
    kw: dict[str, Any] = {"capacity": capacity, "max_seqs": min(args.max_seqs, n), "eos": [],
                          "compile": args.compile, "native": args.native, "kv_dtype": args.kv_dtype}
    if args.quick:
        kw.update(max_batch_tokens=64, prefill_chunk=32)
    gen = Generator(model, **kw)
    res["workload"]["kv_dtype"] = gen.cache.config.kv_dtype or gen.cache.config.dtype   # what it stores
    log(f"[workloads] {args.workload} on {model_name}: {n} requests, warm-up")
    gen.warmup()
    serve(gen, prompts[:8], [min(4, k) for k in lengths[:8]], temperature)

    def record(reqs, seconds: float) -> dict[str, Any]:
        out = sum(len(r.outputs[0]) for r in reqs)
        lat = latency_summary(reqs)
        return {"seconds": seconds, "output_tokens": out, "tokens_per_s": out / seconds,
                "requests_per_s": len(reqs) / seconds, "preempted": gen.stats["preempted"],
                **{k: lat[k] for k in ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99")}}

    log("[workloads] every request at once")
    res["together"] = record(*serve(gen, prompts, lengths, temperature))
    if args.arrival == "poisson":
        rate = args.rate or args.load * res["together"]["requests_per_s"]
        log(f"[workloads] Poisson arrivals at {rate:.2f} requests/s")
        offsets = poisson_arrivals(n, rate, args.seed)
        res["poisson"] = {**record(*serve(gen, prompts, lengths, temperature, offsets)), "rate": rate,
                          "load": None if args.rate else args.load}
    if models is not None:
        log(f"[workloads] agreement check: {args.check_requests} requests against HF's forward")
        sps = [Sampling(max_new_tokens=k, temperature=temperature, seed=i) for i, k in enumerate(lengths)]
        res["agreement"] = tapped_run(gen, prompts, sps, models, args.check_requests, args.seed, park=True)
    else:
        res["agreement"] = not_checked()
    gen.cache.close()
    key = (args.workload, args.model)
    res["anchors"] = [{"engine": e, "conditions": c, "tokens_per_s": v} for e, c, v in ANCHORS.get(key, [])]
    res["target_tokens_per_s"] = TARGETS.get(key) if args.device == "cuda" else None
    report(res)
    path = args.json or RESULTS / f"{stem}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    import json

    path.write_text(json.dumps(res, indent=2, default=str) + "\n")
    log(f"wrote {path}")
    return 1 if res["agreement"].get("passed") is False else 0


def report(res: dict[str, Any]) -> None:
    """The table: our runs, the published anchors beside them, the targets."""
    f = lambda v, spec=",.0f": "-" if v is None else format(v, spec)
    w = res["workload"]
    print(f"{w['name']}, {w['model']}, {w['requests']} requests ({w['prompt_tokens']:,} prompt + "
          f"{w['output_tokens']:,} output tokens), K/V {w.get('kv_dtype')}, {res['device']}")
    print(f"{'run':<34} {'output tok/s':>12} {'TTFT p50':>9} {'p99':>9} {'ITL p50':>8} {'p99':>8}")
    for run in ("together", "poisson"):
        r = res.get(run)
        if r:
            label = "cellcache, all at once" if run == "together" else f"cellcache, Poisson {r['rate']:.2f}/s"
            print(f"{label:<34} {f(r['tokens_per_s']):>12} {f(r['ttft_ms_p50'], '.1f'):>9} "
                  f"{f(r['ttft_ms_p99'], '.1f'):>9} {f(r['itl_ms_p50'], '.2f'):>8} "
                  f"{f(r['itl_ms_p99'], '.2f'):>8}")
    for a in res["anchors"]:
        print(f"{a['engine'] + ' (' + a['conditions'] + ')':<34} {f(a['tokens_per_s']):>12}   published")
    targets = {}
    target = res.get("target_tokens_per_s")
    if target is not None:
        targets["throughput"] = res["together"]["tokens_per_s"] >= target
        print(f"target: >= {target:,.0f} output tok/s: {'met' if targets['throughput'] else 'MISSED'}")
    pois = res.get("poisson")
    if pois and pois.get("load") == 0.7 and pois["ttft_ms_p50"]:
        ratio = pois["ttft_ms_p99"] / pois["ttft_ms_p50"]
        targets["ttft_p99_over_p50"] = ratio <= TTFT_P99_OVER_P50
        print(f"target: TTFT p99 <= {TTFT_P99_OVER_P50:g}x p50 at 70% load: {ratio:.2f}x "
              f"{'met' if targets['ttft_p99_over_p50'] else 'MISSED'}")
    res["targets"] = targets
    print(f"agreement: {res['agreement']['summary']}")


if __name__ == "__main__":
    sys.exit(run_main("bench_workloads", main))
