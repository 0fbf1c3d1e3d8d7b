"""Tensor parallelism: one cell-table decision on every rank of a ``torch.distributed`` group.

Attention is sharded by KV heads (as vLLM, SGLang and Hugging Face's ``tp_plan`` do): each
rank's pools hold only its heads, and every rank runs the same deterministic calls on a cell
table of its own; what one rank alone could see differently (a refusal, an allocation
failure, a fault) is made the same on all of them before anything changes. Three parts::

    shard.py      which heads a rank holds (local_kv_heads, local_q_heads), its cache
                  configuration (shard_config), the model sharded by its own TP plan
                  (shard_model)
    agreement.py  TPCache: a rank's cache whose every decision is agreed with the others
                  (rounds of one all_reduce, deferred digests, faults, debug comparisons)
    peers.py      the agreement's own gloo group, every wait on it bounded by the group's
                  timeout, and a rank that stops or dies named on one line

Only ``torch.distributed`` collectives are used (``all_reduce``, ``all_gather_object``), on
a gloo group of the wrapper's own. :func:`build` builds a rank's cache from
:func:`cellcache.hf.cache_config` (transformers keeps the full head counts in the model's
config), sharded for the rank.

>>> import torch.distributed as dist, cellcache.tp as tp, cellcache.hf as cchf  # doctest: +SKIP
>>> dist.init_process_group("gloo")                # under torchrun      # doctest: +SKIP
>>> model = tp.shard_model(model)                  # same weights on every rank  # doctest: +SKIP
>>> cache = tp.build("auto", "batched", cchf.cache_config(model, capacity=4096))  # doctest: +SKIP
>>> runner = cchf.attach(model, cache.local)       # the forward uses the rank's shard  # doctest: +SKIP
>>> a = cache.seq_new(); cache.declare_step([a] * 5)                     # doctest: +SKIP
>>> step = cache.prepare_step()                                          # doctest: +SKIP
>>> logits = runner.forward(step, tokens=[1, 2, 3, 4, 5]); cache.commit_step()  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from ..config import CacheConfig
from ..registry import build as build_local
from .agreement import TPCache
from .shard import group_rank, local_kv_heads, local_q_heads, shard_config, shard_model

__all__ = ["TPCache", "build", "local_kv_heads", "local_q_heads", "shard_config",
           "shard_model"]


def build(backend: str, kind: str, config: CacheConfig, group: Any = None, *,
          debug: bool = False, deferred: bool = False) -> TPCache:
    """A :class:`TPCache` over ``cellcache.build(backend, kind, shard)``, ``shard`` being
    ``config`` for this rank of ``group`` (:func:`shard_config`; ``config`` has the full
    head counts). With the CUDA backend ``config.device`` is the rank's device
    (:func:`cellcache.hf.cache_config` takes it from the model)."""
    rank, world = group_rank(group)
    return TPCache(build_local(backend, kind, shard_config(config, rank, world)), group, debug=debug,
                   deferred=deferred)
