"""The generator with its prefix cache (issue 18, SPEC §9) on the host backend, CPU torch,
float32, tiny random models: full attention (Llama), a sliding-window layer (Qwen2, window
16) and every layer windowed (Mistral, window 12), with shared prefixes longer than the
windows.

- greedy output is the same with the prefix cache on and off and equals Hugging Face's own
  ``generate``, with arrivals over time, chunked prefill, forks, drafts, preemption and
  eviction under pressure;
- prompt tokens computed equal the ideal exactly: a shared system prompt is computed once,
  a chat turn computes only what the previous turn did not place;
- a failed step with prefix hits is rolled back with the prefix cache as it was;
- after every step: the cache holds exactly the running sequences and the tree's, every
  pin is a running sequence's, every cached path is tokens a request really had, and
  (at the end) every cached node's cells hold the keys HF computes for its tokens.

No timing assertions."""

from __future__ import annotations

import functools
import json
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cellcache import InvalidArgument, PrefixCache  # noqa: E402
from cellcache import hf as cchf  # noqa: E402
from cellcache.generate import Generator, Sampling, main, random_model  # noqa: E402
from cellcache.generate import chat as drive_chat  # noqa: E402
from cellcache.host import HostCellCache  # noqa: E402

ARCHS = ["tiny", "llama-tiny", "mistral-tiny"]
VOCAB = 512
S = 30                 # shared prefix: longer than every window (16, 12)
N_NEW = 8


# -- fixtures and helpers ------------------------------------------------------------------------

class Ref:
    """A second copy of the model (same seed, so the same weights) that stays on HF's own
    attention: greedy references and the keys a prefix's cells must hold."""

    def __init__(self, arch: str):
        self.model = random_model(arch, seed=3)
        self.model.set_attn_implementation("sdpa")
        self._memo: dict[tuple, list[int]] = {}

    def generate(self, prompt, n_new=N_NEW) -> list[int]:
        key = (tuple(prompt), n_new)
        if key not in self._memo:
            ids = torch.tensor([list(prompt)])
            # an explicit mask: without one, generate takes every token equal to the pad id
            # for padding
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)
            self._memo[key] = out[0, len(prompt):].tolist()
        return self._memo[key]

    def keys(self, tokens) -> list[torch.Tensor]:
        with torch.no_grad():
            out = self.model(torch.tensor([list(tokens)]), use_cache=True)
        cache = getattr(out, "past_key_values", None)
        return [layer.keys[0].transpose(0, 1) for layer in cache.layers]   # [kept, Hkv, D]


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param, random_model(request.param, seed=3), Ref(request.param)


@pytest.fixture(scope="module")
def llama():
    return random_model("llama-tiny", seed=3), Ref("llama-tiny")


