"""Continuous batching for a Hugging Face decoder on the cache, and ``cellcache generate``.

:class:`Generator` keeps requests arriving at any time; every step carries each running
sequence's next token and chunks of prompts still being read, in one forward. Around it:

- sampling: greedy, or seeded temperature / top-k / top-p per request; stop tokens and a
  token budget; every continuation ends with a reason (``Request.finish_reasons``:
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
- on CUDA, decode steps replay a CUDA graph of their padded width (:class:`cellcache.hf.ModelRunner`).

>>> gen = Generator(model, capacity=1 << 16)                                   # doctest: +SKIP
>>> req = gen.add([1, 2, 3], Sampling(max_new_tokens=16))                      # doctest: +SKIP
>>> gen.run(); req.outputs[0], req.finish_reasons                              # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import operator
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ._checks import check_int
from ._cli import Parser, in_range
from .cache import CellCache
from .errors import CellCacheError, InvalidArgument, InvalidState, StepTooLarge
from .hf import attach, cache_config, vocab_size
from .prefix import PrefixCache
from .registry import build

__all__ = ["ADMISSION_POLICIES", "FINISH_REASONS", "Generator", "Request", "Sampling", "main"]

#: Why a continuation ended: a stop or end-of-sequence token, its ``max_new_tokens``, the
#: cache could not hold it even alone, :meth:`Generator.cancel`, its request's own code
#: (a callback, a draft, its sampling) raised.
FINISH_REASONS = ("stop", "length", "capacity", "cancelled", "error")

#: Which waiting sequence admission considers first: ``"fifo"`` (arrival order) or
#: ``"lpm"`` (longest cached prefix first, SGLang's policy; preempted sequences still first).
ADMISSION_POLICIES = ("fifo", "lpm")
_PREFIX_OPTIONS = ("policy", "max_seqs", "on_event")
_I32 = np.dtype(np.int32)

_SEED_MOD = 1 << 63
_NOT_IDS = (str, bytes, bytearray, memoryview, Mapping)


def _real(value: object, name: str) -> float:
    """``value`` as a finite float; InvalidArgument for bools, non-numbers, NaN and inf."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"{name} of type {type(value).__name__} is not a number")
    v = float(value)
    if not math.isfinite(v):
        raise InvalidArgument(f"{name}={v} is not a finite number")
    return v


def _token_ids(value: object, what: str, vocab: int | None, *, allow_empty: bool = False) -> list[int]:
    """Token ids given as a sequence of ints, a 1-D integer array or tensor, or a ``[1, T]``
    one (what a tokenizer returns with ``return_tensors``), as a list of ints in
    ``[0, vocab)``; InvalidArgument for anything else."""
    shape_hint = "give a list of ints, or a 1-D or [1, T] integer array or tensor"
    if isinstance(value, (torch.Tensor, np.ndarray)):
        shape = tuple(value.shape)
        if isinstance(value, torch.Tensor):
            integer = not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
        else:
            integer = value.dtype.kind in "iu"
        if not integer:
            raise InvalidArgument(f"{what} has dtype {value.dtype}; token ids are integers")
        if len(shape) == 2 and shape[0] == 1:
            value = value[0]
        elif len(shape) != 1:
            raise InvalidArgument(f"{what} has shape {list(shape)}; {shape_hint}")
        items: list = value.tolist()
    elif isinstance(value, _NOT_IDS) or not isinstance(value, Iterable) or isinstance(value, Set):
        raise InvalidArgument(f"{what} of type {type(value).__name__} is not a sequence of token ids; "
                              f"{shape_hint}")
    else:
        items = list(value)
    ids = []
    for t in items:
        try:
            if isinstance(t, (bool, np.bool_)):
                raise TypeError
            ids.append(operator.index(t))
        except TypeError:
            raise InvalidArgument(f"{what} holds {t!r} of type {type(t).__name__}; token ids are "
                                  "ints") from None
    if not ids and not allow_empty:
        raise InvalidArgument(f"{what} is empty; give at least one token id")
    if ids and (min(ids) < 0 or (vocab is not None and max(ids) >= vocab)):
        bad = next(t for t in ids if t < 0 or (vocab is not None and t >= vocab))
        bound = f"[0, {vocab})" if vocab is not None else ">= 0"
        raise InvalidArgument(f"{what} holds token id {bad}, outside the model's vocabulary {bound}")
    return ids


