"""cellcache.hf and the generator on the host backend (CPU torch): greedy output equals
Hugging Face's own generate token for token, with arrivals over time, chunked prefill,
forks, speculative rewinds and preemption, for Llama, Qwen2 (a sliding-window layer) and
Mistral (every layer windowed)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cellcache import CacheConfig, HostCellCache, InvalidArgument, LayerConfig  # noqa: E402
from cellcache import hf as cchf  # noqa: E402
from cellcache.generate import Generator, Sampling, random_model  # noqa: E402

ARCHS = ["tiny", "llama-tiny", "mistral-tiny"]
N_NEW = 20


@pytest.fixture(scope="module", params=ARCHS)
def model_and_refs(request):
    model = random_model(request.param, seed=3)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 512, size=int(rng.integers(2, 45))).tolist() for _ in range(7)]
    refs = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=N_NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    return model, prompts, refs


def test_config_follows_the_model(model_and_refs):
    model, _, _ = model_and_refs
    cfg = cchf.cache_config(model, capacity=256, max_write=32)
    text = model.config
    assert len(cfg.layers) == text.num_hidden_layers and cfg.mask_format == "bool" and not cfg.paged
    assert [la.window for la in cfg.layers] == cchf.layer_windows(text)
    arch = model.config.model_type
    expect = {"qwen2": [0, 16, 16], "llama": [0, 0], "mistral": [12, 12]}[arch]
    assert [la.window for la in cfg.layers] == expect
    assert cfg.dtype == "float32"


def test_greedy_equals_hf_generate_with_arrivals_chunks_and_preemption(model_and_refs):
    model, prompts, refs = model_and_refs
    # a small pool, so that sequences are preempted and recomputed (reserve=0: admission keeps
    # no cells back for the running requests' growth); small steps and chunks
    gen = Generator(model, capacity=150, max_batch_tokens=16, max_seqs=16, prefill_chunk=7, eos=[],
                    reserve=0)
    reqs = [gen.add(p, Sampling(max_new_tokens=N_NEW)) for p in prompts[:3]]
    for _ in range(4):                                     # the rest arrive over time
        gen.step()
    reqs += [gen.add(p, Sampling(max_new_tokens=N_NEW)) for p in prompts[3:]]
    gen.run()
    assert [r.outputs[0] for r in reqs] == refs
    assert gen.stats["preempted"] > 0 and gen.stats["tokens_out"] == N_NEW * len(prompts)
    gen.cache.check_invariants()
    assert gen.cache.live_seqs() == gen.prefix.owned_seqs()      # cached prompts and outputs
    gen.prefix.clear()
    assert gen.cache.live_seqs() == [] and gen.cache.free_cells == gen.cache.capacity


def test_forks_share_the_prompt_and_continue_alike(model_and_refs):
    model, prompts, refs = model_and_refs
    gen = Generator(model, capacity=400, max_batch_tokens=64, max_seqs=32, eos=[])
    reqs = [gen.add(p, Sampling(max_new_tokens=N_NEW, n=3)) for p in prompts[:3]]
    gen.step()                                             # prompts read, first tokens out
    used_after_prefill = gen.cache.capacity - gen.cache.free_cells
    gen.run()
    for r, ref in zip(reqs, refs[:3]):
        assert r.outputs == [ref] * 3                      # greedy: every continuation alike
    assert gen.stats["forks"] == 6
    # the clones share the prompt's cells: after the prefill step each prompt is stored once
    assert used_after_prefill == sum(len(p) for p in prompts[:3])


def test_speculative_decoding_rewinds_rejected_drafts(model_and_refs):
    model, prompts, refs = model_and_refs
    by_prompt = {tuple(p): ref for p, ref in zip(prompts, refs)}
    rng = np.random.default_rng(5)

    def draft(tokens, k):
        """Proposes the true continuation for a while, then garbage: some accepted, some not."""
        for p, ref in by_prompt.items():
            if tuple(tokens[:len(p)]) == p:
                done = len(tokens) - len(p)
                good = ref[done:done + k]
                cut = int(rng.integers(0, len(good) + 1))
                return good[:cut] + [int(x) for x in rng.integers(0, 512, size=k - cut)]
        return []

    gen = Generator(model, capacity=400, max_batch_tokens=32, max_seqs=16, eos=[])
    reqs = [gen.add(p, Sampling(max_new_tokens=N_NEW), draft=draft, draft_k=4) for p in prompts]
    gen.run()
    assert [r.outputs[0] for r in reqs] == refs
    assert gen.stats["drafted"] > gen.stats["accepted"] > 0     # some kept, some rewound
    assert gen.stats["steps"] < N_NEW + 10                       # fewer steps than tokens


def test_drafts_that_do_not_fit_a_step_are_cut(model_and_refs):
    """Three 2-token prompts read in one step, then all three decode at once drafting 4
    tokens each in steps of 8 rows: drafts are cut to fit, and the output is still what
    plain greedy decoding gives."""
    model, _, _ = model_and_refs
    model.set_attn_implementation("sdpa")              # attached by earlier tests: HF's own again
    prompts = [[5, 9], [17, 3], [250, 1]]
    refs = [model.generate(torch.tensor([p]), max_new_tokens=N_NEW, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, 2:].tolist() for p in prompts]
    by_prompt = {tuple(p): ref for p, ref in zip(prompts, refs)}

    proposed = [0]

    def draft(tokens, k):
        ref = by_prompt[tuple(tokens[:2])]
        out = ref[len(tokens) - 2:len(tokens) - 2 + k]       # always right: accepted if fed
        proposed[0] += len(out)
        return out

    gen = Generator(model, capacity=400, max_batch_tokens=8, max_seqs=16, eos=[])
    reqs = [gen.add(p, Sampling(max_new_tokens=N_NEW), draft=draft, draft_k=4) for p in prompts]
    gen.run()
    assert [r.outputs[0] for r in reqs] == refs
    # some drafts were cut, not fed: "drafted" counts the fed ones, every one of them kept
    assert 0 < gen.stats["accepted"] == gen.stats["drafted"] < proposed[0]
    gen.cache.check_invariants()


def test_sampling_is_seeded_and_respects_stop_and_streaming(model_and_refs):
    model, prompts, _ = model_and_refs
    streamed = []

    def run(seed):
        gen = Generator(model, capacity=300, max_batch_tokens=32, max_seqs=16, eos=[])
        reqs = [gen.add(p, Sampling(max_new_tokens=12, temperature=0.8, top_k=50, top_p=0.9,
                                    seed=seed, n=2),
                        on_token=lambda r, k, t: streamed.append((r.id, k, t)))
                for p in prompts[:3]]
        gen.run()
        return [r.outputs for r in reqs]

    a, b, c = run(1), run(1), run(2)
    assert a == b and a != c
    assert len(streamed) == 3 * 3 * 2 * 12                  # every token of every run streamed
    first = a[0][0][3]                                     # stop at a token we know comes
    gen = Generator(model, capacity=300, max_batch_tokens=32, max_seqs=16, eos=[])
    r = gen.add(prompts[0], Sampling(max_new_tokens=12, temperature=0.8, top_k=50, top_p=0.9,
                                     seed=1, n=2, stop=[first]))
    gen.run()
    assert r.outputs[0][-1] == first and len(r.outputs[0]) <= 4 and r.done


def test_an_attached_model_outside_a_step_says_how_to_detach(model_and_refs):
    from cellcache import InvalidState

    model, prompts, refs = model_and_refs
    cchf.attach(model, HostCellCache(cchf.cache_config(model, capacity=64, max_write=8)))
    with pytest.raises(InvalidState, match="set_attn_implementation\\('sdpa'\\)"):
        model(torch.tensor([prompts[0]]))
    model.set_attn_implementation("sdpa")
    out = model.generate(torch.tensor([prompts[0]]), max_new_tokens=N_NEW, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    assert out[0, len(prompts[0]):].tolist() == refs[0]


def test_attach_refuses_a_cache_that_does_not_fit(model_and_refs):
    model, _, _ = model_and_refs
    wrong = HostCellCache(CacheConfig(capacity=64, layers=[LayerConfig(2, 16)], max_write=8))
    with pytest.raises(InvalidArgument, match="layers"):
        cchf.attach(model, wrong)


def test_generate_cli(tmp_path):
    r = subprocess.run([sys.executable, "-m", "cellcache", "generate", "--random", "tiny",
                        "--random-prompts", "3", "--prompt-len", "5", "--max-new-tokens", "4",
                        "--json", "--quiet", "1 2 3"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["summary"]["requests"] == 4 and out["summary"]["tokens_out"] == 16
    assert out["summary"]["tokens_per_s"] > 0 and out["results"][0]["outputs"][0]
    f = tmp_path / "prompts.txt"
    f.write_text("4 5 6\n7 8\n")
    r = subprocess.run([sys.executable, "-m", "cellcache", "generate", "--random", "tiny",
                        "--prompts-file", str(f), "--max-new-tokens", "3", "--quiet"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "tokens/s" in r.stdout, r.stderr


@pytest.mark.parametrize("args,fragment", [
    ([], "one of the arguments --model --random is required"),
    (["--random", "tiny"], "no prompts"),
    (["--random", "tiny", "x y"], "is not token ids"),
    (["--random", "tiny", "99999"], "token ids must lie in [0, 512)"),
    (["--random", "tiny", "--random-prompts", "1", "--temperature", "-1"], "--temperature must be"),
    (["--model", "/nonexistent/model", "--random-prompts", "1"], "the directory does not exist"),
])
def test_generate_usage_errors(args, fragment, capsys):
    # in this process (a process of its own pays torch's import, seconds on a small machine);
    # test_generate_cli and the test after this one run the command as a process
    from cellcache.__main__ import main

    try:
        code = main(["generate", *args])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], err


def test_a_usage_error_is_one_line_and_exit_code_2_from_the_process():
    r = subprocess.run([sys.executable, "-m", "cellcache", "generate", "--random", "tiny", "x y"],
                       capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not token ids" in lines[0], r.stderr


@pytest.mark.parametrize("growth", ["copy", "allocator"])
def test_copy_growth_moves_the_pools_and_outputs_stay_exact(model_and_refs, growth):
    """Pools that grow by copying (``growth="copy"``, or a user allocator) move at every
    growth: the runner, built before the first step, follows them (its view is refreshed
    before the forward that first sees them), so the output is still HF's."""
    from cellcache.host import HostAllocator

    model, prompts, refs = model_and_refs
    cfg = cchf.cache_config(model, capacity=400, max_write=16, max_seqs=16, initial_capacity=4)
    cache = (HostCellCache(cfg, growth="copy") if growth == "copy"
             else HostCellCache(cfg, allocator=HostAllocator()))
    assert cache.metrics()["pools_move"] is True
    gen = Generator(model, cache, prefill_chunk=7, eos=[])
    assert gen.runner.view.layer(0)[0].shape[0] == 0           # no pool rows before the first step
    reqs = [gen.add(p, Sampling(max_new_tokens=N_NEW)) for p in prompts]
    gen.run()
    assert [r.outputs[0] for r in reqs] == refs
    growths = cache.metrics()["growth_count"]
    assert growths >= 3 and gen.runner.view.generation == growths + 2   # built, first step, growths
    assert gen.runner.view.layer(0)[0].data_ptr() == cache.layer(0).k.ctypes.data


