"""tools/bench_spill.py on the CPU: a quick preemption-heavy run of both sides with the
agreement check (the spill side restores what recompute computes, same tokens), and its
usage errors."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from .helpers import load_tool  # noqa: E402


@pytest.fixture(scope="module")
def bs():
    return load_tool("bench_spill")


def test_a_quick_run_restores_what_recompute_computes(bs, tmp_path, capsys):
    out = tmp_path / "spill.json"
    code = bs.main(["--device", "cpu", "--model", "llama-tiny", "--quick", "--requests", "24",
                    "--json", str(out)])
    assert code == 0
    res = json.loads(out.read_text())
    rec, sp = res["runs"]["recompute"][0], res["runs"]["spill"][0]
    assert rec["preempted"] == sp["preempted"] > 0 and rec["restored_tokens"] == 0
    assert sp["restored_tokens"] > 0
    assert sp["computed_tokens"] == rec["computed_tokens"] - sp["restored_tokens"]
    assert res["agreement"]["passed"] is True and res["bandwidth"]["spill_bytes"] > 0
    assert res["speedup"] == pytest.approx(res["tokens_per_s"]["spill"] / res["tokens_per_s"]["recompute"])
    text = capsys.readouterr().out
    assert "spill / recompute:" in text and "agreement: PASS" in text


@pytest.mark.parametrize("argv,says", [
    (["--share", "0"], "--share"),
    (["--share", "1.5"], "--share"),
    (["--spill-gib", "-1"], "--spill-gib"),
    (["--requests", "0"], "--requests"),
    (["--workload", "nope"], "--workload"),
    (["--model", "no-such-model"], "--model"),
])
def test_bad_usage_is_one_line_and_exit_2(bs, argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        bs.main(["--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and says in err
