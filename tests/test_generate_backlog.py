"""The steady steps' deferred appends (``Scheduler`` keeps each steady step's ids in a
backlog and appends them to the rows' lists later): whatever reads a request's ``outputs``
or ``token_times`` (between steps, in a callback, from another thread) sees every applied
token, the lists hold no more than a full backlog behind (``BACKLOG_STEPS``, 32 here:
these tests fill it), the steady steps never flush otherwise, and a finished request does
not keep the generator alive. CPU, tiny random model."""

from __future__ import annotations

import copy
import gc
import pickle
import signal
import threading
import weakref

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cellcache.generate import Generator, Sampling, random_model  # noqa: E402
from cellcache.generate import scheduler as scheduler_module  # noqa: E402

from .helpers import random_prompts as prompts  # noqa: E402

BACKLOG_STEPS = 32              # the backlog's width in these tests (the library's is larger)
NEW = BACKLOG_STEPS + 40        # long enough for a full backlog and more


@pytest.fixture(autouse=True)
def small_backlog(monkeypatch):
    monkeypatch.setattr(scheduler_module, "BACKLOG_STEPS", BACKLOG_STEPS)


@pytest.fixture(scope="module")
def model():
    return random_model("llama-tiny", seed=3)


def make(model, async_steps, eos=()):
    return Generator(model, capacity=4096, max_batch_tokens=256, prefill_chunk=64,
                     async_steps=async_steps, eos=list(eos))


def reference(model, ps, sampling):
    """The synchronous generator's outputs (it defers nothing)."""
    return [r.outputs for r in _serve_all(model, [(p, sampling) for p in ps], False)[0]]


def started(model, seed, n):
    """The synchronous generator's outputs for ``n`` greedy requests of NEW tokens, and an
    asynchronous generator with the same requests added: (outputs, generator, requests)."""
    ps = prompts(seed, n)
    sampling = Sampling(max_new_tokens=NEW)
    want = reference(model, ps, sampling)
    gen = make(model, True)
    return want, gen, [gen.add(p, sampling) for p in ps]


def staggered(model, seed, n, gap):
    """``n`` greedy requests whose lengths step down by ``gap`` (their rows end by length at
    different steps): the synchronous generator's outputs, and an asynchronous generator
    with the same requests added: (outputs, generator, requests)."""
    specs = [(p, Sampling(max_new_tokens=NEW - gap * i)) for i, p in enumerate(prompts(seed, n))]
    want = [r.outputs for r in _serve_all(model, specs, False)[0]]
    gen = make(model, True)
    return want, gen, [gen.add(p, sp) for p, sp in specs]


def raw(req):
    """The output lists as stored, without bringing deferred tokens in."""
    return req.__dict__["outputs"]


def test_deferred_tokens_are_appended_when_read_and_stay_within_the_backlog(model):
    want, gen, reqs = started(model, 2, 5)
    lag_seen = 0
    for _ in range(10 * NEW):
        busy = gen.step()
        stored = 0
        for r in reqs:
            assert len(r.__dict__["token_times"][0]) == len(raw(r)[0])  # stored together
            stored += len(raw(r)[0])
        behind = gen.stats["tokens_out"] - stored
        # never more than a full backlog of its rows (drawing or ended) behind
        b = gen.scheduler._backlog
        assert 0 <= behind <= BACKLOG_STEPS * (0 if b is None else len(b.outs))
        lag_seen = max(lag_seen, behind)
        if not busy:
            break
    assert lag_seen >= BACKLOG_STEPS // 2 * len(reqs)  # the steady steps deferred their appends
    # read now: every token, in order, as the synchronous generator drew them
    assert [r.outputs for r in reqs] == want
    assert all(len(t) == len(o) for r in reqs for t, o in zip(r.token_times, r.outputs))
    assert all(r.finish_reasons == ["length"] for r in reqs)


def test_reading_between_steps_sees_every_applied_token(model):
    want, gen, reqs = started(model, 3, 4)
    while True:
        busy = gen.step()
        n = gen.stats["tokens_out"]
        got = [r.outputs[0] for r in reqs]
        # what was applied is what can be read: the counters and the lists agree
        assert sum(len(o) for o in got) == n
        assert all(o == w[0][:len(o)] for o, w in zip(got, want))
        assert all(len(r.token_times[0]) == len(r.outputs[0]) for r in reqs)
        for s in gen.running:                   # the sequences' own tokens are current too
            assert s.tokens == s.req.prompt + s.req.outputs[s.index]
            # and their count of cached tokens: all but the last (fed next), plus a cell for
            # the step in flight
            assert len(s.tokens) - s.in_cache == 1
            assert gen.cache.pos(s.sid) - s.in_cache in (0, 1)
        if not busy:
            break
    assert [r.outputs for r in reqs] == want


