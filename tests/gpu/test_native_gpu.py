"""The native forward's kernels (cuda/fused.cu) on the device: each equals the transformers
modules' torch ops on the same tensors (rounded where they round), in float32, fp16 and
bf16, on the vectorized and the scalar variants, on strided rows and inside a captured
graph; and the native forward in float32 gives HF generate's greedy tokens with graphs and
asynchronous steps. (Its agreement in bf16/fp16 is test_agreement_gpu.py's.)"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cellcache import InvalidArgument  # noqa: E402
from cellcache import native as ccn  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def ulp_close(got: torch.Tensor, want: torch.Tensor, ulps: int = 1, same: float = 0.99) -> None:
    """Equal up to ``ulps`` units in the last place of the dtype, and bit for bit in at
    least ``same`` of the elements."""
    eps = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=ulps * eps, atol=ulps * eps)
    equal = (got == want).float().mean().item()
    assert equal >= same, equal


def norm_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """A norm's output against the modules': the RMS sum's order differs, which moves rstd by
    an ulp of float32 now and then; in float32 that moves the whole row by an ulp or two, in
    16-bit types it rarely crosses a rounding boundary."""
    if got.dtype == torch.float32:
        ulp_close(got, want, ulps=4, same=0.0)
    else:
        ulp_close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [896, 4096, 100])           # v8/v4 variants, and v1
def test_norms_equal_the_modules_ops(dtype, hidden):
    g = torch.Generator(device="cuda").manual_seed(hidden)
    rows = 37
    w = torch.randn(hidden, device="cuda", generator=g).to(dtype)
    big = torch.randn(rows, hidden + 8, device="cuda", generator=g).to(dtype)
    x = big[:, :hidden]                                          # strided rows
    res = torch.randn(rows, hidden, device="cuda", generator=g).to(dtype)
    norm_close(ccn.rms_norm(x, w, 1e-6), ccn._norm_ref(x, w, 1e-6))
    want_sum = res + x
    want = ccn._norm_ref(want_sum, w, 1e-6)
    out, s = ccn.add_rms_norm(x, res.clone(), w, 1e-6, inplace=False)
    assert torch.equal(s, want_sum)
    norm_close(out, want)
    keep = res.clone()
    out, s = ccn.add_rms_norm(x, keep, w, 1e-6)
    assert s is keep and torch.equal(keep, want_sum)
    norm_close(out, want)
    empty = x[:0]                                                # no rows: nothing launched
    assert ccn.rms_norm(empty, w, 1e-6).shape == (0, hidden)
    assert ccn.add_rms_norm(empty, res[:0], w, 1e-6)[0].shape == (0, hidden)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [151936, 1001])              # v8/v4 variants, and v1
def test_logits_out_is_the_float32_copy_and_torch_s_argmax(dtype, vocab):
    g = torch.Generator(device="cuda").manual_seed(vocab)
    rows = 300
    big = (4 * torch.randn(rows, vocab + 8, device="cuda", generator=g)).to(dtype)
    x = big[:, :vocab]                                           # strided rows
    x[1, 7] = x[1, vocab - 3] = x[1].max() + 1                   # a tie: the lowest id
    x[2] = float("-inf")                                         # no finite value: id 0
    x[3, 5] = x[3, 9] = float("nan")                             # NaN beats every number
    x[4, vocab - 1] = float("inf")
    x[5, vocab - 2] = float("nan")
    x[5, 3] = float("inf")
    x[6] = x[6, 0]                                               # every id ties
    out = torch.full((rows + 2, vocab), 7.0, device="cuda")
    ids = torch.full((rows + 2,), -1, dtype=torch.long, device="cuda")
    ccn.logits_out(x, out[:rows], ids[:rows])
    bits = lambda t: t.float().view(torch.int32)  # noqa: E731 - equal bit for bit (NaN too)
    assert torch.equal(bits(out[:rows]), bits(x)) and torch.equal(ids[:rows], torch.argmax(x, dim=-1))
    assert ids[[1, 2, 3, 4, 5, 6]].tolist() == [7, 0, 5, vocab - 1, vocab - 2, 0]
    assert (out[rows:] == 7).all() and (ids[rows:] == -1).all()  # nothing past the rows
    ccn.logits_out(x[:0], out[:0], ids[:0])                      # no rows: nothing launched
    with pytest.raises(InvalidArgument, match="no vocabulary"):  # refused, nothing written
        ccn.logits_out(x[:, :0], out[:rows, :0], ids[:rows])
    assert torch.equal(ids[:rows], torch.argmax(x, dim=-1))
    # inside a captured graph, as the runner's decode graphs run it
    y = torch.randn(rows, vocab, device="cuda", generator=g).to(dtype)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ccn.logits_out(y, out[:rows], ids[:rows])
    y.copy_(torch.randn(rows, vocab, device="cuda", generator=g).to(dtype))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(out[:rows]), bits(y)) and torch.equal(ids[:rows], torch.argmax(y, dim=-1))
    # a graph with the write flag: 0 when it replays leaves the copy alone, the ids still come
    write = torch.ones(1, dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ccn.logits_out(y, out[:rows], ids[:rows], write)
    for on in (0, 1, 0):
        y.copy_(torch.randn(rows, vocab, device="cuda", generator=g).to(dtype))
        out.fill_(7.0)
        write.fill_(on)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(ids[:rows], torch.argmax(y, dim=-1))
        assert torch.equal(bits(out[:rows]), bits(y)) if on else bool((out == 7).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [4864, 1000, 36])
def test_silu_mul_equals_the_modules_ops(dtype, inter):
    g = torch.Generator(device="cuda").manual_seed(inter)
    gu = (3 * torch.randn(53, 2 * inter, device="cuda", generator=g)).to(dtype)
    want = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    ulp_close(ccn.silu_mul(gu), want)
    assert ccn.silu_mul(gu[:0]).shape == (0, inter)


def test_steps_past_65535_rows_launch():
    """Rows go on the grid's x dimension (y stops at 65535): a 70,000-token step."""
    gu = torch.randn(70_000, 2 * 64, device="cuda").to(torch.bfloat16)
    ulp_close(ccn.silu_mul(gu), torch.nn.functional.silu(gu[:, :64]) * gu[:, 64:])
    qkv = torch.randn(70_000, 3 * 64, device="cuda").to(torch.bfloat16)
    cos, sin = torch.randn(70_000, 64, device="cuda").to(torch.bfloat16), \
        torch.randn(70_000, 64, device="cuda").to(torch.bfloat16)
    want = qkv.clone()
    x = want[:, :128].view(-1, 2, 64)                            # the torch ops, by hand
    x.copy_(x * cos[:, None] + ccn._rotate_half(x) * sin[:, None])
    ccn.rotary_(qkv, cos, sin, 2, 64)
    ulp_close(qkv, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv, d", [(14, 2, 64), (32, 8, 128), (32, 32, 80), (8, 1, 256)])
def test_rotary_equals_apply_rotary_pos_emb(dtype, heads, kv, d):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator(device="cuda").manual_seed(d)
    T = 41
    qkv = torch.randn(T, (heads + 2 * kv) * d, device="cuda", generator=g).to(dtype)
    pos = torch.randint(0, 30000, (1, T), device="cuda", generator=g)
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2, dtype=torch.float32, device="cuda") / d))
    emb = torch.cat((pos[..., None].float() * inv,) * 2, dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q = qkv[:, :heads * d].view(T, heads, d).transpose(0, 1)[None]
    k = qkv[:, heads * d:(heads + kv) * d].view(T, kv, d).transpose(0, 1)[None]
    q_want, k_want = apply_rotary_pos_emb(q, k, cos, sin)
    v = qkv[:, (heads + kv) * d:].clone()
    ccn.rotary_(qkv, cos[0], sin[0], heads + kv, d)
    ulp_close(qkv[:, :heads * d].view(T, heads, d), q_want[0].transpose(0, 1))
    ulp_close(qkv[:, heads * d:(heads + kv) * d].view(T, kv, d), k_want[0].transpose(0, 1))
    assert torch.equal(qkv[:, (heads + kv) * d:], v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv, d, pad", [(14, 2, 64, 0), (32, 8, 128, 0), (8, 1, 256, 0),
                                               (14, 2, 64, 24)])
