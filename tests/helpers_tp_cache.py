"""What the ranks of tests/test_tp.py run: a TPCache over a shard of a host cache, walked at
random, made to refuse or fail on one rank, losing a rank, and a model sharded by
transformers' own plan. Every function a rank runs is module-level (spawn imports it);
tests/helpers_tp.py runs them (:func:`tests.helpers_tp.run_ranks`)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from cellcache import CacheConfig, HostCellCache, InvalidArgument, LayerConfig, OutOfMemory, StepTooLarge, tp
from cellcache.buffers import step_buffers
from tests.helpers import FailingAllocator, assert_same, state
from tests.helpers_tp import lose, outcome_of, short_group, timed_outcome_of, trace

# -- configurations ------------------------------------------------------------------------

def full_config(**kw: Any) -> CacheConfig:
    """Two layers (one windowed) with 2 and 4 KV heads: 1 and 2 per rank of two."""
    base: dict[str, Any] = dict(capacity=40, layers=[LayerConfig(2, 4), LayerConfig(4, 2, 5)],
                                max_write=8, max_seqs=6, initial_capacity=4, dtype="float32",
                                paged=True, max_kv=60)
    base.update(kw)
    return CacheConfig(**base)


def shard_cache(rank: int, world: int, debug: bool = False, cls: type = HostCellCache,
                **kw: Any) -> tp.TPCache:
    cfg = tp.shard_config(full_config(), rank, world)
    return tp.TPCache(cls(cfg, **kw), debug=debug)


# -- a random walk of verbs and steps --------------------------------------------------------

def step_record(cache: Any, step: Any) -> tuple:
    """What a step decided: the Step's host copies and the written step buffers."""
    pad = step.pad_to
    bufs = []
    for spec in step_buffers(cache.config):
        buf = np.asarray(cache.buffer(spec.name))
        if spec.role in ("cells", "positions"):
            bufs.append(buf[:pad].tolist())
        elif spec.role in ("read_len", "width"):
            bufs.append(buf.tolist())
        elif spec.role == "mask":
            bufs.append(buf.reshape(cache.config.max_write, -1)[:pad, :step.read_len].tolist())
        elif spec.role == "kv_indices":
            bufs.append(buf[:int(step.kv_indptr[-1])].tolist())
    return (step.width, step.pad_to, step.read_len, step.rows, step.grew, step.cells.tolist(),
            step.positions.tolist(), step.seq_ids.tolist(), step.qo_indptr.tolist(),
            step.kv_indptr.tolist(), bufs)


def walk(cache: Any, seed: int, n_ops: int) -> list:
    """A random walk of verbs and steps on ``cache`` (a TPCache or a plain cache: the same
    calls); each choice reads the cache's state, so caches that agree make the same walk.
    Returns one record per call."""
    rng = random.Random(seed)
    out: list = []
    for _ in range(n_ops):
        live = cache.live_seqs()
        op = rng.choice(["new", "new", "clone", "rm", "rewind", "step", "step", "step", "step"])
        if op == "new" or not live:
            out.append(("new", cache.seq_new()))
        elif op == "clone":
            src = rng.choice(live)
            upto = rng.choice([None, rng.randint(0, cache.pos(src))])
            out.append(("clone", src, upto, cache.seq_clone(src, upto)))
        elif op == "rm":
            seq = rng.choice(live)
            out.append(("rm", seq, cache.seq_rm(seq)))
        elif op == "rewind":
            seq = rng.choice(live)
            position = rng.randint(0, cache.pos(seq) + 1)      # pos + 1 is refused
            out.append(("rewind", seq, position, cache.rewind(seq, position)))
        else:
            width = rng.randint(1, cache.config.max_write)
            ids = [rng.choice(live) for _ in range(width)]
            try:
                ok = cache.declare_step(ids)
            except StepTooLarge:
                out.append(("declare", ids, "StepTooLarge"))
                continue
            if not ok:
                out.append(("declare", ids, False))
                cache.seq_rm(rng.choice(live))
                continue
            step = cache.prepare_step(pad_to=rng.randint(width, cache.config.max_write))
            out.append(("step", ids, step_record(cache, step)))
            cache.commit_step()
        out.append(("state", cache.used_end, cache.free_cells, cache.live_seqs(),
                    [cache.pos(s) for s in range(cache.max_seqs)]))
    return out


