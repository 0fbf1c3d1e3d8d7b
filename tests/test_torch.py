"""cellcache.torch on the host backend: zero-copy views of every buffer and dtype, and an
attention whose outputs equal attention over each sequence's own history (with padding,
bool and bit masks)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cellcache as cc  # noqa: E402
import cellcache.torch as cct  # noqa: E402
from cellcache.host import HostAllocator  # noqa: E402
from cellcache.session import Session, SessionConfig  # noqa: E402

LAYERS = (cc.LayerConfig(2, 16, 0), cc.LayerConfig(2, 16, 8))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_as_tensor_views_every_buffer_without_copying(dtype):
    cache = cc.HostCellCache(cc.CacheConfig(capacity=64, layers=LAYERS, max_write=8, dtype=dtype,
                                            paged=True, mask_format="bits"))
    for name in cache.buffer_names:
        buf = cache.buffer(name)
        t = cct.as_tensor(buf)
        assert t.data_ptr() == buf.ctypes.data and tuple(t.shape) == buf.shape, name
    k = cct.as_tensor(cache.layer(0).k)
    assert k.dtype == cct.torch_dtype(dtype)
    k[3, 1, 2] = 1.5                                   # writes land in the cache's own array
    assert float(cache.layer(0).k[3, 1, 2]) == 1.5
    with pytest.raises(cc.InvalidArgument, match="buffer of type list"):
        cct.as_tensor([1, 2])


def session_forward(view):
    """A Session forward through cct.attention: each layer's q/k/v padded to the step's
    pad_to (padding K/V NaN, which must never be read)."""
    def forward(cache, step, qkv):
        outs = []
        for li, (q, k, v) in enumerate(qkv):
            T = step.pad_to
            qt, kt = torch.zeros((T, 4, 16)), torch.full((T, 2, 16), float("nan"))
            vt = kt.clone()
            qt[:step.width] = torch.from_numpy(q)
            kt[:step.width] = torch.from_numpy(k)
            vt[:step.width] = torch.from_numpy(v)
            outs.append(cct.attention(view, li, qt, kt, vt, step=step)[:step.width].numpy())
        return outs
    return forward


@pytest.mark.parametrize("fmt", ["bool", "bits"])
def test_attention_through_torch_matches_each_sequence(fmt):
    cfg = cc.CacheConfig(capacity=512, layers=LAYERS, max_write=32, initial_capacity=16,
                         dtype="float32", max_seqs=16, mask_format=fmt)
    cache = cc.HostCellCache(cfg)
    view = cct.TorchView(cache)

    s = Session(cache, session_forward(view), SessionConfig(n_heads=4, buckets=[4, 8, 16, 32]),
                seed=1).run(60)
    assert s["mismatches"] == 0 and s["growths"] >= 2 and len(s["per_bucket"]) >= 2


def _pool_bytes(cache) -> list[bytes]:
    """Every layer's K and V pool, byte for byte."""
    return [cache.layer(i)[kv].tobytes() for i in range(len(cache.config.layers)) for kv in (0, 1)]


def _refusal_setup():
    """A host cache where seq a owns cells 0-5 and seq b cells 6-7 (one wide step, then
    one narrow one), and a prepared step of seq c: width 2 at pad_to 4.

    cells buffer after the last prepare:   [8, 9, sink, sink, 4, 5, 6, 7]
    a wider forward (T > pad_to) would write a's and b's history at rows 4-7.
    """
    cache = cc.HostCellCache(cc.CacheConfig(capacity=64, layers=LAYERS, max_write=8, dtype="float32"))
    a, b, c = cache.seq_new(), cache.seq_new(), cache.seq_new()
    cache.declare_step([a] * 6 + [b] * 2)
    cache.prepare_step()
    cache.commit_step()
    old = cache.declare_step([c])
    assert old
    older = cache.prepare_step()
    cache.commit_step()
    cache.declare_step([c, c])
    step = cache.prepare_step(pad_to=4)
    assert cache.buffer("cells").tolist()[4:] == [4, 5, 6, 7]
    for i in range(len(LAYERS)):                   # distinct bytes everywhere, sink included
        for pool in cache.layer(i)[:2]:
            pool[:] = np.arange(pool.size, dtype=np.float32).reshape(pool.shape) % 251 + 1
    return cache, step, older


def _qkv(T, heads=4, kv_heads=2, dim=16, dtype=torch.float32, device="cpu"):
    return (torch.ones((T, heads, dim), dtype=dtype, device=device),
            torch.full((T, kv_heads, dim), -3.0, dtype=dtype, device=device),
            torch.full((T, kv_heads, dim), -5.0, dtype=dtype, device=device))


