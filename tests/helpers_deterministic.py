"""What the deterministic-mode tests share (tests/test_deterministic.py on the host,
tests/gpu/test_deterministic_gpu.py on CUDA): serving target requests in a randomized
schedule with every logits row recorded, and the bit-for-bit comparison of two runs."""

from __future__ import annotations

import numpy as np
import torch

from cellcache.generate import Generator, Sampling

from .helpers_agreement import shaped_model  # noqa: F401 - (re-exported for the GPU tests)

VOCAB = 512


def bits(t: torch.Tensor) -> bytes:
    """The float32 bytes of ``t`` (any device): bit-for-bit comparisons, -0.0 included."""
    return t.detach().float().contiguous().view(torch.uint8).cpu().numpy().tobytes()


def drafter(tokens: list[int], k: int) -> list[int]:
    """Drafts that depend on the tokens alone (mostly wrong: verified, then rewound)."""
    return [(t * 7 + 3) % VOCAB for t in tokens[-k:]]


def serve(model, jobs, *, others=(), arrivals=None, seed=0, other_tokens=10, warmup=False, **kw):
    """Serves ``jobs`` ((prompt, Sampling[, keywords of Generator.add])) beside ``others``
    (prompts, greedy, up to ``other_tokens`` + 3 new tokens each) in one deterministic
    Generator (``kw``: its arguments; ``warmup``: its graphs captured first); job i arrives
    after ``arrivals[i]`` steps (0: at once). Returns (per job, the Generator); per job
    (outputs, {(k, context): logits bits}, logprobs: ``Request.logprobs`` or None), where
    every context's logits were the same bits each time a step saw it (a recomputed row is
    checked against its first)."""
    gen = Generator(model, eos=[], deterministic=True, **kw)
    seen: list[tuple] = []

    def on_logits(rows, logits):
        for i, (req, k, ctx) in enumerate(rows):
            seen.append((req, k, ctx, bits(logits[i])))

    gen.on_logits = on_logits
    if warmup:
        gen.warmup()
    arrivals = arrivals or [0] * len(jobs)
    order = sorted(range(len(jobs) + len(others)), key=lambda i: (arrivals + [0] * len(others))[i])
    rng = np.random.default_rng(seed)
    reqs: dict[int, object] = {}
    step = 0
    pending = list(order)
    while pending or not all(r.done for r in reqs.values()):
        while pending and (pending[0] >= len(jobs) or arrivals[pending[0]] <= step):
            i = pending.pop(0)
            if i < len(jobs):
                reqs[i] = gen.add(*jobs[i][:2], **(jobs[i][2] if len(jobs[i]) > 2 else {}))
            else:
                reqs[i] = gen.add(others[i - len(jobs)],
                                  Sampling(max_new_tokens=int(rng.integers(1, other_tokens + 4))))
        gen.step()
        step += 1
        assert step < 2000
    gen.run()
    results = []
    for i in range(len(jobs)):
        req = reqs[i]
        logits: dict[tuple, bytes] = {}
        for r, k, ctx, b in seen:
            if r is not req:
                continue
            if isinstance(ctx, int):               # launched ahead: resolved now
                ctx = tuple((list(req.prompt) + list(req.outputs[k]))[:ctx])
            key = (k, tuple(ctx))
            assert logits.setdefault(key, b) == b, "a context's logits changed within one run"
        lps = None if req.logprobs is None else [list(lp) for lp in req.logprobs]
        results.append(([list(o) for o in req.outputs], logits, lps))
    assert gen.cache.free_cells == gen.cache.capacity or gen.prefix is not None
    return results, gen


def check_same(ref, got, min_common):
    """Two runs' results (:func:`serve`) agree: the same outputs and log-probabilities (every
    float equal), and the same logits bits for every context both saw (at least
    ``min_common`` of them per job)."""
    for (out_a, log_a, lp_a), (out_b, log_b, lp_b) in zip(ref, got):
        assert out_a == out_b
        assert lp_a == lp_b
        common = set(log_a) & set(log_b)
        # every sampled token's row is in both (a prompt's last row, every output but the last)
        assert len(common) >= min_common
        for key in common:
            assert log_a[key] == log_b[key], f"logits differ after {len(key[1])} tokens"


