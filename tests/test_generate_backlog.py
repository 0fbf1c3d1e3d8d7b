"""The steady steps' token store (``Scheduler`` writes each steady step's ids into one
int32 array for all its rows, and the rows' requests and sequences read through it):
whatever reads a request's ``outputs`` or ``token_times`` (between steps, in a callback,
from another thread, a copy or a pickle) sees every applied token without running the
scheduler; a row settles into plain lists when it ends or another kind of step runs; a
finished request does not keep the generator alive. CPU, tiny random model."""

from __future__ import annotations

import copy
import gc
import pickle
import signal
import threading
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cellcache.generate import Generator, Sampling, random_model  # noqa: E402
from cellcache.generate import scheduler as scheduler_module  # noqa: E402
from cellcache.generate.plan import Job, Seq, StoredRow, TokenStore  # noqa: E402
from cellcache.generate.requests import Request  # noqa: E402

from .helpers import random_prompts as prompts  # noqa: E402
from .helpers import run_watched  # noqa: E402

STORE_STEPS = 8                 # a new store's room in these tests (it doubles past it)
NEW = 72                        # long enough for the store to grow three times


@pytest.fixture(autouse=True)
def small_store(monkeypatch):
    monkeypatch.setattr(scheduler_module, "STORE_STEPS", STORE_STEPS)


@pytest.fixture(scope="module")
def model():
    return random_model("llama-tiny", seed=3)


def make(model, async_steps, eos=(), **kw):
    return Generator(model, capacity=4096, max_batch_tokens=256, prefill_chunk=64,
                     async_steps=async_steps, eos=list(eos), **kw)


def _serve_all(model, specs, async_steps, eos=()):
    gen = make(model, async_steps, eos)
    reqs = [gen.add(p, sp) for p, sp in specs]
    gen.run()                                 # nothing read between steps
    return reqs, gen.stats["tokens_out"]


def reference(model, ps, sampling):
    """The synchronous generator's outputs (it stores nothing)."""
    return [r.outputs for r in _serve_all(model, [(p, sampling) for p in ps], False)[0]]


def started(model, seed, n):
    """The synchronous generator's outputs for ``n`` greedy requests of NEW tokens, and an
    asynchronous generator with the same requests added: (outputs, generator, requests)."""
    ps = prompts(seed, n)
    sampling = Sampling(max_new_tokens=NEW)
    want = reference(model, ps, sampling)
    gen = make(model, True)
    return want, gen, [gen.add(p, sampling) for p in ps]


def staggered(model, seed, n, gap, **kw):
    """``n`` greedy requests whose lengths step down by ``gap`` (their rows end by length at
    different steps): the synchronous generator's outputs, and an asynchronous generator
    with the same requests added: (outputs, generator, requests)."""
    specs = [(p, Sampling(max_new_tokens=NEW - gap * i)) for i, p in enumerate(prompts(seed, n))]
    want = [r.outputs for r in _serve_all(model, specs, False)[0]]
    gen = make(model, True, **kw)
    return want, gen, [gen.add(p, sp) for p, sp in specs]


