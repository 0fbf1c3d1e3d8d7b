"""The sm_90a prefill kernels (cuda/tc_sm90a.cu). The bench's entries (tools/_sm90a.py): on
Hopper each kernel, in each unit order, equals float32 attention over the same paged K/V
(ragged runs, a history before the causal part, packed GQA rows, runs shorter than a block, a
unit of a run without queries doing nothing); on any other GPU the shipped sm_90a PTX is
refused with cellcache's CudaError. The runner's (cellcache.cuda.tc, every entry: ``pipe``,
``qpre`` and ``early``): chosen on Hopper only, equal to float64 attention over the cache's
own steps, their device-made list the host's, captured and replayed over other steps."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cellcache.cuda.tc import HOPPER_ENTRIES

from ..helpers import load_tool

# (history, new tokens) a run; (5, 0): a run with no query (no unit of the list; one added
# by hand must read and write nothing)
RUNS = [(0, 1), (7, 5), (5, 0), (100, 130), (1000, 300), (0, 257)]
EMPTY = 2


def _case(torch, H, Hkv, D, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(n for _, n in RUNS)
    cells = sum(h + n for h, n in RUNS) + 64
    q = torch.randn((T, H, D), generator=g, device="cuda").bfloat16()
    k = torch.randn((cells, Hkv, D), generator=g, device="cuda").bfloat16()
    v = torch.randn((cells, Hkv, D), generator=g, device="cuda").bfloat16()
    kvi = torch.randperm(cells, generator=g, device="cuda").int()[:sum(h + n for h, n in RUNS)].contiguous()
    qo, kv = [0], [0]
    for h, n in RUNS:
        qo.append(qo[-1] + n)
        kv.append(kv[-1] + h + n)
    return q, k, v, kvi, qo, kv


def _reference(torch, q, k, v, kvi, qo, kv, G):
    out = torch.empty(q.shape, device="cuda")
    for r, (h, n) in enumerate(RUNS):
        if n == 0:
            continue
        c = kvi[kv[r]:kv[r + 1]].long()
        kk = k[c].float().repeat_interleave(G, dim=1)
        vv = v[c].float().repeat_interleave(G, dim=1)
        s = torch.einsum("nhd,lhd->hnl", q[qo[r]:qo[r + 1]].float(), kk) / math.sqrt(q.shape[-1])
        tok = torch.arange(n, device="cuda")[:, None]
        key = torch.arange(h + n, device="cuda")[None, :]
        s.masked_fill_((key > h + tok)[None], float("-inf"))
        out[qo[r]:qo[r + 1]] = torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), vv)
    return out


@pytest.mark.parametrize("H,Hkv,D", [(16, 4, 128), (14, 2, 64), (4, 4, 64)])
def test_the_sm90a_kernels_equal_float32_attention_on_hopper_and_are_refused_elsewhere(H, Hkv, D):
    torch = pytest.importorskip("torch")
    from cellcache.errors import CudaError

    k90 = load_tool("_sm90a")
    torch.zeros(1, device="cuda")                    # the primary context, current
    if torch.cuda.get_device_capability(0) != (9, 0):
        with pytest.raises(CudaError, match="tc_sm90a.ptx"):
            k90.Sm90aPrefill()
        return
    q, k, v, kvi, qo, kv = _case(torch, H, Hkv, D)
    ref = _reference(torch, q, k, v, kvi, qo, kv, H // Hkv)
    qo_d = torch.tensor(qo, dtype=torch.int32, device="cuda")
    kv_d = torch.tensor(kv, dtype=torch.int32, device="cuda")
    kern = k90.Sm90aPrefill()
    try:
        stream = torch.cuda.current_stream().cuda_stream
        for order in k90.ORDERS:
            listed = k90.units(qo, kv, len(RUNS), H // Hkv, Hkv, order, 1500)
            assert EMPTY not in listed[:, 0].tolist()
            listed = np.concatenate([listed, [[EMPTY, 0, 0, 0]]]).astype(np.int32)
            units = torch.as_tensor(listed, device="cuda")
            for kernel in k90.KERNELS:
                out = torch.full_like(q, float("nan"))
                kern.run(kernel, q, k, v, qo_d.data_ptr(), kv_d.data_ptr(), kvi.data_ptr(), units, H, Hkv,
                         out, stream)
                torch.cuda.synchronize()
                assert not out.isnan().any(), (kernel, order)
                err = float((out.float() - ref).abs().max())
                assert err < 3e-2, (kernel, order, err)
    finally:
        kern.close()


# -- the runner's launch (cellcache.cuda.tc: tc90_plan, persistent tc90_<entry>) ------------------

@pytest.mark.parametrize("entry", HOPPER_ENTRIES)
@pytest.mark.parametrize("D,G", [(128, 4), (64, 7), (64, 1)])
def test_the_tensor_core_kernels_run_prefill_on_sm90a_on_hopper_only(D, G, entry):
    """``TensorCoreAttention`` loads the sm_90a kernels on compute capability 9.0 (bf16 pools)
    and nowhere else (``hopper=True`` is refused there, naming the GPU). On Hopper a prefill
    launch with the table's choice runs them: decode-shaped, prefill and mixed steps, padded
    or not, equal float64 attention and leave zeros in the padding rows; the device's work
    list is the host's run-by-run list of the step's real runs; a decode step, a window or a
    variant of the table keep the sm_80 kernels (the list stays the last sm_90a step's)."""
    torch = pytest.importorskip("torch")
    from cellcache.cuda.tc import TensorCoreAttention
    from cellcache.errors import InvalidArgument

    from .test_cuda_tensor_core import N_KV, WINDOW, Rig, _steps

    k90 = load_tool("_sm90a")
    rig = Rig("bfloat16", D, G, hist=(1, 700), capacity=16384, seed=D + G)
    rig.tc.hopper_entry = entry                      # (tc90_<entry>_bf16_d<D>)
    try:
        hopper = torch.cuda.get_device_capability(0) == (9, 0)
        assert (rig.tc.hopper is not None) == hopper, rig.tc.hopper_reason
        sm = torch.cuda.get_device_properties(0).multi_processor_count
        if not hopper:
            assert "compute capability" in rig.tc.hopper_reason
            with pytest.raises(InvalidArgument, match="compute capability"):
                TensorCoreAttention("bfloat16", sm, hopper=True)
            return
        with pytest.raises(InvalidArgument, match="float16"):
            TensorCoreAttention("float16", sm, hopper=True)
        for kind, ids, pad in _steps(rig.rng, rig.seqs):
            st, view, k_pool, v_pool, q = rig.step(ids, pad)
            what = f"d{D} G{G} {kind} pad {pad - len(ids)}"
            rig.check(st, view, k_pool, v_pool, q, 0, what=what + " sm_90a")
            hv = rig.host_view(view, pad)
            runs = int(np.searchsorted(hv["qo_indptr"], hv["width"]))     # the real runs
            want = k90.units(hv["qo_indptr"][:runs + 1], hv["kv_indptr"][:runs + 1], runs, G, N_KV, "run")
            got = rig.tc.hopper_units()
            assert got.tolist() == want.tolist(), what
            # the sm_80 kernels for what sm_90a does not take: its list stays as it was
            rig.check(st, view, k_pool, v_pool, q, WINDOW, what=what + " window")
            rig.check(st, view, k_pool, v_pool, q, 0, what=what + " decode variant",
                      choices=[{"decode": True}])
            rig.check(st, view, k_pool, v_pool, q, 0, what=what + " table variant",
                      choices=[{"variant": rig.tc.choose(D).variant}])
            assert rig.tc.hopper_units().tolist() == got.tolist(), what
    finally:
        rig.close()


@pytest.mark.parametrize("entry", HOPPER_ENTRIES)
def test_a_captured_sm90a_launch_replays_over_other_steps_and_other_layers_keep_its_list(entry):
    """tc90_plan and tc90_<entry> captured once over a padded 1024-row mixed step replay over
    two other steps of those rows (other runs, lengths and width); a second launch of the same
    step with ``fresh=False`` (a later layer) keeps the list, a windowed launch between them
    (the sm_80 kernels) does not disturb it, and a ``fresh=True`` launch of a new step plans
    it anew. (On another GPU the same launches run the sm_80 kernels and must pass alike.)"""
    torch = pytest.importorskip("torch")
    from .test_cuda_tensor_core import WINDOW, Rig

    G, D, rows = 4, 128, 1024
    rig = Rig("bfloat16", D, G, n_seqs=16, hist=(1, 1200), capacity=60000, max_write=rows, seed=3)
    rig.tc.hopper_entry = entry
    try:
        rng = rig.rng
        hopper = rig.tc.hopper is not None
        assert hopper == (torch.cuda.get_device_capability(0) == (9, 0)), rig.tc.hopper_reason

        def mixed(width):
            ids, seqs, j = [], [int(s) for s in rng.permutation(rig.seqs)], 0
            while len(ids) < width:
                s = seqs[j % len(seqs)]
                n = 1 if j % 3 else int(rng.integers(50, 400))
                if not ids or ids[-1] != s:
                    ids += [s] * min(n, width - len(ids))
                j += 1
            return ids

        st, view, k_pool, v_pool, q = rig.step(mixed(1000), rows)
        out = torch.empty_like(q)
        rig.run(view, rows, q, k_pool, v_pool, out, 0)                    # eager: allocates the list
        rig.check(st, view, k_pool, v_pool, q, 0, out=out, what="eager")
        first = rig.tc.hopper_units() if hopper else None
        rig.run(view, rows, q, k_pool, v_pool, out, WINDOW, fresh=False)   # a windowed layer: sm_80
        rig.check(st, view, k_pool, v_pool, q, WINDOW, out=out, what="windowed layer")
        out.fill_(float("nan"))
        rig.run(view, rows, q, k_pool, v_pool, out, 0, fresh=False)        # a later layer: the list kept
        rig.check(st, view, k_pool, v_pool, q, 0, out=out, what="later layer")
        assert not hopper or rig.tc.hopper_units().tolist() == first.tolist()
        stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            rig.run(view, rows, q, k_pool, v_pool, out, 0)
        for width in (700, 1024):
            st2, view2, k2, v2, q2 = rig.step(mixed(width), rows)
            assert view2.paged_pointers() == view.paged_pointers() and k2.data_ptr() == k_pool.data_ptr()
            q.copy_(q2)
            out.fill_(float("nan"))
            graph.replay()
            rig.check(st2, view2, k2, v2, q, 0, out=out, what=f"replay width {width}")
            assert not hopper or rig.tc.hopper_units().tolist() != first.tolist()
        del graph
    finally:
        rig.close()
