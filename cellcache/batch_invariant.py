"""Batch-invariant torch ops: a row's result that does not depend on the rows beside it.

::

    op(x [R, ...])  inside BatchInvariant(rows=M)
        R rows ─► chunks of exactly M rows (the last one padded with zeros)
              ─► op(chunk) for each chunk, at one shape [M, ...] whatever R is
              ─► the real rows of each chunk, concatenated ─► [R, ...]

A linear (``aten::linear``, what the runner's inference-mode forwards reach) runs its chunks
as one strided-batched GEMM (``bmm`` with the weight broadcast) where a probe found that it
gives, chunk for chunk, the bits of each chunk's own GEMM; otherwise, and for a chunk count
met first inside a CUDA graph's capture, chunk by chunk. Its bias is added on its own.

Matrix products and row reductions pick their algorithm by shape: cuBLAS and oneDNN/MKL
choose tiles, split-K and thread partitions from M (the row count), and torch's reduction
kernels split a row differently when there are few rows. So a token's logits would depend
on how many other tokens its step carried. Run at one fixed M, each kernel sees the same
shape for every step, and a row's reduction order is then that shape's, the same in every
chunk: the row's result depends only on the row (its slot in the chunk changes nothing:
the kernels compute every row of a shape the same way, which the tests check).

:class:`BatchInvariant` is a ``TorchDispatchMode``: inside its ``with`` block (one thread's
ops only) it runs the ops of :data:`ROW_OPS` row-chunked and passes every other op through
untouched. It works on the ops as dispatch hands them over, whichever level that is
(``aten::linear``, ``rms_norm``, ``layer_norm`` whole in inference mode; with autograd on,
what they decompose into: ``addmm``, ``mm`` or ``bmm``, ``mean``, ``_fused_rms_norm``,
``native_layer_norm``): chunking at either level fixes the shapes below it. A reduction
over rows or along the last dim through any other op (``sum``, ``linalg_vector_norm``,
``var``, ``baddbmm``, a custom kernel) passes through at the call's shape: a model that
reduces through one is not batch-invariant in the mode. Its Python cost per op is paid by
eager forwards only: a CUDA graph captured inside the mode replays the fixed-shape kernels
without it.

Elementwise ops need nothing on CUDA (every element runs the same device function). On the
CPU torch's vectorized loops compute the remainder of a thread's range with scalar code
(libm's ``exp`` rather than Sleef's), so where a thread's range ends could change an
element's bits; ``cpu_threads=1`` (the host forward's setting) runs torch's intra-op work on
one thread inside the block, so every range is the whole tensor.

>>> with BatchInvariant(rows=256):                          # doctest: +SKIP
...     logits = model(input_ids=ids).logits                   # every GEMM at M = 256
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._checks import check_int

__all__ = ["MAX_BATCHED_CHUNKS", "ROWS", "ROW_OPS", "BatchInvariant", "batched_gemms", "chunk_rows"]

#: The default fixed row count of every chunked op: a decode step of 256 rows runs
#: unpadded; a smaller step pays a 256-row GEMM, which costs about what a small one does
#: while the weights' bytes bound it.
ROWS = 256
#: Base-address alignment every chunk's operand has (bytes): a library may choose its
#: kernel by the operands' alignment, so a chunk that is a slice and one that is a padded
#: copy must share it. The allocators give at least this; views elsewhere are copied.
_ALIGN = {"cuda": 256, "cpu": 64}
#: The ops run row-chunked (dispatch names); the module docstring says why each.
#: Norms are here because in inference mode (the runner's) ``rms_norm``/``layer_norm`` reach
#: dispatch whole, their inner reductions below the mode; with autograd on, a bias-free
#: ``linear`` of a 3-D input reaches it as ``bmm`` and a norm as its fused kernel.
ROW_OPS = ("aten::linear", "aten::mm", "aten::addmm", "aten::matmul", "aten::bmm", "aten::mean.dim",
           "aten::softmax.int", "aten::log_softmax.int", "aten::_softmax", "aten::_log_softmax",
           "aten::rms_norm", "aten::_fused_rms_norm", "aten::layer_norm", "aten::native_layer_norm")

# intra-op threads pinned by the CPU blocks now open: (count, the setting before the first)
_THREADS_LOCK = threading.Lock()
_threads_state: list[int] = [0, 0]


def chunk_rows(x: torch.Tensor, rows: int, fn: Callable[..., Any], *more: torch.Tensor) -> Any:
    """``fn`` over ``x``'s rows (dim 0) in chunks of exactly ``rows`` rows, the last padded
    with zeros; the real rows of the results concatenated. ``fn`` must map ``[rows, ...]`` to
    ``[rows, ...]`` row by row (or to a tuple of such tensors: a tuple of the concatenations
    then). ``more``: tensors with as many rows, chunked beside ``x`` and passed to ``fn``
    after its chunk. Every operand is first made contiguous at an aligned address, and a
    chunk that is a slice at an unaligned offset is copied, so every chunk (a slice or the
    padded copy) has the same alignment."""
    n = x.shape[0]
    xs = [_aligned(t) for t in (x, *more)]
    if n == rows:
        return fn(*xs)
    outs: list[Any] = []
    for s in range(0, max(n, 1), rows):
        chunks = [_aligned(t[s:s + rows]) for t in xs]
        k = chunks[0].shape[0]
        if k < rows:
            for i, c in enumerate(chunks):
                pad = c.new_zeros((rows, *c.shape[1:]))
                pad[:k] = c
                chunks[i] = pad
        y = fn(*chunks)
        outs.append(y if k == rows else (tuple(t[:k] for t in y) if isinstance(y, tuple) else y[:k]))
    if len(outs) == 1:
        return outs[0]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outs))
    return torch.cat(outs)


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a contiguous copy where it is not contiguous at an aligned address."""
    if not x.is_contiguous() or x.data_ptr() % _ALIGN.get(x.device.type, 64):
        return x.clone(memory_format=torch.contiguous_format)
    return x


