"""What the ranks of tests/test_tp_generate.py run: ``Generator(tp=True)`` over a TPCache on
every rank, serving a workload of arrivals, callbacks, an allocation failure on one rank, a
steady decode stretch, a rank lost, draws that differ; and the one-process references.
Every function a rank runs is module-level (spawn imports it)."""

from __future__ import annotations

import gc
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from cellcache import CacheConfig, HostCellCache, InvalidArgument, OutOfMemory, tp
from tests.helpers import assert_same, state
from tests.helpers_tp import LOST_AT_STEP, lose, outcome_of, short_group, timed_outcome_of, trace
from tests.helpers_tp_cache import RankAllocator

GEN_MODEL, GEN_SEED = "tiny", 7
GEN_PROMPT_LENS = (11, 5, 17, 8, 13, 6, 20, 9)
GEN_ARRIVALS = {0: [0, 1, 2], 2: [3], 5: [4, 5], 9: [6]}      # step -> prompts added before it
GEN_FOLLOW_UP = 7             # the prompt request 0's third token adds (from its callback)
OOM_AFTER_STEP = 2            # rank 1's allocator fails from here to its next allocation


def gen_prompts() -> list[list[int]]:
    rng = np.random.default_rng(GEN_SEED)
    return [rng.integers(0, 512, size=n).tolist() for n in GEN_PROMPT_LENS]


def gen_sampling(i: int) -> Any:
    from cellcache.generate import Sampling

    if i == 1:                                    # n > 1, sampled: rank 0 draws for everyone
        return Sampling(max_new_tokens=10, n=2, temperature=0.9, top_k=40, seed=5)
    return Sampling(max_new_tokens=12 if i % 2 else 9)


def recorded(gen: Any) -> list:
    """Every request ``gen`` is given from now on, added (rank 0) or mirrored (the other
    ranks): a generator keeps only the unfinished ones."""
    seen: list = []
    add, mirror = gen.add, gen.mirror

    def adding(*args: Any, **kwargs: Any) -> Any:
        seen.append(add(*args, **kwargs))
        return seen[-1]

    def mirroring(*args: Any) -> Any:
        s = mirror(*args)
        seen.append(s.req)
        return s

    gen.add, gen.mirror = adding, mirroring
    return seen


def serve_workload(gen: Any, rank: int, alloc: Any = None, fails: bool = False) -> dict:
    """Arrivals over steps (added on rank 0 only), a follow-up added and a cancel made from
    callbacks, a callback that raises, an allocation failure (``alloc`` fails from step
    OOM_AFTER_STEP on where ``fails``: on rank 1); every rank steps in lockstep and handles
    the same exceptions. The same calls on one process, whose allocator fails at the same
    step (a failed step is rolled back with the one in flight: the steps after it follow
    from that), are the reference."""
    from cellcache.errors import InvalidState

    prompts = gen_prompts()
    reqs: dict[int, Any] = {}
    raised: list[str] = []
    added = recorded(gen)

    def on_token(req: Any, k: int, tok: int) -> None:
        n_out = len(req.outputs[k])
        if req.id == 0 and n_out == 3:
            reqs[GEN_FOLLOW_UP] = gen.add(prompts[GEN_FOLLOW_UP], gen_sampling(GEN_FOLLOW_UP))
        if req.id == 2 and n_out == 4:
            gen.cancel(req)
        if req.id == 3 and n_out == 2:
            raise ValueError("injected: a client's callback failed")

    step = 0
    flights = 0                                   # steps left in flight (async_steps)
    reqs_at: set[int] = set()
    last = max(GEN_ARRIVALS)
    while step < 500:
        if rank == 0:
            for i in GEN_ARRIVALS.get(step, []) if step not in reqs_at else []:
                reqs[i] = gen.add(prompts[i], gen_sampling(i), on_token=on_token)
            reqs_at.add(step)                     # once, even when the step is retried
        if alloc is not None and step == OOM_AFTER_STEP and not raised:
            alloc.fail = fails
        try:
            busy = gen.step()
        except OutOfMemory as e:                  # agreed: every rank rolled its step back
            raised.append(f"OutOfMemory: {e}")
            if alloc is not None:
                alloc.fail = False
            continue
        except (ValueError, InvalidState) as e:   # rank 0: the callback's error; else InvalidState
            raised.append(f"{type(e).__name__}: {e}")
            busy = True
        step += 1
        flights += gen.in_flight
        if not busy and step > last:
            break
    cache = gen.cache
    cache.check_invariants()
    return {"outputs": [r.outputs for r in added],
            "reasons": [r.finish_reasons for r in added],
            "errors": [None if r.error is None else type(r.error).__name__ for r in added],
            "stats": dict(gen.stats), "raised": raised, "steps": step, "flights": flights}


