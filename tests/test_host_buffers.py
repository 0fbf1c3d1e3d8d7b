"""The host cache's buffers: step buffers and pools by name, layer(), pool dtypes, stale
regions left as they were, masks and the paged view against the reference over a random
session, and a paged view too large refused at declare."""

from __future__ import annotations

import numpy as np
import pytest

from cellcache import HostCellCache, InvalidArgument, StepTooLarge
from cellcache.host import HostAllocator
from cellcache.reference import ReferenceTable, mask_rows, paged_view

from .helpers import assert_same, config, run_step, state


def test_buffers_by_name_and_layers():
    cache = HostCellCache(config(), allocator=HostAllocator())
    assert cache.buffer_names == ["cells", "positions", "read_len", "width", "mask_w0", "mask_w2",
                                  "layer_0_k", "layer_0_v", "layer_1_k", "layer_1_v"]
    assert cache.buffer("mask_w2").shape == (1, 1, 9, 32)
    assert cache.buffer("mask_w2").dtype == np.bool_
    assert cache.buffer("cells").dtype == np.int64
    assert cache.buffer("layer_1_v").shape == (0, 1, 8)     # nothing before the first step
    lay = cache.layer(1)
    assert lay.window == 2 and lay.mask is cache.buffer("mask_w2") and lay.k is cache.buffer("layer_1_k")
    before = state(cache)
    for bad, match in [("mask_w1", "no buffer named 'mask_w1'; buffers are: cells"),
                       (3, "no buffer named of type int")]:
        with pytest.raises(InvalidArgument, match=match):
            cache.buffer(bad)
    for bad, match in [(2, "layer=2 is outside \\[0, 1\\]"), ("0", "layer of type str")]:
        with pytest.raises(InvalidArgument, match=match):
            cache.layer(bad)
    assert_same(state(cache), before)
    bits = HostCellCache(config(mask_format="bits"))
    assert bits.buffer("mask_w0").shape == (9, 4) and bits.buffer("mask_w0").dtype == np.uint8
    none = HostCellCache(config(mask_format="none", paged=True))
    assert "mask_w0" not in none.buffer_names and none.layer(0).mask is None
    assert none.buffer("kv_indices").shape == (none.config.max_kv + 9,)
    assert none.buffer("kv_last_page_len").tolist() == [1] * 9


@pytest.mark.parametrize("dtype,np_name", [("float16", "float16"), ("bfloat16", "bfloat16"),
                                           ("float32", "float32")])
def test_pool_dtypes(dtype, np_name):
    cache = HostCellCache(config(dtype=dtype))
    a = cache.seq_new()
    run_step(cache, [a])
    assert cache.buffer("layer_0_k").dtype.name == np_name
    assert cache.metrics()["allocated_bytes"] == 2 * 4 * 16 * cache.buffer("layer_0_k").itemsize


def test_stale_regions_are_left_as_they_were():
    cache = HostCellCache(config(capacity=16, max_write=6, initial_capacity=16))
    a, b = cache.seq_new(), cache.seq_new()
    run_step(cache, [a, a, b, b, a])
    cells = cache.buffer("cells").copy()
    mask = cache.buffer("mask_w0").copy()
    cache.seq_rm(b)
    cache.rewind(a, 1)                    # read_len falls to 1
    step = run_step(cache, [a])
    assert step.read_len == 2 and step.cells.tolist() == [1]
    assert cache.buffer("cells")[1:5].tolist() == cells[1:5].tolist()
    new = cache.buffer("mask_w0")[0, 0]
    assert new[0, :2].tolist() == [True, True]
    np.testing.assert_array_equal(new[0, 2:], mask[0, 0, 0, 2:])   # columns past read_len
    np.testing.assert_array_equal(new[1:], mask[0, 0, 1:])          # rows past width


def test_host_cache_matches_the_reference_over_a_random_session():
    rng = np.random.default_rng(7)
    cfg = config(capacity=48, max_write=8, max_seqs=70, initial_capacity=3, paged=True)
    cache = HostCellCache(cfg)
    ref = ReferenceTable(48, 70, 8)
    for _ in range(300):
        r = rng.random()
        live = ref.live_seqs()
        if r < 0.15 or not live:
            assert cache.seq_new() == ref.seq_new()
        elif r < 0.25:
            s = int(rng.choice(live))
            upto = int(rng.integers(0, ref.pos(s) + 2))
            assert cache.seq_clone(s, upto) == ref.seq_clone(s, upto)
        elif r < 0.35:
            s = int(rng.choice(live))
            assert cache.seq_rm(s) == ref.seq_rm(s)
        elif r < 0.45:
            s = int(rng.choice(live))
            p = int(rng.integers(0, ref.pos(s) + 1))
            assert cache.rewind(s, p) == ref.rewind(s, p)
        else:
            ids = [int(x) for x in rng.choice(live, size=int(rng.integers(1, 9)))]
            ok = cache.declare_step(ids)
            assert ok == ref.declare_step(ids)
            if not ok:
                continue
            w = len(ids)
            pad = int(rng.integers(w, 9))
            step = cache.prepare_step(pad_to=pad)
            cells, positions, read_len = ref.place()
            assert step.cells.tolist() == cells and step.positions.tolist() == positions
            assert int(cache.buffer("read_len")[0]) == read_len == step.read_len
            assert cache.buffer("cells")[:w].tolist() == cells
            assert cache.buffer("positions")[:w].tolist() == positions
            for window in cfg.windows:
                expect = np.array(mask_rows(ref.cell_pos, ref.cell_owners, ids, positions,
                                            read_len, window), dtype=bool)
                got = cache.buffer(f"mask_w{window}")[0, 0, :w, :read_len]
                np.testing.assert_array_equal(got, expect.reshape(w, read_len))
            qo, kv, indices, runs = paged_view(ref.cell_pos, ref.cell_owners, ids, positions,
                                               pad, cache.sink)
            assert step.n_runs == runs and step.qo_indptr.tolist() == qo[:runs + pad - w + 1]
            assert cache.buffer("qo_indptr")[:pad + 1].tolist() == qo
            assert cache.buffer("kv_indptr")[:pad + 1].tolist() == kv
            assert cache.buffer("kv_indices")[:len(indices)].tolist() == indices
            cache.commit_step()
        cache.check_invariants()
        assert cache.table.snapshot() == ref.snapshot()


def test_paged_view_too_large_is_refused_at_declare():
    cache = HostCellCache(config(capacity=32, max_write=8, paged=True, max_kv=10))
    a, b = cache.seq_new(), cache.seq_new()
    run_step(cache, [a] * 6)
    before = state(cache)
    # a's run ends at position 7 (8 entries), b's at 2 (3 entries): 11 > 10
    with pytest.raises(StepTooLarge, match="need 11 entries; the paged view holds max_kv=10"):
        cache.declare_step([a, a, b, b, b])
    assert_same(state(cache), before)
    assert cache.table.declared is None
    assert isinstance(StepTooLarge("x"), InvalidArgument)
    assert cache.declare_step([a, a, b]) is True           # 8 + 1 entries fit
