"""The sm_90a prefill kernels' host side (tools/_sm90a.py): the work list the attention bench
launches them over, and that what it launches is what the shipped PTX holds."""

from __future__ import annotations

import re

import numpy as np
import pytest

from cellcache.cuda.tc import HOPPER_ENTRIES

from .helpers import TOOLS, load_tool

ROOT = TOOLS.parent


@pytest.fixture(scope="module")
def k90():
    return load_tool("_sm90a")


# (history, new tokens) a run: an empty history, a run shorter than one block, a block's edge
RUNS = [(0, 512), (8192, 37), (100, 130), (0, 1), (5, 64)]


def _indptr(runs):
    qo, kv = [0], [0]
    for h, n in runs:
        qo.append(qo[-1] + n)
        kv.append(kv[-1] + h + n)
    return np.array(qo, dtype=np.int32), np.array(kv, dtype=np.int32)


@pytest.mark.parametrize("group,n_kv", [(7, 2), (4, 8), (1, 1)])
@pytest.mark.parametrize("order", ["run", "heaviest"])
def test_every_packed_row_is_in_one_unit_that_reads_its_keys(k90, group, n_kv, order):
    qo, kv = _indptr(RUNS)
    u = k90.units(qo, kv, len(RUNS), group, n_kv, order)
    assert u.dtype == np.int32 and u.shape[1] == 4 and (u[:, 3] == 0).all()
    seen = set()
    for run, kvh, row0, _ in u.tolist():
        h, n = RUNS[run]
        assert 0 <= kvh < n_kv and row0 % k90.ROWS == 0 and row0 < n * group
        for p in range(row0, min(row0 + k90.ROWS, n * group)):
            assert (run, kvh, p) not in seen
            seen.add((run, kvh, p))
    assert len(seen) == sum(n * group for _, n in RUNS) * n_kv


def test_run_order_keeps_a_runs_kv_head_together_and_heaviest_sorts_by_keys(k90):
    qo, kv = _indptr(RUNS)
    by_run = k90.units(qo, kv, len(RUNS), 4, 8, "run").tolist()
    pairs = [(r, h) for r, h, _, _ in by_run]
    # each (run, kv head) one stretch, in run then head order: neighbours read the same K/V
    stretches = [p for i, p in enumerate(pairs) if i == 0 or pairs[i - 1] != p]
    assert stretches == sorted(set(pairs))

    def keys(unit):
        run, _, row0, _ = unit
        h, n = RUNS[run]
        return h + min(row0 + k90.ROWS - 1, n * 4 - 1) // 4 + 1

    heavy = k90.units(qo, kv, len(RUNS), 4, 8, "heaviest").tolist()
    assert sorted(map(tuple, heavy)) == sorted(map(tuple, by_run))
    w = [keys(x) for x in heavy]
    assert w == sorted(w, reverse=True) and w[0] == 8192 + 37


def test_an_unknown_order_is_refused(k90):
    qo, kv = _indptr(RUNS)
    with pytest.raises(ValueError, match="order 'nope'"):
        k90.units(qo, kv, len(RUNS), 4, 8, "nope")


def test_a_cta_fits_the_shared_memory_hopper_gives_one_block(k90):
    for d in k90.STAGES:
        assert k90.smem_bytes(d) <= 227 * 1024, d


def test_the_stages_the_bench_sizes_shared_memory_for_are_the_kernels(k90):
    """smem_bytes counts STAGES[D] K/V stages; each kernel's instantiation in the source says
    how many it uses (TC90(name, head_dim, stages, ping-pong), TC90_ATTEND(name, head_dim, stages,
    first tile peeled, who copies Q))."""
    src = (ROOT / "cuda" / "tc_sm90a.cu").read_text()
    found = re.findall(r"^TC90\(tc90_(\w+)_bf16_d(\d+), (\d+), (\d+), (true|false)\)", src, re.M)
    assert sorted(found) == sorted((k, str(d), str(d), str(k90.STAGES[d]), str(k == "pingpong").lower())
                                   for k in k90.KERNELS for d in k90.STAGES)
    runner = re.findall(r"^TC90_ATTEND\(tc90_(\w+)_bf16_d(\d+), (\d+), (\d+), (true|false), (\d)\)",
                        src, re.M)
    qp = {"pipe": "0", "qpre": "1", "early": "2"}                      # who copies Q, and when
    assert sorted(runner) == sorted((e, str(d), str(d), str(k90.STAGES[d]), "true", qp[e])
                                    for e in HOPPER_ENTRIES for d in k90.STAGES)    # the runner's


