"""The generator on the H200: greedy output equals Hugging Face's own generate token for
token, with CUDA graph replay of decode steps, arrivals over time, forks, speculative
rewinds and preemption (float32, so the two attentions agree to rounding)."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.mark.parametrize("arch", ["tiny", "llama-tiny", "mistral-tiny"])
def test_greedy_equals_hf_on_cuda_with_graphs(arch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from cellcache.generate import Generator, Sampling, random_model

    model = random_model(arch, torch.float32, "cuda", seed=3)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 512, size=int(rng.integers(2, 45))).tolist() for _ in range(7)]
    n_new = 24
    refs = []
    for p in prompts:
        out = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=n_new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    by_prompt = {tuple(p): r for p, r in zip(prompts, refs)}

    def draft(tokens, k):
        for p, ref in by_prompt.items():
            if tuple(tokens[:len(p)]) == p:
                done = len(tokens) - len(p)
                return ref[done:done + k - 1] + [7]         # all but the last right
        return []

    gen = Generator(model, capacity=160, max_batch_tokens=32, max_seqs=32, prefill_chunk=9, eos=[],
                    reserve=0)          # admit eagerly, so that cells run short and it preempts
    reqs = [gen.add(p, Sampling(max_new_tokens=n_new, n=2 if i == 0 else 1),
                    draft=draft if i == 1 else None, draft_k=3) for i, p in enumerate(prompts[:3])]
    for _ in range(3):
        gen.step()
    reqs += [gen.add(p, Sampling(max_new_tokens=n_new)) for p in prompts[3:]]
    gen.run()
    assert reqs[0].outputs == [refs[0]] * 2
    assert [r.outputs[0] for r in reqs[1:]] == refs[1:]
    assert gen.stats["graph_steps"] > 0 and gen.stats["forks"] == 1
    assert gen.stats["accepted"] > 0 and gen.stats["preempted"] > 0
    gen.cache.check_invariants()
    gen.cache.close()


def test_prefix_cache_on_off_and_hf_agree_on_cuda():
    """Shared system prompts and a multi-turn conversation on the GPU, float32: the prefix
    cache's reuse (clones of cached cells, only tails computed) gives the same greedy tokens
    as reading every prompt whole, and each is HF's own greedy choice: the argmax of the HF
    model's full forward over prompt + output at every generated position. (That full forward,
    not ``generate``, is the reference here: on a sliding-window model transformers'
    ``generate`` with its sliding cache can disagree with its own full forward.)"""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from cellcache.generate import Generator, Sampling, random_model

    model = random_model("tiny", torch.float32, "cuda", seed=5)   # windows of 16 < prompts
    rng = np.random.default_rng(3)
    system = rng.integers(0, 512, size=40).tolist()
    prompts = [system + rng.integers(0, 512, size=int(rng.integers(1, 12))).tolist()
               for _ in range(12)]
    n_new = 10
    runs = {}
    for on in (True, False):
        gen = Generator(model, capacity=2048, max_batch_tokens=64, max_seqs=16, prefill_chunk=16,
                        eos=[], prefix_cache=on)
        reqs = [gen.add(p, Sampling(max_new_tokens=n_new)) for p in prompts]
        gen.run()
        second = prompts[0] + reqs[0].outputs[0] + [5, 6, 7]          # the next turn
        turn2 = gen.add(second, Sampling(max_new_tokens=n_new))
        gen.run()
        runs[on] = ([r.outputs[0] for r in reqs], turn2.outputs[0], dict(gen.stats))
        gen.cache.check_invariants()
        gen.cache.close()
    assert runs[True][:2] == runs[False][:2]
    model.set_attn_implementation("sdpa")                  # HF's own attention again
    outs, out2, on = runs[True]
    for p, out in [*zip(prompts, outs), (prompts[0] + outs[0] + [5, 6, 7], out2)]:
        with torch.no_grad():
            logits = model(torch.tensor([p + out], device="cuda")).logits[0]
        assert logits[len(p) - 1:-1].argmax(-1).tolist() == out
    off = runs[False][2]
    assert on["cached_tokens"] >= 40 * (len(prompts) - 1) + len(prompts[0]) and off["cached_tokens"] == 0
    assert on["computed_tokens"] < off["computed_tokens"]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_warmup_then_greedy_equals_hf_on_cuda(compile):
    """``warmup()`` captures every reachable decode bucket and every mixed-step token bucket
    before serving and leaves the cache as it was; the run then replays them (no eager
    step, no capture); greedy output equals HF's ``generate`` token for token, with the
    forward compiled (``compile=True``) and without."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from cellcache.generate import Generator, Sampling, random_model

    model = random_model("llama-tiny", torch.float32, "cuda", seed=5)
    rng = np.random.default_rng(12)
    prompts = [rng.integers(0, 512, size=int(rng.integers(3, 40))).tolist() for _ in range(6)]
    n_new = 20
    refs = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=n_new, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    gen = Generator(model, capacity=1024, max_batch_tokens=64, max_seqs=8, prefill_chunk=16,
                    eos=[], prefix_cache=False, compile=compile)
    runner = gen.runner
    assert runner.mixed_buckets == [16, 32, 64]
    free, live = gen.cache.free_cells, gen.cache.live_seqs()
    captured = gen.warmup()
    assert captured == {"decode": [1, 2, 4, 8], "mixed": [16, 32, 64]}
    assert gen.cache.free_cells == free and gen.cache.live_seqs() == live
    assert gen.warmup() == {"decode": [], "mixed": []}          # nothing left to capture
    graphs, mixed, eager = runner.graphs, runner.mixed_graphs, runner.eager
    reqs = [gen.add(p, Sampling(max_new_tokens=n_new)) for p in prompts]
    gen.run()
    assert [r.outputs[0] for r in reqs] == refs
    assert gen.stats["graph_steps"] == gen.stats["steps"] and runner.eager == eager
    for before, after in ((graphs, runner.graphs), (mixed, runner.mixed_graphs)):
        assert after.keys() == before.keys()
        assert all(after[k][0] is before[k][0] for k in before)   # replayed, never recaptured
    gen.cache.check_invariants()
    gen.cache.close()