def test_rotary_store_equals_rotary_then_the_kv_write(dtype, heads, kv, d, pad):
    """The fused launch: qkv as rotary_ leaves it, and the pools as the attention's K/V
    write (index_copy_ of the rotated k and of v at the rows' cells) leaves them, bit for
    bit; every other row untouched. Padding rows all write the sink (the last row here),
    whose content no one reads: each element is one of theirs. ``pad``: rows of qkv, cos and sin
    that many elements further apart than their width (strided views)."""
    from cellcache.cuda.fused import fused_kernels

    g = torch.Generator(device="cuda").manual_seed(d + heads + pad)
    T, rows, W = 37, 300, (heads + 2 * kv) * d
    qkv = torch.randn(T, W + pad, device="cuda", generator=g).to(dtype)[:, :W]
    cos = torch.randn(T, d + pad, device="cuda", generator=g).to(dtype)[:, :d]
    sin = torch.randn(T, d + pad, device="cuda", generator=g).to(dtype)[:, :d]
    cells = torch.randperm(rows - 1, device="cuda", generator=g)[:T]
    cells[-3:] = rows - 1                          # padding rows: the sink
    k_pool = torch.randn(rows, kv, d, device="cuda", generator=g).to(dtype)
    v_pool = torch.randn(rows, kv, d, device="cuda", generator=g).to(dtype)
    want_qkv = qkv.clone()
    ccn.rotary_(want_qkv, cos, sin, heads + kv, d)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    hq, hk = heads * d, kv * d
    want_k[cells[:-3]] = want_qkv[:-3, hq:hq + hk].view(-1, kv, d)
    want_v[cells[:-3]] = want_qkv[:-3, hq + hk:].view(-1, kv, d)
    fused_kernels(0).rotary_store(ccn._DTYPES[dtype], T, qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                  cells.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), heads, kv, d,
                                  qkv.stride(0), cos.stride(0), sin.stride(0),
                                  torch.cuda.current_stream().cuda_stream)
    assert torch.equal(qkv, want_qkv)
    keep = torch.ones(rows, dtype=torch.bool, device="cuda")
    keep[cells] = False
    assert torch.equal(k_pool[keep], want_k[keep]) and torch.equal(v_pool[keep], want_v[keep])
    live = cells[:-3]
    assert torch.equal(k_pool[live], want_k[live]) and torch.equal(v_pool[live], want_v[live])
    # each element of the sink is one of the padding rows' (their threads race element by element)
    pk = torch.stack([want_qkv[t, hq:hq + hk].view(kv, d) for t in (-3, -2, -1)])
    pv = torch.stack([want_qkv[t, hq + hk:].view(kv, d) for t in (-3, -2, -1)])
    assert (k_pool[-1] == pk).any(0).all() and (v_pool[-1] == pv).any(0).all()


