"""The sampler's server knobs (issue 40 §2) on the CPU: ``logit_bias``, the
``min_new_tokens`` mask, repetition / presence / frequency penalties and ``min_p``, each
against a plain torch reference computed from the same logits; log-probabilities (raw model
distribution) of drawn tokens and prompt rows; every slot's draw independent of the other
slots; and end to end through the Generator: log-probabilities against Hugging Face's own
forward over the finished sequence, penalties against a greedy loop over HF's forward,
``min_new_tokens`` and ``ignore_eos`` against the stop rule, drafts and forks unchanged."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cellcache import InvalidArgument  # noqa: E402
from cellcache.generate import Generator, Sampler, SampleSpec, Sampling, random_model  # noqa: E402
from cellcache.generate.plan import SlotExtra  # noqa: E402
from cellcache.generate.sampler import uniforms  # noqa: E402

V = 64


def reference(x, sp, tokens=None, n_prompt=0, banned=()):
    """The processed logits, the formula written out plainly (float32)."""
    x = x.clone().float()
    for t, b in sp.logit_bias.items():
        x[t] += b
    for t in banned:
        x[t] = -torch.inf
    if tokens is not None:
        if sp.repetition_penalty != 1.0:
            for t in set(int(v) for v in tokens):
                x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
        out = [int(v) for v in tokens[n_prompt:]]
        for t in set(out):
            x[t] -= sp.frequency_penalty * out.count(t) + sp.presence_penalty
    return x


def ref_draw(x, sp, seed, index, position):
    """A random draw from processed logits ``x`` as the sampler's formula: temperature,
    min_p, top_k, top_p, then the CDF searched at the keyed uniform."""
    xr = x / sp.temperature
    if sp.min_p > 0:
        xr = torch.where(xr < xr.max() + np.log(sp.min_p), -torch.inf, xr)
    if sp.top_k:
        kth = torch.topk(xr, sp.top_k).values[-1]
        xr = torch.where(xr < kth, -torch.inf, xr)
    p = torch.softmax(xr, -1)
    if sp.top_p < 1:
        sp_, order = torch.sort(p, descending=True)
        keep = (torch.cumsum(sp_, -1) - sp_) < sp.top_p
        p = torch.zeros_like(p).scatter_(0, order, sp_ * keep)
    cdf = torch.cumsum(p.double(), -1)
    u = float(uniforms(seed, index, position))
    return min(int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64),
                                      right=True)[0]), V - 1)


CASES = [
    Sampling(logit_bias={3: 7.5, 9: -100.0}),
    Sampling(repetition_penalty=1.7),
    Sampling(repetition_penalty=0.6),
    Sampling(presence_penalty=1.5, frequency_penalty=0.75),
    Sampling(presence_penalty=-2.0, frequency_penalty=-1.0, logit_bias={5: 2.0}),
    Sampling(min_new_tokens=4),
    Sampling(min_p=0.3, temperature=0.9, seed=3),
    Sampling(min_p=0.05, temperature=1.3, top_k=20, top_p=0.8, seed=4, repetition_penalty=1.3),
    Sampling(temperature=0.7, seed=5, logit_bias={11: 3.0}, presence_penalty=0.5, logprobs=3),
    Sampling(logprobs=0),
    Sampling(logprobs=20, repetition_penalty=1.2),
]


def build(cases, rng):
    """A spec with one slot per case (row i), their penalties' tokens and banned ids."""
    spec = SampleSpec()
    info = []
    for i, sp in enumerate(cases):
        tokens = rng.integers(0, V, size=12)
        n_prompt = 5
        banned = (2, 7) if sp.min_new_tokens else ()
        slot = spec.add(i, sp.temperature, sp.top_k, sp.top_p, sp.seed or 0, 0, 3)
        pen = sp.repetition_penalty != 1.0 or sp.presence_penalty or sp.frequency_penalty
        spec.extras.append(SlotExtra(slot, sp, banned, tokens if pen else None, n_prompt))
        info.append((tokens if pen else None, n_prompt, banned))
    return spec, info


def test_each_knob_draws_from_the_reference_processed_logits():
    rng = np.random.default_rng(0)
    logits = torch.tensor(rng.normal(0, 3, size=(len(CASES), V)), dtype=torch.float32)
    # make the knobs matter: each row's top logits are on the ids the knobs touch
    logits[:, [2, 3, 7, 9]] += 4.0
    spec, info = build(CASES, rng)
    out = Sampler("cpu")(logits, spec)
    for i, (sp, (tokens, n_prompt, banned)) in enumerate(zip(CASES, info)):
        x = reference(logits[i], sp, tokens, n_prompt, banned)
        want = int(torch.argmax(x)) if sp.temperature == 0 else ref_draw(x, sp, sp.seed, 0, 3)
        assert int(out.ids[i]) == want, (i, sp)
        if banned:
            assert int(out.ids[i]) not in banned
    # the knobs changed draws (the test checks something)
    plain = Sampler("cpu")(logits, SampleSpec(rows=list(range(len(CASES))), temperature=[0.0] * len(CASES),
                                             top_k=[0] * len(CASES), top_p=[1.0] * len(CASES),
                                             seed=[0] * len(CASES), index=[0] * len(CASES),
                                             position=[0] * len(CASES), draft=[-1] * len(CASES)))
    assert (plain.ids != out.ids).sum() >= 2