def shared_prompts(seed, n, prefix_len=S, own=(2, 12), dup=False):
    """n prompts of a shared prefix and their own tokens; own parts start with distinct
    tokens, so the prompts share exactly the prefix (``dup``: one more, a repeat of the
    fourth)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, VOCAB, size=prefix_len).tolist()
    firsts = rng.permutation(VOCAB)[:n]
    ps = [shared + [int(firsts[i])] + rng.integers(0, VOCAB, size=int(rng.integers(*own)) - 1).tolist()
          for i in range(n)]
    if dup:
        ps.append(list(ps[3]))
    return shared, ps


#: every request each generator of these tests was given (a generator keeps only the
#: unfinished ones): what a cached path may hold
ADDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def make(model, prefix=True, **kw):
    opts = dict(capacity=1024, max_batch_tokens=32, max_seqs=24, prefill_chunk=8, eos=[],
                prefix_cache=prefix)
    opts.update(kw)
    gen = Generator(model, **opts)
    added = ADDED.setdefault(gen, [])
    add = gen.add

    def recorded(*args, **kwargs):
        req = add(*args, **kwargs)
        added.append(req)
        return req

    gen.add = recorded
    return gen


def check(gen):
    """The cache holds exactly what the generator and its tree believe."""
    cache, pc = gen.cache, gen.prefix
    cache.check_invariants()
    sids = []
    for s in gen.running:
        assert s.sid is not None and cache.pos(s.sid) == s.in_cache < len(s.tokens)
        sids.append(s.sid)
        # its tokens' array (what it stores and pins; a fork's starts as its parent's prompt)
        # is its tokens so far
        if s.arr is not None:
            assert s.arr.dtype == np.int32 and s.arr.tolist() == list(s.tokens[:len(s.arr)])
    for s in gen.waiting:
        assert s.sid is None and s.in_cache == 0 and not s.pins and s.pending is None
    tree = []
    if pc is not None:
        pc.check_invariants()
        tree = pc.owned_seqs()
        # a lent leaf is a running sequence's prompt, placed
        prompts = {s.sid: tuple(s.req.prompt) for s in gen.running}
        lent = set(pc.lent_seqs())
        assert lent <= prompts.keys()
        for path, sid in pc.prefixes():
            if sid in lent:
                assert path == prompts[sid] and cache.pos(sid) >= len(path)
        # every pin is one a running sequence holds, and is taken back when it stops
        assert pc.metrics()["pins"] == sum(len(s.pins) for s in gen.running)
        # every cached path is tokens some request really had (prompt, then its output)
        seen = [r.prompt + o for r in ADDED.get(gen, gen.requests) for o in r.outputs]
        for path, _ in pc.prefixes():
            assert any(tuple(t[:len(path)]) == path for t in seen), path
    assert gen.scheduler.pending.size == sum(s.pending is not None for s in gen.running)
    assert sorted(sids + tree) == cache.live_seqs()


def check_tree_kv(gen, ref: Ref):
    """Every cached path's cells hold the keys HF computes for its tokens (sliding layers:
    HF keeps the last window - 1 positions; those are compared)."""
    table = gen.cache.table
    n = 0
    for path, seq in gen.prefix.prefixes():
        cells = np.array([table.seq_cell_at(seq, q) for q in range(len(path))])
        assert (cells >= 0).all()
        for li, k_ref in enumerate(ref.keys(path)):
            kept = k_ref.shape[0]
            k = gen.cache.layer(li).k[cells[len(path) - kept:]]
            np.testing.assert_allclose(k, k_ref.numpy(), atol=2e-5, rtol=1e-4)
        n += 1
    assert n > 0


def serve(gen, prompts, n_new=N_NEW, arrive=None, every=None, **sampling):
    """Adds prompts (``arrive``: how many at first, the rest ``every`` steps one at a time),
    steps to the end checking after every step; returns the requests."""
    return drive(gen, [lambda p=p: gen.add(p, Sampling(max_new_tokens=n_new, **sampling)) for p in prompts],
                 arrive, every)


def drive(gen, adds, arrive=None, every=None):
    """Calls ``adds`` (each adds one request: ``arrive`` of them at first, the rest one every
    ``every`` steps), steps to the end checking after every step; returns the requests."""
    first = len(adds) if arrive is None else arrive
    reqs = [add() for add in adds[:first]]
    if gen not in ADDED:                                 # a generator not from make()
        ADDED[gen] = reqs
    rest = list(adds[first:])
    i = 0
    while True:
        if rest and (every is None or i % every == 0):
            reqs.append(rest.pop(0)())
        busy = gen.step()
        check(gen)
        i += 1
        if not busy and not rest:
            break
        assert i < 5000
    return reqs


def outputs(reqs):
    return [r.outputs for r in reqs]


# -- 1. the same tokens as HF, prefix cache on and off -------------------------------------------

def test_shared_prefixes_with_arrivals_equal_hf_and_the_cache_off(arch):
    name, model, ref = arch
    _, ps = shared_prompts(1, 9)
    rng = np.random.default_rng(2)
    ps += [rng.integers(0, VOCAB, size=13).tolist()]            # one that shares nothing
    got = {}
    for pc in (False, True):
        gen = make(model, pc, prefill_chunk=7)
        reqs = serve(gen, ps, arrive=3, every=2)
        got[pc] = outputs(reqs)
        assert all(r.finish_reasons == ["length"] for r in reqs)
    assert got[True] == got[False] == [[ref.generate(p)] for p in ps]
    st = gen.stats
    assert st["cached_tokens"] >= 7 * S and st["prompt_tokens"] == sum(map(len, ps))
    assert st["prompt_tokens"] == st["cached_tokens"] + st["computed_tokens"]
    check_tree_kv(gen, ref)


def test_forks_share_a_cached_prefix(arch):
    name, model, ref = arch
    _, ps = shared_prompts(3, 4)
    got = {}
    for pc in (False, True):
        gen = make(model, pc)
        reqs = serve(gen, ps, arrive=1, every=3, n=3)
        got[pc] = outputs(reqs)
    assert got[True] == got[False] == [[ref.generate(p)] * 3 for p in ps]
    assert gen.stats["forks"] == 8 and gen.stats["cached_tokens"] >= 3 * S
    # seeded sampling: the same tokens with the cache on and off too
    samp = {}
    for pc in (False, True):
        gen = make(model, pc)
        samp[pc] = outputs(serve(gen, ps, n=2, temperature=0.9, top_k=50, seed=5))
    assert samp[True] == samp[False]


def test_drafts_with_prefix_hits(arch):
    name, model, ref = arch
    _, ps = shared_prompts(4, 5)
    refs = {tuple(p): ref.generate(p) for p in ps}
    rng = np.random.default_rng(6)

    def draft(tokens, k):
        for p, r in refs.items():
            if tuple(tokens[:len(p)]) == p:
                done = len(tokens) - len(p)
                good = r[done:done + k]
                cut = int(rng.integers(0, len(good) + 1))
                return good[:cut] + [int(x) for x in rng.integers(0, VOCAB, size=k - cut)]
        return []

    got = {}
    for pc in (False, True):
        gen = make(model, pc)
        reqs = [gen.add(p, Sampling(max_new_tokens=N_NEW), draft=draft, draft_k=3) for p in ps[:2]]
        gen.step()
        check(gen)
        reqs += [gen.add(p, Sampling(max_new_tokens=N_NEW), draft=draft, draft_k=3) for p in ps[2:]]
        while gen.step():
            check(gen)
        got[pc] = outputs(reqs)
        assert gen.stats["drafted"] > gen.stats["accepted"] > 0
    assert got[True] == got[False] == [[refs[tuple(p)]] for p in ps]
    check_tree_kv(gen, ref)


def test_preemption_and_eviction_under_pressure(arch):
    """A small pool, reserve=0: sequences are preempted and recomputed (their recompute
    hitting the cache), cached prefixes are evicted to make room; the tokens do not
    change and no running sequence loses a cell (checked after every step)."""
    name, model, ref = arch
    _, ps = shared_prompts(7, 8, own=(5, 20))
    rng = np.random.default_rng(8)
    ps += [rng.integers(0, VOCAB, size=int(rng.integers(20, 40))).tolist() for _ in range(4)]
    order = rng.permutation(len(ps))
    ps = [ps[i] for i in order]
    got, stats = {}, {}
    for pc in (False, True):
        gen = make(model, pc, capacity=150, max_batch_tokens=16, prefill_chunk=7, reserve=0.0)
        reqs = serve(gen, ps, n_new=12, arrive=4, every=3)
        got[pc], stats[pc] = outputs(reqs), dict(gen.stats)
        assert all(r.finish_reasons == ["length"] for r in reqs)
    assert got[True] == got[False] == [[ref.generate(p, 12)] for p in ps]
    assert stats[True]["preempted"] > 0
    m = gen.prefix.metrics()
    assert m["evictions"] > 0 and m["evicted_cells"] > 0 and m["hits"] > 0
    assert m["pins"] == 0
    check_tree_kv(gen, ref)


def test_a_fork_that_fits_alone_never_ends_for_capacity_with_the_cache_on(llama):
    """n=2 in a pool one continuation fills: the first ends and is stored (prompt and
    output); the second, preempted meanwhile, is readmitted with a short hit into that long
    cached path. The path's unused tail is evicted for it: both finish, as with the cache
    off."""
    model, ref = llama
    got = {}
    for pc in (False, True):
        gen = make(model, pc, capacity=64, max_batch_tokens=16)
        req = gen.add([1, 2, 3, 4, 5], Sampling(max_new_tokens=60, n=2))
        while gen.step():
            check(gen)
        assert req.finish_reasons == ["length", "length"], pc
        got[pc] = req.outputs
    assert got[True] == got[False] == [ref.generate([1, 2, 3, 4, 5], 60)] * 2


@functools.cache
def _model(name):
    return random_model(name, seed=3)


@pytest.mark.parametrize("name,seed", [("llama-tiny", 0), ("llama-tiny", 1), ("mistral-tiny", 2),
                                       ("tiny", 3)])
def test_randomized_workloads_give_the_same_tokens_with_the_cache_on_and_off(name, seed):
    """Random pools (some tight enough to preempt and to fill with one request), shared
    prefixes longer than the windows, forks, drafts, arrivals over time, reserve: outputs
    and finish reasons are the same with the prefix cache on and off."""
    model = _model(name)
    rng = np.random.default_rng(100 + seed)
    shared = rng.integers(0, VOCAB, size=int(rng.integers(8, 40))).tolist()
    work = []
    for _ in range(int(rng.integers(4, 9))):
        own = rng.integers(0, VOCAB, size=int(rng.integers(1, 10))).tolist()
        prompt = (shared[:int(rng.integers(1, len(shared) + 1))] if rng.random() < 0.7 else []) + own
        work.append((prompt, int(rng.integers(1, 24)), int(rng.choice([1, 1, 2, 3])),
                     bool(rng.random() < 0.3)))
    need = max(len(p) + new - 1 for p, new, _, _ in work)
    capacity = int(rng.integers(need, 2 * need + 40))
    opts = dict(capacity=capacity, max_batch_tokens=min(capacity, int(rng.choice([8, 16, 32]))),
                prefill_chunk=int(rng.choice([4, 7, 16])),
                reserve=float(rng.choice([0.0, 0.5, 1.0])))
    every = int(rng.integers(1, 4))

    def draft(tokens, k):
        return [(tokens[-1] * 31 + j) % VOCAB for j in range(k)]

    got = {}
    for pc in (False, True):
        gen = make(model, pc, **opts)
        reqs = drive(gen, [lambda w=w, g=gen: g.add(w[0], Sampling(max_new_tokens=w[1], n=w[2]),
                                                    draft=draft if w[3] else None, draft_k=2)
                           for w in work], arrive=1, every=every)
        got[pc] = [(r.outputs, r.finish_reasons) for r in reqs]
        assert all(r.done for r in reqs)
    assert got[True] == got[False], opts


def test_a_tight_pool_with_reserve_evicts_instead_of_preempting(llama):
    """reserve=1: the tree gives back its cells as running requests grow and new ones are
    admitted; nothing admitted beside others is preempted; tokens unchanged."""
    model, ref = llama
    shared, ps = shared_prompts(9, 10, own=(10, 30))
    gen = make(model, capacity=200, max_batch_tokens=32, prefill_chunk=16)
    reqs = serve(gen, ps, n_new=10, arrive=2, every=4)
    assert outputs(reqs) == [[ref.generate(p, 10)] for p in ps]
    assert gen.stats["preempted"] == 0
    assert gen.prefix.metrics()["evictions"] > 0


# -- 2. computed prompt tokens: the ideal, exactly ----------------------------------------------

@pytest.mark.parametrize("admission", ["fifo", "lpm"])
@pytest.mark.parametrize("arrive", ["together", "over-time"])
def test_a_shared_system_prompt_is_computed_once(arch, admission, arrive):
    """16 requests of S shared + own tokens (the own parts differ from their first token),
    and a 17th repeating the fourth: computed = S + sum(own) + 1, the 1 being the repeated
    prompt's last token (a hit stops one token short, whose logits are needed). Requests
    that arrive while the shared prefix is still being read wait for it instead of
    computing it again."""
    name, model, ref = arch
    shared, ps = shared_prompts(10, 16, own=(3, 20), dup=True)
    gen = make(model, admission=admission, max_batch_tokens=64, prefill_chunk=16)
    reqs = serve(gen, ps, arrive=None if arrive == "together" else 1, every=1)
    own = sum(len(p) - S for p in ps[:16])
    st = gen.stats
    assert st["computed_tokens"] == S + own + 1
    assert st["prompt_tokens"] == sum(map(len, ps))
    assert st["cached_tokens"] == st["prompt_tokens"] - st["computed_tokens"]
    assert st["preempted"] == 0
    assert outputs(reqs) == [[ref.generate(p)] for p in ps]
    off = make(model, False, max_batch_tokens=64, prefill_chunk=16)
    serve(off, ps)
    assert off.stats["computed_tokens"] == sum(map(len, ps))


def test_multi_turn_chat_computes_only_the_new_tokens(arch):
    """4 conversations x 5 turns; each turn's prompt = the previous turn's prompt + its
    reply + a new message. The cache holds the previous prompt and every reply token but
    the last (never fed), so a turn computes 1 + len(message): ideal = sum over
    conversations of len(first prompt) + sum over later turns of (1 + len(message))."""
    name, model, ref = arch
    rng = np.random.default_rng(12)
    n_conv, turns = 4, 5
    first = [rng.integers(0, VOCAB, size=int(rng.integers(10, 25))).tolist() for _ in range(n_conv)]
    msgs = [[rng.integers(0, VOCAB, size=int(rng.integers(2, 9))).tolist() for _ in range(turns)]
            for _ in range(n_conv)]

    def chat(pc):                                     # the driver tools/bench_serve.py uses
        gen = make(model, pc, max_batch_tokens=32, prefill_chunk=8, capacity=2048)
        done = drive_chat(gen, first, msgs, Sampling(max_new_tokens=6), after_step=lambda: check(gen))
        assert [t[:2] for t in done] == [(c, k) for c in range(n_conv) for k in range(turns)]
        return gen, done

    gen, done = chat(True)
    ideal = sum(len(first[c]) + sum(1 + len(msgs[c][k]) for k in range(1, turns))
                for c in range(n_conv))
    assert gen.stats["computed_tokens"] == ideal
    off, done_off = chat(False)
    assert [r.outputs for *_, r in done] == [r.outputs for *_, r in done_off]
    assert [r.outputs[0] for *_, r in done] == [ref.generate(r.prompt, 6) for *_, r in done]
    assert off.stats["computed_tokens"] == sum(len(r.prompt) for *_, r in done_off)
    check_tree_kv(gen, ref)


# -- 3. transactions -----------------------------------------------------------------------------

def tree_state(gen):
    m = gen.prefix.metrics()
    return (gen.prefix.prefixes(), m["pins"], m["leaves"], m["cached_tokens"], m["nodes"],
            gen.cache.live_seqs(), gen.cache.free_cells, [id(s) for s in gen.waiting],
            [id(s) for s in gen.running], [(s.in_cache, len(s.pins)) for s in gen.running])


@pytest.mark.parametrize("where,exc", [
    ("prepare", RuntimeError("CUDA error: device-side assert")), ("prepare", KeyboardInterrupt()),
    ("forward", RuntimeError("CUDA error: device-side assert")), ("forward", KeyboardInterrupt()),
    ("sampling", KeyboardInterrupt())],        # an Exception in sampling is the request's own
    ids=["prepare-torch-error", "prepare-interrupt", "forward-torch-error", "forward-interrupt",
         "sampling-interrupt"])
def test_a_failed_step_with_prefix_hits_rolls_back(llama, where, exc):
    """Requests sharing a cached prefix are admitted (hits cloned and pinned) in a step
    whose prepare, forward or sampling fails: the clones are dropped, the pins taken back,
    nothing stored, the queues as they were; then the run ends with the same tokens."""
    model, ref = llama
    _, ps = shared_prompts(13, 6)
    gen = make(model)
    reqs = [gen.add(ps[0], Sampling(max_new_tokens=N_NEW))]
    while gen.prefix.metrics()["leaves"] == 0:                    # the first prompt stored
        gen.step()
    reqs += [gen.add(p, Sampling(max_new_tokens=N_NEW)) for p in ps[1:]]
    if where == "sampling":
        target, name = gen.sampler, "launch"
    else:
        target, name = (gen.cache, "prepare_step") if where == "prepare" else (gen.runner, "forward")
    real = getattr(target, name)

    def failing(*a, **k):
        raise exc

    setattr(target, name, failing)
    before = tree_state(gen)
    hits = gen.prefix.metrics()["hits"]
    with pytest.raises(type(exc)):
        gen.step()
    assert gen.prefix.metrics()["hits"] > hits                   # the step did match
    assert tree_state(gen) == before
    check(gen)
    setattr(target, name, real)
    while gen.step():
        check(gen)
    assert outputs(reqs) == [[ref.generate(p)] for p in ps]
    assert gen.stats["computed_tokens"] == len(ps[0]) + sum(len(p) - S for p in ps[1:])


def test_an_on_event_error_is_raised_once_the_step_is_whole(llama):
    model, ref = llama
    _, ps = shared_prompts(14, 4)
    seen = []

    def on_event(ev):
        seen.append(ev.kind)
        if ev.kind == "stored" and seen.count("stored") == 1:
            raise ValueError("router unreachable")

    gen = make(model, {"on_event": on_event, "policy": "lfu"})
    reqs = [gen.add(p, Sampling(max_new_tokens=N_NEW)) for p in ps]
    with pytest.raises(ValueError, match="router"):
        while gen.step():
            check(gen)
    check(gen)
    while gen.step():
        check(gen)
    assert outputs(reqs) == [[ref.generate(p)] for p in ps]
    assert seen.count("stored") > 1


def test_an_on_event_error_while_a_finished_sequence_is_given_to_the_tree(llama):
    """A finished sequence's id goes to the tree (PrefixCache.give); a callback raising on
    that store leaves the id the tree's, not removed twice nor leaked."""
    model, ref = llama
    _, ps = shared_prompts(16, 4)
    raised = []

    def on_event(ev):
        # a store with output tokens in it: a finished sequence's (prompts alone are shorter)
        if ev.kind == "stored" and len(ev.tokens) > max(map(len, ps)) and not raised:
            raised.append(ev.tokens.tolist())
            raise ValueError("router unreachable")

    gen = make(model, {"on_event": on_event})
    reqs = [gen.add(p, Sampling(max_new_tokens=N_NEW)) for p in ps]
    with pytest.raises(ValueError, match="router"):
        while gen.step():
            check(gen)
    check(gen)
    [path] = raised
    assert any(p == tuple(path) for p, _ in gen.prefix.prefixes())   # stored all the same
    while gen.step():
        check(gen)
    assert outputs(reqs) == [[ref.generate(p)] for p in ps]
    check_tree_kv(gen, ref)


