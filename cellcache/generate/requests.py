"""What a client hands the generator and gets back: :class:`Sampling` (checked on
construction), :class:`Request` (outputs, finish reasons, timestamps), the finish reasons,
the token-id checks every entry point shares, and the latency summary (TTFT, ITL)."""

from __future__ import annotations

import math
import numbers
import operator
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._checks import check_int
from ..errors import InvalidArgument

__all__ = ["FINISH_REASONS", "Request", "Sampling", "latency_summary", "real_number", "token_ids"]

#: Why a continuation ended: a stop or end-of-sequence token, its ``max_new_tokens``, the
#: cache could not hold it even alone, :meth:`Generator.cancel`, its request's own code
#: (a callback, a draft, its sampling) raised.
FINISH_REASONS = ("stop", "length", "capacity", "cancelled", "error")

SEED_LIMIT = 1 << 63
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


def token_ids(value: object, what: str, vocab: int | None, *, allow_empty: bool = False) -> list[int]:
    """Token ids given as a sequence of ints, a 1-D integer array or tensor, or a ``[1, T]``
    one (what a tokenizer returns with ``return_tensors``), as a list of ints in
    ``[0, vocab)``; InvalidArgument for anything else."""
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
        items: list = t.tolist()
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
    floats are not ints. A bad field raises InvalidArgument. Every accepted value samples
    well-defined tokens: a temperature below 2**-64 draws as its limit (the top logit,
    tied ones evenly), one above 2**64 as its limit (uniform over what top-k and top-p
    keep), a top_p below 2**-64 keeps the most probable token alone
    (:mod:`cellcache.generate.sampler` says why those thresholds).

    Seeded sampling is counter-based: continuation k's token number t is drawn with a
    uniform hashed from ``(seed, k, t)`` (``seed`` None: the request's id), so a request's
    tokens do not depend on what else runs, on preemption, on drafts or on a rolled-back
    step (:mod:`cellcache.generate.sampler`).

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
        self.stop = tuple(token_ids(list(stop) if isinstance(stop, Set) else stop, "stop", None,
                                    allow_empty=True))

    def cells_needed(self, prompt_len: int) -> int:
        """Cells one continuation of a prompt of ``prompt_len`` tokens holds at most: its
        prompt and every output token but the last (which is drawn, never fed)."""
        return prompt_len + self.max_new_tokens - 1


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
    # continuations read through a stored row (store_row)
    _stored: int = field(default=0, init=False, repr=False, compare=False)

    def __getstate__(self) -> dict:
        """For pickle and copy: the lists as they stand (every token applied so far), none
        of them read through the generator's arrays."""
        return {**self.__dict__, "outputs": self.outputs, "token_times": self.token_times,
                "_stored": 0}

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

    def end_reason(self, n_out: int, tok: int, eos: Set[int]) -> str | None:
        """The stop rule: why a continuation with ``n_out`` tokens, the last ``tok``, ends:
        ``"stop"`` (an end-of-sequence id of ``eos`` or one of its ``stop`` tokens, which
        is kept), ``"length"`` (``max_new_tokens`` reached), or None (it goes on)."""
        sp = self.sampling
        if tok in eos or tok in sp.stop:
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
    reqs = list(requests)
    ttft = [r.ttft for r in reqs if r.ttft is not None]
    gaps = [g for r in reqs for g in r.itl()]
    return {"requests": len(ttft), "gaps": len(gaps), **_percentiles(ttft, "ttft_ms"),
            **_percentiles(gaps, "itl_ms")}
