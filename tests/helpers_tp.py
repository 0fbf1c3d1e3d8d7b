"""Running a function on several ranks over gloo for tests/test_tp.py, and what the ranks run.

:func:`run_ranks` spawns ``world`` processes (``torch.multiprocessing``, spawn), joins them in a
gloo group through a file rendezvous in the test's tmp_path, runs ``fn(rank, world, *args)``
on each and returns the results by rank. A child's exception fails the test with the
child's traceback (torch's ``ProcessRaisedException`` carries it); a collective waits at
most ``COLLECTIVE_TIMEOUT`` seconds; a run past ``timeout`` kills the children and fails.
A rank is killed with the process that started it (even one that is stopped), so no rank
outlives its test. Every function here that a rank runs is a module-level function, so
spawn can import it.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import pickle
import random
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cellcache import CacheConfig, HostCellCache, InvalidArgument, LayerConfig, OutOfMemory, StepTooLarge, tp
from cellcache.buffers import step_buffers
from tests.helpers import FailingAllocator, assert_same, state

WORLD = 2
COLLECTIVE_TIMEOUT = 30      # seconds a collective may wait for the other rank
_TRACE: list = []            # a rank's trace file and start time (empty outside the ranks)


def trace(message: str) -> None:
    """A line in this rank's trace (``trace<rank>.txt``, flushed at once: a run that hangs or
    dies shows how far each rank got); nothing outside the ranks."""
    if _TRACE:
        f, t0 = _TRACE
        f.write(f"{time.monotonic() - t0:8.2f}s {message}\n")
        f.flush()


def _die_with_parent() -> None:
    """This process gets SIGKILL when the process that started it ends (Linux; a no-op
    elsewhere): a rank left stopped or waiting never outlives a test run that was killed."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)        # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:                             # the parent ended before that
        os._exit(1)


