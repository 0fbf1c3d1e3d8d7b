"""A native forward for Llama-family transformers models (Llama, Mistral, Qwen2, Qwen3) and
the Gemma family (Gemma, Gemma 3's text model) on cellcache steps: the model's own weights,
fewer and larger launches.

Per decoder layer transformers' modules launch three q/k/v GEMMs, two gate/up GEMMs and
five to ten small kernels for each RMSNorm, residual add, rotary embedding and SiLU. The
native forward runs the same arithmetic as

    h, res = add_rms_norm(x, res)        residual add + RMSNorm: one launch
    qkv = h @ W_qkv (+ b_qkv)            one GEMM (q, k, v weights as rows of one tensor)
    rotary_store(qkv)                    q and k heads rotated in place, k and v written into
                                         the layer's pools at the step's cells: one launch
    a = attention(q, k, v, write=False)  cellcache.torch.attention (reads the cache)
    x = a @ W_o
    h, res = add_rms_norm(x, res)
    x = silu_mul(h @ W_gate_up) @ W_down one GEMM, one launch, one GEMM

with the elementwise launches from ``cuda/fused.cu`` on CUDA (bf16, fp16, fp32) and the
modules' own torch ops elsewhere. Each op rounds where the modules' ops round (every torch
op's output is a tensor of the model's dtype), so a native forward differs from the
modules' only by the GEMMs' blocking over the fused weights and the RMS sum's order.

The Gemma family differs in four places, each computed as its modules do: its RMSNorms
scale by ``1 + weight`` in float32 before rounding (the norm modules are called: no fused
launch), its MLP gates with tanh-approximated GELU, Gemma 3 normalizes each block's output
before the residual add (``post_attention_layernorm`` on the attention's output,
``pre_feedforward_layernorm`` before the MLP, ``post_feedforward_layernorm`` on its output)
and rotates sliding and full layers with their own frequencies (the rotary module's
``layer_type``). The embedding's scale is the embedding module's.

The weights are the model's: :class:`NativeLM` concatenates each layer's q/k/v weights (and
biases) and its gate/up weights into one tensor each and rebinds the modules' parameters to
views of it (``param.data``), so memory does not grow, the transformers modules still
compute the same model, and in-place updates (``load_state_dict``, an optimizer step, an RL
weight sync through ``param.data.copy_``) reach both. Replacing a parameter's tensor
(``param.data = new``) detaches it from the native forward: :meth:`NativeLM.check` finds
it (:meth:`NativeAdapter.check` runs it before every forward).

Refused (InvalidArgument, the model unchanged): architectures other than those above (Gemma
2 soft-caps its attention logits), activations other than SiLU and tanh-approximated GELU
(by what the MLP module computes), bidirectional attention, partial rotary embeddings,
attention or final logit soft-capping,
quantized or sharded (DTensor) weights. ``cellcache.hf.attach(model, cache, native=True)``
and ``Generator(model, native=True)`` build it; :class:`NativeAdapter` is its
:class:`cellcache.runner.ModelAdapter`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from . import torch as cct
from .batch_invariant import BatchInvariant
from .cache import Step
from .config import CacheConfig
from .errors import CellCacheError, InvalidArgument, InvalidState

__all__ = ["ARCHITECTURES", "NativeAdapter", "NativeLM", "add_rms_norm", "gelu_tanh_mul", "logits_out",
           "refuse", "rms_norm", "rotary_", "silu_mul"]

#: ``config.model_type`` values the native forward runs.
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3_text")
#: those whose RMSNorms scale by ``1 + weight`` in float32 (run as their modules)
_OFFSET_NORMS = ("gemma", "gemma3_text")
_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


# -- the fused ops -----------------------------------------------------------------------------
# Each has a kernel path (CUDA, a dtype of cuda/fused.cu, rows whose last dim is contiguous)
# and a torch path with the transformers modules' arithmetic, op for op. Eager forwards call
# them directly (a custom op's dispatch costs more than the launch); compiled forwards call
# the custom ops cellcache::rms_norm, ::add_rms_norm, ::silu_mul and ::rotary_ instead.

_LOADER: list[Callable[[int], Any]] = []      # cellcache.cuda.fused.fused_kernels, once imported


def _kernels(t: torch.Tensor) -> Any:
    """The fused kernels of ``t``'s device when they take ``t`` (CUDA, a built dtype), else None."""
    if t.device.type != "cuda" or t.dtype not in _DTYPES:
        return None
    if not _LOADER:                              # (imported on first use: no CUDA module before)
        from .cuda.fused import fused_kernels

        _LOADER.append(fused_kernels)
    return _LOADER[0](t.device.index if t.device.index is not None else torch.cuda.current_device())