@pytest.mark.parametrize("case,error,match", [
    ("rows past pad_to", cc.InvalidArgument, "have 8 rows; the prepared step runs at pad_to=4"),
    ("rows below width", cc.InvalidArgument, "have 1 rows; the prepared step runs at pad_to=4"),
    ("rows between width and pad_to", cc.InvalidArgument, "have 3 rows"),
    ("kv heads", cc.InvalidArgument, "k, v \\[T, 2, 16\\]; got \\(4, 4, 16\\), \\(4, 1, 16\\)"),
    ("q heads not a multiple", cc.InvalidArgument, "n_heads a multiple of 2"),
    ("head_dim", cc.InvalidArgument, "q must be \\[T, n_heads, 16\\]"),
    ("v shape", cc.InvalidArgument, "got \\(4, 4, 16\\), \\(4, 2, 16\\), \\(4, 2, 8\\)"),
    ("q 2-D", cc.InvalidArgument, "q must be"),
    ("integer dtype", cc.InvalidArgument, "must be floating point"),
    ("device", cc.InvalidArgument, "on meta, meta, meta; the cache's buffers are on cpu"),
    ("not a tensor", cc.InvalidArgument, "q of type ndarray is not a torch.Tensor"),
    ("layer -1", cc.InvalidArgument, "layer=-1 is outside \\[0, 1\\]"),
    ("layer 2", cc.InvalidArgument, "layer=2 is outside \\[0, 1\\]"),
    ("layer float", cc.InvalidArgument, "layer of type float is not an int"),
    ("layer bool", cc.InvalidArgument, "layer of type bool is not an int"),
    ("another cache's step", cc.InvalidState, "not this cache's prepared step"),
    ("an older step", cc.InvalidState, "not this cache's prepared step"),
    ("committed", cc.InvalidState, "no step is prepared"),
    ("backend paged", cc.InvalidArgument, "'paged' needs a CUDA cache"),
    ("backend prefill", cc.InvalidArgument, "'prefill' needs a CUDA cache"),
    ("backend flashinfer", cc.InvalidArgument, "'flashinfer' needs a CUDA cache"),
    ("backend magic", cc.InvalidArgument, "is not one of"),
    ("out shape", cc.InvalidArgument, "out must be a \\[4, 4, 16\\] torch.float32"),
    ("not a view", cc.InvalidArgument, "view of type HostCellCache is not a TorchView"),
    ("scale 0", cc.InvalidArgument, "scale=0.0 must be a finite number > 0"),
    ("scale negative", cc.InvalidArgument, "scale=-0.5 must be a finite number > 0"),
    ("scale nan", cc.InvalidArgument, "scale=nan must be a finite number > 0"),
    ("scale str", cc.InvalidArgument, "scale of type str is not a number"),
    ("write str", cc.InvalidArgument, "write of type str is not a bool"),
])
def test_attention_refusals_write_nothing(case, error, match):
    """Every refusal comes before any write: the pools (sink row included), the step buffers
    and the table are exactly as before."""
    cache, step, older = _refusal_setup()
    view = cct.TorchView(cache)
    q, k, v = _qkv(4)
    args = dict(view=view, layer=0, q=q, k=k, v=v, step=step)
    other = cc.HostCellCache(cache.config)
    s = other.seq_new()
    other.declare_step([s, s])
    if case == "rows past pad_to":
        args.update(zip("qkv", _qkv(8)))
    elif case == "rows below width":
        args.update(zip("qkv", _qkv(1)))
    elif case == "rows between width and pad_to":
        args.update(zip("qkv", _qkv(3)))
    elif case == "kv heads":
        args.update(k=k[:, :1], v=v[:, :1])
    elif case == "q heads not a multiple":
        args.update(q=q[:, :3])
    elif case == "head_dim":
        args.update(zip("qkv", _qkv(4, dim=8)))
    elif case == "v shape":
        args.update(v=v[:, :, :8])
    elif case == "q 2-D":
        args.update(q=q[:, 0])
    elif case == "integer dtype":
        args.update(zip("qkv", _qkv(4, dtype=torch.int32)))
    elif case == "device":
        args.update(zip("qkv", _qkv(4, device="meta")))
    elif case == "not a tensor":
        args.update(q=q.numpy())
    elif case.startswith("layer"):
        args.update(layer={"layer -1": -1, "layer 2": 2, "layer float": 0.0, "layer bool": False}[case])
    elif case == "another cache's step":
        args.update(step=other.prepare_step(pad_to=4))
    elif case == "an older step":
        args.update(step=older)
    elif case == "committed":
        cache.commit_step()
        args.update(step=None)
    elif case.startswith("backend"):
        args.update(backend=case.split()[1])
    elif case == "out shape":
        args.update(out=torch.empty((4, 4, 8)))
    elif case == "not a view":
        args.update(view=cache)
    elif case == "write str":
        args.update(write="no")
    elif case.startswith("scale"):
        args.update(scale={"scale 0": 0.0, "scale negative": -0.5, "scale nan": float("nan"),
                           "scale str": "1"}[case])
    pools, bufs = _pool_bytes(cache), {n: cache.buffer(n).tobytes() for n in cache.buffer_names}
    table = cache.metrics()
    with pytest.raises(error, match=match):
        cct.attention(**args)
    assert _pool_bytes(cache) == pools
    assert {n: cache.buffer(n).tobytes() for n in cache.buffer_names} == bufs
    assert cache.metrics() == table
    cache.check_invariants()


