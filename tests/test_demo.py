"""The demo runs in the suite (small) and must report zero mismatches."""

import subprocess
import sys

import pytest

from cellcache import attention, demo
from cellcache.__main__ import main as cli_main


def test_demo_small_session_has_no_mismatch():
    s = demo.run(backend="host", seqs=8, steps=60, seed=3, capacity=256, progress=False)
    assert s["mismatches"] == 0
    assert s["tokens"] > 200 and s["max_error"] < demo.TOLERANCE
    assert s["forks"] + s["rewinds"] > 0 and s["finished"] + s["preempted"] > 0


def test_demo_catches_a_wrong_mask(monkeypatch):
    """If the cache's masks ignored windows, the dense check must notice."""
    real = attention.dense_attention
    monkeypatch.setattr(attention, "dense_attention",
                        lambda q, k, v, p, window: real(q, k, v, p, 0))
    s = demo.run(backend="host", seqs=8, steps=30, seed=3, capacity=256, progress=False)
    assert s["mismatches"] > 0


def test_demo_cli(capsys):
    assert demo.main(["--backend", "host", "--steps", "10", "--seqs", "4", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "0 mismatches" in out and "demo [host]: 10 steps" in out
    assert demo.main(["--backend", "host", "--steps", "5", "--seqs", "4", "--quiet", "--json"]) == 0
    assert '"mismatches": 0' in capsys.readouterr().out


def test_cli_help_and_errors():
    r = subprocess.run([sys.executable, "-m", "cellcache", "demo", "--help"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "--seqs" in r.stdout and "--backend" in r.stdout
    assert cli_main(["nonsense"]) == 2
    assert cli_main([]) == 2
    with pytest.raises(SystemExit) as e:
        demo.main(["--steps", "0"])
    assert e.value.code == 2
