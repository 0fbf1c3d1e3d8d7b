"""The kernels of ``cuda/fused.cu``, launched through the driver API: the native model
path's elementwise ones (RMSNorm with the residual add, SiLU-and-multiply, rotary embedding)
and the host tier's row mover.

:func:`fused_kernels` loads them once per device in its primary context (the one PyTorch
uses); the launches take raw device addresses and element strides and run on any stream
(a capturing one included), like :class:`cellcache.cuda.kernels.AttentionKernels`.
:mod:`cellcache.native` and :mod:`cellcache.generate.spill` call them on torch tensors.
"""

from __future__ import annotations

import struct
import threading

from ..errors import InvalidArgument
from . import _launch
from . import driver as drv
from .driver import check, cu

__all__ = ["DTYPES", "SAMPLE_MAX_VOCAB", "THREADS", "FusedKernels", "fused_kernels", "vector_width"]

#: Element dtypes the kernels are built for, and their sizes.
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}
#: Threads of every block (``THREADS`` in cuda/fused.cu; a CPU test checks the source).
THREADS = 256
_VEC = {4: 4, 2: 8}           # the vectorized variant's width: 16 bytes


def vector_width(itemsize: int, width: int, *strides: int) -> int:
    """The widest variant (16 bytes of elements, or 1) a launch over rows of ``width``
    elements may take: when ``width`` and every row stride in ``strides`` (in elements)
    are multiples of it (the caller checks the addresses)."""
    v = _VEC[itemsize]
    return v if width % v == 0 and all(e % v == 0 for e in strides) else 1


