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
  off), on CUDA without shared-prefix attention too (``cellcache_ungrouped``; target: on
  within 2% of off, as nothing is shared), the same requests arriving otherwise
  (``--arrival``: ``staggered``, 32 every 16 steps, the default; ``poisson``, a seeded
  Poisson process of ``--rate`` requests a second, by default 4x the rate "all together"
  completed requests at, so that the offered load exceeds capacity as it does all together;
  target: within 1.25x of all together; the run at exactly that rate is a second target
  line: its last arrival's decode steps come after "all together" would have finished,
  whatever the server does, so its target is 1.25x of the floor those arrivals impose), HF
  ``generate_batch`` and static ``generate``.
- ``shared``: a system prompt: 512 requests of 2048 shared + 128 own tokens, 128 new:
  prefix cache on and off (target: on >= 3x off; with shared-prefix attention, issue 43's:
  >= 5x off and >= 80K tokens/s), the prefix cache on without shared-prefix attention
  (``cellcache_ungrouped``: ``cellcache.torch.CASCADE_MIN_SHARED = 0``; on CUDA the decode
  step of each, timed by events in one more run each: target grouped <= 0.4x ungrouped),
  prompt tokens computed against the ideal 2048 + 512 x 128 (target: equal), HF
  ``generate_batch`` on the same requests.
- ``grpo``: GRPO-like rollouts: 64 prompts of 1024 tokens, ``n=16`` continuations each at
  temperature 1 (seeded by the request), 512 new: on CUDA with shared-prefix attention and
  without (``cellcache_ungrouped``; target: >= 2x), each decode step's GPU time by events.
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
cellcache's (eager steps); ``--native`` runs cellcache's own forward of the model
(:mod:`cellcache.native`) in every cellcache run and the agreement check, with a run on
the model's modules beside it (``cellcache_modules``). Every cellcache run reports time to
first token and inter-token latency, p50 and p99 (``Generator.latency()``), and a reading of
the host CPU's speed before and after it (``cpu_probe_us``: a fixed piece of pure-Python
work, timed), so that a run's host time can be read against the machine's state. On CUDA the
default workload runs once more with CUDA events around each decode replay: its decode GPU
time and breakdown are the host-time target's denominator, while the host phases come from
the timed run, which carries no events. ``--profile-steps N`` (with or without ``--tp``)
serves the first run's requests once more on its generator with ``torch.profiler`` over N
steady decode steps from the middle of the run (``--profile-kind mixed``: N mixed steps, prompt
chunks beside decode rows, from the middle of those), on every rank, and prints where a
step's time goes (GPU time by kernel category, GPU idle, host time, the top kernels).

Trust and fairness. A speed figure counts only for a configuration that computes the model
it serves: after the timed runs the workload is served once more on the same configuration
and ``--check-requests`` of its requests (chosen at random) have every sampled row's logits
compared with HF's own forward over the same tokens, in float32 (the reference) and in the
served dtype (the noise floor) (:mod:`cellcache.generate.agreement`); the run exits 1,
saying where, when they do not agree (``--no-check`` skips it and the JSON says the figures
do not count). Every side is treated alike: ``--repeat N`` runs each side N times (HF's
too) and every figure is the median run, each run with a CPU probe around it; HF runs with
its own fast options (static ``generate`` compiled, as transformers does by default for a
static cache; ``generate_batch`` with CUDA graphs, asynchronous batching and
``--hf-compile-level``); ``generate_batch``'s outputs are matched to prompts by the prompt
each carries. ``--legacy-baselines`` adds HF as it was once measured (eager static,
``generate_batch`` at its defaults, one run against cellcache's best) to print both ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import RESULTS, cell_bytes, log, require_gpu, run_record

from cellcache._cli import Parser, in_range, output_file, run_main

WORKLOADS = {
    #            requests, prompt_len, new_tokens, shared_len, turns, message_len
    "default": dict(requests=256, prompt_len=512, new_tokens=256, shared_len=0, turns=1, message_len=0),
    "shared": dict(requests=512, prompt_len=128, new_tokens=128, shared_len=2048, turns=1, message_len=0),
    "chat": dict(requests=64, prompt_len=256, new_tokens=128, shared_len=0, turns=8, message_len=64),
    "grpo": dict(requests=64, prompt_len=1024, new_tokens=512, shared_len=0, turns=1, message_len=0, n=16,
                 buckets=[16, 32, 64, 128, 256, 512, 1024]),      # decode graphs up to its 1024 rows
}
DEFAULT_MODEL = "qwen2-0.5b"
QUICK = {
    "default": dict(requests=8, prompt_len=32, new_tokens=16),
    "shared": dict(requests=16, prompt_len=8, new_tokens=8, shared_len=64),
    "chat": dict(requests=4, prompt_len=24, new_tokens=8, turns=3, message_len=6),
    "grpo": dict(requests=4, prompt_len=32, new_tokens=8, n=4, buckets=None),
}


def seqs_of(w: dict, requests: int) -> int:
    """The sequences a run of ``requests`` needs at once (``max_seqs``): a few spare, or with
    ``n`` continuations exactly ``n`` a request (so the largest decode step is a bucket)."""
    n = w.get("n", 1)
    return requests * n if n > 1 else requests + 8


def sampling_of(w: dict, new_tokens: int):
    """A request's sampling in workload ``w``: greedy, or (``n`` > 1, the GRPO-like workload)
    ``n`` continuations at temperature 1, seeded by the request's id."""
    from cellcache.generate import Sampling

    n = w.get("n", 1)
    return Sampling(max_new_tokens=new_tokens, n=n, temperature=1.0 if n > 1 else 0.0)


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def cpu_probe() -> float:
    """Microseconds a fixed piece of pure-Python work takes now (the kind the host phases
    do: list appends, dict stores, attribute reads), the median of 7: a reading of the
    host CPU's own speed, recorded beside each run's host time so that a slow run can be
    told apart from a slow machine (the host time of one tree varies between runs on one
    machine far more than its GPU time does)."""
    def work() -> int:
        xs: list[int] = []
        d: dict[int, int] = {}
        for i in range(4000):
            xs.append(i)
            d[i & 63] = i
        return len(xs) + len(d)

    times = []
    for _ in range(7):
        t = time.perf_counter()
        work()
        times.append(time.perf_counter() - t)
    return round(1e6 * statistics.median(times), 1)


#: The runs compared with the timed configuration ("cellcache"), in the table's order.
COMPARED = ("cellcache_off", "cellcache_ungrouped", "cellcache_modules", "cellcache_staggered",
            "cellcache_poisson", "cellcache_poisson_at_capacity", "hf-batch", "hf-static",
            "hf-batch-legacy", "hf-static-legacy")


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
                    compile=w.get("compile", False), attention=w.get("attention", "auto"),
                    spill_bytes=w.get("spill_bytes", 0),
                    spill_prefixes=bool(w.get("spill_prefixes")) and prefix, buckets=w.get("buckets"),
                    native=bool(w.get("native")))
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
    # the generator's graph replays so far (its warm-up's included), of them the decode
    # steps replayed without the shared-prefix pass (their rows could not group), and of
    # those the ones without the merge too (enough rows that no run could be split)
    res["replays"] = getattr(gen.runner, "replays", 0)
    res["flat_replays"] = getattr(gen.runner, "flat_replays", 0)
    res["lean_replays"] = getattr(gen.runner, "lean_replays", 0)
    # steps launched while the one before was on the device (their host time hidden)
    res["ahead_steps"] = {"decode": prof["decode_ahead_steps"], "mixed": prof["mixed_ahead_steps"]}
    res["host_ms"] = {k: round(v, 3) for k, v in prof["host_ms"].items()}        # every step
    res["decode_host_ms"] = {k: round(v, 3) for k, v in prof["decode_host_ms"].items()}
    n_dec = max(1, prof["decode_steps"])
    # host work a decode step costs (every phase but "wait": blocked on the device)
    res["decode_host_us_per_step"] = {k: round(1e3 * v / n_dec, 1) for k, v in prof["decode_host_ms"].items()}
    res["decode_host_us_per_step_total"] = round(
        1e3 * sum(v for k, v in prof["decode_host_ms"].items() if k != "wait") / n_dec, 1)
    if prof["mixed_steps"]:         # the same for the mixed steps (prompt chunks, admissions)
        res["mixed_host_us_per_step_total"] = round(
            1e3 * sum(v for k, v in prof["mixed_host_ms"].items() if k != "wait") / prof["mixed_steps"], 1)
    if gen.prefix is not None:
        m = gen.prefix.metrics()
        res["prefix"] = {k: m[k] for k in ("cached_tokens", "leaves", "hits", "hit_tokens",
                                           "evictions", "evicted_tokens", "insert_skipped")}
    return res


def staggered(gen, prompts: list, sampling) -> list:
    """Serves ``prompts`` on ``gen`` to the end, 32 arriving every 16 steps (none left: the
    requests already added run out); returns the requests added here."""
    pending, reqs, steps = list(prompts), [], 0
    while pending or gen.busy:
        if pending and steps % 16 == 0:
            reqs += [gen.add(p, sampling) for p in pending[:32]]
            pending = pending[32:]
        if not gen.step() and not pending:
            break
        steps += 1
    return reqs