def test_a_slot_draws_the_same_alone_or_beside_others():
    rng = np.random.default_rng(1)
    logits = torch.tensor(rng.normal(0, 3, size=(len(CASES), V)), dtype=torch.float32)
    spec, _ = build(CASES, np.random.default_rng(2))
    both = Sampler("cpu")(logits, spec)
    for i in range(len(CASES)):
        alone, _ = build([CASES[i]], np.random.default_rng(2))
        e = spec.extras[i]
        alone.extras[0] = SlotExtra(0, e.sampling, e.banned, e.tokens, e.n_prompt)
        one = Sampler("cpu")(logits[i:i + 1], alone)
        assert int(one.ids[0]) == int(both.ids[i])
        if both.logprobs is not None and one.logprobs is not None:
            j = [k for k, x in enumerate(spec.extras) if x.sampling.logprobs is not None].index(i) \
                if CASES[i].logprobs is not None else None
            if j is not None:
                assert one.logprobs[0][0] == both.logprobs[0][j]


def test_logprobs_are_the_raw_distributions_and_come_in_the_one_copy():
    rng = np.random.default_rng(3)
    logits = torch.tensor(rng.normal(0, 2, size=(4, V)), dtype=torch.float32)
    spec = SampleSpec()
    sps = [Sampling(logprobs=5, temperature=0.8, seed=1, logit_bias={4: 50.0}), Sampling(),
           Sampling(logprobs=0, repetition_penalty=2.0)]
    for i, sp in enumerate(sps):
        spec.add(i, sp.temperature, 0, 1.0, sp.seed or 0, 0, 0)
        if sp.processed(0):                               # (the knob requests alone)
            spec.extras.append(SlotExtra(i, sp, (), np.array([1, 2, 3]), 1))
    spec.prompt_rows += [(3, 17, 2), (1, 5, 0)]           # a prompt row, and a drawn row's again
    sampler = Sampler("cpu")
    out = sampler(logits, spec)
    assert sampler.copies == 1
    lsm = torch.log_softmax(logits, -1)
    chosen, ti, tv = out.logprobs
    assert int(out.ids[0]) == 4                           # the bias drew it; its raw logprob:
    rows, toks, tops = [0, 2, 3, 1], [int(out.ids[0]), int(out.ids[2]), 17, 5], [5, 0, 2, 0]
    for e, (r, t, k) in enumerate(zip(rows, toks, tops)):
        assert chosen[e] == pytest.approx(float(lsm[r, t]), abs=1e-6)
        vals, ids = torch.topk(lsm[r], k)
        assert ti[e, :k].tolist() == ids.tolist()
        np.testing.assert_allclose(tv[e, :k], vals.numpy(), atol=1e-6)


def test_top_logprobs_break_ties_by_the_lowest_id():
    """Equal log-probabilities (common with bf16 logits) come most probable first, then by
    id: which ids make the top k and their order never depend on the topk kernel."""
    rows = [torch.zeros(V), torch.zeros(V), torch.full((V,), -3.0)]
    rows[1][[40, 7, 33, 12]] = 2.0                    # four tied at the top, then all tied
    rows[2][[50, 9]] = 1.0
    rows[2][[60, 2, 30]] = -1.0
    logits = torch.stack(rows)
    spec = SampleSpec()
    for i in range(3):
        spec.add(i, 0.0, 0, 1.0, 0, 0, 0)
        spec.extras.append(SlotExtra(i, Sampling(logprobs=6), (), None, 0))
    chosen, ti, tv = Sampler("cpu")(logits, spec).logprobs
    assert ti.tolist() == [[0, 1, 2, 3, 4, 5], [7, 12, 33, 40, 0, 1], [9, 50, 2, 30, 60, 0]]
    lsm = torch.log_softmax(logits, -1)
    np.testing.assert_array_equal(tv, lsm.gather(1, torch.as_tensor(ti)).numpy())
    assert np.all(np.diff(tv, axis=1) <= 0)


# -- through the Generator --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return random_model("llama-tiny", seed=3)