def _rows(t: torch.Tensor) -> bool:
    """Whether ``t`` is 2-D with a contiguous last dim (what the kernels index)."""
    return t.ndim == 2 and t.stride(1) == 1


def _norm_ref(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = h.dtype
    h = h.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * RMSNorm(x)`` over the last dim of a ``[rows, hidden]`` tensor, as
    transformers' Llama/Qwen2 RMSNorm computes it."""
    k = _kernels(x)
    if k is None or not _rows(x) or not weight.is_contiguous() or x.dtype != weight.dtype:
        return _norm_ref(x, weight, eps)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    k.add_rms_norm(_DTYPES[x.dtype], x.shape[0], x.shape[1], x.data_ptr(), x.stride(0), 0, 0, 0, 0,
                   weight.data_ptr(), out.data_ptr(), out.stride(0), float(eps), False,
                   torch.cuda.current_stream(x.device).cuda_stream)
    return out


def logits_out(x: torch.Tensor, out: torch.Tensor, ids: torch.Tensor,
               write: torch.Tensor | None = None) -> None:
    """``out.copy_(x)`` into float32 ``out`` and ``ids`` (int64) = ``x.argmax(-1)`` for a
    ``[rows, vocab]`` ``x``: on CUDA one launch that reads ``x`` once (half the bytes of the
    argmax reading the float32 copy, and one pass less than argmax then copy), elsewhere
    torch's two ops. The ids are torch.argmax's (a NaN above every number, ties to the
    lowest id). InvalidArgument, nothing written, for rows of no logits.

    ``write``: a one-element int32 tensor on ``x``'s device that the launch reads when it
    runs: 0 leaves ``out`` unwritten (the ids alone: a third of the bytes at bf16), so a
    graph captured with it serves steps whose draws read only the ids; the host sets it in
    stream order. The torch path (no kernel) always writes ``out``."""
    if x.ndim == 2 and x.shape[0] and not x.shape[1]:
        raise InvalidArgument(f"logits of shape {tuple(x.shape)}: rows of no vocabulary have no argmax")
    flag = 0
    if write is not None:
        if not isinstance(write, torch.Tensor) or write.dtype != torch.int32 or write.numel() != 1 \
                or write.device != x.device:
            shown = (f"a {tuple(write.shape)} {write.dtype} tensor on {write.device}"
                     if isinstance(write, torch.Tensor) else f"of type {type(write).__name__}")
            raise InvalidArgument(f"write is {shown}; give one int32 on {x.device}")
        flag = write.data_ptr()
    k = _kernels(x)
    if (k is None or not _rows(x) or not _rows(out) or out.dtype != torch.float32
            or out.shape != x.shape or out.device != x.device or ids.dtype != torch.int64
            or ids.shape != x.shape[:1] or not ids.is_contiguous() or ids.device != x.device):
        torch.argmax(x, dim=-1, out=ids)
        out.copy_(x)
        return
    k.logits_out(_DTYPES[x.dtype], x.shape[0], x.shape[1], x.data_ptr(), x.stride(0), out.data_ptr(),
                 out.stride(0), ids.data_ptr(), torch.cuda.current_stream(x.device).cuda_stream, flag)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 inplace: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * RMSNorm(residual + x), residual + x)`` for ``[rows, hidden]`` tensors;
    with ``inplace`` the sum is written into ``residual`` (and returned as it)."""
    k = _kernels(x)
    if (k is None or not _rows(x) or not _rows(residual) or not weight.is_contiguous()
            or not x.dtype == residual.dtype == weight.dtype):
        s = residual + x
        if inplace:
            residual.copy_(s)
            s = residual
        return _norm_ref(s, weight, eps), s
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = residual if inplace else torch.empty_like(residual, memory_format=torch.contiguous_format)
    k.add_rms_norm(_DTYPES[x.dtype], x.shape[0], x.shape[1], x.data_ptr(), x.stride(0),
                   residual.data_ptr(), residual.stride(0), res_out.data_ptr(), res_out.stride(0),
                   weight.data_ptr(), out.data_ptr(), out.stride(0), float(eps), True,
                   torch.cuda.current_stream(x.device).cuda_stream)
    return out, res_out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a ``[rows, 2 * inter]`` tensor holding gate then up."""
    inter = gate_up.shape[-1] // 2
    k = _kernels(gate_up)
    if k is None or not _rows(gate_up):
        return F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    out = gate_up.new_empty((gate_up.shape[0], inter))
    k.silu_mul(_DTYPES[gate_up.dtype], gate_up.shape[0], inter, gate_up.data_ptr(), gate_up.stride(0),
               out.data_ptr(), out.stride(0), torch.cuda.current_stream(gate_up.device).cuda_stream)
    return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
            head_dim: int) -> None:
    """Rotates the first ``n_heads`` heads (``head_dim`` each) of every row of ``qkv``
    ``[T, >= n_heads * head_dim]`` in place by the rows of ``cos`` and ``sin`` ``[T,
    head_dim]``, as transformers' ``apply_rotary_pos_emb`` computes it."""
    k = _kernels(qkv)
    if (k is None or not _rows(qkv) or not _rows(cos) or not _rows(sin)
            or not qkv.dtype == cos.dtype == sin.dtype):
        x = qkv[:, :n_heads * head_dim].view(qkv.shape[0], n_heads, head_dim)
        c, s = cos[:, None], sin[:, None]
        x.copy_((x * c) + (_rotate_half(x) * s))
        return
    k.rotary(_DTYPES[qkv.dtype], qkv.shape[0], qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(),
             n_heads, head_dim, qkv.stride(0), cos.stride(0), sin.stride(0),
             torch.cuda.current_stream(qkv.device).cuda_stream)


