"""cellcache.batch_invariant on the CPU: inside BatchInvariant a row's result of a GEMM, a
norm's mean or a softmax is bit for bit the same whatever rows are computed beside it (how
many, at which offset), close to the plain op's; other ops pass through; refusals change
nothing; the host attention path "invariant" agrees with SDPA and does not depend on the
step's rows or cells."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import cellcache as cc  # noqa: E402
import cellcache.torch as cct  # noqa: E402
from cellcache import InvalidArgument  # noqa: E402
from cellcache.batch_invariant import ROW_OPS, BatchInvariant, chunk_rows  # noqa: E402

F = torch.nn.functional


def bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes, for bit-for-bit comparisons (-0.0 and NaN payloads included)."""
    return t.detach().contiguous().view(torch.uint8).numpy().copy()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(bits(a), bits(b))


# row counts and offsets that cross the chunk size (32 here) in every way
SLICES = [(0, 1), (5, 1), (3, 7), (0, 32), (1, 32), (31, 2), (0, 33), (10, 64), (7, 90), (0, 100)]


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, 96, generator=g)
    w = torch.randn(80, 96, generator=g) / 10
    b = torch.randn(80, generator=g)
    return x, w, b


@pytest.mark.parametrize("op", ["linear", "linear_bias", "linear_3d", "mm", "addmm", "matmul", "bmm",
                                "matmul_batched", "mean",
                                "softmax", "log_softmax", "softmax_half", "rms_norm", "layer_norm"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(data, op):
    x, w, b = data
    fns = {
        "linear": lambda t: F.linear(t, w),
        "linear_bias": lambda t: F.linear(t, w, b),
        "linear_3d": lambda t: F.linear(t[None], w, b)[0],
        "mm": lambda t: torch.mm(t, w.t()),
        "addmm": lambda t: torch.addmm(b, t, w.t()),
        "matmul": lambda t: torch.matmul(t, w.t()),
        "bmm": lambda t: torch.bmm(t[None], w.t()[None])[0],
        "matmul_batched": lambda t: torch.matmul(t[None], w.t()[None])[0],
        "mean": lambda t: t.pow(2).mean(-1, keepdim=True),
        "softmax": lambda t: torch.softmax(t, dim=-1),
        "log_softmax": lambda t: torch.log_softmax(t, dim=-1),
        "softmax_half": lambda t: torch.softmax(t.to(torch.bfloat16), dim=-1, dtype=torch.float32),
        "rms_norm": lambda t: F.rms_norm(t, (t.shape[-1],), x[0], 1e-6),
        "layer_norm": lambda t: F.layer_norm(t, (t.shape[-1],), x[0], x[1]),
    }
    fn = fns[op]
    with torch.inference_mode():
        plain = fn(x)
        with BatchInvariant(rows=32, cpu_threads=1):
            whole = fn(x)
            for off, n in SLICES:
                part = fn(x[off:off + n])
                assert same_bits(part, whole[off:off + n]), (op, off, n)
                # a non-contiguous, offset view of the same rows: the same bits too
                strided = torch.empty(n, 2 * x.shape[1])[:, 1:x.shape[1] + 1]
                strided.copy_(x[off:off + n])
                assert same_bits(fn(strided), whole[off:off + n]), (op, off, n, "strided")
    torch.testing.assert_close(whole, plain, rtol=1e-5, atol=1e-5)


def _gemm_shapes(seen):
    return [shape for name, shape in seen if name == "aten::bmm"]


def test_a_linears_chunks_go_in_one_batched_gemm_where_it_sums_alike(data, monkeypatch):
    """Inference mode's linear: c chunks of rows in one strided-batched GEMM once a probe
    found it equal, chunk for chunk, to each chunk's own GEMM (decided once per shape and
    count); the same rows' bits as one chunk alone and as a forced chunk-by-chunk run."""
    from cellcache import batch_invariant as bi

    monkeypatch.setattr(bi, "_BATCHED", {})
    x, w, b = data
    w, b = torch.nn.Parameter(w, requires_grad=False), torch.nn.Parameter(b, requires_grad=False)
    with torch.inference_mode():
        below = _Below()
        with below, BatchInvariant(rows=16, cpu_threads=1):
            whole = F.linear(x, w, b)                           # 100 rows: 7 chunks
            again = F.linear(x, w, b)
            alone = F.linear(x[48:64], w, b)                    # one chunk
        # the probe (batched, then each chunk alone), the first call, the second, the chunk
        assert _gemm_shapes(below.seen) == [(7, 16, 96)] + [(1, 16, 96)] * 7 + [(7, 16, 96)] * 2 + \
            [(1, 16, 96)]
        assert list(bi._BATCHED.values()) == [True] and bi.batched_gemms() == {"batched": 1, "one_by_one": 0}
        monkeypatch.setattr(bi, "_batched_ok", lambda *a: False)
        below = _Below()
        with below, BatchInvariant(rows=16, cpu_threads=1):
            apart = F.linear(x, w, b)
        assert _gemm_shapes(below.seen) == [(1, 16, 96)] * 7
    assert same_bits(whole, again) and same_bits(whole, apart) and same_bits(whole[48:64], alone)
    torch.testing.assert_close(whole, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_a_batched_gemm_that_sums_otherwise_goes_chunk_by_chunk(data, monkeypatch):
    """A probe that finds the batched GEMM's bits differ from the chunks' own (a stand-in
    batched kernel that rounds otherwise) keeps that count chunk by chunk, for good: the
    rows' bits stay those of a chunk alone."""
    from cellcache import batch_invariant as bi

    monkeypatch.setattr(bi, "_BATCHED", {})
    real = torch.bmm

    def other_order(a, b):                      # batches of more than one sum otherwise
        out = real(a, b)
        return out if a.shape[0] == 1 else out + 1e-3

    monkeypatch.setattr(torch, "bmm", other_order)
    x, w, _ = data
    with torch.inference_mode():
        with BatchInvariant(rows=16, cpu_threads=1):
            whole = F.linear(x, w)
            alone = F.linear(x[16:32], w)
        below = _Below()
        with below, BatchInvariant(rows=16, cpu_threads=1):
            again = F.linear(x, w)
    assert bi.batched_gemms() == {"batched": 0, "one_by_one": 1}
    assert _gemm_shapes(below.seen) == [(1, 16, 96)] * 7
    assert same_bits(whole, again) and same_bits(whole[16:32], alone)
    torch.testing.assert_close(whole, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_rows_alone_in_a_chunk_equal_rows_among_others(data):
    """The slot a row takes in its chunk changes nothing: a row computed alone (slot 0,
    the rest padding) equals the same row at every slot of a full chunk."""
    x, w, b = data
    with torch.inference_mode(), BatchInvariant(rows=16):
        alone = torch.stack([F.linear(x[i:i + 1], w, b)[0] for i in range(40)])
        together = F.linear(x[:40], w, b)
        shifted = F.linear(x[3:43], w, b)[:37]
    assert same_bits(alone, together)
    assert same_bits(alone[3:40], shifted)


def test_other_ops_and_other_dims_pass_through(data):
    x, w, _ = data
    with torch.inference_mode():
        ref = {"sum": x.sum(-1), "mean0": x.mean(0), "softmax0": torch.softmax(x, 0), "silu": F.silu(x),
               "norm2d": F.layer_norm(x, x.shape)}
        with BatchInvariant(rows=8):
            got = {"sum": x.sum(-1), "mean0": x.mean(0), "softmax0": torch.softmax(x, 0), "silu": F.silu(x),
                   "norm2d": F.layer_norm(x, x.shape)}
    for k in ref:
        assert same_bits(got[k], ref[k]), k


def test_rows_are_checked_before_anything_changes():
    before = torch.get_num_threads()
    for bad in (0, -1, 1.5, "8", True, 1 << 17):
        with pytest.raises(InvalidArgument, match="rows"):
            BatchInvariant(rows=bad)
    with pytest.raises(InvalidArgument, match="cpu_threads"):
        BatchInvariant(cpu_threads=0)
    assert torch.get_num_threads() == before


def test_cpu_threads_are_pinned_inside_and_restored_after_nesting_and_errors():
    before = torch.get_num_threads()
    outer, inner = BatchInvariant(cpu_threads=1), BatchInvariant(cpu_threads=1)
    with outer:
        assert torch.get_num_threads() == 1
        with inner:
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1          # the outer block still holds it
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="inside"):
        with BatchInvariant(cpu_threads=1):
            raise RuntimeError("inside")
    assert torch.get_num_threads() == before
    with BatchInvariant():                           # None: left alone
        assert torch.get_num_threads() == before
    same = BatchInvariant(cpu_threads=1)             # one instance entered twice, nested
    with same:
        with same:
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_chunk_rows_handles_empty_and_exact_inputs():
    x = torch.arange(12.0).view(6, 2)
    assert same_bits(chunk_rows(x, 6, lambda c: c * 2), x * 2)       # exactly one chunk
    assert same_bits(chunk_rows(x, 4, lambda c: c + 1), x + 1)       # one full, one padded
    empty = torch.zeros(0, 2)
    assert chunk_rows(empty, 4, lambda c: c + 1).shape == (0, 2)
    assert set(ROW_OPS) >= {"aten::mm", "aten::addmm", "aten::mean.dim", "aten::_log_softmax"}


def test_every_chunk_reaches_fn_at_an_aligned_address():
    """Rows whose bytes are not a multiple of the alignment (12 here): the slices at
    unaligned offsets are copied, so each chunk (slice or padded copy) starts aligned."""
    x = torch.arange(30.0).view(10, 3)
    seen = []

    def fn(c):
        seen.append(c.data_ptr() % 64)
        return c * 2

    assert same_bits(chunk_rows(x, 3, fn), x * 2)
    assert seen == [0, 0, 0, 0]


# -- the host attention path ------------------------------------------------------------------

def _cache(capacity=128, windows=(0, 5)):
    cfg = cc.CacheConfig(capacity=capacity, max_write=16, dtype="float32",
                         layers=[cc.LayerConfig(2, 8, w) for w in windows])
    return cc.build("host", "batched", cfg)


def _attend(cache, view, layer, ids, qkv, backend):
    """One step of ``ids`` at layer ``layer`` with q/k/v rows taken from ``qkv`` by each
    token's (sequence, position); returns the outputs by (sequence, position)."""
    assert cache.declare_step(ids)
    step = cache.prepare_step()
    keys = list(zip(step.seq_ids.tolist(), step.positions.tolist()))
    q = torch.stack([qkv[k][0] for k in keys])
    kk = torch.stack([qkv[k][1] for k in keys])
    vv = torch.stack([qkv[k][2] for k in keys])
    out = cct.attention(view, layer, q, kk, vv, step=step, backend=backend)
    cache.commit_step()
    return {k: out[i] for i, k in enumerate(keys)}


@pytest.mark.parametrize("layer", [0, 1])
def test_host_invariant_attention_is_sdpa_and_independent_of_the_step(layer):
    """Two sequences read in different chunkings, interleavings and cells (a third sequence
    takes cells in between in one run): each token's output is the same bits in every run
    and close to SDPA's over the same masks."""
    g = torch.Generator().manual_seed(1)
    lengths = {0: 40, 1: 23}
    qkv = {(s, p): (torch.randn(4, 8, generator=g), torch.randn(2, 8, generator=g),
                    torch.randn(2, 8, generator=g)) for s in (0, 1, 2) for p in range(45)}
    # filler sequence 2 gets its own vectors per position
    plans = [
        [[0] * 16, [1] * 16, [0] * 16, [1] * 7 + [0] * 8],
        [[0, 1] * 8] * 2 + [[0] * 8 + [1] * 7] + [[0] * 1] * 8,
        [[0] * 5 + [1] * 5, [2] * 9, [0] * 16, [1] * 13 + [0] * 3, [0] * 16],
    ]
    results = []
    for chunks in plans:
        cache = _cache()
        view = cct.TorchView(cache)
        for s in (0, 1, 2):
            assert cache.seq_new() == s
        got, sdpa = {}, {}
        fed = {0: 0, 1: 0, 2: 0}
        for ids in chunks:
            ids = [s for s in ids if fed[s] < lengths.get(s, 9) or s == 2]
            for s in ids:
                fed[s] += 1
            got.update(_attend(cache, view, layer, ids, qkv, "invariant"))
            # the same step again through SDPA, on a rewound copy of the sequences
            for s in set(ids):
                cache.rewind(s, cache.pos(s) - ids.count(s))
            sdpa.update(_attend(cache, view, layer, ids, qkv, "sdpa"))
        results.append({k: v for k, v in got.items() if k[0] != 2})
        for k in results[-1]:
            torch.testing.assert_close(got[k], sdpa[k], rtol=1e-5, atol=1e-5)
    keys = set(results[0]) & set(results[1]) & set(results[2])
    assert len(keys) >= 40
    for k in keys:
        assert same_bits(results[0][k], results[1][k]) and same_bits(results[0][k], results[2][k]), k


def test_invariant_backend_refusals_write_nothing():
    cfg = cc.CacheConfig(capacity=32, max_write=8, dtype="float32", mask_format="none",
                         layers=[cc.LayerConfig(2, 8, 0)])
    cache = cc.build("host", "batched", cfg)
    view = cct.TorchView(cache)
    s = cache.seq_new()
    assert cache.declare_step([s, s])
    step = cache.prepare_step()
    k_pool = view.layer(0)[0].clone()
    q, k = torch.ones(2, 4, 8), torch.ones(2, 2, 8)
    with pytest.raises(InvalidArgument, match="invariant"):
        cct.attention(view, 0, q, k, k, step=step, backend="invariant")
    with pytest.raises(InvalidArgument, match="backend"):
        cct.attention(view, 0, q, k, k, step=step, backend="deterministic")
    assert same_bits(view.layer(0)[0], k_pool)
    assert "invariant" in cct.BACKENDS


def test_tensor_core_choice_takes_split_0_as_never_split():
    """The invariant backend's launch: the table's variant with split 0 (never split along kv,
    whatever the step's unit count); negative splits are refused. (The choice needs no GPU: an
    instance whose variant table is filled by hand.)"""
    tc = pytest.importorskip("cellcache.cuda.tc")
    kern = tc.TensorCoreAttention.__new__(tc.TensorCoreAttention)
    kern.variants = {d: {c.variant: {} for (dd, _), c in tc.TABLE.items() if dd == d} for d in tc.HEAD_DIMS}
    kern.table = tc.TABLE                          # (16-bit pools' table, as __init__ sets it)
    for decode in (False, True):
        base = tc.TABLE[64, "decode" if decode else "prefill"]
        assert kern.choose(64, decode, split=0) == tc.Choice(base.variant, 0, base.order)
    with pytest.raises(InvalidArgument, match="split"):
        kern.choose(64, True, split=-1)
    assert cct.INVARIANT_CLASS in ("decode", "prefill")


class _Below(TorchDispatchMode):
    """Records the ops (name, first operand's shape) that reach the layer below the mode."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if args and isinstance(args[0], torch.Tensor):
            self.seen.append((func.name(), tuple(args[0].shape)))
        return func(*args, **(kwargs or {}))


# row reductions an HF decoder's forward may reach in inference mode (the runner's), each
# entering dispatch as one op: the mode must hand the kernel below chunks of exactly `rows`
ROW_REDUCTIONS = {
    "rms_norm": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
    "rms_norm_module": lambda x, w: torch.nn.RMSNorm(x.shape[-1], eps=1e-6)(x),
    "layer_norm": lambda x, w: F.layer_norm(x, (x.shape[-1],), w, w),
    "mean": lambda x, w: x.pow(2).mean(-1, keepdim=True),
    "linear": lambda x, w: F.linear(x, w[None].expand(8, -1)),
    "matmul_batched": lambda x, w: torch.matmul(x, w[None, :, None].expand(1, -1, 8)),
}
_REDUCING = ("aten::rms_norm", "aten::layer_norm", "aten::native_layer_norm", "aten::_fused_rms_norm",
             "aten::mean.dim", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")


@pytest.mark.parametrize("grad_mode", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("op", sorted(ROW_REDUCTIONS))
def test_row_reductions_reach_their_kernels_in_chunks_of_rows(data, op, grad_mode):
    """Every reduction kernel below the mode sees ``rows`` rows whatever the call's row count
    (the shape is what fixes the kernel's reduction order on CUDA; a batched GEMM, chunks of
    ``rows`` rows), and a row's bits do not depend on the rows beside it."""
    x, _, _ = data
    w = torch.linspace(0.5, 1.5, x.shape[1])
    fn = ROW_REDUCTIONS[op]
    ctx = torch.inference_mode() if grad_mode == "inference_mode" else torch.no_grad()
    with ctx:
        plain = fn(x[None, :37], w)
        below = _Below()
        with below, BatchInvariant(rows=16, cpu_threads=1):
            whole = fn(x[None, :37], w)
            part = fn(x[None, 5:9], w)
    reductions = [(name, shape) for name, shape in below.seen if name in _REDUCING]
    assert reductions, below.seen
    for name, shape in reductions:
        assert shape[:-1] in ((16,), (1, 16)) or (name == "aten::bmm" and shape[1:-1] == (16,)), \
            (name, shape)
    assert same_bits(part, whole[:, 5:9])
    torch.testing.assert_close(whole, plain, rtol=1e-5, atol=1e-5)
