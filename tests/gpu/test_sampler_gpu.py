"""The sampler on the GPU (issue 20): the step's one device-to-host copy goes through the
CUDA driver (cuMemcpyDtoHAsync and a driver event), or through torch without cuda-bindings
or when the stream is another device's than the current one. Every path draws what the CPU
sampler draws, and two steps queued before either is read land in their own buffers."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cellcache.generate import Sampler, SampleSpec  # noqa: E402
from cellcache.generate import readback as readback_mod  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")


def mixed_spec(n: int, seed: int) -> SampleSpec:
    """Greedy and random slots, top-k and top-p, and one verify run of two drafts."""
    rng = np.random.default_rng(seed)
    spec = SampleSpec()
    for i in range(n):
        t = 0.0 if i % 3 == 0 else float(rng.uniform(0.5, 1.5))
        spec.add(i, t, int(rng.choice([0, 5])), float(rng.choice([1.0, 0.9])), seed, 0, i,
                 draft=-1)
    spec.draft[0], spec.draft[1] = 7, 9          # slots 0..2 verify two drafts (slot j checks
    #                                              draft[j]; the last one's, -1, never matches)
    spec.temperature[:3] = [0.0, 0.0, 0.0]
    spec.groups.append((0, 2))
    return spec


def draw_both(sampler: Sampler, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn((24, 300), generator=g)
    logits[0, 7] = 50.0                          # the first draft is accepted, the second not
    logits[1, 9] = -50.0
    spec = mixed_spec(24, seed)
    want = Sampler("cpu")(logits, spec)
    got = sampler.launch(logits.to(sampler.device), spec)
    return want, got


def check_equal(want, got) -> None:
    out = got.result()
    assert out.ids.tolist() == want.ids.tolist()
    assert out.accepted.tolist() == want.accepted.tolist() == [1]


@pytest.mark.parametrize("path", ["driver", "torch", "other-device"])
def test_cuda_draws_equal_the_cpu_sampler_on_every_copy_path(path, monkeypatch):
    sampler = Sampler("cuda:0")
    if path == "torch":                          # no cuda-bindings: torch's copy and event
        monkeypatch.setattr(readback_mod, "_driver_calls", lambda: False)
    if path == "other-device":                   # the stream's device is not the current one
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 99)
    calls = []
    real = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    for seed in range(3):
        want, got = draw_both(sampler, seed)
        check_equal(want, got)
    events = [type(e).__name__ for e in sampler.readback._events if e is not None]
    if path == "driver":
        assert calls == [] and events == ["_DriverEvent", "_DriverEvent"]
    elif path == "torch":
        assert len(calls) == 3 and events == ["Event", "Event"]
    else:
        assert len(calls) == 3 and events == ["_DriverEvent", "_DriverEvent"]
    assert sampler.copies == 3


def test_two_steps_queued_before_either_is_read_keep_their_own_ids():
    """Asynchronous scheduling queues step N+1's copy before reading step N's: the two
    pinned buffers (and events) alternate, so neither copy overwrites the other."""
    sampler = Sampler("cuda:0")
    firsts = []
    for seed in (10, 11, 12, 13):
        firsts.append(draw_both(sampler, seed))
        if len(firsts) == 2:
            for want, got in firsts:
                check_equal(want, got)
            firsts = []
    wide = torch.zeros((2000, 8), device=sampler.device)
    wide[:, 5] = 1.0
    spec = SampleSpec()
    for i in range(2000):                        # more ids than the first buffers held
        spec.add(i, 0.0, 0, 1.0, 0, 0, i)
    assert sampler.launch(wide, spec).result().ids.tolist() == [5] * 2000


@pytest.mark.parametrize("side", [False, True], ids=["current-stream", "side-stream"])
def test_the_copy_waits_for_the_work_queued_before_it_on_the_samplers_stream(side):
    """The copy and its event are queued on the sampler's stream behind the logits' producer:
    a producer held back by a long kernel still lands before the host reads the ids (a copy
    or event on another stream would read the logits before they are written)."""
    stream = torch.cuda.Stream(device=0) if side else torch.cuda.current_stream(0)
    sampler = Sampler("cuda:0", stream=stream)
    spec = SampleSpec()
    for i in range(256):
        spec.add(i, 0.0, 0, 1.0, 0, 0, i)
    for col in (17, 3):                          # twice: both pinned buffers
        logits = torch.zeros((256, 64), device="cuda:0")
        stream.wait_stream(torch.cuda.current_stream(0))
        with torch.cuda.stream(stream):
            torch.cuda._sleep(100_000_000)       # tens of ms of the stream's time
            logits[:, col] = 1.0                 # written only after it
            draw = sampler.launch(logits, spec)
        assert draw.result().ids.tolist() == [col] * 256


def test_a_wider_step_waits_for_the_copy_into_the_buffer_it_replaces():
    """A step wider than a pinned buffer replaces it; a Draw dropped unread may still be
    copying into the old one, which goes back to torch's pinned cache only after that copy."""
    sampler = Sampler("cuda:0")
    small = torch.zeros((8, 16), device="cuda:0")
    spec8 = SampleSpec()
    for i in range(8):
        spec8.add(i, 0.0, 0, 1.0, 0, 0, i)
    torch.cuda._sleep(100_000_000)
    sampler.launch(small, spec8)                 # dropped unread, its copy still queued
    sampler.launch(small, spec8)
    wide = torch.zeros((3000, 16), device="cuda:0")
    wide[:, 9] = 1.0
    spec = SampleSpec()
    for i in range(3000):
        spec.add(i, 0.0, 0, 1.0, 0, 0, i)
    first = sampler.readback._events[sampler.readback._turn ^ 1]
    draw = sampler.launch(wide, spec)            # replaces the first buffer: waits for it
    if type(first).__name__ == "_DriverEvent":     # done already: the query does not wait
        from cellcache.cuda.driver import check, cu
        code, _ = check(cu.cuEventQuery(first.handle), "cuEventQuery", allowed=(600,))
        assert code == 0                         # (600: CUDA_ERROR_NOT_READY)
    assert draw.result().ids.tolist() == [9] * 3000