def test_cancel_and_errors_release_pins_and_store_what_was_computed(llama):
    model, ref = llama
    _, ps = shared_prompts(15, 6, own=(8, 20))
    gen = make(model, prefill_chunk=4)
    reqs = [gen.add(ps[0], Sampling(max_new_tokens=N_NEW))]
    gen.run()
    calls = {"n": 0}

    def bad(req, k, tok):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("client code")

    reqs += [gen.add(p, Sampling(max_new_tokens=N_NEW), on_token=bad if i == 2 else None)
             for i, p in enumerate(ps[1:], 1)]
    gen.step()
    check(gen)
    assert gen.prefix.metrics()["pins"] > 0
    gen.cancel(reqs[1])                                          # mid-prompt, with a hit
    check(gen)
    with pytest.raises(RuntimeError, match="client code"):
        while gen.step():
            check(gen)
    check(gen)
    gen.run()
    check(gen)
    assert reqs[1].finish_reasons == ["cancelled"] and reqs[2].finish_reasons == ["error"]
    assert gen.prefix.metrics()["pins"] == 0
    for i, r in enumerate(reqs):
        if i not in (1, 2):
            assert r.outputs == [ref.generate(ps[i])]
    # what the cancelled request had placed was stored: a repeat of its prompt hits it
    assert gen.prefix.peek(ps[1]) > S


