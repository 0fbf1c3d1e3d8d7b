"""Helpers shared by the tests: the tables (test_rules, test_refusals), the host cache
(test_host_growth, test_step_protocol, test_host_buffers, test_config, test_copy_growth,
test_cache_machine, test_threads) and the CUDA backend against the host backend (tests/gpu)."""

from __future__ import annotations

import importlib.util
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from cellcache import CacheConfig, CellTable, LayerConfig, OutOfMemory, ReferenceTable
from cellcache._views import fill_masks
from cellcache.host import HostAllocator

TABLES = [CellTable, ReferenceTable]
TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str):
    """tools/<name>.py as a module, loaded as running it by path would (tools/ on sys.path)."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_watched(gen: Any, look: Callable[[], Any], pause: float = 0.0) -> None:
    """``gen.run()`` while another thread calls ``look()`` over and over (``pause`` seconds
    apart), as a client reads its requests while they run; what ``look`` raised is raised."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def watch() -> None:
        try:
            while not stop.wait(pause):
                look()
        except BaseException as e:                # pragma: no cover - raised below
            errors.append(e)

    t = threading.Thread(target=watch)
    t.start()
    try:
        gen.run()
    finally:
        stop.set()
        t.join()
    if errors:
        raise errors[0]


def make(table_cls, capacity, max_seqs=64, max_write=None):
    return table_cls(capacity, max_seqs, max_write)


def snapshot(table) -> dict:
    """The observable state; the Cython table is also checked for internal invariants."""
    if isinstance(table, CellTable):
        table.check_invariants()
    return table.snapshot()


def mask_strings(table, seq_ids, positions, read_len, window) -> list[str]:
    """Mask rows of a placed step as '0'/'1' strings of length read_len."""
    if isinstance(table, ReferenceTable):
        rows = table.masks(list(seq_ids), list(positions), read_len, window)
        return ["".join("1" if x else "0" for x in row) for row in rows]
    width = len(seq_ids)
    out = np.full((width, max(read_len, 1)), 7, dtype=np.uint8)  # poisoned: every cell written?
    fill_masks(
        table, np.asarray(seq_ids, dtype=np.int64), np.asarray(positions, dtype=np.int64),
        read_len, [window], [out])
    assert set(np.unique(out[:, :read_len]).tolist()) <= {0, 1}
    return ["".join(str(int(x)) for x in row[:read_len]) for row in out]


def step(table, seq_ids):
    """declare + place; returns (cells, positions, read_len) as lists."""
    assert table.declare_step(seq_ids) is True
    cells, positions, read_len = table.place()
    return [int(c) for c in cells], [int(p) for p in positions], int(read_len)


# -- the host cache ------------------------------------------------------------------

HOST_LAYERS = [LayerConfig(2, 4, 0), LayerConfig(1, 8, 2)]


def config(**kw):
    base = dict(capacity=32, layers=HOST_LAYERS, max_write=9, initial_capacity=4, dtype="float32")
    base.update(kw)
    return CacheConfig(**base)


class FailingAllocator(HostAllocator):
    """Fails the allocation numbered ``fail_at`` (0-based, counted from construction)."""

    def __init__(self, fail_at=None):
        self.fail_at = fail_at
        self.calls = 0
        self.live = 0

    def allocate(self, nbytes, what):
        n = self.calls
        self.calls += 1
        if n == self.fail_at:
            raise OutOfMemory(f"injected failure at allocation {n} ({what})")
        self.live += 1
        return super().allocate(nbytes, what)

    def release(self, allocation):
        self.live -= 1


def state(cache):
    """Everything observable: table, pools, step buffers, declaration, metrics."""
    cache.check_invariants()
    return {
        "table": cache.table.snapshot(),
        "metrics": cache.metrics(),
        "buffers": {n: cache.buffer(n).copy() for n in cache.buffer_names},
        "pool_ptrs": [cache.buffer(n).ctypes.data for n in cache.buffer_names if n.startswith("layer")],
        "rows": (cache.rows, cache.sink),
    }


