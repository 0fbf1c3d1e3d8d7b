"""One schema for the step buffers (cellcache.buffers): the README's table is rendered from
it, and every backend's buffers, names and byte counts are what it says."""

from pathlib import Path

import numpy as np
import pytest

from cellcache import CacheConfig, HostCellCache, LayerConfig
from cellcache.buffers import buffer_names, readme_table, step_buffer_bytes, step_buffers

README = Path(__file__).resolve().parents[1] / "README.md"

CONFIGS = [
    dict(mask_format="bool"),
    dict(mask_format="bits"),
    dict(mask_format="bits", paged=True, max_kv=100),
    dict(mask_format="none", paged=True),
]


def test_readme_table_is_rendered_from_the_schema():
    assert readme_table() in README.read_text()


@pytest.mark.parametrize("extra", CONFIGS)
def test_host_buffers_follow_the_schema(extra):
    cfg = CacheConfig(capacity=70, layers=[LayerConfig(2, 8), LayerConfig(2, 8, window=5)],
                      max_write=6, dtype="float32", **extra)
    cache = HostCellCache(cfg)
    assert cache.buffer_names == buffer_names(cfg)
    specs = step_buffers(cfg)
    assert len({s.name for s in specs}) == len(specs)
    for s in specs:
        buf = cache.buffer(s.name)
        assert buf.shape == s.shape and buf.dtype == s.dtype, s.name
        assert np.all(buf == s.fill), s.name
    assert cache.metrics()["step_buffer_bytes"] == step_buffer_bytes(cfg) == sum(
        cache.buffer(s.name).nbytes for s in specs)
    assert {s.window for s in specs if s.role == "mask"} == (
        set() if cfg.mask_format == "none" else set(cfg.windows))
