"""The Generator: requests in, tokens out, one step a call (the package docstring has the
whole picture). It ties the :class:`~cellcache.generate.scheduler.Scheduler` (every cache
verb), the :class:`cellcache.runner.ModelRunner` (the forward: graphs and input feeds) and the
:class:`~cellcache.generate.sampler.Sampler` (every draw of a step, one host copy) into a
transaction per step, and keeps the threading rules.

::

    step():  drain add/cancel hand-overs -> drafts (user code) -> schedule() [declared]
             -> prepare_step -> forward -> commit -> sample (one D2H) -> decide
             -> update_from_output [Ctrl-C held] -> on_token callbacks (user code)
    failure before update: rollback(plan) and re-raise; a request's own code: "error"

Asynchronous scheduling (``async_steps``, default on CUDA with graphs): a step (a lean
decode step, or a general one without drafts or forks) is left in flight, and the next
call overlaps the host with it::

    step() with step N in flight:
      schedule_decode(after=N)     nothing waits, N lean: N's sequences but those N ends by
                                   length; no ids
      or schedule_ahead(N)         prompt chunks or admissions: N's drawing sequences first
                                   (ids on the device), then chunks and admissions (host ids)
      prepare_step, forward(device_tokens = N's draws gathered on the device [, tokens]),
      commit, sampler.launch       -> step N+1 in flight (its D2H copy queued)
      land N: wait for N's one copy, apply (stops, streams, stats as the synchronous step)
      drop from N+1 the rows of sequences N ended (stop, error, cancel): freed with them
      on_token callbacks for N's tokens
    nothing plannable ahead (drafts, a fork, preemption, penalties on a row fed on the
    device, the host tier, a prompt N may complete that an admission shares): N lands
    alone, then the next step is planned synchronously in the same call. Failure launching
    N+1 or landing N: both roll back (N+1 first: the admissions requeue in order, a
    cancelled one stays ended), the exception propagates; stepping again recomputes them
    (same tokens: sampling is keyed, not stateful).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .._checks import check_int
from ..cache import CellCache
from ..errors import InvalidArgument, InvalidState
from ..hf import attach
from ..prefix import PrefixCache
from ..runner import check_options
from ..tp import TPCache
from .distributed import RankSync
from .logprobs import record_lean_logprobs, record_logprobs
from .options import check_kv8, serving, serving_cache, settings
from .prompts import check_text_options, check_tokenizer, encode_prompt, load_pretrained
from .requests import Progress, Request, Sampling, latency_summary, token_ids
from .sampler import Draw, Sampler
from .scheduler import (
    HoldInterrupts,
    Job,
    Scheduler,
    Seq,
    StepPlan,
    read_clock,
)
from .sleep import OffloadedWeights, offload_weights
from .spill import PrefixTier, Spiller

__all__ = ["Generator"]


#: The phases of :attr:`Generator.profile`: choosing the rows (hand-overs, drafts,
#: ``schedule()``), the cache's ``prepare_step``, the forward's launch (and ``commit_step``),
#: the sampler's launch, waiting for the step's one host copy (the device's time, not the
#: host's), deciding and applying the outcomes, the ``on_token`` callbacks and hand-overs.
PHASES = ("schedule", "prepare", "forward", "sample", "wait", "update", "callbacks")


@dataclasses.dataclass(eq=False)
class _Flight:
    """A launched step: its plan, its draws (ids on the device at once, on the host after
    their copy), whether it replays a graph, its host phases so far."""

    plan: StepPlan
    draw: Draw
    graph: bool
    prof: dict[str, float]
    rolled_back: bool = False


def _own_copy(tokenizer: Any) -> Any:
    """A deep copy of ``tokenizer`` (None for None; the tokenizer itself when it cannot be
    copied)."""
    if tokenizer is None:
        return None
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # noqa: BLE001 - an object that cannot be copied is shared (under the lock)
        return tokenizer


class Generator:
    """Continuous batching of a transformers decoder over a cellcache (package docstring).

    ``cache`` defaults to one built for the model (:func:`cellcache.hf.cache_config`; CUDA
    with the paged view when the model is on a GPU, the host backend otherwise) with
    ``capacity`` cells and ``max_batch_tokens`` rows a step: the token budget of a step
    (decode rows, drafts, prompt chunks together). It defaults to 8192 on a GPU and 512 on
    the CPU; with a ``cache`` given it is the cache's ``max_write``. ``prefill_chunk``
    bounds the prompt tokens one sequence reads per step (default 2048 on a GPU, 256 on the
    CPU, at most the budget). ``eos``: end-of-sequence ids (default: the model's generation
    config; given lazily, at most :data:`~.requests.MAX_STOPS`). ``clock``: what times
    requests (default ``time.perf_counter``).

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
    ``max_seqs`` option, default ``max_seqs``), and admits at most ``max_seqs`` sequences to
    run at once (a request's ``n`` continuations, forked when its prompt ends, may pass it
    by ``n - 1``); with a cache given, the budget defaults to half the ids not live and
    running sequences are bounded by the cache's ids alone. ``admission``: ``"fifo"``
    (default) or ``"lpm"`` (the waiting sequence with the longest cached prefix first, ties
    in arrival order; preempted ones stay first; FIFO without a prefix cache). Call
    ``gen.prefix.clear()`` only while nothing runs (pins of running requests go with it).

    ``tp`` (tensor parallelism, :mod:`cellcache.generate.distributed` has the picture):
    under an initialized ``torch.distributed`` process group, ``tp=True`` (or the world
    size) shards the model with its own TP plan (:func:`cellcache.tp.shard_model`, unless
    its weights are DTensors already), builds the cache through :func:`cellcache.tp.build`
    (``cache``: None, or a :class:`cellcache.tp.TPCache`) and attaches to the rank's shard.
    Every rank builds the Generator the same way and calls :meth:`step` / :meth:`run` in
    lockstep (``gen.run()`` on every rank); requests are added and cancelled on rank 0 only
    and join every rank at the next step boundary; every rank samples its own (identical)
    logits, the draws' checksums compared at each step boundary (asynchronous steps work
    as in one process); ``on_token`` runs on rank 0 only; every rank's requests end with
    the same outputs.
    ``gen.tp`` (``rank``, ``world``) is None in one process.

    ``kv_dtype`` (default None: the model's dtype): the K/V storage of the cache the
    Generator builds, ``"float8_e4m3fn"`` (or ``"fp8"``) for 8-bit K/V with per-(layer, kv
    head) scales set at each layer's first write (:attr:`cellcache.CacheConfig.kv_dtype`;
    half the memory a cell takes, so twice the cells in a capacity's bytes); with a
    ``cache`` given it must be None or the cache's own.
    ``spill_prefixes`` (default False; needs ``spill_bytes`` and the prefix cache): prefixes
    the prefix cache evicts are copied into the same host budget first, and an admission
    whose prompt starts with a longer one than the prefix cache holds gets it back instead
    of reading it (:class:`cellcache.generate.spill.PrefixTier`: an L2; stats
    ``"l2_found"``).
    ``spill_bytes`` (default 0: off): host memory (pinned on CUDA) that keeps a preempted
    sequence's K/V (:mod:`cellcache.generate.spill`): it is copied back when the sequence is
    admitted again instead of recomputed (``stats["spilled"]``, ``stats["restored_tokens"]``);
    a sequence past the budget is read again. Not under tensor parallelism.

    ``stats``: ``steps``, ``tokens_in`` (every row fed), ``tokens_out``, ``preempted``,
    ``forks``, ``drafted`` (draft tokens fed to verify runs: proposals the step had no room
    for are not counted), ``accepted`` (those of them kept), ``graph_steps``, and for
    prompts ``prompt_tokens`` (each request's prompt, counted at its first admission),
    ``cached_tokens`` (tokens an admission found in the prefix cache) and
    ``computed_tokens`` (tokens fed as prompt
    chunks, recomputes after preemption included), ``restored_tokens`` (positions the host
    tier placed instead: preempted sequences', prefixes the prefix cache evicted) and
    ``l2_found`` (admissions served by the prefix cache's host level): when every prompt is
    read once (no preemption, no fork waiting for an id) ``prompt_tokens == cached_tokens +
    restored_tokens + computed_tokens``. :meth:`latency` summarizes time to first token and inter-token
    latency.

    ``async_steps`` (default: on when the model runs on CUDA with graphs; False keeps every
    step synchronous): a step is left in flight on the device while the next one is
    planned, prepared and launched, its decode rows fed the sampled ids on the device (a
    mixed step's prompt chunks and admissions from the host); its tokens are applied, and
    its ``on_token`` callbacks run, in the next :meth:`step` call, so outputs lag the device
    by one step and :meth:`step` returns True while a step is in flight. Outputs, finish
    reasons and streams are the synchronous generator's, token for token, and so are
    ``stats`` for the same calls (verify runs with drafts and steps whose first token forks
    run synchronously), but where a step planned ahead cannot know what the step in flight
    ends: a row ending on a stop token there still takes a token of the budget and a cell,
    and no sequence ending there has freed its cells yet, so with the budget or the cells
    short an admission may come a step later. A request cancelled while a step carrying it
    is in flight loses that step's token, as a cancel during a synchronous step does
    (``stats["tokens_in"]`` then counts that step's row, which the synchronous generator
    never fed). ``profile``: host time per phase (:data:`PHASES`),
    summed in ms, for every step and by kind (decode/mixed), and the steps of each kind
    launched ahead.

    ``graphs``, ``buckets``, ``mixed_buckets`` (the CUDA graphs: decode buckets in rows,
    mixed steps padded to token buckets, ``[]`` for none), ``attention`` (``"auto"`` or
    ``"flashinfer"``) and ``compile`` (False, True or ``torch.compile`` keywords) are the
    runner's (``gen.runner``, :class:`cellcache.runner.ModelRunner`), which decides how each
    step runs and owns the graphs and the input feeds; :meth:`warmup` captures the graphs
    before serving.

    ``tokenizer`` (a transformers tokenizer, or None): prompts may then be text or chat
    messages (:meth:`encode`), requests stream text (``add(..., on_text=...)``, stop
    strings) and read ``Request.texts``; :meth:`from_pretrained` loads a model with its
    tokenizer. ``deterministic`` (default False): passed on to :func:`cellcache.hf.attach`
    when True (batch-invariant forwards); the sampler's per-row work never depends on the
    other rows. ``native`` (default False): the runner runs cellcache's own forward of a
    Llama, Mistral, Qwen2, Qwen3, Gemma or Gemma 3 model (:mod:`cellcache.native`: fused q/k/v and gate/up
    GEMMs, one launch for each norm, rotary embedding and SiLU) over the model's weights,
    which it re-lays as views (:func:`cellcache.hf.attach`'s ``native``); not under
    tensor parallelism. ``on_logits``: see the property.

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
                 admission: str = "fifo", clock: Callable[[], float] | None = None,
                 tp: bool | int | None = None, async_steps: bool | None = None,
                 compile: bool | Mapping[str, Any] = False, mixed_buckets: list[int] | None = None,
                 attention: str = "auto", deterministic: bool = False, tokenizer: Any = None,
                 spill_bytes: int = 0, spill_prefixes: bool = False, kv_dtype: str | None = None,
                 native: bool = False):
        check_options(compile, attention)    # refused before anything is built or switched
        check_tokenizer(tokenizer)
        if not isinstance(deterministic, (bool, np.bool_)):
            raise InvalidArgument(f"deterministic of type {type(deterministic).__name__} is not a bool")
        if not isinstance(native, (bool, np.bool_)):
            raise InvalidArgument(f"native of type {type(native).__name__} is not a bool")
        spill_bytes = check_int(spill_bytes, "spill_bytes", 0)
        if not isinstance(spill_prefixes, (bool, np.bool_)):
            raise InvalidArgument(f"spill_prefixes of type {type(spill_prefixes).__name__} is not a bool")
        if spill_prefixes and not spill_bytes:
            raise InvalidArgument("spill_prefixes=True keeps evicted prefixes in the host tier: give "
                                  "it spill_bytes")
        if spill_prefixes and prefix_cache is False:
            raise InvalidArgument("spill_prefixes=True needs the prefix cache (prefix_cache=False given)")
        max_batch_tokens, prefill_chunk, reserve, eos_ids = settings(
            model, capacity, max_batch_tokens, prefill_chunk, reserve, clock, eos, async_steps)
        checked = serving(tp, cache, admission, prefix_cache, max_seqs)
        check_kv8(kv_dtype, checked, bool(deterministic))
        if spill_bytes and checked.world is not None:
            raise InvalidArgument("spill_bytes does not serve under tensor parallelism (each rank would "
                                  "spill its own shard); leave it 0")
        if native and checked.world is not None:
            raise InvalidArgument("native=True does not serve under tensor parallelism (its forward "
                                  "has no all-reduces): leave it False with tp")
        if deterministic and checked.world is not None:    # (before the model is sharded in place)
            raise InvalidArgument("deterministic=True does not serve under tensor parallelism: the "
                                  "ranks' all-reduces sum in an order that depends on the step's size")
        model, cache, given = serving_cache(model, capacity, max_batch_tokens, checked, kv_dtype)
        self.model, self.cache = model, cache
        #: Runs the forwards: graphs, input feeds, warm-up (:class:`cellcache.runner.ModelRunner`).
        #: Whether every row's forward and sampling are computed as they would be alone
        #: (batch-invariant kernels, :func:`cellcache.hf.attach`'s ``deterministic``); the
        #: sampler's per-row work never depends on the other rows of a step either way.
        self.deterministic = bool(deterministic)
        # the keyword goes to attach only when asked for (an attach without it knows no such mode)
        extra: dict[str, Any] = {"deterministic": True} if self.deterministic else {}
        if native:
            extra["native"] = True
        self.runner = attach(model, cache.local if isinstance(cache, TPCache) else cache,
                             graphs=graphs, buckets=buckets, compile=compile,
                             mixed_buckets=mixed_buckets, attention=attention, **extra)
        self.clock: Callable[[], float] = clock or time.perf_counter
        self.vocab: int = self.runner.vocab
        #: What text prompts are encoded with and outputs decoded with (None: ids only).
        self.tokenizer: Any = tokenizer
        # prompts are encoded with a copy of it, one call at a time: add() runs on any
        # thread, and a Hugging Face fast tokenizer's encode may change its state (padding,
        # truncation), which a decode on the stepping thread must not meet
        self._encoder: Any = _own_copy(tokenizer)
        self._encode_lock = threading.Lock()
        #: What iterating requests wait on between steps (notified after each step).
        self.progress = Progress()
        self.max_batch = cache.config.max_write
        self.prefill_chunk = prefill_chunk
        #: Every cache verb of serving: queues, admission, preemption, the prefix cache.
        self.scheduler = Scheduler(cache, given, max_batch=self.max_batch, prefill_chunk=prefill_chunk,
                                   reserve=reserve, eos=set(eos_ids), admission=admission,
                                   clock=self.clock,
                                   max_running=checked.max_seqs if checked.cache is None else None)
        if spill_bytes:                       # preempted sequences' K/V kept on the host
            self.scheduler.kv.spiller = Spiller(cache, self.runner.view, spill_bytes, self.runner.stream)
            if spill_prefixes and self.prefix is not None:   # and the prefixes evicted
                self.scheduler.kv.l2 = PrefixTier(self.scheduler.kv.spiller)
                self.prefix.before_evict = self.scheduler.kv.l2.store
        #: Draws every token of a step on the model's device (one host copy a step).
        self.sampler = Sampler(self.runner.device)
        # the requests not finished yet, by id, in the order added (a finished one is let
        # go at the end of the step or cancel that finished it: nothing here keeps it),
        # every request added that someone still holds (weakly: which requests are this
        # generator's), and the lists of the run() calls going on
        self._live: dict[int, Job] = {}
        self._added: weakref.WeakValueDictionary[int, Request] = weakref.WeakValueDictionary()
        self._collectors: list[list[Request]] = []
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
        #: The stream the steps run on (the runner's; None on the host).
        self.stream = self.runner.stream
        self.sampler.stream = self.stream             # (looked up once, not every step)
        #: The ranks' lockstep under tensor parallelism (``tp.rank``, ``tp.world``), or None.
        self.tp: RankSync | None = RankSync(self, cache) if isinstance(cache, TPCache) else None
        # -- asynchronous scheduling and the host profile (async_steps checked by settings) --
        #: Whether a lean decode step is left in flight and the next one launched on its ids
        #: (on the device) before they reach the host (default: on CUDA with graphs).
        self.async_steps = bool(self.runner.cuda and self.runner.graphs_enabled) \
            if async_steps is None else bool(async_steps)
        self._flight: _Flight | None = None       # the step on the device, not applied yet
        self._undelivered: list[tuple[Job, int, int]] = []   # applied tokens awaiting on_token
        self._landed: _Flight | None = None       # the step applied by this call, to book
        self._prof: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._on_logits: Callable | None = None
        #: Host time by phase (:data:`PHASES`), in ms summed over the steps applied, for all
        #: steps, decode-only ones and mixed ones, and the step counts (``*_ahead_steps``:
        #: those planned and launched while the step before was in flight, ``async_steps``).
        self.profile: dict[str, Any] = {
            "steps": 0, "decode_steps": 0, "mixed_steps": 0, "decode_ahead_steps": 0,
            "mixed_ahead_steps": 0,
            "host_ms": dict.fromkeys(PHASES, 0.0), "decode_host_ms": dict.fromkeys(PHASES, 0.0),
            "mixed_host_ms": dict.fromkeys(PHASES, 0.0)}
        #: None, or a list (a ``deque(maxlen=...)`` for a long run) the caller sets: each
        #: applied step is appended as ``(kind, rows, {phase: seconds})``, kind ``"decode"``
        #: or ``"mixed"``: where a mean of :attr:`profile` comes from, step by step.
        self.step_log: Any = None
        self._sleep_level = 0                     # 0 awake; 1 or 2: sleep()'s level
        self._offloaded: OffloadedWeights | None = None

    @classmethod
    def from_pretrained(cls, path: Any, *, tokenizer: Any = None, dtype: Any = "auto",
                        device: Any = None, **kwargs: Any) -> Generator:
        """A Generator over the model (``AutoModelForCausalLM``) and tokenizer
        (``AutoTokenizer``, unless ``tokenizer`` is given: a tokenizer, or a path to load one
        from) of a local Hugging Face directory, or a hub name the local Hugging Face cache
        already holds (nothing is downloaded). ``dtype``: a torch dtype, its name, or
        ``"auto"`` (the checkpoint's); ``device``: default ``"cuda"`` when torch sees a GPU,
        else ``"cpu"``. Other keywords go to :class:`Generator`. InvalidArgument when the
        model or tokenizer cannot be loaded. A directory without tokenizer files (a
        checkpoint saved alone) gives a Generator without a tokenizer: token ids only.

        Example
        -------
        >>> gen = Generator.from_pretrained("/models/llama", capacity=1 << 16)   # doctest: +SKIP
        >>> gen.add("Once upon a time", Sampling(max_new_tokens=16)).result().text  # doctest: +SKIP
        """
        model, tok = load_pretrained(path, tokenizer, dtype, device)
        return cls(model, tokenizer=tok, **kwargs)

    @property
    def on_logits(self) -> Callable | None:
        """None (default), or a callable run on the stepping thread after each forward, before
        the step's sampling, as ``on_logits(rows, logits)``.

        ``logits`` is the float32 ``[len(rows), vocab]`` tensor the sampler draws from, on
        the model's device (valid during the call only: the callee copies what it keeps).
        ``rows[i] = (request, k, context)``: logits row i is continuation k of ``request``'s
        next-token logits after ``context``, which is either the tuple of token ids the row
        saw (the prompt, the outputs so far, and for a verify run the drafts fed up to that
        row; for a prompt chunk, the prompt up to that row), or, for a row whose last token
        is still on the device (a step launched ahead of the previous one's ids,
        ``async_steps``), the int ``p``: the row's context is then
        ``(request.prompt + request.outputs[k])[:p]`` once that token has landed (read it
        after the next step; a continuation cancelled meanwhile may never get it). Rows
        come in the order of the step's logits: a request's row may appear several times
        (drafts, prompt rows whose log-probabilities are asked for), continuations forked
        from one prompt share its row (listed once, as continuation 0).

        An exception it raises is the step's failure (rolled back, propagated), as the
        forward's would be. When None the step tests this attribute once and does nothing
        else. Setting anything but a callable or None raises InvalidArgument (unchanged).
        """
        return self._on_logits

    @on_logits.setter
    def on_logits(self, fn: Callable | None) -> None:
        if fn is not None and not callable(fn):
            raise InvalidArgument(f"on_logits of type {type(fn).__name__} is not callable or None")
        self._on_logits = fn

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
        self.scheduler.flush()                # (nothing to do: stored rows read through the store)
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
    def in_flight(self) -> bool:
        """Whether a step was left in flight on the device (``async_steps``): it is applied,
        and its callbacks run, at the next :meth:`step` call."""
        return self._flight is not None

    @property
    def requests(self) -> list[Request]:
        """The requests queued or running (not finished), in the order added. A finished
        request is the caller's alone: the generator keeps nothing of it (what :meth:`add`
        and :meth:`run` returned is how to reach it)."""
        with self._queue_lock:
            return [job.req for job in self._live.values()]

    def latency(self, requests: Sequence[Request]) -> dict[str, float | int | None]:
        """TTFT and inter-token latency p50/p99/mean in ms over ``requests`` (say, what
        :meth:`run` returned): :func:`cellcache.generate.requests.latency_summary`."""
        return latency_summary(requests)

    def _track(self, req: Request, job: Job) -> None:
        """Holds ``req`` (``job``) until it finishes (queue lock held)."""
        self._added[req.id] = req
        self._live[req.id] = job
        for collected in self._collectors:
            collected.append(req)

    def mirror(self, rid: int, prompt: list[int], sampling: Sampling) -> Seq:
        """Tensor parallelism, ranks other than 0: the request rank 0 added as ``rid``
        (checked there), held as :meth:`add` holds one; returns its first continuation, for
        the hand-over to queue. InvalidState when ``rid`` is not this generator's next id
        (the ranks' generators differ)."""
        n = sampling.n
        with self._queue_lock:
            if rid != self._ids:
                raise InvalidState(f"this rank's next request is {self._ids} and rank 0 sent request "
                                   f"{rid}: the ranks' generators differ (build them the same way)")
            req = Request(rid, list(prompt), sampling, None, None, 0,
                          outputs=[[] for _ in range(n)], arrived=self.scheduler.now(),
                          finish_reasons=[None] * n, token_times=[[] for _ in range(n)])
            job = Job(req)
            self._ids += 1
            self._track(req, job)
        return Scheduler.new_seq(job, 0, list(prompt))

    def _release(self) -> None:
        """Lets the requests that finished go (state lock held): their texts closed (the
        last ``on_text`` of each continuation not closed yet), then marked done (waking
        :meth:`Request.result` and the iterators). An exception from that ``on_text`` is
        kept in ``request.error`` (the request is finished already)."""
        ended = self.scheduler.ended_jobs
        if ended:
            with self._queue_lock:
                for job in ended:
                    self._live.pop(job.req.id, None)
            for job in ended:
                req = job.req
                if req.streams_text:
                    try:
                        self._close_texts(job, all_ended=True)
                    except BaseException as e:     # its own code, once it is finished
                        if req.error is None:
                            req.error = e
                req.mark_done()
            ended.clear()
        self.progress.notify()

    def _close_texts(self, job: Job, all_ended: bool = False) -> None:
        """Closes the text of job's continuations that ended (``all_ended``: every one,
        else those whose tokens were all delivered), each with its last ``on_text``."""
        req = job.req
        for k in req.texts_to_close(all_ended):
            delta = req.close_text(k)
            # (a request whose own code failed gets no more calls: its on_text may be what failed)
            if delta is not None and req.on_text is not None and req.error is None:
                req.on_text(req, k, delta)

    # -- requests --------------------------------------------------------------------------------
    def add(self, prompt: Any, sampling: Sampling | None = None, *,
            on_token: Callable | None = None, draft: Callable | None = None,
            draft_k: int = 4, on_text: Callable | None = None) -> Request:
        """Queues a prompt; returns its Request.

        ``prompt``: token ids in ``[0, vocab)`` as a sequence of ints, a 1-D integer array or
        tensor, or a ``[1, T]`` one (a tokenizer's ``return_tensors`` output); or, with a
        tokenizer, a ``str`` or a list of chat messages (:meth:`encode`).
        ``on_token(request, continuation, token)`` is called for every token once its step
        is complete. ``draft(tokens, k)`` proposes up to ``k`` (``draft_k``, an int >= 0)
        next tokens for speculative decoding; what it returns must be token ids in the
        vocabulary, or the request ends with ``"error"``.

        ``on_text(request, continuation, delta)`` (needs a tokenizer) is called on the
        stepping thread (the last call of a request cancelled between steps: on the thread
        that cancels it, during :meth:`cancel`) with the continuation's newly final text,
        after ``on_token`` for the token that released it: never half a UTF-8 character,
        never text that may still begin a stop string, never a stop string itself. When the
        continuation ends, one last call (``delta`` maybe "") hands over what was held back, its
        ``request.finish_reasons[k]`` already set; the deltas concatenate to
        ``request.texts[k]``. A stop string (``Sampling.stop_strings``) found in the text
        ends the continuation with ``"stop"`` there. An exception from ``on_text`` ends the
        request with ``"error"``, as one from ``on_token`` does.

        Everything is checked first; a refusal raises InvalidArgument with nothing queued.
        A request that could never fit is refused: a continuation holds its prompt and every
        output token but the last, ``len(prompt) + max_new_tokens - 1`` cells (its prompt
        alone with ``max_new_tokens`` 0; and as many paged-view entries, ``max_kv``).
        """
        ids = self.encode(prompt)
        if sampling is None:
            sampling = Sampling()
        elif not isinstance(sampling, Sampling):
            raise InvalidArgument(f"sampling of type {type(sampling).__name__} is not a Sampling")
        else:
            sampling = dataclasses.replace(sampling)    # checked again (fields may have changed)
        for name, fn in (("on_token", on_token), ("draft", draft), ("on_text", on_text)):
            if fn is not None and not callable(fn):
                raise InvalidArgument(f"{name} of type {type(fn).__name__} is not callable or None")
        check_text_options(self.tokenizer, sampling, on_text, self.vocab, self.tp is not None)
        if sampling.min_new_tokens and len(set(sampling.stop) | (set() if sampling.ignore_eos else {
                t for t in self.eos if t < self.vocab})) >= self.vocab:
            raise InvalidArgument(f"min_new_tokens={sampling.min_new_tokens} with every id of the "
                                  f"vocabulary ({self.vocab}) a stop or end-of-sequence id: no token "
                                  "could be drawn before min_new_tokens")
        if self.tp is not None:                        # rank 0 only, no drafts; guarded callback
            on_token = self.tp.adding(on_token, draft)
        draft_k = check_int(draft_k, "draft_k", 0, 1 << 20)
        need = sampling.cells_needed(len(ids))          # (the rule admission claims by)
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
        arrived = read_clock(self.clock)               # (user code: raises with nothing queued)
        with self._queue_lock:
            req = Request(self._ids, ids, sampling, on_token, draft, draft_k if draft is not None else 0,
                          outputs=[[] for _ in range(n)], arrived=arrived,
                          finish_reasons=[None] * n, token_times=[[] for _ in range(n)],
                          on_text=on_text, tokenizer=self.tokenizer, progress=self.progress)
            job = Job(req)
            seq = Scheduler.new_seq(job, 0, list(ids))
            self._ids += 1
            self._track(req, job)
            self._incoming.append(seq)
        if self._state_lock.acquire(blocking=False):   # between steps: queue it now
            try:
                self._drain()
            finally:
                self._state_lock.release()
        return req

    def encode(self, prompt: Any) -> list[int]:
        """``prompt`` as the token ids :meth:`add` would queue: token ids as they are
        (checked), a ``str`` through the tokenizer (``tokenizer.encode``: special tokens as
        it adds them by default), a list of chat messages (``{"role": ..., "content": ...}``
        mappings) through ``tokenizer.apply_chat_template(messages,
        add_generation_prompt=True)``. InvalidArgument for text without a tokenizer,
        messages with a tokenizer that has no chat template, a tokenizer that fails, and ids
        outside the model's vocabulary."""
        # (ids but a list or tuple, an iterator or a range(10**18), are refused past the
        # cache's capacity before they are read whole: no longer prompt can run)
        limit = self.cache.config.capacity
        if self._encoder is None or not isinstance(prompt, (str, list, tuple)):
            return encode_prompt(self._encoder, prompt, self.vocab, limit)
        with self._encode_lock:
            return encode_prompt(self._encoder, prompt, self.vocab, limit)

    def cancel(self, request: Request) -> bool:
        """Ends ``request`` (a client disconnecting): its cells are freed, its continuations
        leave the queues, every unfinished one ends with ``"cancelled"`` and no callback of
        it runs again. Returns False, changing nothing, when the request is already done.

        Between steps and from this generator's ``on_token``/``draft`` callbacks it takes
        effect at once. From another thread while a step runs it is recorded (True is
        returned) and applied when that step completes, before any further token of the
        request is delivered; ``request.done`` turns True then.
        """
        if not isinstance(request, Request) or self._added.get(request.id) is not request:
            shown = f"request {request.id}" if isinstance(request, Request) else type(request).__name__
            raise InvalidArgument(f"{shown} is not a Request of this Generator")
        with self._queue_lock:
            job = self._live.get(request.id)
        if job is None:                                # finished, and let go
            job = Job(request)
        if self.tp is not None:                        # rank 0 queues it for the next boundary
            return self.tp.cancel(job)
        if request.done:
            return False
        if self._stepping == threading.get_ident():
            if self._phase in ("draft", "deliver"):
                self._drain()
                self.scheduler.end(job, "cancelled")   # (let go when the step ends)
                return True
        elif self._state_lock.acquire(blocking=False):
            try:
                self._drain()
                self.scheduler.end(job, "cancelled")
                self._release()
            finally:
                self._state_lock.release()
            self.scheduler.raise_interrupt()           # a Ctrl-C in on_event while freeing
            return True
        with self._queue_lock:
            self._cancels.append(job)
        return True

    @property
    def busy(self) -> bool:
        """Whether a request is waiting or running, or a step is in flight."""
        # (the scheduler's list, not the property)
        return bool(self.waiting or self.scheduler.running or (self._incoming and self.tp is None)
                    or self._flight is not None)

    def warmup(self, widths: Sequence[int] | None = None,
               mixed: Sequence[int] | None = None) -> dict[str, list[int]]:
        """Captures the CUDA graphs now, as a serving engine does at start-up, instead of at
        each bucket's first use in the middle of a run: :meth:`ModelRunner.warmup
        <cellcache.runner.ModelRunner.warmup>` (one real step of fresh sequences per bucket,
        freed again; the cache ends as it was but for pools that grew). ``widths``: decode
        buckets of ``runner.buckets`` (default: every bucket a decode step of this generator
        can reach, up to the one holding ``min(max_seqs, max_batch_tokens)`` rows);
        ``mixed``: token buckets of ``runner.mixed_buckets`` (default: all; ``[]``: none).
        Returns the buckets captured now, ``{"decode": [...], "mixed": [...]}`` (both empty
        when the runner replays no graphs: CPU, ``graphs=False``). Under tensor parallelism
        every rank calls it (the verbs are agreed like a step's).

        InvalidArgument for a width that is not a bucket; InvalidState while requests are
        queued or running, a step is in flight, from inside a step, or while the cache has
        a step declared or prepared by another user (nothing changed); OutOfMemory (that
        bucket not captured, its sequences freed) when the cache cannot hold the step
        (StepTooLarge when a prompt-chunk bucket exceeds the paged view's ``max_kv``).
        """
        todo = self.runner.warmup_buckets(widths, mixed, min(self.cache.max_seqs, self.max_batch))
        if not self._step_lock.acquire(blocking=False):
            raise InvalidState("warmup() while a step runs (from a callback or another thread): "
                               "call it before serving")
        try:
            with self._state_lock:
                # (under TP only rank 0 has add()'s queue: it is not in what every rank sees)
                if self.busy or (self._incoming and self.tp is None):
                    raise InvalidState("warmup() while requests are queued or running: call it "
                                       "before adding requests, or once run() has returned")
                return self.runner.warmup(self.cache, todo)
        finally:
            self._step_lock.release()

    # -- sleep and wake (cellcache.generate.sleep has the picture) -------------------------------
    @property
    def asleep(self) -> int:
        """0 when awake, else the level of the :meth:`sleep` in effect."""
        return self._sleep_level

    @contextlib.contextmanager
    def held_idle(self, what: str) -> Iterator[None]:
        """Holds the generator between steps for ``what`` (another module's verb on its
        state: ``save_prefix``, ``load_prefix``), as :meth:`sleep` holds it: InvalidState
        from inside a step (one of its callbacks), while another thread steps it, or while
        requests are waiting or running; no step starts until the block ends."""
        if not self._step_lock.acquire(blocking=False):
            raise InvalidState(f"{what} runs while the generator is idle: a step is running (this is "
                               "one of its callbacks, or another thread steps it)")
        try:
            with self._state_lock:
                if self.busy:
                    raise InvalidState(f"{what} runs while the generator is idle: requests are waiting "
                                       "or running")
                yield
        finally:
            self._step_lock.release()

    def _idle(self, what: str) -> None:
        """Refuses (InvalidState) ``what`` while requests are queued, running or in flight."""
        if self.busy or self._incoming:
            raise InvalidState(f"{what} while requests are queued or running: call it once run() "
                               "has returned (or cancel them)")

    def sleep(self, level: int = 1, keep_prefixes: bool = False) -> None:
        """Gives back this generator's GPU memory between uses, keeping everything it built.

        Level 1: the prefix cache is emptied, the cache's pools lose their memory and keep
        their addresses (:meth:`CellCache.sleep`), and PyTorch's cached free blocks go back
        to the driver; the model stays on the device. The prefix cache's K/V is dropped with
        its host level's (weights changed while asleep must not meet it), unless
        ``keep_prefixes``: then every unpinned cached prefix is evicted into the host level
        (``spill_prefixes=True``; as its budget allows, the latest evicted kept), and
        admissions after :meth:`wake` take them back as any kept prefix; call
        :meth:`reset_prefix_cache` if the weights change meanwhile. Level 2 also moves the
        model's parameters and buffers to pinned host memory (the Parameter objects stay)
        and drops the runner's graphs. :meth:`wake` undoes it. Requests may be added while
        asleep; :meth:`step` and :meth:`run` raise InvalidState until :meth:`wake`.

        InvalidArgument for a level other than 1 or 2 (2 under tensor parallelism, whose
        weights are sharded tensors), or ``keep_prefixes`` not a bool or without the host
        level; InvalidState while requests are queued or running, from inside a step, or
        asleep at another level; the cache's InvalidState when another user of it holds
        cells; OutOfMemory when the host cannot hold the weights (level 2). A refusal after
        the checks leaves the prefix cache emptied (its prefixes in the host level with
        ``keep_prefixes``) and nothing else changed. Sleeping again at the same level changes
        nothing but drop the kept prefixes unless ``keep_prefixes`` is given again.
        """
        if (not isinstance(level, (int, np.integer)) or isinstance(level, (bool, np.bool_))
                or level not in (1, 2)):
            raise InvalidArgument(f"sleep level {level!r} is not 1 (the K/V) or 2 (the K/V and "
                                  "the weights)")
        if not isinstance(keep_prefixes, (bool, np.bool_)):
            raise InvalidArgument(f"keep_prefixes of type {type(keep_prefixes).__name__} is not a bool")
        if keep_prefixes and self.scheduler.kv.l2 is None:
            raise InvalidArgument("sleep(keep_prefixes=True) moves the prefix cache to its host level: "
                                  "build the Generator with spill_bytes and spill_prefixes=True")
        if level == 2 and self.tp is not None:
            raise InvalidArgument("sleep(2) does not move sharded weights (tensor parallelism); "
                                  "use sleep(1)")
        if not self._step_lock.acquire(blocking=False):
            raise InvalidState("sleep() while a step runs (from a callback or another thread)")
        try:
            with self._state_lock:
                if self._sleep_level:
                    if self._sleep_level != level:
                        raise InvalidState(f"asleep at level {self._sleep_level}; wake() before "
                                           f"sleeping at level {level}")
                    if not keep_prefixes and self.scheduler.kv.l2 is not None:
                        self.scheduler.kv.l2.clear()  # (kept by an earlier keep_prefixes sleep)
                    return
                self._idle("sleep()")
                local = self.cache.local if isinstance(self.cache, TPCache) else self.cache
                if self.prefix is not None:
                    if keep_prefixes:                # every prefix through the host level's
                        self.prefix.evict(local.config.capacity)       # eviction hook
                    self.prefix.clear()              # (else its K/V is not kept: emptied first)
                if self.scheduler.kv.l2 is not None and not keep_prefixes:
                    self.scheduler.kv.l2.clear()     # nor its host level's
                local.sleep()                        # refused: nothing else has changed
                                                     # (it waits for the copies queued first)
                if level == 2:
                    try:
                        # the runner's model: the native forward's too (its fused weights)
                        self._offloaded = offload_weights(self.runner.model)
                    except BaseException:
                        local.wake()
                        raise
                    self.runner.drop_graphs()
                self._sleep_level = int(level)
                if self.runner.cuda:
                    torch.cuda.empty_cache()
        finally:
            self._step_lock.release()

    def wake(self) -> None:
        """Takes the memory :meth:`sleep` gave back: the weights return to the device (level
        2; the graphs are captured again at first use) and the pools get fresh memory at
        their addresses (level 1's graphs replay as captured). OutOfMemory leaves the
        generator asleep as it was; the call can be retried. Awake: does nothing."""
        if not self._step_lock.acquire(blocking=False):
            raise InvalidState("wake() while a step runs (from a callback or another thread)")
        try:
            with self._state_lock:
                if not self._sleep_level:
                    return
                local = self.cache.local if isinstance(self.cache, TPCache) else self.cache
                local.wake()                         # refused: nothing has changed
                if self._offloaded is not None:
                    try:
                        self._offloaded.restore()    # (a failure leaves them on the host)
                    except BaseException:
                        local.sleep()                # (no cell is owned: it cannot refuse)
                        raise
                self._offloaded = None
                self._sleep_level = 0
        finally:
            self._step_lock.release()

    def reset_prefix_cache(self) -> int:
        """Empties the prefix cache (the model's weights changed: its K/V no longer matches
        them); returns the cells freed (0 without a prefix cache). InvalidState while
        requests are queued or running, or from inside a step; nothing changes then."""
        if not self._step_lock.acquire(blocking=False):
            raise InvalidState("reset_prefix_cache() while a step runs (from a callback or "
                               "another thread)")
        try:
            with self._state_lock:
                self._idle("reset_prefix_cache()")
                if self.scheduler.kv.l2 is not None:
                    self.scheduler.kv.l2.clear()
                return self.prefix.clear() if self.prefix is not None else 0
        finally:
            self._step_lock.release()

    def _drain(self, boundary: bool = False) -> None:
        """Queues requests added, and applies cancels made, while a step ran (state lock held).
        Under tensor parallelism only at a step's start and end (``boundary``), agreed."""
        if self.tp is not None:                        # rank 0's hand-overs, agreed (distributed.py)
            if boundary:
                with self._queue_lock:
                    incoming, self._incoming = self._incoming, []
                self.tp.handover(incoming)
            return
        if not (self._incoming or self._cancels):   # (one appended meanwhile waits a drain)
            return
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

        With ``async_steps`` a decode step may be left in flight: this call then applies the
        previous one (and runs its callbacks) after launching the next; a failure launching
        the next step or landing the previous one rolls both back (every sequence back to
        its applied tokens) and propagates.

        Raises InvalidState, changing nothing, when called from inside a callback of a step,
        while another thread is stepping this generator, or while another user of its cache
        has a step declared or prepared there (the generator's own declaration would drop it;
        the generator itself holds none between calls).
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
                if self._sleep_level:
                    raise InvalidState(f"the generator is asleep (level {self._sleep_level}); "
                                       "call wake() before stepping")
                local = self.runner.cache
                if local.prepared_step is not None or local.table.declared_width:
                    raise InvalidState("another user of the generator's cache has a step declared or "
                                       "prepared: run or undeclare it before stepping the generator")
                self._stepping = me
                try:
                    return self._step()
                finally:
                    self._stepping = None
                    self._phase = None
                    self._release()
        finally:
            self._step_lock.release()

    def _step(self) -> bool:
        errors: list[BaseException] = []
        self._prof = dict.fromkeys(PHASES, 0.0)
        self._landed = None
        t = time.perf_counter()
        self._drain(boundary=True)
        flight = self._flight
        events: list[tuple[Job, int, int]] = []
        interrupted = False
        plan: StepPlan | None = None
        if flight is not None:                        # asynchronous: a step is on the device
            events, interrupted = self._step_ahead(flight, errors, t)
            if self._flight is None and not interrupted:
                # it landed alone (the next step could not be planned ahead of it): the next
                # one is planned now, so that every call launches a step while there is one
                if self._landed is not None and self._landed.plan.rows:
                    self._book(self._landed)
                self._landed = None
                self._prof = dict.fromkeys(PHASES, 0.0)
                t = time.perf_counter()
                flight = None
        if flight is None:
            self._phase = "draft"
            self._propose(errors)
            self._phase = None
            with HoldInterrupts() as held:
                plan = self.scheduler.schedule()
            if held.hit:
                if plan is not None:
                    self.scheduler.rollback(plan, False)
                raise KeyboardInterrupt
            if plan is not None:
                flight = self._launch(plan, scheduled=t)
                if self.async_steps and plan.flies:   # left in flight: applied next step
                    self._flight = flight
                else:
                    events, interrupted = self._land(flight, errors)
        t = time.perf_counter()
        self._drain()                                 # cancels made by other threads meanwhile
        self._phase = "deliver"
        # every applied token not delivered yet (this step's, and any an interrupt kept from
        # an earlier step's delivery), in order
        events, self._undelivered = self._undelivered, []
        for job, k, tok in events:
            req = job.req
            if job.closed or not req.hooked or req.text_stopped(k):
                continue                              # (a stop string: dropped after it)
            try:
                if req.on_token is not None:
                    req.on_token(req, k, tok)
                if req.streams_text and not job.closed:
                    self._text(job, k, tok)
            except BaseException as e:                # the request's own code
                self._fail(job, e, k, errors)
        ended = self.scheduler.ended_streams
        if ended:                                     # texts of continuations that ended
            jobs = list(dict.fromkeys(ended))         # (without a last token delivered now:
            ended.clear()                             # capacity, a cancel, a stop string)
            for job in jobs:
                try:
                    self._close_texts(job)
                except BaseException as e:            # the request's own code
                    self._fail(job, e, None, errors)
        self._phase = None
        self._drain(boundary=True)                    # and while the callbacks ran
        self._tick("callbacks", t)
        if self._landed is not None and self._landed.plan.rows:
            self._book(self._landed)
            self._landed = None
        if interrupted:                               # held back while the step was applied
            raise KeyboardInterrupt
        later = self.scheduler.later
        if later:                                     # a prefix-cache on_event callback raised
            errors += later
            later.clear()
        if errors:              # a Ctrl-C (or SystemExit) first: another error must not hide it
            raise next((e for e in errors if not isinstance(e, Exception)), errors[0])
        if plan is not None or self._flight is not None or self.busy:
            return True
        self.scheduler.sync()                         # done: the lists whole, the requests let go
        return False

    def _text(self, job: Job, k: int, tok: int) -> None:
        """Continuation k's token ``tok`` into its text: ``on_text`` with what it releases;
        a stop string found ends the continuation (``"stop"``) at once."""
        req = job.req
        delta, stopped = req.push_text(k, tok)
        if stopped:
            self.scheduler.end_one(job, k, "stop")
            req.drop_after_stop(k)                    # (tokens a verify run applied after it)
        last = req.close_text(k) if req.text_closes(k) else None   # its last token: one call
        if last is not None:
            delta += last
        if (delta or last is not None) and req.on_text is not None:
            req.on_text(req, k, delta)

    def _propose(self, errors: list[BaseException]) -> None:
        """Asks each decoding request's draft callable for proposals (user code)."""
        for s in list(self.running):
            job = s.job
            r = job.req
            if r.draft is None:                       # the common case: nothing to reset or ask
                if s.drafts:
                    s.drafts = []
                continue
            s.drafts = []
            if job.closed or s.sid is None or s.to_feed != 1:
                continue
            if s.forks_next():                        # its first token forks: no verify row
                continue
            k = min(r.draft_k, s.draws_left() - 1)
            if k <= 0:
                continue
            try:
                proposed = r.draft(list(s.tokens), k)
                if isinstance(proposed, Iterator):      # (it may never end: k are used)
                    proposed = list(itertools.islice(proposed, k))
                # (a sized one past the cache's capacity, a range(10**18), is refused unread)
                drafts = token_ids(proposed, f"the draft of request {r.id}", self.vocab, allow_empty=True,
                                   limit=self.cache.config.capacity)
            except BaseException as e:                # the request's own code
                self._fail(job, e, s.index, errors)
                continue
            if job.closed or s.sid is None:           # the callback cancelled its request
                continue
            s.drafts = drafts[:k]

    def _tick(self, phase: str, t: float) -> float:
        """Adds the time since ``t`` to ``phase`` of this step's profile; returns now."""
        now = time.perf_counter()
        self._prof[phase] += now - t
        return now

    def _book(self, flight: _Flight) -> None:
        """Adds a landed step's phases to :attr:`profile`."""
        p = self.profile
        kind = "decode" if flight.plan.decode_only else "mixed"
        if self.step_log is not None:
            self.step_log.append((kind, len(flight.plan.rows), dict(flight.prof)))
        p["steps"] += 1
        p[f"{kind}_steps"] += 1
        p[f"{kind}_ahead_steps"] += flight.plan.ahead
        for totals in (p["host_ms"], p[f"{kind}_host_ms"]):
            for k, v in flight.prof.items():
                totals[k] += 1e3 * v

    def _step_ahead(self, flight: _Flight, errors: list[BaseException], t: float
                    ) -> tuple[list[tuple[Job, int, int]], bool]:
        """Asynchronous scheduling, with ``flight`` on the device: the next step is
        scheduled, prepared and launched on ``flight``'s sampled ids (on the device) when it
        can be planned ahead (:meth:`~.base.BaseScheduler.schedule_decode` with ``after``,
        or :meth:`~.base.BaseScheduler.schedule_ahead`); then ``flight`` lands (its one host
        copy, outcomes applied, ended sequences' rows dropped from the next step)."""
        sched = self.scheduler
        nxt: _Flight | None = None
        after = flight.plan
        if after.flies:
            with HoldInterrupts() as held:
                if after.lean and not self.waiting:   # (running: among the flight's rows)
                    plan = sched.schedule_decode(after=after)
                else:                                 # prompt chunks, admissions
                    plan = sched.schedule_ahead(after)
            if held.hit or plan is None:
                if plan is not None:
                    sched.rollback(plan, False)
                if held.hit:
                    self._flight = None
                    sched.rollback(flight.plan, False)
                    raise KeyboardInterrupt
            else:
                self._prof = dict.fromkeys(PHASES, 0.0)   # the next step's phases from here
                try:
                    nxt = self._launch(plan, flight, scheduled=t)
                except BaseException:                 # the step in flight goes back too
                    self._flight = None
                    sched.rollback(flight.plan, False)
                    raise
        self._flight = nxt
        try:
            events, interrupted = self._land(flight, errors, nxt)
        except BaseException:                         # `flight` was rolled back or applied
            self._flight = None
            if nxt is not None and not nxt.rolled_back:
                sched.rollback(nxt.plan, False)
            raise
        if nxt is not None:
            sched.drop_ended(nxt.plan)                # sequences that ended in `flight`
        return events, interrupted

    def _launch(self, plan: StepPlan, after: _Flight | None = None, *,
                scheduled: float | None = None) -> _Flight:
        """Prepares, runs and samples the declared step without waiting for its ids;
        rolls the step back and re-raises if anything fails (a Ctrl-C at its first line
        too: the declared step must not outlive the call). ``after``: the step in flight
        whose ids (on the device) this one feeds; ``scheduled``: when its scheduling began
        (the profile's ``schedule`` phase ends here)."""
        prof = self._prof
        runner = self.runner
        try:
            t = time.perf_counter() if scheduled is None else self._tick("schedule", scheduled)
            if plan.lean:                             # every row one token, every row sampled
                width = logit_rows = len(plan.rows)
            else:
                width, logit_rows = len(plan.tokens), len(plan.logit_rows)
            pad_to, decode = runner.padding(plan.decode_only, len(plan.rows), width, logit_rows)
            step = self.cache.prepare_step(stream=runner.stream_handle, pad_to=pad_to)
            t = self._tick("prepare", t)
            rows = None if plan.lean else plan.logit_rows   # lean: every real row, in order
            # a greedy step's draws are the graph's argmax: no float32 logits to write (the tap
            # read once: another thread may set it while this one steps)
            tap = self._on_logits
            want = tap is not None or plan.spec.reads_logits(logit_rows)
            if after is None:
                logits = self.runner.forward(step, plan.tokens, rows, decode=decode, logits=want)
            elif not plan.lean:                   # its first rows fed on the device, then the host's
                n = len(plan.fed_slots)
                fed = None
                if n:                             # (a step that draws nothing has no ids)
                    ids = after.draw.device_ids
                    assert ids is not None
                    fed = self.runner.gather(ids, np.asarray(plan.fed_slots, np.int64))
                logits = self.runner.forward(step, plan.tokens[n:], rows, decode=decode, device_tokens=fed,
                                             logits=want)
            else:
                fed = self._fed(plan, after)
                if plan.spec.extras:              # penalties count the fed tokens on the device
                    plan.spec.fed = fed
                logits = self.runner.forward(step, None, rows, decode=decode, device_tokens=fed, logits=want)
            self.cache.commit_step()
            t = self._tick("forward", t)
            if tap is not None:
                tap(plan.logit_contexts(), logits)
            greedy = runner.greedy            # the graph's own argmax of each row, or None
            if greedy is None:
                draw = self.sampler.launch(logits, plan.spec)
            else:
                draw = self.sampler.launch(logits, plan.spec, greedy)
            self._tick("sample", t)
        except BaseException:
            # a step prepared and not committed yet, asked of the cache (no one else prepares
            # while the generator steps): an interrupt may come between a call and a flag
            self.scheduler.rollback(plan, self.cache.prepared_step is not None)
            raise
        return _Flight(plan, draw, runner.replayed, prof)

    def _fed(self, plan: StepPlan, after: _Flight) -> torch.Tensor:
        """The ids ``plan`` (scheduled ahead) feeds: ``after``'s draws of its sequences,
        gathered on the device."""
        ids = after.draw.device_ids
        assert ids is not None
        n = len(plan.seqs)
        if n == len(after.plan.spec):                 # every row drawn goes on (slot i: row i)
            return ids if ids.shape[0] == n else ids[:n]
        # rows left out: those reaching max_new_tokens, and rows dropped from `after` itself
        # once its own predecessor landed (its slots keep their numbers)
        if plan.prefix_fed:                           # (the scheduler knows them: the last)
            return ids[:n]
        where = {id(s): slot for s, _, slot, _ in after.plan.owners}
        slots = np.fromiter((where[id(s)] for s in plan.seqs), np.int64, n)
        return self.runner.gather(ids, slots)

    def _land(self, flight: _Flight, errors: list[BaseException], nxt: _Flight | None = None
              ) -> tuple[list[tuple[Job, int, int]], bool]:
        """Waits for ``flight``'s ids, decides and applies its outcomes; a failure before
        they are applied rolls back ``nxt`` (launched after it) and then ``flight`` (so
        that their admissions go back to the queue in order), and re-raises; a failure after
        leaves ``nxt`` to the caller. Returns the tokens to deliver and whether an interrupt
        was held back while applying."""
        plan = flight.plan
        sched = self.scheduler
        try:                                          # from the first statement: rolled back
            self._prof = flight.prof
            t = time.perf_counter()
            drawn = flight.draw.result()              # the step's one host sync
            if self.tp is not None:                   # every rank folds its draws in, in order
                self.tp.landed(drawn)
            t = self._tick("wait", t)
            if not plan.lean:
                outcomes, failed = sched.decide(plan, drawn)
        except BaseException:
            if nxt is not None:
                nxt.rolled_back = True
                sched.rollback(nxt.plan, False)
            sched.rollback(plan, False)
            raise
        with HoldInterrupts() as held:
            if plan.rows:                             # (an ahead step whose rows all ended: not one)
                sched.count_step(plan, flight.graph)
            if plan.lean:
                if drawn.logprobs is not None:
                    record_lean_logprobs(plan, drawn)
                events = sched.apply_decode(plan, drawn.ids, deliver=False)
            else:
                for job, exc in failed:
                    self._fail(job, exc, None, errors)
                if drawn.logprobs is not None:
                    record_logprobs(plan, drawn, outcomes)
                events = sched.update_from_output(outcomes)
            self._undelivered += events               # delivered by this step, or the next
        self._tick("update", t)
        self._landed = flight
        return events, held.hit

    def run(self, progress: bool = False) -> list[Request]:
        """Steps until every request is done; returns the requests it served: those not
        finished when it was called and those added while it ran, in the order added. An
        exception from :meth:`step` propagates (the generator stays consistent: call run()
        again to go on)."""
        with self._queue_lock:
            collected = [job.req for job in self._live.values()]
            self._collectors.append(collected)
        try:
            total = sum(r.sampling.n * r.sampling.max_new_tokens for r in collected)
            out0 = self.stats["tokens_out"]
            last = -1
            while self.step():
                if progress:
                    done = self.stats["tokens_out"] - out0
                    pct = 100 * done // max(1, total)
                    if pct // 5 != last:
                        last = pct // 5
                        print(f"generate: {done} tokens out, step {self.stats['steps']}, "
                              f"{len(self.scheduler.running)} running, {len(self.waiting)} waiting",
                              file=sys.stderr, flush=True)
            self.runner.synchronize()
        finally:
            with self._queue_lock:
                self._collectors = [c for c in self._collectors if c is not collected]
        return collected