def gen_model() -> Any:
    from cellcache.generate import random_model

    return random_model(GEN_MODEL, seed=GEN_SEED)


def gen_cache_config(model: Any) -> CacheConfig:
    from cellcache import hf as cchf

    return cchf.cache_config(model, capacity=72, max_write=16, max_seqs=24, initial_capacity=8)


GEN_OPTIONS = dict(max_batch_tokens=16, prefill_chunk=8, eos=[], reserve=0.0)


def generator_on_rank(rank: int, world: int, async_steps: bool = False, debug: bool = True) -> dict:
    """``Generator(tp=2)`` over a TPCache (``debug``: digests every step) with rank 1's
    allocator made to fail."""
    from cellcache.generate import Generator, Sampling

    model = gen_model()
    alloc = RankAllocator()
    shard = tp.shard_config(gen_cache_config(model), rank, world)
    cache = tp.TPCache(HostCellCache(shard, growth="copy", allocator=alloc), debug=debug)
    gen = Generator(model, cache, tp=True, async_steps=async_steps,  # type: ignore[arg-type]
                    **GEN_OPTIONS)
    refused = {}
    if rank == 1:                                 # the other ranks follow rank 0
        refused["add"] = outcome_of(lambda: gen.add([1, 2, 3]))
    else:
        refused["draft"] = outcome_of(lambda: gen.add([1, 2], Sampling(), draft=lambda t, k: []))
    out = serve_workload(gen, rank, alloc, fails=rank == 1)
    out["refused"] = refused
    out["tp"] = (gen.tp.rank, gen.tp.world) if gen.tp is not None else None
    out["kv_heads"] = [layer.n_kv_heads for layer in gen.cache.config.layers]
    return out


def generator_single(async_steps: bool = False) -> dict:
    """The reference: the same workload in one process, on the whole cache, its allocator
    failing where rank 1's does."""
    from cellcache.generate import Generator

    model = gen_model()
    alloc = RankAllocator()
    cache = HostCellCache(gen_cache_config(model), growth="copy", allocator=alloc)
    gen = Generator(model, cache, async_steps=async_steps, **GEN_OPTIONS)  # type: ignore[arg-type]
    return serve_workload(gen, 0, alloc, fails=True)


class CollectiveCounter:
    """Counts the torch.distributed calls made on ``group`` (patched in this process)."""

    NAMES = ("all_reduce", "broadcast", "all_gather_object", "broadcast_object_list", "all_gather",
             "barrier")

    def __init__(self, group: Any):
        self.group, self.calls = group, 0
        self.saved = {name: getattr(dist, name) for name in self.NAMES}
        for name, fn in self.saved.items():
            setattr(dist, name, self._counted(fn))

    def restore(self) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)

    def _counted(self, fn: Any) -> Any:
        def counted(*args: Any, **kw: Any) -> Any:
            if kw.get("group") is self.group:
                self.calls += 1
            return fn(*args, **kw)
        return counted


