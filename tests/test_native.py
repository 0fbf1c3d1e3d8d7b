"""The native forward (cellcache.native) on the host: its ops are the transformers modules'
arithmetic op for op, its greedy outputs equal HF's generate (Llama, Qwen2 with windowed
layers, Mistral, Qwen3) through arrivals, chunks and preemption, its logits the modules'
forward's on the same steps, the model's weights stay the model's (views, updated in
place), and every refusal changes nothing."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional
pytest.importorskip("transformers")

from cellcache import InvalidArgument, InvalidState, build  # noqa: E402
from cellcache import hf as cchf  # noqa: E402
from cellcache import native as ccn  # noqa: E402
from cellcache.generate import Generator, Sampling, random_model  # noqa: E402

from .helpers_deterministic import VOCAB, check_same, serve  # noqa: E402
from .helpers_native import gemma_tiny  # noqa: E402

N_NEW = 12


def qwen3_tiny(seed: int = 3):
    """A two-layer Qwen3 (per-head q/k RMSNorm before the rotation) with random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  vocab_size=512)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def make(name: str, seed: int = 3):
    if name == "qwen3-tiny":
        return qwen3_tiny(seed)
    if name in ("gemma-tiny", "gemma3-tiny"):
        return gemma_tiny(seed, "gemma" if name == "gemma-tiny" else "gemma3_text")
    return random_model(name, seed=seed)


def prompts(seed: int = 11, n: int = 6) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=int(rng.integers(2, 40))).tolist() for _ in range(n)]


