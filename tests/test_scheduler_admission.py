"""The general step without a model: admission (FIFO, longest prefix first, the reserve,
prompts being read), prefix hits, preemption, drafts cut at a stop, ending a request and
rolling a step back, driven with the fake model of ``test_scheduler_fakes``: after every
step the cache holds exactly what the scheduler believes, and the outputs are the plain
rollout's whatever the scheduler decided."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from cellcache.generate import Sampling  # noqa: E402

from .test_scheduler_fakes import Client, Driver, check, make, prompts, rollout  # noqa: E402


def admissions(d: Driver) -> list[int]:
    """Request ids in the order the driver's plans admitted them."""
    return [s.req.id for plan in d.plans for s in plan.admitted]


def test_fifo_admission_lets_nothing_overtake_a_request_waiting_for_room():
    sched = make(capacity=64, reserve=1.0)
    c = Client(sched)
    a = c.add(list(range(10)), Sampling(max_new_tokens=20))     # claims 29 cells
    b = c.add(list(range(30)), Sampling(max_new_tokens=10))     # claims 39: waits for a
    small = c.add([1, 2, 3], Sampling(max_new_tokens=3))        # would fit beside a
    d = Driver(sched, lean=False)
    d.step()
    assert [s.req for s in sched.running] == [a] and [s.req for s in sched.waiting] == [b, small]
    d.run()
    assert admissions(d) == [0, 1, 2]
    for r in (a, b, small):
        assert r.outputs[0] == rollout(r.prompt, r.sampling.max_new_tokens)


def test_without_a_reserve_the_small_request_runs_beside():
    sched = make(capacity=64, reserve=0.0)
    c = Client(sched)
    c.add(list(range(10)), Sampling(max_new_tokens=20))
    c.add(list(range(30)), Sampling(max_new_tokens=10))
    c.add([1, 2, 3], Sampling(max_new_tokens=3))
    d = Driver(sched, lean=False)
    d.step()
    d.step()
    assert len(sched.running) >= 2                    # admitted on the free cells of now


@pytest.mark.parametrize("policy", ["fifo", "lpm"])
def test_lpm_admits_the_longest_cached_prefix_first(policy):
    sched = make(prefix=True, max_write=8, admission=policy)
    c = Client(sched)
    shared = prompts(30, 1, 24, 25)[0]
    c.add(shared + [1], Sampling(max_new_tokens=2))
    Driver(sched, lean=False).run()                   # shared is in the prefix cache now
    cold = c.add(prompts(31, 1, 10, 11)[0], Sampling(max_new_tokens=3))
    warm = c.add(shared + [2, 3], Sampling(max_new_tokens=3))
    d = Driver(sched, lean=False)
    d.step()                  # cold's first chunk fills the budget of 8; warm's hit needs 3
    assert [s.req for s in sched.running] == ([warm, cold] if policy == "lpm" else [cold])
    d.run()
    assert admissions(d) == ([warm.id, cold.id] if policy == "lpm" else [cold.id, warm.id])
    assert warm.outputs[0] == rollout(warm.prompt, 3) and cold.outputs[0] == rollout(cold.prompt, 3)


def test_a_prefix_hit_shares_the_cached_cells():
    sched = make(prefix=True, max_write=32, prefill_chunk=32)
    c = Client(sched)
    shared = prompts(32, 1, 20, 21)[0]
    c.add(shared + [5], Sampling(max_new_tokens=4))
    Driver(sched).run()
    computed = sched.stats["computed_tokens"]
    free = sched.cache.free_cells
    r = c.add(shared + [6, 7, 8], Sampling(max_new_tokens=4))
    plan = sched.schedule()
    assert plan.admitted and plan.cached == 20
    assert [len(feed) for _, feed in plan.rows] == [3]        # only what the cache lacks
    d = Driver(sched)
    d.land(plan, d.launch(plan, plan.tokens))
    check(sched)
    assert free - sched.cache.free_cells == 3                 # the hit's cells are shared
    d.run()
    assert r.outputs[0] == rollout(shared + [6, 7, 8], 4)
    assert sched.stats["computed_tokens"] - computed == 3
    assert sched.stats["cached_tokens"] == 20


def test_a_prompt_being_read_is_waited_for_and_then_hit():
    sched = make(prefix=True, max_write=16, prefill_chunk=8)
    c = Client(sched)
    p = prompts(33, 1, 30, 31)[0]
    a = c.add(p, Sampling(max_new_tokens=3))
    b = c.add(p, Sampling(max_new_tokens=3))          # the same prompt, arriving together
    d = Driver(sched, lean=False)
    d.run()
    assert a.outputs == b.outputs == [rollout(p, 3)]
    # b waited for a's prompt to be stored, then read only its last token
    assert sched.stats["computed_tokens"] == len(p) + 1
    assert sched.stats["cached_tokens"] == len(p) - 1
    assert sched.pending.size == 0