def test_attention_accepts_the_prepared_step_by_default_and_converts_kv_to_the_pool_dtype():
    cache, step, _ = _refusal_setup()
    view = cct.TorchView(cache)
    q, k, v = _qkv(4)
    by_default = cct.attention(view, 1, q, k.double(), v.double())   # float64 K/V stored as float32
    pools = _pool_bytes(cache)
    explicit = cct.attention(view, 1, q, k, v, step=step)
    assert torch.equal(by_default, explicit) and _pool_bytes(cache) == pools
    k_pool = cache.layer(1).k
    assert (k_pool[step.cells] == -3.0).all() and (k_pool[cache.sink] == -3.0).all()


def test_attention_with_write_false_reads_the_kv_its_caller_wrote():
    """write=False (cellcache.native's fused rotary and K/V write): nothing is written, and
    with K/V written at the step's cells beforehand the result is the writing call's; 8-bit
    pools are refused (their write scales the values) with nothing changed."""
    cache, step, _ = _refusal_setup()
    view = cct.TorchView(cache)
    q, k, v = _qkv(4)
    k, v = k + torch.arange(4.0)[:, None, None], v - torch.arange(4.0)[:, None, None]
    pools = _pool_bytes(cache)
    cct.attention(view, 1, q, k, v, write=False)
    assert _pool_bytes(cache) == pools                         # nothing written
    view.write_kv(1, k, v, step.width)                          # as the caller would
    read = cct.attention(view, 1, q, k * 0, v * 0, write=False)
    assert torch.equal(read, cct.attention(view, 1, q, k, v))

    kv8 = cc.HostCellCache(cc.CacheConfig(capacity=64, layers=LAYERS, max_write=8, dtype="float32",
                                          kv_dtype="fp8"))
    s = kv8.seq_new()
    kv8.declare_step([s])
    kv8.prepare_step(pad_to=4)
    before = _pool_bytes(kv8)
    with pytest.raises(cc.InvalidArgument, match="8-bit pools are written scaled"):
        cct.attention(cct.TorchView(kv8), 0, *_qkv(4), write=False)
    assert _pool_bytes(kv8) == before


def test_attention_is_planned_once_a_step_and_every_layer_runs_that_plan():
    """The step's first call makes its AttentionPlan; the other layers' calls of the step run
    the same one, the next step (or another backend) gets a new one, and a backend the cache
    cannot run is refused with nothing planned and nothing written."""
    cache, step, _ = _refusal_setup()
    view = cct.TorchView(cache)
    q, k, v = _qkv(4)
    cct.attention(view, 0, q, k, v)
    plan = view.plan(step)
    assert plan.step is step and plan.backend == "auto" and not plan.kernels
    cct.attention(view, 1, q, k, v)
    assert view.plan(step) is plan
    assert view.plan(step, "sdpa") is not plan
    pools = _pool_bytes(cache)
    with pytest.raises(cc.InvalidArgument, match="backend 'tc' needs a CUDA cache"):
        cct.attention(view, 0, q, k, v, backend="tc")
    assert _pool_bytes(cache) == pools and view.plan(step, "sdpa").backend == "sdpa"
    cache.commit_step()
    c = cache.seq_new()
    assert cache.declare_step([c])
    nxt = cache.prepare_step()
    cct.attention(view, 0, *_qkv(1))
    assert view.plan(nxt) is not plan and view.plan(nxt).step is nxt


