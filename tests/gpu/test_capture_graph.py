"""tools/capture_graph.py on the GPU: every step by graph replay, captures == buckets used
(growth causes none), zero mismatches, in both modes and both attentions."""

import pytest

from ..helpers import load_tool


@pytest.mark.parametrize("use_torch,attention", [(False, "paged"), (False, "dense"), (True, "paged")],
                         ids=["driver-paged", "driver-dense", "torch-paged"])
def test_capture_graph_small_session(use_torch, attention):
    if use_torch:
        pytest.importorskip("torch")
    mod = load_tool("capture_graph")
    s = mod.run(seqs=16, steps=150, seed=2, use_torch=use_torch, attention=attention,
                capacity=1024, progress=False)
    assert s["mismatches"] == 0 and s["max_error"] < mod.TOLERANCE
    assert s["captures"] == s["buckets_used"] >= 3 and s["growths"] >= 2
    assert s["graph_steps"] == s["steps"] and s["eager_only_steps"] == 0