@pytest.mark.parametrize("graphs", [True, False])
def test_the_fused_kv_write_serves_what_the_attentions_write_does(graphs, monkeypatch):
    """The native forward with its K/V written by the fused rotary launch and with the
    attention's own write (FUSED_KV_WRITE off): the same seeded tokens (the same K/V, so the
    same logits), in bf16 with graphs and eager; the fused launch ran only in the first."""
    from cellcache.cuda import fused
    from cellcache.generate import Generator, Sampling, random_model

    model = random_model("tiny", torch.bfloat16, "cuda", seed=3)     # (qwen2: biases, a window)
    torch.manual_seed(1)
    prompts = [torch.randint(0, 500, (int(n),)).tolist() for n in (3, 40, 9, 25)]
    import cellcache.torch as cct

    calls, writes = [], []
    real = fused.FusedKernels.rotary_store
    monkeypatch.setattr(fused.FusedKernels, "rotary_store",
                        lambda self, *a: calls.append(a[1]) or real(self, *a))
    real_write = cct.TorchView.write_kv
    monkeypatch.setattr(cct.TorchView, "write_kv",
                        lambda self, *a: writes.append(a[0]) or real_write(self, *a))

    def serve(on):
        monkeypatch.setattr(ccn, "FUSED_KV_WRITE", on)
        gen = Generator(model, capacity=1 << 12, max_seqs=8, prefill_chunk=16, max_batch_tokens=64,
                        eos=[], native=True, graphs=graphs, prefix_cache=False)
        gen.warmup()
        reqs = [gen.add(p, Sampling(max_new_tokens=12, temperature=0.8 if i % 2 else 0.0, seed=i))
                for i, p in enumerate(prompts)]
        gen.run()
        torch.cuda.synchronize()
        view = gen.runner.view
        rows = gen.cache.rows                       # (the sink, row `rows`, left out)
        pools = [t[:rows].clone() for i in range(len(gen.cache.config.layers)) for t in view.layer(i)[:2]]
        return [r.outputs[0] for r in reqs], pools

    fused_out, fused_pools = serve(True)
    assert calls and not writes                     # every layer of every forward fused
    calls.clear()
    plain_out, plain_pools = serve(False)
    assert plain_out == fused_out and not calls and writes
    assert all(torch.equal(a, b) for a, b in zip(fused_pools, plain_pools))


