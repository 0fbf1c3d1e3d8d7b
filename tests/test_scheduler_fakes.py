"""A model for the scheduler's tests that needs no model: the host cache's cells hold token
ids instead of K/V, and a row's "logits" are a function of the tokens its mask lets it see
(ordered by position). A step whose cells, positions or masks disagree with the sequences
the scheduler believes it runs draws a token the plain rollout does not; the outputs equal
:func:`rollout` only when the cache holds exactly each sequence's tokens. Drivers step a
scheduler as the Generator does: synchronously (general outcomes or the lean apply) and
asynchronously (a lean step left in flight while the next one is scheduled on its draws).

The module's own tests check the fake: it sees a sequence's tokens and nothing else."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from cellcache import CacheConfig, LayerConfig, PrefixCache, build
from cellcache.generate import Request, Sampling, Scheduler
from cellcache.generate.sampler import SamplerOutput
from cellcache.generate.scheduler import Job

V = 64
#: the scheduler the tests drive (the one the Generator builds)
SCHEDULER = Scheduler


def nxt(tokens) -> int:
    """The fake model's next token after ``tokens`` (depends on all of them)."""
    h = 7
    for t in tokens:
        h = (h * 31 + int(t) + 1) % 1_000_003
    return h % V


def rollout(prompt, n, eos=(), stop=()):
    """What a request of ``prompt`` draws: up to ``n`` tokens, cut after an end token."""
    toks = list(prompt)
    out = []
    for _ in range(n):
        t = nxt(toks)
        toks.append(t)
        out.append(t)
        if t in eos or t in stop:
            break
    return out


def make(capacity=512, max_write=16, max_seqs=32, prefix=False, prefix_ids=8, cls=None, **kw):
    cfg = CacheConfig(capacity=capacity, layers=[LayerConfig(1, 4)], max_write=max_write,
                      initial_capacity=16, dtype="float32",
                      max_seqs=max_seqs + (prefix_ids if prefix else 0))
    cache = build("host", "batched", cfg)
    pc = PrefixCache(cache, max_seqs=prefix_ids) if prefix else None
    opts = dict(max_batch=max_write, prefill_chunk=8, reserve=1.0, eos=set())
    opts.update(kw)
    sched = (cls or SCHEDULER)(cache, pc, **opts)
    MODELS[id(sched)] = (sched, FakeModel(cache))
    return sched


#: each scheduler :func:`make` built, and the fake model over its cache (the cells it holds
#: outlive a driver: the prefix cache keeps them)
MODELS: dict = {}


class Client:
    """Requests into the scheduler's queue, as the Generator's add() does."""

    def __init__(self, sched: Scheduler):
        self.sched, self.ids = sched, 0

    def add(self, prompt, sampling: Sampling, on_token=None) -> Request:
        n = sampling.n
        req = Request(self.ids, list(prompt), sampling, on_token=on_token,
                      outputs=[[] for _ in range(n)], finish_reasons=[None] * n,
                      token_times=[[] for _ in range(n)], arrived=self.sched.now())
        self.ids += 1
        self.sched.waiting.append(Scheduler.new_seq(Job(req), 0, list(prompt)))
        return req


class FakeModel:
    """The forward: writes each fed token into its cell, then reads, for every row, the
    tokens of the cells its mask shows it, in position order."""

    def __init__(self, cache):
        self.cache = cache
        self.tok = np.full(cache.capacity, -1, dtype=np.int64)
        self.pos = np.full(cache.capacity, -1, dtype=np.int64)
        self.steps = 0

    def forward(self, fed) -> list[int]:
        """Prepares and commits the declared step fed ``fed``; returns each row's next token."""
        step = self.cache.prepare_step()
        fed = [int(t) for t in fed]
        assert len(fed) == step.width
        self.tok[step.cells] = fed
        self.pos[step.cells] = step.positions
        mask = self.cache.buffer("mask_w0")[0, 0]
        out = []
        for i in range(step.width):
            seen = np.flatnonzero(mask[i, :step.read_len])
            order = seen[np.argsort(self.pos[seen], kind="stable")]
            assert list(self.pos[order]) == list(range(len(order)))   # no hole, no repeat
            out.append(nxt(self.tok[order]))
        self.cache.commit_step()
        self.steps += 1
        return out


def draw(plan, row_tokens) -> SamplerOutput:
    """The sampler, greedy: slot i takes its logit row's token; a verify group accepts its
    leading drafts that equal the draws."""
    spec = plan.spec
    ids = np.array([row_tokens[plan.logit_rows[r]] for r in spec.rows], dtype=np.int64)
    acc = []
    for first, d in spec.groups:
        j = 0
        while j < d and ids[first + j] == spec.draft[first + j]:
            j += 1
        acc.append(j)
    return SamplerOutput(ids, np.array(acc, dtype=np.int64))


def check(sched: Scheduler, foreign=(), in_flight=0):
    """The cache holds what the scheduler believes: every running sequence's cells are its
    tokens in the cache (``in_flight``: plus up to that many of a step not applied yet), the
    waiting ones hold nothing, and every live id is the scheduler's, the prefix cache's or
    ``foreign``."""
    sched.flush()
    cache = sched.cache
    cache.check_invariants()
    sids = []
    for s in sched.running:
        assert s.sid is not None
        assert cache.pos(s.sid) - s.in_cache in range(in_flight + 1)
        assert cache.pos(s.sid) == cache.seq_len(s.sid)
        assert len(s.tokens) - s.in_cache >= 1
        assert s.tokens[len(s.req.prompt):] == s.req.outputs[s.index]
        sids.append(s.sid)
    for s in sched.waiting:
        assert s.sid is None and s.in_cache == 0 and not s.pins
    tree = sched.prefix.owned_seqs() if sched.prefix is not None else []
    if sched.prefix is not None:
        sched.prefix.check_invariants()
    assert sorted(sids + tree + list(foreign)) == cache.live_seqs()


