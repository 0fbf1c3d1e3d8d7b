"""What the ranks of tests/gpu/test_tp_gpu.py run on two GPUs over NCCL (and, as a dry run over
gloo on the CPU, tests/test_tp_generate.py): ``Generator(tp=True)`` serving greedy
requests step by step with a trace, one GPU's reference with Hugging Face's teacher-forced
argmax, and a probe of what a large model's decode-step collectives cost on the pair."""

from __future__ import annotations

import datetime
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

# run_cli, run_ranks: tests/gpu/test_tp_gpu.py reads every helper through this module
from tests.helpers_tp import COLLECTIVE_TIMEOUT, run_cli, run_ranks, trace  # noqa: F401
from tests.helpers_tp_generate import recorded

GPU_ARCHS = ("tiny", "llama-tiny")


def gpu_prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(0, 512, size=int(rng.integers(2, 45))).tolist() for _ in range(7)]


def gpu_greedy(gen: Any, rank: int, n_new: int) -> list:
    """Prompts arriving over three steps (added on rank 0), greedy, stop tokens off. Each
    step is traced (:func:`trace`): a run that hangs shows the step and what it replayed."""
    from cellcache.generate import Sampling

    prompts = gpu_prompts()
    sampling = Sampling(max_new_tokens=n_new)
    added = recorded(gen)
    runner = gen.runner

    def step() -> bool:
        n, replays = gen.stats["steps"], runner.replays
        graphs = (len(runner.graphs), len(runner.mixed_graphs))
        trace(f"step {n}: {len(gen.waiting)} waiting, {len(gen.running)} running, "
              f"in flight {gen.in_flight}")
        busy = gen.step()
        trace(f"step {n} done: replays +{runner.replays - replays}, graphs (decode, mixed) "
              f"{graphs} -> {(len(runner.graphs), len(runner.mixed_graphs))}, busy {busy}")
        return busy

    if rank == 0:
        for p in prompts[:4]:
            gen.add(p, sampling)
    for _ in range(3):
        step()
    if rank == 0:
        for p in prompts[4:]:
            gen.add(p, sampling)
    while step():
        pass
    if runner.cuda:
        torch.cuda.synchronize(runner.device)
    return [r.outputs for r in added]


def gpu_placement(gen: Any) -> dict:
    """Where a rank's parts live: the model's, the cache's and torch's current device (all
    the rank's own GPU, or two ranks share one and NCCL deadlocks or refuses)."""
    placement = {"model": str(gen.model.device), "runner": str(gen.runner.device),
                 "cache": str(getattr(gen.cache.config, "device", None))}
    if torch.cuda.is_available():
        placement["current"] = f"cuda:{torch.cuda.current_device()}"
    return placement


def gpu_tp_on_rank(rank: int, world: int, arch: str, n_new: int, device_type: str = "cuda") -> dict:
    """TP=2 on GPU ``rank`` (graphs on by default), traced step by step; the test compares
    its outputs with one GPU's and HF's (:func:`gpu_reference`, in the test's process once the
    ranks are gone: a rank waiting at a collective while the other served alone timed out).
    (``device_type="cpu"`` over gloo: a dry run of the same code, without graphs.)"""
    from cellcache.generate import Generator, random_model

    device = f"cuda:{rank}" if device_type == "cuda" else "cpu"
    model = random_model(arch, torch.float32, device, seed=3)
    trace(f"model built on {device}")
    gen = Generator(model, tp=True, **GPU_OPTIONS)
    placement = gpu_placement(gen)
    trace(f"generator built: sharded, placement {placement}, graphs {gen.runner.graphs_enabled}, "
          f"async {gen.async_steps}")
    out: dict = {"tp2": gpu_greedy(gen, rank, n_new), "graph_steps": gen.stats["graph_steps"],
                 "graphs": gen.runner.graphs_enabled, "preempted": gen.stats["preempted"],
                 "async": gen.async_steps, "diverged": gen.cache.diverged,
                 "kv_heads": [layer.n_kv_heads for layer in gen.cache.config.layers],
                 "placement": placement, "exchanges": gen.tp.exchanges, "skipped": gen.tp.skipped}
    trace(f"served: {gen.stats['steps']} steps, {gen.stats['graph_steps']} replayed")
    gen.cache.check_invariants()
    gen.cache.close()
    return out


GPU_OPTIONS = dict(capacity=160, max_batch_tokens=32, max_seqs=32, prefill_chunk=9, eos=[], reserve=0.0)


