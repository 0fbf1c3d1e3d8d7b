"""Asynchronous scheduling (``Generator(async_steps=True)``) on a tiny random model (CPU):
a lean decode step is left in flight and the next one is scheduled, prepared and launched
on its sampled ids on the device before they reach the host; outputs, finish reasons,
streams and counters must equal the synchronous generator's, token for token, through
arrivals, ``n > 1`` forks, drafts, stop tokens, preemption, cancellation, a request's own
failures and failed steps (rolled back with the step in flight)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cellcache import InvalidArgument  # noqa: E402
from cellcache.generate import Generator, Sampling, random_model  # noqa: E402

from .helpers import random_prompts as prompts  # noqa: E402

VOCAB = 512                  # the tiny random models' vocabulary (random_prompts' default)


@pytest.fixture(scope="module")
def model():
    return random_model("llama-tiny", seed=3)


def make(model, async_steps, **kw):
    opts = dict(capacity=512, max_batch_tokens=32, max_seqs=16, prefill_chunk=8, eos=[])
    opts.update(kw)
    gen = Generator(model, async_steps=async_steps, **opts)
    gen.ahead = 0                                     # steps launched on device-side ids
    gen.mixed_ahead = 0                               # of them, with host ids too (prompts)
    real = gen.runner.forward

    def forward(step, tokens=None, logit_rows=None, decode=False, *, device_tokens=None, logits=True):
        if device_tokens is not None:
            gen.ahead += 1
            gen.mixed_ahead += tokens is not None
            return real(step, tokens, logit_rows, decode, device_tokens=device_tokens, logits=logits)
        return real(step, tokens, logit_rows, decode, logits=logits)

    gen.runner.forward = forward
    # the steady path (the same rows as the step in flight, applied without per-row checks)
    sched = gen.scheduler
    gen.steady = {"plans": 0, "applied": 0, "declined": 0}
    plan_real, apply_real = sched._steady_decode, sched._apply_steady

    def steady_plan(after):
        plan = plan_real(after)
        gen.steady["plans"] += plan is not None
        return plan

    def steady_apply(*args):
        events = apply_real(*args)
        gen.steady["applied" if events is not None else "declined"] += 1
        return events

    sched._steady_decode, sched._apply_steady = steady_plan, steady_apply
    return gen


def check(gen):
    """The cache holds what the generator believes: a running sequence owns its in_cache
    tokens, plus the cells of the step in flight that carries it (one a decode row, its
    chunk a prompt's)."""
    cache = gen.cache
    cache.check_invariants()
    flying: dict[int, int] = {}
    if gen._flight is not None:
        for s, feed in gen._flight.plan.rows:
            flying[id(s)] = flying.get(id(s), 0) + len(feed)
    sids = []
    for s in gen.running:
        assert s.sid is not None and s.req.finish_reasons[s.index] is None
        extra = flying.get(id(s), 0)
        assert cache.pos(s.sid) == s.in_cache + extra == cache.seq_len(s.sid)
        sids.append(s.sid)
    for s in gen.waiting:
        assert s.sid is None and s.in_cache == 0
    tree = gen.prefix.owned_seqs() if gen.prefix is not None else []
    assert sorted(sids + tree) == cache.live_seqs()


def serve(model, async_steps, work, *, kw=None, each_step=None, limit=2000):
    """Runs ``work(gen)`` (adds requests, returns them), steps to the end checking the
    state after every step; returns (requests, streamed tokens, stats, generator)."""
    gen = make(model, async_steps, **(kw or {}))
    streamed: dict[tuple[int, int], list[int]] = {}

    def on_token(req, k, tok):
        streamed.setdefault((req.id, k), []).append(tok)

    gen.on_token = on_token
    reqs = work(gen)
    for i in range(limit):
        if each_step is not None:
            each_step(gen, i)
        busy = gen.step()
        check(gen)
        if not busy:
            break
    else:
        pytest.fail("the generator did not finish")
    assert gen._flight is None and not gen.busy
    return reqs, streamed, dict(gen.stats), gen


def same(model, work, *, kw=None, each_step=None, chained=True):
    """The synchronous and asynchronous runs agree on everything observable."""
    a = serve(model, False, work, kw=kw, each_step=each_step)
    b = serve(model, True, work, kw=kw, each_step=each_step)
    ra, rb = a[0], b[0]
    assert [r.outputs for r in ra] == [r.outputs for r in rb]
    assert [r.finish_reasons for r in ra] == [r.finish_reasons for r in rb]
    assert a[1] == b[1]
    assert a[2] == b[2]
    assert a[3].ahead == 0
    print("mixed ahead", b[3].mixed_ahead, "of", b[3].ahead)
    if chained:
        assert b[3].ahead > 0                          # the asynchronous path ran
    return ra, b[3]


def adder(ps, sampling, streaming=True, **kw):
    def work(gen):
        cb = gen.on_token if streaming else None
        return [gen.add(p, sampling(i) if callable(sampling) else sampling, on_token=cb, **kw)
                for i, p in enumerate(ps)]
    return work


def test_greedy_outputs_streams_and_stats_are_the_synchronous_ones(model):
    reqs, gen = same(model, adder(prompts(1, 6), Sampling(max_new_tokens=12)))
    assert all(r.finish_reasons == ["length"] for r in reqs)
    assert gen.steady["plans"] > 0 and gen.steady["applied"] > 0
    p = gen.profile
    assert p["steps"] == gen.stats["steps"] and p["decode_steps"] > 0
    assert set(p["decode_host_ms"]) == {"schedule", "prepare", "forward", "sample", "wait", "update",
                                        "callbacks"}


@pytest.mark.parametrize("async_steps", [False, True])
def test_the_step_log_adds_up_to_the_profile(model, async_steps):
    gen = make(model, async_steps)
    log: list = []
    gen.step_log = log
    for p in prompts(2, 5):
        gen.add(p, Sampling(max_new_tokens=6))
    gen.run()
    p = gen.profile
    assert len(log) == p["steps"] == gen.stats["steps"]
    assert [k for k, _, _ in log].count("decode") == p["decode_steps"] > 0
    assert [k for k, _, _ in log].count("mixed") == p["mixed_steps"] > 0
    for kind in ("decode", "mixed"):
        for phase, ms in p[f"{kind}_host_ms"].items():
            got = sum(d[phase] for k, _, d in log if k == kind) * 1e3
            assert got == pytest.approx(ms, rel=1e-6, abs=1e-9)
    assert all(rows >= 1 for k, rows, _ in log if k == "decode")
    gen.step_log = None                       # off again: nothing more is recorded
    n, steps = len(log), p["steps"]
    gen.add(prompts(3, 1)[0], Sampling(max_new_tokens=2))
    gen.run()
    assert len(log) == n and gen.profile["steps"] > steps


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_rows_ending_by_length_keep_the_steady_path(model, prefix_cache):
    """Requests of different lengths, greedy and seeded, streamed and not: the plan made
    after a step leaves out the rows that step ends by length (filtering the steady record,
    not visiting the rows), the apply ends them itself, and the next plan (made before they
    ended) stays steady; once the last sampled row ended, the steps draw greedily. Everything
    observable equals the synchronous run."""
    sched_calls = {"less": 0, "foreseen": 0, "random_wrong": 0, "turned_greedy": 0}

    def sampling(i):                          # the longest request greedy
        return Sampling(max_new_tokens=3 + 2 * i, temperature=0.8 if i % 3 == 1 else 0.0, seed=i)

    def work(gen):
        sched = gen.scheduler
        less, drop = sched._steady_less, sched.drop_ended

        def counted_less(after, fast):
            plan = less(after, fast)
            sched_calls["less"] += plan is not None
            if plan is not None:
                sampled = any(s.job.req.sampling.temperature > 0 for s in plan.seqs)
                sched_calls["random_wrong"] += plan.spec.random != sampled
                sched_calls["turned_greedy"] += after.spec.random and not plan.spec.random
            return plan

        def counted_drop(plan):
            was = plan.fast.epoch if plan.fast is not None else None
            drop(plan)
            sched_calls["foreseen"] += was is not None and was != sched.epoch and \
                plan.fast.epoch == sched.epoch
        sched._steady_less, sched.drop_ended = counted_less, counted_drop
        return [gen.add(p, sampling(i), on_token=gen.on_token if i % 2 else None)
                for i, p in enumerate(prompts(4, 9))]

    reqs, gen = same(model, work, kw=dict(max_batch_tokens=64, prefix_cache=prefix_cache))
    assert [len(r.outputs[0]) for r in reqs] == [3 + 2 * i for i in range(9)]
    assert sched_calls["less"] >= 5 and sched_calls["foreseen"] >= 5
    assert sched_calls["random_wrong"] == 0 and sched_calls["turned_greedy"] >= 1
    assert gen.steady["declined"] == 0 and gen.steady["applied"] > 10


def test_rows_that_end_by_length_leave_from_the_end_and_the_rest_feed_on_without_a_gather(model):
    """Requests admitted shortest-lived last: the lean steps order their rows by the tokens
    each may still draw (most first), so the rows that end by length are the last ones and
    every later step feeds on from a prefix of the ids in flight (the same tensor, not a
    gather); the outputs are still the synchronous run's."""
    feeds = {"prefix": 0, "gathered": 0}

    def work(gen):
        real = gen._fed

        def fed(plan, after):
            out = real(plan, after)
            ids = after.draw.device_ids
            whole = out.data_ptr() == ids.data_ptr() and out.numel() <= ids.numel()
            if len(plan.seqs) < len(after.plan.spec):
                feeds["prefix" if whole else "gathered"] += 1
            return out

        gen._fed = fed
        feeds.update(prefix=0, gathered=0)
        return [gen.add(p, Sampling(max_new_tokens=4 + 3 * i)) for i, p in enumerate(prompts(5, 6))]

    reqs, gen = same(model, work, kw=dict(max_batch_tokens=64))
    assert [len(r.outputs[0]) for r in reqs] == [4 + 3 * i for i in range(6)]
    assert feeds["prefix"] >= 3 and feeds["gathered"] == 0
    assert gen.steady["applied"] > 5


def test_a_row_ending_in_the_middle_is_gathered_out(model):
    """A stop token ends a row that is not the last: the next step's rows feed through a
    gather of the ids in flight (the other rows' own slots), and the outputs are still the
    synchronous run's."""
    ps = prompts(6, 4)
    ref, _, _, _ = serve(model, False, adder(ps, Sampling(max_new_tokens=12)))
    feeds = {"prefix": 0, "gathered": 0}

    def work(gen):
        real = gen._fed

        def fed(plan, after):
            out = real(plan, after)
            if len(plan.seqs) < len(after.plan.spec):
                ids = after.draw.device_ids
                feeds["prefix" if out.data_ptr() == ids.data_ptr() else "gathered"] += 1
            return out

        gen._fed = fed
        feeds.update(prefix=0, gathered=0)
        stop = [ref[1].outputs[0][5]]
        return adder(ps, lambda i: Sampling(max_new_tokens=12, stop=stop if i == 1 else []))(gen)

    reqs, _ = same(model, work)
    assert reqs[1].finish_reasons == ["stop"] and len(reqs[1].outputs[0]) == 6
    assert feeds["gathered"] >= 1


def test_stop_tokens_drop_the_speculative_row(model):
    """Sequences that end on a stop token already have a row in the step launched after
    theirs: it is dropped (its cell freed), and nothing of it is delivered."""
    ps = prompts(2, 6)
    ref, _, _, _ = serve(model, False, adder(ps, Sampling(max_new_tokens=16)))
    stops = sorted({r.outputs[0][j] for r in ref for j in (3, 6, 9)})
    reqs, gen = same(model, adder(ps, lambda i: Sampling(max_new_tokens=16, stop=stops[i % len(stops):][:2])))
    assert any(r.finish_reasons == ["stop"] for r in reqs)
    assert gen.cache.live_seqs() == (gen.prefix.owned_seqs() if gen.prefix is not None else [])


def test_eos_and_without_streaming(model):
    ps = prompts(3, 5)
    ref, _, _, _ = serve(model, False, adder(ps, Sampling(max_new_tokens=12)))
    eos = [ref[0].outputs[0][4], ref[2].outputs[0][2]]
    reqs, gen = same(model, adder(ps, Sampling(max_new_tokens=12), streaming=False), kw=dict(eos=eos))
    assert any(r.finish_reasons == ["stop"] for r in reqs)
    # steady steps ran, and an eos drawn in one sent it to the general loop
    assert gen.steady["plans"] > 0 and gen.steady["applied"] > 0 and gen.steady["declined"] > 0


def test_seeded_sampling_and_forks(model):
    def sampling(i):
        return Sampling(max_new_tokens=10, temperature=0.8, top_k=50, top_p=0.9, seed=i,
                        n=3 if i % 2 else 1)
    reqs, _ = same(model, adder(prompts(4, 5), sampling))
    assert all(len(r.outputs) == r.sampling.n for r in reqs)


def test_drafts_fall_back_to_synchronous_steps(model):
    def draft(tokens, k):
        return [(tokens[-1] * 7 + 1) % VOCAB, tokens[-1]][:k]

    def work(gen):
        ps = prompts(5, 4)
        return [gen.add(p, Sampling(max_new_tokens=10), on_token=gen.on_token,
                        draft=draft if i == 1 else None, draft_k=2) for i, p in enumerate(ps)]
    same(model, work)


def test_arrivals_between_steps(model):
    ps = prompts(6, 9)
    box: dict = {}

    def work(gen):
        box["reqs"] = [gen.add(p, Sampling(max_new_tokens=9), on_token=gen.on_token) for p in ps[:3]]
        return box["reqs"]

    def each_step(gen, i):
        if i in (4, 9, 13) and len(box["reqs"]) < len(ps):
            j = len(box["reqs"])
            box["reqs"] += [gen.add(p, Sampling(max_new_tokens=9), on_token=gen.on_token)
                            for p in ps[j:j + 2]]

    a = serve(model, False, work, each_step=each_step)
    ra = [r.outputs for r in box["reqs"]]
    b = serve(model, True, work, each_step=each_step)
    assert [r.outputs for r in box["reqs"]] == ra and a[1] == b[1] and b[3].ahead > 0


def test_preemption(model):
    kw = dict(capacity=150, max_batch_tokens=16, prefill_chunk=7, reserve=0.0)
    reqs, gen = same(model, adder(prompts(7, 8, 5, 25), Sampling(max_new_tokens=14)), kw=kw)
    assert gen.stats["preempted"] > 0


def test_cancel_with_a_step_in_flight(model):
    """Cancelled between steps (a step in flight carries it) and from a callback."""
    box: dict = {}

    def work(gen):
        def on_token(req, k, tok):
            gen.on_token(req, k, tok)
            if req.id == 1 and len(req.outputs[0]) == 4:
                gen.cancel(box["reqs"][3])
        box["reqs"] = [gen.add(p, Sampling(max_new_tokens=12), on_token=on_token)
                       for p in prompts(8, 5)]
        return box["reqs"]

    def each_step(gen, i):
        r = box["reqs"][0]
        if len(r.outputs[0]) >= 4 and not r.done:     # (async: its next token is in flight)
            if gen._flight is not None:
                box["in_flight"] = any(s.req is r for s in gen._flight.plan.seqs)
            assert gen.cancel(r)

    a = serve(model, False, work, each_step=each_step)
    oa = [(r.outputs, r.finish_reasons) for r in box["reqs"]]
    b = serve(model, True, work, each_step=each_step)
    assert [(r.outputs, r.finish_reasons) for r in box["reqs"]] == oa and a[1] == b[1]
    assert oa[0][1] == ["cancelled"] and oa[3][1] == ["cancelled"] and b[3].ahead > 0
    assert len(oa[0][0][0]) == 4 and box["in_flight"]


def test_a_requests_own_failures(model):
    """on_token raising ends only its request, with or without a step in flight."""
    def run(async_steps):
        gen = make(model, async_steps)

        def bad(req, k, tok):
            if len(req.outputs[0]) == 3:
                raise ValueError("client gone")

        reqs = [gen.add(p, Sampling(max_new_tokens=10), on_token=bad if i == 1 else None)
                for i, p in enumerate(prompts(9, 5))]
        raised = []
        while True:
            try:
                if not gen.step():
                    break
            except (RuntimeError, ValueError) as e:
                raised.append(type(e).__name__)
            check(gen)
        return [(r.outputs, r.finish_reasons) for r in reqs], raised, gen

    a, ea, _ = run(False)
    b, eb, gen = run(True)
    assert a == b and ea == eb == ["ValueError"]
    assert b[1][1] == ["error"] and len(b[1][0][0]) == 3
    assert all(reasons == ["length"] for i, (_, reasons) in enumerate(b) if i != 1)


@pytest.mark.parametrize("where", ["prepare", "forward", "sample", "land"])
@pytest.mark.parametrize("exc", [RuntimeError("CUDA error: an illegal memory access"), KeyboardInterrupt()],
                         ids=["error", "interrupt"])
def test_a_failed_step_with_one_in_flight_rolls_both_back(model, where, exc):
    """A failure while the next step is launched on the one in flight, or while the one in
    flight lands: both are rolled back (every sequence back to the cells of its applied
    tokens, nothing delivered), the exception propagates, and stepping again ends with
    the synchronous run's tokens."""
    ps = prompts(10, 5)
    ref = serve(model, False, adder(ps, Sampling(max_new_tokens=12)))[0]
    gen = make(model, True)
    streamed: dict = {}
    gen.on_token = lambda req, k, tok: streamed.setdefault(req.id, []).append(tok)
    reqs = adder(ps, Sampling(max_new_tokens=12))(gen)
    while gen._flight is None or len(reqs[0].outputs[0]) < 3:
        gen.step()
    if where == "prepare":
        target, name = gen.cache, "prepare_step"
    elif where == "forward":
        target, name = gen.runner, "forward"
    elif where == "sample":
        target, name = gen.sampler, "launch"
    else:                                             # the copy of the ids in flight fails

        class Failing:
            device_ids = gen._flight.draw.device_ids

            def result(self):
                raise exc

        gen._flight.draw = Failing()
        target, name = None, ""
    real = getattr(target, name) if target is not None else None

    def failing(*a, **k):
        raise exc

    if target is not None:
        setattr(target, name, failing)
    outs = [list(r.outputs[0]) for r in reqs]
    with pytest.raises(type(exc)):
        gen.step()
    assert gen._flight is None
    check(gen)                                        # nothing in flight: pos == in_cache
    assert [r.outputs[0] for r in reqs] == outs
    if target is not None:
        setattr(target, name, real)
    while gen.step():
        check(gen)
    assert [r.outputs for r in reqs] == [r.outputs for r in ref]
    assert all(streamed[r.id] == r.outputs[0] for r in reqs)


def test_async_steps_is_checked_and_defaults_off_without_graphs(model):
    assert Generator(model, capacity=64, max_batch_tokens=16, eos=[]).async_steps is False
    with pytest.raises(InvalidArgument, match="async_steps"):
        Generator(model, capacity=64, max_batch_tokens=16, eos=[], async_steps="yes")


def test_model_runner_takes_device_tokens(model):
    """ModelRunner.forward(device_tokens=...) computes what forward(tokens) does, whole or
    for the first rows with host tokens for the rest; bad inputs are refused before
    anything runs (the input buffer unchanged)."""
    from cellcache.errors import InvalidArgument as Bad

    gen = Generator(model, capacity=64, max_batch_tokens=16, eos=[], prefix_cache=False)
    cache, runner = gen.cache, gen.runner
    ids = [5, 9, 77, 3]
    out = []
    for split in (None, 4, 1, 3):
        a = cache.seq_new()
        assert cache.declare_step([a] * len(ids))
        step = cache.prepare_step()
        if split is None:
            out.append(runner.forward(step, ids))
        else:
            device_tokens = torch.tensor(ids[:split])
            host = None if split == 4 else ids[split:]
            before = runner.input_ids.clone()
            bad_device = (torch.tensor(ids[:3]) if split == 4 else torch.tensor(ids),
                          torch.tensor(ids[:split], dtype=torch.float32), ids[:split])
            for bad in bad_device:
                with pytest.raises(Bad, match="device_tokens"):
                    runner.forward(step, host, device_tokens=bad)
            if host is not None:
                for bad_host in (ids[split:] + [1], [600] * len(host)):
                    with pytest.raises(Bad, match="tokens|vocabulary"):
                        runner.forward(step, bad_host, device_tokens=device_tokens)
            assert torch.equal(runner.input_ids, before)
            with pytest.raises(Bad, match="logits of type"):        # a bool, checked first
                runner.forward(step, host, device_tokens=device_tokens, logits="no")
            with pytest.raises(Bad, match="on of type"):
                runner.write_logits(1)
            assert torch.equal(runner.input_ids, before)
            out.append(runner.forward(step, host, device_tokens=device_tokens, logits=False))
        cache.commit_step()
        cache.seq_rm(a)
    for o in out[1:]:
        assert torch.equal(out[0], o)


def test_profile_serve_tool_runs(tmp_path, capsys):
    import json
    import runpy
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / "profile_serve.py"
    mod = runpy.run_path(str(path))
    before = list(sys.path)
    try:
        assert mod["main"](["--rows", "4", "--steps", "3", "--json", str(tmp_path / "p.json")]) == 0
        res = json.loads((tmp_path / "p.json").read_text())
        assert [r["mode"] for r in res] == ["sync", "async"] and all(r["decode_steps"] == 3 for r in res)
        assert "host" in capsys.readouterr().out
        # --stream: the callbacks phase carries each token's on_token call
        assert mod["main"](["--rows", "4", "--steps", "3", "--mode", "async", "--stream",
                            "--json", str(tmp_path / "s.json")]) == 0
        streamed = json.loads((tmp_path / "s.json").read_text())[0]
        assert streamed["stream"] is True and res[1]["stream"] is False
        assert streamed["decode_steps"] == 3 and streamed["us_per_step"]["callbacks"] > 0
        # 80 rows' prompts take two steps of 512 tokens: the second is a mixed step whose
        # decode rows are fed on the device beside the host's prompt ids (the stub's path)
        assert mod["main"](["--rows", "80", "--steps", "2", "--mode", "async",
                            "--json", str(tmp_path / "m.json")]) == 0
        assert json.loads((tmp_path / "m.json").read_text())[0]["decode_steps"] == 2
        for flag in ("--compile", "--native"):      # the real forward's options need the GPU's
            with pytest.raises(SystemExit) as e:
                mod["main"]([flag])
            assert e.value.code == 2 and "needs --device cuda" in capsys.readouterr().err
        # --kind mixed: 24 prompts of 512 read in 8,192-token steps (at least 2, the second
        # with the first's rows decoding beside the rest), every forward the stub's
        assert mod["main"](["--kind", "mixed", "--rows", "24", "--mode", "sync",
                            "--json", str(tmp_path / "x.json")]) == 0
        mixed = json.loads((tmp_path / "x.json").read_text())[0]
        assert mixed["kind"] == "mixed" and mixed["prompt_len"] == 512 and mixed["mixed_steps"] >= 2
        assert mixed["us_per_step"]["schedule"] > 0 and mixed["host_us_median"] > 0
        assert "us/mixed step" in capsys.readouterr().out
        with pytest.raises(SystemExit) as e:
            mod["main"](["--kind", "mixed", "--device", "cuda"])
        assert e.value.code == 2 and "--kind mixed runs on the CPU only" in capsys.readouterr().err
    finally:
        sys.path[:] = before


def test_requests_added_from_a_client_thread(model):
    """add() from another thread while this one steps asynchronously (the arrivals driver):
    whatever step each request joins at, its tokens are the synchronous run's."""
    from cellcache.generate import serve_arrivals

    ps = prompts(11, 8)
    sp = Sampling(max_new_tokens=10)
    ref = serve(model, False, adder(ps, sp))[0]
    gen = make(model, True)
    reqs = serve_arrivals(gen, ps, [0.002 * i for i in range(len(ps))], sp)
    assert [r.outputs for r in reqs] == [r.outputs for r in ref]
    assert gen._flight is None and not gen.busy


# -- Ctrl-C at the narrow points between launching, applying and delivering a step ----------------

_PS = [[1, 2, 3], [5, 6, 7, 8], [9, 10]]
_SP = [Sampling(max_new_tokens=m) for m in (5, 8, 6)]


def _small(model, async_steps, **kw):
    return Generator(model, capacity=256, max_batch_tokens=32, max_seqs=8, prefill_chunk=8,
                     eos=[], async_steps=async_steps, **kw)


def _interrupt_at_clock_call(monkeypatch, k):
    """Ctrl-C arriving at the engine's k-th ``time.perf_counter()`` call from now."""
    import time as real_time
    import types

    import cellcache.generate.engine as engine

    n = [0]

    def perf_counter():
        n[0] += 1
        if n[0] == k:
            raise KeyboardInterrupt
        return real_time.perf_counter()

    monkeypatch.setattr(engine, "time", types.SimpleNamespace(perf_counter=perf_counter))
    return lambda: monkeypatch.setattr(engine, "time", real_time)


@pytest.mark.parametrize("async_steps", [False, True])
def test_ctrl_c_anywhere_in_a_step_keeps_outputs_streams_and_cells(model, monkeypatch, async_steps):
    """A KeyboardInterrupt at every clock read of a step in turn (the first lines of landing
    a step, between applying it and its callbacks, ...): the step goes back or its tokens
    are kept for delivery, the cache holds what the generator believes, and the run ends
    with the synchronous outputs, every token streamed once and in order."""
    ref = _small(model, False)
    refs = [ref.add(p, s) for p, s in zip(_PS, _SP)]
    ref.run()
    for k in range(1, 16):
        gen = _small(model, async_steps)
        streamed: dict[int, list[int]] = {}
        rs = [gen.add(p, s, on_token=lambda r, i, t, out=streamed: out.setdefault(r.id, []).append(t))
              for p, s in zip(_PS, _SP)]
        for _ in range(3):
            gen.step()
        restore = _interrupt_at_clock_call(monkeypatch, k)
        try:
            gen.step()
        except KeyboardInterrupt:
            pass
        restore()
        check(gen)
        while gen.step():
            check(gen)
        assert [r.outputs for r in rs] == [r.outputs for r in refs], k
        assert [streamed.get(r.id) for r in rs] == [r.outputs[0] for r in rs], k


def test_a_refused_async_steps_leaves_the_model_as_it_was():
    m = random_model("llama-tiny", seed=3)
    with pytest.raises(InvalidArgument, match="async_steps of type str"):
        Generator(m, capacity=64, max_batch_tokens=16, eos=[], async_steps="yes")
    assert m.config._attn_implementation != "cellcache"


def test_ctrl_c_in_on_event_while_cancelling_still_ends_the_request():
    """A BaseException from the prefix cache's on_event while cancel() stores the
    sequence: it propagates, and the request is still ended with its cells and id freed."""
    m = random_model("llama-tiny", seed=3)
    fire = []

    def on_event(ev):
        if fire:
            fire.clear()
            raise KeyboardInterrupt

    gen = _small(m, False, prefix_cache={"on_event": on_event})
    r = gen.add([1, 2, 3, 4], Sampling(max_new_tokens=8))
    for _ in range(3):
        gen.step()
    fire.append(1)
    with pytest.raises(KeyboardInterrupt):
        gen.cancel(r)
    gen.run()
    assert r.done and r.finish_reasons == ["cancelled"]
    assert len(gen.cache.live_seqs()) == gen.prefix.metrics()["leaves"]     # only the tree's
    gen.cache.check_invariants()


def test_a_ctrl_c_in_on_event_is_raised_before_a_requests_error_of_the_same_step():
    """A step where a request's on_token raises ValueError and the prefix cache's on_event
    raises KeyboardInterrupt raises the interrupt (the request's error stays its own)."""
    m = random_model("llama-tiny", seed=3)
    fired = []

    def on_event(ev):
        if ev.kind == "stored" and "event" not in fired:
            fired.append("event")
            raise KeyboardInterrupt

    def on_token(req, k, tok):
        if "token" not in fired:                 # the first token: the step storing the prompt
            fired.append("token")
            raise ValueError("the request's own")

    gen = _small(m, False, prefix_cache={"on_event": on_event})
    r = gen.add([1, 2, 3, 4], Sampling(max_new_tokens=8), on_token=on_token)
    with pytest.raises(KeyboardInterrupt):
        while gen.step():
            pass
    assert fired == ["event", "token"]               # one step: both raised in it
    gen.run()
    assert r.done and isinstance(r.error, ValueError) and "error" in r.finish_reasons
    gen.cache.check_invariants()


def test_warmup_runs_one_step_per_bucket_and_leaves_the_cache_as_it_was(model, monkeypatch):
    """``warmup()`` (the graphs captured before serving; tests/gpu checks the graphs
    themselves): on the CPU it captures nothing; with graphs (forced here, the forward
    recorded) it runs one padded step per reachable bucket of fresh sequences (decode
    buckets: one-token sequences; mixed buckets: one sequence's prompt chunk) and frees
    them; a failing forward frees them too and changes nothing; refusals change nothing."""
    from cellcache.errors import InvalidState

    gen = Generator(model, capacity=256, max_batch_tokens=32, max_seqs=6, eos=[], prefix_cache=False)
    cache, runner = gen.cache, gen.runner
    assert runner.mixed_buckets == [16, 32]
    assert gen.warmup() == {"decode": [], "mixed": []}          # no graphs on the CPU
    before = (cache.free_cells, cache.live_seqs(), cache.table.declared_width)
    for bad in ([3], [64], "8", [0]):
        with pytest.raises(InvalidArgument, match="width"):
            gen.warmup(bad)
    with pytest.raises(InvalidArgument, match="mixed"):
        gen.warmup([], [8])
    assert (cache.free_cells, cache.live_seqs(), cache.table.declared_width) == before
    seen = []

    def forward(step, tokens=None, logit_rows=None, decode=False, *, device_tokens=None, logits=True):
        seen.append((step.width, step.pad_to, decode, len(cache.live_seqs()),
                     None if logit_rows is None else list(logit_rows)))
        if fail:
            raise RuntimeError("capture failed")
        return torch.zeros((step.width, 8))

    monkeypatch.setattr(runner, "cuda", True)
    monkeypatch.setattr(runner, "graphs_enabled", True)
    monkeypatch.setattr(runner, "forward", forward)
    free = cache.free_cells
    fail = False
    # decode: up to the bucket of max_seqs=6 rows; mixed: every token bucket
    assert gen.warmup() == {"decode": [1, 2, 4, 8], "mixed": [16, 32]}
    # the steps needing the most cells first (a growth that moves the pools drops graphs)
    assert seen == [(32, 32, False, 1, [31]), (16, 16, False, 1, [15]), (6, 8, True, 6, None),
                    (4, 4, True, 4, None), (2, 2, True, 2, None), (1, 1, True, 1, None)]
    assert cache.live_seqs() == [] and cache.free_cells == free and cache.prepared_step is None
    cache.check_invariants()
    seen.clear()
    assert gen.warmup([2], []) == {"decode": [2], "mixed": []} and len(seen) == 1
    fail = True
    for args in (([4], []), ([], [16])):
        with pytest.raises(RuntimeError, match="capture failed"):
            gen.warmup(*args)
        assert cache.live_seqs() == [] and cache.free_cells == free and cache.prepared_step is None
        cache.check_invariants()
    fail = False
    other = cache.seq_new()                           # another user of the cache declared a step
    assert cache.declare_step([other])
    seen.clear()
    with pytest.raises(InvalidState, match="declared or prepared"):
        gen.warmup()
    assert seen == [] and cache.table.declared_width == 1 and cache.live_seqs() == [other]
    cache.undeclare()
    cache.seq_rm(other)
    gen.add([1, 2, 3], Sampling(max_new_tokens=2))
    seen.clear()
    with pytest.raises(InvalidState, match="queued or running"):
        gen.warmup()
    assert seen == [] and len(gen.waiting) == 1


def test_mixed_steps_are_padded_only_to_a_graph_that_gives_their_logit_rows(model, monkeypatch):
    """A mixed step is padded to a token bucket only when that bucket's graph gives all its
    logit rows (``min(bucket, logit_cap)``); otherwise it runs eagerly at its own width. A
    mixed graph's capture uses the prefill kernels even for a step of one row a run."""
    import dataclasses

    from cellcache import torch as cct

    gen = Generator(model, capacity=256, max_batch_tokens=32, max_seqs=6, eos=[], prefix_cache=False)
    runner = gen.runner
    assert runner.mixed_bucket(5) is None                  # no graphs on the CPU
    monkeypatch.setattr(runner, "graphs_enabled", True)
    assert runner.mixed_buckets == [16, 32] and runner.logit_cap == 32
    assert runner.mixed_bucket(5) == 16 and runner.mixed_bucket(5, 5) == 16
    assert runner.mixed_bucket(17, 16) == 32 and runner.mixed_bucket(33) is None
    monkeypatch.setattr(runner, "logit_cap", 8)
    assert runner.mixed_bucket(20, 8) == 32 and runner.mixed_bucket(20, 9) is None
    assert runner.mixed_bucket(5, 9) is None               # more than the 16-row graph gives
    cache = gen.cache
    a, b = cache.seq_new(), cache.seq_new()
    assert cache.declare_step([a, b])
    step = dataclasses.replace(cache.prepare_step(), n_runs=2)   # (the paged view's count)
    assert cct._decode_step(step)                          # one row a run
    token = cct.MIXED_CAPTURE.set(True)
    try:
        assert not cct._decode_step(step)
    finally:
        cct.MIXED_CAPTURE.reset(token)
    assert cct._decode_step(step)
    cache.commit_step()


# -- general (mixed) steps launched ahead: prompt chunks and admissions behind a step in flight --

def _arrivals(ps, sampling, every=2, per=2, **kw):
    """``work`` and ``each_step`` for :func:`serve`: the first ``per`` prompts at once, then
    ``per`` more every ``every`` steps (each admitted while a step is in flight)."""
    box: dict = {"reqs": []}

    def add(gen, chunk):
        for i, p in enumerate(chunk, len(box["reqs"])):
            box["reqs"].append(gen.add(p, sampling(i) if callable(sampling) else sampling,
                                       on_token=gen.on_token, **kw))

    def work(gen):
        box["reqs"] = []
        add(gen, ps[:per])
        return box["reqs"]

    def each_step(gen, i):
        j = len(box["reqs"])
        if i % every == every - 1 and j < len(ps):
            add(gen, ps[j:j + per])

    return box, work, each_step


MIXED = dict(max_batch_tokens=24, prefill_chunk=6)   # prompts of 8-30 tokens take chunks


def same_mixed(model, sampling, *, kw=None, n=14, seed=21, arrivals=False, lengths=(8, 30),
               counters=True, **add_kw):
    """Chunked prompts admitted a few at a time (all added at once, or ``arrivals``: two
    every other call), synchronous and asynchronous: outputs, finish reasons and streams
    are equal, general steps were launched ahead of the step in flight, and (``counters``)
    so are the counters: the same steps, rows and admissions."""
    ps = prompts(seed, n, *lengths)
    opts = dict(MIXED, **(kw or {}))
    box, work, each_step = _arrivals(ps, sampling, 2 if arrivals else 10 ** 6, 2 if arrivals else n,
                                     **add_kw)
    a = serve(model, False, work, kw=opts, each_step=each_step)
    ra = list(box["reqs"])
    b = serve(model, True, work, kw=opts, each_step=each_step)
    rb = list(box["reqs"])
    assert [r.outputs for r in ra] == [r.outputs for r in rb]
    assert [r.finish_reasons for r in ra] == [r.finish_reasons for r in rb]
    assert a[1] == b[1]                                # every token streamed, in order
    if counters:
        assert a[2] == b[2]                            # the same steps, rows and admissions
    assert b[3].mixed_ahead >= 4, b[3].mixed_ahead     # prompt chunks launched ahead
    return ra, rb, b[3]


@pytest.mark.parametrize("arrivals", [False, True])
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_mixed_steps_are_launched_ahead_with_the_synchronous_outcome(model, prefix_cache, arrivals):
    """Requests admitted while others decode, their prompts read in chunks: the step with
    their chunks is planned and launched before the step in flight lands (its decode rows
    fed on the device), and outputs, streams (and counters) equal the synchronous run's."""
    _, rb, gen = same_mixed(model, lambda i: Sampling(max_new_tokens=6 + i % 5),
                            kw=dict(prefix_cache=prefix_cache), arrivals=arrivals)
    assert all(r.finish_reasons == ["length"] for r in rb)
    p = gen.profile
    assert p["mixed_steps"] > 0 and p["decode_steps"] > 0


def test_mixed_steps_ahead_with_seeded_sampling_knobs_and_logprobs(model):
    """The slots of a step planned ahead draw at the token numbers the step in flight
    leaves (seeded sampling keyed by them), ``min_new_tokens`` bans by them, and the
    log-probabilities recorded equal the synchronous run's."""
    def sampling(i):
        return Sampling(max_new_tokens=8, temperature=0.9, top_k=40, seed=100 + i,
                        min_new_tokens=3 if i % 3 == 0 else 0, min_p=0.05 if i % 2 else 0.0,
                        logprobs=2 if i % 2 else None)
    ra, rb, _ = same_mixed(model, sampling)
    for x, y in zip(ra, rb):
        if x.sampling.logprobs is not None:
            assert len(y.logprobs[0]) == len(y.outputs[0]) == len(x.logprobs[0])
            for e, f in zip(x.logprobs[0], y.logprobs[0]):    # (rows in another order: ulps)
                assert e.token == f.token and [t for t, _ in e.top] == [t for t, _ in f.top]
                assert e.logprob == pytest.approx(f.logprob, abs=1e-5)


def test_mixed_steps_ahead_with_stop_tokens_in_flight(model):
    """A sequence that ends on a stop token in the step in flight already has its decode
    row in the general step launched after it: the row is dropped (its cell freed, nothing
    delivered), as with lean steps."""
    ps = prompts(21, 14, 8, 30)
    box, work, each_step = _arrivals(ps, Sampling(max_new_tokens=12))
    serve(model, False, work, kw=MIXED, each_step=each_step)
    stops = sorted({r.outputs[0][j] for r in box["reqs"] for j in (2, 5)})
    ra, rb, gen = same_mixed(model, lambda i: Sampling(max_new_tokens=12, stop=stops[i % len(stops):][:3]),
                             arrivals=True)
    assert sum(r.finish_reasons == ["stop"] for r in rb) >= 2
    assert gen.cache.live_seqs() == (gen.prefix.owned_seqs() if gen.prefix is not None else [])


def test_mixed_steps_ahead_when_memory_is_short(model):
    """A cache too small for every request at once (preemption, admissions waiting for
    room) and stop tokens: outputs and streams are the synchronous run's. The counters may
    differ: a row that ends on a stop token in the step in flight still holds its room when
    the step after it is planned, where the synchronous step would admit into it."""
    stops = [3, 77, 151, 260, 402]
    _, rb, gen = same_mixed(model, lambda i: Sampling(max_new_tokens=12, stop=stops[i % 5:][:2]),
                            kw=dict(capacity=160, reserve=0.0), counters=False)
    assert gen.stats["preempted"] > 0 and any(r.finish_reasons == ["stop"] for r in rb)


def test_a_step_that_draws_nothing_is_followed_ahead(model):
    """Long prompts filling whole steps with chunks: a step in flight that draws nothing
    (no ids on the device) is followed by a step planned ahead that feeds only host ids."""
    def count(gen):
        sampler = gen.sampler
        real = sampler.launch

        def launch(logits, spec, *a):
            gen.empty += len(spec) == 0 and not spec.prompt_rows
            return real(logits, spec, *a)
        gen.empty = 0
        sampler.launch = launch

    opts = dict(max_batch_tokens=16, prefill_chunk=8)
    ps = prompts(25, 6, 40, 60)
    runs = []
    for async_steps in (False, True):
        gen = make(model, async_steps, **opts)
        count(gen)
        reqs = [gen.add(p, Sampling(max_new_tokens=5)) for p in ps]
        while gen.step():
            check(gen)
        runs.append(([r.outputs for r in reqs], dict(gen.stats), gen.empty, gen.mixed_ahead))
    (out_a, st_a, empty_a, _), (out_b, st_b, empty_b, mixed) = runs
    assert out_a == out_b and st_a == st_b
    assert empty_a == empty_b >= 3 and mixed >= 3


def test_mixed_steps_ahead_with_forks(model):
    """A request with ``n > 1`` whose prompt ends in a step launched ahead forks when it
    lands; a step that forks is not left in flight (the next one is planned after it)."""
    same_mixed(model, lambda i: Sampling(max_new_tokens=7, temperature=0.7, seed=i, n=2 if i % 3 == 1 else 1))


def test_on_logits_contexts_of_mixed_steps_ahead(model):
    """``on_logits`` of a general step planned ahead gives every row's context as its
    length (its rows' last tokens are on the device); once resolved (LogitsTap), the
    contexts and their logits are the synchronous run's, row for row."""
    from cellcache.generate.agreement import LogitsTap

    ps = prompts(22, 10, 8, 30)
    got = []
    for async_steps in (False, True):
        box, work, each_step = _arrivals(ps, Sampling(max_new_tokens=6))
        gen = make(model, async_steps, **MIXED)
        gen.on_token = None
        with LogitsTap(gen) as tap:
            work(gen)
            i = 0
            while gen.step() or gen.waiting:
                each_step(gen, i)
                i += 1
            each_step(gen, i)
            while gen.step():
                pass
        rows = {(r.request.id, r.k, r.context): r.logits for r in tap.rows()}
        got.append((rows, gen.mixed_ahead))
    (sync_rows, _), (async_rows, mixed) = got
    assert mixed >= 3
    assert sync_rows.keys() == async_rows.keys()
    for key, logits in sync_rows.items():
        assert torch.allclose(logits, async_rows[key], rtol=0, atol=1e-4), key   # (batch shapes)


def test_cancel_while_a_mixed_step_is_in_flight(model):
    """A request cancelled while the general step in flight carries its prompt chunk, and
    one cancelled while a step planned ahead of that one carries its first decode row: both
    end "cancelled" with nothing more delivered, their cells freed, and the others' outputs
    are the synchronous run's."""
    ps = prompts(23, 12, 8, 30)
    results = []
    for async_steps in (False, True):
        box, work, each_step = _arrivals(ps, Sampling(max_new_tokens=9))
        cancelled: list = []

        def each(gen, i, box=box, each_step=each_step, cancelled=cancelled):
            each_step(gen, i)
            if i in (3, 7, 11) and len(box["reqs"]) > 2:
                r = box["reqs"][-1] if i != 7 else box["reqs"][-3]
                if not r.done and gen.cancel(r):
                    cancelled.append(r.id)
        _, streamed, _, gen = serve(model, async_steps, work, kw=MIXED, each_step=each)
        results.append(([(r.outputs, r.finish_reasons) for r in box["reqs"]], streamed, cancelled,
                        gen.mixed_ahead))
        assert gen.cache.live_seqs() == (gen.prefix.owned_seqs() if gen.prefix is not None else [])
    (oa, sa, ca, _), (ob, sb, cb, mixed) = results
    assert ca == cb and len(ca) >= 2 and mixed >= 3
    for (out_a, why_a), (out_b, why_b) in zip(oa, ob):
        if why_a == ["cancelled"]:
            assert why_b == ["cancelled"]
            assert out_b[0] == out_a[0][:len(out_b[0])]   # (async: a token in flight is lost)
        else:
            assert (out_a, why_a) == (out_b, why_b)


@pytest.mark.parametrize("where", ["forward", "land"])
def test_a_failed_mixed_step_ahead_rolls_both_back(model, where):
    """A failure launching a general step on the one in flight, or landing the one in flight
    under it: both go back (admissions requeued in their order, every sequence back to its
    applied tokens), and stepping again ends with the synchronous run's tokens."""
    ps = prompts(24, 10, 8, 30)
    box, work, each_step = _arrivals(ps, Sampling(max_new_tokens=8))
    serve(model, False, work, kw=MIXED, each_step=each_step)
    ref = [r.outputs for r in box["reqs"]]
    box, work, each_step = _arrivals(ps, Sampling(max_new_tokens=8))
    gen = make(model, True, **MIXED)
    streamed: dict = {}
    gen.on_token = lambda req, k, tok: streamed.setdefault(req.id, []).append(tok)
    work(gen)
    real = gen.runner.forward
    fired = []

    def forward(step, tokens=None, logit_rows=None, decode=False, *, device_tokens=None, logits=True):
        if not fired and tokens is not None and device_tokens is not None:
            fired.append(1)
            if where == "forward":
                raise RuntimeError("CUDA error: an illegal memory access")
            flight = gen._flight

            class Failing:
                device_ids = flight.draw.device_ids

                def result(self):
                    raise RuntimeError("the copy failed")
            flight.draw = Failing()
        return real(step, tokens, logit_rows, decode, device_tokens=device_tokens, logits=logits)

    gen.runner.forward = forward
    i = 0
    while not fired:
        each_step(gen, i)
        i += 1
        waiting = [s.req.id for s in gen.waiting]
        try:
            gen.step()
        except RuntimeError:
            assert fired and gen._flight is None
            check(gen)
            # the step in flight's admissions and the ahead step's: back, in their order
            ids = [s.req.id for s in gen.waiting]
            assert ids == sorted(ids) and set(waiting) <= set(ids)
            break
        check(gen)
    assert fired
    gen.runner.forward = real
    while gen.step() or len(box["reqs"]) < len(ps):
        each_step(gen, i)
        i += 1
        check(gen)
    assert [r.outputs for r in box["reqs"]] == ref
    assert all(streamed[r.id] == r.outputs[0] for r in box["reqs"])


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_every_step_but_the_first_of_each_kind_is_launched_ahead(model, prefix_cache):
    """Requests all together, prompts admitted over several steps: every mixed step but the
    first is planned and launched while the one before is in flight, and every decode step
    but the first (behind the last mixed step); the profile counts them."""
    gen = make(model, True, capacity=64 * 96, max_batch_tokens=256, max_seqs=64,
               prefill_chunk=64, prefix_cache=prefix_cache)
    for p in prompts(26, 32, 40, 64):
        gen.add(p, Sampling(max_new_tokens=10))
    gen.run()
    p = gen.profile
    assert p["mixed_steps"] >= 4 and p["decode_steps"] >= 5
    assert p["mixed_ahead_steps"] == p["mixed_steps"] - 1
    assert p["decode_ahead_steps"] == p["decode_steps"] - 1
    assert p["mixed_ahead_steps"] + p["decode_ahead_steps"] == gen.ahead


def test_a_cancelled_admission_stays_ended_when_its_step_is_rolled_back(model):
    """A request admitted by the general step in flight, cancelled before it lands, whose
    landing then fails: the rollback does not requeue it (it ended "cancelled" and keeps
    that); the others end as the synchronous run's."""
    ps = prompts(24, 6, 8, 30)
    ref = serve(model, False, adder(ps[:4], Sampling(max_new_tokens=8)), kw=MIXED)[0]
    gen = make(model, True, **MIXED)
    reqs = [gen.add(p, Sampling(max_new_tokens=8)) for p in ps[:2]]
    victim = None
    for i in range(40):
        if i == 3:
            reqs += [gen.add(p, Sampling(max_new_tokens=8)) for p in ps[2:4]]
        gen.step()
        check(gen)
        f = gen._flight
        if f is not None and f.plan.ahead and not f.plan.lean and f.plan.admitted:
            victim = f.plan.admitted[-1]
            break
    assert victim is not None
    assert gen.cancel(victim.req) and victim.req.finish_reasons == ["cancelled"]

    class Failing:
        device_ids = gen._flight.draw.device_ids

        def result(self):
            raise RuntimeError("the copy failed")

    gen._flight.draw = Failing()
    with pytest.raises(RuntimeError, match="the copy failed"):
        gen.step()
    check(gen)
    assert all(s.req is not victim.req for s in gen.waiting + gen.running)
    while gen.step():
        check(gen)
    assert victim.req.finish_reasons == ["cancelled"] and victim.sid is None
    for r, want in zip(reqs, ref):
        if r is not victim.req:
            assert r.outputs == want.outputs and r.finish_reasons == ["length"]
    assert gen.cache.live_seqs() == (gen.prefix.owned_seqs() if gen.prefix is not None else [])


@pytest.mark.parametrize("why", ["penalties", "host tier"])
def test_a_declined_plan_ahead_lets_the_step_land_and_admits_then(model, why):
    """A request arriving while others decode, where the step after the one in flight
    cannot be planned ahead (a running request with penalties; the prefix cache's host
    level): the step in flight lands and the next one, planned in the same call, admits it,
    one call after the synchronous run (the one call outputs lag)."""
    ps = prompts(5, 3)
    firsts, outs = [], []
    for async_steps in (False, True):
        kw = dict(spill_prefixes=True, spill_bytes=1 << 24) if why == "host tier" else {}
        gen = make(model, async_steps, **kw)
        pen = Sampling(max_new_tokens=40, repetition_penalty=1.2) if why == "penalties" else \
            Sampling(max_new_tokens=40)
        running = [gen.add(ps[0], pen), gen.add(ps[1], Sampling(max_new_tokens=40))]
        for _ in range(4):
            gen.step()
            check(gen)
        late = gen.add(ps[2], Sampling(max_new_tokens=5))
        calls, first = 0, None
        while gen.step():
            check(gen)
            calls += 1
            if first is None and late.outputs[0]:
                first = calls
        firsts.append(first)
        outs.append([r.outputs for r in running + [late]])
    assert outs[0] == outs[1]
    assert firsts[1] <= firsts[0] + 1, firsts              # (the one call outputs lag)


def test_an_admission_waits_for_a_prompt_the_step_in_flight_completes(model):
    """A prompt P read by the step in flight (its only draw ends it by length) and a request
    extending P: the step after is not planned ahead (nothing of P is in the prefix cache
    yet), so the request is admitted once P is stored and its hit is the synchronous one."""
    P = prompts(5, 1, 20, 21)[0]
    W = P + [7, 8, 9, 10, 11]

    def work(gen):
        return [gen.add(P, Sampling(max_new_tokens=1), on_token=gen.on_token),
                gen.add(W, Sampling(max_new_tokens=3), on_token=gen.on_token)]
    kw = dict(max_batch_tokens=24, prefill_chunk=8, prefix_cache=True)
    a = serve(model, False, work, kw=kw)
    b = serve(model, True, work, kw=kw)
    assert [r.outputs for r in a[0]] == [r.outputs for r in b[0]] and a[2] == b[2]
    assert b[0][1].cached_tokens == a[0][1].cached_tokens >= 16


def test_max_running_does_not_count_rows_ending_by_length_in_flight(model):
    """``max_running`` reached, one running request ending by length in the step in flight:
    the step planned ahead admits the next request into its place, as the synchronous step
    planned after it would (the same steps and counters)."""
    same_mixed(model, lambda i: Sampling(max_new_tokens=2 + i % 4), kw=dict(max_seqs=2))


def test_computed_tokens_of_a_step_carrying_a_cancelled_row(model):
    """A request cancelled while a step carrying its row is in flight: that row counts in
    ``tokens_in`` (documented) but never as a computed prompt token, so every prompt token
    is counted once (``prompt_tokens == cached + computed``)."""
    box: dict = {}

    def work(gen):
        box["reqs"] = [gen.add(p, Sampling(max_new_tokens=10), on_token=gen.on_token)
                       for p in prompts(8, 6, 8, 30)]
        return box["reqs"]

    def each_step(gen, i):
        if i == 4 and not box["reqs"][1].done:
            gen.cancel(box["reqs"][1])
    for async_steps in (False, True):
        _, _, st, _ = serve(model, async_steps, work, kw=MIXED, each_step=each_step)
        assert st["prompt_tokens"] == st["cached_tokens"] + st["computed_tokens"], st


@pytest.mark.parametrize("max_seqs", [16, 3])
def test_requests_that_draw_nothing_are_read_ahead_with_the_synchronous_outcome(model, max_seqs):
    """Requests with max_new_tokens 0 (some with prompt log-probabilities) among requests
    that draw, arriving while others decode: their chunks go in steps launched ahead, each
    ends with "length" and no tokens when the step that completes its prompt lands, and
    outputs, streams, counters and prompt log-probabilities are the synchronous run's. With
    few sequences at once (``max_seqs``), a step planned ahead admits into the place of a
    request whose prompt the step in flight completes, as the synchronous step does."""
    def sampling(i):
        return Sampling(max_new_tokens=0 if i % 3 == 0 else 6, prompt_logprobs=1 if i % 2 == 0 else None)
    ra, rb, gen = same_mixed(model, sampling, arrivals=True, kw=dict(max_seqs=max_seqs))
    zero = [(x, y) for x, y in zip(ra, rb) if x.sampling.max_new_tokens == 0]
    assert len(zero) == 5
    for x, y in zero:
        assert x.outputs == y.outputs == [[]] and y.finish_reasons == ["length"] and y.first_token is None
        if x.sampling.prompt_logprobs is not None:
            for e, f in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):   # (rows in another order)
                assert e.token == f.token and e.logprob == pytest.approx(f.logprob, abs=1e-5)
    assert gen.stats["tokens_out"] == sum(len(r.outputs[0]) for r in rb) == 6 * 9


