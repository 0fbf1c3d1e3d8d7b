"""Cache configuration (SPEC §2), validated on construction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ._checks import check_int
from .errors import InvalidArgument

__all__ = ["DTYPES", "CacheConfig", "LayerConfig", "storage_dtype"]

#: K/V storage dtypes by name.
DTYPES = ("float16", "bfloat16", "float32")

MAX_SEQS_LIMIT = 1 << 20
CAPACITY_LIMIT = 1 << 40


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype of a K/V dtype name (bfloat16 through ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


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
    """What a cache is built from (SPEC §2).

    ``initial_capacity`` is clamped to ``[1, capacity]``. Invalid fields raise
    ``InvalidArgument`` naming the field and the accepted range.

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
    _windows: tuple = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self):
        cap = check_int(self.capacity, "capacity", 1, CAPACITY_LIMIT)
        object.__setattr__(self, "capacity", cap)
        if isinstance(self.layers, (str, bytes)) or not isinstance(self.layers, Sequence):
            raise InvalidArgument(
                f"layers={self.layers!r} is not a sequence of LayerConfig")
        layers = tuple(self.layers)
        if not layers:
            raise InvalidArgument("layers is empty; give at least one LayerConfig")
        for i, layer in enumerate(layers):
            if not isinstance(layer, LayerConfig):
                raise InvalidArgument(f"layers[{i}]={layer!r} is not a LayerConfig")
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "max_write", check_int(self.max_write, "max_write", 1, cap))
        initial = check_int(self.initial_capacity, "initial_capacity", -(1 << 62), 1 << 62)
        object.__setattr__(self, "initial_capacity", min(max(initial, 1), cap))
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")
        object.__setattr__(self, "max_seqs", check_int(self.max_seqs, "max_seqs", 1, MAX_SEQS_LIMIT))
        object.__setattr__(self, "device", check_int(self.device, "device", 0, 1 << 16))
        object.__setattr__(self, "_windows", tuple(sorted({layer.window for layer in layers})))

    @property
    def windows(self) -> tuple[int, ...]:
        """The distinct windows, ascending: one mask buffer each."""
        return self._windows

    @property
    def np_dtype(self) -> np.dtype:
        return storage_dtype(self.dtype)
