"""tools/profile_step.py without a GPU: --help, usage errors, and the one-line no-GPU exit."""

import subprocess
import sys

import pytest

from .helpers import TOOLS, load_tool

TOOL = TOOLS / "profile_step.py"


def test_help_names_the_decode_mode():
    r = subprocess.run([sys.executable, str(TOOL), "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    for flag in ("--width", "--read-len", "--max-seqs", "--steps", "--decode"):
        assert flag in r.stdout


@pytest.mark.parametrize("args", [[], ["--decode", "--width", "256", "--max-seqs", "528"]])
def test_no_gpu_message_and_exit_code(args, capsys):
    mod = load_tool("profile_step")
    code = mod.main(args, probe=lambda: (False, "no CUDA driver or no CUDA device"))
    out = capsys.readouterr().out.strip().splitlines()
    assert code == mod.NO_GPU_EXIT == 3
    assert out == ["profile_step: no CUDA driver or no CUDA device; this tool needs a GPU (exit 3)"]


@pytest.mark.parametrize("args, says", [
    (["--decode", "--width", "300", "--max-seqs", "264"], "--width <= --max-seqs"),
    (["--width", "0"], "--width"), (["--format", "dense"], "--format")])
def test_bad_arguments_exit_2_with_one_line(args, says):
    r = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("profile_step: error:") and says in r.stderr