def steady_decode_on_rank(rank: int, world: int) -> dict:
    """The agreement's collectives in each step of a decode-only stretch, synchronous and
    asynchronous, without and with streams (an ``on_token`` callback on every request):
    ``(collectives, rows grew, decode, step in flight)`` per step, and the outputs."""
    from cellcache.generate import Generator, Sampling

    out: dict = {}
    prompts = gen_prompts()[:4]
    streamed: list[tuple[int, int]] = []
    for async_steps, streams in ((False, False), (True, False), (False, True), (True, True)):
        from cellcache import hf as cchf

        model = gen_model()                       # pools from 8 rows: they grow while decoding
        cache = tp.build("host", "batched", cchf.cache_config(model, capacity=256, max_write=16,
                                                              max_seqs=8, initial_capacity=8))
        gen = Generator(model, cache, tp=True, eos=[], prefix_cache=False,  # type: ignore[arg-type]
                        async_steps=async_steps)
        counter = CollectiveCounter(gen.cache.agreement_group)
        added = recorded(gen)
        if rank == 0:
            for p in prompts:
                gen.add(p, Sampling(max_new_tokens=24),
                        on_token=(lambda req, k, tok: streamed.append((req.id, tok))) if streams else None)
        records = []
        busy = True
        while busy:
            calls, rows = counter.calls, gen.cache.rows
            decode = not gen.waiting and all(len(s.tokens) - s.in_cache == 1 for s in gen.running)
            busy = gen.step()
            records.append((counter.calls - calls, gen.cache.rows > rows, decode,
                            gen.in_flight, gen.busy))
        out[async_steps, streams] = {"records": records, "outputs": [r.outputs for r in added],
                                     "skipped": gen.tp.skipped, "exchanges": gen.tp.exchanges}
        counter.restore()
    out["streamed"] = len(streamed)
    return out


def lost_generator_on_rank(rank: int, world: int, how: str, where: str) -> dict:
    """Generator(tp=True) over a TPCache of LOST_TIMEOUT; rank 1 stops or dies (``how``) at
    step LOST_AT_STEP: before it (rank 0 waits in the step's start hand-over) or inside its
    forward (``where="forward"``: rank 0 waits in the model's collectives). Rank 0 reports
    what the step raised, ``gen.cache.peer_error`` of it, its requests and cache before and
    after, and the next step's outcome."""
    from cellcache.generate import Generator, Sampling

    model = gen_model()
    cache = tp.build("host", "batched", gen_cache_config(model), group=short_group())
    gen = Generator(model, cache, tp=True, async_steps=False, **GEN_OPTIONS)  # type: ignore[arg-type]
    if rank == 0:
        for p in gen_prompts()[:3]:
            gen.add(p, Sampling(max_new_tokens=10))
    for _ in range(LOST_AT_STEP):
        assert gen.step()
    local = gen.cache.local

    def seen() -> tuple:
        return ([[list(o) for o in r.outputs] for r in gen.requests], local.live_seqs(),
                [local.pos(s) for s in local.live_seqs()])

    before, before_state = seen(), state(local)
    if rank == 1:
        if where == "forward":
            def lost_inside(*args: Any, **kw: Any) -> Any:
                lose(rank, how)

            gen.model.model.layers[1].mlp.forward = lost_inside   # after layer 1's attention
        else:
            lose(rank, how)
    t0 = time.monotonic()
    try:
        gen.step()
        raised: BaseException | None = None
    except Exception as e:  # noqa: BLE001 - the test reads it
        raised = e
    seconds = time.monotonic() - t0
    trace(f"step raised {raised!r}")
    assert raised is not None
    translated = gen.cache.peer_error(raised)
    out = {"raised": (type(raised).__name__, str(raised), seconds),
           "peer_error": None if translated is None else (type(translated).__name__, str(translated)),
           "same": seen() == before, "lost": gen.cache.lost}
    if where != "forward":                     # nothing ran: the whole cache as it was
        assert_same(before_state, state(local))
    gen.cache.check_invariants()
    out["later"] = timed_outcome_of(gen.step)
    out["same_later"] = seen() == before
    gen.cache.close()
    return out


