"""``compile=True``: the model's forward under ``torch.compile``, cellcache's attention as the
custom op ``cellcache::attention``. Greedy outputs equal the eager runner's and HF
``generate``; the compiled forward is one graph (attention does not break it); bad
``compile`` values are refused with nothing changed.

Dynamo runs with a counting backend (no code generation: fast on two cores), AOT autograd
once, inductor once (its first compile takes tens of seconds on the CPU)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import cellcache as cc  # noqa: E402
from cellcache import InvalidArgument, InvalidState  # noqa: E402
from cellcache import hf as cchf  # noqa: E402
from cellcache.generate import Generator, Sampling, random_model  # noqa: E402

ARCHS = ["tiny", "llama-tiny", "mistral-tiny"]
N_NEW = 12
#: how the op appears in dynamo's graphs (the overload packet) and after AOT (the overload)
ATTENTION = (torch.ops.cellcache.attention, torch.ops.cellcache.attention.default)


class Graphs:
    """A dynamo backend that keeps every graph it is given and runs it as traced."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def attention_calls(self) -> list[int]:
        return [sum(n.target in ATTENTION for n in gm.graph.nodes) for gm in self.graphs]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def prompts_and_refs(model, n=4, seed=11):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 512, size=int(rng.integers(3, 30))).tolist() for _ in range(n)]
    refs = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=N_NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    return prompts, refs


def serve(model, prompts, **kw):
    """Greedy outputs of a Generator whose steps mix prompt chunks and decode rows (small
    budget and chunks, arrivals over time), then decode-only steps."""
    gen = Generator(model, capacity=256, max_batch_tokens=16, max_seqs=8, prefill_chunk=7,
                    eos=[], **kw)
    reqs = [gen.add(p, Sampling(max_new_tokens=N_NEW)) for p in prompts[:2]]
    gen.step()
    reqs += [gen.add(p, Sampling(max_new_tokens=N_NEW)) for p in prompts[2:]]
    gen.run()
    gen.cache.check_invariants()
    return [r.outputs[0] for r in reqs], gen


@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_greedy_equals_eager_and_hf_generate_in_one_graph(arch):
    model = random_model(arch, torch.float32, "cpu", 3)
    prompts, refs = prompts_and_refs(model)
    eager, _ = serve(model, prompts)
    backend = Graphs()
    compiled, gen = serve(model, prompts, compile={"backend": backend, "fullgraph": True})
    assert compiled == eager == refs
    assert gen.runner.compile is not None and gen.runner.eager == gen.stats["steps"]
    layers = model.config.num_hidden_layers
    # every graph holds every layer's attention: none broke at attention; the step width is
    # symbolic, so a handful of graphs (width 1 is specialized) serves every step
    assert backend.graphs and backend.attention_calls() == [layers] * len(backend.graphs)
    assert len(backend.graphs) <= 3
    assert not torch._dynamo.utils.counters["graph_break"]