@pytest.mark.parametrize("shape", ["decode", "mixed"])
def test_graph_greedy_ids_and_fed_inputs_match_the_synchronous_run(shape):
    """The decode graphs compute each row's argmax and leave it in the next step's input;
    the sampler takes those ids for greedy rows and the next step of the same rows reads
    them where they lie. Greedy and seeded random requests side by side, rows ending at
    different lengths (so rows drop out and the feed is gathered): the asynchronous run,
    which feeds on the device, gives exactly the synchronous run's tokens, and greedy ones
    equal HF's ``generate``. ``mixed``: longer prompts read in chunks and admitted a few at
    a time while others decode, so that mixed steps are planned and launched ahead of the
    step in flight (decode rows fed its draws on the device, prompt rows from the host,
    replayed from the mixed graphs)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from cellcache.generate import Generator, Sampling, random_model

    seed, n, lengths, budget, chunk = {"decode": (21, 10, (3, 30), 64, 32),
                                       "mixed": (31, 24, (10, 60), 48, 16)}[shape]
    model = random_model("llama-tiny", torch.float32, "cuda", seed=7)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 512, size=int(rng.integers(*lengths))).tolist() for _ in range(n)]
    samplings = [Sampling(max_new_tokens=12 + 3 * (i % 4), temperature=0.9 if i % 3 == 1 else 0.0,
                          top_k=20 if i % 3 == 1 else 0, seed=i) for i in range(len(prompts))]
    # an explicit mask: HF would take the prompts' id 0 for padding (pad_token_id=0) and mask it
    refs = [model.generate(torch.tensor([p], device="cuda"),
                           attention_mask=torch.ones((1, len(p)), dtype=torch.long, device="cuda"),
                           max_new_tokens=s.max_new_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist()
            for p, s in zip(prompts, samplings)]
    outs, ahead = {}, {}
    for async_steps in (True, False):
        gen = Generator(model, capacity=2048, max_batch_tokens=budget, max_seqs=16, prefill_chunk=chunk,
                        eos=[], prefix_cache=False, async_steps=async_steps)
        gen.warmup()
        reqs = [gen.add(p, s) for p, s in zip(prompts, samplings)]
        gen.run()
        assert gen.stats["graph_steps"] == gen.stats["steps"]
        outs[async_steps] = [r.outputs[0] for r in reqs]
        ahead[async_steps] = gen.profile["mixed_ahead_steps"]
        gen.cache.check_invariants()
        gen.cache.close()
    assert ahead[False] == 0 and (ahead[True] >= 3 or shape == "decode")
    assert outs[True] == outs[False]
    greedy = [i for i, s in enumerate(samplings) if s.temperature == 0]
    assert [outs[True][i] for i in greedy] == [refs[i] for i in greedy]
    assert any(outs[True][i] != refs[i] for i in range(len(prompts)) if i not in greedy)  # sampled


def test_a_replay_without_logits_hands_the_same_ids_and_leaves_the_buffer():
    """``forward(logits=False)``: a replayed decode step writes its greedy ids and not the
    float32 logits (the generator asks so where its draws read only the ids), the next
    replay that asks writes them again, and eager steps write them either way. Three sets
    of clones of the same histories decode the same tokens, so each step's ids and logits
    are the same."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from cellcache.generate import Generator, random_model

    model = random_model("llama-tiny", torch.float32, "cuda", seed=5)
    gen = Generator(model, capacity=512, max_batch_tokens=64, max_seqs=16, eos=[], prefix_cache=False)
    cache, runner = gen.cache, gen.runner
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 512, size=int(rng.integers(3, 12))).tolist() for _ in range(4)]
    roots = []
    for p in prompts:                            # each prompt read eagerly
        s = cache.seq_new()
        assert cache.declare_step([s] * len(p))
        runner.forward(cache.prepare_step(), p, [len(p) - 1])
        cache.commit_step()
        roots.append(s)
    nxt = [int(rng.integers(0, 512)) for _ in prompts]
    got = []
    for want in (True, False, True, False):
        seqs = [cache.seq_clone(s) for s in roots]
        assert cache.declare_step(seqs)
        pad_to, decode = runner.padding(True, len(seqs), len(seqs), len(seqs))
        assert decode
        replays = runner.replays
        out = runner.forward(cache.prepare_step(stream=runner.stream_handle, pad_to=pad_to), nxt,
                             decode=True, logits=want)
        cache.commit_step()
        assert runner.replays == replays + 1 and runner.greedy is not None
        torch.cuda.synchronize()
        got.append((out.clone(), runner.greedy.clone()))
        with torch.inference_mode():             # (the graphs' buffer: an inference tensor)
            out.fill_(7.0)                       # what a replay without logits leaves
        for s in seqs:
            cache.seq_rm(s)
    (l0, g0), (l1, g1), (l2, g2), (l3, g3) = got
    assert torch.equal(g0, torch.argmax(l0, -1)) and torch.equal(g1, g0) and torch.equal(g3, g0)
    assert bool((l1 == 7).all()) and bool((l3 == 7).all()) and torch.equal(l2, l0)
    # a refused flag (not a bool) leaves the graphs' flag as the last replay set it (off)
    from cellcache.errors import InvalidArgument
    torch.cuda.synchronize()
    flag = runner._write.clone()
    assert int(flag) == 0 and runner._writing is False
    with pytest.raises(InvalidArgument, match="on of type"):
        runner.write_logits(1)
    torch.cuda.synchronize()
    assert torch.equal(runner._write, flag) and runner._writing is False
    # some rows' logits only: no greedy ids handed out, so the replay writes them anyway
    seqs = [cache.seq_clone(s) for s in roots]
    assert cache.declare_step(seqs)
    part = runner.forward(cache.prepare_step(stream=runner.stream_handle, pad_to=pad_to), nxt, [0, 2],
                          decode=True, logits=False)
    cache.commit_step()
    assert runner.replayed and runner.greedy is None and torch.equal(part, l0[[0, 2]])
    for s in seqs:
        cache.seq_rm(s)
    seqs = [cache.seq_clone(s) for s in roots]   # eager (no padding): written though not asked
    assert cache.declare_step(seqs)
    eager = runner.forward(cache.prepare_step(), nxt, logits=False)
    cache.commit_step()
    assert torch.allclose(eager, l0, atol=1e-4, rtol=1e-4)
    cache.check_invariants()
    cache.close()
