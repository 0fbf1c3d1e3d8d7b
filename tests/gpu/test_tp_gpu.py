"""Tensor parallelism on the GPU machine with two GPUs (device kind ``nvidia-h200-x2``): two
ranks over NCCL, each model sharded by transformers' own plan, decode steps replayed from
CUDA graphs captured on every rank, every rank sampling for itself with asynchronous steps
(its draws' checksums compared at every hand-over); greedy output (float32) equals one
GPU's and Hugging Face's teacher-forced argmax. Skipped like every GPU test without a usable device
(tests/gpu/conftest.py), and also with fewer than two GPUs or without NCCL."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("transformers")

from tests import helpers_tp as H  # noqa: E402


def _two_gpus() -> None:
    """Skips (never fails) when this host cannot run two NCCL ranks."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        pytest.skip(f"needs two GPUs; this host has {n}")
    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("needs torch.distributed with NCCL")


@pytest.mark.parametrize("arch", H.GPU_ARCHS)
def test_tp2_greedy_equals_one_gpu_and_hf_with_graphs(tmp_path, arch):
    _two_gpus()
    n_new = 24
    r0, r1 = H.run_ranks(H.gpu_tp_on_rank, tmp_path, arch, n_new, backend="nccl", timeout=300)
    for out in (r0, r1):
        assert out["graphs"] and out["graph_steps"] > 0        # captured and replayed on every rank
        assert out["async"] and out["diverged"] is None        # every rank samples, steps ahead
        assert out["kv_heads"] == [1] * len(out["kv_heads"])   # 2 KV heads over 2 ranks
        assert out["preempted"] > 0                            # cells ran short: it preempted
        assert out["tp2"] == r0["tp1"]                         # both ranks: one GPU's outputs
    assert r0["tp1_graph_steps"] > 0
    for outputs, forced in zip(r0["tp1"], r0["hf"]):
        assert outputs[0] == forced


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
