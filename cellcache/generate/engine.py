"""The Generator: requests in, tokens out, one step a call (the package docstring has the
whole picture). It ties the :class:`~cellcache.generate.scheduler.Scheduler` (every cache
verb), the :class:`cellcache.hf.ModelRunner` (the forward) and the
:class:`~cellcache.generate.sampler.Sampler` (every draw of a step, one host copy) into a
transaction per step, and keeps the threading rules.

::

    step():  drain add/cancel hand-overs -> drafts (user code) -> schedule() [declared]
             -> prepare_step -> forward -> commit -> sample (one D2H) -> decide
             -> update_from_output [Ctrl-C held] -> on_token callbacks (user code)
    failure before update: rollback(plan) and re-raise; a request's own code: "error"
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .._checks import check_int
from ..cache import CellCache
from ..errors import InvalidArgument, InvalidState
from ..hf import attach, cache_config
from ..prefix import PrefixCache
from ..registry import build
from .requests import Request, Sampling, latency_summary, real_number, token_ids
from .sampler import Sampler, SamplerOutput
from .scheduler import ADMISSION_POLICIES, Job, Outcome, PendingPrompts, Scheduler, Seq, StepPlan

__all__ = ["Generator"]

_PREFIX_OPTIONS = ("policy", "max_seqs", "on_event")

#: Default token budget a step (``max_batch_tokens``) and prompt chunk on a GPU: a step of
#: 8K rows keeps an H200 busy through the prefill kernels; the CPU defaults stay small.
CUDA_BATCH_TOKENS, CUDA_PREFILL_CHUNK = 8192, 2048
CPU_BATCH_TOKENS, CPU_PREFILL_CHUNK = 512, 256


class _HoldInterrupts:
    """Holds Ctrl-C back while the generator's bookkeeping runs (on the main thread, with
    Python's default SIGINT handler): an interrupt there would leave sequences half
    advanced. ``hit`` tells the caller to raise KeyboardInterrupt once the state is whole."""

    def __init__(self) -> None:
        self.hit = False
        self._old: Any = None

    def _handler(self, signum: int, frame: Any) -> None:
        self.hit = True

    def __enter__(self) -> _HoldInterrupts:
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None


class Generator:
    """Continuous batching of a transformers decoder over a cellcache (package docstring).

    ``cache`` defaults to one built for the model (:func:`cellcache.hf.cache_config`; CUDA
    with the paged view when the model is on a GPU, the host backend otherwise) with
    ``capacity`` cells and ``max_batch_tokens`` rows a step: the token budget of a step
    (decode rows, drafts, prompt chunks together). It defaults to 8192 on a GPU and 512 on
    the CPU; with a ``cache`` given it is the cache's ``max_write``. ``prefill_chunk``
    bounds the prompt tokens one sequence reads per step (default 2048 on a GPU, 256 on the
    CPU, at most the budget). ``eos``: end-of-sequence ids (default: the model's generation
    config). ``clock``: what times requests (default ``time.perf_counter``).

    ``reserve`` (0 to 1, default 1) is the share of the running continuations' remaining
    tokens (up to ``max_new_tokens`` each, ``n`` continuations for ``n > 1``) that
    admission keeps free: at 1 a sequence is admitted only when the cache can hold every
    running continuation to its full length and the new one too, so no preemption (and no
    recompute) happens unless something outside the generator takes cells; lower values
    admit more sequences at once (useful when requests usually stop well before
    ``max_new_tokens``) at the cost of preemptions. When nothing runs, the first waiting
    sequence is admitted whatever it needs, so there is always progress.

    ``prefix_cache`` (default True) keeps computed prefixes for later requests
    (:class:`cellcache.PrefixCache`, ``gen.prefix``): True, False (off), a mapping of
    PrefixCache options (``policy``: ``"lru"``, ``"lfu"``, ``"priority"`` or a callable;
    ``max_seqs``: the ids its tree may hold; ``on_event``), or a PrefixCache over ``cache``.
    A waiting sequence is matched against it (``match(tokens, max_len=len - 1)``: one
    token is always fed, for its logits) and reads only the uncached tail; its prompt is
    stored once the step that placed the prompt's last token is applied, and its prompt
    and output (every token in the cache) when it ends, whatever the reason; a waiting
    prompt that shares more with a prompt being read than with the cache waits until that
    one is stored, so a shared prefix is computed once. The prefix a running request uses
    is pinned; cached prefixes are evicted when cells run short, before a running request
    is preempted, and when no sequence id is free. When the Generator builds the cache it
    gives it ``max_seqs`` ids for running sequences plus the prefix cache's budget (its
    ``max_seqs`` option, default ``max_seqs``); with a cache given, the budget defaults to
    half the ids not live. ``admission``: ``"fifo"`` (default) or ``"lpm"`` (the waiting
    sequence with the longest cached prefix first, ties in arrival order; preempted ones stay
    first; FIFO without a prefix cache). Call ``gen.prefix.clear()`` only while nothing
    runs (pins of running requests go with it).

    ``stats``: ``steps``, ``tokens_in`` (every row fed), ``tokens_out``, ``preempted``,
    ``forks``, ``drafted``, ``accepted``, ``graph_steps``, and for prompts ``prompt_tokens``
    (each request's prompt, counted at its first admission), ``cached_tokens`` (tokens an
    admission found in the prefix cache) and ``computed_tokens`` (tokens fed as prompt
    chunks, recomputes after preemption included): when every prompt is read once (no
    preemption, no fork waiting for an id) ``prompt_tokens == cached_tokens +
    computed_tokens``. :meth:`latency` summarizes time to first token and inter-token
    latency.

    One thread steps a Generator: :meth:`step` (and :meth:`run`) from a second thread while
    a step runs, or from inside an ``on_token``/``draft`` callback, raises InvalidState
    and changes nothing. :meth:`add` and :meth:`cancel` are safe from any thread and from
    callbacks; a request added during a step joins at the next one.

    Example
    -------
    >>> model = random_model("llama-tiny")                                       # doctest: +SKIP
    >>> gen = Generator(model, capacity=1024, eos=[])                            # doctest: +SKIP
    >>> req = gen.add([1, 2, 3], Sampling(max_new_tokens=4))                     # doctest: +SKIP
    >>> gen.run(); len(req.outputs[0]), req.finish_reasons                       # doctest: +SKIP
    (4, ['length'])
    """

    def __init__(self, model: Any, cache: CellCache | None = None, *, capacity: int = 1 << 15,
                 max_batch_tokens: int | None = None, max_seqs: int = 256,
                 prefill_chunk: int | None = None, graphs: bool | None = None,
                 buckets: list[int] | None = None, eos: Sequence[int] | None = None,
                 reserve: float = 1.0, prefix_cache: bool | PrefixCache | Mapping[str, Any] = True,
                 admission: str = "fifo", clock: Callable[[], float] | None = None):
        on_cuda = getattr(getattr(model, "device", None), "type", "cpu") == "cuda"
        if max_batch_tokens is None:
            max_batch_tokens = min(CUDA_BATCH_TOKENS if on_cuda else CPU_BATCH_TOKENS, capacity) \
                if isinstance(capacity, int) and capacity > 0 else CPU_BATCH_TOKENS
        if prefill_chunk is None:
            prefill_chunk = CUDA_PREFILL_CHUNK if on_cuda else CPU_PREFILL_CHUNK
        prefill_chunk = check_int(prefill_chunk, "prefill_chunk", 1)
        reserve = real_number(reserve, "reserve")
        if not 0 <= reserve <= 1:
            raise InvalidArgument(f"reserve={reserve} is outside [0, 1]")
        if clock is not None and not callable(clock):
            raise InvalidArgument(f"clock of type {type(clock).__name__} is not callable or None")
        if eos is None:
            eos_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
            eos = [eos_id] if isinstance(eos_id, int) else list(eos_id or [])
        eos_ids = token_ids(eos, "eos", None, allow_empty=True)
        if cache is not None and not isinstance(cache, CellCache):
            raise InvalidArgument(f"cache of type {type(cache).__name__} is not a cellcache cache")
        if not isinstance(admission, str) or admission not in ADMISSION_POLICIES:
            raise InvalidArgument(f"admission={admission!r} is not one of {', '.join(ADMISSION_POLICIES)}")
        prefix_opts: dict[str, Any] | None = None
        given: PrefixCache | None = None
        if isinstance(prefix_cache, PrefixCache):
            given = prefix_cache
            if cache is None and isinstance(given.cache, CellCache):
                cache = given.cache
            if given.cache is not cache:
                raise InvalidArgument("prefix_cache is a PrefixCache over another cache; give one "
                                      "over this Generator's cache (or True to have it built)")
        elif isinstance(prefix_cache, (bool, np.bool_)):
            prefix_opts = {} if prefix_cache else None
        elif isinstance(prefix_cache, Mapping):
            prefix_opts = dict(prefix_cache)
            unknown = sorted(str(k) for k in prefix_opts if k not in _PREFIX_OPTIONS)
            if unknown:
                raise InvalidArgument(f"prefix_cache options {', '.join(unknown)} are unknown; "
                                      f"give {', '.join(_PREFIX_OPTIONS)}")
            if "max_seqs" in prefix_opts:
                prefix_opts["max_seqs"] = check_int(prefix_opts["max_seqs"], "prefix_cache max_seqs", 1)
        else:
            raise InvalidArgument(f"prefix_cache of type {type(prefix_cache).__name__} is not a bool, "
                                  "a mapping of PrefixCache options or a PrefixCache")
        if cache is None:
            max_seqs = check_int(max_seqs, "max_seqs", 1)
            ids = max_seqs
            if prefix_opts is not None:
                prefix_opts.setdefault("max_seqs", max_seqs)
                ids += prefix_opts["max_seqs"]
            cfg = cache_config(model, capacity=capacity, max_write=max_batch_tokens, max_seqs=ids)
            cache = build("cuda" if model.device.type == "cuda" else "host", "batched", cfg)
        if prefix_opts is not None:                    # refused here before the model is touched
            if "max_seqs" not in prefix_opts:           # half the ids nobody holds yet
                left = cache.max_seqs - len(cache.live_seqs())
                prefix_opts["max_seqs"] = max(1, left // 2)
            prefix_opts["max_seqs"] = min(prefix_opts["max_seqs"], cache.max_seqs)
            given = PrefixCache(cache, **prefix_opts)
        self.model, self.cache = model, cache
        self.runner = attach(model, cache, graphs=graphs, buckets=buckets)
        self.clock: Callable[[], float] = clock or time.perf_counter
        self.vocab: int = self.runner.vocab
        self.max_batch = cache.config.max_write
        self.prefill_chunk = prefill_chunk
        #: Every cache verb of serving: queues, admission, preemption, the prefix cache.
        self.scheduler = Scheduler(cache, given, max_batch=self.max_batch, prefill_chunk=prefill_chunk,
                                   reserve=reserve, eos=set(eos_ids), admission=admission,
                                   clock=self.clock)
        #: Draws every token of a step on the model's device (one host copy a step).
        self.sampler = Sampler(self.runner.device)
        self.requests: list[Request] = []
        self._jobs: dict[int, Job] = {}        # id(request) -> its serving state
        self._ids = 0
        # _step_lock: held by the stepping thread (others are refused); _state_lock: held
        # while the queues and the cache change (a step, or add/cancel between steps);
        # _queue_lock: the hand-over lists add() and cancel() fill during a step.
        self._step_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._queue_lock = threading.Lock()
        self._incoming: list[Seq] = []
        self._cancels: list[Job] = []
        self._stepping: int | None = None      # the stepping thread's id
        self._phase: str | None = None         # "draft" / "deliver": callbacks are running
        self._drawn: SamplerOutput | None = None   # the step's draws, while it is decided
        self.stream = torch.cuda.current_stream(self.runner.device) if self.runner.cuda else None

    # -- what the scheduler holds, by their old names ------------------------------------------------
    @property
    def prefix(self) -> PrefixCache | None:
        """The prefix cache (None when off)."""
        return self.scheduler.prefix

    @property
    def waiting(self) -> list[Seq]:
        """Continuations with no cache id yet (new, or preempted), in admission order."""
        return self.scheduler.waiting

    @property
    def running(self) -> list[Seq]:
        return self.scheduler.running

    @property
    def stats(self) -> dict[str, int]:
        return self.scheduler.stats

    @property
    def admission(self) -> str:
        return self.scheduler.admission

    @property
    def reserve(self) -> float:
        return self.scheduler.reserve

    @property
    def eos(self) -> set[int]:
        return self.scheduler.eos

    @property
    def _pending(self) -> PendingPrompts:
        return self.scheduler.pending

    def latency(self, requests: Sequence[Request] | None = None) -> dict[str, float | int | None]:
        """TTFT and inter-token latency p50/p99/mean in ms over ``requests`` (default every
        request added): :func:`cellcache.generate.requests.latency_summary`."""
        if requests is None:
            with self._queue_lock:
                requests = list(self.requests)
        return latency_summary(requests)

    # -- requests --------------------------------------------------------------------------------
    def add(self, prompt: Any, sampling: Sampling | None = None, *,
            on_token: Callable | None = None, draft: Callable | None = None,
            draft_k: int = 4) -> Request:
        """Queues a prompt; returns its Request.

        ``prompt``: token ids in ``[0, vocab)`` as a sequence of ints, a 1-D integer array or
        tensor, or a ``[1, T]`` one (a tokenizer's ``return_tensors`` output).
        ``on_token(request, continuation, token)`` is called for every token once its step
        is complete. ``draft(tokens, k)`` proposes up to ``k`` (``draft_k``, an int >= 0)
        next tokens for speculative decoding; what it returns must be token ids in the
        vocabulary, or the request ends with ``"error"``.

        Everything is checked first; a refusal raises InvalidArgument with nothing queued.
        A request that could never fit is refused: a continuation holds its prompt and every
        output token but the last, ``len(prompt) + max_new_tokens - 1`` cells (and as many
        paged-view entries, ``max_kv``).
        """
        ids = token_ids(prompt, "prompt", self.vocab)
        if sampling is None:
            sampling = Sampling()
        elif not isinstance(sampling, Sampling):
            raise InvalidArgument(f"sampling of type {type(sampling).__name__} is not a Sampling")
        else:
            sampling = dataclasses.replace(sampling)    # checked again (fields may have changed)
        for name, fn in (("on_token", on_token), ("draft", draft)):
            if fn is not None and not callable(fn):
                raise InvalidArgument(f"{name} of type {type(fn).__name__} is not callable or None")
        draft_k = check_int(draft_k, "draft_k", 0, 1 << 20)
        need = len(ids) + sampling.max_new_tokens - 1
        cfg = self.cache.config
        if need > cfg.capacity:
            raise InvalidArgument(
                f"a prompt of {len(ids)} tokens with max_new_tokens={sampling.max_new_tokens} needs "
                f"{need} cells (its prompt and every output token but the last); the cache has "
                f"capacity={cfg.capacity}: shorten the prompt or max_new_tokens, or build a larger cache")
        if cfg.paged and need > cfg.max_kv:
            raise InvalidArgument(
                f"a prompt of {len(ids)} tokens with max_new_tokens={sampling.max_new_tokens} reads "
                f"{need} kv entries in its last step; the cache's paged view holds "
                f"max_kv={cfg.max_kv}: build the cache with a larger max_kv")
        n = sampling.n
        with self._queue_lock:
            req = Request(self._ids, ids, sampling, on_token, draft, draft_k if draft is not None else 0,
                          outputs=[[] for _ in range(n)], arrived=self.clock(),
                          finish_reasons=[None] * n, token_times=[[] for _ in range(n)])
            job = Job(req)
            self._jobs[id(req)] = job
            seq = Scheduler.new_seq(job, 0, list(ids))
            self._ids += 1
            self.requests.append(req)
            self._incoming.append(seq)
        if self._state_lock.acquire(blocking=False):   # between steps: queue it now
            try:
                self._drain()
            finally:
                self._state_lock.release()
        return req

    def cancel(self, request: Request) -> bool:
        """Ends ``request`` (a client disconnecting): its cells are freed, its continuations
        leave the queues, every unfinished one ends with ``"cancelled"`` and no callback of
        it runs again. Returns False, changing nothing, when the request is already done.

        Between steps and from this generator's ``on_token``/``draft`` callbacks it takes
        effect at once. From another thread while a step runs it is recorded (True is
        returned) and applied when that step completes, before any further token of the
        request is delivered; ``request.done`` turns True then.
        """
        job = self._jobs.get(id(request)) if isinstance(request, Request) else None
        if job is None or job.req is not request:
            shown = f"request {request.id}" if isinstance(request, Request) else type(request).__name__
            raise InvalidArgument(f"{shown} is not a Request of this Generator")
        if request.done:
            return False
        if self._stepping == threading.get_ident():
            if self._phase in ("draft", "deliver"):
                self._drain()
                self.scheduler.end(job, "cancelled")
                return True
        elif self._state_lock.acquire(blocking=False):
            try:
                self._drain()
                self.scheduler.end(job, "cancelled")
            finally:
                self._state_lock.release()
            return True
        with self._queue_lock:
            self._cancels.append(job)
        return True

    @property
    def busy(self) -> bool:
        """Whether a request is waiting or running."""
        return bool(self.waiting or self.running or self._incoming)

    def _drain(self) -> None:
        """Queues requests added, and applies cancels made, while a step ran (state lock held)."""
        with self._queue_lock:
            incoming, self._incoming = self._incoming, []
            cancels, self._cancels = self._cancels, []
        self.scheduler.waiting.extend(incoming)
        for job in cancels:
            if not job.req.done:
                self.scheduler.end(job, "cancelled")

    def _fail(self, job: Job, exc: BaseException, index: int | None,
              errors: list[BaseException]) -> None:
        """The request's own code raised exc (for continuation ``index``): it ends with
        "error" (exc kept in request.error)."""
        if job.req.error is None:
            job.req.error = exc
        errors.append(exc)
        self.scheduler.end(job, "error", index)

    # -- one step ---------------------------------------------------------------------------------
    def step(self) -> bool:
        """Runs one step; False when there is nothing to do.

        A step is a transaction: drafts are proposed, the rows chosen, the forward run and
        every token sampled before any state changes; then every sequence advances (rejected
        drafts rewound, forks cloned, finished sequences freed); only then do the
        ``on_token`` callbacks run. If the forward or the sampling raises (a torch error,
        KeyboardInterrupt), the step is rolled back (sequences rewound, this step's
        admissions requeued, their prefix-cache hits dropped and unpinned) and the exception
        propagates: step again to go on. The prefix cache stores prompts and outputs only
        once a step is applied; what it evicted while the step was planned stays evicted
        (eviction drops cached copies, never what a sequence holds). If a
        request's own code raises (its ``on_token`` or ``draft``, a draft that is not token
        ids, its sampling), that request ends with "error" and ``request.error``, the step
        completes for the others, and the first such exception is re-raised at its end.
        Ctrl-C while the generator's own bookkeeping runs (choosing the rows, applying the
        outcomes) is held back until the state is whole, then raised as KeyboardInterrupt
        (main thread, Python's default SIGINT handler). An exception from a prefix cache's
        ``on_event`` callback is raised the same way, once the step is complete.

        Raises InvalidState, changing nothing, when called from inside a callback of a step
        or while another thread is stepping this generator.
        """
        me = threading.get_ident()
        if not self._step_lock.acquire(blocking=False):
            if self._stepping == me:
                raise InvalidState("Generator.step() was called from inside a step (an on_token or "
                                   "draft callback); step again once the callback has returned")
            raise InvalidState("another thread is running Generator.step(): step a Generator from "
                               "one thread (add() and cancel() are safe from any thread)")
        try:
            with self._state_lock:
                self._stepping = me
                try:
                    return self._step()
                finally:
                    self._stepping = None
                    self._phase = None
        finally:
            self._step_lock.release()

    def _step(self) -> bool:
        errors: list[BaseException] = []
        self._drain()
        self._phase = "draft"
        self._propose(errors)
        self._phase = None
        with _HoldInterrupts() as held:
            plan = self._schedule()
        if held.hit:
            if plan is not None:
                self.scheduler.rollback(plan, False)
            raise KeyboardInterrupt
        events: list[tuple[Job, int, int]] = []
        interrupted = False
        if plan is not None:
            events, interrupted = self._execute(plan, errors)
        self._drain()                                 # cancels made by other threads meanwhile
        self._phase = "deliver"
        for job, k, tok in events:
            req = job.req
            if job.closed or req.on_token is None:
                continue
            try:
                req.on_token(req, k, tok)
            except BaseException as e:                # the request's own code
                self._fail(job, e, k, errors)
        self._phase = None
        self._drain()                                 # and while the callbacks ran
        if interrupted:                               # held back while the step was applied
            raise KeyboardInterrupt
        later = self.scheduler.later
        if later:                                     # a prefix-cache on_event callback raised
            errors += later
            later.clear()
        if errors:
            raise errors[0]
        return plan is not None or self.busy

    def _schedule(self) -> StepPlan | None:
        """The scheduler's plan for this step (declared), or None."""
        return self.scheduler.schedule()

    def _apply(self, outcomes: list[Outcome]) -> list[tuple[Job, int, int]]:
        """Advances every sequence by its outcome (no user code runs); returns the tokens
        to deliver, in order."""
        return self.scheduler.update_from_output(outcomes)

    def _sample(self, s: Seq, slot: int) -> int:
        """The token drawn for ``s`` at sampler slot ``slot`` of this step: a read of the
        step's host copy (the per-request point where its sampling may fail)."""
        assert self._drawn is not None
        return int(self._drawn.ids[slot])

    def _propose(self, errors: list[BaseException]) -> None:
        """Asks each decoding request's draft callable for proposals (user code)."""
        for s in list(self.running):
            s.drafts = []
            job = s.job
            r = job.req
            if job.closed or s.sid is None or r.draft is None or len(s.tokens) - s.in_cache != 1:
                continue
            if r.sampling.n > 1 and not job.forked:   # its first token forks: no verify row
                continue
            k = min(r.draft_k, r.sampling.max_new_tokens - len(r.outputs[s.index]) - 1)
            if k <= 0:
                continue
            try:
                proposed = r.draft(list(s.tokens), k)
                drafts = token_ids(proposed, f"the draft of request {r.id}", self.vocab, allow_empty=True)
            except BaseException as e:                # the request's own code
                self._fail(job, e, s.index, errors)
                continue
            if job.closed or s.sid is None:           # the callback cancelled its request
                continue
            s.drafts = drafts[:k]
            self.stats["drafted"] += len(s.drafts)

    def _execute(self, plan: StepPlan, errors: list[BaseException]
                 ) -> tuple[list[tuple[Job, int, int]], bool]:
        """Prepares, runs and samples the declared step, then applies it; rolls back and
        re-raises if anything but a request's own sampling fails first. Returns the tokens
        to deliver and whether an interrupt was held back while applying."""
        pad_to = None
        if plan.decode_only and self.runner.graphs_enabled:
            pad_to = self.runner.bucket(len(plan.tokens))
        decode = plan.decode_only and pad_to is not None
        prepared = committed = False
        try:
            step = self.cache.prepare_step(stream=self.stream, pad_to=pad_to)
            prepared = True
            logits = self.runner.forward(step, plan.tokens, plan.logit_rows, decode=decode)
            self.cache.commit_step()
            committed = True
            self._drawn = self.sampler(logits, plan.spec)     # the step's one host sync
            outcomes, failed = self.scheduler.decide(plan, self._drawn, self._sample)
        except BaseException:
            self.scheduler.rollback(plan, prepared and not committed)
            raise
        finally:
            self._drawn = None
        with _HoldInterrupts() as held:
            self.scheduler.count_step(plan, decode)
            for job, exc in failed:
                self._fail(job, exc, None, errors)
            events = self._apply(outcomes)
        return events, held.hit

    def run(self, progress: bool = False) -> list[Request]:
        """Steps until every request is done; returns the requests. An exception from
        :meth:`step` propagates (the generator stays consistent: call run() again to go on)."""
        with self._queue_lock:
            total = sum(r.sampling.n * r.sampling.max_new_tokens for r in self.requests)
        last = -1
        while self.step():
            if progress:
                pct = 100 * self.stats["tokens_out"] // max(1, total)
                if pct // 5 != last:
                    last = pct // 5
                    print(f"generate: {self.stats['tokens_out']} tokens out, step {self.stats['steps']}, "
                          f"{len(self.running)} running, {len(self.waiting)} waiting",
                          file=sys.stderr, flush=True)
        if self.runner.cuda:
            torch.cuda.synchronize(self.runner.device)
        return self.requests
