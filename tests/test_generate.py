"""The generator's contract under failure, refusal, cancellation and threads (SPEC §9):
after any exception inside a step the cache holds exactly what the generator believes and
later steps emit what they would have emitted had the failing request been cancelled;
requests that cannot fit never loop; admission keeps recompute near the minimum; every
refusal raises InvalidArgument with nothing queued; the CLI fails in one line.

Greedy on tiny random models (CPU): a request's output does not depend on what else runs,
so a clean run of the other requests is the reference."""

from __future__ import annotations

import itertools
import json
import signal
import threading
from collections.abc import Mapping

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cellcache import HostCellCache, InvalidArgument, InvalidState, OutOfMemory  # noqa: E402
from cellcache import generate as cgen  # noqa: E402
from cellcache import hf as cchf  # noqa: E402
from cellcache.generate import FINISH_REASONS, Generator, Sampling, main, random_model  # noqa: E402
from cellcache.generate.requests import MAX_STOPS  # noqa: E402

VOCAB = 512
N_NEW = 10
WAIT = 60          # seconds: a fail-safe on Event waits only, never a timing assertion


@pytest.fixture(scope="module")
def model():
    return random_model("llama-tiny", seed=3)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(0, VOCAB, size=n).tolist() for n in (5, 9, 14, 3, 20)]


def make(model, **kw):
    opts = dict(capacity=256, max_batch_tokens=16, max_seqs=16, prefill_chunk=8, eos=[])
    opts.update(kw)
    return Generator(model, **opts)


def clean(model, prompts, n_new=N_NEW, **kw):
    """Outputs of the prompts served alone (the reference)."""
    gen = make(model, **kw)
    reqs = [gen.add(p, Sampling(max_new_tokens=n_new)) for p in prompts]
    gen.run()
    assert all(r.finish_reasons == ["length"] for r in reqs)
    return [r.outputs[0] for r in reqs]


def check_consistent(gen, foreign=()):
    """The cache holds exactly what the generator believes: each running sequence owns its
    in_cache tokens at positions [0, in_cache), nothing else is live, waiting ones hold
    nothing."""
    cache = gen.cache
    cache.check_invariants()
    sids = []
    for s in gen.running:
        assert s.sid is not None and s.req.finish_reasons[s.index] is None
        assert cache.pos(s.sid) == s.in_cache == cache.seq_len(s.sid)
        assert len(s.tokens) > s.in_cache
        sids.append(s.sid)
    for s in gen.waiting:
        assert s.sid is None and s.in_cache == 0 and s.req.finish_reasons[s.index] is None
    tree = gen.prefix.owned_seqs() if gen.prefix is not None else []
    if gen.prefix is not None:
        gen.prefix.check_invariants()
    assert sorted(sids + list(foreign) + tree) == cache.live_seqs()


def idle(gen):
    """Nothing runs: the cache holds only the prefix cache's sequences (cached prompts and
    outputs); once it is cleared, nothing."""
    tree = gen.prefix.owned_seqs() if gen.prefix is not None else []
    assert gen.cache.live_seqs() == tree
    if gen.prefix is not None:
        gen.prefix.clear()
    return gen.cache.live_seqs() == [] and gen.cache.free_cells == gen.cache.capacity


def snapshot(gen):
    return (len(gen.requests), [id(s) for s in gen.waiting], [id(s) for s in gen.running],
            len(gen._incoming), gen._ids, gen.cache.live_seqs(), gen.cache.free_cells,
            dict(gen.stats))


def run_through(gen, exc_type, *, expect_raise=True):
    """Runs to the end; the first run() raises exc_type (when expected), the state is
    consistent right after, and the rest completes."""
    if expect_raise:
        with pytest.raises(exc_type):
            gen.run()
        check_consistent(gen)
    gen.run()
    check_consistent(gen)
    assert idle(gen)


# -- 1. failures inside a step --------------------------------------------------------------------

def test_on_token_that_raises_ends_only_its_request(model, prompts):
    streamed: dict[int, list[int]] = {}

    def stream(req, k, tok):
        streamed.setdefault(req.id, []).append(tok)
        if req.id == 1 and len(streamed[1]) == 3:
            raise ValueError("client went away")

    gen = make(model)
    reqs = [gen.add(p, Sampling(max_new_tokens=N_NEW), on_token=stream) for p in prompts]
    run_through(gen, ValueError)
    bad = reqs[1]
    assert bad.finish_reasons == ["error"] and bad.done and isinstance(bad.error, ValueError)
    assert len(streamed[1]) == 3                      # no callback after the failing one
    others = [r for r in reqs if r is not bad]
    refs = clean(model, [prompts[r.id] for r in others])
    assert [r.outputs[0] for r in others] == refs
    assert all(streamed[r.id] == r.outputs[0] for r in others)    # nothing lost to the others
    assert bad.outputs[0] == clean(model, [prompts[1]])[0][:len(bad.outputs[0])]


