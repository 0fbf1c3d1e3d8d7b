"""Cached prefixes saved to a file and loaded into another Generator (cellcache.generate.state):
a conversation's history computed once serves the next process's request as a prefix-cache
hit with the same tokens; every refusal is the library's error with nothing changed."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from cellcache import InvalidArgument, InvalidState, OutOfMemory  # noqa: E402
from cellcache.generate import Generator, Sampling, load_prefix, random_model, save_prefix  # noqa: E402
from cellcache.seqstate import save_sequence  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return random_model("llama-tiny", seed=9)


def make(model, **kw):
    return Generator(model, capacity=1024, max_seqs=8, eos=[], **kw)


def state(gen) -> tuple:
    return gen.cache.free_cells, sorted(gen.cache.live_seqs()), gen.prefix.metrics()["cached_tokens"]


def test_a_saved_history_is_a_hit_in_another_generator(model, tmp_path):
    first = make(model)
    req = first.add([5, 9, 33, 2, 100, 7, 8], Sampling(max_new_tokens=6))
    first.run()
    history = req.prompt + req.outputs[0][:-1]            # what the prefix cache stored
    assert save_prefix(first, history, tmp_path / "h.kv") == len(history)
    nxt = history + [req.outputs[0][-1], 40, 41]
    fresh = make(model)
    ref = fresh.add(nxt, Sampling(max_new_tokens=5))
    fresh.run()
    second = make(model)
    assert load_prefix(second, tmp_path / "h.kv") == len(history)
    assert load_prefix(second, tmp_path / "h.kv") == 0    # held already: nothing new
    hit = second.add(nxt, Sampling(max_new_tokens=5))
    second.run()
    assert hit.cached_tokens == len(history) and ref.cached_tokens == 0
    assert hit.outputs == ref.outputs
    second.cache.check_invariants()


def test_refusals_change_nothing(model, tmp_path):
    gen = make(model)
    req = gen.add([1, 2, 3, 4, 5], Sampling(max_new_tokens=3))
    gen.run()
    history = req.prompt + req.outputs[0][:-1]
    before = state(gen)
    with pytest.raises(InvalidState, match="holds 7 of the 8 tokens"):
        save_prefix(gen, history + [11], tmp_path / "x.kv")
    with pytest.raises(InvalidArgument):
        save_prefix(gen, [], tmp_path / "x.kv")
    with pytest.raises(InvalidArgument):
        save_prefix(gen, [1, 99999], tmp_path / "x.kv")
    assert state(gen) == before and not (tmp_path / "x.kv").exists()
    save_prefix(gen, history, tmp_path / "h.kv")
    busy = make(model)
    busy.add([1, 2, 3], Sampling(max_new_tokens=4))
    with pytest.raises(InvalidState, match="idle"):
        load_prefix(busy, tmp_path / "h.kv")
    with pytest.raises(InvalidState, match="prefix cache"):
        load_prefix(make(model, prefix_cache=False), tmp_path / "h.kv")
    # a file without tokens, and one whose tokens the model does not have
    other = make(model)
    s = other.cache.seq_new()
    assert other.cache.declare_step([s] * 3)
    other.cache.prepare_step(3)
    other.cache.commit_step()
    save_sequence(other.cache, s, tmp_path / "bare.kv")
    save_sequence(other.cache, s, tmp_path / "big.kv", tokens=[1, 2, 600])
    target = make(model)
    before = state(target)
    with pytest.raises(InvalidArgument, match="holds no tokens"):
        load_prefix(target, tmp_path / "bare.kv")
    with pytest.raises(InvalidArgument, match="600"):
        load_prefix(target, tmp_path / "big.kv")
    wide = Generator(random_model("tiny"), capacity=1024, max_seqs=8, eos=[])
    before_wide = state(wide)
    with pytest.raises(InvalidArgument, match="another model|attention layers"):
        load_prefix(wide, tmp_path / "h.kv")
    assert state(target) == before and state(wide) == before_wide


@pytest.mark.parametrize("huge", [range(10**18), range(2**70)], ids=["range-1e18", "range-2**70"])
def test_save_prefix_refuses_a_huge_lazy_sequence_unread(model, tmp_path, huge):
    """Tokens past the cache's capacity (which the prefix cache never holds) given lazily are
    refused by their length: list(range(10**18)) raised a bare MemoryError, range(2**70) an
    OverflowError."""
    gen = make(model)
    gen.add([1, 2, 3, 4, 5], Sampling(max_new_tokens=3))
    gen.run()
    before = state(gen)
    with pytest.raises(InvalidArgument, match="tokens holds more than 1024 token ids"):
        save_prefix(gen, huge, tmp_path / "x.kv")
    assert state(gen) == before and not (tmp_path / "x.kv").exists()


@pytest.mark.parametrize("where", ["callback", "thread"])
def test_save_and_load_are_refused_while_a_step_runs(model, tmp_path, where):
    """From the on_token callback of a request's last token (or another thread while that
    callback holds the step) the generator looked idle, no request left running, and both
    verbs went through in the middle of the step; they are refused as sleep() and
    reset_prefix_cache() are, the file unwritten and the prefix cache as it was."""
    import threading

    gen = make(model)
    req = gen.add([5, 9, 33, 2, 100, 7, 8], Sampling(max_new_tokens=6))
    gen.run()
    history = req.prompt + req.outputs[0][:-1]
    save_prefix(gen, history, tmp_path / "h.kv")
    other = make(model)
    extra = other.add([40, 41, 42, 43], Sampling(max_new_tokens=3))
    other.run()
    save_prefix(other, extra.prompt + extra.outputs[0][:-1], tmp_path / "new.kv")
    seen: list[object] = []

    def attempt() -> None:
        for verb in (lambda: save_prefix(gen, history, tmp_path / "x.kv"),
                     lambda: load_prefix(gen, tmp_path / "new.kv")):
            try:
                seen.append(verb())
            except InvalidState as e:
                seen.append(e)

    def on_token(r, token, *rest):
        if len(r.outputs[0]) < 3:           # (its last token: nothing left running)
            return
        before = state(gen)
        if where == "callback":
            attempt()
        else:
            t = threading.Thread(target=attempt)
            t.start()
            t.join()
        seen.append(state(gen) == before)

    gen.add([1, 2, 3], Sampling(max_new_tokens=3), on_token=on_token)
    gen.run()
    assert len(seen) == 3 and seen[2] is True
    assert all(isinstance(e, InvalidState) and "a step is running" in str(e) for e in seen[:2])
    assert not (tmp_path / "x.kv").exists()
    assert load_prefix(gen, tmp_path / "new.kv") > 0        # idle again: both go through
    assert save_prefix(gen, history, tmp_path / "x.kv") == len(history)
    gen.cache.check_invariants()


def _history(gen, prompt, n=6) -> list[int]:
    req = gen.add(prompt, Sampling(max_new_tokens=n))
    gen.run()
    return req.prompt + req.outputs[0][:-1]


def test_load_into_a_full_cache_evicts_as_an_admission_does(model, tmp_path):
    """A server's prefix cache fills every free cell: a load then refused with OutOfMemory
    however much the prefix cache could give back. It evicts (the policy's order) instead,
    and the loaded prefix serves as a hit."""
    src = make(model)
    history = _history(src, list(range(1, 60)), n=40)          # 98 tokens
    save_prefix(src, history, tmp_path / "h.kv")
    gen = Generator(model, capacity=256, max_seqs=8, eos=[])
    fills = [_history(gen, [200 + 7 * i + j for j in range(30)], n=40) for i in range(4)]
    assert gen.cache.free_cells < len(history) <= gen.cache.free_cells + gen.prefix.evictable_tokens()
    assert load_prefix(gen, tmp_path / "h.kv") == len(history)
    assert gen.prefix.peek(history) == len(history)
    assert gen.prefix.peek(fills[0]) < len(fills[0])            # the oldest went first (LRU)
    hit = gen.add(history + [3, 4], Sampling(max_new_tokens=3))
    gen.run()
    assert hit.cached_tokens == len(history)
    gen.cache.check_invariants()
    gen.prefix.check_invariants()


def test_load_keeps_what_the_prefix_cache_holds_and_places_the_rest(model, tmp_path):
    src = make(model)
    history = _history(src, [5, 9, 33, 2, 100, 7, 8, 61, 62, 63], n=12)
    save_prefix(src, history, tmp_path / "h.kv")
    gen = make(model)
    part = _history(gen, history[:8], n=4)          # the first 8 tokens + 3 of its own
    assert gen.prefix.peek(history) == 8 and part[:8] == history[:8]
    free = gen.cache.free_cells
    assert load_prefix(gen, tmp_path / "h.kv") == len(history) - 8
    assert gen.cache.free_cells == free - (len(history) - 8)    # the held 8 cells shared, not copied
    assert gen.prefix.peek(history) == len(history) and gen.prefix.peek(part) == len(part)
    nxt = history + [44]
    ref = make(model)
    want = ref.add(nxt, Sampling(max_new_tokens=4))
    ref.run()
    got = gen.add(nxt, Sampling(max_new_tokens=4))
    gen.run()
    assert got.cached_tokens == len(history) and got.outputs == want.outputs
    gen.cache.check_invariants()
    gen.prefix.check_invariants()
    assert gen.prefix.metrics()["pins"] == 0                    # the held part's pin taken back


def test_a_load_larger_than_the_room_is_refused_with_nothing_evicted(model, tmp_path):
    src = Generator(model, capacity=512, max_seqs=8, eos=[])
    history = _history(src, list(range(1, 150)), n=60)           # 208 tokens
    save_prefix(src, history, tmp_path / "h.kv")
    small = Generator(model, capacity=192, max_seqs=8, eos=[])
    _history(small, list(range(300, 330)), n=20)
    before = state(small), small.prefix.prefixes()
    with pytest.raises(OutOfMemory, match="the prefix needs 208 cells"):
        load_prefix(small, tmp_path / "h.kv")
    assert (state(small), small.prefix.prefixes()) == before
    small.cache.check_invariants()


def test_load_evicts_for_a_sequence_id_when_the_prefix_cache_holds_them_all(model, tmp_path):
    src = make(model)
    history = _history(src, [70, 71, 72, 73, 74], n=4)
    save_prefix(src, history, tmp_path / "h.kv")
    gen = Generator(model, capacity=1024, max_seqs=3, eos=[])
    for i in range(4):
        _history(gen, [100 + 10 * i + j for j in range(6)], n=3)
    assert len(gen.cache.live_seqs()) == 3                      # every id a cached leaf's
    assert load_prefix(gen, tmp_path / "h.kv") == len(history)
    assert gen.prefix.peek(history) == len(history)
    gen.cache.check_invariants()


@pytest.mark.parametrize("part", ["whole", "first-40"])
def test_save_brings_a_prefix_back_from_the_host_level(model, tmp_path, part):
    """A chat's history that the prefix cache evicted to its host level (spill_prefixes=True)
    was refused by save_prefix ("holds 0 of the tokens"): a server saves a conversation
    after it has gone quiet, when it is most likely to have been evicted. It is restored
    first (all of it, or the first tokens of a longer kept history), then saved."""
    gen = Generator(model, capacity=320, max_seqs=4, eos=[], spill_bytes=1 << 30, spill_prefixes=True)
    rng = np.random.default_rng(3)
    first = _history(gen, rng.integers(1, 500, size=60).tolist(), n=12)
    for _ in range(5):                                   # the others push it out to the host
        _history(gen, rng.integers(1, 500, size=60).tolist(), n=12)
    tier = gen.scheduler.kv.l2
    want = first if part == "whole" else first[:40]
    assert gen.prefix.peek(want) < len(want) and first[:60] in [list(np.frombuffer(k, np.int32))[:60]
                                                                for k in tier.entries]
    assert save_prefix(gen, want, tmp_path / "h.kv") == len(want)
    assert gen.prefix.peek(want) == len(want)
    gen.cache.check_invariants()
    gen.prefix.check_invariants()
    nxt = want + [17, 18]
    ref = make(model)
    expect = ref.add(nxt, Sampling(max_new_tokens=4))
    ref.run()
    other = make(model)
    assert load_prefix(other, tmp_path / "h.kv") == len(want)
    got = other.add(nxt, Sampling(max_new_tokens=4))
    other.run()
    assert got.cached_tokens == len(want) and got.outputs == expect.outputs


def test_save_of_what_neither_level_holds_is_refused_with_the_host_level_kept(model, tmp_path):
    gen = Generator(model, capacity=320, max_seqs=4, eos=[], spill_bytes=1 << 30, spill_prefixes=True)
    rng = np.random.default_rng(4)
    for _ in range(6):
        _history(gen, rng.integers(1, 500, size=60).tolist(), n=12)
    tier = gen.scheduler.kv.l2
    before = state(gen), dict(tier.entries), gen.scheduler.kv.spiller.held
    with pytest.raises(InvalidState, match="holds 0 of the 3 tokens"):
        save_prefix(gen, [501, 502, 503], tmp_path / "x.kv")
    assert (state(gen), dict(tier.entries), gen.scheduler.kv.spiller.held) == before
    assert not (tmp_path / "x.kv").exists()


def test_a_load_the_prefix_cache_has_no_id_for_is_refused_with_nothing_changed(model, tmp_path):
    """A prefix cache at its max_seqs whose only leaf shares the file's first tokens (a
    system prompt) and goes on past them can give no id for the file's branch: give then
    skipped the store, and the load returned 0 ("held already") having placed the file and
    evicted the leaf's tail. Refused before anything changes; a file sharing nothing loads."""
    src = make(model)
    sysp = list(range(10, 30))
    history = _history(src, sysp + [100, 101, 102], n=5)
    save_prefix(src, history, tmp_path / "h.kv")
    gen = Generator(model, capacity=1024, max_seqs=1, eos=[])      # one prefix kept
    _history(gen, sysp + [200, 201, 202], n=5)
    assert gen.prefix.peek(history) == len(sysp)
    before = state(gen), gen.prefix.prefixes()
    with pytest.raises(OutOfMemory, match="sequence id"):
        load_prefix(gen, tmp_path / "h.kv")
    assert (state(gen), gen.prefix.prefixes()) == before and gen.prefix.metrics()["pins"] == 0
    gen.prefix.check_invariants()
    other = Generator(model, capacity=1024, max_seqs=1, eos=[])
    _history(other, list(range(300, 320)), n=5)
    assert load_prefix(other, tmp_path / "h.kv") == len(history)
    assert other.prefix.peek(history) == len(history)