def into_steady_run(gen, steps=NEW // 2):
    """Steps ``gen`` until its store holds ``steps`` steps (nothing read meanwhile)."""
    for _ in range(10 * NEW):
        gen.step()
        if gen.scheduler.stored_steps() >= steps:
            return
    pytest.fail("no steady run")


# -- the store itself --------------------------------------------------------------------------


def test_a_store_row_reads_its_lists_then_its_column_and_grows_without_losing_any():
    store = TokenStore(3, 2)
    out, times, tokens = [9], [0.5], [1, 2, 9]
    rows = [StoredRow(store, i, out if i == 1 else [], times if i == 1 else [], tokens, 1, 3, 2)
            for i in range(3)]
    for j in range(5):                        # past its room twice: the arrays doubled
        store.write(np.array([10 * j, 10 * j + 1, 10 * j + 2]), float(j + 1))
    assert store.k == 5 and len(store.stamps) == 8
    assert rows[1].ids() == [9, 1, 11, 21, 31, 41]
    assert rows[1].token_times() == [0.5, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert rows[1].tokens_list() == [1, 2, 9, 1, 11, 21, 31, 41]
    rows[2].end = 3                           # settled after 3 steps: the store went on
    store.live = 2
    store.write(np.array([50, 51]), 6.0)
    assert rows[2].ids() == [2, 12, 22] and rows[0].ids()[-1] == 50


def test_a_held_sequence_counts_its_stored_steps_and_settles_into_plain_lists():
    req = Request(0, [1, 2, 3], Sampling(max_new_tokens=4), outputs=[[7]],
                  finish_reasons=[None], token_times=[[0.25]])
    s = Seq(Job(req), 0, [1, 2, 3, 7], in_cache=3)
    head_out = req.outputs[0]
    store = TokenStore(1, 4)
    s.hold(StoredRow(store, 0, head_out, req.token_times[0], s.tokens, 1, 4, 3))
    store.write(np.array([8]), 1.0)
    store.write(np.array([9]), 2.0)
    assert type(s) is not Seq and isinstance(s, Seq)
    assert s.tokens == [1, 2, 3, 7, 8, 9] and s.in_cache == 5 and s.to_feed == 1
    assert req.outputs == [[7, 8, 9]] and req.token_times == [[0.25, 1.0, 2.0]]
    assert head_out == [7]                    # nothing appended to the lists meanwhile
    s.settle([8, 9], [1.0, 2.0])
    assert type(s) is Seq and s.row is None
    assert s.tokens == [1, 2, 3, 7, 8, 9] and s.in_cache == 5
    assert req.outputs[0] is head_out and head_out == [7, 8, 9]   # the lists kept grew
    assert req.token_times == [[0.25, 1.0, 2.0]]


# -- through the generator ---------------------------------------------------------------------


def test_steady_steps_store_their_tokens_and_append_no_list(model):
    """From the first steady step on, every applied token is in the store or the lists, the
    lists kept from before the run do not grow until the rows settle, reads see them all,
    and reading settles nothing."""
    want, gen, reqs = started(model, 2, 5)
    sched = gen.scheduler
    heads = None
    stored_seen = 0
    while True:
        busy = gen.step()
        held = sched.stored_steps()
        if held and heads is None:            # the lists the rows had before the store
            heads = [(s.row.out, s.row.n_out) for s in sched.stored_rows()]
        flushed = sched.flushed_tokens
        got = [r.outputs[0] for r in reqs]
        assert sched.flushed_tokens == flushed and sched.stored_steps() == held   # (a read)
        assert sum(map(len, got)) == gen.stats["tokens_out"]
        assert all(o == w[0][:len(o)] for o, w in zip(got, want))
        assert all(len(r.token_times[0]) == len(r.outputs[0]) for r in reqs)
        if held and len(sched.stored_rows()) == len(reqs):
            assert all(len(h) == n for h, n in heads)          # no list was appended
        stored_seen = max(stored_seen, held)
        if not busy:
            break
    assert stored_seen >= NEW - 4                # one store for the whole run, grown
    assert sched.stored_steps() == 0 and sched.stored_rows() == []
    assert [r.outputs for r in reqs] == want
    assert all(type(o) is list for r in reqs for o in r.__dict__["outputs"])
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
        flying = {id(s): len(feed) for s, feed in gen._flight.plan.rows} if gen._flight else {}
        for s in gen.running:                   # the sequences' own tokens are current too
            assert s.tokens == s.req.prompt + s.req.outputs[s.index]
            # and their count of cached tokens: all but the last (fed next), or all but the
            # prompt tokens the step in flight reads; plus the cells of the step in flight
            fed = flying.get(id(s), 0)
            assert len(s.tokens) - s.in_cache == 1 or len(s.tokens) - s.in_cache >= fed > 1
            assert gen.cache.pos(s.sid) - s.in_cache == fed
        if not busy:
            break
    assert [r.outputs for r in reqs] == want


def test_a_callback_reading_outputs_sees_its_own_token(model):
    ps = prompts(4, 3)
    sampling = Sampling(max_new_tokens=NEW)
    want = reference(model, ps, sampling)
    gen = make(model, True)
    seen: dict[int, list[int]] = {}
    stored = []

    def on_token(req, k, tok):
        out = req.outputs[k]
        assert out[-1] == tok                 # the token delivered is the last one stored
        assert req.token_times[k][-1] >= req.token_times[k][0]
        seen[req.id] = list(out)
        stored.append(gen.scheduler.stored_steps())

    reqs = [gen.add(p, sampling, on_token=on_token if i == 0 else None) for i, p in enumerate(ps)]
    gen.run()
    assert max(stored) > NEW // 2             # the callbacks read through the store
    assert seen[reqs[0].id] == want[0][0]
    assert [r.outputs for r in reqs] == want


def test_a_cancel_between_steady_steps_keeps_every_applied_token(model):
    want, gen, reqs = started(model, 5, 4)
    into_steady_run(gen)
    out_before = gen.stats["tokens_out"]
    assert gen.cancel(reqs[1])                # another path: the rows settle
    assert gen.scheduler.stored_rows() == []
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
    times: list[list[int]] = []

    def look() -> None:
        snaps.append([list(r.outputs[0]) for r in reqs])
        times.append([len(r.token_times[0]) for r in reqs])

    run_watched(gen, look, pause=0.0002)      # (a short wait: the stepping thread runs)
    assert [r.outputs for r in reqs] == want
    # the reader ran while tokens came in (it saw more than one state)
    assert len({tuple(len(o) for o in snap) for snap in snaps}) > 1
    for snap in snaps:                          # each one a prefix of the final outputs
        assert all(o == w[0][:len(o)] for o, w in zip(snap, want))
    lengths = [[len(o) for o in snap] for snap in snaps]
    assert all(a <= b for x, y in zip(lengths, lengths[1:]) for a, b in zip(x, y))
    assert all(a <= b for x, y in zip(times, times[1:]) for a, b in zip(x, y))


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


def test_an_interrupt_while_rows_settle_is_held_until_the_lists_are_whole(model, monkeypatch):
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    want, gen, reqs = started(model, 8, 4)
    into_steady_run(gen)
    sched = gen.scheduler
    settle, calls = Seq.settle, []

    def interrupted(self, ids, times):        # Ctrl-C arrives between two rows' settling
        calls.append(True)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)
        settle(self, ids, times)

    monkeypatch.setattr(Seq, "settle", interrupted)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            sched.sync()
    finally:
        signal.signal(signal.SIGINT, old)
    monkeypatch.setattr(Seq, "settle", settle)
    assert len(calls) == len(reqs)            # held: every row settled
    # raised once the lists were whole: every applied token once, counts consistent
    assert sched.stored_rows() == [] and sched.stored_steps() == 0
    assert sum(len(r.outputs[0]) for r in reqs) == gen.stats["tokens_out"]
    assert all(len(r.token_times[0]) == len(r.outputs[0]) for r in reqs)
    for s in gen.running:
        assert type(s) is Seq
        assert s.tokens == s.req.prompt + s.req.outputs[0] and len(s.tokens) - s.in_cache == 1
    gen.run()
    assert [r.outputs for r in reqs] == want


def test_a_request_copied_or_pickled_mid_run_holds_its_tokens_and_no_generator(model):
    want, gen, reqs = started(model, 9, 3)
    into_steady_run(gen)
    assert gen.scheduler.stored_rows()
    n = gen.stats["tokens_out"] // len(reqs)
    for clone in (copy.deepcopy(reqs[0]), pickle.loads(pickle.dumps(reqs[0]))):
        assert clone.outputs[0] == want[0][0][:n] and len(clone.token_times[0]) == n
        assert all(type(o) is list for o in clone.__dict__["outputs"] + clone.__dict__["token_times"])
    gen.run()
    assert [r.outputs for r in reqs] == want


@pytest.mark.parametrize("case", ["lengths", "eos", "forks", "stops"])
def test_stored_steps_agree_with_the_synchronous_generator(model, case):
    """Rows that end at different steps (by length, an eos among the draws, their own stop
    tokens) and sampled forks, with steady steps stored and nothing read between steps."""
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
        tok = base[1].outputs[0][NEW // 2 + 5]
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
    want, gen, reqs = staggered(model, 14, 5, 6, prefix_cache=False)
    assert gen.prefix is None
    sched = gen.scheduler
    real = sched._finish_settled
    batches = []                              # rows the steady steps ended together

    def finish_settled(ended):
        batches.append(len(ended))
        real(ended)

    sched._finish_settled = finish_settled
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


def test_rows_ending_by_length_settle_and_leave_the_others_stored(model):
    """Rows that end by length are the last ones of the steady steps' order: they settle
    into their lists (whole when their request finishes) and the store goes on with the
    other rows. The sequences' counts of cached tokens and the finished requests' lists are
    what the synchronous generator gives, and the prefix cache holds every ended sequence's
    tokens (given together, past the prompts they lend)."""
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
        before = sched.stored_steps()
        busy = gen.step()
        now = [r for r in reqs if r.finished is not None]
        rows = sched.stored_rows()
        if len(now) > finished and rows and sched.stored_steps() == before + 1:
            kept += 1                          # rows ended, the store went on
            for r in now:
                assert type(r.__dict__["outputs"][0]) is list
                assert len(r.outputs[0]) == r.sampling.max_new_tokens
            for s in rows:
                assert s.req.finished is None
                assert gen.cache.pos(s.sid) - s.in_cache in (0, 1)
                assert s.tokens == s.req.prompt + s.req.outputs[0]
        finished = len(now)
        if not busy:
            break
    assert kept >= 3                            # rows ended while the store went on
    assert [r.outputs for r in reqs] == want
    assert sched.stored_rows() == []
    assert rows_given >= len(reqs) - 1
    for r in reqs:
        toks = list(r.prompt) + r.outputs[0]
        assert gen.prefix.peek(toks) == len(toks) - 1