def test_draft_that_raises_ends_only_its_request(model, prompts):
    calls = {"n": 0}

    def bad_draft(tokens, k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("draft model crashed")
        return [(tokens[-1] * 7 + 1) % VOCAB] * k

    def good_draft(tokens, k):
        return [(tokens[-1] * 7 + 1) % VOCAB] * k     # mostly rejected: rewinds happen

    gen = make(model)
    reqs = [gen.add(p, Sampling(max_new_tokens=N_NEW), draft=bad_draft if i == 2 else good_draft,
                    draft_k=3) for i, p in enumerate(prompts)]
    run_through(gen, RuntimeError)
    assert reqs[2].finish_reasons == ["error"] and isinstance(reqs[2].error, RuntimeError)
    others = [r for i, r in enumerate(reqs) if i != 2]
    assert [r.outputs[0] for r in others] == clean(model, [prompts[r.id] for r in others])
    assert gen.stats["drafted"] > gen.stats["accepted"]


@pytest.mark.parametrize("proposal", [[1.5], ["7"], [True], [VOCAB], [-1], 5, None, [[1, 2]],
                                      torch.tensor([0.5]), np.array([VOCAB + 3]), range(10**18),
                                      range(2**70), np.broadcast_to(np.int64(1), (10**18,))],
                         ids=["float", "str", "bool", "vocab", "negative", "int", "none", "nested",
                              "float-tensor", "array-out-of-vocab", "range-1e18", "range-2**70",
                              "broadcast-1e18"])
def test_invalid_draft_ends_its_request_and_is_never_fed(model, prompts, proposal):
    fed_max = []

    gen = make(model)
    real_forward = gen.runner.forward

    def forward(step, tokens, *a, **k):
        fed_max.append(max(int(t) for t in tokens))
        return real_forward(step, tokens, *a, **k)

    gen.runner.forward = forward
    reqs = [gen.add(p, Sampling(max_new_tokens=N_NEW), draft=(lambda t, k: proposal) if i == 0 else None)
            for i, p in enumerate(prompts[:3])]
    run_through(gen, InvalidArgument)
    assert reqs[0].finish_reasons == ["error"] and isinstance(reqs[0].error, InvalidArgument)
    assert "draft of request 0" in str(reqs[0].error)
    assert max(fed_max) < VOCAB
    assert [r.outputs[0] for r in reqs[1:]] == clean(model, prompts[1:3])


def test_endless_iterators_as_prompts_and_drafts(model, prompts):
    """A prompt from an iterator is read for at most the cache's capacity (one that yields
    more is refused, nothing queued; an endless one used to fill memory); a draft from an
    iterator is read for the k ids asked (the request runs as with a list draft)."""
    import itertools

    gen = make(model)
    for endless in (iter(int, 1), itertools.count(1)):
        with pytest.raises(InvalidArgument, match="prompt yields more than 256 token ids"):
            gen.add(endless, Sampling(max_new_tokens=2))
    assert not gen.waiting and not gen.running
    assert gen.encode(iter(prompts[0])) == prompts[0]

    def endless_draft(tokens, k):
        return itertools.repeat((tokens[-1] * 7 + 1) % VOCAB)

    def list_draft(tokens, k):
        return [(tokens[-1] * 7 + 1) % VOCAB] * k

    outs = []
    for draft in (endless_draft, list_draft):
        g = make(model)
        req = g.add(prompts[1], Sampling(max_new_tokens=N_NEW), draft=draft, draft_k=3)
        g.run()
        outs.append((req.outputs[0], req.finish_reasons, g.stats["drafted"]))
    assert outs[0] == outs[1] and outs[0][1] == ["length"] and outs[0][2] > 0
    assert outs[0][0] == clean(model, [prompts[1]])[0]


# huge lazy sequences: no memory holds 10**18 ids (list() raised a bare MemoryError) and
# len(range(2**70)) is past sys.maxsize (list() raised OverflowError)
HUGE = [range(10**18), range(2**70), np.broadcast_to(np.int64(1), (10**18,)),
        torch.ones(1, dtype=torch.long).expand(10**18)]


@pytest.mark.parametrize("what", ["prompt", "stop", "stop_strings", "eos"])
@pytest.mark.parametrize("huge", HUGE, ids=["range-1e18", "range-2**70", "broadcast-1e18", "expand-1e18"])
def test_huge_lazy_sequences_are_refused_unread(model, what, huge):
    """A prompt, stop ids, stop strings or end-of-sequence ids given as a huge lazy sequence
    are refused by their length before they are read (InvalidArgument, nothing queued or
    built): a prompt past the cache's capacity, the others past MAX_STOPS. (Drafts:
    test_invalid_draft_ends_its_request_and_is_never_fed.)"""
    gen = make(model)
    gen.add([1, 2, 3])
    before = snapshot(gen)
    attn = model.config._attn_implementation
    if what == "prompt":
        with pytest.raises(InvalidArgument, match="prompt holds more than 256 token ids"):
            gen.add(huge)
        with pytest.raises(InvalidArgument, match="prompt holds more than 256 token ids"):
            gen.encode(huge)
    elif what == "eos":
        with pytest.raises(InvalidArgument, match=f"eos holds more than {MAX_STOPS} "):
            Generator(model, gen.cache, eos=huge)
    else:
        match = f"{what} holds more than {MAX_STOPS} "
        with pytest.raises(InvalidArgument, match=match):
            Sampling(**{what: huge})
        sp = Sampling()
        setattr(sp, what, huge)                       # set after construction: add checks it again
        with pytest.raises(InvalidArgument, match=match):
            gen.add([1, 2, 3], sp)
    assert snapshot(gen) == before and model.config._attn_implementation == attn


class _HugeMapping(Mapping):
    """10**18 logit biases, made on read: ``lies`` says it holds 3."""

    def __init__(self, lies: bool = False):
        self.lies = lies

    def __getitem__(self, key):
        return 1.0

    def __iter__(self):
        return iter(itertools.count())

    def __len__(self):
        return 3 if self.lies else 10**18


@pytest.mark.parametrize("lies", [False, True], ids=["huge", "lying-len"])
def test_a_huge_lazy_logit_bias_is_refused_unread(model, lies):
    """A logit_bias mapping of 10**18 made-up entries was read to the end (forever); it is
    refused by its length, and one whose length lies is read no further than the bound."""
    from cellcache.generate.requests import BIAS_ENTRIES

    gen = make(model)
    before = snapshot(gen)
    with pytest.raises(InvalidArgument, match=f"logit_bias (holds|yields) more than {BIAS_ENTRIES} entries"):
        Sampling(logit_bias=_HugeMapping(lies))
    if not lies:                                     # (a million reads a try: once is enough)
        sp = Sampling()
        sp.logit_bias = _HugeMapping(lies)           # set after construction: add checks it again
        with pytest.raises(InvalidArgument, match="logit_bias holds more than"):
            gen.add([1, 2, 3], sp)
    assert snapshot(gen) == before


class _OddLen:
    """Items (``endless``: the first repeated forever) behind a ``__len__`` that raises or
    answers what ``len()`` refuses (TypeError for a float, ValueError below 0), or lies."""

    def __init__(self, items, length, endless=False):
        self.items, self.length, self.endless = items, length, endless

    def __len__(self):
        if isinstance(self.length, BaseException):
            raise self.length
        return self.length

    def __iter__(self):
        return itertools.repeat(self.items[0]) if self.endless else iter(self.items)


class _EndlessList(list):
    def __iter__(self):
        return itertools.repeat(self[0])


class _EndlessTuple(tuple):
    def __iter__(self):
        return itertools.repeat(self[0])


@pytest.mark.parametrize("what", ["prompt", "stop", "stop_strings", "eos"])
@pytest.mark.parametrize("odd", ["len-typeerror", "len-valueerror", "len-float", "len-negative",
                                 "len-lies-endless", "list-subclass-endless", "tuple-subclass-endless"])
def test_sequences_whose_len_fails_or_lies_are_read_bounded(model, what, odd):
    """Ids (or stop strings) whose ``__len__`` raises or answers no length are read as an
    iterable of no length, at most the limit and one: whole, they are taken (list() took
    them too: it drops a len() TypeError), endless, refused with InvalidArgument and nothing
    changed; a bare TypeError or ValueError escaped from the length check. A list or
    tuple subclass whose iterator never ends is read bounded too (list() read it until
    memory ran out: MemoryError)."""
    items = ["a", "b", "c"] if what == "stop_strings" else [1, 2, 3]
    value = {"len-typeerror": lambda: _OddLen(items, TypeError("no length")),
             "len-valueerror": lambda: _OddLen(items, ValueError("no length")),
             "len-float": lambda: _OddLen(items, 3.0),
             "len-negative": lambda: _OddLen(items, -1),
             "len-lies-endless": lambda: _OddLen(items, 3, endless=True),
             "list-subclass-endless": lambda: _EndlessList(items),
             "tuple-subclass-endless": lambda: _EndlessTuple(items)}[odd]
    endless = odd.endswith("endless")
    gen = make(model)
    gen.add([1, 2, 3])
    before = snapshot(gen)
    limit = 256 if what == "prompt" else MAX_STOPS
    refused = pytest.raises(InvalidArgument, match=f"{what} yields more than {limit} ")
    if what == "prompt":
        if endless:
            with refused:
                gen.add(value())
        else:
            assert gen.encode(value()) == items
    elif what == "eos":
        if endless:
            with refused:
                Generator(model, gen.cache, eos=value())
        else:
            assert Generator(model, capacity=64, eos=value()).eos == set(items)
    else:
        if endless:
            with refused:
                Sampling(**{what: value()})
        else:
            assert getattr(Sampling(**{what: value()}), what) == tuple(items)
    assert snapshot(gen) == before


def _mixed(gen, prompts):
    """Greedy requests with chunked prefill, a fork (n=2) and a drafting request."""
    def draft(tokens, k):
        return [(tokens[-1] * 7 + 1) % VOCAB, tokens[-1]][:k]

    reqs = []
    for i, p in enumerate(prompts):
        reqs.append(gen.add(p, Sampling(max_new_tokens=N_NEW, n=2 if i == 1 else 1),
                            draft=draft if i == 3 else None, draft_k=2))
    return reqs


@pytest.fixture(scope="module")
def mixed_refs(model, prompts):
    gen = make(model)
    reqs = _mixed(gen, prompts)
    gen.run()
    return [r.outputs for r in reqs], dict(gen.stats)


@pytest.mark.parametrize("where", ["prepare", "forward"])
@pytest.mark.parametrize("exc", [RuntimeError("CUDA error: device-side assert"), KeyboardInterrupt()],
                         ids=["torch-error", "interrupt"])
@pytest.mark.parametrize("at", [1, 4])
def test_a_failed_forward_rolls_the_step_back(model, prompts, mixed_refs, where, exc, at):
    """The first step (everything admitted in it) or a later one (forks, drafts, chunks)
    fails in prepare_step or the forward: rolled back, and the outputs are those of a run
    that never failed."""
    gen = make(model)
    target = gen.cache if where == "prepare" else gen.runner
    name = "prepare_step" if where == "prepare" else "forward"
    real = getattr(target, name)
    calls = {"n": 0}

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] == at:
            raise exc
        return real(*a, **k)

    setattr(target, name, failing)
    reqs = _mixed(gen, prompts)
    for _ in range(at - 1):
        gen.step()
    before = snapshot(gen)
    with pytest.raises(type(exc)):
        gen.step()
    assert snapshot(gen)[:7] == before[:7]            # the queues and the cache, not the stats
    check_consistent(gen)
    assert all(r.error is None and not r.done for r in reqs)
    run_through(gen, None, expect_raise=False)
    refs, ref_stats = mixed_refs
    assert [r.outputs for r in reqs] == refs
    assert gen.stats["tokens_out"] == ref_stats["tokens_out"]


