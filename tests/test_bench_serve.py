"""tools/bench_serve.py's per-step host record on the CPU (tiny model, --quick)."""

import json

from .helpers import load_tool

QUICK = ["--device", "cpu", "--model", "tiny", "--quick"]


def test_the_per_step_host_record_adds_up(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert load_tool("bench_serve").main(
        [*QUICK, "--skip", "off,staggered,hf-batch,hf-static", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    # the record the results index reads: which benchmark, when, by what, on what
    assert res["benchmark"] == "serve-default-tiny-cpu-quick" and len(res["date"]) == 10
    assert res["command"].startswith("python3 tools/bench_serve.py --device cpu --model tiny --quick")
    assert res["device"].endswith(" cores")
    r = res["cellcache"]
    d = r["decode_host_us_distribution"]
    # the steps' own record against the profile's totals: the same mean
    assert abs(d["mean"] - r["decode_host_us_per_step_total"]) <= 0.2
    assert 0 < d["median"] <= d["p90"] <= d["max"] and 0.05 <= d["top5pct_share"] <= 1
    med = d["phase_median"]
    assert set(med) == set(r["decode_host_us_per_step"]) - {"wait"} and min(med.values()) >= 0
    # each phase's median is at most its largest step; the prepare phase is never empty
    assert med["prepare"] > 0 and all(v <= d["max"] + 0.1 for v in med.values())
    worst = r["decode_host_costliest"]
    assert 1 <= len(worst) <= 8 and abs(worst[0]["host_us"] - d["max"]) <= 1
    assert [w["host_us"] for w in worst] == sorted((w["host_us"] for w in worst), reverse=True)
    assert all(0 <= w["step"] < r["decode_steps"] and w["rows"] >= 1 for w in worst)
    assert len(r["gc"]["collections"]) == 3 and r["gc"]["ms"] >= 0
    printed = capsys.readouterr().out
    assert "costliest 5% of steps" in printed and "median of each phase: schedule" in printed


def test_repeated_runs_each_keep_their_host_figure(tmp_path):
    out = tmp_path / "r.json"
    assert load_tool("bench_serve").main(
        [*QUICK, "--repeat", "2", "--skip", "off,staggered,hf-batch,hf-static", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    runs = [e for e in res["runs"] if e["run"] == "cellcache"]
    assert len(runs) == 2 and all(e["decode_host_us_per_step_total"] > 0 for e in runs)
    # each run carries the CPU-speed probe taken before and after it
    assert all(e["cpu_probe_us"]["before"] > 0 and e["cpu_probe_us"]["after"] > 0 for e in runs)
    assert res["cellcache"]["cpu_probe_us"] in [e["cpu_probe_us"] for e in runs]
    # the run reported is the median one (of two: the slower), with its own host figure;
    # both runs' throughput and the best beside it
    slow = min(runs, key=lambda e: e["tokens_per_s"])
    r = res["cellcache"]
    assert r["decode_host_us_per_step_total"] == slow["decode_host_us_per_step_total"]
    assert r["tokens_per_s"] == slow["tokens_per_s"] and len(r["tokens_per_s_runs"]) == 2
    assert r["tokens_per_s_best"] == max(e["tokens_per_s"] for e in runs)
    # the speed counts: the configuration was checked end to end against HF's forward
    agree = res["agreement"]
    assert agree["passed"] and agree["rows"] > 0 and agree["requests"] == 8
    assert res["targets"][0]["met"] and "end-to-end agreement" in res["targets"][0]["target"]


def test_the_host_target_reads_the_median_of_repeated_runs():
    host_target = load_tool("bench_serve").host_target
    one = {"cellcache": {"decode_gpu_ms_median": 3.2, "decode_gpu_rows": 256,
                         "decode_host_us_per_step_total": 600.0}}
    assert host_target({"cellcache": {"decode_host_us_per_step_total": 1.0}}) is None   # no GPU time
    met, text = host_target(one)
    assert not met and "600 us" in text and "18.8%" in text and "median of" not in text
    runs = [{"run": "cellcache", "decode_host_us_per_step_total": h} for h in (600.0, 300.0, 310.0)]
    met, text = host_target({**one, "runs": runs + [{"run": "cellcache_off", "tokens_per_s": 1.0,
                                                     "decode_host_us_per_step_total": 900.0}]})
    assert met and "median of 3 runs (600, 300, 310): 310 us" in text and "9.7%" in text
    runs[1]["decode_host_us_per_step_total"] = 700.0      # the median moves: missed again
    assert not host_target({**one, "runs": runs})[0]


def test_the_agreement_copies_wait_on_the_host_only_where_they_would_crowd_the_cache_out():
    """The float32 and served-dtype copies (6 bytes a parameter) and a cache of ``capacity``
    cells (layers x kv heads x head_dim x K and V x the dtype's bytes) against nine tenths of
    the free memory: the copies are parked on the host only past that."""
    import torch

    from cellcache.generate import random_model

    crowd = load_tool("bench_serve").copies_crowd
    model = random_model("tiny", torch.bfloat16, "cpu", 0)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cell = cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * 2
    need = 6 * sum(p.numel() for p in model.parameters()) + 1000 * cell
    assert not crowd(model, 1000, need * 10 // 9 + 10)
    assert crowd(model, 1000, need * 10 // 9 - 10)
    assert crowd(model, 1001, need * 10 // 9 + 1)                  # one cell more: over
    # tensor parallel: rank 0 holds half of each cell of two shards, the copies whole
    half = 6 * sum(p.numel() for p in model.parameters()) + 1000 * cell // 2
    assert not crowd(model, 1000, half * 10 // 9 + 10, shards=2)
    assert crowd(model, 1000, half * 10 // 9 - 10, shards=2)


def test_the_mixed_steps_host_target_reads_their_forwards_gpu_time():
    """Issue 42's host target for the mixed steps: host time per mixed step against the
    median of the timing pass's mixed forwards, the median of repeated runs where there are
    several; none without a GPU time."""
    target = load_tool("bench_serve").mixed_host_target
    one = {"cellcache": {"mixed_gpu_ms_median": 15.0, "mixed_gpu_samples": 17,
                         "mixed_host_us_per_step_total": 2000.0,
                         "decode_host_us_per_step_total": 1.0}}
    assert target({"cellcache": {"mixed_host_us_per_step_total": 1.0}}) is None
    assert target({"cellcache": {"mixed_gpu_ms_median": 15.0, "mixed_gpu_samples": 3}}) is None
    met, text = target(one)
    assert not met and "2000 us" in text and "13.3%" in text and "17 mixed forwards" in text
    runs = [{"run": "cellcache", "mixed_host_us_per_step_total": h} for h in (2000.0, 1400.0, 1200.0)]
    off = {"run": "cellcache_off", "mixed_host_us_per_step_total": 9e3}
    met, text = target({**one, "runs": runs + [off]})
    assert met and "median of 3 runs (2000, 1400, 1200): 1400 us" in text and "9.3%" in text


def test_the_timing_pass_tells_mixed_forwards_by_their_runs_not_by_graphs(monkeypatch):
    """The timing pass's events: a step with a run of several rows is a mixed step whether
    or not the runner pads it as a decode step (without graphs none is), a decode step is
    timed only where it replayed a graph, and nothing else is recorded."""
    import types

    import torch

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            pass

    monkeypatch.setattr(torch.cuda, "Event", Event)

    class Runner:
        replays = 0

        def forward(self, step, tokens=None, logit_rows=None, decode=False, **kw):
            self.replays += bool(decode)
            return "logits"

    gen = types.SimpleNamespace(runner=Runner())
    out = load_tool("bench_serve")._time_replays(gen)

    def step(width, n_runs, pad_to):
        return types.SimpleNamespace(width=width, n_runs=n_runs, pad_to=pad_to)

    assert gen.runner.forward(step(5, 2, 8)) == "logits"            # chunks, no graph
    gen.runner.forward(step(3, 3, 4), decode=True)                  # a decode replay
    gen.runner.forward(step(3, 3, 4))                               # decode, graphs off
    gen.runner.forward(step(6, 3, 8), decode=True)                  # drafts, replayed
    assert [T for T, _, _ in out] == [None, 4, None]


def test_a_run_that_does_not_agree_with_the_model_fails_loudly(tmp_path, monkeypatch, capsys):
    """The served model changed after the reference copies were taken: the run still writes
    its JSON, says where the logits differ, and exits 1."""
    tool = load_tool("bench_serve")
    real = tool.agreement_pass

    def changed(model, *a, **k):
        import torch

        with torch.no_grad():
            for prm in model.parameters():
                prm.mul_(1.05)
        return real(model, *a, **k)

    monkeypatch.setattr(tool, "agreement_pass", changed)
    out = tmp_path / "bad.json"
    assert tool.main([*QUICK, "--skip", "off,staggered,hf-batch,hf-static", "--json", str(out)]) == 1
    res = json.loads(out.read_text())
    assert res["agreement"]["passed"] is False and res["targets"][0]["met"] is False
    err = capsys.readouterr().err
    assert "does not agree with the model end to end: FAIL" in err and "worst rows" in err


def test_no_check_says_the_figures_do_not_count(tmp_path):
    out = tmp_path / "n.json"
    assert load_tool("bench_serve").main(
        [*QUICK, "--no-check", "--skip", "off,staggered,hf-batch,hf-static", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["agreement"]["passed"] is None and "do not count" in res["agreement"]["summary"]


def test_a_chat_that_does_not_fit_reads_its_histories_once_with_the_prefix_level(tmp_path, capsys):
    """--capacity-share below 1: the histories do not fit; with --spill-prefixes the prompt
    tokens computed come down to the ideal (every history read once), and the run reports
    the host tier's copies."""
    bs = load_tool("bench_serve")
    runs = {}
    for name, extra in (("plain", []), ("l2", ["--spill-gib", "1", "--spill-prefixes"])):
        out = tmp_path / f"{name}.json"
        assert bs.main(["--device", "cpu", "--model", "llama-tiny", "--workload", "chat", "--requests", "8",
                        "--turns", "3", "--new-tokens", "16", "--capacity-share", "0.2", "--skip", "off",
                        *extra, "--json", str(out)]) == 0
        runs[name] = json.loads(out.read_text())
    ideal = runs["l2"]["workload"]["ideal_computed"]
    assert runs["l2"]["benchmark"] == "serve-chat-llama-tiny-small-l2-cpu"
    assert runs["plain"]["cellcache"]["computed_tokens"] > 1.5 * ideal
    assert runs["l2"]["cellcache"]["computed_tokens"] <= 1.2 * ideal
    assert runs["l2"]["agreement"]["passed"] is True
    tier = runs["l2"]["cellcache"]["host_tier"]
    assert "host_tier" not in runs["plain"]["cellcache"]
    assert tier["prefixes"]["stored"] > 0 and tier["spill_bytes_moved"] > 0
    assert tier["restored_tokens"] > 0
    assert 0 < tier["restored_bytes"] <= tier["spill_bytes_moved"] and tier["restore_host_s"] > 0
    assert "cellcache: host tier: " in capsys.readouterr().out


def test_bad_capacity_and_spill_usage_exits_2_with_one_line(capsys):
    import pytest

    bs = load_tool("bench_serve")
    for argv, says in ((["--capacity-share", "0"], "--capacity-share"),
                       (["--spill-gib", "-1"], "--spill-gib"),
                       (["--spill-prefixes"], "give --spill-gib"),
                       (["--tp", "2", "--spill-gib", "1"], "--tp runs take neither")):
        with pytest.raises(SystemExit) as e:
            bs.main([*QUICK, *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and says in err


def test_the_grpo_workload_serves_n_continuations_a_prompt_and_checks_them(tmp_path, capsys):
    """--workload grpo: every prompt's n continuations (sampled at temperature 1) are served
    and the agreement check reads them; no prefix-cache-off side (every continuation forks
    the prompt), and on the CPU no side without shared-prefix attention (a CUDA kernel)."""
    out = tmp_path / "g.json"
    assert load_tool("bench_serve").main([*QUICK, "--workload", "grpo", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    w = res["workload"]
    assert w["name"] == "grpo" and w["n"] == 4
    r = res["cellcache"]
    assert r["tokens_out"] == w["requests"] * w["n"] * w["new_tokens"]
    assert r["computed_tokens"] == w["requests"] * w["prompt_len"] == w["ideal_computed"]
    assert "cellcache_off" not in res and "cellcache_ungrouped" not in res
    assert res["agreement"]["passed"] is True
    assert [t["met"] for t in res["targets"]] == [True, True]
