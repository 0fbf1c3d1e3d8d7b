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


@pytest.mark.parametrize("async_steps, debug", [(False, True), (True, False)])
def test_two_ranks_serve_what_one_process_serves(tmp_path, async_steps, debug):
    """Every rank samples for itself (no ids broadcast): the outputs are one process's,
    synchronous with debug digests, and asynchronous (steps left in flight) without."""
    single = H.generator_single(async_steps)
    r0, r1 = H.run_ranks(H.generator_on_rank, tmp_path, async_steps, debug, timeout=150)
    if async_steps:                                                # the asynchronous path ran
        assert single["flights"] >= 3 and r0["flights"] == r1["flights"] >= 3
    # the workload reaches what it is meant to
    st = single["stats"]
    assert st["preempted"] > 0 and st["forks"] == 1
    assert single["reasons"][2] == ["cancelled"] and single["reasons"][3] == ["error"]
    assert len(single["outputs"]) == len(H.GEN_PROMPT_LENS)        # the follow-up was added
    assert single["raised"] == ["ValueError: injected: a client's callback failed"]
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
    assert r0["raised"] == r1["raised"][:1] + single["raised"]
    assert r1["raised"][1].startswith("InvalidState: request 3's on_token raised on rank 0")
    assert r0["errors"][3] == "ValueError" and r1["errors"][3] == "InvalidState"
    kind, message = r1["refused"]["add"]
    assert kind == "InvalidState" and "added on rank 0 only" in message
    kind, message = r0["refused"]["draft"]
    assert kind == "InvalidArgument" and "draft" in message


def test_a_steady_decode_step_runs_two_collectives(tmp_path):
    """The agreement's collectives in a decode step: the two hand-overs (which also compare
    the draws and settle the cache), plus one when the step grows the pools; synchronous and
    asynchronous, with the same outputs."""
    r0, r1 = H.run_ranks(H.steady_decode_on_rank, tmp_path, timeout=150)
    for out in (r0, r1):
        for async_steps in (False, True):
            records = out[async_steps]["records"]
            decode = [(calls, grew) for calls, grew, is_decode, _ in records[1:] if is_decode]
            assert len(decode) >= 20
            assert any(grew for _, grew in decode)                 # growth is agreed: one more
            assert all(calls == 2 + grew for calls, grew in decode), records
            if async_steps:
                assert sum(flight for *_, flight in records) >= 20
        assert out[True]["outputs"] == out[False]["outputs"] == r0[False]["outputs"]


def test_sampled_ids_that_differ_raise_on_every_rank(tmp_path):
    """Rank 1 draws another id once (its sampler patched): every rank raises InvalidState
    naming the step, and refuses every later step."""
    r0, r1 = H.run_ranks(H.diverged_draws_on_rank, tmp_path, timeout=150)
    for key in ("sync", "async", "async_debug"):
        a, b = r0[key], r1[key]
        assert a["first"] is not None and b["first"] is not None, key
        assert a["first"][0] == b["first"][0], key                 # the same step() call
        for out in (a, b):
            call, kind, message = out["first"]
            assert kind == "InvalidState" and "sampled ids diverged at step 4 " in message, key
            assert out["later"][0] == "InvalidState" and "diverged" in out["later"][1], key
            assert "sampled ids diverged" in out["diverged"]


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
    for r in H.run_ranks(H.refused_generator, tmp_path, timeout=120):
        assert r["raised"] is not None and len(r["raised"]) == 3, r
        assert not r["sharded"] and r["attention"] != "cellcache", r
