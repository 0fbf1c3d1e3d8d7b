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
:func:`cellcache.torch.attention`. Before switching, attach checks the cache and the
runner's options; after, one probe forward of one token (written nowhere) checks that every
layer calls the function with nothing it does not compute (soft-capping, sinks,
bidirectional attention, ...): a refused attach leaves the model's attention setting as it
was. One forward carries every sequence of a step as one
row of ``[1, T]`` tokens with the step's positions (RoPE needs nothing else).
:func:`cache_config` maps the model's ``layer_types``/``sliding_window`` to per-layer
windows. :class:`cellcache.generate.Generator` builds continuous batching on top.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import torch as cct
from ._checks import CAPACITY_LIMIT, check_int
from .buckets import bucket_for, check_buckets, default_buckets, default_mixed_buckets
from .cache import CellCache, Step
from .config import CacheConfig, LayerConfig
from .errors import CellCacheError, InvalidArgument, InvalidState

__all__ = ["ATTENTION_NAME", "COMPILE_OPTIONS", "ModelRunner", "attach", "cache_config", "compile_options",
           "layer_windows", "vocab_size"]

ATTENTION_NAME = "cellcache"
_CURRENT = cct.FORWARD          # the step a forward runs on (a _Current), for the hook and the op

#: Keywords transformers passes to attention functions that do not change what attention
#: computes (the step's positions reach RoPE before attention; cellcache keeps the K/V).
_IGNORED_KWARGS = frozenset({
    "position_ids", "cache_position", "position_embeddings", "use_cache", "past_key_values",
    "past_key_value", "output_attentions", "output_router_logits", "output_hidden_states",
    "return_dict"})
#: Keywords that change the scores in ways cellcache's attention does not compute.
_SCORE_KWARGS = {"softcap": "attention logit soft-capping", "s_aux": "attention sinks",
                 "sinks": "attention sinks"}


@dataclass
class _Current:
    view: cct.TorchView
    step: Step | None
    backend: str
    calls: int = 0
    probe: list | None = None      # attach's probe: (layer, module config) per call; writes nothing


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def _config_int(cfg: Any, name: str, lo: int, default: int | None = None) -> int:
    """``cfg.name`` as an int ``>= lo``; ``default`` when it is absent or None (required
    when ``default`` is None)."""
    value = getattr(cfg, name, None)
    if value is None:
        if default is None:
            raise InvalidArgument(f"the model's config ({type(cfg).__name__}) has no {name}; "
                                  "give a transformers decoder model or its config")
        return default
    return check_int(value, f"config.{name}", lo, CAPACITY_LIMIT)


def _decoder_config(model_or_config: Any) -> Any:
    """The text config of a transformers model or config; InvalidArgument for anything else."""
    config = getattr(model_or_config, "config", model_or_config)
    cfg = _text_config(config)
    if getattr(cfg, "num_hidden_layers", None) is None:
        raise InvalidArgument(
            f"{type(model_or_config).__name__} is not a transformers decoder model or config "
            "(it has no num_hidden_layers)")
    return cfg


def layer_windows(config: Any) -> list[int]:
    """Each decoder layer's window (0: full attention) from a transformers config.

    ``layer_types`` names each layer's kind (``"sliding_attention"`` uses
    ``sliding_window``); without it a ``sliding_window`` applies to every layer (Mistral)
    unless the config switches it off (Qwen2's ``use_sliding_window``).
    """
    cfg = _decoder_config(config)
    n = _config_int(cfg, "num_hidden_layers", 1)
    window = _config_int(cfg, "sliding_window", 0, default=0)
    if getattr(cfg, "use_sliding_window", True) is False:
        window = 0
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return [window] * n
    if isinstance(types, (str, bytes)) or not hasattr(types, "__len__") or len(types) < n:
        raise InvalidArgument(f"config.layer_types={types!r} does not name a type for each of the "
                              f"{n} layers")
    out = []
    for i, kind in enumerate(list(types)[:n]):
        if kind == "full_attention":
            out.append(0)
        elif kind == "sliding_attention":
            if not window:
                raise InvalidArgument(f"layer {i} is sliding_attention but the config has no sliding_window")
            out.append(window)
        else:
            raise InvalidArgument(f"layer {i} has attention type {kind!r}; cellcache serves "
                                  "full_attention and sliding_attention layers")
    return out


_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(CacheConfig) if f.init)


