"""The ``cython`` mark: the test modules whose subject is the compiled code (the cell table,
the views, the step engine's host side, DLPack) or that drive it hardest through the
caches (state machines, growth, refusals, threads, the prefix tree, the model-free
scheduler). tools/test.sh runs them a second time against a bounds-checked build
(``-m cython``); every test runs in the first pass."""

from __future__ import annotations

from pathlib import Path

import pytest

CYTHON = {
    "test_buckets", "test_buffers", "test_cache_machine", "test_config", "test_copy_growth",
    "test_cuda_host_side", "test_demo", "test_growth_modes", "test_host_buffers",
    "test_host_growth", "test_lifetime", "test_memory_limits", "test_prefix",
    "test_prefix_eviction", "test_prefix_lend", "test_prefix_machine", "test_refusals",
    "test_registry", "test_rules", "test_scheduler", "test_scheduler_admission",
    "test_scheduler_fakes", "test_scheduler_rules", "test_scheduler_steady", "test_step_protocol",
    "test_stubs", "test_table_machine", "test_threads",
}

#: what in those modules is not about compiled code: the PTX rebuilds (NVRTC, minutes)
NOT_CYTHON = ("ptx",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).stem in CYTHON and not any(w in item.name for w in NOT_CYTHON):
            item.add_marker(pytest.mark.cython)
