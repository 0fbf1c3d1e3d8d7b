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


@pytest.mark.parametrize("extra", CONFIGS)
def test_torch_view_roles_come_from_the_schema(extra):
    """Every spec is reachable in a TorchView by its role (a tensor over the very buffer),
    and the view holds nothing the schema does not describe."""
    pytest.importorskip("torch")
    from cellcache.buffers import PAGED_ROLES, pool_spec
    from cellcache.torch import TorchView

    cfg = CacheConfig(capacity=70, layers=[LayerConfig(2, 8), LayerConfig(2, 8, window=5)],
                      max_write=6, dtype="float32", **extra)
    cache = HostCellCache(cfg)
    view = TorchView(cache)
    specs = step_buffers(cfg)
    for s in specs:
        if s.role == "mask":
            t = view.masks[s.window]
        elif s.role in PAGED_ROLES:
            t = view.paged[s.role]
        else:
            t = getattr(view, s.role)
        buf = cache.buffer(s.name)
        assert t.data_ptr() == buf.ctypes.data and t.numel() == buf.size, s.name
        assert t.element_size() == s.dtype.itemsize, s.name
    assert set(view.masks) == {s.window for s in specs if s.role == "mask"}
    assert set(view.paged) == {s.role for s in specs if s.role in PAGED_ROLES}
    assert {s.role for s in specs} <= {"cells", "positions", "read_len", "width", "mask", *PAGED_ROLES}
    for i in range(len(cfg.layers)):
        for j, kv in enumerate("kv"):
            pool = view.layer(i)[j]
            spec = pool_spec(cfg, i, kv, cache.sink)
            assert tuple(pool.shape) == spec.shape and pool.data_ptr() == cache.buffer(spec.name).ctypes.data


def test_mask_width_is_computed_once():
    """mask_row_bytes is the mask row's width in every format (the schema's mask shapes use
    it), and nothing else in the package computes ceil(capacity / 8)."""
    import re

    from cellcache.buffers import mask_row_bytes

    for fmt, want in (("bool", 70), ("bits", 9), ("none", 0)):
        cfg = CacheConfig(capacity=70, layers=[LayerConfig(1, 8)], max_write=4, mask_format=fmt,
                          paged=fmt == "none")
        assert mask_row_bytes(cfg) == want
        for s in step_buffers(cfg):
            if s.role == "mask":
                assert s.nbytes == cfg.max_write * want
    package = Path(__file__).resolve().parents[1] / "cellcache"
    pattern = re.compile(r"(capacity|cap)\s*\+\s*7\)\s*//\s*8")
    hits = [f"{p.relative_to(package)}:{n}" for p in package.rglob("*.py")
            for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert [h.split(":")[0] for h in hits] == ["buffers.py"], hits
