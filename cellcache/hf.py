"""Hugging Face transformers over the cache: a decoder-only model runs its forwards on
cellcache steps, with continuous batching, forks and rewinds underneath.

>>> from transformers import AutoModelForCausalLM
>>> import cellcache as cc, cellcache.hf as cchf
>>> model = AutoModelForCausalLM.from_pretrained(path, dtype="bfloat16").cuda()    # doctest: +SKIP
>>> cache = cc.build("auto", "batched", cchf.cache_config(model, capacity=1 << 16))  # doctest: +SKIP
>>> runner = cchf.attach(model, cache)                                             # doctest: +SKIP
>>> a = cache.seq_new(); cache.declare_step([a] * 5)                               # doctest: +SKIP
>>> step = cache.prepare_step(stream=torch.cuda.current_stream())                  # doctest: +SKIP
>>> logits = runner.forward(step, tokens=[1, 2, 3, 4, 5], logit_rows=[4])           # doctest: +SKIP

:func:`attach` registers an attention function named ``"cellcache"`` in transformers'
``AttentionInterface`` and switches the model to it; transformers then builds no masks of
its own (it does so only for the attention functions it knows). The function reads the
layer's K/V from the model, writes them at the step's cells and attends through
:func:`cellcache.torch.attention`. One forward carries every sequence of a step as one
row of ``[1, T]`` tokens with the step's positions (RoPE needs nothing else).
:func:`cache_config` maps the model's ``layer_types``/``sliding_window`` to per-layer
windows. :class:`cellcache.generate.Generator` builds continuous batching on top.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import torch as cct
from .cache import CellCache, Step
from .config import CacheConfig, LayerConfig
from .errors import InvalidArgument, InvalidState

__all__ = ["ATTENTION_NAME", "ModelRunner", "attach", "cache_config", "layer_windows"]

ATTENTION_NAME = "cellcache"
_CURRENT: contextvars.ContextVar = contextvars.ContextVar("cellcache_step", default=None)


@dataclass
class _Current:
    view: cct.TorchView
    step: Step | None
    backend: str


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def layer_windows(config: Any) -> list[int]:
    """Each decoder layer's window (0: full attention) from a transformers config.

    ``layer_types`` names each layer's kind (``"sliding_attention"`` uses
    ``sliding_window``); without it a ``sliding_window`` applies to every layer (Mistral)
    unless the config switches it off (Qwen2's ``use_sliding_window``).
    """
    cfg = _text_config(config)
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None) or 0
    if getattr(cfg, "use_sliding_window", True) is False:
        window = 0
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return [int(window)] * n
    out = []
    for i, kind in enumerate(types[:n]):
        if kind == "full_attention":
            out.append(0)
        elif kind == "sliding_attention":
            if not window:
                raise InvalidArgument(f"layer {i} is sliding_attention but the config has no sliding_window")
            out.append(int(window))
        else:
            raise InvalidArgument(f"layer {i} has attention type {kind!r}; cellcache serves "
                                  "full_attention and sliding_attention layers")
    return out


def cache_config(model_or_config: Any, capacity: int, max_write: int = 512, max_seqs: int = 256,
                 dtype: Any = None, paged: bool | None = None, mask_format: str | None = None,
                 initial_capacity: int = 512, device: int | None = None, **extra: Any) -> CacheConfig:
    """A :class:`CacheConfig` for a transformers decoder: one layer per decoder layer, its KV
    heads, head_dim and window. ``paged``/``mask_format`` default to the paged view without
    masks on CUDA models and masks without the paged view on CPU ones."""
    config = getattr(model_or_config, "config", model_or_config)
    cfg = _text_config(config)
    if getattr(cfg, "attn_logit_softcapping", None):
        raise InvalidArgument("attention logit soft-capping is not supported by cellcache's attention")
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layers = [LayerConfig(kv_heads, head_dim, w) for w in layer_windows(cfg)]
    model_dtype = getattr(model_or_config, "dtype", None)
    on_cuda = getattr(getattr(model_or_config, "device", None), "type", "cpu") == "cuda"
    if dtype is None:
        dtype = str(model_dtype).removeprefix("torch.") if model_dtype is not None else "bfloat16"
    if paged is None:
        paged = on_cuda
    if mask_format is None:
        mask_format = "none" if on_cuda else "bool"
    if device is None:
        dev = getattr(model_or_config, "device", None)
        device = (getattr(dev, "index", None) or 0) if on_cuda else 0
    return CacheConfig(capacity=capacity, layers=layers, max_write=max_write,
                       initial_capacity=min(initial_capacity, capacity), dtype=dtype,
                       max_seqs=max_seqs, device=device, paged=paged, mask_format=mask_format,
                       **extra)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The function transformers calls for every attention layer (see :func:`attach`)."""
    cur = _CURRENT.get()
    if cur is None:
        raise InvalidState("the model's attention is cellcache's, but no step is running: run "
                           "forwards through ModelRunner.forward, or call "
                           "model.set_attn_implementation('sdpa') to use the model without cellcache")
    layer = module.layer_idx
    q = query[0].transpose(0, 1)                      # [T, H, D] (a view)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    out = cct.attention(cur.view, layer, q, k, v, step=cur.step, backend=cur.backend, scale=scaling)
    return out[None].to(query.dtype), None


def register() -> None:
    """Registers the attention function with transformers (once; safe to repeat)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _attention)


def attach(model: Any, cache: CellCache, *, graphs: bool | None = None,
           buckets: list[int] | None = None) -> ModelRunner:
    """Switches ``model`` to cellcache's attention and returns the :class:`ModelRunner`
    that runs its forwards on ``cache``'s steps."""
    cfg = _text_config(model.config)
    if len(cache.config.layers) != cfg.num_hidden_layers:
        raise InvalidArgument(f"the cache has {len(cache.config.layers)} layers; the model "
                              f"{cfg.num_hidden_layers} (build the config with cache_config(model))")
    windows = layer_windows(cfg)
    for i, (layer, w) in enumerate(zip(cache.config.layers, windows)):
        if layer.window != w:
            raise InvalidArgument(f"layer {i}: the cache's window {layer.window} is not the model's {w}")
    register()
    model.set_attn_implementation(ATTENTION_NAME)
    return ModelRunner(model, cache, graphs=graphs, buckets=buckets)


class ModelRunner:
    """Runs a model's forward for a prepared step: tokens in, logits of chosen rows out.

    On CUDA with the paged view, decode steps (every row its sequence's next token) whose
    padded width is a bucket replay a CUDA graph captured once per bucket; everything else
    runs eagerly (prefill chunks through the tiled prefill kernel).
    """

    def __init__(self, model: Any, cache: CellCache, *, graphs: bool | None = None,
                 buckets: list[int] | None = None):
        self.model, self.cache = model, cache
        self.view = cct.TorchView(cache)
        self.device = self.view.device
        mw = cache.config.max_write
        self.cuda = self.view.cuda
        self.graphs_enabled = (self.cuda and cache.config.paged) if graphs is None else graphs
        if self.graphs_enabled and not (self.cuda and cache.config.paged):
            raise InvalidArgument("graph replay needs a CUDA cache built with paged=True")
        self.buckets = sorted(buckets or [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b <= mw])
        self.input_ids = torch.zeros((1, mw), dtype=torch.long, device=self.device)
        self._graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self.replays = 0
        self.eager = 0

    def bucket(self, width: int) -> int | None:
        """The smallest bucket that holds ``width`` rows (None when none does)."""
        return next((b for b in self.buckets if b >= width), None)

    def _positions(self, step: Step) -> torch.Tensor:
        return self.view.positions[:step.pad_to][None]

    def _run(self, step: Step, backend: str, rows: torch.Tensor | None) -> torch.Tensor:
        T = step.pad_to
        token = _CURRENT.set(_Current(self.view, step, backend))
        try:
            out = self.model(input_ids=self.input_ids[:, :T], position_ids=self._positions(step),
                             use_cache=False, logits_to_keep=rows if rows is not None else 0)
        finally:
            _CURRENT.reset(token)
        return out.logits[0]

    def forward(self, step: Step, tokens: Any, logit_rows: Any = None, decode: bool = False) -> torch.Tensor:
        """Runs the forward of ``step`` on ``tokens`` (one per real row); returns float32
        logits ``[len(logit_rows), vocab]`` (all real rows when None).

        ``decode`` says every row is its sequence's next token (one token per sequence);
        then, on CUDA with graphs on, the step is replayed from a graph of its padded width.
        """
        T, width = step.pad_to, step.width
        ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64)[:width])
        self.input_ids[0, :width].copy_(ids, non_blocking=False)
        if T > width:
            self.input_ids[0, width:T].zero_()
        rows = np.arange(width) if logit_rows is None else np.asarray(logit_rows, dtype=np.int64)
        with torch.inference_mode():
            if self.graphs_enabled and decode and T in self.buckets:
                logits = self._replay(step)
                self.replays += 1
                return logits[torch.as_tensor(rows, device=logits.device)].float()
            self.eager += 1
            backend = "auto"
            if self.cuda and self.cache.config.paged and width > 1 and not decode:
                backend = "prefill"
            rows_t = torch.as_tensor(rows, device=self.device)
            return self._run(step, backend, rows_t).float()

    def _replay(self, step: Step) -> torch.Tensor:
        T = step.pad_to
        if T not in self._graphs:
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._run(step, "paged", None)         # warm-up: allocations, kernel loads
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = self._run(step, "paged", None)
            self._graphs[T] = (graph, logits)
        graph, logits = self._graphs[T]
        graph.replay()
        return logits