def walk_on_rank(rank: int, world: int, seed: int, n_ops: int, debug: bool,
                 deferred: bool = False) -> dict:
    cache = shard_cache(rank, world, debug=debug, growth="copy")
    if deferred:
        cache.defer()
    records = walk(cache, seed, n_ops)
    rounds = cache.rounds                      # the agreement's collectives during the walk
    cache.exchange()                           # settles the deferred outcomes: they agree
    cache.check_invariants()
    return {"records": records, "heads": [layer.n_kv_heads for layer in cache.config.layers],
            "pool_shape": list(cache.buffer("layer_1_k").shape), "rounds": rounds}


# -- refusals ------------------------------------------------------------------------------

class RankAllocator(FailingAllocator):
    """Host pool storage that fails every allocation while ``fail`` is set."""

    fail = False

    def allocate(self, nbytes: int, what: str) -> Any:
        if self.fail:
            raise OutOfMemory(f"injected: no memory for {what} ({nbytes} bytes)")
        return super().allocate(nbytes, what)


class FaultyHostCache(HostCellCache):
    """A host cache whose declare_step or buffer writes can be made to fail: the faults a
    test injects on one rank only (the tables themselves always agree)."""

    declare_fault: BaseException | None = None   # raised by declare_step (nothing declared)
    refuse = False                               # declare_step returns False
    write_fault: BaseException | None = None     # raised while the step buffers are written

    def declare_step(self, seq_ids: Any) -> bool:
        if self.declare_fault is not None or self.refuse:
            self.undeclare()
            if self.declare_fault is not None:
                raise self.declare_fault
            return False
        return super().declare_step(seq_ids)

    def _write_step(self, width: int, pad_to: int, read_len: int, stream: int) -> tuple:
        if self.write_fault is not None:
            raise self.write_fault
        return super()._write_step(width, pad_to, read_len, stream)


def oom_on_one_rank(rank: int, world: int, deferred: bool = False) -> dict:
    alloc = RankAllocator()
    cache = shard_cache(rank, world, growth="copy", allocator=alloc)
    if deferred:
        cache.defer()
    local = cache.local
    a = cache.seq_new()
    assert cache.declare_step([a] * 4) is True
    cache.prepare_step()                                  # 4 rows: the first allocation
    cache.commit_step()
    assert cache.declare_step([a] * 3) is True            # needs 7 rows: a growth
    before, calls, live = state(local), alloc.calls, alloc.live
    alloc.fail = rank == 1
    outcome = outcome_of(cache.prepare_step)
    assert_same(before, state(local))                    # nothing changed, even the declaration
    assert local.table.declared == [a] * 3
    planned = alloc.calls - calls                         # rank 0 planned, then gave it back
    assert alloc.live == live
    alloc.fail = False
    step = cache.prepare_step()                           # the same call, retried
    cache.commit_step()
    return {"outcome": outcome, "planned": planned, "step": step_record(local, step)}


