"""The batched sampler without a cache or a model (issue 20): greedy is torch.argmax
(ties: the lowest id), seeded draws depend only on their key and logits (not on the batch
around them), top-k and top-p restrict the support exactly as the per-row code did, the
draws follow the distribution, verify runs count the leading accepted drafts, a call
makes exactly one device-to-host copy, and parameters beyond what float32 computes draw as
their limits in every logits dtype while ordinary ones draw as the unclamped formula (issue
38). Every random number here is a hash of a fixed key: nothing can come out differently
from run to run."""

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
    """Every way a tensor's values reach the host is counted during the call: one (the
    clamping of extreme parameters reads the spec's lists, not tensors)."""
    seen = []
    for name in ("item", "tolist", "numpy", "cpu", "__int__", "__float__", "__bool__", "__index__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, _name=name, **k):
            seen.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    logits = torch.randn((5, 30))
    spec = spec_for(6, rows=[0, 1, 2, 3, 3, 4])
    spec.temperature[1] = spec.temperature[3] = 0.9
    spec.top_k[1], spec.top_p[3] = 4, 0.8
    spec.temperature[4], spec.temperature[5], spec.top_p[5] = 1e-300, 1e300, 1e-300   # clamped
    spec.draft[0] = 7
    spec.groups.append((0, 1))
    sampler = Sampler("cpu")
    sampler(logits, spec)
    monkeypatch.undo()
    assert seen == ["numpy"] and sampler.copies == 1


def test_the_readback_copies_once_a_launch_and_hands_the_caller_its_own_array():
    """The sampler hands its ids to its Readback: one copy a launched step (none for an
    empty spec), and a Draw's host arrays are the caller's, unchanged by later steps."""
    from cellcache.generate.readback import Readback

    sampler = Sampler("cpu")
    assert isinstance(sampler.readback, Readback) and sampler.stream is None
    logits = torch.zeros((3, 8))
    logits[:, 5] = 1.0
    first = sampler.launch(logits, spec_for(3))
    logits[:, 5], logits[:, 2] = 0.0, 1.0
    second = sampler.launch(logits, spec_for(3))
    assert sampler.copies == sampler.readback.copies == 2
    assert first.result().ids.tolist() == [5, 5, 5] and second.result().ids.tolist() == [2, 2, 2]
    assert first.result() is first.result()                # waited for once
    assert sampler.launch(logits, SampleSpec()).result().ids.tolist() == []
    assert sampler.copies == 2
    ids = torch.tensor([4, 1])
    pending = Readback("cpu").copy(ids)
    ids[0] = 9
    assert pending.wait().tolist() == [4, 1]


def test_uniforms_are_a_fixed_function_of_the_key():
    u = uniforms(np.arange(20000) % 7, np.arange(20000) // 7, np.arange(20000))
    assert ((0 <= u) & (u < 1)).all() and abs(u.mean() - 0.5) < 0.01
    assert len(np.unique(u)) == len(u)
    assert uniforms(3, 1, 4) == uniforms(3, 1, 4) != uniforms(3, 1, 5)
    assert uniforms(2**63 - 1, 65535, 2**40) < 1


# -- parameters at the ends of their ranges -------------------------------------------------

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
V = 64


def unclamped(logits, spec):
    """The random slots' formula, row by row, with no clamping: float32(x) / T, top-k (the
    k-th largest value, ties kept), softmax, top-p, inverse CDF. The oracle for ordinary
    parameters, whose draws clamping must leave alone."""
    out = []
    for i, r in enumerate(spec.rows):
        t = torch.tensor(spec.temperature[i], dtype=torch.float64).float()
        x = logits[r].float() / t
        k, n = spec.top_k[i], x.shape[-1]
        if 0 < k < n:
            x = x.masked_fill(x < torch.topk(x, k).values[-1], -torch.inf)
        probs = torch.softmax(x, -1)
        if spec.top_p[i] < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            p = torch.tensor(spec.top_p[i], dtype=torch.float64).float()
            keep = torch.cumsum(sorted_p, 0) - sorted_p < p
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p * keep)
        cdf = torch.cumsum(probs.double(), 0)
        u = float(uniforms(spec.seed[i], spec.index[i], spec.position[i]))
        out.append(min(int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64),
                                              right=True)[0]), n - 1))
    return out


