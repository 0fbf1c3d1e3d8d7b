"""The scheduler without a model: a fake forward whose "logits" put all the mass on
a token that is a fixed function of the sequence's tokens so far, the real batched sampler on
the CPU, and the host cache. Outputs must equal a plain rollout of that function whatever
the scheduler does (token budget, prompt chunks, preemption, the prefix cache, drafts, forks),
the cache must hold exactly what the scheduler believes after every step, and a rolled-back
step must leave everything as it was."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cellcache import CacheConfig, HostCellCache, LayerConfig, PrefixCache  # noqa: E402
from cellcache.generate import Request, Sampler, Sampling, Scheduler  # noqa: E402
from cellcache.generate.scheduler import Job  # noqa: E402

from .test_scheduler_fakes import check  # noqa: E402

V = 64


def nxt(tokens) -> int:
    """The fake model: the next token after ``tokens``."""
    return (tokens[-1] * 7 + 3 * len(tokens) + (tokens[-2] if len(tokens) > 1 else 0)) % V


def rollout(prompt, n):
    toks = list(prompt)
    for _ in range(n):
        toks.append(nxt(toks))
    return toks[len(prompt):]


def make(capacity=256, max_write=16, max_seqs=32, prefix=False, prefix_ids=8, **kw):
    cfg = CacheConfig(capacity=capacity, layers=[LayerConfig(1, 4)], max_write=max_write,
                      initial_capacity=16, dtype="float32", max_seqs=max_seqs + (prefix_ids if prefix else 0))
    cache = HostCellCache(cfg)
    pc = PrefixCache(cache, max_seqs=prefix_ids) if prefix else None
    opts = dict(max_batch=max_write, prefill_chunk=8, reserve=1.0, eos=set())
    opts.update(kw)
    return Scheduler(cache, pc, **opts)


class Client:
    """Requests into the scheduler's queue, as the Generator's add() does."""

    def __init__(self, sched: Scheduler):
        self.sched, self.ids = sched, 0

    def add(self, prompt, sampling: Sampling) -> Request:
        n = sampling.n
        req = Request(self.ids, list(prompt), sampling, outputs=[[] for _ in range(n)],
                      finish_reasons=[None] * n, token_times=[[] for _ in range(n)])
        self.ids += 1
        self.sched.waiting.append(Scheduler.new_seq(Job(req), 0, list(prompt)))
        return req


def fake_forward(plan) -> torch.Tensor:
    """Logits of the plan's logit rows: one-hot on nxt(context of that row)."""
    rows = []
    for s, feed, first, group in plan.owners:
        if first is None:
            continue
        base = s.tokens[:s.in_cache]
        if group >= 0:                                # a verify run: every fed position
            rows += [nxt(base + feed[:j + 1]) for j in range(len(feed))]
        else:
            rows.append(nxt(s.tokens[:s.in_cache + len(feed)]))
    logits = torch.full((len(rows), V), -5.0)
    logits[torch.arange(len(rows)), torch.tensor(rows, dtype=torch.long)] = 5.0
    return logits


def run(sched: Scheduler, sampler=None, on_plan=None, draft=None, limit=2000, foreign=()):
    """Steps to the end with the fake forward; returns the plans' widths."""
    sampler = sampler or Sampler("cpu")
    widths = []
    for _ in range(limit):
        if draft is not None:
            for s in sched.running:
                s.drafts = []
                if len(s.tokens) - s.in_cache == 1 and (s.req.sampling.n == 1 or s.job.forked):
                    left = s.req.sampling.max_new_tokens - len(s.req.outputs[s.index]) - 1
                    s.drafts = draft(s.tokens, min(3, left)) if left > 0 else []
        plan = sched.schedule()
        if plan is None:
            break
        if on_plan is not None:
            on_plan(plan)
        widths.append(len(plan.tokens))
        sched.cache.prepare_step()
        sched.cache.commit_step()
        out = sampler(fake_forward(plan), plan.spec)
        outcomes, failed = sched.decide(plan, out)
        assert failed == []
        sched.count_step(plan, False)
        sched.update_from_output(outcomes)
        check(sched, foreign)
    else:
        pytest.fail("the scheduler did not finish")
    return widths


def prompts(seed, n, lo=3, hi=30):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, V, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def test_outputs_follow_the_model_within_the_token_budget():
    sched = make()
    c = Client(sched)
    ps = prompts(1, 9)
    reqs = [c.add(p, Sampling(max_new_tokens=12)) for p in ps]
    plans = []
    widths = run(sched, on_plan=plans.append)
    assert [r.outputs[0] for r in reqs] == [rollout(p, 12) for p in ps]
    assert all(r.finish_reasons == ["length"] for r in reqs)
    assert max(widths) <= 16 and sched.stats["preempted"] == 0
    for plan in plans:                                # prompt chunks bounded by prefill_chunk
        assert all(len(feed) <= 8 for _, feed in plan.rows)
        assert len(plan.tokens) == sum(len(feed) for _, feed in plan.rows)
    assert sched.stats["computed_tokens"] == sched.stats["prompt_tokens"] == sum(map(len, ps))
    assert sched.cache.live_seqs() == []


