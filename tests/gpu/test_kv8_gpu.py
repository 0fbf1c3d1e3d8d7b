"""8-bit K/V (CacheConfig.kv_dtype="float8_e4m3fn") through cellcache.torch.attention on a CUDA
cache: the tensor-core e4m3 path equals SDPA over the dequantized pools, stays within e4m3's
rounding of 16-bit K/V, a layer's first write (which sets its scales) is refused inside a
graph capture with nothing written, and a captured decode step replays as it ran eagerly;
FlashInfer's e4m3 kernels read the same pools to the same result; a Generator serving with
8-bit K/V uses half the pool bytes a cell and passes the teacher-forced agreement check."""

from __future__ import annotations

import numpy as np
import pytest

import cellcache as cc

from ..helpers import cuda

LAYERS = (cc.LayerConfig(2, 64), cc.LayerConfig(2, 128, 40))
H = 8


def _cache(kv_dtype):
    CudaCellCache, *_ = cuda()
    cfg = cc.CacheConfig(capacity=4096, layers=LAYERS, max_write=256, initial_capacity=4096,
                         dtype="bfloat16", max_seqs=8, paged=True, mask_format="bool",
                         kv_dtype=kv_dtype)
    return CudaCellCache(cfg)


def _qkv(torch, gen, T, D):
    q = torch.randn((T, H, D), generator=gen, device="cuda").bfloat16()
    k = (torch.randn((T, 2, D), generator=gen, device="cuda") * 3).bfloat16()
    v = torch.randn((T, 2, D), generator=gen, device="cuda").bfloat16()
    return q, k, v


def test_kv8_attention_matches_sdpa_and_16bit_within_e4m3():
    torch = pytest.importorskip("torch")
    import cellcache.torch as cct

    c8, c16 = _cache("fp8"), _cache(None)
    try:
        v8, v16 = cct.TorchView(c8), cct.TorchView(c16)
        assert v8.layer(0)[0].dtype == torch.float8_e4m3fn and v8.layer(0)[0].element_size() == 1
        assert cct.layer_paths(c8.config, H) == ["tc", "tc"]
        assert c8.layer(0).k.nbytes * 2 == c16.layer(0).k.nbytes          # twice the cells a byte
        seqs = [(c8.seq_new(), c16.seq_new()) for _ in range(4)]
        gen = torch.Generator(device="cuda").manual_seed(0)
        steps = [[0] * 100 + [1] * 37 + [2] * 64 + [3] * 9] + [[0, 1, 2, 3]] * 3 + [[1] * 20 + [2, 3]]
        worst = 0.0
        for n, rows in enumerate(steps):
            pad = len(rows) + 3
            for c, ids in ((c8, [seqs[i][0] for i in rows]), (c16, [seqs[i][1] for i in rows])):
                assert c.declare_step(ids)
            s8 = c8.prepare_step(stream=torch.cuda.current_stream(), pad_to=pad)
            s16 = c16.prepare_step(stream=torch.cuda.current_stream(), pad_to=pad)
            for layer, lc in enumerate(LAYERS):
                q, k, v = _qkv(torch, gen, pad, lc.head_dim)
                if n == 0:
                    assert not v8.kv_scales_set(layer)
                tc = cct.attention(v8, layer, q, k, v, step=s8, backend="tc")      # refused without it
                ref = cct.attention(v8, layer, q, k, v, step=s8, backend="sdpa")   # same bytes again
                full = cct.attention(v16, layer, q, k, v, step=s16)
                w = s8.width
                assert v8.kv_scales_set(layer)
                d = float((tc[:w].float() - ref[:w].float()).abs().max())
                assert d <= 3e-2, f"step {n} layer {layer}: tc vs sdpa over the same 8-bit pools {d}"
                assert not bool(tc[w:].float().any()), "padding rows not zero"
                e = float((tc[:w].float() - full[:w].float()).abs().mean())
                worst = max(worst, e)
                assert e <= 0.05, f"step {n} layer {layer}: 8-bit vs 16-bit K/V, mean {e}"   # e4m3: ~3%
            c8.commit_step()
            c16.commit_step()
        scales = v8.kv_scales(1)
        assert scales.shape == (2, 2) and bool((scales > 0).all())
        assert worst > 0                                        # the 8-bit run did quantize
    finally:
        c8.close()
        c16.close()


