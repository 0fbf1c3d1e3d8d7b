"""The Generator and ``cellcache generate`` across ranks on the CPU: two processes over gloo
serve exactly the outputs of one process (float32), through arrivals, a follow-up added and
a cancel made from callbacks, a callback that raises, preemption, ``n > 1`` sampling and an
allocation failure on one rank (agreed, rolled back on every rank, then served on); the CLI
under torchrun prints what ``--tp 1`` prints. Every wait is bounded (collectives by the
group's timeout, the ranks and the CLI by a wall-clock limit)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("transformers")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from cellcache import InvalidArgument, InvalidState  # noqa: E402
from tests import helpers_tp as H  # noqa: E402
from tests import helpers_tp_generate as HG  # noqa: E402
from tests import helpers_tp_gpu as HGPU  # noqa: E402


@pytest.mark.parametrize("async_steps, debug", [(False, True), (True, False)])
def test_two_ranks_serve_what_one_process_serves(tmp_path, async_steps, debug):
    """Every rank samples for itself (no ids broadcast): the outputs are one process's,
    synchronous with debug digests, and asynchronous (steps left in flight) without."""
    single = HG.generator_single(async_steps)
    r0, r1 = H.run_ranks(HG.generator_on_rank, tmp_path, async_steps, debug, timeout=150)
    if async_steps:                                                # the asynchronous path ran
        assert single["flights"] >= 3 and r0["flights"] == r1["flights"] >= 3
    # the workload reaches what it is meant to
    st = single["stats"]
    assert st["preempted"] > 0 and st["forks"] == 1
    assert single["reasons"][2] == ["cancelled"] and single["reasons"][3] == ["error"]
    assert len(single["outputs"]) == len(HG.GEN_PROMPT_LENS)        # the follow-up was added
    assert single["raised"][0].startswith("OutOfMemory: ") and "injected" in single["raised"][0]
    assert single["raised"][1:] == ["ValueError: injected: a client's callback failed"]
    for rank, out in enumerate((r0, r1)):
        assert out["tp"] == (rank, 2) and out["kv_heads"] == [1, 1, 1]
        assert out["outputs"] == single["outputs"], f"rank {rank}"
        assert out["reasons"] == single["reasons"], f"rank {rank}"
        assert out["stats"] == single["stats"], f"rank {rank}"
        assert out["steps"] == single["steps"]
        # one allocation failure, on rank 1, raised on both as the same error; then the
        # callback's failure: rank 0 raised it, rank 1 an InvalidState naming it
        oom = out["raised"][0]
        assert oom.startswith("OutOfMemory: growing the pools") and "injected" in oom
        assert "on rank 1 of 2" in oom
    assert r0["raised"] == r1["raised"][:1] + single["raised"][1:]
    assert r1["raised"][1].startswith("InvalidState: request 3's on_token raised on rank 0")
    assert r0["errors"][3] == "ValueError" and r1["errors"][3] == "InvalidState"
    kind, message = r1["refused"]["add"]
    assert kind == "InvalidState" and "added on rank 0 only" in message
    kind, message = r0["refused"]["draft"]
    assert kind == "InvalidArgument" and "draft" in message


def test_a_steady_decode_step_runs_one_collective_two_with_streams(tmp_path):
    """The agreement's collectives in a decode step: the step's start hand-over (which also
    compares the draws and settles the cache), the end's too when a request streams (its
    callback may add or cancel), plus one when the step grows the pools; synchronous and
    asynchronous, with the same outputs. The last step (nothing left: step() may return
    False) always runs both."""
    r0, r1 = H.run_ranks(HG.steady_decode_on_rank, tmp_path, timeout=150)
    assert r0["streamed"] == 2 * 4 * 24 and r1["streamed"] == 0  # rank 0 ran the callbacks
    for out in (r0, r1):
        for async_steps in (False, True):
            for streams in (False, True):
                run = out[async_steps, streams]
                records = run["records"]
                # decode steps after which the generator stays busy (the others may end the
                # run: step() returns False only with both hand-overs)
                decode = [(calls, grew) for calls, grew, is_decode, _, busy in records[1:]
                          if is_decode and busy]
                assert len(decode) >= 20
                assert any(grew for _, grew in decode)             # growth is agreed: one more
                per_step = 2 if streams else 1
                # (asynchronous: the first call only launches, the prompts' step: nothing
                # lands, so its end's hand-over is not told apart from a start's and runs, as
                # it always may; each decode step after it lands the step before)
                off = [calls - grew - per_step for calls, grew in decode if calls != per_step + grew]
                assert off == [], (streams, records)
                if async_steps:
                    assert records[0][3]                   # the prompts' step, left in flight
                assert all(calls >= 2 for calls, _, _, _, busy in records if not busy)
                assert (run["skipped"] > 20) != streams
                if async_steps:
                    assert sum(r[3] for r in records) >= 20
        keys = ((False, False), (True, False), (False, True), (True, True))
        assert all(out[key]["outputs"] == r0[False, False]["outputs"] for key in keys)
    assert r1[True, True]["outputs"] == r0[True, True]["outputs"]


def test_sampled_ids_that_differ_raise_on_every_rank(tmp_path):
    """Rank 1 draws another id once (its sampler patched): every rank raises InvalidState
    naming the step, and refuses every later step."""
    r0, r1 = H.run_ranks(HG.diverged_draws_on_rank, tmp_path, timeout=150)
    for key in ("sync", "async", "async_debug"):
        a, b = r0[key], r1[key]
        assert a["first"] is not None and b["first"] is not None, key
        assert a["first"][0] == b["first"][0], key                 # the same step() call
        for out in (a, b):
            call, kind, message = out["first"]
            assert kind == "InvalidState" and "sampled ids diverged at step 4 " in message, key
            assert out["later"][0] == "InvalidState" and "diverged" in out["later"][1], key
            assert "sampled ids diverged" in out["diverged"]


def test_the_two_gpu_test_runs_over_gloo_on_the_cpu(tmp_path):
    """tests/gpu/test_tp_gpu.py's rank function, dry run over gloo (no graphs, synchronous
    steps): the outputs of one process, a trace of every step on each rank, and a clean
    teardown."""
    r0, r1 = H.run_ranks(HGPU.gpu_tp_on_rank, tmp_path, "tiny", 6, "cpu", timeout=150)
    ref = HGPU.gpu_reference("tiny", 6, "cpu")
    for rank, out in enumerate((r0, r1)):
        assert out["tp2"] == ref["tp1"], rank
        assert out["diverged"] is None and out["placement"]["model"] == "cpu"
        assert out["exchanges"] > 0
        lines = (tmp_path / f"trace{rank}.txt").read_text().splitlines()
        assert "process group up" in lines[1] and "generator built" in "".join(lines)
        assert lines[-1].endswith("process group destroyed")


def test_the_two_gpu_agreement_check_runs_over_gloo_on_the_cpu(tmp_path):
    """tests/gpu/test_tp_gpu.py's bf16 agreement rank function, dry run over gloo in float32
    (no noise floor: the error against the reference within atol)."""
    r0, r1 = H.run_ranks(HGPU.gpu_agreement_on_rank, tmp_path, "tiny", 6, "cpu", timeout=150)
    agree = r0["agreement"]
    assert agree["passed"] is True, agree["summary"]
    assert agree["rows"] >= sum(len(o[0]) for o in r0["outputs"]) > 0
    assert "agreement" not in r1                      # rank 0 compares


def test_a_tp_generator_is_freed_with_its_last_reference(tmp_path):
    """No reference cycle keeps a TP generator's runner (its CUDA graphs) alive: with NCCL,
    destroy_process_group() after its last use would otherwise wait for them forever."""
    for out in H.run_ranks(HG.generator_freed_on_rank, tmp_path, timeout=120):
        assert out["alive"] == [False, False]


def test_ranks_at_different_hand_overs_raise_instead_of_pairing_them(tmp_path):
    for out in H.run_ranks(HG.mismatched_handovers_on_rank, tmp_path, timeout=120):
        kind, message = out["first"]
        assert kind == "InvalidState" and "different hand-overs" in message, out
        assert out["later"][0] == "InvalidState" and "different hand-overs" in out["diverged"]


def test_a_rank_that_hangs_fails_the_test_with_every_ranks_stacks(tmp_path):
    """run_ranks' time limit: the failure shows each rank's trace and where its threads were.
    (The limit counts from the ranks' start, after the forkserver's imports.)"""
    with pytest.raises(pytest.fail.Exception) as failed:
        H.run_ranks(H.hang_on_rank_1, tmp_path, timeout=5)
    text = str(failed.value)
    assert "did not finish within 5 s" in text
    assert "--- rank 1 (alive) ---" in text and "in hang_on_rank_1" in text
    assert "rank 1 waits forever" in text                           # its trace


def test_tp_needs_a_process_group_of_its_size():
    from cellcache.generate import Generator, random_model

    assert not dist.is_initialized()
    model = random_model("tiny")
    with pytest.raises(InvalidState, match="init_process_group"):
        Generator(model, capacity=64, tp=2)
    with pytest.raises(InvalidArgument, match="tp='2'"):
        Generator(model, capacity=64, tp="2")
    gen = Generator(model, capacity=64, tp=1)                     # one process: no group
    assert gen.tp is None


def test_the_cli_under_torchrun_prints_what_one_process_prints(tmp_path):
    args = ["--random", "tiny", "--device", "cpu", "--random-prompts", "8", "--max-new-tokens", "12",
            "--json", "--quiet"]
    one = H.run_cli(args + ["--tp", "1"], False, tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    two = H.run_cli(args + ["--tp", "2"], True, tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = json.loads(one.stdout), json.loads(two.stdout)          # rank 0 only: one document
    assert a["summary"]["tp"] == 1 and b["summary"]["tp"] == 2
    assert [r["outputs"] for r in b["results"]] == [r["outputs"] for r in a["results"]]
    assert [r["finish_reasons"] for r in b["results"]] == [r["finish_reasons"] for r in a["results"]]
    assert b["summary"]["steps"] == a["summary"]["steps"]


def test_the_cli_refuses_tp_without_torchrun(tmp_path):
    bad = H.run_cli(["--random", "tiny", "--device", "cpu", "--random-prompts", "1", "--tp", "2"], False,
               tmp_path)
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tp 2 needs one process per rank started by torchrun" in lines[0]


def test_a_refused_tp_generator_leaves_the_model_unsharded(tmp_path):
    """Every argument is checked before the model is sharded (which cannot be undone) or
    switched to cellcache's attention."""
    for r in H.run_ranks(HG.refused_generator, tmp_path, timeout=120):
        assert r["raised"] is not None and len(r["raised"]) == 3, r
        assert not r["sharded"] and r["attention"] != "cellcache", r


