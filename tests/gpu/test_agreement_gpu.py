"""End-to-end agreement on the GPU, in the precision served: every configuration a benchmark
reports or a user can reach (the tensor-core kernels at every head_dim they take, in bf16
and fp16, GQA groups 1 to 8, sliding-window layers, compile on and off, graphs and eager,
asynchronous steps on and off, FlashInfer, the native forward) serves a schedule that makes every kind of row
(prompt chunks, decode steps at several widths, a fork, rewound drafts, preemption and
re-prefill, prefix-cache hits), and the logits each row was sampled from are compared with
Hugging Face's own forward of the same weights over the same tokens: float32 as the
reference, the served dtype as the noise floor (cellcache.generate.agreement). Real-model
shapes (two layers each): Qwen2-0.5B, Llama-3-8B, Gemma-2B's attention, Mistral's sliding
window, and head dims 80 and 96 on Llama's architecture."""

from __future__ import annotations

import pytest

from ..helpers_agreement import serve_every_kind, shaped_model

SHAPES = {
    # name: (config, head_dim, group)
    "qwen2-0.5b": dict(arch="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=2,
                       num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                       rope_theta=1000000.0, tie_word_embeddings=True),                   # d64, g7
    "d80-mha": dict(arch="llama", hidden_size=2560, intermediate_size=4096, num_hidden_layers=2,
                    num_attention_heads=32, num_key_value_heads=32, head_dim=80,
                    vocab_size=8192),                                                      # d80, g1
    "d96-g3": dict(arch="llama", hidden_size=2304, intermediate_size=4096, num_hidden_layers=2,
                   num_attention_heads=24, num_key_value_heads=8, head_dim=96,
                   vocab_size=8192),                                                       # d96, g3
    "llama3-8b": dict(arch="llama", hidden_size=4096, intermediate_size=4096, num_hidden_layers=2,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=8192,
                      rope_theta=500000.0),                                                # d128, g4
    "gemma-2b-attn": dict(arch="llama", hidden_size=2048, intermediate_size=4096, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=1, head_dim=256,
                          vocab_size=8192),                                                # d256, g8
    "mistral-window": dict(arch="mistral", hidden_size=2048, intermediate_size=4096,
                           num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=8,
                           vocab_size=8192, sliding_window=48),                            # d128, g2
}


def _agree(name: str, dtype_name: str, *, expect_path: str | None = "tc", **options):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import cellcache.torch as cct
    from cellcache.generate import Generator
    from cellcache.generate.agreement import LogitsTap, compare, reference_models

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    spec = SHAPES[name]
    model = shaped_model(spec, dtype, "cuda", seed=1)
    ref, floor = reference_models(model)
    gen = Generator(model, capacity=320, max_batch_tokens=64, max_seqs=16, prefill_chunk=24,
                    eos=[], reserve=0, **options)
    if options.get("graphs", True) is not False:
        gen.warmup()
    if expect_path is not None:
        heads = spec["num_attention_heads"]
        assert cct.layer_paths(gen.cache.config, heads) == [expect_path] * spec["num_hidden_layers"]
    with LogitsTap(gen) as tap:
        serve_every_kind(gen, spec["vocab_size"], seed=2)
    st = gen.stats
    assert st["preempted"] > 0 and st["forks"] > 0 and st["drafted"] > 0 and st["cached_tokens"] > 0
    rows = tap.rows()
    assert {r.kind for r in rows} == {"prompt", "output", "draft"}
    report = compare(rows, ref, floor)
    gen.cache.check_invariants()
    gen.cache.close()
    print(f"\n{name} {dtype_name} {options or 'defaults'}: {report.summary()}")   # (the record, with -s)
    assert report.passed, (report.summary(), report.by_kind, report.worst)
    return gen, report


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["qwen2-0.5b", "d80-mha", "d96-g3", "llama3-8b", "gemma-2b-attn"])
def test_tensor_core_kernels_agree_end_to_end(name, dtype):
    """The default configuration (tensor-core kernels, decode graphs, asynchronous steps) at
    head dims 64, 80, 96, 128, 256 and groups 7, 1, 3, 4, 8."""
    gen, _ = _agree(name, dtype)
    assert gen.async_steps and gen.stats["graph_steps"] > 0


def test_sliding_window_layers_agree_end_to_end():
    """Mistral's architecture with a window shorter than the prompts (group 2)."""
    _agree("mistral-window", "bf16")


def test_compiled_forward_agrees_end_to_end():
    """``compile=True``: the compiled forward, captured in the graphs."""
    _agree("qwen2-0.5b", "bf16", compile=True)


def test_eager_synchronous_steps_agree_end_to_end():
    """No graphs and no asynchronous steps: every step eager and synchronous."""
    gen, _ = _agree("llama3-8b", "bf16", graphs=False, async_steps=False)
    assert gen.stats["graph_steps"] == 0 and not gen.async_steps


def test_synchronous_steps_with_graphs_agree_end_to_end():
    gen, _ = _agree("qwen2-0.5b", "fp16", async_steps=False)
    assert gen.stats["graph_steps"] > 0 and not gen.async_steps


@pytest.mark.parametrize("name, dtype", [("qwen2-0.5b", "bf16"), ("llama3-8b", "fp16"),
                                         ("d80-mha", "bf16"), ("gemma-2b-attn", "bf16"),
                                         ("mistral-window", "bf16")])
def test_native_forward_agrees_end_to_end(name, dtype):
    """``native=True``: cellcache's own forward (fused q/k/v and gate/up GEMMs, the fused
    norm, rotary and SiLU kernels) with graphs and asynchronous steps."""
    from cellcache.native import NativeLM

    gen, _ = _agree(name, dtype, native=True)
    assert isinstance(gen.runner.model, NativeLM) and gen.stats["graph_steps"] > 0


def test_compiled_native_forward_agrees_end_to_end():
    """``native=True, compile=True``: the fused ops as custom ops in the compiled forward."""
    _agree("qwen2-0.5b", "bf16", native=True, compile=True)


def test_flashinfer_attention_agrees_end_to_end():
    """``attention="flashinfer"``: FlashInfer's kernels over the same paged view."""
    pytest.importorskip("flashinfer")
    _agree("llama3-8b", "bf16", expect_path=None, attention="flashinfer")
