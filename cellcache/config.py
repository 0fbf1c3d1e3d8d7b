"""Cache configuration, validated on construction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ._checks import CAPACITY_LIMIT, MAX_SEQS_LIMIT, check_int
from .errors import InvalidArgument

__all__ = ["DTYPES", "KV_DTYPES", "MASK_FORMATS", "CacheConfig", "LayerConfig", "storage_dtype"]

#: K/V storage dtypes by name.
DTYPES = ("float16", "bfloat16", "float32")
#: 8-bit K/V storage (``CacheConfig.kv_dtype``): float8 e4m3 without infinities (max 448),
#: one scale per (layer, kv head) each for K and V (docs/design/cache.md, "8-bit K/V").
KV_DTYPES = ("float8_e4m3fn",)
_KV_ALIASES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "e4m3": "float8_e4m3fn",
               "float8_e4m3fn": "float8_e4m3fn"}
#: How the per-window visibility masks are stored: one bool per (row, cell), one bit per
#: (row, cell) packed little-endian into bytes, or no masks at all (paged view only).
MASK_FORMATS = ("bool", "bits", "none")
#: Largest entry count of the paged view (its indices are int32).
MAX_KV_LIMIT = (1 << 31) - 1
#: Largest capacity with the paged view: its cell indices, the sink (= capacity) included,
#: are int32.
PAGED_CAPACITY_LIMIT = (1 << 31) - 1


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype of a K/V dtype name (bfloat16 through ml_dtypes)."""
    if name in ("bfloat16", *KV_DTYPES):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def _dtype_name(value: object) -> str:
    """A K/V dtype given as a name, a numpy dtype or a torch dtype, as its name in DTYPES."""
    name = value if isinstance(value, str) else None
    if name is None:
        try:
            name = np.dtype(value).name  # type: ignore[call-overload]
        except TypeError:
            name = str(value).removeprefix("torch.")   # torch.float16 and friends
    if name not in DTYPES:
        raise InvalidArgument(f"dtype={value!r} is not one of {', '.join(DTYPES)}")
    return name


def _kv_dtype_name(value: object, dtype: str) -> str | None:
    """``kv_dtype`` as stored: an 8-bit name or alias (``"fp8"``, ``"fp8_e4m3"``, ``"e4m3"``,
    torch's ``float8_e4m3fn``) is ``"float8_e4m3fn"``; None and ``dtype``'s own name are None
    (K/V stored in ``dtype``, so a copy with another ``dtype`` stays consistent)."""
    if value is None:
        return None
    name = value if isinstance(value, str) else str(value).removeprefix("torch.")
    if name in _KV_ALIASES:
        return _KV_ALIASES[name]
    if name == dtype:
        return None
    raise InvalidArgument(f"kv_dtype={value!r} is not None (the dtype, {dtype}) or one of "
                          f"{', '.join(KV_DTYPES)} (or fp8, fp8_e4m3, e4m3)")


@dataclass(frozen=True)
class LayerConfig:
    """One attention layer's K/V shape and window (0 = full history).

    Example
    -------
    >>> LayerConfig(n_kv_heads=8, head_dim=128, window=4096)
    LayerConfig(n_kv_heads=8, head_dim=128, window=4096)
    """

    n_kv_heads: int
    head_dim: int
    window: int = 0

    def __post_init__(self):
        object.__setattr__(self, "n_kv_heads", check_int(self.n_kv_heads, "n_kv_heads", 1, 1 << 16))
        object.__setattr__(self, "head_dim", check_int(self.head_dim, "head_dim", 1, 1 << 16))
        object.__setattr__(self, "window", check_int(self.window, "window", 0, CAPACITY_LIMIT))

    @property
    def row_elems(self) -> int:
        """Elements of one token's K (or V) in this layer."""
        return self.n_kv_heads * self.head_dim


