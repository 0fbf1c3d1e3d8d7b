"""PyTorch over the cache: zero-copy tensor views and an attention that writes K/V and reads
the cache, eager or inside a captured CUDA graph.

>>> import torch, cellcache as cc, cellcache.torch as cct
>>> cache = cc.build("auto", "batched", cc.CacheConfig(capacity=4096, max_write=64,
...                  layers=[cc.LayerConfig(2, 64)], paged=True))             # doctest: +SKIP
>>> view = cct.TorchView(cache)                                               # doctest: +SKIP
>>> step = cache.prepare_step(stream=torch.cuda.current_stream(), pad_to=16)  # doctest: +SKIP
>>> out = cct.attention(view, 0, q, k, v, step=step)  # q [16, H, D], k/v [16, Hkv, D] # doctest: +SKIP

:class:`TorchView` holds tensors over every buffer (rebuilt when the pools move: never after
the first step with fixed-address pools, at every growth with copy growth; the view notices
by itself). :func:`attention` first checks the call against the cache's prepared step and
the layer (rows ``T`` = the step's ``pad_to``, head counts, head_dim, dtype, device) and
refuses before anything is written; then, for rows ``[0, T)``:

1. K/V of every row into the layer's pools at ``cells[:T]`` (``index_copy_``; padding rows
   land in the sink row; 8-bit pools (``CacheConfig.kv_dtype``) store K/V divided by the
   layer's per-kv-head scales, saturated at ±448, set from the layer's first write:
   :meth:`TorchView.kv_scales`);
2. attention of every row: on CUDA over the paged view through the path
   :func:`cellcache.cuda.kernels.choose_path` picks for the layer's shape (tensor-core
   kernels, cellcache's CUDA-core decode/prefill kernels, FlashInfer, SDPA over masks; a
   fallback warns once), launched on torch's current stream so a graph captures them;
   on the host backend, and on CUDA caches without the paged view, through
   ``scaled_dot_product_attention`` over the layer's mask, restricted to pool rows
   ``[0, read_len)`` (host) or ``[0, rows)`` (CUDA: no host sync, so a graph captured at
   one row count serves until ``Step.rows`` changes).

No host synchronisation happens inside on CUDA, so the call can be captured in a graph.

The path is planned once per step, as FlashInfer splits ``plan()`` from ``run()``: the step's
first call makes its :class:`AttentionPlan` (:meth:`TorchView.plan`: the backend checked,
decode or not, each layer's route, FlashInfer's wrappers), and every layer's call runs it.
:func:`layer_paths` gives a runner each layer's path before any step, to refuse a model
whose shapes have none.

For ``torch.compile`` the same call is the custom op ``torch.ops.cellcache.attention(q, k,
v, layer, scale)`` (:func:`attention_op`): opaque to dynamo, so a compiled forward is one
graph; it finds its view and step in :data:`FORWARD`, set around the forward by its runner.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import importlib.util
import math
import os
import threading
import warnings
import weakref
from typing import Any, NamedTuple, NoReturn

import numpy as np
import torch

from ._checks import check_int
from .buffers import PAGED_ROLES, step_buffers
from .cache import CellCache, Step
from .config import CacheConfig
from .errors import CellCacheError, InvalidArgument, InvalidState

__all__ = ["BACKENDS", "CASCADE_MIN_SHARED", "FORWARD", "GROUPING", "INVARIANT_CLASS", "INVARIANT_TILE",
           "AttentionPlan", "Forward", "Grouping", "TorchView",
           "as_tensor", "attention", "attention_op", "check_qkv", "invariant_paths", "invariant_refusal",
           "layer_paths", "may_group", "sm90a_setting", "torch_dtype"]

_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                 "float8_e4m3fn": torch.float8_e4m3fn}
#: 8-bit K/V: the largest finite e4m3 value, and the headroom left above the first write's
#: largest |K| (|V|) of a kv head when its scale is set: scale = max(amax, 1) * HEADROOM / FP8_MAX
#: (a floor of 1 keeps an all-zero first write from making a scale that later rows saturate)
FP8_MAX = 448.0
KV8_HEADROOM = 4.0
#: What ``backend=`` takes (see :func:`attention`).
BACKENDS = ("auto", "paged", "prefill", "tc", "flashinfer", "sdpa", "invariant")
#: The tensor-core table's shape class (``"decode"`` or ``"prefill"``) whose variant the
#: ``"invariant"`` backend runs for every step on CUDA (one variant for every step, splits
#: off). The prefill variant is the default: its invariance is the one checked on a GPU
#: (tests/gpu/test_deterministic_gpu.py). The decode variant should be invariant for the
#: same reasons and is cheaper for decode steps (16-row units instead of 128), but it is
#: chosen only once the same tests have passed with it (docs/design/deterministic.md).
INVARIANT_CLASS = "prefill"
#: Keys a tile of the host's ``"invariant"`` attention: a row's keys, in position order, are
#: reduced tile after tile from its first key, whatever the step holds.
INVARIANT_TILE = 32
#: Shared-prefix (cascade) attention on the tensor-core path: in decode steps, consecutive
#: rows whose sequences share at least this many leading cells (a multiple of 128) form a
#: group whose shared cells are read once for all its rows (docs/design/attention.md); 0
#: turns it off. Read as each forward of a step starts. Never with the ``"invariant"`` backend
#: (grouping changes a row's order of sums) nor on windowed layers.
CASCADE_MIN_SHARED = 256
#: A plan's last layer before its first forward: whatever layer comes first starts one.
_NO_FORWARD_YET = 1 << 30


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a K/V dtype name (``"float16"``, ``"bfloat16"``, ``"float32"``,
    ``"float8_e4m3fn"``)."""
    try:
        return _TORCH_DTYPES[name]
    except (KeyError, TypeError):
        raise InvalidArgument(
            f"dtype {name!r} is not one of {', '.join(_TORCH_DTYPES)}") from None


def as_tensor(buffer: Any) -> torch.Tensor:
    """A zero-copy torch view of any cache buffer, on any backend and dtype.

    Host buffers (numpy, bfloat16 included through ml_dtypes) become CPU tensors sharing the
    memory; CUDA buffers come through DLPack, ordered after the last step's buffer writes
    on torch's current stream. Anything else raises InvalidArgument.
    """
    try:
        if isinstance(buffer, np.ndarray):
            if buffer.dtype.name == "bfloat16":
                return torch.from_numpy(buffer.view(np.int16)).view(torch.bfloat16)
            if buffer.dtype.name == "float8_e4m3fn":
                return torch.from_numpy(buffer.view(np.uint8)).view(torch.float8_e4m3fn)
            return torch.from_numpy(buffer)
        if hasattr(buffer, "__dlpack__"):
            t = torch.from_dlpack(buffer)
            if getattr(getattr(buffer, "dtype", None), "name", None) == "float8_e4m3fn":
                t = t.view(torch.float8_e4m3fn)          # exported as bytes
            return t
    except CellCacheError:
        raise
    except (TypeError, ValueError, RuntimeError, BufferError, AttributeError) as e:
        raise InvalidArgument(
            f"buffer of type {type(buffer).__name__} cannot be viewed as a tensor ({e}); give a "
            "cache buffer (cache.buffer(name))") from e
    raise InvalidArgument(f"buffer of type {type(buffer).__name__} is not a cache buffer")


class _Kv8State:
    """A cache's 8-bit K/V scales: per layer a float32 ``[2, n_kv_heads]`` tensor on its device
    (fixed for the cache's life, so captured graphs read whatever it holds), and whether
    each layer's are set."""

    __slots__ = ("table", "set")

    def __init__(self, config: CacheConfig, device: torch.device):
        self.table = [torch.ones((2, lc.n_kv_heads), dtype=torch.float32, device=device)
                      for lc in config.layers]
        self.set = [False] * len(config.layers)


