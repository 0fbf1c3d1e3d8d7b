#!/usr/bin/env python3
"""Serving benchmark: cellcache's continuous-batching generator, with its prefix cache on and
off, against Hugging Face's own continuous batching (``generate_batch``) and static-cache
``generate``, on the same random-weight model and workload, in one run. Prints a table and
writes JSON. GPU by default; ``--device cpu --model tiny --quick`` is a smoke run.

Workloads (``--workload``), greedy, stop tokens off (every request generates all its
tokens), a Qwen2-0.5B-sized model (24 layers, hidden 896, 14 heads, 2 KV heads, bf16,
random weights):

- ``default``: 256 requests of 512 prompt tokens and 256 new tokens, no sharing, all
  arriving together: cellcache with the prefix cache on and off (target: on within 2% of
  off), the same requests arriving otherwise (``--arrival``: ``staggered``, 32 every 16
  steps, the default; ``poisson``, a seeded Poisson process of ``--rate`` requests a second,
  by default 4x the rate "all together" completed requests at, so that the offered load
  exceeds capacity as it does all together; the run at exactly that rate is a second
  target line, printed with the floor its arrivals impose: its last arrival's decode steps
  come after "all together" would have finished, whatever the server does; target: within
  1.25x of all together), HF ``generate_batch`` and static ``generate``.
- ``shared``: a system prompt: 512 requests of 2048 shared + 128 own tokens, 128 new:
  prefix cache on and off (target: on >= 3x off), prompt tokens computed against the ideal
  2048 + 512 x 128 (target: equal), HF ``generate_batch`` on the same requests.
- ``chat``: 64 conversations x 8 turns; turn 1's prompt has 256 tokens, each later turn's
  prompt is the previous turn's prompt + its reply (128 new tokens) + a new 64-token
  message, sent as soon as the reply is complete: prompt tokens computed against the ideal
  (each conversation's first prompt, then 1 + the message per turn: the reply's last token
  was never fed), time to first token p50/p99, prefix cache on and off.

``--requests`` (conversations for chat), ``--prompt-len`` (the own part for shared, the
first prompt for chat), ``--shared-len``, ``--new-tokens``, ``--turns``, ``--message-len``
scale a workload; ``--quick`` makes every default small. On CUDA the cellcache runs use the
Generator's defaults (8192-token steps, 2048-token prompt chunks) unless
``--max-batch-tokens``/``--prefill-chunk`` say otherwise, and capture their CUDA graphs
(``Generator.warmup()``) before the clock starts, as a serving engine does at start-up;
``--attention flashinfer`` runs FlashInfer's kernels over the same paged view instead of
cellcache's (eager steps). Every cellcache run reports time to
first token and inter-token latency, p50 and p99 (``Generator.latency()``). On CUDA the
default workload runs once more with CUDA events around each decode replay: its decode GPU
time and breakdown are the host-time target's denominator, while the host phases come from
the timed run, which carries no events.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import ROOT, log, require_gpu

from cellcache._cli import Parser, in_range

WORKLOADS = {
    #            requests, prompt_len, new_tokens, shared_len, turns, message_len
    "default": dict(requests=256, prompt_len=512, new_tokens=256, shared_len=0, turns=1, message_len=0),
    "shared": dict(requests=512, prompt_len=128, new_tokens=128, shared_len=2048, turns=1, message_len=0),
    "chat": dict(requests=64, prompt_len=256, new_tokens=128, shared_len=0, turns=8, message_len=64),
}
QUICK = {
    "default": dict(requests=8, prompt_len=32, new_tokens=16),
    "shared": dict(requests=16, prompt_len=8, new_tokens=8, shared_len=64),
    "chat": dict(requests=4, prompt_len=24, new_tokens=8, turns=3, message_len=6),
}


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def make_gen(model, w: dict, prefix: bool, capacity: int, max_seqs: int):
    import gc

    import torch

    from cellcache.generate import Generator

    gc.collect()                    # earlier runs' generators (cycles through the timers) and
    if torch.cuda.is_available():   # their graphs go before this one's are captured
        torch.cuda.empty_cache()

    gen = Generator(model, capacity=capacity, max_batch_tokens=w["max_batch_tokens"],
                    max_seqs=max_seqs, prefill_chunk=w["prefill_chunk"], eos=[],
                    prefix_cache=prefix, async_steps=w.get("async_steps"),
                    compile=w.get("compile", False), attention=w.get("attention", "auto"))
    gen.warmup()                    # the decode graphs, captured before the clock starts
    return gen


def summarize(gen, elapsed: float, reqs) -> dict:
    st = gen.stats
    lat = gen.latency(reqs)
    res = {"seconds": elapsed, "tokens_out": st["tokens_out"], "tokens_per_s": st["tokens_out"] / elapsed,
           "steps": st["steps"], "graph_steps": st["graph_steps"], "preempted": st["preempted"],
           "prompt_tokens": st["prompt_tokens"], "cached_tokens": st["cached_tokens"],
           "computed_tokens": st["computed_tokens"], "tokens_in": st["tokens_in"],
           **{k: lat[k] for k in ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99")}}
    prof = gen.profile
    res["async_steps"] = gen.async_steps
    res["host_ms"] = {k: round(v, 3) for k, v in prof["host_ms"].items()}        # every step
    res["decode_host_ms"] = {k: round(v, 3) for k, v in prof["decode_host_ms"].items()}
    n_dec = max(1, prof["decode_steps"])
    # host work a decode step costs (every phase but "wait": blocked on the device)
    res["decode_host_us_per_step"] = {k: round(1e3 * v / n_dec, 1) for k, v in prof["decode_host_ms"].items()}
    res["decode_host_us_per_step_total"] = round(
        1e3 * sum(v for k, v in prof["decode_host_ms"].items() if k != "wait") / n_dec, 1)
    if gen.prefix is not None:
        m = gen.prefix.metrics()
        res["prefix"] = {k: m[k] for k in ("cached_tokens", "leaves", "hits", "hit_tokens",
                                           "evictions", "evicted_tokens", "insert_skipped")}
    return res


def ours(model, prompts, new_tokens, arrival: str, capacity: int, w: dict, device: str,
         prefix: bool = True, with_breakdown: bool = False, rate: float = 0.0, seed: int = 0) -> dict:
    """Every prompt served: all arriving ``"together"``, ``"staggered"`` (32 every 16 steps)
    or at the times of a seeded Poisson process of ``rate`` requests a second (``"poisson"``:
    added by a client thread while this one steps, as a server would see them)."""
    from cellcache.generate import Sampling, poisson_arrivals, serve_arrivals

    gen = make_gen(model, w, prefix, capacity, len(prompts) + 8)
    sampling = Sampling(max_new_tokens=new_tokens)
    prep: list[float] = []
    real_prepare = gen.cache.prepare_step

    def timed_prepare(*a, **k):
        s = time.perf_counter()
        out = real_prepare(*a, **k)
        prep.append(time.perf_counter() - s)
        return out

    gen.cache.prepare_step = timed_prepare
    step_s: dict[str, list[float]] = {"mixed": [], "decode": []}
    real_step = gen.step

    def timed_step() -> bool:
        # a call is booked by the step it applied (asynchronous scheduling: a call may only
        # launch a step, applied by the next call, or apply one and launch the next)
        prof = gen.profile
        before, s = (prof["mixed_steps"], prof["decode_steps"]), time.perf_counter()
        busy = real_step()
        took = time.perf_counter() - s
        if prof["mixed_steps"] > before[0]:
            step_s["mixed"].append(took)
        elif prof["decode_steps"] > before[1]:
            step_s["decode"].append(took)
        return busy

    gen.step = timed_step
    replay_events = _time_replays(gen) if with_breakdown and device == "cuda" else None
    _sync(device)
    t0 = time.perf_counter()
    if arrival == "poisson":
        offsets = poisson_arrivals(len(prompts), rate, seed)
        last_arrival = max(offsets)
        reqs = serve_arrivals(gen, prompts, offsets, sampling)
    else:
        pending = list(prompts)
        reqs = []
        if arrival == "together":
            reqs = [gen.add(p, sampling) for p in pending]
            pending = []
        steps = 0
        while pending or gen.busy:
            if pending and steps % 16 == 0:
                reqs += [gen.add(p, sampling) for p in pending[:32]]
                pending = pending[32:]
            if not gen.step() and not pending:
                break
            steps += 1
    _sync(device)
    elapsed = time.perf_counter() - t0
    res = summarize(gen, elapsed, reqs)
    res["arrival"] = arrival if arrival != "poisson" else f"poisson {rate:.2f} requests/s"
    if arrival == "poisson":
        res["last_arrival_s"] = last_arrival
    res["prepare_step_host_ms_total"] = 1e3 * sum(prep)
    res["prepare_step_host_us_median"] = 1e6 * statistics.median(prep) if prep else 0.0
    for kind, times in step_s.items():         # where on and off differ, by kind of step
        res[f"{kind}_steps"] = len(times)
        res[f"{kind}_step_ms_total"] = 1e3 * sum(times)
        res[f"{kind}_step_ms_median"] = 1e3 * statistics.median(times) if times else 0.0
    res["outputs"] = [r.outputs[0] for r in reqs]
    if replay_events is not None:
        # GPU time of the run's own decode forwards (graph replays of its usual width),
        # measured in the run by events on the stream: the step's GPU time for the host target
        rows: dict[int, list[float]] = {}
        for T, a, b in replay_events:
            rows.setdefault(T, []).append(a.elapsed_time(b))
        if rows:
            T = max(rows, key=lambda k: len(rows[k]))
            res["decode_gpu_ms_median"] = statistics.median(rows[T])
            res["decode_gpu_rows"] = T
            res["decode_gpu_samples"] = len(rows[T])
    if with_breakdown and device == "cuda":
        res["breakdown"] = breakdown(gen, model)
    gen.cache.close()
    return res


def chat(model, first, messages, new_tokens, capacity: int, w: dict, device: str,
         prefix: bool = True) -> dict:
    """Conversations: turn k + 1 is added as soon as turn k's reply is complete
    (:func:`cellcache.generate.chat`, the driver the tests use too)."""
    from cellcache.generate import Sampling
    from cellcache.generate import chat as drive

    gen = make_gen(model, w, prefix, capacity, len(first) + 8)
    _sync(device)
    t0 = time.perf_counter()
    done = drive(gen, first, messages, Sampling(max_new_tokens=new_tokens))
    _sync(device)
    elapsed = time.perf_counter() - t0
    reqs = [r for *_, r in done]
    res = summarize(gen, elapsed, reqs)
    res["turns_done"] = len(reqs)
    res["outputs"] = [r.outputs[0] for r in reqs]
    gen.cache.close()
    return res


def _time_replays(gen) -> list:
    """Wraps the runner's forward so that each decode step it replays from a graph records a
    CUDA event pair around it on the stream (events made beforehand: no allocation in the
    timed steps); returns the list of (bucket, start, end) the run fills."""
    import torch

    runner = gen.runner
    real = runner.forward
    pool = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(4096)]
    out: list = []

    def timed(step, tokens=None, logit_rows=None, decode=False, **kw):
        if not decode or len(out) >= len(pool):
            return real(step, tokens, logit_rows, decode, **kw)
        a, b = pool[len(out)]
        replays = runner.replays
        a.record()
        logits = real(step, tokens, logit_rows, decode, **kw)
        b.record()
        if runner.replays > replays:
            out.append((step.pad_to, a, b))
        return logits

    runner.forward = timed
    return out


def breakdown(gen, model) -> dict:
    """Where a 256-row decode step goes: prepare_step (host), the whole forward (graph
    replay), and the attention kernels alone (24 layers, same shapes and lists)."""
    import torch

    runner, view = gen.runner, gen.runner.view
    graphs = runner.graphs
    if not graphs:
        return {}
    T = max(graphs)
    graph = graphs[T][0]               # (graph, its logits, its greedy ids)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    forward_ms = statistics.median(times)
    cfg = model.config
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = cfg.hidden_size // H
    q = torch.randn((T, H, D), device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    kern = view.kernels()
    pv = view.paged_pointers()
    stream = torch.cuda.current_stream().cuda_stream
    layers = len(gen.cache.config.layers)

    def attn():
        for li in range(layers):
            k, v, w = view.layer(li)
            kern.paged(pv, T, q.data_ptr(), (H * D, D), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                       (H * D, D), H, Hkv, D, w, stream)

    attn()
    times = []
    for _ in range(20):
        a.record()
        attn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    attn_ms = statistics.median(times)
    return {"decode_rows": T, "forward_ms": forward_ms, "attention_ms": attn_ms,
            "rest_of_model_ms": forward_ms - attn_ms}


def hf_batch(model, prompts, new_tokens, device: str = "cuda") -> dict:
    from transformers import GenerationConfig

    model.set_attn_implementation("sdpa")
    cfg = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    _sync(device)
    t0 = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=cfg)
    _sync(device)
    elapsed = time.perf_counter() - t0
    outs = [list(r.generated_tokens) for r in results.values()]
    n = sum(len(o) for o in outs)
    return {"seconds": elapsed, "tokens_out": n, "tokens_per_s": n / elapsed, "outputs": outs}


def hf_static(model, prompts, new_tokens, device: str = "cuda") -> dict:
    import torch

    model.set_attn_implementation("sdpa")
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):                         # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    _sync(device)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0, cache_implementation="static",
                         disable_compile=True)
    _sync(device)
    elapsed = time.perf_counter() - t0
    gen = out[:, width:]
    n = int(gen.numel())
    return {"seconds": elapsed, "tokens_out": n, "tokens_per_s": n / elapsed,
            "outputs": gen.tolist()}


def build_workload(name: str, w: dict, vocab: int, seed: int) -> dict:
    """The prompts (default, shared) or conversations (chat) and the ideal prompt tokens
    computed. Own parts and first prompts start with distinct tokens, so prompts share
    exactly what the workload says."""
    rng = np.random.default_rng(seed)
    n = w["requests"]
    firsts = rng.permutation(vocab)[:n] if n <= vocab else rng.integers(0, vocab, size=n)

    def own(i: int, length: int) -> list[int]:
        return [int(firsts[i])] + rng.integers(0, vocab, size=length - 1).tolist()

    if name == "chat":
        first = [own(i, w["prompt_len"]) for i in range(n)]
        messages = [[rng.integers(0, vocab, size=w["message_len"]).tolist() for _ in range(w["turns"])]
                    for _ in range(n)]
        ideal = n * (w["prompt_len"] + (w["turns"] - 1) * (1 + w["message_len"]))
        return {"first": first, "messages": messages, "ideal_computed": ideal}
    shared = rng.integers(0, vocab, size=w["shared_len"]).tolist()
    prompts = [shared + own(i, w["prompt_len"]) for i in range(n)]
    ideal = w["shared_len"] + n * w["prompt_len"] if w["shared_len"] else n * w["prompt_len"]
    return {"prompts": prompts, "ideal_computed": ideal}


# -- tensor parallelism (issue 19): --tp N under torchrun ------------------------------------------
def tp_bench(p, args) -> int:
    """``torchrun --nproc-per-node N tools/bench_serve.py --model qwen2-7b --tp N`` (``--tp 1``
    without torchrun for the comparison): the default workload (256 requests x (512 + 256),
    all arriving together, greedy, prefix cache off) through ``Generator(tp=N)``, then HF
    ``generate_batch`` on the same sharded model. Reports tokens/s and rank 0's host time per
    step (wall time of ``step()``, and the host phases of ``Generator.profile`` when present);
    rank 0 writes ``benchmarks/results/serve-tp{N}-{model}-{date}.json``.

    HF's comparison: ``from_pretrained(..., tp_plan="auto")`` needs a checkpoint and
    ``accelerate``; the random model is sharded instead with the same plan through the same
    transformers API (``cellcache.tp.shard_model``: ``prepare_distribute_model`` +
    ``maybe_distribute_model``, what ``tp_plan="auto"`` applies), then served by its
    ``generate_batch`` with SDPA attention."""
    import torch

    from cellcache.generate import Generator, Sampling, random_model
    from cellcache.generate.cli import init_tp

    device = args.device
    if device == "cuda" and (code := require_gpu("bench_serve")) is not None:
        return code
    try:
        rank, world, place = init_tp(args.tp, device)
    except ValueError as e:
        p.error(str(e))
    w = dict(WORKLOADS["default"], max_batch_tokens=8192, prefill_chunk=2048)
    if args.quick:
        w.update(QUICK["default"], max_batch_tokens=64, prefill_chunk=32)
    for key in ("requests", "prompt_len", "new_tokens", "max_batch_tokens", "prefill_chunk"):
        if getattr(args, key) is not None:
            w[key] = getattr(args, key)
    n, plen, new = w["requests"], w["prompt_len"], w["new_tokens"]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = random_model(args.model, dtype, place, args.seed)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, model.config.vocab_size, size=plen).tolist() for _ in range(n)]
    capacity = n * (plen + new) + 4096

    def serve(batch: list, new_tokens: int) -> dict:
        gen = Generator(model, capacity=capacity, max_batch_tokens=w["max_batch_tokens"],
                        max_seqs=len(batch) + 8, prefill_chunk=w["prefill_chunk"], eos=[],
                        prefix_cache=False, tp=world if world > 1 else None)
        gen.warmup()                # the decode graphs on every rank, before the clock starts
        sampling = Sampling(max_new_tokens=new_tokens)
        for prompt in batch if rank == 0 else []:
            gen.add(prompt, sampling)
        step_s: list[float] = []
        _sync(device)
        t0 = time.perf_counter()
        while True:
            s = time.perf_counter()
            busy = gen.step()
            step_s.append(time.perf_counter() - s)
            if not busy:
                break
        _sync(device)
        elapsed = time.perf_counter() - t0
        st = gen.stats
        res = {"seconds": elapsed, "tokens_out": st["tokens_out"], "tokens_per_s": st["tokens_out"] / elapsed,
               "steps": st["steps"], "graph_steps": st["graph_steps"],
               "step_ms_median": 1e3 * statistics.median(step_s), "step_ms_mean": 1e3 * elapsed / len(step_s)}
        prof = getattr(gen, "profile", None)
        if isinstance(prof, dict) and prof.get("steps"):
            host = {k: v for k, v in prof["host_ms"].items() if k != "wait"}
            res["host_ms_per_step"] = sum(host.values()) / prof["steps"]
            res["host_ms_by_phase"] = {k: v / prof["steps"] for k, v in host.items()}
            if prof.get("decode_steps"):
                res["decode_host_ms_per_step"] = sum(
                    v for k, v in prof["decode_host_ms"].items() if k != "wait") / prof["decode_steps"]
        gen.cache.close()
        return res

    res: dict = {"date": _dt.date.today().isoformat(), "command": " ".join(sys.argv),
                 "workload": {"model": args.model, "device": device, "tp": world, "requests": n,
                              "prompt_len": plen, "new_tokens": new, "capacity": capacity,
                              "max_batch_tokens": w["max_batch_tokens"], "prefill_chunk": w["prefill_chunk"]}}
    if rank == 0:
        log(f"[serve-tp] tp={world} {args.model}: warm-up")
    serve(prompts[:8], 8)                                         # kernels, graphs
    res["cellcache"] = serve(prompts, new)
    if rank == 0:
        r = res["cellcache"]
        host = r.get("host_ms_per_step", float("nan"))
        log(f"[serve-tp] cellcache tp={world}: {r['tokens_per_s']:.0f} tokens/s, "
            f"step median {r['step_ms_median']:.2f} ms, host/step {host:.3f} ms")
    stem = f"serve-tp{world}-{args.model}-{res['date']}"
    path = args.json or ROOT / "benchmarks" / "results" / f"{stem}.json"
    if rank == 0:                                 # saved now, and again with HF's run
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=2, default=str) + "\n")
    if "hf-batch" not in set(filter(None, args.skip.split(","))):
        try:
            hf_batch(model, prompts[:4], 4, device)                 # warm-up
            hf = hf_batch(model, prompts, new, device)
            res["hf-batch"] = {k: v for k, v in hf.items() if k != "outputs"}
            res["hf-batch"]["how"] = ("transformers' TP plan (prepare_distribute_model + "
                                      "maybe_distribute_model)" if world > 1 else "one process")
        except Exception as e:  # noqa: BLE001 - reported
            res["hf-batch"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        if rank == 0 and "tokens_per_s" in res["hf-batch"]:
            log(f"[serve-tp] HF generate_batch tp={world}: {res['hf-batch']['tokens_per_s']:.0f} tokens/s")
    if rank == 0:
        if "tokens_per_s" in res.get("hf-batch", {}):
            res["cellcache_vs_hf_batch"] = res["cellcache"]["tokens_per_s"] / res["hf-batch"]["tokens_per_s"]
        path.write_text(json.dumps(res, indent=2, default=str) + "\n")
        print(json.dumps(res, indent=2, default=str))
    if world > 1:
        import torch.distributed as dist

        dist.barrier()                    # every rank past its last collective first
        dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    p = Parser(prog="bench_serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="default")
    p.add_argument("--model", default="qwen2-0.5b", help="built-in random model (default qwen2-0.5b)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda (default; bf16) or cpu (float32: a smoke run with a tiny model)")
    p.add_argument("--requests", type=in_range(1, 1 << 16), default=None,
                   help="requests (chat: conversations)")
    p.add_argument("--prompt-len", type=in_range(1, 1 << 20), default=None,
                   help="prompt tokens (shared: each request's own part; chat: the first prompt)")
    p.add_argument("--shared-len", type=in_range(1, 1 << 20), default=None, help="shared: the system prompt")
    p.add_argument("--new-tokens", type=in_range(1, 1 << 16), default=None)
    p.add_argument("--turns", type=in_range(1, 1 << 10), default=None, help="chat: turns per conversation")
    p.add_argument("--message-len", type=in_range(1, 1 << 16), default=None,
                   help="chat: tokens of each new message")
    p.add_argument("--max-batch-tokens", type=in_range(1, 1 << 16), default=None,
                   help="rows a step (default 2048; --quick 64)")
    p.add_argument("--prefill-chunk", type=in_range(1, 1 << 16), default=None,
                   help="prompt tokens a sequence reads a step (default 512, shared 2048; --quick 32)")
    p.add_argument("--repeat", type=in_range(1, 16), default=1,
                   help="cellcache on/off runs, alternating; the best of each is reported")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument("--arrival", choices=["staggered", "poisson", "none"], default="staggered",
                   help="default workload: the run beside 'all together' (default staggered: 32 "
                        "every 16 steps; poisson: --rate requests a second; none)")
    p.add_argument("--rate", type=float, default=None,
                   help="Poisson arrivals: requests a second (default: 4x the rate 'all together' "
                        "completed requests at, so the offered load exceeds what the server "
                        "completes and its queue fills, as all together; the run at exactly that "
                        "rate is a second target line, with the floor its arrivals impose)")
    p.add_argument("--skip", default="",
                   help="comma-separated runs to skip: off, staggered, hf-batch, hf-static")
    p.add_argument("--async-steps", choices=["auto", "on", "off"], default="auto",
                   help="asynchronous scheduling of decode steps (Generator(async_steps=)); auto: "
                        "on with CUDA graphs")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model's forward (Generator(compile=True): inductor, "
                        "attention as the custom op cellcache::attention; on CUDA the decode graphs "
                        "capture the compiled forward); the warm-up run compiles")
    p.add_argument("--attention", choices=["auto", "flashinfer"], default="auto",
                   help="attention kernels (Generator(attention=)): auto, cellcache's own "
                        "(default); flashinfer, FlashInfer's over the same paged view (eager steps)")
    p.add_argument("--seed", type=in_range(0, 2**31 - 1), default=0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--tp", type=in_range(1, 1 << 12), default=None,
                   help="tensor parallelism (issue 19): N ranks under torchrun --nproc-per-node N "
                        "(1: one process, the comparison); the default workload only")
    args = p.parse_args(argv)
    if args.tp is not None:
        if args.compile:
            p.error("--compile is measured in one process (without --tp)")
        return tp_bench(p, args)
    if args.rate is not None and not 0 < args.rate < float("inf"):
        p.error(f"--rate must be a finite number > 0, not {args.rate}")
    if args.device == "cuda" and (code := require_gpu("bench_serve")) is not None:
        return code
    import torch

    from cellcache.generate import RANDOM_MODELS, random_model

    if args.model not in RANDOM_MODELS:
        p.error(f"--model {args.model!r} is not one of {', '.join(sorted(RANDOM_MODELS))}")
    name = args.workload
    w: dict[str, Any] = dict(WORKLOADS[name])
    if args.device == "cuda":                 # the Generator's CUDA defaults
        w.update(max_batch_tokens=8192, prefill_chunk=2048)
    else:
        w.update(max_batch_tokens=2048, prefill_chunk=2048 if name == "shared" else 512)
    if args.quick:
        w.update(QUICK[name], max_batch_tokens=64, prefill_chunk=32)
    for key in ("requests", "prompt_len", "shared_len", "new_tokens", "turns", "message_len",
                "max_batch_tokens", "prefill_chunk"):
        if getattr(args, key) is not None:
            w[key] = getattr(args, key)
    w["async_steps"] = {"auto": None, "on": True, "off": False}[args.async_steps]
    w["compile"] = bool(args.compile)
    w["attention"] = args.attention
    skip = set(filter(None, args.skip.split(",")))
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = random_model(args.model, dtype, device, args.seed)
    vocab = model.config.vocab_size
    work = build_workload(name, w, vocab, args.seed)
    n, new = w["requests"], w["new_tokens"]
    if name == "chat":
        longest = w["prompt_len"] + (w["turns"] - 1) * (new + w["message_len"])
        capacity = n * (longest + new) + 4096
    else:
        capacity = n * (w["shared_len"] + w["prompt_len"] + new) + 4096
    capacity = max(capacity, w["max_batch_tokens"])
    command = "python3 tools/bench_serve.py " + " ".join(argv if argv is not None else sys.argv[1:])
    res: dict = {"date": _dt.date.today().isoformat(), "command": command,
                 "workload": {"name": name, "model": args.model, "device": device, **w,
                              "capacity": capacity, "ideal_computed": work["ideal_computed"]}}
    stem = ("serve" if name == "default" else f"serve-{name}") + ("-compile" if args.compile else "")
    path = args.json or ROOT / "benchmarks" / "results" / f"{stem}-{res['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:                  # after every run, so a cut-short session keeps what ran
        slim = {k: ({kk: vv for kk, vv in v.items() if kk != "outputs"} if isinstance(v, dict) else v)
                for k, v in res.items()}
        path.write_text(json.dumps(slim, indent=2, default=str) + "\n")

    def run(prefix: bool, arrival: str = "together", breakdown_: bool = False, rate: float = 0.0) -> dict:
        if name == "chat":
            return chat(model, work["first"], work["messages"], new, capacity, w, device, prefix)
        return ours(model, work["prompts"], new, arrival, capacity, w, device, prefix, breakdown_,
                    rate=rate, seed=args.seed)

    log(f"[serve] {name}: warm-up")                            # kernels, graphs
    if name == "chat":
        chat(model, work["first"][:4], [m[:2] for m in work["messages"][:4]], 4, capacity, w, device)
    else:
        ours(model, work["prompts"][:8], 8, "together", capacity, w, device)
    modes = [("cellcache", True)] + ([] if "off" in skip else [("cellcache_off", False)])
    for rep in range(args.repeat):
        for key, prefix in (modes if rep % 2 == 0 else modes[::-1]):
            log(f"[serve] {key} (prefix cache {'on' if prefix else 'off'})")
            r = run(prefix)
            log(f"[serve] {key}: {r['tokens_per_s']:.0f} tokens/s, prompt tokens computed "
                f"{r['computed_tokens']} (ideal {work['ideal_computed']})")
            if key not in res or r["tokens_per_s"] > res[key]["tokens_per_s"]:
                res[key] = r
            res.setdefault("runs", []).append({"run": key, "tokens_per_s": r["tokens_per_s"]})
            save()
    if device == "cuda" and name == "default":
        # The GPU time of the decode steps, for the host-time target (the default workload's),
        # comes from one more run of it (prefix cache on) with CUDA events around each decode
        # replay and the breakdown after it: the events' own host cost stays out of the timed
        # runs' host phases, which the target reads.
        log("[serve] cellcache, GPU timing pass (events around the decode replays)")
        t = run(True, breakdown_=True)
        r = res["cellcache"]
        for k in ("decode_gpu_ms_median", "decode_gpu_rows", "decode_gpu_samples", "breakdown"):
            if k in t:
                r[k] = t[k]
        r["gpu_timing_pass"] = {"tokens_per_s": t["tokens_per_s"],
                                "decode_host_us_per_step_total": t["decode_host_us_per_step_total"],
                                "same_outputs": t["outputs"] == r["outputs"]}
        save()
    if name == "default" and args.arrival == "staggered" and "staggered" not in skip:
        log("[serve] cellcache, staggered")
        res["cellcache_staggered"] = run(True, "staggered")
        save()
    if name == "default" and args.arrival == "poisson":
        # "All together" offers everything at once. Poisson arrivals at the rate it completes
        # requests (capacity) cannot match its throughput whatever the server does: the last
        # arrival comes about when "all together" has finished, and its own new_tokens decode
        # steps follow. At 4x that rate the queue fills (offered load above capacity), so the
        # throughput measures the server, as "all together" does: the target's comparison.
        completes = n / res["cellcache"]["seconds"]         # requests a second, all together
        rates = [("cellcache_poisson", args.rate or 4 * completes)]
        if args.rate is None:
            rates.append(("cellcache_poisson_at_capacity", completes))
        for key, rate in rates:
            log(f"[serve] cellcache, Poisson arrivals at {rate:.2f} requests/s")
            res[key] = run(True, "poisson", rate=rate)
            res[key]["rate_per_s"] = rate
            res[key]["offered_vs_capacity"] = rate / completes
            save()
    hf_runs = {"default": ("hf-batch", "hf-static"), "shared": ("hf-batch",), "chat": ()}[name]
    for hf in hf_runs:
        if hf in skip:
            continue
        fn = hf_batch if hf == "hf-batch" else hf_static
        log(f"[serve] {hf}")
        try:
            fn(model, work["prompts"][:4], 4, device)                  # warm-up
            res[hf] = fn(model, work["prompts"], new, device)
            log(f"[serve] {hf}: {res[hf]['tokens_per_s']:.0f} tokens/s")
        except Exception as e:  # noqa: BLE001 - reported in the table
            res[hf] = {"error": f"{type(e).__name__}: {e}"[:300]}
        save()
    base = res["cellcache"]["outputs"]
    for key in ("cellcache_off", "cellcache_staggered", "cellcache_poisson", "cellcache_poisson_at_capacity",
                "hf-batch", "hf-static"):
        r = res.get(key, {})
        if "outputs" in r:
            same = sum(a == b for a, b in zip(base, r["outputs"]))
            r["same_outputs_as_cellcache"] = f"{same}/{len(base)}"

    print()
    print(f"workload {name}: {json.dumps({k: v for k, v in w.items()})}")
    print(f"{'run':<29} {'tokens/s':>10} {'seconds':>9} {'computed':>10} {'cached':>10} "
          f"{'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'ITL p50 ms':>11} {'ITL p99 ms':>11} "
          f"{'cellcache is':>13}")
    ours_tps = res["cellcache"]["tokens_per_s"]
    def ms(r: dict, key: str, width: int) -> str:
        v = r.get(key)
        return f"{v:>{width}.2f}" if isinstance(v, float) else " " * width

    for key in ("cellcache", "cellcache_off", "cellcache_staggered", "cellcache_poisson",
                "cellcache_poisson_at_capacity", "hf-batch", "hf-static"):
        r = res.get(key)
        if r is None:
            continue
        if "error" in r:
            print(f"{key:<29} {'failed: ' + r['error'][:60]}")
            continue
        comp = r.get("computed_tokens", "")
        cached = r.get("cached_tokens", "")
        ratio = ours_tps / r["tokens_per_s"]
        print(f"{key:<29} {r['tokens_per_s']:>10.0f} {r['seconds']:>9.2f} {comp!s:>10} {cached!s:>10} "
              f"{ms(r, 'ttft_ms_p50', 12)} {ms(r, 'ttft_ms_p99', 12)} {ms(r, 'itl_ms_p50', 11)} "
              f"{ms(r, 'itl_ms_p99', 11)} {ratio:>12.2f}x")
    for key in ("cellcache_off", "cellcache_staggered", "cellcache_poisson", "cellcache_poisson_at_capacity",
                "hf-batch", "hf-static"):
        if "same_outputs_as_cellcache" in res.get(key, {}):
            same = res[key]["same_outputs_as_cellcache"]
            print(f"{key}: same greedy outputs as cellcache for {same} requests")
    bd = res["cellcache"].get("breakdown", {})
    if bd:
        print(f"decode step of {bd['decode_rows']} rows: forward {bd['forward_ms']:.2f} ms = attention "
              f"{bd['attention_ms']:.2f} ms + rest of the model {bd['rest_of_model_ms']:.2f} ms; "
              f"prepare_step {res['cellcache']['prepare_step_host_us_median']:.0f} us host (median)")
    for key in ("cellcache", "cellcache_off"):
        r = res.get(key, {})
        if "mixed_steps" in r:
            print(f"{key}: {r['mixed_steps']} mixed steps {r['mixed_step_ms_total']:.0f} ms (median "
                  f"{r['mixed_step_ms_median']:.2f}), {r['decode_steps']} decode steps "
                  f"{r['decode_step_ms_total']:.0f} ms (median {r['decode_step_ms_median']:.2f}), "
                  f"prepare_step {r['prepare_step_host_us_median']:.0f} us (median)")
        if "decode_host_us_per_step" in r:
            parts = ", ".join(f"{k} {v:.0f}" for k, v in r["decode_host_us_per_step"].items())
            print(f"{key}: host per decode step {r['decode_host_us_per_step_total']:.0f} us "
                  f"(async_steps={r['async_steps']}): {parts} (wait: blocked on the device)")

    targets = []
    ideal = work["ideal_computed"]
    computed = res["cellcache"]["computed_tokens"]
    off = res.get("cellcache_off")
    if name == "default":
        if off:
            ratio = ours_tps / off["tokens_per_s"]
            targets.append((ratio >= 0.98, f"prefix cache on within 2% of off ({ratio:.3f}x)"))
        for key in ("cellcache_staggered", "cellcache_poisson"):
            if key in res:
                ratio = ours_tps / res[key]["tokens_per_s"]
                load = res[key].get("offered_vs_capacity")
                at = "" if load is None else f", offered load {load:.1f}x what all together completes"
                targets.append((ratio <= 1.25, f"{key.split('_')[1]} arrivals within 1.25x of all "
                                               f"together ({ratio:.2f}x{at})"))
        if "cellcache_poisson_at_capacity" in res:
            r = res["cellcache_poisson_at_capacity"]
            ratio = ours_tps / r["tokens_per_s"]
            # no server finishes before its last request arrives and decodes its new tokens
            floor_s = max(res["cellcache"]["seconds"],
                          r["last_arrival_s"] + new * 1e-3 * r["decode_step_ms_median"])
            floor = floor_s / res["cellcache"]["seconds"]
            targets.append((ratio <= 1.25, f"poisson arrivals at exactly the rate all together "
                                           f"completes, within 1.25x ({ratio:.2f}x; the arrivals "
                                           f"alone impose {floor:.2f}x: last at "
                                           f"{r['last_arrival_s']:.2f} s, then {new} decode steps)"))
        if device == "cuda":                  # issue #20's targets, for the H200
            targets.append((ours_tps >= 30_000, f">= 30,000 tokens/s ({ours_tps:,.0f})"))
            for key, times in (("hf-static", 5), ("hf-batch", 25)):
                if "tokens_per_s" in res.get(key, {}):
                    ratio = ours_tps / res[key]["tokens_per_s"]
                    targets.append((ratio >= times, f">= {times}x HF {key[3:]} ({ratio:.2f}x)"))
    elif name == "shared":
        if off:
            ratio = ours_tps / off["tokens_per_s"]
            targets.append((ratio >= 3, f">= 3x the throughput with the prefix cache off ({ratio:.2f}x)"))
        targets.append((computed == ideal, f"prompt tokens computed = the ideal ({computed} vs {ideal})"))
    else:
        targets.append((computed == ideal, f"prompt tokens computed = the ideal ({computed} vs {ideal})"))
        r = res["cellcache"]
        itl = "" if r["itl_ms_p50"] is None else \
            f"; inter-token p50 {r['itl_ms_p50']:.2f} ms, p99 {r['itl_ms_p99']:.2f} ms"
        print(f"TTFT: p50 {r['ttft_ms_p50']:.1f} ms, p99 {r['ttft_ms_p99']:.1f} ms over "
              f"{r['turns_done']} turns{itl}")
    r = res["cellcache"]
    if "decode_gpu_ms_median" in r and "decode_host_us_per_step_total" in r:
        host_us, gpu_us = r["decode_host_us_per_step_total"], 1e3 * r["decode_gpu_ms_median"]
        targets.append((host_us <= 0.1 * gpu_us, f"host time per decode step <= 10% of its GPU time "
                        f"({host_us:.0f} us vs the {r['decode_gpu_rows']}-row decode forwards of the "
                        f"timing pass, "
                        f"{gpu_us:.0f} us median on the GPU: {100 * host_us / gpu_us:.1f}%)"))
    for ok, text in targets:
        print(f"target {'met ' if ok else 'MISSED'}: {text}")
    res["targets"] = [{"met": ok, "target": text} for ok, text in targets]
    save()
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