@pytest.fixture(scope="module")
def ref():
    return random_model("llama-tiny", seed=3)


def make(model, **kw):
    opts = dict(capacity=512, max_batch_tokens=32, max_seqs=8, prefill_chunk=8, eos=[])
    opts.update(kw)
    return Generator(model, **opts)


def hf_logprobs(ref, tokens):
    with torch.no_grad():
        return torch.log_softmax(ref(torch.tensor([tokens])).logits[0].float(), -1)


def test_logprobs_and_prompt_logprobs_equal_hf_forward(model, ref):
    gen = make(model)
    prompts = [[5, 9, 33, 2, 100, 7, 41, 8, 19, 300, 4], [1, 2, 3]]
    reqs = [gen.add(prompts[0], Sampling(max_new_tokens=6, temperature=0.9, seed=2, logprobs=4,
                                         prompt_logprobs=2, n=2)),
            gen.add(prompts[1], Sampling(max_new_tokens=5, logprobs=0, presence_penalty=1.0)),
            gen.add([7, 7, 7], Sampling(max_new_tokens=5))]
    gen.run()
    assert reqs[2].logprobs is None and reqs[2].prompt_logprobs is None
    for req in reqs[:2]:
        for k in range(req.sampling.n):
            seq = req.prompt + req.outputs[k]
            lsm = hf_logprobs(ref, seq)
            assert len(req.logprobs[k]) == len(req.outputs[k])
            for i, e in enumerate(req.logprobs[k]):
                pos = len(req.prompt) - 1 + i
                assert e.token == req.outputs[k][i]
                assert e.logprob == pytest.approx(float(lsm[pos, e.token]), abs=1e-4)
                top = req.sampling.logprobs
                assert len(e.top) == top
                if top:
                    vals, ids = torch.topk(lsm[pos], top)
                    assert [t for t, _ in e.top] == ids.tolist()
                    np.testing.assert_allclose([v for _, v in e.top], vals.numpy(), atol=1e-4)
    req = reqs[0]
    lsm = hf_logprobs(ref, req.prompt)
    assert req.prompt_logprobs[0] is None and len(req.prompt_logprobs) == len(req.prompt)
    for i in range(1, len(req.prompt)):                    # (read over two chunks of 8)
        e = req.prompt_logprobs[i]
        assert e.token == req.prompt[i]
        assert e.logprob == pytest.approx(float(lsm[i - 1, req.prompt[i]]), abs=1e-4)
        assert [t for t, _ in e.top] == torch.topk(lsm[i - 1], 2).indices.tolist()


def test_prompt_logprobs_are_computed_even_when_the_prefix_is_cached(model):
    gen = make(model)
    prompt = list(range(40, 60))
    first = gen.add(prompt, Sampling(max_new_tokens=2))
    gen.run()
    again = gen.add(prompt, Sampling(max_new_tokens=2))
    gen.run()
    assert again.cached_tokens > 0 and first.cached_tokens == 0
    wants = gen.add(prompt, Sampling(max_new_tokens=2, prompt_logprobs=0))
    gen.run()
    assert wants.cached_tokens == 0 and None not in wants.prompt_logprobs[1:]
    assert wants.outputs == first.outputs


# -- prompt scoring: max_new_tokens 0 (OpenAI's max_tokens 0 with echo) -----------------------------
#: 20 tokens: read in three chunks of make()'s prefill_chunk 8
SCORED = [5, 9, 33, 2, 100, 7, 41, 8, 19, 300, 4, 6, 7, 8, 9, 10, 11, 12, 200, 3]


def same_prompt_logprobs(a, b, tol=1e-5):
    """Two requests' prompt log-probabilities agree: the tokens, their alternatives' ids,
    the values up to ``tol`` (a logits row computed beside other rows: float32 ulps)."""
    assert len(a) == len(b) and a[0] is None and b[0] is None
    for e, f in zip(a[1:], b[1:]):
        assert e.token == f.token and [t for t, _ in e.top] == [t for t, _ in f.top]
        assert e.logprob == pytest.approx(f.logprob, abs=tol)
        np.testing.assert_allclose([v for _, v in e.top], [v for _, v in f.top], atol=tol)


def scored_alone(model, max_new_tokens, prompt=SCORED, **kw):
    """``prompt`` alone in a fresh generator without a prefix cache, prompt
    log-probabilities with 3 alternatives: (request, generator)."""
    gen = make(model, prefix_cache=False, **kw)
    req = gen.add(prompt, Sampling(max_new_tokens=max_new_tokens, prompt_logprobs=3))
    gen.run()
    return req, gen


