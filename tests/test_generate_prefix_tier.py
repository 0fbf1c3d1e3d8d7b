"""The prefix cache's host level (Generator(spill_prefixes=True)): conversations whose
histories do not fit the cache come back from host memory at their next turn, with the same
tokens as reading them again and fewer tokens computed; the budget is kept; a reset lets the
kept prefixes go; bad combinations are refused."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cellcache import InvalidArgument  # noqa: E402
from cellcache.generate import Generator, Sampling, random_model  # noqa: E402

N_CONV = 8


@pytest.fixture(scope="module", params=["llama-tiny", "tiny"])   # tiny: sliding windows
def model(request):
    return random_model(request.param, seed=5)


def chat(model, reverse=False, **kw):
    """Two turns of N_CONV conversations in a cache that holds about three histories: every
    first turn, then every second turn (history + the answer + a new message; ``reverse``:
    the most recent conversation first)."""
    gen = Generator(model, capacity=320, max_seqs=4, eos=[], **kw)
    rng = np.random.default_rng(0)
    firsts = [rng.integers(1, 500, size=60).tolist() for _ in range(N_CONV)]
    outs = []
    for turn in range(2):
        prompts = firsts if turn == 0 else [p + o + rng.integers(1, 500, size=8).tolist()
                                            for p, o in zip(firsts, outs[0])]
        order = list(range(N_CONV))[::-1] if reverse and turn else list(range(N_CONV))
        reqs = {}
        for i in order:                   # one conversation at a time: the others get evicted
            reqs[i] = gen.add(prompts[i], Sampling(max_new_tokens=12))
            gen.run()
        outs.append([reqs[i].outputs[0] for i in range(N_CONV)])
    gen.cache.check_invariants()
    return outs, gen


def test_evicted_histories_come_back_from_the_host_with_the_same_tokens(model):
    ref, rgen = chat(model)
    out, gen = chat(model, spill_bytes=1 << 30, spill_prefixes=True)
    assert out == ref
    st, rst = gen.stats, rgen.stats
    tier = gen.scheduler.kv.l2
    assert tier.stats["stored"] > 0 and st["l2_found"] >= N_CONV // 2
    # one copy an evicted history: not one more for each node an eviction walks up through
    assert tier.stats["stored"] <= 2 * N_CONV
    assert st["restored_tokens"] > 0 and rgen.stats["restored_tokens"] == 0
    assert st["computed_tokens"] == rst["computed_tokens"] - st["restored_tokens"]
    assert st["computed_tokens"] < 0.8 * rst["computed_tokens"]
    sp = gen.scheduler.kv.spiller
    assert sp.held == sum(s.nbytes for s in tier.entries.values())


def test_a_small_budget_keeps_the_most_recent_prefixes_within_it(model):
    ref, _ = chat(model, reverse=True)
    _, big = chat(model, reverse=True, spill_bytes=1 << 30, spill_prefixes=True)
    one = max(s.nbytes for s in big.scheduler.kv.l2.entries.values())
    out, gen = chat(model, reverse=True, spill_bytes=3 * one, spill_prefixes=True)   # ~3 histories
    assert out == ref
    tier, sp = gen.scheduler.kv.l2, gen.scheduler.kv.spiller
    assert sp.held <= sp.budget and tier.stats["dropped"] > 0
    assert sp.held == sum(s.nbytes for s in tier.entries.values()) == tier.nbytes
    # the last conversations' histories were the most recent: some turns still found theirs
    assert 0 < gen.stats["l2_found"] < big.stats["l2_found"]


@pytest.mark.parametrize("how", ["reset", "sleep"])
def test_reset_and_sleep_let_the_kept_prefixes_go(model, how):
    _, gen = chat(model, spill_bytes=1 << 30, spill_prefixes=True)
    tier, sp = gen.scheduler.kv.l2, gen.scheduler.kv.spiller
    assert len(tier) > 0 and sp.held > 0
    if how == "reset":
        gen.reset_prefix_cache()
    else:
        gen.sleep(1)
        gen.wake()
    assert len(tier) == 0 and sp.held == 0 and not tier.lengths and tier.nbytes == 0


def test_the_same_prompt_again_restores_its_kept_history_up_to_the_prompt(model):
    """A kept history longer than the prompt that finds it (the same prompt asked again
    after its history was evicted) is restored up to the prompt's last token."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 500, size=60).tolist() for _ in range(N_CONV)]

    def run(**kw):
        gen = Generator(model, capacity=320, max_seqs=4, eos=[], **kw)
        for p in prompts:                  # one at a time: the first ones' histories evicted
            gen.add(p, Sampling(max_new_tokens=12))
            gen.run()
        again = gen.add(prompts[0], Sampling(max_new_tokens=12))
        gen.run()
        gen.cache.check_invariants()
        return again.outputs, gen

    ref, rgen = run()
    out, gen = run(spill_bytes=1 << 30, spill_prefixes=True)
    assert out == ref
    assert gen.stats["l2_found"] == 1
    assert gen.stats["restored_tokens"] == len(prompts[0]) - 1            # up to the prompt's last
    assert gen.stats["computed_tokens"] == rgen.stats["computed_tokens"] - (len(prompts[0]) - 1)
    assert gen.scheduler.kv.spiller.held == gen.scheduler.kv.l2.nbytes   # the found one let go