def test_prompts_are_lent_to_the_tree_while_their_requests_run(llama):
    """A placed prompt is stored by lending its running sequence (no clone: the cache holds
    one id a request); a request arriving later hits the lent prompt, and each ending
    request's sequence becomes the tree's own leaf."""
    model, ref = llama
    _, ps = shared_prompts(31, 4)
    gen = make(model, prefill_chunk=64, max_batch_tokens=256)
    reqs = [gen.add(p, Sampling(max_new_tokens=N_NEW)) for p in ps]
    pc, cache = gen.prefix, gen.cache
    while len(pc.lent_seqs()) < 4:            # the shared prefix computed once, then hit
        assert gen.step() and all(r.finished is None for r in reqs)
        check(gen)
    running = sorted(s.sid for s in gen.running)
    assert len(running) == 4 and pc.lent_seqs() == running and pc.owned_seqs() == []
    assert pc.metrics()["hit_tokens"] >= 3 * S
    assert cache.live_seqs() == running       # no clone was made for the tree
    assert sorted(p for p, _ in pc.prefixes()) == sorted(tuple(p) for p in ps)
    more = ps[0] + [7, 8, 9]
    reqs += serve(gen, [more])                # hits the first request's lent prompt
    assert pc.metrics()["hit_tokens"] >= len(ps[0])
    assert outputs(reqs) == [[ref.generate(p)] for p in ps + [more]]
    m = pc.metrics()
    assert m["lent"] == 0 and m["reclaims"] == 0 and len(pc.owned_seqs()) == m["leaves"] == 5


