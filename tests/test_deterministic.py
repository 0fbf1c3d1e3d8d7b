"""Generator(deterministic=True) on the host backend (CPU, float32): a request's tokens
(greedy and seeded sampling) and the logits they were drawn from are bit for bit the same
whatever else is batched with it, when it arrives, how its prompt is chunked, whether it
is preempted and recomputed, the prefix cache on or off, async steps on or off; and they
equal a teacher-forced forward over the finished sequence in the same mode. Schedules are
drawn at random (seeded)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cellcache import HostCellCache, InvalidArgument  # noqa: E402
from cellcache import hf as cchf  # noqa: E402
from cellcache.batch_invariant import BatchInvariant  # noqa: E402
from cellcache.generate import Generator, Sampling, random_model  # noqa: E402

from .helpers import load_tool  # noqa: E402
from .helpers_deterministic import VOCAB, bits, check_same, drafter, serve  # noqa: E402

N_NEW = 10


@pytest.fixture(scope="module")
def model():
    # a Qwen2 with one full-attention layer and two windowed ones (window 16)
    return random_model("tiny", seed=7)


@pytest.fixture(scope="module")
def targets():
    """The requests whose results are compared: prompts sharing a prefix (prefix-cache hits
    between them), greedy, seeded sampling, two seeded continuations of one prompt, and
    greedy with drafts."""
    rng = np.random.default_rng(5)
    shared = rng.integers(0, VOCAB, size=12).tolist()
    prompts = [shared + rng.integers(0, VOCAB, size=n).tolist() for n in (3, 17, 9)]
    prompts.append(rng.integers(0, VOCAB, size=30).tolist())
    samplings = [Sampling(max_new_tokens=N_NEW, logprobs=0),
                 Sampling(max_new_tokens=N_NEW, temperature=0.9, seed=11, logprobs=3),
                 Sampling(max_new_tokens=N_NEW, temperature=1.3, top_k=40, top_p=0.9, seed=12, n=2,
                          logprobs=1),
                 Sampling(max_new_tokens=N_NEW)]
    jobs = list(zip(prompts, samplings))
    jobs.append((rng.integers(0, VOCAB, size=8).tolist(), Sampling(max_new_tokens=N_NEW),
                 dict(draft=drafter, draft_k=2)))      # verify runs: drafts read like a prompt
    return jobs


def alone(model, targets):
    """Each target served by itself: whole prompt in one chunk, plenty of room."""
    return [serve(model, [job], capacity=512, max_batch_tokens=64, prefill_chunk=64,
                  max_seqs=8)[0][0] for job in targets]


@pytest.fixture(scope="module")
def reference(model, targets):
    return alone(model, targets)


@pytest.mark.parametrize("seed", range(4))
def test_tokens_and_logits_do_not_depend_on_the_schedule(model, targets, reference, seed):
    rng = np.random.default_rng(100 + seed)
    others = [rng.integers(0, VOCAB, size=int(rng.integers(2, 40))).tolist()
              for _ in range(int(rng.integers(2, 6)))]
    if seed % 2:                                   # others sharing a target's prompt prefix
        others.append(targets[0][0][:14] + [1, 2, 3])
    arrivals = rng.integers(0, 8, size=len(targets)).tolist()
    kw = dict(capacity=int(rng.integers(90, 180)), max_batch_tokens=int(rng.integers(8, 40)),
              prefill_chunk=int(rng.integers(2, 19)), max_seqs=int(rng.integers(4, 12)),
              reserve=0.0, prefix_cache=bool(seed % 2), async_steps=bool(seed // 2))
    if seed == 0:
        kw["capacity"] = 64                        # short of cells: preempts and recomputes
    got, gen = serve(model, targets, others=others, arrivals=arrivals, seed=seed, **kw)
    check_same(reference, got, N_NEW)
    if seed == 0:
        assert gen.stats["preempted"] > 0          # the small pool made room by preemption


def teacher_forced(model, sequence, rows=None):
    """A fresh cache and runner in deterministic mode: one step over the whole sequence,
    every row's float32 logits."""
    cfg = cchf.cache_config(model, capacity=256, max_write=128)
    cache = HostCellCache(cfg)
    runner = cchf.attach(model, cache, deterministic=True)
    s = cache.seq_new()
    assert cache.declare_step([s] * len(sequence))
    step = cache.prepare_step()
    logits = runner.forward(step, sequence, rows)
    cache.commit_step()
    return logits


def test_logits_and_logprobs_equal_a_teacher_forced_forward(model, targets, reference):
    """A trainer's recomputation: one forward of the finished sequence in the same mode gives
    every generated token's logits bit for bit, and its log_softmax (in the mode) every
    log-probability the Generator returned, float for float."""
    checked = 0
    for (prompt, *_), (outputs, logits, logprobs) in zip(targets, reference):
        for k, out in enumerate(outputs):
            seq = list(prompt) + out
            forced = teacher_forced(model, seq)
            n = 0
            for j in range(len(prompt) - 1, len(seq) - 1):
                key = (k, tuple(seq[:j + 1]))
                if key in logits:
                    assert bits(forced[j]) == logits[key], (k, j)
                    n += 1
            assert n >= N_NEW - 1
            if logprobs is None:
                continue
            with BatchInvariant(cpu_threads=1):
                lsm = torch.log_softmax(forced, dim=-1).double()
            assert len(logprobs[k]) == len(out)
            for i, entry in enumerate(logprobs[k]):
                row = lsm[len(prompt) - 1 + i]
                assert entry.token == out[i] and entry.logprob == float(row[out[i]]), (k, i)
                for tok, value in entry.top:
                    assert value == float(row[tok])
                checked += 1
    assert checked >= 3 * N_NEW