_KV8: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_KV8_LOCK = threading.Lock()


def _kv8_state(cache: CellCache, device: torch.device) -> _Kv8State:
    """The cache's scale table, shared by every view of it (made with the first)."""
    with _KV8_LOCK:
        state = _KV8.get(cache)
        if state is None:
            state = _KV8[cache] = _Kv8State(cache.config, device)
        return state


class TorchView:
    """Torch tensors over a cache's buffers, by role rather than by name.

    The roles are the schema's (:func:`cellcache.buffers.step_buffers`): ``cells``,
    ``positions``, ``read_len``, ``width`` (int64) as attributes, ``masks[window]``
    (``[max_write, capacity]`` bool, or ``[max_write, ceil(capacity / 8)]`` uint8 bits),
    ``paged[role]`` for the paged view's ``qo_indptr``, ``kv_indptr``, ``kv_indices``,
    ``kv_last_page_len`` (int32), and per layer its K and V pools
    ``[sink + 1, n_kv_heads, head_dim]`` (:meth:`layer`).

    Pools that grow by copying move at every growth (``Step.grew``): :meth:`stale` says
    whether they moved since the views were built, :func:`attention` refreshes a stale view
    itself (and refuses while a CUDA graph is being captured, where a refresh cannot run),
    and :meth:`refresh` rebuilds the views on demand. ``generation`` counts the refreshes,
    so that a holder of tensors derived from the views (a captured graph) knows when they
    went out of date.
    """

    def __init__(self, cache: CellCache):
        if not isinstance(cache, CellCache):
            raise InvalidArgument(f"cache of type {type(cache).__name__} is not a cellcache cache")
        self.cache = cache
        self.config = cache.config
        self.cuda = cache.backend == "cuda"
        self._kernels: Any = None
        self._tensor_cores: Any = None
        #: by layer shape (heads, kv heads, head_dim): the most rows the tensor-core kernels'
        #: grouped scratch was reserved for (:meth:`reserve_grouped`)
        self._grouped_rows: dict[tuple[int, int, int], int] = {}
        self._pools_generation = -1
        # the prepared step's attention plan (made at its first attention call), and each
        # layer's route by (backend, layer, n_heads): the shape's part, the same every step
        self._plan: AttentionPlan | None = None
        self._routes: dict[tuple[str, int, int], _Route] = {}
        self._flashinfer_workspace: torch.Tensor | None = None   # FlashInfer's, on first use
        self.generation = 0
        self.refresh()
        self._kv8 = _kv8_state(cache, self.device) if self.config.kv8 else None

    def stale(self) -> bool:
        """Whether the pools moved since the views were built (then call :meth:`refresh`).

        Pure attribute reads, no device access: cheap enough for every attention call.
        """
        return self.cache.pools_generation != self._pools_generation

    def refresh(self) -> None:
        """Rebuilds the views (pools that moved: a copy growth, ``Step.grew``)."""
        c, cfg = self.cache, self.config
        generation = c.pools_generation
        scalars: dict[str, torch.Tensor] = {}
        self.masks: dict[int, torch.Tensor] = {}
        self.paged: dict[str, torch.Tensor] = {}
        for spec in step_buffers(cfg):
            t = as_tensor(c.buffer(spec.name))
            if spec.role == "mask":
                self.masks[spec.window] = t.view(cfg.max_write, -1)  # type: ignore[index]
            elif spec.role in PAGED_ROLES:
                self.paged[spec.role] = t
            else:
                scalars[spec.role] = t
        self.cells, self.positions = scalars["cells"], scalars["positions"]
        self.read_len, self.width = scalars["read_len"], scalars["width"]
        self.pools = [(as_tensor(lay.k), as_tensor(lay.v))
                      for lay in (c.layer(i) for i in range(len(cfg.layers)))]
        self.device = self.cells.device
        self._arange = torch.arange(self.pools[0][0].shape[0], device=self.device)
        self._pools_generation = generation
        self.generation += 1

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Layer ``index``'s K pool, V pool and window; ``index`` in ``[0, layers)``
        (negative indices are refused, not counted from the end)."""
        i = check_int(index, "layer", 0, len(self.pools) - 1)
        k, v = self.pools[i]
        return k, v, self.config.layers[i].window

    def kv_scales(self, layer: int) -> torch.Tensor | None:
        """8-bit K/V pools: layer ``layer``'s scales, float32 ``[2, n_kv_heads]`` on the cache's
        device (K's row, then V's; a stored value times its head's scale is the K or V it
        stands for), a view of the cache's scale table: every TorchView of the cache shares
        it. None for 16/32-bit pools. A layer's scales are set at its first write, from
        the largest |K| and |V| per kv head among the step's real rows (with
        :data:`KV8_HEADROOM`), on the device (no host sync), and kept for the cache's life:
        every stored cell was written with them. :meth:`set_kv_scales` sets them ahead."""
        if self._kv8 is None:
            return None
        return self._kv8.table[check_int(layer, "layer", 0, len(self.pools) - 1)]

    def kv_scales_set(self, layer: int) -> bool:
        """Whether layer ``layer``'s 8-bit scales are set (False for 16/32-bit pools)."""
        i = check_int(layer, "layer", 0, len(self.pools) - 1)
        return self._kv8 is not None and self._kv8.set[i]

    def kv_scales_ready(self) -> bool:
        """Whether every layer's 8-bit scales are set (True for 16/32-bit pools): until then a
        runner runs its forwards eagerly, since a first write inside a graph is refused."""
        return self._kv8 is None or all(self._kv8.set)

    def reset_kv_scales(self) -> None:
        """Forgets every layer's 8-bit scales, so the next writes set them again (a runner's
        warm-up writes dummy tokens: their K/V must not set the scales real K/V is stored
        with). InvalidState, nothing changed, while any cell is owned (it holds K/V written
        with them); a no-op for 16/32-bit pools."""
        if self._kv8 is None:
            return
        if self.cache.free_cells != self.config.capacity:
            raise InvalidState("reset_kv_scales() while cells hold K/V written with the scales: "
                               "free every sequence first")
        for t in self._kv8.table:
            t.fill_(1.0)
        self._kv8.set = [False] * len(self._kv8.set)

    def set_kv_scales(self, layer: int, k_scale: Any, v_scale: Any) -> None:
        """Sets layer ``layer``'s 8-bit scales (``[n_kv_heads]`` each, or one number for every
        head; finite and > 0) before its first write, e.g. from a calibration run or a
        checkpoint. Refused (InvalidArgument: not 8-bit pools, a bad value; InvalidState:
        the layer's scales are set already, so cells may hold K/V written with them) with
        nothing changed."""
        if self._kv8 is None:
            raise InvalidArgument(f"the cache stores K/V in {self.config.dtype}: only 8-bit pools "
                                  "(CacheConfig.kv_dtype) have scales")
        i = check_int(layer, "layer", 0, len(self.pools) - 1)
        h = self.config.layers[i].n_kv_heads
        vals = []
        for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
            try:
                t = torch.as_tensor(x, dtype=torch.float64).flatten().cpu()
            except (TypeError, ValueError, RuntimeError) as e:
                raise InvalidArgument(f"{name} of type {type(x).__name__} is not a number or "
                                      f"[{h}] numbers ({e})") from None
            if t.numel() == 1:
                t = t.expand(h)
            if t.numel() != h or not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
                raise InvalidArgument(f"{name} must be one finite number > 0 or {h} of them "
                                      f"(layer {i}'s kv heads); got {x!r}")
            vals.append(t.float())
        if self._kv8.set[i]:
            raise InvalidState(f"layer {i}'s 8-bit scales are set already (at its first write or by "
                               "set_kv_scales): cells may hold K/V written with them")
        self._kv8.table[i].copy_(torch.stack(vals).to(self.device))
        self._kv8.set[i] = True

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, width: int) -> None:
        """Rows ``[0, T)`` of ``k``/``v`` (``[T, n_kv_heads, head_dim]``, checked by the
        caller) into layer ``layer``'s pools at ``cells[:T]``, converted to the pools' dtype;
        8-bit pools store them scaled (the layer's first write sets its scales from rows
        ``[0, width)``: refused with InvalidState, nothing written, inside a graph capture)."""
        self.write_rows(layer, self.cells[:k.shape[0]], k, v, width)

    def write_rows(self, layer: int, cells: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   width: int | None = None) -> None:
        """``k``/``v`` (``[n, n_kv_heads, head_dim]``) into layer ``layer``'s pools at pool rows
        ``cells`` (int64 ``[n]`` on the cache's device), as :meth:`write_kv` writes a step's
        (``width``: the rows a first 8-bit write sets the scales from; None: all)."""
        k_pool, v_pool, _ = self.layer(layer)
        if self._kv8 is None:
            k_pool.index_copy_(0, cells, k.to(k_pool.dtype))
            v_pool.index_copy_(0, cells, v.to(v_pool.dtype))
            return
        if not self._kv8.set[layer] and self.cuda and torch.cuda.is_current_stream_capturing():
            raise InvalidState(f"layer {layer}'s 8-bit K/V scales are set at its first write, "
                               "which cannot be captured in a graph: run one step eagerly first "
                               "(or set_kv_scales)")
        kq, vq = self._quantize(layer, k, v, k.shape[0] if width is None else width)
        k_pool.view(torch.uint8).index_copy_(0, cells, kq.view(torch.uint8))
        v_pool.view(torch.uint8).index_copy_(0, cells, vq.view(torch.uint8))

    def _quantize(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                  width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as the layer's 8-bit pools store them (setting its scales from rows
        ``[0, width)`` at its first write)."""
        kv8 = self._kv8
        assert kv8 is not None
        scales = kv8.table[layer]
        if not kv8.set[layer]:
            real = max(int(width), 1)
            # (a non-finite value, which a real model's K/V never holds, must not make a
            # scale that zeroes its head for good)
            amax = torch.stack([k[:real].float().abs().nan_to_num(0.0, 0.0, 0.0).amax(dim=(0, 2)),
                                v[:real].float().abs().nan_to_num(0.0, 0.0, 0.0).amax(dim=(0, 2))])
            scales.copy_(amax.clamp(min=1.0) * (KV8_HEADROOM / FP8_MAX))
            kv8.set[layer] = True
        kq = (k.float() / scales[0, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        vq = (v.float() / scales[1, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return kq, vq

    def dequantized(self, layer: int, rows: torch.Tensor | slice, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``rows`` of layer ``layer``'s K and V pools as ``dtype`` (8-bit pools: times
        the layer's scales): what attention reads. ``[n, n_kv_heads, head_dim]`` each."""
        k_pool, v_pool, _ = self.layer(layer)
        if self._kv8 is None:
            return k_pool[rows].to(dtype), v_pool[rows].to(dtype)
        # (gathered as bytes: not every torch op takes float8)
        k = k_pool.view(torch.uint8)[rows].view(torch.float8_e4m3fn)
        v = v_pool.view(torch.uint8)[rows].view(torch.float8_e4m3fn)
        s = self._kv8.table[layer]
        return ((k.float() * s[0, :, None]).to(dtype), (v.float() * s[1, :, None]).to(dtype))

    def live_rows(self, rows: int) -> torch.Tensor:
        """``[rows]`` bool: which of pool rows ``[0, rows)`` are below ``read_len``, compared on
        the device (no host sync: a captured graph sees each step's ``read_len``)."""
        return self._arange[:rows] < self.read_len

    def plan(self, step: Step, backend: str = "auto") -> AttentionPlan:
        """The attention plan of ``step`` (the cache's prepared step) under ``backend``
        (:func:`attention` takes the same names): made at the step's first call, the same
        object for every later layer of that step, replaced at the next step (or another
        backend, or when :data:`MIXED_CAPTURE` changes). InvalidArgument for a backend the
        cache cannot run, before anything is written."""
        plan = self._plan
        if plan is None or not plan.matches(step, backend):
            plan = self._plan = AttentionPlan(self, step, backend, self._routes)
        return plan

    def flashinfer_workspace(self) -> torch.Tensor:
        """FlashInfer's workspace on the cache's device (256 MiB), made on first use and
        shared by every plan of this view."""
        if self._flashinfer_workspace is None:
            self._flashinfer_workspace = torch.empty(256 << 20, dtype=torch.uint8, device=self.device)
        return self._flashinfer_workspace

    def paged_pointers(self) -> dict[str, int]:
        """Device addresses of the paged view and ``width``, as cellcache's kernels take them."""
        p = self.paged
        return {"qo_indptr": p["qo_indptr"].data_ptr(), "kv_indptr": p["kv_indptr"].data_ptr(),
                "kv_indices": p["kv_indices"].data_ptr(), "width": self.width.data_ptr()}

    def kernels(self) -> Any:
        """cellcache's attention kernels for this cache (CUDA): the cache's own
        (``CudaCellCache.attention_kernels()``, released when it closes)."""
        if self._kernels is None:
            from .cuda.backend import CudaCellCache

            if not isinstance(self.cache, CudaCellCache):
                raise InvalidArgument(f"a {self.cache.backend} cache has no attention kernels; "
                                      "they need a CUDA cache")
            self._kernels = self.cache.attention_kernels()
        return self._kernels

    def reserve_grouped(self, rows: int, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
        """Has the tensor-core kernels hold the scratch a grouped (shared-prefix) decode step
        of ``rows`` padded rows needs at this layer shape, so that a graph captured later finds
        it (:meth:`AttentionPlan._kernel`); once a shape and width (scratch only grows), so a
        call that finds it held is a lookup."""
        key = (n_heads, n_kv_heads, head_dim)
        if self._grouped_rows.get(key, 0) < rows:
            self.tensor_cores().reserve(rows, n_heads, n_kv_heads, head_dim, decode=True, cascade=True)
            self._grouped_rows[key] = rows

    def tensor_cores(self) -> Any:
        """The tensor-core kernels (``cellcache.cuda.tc.TensorCoreAttention``) for this
        cache's dtype, built on first use and closed with the cache (the sm_90a prefill
        kernels where the GPU takes them, as :func:`sm90a_setting` says); InvalidArgument
        where the module is absent."""
        if self._tensor_cores is None:
            from .cuda.kernels import tensor_cores

            tc = tensor_cores()
            if tc is None:
                raise InvalidArgument("the tensor-core kernels (cellcache.cuda.tc) are not available")
            kern = tc.TensorCoreAttention(self.config.dtype, self.kernels().sm_count,
                                          kv_dtype=self.config.kv_dtype, hopper=sm90a_setting())
            self.cache.on_close(kern.close)
            self._tensor_cores = kern
        return self._tensor_cores


def sm90a_setting() -> bool | None:
    """``CELLCACHE_SM90A`` read when a cache's tensor-core kernels are built: unset or empty,
    the sm_90a prefill kernels wherever the GPU takes them (None); ``0``: never (the sm_80
    kernels everywhere: to compare, or as a way out); ``1``: required (InvalidArgument on
    another GPU). Anything else is an InvalidArgument."""
    value = os.environ.get("CELLCACHE_SM90A", "")
    if value not in ("", "0", "1"):
        raise InvalidArgument(f"CELLCACHE_SM90A={value!r}: unset, 0 (never) or 1 (required)")
    return None if value == "" else value == "1"


def attention(view: TorchView, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              *, step: Step | None = None, backend: str = "auto",
              scale: float | None = None, out: torch.Tensor | None = None,
              write: bool = True) -> torch.Tensor:
    """Writes rows ``[0, T)`` of K/V at ``cells[:T]`` and attends every row; returns
    ``[T, n_heads, head_dim]`` (rows past the step's real width are padding: discard them).
    ``out``, when given, receives the result: ``[T, n_heads, head_dim]`` of the pool's dtype.

    ``q`` is ``[T, n_heads, head_dim]``, ``k``/``v`` ``[T, n_kv_heads, head_dim]``, any
    strides (HF's ``[1, H, T, D]`` transposed is fine), on the cache's device, of any
    floating dtype (K/V are stored converted to the pool's dtype, as the model's own cache
    would cast them); ``n_heads`` a multiple of the layer's ``n_kv_heads``; ``T`` the
    prepared step's ``pad_to``. ``step``, when given, must be the cache's prepared step (the
    one not yet committed); by default it is that step. ``backend``: ``"auto"`` (on CUDA
    with the paged view the path :func:`cellcache.cuda.kernels.choose_path` picks for the
    shape: the tensor-core kernels, else cellcache's decode kernel for a decode step and
    its prefill kernel otherwise, else FlashInfer, else SDPA over masks; on the host or
    without the paged view SDPA over masks), ``"paged"`` (the decode kernel: one block per
    row), ``"prefill"`` (the prefill kernel: query tiles share K/V tiles; its work list is
    built on the device, so it can be captured), ``"tc"`` (the tensor-core kernels),
    ``"sdpa"`` or ``"flashinfer"`` (FlashInfer plans from the step's host indptrs), or
    ``"invariant"``: each row's result depends on its own sequence's keys alone, never on
    the step around it (deterministic serving, docs/design/deterministic.md): on CUDA one
    tensor-core variant for every step (:data:`INVARIANT_CLASS`), kv splits off
    (InvalidArgument for a shape or address it does not take); on the host each row's keys in position
    order, in fixed tiles of :data:`INVARIANT_TILE` keys with a fixed-order online softmax
    in float32 (needs masks).
    ``"paged"``/``"prefill"`` on a shape cellcache's kernels do not take fall back like
    ``"auto"`` and warn once per cache and shape; a shape no path takes raises
    InvalidArgument.

    ``write=False``: the caller has written rows ``[0, T)`` of K/V at ``cells[:T]`` itself,
    in the pools' dtype (cellcache.native's fused rotary and K/V write); ``k``/``v`` are
    then checked for shape only. Refused (InvalidArgument) for 8-bit pools, whose write
    scales the values.

    Every check happens before anything is written: a refused call (InvalidArgument for
    the arguments, InvalidState for the step) leaves the pools as they were (with
    ``write=False`` the caller's own write came before them: it touched the step's cells
    only). The checks read Python attributes only (no device access), so the call can be
    captured in a graph.
    """
    cfg = view.config if isinstance(view, TorchView) else None
    if cfg is None:
        raise InvalidArgument(f"view of type {type(view).__name__} is not a TorchView")
    layer = check_qkv(view, layer, q, k, v)
    if not isinstance(write, (bool, np.bool_)):
        raise InvalidArgument(f"write of type {type(write).__name__} is not a bool")
    if not write and cfg.kv8:
        raise InvalidArgument("write=False: 8-bit pools are written scaled by attention itself")
    T = q.shape[0]
    current = view.cache.prepared_step
    if current is None:
        raise InvalidState("no step is prepared (or it was committed already): a forward writes "
                           "K/V between prepare_step() and commit_step()")
    if step is not None and step is not current:
        raise InvalidState("step= is not this cache's prepared step (a committed step, an older "
                           "one or another cache's): pass the Step that prepare_step() just returned")
    step = current
    if T != step.pad_to:
        raise InvalidArgument(
            f"q, k, v have {T} rows; the prepared step runs at pad_to={step.pad_to} rows "
            f"({step.width} real): give exactly pad_to rows")
    scale = _check_scale(scale)
    plan = view.plan(step, backend)              # refuses a backend the cache cannot run
    if out is not None:
        shape, dtype = (T, q.shape[1], q.shape[2]), _TORCH_DTYPES[cfg.dtype]
        if not (isinstance(out, torch.Tensor) and out.shape == shape and out.dtype == dtype
                and out.device == view.device and out.stride(2) == 1):
            got = (f"{tuple(out.shape)} {out.dtype} on {out.device}" if isinstance(out, torch.Tensor)
                   else f"of type {type(out).__name__}")
            raise InvalidArgument(f"out must be a {list(shape)} {dtype} tensor on {view.device} "
                                  f"with unit stride in head_dim; got {got}")
    if view.stale():                             # copy growth moved the pools since the last refresh
        if view.cuda and torch.cuda.is_current_stream_capturing():
            raise InvalidState("the pools moved (a copy growth) since the view was built; call "
                               "view.refresh() before capturing a graph")
        view.refresh()
    return plan.run(layer, q, k, v, scale, out, write)


@dataclasses.dataclass
class Forward:
    """A forward running over a step (what :data:`FORWARD` holds): the ``view``, the
    ``step`` and the ``backend`` its attention runs on (as :func:`attention` takes them),
    the attention calls made so far, and ``probe`` (a list, or None): an attach's probe
    forward, whose attention checks and records (layer, module config) and writes nothing."""

    view: TorchView
    step: Step | None
    backend: str
    calls: int = 0
    probe: list | None = None


#: The forward running now, for :func:`attention_op` and the model code that calls
#: :func:`attention` (cellcache.hf's hook, cellcache.native): a :class:`Forward` whose
#: ``calls`` the op counts up; None between forwards. Set by the model's adapter around each
#: forward of a :class:`cellcache.runner.ModelRunner`, read only inside the op, where dynamo
#: does not look.
FORWARD: contextvars.ContextVar = contextvars.ContextVar("cellcache_forward", default=None)


@torch.library.custom_op("cellcache::attention", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, int layer, float? scale) -> Tensor")
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                  scale: float | None) -> torch.Tensor:
    forward = FORWARD.get()
    if forward is None:
        raise InvalidState("cellcache's attention op ran outside a step: run the compiled forward "
                           "through ModelRunner.forward")
    forward.calls += 1
    out = attention(forward.view, layer, q, k, v, step=forward.step, backend=forward.backend,
                    scale=scale)
    return out.to(q.dtype).contiguous()     # what the fake promises: q's dtype, contiguous


