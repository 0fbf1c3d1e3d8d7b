"""The demo (a Session through the reference consumer) in the suite, small, on every view;
the checker catches wrong masks, wrong views and a visible sink; the CLI's usage errors."""

import subprocess
import sys

import pytest

from cellcache import attention, demo
from cellcache import errors as cc_errors
from cellcache.__main__ import main as cli_main
from cellcache.host import HostCellCache


@pytest.mark.parametrize("view", ["bool", "bits", "paged"])
@pytest.mark.parametrize("pad", [False, True], ids=["unpadded", "padded"])
def test_demo_small_session_has_no_mismatch(view, pad):
    s = demo.run(backend="host", seqs=8, steps=60, seed=3, capacity=256, view=view, pad=pad,
                 progress=False)
    assert s["mismatches"] == 0
    assert s["tokens"] > 200 and s["max_error"] < demo.TOLERANCE
    assert s["forks"] + s["rewinds"] > 0 and s["finished"] + s["preempted"] > 0
    if pad:
        assert set(s["per_bucket"]) <= {1, 2, 4, 8, 16, 32, 64} and len(s["per_bucket"]) > 1


def test_demo_catches_a_wrong_mask(monkeypatch):
    """If the cache's masks ignored windows, the dense check must notice."""
    real = attention.dense_attention
    monkeypatch.setattr(attention, "dense_attention",
                        lambda q, k, v, p, window: real(q, k, v, p, 0))
    s = demo.run(backend="host", seqs=8, steps=30, seed=3, capacity=256, progress=False)
    assert s["mismatches"] > 0


def test_demo_catches_a_wrong_paged_view(monkeypatch):
    """A paged view whose lists lost their last entry must be caught."""
    real = HostCellCache._write_step

    def broken(self, width, pad_to, read_len, stream):
        out = real(self, width, pad_to, read_len, stream)
        kv = self._buffers["kv_indptr"]
        self._buffers["kv_indices"][kv[0]] = self._buffers["kv_indices"][kv[1] - 1]
        return out

    monkeypatch.setattr(HostCellCache, "_write_step", broken)
    s = demo.run(backend="host", seqs=8, steps=30, seed=3, capacity=256, view="paged", progress=False)
    assert s["mismatches"] > 0


def test_demo_catches_a_sink_that_is_a_live_cell(monkeypatch):
    """Padding rows write NaN K/V at their cells: were the sink a live cell, outputs turn NaN."""
    real = HostCellCache._write_step

    def leaky(self, width, pad_to, read_len, stream):
        out = real(self, width, pad_to, read_len, stream)
        self._buffers["cells"][width:pad_to] = self._cells[0]
        return out

    monkeypatch.setattr(HostCellCache, "_write_step", leaky)
    s = demo.run(backend="host", seqs=8, steps=30, seed=3, capacity=256, pad=True, progress=False)
    assert s["mismatches"] > 0


