"""The attention kernels of ``cuda/attention.cu``, launched through the driver API.

:class:`AttentionKernels` loads them for one K/V dtype in the device's primary context and
launches them on any stream (a torch stream included; a launch on a capturing stream is
captured into the graph). Arguments are raw device addresses and element strides, so any
framework's tensors can be passed. A cache's kernels come from
``CudaCellCache.attention_kernels()``: loaded once per cache, released when it closes.
"""

from __future__ import annotations

import ctypes
import math
import struct
from typing import Any

from ..errors import InvalidArgument, InvalidState
from . import _launch
from . import driver as drv
from .driver import check, cu

__all__ = ["PATHS", "AttentionKernels", "choose_path", "copy_unit", "decode_heads", "decode_layout",
           "flashinfer_supports", "paged_supports", "prefill_layout", "supported_head_dim",
           "tensor_cores", "write_rows"]

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
#: the largest head_dim and query heads per kv head the paged kernels take
MAX_HEAD_DIM = 256
MAX_GROUP = 16
#: query heads one paged_decode thread holds: the kernels paged_decode_T_g{N}
decode_heads = (1, 2, 4)
#: cuda/attention.cu's defaults of its attention_config (the module's copy is what a launch
#: uses; a CPU test checks these against the source)
DEFAULT_CONFIG = {"decode_stages": 3, "prefill_stages": 2, "prefill_maxp": 16, "plan_threads": 1024}
_STAGE_BYTES = 8192        # K bytes of one decode stage (V as many again)


def paged_supports(dtype: str, head_dim: int, group: int) -> bool:
    """Whether cellcache's CUDA-core paged kernels (decode and prefill) take this K/V dtype,
    head_dim (a multiple of 8 up to 256) and group (query heads per kv head, 1 to 16)."""
    return (dtype in _ITEMSIZE and isinstance(head_dim, int) and isinstance(group, int)
            and 8 <= head_dim <= MAX_HEAD_DIM and head_dim % 8 == 0 and 1 <= group <= MAX_GROUP)


def supported_head_dim(dtype: str, head_dim: int) -> bool:
    """Whether the paged kernels take this head_dim for ``dtype`` (any group they take)."""
    return paged_supports(dtype, head_dim, 1)


def copy_unit(itemsize: int, *byte_values: int) -> int:
    """The widest K/V copy (16, 8, 4 or 2 bytes, at least one element) that every address
    and byte stride in ``byte_values`` is a multiple of; 0 when even one element is
    misaligned."""
    for cb in (16, 8, 4, 2):
        if cb >= itemsize and all(v % cb == 0 for v in byte_values):
            return cb
    return 0


