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
windows. This module maps configs and attention (:class:`HFAdapter`); the runner that
:func:`attach` returns, which owns the graphs and the input feeds, is
:class:`cellcache.runner.ModelRunner` (also importable from here).
:class:`cellcache.generate.Generator` builds continuous batching on top.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import torch as cct
from ._checks import CAPACITY_LIMIT, check_int
from .batch_invariant import ROWS, BatchInvariant
from .cache import CellCache, Step
from .config import KV_DTYPES, CacheConfig, LayerConfig, _kv_dtype_name
from .errors import CellCacheError, InvalidArgument, InvalidState
from .runner import ATTENTION_BACKENDS, COMPILE_OPTIONS, ModelRunner, check_options, compile_options

__all__ = ["ATTENTION_BACKENDS", "ATTENTION_NAME", "COMPILE_OPTIONS", "HFAdapter", "ModelRunner", "attach",
           "cache_config", "compile_options", "layer_windows", "vocab_size"]

ATTENTION_NAME = "cellcache"
_CURRENT = cct.FORWARD          # the step a forward runs on (a cct.Forward), for the hook and the op

#: Keywords transformers passes to attention functions that do not change what attention
#: computes (the step's positions reach RoPE before attention; cellcache keeps the K/V).
_IGNORED_KWARGS = frozenset({
    "position_ids", "cache_position", "position_embeddings", "use_cache", "past_key_values",
    "past_key_value", "output_attentions", "output_router_logits", "output_hidden_states",
    "return_dict"})
#: Keywords that change the scores in ways cellcache's attention does not compute.
_SCORE_KWARGS = {"softcap": "attention logit soft-capping", "s_aux": "attention sinks",
                 "sinks": "attention sinks"}