def test_find_prefers_a_key_and_scans_only_for_a_whole_prompt():
    """PrefixTier.find: a kept prefix of the prompt by its key; else a kept history the
    prompt runs into, restored up to the prompt's last token, only when the whole prompt
    can be placed (a history cut for room would lose its tail)."""
    from cellcache.generate.spill import PrefixTier, Spill

    class Spiller:                          # the tier's side of it: a budget and copies
        held, budget = 0, 1 << 30

        def bytes_for(self, n):
            return n

        def take(self, seq, length):
            return Spill(np.arange(length), length, torch.zeros(1), length)

        def drop(self, spill):
            pass

    tier = PrefixTier(Spiller())
    a = np.arange(100, 200, dtype=np.int32)
    tier.store(0, 100, a)                   # a 100-token history
    tier.store(1, 30, a[:30])               # and a 30-token prefix of it
    got = tier.find(a[:50], 0)
    assert got.length == 30 and got.stop is None and got.end == 30     # the key, no scan
    got = tier.find(a[:50], 0)              # now the history the prompt runs into
    assert got.length == 100 and got.stop == 49 and got.end == 49 and len(tier) == 0
    tier.store(0, 100, a)
    assert tier.find(a[:50], 0, below=20) is None and len(tier) == 1   # capped by room: kept
    assert tier.find(a[:50], 49) is None                               # nothing past the hit
    b = a.copy()
    b[10] += 1
    assert tier.find(b[:50], 0) is None and len(tier) == 1             # diverges early
    assert tier.stats["found"] == 2


def test_sleep_can_keep_the_prefixes_in_the_host_level(model):
    """sleep(1, keep_prefixes=True): the prefix cache's contents move to the host level
    and the next turns take them back after the wake (the tokens of a run that never
    slept, fewer computed than after a plain sleep); a reset drops them."""
    rng = np.random.default_rng(3)
    firsts = [rng.integers(1, 500, size=40).tolist() for _ in range(3)]   # all fit the cache

    def run(keep, sleep=True):
        gen = Generator(model, capacity=320, max_seqs=4, eos=[], spill_bytes=1 << 30, spill_prefixes=True)
        first = [gen.add(p, Sampling(max_new_tokens=8)) for p in firsts]
        gen.run()
        if sleep:
            gen.sleep(1, keep_prefixes=keep)
            assert gen.prefix.metrics()["cached_tokens"] == 0
            assert (len(gen.scheduler.kv.l2) > 0) == keep
            gen.wake()
        again = [gen.add(p + r.outputs[0] + [5, 6], Sampling(max_new_tokens=8))
                 for p, r in zip(firsts, first)]
        gen.run()
        gen.cache.check_invariants()
        return [r.outputs for r in again], gen

    ref, _ = run(False, sleep=False)
    plain, pgen = run(False)
    kept, kgen = run(True)
    assert plain == ref and kept == ref
    assert pgen.stats["l2_found"] == 0 and kgen.stats["l2_found"] == len(firsts)
    assert kgen.stats["computed_tokens"] < pgen.stats["computed_tokens"]
    assert kgen.stats["computed_tokens"] == pgen.stats["computed_tokens"] - kgen.stats["restored_tokens"]
    kgen.sleep(1, keep_prefixes=True)
    kgen.wake()
    assert len(kgen.scheduler.kv.l2) > 0
    kgen.reset_prefix_cache()                         # the weights changed meanwhile
    assert len(kgen.scheduler.kv.l2) == 0 and kgen.scheduler.kv.spiller.held == 0
    kgen.add(firsts[0], Sampling(max_new_tokens=4))
    kgen.run()
    kgen.sleep(1, keep_prefixes=True)
    assert len(kgen.scheduler.kv.l2) > 0
    kgen.sleep(1)                                     # asleep already: a plain sleep drops them
    assert len(kgen.scheduler.kv.l2) == 0 and kgen.asleep == 1
    kgen.wake()