def test_a_detached_model_is_refused_by_its_runner_until_reattached(model_and_refs):
    """After the documented detach (set_attn_implementation('sdpa')) a runner refuses to run
    (it would run without the cache and return wrong tokens), writing nothing; reattach()
    switches the model back and the same step then runs."""
    from cellcache import InvalidState

    model, prompts, refs = model_and_refs
    cache = HostCellCache(cchf.cache_config(model, capacity=64, max_write=8))
    runner = cchf.attach(model, cache)
    a = cache.seq_new()
    prompt = prompts[0][:8]
    cache.declare_step([a] * len(prompt))
    step = cache.prepare_step()
    model.set_attn_implementation("sdpa")
    pools = [cache.layer(i)[kv].tobytes() for i in range(len(cache.config.layers)) for kv in (0, 1)]
    with pytest.raises(InvalidState, match="runner.reattach\\(\\)"):
        runner.forward(step, prompt)
    assert [cache.layer(i)[kv].tobytes() for i in range(len(cache.config.layers)) for kv in (0, 1)] == pools
    assert runner.eager == 0
    expected = model(torch.tensor([prompt])).logits[0, -1]           # HF's own attention
    runner.reattach()
    logits = runner.forward(step, prompt, [len(prompt) - 1])
    cache.commit_step()
    torch.testing.assert_close(logits[0], expected.float(), atol=1e-4, rtol=1e-4)
    model.set_attn_implementation("sdpa")


