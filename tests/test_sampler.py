"""The batched sampler without a cache or a model (issue 20): greedy is torch.argmax
(ties: the lowest id), seeded draws depend only on their key and logits (not on the batch
around them), top-k and top-p restrict the support exactly as the per-row code did, the
draws follow the distribution, verify runs count the leading accepted drafts, and a call
makes exactly one device-to-host copy. Every random number here is a hash of a fixed key:
nothing can come out differently from run to run."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cellcache.generate import Sampler, SampleSpec  # noqa: E402
from cellcache.generate.sampler import uniforms  # noqa: E402


def spec_for(n, temperature=0.0, top_k=0, top_p=1.0, seed=0, rows=None, positions=None, index=0):
    spec = SampleSpec()
    for i in range(n):
        spec.add(i if rows is None else rows[i], temperature, top_k, top_p, seed, index,
                 i if positions is None else positions[i])
    return spec


def test_greedy_is_argmax_with_ties_to_the_lowest_id():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn((6, 50), generator=g)
    logits[1, [3, 7, 40]] = 9.0                       # a three-way tie
    logits[2] = 0.0                                   # every id ties
    logits[4, 49] = logits[4].max() + 1
    out = Sampler("cpu")(logits, spec_for(6))
    assert out.ids.tolist() == torch.argmax(logits, dim=-1).tolist()
    assert out.ids[1] == 3 and out.ids[2] == 0 and out.ids[4] == 49


def test_given_greedy_ids_replace_the_argmax_only_where_slot_i_is_row_i(monkeypatch):
    """A replayed graph hands its own argmax over (``greedy``): taken as the greedy draws
    (no argmax launched) when slot i draws from row i, random slots still sampled; ignored
    when the spec picks rows; a tensor that is not one id per row is refused before
    anything is queued."""
    from cellcache.errors import InvalidArgument

    g = torch.Generator().manual_seed(3)
    logits = torch.randn((5, 40), generator=g)
    marked = torch.tensor([39, 38, 37, 36, 35])      # not the argmax: shows which ids were used
    calls = []
    real = torch.argmax
    monkeypatch.setattr(torch, "argmax", lambda *a, **k: calls.append(1) or real(*a, **k))
    sampler = Sampler("cpu")
    assert sampler.launch(logits, spec_for(5), marked).result().ids.tolist() == marked.tolist()
    assert calls == []
    spec = spec_for(5, temperature=0.0)
    spec.temperature[2] = 0.8
    mixed = sampler.launch(logits, spec, marked).result().ids
    assert [mixed[i] for i in (0, 1, 3, 4)] == [39, 38, 36, 35]
    assert mixed[2] == Sampler("cpu")(logits, spec).ids[2]            # the seeded draw, unchanged
    picked = spec_for(3, rows=[4, 0, 2])
    assert sampler.launch(logits, picked, marked).result().ids.tolist() == \
        real(logits[[4, 0, 2]], dim=-1).tolist()
    copies = sampler.copies
    for bad in (marked[:4], marked.to(torch.int32), marked[:, None]):
        with pytest.raises(InvalidArgument, match="greedy ids"):
            sampler.launch(logits, spec_for(5), bad)
    assert sampler.copies == copies


def test_a_draw_depends_only_on_its_key_and_logits():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn((8, 100), generator=g) * 3
    keys = [(5, 0, t) for t in range(8)]
    spec = SampleSpec()
    for r, (seed, k, t) in enumerate(keys):
        spec.add(r, 0.8, 20, 0.9, seed, k, t)
    a = Sampler("cpu")(logits, spec).ids
    # the same keys in another order, among other rows (greedy ones too)
    perm = [5, 2, 7, 0, 3, 6, 1, 4]
    big = torch.cat([torch.randn((3, 100), generator=g), logits[perm]])
    spec2 = SampleSpec()
    for j in range(3):
        spec2.add(j, 0.0 if j == 1 else 1.0, 0, 1.0, 99, 0, j)
    for j, r in enumerate(perm):
        seed, k, t = keys[r]
        spec2.add(3 + j, 0.8, 20, 0.9, seed, k, t)
    b = Sampler("cpu")(big, spec2).ids[3:]
    assert b.tolist() == a[perm].tolist()
    other = SampleSpec()
    for r in range(8):
        other.add(r, 0.8, 20, 0.9, 6, 0, r)           # another seed: other draws somewhere
    assert Sampler("cpu")(logits, other).ids.tolist() != a.tolist()


def test_draws_follow_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n, T = 6000, 0.7
    spec = spec_for(n, temperature=T, rows=[0] * n, seed=11)
    ids = Sampler("cpu")(logits, spec).ids
    freq = np.bincount(ids, minlength=6) / n
    p = torch.softmax(logits[0] / T, -1).numpy()
    assert np.abs(freq - p).max() < 0.03, (freq, p)


def test_top_k_and_top_p_restrict_the_support_as_before():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn((1, 40), generator=g) * 2
    n = 3000
    ids = Sampler("cpu")(logits, spec_for(n, 1.0, top_k=5, rows=[0] * n, seed=3)).ids
    top5 = set(torch.topk(logits[0], 5).indices.tolist())
    assert set(ids.tolist()) == top5                  # every one of the five, nothing else
    ids = Sampler("cpu")(logits, spec_for(50, 1.0, top_k=1, rows=[0] * 50)).ids
    assert set(ids.tolist()) == {int(torch.argmax(logits))}
    # top-p: the per-row rule of the generator before the sampler was batched
    probs = torch.softmax(logits[0], -1)
    sorted_p, order = torch.sort(probs, descending=True)
    keep = torch.cumsum(sorted_p, 0) - sorted_p < 0.6
    nucleus = set(order[keep].tolist())
    ids = Sampler("cpu")(logits, spec_for(n, 1.0, top_p=0.6, rows=[0] * n, seed=4)).ids
    assert set(ids.tolist()) == nucleus and len(nucleus) < 40


def test_verify_groups_count_the_leading_accepted_drafts():
    logits = torch.full((7, 10), -4.0)
    want = [3, 1, 4, 1, 5, 9, 2]                      # greedy tokens of the seven rows
    logits[torch.arange(7), torch.tensor(want)] = 4.0
    spec = SampleSpec()
    # group 0: rows 0..3 check drafts 3, 1, 7 (two accepted); group 1: row 4 alone, no draft;
    # group 2: rows 5..6 check draft 9 (accepted, then the bonus row)
    for r, d in zip(range(4), [3, 1, 7, -1]):
        spec.add(r, 0.0, 0, 1.0, 0, 0, r, d)
    spec.groups.append((0, 3))
    spec.add(4, 0.0, 0, 1.0, 0, 0, 0)
    for r, d in zip((5, 6), [9, -1]):
        spec.add(r, 0.0, 0, 1.0, 0, 0, r, d)
    spec.groups.append((5, 1))
    out = Sampler("cpu")(logits, spec)
    assert out.ids.tolist() == want and out.accepted.tolist() == [2, 1]


def test_one_host_copy_per_call(monkeypatch):
    """Every way a tensor's values reach the host is counted during the call: one."""
    seen = []
    for name in ("item", "tolist", "numpy", "cpu", "__int__", "__float__", "__bool__", "__index__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, _name=name, **k):
            seen.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    logits = torch.randn((5, 30))
    spec = spec_for(5, rows=[0, 1, 2, 3, 3])
    spec.temperature[1] = spec.temperature[3] = 0.9
    spec.top_k[1], spec.top_p[3] = 4, 0.8
    spec.draft[0] = 7
    spec.groups.append((0, 1))
    sampler = Sampler("cpu")
    sampler(logits, spec)
    monkeypatch.undo()
    assert seen == ["numpy"] and sampler.copies == 1


def test_uniforms_are_a_fixed_function_of_the_key():
    u = uniforms(np.arange(20000) % 7, np.arange(20000) // 7, np.arange(20000))
    assert ((0 <= u) & (u < 1)).all() and abs(u.mean() - 0.5) < 0.01
    assert len(np.unique(u)) == len(u)
    assert uniforms(3, 1, 4) == uniforms(3, 1, 4) != uniforms(3, 1, 5)
    assert uniforms(2**63 - 1, 65535, 2**40) < 1
