"""tools/bench_workloads.py on the CPU: the workloads' lengths as their sources draw them,
models from a directory, a quick run with Poisson arrivals and the agreement check, and its
usage errors."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from .helpers import load_tool  # noqa: E402


@pytest.fixture(scope="module")
def bw():
    return load_tool("bench_workloads")


def test_the_workloads_draw_their_lengths_as_published(bw):
    prompts, outs = bw.build_workload("nano-vllm", 256, 151936, 0)
    assert len(prompts) == len(outs) == 256
    assert all(100 <= len(p) <= 1024 and all(0 <= t <= 10000 for t in p) for p in prompts)
    assert all(100 <= k <= 1024 for k in outs) and len(set(outs)) > 100
    assert (prompts, outs) == bw.build_workload("nano-vllm", 256, 151936, 0)     # seeded
    assert bw.build_workload("nano-vllm", 4, 151936, 1) != bw.build_workload("nano-vllm", 4, 151936, 0)
    prompts, outs = bw.build_workload("trt-128", 5, 512, 0)
    assert [len(p) for p in prompts] == [128] * 5 and outs == [128] * 5
    prompts, outs = bw.build_workload("sharegpt", 1000, 512, 0)
    lens = sorted(len(p) for p in prompts)
    assert 4 <= lens[0] and lens[-1] <= 4096 and 120 <= lens[500] <= 230          # median about 170
    assert 4 <= min(outs) and max(outs) <= 2048 and 100 <= sorted(outs)[500] <= 200
    assert all(0 <= t < 512 for p in prompts for t in p)


def test_a_model_directory_with_weights_or_a_config_alone(bw, tmp_path):
    import torch

    from cellcache.generate import random_model

    ref = random_model("llama-tiny", seed=5)
    ref.save_pretrained(tmp_path / "full")
    loaded, name = bw.load_model(str(tmp_path / "full"), torch.float32, "cpu", 0)
    assert name == "full"
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), ref.state_dict().values()))
    ref.config.save_pretrained(tmp_path / "config-only")
    bare, name = bw.load_model(str(tmp_path / "config-only"), torch.float32, "cpu", 0)
    assert name == "config-only (random weights)" and bare.config.hidden_size == ref.config.hidden_size


def test_a_quick_run_with_poisson_arrivals_and_the_agreement_check(bw, tmp_path, capsys):
    out = tmp_path / "w.json"
    args = ["--device", "cpu", "--model", "tiny", "--quick", "--workload", "sharegpt", "--arrival", "poisson",
            "--load", "0.7", "--json", str(out)]
    assert bw.main(args) == 0
    res = json.loads(out.read_text())
    assert res["benchmark"] == "workload-sharegpt-tiny-cpu-quick" and res["command"].startswith(
        "python3 tools/bench_workloads.py --device cpu")
    w = res["workload"]
    assert w["requests"] == 16 and res["together"]["output_tokens"] == w["output_tokens"]
    assert w["kv_dtype"] == "float32"                        # (the model's: stored as computed)
    assert res["poisson"]["output_tokens"] == w["output_tokens"] and res["poisson"]["load"] == 0.7
    assert res["poisson"]["rate"] == pytest.approx(0.7 * res["together"]["requests_per_s"])
    assert res["agreement"]["passed"] is True and res["agreement"]["requests"] == 4
    assert "ttft_p99_over_p50" in res["targets"] and res["target_tokens_per_s"] is None
    printed = capsys.readouterr().out
    assert "cellcache, all at once" in printed and "cellcache, Poisson" in printed
    assert "agreement: PASS" in printed


def test_the_reference_copies_wait_on_the_host_and_the_check_runs_with_the_cache_asleep(monkeypatch):
    """bench_workloads keeps HF's reference copies off the GPU through the timed runs (the
    cache is sized after them) and compares with the served cache asleep, its memory given
    back; the generator serves again after the check, with its models back home."""
    import torch

    import cellcache.generate.agreement as agreement
    from cellcache.generate import Generator, Sampling, random_model

    bs = load_tool("bench_serve")
    model = random_model("llama-tiny", torch.float32, "cpu", 3)
    ref, floor = agreement.reference_models(model, device="cpu")
    assert floor is None and ref is not model
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in ref.parameters())
    gen = Generator(model, capacity=256, max_seqs=4, eos=[])
    seen = []
    real = agreement.compare

    def compare(rows, *models):
        seen.append((gen.asleep, next(models[0].parameters()).device))
        return real(rows, *models)

    monkeypatch.setattr(agreement, "compare", compare)
    sps = [Sampling(max_new_tokens=3)] * 3
    out = bs.tapped_run(gen, [[1, 2, 3], [4, 5], [6]], sps, (ref, floor), 2, 0, park=True)
    assert out["passed"] and out["requests"] == 2
    assert seen == [(1, torch.device("cpu"))]
    assert not gen.asleep and next(ref.parameters()).device.type == "cpu"
    again = gen.add([1, 2, 3], Sampling(max_new_tokens=3))
    gen.run()
    assert len(again.outputs[0]) == 3
    gen.cache.close()


def test_kv_dtype_serves_8bit_kv_and_names_the_record(bw, tmp_path, capsys):
    out = tmp_path / "k.json"
    assert bw.main(["--device", "cpu", "--model", "tiny", "--quick", "--workload", "trt-128",
                    "--requests", "4", "--kv-dtype", "fp8_e4m3", "--no-check", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["benchmark"] == "workload-trt-128-tiny-kv8-cpu-quick"
    assert res["workload"]["kv_dtype"] == "float8_e4m3fn"
    assert res["together"]["output_tokens"] == res["workload"]["output_tokens"]
    assert "K/V float8_e4m3fn" in capsys.readouterr().out


@pytest.mark.parametrize("args, fragment", [
    (["--model", "nope"], "--model 'nope'"),
    (["--model", "tiny", "--rate", "0"], "--rate"),
    (["--model", "tiny", "--load", "9"], "--load"),
    (["--workload", "other"], "--workload"),
    (["--model", "tiny", "--kv-dtype", "int4"], "--kv-dtype"),
])
def test_usage_errors_are_one_line_and_exit_2(bw, args, fragment, capsys):
    with pytest.raises(SystemExit) as e:
        bw.main(["--device", "cpu", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0]