@dataclass(frozen=True)
class CacheConfig:
    """What a cache is built from.

    - ``capacity``: cells in the table, the most rows a pool can grow to (>= 1).
    - ``layers``: one :class:`LayerConfig` per attention layer.
    - ``max_write``: widest step (and widest padded step), ``1 <= max_write <= capacity``.
    - ``initial_capacity``: pool rows at the first step, clamped to ``[1, capacity]``.
    - ``dtype``: K/V storage, ``"float16"``, ``"bfloat16"`` or ``"float32"`` (a numpy or
      torch dtype of those names is accepted and stored as its name); with ``kv_dtype``
      the dtype attention takes q in and returns its output in.
    - ``kv_dtype``: None (K/V stored in ``dtype``) or ``"float8_e4m3fn"`` (aliases ``"fp8"``,
      ``"fp8_e4m3"``, ``"e4m3"``): K/V stored in 8 bits with a scale per (layer, kv head),
      half the bytes a cell of a 16-bit dtype takes; stored as its name (None when K/V are
      stored in ``dtype``: None or ``dtype``'s own name given).
    - ``max_seqs``: sequence ids are ``[0, max_seqs)``.
    - ``device``: CUDA device ordinal (the CUDA backend).
    - ``paged``: also build the paged view (FlashInfer's page-size-1 CSR buffers); its
      indices are int32, so ``capacity`` is then at most ``2**31 - 1``.
    - ``max_kv``: entries of the paged view's ``kv_indices`` a step may use (default
      ``4 * capacity + max_write``; ``max_kv + max_write`` at most ``2**31 - 1``); a wider
      step is refused at ``declare_step`` with :class:`StepTooLarge`.
    - ``mask_format``: ``"bool"`` (``mask_w{W}`` of shape ``[1, 1, max_write, capacity]``),
      ``"bits"`` (uint8 ``[max_write, ceil(capacity / 8)]``, bit j of a row = column j,
      little-endian) or ``"none"`` (no masks; with ``paged=True`` for kernels that read the
      view).

    Invalid fields raise ``InvalidArgument`` naming the field and the accepted range.

    Example
    -------
    >>> cfg = CacheConfig(capacity=1 << 16, layers=[LayerConfig(8, 128), LayerConfig(8, 128, 4096)],
    ...                   max_write=256)
    >>> cfg.windows
    (0, 4096)
    """

    capacity: int
    layers: Sequence[LayerConfig]
    max_write: int
    initial_capacity: int = 512
    dtype: str = "bfloat16"
    max_seqs: int = 64
    device: int = 0
    paged: bool = False
    max_kv: int = None  # type: ignore[assignment]  # None: the default, resolved below
    mask_format: str = "bool"
    kv_dtype: str | None = None
    _windows: tuple = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self):
        cap = check_int(self.capacity, "capacity", 1, CAPACITY_LIMIT)
        object.__setattr__(self, "capacity", cap)
        if isinstance(self.layers, (str, bytes)) or not isinstance(self.layers, Sequence):
            raise InvalidArgument(
                f"layers of type {type(self.layers).__name__} is not a sequence of LayerConfig")
        layers = tuple(self.layers)
        if not layers:
            raise InvalidArgument("layers is empty; give at least one LayerConfig")
        for i, layer in enumerate(layers):
            if not isinstance(layer, LayerConfig):
                raise InvalidArgument(f"layers[{i}]={layer!r} is not a LayerConfig")
        object.__setattr__(self, "layers", layers)
        mw = check_int(self.max_write, "max_write", 1, cap)
        object.__setattr__(self, "max_write", mw)
        initial = check_int(self.initial_capacity, "initial_capacity", -(1 << 62), 1 << 62)
        object.__setattr__(self, "initial_capacity", min(max(initial, 1), cap))
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        object.__setattr__(self, "kv_dtype", _kv_dtype_name(self.kv_dtype, self.dtype))
        object.__setattr__(self, "max_seqs", check_int(self.max_seqs, "max_seqs", 1, MAX_SEQS_LIMIT))
        object.__setattr__(self, "device", check_int(self.device, "device", 0, 1 << 16))
        if not isinstance(self.paged, (bool, np.bool_)):
            raise InvalidArgument(f"paged of type {type(self.paged).__name__} is not a bool")
        object.__setattr__(self, "paged", bool(self.paged))
        if self.paged:
            # the paged view stores cells (the sink = capacity too) and offsets as int32
            if cap > PAGED_CAPACITY_LIMIT:
                raise InvalidArgument(
                    f"capacity={cap} is outside [1, 2**31 - 1] with paged=True (the paged "
                    "view's cell indices are int32)")
            if mw > MAX_KV_LIMIT - 1:
                raise InvalidArgument(
                    f"max_write={mw} is outside [1, 2**31 - 2] with paged=True (max_kv + "
                    "max_write entries must fit int32)")
        if self.max_kv is None:
            max_kv = max(1, min(MAX_KV_LIMIT - mw, 4 * cap + mw))
        else:
            max_kv = check_int(self.max_kv, "max_kv", 1, max(1, MAX_KV_LIMIT - mw))
        object.__setattr__(self, "max_kv", max_kv)
        if self.mask_format not in MASK_FORMATS:
            raise InvalidArgument(
                f"mask_format={self.mask_format!r} is not one of {', '.join(MASK_FORMATS)}")
        object.__setattr__(self, "_windows", tuple(sorted({layer.window for layer in layers})))

    @property
    def windows(self) -> tuple[int, ...]:
        """The distinct windows, ascending: one mask buffer each (unless ``mask_format`` is
        ``"none"``)."""
        return self._windows

    @property
    def np_dtype(self) -> np.dtype:
        """The pools' numpy dtype (``kv_dtype``'s)."""
        return storage_dtype(self.kv_dtype or self.dtype)

    @property
    def kv8(self) -> bool:
        """Whether K/V are stored in 8 bits (with per-(layer, kv head) scales)."""
        return self.kv_dtype in KV_DTYPES