def hf_greedy(model, ps: list[list[int]]) -> list[list[int]]:
    out = []
    for p in ps:
        ids = model.generate(torch.tensor([p]), max_new_tokens=N_NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_weights(model, before: dict[str, torch.Tensor]) -> bool:
    now = model.state_dict()
    return now.keys() == before.keys() and all(torch.equal(now[k], before[k]) for k in before)


def relaid(model) -> bool:
    """Whether any layer's q and k weights share a storage (the native forward's lay-out)."""
    return any(la.self_attn.q_proj.weight.untyped_storage().data_ptr()
               == la.self_attn.k_proj.weight.untyped_storage().data_ptr() for la in model.model.layers)


# -- the ops -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_are_the_modules_arithmetic_bit_for_bit(dtype):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    T, hidden, heads, kv, d = 5, 48, 4, 2, 12
    norm = Qwen2RMSNorm(hidden, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(hidden, generator=g).to(dtype)
    big = torch.randn(T, hidden * 2, generator=g).to(dtype)
    x = big[:, :hidden]                                 # rows at a stride of 2 * hidden
    res = torch.randn(T, hidden, generator=g).to(dtype)
    assert torch.equal(ccn.rms_norm(x, norm.weight, 1e-5), norm(x))
    want_sum = res + x
    keep = res.clone()
    out, s = ccn.add_rms_norm(x, keep, norm.weight, 1e-5, inplace=False)
    assert torch.equal(out, norm(want_sum)) and torch.equal(s, want_sum) and torch.equal(keep, res)
    out, s = ccn.add_rms_norm(x, res, norm.weight, 1e-5)
    assert s is res and torch.equal(res, want_sum) and torch.equal(out, norm(want_sum))

    gu = torch.randn(T, 2 * 40, generator=g).to(dtype)
    assert torch.equal(ccn.silu_mul(gu), torch.nn.functional.silu(gu[:, :40]) * gu[:, 40:])

    qkv = torch.randn(T, (heads + 2 * kv) * d, generator=g).to(dtype)
    pos = torch.tensor([[3, 0, 7, 1, 100]])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = pos[..., None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)             # [1, T, d]
    q = qkv[:, :heads * d].view(T, heads, d).transpose(0, 1)[None]  # [1, H, T, d]
    k = qkv[:, heads * d:(heads + kv) * d].view(T, kv, d).transpose(0, 1)[None]
    q_want, k_want = apply_rotary_pos_emb(q, k, cos, sin)
    v_before = qkv[:, (heads + kv) * d:].clone()
    ccn.rotary_(qkv, cos[0], sin[0], heads + kv, d)
    assert torch.equal(qkv[:, :heads * d].view(T, heads, d), q_want[0].transpose(0, 1))
    assert torch.equal(qkv[:, heads * d:(heads + kv) * d].view(T, kv, d), k_want[0].transpose(0, 1))
    assert torch.equal(qkv[:, (heads + kv) * d:], v_before)          # v is not rotated


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul_is_the_gemma_mlps_arithmetic_bit_for_bit(dtype):
    from transformers.activations import ACT2FN

    g = torch.Generator().manual_seed(1)
    gu = (torch.randn((7, 80), generator=g) * 3).to(dtype)       # [gate | up], as the fused GEMM gives
    want = ACT2FN["gelu_pytorch_tanh"](gu[:, :40]) * gu[:, 40:]  # (the modules' ops on the same layout)
    assert torch.equal(ccn.gelu_tanh_mul(gu), want)
    assert not torch.equal(ccn.gelu_tanh_mul(gu), F.gelu(gu[:, :40]) * gu[:, 40:])     # not erf's GELU


def test_logits_out_off_cuda_is_torch_s_copy_and_argmax():
    x = torch.randn(5, 33).to(torch.bfloat16)
    x[2, 4] = float("nan")
    out = torch.zeros(6, 33)
    ids = torch.full((6,), -1, dtype=torch.long)
    ccn.logits_out(x, out[:5], ids[:5])
    assert torch.equal(out[:5].view(torch.int32), x.float().view(torch.int32))   # (bits: NaN)
    assert torch.equal(ids[:5], torch.argmax(x, dim=-1))
    assert ids[2] == 4 and (out[5] == 0).all() and ids[5] == -1
    with pytest.raises(InvalidArgument, match="no vocabulary"):      # refused, nothing written
        ccn.logits_out(x[:, :0], out[:5, :0], ids[:5])
    assert torch.equal(ids[:5], torch.argmax(x, dim=-1))
    ids.fill_(-1)
    for bad in (torch.ones(1), torch.ones(2, dtype=torch.int32), 1):  # the write flag: one int32
        with pytest.raises(InvalidArgument, match="write is"):
            ccn.logits_out(x, out[:5], ids[:5], bad)
    assert (ids == -1).all()
    ccn.logits_out(x, out[:5], ids[:5], torch.zeros(1, dtype=torch.int32))   # off CUDA: written
    assert torch.equal(out[:5].view(torch.int32), x.float().view(torch.int32))
    assert torch.equal(ids[:5], torch.argmax(x, dim=-1))


def test_custom_ops_compute_what_the_eager_ops_do():
    g = torch.Generator().manual_seed(1)
    x, res, w = (torch.randn(4, 32, generator=g) for _ in range(3))
    out, s = torch.ops.cellcache.add_rms_norm(x, res, w, 1e-6)
    want_out, want_s = ccn.add_rms_norm(x, res.clone(), w, 1e-6)
    assert torch.equal(out, want_out) and torch.equal(s, want_s)
    assert torch.equal(torch.ops.cellcache.rms_norm(x, w, 1e-6), ccn.rms_norm(x, w, 1e-6))
    gu = torch.randn(4, 16, generator=g)
    assert torch.equal(torch.ops.cellcache.silu_mul(gu), ccn.silu_mul(gu))
    qkv = torch.randn(4, 3 * 8, generator=g)
    cos, sin = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    a = qkv.clone()
    torch.ops.cellcache.rotary_(a, cos, sin, 2, 8)
    b = qkv.clone()
    ccn.rotary_(b, cos, sin, 2, 8)
    assert torch.equal(a, b) and not torch.equal(a, qkv)


# -- the model ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny", "llama-tiny", "mistral-tiny", "qwen3-tiny", "gemma-tiny",
                                  "gemma3-tiny"])
def test_greedy_equals_hf_generate_with_arrivals_chunks_and_preemption(name):
    model = make(name)
    ps = prompts()
    refs = hf_greedy(model, ps)
    before = weights(model)
    # a small pool (preemption and recompute), small steps and chunks, arrivals over time
    gen = Generator(model, capacity=120, max_batch_tokens=16, max_seqs=16, prefill_chunk=7, eos=[],
                    reserve=0, native=True)
    assert isinstance(gen.runner.model, ccn.NativeLM) and isinstance(gen.runner.adapter, ccn.NativeAdapter)
    reqs = [gen.add(p, Sampling(max_new_tokens=N_NEW)) for p in ps[:3]]
    for _ in range(3):
        gen.step()
    reqs += [gen.add(p, Sampling(max_new_tokens=N_NEW)) for p in ps[3:]]
    gen.run()
    assert [r.outputs[0] for r in reqs] == refs
    assert gen.stats["preempted"] > 0
    # the model is the same model: same weights, its attention setting untouched, and it
    # still generates by itself
    assert same_weights(model, before)
    assert model.config._attn_implementation != cchf.ATTENTION_NAME
    assert hf_greedy(model, ps[:1]) == refs[:1]


