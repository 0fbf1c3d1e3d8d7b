"""tools/results_index.py: the index of benchmarks/results is what the results make, every
result says what ran it, and new results are filed under their benchmark's name."""

import json
import re
import subprocess
import sys

import pytest

from .helpers import TOOLS, load_tool

TOOL = TOOLS / "results_index.py"
ROOT = TOOLS.parent
RESULTS = ROOT / "benchmarks" / "results"


@pytest.fixture(scope="module")
def ri():
    return load_tool("results_index")


def run(*args):
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True)


SERVE = {"benchmark": "serve-default", "date": "2026-12-03", "device": "NVIDIA H200",
         "command": "python3 tools/bench_serve.py --workload default --skip off",
         "workload": {"name": "default", "device": "cuda"},
         "cellcache": {"tokens_per_s": 40000.0, "decode_host_us_per_step_total": 100.0,
                       "decode_gpu_ms_median": 4.0},
         "hf-static": {"tokens_per_s": 8000.0}, "hf-batch": {"error": "RuntimeError: no"},
         "targets": [{"met": True, "target": "a"}, {"met": False, "target": "b"}]}


def write(folder, name, content):
    p = folder / name
    p.write_text(content if isinstance(content, str) else json.dumps(content))
    return p


# -- the committed record ---------------------------------------------------------------------
def test_the_committed_index_is_what_the_results_make(ri):
    """README.md cannot drift from the files: regenerate it with the tool after any change."""
    assert ri.main(["--check"]) == 0, "run: python3 tools/results_index.py"


def test_every_result_says_what_ran_it_and_is_named_after_its_benchmark(ri):
    files = ri.result_files(RESULTS)
    assert files and all(p.suffix in (".json", ".log") for p in files), files
    for p in files:
        row = ri.read_result(p)
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"]), p.name
        assert row["command"] != ri.UNKNOWN and row["device"] != ri.UNKNOWN, p.name
        assert row["headline"] != ri.UNKNOWN, p.name
        if p.suffix == ".json":
            assert json.loads(p.read_text())["benchmark"] == p.stem, p.name


def test_the_record_stays_small_and_holds_no_scripts():
    files = [p for p in (ROOT / "benchmarks").rglob("*") if p.is_file()]
    assert len(files) <= 32, len(files)       # one file a benchmark (its workload x model), no history
    assert not [p.name for p in files if p.suffix in (".py", ".sh", ".cu", ".patch")]


# -- the index ------------------------------------------------------------------------------
def test_a_serving_result_reads_as_its_throughput_ratios_host_and_targets(ri):
    h = ri.headline(SERVE)
    assert h.startswith("40,000 tok/s; 5.00x HF static")
    assert "generate_batch" not in h                       # a failed comparison gives no ratio
    assert "host 100 µs a decode step = 2.5% of its 4.00 ms on the GPU" in h
    assert h.endswith("targets 1/2 met")


