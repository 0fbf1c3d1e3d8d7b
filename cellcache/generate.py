"""Continuous batching for a Hugging Face decoder on the cache, and ``cellcache generate``.

:class:`Generator` keeps requests arriving at any time; every step carries each running
sequence's next token and chunks of prompts still being read, in one forward. Around it:

- sampling: greedy, or seeded temperature / top-k / top-p per request; stop tokens and a
  token budget;
- ``n > 1``: the prompt is read once; at its first token the sequence is cloned
  (``seq_clone``: the prompt's cells are shared, nothing is copied) and each continuation
  samples on its own;
- speculative decoding: a request given a ``draft`` callable gets ``k`` proposed tokens
  verified in one step; the rejected ones are rewound (``rewind``). The emitted tokens are
  what plain decoding would emit (greedy) or distributed as it (sampling);
- preemption: when cells run short the sequence holding the most is freed and requeued;
  it is recomputed (its prompt and output so far read again) when cells are free;
- streaming: ``on_token(request, continuation, token)`` after every token;
- on CUDA, decode steps replay a CUDA graph of their padded width (:class:`cellcache.hf.ModelRunner`).

>>> gen = Generator(model, capacity=1 << 16)                                   # doctest: +SKIP
>>> req = gen.add([1, 2, 3], Sampling(max_new_tokens=16))                      # doctest: +SKIP
>>> gen.run(); req.outputs[0]                                                   # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ._cli import Parser, in_range
from .cache import CellCache
from .errors import InvalidArgument, StepTooLarge
from .hf import attach, cache_config
from .registry import build

__all__ = ["Generator", "Request", "Sampling", "main"]


@dataclass
class Sampling:
    """How a request samples. ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 keep
    every token; ``seed`` makes sampling repeatable; ``stop`` ends a continuation (the stop
    token is kept); ``n`` continuations share the prompt."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[int] = ()
    n: int = 1

    def __post_init__(self):
        if self.max_new_tokens < 1 or self.n < 1 or self.temperature < 0 or self.top_k < 0 \
                or not 0 < self.top_p <= 1:
            raise InvalidArgument(f"invalid sampling parameters {self}")


@dataclass
class _Seq:
    req: Request
    index: int                       # which continuation of its request
    tokens: list[int]                # prompt + output so far
    sid: int | None = None           # cache id while running
    in_cache: int = 0                # tokens[:in_cache] are in the cache
    drafts: list[int] = field(default_factory=list)
    rng: torch.Generator | None = None
    done: bool = False


@dataclass
class Request:
    """A prompt being served: ``outputs[k]`` is continuation k's tokens so far."""

    id: int
    prompt: list[int]
    sampling: Sampling
    on_token: Callable | None = None
    draft: Callable | None = None
    draft_k: int = 0
    outputs: list[list[int]] = field(default_factory=list)
    arrived: float = 0.0
    finished: float | None = None

    @property
    def done(self) -> bool:
        return self.finished is not None