@pytest.mark.parametrize("length", [20, 17])
@pytest.mark.parametrize("async_steps", [False, True])
def test_a_request_that_draws_nothing_scores_its_prompt(model, ref, async_steps, length):
    """max_new_tokens 0 with prompt log-probabilities: the prompt is read (three chunks;
    at 17 tokens the last one is its last token alone, a step of one row that a decode
    step would otherwise take),
    its log-probabilities are those of the same prompt asked with max_new_tokens 1 (the
    same steps, one logits row fewer) and HF's forward's, nothing is drawn or delivered, it ends
    with "length", the counters count its prompt and no output, and every cell it took is
    free again."""
    prompt = SCORED[:length]
    one, _ = scored_alone(model, 1, prompt, async_steps=async_steps)
    assert len(one.outputs[0]) == 1
    gen = make(model, prefix_cache=False, async_steps=async_steps)
    free = gen.cache.metrics()["free_cells"]
    delivered = []
    req = gen.add(prompt, Sampling(max_new_tokens=0, prompt_logprobs=3),
                  on_token=lambda *a: delivered.append(a))
    gen.run()
    assert req.outputs == [[]] and req.finish_reasons == ["length"] and req.done and req.complete
    assert req.logprobs is None and req.first_token is None and req.token_times == [[]]
    assert delivered == [] and list(req.iter_tokens()) == []
    same_prompt_logprobs(req.prompt_logprobs, one.prompt_logprobs)
    lsm = hf_logprobs(ref, prompt)
    for i in range(1, length):
        e = req.prompt_logprobs[i]
        assert e.token == prompt[i] and len(e.top) == 3
        assert e.logprob == pytest.approx(float(lsm[i - 1, prompt[i]]), abs=1e-4)
    st = gen.stats
    counts = (st["steps"], st["tokens_out"], st["prompt_tokens"], st["computed_tokens"])
    assert counts == (3, 0, length, length)
    assert gen.cache.metrics()["free_cells"] == free and gen.cache.live_seqs() == []
    assert not gen.running and not gen.waiting and not gen.requests and not gen.busy


def test_scoring_beside_other_requests_changes_none_of_their_tokens(model):
    """A request that draws nothing, its chunks in the steps of greedy, seeded and n > 1
    requests: theirs are the tokens, streams and log-probabilities of a run without it,
    and its prompt log-probabilities are those it gets alone (float32 sums in another
    batch: ulps)."""
    others = [([1, 2, 3], Sampling(max_new_tokens=9)),
              ([4, 5, 6, 7, 8, 9, 10, 11, 12, 13], Sampling(max_new_tokens=7, temperature=0.8, seed=5,
                                                          logprobs=2)),
              ([40, 41], Sampling(max_new_tokens=5, temperature=1.0, seed=1, n=2))]
    alone, _ = scored_alone(model, 0)
    runs = []
    for scoring in (False, True):
        gen = make(model)
        streamed: list = []

        def on_token(r, k, t, streamed=streamed):
            streamed.append((r.id, k, t))

        reqs = [gen.add(p, sp, on_token=on_token) for p, sp in others[:2]]
        score = gen.add(SCORED, Sampling(max_new_tokens=0, prompt_logprobs=3)) if scoring else None
        reqs.append(gen.add(*others[2]))
        gen.run()
        runs.append((reqs, score, streamed, dict(gen.stats)))
    (plain, _, s0, st0), (mixed, score, s1, st1) = runs
    assert [r.outputs for r in mixed] == [r.outputs for r in plain]
    assert [r.finish_reasons for r in mixed] == [r.finish_reasons for r in plain] == [["length"]] * 2 + [
        ["length"] * 2]
    assert [(k, t) for _, k, t in s1] == [(k, t) for _, k, t in s0]
    for e, f in zip(plain[1].logprobs[0], mixed[1].logprobs[0]):
        assert e.token == f.token and e.logprob == pytest.approx(f.logprob, abs=1e-5)
    assert score.outputs == [[]] and score.finish_reasons == ["length"]
    same_prompt_logprobs(score.prompt_logprobs, alone.prompt_logprobs)
    assert st1["tokens_out"] == st0["tokens_out"] and st1["prompt_tokens"] == st0["prompt_tokens"] + 20


