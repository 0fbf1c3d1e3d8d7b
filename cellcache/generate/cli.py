"""``cellcache generate``: serve a Hugging Face decoder (a local checkpoint, or random
weights from :data:`RANDOM_MODELS`) through the Generator from the command line; ``--json``
reports outputs, stats and latency (TTFT, inter-token p50/p99)."""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any

import numpy as np
import torch

from .._cli import Parser, in_range
from ..errors import CellCacheError, InvalidArgument
from ..hf import vocab_size
from .engine import CPU_BATCH_TOKENS, CUDA_BATCH_TOKENS, Generator
from .requests import Sampling
from .scheduler import ADMISSION_POLICIES

__all__ = ["RANDOM_MODELS", "main", "random_model"]


RANDOM_MODELS = {
    "tiny": dict(arch="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 use_sliding_window=True, sliding_window=16, max_window_layers=1),
    "llama-tiny": dict(arch="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    "mistral-tiny": dict(arch="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                         sliding_window=12),
    "qwen2-0.5b": dict(arch="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                       max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True),
}


def random_model(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
    """A model with random weights from a built-in config (no download)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(RANDOM_MODELS[name])
    arch = str(spec.pop("arch"))
    config = AutoConfig.for_model(arch, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device).eval()


def _one_line(e: BaseException) -> str:
    """An exception as one line (CLI errors are one line)."""
    text = " ".join(str(e).split())
    return text or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="cellcache generate",
               description="Serve a Hugging Face decoder through cellcache with continuous batching. "
                           "Prompts are text (with --model and its tokenizer) or token ids.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a local Hugging Face checkpoint directory (no download)")
    src.add_argument("--random", choices=sorted(RANDOM_MODELS), help="random weights, built-in config")
    p.add_argument("prompts", nargs="*", help="prompts (text with --model; else space-separated token ids)")
    p.add_argument("--prompts-file", help="a UTF-8 file with one prompt per line")
    p.add_argument("--random-prompts", type=in_range(1, 1 << 20), default=0,
                   help="N random token prompts (of --prompt-len tokens)")
    p.add_argument("--prompt-len", type=in_range(1, 1 << 20), default=32)
    p.add_argument("--max-new-tokens", type=in_range(1, 1 << 20), default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=in_range(0, 1 << 30), default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--n", type=in_range(1, 64), default=1, help="continuations per prompt")
    p.add_argument("--seed", type=in_range(0, 2**31 - 1), default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--capacity", type=in_range(64, 1 << 30), default=1 << 16, help="cells (default 65536)")
    p.add_argument("--max-batch-tokens", type=in_range(1, 1 << 16), default=None,
                   help="the token budget of a step (default 8192 on a GPU, 512 on the CPU; "
                        "at most --capacity)")
    p.add_argument("--no-graphs", action="store_true", help="run decode steps eagerly on CUDA")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="read every prompt whole (no reuse of cached prefixes)")
    p.add_argument("--admission", choices=list(ADMISSION_POLICIES), default="fifo",
                   help="waiting requests in arrival order, or longest cached prefix first (lpm)")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    if not math.isfinite(args.temperature) or args.temperature < 0:
        p.error(f"--temperature must be a finite number >= 0, not {args.temperature}")
    if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        p.error(f"--top-p must be in (0, 1], not {args.top_p}")
    if args.max_batch_tokens is not None and args.max_batch_tokens > args.capacity:
        p.error("--max-batch-tokens must be at most --capacity")
    texts = list(args.prompts)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                texts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            p.error(f"cannot read --prompts-file: {_one_line(e)}")
        except UnicodeDecodeError as e:
            p.error(f"--prompts-file {args.prompts_file} is not UTF-8 text ({_one_line(e)})")
    from ..cuda.probe import cuda_usable

    device = args.device
    if device != "cpu":
        try:
            usable, why = cuda_usable()
        except CellCacheError as e:
            usable, why = False, _one_line(e)
        if usable and not torch.cuda.is_available():
            usable, why = False, "this torch build has no CUDA (torch.cuda.is_available() is False)"
        if device == "cuda" and not usable:
            p.error(f"--device cuda: {why}")
        device = "cuda" if usable else "cpu"
    if args.max_batch_tokens is None:
        args.max_batch_tokens = min(CUDA_BATCH_TOKENS if device == "cuda" else CPU_BATCH_TOKENS,
                                    args.capacity)
    dtype = {"auto": torch.bfloat16 if device == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    tokenizer = None
    try:
        if args.random:
            model = random_model(args.random, dtype, device, args.seed)
        else:
            import os

            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            from transformers import AutoModelForCausalLM, AutoTokenizer

            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
            try:
                tokenizer = AutoTokenizer.from_pretrained(args.model)
            except (OSError, ValueError):
                tokenizer = None
    except (OSError, ValueError) as e:
        p.error(f"cannot load the model: {_one_line(e)}")
    try:
        vocab = vocab_size(model)
    except InvalidArgument as e:
        p.error(f"cannot serve the model: {_one_line(e)}")
    prompts = []
    for t in texts:
        if tokenizer is not None:
            prompts.append(tokenizer(t)["input_ids"])
        else:
            try:
                ids = [int(x) for x in t.split()]
            except ValueError:
                p.error(f"prompt {t!r} is not token ids (this model has no tokenizer)")
            if not ids or min(ids) < 0 or max(ids) >= vocab:
                p.error(f"prompt {t!r}: token ids must lie in [0, {vocab})")
            prompts.append(ids)
    rng = np.random.default_rng(args.seed)
    prompts += [rng.integers(0, vocab, size=args.prompt_len).tolist() for _ in range(args.random_prompts)]
    if not prompts:
        p.error("no prompts: give some, --prompts-file or --random-prompts")
    try:
        gen = Generator(model, capacity=args.capacity, max_batch_tokens=args.max_batch_tokens,
                        max_seqs=min(4096, max(64, 2 * len(prompts) * args.n)),
                        graphs=False if args.no_graphs else None,
                        prefix_cache=not args.no_prefix_cache, admission=args.admission)
    except (CellCacheError, MemoryError) as e:
        p.error(f"cannot serve this model with --capacity {args.capacity} on {device}: {_one_line(e)}")
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p, seed=args.seed, n=args.n)
    for i, ids in enumerate(prompts):
        try:
            gen.add(ids, sampling)
        except InvalidArgument as e:
            p.error(f"prompt {i}: {_one_line(e)}")
    t0 = time.perf_counter()
    try:
        gen.run(progress=not args.quiet)
    except KeyboardInterrupt:
        print("cellcache generate: interrupted", file=sys.stderr)
        return 130
    elapsed = time.perf_counter() - t0
    out_tokens = gen.stats["tokens_out"]
    results = []
    for r in gen.requests:
        item: dict[str, Any] = {"id": r.id, "prompt_tokens": len(r.prompt), "outputs": r.outputs,
                                "finish_reasons": r.finish_reasons}
        if r.ttft is not None:
            item["ttft_ms"] = 1e3 * r.ttft
        if r.error is not None:
            item["error"] = _one_line(r.error)
        if tokenizer is not None:
            item["text"] = [tokenizer.decode(o) for o in r.outputs]
        results.append(item)
    summary = {"model": args.model or args.random, "device": device, "requests": len(prompts),
               "tokens_out": out_tokens, "seconds": elapsed, "tokens_per_s": out_tokens / elapsed,
               "prefix_cache": gen.prefix is not None, "admission": args.admission,
               "max_batch_tokens": gen.max_batch, **gen.stats, "latency": gen.latency()}
    if args.json:
        print(json.dumps({"summary": summary, "results": results}, indent=2))
    else:
        for item in results:
            for k, o in enumerate(item.get("text") or item["outputs"]):
                print(f"[{item['id']}.{k}] {o}")
        print(f"generate: {len(prompts)} requests, {out_tokens} tokens in {elapsed:.2f} s = "
              f"{out_tokens / elapsed:.1f} tokens/s ({gen.stats['steps']} steps, "
              f"{gen.stats['graph_steps']} by graph replay, {gen.stats['preempted']} preempted); "
              f"prompts {gen.stats['prompt_tokens']} tokens: {gen.stats['cached_tokens']} from the "
              f"prefix cache, {gen.stats['computed_tokens']} computed")
        lat = summary["latency"]
        if lat["ttft_ms_p50"] is not None:
            itl = "" if lat["itl_ms_p50"] is None else \
                f"; inter-token p50 {lat['itl_ms_p50']:.2f} ms, p99 {lat['itl_ms_p99']:.2f} ms"
            print(f"generate: time to first token p50 {lat['ttft_ms_p50']:.1f} ms, "
                  f"p99 {lat['ttft_ms_p99']:.1f} ms{itl}")
    return 0