def refusals_on_one_rank(rank: int, world: int) -> dict:
    """declare_step False, StepTooLarge and a foreign error on rank 1 only."""
    cache = shard_cache(rank, world, cls=FaultyHostCache)
    local = cache.local
    a, b = cache.seq_new(), cache.seq_new()
    assert cache.declare_step([a, a, b]) is True
    cache.prepare_step()
    cache.commit_step()
    out: dict = {}
    for name, fault in [("false", None),
                        ("too_large", StepTooLarge("injected: the step's kv lists do not fit")),
                        ("foreign", KeyError("injected"))]:
        assert cache.declare_step([a]) is True           # a declaration the refusal must drop
        before = state(local)
        if rank == 1:
            local.refuse = fault is None
            local.declare_fault = fault
        if fault is None:
            out[name] = ("returned", cache.declare_step([a, b]))
        else:
            out[name] = outcome_of(lambda: cache.declare_step([a, b]))
        after = state(local)
        assert after["table"]["declared"] is None
        before["table"]["declared"] = None                # what a refused declaration leaves
        assert_same(before, after)
        local.refuse, local.declare_fault = False, None
    assert cache.declare_step([a, b]) is True
    out["step"] = step_record(local, cache.prepare_step())
    cache.commit_step()
    # a real StepTooLarge: both ranks refuse by themselves (each run lists its sequence's
    # cells at [0, last]: a's 4 runs 12 + 13 + 14 + 15, b's 3 + 4 + 5 + 6; 72 > max_kv=60),
    # with the same message
    assert cache.declare_step([a] * 8) is True
    cache.prepare_step()
    cache.commit_step()
    before = state(local)
    out["real_too_large"] = outcome_of(lambda: cache.declare_step([a, b] * 4))
    assert_same(before, state(local))
    return out


def fault_after_agreement(rank: int, world: int) -> dict:
    """Rank 1 fails while writing the step buffers, after the ranks agreed to go on."""
    cache = shard_cache(rank, world, cls=FaultyHostCache)
    local = cache.local
    a = cache.seq_new()
    assert cache.declare_step([a] * 2) is True
    cache.prepare_step()
    cache.commit_step()
    assert cache.declare_step([a] * 2) is True            # no growth: rows stay 4
    before = state(local)
    if rank == 1:
        local.write_fault = MemoryError("injected")
    outcome = outcome_of(cache.prepare_step)
    after = state(local)
    # the placement is taken back on both ranks, the step declared again; the step buffers
    # keep what was written (stale values are allowed there)
    assert after["table"] == before["table"] and after["metrics"] == before["metrics"]
    assert after["rows"] == before["rows"] and local.prepared_step is None
    local.write_fault = None
    step = cache.prepare_step()
    cache.commit_step()
    return {"outcome": outcome, "step": step_record(local, step)}


def deferred_faults(rank: int, world: int) -> dict:
    """A deferred TPCache: what one rank alone sees between two rounds is settled by the next
    round (``exchange``): a fault after the step's agreement (rank 1 fails writing its step
    buffers) and a declaration that differs (rank 1 refuses)."""
    out: dict = {}
    # 1. a fault after the agreement: rank 1 raises at once, rank 0 goes on; the next round
    #    raises rank 1's error on both, and both refuse from then on
    cache = shard_cache(rank, world, cls=FaultyHostCache)
    cache.defer()
    local = cache.local
    a = cache.seq_new()
    assert cache.declare_step([a] * 2) is True
    cache.prepare_step()                                  # grows: the one round of these steps
    cache.commit_step()
    rounds = cache.rounds
    assert cache.declare_step([a] * 2) is True            # no growth: rows stay 4
    if rank == 1:
        local.write_fault = MemoryError("injected")
    out["prepare"] = outcome_of(lambda: (cache.prepare_step(), cache.commit_step()))
    out["rounds"] = cache.rounds - rounds                 # no collective in that step
    local.write_fault = None
    out["exchange"] = outcome_of(cache.exchange)
    out["diverged"] = cache.diverged
    out["after"] = outcome_of(lambda: cache.declare_step([a]))
    # 2. a declaration refused on rank 1 only: caught by the next round, on both ranks
    cache = shard_cache(rank, world, cls=FaultyHostCache)
    cache.defer()
    local = cache.local
    a = cache.seq_new()
    assert cache.declare_step([a] * 2) is True
    cache.prepare_step()
    cache.commit_step()
    local.refuse = rank == 1
    out["declared"] = cache.declare_step([a])
    local.refuse = False
    if out["declared"]:
        cache.prepare_step()
        cache.commit_step()
    out["refused"] = outcome_of(cache.exchange)
    out["refused_after"] = outcome_of(cache.exchange)
    return out


