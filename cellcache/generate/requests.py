"""What a client hands the generator and gets back: :class:`Sampling` (checked on
construction), :class:`Request` (outputs, finish reasons, timestamps), the finish reasons,
the token-id checks every entry point shares, and the latency summary (TTFT, ITL)."""

from __future__ import annotations

import functools
import math
import numbers
import operator
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._checks import bounded_list, check_int
from ..errors import InvalidArgument
from .text import TextStream

__all__ = ["FINISH_REASONS", "MAX_LOGPROBS", "MAX_STOPS", "Progress", "Request", "Sampling", "TokenLogprob",
           "latency_summary", "real_number", "token_ids"]

#: Why a continuation ended: a stop or end-of-sequence token, its ``max_new_tokens``, the
#: cache could not hold it even alone, :meth:`Generator.cancel`, its request's own code
#: (a callback, a draft, its sampling) raised.
FINISH_REASONS = ("stop", "length", "capacity", "cancelled", "error")

SEED_LIMIT = 1 << 63
#: The most top alternatives ``logprobs`` and ``prompt_logprobs`` may ask for (OpenAI's).
MAX_LOGPROBS = 20
#: ``presence_penalty`` and ``frequency_penalty`` lie in [-PENALTY_MAX, PENALTY_MAX];
#: ``logit_bias`` values in [-BIAS_MAX, BIAS_MAX] (OpenAI's ranges).
PENALTY_MAX = 2.0
BIAS_MAX = 100.0
#: The most ``logit_bias`` entries: more than any model's vocabulary has tokens.
BIAS_ENTRIES = 1 << 20
#: ``repetition_penalty`` lies in [1 / REPETITION_MAX, REPETITION_MAX]: past it the float32
#: logits it divides or multiplies overflow (a penalty of 1e-300 is 0 in float32: the seen
#: tokens' logits became inf, the draw NaN)
REPETITION_MAX = 1e6
#: The most ``stop`` ids, ``stop_strings`` or end-of-sequence ids (``Generator(eos=...)``)
#: given as anything but a list or tuple (an iterator, a range, an array): more ids than any
#: vocabulary holds, so a longer one (an endless generator, a ``range(10**18)``) is refused
#: before it is read whole.
MAX_STOPS = 1 << 20
_NOT_IDS = (str, bytes, bytearray, memoryview, Mapping)