def test_reading_any_one_request_brings_every_deferred_token_in(model):
    """Rows end at different steps (the steady path drops them from its record and keeps a
    backlog of the rest): reading any single request's outputs, one a step in turn, runs
    the flush, so every row's stored list is current afterwards. A request whose reads
    did not reach the scheduler's hook would leave the backlog's tokens unstored."""
    ps = prompts(4, 6)
    samplings = [Sampling(max_new_tokens=NEW - 7 * i) for i in range(len(ps))]
    want = [r.outputs for r in _serve_all(model, list(zip(ps, samplings)), False)[0]]
    gen = make(model, True)
    reqs = [gen.add(p, sp) for p, sp in zip(ps, samplings)]
    behind_seen = i = 0
    while True:
        busy = gen.step()
        behind_seen = max(behind_seen, gen.stats["tokens_out"] - sum(len(raw(r)[0]) for r in reqs))
        r = reqs[i % len(reqs)]
        i += 1
        got = r.outputs[0]
        assert sum(len(raw(q)[0]) for q in reqs) == gen.stats["tokens_out"]
        assert got == want[reqs.index(r)][0][:len(got)]
        if not busy:
            break
    assert behind_seen > 0                      # tokens were deferred between the reads
    assert [r.outputs for r in reqs] == want


def test_a_callback_reading_outputs_sees_its_own_token(model):
    ps = prompts(4, 3)
    sampling = Sampling(max_new_tokens=NEW)
    want = reference(model, ps, sampling)
    gen = make(model, True)
    seen: dict[int, list[int]] = {}

    def on_token(req, k, tok):
        out = req.outputs[k]
        assert out[-1] == tok                 # the token delivered is the last one stored
        seen[req.id] = list(out)

    reqs = [gen.add(p, sampling, on_token=on_token if i == 0 else None) for i, p in enumerate(ps)]
    gen.run()
    assert seen[reqs[0].id] == want[0][0]
    assert [r.outputs for r in reqs] == want


