"""tools/bench_kv8.py on the CPU: a quick serving run of both sides in the same pool bytes
(the 8-bit side with twice the cells, in agreement with HF float32 over K/V rounded to
e4m3), and its usage errors."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from .helpers import load_tool  # noqa: E402


@pytest.fixture(scope="module")
def bk():
    return load_tool("bench_kv8")


def test_a_quick_serving_run_gives_the_8bit_side_twice_the_cells(bk, tmp_path, capsys):
    out = tmp_path / "kv8.json"
    code = bk.main(["--device", "cpu", "--skip", "attention", "--model", "llama-tiny", "--quick",
                    "--requests", "16", "--json", str(out)])
    assert code == 0
    res = json.loads(out.read_text())
    runs = res["serve"]["runs"]
    assert runs["fp8"]["capacity"] == 2 * runs["bfloat16"]["capacity"]
    assert runs["fp8"]["bytes_per_cell"] * 2 == runs["bfloat16"]["bytes_per_cell"]
    assert all(r["median_tokens_per_s"] > 0 for r in runs.values())
    assert res["serve"]["agreement"]["passed"] is True and res["cells_per_gib"]["ratio"] == 2.0
    text = capsys.readouterr().out
    assert "e4m3 / bf16:" in text and "agreement (e4m3 side): PASS" in text


@pytest.mark.parametrize("argv,says", [
    (["--skip", "attention", "--share", "0"], "--share"),
    (["--skip", "attention", "--kv-gib", "-1"], "--kv-gib"),
    (["--skip", "nope"], "--skip"),
    (["--skip", "attention", "--requests", "0"], "--requests"),
    (["--skip", "attention", "--model", "no-such-model"], "--model"),
    ([], "attention section needs --device cuda"),
])
def test_bad_usage_is_one_line_and_exit_2(bk, argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        bk.main(["--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and says in err