def test_a_forward_refused_after_a_detach_rolls_back_and_resumes_after_reattach(model, prompts):
    gen = make(model)
    reqs = [gen.add(p, Sampling(max_new_tokens=N_NEW)) for p in prompts]
    for _ in range(3):
        gen.step()
    before = snapshot(gen)
    model.set_attn_implementation("sdpa")             # the documented detach
    with pytest.raises(InvalidState):
        gen.step()
    assert snapshot(gen)[:7] == before[:7]
    check_consistent(gen)
    gen.runner.reattach()
    gen.run()
    assert [r.outputs[0] for r in reqs] == clean(model, prompts)


@pytest.mark.parametrize("where", ["schedule", "update_from_output"])
def test_ctrl_c_during_the_bookkeeping_is_held_until_the_step_is_whole(model, prompts, where):
    """SIGINT arriving while the rows are chosen (the step is then rolled back) or while
    the outcomes are applied (the step completes, its tokens are delivered): either way
    KeyboardInterrupt comes out of step() with the state whole, and nothing is lost."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("needs the main thread with Python's default SIGINT handler")
    gen = make(model)
    streamed: dict[int, list[int]] = {}

    def record(req, k, tok):
        streamed.setdefault(req.id, []).append(tok)

    reqs = [gen.add(p, Sampling(max_new_tokens=N_NEW), on_token=record) for p in prompts]
    real = getattr(gen.scheduler, where)
    calls = {"n": 0}

    def interrupted(*a, **k):
        calls["n"] += 1
        if calls["n"] == 1 and where == "update_from_output":
            signal.raise_signal(signal.SIGINT)        # Ctrl-C before any outcome is applied
        out = real(*a, **k)
        if calls["n"] == 1 and where == "schedule":
            signal.raise_signal(signal.SIGINT)        # Ctrl-C once sequences were admitted
        return out

    setattr(gen.scheduler, where, interrupted)
    before = snapshot(gen)
    with pytest.raises(KeyboardInterrupt):
        gen.step()
    assert calls["n"] == 1
    if where == "schedule":
        assert snapshot(gen)[:7] == before[:7]
    check_consistent(gen)
    gen.run()
    assert [r.outputs[0] for r in reqs] == clean(model, prompts)
    assert all(streamed[r.id] == r.outputs[0] for r in reqs)


class _Interrupted:
    """A launched step's draws whose landing is interrupted (what the sampler's launch
    returns, in its place)."""

    def __init__(self, draw):
        self.device_ids = draw.device_ids

    def result(self):
        raise KeyboardInterrupt


def test_an_interrupt_in_sampling_rolls_back_and_the_draws_repeat(model, prompts):
    """Seeded sampling, forks: an interrupt while a step's draws land (the generator's
    sampler is public: wrapped here) rolls the step back, and stepping again draws the same
    tokens: the outputs are the clean run's."""
    sp = Sampling(max_new_tokens=N_NEW, temperature=0.9, top_k=40, seed=5, n=2)

    def serve(fail_at):
        gen = make(model)
        launch = gen.sampler.launch
        count = {"n": 0}

        def interrupted(*args):
            draw = launch(*args)
            count["n"] += 1
            return _Interrupted(draw) if count["n"] == fail_at else draw

        gen.sampler.launch = interrupted
        reqs = [gen.add(p, sp) for p in prompts[:3]]
        run_through(gen, KeyboardInterrupt, expect_raise=fail_at is not None)
        assert count["n"] >= (fail_at or 0)
        return [r.outputs for r in reqs]

    assert serve(3) == serve(None)