def assert_same(a, b):
    assert a["table"] == b["table"]
    assert a["metrics"] == b["metrics"]
    assert a["pool_ptrs"] == b["pool_ptrs"]
    assert a["rows"] == b["rows"]
    for name in a["buffers"]:
        np.testing.assert_array_equal(a["buffers"][name], b["buffers"][name], err_msg=name)


def run_step(cache, ids, **kw):
    assert cache.declare_step(ids) is True
    step = cache.prepare_step(**kw)
    cache.commit_step()
    return step


def write_rows(cache, step, value_fn):
    for layer in range(len(cache.config.layers)):
        for kv in "kv":
            pool = cache.buffer(f"layer_{layer}_{kv}")
            for c, p, s in zip(step.cells, step.positions, step.seq_ids):
                pool[c] = value_fn(layer, kv, int(s), int(p))


# -- the CUDA backend against the host backend (tests/gpu) ----------------------------

def cuda():
    """(CudaCellCache, driver module, check, cu), imported when a test runs."""
    from cellcache.cuda import driver
    from cellcache.cuda.backend import CudaCellCache

    return CudaCellCache, driver, driver.check, driver.cu


def compare_step(host, dev, hs, ds, cfg):
    assert hs.cells.tolist() == ds.cells.tolist() and hs.positions.tolist() == ds.positions.tolist()
    assert (hs.n_runs, hs.pad_to) == (ds.n_runs, ds.pad_to)
    pad, r = ds.pad_to, ds.read_len
    for name in ("cells", "positions"):
        np.testing.assert_array_equal(dev.buffer(name).copy_to_host()[:pad], host.buffer(name)[:pad],
                                      err_msg=name)
    for name in ("read_len", "width"):
        assert int(dev.buffer(name).copy_to_host()[0]) == int(host.buffer(name)[0]), name
    if cfg.mask_format != "none":
        for win in cfg.windows:
            got = dev.buffer(f"mask_w{win}").copy_to_host()
            want = host.buffer(f"mask_w{win}")
            if cfg.mask_format == "bool":
                np.testing.assert_array_equal(got[0, 0, :pad, :r], want[0, 0, :pad, :r],
                                              err_msg=f"mask_w{win}")
            else:
                nb = (r + 7) // 8
                np.testing.assert_array_equal(got[:pad, :nb], want[:pad, :nb], err_msg=f"mask_w{win}")
    if cfg.paged:
        assert ds.qo_indptr.tolist() == hs.qo_indptr.tolist()
        assert ds.kv_indptr.tolist() == hs.kv_indptr.tolist()
        for name in ("qo_indptr", "kv_indptr"):
            np.testing.assert_array_equal(dev.buffer(name).copy_to_host()[:pad + 1],
                                          host.buffer(name)[:pad + 1], err_msg=name)
        n_kv = int(hs.kv_indptr[-1])
        np.testing.assert_array_equal(dev.buffer("kv_indices").copy_to_host()[:n_kv],
                                      host.buffer("kv_indices")[:n_kv], err_msg="kv_indices")


def live_rows_equal(host, dev):
    """Every live cell's K/V row agrees (host pools vs device pools)."""
    t = host.table
    live = np.flatnonzero(t.positions_array() >= 0)
    for i in range(len(host.config.layers)):
        lay_h, lay_d = host.layer(i), dev.layer(i)
        for kv in "kv":
            got = getattr(lay_d, kv).copy_to_host()
            want = getattr(lay_h, kv)
            np.testing.assert_array_equal(got[live], want[live], err_msg=f"layer {i} {kv}")


def small_config(**kw):
    base = dict(capacity=256, layers=[LayerConfig(2, 8, 0), LayerConfig(2, 8, 3)],
                max_write=16, initial_capacity=16, dtype="bfloat16")
    base.update(kw)
    return CacheConfig(**base)



def random_prompts(seed: int, n: int, lo: int = 3, hi: int = 20, vocab: int = 512) -> list[list[int]]:
    """n prompts of random token ids in [0, vocab), lengths in [lo, hi) (the tiny random
    models' vocabulary is 512)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]
