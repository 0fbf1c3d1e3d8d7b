"""tools/capture_graph.py without a GPU: --help, usage errors, and the one-line no-GPU exit."""

import subprocess
import sys

import pytest

from .helpers import TOOLS, load_tool

TOOL = TOOLS / "capture_graph.py"


def test_help():
    r = subprocess.run([sys.executable, str(TOOL), "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    for flag in ("--seqs", "--steps", "--seed", "--torch", "--buckets", "--attention"):
        assert flag in r.stdout


def test_no_gpu_message_and_exit_code(capsys):
    mod = load_tool("capture_graph")
    code = mod.main(["--steps", "5"], probe=lambda: (False, "no CUDA driver or no CUDA device"))
    out = capsys.readouterr().out.strip().splitlines()
    assert code == mod.NO_GPU_EXIT == 3
    assert out == ["capture_graph: no CUDA driver or no CUDA device; this tool needs a GPU (exit 3)"]


@pytest.mark.parametrize("args", [["--seqs", "0"], ["--steps", "-3"], ["--buckets", "8,16"],
                                  ["--attention", "flash"], ["--buckets", "x"]])
def test_bad_arguments_exit_2_with_one_line(args):
    r = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("capture_graph: error:")