# -- 2. re-entrance and threads ----------------------------------------------------------------

def test_step_from_a_callback_is_refused_and_changes_nothing(model, prompts):
    seen = []
    gen = make(model)

    def on_token(req, k, tok):
        if len(seen) < 3:
            before = snapshot(gen)
            with pytest.raises(InvalidState, match="inside a step"):
                gen.step()
            with pytest.raises(InvalidState, match="inside a step"):
                gen.run()
            seen.append(before == snapshot(gen))

    reqs = [gen.add(p, Sampling(max_new_tokens=N_NEW), on_token=on_token if i == 0 else None)
            for i, p in enumerate(prompts[:3])]
    gen.run()
    assert seen == [True, True, True]
    assert [r.outputs[0] for r in reqs] == clean(model, prompts[:3])


@pytest.mark.parametrize("async_steps", [False, True])
def test_a_step_another_user_of_the_cache_declared_is_not_dropped(model, prompts, async_steps):
    """A generator over a cache that another user has declared (or prepared) a step on
    refuses to step, changing nothing: its own declaration would have dropped the other's
    (it did, silently). Once the other user's step is committed, the generator goes on
    and its tokens are those of a clean run; its step in flight (asynchronous) is kept."""
    gen = make(model, async_steps=async_steps, prefix_cache=False)
    cache = gen.cache
    reqs = [gen.add(p, Sampling(max_new_tokens=N_NEW)) for p in prompts[:3]]
    for _ in range(3):
        gen.step()
    other = cache.seq_new()
    for prepare in (False, True):
        assert cache.declare_step([other, other])
        if prepare:
            cache.prepare_step()
        before = snapshot(gen)
        for verb in (gen.step, gen.run):
            with pytest.raises(InvalidState, match="another user"):
                verb()
        assert snapshot(gen) == before
        # (a prepared step is no longer a declared one)
        assert cache.table.declared_width == (0 if prepare else 2)
        assert (cache.prepared_step is not None) == prepare
        if prepare:
            cache.commit_step()
        else:
            cache.undeclare()
    gen.run()
    assert [r.outputs[0] for r in reqs] == clean(model, prompts[:3])
    assert cache.live_seqs() == [other]


def test_a_callback_that_steps_without_catching_ends_its_request(model, prompts):
    gen = make(model)
    def step_again(req, k, tok):
        gen.step()

    reqs = [gen.add(p, Sampling(max_new_tokens=N_NEW), on_token=step_again if i == 1 else None)
            for i, p in enumerate(prompts[:3])]
    run_through(gen, InvalidState)
    assert reqs[1].finish_reasons == ["error"] and isinstance(reqs[1].error, InvalidState)
    assert [reqs[0].outputs[0], reqs[2].outputs[0]] == clean(model, [prompts[0], prompts[2]])