@dataclass
class Driver:
    """Steps ``sched`` with the fake model. ``lean``: lean plans go through apply_decode (the
    Generator's way) rather than decide + update_from_output; ``ahead``: a lean step is left
    in flight and the next one scheduled on its draws (asynchronous scheduling). ``events``
    collects what the applies return; ``plans`` every plan launched."""

    sched: Scheduler
    lean: bool = True
    ahead: bool = False
    draft: object = None
    foreign: tuple = ()
    deliver: bool = True
    on_plan: object = None
    model: FakeModel = None  # type: ignore[assignment]
    flight: tuple | None = None
    events: list = field(default_factory=list)
    plans: list = field(default_factory=list)

    def __post_init__(self):
        if self.model is None:
            known = MODELS.get(id(self.sched))
            self.model = known[1] if known else FakeModel(self.sched.cache)

    def launch(self, plan, fed):
        self.plans.append(plan)
        if self.on_plan is not None:
            self.on_plan(plan)
        return draw(plan, self.model.forward(fed))

    def land(self, plan, out):
        sched = self.sched
        if plan.rows:
            sched.count_step(plan, False)
        if plan.lean and self.lean:
            self.events += sched.apply_decode(plan, out.ids, deliver=self.deliver)
        else:
            outcomes, failed = sched.decide(plan, out)
            assert failed == []
            self.events += sched.update_from_output(outcomes)

    def fed_ahead(self, plan, after, out):
        """What an ahead plan feeds: ``after``'s draws of its sequences."""
        where = {id(s): slot for s, _, slot, _ in after.owners}
        fed = [int(out.ids[where[id(s)]]) for s in plan.seqs]
        if plan.prefix_fed:                           # its promise: a prefix of the draws
            assert fed == out.ids[:len(fed)].tolist()
        return fed

    def propose(self):
        for s in self.sched.running:
            s.drafts = []
            if len(s.tokens) - s.in_cache == 1 and (s.req.sampling.n == 1 or s.job.forked):
                left = s.req.sampling.max_new_tokens - len(s.req.outputs[s.index]) - 1
                s.drafts = self.draft(s.tokens, min(3, left)) if left > 0 else []

    def step(self) -> bool:
        sched = self.sched
        if self.flight is None:
            if self.draft is not None:
                self.propose()
            plan = sched.schedule()
            if plan is None:
                sched.sync()
                return False
            assert not plan.ahead
            out = self.launch(plan, plan.tokens)
            if self.ahead and plan.lean:
                self.flight = (plan, out)
            else:
                self.land(plan, out)
            check(sched, self.foreign, int(self.flight is not None))
            return True
        plan, out = self.flight
        nxt_flight = None
        if not sched.waiting:
            after = sched.schedule_decode(after=plan)
            if after is not None:
                assert after.ahead and after.lean and after.tokens == []
                nxt_flight = (after, self.launch(after, self.fed_ahead(after, plan, out)))
        self.flight = nxt_flight
        self.land(plan, out)
        if nxt_flight is not None:
            sched.drop_ended(nxt_flight[0])
        check(sched, self.foreign, int(nxt_flight is not None))
        return True

    def run(self, limit=5000):
        for _ in range(limit):
            if not self.step():
                return self
        pytest.fail("the scheduler did not finish")


def prompts(seed, n, lo=3, hi=30):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, V, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


# -- the fake itself ----------------------------------------------------------------------------


def test_the_fake_model_sees_its_sequence_and_nothing_else():
    cache = make().cache
    m = FakeModel(cache)
    a, b = cache.seq_new(), cache.seq_new()
    assert cache.declare_step([a, a, a, b, b])
    got = m.forward([5, 6, 7, 8, 9])
    assert got == [nxt([5]), nxt([5, 6]), nxt([5, 6, 7]), nxt([8]), nxt([8, 9])]
    c = cache.seq_clone(a, 2)                         # shares a's first two cells
    assert cache.declare_step([c, a])
    assert m.forward([1, 2]) == [nxt([5, 6, 1]), nxt([5, 6, 7, 2])]


def test_the_fake_model_notices_a_cache_that_holds_the_wrong_tokens():
    cache = make().cache
    m = FakeModel(cache)
    a = cache.seq_new()
    assert cache.declare_step([a, a])
    m.forward([3, 4])
    assert cache.rewind(a, 1)                         # the scheduler forgot a token
    assert cache.declare_step([a])
    got = m.forward([9])
    assert got == [nxt([3, 9])] and got != [nxt([3, 4, 9])]


def test_the_drivers_agree_with_the_rollout():
    for lean, ahead in ((False, False), (True, False), (True, True)):
        sched = make()
        c = Client(sched)
        ps = prompts(1, 5)
        reqs = [c.add(p, Sampling(max_new_tokens=9)) for p in ps]
        Driver(sched, lean=lean, ahead=ahead).run()
        assert [r.outputs[0] for r in reqs] == [rollout(p, 9) for p in ps]
        assert sched.cache.live_seqs() == []
