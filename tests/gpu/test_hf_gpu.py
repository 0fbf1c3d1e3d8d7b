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