def test_a_lent_prompt_holds_no_pin_and_a_cached_one_only_its_hit(llama):
    """A prompt its request lends needs no pin (a lent leaf is never evicted): a running
    request holds only its hit's pin. A prompt the tree held already (a repeat of one still
    running) is not lent: that request keeps its hit's pin (all but the last token, which
    it computes into a cell of its own), and the pin goes when it ends."""
    model, ref = llama
    _, ps = shared_prompts(33, 4, dup=True)   # ps[4] repeats ps[3]
    gen = make(model, prefill_chunk=64, max_batch_tokens=256)
    reqs = [gen.add(p, Sampling(max_new_tokens=4 * N_NEW)) for p in ps[:4]]
    pc = gen.prefix
    while len(pc.lent_seqs()) < 4:
        assert gen.step()
        check(gen)
    assert all(n < len(s.req.prompt) for s in gen.running for _, n in s.pins)
    assert sum(len(s.pins) for s in gen.running) == 3      # the three hits on the shared prefix
    dup = gen.add(ps[4], Sampling(max_new_tokens=N_NEW))
    while not any(s.req is dup and s.stored for s in gen.running):
        assert gen.step()
        check(gen)
    s = next(s for s in gen.running if s.req is dup)
    assert s.sid not in pc.lent_seqs() and [n for _, n in s.pins] == [len(ps[4]) - 1]
    reqs.append(dup)
    while gen.step():
        check(gen)
    assert pc.metrics()["pins"] == 0
    assert outputs(reqs) == [[ref.generate(p, 4 * N_NEW)] for p in ps[:4]] + [[ref.generate(ps[4])]]