def _last_dim(dim: Any, ndim: int) -> bool:
    """Whether ``dim`` (an int or a one-element list) names the last of ``ndim`` dims."""
    if isinstance(dim, Sequence):
        if len(dim) != 1:
            return False
        dim = dim[0]
    return isinstance(dim, int) and ndim >= 1 and dim % ndim == ndim - 1


def _rows_of(x: torch.Tensor, fn: Callable[[torch.Tensor], Any], rows: int,
             out_tail: tuple[int, ...], *more_tails: tuple[int, ...]) -> Any:
    """``fn`` over ``x`` viewed as ``[rows of the leading dims, last dim]``, reshaped to
    ``x``'s leading dims followed by ``out_tail`` (``fn`` returning a tuple: its tensors
    reshaped with ``out_tail``, then ``more_tails``)."""
    lead = tuple(x.shape[:-1])
    flat = x.reshape(-1, x.shape[-1])
    y = chunk_rows(flat, rows, fn)
    if isinstance(y, tuple):
        return tuple(t.reshape(*lead, *tail) for t, tail in zip(y, (out_tail, *more_tails)))
    return y.reshape(*lead, *out_tail)


def _linear(rows: int, func: Any, args: tuple, kwargs: dict) -> Any:
    # x @ w.T in chunks of rows by the batched GEMM (_gemm_chunks), then the bias added on
    # its own (an elementwise op: the same whatever the rows)
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if x.ndim < 1 or w.ndim != 2:
        return func(*args, **kwargs)
    plain = (torch.Tensor, torch.nn.Parameter)           # (a weight is a Parameter)
    if not (type(x) in plain and type(w) in plain and x.dtype == w.dtype and x.device == w.device
            and x.shape[-1] == w.shape[1] and not kwargs.get("out")
            and (bias is None or (type(bias) in plain and bias.dtype == x.dtype
                                  and bias.device == x.device))):
        # (a subclass, mixed dtypes or devices: the op itself on each chunk, as it decides)
        return _rows_of(x, lambda c: func(c, w, bias), rows, (w.shape[0],))
    lead = tuple(x.shape[:-1])
    y = _gemm_chunks(_aligned(x.reshape(-1, x.shape[-1])), w, rows)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, w.shape[0])