def real_number(value: object, name: str) -> float:
    """``value`` as a finite float; InvalidArgument for bools, non-numbers, NaN and inf."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"{name} of type {type(value).__name__} is not a number")
    try:
        v = float(value)
    except OverflowError:                         # an int past float's range
        v = math.inf
    if not math.isfinite(v):
        shown = repr(value) if len(repr(value)) < 40 else repr(value)[:37] + "..."
        raise InvalidArgument(f"{name}={shown} is not a finite number")
    return v


def token_ids(value: object, what: str, vocab: int | None, *, allow_empty: bool = False,
              limit: int | None = None) -> list[int]:
    """Token ids given as a sequence of ints, a 1-D integer array or tensor, or a ``[1, T]``
    one (what a tokenizer returns with ``return_tensors``), as a list of ints in
    ``[0, vocab)``; InvalidArgument for anything else. ``limit``: ids given as anything but
    a list or tuple (already whole: their callers check their length; a subclass may not
    be) are refused when there are more, before they are read whole: an iterator (a
    generator, say: it may never end) is read for at most ``limit + 1`` ids, a sized one
    (an array, a ``range(10**18)``) is asked its length first."""
    shape_hint = "give a list of ints, or a 1-D or [1, T] integer array or tensor"
    # a torch tensor can only be given once torch is imported: this module needs no torch
    torch: Any = sys.modules.get("torch")
    tensor = torch is not None and isinstance(value, torch.Tensor)
    t: Any = value
    if tensor and (t.layout != torch.strided or t.is_nested or t.is_quantized
                   or t.device.type == "meta"):
        kind = "nested" if t.is_nested else "quantized" if t.is_quantized else \
            "meta" if t.device.type == "meta" else str(t.layout).removeprefix("torch.")
        raise InvalidArgument(f"{what} is a {kind} tensor; give a dense tensor (or a list of ints)")
    if tensor or isinstance(value, np.ndarray):
        shape = tuple(t.shape)
        if tensor:
            integer = not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)
        else:
            integer = t.dtype.kind in "iu"
        if not integer:
            raise InvalidArgument(f"{what} has dtype {t.dtype}; token ids are integers")
        if len(shape) == 2 and shape[0] == 1:
            t = t[0]
        elif len(shape) != 1:
            raise InvalidArgument(f"{what} has shape {list(shape)}; {shape_hint}")
        if limit is not None and shape[-1] > limit:     # (a broadcast view holds no memory)
            raise InvalidArgument(f"{what} holds more than {limit} token ids")
        items: list = t.tolist()
    elif isinstance(value, _NOT_IDS) or not isinstance(value, Iterable) or isinstance(value, Set):
        raise InvalidArgument(f"{what} of type {type(value).__name__} is not a sequence of token ids; "
                              f"{shape_hint}")
    else:
        items = bounded_list(value, what, "token ids", limit)
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


def _in_range(value: object, name: str, lo: float, hi: float) -> float:
    """``value`` as a finite float in [lo, hi]; InvalidArgument otherwise."""
    v = real_number(value, name)
    if not lo <= v <= hi:
        raise InvalidArgument(f"{name}={v} is outside [{lo:g}, {hi:g}]")
    return v


@dataclass
class Sampling:
    """How a request samples. ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 keep
    every token; ``seed`` makes sampling repeatable; ``stop`` ends a continuation (the stop
    token is kept); ``n`` continuations share the prompt.

    Every field is checked on construction (and again by :meth:`Generator.add`):
    ``max_new_tokens`` an int >= 0, ``n`` an int in [1, 65536], ``top_k`` an int >= 0,
    ``seed`` None or an int in [0, 2**63), ``temperature`` a finite number >= 0, ``top_p``
    a finite number in (0, 1], ``stop`` a sequence of ints (kept as a tuple; given as
    anything but a list or tuple, an iterator or a range, at most :data:`MAX_STOPS` of them,
    as ``stop_strings``). Bools and floats are not ints. A bad field raises
    InvalidArgument. Every accepted value samples well-defined tokens: a temperature below
    2**-64 draws as its limit (the top logit, tied ones evenly), one above 2**64 as its
    limit (uniform over what top-k and top-p keep), a top_p below 2**-64 keeps the most
    probable token alone (:mod:`cellcache.generate.sampler` says why those thresholds).

    ``max_new_tokens=0`` draws nothing: the prompt is read (through the prefix cache, as
    any prompt), its log-probabilities computed when ``prompt_logprobs`` asks, and every
    continuation ends with ``"length"`` and no tokens once the prompt is in the cache
    (scoring a text, as OpenAI's ``max_tokens: 0, echo: true``).

    Seeded sampling is counter-based: continuation k's token number t is drawn with a
    uniform hashed from ``(seed, k, t)`` (``seed`` None: the request's id), so a request's
    tokens do not depend on what else runs, on preemption, on drafts or on a rolled-back
    step (:mod:`cellcache.generate.sampler`).

    What servers ask for (checked the same way):

    - ``stop_strings``: a sequence of non-empty strings (kept as a tuple; the generator
      needs a tokenizer for them): matched on the continuation's detokenized text, across
      token boundaries; a match ends it with ``"stop"``, its text cut before the string
      (``outputs`` keeps the tokens up to the one that completed it, and only those: the
      ones a verify run applied after it are dropped, and never delivered). The text is
      decoded with special tokens skipped, so a special token (``"<|im_end|>"``) is never
      matched as a string: stop on its id in ``stop``.
    - ``ignore_eos`` (a bool): end-of-sequence ids never end it (its ``stop`` tokens still do).
    - ``min_new_tokens`` (an int in [0, max_new_tokens]): until it has that many tokens,
      its ``stop`` ids and (unless ``ignore_eos``, as vLLM) the end-of-sequence ids are
      never drawn (their logits are -inf), and stop strings do not end it.
    - ``min_p`` in [0, 1]: a sampled token's probability (after temperature) must be at
      least ``min_p`` times the most probable one's.
    - ``presence_penalty``, ``frequency_penalty`` in [-2, 2] (OpenAI's): each token's
      logit less ``frequency_penalty * count + presence_penalty * (count > 0)``, counting
      the continuation's own output tokens.
    - ``repetition_penalty`` in [1e-6, 1e6] (Hugging Face's, CTRL's): a token already in
      the prompt or the output has its logit divided by it when positive, multiplied when
      negative.
    - ``logit_bias``: a mapping of token id (an int >= 0, below the vocabulary at
      :meth:`Generator.add`) to a number in [-100, 100] added to its logit (kept as a dict).
    - ``logprobs``: None (none), 0 (the log-probability of each output token) or 1..20
      (and that many most probable alternatives); ``prompt_logprobs`` the same for every
      prompt token after the first. Log-probabilities are of the model's own distribution,
      ``log_softmax`` of its float32 logits, before ``logit_bias``, penalties, temperature
      and truncation (what vLLM calls raw log-probabilities); a greedy row's too.

    The sampler applies them in this order: ``logit_bias``, the ``min_new_tokens`` mask,
    ``repetition_penalty``, ``frequency_penalty``/``presence_penalty``, then temperature,
    ``min_p``, ``top_k``, ``top_p`` (greedy: the argmax of the processed logits).

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
    stop_strings: Sequence[str] = ()
    ignore_eos: bool = False
    min_new_tokens: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    #: Whether some draw of it may need the sampler's server knobs (set on construction):
    #: the one attribute a lean decode step tests per row.
    server_knobs: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self):
        self.max_new_tokens = check_int(self.max_new_tokens, "max_new_tokens", 0, 1 << 40)
        self.n = check_int(self.n, "n", 1, 1 << 16)
        self.top_k = check_int(self.top_k, "top_k", 0, 1 << 40)
        if self.seed is not None:
            self.seed = check_int(self.seed, "seed", 0, SEED_LIMIT - 1)
        self.temperature = real_number(self.temperature, "temperature")
        if self.temperature < 0:
            raise InvalidArgument(f"temperature={self.temperature} is negative; give 0 (greedy) or more")
        self.top_p = real_number(self.top_p, "top_p")
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p={self.top_p} is outside (0, 1]")
        stop = self.stop
        if getattr(stop, "ndim", 1) == 0 or isinstance(stop, _NOT_IDS) or not isinstance(stop, Iterable):
            raise InvalidArgument(f"stop of type {type(stop).__name__} is not a sequence of token "
                                  "ids; give a list of ints, e.g. stop=[2]")
        # (a set is read as an iterator: token_ids refuses sets, whose order is arbitrary)
        self.stop = tuple(token_ids(iter(stop) if isinstance(stop, Set) else stop, "stop", None,
                                    allow_empty=True, limit=MAX_STOPS))
        strings = self.stop_strings
        if isinstance(strings, (str, bytes, Mapping)) or not isinstance(strings, Iterable):
            raise InvalidArgument(f"stop_strings of type {type(strings).__name__} is not a sequence "
                                  "of strings; give a list, e.g. stop_strings=['\\n\\n']")
        strings = tuple(bounded_list(strings, "stop_strings", "strings", MAX_STOPS))
        for x in strings:
            if not isinstance(x, str) or not x:
                raise InvalidArgument(f"stop_strings holds {x!r}; each must be a non-empty str")
        self.stop_strings = strings
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise InvalidArgument(f"ignore_eos of type {type(self.ignore_eos).__name__} is not a bool")
        self.ignore_eos = bool(self.ignore_eos)
        self.min_new_tokens = check_int(self.min_new_tokens, "min_new_tokens", 0, 1 << 40)
        if self.min_new_tokens > self.max_new_tokens:
            raise InvalidArgument(f"min_new_tokens={self.min_new_tokens} is more than "
                                  f"max_new_tokens={self.max_new_tokens}")
        self.min_p = _in_range(self.min_p, "min_p", 0.0, 1.0)
        self.presence_penalty = _in_range(self.presence_penalty, "presence_penalty", -PENALTY_MAX,
                                          PENALTY_MAX)
        self.frequency_penalty = _in_range(self.frequency_penalty, "frequency_penalty",
                                           -PENALTY_MAX, PENALTY_MAX)
        self.repetition_penalty = real_number(self.repetition_penalty, "repetition_penalty")
        if not 1 / REPETITION_MAX <= self.repetition_penalty <= REPETITION_MAX:
            raise InvalidArgument(f"repetition_penalty={self.repetition_penalty} is outside "
                                  f"[{1 / REPETITION_MAX:g}, {REPETITION_MAX:g}] (1 leaves the logits as "
                                  "they are)")
        bias = self.logit_bias
        if not isinstance(bias, Mapping):
            raise InvalidArgument(f"logit_bias of type {type(bias).__name__} is not a mapping of "
                                  "token id to a number")
        checked: dict[int, float] = {}
        # (a huge lazy mapping is refused by its length, one whose length lies read no further)
        for key, value in bounded_list(bias.items(), "logit_bias", "entries", BIAS_ENTRIES):
            tid = token_ids([key], "logit_bias", None)[0] if not isinstance(key, (str, bytes)) \
                else None
            if tid is None:
                raise InvalidArgument(f"logit_bias holds the key {key!r}; keys are token ids (ints)")
            checked[tid] = _in_range(value, f"logit_bias[{tid}]", -BIAS_MAX, BIAS_MAX)
        self.logit_bias = checked
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, check_int(value, name, 0, MAX_LOGPROBS))
        self.server_knobs = self.shapes_draws or self.min_new_tokens > 0

    @property
    def shapes_draws(self) -> bool:
        """Whether the sampler does more than temperature, top-k and top-p for every draw
        of it (logits changed, or log-probabilities asked for)."""
        return bool(self.min_p or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias or self.logprobs is not None)

    def processed(self, n_out: int) -> bool:
        """Whether its draw of output token ``n_out`` needs the sampler's server knobs
        (:attr:`shapes_draws`, or the ``min_new_tokens`` mask before that many tokens): its
        slot then carries a :class:`~cellcache.generate.plan.SlotExtra`."""
        return self.shapes_draws or n_out < self.min_new_tokens

    def cells_needed(self, prompt_len: int) -> int:
        """Cells one continuation of a prompt of ``prompt_len`` tokens holds at most: its
        prompt and every output token but the last (which is drawn, never fed); its prompt
        alone when it draws nothing (``max_new_tokens`` 0)."""
        return prompt_len + max(self.max_new_tokens, 1) - 1


def _timeout(timeout: object) -> float | None:
    """A wait's ``timeout``: None (no limit) or seconds >= 0; InvalidArgument otherwise.
    One past the longest wait the platform's locks take (``threading.TIMEOUT_MAX``, ~292
    years) is no limit (the lock would raise OverflowError)."""
    if timeout is None:
        return None
    t = real_number(timeout, "timeout")
    if t < 0:
        raise InvalidArgument(f"timeout={t} is negative; give None or seconds >= 0")
    return None if t >= threading.TIMEOUT_MAX else t


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability: ``token``, its ``logprob`` under the model's own
    distribution (``log_softmax`` of the float32 logits, before logit_bias, penalties,
    temperature and truncation), and ``top``: the most probable ``(token, logprob)`` pairs
    of that distribution, most probable first, equal ones by the lowest id (as many as
    asked for; may include ``token``).

    Example
    -------
    >>> TokenLogprob(5, -0.25, [(5, -0.25), (9, -1.5)]).top[1]
    (9, -1.5)
    """

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class Progress:
    """What a generator's requests wait on between steps (:meth:`Request.iter_tokens`,
    :meth:`Request.iter_text`): a condition the stepping thread notifies after each step
    when someone waits (one attribute test otherwise)."""

    __slots__ = ("cond", "waiters")

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.waiters = 0

    def notify(self) -> None:
        """Wakes every waiter (the stepping thread, after a step changed what they read)."""
        if self.waiters:
            with self.cond:
                self.cond.notify_all()

    def wait(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Blocks until ``ready()``; False when ``timeout`` seconds passed first."""
        with self.cond:
            self.waiters += 1
            try:
                return self.cond.wait_for(ready, timeout)
            finally:
                self.waiters -= 1


