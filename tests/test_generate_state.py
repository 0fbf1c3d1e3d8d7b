"""Cached prefixes saved to a file and loaded into another Generator (cellcache.generate.state):
a conversation's history computed once serves the next process's request as a prefix-cache
hit with the same tokens; every refusal is the library's error with nothing changed."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from cellcache import InvalidArgument, InvalidState  # noqa: E402
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
