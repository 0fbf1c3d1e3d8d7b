"""tools/capture_graph.py without a GPU: --help and the one-line no-GPU exit."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "capture_graph.py"


def load():
    spec = importlib.util.spec_from_file_location("capture_graph", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_help():
    r = subprocess.run([sys.executable, str(TOOL), "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    for flag in ("--seqs", "--steps", "--seed", "--torch"):
        assert flag in r.stdout


def test_no_gpu_message_and_exit_code(capsys):
    mod = load()
    code = mod.main(["--steps", "5"], probe=lambda: (False, "no CUDA driver or no CUDA device"))
    out = capsys.readouterr().out.strip().splitlines()
    assert code == mod.NO_GPU_EXIT == 3
    assert out == ["capture_graph: no CUDA driver or no CUDA device; this demo needs a GPU (exit 3)"]


def test_bad_arguments_exit_2():
    mod = load()
    with pytest.raises(SystemExit) as e:
        mod.main(["--seqs", "8"], probe=lambda: (True, ""))
    assert e.value.code == 2
