"""A :class:`~cellcache.generate.Generator`'s arguments, checked and turned into what it
serves with, before anything is built or switched::

    settings(...)       budget, prompt chunk, reserve, clock, eos, async_steps (its own)
    serving(...)        tp, cache, admission, prefix_cache, max_seqs checked together:
                        the world, the cache and prefix cache given or what to build them
                        with
    serving_cache(...)  the model sharded under tensor parallelism, the cache and the
                        prefix cache built from them

Every refusal is an InvalidArgument raised before the model is sharded or a cache is built;
the runner's options (``graphs``, ``buckets``, ``compile``, ``attention``) are the runner's
to check (:func:`cellcache.runner.check_options`, :func:`cellcache.hf.attach`).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._checks import check_int
from ..cache import CellCache
from ..config import _KV_ALIASES, _kv_dtype_name
from ..errors import InvalidArgument
from ..hf import cache_config
from ..prefix import PrefixCache
from ..registry import build
from ..tp import TPCache, shard_model
from ..tp import build as tp_build
from .distributed import is_sharded, tp_world
from .requests import MAX_STOPS, real_number, token_ids
from .scheduler import ADMISSION_POLICIES

__all__ = ["CPU_BATCH_TOKENS", "CPU_PREFILL_CHUNK", "CUDA_BATCH_TOKENS", "CUDA_PREFILL_CHUNK",
           "PREFIX_OPTIONS", "Serving", "serving", "serving_cache", "settings"]

#: Default token budget a step (``max_batch_tokens``) and prompt chunk on a GPU (wide enough
#: to keep the device busy through the prefill kernels); the CPU defaults stay small.
CUDA_BATCH_TOKENS, CUDA_PREFILL_CHUNK = 8192, 2048
CPU_BATCH_TOKENS, CPU_PREFILL_CHUNK = 512, 256
#: The keys a mapping given as ``prefix_cache`` may hold.
PREFIX_OPTIONS = ("policy", "max_seqs", "on_event")


def settings(model: Any, capacity: Any, max_batch_tokens: int | None, prefill_chunk: Any,
              reserve: Any, clock: Any, eos: Sequence[int] | None, async_steps: Any
              ) -> tuple[int, int, float, list[int]]:
    """The Generator's own settings checked (InvalidArgument), defaults filled in from the
    model's device and generation config: (max_batch_tokens, prefill_chunk, reserve, eos)."""
    if async_steps is not None and not isinstance(async_steps, (bool, np.bool_)):
        raise InvalidArgument(f"async_steps of type {type(async_steps).__name__} is not a bool or None")
    on_cuda = getattr(getattr(model, "device", None), "type", "cpu") == "cuda"
    if max_batch_tokens is None:
        try:                                  # (any int type: capacity is checked later)
            cap = operator.index(capacity) if not isinstance(capacity, (bool, np.bool_)) else 0
        except TypeError:
            cap = 0
        max_batch_tokens = min(CUDA_BATCH_TOKENS if on_cuda else CPU_BATCH_TOKENS, cap) \
            if cap > 0 else CPU_BATCH_TOKENS
    if prefill_chunk is None:
        prefill_chunk = CUDA_PREFILL_CHUNK if on_cuda else CPU_PREFILL_CHUNK
    prefill_chunk = check_int(prefill_chunk, "prefill_chunk", 1)
    reserve = real_number(reserve, "reserve")
    if not 0 <= reserve <= 1:
        raise InvalidArgument(f"reserve={reserve} is outside [0, 1]")
    if clock is not None and not callable(clock):
        raise InvalidArgument(f"clock of type {type(clock).__name__} is not callable or None")
    if eos is None:
        eos_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = [eos_id] if isinstance(eos_id, int) else list(eos_id or [])
    return max_batch_tokens, prefill_chunk, reserve, token_ids(eos, "eos", None, allow_empty=True,
                                                               limit=MAX_STOPS)


@dataclasses.dataclass(frozen=True)
class Serving:
    """The memory side of a Generator's arguments, checked: the tensor-parallel world (None
    in one process), the cache given (or the prefix cache's; None: build one), the prefix
    cache given, or the options to build one with (None: no prefix cache built), and the
    ids for running sequences when the cache is built."""

    world: int | None
    cache: CellCache | TPCache | None
    prefix: PrefixCache | None
    prefix_options: dict[str, Any] | None
    max_seqs: Any