def cache_config(model_or_config: Any, capacity: int, max_write: int | None = None, max_seqs: int = 256,
                 dtype: Any = None, paged: bool | None = None, mask_format: str | None = None,
                 initial_capacity: int = 512, device: int | None = None, **extra: Any) -> CacheConfig:
    """A :class:`CacheConfig` for a transformers decoder: one layer per decoder layer, its KV
    heads, head_dim and window. ``max_write`` defaults to ``min(512, capacity)``; ``paged``
    to the paged view on CUDA models; ``mask_format`` to no masks where the paged view
    serves (CUDA) and bool masks otherwise (the host backend and SDPA attend over masks).
    ``extra``: other :class:`CacheConfig` fields. A config that lacks what a decoder has, or
    a bad value, raises InvalidArgument.
    """
    cfg = _decoder_config(model_or_config)
    capacity = check_int(capacity, "capacity", 1, CAPACITY_LIMIT)
    if max_write is None:
        max_write = min(512, capacity)
    unknown = sorted(set(extra) - _CONFIG_FIELDS)
    if unknown:
        raise InvalidArgument(f"unknown CacheConfig field(s) {', '.join(unknown)}; fields are "
                              f"{', '.join(sorted(_CONFIG_FIELDS))}")
    if getattr(cfg, "attn_logit_softcapping", None):
        raise InvalidArgument("attention logit soft-capping is not supported by cellcache's attention")
    heads = _config_int(cfg, "num_attention_heads", 1)
    kv_heads = _config_int(cfg, "num_key_value_heads", 1, default=heads)
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim is None:
        hidden = _config_int(cfg, "hidden_size", 1)
        if hidden % heads:
            raise InvalidArgument(f"config.hidden_size={hidden} is not a multiple of "
                                  f"num_attention_heads={heads} and the config has no head_dim")
        head_dim = hidden // heads
    head_dim = check_int(head_dim, "config.head_dim", 1, CAPACITY_LIMIT)
    if heads % kv_heads:
        raise InvalidArgument(f"config.num_attention_heads={heads} is not a multiple of "
                              f"num_key_value_heads={kv_heads}")
    layers = [LayerConfig(kv_heads, head_dim, w) for w in layer_windows(cfg)]
    model_dtype = getattr(model_or_config, "dtype", None)
    dev = getattr(model_or_config, "device", None)
    on_cuda = getattr(dev, "type", "cpu") == "cuda"
    if dtype is None:
        dtype = str(model_dtype).removeprefix("torch.") if model_dtype is not None else "bfloat16"
    if paged is None:
        paged = on_cuda
    if mask_format is None:
        mask_format = "none" if on_cuda and paged is True else "bool"
    if device is None:
        device = (getattr(dev, "index", None) or 0) if on_cuda else 0
    return CacheConfig(capacity=capacity, layers=layers, max_write=max_write,
                       initial_capacity=initial_capacity, dtype=dtype, max_seqs=max_seqs,
                       device=device, paged=paged, mask_format=mask_format, **extra)


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {tuple(value.shape)} tensor"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_call(module: Any, query: Any, key: Any, value: Any, cur: _Current, dropout: Any,
                kwargs: dict) -> int:
    """Refuses an attention call cellcache would compute differently from the model (every
    such refusal comes up at attach's probe); returns the layer index."""
    cfg = cur.view.config
    n = len(cfg.layers)
    layer = getattr(module, "layer_idx", None)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
        raise InvalidArgument(f"attention module {type(module).__name__} has layer_idx={layer!r}; "
                              f"cellcache needs each decoder layer's index in [0, {n})")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4 or t.shape[0] != 1:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidArgument(f"layer {layer}: {name} is {shape}; cellcache runs a step as "
                                  "one [1, heads, T, head_dim] row (batch 1)")
    if dropout:
        raise InvalidArgument(f"layer {layer}: attention dropout {dropout} is not computed by "
                              "cellcache; call model.eval()")
    if getattr(module, "is_causal", True) is False or kwargs.get("is_causal", True) is False:
        raise InvalidArgument(f"layer {layer}: {type(module).__name__} is bidirectional "
                              "(is_causal=False); cellcache's attention is causal")
    window = cfg.layers[layer].window
    for k, v in kwargs.items():
        if k in _IGNORED_KWARGS or k == "is_causal" or v is None:
            continue
        if k == "sliding_window":
            if v != window and not (v == 0 and window == 0):
                raise InvalidArgument(f"layer {layer}: the model attends over a sliding window of "
                                      f"{_short(v)}, the cache's layer over {window or 'all'} "
                                      "positions: build the cache with cache_config(model)")
        elif k in _SCORE_KWARGS:
            if not (isinstance(v, (int, float)) and v == 0):
                raise InvalidArgument(f"layer {layer}: {_SCORE_KWARGS[k]} ({k}={_short(v)}) is not "
                                      "computed by cellcache's attention; this model is not supported")
        elif v is not False:
            raise InvalidArgument(f"layer {layer}: the attention keyword {k}={_short(v)} is not one "
                                  "cellcache's attention implements; this model is not supported")
    return layer


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The function transformers calls for every attention layer (see :func:`attach`)."""
    if torch.compiler.is_compiling():
        return _compiled_attention(module, query, key, value, scaling, dropout)
    cur = _CURRENT.get()
    if cur is None:
        raise InvalidState("the model's attention is cellcache's, but no step is running: run "
                           "forwards through ModelRunner.forward, or call "
                           "model.set_attn_implementation('sdpa') to use the model without cellcache")
    layer = _check_call(module, query, key, value, cur, dropout, kwargs)
    q = query[0].transpose(0, 1)                      # [T, H, D] (a view)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    cur.calls += 1
    if cur.probe is not None:                         # attach's probe: check, record, write nothing
        cct.check_qkv(cur.view, layer, q, k, v)
        cur.probe.append((layer, getattr(module, "config", None)))
        # the probe's one token at position 0 sees only itself: attention returns its V
        out = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return out[None].to(query.dtype), None
    out = cct.attention(cur.view, layer, q, k, v, step=cur.step, backend=cur.backend, scale=scaling)
    return out[None].to(query.dtype), None


def _compiled_attention(module, query, key, value, scaling, dropout):
    """The hook as dynamo traces it (a ``compile=True`` runner): the custom op
    ``cellcache::attention``, which reads the step from the context variable when it runs,
    so nothing here touches Python state dynamo would have to guard on or break at. The
    keyword checks of :func:`_check_call` ran at attach's (eager) probe; the op checks
    q, k, v against the step and layer on every call."""
    layer = module.layer_idx
    if dropout:
        raise InvalidArgument(f"layer {layer}: attention dropout {dropout} is not computed by "
                              "cellcache; call model.eval()")
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    out = cct.attention_op(q, k, v, layer, scaling)
    return out[None].to(query.dtype), None


def register() -> None:
    """Registers the attention function with transformers (once; safe to repeat)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _attention)


