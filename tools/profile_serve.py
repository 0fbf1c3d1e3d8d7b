#!/usr/bin/env python3
"""Host time of the generator's decode steps (or its mixed steps), by phase, with the model's
forward taken out: the generator runs a tiny random model on the CPU whose
``ModelRunner.forward`` is replaced by a stub that returns constant logits over 8 ids for
decode steps (greedy draws token 0; ``eos=[]``, so every request generates all its tokens;
prompt chunks run the model, except with ``--kind mixed``, where every forward is the stub
and the steps timed are those reading prompts: the default serving workload's shape by
default, 8,192-token steps of 2,048-token chunks, 512-token prompts of random ids, so ~16
admissions a step beside the rows already decoding, the prefix cache on as in its first
run; their ``prepare`` is the host backend's, which builds the masks on the host, far more
than the CUDA backend's). What is left is the host work a step costs the GPU it feeds:
scheduling, the cache's ``prepare_step`` (the host backend here: the CUDA backend's is
timed by ``tools/bench_serve.py``), the forward's input path, the sampler's launch,
deciding and applying the outcomes, the callbacks.

::

    python3 tools/profile_serve.py                      # 256 rows, sync and async
    python3 tools/profile_serve.py --rows 64 --steps 100 --mode async --json out.json
    python3 tools/profile_serve.py --cprofile 25        # the 25 costliest functions too
    python3 tools/profile_serve.py --mode async --stream   # every token to an on_token callback
    python3 tools/profile_serve.py --device cuda --compile --mode async   # the GPU's real steps
    python3 tools/profile_serve.py --device cuda --native --mode async    # on the native forward
    python3 tools/profile_serve.py --kind mixed --cprofile 25   # the default workload's mixed steps

It prints, per mode, the mean host microseconds per decode (or mixed) step for each phase of
``Generator.profile`` and their sum (``wait``: blocked on the sampled ids' copy, not host
work, is shown apart), and ``--json`` writes the same numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pstats
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cellcache._cli import Parser, in_range, output_file, run_main  # noqa: E402 - after the checkout is on sys.path
from cellcache.errors import CellCacheError  # noqa: E402


def build(rows: int, new_tokens: int, prompt_len: int, mode: str, model_name: str,
          device: str = "cpu", compile: bool = False, stream: bool = False, native: bool = False,
          kind: str = "decode"):
    import numpy as np
    import torch

    from cellcache.generate import Generator, Sampling, random_model

    outbox: list = []
    # --stream: each token to a callback doing what the server's engine thread does with it
    # (an event appended to the outbox the event loop takes after the step)
    on_token = (lambda req, k, tok: outbox.append((req.id, k, tok))) if stream else None

    capacity = rows * (prompt_len + new_tokens) + 1024
    if device == "cuda":                      # the real model and forward (graphs, bf16)
        model = random_model(model_name, torch.bfloat16, "cuda", 0)
        gen = Generator(model, capacity=capacity, max_seqs=rows + 8, eos=[], prefix_cache=False,
                        async_steps=mode == "async", compile=compile, native=native)
        gen.warmup()
        vocab = model.config.vocab_size
        for i in range(rows):
            gen.add([(i * 7 + j) % vocab for j in range(prompt_len)],
                    Sampling(max_new_tokens=new_tokens), on_token=on_token)
        gen.outbox = outbox
        return gen
    torch.set_num_threads(1)                  # the stub's argmax: no thread pool wake-ups
    model = random_model(model_name, torch.float32, "cpu", 0)
    # mixed: the steps the default workload's mixed steps are on CUDA (Generator's defaults)
    step_tokens, chunk = (8192, 2048) if kind == "mixed" else (max(rows, 512), 256)
    gen = Generator(model, capacity=capacity, max_batch_tokens=step_tokens, max_seqs=rows + 8,
                    prefill_chunk=chunk, eos=[], prefix_cache=kind == "mixed", async_steps=mode == "async")
    vocab = 8                                 # the stub's logits: 8 ids, so its argmax is ~free
    real = gen.runner.forward
    stub_logits: dict[int, torch.Tensor] = {}

    def forward(step, tokens=None, logit_rows=None, decode=False, *, device_tokens=None, logits=True):
        if kind == "decode" and logit_rows is not None and len(logit_rows) != step.width:
            return real(step, tokens, logit_rows, decode, device_tokens=device_tokens, logits=logits)
        n = step.width if logit_rows is None else len(logit_rows)
        if n not in stub_logits:
            stub_logits[n] = torch.zeros((n, vocab), dtype=torch.float32)
        return stub_logits[n]

    gen.runner.forward = forward  # type: ignore[method-assign]
    sampling = Sampling(max_new_tokens=new_tokens)
    # mixed: prompts of random ids, as the default workload's (no two share a prefix: the
    # admissions' prefix-cache lookups are each a miss); decode: 8 ids, period 8
    rng = np.random.default_rng(0)
    for i in range(rows):
        prompt = (rng.integers(0, model.config.vocab_size, prompt_len).tolist() if kind == "mixed"
                  else [(i * 7 + j) % vocab for j in range(prompt_len)])
        gen.add(prompt, sampling, on_token=on_token)
    gen.outbox = outbox
    return gen


@contextlib.contextmanager
def _cprofiled(n: int) -> Iterator[None]:
    """cProfile around the block (nothing when ``n`` is 0); its ``n`` costliest functions by
    own time printed after it."""
    if not n:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(n)


def profile_mixed(rows: int, mode: str, model_name: str, cprof: int, prompt_len: int,
                  stream: bool = False) -> dict:
    """The host phases of the steps that read the prompts (``--kind mixed``), every forward
    the stub's: from the first step until no prompt is left to read."""
    import statistics

    gen = build(rows, 32, prompt_len, mode, model_name, "cpu", False, stream, False, kind="mixed")
    gen.step_log = []
    with _cprofiled(cprof):
        t0 = time.perf_counter()
        while gen.waiting or any(len(s.tokens) - s.in_cache > 1 for s in gen.running):
            gen.step()
            gen.outbox.clear()
        wall = time.perf_counter() - t0
    mixed = [ph for kind, _, ph in gen.step_log if kind == "mixed"]
    gen.step_log = None
    n = max(len(mixed), 1)
    phases = {k: 1e6 * sum(ph.get(k, 0.0) for ph in mixed) / n for k in gen.profile["host_ms"]}
    totals = [1e6 * sum(v for k, v in ph.items() if k != "wait") for ph in mixed]
    res = {"kind": "mixed", "mode": mode, "stream": stream, "rows": rows, "prompt_len": prompt_len,
           "mixed_steps": len(mixed), "us_per_step": phases,
           "host_us_per_step": sum(v for k, v in phases.items() if k != "wait"),
           "host_us_median": statistics.median(totals) if totals else 0.0,
           "wall_us_per_step": 1e6 * wall / n}
    gen.run()
    return res