@pytest.mark.parametrize("prompt_len", [3, 40])
def test_a_repeated_prompt_alone_gets_every_token_that_fits(llama, prompt_len):
    """A request whose whole prompt the tree holds, alone in a cache sized for it exactly
    (``capacity - prompt + 1`` new tokens), gets them all as the first one did: the tree's
    copy of the prompt's last token, which the request computes again, is not held from
    eviction for it."""
    model, ref = llama
    cap = 96
    gen = make(model, capacity=cap, max_seqs=4, max_batch_tokens=64, prefill_chunk=64)
    prompt = np.random.default_rng(prompt_len).integers(0, VOCAB, size=prompt_len).tolist()
    want = cap - prompt_len + 1
    first = gen.add(prompt, Sampling(max_new_tokens=want))
    gen.run()
    again = gen.add(prompt, Sampling(max_new_tokens=want))
    gen.run()
    assert again.cached_tokens == prompt_len - 1
    for r in (first, again):
        assert len(r.outputs[0]) == want and r.finish_reasons == ["length"]
    assert again.outputs == first.outputs == [ref.generate(prompt, want)]
    assert gen.prefix.metrics()["pins"] == 0
    check(gen)


def test_a_preempted_request_keeps_the_prompt_it_lent_cached(llama):
    """Requests that run out of cells while decoding preempt the newest, whose prompt the
    tree holds by lending: the tree clones it first (reclaim), so the prompt stays cached
    and the request's recompute hits it; the tokens do not change."""
    model, ref = llama
    rng = np.random.default_rng(21)
    ps = [rng.integers(0, VOCAB, size=20).tolist() for _ in range(3)]
    gen = make(model, capacity=120, max_batch_tokens=64, prefill_chunk=64, reserve=0.0)
    reqs = [gen.add(p, Sampling(max_new_tokens=40)) for p in ps]
    pc, kept = gen.prefix, 0
    while True:
        lent = {s.sid: s.req.prompt for s in gen.running if s.sid in pc.lent_seqs()}
        before = gen.stats["preempted"]
        busy = gen.step()
        check(gen)
        if gen.stats["preempted"] > before:
            for s in gen.waiting:             # a preempted lender: its prompt stays cached
                if s.req.prompt in lent.values():
                    assert pc.peek(s.req.prompt) == len(s.req.prompt)
                    kept += 1
        if not busy:
            break
    assert kept > 0
    m = pc.metrics()
    assert m["reclaims"] >= kept and m["lent"] == 0
    assert outputs(reqs) == [[ref.generate(p, 40)] for p in ps]