def edge_logits(dtype, rows=6):
    """Rows every dtype holds exactly: distinct values (spread to +-60000, near float16's
    limit, in row 0), a three-way tie for the top (row 1), -inf for half the vocabulary
    (row 2), a tie for the top among -inf entries (row 3)."""
    g = torch.Generator().manual_seed(21)
    logits = (torch.randn((rows, V), generator=g) * 4).to(dtype)
    logits[0] = torch.linspace(-60000, 60000, V)[torch.randperm(V, generator=g)].to(dtype)
    logits[1, [5, 20, 41]] = 30.0
    logits[2, ::2] = -torch.inf
    logits[3, 1::2] = -torch.inf
    logits[3, [8, 30]] = 25.0
    return logits


def batch(logits, params, seed=7, keys=None):
    """One slot per (row, temperature, top_k, top_p) of ``params``, keyed (seed, slot, 3)."""
    spec = SampleSpec()
    for j, (r, t, k, p) in enumerate(params):
        spec.add(r, t, k, p, seed, j if keys is None else keys[j], 3)
    return spec


ORDINARY = [(r, t, k, p) for r in range(6) for t, k, p in
            [(0.7, 0, 1.0), (1.3, 5, 0.9), (0.05, 0, 0.5), (4.0, 3, 1.0)]]


def check_ordinary_rows_unchanged(logits, got, n_extreme):
    """The batch's ordinary slots (after ``n_extreme`` extreme ones) drew what the
    unclamped formula draws, and what they draw in a batch of their own."""
    alone = batch(logits, ORDINARY, keys=list(range(n_extreme, n_extreme + len(ORDINARY))))
    want = unclamped(logits, alone)
    assert got[n_extreme:].tolist() == want == Sampler("cpu")(logits, alone).ids.tolist()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ordinary_parameters_draw_as_the_unclamped_formula(dtype):
    """Every value inside the thresholds, the thresholds included, reaches the device as
    given: the draws are those of the formula without any clamping, slot by slot."""
    from cellcache.generate.sampler import TEMPERATURE_MAX, TEMPERATURE_MIN, TOP_P_MIN

    g = torch.Generator().manual_seed(5)
    logits = (torch.randn((6, V), generator=g) * 3).to(dtype)
    params = list(ORDINARY)
    params += [(r, TEMPERATURE_MIN, 0, 1.0) for r in range(4)]
    params += [(r, TEMPERATURE_MAX, k, 1.0) for r in range(4) for k in (0, 7)]
    params += [(r, 1.0, 0, TOP_P_MIN) for r in range(4)]
    params += [(r, 0.9, k, p) for r in range(6) for k in (0, 1, 10, V) for p in (1.0, 0.95, 0.3, 1e-3)]
    spec = batch(logits, params, seed=12)
    got = Sampler("cpu")(logits, spec).ids.tolist()
    assert got == unclamped(logits, spec)
    assert len(set(got)) > 10                        # the draws are spread, not one id


