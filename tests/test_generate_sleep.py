"""Generator.sleep / wake (cellcache.generate.sleep): the same requests give the same tokens
after a sleep at either level, the prefix cache starts empty, requests added while asleep
run after wake, and every refusal is the library's error with nothing changed."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cellcache import InvalidArgument, InvalidState  # noqa: E402
from cellcache.generate import Generator, Sampling, random_model  # noqa: E402

PROMPTS = [[5, 9, 33, 2, 100, 7, 8], [1, 2, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


@pytest.fixture(scope="module")
def model():
    return random_model("llama-tiny", seed=3)


def make(model, **kw):
    return Generator(model, capacity=1024, max_seqs=8, eos=[], **kw)


def serve(gen, seed: int | None = None):
    reqs = [gen.add(p, Sampling(max_new_tokens=6, temperature=0.0 if seed is None else 1.0,
                                seed=seed)) for p in PROMPTS]
    gen.run()
    return [r.outputs for r in reqs]


def state(gen) -> tuple:
    c = gen.cache
    return (gen.asleep, c.asleep, c.free_cells, sorted(c.live_seqs()),
            gen.prefix.metrics()["cached_tokens"], len(gen.waiting), len(gen.running))


@pytest.mark.parametrize("level", [1, 2])
def test_the_same_requests_give_the_same_tokens_after_sleep_and_wake(model, level):
    gen = make(model)
    greedy, sampled = serve(gen), serve(gen, seed=7)
    assert gen.prefix.metrics()["cached_tokens"] > 0
    gen.sleep(level)
    assert gen.asleep == level and gen.cache.asleep
    assert gen.prefix.metrics()["cached_tokens"] == 0          # the K/V was not kept
    assert gen.cache.metrics()["allocated_bytes"] == 0
    assert gen.cache.free_cells == gen.cache.capacity
    gen.sleep(level)                                            # again: nothing happens
    gen.wake()
    assert gen.asleep == 0 and not gen.cache.asleep
    gen.wake()                                                  # awake: nothing happens
    assert serve(gen) == greedy and serve(gen, seed=7) == sampled
    gen.cache.check_invariants()


def test_requests_added_while_asleep_wait_and_run_after_wake(model):
    ref = serve(make(model))
    gen = make(model)
    gen.sleep()
    reqs = [gen.add(p, Sampling(max_new_tokens=6)) for p in PROMPTS]
    before = state(gen)
    with pytest.raises(InvalidState, match="asleep"):
        gen.step()
    with pytest.raises(InvalidState, match="asleep"):
        gen.run()
    assert state(gen) == before and not any(r.done for r in reqs)
    gen.wake()
    with pytest.raises(InvalidState, match="queued or running"):
        gen.sleep()                         # awake now; the queued requests refuse a sleep
    gen.run()
    assert [r.outputs for r in reqs] == ref


def test_sleep_is_refused_while_requests_are_queued_or_running(model):
    gen = make(model)
    serve(gen)
    req = gen.add(PROMPTS[0], Sampling(max_new_tokens=20))
    before = state(gen)
    with pytest.raises(InvalidState, match="queued or running"):
        gen.sleep()
    assert state(gen) == before
    gen.step()                                           # now running, cells owned
    before = state(gen)
    with pytest.raises(InvalidState, match="queued or running"):
        gen.sleep(2)
    with pytest.raises(InvalidState, match="queued or running"):
        gen.reset_prefix_cache()
    assert state(gen) == before and not req.done
    gen.run()
    assert req.done and len(req.outputs[0]) == 20


def test_bad_levels_and_a_second_level_are_refused(model):
    gen = make(model)
    serve(gen)
    before = state(gen)
    for level in (0, 3, True, 1.0, "1", None):
        with pytest.raises(InvalidArgument, match="sleep level"):
            gen.sleep(level)
    assert state(gen) == before
    gen.sleep(1)
    before = state(gen)
    with pytest.raises(InvalidState, match="asleep at level 1"):
        gen.sleep(2)
    assert state(gen) == before
    gen.wake()


def test_sleep_from_inside_a_step_is_refused(model):
    gen = make(model)
    seen = []

    def on_token(req, k, tok):
        for call in (gen.sleep, gen.wake, gen.reset_prefix_cache):
            try:
                call()
            except InvalidState as e:
                seen.append(str(e))

    gen.add(PROMPTS[1], Sampling(max_new_tokens=2), on_token=on_token)
    gen.run()
    assert len(seen) == 6 and all("while a step runs" in m for m in seen)
    assert gen.asleep == 0


def test_reset_prefix_cache_empties_it_and_the_next_request_computes_its_prompt(model):
    gen = make(model)
    first = serve(gen)
    held = gen.prefix.metrics()["cached_tokens"]
    free = gen.cache.free_cells
    assert held > 0
    assert gen.reset_prefix_cache() == gen.cache.free_cells - free > 0
    assert gen.prefix.metrics()["cached_tokens"] == 0
    req = gen.add(PROMPTS[0], Sampling(max_new_tokens=6))
    gen.run()
    assert req.cached_tokens == 0 and req.outputs == first[0]
    assert make(model, prefix_cache=False).reset_prefix_cache() == 0


def test_a_sleep_the_cache_refuses_leaves_the_generator_awake_and_serving(model):
    gen = make(model)
    ref = serve(gen)
    other = gen.cache.seq_new()                       # another user of the cache holds a cell
    assert gen.cache.declare_step([other])
    gen.cache.prepare_step()
    gen.cache.commit_step()
    for level in (1, 2):
        with pytest.raises(InvalidState, match="1 cells are owned"):
            gen.sleep(level)
        assert gen.asleep == 0 and not gen.cache.asleep
        assert all(p.device.type == "cpu" for p in model.parameters())
    assert serve(gen) == ref
    gen.cache.seq_rm(other)


def test_a_wake_that_runs_out_of_memory_stays_asleep_and_can_be_retried(model, monkeypatch):
    from cellcache import OutOfMemory

    gen = make(model)
    ref = serve(gen)
    gen.sleep(2)
    calls = {"n": 0}
    real = type(gen.cache).wake

    def failing(cache):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OutOfMemory("injected: no memory for the pools")
        return real(cache)

    monkeypatch.setattr(type(gen.cache), "wake", failing)
    with pytest.raises(OutOfMemory, match="injected"):
        gen.wake()
    assert gen.asleep == 2 and gen.cache.asleep
    gen.wake()
    assert gen.asleep == 0 and serve(gen) == ref
