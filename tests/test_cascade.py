"""cellcache.cascade on the host backend: a step's grouping in FlashInfer's two-level cascade
layout, read as FlashInfer reads it (level 0 non-causal, the last level causal, the two merged
by log-sum-exp) in float64, equals attention over the plain paged view; which runs group;
and its refusals."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cellcache import CacheConfig, LayerConfig, build  # noqa: E402
from cellcache.errors import InvalidArgument, InvalidState  # noqa: E402

from .helpers import snapshot  # noqa: E402
from .helpers_cascade import Families  # noqa: E402

cascade = pytest.importorskip("cellcache.cascade")
cct = pytest.importorskip("cellcache.torch")

H, HKV, D = 4, 2, 8


def _cache(paged=True, capacity=8192, max_seqs=40):
    cfg = CacheConfig(capacity=capacity, layers=[LayerConfig(HKV, D)], max_write=512,
                      initial_capacity=capacity, dtype="float32", max_seqs=max_seqs, paged=paged,
                      mask_format="none" if paged else "bool")
    return build("host", "batched", cfg)


def _attend(q, K, V, cells, causal):
    """Rows q [n, H, D] over cells; (out [n, H, D], lse [n, H]) in float64, FlashInfer's
    alignment (query i of n sees keys up to len - n + i when causal)."""
    n, L = q.shape[0], len(cells)
    if L == 0:
        return np.zeros_like(q), np.full(q.shape[:2], -np.inf)
    G = H // HKV
    k = np.repeat(K[cells], G, axis=1)
    v = np.repeat(V[cells], G, axis=1)
    s = np.einsum("qhd,khd->qhk", q, k) / np.sqrt(D)
    if causal:
        vis = np.arange(L)[None, :] <= (L - n + np.arange(n))[:, None]
        s = np.where(vis[:, None, :], s, -np.inf)
    mx = s.max(axis=2, keepdims=True)
    p = np.exp(s - mx)
    lse = np.log(p.sum(axis=2)) + mx[..., 0]
    return np.einsum("qhk,khd->qhd", p / p.sum(axis=2, keepdims=True), v), lse


def _levels_attention(lv, q, K, V):
    outs = []
    for i, level in enumerate(lv.levels):
        qo, kv, idx = (level[k].numpy().astype(np.int64) for k in ("qo_indptr", "kv_indptr", "kv_indices"))
        assert (level["kv_last_page_len"].numpy() == 1).all() and qo[-1] == len(q)
        o, s = np.zeros_like(q), np.zeros(q.shape[:2])
        for e in range(len(qo) - 1):
            o[qo[e]:qo[e + 1]], s[qo[e]:qo[e + 1]] = _attend(q[qo[e]:qo[e + 1]], K, V, idx[kv[e]:kv[e + 1]],
                                                            causal=i == len(lv.levels) - 1)
        outs.append((o, s))
    (o0, s0), (o1, s1) = outs
    m = np.maximum(s0, s1)
    w0, w1 = np.exp(s0 - m), np.exp(s1 - m)
    return (o0 * w0[..., None] + o1 * w1[..., None]) / (w0 + w1)[..., None]


def _plain(step, view, q, K, V):
    qo, kv = step.qo_indptr.astype(np.int64), step.kv_indptr.astype(np.int64)
    idx = view.paged["kv_indices"].numpy().astype(np.int64)
    out = np.zeros_like(q)
    for r in range(len(qo) - 1):
        out[qo[r]:qo[r + 1]] = _attend(q[qo[r]:qo[r + 1]], K, V, idx[kv[r]:kv[r + 1]], causal=True)[0]
    return out


def _check(cache, ids, pad_to, min_shared, seed=0):
    step = cache.prepare_step(pad_to=pad_to) if cache.declare_step(ids) else None
    assert step is not None
    view = cct.TorchView(cache)
    rng = np.random.default_rng(seed)
    K = rng.standard_normal((cache.sink + 1, HKV, D))
    V = rng.standard_normal((cache.sink + 1, HKV, D))
    q = rng.standard_normal((pad_to, H, D))
    lv = cascade.cascade_levels(view, min_shared=min_shared)
    got, want = _levels_attention(lv, q, K, V), _plain(step, view, q, K, V)
    assert np.abs(got - want).max() < 1e-10
    cache.commit_step()
    return lv


def test_forks_of_one_root_group_and_the_levels_give_plain_attention():
    cache = _cache()
    f = Families(cache.table, np.random.default_rng(0), chunk=60)
    root = f.new(600)
    kids = f.forks(root, 5, own=(1, 40))
    u1, u2 = f.new(300), f.new(700)
    ids = [u1, *kids, u2]
    lv = _check(cache, [int(x) for x in ids], len(ids) + 3, 256)
    assert lv.groups == [(1, 5, 512)]                  # 600 shared, down to a multiple of 128
    assert lv.levels[0]["qo_indptr"].tolist() == [0, 1, 6, 7, 8, 9, 10]   # padding rows: one each
    # the group's level-0 cells are the root's first 512; the members' own cells follow them
    assert lv.levels[0]["kv_indptr"].tolist()[:3] == [0, 0, 512]


def test_nested_sharing_interior_clones_thresholds_and_mixed_steps():
    cache = _cache()
    f = Families(cache.table, np.random.default_rng(3), chunk=60)
    s = f.new(300)
    d1, d2 = f.forks(s, 2, own=(400, 400))
    f1, f2 = f.forks(d1, 3, own=(1, 40)), f.forks(d2, 2, own=(1, 40))
    fi = f.forks(d1, 2, upto=650, own=(1, 40))
    u = f.new(500)
    ids = [int(x) for x in [u, *f1, *fi, d1, *f2, d2, s]]
    lv = _check(cache, ids, len(ids) + 2, 128, seed=1)
    assert len(lv.groups) == 1 and lv.groups[0][:2] == (1, len(ids) - 1)   # one level: the least share
    lv = _check(cache, ids, len(ids), 512, seed=2)
    assert [g[:2] for g in lv.groups] == [(1, 6), (7, 3)]                 # broken at the 300 share
    assert not _check(cache, ids, len(ids), 1024, seed=3).groups          # shares below it
    mixed = [int(u)] * 17 + [int(x) for x in f1] + [int(s)] * 9 + [int(x) for x in f2]
    lv = _check(cache, mixed, len(mixed) + 1, 256, seed=4)
    assert [g[:2] for g in lv.groups] == [(1, 3), (5, 2)]                 # prompt chunks never group


def test_refusals_change_nothing():
    cache = _cache()
    f = Families(cache.table, np.random.default_rng(0), chunk=60)
    a = f.new(10)
    view = cct.TorchView(cache)
    with pytest.raises(InvalidState, match="prepared step"):
        cascade.cascade_levels(view)
    assert cache.declare_step([int(a)])
    st = cache.prepare_step()
    before = view.paged["kv_indices"].clone()
    for bad in (0, 100, -128, True, 1.5, "256"):
        with pytest.raises(InvalidArgument, match="min_shared"):
            cascade.cascade_levels(view, min_shared=bad)
    with pytest.raises(InvalidArgument, match="TorchView"):
        cascade.cascade_levels(object())
    other = _cache()
    b = other.table.seq_new()
    assert other.declare_step([b])
    with pytest.raises(InvalidState, match="prepared step"):
        cascade.cascade_levels(view, step=other.prepare_step())
    # the refusals left the step prepared and its paged view as it was
    assert cache.prepared_step is st and torch.equal(view.paged["kv_indices"], before)
    assert cascade.cascade_levels(view).groups == []
    cache.commit_step()
    plain = _cache(paged=False)
    with pytest.raises(InvalidArgument, match="paged=True"):
        cascade.cascade_levels(cct.TorchView(plain))


def test_may_group_wherever_a_group_forms_and_not_where_rows_cannot():
    """``cct.may_group`` (the table's ``rows_share_cell`` at ``CASCADE_MIN_SHARED - 1``):
    True for every decode step whose rows form a group, and exactly where two consecutive
    rows are different sequences holding the same cell at that position; False for
    unrelated sequences side by side and for forks of a prompt shorter than the threshold
    (a shared BOS). Refusals of a bad array or position change nothing."""
    cache = _cache()
    rng = np.random.default_rng(5)
    f = Families(cache.table, rng, chunk=60)
    n = cct.CASCADE_MIN_SHARED
    roots = [f.new(int(k)) for k in (1, 150, n - 1, n, n + 40, 700)]
    families = [[r, *f.forks(r, 3, own=(1, 30))] for r in roots]
    lone = [[f.new(int(k))] for k in rng.integers(1, 400, size=5)]
    view = cct.TorchView(cache)
    seen = set()
    for trial in range(40):
        if trial % 2:                              # families side by side, in some order
            blocks = [families[i] for i in rng.permutation(len(families))]
            blocks += [lone[i] for i in rng.permutation(len(lone))]
            ids = [int(x) for b in rng.permutation(len(blocks)) for x in blocks[b]]
        else:                                      # any order
            ids = [int(x) for x in rng.permutation([x for b in families + lone for x in b])]
        ids = ids[:int(rng.integers(2, len(ids) + 1))]
        assert cache.declare_step(ids)
        step = cache.prepare_step(pad_to=len(ids) + 2)
        cells = [cache.table.seq_cell_at(s, n - 1) for s in ids]     # -1: not that long
        want = any(cells[i] >= 0 and cells[i] == cells[i - 1] for i in range(1, len(ids)))
        lv = cascade.cascade_levels(view)
        got = cct.may_group(view, step)
        assert got is want and (got or not lv.groups)
        seen.add((bool(lv.groups), got))
        cache.commit_step()
    assert {(True, True), (False, False)} <= seen
    t = cache.table
    before = snapshot(t)
    a, b = families[-1][:2]
    ab = np.array([a, b], dtype=np.int64)
    i64 = np.int64
    for bad, pos in (([a, b], 0), (np.array([a, b], dtype=np.int32), 0), (np.array([[a, b]], dtype=i64), 0),
                     (np.array([a, 40], dtype=i64), 0), (np.array([-1, a], dtype=i64), 0), (None, 0),
                     (ab, -1), (ab, 1.5), (ab, "0"), (ab, 1 << 70)):
        with pytest.raises(InvalidArgument, match="seq_ids|position"):
            t.rows_share_cell(bad, pos)
    assert snapshot(t) == before
    assert t.rows_share_cell(ab, 699) is True and t.rows_share_cell(ab, 10 ** 6) is False
    assert t.rows_share_cell(ab[::-1], 0) is True                                # strided
    assert t.rows_share_cell(np.array([a, a], dtype=np.int64), 0) is False       # one sequence
    assert t.rows_share_cell(np.zeros(0, dtype=np.int64), 0) is False
    c, d = families[0][:2]                         # forks of a one-token prompt: a shared BOS
    assert t.rows_share_cell(np.array([c, d], dtype=np.int64), 0) is True
    assert t.rows_share_cell(np.array([c, d], dtype=np.int64), n - 1) is False