def _steps(runner, cache, seqs_tokens):
    """Runs each step of ``seqs_tokens`` (a list of steps, each a list of (seq index, tokens))
    on ``runner``; returns every step's logits."""
    ids = [cache.seq_new() for _ in range(3)]
    out = []
    for step_rows in seqs_tokens:
        seqs = [ids[i] for i, toks in step_rows for _ in toks]
        tokens = [t for _, toks in step_rows for t in toks]
        cache.declare_step(seqs)
        step = cache.prepare_step()
        out.append(runner.forward(step, tokens=tokens).clone())
        cache.commit_step()
    return out


@pytest.mark.parametrize("name", ["tiny", "gemma-tiny", "gemma3-tiny"])
def test_logits_are_the_modules_forwards_on_the_same_steps(name):
    _same_logits_as_the_modules(make(name, seed=5))


def _same_logits_as_the_modules(model):
    other = copy.deepcopy(model)
    cfg = cchf.cache_config(model, capacity=128, max_write=32)
    native = cchf.attach(model, build("host", "batched", cfg), native=True)
    modules = cchf.attach(other, build("host", "batched", cfg))
    rng = np.random.default_rng(2)
    steps = [[(0, rng.integers(0, VOCAB, 9).tolist()), (1, rng.integers(0, VOCAB, 20).tolist())],
             [(0, [5]), (1, [7]), (2, rng.integers(0, VOCAB, 6).tolist())]]
    steps += [[(0, [i]), (1, [i + 1]), (2, [i + 2])] for i in range(8)]   # windows pass 16
    a = _steps(native, native.cache, steps)
    b = _steps(modules, modules.cache, steps)
    for x, y in zip(a, b):
        assert x.shape == y.shape
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_weights_are_views_updated_in_place_and_a_replaced_one_is_refused():
    model = random_model("llama-tiny", seed=2)
    ps = prompts(4, 3)
    count = sum(p.numel() for p in model.parameters())
    gen = Generator(model, capacity=256, eos=[], native=True)
    native = gen.runner.model
    layer = model.model.layers[0]
    qkv = native._layers[0].qkv_w
    assert layer.self_attn.q_proj.weight.data_ptr() == qkv.data_ptr()
    assert layer.self_attn.v_proj.weight.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    assert sum(p.numel() for p in model.parameters()) == count and relaid(model)

    # new weights loaded in place (as a trainer's weight sync does) reach the native forward
    fresh = random_model("llama-tiny", seed=9)
    model.load_state_dict(fresh.state_dict())
    reqs = [gen.add(p, Sampling(max_new_tokens=N_NEW)) for p in ps]
    gen.run()
    assert [r.outputs[0] for r in reqs] == hf_greedy(fresh, ps)

    # a replaced tensor no longer reaches it: refused, nothing served or changed
    w = layer.self_attn.k_proj.weight
    w.data = w.data.clone()
    req = gen.add(ps[0], Sampling(max_new_tokens=N_NEW))
    steps = gen.stats["steps"]
    with pytest.raises(InvalidState, match="in place"):
        gen.step()
    assert gen.stats["steps"] == steps and req.outputs[0] == []
    # attaching again re-lays the weights: served as HF generates
    gen2 = Generator(model, capacity=256, eos=[], native=True)
    assert gen2.runner.model is not native
    req = gen2.add(ps[0], Sampling(max_new_tokens=N_NEW))
    gen2.run()
    assert req.outputs[0] == hf_greedy(model, ps[:1])[0]
    # and a third attach reuses that native forward, after checking every fused weight: a
    # replaced up_proj (which a step's quick check does not look at) makes a new one
    cfg = cchf.cache_config(model, capacity=64)
    assert cchf.attach(model, build("host", "batched", cfg), native=True).model is gen2.runner.model
    up = layer.mlp.up_proj.weight
    up.data = up.data.clone()
    again = cchf.attach(model, build("host", "batched", cfg), native=True).model
    assert again is not gen2.runner.model
    again.check(full=True)


