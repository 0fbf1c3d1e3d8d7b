"""The serving rules as methods of the plan's objects (``cellcache.generate.plan``) and the
scheduler's one door to memory (``cellcache.generate.kv.KVManager``), without a model: each
rule on hand-made sequences, each memory verb on a host cache with a prefix cache, checked
against what the cache and the tree hold afterwards."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from cellcache.generate import Request, Sampling  # noqa: E402
from cellcache.generate.kv import KVManager  # noqa: E402
from cellcache.generate.plan import Job, Seq, StepPlan  # noqa: E402

from .test_scheduler_fakes import FakeModel, make  # noqa: E402


def seq(prompt, sampling, outputs=(), index=0, forked=False):
    n = sampling.n
    req = Request(0, list(prompt), sampling, outputs=[list(outputs) for _ in range(n)],
                  finish_reasons=[None] * n, token_times=[[] for _ in range(n)])
    return Seq(Job(req, forked=forked), index, list(prompt) + list(outputs))


def test_the_rules_of_a_sequence():
    s = seq([1, 2, 3, 4], Sampling(max_new_tokens=10), outputs=[7, 8])
    assert s.to_feed == 6 and s.draws_left() == 8
    s.in_cache = 5
    assert s.to_feed == 1                             # decoding: its last token is fed next
    assert Sampling(max_new_tokens=10).cells_needed(4) == 13
    assert s.claim(5) == 13 - 5 and s.claim(20) == 0
    assert not s.forks_next()
    f = seq([1, 2, 3], Sampling(max_new_tokens=5, n=3))
    assert f.forks_next() and f.claim(0) == 7 + 2 * 4  # its continuations' own tokens too
    f.job.forked = True
    assert not f.forks_next() and f.claim(0) == 7
    assert f.tokens_array().dtype == np.int32 and f.tokens_array().tolist() == [1, 2, 3]


def test_the_stop_rule():
    s = seq([1], Sampling(max_new_tokens=3, stop=[9]))
    assert s.end_reason(1, 5, set()) is None
    assert s.end_reason(1, 9, set()) == "stop"        # its own stop token
    assert s.end_reason(1, 4, {4}) == "stop"          # an end-of-sequence id
    assert s.end_reason(3, 5, set()) == "length"
    assert s.end_reason(3, 9, set()) == "stop"        # a stop wins over the length


def test_a_plans_width_and_token_ids():
    a, b = seq([1, 2], Sampling()), seq([3], Sampling())
    a.sid, b.sid = 4, 7
    plan = StepPlan([(a, [1, 2]), (b, [3])], [], False)
    sids = plan.token_sids()                   # a chunk: an int64 array, as declare_step reads fast
    assert plan.width == 3 and sids.dtype == np.int64 and sids.tolist() == [4, 4, 7]
    assert StepPlan([(a, [2]), (b, [3])], [], True).token_sids() == [4, 7]   # a token a row: a list
    lean = StepPlan([], [], True)
    lean.lean_rows([b, a], ahead=True)
    assert lean.lean and lean.ahead and lean.seqs == [b, a] and lean.width == 2
    assert [(s, slot) for s, _, slot, _ in lean.owners] == [(b, 0), (a, 1)]
    assert lean.spec.dense == 2 and lean.logit_rows == [0, 1]


def kv_with_prompt(prompt):
    """A KVManager over a host cache whose prefix cache holds ``prompt`` (read by a sequence
    that ended); its fake model."""
    sched = make(prefix=True, max_write=32)
    kv = KVManager(sched.cache, sched.prefix, later=[])
    m = FakeModel(sched.cache)
    s = seq(prompt, Sampling(max_new_tokens=2))
    s.sid, _ = kv.obtain(s, s.tokens_array(), 0)
    assert kv.declare([s.sid] * len(prompt))
    m.forward(prompt)
    s.in_cache = len(prompt)
    kv.placed(s)                                      # stored and lent
    assert s.stored and kv.prefix.owns(s.sid) is False
    kv.release(s, store=True)
    assert s.sid is None and kv.hit(np.array(prompt + [0], np.int32)) == len(prompt)
    return kv, m


def test_a_hit_is_a_pinned_clone_and_release_gives_back_only_the_own_cells():
    prompt = list(range(10, 22))
    kv, _ = kv_with_prompt(prompt)
    cache, pc = kv.cache, kv.prefix
    free = cache.free_cells
    w = seq(prompt + [5, 6], Sampling(max_new_tokens=4))
    arr = w.tokens_array()
    hit = kv.hit(arr)
    assert hit == 12
    sid, n = kv.obtain(w, arr, hit)
    assert n == 12 and cache.pos(sid) == 12 and cache.free_cells == free   # shared, not copied
    assert pc.metrics()["pins"] > 0 and w.pins
    w.sid, w.in_cache = sid, n
    kv.release(w, store=False)
    assert w.sid is None and not w.pins and pc.metrics()["pins"] == 0
    assert cache.free_cells == free and sid not in cache.live_seqs()
    pc.check_invariants()
    cache.check_invariants()


def test_a_prompt_being_read_makes_a_sharing_request_wait():
    sched = make(prefix=True)
    kv = KVManager(sched.cache, sched.prefix, later=[])
    a = seq([1, 2, 3, 4, 5, 6], Sampling())
    kv.reading(a, 0)
    b = np.array([1, 2, 3, 4, 9], np.int32)
    assert kv.waits_for(b, 0) and not kv.waits_for(b, 4)
    kv.done_reading(a)
    assert not kv.waits_for(b, 0) and a.pending is None


def test_evictions_free_only_what_no_sequence_holds():
    prompt = list(range(30, 50))
    kv, _ = kv_with_prompt(prompt)
    cache = kv.cache
    free = cache.free_cells
    w = seq(prompt + [1], Sampling())
    arr = w.tokens_array()
    # evicting for w keeps the prefix w would hit: nothing to give without a partial store
    assert kv.evict_for(arr, 20, 5, partial=False) == 0 and cache.free_cells == free
    assert kv.evict(100) == 20 and cache.free_cells == free + 20
    assert kv.hit(arr) == 0


def test_a_refused_rewind_is_reported_and_a_fork_shares_the_prompt():
    prompt = [3, 1, 4, 1, 5]
    sched = make(prefix=False)
    kv = KVManager(sched.cache, None, later=[])
    m = FakeModel(sched.cache)
    s = seq(prompt, Sampling(max_new_tokens=4, n=2))
    s.sid, _ = kv.obtain(s, s.tokens_array(), 0)
    assert kv.declare([s.sid] * 5)
    m.forward(prompt)
    s.in_cache = 5
    child = Seq(s.job, 1, list(prompt))
    free = sched.cache.free_cells
    assert kv.fork(s, child)
    assert child.in_cache == 5 and sched.cache.pos(child.sid) == 5 and sched.cache.free_cells == free
    assert kv.rewind(s, 3) and s.in_cache == 3 and sched.cache.pos(s.sid) == 3
    assert not kv.rewind(s, 4) and s.in_cache == 3    # past its end: refused, nothing changed