def test_one_stepping_thread_while_others_add_and_cancel(model, prompts):
    """Thread T steps; its callback waits inside the step while the main thread calls
    step() (refused, nothing changed), add() (queued for the next step) and cancel()
    (applied when the step completes)."""
    gen = make(model)
    inside, release = threading.Event(), threading.Event()
    errors = []

    def on_token(req, k, tok):
        if not inside.is_set():
            inside.set()
            if not release.wait(WAIT):
                errors.append("never released")

    first = gen.add(prompts[0], Sampling(max_new_tokens=N_NEW), on_token=on_token)
    victim = gen.add(prompts[1], Sampling(max_new_tokens=N_NEW))
    def stepper():
        try:
            gen.step()
        except BaseException as e:                    # reported below
            errors.append(e)

    t = threading.Thread(target=stepper)
    t.start()
    assert inside.wait(WAIT)
    before = snapshot(gen)
    with pytest.raises(InvalidState, match="another thread"):
        gen.step()
    assert snapshot(gen) == before
    late = gen.add(prompts[2], Sampling(max_new_tokens=N_NEW))
    assert late.id == 2 and len(gen._incoming) == 1 and not any(s.req is late for s in gen.waiting)
    assert gen.cancel(victim) is True and not victim.done          # takes effect after the step
    release.set()
    t.join(WAIT)
    assert not t.is_alive() and not errors
    assert victim.finish_reasons == ["cancelled"] and victim.done
    check_consistent(gen)
    gen.run()
    assert [first.outputs[0], late.outputs[0]] == clean(model, [prompts[0], prompts[2]])
    assert idle(gen)


# -- 3. requests that cannot fit ---------------------------------------------------------------

def test_requests_that_can_never_fit_are_refused_at_add(model):
    gen = make(model, capacity=64, max_batch_tokens=16)
    before = snapshot(gen)
    with pytest.raises(InvalidArgument, match="capacity=64"):
        gen.add(list(range(65)), Sampling(max_new_tokens=1))           # prompt alone too long
    with pytest.raises(InvalidArgument, match="needs 65 cells"):
        gen.add(list(range(50)), Sampling(max_new_tokens=16))          # prompt + output too long
    assert snapshot(gen) == before
    r = gen.add(list(range(50)), Sampling(max_new_tokens=15))          # exactly 64 cells: fits
    gen.run()
    assert r.finish_reasons == ["length"] and len(r.outputs[0]) == 15


def test_kv_lists_past_max_kv_are_refused_or_split(model, prompts):
    cfg = cchf.cache_config(model, capacity=256, max_write=16, max_seqs=16, paged=True, max_kv=40)
    gen = Generator(model, HostCellCache(cfg), prefill_chunk=8, eos=[])
    before = snapshot(gen)
    with pytest.raises(InvalidArgument, match="max_kv=40"):
        gen.add(list(range(30)), Sampling(max_new_tokens=12))           # 41 entries in its last step
    assert snapshot(gen) == before
    # each fits alone; together their steps need more than 40 entries: steps are split
    reqs = [gen.add(p, Sampling(max_new_tokens=N_NEW)) for p in prompts]
    gen.run()
    assert [r.outputs[0] for r in reqs] == clean(model, prompts)
    assert gen.stats["preempted"] == 0


def test_cells_held_outside_the_generator_end_a_request_with_capacity(model, prompts):
    """Another user of the cache holds most cells: a request that cannot get them even
    alone ends with "capacity" (run returns); one that fits completes."""
    cfg = cchf.cache_config(model, capacity=64, max_write=16, max_seqs=4)
    cache = HostCellCache(cfg)
    other = cache.seq_new()
    assert cache.declare_step([other] * 16)
    cache.prepare_step()
    cache.commit_step()
    assert cache.declare_step([other] * 16)
    cache.prepare_step()
    cache.commit_step()                               # 32 of 64 cells are someone else's
    gen = Generator(model, cache, prefill_chunk=8, eos=[])
    big = gen.add(list(range(30)), Sampling(max_new_tokens=20))        # 49 cells: only 32 free
    small = gen.add(prompts[0], Sampling(max_new_tokens=N_NEW))
    gen.run()
    assert big.finish_reasons == ["capacity"] and 0 < len(big.outputs[0]) < 20
    assert big.outputs[0] == clean(model, [list(range(30))], n_new=20)[0][:len(big.outputs[0])]
    assert small.outputs[0] == clean(model, [prompts[0]])[0] and small.finish_reasons == ["length"]
    check_consistent(gen, foreign=[other])
    gen.prefix.clear()
    assert cache.free_cells == 32


def test_no_free_id_outside_the_generator_ends_requests_with_capacity(model, prompts):
    cfg = cchf.cache_config(model, capacity=64, max_write=16, max_seqs=2)
    cache = HostCellCache(cfg)
    held = [cache.seq_new(), cache.seq_new()]
    gen = Generator(model, cache, eos=[])
    r = gen.add(prompts[0], Sampling(max_new_tokens=N_NEW))
    assert gen.step() is False
    assert r.finish_reasons == ["capacity"] and r.outputs == [[]] and not gen.busy
    assert cache.live_seqs() == held


# -- 4. admission and preemption -----------------------------------------------------------------