@pytest.mark.parametrize("stream", ["own", "current"])
def test_a_graphs_greedy_ids_launched_again_skip_the_checks_and_land_each_time(stream):
    """A steady decode step hands the sampler the same spec, logits and greedy-ids tensors
    each time (a graph's outputs, rewritten in place): once each pinned buffer has served
    one, the repeat goes straight to the copy with the sampler's own stream, and each Draw
    still lands that step's ids, two queued at once; without a stream of its own the
    checked copy runs every time. A spec given one more slot, or changed in place to say
    it samples, is checked again (the engine never changes a spec it launched; a user
    of the sampler may)."""
    dev = torch.device("cuda:0")
    sampler = Sampler(dev, stream=torch.cuda.current_stream(0) if stream == "own" else None)
    n = 300
    logits = torch.zeros((n, 32), device=dev)
    greedy = torch.zeros(n, dtype=torch.int64, device=dev)
    spec = SampleSpec(dense=n, random=False)
    for i in range(n):
        spec.add(i, 0.0, 0, 1.0, 0, 0, i)
    seen = []                                    # the checked path's copies
    real = sampler.readback.copy
    sampler.readback.copy = lambda *a: seen.append(1) or real(*a)
    draws = []
    for k in range(6):
        torch.cuda._sleep(20_000_000)            # the copy must wait for the write below
        greedy.copy_(torch.arange(n, device=dev) * (k + 1) % 32)
        draws.append((k, sampler.launch(logits, spec, greedy)))
        if len(draws) == 2:
            for j, draw in draws:
                assert draw.result().ids.tolist() == (np.arange(n) * (j + 1) % 32).tolist()
            draws = []
    # own stream: the first launch of each pinned buffer (two, used in turn) is checked
    assert sampler.copies == 6 and len(seen) == (2 if stream == "own" else 6)
    spec.add(0, 0.0, 0, 1.0, 0, 0, n)           # one more slot: row 0 again, not dense now
    spec.dense = None
    out = sampler.launch(logits, spec, greedy).result().ids.tolist()
    assert out == [0] * (n + 1)                  # argmax of zero logits, not greedy's ids
    assert len(seen) == (3 if stream == "own" else 7)
    spec2 = SampleSpec(dense=n, random=False)   # a new dense spec: checked, then fast
    for i in range(n):
        spec2.add(i, 0.0, 0, 1.0, 0, 0, i)
    for _ in range(3):
        assert sampler.launch(logits, spec2, greedy).result().ids.tolist() == greedy.tolist()
    spec2.temperature[:] = [1.0] * n            # changed in place: it samples now
    spec2.random = True
    drawn = sampler.launch(logits, spec2, greedy).result().ids.tolist()
    want = Sampler("cpu")(logits.cpu(), spec2).ids.tolist()
    assert drawn == want and drawn != greedy.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_extreme_parameters_draw_on_cuda_as_on_the_cpu(dtype):
    """Temperatures and top-p values beyond what float32 computes are clamped on the host
    (the sampler module's docstring), so the device runs the same formula either side of
    the thresholds: the CUDA sampler draws what the CPU one draws, in every logits dtype,
    and that is the limit (tiny T: the top logit, or one of the tied top ones; tiny top_p:
    the top token; huge T: a finite logit within top-k), the ordinary slots of the batch
    drawing what they draw without the extreme ones. Ties meet top-p only where every tied
    id is kept: the sort's order among equal probabilities is the device's own."""
    g = torch.Generator().manual_seed(21)
    V = 64
    logits = (torch.randn((6, V), generator=g) * 4).to(dtype)
    logits[0] = torch.linspace(-60000, 60000, V)[torch.randperm(V, generator=g)].to(dtype)
    logits[1, [5, 20, 41]] = 30.0                # a three-way tie at the top
    logits[2, ::2] = -torch.inf
    logits[3, 1::2] = -torch.inf
    logits[3, [8, 30]] = 25.0                    # a tie at the top among -inf entries
    f = logits.float()
    top = torch.argmax(f, -1).tolist()
    ties = {1: {5, 20, 41}, 3: {8, 30}}
    extreme = [(r, t, k, 1.0) for r in range(6) for t in (1e-39, 1e-300, 5e-324) for k in (0, 4)]
    extreme += [(r, t, 0, p) for r in (0, 2, 4, 5) for t in (0.5, 1.0) for p in (1e-46, 1e-300)]
    extreme += [(r, 1e300, k, 1.0) for r in range(6) for k in (0, 1, 3)]
    ordinary = [(r, t, k, p) for r in (0, 2, 4, 5) for t, k, p in
                [(0.7, 0, 1.0), (1.3, 5, 0.9), (0.05, 0, 0.5), (4.0, 3, 1.0)]]
    ordinary += [(r, 0.8, k, 1.0) for r in (1, 3) for k in (0, 2)]

    def spec_of(params, first):
        spec = SampleSpec()
        for j, (r, t, k, p) in enumerate(params):
            spec.add(r, t, k, p, 7, first + j, 3)
        return spec

    spec = spec_of(extreme + ordinary, 0)
    want = Sampler("cpu")(logits, spec).ids
    got = Sampler("cuda:0")(logits.to("cuda:0"), spec).ids
    assert got.tolist() == want.tolist()
    for j, (r, t, k, p) in enumerate(extreme):
        if t < 1e-30 or p < 1e-30:
            assert got[j] in ties.get(r, {top[r]}), (r, t, k, p, got[j])
        else:
            assert torch.isfinite(f[r, got[j]])
            if k:
                assert f[r, got[j]] >= torch.topk(f[r], k).values[-1]
    n = len(extreme)
    alone = Sampler("cuda:0")(logits.to("cuda:0"), spec_of(ordinary, n)).ids
    assert got[n:].tolist() == alone.tolist()