def test_demo_cli(capsys):
    assert demo.main(["--backend", "host", "--steps", "10", "--seqs", "4", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "0 mismatches" in out and "demo [host, bool]: 10 steps" in out
    assert demo.main(["--backend", "host", "--steps", "5", "--seqs", "4", "--quiet", "--json"]) == 0
    assert '"mismatches": 0' in capsys.readouterr().out


@pytest.mark.parametrize("args,fragment", [
    (["--capacity", "0"], "argument --capacity: 0 is outside [64, 16777216]"),
    (["--capacity", "10"], "argument --capacity: 10 is outside"),
    (["--capacity", "-1"], "argument --capacity: -1 is outside"),
    (["--seqs", "2000000"], "argument --seqs: 2000000 is outside [1, 65536]"),
    (["--seed", "-1"], "argument --seed: -1 is outside"),
    (["--steps", "0"], "argument --steps: 0 is outside"),
    (["--steps", "x"], "argument --steps: 'x' is not an int"),
    (["--view", "dense"], "argument --view: invalid choice"),
    (["--nonsense"], "unrecognized arguments: --nonsense"),
])
def test_demo_usage_errors_are_one_line_and_exit_2(args, fragment):
    r = subprocess.run([sys.executable, "-m", "cellcache", "demo", *args],
                       capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and lines[0].startswith("cellcache demo: error:")
    assert r.stdout == ""


def test_cli_help_and_errors(capsys):
    r = subprocess.run([sys.executable, "-m", "cellcache", "demo", "--help"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "--seqs" in r.stdout and "--backend" in r.stdout
    assert cli_main(["nonsense"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "cellcache: error: unknown command 'nonsense' (see --help)"
    assert cli_main([]) == 2
    assert cli_main(["--help"]) == 0


@pytest.mark.parametrize("capacity", [64, 100, 128])
def test_demo_paged_view_runs_at_any_capacity(capacity):
    """The paged view's max_kv is sized for the session's steps (at most MAX_WRITE runs of a
    sequence's length each), so small capacities no longer end in StepTooLarge."""
    r = subprocess.run([sys.executable, "-m", "cellcache", "demo", "--backend", "host", "--view",
                        "paged", "--capacity", str(capacity), "--steps", "150", "--quiet"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "0 mismatches" in r.stdout and r.stderr == ""


@pytest.mark.parametrize("error", [
    lambda: cc_errors.StepTooLarge("the step's kv lists need 349 entries"),
    lambda: cc_errors.OutOfMemory("could not allocate 4 GiB for the step buffer mask_w0"),
    lambda: cc_errors.CudaError("the CUDA backend is not usable here: no CUDA device"),
    lambda: cc_errors.InvalidState("anything else the cache refuses"),
], ids=["StepTooLarge", "OutOfMemory", "CudaError", "InvalidState"])
def test_demo_cli_turns_any_cache_error_into_one_line_and_exit_2(monkeypatch, capsys, error):
    def refuse(*args, **kwargs):
        raise error()

    monkeypatch.setattr(demo, "run", refuse)
    assert demo.main(["--backend", "host", "--quiet"]) == 2
    out, err = capsys.readouterr()
    exc = error()
    assert out == "" and err == f"cellcache demo: error: {type(exc).__name__}: {exc}\n"


@pytest.mark.parametrize("command", ["demo", "generate"])
def test_cli_turns_an_uncaught_cache_error_into_one_line_and_exit_2(monkeypatch, capsys, command):
    """The safety net of ``python -m cellcache``: whatever a command lets through as a
    CellCacheError (generate --device cuda without a driver, say) is one line, exit 2."""
    import types

    def main(argv):
        raise cc_errors.CudaError("the CUDA backend is not usable here: no CUDA device")

    monkeypatch.setitem(sys.modules, f"cellcache.{command}", types.SimpleNamespace(main=main))
    assert cli_main([command, "--anything"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"cellcache {command}: error: CudaError: the CUDA backend is not "
                                 "usable here: no CUDA device\n")


@pytest.mark.parametrize("command", ["demo", "generate"])
def test_cli_turns_ctrl_c_into_one_line_and_exit_130(monkeypatch, capsys, command):
    """Ctrl-C where a command does not catch it itself (demo's run, generate loading its model)
    is one line and exit code 130, never a traceback."""
    import types

    def main(argv):
        raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, f"cellcache.{command}", types.SimpleNamespace(main=main))
    assert cli_main([command]) == 130
    assert capsys.readouterr() == ("", f"cellcache {command}: interrupted\n")


def test_demo_into_a_closed_pipe_exits_141_without_a_traceback():
    """``cellcache demo --json | head -c1``: the reader is gone before the summary is out."""
    proc = subprocess.Popen([sys.executable, "-m", "cellcache", "demo", "--backend", "host", "--steps", "3",
                             "--seqs", "2", "--json", "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.close()
    err = proc.stderr.read() if proc.stderr is not None else ""
    assert proc.wait(timeout=60) == 141 and err == ""