def test_preemption_under_pressure_keeps_the_outputs():
    sched = make(capacity=96, reserve=0.0)
    c = Client(sched)
    ps = prompts(2, 8, 10, 40)
    reqs = [c.add(p, Sampling(max_new_tokens=15)) for p in ps]
    run(sched)
    assert sched.stats["preempted"] > 0
    assert [r.outputs[0] for r in reqs] == [rollout(p, 15) for p in ps]


def test_a_shared_prefix_is_computed_once_with_the_prefix_cache():
    sched = make(prefix=True, max_write=32)
    c = Client(sched)
    rng = np.random.default_rng(3)
    shared = rng.integers(0, V, size=20).tolist()
    own = [[i] + rng.integers(0, V, size=5).tolist() for i in range(6)]
    reqs = [c.add(shared + o, Sampling(max_new_tokens=5)) for o in own]
    run(sched)
    assert [r.outputs[0] for r in reqs] == [rollout(shared + o, 5) for o in own]
    assert sched.stats["computed_tokens"] == 20 + 6 * 6
    assert sched.prefix.metrics()["pins"] == 0


def test_drafts_are_verified_and_the_rejected_rewound():
    sched = make()
    c = Client(sched)
    ps = prompts(4, 5)
    rng = np.random.default_rng(5)

    def draft(tokens, k):                             # right for a while, then wrong
        good = rollout(tokens, k)
        cut = int(rng.integers(0, k + 1))
        return good[:cut] + [(t + 1) % V for t in good[cut:]]

    reqs = [c.add(p, Sampling(max_new_tokens=10)) for p in ps]
    run(sched, draft=draft)
    assert [r.outputs[0] for r in reqs] == [rollout(p, 10) for p in ps]
    assert 0 < sched.stats["accepted"]


def test_forks_share_the_prompt():
    sched = make(prefill_chunk=16)
    c = Client(sched)
    p = prompts(6, 1, 12, 13)[0]
    req = c.add(p, Sampling(max_new_tokens=6, n=3))
    seen = []

    def after_first(plan):                            # planning step 2: step 1 forked
        if sched.stats["steps"] == 1:
            seen.append(sched.cache.capacity - sched.cache.free_cells)

    run(sched, on_plan=after_first)
    assert req.outputs == [rollout(p, 6)] * 3 and sched.stats["forks"] == 2
    assert seen == [len(p)]                           # the clones added no cell for the prompt


def test_rollback_leaves_everything_as_it_was():
    sched = make(prefix=True)
    c = Client(sched)
    rng = np.random.default_rng(7)
    shared = rng.integers(0, V, size=12).tolist()
    c.add(shared + [1, 2], Sampling(max_new_tokens=3))
    run(sched)                                        # the first prompt is cached
    reqs = [c.add(shared + [i, 5, 6], Sampling(max_new_tokens=4)) for i in range(3, 6)]
    sched.waiting[0].drafts = []

    def state():
        m = sched.prefix.metrics()
        return (sched.prefix.prefixes(), m["pins"], sched.cache.live_seqs(), sched.cache.free_cells,
                [id(s) for s in sched.waiting], [id(s) for s in sched.running], dict(sched.stats))

    before = state()
    plan = sched.schedule()
    assert plan is not None and plan.admitted and plan.cached > 0
    sched.cache.prepare_step()
    sched.rollback(plan, commit=True)
    assert state() == before
    check(sched)
    run(sched)
    assert [r.outputs[0] for r in reqs] == [rollout(shared + [i, 5, 6], 4) for i in range(3, 6)]


def test_a_request_that_cannot_get_a_cell_ends_with_capacity():
    sched = make(capacity=40, max_write=16)
    other = sched.cache.seq_new()
    assert sched.cache.declare_step([other] * 16)
    sched.cache.prepare_step()
    sched.cache.commit_step()
    assert sched.cache.declare_step([other] * 16)
    sched.cache.prepare_step()
    sched.cache.commit_step()                         # 32 of 40 cells are someone else's
    c = Client(sched)
    big = c.add(list(range(20)), Sampling(max_new_tokens=5))    # 24 cells; 8 free
    small = c.add([1, 2, 3], Sampling(max_new_tokens=3))
    run(sched, foreign=[other])
    assert big.finish_reasons == ["capacity"] and small.outputs[0] == rollout([1, 2, 3], 3)
    assert sched.cache.live_seqs() == [other]