@_attention_op.register_fake
def _(q, k, v, layer, scale):
    return q.new_empty(q.shape)


# The op writes the layer's pools, which are not among its arguments (see attention_op):
# never dropped as dead code, even where a graph would not use its output.
torch.fx.node.has_side_effect(torch.ops.cellcache.attention.default)


def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                 scale: float | None = None) -> torch.Tensor:
    """:func:`attention` as the custom op ``cellcache::attention``, for compiled forwards:
    ``[T, n_heads, head_dim]`` in ``q``'s dtype (contiguous), for the view, step and backend
    of the forward in :data:`FORWARD` (InvalidState when none runs); it counts the call in
    ``FORWARD.calls``.

    A custom op takes only tensors and scalars, so the Python state (view, step, backend)
    stays in the context variable and the layer travels as an int; the op is opaque to
    dynamo, which therefore neither traces the lookup nor breaks the graph at attention.
    The layer's K/V pools, which the op writes, are not arguments (``mutates_args=()``, as
    vLLM's ``unified_attention`` keeps its KV cache out of the graph): each layer's pools are
    touched by that layer's call alone, whose output the next layer consumes, so no other
    op can be reordered around the write. Passed as mutated arguments they would have to be
    graph inputs (threaded through the model's forward), AOT would functionalize the write
    (``auto_functionalized_v2``: a clone of each pool and a copy back per call unless
    inductor re-inplaces it; aot_eager does not), and a copy growth (new pool tensors)
    would recompile the graph.
    """
    return torch.ops.cellcache.attention(q, k, v, layer, scale)