def test_a_cancel_between_steady_steps_keeps_every_applied_token(model):
    want, gen, reqs = started(model, 5, 4)
    for _ in range(BACKLOG_STEPS // 2 + 10):  # into the steady run, nothing read meanwhile
        gen.step()
    out_before = gen.stats["tokens_out"]
    assert gen.cancel(reqs[1])
    gen.run()
    assert reqs[1].finish_reasons == ["cancelled"]
    assert 0 < len(reqs[1].outputs[0]) < NEW
    assert len(reqs[1].token_times[0]) == len(reqs[1].outputs[0])
    assert sum(len(r.outputs[0]) for r in reqs) == gen.stats["tokens_out"] >= out_before
    assert reqs[1].outputs[0] == want[1][0][:len(reqs[1].outputs[0])]
    assert [r.outputs for i, r in enumerate(reqs) if i != 1] == [w for i, w in enumerate(want) if i != 1]


def test_outputs_read_from_another_thread_are_always_a_prefix_of_the_result(model):
    want, gen, reqs = started(model, 6, 4)
    snaps: list[list[list[int]]] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader():
        try:
            while not stop.wait(0.0002):        # (a short wait: the stepping thread runs)
                snaps.append([list(r.outputs[0]) for r in reqs])
        except BaseException as e:            # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    try:
        gen.run()
    finally:
        stop.set()
        t.join()
    assert not errors
    assert [r.outputs for r in reqs] == want
    # the reader ran while tokens came in (it saw more than one state)
    assert len({tuple(len(o) for o in snap) for snap in snaps}) > 1
    for snap in snaps:                          # each one a prefix of the final outputs
        assert all(o == w[0][:len(o)] for o, w in zip(snap, want))
    lengths = [[len(o) for o in snap] for snap in snaps]
    assert all(a <= b for x, y in zip(lengths, lengths[1:]) for a, b in zip(x, y))


def test_finished_requests_do_not_keep_the_generator_alive(model):
    gen = make(model, True)
    reqs = [gen.add(p, Sampling(max_new_tokens=NEW)) for p in prompts(7, 3)]
    gen.run()
    sched = weakref.ref(gen.scheduler)
    outs = [r.outputs for r in reqs]
    del gen
    gc.collect()
    assert sched() is None
    assert [r.outputs for r in reqs] == outs and all(len(o[0]) == NEW for o in outs)


def test_an_interrupt_during_a_flush_is_held_until_the_lists_are_whole(model, monkeypatch):
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    want, gen, reqs = started(model, 8, 4)
    for _ in range(BACKLOG_STEPS // 2 + 10):  # steady steps deferred, nothing read
        gen.step()
    consume, calls = scheduler_module._consume, []

    def interrupted(it):                      # Ctrl-C arrives between the flush's appends
        calls.append(True)
        if len(calls) == 2:                   # (the outputs appended, the rest not yet)
            signal.raise_signal(signal.SIGINT)
        consume(it)

    monkeypatch.setattr(scheduler_module, "_consume", interrupted)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            reqs[0].outputs                   # noqa: B018 - the read flushes
    finally:
        signal.signal(signal.SIGINT, old)
    monkeypatch.setattr(scheduler_module, "_consume", consume)
    assert len(calls) == 3                    # held: the flush ran to its end
    # raised once the lists were whole: every applied token once, counts consistent
    assert sum(len(r.outputs[0]) for r in reqs) == gen.stats["tokens_out"]
    assert all(len(r.token_times[0]) == len(r.outputs[0]) for r in reqs)
    for s in gen.running:
        assert s.tokens == s.req.prompt + s.req.outputs[0] and len(s.tokens) - s.in_cache == 1
    gen.run()
    assert [r.outputs for r in reqs] == want


def test_a_request_copied_or_pickled_mid_run_holds_its_tokens_and_no_generator(model):
    want, gen, reqs = started(model, 9, 3)
    for _ in range(BACKLOG_STEPS // 2 + 10):
        gen.step()
    n = gen.stats["tokens_out"] // len(reqs)
    for clone in (copy.deepcopy(reqs[0]), pickle.loads(pickle.dumps(reqs[0]))):
        assert clone.outputs[0] == want[0][0][:n] and len(clone.token_times[0]) == n
    gen.run()
    assert [r.outputs for r in reqs] == want


def _serve_all(model, specs, async_steps, eos=()):
    gen = make(model, async_steps, eos)
    reqs = [gen.add(p, sp) for p, sp in specs]
    gen.run()                                 # nothing read between steps
    return reqs, gen.stats["tokens_out"]


@pytest.mark.parametrize("case", ["lengths", "eos", "forks", "stops"])
def test_deferred_steps_agree_with_the_synchronous_generator(model, case):
    """Rows that end at different steps (by length, an eos among the draws, their own stop
    tokens) and sampled forks, with steady steps deferred and nothing read between steps."""
    ps = prompts(10, 4)
    eos: tuple[int, ...] = ()
    if case == "lengths":
        specs = [(p, Sampling(max_new_tokens=NEW - 11 * i)) for i, p in enumerate(ps)]
    elif case == "forks":
        specs = [(p, Sampling(max_new_tokens=NEW - 5 * i, n=2, temperature=0.8, seed=i))
                 for i, p in enumerate(ps)]
    else:
        # a token request 1 draws late in its run (the synchronous reference says which)
        base, _ = _serve_all(model, [(p, Sampling(max_new_tokens=NEW)) for p in ps], False)
        tok = base[1].outputs[0][BACKLOG_STEPS + 5]
        if case == "eos":
            eos = (tok,)
            specs = [(p, Sampling(max_new_tokens=NEW)) for p in ps]
        else:
            specs = [(p, Sampling(max_new_tokens=NEW, stop=[tok] if i == 1 else []))
                     for i, p in enumerate(ps)]
    a, na = _serve_all(model, specs, False, eos)
    b, nb = _serve_all(model, specs, True, eos)
    assert [r.outputs for r in a] == [r.outputs for r in b] and na == nb
    assert [r.finish_reasons for r in a] == [r.finish_reasons for r in b]
    assert all(len(t) == len(o) for r in b for t, o in zip(r.token_times, r.outputs))
    if case in ("eos", "stops"):              # the token ended request 1 early
        assert b[1].finish_reasons == ["stop"] and len(b[1].outputs[0]) < NEW


def test_rows_ending_by_length_without_a_prefix_cache(model):
    """The same rows ending at different steps with the prefix cache off: nothing is stored,
    each ending row's id goes back to the cache, and the outputs are the synchronous
    generator's."""
    specs = [(p, Sampling(max_new_tokens=NEW - 6 * i)) for i, p in enumerate(prompts(14, 5))]
    want = [r.outputs for r in _serve_all(model, specs, False)[0]]
    gen = Generator(model, capacity=4096, max_batch_tokens=256, prefill_chunk=64,
                    async_steps=True, eos=[], prefix_cache=False)
    assert gen.prefix is None
    sched = gen.scheduler
    real_finish_held = sched._finish_held
    batches = []                              # rows the steady steps ended together

    def finish_held(ended, bases, held):
        batches.append(len(ended))
        real_finish_held(ended, bases, held)

    sched._finish_held = finish_held
    reqs = [gen.add(p, sp) for p, sp in specs]
    seen = set()
    while gen.step():
        done = sum(r.finished is not None for r in reqs)
        # every finished request's id is back: as many live ids as rows still running
        assert len(gen.cache.live_seqs()) == len(reqs) - done
        seen.add(done)
    assert len(seen) >= 4                     # the rows ended at different steps
    assert sum(batches) >= len(reqs) - 1      # (by the steady steps, the last maybe not)
    assert all(r.finished is not None for r in reqs) and gen.cache.live_seqs() == []
    assert [r.outputs for r in reqs] == want


def test_rows_ending_by_length_leave_the_others_deferred(model):
    """Rows that end by length are the last ones of the steady steps' order: they leave
    the backlog's drawing rows with their tokens still held (counted in the cache, not
    appended), and the backlog goes on with the other rows (the same object). The rows
    read afterwards, the sequences' counts of cached tokens and the finished requests'
    lists are what the synchronous generator gives; once the last rows end the requests
    are let go."""
    want, gen, reqs = staggered(model, 12, 5, 6)
    sched = gen.scheduler
    rows_given = 0
    real_give = gen.prefix.give_lent

    def give_lent(sids, starts, tails):
        nonlocal rows_given
        given = real_give(sids, starts, tails)
        rows_given += sum(given)
        return given

    gen.prefix.give_lent = give_lent
    kept = 0
    finished = 0
    while True:
        before = sched._backlog
        busy = gen.step()
        now = [r for r in reqs if r.finished is not None]
        b = sched._backlog
        if len(now) > finished and before is not None and b is before:
            kept += 1
            held = len(b.stamps)
            for i, s in enumerate(b.seqs):
                r = s.req
                if i < b.live:                # the rows going on: cached = stored + held
                    assert gen.cache.pos(s.sid) - s.in_cache - held in (0, 1)
                else:                         # an ended row: stored + its own held = all
                    assert s.sid is None and r.finished is not None
                    assert len(raw(r)[0]) + b.counts[i] == r.sampling.max_new_tokens
            assert any(len(raw(r)[0]) < r.sampling.max_new_tokens for r in now)
            assert gen.stats["tokens_out"] - sum(len(raw(q)[0]) for q in reqs) \
                == held * b.live + sum(b.counts[b.live:])
        finished = len(now)
        if not busy:
            break
    assert kept >= 3                            # rows ended while the backlog went on
    assert [r.outputs for r in reqs] == want
    assert sched._backlog is None and sched._hook.fn is None
    # the ended rows went to the prefix cache together, their tokens past the prompts they
    # lend read from the backlog's int32 matrix: the tree holds every token each sequence
    # had in the cache (all but its last), in order
    assert rows_given >= len(reqs) - 1
    for r in reqs:
        toks = list(r.prompt) + r.outputs[0]
        assert gen.prefix.peek(toks) == len(toks) - 1


def test_steady_steps_leave_the_lists_to_a_read_or_the_end_of_the_run(model, monkeypatch):
    """With the library's backlog (wide enough for every step of these rows), nothing is
    appended from the first steady step until the run ends, though rows end by length
    meanwhile (their lists stay short of their tokens), and asking ``Generator.busy``
    between steps does not flush; the step that finds nothing left to do appends them all
    and lets the requests go."""
    monkeypatch.undo()                        # the library's BACKLOG_STEPS
    assert scheduler_module.BACKLOG_STEPS >= NEW + 2
    want, gen, reqs = staggered(model, 13, 4, 9)
    sched = gen.scheduler
    log = []
    while True:
        busy = gen.step()
        assert gen.busy == busy                   # (asking flushes nothing)
        log.append((sum(r.finished is not None for r in reqs), sched.flushed_tokens,
                    sum(len(raw(r)[0]) for r in reqs)))
        if not busy:
            break
    first = next(i for i, e in enumerate(log) if e[0])
    assert first >= NEW // 2                  # (the steady run came before)
    # the steps from the one before the first row ended to the last one: no flush
    assert len({e[1] for e in log[first - 1:-1]}) == 1
    assert log[-2][0] == len(reqs) - 1 and log[-2][2] < gen.stats["tokens_out"]
    # the last step appended every held token and let the requests go
    assert log[-1][2] == gen.stats["tokens_out"] == sum(len(o[0]) for o in want)
    assert sched._backlog is None and sched._hook.fn is None
    assert [r.outputs for r in reqs] == want
