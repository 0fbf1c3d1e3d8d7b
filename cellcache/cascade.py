"""A prepared step's shared-prefix grouping in FlashInfer's multi-level cascade layout.

cellcache's tensor-core kernels group decode rows that share leading cells on the device
(``docs/design/attention.md``, "Shared-prefix (cascade) attention"). :func:`cascade_levels`
makes the same grouping, by the same rule, for a FlashInfer user: two levels of paged views
(page size 1) over the step's cells, for ``flashinfer.MultiLevelCascadeAttentionWrapper``:

- level 0 (shared, non-causal): one entry per group of consecutive decode runs, its rows
  together, its kv list the group's shared cells; one entry per other run with no cells;
- level 1 (own, causal): one entry per run (padding rows' too), its kv list the run's cells
  past its group's shared ones (all of them for a run in no group).

The rule: run r joins run r - 1's group when both are real decode runs (one row) and their
kv lists share at least ``min_shared`` leading cells (within their histories: the entries
before each run's last); a group needs two runs; its shared cells are the least share along
it, down to a multiple of 128. Sharing between two sequences is always a prefix of
positions, so "leading cells in common" is what the prefix cache and forks made common.

Example
-------
>>> lv = cascade_levels(view)                                         # doctest: +SKIP
>>> wrapper = flashinfer.MultiLevelCascadeAttentionWrapper(2, workspace, "NHD")  # doctest: +SKIP
>>> wrapper.plan(*lv.flashinfer_args(), n_heads, n_kv_heads, head_dim, 1,  # doctest: +SKIP
...              causal=True)
>>> out = wrapper.run(q, (k_pool[:, None], v_pool[:, None]))          # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .cache import Step
from .errors import InvalidArgument, InvalidState
from .torch import CASCADE_MIN_SHARED, TorchView

__all__ = ["ALIGN", "CascadeLevels", "cascade_levels", "shared_prefixes"]

#: A group's shared cells: a multiple of this many (the tensor-core kernels' rule).
ALIGN = 128


@dataclass
class CascadeLevels:
    """Two levels of a step in FlashInfer's multi-level cascade layout (page size 1).

    ``levels[i]`` holds ``qo_indptr``, ``kv_indptr``, ``kv_indices`` and
    ``kv_last_page_len`` (int32 tensors on the view's device); ``groups`` lists each group as
    (first run, runs, shared cells)."""

    levels: list[dict[str, torch.Tensor]]
    groups: list[tuple[int, int, int]] = field(default_factory=list)

    def flashinfer_args(self) -> tuple[list[torch.Tensor], ...]:
        """(qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len)
        as ``MultiLevelCascadeAttentionWrapper.plan`` takes them."""
        return tuple([lv[k] for lv in self.levels]
                     for k in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"))


def shared_prefixes(qo_indptr: np.ndarray, kv_indptr: np.ndarray, kv_indices: torch.Tensor,
                    n_runs: int) -> np.ndarray:
    """share[r]: leading kv entries run r has in common with run r - 1 when both are real
    decode runs (one row each; r < ``n_runs``), within their histories; else 0. Computed
    where ``kv_indices`` lives, one comparison an entry."""
    qo = np.asarray(qo_indptr, dtype=np.int64)
    kv = np.asarray(kv_indptr, dtype=np.int64)
    runs = len(qo) - 1
    share = np.zeros(runs, dtype=np.int64)
    if runs < 2 or n_runs < 2:
        return share
    one = (qo[1:] - qo[:-1] == 1) & (np.arange(runs) < n_runs)
    lens = kv[1:] - kv[:-1]
    r = np.arange(1, runs)
    pair = one[1:] & one[:-1]
    m = np.where(pair, np.minimum(lens[r - 1], lens[r]) - 1, 0).clip(min=0)
    total = int(m.sum())
    if total == 0:
        return share
    dev = kv_indices.device
    mt = torch.as_tensor(m, device=dev)
    seg = torch.repeat_interleave(torch.as_tensor(r, device=dev), mt)          # run of each entry
    starts = torch.cumsum(mt, 0) - mt
    k = torch.arange(total, device=dev) - torch.repeat_interleave(starts, mt)
    kvt = torch.as_tensor(kv, device=dev)
    a = kv_indices[(kvt[seg - 1] + k).long()]
    b = kv_indices[(kvt[seg] + k).long()]
    # the first entry that differs, else the whole history
    first = torch.where(a != b, k, torch.full_like(k, total))
    out = torch.as_tensor(m, device=dev).scatter_reduce(0, seg - 1, first, reduce="amin", include_self=True)
    share[1:] = out.cpu().numpy()
    return share


def cascade_levels(view: TorchView, step: Step | None = None, min_shared: int | None = None) -> CascadeLevels:
    """The prepared step's two cascade levels (the module's docstring says which); ``step``
    the cache's prepared step (default), ``min_shared`` the least shared cells a group
    needs (default :data:`cellcache.torch.CASCADE_MIN_SHARED`; a positive multiple of
    :data:`ALIGN`). InvalidArgument for a view without the paged view or a bad
    ``min_shared``; InvalidState without a prepared step or for another one. Windowed
    layers do not group (FlashInfer's window applies at every level): give them the plain
    paged view."""
    if not isinstance(view, TorchView):
        raise InvalidArgument(f"view of type {type(view).__name__} is not a TorchView")
    if not view.config.paged:
        raise InvalidArgument("cascade_levels needs a cache built with paged=True")
    cmin = CASCADE_MIN_SHARED if min_shared is None else min_shared
    if isinstance(cmin, bool) or not isinstance(cmin, (int, np.integer)) or cmin <= 0 or cmin % ALIGN:
        raise InvalidArgument(f"min_shared={min_shared!r} must be a positive multiple of {ALIGN}")
    current = view.cache.prepared_step
    if current is None or (step is not None and step is not current):
        raise InvalidState("cascade_levels reads the cache's prepared step: prepare one (and pass "
                           "that Step, or none)")
    step = current
    qo = np.asarray(step.qo_indptr, dtype=np.int64)
    kv = np.asarray(step.kv_indptr, dtype=np.int64)
    runs = len(qo) - 1
    idx = view.paged["kv_indices"]
    share = shared_prefixes(qo, kv, idx[:int(kv[-1])], step.n_runs)
    link = share >= cmin
    groups: list[tuple[int, int, int]] = []
    start = np.zeros(runs, dtype=np.int64)        # each run's first own entry
    r = 0
    while r < runs:
        e = r + 1
        while e < runs and link[e]:
            e += 1
        if e - r >= 2:
            s = int(share[r + 1:e].min()) // ALIGN * ALIGN
            if s >= cmin:
                groups.append((r, e - r, s))
                start[r:e] = s
        r = e
    dev = idx.device
    # level 0: a group's rows and its shared cells; every other run, its rows and no cells
    q0, k0, src0 = [0], [0], []
    grouped = {g[0]: g for g in groups}
    r = 0
    while r < runs:
        first, n, s = grouped.get(r, (r, 1, 0))
        q0.append(int(qo[first + n]))
        k0.append(k0[-1] + s)
        if s:
            src0.append((int(kv[first]), s))
        r = first + n
    own = kv[1:] - kv[:-1] - start
    k1 = np.concatenate([[0], np.cumsum(own)])

    def gather(spans: list[tuple[int, int]] | tuple[np.ndarray, np.ndarray]) -> torch.Tensor:
        begin, length = (np.array([b for b, _ in spans], dtype=np.int64),
                         np.array([n for _, n in spans], dtype=np.int64)) if isinstance(spans, list) \
            else spans
        if length.sum() == 0:
            return torch.zeros(0, dtype=torch.int32, device=dev)
        lt = torch.as_tensor(length, device=dev)
        base = torch.repeat_interleave(torch.as_tensor(begin, device=dev), lt)
        first = torch.repeat_interleave(torch.cumsum(lt, 0) - lt, lt)
        off = torch.arange(int(length.sum()), device=dev) - first
        return idx[(base + off).long()].to(torch.int32)

    def level(q: np.ndarray | list[int], k: np.ndarray | list[int],
              cells: torch.Tensor) -> dict[str, torch.Tensor]:
        q_t = torch.as_tensor(np.asarray(q), dtype=torch.int32, device=dev)
        return {"qo_indptr": q_t, "kv_indptr": torch.as_tensor(np.asarray(k), dtype=torch.int32, device=dev),
                "kv_indices": cells,
                # page size 1: a list of n pages holds n entries (none: (0 - 1) * 1 + 1 = 0)
                "kv_last_page_len": torch.ones(len(q_t) - 1, dtype=torch.int32, device=dev)}

    return CascadeLevels([level(q0, k0, gather(src0)),
                          level(qo, k1, gather((kv[:-1] + start, own)))], groups)
