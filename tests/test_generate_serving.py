"""The generator's serving additions of issue 20 on a tiny random model (CPU): latency
records (a fake clock: the step count, so every value is exact and nothing depends on
time), counter-based seeds (a seeded request's tokens depend on its key only: not on drafts,
preemption or what else runs), one host copy of the sampled ids per step, the CPU token
budget default, the arrivals driver, and ``--json``'s latency summary."""

from __future__ import annotations

import itertools
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cellcache import InvalidArgument  # noqa: E402
from cellcache.generate import (  # noqa: E402
    Generator,
    Sampling,
    latency_summary,
    main,
    poisson_arrivals,
    random_model,
    serve_arrivals,
)

from .helpers import random_prompts as prompts  # noqa: E402

VOCAB = 512                  # the tiny random models' vocabulary (random_prompts' default)


@pytest.fixture(scope="module")
def model():
    return random_model("llama-tiny", seed=3)


def stepped(model, **kw):
    """A generator whose clock is its own step count."""
    box: dict = {}
    opts = dict(capacity=512, max_batch_tokens=32, max_seqs=16, prefill_chunk=8, eos=[],
                clock=lambda: float(box["gen"].stats["steps"]) if "gen" in box else 0.0)
    opts.update(kw)
    gen = Generator(model, **opts)
    box["gen"] = gen
    return gen


def test_token_times_ttft_and_itl_with_a_step_clock(model):
    gen = stepped(model)
    a = gen.add(list(range(5)), Sampling(max_new_tokens=6))            # read in step 1
    b = gen.add(list(range(100, 120)), Sampling(max_new_tokens=3, n=2))  # 20 tokens: steps 1-3
    assert gen.run() == [a, b]
    assert a.token_times == [[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]] and a.ttft == 1.0
    assert a.itl() == [1.0] * 5
    assert b.token_times == [[3.0, 4.0, 5.0]] * 2 and b.ttft == 3.0 and b.itl() == [1.0] * 4
    assert a.finished == 6.0 and b.finished == 5.0
    lat = gen.latency([a, b])
    assert lat["requests"] == 2 and lat["gaps"] == 9
    assert lat["ttft_ms_p50"] == 2000.0 and lat["itl_ms_p50"] == lat["itl_ms_p99"] == 1000.0
    assert latency_summary([])["ttft_ms_p50"] is None
    for bad, said in ((5, "requests of type int"), ("ab", "requests of type str"), ([None], "holds NoneType"),
                      ([a, 3], "holds int"), (range(10**18), "holds int"),
                      (itertools.chain([a], itertools.repeat(None)), "holds NoneType")):
        with pytest.raises(InvalidArgument, match=said):
            gen.latency(bad)


def test_accepted_drafts_share_their_step_time(model):
    ref = stepped(model)
    r = ref.add([7, 8, 9], Sampling(max_new_tokens=8))
    ref.run()
    good = r.outputs[0]
    gen = stepped(model)
    d = gen.add([7, 8, 9], Sampling(max_new_tokens=8),
                draft=lambda toks, k: good[len(toks) - 3:len(toks) - 3 + k], draft_k=3)
    gen.run()
    assert d.outputs == r.outputs
    assert d.token_times == [[1.0, 2.0, 2.0, 2.0, 2.0, 3.0, 3.0, 3.0]]
    assert d.itl().count(0.0) == 5


def test_a_seeded_request_depends_only_on_its_key(model):
    """Same seed, same tokens: alone, beside others, with drafts (right or wrong), and
    preempted and recomputed in a tight cache."""
    ps = prompts(1, 4)
    sp = Sampling(max_new_tokens=10, temperature=0.9, top_k=40, top_p=0.95, seed=7, n=2)
    alone = Generator(model, capacity=512, max_batch_tokens=32, eos=[])
    ref = alone.add(ps[0], sp)
    alone.run()

    def wrong(tokens, k):
        return [(tokens[-1] + 1) % VOCAB] * k

    def right(tokens, k):
        out = ref.outputs[0]
        n = len(tokens) - len(ps[0])
        return out[n:n + k]

    for draft in (None, wrong, right):
        gen = Generator(model, capacity=512, max_batch_tokens=32, eos=[])
        others = [gen.add(p, Sampling(max_new_tokens=10, temperature=1.0, seed=i))
                  for i, p in enumerate(ps[1:])]
        r = gen.add(ps[0], sp, draft=draft, draft_k=3)
        gen.run()
        assert r.outputs == ref.outputs and others
    tight = Generator(model, capacity=64, max_batch_tokens=16, prefill_chunk=4, reserve=0.0, eos=[])
    reqs = [tight.add(p, sp) for p in ps]
    tight.run()
    assert tight.stats["preempted"] > 0 and reqs[0].outputs == ref.outputs
    other_seed = Generator(model, capacity=512, max_batch_tokens=32, eos=[])
    r = other_seed.add(ps[0], Sampling(max_new_tokens=10, temperature=0.9, top_k=40, top_p=0.95, seed=8, n=2))
    other_seed.run()
    assert r.outputs != ref.outputs


