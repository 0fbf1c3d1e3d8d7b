"""Sleep and wake on the device: the pools' memory goes back to the driver and returns at the
same addresses, so a graph captured before the sleep replays after the wake with the same
result; a Generator with graphs gives the same tokens after either level, replaying the
graphs it captured before (level 1) or captured again (level 2, the weights moved)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import cellcache as cc  # noqa: E402

from ..helpers import cuda  # noqa: E402

MiB = 1 << 20


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_pool_memory_goes_back_and_a_graph_captured_before_sleep_replays_after_wake():
    CudaCellCache, *_ = cuda()
    from cellcache.torch import as_tensor

    layers = [cc.LayerConfig(8, 128) for _ in range(8)]          # 4 KiB a row a pool (bf16: 2)
    cfg = cc.CacheConfig(capacity=1 << 16, layers=layers, max_write=4096, dtype="bfloat16",
                         initial_capacity=1 << 16, paged=True, mask_format="none")
    cache = CudaCellCache(cfg)
    a = cache.seq_new()
    assert cache.declare_step([a] * 4096)
    cache.prepare_step()
    cache.commit_step()
    mapped = cache.metrics()["mapped_bytes"]
    assert mapped >= 16 * (1 << 16) * 2048                       # every row of 16 pools
    k = as_tensor(cache.layer(3).k)
    ptr = k.data_ptr()
    src = torch.randn(4096, 8, 128, device="cuda").to(torch.bfloat16)
    out = torch.zeros(8, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):                     # writes the pool, reads it back
        k[:4096].copy_(src)
        out.copy_(k[:4096].float().sum(dim=(0, 2)))
    g.replay()
    expect = out.clone()
    cache.seq_rm(a)
    before = free_bytes()
    cache.sleep()
    given = free_bytes() - before
    assert cache.metrics()["mapped_bytes"] == 0
    assert given >= 0.99 * mapped, (given, mapped)
    with pytest.raises(cc.InvalidState, match="asleep"):
        cache.declare_step([cache.seq_new()])
    assert cache.layer(3).k.copy_to_host().shape[0] == 0        # nothing read from unmapped memory
    cache.wake()
    assert cache.metrics()["mapped_bytes"] == mapped and free_bytes() <= before + 64 * MiB
    assert as_tensor(cache.layer(3).k).data_ptr() == ptr
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expect)
    b = cache.seq_new()                                          # steps go on
    assert cache.declare_step([b] * 16)
    step = cache.prepare_step()
    cache.commit_step()
    assert not step.grew and list(step.cells) == list(range(16))
    del g
    cache.close()


def test_copy_pools_are_released_and_allocated_elsewhere_at_the_next_step():
    CudaCellCache, *_ = cuda()
    cfg = cc.CacheConfig(capacity=1 << 12, layers=[cc.LayerConfig(4, 64)], max_write=256,
                         dtype="float32")
    cache = CudaCellCache(cfg, growth="copy")
    a = cache.seq_new()
    assert cache.declare_step([a] * 256)
    cache.prepare_step()
    cache.commit_step()
    cache.seq_rm(a)
    generation = cache.pools_generation
    cache.sleep()
    assert cache.rows == 0 and cache.pools_generation == generation + 1
    cache.wake()                                 # (the memory comes with the next step)
    assert cache.rows == 0 and cache.pools_generation == generation + 1
    assert cache.declare_step([cache.seq_new()] * 1)
    assert cache.prepare_step().grew
    cache.commit_step()
    assert cache.rows > 0 and cache.pools_generation == generation + 2
    cache.close()


@pytest.mark.parametrize("level, native", [(1, False), (2, False), (2, True)])
def test_a_generator_with_graphs_gives_the_same_tokens_after_sleep_and_wake(level, native):
    """(``native``: the native forward, whose fused weights the modules' parameters are
    views of: they go to the host and back as one storage, still shared.)"""
    from cellcache.generate import Generator, Sampling, random_model

    model = random_model("llama-tiny", torch.bfloat16, "cuda", seed=5)
    gen = Generator(model, capacity=1 << 14, max_seqs=16, eos=[], native=native)
    assert gen.runner.graphs_enabled and gen.async_steps
    gen.warmup()                        # decode and mixed graphs, the mixed ones in one pool
    prompts = [[3 + i, 40, 7 * i % 500, 9] for i in range(12)]

    def serve():
        reqs = [gen.add(p, Sampling(max_new_tokens=24, temperature=0.8 if i % 2 else 0.0, seed=i))
                for i, p in enumerate(prompts)]
        gen.run()
        return [r.outputs for r in reqs]

    first = serve()
    graphs = gen.runner.graphs
    assert graphs and gen.runner.mixed_graphs
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    allocated = torch.cuda.memory_allocated()
    before = free_bytes()
    gen.sleep(level)
    assert gen.cache.metrics()["mapped_bytes"] == 0 and free_bytes() > before
    if level == 2:
        assert all(p.device.type == "cpu" and p.is_pinned() for p in model.parameters())
        assert torch.cuda.memory_allocated() <= allocated - weights
        assert not gen.runner.graphs
    gen.wake()
    assert all(p.device.type == "cuda" for p in model.parameters())
    if native:                          # the modules' weights are the native forward's again
        gen.runner.model.check()
    steps = gen.stats["graph_steps"]
    assert serve() == first
    assert gen.stats["graph_steps"] > steps
    if level == 1:           # the same graph objects replayed: nothing captured again
        assert {b: g[0] for b, g in gen.runner.graphs.items()} == {b: g[0] for b, g in graphs.items()}
