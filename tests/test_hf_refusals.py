"""cellcache.hf refusals: every one raises the library's error class and changes nothing —
the model's attention setting, the cache's pools and table, the runner's counters.

Models are tiny and random, built from transformers configs (no download)."""

from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from cellcache import CacheConfig, HostCellCache, InvalidArgument, InvalidState, LayerConfig  # noqa: E402
from cellcache import hf as cchf  # noqa: E402
from cellcache.generate import Generator, Sampling, random_model  # noqa: E402

#: Decoders whose attention cellcache does not compute, and why attach refuses them.
UNSUPPORTED = {
    # attention sinks: transformers passes s_aux
    "gpt_oss": (dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=128, num_local_experts=4,
                     num_experts_per_tok=2, sliding_window=8), "attention sinks \\(s_aux="),
    # ALiBi biases: they come inside the attention mask, which cellcache does not read
    "falcon-alibi": (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
                          alibi=True), "ALiBi position biases"),
    # soft-capped scores (cache_config refuses it; a hand-built cache does not)
    "gemma2": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=128, sliding_window=8,
                    attn_logit_softcapping=50.0), "soft-capping \\(softcap=50.0\\)"),
    # bidirectional
    "bert": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  vocab_size=128), "is bidirectional \\(is_causal=False\\)"),
}


def _tiny(name: str):
    spec, _ = UNSUPPORTED[name]
    config = AutoConfig.for_model(name.split("-")[0], **spec)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _settings(model) -> list:
    """The attention setting of every config the model carries."""
    return [(id(c), c._attn_implementation) for c in cchf._attn_configs(model)]


def _pools(cache) -> list[bytes]:
    return [cache.layer(i)[kv].tobytes() for i in range(len(cache.config.layers)) for kv in (0, 1)]


def _hand_built(model, **kw) -> CacheConfig:
    """A cache for the model's layer shapes, built without cache_config's checks."""
    text = model.config
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    layers = [LayerConfig(kv, dim, w) for w in cchf.layer_windows(text)]
    return CacheConfig(capacity=64, layers=layers, max_write=8, dtype="float32", **kw)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_attach_refuses_attention_it_does_not_compute(name):
    model = _tiny(name)
    _, match = UNSUPPORTED[name]
    cache = HostCellCache(_hand_built(model))
    before, metrics, pools = _settings(model), cache.metrics(), _pools(cache)
    with pytest.raises(InvalidArgument, match=match):
        cchf.attach(model, cache)
    assert _settings(model) == before
    assert model.config._attn_implementation != cchf.ATTENTION_NAME
    assert cache.metrics() == metrics and _pools(cache) == pools
    cache.check_invariants()


def test_cache_config_refuses_soft_capping_and_alibi():
    with pytest.raises(InvalidArgument, match="soft-capping"):
        cchf.cache_config(_tiny("gemma2"), capacity=64)
    with pytest.raises(InvalidArgument, match="ALiBi"):
        cchf.cache_config(_tiny("falcon-alibi"), capacity=64)


#: Falcon (rotary) without and with its new decoder architecture (grouped K/V).
FALCON = {"falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128),
          "falcon-new": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
                             new_decoder_architecture=True, num_kv_heads=2)}


def _falcon_calls_the_interface() -> bool:
    """Whether the installed transformers' Falcon attention calls the attention interface
    (it does from transformers 5.25 on; before, it computed attention itself)."""
    import inspect

    from transformers.models.falcon import modeling_falcon

    return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(modeling_falcon.FalconAttention)


