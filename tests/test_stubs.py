"""The .pyi stubs beside the compiled modules must match what the modules export."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPILED = ["cellcache._table", "cellcache._views", "cellcache.cuda._launch", "cellcache.cuda._dlpack",
            "cellcache.cuda._engine"]


@pytest.mark.parametrize("module", COMPILED)
def test_stub_matches_module(module):
    result = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "--mypy-config-file", str(ROOT / "pyproject.toml"), module],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