@torch.library.custom_op("cellcache::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(x, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("cellcache::add_rms_norm", mutates_args=())
def _add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return add_rms_norm(x, residual, weight, eps, inplace=False)


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(residual, memory_format=torch.contiguous_format))


@torch.library.custom_op("cellcache::silu_mul", mutates_args=())
def _silu_mul_op(gate_up: torch.Tensor) -> torch.Tensor:
    return silu_mul(gate_up)


@_silu_mul_op.register_fake
def _(gate_up):
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[-1] // 2))


@torch.library.custom_op("cellcache::rotary_", mutates_args=("qkv",))
def _rotary_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
               head_dim: int) -> None:
    rotary_(qkv, cos, sin, n_heads, head_dim)


@_rotary_op.register_fake
def _(qkv, cos, sin, n_heads, head_dim):
    return None


# -- the model ---------------------------------------------------------------------------------

def _fuse(modules: list[Any], name: str) -> torch.Tensor | None:
    """One tensor holding the ``name`` (``weight`` or ``bias``) of each module, concatenated
    along their first dim, whose slices become the modules' parameters' data; None when no module
    has one. A bias some of the modules lack is zeros in the fused tensor (theirs stays None)."""
    parts = [getattr(m, name, None) for m in modules]
    if all(p is None for p in parts):
        return None
    ref = next(p for p in parts if p is not None)
    sizes = [m.weight.shape[0] for m in modules]
    fused = torch.empty((sum(sizes), *ref.shape[1:]), dtype=ref.dtype, device=ref.device)
    at = 0
    for p, n in zip(parts, sizes):
        if p is None:
            fused[at:at + n].zero_()
        else:
            fused[at:at + n].copy_(p.detach())
        at += n
    at = 0
    for p, n in zip(parts, sizes):
        if p is not None:
            p.data = fused[at:at + n]
        at += n
    return fused