@pytest.mark.parametrize("how, where", [("stop", "hand-over"), ("die", "hand-over"),
                                        ("die", "forward")])
def test_a_peer_that_stops_or_dies_ends_the_generator_with_one_line(tmp_path, how, where):
    """Rank 1 stops (silent) or dies before a step (rank 0 waits in the step's hand-over) or
    inside its forward (rank 0 waits in the model's collectives): rank 0's step raises within
    the group's timeout, and a line naming rank 1 (the hand-over's InvalidState, or
    ``gen.cache.peer_error`` of the model's error: what the CLI prints); its requests and
    cache are as before the step, and every later step is refused at once."""
    r0, r1 = H.run_ranks(HG.lost_generator_on_rank, tmp_path, how, where, lost=1, timeout=150)
    assert r1 is None
    kind, message, seconds = r0["raised"]
    if how == "stop":
        assert H.LOST_TIMEOUT - 0.5 <= seconds <= H.LOST_TIMEOUT + H.LOST_SLACK
    else:
        assert seconds <= H.LOST_TIMEOUT + H.LOST_SLACK
    if where == "hand-over":
        assert kind == "InvalidState" and r0["peer_error"] is None     # the library's already
        expected = "did not answer" if how == "stop" else "closed its connection"
        assert message.startswith(f"rank 1 of 2 {expected}") and "exchange()'s agreement" in message
    else:
        assert kind == "RuntimeError"                                  # the model's (gloo)
        kind, message = r0["peer_error"]
        assert kind == "InvalidState"
        assert message.startswith("rank 1 of 2 closed its connection during the model's collectives")
    assert "\n" not in message and "build new caches" in message
    assert r0["lost"] == message
    assert r0["same"] and r0["same_later"]
    kind, later, seconds, _ = r0["later"]
    assert (kind, later) == ("InvalidState", message) and seconds < 1.0


