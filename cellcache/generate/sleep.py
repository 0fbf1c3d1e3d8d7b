"""Sleep and wake of a Generator: its GPU memory given back between uses (an RL trainer
sharing the GPU with the rollouts) and taken again without rebuilding anything.

::

    sleep(1)   prefix cache dropped (its K/V would be lost; keep_prefixes: evicted into the
               host level first) -> cache.sleep(): the pools' memory unmapped, their
               addresses kept -> torch's cached blocks freed
    sleep(2)   level 1, and the model's weights and buffers copied to pinned host memory
               (their device memory freed; the runner's graphs, which read them, dropped)
    wake()     weights back to the device (level 2: new addresses, graphs recaptured at
               first use) -> cache.wake(): fresh memory at the pools' old addresses, so
               level 1's graphs replay as captured

A wake that runs out of memory leaves everything asleep as it was. The pools' K/V is never
kept: a sleep happens between uses, with nothing running, and a prefix cache starts empty
after it (so weights changed while asleep are never met by stale K/V; :meth:`Generator.
reset_prefix_cache` does the same for weights changed while awake). ``keep_prefixes`` is
for weights that stay: the prefixes wait in the host level and come back at the turns that
extend them.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import OutOfMemory

__all__ = ["OffloadedWeights", "offload_weights"]


def _view(base: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``like``'s view (dtype, offset, shape, strides) of the bytes of ``base``'s storage."""
    return torch.empty(0, dtype=like.dtype, device=base.device).set_(
        base.untyped_storage(), like.storage_offset(), like.shape, like.stride())


class OffloadedWeights:
    """A model's device tensors (parameters and buffers) moved to pinned host memory by
    :func:`offload_weights`; :meth:`restore` moves them back (to new device addresses).
    Tensors that shared a storage (tied weights, the native forward's fused weights and the
    modules' views of them) share one again, on the host and back on the device."""

    def __init__(self, moved: list[tuple[torch.Tensor, list[torch.Tensor], torch.device]]):
        self._moved = moved          # (a storage's bytes on the host, its tensors, its device)

    @property
    def nbytes(self) -> int:
        """Bytes moved to the host (each storage once)."""
        return sum(host.numel() for host, _, _ in self._moved)

    def restore(self) -> None:
        """Copies every storage back to its device. OutOfMemory (a CUDA allocation failing)
        puts the tensors already copied back on the host: the weights stay offloaded and
        the call can be retried."""
        if not self._moved:
            return
        back: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        try:
            for host, tensors, device in self._moved:
                dev = host.to(device, non_blocking=True)
                for t in tensors:
                    t.data = _view(dev, t.data)
                back.append((host, tensors))
            torch.cuda.synchronize()
        except (torch.OutOfMemoryError, RuntimeError) as e:
            for host, tensors in back:
                for t in tensors:
                    t.data = _view(host, t.data)
            torch.cuda.empty_cache()
            raise OutOfMemory(f"moving the weights back to the device ran out of memory ({e}); "
                              "they stay on the host, wake() can be retried") from e
        self._moved = []


def offload_weights(model: Any) -> OffloadedWeights:
    """Moves every CUDA parameter and buffer of ``model`` to pinned host memory in place
    (``tensor.data`` swapped: the Parameter objects, and whatever holds them, stay): each
    storage is copied once, whole, and every tensor on it becomes the same view of the copy
    (tied weights and views of one tensor stay one storage). Nothing changes if an
    allocation fails."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for t in (*model.parameters(), *model.buffers()):
        if t.device.type != "cuda" or id(t) in seen:
            continue
        seen.add(id(t))
        key = (t.device, t.untyped_storage().data_ptr())
        groups.setdefault(key, []).append(t)
    if not groups:                           # a model on the host: nothing to move
        return OffloadedWeights([])
    moved: list[tuple[torch.Tensor, list[torch.Tensor], torch.device]] = []
    try:
        for (device, _), tensors in groups.items():
            storage = tensors[0].untyped_storage()
            n = storage.nbytes()
            data = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (n,), (1,))
            host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            host.copy_(data, non_blocking=True)
            moved.append((host, tensors, device))
        torch.cuda.synchronize()
    except (torch.OutOfMemoryError, RuntimeError) as e:
        raise OutOfMemory(f"copying the weights to pinned host memory failed ({e}); nothing "
                          "changed") from e
    for host, tensors, _ in moved:
        for t in tensors:
            t.data = _view(host, t.data)
    return OffloadedWeights(moved)