def _refuse_alibi(cfg: Any) -> None:
    """InvalidArgument for a model with ALiBi position biases (Falcon's ``alibi=True``): they
    reach attention inside its mask, which cellcache's attention does not read (it builds
    causality and windows from the cache), so the scores would lack them."""
    if getattr(cfg, "alibi", False) is True:
        raise InvalidArgument("ALiBi position biases (config.alibi=True) reach attention through "
                              "its mask, which cellcache's attention does not read; this model is "
                              "not supported")


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
    _refuse_alibi(cfg)
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
        if mask_format == "none" and _kv8_without_tc(extra.get("kv_dtype"), dtype, head_dim,
                                                     heads // kv_heads):
            mask_format = "bool"          # 8-bit K/V the tensor-core kernels do not take: SDPA
    if device is None:
        device = (getattr(dev, "index", None) or 0) if on_cuda else 0
    return CacheConfig(capacity=capacity, layers=layers, max_write=max_write,
                       initial_capacity=initial_capacity, dtype=dtype, max_seqs=max_seqs,
                       device=device, paged=paged, mask_format=mask_format, **extra)


def _kv8_without_tc(kv_dtype: Any, dtype: Any, head_dim: int, group: int) -> bool:
    """Whether ``kv_dtype`` is 8-bit and no tensor-core kernel reads this shape from it: the
    cache then gets masks for SDPA, the path that always exists (FlashInfer, where
    installed, may take the shape without them)."""
    if kv_dtype is None:
        return False
    try:
        kv8 = _kv_dtype_name(kv_dtype, str(dtype)) in KV_DTYPES
    except InvalidArgument:
        return False                            # refused by CacheConfig with its own message
    if not kv8:
        return False
    try:
        from .cuda.tc import supports
    except ImportError:                         # no cuda-bindings: no kernels either
        return True
    return not supports(str(dtype).removeprefix("torch."), head_dim, group)


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {tuple(value.shape)} tensor"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_call(module: Any, query: Any, key: Any, value: Any, cur: cct.Forward, dropout: Any,
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
           mixed_buckets: list[int] | None = None, attention: str = "auto",
           deterministic: bool = False, invariant_rows: int = ROWS, native: bool = False) -> ModelRunner:
    """Switches ``model`` to cellcache's attention and returns the :class:`ModelRunner`
    that runs its forwards on ``cache``'s steps.

    Everything is checked before the model changes: the cache's layers and windows against
    the model's, the runner's options (``graphs``, ``buckets``), the cache's attention path
    (a host cache needs masks). Then the model is switched and one probe forward of one
    token (written nowhere) checks that every decoder layer calls cellcache's attention
    with nothing it does not compute (soft-capping, attention sinks, bidirectional or
    dropout attention, a different sliding window, unknown keywords); a model that fails
    it (gpt-oss, Gemma2 soft-capping, BERT, and Falcon where transformers' Falcon does not
    call the attention interface) is refused with its attention setting restored; so is a
    model with ALiBi biases (Falcon's ``alibi=True``), before anything is switched. Every
    refusal raises InvalidArgument and changes nothing.

    ``compile``: False (default), True or a mapping of ``torch.compile`` keywords
    (``backend``, ``mode``, ``dynamic``, ``fullgraph``, ``options``): the runner's forwards
    go through ``torch.compile(model, ...)`` with attention as the custom op
    ``cellcache::attention``, so the graph does not break there (see :class:`ModelRunner`).

    ``deterministic``: every forward is batch-invariant (docs/design/deterministic.md): a
    token's logits depend only on its own sequence's tokens, never on the rest of the step,
    its chunking, its cells or whether a graph replays it. The forwards run inside
    :class:`cellcache.batch_invariant.BatchInvariant` (GEMMs, norms and softmaxes at a fixed
    ``invariant_rows`` rows; on the host with one intra-op thread) and attention through the
    ``"invariant"`` backend of :func:`cellcache.torch.attention`. Refused (InvalidArgument)
    with ``compile`` (inductor picks its kernels and reduction splits per shape),
    ``attention="flashinfer"``, a tensor-parallel shard, a CUDA cache without the paged
    view, and on CUDA a layer the
    tensor-core kernels do not take (:func:`cellcache.torch.invariant_refusal`). The
    runner's graphs stay on.

    To use the model without cellcache again: ``model.set_attn_implementation("sdpa")``;
    its runners then refuse to run (InvalidState) until :meth:`ModelRunner.reattach`.

    ``native`` (default False): the runner runs :class:`cellcache.native.NativeLM`, cellcache's
    own forward of a Llama, Mistral, Qwen2, Qwen3, Gemma or Gemma 3 (text) model over the
    same weights (q/k/v and gate/up as one GEMM each, the norms, residual adds, rotary
    embedding and SiLU as one launch each; the Gemma family's norms as its modules), instead
    of the model's modules; the model's attention setting is then not switched. Its q/k/v
    and gate/up weights are re-laid as views of one tensor each (the same values; update
    them in place). Refused (InvalidArgument, before anything is re-laid) for other
    architectures, a tensor-parallel shard and the refusals of
    :func:`cellcache.native.refuse`; a refusal after that (the runner's options, the probe)
    leaves the weights re-laid, with the same values. Attaching a model natively again while a runner keeps
    its :class:`~cellcache.native.NativeLM` reuses it.
    """
    if not isinstance(cache, CellCache):
        raise InvalidArgument(f"cache of type {type(cache).__name__} is not a cellcache cache")
    if not callable(getattr(model, "set_attn_implementation", None)):
        raise InvalidArgument(f"model of type {type(model).__name__} is not a transformers model "
                              "(it has no set_attn_implementation)")
    cfg = _decoder_config(model)
    _refuse_alibi(cfg)
    windows = layer_windows(cfg)
    if len(cache.config.layers) != len(windows):
        raise InvalidArgument(f"the cache has {len(cache.config.layers)} layers; the model "
                              f"{len(windows)} (build the config with cache_config(model))")
    for i, (layer, w) in enumerate(zip(cache.config.layers, windows)):
        if layer.window != w:
            raise InvalidArgument(f"layer {i}: the cache's window {layer.window} is not the model's {w}")
    if not isinstance(deterministic, bool):
        raise InvalidArgument(f"deterministic of type {type(deterministic).__name__} is not a bool")
    invariant_rows = check_int(invariant_rows, "invariant_rows", 1, 1 << 16)
    if deterministic:
        if compile_options(compile) is not None:
            raise InvalidArgument("deterministic=True runs eagerly (its graphs capture eager "
                                  "forwards): torch.compile picks kernels and reduction splits per "
                                  "shape, which the batch-invariant ops exist to avoid; pass "
                                  "compile=False")
        if attention != "auto":
            raise InvalidArgument(f"deterministic=True runs its own attention path; attention="
                                  f"{attention!r} is not taken with it (give 'auto')")
        if getattr(cache, "backend", None) == "cuda" and not cache.config.paged:
            # the invariant attention on CUDA is the tensor-core kernels over the paged view
            raise InvalidArgument("deterministic=True on CUDA needs a cache built with paged=True "
                                  "(cache_config(model) builds one): its attention reads the paged view")
        heads = _config_int(cfg, "num_attention_heads", 1)
        kv_heads = _config_int(cfg, "num_key_value_heads", 1, default=heads)
        if any(layer.n_kv_heads != kv_heads for layer in cache.config.layers):
            # a rank's share of the heads: its row-parallel layers end in an all-reduce whose
            # order follows the message size, i.e. the step's rows
            raise InvalidArgument("deterministic=True does not serve a tensor-parallel shard (the "
                                  f"cache holds {cache.config.layers[0].n_kv_heads} of the model's "
                                  f"{kv_heads} KV heads): the ranks' all-reduces sum in an order "
                                  "that depends on the step's size")
    if not isinstance(native, bool):
        raise InvalidArgument(f"native of type {type(native).__name__} is not a bool")
    adapter = HFAdapter(model, deterministic=deterministic, invariant_rows=invariant_rows)
    options: dict[str, Any] = dict(graphs=graphs, buckets=buckets, compile=compile,
                                   mixed_buckets=mixed_buckets, attention=attention)
    if native:
        return _attach_native(model, cache, cfg, adapter, options)
    runner = ModelRunner(model, cache, adapter, **options)
    runner.reattach()
    return runner


