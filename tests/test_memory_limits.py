"""The host cache under an address-space limit (issue 15): building either succeeds or raises
OutOfMemory with nothing left behind, and a cache whose full up-front reservation
(``capacity + 1`` rows per pool) does not fit falls back to copy growth instead of being
refused. Each case runs in a child process that lowers RLIMIT_AS."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

resource = pytest.importorskip("resource")

if not sys.platform.startswith("linux"):
    pytest.skip("reads /proc/self/status", allow_module_level=True)

PRELUDE = r"""
import gc, json, resource
import numpy as np
import cellcache as cc

MiB = 1 << 20

def vm():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024

def limit(extra):
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY if extra is None else vm() + extra, hard))

def steps(cache, widths):
    a = cache.seq_new()
    out = []
    for w in widths:
        assert cache.declare_step([a] * w)
        step = cache.prepare_step()
        k = cache.buffer("layer_0_k")
        k[step.cells, 0, 0] = step.positions + 1          # the forward writes K at cells
        cache.commit_step()
        out.append((step.grew, step.rows))
    k = cache.buffer("layer_0_k")
    assert k[: cache.used_end, 0, 0].tolist() == list(range(1, cache.used_end + 1))
    cache.check_invariants()
    return out

# warm up everything a build and a step touch, so the limit meets only the cache's own memory
steps(cc.HostCellCache(cc.CacheConfig(capacity=64, layers=[cc.LayerConfig(1, 8)], max_write=8,
                                      dtype="float32")), [3, 5])
"""


def run_child(body: str) -> dict:
    r = subprocess.run([sys.executable, "-c", PRELUDE + body], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_cache_whose_reservation_does_not_fit_grows_by_copy():
    """4 pools of 65537 rows x 4 KiB reserve 1 GiB; under a 64 MiB allowance the cache still
    builds, with copy pools: the first allocation (64 rows, 1 MiB) fits, and each growth
    moves the pools, as Step.grew reports."""
    out = run_child(r"""
cfg = cc.CacheConfig(capacity=1 << 16, layers=[cc.LayerConfig(8, 128)] * 2, max_write=64,
                     initial_capacity=64, dtype="float32", mask_format="bits")
limit(64 * MiB)
cache = cc.HostCellCache(cfg)
grew = steps(cache, [40, 40, 64, 64])
m = cache.metrics()
limit(None)
print(json.dumps({"grew": grew, "moves": m["pools_move"], "growths": m["growth_count"]}))
""")
    assert out["moves"] is True
    assert out["grew"] == [[True, 64], [True, 128], [True, 256], [False, 256]]
    assert out["growths"] == 2


def test_without_a_limit_the_pools_are_mapped():
    out = run_child(r"""
cfg = cc.CacheConfig(capacity=1 << 16, layers=[cc.LayerConfig(8, 128)] * 2, max_write=64,
                     initial_capacity=64, dtype="float32", mask_format="bits")
cache = cc.HostCellCache(cfg)
print(json.dumps({"grew": steps(cache, [40, 40]), "moves": cache.metrics()["pools_move"]}))
""")
    assert out == {"grew": [[True, 64], [False, 128]], "moves": False}


def test_every_limit_gives_a_working_cache_or_out_of_memory_with_nothing_left():
    """A sweep of limits across what a cache needs (table about 2.5 MiB, bit masks 1 MiB, four
    pools of 32 MiB each to reserve): every outcome is a working cache (mapped pools where all
    four reservations fit, copy pools where some do not) or OutOfMemory, never numpy's
    MemoryError or another exception; and nothing is left behind, neither by a refused build
    nor by reservations made before one failed (a leaked one would be 32 MiB)."""
    out = run_child(r"""
cfg = cc.CacheConfig(capacity=1 << 16, layers=[cc.LayerConfig(4, 32), cc.LayerConfig(4, 32, 8)],
                     max_write=64, initial_capacity=64, dtype="float32", mask_format="bits")
results = []
start = vm()
for extra in [0, MiB // 4, MiB, 2 * MiB, 3 * MiB, 4 * MiB, 6 * MiB, 8 * MiB, 16 * MiB, 48 * MiB,
              80 * MiB, 112 * MiB, 200 * MiB]:
    gc.collect()
    before = vm()
    limit(extra)
    moves = None
    try:
        cache = cc.HostCellCache(cfg)
        moves = cache.metrics()["pools_move"]
        steps(cache, [64, 64, 64])
        del cache
        outcome = "ok"
    except Exception as e:          # noqa: BLE001 - the parent checks the class
        outcome = type(e).__name__
    limit(None)
    gc.collect()
    results.append([extra, outcome, moves, vm() - before])
print(json.dumps({"results": results, "total": vm() - start}))
""")
    results = out["results"]
    assert {outcome for _, outcome, _, _ in results} == {"ok", "OutOfMemory"}, results
    assert {moves for _, outcome, moves, _ in results if outcome == "ok"} == {True, False}, results
    for extra, outcome, _, leaked in results:
        assert leaked < 16 << 20, (extra, outcome, leaked)
    assert out["total"] < 16 << 20, out
