"""The sm_90a prefill kernels (cuda/tc_sm90a.cu, launched by tools/_sm90a.py for the attention
bench): on Hopper each kernel, in each unit order, equals float32 attention over the same
paged K/V (ragged runs, a history before the causal part, packed GQA rows, runs shorter than
a block, a unit of a run without queries doing nothing); on any other GPU the shipped sm_90a
PTX is refused with cellcache's CudaError."""

from __future__ import annotations

import math

import numpy as np
import pytest

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