def test_preemption_with_requests_that_draw_nothing(model):
    """Preemption among requests that draw nothing and requests that do (reserve 0, a small
    cache): the same outcome with asynchronous steps as without."""
    kw = dict(capacity=120, max_batch_tokens=16, prefill_chunk=7, reserve=0.0)
    reqs, gen = same(model, adder(prompts(7, 8, 5, 25), lambda i: Sampling(max_new_tokens=0 if i % 2 else 24,
                                                                          prompt_logprobs=0)), kw=kw)
    assert gen.stats["preempted"] > 0
    assert [r.finish_reasons for r in reqs] == [["length"]] * 8
    assert [len(r.outputs[0]) for r in reqs] == [24, 0] * 4
    assert all(None not in r.prompt_logprobs[1:] for r in reqs)


@pytest.mark.parametrize("async_steps", [False, True])
def test_the_float32_logits_are_asked_for_only_where_the_draws_read_them(model, async_steps):
    """A replayed step whose draws are each row's own argmax needs only the graph's greedy
    ids, so the generator calls ``forward(logits=False)`` then; a step with a sampled row,
    a server knob or prompt log-probabilities, or with an ``on_logits`` tap, asks for the
    logits. Greedy requests alone: every step without; the tap: every step with; one
    sampled request (or one asking for log-probabilities) beside them: at least each of
    the 20 steps that draw its tokens with."""
    def run(samplings, tap=False):
        gen = make(model, async_steps)
        asked = []
        real = gen.runner.forward

        def forward(step, tokens=None, logit_rows=None, decode=False, *, device_tokens=None, logits=True):
            asked.append(logits)
            return real(step, tokens, logit_rows, decode, device_tokens=device_tokens, logits=logits)

        gen.runner.forward = forward
        if tap:
            gen.on_logits = lambda rows, logits: None
        reqs = [gen.add(p, s) for p, s in zip(prompts(7, 5), samplings)]
        gen.run()
        return asked, [r.outputs for r in reqs]

    greedy = [Sampling(max_new_tokens=6 + i) for i in range(5)]
    asked, outs = run(greedy)
    assert asked and not any(asked)
    tapped, tapped_outs = run(greedy, tap=True)
    assert set(tapped) == {True} and tapped_outs == outs
    for odd in (Sampling(max_new_tokens=20, temperature=0.8, seed=1),
                Sampling(max_new_tokens=20, logprobs=2)):
        asked = run(greedy[:4] + [odd])[0]
        assert sum(asked) >= 20 and not all(asked)            # (prompt chunks without its row)