def gpu_agreement_on_rank(rank: int, world: int, arch: str, n_new: int, device_type: str = "cuda") -> dict:
    """TP=2 in the served precision (bf16 on the GPU; ``device_type="cpu"``: float32 over
    gloo, a dry run), checked end to end: rank 0 copies the whole model for the reference
    (float32) and the noise floor (bf16) before the Generator shards it, records the logits
    every row of its requests was sampled from, and compares them with HF's forward
    (:mod:`cellcache.generate.agreement`). Returns the report (rank 0) and what the ranks
    served with."""
    from cellcache.generate import Generator, random_model
    from cellcache.generate.agreement import LogitsTap, compare, reference_models

    cuda = device_type == "cuda"
    device = f"cuda:{rank}" if cuda else "cpu"
    model = random_model(arch, torch.bfloat16 if cuda else torch.float32, device, seed=5)
    models = reference_models(model) if rank == 0 else None
    gen = Generator(model, tp=True, **GPU_OPTIONS)
    trace(f"generator built: graphs {gen.runner.graphs_enabled}, async {gen.async_steps}")
    out: dict = {"graphs": gen.runner.graphs_enabled, "async": gen.async_steps,
                 "kv_heads": [layer.n_kv_heads for layer in gen.cache.config.layers]}
    if rank == 0:
        assert models is not None
        with LogitsTap(gen) as tap:
            out["outputs"] = gpu_greedy(gen, rank, n_new)
        out["agreement"] = compare(tap.rows(), *models).as_dict()
    else:
        gpu_greedy(gen, rank, n_new)
    out["graph_steps"], out["preempted"] = gen.stats["graph_steps"], gen.stats["preempted"]
    trace(f"served: {gen.stats['steps']} steps, {gen.stats['graph_steps']} replayed")
    gen.cache.close()
    return out


def gpu_reference(arch: str, n_new: int, device: str) -> dict:
    """One GPU (TP=1) on the same requests, and HF's teacher-forced argmax of every output."""
    from cellcache.generate import Generator, random_model

    model = random_model(arch, torch.float32, device, seed=3)
    one = Generator(model, **GPU_OPTIONS)
    out: dict = {"tp1": gpu_greedy(one, 0, n_new), "tp1_graph_steps": one.stats["graph_steps"]}
    one.cache.close()
    model.set_attn_implementation("sdpa")                  # HF's own attention again
    forced = []
    with torch.inference_mode():
        for p, outputs in zip(gpu_prompts(), out["tp1"]):
            logits = model(torch.tensor([p + outputs[0]], device=device)).logits[0]
            forced.append(logits[len(p) - 1:-1].argmax(-1).tolist())
    out["hf"] = forced
    return out


def comm_probe_on_rank(rank: int, world: int, rows: int = 256, hidden: int = 3584,
                       vocab: int = 152064, layers: int = 28) -> dict:
    """What the collectives of one TP decode step of a Qwen2-7B-sized model cost on this
    pair, apart from the model: the ``2 * layers + 1`` all-reduces of ``[rows, hidden]`` bf16
    (attention and MLP outputs, the embedding) and the all-gather of the head's
    ``[rows, vocab / world]`` logits, eagerly and replayed from a CUDA graph (ms per step);
    one all-reduce alone (us); the gloo all-reduce of 15 int64s the hand-overs run (us);
    whether the GPUs reach each other's memory (P2P)."""
    dev = torch.device("cuda", rank)
    out: dict = {"peer": torch.cuda.can_device_access_peer(rank, (rank + 1) % world)}
    x = torch.ones(rows, hidden, dtype=torch.bfloat16, device=dev)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    out["sum_ok"] = bool((x == world).all())
    trace(f"first all-reduce: sum ok {out['sum_ok']}, peer access {out['peer']}")
    part = torch.ones(rows, vocab // world, dtype=torch.bfloat16, device=dev)
    gathered = torch.empty(rows * world, vocab // world, dtype=torch.bfloat16, device=dev)

    def step_comms() -> None:
        for _ in range(2 * layers + 1):
            dist.all_reduce(x)
        dist.all_gather_into_tensor(gathered, part)

    def timed(fn: Any, n: int = 10) -> float:
        fn()
        torch.cuda.synchronize()
        dist.barrier(device_ids=[rank])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n

    out["eager_ms"] = timed(step_comms)
    out["all_reduce_us"] = 1e3 * timed(lambda: dist.all_reduce(x), 100)
    out["all_gather_ms"] = timed(lambda: dist.all_gather_into_tensor(gathered, part))
    trace(f"eager: {out['eager_ms']:.3f} ms a step")
    side = torch.cuda.Stream(device=dev)                  # warm-up on a side stream, as captures do
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        step_comms()
    torch.cuda.current_stream(dev).wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    trace("capturing")
    with torch.cuda.graph(graph):
        step_comms()
    trace("captured")
    out["graph_ms"] = timed(graph.replay)
    trace(f"graph: {out['graph_ms']:.3f} ms a step")
    del graph
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    flags = torch.zeros(15, dtype=torch.int64)
    for _ in range(50):
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    t0 = time.perf_counter()
    for _ in range(500):
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    out["gloo_us"] = 1e6 * (time.perf_counter() - t0) / 500
    dist.barrier(group=group)
    return out


def nccl_transport(tmp_path: Path) -> list[str]:
    """The lines of the ranks' NCCL logs that name the transport between the GPUs."""
    lines: list[str] = []
    for path in sorted(tmp_path.glob("nccl*.txt")):
        lines += [line.strip() for line in path.read_text().splitlines()
                  if (" via " in line or "P2P" in line) and "NVLS" not in line][:6]
    return lines