def test_admission_reserves_growth_so_recompute_stays_at_the_minimum(model):
    """8 requests of 40 + 40 tokens in 256 cells (3 fit at a time): no preemption, every
    prompt read once, outputs those of a cache that holds everything."""
    rng = np.random.default_rng(1)
    ps = [rng.integers(0, VOCAB, size=40).tolist() for _ in range(8)]

    def serve(capacity):
        gen = make(model, capacity=capacity, max_batch_tokens=64, prefill_chunk=256)
        reqs = [gen.add(p, Sampling(max_new_tokens=40)) for p in ps]
        gen.run()
        return [r.outputs[0] for r in reqs], gen.stats

    small, stats = serve(256)
    big, _ = serve(4096)
    assert small == big
    assert stats["preempted"] == 0
    assert stats["tokens_in"] == 8 * (40 + 40 - 1)    # each prompt and output token fed once


def test_preemption_takes_the_newest_and_never_readmits_it_in_the_same_step(model):
    """reserve=0 admits as soon as a prompt fits, so sequences are preempted: the victims
    are the most recently admitted, never readmitted in the step that preempted them, and
    the outputs equal Hugging Face generate."""
    rng = np.random.default_rng(11)
    ps = [rng.integers(0, VOCAB, size=int(rng.integers(2, 45))).tolist() for _ in range(7)]
    model.set_attn_implementation("sdpa")
    refs = [model.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist() for p in ps]
    gen = make(model, capacity=150, max_batch_tokens=16, prefill_chunk=7, reserve=0.0)
    reqs = [gen.add(p, Sampling(max_new_tokens=20)) for p in ps[:3]]
    preemptions = 0
    for i in range(1000):
        if i == 4:
            reqs += [gen.add(p, Sampling(max_new_tokens=20)) for p in ps[3:]]
        before = {id(s): (s, s.stamp, s.in_cache) for s in gen.running}
        n = gen.stats["preempted"]
        if not gen.step():
            break
        check_consistent(gen)
        if gen.stats["preempted"] == n:
            continue
        preemptions += 1
        waiting = {id(s) for s in gen.waiting}
        victims = [v for v in before.values() if id(v[0]) in waiting]
        kept = [v for v in before.values() if id(v[0]) not in waiting]
        assert len(victims) == gen.stats["preempted"] - n
        assert max(v[1] for v in kept) < min(v[1] for v in victims)      # newest first
        for s in gen.running:                         # nobody went back to zero and re-entered
            if id(s) in before:
                assert s.in_cache >= before[id(s)][2]
    assert preemptions > 0 and not gen.busy
    assert [r.outputs[0] for r in reqs] == refs


# -- 5. checks up front ---------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    dict(temperature=float("nan")), dict(temperature=float("inf")), dict(temperature=-0.1),
    dict(temperature="0.5"), dict(temperature=True), dict(temperature=None),
    dict(top_p=0.0), dict(top_p=1.5), dict(top_p=float("nan")), dict(top_p="1"),
    dict(top_k=1.5), dict(top_k=True), dict(top_k=-1), dict(top_k="3"),
    dict(n=0), dict(n=2.0), dict(n=True), dict(n=None),
    dict(max_new_tokens=-1), dict(max_new_tokens=1.0), dict(max_new_tokens=False), dict(max_new_tokens="3"),
    dict(seed=-1), dict(seed=1.5), dict(seed=True), dict(seed=2**63), dict(seed="1"),
    dict(temperature=10 ** 400), dict(top_p=-10 ** 400),
    dict(stop=5), dict(stop="ab"), dict(stop=b"ab"), dict(stop=[1.5]), dict(stop=[True]), dict(stop=[-1]),
    dict(stop=None), dict(stop={1: 2}), dict(stop=np.int64(3)), dict(stop=torch.tensor(3)),
], ids=repr)
def test_sampling_refuses_bad_values(kw):
    with pytest.raises(InvalidArgument):
        Sampling(**kw)


def test_sampling_accepts_numpy_and_torch_scalars_and_sequences():
    s = Sampling(max_new_tokens=np.int64(4), temperature=np.float32(0.5), n=np.int32(2),
                 stop=np.array([3, 1]), seed=7)
    assert (s.max_new_tokens, s.n, s.stop) == (4, 2, (3, 1)) and type(s.temperature) is float
    assert Sampling(stop={5}).stop == (5,) and Sampling(stop=torch.tensor([2, 9])).stop == (2, 9)
    assert Sampling(temperature=1).temperature == 1.0 and Sampling(stop=range(2)).stop == (0, 1)


def test_extreme_sampling_values_draw_their_limits_through_the_generator(model, prompts):
    """Every finite temperature >= 0 and top_p in (0, 1] is accepted as given, and the ones
    beyond what float32 computes draw as their limits (cellcache.generate.sampler): a
    temperature of 1e-39 or 1e-300, a top_p of 1e-300, or 1e300 with top_k 1 give the
    greedy tokens (the random model's logits have no ties); 1e300 alone draws what 1e15
    draws (uniform over the vocabulary). Served beside them, a greedy request gives the
    clean run's tokens and a seeded ordinary one what it draws alone."""
    limits = [dict(temperature=1e-39, seed=1), dict(temperature=1e-300, seed=2),
              dict(temperature=1.0, top_p=1e-300, seed=3), dict(temperature=1e300, top_k=1, seed=4)]
    for kw in limits + [dict(temperature=5e-324), dict(top_p=5e-324)]:
        sp = Sampling(**kw)
        assert all(getattr(sp, name) == value for name, value in kw.items())
    ordinary = Sampling(max_new_tokens=N_NEW, temperature=0.9, top_k=40, top_p=0.95, seed=5)

    def alone(prompt, sampling):
        gen = make(model)
        req = gen.add(prompt, sampling)
        gen.run()
        return req.outputs[0]

    greedy = clean(model, prompts[:3])
    gen = make(model)
    reqs = [[gen.add(p, Sampling(max_new_tokens=N_NEW, **kw)) for kw in limits] for p in prompts[:2]]
    huge = gen.add(prompts[3], Sampling(max_new_tokens=N_NEW, temperature=1e300, seed=9))
    beside = gen.add(prompts[4], ordinary)
    plain = gen.add(prompts[2], Sampling(max_new_tokens=N_NEW))
    gen.run()
    for i, row in enumerate(reqs):
        assert [r.outputs[0] for r in row] == [greedy[i]] * len(limits)
    assert huge.outputs[0] == alone(prompts[3], Sampling(max_new_tokens=N_NEW, temperature=1e15, seed=9))
    assert len(set(huge.outputs[0])) > N_NEW // 2             # spread over the vocabulary
    assert beside.outputs[0] == alone(prompts[4], ordinary)
    assert plain.outputs[0] == greedy[2]


