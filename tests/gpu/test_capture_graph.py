"""tools/capture_graph.py on the GPU: zero mismatches, captures = 1 + growths."""

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "capture_graph.py"
spec = importlib.util.spec_from_file_location("capture_graph", TOOL)
capture_graph = importlib.util.module_from_spec(spec)
spec.loader.exec_module(capture_graph)


@pytest.mark.parametrize("use_torch", [False, True], ids=["driver", "torch"])
def test_capture_graph_small_session(use_torch):
    if use_torch:
        pytest.importorskip("torch")
    s = capture_graph.run(seqs=16, steps=80, seed=2, width=16, use_torch=use_torch,
                          capacity=2048, progress=False)
    assert s["mismatches"] == 0
    assert s["captures"] == 1 + s["growths"] and s["growths"] >= 1
    assert s["graph_steps"] >= 10 and s["eager_steps"] >= 10
    assert s["max_error"] < capture_graph.TOLERANCE