def test_each_kind_of_result_has_its_headline(ri):
    assert ri.headline({"mutants": [], "caught": 11, "total": 12}) == "caught 11 of 12 mutants"
    tp = {"workload": {"tp": 2}, "cellcache": {"tokens_per_s": 12000.0, "step_ms_median": 11.9},
          "cellcache_vs_hf_batch": 15.5}
    assert ri.headline(tp) == "12,000 tok/s, step median 11.90 ms; 15.50x HF `generate_batch`"
    prefix = {"prefix": {"cached_tokens": 100352, "match_us": 18.85, "targets": {"match": True}}}
    assert ri.headline(prefix) == ("match of an 8K prompt over 100,352 cached tokens: 18.9 µs; "
                                   "targets 1/1 met")
    growth = {"growth": {"map": {"us": 1686.4}, "copy": {"us": 2017.4}}, "note": "one section"}
    assert ri.headline(growth) == "grow to 1 GiB: map 1,686 µs; grow to 1 GiB: copy 2,017 µs; one section"
    http = {"http": {"saturation": {"tokens_per_s": 9000.0, "ttft_ms_p50": 50.0}},
            "in_process": {"saturation": {"tokens_per_s": 10000.0, "ttft_ms_p50": 40.0}},
            "targets": {"saturation_ratio": 0.9, "saturation_ok": True,
                        "ttft_p50_gap_ms_at_half_load": 12.0, "ttft_ok": False}}
    assert ri.headline(http) == ("saturation: HTTP 9,000 tok/s, TTFT p50 50.0 ms (in process 10,000 tok/s, "
                                 "40.0 ms); saturation HTTP/in-process 0.90x (met: >= 0.9x); 50% load TTFT "
                                 "p50 gap +12.0 ms (MISSED: <= 10 ms)")
    http["in_process"]["agreement"] = {"passed": True, "noise_max": 0.4, "error_max": 0.1}
    assert ri.headline(http).endswith("(MISSED: <= 10 ms); agreement with HF passed (0.25x the noise floor)")
    soak = {"soak": {"requests": 100, "minutes": 30, "rate": 2.5, "disconnected": 7, "errors": 0,
                     "samples": [{"rss_bytes": 2**30}, {"rss_bytes": 2**30 + 2**21}]}}
    assert ri.headline(soak) == ("100 requests in 30 min at 2.50/s, 7 disconnects, 0 errors; "
                                 "server RSS 1,024 -> 1,026 MiB")
    det = {"tokens_per_s": {"normal": 100.0, "deterministic": 90.0}, "deterministic_cost": 0.1,
           "target_cost": 0.15, "sglang_published_cost": 0.34, "deterministic_runs_identical": True,
           "agreement": {"normal": {"passed": True, "noise_max": 0.5, "error_max": 0.1},
                         "deterministic": {"passed": False, "noise_max": 0.5, "error_max": 1.0}}}
    assert ri.headline(det) == ("normal 100 tok/s, deterministic 90 tok/s: 10.0% cost (target 15%, "
                                "SGLang's published 34%); deterministic runs identical; normal: "
                                "agreement with HF passed (0.20x the noise floor); deterministic: "
                                "agreement with HF FAILED (2.00x the noise floor)")
    anchor = {"engine": "vLLM", "conditions": "A800", "tokens_per_s": 17700.0}
    work = {"together": {"tokens_per_s": 23456.0}, "anchors": [anchor], "target_tokens_per_s": 50000.0,
            "agreement": {"passed": True, "noise_max": 0.3, "error_max": 0.06}}
    assert ri.headline(work) == ("23,456 output tok/s all at once; vLLM (A800) 17,700 published; "
                                 "target 50,000; agreement with HF passed (0.20x the noise floor)")
    sleep = {"cache": {"mapped_bytes": 60 * 2**30, "asleep_share": 0.0042, "wake_s_median": 0.014,
                       "wake_s_max": 0.066, "replays_equal": True},
             "generator": {"model": "m", "levels": {"2": {"freed_bytes": 2**31, "wake_s": 0.3241,
                                                           "outputs_equal": False}}},
             "targets": {"asleep_share": 0.01, "wake_s": 0.5}}
    assert ri.headline(sleep) == ("60.0 GiB cache asleep holds 0.42%, wake 14 ms median / 66 ms max, "
                                  "graph replay equal; m level 2: freed 2.00 GiB, wake 0.324 s, "
                                  "outputs DIFFER; targets: asleep <= 1%, wake <= 0.5 s")
    spill = {"speedup": 0.9, "tokens_per_s": {"spill": 900.0, "recompute": 1000.0},
             "workload": {"name": "trt-1000", "requests": 256, "share": 0.5},
             "bandwidth": {"spill_share": 0.02, "restore_share": 0.6}, "targets": {"speedup": 1.5},
             "agreement": {"passed": True, "noise_max": 0.3, "error_max": 0.06}}
    assert ri.headline(spill) == ("trt-1000 x256, cache 0.5 of the working set: spill 900 tok/s vs "
                                  "recompute 1,000 = 0.90x (target 1.5x); copies at 2% (spill) and "
                                  "60% (restore) of a pinned copy; agreement with HF passed (0.20x the "
                                  "noise floor)")
    kv8 = {"cells_per_gib": {"ratio": 2.0},
           "attention": [{"case": "decode 256 x 4096, 32q/8kv d128", "heads": [32, 8, 128], "speedup": 1.95,
                          "float8_e4m3fn": {"ms": 0.5, "kernel_mean_error": 2e-4},
                          "flashinfer e4m3 (per-head scales)": {"ms": 1.2, "kernel_mean_error": 5e-4},
                          "flashinfer e4m3 (per-tensor scale)": {"ms": 1.0, "kernel_mean_error": 3e-4}}]}
    assert ri.headline(kv8) == ("8-bit K/V: 2.0x the cells a GiB; decode 256 x 4096 d128: 1.95x the "
                                "16-bit kernel; 2.00x faster than FlashInfer's e4m3 path, arithmetic "
                                "error (mean) 2.0e-04 vs its 3.0e-04")
    cascade = {"benchmark": "cascade",
               "cases": [{"case": "shared prompt 512 x 2048, 14q/2kv d64", "heads": [14, 2, 64],
                          "on_ms": 0.083, "off_ms": 0.186, "on_vs_off": 0.446}]}
    assert ri.headline(cascade) == ("shared prompt 512 x 2048 (14q/2kv d64): grouped 0.083 ms vs "
                                    "0.186 ms a layer = 0.45x")
    grouped = {"workload": {"name": "grpo"},
               "cellcache": {"tokens_per_s": 110.0, "decode_host_us_per_step_total": 50.0,
                             "decode_gpu_ms_median": 4.0},
               "cellcache_ungrouped": {"tokens_per_s": 100.0, "decode_gpu_ms_median": 5.0}}
    assert ri.headline(grouped) == ("110 tok/s; 1.10x without shared-prefix attention; host 50 µs a "
                                    "decode step = 1.2% of its 4.00 ms on the GPU; decode step 0.80x "
                                    "without shared-prefix attention")
    attn = {"attention": {"cases": [
        {"case": "prefill 16 x 512 causal, 14q/2kv d64 (x)", "tensor_core_ms": 0.08,
         "flashinfer_best_ms": 0.1, "sm90a_ms": 0.05},
        {"case": "decode 256 x 4096, 32q/8kv d128", "tensor_core_ms": 1.1, "flashinfer_best_ms": 1.0}]}}
    assert ri.headline(attn) == ("prefill 16 x 512 causal, 14q/2kv d64: 0.080 ms (0.80x FlashInfer's best), "
                                 "sm_90a 0.050 ms (0.50x); decode 256 x 4096, 32q/8kv d128: 1.100 ms (1.10x "
                                 "FlashInfer's best)")
    assert ri.headline({"date": "2026-01-01"}) == ri.UNKNOWN


