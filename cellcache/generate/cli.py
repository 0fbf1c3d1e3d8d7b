"""``cellcache generate``: serve a Hugging Face decoder (a local checkpoint, or random
weights from :data:`RANDOM_MODELS`) through the Generator from the command line; ``--json``
reports outputs, stats and latency (TTFT, inter-token p50/p99).

Tensor parallelism: ``torchrun --nproc-per-node N -m cellcache generate --tp N ...`` runs one
process per rank; each joins the process group from torchrun's environment (``gloo`` on the
CPU, ``nccl`` on CUDA with the device ``cuda:LOCAL_RANK``), shards the model with its own
TP plan and serves through ``Generator(tp=N)``; only rank 0 adds the requests and prints.
Several nodes work the same way through torchrun's rendezvous (``torchrun --nnodes M
--nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m cellcache generate --tp
M*G ...``; untested here). Without torchrun ``--tp 1`` (the default) is one process. Every
flag of the command keeps its meaning under torchrun: none is an abbreviation torchrun's own
parser claims (``--n``, which torchrun calls ambiguous, has the name ``--num-samples``).

Failures are one line on stderr: usage and checkpoint problems (a ``--model`` directory that
does not exist, a config.json whose sizes are not positive ints) and memory that runs out
(``OutOfMemory``, naming the flag to change) exit 2. Ctrl-C exits 130 after writing what was
generated so far, each continuation it cut short marked ``"interrupted"``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, NoReturn

import numpy as np
import torch

from .._cli import Parser, in_range
from ..errors import CellCacheError, InvalidArgument, OutOfMemory
from ..hf import vocab_size
from ..tp import TPCache
from .engine import Generator
from .options import CPU_BATCH_TOKENS, CUDA_BATCH_TOKENS
from .requests import Request, Sampling
from .scheduler import ADMISSION_POLICIES

__all__ = ["RANDOM_MODELS", "build_parser", "main", "random_model"]


_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

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
    # the public configs of the models speed comparisons are published on (issue 42)
    "qwen2.5-0.5b": dict(arch="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=True),
    "llama-3.2-1b": dict(arch="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, rope_scaling=_LLAMA3_ROPE | {"factor": 32.0}),
    "llama-3.1-8b": dict(arch="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, rope_scaling=_LLAMA3_ROPE | {"factor": 8.0}),
    "qwen2.5-7b": dict(arch="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=False),
    # Gemma 3 1B's text model (999,885,952 parameters): five layers sliding over 512 keys
    # (rotary base 10K) for each full one (1M), 4 query heads over one K/V head of 256,
    # transformers' defaults for the rest (query_pre_attn_scalar 256, tanh-GELU)
    "gemma-3-1b": dict(arch="gemma3_text", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                       max_position_embeddings=32768, sliding_window=512, rms_norm_eps=1e-6,
                       tie_word_embeddings=True),
}


#: Built-in models initialized directly on their device (too large to fill on the CPU first).
_INIT_ON_DEVICE = frozenset({"qwen2-7b", "llama-3.2-1b", "llama-3.1-8b", "qwen2.5-7b", "gemma-3-1b"})


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


def build_parser() -> Parser:
    """The parser of ``cellcache generate``. Its flags are full names torchrun's parser does not
    claim as abbreviations (tests/test_generate_cli.py parses every one through it)."""
    p = Parser(prog="cellcache generate",
               description="Serve a Hugging Face decoder through cellcache with continuous batching. "
                           "Prompts are text (with --model and its tokenizer) or token ids. "
                           "Ctrl-C stops it and writes what was generated so far (exit code 130).")
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
    # torchrun's parser takes "--n" for an abbreviation of its --nnodes, --nproc-per-node, ...
    # and stops: "--num-samples" is the name that works everywhere, "--n" is kept for one process
    p.add_argument("--num-samples", "--n", dest="n", metavar="N", type=in_range(1, 64), default=1,
                   help="continuations per prompt (OpenAI's n; under torchrun only --num-samples)")
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
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant serving: each request's tokens and logits are the same "
                        "bits whatever else is batched with it (docs/design/deterministic.md)")
    p.add_argument("--kv-dtype", choices=["auto", "fp8"], default="auto",
                   help="K/V storage: the model's dtype, or 8-bit e4m3 with per-head scales "
                        "(half the memory a cell takes)")
    p.add_argument("--native", action="store_true",
                   help="cellcache's own forward of a Llama, Mistral, Qwen2, Qwen3 or Gemma (1, 3) "
                        "model (fused q/k/v and gate/up GEMMs, one launch a norm, rotary and SiLU; "
                        "Gemma's norms and GELU as its modules' ops) instead of the model's modules; "
                        "not with --tp")
    p.add_argument("--admission", choices=list(ADMISSION_POLICIES), default="fifo",
                   help="waiting requests in arrival order, or longest cached prefix first (lpm)")
    p.add_argument("--tp", type=in_range(1, 1 << 12), default=1,
                   help="tensor-parallel ranks: run under torchrun --nproc-per-node N (default 1)")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if not math.isfinite(args.temperature) or args.temperature < 0:
        p.error(f"--temperature must be a finite number >= 0, not {args.temperature}")
    if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        p.error(f"--top-p must be in (0, 1], not {args.top_p}")
    if args.max_batch_tokens is not None and args.max_batch_tokens > args.capacity:
        p.error("--max-batch-tokens must be at most --capacity")
    if args.deterministic and args.tp > 1:
        # refused here, before every rank joins the group, loads and shards the model
        p.error("--deterministic does not run with --tp > 1: the ranks' all-reduces sum in an order "
                "that depends on the step's size")
    if args.native and args.tp > 1:
        p.error("--native does not run with --tp > 1 (its forward has no all-reduces)")
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
        # every rank past its last collective before any tears them down; not after Ctrl-C,
        # which may have stopped a rank inside a collective the others never finish
        if world > 1 and code != 130:
            import torch.distributed as dist

            dist.barrier()
        return code
    except KeyboardInterrupt:                         # before any token, or a second Ctrl-C
        if rank == 0:
            print("cellcache generate: interrupted", file=sys.stderr)
        return 130
    finally:
        if world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


#: The sizes of a checkpoint's config.json (top level, and ``text_config`` of a multimodal one)
#: that must be ints >= 1 where present and not null.
CONFIG_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                "sliding_window")


def config_problem(config: Any) -> str | None:
    """What is wrong with a checkpoint's config.json (its parsed JSON) in the sizes a decoder
    is built from (:data:`CONFIG_SIZES`: ints >= 1; the attention heads a multiple of the KV
    heads), as one line; None when nothing is."""
    if not isinstance(config, dict):
        return f"config.json holds a {type(config).__name__}, not an object"
    for where, cfg in (("", config), ("text_config.", config.get("text_config"))):
        if not isinstance(cfg, dict):
            continue
        for key in CONFIG_SIZES:
            value = cfg.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                return f"config.json has {where}{key}={value!r}; it must be an int >= 1"
        heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
        if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
            return (f"config.json has {where}num_attention_heads={heads}, not a multiple of "
                    f"{where}num_key_value_heads={kv}")
    return None


def _model_dir_problem(path: str) -> str | None:
    """Why ``--model path`` names no checkpoint this command can read, as one line; None when
    it is a directory (or, not being one, a model already in the Hugging Face cache)."""
    if os.path.isdir(path):
        return None
    if os.path.exists(path):
        return f"--model {path} is a file, not a checkpoint directory"
    try:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(path, "config.json"), str):
            return None
    except (ImportError, ValueError):                 # not a repo id either
        pass
    return f"--model {path}: the directory does not exist (nothing is downloaded: give a local checkpoint)"


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocation that failed: torch's OutOfMemoryError (CUDA), a CPU
    allocator's RuntimeError, or Python's MemoryError."""
    if isinstance(e, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("DefaultCPUAllocator" in text or "can't allocate memory" in text)


def _oom_size(e: BaseException) -> str:
    """The size a failed allocation asked for, as its message gives it (``20.00 GiB``,
    ``123456 bytes``), or ``""``."""
    m = re.search(r"[Tt]ried to allocate ([0-9]+ bytes|[0-9.]+ ?[KMGTP]?i?B\b)", str(e))
    return m.group(1) if m else ""


def out_of_memory(what: str, e: BaseException, advice: str) -> OutOfMemory:
    """The one-line error of an allocation that failed while doing ``what``, naming what to change."""
    size = _oom_size(e)
    return OutOfMemory(f"{what} ran out of memory{f' (an allocation of {size} failed)' if size else ''}; "
                       f"{advice}")


def _refuse(e: CellCacheError) -> NoReturn:
    """Exits 2 with ``e`` as one line (printed by whichever rank it happened on)."""
    print(f"cellcache generate: error: {type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(2)


def _load(p: Parser, args: Any, dtype: torch.dtype, place: Any) -> tuple[Any, Any]:
    """The model on ``place`` and its tokenizer (None for random weights or a checkpoint
    without one). A checkpoint that cannot be read is a usage error (one line, exit 2), a
    model that does not fit is ``OutOfMemory`` (one line, exit 2)."""
    try:
        if args.random:
            return random_model(args.random, dtype, place, args.seed), None
        return _load_checkpoint(p, args.model, dtype, place)
    except (RuntimeError, MemoryError) as e:
        if not is_out_of_memory(e):
            raise
        to_try = ["--dtype bfloat16 or float16 (half of float32's memory)"] if dtype == torch.float32 else []
        to_try += ["a smaller model" if args.model else "a smaller --random model",
                   "a device with more free memory (--tp does not help: every rank loads the whole "
                   "model before sharding it)"]
        _refuse(out_of_memory(f"loading {args.random or args.model} ({str(dtype).removeprefix('torch.')}) "
                              f"on {place}", e, "give " + ", or ".join(to_try)))


def _load_checkpoint(p: Parser, path: str, dtype: torch.dtype, place: Any) -> tuple[Any, Any]:
    """:func:`_load` for ``--model path``: whatever stops transformers from reading the
    checkpoint is one line (its directory, its config.json, weights that do not match it);
    an allocation that fails propagates."""
    problem = _model_dir_problem(path)
    if problem:
        p.error(problem)
    config_file = os.path.join(path, "config.json")
    if os.path.isfile(config_file):
        try:
            with open(config_file, encoding="utf-8") as f:
                problem = config_problem(json.load(f))
        except (OSError, ValueError) as e:
            problem = f"config.json cannot be read: {_one_line(e)}"
        if problem:
            p.error(f"cannot load the model {path}: {problem}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:            # its validators raise any type for a bad value (ZeroDivisionError...)
        p.error(f"cannot load the model {path}: its config: {type(e).__name__}: {_one_line(e)}")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype).to(place).eval()
    except (OSError, ValueError, TypeError, RuntimeError) as e:
        if is_out_of_memory(e):
            raise
        p.error(f"cannot load the model {path}: {_one_line(e)}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer


def _report(args: Any, gen: Generator, reqs: list[Request], tokenizer: Any, device: str, world: int,
            elapsed: float, interrupted: bool) -> None:
    """Prints the outputs of ``reqs`` (as they stand: a continuation still running when Ctrl-C
    came has the finish reason ``"interrupted"``), the summary and the latencies; as JSON with
    ``--json``."""
    out_tokens = gen.stats["tokens_out"]
    results = []
    for r in reqs:
        item: dict[str, Any] = {"id": r.id, "prompt_tokens": len(r.prompt), "outputs": r.outputs,
                                "finish_reasons": [f or "interrupted" for f in r.finish_reasons]}
        if r.ttft is not None:
            item["ttft_ms"] = 1e3 * r.ttft
        if r.error is not None:
            item["error"] = _one_line(r.error)
        if tokenizer is not None:
            item["text"] = [tokenizer.decode(o) for o in r.outputs]
        results.append(item)
    rate = out_tokens / elapsed if elapsed > 0 else 0.0
    summary = {"model": args.model or args.random, "device": device, "tp": world, "requests": len(results),
               "interrupted": interrupted, "tokens_out": out_tokens, "seconds": elapsed,
               "tokens_per_s": rate, "prefix_cache": gen.prefix is not None, "admission": args.admission,
               "max_batch_tokens": gen.max_batch, **gen.stats, "latency": gen.latency(reqs)}
    if args.json:
        print(json.dumps({"summary": summary, "results": results}, indent=2), flush=True)
        return
    for item in results:
        for k, o in enumerate(item.get("text") or item["outputs"]):
            cut = " [interrupted]" if item["finish_reasons"][k] == "interrupted" else ""
            print(f"[{item['id']}.{k}]{cut} {o}")
    done = sum(1 for r in reqs if r.done)
    head = f"{len(results)} requests"
    if interrupted:
        head = f"interrupted: {done} of {head} done"
    print(f"generate: {head}, {out_tokens} tokens in {elapsed:.2f} s = "
          f"{rate:.1f} tokens/s ({gen.stats['steps']} steps, "
          f"{gen.stats['graph_steps']} by graph replay, {gen.stats['preempted']} preempted); "
          f"prompts {gen.stats['prompt_tokens']} tokens: {gen.stats['cached_tokens']} from the "
          f"prefix cache, {gen.stats['computed_tokens']} computed")
    lat = summary["latency"]
    if lat["ttft_ms_p50"] is not None:
        itl = "" if lat["itl_ms_p50"] is None else \
            f"; inter-token p50 {lat['itl_ms_p50']:.2f} ms, p99 {lat['itl_ms_p99']:.2f} ms"
        print(f"generate: time to first token p50 {lat['ttft_ms_p50']:.1f} ms, "
              f"p99 {lat['ttft_ms_p99']:.1f} ms{itl}")
    if sys.stdout is not None:                    # None: started with stdout closed (>&-)
        sys.stdout.flush()


def _serve(p: Parser, args: Any, texts: list[str], device: str, place: Any, dtype: torch.dtype,
           rank: int, world: int) -> int:
    """Everything after the process group: load, add (rank 0), run, print (rank 0). Returns
    0, or 130 when Ctrl-C stopped the run (what was generated is printed all the same)."""
    if rank != 0:                                     # the same usage errors, printed once
        p.error = lambda message: sys.exit(2)  # type: ignore[method-assign]
    model, tokenizer = _load(p, args, dtype, place)
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
            if not ids:
                p.error(f"prompt {t!r} is empty: give at least one token id")
            if min(ids) < 0 or max(ids) >= vocab:
                p.error(f"prompt {t!r}: token ids must lie in [0, {vocab})")
            prompts.append(ids)
    rng = np.random.default_rng(args.seed)
    prompts += [rng.integers(0, vocab, size=args.prompt_len).tolist() for _ in range(args.random_prompts)]
    if not prompts:
        p.error("no prompts: give some, --prompts-file or --random-prompts")
    sizes = f"--capacity {args.capacity}, --max-batch-tokens {args.max_batch_tokens}"
    try:
        gen = Generator(model, capacity=args.capacity, max_batch_tokens=args.max_batch_tokens,
                        max_seqs=min(4096, max(64, 2 * len(prompts) * args.n)),
                        graphs=False if args.no_graphs else None,
                        prefix_cache=not args.no_prefix_cache, admission=args.admission,
                        tp=world if world > 1 else None, deterministic=args.deterministic,
                        kv_dtype=None if args.kv_dtype == "auto" else "float8_e4m3fn",
                        native=args.native)
    except (CellCacheError, MemoryError) as e:
        p.error(f"cannot serve this model with --capacity {args.capacity} on {device}: {_one_line(e)}")
    except RuntimeError as e:
        if not is_out_of_memory(e):
            raise
        _refuse(out_of_memory(f"building the cache and step buffers ({sizes}) on {place}", e,
                              "give a smaller --capacity or --max-batch-tokens"))
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p, seed=args.seed, n=args.n)
    reqs = []
    for i, ids in enumerate(prompts if rank == 0 else []):     # the other ranks follow rank 0
        try:
            reqs.append(gen.add(ids, sampling))
        except InvalidArgument as e:
            p.error(f"prompt {i}: {_one_line(e)}")
    t0 = time.perf_counter()
    interrupted = False
    try:
        gen.run(progress=not args.quiet and rank == 0)
    except KeyboardInterrupt:                         # the generator is whole: report what it has
        interrupted = True
    except RuntimeError as e:
        lost = gen.cache.peer_error(e) if isinstance(gen.cache, TPCache) else None
        if lost is not None:                          # a rank lost in the model's collectives
            _refuse(lost)
        if not is_out_of_memory(e):
            raise
        _refuse(out_of_memory(f"a step of at most --max-batch-tokens {args.max_batch_tokens} on {place}",
                              e, "give a smaller --max-batch-tokens"))
    elapsed = time.perf_counter() - t0
    if rank != 0:
        return 130 if interrupted else 0
    if not interrupted:
        _report(args, gen, reqs, tokenizer, device, world, elapsed, False)
        return 0
    with _sigint_ignored():          # a second Ctrl-C (or torchrun passing it on) would cut it short
        _report(args, gen, reqs, tokenizer, device, world, elapsed, True)
        print(f"cellcache generate: interrupted after {gen.stats['tokens_out']} tokens; what was "
              "generated is above", file=sys.stderr)
    return 130


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored inside (in the main thread; elsewhere signals are not this thread's)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