BAD_ADDS = [
    (dict(prompt=[]), "empty"), (dict(prompt="abc"), "no tokenizer"),
    (dict(prompt=b"ab"), "not a sequence"), (dict(prompt=[1.5]), "ints"), (dict(prompt=[True, 2]), "ints"),
    (dict(prompt=["3"]), "ints"), (dict(prompt=[-1]), "vocabulary"), (dict(prompt=[VOCAB]), "vocabulary"),
    (dict(prompt=[[1, 2]]), "ints"), (dict(prompt=7), "not a sequence"),
    (dict(prompt={1, 2}), "not a sequence"), (dict(prompt=None), "not a"),
    (dict(prompt=np.zeros((2, 3), np.int64)), "shape"),
    (dict(prompt=torch.zeros((2, 3), dtype=torch.long)), "shape"),
    (dict(prompt=torch.zeros((1, 1, 3), dtype=torch.long)), "shape"), (dict(prompt=torch.ones(3)), "dtype"),
    (dict(prompt=np.array([1.0, 2.0])), "dtype"),
    (dict(prompt=torch.zeros((1, 0), dtype=torch.long)), "empty"),
    (dict(prompt=torch.ones(3, dtype=torch.long, device="meta")), "meta tensor"),
    (dict(prompt=torch.tensor([1, 2, 3]).to_sparse()), "sparse_coo tensor"),
    (dict(prompt=torch.tensor([[1, 2, 3]]).to_sparse_csr()), "sparse_csr tensor"),
    (dict(prompt=torch.nested.nested_tensor([torch.tensor([1, 2])])), "nested tensor"),
    (dict(sampling="greedy"), "not a Sampling"), (dict(sampling=dict(max_new_tokens=3)), "not a Sampling"),
    (dict(on_token=5), "not callable"), (dict(draft="x"), "not callable"),
    (dict(draft_k=-1), "draft_k"), (dict(draft_k=1.5), "draft_k"), (dict(draft_k=True), "draft_k"),
    (dict(prompt=list(range(200)), sampling=Sampling(max_new_tokens=100)), "cells"),
]


@pytest.mark.parametrize("kw,fragment", BAD_ADDS, ids=[repr(k)[:60] for k, _ in BAD_ADDS])
def test_add_refuses_and_queues_nothing(model, kw, fragment):
    gen = make(model)
    gen.add([1, 2, 3])
    before = snapshot(gen)
    args = dict(prompt=[1, 2, 3])
    args.update(kw)
    with pytest.raises(InvalidArgument, match=fragment):
        gen.add(args.pop("prompt"), **args)
    assert snapshot(gen) == before


@pytest.mark.parametrize("tensor", [torch.ones(2, dtype=torch.long, device="meta"),
                                    torch.tensor([1, 2]).to_sparse()], ids=["meta", "sparse"])
def test_stop_and_eos_refuse_tensors_without_plain_data(model, tensor):
    with pytest.raises(InvalidArgument, match="tensor; give a dense tensor"):
        Sampling(stop=tensor)
    with pytest.raises(InvalidArgument, match="tensor; give a dense tensor"):
        make(model, eos=tensor)


@pytest.mark.parametrize("capacity", [np.int64(64), np.int32(64), torch.tensor(64)], ids=repr)
def test_a_capacity_of_any_int_type_is_taken_as_the_int(model, capacity):
    gen = make(model, capacity=capacity, max_batch_tokens=None)
    assert gen.cache.config.capacity == 64 and gen.max_batch == 64


def test_add_rechecks_a_sampling_changed_after_construction(model):
    gen = make(model)
    sp = Sampling()
    sp.temperature = float("nan")
    before = snapshot(gen)
    with pytest.raises(InvalidArgument, match="temperature"):
        gen.add([1, 2], sp)
    assert snapshot(gen) == before


def test_tensor_and_array_prompts_are_accepted(model, prompts):
    p = prompts[1]
    gen = make(model)
    forms = [p, torch.tensor([p]), np.array([p]), torch.tensor(p, dtype=torch.int32),
             np.array(p, dtype=np.uint16), [np.int64(t) for t in p], tuple(p)]
    reqs = [gen.add(f, Sampling(max_new_tokens=4)) for f in forms]
    gen.run()
    assert all(r.prompt == p for r in reqs)
    assert all(r.outputs == reqs[0].outputs for r in reqs)


# -- 6. cancel and finish reasons ----------------------------------------------------------------

def test_cancel_between_steps(model, prompts):
    gen = make(model)
    reqs = [gen.add(p, Sampling(max_new_tokens=N_NEW, n=2 if i == 1 else 1)) for i, p in enumerate(prompts)]
    for _ in range(3):
        gen.step()
    fork, waiting = reqs[1], reqs[4]
    assert len(fork.outputs[1]) > 0 and not fork.done           # forked, running
    assert gen.cancel(fork) is True and gen.cancel(waiting) is True
    assert fork.finish_reasons == ["cancelled", "cancelled"] and fork.done
    assert waiting.finish_reasons == ["cancelled"] and waiting.outputs == [[]]
    assert not any(s.req in (fork, waiting) for s in gen.running + gen.waiting)
    check_consistent(gen)
    assert gen.cancel(fork) is False                  # already done: a no-op
    gen.run()
    others = [reqs[0], reqs[2], reqs[3]]
    assert [r.outputs[0] for r in others] == clean(model, [prompts[0], prompts[2], prompts[3]])
    assert gen.cancel(reqs[0]) is False and reqs[0].finish_reasons == ["length"]
    assert fork.finish_reasons == ["cancelled", "cancelled"]