def divergence(rank: int, world: int) -> dict:
    """debug=True: an extra sequence op on rank 1 is caught, by a verb and by a step digest."""
    out: dict = {}
    # 1. rank 1 takes an id behind the wrapper's back: the next seq_new differs
    cache = shard_cache(rank, world, debug=True)
    cache.seq_new()
    if rank == 1:
        cache.local.seq_new()
    out["verb"] = outcome_of(cache.seq_new)
    out["after"] = outcome_of(lambda: cache.declare_step([0]))
    # 2. rank 1 moves a's tail to b: same used_end, free cells and live ids; the step differs
    cache = shard_cache(rank, world, debug=True)
    a, b = cache.seq_new(), cache.seq_new()
    for ids in ([a] * 4, [b] * 2):
        assert cache.declare_step(ids) is True
        cache.prepare_step()
        cache.commit_step()
    if rank == 1:
        local = cache.local
        assert local.rewind(a, 2)
        assert local.declare_step([b, b])
        local.prepare_step()
        local.commit_step()
    out["declare"] = cache.declare_step([a])              # passes: the summaries agree
    out["prepare"] = outcome_of(cache.prepare_step)
    out["diverged"] = cache.diverged
    return out


# -- a rank that stops or dies -------------------------------------------------------------

def lost_peer_on_rank(rank: int, world: int, how: str, where: str) -> dict:
    """The last rank stops or dies (``how``) where the others wait for it (``where``):
    ``declare`` (declare_step's agreement), ``grow`` (prepare_step's growth agreement,
    deferred) or ``exchange`` (a deferred round). The others report what they raised, how
    long it took, their cache before and after, and the next call's outcome."""
    lost = world - 1
    config = full_config(layers=[LayerConfig(world, 4), LayerConfig(world, 2, 5)])
    cache = tp.TPCache(HostCellCache(tp.shard_config(config, rank, world), growth="copy"),
                       short_group())
    if where != "declare":
        cache.defer()
    local = cache.local
    a = cache.seq_new()
    assert cache.declare_step([a] * 3) is True
    cache.prepare_step()                                  # 4 rows: agreed (growth)
    cache.commit_step()
    cache.exchange()
    if where == "grow":
        assert cache.declare_step([a] * 2) is True        # local (deferred); 5 rows: a growth
        call = cache.prepare_step
    elif where == "declare":
        call = lambda: cache.declare_step([a] * 2)        # noqa: E731
    else:
        assert cache.declare_step([a]) is True            # 4 rows: no growth, no collective
        cache.prepare_step()
        cache.commit_step()
        call = cache.exchange
    before = state(local)
    if rank == lost:
        lose(rank, how)
    outcome = timed_outcome_of(call)
    trace(f"raised {outcome}")
    after = state(local)
    assert_same(before, after)                            # nothing changed by the failure
    declared = local.table.declared
    later = timed_outcome_of(lambda: cache.declare_step([a]))       # refused at once
    assert_same(before, state(local))
    cache.check_invariants()
    cache.close()
    return {"outcome": outcome, "later": later, "lost": cache.lost, "declared": declared,
            "closed": cache.closed, "timeout": cache.timeout}


