"""cellcache.tp on the CPU: two ranks over gloo (spawned processes) take the same decisions
as one process, agree on every refusal and failure with nothing changed on any rank, catch a
divergence in debug mode, and a model sharded with transformers' own tensor-parallel plan
gives one process's logits. Also the cache's hooks the agreement is built on
(``prepare_step(agree=)``, ``unprepare_step``, ``undeclare``) and the head shard rules."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from cellcache import (  # noqa: E402
    CacheConfig,
    HostCellCache,
    InvalidArgument,
    InvalidState,
    LayerConfig,
    OutOfMemory,
    tp,
)
from tests import helpers_tp as H  # noqa: E402
from tests import helpers_tp_cache as HC  # noqa: E402
from tests.helpers import FailingAllocator, assert_same, config, state  # noqa: E402

# -- the head shard ----------------------------------------------------------------------------

@pytest.mark.parametrize("n_kv, world, expected", [
    (8, 1, [range(0, 8)]),
    (8, 4, [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]),
    (2, 2, [range(0, 1), range(1, 2)]),
    (2, 4, [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]),     # replicated
    (1, 8, [range(0, 1)] * 8),
])
def test_kv_heads_are_divided_or_replicated(n_kv, world, expected):
    assert [tp.local_kv_heads(n_kv, r, world) for r in range(world)] == expected
    n_q = 4 * max(n_kv, world)
    group = n_q // n_kv
    for r in range(world):
        q = tp.local_q_heads(n_q, n_kv, r, world)
        assert len(q) == n_q // world
        assert {h // group for h in q} <= set(expected[r])   # a rank's q heads read its KV heads


@pytest.mark.parametrize("n_kv, rank, world, match", [
    (6, 0, 4, "cannot be divided over 4 ranks"),
    (4, 0, 6, "cannot be replicated over 6 ranks"),
    (4, 2, 2, "rank"),
    (4, 0, 0, "world"),
])
def test_heads_that_cannot_be_sharded_are_refused(n_kv, rank, world, match):
    with pytest.raises(InvalidArgument, match=match):
        tp.local_kv_heads(n_kv, rank, world)
    if world >= 1 and 0 <= rank < world:
        cfg = CacheConfig(capacity=16, layers=[LayerConfig(n_kv, 4)], max_write=4)
        with pytest.raises(InvalidArgument, match=match):
            tp.shard_config(cfg, rank, world)


def test_shard_config_changes_only_the_kv_heads():
    cfg = HC.full_config(mask_format="bits")
    for rank in range(2):
        shard = tp.shard_config(cfg, rank, 2)
        assert [layer.n_kv_heads for layer in shard.layers] == [1, 2]
        assert [(la.head_dim, la.window) for la in shard.layers] == [(4, 0), (2, 5)]
        same = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "layers"}
        assert same == {f.name: getattr(shard, f.name) for f in dataclasses.fields(shard)
                        if f.name != "layers"}
    with pytest.raises(InvalidArgument, match="not a CacheConfig"):
        tp.shard_config("cfg", 0, 2)


def test_the_wrapper_needs_a_cache_and_a_process_group():
    assert not dist.is_initialized()
    cache = HostCellCache(HC.full_config())
    with pytest.raises(InvalidState, match="init_process_group"):
        tp.TPCache(cache)
    with pytest.raises(InvalidArgument, match="not a cellcache cache"):
        tp.TPCache("cache")


# -- the cache's hooks -------------------------------------------------------------------------

def test_agree_sees_every_outcome_and_its_refusal_changes_nothing():
    alloc = FailingAllocator()
    cache = HostCellCache(config(), growth="copy", allocator=alloc)
    a = cache.seq_new()
    seen = []
    assert cache.declare_step([a] * 3)
    cache.prepare_step(agree=seen.append)                 # the first allocation: 4 rows
    cache.commit_step()
    assert seen == [None]
    assert cache.declare_step([a] * 2)                     # 5 rows needed: a growth
    before, calls, live = state(cache), alloc.calls, alloc.live

    def refuse_with(error):
        def agree(local_error):
            seen.append(local_error)
            raise error
        return agree

    with pytest.raises(OutOfMemory, match="another rank"):
        cache.prepare_step(agree=refuse_with(OutOfMemory("another rank is out of memory")))
    assert seen[-1] is None
    assert alloc.calls > calls and alloc.live == live     # the plan was made, then given back
    assert_same(before, state(cache))
    # a local refusal reaches agree, which may replace it
    with pytest.raises(InvalidState, match="agreed"):
        cache.prepare_step(width=3, agree=refuse_with(InvalidState("agreed")))
    assert isinstance(seen[-1], InvalidState) and "differs from the declared" in str(seen[-1])
    with pytest.raises(InvalidState, match="differs from the declared"):
        cache.prepare_step(width=3, agree=lambda e: None)  # agree returning: the local error
    assert_same(before, state(cache))
    step = cache.prepare_step(agree=seen.append)
    assert seen[-1] is None and step.rows == 8


def test_unprepare_takes_the_step_back_and_undeclare_drops_it():
    cache = HostCellCache(config(initial_capacity=8))     # no growth in the step taken back
    a, b = cache.seq_new(), cache.seq_new()
    assert cache.declare_step([a, a, b])
    cache.prepare_step()
    cache.commit_step()
    assert cache.declare_step([b, a])
    before = state(cache)
    step = cache.prepare_step(pad_to=4)
    cache.unprepare_step()
    after = state(cache)
    assert after["table"] == before["table"] and after["metrics"] == before["metrics"]
    assert cache.table.declared == [b, a] and cache.prepared_step is None
    assert cache.prepare_step(pad_to=4).cells.tolist() == step.cells.tolist()
    cache.seq_new()                                        # a verb: the placement stands
    with pytest.raises(InvalidState, match="nothing was placed"):
        cache.unprepare_step()
    cache.commit_step()
    with pytest.raises(InvalidState, match="no step is prepared"):
        cache.unprepare_step()
    assert cache.declare_step([a])
    cache.undeclare()
    assert cache.table.declared is None
    cache.undeclare()                                       # nothing declared: nothing to do
    assert cache.table.declared is None


# -- two ranks over gloo -----------------------------------------------------------------------

@pytest.mark.parametrize("debug, deferred", [(False, False), (True, False), (False, True)])
def test_every_rank_takes_the_decisions_of_one_process(tmp_path, debug, deferred):
    seed, n_ops = 3, 120
    ranks = H.run_ranks(HC.walk_on_rank, tmp_path, seed, n_ops, debug, deferred)
    single = HC.walk(HostCellCache(HC.full_config(), growth="copy"), seed, n_ops)
    kinds = {r[0] for r in single}
    assert {"step", "declare", "clone", "rm", "rewind"} <= kinds    # the walk reaches them all
    assert any(r[0] == "declare" and r[2] == "StepTooLarge" for r in single)
    assert any(r[0] == "declare" and r[2] is False for r in single)
    assert any(r[0] == "step" and r[2][4] and r[2][3] > 4 for r in single)   # a growth
    for rank, out in enumerate(ranks):
        assert out["heads"] == [1, 2]
        assert out["pool_shape"][1:] == [2, 2]
        for i, (mine, ref) in enumerate(zip(out["records"], single)):
            assert mine == ref, f"rank {rank} differs from one process at record {i}"
        assert len(out["records"]) == len(single)
        if deferred:                         # a collective only where a step grew the pools
            assert out["rounds"] == sum(1 for r in single if r[0] == "step" and r[2][4])


@pytest.mark.parametrize("deferred", [False, True])
def test_an_allocation_failure_on_one_rank_is_the_same_error_on_both(tmp_path, deferred):
    r0, r1 = H.run_ranks(HC.oom_on_one_rank, tmp_path, deferred)
    assert r0["outcome"] == r1["outcome"]
    kind, message = r0["outcome"]
    assert kind == "OutOfMemory"
    assert "injected" in message and "on rank 1 of 2" in message
    assert r0["planned"] > 0 and r1["planned"] == 0    # rank 0 had its plan, and gave it back
    assert r0["step"] == r1["step"]                       # the retry: the same step on both
    assert r0["step"][3] == 8                             # it grew


def test_refusals_on_one_rank_are_refusals_on_both(tmp_path):
    r0, r1 = H.run_ranks(HC.refusals_on_one_rank, tmp_path)
    assert r0["false"] == r1["false"] == ("returned", False)
    assert r0["too_large"] == r1["too_large"]
    assert r0["too_large"][0] == "StepTooLarge" and "on rank 1 of 2" in r0["too_large"][1]
    assert r1["foreign"] == ("KeyError", "'injected'")     # the rank's own error, as it was
    assert r0["foreign"][0] == "InvalidState"
    assert "declare_step failed on rank 1 of 2 with KeyError" in r0["foreign"][1]
    assert r0["step"] == r1["step"]
    assert r0["real_too_large"] == r1["real_too_large"]
    kind, message = r0["real_too_large"]
    assert kind == "StepTooLarge" and "need 72 entries" in message and "max_kv=60" in message
    assert "on rank 0 of 2" in message                    # both refused: the first rank's


def test_a_fault_after_the_agreement_takes_the_step_back_on_every_rank(tmp_path):
    r0, r1 = H.run_ranks(HC.fault_after_agreement, tmp_path)
    assert r0["outcome"] == r1["outcome"]
    kind, message = r0["outcome"]
    assert kind == "OutOfMemory" and "writing the step ran out of memory" in message
    assert "on rank 1 of 2" in message
    assert r0["step"] == r1["step"]


def test_deferred_agreement_settles_at_the_next_round(tmp_path):
    """Deferred: a step without growth runs no collective; a rank's own failure after the
    agreement is raised there at once and on every rank at the next round, and the wrapper
    refuses from then on; outcomes that differ (one rank refused) are caught by that round."""
    r0, r1 = H.run_ranks(HC.deferred_faults, tmp_path)
    assert r0["rounds"] == r1["rounds"] == 0
    assert r0["prepare"] == ("none", "")
    kind, message = r1["prepare"]
    assert kind == "OutOfMemory" and "writing the step ran out of memory" in message
    for out in (r0, r1):
        kind, message = out["exchange"]
        assert kind == "OutOfMemory", out
        assert "rank 1 of 2 failed after the ranks agreed on the step" in message
        assert "writing the step ran out of memory" in message
        assert out["diverged"] is not None and "rank 1 failed after the ranks agreed" in out["diverged"]
        assert out["after"][0] == "InvalidState" and "build new caches" in out["after"][1]
        kind, message = out["refused"]
        assert kind == "InvalidState" and "cache outcomes (declare_step, prepare_step) differ" in message
        assert out["refused_after"][0] == "InvalidState"
    assert r0["declared"] is True and r1["declared"] is False


def test_debug_mode_names_the_rank_that_diverged(tmp_path):
    r0, r1 = H.run_ranks(HC.divergence, tmp_path)
    for out in (r0, r1):
        kind, message = out["verb"]
        assert kind == "InvalidState" and "rank 1 differs from rank 0 at seq_new" in message
        assert out["after"][0] == "InvalidState" and "build new caches" in out["after"][1]
        assert out["declare"] is True
        kind, message = out["prepare"]
        assert kind == "InvalidState" and "rank 1 differs from rank 0 at prepare_step" in message
        assert out["diverged"] is not None
    assert r0["prepare"] == r1["prepare"]


def test_a_model_sharded_by_transformers_gives_one_process_logits(tmp_path):
    pytest.importorskip("transformers")
    from cellcache import hf as cchf
    from cellcache.generate import random_model

    r0, r1 = H.run_ranks(HC.sharded_model_logits, tmp_path, timeout=150)
    model = random_model("llama-tiny", seed=4)
    single = HC.greedy_logits(model, HostCellCache(cchf.cache_config(model, capacity=64, max_write=16,
                                                                      max_seqs=4)))
    for out in (r0, r1):
        # each rank holds one of the two KV heads and two of the four query heads
        assert out["kv_heads"] == [1, 1] and out["pool"][1:] == [1, 16]
        assert out["q_rows"] == 32 and out["k_rows"] == 16
        assert len(out["logits"]) == len(single) == 1 + HC.DECODE_STEPS
        for mine, ref in zip(out["logits"], single):
            assert mine.shape == ref.shape
            np.testing.assert_allclose(mine, ref, rtol=0, atol=1e-5)
            assert (mine.argmax(-1) == ref.argmax(-1)).all()


# -- a rank that stops or dies ---------------------------------------------------------------

def test_the_agreement_waits_as_long_as_the_group_it_agrees_over(tmp_path):
    """The agreement's own gloo group is made with the timeout of the group it agrees over
    (torch would give it gloo's 30 minutes): the default group's here."""
    for out in H.run_ranks(HC.agreement_timeouts, tmp_path):
        assert out == {"world": H.COLLECTIVE_TIMEOUT, "world_agreement": H.COLLECTIVE_TIMEOUT,
                       "short": H.LOST_TIMEOUT, "short_agreement": H.LOST_TIMEOUT}


@pytest.mark.parametrize("how, where", [("stop", "declare"), ("stop", "exchange"), ("die", "grow"),
                                        ("die", "exchange")])
def test_a_rank_that_stops_or_dies_is_named_on_one_line_within_the_timeout(tmp_path, how, where):
    r0, r1 = H.run_ranks(HC.lost_peer_on_rank, tmp_path, how, where, lost=1, timeout=60)
    assert r1 is None
    kind, message, seconds, chained = r0["outcome"]
    assert kind == "InvalidState" and not chained
    assert "\n" not in message and message.startswith("rank 1 of 2 ")
    assert "build new caches" in message
    verb = {"declare": "declare_step", "grow": "prepare_step", "exchange": "exchange"}[where]
    assert f"{verb}()'s agreement" in message
    if how == "stop":
        assert "did not answer" in message and f"timeout ({H.LOST_TIMEOUT:g} s)" in message
        assert H.LOST_TIMEOUT - 0.5 <= seconds <= H.LOST_TIMEOUT + H.LOST_SLACK
    else:
        assert "closed its connection" in message and "died" in message
        assert seconds <= H.LOST_TIMEOUT + H.LOST_SLACK
    # nothing changed (the rank function compared its whole cache), and every later call
    # is refused at once with the same line
    assert r0["declared"] == (None if where in ("declare", "exchange") else [0, 0])
    assert r0["later"][:2] == ("InvalidState", message) and r0["later"][2] < 1.0
    assert r0["lost"] == message and r0["closed"]


def test_with_three_ranks_the_roll_call_names_the_one_that_stopped(tmp_path):
    *survivors, lost = H.run_ranks(HC.lost_peer_on_rank, tmp_path, "stop", "exchange", world=3,
                                   lost=2, timeout=60)
    assert lost is None
    for rank, out in enumerate(survivors):
        kind, message, seconds, _ = out["outcome"]
        assert kind == "InvalidState" and "\n" not in message, rank
        assert message.startswith("rank 2 of 3 did not answer exchange()'s agreement"), message
        assert f"rank {rank} ends its wait" in message
        assert seconds <= H.LOST_TIMEOUT + H.LOST_SLACK


def test_peer_error_names_only_a_transport_failure(tmp_path):
    """What a CLI turns into one line: the backend's words for a peer gone or silent (inside
    the model's collectives, say); any other error is left as it is (None), the wrapper
    still usable."""
    for rank, out in enumerate(H.run_ranks(HC.peer_errors_on_rank, tmp_path)):
        other = 1 - rank
        assert out["timed_out"] == (
            f"rank {other} of 2 did not answer the model's collectives within its group's timeout: "
            f"it stopped, hangs or is out of step; rank {rank} ends "
            "its wait: build new caches [Timed out waiting 3000ms for recv operation to complete]")
        assert out["refused"] == ("InvalidState", out["timed_out"])
        assert out["then_closed"] == out["timed_out"]          # the first reason stays
        assert out["closed"] == (
            f"rank {other} of 2 closed its connection during a step: the process died or left; "
            f"rank {rank} ends its wait: build new caches [Connection closed by peer "
            "[127.0.0.1]:34446]")
        assert out["others"] == [None, None, None, None]
        assert out["bug"] == ("RuntimeError", "Tensors must be CPU and dense")   # as it was
        assert out["lost"] is None
