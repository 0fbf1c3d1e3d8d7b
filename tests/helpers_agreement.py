"""A serving schedule that makes every kind of row the served path computes, for the
end-to-end agreement checks (cellcache.generate.agreement): prompts read in chunks through
a shared system prompt (prefix-cache hits), decode steps at several widths (arrivals over
time: padded buckets), a fork (n=2), drafts that are mostly wrong (verified and rewound),
and a cache too small for everything at once (preemption, prompts read again)."""

from __future__ import annotations

from typing import Any

import numpy as np


def shaped_model(spec: dict[str, Any], dtype: Any, device: str, seed: int = 0) -> Any:
    """A random-weight HF model of ``spec`` (``arch`` and config keywords), in eval mode."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(spec)
    config = AutoConfig.for_model(spec.pop("arch"), **spec)
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def serve_every_kind(gen: Any, vocab: int, *, seed: int = 0, system_len: int = 40,
                     new_tokens: int = 20) -> list:
    """Serves nine requests on ``gen`` (built with a small capacity and ``reserve=0`` so
    that it preempts, a prefix cache, a short ``prefill_chunk``): a shared system prompt,
    three arriving at once (one with ``n=2``, one with drafts), six more after three steps.
    Returns the requests, finished."""
    from cellcache.generate import Sampling

    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, size=system_len).tolist()

    def prompt() -> list[int]:
        own = rng.integers(0, vocab, size=int(rng.integers(3, 40))).tolist()
        return system + own

    def draft(tokens: list[int], k: int) -> list[int]:     # mostly wrong: verified, rewound
        return [int(t) for t in np.random.default_rng(len(tokens)).integers(0, vocab, size=k)]

    reqs = [gen.add(prompt(), Sampling(max_new_tokens=new_tokens, n=2 if i == 0 else 1),
                    draft=draft if i == 1 else None, draft_k=3) for i in range(3)]
    for _ in range(3):
        gen.step()
    reqs += [gen.add(prompt(), Sampling(max_new_tokens=new_tokens)) for _ in range(6)]
    gen.run()
    return reqs