def test_one_host_copy_of_sampled_ids_per_step(model):
    gen = Generator(model, capacity=512, max_batch_tokens=32, eos=[])
    for i, p in enumerate(prompts(2, 5)):
        gen.add(p, Sampling(max_new_tokens=6, temperature=0.5 * (i % 2), n=1 + (i == 2), seed=i),
                draft=(lambda t, k: [1] * k) if i == 3 else None)
    gen.run()
    assert gen.stats["drafted"] > 0 and gen.stats["forks"] == 1
    assert gen.sampler.copies == gen.stats["steps"] > 0


def test_the_token_budget_defaults_to_the_cpu_size(model):
    gen = Generator(model, capacity=4096, eos=[])
    assert gen.max_batch == 512 and gen.prefill_chunk == 256
    assert Generator(model, capacity=300, eos=[]).max_batch == 300
    before = model.config._attn_implementation
    for bad in (dict(clock=5), dict(prefill_chunk=0)):
        model.set_attn_implementation("sdpa")
        with pytest.raises(InvalidArgument):
            Generator(model, capacity=256, eos=[], **bad)
        assert model.config._attn_implementation == "sdpa"       # refused before attaching
    assert before


def test_arrivals_driver_serves_every_request(model):
    ps = prompts(3, 6)
    offsets = poisson_arrivals(len(ps), rate=50.0, seed=4)
    assert offsets == sorted(offsets) and offsets == poisson_arrivals(len(ps), 50.0, 4)
    now = [0.0]

    def sleep(dt):                                   # a fake clock both threads share
        now[0] += max(dt, 1e-3)

    gen = Generator(model, capacity=512, max_batch_tokens=32, eos=[])
    reqs = serve_arrivals(gen, ps, offsets, Sampling(max_new_tokens=5), clock=lambda: now[0], sleep=sleep)
    ref = Generator(model, capacity=512, max_batch_tokens=32, eos=[])
    refs = [ref.add(p, Sampling(max_new_tokens=5)) for p in ps]
    ref.run()
    assert [r.outputs for r in reqs] == [r.outputs for r in refs] and not gen.busy
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0)


def test_cli_json_reports_latency(capsys):
    argv = ["--random", "llama-tiny", "--random-prompts", "2", "--prompt-len", "4",
            "--max-new-tokens", "3", "--json", "--quiet", "--device", "cpu"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    lat = out["summary"]["latency"]
    assert lat["requests"] == 2 and lat["gaps"] == 4
    assert 0 <= lat["ttft_ms_p50"] <= lat["ttft_ms_p99"] and 0 <= lat["itl_ms_p50"] <= lat["itl_ms_p99"]
    assert out["summary"]["max_batch_tokens"] == 512
    assert all(r["ttft_ms"] >= 0 for r in out["results"])


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_max_seqs_bounds_the_sequences_running_at_once(model, prefix_cache):
    """The Generator builds its cache with max_seqs ids for running sequences plus the
    prefix cache's; the running ones stay within max_seqs even while the prefix cache
    leaves its own ids free, and every request still finishes with what a wide generator
    gives it. A request's n continuations may pass the bound by n - 1 (forked at its
    prompt's end)."""
    ps = prompts(4, 10)
    wide = Generator(model, capacity=2048, max_seqs=16, eos=[], prefix_cache=prefix_cache)
    ref = [wide.add(p, Sampling(max_new_tokens=8)) for p in ps]
    wide.run()
    gen = Generator(model, capacity=2048, max_seqs=3, eos=[], prefix_cache=prefix_cache)
    assert gen.cache.max_seqs == (6 if prefix_cache else 3)
    reqs = [gen.add(p, Sampling(max_new_tokens=8)) for p in ps]
    most = 0
    while gen.step():
        most = max(most, len(gen.running))
    assert most == 3
    assert [r.outputs for r in reqs] == [r.outputs for r in ref]
    fork = gen.add(ps[0], Sampling(max_new_tokens=4, n=3))
    rest = [gen.add(p, Sampling(max_new_tokens=4)) for p in ps[1:4]]
    most = 0
    while gen.step():
        most = max(most, len(gen.running))
    assert most <= 3 + 2 and fork.done and all(r.done for r in rest)


def test_serve_arrivals_takes_a_sampling_per_prompt_and_refuses_a_count_that_differs(model):
    gen = Generator(model, capacity=512, max_seqs=8, eos=[])
    ps = prompts(6, 3)
    sps = [Sampling(max_new_tokens=k) for k in (2, 5, 3)]
    reqs = serve_arrivals(gen, ps, [0.0, 0.001, 0.002], sps)
    assert [len(r.outputs[0]) for r in reqs] == [2, 5, 3]
    with pytest.raises(InvalidArgument, match="2 Samplings for 3 prompts"):
        serve_arrivals(gen, ps, [0.0, 0.0, 0.0], sps[:2])
    assert not gen.busy and gen.stats["tokens_out"] == 10               # nothing queued