def agreement_timeouts(rank: int, world: int) -> dict:
    """The timeouts of a TPCache over the world and over a group of LOST_TIMEOUT, with the
    timeouts their agreement groups were made with (read from each group's gloo backend)."""
    from cellcache.tp.peers import group_timeout

    config = tp.shard_config(full_config(), rank, world)
    over_world = tp.TPCache(HostCellCache(config))
    over_short = tp.TPCache(HostCellCache(config), short_group())
    made_with = {name: group_timeout(cache.agreement_group).total_seconds()
                 for name, cache in (("world_agreement", over_world), ("short_agreement", over_short))}
    return {"world": over_world.timeout, "short": over_short.timeout, **made_with}


GLOO_TIMED_OUT = ("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                  "waiting 3000ms for recv operation to complete")
GLOO_CLOSED = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:34446. This is typically caused by a remote worker crashing. Check the "
               "logs of the remote worker before reporting an error.")


def peer_errors_on_rank(rank: int, world: int) -> dict:
    """TPCache.peer_error on what gloo raises when a peer is silent or gone, and on errors that
    are not a transport's (no collective after the caches are made)."""
    config = tp.shard_config(full_config(), rank, world)
    silent, gone, fine = (tp.TPCache(HostCellCache(config)) for _ in range(3))
    out: dict = {"timed_out": str(silent.peer_error(RuntimeError(GLOO_TIMED_OUT)))}
    out["refused"] = outcome_of(silent.seq_new)
    out["then_closed"] = str(silent.peer_error(RuntimeError(GLOO_CLOSED), "a step"))
    out["closed"] = str(gone.peer_error(RuntimeError(GLOO_CLOSED), "a step"))
    out["others"] = [fine.peer_error(e) for e in (
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 6x8)"),
        InvalidArgument("a library error"), ValueError("timed out"), KeyboardInterrupt())]

    def bug_in_a_collective() -> None:
        with fine.collective("a collective"):
            raise RuntimeError("Tensors must be CPU and dense")

    out["bug"] = outcome_of(bug_in_a_collective)
    out["lost"] = fine.lost
    return out


# -- a sharded model ------------------------------------------------------------------------

PROMPTS = ([5, 17, 301, 44, 9], [250, 3, 77])
DECODE_STEPS = 4


def greedy_logits(model: Any, cache: Any) -> list[np.ndarray]:
    """A prefill of both prompts in one step, then greedy decode steps (with a fork after
    the first); the logits of every step."""
    from cellcache import hf as cchf

    runner = cchf.attach(model, cache.local if isinstance(cache, tp.TPCache) else cache)
    seqs = [cache.seq_new() for _ in PROMPTS]
    ids = [s for s, p in zip(seqs, PROMPTS) for _ in p]
    assert cache.declare_step(ids) is True
    step = cache.prepare_step()
    logits = runner.forward(step, [t for p in PROMPTS for t in p],
                            logit_rows=[len(PROMPTS[0]) - 1, len(ids) - 1])
    cache.commit_step()
    out = [logits.numpy()]
    for i in range(DECODE_STEPS):
        tokens = logits.argmax(-1).tolist()
        if i == 1:
            seqs.append(cache.seq_clone(seqs[0]))
            tokens.append((tokens[0] + 1) % 512)
        assert cache.declare_step(seqs) is True
        step = cache.prepare_step(pad_to=4)
        logits = runner.forward(step, tokens, decode=True)
        cache.commit_step()
        out.append(logits.numpy())
    return out


def sharded_model_logits(rank: int, world: int) -> dict:
    from cellcache import hf as cchf
    from cellcache.generate import random_model

    model = tp.shard_model(random_model("llama-tiny", seed=4))
    cache = tp.build("host", "batched", cchf.cache_config(model, capacity=64, max_write=16,
                                                          max_seqs=4), debug=True)
    attn = model.model.layers[0].self_attn
    return {"logits": greedy_logits(model, cache),
            "kv_heads": [layer.n_kv_heads for layer in cache.config.layers],
            "pool": list(cache.layer(0).k.shape),
            "q_rows": attn.q_proj.weight.to_local().shape[0],
            "k_rows": attn.k_proj.weight.to_local().shape[0]}
