"""The end-to-end agreement check (cellcache.generate.agreement) on the CPU: the served path
(host backend, float32, and bf16 with HF's own bf16 forward as the noise floor) agrees with
HF's forward over every kind of row; a model changed after the reference was taken is
caught (the check can fail); the tap's options and refusals."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cellcache.errors import InvalidArgument  # noqa: E402
from cellcache.generate import Generator, Sampling, random_model  # noqa: E402
from cellcache.generate.agreement import LogitsTap, compare, reference_models  # noqa: E402

from .helpers_agreement import serve_every_kind  # noqa: E402


def _served(dtype, perturb: float = 0.0):
    model = random_model("llama-tiny", dtype, "cpu", seed=4)
    ref, floor = reference_models(model)
    if perturb:
        with torch.no_grad():
            model.model.layers[1].self_attn.o_proj.weight.mul_(1 + perturb)
    gen = Generator(model, capacity=200, max_batch_tokens=48, max_seqs=12, prefill_chunk=16,
                    eos=[], reserve=0)
    with LogitsTap(gen) as tap:
        serve_every_kind(gen, 512, seed=5, system_len=30, new_tokens=12)
    st = gen.stats
    assert st["preempted"] > 0 and st["forks"] > 0 and st["drafted"] > 0 and st["cached_tokens"] > 0
    assert gen.on_logits is None                          # the tap is gone again
    rows = tap.rows()
    assert {r.kind for r in rows} == {"prompt", "output", "draft"}
    return rows, ref, floor


def test_the_float32_host_path_agrees_with_hfs_forward():
    rows, ref, floor = _served(torch.float32)
    assert floor is None
    report = compare(rows, ref, floor)
    assert report.passed, report.summary()
    assert report.error_max < 1e-4 and report.noise_max == 0
    assert report.argmax_checked > 0 and report.argmax_mismatches == 0
    assert set(report.by_kind) == {"prompt", "output", "draft"}
    assert report.summary().startswith("PASS")


def test_the_bf16_host_path_is_within_the_noise_floor_of_hfs_bf16_forward():
    rows, ref, floor = _served(torch.bfloat16)
    report = compare(rows, ref, floor)
    assert report.noise_max > 0 and report.error_max > 0  # bf16 on both sides: both err
    assert report.passed, (report.summary(), report.by_kind)


def test_a_model_that_is_not_the_reference_fails():
    """Weights changed by 2% in one projection after the reference was taken: the check
    fails on the error, whatever the argmax does."""
    rows, ref, floor = _served(torch.float32, perturb=0.02)
    report = compare(rows, ref, floor)
    assert not report.passed and report.error_max > 10 * report.atol * report.scale
    assert report.summary().startswith("FAIL") and report.worst[0]["error_max"] == report.error_max


def test_the_tap_keeps_what_it_is_asked_to():
    model = random_model("llama-tiny", torch.float32, "cpu", seed=4)
    gen = Generator(model, capacity=256, max_batch_tokens=32, max_seqs=8, eos=[])
    mine = set()
    with LogitsTap(gen, keep=lambda r: r.id in mine, max_rows=3) as tap:
        a = gen.add([1, 2, 3, 4], Sampling(max_new_tokens=6))
        gen.add([5, 6, 7], Sampling(max_new_tokens=6))
        mine.add(a.id)
        gen.run()
    rows = tap.rows()
    assert len(rows) == 3 and all(r.request is a for r in rows)
    assert [len(r.context) for r in rows] == [4, 5, 6]
    assert rows[0].kind == "prompt" and rows[1].kind == rows[2].kind == "output"


def test_the_tap_and_compare_refuse_bad_arguments():
    model = random_model("llama-tiny", torch.float32, "cpu", seed=4)
    gen = Generator(model, capacity=256, max_batch_tokens=32, max_seqs=8, eos=[])
    for kw in ({"keep": 3}, {"max_rows": 0}, {"max_rows": True}, {"max_rows": 1.5}):
        with pytest.raises(InvalidArgument):
            LogitsTap(gen, **kw)
    assert gen.on_logits is None
    with pytest.raises(InvalidArgument):
        LogitsTap(object())
    for kw in ({"factor": 0}, {"factor": float("nan")}, {"atol": -1}):
        with pytest.raises(InvalidArgument):
            compare([], model, None, **kw)
    assert not compare([], model, None).passed          # nothing compared: not a pass
