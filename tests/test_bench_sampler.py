"""tools/bench_sampler.py on the CPU: a smoke run writes every case and the comparison of the
two random paths, and its usage errors are one line and exit 2."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from .helpers import load_tool  # noqa: E402


@pytest.fixture(scope="module")
def bs():
    return load_tool("bench_sampler")


def test_a_smoke_run_times_every_case(bs, tmp_path, capsys):
    out = tmp_path / "s.json"
    assert bs.main(["--device", "cpu", "--rows", "8", "--vocab", "1000", "--reps", "2",
                    "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["benchmark"] == "sampler-cpu" and res["rows"] == 8 and res["vocab"] == 1000
    assert set(res["cases"]) == {"greedy", "temperature, fused draw", "temperature, torch's ops",
                                 "temperature and top-p 0.9", "fused, steady decode specs"}
    assert all(c["ms_median"] >= c["ms_min"] > 0 for c in res["cases"].values())
    # the host's share: the launch alone, within the whole step on the CPU
    assert all(0 < c["host_us_median"] <= 1e3 * c["ms_median"] * 1.5 for c in res["cases"].values())
    assert res["passed"] is True and res["fused_vs_torch_differing_slots"] == 0
    printed = capsys.readouterr().out
    assert "ms a step" in printed and "host us" in printed and "0 of 8 slots differ (ok)" in printed


def test_draws_that_differ_fail_the_run(bs, tmp_path, monkeypatch, capsys):
    """A fused path drawing other ids than torch's (here: one that draws id 0) exits 1."""
    import torch

    from cellcache.generate import sampler as sampler_mod

    real = sampler_mod.Sampler._draw

    def skewed(self, x, *a, **k):
        tok = real(self, x, *a, **k)
        return torch.zeros_like(tok) if sampler_mod.FUSED_DRAW else tok

    monkeypatch.setattr(sampler_mod.Sampler, "_draw", skewed)
    out = tmp_path / "s.json"
    assert bs.main(["--device", "cpu", "--rows", "8", "--vocab", "1000", "--reps", "1",
                    "--json", str(out)]) == 1
    assert json.loads(out.read_text())["passed"] is False
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("argv,says", [
    (["--temperature", "0"], "--temperature"),
    (["--rows", "0"], "--rows"),
    (["--device", "tpu"], "--device"),
])
def test_usage_errors_are_one_line_and_exit_2(bs, argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        bs.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]
