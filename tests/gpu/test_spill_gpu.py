"""The host tier on the device: a sequence's K/V spilled to pinned memory and restored into
other cells is bit for bit what it was (bf16), and a Generator with graphs and preemptions
gives the same tokens with the tier as without it (float32), the prefix cache's host level
too."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import cellcache as cc  # noqa: E402

from ..test_seqstate import LAYERS, feed, kv_at  # noqa: E402


@pytest.mark.parametrize("growth, kv, clone_at", [
    ("auto", None, 20), ("auto", None, 50), ("copy", None, 20), ("auto", "fp8_e4m3", 20)])
def test_a_spill_round_trip_is_bit_exact_in_bf16(growth, kv, clone_at):
    """Restored past a clone of 20 (the whole spill goes up in one copy) or 50 positions (each
    pool's slice of the 20 left); with copy growth the pools move part-way through the
    restore (80 rows at first: a restore step needs more), so its later steps go through a
    new table of the pools; 8-bit pools move as bytes."""
    from cellcache.cuda.backend import CudaCellCache  # (not at collection: see conftest)
    from cellcache.generate.spill import Spiller
    from cellcache.torch import TorchView

    cfg = cc.CacheConfig(capacity=512, layers=LAYERS, max_write=16, dtype="bfloat16", max_seqs=8,
                         initial_capacity=80, kv_dtype=kv)
    with CudaCellCache(cfg, growth=growth) as cache:
        a = cache.seq_new()
        feed(cache, a, 70, seed=4)
        torch.cuda.synchronize()
        before = {p: [t.cpu() for t in ts] for p, ts in kv_at(cache, a).items()}
        view = TorchView(cache)
        sp = Spiller(cache, view, 1 << 30)
        spill = sp.take(a, 70)
        assert spill is not None and spill.host[0].is_pinned() and sp.held == spill.nbytes
        clone = cache.seq_clone(a, clone_at)      # (a prefix kept elsewhere: restored past it)
        cache.seq_rm(a)
        filler = cache.seq_new()
        feed(cache, filler, 33, seed=5)           # the old cells are taken by another sequence
        moved = cache.pools_generation
        sp.give(spill, clone, clone_at)
        assert sp.held == 0 and cache.seq_len(clone) == 70
        assert (cache.pools_generation > moved) == (growth == "copy" and clone_at == 20)
        after = {p: [t.cpu() for t in ts] for p, ts in kv_at(cache, clone).items()}
        assert sorted(after) == sorted(before)
        assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                   for p in before for x, y in zip(before[p], after[p]))
        assert sp._table is not None and sp._table[1] is not None   # (the row mover ran)
        cache.check_invariants()


def _table(pools):
    import numpy as np

    rows = [p.shape[1] for p in pools]
    cum = np.concatenate([[0], np.cumsum(rows)[:-1]])
    return torch.tensor(np.stack([[p.data_ptr() for p in pools], rows, cum], 1).astype(np.int64),
                        device="cuda"), rows


@pytest.mark.parametrize("sizes, vecs", [((256, 48, 2048, 16), (16, 1)), ((5, 3, 130), (1,))])
@pytest.mark.parametrize("units, blocks", [(None, None), (4096, None), (None, 3)])
def test_the_row_mover_gathers_and_scatters_every_pool_in_one_launch(sizes, vecs, units, blocks,
                                                                     monkeypatch):
    """FusedKernels.move_rows against index_select / index_copy_ pool by pool: rows of every
    size (16-byte units and bytes), a gather into a packed stage and a scatter of a subset of
    its rows into other cells, rows untouched elsewhere; with ``units`` 4096 the launches go
    in pieces of a few rows (the kernel's row0), with ``blocks`` 3 each thread loops over
    many units (the grid-stride loop)."""
    from cellcache.cuda import fused
    from cellcache.errors import InvalidArgument

    if units is not None:
        monkeypatch.setattr(fused, "_MAX_UNITS", units)
    if blocks is not None:
        monkeypatch.setattr(fused, "_MAX_BLOCKS", blocks)
    k = fused.fused_kernels(torch.cuda.current_device())
    stream = torch.cuda.current_stream().cuda_stream
    g = torch.Generator(device="cuda").manual_seed(0)
    pools = [torch.randint(0, 256, (300, b), dtype=torch.uint8, device="cuda", generator=g) for b in sizes]
    table, rows = _table(pools)
    n = 123
    idx = torch.randperm(300, device="cuda", generator=g)[:n]
    total = sum(rows)
    for vec in vecs:
        stage = torch.zeros(n * total, dtype=torch.uint8, device="cuda")
        k.move_rows(table.data_ptr(), len(pools), rows, stage.data_ptr(), n, idx.data_ptr(), 0, n,
                    True, vec, stream)
        off = 0
        for p, b in zip(pools, rows):
            assert torch.equal(stage[off:off + n * b].view(n, b), p.index_select(0, idx))
            off += n * b
        # a scatter: stage rows src (distinct, any order) into cells dst of a copy of the pools
        m = 50
        src = torch.randperm(n, device="cuda", generator=g)[:m]
        dst = torch.randperm(300, device="cuda", generator=g)[:m]
        want = [p.clone() for p in pools]
        for w, part in zip(want, fused_parts(stage, rows, n)):
            w.index_copy_(0, dst, part.index_select(0, src))
        pairs = torch.stack([dst, src]).contiguous()
        k.move_rows(table.data_ptr(), len(pools), rows, stage.data_ptr(), n, pairs[0].data_ptr(),
                    pairs[1].data_ptr(), m, False, vec, stream)
        assert all(torch.equal(p, w) for p, w in zip(pools, want))
    before = [p.clone() for p in pools]
    # rows that are not whole 16-byte units, or (rows that are) a stage off 16 bytes
    refusals = [(stage.data_ptr(), 16, "units of 16")] if 16 not in vecs else \
        [(stage.data_ptr() + 8, 16, "multiple of 16")]
    for at, vec, why in refusals:
        with pytest.raises(InvalidArgument, match=why):
            k.move_rows(table.data_ptr(), len(pools), rows, at, n, idx.data_ptr(), 0, n, False,
                        vec, stream)
    assert all(torch.equal(p, b) for p, b in zip(pools, before))


def fused_parts(stage, rows, n):
    out, off = [], 0
    for b in rows:
        out.append(stage[off:off + n * b].view(n, b))
        off += n * b
    return out


def test_a_generator_with_graphs_gives_the_same_tokens_with_the_tier():
    from cellcache.generate import Generator, Sampling, random_model

    model = random_model("llama-tiny", torch.float32, "cuda", seed=5)
    prompts = [[(7 * i + j) % 500 for j in range(20 + 5 * i)] for i in range(24)]

    def serve(**kw):
        gen = Generator(model, capacity=700, max_seqs=32, eos=[], reserve=0.0, **kw)
        assert gen.runner.graphs_enabled
        reqs = [gen.add(p, Sampling(max_new_tokens=48, temperature=0.8 if i % 2 else 0.0, seed=i))
                for i, p in enumerate(prompts)]
        gen.run()
        gen.cache.check_invariants()
        return [r.outputs for r in reqs], gen

    ref, rgen = serve()
    out, gen = serve(spill_bytes=1 << 28)
    assert rgen.stats["preempted"] > 0 and gen.stats["restored_tokens"] > 0
    assert out == ref
    assert gen.scheduler.kv.spiller.held == 0


def test_the_prefix_level_gives_the_same_tokens_with_its_copies_on_the_stream():
    """Conversations whose histories do not fit come back from host memory with the tokens
    of reading them again (float32); the copies, queued on the runner's stream with no host
    wait, are timed on the device."""
    from cellcache.generate import random_model

    from ..test_generate_prefix_tier import chat

    model = random_model("llama-tiny", torch.float32, "cuda", seed=5)
    ref, rgen = chat(model)
    out, gen = chat(model, spill_bytes=1 << 28, spill_prefixes=True)
    assert gen.runner.graphs_enabled
    assert out == ref
    assert gen.stats["l2_found"] > 0 and gen.stats["restored_tokens"] > 0
    assert gen.stats["computed_tokens"] == rgen.stats["computed_tokens"] - gen.stats["restored_tokens"]
    st = gen.scheduler.kv.spiller.settle()
    assert st["spill_s"] > 0 and st["restore_s"] > 0 and not gen.scheduler.kv.spiller._timing
