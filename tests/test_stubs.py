"""The .pyi stubs beside the compiled modules must match what the modules export."""

import subprocess
import sys

import pytest

COMPILED = ["cellcache._table", "cellcache._driver"]


@pytest.mark.parametrize("module", COMPILED)
def test_stub_matches_module(module):
    result = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", module],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