def test_scoring_through_the_prefix_cache(model):
    """A request that draws nothing is read through the prefix cache as any other: without
    prompt log-probabilities it takes the cached prefix and computes the last token alone;
    with them it reads its prompt whole (a hit's tokens are never computed), as a request
    that draws does; either way its prompt is stored for the requests after it."""
    gen = make(model)
    first = gen.add(SCORED, Sampling(max_new_tokens=0))
    gen.run()
    assert first.cached_tokens == 0 and first.finish_reasons == ["length"] and first.prompt_logprobs is None
    computed = gen.stats["computed_tokens"]
    hit = gen.add(SCORED, Sampling(max_new_tokens=0))
    gen.run()
    assert hit.cached_tokens == len(SCORED) - 1 and gen.stats["computed_tokens"] - computed == 1
    assert hit.outputs == [[]] and hit.finish_reasons == ["length"]
    scored = gen.add(SCORED, Sampling(max_new_tokens=0, prompt_logprobs=3))
    gen.run()
    alone, _ = scored_alone(model, 0)
    assert scored.cached_tokens == 0
    same_prompt_logprobs(scored.prompt_logprobs, alone.prompt_logprobs)
    longer = gen.add(SCORED + [1, 2], Sampling(max_new_tokens=3))
    gen.run()
    assert longer.cached_tokens == len(SCORED) and len(longer.outputs[0]) == 3
    gen.prefix.clear()
    assert gen.cache.live_seqs() == [] and gen.cache.metrics()["free_cells"] == gen.cache.config.capacity


def test_scoring_with_n_continuations_forks_nothing(model):
    """n > 1 with nothing to draw: the prompt is read once and every continuation ends with
    "length" and no tokens (no fork: forks happen at the first token)."""
    gen = make(model)
    req = gen.add(SCORED, Sampling(max_new_tokens=0, n=3, prompt_logprobs=0, logprobs=1))
    assert gen.waiting[0].claim(0) == 20              # its prompt; nothing for continuations
    gen.run()
    assert req.outputs == [[], [], []] and req.finish_reasons == ["length"] * 3
    assert req.logprobs == [[], [], []] and None not in req.prompt_logprobs[1:]
    assert gen.stats["forks"] == 0 and gen.stats["tokens_out"] == 0 and gen.stats["computed_tokens"] == 20


def test_a_preempted_scoring_request_reads_its_prompt_again(model):
    """A cache too small for everything at once (reserve 0): the request that draws
    nothing, admitted last, is preempted while its prompt is read and read again later;
    its prompt log-probabilities and the others' tokens are those of a run with room."""
    runs = []
    for capacity in (56, 512):
        gen = make(model, capacity=capacity, reserve=0.0, prefix_cache=False)
        reqs = [gen.add(list(range(10 + 20 * i, 20 + 20 * i)), Sampling(max_new_tokens=20)) for i in range(2)]
        reqs.append(gen.add(SCORED, Sampling(max_new_tokens=0, prompt_logprobs=3)))
        gen.run()
        runs.append((reqs, gen.stats["preempted"], gen.cache.metrics()["free_cells"] == capacity))
    (short, preempted, freed), (roomy, none, _) = runs
    assert preempted > 0 and none == 0 and freed
    assert [r.outputs for r in short] == [r.outputs for r in roomy]
    assert short[2].finish_reasons == ["length"] and short[2].outputs == [[]]
    same_prompt_logprobs(short[2].prompt_logprobs, roomy[2].prompt_logprobs)


def test_scoring_closes_each_continuations_text(model):
    """With a tokenizer, each continuation's text closes with one on_text call ("" and its
    finish reason set), as a continuation that ends does."""
    pytest.importorskip("tokenizers")
    from tests.helpers_text import make_tokenizer

    gen = make(model, tokenizer=make_tokenizer())
    calls = []
    req = gen.add("hello world, hello there", Sampling(max_new_tokens=0, n=2),
                  on_text=lambda r, k, delta: calls.append((k, delta, r.finish_reasons[k])))
    gen.run()
    assert sorted(calls) == [(0, "", "length"), (1, "", "length")]
    assert req.texts == ["", ""] and list(req.iter_text(1)) == []


def test_nothing_to_draw_needs_its_prompt_alone_and_less_is_refused(model):
    """max_new_tokens 0 claims its prompt's cells (not one fewer, as the rule for a drawn
    last token would give): a prompt of the whole capacity runs, one more is refused at
    add() with nothing queued; a negative count, or min_new_tokens above 0, is refused."""
    for kw in (dict(max_new_tokens=-1), dict(max_new_tokens=0, min_new_tokens=1)):
        with pytest.raises(InvalidArgument):
            Sampling(**kw)
    assert Sampling(max_new_tokens=0).cells_needed(10) == Sampling(max_new_tokens=1).cells_needed(10) == 10
    gen = make(model, capacity=64, prefix_cache=False)
    with pytest.raises(InvalidArgument, match="needs 65 cells"):
        gen.add(list(range(65)), Sampling(max_new_tokens=0))
    assert not gen.waiting and not gen.requests
    req = gen.add(list(range(64)), Sampling(max_new_tokens=0, prompt_logprobs=0))
    gen.run()
    assert req.finish_reasons == ["length"] and None not in req.prompt_logprobs[1:]