def _entry(rank: int, fn: Any, world: int, tmp: str, args: tuple, backend: str = "gloo",
           deadline: float = 0.0, lost: int = -1) -> None:
    _die_with_parent()
    # A rank that hangs dumps every thread's stack: on SIGUSR1 (run_ranks sends it at its
    # timeout, or when interrupted, before killing the ranks), on SIGTERM (torch's join ends
    # the others that way when one rank fails), on a fatal signal (an NCCL abort is SIGABRT),
    # and by itself at ``deadline`` seconds, after which it exits (so a rank never outlives
    # its test, even when the test process is interrupted and cannot signal it).
    stacks = open(os.path.join(tmp, f"stack{rank}.txt"), "w")  # noqa: SIM115 - the process's life
    faulthandler.enable(file=stacks, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    faulthandler.register(signal.SIGTERM, file=stacks, all_threads=True, chain=True)
    if deadline > 0:
        faulthandler.dump_traceback_later(deadline, exit=True, file=stacks)
    _TRACE[:] = [open(os.path.join(tmp, f"trace{rank}.txt"), "w"), time.monotonic()]  # noqa: SIM115
    torch.set_num_threads(1)
    timeout = COLLECTIVE_TIMEOUT
    if backend == "nccl":                            # tests/gpu: rank r on GPU r
        torch.cuda.set_device(rank)
        # NCCL's init lines (the transport between the GPUs: "via P2P/..." or "via SHM/...")
        # go to a file of the rank's, read back by the test
        os.environ.setdefault("NCCL_DEBUG", "INFO")
        os.environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT,GRAPH")
        os.environ.setdefault("NCCL_DEBUG_FILE", os.path.join(tmp, f"nccl{rank}.txt"))
        timeout = 2 * COLLECTIVE_TIMEOUT             # first kernels, first communicators
    trace(f"rank {rank} of {world}: {backend}, pid {os.getpid()}")
    dist.init_process_group(backend, init_method=f"file://{tmp}/rendezvous", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout))
    trace("process group up")
    try:
        try:
            result = fn(rank, world, *args)
        except BaseException:                        # torch's join reports only the first
            trace("raised:\n" + traceback.format_exc())   # rank to fail: each keeps its own
            raise
        with open(os.path.join(tmp, f"result{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        trace("result written")
        if backend == "nccl":
            # what the rank ran may hold CUDA graphs with NCCL kernels of the model's
            # communicator: gone, and the device idle, before the group is torn down
            result = None
            gc.collect()
            torch.cuda.synchronize()
        # both ranks past their last collective before either tears its groups down: a rank
        # that closed its gloo pairs while the other still sent its last chunk aborted the
        # other (std::terminate, SIGABRT; 1 run in 13 of tests/test_tp_generate.py)
        if lost >= 0:
            pass                                     # rank ``lost`` never answers again
        elif backend == "nccl":
            dist.barrier(device_ids=[rank])
        else:
            dist.barrier()
        trace("final barrier passed")
    finally:
        dist.destroy_process_group()
        trace("process group destroyed")
        faulthandler.cancel_dump_traceback_later()


def run_ranks(fn: Any, tmp_path: Path, *args: Any, world: int = WORLD, timeout: float = 90,
              backend: str = "gloo", lost: int | None = None) -> list:
    """``fn(rank, world, *args)`` on ``world`` spawned ranks over ``backend`` (gloo: the ranks
    see no GPU; nccl: rank r on GPU r); the results by rank. A rank that raises, dies or is
    still running after ``timeout`` seconds fails the test with every rank's thread stacks
    and trace (:func:`trace`); each rank also ends itself, stacks dumped, 5 s after that.

    ``lost``: the rank that stops or dies on purpose: the others skip the final barrier and
    are waited for alone; rank ``lost`` is then killed (a stopped one too) and its result is
    None."""
    if lost is not None:
        return _run_losing(fn, tmp_path, args, world, timeout, lost)
    ctx = _spawn(fn, tmp_path, args, world, timeout, backend)
    deadline = time.monotonic() + timeout
    dumped = False
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                dumped = True
                pytest.fail(f"the ranks did not finish within {timeout} s; their stacks and traces:\n"
                            + _stacks(ctx, tmp_path))
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        dumped = True
        # torch's join ended the other ranks (SIGTERM: their stacks were dumped)
        pytest.fail(f"a rank failed: {e}\n--- every rank's stacks and trace ---\n"
                    + _stacks(ctx, tmp_path), pytrace=False)
    finally:
        if not dumped and any(p.is_alive() for p in ctx.processes):
            sys.stderr.write(_stacks(ctx, tmp_path))     # interrupted: where they were
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    out = []
    for rank in range(world):
        with open(tmp_path / f"result{rank}.pkl", "rb") as f:
            out.append(pickle.load(f))
    return out


def _spawn(fn: Any, tmp_path: Path, args: tuple, world: int, timeout: float, backend: str,
           lost: int = -1) -> Any:
    """The ranks of :func:`run_ranks`, started (torch's process context)."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    # CPU tests: the ranks see no GPU, so transformers' mesh is on the CPU even on a GPU host
    if backend == "gloo":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        return mp.start_processes(_entry, args=(fn, world, str(tmp_path), args, backend, timeout + 5, lost),
                                  nprocs=world, join=False, start_method="spawn")
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def _run_losing(fn: Any, tmp_path: Path, args: tuple, world: int, timeout: float, lost: int) -> list:
    """:func:`run_ranks` with rank ``lost`` stopping or dying on purpose (gloo only)."""
    ctx = _spawn(fn, tmp_path, args, world, timeout, "gloo", lost)
    survivors = [(r, p) for r, p in enumerate(ctx.processes) if r != lost]
    deadline = time.monotonic() + timeout
    try:
        for _, p in survivors:
            p.join(max(0.0, deadline - time.monotonic()))
        late = [r for r, p in survivors if p.exitcode is None]
        if late:
            pytest.fail(f"ranks {late} did not finish within {timeout} s; their stacks and traces:\n"
                        + _stacks(ctx, tmp_path), pytrace=False)
        failed = [(r, p.exitcode) for r, p in survivors if p.exitcode != 0]
        if failed:
            pytest.fail(f"ranks failed (rank, exit code): {failed}\n--- every rank's stacks and "
                        "trace ---\n" + _stacks(ctx, tmp_path), pytrace=False)
    finally:
        for p in ctx.processes:                      # the lost rank: stopped, or gone already
            if p.is_alive():
                p.kill()
            p.join(5)
    out: list = []
    for rank in range(world):
        if rank == lost:
            out.append(None)
            continue
        with open(tmp_path / f"result{rank}.pkl", "rb") as f:
            out.append(pickle.load(f))
    return out


def _stacks(ctx: Any, tmp_path: Path) -> str:
    """Every rank's thread stacks (faulthandler: live ranks are sent SIGUSR1 now; a rank that
    died left what it dumped then) and trace, as text."""
    alive = [p for p in ctx.processes if p.is_alive()]
    for p in alive:
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except OSError:
            pass
    if alive:
        time.sleep(1.0)
    text = []
    for rank, p in enumerate(ctx.processes):
        state = "alive" if p.is_alive() else f"exit code {p.exitcode}"
        text.append(f"--- rank {rank} ({state}) ---\n")
        for name in (f"trace{rank}.txt", f"stack{rank}.txt"):
            path = tmp_path / name
            body = path.read_text()[-20000:] if path.exists() else "(none)\n"
            text.append(f"[{name}]\n{body or '(empty)'}\n")
    return "".join(text)


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


def _outcome(fn: Any) -> tuple[str, str]:
    """(class name, message) of what ``fn()`` raises; ("none", "") when it returns."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares the outcome across ranks
        return type(e).__name__, str(e)
    return "none", ""


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
    outcome = _outcome(cache.prepare_step)
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
            out[name] = _outcome(lambda: cache.declare_step([a, b]))
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
    out["real_too_large"] = _outcome(lambda: cache.declare_step([a, b] * 4))
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
    outcome = _outcome(cache.prepare_step)
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
    out["prepare"] = _outcome(lambda: (cache.prepare_step(), cache.commit_step()))
    out["rounds"] = cache.rounds - rounds                 # no collective in that step
    local.write_fault = None
    out["exchange"] = _outcome(cache.exchange)
    out["diverged"] = cache.diverged
    out["after"] = _outcome(lambda: cache.declare_step([a]))
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
    out["refused"] = _outcome(cache.exchange)
    out["refused_after"] = _outcome(cache.exchange)
    return out


def divergence(rank: int, world: int) -> dict:
    """debug=True: an extra sequence op on rank 1 is caught, by a verb and by a step digest."""
    out: dict = {}
    # 1. rank 1 takes an id behind the wrapper's back: the next seq_new differs
    cache = shard_cache(rank, world, debug=True)
    cache.seq_new()
    if rank == 1:
        cache.local.seq_new()
    out["verb"] = _outcome(cache.seq_new)
    out["after"] = _outcome(lambda: cache.declare_step([0]))
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
    out["prepare"] = _outcome(cache.prepare_step)
    out["diverged"] = cache.diverged
    return out


# -- a rank that stops or dies -------------------------------------------------------------

LOST_TIMEOUT = 4.0           # the group's timeout where a rank stops or dies on purpose
# a stopped rank (silent: its connections open) is given up after the group's timeout, a
# dead one at once: the tests allow this much more on a loaded machine (still far below
# torch's 30-minute default)
LOST_SLACK = 20.0


def lose(rank: int, how: str) -> None:
    """Rank ``rank`` ends here without a word: ``stop`` (SIGSTOP: silent, its connections
    open) or ``die`` (SIGKILL: its connections closed by the kernel). run_ranks kills a
    stopped rank once the others are done."""
    trace(f"rank {rank}: {how}")
    os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)
    time.sleep(3600)                                  # never reached: SIGSTOP holds, SIGKILL ends