#: The native forward of each model attached natively, while a runner keeps it (by the
#: model's id; weak references, so the dead ones are found by ``ref() is None``).
_NATIVE: dict[int, Any] = {}


def _attach_native(model: Any, cache: CellCache, cfg: Any, base: HFAdapter,
                   options: dict[str, Any]) -> ModelRunner:
    """:func:`attach`'s ``native=True``: the model's :class:`~cellcache.native.NativeLM`
    (built once while a runner keeps it; building it re-lays the weights) run by a runner
    through a :class:`~cellcache.native.NativeAdapter`."""
    from .native import NativeAdapter, NativeLM, refuse

    heads = _config_int(cfg, "num_attention_heads", 1)
    kv_heads = _config_int(cfg, "num_key_value_heads", 1, default=heads)
    if any(layer.n_kv_heads != kv_heads for layer in cache.config.layers):
        raise InvalidArgument(f"native=True does not run a tensor-parallel shard (the cache holds "
                              f"{cache.config.layers[0].n_kv_heads} of the model's {kv_heads} KV "
                              "heads): serve it without native")
    refuse(model)                                         # before anything is re-laid
    check_options(options["compile"], options["attention"])
    for key in [k for k, r in _NATIVE.items() if r() is None]:
        del _NATIVE[key]
    ref = _NATIVE.get(id(model))
    native = ref() if ref is not None else None
    if native is not None:
        try:
            native.check(full=True)
        except InvalidState:
            native = None
    if native is None or native.hf is not model:
        native = NativeLM(model)
        _NATIVE[id(model)] = weakref.ref(native)
    runner = ModelRunner(native, cache, NativeAdapter(native, base), **options)
    runner.reattach()
    return runner