def ours(model, prompts, new_tokens, arrival: str, capacity: int, w: dict, device: str,
         prefix: bool = True, with_breakdown: bool = False, rate: float = 0.0, seed: int = 0,
         profile_steps: int = 0, profile_to: tuple[Path, str] | None = None,
         profile_kind: str = "decode") -> dict:
    """Every prompt served: all arriving ``"together"``, ``"staggered"`` (32 every 16 steps)
    or at the times of a seeded Poisson process of ``rate`` requests a second (``"poisson"``:
    added by a client thread while this one steps, as a server would see them).
    ``profile_steps``: then the same prompts once more on the same generator, all together,
    through :func:`profile_pass` over steps of ``profile_kind`` (its summary in
    ``res["profile"]``, its files written to ``profile_to``: folder, stem)."""
    from cellcache.generate import poisson_arrivals, serve_arrivals

    gen = make_gen(model, w, prefix, capacity, seqs_of(w, len(prompts)))
    sampling = sampling_of(w, new_tokens)
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
    # each landed decode step's host time (every phase but "wait"), and the interpreter's
    # garbage collections during the run: where a mean above the typical step comes from
    gen.step_log = []
    gc_runs: list[tuple[int, float]] = []
    gc_start = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_runs.append((info["generation"], time.perf_counter() - gc_start[0]))

    gc.callbacks.append(on_gc)
    try:
        replay_events = _time_replays(gen) if with_breakdown and device == "cuda" else None
        _sync(device)
        probe_before = cpu_probe()
        sched = gen.scheduler
        flush0 = (sched.flush_s, sched.flushed_tokens)
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
            reqs += staggered(gen, pending, sampling)
        _sync(device)
        elapsed = time.perf_counter() - t0
    finally:                                  # (a failed run leaves no callback behind)
        gc.callbacks.remove(on_gc)
    step_info = [(rows, prof) for kind, rows, prof in gen.step_log if kind == "decode"]
    step_host = [sum(v for k, v in prof.items() if k != "wait") for _, prof in step_info]
    gen.step_log = None
    res = summarize(gen, elapsed, reqs)
    res["cpu_probe_us"] = {"before": probe_before, "after": cpu_probe()}
    res["arrival"] = arrival if arrival != "poisson" else f"poisson {rate:.2f} requests/s"
    if step_host:
        us = sorted(1e6 * h for h in step_host)
        top = us[-max(1, len(us) // 20):]
        res["decode_host_us_distribution"] = {
            "mean": round(statistics.mean(us), 1), "median": round(statistics.median(us), 1),
            "p90": round(us[int(0.9 * (len(us) - 1))], 1), "max": round(us[-1], 1),
            "top5pct_share": round(sum(top) / sum(us), 3),
            # each phase's median over the decode steps: the steady step, which the mean hides
            "phase_median": {k: round(1e6 * statistics.median(prof[k] for _, prof in step_info), 1)
                             for k in step_info[0][1] if k != "wait"}}
        # the costliest steps: their number among the run's decode steps, rows, phases (us)
        worst = sorted(range(len(step_host)), key=step_host.__getitem__)[-8:][::-1]
        res["decode_host_costliest"] = [
            {"step": i, "rows": step_info[i][0], "host_us": round(1e6 * step_host[i]),
             **{k: round(1e6 * v) for k, v in step_info[i][1].items() if k != "wait"}} for i in worst]
    res["gc"] = {"collections": [sum(1 for g, _ in gc_runs if g == k) for k in range(3)],
                 "ms": round(1e3 * sum(t for _, t in gc_runs), 2)}
    # the steady steps' tokens appended to the requests' lists in the run, wherever that
    # happened (a row ending, a non-steady step, the end of the run): host work
    # the decode steps' phases leave out when it falls outside them
    flush_ms = 1e3 * (sched.flush_s - flush0[0])
    res["backlog_flush"] = {"ms": round(flush_ms, 2), "tokens": sched.flushed_tokens - flush0[1],
                            "us_per_decode_step": round(1e3 * flush_ms / max(1, len(step_host)), 1)}
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
        mixed = []
        for T, a, b in replay_events:
            if T is None:
                mixed.append(a.elapsed_time(b))
            else:
                rows.setdefault(T, []).append(a.elapsed_time(b))
        if mixed:             # the mixed steps' forwards: their host target's denominator
            res["mixed_gpu_ms_median"] = statistics.median(mixed)
            res["mixed_gpu_samples"] = len(mixed)
        if rows:
            T = max(rows, key=lambda k: len(rows[k]))
            res["decode_gpu_ms_median"] = statistics.median(rows[T])
            res["decode_gpu_rows"] = T
            res["decode_gpu_samples"] = len(rows[T])
    if with_breakdown and device == "cuda":
        res["breakdown"] = breakdown(gen, model)
    if profile_steps:
        gen.step, gen.cache.prepare_step = real_step, real_prepare    # the timers off
        if gen.prefix is not None:            # the same cache state as the run it profiles:
            gen.prefix.clear()                # no prompt of its own first pass to hit
        start = max(0, (gen.profile[f"{profile_kind}_steps"] - profile_steps - PROFILE_WARMUP) // 2)
        summary = profile_pass(gen, prompts, new_tokens, profile_steps, start, device, kind=profile_kind)
        folder, stem = profile_to or (RESULTS, "serve")
        res["profile"] = save_profile(summary, folder, stem, 0)
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
    kv = gen.scheduler.kv
    if kv.spiller is not None:          # the host tier: its copies' device and host time
        res["host_tier"] = {**kv.spiller.settle(), **({"prefixes": dict(kv.l2.stats)} if kv.l2 else {})}
    res["outputs"] = [r.outputs[0] for r in reqs]
    gen.cache.close()
    return res


def _host_tier_line(t: dict) -> str:
    """The host tier's copies: how many, how many bytes, their device and host seconds."""
    gib = 1 << 30

    def rate(nbytes: float, seconds: float) -> str:
        return f"{nbytes / seconds / gib:.1f} GiB/s" if seconds else "-"

    line = (f"{t['spilled']:.0f} copies down ({t['spill_bytes_moved'] / gib:.2f} GiB, device "
            f"{t['spill_s']:.2f} s = {rate(t['spill_bytes_moved'], t['spill_s'])}, host "
            f"{t['spill_host_s']:.2f} s), {t['restored_tokens']:.0f} tokens up "
            f"({t['restored_bytes'] / gib:.2f} GiB, device {t['restore_s']:.2f} s = "
            f"{rate(t['restored_bytes'], t['restore_s'])}, host {t['restore_host_s']:.2f} s)")
    if "prefixes" in t:
        line += "; prefixes " + ", ".join(f"{k} {v}" for k, v in t["prefixes"].items())
    return line


def _time_replays(gen) -> list:
    """Wraps the runner's forward so that each decode step it replays from a graph, and each
    mixed step's forward (a run of several rows; replayed or eager), records a CUDA event
    pair around it on the stream (events made beforehand: no allocation in the timed
    steps); returns the list of (bucket, start, end) the run fills, bucket None for a mixed
    step."""
    import torch

    runner = gen.runner
    real = runner.forward
    pool = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(4096)]
    out: list = []

    def timed(step, tokens=None, logit_rows=None, decode=False, **kw):
        if len(out) >= len(pool):
            return real(step, tokens, logit_rows, decode, **kw)
        a, b = pool[len(out)]
        replays = runner.replays
        a.record()
        logits = real(step, tokens, logit_rows, decode, **kw)
        b.record()
        if step.width > step.n_runs:    # a run of several rows (a prompt chunk, drafts):
            out.append((None, a, b))       # a mixed step, graphs or not
        elif decode and runner.replays > replays:
            out.append((step.pad_to, a, b))
        return logits

    runner.forward = timed
    return out


def breakdown(gen, model) -> dict:
    """Where a 256-row decode step goes: prepare_step (host), the whole forward (graph
    replay, without the float32 logits: as the workload's greedy steps replay it), and the
    attention kernels alone (24 layers, same shapes and lists)."""
    import torch

    runner, view = gen.runner, gen.runner.view
    # the flavor the run's decode steps replayed the most (rows that cannot group: the
    # graphs without the shared-prefix pass), never the one without the merge: it promises
    # a step's runs, and the buffers hold the run's last step (the profile times it served)
    graphs = runner.flat_graphs if 2 * runner.flat_replays > runner.replays else runner.graphs
    if not graphs:
        return {}
    runner.write_logits(False)
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


def _by_prompt(prompts: list, results: Any) -> list:
    """``generate_batch``'s outputs in the order of ``prompts``: its results are keyed by
    request id and may come in the order they finished; each carries its prompt."""
    slot: dict[tuple, list[int]] = {}
    for i, p in enumerate(prompts):
        slot.setdefault(tuple(p), []).append(i)
    outs: list = [None] * len(prompts)
    for r in results.values():
        i = slot[tuple(r.prompt_ids)].pop(0)
        outs[i] = list(r.generated_tokens)
    return outs


def hf_batch(model, prompts, new_tokens, device: str = "cuda", fast: bool = True,
             compile_level: int = 1) -> dict:
    """HF's continuous batching (``generate_batch``), greedy, on SDPA attention. ``fast``:
    with the options this transformers version has for speed (CUDA graphs, asynchronous
    batching, ``default_compile_level``), as a user after throughput would set them; else
    at its defaults (which turn graphs and asynchronous batching off for SDPA, an attention
    that needs a mask)."""
    from transformers import GenerationConfig

    model.set_attn_implementation("sdpa")
    cfg = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    extra: dict = {}
    if fast and device == "cuda":
        from transformers import ContinuousBatchingConfig

        # half the free memory for its cache (far more than the workload needs): its
        # default 90% leaves no room for compiling and capturing
        extra["continuous_batching_config"] = ContinuousBatchingConfig(
            use_cuda_graph=True, use_async_batching=True, default_compile_level=compile_level,
            max_memory_percent=0.5)
    _sync(device)
    t0 = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=cfg, **extra)
    _sync(device)
    elapsed = time.perf_counter() - t0
    outs = _by_prompt(prompts, results)
    n = sum(len(o) for o in outs if o is not None)
    return {"seconds": elapsed, "tokens_out": n, "tokens_per_s": n / elapsed, "outputs": outs,
            "options": "graphs, async batching, compile level " + str(compile_level)
            if extra else "defaults"}


def hf_static(model, prompts, new_tokens, device: str = "cuda", fast: bool = True) -> dict:
    """HF's ``generate`` with a static cache over the whole batch (left-padded), greedy, on
    SDPA. ``fast``: as transformers runs it by default, the decoding forward compiled (it
    compiles it for a static cache); else eager (``disable_compile=True``)."""
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
    compiled = fast and device == "cuda"         # (the CPU smoke run stays eager)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0, cache_implementation="static",
                         disable_compile=not compiled)
    _sync(device)
    elapsed = time.perf_counter() - t0
    gen = out[:, width:]
    n = int(gen.numel())
    return {"seconds": elapsed, "tokens_out": n, "tokens_per_s": n / elapsed,
            "outputs": gen.tolist(), "options": "compiled decoding" if compiled else "eager"}