def _attn_configs(model: Any) -> list[Any]:
    """Every config of the model and its submodels that carries an attention setting."""
    found: dict[int, Any] = {}
    stack = [getattr(model, "config", None)]
    modules = getattr(model, "modules", None)
    if callable(modules):
        stack += [getattr(m, "config", None) for m in modules()]
    while stack:
        c = stack.pop()
        if c is None or id(c) in found or not hasattr(c, "_attn_implementation_internal"):
            continue
        found[id(c)] = c
        stack += [getattr(c, key, None) for key in (getattr(c, "sub_configs", None) or ())]
    return list(found.values())


def attach(model: Any, cache: CellCache, *, graphs: bool | None = None,
           buckets: list[int] | None = None, compile: bool | Mapping[str, Any] = False,
           mixed_buckets: list[int] | None = None, attention: str = "auto") -> ModelRunner:
    """Switches ``model`` to cellcache's attention and returns the :class:`ModelRunner`
    that runs its forwards on ``cache``'s steps.

    Everything is checked before the model changes: the cache's layers and windows against
    the model's, the runner's options (``graphs``, ``buckets``), the cache's attention path
    (a host cache needs masks). Then the model is switched and one probe forward of one
    token (written nowhere) checks that every decoder layer calls cellcache's attention
    with nothing it does not compute (soft-capping, attention sinks, bidirectional or
    dropout attention, a different sliding window, unknown keywords); a model that fails
    it (gpt-oss, Falcon, Gemma2 soft-capping, BERT) is refused with its attention setting
    restored. Every refusal raises InvalidArgument and changes nothing.

    ``compile``: False (default), True or a mapping of ``torch.compile`` keywords
    (``backend``, ``mode``, ``dynamic``, ``fullgraph``, ``options``): the runner's forwards
    go through ``torch.compile(model, ...)`` with attention as the custom op
    ``cellcache::attention``, so the graph does not break there (see :class:`ModelRunner`).

    To use the model without cellcache again: ``model.set_attn_implementation("sdpa")``;
    its runners then refuse to run (InvalidState) until :meth:`ModelRunner.reattach`.
    """
    if not isinstance(cache, CellCache):
        raise InvalidArgument(f"cache of type {type(cache).__name__} is not a cellcache cache")
    if not callable(getattr(model, "set_attn_implementation", None)):
        raise InvalidArgument(f"model of type {type(model).__name__} is not a transformers model "
                              "(it has no set_attn_implementation)")
    cfg = _decoder_config(model)
    windows = layer_windows(cfg)
    if len(cache.config.layers) != len(windows):
        raise InvalidArgument(f"the cache has {len(cache.config.layers)} layers; the model "
                              f"{len(windows)} (build the config with cache_config(model))")
    for i, (layer, w) in enumerate(zip(cache.config.layers, windows)):
        if layer.window != w:
            raise InvalidArgument(f"layer {i}: the cache's window {layer.window} is not the model's {w}")
    runner = ModelRunner(model, cache, graphs=graphs, buckets=buckets, compile=compile,
                         mixed_buckets=mixed_buckets, attention=attention)
    runner.reattach()
    return runner


