"""The attention kernels of ``cuda/attention.cu``, launched through the driver API.

:class:`AttentionKernels` loads them for one K/V dtype in the device's primary context and
launches them on any stream (a torch stream included; a launch on a capturing stream is
captured into the graph). Arguments are raw device addresses and element strides, so any
framework's tensors can be passed. A cache's kernels come from
``CudaCellCache.attention_kernels()``: loaded once per cache, released when it closes.
"""

from __future__ import annotations

import math
import struct
from typing import Any

from ..errors import InvalidArgument
from . import _launch
from . import driver as drv
from .driver import check, cu

__all__ = ["AttentionKernels", "decode_groups", "supported_head_dim", "write_rows"]

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
#: query heads per kv head each paged_decode variant handles (the kernel's MAXG)
decode_groups = (1, 2, 4, 8, 16)


def supported_head_dim(dtype: str, head_dim: int) -> bool:
    """Whether the paged kernels take this head_dim: 16-byte vectors of the dtype spread
    over a power-of-two number of lanes (at most 32), and at most 256."""
    vec = 16 // _ITEMSIZE[dtype]
    if head_dim % vec or head_dim > 256:
        return False
    lanes = head_dim // vec
    return lanes >= 1 and 32 % lanes == 0


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
    >>> k.paged(cache, q_ptr, ..., stream=torch.cuda.current_stream().cuda_stream)  # doctest: +SKIP
    """

    def __init__(self, dtype: str, sm_count: int):
        if dtype not in _ITEMSIZE:
            raise InvalidArgument(f"dtype={dtype!r} is not one of {', '.join(_ITEMSIZE)}")
        self.dtype = dtype
        self.sm_count = sm_count
        self.module = drv.load_module("attention")
        fn = lambda name: int(drv.function(self.module, name))  # noqa: E731
        self.f_store = fn(f"store_kv_{dtype}")
        self.f_attend = fn(f"attend_{dtype}")
        self.f_merge = fn(f"paged_merge_{dtype}")
        self.f_prefill = fn(f"paged_prefill_{dtype}")
        self.f_decode = {g: fn(f"paged_decode_{dtype}_g{g}") for g in decode_groups}
        self._workspace = 0
        self._workspace_bytes = 0
        self._retired: list[int] = []     # outgrown workspaces: captured graphs may still use them
        self._tiles = 0
        self._tiles_bytes = 0
        self._prefill_smem = 0

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

    def splits_for(self, rows: int, n_kv_heads: int) -> int:
        """Splits per (row, kv head) that fill the device: about 4 blocks per SM."""
        return max(1, min(32, -(-4 * self.sm_count // max(1, rows * n_kv_heads))))

    def paged(self, view: dict, rows: int, q: int, q_strides: tuple[int, int], k_pool: int,
              v_pool: int, out: int, out_strides: tuple[int, int], n_heads: int, n_kv_heads: int,
              head_dim: int, window: int, stream: int, scale: float | None = None,
              splits: int | None = None) -> None:
        """Paged attention (any mix of decode and prefill rows) for query rows ``[0, rows)``.

        ``view`` holds the device addresses of ``qo_indptr``, ``kv_indptr``, ``kv_indices``
        and ``width`` (the cache's buffers); q and out are ``[rows, n_heads, head_dim]`` with
        the given (token, head) element strides. Launch shapes depend only on ``rows`` and
        the heads, so the launch can be captured and replayed for any step padded to rows.
        """
        group = n_heads // n_kv_heads
        if n_heads % n_kv_heads or group > decode_groups[-1]:
            raise InvalidArgument(
                f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}, at most "
                f"{decode_groups[-1]} per kv head")
        if not supported_head_dim(self.dtype, head_dim):
            raise InvalidArgument(f"head_dim={head_dim} is not supported by the paged kernels "
                                  f"for {self.dtype}")
        maxg = next(g for g in decode_groups if g >= group)
        splits = splits or self.splits_for(rows, n_kv_heads)
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        args = _launch.paged_args(view["qo_indptr"], view["kv_indptr"], view["kv_indices"],
                                  view["width"], q_strides[0], q_strides[1], out_strides[0],
                                  out_strides[1], rows, n_heads, n_kv_heads, head_dim, window,
                                  scale)
        part = 0
        if splits > 1:
            part = self._ensure_workspace(4 * rows * n_heads * splits * (head_dim + 2))
        blob, offs = _pack(("raw", args), ("Q", q), ("Q", k_pool), ("Q", v_pool), ("Q", part),
                           ("Q", out))
        _launch.launch(self.f_decode[maxg], (rows, n_kv_heads, splits), _launch.ATTN_THREADS, 0,
                       stream, blob, offs)
        if splits > 1:
            blob, offs = _pack(("raw", args), ("i", splits), ("Q", part), ("Q", out))
            _launch.launch(self.f_merge, (rows, n_heads, 1), _launch.ATTN_THREADS, 0, stream,
                           blob, offs)

    def prefill(self, view: dict, qo_indptr_host: Any, n_requests: int, width: int, q: int,
                q_strides: tuple[int, int], k_pool: int, v_pool: int, out: int,
                out_strides: tuple[int, int], n_heads: int, n_kv_heads: int, head_dim: int,
                window: int, stream: int, scale: float | None = None) -> None:
        """Paged attention of a step's real rows with query tiles staged in shared memory
        (eager only: the tiles come from the step's host ``qo_indptr``)."""
        import numpy as np

        group = n_heads // n_kv_heads
        if n_heads % n_kv_heads or group > _launch.PREFILL_PAIRS:
            raise InvalidArgument(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
        qt = max(1, _launch.PREFILL_PAIRS // group)
        qo = np.asarray(qo_indptr_host, dtype=np.int64)
        tiles = [q0 for r in range(n_requests) for q0 in range(int(qo[r]), int(qo[r + 1]), qt)
                 if q0 < width]
        if not tiles:
            return
        data = np.asarray(tiles, dtype=np.int32)
        ptr = self._ensure_tiles(data.nbytes)
        check(cu.cuMemcpyHtoDAsync(ptr, data.ctypes.data, data.nbytes, stream), "cuMemcpyHtoDAsync")
        check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")   # data is a temporary
        pairs = qt * group
        smem = 4 * (2 * pairs * head_dim + pairs * _launch.PREFILL_K + 3 * pairs) \
            + 2 * _launch.PREFILL_K * head_dim * _ITEMSIZE[self.dtype]
        if smem > self._prefill_smem:
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(cu.cuFuncSetAttribute(self.f_prefill, attr, smem), "cuFuncSetAttribute")
            self._prefill_smem = smem
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        args = _launch.paged_args(view["qo_indptr"], view["kv_indptr"], view["kv_indices"],
                                  view["width"], q_strides[0], q_strides[1], out_strides[0],
                                  out_strides[1], int(qo[n_requests]), n_heads, n_kv_heads,
                                  head_dim, window, scale)
        blob, offs = _pack(("raw", args), ("i", qt), ("Q", ptr), ("Q", q), ("Q", k_pool),
                           ("Q", v_pool), ("Q", out))
        _launch.launch(self.f_prefill, (len(tiles), n_kv_heads, 1), _launch.ATTN_THREADS, smem,
                       stream, blob, offs)

    # -- scratch ---------------------------------------------------------------------------------
    def _ensure_workspace(self, nbytes: int) -> int:
        # A graph captured earlier keeps the address it saw, so an outgrown workspace is kept
        # (until close) rather than freed; call once outside capture with each shape first.
        if nbytes > self._workspace_bytes:
            if self._workspace:
                self._retired.append(self._workspace)
            self._workspace = int(check(cu.cuMemAlloc(nbytes), "cuMemAlloc(attention workspace)"))
            self._workspace_bytes = nbytes
        return self._workspace

    def _ensure_tiles(self, nbytes: int) -> int:
        if nbytes > self._tiles_bytes:
            if self._tiles:
                check(cu.cuMemFree(self._tiles), "cuMemFree")
            self._tiles = int(check(cu.cuMemAlloc(nbytes), "cuMemAlloc(prefill tiles)"))
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
