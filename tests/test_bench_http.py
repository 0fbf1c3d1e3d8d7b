"""tools/bench_http.py on the CPU: a tiny model, a few requests, in process and over HTTP side
by side; bad usage is one line and exit 2. (The soak mode shares the HTTP client and the
summaries with this run; a soak of seconds takes a server start of its own, which the suite's
time budget leaves out.)"""

from __future__ import annotations

import json

import pytest

from tests.helpers import load_tool
from tests.helpers_text import save_model_and_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_and_tokenizer(tmp_path_factory.mktemp("bench-http") / "tiny", "bytelevel")


SMALL = ["--device", "cpu", "--dtype", "float32", "--requests", "4", "--prompt-len", "8",
         "--max-tokens", "4", "--capacity", "1024", "--clients", "1"]


def test_side_by_side(model_dir, tmp_path, capsys):
    out = tmp_path / "h.json"
    assert load_tool("bench_http").main(["--model", str(model_dir), *SMALL, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["benchmark"] == "http" and res["command"].startswith("python3 tools/bench_http.py --model")
    for where in ("in_process", "http"):
        for run in ("saturation", "load_0.5"):
            r = res[where][run]
            assert r["tokens"] == 4 * 4 and r["tokens_per_s"] > 0, (where, run, r)
            assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_p99"] and 0 < r["itl_ms_p50"] <= r["itl_ms_p99"]
    assert res["http"]["saturation"]["errors"] == 0
    # the configuration served, checked end to end in process (float32: against the reference)
    agree = res["in_process"]["agreement"]
    assert agree["passed"] is True and agree["rows"] > 0 and agree["requests"] == 4, agree
    assert res["targets"]["saturation_ratio"] > 0 and "ttft_p50_gap_ms_at_half_load" in res["targets"]
    # the TTFT split (the server's /metrics over the run): the engine's own mean within the
    # front end's (handler to first chunk), within the client's
    for run in ("saturation", "load_0.5"):
        r = res["http"][run]
        assert 0 < r["engine_ttft_ms_mean"] < r["front_end_ttft_ms_mean"] < r["ttft_ms_mean"], (run, r)
    split = res["targets"]["ttft_mean_split_at_half_load"]
    assert split["client_ms"] == pytest.approx(split["engine_ms"] + split["transport_ms"])
    assert split["client_ms"] == pytest.approx(
        split["engine_ms"] + split["pipe_and_loop_ms"] + split["client_and_http_ms"])
    assert split["transport_ms"] > 0 and split["in_process_ms"] > 0
    # how busy each side's loop was: the server's /metrics, the client processes' own probes
    for run in ("saturation", "load_0.5"):
        r = res["http"][run]
        assert r["server_lag_ms_mean"] >= 0 and r["client_lag_ms_mean"] >= 0, (run, r)
    assert split["server_lag_ms"] == res["http"]["load_0.5"]["server_lag_ms_mean"]
    printed = capsys.readouterr().out
    assert "saturation: HTTP / in-process throughput" in printed and "50% load: TTFT p50" in printed
    assert "50% load: TTFT mean over HTTP" in printed and "pipe and front end loop" in printed
    assert "loop lag" in printed and "end-to-end agreement of the configuration served" in printed


def test_the_lean_client_reads_the_same_streams(model_dir, tmp_path):
    """``--client httpx``: the SSE lines read and parsed without the openai client; every
    request's tokens arrive, and the record says which client ran."""
    out = tmp_path / "h.json"
    assert load_tool("bench_http").main(["--model", str(model_dir), *SMALL, "--client", "httpx",
                                         "--skip-inprocess", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["client"] == "httpx" and "in_process" not in res
    for run in ("saturation", "load_0.5"):
        r = res["http"][run]
        assert r["tokens"] == 4 * 4 and r["errors"] == 0 and 0 < r["ttft_ms_p50"], (run, r)
        assert 0 < r["engine_ttft_ms_mean"] < r["front_end_ttft_ms_mean"] < r["ttft_ms_mean"], (run, r)


@pytest.mark.parametrize("argv,says", [
    (["--random", "tiny", "--loads", "0"], "--loads"),
    (["--random", "tiny", "--loads", "x"], "--loads"),
    (["--random", "nope"], "--random"),
    (["--model", "/nonexistent"], "--model"),
    (["--random", "tiny", "--soak", "-1"], "--soak"),
    (["--random", "tiny", "--disconnect", "2"], "--disconnect"),
    (["--random", "tiny", "--sample-every", "inf"], "--sample-every"),   # the sampler thread died
    (["--random", "tiny", "--sample-every", "nan"], "--sample-every"),
    (["--requests", "4"], "--model"),
    (["--random", "tiny", "--client", "curl"], "--client"),
])
def test_bad_usage_is_one_line_and_exit_2(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        load_tool("bench_http").main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and says in err, err
