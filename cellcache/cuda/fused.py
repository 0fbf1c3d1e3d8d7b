"""The elementwise kernels of ``cuda/fused.cu`` (the native model path's RMSNorm with the
residual add, SiLU-and-multiply and rotary embedding), launched through the driver API.

:func:`fused_kernels` loads them once per device in its primary context (the one PyTorch
uses); the launches take raw device addresses and element strides and run on any stream
(a capturing one included), like :class:`cellcache.cuda.kernels.AttentionKernels`.
:mod:`cellcache.native` calls them on torch tensors.
"""

from __future__ import annotations

import struct
import threading

from ..errors import InvalidArgument
from . import _launch
from . import driver as drv
from .driver import check, cu

__all__ = ["DTYPES", "THREADS", "FusedKernels", "fused_kernels", "vector_width"]

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
        args = struct.pack("=QQQQQiqqqqfi", x, res_in, res_out, w, out, hidden, s_x, s_in, s_res,
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
        args = struct.pack("=QQiqq", gu, out, inter, s_gu, s_out)
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
        args = struct.pack("=QQQiiqqq", qkv, cos, sin, n_heads, head_dim, s_tok, s_cos, s_sin)
        blocks = -(-n_heads * (head_dim // 2) // THREADS)
        _launch.launch(self.f_rotary[dtype], (rows, blocks, 1), THREADS, 0, stream, args, _ROTARY_OFFS)

    def close(self) -> None:
        if self.module is not None:
            check(cu.cuModuleUnload(self.module), "cuModuleUnload")
            self.module = None
            self.ctx.release()


def _offsets(fmt: str) -> tuple[int, ...]:
    out, at = [], 0
    for c in fmt:
        size = struct.calcsize("=" + c)
        out.append(at)
        at += size
    return tuple(out)


_NORM_OFFS = _offsets("QQQQQiqqqqfi")
_SILU_OFFS = _offsets("QQiqq")
_ROTARY_OFFS = _offsets("QQQiiqqq")

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
