"""The backend registry: build() for host and auto, register_builder(), and errors that name
what exists."""

from __future__ import annotations

import pytest

import cellcache as cc
from cellcache import HostCellCache, InvalidArgument

from .helpers import config


def test_registry_builds_host_and_auto():
    for kind in ("batched-cell", "batched"):
        assert isinstance(cc.build("host", kind, config()), HostCellCache)
    auto = cc.build("auto", "batched", config())
    from cellcache.registry import resolve_backend
    assert auto.backend == resolve_backend("auto")


def test_registry_errors_name_what_exists():
    with pytest.raises(InvalidArgument, match="unknown backend 'tpu'; registered backends: auto, host, cuda"):
        cc.build("tpu", "batched", config())
    with pytest.raises(InvalidArgument,
                       match="unknown kind 'paged' for backend 'host'; its kinds: batched-cell, batched"):
        cc.build("host", "paged", config())
    with pytest.raises(InvalidArgument, match="kind of type list is not a non-empty string"):
        cc.build("host", ["batched"], config())
    with pytest.raises(InvalidArgument, match="backend of type NoneType"):
        cc.build(None, "batched", config())
    with pytest.raises(InvalidArgument, match="already registered; registered: host: batched-cell, batched"):
        cc.register_builder("host", "batched", HostCellCache)
    with pytest.raises(InvalidArgument, match="reserved"):
        cc.register_builder("auto", "x", HostCellCache)
    with pytest.raises(InvalidArgument, match="not callable"):
        cc.register_builder("mine", "x", 3)
    from cellcache.registry import registered
    assert "mine" not in registered()


def test_register_new_builder(monkeypatch):
    from cellcache import registry
    monkeypatch.setattr(registry, "_BUILDERS", dict(registry._BUILDERS))
    cc.register_builder("host", "custom", lambda cfg: ("built", cfg.capacity))
    assert cc.build("host", "custom", config()) == ("built", 32)
