"""Backends and kinds by name: ``build(backend, kind, config)``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from .config import CacheConfig
from .errors import InvalidArgument

__all__ = ["build", "register_builder", "registered"]

Builder = Callable[[CacheConfig], Any]
_BUILDERS: dict[tuple[str, str], Builder] = {}
_cuda_probe: Callable[[], bool] | None = None


def register_builder(backend: str, kind: str, fn: Builder) -> None:
    """Registers ``fn(config) -> cache`` for (backend, kind). Insertion only: a pair that is
    already registered raises InvalidArgument."""
    for name, value in (("backend", backend), ("kind", kind)):
        if not isinstance(value, str) or not value:
            raise InvalidArgument(f"{name}={value!r} is not a non-empty string")
    if backend == "auto":
        raise InvalidArgument("backend 'auto' is reserved: it picks cuda or host")
    if not callable(fn):
        raise InvalidArgument(f"builder {fn!r} is not callable")
    if (backend, kind) in _BUILDERS:
        raise InvalidArgument(
            f"a builder for backend {backend!r}, kind {kind!r} is already registered; "
            f"registered: {_describe()}")
    _BUILDERS[(backend, kind)] = fn


def set_cuda_probe(probe: Callable[[], bool]) -> None:
    """How ``auto`` decides that a CUDA device is usable (set by the CUDA backend)."""
    global _cuda_probe
    _cuda_probe = probe


def registered() -> dict[str, list[str]]:
    """Registered kinds by backend."""
    out: dict[str, list[str]] = {}
    for backend, kind in _BUILDERS:
        out.setdefault(backend, []).append(kind)
    return out


def _describe() -> str:
    return "; ".join(f"{b}: {', '.join(k)}" for b, k in registered().items())


def resolve_backend(backend: str) -> str:
    """'auto' becomes 'cuda' when a CUDA device is usable, else 'host'."""
    if backend == "auto":
        if ("cuda" in registered()) and _cuda_probe is not None and _cuda_probe():
            return "cuda"
        return "host"
    return backend


def build(backend: str, kind: str, config: CacheConfig) -> Any:
    """Builds a cache: backend 'cuda', 'host' or 'auto'; kind 'batched-cell' or 'batched'."""
    name = resolve_backend(backend)
    kinds = registered()
    if name not in kinds:
        raise InvalidArgument(
            f"unknown backend {backend!r}; registered backends: auto, {', '.join(kinds)}")
    if (name, kind) not in _BUILDERS:
        raise InvalidArgument(
            f"unknown kind {kind!r} for backend {name!r}; its kinds: {', '.join(kinds[name])}")
    return _BUILDERS[(name, kind)](config)


def _register_defaults() -> None:
    from .host import HostCellCache

    for kind in ("batched-cell", "batched"):
        register_builder("host", kind, HostCellCache)
    # The CUDA backend registers itself when its module imports (cuda-bindings present);
    # whether a device is usable is decided later, by the probe, when 'auto' is resolved.
    try:
        backend = importlib.import_module("cellcache.cuda.backend")
    except ImportError:
        return
    backend.register()