def test_the_table_has_a_row_per_file_and_says_unknown_for_what_a_file_lacks(ri, tmp_path):
    write(tmp_path, "serve-default.json", SERVE)
    write(tmp_path, "old.json", {"mutants": [], "caught": 1, "total": 1, "command": "a | b"})
    write(tmp_path, "gpu-tests.log", "# 2026-12-03, NVIDIA H200: python3 -m pytest -q tests/gpu\n"
                                     "....\n\n===== 4 passed in 1.00s =====\n\n")
    text = ri.render(tmp_path)
    rows = [ln for ln in text.splitlines() if ln.startswith("| [")]
    assert [r.split("]")[0] for r in rows] == ["| [gpu-tests", "| [old", "| [serve-default"]
    assert rows[0] == ("| [gpu-tests](gpu-tests.log) | 2026-12-03 | NVIDIA H200 | "
                       "`python3 -m pytest -q tests/gpu` | 4 passed in 1.00s |")
    assert rows[1] == "| [old](old.json) | unknown | unknown | `a \\| b` | caught 1 of 1 mutants |"
    assert rows[2].startswith("| [serve-default](serve-default.json) | 2026-12-03 | NVIDIA H200 | "
                              "`python3 tools/bench_serve.py --workload default --skip off` | 40,000 tok/s")


