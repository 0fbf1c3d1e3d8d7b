"""The sm_90a prefill kernels' bench entries (``cuda/tc_sm90a.cu``, ``tc90_<overlap|pingpong>``):
their work list, made on the host in any of three orders, and their launch, one CTA a unit.
The runner launches the same kernel body through ``cellcache.cuda.tc`` (``tc90_plan`` and
``tc90_<entry>``: the list made on the device, run by run, persistent CTAs); ``tools/bench.py
--section attention`` times both beside the table's choice and FlashInfer on Hopper
(docs/design/attention.md, "An sm_90a path").

A unit is ``(run, kv head, first packed row, 0)``: 128 packed rows of one run (row p = query
p // G, head p % G of the kv head's group of G), one CTA each. ``order="run"`` lists them run
by run and kv head by kv head (neighbouring CTAs read the same K/V, which L2 then serves),
``"heaviest"`` by keys read, most first, over the whole step (no tail; measured DRAM-bound on
long prompts, 1.4x slower), ``"sections"`` cuts the run-by-run list into sections of (run, kv
head) pairs whose keys together stay within ``section_keys`` (what half of L2 holds) and lists
each section heaviest first (FlashAttention-3's longest-first scheduling within L2's reach: a
causal step's short units fill the tail of each section, not of the step).
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import numpy as np

from cellcache.cuda.tc import HOPPER_ROWS as ROWS
from cellcache.cuda.tc import HOPPER_STAGES as STAGES
from cellcache.cuda.tc import HOPPER_THREADS as THREADS
from cellcache.cuda.tc import hopper_smem as smem_bytes

KERNELS = ("overlap", "pingpong")
ORDERS = ("run", "heaviest", "sections")


def section_keys(l2_bytes: int, head_dim: int) -> int:
    """Keys of one kv head whose K and V (bf16) fill half of an L2 of ``l2_bytes``."""
    return max(1, l2_bytes // 2 // (head_dim * 2 * 2))


def units(qo_indptr, kv_indptr, n_runs: int, group: int, n_kv_heads: int, order: str = "run",
          section_keys: int = 0) -> np.ndarray:
    """The launch's work list, int32 ``[n, 4]``: every (run, kv head, 128-row block) of the
    step's ``n_runs`` runs, in ``order`` (``"sections"`` needs ``section_keys`` > 0). A run of
    n queries over L keys packs n x ``group`` rows; its block from row r0 reads the keys up to
    query ((r0 + 127) // group)'s last."""
    if order not in ORDERS:
        raise ValueError(f"order {order!r}: one of {ORDERS}")
    if order == "sections" and section_keys <= 0:
        raise ValueError(f"order 'sections' needs section_keys > 0, not {section_keys}")
    pairs = []                               # run by run, kv head by kv head
    for r in range(n_runs):
        n = int(qo_indptr[r + 1]) - int(qo_indptr[r])
        L = int(kv_indptr[r + 1]) - int(kv_indptr[r])
        rows = n * group
        for kvh in range(n_kv_heads):
            blocks = [(L - n + min(row0 + ROWS - 1, rows - 1) // group + 1, r, kvh, row0)
                      for row0 in range(0, rows, ROWS)]
            pairs.append((L, sorted(blocks, key=lambda u: -u[0])))
    if order == "heaviest":
        out = sorted((u for _, blocks in pairs for u in blocks), key=lambda u: -u[0])   # stable
    elif order == "run":
        out = [u for _, blocks in pairs for u in blocks]
    else:
        out, section, keys = [], [], 0
        for L, blocks in pairs:
            if section and keys + L > section_keys:
                out += sorted(section, key=lambda u: -u[0])
                section, keys = [], 0
            section += blocks
            keys += L
        out += sorted(section, key=lambda u: -u[0])
    return np.array([(r, kvh, row0, 0) for _, r, kvh, row0 in out], dtype=np.int32).reshape(-1, 4)


class Sm90aPrefill:
    """The shipped ``tc_sm90a.ptx`` loaded in the current context; ``run`` launches one kernel
    over a host-made unit list (a device int32 ``[n, 4]`` tensor). Loading fails (the driver's
    error) on a GPU other than compute capability 9.0."""

    def __init__(self):
        from cellcache.cuda.driver import check, cu, load_module

        self._cu, self._check = cu, check
        self.module = load_module("tc_sm90a")
        self.functions: dict[tuple[str, int], Any] = {}
        attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        try:
            for kernel in KERNELS:
                for d in STAGES:
                    f = check(cu.cuModuleGetFunction(self.module, f"tc90_{kernel}_bf16_d{d}".encode()),
                              "cuModuleGetFunction")
                    check(cu.cuFuncSetAttribute(f, attr, smem_bytes(d)), "cuFuncSetAttribute")
                    self.functions[kernel, d] = f
        except BaseException:
            self.close()
            raise

    def run(self, kernel: str, q, k_pool, v_pool, qo_indptr: int, kv_indptr: int, kv_indices: int,
            unit_list, n_heads: int, n_kv_heads: int, out, stream: int) -> None:
        """``q`` / ``out`` bf16 ``[T, H, D]`` contiguous, pools ``[cells, Hkv, D]`` bf16; the
        index arrays as device pointers (int32); ``unit_list`` from :func:`units`, on the
        device. A ValueError for anything else (the kernel would read it as these)."""
        import torch

        d = int(q.shape[-1])
        if (kernel, d) not in self.functions:
            raise ValueError(f"kernel {kernel!r} at head_dim {d}: built for {KERNELS} x {tuple(STAGES)}")
        if n_heads % n_kv_heads:
            raise ValueError(f"{n_heads} query heads are not a multiple of {n_kv_heads} kv heads")
        for what, t, shape in (("q", q, (n_heads, d)), ("out", out, (n_heads, d)),
                               ("k_pool", k_pool, (n_kv_heads, d)), ("v_pool", v_pool, (n_kv_heads, d))):
            if t.dtype != torch.bfloat16 or not t.is_contiguous() or tuple(t.shape[1:]) != shape:
                raise ValueError(f"{what} must be contiguous bf16 [*, {shape[0]}, {shape[1]}], not "
                                 f"{t.dtype} {tuple(t.shape)}")
        if (unit_list.dtype != torch.int32 or not unit_list.is_contiguous() or unit_list.dim() != 2
                or unit_list.shape[1] != 4):
            raise ValueError(f"unit_list must be contiguous int32 [n, 4], not {unit_list.dtype} "
                             f"{tuple(unit_list.shape)}")
        f = self.functions[kernel, d]
        scale_log2 = 1.0 / math.sqrt(d) * math.log2(math.e)
        vals = (q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), qo_indptr, kv_indptr, kv_indices,
                unit_list.data_ptr(), n_heads, n_kv_heads, scale_log2, out.data_ptr())
        types = (ctypes.c_void_p,) * 7 + (ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_void_p)
        cu = self._cu
        self._check(cu.cuLaunchKernel(f, int(unit_list.shape[0]), 1, 1, THREADS, 1, 1, smem_bytes(d),
                                      cu.CUstream(stream), (vals, types), 0), "cuLaunchKernel(tc90)")

    def close(self) -> None:
        if self.module is not None:
            self._cu.cuModuleUnload(self.module)
            self.module = None