@dataclass
class Sampling:
    """How a request samples. ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 keep
    every token; ``seed`` makes sampling repeatable; ``stop`` ends a continuation (the stop
    token is kept); ``n`` continuations share the prompt.

    Every field is checked on construction (and again by :meth:`Generator.add`):
    ``max_new_tokens`` an int >= 1, ``n`` an int in [1, 65536], ``top_k`` an int >= 0,
    ``seed`` None or an int in [0, 2**63), ``temperature`` a finite number >= 0, ``top_p``
    a finite number in (0, 1], ``stop`` a sequence of ints (kept as a tuple). Bools and
    floats are not ints. A bad field raises InvalidArgument.

    Example
    -------
    >>> Sampling(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=1, stop=[2]).stop
    (2,)
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[int] = ()
    n: int = 1

    def __post_init__(self):
        self.max_new_tokens = check_int(self.max_new_tokens, "max_new_tokens", 1, 1 << 40)
        self.n = check_int(self.n, "n", 1, 1 << 16)
        self.top_k = check_int(self.top_k, "top_k", 0, 1 << 40)
        if self.seed is not None:
            self.seed = check_int(self.seed, "seed", 0, _SEED_MOD - 1)
        self.temperature = _real(self.temperature, "temperature")
        if self.temperature < 0:
            raise InvalidArgument(f"temperature={self.temperature} is negative; give 0 (greedy) or more")
        self.top_p = _real(self.top_p, "top_p")
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p={self.top_p} is outside (0, 1]")
        stop = self.stop
        if getattr(stop, "ndim", 1) == 0 or isinstance(stop, _NOT_IDS) or not isinstance(stop, Iterable):
            raise InvalidArgument(f"stop of type {type(stop).__name__} is not a sequence of token "
                                  "ids; give a list of ints, e.g. stop=[2]")
        self.stop = tuple(_token_ids(list(stop) if isinstance(stop, Set) else stop, "stop", None,
                                     allow_empty=True))


@dataclass(eq=False)
class _Seq:
    req: Request
    index: int                       # which continuation of its request
    tokens: list[int]                # prompt + output so far
    sid: int | None = None           # cache id while running
    in_cache: int = 0                # tokens[:in_cache] are in the cache
    drafts: list[int] = field(default_factory=list)
    rng: torch.Generator | None = None
    stamp: int = -1                  # admission order: the highest is preempted first
    # prefix cache: pins this sequence holds ((tokens, n) for unpin), whether its prompt was
    # stored since it was admitted, its prompt's bytes while it is being read (the pending
    # prompts), and tokens as int32 (rebuilt when tokens grew)
    pins: list[tuple[np.ndarray, int]] = field(default_factory=list)
    stored: bool = False
    pending: bytes | None = None
    arr: np.ndarray | None = None


@dataclass
class Request:
    """A prompt being served: ``outputs[k]`` is continuation k's tokens so far.

    ``finish_reasons[k]`` is None while continuation k runs, then one of
    :data:`FINISH_REASONS`; the request is ``done`` when every continuation has one.
    ``error`` holds the exception that ended it with ``"error"`` (its ``on_token`` or
    ``draft`` raised, a draft was not token ids, its sampling failed). ``arrived``,
    ``first_token`` and ``finished`` are ``time.perf_counter()`` times: when :meth:`Generator.add`
    queued it, when the step that sampled its first token was applied (time to first token:
    ``first_token - arrived``), when its last continuation ended.
    """

    id: int
    prompt: list[int]
    sampling: Sampling
    on_token: Callable | None = None
    draft: Callable | None = None
    draft_k: int = 0
    outputs: list[list[int]] = field(default_factory=list)
    arrived: float = 0.0
    finished: float | None = None
    finish_reasons: list[str | None] = field(default_factory=list)
    error: BaseException | None = None
    first_token: float | None = None
    _owner: Any = field(default=None, init=False, repr=False, compare=False)
    _closed: bool = field(default=False, init=False, repr=False, compare=False)  # cancelled/failed
    _forked: bool = field(default=False, init=False, repr=False, compare=False)  # 1.. were made
    _counted: bool = field(default=False, init=False, repr=False, compare=False)  # prompt_tokens

    @property
    def done(self) -> bool:
        return self.finished is not None


@dataclass(eq=False)
class _Outcome:
    """What a step does to one planned sequence, decided before anything is applied."""

    seq: _Seq
    feed: list[int]
    keep: int                         # the sequence's in_cache after the step
    tokens: list[int] = field(default_factory=list)           # emitted, in order
    accepted: int = 0
    forks: list[tuple[_Seq, int]] = field(default_factory=list)  # new continuations, first token


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


@dataclass(eq=False)
class _Plan:
    rows: list[tuple[_Seq, list[int]]]     # (sequence, tokens it feeds), in the step's order
    admitted: list[_Seq]                   # sequences given a cache id for this step
    decode_only: bool                      # every row one sequence's next token, nothing else
    cached: int = 0                        # tokens the admissions found in the prefix cache


class _Prompts:
    """Prompts being read (admitted, not yet stored in the prefix cache), as a radix tree of
    int32 token bytes with a count per node: :meth:`lcp` is the longest common prefix of a
    query with any of them. Admission defers a prompt that shares more with one being read
    than with the prefix cache: it is admitted once that one is stored, and reads only what
    it does not share (so a shared prefix is computed once, even by requests that arrive
    together)."""

    __slots__ = ("root", "size")

    def __init__(self) -> None:
        self.root: list = [b"", {}, 0]       # [segment bytes, children by first 4 bytes, count]
        self.size = 0

    @staticmethod
    def _common(seg: bytes, qb: bytes, b: int) -> int:
        """Bytes (a multiple of 4) that seg shares with qb from offset b."""
        if qb.startswith(seg, b):
            return len(seg)
        m = min(len(seg), len(qb) - b) // 4
        eq = np.frombuffer(seg, _I32, m) == np.frombuffer(qb, _I32, m, b)
        return 4 * (m if eq.all() else int(eq.argmin()))

    def add(self, qb: bytes) -> None:
        node = self.root
        node[2] += 1
        self.size += 1
        b = 0
        while b < len(qb):
            key = qb[b:b + 4]
            child = node[1].get(key)
            if child is None:
                node[1][key] = [qb[b:], {}, 1]
                return
            k = self._common(child[0], qb, b)
            if k < len(child[0]):                     # split the child at k
                seg = child[0]
                upper = [seg[:k], {seg[k:k + 4]: child}, child[2]]
                child[0] = seg[k:]
                node[1][key] = upper
                child = upper
            child[2] += 1
            node = child
            b += k

    def remove(self, qb: bytes) -> None:
        node = self.root
        node[2] -= 1
        self.size -= 1
        b = 0
        while b < len(qb):
            key = qb[b:b + 4]
            child = node[1][key]
            child[2] -= 1
            if child[2] == 0:
                del node[1][key]
                return
            node = child
            b += len(child[0])

    def lcp(self, qb: bytes) -> int:
        node, b = self.root, 0
        while b < len(qb):
            child = node[1].get(qb[b:b + 4])
            if child is None:
                break
            k = self._common(child[0], qb, b)
            b += k
            if k < len(child[0]):
                break
            node = child
        return b // 4


class Generator:
    """Continuous batching of a transformers decoder over a cellcache (module docstring).

    ``cache`` defaults to one built for the model (:func:`cellcache.hf.cache_config`; CUDA
    with the paged view when the model is on a GPU, the host backend otherwise) with
    ``capacity`` cells and ``max_batch_tokens`` rows a step. ``prefill_chunk`` bounds the
    prompt tokens one sequence reads per step. ``eos``: end-of-sequence ids (default: the
    model's generation config).

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
    computed_tokens``.

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
                 max_batch_tokens: int = 512, max_seqs: int = 256, prefill_chunk: int = 256,
                 graphs: bool | None = None, buckets: list[int] | None = None,
                 eos: Sequence[int] | None = None, reserve: float = 1.0,
                 prefix_cache: bool | PrefixCache | Mapping[str, Any] = True,
                 admission: str = "fifo"):
        prefill_chunk = check_int(prefill_chunk, "prefill_chunk", 1)
        reserve = _real(reserve, "reserve")
        if not 0 <= reserve <= 1:
            raise InvalidArgument(f"reserve={reserve} is outside [0, 1]")
        if eos is None:
            eos_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
            eos = [eos_id] if isinstance(eos_id, int) else list(eos_id or [])
        eos_ids = _token_ids(eos, "eos", None, allow_empty=True)
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
        #: The prefix cache (None when off).
        self.prefix: PrefixCache | None = given
        self.admission = admission
        self._pending = _Prompts()
        self._later: list[BaseException] = []      # prefix-cache callback errors, raised at step end
        self.vocab: int = self.runner.vocab
        self.max_batch = cache.config.max_write
        self.prefill_chunk = prefill_chunk
        self.reserve = reserve
        self.eos = set(eos_ids)
        self.requests: list[Request] = []
        self.waiting: list[_Seq] = []          # no cache id yet (new, or preempted)
        self.running: list[_Seq] = []
        self.stats = {"steps": 0, "tokens_in": 0, "tokens_out": 0, "preempted": 0,
                      "forks": 0, "drafted": 0, "accepted": 0, "graph_steps": 0,
                      "prompt_tokens": 0, "cached_tokens": 0, "computed_tokens": 0}
        self._ids = 0
        self._stamps = 0
        # _step_lock: held by the stepping thread (others are refused); _state_lock: held
        # while the queues and the cache change (a step, or add/cancel between steps);
        # _queue_lock: the hand-over lists add() and cancel() fill during a step.
        self._step_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._queue_lock = threading.Lock()
        self._incoming: list[_Seq] = []
        self._cancels: list[Request] = []
        self._stepping: int | None = None      # the stepping thread's id
        self._phase: str | None = None         # "draft" / "deliver": callbacks are running
        self.stream = torch.cuda.current_stream(self.runner.device) if self.runner.cuda else None

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
        ids = _token_ids(prompt, "prompt", self.vocab)
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
                          outputs=[[] for _ in range(n)], arrived=time.perf_counter(),
                          finish_reasons=[None] * n)
            req._owner = self
            seq = self._seq(req, 0, list(ids))
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
        if not isinstance(request, Request) or request._owner is not self:
            shown = f"request {request.id}" if isinstance(request, Request) else type(request).__name__
            raise InvalidArgument(f"{shown} is not a Request of this Generator")
        if request.done:
            return False
        if self._stepping == threading.get_ident():
            if self._phase in ("draft", "deliver"):
                self._drain()
                self._end(request, "cancelled")
                return True
        elif self._state_lock.acquire(blocking=False):
            try:
                self._drain()
                self._end(request, "cancelled")
            finally:
                self._state_lock.release()
            return True
        with self._queue_lock:
            self._cancels.append(request)
        return True

    def _seq(self, req: Request, index: int, tokens: list[int]) -> _Seq:
        rng = None
        if req.sampling.temperature > 0:
            rng = torch.Generator(device="cpu")
            base = req.sampling.seed if req.sampling.seed is not None else req.id
            rng.manual_seed((base * 1009 + index) % _SEED_MOD)
        return _Seq(req, index, tokens, rng=rng)

    @property
    def busy(self) -> bool:
        """Whether a request is waiting or running."""
        return bool(self.waiting or self.running or self._incoming)

    def _drain(self) -> None:
        """Queues requests added, and applies cancels made, while a step ran (state lock held)."""
        with self._queue_lock:
            incoming, self._incoming = self._incoming, []
            cancels, self._cancels = self._cancels, []
        self.waiting.extend(incoming)
        for req in cancels:
            if not req.done:
                self._end(req, "cancelled")

    # -- ending sequences and requests --------------------------------------------------------------
    def _free(self, s: _Seq, store: bool = False) -> None:
        """Gives back s's cache id and cells; s is then a sequence to be read from scratch.
        ``store``: s ends, its tokens in the cache go to the prefix cache first."""
        if s.pending is not None:
            self._pending.remove(s.pending)
            s.pending = None
        pc = self.prefix
        if pc is not None:
            if store and s.sid is not None and s.in_cache > 0:
                self._pcall(0, pc.insert, s.sid, self._tokens(s)[:s.in_cache])
            for arr, n in s.pins:
                try:
                    pc.unpin(arr, n)
                except CellCacheError:                # the tree was cleared or forgotten meanwhile
                    pass
        s.pins, s.stored = [], False
        if s.sid is not None:
            self.cache.seq_rm(s.sid)
        s.sid, s.in_cache, s.drafts = None, 0, []

    # -- the prefix cache --------------------------------------------------------------------------
    def _pcall(self, default: Any, fn: Callable, *args: Any, **kw: Any) -> Any:
        """A prefix-cache operation that changes it. An exception (from a user's ``on_event``:
        the prefix cache is consistent when it propagates) is kept and raised when the step
        is complete; ``default`` stands for the lost result."""
        try:
            return fn(*args, **kw)
        except Exception as e:
            self._later.append(e)
            return default

    @staticmethod
    def _tokens(s: _Seq) -> np.ndarray:
        """s's tokens as int32 (tokens only grow: extended, not rebuilt)."""
        arr, n = s.arr, len(s.tokens)
        if arr is None or len(arr) != n:
            if arr is None or len(arr) > n:
                arr = np.array(s.tokens, dtype=_I32)
            else:
                arr = np.concatenate([arr, np.array(s.tokens[len(arr):], dtype=_I32)])
            s.arr = arr
        return arr

    def _evict(self, cells: int) -> int:
        """Asks the prefix cache for ``cells`` cells; returns those freed."""
        if self.prefix is None or cells <= 0:
            return 0
        before = self.cache.free_cells
        self._pcall(0, self.prefix.evict, cells)
        return self.cache.free_cells - before

    def _evict_for(self, arr: np.ndarray, hit: int, cells: int, partial: bool) -> int:
        """Evicts for a waiting sequence (tokens ``arr``) that would hit ``hit`` tokens,
        keeping those: ``cells`` cells, or (``partial`` False) nothing unless the prefix cache
        can give them all. Returns the cells freed."""
        pc = self.prefix
        if pc is None or cells <= 0:
            return 0
        held = pc.pin(arr, max_len=hit) if hit else 0
        try:
            if not partial and pc.evictable_tokens(cells) < cells:
                return 0
            return self._evict(cells)
        finally:
            if held:
                try:
                    pc.unpin(arr, held)
                except CellCacheError:                # the tree was forgotten meanwhile
                    pass

    def _obtain(self, w: _Seq, arr: np.ndarray, hit: int) -> tuple[int | None, int]:
        """A cache id for w: a clone holding its cached prefix (pinned) when ``hit``, else a
        new one; a prefix-cache leaf is evicted when no id is free. (None, 0) if none is had."""
        pc = self.prefix
        for attempt in range(2):
            if hit and pc is not None:
                sid, n = self._pcall((None, 0), pc.match, arr, max_len=len(arr) - 1, pin=True)
                if sid is not None:
                    if n:
                        w.pins.append((arr, n))
                    return sid, n
            sid = self.cache.seq_new()
            if sid is not None:
                return sid, 0
            if pc is None or attempt:
                break
            self._pcall(0, pc.evict, n_ids=1)
        return None, 0

    def _store_prompt(self, s: _Seq) -> None:
        """s's prompt has been placed: stored in the prefix cache, and pinned while s runs."""
        pc = self.prefix
        assert pc is not None and s.sid is not None
        p = self._tokens(s)[:len(s.req.prompt)]
        self._pcall(0, pc.insert, s.sid, p)
        n = pc.pin(p)
        if n:
            s.pins.append((p, n))
        s.stored = True
        if s.pending is not None:
            self._pending.remove(s.pending)
            s.pending = None

    def _finish_seq(self, s: _Seq, reason: str) -> None:
        """Ends continuation s (already out of the queues, or about to be) with reason."""
        self._free(s, store=True)
        req = s.req
        req.finish_reasons[s.index] = reason
        if s.index == 0 and not req._forked:          # its continuations never started
            for k in range(1, req.sampling.n):
                if req.finish_reasons[k] is None:
                    req.finish_reasons[k] = reason
        if req.finished is None and all(r is not None for r in req.finish_reasons):
            req.finished = time.perf_counter()

    def _end(self, req: Request, reason: str, index: int | None = None) -> None:
        """Ends every unfinished continuation of req (and continuation ``index``, finished or
        not) with reason; frees their cells; no callback of req runs again."""
        req._closed = True
        for queue in (self.running, self.waiting):
            mine = [s for s in queue if s.req is req]
            if mine:
                queue[:] = [s for s in queue if s.req is not req]
                for s in mine:
                    self._free(s, store=True)
        for k, r in enumerate(req.finish_reasons):
            if r is None or k == index:
                req.finish_reasons[k] = reason
        if req.finished is None:
            req.finished = time.perf_counter()

    def _fail(self, req: Request, exc: BaseException, index: int | None,
              errors: list[BaseException]) -> None:
        """req's own code raised exc (for continuation ``index``): req ends with "error"
        (exc kept in req.error)."""
        if req.error is None:
            req.error = exc
        errors.append(exc)
        self._end(req, "error", index)

    @staticmethod
    def _ends(req: Request, n_out: int, tok: int, eos: set[int]) -> str | None:
        """Why a continuation with n_out tokens, the last tok, ends (None: it goes on)."""
        if tok in eos or tok in req.sampling.stop:
            return "stop"
        if n_out >= req.sampling.max_new_tokens:
            return "length"
        return None

    # -- admission and preemption ---------------------------------------------------------------
    def _remaining(self, s: _Seq, have: int) -> int:
        """Cells continuation s still claims once ``have`` of its tokens are in the cache:
        up to len(prompt) + max_new_tokens - 1 in all, and its other continuations' own
        tokens while they are not forked yet."""
        sp = s.req.sampling
        more = max(0, len(s.req.prompt) + sp.max_new_tokens - 1 - have)
        if s.index == 0 and sp.n > 1 and not s.req._forked:
            more += (sp.n - 1) * (sp.max_new_tokens - 1)
        return more

    def _preempt(self) -> None:
        """Frees the most recently admitted running sequence and requeues it at the head of
        the queue; it is read again (prompt and output so far) when admitted."""
        v = max(self.running, key=lambda s: s.stamp)
        self.running.remove(v)
        self._free(v)
        self.waiting.insert(0, v)
        self.stats["preempted"] += 1

    def _schedule(self) -> _Plan | None:
        """Chooses and declares the step's rows; None when nothing is left to run.

        Where cells run short the prefix cache evicts first; then it preempts (most recent
        first) until every running sequence's next token has a cell; a sequence that cannot
        get one even alone, or a waiting one that cannot be admitted into an idle cache
        (every free cell or id held outside the generator), ends with "capacity". Each pass
        evicts, preempts or ends a sequence, or declares a step: it returns.
        """
        preempted = False
        while self.running or self.waiting:
            free = self.cache.free_cells
            decoding = [s for s in self.running if len(s.tokens) - s.in_cache == 1]
            need = min(len(decoding), self.max_batch) if decoding else int(bool(self.running))
            if need > free:
                free += self._evict(need - free)      # cached prefixes before running requests
            if need > free:
                if len(self.running) > 1:
                    self._preempt()
                    preempted = True                  # and nothing is admitted in this step
                else:
                    self._finish_seq(self.running.pop(), "capacity")
                continue
            plan = self._plan(free, decoding, admit=not preempted)
            if plan is None:
                self._finish_seq(self.waiting.pop(0), "capacity")
                continue
            width = sum(len(feed) for _, feed in plan.rows)
            try:
                ok = self.cache.declare_step([s.sid for s, feed in plan.rows for _ in feed])
            except StepTooLarge:
                ok = False
            if ok:
                return plan
            # the plan fits the free cells and max_kv; only cells taken behind the
            # generator's back (another user of the cache) get here
            self._unadmit(plan.admitted)
            if self._evict(width - self.cache.free_cells) > 0:
                continue
            if len(self.running) > 1:
                self._preempt()
                preempted = True
            elif self.running:
                self._finish_seq(self.running.pop(), "capacity")
            else:
                self._finish_seq(self.waiting.pop(0), "capacity")
        return None

    def _order_lpm(self) -> None:
        """Longest cached prefix first (stable: FIFO among equals); preempted sequences (read
        before) keep the head."""
        pc = self.prefix
        if pc is None or len(self.waiting) < 2:
            return

        def key(w: _Seq) -> tuple[int, int]:
            arr = self._tokens(w)
            return (int(w.stamp < 0), -pc.peek(arr, max_len=len(arr) - 1))

        self.waiting.sort(key=key)

    def _plan(self, free: int, decoding: list[_Seq], admit: bool) -> _Plan | None:
        """The step's rows within max_batch_tokens, the free cells and max_kv: one token for
        each decoding sequence, their drafts as far as room remains, prompt chunks of
        running sequences, then admissions (FIFO or ``lpm``; see the class docstring for
        ``reserve`` and the prefix cache). The prefix cache evicts for the running
        sequences' rows, and for an admission only when it can give all it lacks."""
        budget, cells = self.max_batch, free
        kv = self.cache.config.max_kv if self.cache.config.paged else 1 << 62
        pc = self.prefix
        if pc is not None and cells < budget:         # room for the running rows first
            want = len(decoding) + sum(min(len(s.tokens) - s.in_cache, self.prefill_chunk)
                                       for s in self.running if len(s.tokens) - s.in_cache > 1)
            got = self._evict(min(want, budget) - cells)
            cells, free = cells + got, free + got
        chosen: list[_Seq] = []
        for s in decoding:                            # 1. every running sequence's next token
            if budget == 0 or cells == 0:
                break
            if s.in_cache + 1 > kv:                   # deferred: the paged view is full
                continue
            chosen.append(s)
            budget, cells, kv = budget - 1, cells - 1, kv - s.in_cache - 1
        rows: list[tuple[_Seq, list[int]]] = []
        decode_only = True
        for s in chosen:                              # 2. drafts, as far as they fit
            room = min(len(s.drafts), budget, cells, kv)
            s.drafts = s.drafts[:room]
            budget, cells, kv = budget - room, cells - room, kv - room
            rows.append((s, [s.tokens[-1]] + s.drafts))
            decode_only &= room == 0
        cached = 0
        for s in self.running:                        # 3. prompt chunks and recomputes
            pending = len(s.tokens) - s.in_cache
            if pending <= 1:
                continue
            n = min(pending, self.prefill_chunk, budget, cells, kv - s.in_cache)
            if n < 1:
                continue
            rows.append((s, s.tokens[s.in_cache:s.in_cache + n]))
            budget, cells, kv = budget - n, cells - n, kv - s.in_cache - n
            decode_only = False
        admitted: list[_Seq] = []
        if admit and self.waiting:                    # 4. admissions
            planned = {id(s): len(feed) for s, feed in rows}
            avail = free - sum(max(planned.get(id(s), 0),
                                   math.ceil(self.reserve * self._remaining(s, s.in_cache)))
                               for s in self.running)
            idle = not self.running
            if self.admission == "lpm":
                self._order_lpm()
            i = 0
            while i < len(self.waiting) and budget > 0:
                w = self.waiting[i]
                arr = self._tokens(w)
                L = len(arr)
                hit = pc.peek(arr, max_len=L - 1) if pc is not None else 0
                # a prompt being read shares more with w than the cache: w waits for it to be
                # stored (only while something else runs in this step)
                if self._pending.size and rows and self._pending.lcp(arr.tobytes()) > hit:
                    i += 1
                    continue
                growth = math.ceil(self.reserve * self._remaining(w, L))
                own = L - hit + growth                # a hit's cells are allocated already
                if not (idle and not admitted) and own > avail:
                    got = self._evict_for(arr, hit, own - avail, partial=False)
                    cells, avail = cells + got, avail + got
                    if own > avail:
                        break                         # FIFO: nothing overtakes it for room
                n = min(L - hit, self.prefill_chunk, budget, kv - hit)
                if n > cells:
                    got = self._evict_for(arr, hit, n - cells, partial=True)
                    cells, avail = cells + got, avail + got
                if min(n, cells) < 1:
                    break
                sid, hit = self._obtain(w, arr, hit)
                n = min(L - hit, self.prefill_chunk, budget, cells, kv - hit)
                if sid is None or n < 1:
                    w.sid = sid
                    self._free(w)                     # its pin too
                    break
                self.waiting.pop(i)
                w.sid, w.in_cache, w.drafts, w.stamp = sid, hit, [], self._stamps
                self._stamps += 1
                self.running.append(w)
                admitted.append(w)
                rows.append((w, w.tokens[hit:hit + n]))
                budget, cells, kv = budget - n, cells - n, kv - hit - n
                avail -= L - hit + growth
                decode_only = False
                cached += hit
                if pc is not None and hit < len(w.req.prompt):
                    w.pending = self._tokens(w)[:len(w.req.prompt)].tobytes()
                    self._pending.add(w.pending)
        if not rows:
            return None
        return _Plan(rows, admitted, decode_only, cached)

    def _unadmit(self, admitted: list[_Seq]) -> None:
        """Takes back this step's admissions: ids freed, back at the queue's head in order."""
        for s in reversed(admitted):
            if s in self.running:
                self.running.remove(s)
            self._free(s)
            self.waiting.insert(0, s)

    def _rewind(self, s: _Seq, keep: int) -> None:
        """Drops s's cells from position ``keep`` on; a refusal (which would mean the cache and
        the generator disagree) requeues s to be read from scratch instead."""
        assert s.sid is not None
        if self.cache.rewind(s.sid, keep):
            s.in_cache = keep
        else:
            self._free(s)
            if s in self.running:
                self.running.remove(s)
            self.waiting.insert(0, s)

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
                self._rollback(plan, False, [])
            raise KeyboardInterrupt
        events: list[tuple[Request, int, int]] = []
        interrupted = False
        if plan is not None:
            events, interrupted = self._execute(plan, errors)
        self._drain()                                 # cancels made by other threads meanwhile
        self._phase = "deliver"
        for req, k, tok in events:
            if req._closed or req.on_token is None:
                continue
            try:
                req.on_token(req, k, tok)
            except BaseException as e:                # the request's own code
                self._fail(req, e, k, errors)
        self._phase = None
        self._drain()                                 # and while the callbacks ran
        if interrupted:                               # held back while the step was applied
            raise KeyboardInterrupt
        if self._later:                               # a prefix-cache on_event callback raised
            errors += self._later
            self._later.clear()
        if errors:
            raise errors[0]
        return plan is not None or self.busy

    def _propose(self, errors: list[BaseException]) -> None:
        """Asks each decoding request's draft callable for proposals (user code)."""
        for s in list(self.running):
            s.drafts = []
            r = s.req
            if r._closed or s.sid is None or r.draft is None or len(s.tokens) - s.in_cache != 1:
                continue
            if r.sampling.n > 1 and not r._forked:   # its first token forks: no verify row
                continue
            k = min(r.draft_k, r.sampling.max_new_tokens - len(r.outputs[s.index]) - 1)
            if k <= 0:
                continue
            try:
                proposed = r.draft(list(s.tokens), k)
                drafts = _token_ids(proposed, f"the draft of request {r.id}", self.vocab, allow_empty=True)
            except BaseException as e:                # the request's own code
                self._fail(r, e, s.index, errors)
                continue
            if r._closed or s.sid is None:            # the callback cancelled its request
                continue
            s.drafts = drafts[:k]
            self.stats["drafted"] += len(s.drafts)

    def _execute(self, plan: _Plan, errors: list[BaseException]
                 ) -> tuple[list[tuple[Request, int, int]], bool]:
        """Prepares, runs and samples the declared step, then applies it; rolls back and
        re-raises if anything but a request's own sampling fails first. Returns the tokens
        to deliver and whether an interrupt was held back while applying."""
        tokens = [t for _, feed in plan.rows for t in feed]
        # rows whose logits matter: each sequence's last fed token, if it reaches the end of
        # what the sequence knows; every row of a verify run
        rows: list[int] = []
        owners: list[tuple[_Seq, list[int], int | None]] = []
        row = 0
        for s, feed in plan.rows:
            end = row + len(feed)
            known_end = s.in_cache + len(feed) >= len(s.tokens)
            if s.drafts and known_end:
                rows += list(range(row, end))
                owners.append((s, feed, len(rows) - len(feed)))
            elif known_end:
                rows.append(end - 1)
                owners.append((s, feed, len(rows) - 1))
            else:
                owners.append((s, feed, None))
            row = end
        pad_to = None
        if plan.decode_only and self.runner.graphs_enabled:
            pad_to = self.runner.bucket(len(tokens))
        decode = plan.decode_only and pad_to is not None
        saved = [(s, s.rng.get_state()) for s, _, first in owners if first is not None and s.rng is not None]
        prepared = committed = False
        try:
            step = self.cache.prepare_step(stream=self.stream, pad_to=pad_to)
            prepared = True
            logits = self.runner.forward(step, tokens, rows, decode=decode)
            self.cache.commit_step()
            committed = True
            outcomes, failed = self._sample_all(owners, logits)
        except BaseException:
            self._rollback(plan, prepared and not committed, saved)
            raise
        with _HoldInterrupts() as held:
            st = self.stats
            st["steps"] += 1
            st["tokens_in"] += len(tokens)
            st["graph_steps"] += int(decode)
            st["cached_tokens"] += plan.cached
            for s, feed in plan.rows:                 # prompt tokens and recomputes: every row
                n_tok = len(s.tokens)                 # before the sequence's own next token
                end = s.in_cache + len(feed)
                st["computed_tokens"] += max(0, min(end, n_tok - 1) - s.in_cache) + int(
                    n_tok == len(s.req.prompt) and s.in_cache < n_tok <= end)
            for s in plan.admitted:
                if not s.req._counted:
                    s.req._counted = True
                    st["prompt_tokens"] += len(s.req.prompt)
            for req, exc in failed:
                self._fail(req, exc, None, errors)
            events = self._apply(outcomes)
        return events, held.hit

    def _rollback(self, plan: _Plan, commit: bool, saved: list[tuple[_Seq, Any]]) -> None:
        """Undoes a step whose forward or sampling raised: every planned sequence back to
        the cells it had, this step's admissions requeued, random generators restored."""
        try:
            if commit:                                # the forward may have been queued
                self.cache.commit_step()
        finally:
            admitted = {id(s) for s in plan.admitted}
            for s, _ in plan.rows:
                s.drafts = []
                if id(s) not in admitted and s.sid is not None:
                    self._rewind(s, s.in_cache)
            self._unadmit(plan.admitted)
            for s, state in saved:
                assert s.rng is not None
                s.rng.set_state(state)

    def _sample_all(self, owners: list[tuple[_Seq, list[int], int | None]], logits: torch.Tensor
                    ) -> tuple[list[_Outcome], list[tuple[Request, BaseException]]]:
        """Every planned sequence's outcome; a request whose sampling raises an Exception is
        returned in the failed list (the others' outcomes stand)."""
        outcomes: list[_Outcome] = []
        failed: dict[int, tuple[Request, BaseException]] = {}
        for s, feed, first in owners:
            if first is None or id(s.req) in failed:
                outcomes.append(_Outcome(s, feed, s.in_cache + len(feed)))
                continue
            try:
                outcomes.append(self._decide(s, feed, logits, first))
            except Exception as e:
                failed[id(s.req)] = (s.req, e)
        return outcomes, list(failed.values())

    def _decide(self, s: _Seq, feed: list[int], logits: torch.Tensor, first: int) -> _Outcome:
        """Samples s's tokens from its logit rows (a verify run: until a draft is rejected)."""
        req, before = s.req, s.in_cache
        n_out = len(req.outputs[s.index])
        n_draft = len(s.drafts)
        if n_draft and len(feed) == 1 + n_draft:
            toks: list[int] = []
            accepted = 0
            for j in range(n_draft):
                tok = self._sample(s, logits[first + j])
                toks.append(tok)
                if tok != s.drafts[j]:
                    break
                accepted += 1
                if self._ends(req, n_out + len(toks), tok, self.eos):
                    break
            else:
                toks.append(self._sample(s, logits[first + n_draft]))
            return _Outcome(s, feed, before + 1 + accepted, toks, accepted)
        row = logits[first]
        out = _Outcome(s, feed, before + len(feed), [self._sample(s, row)])
        if s.index == 0 and req.sampling.n > 1 and not req._forked:
            for k in range(1, req.sampling.n):
                child = self._seq(req, k, list(req.prompt))
                out.forks.append((child, self._sample(child, row)))
        return out

    def _apply(self, outcomes: list[_Outcome]) -> list[tuple[Request, int, int]]:
        """Advances every sequence by its outcome (no user code runs); returns the tokens
        to deliver, in order."""
        events: list[tuple[Request, int, int]] = []
        pc = self.prefix
        now = time.perf_counter()
        for o in outcomes:
            s, req = o.seq, o.seq.req
            if req._closed or s.sid is None:          # its request failed in sampling
                continue
            s.drafts = []
            out = req.outputs[s.index]
            reason = None
            for tok in o.tokens:
                out.append(tok)
                s.tokens.append(tok)
                events.append((req, s.index, tok))
                reason = self._ends(req, len(out), tok, self.eos)
            if o.tokens and req.first_token is None:
                req.first_token = now
            self.stats["tokens_out"] += len(o.tokens)
            self.stats["accepted"] += o.accepted
            if reason is None and o.keep < s.in_cache + len(o.feed):
                self._rewind(s, o.keep)               # the rejected drafts
            else:
                s.in_cache = o.keep
            if pc is not None and not s.stored and s.sid is not None \
                    and s.in_cache >= len(req.prompt):
                self._store_prompt(s)                 # its prompt is whole in the cache now
            if o.forks:
                req._forked = True
            for child, tok in o.forks:                # clones share the prompt's cells
                req.outputs[child.index].append(tok)
                child.tokens.append(tok)
                events.append((req, child.index, tok))
                self.stats["tokens_out"] += 1
                child_reason = self._ends(req, 1, tok, self.eos)
                if child_reason is not None:
                    self._finish_seq(child, child_reason)
                    continue
                sid = None if s.sid is None else self.cache.seq_clone(s.sid, len(req.prompt))
                if sid is None and pc is not None and s.sid is not None:
                    self._pcall(0, pc.evict, n_ids=1)
                    sid = self.cache.seq_clone(s.sid, len(req.prompt))
                if sid is None:                       # no free id: reads its prompt later
                    self.waiting.append(child)
                    continue
                child.sid, child.in_cache, child.stamp = sid, len(req.prompt), self._stamps
                self._stamps += 1
                self.stats["forks"] += 1
                self.running.append(child)
                if pc is not None:                    # the prompt it shares stays cached
                    p = self._tokens(s)[:len(req.prompt)]
                    n = pc.pin(p)
                    if n:
                        child.pins.append((p, n))
                    child.stored = True
            if reason is not None:
                self._finish_seq(s, reason)
        self.running = [s for s in self.running if s.sid is not None]
        return events

    def _sample(self, s: _Seq, row: torch.Tensor) -> int:
        sp = s.req.sampling
        if sp.temperature == 0:
            return int(torch.argmax(row))
        logits = row.float().cpu() / sp.temperature
        if sp.top_k:
            kth = torch.topk(logits, min(sp.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, -math.inf)
        probs = torch.softmax(logits, dim=-1)
        if sp.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < sp.top_p
            sorted_p = sorted_p * keep
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
            probs = probs / probs.sum()
        return int(torch.multinomial(probs, 1, generator=s.rng))

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


# -- models for trying it out ----------------------------------------------------------------

RANDOM_MODELS = {
    "tiny": dict(arch="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 use_sliding_window=True, sliding_window=16, max_window_layers=1),
    "llama-tiny": dict(arch="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    "mistral-tiny": dict(arch="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                         sliding_window=12),
    "qwen2-0.5b": dict(arch="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                       max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True),
}


def random_model(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
    """A model with random weights from a built-in config (no download)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(RANDOM_MODELS[name])
    arch = str(spec.pop("arch"))
    config = AutoConfig.for_model(arch, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device).eval()


def _one_line(e: BaseException) -> str:
    """An exception as one line (CLI errors are one line)."""
    text = " ".join(str(e).split())
    return text or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="cellcache generate",
               description="Serve a Hugging Face decoder through cellcache with continuous batching. "
                           "Prompts are text (with --model and its tokenizer) or token ids.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a local Hugging Face checkpoint directory (no download)")
    src.add_argument("--random", choices=sorted(RANDOM_MODELS), help="random weights, built-in config")
    p.add_argument("prompts", nargs="*", help="prompts (text with --model; else space-separated token ids)")
    p.add_argument("--prompts-file", help="a UTF-8 file with one prompt per line")
    p.add_argument("--random-prompts", type=in_range(1, 1 << 20), default=0,
                   help="N random token prompts (of --prompt-len tokens)")
    p.add_argument("--prompt-len", type=in_range(1, 1 << 20), default=32)
    p.add_argument("--max-new-tokens", type=in_range(1, 1 << 20), default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=in_range(0, 1 << 30), default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--n", type=in_range(1, 64), default=1, help="continuations per prompt")
    p.add_argument("--seed", type=in_range(0, 2**31 - 1), default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--capacity", type=in_range(64, 1 << 30), default=1 << 16, help="cells (default 65536)")
    p.add_argument("--max-batch-tokens", type=in_range(1, 1 << 16), default=512)
    p.add_argument("--no-graphs", action="store_true", help="run decode steps eagerly on CUDA")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="read every prompt whole (no reuse of cached prefixes)")
    p.add_argument("--admission", choices=list(ADMISSION_POLICIES), default="fifo",
                   help="waiting requests in arrival order, or longest cached prefix first (lpm)")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    if not math.isfinite(args.temperature) or args.temperature < 0:
        p.error(f"--temperature must be a finite number >= 0, not {args.temperature}")
    if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        p.error(f"--top-p must be in (0, 1], not {args.top_p}")
    if args.max_batch_tokens > args.capacity:
        p.error("--max-batch-tokens must be at most --capacity")
    texts = list(args.prompts)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                texts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            p.error(f"cannot read --prompts-file: {_one_line(e)}")
        except UnicodeDecodeError as e:
            p.error(f"--prompts-file {args.prompts_file} is not UTF-8 text ({_one_line(e)})")
    from .cuda.probe import cuda_usable

    device = args.device
    if device != "cpu":
        try:
            usable, why = cuda_usable()
        except CellCacheError as e:
            usable, why = False, _one_line(e)
        if usable and not torch.cuda.is_available():
            usable, why = False, "this torch build has no CUDA (torch.cuda.is_available() is False)"
        if device == "cuda" and not usable:
            p.error(f"--device cuda: {why}")
        device = "cuda" if usable else "cpu"
    dtype = {"auto": torch.bfloat16 if device == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    tokenizer = None
    try:
        if args.random:
            model = random_model(args.random, dtype, device, args.seed)
        else:
            import os

            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            from transformers import AutoModelForCausalLM, AutoTokenizer

            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
            try:
                tokenizer = AutoTokenizer.from_pretrained(args.model)
            except (OSError, ValueError):
                tokenizer = None
    except (OSError, ValueError) as e:
        p.error(f"cannot load the model: {_one_line(e)}")
    try:
        vocab = vocab_size(model)
    except InvalidArgument as e:
        p.error(f"cannot serve the model: {_one_line(e)}")
    prompts = []
    for t in texts:
        if tokenizer is not None:
            prompts.append(tokenizer(t)["input_ids"])
        else:
            try:
                ids = [int(x) for x in t.split()]
            except ValueError:
                p.error(f"prompt {t!r} is not token ids (this model has no tokenizer)")
            if not ids or min(ids) < 0 or max(ids) >= vocab:
                p.error(f"prompt {t!r}: token ids must lie in [0, {vocab})")
            prompts.append(ids)
    rng = np.random.default_rng(args.seed)
    prompts += [rng.integers(0, vocab, size=args.prompt_len).tolist() for _ in range(args.random_prompts)]
    if not prompts:
        p.error("no prompts: give some, --prompts-file or --random-prompts")
    try:
        gen = Generator(model, capacity=args.capacity, max_batch_tokens=args.max_batch_tokens,
                        max_seqs=min(4096, max(64, 2 * len(prompts) * args.n)),
                        graphs=False if args.no_graphs else None,
                        prefix_cache=not args.no_prefix_cache, admission=args.admission)
    except (CellCacheError, MemoryError) as e:
        p.error(f"cannot serve this model with --capacity {args.capacity} on {device}: {_one_line(e)}")
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p, seed=args.seed, n=args.n)
    for i, ids in enumerate(prompts):
        try:
            gen.add(ids, sampling)
        except InvalidArgument as e:
            p.error(f"prompt {i}: {_one_line(e)}")
    t0 = time.perf_counter()
    try:
        gen.run(progress=not args.quiet)
    except KeyboardInterrupt:
        print("cellcache generate: interrupted", file=sys.stderr)
        return 130
    elapsed = time.perf_counter() - t0
    out_tokens = gen.stats["tokens_out"]
    results = []
    for r in gen.requests:
        item: dict[str, Any] = {"id": r.id, "prompt_tokens": len(r.prompt), "outputs": r.outputs,
                                "finish_reasons": r.finish_reasons}
        if r.error is not None:
            item["error"] = _one_line(r.error)
        if tokenizer is not None:
            item["text"] = [tokenizer.decode(o) for o in r.outputs]
        results.append(item)
    summary = {"model": args.model or args.random, "device": device, "requests": len(prompts),
               "tokens_out": out_tokens, "seconds": elapsed, "tokens_per_s": out_tokens / elapsed,
               "prefix_cache": gen.prefix is not None, "admission": args.admission, **gen.stats}
    if args.json:
        print(json.dumps({"summary": summary, "results": results}, indent=2))
    else:
        for item in results:
            for k, o in enumerate(item.get("text") or item["outputs"]):
                print(f"[{item['id']}.{k}] {o}")
        print(f"generate: {len(prompts)} requests, {out_tokens} tokens in {elapsed:.2f} s = "
              f"{out_tokens / elapsed:.1f} tokens/s ({gen.stats['steps']} steps, "
              f"{gen.stats['graph_steps']} by graph replay, {gen.stats['preempted']} preempted); "
              f"prompts {gen.stats['prompt_tokens']} tokens: {gen.stats['cached_tokens']} from the "
              f"prefix cache, {gen.stats['computed_tokens']} computed")
    return 0