def test_a_spec_said_random_without_random_slots_draws_greedy():
    """A caller's ``random=True`` over slots that are all greedy (a slice of a random
    plan) goes through the random path with no slot in it: the argmax of every row."""
    logits = torch.randn((4, V), generator=torch.Generator().manual_seed(9))
    spec = spec_for(4)
    spec.random = True
    assert Sampler("cpu")(logits, spec).ids.tolist() == torch.argmax(logits, -1).tolist()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tiny_temperatures_draw_the_top_logit(dtype):
    """A temperature below TEMPERATURE_MIN (subnormal in float32, 0 in float32, or just
    under the threshold) draws as T -> 0+: the largest logit where it is unique, one of the
    tied largest where several are (seeded, each of them for some key), never a -inf one.
    Such a slot draws what the formula draws at the threshold itself; the batch's
    ordinary slots draw what they draw without it."""
    from cellcache.generate.sampler import TEMPERATURE_MIN

    logits = edge_logits(dtype)
    top = torch.argmax(logits.float(), -1).tolist()
    ties = {1: {5, 20, 41}, 3: {8, 30}}
    for t in (1e-39, 1e-300, 5e-324, TEMPERATURE_MIN / 2, 1e-30):
        for k, p in ((0, 1.0), (4, 1.0), (0, 0.9)):
            extreme = [(r, t, k, p) for r in range(6) for _ in range(8)]
            sampler = Sampler("cpu")
            got = sampler(logits, batch(logits, extreme + ORDINARY)).ids
            n = len(extreme)
            for j, (r, *_rest) in enumerate(extreme):
                assert got[j] in ties.get(r, {top[r]}), (t, k, p, r, got[j])
            at_min = batch(logits, [(r, TEMPERATURE_MIN, k, p) for r, *_ in extreme])
            assert got[:n].tolist() == unclamped(logits, at_min)
            check_ordinary_rows_unchanged(logits, got, n)
            assert sampler.copies == 1
    # the ties share the draws: each tied id for some keys
    many = batch(logits, [(1, 1e-300, 0, 1.0)] * 300 + [(3, 1e-300, 0, 1.0)] * 300)
    drawn = Sampler("cpu")(logits, many).ids
    assert set(drawn[:300].tolist()) == ties[1] and set(drawn[300:].tolist()) == ties[3]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tiny_top_p_keeps_the_top_token(dtype):
    """A top_p below TOP_P_MIN (subnormal or 0 in float32) keeps the most probable token
    alone, as any top_p under the largest probability does (1e-6 here, vocabulary 64): the
    same draws, slot for slot, at every temperature and with top-k; the batch's ordinary
    slots are unchanged."""
    from cellcache.generate.sampler import TOP_P_MIN

    logits = edge_logits(dtype)
    top = torch.argmax(logits.float(), -1).tolist()
    for p in (1e-40, 1e-46, 1e-300, 5e-324, TOP_P_MIN / 2):
        extreme = [(r, t, k, p) for r in range(6) for t in (0.3, 1.0, 50.0) for k in (0, 5)]
        got = Sampler("cpu")(logits, batch(logits, extreme + ORDINARY)).ids
        n = len(extreme)
        at_small_p = batch(logits, [(r, t, k, 1e-6) for r, t, k, _ in extreme])
        assert got[:n].tolist() == unclamped(logits, at_small_p)
        for j, (r, *_rest) in enumerate(extreme):
            if r not in (1, 3):                      # a unique top: it
                assert got[j] == top[r]
            else:                                    # tied tops: one of them
                assert got[j] in ({5, 20, 41} if r == 1 else {8, 30})
        check_ordinary_rows_unchanged(logits, got, n)
        # at a temperature so high that every probability rounds alike: still the top logit
        hot = [(r, t, k, p) for r in range(6) for t in (1e30, 1e300) for k in (0, 5)]
        got = Sampler("cpu")(logits, batch(logits, hot + ORDINARY)).ids
        for j, (r, *_rest) in enumerate(hot):
            assert got[j] == top[r] if r not in (1, 3) else got[j] in ({5, 20, 41} if r == 1 else {8, 30})
        check_ordinary_rows_unchanged(logits, got, len(hot))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_huge_temperatures_draw_uniformly_over_the_kept_tokens(dtype):
    """A temperature above TEMPERATURE_MAX (inf in float32 from 3.5e38 up) draws as
    T -> inf: uniformly over the top-k set, never a -inf id, as the formula does at 1e15
    (where the logits' span over T, under 2**-25, already rounds every exp to 1); top-k 1
    is then the top logit. The batch's ordinary slots are unchanged."""
    logits = edge_logits(dtype)
    f = logits.float()
    for t in (1e300, 1e39, 2.0 ** 70):
        for k in (0, 1, 3):
            extreme = [(r, t, k, 1.0) for r in range(6) for _ in range(8)]
            got = Sampler("cpu")(logits, batch(logits, extreme + ORDINARY)).ids
            n = len(extreme)
            at_1e15 = batch(logits, [(r, 1e15, k, 1.0) for r, *_ in extreme])
            assert got[:n].tolist() == unclamped(logits, at_1e15)
            for j, (r, *_rest) in enumerate(extreme):
                assert torch.isfinite(f[r, got[j]])
                if k:
                    assert f[r, got[j]] >= torch.topk(f[r], k).values[-1]
            check_ordinary_rows_unchanged(logits, got, n)
    m = 4000
    for r, k, support in ((2, 0, V // 2), (0, 3, 3), (1, 2, 3)):   # row 1: 3 tied at the top
        drawn = Sampler("cpu")(logits, batch(logits, [(r, 1e300, k, 1.0)] * m)).ids
        freq = np.bincount(drawn, minlength=V)
        kept = np.flatnonzero(freq)
        assert len(kept) == support and np.isfinite(f[r, kept].numpy()).all()
        assert np.abs(freq[kept] / m - 1 / support).max() < 4 * np.sqrt(1 / support / m), freq[kept]


# -- the slots' parameters kept from one spec to the next ------------------------------------

def steady_specs(first, steps):
    """Specs as a steady decode plans them (:meth:`SampleSpec.next_step`): each shares the
    one before's lists and moves its positions on by one, as an int64 array."""
    out = [first]
    for _ in range(steps - 1):
        nxt = out[-1].next_step()
        assert nxt.temperature is first.temperature and isinstance(nxt.position, np.ndarray)
        out.append(nxt)
    return out


def mixed_spec(n):
    """Greedy, plain-temperature, top-k, top-p and extreme slots side by side, each its own key."""
    kinds = [(0.0, 0, 1.0), (0.8, 0, 1.0), (1.2, 5, 1.0), (0.6, 0, 0.7), (1e-30, 0, 1.0),
             (1e30, 3, 1.0), (0.9, 0, 1e-30)]
    spec = SampleSpec()
    for i in range(n):
        t, k, p = kinds[i % len(kinds)]
        spec.add(i, t, k, p, 11 + i // 4, i % 4, 5 + i)
    return spec


def test_steady_specs_sharing_lists_draw_what_fresh_specs_draw():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn((14, V), generator=g) * 3
    kept = Sampler("cpu")
    for spec in steady_specs(mixed_spec(14), 5):
        fresh = SampleSpec()
        for i in range(len(spec)):
            fresh.add(spec.rows[i], spec.temperature[i], spec.top_k[i], spec.top_p[i], spec.seed[i],
                      spec.index[i], int(spec.position[i]))
        got = kept(logits, spec).ids
        want = unclamped_or_greedy(logits, fresh)
        assert got.tolist() == Sampler("cpu")(logits, fresh).ids.tolist() == want


def unclamped_or_greedy(logits, spec):
    """Each slot's token by :func:`unclamped` for ordinary parameters, argmax for greedy
    slots, and the limits (module docstring of the sampler) for the extreme ones."""
    out = []
    for i in range(len(spec)):
        t, k, p = spec.temperature[i], spec.top_k[i], spec.top_p[i]
        one = SampleSpec()
        if t == 0:
            out.append(int(torch.argmax(logits[spec.rows[i]])))
            continue
        if t < 2.0 ** -64 or p < 2.0 ** -64:     # the top logit (ties: drawn among them)
            t, k, p = 1.0, 1, 1.0
        t = min(t, 2.0 ** 64)
        one.add(spec.rows[i], t, k, p, spec.seed[i], spec.index[i], spec.position[i])
        out.append(unclamped(logits, one)[0])
    return out


def test_a_list_changed_in_place_is_drawn_with_its_new_values():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn((8, V), generator=g) * 3
    spec = mixed_spec(8)
    sampler = Sampler("cpu")
    sampler(logits, spec)
    for name, slot, value in [("temperature", 1, 0.0), ("temperature", 0, 2.5), ("top_k", 1, 1),
                              ("top_p", 3, 1.0), ("seed", 2, 99), ("index", 3, 7)]:
        getattr(spec, name)[slot] = value
        assert sampler(logits, spec).ids.tolist() == Sampler("cpu")(logits, spec).ids.tolist() \
            == unclamped_or_greedy(logits, spec), name


def test_the_same_lists_over_another_vocabulary_are_clamped_for_it():
    spec = SampleSpec()
    for i in range(16):                           # top-k 40: all of 40 ids, a cut of 64
        spec.add(i, 100.0, 40, 1.0, 5, i, 0)
    sampler = Sampler("cpu")
    for vocab in (40, 64):
        logits = torch.randn((16, vocab), generator=torch.Generator().manual_seed(vocab)) * 3
        got = sampler(logits, spec).ids
        assert got.tolist() == Sampler("cpu")(logits, spec).ids.tolist()
        kth = torch.topk(logits, min(40, vocab), dim=-1).values[:, -1]
        assert (logits[torch.arange(16), torch.as_tensor(got)] >= kth).all()


def test_a_spec_reads_the_logits_unless_every_slot_is_its_rows_argmax():
    """``SampleSpec.reads_logits``: False only when every slot draws greedily from its own
    row with no server knob and no prompt log-probabilities (then a replayed graph's
    argmax is the whole draw)."""
    from cellcache.generate import Sampling
    from cellcache.generate.plan import SlotExtra

    assert not spec_for(4).reads_logits(4)
    assert spec_for(4).reads_logits(5)                         # a row nobody draws from
    assert spec_for(3, rows=[0, 0, 1]).reads_logits(3)         # n > 1 continuations share a row
    assert spec_for(4, temperature=0.7).reads_logits(4)
    said = spec_for(4)
    said.random = True                                         # as the caller says, not looked at
    assert said.reads_logits(4)
    knob = spec_for(4)
    knob.extras.append(SlotExtra(1, Sampling(logprobs=1)))
    assert knob.reads_logits(4)
    prompt = spec_for(4)
    prompt.prompt_rows.append((2, 5, 0))
    assert prompt.reads_logits(4)


def test_a_spec_that_reads_no_logits_draws_from_the_greedy_ids_alone():
    """The other side of ``reads_logits``: for random specs (rows shared or not, greedy and
    sampled slots, the caller's ``dense``/``random`` overrides, verify groups with drafts)
    whose ``reads_logits`` is False, the draws come from the given greedy ids alone: logits
    of NaN (whose argmax is id 0) leave them unchanged, and verify groups count their
    accepted drafts from those ids."""
    rng = np.random.default_rng(5)
    checked = 0
    for _ in range(300):
        n = int(rng.integers(1, 9))
        rows = list(range(n)) if rng.random() < 0.7 else sorted(rng.integers(0, n, n).tolist())
        temps = [0.0 if rng.random() < 0.8 else 0.7 for _ in range(n)]
        spec = SampleSpec()
        for i in range(n):
            spec.add(rows[i], temps[i], 0, 1.0, 1, 0, i, int(rng.integers(-1, 6)))
        if rng.random() < 0.3:
            spec.dense = n if rows == list(range(n)) else None
        if rng.random() < 0.3:
            spec.random = any(t > 0 for t in temps) or bool(rng.random() < 0.5)
        if n >= 2 and rng.random() < 0.5:
            spec.groups.append((0, n - 1))
            spec.draft[n - 1] = -1
        if spec.reads_logits(n):
            continue
        checked += 1
        greedy = torch.tensor(rng.integers(1, 6, n), dtype=torch.int64)
        out = Sampler("cpu").launch(torch.full((n, 6), float("nan")), spec, greedy).result()
        assert out.ids.tolist() == greedy.tolist()
        for g, (first, drafts) in enumerate(spec.groups):
            ok = 0
            while ok < drafts and spec.draft[first + ok] == int(greedy[first + ok]):
                ok += 1
            assert out.accepted[g] == ok
    assert checked > 50