def greedy_loop(ref, prompt, sp, n, eos=()):
    """Greedy decoding over HF's own forward with the knobs applied by :func:`reference`."""
    tokens = list(prompt)
    out = []
    for _ in range(n):
        with torch.no_grad():
            x = ref(torch.tensor([tokens])).logits[0, -1].float()
        # (as vLLM: with ignore_eos the end-of-sequence ids are not stop ids, so not masked)
        banned = ()
        if len(out) < sp.min_new_tokens:
            banned = (() if sp.ignore_eos else tuple(eos)) + tuple(sp.stop)
        pen = sp.repetition_penalty != 1.0 or sp.presence_penalty or sp.frequency_penalty
        x = reference(x, sp, np.array(tokens) if pen else None, len(prompt), banned)
        t = int(torch.argmax(x))
        out.append(t)
        tokens.append(t)
        if (t in sp.stop or (t in eos and not sp.ignore_eos)) and len(out) > sp.min_new_tokens:
            break
    return out


@pytest.mark.parametrize("sp", [
    Sampling(max_new_tokens=8, repetition_penalty=1.9),
    Sampling(max_new_tokens=8, presence_penalty=2.0, frequency_penalty=1.0),
    Sampling(max_new_tokens=8, logit_bias={17: 4.0, 99: 3.0}, frequency_penalty=2.0),
])
def test_penalties_end_to_end_match_a_greedy_loop_over_hf(model, ref, sp):
    gen = make(model)
    prompt = [3, 17, 99, 17, 5, 8]
    plain = gen.add(prompt, Sampling(max_new_tokens=8))
    req = gen.add(prompt, sp)
    drafted = gen.add(prompt, sp, draft=lambda toks, k: toks[-k:], draft_k=3)   # verify runs too
    gen.run()
    want = greedy_loop(ref, prompt, sp, 8)
    assert req.outputs[0] == want and drafted.outputs[0] == want
    assert plain.outputs[0] != want                        # the knobs changed something


def test_min_new_tokens_and_ignore_eos(model, ref):
    prompt = [3, 17, 99, 17, 5, 8]
    first = greedy_loop(ref, prompt, Sampling(), 1)[0]
    gen = make(model, eos=[first])
    stopped = gen.add(prompt, Sampling(max_new_tokens=8))
    ignored = gen.add(prompt, Sampling(max_new_tokens=8, ignore_eos=True))
    held = gen.add(prompt, Sampling(max_new_tokens=8, min_new_tokens=3))
    stop_tok = gen.add(prompt, Sampling(max_new_tokens=8, min_new_tokens=2, stop=[first], ignore_eos=True))
    gen.run()
    assert stopped.outputs == [[first]] and stopped.finish_reasons == ["stop"]
    assert ignored.finish_reasons == ["length"] and ignored.outputs[0] == greedy_loop(
        ref, prompt, Sampling(max_new_tokens=8), 8)
    want = greedy_loop(ref, prompt, Sampling(min_new_tokens=3), 8, eos=[first])
    assert held.outputs[0] == want and first not in want[:3]
    assert stop_tok.outputs[0] == greedy_loop(ref, prompt, Sampling(min_new_tokens=2, stop=[first],
                                                                    ignore_eos=True), 8)


def test_ids_past_the_vocabulary_in_stop_and_eos(model, ref):
    """A stop id outside the vocabulary is refused at add() (as a logit_bias id is), nothing
    added; an end-of-sequence id the logits do not reach (a generation config's, say) is
    never drawn, so min_new_tokens has nothing to mask for it: the request runs as without
    it (its mask used to raise IndexError at every later step, holding up every request)."""
    from cellcache.errors import InvalidArgument

    V = model.config.vocab_size
    prompt = [3, 17, 99, 17, 5, 8]
    gen = make(model, eos=[V, 2**70])
    for stop in ([V], [2**70]):
        with pytest.raises(InvalidArgument, match="stop holds token id"):
            gen.add(prompt, Sampling(max_new_tokens=4, min_new_tokens=1, stop=stop))
    assert not gen.waiting and not gen.running
    held = gen.add(prompt, Sampling(max_new_tokens=4, min_new_tokens=2))
    other = gen.add(prompt, Sampling(max_new_tokens=4))
    gen.run()
    want = greedy_loop(ref, prompt, Sampling(), 4)
    assert held.outputs[0] == want and other.outputs[0] == want


