"""Tensor parallelism on the GPU machine with two GPUs (device kind ``nvidia-h200-x2``): two
ranks over NCCL, each model sharded by transformers' own plan, decode steps replayed from
CUDA graphs captured on every rank, every rank sampling for itself with asynchronous steps
(its draws' checksums compared at every hand-over); greedy output (float32) equals one
GPU's and Hugging Face's teacher-forced argmax (computed in the test's process once the ranks
are gone); in bf16, the logits every row was sampled from agree with HF's forward of the
whole model end to end (cellcache.generate.agreement). First, a probe of what a 7B decode
step's collectives cost on the pair. Skipped like every GPU test without a usable device
(tests/gpu/conftest.py), and also with fewer than two GPUs or without NCCL. A rank that
hangs or dies fails its test with every rank's stacks and step trace
(tests/helpers_tp.run_ranks); ``-s`` prints the numbers and NCCL's transport."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("transformers")

from tests import helpers_tp_gpu as H  # noqa: E402

#: Seconds the two ranks of one test may run (spawn, NCCL, sharding, captures, ~40 steps):
#: well under the 240 s a whole run of this file is given, so a hang fails with the stacks
RANKS_TIMEOUT = 100


def _two_gpus() -> None:
    """Skips (never fails) when this host cannot run two NCCL ranks."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        pytest.skip(f"needs two GPUs; this host has {n}")
    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("needs torch.distributed with NCCL")


def test_the_pair_runs_a_7b_decode_steps_collectives(tmp_path):
    """First, and quick: the collectives of a Qwen2-7B-sized TP=2 decode step alone, eager and
    from a CUDA graph (a hang here is NCCL in graphs itself, with the stacks); ``-s`` prints
    what they cost, what one gloo hand-over costs, and the transport NCCL chose."""
    _two_gpus()
    r0, r1 = H.run_ranks(H.comm_probe_on_rank, tmp_path, backend="nccl", timeout=90)
    print("\n[comm] NCCL transport:", *H.nccl_transport(tmp_path) or ["(no lines)"], sep="\n  ")
    for rank, r in enumerate((r0, r1)):
        print(f"[comm] rank {rank}: P2P {r['peer']}; a decode step's collectives {r['eager_ms']:.3f} ms "
              f"eager, {r['graph_ms']:.3f} ms in a graph; one all-reduce {r['all_reduce_us']:.1f} us; "
              f"the logits' all-gather {r['all_gather_ms']:.3f} ms; a gloo hand-over {r['gloo_us']:.1f} us")
        assert r["sum_ok"]


@pytest.mark.parametrize("arch", H.GPU_ARCHS)
def test_tp2_greedy_equals_one_gpu_and_hf_with_graphs(tmp_path, arch):
    """A rank that hangs or dies fails this within ``RANKS_TIMEOUT`` s with every rank's
    thread stacks and step trace (tests/helpers_tp.run_ranks); ``-s`` prints the transport
    NCCL chose between the two GPUs."""
    _two_gpus()
    n_new = 24
    r0, r1 = H.run_ranks(H.gpu_tp_on_rank, tmp_path, arch, n_new, backend="nccl",
                         timeout=RANKS_TIMEOUT)
    print(f"\n[tp2 {arch}] NCCL transport:", *H.nccl_transport(tmp_path) or ["(no lines)"], sep="\n  ")
    print(f"[tp2 {arch}] placement: rank 0 {r0['placement']}, rank 1 {r1['placement']}; hand-overs "
          f"run {r0['exchanges']}, skipped {r0['skipped']}")
    assert r0["placement"]["model"] == "cuda:0" and r1["placement"]["model"] == "cuda:1"
    ref = H.gpu_reference(arch, n_new, "cuda:0")           # here, once the ranks are gone
    for out in (r0, r1):
        assert out["graphs"] and out["graph_steps"] > 0        # captured and replayed on every rank
        assert out["async"] and out["diverged"] is None        # every rank samples, steps ahead
        assert out["kv_heads"] == [1] * len(out["kv_heads"])   # 2 KV heads over 2 ranks
        assert out["preempted"] > 0                            # cells ran short: it preempted
        assert out["tp2"] == ref["tp1"]                        # both ranks: one GPU's outputs
    assert ref["tp1_graph_steps"] > 0
    for outputs, forced in zip(ref["tp1"], ref["hf"]):
        assert outputs[0] == forced


def test_tp2_in_bf16_agrees_with_hf_end_to_end(tmp_path):
    """Issue 41's check under TP: a Qwen2-0.5B-shaped model (14 q / 2 KV heads of 64: one KV
    head a rank, the tensor-core kernels) served in bf16 by two ranks with graphs and
    asynchronous steps, its sampled rows' logits against HF's forward of the whole model
    (float32 reference, bf16 noise floor), cells short enough to preempt."""
    _two_gpus()
    r0, r1 = H.run_ranks(H.gpu_agreement_on_rank, tmp_path, "qwen2-0.5b", 16, backend="nccl",
                         timeout=RANKS_TIMEOUT)
    for out in (r0, r1):
        assert out["graphs"] and out["async"] and out["graph_steps"] > 0
        assert out["kv_heads"] == [1] * len(out["kv_heads"])
    agree = r0["agreement"]
    print(f"\n[tp2 agreement] {agree['summary']}")
    assert agree["passed"], agree["summary"]
    assert agree["rows"] >= sum(len(o[0]) for o in r0["outputs"])     # every sampled row


def test_the_cli_under_torchrun_on_two_gpus_prints_what_one_gpu_prints(tmp_path):
    _two_gpus()
    args = ["--random", "tiny", "--device", "cuda", "--dtype", "float32", "--random-prompts", "8",
            "--max-new-tokens", "16", "--json", "--quiet"]
    one = H.run_cli(args + ["--tp", "1"], False, tmp_path, cuda=True)
    assert one.returncode == 0, one.stderr[-3000:]
    two = H.run_cli(args + ["--tp", "2"], True, tmp_path, cuda=True)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = json.loads(one.stdout), json.loads(two.stdout)
    assert b["summary"]["tp"] == 2 and b["summary"]["graph_steps"] > 0
    assert [r["outputs"] for r in b["results"]] == [r["outputs"] for r in a["results"]]