def _three_sequences(layers):
    """A paged float32 host cache holding three sequences of 5, 8 and 7 tokens, and a view of
    it that calls itself CUDA (a plan's decisions only: nothing is launched)."""
    cache = cc.HostCellCache(cc.CacheConfig(capacity=256, layers=layers, max_write=8, dtype="float32",
                                            paged=True))
    seqs = [cache.seq_new() for _ in range(3)]
    for s, n in zip(seqs, (5, 8, 7)):
        assert cache.declare_step([s] * n)
        cache.prepare_step()
        cache.commit_step()
    view = cct.TorchView(cache)
    view.cuda = True
    return cache, seqs, view


def test_a_plan_decides_again_at_each_forward_whether_a_graph_is_being_captured(monkeypatch):
    """One plan serves every forward of its step, and a forward may run eagerly (a caller's
    warm-up) and the next inside a capture (one plan for both), or a plan made outside a
    capture have its first forward captured. Each forward decides as it starts: eagerly
    the tensor-core path counts on the step's own runs (it leaves the merge out where they
    rule a split out) and groups only where rows may; captured, it counts on none (the
    graph replays other steps) and launches the shared-prefix pass. (On the host: a CUDA
    view's decisions, every layer run by SDPA.)"""
    cache, seqs, view = _three_sequences(LAYERS)
    assert cache.declare_step(seqs)
    step = cache.prepare_step(pad_to=4)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(cct.AttentionPlan, "_path", lambda self, layer, q, k_pool, v_pool, out: ("sdpa", q))
    q, k, v = _qkv(4)
    plan = view.plan(step)                            # made outside the capture
    seen = []
    for flag in (True, False, True):
        capturing[0] = flag
        for layer in (0, 1):
            cct.attention(view, layer, q, k, v, write=False)
            assert view.plan(step) is plan
            seen.append((plan.live_rows, plan.cascade))
    n = cct.CASCADE_MIN_SHARED
    assert plan.kernels and plan.decode and step.n_runs == 3
    assert seen == [(0, n), (0, n), (3, 0), (3, 0), (0, n), (0, n)], seen


def test_an_eager_decode_forward_reserves_the_scratch_a_capture_of_its_step_needs(monkeypatch):
    """A caller warms a step up eagerly, then captures it: the eager forward cannot group
    (the step's rows share nothing), the capture groups, and nothing can be allocated in a
    capture. So the eager forward reserves the grouped rows' scratch for its windowless
    layers only (the kernels ignore grouping under a window), once a layer shape and width a
    cache (scratch only grows: an eager serving loop pays a lookup a layer); a captured
    forward, a prompt step or a forward under the runner's grouping (its captures, which
    reserve first) reserve nothing. (On the host: a stand-in for the tensor-core kernels.)"""
    layers = (cc.LayerConfig(2, 16, 8), cc.LayerConfig(1, 16, 0))     # windowed first, then not
    cache, seqs, view = _three_sequences(layers)

    class Kernels:
        reserved: list = []

        def reserve(self, *a, **k):
            self.reserved.append((a, k))

        def run(self, *a, **k):
            return False

        def unsplit_rows(self, *a, **k):
            return 1 << 20

    kern = Kernels()
    view._tensor_cores = kern
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0}))
    monkeypatch.setattr(cct.AttentionPlan, "_path", lambda self, layer, q, k_pool, v_pool, out: ("tc", q))
    monkeypatch.setattr(cct.TorchView, "paged_pointers", lambda self: {})

    def forwards(pad_to, flags, ids=seqs):
        assert cache.declare_step(ids)
        cache.prepare_step(pad_to=pad_to)
        qkv = [_qkv(pad_to, kv_heads=lc.n_kv_heads) for lc in layers]
        for flag in flags:
            capturing[0] = flag
            for layer in (0, 1):
                cct.attention(view, layer, *qkv[layer], write=False)
        cache.commit_step()

    forwards(4, (True,))                          # a plan whose first forward is captured
    token = cct.GROUPING.set(cct.Grouping(False))
    try:
        forwards(4, (False,))                     # the runner's capture: it reserves itself
    finally:
        cct.GROUPING.reset(token)
    forwards(4, (False,), [seqs[0]] * 3)          # a prompt chunk: no grouping to prepare for
    assert kern.reserved == []
    forwards(4, (False, False, True))             # eager twice, then the capture
    want = [((4, 4, 1, 16), {"decode": True, "cascade": True})]           # the windowless layer's
    assert kern.reserved == want, kern.reserved
    forwards(4, (False,))                         # another step of that width: reserved already
    assert kern.reserved == want
    forwards(8, (False,))                         # a wider one: reserved again
    assert kern.reserved == want + [((8, 4, 1, 16), {"decode": True, "cascade": True})]