def test_kv8_first_write_refused_in_capture_then_graph_replays():
    torch = pytest.importorskip("torch")
    import cellcache.torch as cct

    c = _cache("fp8")
    try:
        seqs = [c.seq_new() for _ in range(4)]
        gen = torch.Generator(device="cuda").manual_seed(1)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            assert c.declare_step(seqs)
            step = c.prepare_step(stream=stream, pad_to=8)
        view = cct.TorchView(c)                                  # over the pools the step mapped
        qkv = [_qkv(torch, gen, 8, lc.head_dim) for lc in LAYERS]
        before = [view.layer(i)[0].view(torch.uint8).clone() for i in range(len(LAYERS))]
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(cc.InvalidState, match="first write"):
            with torch.cuda.graph(graph, stream=stream):
                cct.attention(view, 0, *qkv[0], step=step)
        del graph
        torch.cuda.synchronize()
        assert all(bool((view.layer(i)[0].view(torch.uint8) == b).all()) for i, b in enumerate(before))
        assert not view.kv_scales_set(0)
        with torch.cuda.stream(stream):                          # eager: the scales are set
            outs = [cct.attention(view, i, *qkv[i], step=step).clone() for i in range(len(LAYERS))]
            c.commit_step()
            assert c.declare_step(seqs)
            step = c.prepare_step(stream=stream, pad_to=8)
        qkv2 = [_qkv(torch, gen, 8, lc.head_dim) for lc in LAYERS]
        graph = torch.cuda.CUDAGraph()
        outs_g = []
        with torch.cuda.graph(graph, stream=stream):
            for i in range(len(LAYERS)):
                outs_g.append(cct.attention(view, i, *qkv2[i], step=step))
        graph.replay()
        torch.cuda.synchronize()
        eager = [cct.attention(view, i, *qkv2[i], step=step, backend="sdpa") for i in range(len(LAYERS))]
        for i in range(len(LAYERS)):
            assert float((outs_g[i][:4].float() - eager[i][:4].float()).abs().max()) <= 3e-2
            assert bool(torch.isfinite(outs[i]).all())
        c.commit_step()
    finally:
        c.close()