@dataclass
class Request:
    """A prompt being served: ``outputs[k]`` is continuation k's tokens so far.

    ``finish_reasons[k]`` is None while continuation k runs, then one of
    :data:`FINISH_REASONS`; the request is ``done`` when every continuation has one.
    ``error`` holds the exception that ended it with ``"error"`` (its ``on_token`` or
    ``draft`` raised, a draft was not token ids, its sampling failed).

    Times are the generator's clock (``time.perf_counter()`` unless ``Generator(clock=...)``):
    ``arrived`` when :meth:`Generator.add` queued it, ``first_token`` when the step that
    sampled its first token was applied (time to first token: ``first_token - arrived``),
    ``token_times[k][i]`` when continuation k's token i was applied (tokens of one step,
    such as accepted drafts, share a time), ``finished`` when its last continuation ended.
    :meth:`itl` lists the inter-token gaps.

    ``outputs`` and ``token_times`` are lists. While continuation k runs, the generator may
    keep the tokens of its steady decode steps in arrays (no list appended a step): reading
    ``req.outputs[k]`` or ``req.token_times[k]`` then builds a list of every token applied
    so far, from any thread, without running the generator. Read through the request each
    time: a list obtained while the continuation runs may be a copy that does not grow.
    Once continuation k ends its lists are plain lists holding all of its tokens.

    Text (a generator with a tokenizer): ``texts[k]`` is continuation k's text so far (what
    ``on_text`` was handed, cut before a stop string; empty strings without a tokenizer),
    ``text`` is ``texts[0]``. ``logprobs[k][i]`` is the :class:`TokenLogprob` of
    continuation k's token i (None unless ``Sampling.logprobs`` is set);
    ``prompt_logprobs[i]`` that of prompt token i (index 0 is None; None unless
    ``Sampling.prompt_logprobs`` is set). ``cached_tokens``: prompt tokens its first
    admission found in the prefix cache. :meth:`result` waits for the end;
    :meth:`iter_tokens` and :meth:`iter_text` follow a continuation from another thread.
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
    token_times: list[list[float]] = field(default_factory=list)
    on_text: Callable | None = None
    tokenizer: Any = field(default=None, repr=False, compare=False)
    logprobs: list[list[TokenLogprob]] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_tokens: int = 0
    progress: Progress | None = field(default=None, repr=False, compare=False)
    # continuations read through a stored row (store_row)
    _stored: int = field(default=0, init=False, repr=False, compare=False)
    # each continuation's text stream: streamed on the stepping thread (on_text or stop
    # strings), or made lazily when the texts are read (None: none yet)
    _streams: list[TextStream] | None = field(default=None, init=False, repr=False, compare=False)
    _lazy: list[TextStream] | None = field(default=None, init=False, repr=False, compare=False)
    _lock: Any = field(default=None, init=False, repr=False, compare=False)
    _done: Any = field(default=None, init=False, repr=False, compare=False)
    #: Whether the generator hands its applied tokens to the stepping thread's callbacks
    #: (an ``on_token``, or a text stream: ``on_text`` or stop strings).
    hooked: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sp, n = self.sampling, self.sampling.n
        self._lock = threading.Lock()
        self._done = threading.Event()
        if self.finished is not None:
            self._done.set()
        if self.tokenizer is not None and (self.on_text is not None or sp.stop_strings):
            self._streams = [TextStream(self.tokenizer, self.prompt, sp.stop_strings, sp.min_new_tokens)
                             for _ in range(n)]
        if self.logprobs is None and sp.logprobs is not None:
            self.logprobs = [[] for _ in range(n)]
        if self.prompt_logprobs is None and sp.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt)
        self.hooked = self.on_token is not None or self._streams is not None

    def __getstate__(self) -> dict:
        """For pickle and copy: the lists as they stand (every token applied so far), none
        of them read through the generator's arrays; the texts as read now. Locks, events
        and the generator's wake-ups stay behind."""
        texts = self.texts
        state = {**self.__dict__, "outputs": self.outputs, "token_times": self.token_times,
                 "_stored": 0, "_lock": None, "_done": None, "progress": None, "_lazy": None,
                 "_streams": None}
        state["_texts"] = texts
        return state

    def __setstate__(self, state: dict) -> None:
        texts = state.pop("_texts", None)
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._done = threading.Event()
        if self.finished is not None:
            self._done.set()
        if texts is not None and self.tokenizer is not None:
            self._lazy = []                   # the texts as they were (nothing to decode again)
            for t in texts:
                st = TextStream(self.tokenizer)
                st.text, st.closed = t, True
                self._lazy.append(st)

    # -- text -----------------------------------------------------------------------------------
    @property
    def texts(self) -> list[str]:
        """Continuation k's output as text so far: what :meth:`Generator.add`'s ``on_text``
        was given (deltas concatenated), cut before a stop string and before a stop token;
        text that may still be half a character or the start of a stop string (and, read
        without ``on_text`` or stop strings, the last token's) is not in it until the
        continuation ends. Empty strings without a tokenizer. Safe from any thread (a request with no
        text stream is decoded here, incrementally, as it is read)."""
        n = self.sampling.n
        if self.tokenizer is None:
            return [""] * n
        streams = self._streams
        if streams is not None:
            return [st.text for st in streams]
        with self._lock:
            lazy = self._lazy
            if lazy is None:
                lazy = self._lazy = [TextStream(self.tokenizer, self.prompt) for _ in range(n)]
            for k, st in enumerate(lazy):
                if st.closed:
                    continue
                ended = self.finish_reasons[k] is not None
                out = self.outputs[k]
                # the last token waits for the end: one that ends "stop" ends on a stop or
                # end-of-sequence id here (no stop string), and that token is not in the text,
                # as push_text has it (read before its reason is set, it would have been)
                last = len(out) if ended and self.finish_reasons[k] != "stop" else len(out) - 1
                for tok in out[st.fed:last]:
                    st.push(tok)
                if ended:
                    st.close()
            return [st.text for st in lazy]

    @property
    def text(self) -> str:
        """``texts[0]``."""
        return self.texts[0]

    @property
    def streams_text(self) -> bool:
        """Whether its text is made on the stepping thread as tokens are applied (it has a
        tokenizer, and an ``on_text`` or stop strings)."""
        return self._streams is not None

    def text_final(self, k: int = 0) -> bool:
        """Whether continuation k ended and its text is whole (its last ``on_text`` ran)."""
        if self.finish_reasons[k] is None:
            return False
        streams = self._streams
        return streams is None or streams[k].closed

    def push_text(self, k: int, token: int) -> tuple[str, bool]:
        """The stepping thread's: continuation k's next token into its text stream; returns
        (the text released, whether a stop string matched with it). ("", False) when the
        request streams no text or continuation k's text is closed."""
        streams = self._streams
        if streams is None:
            return "", False
        st = streams[k]
        if st.stopped or st.closed:
            st.fed += 1
            return "", False
        if self.finish_reasons[k] == "stop" and st.fed + 1 == len(self.outputs[k]):
            # the token that ended it by its id (a stop id, end-of-sequence): kept in the
            # outputs, not in the text, as a stop string is not (vLLM's default)
            st.fed += 1
            return "", False
        delta = st.push(token)
        return delta, st.stopped

    def text_stopped(self, k: int) -> bool:
        """Whether a stop string ended continuation k's text (its later tokens are not
        delivered)."""
        streams = self._streams
        return streams is not None and streams[k].stopped

    def drop_after_stop(self, k: int) -> None:
        """The stepping thread's, once a stop string ended continuation k and the scheduler
        freed it (its lists plain): drops the tokens applied after the one that completed
        the stop string (a verify run applies several in one step), with their times and
        log-probabilities, so that ``outputs[k]`` ends as it does without drafts."""
        n = self._streams[k].fed if self._streams is not None else None
        if n is None:
            return
        for name in ("outputs", "token_times"):
            entry = self.__dict__[name][k]
            if type(entry) is list:
                del entry[n:]
        if self.logprobs is not None:
            del self.logprobs[k][n:]

    def close_text(self, k: int) -> str | None:
        """The stepping thread's: closes continuation k's text stream; returns the text held
        back until now (maybe ""), or None when it was closed already or nothing streams."""
        streams = self._streams
        if streams is None or streams[k].closed:
            return None
        out = streams[k].close()
        # a stop string that only the flush completes (one ending in the U+FFFD of a last,
        # unfinished character): the text was cut there, so it ended on the stop string
        if streams[k].stopped and self.finish_reasons[k] == "length":
            self.finish_reasons[k] = "stop"
        return out

    def texts_to_close(self, all_ended: bool = False) -> list[int]:
        """The continuations that ended and whose text stream is open: with ``all_ended``
        every one, else only those whose every output token was pushed (the others' last
        tokens are still to be delivered)."""
        if self._streams is None:
            return []
        return [k for k in range(len(self._streams)) if self.text_closes(k, all_ended)]

    def text_closes(self, k: int, ended: bool = False) -> bool:
        """Whether continuation k's open text stream is to be closed now: it ended, and
        (``ended``) whatever was delivered, or its every output token was pushed (or a stop
        string stopped it)."""
        streams = self._streams
        if streams is None:
            return False
        st = streams[k]
        if st.closed or self.finish_reasons[k] is None:
            return False
        return ended or st.stopped or st.fed >= len(self.outputs[k])

    def prompt_logprobs_missing(self) -> bool:
        """Whether some prompt token after the first still has no log-probability (asked
        for, not computed yet)."""
        lp = self.prompt_logprobs
        return lp is not None and None in lp[1:]

    # -- waiting --------------------------------------------------------------------------------
    def mark_done(self) -> None:
        """The generator's, once the request finished and its texts were closed: wakes
        :meth:`result` and the iterators."""
        self._done.set()
        if self.progress is not None:
            self.progress.notify()

    def result(self, timeout: float | None = None) -> Request:
        """Blocks until the request is done (whatever the reason) and its texts are whole;
        returns it. ``timeout`` (None: no limit) in seconds: TimeoutError when it runs out
        first. Another thread must step the generator meanwhile."""
        timeout = _timeout(timeout)
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} was not done within {timeout} s")
        return self

    def _wait(self, ready: Callable[[], bool], timeout: float | None) -> None:
        """Waits until ``ready()`` (checked under the generator's wake-up lock) or the
        request is done; TimeoutError after ``timeout`` seconds."""
        progress = self.progress
        if progress is None:                  # not a generator's: only the end wakes it
            if not ready() and not self._done.wait(timeout) and not ready():
                raise TimeoutError(f"request {self.id} made no progress within {timeout} s")
            return
        if not progress.wait(lambda: ready() or self._done.is_set(), timeout):
            raise TimeoutError(f"request {self.id} made no progress within {timeout} s")

    def _check_k(self, k: int) -> int:
        return check_int(k, "continuation", 0, self.sampling.n - 1)

    def _has_tokens(self, k: int, i: int) -> bool:
        return len(self.outputs[k]) > i or self.finish_reasons[k] is not None

    def _has_text(self, k: int, pos: int) -> bool:
        return len(self.texts[k]) > pos or self.text_final(k)

    def iter_tokens(self, k: int = 0, timeout: float | None = None) -> Iterator[int]:
        """Continuation k's tokens as they are applied, blocking between steps (another
        thread steps the generator); ends when the continuation ends. ``timeout``: the
        longest wait for one token (TimeoutError). ``k`` and ``timeout`` are checked at the
        call (InvalidArgument), not at the first ``next``."""
        return self._tokens(self._check_k(k), _timeout(timeout))

    def _tokens(self, k: int, timeout: float | None) -> Iterator[int]:
        i = 0
        while True:
            out = self.outputs[k]
            if len(out) > i:
                yield from out[i:]
                i = len(out)
                continue
            if self.finish_reasons[k] is not None:
                if len(self.outputs[k]) > i:
                    continue
                return
            self._wait(functools.partial(self._has_tokens, k, i), timeout)

    def iter_text(self, k: int = 0, timeout: float | None = None) -> Iterator[str]:
        """Continuation k's text as it becomes final (non-empty deltas, concatenating to
        ``texts[k]``), blocking between steps; ends when its text is whole. ``timeout``:
        the longest wait for one delta (TimeoutError). ``k`` and ``timeout`` are checked
        at the call (InvalidArgument), not at the first ``next``."""
        return self._text_deltas(self._check_k(k), _timeout(timeout))

    def _text_deltas(self, k: int, timeout: float | None) -> Iterator[str]:
        pos = 0
        while True:
            t = self.texts[k]
            if len(t) > pos:
                yield t[pos:]
                pos = len(t)
                continue
            if self.text_final(k):
                t = self.texts[k]
                if len(t) > pos:
                    continue
                return
            self._wait(functools.partial(self._has_text, k, pos), timeout)

    def store_row(self, k: int, row: Any) -> None:
        """Makes continuation k's ``outputs`` and ``token_times`` read through ``row`` (its
        ``ids()`` and ``token_times()``: a :class:`~.plan.StoredRow`) until
        :meth:`unstore_row`."""
        for name in ("outputs", "token_times"):
            rows = self.__dict__[name]
            if type(rows) is list:            # a copy: a reader's plain list never holds a row
                rows = _StoredRows(rows)
            rows[k] = row
            self.__dict__[name] = rows
        self._stored += 1

    def own_row(self, k: int) -> tuple[list[int], list[float]]:
        """Continuation k's own ``outputs`` and ``token_times`` lists, k not stored: no
        other continuation's list is built (reading ``outputs`` while some are stored builds
        every one of them)."""
        out, times = self.__dict__["outputs"][k], self.__dict__["token_times"][k]
        assert type(out) is list and type(times) is list, "a stored continuation's lists are its row's"
        return out, times

    def unstore_row(self, k: int, out: list[int], times: list[float]) -> None:
        """Continuation k's lists are ``out`` and ``times`` again (whole: the row's tokens
        appended)."""
        self._stored -= 1
        for name, whole in (("outputs", out), ("token_times", times)):
            rows = self.__dict__[name]
            rows[k] = whole
            if not self._stored:              # plain lists again
                self.__dict__[name] = list(rows)

    @property
    def done(self) -> bool:
        return self.finished is not None

    @property
    def complete(self) -> bool:
        """Done, and its generator has let it go: its texts closed (their last ``on_text``
        made), no callback of it to come. What :meth:`result` waits for; ``done`` turns
        True first (a cancel from another thread closes the texts just after)."""
        return self._done.is_set()

    def end_reason(self, n_out: int, tok: int, eos: Set[int]) -> str | None:
        """The stop rule: why a continuation with ``n_out`` tokens, the last ``tok``, ends:
        ``"stop"`` (an end-of-sequence id of ``eos``, unless ``ignore_eos``, or one of its
        ``stop`` tokens, which is kept; neither before ``min_new_tokens`` tokens came
        first), ``"length"`` (``max_new_tokens`` reached), or None (it goes on). Stop
        strings are matched on the text (:class:`~cellcache.generate.text.TextStream`)."""
        sp = self.sampling
        if (tok in sp.stop or (tok in eos and not sp.ignore_eos)) and n_out > sp.min_new_tokens:
            return "stop"
        if n_out >= sp.max_new_tokens:
            return "length"
        return None

    @property
    def ttft(self) -> float | None:
        """Time to first token (None before it)."""
        return None if self.first_token is None else self.first_token - self.arrived

    def itl(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive tokens of each continuation
        (a continuation's first token is the TTFT's, not a gap)."""
        return [b - a for times in self.token_times for a, b in zip(times, times[1:])]


class _StoredRows(list):
    """A request's ``outputs`` or ``token_times`` as kept while some continuation's entry is
    a stored row (:meth:`Request.store_row`); never handed out."""


def _stored(name: str, read: str) -> property:
    """``Request.<name>`` as a property: the lists, a running continuation's built from the
    generator's arrays (an entry :meth:`Request.store_row` set answers ``read``) at each
    read. No list is built when none is stored (the scheduler's own reads)."""
    def get(self: Request, _plain: type = list) -> list:
        rows: list = self.__dict__[name]
        if rows.__class__ is _plain:          # (a local: read many times a step)
            return rows
        return [x if type(x) is list else getattr(x, read)() for x in rows]

    def put(self: Request, value: list) -> None:
        self.__dict__[name] = value

    return property(get, put)


# read through the generator's token arrays (set after the dataclass made its fields)
Request.outputs = _stored("outputs", "ids")  # type: ignore[assignment]
Request.token_times = _stored("token_times", "token_times")  # type: ignore[assignment]


def _percentiles(values: list[float], prefix: str) -> dict[str, float | None]:
    if not values:
        return {f"{prefix}_p50": None, f"{prefix}_p99": None, f"{prefix}_mean": None}
    arr = 1e3 * np.asarray(values, dtype=np.float64)
    return {f"{prefix}_p50": float(np.percentile(arr, 50)), f"{prefix}_p99": float(np.percentile(arr, 99)),
            f"{prefix}_mean": float(arr.mean())}


def latency_summary(requests: Iterable[Request]) -> dict[str, float | int | None]:
    """TTFT and inter-token latency over ``requests``, in milliseconds: ``ttft_ms_p50``,
    ``ttft_ms_p99``, ``ttft_ms_mean`` over the requests that got a first token,
    ``itl_ms_p50/p99/mean`` over every gap of every continuation; ``requests`` and
    ``gaps`` count what went in. A statistic with nothing to summarize is None."""
    if not isinstance(requests, Iterable) or isinstance(requests, (str, bytes)):
        raise InvalidArgument(f"requests of type {type(requests).__name__} is not a sequence of "
                              "requests")
    reqs = []
    for r in requests:                  # (checked as read: a range(10**18) is refused at once)
        if not isinstance(r, Request):
            raise InvalidArgument(f"requests holds {type(r).__name__}, not a Request")
        reqs.append(r)
    ttft = [r.ttft for r in reqs if r.ttft is not None]
    gaps = [g for r in reqs for g in r.itl()]
    return {"requests": len(ttft), "gaps": len(gaps), **_percentiles(ttft, "ttft_ms"),
            **_percentiles(gaps, "itl_ms")}
