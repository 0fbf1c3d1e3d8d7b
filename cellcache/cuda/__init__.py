"""The CUDA backend: ``CudaCellCache`` through the raw driver API (cuda-bindings).

Nothing here imports cuda-bindings until a CUDA cache (or driver module) is asked for;
:func:`cellcache.cuda.probe.cuda_usable` answers "is it usable here" with ctypes alone.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CudaCellCache", "cuda_usable"]


def __getattr__(name: str) -> Any:
    if name == "CudaCellCache":
        from .backend import CudaCellCache

        return CudaCellCache
    if name == "cuda_usable":
        from .probe import cuda_usable

        return cuda_usable
    raise AttributeError(f"module 'cellcache.cuda' has no attribute {name!r}")
