"""The OpenAI wire format of ``cellcache serve``: request bodies (pydantic models, checked
strictly), their mapping onto the library's :class:`~cellcache.generate.Sampling`, the
response and chunk bodies, and OpenAI-style errors.

Decisions where OpenAI's reference is silent or the library differs:

- **Strict JSON types.** ``"max_tokens": "5"`` or ``"n": 1.0`` is a 400, as OpenAI answers;
  NaN and infinities are refused. Fields this server does not know are ignored (as vLLM
  does), so clients that send newer OpenAI fields keep working; fields it knows but cannot
  honour (``tools``, a ``response_format`` other than text, ``suffix``, ``best_of`` other
  than ``n``) are a 400 naming the field.
- **Extensions** (vLLM's names): ``top_k``, ``min_p``, ``repetition_penalty``,
  ``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``return_token_ids`` (each choice
  carries ``token_ids``, the response ``prompt_token_ids``).
- **Scoring a prompt.** Completions take ``max_tokens: 0`` with ``echo: true`` (OpenAI's
  legacy spec, vLLM, what lm-eval-harness sends): the prompt is read and echoed, with its
  log-probabilities when ``logprobs`` is set (the first token's ``null``), no token is
  drawn, ``finish_reason`` is ``"length"`` and ``completion_tokens`` 0. ``max_tokens: 0``
  without ``echo`` is a 400, as vLLM answers (there would be nothing to return); chat
  completions keep ``max_tokens`` >= 1.
- **Finish reasons.** The library's ``"capacity"`` (the cache could not hold the
  continuation) is reported as ``"length"``; ``"cancelled"`` (the server shutting down) as
  ``"abort"``, vLLM's word; ``"error"`` fails the request (500, or an ``error`` event on a
  stream).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from ..generate.requests import REPETITION_MAX

__all__ = ["APIError", "ChatRequest", "CompletionRequest", "FINISH", "ServeLimits", "error_body",
           "finish_reason", "from_validation_error", "sampling_fields", "usage"]

#: The library's finish reasons as this server reports them (module docstring).
FINISH = {"stop": "stop", "length": "length", "capacity": "length", "cancelled": "abort",
          "error": "error"}

#: OpenAI's limits: 4 stop sequences, 5 alternatives for completions, 20 for chat.
MAX_STOP = 4
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_LOGPROBS = 20
#: stop_token_ids at most: the library tests each new token against the list, so a long one
#: slows every step of every request on the engine thread.
MAX_STOP_TOKEN_IDS = 1024

Float = Annotated[float, Field(allow_inf_nan=False)]


class APIError(Exception):
    """An error answered as OpenAI does: ``status`` and the body ``{"error": {"message",
    "type", "param", "code"}}``; ``headers`` (``Retry-After``) go with it."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code = param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body of this error."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def from_validation_error(e: ValidationError) -> APIError:
    """A 400 for a body pydantic refused: the first problem's message, its field as ``param``
    (dotted: ``messages.0.content``)."""
    first = e.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in first.get("loc", ()) if not _union_tag(p))
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('msg')}", code="invalid_json")
    msg = first.get("msg", "invalid value")
    return APIError(400, f"{loc}: {msg}" if loc else msg, param=loc or None)


def _union_tag(part: object) -> bool:
    """Whether a part of pydantic's error location names a member of a union (``str``,
    ``list[int]``, ``function-after[...]``) rather than a field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part
                                      or part.startswith("function-"))


class _NullIsDefault(BaseModel):
    """A body object whose fields given as JSON ``null`` take their defaults."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """A field given as JSON ``null`` takes its default, as OpenAI's API reads it
        ("number or null"; its client sends ``null`` for an argument passed as None)."""
        if isinstance(data, Mapping):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_NullIsDefault):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage."""

    include_usage: StrictBool = False


