"""Sequence files on the CUDA backend: a sequence saved from a CUDA cache loads into a host
cache and into another CUDA cache (bf16) with the same K/V at every position, and one saved
from the host loads onto the GPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

import cellcache as cc  # noqa: E402
from cellcache.seqstate import load_sequence, save_sequence  # noqa: E402

from ..test_seqstate import LAYERS, feed, kv_at  # noqa: E402


def config() -> cc.CacheConfig:
    return cc.CacheConfig(capacity=256, layers=LAYERS, max_write=16, dtype="bfloat16", max_seqs=8)


def test_sequence_files_cross_backends(tmp_path):
    from cellcache.cuda.backend import CudaCellCache  # (not at collection: see conftest)

    with CudaCellCache(config()) as dev, CudaCellCache(config()) as dev2:
        host = cc.HostCellCache(config())
        s = dev.seq_new()
        feed(dev, s, 37, seed=11)
        torch.cuda.synchronize()
        assert save_sequence(dev, s, tmp_path / "d.kv", tokens=[1, 2, 3]) == 37
        mine = {p: [t.cpu() for t in ts] for p, ts in kv_at(dev, s).items()}
        for target in (host, dev2):
            seq, tokens = load_sequence(target, tmp_path / "d.kv")
            theirs = {p: [t.cpu() for t in ts] for p, ts in kv_at(target, seq).items()}
            assert tokens == [1, 2, 3] and sorted(theirs) == list(range(37))
            assert all(torch.equal(x, y) for p in mine for x, y in zip(mine[p], theirs[p]))
        h = host.seq_new()
        feed(host, h, 20, seed=12)
        save_sequence(host, h, tmp_path / "h.kv")
        seq, _ = load_sequence(dev, tmp_path / "h.kv")
        back = {p: [t.cpu() for t in ts] for p, ts in kv_at(dev, seq).items()}
        ref = kv_at(host, h)
        assert all(torch.equal(x, y) for p in ref for x, y in zip(ref[p], back[p]))
        dev.check_invariants()


def test_a_prefix_saved_from_the_host_level_loads_into_a_full_cache(tmp_path):
    """On the device with graphs (float32): a history the prefix cache evicted to its host
    level is brought back and saved; loaded into another Generator whose prefix cache fills
    its free cells, it evicts for room and its next turn is a hit with the tokens of reading
    it again."""
    import numpy as np

    from cellcache.generate import Generator, Sampling, load_prefix, random_model, save_prefix

    model = random_model("llama-tiny", torch.float32, "cuda", seed=5)
    rng = np.random.default_rng(3)

    def history(gen):
        req = gen.add(rng.integers(1, 500, size=60).tolist(), Sampling(max_new_tokens=12))
        gen.run()
        return req.prompt + req.outputs[0][:-1]

    gen = Generator(model, capacity=320, max_seqs=4, eos=[], spill_bytes=1 << 28, spill_prefixes=True)
    assert gen.runner.graphs_enabled
    first = history(gen)
    for _ in range(5):
        history(gen)
    assert gen.prefix.peek(first) < len(first)
    assert save_prefix(gen, first, tmp_path / "h.kv") == len(first)
    gen.cache.check_invariants()
    full = Generator(model, capacity=320, max_seqs=4, eos=[])
    for _ in range(4):
        history(full)
    assert full.cache.free_cells < len(first)
    assert load_prefix(full, tmp_path / "h.kv") == len(first)
    full.cache.check_invariants()
    nxt = first + [17, 18]
    ref = Generator(model, capacity=320, max_seqs=4, eos=[])
    want = ref.add(nxt, Sampling(max_new_tokens=6))
    ref.run()
    got = full.add(nxt, Sampling(max_new_tokens=6))
    full.run()
    assert got.cached_tokens == len(first) and got.outputs == want.outputs