def test_flashinfer_reads_8bit_pools_as_the_tensor_core_kernels_do():
    """FlashInfer's e4m3 K/V kernels over the same 8-bit pools (the per-kv-head scales folded
    into q and the output) give the tensor-core kernels' result, windows and GQA included; a
    head_dim FlashInfer does not take is refused before any write."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("flashinfer")
    import cellcache.torch as cct

    c = _cache("fp8")
    try:
        view = cct.TorchView(c)
        seqs = [c.seq_new() for _ in range(4)]
        gen = torch.Generator(device="cuda").manual_seed(2)
        steps = [[0] * 90 + [1] * 41 + [2] * 7 + [3] * 60] + [[0, 1, 2, 3]] * 2 + [[2] * 30 + [0, 3]]
        for n, rows in enumerate(steps):
            assert c.declare_step([seqs[i] for i in rows])
            step = c.prepare_step(stream=torch.cuda.current_stream(), pad_to=len(rows) + 5)
            w = step.width
            for layer, lc in enumerate(LAYERS):
                q, k, v = _qkv(torch, gen, len(rows) + 5, lc.head_dim)
                tc = cct.attention(view, layer, q, k, v, step=step, backend="tc")
                fi = cct.attention(view, layer, q, k, v, step=step, backend="flashinfer")
                # (bf16 outputs: a rounding apart where P or q*scale round differently)
                d = float(((tc[:w].float() - fi[:w].float()).abs() - 1e-2 * tc[:w].float().abs()).max())
                assert d <= 2e-2, f"step {n} layer {layer}: FlashInfer vs tc over the same 8-bit pools {d}"
                assert float(fi[:w].float().abs().mean()) > 1e-2        # not an empty result
            c.commit_step()
    finally:
        c.close()
    # a head_dim FlashInfer does not take: refused before the write that would set the scales
    CudaCellCache, *_ = cuda()
    c96 = CudaCellCache(cc.CacheConfig(capacity=256, layers=[cc.LayerConfig(2, 96)], max_write=16,
                                       dtype="bfloat16", max_seqs=2, paged=True, kv_dtype="fp8"))
    try:
        view = cct.TorchView(c96)
        assert c96.declare_step([c96.seq_new()] * 3)
        step = c96.prepare_step(stream=torch.cuda.current_stream())
        before = view.layer(0)[0].view(torch.uint8).clone()
        q, k, v = _qkv(torch, torch.Generator(device="cuda").manual_seed(3), 3, 96)
        with pytest.raises(cc.InvalidArgument, match="head_dim=96"):
            cct.attention(view, 0, q, k, v, step=step, backend="flashinfer")
        assert not view.kv_scales_set(0) and torch.equal(view.layer(0)[0].view(torch.uint8), before)
    finally:
        c96.close()


@pytest.mark.parametrize("name,attention", [("llama-tiny", "auto"), ("qwen2.5-0.5b", "auto"),
                                            ("qwen2.5-0.5b", "flashinfer")])
def test_generator_serves_8bit_kv_in_agreement(name, attention):
    """Random bf16 models served with 8-bit K/V (head_dim 16: SDPA over the dequantized pools;
    64: the tensor-core e4m3 kernels, or FlashInfer's): the pools take a byte an element, and
    the teacher-forced check passes against HF float32 with the noise floor of HF's bf16
    forward over K/V rounded to e4m3 at the served scales."""
    torch = pytest.importorskip("torch")
    cuda()
    if attention == "flashinfer":
        pytest.importorskip("flashinfer")
    from cellcache.generate import Generator, Sampling
    from cellcache.generate.agreement import LogitsTap, compare, kv8_floor, reference_models
    from cellcache.generate.cli import random_model

    model = random_model(name, dtype=torch.bfloat16, device="cuda")
    ref, floor = reference_models(model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 500, size=int(n)).tolist() for n in rng.integers(5, 120, size=12)]
    prompts[1] = prompts[0][:50] + prompts[1]             # a prefix-cache hit
    gen = Generator(model, capacity=8192, eos=[], kv_dtype="fp8", attention=attention)
    gen.warmup()                                          # dummy tokens: must not set the scales
    view = gen.runner.view
    assert not any(view.kv_scales_set(i) for i in range(len(gen.cache.config.layers)))
    per_cell = [gen.cache.layer(i).k.nbytes // gen.cache.layer(i).k.shape[0]
                for i in range(len(gen.cache.config.layers))]
    lc = gen.cache.config.layers[0]
    assert per_cell[0] == lc.n_kv_heads * lc.head_dim                   # one byte an element
    with LogitsTap(gen) as tap:
        reqs = [gen.add(p, Sampling(max_new_tokens=16)) for p in prompts]
        gen.run()
    assert all(len(r.outputs[0]) == 16 for r in reqs)
    assert view.kv_scales_ready()
    # d64: the tensor cores, graphs (the first real step eager); d16 (SDPA) and FlashInfer:
    # eager, no graphs
    graphs = name != "llama-tiny" and attention == "auto"
    assert (gen.stats["graph_steps"] > 0) == graphs == gen.runner.graphs_enabled
    kv8_floor(floor, gen.runner.view)
    report = compare(tap.rows(), ref, floor)
    assert report.passed, report.summary()
    gen.cache.close()
