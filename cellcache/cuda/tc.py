"""Paged attention on tensor cores (``cuda/tc_attention.cu``), launched through the driver API.

One call of :meth:`TensorCoreAttention.run` is up to five launches on the caller's stream,
whose shapes depend only on the padded row count and the heads, so they can be captured in a
graph and replayed for any step padded to the same rows::

    tc_share       (cascade, once a step) how many leading kv entries each decode run shares
                   with the one before it
    tc_plan        qo_indptr, kv_indptr, width (, shares)  ->  work list + kv split size +
                   groups of runs that share leading cells (device; once a step when the
                   caller says the step's later layers plan alike: ``fresh=False``)
    tc_attend      persistent CTAs take (item, kv head) units from the list (one variant),
                   zero the padding rows; the last to take puts the counter back
    tc_attend      (cascade) the groups' shared keys, once a group, the prefill variant
    tc_merge       combines the kv splits of split runs and the grouped rows' own and shared
                   parts (left out where the caller shows that no run can be split:
                   ``live_rows``)

The kernel file instantiates a few variants per head_dim (rows a warp, warps along the rows
or along the kv tile, kv tile, ring stages; the module lists them in ``tc_variants``). A run
picks one from :data:`TABLE` by head_dim and shape class: ``decode=True`` when every run of
the step has one query (a decode step), else the prefill entry; ``variant=`` overrides it
(``tools/bench.py --section attention`` times every variant and prints the table to set).

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
from typing import Any, NamedTuple

import numpy as np

from ..errors import InvalidArgument, InvalidState
from . import _launch
from . import driver as drv
from .driver import check, cu

__all__ = ["HEAD_DIMS", "KV8_DTYPES", "TABLE", "TABLE_E4M3", "Choice", "TensorCoreAttention", "aligned",
           "supports"]

#: head dims with a tensor-core kernel; K/V dtypes it takes
HEAD_DIMS = (64, 80, 96, 128, 256)
DTYPES = ("float16", "bfloat16")
#: 8-bit K/V storage the kernels read (q and out of a DTYPES dtype; ``..._e4m3_...`` variants)
KV8_DTYPES = ("float8_e4m3fn",)
MAX_GROUP = 64          # query heads per kv head (a query's rows may span several units)
THREADS = 128           # tc_attend / tc_merge blocks (TC_THREADS)
PLAN_THREADS = 1024     # tc_plan blocks (TC_PLAN_THREADS)
_PLAN_HDR = 16          # int32 words of the plan header (TC_HDR)
_LOG2E = 1.4426950408889634
#: TcArgs in cuda/tc_attention.cu: every field 8 bytes
_ARGS = struct.Struct("=8Q4q5q2Q3qdQ2q2Q")
#: cascade: the most kv splits of a group's shared keys (TC_NSH), their alignment (TC_CASCADE_ALIGN)
_NSH = 4
CASCADE_ALIGN = 128
#: Tc90Args in cuda/tc_sm90a.cu: every field 8 bytes
_ARGS90 = struct.Struct("=8Q4q3qQqd")
#: the sm_90a prefill kernels (compute capability 9.0, bf16 pools): head dims, K/V stages,
#: packed rows a unit, threads a CTA (a producer warpgroup and two consumers)
HOPPER_HEAD_DIMS = (64, 128)
#: the runner's sm_90a entries (``tc90_<entry>_bf16_d<D>``), every one with each unit's first
#: tile peeled off the loop (so ptxas keeps the wgmmas pipelined): "pipe" (the consumers copy
#: a unit's Q), "qpre" (the producer copies it while the consumers finish the unit before;
#: chosen: 0.62-0.97x FlashInfer's sm90 prefill, docs/design/attention.md), "early" (qpre with
#: the unit's first K/V tile copied before its Q; correct, and 1.04x qpre's time on the long
#: prompt in its one timed run, the short prompts not yet timed)
HOPPER_ENTRIES = ("pipe", "qpre", "early")
HOPPER_ENTRY = "qpre"
HOPPER_STAGES = {64: 4, 128: 3}
HOPPER_ROWS = 128
HOPPER_THREADS = 384


def hopper_smem(head_dim: int) -> int:
    """Dynamic shared memory of an sm_90a prefill CTA: both consumers' Q, the K/V stages, 1 KiB
    of alignment slack for the 128-byte swizzle, a full and an empty mbarrier a stage and Q's
    full and empty mbarriers."""
    st = HOPPER_STAGES[head_dim]
    return 2 * 64 * head_dim * 2 + st * 2 * HOPPER_ROWS * head_dim * 2 + 1024 + 2 * st * 8 + 2 * 8


def hopper_units_cap(rows: int, n_heads: int, n_kv_heads: int) -> int:
    """Units an sm_90a plan of ``rows`` padded rows can make: every run with a query makes
    ceil(queries x group / 128) a kv head, at most rows x group / 128 + rows in all."""
    return n_kv_heads * (rows + -(-rows * (n_heads // n_kv_heads) // HOPPER_ROWS))


#: tc_variants: {D, MQ, WKV, KT, ST, packed rows a unit, shared bytes, B (CTAs an SM asked of
#: the compiler, 0: none; named ...b<B>), KS (keys scored at once, 0: the default rule; named
#: ...x<KS>)}
_VARIANT_WORDS = 9


class Choice(NamedTuple):
    """What a run launches: the variant ``m<MQ>w<WKV>k<KT>s<ST>[b<B>][x<KS>]`` (``b<B>``: compiled
    for B CTAs an SM; ``x<KS>``: KS keys scored at once); ``split``: the step is
    split along kv when it has fewer than split x CTAs units (into at most 2 x split x CTAs;
    0: never, so that a row's sums do not depend on the step's other units);
    ``order``: the work list run by run (0, neighbours share K/V in L2) or heaviest first over
    the step (1, no tail)."""

    variant: str
    split: int
    order: int


#: (head_dim, shape class) -> Choice; class "decode" (every run one query) or "prefill" (any
#: other step). Set from ``tools/bench.py --section attention`` on the target GPU, which
#: times every variant and prints the winners in this form; head dims the sweep has no case
#: for keep a choice of the nearest swept one.
TABLE: dict[tuple[int, str], Choice] = {
    (64, "prefill"): Choice("m2w1k64s2x64", 1, 0),
    (64, "decode"): Choice("m1w4k128s2", 1, 1),
    (80, "prefill"): Choice("m2w1k32s2", 1, 1),
    (80, "decode"): Choice("m1w4k64s2", 4, 1),
    (96, "prefill"): Choice("m2w1k32s2", 1, 1),
    (96, "decode"): Choice("m1w4k64s2", 4, 1),
    (128, "prefill"): Choice("m2w1k64s2", 1, 0),
    (128, "decode"): Choice("m1w4k64s2", 4, 1),
    (256, "prefill"): Choice("m1w1k16s3", 1, 1),
    (256, "decode"): Choice("m1w4k64s2", 4, 1),
}


#: The same for 8-bit K/V pools (``tc_variants_e4m3``; the bytes are widened to f16 in
#: registers by the decode-shaped variants, through shared memory by the others). Set from
#: ``tools/bench_kv8.py``, which times every e4m3 variant on the same cells.
TABLE_E4M3: dict[tuple[int, str], Choice] = {
    (64, "prefill"): Choice("m2w1k32s2", 1, 0),
    (64, "decode"): Choice("m1w4k64s2", 2, 1),
    (80, "prefill"): Choice("m2w1k32s2", 1, 1),
    (80, "decode"): Choice("m1w4k64s2", 4, 1),
    (96, "prefill"): Choice("m2w1k32s2", 1, 1),
    (96, "decode"): Choice("m1w4k64s2", 4, 1),
    (128, "prefill"): Choice("m2w1k32s2", 1, 0),
    (128, "decode"): Choice("m1w4k64s2", 4, 1),
    (256, "prefill"): Choice("m1w1k32s2", 1, 1),
    (256, "decode"): Choice("m1w4k64s2", 4, 1),
}


def compute_capability() -> tuple[int, int]:
    """(major, minor) of the current context's GPU."""
    dev = check(cu.cuCtxGetDevice(), "cuCtxGetDevice")
    attr = cu.CUdevice_attribute
    major, minor = (int(check(cu.cuDeviceGetAttribute(which, dev), "cuDeviceGetAttribute"))
                    for which in (attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                  attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))
    return major, minor


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
    """The tensor-core paged attention kernels for one K/V dtype (``ptx``: the module built
    from other sources, to compare kernels; sources whose merge puts the work counters back
    need the merge after every launch: ``live_rows=0`` and a split above 0).

    Example
    -------
    >>> tc = TensorCoreAttention("bfloat16", sm_count=132)           # doctest: +SKIP
    >>> tc.reserve(rows=2048, n_heads=32, n_kv_heads=8, head_dim=128)  # before a capture  # doctest: +SKIP
    >>> tc.run(view.paged_pointers(), 2048, q.data_ptr(), (q.stride(0), q.stride(1)), k.data_ptr(),
    ...        v.data_ptr(), out.data_ptr(), (out.stride(0), out.stride(1)), 32, 8, 128, 0,
    ...        torch.cuda.current_stream().cuda_stream)             # doctest: +SKIP
    """

    def __init__(self, dtype: str, sm_count: int, kv_dtype: str | None = None, *, ptx: bytes | None = None,
                 hopper: bool | None = None):
        """``hopper``: the sm_90a prefill kernels where the GPU and pools take them (None),
        never (False), or required (True: InvalidArgument where they cannot run)."""
        if hopper is not None and not isinstance(hopper, bool):
            raise InvalidArgument(f"hopper must be None (where the GPU takes it), True or False, "
                                  f"not {hopper!r}")
        if ptx is not None and not isinstance(ptx, (bytes, bytearray)):
            raise InvalidArgument(f"ptx must be bytes (a tc_attention.ptx built elsewhere), not "
                                  f"{type(ptx).__name__}")
        if dtype not in DTYPES:
            raise InvalidArgument(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
        if kv_dtype not in (None, dtype, *KV8_DTYPES):
            raise InvalidArgument(f"kv_dtype={kv_dtype!r} is not {dtype!r} or one of {', '.join(KV8_DTYPES)}")
        self.dtype = dtype
        #: whether the pools hold 8-bit K/V (then every run takes the layer's scales)
        self.kv8 = kv_dtype in KV8_DTYPES
        self.table = TABLE_E4M3 if self.kv8 else TABLE
        self.sm_count = sm_count
        self.module = drv.load_module("tc_attention", ptx)
        self._live: list[int] = []          # every scratch allocation, freed at close
        try:
            self.f_plan = int(drv.function(self.module, "tc_plan"))
            self.f_merge = int(drv.function(self.module, f"tc_merge_{dtype}"))
            #: head_dim -> variant name -> {mq, warps_kv, kv_tile, stages, min_blocks, qrows, smem,
            #: ctas, f}
            self.variants: dict[int, dict[str, dict[str, int]]] = {d: {} for d in HEAD_DIMS}
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            for d, mq, wkv, kt, st, qrows, smem, minb, ks in self._read_variants():
                name = f"m{mq}w{wkv}k{kt}s{st}" + (f"b{minb}" if minb else "") + (f"x{ks}" if ks else "")
                f = drv.function(self.module, f"tc_attend_{dtype}{'_e4m3' if self.kv8 else ''}_d{d}_{name}")
                check(cu.cuFuncSetAttribute(f, attr, smem), "cuFuncSetAttribute")
                per_sm = int(check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(f, THREADS, smem),
                                   "cuOccupancyMaxActiveBlocksPerMultiprocessor"))
                self.variants[d][name] = {"mq": mq, "warps_kv": wkv, "kv_tile": kt, "stages": st,
                                          "min_blocks": minb, "qrows": qrows, "smem": smem,
                                          "ctas": max(1, per_sm) * sm_count, "f": int(f)}
            for (d, kind), choice in self.table.items():
                if choice.variant not in self.variants[d]:
                    raise InvalidState(f"the table's [{d}, {kind!r}] names {choice.variant!r}, which "
                                       f"cuda/tc_attention.cu does not build ({sorted(self.variants[d])})")
        except BaseException:
            check(cu.cuModuleUnload(self.module), "cuModuleUnload")
            self.module = None
            raise
        self.f_share = int(drv.function(self.module, "tc_share"))
        self._plan = self._part = self._share = self._cpart = 0
        self._plan_bytes = self._part_bytes = self._share_bytes = self._cpart_bytes = 0
        self._plan_key: tuple | None = None    # what the last tc_plan launch planned
        self._plan90 = self._plan90_bytes = 0
        self._plan90_key: tuple | None = None
        self._plan90_made = False               # whether _plan90 holds a list (hopper_units)
        #: the sm_90a prefill kernels, where this GPU and these pools take them (else None)
        self.hopper: Any = None
        #: why not, where not: a line for the logs and the bench
        self.hopper_reason = ""
        self._hopper_entry = HOPPER_ENTRY
        try:
            self._load_hopper(hopper, ptx is not None)
        except BaseException:
            self.close()
            raise

    @property
    def hopper_entry(self) -> str:
        """Which sm_90a entry a launch runs, one of :data:`HOPPER_ENTRIES` (the bench and the
        tests set it to compare them); InvalidArgument for anything else."""
        return self._hopper_entry

    @hopper_entry.setter
    def hopper_entry(self, entry: str) -> None:
        if entry not in HOPPER_ENTRIES:
            raise InvalidArgument(f"hopper_entry={entry!r} is not one of {HOPPER_ENTRIES}")
        self._hopper_entry = entry

    def _load_hopper(self, hopper: bool | None, custom_ptx: bool) -> None:
        """Loads ``tc_sm90a.ptx`` where the current GPU is compute capability 9.0, the pools
        bf16 and the module the shipped one (``hopper=None``); ``False``: never; ``True``:
        InvalidArgument where it cannot (the GPU, the dtype or a given ``ptx``)."""
        if hopper is False:
            self.hopper_reason = "turned off (hopper=False)"
            return
        cc = compute_capability()
        why = ("the GPU is compute capability {}.{}, not 9.0".format(*cc) if cc != (9, 0)
               else f"the pools are {self.dtype}, not bfloat16" if self.dtype != "bfloat16" or self.kv8
               else "the tensor-core module is PTX given to compare kernels" if custom_ptx else "")
        if why:
            if hopper:
                raise InvalidArgument(f"hopper=True: the sm_90a prefill kernels do not run here: {why}")
            self.hopper_reason = why
            return
        try:
            module = drv.load_module("tc_sm90a")
        except drv.CudaError as e:
            if hopper:
                raise
            self.hopper_reason = f"the driver did not load tc_sm90a.ptx: {e}"
            return
        try:
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            fns: dict[Any, int] = {"plan": int(drv.function(module, "tc90_plan"))}
            for entry in HOPPER_ENTRIES:
                for d in HOPPER_HEAD_DIMS:
                    f = drv.function(module, f"tc90_{entry}_bf16_d{d}")
                    check(cu.cuFuncSetAttribute(f, attr, hopper_smem(d)), "cuFuncSetAttribute")
                    fns[entry, d] = int(f)
        except BaseException:
            check(cu.cuModuleUnload(module), "cuModuleUnload")
            raise
        self.hopper = {"module": module, **fns}

    def _read_variants(self) -> list[tuple[int, ...]]:
        """The module's variant list (one source: the kernel file's TC_VARIANTS)."""
        suffix = b"_e4m3" if self.kv8 else b""
        ptr, _ = check(cu.cuModuleGetGlobal(self.module, b"tc_n_variants" + suffix), "cuModuleGetGlobal")
        n = np.zeros(1, dtype=np.int32)
        check(cu.cuMemcpyDtoH(n.ctypes.data, ptr, 4), "cuMemcpyDtoH")
        ptr, _ = check(cu.cuModuleGetGlobal(self.module, b"tc_variants" + suffix), "cuModuleGetGlobal")
        buf = np.zeros(int(n[0]) * _VARIANT_WORDS, dtype=np.int32)
        check(cu.cuMemcpyDtoH(buf.ctypes.data, ptr, buf.nbytes), "cuMemcpyDtoH")
        return [tuple(int(x) for x in row) for row in buf.reshape(-1, _VARIANT_WORDS)]

    def choose(self, head_dim: int, decode: bool = False, variant: str | None = None,
               split: int | None = None, order: int | None = None) -> Choice:
        """The table's choice for head_dim and the shape class, with any field overridden."""
        base = self.table[head_dim, "decode" if decode else "prefill"]
        c = Choice(variant or base.variant, base.split if split is None else split,
                   base.order if order is None else order)
        if c.variant not in self.variants.get(head_dim, {}):
            raise InvalidArgument(f"variant {c.variant!r} is not built for head_dim={head_dim} "
                                  f"(one of {sorted(self.variants.get(head_dim, {}))})")
        if c.split < 0 or c.order not in (0, 1):
            raise InvalidArgument(f"split={c.split} must be >= 0 (0: never split) and order={c.order} "
                                  "0 or 1")
        return c

    def unsplit_rows(self, n_kv_heads: int, head_dim: int, decode: bool = False,
                     variant: str | None = None, split: int | None = None) -> int:
        """The fewest runs with a query at which a step of this shape is never split along
        kv (0: the choice never splits): the plan splits a step only below split x CTAs
        units, and every run with a query makes at least one unit a kv head. A launch whose
        ``live_rows`` reach it leaves the merge out (:meth:`run`). InvalidArgument for
        n_kv_heads < 1 or a head_dim without a kernel."""
        if n_kv_heads < 1:
            raise InvalidArgument(f"n_kv_heads={n_kv_heads} must be >= 1")
        if head_dim not in HEAD_DIMS:
            raise InvalidArgument(f"head_dim={head_dim} has no tensor-core kernel (one of {HEAD_DIMS})")
        return self._unsplit(self.choose(head_dim, decode, variant, split), head_dim, n_kv_heads)

    def _unsplit(self, choice: Choice, head_dim: int, n_kv_heads: int) -> int:
        return -(-choice.split * self.variants[head_dim][choice.variant]["ctas"] // n_kv_heads)

    def close(self) -> None:
        for ptr in self._live:
            check(cu.cuMemFree(ptr), "cuMemFree")
        self._live = []
        self._plan_key = None
        self._plan = self._part = self._share = self._cpart = 0
        self._plan_bytes = self._part_bytes = self._share_bytes = self._cpart_bytes = 0
        self._plan90 = self._plan90_bytes = 0
        self._plan90_key = None
        self._plan90_made = False
        if self.hopper is not None:
            check(cu.cuModuleUnload(self.hopper["module"]), "cuModuleUnload")
            self.hopper = None
        if self.module is not None:
            check(cu.cuModuleUnload(self.module), "cuModuleUnload")
            self.module = None

    # -- sizes ---------------------------------------------------------------------------------
    def _sizes(self, rows: int, n_heads: int, n_kv_heads: int, head_dim: int,
               choice: Choice, cascade: bool = False) -> tuple[int, ...]:
        """(list_cap, split_cap units, plan bytes, partial bytes, group items, cascade partial
        bytes) for a launch of ``rows``."""
        group = n_heads // n_kv_heads
        v = self.variants[head_dim][choice.variant]
        qrows = v["qrows"]
        split_cap = 2 * choice.split * v["ctas"]               # units a split plan may make
        split_items = -(-split_cap // n_kv_heads)
        # without splits: sum over runs of ceil(qo_len * G / qrows) <= rows * G / qrows + runs
        list_cap = rows + -(-rows * group // qrows) + split_items
        # cascade: groups of >= 2 rows (<= rows / 2), each ceil(rows_g * G / gqrows) q tiles of
        # at most _NSH splits
        gqrows = self.variants[head_dim][self.table[head_dim, "prefill"].variant]["qrows"]
        gcap = (rows // 2 + 1 + -(-rows * group // gqrows)) * _NSH if cascade else 0
        plan_bytes = 4 * (_PLAN_HDR + 4 * list_cap + (6 * rows + 3) // 4 * 4 + 4 * (rows // 2 + 1) + 4 * gcap)
        part_bytes = 4 * split_items * n_kv_heads * qrows * (head_dim + 2)
        cpart_bytes = 4 * rows * n_heads * (1 + _NSH) * (head_dim + 2) if cascade else 0
        return list_cap, split_cap, plan_bytes, part_bytes, gcap, cpart_bytes

    def reserve(self, rows: int, n_heads: int, n_kv_heads: int, head_dim: int,
                decode: bool = False, variant: str | None = None, split: int | None = None,
                cascade: bool = False) -> None:
        """Allocates the scratch a launch of ``rows`` padded rows with this choice needs (call
        outside a capture, with the arguments the captured run will get; ``cascade``: the
        grouped rows' partials too, ``rows * n_heads * 5 * (head_dim + 2)`` floats)."""
        choice = self.choose(head_dim, decode, variant, split)
        _, _, plan_bytes, part_bytes, _, cpart_bytes = self._sizes(rows, n_heads, n_kv_heads, head_dim,
                                                                   choice, cascade)
        if plan_bytes > self._plan_bytes:
            self._plan = self._alloc(plan_bytes, "tensor-core work list")
            self._plan_bytes = plan_bytes
        if part_bytes > self._part_bytes:
            self._part = self._alloc(part_bytes, "tensor-core split partials")
            self._part_bytes = part_bytes
        if cascade and 4 * rows > self._share_bytes:
            # zeros: a plan that reads shares no call wrote groups nothing
            self._share = self._alloc(4 * rows, "tensor-core shared prefixes")
            check(cu.cuMemsetD32(self._share, 0, rows), "cuMemsetD32")
            self._share_bytes = 4 * rows
        if cpart_bytes > self._cpart_bytes:
            self._cpart = self._alloc(cpart_bytes, "tensor-core grouped partials")
            self._cpart_bytes = cpart_bytes
        if self._hopper_takes(head_dim, decode, variant, split, None):
            self._reserve_hopper(rows, n_heads, n_kv_heads)

    def _hopper_takes(self, head_dim: int, decode: bool, variant: str | None, split: int | None,
                      order: int | None, window: int = 0, cascade: int = 0) -> bool:
        """Whether a launch with these arguments runs the sm_90a prefill kernels: a prefill
        step of a windowless bf16 layer at head_dim 64 or 128 with the table's choice (a
        variant, split or order given, a decode step, a window or grouped rows keep the sm_80
        kernels)."""
        return (self.hopper is not None and not decode and variant is None and split is None
                and order is None and window == 0 and cascade == 0 and head_dim in HOPPER_HEAD_DIMS)

    def _reserve_hopper(self, rows: int, n_heads: int, n_kv_heads: int) -> None:
        nbytes = 16 * (1 + hopper_units_cap(rows, n_heads, n_kv_heads))
        if nbytes > self._plan90_bytes:
            self._plan90 = self._alloc(nbytes, "sm_90a work list")
            self._plan90_bytes = nbytes
            self._plan90_made = False

    def _alloc(self, nbytes: int, what: str) -> int:
        ptr = int(check(cu.cuMemAlloc(nbytes), f"cuMemAlloc({what})"))
        self._live.append(ptr)
        return ptr

    # -- the launch ----------------------------------------------------------------------------
    def run(self, view: dict, rows: int, q: int, q_strides: tuple[int, int], k_pool: int,
            v_pool: int, out: int, out_strides: tuple[int, int], n_heads: int, n_kv_heads: int,
            head_dim: int, window: int, stream: int, scale: float | None = None,
            decode: bool = False, variant: str | None = None, split: int | None = None,
            order: int | None = None, kv_scale: int = 0, cascade: int = 0,
            share: bool = False, fresh: bool = True, live_rows: int = 0) -> bool:
        """Paged attention of query rows ``[0, rows)`` (any mix of decode and prefill rows).

        ``view`` holds the device addresses of ``qo_indptr``, ``kv_indptr``, ``kv_indices``
        and ``width``; q and out are ``[rows, n_heads, head_dim]`` of the pool dtype at the
        given (token, head) element strides. ``decode=True`` says every run has one query
        (it only picks the table's decode variant: any variant is correct for any step);
        ``variant``, ``split``, ``order`` override the table (:class:`Choice`; ``split=0``
        never splits a run along kv: each row then runs its kv tiles from its first key in
        one unit, whatever else the step holds, which deterministic serving needs). Refuses
        (InvalidArgument, nothing launched) a shape :func:`supports` rejects or
        addresses/strides :func:`aligned` rejects. With 8-bit K/V pools (``kv_dtype``)
        ``kv_scale`` is the device address of the layer's float32 scales, K's
        ``[n_kv_heads]`` then V's (a stored value times its head's scale is the K or V it
        stands for); InvalidArgument without it.

        ``cascade`` > 0 (a multiple of :data:`CASCADE_ALIGN`; windowless layers only, else it
        is ignored) groups consecutive decode runs that share at least that many leading kv
        entries: the group's shared keys are read once for all its rows by the table's
        prefill variant (a second persistent launch), each row's own keys by its own unit,
        and the merge folds the two. ``share=True`` first finds, for this step, how many
        leading entries each run shares with the one before it (``tc_share``); later calls of
        the same step (the other layers) pass False and reuse it. A share left from another
        step is checked against this step's lists before any group is formed, so it can only
        cost sharing, never a wrong row.

        ``fresh=False`` keeps the work list the last launch made when this launch's plan
        inputs are the same (its view, rows, heads, window, variant, split and cascade): the
        other layers of a step whose first layer planned it (``tc_plan`` is a single block;
        once a step instead of once a layer). A caller passes False only for launches of the
        same step, in the same order every time (a captured graph keeps the choice); a
        launch with ``fresh=True`` forgets both kernel families' lists.

        On a GPU of compute capability 9.0 with bf16 pools (``hopper``, chosen at load), a
        prefill step (``decode=False``) of a windowless layer at head_dim 64 or 128 with the
        table's choice (no ``variant``, ``split`` or ``order`` given) and no grouped rows runs
        the sm_90a kernels instead (``cuda/tc_sm90a.cu``: their own work list, ``tc90_plan``,
        then persistent warp-specialized CTAs; never split, so never a merge).

        ``live_rows`` is the caller's promise that at least that many of the step's runs have
        a query (a captured graph: in every step it replays). Without grouping (``cascade``
        0 or ignored) and at :meth:`unsplit_rows` or more, no run can be split, so the merge
        is not launched. Returns whether it was. InvalidArgument (nothing launched) unless
        live_rows is an int in ``[0, rows]``.
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
        if self.kv8 and not kv_scale:
            raise InvalidArgument("8-bit K/V pools need kv_scale, the device address of the layer's scales")
        if scale is not None and not scale > 0:
            # the kernel takes row maxima of the raw scores and folds the scale into the exp
            raise InvalidArgument(f"scale={scale} must be > 0")
        if cascade < 0 or cascade % CASCADE_ALIGN:
            raise InvalidArgument(f"cascade={cascade} must be 0 (off) or a positive multiple of "
                                  f"{CASCADE_ALIGN}")
        if isinstance(live_rows, bool) or not isinstance(live_rows, int) \
                or not 0 <= live_rows <= max(rows, 0):
            raise InvalidArgument(f"live_rows={live_rows!r} must be an int in [0, rows={rows}]")
        choice = self.choose(head_dim, decode, variant, split, order)
        if rows < 1:
            return False
        if fresh:
            # a new step: neither kernel family's last list is this step's, whichever launched
            # it (a windowed layer's sm_80 list, then a windowless layer's sm_90a one, ...)
            self._plan_key = self._plan90_key = None
        cascade = cascade if window == 0 and rows > 1 else 0
        if self._hopper_takes(head_dim, decode, variant, split, order, window, cascade):
            self._run_hopper(view, rows, q, q_strides, k_pool, v_pool, out, out_strides, n_heads,
                             n_kv_heads, head_dim, stream, scale, fresh)
            return False
        list_cap, split_cap, plan_bytes, part_bytes, gcap, cpart_bytes = self._sizes(
            rows, n_heads, n_kv_heads, head_dim, choice, cascade > 0)
        if (plan_bytes > self._plan_bytes or part_bytes > self._part_bytes
                or cpart_bytes > self._cpart_bytes or (cascade and 4 * rows > self._share_bytes)):
            if drv.capturing(stream):
                raise InvalidState(
                    f"the tensor-core scratch for rows={rows} is not allocated and the stream is "
                    "being captured; call reserve() with these shapes before the capture")
            self.reserve(rows, n_heads, n_kv_heads, head_dim, decode, choice.variant, choice.split,
                         cascade > 0)
        v = self.variants[head_dim][choice.variant]
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale

        def pack(mode: int) -> bytes:
            return _ARGS.pack(view["qo_indptr"], view["kv_indptr"], view["kv_indices"], view["width"],
                              q, k_pool, v_pool, out, q_strides[0], q_strides[1], out_strides[0],
                              out_strides[1], rows, n_heads, n_kv_heads, group, window, self._plan,
                              self._part, list_cap, split_cap, choice.split * v["ctas"],
                              scale * _LOG2E, kv_scale if self.kv8 else 0, mode, gcap,
                              self._cpart if cascade else 0, self._share if cascade else 0)

        args = pack(0)
        n = len(args)
        min_chunk = 2 * v["kv_tile"]
        vg = self.variants[head_dim][self.table[head_dim, "prefill"].variant]
        if cascade and share:
            _launch.launch(self.f_share, (-(-rows // (THREADS // 32)), 1, 1), THREADS, 0, stream, args, (0,))
        plan_args = struct.pack("=iiiiiii", v["qrows"], min_chunk, head_dim, choice.order, cascade,
                                vg["qrows"], vg["ctas"])
        # what the work list depends on (not q, the pools or out; the partials' addresses
        # are the same while the scratch is)
        key = (args[:32], rows, n_heads, n_kv_heads, window, list_cap, split_cap, gcap,
               choice.split * v["ctas"], self._plan, self._part, self._cpart, self._share, plan_args)
        if fresh or key != self._plan_key or cascade and share:
            _launch.launch(self.f_plan, (1, 1, 1), PLAN_THREADS, 0, stream, args + plan_args,
                           (0, n, n + 4, n + 8, n + 12, n + 16, n + 20, n + 24))
            self._plan_key = key
        _launch.launch(v["f"], (v["ctas"], 1, 1), THREADS, v["smem"], stream, args, (0,))
        if cascade:
            _launch.launch(vg["f"], (vg["ctas"], 1, 1), THREADS, vg["smem"], stream, pack(1), (0,))
        if not cascade and live_rows >= self._unsplit(choice, head_dim, n_kv_heads):
            return False      # no run split, no row grouped: tc_attend wrote every row
        # a warp a (row, head) where the rows allow (the merge waits on loads, not on math)
        merge_ctas = min(16 * self.sm_count, max(4 * self.sm_count, -(-rows * n_heads // (THREADS // 32))))
        _launch.launch(self.f_merge, (merge_ctas, 1, 1), THREADS, 0, stream,
                       args + struct.pack("=ii", head_dim, v["qrows"]), (0, n, n + 4))
        return True

    def _run_hopper(self, view: dict, rows: int, q: int, q_strides: tuple[int, int], k_pool: int,
                    v_pool: int, out: int, out_strides: tuple[int, int], n_heads: int, n_kv_heads: int,
                    head_dim: int, stream: int, scale: float | None, fresh: bool) -> None:
        """tc90_plan (unless ``fresh=False`` finds this step's list made) and the persistent
        sm_90a launch, one CTA an SM; no split, so no merge."""
        cap = hopper_units_cap(rows, n_heads, n_kv_heads)
        if 16 * (1 + cap) > self._plan90_bytes:
            if drv.capturing(stream):
                raise InvalidState(
                    f"the sm_90a work list for rows={rows} is not allocated and the stream is "
                    "being captured; call reserve() with these shapes before the capture")
            self._reserve_hopper(rows, n_heads, n_kv_heads)
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        args = _ARGS90.pack(view["qo_indptr"], view["kv_indptr"], view["kv_indices"], view["width"], q,
                            k_pool, v_pool, out, q_strides[0], q_strides[1], out_strides[0], out_strides[1],
                            rows, n_heads, n_kv_heads, self._plan90, cap, scale * _LOG2E)
        key = (args[:32], rows, n_heads, n_kv_heads, self._plan90, cap)
        if fresh or key != self._plan90_key:
            _launch.launch(self.hopper["plan"], (1, 1, 1), 1024, 0, stream, args, (0,))
            self._plan90_key = key
            self._plan90_made = True
        _launch.launch(self.hopper[self._hopper_entry, head_dim], (self.sm_count, 1, 1), HOPPER_THREADS,
                       hopper_smem(head_dim), stream, args, (0,))

    def plan_header(self) -> dict[str, int]:
        """The last launch's plan as the device left it (waits for the device): units of the
        runs' own pass and of the shared (cascade) pass, the kv split size, and whether some
        run was split or some rows grouped."""
        if not self._plan:
            raise InvalidState("no launch has made a plan yet")
        check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        hdr = np.zeros(_PLAN_HDR, dtype=np.int32)
        check(cu.cuMemcpyDtoH(hdr.ctypes.data, self._plan, hdr.nbytes), "cuMemcpyDtoH")
        return {"units": int(hdr[0]), "chunk": int(hdr[1]), "split": int(hdr[3]),
                "shared_units": int(hdr[4]), "grouped": int(hdr[6])}

    def hopper_units(self) -> np.ndarray:
        """The last sm_90a launch's work list as the device left it (waits for the device):
        int32 ``[units, 4]`` of (run, kv head, first packed row, 0), run by run, kv head by kv
        head, each pair's 128-row blocks last (heaviest) first."""
        if not self._plan90_made:
            raise InvalidState("no sm_90a launch has made a work list yet")
        check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        n = np.zeros(4, dtype=np.int32)
        check(cu.cuMemcpyDtoH(n.ctypes.data, self._plan90, n.nbytes), "cuMemcpyDtoH")
        units = np.zeros((int(n[0]), 4), dtype=np.int32)
        if units.size:
            check(cu.cuMemcpyDtoH(units.ctypes.data, self._plan90 + 16, units.nbytes), "cuMemcpyDtoH")
        return units

    def describe(self, head_dim: int, decode: bool = False, variant: str | None = None) -> dict[str, Any]:
        """Tile shape, shared memory and persistent grid of the variant a run would launch."""
        c = self.choose(head_dim, decode, variant)
        v = {k: x for k, x in self.variants[head_dim][c.variant].items() if k != "f"}
        return {"variant": c.variant, "split": c.split, "order": c.order, **v, "threads": THREADS}
