"""The shard of a model and of its cache over the ranks of a ``torch.distributed`` group.

Attention is sharded by KV heads (as vLLM, SGLang and Hugging Face's ``tp_plan`` do): rank r
of ``world`` holds the KV heads :func:`local_kv_heads` gives (divided, or one replicated head
when there are fewer heads than ranks) and computes the query heads :func:`local_q_heads`
gives, which only read those KV heads. :func:`shard_config` is a cache configuration with
each layer's KV heads cut to the rank's; everything that decides the cell table (capacity,
widths, windows, masks) stays the same, so every rank's table takes the same decisions.

The model side: :func:`shard_model` applies the model's own tensor-parallel plan from
transformers (``base_model_tp_plan``: q/k/v colwise, o rowwise, MLP colwise/rowwise, the
embedding and the head over the vocabulary), so the attention function that
:func:`cellcache.hf.attach` registers receives each rank's local heads
(``q [1, H / world, T, D]``, ``k/v [1, H_kv / world, T, D]``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist

from .._checks import check_int
from ..config import CacheConfig, LayerConfig
from ..errors import InvalidArgument, InvalidState

__all__ = ["group_rank", "local_kv_heads", "local_q_heads", "shard_config", "shard_model"]


def _check_rank(rank: int, world: int) -> tuple[int, int]:
    world = check_int(world, "world", 1, 1 << 20)
    return check_int(rank, "rank", 0, world - 1), world


def local_kv_heads(n_kv_heads: int, rank: int, world: int) -> range:
    """The KV heads ``rank`` of ``world`` holds.

    With ``n_kv_heads >= world`` the heads are divided: ``n_kv_heads % world == 0`` is
    required and rank r holds heads ``[r * n, (r + 1) * n)``, ``n = n_kv_heads // world``.
    With fewer KV heads than ranks each head is replicated, as vLLM does:
    ``world % n_kv_heads == 0`` is required and rank r holds the one head
    ``r * n_kv_heads // world`` (ranks ``[h * world / n_kv_heads, (h + 1) * world /
    n_kv_heads)`` share head h). Anything else raises InvalidArgument.

    >>> local_kv_heads(8, 1, 4), local_kv_heads(2, 3, 4)
    (range(2, 4), range(1, 2))
    """
    rank, world = _check_rank(rank, world)
    n_kv_heads = check_int(n_kv_heads, "n_kv_heads", 1, 1 << 16)
    if n_kv_heads >= world:
        if n_kv_heads % world:
            raise InvalidArgument(
                f"n_kv_heads={n_kv_heads} cannot be divided over {world} ranks: give a world size "
                f"that divides it, or one that is a multiple of it (each head then replicated)")
        per = n_kv_heads // world
        return range(rank * per, (rank + 1) * per)
    if world % n_kv_heads:
        raise InvalidArgument(
            f"n_kv_heads={n_kv_heads} cannot be replicated over {world} ranks: the world size must "
            f"be a multiple of it (or divide it)")
    head = rank * n_kv_heads // world
    return range(head, head + 1)


def local_q_heads(n_heads: int, n_kv_heads: int, rank: int, world: int) -> range:
    """The query heads ``rank`` computes: ``[r * n, (r + 1) * n)``, ``n = n_heads // world``
    (``n_heads % world == 0`` required). Query head h reads KV head ``h // (n_heads //
    n_kv_heads)``, which is always one of :func:`local_kv_heads` (the rank's q heads are its
    KV heads' groups, or a part of its one replicated head's group).

    >>> local_q_heads(32, 8, 1, 4), local_q_heads(32, 2, 3, 4)
    (range(8, 16), range(24, 32))
    """
    rank, world = _check_rank(rank, world)
    n_heads = check_int(n_heads, "n_heads", 1, 1 << 16)
    kv = local_kv_heads(n_kv_heads, rank, world)
    if n_heads % n_kv_heads:
        raise InvalidArgument(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
    if n_heads % world:
        raise InvalidArgument(f"n_heads={n_heads} cannot be divided over {world} ranks")
    per, group = n_heads // world, n_heads // n_kv_heads
    heads = range(rank * per, (rank + 1) * per)
    assert heads[0] // group >= kv.start and heads[-1] // group < kv.stop
    return heads


def shard_config(config: CacheConfig, rank: int, world: int) -> CacheConfig:
    """``config`` for ``rank`` of ``world``: each layer's ``n_kv_heads`` becomes
    ``len(local_kv_heads(n_kv_heads, rank, world))`` (divided, or 1 when replicated);
    everything else (capacity, max_write, max_seqs, windows, max_kv, dtype, masks, paged)
    is identical, so every rank's cell table takes the same decisions. InvalidArgument when
    a layer's heads cannot be divided or replicated over ``world``.

    >>> cfg = CacheConfig(capacity=64, layers=[LayerConfig(4, 8), LayerConfig(4, 8, 16)], max_write=8)
    >>> [layer.n_kv_heads for layer in shard_config(cfg, 0, 2).layers]
    [2, 2]
    """
    if not isinstance(config, CacheConfig):
        raise InvalidArgument(f"config of type {type(config).__name__} is not a CacheConfig")
    layers = [LayerConfig(len(local_kv_heads(layer.n_kv_heads, rank, world)), layer.head_dim,
                          layer.window) for layer in config.layers]
    return dataclasses.replace(config, layers=layers)


def group_rank(group: Any) -> tuple[int, int]:
    """(rank, world size) of this process in ``group`` (None: the default group);
    InvalidState when no process group is initialized."""
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidState("torch.distributed is not initialized: call "
                           "torch.distributed.init_process_group() first (torchrun sets the rendezvous)")
    return dist.get_rank(group), dist.get_world_size(group)


# -- the model --------------------------------------------------------------------------------
def shard_model(model: Any) -> Any:
    """Shards a transformers model in place over the whole ``torch.distributed`` world with
    the model's own tensor-parallel plan (``base_model_tp_plan``), through transformers'
    ``prepare_distribute_model`` / ``maybe_distribute_model``; returns it.

    Every rank must hold the same weights (a checkpoint, or a ``from_config`` model built
    with the same seed): each keeps its shard of its own copy, nothing is sent. The model
    must be on the device transformers' mesh uses (the accelerator, ``cuda:LOCAL_RANK``
    under torchrun; else the CPU with gloo). The attention heads and the KV heads must
    divide by the world size (transformers' plan splits ``k_proj``/``v_proj`` by rows, so
    it cannot replicate a KV head). For a checkpoint too large for one process,
    ``from_pretrained(path, distributed_config=DistributedConfig(tp_size=world))``
    (transformers with accelerate installed) loads each rank's shard directly.

    Raises InvalidArgument (not a transformers model, heads that do not divide, a model on
    another device than the mesh) or InvalidState (no process group; a transformers without
    its distributed API).
    """
    _, world = group_rank(None)
    cls = type(model)
    if not (callable(getattr(cls, "prepare_distribute_model", None))
            and callable(getattr(cls, "maybe_distribute_model", None))):
        import transformers

        raise InvalidState(
            f"{cls.__name__} has no prepare_distribute_model/maybe_distribute_model: transformers "
            f"{transformers.__version__} lacks the distributed API (transformers.distributed) this "
            "needs; install a newer transformers")
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    heads = getattr(cfg, "num_attention_heads", None)
    if not isinstance(heads, int):
        raise InvalidArgument(f"model of type {cls.__name__} has no num_attention_heads in its config")
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if heads % world or kv % world:
        raise InvalidArgument(
            f"{heads} attention heads and {kv} KV heads cannot both be divided over {world} ranks: "
            "transformers' plan shards k_proj/v_proj by rows and cannot replicate a KV head")
    accelerator = getattr(torch, "accelerator", None)       # torch >= 2.6; before: CUDA or CPU
    if accelerator is not None:
        found = accelerator.current_accelerator() if accelerator.is_available() else None
        mesh_type = found.type if found is not None else "cpu"
    else:
        mesh_type = "cuda" if torch.cuda.is_available() else "cpu"
    device = getattr(model, "device", None)
    if isinstance(device, torch.device) and device.type != mesh_type:
        raise InvalidArgument(f"the model is on {device}; transformers builds its mesh on "
                              f"{mesh_type}: move the model there first")
    if world == 1:
        return model
    from transformers.distributed import DistributedConfig

    # transformers reads the accelerator index from LOCAL_RANK, which torchrun sets, and binds
    # the process to that device; a group joined otherwise (mp.spawn + init_process_group)
    # has none: the model's own device then, for the whole sharding (a read defaulting to 0
    # would move rank 1's current device to GPU 0: graphs captured on the wrong device's
    # stream, two ranks' communicators on one GPU)
    added = mesh_type != "cpu" and "LOCAL_RANK" not in os.environ
    index = device.index if isinstance(device, torch.device) and device.index is not None else None
    current = torch.cuda.current_device() if mesh_type == "cuda" else None
    if added:
        os.environ["LOCAL_RANK"] = str(index if index is not None else current)
    try:
        dconfig, _device_map, mesh = cls.prepare_distribute_model(DistributedConfig(tp_size=world))
        model = cls.maybe_distribute_model(model, dconfig, mesh)
    finally:
        if added:
            del os.environ["LOCAL_RANK"]
    if mesh_type == "cuda" and index is not None and torch.cuda.current_device() != index:
        torch.cuda.set_device(index)             # the rank's current device is its model's
    return model