def test_check_fails_on_a_stale_index_and_the_default_rewrites_it(ri, tmp_path):
    write(tmp_path, "serve-default.json", SERVE)
    assert ri.main(["--results", str(tmp_path), "--check"]) == 1          # no index yet
    assert not (tmp_path / "README.md").exists()
    assert ri.main(["--results", str(tmp_path)]) == 0
    assert ri.main(["--results", str(tmp_path), "--check"]) == 0
    write(tmp_path, "serve-default.json", {**SERVE, "date": "2026-12-04"})
    assert ri.main(["--results", str(tmp_path), "--check"]) == 1


def test_add_files_a_tool_json_under_its_benchmark_and_rewrites_the_index(ri, tmp_path):
    results, out = tmp_path / "results", tmp_path / "out"
    results.mkdir()
    out.mkdir()
    write(results, "serve-default.json", {**SERVE, "date": "2026-11-01"}).chmod(0o444)
    new = write(out, "serve.json", SERVE)
    new.chmod(0o444)                                      # as a device machine's files come back
    log = write(out, "gpu-tests.log", "# 2026-12-03, NVIDIA H200: pytest\n1 passed\n")
    assert ri.main(["--results", str(results), "--add", str(new), str(log)]) == 0
    assert json.loads((results / "serve-default.json").read_text()) == SERVE     # replaced
    assert (results / "gpu-tests.log").exists()
    assert ri.main(["--results", str(results), "--check"]) == 0
    assert "| 2026-12-03 |" in (results / "README.md").read_text()


@pytest.mark.parametrize("name,content", [
    ("x.json", {"date": "2026-12-03"}),                      # no benchmark field
    ("x.json", {"benchmark": "../up", "date": "2026-12-03"}),
    ("x.json", "{not json"),
    ("x.log", "no header\n1 passed\n"),
    ("x.txt", "anything"),
])
def test_add_refuses_what_is_not_a_result_and_changes_nothing(ri, tmp_path, name, content, capsys):
    results = tmp_path / "results"
    results.mkdir()
    write(results, "serve-default.json", SERVE)
    before = {p.name: p.read_text() for p in results.iterdir()}
    bad = write(tmp_path, name, content)
    assert ri.main(["--results", str(results), "--add", str(bad)]) == 2
    assert {p.name: p.read_text() for p in results.iterdir()} == before
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("results_index: ")


def test_an_unreadable_result_in_the_folder_is_an_error_not_a_row(ri, tmp_path, capsys):
    write(tmp_path, "broken.json", "[1, 2]")
    assert ri.main(["--results", str(tmp_path)]) == 2
    assert "broken.json: a result is a JSON object" in capsys.readouterr().err
    assert not (tmp_path / "README.md").exists()


# -- what the tools write ---------------------------------------------------------------------
def test_a_tools_record_opens_with_what_the_index_reads():
    common = load_tool("_common")
    words = ["python3", "tools/bench.py", "--section", "gpu", "--json", "a b.json"]
    r = common.run_record("gpu-masks", words, "cpu")
    assert list(r) == ["benchmark", "date", "command", "device"]
    assert r["benchmark"] == "gpu-masks" and re.fullmatch(r"\d{4}-\d{2}-\d{2}", r["date"])
    assert r["command"] == "python3 tools/bench.py --section gpu --json 'a b.json'"
    assert r["device"].endswith(" cores") and common.RESULTS == RESULTS


