"""8-bit K/V pools (CacheConfig.kv_dtype) on the host backend: the config, the pools' bytes,
the K/V write (scaled per layer and kv head, saturating), the scales set at a layer's first
write or ahead of it, attention over the dequantized pools against float64 attention over
the same rounded values and within e4m3's rounding of the unrounded ones, every refusal
with nothing changed, and a Generator serving with 8-bit K/V."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cellcache as cc  # noqa: E402
import cellcache.torch as cct  # noqa: E402

LAYERS = (cc.LayerConfig(2, 16, 0), cc.LayerConfig(2, 16, 5))


def _cache(kv_dtype="fp8", **kw):
    cfg = dict(capacity=256, layers=LAYERS, max_write=32, dtype="float32", max_seqs=8)
    cfg.update(kw)
    return cc.HostCellCache(cc.CacheConfig(kv_dtype=kv_dtype, **cfg))


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "e4m3", "float8_e4m3fn", torch.float8_e4m3fn])
def test_config_takes_8bit_names_and_halves_the_pools(name):
    c8 = cc.CacheConfig(capacity=64, layers=LAYERS, max_write=8, kv_dtype=name)
    assert c8.kv_dtype == "float8_e4m3fn" and c8.kv8 and c8.dtype == "bfloat16"
    assert c8.np_dtype.itemsize == 1
    c16 = cc.CacheConfig(capacity=64, layers=LAYERS, max_write=8)
    assert c16.kv_dtype is None and not c16.kv8
    import dataclasses
    assert dataclasses.replace(c8, dtype="float16").kv8 and not dataclasses.replace(c16, dtype="float16").kv8
    a, b = cc.HostCellCache(c8), cc.HostCellCache(c16)
    assert a.layer(0).k.nbytes * 2 == b.layer(0).k.nbytes     # twice the cells in the same bytes
    assert cc.CacheConfig(capacity=64, layers=LAYERS, max_write=8, dtype="float16",
                          kv_dtype="float16").kv_dtype is None


@pytest.mark.parametrize("bad", ["int8", "float16", "fp4", 3, torch.int8])
def test_config_refuses_other_kv_dtypes(bad):
    with pytest.raises(cc.InvalidArgument, match="kv_dtype"):
        cc.CacheConfig(capacity=64, layers=LAYERS, max_write=8, kv_dtype=bad)


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).double()


def _attend64(q, ks, vs, scale=None):
    """float64 attention of one row over [n, Hkv, D] keys (every key visible)."""
    H, D = q.shape
    G = H // ks.shape[1]
    k = ks.repeat_interleave(G, dim=1)
    v = vs.repeat_interleave(G, dim=1)
    s = torch.einsum("hd,nhd->hn", q, k) * (scale or 1 / math.sqrt(D))
    return torch.einsum("hn,nhd->hd", s.softmax(-1), v)


def test_attention_reads_what_was_written_scaled_and_rounded():
    """One sequence fed in three steps (a prompt chunk, decode rows, a padded step): layer 0's
    output is float64 attention over the values its pools stand for (stored e4m3 x scale),
    and within e4m3's rounding of attention over the unrounded K/V."""
    cache = _cache()
    view = cct.TorchView(cache)
    s = cache.seq_new()
    g = torch.Generator().manual_seed(0)
    hist_k, hist_v = [], []
    for n, pad in ((11, 11), (1, 1), (3, 6)):
        assert cache.declare_step([s] * n)
        step = cache.prepare_step(pad_to=pad)
        q = torch.randn((pad, 4, 16), generator=g)
        k = torch.randn((pad, 2, 16), generator=g) * torch.tensor([1.0, 9.0])[:, None]
        v = torch.randn((pad, 2, 16), generator=g)
        k[n:] = float("nan")                           # padding rows: never read
        v[n:] = float("nan")
        out = cct.attention(view, 0, q, k, v, step=step)
        cache.commit_step()
        hist_k.append(k[:n].double())
        hist_v.append(v[:n].double())
        sc = view.kv_scales(0).double()
        kk, vv = torch.cat(hist_k), torch.cat(hist_v)
        k_st = _e4m3(kk / sc[0][:, None]) * sc[0][:, None]
        v_st = _e4m3(vv / sc[1][:, None]) * sc[1][:, None]
        L = kk.shape[0]
        for i in range(n):
            visible = L - n + i + 1
            want = _attend64(q[i].double(), k_st[:visible], v_st[:visible])
            assert torch.allclose(out[i].double(), want, atol=1e-5), (n, i)
            exact = _attend64(q[i].double(), kk[:visible], vv[:visible])
            assert float((out[i].double() - exact).abs().mean()) < 0.05      # e4m3: ~3% a value
    # the scales came from the first write: max(amax, 1) x 4 / 448 per kv head
    first_k = hist_k[0].abs().amax(dim=(0, 2))
    want = first_k.clamp(min=1.0) * 4 / 448
    assert torch.allclose(view.kv_scales(0)[0].double(), want, rtol=1e-6)
    stored = view.layer(0)[0]
    assert stored.dtype == torch.float8_e4m3fn