def _read_in_steps(model, seqs, steps, rows):
    """Sequences ``seqs`` fed through one runner (``invariant_rows=rows``) in ``steps``: each
    step a list of sequence indices, one token each in order; every token's logits bits by
    (sequence, position)."""
    cache = HostCellCache(cchf.cache_config(model, capacity=256, max_write=64))
    runner = cchf.attach(model, cache, deterministic=True, invariant_rows=rows)
    ids = [cache.seq_new() for _ in seqs]
    fed = [0] * len(seqs)
    got = {}
    for step_of in steps:
        assert cache.declare_step([ids[i] for i in step_of])
        step = cache.prepare_step()
        keys = []
        for i in step_of:
            keys.append((i, fed[i]))
            fed[i] += 1
        logits = runner.forward(step, [seqs[i][p] for i, p in keys])
        cache.commit_step()
        got.update({k: bits(logits[j]) for j, k in enumerate(keys)})
    assert fed == [len(s) for s in seqs]
    return got


def test_a_token_is_the_same_across_chunk_boundaries_of_the_model(model):
    """Through the whole model at invariant_rows=8: a 40-token sequence read in one step
    (five chunks of the mode), in steps of other sizes, and interleaved with another
    sequence (its rows at other slots and chunks): every token's logits are the same bits."""
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, VOCAB, size=40).tolist(), rng.integers(0, VOCAB, size=30).tolist()
    one = _read_in_steps(model, [a], [[0] * 40], 8)
    sizes = [3, 11, 9, 17]
    pieces = _read_in_steps(model, [a], [[0] * n for n in sizes], 8)
    mixed_steps = [[1] * 5 + [0] * 3, [0, 1] * 9 + [0] * 4, [1] * 7 + [0] * 18 + [1] * 6,
                   [0] * 6 + [1] * 3]
    mixed = _read_in_steps(model, [a, b], mixed_steps, 8)
    for p in range(40):
        assert pieces[0, p] == one[0, p] and mixed[0, p] == one[0, p], p


def test_deterministic_stays_close_to_the_normal_mode(model, targets):
    prompt = targets[3][0]
    cfg = cchf.cache_config(model, capacity=256, max_write=64)
    outs = []
    for det in (False, True):
        cache = HostCellCache(cfg)
        runner = cchf.attach(model, cache, deterministic=det)
        s = cache.seq_new()
        assert cache.declare_step([s] * len(prompt))
        step = cache.prepare_step()
        outs.append(runner.forward(step, prompt))
        cache.commit_step()
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)


def test_attach_refusals_change_nothing(model):
    cfg = cchf.cache_config(model, capacity=64, max_write=16)
    cache = HostCellCache(cfg)
    before = model.config._attn_implementation
    for kw, match in ((dict(deterministic=1), "deterministic"),
                      (dict(deterministic="yes"), "deterministic"),
                      (dict(deterministic=True, attention="flashinfer"), "flashinfer"),
                      (dict(deterministic=True, attention="sdpa"), "sdpa"),
                      (dict(deterministic=True, compile=True), "compile"),
                      (dict(deterministic=True, compile={"backend": "eager"}), "compile"),
                      (dict(deterministic=True, invariant_rows=0), "invariant_rows"),
                      (dict(deterministic=True, invariant_rows=2.5), "invariant_rows")):
        with pytest.raises(InvalidArgument, match=match):
            cchf.attach(model, cache, **kw)
        assert model.config._attn_implementation == before
        assert cache.live_seqs() == [] and cache.free_cells == cache.capacity
    # a rank's shard of the heads (tensor parallel): its all-reduces are not invariant
    shard = dataclasses.replace(cfg, layers=[dataclasses.replace(la, n_kv_heads=1) for la in cfg.layers])
    with pytest.raises(InvalidArgument, match="tensor-parallel"):
        cchf.attach(model, HostCellCache(shard), deterministic=True)
    assert model.config._attn_implementation == before
    with pytest.raises(InvalidArgument, match="deterministic"):
        Generator(model, capacity=64, eos=[], deterministic=True, compile=True)
    assert model.config._attn_implementation == before