def test_greedy_outputs_without_knobs_are_unchanged_beside_requests_with_them(model):
    prompts = [[5, 6, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44]]
    alone = make(model)
    base = [alone.add(p, Sampling(max_new_tokens=7)) for p in prompts]
    alone.run()
    mixed = make(model)
    plain = [mixed.add(p, Sampling(max_new_tokens=7)) for p in prompts]
    knobs = [mixed.add(p, Sampling(max_new_tokens=7, logprobs=2, repetition_penalty=1.5, min_p=0.1,
                                   temperature=0.5, seed=1)) for p in prompts]
    mixed.run()
    assert [r.outputs for r in plain] == [r.outputs for r in base]
    assert all(len(r.logprobs[0]) == 7 for r in knobs)


def test_knobs_that_end_run_ahead_again(model, ref):
    """Prompt log-probabilities need no decode-step work and the min_new_tokens mask ends
    once that many tokens are drawn: the request's later decode steps run ahead
    (asynchronous steps) as plain ones do, with the synchronous generator's outputs."""
    prompt = [3, 17, 99, 17, 5, 8]
    first = greedy_loop(ref, prompt, Sampling(), 1)[0]
    outs = []
    for async_steps in (False, True):
        gen = make(model, eos=[first], async_steps=async_steps)
        ahead = []
        real = gen.runner.forward

        def forward(step, tokens=None, logit_rows=None, decode=False, *, device_tokens=None,
                    logits=True, ahead=ahead, real=real):
            ahead.append(device_tokens is not None)
            return real(step, tokens, logit_rows, decode, device_tokens=device_tokens, logits=logits)

        gen.runner.forward = forward
        req = gen.add(prompt, Sampling(max_new_tokens=12, min_new_tokens=3, prompt_logprobs=1,
                                       ignore_eos=True))
        gen.run()
        assert any(ahead) == async_steps and None not in req.prompt_logprobs[1:]
        outs.append(req.outputs)
    assert outs[0] == outs[1]
    want = greedy_loop(ref, prompt, Sampling(min_new_tokens=3, ignore_eos=True), 12, eos=[first])
    assert outs[0][0] == want