@pytest.mark.parametrize("V, rows", [(300, 40), (151936, 256)])
def test_temperature_alone_draws_in_one_fused_launch_as_on_the_cpu(V, rows, monkeypatch):
    """A step whose random slots have no top-k, top-p or min-p draws them with sample_rows
    (cuda/fused.cu): what the CPU sampler and CUDA's torch path (FUSED_DRAW off) draw, for
    a vocabulary of a few hundred ids and Qwen2's, greedy slots between the random ones
    (their rows picked by index), temperatures from 2**-64 to 2**64 and beyond, and rows
    with a NaN, every entry -inf, or a +inf entry (torch's search runs off the end: the last
    id). No argmax runs when every slot samples."""
    from cellcache.cuda import fused
    from cellcache.generate import sampler as sampler_mod

    g = torch.Generator().manual_seed(5)
    logits = torch.randn((rows, V), generator=g) * 3
    logits[1, 17] = torch.nan
    logits[2] = -torch.inf
    logits[3, 9] = torch.inf
    temps = [0.0 if i % 7 == 6 else float(t) for i, t in
             enumerate(np.exp(np.random.default_rng(1).uniform(-3, 2, rows)))]
    temps[4], temps[5], temps[8] = 2.0 ** -64, 2.0 ** 64, 1e300

    def spec_of(ts):
        spec = SampleSpec()
        for i, t in enumerate(ts):
            spec.add(i, t, 0, 1.0, 11, 0, i)
        return spec

    launches = []
    real = fused.FusedKernels.sample_rows
    monkeypatch.setattr(fused.FusedKernels, "sample_rows",
                        lambda self, *a: launches.append(a[3]) or real(self, *a))
    for ts in (temps, [t if t > 0 else 0.9 for t in temps]):      # with greedy slots, without
        want = Sampler("cpu")(logits, spec_of(ts)).ids
        dev = logits.to("cuda:0")
        got = Sampler("cuda:0")(dev, spec_of(ts)).ids
        monkeypatch.setattr(sampler_mod, "FUSED_DRAW", False)
        plain = Sampler("cuda:0")(dev, spec_of(ts)).ids
        monkeypatch.setattr(sampler_mod, "FUSED_DRAW", True)
        assert got.tolist() == want.tolist() == plain.tolist()
        assert got[1] == got[2] == got[3] == V - 1
    assert launches == [sum(t > 0 for t in temps), rows]
    # a slot at a temperature alone draws the same beside slots with top-p (torch's ops for
    # those): its way does not depend on the batch
    mixed = SampleSpec()
    for i in range(rows):
        mixed.add(i, 0.9, 0, 0.9 if i % 3 == 0 else 1.0, 11, 0, i)
    alone = Sampler("cuda:0")(logits.to("cuda:0"), spec_of([0.9] * rows)).ids
    beside = Sampler("cuda:0")(logits.to("cuda:0"), mixed).ids
    plain = [i for i in range(rows) if i % 3]
    assert beside[plain].tolist() == alone[plain].tolist()
    assert launches[-2:] == [rows, len(plain)]
    argmax = []
    monkeypatch.setattr(torch, "argmax", lambda *a, **k: argmax.append(1) or torch.max(*a, **k)[1])
    Sampler("cuda:0")(logits.to("cuda:0"), spec_of([0.9] * rows))
    assert argmax == []