def _pow2ceil(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def decode_layout(dtype: str, head_dim: int, group: int, stages: int = DEFAULT_CONFIG["decode_stages"],
                  threads: int | None = None) -> dict[str, int]:
    """The decode kernel's block shape for a supported shape: ``heads`` per thread (the
    kernel variant), ``bdx`` lanes over head_dim (8 dims each, a power of two), ``bdy``
    head slots, ``bdz`` row slots (``bdx * bdy * bdz`` = threads), ``tile`` rows per stage
    (a multiple of ``bdz``, at most ``threads``), the stage row ``pitch`` and dynamic
    shared ``smem`` bytes (the ring, or the row slots' merge if larger). Mirrors
    ``paged_decode`` in cuda/attention.cu."""
    threads = threads or _launch.ATTN_THREADS
    isz = _ITEMSIZE[dtype]
    heads = 1 if group == 1 else 2 if group == 2 else 4
    bdx = _pow2ceil(-(-head_dim // 8))
    bdy = _pow2ceil(-(-group // heads))
    bdz = threads // (bdx * bdy)
    pitch = -(-head_dim * isz // 16) * 16
    tile = min(threads, max(bdz, _STAGE_BYTES // pitch // bdz * bdz))
    ring = stages * 2 * tile * pitch + stages * tile * 4
    merge = 4 * (bdz * bdy * heads * bdx * 8 + bdz * bdy * heads * 2)
    return {"heads": heads, "bdx": bdx, "bdy": bdy, "bdz": bdz, "tile": tile, "pitch": pitch,
            "smem": max(ring, merge)}


def prefill_layout(dtype: str, head_dim: int, group: int,
                   stages: int = DEFAULT_CONFIG["prefill_stages"]) -> dict[str, int]:
    """The prefill kernel's tiles for a supported shape: ``qt`` queries a tile (``pairs`` =
    qt x group (query, head) pairs, at most 64, 32 above head_dim 128), ``kt`` K/V rows a
    stage, the stage row ``pitch`` (an odd multiple of 16 bytes) and dynamic ``smem``
    bytes. Mirrors ``paged_prefill`` in cuda/attention.cu."""
    isz = _ITEMSIZE[dtype]
    rb = head_dim * isz
    kt = 32 if rb <= 256 else 16
    qt = max(1, (64 if head_dim <= 128 else 32) // group)
    pairs = qt * group
    units = -(-rb // 16)
    pitch = 16 * (units + 1 - units % 2)
    smem = stages * 2 * kt * pitch + stages * kt * 4 + 4 * (2 * pairs * head_dim + pairs * kt + 3 * pairs)
    return {"qt": qt, "pairs": pairs, "kt": kt, "pitch": pitch, "smem": smem}


#: the paths attention can take on a CUDA cache with the paged view, fastest first
PATHS = ("tc", "paged", "flashinfer", "sdpa")
#: head_dims FlashInfer's paged prefill kernels are known to take (f16/bf16)
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def tensor_cores() -> Any:
    """The tensor-core kernels' module (``cellcache.cuda.tc``), or None where it is absent
    or cannot be imported (its ``supports(dtype, head_dim, group)`` and ``aligned(...)``
    decide which shapes and addresses it takes)."""
    try:
        from . import tc
    except ImportError:
        return None
    return tc


def flashinfer_supports(dtype: str, head_dim: int, group: int) -> bool:
    """Whether FlashInfer's paged prefill wrapper takes this shape (f16/bf16 K/V, head_dim
    64, 128 or 256, any group)."""
    return dtype in ("float16", "bfloat16") and head_dim in FLASHINFER_HEAD_DIMS and group >= 1


def choose_path(dtype: str, head_dim: int, group: int, *, tc_aligned: bool = True,
                have_flashinfer: bool = False, has_masks: bool = False, kv8: bool = False) -> str:
    """The attention path for one layer's shape on a CUDA cache with the paged view: the one
    place the choice is made, at plan time, before anything is written.

    In order: ``"tc"``, the tensor-core kernels, where ``cellcache.cuda.tc`` imports, its
    ``supports(dtype, head_dim, group)`` holds and ``tc_aligned`` (the addresses and strides
    suit its 16-byte accesses); ``"paged"``, cellcache's CUDA-core kernels (head_dim a
    multiple of 8 up to 256, group 1 to 16, any alignment); ``"flashinfer"`` where it is
    installed (``have_flashinfer``) and takes the shape; ``"sdpa"`` over the layer's mask
    where the cache has masks (``has_masks``). A shape none of them takes raises
    InvalidArgument naming it. With 8-bit K/V pools (``kv8``) ``"tc"`` (its e4m3 variants),
    ``"flashinfer"`` (its e4m3 K/V kernels) and ``"sdpa"`` (over the dequantized pools) read
    them.

    >>> choose_path("bfloat16", 12, 4, has_masks=True)
    'sdpa'
    """
    tc = tensor_cores()
    if tc is not None and tc_aligned and tc.supports(dtype, head_dim, group):   # the tensor-core hook
        return "tc"
    if kv8:
        if have_flashinfer and flashinfer_supports(dtype, head_dim, group):
            return "flashinfer"
        if has_masks:
            return "sdpa"
        raise InvalidArgument(
            f"no attention path reads 8-bit K/V at head_dim={head_dim}, group={group} ({dtype} q): the "
            "tensor-core kernels take float16/bfloat16 q with head_dim in (64, 80, 96, 128, 256), "
            "16-byte aligned, and group 1 to 64; FlashInfer (where installed) head_dim in "
            f"{FLASHINFER_HEAD_DIMS}; SDPA needs masks (mask_format 'bool' or 'bits')")
    if paged_supports(dtype, head_dim, group):
        return "paged"
    if have_flashinfer and flashinfer_supports(dtype, head_dim, group):
        return "flashinfer"
    if has_masks:
        return "sdpa"
    fi = ("FlashInfer is not installed" if not have_flashinfer else
          f"FlashInfer takes f16/bf16 with head_dim in {FLASHINFER_HEAD_DIMS}")
    raise InvalidArgument(
        f"no attention path computes head_dim={head_dim}, group={group} ({dtype}): cellcache's "
        f"kernels take head_dim a multiple of 8 in [8, {MAX_HEAD_DIM}] and group in [1, "
        f"{MAX_GROUP}]; {fi}; SDPA needs masks (build the cache with mask_format='bool' or 'bits')")


def _pack(*args: tuple[str, Any]) -> tuple[bytes, tuple[int, ...]]:
    """Packs (struct format, value) pairs back to back; bytes values go in as they are."""
    blob, offsets = b"", []
    for fmt, value in args:
        offsets.append(len(blob))
        blob += value if fmt == "raw" else struct.pack("=" + fmt, value)
    return blob, tuple(offsets)


class AttentionKernels:
    """``store_kv``, the dense ``attend`` and the paged kernels for one dtype.

    Example
    -------
    >>> k = AttentionKernels("bfloat16", sm_count=132)              # doctest: +SKIP
    >>> k.paged(view.paged_pointers(), rows, q_ptr, ..., stream=s)  # doctest: +SKIP
    """

    def __init__(self, dtype: str, sm_count: int):
        if dtype not in _ITEMSIZE:
            raise InvalidArgument(f"dtype={dtype!r} is not one of {', '.join(_ITEMSIZE)}")
        self.dtype = dtype
        self.sm_count = sm_count
        self.module = drv.load_module("attention")
        try:
            fn = lambda name: int(drv.function(self.module, name))  # noqa: E731
            self.f_store = fn(f"store_kv_{dtype}")
            self.f_attend = fn(f"attend_{dtype}")
            self.f_merge = fn(f"paged_merge_{dtype}")
            self.f_prefill = fn(f"paged_prefill_{dtype}")
            self.f_plan = fn("prefill_plan")
            self.f_decode = {g: fn(f"paged_decode_{dtype}_g{g}") for g in decode_heads}
            self.config = self._read_config()
        except BaseException:
            check(cu.cuModuleUnload(self.module), "cuModuleUnload")
            self.module = None
            raise
        self._workspace = 0
        self._workspace_bytes = 0
        self._tiles = 0
        self._tiles_bytes = 0
        self._retired: list[int] = []     # outgrown scratch: captured graphs may still use it
        self._smem: dict[int, int] = {}   # dynamic shared bytes each function is allowed
        self._per_sm: dict[tuple[int, int], int] = {}

    def _read_config(self) -> dict[str, int]:
        ptr, _ = check(cu.cuModuleGetGlobal(self.module, b"attention_config"), "cuModuleGetGlobal")
        buf = (ctypes.c_int32 * 4)()
        check(cu.cuMemcpyDtoH(ctypes.addressof(buf), ptr, 16), "cuMemcpyDtoH")
        return dict(zip(DEFAULT_CONFIG, (int(x) for x in buf)))

    def close(self) -> None:
        for ptr in (self._workspace, self._tiles, *self._retired):
            if ptr:
                check(cu.cuMemFree(ptr), "cuMemFree")
        self._workspace = self._tiles = 0
        self._retired = []
        if self.module is not None:
            check(cu.cuModuleUnload(self.module), "cuModuleUnload")
            self.module = None

    # -- launches ------------------------------------------------------------------------------
    def store_kv(self, cells: int, rows: int, k: int, v: int, s_tok: int, s_head: int,
                 k_pool: int, v_pool: int, n_kv_heads: int, head_dim: int, stream: int) -> None:
        """Writes ``rows`` K and V rows (element (t, h, d) at ``t * s_tok + h * s_head + d``,
        pool dtype) into the pools at ``cells[:rows]``."""
        blob, offs = _pack(("Q", cells), ("i", rows), ("Q", k), ("Q", v), ("q", s_tok),
                           ("q", s_head), ("Q", k_pool), ("Q", v_pool), ("i", n_kv_heads),
                           ("i", head_dim))
        gx = max(1, min(64, -(-n_kv_heads * head_dim // _launch.ATTN_THREADS)))
        _launch.launch(self.f_store, (gx, rows, 1), _launch.ATTN_THREADS, 0, stream, blob, offs)

    def attend_dense(self, read_len: int, q: int, k_pool: int, v_pool: int, mask: int,
                     capacity: int, rows: int, n_heads: int, n_kv_heads: int, head_dim: int,
                     out: int, stream: int) -> None:
        """The dense reference kernel: float32 q/out ``[rows, n_heads, head_dim]`` over pool
        rows ``[0, *read_len)`` under a bool mask of row stride ``capacity``."""
        blob, offs = _pack(("Q", read_len), ("Q", q), ("Q", k_pool), ("Q", v_pool), ("Q", mask),
                           ("q", capacity), ("i", n_heads), ("i", n_kv_heads), ("i", head_dim),
                           ("Q", out))
        _launch.launch(self.f_attend, (rows, n_heads, 1), _launch.ATTN_THREADS, 0, stream, blob, offs)

    def splits_for(self, rows: int, n_kv_heads: int, per_sm: int = 4) -> int:
        """Splits per (row, kv head): the fewest (1 to 32) whose blocks, ``per_sm`` resident
        on each SM, finish in the fewest rounds of the device's slots per unit of work
        (a row's list is cut in tile-aligned chunks, one per split)."""
        blocks = max(1, rows * n_kv_heads)
        slots = max(1, per_sm * self.sm_count)
        cost = {s: -(-blocks * s // slots) / s for s in range(1, 33)}
        best = min(cost.values())
        return next(s for s in range(1, 33) if cost[s] <= best * 1.02)

    def _check(self, rows: int, n_heads: int, n_kv_heads: int, head_dim: int, k_pool: int,
               v_pool: int) -> tuple[int, int]:
        """(group, copy unit) of a paged launch, or InvalidArgument before anything runs."""
        if self.module is None:
            raise InvalidState("the attention kernels are closed")
        if rows < 1 or n_kv_heads < 1 or n_heads < 1 or n_heads % n_kv_heads:
            raise InvalidArgument(f"rows={rows}, n_heads={n_heads}, n_kv_heads={n_kv_heads}: rows "
                                  "and heads must be >= 1 and n_heads a multiple of n_kv_heads")
        group = n_heads // n_kv_heads
        if not paged_supports(self.dtype, head_dim, group):
            raise InvalidArgument(
                f"head_dim={head_dim}, group={group} ({self.dtype}) is not taken by the paged "
                f"kernels: head_dim must be a multiple of 8 in [8, {MAX_HEAD_DIM}] and the group "
                f"(query heads per kv head) in [1, {MAX_GROUP}]; use choose_path() for a fallback")
        isz = _ITEMSIZE[self.dtype]
        cb = copy_unit(isz, k_pool, v_pool, head_dim * isz)
        if not cb:
            raise InvalidArgument(f"the K/V pools at {k_pool:#x}, {v_pool:#x} are not aligned to "
                                  f"their {self.dtype} elements")
        return group, cb

    def _prepare(self, fn: int, smem: int) -> int:
        """Allows ``fn`` ``smem`` dynamic shared bytes; returns its resident blocks per SM."""
        if smem > self._smem.get(fn, 48 << 10):
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(cu.cuFuncSetAttribute(fn, attr, smem), "cuFuncSetAttribute")
            self._smem[fn] = smem
        key = (fn, smem)
        if key not in self._per_sm:
            n = check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, _launch.ATTN_THREADS, smem),
                      "cuOccupancyMaxActiveBlocksPerMultiprocessor")
            self._per_sm[key] = max(1, int(n))
        return self._per_sm[key]

    def _args(self, view: dict, q_strides: tuple[int, int], out_strides: tuple[int, int],
              rows: int, n_heads: int, n_kv_heads: int, head_dim: int, window: int,
              scale: float | None) -> bytes:
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        return _launch.paged_args(view["qo_indptr"], view["kv_indptr"], view["kv_indices"],
                                  view["width"], q_strides[0], q_strides[1], out_strides[0],
                                  out_strides[1], rows, n_heads, n_kv_heads, head_dim, window,
                                  scale)

    def paged(self, view: dict, rows: int, q: int, q_strides: tuple[int, int], k_pool: int,
              v_pool: int, out: int, out_strides: tuple[int, int], n_heads: int, n_kv_heads: int,
              head_dim: int, window: int, stream: int, scale: float | None = None,
              splits: int | None = None) -> None:
        """Paged attention (any mix of decode and prefill rows) for query rows ``[0, rows)``,
        one block per (row, kv head, split): the decode kernel.

        ``view`` holds the device addresses of ``qo_indptr``, ``kv_indptr``, ``kv_indices``
        and ``width`` (the cache's buffers); q and out are ``[rows, n_heads, head_dim]`` of
        the pool dtype with the given (token, head) element strides (any: they are read and
        written element by element). Launch shapes depend only on ``rows`` and the heads, so
        the launch can be captured and replayed for any step padded to rows (call once
        outside a capture first: the split workspace is allocated then). A shape the kernels
        do not take (:func:`paged_supports`) raises InvalidArgument and launches nothing.
        """
        group, cb = self._check(rows, n_heads, n_kv_heads, head_dim, k_pool, v_pool)
        lay = decode_layout(self.dtype, head_dim, group, self.config["decode_stages"])
        fn = self.f_decode[lay["heads"]]
        per_sm = self._prepare(fn, lay["smem"])
        splits = splits or self.splits_for(rows, n_kv_heads, per_sm)
        args = self._args(view, q_strides, out_strides, rows, n_heads, n_kv_heads, head_dim,
                          window, scale)
        part = 0
        if splits > 1:
            part = self._ensure_workspace(4 * rows * n_heads * splits * (head_dim + 2), stream)
        blob, offs = _pack(("raw", args), ("i", lay["bdx"]), ("i", lay["bdy"]), ("i", lay["tile"]),
                           ("i", cb), ("Q", q), ("Q", k_pool), ("Q", v_pool), ("Q", part), ("Q", out))
        _launch.launch(fn, (rows, n_kv_heads, splits), _launch.ATTN_THREADS, lay["smem"], stream,
                       blob, offs)
        if splits > 1:
            blob, offs = _pack(("raw", args), ("i", splits), ("Q", part), ("Q", out))
            _launch.launch(self.f_merge, (rows, n_heads, 1), _launch.ATTN_THREADS, 0, stream,
                           blob, offs)

    def prefill(self, view: dict, rows: int, q: int, q_strides: tuple[int, int], k_pool: int,
                v_pool: int, out: int, out_strides: tuple[int, int], n_heads: int, n_kv_heads: int,
                head_dim: int, window: int, stream: int, scale: float | None = None) -> None:
        """Paged attention of query rows ``[0, rows)`` with query tiles sharing each staged
        K/V tile: the prefill kernel. Same arguments as :meth:`paged`; padding rows give zeros.

        The work list is built on the device (``prefill_plan`` from ``qo_indptr`` and
        ``width``) and the grid depends only on ``rows`` and the heads: no host sync, so the
        launch can be captured and replayed for any step padded to ``rows`` (call once
        outside a capture first: the work list is allocated then).
        """
        group, cb = self._check(rows, n_heads, n_kv_heads, head_dim, k_pool, v_pool)
        lay = prefill_layout(self.dtype, head_dim, group, self.config["prefill_stages"])
        per_sm = self._prepare(self.f_prefill, lay["smem"])
        tiles = self._ensure_tiles(4 * (rows + 1), stream)
        args = self._args(view, q_strides, out_strides, rows, n_heads, n_kv_heads, head_dim,
                          window, scale)
        blob, offs = _pack(("raw", args), ("i", lay["qt"]), ("Q", tiles))
        _launch.launch(self.f_plan, (1, 1, 1), self.config["plan_threads"], 0, stream, blob, offs)
        gx = max(1, min(rows, -(-2 * per_sm * self.sm_count // n_kv_heads)))
        blob, offs = _pack(("raw", args), ("i", lay["qt"]), ("i", lay["kt"]), ("i", cb),
                           ("Q", tiles), ("Q", q), ("Q", k_pool), ("Q", v_pool), ("Q", out))
        _launch.launch(self.f_prefill, (gx, n_kv_heads, 1), _launch.ATTN_THREADS, lay["smem"],
                       stream, blob, offs)

    # -- scratch ---------------------------------------------------------------------------------
    # A graph captured earlier keeps the address it saw, so outgrown scratch is kept (until
    # close) rather than freed; run each shape once outside a capture first.
    def _grow(self, ptr: int, nbytes: int, what: str, stream: int) -> int:
        if drv.capturing(stream):
            raise InvalidState(f"the attention {what} must grow to {nbytes} bytes while the stream "
                               "is being captured; run this shape once before the capture")
        if ptr:
            self._retired.append(ptr)
        return int(check(cu.cuMemAlloc(nbytes), f"cuMemAlloc(attention {what})"))

    def _ensure_workspace(self, nbytes: int, stream: int) -> int:
        if nbytes > self._workspace_bytes:
            self._workspace = self._grow(self._workspace, nbytes, "split workspace", stream)
            self._workspace_bytes = nbytes
        return self._workspace

    def _ensure_tiles(self, nbytes: int, stream: int) -> int:
        if nbytes > self._tiles_bytes:
            self._tiles = self._grow(self._tiles, nbytes, "prefill work list", stream)
            self._tiles_bytes = nbytes
        return self._tiles


def write_rows(cache: Any, layer: int, k: Any, v: Any, width: int, pad_to: int,
               stream: int = 0) -> None:
    """The reference consumer's K/V write on a CUDA cache: the step's host rows (and NaN
    padding rows) go up into the cache's ``"write_rows"`` scratch, and ``store_kv`` writes
    them at ``cells[:pad_to]`` on the device."""
    import numpy as np

    kern = cache.attention_kernels()
    lay = cache.layer(layer)
    cfg = cache.config.layers[layer]
    dtype = cache.config.np_dtype
    rows = np.full((2, pad_to, cfg.n_kv_heads, cfg.head_dim), np.nan, np.float32)
    rows[0, :width], rows[1, :width] = k[:width], v[:width]
    data = np.ascontiguousarray(rows.astype(dtype))
    check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")     # scratch free to reuse
    scratch = cache.scratch("write_rows", data.nbytes)
    check(cu.cuMemcpyHtoD(scratch, data.ctypes.data, data.nbytes), "cuMemcpyHtoD")
    half = data.nbytes // 2
    kern.store_kv(cache.buffer("cells").ptr, pad_to, scratch, scratch + half,
                  cfg.n_kv_heads * cfg.head_dim, cfg.head_dim, lay.k.ptr, lay.v.ptr,
                  cfg.n_kv_heads, cfg.head_dim, stream)