class _CountingAdapter(cchf.HFAdapter):
    """The transformers adapter, counting what the runner asks of it."""

    def __init__(self, model):
        super().__init__(model)
        self.asked = {"attach": 0, "check": 0, "run": 0}

    def attach(self, view):
        self.asked["attach"] += 1
        super().attach(view)

    def check(self):
        self.asked["check"] += 1
        super().check()

    def run(self, *args):
        self.asked["run"] += 1
        return super().run(*args)


def test_the_runner_asks_its_adapter_for_everything_model_side():
    """ModelRunner never touches the model's attention setting itself: reattach() is the
    adapter's attach, every forward checks and runs through the adapter (cellcache.runner's
    ModelAdapter contract), and the logits are those of attach's own runner."""
    from cellcache.runner import ModelRunner

    model = random_model("tiny", seed=3)
    prompt = [5, 6, 7, 8]
    outs = []
    for make in ("attach", "adapter"):
        cache = HostCellCache(cchf.cache_config(model, capacity=64, max_write=8))
        if make == "attach":
            runner = cchf.attach(model, cache)
        else:
            adapter = _CountingAdapter(model)
            runner = ModelRunner(model, cache, adapter)
            runner.reattach()
            assert adapter.asked == {"attach": 1, "check": 0, "run": 0}
        a = cache.seq_new()
        cache.declare_step([a] * len(prompt))
        outs.append(runner.forward(cache.prepare_step(), prompt, [len(prompt) - 1]))
        cache.commit_step()
    assert adapter.asked == {"attach": 1, "check": 1, "run": 1}
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    model.set_attn_implementation("sdpa")