def profile(rows: int, steps: int, mode: str, model_name: str, cprof: int,
            device: str = "cpu", prompt_len: int = 8, compile: bool = False, stream: bool = False,
            native: bool = False) -> dict:
    gen = build(rows, steps + 8, prompt_len, mode, model_name, device, compile, stream, native)
    # read every prompt and reach the steady state (all rows decoding)
    while any(len(s.tokens) - s.in_cache > 1 for s in gen.running) or gen.waiting:
        gen.step()
    for _ in range(3):
        gen.step()
    before = {k: dict(v) if isinstance(v, dict) else v for k, v in gen.profile.items()}
    with _cprofiled(cprof):
        t0 = time.perf_counter()
        for _ in range(steps):
            gen.step()
            gen.outbox.clear()                # (the loop's take, off this thread's clock)
        wall = time.perf_counter() - t0
    after = gen.profile
    n = after["decode_steps"] - before["decode_steps"]
    phases = {k: 1e3 * (after["decode_host_ms"][k] - before["decode_host_ms"].get(k, 0.0)) / max(n, 1)
              for k in after["decode_host_ms"]}
    host = sum(v for k, v in phases.items() if k != "wait")
    res = {"mode": mode, "compile": compile, "native": native, "stream": stream, "rows": rows,
           "decode_steps": n,
           "us_per_step": phases,
           "host_us_per_step": host, "wall_us_per_step": 1e6 * wall / steps}
    gen.run()
    return res