def test_sections_keep_l2_sized_runs_together_heaviest_first(k90):
    qo, kv = _indptr(RUNS)
    keys = [h + n for h, n in RUNS]                  # a run's keys, each kv head
    span = 9000                                      # holds the 8229-key run alone, the rest together
    got = k90.units(qo, kv, len(RUNS), 4, 2, "sections", span).tolist()
    assert sorted(map(tuple, got)) == sorted(map(tuple, k90.units(qo, kv, len(RUNS), 4, 2, "run")))
    # sections in run order, each at most span keys (a pair larger than span stands alone)
    sections, cur, total = [], [], 0
    for r in range(len(RUNS)):
        for h in range(2):
            if cur and total + keys[r] > span:
                sections.append(cur)
                cur, total = [], 0
            cur.append((r, h))
            total += keys[r]
    sections.append(cur)
    at = 0
    for sec in sections:
        n = sum(1 for u in got if (u[0], u[1]) in sec)
        part = got[at:at + n]
        assert {(u[0], u[1]) for u in part} == set(sec)
        w = [RUNS[u[0]][0] + min(u[2] + 127, RUNS[u[0]][1] * 4 - 1) // 4 + 1 for u in part]
        assert w == sorted(w, reverse=True)
        at += n
    assert at == len(got) and len(sections) > 2
    with pytest.raises(ValueError, match="section_keys > 0"):
        k90.units(qo, kv, len(RUNS), 4, 2, "sections")
    assert k90.section_keys(50 << 20, 128) == (25 << 20) // 512


def test_the_kernels_the_bench_and_the_runner_launch_are_the_shipped_ptxs(k90):
    ptx = (ROOT / "cellcache" / "ptx" / "tc_sm90a.ptx").read_text()
    entries = re.findall(r"\.entry (\w+)\(.*?\.maxntid (\d+), 1, 1", ptx, re.S)
    assert {name: int(t) for name, t in entries} == {
        **{f"tc90_{k}_bf16_d{d}": k90.THREADS for k in k90.KERNELS for d in k90.STAGES},
        **{f"tc90_{e}_bf16_d{d}": k90.THREADS for e in HOPPER_ENTRIES for d in k90.STAGES}, "tc90_plan": 1024}


def test_the_launcher_refuses_what_the_kernel_would_misread(k90):
    """Checked before any driver call (so on the CPU too): the head size, the head counts,
    each tensor's dtype, layout and shape, the unit list's."""
    torch = pytest.importorskip("torch")
    k = k90.Sm90aPrefill.__new__(k90.Sm90aPrefill)      # no module: only the checks run
    k.functions = {(kernel, d): None for kernel in k90.KERNELS for d in k90.STAGES}
    bf = torch.bfloat16
    q, pool = torch.zeros((5, 8, 64), dtype=bf), torch.zeros((9, 2, 64), dtype=bf)
    good = torch.zeros((3, 4), dtype=torch.int32)
    cases = [
        (dict(q=torch.zeros((5, 8, 96), dtype=bf)), "head_dim 96"),
        (dict(n_heads=7), "7 query heads"),
        (dict(q=q.float()), "q must be contiguous bf16"),
        (dict(out=q.transpose(0, 1)), "out must be contiguous bf16"),
        (dict(k_pool=torch.zeros((9, 4, 64), dtype=bf)), "k_pool must be"),
        (dict(unit_list=good.long()), "unit_list must be contiguous int32"),
        (dict(unit_list=good[:, :3]), "unit_list must be"),
    ]
    for change, says in cases:
        args = dict(kernel="pingpong", q=q, k_pool=pool, v_pool=pool, qo_indptr=0, kv_indptr=0,
                    kv_indices=0, unit_list=good, n_heads=8, n_kv_heads=2, out=q.clone(), stream=0)
        args.update(change)
        if "q" in change and "out" not in change:
            args["out"] = torch.zeros_like(args["q"]) if args["q"].dtype == bf else q.clone()
        with pytest.raises(ValueError, match=says):
            k.run(**args)