class HFAdapter:
    """What a :class:`ModelRunner` asks of a transformers model (a
    :class:`cellcache.runner.ModelAdapter`): its vocabulary, each layer's attention path,
    switching its attention setting to cellcache's (checked by a probe forward), checking
    that it still is, and one forward with cellcache's attention over a step.

    >>> runner = ModelRunner(model, cache, HFAdapter(model))        # doctest: +SKIP
    >>> runner.reattach()                                           # doctest: +SKIP

    (what :func:`attach` does, after checking the cache against the model).

    ``deterministic``: each forward runs batch-invariant (see :func:`attach`): inside
    :class:`~cellcache.batch_invariant.BatchInvariant` of ``invariant_rows`` rows, attention
    through the ``"invariant"`` backend whatever backend the runner asks for.
    """

    def __init__(self, model: Any, deterministic: bool = False, invariant_rows: int = ROWS):
        self.model = model
        #: Whether forwards run batch-invariant (fixed by attach; see the class).
        self.deterministic = bool(deterministic)
        self.invariant_rows = check_int(invariant_rows, "invariant_rows", 1, 1 << 16)
        self._configs: list[Any] = []          # the configs the attention layers read (attach)

    def vocab(self) -> int:
        return vocab_size(self.model)

    def attention_paths(self, config: CacheConfig) -> list[str]:
        if self.deterministic:
            return cct.invariant_paths(
                config, _config_int(_decoder_config(self.model.config), "num_attention_heads", 1))
        return _attention_paths(self.model.config, config)

    def invariant(self, device: torch.device) -> BatchInvariant:
        """The batch-invariant mode a deterministic forward on ``device`` runs in (one
        intra-op thread on the host: module docstring of :mod:`cellcache.batch_invariant`)."""
        return BatchInvariant(self.invariant_rows, cpu_threads=1 if device.type == "cpu" else None)

    def attach(self, view: cct.TorchView) -> None:
        register()
        saved = [(c, c._attn_implementation_internal) for c in _attn_configs(self.model)]
        try:
            try:
                self.model.set_attn_implementation(ATTENTION_NAME)
            except (ValueError, TypeError, AttributeError) as e:
                raise InvalidArgument(f"the model refuses set_attn_implementation"
                                      f"({ATTENTION_NAME!r}): {e}") from e
            configs = self._probe(view)
        except BaseException:
            for c, value in saved:
                c._attn_implementation_internal = value
            raise
        self._configs = configs

    def _probe(self, view: cct.TorchView) -> list[Any]:
        """One forward of one token at position 0 through cellcache's attention in probe
        mode (checks, writes nothing); returns the configs the attention layers read."""
        n = len(view.config.layers)
        device = view.device
        mdev = getattr(self.model, "device", None)
        if isinstance(mdev, torch.device) and mdev != device:
            raise InvalidArgument(f"the model is on {mdev}; the cache's buffers are on {device}")
        calls: list[tuple[int, Any]] = []
        cur = cct.Forward(view, None, "probe", probe=calls)
        ids = torch.zeros((1, 1), dtype=torch.long, device=device)
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

    def check(self) -> None:
        for c in self._configs or [_text_config(self.model.config)]:
            # what transformers' property returns, read without its __getattribute__ (once
            # a config on every step); anything else goes the documented way
            if vars(c).get("_attn_implementation_internal") == ATTENTION_NAME:
                continue
            impl = getattr(c, "_attn_implementation", None)
            if impl != ATTENTION_NAME:
                raise InvalidState(
                    f"the model's attention is {impl!r}, not cellcache's (it was switched after "
                    "attach): call runner.reattach() (a Generator: generator.runner.reattach()) "
                    "to serve it from the cache again")

    def run(self, forward: Callable[..., Any], view: cct.TorchView, step: Step, backend: str,
            input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        if self.deterministic:
            backend = "invariant"
        cur = cct.Forward(view, step, backend)
        token = _CURRENT.set(cur)
        try:
            if self.deterministic:
                with self.invariant(view.device):
                    out = forward(input_ids=input_ids, position_ids=positions, use_cache=False,
                                  logits_to_keep=rows if rows is not None else 0)
            else:
                out = forward(input_ids=input_ids, position_ids=positions, use_cache=False,
                              logits_to_keep=rows if rows is not None else 0)
        finally:
            _CURRENT.reset(token)
        n = len(view.config.layers)
        if cur.calls != n:
            raise InvalidState(f"the forward called cellcache's attention {cur.calls} times for "
                               f"{n} layers: the model no longer runs its attention through the cache")
        return out.logits[0]


def _attention_paths(config: Any, cfg: CacheConfig) -> list[str]:
    """Each layer's attention path on a CUDA cache with the paged view, by the rule the step's
    attention plan follows (:func:`cellcache.torch.layer_paths`); InvalidArgument when a
    layer's shape has none, so such a model is refused before it is switched."""
    return cct.layer_paths(cfg, _config_int(_decoder_config(config), "num_attention_heads", 1))


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