def test_generator_refuses_deterministic_under_tp_before_sharding(model, monkeypatch):
    """``Generator(tp=..., deterministic=True)`` is refused before the model is sharded in
    place or a cache is built (a world of two ranks, as the process group would say)."""
    from cellcache.generate import distributed, engine, options

    monkeypatch.setattr(options, "tp_world", lambda tp: 2)
    built = []
    monkeypatch.setattr(engine, "serving_cache", lambda *a: built.append(a))
    before = model.config._attn_implementation
    with pytest.raises(InvalidArgument, match="tensor parallelism"):
        Generator(model, capacity=64, eos=[], tp=True, deterministic=True)
    assert built == [] and not distributed.is_sharded(model)
    assert model.config._attn_implementation == before


def test_attach_refuses_a_cuda_cache_without_the_paged_view(model, monkeypatch):
    """On CUDA the invariant attention runs the tensor-core kernels, which read the paged
    view: a cache without it is refused by attach, before the model is switched (not by the
    first forward). (A host cache that says it is a CUDA one: the check reads the backend.)"""
    cache = HostCellCache(cchf.cache_config(model, capacity=64, max_write=16))
    assert not cache.config.paged
    monkeypatch.setattr(cache, "backend", "cuda")
    before = model.config._attn_implementation
    with pytest.raises(InvalidArgument, match="paged"):
        cchf.attach(model, cache, deterministic=True)
    assert model.config._attn_implementation == before


def test_cli_refuses_deterministic_with_tp_before_joining_ranks(monkeypatch, capsys):
    """``--deterministic --tp 2`` is a usage error found before the process group is joined
    or a model is built (under torchrun every rank would otherwise load, shard and build
    its cache first, then fail in attach)."""
    from cellcache.generate import cli

    def joined(*a, **k):
        raise AssertionError("the process group was joined")

    monkeypatch.setattr(cli, "init_tp", joined)
    with pytest.raises(SystemExit) as e:
        cli.main(["--random", "tiny", "--device", "cpu", "--deterministic", "--tp", "2", "1 2 3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--deterministic" in err and "--tp" in err


def test_runner_reports_its_mode(model):
    cache = HostCellCache(cchf.cache_config(model, capacity=64, max_write=16))
    runner = cchf.attach(model, cache, deterministic=True, invariant_rows=64)
    assert runner.adapter.deterministic is True and runner.adapter.invariant_rows == 64
    runner = cchf.attach(model, cache)
    assert runner.adapter.deterministic is False


def test_bench_det_times_both_modes_on_one_workload(tmp_path):
    """tools/bench_det.py (smoke size, CPU): both modes served, the cost and SGLang's
    published figure reported, the deterministic runs identical (two of them: one run is
    not compared with itself); the module settings it overrides are restored."""
    import cellcache.torch as cct
    from cellcache.generate import engine

    bench = load_tool("bench_det")
    out = tmp_path / "det.json"
    before = cct.INVARIANT_CLASS, engine.attach
    assert bench.main(["--device", "cpu", "--quick", "--model", "llama-tiny", "--requests", "4",
                       "--repeat", "2", "--rows", "64", "--invariant-class", "decode",
                       "--json", str(out)]) == 0
    assert (cct.INVARIANT_CLASS, engine.attach) == before
    res = json.loads(out.read_text())
    assert res["benchmark"] == "deterministic" and res["deterministic_runs_identical"] is True
    assert res["invariant_class"] == "decode" and res["invariant_rows"] == 64
    assert set(res["linear_gemms"]) == {"batched", "one_by_one"}
    assert bench.main(["--device", "cpu", "--quick", "--model", "llama-tiny", "--requests", "2",
                       "--native", "--json", str(out)]) == 0
    native = json.loads(out.read_text())
    assert native["deterministic_runs_identical"] is None and native["native"] is True
    assert native["benchmark"] == "deterministic-native"
    assert set(res["tokens_per_s"]) == {"normal", "deterministic"}
    assert res["sglang_published_cost"] == 0.34 and res["target_cost"] == 0.15
    # each mode served once more and checked end to end against HF's forward (float32: atol)
    for r in (res, native):
        assert set(r["agreement"]) == {"normal", "deterministic"}
        assert all(a["passed"] is True and a["rows"] > 0 for a in r["agreement"].values())
    assert res["runs"]["deterministic"][0]["tokens_out"] == res["runs"]["normal"][0]["tokens_out"] > 0


def test_bench_det_fails_when_a_mode_does_not_agree_with_the_model(tmp_path, monkeypatch, capsys):
    """The served model changed after the reference copies were taken: the JSON keeps each
    mode's report, the run says which mode and where, and exits 1."""
    bench = load_tool("bench_det")
    real = bench.tapped_run

    def changed(gen, *a, **k):
        with torch.no_grad():
            for prm in gen.model.parameters():
                prm.mul_(1.05)
        return real(gen, *a, **k)

    monkeypatch.setattr(bench, "tapped_run", changed)
    out = tmp_path / "det.json"
    assert bench.main(["--device", "cpu", "--quick", "--model", "llama-tiny", "--requests", "2",
                       "--json", str(out)]) == 1
    res = json.loads(out.read_text())
    assert {mode: a["passed"] for mode, a in res["agreement"].items()} == \
        {"normal": False, "deterministic": False}
    err = capsys.readouterr().err
    assert "bench_det (normal): the served configuration does not agree" in err and "worst rows" in err