class Generator:
    """Continuous batching of a transformers decoder over a cellcache (module docstring).

    ``cache`` defaults to one built for the model (:func:`cellcache.hf.cache_config`; CUDA
    with the paged view when the model is on a GPU, the host backend otherwise) with
    ``capacity`` cells and ``max_batch_tokens`` rows a step. ``prefill_chunk`` bounds the
    prompt tokens one sequence reads per step.
    """

    def __init__(self, model: Any, cache: CellCache | None = None, *, capacity: int = 1 << 15,
                 max_batch_tokens: int = 512, max_seqs: int = 256, prefill_chunk: int = 256,
                 graphs: bool | None = None, buckets: list[int] | None = None,
                 eos: Sequence[int] | None = None):
        if cache is None:
            cfg = cache_config(model, capacity=capacity, max_write=max_batch_tokens, max_seqs=max_seqs)
            cache = build("cuda" if model.device.type == "cuda" else "host", "batched", cfg)
        self.model, self.cache = model, cache
        self.runner = attach(model, cache, graphs=graphs, buckets=buckets)
        self.max_batch = cache.config.max_write
        self.prefill_chunk = max(1, prefill_chunk)
        if eos is None:
            eos_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
            eos = [eos_id] if isinstance(eos_id, int) else list(eos_id or [])
        self.eos = set(int(e) for e in eos)
        self.requests: list[Request] = []
        self.waiting: list[_Seq] = []          # no cache id yet (new, or preempted)
        self.running: list[_Seq] = []
        self.stats = {"steps": 0, "tokens_in": 0, "tokens_out": 0, "preempted": 0,
                      "forks": 0, "drafted": 0, "accepted": 0, "graph_steps": 0}
        self._ids = 0
        self.stream = torch.cuda.current_stream(self.runner.device) if self.runner.cuda else None

    # -- requests --------------------------------------------------------------------------------
    def add(self, prompt: Sequence[int], sampling: Sampling | None = None, *,
            on_token: Callable | None = None, draft: Callable | None = None,
            draft_k: int = 4) -> Request:
        """Queues a prompt (token ids); returns its Request. ``draft(tokens, k)`` proposes
        up to ``k`` next tokens for speculative decoding."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise InvalidArgument("a prompt needs at least one token")
        sampling = sampling or Sampling()
        req = Request(self._ids, prompt, sampling, on_token, draft, draft_k if draft else 0,
                      outputs=[[] for _ in range(sampling.n)], arrived=time.perf_counter())
        self._ids += 1
        self.requests.append(req)
        self.waiting.append(self._seq(req, 0, list(prompt)))
        return req

    def _seq(self, req: Request, index: int, tokens: list[int]) -> _Seq:
        rng = None
        if req.sampling.temperature > 0:
            rng = torch.Generator(device="cpu")
            rng.manual_seed((req.sampling.seed if req.sampling.seed is not None else req.id) * 1009 + index)
        return _Seq(req, index, tokens, rng=rng)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------------------------
    def _plan(self) -> tuple[list[tuple[_Seq, list[int]]], bool]:
        """The step's rows: (sequence, tokens it feeds) in order; and whether it is decode-only."""
        plan: list[tuple[_Seq, list[int]]] = []
        budget = self.max_batch
        decode_only = True
        for s in self.running:                        # decode (and verify) rows first
            pending = s.tokens[s.in_cache:]
            if len(pending) == 1 and budget > 0:
                s.drafts = s.drafts[: max(0, budget - 1)]     # verify only what fits
                feed = pending + s.drafts
                plan.append((s, feed))
                budget -= len(feed)
                decode_only &= len(feed) == 1
        for s in self.running:                        # then prompt chunks (and recomputes)
            pending = s.tokens[s.in_cache:]
            if len(pending) > 1 and budget > 0:
                feed = pending[: min(budget, self.prefill_chunk)]
                plan.append((s, feed))
                budget -= len(feed)
                decode_only = False
        while self.waiting and budget > 0:            # admit waiting sequences
            s = self.waiting[0]
            sid = self.cache.seq_new()
            if sid is None:
                break
            self.waiting.pop(0)
            s.sid, s.in_cache = sid, 0
            self.running.append(s)
            feed = s.tokens[: min(budget, self.prefill_chunk)]
            plan.append((s, feed))
            budget -= len(feed)
            decode_only = False
        return plan, decode_only

    def _preempt(self) -> bool:
        """Frees the running sequence holding the most cells and requeues it (it is read
        again later); False when no sequence holds any."""
        victims = [s for s in self.running if s.sid is not None and s.in_cache > 0]
        if not victims:
            return False
        v = max(victims, key=lambda s: s.in_cache)
        assert v.sid is not None
        self.cache.seq_rm(v.sid)
        v.sid, v.in_cache, v.drafts = None, 0, []
        self.running.remove(v)
        self.waiting.insert(0, v)
        self.stats["preempted"] += 1
        return True

    def step(self) -> bool:
        """Runs one step; False when there is nothing to do."""
        for s in self.running:                        # speculative proposals
            r = s.req
            if r.draft is not None and len(s.tokens) - s.in_cache == 1:
                left = r.sampling.max_new_tokens - len(r.outputs[s.index]) - 1
                proposed = r.draft(list(s.tokens), max(0, min(r.draft_k, left)))
                s.drafts = [int(t) for t in proposed][:max(0, left)]
                self.stats["drafted"] += len(s.drafts)
        while True:
            plan, decode_only = self._plan()
            if not plan:
                return False
            ids = [s.sid for s, feed in plan for _ in feed]
            try:
                ok = self.cache.declare_step(ids)
            except StepTooLarge:
                ok = False
            if ok:
                break
            if not self._preempt():
                raise InvalidArgument(
                    f"a step of {len(ids)} tokens does not fit the cache even alone: raise "
                    "capacity (or max_kv), or lower max_batch_tokens / prefill_chunk")
        tokens = [t for _, feed in plan for t in feed]
        pad_to = None
        if decode_only and self.runner.graphs_enabled:
            pad_to = self.runner.bucket(len(tokens))
        step = self.cache.prepare_step(stream=self.stream, pad_to=pad_to)
        # rows whose logits matter: each sequence's last fed token, if it reaches the end of
        # what the sequence knows; every row of a verify run
        rows: list[int] = []
        owners: list[tuple[_Seq, list[int], int | None]] = []
        row = 0
        for s, feed in plan:
            end = row + len(feed)
            known_end = s.in_cache + len(feed) >= len(s.tokens)
            if s.drafts and known_end:
                rows += list(range(row, end))
                owners.append((s, feed, len(rows) - len(feed)))
            elif known_end:
                rows.append(end - 1)
                owners.append((s, feed, len(rows) - 1))
            else:
                owners.append((s, feed, None))
            row = end
        logits = self.runner.forward(step, tokens, rows, decode=decode_only and pad_to is not None)
        self.cache.commit_step()
        self.stats["steps"] += 1
        self.stats["tokens_in"] += len(tokens)
        self.stats["graph_steps"] += int(decode_only and pad_to is not None)
        for s, feed, first in owners:
            self._advance(s, feed, logits, first)
        self.running = [s for s in self.running if not s.done]
        return True

    def _advance(self, s: _Seq, feed: list[int], logits: torch.Tensor, first: int | None) -> None:
        before = s.in_cache
        if first is None:                             # a prompt chunk that ends mid-prompt
            s.in_cache += len(feed)
            return
        n_draft = len(s.drafts) if s.drafts else 0
        if n_draft and len(feed) == 1 + n_draft:
            accepted = 0
            for j in range(n_draft):
                tok = self._sample(s, logits[first + j])
                if tok == s.drafts[j]:
                    accepted += 1
                    if self._emit(s, tok):
                        break
                    continue
                self._emit(s, tok)
                break
            else:
                if not s.done:
                    self._emit(s, self._sample(s, logits[first + n_draft]))
            self.stats["accepted"] += accepted
            keep = before + 1 + accepted
            if keep < before + len(feed):
                assert s.sid is not None and self.cache.rewind(s.sid, keep)
            s.in_cache = keep if not s.done else s.in_cache
            s.drafts = []
            if s.done:
                self._finish(s)
            return
        s.in_cache = before + len(feed)
        s.drafts = []
        req = s.req
        row = logits[first]
        if s.index == 0 and not req.outputs[0] and req.sampling.n > 1 and len(s.tokens) == len(req.prompt):
            self._fork(s, row)
        self._emit(s, self._sample(s, row))
        if s.done:
            self._finish(s)

    def _fork(self, parent: _Seq, row: torch.Tensor) -> None:
        """Continuations 1..n-1 of parent's request: clones sharing the prompt's cells."""
        req = parent.req
        assert parent.sid is not None
        for k in range(1, req.sampling.n):
            child = self._seq(req, k, list(req.prompt))
            sid = self.cache.seq_clone(parent.sid)
            if sid is None:                           # no free id: read the prompt again later
                self.waiting.append(child)
                continue
            child.sid, child.in_cache = sid, parent.in_cache
            self.stats["forks"] += 1
            self.running.append(child)
            self._emit(child, self._sample(child, row))
            if child.done:
                self._finish(child)

    def _sample(self, s: _Seq, row: torch.Tensor) -> int:
        sp = s.req.sampling
        if sp.temperature == 0:
            return int(torch.argmax(row))
        logits = row.float().cpu() / sp.temperature
        if sp.top_k:
            kth = torch.topk(logits, min(sp.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, -math.inf)
        probs = torch.softmax(logits, dim=-1)
        if sp.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < sp.top_p
            sorted_p = sorted_p * keep
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
            probs = probs / probs.sum()
        return int(torch.multinomial(probs, 1, generator=s.rng))

    def _emit(self, s: _Seq, tok: int) -> bool:
        """Appends a token to a continuation; returns True when it is done."""
        req = s.req
        out = req.outputs[s.index]
        out.append(tok)
        s.tokens.append(tok)
        self.stats["tokens_out"] += 1
        if req.on_token is not None:
            req.on_token(req, s.index, tok)
        if tok in self.eos or tok in req.sampling.stop or len(out) >= req.sampling.max_new_tokens:
            s.done = True
        return s.done

    def _finish(self, s: _Seq) -> None:
        if s.sid is not None:
            self.cache.seq_rm(s.sid)
            s.sid = None
        req = s.req
        if all(len(o) > 0 for o in req.outputs) and all(
                self._continuation_done(req, k) for k in range(req.sampling.n)):
            req.finished = time.perf_counter()

    def _continuation_done(self, req: Request, k: int) -> bool:
        out = req.outputs[k]
        return bool(out) and (out[-1] in self.eos or out[-1] in req.sampling.stop
                              or len(out) >= req.sampling.max_new_tokens)

    def run(self, progress: bool = False) -> list[Request]:
        """Steps until every request is done; returns the requests."""
        total = sum(r.sampling.n * r.sampling.max_new_tokens for r in self.requests)
        last = -1
        while self.step():
            if progress:
                pct = 100 * self.stats["tokens_out"] // max(1, total)
                if pct // 5 != last:
                    last = pct // 5
                    print(f"generate: {self.stats['tokens_out']} tokens out, step {self.stats['steps']}, "
                          f"{len(self.running)} running, {len(self.waiting)} waiting",
                          file=sys.stderr, flush=True)
        if self.runner.cuda:
            torch.cuda.synchronize(self.runner.device)
        return self.requests


# -- models for trying it out ----------------------------------------------------------------

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


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="cellcache generate",
               description="Serve a Hugging Face decoder through cellcache with continuous batching. "
                           "Prompts are text (with --model and its tokenizer) or token ids.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a local Hugging Face checkpoint directory (no download)")
    src.add_argument("--random", choices=sorted(RANDOM_MODELS), help="random weights, built-in config")
    p.add_argument("prompts", nargs="*", help="prompts (text with --model; else space-separated token ids)")
    p.add_argument("--prompts-file", help="a file with one prompt per line")
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
    p.add_argument("--max-batch-tokens", type=in_range(1, 1 << 16), default=512)
    p.add_argument("--no-graphs", action="store_true", help="run decode steps eagerly on CUDA")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        p.error("--temperature must be >= 0 and --top-p in (0, 1]")
    if args.max_batch_tokens > args.capacity:
        p.error("--max-batch-tokens must be at most --capacity")
    device = args.device
    if device == "auto":
        from .cuda.probe import cuda_usable

        device = "cuda" if cuda_usable()[0] and torch.cuda.is_available() else "cpu"
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
        p.error(f"cannot load the model: {e}")
    texts = list(args.prompts)
    if args.prompts_file:
        try:
            with open(args.prompts_file) as f:
                texts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            p.error(f"cannot read --prompts-file: {e}")
    vocab = model.config.get_text_config().vocab_size
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
    gen = Generator(model, capacity=args.capacity, max_batch_tokens=args.max_batch_tokens,
                    max_seqs=min(4096, max(64, 2 * len(prompts) * args.n)),
                    graphs=False if args.no_graphs else None)
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p, seed=args.seed, n=args.n)
    for ids in prompts:
        gen.add(ids, Sampling(**sampling))
    t0 = time.perf_counter()
    gen.run(progress=not args.quiet)
    elapsed = time.perf_counter() - t0
    out_tokens = gen.stats["tokens_out"]
    results = []
    for r in gen.requests:
        item: dict[str, Any] = {"id": r.id, "prompt_tokens": len(r.prompt), "outputs": r.outputs}
        if tokenizer is not None:
            item["text"] = [tokenizer.decode(o) for o in r.outputs]
        results.append(item)
    summary = {"model": args.model or args.random, "device": device, "requests": len(prompts),
               "tokens_out": out_tokens, "seconds": elapsed, "tokens_per_s": out_tokens / elapsed,
               **gen.stats}
    if args.json:
        print(json.dumps({"summary": summary, "results": results}, indent=2))
    else:
        for item in results:
            for k, o in enumerate(item.get("text") or item["outputs"]):
                print(f"[{item['id']}.{k}] {o}")
        print(f"generate: {len(prompts)} requests, {out_tokens} tokens in {elapsed:.2f} s = "
              f"{out_tokens / elapsed:.1f} tokens/s ({gen.stats['steps']} steps, "
              f"{gen.stats['graph_steps']} by graph replay, {gen.stats['preempted']} preempted)")
    return 0