def test_preemption_takes_the_most_recent_admission_first():
    sched = make(capacity=96, reserve=0.0)
    c = Client(sched)
    ps = prompts(34, 8, 10, 40)
    reqs = [c.add(p, Sampling(max_new_tokens=15)) for p in ps]
    d = Driver(sched, lean=False)
    preempted_seen = 0
    while True:
        before = {id(s): s.stamp for s in sched.running}
        count = sched.stats["preempted"]
        if not d.step():
            break
        if sched.stats["preempted"] > count:
            preempted_seen += 1
            gone = [sid for sid in before if sid not in {id(s) for s in sched.running}
                    and any(id(w) == sid for w in sched.waiting)]
            stayed = [st for sid, st in before.items() if sid not in gone]
            assert gone and all(before[g] > max(stayed, default=-1) for g in gone)
    assert preempted_seen > 0
    assert [r.outputs[0] for r in reqs] == [rollout(p, 15) for p in ps]
    # a preempted sequence is read again: more computed than the prompts
    assert sched.stats["computed_tokens"] > sched.stats["prompt_tokens"]


def test_accepted_drafts_are_cut_at_a_stop_and_at_max_new_tokens():
    p = prompts(35, 1, 8, 9)[0]
    full = rollout(p, 30)
    eos = full[17]
    want = rollout(p, 30, eos=(eos,))

    def draft(tokens, k):                             # always right
        return rollout(tokens, k)

    sched = make(eos={eos})
    c = Client(sched)
    r = c.add(p, Sampling(max_new_tokens=30))
    short = c.add(p[:5], Sampling(max_new_tokens=7))
    d = Driver(sched, draft=draft, lean=False)
    d.run()
    assert r.outputs[0] == want and r.finish_reasons == ["stop"]
    assert short.outputs[0] == rollout(p[:5], 7, eos=(eos,))
    assert len(short.outputs[0]) <= 7
    assert sched.stats["accepted"] > 5
    assert sched.stats["tokens_out"] == len(want) + len(short.outputs[0])


def test_rejected_drafts_are_rewound():
    p = prompts(36, 1, 8, 9)[0]

    def draft(tokens, k):                             # first right, then wrong
        good = rollout(tokens, k)
        return good[:1] + [(t + 1) % 64 for t in good[1:]]

    sched = make()
    c = Client(sched)
    r = c.add(p, Sampling(max_new_tokens=20))
    d = Driver(sched, draft=draft, lean=False)
    d.run()                                           # check() after every step: no stale cell
    assert r.outputs[0] == rollout(p, 20)
    assert 0 < sched.stats["accepted"] < sched.stats["tokens_out"]


def test_ending_a_request_frees_every_continuation_and_stores_it():
    sched = make(prefix=True, prefill_chunk=16)
    c = Client(sched)
    p = prompts(37, 1, 12, 13)[0]
    r = c.add(p, Sampling(max_new_tokens=30, n=3))
    other = c.add(prompts(38, 1, 5, 6)[0], Sampling(max_new_tokens=30))
    d = Driver(sched, lean=False)
    for _ in range(5):
        d.step()
    assert sched.stats["forks"] == 2
    job = next(s.job for s in sched.running if s.req is r)
    sched.end(job, "cancelled")
    assert r.finish_reasons == ["cancelled"] * 3 and r.finished is not None
    assert job in sched.ended_jobs and job.closed
    assert all(s.req is not r for s in sched.running + sched.waiting)
    check(sched)
    for out in r.outputs:                             # each continuation's cells went to the tree
        toks = p + out
        assert sched.prefix.peek(toks) == len(toks) - 1
    d.run()
    assert other.outputs[0] == rollout(other.prompt, 30)


def test_rolling_back_a_step_with_drafts_and_prompt_chunks():
    sched = make(prefix=True, max_write=32)
    c = Client(sched)
    ps = prompts(39, 3, 20, 30)
    reqs = [c.add(p, Sampling(max_new_tokens=8)) for p in ps]
    d = Driver(sched, lean=False)
    d.step()
    d.step()
    for s in sched.running:
        if len(s.tokens) - s.in_cache == 1:
            s.drafts = rollout(s.tokens, 2)

    def state():
        return ([(id(s), s.sid, s.in_cache, len(s.tokens)) for s in sched.running],
                [id(s) for s in sched.waiting], sched.cache.live_seqs(), sched.cache.free_cells,
                sched.prefix.prefixes(), sched.prefix.metrics()["pins"], dict(sched.stats))

    before = state()
    plan = sched.schedule()
    assert plan is not None and not plan.decode_only
    d.model.forward(plan.tokens)                      # prepared and committed
    sched.rollback(plan, commit=False)
    assert state() == before
    assert all(not s.drafts for s in sched.running)
    check(sched)
    d.run()
    assert [r.outputs[0] for r in reqs] == [rollout(p, 8) for p in ps]