def test_the_fused_draw_takes_strided_rows_and_its_largest_vocabulary():
    """Logits whose rows lie further apart than the vocabulary (a slice of a wider tensor),
    and the largest vocabulary whose tile sums fit a block's shared memory: the CPU
    sampler's draws; one id past it goes through torch's ops."""
    from cellcache.cuda.fused import SAMPLE_MAX_VOCAB

    g = torch.Generator().manual_seed(9)
    for V, width in ((5000, 5003), (SAMPLE_MAX_VOCAB, SAMPLE_MAX_VOCAB), (SAMPLE_MAX_VOCAB + 1,) * 2):
        wide = torch.randn((4, width), generator=g) * 3
        logits = wide[:, :V]
        spec = SampleSpec()
        for i in range(4):
            spec.add(i, 0.7, 0, 1.0, 3, 0, i)
        want = Sampler("cpu")(logits, spec).ids
        got = Sampler("cuda:0")(wide.to("cuda:0")[:, :V], spec).ids
        assert got.tolist() == want.tolist(), V


# -- the server knobs (issue 40 §2) -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_server_knobs_draw_on_cuda_as_on_the_cpu(dtype):
    """Every knob of tests/test_sampling_knobs.py's cases (bias, the min_new_tokens mask,
    penalties, min_p with temperature/top-k/top-p, logprobs) draws on CUDA what the CPU
    sampler draws from the same logits, and the raw log-probabilities and their top
    alternatives agree, through the one copy (floats packed behind the ids)."""
    from ..test_sampling_knobs import CASES, build

    g = torch.Generator().manual_seed(4)
    logits = (torch.randn((len(CASES), 64), generator=g) * 3).to(dtype)
    logits[:, [2, 3, 7, 9]] += 4.0
    spec, _ = build(CASES, np.random.default_rng(0))
    spec.prompt_rows += [(2, 17, 3), (5, 40, 0)]
    want = Sampler("cpu")(logits, spec)
    sampler = Sampler("cuda:0")
    got = sampler(logits.to("cuda:0"), spec)
    assert sampler.copies == 1
    assert got.ids.tolist() == want.ids.tolist()
    for a, b in zip(got.logprobs, want.logprobs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_generator_knobs_text_and_logprobs_on_cuda_with_graphs_and_async_steps():
    """A tiny random Llama on CUDA (float32, graphs and asynchronous steps on): plain greedy
    requests equal HF's generate beside requests using the knobs; a logit_bias/penalty
    request equals a greedy loop over HF's forward; log-probabilities equal HF's log_softmax
    over the finished sequence; a stop string cuts the streamed text and ends the request."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from cellcache.generate import Generator, Sampling, random_model

    from ..helpers_text import make_tokenizer
    from ..test_sampling_knobs import reference

    tok = make_tokenizer("bytelevel")
    model = random_model("llama-tiny", torch.float32, "cuda", seed=3)
    hf = copy.deepcopy(model)           # HF's own forward (the Generator's model is cellcache's)
    gen = Generator(model, capacity=1024, max_seqs=16, eos=[], tokenizer=tok)
    assert gen.async_steps
    prompts = [[5, 9, 33, 2, 100], [1, 2, 3, 4], [300, 301, 7]]
    plain = [gen.add(p, Sampling(max_new_tokens=10)) for p in prompts]
    sp = Sampling(max_new_tokens=8, logit_bias={17: 3.0}, repetition_penalty=1.5, presence_penalty=1.0)
    knob = gen.add(prompts[0], sp)
    lp = gen.add(prompts[1], Sampling(max_new_tokens=6, temperature=0.8, seed=1, logprobs=3,
                                      prompt_logprobs=1))
    gen.run()
    with torch.no_grad():
        for p, r in zip(prompts, plain):
            out = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=10, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
            assert r.outputs[0] == out[0, len(p):].tolist()
        tokens = list(prompts[0])
        for _ in range(8):
            x = hf(torch.tensor([tokens], device="cuda")).logits[0, -1].float().cpu()
            x = reference(x, sp, np.array(tokens), len(prompts[0]))
            tokens.append(int(torch.argmax(x)))
        assert knob.outputs[0] == tokens[len(prompts[0]):]
        seq = lp.prompt + lp.outputs[0]
        lsm = torch.log_softmax(hf(torch.tensor([seq], device="cuda")).logits[0].float(), -1).cpu()
    for i, e in enumerate(lp.logprobs[0]):
        assert e.logprob == pytest.approx(float(lsm[len(lp.prompt) - 1 + i, e.token]), abs=1e-3)
        assert len(e.top) == 3
    for i in range(1, len(lp.prompt)):
        assert lp.prompt_logprobs[i].logprob == pytest.approx(float(lsm[i - 1, lp.prompt[i]]), abs=1e-3)
    # a stop string, matched while decode steps run ahead
    text = plain[2].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    if not stop.strip():
        stop = text[-2:]
    deltas = []
    req = gen.add(prompts[2], Sampling(max_new_tokens=10, stop_strings=[stop]),
                  on_text=lambda r, k, d: deltas.append(d))
    gen.run()
    assert req.finish_reasons == ["stop"] and req.text == text[:text.index(stop)]
    assert "".join(deltas) == req.text


@pytest.mark.parametrize("native", [False, True], ids=["modules", "native"])
def test_scoring_requests_on_cuda_with_graphs_and_async_steps(native):
    """Requests that draw nothing (``max_new_tokens=0``, the server's ``max_tokens: 0`` with
    ``echo``) on CUDA with graphs and asynchronous steps: alone (a step whose one row draws
    nothing, no logits row to sample) and beside greedy requests. Their prompt
    log-probabilities equal HF's log_softmax over the prompt (read in chunks), they end ``length`` with no
    tokens, the greedy requests' tokens are those of a run without them, the cells all
    come back."""
    pytest.importorskip("transformers")
    from cellcache.generate import Generator, Sampling, random_model

    model = random_model("llama-tiny", torch.float32, "cuda", seed=3)
    hf = copy.deepcopy(model)
    # (chunks of 16: the 33-token prompt's last chunk is its last token alone)
    gen = Generator(model, capacity=1024, max_seqs=16, eos=[], native=native, prefill_chunk=16,
                    prefix_cache=False)
    assert gen.async_steps
    prompts = [[5, 9, 33, 2, 100, 7], [1, 2, 3, 4], [300, 301, 7, 8, 9]]
    scored = [list(range(40, 73)), [11, 12]]
    free = gen.cache.metrics()["free_cells"]
    alone = gen.add(scored[0], Sampling(max_new_tokens=0, prompt_logprobs=2))
    gen.run()
    plain = [gen.add(p, Sampling(max_new_tokens=12)) for p in prompts]
    gen.run()
    mixed = [gen.add(p, Sampling(max_new_tokens=12)) for p in prompts[:2]]
    side = [gen.add(s, Sampling(max_new_tokens=0, prompt_logprobs=0)) for s in scored]
    mixed.append(gen.add(prompts[2], Sampling(max_new_tokens=12)))
    gen.run()
    assert [r.outputs for r in mixed] == [r.outputs for r in plain]
    assert all(len(r.outputs[0]) == 12 for r in plain)
    for r in [alone, *side]:
        assert r.outputs == [[]] and r.finish_reasons == ["length"]
        with torch.no_grad():
            lsm = torch.log_softmax(hf(torch.tensor([r.prompt], device="cuda")).logits[0].float(), -1).cpu()
        assert r.prompt_logprobs[0] is None
        for i in range(1, len(r.prompt)):
            assert r.prompt_logprobs[i].logprob == pytest.approx(float(lsm[i - 1, r.prompt[i]]), abs=1e-3)
    assert len(alone.prompt_logprobs[5].top) == 2
    assert gen.cache.live_seqs() == [] and gen.cache.metrics()["free_cells"] == free
