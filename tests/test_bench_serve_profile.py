"""tools/bench_serve.py --profile-steps on the CPU: the option's usage errors, the kernel
categories, a one-process run and a 2-rank gloo run under torchrun (tiny model, --quick)."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from .helpers import TOOLS, load_tool

TOOL = TOOLS / "bench_serve.py"
ROOT = TOOLS.parent
QUICK = ["--device", "cpu", "--model", "tiny", "--quick"]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", CELLCACHE_TP_TIMEOUT="60", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def test_help_documents_the_option():
    r = subprocess.run([sys.executable, str(TOOL), "--help"], capture_output=True, text=True, env=_env())
    assert r.returncode == 0
    assert "--profile-steps N" in r.stdout and "top 15 kernels" in " ".join(r.stdout.split())


@pytest.mark.parametrize("args", [["--profile-steps", "-1"], ["--profile-steps", "x"],
                                  ["--profile-steps", "2", "--workload", "chat"]])
def test_bad_usage_exits_2_with_one_line(args):
    r = subprocess.run([sys.executable, str(TOOL), *QUICK, *args], capture_output=True, text=True,
                       env=_env())
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("bench_serve: error:") and "profile-steps" in r.stderr


def test_kernel_categories():
    cat = load_tool("bench_serve").kernel_category
    names = {
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "collective",
        "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "collective",
        "nvjet_tst_128x64_64x8_2x1_v_bz_coopA_NTN": "gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "gemm",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>":
            "gemm",
        "paged_decode_bf16_g7": "attention",
        "tc_attend_bf16_d128_m2w1k64s2x64": "attention",
        "store_kv_bf16": "attention",
        "build_step": "cellcache_step",
        "Memcpy HtoD (Pinned -> Device)": "memcpy",
        "Memset (Device)": "memcpy",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>":
            "other",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps>>":
            "other",
        "aten::mm": "gemm",
        "gloo:all_reduce": "collective",
        "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    }
    assert {n: cat(n) for n in names} == names


def test_every_shipped_kernel_is_attention_or_a_step_kernel():
    """The kernels cellcache launches, by their names in the shipped PTX: none lands in
    "other" (the row meant for the model's elementwise kernels), but the native forward's
    (fused.ptx), which are the model's elementwise work."""
    cat = load_tool("bench_serve").kernel_category
    entries = {f.stem: set(re.findall(r"\.entry\s+(\w+)", f.read_text()))
               for f in (ROOT / "cellcache" / "ptx").glob("*.ptx")}
    names = set().union(*(v for k, v in entries.items() if k != "fused"))
    assert len(names) > 20 and entries["fused"]
    got = {n: cat(n) for n in names}
    assert {n for n, c in got.items() if c not in ("attention", "cellcache_step")} == set()
    assert got["build_step"] == got["apply_step"] == "cellcache_step"
    assert {cat(n) for n in entries["fused"]} == {"other"}


def test_the_window_counts_the_device_work_it_launched_only():
    """With asynchronous steps the forward launched before the window still runs when it
    opens; its kernels are left out (they made a window of N steps hold N + 1 forwards)."""
    from types import SimpleNamespace as E

    from torch.autograd import DeviceType

    mod = load_tool("bench_serve")
    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    events = [E(id=7, name="cudaGraphLaunch", device_type=cpu),
              E(id=9, name="cuLaunchKernel", device_type=cpu),
              E(id=1, name="aten::copy_", device_type=cpu),       # an operator: no launch id
              E(id=5, name="gemm", device_type=gpu),               # launched before the window
              E(id=7, name="gemm", device_type=gpu), E(id=7, name="attend", device_type=gpu),
              E(id=9, name="build_step", device_type=gpu),
              E(id=7, name="cellcache.step", device_type=gpu),   # an annotation's device row
              E(id=1, name="memcpy", device_type=gpu)]            # an operator's id, no launch's
    kept, left_out = mod.window_device_events(events)
    assert [(e.id, e.name) for e in kept] == [(7, "gemm"), (7, "attend"), (9, "build_step")]
    assert left_out == 2
    # ids that match no recorded call: every device event is kept, the count unknown
    kept, left_out = mod.window_device_events([E(id=3, name="cudaGraphLaunch", device_type=cpu),
                                               E(id=4, name="k", device_type=gpu)])
    assert [e.name for e in kept] == ["k"] and left_out is None


def test_the_breakdown_comes_from_the_profiled_steps():
    mod = load_tool("bench_serve")
    cuda = {"steps": 8, "activities": "cuda", "device_us_per_step_total": 2285.5,
            "device_us_per_step": {"gemm": 846.7, "collective": 0.0, "attention": 1043.1,
                                   "cellcache_step": 30.0, "memcpy": 2.5, "other": 363.2}}
    pb = mod.profiled_breakdown(cuda)
    assert pb["steps"] == 8 and pb["kernels_ms"] == 2.2855
    assert abs(pb["attention_ms"] - 1.0431) < 1e-12 and abs(pb["gemm_ms"] - 0.8467) < 1e-12
    assert abs(pb["attention_ms"] + pb["gemm_ms"] + pb["rest_ms"] - pb["kernels_ms"]) < 1e-12
    assert mod.profiled_breakdown({**cuda, "activities": "cpu"}) is None   # operators' time, not the GPU's
    assert mod.profiled_breakdown({"error": "no window"}) is None


def _check_summary(s: dict, steps: int, kinds: dict | None = None) -> None:
    assert "error" not in s, s
    assert s["steps"] == steps and s["activities"] == "cpu"
    assert s["window"]["kinds"] == (kinds or {"decode": steps})   # steps of the one kind asked
    per = s["device_us_per_step"]
    assert set(per) == {"gemm", "collective", "attention", "cellcache_step", "memcpy", "other"}
    assert per["gemm"] > 0 and per["attention"] > 0
    assert 0 < len(s["top_kernels"]) <= 15
    assert all(k["category"] in per and k["calls_per_step"] > 0 for k in s["top_kernels"])
    assert s["step_wall_us"]["median"] > 0 and s["host_us_per_step"] > 0
    assert s["host_calls_per_step"]["cellcache.forward"]["calls"] == 1   # one forward a step


def test_one_process_profile(tmp_path, capsys):
    mod = load_tool("bench_serve")
    out = tmp_path / "s.json"
    code = mod.main([*QUICK, "--skip", "off,staggered,hf-batch,hf-static", "--json", str(out),
                     "--profile-steps", "3"])
    assert code == 0
    res = json.loads(out.read_text())
    assert "profile" not in res["cellcache"]           # the headline run carries no profile
    (s,) = res["profile"]
    _check_summary(s, 3)
    assert s["window"]["start_after_decode_steps"] > 0    # from the middle, not the start
    assert (tmp_path / "s-profile-rank0.json").exists() and (tmp_path / "s-trace-rank0.json.gz").exists()
    printed = capsys.readouterr().out
    assert "profile: cellcache" in printed and "top kernels" in printed


def test_tp2_gloo_profile_every_rank(tmp_path):
    out = tmp_path / "tp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(TOOL), *QUICK, "--tp", "2", "--skip", "hf-batch", "--json", str(out), "--profile-steps", "2"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("bench_serve --tp 2 --profile-steps did not finish within 180 s")
    assert proc.returncode == 0, stderr[-4000:]
    res = json.loads(out.read_text())
    # the record names the TP benchmark and the launcher that ran it
    assert res["benchmark"] == "serve-tp2-tiny-cpu-quick"
    assert res["command"].startswith("torchrun --nproc-per-node 2 tools/bench_serve.py --device cpu")
    r = res["cellcache"]                             # the timed run's seconds by kind of step
    assert r["mixed_calls"] >= 1 and r["decode_calls"] >= 1
    assert r["mixed_calls"] + r["decode_calls"] + r["none_calls"] == r["steps"] + r["none_calls"]
    walls = r["mixed_ms_total"] + r["decode_ms_total"] + r["none_ms_total"]
    assert 0.5 * 1e3 * r["seconds"] <= walls <= 1e3 * r["seconds"]
    # the configuration timed, checked end to end on rank 0 (float32: against the reference
    # within atol, no noise floor), every sampled row of the requests it chose
    agree = res["agreement"]
    assert agree["passed"] is True and agree["rows"] > 0 and agree["requests"] >= 1, agree
    summaries = r["profile"]
    assert [s["rank"] for s in summaries] == [0, 1]
    for s in summaries:
        _check_summary(s, 2)
        assert s["device_us_per_step"]["collective"] > 0          # the model's all-reduces (gloo)
        assert s["host_calls_per_step"]["cellcache.handover"]["calls"] >= 1
    for r in (0, 1):
        assert (tmp_path / f"tp-profile-rank{r}.json").exists()
    assert "rank 0" in stdout and "rank 1" in stdout and "top kernels" in stdout


def test_mixed_steps_profile(tmp_path, capsys):
    """``--profile-kind mixed``: the window opens in the middle of the prompt chunks (steps
    small enough that the prompts take several) and records mixed steps; without
    ``--profile-steps`` the option is bad usage."""
    mod = load_tool("bench_serve")
    out = tmp_path / "m.json"
    code = mod.main([*QUICK, "--skip", "off,staggered,hf-batch,hf-static", "--json", str(out),
                     "--max-batch-tokens", "48", "--prefill-chunk", "16", "--no-check",
                     "--profile-steps", "2", "--profile-kind", "mixed"])
    assert code == 0
    (s,) = json.loads(out.read_text())["profile"]
    _check_summary(s, 2, kinds={"mixed": 2})
    assert s["window"]["kind"] == "mixed" and s["window"]["start_after_mixed_steps"] > 0
    assert "after" in capsys.readouterr().out
    r = subprocess.run([sys.executable, str(TOOL), *QUICK, "--profile-kind", "mixed"], capture_output=True,
                       text=True, env=_env())
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--profile-steps" in r.stderr
