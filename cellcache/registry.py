"""Backends and kinds by name: ``build(backend, kind, config)``.

The registry knows the built-in builders by module path and imports them only when asked,
so ``import cellcache`` loads nothing of the CUDA backend; ``"auto"`` asks the ctypes probe
:func:`cellcache.cuda.probe.cuda_usable`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from .config import CacheConfig
from .errors import InvalidArgument, InvalidState

__all__ = ["build", "register_builder", "registered", "resolve_backend"]

Builder = Callable[[CacheConfig], Any]
_KINDS = ("batched-cell", "batched")
# built-in builders as "module:attribute", imported on first use
_BUILDERS: dict[tuple[str, str], Builder | str] = {
    **{("host", kind): "cellcache.host:HostCellCache" for kind in _KINDS},
    **{("cuda", kind): "cellcache.cuda.backend:CudaCellCache" for kind in _KINDS},
}


def _check_name(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{name} of type {type(value).__name__} is not a non-empty string"
                              if not isinstance(value, str) else f"{name} is an empty string")
    return value


def register_builder(backend: str, kind: str, fn: Builder) -> None:
    """Registers ``fn(config) -> cache`` for (backend, kind). Insertion only: a pair that is
    already registered raises InvalidArgument."""
    _check_name("backend", backend)
    _check_name("kind", kind)
    if backend == "auto":
        raise InvalidArgument("backend 'auto' is reserved: it picks cuda or host")
    if not callable(fn):
        raise InvalidArgument(f"builder of type {type(fn).__name__} is not callable")
    if (backend, kind) in _BUILDERS:
        raise InvalidArgument(
            f"a builder for backend {backend!r}, kind {kind!r} is already registered; "
            f"registered: {_describe()}")
    _BUILDERS[(backend, kind)] = fn


def registered() -> dict[str, list[str]]:
    """Registered kinds by backend."""
    out: dict[str, list[str]] = {}
    for backend, kind in _BUILDERS:
        out.setdefault(backend, []).append(kind)
    return out


def _describe() -> str:
    return "; ".join(f"{b}: {', '.join(k)}" for b, k in registered().items())


def resolve_backend(backend: str) -> str:
    """'auto' becomes 'cuda' when a CUDA device is usable here, else 'host'."""
    _check_name("backend", backend)
    if backend == "auto":
        from .cuda.probe import cuda_usable

        return "cuda" if cuda_usable()[0] else "host"
    return backend


def build(backend: str, kind: str, config: CacheConfig) -> Any:
    """Builds a cache: backend 'cuda', 'host' or 'auto' (cuda when a device is usable);
    kind 'batched-cell' or 'batched' (both this library's batched cell layout).

    'cuda' where CUDA is not usable (no cuda-bindings, driver or device, or cuda-bindings
    newer than the driver) raises CudaError with the probe's one-line reason."""
    _check_name("kind", kind)
    name = resolve_backend(backend)
    kinds = registered()
    if name not in kinds:
        raise InvalidArgument(
            f"unknown backend {backend!r}; registered backends: auto, {', '.join(kinds)}")
    if (name, kind) not in _BUILDERS:
        raise InvalidArgument(
            f"unknown kind {kind!r} for backend {name!r}; its kinds: {', '.join(kinds[name])}")
    builder = _BUILDERS[(name, kind)]
    if name == "cuda" and backend != "auto":
        from .cuda.probe import require_cuda

        require_cuda()    # CudaError with the probe's reason, before any CUDA module loads
    if isinstance(builder, str):
        module, attr = builder.split(":")
        try:
            builder = getattr(importlib.import_module(module), attr)
        except ImportError as e:
            raise InvalidState(f"backend {name!r} cannot be loaded here: {e}") from e
    return builder(config)