def test_values_past_the_headroom_saturate_instead_of_overflowing():
    cache = _cache()
    view = cct.TorchView(cache)
    view.set_kv_scales(0, 0.01, 0.01)                 # 448 x 0.01 = 4.48 at most
    s = cache.seq_new()
    assert cache.declare_step([s] * 2)
    step = cache.prepare_step()
    q = torch.ones((2, 4, 16))
    k = torch.full((2, 2, 16), 1e6)
    v = torch.full((2, 2, 16), -1e6)
    out = cct.attention(view, 0, q, k, v, step=step)
    pool_k = view.layer(0)[0][cache.buffer("cells")[:2].tolist()].float()
    assert bool(torch.isfinite(pool_k).all()) and float(pool_k.max()) == 448.0
    assert bool(torch.isfinite(out).all()) and torch.allclose(out, torch.full_like(out, -4.48))


def test_set_kv_scales_refusals_change_nothing():
    cache = _cache()
    view = cct.TorchView(cache)
    before = view.kv_scales(1).clone()
    for args, error, match in (
            ((1, 0.0, 1.0), cc.InvalidArgument, "k_scale must be one finite number > 0"),
            ((1, 1.0, float("nan")), cc.InvalidArgument, "v_scale must be"),
            ((1, [1.0, 2.0, 3.0], 1.0), cc.InvalidArgument, "or 2 of them"),
            ((1, "x", 1.0), cc.InvalidArgument, "k_scale of type str"),
            ((2, 1.0, 1.0), cc.InvalidArgument, "layer=2 is outside"),
            ((-1, 1.0, 1.0), cc.InvalidArgument, "layer=-1 is outside")):
        with pytest.raises(error, match=match):
            view.set_kv_scales(*args)
        assert torch.equal(view.kv_scales(1), before) and not view.kv_scales_set(1)
    view.set_kv_scales(1, [0.5, 2.0], 3.0)
    assert view.kv_scales(1).tolist() == [[0.5, 2.0], [3.0, 3.0]] and view.kv_scales_set(1)
    with pytest.raises(cc.InvalidState, match="set already"):
        view.set_kv_scales(1, 1.0, 1.0)
    assert view.kv_scales(1).tolist() == [[0.5, 2.0], [3.0, 3.0]]
    # another view of the same cache shares the table
    assert cct.TorchView(cache).kv_scales(1).tolist() == [[0.5, 2.0], [3.0, 3.0]]
    plain = cct.TorchView(_cache(kv_dtype=None))
    assert plain.kv_scales(0) is None and not plain.kv_scales_set(0)
    with pytest.raises(cc.InvalidArgument, match="only 8-bit pools"):
        plain.set_kv_scales(0, 1.0, 1.0)


def test_reset_kv_scales_only_without_cells():
    cache = _cache()
    view = cct.TorchView(cache)
    assert not view.kv_scales_ready()
    view.set_kv_scales(0, 0.5, 0.25)
    view.set_kv_scales(1, 2.0, 4.0)
    assert view.kv_scales_ready()
    s = cache.seq_new()
    assert cache.declare_step([s] * 2)
    step = cache.prepare_step()
    cct.attention(view, 0, torch.ones((2, 4, 16)), torch.ones((2, 2, 16)), torch.ones((2, 2, 16)), step=step)
    cct.attention(view, 1, torch.ones((2, 4, 16)), torch.ones((2, 2, 16)), torch.ones((2, 2, 16)), step=step)
    cache.commit_step()
    with pytest.raises(cc.InvalidState, match="cells hold K/V"):
        view.reset_kv_scales()
    assert view.kv_scales(0).tolist() == [[0.5, 0.5], [0.25, 0.25]] and view.kv_scales_ready()
    cache.seq_rm(s)
    view.reset_kv_scales()
    assert not view.kv_scales_ready() and view.kv_scales(0).tolist() == [[1.0, 1.0], [1.0, 1.0]]
    plain = cct.TorchView(_cache(kv_dtype=None))
    plain.reset_kv_scales()
    assert plain.kv_scales_ready()


def test_a_first_write_with_non_finite_values_keeps_finite_scales():
    cache = _cache()
    view = cct.TorchView(cache)
    s = cache.seq_new()
    assert cache.declare_step([s] * 3)
    step = cache.prepare_step()
    k = torch.ones((3, 2, 16)) * 2
    k[1, 0, 3] = float("inf")
    k[2, 1, 5] = float("nan")
    cct.attention(view, 0, torch.ones((3, 4, 16)), k, torch.ones((3, 2, 16)), step=step)
    assert bool(torch.isfinite(view.kv_scales(0)).all())
    assert torch.allclose(view.kv_scales(0)[0], torch.full((2,), 2.0 * 4 / 448))


def _pool_bytes(view):
    return [p.view(torch.uint8).clone() for i in range(len(LAYERS)) for p in view.layer(i)[:2]]


