"""The attention path chosen per shape (cellcache.cuda.kernels.choose_path), the shapes the
CUDA-core kernels take, their launch layouts (threads, tiles, shared memory) for every such
shape, and the refusals of cellcache.torch.attention that come before any write.

No GPU is needed: the layouts are pure functions the launchers use, checked against the
kernels' own limits (cuda/attention.cu)."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings")           # cellcache.cuda.kernels imports the driver module

from cellcache import CacheConfig, HostCellCache, InvalidArgument, LayerConfig  # noqa: E402
from cellcache.cuda import kernels as ck  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("float32", "float16", "bfloat16")
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
THREADS = 128
MAX_SMEM = 227 * 1024                      # dynamic shared memory of one block on sm_80/sm_90


def _defines() -> dict[str, int]:
    text = (ROOT / "cuda" / "attention.cu").read_text()
    return {k: int(v) for k, v in re.findall(r"^#define (\w+) (\d+)\b", text, re.M)}


@pytest.fixture
def no_tc(monkeypatch):
    monkeypatch.setattr(ck, "tensor_cores", lambda: None)


def test_the_host_constants_are_the_kernel_files():
    d = _defines()
    assert ck.DEFAULT_CONFIG == {"decode_stages": d["DECODE_STAGES"], "prefill_stages": d["PREFILL_STAGES"],
                                 "prefill_maxp": d["PREFILL_MAXP"], "plan_threads": d["PLAN_THREADS"]}
    assert d["MAX_HEAD_DIM"] == ck.MAX_HEAD_DIM
    assert ck.decode_heads == tuple(int(n) for n in re.findall(
        r"DECODE\(SUFFIX, T, (\d+)\)", (ROOT / "cuda" / "attention.cu").read_text()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_kernels_take_every_multiple_of_8_up_to_256_and_groups_1_to_16(dtype):
    for d in range(1, 300):
        for g in (0, 1, 2, 3, 7, 8, 15, 16, 17, 32):
            assert ck.paged_supports(dtype, d, g) == (d % 8 == 0 and d <= 256 and 1 <= g <= 16), (d, g)
    assert not ck.paged_supports("float64", 64, 1)
    assert not ck.paged_supports(dtype, 64.0, 1)


def test_choose_path_order_and_its_refusal(no_tc):
    assert ck.choose_path("bfloat16", 128, 4) == "paged"
    assert ck.choose_path("float32", 8, 16) == "paged"
    # not taken by the CUDA-core kernels: FlashInfer where it takes the shape, else SDPA
    assert ck.choose_path("bfloat16", 64, 32, have_flashinfer=True, has_masks=True) == "flashinfer"
    assert ck.choose_path("bfloat16", 12, 4, have_flashinfer=True, has_masks=True) == "sdpa"
    assert ck.choose_path("float32", 264, 1, have_flashinfer=True, has_masks=True) == "sdpa"
    for args, fi in ((("float32", 264, 1), True), (("bfloat16", 12, 4), True),
                     (("bfloat16", 64, 17), False)):
        with pytest.raises(InvalidArgument, match=f"head_dim={args[1]}, group={args[2]}.*SDPA needs masks"):
            ck.choose_path(*args, have_flashinfer=fi)


def test_choose_path_for_8bit_pools_skips_the_cuda_core_kernels(no_tc):
    # they read 16-bit pools only: FlashInfer's e4m3 K/V kernels where they take the shape,
    # else SDPA over the dequantized pools, else a refusal naming every path
    assert ck.choose_path("bfloat16", 128, 4, have_flashinfer=True, kv8=True) == "flashinfer"
    assert ck.choose_path("bfloat16", 128, 4, have_flashinfer=False, has_masks=True, kv8=True) == "sdpa"
    assert ck.choose_path("bfloat16", 96, 4, have_flashinfer=True, has_masks=True, kv8=True) == "sdpa"
    with pytest.raises(InvalidArgument, match="8-bit K/V at head_dim=96.*FlashInfer.*SDPA needs masks"):
        ck.choose_path("bfloat16", 96, 4, have_flashinfer=True, kv8=True)


def test_choose_path_takes_the_tensor_core_hook_first(monkeypatch):
    fake = types.SimpleNamespace(supports=lambda dtype, d, g: dtype != "float32" and d in (64, 128))
    monkeypatch.setattr(ck, "tensor_cores", lambda: fake)
    assert ck.choose_path("bfloat16", 128, 4) == "tc"
    assert ck.choose_path("bfloat16", 128, 4, tc_aligned=False) == "paged"
    assert ck.choose_path("float32", 128, 4) == "paged"
    assert ck.choose_path("bfloat16", 96, 4) == "paged"
    monkeypatch.setattr(ck, "tensor_cores", lambda: None)
    assert ck.choose_path("bfloat16", 128, 4) == "paged"


def test_tensor_cores_is_none_or_a_module_with_the_hook():
    tc = ck.tensor_cores()
    assert tc is None or (callable(tc.supports) and callable(tc.aligned))


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_layout_fits_the_kernel_for_every_supported_shape(dtype):
    isz = ITEMSIZE[dtype]
    for d in range(8, 257, 8):
        for g in range(1, 17):
            lay = ck.decode_layout(dtype, d, g, threads=THREADS)
            bdx, bdy, bdz, tile = lay["bdx"], lay["bdy"], lay["bdz"], lay["tile"]
            assert lay["heads"] in ck.decode_heads
            assert bdx * bdy * bdz == THREADS and bdx <= 32 and bdx & (bdx - 1) == 0
            assert bdx * 8 >= d and bdy * lay["heads"] >= g
            assert tile % bdz == 0 and bdz <= tile <= THREADS      # index loads: one per thread
            assert lay["pitch"] % 16 == 0 and lay["pitch"] >= d * isz
            ring = 3 * 2 * tile * lay["pitch"] + 3 * tile * 4
            merge = 4 * (bdz * bdy * lay["heads"] * (bdx * 8 + 2))
            assert lay["smem"] == max(ring, merge) <= 64 * 1024, (d, g, lay)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_layout_fits_the_kernel_for_every_supported_shape(dtype):
    isz = ITEMSIZE[dtype]
    maxp = ck.DEFAULT_CONFIG["prefill_maxp"]
    for d in range(8, 257, 8):
        for g in range(1, 17):
            lay = ck.prefill_layout(dtype, d, g)
            kt, pairs = lay["kt"], lay["pairs"]
            assert kt in (16, 32) and THREADS % kt == 0
            assert pairs == lay["qt"] * g and pairs <= 64 and lay["qt"] >= 1
            assert -(-pairs // (THREADS // kt)) <= maxp                 # pairs a thread scores
            assert (lay["pitch"] // 16) % 2 == 1 and lay["pitch"] >= d * isz
            assert lay["smem"] <= MAX_SMEM, (d, g, lay)


def test_copy_unit_is_the_widest_the_addresses_allow():
    assert ck.copy_unit(2, 0x1000, 0x2000, 256) == 16
    assert ck.copy_unit(2, 0x1008, 0x2000, 256) == 8
    assert ck.copy_unit(2, 0x1002, 0x2000, 160) == 2
    assert ck.copy_unit(4, 0x1004, 0x2000, 32) == 4
    assert ck.copy_unit(4, 0x1002, 0x2000, 32) == 0           # not even element-aligned
    assert ck.copy_unit(2, 0x1000, 0x2000, 48) == 16


def test_splits_fill_the_device_and_stay_in_range():
    k = object.__new__(ck.AttentionKernels)
    k.sm_count = 132
    for rows in (1, 2, 7, 64, 256, 1024):
        for kv in (1, 2, 8):
            s = k.splits_for(rows, kv, per_sm=4)
            assert 1 <= s <= 32
            blocks = rows * kv * s
            if rows * kv < 4 * 132:
                assert blocks >= min(32 * rows * kv, 4 * 132 * 0.9) or s == 32
    assert k.splits_for(1, 1, per_sm=4) == 32


def test_attention_refuses_the_kernel_backends_on_a_host_cache_before_writing():
    """backend 'tc', 'paged', 'prefill' need a CUDA cache with the paged view: refused with
    InvalidArgument and the pools unchanged."""
    torch = pytest.importorskip("torch")
    import cellcache.torch as cct

    cfg = CacheConfig(capacity=64, layers=[LayerConfig(2, 8)], max_write=8, dtype="float32",
                      paged=True, mask_format="bool")
    cache = HostCellCache(cfg)
    view = cct.TorchView(cache)
    a = cache.seq_new()
    assert cache.declare_step([a] * 3)
    step = cache.prepare_step()
    k_pool, v_pool, _ = view.layer(0)
    before = (k_pool.clone(), v_pool.clone())
    q, k, v = torch.ones((3, 4, 8)), torch.ones((3, 2, 8)), torch.ones((3, 2, 8))
    for backend in ("tc", "paged", "prefill"):
        with pytest.raises(InvalidArgument, match=f"backend '{backend}' needs a CUDA cache"):
            cct.attention(view, 0, q, k, v, step=step, backend=backend)
    with pytest.raises(InvalidArgument, match="is not one of auto, paged, prefill, tc"):
        cct.attention(view, 0, q, k, v, step=step, backend="fast")
    assert torch.equal(k_pool, before[0]) and torch.equal(v_pool, before[1])
    cache.commit_step()


def test_cellcache_sm90a_turns_the_hopper_kernels_on_off_or_auto(monkeypatch):
    """``CELLCACHE_SM90A``: unset or empty -> None (wherever the GPU takes them), 0 -> never,
    1 -> required; any other value is refused, naming the variable."""
    pytest.importorskip("torch")
    from cellcache import InvalidArgument
    from cellcache.torch import sm90a_setting

    monkeypatch.delenv("CELLCACHE_SM90A", raising=False)
    assert sm90a_setting() is None
    for value, want in (("", None), ("0", False), ("1", True)):
        monkeypatch.setenv("CELLCACHE_SM90A", value)
        assert sm90a_setting() is want
    for bad in ("yes", "2", " 1", "true"):
        monkeypatch.setenv("CELLCACHE_SM90A", bad)
        with pytest.raises(InvalidArgument, match="CELLCACHE_SM90A"):
            sm90a_setting()