def diverged_draws_on_rank(rank: int, world: int) -> dict:
    """Rank 1's sampler draws another id once (its 4th launch): every rank must raise
    InvalidState naming the step, then refuse every later step. Synchronous, asynchronous,
    and asynchronous with debug digests."""
    from cellcache.generate import Generator, Sampling
    from cellcache.generate.sampler import Draw, SamplerOutput

    out: dict = {}
    prompts = gen_prompts()[:3]
    for key, (async_steps, debug) in {"sync": (False, False), "async": (True, False),
                                      "async_debug": (True, True)}.items():
        model = gen_model()
        cache = tp.build("host", "batched", gen_cache_config(model), debug=debug)
        gen = Generator(model, cache, tp=True, async_steps=async_steps, **GEN_OPTIONS)  # type: ignore[arg-type]
        sampler = gen.sampler
        launch, launched = sampler.launch, [0]

        def other_id(logits: Any, spec: Any, greedy: Any = None, launch: Any = launch,
                     launched: list = launched) -> Any:
            draw = launch(logits, spec, greedy)
            launched[0] += 1
            if launched[0] != 4 or rank != 1:
                return draw
            got = draw.result()
            ids = got.ids.copy()
            ids[0] = (ids[0] + 1) % 512
            return Draw(SamplerOutput(ids, got.accepted, torch.from_numpy(ids)))

        sampler.launch = other_id
        if rank == 0:
            for p in prompts:
                gen.add(p, Sampling(max_new_tokens=10))
        first = None
        for call in range(40):
            try:
                if not gen.step():
                    break
            except Exception as e:  # noqa: BLE001 - compared across ranks
                first = (call, type(e).__name__, str(e))
                break
        later = outcome_of(gen.step)
        out[key] = {"first": first, "later": later, "diverged": gen.cache.diverged,
                    "launched": launched[0]}
    return out


def generator_freed_on_rank(rank: int, world: int) -> dict:
    """Whether a Generator(tp=True) and its runner (which holds the CUDA graphs) are gone as
    soon as the last reference goes, without a garbage collection: NCCL will not destroy a
    communicator while a graph that captured one of its kernels lives, so a generator kept
    by a reference cycle made destroy_process_group() wait forever."""
    import weakref

    from cellcache.generate import Generator

    gc.disable()
    try:
        gen = Generator(gen_model(), tp=True, capacity=64, eos=[])
        if rank == 0:
            gen.add([1, 2, 3])
        gen.run()
        refs = weakref.ref(gen), weakref.ref(gen.runner)
        del gen
        return {"alive": [r() is not None for r in refs]}
    finally:
        gc.enable()


def mismatched_handovers_on_rank(rank: int, world: int) -> dict:
    """Rank 0 at a step's start hand-over while rank 1 is at an end's: both raise InvalidState
    (never pair them), and refuse from then on."""
    from cellcache.generate import Generator

    gen = Generator(gen_model(), tp=True, capacity=64, eos=[])
    first = outcome_of(lambda: gen.tp.handover([], end=rank == 1))
    return {"first": first, "later": outcome_of(gen.step), "diverged": gen.cache.diverged}


def refused_generator(rank: int, world: int) -> dict:
    """Rank function: a Generator(tp=True) refused for a bad argument must leave the model
    as it was (unsharded: sharding is for good)."""
    from cellcache.generate import Generator
    from cellcache.generate.distributed import is_sharded

    model = gen_model()
    raised = None
    for bad in (dict(admission="bogus"), dict(async_steps="yes"), dict(max_seqs=0)):
        try:
            Generator(model, tp=True, capacity=64, eos=[], **bad)
        except InvalidArgument as e:
            raised = (raised or []) + [str(e)]
    return {"raised": raised, "sharded": is_sharded(model),
            "attention": model.config._attn_implementation}
