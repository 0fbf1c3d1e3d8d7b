"""Deterministic serving on CUDA in bf16, on a Qwen2-0.5B-shaped random model (its head
dims, GQA group 7 and vocabulary; 4 layers): a request's tokens (greedy, seeded, forked,
drafted) and every logits row are bit for bit the same whatever else is batched with it,
its arrival, its prompt chunks, preemption, the prefix cache, async steps, graphs replayed
or eager; and equal a teacher-forced forward of the finished sequence in the same mode.
Below that: the batch-invariant ops at the model's shapes (eager and inside a CUDA graph),
and the "invariant" attention reading a token in a prompt chunk and in a decode step alike."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import cellcache as cc  # noqa: E402
import cellcache.torch as cct  # noqa: E402
from cellcache import InvalidArgument  # noqa: E402
from cellcache import hf as cchf  # noqa: E402
from cellcache.batch_invariant import BatchInvariant  # noqa: E402
from cellcache.generate import Sampling, random_model  # noqa: E402
from cellcache.generate.cli import RANDOM_MODELS  # noqa: E402

from ..helpers_deterministic import bits, check_same, drafter, serve, shaped_model  # noqa: E402

QWEN = dict(RANDOM_MODELS["qwen2-0.5b"], num_hidden_layers=4)
VOCAB = QWEN["vocab_size"]
N_NEW = 16


@pytest.fixture(scope="module")
def model():
    return shaped_model(QWEN, torch.bfloat16, "cuda", seed=1)


@pytest.fixture(scope="module")
def targets():
    rng = np.random.default_rng(3)
    shared = rng.integers(0, VOCAB, size=40).tolist()
    prompts = [shared + rng.integers(0, VOCAB, size=n).tolist() for n in (5, 70, 23)]
    prompts.append(rng.integers(0, VOCAB, size=300).tolist())      # several chunks
    samplings = [Sampling(max_new_tokens=N_NEW, logprobs=0),
                 Sampling(max_new_tokens=N_NEW, temperature=0.9, seed=11, logprobs=5),
                 Sampling(max_new_tokens=N_NEW, temperature=1.2, top_k=50, top_p=0.9, seed=12, n=2,
                          logprobs=1),
                 Sampling(max_new_tokens=N_NEW)]
    jobs = list(zip(prompts, samplings))
    jobs.append((rng.integers(0, VOCAB, size=20).tolist(), Sampling(max_new_tokens=N_NEW),
                 dict(draft=drafter, draft_k=3)))
    return jobs


@pytest.fixture(scope="module")
def reference(model, targets):
    """Each target alone, its prompt in one chunk, graphs on."""
    return [serve(model, [job], capacity=4096, max_batch_tokens=512, prefill_chunk=512,
                  max_seqs=8)[0][0] for job in targets]


# schedule knobs by seed: (graphs, async steps, prefix cache, warmup)
KNOBS = [(None, None, True, False), (None, False, False, True), (False, False, True, False),
         (None, True, False, False), (None, None, True, True), (False, None, False, False)]


@pytest.mark.parametrize("seed", range(len(KNOBS)))
def test_tokens_and_logits_do_not_depend_on_the_schedule(model, targets, reference, seed):
    graphs, async_steps, prefix, warm = KNOBS[seed]
    rng = np.random.default_rng(200 + seed)
    others = [rng.integers(0, VOCAB, size=int(rng.integers(2, 400))).tolist()
              for _ in range(int(rng.integers(3, 40)))]
    others.append(targets[0][0][:45] + [1, 2, 3])                  # shares a target's prefix
    arrivals = rng.integers(0, 12, size=len(targets)).tolist()
    kw = dict(capacity=int(rng.integers(900, 3000)) if seed % 3 else 700,
              max_batch_tokens=int(rng.integers(16, 600)), prefill_chunk=int(rng.integers(3, 300)),
              max_seqs=int(rng.integers(8, 64)), reserve=0.0, prefix_cache=prefix, graphs=graphs,
              async_steps=async_steps)
    got, gen = serve(model, targets, others=others, arrivals=arrivals, seed=seed, other_tokens=40,
                     warmup=warm, **kw)
    check_same(reference, got, N_NEW)
    if graphs is None:
        assert gen.stats["graph_steps"] > 0
    gen.cache.close()


def teacher_forced(model, sequence):
    cache = cc.build("cuda", "batched", cchf.cache_config(model, capacity=4096, max_write=1024))
    try:
        runner = cchf.attach(model, cache, deterministic=True)
        s = cache.seq_new()
        assert cache.declare_step([s] * len(sequence))
        step = cache.prepare_step(stream=runner.stream)
        logits = runner.forward(step, sequence).clone()
        cache.commit_step()
        runner.synchronize()
        return logits
    finally:
        cache.close()


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
            with torch.inference_mode(), BatchInvariant():
                lsm = torch.log_softmax(forced, dim=-1).double().cpu()
            assert len(logprobs[k]) == len(out)
            for i, entry in enumerate(logprobs[k]):
                row = lsm[len(prompt) - 1 + i]
                assert entry.token == out[i] and entry.logprob == float(row[out[i]]), (k, i)
                for tok, value in entry.top:
                    assert value == float(row[tok])
                checked += 1
    assert checked >= 3 * N_NEW


@pytest.mark.parametrize("k,n", [(896, 4864), (4864, 896), (896, 128), (896, VOCAB)])
def test_batch_invariant_ops_at_the_models_shapes_bf16(k, n):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(700, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / 30
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
    with torch.inference_mode(), BatchInvariant():
        whole = torch.nn.functional.linear(x, w, b)
        norm = x.float().pow(2).mean(-1, keepdim=True)
        lsm = torch.log_softmax(whole.float(), dim=-1)
        for off, m in ((0, 1), (3, 7), (100, 256), (255, 2), (1, 300), (0, 700)):
            assert bits(torch.nn.functional.linear(x[off:off + m], w, b)) == bits(whole[off:off + m])
            assert bits(x[off:off + m].float().pow(2).mean(-1, keepdim=True)) == bits(norm[off:off + m])
            assert bits(torch.log_softmax(whole[off:off + m].float(), dim=-1)) == bits(lsm[off:off + m])
        # inside a CUDA graph: the same kernels, the same bits
        static = x[5:17].clone()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.nn.functional.linear(static, w, b)                  # warm-up off the capture
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            out = torch.nn.functional.linear(static, w, b)
        graph.replay()
        torch.cuda.synchronize()
        assert bits(out) == bits(whole[5:17])
    torch.testing.assert_close(whole.float(), torch.nn.functional.linear(x, w, b).float(),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("window", [0, 20])
def test_invariant_attention_reads_a_token_alike_in_a_chunk_and_in_decode(window):
    """Sequence 0's 60 tokens read as two prompt chunks beside another sequence's chunk, or
    one a step beside other decode rows (and the step padded): every token's attention
    output is the same bits, with full attention and with a window (whose units' first kv
    tile starts at a multiple of the tile whichever query opens it); and close to the
    default path's."""
    cfg = cc.CacheConfig(capacity=512, max_write=128, dtype="bfloat16", paged=True, mask_format="none",
                         layers=[cc.LayerConfig(2, 64, window)])
    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(3, 80, 14, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(3, 80, 2, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)

    def run(steps, backend, pad=None):
        cache = cc.build("cuda", "batched", cfg)
        view = cct.TorchView(cache)
        for s in range(3):
            assert cache.seq_new() == s
        fed, got = [0, 0, 0], {}
        for ids in steps:
            assert cache.declare_step(ids)
            width = len(ids)
            rows = max(pad or width, width)
            step = cache.prepare_step(stream=torch.cuda.current_stream(), pad_to=rows)
            pos = []
            for s in ids:
                pos.append((s, fed[s]))
                fed[s] += 1
            qq = torch.zeros(rows, 14, 64, device="cuda", dtype=torch.bfloat16)
            kk = torch.zeros(rows, 2, 64, device="cuda", dtype=torch.bfloat16)
            vv = torch.zeros(rows, 2, 64, device="cuda", dtype=torch.bfloat16)
            for i, (s, p) in enumerate(pos):
                qq[i], kk[i], vv[i] = q[s, p], kv[s, p, 0], kv[s, p, 1]
            out = cct.attention(view, 0, qq, kk, vv, step=step, backend=backend)
            cache.commit_step()
            for i, key in enumerate(pos):
                got[key] = out[i].clone()
        torch.cuda.synchronize()
        cache.close()
        return {k: v for k, v in got.items() if k[0] == 0}

    chunked = [[0] * 30 + [1] * 50, [2] * 20 + [0] * 30]
    decode = [[1] * 40, [2] * 10] + [[0, 1, 2] if i % 2 else [2, 0] for i in range(60)]
    a = run(chunked, "invariant")
    b = run(decode, "invariant", pad=16)
    c = run(chunked, "auto")
    assert set(a) == set(b) and len(a) == 60
    for key in a:
        assert bits(a[key]) == bits(b[key]), key
        torch.testing.assert_close(a[key].float(), c[key].float(), rtol=2e-2, atol=2e-2)


#: a Mistral with head_dim 64 (a shape the tensor-core kernels take) and a sliding window
WINDOWED = dict(arch="mistral", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=512, sliding_window=12)


def test_a_windowed_model_is_served_invariantly():
    model = shaped_model(WINDOWED, torch.bfloat16, "cuda", seed=0)
    rng = np.random.default_rng(9)
    jobs = [(rng.integers(0, 512, size=n).tolist(), Sampling(max_new_tokens=12)) for n in (5, 40)]
    ref = [serve(model, [job], capacity=512, max_batch_tokens=64, prefill_chunk=64, max_seqs=8)[0][0]
           for job in jobs]
    others = [rng.integers(0, 512, size=int(rng.integers(2, 60))).tolist() for _ in range(9)]
    got, gen = serve(model, jobs, others=others, arrivals=[0, 3], capacity=300, max_batch_tokens=24,
                     prefill_chunk=7, max_seqs=16, reserve=0.0)
    check_same(ref, got, 11)
    gen.cache.close()


def test_shapes_the_invariant_kernels_do_not_take_are_refused():
    model = random_model("llama-tiny", torch.float32, "cuda", seed=0)     # float32, head_dim 16
    cache = cc.build("cuda", "batched", cchf.cache_config(model, capacity=256, max_write=64))
    before = model.config._attn_implementation
    with pytest.raises(InvalidArgument, match="tensor-core"):
        cchf.attach(model, cache, deterministic=True)
    assert model.config._attn_implementation == before
    assert cache.live_seqs() == []
    cchf.attach(model, cache)                                     # the normal mode takes it
    cache.close()