def test_the_kernels_replay_from_a_graph():
    dtype = torch.bfloat16
    x = torch.randn(64, 896, device="cuda").to(dtype)
    res = torch.randn(64, 896, device="cuda").to(dtype)
    w = torch.randn(896, device="cuda").to(dtype)
    gu = torch.randn(64, 2 * 256, device="cuda").to(dtype)
    qkv = torch.randn(64, 18 * 64, device="cuda").to(dtype)
    cos, sin = torch.randn(64, 64, device="cuda").to(dtype), torch.randn(64, 64, device="cuda").to(dtype)

    def run():
        r = res.clone()
        h, r = ccn.add_rms_norm(x, r, w, 1e-6)
        q = qkv.clone()
        ccn.rotary_(q, cos, sin, 16, 64)
        return h, r, ccn.silu_mul(gu), q

    eager = run()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()                                    # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for t in out:
        t.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(out, eager):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name, graphs", [("tiny", True), ("llama-tiny", True), ("mistral-tiny", True),
                                         ("llama-tiny", False), ("gemma3-tiny", True), ("gemma3-tiny", False),
                                         ("gemma-tiny", True)])
def test_native_greedy_float32_equals_hf_generate(name, graphs):
    """With graphs and asynchronous steps, and eager (prompt chunks without logit rows: the
    final norm over no rows); the Gemma family's norms, GELU, block-output norms and
    per-layer-type rotary too (tests/test_native.py's tiny Gemma models)."""
    from cellcache.generate import Generator, Sampling, random_model

    if name.startswith("gemma"):
        from ..helpers_native import gemma_tiny

        model = gemma_tiny(3, "gemma" if name == "gemma-tiny" else "gemma3_text").to("cuda")
    else:
        model = random_model(name, torch.float32, "cuda", seed=3)
    torch.manual_seed(0)
    prompts = [torch.randint(0, 512, (int(n),)).tolist() for n in (3, 17, 40, 9, 25, 2)]
    refs = []
    for p in prompts:
        out = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=16, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    gen = Generator(model, capacity=1 << 12, max_seqs=16, prefill_chunk=16, max_batch_tokens=64,
                    eos=[], native=True, graphs=graphs)
    gen.warmup()
    reqs = [gen.add(p, Sampling(max_new_tokens=16)) for p in prompts]
    gen.run()
    assert [r.outputs[0] for r in reqs] == refs
    assert (gen.stats["graph_steps"] > 0) == graphs
