"""The HTTP server against the in-process Generator, one workload, one invocation.

::

    python3 tools/bench_http.py --model DIR [--requests 256 --prompt-len 512 --max-tokens 256]
    python3 tools/bench_http.py --random qwen2-0.5b --device cuda         (random weights, saved once)
    python3 tools/bench_http.py --model DIR --soak 30 --load 0.7 --disconnect 0.05 --plot soak.png

1. In process: ``Generator.from_pretrained`` (the server's options), warmed up; the workload all
   at once (saturation: throughput, TTFT, ITL), then at each ``--loads`` fraction of that
   request rate with Poisson arrivals (``serve_arrivals``).
2. Over HTTP: ``cellcache serve`` started as a subprocess with the same options, the same
   prompts (token ids), the same arrival times, sent through the ``openai`` client
   (``AsyncOpenAI``, streaming completions, ``ignore_eos`` so every request generates
   ``--max-tokens``) from ``--clients`` processes, so that the client's own parsing is not
   the bottleneck. TTFT: send to the first chunk with a token; ITL: gaps between chunks
   with tokens (a chunk may carry several when the client falls behind: ``tokens_per_chunk``).
   Then the configuration is checked end to end: the prompts once more, the logits of
   ``--check-requests`` of them against HF's forward of the checkpoint (the figures count
   only when it agrees; exit 1 otherwise; ``--no-check`` skips it).
3. The table: throughput, TTFT and ITL p50/p99 side by side, the HTTP/in-process ratios, and
   the issue's targets (saturation >= 0.9x; TTFT p50 within 10 ms at 50% load), then where
   the 50% load TTFT mean went: the engine's, the pipe and the front end's loop, the client
   and HTTP (the server's histograms over the run), and how busy each side's event loop was
   (the server's ``cellcache_event_loop_lag_seconds``, the client processes' own probes).

``--soak MINUTES``: only the server, Poisson arrivals at ``--load`` of the rate measured at
saturation (or ``--rate``), each request dropped by its client after a random number of chunks
with probability ``--disconnect``; every ``--sample-every`` seconds the server's resident
memory, its device memory (``/metrics``), running/waiting and cells used are sampled. Written
as JSON (``--json``) and, when matplotlib is installed, as a PNG plot (``--plot``). Any request
that fails other than by its planned disconnect counts as an error; the exit code is 1 when
there was one.

Progress lines go to stderr; the table to stdout. Bad usage: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, log, run_record
from _http_client import CLIENTS, run_client

from cellcache._cli import Parser, in_range, output_file, run_main, stacks_on_sigusr1

TARGET_SATURATION = 0.9
#: Requests of a short warm-up round before the measured runs, in process and over HTTP.
WARM_REQUESTS = 8
TARGET_TTFT_MS = 10.0


def build_parser() -> Parser:
    p = Parser(prog="bench_http.py", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a local checkpoint directory (with or without a tokenizer)")
    src.add_argument("--random", help="a built-in random model (cellcache.generate.RANDOM_MODELS), saved "
                                      "to a temporary directory")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--requests", type=in_range(1, 1 << 16), default=256)
    p.add_argument("--prompt-len", type=in_range(1, 1 << 20), default=512)
    p.add_argument("--max-tokens", type=in_range(1, 1 << 20), default=256)
    p.add_argument("--capacity", type=in_range(64, 1 << 30), default=1 << 18)
    p.add_argument("--max-seqs", type=in_range(1, 1 << 16), default=256)
    p.add_argument("--stream-interval", type=in_range(1, 1 << 16), default=1,
                   help="the server's --stream-interval (tokens a chunk gathers; default 1)")
    p.add_argument("--max-batch-tokens", type=in_range(1, 1 << 16), default=None)
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--server-log", type=output_file, default=None,
                   help="keep the server's output in this file (written as it runs)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for `cellcache serve` (repeatable; "
                        "e.g. --server-arg=--async-steps)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="the server steps its generator in a process of its own (its default; "
                        "--no-engine-process: the engine thread beside the HTTP loop)")
    p.add_argument("--loads", default="0.5", help="fractions of the saturated request rate (default 0.5)")
    p.add_argument("--clients", type=in_range(1, 64), default=4, help="client processes (default 4)")
    p.add_argument("--client", choices=CLIENTS, default="openai",
                   help="what the client processes send through: the openai client (default: what "
                        "users run) or httpx alone (lean: SSE lines and json.loads, so that the "
                        "client's own parsing weighs less in TTFT)")
    p.add_argument("--seed", type=in_range(0, 2**31 - 1), default=0)
    p.add_argument("--skip-inprocess", action="store_true", help="only the server")
    p.add_argument("--no-check", action="store_true",
                   help="skip the end-to-end agreement check of the served configuration (the "
                        "figures do not count)")
    p.add_argument("--check-requests", type=in_range(1, 1 << 16), default=8,
                   help="requests whose every sampled row is checked against HF's forward (default 8)")
    p.add_argument("--soak", type=float, default=None, metavar="MINUTES", help="a soak of this many minutes")
    p.add_argument("--load", type=float, default=0.7, help="soak: fraction of the saturated rate")
    p.add_argument("--rate", type=float, default=None, help="soak: requests a second (no saturation run)")
    p.add_argument("--disconnect", type=float, default=0.05, help="soak: share of clients that leave early")
    p.add_argument("--sample-every", type=float, default=10.0, help="soak: seconds between memory samples")
    p.add_argument("--json", type=output_file, default=None, help="write the results here")
    p.add_argument("--plot", type=output_file, default=None,
                   help="soak: the memory curve as a PNG (matplotlib)")
    return p


def check(p: Parser, args: Any) -> list[float]:
    """The loads; usage errors exit 2 with one line."""
    try:
        loads = [float(x) for x in args.loads.split(",") if x.strip()]
    except ValueError:
        p.error(f"--loads {args.loads!r} is not a comma-separated list of numbers")
    if not loads or not all(0 < x <= 1 for x in loads):
        p.error(f"--loads {args.loads!r}: each must be in (0, 1]")
    if args.soak is not None and not (0 < args.soak < 1e5):
        p.error(f"--soak {args.soak} minutes must be > 0")
    if not 0 < args.load <= 1:
        p.error(f"--load {args.load} must be in (0, 1]")
    if args.rate is not None and not (0 < args.rate < math.inf):
        p.error(f"--rate {args.rate} must be a positive number")
    if not 0 <= args.disconnect <= 1:
        p.error(f"--disconnect {args.disconnect} must be in [0, 1]")
    if not 0 < args.sample_every <= 86400:           # inf: Event.wait() raises OverflowError
        p.error(f"--sample-every {args.sample_every} must be a number of seconds in (0, 86400]")
    if args.model is not None and not os.path.isdir(args.model):
        p.error(f"--model {args.model}: not a directory")
    for path in (args.json, args.plot, args.server_log):    # their folders, as the other tools do
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
    if args.random is not None:
        from cellcache.generate import RANDOM_MODELS

        if args.random not in RANDOM_MODELS:
            p.error(f"--random {args.random!r}: one of {', '.join(sorted(RANDOM_MODELS))}")
    return loads


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def summary(tokens: int, seconds: float, ttft: list[float], itl: list[float], **extra: Any) -> dict[str, Any]:
    """Throughput and latency percentiles (ms) of a run, and the mean TTFT."""
    ms = lambda v: None if v is None else 1e3 * v
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "ttft_ms_p50": ms(percentile(ttft, 50)), "ttft_ms_p99": ms(percentile(ttft, 99)),
            "ttft_ms_mean": ms(sum(ttft) / len(ttft)) if ttft else None,
            "itl_ms_p50": ms(percentile(itl, 50)), "itl_ms_p99": ms(percentile(itl, 99)), **extra}


#: The server's TTFT histograms a run's mean is read from: the engine's (queued in the engine
#: to its first token's step applied) and the front end's (the request's handler start to its
#: first token's chunk on the way out: the engine's, the pipe both ways and the front end's loop).
SERVER_MEANS = {"engine_ttft_ms_mean": "cellcache_time_to_first_token_seconds",
                "front_end_ttft_ms_mean": "cellcache_http_time_to_first_token_seconds",
                "server_lag_ms_mean": "cellcache_event_loop_lag_seconds"}


def server_sums(url: str) -> dict[str, tuple[float, float]]:
    """The server's histograms of :data:`SERVER_MEANS` so far (``/metrics``), by its key:
    (sum in seconds, count). A run's mean of one (the difference of two readings) places
    part of the TTFT a client sees: the engine's, then the front end's (the engine's, the
    pipe and the loop); the rest is the client and HTTP. The front end loop's lag says how
    busy that loop was (a request's parsing and chunks wait about that long)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    names = {v: k for k, v in SERVER_MEANS.items()}
    out = {k: (0.0, 0.0) for k in SERVER_MEANS}
    for family in text_string_to_metric_families(text):
        key = names.get(family.name)
        if key is None:
            continue
        total = count = 0.0
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                total = sample.value
            elif sample.name.endswith("_count"):
                count = sample.value
        out[key] = (total, count)
    return out


def measured(url: str, run: Any) -> dict[str, Any]:
    """``run()``'s :func:`http_summary`, with the server's means over it (each key of
    :data:`SERVER_MEANS`: :func:`server_sums` before and after)."""
    before = server_sums(url)
    res = run()
    after = server_sums(url)
    for key in SERVER_MEANS:
        (s0, n0), (s1, n1) = before[key], after[key]
        res[key] = 1e3 * (s1 - s0) / (n1 - n0) if n1 > n0 else None
    return res


# -- in process -------------------------------------------------------------------------------------

def server_options(args: Any) -> dict[str, Any]:
    opts: dict[str, Any] = {"capacity": args.capacity, "max_seqs": args.max_seqs,
                            "prefix_cache": not args.no_prefix_cache}
    if args.max_batch_tokens is not None:
        opts["max_batch_tokens"] = args.max_batch_tokens
    return opts


def server_flags(args: Any) -> list[str]:
    flags = ["--device", args.device, "--dtype", args.dtype, "--capacity", str(args.capacity),
             "--max-seqs", str(args.max_seqs), "--log-level", "warning", "--served-model-name", "bench",
             "--max-waiting", str(1 << 20)]
    if args.max_batch_tokens is not None:
        flags += ["--max-batch-tokens", str(args.max_batch_tokens)]
    if args.no_prefix_cache:
        flags.append("--no-prefix-cache")
    if args.stream_interval != 1:
        flags += ["--stream-interval", str(args.stream_interval)]
    if not args.engine_process:
        flags.append("--no-engine-process")
    return flags + list(args.server_arg)


def in_process(args: Any, model_dir: str, prompts: list[list[int]], loads: list[float]) -> dict[str, Any]:
    """Saturation, then each load's Poisson arrivals, through the Generator in this process."""
    import gc

    import torch

    from cellcache.generate import Generator, Sampling, poisson_arrivals, serve_arrivals

    device = None if args.device == "auto" else args.device
    gen = Generator.from_pretrained(model_dir, dtype=args.dtype, device=device, **server_options(args))
    gen.warmup()
    sampling = Sampling(max_new_tokens=args.max_tokens, ignore_eos=True)
    for p in prompts[:WARM_REQUESTS]:                 # first-use costs out of the measured runs
        gen.add(p, Sampling(max_new_tokens=min(args.max_tokens, 4), ignore_eos=True))
    gen.run()
    out: dict[str, Any] = {}
    log(f"in process: {len(prompts)} requests at once")
    t0 = time.perf_counter()
    reqs = [gen.add(p, sampling) for p in prompts]
    gen.run()
    elapsed = time.perf_counter() - t0
    out["saturation"] = summary(sum(len(r.outputs[0]) for r in reqs), elapsed, [r.ttft for r in reqs],
                                [g for r in reqs for g in r.itl()])
    rate = len(prompts) / elapsed
    for load in loads:
        offsets = poisson_arrivals(len(prompts), load * rate, seed=args.seed)
        log(f"in process: load {load:g} ({load * rate:.2f} requests/s)")
        t0 = time.perf_counter()
        reqs = serve_arrivals(gen, prompts, offsets, sampling)
        elapsed = time.perf_counter() - t0
        out[f"load_{load:g}"] = summary(sum(len(r.outputs[0]) for r in reqs), elapsed,
                                        [r.ttft for r in reqs], [g for r in reqs for g in r.itl()],
                                        rate=load * rate)
    if not args.no_check:
        out["agreement"] = agreement(args, model_dir, gen, prompts, sampling)
    del gen, reqs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    out["rate_at_saturation"] = rate
    return out


def agreement(args: Any, model_dir: str, gen: Any, prompts: list[list[int]], sampling: Any) -> dict[str, Any]:
    """The end-to-end agreement check of the configuration served (the server runs the same
    options): the prompts once more on the in-process generator, the logits of
    ``--check-requests`` of them against HF's forward of the checkpoint (float32 reference,
    the served dtype's noise floor; bench_serve's ``tapped_run``)."""
    from bench_serve import tapped_run
    from transformers import AutoModelForCausalLM

    from cellcache.generate.agreement import reference_models

    log(f"in process: agreement check, {args.check_requests} requests against HF's forward")
    dtype = next(gen.model.parameters()).dtype
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(gen.runner.device)
    models = reference_models(hf)
    del hf
    out = tapped_run(gen, prompts, [sampling] * len(prompts), models, args.check_requests, args.seed)
    log(f"in process: agreement: {out['summary']}")
    return out


# -- over HTTP --------------------------------------------------------------------------------------

def over_http(url: str, prompts: list[list[int]], offsets: list[float], max_tokens: int, clients: int,
              leave: list[int | None] | None = None, order: list[int] | None = None,
              keep_chunks: bool = True, kind: str = "openai") -> list[dict[str, Any]]:
    """Request i (prompt ``order[i]``, default i) at ``offsets[i]`` seconds through ``clients``
    processes of the ``kind`` client; request i's client leaves after ``leave[i]`` chunks when
    that is not None."""
    n = len(offsets)
    leave = leave or [None] * n
    order = order if order is not None else list(range(n))
    jobs = [(i, order[i], offsets[i], leave[i]) for i in range(n)]
    t0 = time.time() + 1.0 + 0.2 * clients            # every client started by then
    ctx = mp.get_context("spawn")
    with ctx.Pool(clients) as pool:
        parts = pool.starmap(run_client, [(url, prompts, jobs[w::clients], max_tokens, t0, keep_chunks,
                                           kind) for w in range(clients)])
    recs = sorted((r for part in parts for r in part), key=lambda r: r["i"])
    for r in recs:
        r["t0"] = t0
    return recs


def http_summary(recs: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """Throughput, TTFT (send to the first chunk with a token) and ITL (gaps between chunks
    with tokens; a record without its chunks counts its mean gap)."""
    t0 = recs[0]["t0"] if recs else 0.0
    ok = [r for r in recs if r["error"] is None]
    ttft = [r["first"] - r["sent"] for r in ok if r["first"] is not None]
    itl = []
    for r in ok:
        if r["chunks"]:
            itl += [b[0] - a[0] for a, b in zip(r["chunks"], r["chunks"][1:])]
        elif r["n_chunks"] > 1:
            itl.append((r["last"] - r["first"]) / (r["n_chunks"] - 1))
    lags = [r["client_lag_ms"] for r in recs if r.get("client_lag_ms") is not None]
    if lags:
        extra.setdefault("client_lag_ms_mean", sum(lags) / len(lags))
    chunks = sum(r["n_chunks"] for r in ok)
    tokens = sum(r["tokens"] for r in ok)
    end = max((r["end"] for r in recs), default=t0)
    first = min((r["sent"] for r in recs), default=t0)
    return summary(tokens, end - first, ttft, itl, errors=len(recs) - len(ok),
                   tokens_per_chunk=tokens / chunks if chunks else None, **extra)


# -- the soak ---------------------------------------------------------------------------------------

def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return 1024 * int(line.split()[1])
    except OSError:
        pass
    return 0


def soak(args: Any, server: Any, prompts: list[list[int]], rate: float) -> dict[str, Any]:
    """Poisson arrivals at ``rate`` for ``args.soak`` minutes, random disconnects, memory sampled."""
    import threading

    seconds = 60.0 * args.soak
    rng = random.Random(args.seed)
    samples: list[dict[str, Any]] = []
    stop = threading.Event()

    def sampler() -> None:
        start = time.time()
        while not stop.is_set():
            try:
                m = server.metrics()
            except (AssertionError, OSError, ValueError):     # the server going away: no sample
                stop.wait(args.sample_every)
                continue
            status, body, _ = server.get("/health")
            if status != 200 and (not samples or samples[-1].get("health") != status):
                log(f"soak: /health answers {status}: {body.strip()[:300]}")   # (a stall says why)
            samples.append({"t": time.time() - start, "health": status, "rss_bytes": _rss(server.proc.pid),
                            # the engine process's (absent with --no-engine-process: the same process)
                            "engine_rss_bytes": m.get("cellcache_engine_resident_memory_bytes", 0.0),
                            "gpu_reserved_bytes": m.get("cellcache_gpu_memory_reserved_bytes", 0.0),
                            "gpu_allocated_bytes": m.get("cellcache_gpu_memory_allocated_bytes", 0.0),
                            "running": m.get("cellcache_requests_running", 0.0),
                            "waiting": m.get("cellcache_requests_waiting", 0.0),
                            "cells_used": m.get("cellcache_kv_cells_used", 0.0)})
            last = samples[-1]
            log(f"soak: t={last['t']:.0f}s rss={last['rss_bytes'] / 2**20:.0f} MiB "
                f"engine rss={last['engine_rss_bytes'] / 2**20:.0f} MiB "
                f"gpu={last['gpu_reserved_bytes'] / 2**20:.0f} MiB running={last['running']:.0f}")
            stop.wait(args.sample_every)

    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    # one pool of clients for the whole soak, each request's arrival drawn here (Poisson)
    offsets, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            break
        offsets.append(t)
    offsets = offsets or [0.0]
    order = [rng.randrange(len(prompts)) for _ in offsets]
    leave = [rng.randint(1, max(1, args.max_tokens // 2)) if rng.random() < args.disconnect else None
             for _ in offsets]
    log(f"soak: {len(offsets)} requests over {seconds:.0f} s")
    recs = over_http(server.url, prompts, offsets, args.max_tokens, args.clients, leave, order,
                     keep_chunks=False, kind=args.client)
    stop.set()
    th.join()
    # an error: an exception, or a request that was not left and did not run to its length
    failed = [r for r in recs if r["error"] is not None or (not r["left"] and r["finish"] != "length")]
    return {**http_summary(recs), "minutes": args.soak, "rate": rate, "requests": len(recs),
            "disconnected": sum(1 for r in recs if r["left"]), "errors": len(failed),
            "first_errors": [r["error"] or f"finish {r['finish']}" for r in failed[:5]],
            "samples": samples}


def plot(path: Path, result: dict[str, Any]) -> bool:
    """The soak's memory curve as a PNG; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    s = result["samples"]
    t = [x["t"] / 60 for x in s]
    fig, ax = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax[0].plot(t, [x["rss_bytes"] / 2**20 for x in s], label="server RSS (MiB)")
    if any(x.get("engine_rss_bytes") for x in s):
        ax[0].plot(t, [x["engine_rss_bytes"] / 2**20 for x in s], label="engine process RSS (MiB)")
    ax[0].plot(t, [x["gpu_reserved_bytes"] / 2**20 for x in s], label="GPU reserved (MiB)")
    ax[0].plot(t, [x["gpu_allocated_bytes"] / 2**20 for x in s], label="GPU allocated (MiB)")
    ax[0].set_ylabel("MiB")
    ax[0].legend()
    ax[1].plot(t, [x["running"] for x in s], label="running")
    ax[1].plot(t, [x["cells_used"] / 100 for x in s], label="KV cells used / 100")
    ax[1].set_xlabel("minutes")
    ax[1].legend()
    fig.suptitle(f"cellcache serve soak: {result['requests']} requests, {result['disconnected']} "
                 f"disconnects, {result['errors']} errors")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# -- main -------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    loads = check(p, args)
    stacks_on_sigusr1()                        # kill -USR1: where the clients wait
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from tests.helpers_serve import ServerProcess

    with tempfile.TemporaryDirectory(prefix="bench-http-") as tmp:
        model_dir = args.model
        if model_dir is None:
            import torch

            from cellcache.generate import random_model

            # saved in the dtype it is served in ("auto" reads it back): bf16 on a GPU
            dtype = {"auto": torch.bfloat16 if _on_cuda(args) else torch.float32,
                     "float32": torch.float32, "bfloat16": torch.bfloat16,
                     "float16": torch.float16}[args.dtype]
            log(f"saving random {args.random} ({dtype}) to {tmp}")
            model_dir = os.path.join(tmp, args.random)
            random_model(args.random, dtype).save_pretrained(model_dir)
        from transformers import AutoConfig

        vocab = int(AutoConfig.from_pretrained(model_dir).vocab_size)
        rng = np.random.default_rng(args.seed)
        prompts = [rng.integers(3, vocab, size=args.prompt_len).tolist() for _ in range(args.requests)]
        words = ["python3", "tools/bench_http.py", *(argv if argv is not None else sys.argv[1:])]
        device = "cuda" if _on_cuda(args) else "cpu"
        # (a CPU soak is a result of its own: the GPU's is kept beside it)
        name = "http" if args.soak is None else "http-soak" if device == "cuda" else "http-soak-cpu"
        result: dict[str, Any] = {**run_record(name, words, device),
                                  "workload": {"requests": args.requests, "prompt_len": args.prompt_len,
                                               "max_tokens": args.max_tokens},
                                  "client": args.client, "clients": args.clients}
        if args.soak is None and not args.skip_inprocess:
            result["in_process"] = in_process(args, model_dir, prompts, loads)
        log("starting the server")
        with ServerProcess(model_dir, *server_flags(args), timeout=1800, log_path=args.server_log) as server:
            def send(offsets: list[float], ps: list[list[int]] = prompts,
                     max_tokens: int = args.max_tokens) -> list[dict[str, Any]]:
                return over_http(server.url, ps, offsets, max_tokens, args.clients, kind=args.client)

            if args.soak is not None:
                rate = args.rate
                if rate is None:
                    recs = send([0.0] * len(prompts))
                    sat = http_summary(recs)
                    rate = args.load * len(prompts) / sat["seconds"]
                    result["saturation"] = sat
                log(f"soak: {args.soak:g} minutes at {rate:.2f} requests/s")
                res = soak(args, server, prompts, rate)
                result["soak"] = res
                if args.plot is not None:
                    log(f"plot: {args.plot}" if plot(args.plot, res) else "plot: matplotlib is not installed")
                print(f"soak: {res['requests']} requests in {args.soak:g} min at {rate:.2f}/s, "
                      f"{res['disconnected']} disconnects, {res['errors']} errors; RSS "
                      f"{_mib(res['samples'], 'rss_bytes')} MiB, engine RSS "
                      f"{_mib(res['samples'], 'engine_rss_bytes')} MiB, GPU reserved "
                      f"{_mib(res['samples'], 'gpu_reserved_bytes')} MiB (first -> last sample)")
                code = 1 if res["errors"] else 0
            else:
                send([0.0] * min(WARM_REQUESTS, len(prompts)), prompts[:WARM_REQUESTS],
                     min(args.max_tokens, 4))                                 # first-use costs
                log(f"over HTTP: {len(prompts)} requests at once")
                http: dict[str, Any] = {"saturation": measured(server.url, lambda: http_summary(
                    send([0.0] * len(prompts))))}
                base_rate = result.get("in_process", {}).get("rate_at_saturation") or \
                    len(prompts) / http["saturation"]["seconds"]
                from cellcache.generate import poisson_arrivals

                for load in loads:
                    offsets = poisson_arrivals(len(prompts), load * base_rate, seed=args.seed)
                    log(f"over HTTP: load {load:g} ({load * base_rate:.2f} requests/s)")
                    run = lambda offsets=offsets, load=load: http_summary(    # noqa: E731
                        send(offsets), rate=load * base_rate)
                    http[f"load_{load:g}"] = measured(server.url, run)
                result["http"] = http
                code = report(result, loads)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
        log(f"wrote {args.json}")
    return code


def _mib(samples: list[dict[str, Any]], key: str) -> str:
    if not samples:
        return "?"
    return f"{samples[0][key] / 2**20:.0f} -> {samples[-1][key] / 2**20:.0f}"


def _on_cuda(args: Any) -> bool:
    """Whether the run serves on a GPU (``--device cuda``, or ``auto`` with one)."""
    if args.device != "auto":
        return bool(args.device == "cuda")
    import torch

    return bool(torch.cuda.is_available())


def report(result: dict[str, Any], loads: list[float]) -> int:
    """The side-by-side table; the targets' verdicts into ``result["targets"]``. Returns 1 when
    a request failed over HTTP, else 0 (a missed target is a finding, not a failure)."""
    http, local = result["http"], result.get("in_process")
    f = lambda v, spec=".1f": "-" if v is None else format(v, spec)
    print(f"{'run':<16} {'where':<11} {'tok/s':>10} {'TTFT p50':>9} {'p99':>9} {'ITL p50':>8} {'p99':>8} "
          f"{'tok/chunk':>9}")
    for run in ["saturation", *(f"load_{x:g}" for x in loads)]:
        for where, res in (("in-process", local and local.get(run)), ("http", http.get(run))):
            if res:
                print(f"{run:<16} {where:<11} {f(res['tokens_per_s'], '.0f'):>10} "
                      f"{f(res['ttft_ms_p50']):>9} {f(res['ttft_ms_p99']):>9} "
                      f"{f(res['itl_ms_p50'], '.2f'):>8} {f(res['itl_ms_p99'], '.2f'):>8} "
                      f"{f(res.get('tokens_per_chunk'), '.2f'):>9}")
    targets: dict[str, Any] = {}
    agree = (local or {}).get("agreement")
    if agree is not None:
        print(f"end-to-end agreement of the configuration served, with HF's forward: {agree['summary']}")
    if local:
        ratio = http["saturation"]["tokens_per_s"] / local["saturation"]["tokens_per_s"]
        targets["saturation_ratio"] = ratio
        targets["saturation_ok"] = ratio >= TARGET_SATURATION
        print(f"saturation: HTTP / in-process throughput {ratio:.3f} (target >= {TARGET_SATURATION})")
        half = "load_0.5"
        if half in http and half in local and http[half]["ttft_ms_p50"] is not None:
            gap = http[half]["ttft_ms_p50"] - local[half]["ttft_ms_p50"]
            targets["ttft_p50_gap_ms_at_half_load"] = gap
            targets["ttft_ok"] = gap <= TARGET_TTFT_MS
            print(f"50% load: TTFT p50 HTTP - in-process {gap:+.1f} ms (target <= {TARGET_TTFT_MS} ms)")
            mine, engine, there = (http[half]["ttft_ms_mean"], http[half].get("engine_ttft_ms_mean"),
                                   local[half]["ttft_ms_mean"])
            front = http[half].get("front_end_ttft_ms_mean")
            if None not in (mine, engine, there):
                # where the gap lies: in the engine (queued to first token applied), between it
                # and the front end's handler (the pipe both ways, the loop), or between the
                # handler and the client (HTTP, the client's own parsing)
                split = {"client_ms": mine, "engine_ms": engine, "in_process_ms": there,
                         "engine_gap_ms": engine - there, "transport_ms": mine - engine}
                line = (f"50% load: TTFT mean over HTTP {mine:.1f} ms = engine {engine:.1f} ms (in "
                        f"process {there:.1f}: {engine - there:+.1f})")
                if front is not None:
                    split.update(front_end_ms=front, pipe_and_loop_ms=front - engine,
                                 client_and_http_ms=mine - front)
                    line += (f" + pipe and front end loop {front - engine:.1f} ms + client and HTTP "
                             f"{mine - front:.1f} ms")
                lags = {"server": http[half].get("server_lag_ms_mean"),
                        "client": http[half].get("client_lag_ms_mean")}
                if None not in lags.values():
                    split.update(server_lag_ms=lags["server"], client_lag_ms=lags["client"])
                    line += (f"; loop lag (a timer due every 10 ms, how late it ran, mean): server "
                             f"{lags['server']:.2f} ms, clients {lags['client']:.2f} ms")
                else:
                    line += f" + the way in and out {mine - engine:.1f} ms"
                targets["ttft_mean_split_at_half_load"] = split
                print(line)
    result["targets"] = targets
    errors = sum(r.get("errors", 0) for r in http.values())
    if errors:
        print(f"{errors} requests failed over HTTP")
    if agree is not None:
        from bench_serve import disagreement

        if disagreement(agree, "bench_http"):
            return 1
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(run_main("bench_http", main))