class FusedKernels:
    """The kernels of ``cuda/fused.cu`` in one device's primary context.

    >>> k = fused_kernels(0)                                                # doctest: +SKIP
    >>> k.add_rms_norm("bfloat16", rows, hidden, x, s_x, res, s_res, w, out, s_out,
    ...                1e-6, True, stream)                                  # doctest: +SKIP
    """

    def __init__(self, device: int):
        self.ctx = drv.Context(device)
        if not _launch.entry_points_set():    # (set by the first CUDA cache otherwise)
            _launch.set_entry_points(drv.entry_points(_launch.ENTRY_POINTS))
        self.module = drv.load_module("fused")
        fn = lambda name: int(drv.function(self.module, name))  # noqa: E731
        self.f_norm = {(d, v): fn(f"add_rms_norm_{d}_v{v}") for d, s in DTYPES.items()
                       for v in (1, _VEC[s])}
        self.f_silu = {(d, v): fn(f"silu_mul_{d}_v{v}") for d, s in DTYPES.items()
                       for v in (1, _VEC[s])}
        self.f_rotary = {d: fn(f"rotary_{d}") for d in DTYPES}
        self.f_rotary_store = {d: fn(f"rotary_store_{d}") for d in DTYPES}
        self.f_move = {v: fn(f"move_rows_v{v}") for v in (1, 16)}
        self.f_sample = fn("sample_rows")
        self.f_logits = {(d, v): fn(f"logits_out_{d}_v{v}") for d, s in DTYPES.items()
                         for v in (1, _VEC[s])}

    def make_current(self) -> None:
        """Makes the device's primary context current on this thread (a thread PyTorch has
        not run on yet has none)."""
        self.ctx.make_current()

    def add_rms_norm(self, dtype: str, rows: int, hidden: int, x: int, s_x: int, res_in: int,
                     s_in: int, res_out: int, s_res: int, w: int, out: int, s_out: int,
                     eps: float, add: bool, stream: int) -> None:
        """``out = w * norm(res_in + x)`` with ``res_out = res_in + x`` (``add``; ``res_out``
        may be ``res_in``), else ``out = w * norm(x)`` (``res_*`` unused); rows of
        ``hidden`` contiguous elements at the given row strides (elements; addresses in
        bytes). No rows: nothing launched."""
        if rows == 0:
            return
        both = (s_x, s_out, s_in, s_res) if add else (s_x, s_out)
        v = vector_width(DTYPES[dtype], hidden, *both)
        if v > 1 and any(a % 16 for a in ((x, w, out, res_in, res_out) if add else (x, w, out))):
            v = 1                            # (the vector loads need 16-byte addresses)
        args = struct.pack(FORMATS["add_rms_norm"], x, res_in, res_out, w, out, hidden, s_x, s_in, s_res,
                           s_out, eps, int(add))
        _launch.launch(self.f_norm[dtype, v], (rows, 1, 1), THREADS, 0, stream, args, _NORM_OFFS)

    def silu_mul(self, dtype: str, rows: int, inter: int, gu: int, s_gu: int, out: int,
                 s_out: int, stream: int) -> None:
        """``out[:, :inter] = silu(gu[:, :inter]) * gu[:, inter:2 * inter]`` by rows."""
        if rows == 0:
            return
        v = vector_width(DTYPES[dtype], inter, s_gu, s_out)
        if v > 1 and (gu % 16 or out % 16):
            v = 1
        args = struct.pack(FORMATS["silu_mul"], gu, out, inter, s_gu, s_out)
        blocks = -(-inter // (THREADS * v))
        _launch.launch(self.f_silu[dtype, v], (rows, blocks, 1), THREADS, 0, stream, args, _SILU_OFFS)

    def rotary(self, dtype: str, rows: int, qkv: int, cos: int, sin: int, n_heads: int,
               head_dim: int, s_tok: int, s_cos: int, s_sin: int, stream: int) -> None:
        """Rotates heads ``[0, n_heads)`` (``head_dim`` contiguous elements each, from a row's
        start) of ``rows`` rows in place by each row's ``cos`` and ``sin``."""
        if head_dim % 2:
            raise InvalidArgument(f"rotary embedding over an odd head_dim ({head_dim})")
        if rows == 0:
            return
        args = struct.pack(FORMATS["rotary"], qkv, cos, sin, n_heads, head_dim, s_tok, s_cos, s_sin)
        blocks = -(-n_heads * (head_dim // 2) // THREADS)
        _launch.launch(self.f_rotary[dtype], (rows, blocks, 1), THREADS, 0, stream, args, _ROTARY_OFFS)

    def rotary_store(self, dtype: str, rows: int, qkv: int, cos: int, sin: int, cells: int,
                     k_pool: int, v_pool: int, n_q: int, n_kv: int, head_dim: int, s_tok: int,
                     s_cos: int, s_sin: int, stream: int) -> None:
        """:meth:`rotary` over a row's ``n_q + n_kv`` q and k heads, and the row's k heads
        (rotated) and the ``n_kv`` v heads after them written at pool row ``cells[r]`` (int64)
        of ``k_pool`` / ``v_pool`` (``[pool rows, n_kv, head_dim]``, contiguous, ``dtype``):
        the rotation and the attention's K/V write in one launch."""
        if head_dim % 2:
            raise InvalidArgument(f"rotary embedding over an odd head_dim ({head_dim})")
        if rows == 0:
            return
        args = struct.pack(FORMATS["rotary_store"], qkv, cos, sin, cells, k_pool, v_pool, n_q, n_kv,
                           head_dim, s_tok, s_cos, s_sin)
        blocks = -(-(n_q + 2 * n_kv) * (head_dim // 2) // THREADS)
        _launch.launch(self.f_rotary_store[dtype], (rows, blocks, 1), THREADS, 0, stream, args,
                       _ROTARY_STORE_OFFS)

    def move_rows(self, pools: int, n_pools: int, row_bytes: list[int], stage: int,
                  stage_rows: int, pool_idx: int, stage_idx: int, n: int, to_stage: bool,
                  vec: int, stream: int) -> None:
        """Moves rows ``pool_idx[j]`` (int64, device) of every pool and rows ``stage_idx[j]``
        (int64, device; 0: row ``j``) of the pool's part of ``stage``, ``j`` in ``[0, n)``:
        into the stage (``to_stage``) or out of it into the pools. ``pools``: a device table
        of ``n_pools`` records of three int64 (base address, ``row_bytes[p]``, the bytes of a
        row of the pools before it); part ``p`` of the stage starts ``stage_rows`` times that
        last figure in. ``vec`` 16 needs every row's bytes, pool base and the stage at a
        multiple of 16 (InvalidArgument where the rows or the stage are not; the pools'
        bases are the caller's to check); 1 takes any. Launched in pieces of rows small
        enough that a piece's units of ``vec`` bytes count below 2^31 (the kernel's 32-bit
        index). No rows or pools: nothing launched."""
        if vec not in self.f_move:
            raise InvalidArgument(f"vec {vec} is neither 1 nor 16")
        if n <= 0 or n_pools <= 0:
            return
        if n_pools > 65535 or len(row_bytes) != n_pools:
            raise InvalidArgument(f"{n_pools} pools with {len(row_bytes)} row sizes (at most 65535)")
        widest = max(row_bytes) // vec
        if widest <= 0 or any(b % vec for b in row_bytes):
            raise InvalidArgument(f"rows of {row_bytes} bytes do not split into units of {vec}")
        if vec > 1 and stage % vec:
            raise InvalidArgument(f"a stage at {stage:#x} is not at a multiple of {vec} bytes")
        if widest > _MAX_UNITS:
            raise InvalidArgument(f"a row of {widest} units of {vec} bytes is past one launch's "
                                  f"{_MAX_UNITS}")
        piece = _MAX_UNITS // widest
        for lo in range(0, n, piece):
            m = min(piece, n - lo)
            blocks = min(-(-m * widest // THREADS), _MAX_BLOCKS)
            # (no stage_idx: the stage's rows follow j from this piece's first, row0)
            args = struct.pack(FORMATS["move_rows"], pools, stage, stage_rows, pool_idx + 8 * lo,
                               stage_idx + 8 * lo if stage_idx else 0, lo, m, int(to_stage))
            _launch.launch(self.f_move[vec], (blocks, n_pools, 1), THREADS, 0, stream, args,
                           _MOVE_OFFS)

    def sample_rows(self, x: int, sx: int, vocab: int, n: int, rows: int, temp: int, unif: int,
                    out: int, stream: int) -> None:
        """Draws ``n`` tokens into ``out`` (int64): slot ``s`` from row ``rows[s]`` (int64;
        0: row ``s``) of the float32 logits at ``x`` (rows ``sx`` elements apart, ``vocab``
        wide) at temperature ``temp[s]`` with uniform ``unif[s]`` (both float64): the first
        id whose running sum of ``exp(x / T - max)`` passes ``u`` times the row's sum (the
        sampler's formula with neither top-k nor top-p). InvalidArgument for a vocabulary
        whose tile sums do not fit a block's shared memory (past :data:`SAMPLE_MAX_VOCAB`)."""
        if n <= 0:
            return
        if not 0 < vocab <= SAMPLE_MAX_VOCAB:
            raise InvalidArgument(f"a vocabulary of {vocab} is outside [1, {SAMPLE_MAX_VOCAB}]")
        smem = 8 * -(-vocab // SAMPLE_TILE)
        args = struct.pack(FORMATS["sample_rows"], x, sx, rows, temp, unif, out, vocab)
        _launch.launch(self.f_sample, (n, 1, 1), SAMPLE_THREADS, smem, stream, args, _SAMPLE_OFFS)

    def logits_out(self, dtype: str, rows: int, vocab: int, x: int, sx: int, out: int, so: int,
                   ids: int, stream: int, write: int = 0) -> None:
        """``out[r, :vocab] = float32(x[r, :vocab])`` and ``ids[r]`` (int64) = the row's
        argmax in ``torch.argmax``'s order (a NaN above every number, ties to the lowest
        id), ``r`` in ``[0, rows)``: rows ``sx`` / ``so`` elements apart, ``dtype`` the
        elements of ``x``. ``write``: the address of an int32 on the device; while it holds 0
        when the kernel runs, ``out`` is not written (0, the default: always written). One
        block a row. No rows: nothing launched."""
        if rows <= 0:
            return
        if not 0 < vocab < 2**31:
            raise InvalidArgument(f"a vocabulary of {vocab} is outside [1, 2**31)")
        v = vector_width(DTYPES[dtype], vocab, sx)
        if v > 1 and (x % 16 or out % 16 or so % 4):
            v = 1                            # (the vector loads and stores need 16 bytes)
        args = struct.pack(FORMATS["logits_out"], x, sx, out, so, ids, write, vocab)
        _launch.launch(self.f_logits[dtype, v], (rows, 1, 1), LOGIT_THREADS, 0, stream, args, _LOGITS_OFFS)

    def close(self) -> None:
        if self.module is not None:
            check(cu.cuModuleUnload(self.module), "cuModuleUnload")
            self.module = None
            self.ctx.release()


def _offsets(fmt: str) -> tuple[int, ...]:
    out, at = [], 0
    for c in fmt.lstrip("="):
        size = struct.calcsize("=" + c)
        out.append(at)
        at += size
    return tuple(out)


#: Each kernel's arguments as struct formats (standard sizes, no padding: each argument is
#: handed to the driver by its own address): a CPU test reads the PTX's parameter lists
FORMATS = {"add_rms_norm": "=QQQQQiqqqqfi", "silu_mul": "=QQiqq", "rotary_store": "=QQQQQQiiiqqq",
           "rotary": "=QQQiiqqq", "move_rows": "=QQqQQqii", "sample_rows": "=QqQQQQi",
           "logits_out": "=QqQqQQi"}
_NORM_OFFS = _offsets(FORMATS["add_rms_norm"])
_SILU_OFFS = _offsets(FORMATS["silu_mul"])
_ROTARY_OFFS = _offsets(FORMATS["rotary"])
_ROTARY_STORE_OFFS = _offsets(FORMATS["rotary_store"])
_MOVE_OFFS = _offsets(FORMATS["move_rows"])
_SAMPLE_OFFS = _offsets(FORMATS["sample_rows"])
_LOGITS_OFFS = _offsets(FORMATS["logits_out"])
#: logits_out: threads of its block (LOGIT_THREADS in cuda/fused.cu)
LOGIT_THREADS = 1024
#: sample_rows: threads of its block, elements of a warp's tile (SAMPLE_THREADS and SAMPLE_TILE
#: in cuda/fused.cu), and the largest vocabulary whose tile sums fit the 48 KiB of shared
#: memory a block gets without opting in, beside the kernel's own few hundred bytes
SAMPLE_THREADS = 512
SAMPLE_TILE = 128
SAMPLE_MAX_VOCAB = (48 * 1024 - 1024) // 8 * SAMPLE_TILE
#: Most units one move_rows launch indexes (its 32-bit unit index), and most blocks a pool
#: a launch (a grid-stride loop takes the rest); tests lower both
_MAX_UNITS = (1 << 31) - 1
_MAX_BLOCKS = 2048

_loaded: dict[int, FusedKernels] = {}
_lock = threading.Lock()


def fused_kernels(device: int) -> FusedKernels:
    """The kernels of ``device`` (an ordinal), loaded at the first call and kept for the
    process (a module of ~100 KB of PTX a device)."""
    k = _loaded.get(device)
    if k is None:
        with _lock:
            k = _loaded.get(device)
            if k is None:
                k = _loaded[device] = FusedKernels(device)
    return k
