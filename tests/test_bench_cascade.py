"""tools/bench_cascade.py off the GPU: its usage errors and the exit code that says it needs
a GPU (the timings themselves: benchmarks/results/cascade.json, from the H200)."""

from __future__ import annotations

import pytest

from .helpers import load_tool


@pytest.fixture(scope="module")
def bc():
    return load_tool("bench_cascade")


@pytest.mark.parametrize("argv,says", [
    (["--layers", "0"], "--layers"),
    (["--reps", "2"], "--reps"),
    (["--only", "x"], "--only"),
    (["--only", "9"], "--only"),
    (["--nope"], "--nope"),
])
def test_bad_usage_is_one_line_and_exit_2(bc, argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        bc.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and says in err


def test_without_a_gpu_it_says_so_and_exits_3(bc, capsys, monkeypatch, tmp_path):
    import _common

    monkeypatch.setattr(_common, "cuda_usable", lambda: (False, "no CUDA driver"))
    out = tmp_path / "c.json"
    assert bc.main(["--json", str(out)]) == 3
    assert "needs a GPU" in capsys.readouterr().out and not out.exists()
