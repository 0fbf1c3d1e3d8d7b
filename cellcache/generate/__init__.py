"""Continuous batching for a Hugging Face decoder on the cache, and ``cellcache generate``.

:class:`Generator` keeps requests arriving at any time; every step carries each running
sequence's next token and chunks of prompts still being read, in one forward. Around it:

- sampling: greedy, or seeded temperature / top-k / top-p per request, drawn for the whole
  step at once on the model's device with one host copy of the ids (``sampler``; seeds are
  counter-based: a token depends on (seed, continuation, output index), not on the batch);
  stop tokens and a token budget; every continuation ends with a reason (``Request.finish_reasons``:
  ``"stop"``, ``"length"``, ``"capacity"``, ``"cancelled"``, ``"error"``);
- ``n > 1``: the prompt is read once; at its first token the sequence is cloned
  (``seq_clone``: the prompt's cells are shared, nothing is copied) and each continuation
  samples on its own;
- speculative decoding: a request given a ``draft`` callable gets ``k`` proposed tokens
  verified in one step; the rejected ones are rewound (``rewind``). The emitted tokens are
  what plain decoding would emit (greedy) or distributed as it (sampling);
- prefix cache (on by default, :class:`cellcache.PrefixCache`): admission matches each
  prompt against the token prefixes already in the cache and reads only the uncached tail
  (a hit clones the cached cells: nothing is copied); a prompt is stored once its last
  token is placed, and prompt + output when its continuation ends, so a multi-turn chat
  reads each turn's new tokens only; cached prefixes no running request uses are evicted
  (LRU by default) before any running request is preempted;
- admission and preemption: a waiting sequence is admitted only while the free cells
  (and the cells the prefix cache can give back) still hold every running continuation's
  remaining tokens (``reserve``) and its own; when cells run short anyway the prefix cache
  evicts first, then the most recently admitted sequence is freed and requeued at the
  head of the queue (not readmitted in the same step) and recomputed later; a request
  that can never fit is refused at :meth:`Generator.add`, one that cannot get a cell even
  alone ends with ``"capacity"``: nothing loops forever;
- streaming: ``on_token(request, continuation, token)`` for every token, called once the
  step is complete; :meth:`Generator.cancel` ends a request (a client disconnecting);
- failures: a step is a transaction. The forward and the sampling run before any state
  changes; if they raise, the step is rolled back (every sequence rewound to where it
  was) and the exception propagates. A request whose own code fails (its ``on_token`` or
  ``draft``, a draft that is not token ids, its sampling) ends with ``"error"``
  (``Request.error``), its cells are freed and the others go on; :meth:`Generator.step`
  re-raises that exception once the step is complete. Either way every sequence's cache
  length is what the generator believes, and later steps emit what they would have
  emitted had the failing request been cancelled (Ctrl-C during the generator's own
  bookkeeping is held back until the step is whole);
- threads: one thread steps a Generator (another stepping thread, or ``step()`` from
  inside a callback, gets ``InvalidState``); :meth:`Generator.add` and
  :meth:`Generator.cancel` are safe from any thread;
- on CUDA, decode steps replay a CUDA graph of their padded width (:class:`cellcache.runner.ModelRunner`),
  and run asynchronously (``async_steps``): the next decode step is planned, prepared and
  launched on the previous one's sampled ids, on the device, before they reach the host;
  outputs are the synchronous generator's, token for token;
- latency: every token's time is kept (``Request.token_times``): :meth:`Generator.latency`
  gives time to first token and inter-token latency p50/p99;
- text (a tokenizer, :meth:`Generator.from_pretrained`): prompts as text or chat messages,
  ``on_text`` deltas from incremental detokenization (never half a character), stop strings
  matched on the text and cut exactly, ``Request.texts``; waiting with
  :meth:`Request.result` and the blocking ``iter_tokens`` / ``iter_text``;
- the server knobs of :class:`Sampling` (``min_new_tokens``, ``ignore_eos``, ``min_p``,
  presence/frequency/repetition penalties, ``logit_bias``) and log-probabilities of the
  model's own distribution (``logprobs``, ``prompt_logprobs``: :class:`TokenLogprob`), on
  the device in the step's sampler call, back in its one copy; ``max_new_tokens=0`` reads
  a prompt and draws nothing (with ``prompt_logprobs``: the prompt scored);
- ``Generator.on_logits``: every forward's logits rows with the context each row saw.

Modules, by concern (each testable alone): ``text`` (incremental detokenization, stop
strings), ``requests`` (Request, Sampling, TokenLogprob, finish reasons, argument checks,
latency summary), ``prompts`` (text and chat prompts in, loading a model with its
tokenizer), ``logprobs`` (a step's log-probabilities onto its requests), ``plan``
(StepPlan, Seq, Job, Outcome and the serving rules), ``kv`` (the scheduler's one door to
the cache and the prefix cache),
``base`` (the plain scheduler: admission, chunking under the token budget, preemption,
forks, draft rewinds; ``schedule()`` / ``update_from_output()``, no model needed),
``scheduler`` (the Generator's scheduler: the base plus the steady path of lean decode
steps), ``sampler`` (batched sampling and draft verification on the device, no cache
needed), ``readback`` (the step's device-to-host copy), ``options`` (the Generator's arguments,
checked), ``engine`` (the Generator: the step
transaction, rollback, threads), ``drivers`` (chat and Poisson-arrival clients shared by
tests and ``tools/bench_serve.py``), ``state`` (cached prefixes saved to files and loaded
back: ``save_prefix``, ``load_prefix``), ``cli`` (``cellcache generate``, random models).

>>> gen = Generator(model, capacity=1 << 16)                                   # doctest: +SKIP
>>> req = gen.add([1, 2, 3], Sampling(max_new_tokens=16))                      # doctest: +SKIP
>>> gen.run(); req.outputs[0], req.finish_reasons                              # doctest: +SKIP
"""

from __future__ import annotations

from .cli import RANDOM_MODELS, main, random_model
from .drivers import chat, poisson_arrivals, serve_arrivals
from .engine import Generator
from .requests import FINISH_REASONS, Request, Sampling, TokenLogprob, latency_summary
from .sampler import Sampler, SamplerOutput, SampleSpec
from .scheduler import ADMISSION_POLICIES, Scheduler, StepPlan
from .state import load_prefix, save_prefix

__all__ = ["ADMISSION_POLICIES", "FINISH_REASONS", "RANDOM_MODELS", "Generator", "Request",
           "SampleSpec", "Sampler", "SamplerOutput", "Sampling", "Scheduler", "StepPlan",
           "TokenLogprob", "chat",
           "latency_summary", "load_prefix", "main", "poisson_arrivals", "random_model", "save_prefix",
           "serve_arrivals"]