def test_cancel_from_callbacks(model, prompts):
    gen = make(model)
    calls: dict[int, int] = {}

    def on_token(req, k, tok):
        calls[req.id] = calls.get(req.id, 0) + 1
        if req.id == 1 and calls[1] == 3:
            assert gen.cancel(req) is True            # itself
        if req.id == 0 and calls[0] == 2:
            gen.cancel(reqs[2])                       # another request

    def draft(tokens, k):
        if len(tokens) > len(prompts[3]) + 2:
            gen.cancel(reqs[3])                       # itself, from its draft
        return [1] * k

    reqs = [gen.add(p, Sampling(max_new_tokens=N_NEW), on_token=on_token, draft=draft if i == 3 else None)
            for i, p in enumerate(prompts)]
    gen.run()
    assert calls[1] == 3 and len(reqs[1].outputs[0]) == 3
    assert [r.finish_reasons for r in reqs] == [["length"], ["cancelled"], ["cancelled"], ["cancelled"],
                                                ["length"]]
    assert all(r.error is None for r in reqs)
    assert [reqs[0].outputs[0], reqs[4].outputs[0]] == clean(model, [prompts[0], prompts[4]])
    assert idle(gen)


def test_cancel_refuses_what_is_not_its_request(model):
    gen, other = make(model), make(model)
    r = other.add([1, 2])
    with pytest.raises(InvalidArgument, match="not a Request of this Generator"):
        gen.cancel(r)
    with pytest.raises(InvalidArgument):
        gen.cancel("request 0")


def test_finish_reasons_per_continuation(model, prompts):
    ref = clean(model, [prompts[0]])[0]
    gen = make(model)
    r_stop = gen.add(prompts[0], Sampling(max_new_tokens=N_NEW, stop=[ref[3]]))
    r_len = gen.add(prompts[2], Sampling(max_new_tokens=2, n=3))
    gen.run()
    assert r_stop.outputs[0] == ref[:ref.index(ref[3]) + 1] and r_stop.finish_reasons == ["stop"]
    assert r_len.finish_reasons == ["length"] * 3 and all(len(o) == 2 for o in r_len.outputs)
    gen = make(model, eos=[ref[5]])
    r_eos = gen.add(prompts[0], Sampling(max_new_tokens=N_NEW, n=2))
    gen.run()
    assert r_eos.outputs == [ref[:ref.index(ref[5]) + 1]] * 2 and r_eos.finish_reasons == ["stop"] * 2
    assert set(FINISH_REASONS) == {"stop", "length", "capacity", "cancelled", "error"}


# -- 7. the command line -----------------------------------------------------------------------

def one_line_exit(capsys, argv, fragment):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], err
    return lines[0]


BASE = ["--random", "llama-tiny", "--random-prompts", "1", "--prompt-len", "4", "--max-new-tokens", "2",
        "--quiet"]


@pytest.mark.parametrize("args,fragment", [
    (["--temperature", "nan"], "--temperature must be a finite number"),
    (["--temperature", "inf"], "--temperature must be a finite number"),
    (["--top-p", "nan"], "--top-p must be in (0, 1]"),
    (["--capacity", "64", "--prompt-len", "60", "--max-new-tokens", "10", "--max-batch-tokens", "64"],
     "needs 69 cells"),
])
def test_cli_bad_values_are_one_line(capsys, args, fragment):
    one_line_exit(capsys, BASE + args, fragment)


def test_cli_non_utf8_prompts_file(capsys, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_bytes(b"1 2 3\n\xff\xfe 4\n")
    one_line_exit(capsys, BASE + ["--prompts-file", str(f)], "is not UTF-8 text")


def test_cli_refused_model(capsys, monkeypatch):
    def refuse(*a, **k):
        raise InvalidArgument("layer 0: attention sinks (s_aux=...) are not computed\nby cellcache")

    monkeypatch.setattr(cgen.engine, "attach", refuse)      # where the Generator finds it
    one_line_exit(capsys, BASE, "attention sinks")


def test_cli_capacity_that_cannot_be_allocated(capsys, monkeypatch):
    def oom(*a, **k):
        raise OutOfMemory("could not allocate 68719476736 bytes for the step buffer mask_w0")

    monkeypatch.setattr(cgen.options, "build", oom)
    one_line_exit(capsys, BASE + ["--capacity", "134217728"], "cannot serve this model with --capacity")


def test_cli_huge_capacity_returns(capsys):
    """The real thing: 2**27 cells either serve or exit 2 in one line (here: the masks do
    not fit memory), never a traceback."""
    try:
        code = main(BASE + ["--capacity", "134217728"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 0 or (code == 2 and len(err) == 1), err


def test_cli_cuda_without_a_driver(capsys):
    from cellcache.cuda.probe import cuda_usable

    usable, why = cuda_usable()
    if usable and torch.cuda.is_available():
        pytest.skip("a CUDA device is usable here")
    one_line_exit(capsys, BASE + ["--device", "cuda"], f"--device cuda: {why if not usable else 'no CUDA'}")


def test_cli_json_has_finish_reasons(capsys):
    argv = BASE[:3] + ["2", "--prompt-len", "4", "--max-new-tokens", "3", "--json", "--quiet", "1 2"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["finish_reasons"] for r in out["results"]] == [["length"]] * 3
    assert all(len(r["outputs"][0]) == 3 for r in out["results"])