@pytest.mark.parametrize("name", sorted(FALCON))
def test_falcon_is_served_where_it_calls_the_interface_and_refused_where_not(name):
    """Where Falcon's attention goes through transformers' attention interface, cellcache
    serves it and greedy output equals HF's own generate (float32); where it does not, attach
    refuses it (no layer called cellcache's attention) and nothing changes."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("falcon", **FALCON[name])).eval()
    if not _falcon_calls_the_interface():
        cache = HostCellCache(_hand_built(model))
        before, metrics = _settings(model), cache.metrics()
        with pytest.raises(InvalidArgument, match="for 0 of the model's 2 layers"):
            cchf.attach(model, cache)
        assert _settings(model) == before and cache.metrics() == metrics
        return
    prompts = [[5, 9, 3, 17, 2], [44, 1, 8], [7] * 11]
    refs = [model.generate(torch.tensor([p]), attention_mask=torch.ones((1, len(p)), dtype=torch.long),
                           max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    gen = Generator(model, capacity=128, max_batch_tokens=16, max_seqs=4, prefill_chunk=4, eos=[])
    reqs = [gen.add(p, Sampling(max_new_tokens=8)) for p in prompts]
    gen.run()
    assert [r.outputs[0] for r in reqs] == refs


@pytest.fixture(scope="module")
def llama():
    model = random_model("llama-tiny", seed=2)
    model.set_attn_implementation("sdpa")
    return model


@pytest.mark.parametrize("case,match", [
    ("buckets [0]", "bucket=0 is outside \\[1, 8\\]"),
    ("buckets [9]", "bucket=9 is outside \\[1, 8\\]"),
    ("buckets ['a']", "bucket of type str is not an int"),
    ("buckets []", "buckets is empty"),
    ("buckets 4", "buckets of type int is not a list of"),
    ("mixed_buckets [9]", "bucket=9 is outside \\[1, 8\\]"),
    ("mixed_buckets 'a'", "buckets of type str is not a list of"),
    ("graphs on the host", "graph replay needs a CUDA cache built with paged=True"),
    ("graphs 'yes'", "graphs of type str is not a bool"),
    ("layer count", "the cache has 1 layers; the model 2"),
    ("window", "layer 0: the cache's window 4 is not the model's 0"),
    ("head shapes", "layer 0: q must be \\[T, n_heads, 8\\]"),
    ("mask_format none", "the host backend attends over masks, and this cache has none"),
    ("paged, mask_format none", "the host backend attends over masks"),
    ("not a cache", "cache of type CacheConfig is not a cellcache cache"),
    ("not a model", "model of type str is not a transformers model"),
])
def test_a_refused_attach_changes_nothing(llama, case, match):
    """attach checks everything (the runner included) before it switches the model, and the
    probe forward restores the switch when it refuses."""
    kw: dict = {}
    cfg = cchf.cache_config(llama, capacity=64, max_write=8)
    model = llama
    if case.startswith("buckets"):
        kw["buckets"] = {"buckets [0]": [0], "buckets [9]": [9], "buckets ['a']": ["a"],
                         "buckets []": [], "buckets 4": 4}[case]
    elif case.startswith("mixed_buckets"):
        kw["mixed_buckets"] = {"mixed_buckets [9]": [9], "mixed_buckets 'a'": "a"}[case]
    elif case == "graphs on the host":
        kw["graphs"] = True
    elif case == "graphs 'yes'":
        kw["graphs"] = "yes"
    elif case == "layer count":
        cfg = CacheConfig(capacity=64, layers=[LayerConfig(2, 16)], max_write=8)
    elif case == "window":
        cfg = CacheConfig(capacity=64, layers=[LayerConfig(2, 16, 4), LayerConfig(2, 16)], max_write=8)
    elif case == "head shapes":
        cfg = CacheConfig(capacity=64, layers=[LayerConfig(2, 8)] * 2, max_write=8, dtype="float32")
    elif case == "mask_format none":
        cfg = cchf.cache_config(llama, capacity=64, max_write=8, mask_format="none")
    elif case == "paged, mask_format none":
        cfg = cchf.cache_config(llama, capacity=64, max_write=8, mask_format="none", paged=True)
    cache = cfg if case == "not a cache" else HostCellCache(cfg)
    if case == "not a model":
        model = "llama"
    before = _settings(llama)
    with pytest.raises(InvalidArgument, match=match):
        cchf.attach(model, cache, **kw)
    assert _settings(llama) == before and llama.config._attn_implementation == "sdpa"


def test_a_refused_attach_leaves_an_attached_model_attached(llama):
    """A model attached to one cache and then refused for another keeps the first setting
    (cellcache), exactly as before the refused call."""
    good = HostCellCache(cchf.cache_config(llama, capacity=64, max_write=8))
    cchf.attach(llama, good)
    before = _settings(llama)
    bad = HostCellCache(CacheConfig(capacity=64, layers=[LayerConfig(2, 8)] * 2, max_write=8,
                                    dtype="float32"))
    with pytest.raises(InvalidArgument, match="q must be"):
        cchf.attach(llama, bad)
    assert _settings(llama) == before and llama.config._attn_implementation == cchf.ATTENTION_NAME
    llama.set_attn_implementation("sdpa")


@pytest.fixture
def prepared(llama):
    """A runner with one sequence of 3 tokens in its cache and a 3-token step prepared."""
    cache = HostCellCache(cchf.cache_config(llama, capacity=64, max_write=8))
    runner = cchf.attach(llama, cache)
    a = cache.seq_new()
    cache.declare_step([a] * 3)
    runner.forward(cache.prepare_step(), [1, 2, 3], [2])
    cache.commit_step()
    cache.declare_step([a] * 3)
    step = cache.prepare_step(pad_to=4)
    yield runner, cache, step
    llama.set_attn_implementation("sdpa")


@pytest.mark.parametrize("case,error,match", [
    ("too few tokens", InvalidArgument, "2 tokens for a step of width 3"),
    ("too many tokens", InvalidArgument, "4 tokens for a step of width 3"),
    ("float tokens", InvalidArgument, "tokens is a 1-D array of float64; give a 1-D sequence of ints"),
    ("bool tokens", InvalidArgument, "tokens is a 1-D array of bool"),
    ("2-D tokens", InvalidArgument, "tokens is a 2-D array"),
    ("string tokens", InvalidArgument, "tokens is of type str"),
    ("ragged tokens", InvalidArgument, "tokens is of type list"),
    ("negative token", InvalidArgument, "token id -1 is outside the vocabulary \\[0, 512\\)"),
    ("token past the vocabulary", InvalidArgument, "token id 512 is outside the vocabulary \\[0, 512\\)"),
    ("huge token", InvalidArgument, "tokens is a 1-D array of object"),
    ("logit row past the width", InvalidArgument, "logit row 3 is outside the step's real rows \\[0, 3\\)"),
    ("negative logit row", InvalidArgument, "logit row -1 is outside"),
    ("float logit rows", InvalidArgument, "logit_rows is a 1-D array of float64"),
    ("2-D logit rows", InvalidArgument, "logit_rows is a 2-D array"),
    ("scalar logit row", InvalidArgument, "logit_rows is a 0-D array"),
    ("decode 'yes'", InvalidArgument, "decode of type str is not a bool"),
    ("not a step", InvalidArgument, "step of type dict is not a Step"),
    ("a committed step", InvalidState, "not this cache's prepared step"),
    ("another cache's step", InvalidState, "not this cache's prepared step"),
])
def test_forward_refusals_write_nothing(prepared, llama, case, error, match):
    runner, cache, step = prepared
    args: dict = dict(step=step, tokens=[4, 5, 6], logit_rows=[2], decode=False)
    tokens = {"too few tokens": [4, 5], "too many tokens": [4, 5, 6, 7], "float tokens": [4.0, 5.5, 6.0],
              "bool tokens": [True, False, True], "2-D tokens": [[4, 5, 6]], "string tokens": "456",
              "ragged tokens": [4, [5], 6], "negative token": [4, -1, 6],
              "token past the vocabulary": [4, 512, 6], "huge token": [4, 2 ** 70, 6]}
    rows = {"logit row past the width": [3], "negative logit row": [-1], "float logit rows": [1.0],
            "2-D logit rows": [[2]], "scalar logit row": 2}
    if case in tokens:
        args["tokens"] = tokens[case]
    elif case in rows:
        args["logit_rows"] = rows[case]
    elif case == "decode 'yes'":
        args["decode"] = "yes"
    elif case == "not a step":
        args["step"] = {"width": 3}
    elif case == "a committed step":
        cache.commit_step()
    elif case == "another cache's step":
        other = HostCellCache(cache.config)
        s = other.seq_new()
        other.declare_step([s] * 3)
        args["step"] = other.prepare_step(pad_to=4)
    pools, metrics, counts = _pools(cache), cache.metrics(), (runner.eager, runner.replays)
    with pytest.raises(error, match=match):
        runner.forward(**args)
    assert _pools(cache) == pools and cache.metrics() == metrics
    assert (runner.eager, runner.replays) == counts


def test_forward_accepts_arrays_tensors_and_no_logit_rows(prepared):
    runner, cache, step = prepared
    a = runner.forward(step, np.array([4, 5, 6], dtype=np.int32), torch.tensor([0, 2]))
    b = runner.forward(step, torch.tensor([4, 5, 6]), None)         # every real row
    empty = runner.forward(step, (4, 5, 6), [])                      # a chunk that samples nothing
    assert a.shape == (2, 512) and b.shape == (3, 512) and empty.shape == (0, 512)
    torch.testing.assert_close(a, b[[0, 2]])


def test_a_detached_generator_refuses_its_next_step(llama):
    gen = Generator(llama, capacity=64, max_batch_tokens=8, eos=[])
    gen.add([1, 2, 3], Sampling(max_new_tokens=4))
    gen.step()
    llama.set_attn_implementation("sdpa")
    with pytest.raises(InvalidState, match="generator.runner.reattach\\(\\)"):
        gen.step()


@pytest.mark.parametrize("source,kw,match", [
    ("llama", dict(capacity="64"), "capacity of type str is not an int"),
    ("llama", dict(capacity=64.0), "capacity of type float is not an int"),
    ("llama", dict(capacity=64, initial_capacity="8"), "initial_capacity of type str"),
    ("llama", dict(capacity=64, dtype="int8"), "dtype='int8' is not one of"),
    ("llama", dict(capacity=64, dtype=torch.int8), "is not one of float16, bfloat16, float32"),
    ("llama", dict(capacity=64, mask_format="dense"), "mask_format='dense' is not one of"),
    ("llama", dict(capacity=64, colour="red"), "unknown CacheConfig field\\(s\\) colour"),
    ("llama", dict(capacity=64, max_write=65), "max_write=65 is outside"),
    ("no layers", dict(capacity=64), "has no num_hidden_layers"),
    ("no heads", dict(capacity=64), "has no num_attention_heads"),
    ("text layers", dict(capacity=64), "config.num_hidden_layers of type str is not an int"),
    ("short layer_types", dict(capacity=64), "does not name a type for each of the 3 layers"),
    ("odd hidden size", dict(capacity=64), "hidden_size=30 is not a multiple of num_attention_heads=4"),
    ("a string", dict(capacity=64), "str is not a transformers decoder model or config"),
    ("None", dict(capacity=64), "NoneType is not a transformers decoder model or config"),
])
def test_cache_config_refuses_bad_inputs_with_invalid_argument(llama, source, kw, match):
    configs = {
        "no layers": types.SimpleNamespace(num_attention_heads=4, hidden_size=64),
        "no heads": types.SimpleNamespace(num_hidden_layers=2, hidden_size=64),
        "text layers": types.SimpleNamespace(num_hidden_layers="2", num_attention_heads=4, hidden_size=64),
        "short layer_types": types.SimpleNamespace(num_hidden_layers=3, num_attention_heads=4, hidden_size=64,
                                                   layer_types=["full_attention"] * 2),
        "odd hidden size": types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=30),
        "a string": "llama", "None": None}
    source = llama if source == "llama" else configs[source]
    with pytest.raises(InvalidArgument, match=match):
        cchf.cache_config(source, **kw)