# -- 4. admission policy, options, ids, CLI ------------------------------------------------------

def test_lpm_admits_the_longest_cached_prefix_first(llama):
    model, ref = llama
    shared, ps = shared_prompts(16, 3, own=(4, 6))
    rng = np.random.default_rng(17)
    other = [rng.integers(0, VOCAB, size=20).tolist() for _ in range(2)]
    started = {}
    for admission in ("fifo", "lpm"):
        gen = make(model, admission=admission, max_batch_tokens=24, prefill_chunk=24)
        gen.add(ps[0], Sampling(max_new_tokens=1))
        gen.run()                                                # ps[0] cached
        reqs = [gen.add(p, Sampling(max_new_tokens=2)) for p in other + ps[1:]]
        gen.step()                                               # 24 rows: who got them?
        started[admission] = [bool(r.outputs[0]) for r in reqs]
        while gen.step():
            check(gen)
        assert outputs(reqs) == [[ref.generate(p, 2)] for p in other + ps[1:]]
    assert started["fifo"] == [True, False, False, False]        # arrival order
    assert started["lpm"] == [False, False, True, True]          # the cached prefix first


def test_options_ids_and_refusals(llama):
    model, _ = llama
    attn = model.config._attn_implementation
    gen = make(model, max_seqs=10)
    assert isinstance(gen.prefix, PrefixCache) and gen.prefix.policy == "lru"
    assert gen.cache.max_seqs == 20 and gen.prefix.max_seqs == 10     # running ids kept whole
    gen = make(model, {"policy": "lfu", "max_seqs": 3}, max_seqs=10)
    assert gen.prefix.policy == "lfu" and gen.prefix.max_seqs == 3 and gen.cache.max_seqs == 13
    assert make(model, False).prefix is None
    cfg = cchf.cache_config(model, capacity=512, max_write=32, max_seqs=16)
    cache = HostCellCache(cfg)
    held = [cache.seq_new() for _ in range(4)]
    gen = Generator(model, cache, eos=[])
    assert gen.prefix.max_seqs == 6 and gen.prefix.cache is cache     # half the 12 ids left
    pc = PrefixCache(cache, max_seqs=2)
    assert Generator(model, cache, eos=[], prefix_cache=pc).prefix is pc
    assert Generator(model, prefix_cache=pc, eos=[]).cache is cache
    other = HostCellCache(cfg)
    for kw, fragment in [(dict(prefix_cache="yes"), "not a bool"),
                         (dict(prefix_cache={"polcy": "lru"}), "polcy"),
                         (dict(prefix_cache={"policy": "mru"}), "policy"),
                         (dict(prefix_cache={"max_seqs": 0}), "max_seqs"),
                         (dict(admission="lifo"), "admission"),
                         (dict(cache=cache, prefix_cache=PrefixCache(other)), "another cache")]:
        model.set_attn_implementation("sdpa")
        kw.setdefault("capacity", 256)
        with pytest.raises(InvalidArgument, match=fragment):
            Generator(model, max_batch_tokens=16, eos=[], **kw)
        assert model.config._attn_implementation == "sdpa"       # refused before attaching
    assert len(held) == 4 and attn