class _Common(_NullIsDefault):
    """The sampling fields both endpoints share (OpenAI's ranges; extensions: vLLM's)."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Float = Field(1.0, ge=0, le=2)
    top_p: Float = Field(1.0, gt=0, le=1)
    n: StrictInt = Field(1, ge=1, le=128)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = Field(None, ge=0, le=(1 << 63) - 1)
    presence_penalty: Float = Field(0.0, ge=-2, le=2)
    frequency_penalty: Float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[StrictStr, Float] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # extensions (vLLM's names)
    top_k: StrictInt = Field(0, ge=-1)
    min_p: Float = Field(0.0, ge=0, le=1)
    repetition_penalty: Float = Field(1.0, ge=1 / REPETITION_MAX, le=REPETITION_MAX)
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(0, ge=0)
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    return_token_ids: StrictBool = False


class CompletionRequest(_Common):
    """``POST /v1/completions``. ``prompt``: a string, token ids, or a list of either (a
    batch: prompt i's continuation k is choice ``i * n + k``). ``max_tokens`` 0 with
    ``echo`` scores the prompt (module docstring)."""

    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    # 0 only with echo (_refuse_unsupported): the prompt scored, nothing drawn
    max_tokens: StrictInt | None = Field(None, ge=0)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = Field(None, ge=1)

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, one per batch entry (an empty list is refused)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty; give a string, token ids, or a list of them",
                           param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    """A content part of a chat message: only text parts are served."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    """A chat message: its role and its content (a string, or text parts joined by newlines,
    as vLLM and TensorRT-LLM join them, so a template sees the same prompt)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def as_dict(self) -> dict[str, str]:
        """What the chat template reads: ``{"role", "content"}`` (``developer`` as ``system``)."""
        c = self.content
        text = "" if c is None else c if isinstance(c, str) else "\n".join(p.text for p in c)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: StrictStr = "text"


class ChatRequest(_Common):
    """``POST /v1/chat/completions``: ``messages`` through the model's chat template."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_CHAT_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: ResponseFormat | None = None


class ServeLimits(BaseModel):
    """What the server may grant a request: the cache's ``capacity`` (cells), the model's
    context (``max_positions``, None when unknown), ``default_max_tokens`` (the cap on
    ``max_tokens`` when a request gives none)."""

    capacity: int
    max_positions: int | None = None
    default_max_tokens: int = 4096


def _refuse_unsupported(req: _Common) -> None:
    """400 for fields this server knows and cannot honour (module docstring)."""
    if isinstance(req, CompletionRequest):
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens: Input should be greater than or equal to 1 (0 only with "
                           "echo: true, which returns the prompt and draws nothing)", param="max_tokens")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, f"best_of={req.best_of} is not supported (only best_of equal to n)",
                           param="best_of")
    if isinstance(req, ChatRequest):
        if req.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if req.tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice is not supported", param="tool_choice")
        if req.response_format is not None and req.response_format.type != "text":
            raise APIError(400, f"response_format {req.response_format.type!r} is not supported "
                           "(only 'text')", param="response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options needs stream: true", param="stream_options")


def max_new_tokens(req: _Common, prompt_len: int, limits: ServeLimits) -> int:
    """The request's ``max_tokens`` (chat: ``max_completion_tokens`` first; 0 for a
    completion that scores its prompt), checked against
    what the cache and the model's context can hold for a prompt of ``prompt_len`` tokens;
    without one, what fits, at most ``limits.default_max_tokens``. A prompt or a
    ``max_tokens`` that can never fit is a 400 (``context_length_exceeded``)."""
    room = limits.capacity - prompt_len + 1          # a continuation holds prompt + max - 1 cells
    if limits.max_positions is not None:
        room = min(room, limits.max_positions - prompt_len)
    asked = req.max_completion_tokens if isinstance(req, ChatRequest) and \
        req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if isinstance(req, ChatRequest) and \
        req.max_completion_tokens is not None else "max_tokens"
    if room < 1:
        raise APIError(400, f"the prompt has {prompt_len} tokens; this server holds at most "
                       f"{prompt_len + room - 1} prompt tokens (cache capacity {limits.capacity}"
                       + (f", model context {limits.max_positions}" if limits.max_positions else "")
                       + ")", param="messages" if isinstance(req, ChatRequest) else "prompt",
                       code="context_length_exceeded")
    if asked is None:
        got = min(room, max(limits.default_max_tokens, req.min_tokens))
        if req.min_tokens > got:
            raise APIError(400, f"min_tokens={req.min_tokens} with a prompt of {prompt_len} tokens does "
                           f"not fit: at most {room} new tokens", param="min_tokens",
                           code="context_length_exceeded")
        return got
    if req.min_tokens > asked:
        raise APIError(400, f"min_tokens={req.min_tokens} is more than {param}={asked}", param="min_tokens")
    if asked > room:
        raise APIError(400, f"{param}={asked} with a prompt of {prompt_len} tokens does not fit: "
                       f"at most {room} new tokens (cache capacity {limits.capacity}"
                       + (f", model context {limits.max_positions}" if limits.max_positions else "")
                       + ")", param=param, code="context_length_exceeded")
    return asked


def sampling_fields(req: _Common) -> dict[str, Any]:
    """The keyword arguments of :class:`~cellcache.generate.Sampling` this request asks for,
    but ``max_new_tokens`` (:func:`max_new_tokens`). Raises APIError (400) for what the
    wire format allows and the library cannot take (a ``logit_bias`` key that is not a token
    id, more than four stop sequences, an empty one)."""
    _refuse_unsupported(req)
    stops = [] if req.stop is None else [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if len(stops) > MAX_STOP:
        raise APIError(400, f"stop has {len(stops)} sequences; at most {MAX_STOP}", param="stop")
    if any(s == "" for s in stops):
        raise APIError(400, "stop holds an empty string", param="stop")
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        # a token id's decimal digits only: int() would also take " 5", "1_0" and non-ASCII digits
        # (and few of them: no vocabulary reaches 19 digits, and int() refuses past 4300)
        if not (key.isascii() and key.isdigit()) or len(key) > 19:
            shown = key if len(key) <= 40 else key[:37] + "..."
            raise APIError(400, f"logit_bias key {shown!r} is not a token id", param="logit_bias")
        tok = int(key)
        if not -100 <= value <= 100:
            raise APIError(400, f"logit_bias[{key}]={value} is outside [-100, 100]", param="logit_bias")
        bias[tok] = value
    if isinstance(req, ChatRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt_logprobs = None
    else:
        assert isinstance(req, CompletionRequest)
        logprobs = req.logprobs
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    fields: dict[str, Any] = {
        "temperature": req.temperature, "top_p": req.top_p, "top_k": max(0, req.top_k), "n": req.n,
        "seed": req.seed, "stop_strings": tuple(stops), "ignore_eos": req.ignore_eos,
        "min_new_tokens": req.min_tokens, "min_p": req.min_p,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty, "logit_bias": bias, "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs}
    if req.stop_token_ids:
        fields["stop"] = tuple(req.stop_token_ids)
    return fields


def finish_reason(reason: str | None) -> str | None:
    """A library finish reason as this server reports it (:data:`FINISH`)."""
    return None if reason is None else FINISH.get(reason, reason)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object, with ``prompt_tokens_details.cached_tokens``."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def new_id(prefix: str) -> str:
    """A response id: ``cmpl-...`` or ``chatcmpl-...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """``created``: seconds since the epoch."""
    return int(time.time())
