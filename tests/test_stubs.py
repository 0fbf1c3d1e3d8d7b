"""The .pyi stubs beside the compiled modules must match what the modules export."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPILED = ["cellcache._table", "cellcache._views", "cellcache.cuda._launch", "cellcache.cuda._dlpack",
            "cellcache.cuda._engine"]


def test_stubs_match_the_compiled_modules():
    # one stubtest run for every module (each run pays mypy's start, ~10 s on a 2-core machine);
    # its report names the module and the symbol of every mismatch
    result = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "--mypy-config-file", str(ROOT / "pyproject.toml"),
         *COMPILED],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