def test_the_runner_decides_padding_feeds_and_warmup_on_the_host():
    """On the host (no graphs) every step runs eagerly and unpadded, gathered feeds pick rows
    on the host tensor, and warm-up captures nothing; bad warm-up widths are refused."""
    model = random_model("tiny", seed=3)
    cache = HostCellCache(cchf.cache_config(model, capacity=64, max_write=8))
    runner = cchf.attach(model, cache)
    assert not runner.graphs_enabled and runner.stream is None and runner.stream_handle is None
    assert runner.padding(True, 3, 3, 3) == (None, False)
    assert runner.padding(False, 2, 7, 2) == (None, False)
    ids = torch.arange(10, 20)
    prefix = runner.gather(ids, np.arange(4, dtype=np.int64))
    assert prefix.data_ptr() == ids.data_ptr() and prefix.tolist() == [10, 11, 12, 13]
    assert runner.gather(ids, np.array([0, 2, 5], dtype=np.int64)).tolist() == [10, 12, 15]
    todo = runner.warmup_buckets(None, None, 4)
    assert todo == [("mixed", w) for w in reversed(runner.mixed_buckets)] + \
        [("decode", w) for w in reversed(runner.buckets) if w <= 4]
    assert runner.warmup_buckets([2, 2, 1], [], 4) == [("decode", 2), ("decode", 1)]
    for bad in ([3], "12", [0]):
        with pytest.raises(InvalidArgument, match="width"):
            runner.warmup_buckets(bad, None, 4)
    assert runner.warmup(cache, todo) == {"decode": [], "mixed": []}
    assert cache.live_seqs() == [] and runner.replays == runner.eager == 0
    model.set_attn_implementation("sdpa")
