"""tools/bench_serve.py's per-step host record on the CPU (tiny model, --quick)."""

import json

from .helpers import load_tool

QUICK = ["--device", "cpu", "--model", "tiny", "--quick"]


def test_the_per_step_host_record_adds_up(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert load_tool("bench_serve").main(
        [*QUICK, "--skip", "off,staggered,hf-batch,hf-static", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["cellcache"]
    d = r["decode_host_us_distribution"]
    # the steps' own record against the profile's totals: the same mean
    assert abs(d["mean"] - r["decode_host_us_per_step_total"]) <= 0.2
    assert 0 < d["median"] <= d["p90"] <= d["max"] and 0.05 <= d["top5pct_share"] <= 1
    worst = r["decode_host_costliest"]
    assert 1 <= len(worst) <= 8 and abs(worst[0]["host_us"] - d["max"]) <= 1
    assert [w["host_us"] for w in worst] == sorted((w["host_us"] for w in worst), reverse=True)
    assert all(0 <= w["step"] < r["decode_steps"] and w["rows"] >= 1 for w in worst)
    assert len(r["gc"]["collections"]) == 3 and r["gc"]["ms"] >= 0
    assert "costliest 5% of steps" in capsys.readouterr().out