def test_attached_in_inference_mode_the_weights_still_serve_autograd():
    model = random_model("llama-tiny", seed=4)
    with torch.inference_mode():
        Generator(model, capacity=64, eos=[], native=True)
    assert relaid(model) and not any(p.is_inference() for p in model.parameters())
    model.train()
    loss = model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss
    loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_deterministic_native_tokens_do_not_depend_on_the_schedule():
    model = random_model("tiny", seed=7)
    rng = np.random.default_rng(5)
    jobs = [(rng.integers(0, VOCAB, size=n).tolist(), Sampling(max_new_tokens=8, logprobs=1))
            for n in (5, 19, 11)]
    jobs[1] = (jobs[1][0], Sampling(max_new_tokens=8, temperature=0.9, seed=3, logprobs=2))
    ref = [serve(model, [job], capacity=256, max_batch_tokens=64, prefill_chunk=64, max_seqs=8,
                 native=True)[0][0] for job in jobs]
    others = [rng.integers(0, VOCAB, size=int(rng.integers(2, 30))).tolist() for _ in range(4)]
    got, gen = serve(model, jobs, others=others, arrivals=[0, 3, 1], capacity=64, max_batch_tokens=13,
                     prefill_chunk=5, max_seqs=6, reserve=0.0, native=True)
    check_same(ref, got, 8)
    assert gen.stats["preempted"] > 0 and isinstance(gen.runner.model, ccn.NativeLM)


# -- refusals ----------------------------------------------------------------------------------

def _granite_tiny():
    """Granite scales its embeddings, residuals and logits by config multipliers: an
    architecture cellcache serves through its modules but the native forward does not run."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("granite", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _bidirectional_gemma3():
    """Gemma 3 as an encoder (EmbeddingGemma): every token sees every other."""
    return gemma_tiny(3, use_bidirectional_attention=True)


def test_the_activation_is_the_mlp_modules_not_a_config_key():
    """Gemma's MLP reads ``hidden_act``, Gemma 3's ``hidden_activation``: a Gemma config
    holding both (SiLU and tanh-GELU) runs what its modules run, SiLU."""
    model = gemma_tiny(3, "gemma", hidden_act="silu", hidden_activation="gelu_pytorch_tanh")
    x = torch.linspace(-3, 3, 13)
    assert torch.equal(model.model.layers[0].mlp.act_fn(x), F.silu(x))    # (the premise)
    _same_logits_as_the_modules(model)


def _gelu_llama():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                  hidden_act="gelu")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("build_model, match", [(_granite_tiny, "runs llama"), (_gelu_llama, "SiLU"),
                                                 (_bidirectional_gemma3, "causal attention")])
def test_unsupported_models_are_refused_unchanged(build_model, match):
    model = build_model()
    before = weights(model)
    attn = model.config._attn_implementation
    with pytest.raises(InvalidArgument, match=match):
        Generator(model, capacity=64, eos=[], native=True)
    cfg = cchf.cache_config(model, capacity=64)
    with pytest.raises(InvalidArgument, match=match):
        cchf.attach(model, build("host", "batched", cfg), native=True)
    assert same_weights(model, before) and model.config._attn_implementation == attn
    assert not relaid(model)


def test_a_tensor_parallel_shard_and_bad_types_are_refused_unchanged(monkeypatch):
    model = random_model("llama-tiny", seed=1)
    before = weights(model)
    cfg = cchf.cache_config(model, capacity=64)
    shard = dataclasses.replace(cfg, layers=[dataclasses.replace(la, n_kv_heads=1) for la in cfg.layers])
    with pytest.raises(InvalidArgument, match="tensor-parallel shard"):
        cchf.attach(model, build("host", "batched", shard), native=True)
    for bad in ("yes", 1, None):
        with pytest.raises(InvalidArgument, match="native"):
            cchf.attach(model, build("host", "batched", cfg), native=bad)
        with pytest.raises(InvalidArgument, match="native"):
            Generator(model, capacity=64, eos=[], native=bad)
    # Generator(tp=..., native=True): refused before the model is sharded or a cache built
    from cellcache.generate import engine, options

    monkeypatch.setattr(options, "tp_world", lambda tp: 2)
    built = []
    monkeypatch.setattr(engine, "serving_cache", lambda *a: built.append(a))
    with pytest.raises(InvalidArgument, match="tensor parallelism"):
        Generator(model, capacity=64, eos=[], tp=True, native=True)
    assert built == []
    assert same_weights(model, before)
    assert not relaid(model)


def test_native_forward_outside_a_step_is_refused():
    model = random_model("llama-tiny", seed=1)
    native = ccn.NativeLM(model)
    ids = torch.zeros((1, 2), dtype=torch.long)
    with pytest.raises(InvalidState, match="outside a step"):
        native(ids, ids)