class ModelRunner:
    """Runs a model's forward for a prepared step: tokens in, logits of chosen rows out.

    On CUDA with the paged view, decode steps (every row its sequence's next token) whose
    padded width is a bucket replay a CUDA graph captured once per bucket. Mixed steps
    (prompt chunks beside decode rows) padded to a token-count bucket of ``mixed_buckets``
    (default :func:`cellcache.buckets.default_mixed_buckets`; ``[]``: none) replay a graph
    per bucket too, whose attention reads the device-built work list and whose logits come
    for up to :attr:`logit_cap` rows given in a fixed device index buffer; a step with more
    logit rows, or a width at no bucket, runs eagerly. A
    model whose layers fall back to FlashInfer or SDPA (a head_dim or group cellcache's
    kernels do not take) runs every step eagerly. When a copy growth
    moves the pools, the next forward rebuilds the views and drops the graphs (recaptured
    on their next use).

    Build it with :func:`attach`. If the model's attention is switched away afterwards
    (``model.set_attn_implementation("sdpa")``), :meth:`forward` refuses (InvalidState)
    until :meth:`reattach` switches it back.

    ``attention``: ``"auto"`` (default: cellcache's kernels, chosen per layer shape) or
    ``"flashinfer"`` (every layer through FlashInfer's paged kernels over the same paged
    view, planned on the host each step, so every step runs eagerly; InvalidArgument
    without FlashInfer, without a paged CUDA cache, or with ``graphs=True``).

    ``compile`` (True or a mapping of ``torch.compile`` keywords; see :data:`COMPILE_OPTIONS`)
    runs every forward through ``torch.compile(model, **options)`` (default: inductor,
    ``dynamic=True``). ``dynamic=True`` makes the step width symbolic (the inputs are the
    token ids, positions and logit rows; parameters stay static): one graph serves every
    width, mixed steps and decode buckets alike (width 1 specializes: a second graph; a
    replayed bucket, which keeps every logit row, another), so mixed steps of any width
    never hit dynamo's recompile limit. ``dynamic=False`` compiles a graph per width (static
    shapes per decode bucket, but mixed widths soon exceed the limit and run eagerly);
    ``dynamic=None`` is torch's guess (static first, symbolic after a change). Attention is the custom op
    ``cellcache::attention`` (:func:`cellcache.torch.attention_op`), so the compiled
    forward is one graph. On CUDA with graphs the compiled forward is what each decode
    bucket captures (warm-up, which compiles, then capture): this runner stays the one
    owner of CUDA graphs, so modes that capture graphs themselves (``"reduce-overhead"``,
    ``"max-autotune"``, ``triton.cudagraphs``) are refused on CUDA, with or without the
    runner's graphs (the op decides its kernel per step). Attach's probe runs eagerly.
    """

    def __init__(self, model: Any, cache: CellCache, *, graphs: bool | None = None,
                 buckets: list[int] | None = None, compile: bool | Mapping[str, Any] = False,
                 mixed_buckets: list[int] | None = None, attention: str = "auto"):
        options = compile_options(compile)
        if attention not in ATTENTION_BACKENDS:
            raise InvalidArgument(f"attention={attention!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
        view = cct.TorchView(cache)
        config = getattr(model, "config", None)
        if config is None or not callable(model):
            raise InvalidArgument(f"model of type {type(model).__name__} is not a transformers model")
        cfg = cache.config
        mw = cfg.max_write
        paged_cuda = view.cuda and cfg.paged
        if cfg.mask_format == "none" and not paged_cuda:
            where = "the host backend" if not view.cuda else "a CUDA cache without the paged view"
            raise InvalidArgument(f"{where} attends over masks, and this cache has none "
                                  "(mask_format='none'): build it with mask_format='bool' or 'bits' "
                                  "(cache_config(model) does)")
        if graphs is not None and not isinstance(graphs, bool):
            raise InvalidArgument(f"graphs of type {type(graphs).__name__} is not a bool or None")
        if attention == "flashinfer":
            if not paged_cuda:
                raise InvalidArgument("attention='flashinfer' needs a CUDA cache built with paged=True")
            if not cct.have_flashinfer():
                raise InvalidArgument("attention='flashinfer': FlashInfer is not installed "
                                      "(pip install flashinfer-python)")
            if graphs:
                raise InvalidArgument("attention='flashinfer' plans each step on the host and cannot "
                                      "be replayed from a graph: pass graphs=False (or None)")
            graphs = False
        paths = _attention_paths(config, cfg) if paged_cuda else []
        # FlashInfer and SDPA fallbacks plan on the host or read the pools' row count, so
        # decode graphs are only for layers cellcache's or the tensor-core kernels take
        unsafe = [f"layer {i}: {p}" for i, p in enumerate(paths) if p not in ("tc", "paged")]
        graphs_enabled = (paged_cuda and not unsafe) if graphs is None else graphs
        if graphs_enabled and not paged_cuda:
            raise InvalidArgument("graph replay needs a CUDA cache built with paged=True")
        if graphs_enabled and unsafe:
            raise InvalidArgument(f"graph replay needs every layer on cellcache's or the tensor-core "
                                  f"kernels; {', '.join(unsafe[:4])} (its shape falls back): "
                                  "pass graphs=False")
        if options is not None and view.cuda and (
                options.get("mode") in _GRAPH_MODES
                or (options.get("options") or {}).get("triton.cudagraphs")):
            # inductor's own graphs would replay cellcache::attention without running it:
            # its per-step choices (kernel, decode or prefill variant) come from the step
            raise InvalidArgument(f"compile mode {options.get('mode')!r} with options "
                                  f"{options.get('options')!r} captures CUDA graphs itself, which "
                                  "cellcache's attention op cannot be replayed by; this runner "
                                  "captures the decode graphs (of the compiled forward): use mode "
                                  "'default' or 'max-autotune-no-cudagraphs'")
        chosen = default_buckets(mw, 512) if buckets is None else check_buckets(buckets, mw)
        if mixed_buckets is None:
            mixed = default_mixed_buckets(mw)
        elif isinstance(mixed_buckets, (list, tuple)) and len(mixed_buckets) == 0:
            mixed = []
        else:
            mixed = check_buckets(mixed_buckets, mw)
        self.model, self.cache, self.view = model, cache, view
        if options is not None:           # a symbolic width: one graph for every width
            options = {"dynamic": True, **options}
        #: The torch.compile options the forwards run under, or None (eager).
        self.compile = options
        # what _run calls: the model, or its compiled wrapper (attach's probe runs the model)
        self._forward = model if options is None else torch.compile(model, **options)
        self.device = view.device
        self.cuda = view.cuda
        self.graphs_enabled = graphs_enabled
        #: The attention backend every layer runs: "auto" (cellcache's kernels, the choice
        #: per shape) or "flashinfer" (FlashInfer's paged kernels over the same view, eager).
        self.attention = attention
        self.buckets = chosen
        #: Token-count buckets of the mixed-step graphs (see the class).
        self.mixed_buckets = mixed
        #: The most logit rows a mixed-step graph gives (its fixed index buffer's length: the
        #: largest decode bucket; a step with more logit rows runs eagerly).
        self.logit_cap = min(mw, chosen[-1])
        self._out: torch.Tensor | None = None          # the graphs' float32 logits, shared
        self._greedy: torch.Tensor | None = None       # and the argmax of each of their rows
        self._replayed_greedy: Any = None              # the last replayed graph's part of it
        # forward's views of a decode graph's first rows: (its logits, the logits' first
        # rows, its greedy ids' first rows) by (id of its logits, width) (_first_rows)
        self._row_views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self._handed: tuple[torch.Tensor, int] | None = None   # that view and its width, as
        #                                                          the last forward gave it
        #: The greedy ids (argmax, on the device) of the last forward's logits, row for row,
        #: when the forward was a graph replay that returned a plain slice of the graph's
        #: output (the graph computes them: no launch after it); None otherwise. Valid
        #: until the next replay, as the logits are.
        self.greedy: torch.Tensor | None = None
        # input_ids[0, :_fed_rows] holds the last decode graph's greedy ids (it writes them
        # there for the next step); 0 once anything else writes input_ids
        self._fed_rows = 0
        self._mixed: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self._mixed_pool: Any = None
        self._rows_dev: torch.Tensor | None = None     # the mixed graphs' logit rows (device)
        self._rows_host: torch.Tensor | None = None    # and their pinned staging, event
        self._rows_staged: Any = None
        self.vocab = vocab_size(model)
        self.input_ids = torch.zeros((1, mw), dtype=torch.long, device=self.device)
        self._staging: torch.Tensor | None = None     # pinned upload buffer (CUDA) and its event
        self._staged: Any = None
        self._graphs: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self._graph_generation = view.generation
        self._attn_configs: list[Any] = [_text_config(config)]
        self.replays = 0
        self.eager = 0

    @property
    def mixed_graphs(self) -> dict[int, tuple[Any, torch.Tensor, torch.Tensor]]:
        """The captured mixed-step graphs by token bucket (a copy, as :attr:`graphs`)."""
        return dict(self._mixed)

    def mixed_bucket(self, width: int, logit_rows: int = 1) -> int | None:
        """The mixed-step bucket a step of ``width`` tokens with ``logit_rows`` rows to sample
        is padded to, or None (it runs eagerly, unpadded): on CUDA with graphs, the smallest
        of :attr:`mixed_buckets` holding it, when its graph gives that many logit rows."""
        if not self.graphs_enabled:
            return None
        bucket = bucket_for(width, self.mixed_buckets)
        if bucket is None or logit_rows > min(bucket, self.logit_cap):
            return None
        return bucket

    @property
    def graphs(self) -> dict[int, tuple[Any, torch.Tensor, torch.Tensor]]:
        """The captured decode graphs by bucket: (``torch.cuda.CUDAGraph``, its logits
        tensor, its greedy ids tensor). A copy: dropping or adding entries changes nothing in
        the runner."""
        return dict(self._graphs)

    # -- the model's attention setting -------------------------------------------------------
    def reattach(self) -> None:
        """Switches the model (back) to cellcache's attention, checked by one probe forward.

        A refusal (InvalidArgument: a layer that does not call cellcache's attention, or
        calls it with something it does not compute) restores the model's attention
        setting exactly as it was.
        """
        register()
        saved = [(c, c._attn_implementation_internal) for c in _attn_configs(self.model)]
        try:
            try:
                self.model.set_attn_implementation(ATTENTION_NAME)
            except (ValueError, TypeError, AttributeError) as e:
                raise InvalidArgument(f"the model refuses set_attn_implementation"
                                      f"({ATTENTION_NAME!r}): {e}") from e
            configs = self._probe()
        except BaseException:
            for c, value in saved:
                c._attn_implementation_internal = value
            raise
        self._attn_configs = configs

    def _probe(self) -> list[Any]:
        """One forward of one token at position 0 through cellcache's attention in probe
        mode (checks, writes nothing); returns the configs the attention layers read."""
        n = len(self.cache.config.layers)
        mdev = getattr(self.model, "device", None)
        if isinstance(mdev, torch.device) and mdev != self.device:
            raise InvalidArgument(f"the model is on {mdev}; the cache's buffers are on {self.device}")
        calls: list[tuple[int, Any]] = []
        cur = _Current(self.view, None, "probe", probe=calls)
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        token = _CURRENT.set(cur)
        try:
            with torch.inference_mode():
                self.model(input_ids=ids, position_ids=ids, use_cache=False, logits_to_keep=1)
        except CellCacheError:
            raise
        except Exception as e:
            raise InvalidArgument(f"the model's forward failed on attach's one-token probe "
                                  f"({type(e).__name__}: {e})") from e
        finally:
            _CURRENT.reset(token)
        layers = sorted(layer for layer, _ in calls)
        if layers != list(range(n)):
            missing = sorted(set(range(n)) - set(layers))
            twice = sorted({la for la in layers if layers.count(la) > 1})
            raise InvalidArgument(
                f"a forward went through cellcache's attention for {len(set(layers))} of the "
                f"model's {n} layers (missing {missing[:8]}, repeated {twice[:8]}): this model "
                f"({type(self.model).__name__}) computes attention cellcache does not see, so the "
                "cache would not be used; it is not supported")
        configs: dict[int, Any] = {}
        for _, c in calls:
            if c is not None and hasattr(c, "_attn_implementation"):
                configs[id(c)] = c
        return list(configs.values()) or [_text_config(self.model.config)]

    def _check_attached(self) -> None:
        for c in self._attn_configs:
            # what transformers' property returns, read without its __getattribute__ (~7 us
            # a config on the GPU host); anything else goes the documented way
            if vars(c).get("_attn_implementation_internal") == ATTENTION_NAME:
                continue
            impl = getattr(c, "_attn_implementation", None)
            if impl != ATTENTION_NAME:
                raise InvalidState(
                    f"the model's attention is {impl!r}, not cellcache's (it was switched after "
                    "attach): call runner.reattach() (a Generator: generator.runner.reattach()) "
                    "to serve it from the cache again")

    # -- checks ----------------------------------------------------------------------------------
    def _token_ids(self, tokens: Any, width: int) -> np.ndarray:
        arr = _int_array(tokens, "tokens")
        if arr.size != width:
            raise InvalidArgument(f"{arr.size} tokens for a step of width {width}: give one token "
                                  "per real row")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.vocab:
            raise InvalidArgument(f"token id {lo if lo < 0 else hi} is outside the vocabulary "
                                  f"[0, {self.vocab})")
        return arr

    @staticmethod
    def _logit_rows(logit_rows: Any, width: int) -> np.ndarray:
        if logit_rows is None:
            return np.arange(width)
        arr = _int_array(logit_rows, "logit_rows")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= width):
            bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
            raise InvalidArgument(f"logit row {bad} is outside the step's real rows [0, {width})")
        return arr

    # -- forwards -----------------------------------------------------------------------------------
    def bucket(self, width: int) -> int | None:
        """The smallest bucket that holds ``width`` rows (None when none does)."""
        return bucket_for(width, self.buckets)

    def _positions(self, step: Step) -> torch.Tensor:
        return self.view.positions[:step.pad_to][None]

    def _run(self, step: Step, backend: str, rows: torch.Tensor | None) -> torch.Tensor:
        T = step.pad_to
        cur = _Current(self.view, step, backend)
        ids, positions = self.input_ids[:, :T], self._positions(step)
        token = _CURRENT.set(cur)
        try:
            out = self._forward(input_ids=ids, position_ids=positions, use_cache=False,
                                logits_to_keep=rows if rows is not None else 0)
        finally:
            _CURRENT.reset(token)
        n = len(self.cache.config.layers)
        if cur.calls != n:
            raise InvalidState(f"the forward called cellcache's attention {cur.calls} times for "
                               f"{n} layers: the model no longer runs its attention through the cache")
        return out.logits[0]

    def forward(self, step: Step, tokens: Any = None, logit_rows: Any = None, decode: bool = False, *,
                device_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Runs the forward of ``step`` on ``tokens`` (one per real row); returns float32
        logits ``[len(logit_rows), vocab]`` (all real rows when None).

        ``step`` must be the cache's prepared step (InvalidState otherwise); ``tokens``
        exactly ``step.width`` ids in ``[0, vocab)``; ``logit_rows`` ids in
        ``[0, step.width)``; both 1-D sequences (or arrays, tensors) of ints. Every check
        runs before anything is written (InvalidArgument / InvalidState).

        ``device_tokens`` instead of ``tokens``: a 1-D integer tensor of ``step.width`` ids
        already on the runner's device (the previous step's sampled ids, gathered: the
        asynchronous generator feeds a step before its ids reach the host). It is copied
        into the input on the device's current stream without a host sync, so its values
        are not checked: they must be ids the model's own sampling drew.

        On CUDA the host ``tokens`` go up through a pinned buffer without blocking the host.

        ``decode`` says every row is its sequence's next token (one token per sequence);
        then, on CUDA with graphs on, the step is replayed from a graph of its padded width.
        A replayed step's logits (decode or mixed) are a view of the float32 buffer every
        graph of this runner writes: valid until the next replayed forward, of any width (the
        step's sampling reads them before, in stream order); ``clone()`` them to keep them.
        """
        if not isinstance(step, Step):
            raise InvalidArgument(f"step of type {type(step).__name__} is not a Step")
        if step is not self.cache.prepared_step:
            raise InvalidState("step is not this cache's prepared step (a committed step, an older "
                               "one or another cache's): pass the Step that prepare_step() just returned")
        self._check_attached()
        T, width = step.pad_to, step.width
        handed = self._handed
        if device_tokens is not None:
            if tokens is not None:
                raise InvalidArgument("give tokens or device_tokens, not both")
            # the greedy ids the last replay handed out (self.greedy), fed back whole: known
            # to be right (its checks cost ~5 us a step on the GPU host)
            mine = handed is not None and device_tokens is handed[0] and handed[1] == width
            if not mine and (not isinstance(device_tokens, torch.Tensor) or device_tokens.ndim != 1 \
                    or device_tokens.is_floating_point() or device_tokens.dtype == torch.bool \
                    or device_tokens.device != self.device or device_tokens.numel() != width):
                shown = (f"a {tuple(device_tokens.shape)} {device_tokens.dtype} tensor on "
                         f"{device_tokens.device}" if isinstance(device_tokens, torch.Tensor)
                         else f"of type {type(device_tokens).__name__}")
                raise InvalidArgument(f"device_tokens is {shown}; give a 1-D integer tensor of "
                                      f"{width} ids on {self.device}")
            ids_np = None
        elif tokens is None:
            raise InvalidArgument("give the step's tokens (or device_tokens)")
        else:
            ids_np = self._token_ids(tokens, width)
        rows = None if logit_rows is None else self._logit_rows(logit_rows, width)
        if not isinstance(decode, (bool, np.bool_)):
            raise InvalidArgument(f"decode of type {type(decode).__name__} is not a bool")
        if self.view.stale():                 # a copy growth moved the pools
            self.view.refresh()
        if self._graph_generation != self.view.generation:
            self._graphs.clear()              # they read the old pools: recaptured on next use
            self._mixed.clear()
            self._graph_generation = self.view.generation
        self.greedy = None
        self._handed = None
        if device_tokens is not None:
            # the previous decode graph's own greedy ids: already in input_ids (it put them there)
            greedy = self._greedy
            if not (greedy is not None and width <= self._fed_rows
                    and (mine or (device_tokens.data_ptr() == greedy.data_ptr()
                                  and device_tokens.dtype == greedy.dtype
                                  and device_tokens.stride(0) == 1))):
                self.input_ids[0, :width].copy_(device_tokens, non_blocking=True)
                self._fed_rows = 0
        elif ids_np is not None:
            self._upload(ids_np)
            self._fed_rows = 0
        # rows [width, T) are padding: they keep ids of earlier steps (always ids in [0, vocab):
        # the buffer starts zeroed and only checked or drawn ids are written), their outputs dropped
        every = rows is None or (rows.size == width and (
            width == 0 or (rows[0] == 0 and rows[-1] == width - 1 and bool((np.diff(rows) == 1).all()))))
        if self.graphs_enabled and decode and T in self.buckets:
            logits = self._replay(step)       # (the capture, on first use, in inference mode)
            self.replays += 1
            self._fed_rows = T
            if every:                         # every real row: a slice, no index upload
                logits, self.greedy = self._first_rows(logits, width)
                self._handed = (self.greedy, width)
                return logits
            assert rows is not None
            return logits[self._index(rows)]
        with torch.inference_mode():
            n_rows = width if rows is None else rows.size
            if self.graphs_enabled and not decode and T in self.mixed_buckets \
                    and n_rows <= min(T, self.logit_cap):
                logits = self._replay_mixed(step, rows, n_rows)
                self.replays += 1
                self._fed_rows = 0            # its greedy ids overwrote the decode graph's
                self.greedy = self._replayed_greedy[:n_rows]
                return logits[:n_rows]
            self.eager += 1
            # "auto": on CUDA with the paged view, the path choose_path gives each layer's
            # shape (cellcache's decode kernel for decode steps, its prefill kernel with the
            # device-built work list for mixed ones, or the tensor-core kernels)
            if rows is None:
                if self.compile is None:      # every row's logits, the padding rows' dropped
                    return self._run(step, self.attention, None)[:width].float()
                rows = np.arange(width)       # compiled: rows as a tensor, as every eager step
            return self._run(step, self.attention, self._index(rows)).float()

    def _upload(self, ids: np.ndarray) -> None:
        """Host ids into ``input_ids``: on CUDA through a pinned staging buffer, without
        blocking the host (the buffer is reused once the previous upload has run)."""
        n = ids.size
        if not self.cuda:
            self.input_ids[0, :n].copy_(torch.from_numpy(ids))
            return
        if self._staging is None or self._staging.numel() < n:
            self._staging = torch.empty(max(n, self.input_ids.shape[1]), dtype=torch.long, pin_memory=True)
            self._staged = torch.cuda.Event()
        else:
            self._staged.synchronize()        # the previous upload has left the buffer
        self._staging[:n].numpy()[:] = ids
        self.input_ids[0, :n].copy_(self._staging[:n], non_blocking=True)
        self._staged.record(torch.cuda.current_stream(self.device))

    def _index(self, rows: np.ndarray) -> torch.Tensor:
        """Logit rows as a tensor on the device."""
        t = torch.from_numpy(rows)
        if not self.cuda:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _replay_mixed(self, step: Step, rows: np.ndarray | None, n: int) -> torch.Tensor:
        """Replays (capturing on first use) the mixed-step graph of ``step.pad_to`` tokens;
        its logits (``min(pad_to, logit_cap)`` rows) are for ``rows`` (None: rows 0..n-1),
        written into the graphs' index buffer (the rest point at row 0). The capture runs
        the prefill kernels whatever the captured step looks like (:data:`cct.MIXED_CAPTURE`):
        the graph replays any mix of rows."""
        T = step.pad_to
        cap = min(T, self.logit_cap)
        if self._rows_dev is None:
            self._rows_dev = torch.zeros(self.logit_cap, dtype=torch.long, device=self.device)
            self._rows_host = torch.zeros(self.logit_cap, dtype=torch.long, pin_memory=True)
            self._rows_staged = torch.cuda.Event()
        else:
            self._rows_staged.synchronize()   # the previous upload has left the buffer
        assert self._rows_host is not None
        host = self._rows_host.numpy()
        host[:n] = np.arange(n) if rows is None else rows
        host[n:cap] = 0
        self._rows_dev[:cap].copy_(self._rows_host[:cap], non_blocking=True)
        self._rows_staged.record(torch.cuda.current_stream(self.device))
        if T not in self._mixed:
            if self._mixed_pool is None:
                self._mixed_pool = torch.cuda.graph_pool_handle()
            token = cct.MIXED_CAPTURE.set(True)
            try:
                # one memory pool for every mixed graph: they replay one at a time, in stream order
                self._mixed[T] = self._capture(step, self._rows_dev[:cap], cap, self._mixed_pool,
                                               feed=False)
            finally:
                cct.MIXED_CAPTURE.reset(token)
        graph, logits, greedy = self._mixed[T]
        graph.replay()
        self._replayed_greedy = greedy
        return logits

    def _shared_out(self, rows: int, width: int) -> torch.Tensor:
        """The one float32 logits buffer every graph writes its output into (graphs replay
        one at a time in stream order, and a step's logits are read before the next replay):
        ``[max(logit_cap, largest bucket), width]``, made before the first capture (``width``:
        the logits' width, from the warm-up forward), with the int64 buffer of their rows'
        greedy ids beside it."""
        n = max(self.logit_cap, self.buckets[-1], rows)
        if self._out is None or self._out.shape[1] != width or self._out.shape[0] < rows:
            self._out = torch.empty((n, width), dtype=torch.float32, device=self.device)
            self._greedy = torch.zeros(n, dtype=torch.long, device=self.device)
        return self._out

    def _capture(self, step: Step, index: torch.Tensor | None, rows: int,
                 pool: Any = None, feed: bool = True) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """A graph of ``step``'s forward (logits of ``index``, None: every row) writing its
        ``rows`` float32 logits into the shared buffer and their greedy ids (argmax) into
        the ids buffer, after one eager warm-up on a side stream (allocations, kernel
        loads); returns (graph, its logits view, its greedy ids view). ``feed`` (decode graphs, every row's
        logits): the graph also copies the greedy ids into ``input_ids``, where the next
        decode step of the same rows, greedy, finds its tokens without a launch."""
        with torch.inference_mode():
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            try:
                with torch.cuda.stream(stream):
                    warm = self._run(step, "auto", index)
            finally:
                torch.cuda.current_stream(self.device).wait_stream(stream)
            out = self._shared_out(rows, warm.shape[-1])
            greedy = self._greedy
            assert greedy is not None
            del warm
            graph = torch.cuda.CUDAGraph()
            # float32 logits and their greedy ids out of the graph: no launch after it
            with torch.cuda.graph(graph, pool=pool):
                logits = out[:rows]
                logits.copy_(self._run(step, "auto", index))
                torch.argmax(logits, dim=-1, out=greedy[:rows])
                if feed:                      # ids in [0, vocab): pad rows' are harmless too
                    self.input_ids[0, :rows].copy_(greedy[:rows])
        return graph, logits, greedy[:rows]

    def _first_rows(self, logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``width`` rows of a replayed decode graph's ``logits`` and of its greedy
        ids: the same two views each time for one graph and width (a slice costs ~2 us on
        the GPU host, and a steady decode step takes two)."""
        key = (id(logits), width)
        views = self._row_views.get(key)
        if views is None:               # (an entry holds its logits: their id is not reused)
            if len(self._row_views) >= 1024:
                self._row_views.clear()
            views = self._row_views[key] = (logits, logits[:width], self._replayed_greedy[:width])
        return views[1], views[2]

    def _replay(self, step: Step) -> torch.Tensor:
        T = step.pad_to
        if T not in self._graphs:
            self._graphs[T] = self._capture(step, None, T)
        graph, logits, greedy = self._graphs[T]
        graph.replay()
        self._replayed_greedy = greedy
        return logits


#: What ``attention=`` takes (see :class:`ModelRunner`).
ATTENTION_BACKENDS = ("auto", "flashinfer")
#: The ``torch.compile`` keywords ``compile=`` takes as a mapping.
COMPILE_OPTIONS = ("backend", "mode", "dynamic", "fullgraph", "options")
#: Compile modes that capture CUDA graphs themselves (a second owner of the decode graphs).
_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def compile_options(compile: Any) -> dict[str, Any] | None:
    """The ``torch.compile`` keywords of a ``compile=`` argument: None for False, ``{}`` for
    True (inductor; :class:`ModelRunner` adds ``dynamic=True`` where ``dynamic`` is not
    given), a copy of a mapping whose keys are among :data:`COMPILE_OPTIONS`;
    InvalidArgument for anything else."""
    if isinstance(compile, (bool, np.bool_)):
        return {} if compile else None
    if not isinstance(compile, Mapping):
        raise InvalidArgument(f"compile of type {type(compile).__name__} is not a bool or a mapping "
                              f"of torch.compile options ({', '.join(COMPILE_OPTIONS)})")
    unknown = sorted(str(k) for k in compile if k not in COMPILE_OPTIONS)
    if unknown:
        raise InvalidArgument(f"compile options {', '.join(unknown)} are unknown; give "
                              f"{', '.join(COMPILE_OPTIONS)}")
    options = dict(compile)
    backend = options.get("backend", "inductor")
    if not (isinstance(backend, str) and backend) and not callable(backend):
        raise InvalidArgument(f"compile backend {backend!r} is not a backend name or a callable")
    mode = options.get("mode")
    if mode is not None and not isinstance(mode, str):
        raise InvalidArgument(f"compile mode of type {type(mode).__name__} is not a string or None")
    if not isinstance(options.get("dynamic"), (bool, np.bool_, type(None))):
        raise InvalidArgument(f"compile dynamic of type {type(options['dynamic']).__name__} is not "
                              "a bool or None")
    if not isinstance(options.get("fullgraph", False), (bool, np.bool_)):
        raise InvalidArgument(f"compile fullgraph of type {type(options['fullgraph']).__name__} is "
                              "not a bool")
    if options.get("options") is not None and not isinstance(options["options"], Mapping):
        raise InvalidArgument(f"compile options['options'] of type {type(options['options']).__name__} "
                              "is not a mapping")
    return options


def _attention_paths(config: Any, cfg: CacheConfig) -> list[str]:
    """Each layer's attention path on a CUDA cache with the paged view
    (:func:`cellcache.cuda.kernels.choose_path`); InvalidArgument when a layer's shape has
    none, so such a model is refused before it is switched."""
    from .cuda.kernels import choose_path

    heads = _config_int(_decoder_config(config), "num_attention_heads", 1)
    return [choose_path(cfg.dtype, lc.head_dim, heads // lc.n_kv_heads,
                        have_flashinfer=cct.have_flashinfer(), has_masks=cfg.mask_format != "none")
            for lc in cfg.layers]


def _int_array(values: Any, name: str) -> np.ndarray:
    """``values`` (a sequence, array or tensor of ints) as a 1-D int64 array; an empty one
    is fine."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    if isinstance(values, (str, bytes)):
        arr = None
    else:
        try:
            arr = np.asarray(values)
        except (TypeError, ValueError, OverflowError):
            arr = None
    if arr is None or arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        what = (f"a {arr.ndim}-D array of {arr.dtype}" if arr is not None
                else f"of type {type(values).__name__}")
        raise InvalidArgument(f"{name} is {what}; give a 1-D sequence of ints")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) >= 1 << 63:
        raise InvalidArgument(f"{name} holds {int(arr.max())}, outside int64")
    return arr.astype(np.int64)


def vocab_size(model: Any) -> int:
    """Rows of the model's input embedding (what a token id indexes), else the config's
    vocab_size."""
    n = None
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            n = getattr(get(), "num_embeddings", None)
        except (NotImplementedError, AttributeError, TypeError):
            n = None
    if n is None:
        n = getattr(_text_config(model.config), "vocab_size", None)
    if n is None:
        raise InvalidArgument(f"model of type {type(model).__name__} has no input embedding or "
                              "vocab_size: cannot check token ids")
    return check_int(n, "the model's vocabulary size", 1)
