"""A step's log-probabilities, from the sampler's output onto the requests (issue 40 §2).

::

    SamplerOutput.logprobs = (logprob [L], top ids [L, K], top logprobs [L, K])
        entries 0 .. m-1:  the spec's extras that ask for ``logprobs``, in slot order
                           -> request.logprobs[k] gets one TokenLogprob per emitted token
        entries m .. L-1:  the spec's prompt rows, in order (plan.prompt_lp says whose)
                           -> request.prompt_logprobs[i] = TokenLogprob(prompt[i], ...)

What the values are is the sampler's (:meth:`Sampler._logprobs
<cellcache.generate.sampler.Sampler>`): the model's own distribution, ``log_softmax`` of the
float32 logits before ``logit_bias``, penalties, temperature and truncation. Nothing here
imports torch.
"""

from __future__ import annotations

import numpy as np

from .plan import Outcome, SamplerOutput, StepPlan
from .requests import TokenLogprob

__all__ = ["record_lean_logprobs", "record_logprobs"]


def _entry(out: tuple[np.ndarray, np.ndarray, np.ndarray], i: int, token: int, top: int) -> TokenLogprob:
    chosen, ti, tv = out
    alts = list(zip(ti[i, :top].tolist(), tv[i, :top].tolist())) if top else []
    return TokenLogprob(int(token), float(chosen[i]), alts)


def record_logprobs(plan: StepPlan, output: SamplerOutput, outcomes: list[Outcome]) -> None:
    """Hands the step's log-probabilities to their requests: prompt entries to
    ``prompt_logprobs``, and one entry per token each outcome emits (its forks' first
    tokens too) to ``logprobs[k]``, in order. Called just before the outcomes are applied,
    skipping those :meth:`~.base.BaseScheduler.update_from_output` skips (a request that
    failed or was cancelled meanwhile), so each ``logprobs[k]`` stays as long as
    ``outputs[k]``."""
    lp = output.logprobs
    if lp is None:
        return
    spec = plan.spec
    entry: dict[int, tuple[int, int]] = {}           # slot -> (entry, top)
    for e in spec.extras:
        top = e.sampling.logprobs
        if top is not None:
            entry[e.slot] = (len(entry), top)
    m = len(entry)
    for j, ((_, token, top), (req, pos)) in enumerate(zip(spec.prompt_rows, plan.prompt_lp)):
        if req.prompt_logprobs is not None:
            req.prompt_logprobs[pos] = _entry(lp, m + j, token, top)
    if not m:
        return
    first = {id(s): f for s, _, f, _ in plan.owners if f is not None}
    for o in outcomes:
        s = o.seq
        req = s.req
        if req.logprobs is None or s.job.closed or s.sid is None or id(s) not in first:
            continue
        slot = first[id(s)]
        for j, tok in enumerate(o.tokens):
            i, top = entry[slot + j]
            req.logprobs[s.index].append(_entry(lp, i, tok, top))
        for j, (child, tok) in enumerate(o.forks, 1):
            i, top = entry[slot + j]
            req.logprobs[child.index].append(_entry(lp, i, tok, top))


def record_lean_logprobs(plan: StepPlan, output: SamplerOutput) -> None:
    """:func:`record_logprobs` for a lean plan (slot i drew row i's one token): each row
    still in the plan whose request asks gets its token's entry, skipping the rows
    :meth:`~.base.BaseScheduler.apply_decode` skips. Called just before it."""
    lp = output.logprobs
    if lp is None:
        return
    seq_of = {slot: s for s, _, slot, _ in plan.owners}   # (rows dropped meanwhile: absent)
    ids = output.ids
    i = 0
    for e in plan.spec.extras:
        top = e.sampling.logprobs
        if top is None:
            continue
        s = seq_of.get(e.slot)
        if s is not None and not s.job.closed and s.sid is not None:
            req = s.req
            if req.logprobs is not None:
                req.logprobs[s.index].append(_entry(lp, i, int(ids[e.slot]), top))
        i += 1