def short_group() -> Any:
    """A group over the world with LOST_TIMEOUT, the ranks in step when it is made (its own
    creation waits at most that long)."""
    dist.barrier()
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=LOST_TIMEOUT))


def _timed(fn: Any) -> tuple[str, str, float, bool]:
    """(class name, message, seconds, chained) of what ``fn()`` raises (``chained``: Python
    would print another exception with it); ("none", "", seconds, False) when it returns."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the outcome
        chained = e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__)
        return type(e).__name__, str(e), time.monotonic() - t0, chained
    return "none", "", time.monotonic() - t0, False


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
    outcome = _timed(call)
    trace(f"raised {outcome}")
    after = state(local)
    assert_same(before, after)                            # nothing changed by the failure
    declared = local.table.declared
    later = _timed(lambda: cache.declare_step([a]))       # refused at once
    assert_same(before, state(local))
    cache.check_invariants()
    cache.close()
    return {"outcome": outcome, "later": later, "lost": cache.lost, "declared": declared,
            "closed": cache.closed, "timeout": cache.timeout}


def _backend_timeout(group: Any) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def agreement_timeouts(rank: int, world: int) -> dict:
    """The timeouts of a TPCache over the world and over a group of LOST_TIMEOUT, with the
    timeouts their agreement groups were made with."""
    config = tp.shard_config(full_config(), rank, world)
    over_world = tp.TPCache(HostCellCache(config))
    over_short = tp.TPCache(HostCellCache(config), short_group())
    return {"world": over_world.timeout, "world_agreement": _backend_timeout(over_world.agreement_group),
            "short": over_short.timeout, "short_agreement": _backend_timeout(over_short.agreement_group)}


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
    out["refused"] = _outcome(silent.seq_new)
    out["then_closed"] = str(silent.peer_error(RuntimeError(GLOO_CLOSED), "a step"))
    out["closed"] = str(gone.peer_error(RuntimeError(GLOO_CLOSED), "a step"))
    out["others"] = [fine.peer_error(e) for e in (
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 6x8)"),
        InvalidArgument("a library error"), ValueError("timed out"), KeyboardInterrupt())]

    def bug_in_a_collective() -> None:
        with fine.collective("a collective"):
            raise RuntimeError("Tensors must be CPU and dense")

    out["bug"] = _outcome(bug_in_a_collective)
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



# -- the Generator across ranks (tests/test_tp_generate.py) -----------------------------------

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


def serve_workload(gen: Any, rank: int, alloc: Any = None) -> dict:
    """Arrivals over steps (added on rank 0 only), a follow-up added and a cancel made from
    callbacks, a callback that raises, an allocation failure on rank 1 (``alloc``); every
    rank steps in lockstep and handles the same exceptions. The same calls on one process
    (rank 0, ``alloc`` None) are the reference."""
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
            alloc.fail = rank == 1
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
        flights += gen._flight is not None
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
        refused["add"] = _outcome(lambda: gen.add([1, 2, 3]))
    else:
        refused["draft"] = _outcome(lambda: gen.add([1, 2], Sampling(), draft=lambda t, k: []))
    out = serve_workload(gen, rank, alloc)
    out["refused"] = refused
    out["tp"] = (gen.tp.rank, gen.tp.world) if gen.tp is not None else None
    out["kv_heads"] = [layer.n_kv_heads for layer in gen.cache.config.layers]
    return out


def generator_single(async_steps: bool = False) -> dict:
    """The reference: the same workload in one process, on the whole cache."""
    from cellcache.generate import Generator

    model = gen_model()
    cache = HostCellCache(gen_cache_config(model), growth="copy", allocator=FailingAllocator())
    gen = Generator(model, cache, async_steps=async_steps, **GEN_OPTIONS)  # type: ignore[arg-type]
    return serve_workload(gen, 0)


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
                            gen._flight is not None, gen.busy))
        out[async_steps, streams] = {"records": records, "outputs": [r.outputs for r in added],
                                     "skipped": gen.tp.skipped, "exchanges": gen.tp.exchanges}
        counter.restore()
    out["streamed"] = len(streamed)
    return out


LOST_AT_STEP = 3              # the step before which (or in whose forward) rank 1 is lost


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
    out["later"] = _timed(gen.step)
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
        inner = gen.sampler.inner
        launch, launched = inner.launch, [0]

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

        inner.launch = other_id
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
        later = _outcome(gen.step)
        out[key] = {"first": first, "later": later, "diverged": gen.cache.diverged,
                    "launched": launched[0]}
    return out


# -- the GPU machine: two ranks over NCCL (tests/gpu/test_tp_gpu.py) ------------------------------

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
              f"in flight {gen._flight is not None}")
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
    first = _outcome(lambda: gen.tp.handover([], end=rank == 1))
    return {"first": first, "later": _outcome(gen.step), "diverged": gen.cache.diverged}


def hang_on_rank_1(rank: int, world: int) -> dict:
    """Rank 1 sleeps past any test's limit (rank 0 waits at the final barrier)."""
    if rank == 1:
        trace("rank 1 waits forever")
        time.sleep(3600)
    return {}