def serving(tp: Any, cache: Any, admission: Any, prefix_cache: Any, max_seqs: Any) -> Serving:
    """Checks ``tp``, ``cache``, ``admission``, ``prefix_cache`` and ``max_seqs`` together
    (InvalidArgument) before the model is sharded or anything is built."""
    # -- tensor parallelism (cellcache.generate.distributed): shard, build over the ranks --
    world = tp_world(tp if tp is not None or not isinstance(cache, TPCache) else True)
    if world is not None:
        if cache is not None and not isinstance(cache, TPCache):
            raise InvalidArgument(f"with tp={tp!r} the cache must be a cellcache.tp.TPCache "
                                  f"(or None: built here), not {type(cache).__name__}")
    elif isinstance(cache, TPCache):
        raise InvalidArgument(f"a TPCache needs tp=True (its world has {cache.world} ranks)")
    # -- end tensor parallelism --
    if cache is not None and not isinstance(cache, (CellCache, TPCache)):
        raise InvalidArgument(f"cache of type {type(cache).__name__} is not a cellcache cache")
    if not isinstance(admission, str) or admission not in ADMISSION_POLICIES:
        raise InvalidArgument(f"admission={admission!r} is not one of {', '.join(ADMISSION_POLICIES)}")
    prefix_opts: dict[str, Any] | None = None
    given: PrefixCache | None = None
    if isinstance(prefix_cache, PrefixCache):
        given = prefix_cache
        if cache is None and isinstance(given.cache, (CellCache, TPCache)):
            cache = given.cache
        if given.cache is not cache:
            raise InvalidArgument("prefix_cache is a PrefixCache over another cache; give one "
                                  "over this Generator's cache (or True to have it built)")
    elif isinstance(prefix_cache, (bool, np.bool_)):
        prefix_opts = {} if prefix_cache else None
    elif isinstance(prefix_cache, Mapping):
        prefix_opts = dict(prefix_cache)
        unknown = sorted(str(k) for k in prefix_opts if k not in PREFIX_OPTIONS)
        if unknown:
            raise InvalidArgument(f"prefix_cache options {', '.join(unknown)} are unknown; "
                                  f"give {', '.join(PREFIX_OPTIONS)}")
        if "max_seqs" in prefix_opts:
            prefix_opts["max_seqs"] = check_int(prefix_opts["max_seqs"], "prefix_cache max_seqs", 1)
    else:
        raise InvalidArgument(f"prefix_cache of type {type(prefix_cache).__name__} is not a bool, "
                              "a mapping of PrefixCache options or a PrefixCache")
    if cache is None:
        max_seqs = check_int(max_seqs, "max_seqs", 1)
    return Serving(world, cache, given, prefix_opts, max_seqs)


def check_kv8(kv_dtype: Any, s: Serving, deterministic: bool) -> None:
    """Refuses, before anything is built, what does not serve 8-bit K/V (``kv_dtype`` an
    8-bit name, or a given cache with 8-bit pools): the deterministic mode (its kernels read
    16-bit pools) and tensor parallelism (not built yet)."""
    name = kv_dtype if isinstance(kv_dtype, str) else str(kv_dtype).removeprefix("torch.")
    kv8 = (kv_dtype is not None and name in _KV_ALIASES) or bool(
        getattr(getattr(s.cache, "config", None), "kv8", False))
    if not kv8:
        return
    for bad, why in ((deterministic, "deterministic=True (its kernels read 16-bit pools)"),
                     (s.world is not None, "tensor parallelism (not built yet)")):
        if bad:
            raise InvalidArgument(f"8-bit K/V does not serve with {why}: leave kv_dtype None")


def serving_cache(model: Any, capacity: int, max_batch_tokens: int, s: Serving,
                  kv_dtype: Any = None) -> tuple[Any, CellCache | TPCache, PrefixCache | None]:
    """The model (sharded under tensor parallelism), the cache (given, or built for the
    model, with K/V stored in ``kv_dtype``) and the prefix cache (or None) a Generator
    serves with, from its checked arguments."""
    if s.cache is not None and kv_dtype is not None:
        cfg = s.cache.config
        if _kv_dtype_name(kv_dtype, cfg.dtype) != cfg.kv_dtype:
            raise InvalidArgument(f"kv_dtype={kv_dtype!r} differs from the given cache's "
                                  f"({cfg.kv_dtype or cfg.dtype}); leave it None with a cache given")
    if s.world is not None and not is_sharded(model):   # every argument checked: sharding is for good
        model = shard_model(model)
    cache, prefix_opts = s.cache, s.prefix_options
    if cache is None:
        ids = s.max_seqs
        if prefix_opts is not None:
            prefix_opts.setdefault("max_seqs", s.max_seqs)
            ids += prefix_opts["max_seqs"]
        extra = {} if kv_dtype is None else {"kv_dtype": kv_dtype}
        cfg = cache_config(model, capacity=capacity, max_write=max_batch_tokens, max_seqs=ids, **extra)
        backend = "cuda" if model.device.type == "cuda" else "host"
        cache = build(backend, "batched", cfg) if s.world is None else tp_build(backend, "batched", cfg)
    if prefix_opts is None:
        return model, cache, s.prefix
    if "max_seqs" not in prefix_opts:               # half the ids nobody holds yet
        left = cache.max_seqs - len(cache.live_seqs())
        prefix_opts["max_seqs"] = max(1, left // 2)
    prefix_opts["max_seqs"] = min(prefix_opts["max_seqs"], cache.max_seqs)
    return model, cache, PrefixCache(cache, **prefix_opts)   # (refused before the model is touched)