@pytest.mark.parametrize("ending", ["length", "stop"])
@pytest.mark.parametrize("history", [False, True])
def test_knobs_run_ahead_with_the_synchronous_outputs(model, ending, history):
    """Requests using the knobs decode in steps launched ahead (asynchronous; the steady
    path too when nothing depends on a row's past) and give the synchronous generator's
    tokens and log-probabilities, rows ending (by length at different steps, or on a stop
    token) and leaving the steps in flight. ``history``: penalties and min_new_tokens, whose
    draws count the token each row was fed on the device (``SampleSpec.fed``)."""
    prompts = [[5, 6, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44], [7, 7]]
    sps = [Sampling(max_new_tokens=14, logprobs=2, logit_bias={17: 2.0}),
           Sampling(max_new_tokens=9, temperature=0.9, seed=4, min_p=0.2, logprobs=0),
           Sampling(max_new_tokens=12),
           Sampling(max_new_tokens=11, temperature=1.2, seed=2, top_k=30, logit_bias={3: -5.0})]
    if history:
        sps[1] = Sampling(max_new_tokens=9, repetition_penalty=1.8, frequency_penalty=1.0,
                          presence_penalty=0.5, logprobs=1)
        sps[2] = Sampling(max_new_tokens=12, temperature=0.8, seed=7, presence_penalty=2.0,
                          min_new_tokens=5, stop=[0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    if ending == "stop":                               # a stop token one request draws
        probe = make(model)
        r = probe.add(prompts[0], sps[0])
        probe.run()
        sps[0] = Sampling(max_new_tokens=14, logprobs=2, logit_bias={17: 2.0}, stop=[r.outputs[0][6]])
    results = []
    for async_steps in (False, True):
        gen = make(model, async_steps=async_steps)
        ahead = []
        real = gen.runner.forward

        def forward(step, tokens=None, logit_rows=None, decode=False, *, device_tokens=None,
                    logits=True, ahead=ahead, real=real):
            ahead.append(device_tokens is not None)
            return real(step, tokens, logit_rows, decode, device_tokens=device_tokens, logits=logits)

        gen.runner.forward = forward
        reqs = [gen.add(p, sp) for p, sp in zip(prompts, sps)]
        gen.run()
        assert sum(ahead) > 3 if async_steps else not any(ahead)
        if async_steps and ending == "length":        # the steady path's token store held rows
            assert gen.scheduler.flushed_tokens > 0
        results.append([(r.outputs, r.logprobs, r.finish_reasons) for r in reqs])
    assert results[0] == results[1]
    assert results[1][0][2] == [ending]
    assert [len(lp[0]) for _, lp, _ in results[1] if lp is not None] == \
        [len(o[0]) for o, lp, _ in results[1] if lp is not None]


def test_many_logprob_rows_go_in_blocks_with_the_same_values(monkeypatch):
    from cellcache.generate import sampler as sampler_mod

    rng = np.random.default_rng(5)
    logits = torch.tensor(rng.normal(0, 2, size=(11, V)), dtype=torch.float32)
    spec = SampleSpec()
    spec.add(10, 0.0, 0, 1.0, 0, 0, 0)
    spec.extras.append(SlotExtra(0, Sampling(logprobs=4)))
    spec.prompt_rows += [(r, int(rng.integers(0, V)), 3) for r in range(10)]
    whole = Sampler("cpu")(logits, spec).logprobs
    monkeypatch.setattr(sampler_mod, "LOGPROB_BLOCK", 3)
    blocks = Sampler("cpu")(logits, spec).logprobs
    for a, b in zip(whole, blocks):
        np.testing.assert_array_equal(a, b)
    lsm = torch.log_softmax(logits, -1)
    assert whole[0][3] == pytest.approx(float(lsm[2, spec.prompt_rows[2][1]]), abs=1e-6)
    assert whole[1].shape == (11, 4)


def test_penalties_count_the_tokens_fed_on_the_device():
    """A step launched ahead: each row's last token is on the device (SampleSpec.fed); the
    penalties count it as an output token, as if the host had it."""
    rng = np.random.default_rng(8)
    cases = [Sampling(repetition_penalty=1.9), Sampling(presence_penalty=2.0, frequency_penalty=1.5),
             Sampling(repetition_penalty=0.5, frequency_penalty=-1.0, temperature=0.7, seed=3)]
    logits = torch.tensor(rng.normal(0, 3, size=(len(cases), V)), dtype=torch.float32)
    fed = torch.tensor([int(torch.argmax(logits[i])) for i in range(len(cases))])  # (it matters)
    spec = SampleSpec()
    host = []
    for i, sp in enumerate(cases):
        tokens = rng.integers(0, V, size=9)
        spec.add(i, sp.temperature, 0, 1.0, sp.seed or 0, 0, 4)
        spec.extras.append(SlotExtra(i, sp, (), tokens, 4))
        host.append(tokens)
    spec.fed = fed
    out = Sampler("cpu")(logits, spec)
    for i, sp in enumerate(cases):
        x = reference(logits[i], sp, np.append(host[i], int(fed[i])), 4)
        want = int(torch.argmax(x)) if sp.temperature == 0 else ref_draw(x, sp, sp.seed, 0, 4)
        assert int(out.ids[i]) == want
    assert out.ids.tolist() != [int(f) for f in fed]


def test_the_extreme_repetition_penalties_draw_seen_tokens_and_past_them_are_refused():
    """At the smallest penalty allowed a seen token with a positive logit dominates: every
    seed draws one (the float32 logits stay finite); below it the request is refused with
    nothing queued (1e-300 was 0 in float32: inf logits, a NaN draw, the vocabulary's last id)."""
    from cellcache.errors import InvalidArgument
    from cellcache.generate import Generator, Sampling, random_model
    from cellcache.generate.requests import REPETITION_MAX

    model = random_model("llama-tiny", torch.float32, "cpu", 0)
    prompt = [483, 320, 350, 459, 296]
    gen = Generator(model, capacity=256, eos=[])
    reqs = [gen.add(prompt, Sampling(max_new_tokens=3, repetition_penalty=1 / REPETITION_MAX,
                                     temperature=1.0, seed=s)) for s in range(3)]
    gen.run()
    for r in reqs:
        out = r.outputs[0]
        assert all(t in prompt + out[:i] for i, t in enumerate(out)), out
    sp = Sampling(max_new_tokens=3)
    sp.repetition_penalty = 1e-300                  # changed after construction: add() checks
    with pytest.raises(InvalidArgument, match="repetition_penalty"):
        gen.add(prompt, sp)
    assert not gen.waiting and not gen.busy


def test_min_new_tokens_with_every_id_a_stop_id_is_refused():
    from cellcache.errors import InvalidArgument
    from cellcache.generate import Generator, Sampling, random_model

    model = random_model("llama-tiny", torch.float32, "cpu", 0)
    gen = Generator(model, capacity=256, eos=[511])
    with pytest.raises(InvalidArgument, match="no token could be drawn"):
        gen.add([1, 2], Sampling(max_new_tokens=4, min_new_tokens=3, stop=list(range(512))))
    with pytest.raises(InvalidArgument, match="no token could be drawn"):
        gen.add([1, 2], Sampling(max_new_tokens=4, min_new_tokens=3, stop=list(range(511))))
    assert not gen.waiting and not gen.requests
    ok = gen.add([1, 2], Sampling(max_new_tokens=4, min_new_tokens=3, stop=list(range(511)),
                                  ignore_eos=True))
    gen.run()
    assert ok.outputs[0][:3] == [511] * 3            # the one id not masked