def _host_gen(model, seed=3, **kw):
    gen = Generator(model, capacity=320, max_seqs=4, eos=[], spill_bytes=1 << 30, spill_prefixes=True, **kw)
    rng = np.random.default_rng(seed)
    first = _history(gen, rng.integers(1, 500, size=60).tolist(), n=12)
    for _ in range(5):                                   # the others push it out to the host
        _history(gen, rng.integers(1, 500, size=60).tolist(), n=12)
    return gen, first


def _kept(gen) -> tuple:
    tier = gen.scheduler.kv.l2
    return list(tier.entries), tier.nbytes, gen.scheduler.kv.spiller.held


def test_a_save_from_the_host_level_refused_keeps_the_copy(model, tmp_path):
    """Refusals after the copy left the host level lost it: asleep (the restore's placement
    refused, the spill dropped), no prefix-cache id for it (given, then skipped); a policy
    or on_event raising in the eviction for its cells leaked its bytes from the budget."""
    sysp = list(range(10, 30))
    gen = Generator(model, capacity=1024, max_seqs=1, eos=[], spill_bytes=1 << 30, spill_prefixes=True)
    first = _history(gen, sysp + [100, 101, 102], n=5)
    gen.prefix.evict(1000)                               # to the host level
    _history(gen, sysp + [200, 201, 202], n=5)           # the one id: a branch of the same prompt
    before = state(gen), gen.prefix.prefixes(), _kept(gen)
    with pytest.raises(InvalidState, match="holds 20 of the 27 tokens"):
        save_prefix(gen, first, tmp_path / "x.kv")
    assert (state(gen), gen.prefix.prefixes(), _kept(gen)) == before

    gen, first = _host_gen(model)
    gen.sleep(1, keep_prefixes=True)
    before = _kept(gen)
    with pytest.raises(InvalidState, match="wake"):
        save_prefix(gen, first, tmp_path / "x.kv")
    assert _kept(gen) == before
    gen.wake()
    assert save_prefix(gen, first, tmp_path / "x.kv") == len(first)

    gen, first = _host_gen(model)

    def boom(event):
        if event.kind == "evicted":
            raise KeyError("on_event")

    gen.prefix.on_event = boom
    with pytest.raises(KeyError):
        save_prefix(gen, first, tmp_path / "y.kv")
    gen.prefix.on_event = None
    tier = gen.scheduler.kv.l2
    assert tier.nbytes == gen.scheduler.kv.spiller.held == sum(s.nbytes for s in tier.entries.values())
    assert tier.find_whole(np.asarray(first, np.int32)) is not None
    assert gen.prefix.metrics()["pins"] == 0 and not (tmp_path / "y.kv").exists()
    assert save_prefix(gen, first, tmp_path / "y.kv") == len(first)
    gen.cache.check_invariants()
    gen.prefix.check_invariants()