#: (device, dtype, K, N, the weight's strides and alignment, rows, chunks) -> whether that many
#: chunks in one strided-batched GEMM give, chunk for chunk, the bits of each chunk's GEMM alone
_BATCHED: dict[tuple, bool] = {}
#: The most chunks one batched GEMM takes (more: chunk by chunk)
MAX_BATCHED_CHUNKS = 64


def _gemm_chunks(x: torch.Tensor, w: torch.Tensor, rows: int) -> torch.Tensor:
    """``x @ w.T`` (``x``: ``[n, K]``, contiguous at an aligned address) as ``c`` chunks of
    exactly ``rows`` rows (the last padded with zeros), each computed as its own batch-of-one
    GEMM (``bmm``: a ``gemm`` call at one shape whatever ``n`` is). Where :func:`_batched_ok`
    found that one strided-batched GEMM over the ``c`` chunks (the weight broadcast, no copy)
    gives the same bits chunk for chunk, the chunks go in that one launch instead: a prompt
    chunk of 8192 tokens is then one GEMM a linear, not 32."""
    n, K = x.shape
    N = w.shape[0]
    c = max(1, -(-n // rows))
    if n != c * rows:
        padded = x.new_zeros((c * rows, K))
        padded[:n] = x
        x = padded
    x3 = x.view(c, rows, K)
    wt = w.t().unsqueeze(0)                       # [1, K, N], a view
    if c == 1:
        y = torch.bmm(x3, wt)
    elif _batched_ok(x3, wt, rows):
        y = torch.bmm(x3, wt.expand(c, K, N))
    else:
        y = _one_by_one(x3, wt)
    return y.view(c * rows, N)[:n]


def _one_by_one(x3: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """Each chunk of ``x3`` in a GEMM of its own, at an aligned address (copied where the
    chunk's offset is not)."""
    return torch.cat([torch.bmm(_aligned(x3[i:i + 1]), wt) for i in range(x3.shape[0])])


def _batched_ok(x3: torch.Tensor, wt: torch.Tensor, rows: int) -> bool:
    """Whether one strided-batched GEMM over ``x3``'s chunks equals, chunk for chunk, each
    chunk's own GEMM: decided once per shape and chunk count, on random values (a kernel
    chosen by the batch count sums in another order, which random values show at once),
    outside a CUDA graph's capture (during one, an undecided count goes chunk by chunk)."""
    c, _, K = x3.shape
    N = wt.shape[2]
    if c > MAX_BATCHED_CHUNKS:
        return False
    dev = x3.device
    key = (dev.type, dev.index, x3.dtype, K, N, wt.stride(), wt.data_ptr() % 256, rows, c,
           _gemm_settings(dev.type))
    ok = _BATCHED.get(key)
    if ok is not None:
        return ok
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    g = torch.Generator(device=dev).manual_seed(c)
    probe = torch.randn(x3.shape, generator=g, device=dev, dtype=x3.dtype)
    whole = torch.bmm(probe, wt.expand(c, K, N))
    ok = all(torch.equal(whole[i:i + 1], torch.bmm(_aligned(probe[i:i + 1]), wt)) for i in range(c))
    _BATCHED[key] = ok
    return ok


def _gemm_settings(device_type: str) -> tuple:
    """The process-wide settings a GEMM's kernel choice may follow: TF32 and reduced-precision
    reductions, the preferred BLAS library on CUDA, the intra-op threads on the CPU (a probe
    decided under one holds for it alone)."""
    if device_type == "cuda":
        m = torch.backends.cuda.matmul
        return (m.allow_tf32, getattr(m, "fp32_precision", None), m.allow_fp16_reduced_precision_reduction,
                m.allow_bf16_reduced_precision_reduction, str(torch.backends.cuda.preferred_blas_library()),
                torch.get_float32_matmul_precision())
    return (torch.get_num_threads(), torch.get_float32_matmul_precision())


def batched_gemms() -> dict[str, int]:
    """How the chunk counts met so far were decided: ``{"batched": shapes and counts that go
    in one batched GEMM, "one_by_one": those whose batched GEMM summed otherwise}``."""
    ok = list(_BATCHED.values())
    return {"batched": sum(ok), "one_by_one": len(ok) - sum(ok)}


def _mm(rows: int, func: Any, args: tuple, kwargs: dict) -> Any:
    a, b = args[0], args[1]
    if a.ndim != 2 or b.ndim != 2 or kwargs:
        return func(*args, **kwargs)
    return chunk_rows(a, rows, lambda c: func(c, b))


def _matmul(rows: int, func: Any, args: tuple, kwargs: dict) -> Any:
    a, b = args[0], args[1]
    if a.ndim < 2 or b.ndim < 2 or kwargs:
        return func(*args, **kwargs)
    if b.ndim == 2:
        return _rows_of(a, lambda c: func(c, b), rows, (b.shape[1],))
    # batched by both sides (the bmm below it would run whole): a's rows (dim -2) chunked,
    # its batch dims and b as they are
    y = chunk_rows(a.movedim(-2, 0), rows, lambda c: func(c.movedim(0, -2), b).movedim(-2, 0))
    return y.movedim(0, -2).contiguous()


def _bmm(rows: int, func: Any, args: tuple, kwargs: dict) -> Any:
    # [B, T, K] @ [B, K, N]: the rows are dim 1 (an HF forward's [1, T, hidden] layout, which
    # a bias-free linear reaches as bmm when autograd is on), chunked with B and b unchanged
    a, b = args[0], args[1]
    if a.ndim != 3 or b.ndim != 3 or kwargs:
        return func(*args, **kwargs)
    y = chunk_rows(a.transpose(0, 1), rows, lambda c: func(c.transpose(0, 1), b).transpose(0, 1))
    return y.transpose(0, 1).contiguous()


def _norm(rows: int, func: Any, args: tuple, kwargs: dict) -> Any:
    # rms_norm / _fused_rms_norm / layer_norm / native_layer_norm over the last dim only
    x, shape = args[0], args[1] if len(args) > 1 else kwargs.get("normalized_shape")
    if x.ndim < 2 or not isinstance(shape, Sequence) or len(shape) != 1:
        return func(*args, **kwargs)
    rest = args[2:]
    name = func.name()
    tails: tuple[tuple[int, ...], ...] = ((x.shape[-1],),)
    if name == "aten::_fused_rms_norm":
        tails += ((1,),)
    elif name == "aten::native_layer_norm":
        tails += ((1,), (1,))
    return _rows_of(x, lambda c: func(c, shape, *rest, **kwargs), rows, *tails)


def _addmm(rows: int, func: Any, args: tuple, kwargs: dict) -> Any:
    bias, a, b = args[0], args[1], args[2]
    if a.ndim != 2 or b.ndim != 2 or len(args) > 3:
        return func(*args, **kwargs)
    if bias.ndim == 2 and bias.shape[0] == a.shape[0] and a.shape[0] != 1:
        # a bias of one row per row: chunked beside its rows
        return chunk_rows(a, rows, lambda c, bc: func(bc, c, b, **kwargs),
                          bias.expand(a.shape[0], b.shape[1]))
    return chunk_rows(a, rows, lambda c: func(bias, c, b, **kwargs))


def _mean(rows: int, func: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = bool(args[2]) if len(args) > 2 else bool(kwargs.get("keepdim", False))
    extra = {k: v for k, v in kwargs.items() if k not in ("dim", "keepdim")}
    if len(args) > 3 or x.ndim < 2 or not _last_dim(dim, x.ndim):
        return func(*args, **kwargs)
    return _rows_of(x, lambda c: func(c, [1], True, **extra), rows, (1,) if keepdim else ())


def _softmax(rows: int, func: Any, args: tuple, kwargs: dict) -> Any:
    x, dim = args[0], args[1] if len(args) > 1 else kwargs.get("dim")
    rest = args[2:]
    if x.ndim < 2 or not _last_dim(dim, x.ndim):
        return func(*args, **kwargs)
    extra = {k: v for k, v in kwargs.items() if k != "dim"}
    return _rows_of(x, lambda c: func(c, 1, *rest, **extra), rows, (x.shape[-1],))


_HANDLERS: dict[str, Callable[[int, Any, tuple, dict], Any]] = {
    "aten::linear": _linear, "aten::mm": _mm, "aten::addmm": _addmm, "aten::matmul": _matmul,
    "aten::mean.dim": _mean, "aten::softmax.int": _softmax, "aten::log_softmax.int": _softmax,
    "aten::_softmax": _softmax, "aten::_log_softmax": _softmax, "aten::bmm": _bmm,
    "aten::rms_norm": _norm, "aten::_fused_rms_norm": _norm, "aten::layer_norm": _norm,
    "aten::native_layer_norm": _norm,
}
assert set(_HANDLERS) == set(ROW_OPS)


class BatchInvariant(TorchDispatchMode):
    """Inside the block, the ops of :data:`ROW_OPS` run on fixed chunks of ``rows`` rows
    (module docstring), so each row's result is independent of the other rows of the call;
    every other op passes through. ``rows``: an int in ``[1, 65536]`` (InvalidArgument
    otherwise, before anything changes); the same value must be used wherever results are
    to agree. ``cpu_threads``: torch's intra-op threads inside the block (None: as they
    are); the setting is process-wide, so nested and concurrent blocks share one saved value
    and the last to leave restores it.

    Results differ from the plain ops by rounding only (a different reduction order): close
    to them, not equal.

    Example
    -------
    >>> with BatchInvariant(rows=64, cpu_threads=1):                  # doctest: +SKIP
    ...     a = torch.nn.functional.linear(x[:3], w)                      # rows 0-2 ...
    ...     b = torch.nn.functional.linear(x, w)[:3]                      # ... equal bit for bit
    """

    def __init__(self, rows: int = ROWS, cpu_threads: int | None = None):
        super().__init__()
        self.rows = check_int(rows, "rows", 1, 1 << 16)
        if cpu_threads is not None:
            cpu_threads = check_int(cpu_threads, "cpu_threads", 1, 1 << 16)
        self.cpu_threads = cpu_threads
        self._pins = 0          # this instance's open pinning blocks (an instance may nest in itself)

    def __enter__(self) -> BatchInvariant:
        if self.cpu_threads is not None:
            with _THREADS_LOCK:
                if _threads_state[0] == 0:
                    _threads_state[1] = torch.get_num_threads()
                _threads_state[0] += 1
                torch.set_num_threads(self.cpu_threads)
            self._pins += 1
        try:
            return super().__enter__()
        except BaseException:
            self._unpin()
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._unpin()

    def _unpin(self) -> None:
        if self._pins == 0:
            return
        self._pins -= 1
        with _THREADS_LOCK:
            _threads_state[0] -= 1
            if _threads_state[0] == 0:
                torch.set_num_threads(_threads_state[1])

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func.name())
        if handler is None or not all(isinstance(a, torch.Tensor) for a in args[:1]):
            return func(*args, **kwargs)
        return handler(self.rows, func, args, kwargs)