def median_run(runs: list[dict]) -> dict:
    """The run a figure reports: the median by tokens/s (the lower middle one of an even
    count), with every run's tokens/s and the best beside it."""
    ranked = sorted(runs, key=lambda r: r["tokens_per_s"])
    pick = dict(ranked[(len(ranked) - 1) // 2])
    pick["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
    pick["tokens_per_s_best"] = ranked[-1]["tokens_per_s"]
    return pick


def copies_crowd(model, capacity: int, free: int, shards: int = 1) -> bool:
    """Whether the agreement check's two copies of ``model`` (float32 and the served dtype:
    three times its bf16 bytes) and a cache of ``capacity`` cells would not fit together in
    ``free`` bytes of GPU memory with a tenth of them to spare (an 8B model on an 80 GB card):
    then the copies wait on the host (:func:`tapped_run`'s ``park``). ``shards``: the ranks
    of a tensor-parallel run, whose cache holds a ``1 / shards`` of each cell on rank 0."""
    cell = cell_bytes(model.config, next(model.parameters()).element_size())
    weights = sum(p.numel() for p in model.parameters()) * 6            # float32 + bf16
    return weights + capacity * cell // shards > 0.9 * free


def agreement_pass(model, prompts, new_tokens, capacity: int, w: dict, device: str, models: tuple,
                   sample: int, seed: int, park: bool = False) -> dict:
    """The end-to-end agreement check of the configuration timed (cellcache.generate.agreement):
    every prompt served once more, all together, by a generator built as the timed ones
    (prefix cache on), through :func:`tapped_run` (``park``: the copies are on the host)."""
    gen = make_gen(model, w, True, capacity, seqs_of(w, len(prompts)))
    out = tapped_run(gen, prompts, [sampling_of(w, new_tokens)] * len(prompts), models, sample, seed,
                     park=park)
    gen.cache.close()
    return out


def not_checked() -> dict:
    """What a run records for its agreement check under ``--no-check``."""
    return {"passed": None, "summary": "not checked (--no-check): the figures do not count"}


def tapped_run(gen, prompts: list, samplings: list, models: tuple, sample: int, seed: int,
               park: bool = False) -> dict:
    """Every prompt served on ``gen`` all together (the batch shapes of the run timed), the
    logits of ``sample`` requests chosen at random recorded at every row they were sampled
    at, then compared with HF's own forward of the same weights over the same tokens
    (float32: the reference; the served dtype: the noise floor). ``park``: the models were
    kept on the host (``reference_models(..., device="cpu")``) so that the cache had the
    GPU's memory; for the comparison ``gen`` sleeps (level 1: its K/V memory given back),
    the models move to its device, and after it they go back and ``gen`` wakes."""
    import torch

    from cellcache.generate.agreement import LogitsTap, compare

    rng = np.random.default_rng(seed)
    chosen = set(rng.choice(len(prompts), size=min(sample, len(prompts)), replace=False).tolist())
    ids: set[int] = set()
    with LogitsTap(gen, keep=lambda r: r.id in ids) as tap:
        for i, (p, sp) in enumerate(zip(prompts, samplings)):
            req = gen.add(p, sp)
            if i in chosen:
                ids.add(req.id)
        gen.run()
    if not park:
        out = compare(tap.rows(), *models).as_dict()
    else:
        home = next(models[0].parameters()).device
        gen.sleep(1)
        try:
            for m in models:
                if m is not None:
                    m.to(gen.runner.device)
            out = compare(tap.rows(), *models).as_dict()
        finally:
            for m in models:
                if m is not None:
                    m.to(home)
            if gen.runner.device.type == "cuda":
                torch.cuda.empty_cache()
            gen.wake()
    out["requests"] = len(chosen)
    return out


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


# -- --profile-steps N: torch.profiler over N steady decode steps ---------------------------------
#: Steps the profiler runs before recording (its own start-up, CUPTI's first buffers, stays
#: out of the N recorded steps).
PROFILE_WARMUP = 2
#: Kernel (CPU: operator) categories of the profile table, in its order.
CATEGORIES = ("gemm", "collective", "attention", "cellcache_step", "memcpy", "other")
_ANNOTATIONS = ("cellcache.step", "cellcache.handover", "cellcache.prepare_step",
                "cellcache.forward", "cellcache.sample_launch")


def kernel_category(name: str) -> str:
    """The profile table's category of a GPU kernel (or, on the CPU, an operator) by name:
    memcpy (copies, memsets), collective (NCCL kernels; gloo/c10d ops on the CPU),
    attention (cellcache's kernels: paged decode/prefill/merge and its plan, store_kv,
    the tensor-core tc_share/tc_plan/tc_attend/tc_merge and the sm_90a tc90_ prefill;
    FlashInfer's; on the CPU, SDPA),
    cellcache_step (the step kernels build_step/apply_step), gemm (cuBLAS/cuBLASLt/CUTLASS
    kernels, aten matmuls on the CPU), other (elementwise, norms, rotary, argmax, ...)."""
    n = name.lower()
    if "memcpy" in n or "memset" in n or n in ("aten::copy_", "aten::to", "aten::_to_copy"):
        return "memcpy"
    if any(k in n for k in ("nccl", "gloo", "c10d", "all_reduce", "allreduce", "all_gather",
                            "allgather", "reduce_scatter", "broadcast_", "wait_tensor")):
        return "collective"
    if any(k in n for k in ("paged_decode", "paged_prefill", "paged_merge", "prefill_plan",
                            "store_kv", "tc_attend", "tc_plan", "tc_merge", "tc_share", "tc90_", "attend_",
                            "flashinfer", "batchdecode",
                            "batchprefill", "cellcache::attention", "scaled_dot_product")):
        return "attention"
    if n.startswith(("build_step", "apply_step")):
        return "cellcache_step"
    if any(k in n for k in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "gemv", "splitk",
                            "wgmma", "triton_tem", "aten::mm", "aten::addmm", "aten::bmm",
                            "aten::matmul", "aten::linear", "aten::baddbmm")):
        return "gemm"
    return "other"


def _annotate(gen, forward_events: list | None):
    """Wraps the generator's handover (TP), the cache's prepare_step, the runner's forward
    and the sampler's launch in ``record_function`` ranges (``cellcache.*``), for the host
    table; with ``forward_events`` (CUDA), each forward also records a CUDA event pair
    around it while ``forward_events`` is armed (its first item, a list of free pairs, is
    non-empty). Returns a function that takes the wrappers off."""
    from torch.profiler import record_function

    undo = []

    def wrap(obj, attr: str, label: str, events: bool = False) -> None:
        real = getattr(obj, attr)

        def wrapped(*a, **k):
            with record_function(label):
                if events and forward_events and forward_events[0]:
                    start, end = forward_events[0].pop()
                    start.record()
                    out = real(*a, **k)
                    end.record()
                    forward_events.append((start, end))
                    return out
                return real(*a, **k)

        had = attr in vars(obj) if hasattr(obj, "__dict__") else False
        setattr(obj, attr, wrapped)
        undo.append((obj, attr, real, had))

    if gen.tp is not None:
        wrap(gen.tp, "handover", "cellcache.handover")
    wrap(gen.cache, "prepare_step", "cellcache.prepare_step")
    wrap(gen.runner, "forward", "cellcache.forward", events=True)
    wrap(gen.sampler, "launch", "cellcache.sample_launch")

    def off() -> None:
        for obj, attr, real, had in reversed(undo):
            if had:
                setattr(obj, attr, real)
            else:
                try:
                    delattr(obj, attr)
                except AttributeError:
                    setattr(obj, attr, real)

    return off


def profile_pass(gen, prompts: list, new_tokens: int, steps: int, start_after: int, device: str,
                 add: bool = True, kind: str = "decode") -> dict:
    """Serves ``prompts`` (all arriving together; ``add``: this rank adds them, rank 0 under
    TP) on ``gen`` (idle, its graphs captured by the timed run) once more, with
    ``torch.profiler`` (CUDA activities on CUDA, the CPU's otherwise) over ``steps``
    consecutive ``step()`` calls once ``start_after`` steps of ``kind`` (``"decode"`` or
    ``"mixed"``: prompt chunks) have landed (the middle of the run's steps of that kind),
    after :data:`PROFILE_WARMUP` calls the profiler discards.
    Every rank runs it (the window is a function of the shared schedule). Returns
    :func:`profile_summary`'s dict for this rank; the pass's own throughput is not reported
    (the profiler's overhead is in it)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    from cellcache.generate import Sampling

    cuda = device == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    pairs = ([(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(steps + 4)] if cuda else [])
    fwd_events: list = [[]]                  # [free pairs while armed, then the used pairs]
    off = _annotate(gen, fwd_events if cuda else None)
    sampling = Sampling(max_new_tokens=new_tokens)
    if add:
        for p in prompts:
            gen.add(p, sampling)
    kept: list = []
    prof = None
    calls = 0                                # step() calls since the profiler started
    walls: list[float] = []
    kinds: list[str] = []
    p_before: dict = {}
    kind0 = gen.profile[f"{kind}_steps"]
    total = PROFILE_WARMUP + steps
    try:
        while True:
            d, m = gen.profile["decode_steps"], gen.profile["mixed_steps"]
            recording = prof is not None and PROFILE_WARMUP <= calls < total
            if recording and calls == PROFILE_WARMUP:
                fwd_events[0] = pairs[::-1]  # armed for the recorded calls
                p_before = {k: dict(gen.profile[k]) for k in ("host_ms", "decode_host_ms")}
                p_before["steps"], p_before["decode_steps"] = gen.profile["steps"], d
            s = time.perf_counter()
            with record_function("cellcache.step"):
                busy = gen.step()
            took = time.perf_counter() - s
            landed = ("decode" if gen.profile["decode_steps"] > d else
                      "mixed" if gen.profile["mixed_steps"] > m else "none")
            if prof is None:
                if landed == kind and gen.profile[f"{kind}_steps"] - kind0 >= start_after and busy:
                    prof = profile(activities=acts, schedule=schedule(
                        wait=0, warmup=PROFILE_WARMUP, active=steps, repeat=1),
                        on_trace_ready=kept.append)
                    prof.start()
            elif calls < total:
                if recording:
                    walls.append(took)
                    kinds.append(landed)
                calls += 1
                if calls == total:
                    fwd_events[0] = []
                    p_after = {k: dict(gen.profile[k]) for k in ("host_ms", "decode_host_ms")}
                    p_after["steps"] = gen.profile["steps"]
                    p_after["decode_steps"] = gen.profile["decode_steps"]
                prof.step()
            if not busy:
                break
    finally:
        if prof is not None and not kept:
            prof.stop()                      # the run ended inside the window
        off()
    if prof is None or not walls:
        more = "--new-tokens" if kind == "decode" else "requests or a smaller --max-batch-tokens"
        return {"error": f"the run ended before a profile window of {steps} steps after "
                         f"{start_after} {kind} steps (give fewer --profile-steps or more {more})",
                "steps": 0}
    if calls < total:
        p_after = {k: dict(gen.profile[k]) for k in ("host_ms", "decode_host_ms")}
        p_after["steps"], p_after["decode_steps"] = gen.profile["steps"], gen.profile["decode_steps"]
    if cuda:
        torch.cuda.synchronize()
    fwd_ms = [a.elapsed_time(b) for a, b in fwd_events[1:]]
    n_steps = max(1, p_after["steps"] - p_before["steps"])
    phases = {k: round(1e3 * (v - p_before["host_ms"].get(k, 0.0)) / n_steps, 1)
              for k, v in p_after["host_ms"].items()}
    summary = profile_summary(prof, len(walls), cuda)
    summary.update(
        window={"kind": kind, f"start_after_{kind}_steps": start_after, "warmup_calls": PROFILE_WARMUP,
                "kinds": {k: kinds.count(k) for k in sorted(set(kinds))}},
        step_wall_us={"median": round(1e6 * statistics.median(walls), 1),
                      "mean": round(1e6 * sum(walls) / len(walls), 1),
                      "max": round(1e6 * max(walls), 1)},
        host_phases_us_per_step=phases,
        host_us_per_step=round(sum(v for k, v in phases.items() if k != "wait"), 1))
    if fwd_ms:
        summary["forward_gpu_us"] = {"median": round(1e3 * statistics.median(fwd_ms), 1),
                                     "min": round(1e3 * min(fwd_ms), 1),
                                     "max": round(1e3 * max(fwd_ms), 1), "samples": len(fwd_ms)}
    summary["_prof"] = prof                  # for the trace export; dropped before JSON
    return summary


_RUNTIME = re.compile(r"cu(da)?[A-Z]")        # the driver's and the runtime's calls


def window_device_events(events: list) -> tuple[list, int | None]:
    """The device events (kernels, copies, memsets) of ``events`` (torch.profiler's
    ``prof.events()``) whose launch the window recorded, and how many were left out: with
    asynchronous steps the device is still running the forward launched just before the
    window when it opens, and the profiler records that forward's kernels too (a window of
    N steps then holds N + 1 forwards' worth of some kernels). A device event's ``id`` is
    its launch's correlation id, the same as the launching call's (``cudaGraphLaunch``,
    ``cuLaunchKernel``, a copy); an event whose launching call is not among the window's
    is left out. Where nothing matches (no call recorded, or ids that are not correlation
    ids) every device event is kept and the count is None."""
    from torch.autograd import DeviceType

    launched = {e.id for e in events if e.device_type == DeviceType.CPU and _RUNTIME.match(e.name)}
    device = [e for e in events
              if not (e.device_type == DeviceType.CPU or getattr(e, "is_user_annotation", False)
                      or e.name in _ANNOTATIONS or e.name.startswith("ProfilerStep"))]
    kept = [e for e in device if e.id in launched]
    if not kept:
        return device, None
    return kept, len(device) - len(kept)


def profile_summary(prof, steps: int, cuda: bool) -> dict:
    """Per-step numbers from a finished profiler over ``steps`` steps, from torch.profiler's
    own events: device time by :func:`kernel_category` (CUDA: every kernel, copy and memset
    the window recorded; CPU: the operators' self time), the GPU's busy time (union of its
    kernels), span (first start to last end) and idle gaps, the top 15 kernels, and host
    time by annotation and CUDA runtime call."""
    from torch.autograd import DeviceType

    events = prof.events()
    per: dict[str, list[float]] = {}          # name -> [total us, count]
    intervals: list[tuple[float, float]] = []
    devices: set = set()
    left_out: int | None = 0
    if cuda:
        device_events, left_out = window_device_events(events)
        for e in device_events:
            start, end = e.time_range.start, e.time_range.end
            intervals.append((start, end))
            devices.add(getattr(e, "device_index", None))
            row = per.setdefault(e.name, [0.0, 0])
            row[0] += end - start
            row[1] += 1
    host: dict[str, list[float]] = {}
    for a in prof.key_averages():
        if getattr(a, "device_type", DeviceType.CPU) != DeviceType.CPU:
            continue
        key = a.key
        if key in _ANNOTATIONS or _RUNTIME.match(key) \
                or key.startswith(("gloo", "c10d::")) or "nccl" in key.lower():
            host[key] = [a.cpu_time_total, a.count]
        if not cuda and not key.startswith(("cellcache.", "ProfilerStep")) and a.self_cpu_time_total > 0:
            per[key] = [float(a.self_cpu_time_total), a.count]
    n = max(steps, 1)
    cats = dict.fromkeys(CATEGORIES, 0.0)
    for name, (tot, _) in per.items():
        cats[kernel_category(name)] += tot
    out: dict[str, Any] = {
        "steps": steps, "activities": "cuda" if cuda else "cpu",
        "device_us_per_step": {k: round(v / n, 1) for k, v in cats.items()},
        "device_us_per_step_total": round(sum(cats.values()) / n, 1),
        "top_kernels": [{"name": name, "category": kernel_category(name),
                         "us_per_step": round(tot / n, 1), "calls_per_step": round(cnt / n, 2),
                         "us_per_call": round(tot / max(cnt, 1), 2)}
                        for name, (tot, cnt) in sorted(per.items(), key=lambda kv: -kv[1][0])[:15]],
        "host_us_per_step": {},
        "host_calls_per_step": {k: {"us": round(t / n, 1), "calls": round(c / n, 2)}
                                for k, (t, c) in sorted(host.items(), key=lambda kv: -kv[1][0])[:12]},
    }
    if cuda:
        out["devices"] = sorted(d for d in devices if d is not None)
        if intervals:
            intervals.sort()
            busy, gaps = 0.0, []
            cur_s, cur_e = intervals[0]
            for s, e in intervals[1:]:
                if s > cur_e:
                    busy += cur_e - cur_s
                    gaps.append(s - cur_e)
                    cur_s, cur_e = s, e
                else:
                    cur_e = max(cur_e, e)
            busy += cur_e - cur_s
            span = cur_e - intervals[0][0]
            out["gpu"] = {"span_us_per_step": round(span / n, 1), "busy_us_per_step": round(busy / n, 1),
                          "idle_us_per_step": round((span - busy) / n, 1),
                          "largest_gap_us": round(max(gaps, default=0.0), 1),
                          "gaps_over_50us": sum(g > 50 for g in gaps),
                          "kernels_per_step": round(len(intervals) / n, 1),
                          "launched_before_window": left_out}
        else:
            out["gpu"] = {"note": "no GPU activity recorded (CUPTI traced no kernel)"}
    return out


def profiled_breakdown(summary: dict) -> dict | None:
    """The profiled step's split from a ``--profile-steps`` summary (the served steps mid-run,
    per step): all kernels, attention, GEMMs and the rest, in ms; None for a summary without
    device activity (an error, a CPU profile)."""
    dev = summary.get("device_us_per_step")
    if "error" in summary or summary.get("activities") != "cuda" or not dev:
        return None
    total = summary.get("device_us_per_step_total", sum(dev.values()))
    att, gemm = dev.get("attention", 0.0), dev.get("gemm", 0.0)
    return {"steps": summary.get("steps"), "kernels_ms": total / 1e3, "attention_ms": att / 1e3,
            "gemm_ms": gemm / 1e3, "rest_ms": (total - att - gemm) / 1e3}


def print_profile(summaries: list[dict], title: str) -> None:
    """The profile table: a column per rank (``summaries[r]``)."""
    ok = [s for s in summaries if "error" not in s]
    print()
    print(f"profile: {title}")
    for r, s in enumerate(summaries):
        if "error" in s:
            print(f"  rank {r}: {s['error']}")
    if not ok:
        return
    ranks = [r for r, s in enumerate(summaries) if "error" not in s]
    head = "".join(f"{'rank ' + str(r):>12}" for r in ranks)
    w0 = ok[0]
    unit = "GPU" if w0["activities"] == "cuda" else "CPU (operators' self time)"
    kind = w0["window"].get("kind", "decode")
    print(f"  {w0['steps']} steps recorded (kinds {w0['window']['kinds']}), after "
          f"{w0['window'][f'start_after_{kind}_steps']} {kind} steps; us per step")
    print(f"  {'':<34}{head}")

    def line(label: str, get) -> None:
        vals = []
        for s in ok:
            try:
                v = get(s)
            except (KeyError, TypeError):
                v = None
            vals.append(f"{v:>12.1f}" if isinstance(v, (int, float)) else f"{'-':>12}")
        print(f"  {label:<34}{''.join(vals)}")

    line("step wall (median)", lambda s: s["step_wall_us"]["median"])
    line("step wall (mean)", lambda s: s["step_wall_us"]["mean"])
    if w0["activities"] == "cuda":
        line("forward on the GPU (events, median)", lambda s: s["forward_gpu_us"]["median"])
        line("GPU span (first to last kernel)", lambda s: s["gpu"]["span_us_per_step"])
        line("GPU busy (union of kernels)", lambda s: s["gpu"]["busy_us_per_step"])
        line("GPU idle (gaps)", lambda s: s["gpu"]["idle_us_per_step"])
        line("  largest single gap", lambda s: s["gpu"]["largest_gap_us"])
        line("  kernels per step", lambda s: s["gpu"]["kernels_per_step"])
        line("  kernels launched before, left out", lambda s: s["gpu"]["launched_before_window"])
    print(f"  {unit} time by category:")
    for c in CATEGORIES:
        line(f"  {c}", lambda s, c=c: s["device_us_per_step"][c])
    line("  sum", lambda s: s["device_us_per_step_total"])
    print("  host (profiler overhead included):")
    line("  host phases (Generator.profile)", lambda s: s["host_us_per_step"])
    for k in w0["host_phases_us_per_step"]:
        line(f"    {k}", lambda s, k=k: s["host_phases_us_per_step"][k])
    keys = list(dict.fromkeys(k for s in ok for k in s["host_calls_per_step"]))
    for k in keys:
        line(f"  {k[:32]}", lambda s, k=k: s["host_calls_per_step"][k]["us"])
    for r, s in zip(ranks, ok):
        print(f"  rank {r}: top kernels" + (f" (device {s['devices']})" if s.get("devices") else ""))
        print(f"    {'us/step':>9} {'calls':>6} {'us/call':>8}  {'category':<14} name")
        for k in s["top_kernels"]:
            print(f"    {k['us_per_step']:>9.1f} {k['calls_per_step']:>6.1f} {k['us_per_call']:>8.2f}  "
                  f"{k['category']:<14} {k['name'][:90]}")


def save_profile(summary: dict, folder: Path, stem: str, rank: int) -> dict:
    """Writes this rank's summary (``{stem}-profile-rank{rank}.json``) and chrome trace
    (``...-trace-rank{rank}.json.gz``) into ``folder``; returns the summary without the
    profiler object."""
    import gzip
    import shutil
    import tempfile

    prof = summary.pop("_prof", None)
    folder.mkdir(parents=True, exist_ok=True)
    if prof is not None:
        trace = folder / f"{stem}-trace-rank{rank}.json.gz"
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            try:
                prof.export_chrome_trace(str(raw))
                with open(raw, "rb") as fin, gzip.open(trace, "wb") as fout:
                    shutil.copyfileobj(fin, fout)
                summary["trace"] = str(trace)
            except Exception as e:  # noqa: BLE001 - the summary is what matters
                summary["trace_error"] = f"{type(e).__name__}: {e}"[:200]
    (folder / f"{stem}-profile-rank{rank}.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# -- tensor parallelism (issue 19): --tp N under torchrun ------------------------------------------
def tp_bench(p, args, argv: list[str]) -> int:
    """``torchrun --nproc-per-node N tools/bench_serve.py --model qwen2-7b --tp N`` (``--tp 1``
    without torchrun for the comparison): the default workload (256 requests x (512 + 256),
    all arriving together, greedy, prefix cache off) through ``Generator(tp=N)``, then HF
    ``generate_batch`` on the same sharded model. Reports tokens/s and rank 0's host time per
    step (wall time of ``step()``, and the host phases of ``Generator.profile`` when present);
    rank 0 writes the JSON (default: ``benchmarks/results/serve-tp{N}-{model}.json``). The
    configuration timed is checked end to end as one process's is (every prompt served once
    more; rank 0 compares ``--check-requests`` of them with HF's forward of the whole model,
    float32 and the served dtype, copies it made before the model was sharded): the run exits
    1 when they do not agree.

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
    # the agreement check's float32 reference and served-dtype noise floor, whole models on
    # rank 0 (which compares): copies made before a Generator shards the model; kept on the
    # host until the check (rank 0's generator asleep meanwhile) where they would crowd the
    # cache out of rank 0's GPU
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, model.config.vocab_size, size=plen).tolist() for _ in range(n)]
    capacity = n * (plen + new) + 4096
    models, park = None, False
    if not args.no_check and rank == 0:
        from cellcache.generate.agreement import reference_models

        park = device == "cuda" and copies_crowd(model, capacity, torch.cuda.mem_get_info()[0], world)
        models = reference_models(model, device="cpu" if park else None)

    words = ["python3", "tools/bench_serve.py", *argv] if world == 1 else \
        ["torchrun", "--nproc-per-node", str(world), "tools/bench_serve.py", *argv]
    record = run_record(result_name(args, world), words, device, gpus=world)
    path = args.json or RESULTS / f"{record['benchmark']}.json"

    def make(requests: int) -> Any:
        gen = Generator(model, capacity=capacity, max_batch_tokens=w["max_batch_tokens"],
                        max_seqs=requests + 8, prefill_chunk=w["prefill_chunk"], eos=[],
                        prefix_cache=False, tp=world if world > 1 else None)
        gen.warmup()                # the decode graphs on every rank, before the clock starts
        return gen

    def serve(batch: list, new_tokens: int, profile_steps: int = 0) -> dict:
        gen = make(len(batch))
        sampling = Sampling(max_new_tokens=new_tokens)
        for prompt in batch if rank == 0 else []:
            gen.add(prompt, sampling)
        step_s: list[float] = []
        by_kind: dict[str, list[float]] = {"mixed": [], "decode": [], "none": []}
        gp = gen.profile
        _sync(device)
        t0 = time.perf_counter()
        while True:
            m, d = gp["mixed_steps"], gp["decode_steps"]
            s = time.perf_counter()
            busy = gen.step()
            took = time.perf_counter() - s
            step_s.append(took)
            # a call is booked by the step it applied (async: it launches the next one)
            by_kind["mixed" if gp["mixed_steps"] > m else "decode" if gp["decode_steps"] > d
                    else "none"].append(took)
            if not busy:
                break
        _sync(device)
        elapsed = time.perf_counter() - t0
        st = gen.stats
        res = {"seconds": elapsed, "tokens_out": st["tokens_out"], "tokens_per_s": st["tokens_out"] / elapsed,
               "steps": st["steps"], "graph_steps": st["graph_steps"],
               "step_ms_median": 1e3 * statistics.median(step_s), "step_ms_mean": 1e3 * elapsed / len(step_s)}
        for kind, times in by_kind.items():      # where the run's seconds go, by kind of step
            res[f"{kind}_calls"] = len(times)
            res[f"{kind}_ms_total"] = 1e3 * sum(times)
            res[f"{kind}_ms_median"] = 1e3 * statistics.median(times) if times else 0.0
        prof = getattr(gen, "profile", None)
        if isinstance(prof, dict) and prof.get("steps"):
            host = {k: v for k, v in prof["host_ms"].items() if k != "wait"}
            res["host_ms_per_step"] = sum(host.values()) / prof["steps"]
            res["host_ms_by_phase"] = {k: v / prof["steps"] for k, v in host.items()}
            if prof.get("decode_steps"):
                res["decode_host_ms_per_step"] = sum(
                    v for k, v in prof["decode_host_ms"].items() if k != "wait") / prof["decode_steps"]
        if profile_steps:
            # after the timed run, on the same generator (graphs captured): the same requests
            # again, the profiler over steps from the middle of their decode steps
            kind = args.profile_kind
            start = max(0, (prof[f"{kind}_steps"] - profile_steps - PROFILE_WARMUP) // 2)
            summary = profile_pass(gen, batch, new_tokens, profile_steps, start, device, add=rank == 0,
                                   kind=kind)
            summary["rank"] = rank
            summary = save_profile(summary, path.parent, path.stem, rank)
            every = [summary]
            if world > 1:
                import torch.distributed as dist

                every = [None] * world
                dist.all_gather_object(every, summary, group=gen.tp.group)
            res["profile"] = every
        gen.cache.close()
        return res

    res: dict = {**record,
                 "workload": {"model": args.model, "device": device, "tp": world, "requests": n,
                              "prompt_len": plen, "new_tokens": new, "capacity": capacity,
                              "max_batch_tokens": w["max_batch_tokens"], "prefill_chunk": w["prefill_chunk"]}}
    if rank == 0:
        log(f"[serve-tp] tp={world} {args.model}: warm-up")
    serve(prompts[:8], 8)                                         # kernels, graphs
    res["cellcache"] = serve(prompts, new, args.profile_steps)
    if rank == 0:
        r = res["cellcache"]
        host = r.get("host_ms_per_step", float("nan"))
        log(f"[serve-tp] cellcache tp={world}: {r['tokens_per_s']:.0f} tokens/s, "
            f"step median {r['step_ms_median']:.2f} ms, host/step {host:.3f} ms; "
            f"{r['mixed_calls']} mixed steps {r['mixed_ms_total']:.0f} ms (median "
            f"{r['mixed_ms_median']:.2f}), {r['decode_calls']} decode steps {r['decode_ms_total']:.0f} ms "
            f"(median {r['decode_ms_median']:.2f})")
        if "profile" in r:
            print_profile(r["profile"], f"cellcache tp={world} {args.model}, {n} requests x "
                                        f"({plen} + {new}); files {path.parent}/{path.stem}-*-rank*")
    if not args.no_check:
        # the configuration timed, every prompt once more on every rank; rank 0 records the
        # logits of --check-requests of them and compares them with HF's forward
        if rank == 0:
            log(f"[serve-tp] agreement check: {args.check_requests} requests against HF's forward")
        gen = make(len(prompts))
        if rank == 0:
            assert models is not None
            res["agreement"] = tapped_run(gen, prompts, [Sampling(max_new_tokens=new)] * len(prompts),
                                          models, args.check_requests, args.seed, park=park)
            res["agreement"]["copies_parked"] = park
            del models
            log(f"[serve-tp] agreement: {res['agreement']['summary']}")
        else:
            gen.run()
        gen.cache.close()
    else:
        res["agreement"] = not_checked()
    if rank == 0:                                 # saved now, and again with HF's run
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=2, default=str) + "\n")
    if "hf-batch" not in set(filter(None, args.skip.split(","))):
        try:
            # at its defaults: its fast options are measured in one process (not under TP)
            hf_batch(model, prompts[:4], 4, device, fast=False)     # warm-up
            hf = hf_batch(model, prompts, new, device, fast=False)
            res["hf-batch"] = {k: v for k, v in hf.items() if k != "outputs"}
            res["hf-batch"]["how"] = ("transformers' TP plan (prepare_distribute_model + "
                                      "maybe_distribute_model)" if world > 1 else "one process")
            if args.profile_steps:            # (CUPTI may stay loaded after the profile pass)
                res["hf-batch"]["after_profiler"] = True
        except Exception as e:  # noqa: BLE001 - reported
            res["hf-batch"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        if rank == 0 and "tokens_per_s" in res["hf-batch"]:
            log(f"[serve-tp] HF generate_batch tp={world}: {res['hf-batch']['tokens_per_s']:.0f} tokens/s")
    if rank == 0:
        if "tokens_per_s" in res.get("hf-batch", {}):
            res["cellcache_vs_hf_batch"] = res["cellcache"]["tokens_per_s"] / res["hf-batch"]["tokens_per_s"]
        path.write_text(json.dumps(res, indent=2, default=str) + "\n")
        shown = {k: ({kk: vv for kk, vv in v.items() if kk != "profile"} if isinstance(v, dict) else v)
                 for k, v in res.items()}         # the profile: its table above, and the files
        print(json.dumps(shown, indent=2, default=str))
    if world > 1:
        import torch.distributed as dist

        dist.barrier()                    # every rank past its last collective first
        dist.destroy_process_group()
    return disagreement(res["agreement"]) if rank == 0 else 0


def result_name(args, world: int | None = None) -> str:
    """The benchmark a run records (the stem of its canonical file in benchmarks/results): the
    workload, then whatever sets the run apart from that workload's plain GPU run, so that
    a smoke run on the CPU never lands on a GPU result. ``world``: the ranks of a --tp run."""
    if world is not None:
        parts = [f"serve-tp{world}", args.model]
    else:
        parts = [f"serve-{args.workload}"]
        if args.compile:
            parts.append("compile")
        if args.native:
            parts.append("native")
        if args.attention == "flashinfer":
            parts.append("flashinfer")
        if args.arrival == "poisson" and args.workload == "default":
            parts.append("poisson")
        if args.model != DEFAULT_MODEL:
            parts.append(args.model)
        if args.capacity_share < 1:
            parts.append("small")
        if args.spill_gib:
            parts.append("l2" if args.spill_prefixes else "spill")
    if args.device != "cuda":
        parts.append(args.device)
    if args.quick:
        parts.append("quick")
    return "-".join(parts)


def _host_share(res: dict, kind: str) -> tuple[float, float, str] | None:
    """(host us, GPU us, how the host figure was read) of a ``kind`` ("decode" or "mixed")
    step: the host time of the prefix-cache-on run, the median of them with ``--repeat``
    (the host varies between runs of one tree far more than the GPU does), and the timing
    pass's median forward; None without both."""
    r = res["cellcache"]
    host, gpu = f"{kind}_host_us_per_step_total", f"{kind}_gpu_ms_median"
    if gpu not in r or host not in r:
        return None
    hosts = [e[host] for e in res.get("runs", []) if e["run"] == "cellcache" and host in e]
    of = f"median of {len(hosts)} runs ({', '.join(f'{h:.0f}' for h in hosts)}): " if len(hosts) > 1 else ""
    return statistics.median(hosts or [r[host]]), 1e3 * r[gpu], of


def mixed_host_target(res: dict) -> tuple[bool, str] | None:
    """Issue 42's host target for the mixed steps (prompt chunks beside decode rows), read as
    :func:`host_target` reads the decode steps': host time per mixed step (every phase but
    the wait) <= 10% of a mixed step's forward on the GPU (the timing pass's median, events
    around the forward). None without a GPU time or without mixed steps."""
    share = _host_share(res, "mixed")
    if share is None:
        return None
    host_us, gpu_us, of = share
    r = res["cellcache"]
    return (host_us <= 0.1 * gpu_us,
            f"host time per mixed step <= 10% of its GPU time ({of}{host_us:.0f} us vs the "
            f"{r['mixed_gpu_samples']} mixed forwards of the timing pass, {gpu_us:.0f} us median "
            f"on the GPU: {100 * host_us / gpu_us:.1f}%)")


def host_target(res: dict) -> tuple[bool, str] | None:
    """Issue #20's host target from a run's results: host time per decode step <= 10% of
    the decode step's GPU time (the timing pass's median forward). The host varies between
    runs of one tree far more than the GPU does, so with
    ``--repeat`` it reads the median of the prefix-cache-on runs. None without a GPU time."""
    share = _host_share(res, "decode")
    if share is None:
        return None
    host_us, gpu_us, of = share
    r = res["cellcache"]
    flushes = [e["backlog_flush"]["us_per_decode_step"] for e in res.get("runs", [])
               if e["run"] == "cellcache" and "backlog_flush" in e]
    lists = (f"; the steady steps' output lists, appended in the run wherever that fell: "
             f"{statistics.median(flushes):.0f} us per decode step") if flushes else ""
    return (host_us <= 0.1 * gpu_us,
            f"host time per decode step <= 10% of its GPU time ({of}{host_us:.0f} us vs the "
            f"{r['decode_gpu_rows']}-row decode forwards of the timing pass, {gpu_us:.0f} us median "
            f"on the GPU: {100 * host_us / gpu_us:.1f}%{lists})")


def main(argv=None) -> int:
    p = Parser(prog="bench_serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="default")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"built-in random model (default {DEFAULT_MODEL})")
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
                   help="runs of each side (cellcache on/off alternating, then each HF baseline): "
                        "every figure and ratio is the median run of each (the lower middle of an "
                        "even count), the best beside it in the JSON")
    p.add_argument("--no-check", action="store_true",
                   help="skip the end-to-end agreement check (the speed figures then do not count: "
                        "the JSON says so)")
    p.add_argument("--check-requests", type=in_range(1, 1 << 16), default=8,
                   help="requests of the workload whose every sampled row the agreement check "
                        "compares with HF's own forward (default 8)")
    p.add_argument("--hf-compile-level", type=in_range(0, 3), default=1,
                   help="generate_batch's default_compile_level in its fast configuration (default 1)")
    p.add_argument("--legacy-baselines", action="store_true",
                   help="also run HF as the ratios were once measured (static generate eager, "
                        "generate_batch at its defaults, one run each against cellcache's best) "
                        "and print the old ratios beside the fair ones")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument("--arrival", choices=["staggered", "poisson", "none"], default="staggered",
                   help="default workload: the run beside 'all together' (default staggered: 32 "
                        "every 16 steps; poisson: --rate requests a second; none)")
    p.add_argument("--rate", type=float, default=None,
                   help="Poisson arrivals: requests a second (default: 4x the rate 'all together' "
                        "completed requests at, so the offered load exceeds what the server "
                        "completes and its queue fills, as all together; the run at exactly that "
                        "rate is a second target line: within 1.25x of the floor its arrivals impose)")
    p.add_argument("--skip", default="",
                   help="comma-separated runs to skip: off, ungrouped, modules, staggered, hf-batch, "
                        "hf-static")
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
    p.add_argument("--native", action="store_true",
                   help="cellcache's own forward of the model (Generator(native=True): fused "
                        "q/k/v and gate/up GEMMs, one launch a norm, rotary and SiLU) for every "
                        "cellcache run and the agreement check, with the model's modules beside it "
                        "(cellcache_modules) unless --skip modules")
    p.add_argument("--capacity-share", type=float, default=1.0,
                   help="the cache's cells as a share of what holds the whole workload (default 1; "
                        "below 1 the histories do not fit: evictions, preemptions)")
    p.add_argument("--spill-gib", type=float, default=0.0,
                   help="host memory for the host tier, GiB (Generator(spill_bytes=); default 0: off)")
    p.add_argument("--spill-prefixes", action="store_true",
                   help="the prefix cache's evictions go to the host tier too (needs --spill-gib)")
    p.add_argument("--seed", type=in_range(0, 2**31 - 1), default=0)
    p.add_argument("--json", type=output_file, default=None,
                   help="where to write the JSON (default: its canonical file, benchmarks/results/"
                        "<benchmark>.json, the benchmark named by result_name(): serve-<workload>, "
                        "then -compile, -flashinfer, -poisson, the model, -cpu, -quick where they "
                        "apply; serve-tp<N>-<model> with --tp)")
    p.add_argument("--tp", type=in_range(1, 1 << 12), default=None,
                   help="tensor parallelism (issue 19): N ranks under torchrun --nproc-per-node N "
                        "(1: one process, the comparison); the default workload only")
    p.add_argument("--profile-steps", type=in_range(0, 1024), default=0, metavar="N",
                   help="a cellcache run (prefix cache on) after every other run (with --tp: the "
                        "measured run, before HF's), then its requests once more on the same "
                        "generator with "
                        "torch.profiler (CUDA activities on CUDA, the CPU's otherwise) over N "
                        "consecutive steps from the middle of the decode steps, on every rank, "
                        f"after {PROFILE_WARMUP} steps it discards; prints per step: the GPU's "
                        "time by kernel category (gemm, collective, attention, cellcache_step, "
                        "memcpy, other), its busy, span and idle time, the forward's GPU time "
                        "(CUDA events), host time (step wall, Generator.profile phases, "
                        "annotated calls, CUDA runtime calls), and the top 15 kernels; each rank "
                        "writes <json stem>-profile-rank<r>.json and a chrome trace "
                        "<json stem>-trace-rank<r>.json.gz beside the JSON. The headline numbers "
                        "come from the run before, which carries no profiler. 0: off (default); "
                        "default and shared workloads")
    p.add_argument("--profile-kind", choices=("decode", "mixed"), default="decode",
                   help="the steps --profile-steps records: steady decode steps (default) or mixed "
                        "steps (prompt chunks beside decode rows), from the middle of the run's "
                        "steps of that kind")
    args = p.parse_args(argv)
    if args.profile_steps and args.tp is None and args.workload == "chat":
        p.error("--profile-steps profiles the default and shared workloads (not chat)")
    if args.profile_kind != "decode" and not args.profile_steps:
        p.error("--profile-kind says which steps --profile-steps N records: give --profile-steps")
    if not 0 < args.capacity_share <= 1:
        p.error(f"--capacity-share {args.capacity_share} is outside (0, 1]")
    if not 0 <= args.spill_gib <= 4096:
        p.error(f"--spill-gib {args.spill_gib} is outside [0, 4096]")
    if args.spill_prefixes and not args.spill_gib:
        p.error("--spill-prefixes keeps evicted prefixes in the host tier: give --spill-gib")
    if args.tp is not None and (args.spill_gib or args.capacity_share != 1):
        p.error("--tp runs take neither --spill-gib nor --capacity-share")
    if args.tp is not None:
        if args.compile:
            p.error("--compile is measured in one process (without --tp)")
        return tp_bench(p, args, argv if argv is not None else sys.argv[1:])
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
    w["spill_bytes"] = int(args.spill_gib * (1 << 30))
    w["spill_prefixes"] = bool(args.spill_prefixes)
    w["compile"] = bool(args.compile)
    w["attention"] = args.attention
    w["native"] = bool(args.native)
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
        capacity = n * (w["shared_len"] + w["prompt_len"] + w.get("n", 1) * new) + 4096
    capacity = max(int(capacity * args.capacity_share), w["max_batch_tokens"])
    # the agreement check's float32 reference and served-dtype noise floor: copies made
    # before any Generator attaches to the model, kept on the host until the check where
    # they would crowd the cache out of the GPU
    models, park = None, False
    if not args.no_check:
        from cellcache.generate.agreement import reference_models

        park = device == "cuda" and copies_crowd(model, capacity, torch.cuda.mem_get_info()[0])
        models = reference_models(model, device="cpu" if park else None)
    words = ["python3", "tools/bench_serve.py", *(argv if argv is not None else sys.argv[1:])]
    res: dict = {**run_record(result_name(args), words, device),
                 "workload": {"name": name, "model": args.model, "device": device, **w,
                              "capacity": capacity, "ideal_computed": work["ideal_computed"]}}
    path = args.json or RESULTS / f"{res['benchmark']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:                  # after every run, so a run cut short keeps what it measured
        slim = {k: ({kk: vv for kk, vv in v.items() if kk != "outputs"} if isinstance(v, dict) else v)
                for k, v in res.items()}
        path.write_text(json.dumps(slim, indent=2, default=str) + "\n")

    def run(prefix: bool, arrival: str = "together", breakdown_: bool = False, rate: float = 0.0,
            profile_steps: int = 0, grouped: bool = True, native: bool | None = None) -> dict:
        import cellcache.torch as cct

        cascade = cct.CASCADE_MIN_SHARED
        cct.CASCADE_MIN_SHARED = cascade if grouped else 0      # read when a step's plan is made
        was = w["native"]
        w["native"] = was if native is None else native
        try:
            if name == "chat":
                return chat(model, work["first"], work["messages"], new, capacity, w, device, prefix)
            return ours(model, work["prompts"], new, arrival, capacity, w, device, prefix, breakdown_,
                        rate=rate, seed=args.seed, profile_steps=profile_steps,
                        profile_to=(path.parent, path.stem), profile_kind=args.profile_kind)
        finally:
            cct.CASCADE_MIN_SHARED = cascade
            w["native"] = was

    log(f"[serve] {name}: warm-up")                            # kernels, graphs
    if name == "chat":
        chat(model, work["first"][:4], [m[:2] for m in work["messages"][:4]], 4, capacity, w, device)
    else:
        ours(model, work["prompts"][:8], 8, "together", capacity, w, device)
    modes = [("cellcache", True, True, None)] + (
        [] if "off" in skip else [("cellcache_off", False, True, None)])
    if name == "grpo":                  # every continuation forks the prompt: no "off" to compare
        modes = [m for m in modes if m[0] != "cellcache_off"]
    if name in ("shared", "default", "grpo") and device == "cuda" and "ungrouped" not in skip:
        modes.append(("cellcache_ungrouped", True, False, None))
    if args.native and "modules" not in skip:     # the model's own modules, beside the native forward
        modes.append(("cellcache_modules", True, True, False))
    timed: dict[str, list[dict]] = {}
    for rep in range(args.repeat):
        for key, prefix, grouped, native in (modes if rep % 2 == 0 else modes[::-1]):
            log(f"[serve] {key} (prefix cache {'on' if prefix else 'off'}"
                f"{'' if grouped else ', shared-prefix attention off'}"
                f"{', on the modules' if native is False else ''})")
            r = run(prefix, grouped=grouped, native=native)
            host = f", host per decode step {r['decode_host_us_per_step_total']:.0f} us" \
                if "decode_host_us_per_step_total" in r else ""
            if "backlog_flush" in r:
                host += f" (+ {r['backlog_flush']['us_per_decode_step']:.0f} us of output lists)"
            if "cpu_probe_us" in r:
                host += " (CPU probe {before:.0f} / {after:.0f} us before / after)".format(
                    **r["cpu_probe_us"])
            log(f"[serve] {key}: {r['tokens_per_s']:.0f} tokens/s, prompt tokens computed "
                f"{r['computed_tokens']} (ideal {work['ideal_computed']}){host}")
            timed.setdefault(key, []).append(r)
            res[key] = median_run(timed[key])
            entry = {"run": key, "tokens_per_s": r["tokens_per_s"]}
            for k in ("decode_host_us_per_step_total", "mixed_host_us_per_step_total"):
                if k in r:
                    entry[k] = r[k]
            if "backlog_flush" in r:
                entry["backlog_flush"] = r["backlog_flush"]
            if "cpu_probe_us" in r:
                entry["cpu_probe_us"] = r["cpu_probe_us"]
            res.setdefault("runs", []).append(entry)
            save()
    if device == "cuda" and name == "default":
        # The GPU time of the decode and mixed steps, for the host-time targets (the default
        # workload's), comes from one more run of it (prefix cache on) with CUDA events around
        # each decode replay and each mixed step's forward, and the breakdown after it: the
        # events' own host cost stays out of the timed runs' host phases, which the targets read.
        log("[serve] cellcache, GPU timing pass (events around the decode replays and mixed forwards)")
        t = run(True, breakdown_=True)
        r = res["cellcache"]
        for k in ("decode_gpu_ms_median", "decode_gpu_rows", "decode_gpu_samples", "mixed_gpu_ms_median",
                  "mixed_gpu_samples", "breakdown"):
            if k in t:
                r[k] = t[k]
        r["gpu_timing_pass"] = {"tokens_per_s": t["tokens_per_s"],
                                "decode_host_us_per_step_total": t["decode_host_us_per_step_total"],
                                "same_outputs": t["outputs"] == r["outputs"]}
        save()
    if device == "cuda" and name in ("shared", "grpo"):
        # the decode step's GPU time with shared-prefix attention and without (events around
        # the decode replays, one more run each): issue 43's step target
        for key, grouped in (("cellcache", True), ("cellcache_ungrouped", False)):
            if key not in res:
                continue
            log(f"[serve] {key}, GPU timing pass (events around the decode replays)")
            t = run(True, breakdown_=True, grouped=grouped)
            for k in ("decode_gpu_ms_median", "decode_gpu_rows", "decode_gpu_samples"):
                if k in t:
                    res[key][k] = t[k]
            res[key]["gpu_timing_pass"] = {"tokens_per_s": t["tokens_per_s"],
                                           "same_outputs": t["outputs"] == res[key]["outputs"]}
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
    if models is not None:
        # before the HF runs (they switch the model's attention to SDPA; a Generator switches
        # it back), on the configuration timed
        log(f"[serve] agreement check: {args.check_requests} requests against HF's forward")
        prompts = work["prompts"] if name != "chat" else work["first"]
        res["agreement"] = agreement_pass(model, prompts, new, capacity, w, device, models,
                                          args.check_requests, args.seed, park=park)
        res["agreement"]["copies_parked"] = park
        del models
        log(f"[serve] agreement: {res['agreement']['summary']}")
        save()
    else:
        res["agreement"] = not_checked()
    hf_runs = {"default": ("hf-batch", "hf-static"), "shared": ("hf-batch",), "chat": (), "grpo": ()}[name]
    for hf in hf_runs:
        if hf in skip:
            continue
        fn = hf_batch if hf == "hf-batch" else hf_static
        kw = {"compile_level": args.hf_compile_level} if hf == "hf-batch" else {}
        sides = [(hf, True)] + ([(f"{hf}-legacy", False)] if args.legacy_baselines else [])
        for key, fast in sides:
            log(f"[serve] {key} ({'its fast options' if fast else 'as once measured'})")
            gc.collect()                # what earlier runs left (generators, reference copies)
            if device == "cuda":
                torch.cuda.empty_cache()
            try:
                # warm-up: the whole workload once, untimed, so that compiling and capturing
                # for its shapes are done before the clock starts, as cellcache's warmup()
                # does (as once measured: four short prompts)
                warm = work["prompts"] if fast else work["prompts"][:4]
                fn(model, warm, new if fast else 4, device, fast, **kw)
                runs = []
                for _ in range(args.repeat if fast else 1):
                    before = cpu_probe()
                    r = fn(model, work["prompts"], new, device, fast, **kw)
                    r["cpu_probe_us"] = {"before": before, "after": cpu_probe()}
                    runs.append(r)
                    log(f"[serve] {key}: {r['tokens_per_s']:.0f} tokens/s")
                res[key] = median_run(runs)
            except Exception as e:  # noqa: BLE001 - reported in the table
                res[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
            save()
    if args.profile_steps:
        # last, so that nothing measured runs after the profiler (CUPTI may stay loaded)
        log(f"[serve] cellcache, profile pass ({args.profile_steps} steps, torch.profiler)")
        res["profile"] = [run(True, profile_steps=args.profile_steps)["profile"]]
        save()
    base = res["cellcache"]["outputs"]
    for key in COMPARED:
        r = res.get(key, {})
        if "outputs" in r:
            same = sum(a == b for a, b in zip(base, r["outputs"]))
            r["same_outputs_as_cellcache"] = f"{same}/{len(base)}"

    print()
    print(f"workload {name}: {json.dumps({k: v for k, v in w.items()})}")
    agree = res["agreement"]
    print(f"end-to-end agreement with HF's forward: {agree['summary']}")
    if args.repeat > 1:
        print(f"every figure: the median of {args.repeat} runs of its side")
    print(f"{'run':<29} {'tokens/s':>10} {'seconds':>9} {'computed':>10} {'cached':>10} "
          f"{'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'ITL p50 ms':>11} {'ITL p99 ms':>11} "
          f"{'cellcache is':>13}")
    ours_tps = res["cellcache"]["tokens_per_s"]
    def ms(r: dict, key: str, width: int) -> str:
        v = r.get(key)
        return f"{v:>{width}.2f}" if isinstance(v, float) else " " * width

    for key in ("cellcache", *COMPARED):
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
    for key in COMPARED:
        if "same_outputs_as_cellcache" in res.get(key, {}):
            same = res[key]["same_outputs_as_cellcache"]
            print(f"{key}: same greedy outputs as cellcache for {same} requests")
    if "profile" in res:
        print_profile(res["profile"], f"cellcache (prefix cache on) {args.model}, {name} workload; "
                                      f"files {path.parent}/{path.stem}-*-rank0*")
    pb = profiled_breakdown(res["profile"][0]) if "profile" in res else None
    if pb:
        print(f"{args.profile_kind} step as served (profiled mid-run, {pb['steps']} steps): "
              f"{pb['kernels_ms']:.2f} ms "
              f"of kernels = attention {pb['attention_ms']:.2f} + GEMMs {pb['gemm_ms']:.2f} + the rest "
              f"{pb['rest_ms']:.2f} ms (the profile's table above)")
    bd = res["cellcache"].get("breakdown", {})
    if bd:
        print(f"decode step of {bd['decode_rows']} rows, its graph replayed after the run: forward "
              f"{bd['forward_ms']:.2f} ms = attention {bd['attention_ms']:.2f} ms (the CUDA-core kernel, "
              f"replayed alone) + rest of the model {bd['rest_of_model_ms']:.2f} ms; prepare_step "
              f"{res['cellcache']['prepare_step_host_us_median']:.0f} us host (median)"
              + ("" if pb else "; --profile-steps N gives the served step's kernels"))
    for key in ("cellcache", "cellcache_off", "cellcache_ungrouped"):
        r = res.get(key, {})
        if "decode_gpu_ms_median" in r and name in ("shared", "grpo"):
            print(f"{key}: {r['decode_gpu_rows']}-row decode step {r['decode_gpu_ms_median']:.2f} ms "
                  f"on the GPU (median of {r['decode_gpu_samples']}, events around the replays of a "
                  f"timing pass)")
        if "mixed_steps" in r:
            ahead = r.get("ahead_steps", {}).get("mixed", 0)
            print(f"{key}: {r['mixed_steps']} mixed steps ({ahead} launched ahead) "
                  f"{r['mixed_step_ms_total']:.0f} ms (median "
                  f"{r['mixed_step_ms_median']:.2f}), {r['decode_steps']} decode steps "
                  f"{r['decode_step_ms_total']:.0f} ms (median {r['decode_step_ms_median']:.2f}), "
                  f"prepare_step {r['prepare_step_host_us_median']:.0f} us (median)")
        if r.get("replays"):
            print(f"{key}: {r['flat_replays']} of the generator's {r['replays']} graph replays without "
                  f"the shared-prefix pass (decode steps whose rows could not group), "
                  f"{r['lean_replays']} of them also without the merge")
        if "host_tier" in r:
            print(f"{key}: host tier: " + _host_tier_line(r["host_tier"]))
        if "decode_host_us_per_step" in r:
            parts = ", ".join(f"{k} {v:.0f}" for k, v in r["decode_host_us_per_step"].items())
            print(f"{key}: host per decode step {r['decode_host_us_per_step_total']:.0f} us "
                  f"(async_steps={r['async_steps']}): {parts} (wait: blocked on the device)")
        if "decode_host_us_distribution" in r:
            d, g = r["decode_host_us_distribution"], r["gc"]
            print(f"{key}: host per decode step, median {d['median']:.0f} us, p90 {d['p90']:.0f}, "
                  f"max {d['max']:.0f}; the costliest 5% of steps hold {100 * d['top5pct_share']:.0f}% "
                  f"of it; garbage collections in the run {g['collections']} (gen 0/1/2), "
                  f"{g['ms']:.1f} ms")
            print(f"{key}: median of each phase: "
                  + ", ".join(f"{k} {v:.0f}" for k, v in d["phase_median"].items()))
            for c in r.get("decode_host_costliest", [])[:5]:
                parts = ", ".join(f"{k} {v}" for k, v in c.items() if k not in ("step", "rows", "host_us"))
                print(f"  decode step {c['step']} ({c['rows']} rows): {c['host_us']} us host: {parts}")

    for key in ("hf-static", "hf-batch"):
        old, fair = res.get(f"{key}-legacy", {}), res.get(key, {})
        if "tokens_per_s" in old and "tokens_per_s" in fair:
            best = res["cellcache"]["tokens_per_s_best"]
            print(f"{key}: cellcache is {best / old['tokens_per_s']:.2f}x as once measured (cellcache's "
                  f"best of {args.repeat} against one run of HF {old['options']}); "
                  f"{ours_tps / fair['tokens_per_s']:.2f}x fair (median against median, HF "
                  f"{fair['options']})")
    targets = []
    if agree["passed"] is not None:
        targets.append((agree["passed"], "end-to-end agreement with HF's forward (the speed figures "
                                         "count only with it)"))
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
            # the same 1.25x, over what the arrivals leave any server (the ratio itself cannot
            # reach 1.25x, the floor alone being above it): what the server adds to them
            targets.append((ratio <= 1.25 * floor, f"poisson arrivals at exactly the rate all "
                                                   f"together completes, within 1.25x of the floor "
                                                   f"its arrivals impose ({ratio:.2f}x all together "
                                                   f"= {ratio / floor:.2f}x the floor of {floor:.2f}x: "
                                                   f"last arrival at {r['last_arrival_s']:.2f} s, "
                                                   f"then {new} decode steps)"))
        if device == "cuda":                  # issue #20's targets, for the H200
            targets.append((ours_tps >= 30_000, f">= 30,000 tokens/s ({ours_tps:,.0f})"))
            for key, times in (("hf-static", 5), ("hf-batch", 25)):
                if "tokens_per_s" in res.get(key, {}):
                    ratio = ours_tps / res[key]["tokens_per_s"]
                    targets.append((ratio >= times, f">= {times}x HF {key[3:]} ({ratio:.2f}x)"))
        mod = res.get("cellcache_modules")
        if mod:                                # the native forward against the modules'
            ratio = ours_tps / mod["tokens_per_s"]
            targets.append((ratio >= 1.0, f"the native forward at least as fast as the model's "
                                          f"modules ({ratio:.3f}x)"))
        ung = res.get("cellcache_ungrouped")
        if ung:                                # issue 43's: no sharing, nothing to pay
            ratio = ours_tps / ung["tokens_per_s"]
            targets.append((ratio >= 0.98, f"shared-prefix attention on, nothing shared: within 2% of "
                                           f"it off ({ratio:.3f}x)"))
    elif name == "grpo":
        ung = res.get("cellcache_ungrouped")
        if ung:                                # issue 43's
            ratio = ours_tps / ung["tokens_per_s"]
            targets.append((ratio >= 2, f"shared-prefix attention: >= 2x without it ({ratio:.2f}x)"))
        targets.append((computed == ideal, f"prompt tokens computed = the ideal ({computed} vs {ideal})"))
    elif name == "shared":
        if off:
            ratio = ours_tps / off["tokens_per_s"]
            targets.append((ratio >= 3, f">= 3x the throughput with the prefix cache off ({ratio:.2f}x)"))
        ung = res.get("cellcache_ungrouped")
        if ung:                                # issue 43's, for the H200
            if off:
                targets.append((ratio >= 5, f"shared-prefix attention: >= 5x the prefix cache off "
                                            f"({ratio:.2f}x)"))
            targets.append((ours_tps >= 80_000, f"shared-prefix attention: >= 80,000 tokens/s "
                                                f"({ours_tps:,.0f}; {ours_tps / ung['tokens_per_s']:.2f}x "
                                                f"without it)"))
            a, b = res["cellcache"].get("decode_gpu_ms_median"), ung.get("decode_gpu_ms_median")
            if a and b:
                targets.append((a <= 0.4 * b, f"decode step <= 0.4x without shared-prefix attention "
                                              f"({a:.2f} ms against {b:.2f} ms = {a / b:.2f}x)"))
        targets.append((computed == ideal, f"prompt tokens computed = the ideal ({computed} vs {ideal})"))
    else:
        targets.append((computed == ideal, f"prompt tokens computed = the ideal ({computed} vs {ideal})"))
        r = res["cellcache"]
        itl = "" if r["itl_ms_p50"] is None else \
            f"; inter-token p50 {r['itl_ms_p50']:.2f} ms, p99 {r['itl_ms_p99']:.2f} ms"
        print(f"TTFT: p50 {r['ttft_ms_p50']:.1f} ms, p99 {r['ttft_ms_p99']:.1f} ms over "
              f"{r['turns_done']} turns{itl}")
    for host_line in (host_target(res), mixed_host_target(res)):
        if host_line is not None:
            targets.append(host_line)
    for ok, text in targets:
        print(f"target {'met ' if ok else 'MISSED'}: {text}")
    res["targets"] = [{"met": ok, "target": text} for ok, text in targets]
    save()
    log(f"wrote {path}")
    return disagreement(agree)


def disagreement(agree: dict, prog: str = "bench_serve") -> int:
    """The run's exit code by its agreement check: 1, saying where, when the served
    configuration does not agree with the model end to end (the figures do not count)."""
    if agree["passed"] is False:
        print(f"{prog}: the served configuration does not agree with the model end to end: "
              f"{agree['summary']}; by row kind {agree['by_kind']}; worst rows {agree['worst']}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_main("bench_serve", main))