def main(argv=None) -> int:
    p = Parser(prog="profile_serve", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=in_range(1, 4096), default=256, help="decode rows a step (default 256)")
    p.add_argument("--steps", type=in_range(1, 100_000), default=200, help="decode steps timed (default 200)")
    p.add_argument("--mode", choices=["sync", "async", "both"], default="both")
    p.add_argument("--model", default=None,
                   help="built-in random model (default llama-tiny; qwen2-0.5b with --device cuda)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu (default): the forward stubbed out; cuda: the real bf16 model, "
                        "graphs and all, so 'forward' and 'wait' are the GPU's")
    p.add_argument("--kind", choices=["decode", "mixed"], default="decode",
                   help="decode (default): steady decode steps; mixed: the steps reading the prompts "
                        "(CPU only, every forward stubbed out; 8,192-token steps, 2,048-token chunks)")
    p.add_argument("--prompt-len", type=in_range(1, 8192), default=None,
                   help="prompt tokens a row (default 8; 512 with --kind mixed)")
    p.add_argument("--compile", action="store_true",
                   help="with --device cuda: the model through torch.compile (Generator(compile=True))")
    p.add_argument("--native", action="store_true",
                   help="with --device cuda: cellcache's own forward of the model (Generator(native=True))")
    p.add_argument("--cprofile", type=in_range(0, 1 << 20), default=0, metavar="N",
                   help="also print cProfile's N costliest functions (by own time)")
    p.add_argument("--stream", action="store_true",
                   help="every request streams: an on_token callback per token, as the HTTP server's")
    p.add_argument("--json", type=output_file, default=None)
    args = p.parse_args(argv)
    if args.compile and args.device != "cuda":
        p.error("--compile needs --device cuda")
    if args.kind == "mixed" and args.device != "cpu":
        p.error("--kind mixed runs on the CPU only (on CUDA, bench_serve --profile-kind mixed)")
    prompt_len = args.prompt_len or (512 if args.kind == "mixed" else 8)
    if args.native and args.device != "cuda":
        p.error("--native needs --device cuda (on the CPU the forward is stubbed out)")
    model = args.model or ("qwen2-0.5b" if args.device == "cuda" else "llama-tiny")
    from cellcache.generate import RANDOM_MODELS

    if model not in RANDOM_MODELS:
        p.error(f"--model {model!r}: one of {', '.join(sorted(RANDOM_MODELS))}")
    if args.device == "cuda":
        from tools._common import require_gpu
        if (code := require_gpu("profile_serve")) is not None:
            return code
    modes = ["sync", "async"] if args.mode == "both" else [args.mode]
    out = []
    for mode in modes:
        try:
            if args.kind == "mixed":
                r = profile_mixed(args.rows, mode, model, args.cprofile, prompt_len, args.stream)
            else:
                r = profile(args.rows, args.steps, mode, model, args.cprofile, args.device, prompt_len,
                            args.compile, args.stream, args.native)
        except CellCacheError as e:         # a cache too large for this machine: which flag to lower
            print(f"profile_serve: error: {type(e).__name__}: {e} (lower --rows, --steps or --prompt-len)",
                  file=sys.stderr)
            return 2
        out.append(r)
        parts = ", ".join(f"{k} {v:.1f}" for k, v in r["us_per_step"].items())
        if args.kind == "mixed":
            print(f"{mode}: {r['rows']} rows of {prompt_len}-token prompts, {r['mixed_steps']} mixed "
                  f"steps, host {r['host_us_per_step']:.1f} us/mixed step "
                  f"(median {r['host_us_median']:.1f}): {parts}")
        else:
            print(f"{mode}: {r['rows']} rows, host {r['host_us_per_step']:.1f} us/decode step "
                  f"(wall {r['wall_us_per_step']:.1f}): {parts}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_main("profile_serve", main))