def test_sleep_keep_prefixes_refusals_change_nothing(model):
    gen = Generator(model, capacity=320, max_seqs=4, eos=[])
    gen.add(list(range(1, 40)), Sampling(max_new_tokens=4))
    gen.run()
    cached = gen.prefix.metrics()["cached_tokens"]
    assert cached > 0
    with pytest.raises(InvalidArgument, match="spill_prefixes=True"):
        gen.sleep(1, keep_prefixes=True)
    with pytest.raises(InvalidArgument, match="keep_prefixes of type int"):
        gen.sleep(1, keep_prefixes=1)
    assert not gen.asleep and gen.prefix.metrics()["cached_tokens"] == cached


def test_a_prompt_asking_for_its_log_probabilities_is_read_whole(model):
    """A restored prefix has no prompt log-probabilities: such a prompt is read, never restored."""
    def run(**kw):
        gen = Generator(model, capacity=320, max_seqs=4, eos=[], **kw)
        rng = np.random.default_rng(1)
        firsts = [rng.integers(1, 500, size=60).tolist() for _ in range(N_CONV)]
        for p in firsts:
            gen.add(p, Sampling(max_new_tokens=4))
            gen.run()
        req = gen.add(firsts[0] + [7, 8, 9], Sampling(max_new_tokens=4, prompt_logprobs=0))
        gen.run()
        return req, gen

    ref, _ = run()
    req, gen = run(spill_bytes=1 << 30, spill_prefixes=True)
    assert gen.scheduler.kv.l2.stats["stored"] > 0 and gen.stats["l2_found"] == 0
    assert req.outputs == ref.outputs
    got, want = req.prompt_logprobs, ref.prompt_logprobs
    assert len(got) == len(want) == 63 and all(x is not None for x in got[1:])


@pytest.mark.parametrize("kw,says", [
    ({"spill_prefixes": True}, "give it spill_bytes"),
    ({"spill_prefixes": True, "spill_bytes": 1 << 20, "prefix_cache": False}, "needs the prefix cache"),
    ({"spill_prefixes": 1, "spill_bytes": 1 << 20}, "spill_prefixes of type int is not a bool"),
])
def test_bad_combinations_are_refused(model, kw, says):
    with pytest.raises(InvalidArgument, match=says):
        Generator(model, capacity=320, **kw)


def test_before_evict_sees_the_prefix_with_its_cells_and_cannot_stop_the_eviction():
    import cellcache as cc

    cache = cc.build("host", "batched", cc.CacheConfig(capacity=64, layers=[cc.LayerConfig(1, 8)],
                                                       max_write=16, mask_format="none"))
    prefix = cc.PrefixCache(cache)
    seen = []

    def hook(seq, length, tokens):
        seen.append((cache.pos(seq), length, tokens.tolist(), cache.free_cells))
        raise RuntimeError("a copy failing")

    prefix.before_evict = hook
    s = cache.seq_new()
    prompt = [5, 6, 7, 8, 9]
    cache.declare_step([s] * len(prompt))
    cache.prepare_step()
    cache.commit_step()
    prefix.insert(s, prompt)
    cache.seq_rm(s)                                   # the prefix cache's own copy holds the cells
    free = cache.free_cells
    assert prefix.evict(n_cells=1) == 5
    assert seen == [(5, 5, prompt, free)]          # called while the cells were still held
    assert cache.free_cells == free + 5 and prefix.peek(prompt) == 0