def test_the_tools_name_their_results_after_the_benchmark():
    from types import SimpleNamespace

    bench = load_tool("bench")
    assert [bench.result_name(s) for s in ("table", "gpu", "all-gpu", "attention")] == [
        "table", "gpu-masks", "gpu-all", "attention"]
    assert bench.result_name("attention", "256 x 640") == "attention-some"   # not the sweep's file
    name = load_tool("bench_serve").result_name
    plain = dict(workload="default", compile=False, attention="auto", arrival="staggered",
                 model="qwen2-0.5b", device="cuda", quick=False, capacity_share=1.0, spill_gib=0.0,
                 spill_prefixes=False, native=False)
    assert name(SimpleNamespace(**plain)) == "serve-default"
    assert name(SimpleNamespace(**{**plain, "native": True})) == "serve-default-native"
    assert name(SimpleNamespace(**{**plain, "arrival": "none"})) == "serve-default"
    assert name(SimpleNamespace(**{**plain, "compile": True})) == "serve-default-compile"
    assert name(SimpleNamespace(**{**plain, "arrival": "poisson"})) == "serve-default-poisson"
    assert name(SimpleNamespace(**{**plain, "workload": "chat"})) == "serve-chat"
    assert name(SimpleNamespace(**{**plain, "attention": "flashinfer"})) == "serve-default-flashinfer"
    assert name(SimpleNamespace(**{**plain, "model": "tiny", "device": "cpu", "quick": True})) == \
        "serve-default-tiny-cpu-quick"                   # a smoke run never lands on a GPU result
    assert name(SimpleNamespace(**{**plain, "model": "qwen2-7b"}), world=2) == "serve-tp2-qwen2-7b"
    chat = {**plain, "workload": "chat", "capacity_share": 0.25, "spill_gib": 8.0}
    assert name(SimpleNamespace(**chat)) == "serve-chat-small-spill"
    assert name(SimpleNamespace(**{**chat, "spill_prefixes": True})) == "serve-chat-small-l2"
    # every file kept here is one the tools would write under the same name
    kept = {p.stem for p in RESULTS.glob("*.json")}
    assert {"serve-default", "serve-default-compile", "serve-default-native", "gpu-masks",
            "attention"} <= kept


# -- the command line -------------------------------------------------------------------------
def test_help_documents_the_options():
    r = run("--help")
    assert r.returncode == 0
    assert "--check" in r.stdout and "--add FILE" in r.stdout and "--results DIR" in r.stdout


@pytest.mark.parametrize("args", [["--bogus"], ["--check", "--add", "x.json"], ["--add"],
                                  ["--results", "/nonexistent/folder"], ["--add", "/nonexistent.json"]])
def test_bad_usage_exits_2_with_one_line(args):
    r = run(*args)
    assert r.returncode == 2, r
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("results_index: error:"), r.stderr
    assert not r.stdout


def test_bench_refuses_a_case_filter_outside_the_attention_section(tmp_path, capsys):
    bench = load_tool("bench")
    out = tmp_path / "t.json"
    with pytest.raises(SystemExit) as e:
        bench.main(["--section", "table", "--case", "decode", "--json", str(out)])
    assert e.value.code == 2 and not out.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--case selects cases of the attention section" in err[0]


def test_bench_refuses_a_baseline_ptx_outside_the_attention_section_or_unreadable(tmp_path, capsys):
    bench = load_tool("bench")
    out = tmp_path / "t.json"
    ptx = tmp_path / "old.ptx"
    ptx.write_text("// a PTX")
    for argv, said in ((["--section", "table", "--baseline-ptx", str(ptx)],
                        "--baseline-ptx is for the attention"),
                       (["--section", "attention", "--baseline-ptx", str(tmp_path / "none.ptx")],
                        "--baseline-ptx: cannot read")):
        with pytest.raises(SystemExit) as e:
            bench.main([*argv, "--json", str(out)])
        assert e.value.code == 2 and not out.exists()
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err