@pytest.mark.parametrize("backend", ["paged", "prefill", "invariant"])
def test_backends_that_do_not_read_8bit_pools_are_refused_before_any_write(backend):
    cache = _cache(paged=True)
    view = cct.TorchView(cache)
    s = cache.seq_new()
    assert cache.declare_step([s] * 3)
    step = cache.prepare_step()
    before = _pool_bytes(view)
    q, k, v = torch.ones((3, 4, 16)), torch.ones((3, 2, 16)), torch.ones((3, 2, 16))
    with pytest.raises(cc.InvalidArgument, match="does not read 8-bit K/V pools"):
        cct.attention(view, 0, q, k, v, step=step, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(before, _pool_bytes(view)))
    assert not view.kv_scales_set(0)


def test_reference_write_refuses_8bit_pools():
    from cellcache.attention import write_kv

    cache = _cache()
    s = cache.seq_new()
    assert cache.declare_step([s] * 2)
    cache.prepare_step()
    before = cache.layer(0).k.copy()
    with pytest.raises(cc.InvalidArgument, match="8-bit pools"):
        write_kv(cache, 0, np.ones((2, 2, 16), np.float32), np.ones((2, 2, 16), np.float32), 2)
    assert np.array_equal(before.view(np.uint8), cache.layer(0).k.view(np.uint8))


def test_sequence_files_round_trip_8bit_pools_and_move_to_16bit_caches(tmp_path):
    """A file of an 8-bit cache holds the values its bytes stand for; loaded back into the same
    cache it gives the same bytes, and into a 16-bit cache of the same shape the same values."""
    from cellcache.seqstate import cells_by_position, load_sequence, save_sequence

    def cells_of(c, sid):
        return torch.from_numpy(cells_by_position(c, sid)[0].astype(np.int64))

    cache = _cache()
    view = cct.TorchView(cache)
    s = cache.seq_new()
    g = torch.Generator().manual_seed(3)
    for n in (9, 1, 4):
        assert cache.declare_step([s] * n)
        step = cache.prepare_step()
        for layer in range(len(LAYERS)):
            q = torch.randn((n, 4, 16), generator=g)
            k = torch.randn((n, 2, 16), generator=g) * 5
            cct.attention(view, layer, q, k, torch.randn((n, 2, 16), generator=g), step=step)
        cache.commit_step()
    assert save_sequence(cache, s, tmp_path / "a.seq") == 14
    cells = cells_of(cache, s)
    want = [view.layer(i)[kv].view(torch.uint8)[cells].clone() for i in range(2) for kv in (0, 1)]
    t, _ = load_sequence(cache, tmp_path / "a.seq")
    cells2 = cells_of(cache, t)
    got = [view.layer(i)[kv].view(torch.uint8)[cells2] for i in range(2) for kv in (0, 1)]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    plain = _cache(kv_dtype=None)
    u, _ = load_sequence(plain, tmp_path / "a.seq")
    pv = cct.TorchView(plain)
    cells3 = cells_of(plain, u)
    for i in range(2):
        k8, v8 = view.dequantized(i, cells, torch.float32)
        assert torch.equal(pv.layer(i)[0][cells3], k8) and torch.equal(pv.layer(i)[1][cells3], v8)


def test_generator_serves_8bit_kv_on_the_host():
    """A float32 Llama-shaped model: 8-bit K/V gives continuations of the requested lengths,
    the pools a byte an element, its scales set for every layer; the first token of each
    request (read from the prompt alone) equals the 16-bit run's unless its top-2 margin is
    within e4m3's rounding."""
    from cellcache.generate import Generator, Sampling
    from cellcache.generate.cli import random_model

    model = random_model("llama-tiny")
    prompts = [[1 + i, 5, 9, 2, 7, 3, 8][: 3 + i] for i in range(5)]
    firsts = {}
    for kv in (None, "fp8"):
        gen = Generator(model, capacity=512, eos=[], kv_dtype=kv)
        reqs = [gen.add(p, Sampling(max_new_tokens=6)) for p in prompts]
        gen.run()
        assert all(len(r.outputs[0]) == 6 for r in reqs)
        firsts[kv] = [r.outputs[0][0] for r in reqs]
        if kv:
            assert gen.cache.config.kv8 and gen.cache.layer(0).k.dtype.itemsize == 1
            assert all(gen.runner.view.kv_scales_set(i) for i in range(len(gen.cache.config.layers)))
    assert sum(a == b for a, b in zip(firsts[None], firsts["fp8"])) >= 4
    with pytest.raises(cc.InvalidArgument, match="kv_dtype"):
        Generator(model, capacity=512, kv_dtype="int4")
    with pytest.raises(cc.InvalidArgument, match="8-bit K/V does not serve with deterministic"):
        Generator(model, capacity=512, kv_dtype="fp8", deterministic=True)
    with pytest.raises(cc.InvalidArgument, match="needs a CUDA cache"):     # FlashInfer reads 8-bit pools
        Generator(model, capacity=512, kv_dtype="fp8", attention="flashinfer")
    given = cc.build("host", "batched", cc.CacheConfig(capacity=512, layers=LAYERS, max_write=32,
                                                       dtype="float32"))
    with pytest.raises(cc.InvalidArgument, match="differs from the given cache's"):
        Generator(model, cache=given, kv_dtype="fp8")
