"""The host tier (cellcache.generate.spill): a preempted sequence's K/V kept in host memory
comes back when it is admitted again, with the same tokens as recompute gives, fewer tokens
computed, and the budget given back; a restore that fails falls back to recompute; bad
budgets are refused."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cellcache import InvalidArgument, OutOfMemory  # noqa: E402
from cellcache.generate import Generator, Sampling, random_model  # noqa: E402

PROMPTS = [[(7 * i + j) % 500 for j in range(20 + 5 * i)] for i in range(12)]


@pytest.fixture(scope="module", params=["llama-tiny", "tiny"])   # tiny: sliding windows
def model(request):
    return random_model(request.param, seed=3)


def serve(model, **kw):
    """Every prompt at once into a cache too small for them (reserve 0: preemptions)."""
    gen = Generator(model, capacity=400, max_seqs=16, eos=[], reserve=0.0, **kw)
    reqs = [gen.add(p, Sampling(max_new_tokens=40, temperature=0.9 if i % 3 else 0.0, seed=i,
                                n=2 if i % 4 == 0 else 1))
            for i, p in enumerate(PROMPTS)]
    gen.run()
    gen.cache.check_invariants()
    return [r.outputs for r in reqs], gen


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_spilled_sequences_come_back_with_the_same_tokens_and_less_computed(model, prefix_cache):
    ref, rgen = serve(model, prefix_cache=prefix_cache)
    out, gen = serve(model, prefix_cache=prefix_cache, spill_bytes=1 << 30)
    assert out == ref
    st, rst = gen.stats, rgen.stats
    assert st["preempted"] == rst["preempted"] > 0
    assert st["spilled"] == st["preempted"] and st["restored_tokens"] > 0
    assert st["computed_tokens"] == rst["computed_tokens"] - st["restored_tokens"]
    sp = gen.scheduler.kv.spiller
    assert sp.held == 0 and sp.stats["spilled"] == st["spilled"]


def test_a_small_budget_spills_what_it_holds_and_reads_the_rest_again(model):
    ref, _ = serve(model)
    out, gen = serve(model, spill_bytes=20_000)
    assert out == ref
    assert 0 < gen.stats["spilled"] < gen.stats["preempted"]
    assert gen.scheduler.kv.spiller.held == 0


def test_a_restore_that_fails_reads_the_sequence_again(model, monkeypatch):
    ref, _ = serve(model)
    from cellcache.generate.spill import Spiller

    real = Spiller.give
    calls = {"n": 0}

    def flaky(self, spill, sid, start):
        calls["n"] += 1
        if calls["n"] % 2:
            self.drop(spill)
            raise OutOfMemory("injected: no cells")
        return real(self, spill, sid, start)

    monkeypatch.setattr(Spiller, "give", flaky)
    out, gen = serve(model, spill_bytes=1 << 30)
    assert out == ref and calls["n"] > 1
    assert 0 < gen.stats["restored_tokens"]
    assert gen.scheduler.kv.spiller.held == 0


def test_a_cancelled_spilled_request_gives_its_host_memory_back(model):
    gen = Generator(model, capacity=400, max_seqs=16, eos=[], reserve=0.0, spill_bytes=1 << 30)
    reqs = [gen.add(p, Sampling(max_new_tokens=40)) for p in PROMPTS]
    sp = gen.scheduler.kv.spiller
    while gen.step() and not any(s.spill is not None for s in gen.waiting):
        pass
    spilled = [s for s in gen.waiting if s.spill is not None]
    assert spilled and sp.held > 0
    for s in spilled:
        gen.cancel(s.req)
    assert sp.held == 0
    gen.run()
    assert all(r.done for r in reqs)
    gen.cache.check_invariants()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1", None])
def test_bad_budgets_are_refused(bad):
    with pytest.raises(InvalidArgument, match="spill_bytes"):
        Generator(random_model("llama-tiny"), capacity=64, spill_bytes=bad)


def test_the_pinned_arena_reuses_what_spills_give_back():
    from cellcache.generate.spill import PinnedArena

    arena = PinnedArena(limit=4096, slab=2048, pin=False)
    a = arena.alloc(1000)                    # (rounded up to 1024)
    b = arena.alloc(1000)
    assert a == (0, 0) and b == (0, 1024) and len(arena.slabs) == 1
    c = arena.alloc(1500)                    # a second slab
    assert c == (1, 0) and arena.nbytes == 4096
    assert arena.alloc(600) is None          # the limit: no third slab
    arena.release(*a, 1000)
    arena.release(*b, 1000)                  # merged with a's range: the whole slab again
    assert arena.free[0] == [(0, 2048)]
    assert arena.alloc(2048) == (0, 0) and arena.nbytes == 4096
    big = PinnedArena(limit=1 << 20, slab=1024, pin=False)
    assert big.alloc(5000) == (0, 0) and big.slabs[0].numel() == 5120   # a slab of its own


def test_a_restore_failing_in_torch_is_the_librarys_out_of_memory_and_undoes_its_cells(monkeypatch):
    import cellcache as cc
    from cellcache.generate.spill import Spiller
    from cellcache.torch import TorchView

    from .test_seqstate import LAYERS, feed

    cache = cc.HostCellCache(cc.CacheConfig(capacity=256, layers=LAYERS, max_write=16, max_seqs=8))
    a = cache.seq_new()
    feed(cache, a, 40, seed=1)
    sp = Spiller(cache, TorchView(cache), 1 << 20)
    spill = sp.take(a, 40)
    assert spill is not None and sp.held == spill.nbytes
    b = cache.seq_clone(a, 10)
    cache.seq_rm(a)
    free = cache.free_cells
    calls = {"n": 0}
    real = torch.Tensor.index_copy_

    def oom(self, *args):
        calls["n"] += 1
        if calls["n"] == 3:                           # part way through the scatter (every step placed)
            raise RuntimeError("CUDA out of memory (injected)")
        return real(self, *args)

    monkeypatch.setattr(torch.Tensor, "index_copy_", oom)
    with pytest.raises(OutOfMemory, match="restoring a spilled sequence failed"):
        sp.give(spill, b, 10)
    assert cache.seq_len(b) == 10 and cache.free_cells == free and sp.held == 0
    assert cache.table.declared_width == 0 and cache.prepared_step is None
    cache.check_invariants()


@pytest.mark.parametrize("window", [None, 12])
def test_a_restore_puts_every_kept_row_back_at_its_position(window):
    """The rows go in after the last step of the placement: each position's K/V equals
    the spilled one, placed after another sequence took cells it left,
    with and without sliding-window layers."""
    import cellcache as cc
    from cellcache.generate.spill import Spiller
    from cellcache.torch import TorchView

    from .test_seqstate import feed, kv_at

    extra = {} if window is None else {"window": window}
    layers = (cc.LayerConfig(n_kv_heads=2, head_dim=8, **extra),
              cc.LayerConfig(n_kv_heads=2, head_dim=8, **extra))
    cache = cc.HostCellCache(cc.CacheConfig(capacity=96, layers=layers, max_write=16, max_seqs=8))
    a = cache.seq_new()
    feed(cache, a, 40, seed=3)
    before = kv_at(cache, a)
    sp = Spiller(cache, TorchView(cache), 1 << 20)
    spill = sp.take(a, 40)
    assert spill is not None and sorted(before) == spill.positions.tolist()
    cache.seq_rm(a)
    filler = cache.seq_new()                       # the freed cells taken: others come back
    feed(cache, filler, 24, seed=4)
    b = cache.seq_new()
    sp.give(spill, b, 0)
    assert cache.seq_len(b) == 40 and sp.held == 0
    after = kv_at(cache, b)
    assert sorted(after) == sorted(before)
    for pos, rows in before.items():
        for x, y in zip(rows, after[pos]):
            assert torch.equal(x, y), pos
    cache.check_invariants()
