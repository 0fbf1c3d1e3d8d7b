"""``Generator.on_logits`` (every forward's logits rows, before sampling, with the context
each row saw) and ``Generator(deterministic=...)``, on a tiny random model (CPU, float32):
every row's logits equal Hugging Face's own forward over its context, through drafts, forks,
preemption and steps launched ahead of the previous one's ids."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cellcache import InvalidArgument  # noqa: E402
from cellcache.generate import Generator, Sampling, random_model  # noqa: E402

from .helpers import random_prompts  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return random_model("llama-tiny", seed=3)


@pytest.fixture(scope="module")
def reference():
    """The same weights, never attached: Hugging Face's own attention."""
    return random_model("llama-tiny", seed=3)


def hf_logits(ref, context):
    with torch.no_grad():
        return ref(torch.tensor([list(context)])).logits[0, -1].float()


def record(gen):
    seen = []

    def on_logits(rows, logits):
        assert logits.dtype == torch.float32 and logits.shape[0] == len(rows)
        for i, (req, k, ctx) in enumerate(rows):
            seen.append((req, k, ctx, logits[i].clone()))

    gen.on_logits = on_logits
    return seen


def check_rows(ref, seen):
    assert seen
    for req, k, ctx, got in seen:
        if isinstance(ctx, int):              # launched ahead: its last token landed since
            ctx = (req.prompt + req.outputs[k])[:ctx]
        assert len(ctx) >= 1
        torch.testing.assert_close(got, hf_logits(ref, ctx), rtol=1e-4, atol=1e-4)


def drafter(req_tokens, k):
    return [(t * 7 + 3) % 512 for t in req_tokens[-k:]]


@pytest.mark.parametrize("async_steps", [False, True])
def test_every_logits_row_is_hf_forward_over_its_context(model, reference, async_steps):
    gen = Generator(model, capacity=56, max_batch_tokens=24, max_seqs=8, prefill_chunk=8,
                    eos=[], reserve=0.0, async_steps=async_steps, prefix_cache=False)
    seen = record(gen)
    prompts = random_prompts(11, 5, lo=4, hi=14)
    reqs = [gen.add(p, Sampling(max_new_tokens=12)) for p in prompts[:3]]
    reqs.append(gen.add(prompts[3], Sampling(max_new_tokens=6, n=2, temperature=0.8, seed=1)))
    reqs.append(gen.add(prompts[4], Sampling(max_new_tokens=6), draft=drafter, draft_k=2))
    gen.run()
    assert all(r.done for r in reqs), [r.finish_reasons for r in reqs]
    assert gen.stats["preempted"] > 0 and gen.stats["forks"] > 0 and gen.stats["drafted"] > 0
    # then decode steps alone: launched ahead of the previous one's ids when async
    more = [gen.add(p, Sampling(max_new_tokens=8)) for p in random_prompts(12, 3, lo=3, hi=6)]
    gen.run()
    assert all(r.finish_reasons == ["length"] for r in more)
    if async_steps:
        assert any(isinstance(ctx, int) for _, _, ctx, _ in seen)
    check_rows(reference, seen)


def test_on_logits_is_checked_and_its_failure_is_the_steps(model):
    gen = Generator(model, capacity=64, max_batch_tokens=16, max_seqs=4, eos=[])
    assert gen.on_logits is None
    with pytest.raises(InvalidArgument, match="on_logits"):
        gen.on_logits = 3
    assert gen.on_logits is None

    def boom(rows, logits):
        raise RuntimeError("boom")

    gen.on_logits = boom
    req = gen.add([1, 2, 3], Sampling(max_new_tokens=3))
    with pytest.raises(RuntimeError, match="boom"):
        gen.step()
    assert req.outputs == [[]] and gen.cache.free_cells == gen.cache.config.capacity
    gen.on_logits = None
    gen.run()
    assert req.finish_reasons == ["length"] and len(req.outputs[0]) == 3


def test_deterministic_is_checked(model):
    with pytest.raises(InvalidArgument, match="deterministic"):
        Generator(model, capacity=64, eos=[], deterministic=1)
    gen = Generator(model, capacity=64, eos=[])
    assert gen.deterministic is False
