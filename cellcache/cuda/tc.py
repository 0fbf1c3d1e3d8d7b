"""Paged attention on tensor cores (``cuda/tc_attention.cu``), launched through the driver API.

One call of :meth:`TensorCoreAttention.run` is three launches on the caller's stream, whose
shapes depend only on the padded row count and the heads, so the three can be captured in
a graph and replayed for any step padded to the same rows::

    tc_plan        qo_indptr, kv_indptr, width  ->  work list + kv split size (device)
    tc_attend      persistent CTAs take (item, kv head) units from the list
    tc_merge       combines the kv splits of split runs (returns at once without any)

The calling convention is :meth:`cellcache.cuda.kernels.AttentionKernels.paged`'s: the
paged view's device addresses, q/out ``[rows, n_heads, head_dim]`` with (token, head)
element strides and unit stride in head_dim. Padding rows (past the step's ``width``) get
zeros. Scratch (the work list, the split partials) is allocated on first use outside a
capture, or up front by :meth:`TensorCoreAttention.reserve`; outgrown scratch is kept until
:meth:`close`, since a captured graph keeps the addresses it saw.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np

from ..errors import InvalidArgument, InvalidState
from . import _launch
from . import driver as drv
from .driver import check, cu

__all__ = ["HEAD_DIMS", "TensorCoreAttention", "aligned", "supports"]

#: head dims with a tensor-core kernel; K/V dtypes it takes
HEAD_DIMS = (64, 80, 96, 128, 256)
DTYPES = ("float16", "bfloat16")
MAX_GROUP = 64          # query heads per kv head (a unit is 64 packed rows: one query at least)
THREADS = 128           # tc_attend / tc_merge blocks (TC_THREADS)
PLAN_THREADS = 1024     # tc_plan blocks (TC_PLAN_THREADS)
_PLAN_HDR = 16          # int32 words of the plan header (TC_HDR)
_ZERO_BLOCKS = 32       # tc_plan blocks that zero the padding rows
_LOG2E = 1.4426950408889634
#: TcArgs in cuda/tc_attention.cu: every field 8 bytes
_ARGS = struct.Struct("=8Q4q5q2Q3qd")


def supports(dtype: str, head_dim: int, group: int) -> bool:
    """Whether a tensor-core kernel takes this K/V dtype, head_dim and query heads per kv head."""
    return dtype in DTYPES and head_dim in HEAD_DIMS and 1 <= group <= MAX_GROUP


def aligned(q: int, q_strides: tuple[int, int], k_pool: int, v_pool: int, out: int,
            out_strides: tuple[int, int]) -> bool:
    """Whether the kernels' 16-byte loads and stores are aligned for these addresses and
    (token, head) element strides of a 2-byte dtype: addresses multiples of 16 bytes,
    strides multiples of 8 elements. When False, use another path (the kernels would fault)."""
    return (all(p % 16 == 0 for p in (q, k_pool, v_pool, out))
            and all(s % 8 == 0 for s in (*q_strides, *out_strides)))


class TensorCoreAttention:
    """The tensor-core paged attention kernels for one K/V dtype.

    Example
    -------
    >>> tc = TensorCoreAttention("bfloat16", sm_count=132)           # doctest: +SKIP
    >>> tc.reserve(rows=2048, n_heads=32, n_kv_heads=8, head_dim=128)  # before a capture  # doctest: +SKIP
    >>> tc.run(view.paged_pointers(), 2048, q.data_ptr(), (q.stride(0), q.stride(1)), k.data_ptr(),
    ...        v.data_ptr(), out.data_ptr(), (out.stride(0), out.stride(1)), 32, 8, 128, 0,
    ...        torch.cuda.current_stream().cuda_stream)             # doctest: +SKIP
    """

    def __init__(self, dtype: str, sm_count: int):
        if dtype not in DTYPES:
            raise InvalidArgument(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
        self.dtype = dtype
        self.sm_count = sm_count
        self.module = drv.load_module("tc_attention")
        self._live: list[int] = []          # every scratch allocation, freed at close
        try:
            self.f_plan = int(drv.function(self.module, "tc_plan"))
            self.f_merge = int(drv.function(self.module, f"tc_merge_{dtype}"))
            self.f_attend: dict[int, int] = {}
            self.config: dict[int, dict[str, int]] = {}
            self.ctas: dict[int, int] = {}
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            for d in HEAD_DIMS:
                f = drv.function(self.module, f"tc_attend_{dtype}_d{d}")
                kt, stages, qrows, smem = self._read_config(d)
                self.config[d] = {"kv_tile": kt, "stages": stages, "qrows": qrows, "smem": smem}
                check(cu.cuFuncSetAttribute(f, attr, smem), "cuFuncSetAttribute")
                per_sm = int(check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(f, THREADS, smem),
                                   "cuOccupancyMaxActiveBlocksPerMultiprocessor"))
                self.ctas[d] = max(1, per_sm) * sm_count
                self.f_attend[d] = int(f)
        except BaseException:
            check(cu.cuModuleUnload(self.module), "cuModuleUnload")
            self.module = None
            raise
        self._plan = self._part = 0
        self._plan_bytes = self._part_bytes = 0

    def _read_config(self, head_dim: int) -> tuple[int, int, int, int]:
        """{kv tile, stages, packed rows a unit, dynamic shared bytes} from the module (one
        source: the kernel file's tc_config_dD)."""
        ptr, size = check(cu.cuModuleGetGlobal(self.module, f"tc_config_d{head_dim}".encode()),
                          "cuModuleGetGlobal")
        buf = np.zeros(4, dtype=np.int32)
        check(cu.cuMemcpyDtoH(buf.ctypes.data, ptr, 16), "cuMemcpyDtoH")
        kt, stages, qrows, smem = (int(x) for x in buf)
        return kt, stages, qrows, smem

    def close(self) -> None:
        for ptr in self._live:
            check(cu.cuMemFree(ptr), "cuMemFree")
        self._live = []
        self._plan = self._part = 0
        self._plan_bytes = self._part_bytes = 0
        if self.module is not None:
            check(cu.cuModuleUnload(self.module), "cuModuleUnload")
            self.module = None

    # -- sizes ---------------------------------------------------------------------------------
    def _sizes(self, rows: int, n_heads: int, n_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """(list_cap, split_cap units, plan bytes, partial bytes) for a launch of ``rows``."""
        group = n_heads // n_kv_heads
        qrows = self.config[head_dim]["qrows"]
        split_cap = 2 * self.ctas[head_dim]                    # units a split plan may make
        split_items = -(-split_cap // n_kv_heads)
        # without splits: sum over runs of ceil(qo_len * G / qrows) <= rows * G / qrows + runs
        list_cap = rows + -(-rows * group // qrows) + split_items
        plan_bytes = 4 * (_PLAN_HDR + 4 * list_cap + 2 * rows)
        part_bytes = 4 * split_items * n_kv_heads * qrows * (head_dim + 2)
        return list_cap, split_cap, plan_bytes, part_bytes

    def reserve(self, rows: int, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
        """Allocates the scratch a launch of ``rows`` padded rows needs (call outside a capture)."""
        _, _, plan_bytes, part_bytes = self._sizes(rows, n_heads, n_kv_heads, head_dim)
        if plan_bytes > self._plan_bytes:
            self._plan = self._alloc(plan_bytes, "tensor-core work list")
            self._plan_bytes = plan_bytes
        if part_bytes > self._part_bytes:
            self._part = self._alloc(part_bytes, "tensor-core split partials")
            self._part_bytes = part_bytes

    def _alloc(self, nbytes: int, what: str) -> int:
        ptr = int(check(cu.cuMemAlloc(nbytes), f"cuMemAlloc({what})"))
        self._live.append(ptr)
        return ptr

    # -- the launch ----------------------------------------------------------------------------
    def run(self, view: dict, rows: int, q: int, q_strides: tuple[int, int], k_pool: int,
            v_pool: int, out: int, out_strides: tuple[int, int], n_heads: int, n_kv_heads: int,
            head_dim: int, window: int, stream: int, scale: float | None = None) -> None:
        """Paged attention of query rows ``[0, rows)`` (any mix of decode and prefill rows).

        ``view`` holds the device addresses of ``qo_indptr``, ``kv_indptr``, ``kv_indices``
        and ``width``; q and out are ``[rows, n_heads, head_dim]`` of the pool dtype at the
        given (token, head) element strides. Refuses (InvalidArgument, nothing launched) a
        shape :func:`supports` rejects or addresses/strides :func:`aligned` rejects.
        """
        if self.module is None:
            raise InvalidState("the tensor-core kernels are closed")
        if n_kv_heads < 1 or n_heads % n_kv_heads:
            raise InvalidArgument(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
        group = n_heads // n_kv_heads
        if not supports(self.dtype, head_dim, group):
            raise InvalidArgument(
                f"head_dim={head_dim}, group={group} has no tensor-core kernel for {self.dtype} "
                f"(head_dim one of {HEAD_DIMS}, group in [1, {MAX_GROUP}])")
        if not aligned(q, q_strides, k_pool, v_pool, out, out_strides):
            raise InvalidArgument(
                f"q/k/v/out addresses must be multiples of 16 bytes and strides multiples of 8 "
                f"elements (q strides {q_strides}, out strides {out_strides})")
        if rows < 1:
            return
        list_cap, split_cap, plan_bytes, part_bytes = self._sizes(rows, n_heads, n_kv_heads, head_dim)
        if plan_bytes > self._plan_bytes or part_bytes > self._part_bytes:
            capturing = check(cu.cuStreamIsCapturing(stream), "cuStreamIsCapturing")
            if int(capturing) != int(cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE):
                raise InvalidState(
                    f"the tensor-core scratch for rows={rows} is not allocated and the stream is "
                    "being captured; call reserve() with these shapes before the capture")
            self.reserve(rows, n_heads, n_kv_heads, head_dim)
        cfg = self.config[head_dim]
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        args = _ARGS.pack(view["qo_indptr"], view["kv_indptr"], view["kv_indices"], view["width"],
                          q, k_pool, v_pool, out, q_strides[0], q_strides[1], out_strides[0],
                          out_strides[1], rows, n_heads, n_kv_heads, group, window, self._plan,
                          self._part, list_cap, split_cap, self.ctas[head_dim], scale * _LOG2E)
        n = len(args)
        min_chunk = 2 * cfg["kv_tile"]
        _launch.launch(self.f_plan, (1 + _ZERO_BLOCKS, 1, 1), PLAN_THREADS, 0, stream,
                       args + struct.pack("=iii", cfg["qrows"], min_chunk, head_dim),
                       (0, n, n + 4, n + 8))
        _launch.launch(self.f_attend[head_dim], (self.ctas[head_dim], 1, 1), THREADS, cfg["smem"],
                       stream, args, (0,))
        _launch.launch(self.f_merge, (2 * self.sm_count, 1, 1), THREADS, 0, stream,
                       args + struct.pack("=ii", head_dim, cfg["qrows"]), (0, n, n + 4))

    def describe(self, head_dim: int) -> dict[str, Any]:
        """Tile shape, shared memory and persistent grid of the head_dim's kernel."""
        return {**self.config[head_dim], "ctas": self.ctas[head_dim], "threads": THREADS}