def test_layer_paths_name_each_layers_path_as_choose_path_does():
    """What a runner asks before attaching: each layer's path for the model's head count
    (the tensor-core kernels where their module imports and takes the shape)."""
    pytest.importorskip("cuda.bindings")           # cellcache.cuda.kernels imports the driver module
    from cellcache.cuda import kernels as ck

    cfg = cc.CacheConfig(capacity=64, layers=[cc.LayerConfig(2, 128), cc.LayerConfig(2, 12)],
                         max_write=8, dtype="bfloat16", paged=True, mask_format="bool")
    paths = cct.layer_paths(cfg, 8)
    assert paths == [ck.choose_path("bfloat16", 128, 4, have_flashinfer=cct.have_flashinfer(),
                                    has_masks=True), "sdpa"]
    assert paths[0] in ("tc", "paged")
    with pytest.raises(cc.InvalidArgument, match="n_heads=0"):
        cct.layer_paths(cfg, 0)
    bare = cc.CacheConfig(capacity=64, layers=[cc.LayerConfig(2, 12)], max_write=8,
                          dtype="bfloat16", paged=True, mask_format="none")
    if not cct.have_flashinfer():
        with pytest.raises(cc.InvalidArgument, match="no attention path computes head_dim=12"):
            cct.layer_paths(bare, 8)


def test_view_layer_refuses_negative_and_out_of_range_indices():
    cache = cc.HostCellCache(cc.CacheConfig(capacity=64, layers=LAYERS, max_write=8, dtype="float32"))
    view = cct.TorchView(cache)
    for index, match in [(-1, "layer=-1 is outside \\[0, 1\\]"), (2, "layer=2 is outside"),
                         (1.0, "of type float"), ("0", "of type str"), (None, "of type NoneType")]:
        with pytest.raises(cc.InvalidArgument, match=match):
            view.layer(index)
    k, v, window = view.layer(np.int64(1))
    assert window == 8 and k.data_ptr() == cache.layer(1).k.ctypes.data


class _BadDLPack:
    def __dlpack__(self, stream=None):
        raise TypeError("no capsule today")

    def __dlpack_device__(self):
        return (1, 0)


@pytest.mark.parametrize("obj,match", [
    ([1, 2], "buffer of type list is not a cache buffer"),
    (None, "buffer of type NoneType"),
    (np.array([object()]), "cannot be viewed as a tensor"),
    (np.array(["ab"]), "cannot be viewed as a tensor"),
    (_BadDLPack(), "buffer of type _BadDLPack cannot be viewed as a tensor"),
])
def test_as_tensor_refuses_what_is_not_a_buffer(obj, match):
    with pytest.raises(cc.InvalidArgument, match=match):
        cct.as_tensor(obj)


def test_torch_dtype_refuses_unknown_names():
    assert cct.torch_dtype("bfloat16") is torch.bfloat16
    for name in ("int8", None, torch.float32):
        with pytest.raises(cc.InvalidArgument, match="is not one of float16, bfloat16, float32"):
            cct.torch_dtype(name)


@pytest.mark.parametrize("fmt", ["bool", "bits"])
def test_a_view_follows_pools_that_move_by_copy_growth(fmt):
    """Copy growth moves the pools at every growth: a view built before the first step
    (empty pools) notices by itself, refreshes, and the attention stays exact."""
    cfg = cc.CacheConfig(capacity=512, layers=LAYERS, max_write=32, initial_capacity=8,
                         dtype="float32", max_seqs=16, mask_format=fmt)
    cache = cc.HostCellCache(cfg, allocator=HostAllocator())
    view = cct.TorchView(cache)
    assert view.layer(0)[0].shape[0] == 0 and not view.stale()
    moved = []

    attend = session_forward(view)

    def forward(cache, step, qkv):
        moved.append(view.stale())
        outs = attend(cache, step, qkv)
        assert view.layer(1)[0].data_ptr() == cache.layer(1).k.ctypes.data   # the live pools
        return outs

    s = Session(cache, forward, SessionConfig(n_heads=4, buckets=[4, 8, 16, 32]), seed=1).run(60)
    assert s["mismatches"] == 0 and s["growths"] >= 3
    assert sum(moved) == s["growths"] + 1 and view.generation == s["growths"] + 2