# -- the CLI under torchrun -------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
CLI_TIMEOUT = 120


def run_cli(args: list[str], torchrun: bool, tmp_path: Path, cuda: bool = False,
            entry: tuple[str, ...] = ("-m", "cellcache"), tp_timeout: float = 60,
            torchrun_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``cellcache generate`` in a subprocess (under torchrun: 2 ranks, ``--standalone``: a
    free port, ``torchrun_args`` added), killed with its children after CLI_TIMEOUT
    seconds. ``cuda``: the GPUs stay visible. ``entry``: what each process runs (the
    ``generate`` command and ``args`` follow it); ``tp_timeout``: the group's timeout."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", *torchrun_args] if torchrun else [sys.executable]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    # PYTHONFAULTHANDLER: a process sent SIGABRT (below, at the time limit) prints every
    # thread's stack on its stderr first
    env.update(OMP_NUM_THREADS="1", CELLCACHE_TP_TIMEOUT=f"{tp_timeout:g}", PYTHONFAULTHANDLER="1",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.Popen(launcher + [*entry, "generate", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=CLI_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)          # stacks first (faulthandler), then gone
        try:
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"cellcache generate did not finish within {CLI_TIMEOUT} s; its stderr, "
                    f"the processes' stacks last:\n{err[-12000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


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


def _leave_in_cli(how: str, where: str) -> None:
    """Rank 1 of ``cellcache generate`` under torchrun leaves at its generator's step
    LOST_AT_STEP, before the step or inside its forward (``where``: ``step``, ``forward``):
    ``sleep`` (silent, forever) or ``exit`` (its process gone; exit code 0, on which torchrun
    waits for the other ranks instead of ending them: what rank 0 prints is its own)."""
    from cellcache.generate import engine

    _die_with_parent()                                # never outlives torchrun

    def leave(*args: Any, **kw: Any) -> None:
        if how == "sleep":                            # torchrun ends it once rank 0 is done
            time.sleep(3 * float(os.environ["CELLCACHE_TP_TIMEOUT"]) + CLI_TIMEOUT)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    step, calls = engine.Generator.step, [0]

    def leaving_step(gen: Any) -> bool:
        calls[0] += 1
        if calls[0] == LOST_AT_STEP:
            if where == "forward":
                gen.model.model.layers[1].mlp.forward = leave      # after layer 1's attention
            else:
                leave()
        return step(gen)

    engine.Generator.step = leaving_step  # type: ignore[method-assign]


if __name__ == "__main__":
    # python -m tests.helpers_tp HOW WHERE generate ARGS...: the CLI, rank 1 leaving (above)
    how, where, *command = sys.argv[1:]
    if os.environ.get("RANK") == "1":
        _leave_in_cli(how, where)
    from cellcache.__main__ import main

    sys.exit(main(command))
