"""The lean decode steps without a model: ``schedule_decode`` (after a plan in flight or
not), ``apply_decode``, ``drop_ended`` and the steady records and held tokens behind them,
driven with the fake model of ``test_scheduler_fakes`` as the asynchronous Generator drives
them. Every read of a request between steps sees every applied token; rows end by length,
by an end-of-sequence id or by their own stop tokens at any step; a cancel or a rollback
between steps leaves the cache holding what the scheduler believes."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from cellcache.generate import Sampling  # noqa: E402
from cellcache.generate.base import BaseScheduler  # noqa: E402

from .test_scheduler_fakes import Client, Driver, check, make, prompts, rollout  # noqa: E402


def serve(specs, ahead=True, lean=True, eos=(), prefix=False, **kw):
    """Serves ``specs`` ((prompt, Sampling) pairs) to the end; returns (requests, driver)."""
    sched = make(eos=set(eos), prefix=prefix, **kw)
    c = Client(sched)
    reqs = [c.add(p, sp) for p, sp in specs]
    return reqs, Driver(sched, lean=lean, ahead=ahead).run()


def key(events):
    return [(job.req.id, k, tok) for job, k, tok in events]


def test_steady_steps_draw_what_the_rollout_draws():
    ps = prompts(11, 6)
    reqs, d = serve([(p, Sampling(max_new_tokens=40)) for p in ps])
    assert [r.outputs[0] for r in reqs] == [rollout(p, 40) for p in ps]
    assert all(r.finish_reasons == ["length"] and r.finished is not None for r in reqs)
    assert all(len(r.token_times[0]) == 40 for r in reqs)
    steady = [p for p in d.plans if p.fast is not None]
    assert len(steady) >= 30                          # the run was mostly steady steps
    assert d.sched.stats["tokens_out"] == 6 * 40 == len(d.events)
    assert d.sched.cache.live_seqs() == []


def test_asynchronous_and_synchronous_steps_agree_event_by_event():
    specs = [(p, Sampling(max_new_tokens=30 - 4 * i)) for i, p in enumerate(prompts(12, 5))]
    runs = [serve(specs, ahead=a, lean=lean) for a, lean in ((False, False), (False, True), (True, True))]
    outs = [[r.outputs for r in reqs] for reqs, _ in runs]
    assert outs[0] == outs[1] == outs[2] == [[rollout(p, sp.max_new_tokens)] for p, sp in specs]
    # the same tokens delivered in the same order (callbacks run in one order either way)
    assert key(runs[0][1].events) == key(runs[1][1].events) == key(runs[2][1].events)
    assert [r.finish_reasons for r in runs[2][0]] == [["length"]] * 5
    stats = [d.sched.stats for _, d in runs]
    assert all(s["tokens_out"] == stats[0]["tokens_out"] for s in stats)
    assert all(s["computed_tokens"] == s["prompt_tokens"] == sum(map(len, (p for p, _ in specs)))
               for s in stats)


def test_the_base_scheduler_schedules_ahead_the_same_steps():
    """The steady path is a faster way to the same plans: the base scheduler's lean steps
    after a plan in flight draw the same tokens, deliver them in the same order and end the
    same rows."""
    ps = prompts(25, 5)
    specs = [(p, Sampling(max_new_tokens=35 - 5 * i, stop=[7] if i == 3 else []))
             for i, p in enumerate(ps)]
    eos = [rollout(ps[1], 35)[20]]
    plain, dp = serve(specs, cls=BaseScheduler, eos=eos)
    steady, ds = serve(specs, eos=eos)
    assert not any(p.fast is not None for p in dp.plans)
    assert any(p.fast is not None for p in ds.plans)
    assert [r.outputs for r in plain] == [r.outputs for r in steady]
    assert [r.finish_reasons for r in plain] == [r.finish_reasons for r in steady]
    assert key(dp.events) == key(ds.events)
    assert len(dp.plans) == len(ds.plans) and dp.sched.stats == ds.sched.stats


def test_reads_between_steady_steps_see_every_applied_token():
    ps = prompts(13, 4)
    sched = make()
    c = Client(sched)
    reqs = [c.add(p, Sampling(max_new_tokens=50)) for p in ps]
    want = [rollout(p, 50) for p in ps]
    d = Driver(sched, ahead=True)
    seen_steady = 0
    while d.step():
        got = [list(r.outputs[0]) for r in reqs]
        assert sum(map(len, got)) == sched.stats["tokens_out"]
        assert all(g == w[:len(g)] for g, w in zip(got, want))
        assert all(len(r.token_times[0]) == len(r.outputs[0]) for r in reqs)
        seen_steady += d.plans[-1].fast is not None
    assert seen_steady > 20
    assert [r.outputs[0] for r in reqs] == want


def test_rows_ending_by_length_at_different_steps_leave_at_once():
    specs = [(p, Sampling(max_new_tokens=45 - 6 * i)) for i, p in enumerate(prompts(14, 6))]
    sched = make()
    c = Client(sched)
    reqs = [c.add(p, sp) for p, sp in specs]
    d = Driver(sched, ahead=True)
    ended_at = {}
    while d.step():
        for job in sched.ended_jobs:
            ended_at.setdefault(job.req.id, sched.stats["tokens_out"])
            # a finished request has every token, its id went back at once (check())
            assert len(job.req.outputs[0]) == job.req.sampling.max_new_tokens
        sched.ended_jobs.clear()
        running = {s.req.id for s in sched.running}
        assert not running & set(ended_at)
    assert len(set(ended_at.values())) == len(reqs)   # one by one, each at its own step
    assert [r.outputs[0] for r in reqs] == [rollout(p, sp.max_new_tokens) for p, sp in specs]
    assert all(r.finish_reasons == ["length"] for r in reqs)


def test_lean_rows_are_ordered_by_tokens_left_and_ending_rows_leave_from_the_end():
    specs = [(p, Sampling(max_new_tokens=12 + 3 * i)) for i, p in enumerate(prompts(15, 4))]
    sched = make()
    c = Client(sched)
    reqs = [c.add(p, sp) for p, sp in specs]
    orders = []

    def on_plan(plan):
        if not plan.lean:
            return
        assert len(plan.rows) == len(plan.seqs) == len(plan.owners) == plan.spec.dense
        left = [s.req.sampling.max_new_tokens - len(s.req.outputs[s.index]) for s in plan.seqs]
        if not plan.ahead:                            # most tokens left first
            assert left == sorted(left, reverse=True)
        else:                                         # (one token in flight: it ends no row)
            assert min(left) >= 2
        orders.append([s.req.id for s in plan.seqs])

    d = Driver(sched, ahead=True, on_plan=on_plan)
    d.run()
    assert any(p.ahead for p in d.plans)
    # each plan's rows keep the order of the one before, less some at the end
    for a, b in zip(orders, orders[1:]):
        if set(b) <= set(a):
            assert a[:len(b)] == b
    assert [r.outputs[0] for r in reqs] == [rollout(p, sp.max_new_tokens) for p, sp in specs]


def test_an_end_of_sequence_id_ends_a_row_in_a_steady_run():
    ps = prompts(16, 5)
    base = [rollout(p, 60) for p in ps]
    eos = base[2][35]                                 # drawn late by request 2
    reqs, d = serve([(p, Sampling(max_new_tokens=60)) for p in ps], eos=[eos])
    want = [rollout(p, 60, eos=(eos,)) for p in ps]
    assert [r.outputs[0] for r in reqs] == want
    assert reqs[2].finish_reasons == ["stop"] and reqs[2].outputs[0][-1] == eos
    for r, w in zip(reqs, want):
        assert r.finish_reasons == ["stop" if w[-1] == eos else "length"]
    sync, _ = serve([(p, Sampling(max_new_tokens=60)) for p in ps], ahead=False, eos=[eos])
    assert [r.outputs for r in sync] == [r.outputs for r in reqs]


def test_a_requests_own_stop_token_ends_it_in_a_steady_run():
    ps = prompts(17, 4)
    tok = rollout(ps[1], 60)[40]
    specs = [(p, Sampling(max_new_tokens=60, stop=[tok] if i == 1 else [])) for i, p in enumerate(ps)]
    reqs, d = serve(specs)
    assert reqs[1].finish_reasons == ["stop"] and reqs[1].outputs[0] == rollout(ps[1], 60, stop=(tok,))
    assert [r.outputs[0] for i, r in enumerate(reqs) if i != 1] == \
        [rollout(p, 60) for i, p in enumerate(ps) if i != 1]


def test_apply_decode_returns_every_token_or_only_the_hooked_ones():
    ps = prompts(18, 4)
    for deliver in (True, False):
        sched = make()
        c = Client(sched)
        reqs = [c.add(p, Sampling(max_new_tokens=25), on_token=print if i == 2 else None)
                for i, p in enumerate(ps)]
        d = Driver(sched, ahead=True, lean=True, deliver=deliver)
        d.run()
        others = [e for e in d.events if e[0].req is not reqs[2]]
        if deliver:
            assert len(d.events) == sched.stats["tokens_out"] == 100
            for r, p in zip(reqs, ps):
                assert [tok for job, k, tok in d.events if job.req is r] == rollout(p, 25)
        else:                                         # the lean applies gave request 2's alone
            assert len(others) < 75 // 2
        assert [tok for job, k, tok in d.events if job.req is reqs[2]] == rollout(ps[2], 25)


def test_a_cancel_between_steady_steps_drops_the_row_and_keeps_its_tokens():
    ps = prompts(19, 4)
    sched = make(prefix=True)
    c = Client(sched)
    reqs = [c.add(p, Sampling(max_new_tokens=50)) for p in ps]
    d = Driver(sched, ahead=True)
    for _ in range(25):
        assert d.step()
    assert d.flight is not None and d.flight[0].fast is not None   # a steady plan in flight
    n = len(reqs[1].outputs[0])
    job = next(s.job for s in sched.running if s.req is reqs[1])
    sched.end(job, "cancelled")
    check(sched, in_flight=1)
    d.run()
    assert reqs[1].finish_reasons == ["cancelled"]
    assert reqs[1].outputs[0] == rollout(ps[1], 50)[:n + 1] or reqs[1].outputs[0] == rollout(ps[1], 50)[:n]
    assert len(reqs[1].token_times[0]) == len(reqs[1].outputs[0])
    assert [r.outputs[0] for i, r in enumerate(reqs) if i != 1] == \
        [rollout(p, 50) for i, p in enumerate(ps) if i != 1]
    assert sched.prefix.metrics()["pins"] == 0


def test_rolling_back_a_step_in_flight_and_the_one_after_it():
    ps = prompts(20, 4)
    sched = make()
    c = Client(sched)
    reqs = [c.add(p, Sampling(max_new_tokens=40)) for p in ps]
    d = Driver(sched, ahead=True)
    for _ in range(20):
        d.step()
    flight, _ = d.flight
    applied = sched.stats["tokens_out"]
    outs = [list(r.outputs[0]) for r in reqs]
    nxt_plan = sched.schedule_decode(after=flight)    # declared, not prepared
    assert nxt_plan is not None and nxt_plan.fast is not None
    sched.rollback(nxt_plan, False)
    sched.rollback(flight, False)                     # the forward ran: its cells go back
    d.flight = None
    check(sched)                                      # cache == what the scheduler believes
    assert [list(r.outputs[0]) for r in reqs] == outs and sched.stats["tokens_out"] == applied
    d.run()
    assert [r.outputs[0] for r in reqs] == [rollout(p, 40) for p in ps]


def test_token_times_are_the_clock_at_each_apply():
    ticks = iter(range(1, 10_000))
    reads = []

    def clock():
        reads.append(float(next(ticks)))
        return reads[-1]

    ps = prompts(21, 3)
    sched = make(clock=clock)
    c = Client(sched)
    reqs = [c.add(p, Sampling(max_new_tokens=30 - 5 * i)) for i, p in enumerate(ps)]
    Driver(sched, ahead=True).run()
    for r in reqs:
        times = r.token_times[0]
        assert len(times) == len(r.outputs[0])
        assert all(a < b for a, b in zip(times, times[1:]))   # one reading a step
        assert set(times) <= set(reads)
        assert r.first_token == times[0] and r.finished >= times[-1]
    # the rows of one step share its time
    assert reqs[0].token_times[0][:20] == reqs[1].token_times[0][:20]


def test_a_clock_that_fails_leaves_the_step_whole():
    state = {"n": 0.0}

    def clock():
        state["n"] += 1
        if state["n"] == 20:
            raise ValueError("clock broke")
        return state["n"]

    ps = prompts(22, 3)
    sched = make(clock=clock)
    c = Client(sched)
    reqs = [c.add(p, Sampling(max_new_tokens=30)) for p in ps]
    d = Driver(sched, ahead=True)
    errors = []
    while d.step():
        errors += sched.later
        sched.later.clear()
    assert [type(e) for e in errors] == [ValueError]
    assert [r.outputs[0] for r in reqs] == [rollout(p, 30) for p in ps]
    assert all(len(r.token_times[0]) == 30 for r in reqs)


def test_schedule_decode_declines_what_the_general_path_must_plan():
    ps = prompts(23, 3)
    sched = make(max_write=2)                         # a token budget of 2: three rows don't fit
    c = Client(sched)
    [c.add(p, Sampling(max_new_tokens=5)) for p in ps]
    assert sched.schedule_decode() is None            # nothing running yet
    d = Driver(sched, ahead=True)
    d.run()
    assert not any(p.lean and len(p.rows) > 2 for p in d.plans)

    sched = make()
    c = Client(sched)
    r = c.add(ps[0], Sampling(max_new_tokens=20))
    r.draft = lambda tokens, k: []                    # it may propose drafts: synchronous steps
    d = Driver(sched, ahead=True)
    d.run()
    assert not any(p.ahead for p in d.plans) and r.outputs[0] == rollout(ps[0], 20)


def test_forks_and_prefix_hits_then_steady_steps():
    shared = prompts(24, 1, 20, 21)[0]
    specs = [(shared + [i, i + 1], Sampling(max_new_tokens=30, n=2 if i == 1 else 1)) for i in range(4)]
    reqs, d = serve(specs, prefix=True, max_write=32)
    for (p, sp), r in zip(specs, reqs):
        assert r.outputs == [rollout(p, 30)] * sp.n
    assert d.sched.stats["forks"] == 1
    assert any(p.fast is not None for p in d.plans)
    pc = d.sched.prefix
    assert pc.metrics()["pins"] == 0
    for (p, _), r in zip(specs, reqs):                # every finished sequence went to the tree
        toks = p + r.outputs[0]
        assert pc.peek(toks) == len(toks) - 1


def test_holding_a_request_s_continuations_builds_none_of_its_lists(monkeypatch):
    """The token store takes each continuation's own lists: with n continuations held, no
    read of ``outputs`` while the store is made builds the siblings' lists from their rows
    (n^2 work a request: what reading ``req.outputs[k]`` there did), and every token lands."""
    from cellcache.generate import plan as plan_mod
    from cellcache.generate.scheduler import Scheduler

    holding, built, held = [], [], []
    real_ids, real_hold = plan_mod.StoredRow.ids, Scheduler._hold

    def ids(self):
        if holding:
            built.append(1)
        return real_ids(self)

    def hold(self, seqs, fast):
        holding.append(len(seqs))
        held.append(len(seqs))
        try:
            return real_hold(self, seqs, fast)
        finally:
            holding.pop()

    monkeypatch.setattr(plan_mod.StoredRow, "ids", ids)
    monkeypatch.setattr(Scheduler, "_hold", hold)
    ps = prompts(25, 2)
    reqs, _ = serve([(p, Sampling(max_new_tokens=24, n=8, temperature=1.0)) for p in ps],
                    prefix=True, max_write=32)
    assert max(held) == 16                            # both requests' continuations at once
    assert built == []                                # nothing built a held row's list
    assert all(len(o) == 24 for r in reqs for o in r.outputs)
    assert all(r.finish_reasons == ["length"] * 8 for r in reqs)
