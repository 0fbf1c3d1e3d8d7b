"""``cellcache generate``: serve a Hugging Face decoder (a local checkpoint, or random
weights from :data:`RANDOM_MODELS`) through the Generator from the command line; ``--json``
reports outputs, stats and latency (TTFT, inter-token p50/p99).

Tensor parallelism: ``torchrun --nproc-per-node N -m cellcache generate --tp N ...`` runs one
process per rank; each joins the process group from torchrun's environment (``gloo`` on the
CPU, ``nccl`` on CUDA with the device ``cuda:LOCAL_RANK``), shards the model with its own
TP plan and serves through ``Generator(tp=N)``; only rank 0 adds the requests and prints.
Several nodes work the same way through torchrun's rendezvous (``torchrun --nnodes M
--nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m cellcache generate --tp
M*G ...``; untested here). Without torchrun ``--tp 1`` (the default) is one process.
"""

from __future__ import annotations

import datetime
import json
import math
import os
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
    # issue 19's tensor-parallel target: Qwen2-7B's shapes
    "qwen2-7b": dict(arch="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                     max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=False),
}


#: Built-in models initialized directly on their device (too large to fill on the CPU first).
_INIT_ON_DEVICE = frozenset({"qwen2-7b"})


def random_model(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
    """A model with random weights from a built-in config (no download). The same name, dtype,
    device type and seed give the same weights in every process (tensor-parallel ranks rely
    on it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(RANDOM_MODELS[name])
    arch = str(spec.pop("arch"))
    config = AutoConfig.for_model(arch, **spec)
    torch.manual_seed(seed)
    if name in _INIT_ON_DEVICE:
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device).eval()


def _one_line(e: BaseException) -> str:
    """An exception as one line (CLI errors are one line)."""
    text = " ".join(str(e).split())
    return text or type(e).__name__


#: What torchrun sets for every process it starts.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def init_tp(tp: int, device: str) -> tuple[int, int, str]:
    """Joins the process group torchrun describes for ``--tp``; returns (rank, world, the
    device for this rank's model: ``cuda:LOCAL_RANK`` or ``cpu``). ``--tp 1`` outside
    torchrun: (0, 1, device), nothing joined. A usage problem raises ValueError (one line)."""
    env_world = os.environ.get("WORLD_SIZE")
    if tp == 1 and (env_world is None or env_world == "1"):
        return 0, 1, device
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise ValueError(f"--tp {tp} needs one process per rank started by torchrun (no "
                         f"{', '.join(missing)} in the environment): torchrun --nproc-per-node {tp} "
                         f"-m cellcache generate ... --tp {tp}")
    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if world != tp:
        raise ValueError(f"--tp {tp} but torchrun started {world} processes: give --tp {world} "
                         f"(or --nproc-per-node {tp})")
    if device == "cuda":
        if local >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {local} but this host has {torch.cuda.device_count()} "
                             "GPUs: start at most that many processes per node")
        torch.cuda.set_device(local)
        place = f"cuda:{local}"
    else:
        place = "cpu"
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=float(os.environ.get("CELLCACHE_TP_TIMEOUT", "600")))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timeout)
    return dist.get_rank(), world, place


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
    p.add_argument("--tp", type=in_range(1, 1 << 12), default=1,
                   help="tensor-parallel ranks: run under torchrun --nproc-per-node N (default 1)")
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
    try:
        rank, world, place = init_tp(args.tp, device)
    except ValueError as e:
        if os.environ.get("RANK", "0") != "0":       # printed once, by rank 0
            sys.exit(2)
        p.error(str(e))
    try:
        code = _serve(p, args, texts, device, place, dtype, rank, world)
        if world > 1:         # every rank past its last collective before any tears them down
            import torch.distributed as dist

            dist.barrier()
        return code
    finally:
        if world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _serve(p: Parser, args: Any, texts: list[str], device: str, place: Any, dtype: torch.dtype,
           rank: int, world: int) -> int:
    """Everything after the process group: load, add (rank 0), run, print (rank 0)."""
    if rank != 0:                                     # the same usage errors, printed once
        p.error = lambda message: sys.exit(2)  # type: ignore[method-assign]
    tokenizer = None
    try:
        if args.random:
            model = random_model(args.random, dtype, place, args.seed)
        else:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            from transformers import AutoModelForCausalLM, AutoTokenizer

            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(place).eval()
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
                        prefix_cache=not args.no_prefix_cache, admission=args.admission,
                        tp=world if world > 1 else None)
    except (CellCacheError, MemoryError) as e:
        p.error(f"cannot serve this model with --capacity {args.capacity} on {device}: {_one_line(e)}")
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p, seed=args.seed, n=args.n)
    for i, ids in enumerate(prompts if rank == 0 else []):     # the other ranks follow rank 0
        try:
            gen.add(ids, sampling)
        except InvalidArgument as e:
            p.error(f"prompt {i}: {_one_line(e)}")
    t0 = time.perf_counter()
    try:
        gen.run(progress=not args.quiet and rank == 0)
    except KeyboardInterrupt:
        print("cellcache generate: interrupted", file=sys.stderr)
        return 130
    elapsed = time.perf_counter() - t0
    if rank != 0:
        return 0
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
    summary = {"model": args.model or args.random, "device": device, "tp": world, "requests": len(prompts),
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