def test_one_forward_is_one_graph():
    """The first forward of a compiled runner compiles exactly one graph holding each layer's
    attention op; later widths reuse it (symbolic width)."""
    model = random_model("tiny", torch.float32, "cpu", 0)
    cache = cc.build("host", "batched", cchf.cache_config(model, capacity=128, max_write=32))
    backend = Graphs()
    runner = cchf.attach(model, cache, compile={"backend": backend})
    a, b = cache.seq_new(), cache.seq_new()
    cache.declare_step([a] * 5 + [b] * 3)
    step = cache.prepare_step()
    runner.forward(step, tokens=list(range(1, 9)), logit_rows=[4, 7])
    cache.commit_step()
    assert backend.attention_calls() == [3]
    for width in (2, 4, 6):
        cache.declare_step([a, b] * (width // 2))
        step = cache.prepare_step()
        runner.forward(step, tokens=[9] * width)
        cache.commit_step()
    assert backend.attention_calls() == [3]
    assert not torch._dynamo.utils.counters["graph_break"]
    # what a decode graph on CUDA captures: every row's logits (logits_to_keep=0, an int
    # instead of a tensor of rows: compiled once more), equal to the forward's logits (the
    # step's K/V written twice, the same values)
    cache.declare_step([a, b])
    step = cache.prepare_step()
    logits = runner.forward(step, tokens=[5, 6])
    with torch.inference_mode():
        every = runner._run(step, "auto", None)
    cache.commit_step()
    torch.testing.assert_close(every.float(), logits)
    assert backend.attention_calls() == [3, 3]


def test_pools_that_move_need_no_recompile():
    """Copy growth moves the pools at every growth; they are not graph inputs (the op finds
    them through the view), so the graphs stay and the output is still HF's."""
    model = random_model("tiny", torch.float32, "cpu", 3)
    prompts, refs = prompts_and_refs(model, n=3, seed=6)
    cfg = cchf.cache_config(model, capacity=300, max_write=16, max_seqs=16, initial_capacity=4)
    cache = cc.HostCellCache(cfg, growth="copy")
    backend = Graphs()
    gen = Generator(model, cache, prefill_chunk=7, eos=[], compile={"backend": backend})
    reqs = [gen.add(p, Sampling(max_new_tokens=N_NEW)) for p in prompts]
    gen.run()
    assert [r.outputs[0] for r in reqs] == refs
    assert cache.metrics()["growth_count"] >= 3
    assert len(backend.graphs) <= 3 and backend.attention_calls() == [3] * len(backend.graphs)


def test_aot_eager_equals_eager():
    """AOT autograd (functionalization, decompositions) around the op: same tokens."""
    model = random_model("mistral-tiny", torch.float32, "cpu", 5)
    prompts, refs = prompts_and_refs(model, n=3, seed=2)
    compiled, _ = serve(model, prompts, compile={"backend": "aot_eager"})
    assert compiled == refs


@pytest.mark.parametrize("arch", ["tiny"])                # (windowed layers, biases: Qwen2)
def test_compiled_native_forward_is_one_graph_and_equals_hf_generate(arch):
    """``native=True`` compiled: the fused ops as custom ops beside attention, one graph
    without breaks (counting backend), and through AOT autograd, whose functionalization
    meets the in-place ``cellcache::rotary_``: HF's greedy tokens both ways."""
    model = random_model(arch, torch.float32, "cpu", 3)
    prompts, refs = prompts_and_refs(model)
    backend = Graphs()
    compiled, gen = serve(model, prompts, native=True, compile={"backend": backend, "fullgraph": True})
    assert compiled == refs and gen.runner.eager == gen.stats["steps"]
    layers = model.config.num_hidden_layers
    assert backend.graphs and backend.attention_calls() == [layers] * len(backend.graphs)
    rotary = (torch.ops.cellcache.rotary_, torch.ops.cellcache.rotary_.default)
    assert all(sum(n.target in rotary for n in gm.graph.nodes) == layers for gm in backend.graphs)
    assert not torch._dynamo.utils.counters["graph_break"]
    aot, _ = serve(model, prompts, native=True, compile={"backend": "aot_eager"})
    assert aot == refs


def test_inductor_equals_hf_generate():
    """``compile=True`` as users get it (inductor, C++ on the CPU): the one slow test here."""
    model = random_model("llama-tiny", torch.float32, "cpu", 7)
    prompts, refs = prompts_and_refs(model, n=3, seed=4)
    compiled, gen = serve(model, prompts, compile=True)
    assert gen.runner.compile == {"dynamic": True}
    assert compiled == refs


def test_released_compile_workers_leave_compile_working(monkeypatch):
    """What ``warmup()`` does after capturing compiled graphs: inductor's worker pool is
    shut down through torch's own function, and a later compile still works (it starts
    what it needs again)."""
    from torch._inductor import async_compile

    from cellcache.runner import release_compile_workers

    calls = []
    real = async_compile.shutdown_compile_workers
    monkeypatch.setattr(async_compile, "shutdown_compile_workers", lambda: (calls.append(1), real())[1])
    x = torch.arange(5.0)
    torch.testing.assert_close(torch.compile(lambda t: t.sin() * 2 + 1)(x), x.sin() * 2 + 1)
    release_compile_workers()
    assert calls == [1] and not async_compile._pool_set
    torch.testing.assert_close(torch.compile(lambda t: t.cos() - 3)(x), x.cos() - 3)


def test_the_op_outside_a_step_is_refused():
    q = torch.zeros(2, 4, 16)
    k = torch.zeros(2, 2, 16)
    with pytest.raises(InvalidState, match="outside a step"):
        torch.ops.cellcache.attention(q, k, k, 0, None)


BAD = [1, "yes", None, [True], {"backend": "eager", "bogus": 1}, {"fullgraph": "yes"},
       {"dynamic": 1}, {"mode": 3}, {"backend": 3}, {"options": [1]}]


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_bad_compile_values_are_refused_with_nothing_changed(bad):
    model = random_model("llama-tiny", torch.float32, "cpu", 0)
    cfg = model.config
    before = cfg._attn_implementation
    with pytest.raises(InvalidArgument, match="compile"):
        Generator(model, capacity=64, compile=bad)
    assert cfg._attn_implementation == before
    cache = cc.build("host", "batched", cchf.cache_config(model, capacity=64, max_write=16))
    a = cache.seq_new()
    snapshot = (cache.live_seqs(), cache.free_cells, cache.capacity)
    with pytest.raises(InvalidArgument, match="compile"):
        cchf.attach(model, cache, compile=bad)
    assert cfg._attn_implementation == before
    assert (cache.live_seqs(), cache.free_cells, cache.capacity) == snapshot
    assert cache.seq_len(a) == 0
    assert not torch._dynamo.utils.counters["stats"]