def test_no_free_id_evicts_a_cached_prefix(llama):
    """Every id but the tree's is taken: admission takes one back from the tree."""
    model, ref = llama
    _, ps = shared_prompts(18, 6)
    cfg = cchf.cache_config(model, capacity=512, max_write=32, max_seqs=4)
    cache = HostCellCache(cfg)
    gen = Generator(model, cache, prefill_chunk=8, eos=[], prefix_cache={"max_seqs": 3})
    reqs = serve(gen, ps, arrive=2, every=2)
    assert outputs(reqs) == [[ref.generate(p)] for p in ps]
    assert gen.prefix.metrics()["evictions"] > 0


def test_cli_prefix_cache_flags(capsys):
    args = ["--random", "llama-tiny", "--quiet", "--json", "--max-new-tokens", "3", "--device", "cpu",
            "7 8 9 10 11 12 13 14 15 16 1 2", "7 8 9 10 11 12 13 14 15 16 3 4"]
    assert main(args) == 0
    on = json.loads(capsys.readouterr().out)["summary"]
    assert main(args + ["--no-prefix-cache", "--admission", "lpm"]) == 0
    off = json.loads(capsys.readouterr().out)["summary"]
    assert on["prefix_cache"] is True and off["prefix_cache"] is False and off["admission"] == "lpm"
    assert on["prompt_tokens"] == off["prompt_tokens"] == 24
    assert on["computed_tokens"] == 12 + 2 and on["cached_tokens"] == 10
    assert off["computed_tokens"] == 24 and off["cached_tokens"] == 0


def test_requests_record_the_time_to_first_token(llama):
    model, _ = llama
    _, ps = shared_prompts(20, 3)
    gen = make(model)
    reqs = [gen.add(p, Sampling(max_new_tokens=3)) for p in ps]
    assert all(r.first_token is None for r in reqs)
    gen.run()
    assert all(r.arrived <= r.first_token <= r.finished for r in reqs)
