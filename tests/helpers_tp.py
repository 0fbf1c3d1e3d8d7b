"""Processes for the tensor-parallel tests: ranks over gloo (or NCCL), a rank that
stops or dies on purpose, and ``cellcache generate`` under torchrun.

:func:`run_ranks` starts ``world`` processes (``torch.multiprocessing``: over gloo forked
from a forkserver that imported torch once, over NCCL spawned), joins them in a gloo group
through a file rendezvous in the test's tmp_path, runs ``fn(rank, world, *args)`` on each
and returns the results by rank. A child's exception fails the test with the child's
traceback (torch's ``ProcessRaisedException`` carries it); a collective waits at most
``COLLECTIVE_TIMEOUT`` seconds; a run past ``timeout`` kills the children and fails. A rank
is killed with the process that started it (even one that is stopped; a forked rank's is
the forkserver, which ends with the test process), so no rank outlives its test. Every
function a rank runs is a module-level function (here, in tests/helpers_tp_cache.py,
tests/helpers_tp_generate.py or tests/helpers_tp_gpu.py), so a rank can import it.

:func:`run_cli` runs ``cellcache generate`` in a subprocess, under torchrun or not;
``python -m tests.helpers_tp HOW WHERE generate ARGS...`` is the CLI with rank 1 leaving
at a chosen step (:func:`_leave_in_cli`).
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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
        # that closes its gloo pairs while the other still sends its last chunk aborts the
        # other (std::terminate, SIGABRT)
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


#: What the forkserver imports once, so that a gloo rank starts in a fork instead of a fresh
#: interpreter importing torch (~4 s a rank on a 2-core machine, most of a CPU test's time)
_PRELOAD = ["torch", "torch.distributed", "transformers", "cellcache.generate", "cellcache.hf",
            "tests.helpers_tp", "tests.helpers_tp_cache", "tests.helpers_tp_generate",
            "tests.helpers_tp_gpu"]


def _spawn(fn: Any, tmp_path: Path, args: tuple, world: int, timeout: float, backend: str,
           lost: int = -1) -> Any:
    """The ranks of :func:`run_ranks`, started (torch's process context). gloo ranks fork
    from a forkserver (started once, with this process's sys.path and CUDA_VISIBLE_DEVICES
    empty, then importing ``_PRELOAD``: it never touches a GPU); NCCL ranks are spawned, so
    each starts its own CUDA."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    # CPU tests: the ranks see no GPU, so transformers' mesh is on the CPU even on a GPU host
    method = "spawn"
    if backend == "gloo":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        if "forkserver" in mp.get_all_start_methods():
            method = "forkserver"
            mp.set_forkserver_preload(_PRELOAD)
    try:
        return mp.start_processes(_entry, args=(fn, world, str(tmp_path), args, backend, timeout + 5, lost),
                                  nprocs=world, join=False, start_method=method)
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


# -- outcomes -------------------------------------------------------------------------------

def outcome_of(fn: Any) -> tuple[str, str]:
    """(class name, message) of what ``fn()`` raises; ("none", "") when it returns."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares the outcome across ranks
        return type(e).__name__, str(e)
    return "none", ""


def timed_outcome_of(fn: Any) -> tuple[str, str, float, bool]:
    """(class name, message, seconds, chained) of what ``fn()`` raises (``chained``: Python
    would print another exception with it); ("none", "", seconds, False) when it returns."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the outcome
        chained = e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__)
        return type(e).__name__, str(e), time.monotonic() - t0, chained
    return "none", "", time.monotonic() - t0, False


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


#: The generator step before which (or in whose forward) rank 1 is lost: in a rank function
#: (tests/helpers_tp_generate.py) and in the CLI (:func:`_leave_in_cli`).
LOST_AT_STEP = 3


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