#: (dtype, head_dim, group, path) fallbacks already announced, per cache
_ANNOUNCED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_HAVE_FLASHINFER: list[bool] = []


def have_flashinfer() -> bool:
    """Whether FlashInfer is installed (looked up once, without importing it)."""
    if not _HAVE_FLASHINFER:
        _HAVE_FLASHINFER.append(importlib.util.find_spec("flashinfer") is not None)
    return _HAVE_FLASHINFER[0]


def _check_scale(scale: Any) -> float | None:
    """None (1/sqrt(head_dim)) or a finite number > 0 (the kernels fold it into exp2 after
    taking row maxima of the raw scores); InvalidArgument for anything else."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise InvalidArgument(f"scale of type {type(scale).__name__} is not a number")
    value = float(scale)
    if not (math.isfinite(value) and value > 0):
        raise InvalidArgument(f"scale={value} must be a finite number > 0")
    return value


#: True while a runner captures a mixed-step graph: the graph replays any mix of rows later,
#: so its kernels must be the prefill ones even when the captured step has one row a run.
MIXED_CAPTURE: contextvars.ContextVar = contextvars.ContextVar("cellcache_mixed_capture", default=False)


class Grouping:
    """What a runner asks of the decode steps planned while it captures a graph
    (:data:`GROUPING`), and what their layers tell it back. Asked: ``on``, whether they
    launch the shared-prefix pass (their rows may group, whatever their sequences share now:
    the graph replays other steps); ``live_rows``, how many runs with a query the runner
    promises of every step the graph replays (tensor-core layers without the pass leave
    the merge out where that many cannot be split:
    :meth:`~cellcache.cuda.tc.TensorCoreAttention.run`). Told: ``used``, set once a layer
    of more than one row launched the pass (False after the capture: both ways capture the
    same launches); ``need``, the most live rows any tensor-core layer of the capture needs
    to leave its merge out (:meth:`~cellcache.cuda.tc.TensorCoreAttention.unsplit_rows`;
    None: no tensor-core layer ran)."""

    __slots__ = ("on", "used", "live_rows", "need")

    def __init__(self, on: bool, live_rows: int = 0):
        self.on, self.used, self.live_rows = on, False, live_rows
        self.need: int | None = None


#: Set (a :class:`Grouping`) while a runner captures a decode graph; unset, each decode step
#: on the tensor-core path groups its rows only where :func:`may_group` says some can.
GROUPING: contextvars.ContextVar[Grouping | None] = contextvars.ContextVar("cellcache_grouping", default=None)


def may_group(view: TorchView, step: Step) -> bool:
    """Whether two consecutive rows of ``step`` belong to different sequences holding the
    same cell at position ``CASCADE_MIN_SHARED - 1``: what the device's grouping of decode
    rows (``tc_share``: a row's leading kv entries in common with the row before, at least
    that many to group) needs. False: no row would group, and the shared-prefix pass would
    be launched in every layer to find nothing (the runner then replays its bucket's graph
    captured without it). A prefix of a token or two that requests share (a BOS, a chat
    template's opening) leaves it False."""
    n = CASCADE_MIN_SHARED
    return n > 0 and view.cache.table.rows_share_cell(step.seq_ids, n - 1)


def _decode_step(step: Step) -> bool:
    """Every real run of the step is one row (a decode step): the decode kernel's case
    (never while a mixed-step graph is captured: :data:`MIXED_CAPTURE`)."""
    return step.n_runs >= step.width and not MIXED_CAPTURE.get()


def layer_paths(config: CacheConfig, n_heads: int) -> list[str]:
    """Each layer's attention path on a CUDA cache with the paged view, for a model of
    ``n_heads`` query heads: :func:`cellcache.cuda.kernels.choose_path` of the layer's shape
    (``"tc"``, ``"paged"``, ``"flashinfer"`` or ``"sdpa"``), the choice every step's
    :class:`AttentionPlan` makes under ``backend="auto"`` where the addresses suit the
    tensor-core kernels. InvalidArgument when a layer's shape has no path, so a runner can
    refuse a model before anything runs."""
    from .cuda.kernels import choose_path

    n_heads = check_int(n_heads, "n_heads", 1)
    return [choose_path(config.dtype, lc.head_dim, n_heads // lc.n_kv_heads,
                        have_flashinfer=have_flashinfer(), has_masks=config.mask_format != "none",
                        kv8=config.kv8)
            for lc in config.layers]


def invariant_refusal(config: CacheConfig, layer: int, n_heads: int) -> str | None:
    """Why layer ``layer`` of a CUDA cache with the paged view cannot run the ``"invariant"``
    backend for ``n_heads`` query heads, or None when it can: the tensor-core kernels must
    take the shape (windowed layers included: a unit's kv tiles start at a multiple of the
    tile, whichever query opens it)."""
    from .cuda import kernels as ck

    lc = config.layers[layer]
    group = n_heads // lc.n_kv_heads
    tc = ck.tensor_cores()
    if tc is None or not tc.supports(config.dtype, lc.head_dim, group):
        return (f"layer {layer}: deterministic attention runs the tensor-core kernels, which do not "
                f"take head_dim={lc.head_dim}, group={group} ({config.dtype}); they take float16 or "
                "bfloat16 at head_dim 64, 80, 96, 128 or 256")
    return None


def invariant_paths(config: CacheConfig, n_heads: int) -> list[str]:
    """Each layer's path under the ``"invariant"`` backend on a CUDA cache with the paged view
    (``"tc"`` for every layer); InvalidArgument naming the first layer it cannot run
    (:func:`invariant_refusal`), so a runner refuses the model before anything runs."""
    n_heads = check_int(n_heads, "n_heads", 1)
    for i in range(len(config.layers)):
        reason = invariant_refusal(config, i, n_heads)
        if reason is not None:
            raise InvalidArgument(reason)
    return ["tc"] * len(config.layers)


class _Route(NamedTuple):
    """A layer shape's path under one backend, the same every step: ``aligned`` where the
    call's addresses suit the tensor-core kernels, ``unaligned`` otherwise (equal unless
    ``tc``: the tensor-core kernels take the shape); None: refused. ``"paged"`` becomes the
    decode or prefill kernel by the step; ``chosen``: picked by ``choose_path`` (a fallback
    away from cellcache's kernels is announced)."""

    tc: bool
    aligned: str | None
    unaligned: str | None
    chosen: bool


def _route(cfg: CacheConfig, layer: int, n_heads: int, backend: str) -> _Route:
    """The route of ``layer`` for ``n_heads`` query heads under a kernel ``backend`` ("auto",
    "paged", "prefill", "tc") on a CUDA cache with the paged view."""
    from .cuda import kernels as ck

    lc = cfg.layers[layer]
    D, group = lc.head_dim, n_heads // lc.n_kv_heads
    tc = ck.tensor_cores()
    takes_tc = tc is not None and tc.supports(cfg.dtype, D, group)
    if backend == "tc":
        return _Route(takes_tc, "tc" if takes_tc else None, None, False)
    if backend in ("paged", "prefill") and ck.paged_supports(cfg.dtype, D, group):
        fixed = "decode" if backend == "paged" else "prefill"
        return _Route(False, fixed, fixed, False)

    def choose(aligned: bool) -> str | None:
        try:
            return ck.choose_path(cfg.dtype, D, group, tc_aligned=aligned,
                                  have_flashinfer=have_flashinfer(), has_masks=cfg.mask_format != "none",
                                  kv8=cfg.kv8)
        except InvalidArgument:
            return None                      # refused at the call, with choose_path's message

    aligned = choose(True)
    return _Route(takes_tc, aligned, choose(False) if takes_tc else aligned, True)


class AttentionPlan:
    """One prepared step's attention, planned once for every layer (FlashInfer's
    ``plan()``/``run()`` split): :meth:`TorchView.plan` makes it at the step's first
    :func:`attention` call and keeps it until the next step; each layer's call only
    :meth:`run`\\ s it.

    The plan holds what the step decides: the backend, checked against the cache once;
    ``decode`` (every real run of the step is one row, and no mixed-step graph is being
    captured: the decode kernels' case); each layer's path for its shape (routes kept by the
    view, the same every step); and FlashInfer's wrappers, planned from the step's host
    indptrs once per distinct layer shape. A call checks only what is its own: whether q's,
    the pools' and out's addresses suit the tensor-core kernels.

    Example
    -------
    >>> plan = view.plan(step)                                  # doctest: +SKIP
    >>> out = plan.run(layer, q, k, v, scale=None, out=None)    # doctest: +SKIP
    """

    __slots__ = ("view", "step", "backend", "mixed", "decode", "kernels", "cascade", "live_rows",
                 "_routes", "_flashinfer", "_keys", "_shared", "_planned", "_last_layer", "_grouping")

    def __init__(self, view: TorchView, step: Step, backend: str,
                 routes: dict[tuple[str, int, int], _Route] | None = None):
        _check_backend(view, backend, step)
        self.view, self.step, self.backend = view, step, backend
        self.mixed = MIXED_CAPTURE.get()
        self.decode = _decode_step(step)
        #: whether layers route among cellcache's kernels (a CUDA cache with the paged view
        #: and a kernel backend); else every layer runs ``backend`` ("sdpa" for "auto")
        self.kernels = backend not in ("sdpa", "flashinfer", "invariant") and view.cuda and view.config.paged
        self._routes = {} if routes is None else routes
        self._flashinfer: dict[tuple, Any] = {}
        self._keys: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # host "invariant": by window
        self._grouping = GROUPING.get()
        # decided as each forward starts (:meth:`_begin`), the first included: a plan made
        # outside a capture may have its first forward captured
        self.cascade = self.live_rows = 0
        self._shared = self._planned = False
        self._last_layer = _NO_FORWARD_YET

    def _begin(self) -> None:
        """What a forward of the step launches by, decided as it starts: a plan serves every
        forward of its step, and one may run eagerly (a caller's warm-up) and the next in a
        capture, which must not keep what the eager one could count on."""
        view, step, grouping = self.view, self.step, self._grouping
        capturing = bool(self.kernels and grouping is None and torch.cuda.is_current_stream_capturing())
        #: the tensor-core path's cascade threshold for this forward (0: off): decode steps
        #: only (only decode runs group; a prompt chunk's rows would size the grouped rows'
        #: partials for nothing); in a capture on (a graph captured from a one-row step
        #: replays wider ones) unless the runner asks otherwise (:data:`GROUPING`), else
        #: where two rows may group (:func:`may_group`)
        self.cascade = CASCADE_MIN_SHARED if self.kernels and self.decode else 0
        if self.cascade and not (grouping.on if grouping is not None else capturing or may_group(view, step)):
            self.cascade = 0
        #: how many of the step's runs the tensor-core path may count on having a query (it
        #: leaves the merge out where they cannot be split): the runner's promise in its
        #: captures, none in a graph someone else captures (it replays any step), else the
        #: step's own runs
        self.live_rows = 0
        if self.kernels and not capturing:
            self.live_rows = step.n_runs if grouping is None else grouping.live_rows
        # the step's shares are found and its tensor-core work list made by the first
        # cascade (tensor-core) layer of each forward; the others reuse them (a forward
        # starts when a layer comes again or an earlier one does: a graph captured from any
        # forward holds those launches)
        self._shared = self._planned = False
        self._last_layer = -1

    def matches(self, step: Step, backend: str) -> bool:
        """Whether this plan is the one for ``step`` under ``backend`` now."""
        return (step is self.step and backend == self.backend and MIXED_CAPTURE.get() == self.mixed
                and GROUPING.get() is self._grouping)

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            scale: float | None, out: torch.Tensor | None, write: bool = True) -> torch.Tensor:
        """Layer ``layer``'s attention of the step (arguments checked by :func:`attention`):
        its path decided (a refusal raises here, before anything is written), K/V written
        at ``cells[:T]`` (unless ``write`` is False: the caller did), then the path run."""
        view = self.view
        if layer <= self._last_layer:              # a new forward of the step
            self._begin()
        self._last_layer = layer
        k_pool, v_pool, window = view.layer(layer)
        path, qk = self._path(layer, q, k_pool, v_pool, out)
        if write:
            view.write_kv(layer, k, v, self.step.width)
        if path in ("decode", "prefill", "tc"):
            return self._kernel(layer, path, qk, k_pool, v_pool, window, scale, out)
        if path == "flashinfer":
            result = self._flashinfer_run(layer, q, k_pool, v_pool, window, scale)
        elif path == "invariant":
            result = self._invariant_host(q, k_pool, v_pool, window, scale)
        else:
            result = self._sdpa(layer, q, window, scale)
        if out is not None:
            out.copy_(result)
            return out
        return result

    def _path(self, layer: int, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
              out: torch.Tensor | None) -> tuple[str, torch.Tensor]:
        """The call's path and q as the kernels take it (pool dtype, unit stride in head_dim):
        ``"decode"``/``"prefill"`` (cellcache's CUDA-core kernels), ``"tc"``, ``"flashinfer"``
        or ``"sdpa"``. A fallback away from cellcache's kernels (FlashInfer, SDPA) warns once
        per cache and shape. Refusals raise before any write."""
        if self.backend == "invariant":
            return self._invariant_path(layer, q, k_pool, v_pool, out)
        if not self.kernels:
            plain = "sdpa" if self.backend == "auto" else self.backend
            if plain == "flashinfer":             # refused here, before any write (or scale set)
                from .cuda import kernels as ck

                cfg = self.view.config
                T, H, D = q.shape
                if not ck.flashinfer_supports(cfg.dtype, D, H // cfg.layers[layer].n_kv_heads):
                    raise InvalidArgument(
                        f"backend 'flashinfer': FlashInfer's paged kernels take float16/bfloat16 "
                        f"with head_dim in {ck.FLASHINFER_HEAD_DIMS}; layer {layer} has "
                        f"head_dim={D} ({cfg.dtype})")
            return plain, q
        cfg = self.view.config
        T, H, D = q.shape
        key = (self.backend, layer, H)
        route = self._routes.get(key)
        if route is None:
            route = self._routes[key] = _route(cfg, layer, H, self.backend)
        qk = q
        if route.tc or route.aligned in ("decode", "prefill", "paged", "tc"):
            qk = q.to(_TORCH_DTYPES[cfg.dtype])
            if qk.stride(2) != 1:
                qk = qk.contiguous()
        path = route.aligned
        if route.tc:
            from .cuda import kernels as ck

            tc = ck.tensor_cores()
            aligned = tc is not None and tc.aligned(
                qk.data_ptr(), (qk.stride(0), qk.stride(1)), k_pool.data_ptr(), v_pool.data_ptr(),
                out.data_ptr() if out is not None else 0,
                (out.stride(0), out.stride(1)) if out is not None else (H * D, D))
            if not aligned:
                path = route.unaligned
        group = H // cfg.layers[layer].n_kv_heads
        if path is None:
            self._refuse(D, group)
        if path == "paged":
            return ("decode" if self.decode else "prefill"), qk
        if route.chosen and (self.backend != "auto" or path != "tc"):
            _announce(self.view, layer, cfg.dtype, D, group, path)
        if path == "flashinfer" and torch.cuda.is_current_stream_capturing():
            raise InvalidState(f"layer {layer}: head_dim={D}, group={group} falls back to FlashInfer, "
                               "which plans each step on the host and cannot be captured in a graph")
        return path, (qk if path in ("decode", "prefill", "tc") else q)

    def _refuse(self, head_dim: int, group: int) -> NoReturn:
        """Raises the refusal of a shape (and addresses) no path of this backend takes."""
        from .cuda import kernels as ck

        dtype = self.view.config.dtype
        if self.backend == "tc":
            raise InvalidArgument(
                f"backend 'tc': the tensor-core kernels do not take head_dim={head_dim}, "
                f"group={group} ({dtype}) with these addresses and strides"
                + ("" if ck.tensor_cores() is not None else " (cellcache.cuda.tc is not available)"))
        ck.choose_path(dtype, head_dim, group, tc_aligned=False, have_flashinfer=have_flashinfer(),
                       has_masks=self.view.config.mask_format != "none",
                       kv8=self.view.config.kv8)   # raises its refusal
        raise AssertionError("choose_path took a shape it refused")

    def _kernel(self, layer, path, q, k_pool, v_pool, window, scale, out):
        """cellcache's decode or prefill kernel, or the tensor-core kernels, on torch's
        current stream (so a graph captures them); q is in the pool dtype with unit stride in
        head_dim. A decode step takes the tensor-core kernels' decode variant."""
        view = self.view
        lc = view.config.layers[layer]
        T, H, D = q.shape
        if out is None:
            out = torch.empty((T, H, D), dtype=_TORCH_DTYPES[view.config.dtype], device=q.device)
        if path == "tc" and self.backend == "invariant":
            # one variant for every step and no kv split: the split's count and size follow
            # the step's units, the variant its shape class
            run = functools.partial(view.tensor_cores().run, decode=INVARIANT_CLASS == "decode",
                                    split=0, fresh=not self._planned)
            self._planned = True
        elif path == "tc":
            cascade = self.cascade if window == 0 else 0
            tc = view.tensor_cores()
            if self.decode and not self.cascade and window == 0 and T > 1 and CASCADE_MIN_SHARED \
                    and self._grouping is None:
                # an eager decode forward whose rows cannot group is what a caller runs to warm
                # up before capturing the step: the capture turns grouping on, and its windowless
                # layers must find the grouped rows' scratch allocated (nothing can be allocated
                # in a capture)
                view.reserve_grouped(T, H, lc.n_kv_heads, D)
            run = functools.partial(tc.run, decode=self.decode, cascade=cascade,
                                    share=cascade > 0 and not self._shared, fresh=not self._planned,
                                    live_rows=self.live_rows)
            self._shared = self._shared or cascade > 0
            self._planned = True
            grouping = self._grouping
            if grouping is not None:
                if cascade and T > 1:                               # (one row never groups)
                    grouping.used = True
                # (told whatever the capture promises: the runner reads it from its first)
                need = tc.unsplit_rows(lc.n_kv_heads, D, decode=self.decode)
                grouping.need = max(grouping.need or 0, need)
            if view.config.kv8:
                run = functools.partial(run, kv_scale=view.kv_scales(layer).data_ptr())
        else:
            kern = view.kernels()
            run = kern.paged if path == "decode" else kern.prefill
        run(view.paged_pointers(), T, q.data_ptr(), (q.stride(0), q.stride(1)), k_pool.data_ptr(),
            v_pool.data_ptr(), out.data_ptr(), (out.stride(0), out.stride(1)), H, lc.n_kv_heads, D,
            window, torch.cuda.current_stream(q.device).cuda_stream, scale=scale)
        return out

    def _invariant_path(self, layer: int, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                        out: torch.Tensor | None) -> tuple[str, torch.Tensor]:
        """The ``"invariant"`` backend's path: ``"invariant"`` (the host's) or ``"tc"`` (CUDA,
        q in the pool dtype with unit stride in head_dim); InvalidArgument, before any
        write, for a CUDA layer the tensor-core kernels cannot run invariantly."""
        view = self.view
        if not view.cuda:
            return "invariant", q
        cfg = view.config
        T, H, D = q.shape
        reason = invariant_refusal(cfg, layer, H)
        if reason is not None:
            raise InvalidArgument(reason)
        from .cuda import kernels as ck

        tc = ck.tensor_cores()
        qk = q.to(k_pool.dtype)
        if qk.stride(2) != 1:
            qk = qk.contiguous()
        if not tc.aligned(qk.data_ptr(), (qk.stride(0), qk.stride(1)), k_pool.data_ptr(), v_pool.data_ptr(),
                          out.data_ptr() if out is not None else 0,
                          (out.stride(0), out.stride(1)) if out is not None else (H * D, D)):
            raise InvalidArgument(f"layer {layer}: backend 'invariant' runs the tensor-core kernels, "
                                  "which need 16-byte aligned q/pools/out and strides in multiples of 8")
        return "tc", qk

    def _invariant_keys(self, window: int) -> tuple[np.ndarray, np.ndarray]:
        """(cells, starts) of the step's real rows on the host: row i's visible cells in
        position order are ``cells[starts[i]:starts[i + 1]]`` (from the layer's mask and the
        table's positions; made once a step per window)."""
        keys = self._keys.get(window)
        if keys is None:
            view, step = self.view, self.step
            rows, width = step.read_len, step.width
            mask = view.masks[window][:width]
            mask = _unpack_bits(mask, rows) if view.config.mask_format == "bits" else mask[:, :rows]
            r, c = np.nonzero(mask.numpy())
            pos = view.cache.table.positions_array()[:rows]
            order = np.lexsort((pos[c], r))          # by row, then by position
            starts = np.zeros(width + 1, dtype=np.int64)
            np.cumsum(np.bincount(r, minlength=width), out=starts[1:])
            keys = self._keys[window] = (c[order], starts)
        return keys

    def _invariant_host(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                        window: int, scale: float | None) -> torch.Tensor:
        """The host's ``"invariant"`` attention: every real row on its own, its keys in
        position order from its first, in tiles of :data:`INVARIANT_TILE` (the last padded
        and masked), an online softmax in float32 in tile order. Every op runs at a shape
        set by the layer alone ([kv heads, group, tile, head_dim]), so a row's result is a
        function of its query and its keys: not of the step's rows, read length, cells or
        whether the row came in a prompt chunk or a decode step."""
        T, H, D = q.shape
        Hkv = k_pool.shape[1]
        G = H // Hkv
        KT = INVARIANT_TILE
        cells, starts = self._invariant_keys(window)
        scale = 1.0 / math.sqrt(D) if scale is None else scale
        out = torch.zeros((T, H, D), dtype=torch.float32)
        qf = q.float()
        for i in range(self.step.width):
            idx = cells[starts[i]:starts[i + 1]]
            n = idx.size
            tiles = -(-n // KT)
            padded = np.full(tiles * KT, idx[0], dtype=np.int64)
            padded[:n] = idx
            sel = torch.from_numpy(padded)
            ks = k_pool.index_select(0, sel).float().view(tiles, KT, Hkv, D).permute(0, 2, 1, 3)
            vs = v_pool.index_select(0, sel).float().view(tiles, KT, Hkv, D).permute(0, 2, 1, 3)
            qi = qf[i].view(Hkv, G, 1, D)
            m = torch.full((Hkv, G), -math.inf)
            l_sum = torch.zeros((Hkv, G))
            acc = torch.zeros((Hkv, G, D))
            for j in range(tiles):
                s = (qi * ks[j][:, None]).sum(-1) * scale                    # [Hkv, G, KT]
                if (j + 1) * KT > n:
                    s[..., n - j * KT:] = -math.inf
                m_new = torch.maximum(m, s.amax(-1))
                corr = torch.exp(m - m_new)                                   # 0 at the first tile
                p = torch.exp(s - m_new[..., None])
                l_sum = l_sum * corr + p.sum(-1)
                acc = acc * corr[..., None] + (p[..., None] * vs[j][:, None]).sum(-2)
                m = m_new
            out[i] = (acc / l_sum[..., None]).reshape(H, D)
        return out.to(k_pool.dtype)

    def _sdpa(self, layer, q, window, scale):
        view = self.view
        cfg = view.config
        T = q.shape[0]
        if view.cuda:
            rows = view.cache.rows      # backed rows: a graph captured here serves until they change
            live = view.live_rows(rows)
        else:
            rows = self.step.read_len
            live = None
        mask = view.masks[window][:T]
        if cfg.mask_format == "bits":
            mask = _unpack_bits(mask, rows)
        else:
            mask = mask[:, :rows]
        if live is not None:
            mask = mask & live
        dtype = q.dtype if q.dtype != torch.float16 or view.cuda else torch.float32
        k, v = view.dequantized(layer, slice(0, rows), dtype)
        k = k.permute(1, 0, 2)[None]                             # [1, Hkv, rows, D]
        v = v.permute(1, 0, 2)[None]
        qq = q.to(dtype).permute(1, 0, 2)[None]                  # [1, H, T, D]
        o = torch.nn.functional.scaled_dot_product_attention(
            qq, k, v, attn_mask=mask[None, None], scale=scale,
            enable_gqa=qq.shape[1] != k.shape[1])
        return o[0].permute(1, 0, 2).to(_TORCH_DTYPES[cfg.dtype])

    def _flashinfer_run(self, layer, q, k_pool, v_pool, window, scale):
        """FlashInfer's paged prefill, its wrapper planned once per step for each distinct
        (window, heads, head_dim, scale) from the step's host indptrs. 8-bit pools go through
        its bf16/fp16-query, e4m3-K/V kernels with the layer's per-kv-head scales folded in
        as its own scalar k_scale/v_scale are (q times K's scale before, the output times
        V's after: FlashInfer takes one scale a call, cellcache keeps one a kv head)."""
        view, step = self.view, self.step
        lc = view.config.layers[layer]
        T, H, D = q.shape
        q_dtype = _TORCH_DTYPES[view.config.dtype]
        key = (window, H, lc.n_kv_heads, D, scale)
        wrapper = self._flashinfer.get(key)
        if wrapper is None:
            import flashinfer

            n = step.n_requests
            dev = q.device
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(view.flashinfer_workspace(), "NHD")
            wrapper.plan(torch.as_tensor(step.qo_indptr, device=dev),
                         torch.as_tensor(step.kv_indptr, device=dev),
                         view.paged["kv_indices"], view.paged["kv_last_page_len"][:n],
                         H, lc.n_kv_heads, D, 1, causal=True, window_left=window - 1 if window else -1,
                         sm_scale=scale, q_data_type=q_dtype, kv_data_type=k_pool.dtype)
            self._flashinfer[key] = wrapper
        scales = view.kv_scales(layer)
        if scales is None:
            return wrapper.run(q.to(q_dtype).contiguous(), (k_pool[:, None], v_pool[:, None]))
        per_q = scales.repeat_interleave(H // lc.n_kv_heads, dim=1)[:, None, :, None]   # [2, 1, H, 1]
        qs = (q.float() * per_q[0]).to(q_dtype).contiguous()
        out = wrapper.run(qs, (k_pool[:, None], v_pool[:, None]))
        return (out.float() * per_q[1]).to(q_dtype)


def _announce(view: TorchView, layer: int, dtype: str, head_dim: int, group: int, path: str) -> None:
    """Warns once per (cache, shape, path) that attention leaves cellcache's kernels."""
    try:
        seen = _ANNOUNCED.setdefault(view.cache, set())
    except TypeError:                               # a cache that takes no weak reference
        seen = set()
    key = (dtype, head_dim, group, path)
    if key in seen:
        return
    seen.add(key)
    warnings.warn(f"cellcache: attention of head_dim={head_dim}, group={group} ({dtype}; layer "
                  f"{layer}) is not taken by cellcache's CUDA-core kernels (head_dim a multiple of 8 "
                  f"up to 256, group 1 to 16); it runs through {path}", stacklevel=4)


def check_qkv(view: TorchView, layer: Any, q: Any, k: Any, v: Any) -> int:
    """Checks ``q``, ``k``, ``v`` against layer ``layer`` of ``view``'s cache (shapes, head
    counts, head_dim, floating dtypes, the cache's device); returns the layer index.

    Raises InvalidArgument naming what differs. Attribute reads only: no device access.
    """
    cfg = view.config
    n = len(cfg.layers)
    i = check_int(layer, "layer", 0, n - 1)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgument(f"{name} of type {type(t).__name__} is not a torch.Tensor")
    lc = cfg.layers[i]
    T = q.shape[0] if q.ndim else -1
    if (q.ndim != 3 or k.shape != (T, lc.n_kv_heads, lc.head_dim) or v.shape != k.shape
            or q.shape[2] != lc.head_dim or q.shape[1] < 1 or q.shape[1] % lc.n_kv_heads):
        raise InvalidArgument(
            f"layer {i}: q must be [T, n_heads, {lc.head_dim}] with n_heads a multiple of "
            f"{lc.n_kv_heads}, and k, v [T, {lc.n_kv_heads}, {lc.head_dim}]; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype.is_floating_point and k.dtype.is_floating_point and v.dtype.is_floating_point):
        raise InvalidArgument(f"q, k, v must be floating point; got {q.dtype}, {k.dtype}, {v.dtype}")
    dev = view.device
    if q.device != dev or k.device != dev or v.device != dev:
        raise InvalidArgument(f"q, k, v are on {q.device}, {k.device}, {v.device}; the cache's "
                              f"buffers are on {dev}")
    return i


def _check_backend(view: TorchView, backend: str, step: Step) -> None:
    cfg = view.config
    paged_cuda = view.cuda and cfg.paged
    if backend not in BACKENDS:
        raise InvalidArgument(f"backend={backend!r} is not one of {', '.join(BACKENDS)}")
    if cfg.kv8 and backend in ("paged", "prefill", "invariant"):
        raise InvalidArgument(f"backend {backend!r} does not read 8-bit K/V pools ({cfg.kv_dtype}): "
                              "use 'auto', 'tc', 'flashinfer' or 'sdpa'")
    kernel = backend in ("paged", "prefill", "tc", "flashinfer") or (backend == "invariant" and view.cuda)
    if kernel and not (paged_cuda and step.qo_indptr is not None):
        raise InvalidArgument(f"backend {backend!r} needs a CUDA cache built with paged=True")
    if backend == "invariant" and not view.cuda and cfg.mask_format == "none":
        raise InvalidArgument("backend 'invariant' on the host reads each row's keys from the masks: "
                              "build the cache with mask_format 'bool' or 'bits'")
    if (backend == "sdpa" or (backend == "auto" and not paged_cuda)) and cfg.mask_format == "none":
        raise InvalidArgument("backend 'sdpa' needs masks (mask_format 'bool' or 'bits')")


def _unpack_bits(bits: torch.Tensor, cols: int) -> torch.Tensor:
    shifts = torch.arange(8, device=bits.device, dtype=torch.uint8)
    expanded = (bits[:, :, None] >> shifts) & 1                       # little-endian in a byte
    return expanded.reshape(bits.shape[0], -1)[:, :cols].bool()