CLI_LOST_TIMEOUT = 10.0       # the group's timeout of the CLI runs that lose a rank


@pytest.mark.parametrize("how, where", [
    ("sleep", "step"), ("exit", "step"),
    ("exit", "forward")])
def test_the_cli_survivor_of_a_lost_rank_prints_one_line(tmp_path, how, where):
    """``cellcache generate --tp 2`` under torchrun whose rank 1 goes silent (sleeps) or exits
    before a step (rank 0 waits in the hand-over) or inside its forward (rank 0 waits in the
    model's collectives): rank 0's stderr is one line naming rank 1, no traceback. (Rank 1
    exits with code 0, so torchrun waits for rank 0 instead of ending it: its stderr is its
    own.)"""
    logs = tmp_path / "logs"
    args = ["--random", "tiny", "--device", "cpu", "--random-prompts", "4", "--max-new-tokens", "40",
            "--quiet", "--tp", "2"]
    run = H.run_cli(args, True, tmp_path, entry=("-m", "tests.helpers_tp", how, where),
                    tp_timeout=CLI_LOST_TIMEOUT, torchrun_args=("--redirects", "3", "--log-dir", str(logs)))
    assert run.returncode != 0
    found = list(logs.glob("*/attempt_0/0/stderr.log"))
    assert len(found) == 1, run.stderr[-3000:]
    err = found[0].read_text()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-3000:]
    expected = "did not answer" if how == "sleep" else "closed its connection"
    assert lines[0].startswith(f"cellcache generate: error: InvalidState: rank 1 of 2 {expected} "), lines
    assert "rank 0 ends its wait: build new caches" in lines[0]
