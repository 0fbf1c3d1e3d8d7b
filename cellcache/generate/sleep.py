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


class OffloadedWeights:
    """A model's device tensors (parameters and buffers) moved to pinned host memory by
    :func:`offload_weights`; :meth:`restore` moves them back (to new device addresses)."""

    def __init__(self, moved: list[tuple[torch.Tensor, torch.Tensor, torch.device]]):
        self._moved = moved          # (the model's tensor, its host copy, its device)

    @property
    def nbytes(self) -> int:
        """Bytes moved to the host (each storage once)."""
        seen: dict[int, int] = {}
        for _, host, _ in self._moved:
            seen[id(host)] = host.numel() * host.element_size()
        return sum(seen.values())

    def restore(self) -> None:
        """Copies every tensor back to its device. OutOfMemory (a CUDA allocation failing)
        puts the ones already copied back on the host: the weights stay offloaded and the
        call can be retried."""
        if not self._moved:
            return
        done: dict[int, torch.Tensor] = {}          # a host copy shared by tied tensors: one copy
        back: list[torch.Tensor] = []
        try:
            for t, host, device in self._moved:
                dev = done.get(id(host))
                if dev is None:
                    dev = done[id(host)] = host.to(device, non_blocking=True)
                t.data = dev
                back.append(t)
            torch.cuda.synchronize()
        except (torch.OutOfMemoryError, RuntimeError) as e:
            for t, host, _ in self._moved[:len(back)]:
                t.data = host
            done.clear()
            torch.cuda.empty_cache()
            raise OutOfMemory(f"moving the weights back to the device ran out of memory ({e}); "
                              "they stay on the host, wake() can be retried") from e
        self._moved = []


def offload_weights(model: Any) -> OffloadedWeights:
    """Moves every CUDA parameter and buffer of ``model`` to pinned host memory in place
    (``tensor.data`` swapped: the Parameter objects, and whatever holds them, stay), tied
    tensors (one storage, one shape) once. Nothing changes if an allocation fails."""
    moved: list[tuple[torch.Tensor, torch.Tensor, torch.device]] = []
    copies: dict[tuple, torch.Tensor] = {}
    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.device.type == "cuda"]
    if not tensors:                          # a model on the host: nothing to move
        return OffloadedWeights([])
    try:
        for t in tensors:
            key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
            host = copies.get(key)
            if host is None:
                host = copies[key] = torch.empty_like(t, device="cpu", pin_memory=True)
                host.copy_(t.detach(), non_blocking=True)
            moved.append((t, host, t.device))
        torch.cuda.synchronize()
    except (torch.OutOfMemoryError, RuntimeError) as e:
        raise OutOfMemory(f"copying the weights to pinned host memory failed ({e}); nothing "
                          "changed") from e
    for t, host, _ in moved:
        t.data = host
    return OffloadedWeights(moved)