def _activation(mlp: Any) -> str | None:
    """The MLP's activation by what its ``act_fn`` computes ("silu", "gelu_tanh"; None for
    anything else): the module decides, not a config key (Gemma's MLP reads ``hidden_act``,
    Gemma 3's ``hidden_activation``, and a config may hold both)."""
    act = getattr(mlp, "act_fn", None)
    if not callable(act):
        return None
    x = torch.linspace(-8.0, 8.0, 257)
    try:
        with torch.no_grad():
            y = act(x)
    except Exception:            # noqa: BLE001 - an activation that needs other inputs: not ours
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != x.dtype:
        return None
    if torch.equal(y, F.silu(x)):
        return "silu"
    if torch.equal(y, F.gelu(x, approximate="tanh")):
        return "gelu_tanh"
    return None


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` of a ``[rows, 2 * inter]`` tensor holding gate
    then up (the Gemma family's MLP, its modules' torch ops)."""
    inter = gate_up.shape[-1] // 2
    return F.gelu(gate_up[..., :inter], approximate="tanh") * gate_up[..., inter:]


def refuse(model: Any) -> Any:
    """The text config of a model the native forward runs, after every check; InvalidArgument
    naming what it does not run."""
    config = getattr(model, "config", None)
    cfg = getattr(config, "text_config", None) or config
    kind = getattr(cfg, "model_type", None)
    if kind not in ARCHITECTURES:
        raise InvalidArgument(f"native=True runs {', '.join(ARCHITECTURES)} models; this one is "
                              f"{kind!r} ({type(model).__name__}): serve it without native")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise InvalidArgument("native=True runs causal attention; this model's "
                              "use_bidirectional_attention is set")
    rope = getattr(cfg, "rope_parameters", None) or {}
    partial = getattr(cfg, "partial_rotary_factor", None) or (
        rope.get("partial_rotary_factor") if isinstance(rope, dict) else None)
    if partial not in (None, 1, 1.0):
        raise InvalidArgument(f"native=True rotates whole heads; this model's "
                              f"partial_rotary_factor is {partial}")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, name, None):
            raise InvalidArgument(f"native=True does not compute {name}={getattr(cfg, name)}")
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(model, "lm_head"):
        raise InvalidArgument(f"{type(model).__name__} has no .model.layers and .lm_head: not a "
                              "transformers causal LM of a supported architecture")
    for p in model.parameters():
        if type(p.data) is not torch.Tensor:          # DTensor (a TP shard), quantized
            raise InvalidArgument(f"native=True runs plain weights; this model holds "
                                  f"{type(p.data).__name__} parameters (a tensor-parallel shard or "
                                  "a quantized model): serve it without native")
    for i, layer in enumerate(base.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for owner, names in ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                             (mlp, ("gate_proj", "up_proj", "down_proj"))):
            for n in names:
                if not isinstance(getattr(owner, n, None), torch.nn.Linear):
                    raise InvalidArgument(f"layer {i}: {n} is not a torch.nn.Linear; this model's "
                                          "layers are not a supported architecture's")
        dtypes = {p.dtype for p in layer.parameters()}
        if len(dtypes) != 1:
            raise InvalidArgument(f"layer {i} holds parameters of dtypes {sorted(map(str, dtypes))}; "
                                  "native=True runs one dtype")
    acts = {_activation(layer.mlp) for layer in base.layers}
    if len(acts) != 1 or None in acts:
        act = type(getattr(base.layers[0].mlp, "act_fn", None)).__name__
        raise InvalidArgument(f"native=True runs SiLU- or tanh-GELU-gated MLPs; this model's "
                              f"activation is {act}")
    return cfg


class _Layer:
    """One decoder layer's tensors and sizes (plain attributes: no module call per layer)."""

    def __init__(self, index: int, layer: Any, cfg: Any, qkv_w: torch.nn.Parameter,
                 qkv_b: torch.nn.Parameter | None, gate_up_w: torch.nn.Parameter,
                 gate_up_b: torch.nn.Parameter | None):
        attn, mlp = layer.self_attn, layer.mlp
        self.index = index
        self.attn, self.mlp = attn, mlp
        self.in_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        # Gemma 3's norms of each block's output: post_norm then normalizes the attention's
        # output, pre_ff_norm is the MLP's input norm and post_ff_norm its output's
        self.pre_ff_norm: Any = getattr(layer, "pre_feedforward_layernorm", None)
        self.post_ff_norm: Any = getattr(layer, "post_feedforward_layernorm", None)
        self.sandwich = self.pre_ff_norm is not None and self.post_ff_norm is not None
        self.mlp_norm = self.pre_ff_norm if self.sandwich else self.post_norm
        types = getattr(cfg, "layer_types", None)
        self.layer_type = types[index] if types else None
        self.qkv_w, self.qkv_b, self.gate_up_w, self.gate_up_b = qkv_w, qkv_b, gate_up_w, gate_up_b
        self.head_dim = int(getattr(attn, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.n_q = attn.q_proj.out_features // self.head_dim
        self.n_kv = attn.k_proj.out_features // self.head_dim
        self.scale = float(getattr(attn, "scaling", self.head_dim ** -0.5))
        # Qwen3's per-head RMSNorm of q and k before the rotation (its own modules)
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)


def _eps(norm: Any) -> float:
    for name in ("variance_epsilon", "eps"):
        v = getattr(norm, name, None)
        if v is not None:
            return float(v)
    raise InvalidArgument(f"{type(norm).__name__} has no variance_epsilon or eps")


class NativeLM(torch.nn.Module):
    """The native forward of a Llama-family model (see the module docstring): called as a
    transformers causal LM is (``input_ids`` and ``position_ids`` ``[1, T]``,
    ``logits_to_keep``), inside a cellcache step (:class:`NativeAdapter`). ``hf`` is the
    model (a submodule: its parameters, the fused ones' views included, are this module's).

    >>> native = NativeLM(model)        # re-lays q/k/v and gate/up as views   # doctest: +SKIP
    """

    def __init__(self, model: Any):
        super().__init__()
        cfg = refuse(model)
        # (outside inference mode: the re-laid weights must stay usable by autograd)
        with torch.inference_mode(False), torch.no_grad():
            self._build(model, cfg)

    def _build(self, model: Any, cfg: Any) -> None:
        self.hf = model
        self.text_config = cfg
        base = model.model
        self.qkv_w = torch.nn.ParameterList()
        self.qkv_b = torch.nn.ParameterList()
        self.gate_up_w = torch.nn.ParameterList()
        self.gate_up_b = torch.nn.ParameterList()
        layers = []
        for i, layer in enumerate(base.layers):
            attn, mlp = layer.self_attn, layer.mlp
            projs = [attn.q_proj, attn.k_proj, attn.v_proj]
            gates = [mlp.gate_proj, mlp.up_proj]
            params = []
            for mods, name, into in ((projs, "weight", self.qkv_w), (projs, "bias", self.qkv_b),
                                     (gates, "weight", self.gate_up_w), (gates, "bias", self.gate_up_b)):
                fused = _fuse(mods, name)
                p = None if fused is None else torch.nn.Parameter(fused, requires_grad=False)
                if p is not None:
                    into.append(p)
                params.append(p)
            qkv_w, qkv_b, gate_up_w, gate_up_b = params
            assert qkv_w is not None and gate_up_w is not None        # (Linear layers have weights)
            layers.append(_Layer(i, layer, cfg, qkv_w, qkv_b, gate_up_w, gate_up_b))
        self._layers = layers
        self.embed = base.embed_tokens
        self.norm = base.norm
        self.norm_eps = _eps(base.norm)
        self.rotary = base.rotary_emb
        self.lm_head = model.lm_head
        self._eps = [(_eps(la.in_norm), _eps(la.mlp_norm)) for la in layers]
        self._module_norms = cfg.model_type in _OFFSET_NORMS
        self._act = _activation(base.layers[0].mlp)        # (refuse: the same in every layer)
        # a rotary module of several layer types (Gemma 3: sliding and full layers' frequencies)
        self._rotary_types = ("layer_type" in inspect.signature(self.rotary.forward).parameters
                              and all(la.layer_type is not None for la in layers))
        self._kinds = [la.layer_type if self._rotary_types else None for la in layers]

    @property
    def config(self) -> Any:
        """The transformers model's config (what the runner and its checks read)."""
        return self.hf.config

    def check(self, full: bool = False) -> None:
        """InvalidState when the modules no longer hold views of the fused weights (a
        parameter's tensor was replaced, not updated in place: the native forward would
        serve the old weights). The first and last layers' q, k and gate weights (what every
        forward checks), or with ``full`` every fused weight and bias of every layer and the
        modules the forward calls directly (what a reuse at attach checks)."""
        layers = self._layers if full else (self._layers[0], self._layers[-1])
        for la in layers:
            parts = [(la.qkv_w, [la.attn.q_proj.weight, la.attn.k_proj.weight]),
                     (la.gate_up_w, [la.mlp.gate_proj.weight])]
            if full:
                parts = [(la.qkv_w, [la.attn.q_proj.weight, la.attn.k_proj.weight,
                                     la.attn.v_proj.weight]),
                         (la.gate_up_w, [la.mlp.gate_proj.weight, la.mlp.up_proj.weight])]
                parts += [(b, [p for p in (m.bias for m in mods) if p is not None])
                          for b, mods in ((la.qkv_b, (la.attn.q_proj, la.attn.k_proj, la.attn.v_proj)),
                                          (la.gate_up_b, (la.mlp.gate_proj, la.mlp.up_proj)))
                          if b is not None and all(m.bias is not None for m in mods)]
            stale = any(not _views_of(fused, params, full) for fused, params in parts)
            if full:
                layer = self.hf.model.layers[la.index]
                stale = stale or layer.self_attn is not la.attn or layer.mlp is not la.mlp
            if stale:
                raise InvalidState(
                    f"layer {la.index}'s q/k/gate weights are no longer the native forward's (a "
                    "parameter's tensor was replaced, e.g. param.data = new or model.to(...)): update "
                    "weights in place (load_state_dict, param.data.copy_), or attach again")

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, use_cache: bool = False,
                logits_to_keep: int | torch.Tensor = 0) -> Any:
        compiling = torch.compiler.is_compiling()
        x = self.embed(input_ids[0])                                      # [T, hidden]
        if self._rotary_types:                                            # [T, head_dim] a type
            rot = {t: tuple(c[0] for c in self.rotary(x[None], position_ids, t)) for t in set(self._kinds)}
        else:
            cos, sin = self.rotary(x[None], position_ids)
            rot = {None: (cos[0], sin[0])}
        T = x.shape[0]
        res = x               # the residual stream (eager: updated in place from here on)
        first = self._layers[0]
        if self._module_norms:
            h = first.in_norm(x)
        elif compiling:
            h = torch.ops.cellcache.rms_norm(x, first.in_norm.weight, self._eps[0][0])
        else:
            h = rms_norm(x, first.in_norm.weight, self._eps[0][0])
        for la, (eps_in, eps_post), kind in zip(self._layers, self._eps, self._kinds):
            cos, sin = rot[kind]
            if la.index:
                h, res = self._add_norm(x, res, la.in_norm, eps_in, compiling)
            qkv = F.linear(h, la.qkv_w, la.qkv_b)
            hq, hk = la.n_q * la.head_dim, la.n_kv * la.head_dim
            if la.q_norm is not None and la.k_norm is not None:
                q = la.q_norm(qkv[:, :hq].view(T, la.n_q, la.head_dim))
                k = la.k_norm(qkv[:, hq:hq + hk].view(T, la.n_kv, la.head_dim))
                qkv = torch.cat((q.reshape(T, hq), k.reshape(T, hk), qkv[:, hq + hk:]), dim=-1)
            written = False
            if compiling:
                torch.ops.cellcache.rotary_(qkv, cos, sin, la.n_q + la.n_kv, la.head_dim)
            else:
                written = _rotary_store(la.index, qkv, cos, sin, la.n_q, la.n_kv, la.head_dim)
                if not written:
                    rotary_(qkv, cos, sin, la.n_q + la.n_kv, la.head_dim)
            q = qkv[:, :hq].view(T, la.n_q, la.head_dim)
            k = qkv[:, hq:hq + hk].view(T, la.n_kv, la.head_dim)
            v = qkv[:, hq + hk:].view(T, la.n_kv, la.head_dim)
            a = _attend(la.index, q, k, v, la.scale, compiling, written)
            x = la.attn.o_proj(a.reshape(T, hq))
            if la.sandwich:
                x = la.post_norm(x)
            h, res = self._add_norm(x, res, la.mlp_norm, eps_post, compiling)
            gu = F.linear(h, la.gate_up_w, la.gate_up_b)
            if self._act == "gelu_tanh":
                x = la.mlp.down_proj(gelu_tanh_mul(gu))
            else:
                x = la.mlp.down_proj(torch.ops.cellcache.silu_mul(gu) if compiling else silu_mul(gu))
            if la.sandwich:
                x = la.post_ff_norm(x)
        if isinstance(logits_to_keep, torch.Tensor):
            x, res = x[logits_to_keep], res[logits_to_keep]
        elif logits_to_keep:
            x, res = x[-logits_to_keep:], res[-logits_to_keep:]
        h, _ = self._add_norm(x, res, self.norm, self.norm_eps, compiling)
        return _Output(self.lm_head(h)[None])

    def _add_norm(self, x: torch.Tensor, res: torch.Tensor, norm: Any, eps: float,
                  compiling: bool, inplace: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(res + x), res + x)``; eager, the sum is written into ``res``. The Gemma
        family's norms run as their modules."""
        if self._module_norms:
            s = res + x
            if inplace and not compiling:
                res.copy_(s)
                s = res
            return norm(s), s
        if compiling:
            return torch.ops.cellcache.add_rms_norm(x, res, norm.weight, eps)
        return add_rms_norm(x, res, norm.weight, eps, inplace=inplace)


def _views_of(fused: torch.Tensor, params: list[torch.Tensor], storage: bool) -> bool:
    """Whether ``params`` start one after the other from ``fused``'s start (as :func:`_fuse`
    laid them), and with ``storage`` also lie in its storage (a few µs more)."""
    at = fused.data_ptr()
    for p in params:
        if p.data_ptr() != at:
            return False
        if storage and p.untyped_storage().data_ptr() != fused.untyped_storage().data_ptr():
            return False
        at += p.numel() * p.element_size()
    return True


class _Output:
    """What the adapter reads of a forward (``.logits``), as of a transformers output."""

    __slots__ = ("logits",)

    def __init__(self, logits: torch.Tensor):
        self.logits = logits


#: Eager forwards (and the graphs captured from them) rotate q and k and write K/V into the
#: pools in one launch (:func:`_rotary_store`) where it takes the layer; False: the rotary
#: kernel, then cellcache's attention writes K/V (two copies a layer)
FUSED_KV_WRITE = True


def _rotary_store(layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q: int,
                  n_kv: int, head_dim: int) -> bool:
    """The rotary embedding of ``qkv``'s q and k heads and the K/V write of ``layer`` into
    the pools of the step the forward runs, in one launch (``rotary_store`` of
    cuda/fused.cu); False, with nothing done, where it does not run: outside a step or in
    attach's probe, on the host, with 8-bit or other-dtype pools, a row count other than the
    step's, a view whose pools moved inside a capture, or :data:`FUSED_KV_WRITE` off (then
    the caller rotates and attention writes, as ever)."""
    cur = cct.FORWARD.get()
    if not FUSED_KV_WRITE or cur is None or cur.probe is not None or cur.step is None:
        return False
    view = cur.view
    kern = _kernels(qkv)
    T = qkv.shape[0]
    if kern is None or view.config.kv8 or T != cur.step.pad_to or cur.step is not view.cache.prepared_step \
            or not (_rows(qkv) and _rows(cos) and _rows(sin) and qkv.dtype == cos.dtype == sin.dtype) \
            or not qkv.device == cos.device == sin.device == view.device \
            or qkv.shape[1] != (n_q + 2 * n_kv) * head_dim or n_q % n_kv:
        return False
    if view.stale():                              # (attention refreshes it so too)
        if torch.cuda.is_current_stream_capturing():
            return False
        view.refresh()
    k_pool, v_pool, _ = view.layer(layer)
    if not (k_pool.dtype == v_pool.dtype == qkv.dtype and k_pool.is_contiguous()
            and v_pool.is_contiguous() and k_pool.shape[1:] == (n_kv, head_dim)):
        return False
    kern.rotary_store(_DTYPES[qkv.dtype], T, qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                      view.cells[:T].data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), n_q, n_kv,
                      head_dim, qkv.stride(0), cos.stride(0), sin.stride(0),
                      torch.cuda.current_stream(qkv.device).cuda_stream)
    return True


def _attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            compiling: bool, written: bool = False) -> torch.Tensor:
    """Attention of one layer over the step the forward runs (cellcache.hf's context);
    ``written``: its K/V are in the pools already (:func:`_rotary_store`)."""
    if compiling:
        return cct.attention_op(q, k, v, layer, scale)
    cur = cct.FORWARD.get()
    if cur is None:
        raise InvalidState("the native forward ran outside a step: run it through "
                           "ModelRunner.forward (cellcache.hf.attach(..., native=True))")
    cur.calls += 1
    if cur.probe is not None:                 # attach's probe: check, record, write nothing
        cct.check_qkv(cur.view, layer, q, k, v)
        cur.probe.append((layer, None))
        return v.repeat_interleave(q.shape[1] // v.shape[1], dim=1).to(q.dtype)
    return cct.attention(cur.view, layer, q, k, v, step=cur.step, backend=cur.backend, scale=scale,
                         write=not written)


class NativeAdapter:
    """The :class:`cellcache.runner.ModelAdapter` of a :class:`NativeLM`: its forward calls
    cellcache's attention itself, so nothing in the transformers model is switched (it
    keeps its attention setting and runs as before outside the runner).

    ``base``: the model's :class:`cellcache.hf.HFAdapter`, which answers for the model (its
    vocabulary, attention paths) and says whether forwards run deterministic (inside
    :class:`~cellcache.batch_invariant.BatchInvariant`, attention through ``"invariant"``:
    the fused kernels work a row at a time, so they are batch-invariant as they are; the
    Gemma family's norms are torch ops that reduce through ``BatchInvariant``).
    """

    def __init__(self, native: NativeLM, base: Any):
        self.native = native
        self._hf = base
        self.deterministic = bool(base.deterministic)

    def vocab(self) -> int:
        return self._hf.vocab()

    def attention_paths(self, config: CacheConfig) -> list[str]:
        return self._hf.attention_paths(config)

    def invariant(self, device: torch.device) -> BatchInvariant:
        return self._hf.invariant(device)

    def attach(self, view: cct.TorchView) -> None:
        """One probe forward of one token at position 0 (writes nothing): every layer's
        q, k, v checked against the cache's layers."""
        calls: list[tuple[int, Any]] = []
        cur = cct.Forward(view, None, "probe", probe=calls)
        ids = torch.zeros((1, 1), dtype=torch.long, device=view.device)
        token = cct.FORWARD.set(cur)
        try:
            with torch.inference_mode():
                self.native(ids, ids, logits_to_keep=1)
        except CellCacheError:
            raise
        except Exception as e:
            raise InvalidArgument(f"the native forward failed on attach's one-token probe "
                                  f"({type(e).__name__}: {e})") from e
        finally:
            cct.FORWARD.reset(token)
        n = len(view.config.layers)
        if sorted(layer for layer, _ in calls) != list(range(n)):
            raise InvalidArgument(f"the native forward attended {len(calls)} times for the "
                                  f"cache's {n} layers")

    def check(self) -> None:
        self.native.check()

    def run(self, forward: Callable[..., Any], view: cct.TorchView, step: Step, backend: str,
            input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        if self.deterministic:
            backend = "invariant"
        cur = cct.Forward(view, step, backend)
        token = cct.FORWARD.set(cur)
        try:
            if self.deterministic:
                with self.invariant(view.device):
                    out = forward(input_ids, positions, logits_to_keep=rows if rows is not None else 0)
            else:
                out = forward(input_ids, positions, logits_to_keep=rows if rows is not None else 0)
        finally:
            cct.FORWARD.reset(token)
        n = len(view.config.layers)
        if cur.calls != n:
            raise InvalidState(f"the native forward called cellcache's attention {cur.calls} times "
                               f"for {n} layers")
        return out.logits[0]
