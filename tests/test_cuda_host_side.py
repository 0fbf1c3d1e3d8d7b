"""The CUDA backend's pieces that need no GPU: shipped PTX, the kernel ABI, DLPack capsules,
entry points, the probe, and the import graph."""

import ctypes
import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from cellcache import CudaError
from cellcache.cuda import _dlpack, _engine, _launch, probe
from cellcache.registry import resolve_backend

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "build_ptx.py"


def load_build_ptx():
    spec = importlib.util.spec_from_file_location("build_ptx", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_shipped_ptx_matches_the_kernel_sources():
    """Hashes, ISA and target always; the bytes too where the pinned NVRTC is installed
    (tools/test.sh installs it, so CI rebuilds byte for byte)."""
    # tools/test.sh sets CELLCACHE_REQUIRE_NVRTC: there the bytes are always compared
    require = ["--require-compiler"] if os.environ.get("CELLCACHE_REQUIRE_NVRTC") else []
    r = subprocess.run([sys.executable, str(TOOL), "--check", *require], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_shipped_ptx_loads_on_every_cuda_12_driver():
    m = json.loads((ROOT / "cellcache" / "ptx" / "manifest.json").read_text())
    assert set(m["kernels"]) == {p.stem for p in (ROOT / "cuda").glob("*.cu")}
    assert m["min_driver_cuda"] == "12.0" and m["compiler"] == "nvrtc 12.0.140"
    for name in m["kernels"]:
        head = (ROOT / "cellcache" / "ptx" / f"{name}.ptx").read_text()[:2000]
        assert re.search(r"^\.version 8\.0$", head, re.M), name
        # Hopper-only kernels (wgmma) in files named *_sm90a.cu; every other file Ampere's
        target = "sm_90a" if name.endswith("_sm90a") else "sm_80"
        assert re.search(rf"^\.target {target}$", head, re.M), name


def _tree_copy(tmp_path):
    for part in ("cuda", "tools", "cellcache/ptx"):
        shutil.copytree(ROOT / part, tmp_path / part)
    return tmp_path


@pytest.mark.parametrize("edit,expect", [
    (lambda t: (t / "cuda" / "step.cu").write_text((t / "cuda" / "step.cu").read_text() + "\n// x\n"),
     "step.cu (or a header) changed"),
    (lambda t: (t / "cuda" / "abi.h").write_text((t / "cuda" / "abi.h").read_text() + "\n// x\n"),
     "attention.cu (or a header) changed"),
], ids=["kernel", "header"])
def test_ptx_check_notices_a_changed_source(tmp_path, edit, expect):
    tree = _tree_copy(tmp_path)
    edit(tree)
    r = subprocess.run([sys.executable, str(tree / "tools" / "build_ptx.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and expect in r.stderr, r.stderr


def test_ptx_check_refuses_an_isa_newer_than_8_0(tmp_path):
    """PTX rebuilt by a newer compiler (ISA 9.0, CUDA 13 drivers only) must fail the check
    even with the manifest updated to match it."""
    tree = _tree_copy(tmp_path)
    ptx = tree / "cellcache" / "ptx" / "step.ptx"
    text = ptx.read_text().replace(".version 8.0", ".version 9.0", 1)
    ptx.write_text(text)
    manifest = json.loads((tree / "cellcache" / "ptx" / "manifest.json").read_text())
    import hashlib

    manifest["kernels"]["step"]["ptx_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    (tree / "cellcache" / "ptx" / "manifest.json").write_text(json.dumps(manifest))
    r = subprocess.run([sys.executable, str(tree / "tools" / "build_ptx.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "step.ptx is PTX ISA 9.0; at most 8.0" in r.stderr, r.stderr


@pytest.mark.parametrize("isa,cuda", [
    ("7.0", "11.0"), ("7.4", "11.4"), ("7.8", "11.8"), ("8.0", "12.0"), ("8.3", "12.3"),
    ("8.5", "12.4"), ("8.6", "12.7"), ("8.7", "12.8"), ("8.8", "12.9"), ("9.0", "13.0"),
])
def test_driver_for_isa_names_the_cuda_release(isa, cuda):
    assert load_build_ptx().driver_for_isa(isa) == cuda


def test_driver_for_isa_refuses_an_unknown_isa():
    with pytest.raises(ValueError, match="no known CUDA release for PTX ISA 9.9"):
        load_build_ptx().driver_for_isa("9.9")


def test_fused_launches_match_the_kernels_parameters_and_block_sizes():
    """Every entry of fused.ptx takes, in order, arguments of the sizes its launch packs
    (cellcache.cuda.fused.FORMATS), and the block sizes the host launches with are the
    source's #defines (the kernels index by them)."""
    from cellcache.cuda import fused

    ptx = (ROOT / "cellcache" / "ptx" / "fused.ptx").read_text()
    entries = re.findall(r"\.entry (\w+)\(\s*(.*?)\)", ptx, re.S)
    size = {"u64": 8, "s64": 8, "b64": 8, "u32": 4, "s32": 4, "b32": 4, "f32": 4}
    assert len(entries) > 10
    for name, params in entries:
        kind = max((k for k in fused.FORMATS if name.startswith(k)), key=len)   # (rotary_store_*)
        got = [size[t] for t in re.findall(r"\.param \.(\w+) ", params)]
        want = [struct.calcsize("=" + c) for c in fused.FORMATS[kind].lstrip("=")]
        assert got == want, name
    source = (ROOT / "cuda" / "fused.cu").read_text()
    values = dict(re.findall(r"^#define (\w+) (\d+)$", source, re.M))
    assert fused.THREADS == int(values["THREADS"])
    assert fused.SAMPLE_THREADS == int(values["SAMPLE_THREADS"])
    assert fused.SAMPLE_TILE == int(values["SAMPLE_TILE"])
    assert fused.LOGIT_THREADS == int(values["LOGIT_THREADS"])


def test_kernel_abi_has_one_source():
    """The engine takes its limits from cuda/abi.h; no Python or kernel file restates them."""
    header = (ROOT / "cuda" / "abi.h").read_text()
    values = dict(re.findall(r"^#define (CC_[A-Z_]+) (\d+)", header, re.M))
    assert _engine.MAX_WINDOWS == int(values["CC_MAX_WINDOWS"])
    assert _engine.STEP_THREADS == int(values["CC_STEP_THREADS"])
    assert _engine.MASK_COLS == int(values["CC_MASK_COLS"])
    assert _launch.ATTN_THREADS == int(values["CC_ATTN_THREADS"])
    assert _launch.PREFILL_PAIRS == int(values["CC_PREFILL_PAIRS"])
    # every field of cc_step_params is 8 bytes: 22 scalars and two windows arrays
    assert _engine.PARAMS_BYTES == 8 * (22 + 2 * _engine.MAX_WINDOWS)
    for path in list((ROOT / "cuda").glob("*.cu")) + list((ROOT / "cellcache").rglob("*.py")):
        text = path.read_text()
        for name in ("MAX_WINDOWS", "MASK_MAX_ROWS"):
            assert not re.search(rf"^\s*(#define\s+)?{name}\s*=?\s*\d+", text, re.M), (path, name)


def test_paged_args_pack_every_field():
    blob = _launch.paged_args(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 0.5)
    import struct

    assert len(blob) == 4 * 8 + 4 * 8 + 5 * 4 + 4
    assert struct.unpack("=8q5if", blob) == (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 0.5)


def step_param_fields():
    """The scalar fields of cc_step_params in cuda/abi.h, in order (windows/masks follow)."""
    header = (ROOT / "cuda" / "abi.h").read_text()
    body = re.search(r"typedef struct \{(.*?)\} cc_step_params;", header, re.S).group(1)
    fields = []
    for line in body.splitlines():
        decl = line.split("//")[0].strip().rstrip(";")
        if decl and "[" not in decl:
            fields += [name.strip() for name in decl.split(None, 1)[1].split(",")]
    return fields


def test_step_params_takes_each_field_by_its_abi_name():
    import struct

    fields = step_param_fields()
    assert len(fields) == 22
    values = {name: 1000 + k for k, name in enumerate(fields)}
    blob = _engine.step_params(**values, windows=[7, 9], masks=[0xAB, 0xCD])
    assert len(blob) == _engine.PARAMS_BYTES
    words = struct.unpack(f"=22q{_engine.MAX_WINDOWS}q{_engine.MAX_WINDOWS}Q", blob)
    n = _engine.MAX_WINDOWS
    assert words[:22] == tuple(values[name] for name in fields)
    assert words[22:22 + n] == (7, 9) + (0,) * (n - 2)
    assert words[22 + n:] == (0xAB, 0xCD) + (0,) * (n - 2)
    # the paged view's addresses default to 0; anything not a field is refused at the call
    paged = {"qo_indptr", "kv_indptr", "kv_indices", "run_seq", "run_last", "run_kv"}
    base = {k: v for k, v in values.items() if k not in paged}
    blob = _engine.step_params(**base, windows=[], masks=[])
    words = struct.unpack("=22q", blob[:22 * 8])
    assert [words[fields.index(name)] for name in sorted(paged)] == [0] * len(paged)
    with pytest.raises(TypeError, match="kv_last_page_len"):
        _engine.step_params(**base, windows=[], masks=[], kv_last_page_len=1)
    with pytest.raises(TypeError, match="capacity"):
        _engine.step_params(**{k: v for k, v in base.items() if k != "capacity"}, windows=[], masks=[])
    with pytest.raises(ValueError, match="at most"):
        _engine.step_params(**base, windows=[1] * (n + 1), masks=[])


def test_engine_resources_are_named_and_checked():
    good = dict(ctx=1, fn_apply=2, fn_build=3, params=4, slot_words=5, host_slots=(6, 7),
                dev_slots=(8, 9), slot_events=(10, 11), commit_event=12, sm_count=13,
                paged=True, masks=False)
    r = _engine.EngineResources(**good)
    assert {k: getattr(r, k) for k in good} == good
    # the signature the docstring declares (what help() and stubtest see) is the real one
    import inspect

    assert list(inspect.signature(_engine.EngineResources.__init__).parameters)[1:] == list(good)
    with pytest.raises(TypeError):
        _engine.EngineResources(*good.values())
    with pytest.raises(TypeError, match="sm_counts"):
        _engine.EngineResources(**good, sm_counts=1)
    with pytest.raises(ValueError, match="host_slots has 1 entries"):
        _engine.EngineResources(**{**good, "host_slots": (6,)})
    with pytest.raises(TypeError):
        _engine.EngineResources(**{**good, "ctx": "ctx"})


def test_engine_target_blocks_is_checked_and_a_refusal_changes_nothing():
    """The mask grid's target (8 blocks an SM) is settable for grid sweeps; a value the grid
    cannot use (0 would divide by zero on the host) is refused and leaves it as it was."""
    import numpy as np

    from cellcache import InvalidArgument
    from cellcache._table import CellTable

    table = CellTable(64, 4, 8, track_changes=True)
    words = _engine.staging_words(8, table.owner_words, 4)
    res = _engine.EngineResources(ctx=1, fn_apply=2, fn_build=3, params=4, slot_words=words,
                                  host_slots=(6, 7), dev_slots=(8, 9), slot_events=(10, 11),
                                  commit_event=12, sm_count=13, paged=False, masks=True)
    arrays = [np.zeros(8, np.int64) for _ in range(3)]
    engine = _engine.StepEngine(table, res, *arrays)
    assert engine.target_blocks == 8 * 13
    engine.target_blocks = 2048
    assert engine.target_blocks == 2048
    for bad in (0, -1, 2**31, 1.5, "64", True, None):
        with pytest.raises(InvalidArgument):
            engine.target_blocks = bad
        assert engine.target_blocks == 2048


def test_launch_before_the_entry_points_is_refused():
    if _launch.entry_points_set():
        pytest.skip("a CUDA cache in this process has set the entry points")
    with pytest.raises(RuntimeError, match="entry points not set"):
        _launch.launch(1, (1, 1, 1), 1, 0, 0, b"", ())


def _ptxas() -> Path | None:
    """ptxas of the nvidia-cuda-nvcc-cu12 wheel (the test extra on Linux x86_64), if installed."""
    try:
        spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    except ModuleNotFoundError:               # (no nvidia package at all)
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        exe = Path(location) / "bin" / "ptxas"
        if exe.exists():
            return exe
    return None


def test_ptxas_keeps_the_pipelined_sm90a_entries_wgmmas_in_flight():
    """ptxas serializes every wgmma of a function (C7513: a WARPGROUP.DEPBAR after each HGMMA)
    when a non-wgmma instruction may define a wgmma's registers inside a fence's stage, as a
    branch around the P V wgmmas did. The runner's entries peel the first tile instead, and
    must compile without it; the bench's still carry the branch, and the test says so, so
    that the day they lose it is seen. (Where the wheel is installed; tools/test.sh sets
    CELLCACHE_REQUIRE_NVRTC, under which it must be.)"""
    from cellcache.cuda.tc import HOPPER_ENTRIES, HOPPER_HEAD_DIMS

    exe = _ptxas()
    if exe is None:
        assert not os.environ.get("CELLCACHE_REQUIRE_NVRTC"), "the test extra's ptxas is not installed"
        pytest.skip("ptxas (nvidia-cuda-nvcc-cu12) is not installed")
    ptx = ROOT / "cellcache" / "ptx" / "tc_sm90a.ptx"
    r = subprocess.run([str(exe), "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    # (whatever ptxas numbers the note: C7513 in 12.8, C7514 in 13.0)
    serialized = set(re.findall(r"wgmma.mma_async instructions are serialized.*in the function '(\w+)'",
                                r.stderr))
    entries = set(re.findall(r"Compiling entry function '(\w+)'", r.stderr))
    pipe = {f"tc90_{e}_bf16_d{d}" for e in HOPPER_ENTRIES for d in HOPPER_HEAD_DIMS}
    assert pipe <= entries
    assert serialized == entries - pipe - {"tc90_plan"}, sorted(serialized)
    # no spills either, and no stack (a tile body left as a call would show one)
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                        r.stderr)
    assert len(frames) == len(entries) and set(frames) == {("0", "0", "0")}, frames


def _hand_made_tensor_cores(tc, qrows: int, ctas: int, attend: int, hopper):
    """A TensorCoreAttention without a GPU: the table's variants on ``ctas`` CTAs launching
    ``attend``, plan 1, share 2, merge 3, every scratch taken as allocated; ``hopper``: the
    sm_90a module's functions (None: a GPU without them)."""
    kern = tc.TensorCoreAttention.__new__(tc.TensorCoreAttention)
    kern.dtype, kern.kv8, kern.table, kern.sm_count, kern.module = "bfloat16", False, tc.TABLE, 132, object()
    kern.f_plan, kern.f_share, kern.f_merge = 1, 2, 3
    kern.variants = {d: {} for d in tc.HEAD_DIMS}
    for (d, _), c in tc.TABLE.items():
        kern.variants[d][c.variant] = {"qrows": qrows, "kv_tile": 64, "smem": 0, "ctas": ctas, "f": attend}
    kern._plan = kern._part = kern._share = kern._cpart = 1 << 20
    kern._plan_bytes = kern._part_bytes = kern._share_bytes = kern._cpart_bytes = 1 << 40
    kern._plan_key = None
    kern.hopper, kern._hopper_entry = hopper, "qpre"
    kern._plan90, kern._plan90_bytes, kern._plan90_key = 1 << 30, 1 << 40, None
    return kern


def test_a_hopper_gpu_runs_windowless_bf16_prefill_on_sm90a_and_everything_else_on_sm80(monkeypatch):
    """Which kernels a launch runs once the sm_90a module is loaded: a prefill launch of a
    windowless layer at head_dim 64 or 128 with the table's choice runs ``tc90_plan`` then
    ``tc90_qpre`` on one CTA an SM (the plan kept by a later layer's ``fresh=False``, made
    anew by any ``fresh=True``), never the merge; a decode step, a window, a variant, split
    or order of the caller's, grouped rows, or another head_dim run the sm_80 kernels. The
    arguments are Tc90Args' 18 eight-byte fields. (No GPU: an instance filled by hand, its
    launches recorded.)"""
    import types

    from cellcache import InvalidArgument
    from cellcache.cuda import tc

    attend = 4
    kern = _hand_made_tensor_cores(tc, qrows=128, ctas=132, attend=attend,
                                   hopper={"module": object(), "plan": 7, ("qpre", 64): 8,
                                           ("qpre", 128): 9, ("pipe", 64): 10, ("pipe", 128): 11})
    launched: list[tuple] = []
    monkeypatch.setattr(tc, "_launch", types.SimpleNamespace(
        launch=lambda f, grid, block, smem, stream, args, offsets: launched.append((f, grid[0], block, smem,
                                                                                   args))))
    view = {"qo_indptr": 16, "kv_indptr": 32, "kv_indices": 48, "width": 64}

    def run(head_dim=128, window=0, n_kv=8, **kw):
        launched.clear()
        merged = kern.run(view, 100, 1024, (1024, 64), 2048, 4096, 8192, (1024, 64), 16, n_kv, head_dim,
                          window, 0, **kw)
        return merged, [x[0] for x in launched]

    assert run() == (False, [7, 9])
    plan, attend90 = launched
    assert plan[1:3] == (1, 1024) and attend90[1:4] == (132, 384, tc.hopper_smem(128))
    assert len(attend90[4]) == tc._ARGS90.size == 18 * 8
    fields = tc._ARGS90.unpack(attend90[4])
    assert fields[:8] == (16, 32, 48, 64, 1024, 2048, 4096, 8192) and fields[12:15] == (100, 16, 8)
    assert fields[15:17] == (1 << 30, tc.hopper_units_cap(100, 16, 8))
    assert abs(fields[17] - 128 ** -0.5 * 1.4426950408889634) < 1e-12
    assert run(fresh=False) == (False, [9])                   # a later layer keeps the list
    assert run(head_dim=64, fresh=False) == (False, [8])      # (the list does not depend on it)
    assert run(window=37, fresh=False)[1][:2] == [1, attend]  # sm_80 (its own list: a new key)
    assert run(fresh=False) == (False, [9])                   # the sm_90a list kept beside it
    assert run(n_kv=4, fresh=False) == (False, [7, 9])        # other heads: another list
    assert run(fresh=False) == (False, [7, 9])
    assert run(fresh=True) == (False, [7, 9])                 # a new step
    for kw in (dict(decode=True), dict(window=37), dict(variant=tc.TABLE[128, "prefill"].variant),
               dict(split=0), dict(order=0), dict(cascade=128), dict(head_dim=96)):
        _, fs = run(**kw)
        assert 7 not in fs and 8 not in fs and 9 not in fs and attend in fs, kw
    run(window=37)                                            # fresh=True: both lists forgotten
    assert run(fresh=False) == (False, [7, 9])
    kern.hopper_entry = "pipe"                                # the other entry, on the same list
    assert run(fresh=False) == (False, [11]) and run(head_dim=64, fresh=False) == (False, [10])
    with pytest.raises(InvalidArgument, match="hopper_entry"):
        kern.hopper_entry = "nope"
    assert kern.hopper_entry == "pipe"
    kern.hopper = None                                        # (no Hopper): the same launch on sm_80
    assert attend in run()[1]


def test_a_hopper_setting_that_is_not_none_or_a_bool_is_refused_before_any_driver_call(monkeypatch):
    """``TensorCoreAttention(hopper=...)`` takes None, True or False; anything else is refused
    first, so nothing is loaded (the driver calls are made to fail here: none is reached)."""
    from cellcache import InvalidArgument
    from cellcache.cuda import tc

    def no_driver(*args, **kwargs):
        raise AssertionError("a driver call before the argument checks")

    monkeypatch.setattr(tc.drv, "load_module", no_driver)
    for bad in ("yes", 1, 0, "auto"):
        with pytest.raises(InvalidArgument, match="hopper must be None"):
            tc.TensorCoreAttention("bfloat16", 132, hopper=bad)


def test_hopper_units_cap_holds_every_list_a_step_can_make():
    """The sm_90a list's capacity against the largest lists of a step of ``rows`` rows: one
    run of every row (decode), one run of all rows, and every split between."""
    from cellcache.cuda import tc

    for rows in (1, 7, 128, 1000, 4096):
        for H, Hkv in ((16, 8), (14, 2), (64, 1), (4, 4)):
            G = H // Hkv
            cap = tc.hopper_units_cap(rows, H, Hkv)
            for runs in {1, 2, rows // 3 or 1, rows}:
                lens = [rows // runs + (1 if r < rows % runs else 0) for r in range(runs)]
                assert sum(-(-n * G // tc.HOPPER_ROWS) for n in lens) * Hkv <= cap, (rows, H, Hkv, runs)


def test_tensor_core_run_leaves_the_merge_out_only_where_no_run_can_split(monkeypatch):
    """``unsplit_rows``: split x CTAs over the kv heads, rounded up (0 where the choice never
    splits). ``run(live_rows=...)`` launches the merge unless grouping is off and the promised
    runs reach it, and says whether it did; a live_rows that is not an int in [0, rows] is
    refused before anything is launched. (No GPU: an instance filled by hand, with its scratch
    taken as allocated, the table's variants on a grid of 528 CTAs and its launches recorded.)"""
    import types

    from cellcache import InvalidArgument
    from cellcache.cuda import tc

    attend = 4
    kern = _hand_made_tensor_cores(tc, qrows=16, ctas=528, attend=attend, hopper=None)   # (an sm_80 GPU)
    launched: list[int] = []
    monkeypatch.setattr(tc, "_launch", types.SimpleNamespace(launch=lambda f, *args: launched.append(f)))

    split = tc.TABLE[64, "decode"].split
    assert split > 0 and kern.unsplit_rows(8, 64, decode=True) == -(-split * 528 // 8)
    assert kern.unsplit_rows(3, 64, decode=True, split=4) == 704
    assert kern.unsplit_rows(8, 64, decode=True, split=0) == 0
    for bad in (dict(n_kv_heads=0, head_dim=64), dict(n_kv_heads=8, head_dim=24),
                dict(n_kv_heads=8, head_dim=64, variant="m9w9k9s9")):
        with pytest.raises(InvalidArgument):
            kern.unsplit_rows(**bad, decode=True)
    need = kern.unsplit_rows(8, 64, decode=True)
    view = {"qo_indptr": 16, "kv_indptr": 32, "kv_indices": 48, "width": 64}

    def run(rows, window=0, **kw):
        launched.clear()
        merged = kern.run(view, rows, 1024, (1024, 64), 2048, 4096, 8192, (1024, 64), 16, 8, 64,
                          window, 0, decode=True, **kw)
        assert (kern.f_merge in launched) is merged and launched[-1:] in ([], [kern.f_merge], [attend])
        return merged

    assert run(100) is True                                   # (the table's split: the merge)
    assert run(100, live_rows=need - 1) is True
    assert run(100, live_rows=need) is False
    assert run(100, live_rows=need, fresh=False) is False and launched == [attend]   # (plan kept)
    assert run(100, live_rows=100, cascade=128) is True       # rows may group: the merge folds them
    assert run(100, window=37, live_rows=100, cascade=128) is False   # (cascade ignored)
    assert run(100, split=0) is False                         # never split: no merge at any rows
    assert run(0) is False and launched == []
    assert run(100, live_rows=need) is False
    kept = kern._plan_key
    assert kept is not None
    for bad in (-1, 101, True, 1.5, None, "3"):
        launched.clear()
        with pytest.raises(InvalidArgument, match="live_rows"):
            kern.run(view, 100, 1024, (1024, 64), 2048, 4096, 8192, (1024, 64), 16, 8, 64, 0, 0,
                     decode=True, live_rows=bad)
        assert launched == [] and kern._plan_key == kept       # nothing launched, the plan kept


class Owner:
    pass


def test_dlpack_capsule_keeps_its_owner_alive_until_released():
    owner = Owner()
    before = sys.getrefcount(owner)
    cap = _dlpack.dlpack_capsule(owner, 0x1000, (2, 3), 2, 32, 0)
    assert sys.getrefcount(owner) == before + 1
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype = ctypes.c_char_p
    get_name.argtypes = [ctypes.py_object]
    assert get_name(cap) == b"dltensor"
    del cap                                       # never consumed: the capsule frees it
    assert sys.getrefcount(owner) == before


def test_entry_points_must_all_be_given():
    with pytest.raises(RuntimeError, match="not resolved: cuLaunchKernel"):
        _launch.set_entry_points({n: 1 for n in _launch.ENTRY_POINTS if n != "cuLaunchKernel"})


def test_import_cellcache_loads_no_cuda_module():
    # modules present before the import do not count: cuda-bindings 12.x installs a .pth
    # file that imports the `cuda` namespace package at interpreter start-up
    code = ("import sys; before = set(sys.modules); import cellcache; "
            "print(sorted(m for m in set(sys.modules) - before "
            "if m.startswith('cuda') or m.startswith('cellcache.cuda')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_auto_without_a_device_loads_no_cuda_bindings():
    code = ("import sys, cellcache; c = cellcache.build('auto', 'batched', cellcache.CacheConfig("
            "capacity=8, layers=[cellcache.LayerConfig(1, 8)], max_write=4)); "
            "print(c.backend, sorted(m for m in sys.modules if m.startswith('cuda.bindings') "
            "or m.startswith('cellcache.cuda.') and m != 'cellcache.cuda.probe'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    backend, loaded = r.stdout.split(" ", 1)
    if backend == "host":            # no device: auto asked the ctypes probe alone
        assert loaded.strip() == "[]", loaded


# -- the probe, each "absent" cause simulated --------------------------------------------------

class FakeDriver:
    def __init__(self, init=0, count=1, count_code=0, version=13000, version_code=0):
        self._init, self._count, self._count_code = init, count, count_code
        self._version, self._version_code = version, version_code

    def cuInit(self, flags):
        return self._init

    def cuDeviceGetCount(self, ptr):
        ctypes.cast(ptr, ctypes.POINTER(ctypes.c_int))[0] = self._count
        return self._count_code

    def cuDriverGetVersion(self, ptr):
        ctypes.cast(ptr, ctypes.POINTER(ctypes.c_int))[0] = self._version
        return self._version_code


@pytest.fixture
def bindings_present(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(probe.importlib.util, "find_spec",
                        lambda name, *a: object() if name.startswith("cuda") else real(name, *a))


def test_probe_without_cuda_bindings(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(probe.importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("cuda") else real(name, *a))
    assert probe.cuda_usable() == (
        False, "cuda-bindings is not installed (pip install 'cellcache[cu12]' (drivers for CUDA "
               "12.0+, R525+) or 'cellcache[cu13]' (CUDA 13.0+, R580+))")


def test_probe_without_a_driver_library(monkeypatch, bindings_present):
    def missing():
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(probe, "_load_driver", missing)
    ok, why = probe.cuda_usable()
    assert not ok and why.startswith("no CUDA driver (libcuda.so.1 cannot be loaded")


@pytest.mark.parametrize("driver,why", [
    (FakeDriver(init=34), "no CUDA driver (libcuda.so.1 is the toolkit's stub)"),
    (FakeDriver(init=100), "no CUDA device"),
    (FakeDriver(count=0), "no CUDA device"),
], ids=["stub", "no-device", "zero-devices"])
def test_probe_absent_causes(monkeypatch, bindings_present, driver, why):
    monkeypatch.setattr(probe, "_load_driver", lambda: driver)
    assert probe.cuda_usable() == (False, why)


@pytest.mark.parametrize("driver,match", [
    (FakeDriver(init=999), "cuInit failed with CUresult 999"),
    (FakeDriver(count_code=3), "cuDeviceGetCount failed with CUresult 3"),
], ids=["init-fails", "count-fails"])
def test_probe_other_failures_raise(monkeypatch, bindings_present, driver, match):
    monkeypatch.setattr(probe, "_load_driver", lambda: driver)
    with pytest.raises(CudaError, match=match):
        probe.cuda_usable()


def test_probe_present(monkeypatch, bindings_present):
    monkeypatch.setattr(probe, "_bindings_version", lambda: "13.5.0")
    monkeypatch.setattr(probe, "_load_driver", lambda: FakeDriver(count=2, version=13000))
    assert probe.cuda_usable() == (True, "")


@pytest.mark.parametrize("bindings,driver,usable", [
    ("12.9.4", 12000, True), ("12.6.0", 13010, True), ("13.0.0", 13000, True),
    ("13.5.0", 13020, True), (None, 12040, True),            # a source checkout: no metadata
    ("13.5.0", 12090, r"pip install 'cellcache\[cu12\]' \(cuda-bindings>=12.6,<13\)"),
    ("13.0.1", 12000, r"cuda-bindings 13.0.1 needs a driver for CUDA 13.0 or newer \(R580\+\); "
                      r"this driver supports CUDA 12.0"),
    ("14.0.0", 13000, r"needs a driver for CUDA 14.0 or newer.*'cellcache\[cu13\]'"),
    ("12.9.4", 11080, r"this driver supports CUDA 11.8; cellcache needs a driver for CUDA 12.0 or "
                      r"newer \(R525\+\)"),
])
def test_probe_matches_cuda_bindings_to_the_driver(monkeypatch, bindings_present, bindings, driver,
                                                    usable):
    """cuda-bindings newer than the driver (13.x on an R525-R575 driver) is named, with the
    extra that fits, instead of a crash inside cuda-bindings; as a misinstall, not an absent
    CUDA, it raises (auto does not hide it and the GPU tests fail rather than skip)."""
    monkeypatch.setattr(probe, "_bindings_version", lambda: bindings)
    monkeypatch.setattr(probe, "_load_driver", lambda: FakeDriver(version=driver))
    if usable is True:
        assert probe.cuda_usable() == (True, "")
        probe.require_cuda()
    else:
        with pytest.raises(CudaError, match=usable):
            probe.cuda_usable()
        with pytest.raises(CudaError, match=usable):
            resolve_backend("auto")


def test_probe_driver_version_failure_raises(monkeypatch, bindings_present):
    monkeypatch.setattr(probe, "_load_driver", lambda: FakeDriver(version_code=999))
    with pytest.raises(CudaError, match="cuDriverGetVersion failed with CUresult 999"):
        probe.cuda_usable()


def test_extras_match_the_probe():
    """pyproject's per-major extras are the probe's, and 'cuda' is cu12."""
    tomllib = pytest.importorskip("tomllib")          # Python 3.11+

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name, requirement, _ in probe.EXTRAS.values():
        assert extras[name] == [requirement], name
    assert extras["cuda"] == extras["cu12"]
    assert [r for r in extras["test"] if r.startswith("cuda-bindings")] == extras["cu12"]


# -- every explicit CUDA path goes through the probe --------------------------------------------

CFG_CODE = ("import cellcache as cc; cfg = cc.CacheConfig(capacity=64, layers=[cc.LayerConfig(1, 8)], "
            "max_write=8)\n")


@pytest.mark.parametrize("why", ["no CUDA device", "no CUDA driver (libcuda.so.1 is the toolkit's stub)",
                                 "cuda-bindings is not installed (pip install 'cellcache[cu12]')"])
def test_explicit_cuda_without_cuda_is_one_cuda_error(monkeypatch, why):
    monkeypatch.setattr(probe, "cuda_usable", lambda: (False, why))
    import cellcache as cc
    from cellcache.registry import build

    cfg = cc.CacheConfig(capacity=64, layers=[cc.LayerConfig(1, 8)], max_write=8)
    for kind in ("batched", "batched-cell"):
        with pytest.raises(CudaError) as info:
            build("cuda", kind, cfg)
        assert str(info.value) == f"the CUDA backend is not usable here: {why}"
    assert build("auto", "batched", cfg).backend == "host"      # auto falls back on the same answer
    pytest.importorskip("cuda.bindings")
    from cellcache.cuda.backend import CudaCellCache

    with pytest.raises(CudaError, match=f"not usable here: {re.escape(why)}"):
        CudaCellCache(cfg)


def test_explicit_cuda_on_this_machine_raises_the_probes_reason():
    """The real path, in a fresh interpreter: no cuda-bindings traceback, one CudaError."""
    ok, why = probe.cuda_usable()
    if ok:
        pytest.skip("a CUDA device is usable here")
    pytest.importorskip("cuda.bindings")
    code = CFG_CODE + (
        "from cellcache.cuda import CudaCellCache\n"
        "for make in (lambda: cc.build('cuda', 'batched', cfg), lambda: CudaCellCache(cfg)):\n"
        "    try:\n        make()\n"
        "    except cc.CudaError as e:\n        print(type(e).__name__, e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"CudaError the CUDA backend is not usable here: {why}"] * 2


def test_demo_with_cuda_backend_and_no_cuda_exits_2_with_one_line():
    if probe.cuda_usable()[0]:
        pytest.skip("a CUDA device is usable here")
    r = subprocess.run([sys.executable, "-m", "cellcache", "demo", "--backend", "cuda", "--steps", "2"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("cellcache demo: error: CudaError: the CUDA backend is not usable here: ")


def test_auto_follows_the_probe(monkeypatch):
    monkeypatch.setattr(probe, "cuda_usable", lambda: (False, "no CUDA device"))
    assert resolve_backend("auto") == "host"
    monkeypatch.setattr(probe, "cuda_usable", lambda: (True, ""))
    assert resolve_backend("auto") == "cuda"


def test_canonical_ptx_ignores_register_numbers_and_nothing_else():
    b = load_build_ptx()
    one = (b".visible .entry f(\n.reg .f32 %f<9>;\nmov.f32 %f5, 0f0;\n"
           b"add.f32 %f6, %f5, %f5;\nst.f32 [%rd1], %f6;\n}")
    two = (b".visible .entry f(\n.reg .f32 %f<7>;\nmov.f32 %f3, 0f0;\n"
           b"add.f32 %f4, %f3, %f3;\nst.f32 [%rd1], %f4;\n}")
    assert b.canonical(one) == b.canonical(two)
    assert b.canonical(one) != b.canonical(two.replace(b"add.f32", b"sub.f32"))
    assert b.canonical(one) != b.canonical(two.replace(b"%f4, %f3, %f3", b"%f4, %f3, %f4"))


def test_ptx_check_rebuilds_and_notices_a_changed_instruction(tmp_path):
    b = load_build_ptx()
    if b.find_nvrtc() is None:
        pytest.skip("the pinned NVRTC is not installed (tools/test.sh installs it)")
    import hashlib

    tree = _tree_copy(tmp_path)
    ptx = tree / "cellcache" / "ptx" / "step.ptx"
    text = ptx.read_bytes().replace(b"add.s64", b"sub.s64", 1)
    ptx.write_bytes(text)
    manifest = json.loads((tree / "cellcache" / "ptx" / "manifest.json").read_text())
    manifest["kernels"]["step"]["ptx_sha256"] = hashlib.sha256(text).hexdigest()
    (tree / "cellcache" / "ptx" / "manifest.json").write_text(json.dumps(manifest))
    r = subprocess.run([sys.executable, str(tree / "tools" / "build_ptx.py"), "--check", "--only", "step"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "rebuilding step.cu with nvrtc 12.0.140 gives different PTX" in r.stderr
    r = subprocess.run([sys.executable, str(tree / "tools" / "build_ptx.py"), "--check", "--only", "nope"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "build_ptx: error: --only ['nope']: the kernel files are ['attention', 'fused', 'step', "
        "'tc_attention', 'tc_sm90a'] (see --help)"]


@pytest.mark.parametrize("stem,was,now", [("tc_sm90a", "sm_90a", "sm_80"), ("step", "sm_80", "sm_90a")])
def test_ptx_check_holds_each_file_to_its_own_target(tmp_path, stem, was, now):
    """A *_sm90a.cu file's PTX must target sm_90a (its wgmma exists nowhere else), every other
    file's sm_80 (loads on every GPU from Ampere on): the check refuses either relabelled."""
    import hashlib

    b = load_build_ptx()
    assert b.arch_of(Path("cuda/tc_sm90a.cu")) == ("compute_90a", "sm_90a")
    assert b.arch_of(Path("cuda/step.cu")) == ("compute_80", "sm_80")
    tree = _tree_copy(tmp_path)
    ptx = tree / "cellcache" / "ptx" / f"{stem}.ptx"
    text = ptx.read_bytes().replace(f"\n.target {was}\n".encode(), f"\n.target {now}\n".encode(), 1)
    ptx.write_bytes(text)
    manifest = json.loads((tree / "cellcache" / "ptx" / "manifest.json").read_text())
    manifest["kernels"][stem]["ptx_sha256"] = hashlib.sha256(text).hexdigest()
    (tree / "cellcache" / "ptx" / "manifest.json").write_text(json.dumps(manifest))
    r = subprocess.run([sys.executable, str(tree / "tools" / "build_ptx.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and f"{stem}.ptx targets {now}, not {was}" in r.stderr, r.stderr


@pytest.mark.parametrize("use", ["copy_to_host", "dlpack", "cuda_array_interface"])
def test_a_buffer_of_a_closed_cache_refuses_without_touching_the_device(use):
    """A DeviceBuffer kept past its cache's close() raises InvalidState instead of handing
    out or reading released memory (the refusal comes before any driver call, so it holds
    on a machine without a driver too)."""
    import types

    from cellcache import InvalidState
    from cellcache.cuda.backend import DeviceBuffer

    cache = types.SimpleNamespace(closed=True, config=types.SimpleNamespace(device=0))
    buf = DeviceBuffer(cache, "cells", 0xDEAD000, (16,), "int64")
    with pytest.raises(InvalidState, match="'cells': its cache is closed"):
        if use == "copy_to_host":
            buf.copy_to_host()
        elif use == "dlpack":
            buf.__dlpack__()
        else:
            _ = buf.__cuda_array_interface__
    cache.closed = False                      # open: the interface is handed out as before
    assert buf.__cuda_array_interface__["data"] == (0xDEAD000, False)


@pytest.mark.parametrize("name,says", [
    ("tc_sm90a", "built for sm_90a): CUDA_ERROR_NO_BINARY_FOR_GPU. It runs only on GPUs of compute "
                 "capability 9.0."),
    ("step", "built by nvrtc 12.0.140 for sm_80): CUDA_ERROR_NO_BINARY_FOR_GPU. It needs a driver for "
             "CUDA 12.0 or newer; this driver supports CUDA 12.4."),
])
def test_a_ptx_the_driver_refuses_is_explained_by_its_own_target(monkeypatch, name, says):
    """Hopper-only PTX on another GPU is refused for the GPU, not for the driver's age."""
    from cellcache.cuda import driver as drv
    from cellcache.errors import CudaError

    refused = int(drv.cu.CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU)
    monkeypatch.setattr(drv, "driver_version", lambda: 12040)
    monkeypatch.setattr(drv, "error_name", lambda code: "CUDA_ERROR_NO_BINARY_FOR_GPU")
    monkeypatch.setattr(drv.cu, "cuModuleLoadData", lambda image: (drv.cu.CUresult(refused), None))
    with pytest.raises(CudaError) as e:
        drv.load_module(name)
    assert says in str(e.value) and e.value.code == refused
