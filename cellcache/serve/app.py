"""The HTTP side of ``cellcache serve``: a FastAPI app with OpenAI's routes over an
:class:`~cellcache.serve.engine.Engine`.

::

    POST /v1/completions, /v1/chat/completions
      body -> protocol model (400) -> model name (404) -> admission (429 / 503)
      -> encode (thread pool) -> Sampling (400) -> engine.submit per prompt (gen.add; 400)
      -> stream: SSE chunks as the engine's events arrive; client gone: gen.cancel
         or not:  one JSON body once every request is done; client gone: gen.cancel
    GET /v1/models, /health (503 while draining), /metrics (Prometheus)

Every error body is OpenAI's ``{"error": {"message", "type", "param", "code"}}``, unknown
routes included.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, TypeGuard

import anyio
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..errors import InvalidArgument, InvalidState
from ..generate import Request, Sampling
from ..generate.text import decode, token_bytes
from .engine import Engine, Event, Refused, Stream
from .metrics import CONTENT_TYPE, Metrics
from .protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    ServeLimits,
    error_body,
    finish_reason,
    from_validation_error,
    max_new_tokens,
    new_id,
    now,
    sampling_fields,
    usage,
)

__all__ = ["build_app"]

#: What a log-probability that is not finite is reported as (JSON has no -inf).
LOGPROB_FLOOR = -9999.0


def _lp(x: float) -> float:
    return float(x) if math.isfinite(x) else LOGPROB_FLOOR


class EventStream(StreamingResponse):
    """An SSE response that notices a client going away while it waits for the next event
    (not only when a write fails) and then runs ``on_close`` (which cancels the requests)."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def wrap(func: Callable[[], Awaitable[None]]) -> None:
                    try:
                        await func()
                    except OSError:             # the client went away mid-write
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(wrap, partial(self.stream_response, send))
                await wrap(partial(self.listen_for_disconnect, receive))
        finally:
            self.on_close()


class _Choices:
    """What one HTTP request's choices hold while its engine requests run: per choice
    (prompt ``tag``, continuation ``k`` -> index ``tag * n + k``) the text sent, the tokens
    seen, how many of them were reported, whether its end was reported."""

    def __init__(self, streams: list[Stream], n: int):
        self.streams, self.n = streams, n
        total = len(streams) * n
        self.sent_text = [""] * total
        self.tokens: list[list[int]] = [[] for _ in range(total)]
        self.reported = [0] * total
        self.ended = [False] * total
        self.done = [False] * len(streams)
        self.error: str | None = None

    def record(self, ev: Event) -> None:
        """What ``ev`` says about the requests: done, failed, a token."""
        if ev.kind == "done":
            self.done[ev.tag] = True
        elif ev.kind == "error":
            self.error = ev.text
        elif ev.kind == "token":
            self.tokens[ev.tag * self.n + ev.k].append(ev.token)

    def request(self, tag: int) -> Request:
        req = self.streams[tag].request
        assert req is not None
        return req


class _Server:
    """The routes' shared state: the engine, the served name, the limits, the metrics."""

    def __init__(self, engine: Engine, model_name: str, limits: ServeLimits, metrics: Metrics):
        self.engine, self.model_name, self.limits, self.metrics = engine, model_name, limits, metrics
        self._pieces: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}
        self._token_bytes: tuple[Any, Callable[[int], bytes]] | None = None   # (tokenizer, its map)

    # -- tokens as text ------------------------------------------------------------------------------
    def piece(self, token: int) -> str:
        """A token alone as text: its own bytes (:meth:`piece_bytes`, so a SentencePiece
        token keeps its leading space and the pieces join to the text), or, for part of a
        character, the token decoded alone (U+FFFD); ``token_id:N`` without a tokenizer.
        Remembered."""
        s = self._pieces.get(token)
        if s is None:
            tok = self.engine.tokenizer
            if tok is None:
                s = f"token_id:{token}"
            else:
                try:
                    s = self.piece_bytes(token).decode("utf-8")
                except UnicodeDecodeError:
                    s = str(tok.decode([token]))
            if len(self._pieces) < 1 << 20:
                self._pieces[token] = s
        return s

    def piece_bytes(self, token: int) -> bytes:
        """A token's own bytes, maybe part of a character (:func:`token_bytes`; the UTF-8 of
        ``token_id:N`` without a tokenizer); remembered."""
        b = self._bytes.get(token)
        if b is None:
            tok = self.engine.tokenizer
            if tok is None:
                b = self.piece(token).encode("utf-8")
            else:
                if self._token_bytes is None or self._token_bytes[0] is not tok:
                    self._token_bytes = (tok, token_bytes(tok))
                b = self._token_bytes[1](token)
            if len(self._bytes) < 1 << 20:
                self._bytes[token] = b
        return b

    def decode(self, ids: list[int]) -> str:
        """Token ids as the library's texts have them (special tokens skipped); "" without a
        tokenizer."""
        tok = self.engine.tokenizer
        return "" if tok is None else decode(tok, ids)

    # -- requests in ---------------------------------------------------------------------------------
    async def parse(self, http: HTTPRequest, model: type[CompletionRequest] | type[ChatRequest]) -> Any:
        try:
            raw = await http.body()
        except ClientDisconnect:                 # gone mid-upload: nobody to answer, no server error
            raise APIError(499, "the client closed the connection before its body arrived",
                           code="client_closed_request") from None
        try:
            body = model.model_validate_json(raw)
        except ValidationError as e:
            raise from_validation_error(e) from None
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")
        return body

    async def submit(self, body: Any, prompts: list[str | list[int] | list[dict[str, str]]]
                     ) -> tuple[list[Stream], asyncio.Queue, list[list[int]]]:
        """Encodes ``prompts``, builds each one's Sampling and queues them all (or none)."""
        fields = sampling_fields(body)
        if len(prompts) > self.engine.max_waiting:     # never admitted: not worth a retry
            raise APIError(400, f"prompt holds {len(prompts)} prompts; this server takes at most "
                           f"{self.engine.max_waiting} at once (--max-waiting)", param="prompt")
        self.engine.check_admission(len(prompts))
        ids_list: list[list[int]] = []
        for p in prompts:
            try:
                ids = list(p) if _is_ids(p) else await self.engine.encode(p)  # type: ignore[arg-type]
            except Exception as e:          # the tokenizer or its chat template refused this input
                why = str(e) if isinstance(e, InvalidArgument) else f"{type(e).__name__}: {e}"
                raise APIError(400, why, param="messages" if isinstance(body, ChatRequest)
                               else "prompt") from None
            ids_list.append(ids)
        samplings = []
        for ids in ids_list:
            try:
                most = max_new_tokens(body, len(ids), self.limits)
                samplings.append(Sampling(max_new_tokens=most, **fields))
            except InvalidArgument as e:
                raise APIError(400, str(e)) from None
        queue: asyncio.Queue = asyncio.Queue()
        streams: list[Stream] = []
        try:
            for tag, (ids, sampling) in enumerate(zip(ids_list, samplings)):
                streams.append(await self.engine.submit(ids, sampling, queue, tag,
                                                        tokens=_wants_tokens(body)))
        except BaseException as e:
            for s in streams:
                self.engine.cancel(s)
            if isinstance(e, InvalidArgument):
                raise APIError(400, str(e)) from None
            raise
        return streams, queue, ids_list

    def cancel_all(self, streams: list[Stream]) -> None:
        for s in streams:
            self.engine.cancel(s)

    # -- events --------------------------------------------------------------------------------------
    async def events(self, choices: _Choices, queue: asyncio.Queue) -> AsyncIterator[Event]:
        """The events of ``choices``' requests until every one is done."""
        while not all(choices.done):
            ev: Event = await queue.get()
            choices.record(ev)
            yield ev

    def gone(self) -> Response:
        """The answer to a client that left before its result (nobody reads it), counted with
        the other error responses (a client gone mid-upload is too)."""
        self.metrics.errors.labels(status="499").inc()
        return Response(status_code=499)

    async def collect(self, http: HTTPRequest, choices: _Choices, queue: asyncio.Queue) -> bool:
        """Waits until every request is done; False (all cancelled) when the client left first."""
        async def drain() -> None:
            async for _ in self.events(choices, queue):
                pass

        async def gone() -> None:
            while True:
                message = await http.receive()
                if message["type"] == "http.disconnect":
                    return

        done = asyncio.ensure_future(drain())
        left = asyncio.ensure_future(gone())
        try:
            await asyncio.wait({done, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            if not done.done():
                done.cancel()
                self.cancel_all(choices.streams)
        return done.done() and not done.cancelled()

    # -- log-probabilities ---------------------------------------------------------------------------
    def chat_logprobs(self, entries: list[Any]) -> dict[str, Any]:
        def item(token: int, lp: float) -> dict[str, Any]:
            return {"token": self.piece(token), "logprob": _lp(lp), "bytes": list(self.piece_bytes(token))}
        return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]}
                            for e in entries]}

    def completion_logprobs(self, tokens: list[int], entries: list[Any], offset: int) -> dict[str, Any]:
        """The legacy format over ``tokens`` (``entries[i]`` their TokenLogprob, or None for
        the prompt's first token); ``offset``: the text length before the first of them."""
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                     "text_offset": []}
        for token, e in zip(tokens, entries):
            s = self.piece(token)
            out["tokens"].append(s)
            out["text_offset"].append(offset)
            offset += len(s)
            if e is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_lp(e.logprob))
            top = {self.piece(t): _lp(v) for t, v in e.top}
            top.setdefault(s, _lp(e.logprob))
            out["top_logprobs"].append(top)
        return out


def _end_offset(lp: dict[str, Any], offset: int) -> int:
    """The text offset after the tokens of :meth:`_Server.completion_logprobs`' answer
    ``lp`` (``offset`` when it holds none)."""
    return lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] else offset


def _wants_tokens(body: Any) -> bool:
    """Whether a stream sends token ids or log-probabilities (so needs each token's event)."""
    lp = body.logprobs if isinstance(body, ChatRequest) else body.logprobs is not None
    return bool(body.stream and (body.return_token_ids or lp))


def _is_ids(p: Any) -> TypeGuard[list[int]]:
    return isinstance(p, list) and all(isinstance(x, int) for x in p) and bool(p)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False)}\n\n"


def _usage_of(choices: _Choices, ids_list: list[list[int]]) -> dict[str, Any]:
    prompt = sum(len(ids) for ids in ids_list)
    completion = sum(len(t) for t in choices.tokens)
    cached = sum(choices.request(i).cached_tokens for i in range(len(choices.streams)))
    return usage(prompt, completion, cached)


def _final_outputs(choices: _Choices) -> None:
    """After the end: each choice's tokens as the request holds them (events may have been
    dropped for a request cancelled mid-step)."""
    for tag in range(len(choices.streams)):
        req = choices.request(tag)
        for k in range(choices.n):
            choices.tokens[tag * choices.n + k] = list(req.outputs[k])


def build_app(engine: Engine, *, model_name: str, limits: ServeLimits, metrics: Metrics | None = None,
              drain_timeout: float = 30.0, enable_sleep: bool = False) -> FastAPI:
    """The FastAPI app serving ``engine`` under ``model_name``. Its lifespan starts the
    engine thread and, at shutdown, drains (``drain_timeout`` seconds) and stops it.

    ``enable_sleep`` adds ``POST /sleep?level=1|2`` (``&keep_prefixes=true``: the prefix
    cache moves to its host level), ``POST /wake_up`` and ``GET /is_sleeping``
    (``Generator.sleep``: an RL trainer takes the GPU between rollouts);
    off, they are 404, since any client could otherwise stop the server serving. A sleep
    while requests are queued or running is 409; asleep, new requests are 503."""
    metrics = metrics or Metrics(engine)
    engine.on_done = metrics.observe
    srv = _Server(engine, model_name, limits, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        watch = asyncio.get_running_loop().create_task(metrics.watch_loop())
        try:
            yield
        finally:
            watch.cancel()
            await engine.drain(drain_timeout)
            await anyio.to_thread.run_sync(engine.stop)

    app = FastAPI(title="cellcache", lifespan=lifespan)
    app.state.server = srv
    app.state.metrics = metrics

    def error_response(status: int, body: dict[str, Any],
                       headers: dict[str, str] | None = None) -> JSONResponse:
        metrics.errors.labels(status=str(status)).inc()
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(_: HTTPRequest, e: APIError) -> JSONResponse:
        return error_response(e.status, e.body(), e.headers)

    @app.exception_handler(Refused)
    async def refused(_: HTTPRequest, e: Refused) -> JSONResponse:
        code, kind = ("rate_limit_exceeded", "requests") if e.status == 429 else \
            ("service_unavailable", "server_error")
        return error_response(e.status, error_body(e.message, kind, None, code),
                              {"Retry-After": str(e.retry_after)})

    @app.exception_handler(InvalidArgument)
    async def invalid(_: HTTPRequest, e: InvalidArgument) -> JSONResponse:
        return error_response(400, error_body(str(e)))

    @app.exception_handler(HTTPException)
    async def http_error(_: HTTPRequest, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, error_body(str(e.detail), kind), getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal(_: HTTPRequest, e: Exception) -> JSONResponse:
        return error_response(500, error_body(f"{type(e).__name__}: {e}", "server_error"))

    @app.api_route("/health", methods=["GET", "HEAD"])   # (HEAD: what some load balancers probe)
    async def health() -> JSONResponse:
        if engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": "1"})
        if engine.failed is not None:
            return JSONResponse({"status": "failed", "error": str(engine.failed)}, status_code=500)
        if not engine.alive:                            # nothing steps: every request would hang
            return JSONResponse({"status": "failed", "error": "the engine thread is not running"},
                                status_code=500)
        if engine.asleep:                               # healthy; requests wait for POST /wake_up
            return JSONResponse({"status": "asleep", "level": engine.asleep})
        return JSONResponse({"status": "ok"})

    if enable_sleep:
        @app.post("/sleep")
        async def sleep(http: HTTPRequest) -> JSONResponse:
            text = http.query_params.get("level", "1")
            try:
                level = int(text)
            except ValueError:
                return error_response(400, error_body(f"level {text!r} is not 1 or 2", param="level"))
            keep = http.query_params.get("keep_prefixes", "false").lower()
            if keep not in ("true", "false", "1", "0"):
                return error_response(400, error_body(f"keep_prefixes {keep!r} is not true or false",
                                                      param="keep_prefixes"))
            try:
                got = await engine.sleep(level, keep_prefixes=keep in ("true", "1"))
            except InvalidArgument as e:
                return error_response(400, error_body(
                    str(e), param="keep_prefixes" if "keep_prefixes" in str(e) else "level"))
            except InvalidState as e:
                return error_response(409, error_body(str(e), "invalid_request_error", None, "conflict"))
            return JSONResponse({"is_sleeping": True, "level": got})

        @app.post("/wake_up")
        async def wake_up() -> JSONResponse:
            await engine.wake()
            return JSONResponse({"is_sleeping": False, "level": 0})

        @app.get("/is_sleeping")
        async def is_sleeping() -> JSONResponse:
            return JSONResponse({"is_sleeping": bool(engine.asleep), "level": engine.asleep})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": now(), "owned_by": "cellcache",
                "max_model_len": limits.max_positions or limits.capacity}

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str) -> JSONResponse:
        if name != model_name:
            raise APIError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")
        return JSONResponse(model_card())

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest) -> Response:
        t0 = time.perf_counter()
        body: CompletionRequest = await srv.parse(http, CompletionRequest)
        prompts = body.prompts()
        streams, queue, ids_list = await srv.submit(body, list(prompts))
        choices = _Choices(streams, body.n)
        rid, created = new_id("cmpl"), now()
        # (decoded on the loop only for echo: a long token-id prompt's decode delays every stream)
        prompt_texts = [p if isinstance(p, str) else srv.decode(ids) if body.echo else ""
                        for p, ids in zip(prompts, ids_list)]
        if body.stream:
            chunks = _completion_chunks(srv, body, choices, queue, ids_list, prompt_texts, rid, created, t0)
            return EventStream(chunks, partial(srv.cancel_all, streams))
        if not await srv.collect(http, choices, queue):
            return srv.gone()
        _final_outputs(choices)
        if choices.error is not None:
            raise APIError(500, choices.error, type="server_error")
        out = []
        for tag, ids in enumerate(ids_list):
            req = choices.request(tag)
            for k in range(body.n):
                i = tag * body.n + k
                text = req.texts[k]
                toks = choices.tokens[i]
                item: dict[str, Any] = {"index": i, "text": prompt_texts[tag] + text if body.echo else text,
                                        "logprobs": None,
                                        "finish_reason": finish_reason(req.finish_reasons[k])}
                if body.logprobs is not None:
                    lps = list(req.logprobs[k]) if req.logprobs is not None else []
                    if body.echo:
                        plp = list(req.prompt_logprobs or [None] * len(ids))
                        item["logprobs"] = srv.completion_logprobs(ids + toks, plp + lps, 0)
                    else:
                        item["logprobs"] = srv.completion_logprobs(toks, lps, 0)
                if body.return_token_ids:
                    item["token_ids"] = toks
                out.append(item)
        resp: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created,
                                "model": model_name, "choices": out, "usage": _usage_of(choices, ids_list)}
        if body.return_token_ids:
            resp["prompt_token_ids"] = ids_list if len(ids_list) > 1 else ids_list[0]
        return JSONResponse(resp)

    @app.post("/v1/chat/completions")
    async def chat(http: HTTPRequest) -> Response:
        t0 = time.perf_counter()
        body: ChatRequest = await srv.parse(http, ChatRequest)
        messages = [m.as_dict() for m in body.messages]
        streams, queue, ids_list = await srv.submit(body, [messages])
        choices = _Choices(streams, body.n)
        rid, created = new_id("chatcmpl"), now()
        if body.stream:
            chunks = _chat_chunks(srv, body, choices, queue, ids_list, rid, created, t0)
            return EventStream(chunks, partial(srv.cancel_all, streams))
        if not await srv.collect(http, choices, queue):
            return srv.gone()
        _final_outputs(choices)
        if choices.error is not None:
            raise APIError(500, choices.error, type="server_error")
        req = choices.request(0)
        out = []
        for k in range(body.n):
            item: dict[str, Any] = {"index": k, "message": {"role": "assistant", "content": req.texts[k]},
                                    "logprobs": None, "finish_reason": finish_reason(req.finish_reasons[k])}
            if body.logprobs:
                item["logprobs"] = srv.chat_logprobs(list(req.logprobs[k]) if req.logprobs else [])
            if body.return_token_ids:
                item["token_ids"] = choices.tokens[k]
            out.append(item)
        resp = {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": out, "usage": _usage_of(choices, ids_list)}
        if body.return_token_ids:
            resp["prompt_token_ids"] = ids_list[0]
        return JSONResponse(resp)

    return app


def _pending(srv: _Server, choices: _Choices, tag: int, k: int) -> tuple[list[int], list[Any]]:
    """The tokens of choice (tag, k) seen and not reported yet, with their TokenLogprobs when
    the request has them; marks them reported."""
    i = tag * choices.n + k
    start, toks = choices.reported[i], choices.tokens[i]
    choices.reported[i] = len(toks)
    req = choices.request(tag)
    lps = list(req.logprobs[k][start:len(toks)]) if req.logprobs is not None else []
    return toks[start:], lps


async def _stream_events(srv: _Server, choices: _Choices, queue: asyncio.Queue, t0: float = 0.0,
                         ) -> AsyncIterator[tuple[int, int, str, str | None]]:
    """``(tag, k, text delta, finish reason or None)`` for the text a choice gets and once
    for its end (the request's own text past what was sent fills any gap). Every event
    already queued is taken at once and a choice's deltas among them are joined: a client
    (or a loop) that falls behind gets fewer, larger chunks instead of a growing backlog.
    Without a tokenizer each step's tokens make a chunk (empty text; their ids with
    ``return_token_ids``). ``t0``: when the request came (``time.perf_counter()``); the
    first chunk's delay from it goes to the server's HTTP TTFT histogram."""
    n = choices.n
    untexted = srv.engine.tokenizer is None
    first = t0 > 0
    try:
        while not all(choices.done):
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            texts: dict[int, list[Any]] = {}          # choice -> [tag, k, text, finish]
            ended: list[int] = []
            for ev in batch:
                choices.record(ev)
                if ev.kind == "token" and untexted:       # a chunk for its token ids alone
                    texts.setdefault(ev.tag * n + ev.k, [ev.tag, ev.k, "", None])
                elif ev.kind == "text":
                    i = ev.tag * n + ev.k
                    if choices.ended[i]:
                        continue
                    entry = texts.setdefault(i, [ev.tag, ev.k, "", None])
                    entry[2] += ev.text
                    choices.sent_text[i] += ev.text
                    if ev.finish is not None:
                        entry[3] = finish_reason(ev.finish)
                        choices.ended[i] = True
                elif ev.kind == "done":
                    ended.append(ev.tag)
            if first and texts:
                first = False
                srv.metrics.http_ttft.observe(time.perf_counter() - t0)
            for tag, k, text, finish in texts.values():
                yield tag, k, text, finish
            for tag in ended:
                req = choices.request(tag)
                for k in range(n):
                    i = tag * n + k
                    if choices.ended[i]:
                        continue
                    choices.ended[i] = True
                    whole = req.texts[k] if req.texts else ""
                    sent = choices.sent_text[i]
                    rest = whole[len(sent):] if whole.startswith(sent) else ""
                    choices.sent_text[i] += rest
                    yield tag, k, rest, finish_reason(req.finish_reasons[k] or "cancelled")
    finally:
        if not all(choices.done):
            srv.cancel_all(choices.streams)


async def _completion_chunks(srv: _Server, body: CompletionRequest, choices: _Choices, queue: asyncio.Queue,
                             ids_list: list[list[int]], prompt_texts: list[str], rid: str,
                             created: int, t0: float) -> AsyncIterator[str]:
    n = body.n
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    head = {"id": rid, "object": "text_completion", "created": created, "model": srv.model_name}
    extra = {"usage": None} if include_usage else {}
    offsets = [0] * (len(ids_list) * n)
    echoed = [not body.echo] * len(ids_list)
    async for tag, k, delta, finish in _stream_events(srv, choices, queue, t0):
        i = tag * n + k
        if choices.error is not None:
            break
        if not echoed[tag]:               # the prompt first, once its log-probabilities exist
            echoed[tag] = True
            ids = ids_list[tag]
            for kk in range(n):
                lp = None
                if body.logprobs is not None:
                    plp = list(choices.request(tag).prompt_logprobs or [None] * len(ids))
                    lp = srv.completion_logprobs(ids, plp, 0)
                    # the output's offsets go on from the prompt's tokens, as in a whole answer
                    offsets[tag * n + kk] = _end_offset(lp, 0)
                yield _sse({**head, "choices": [{"index": tag * n + kk, "text": prompt_texts[tag],
                                                 "logprobs": lp, "finish_reason": None}], **extra})
        toks, lps = _pending(srv, choices, tag, k)
        if not delta and not finish and not toks:
            continue
        item: dict[str, Any] = {"index": i, "text": delta, "logprobs": None, "finish_reason": finish}
        if body.logprobs is not None:
            item["logprobs"] = lp = srv.completion_logprobs(toks, lps, offsets[i])
            offsets[i] = _end_offset(lp, offsets[i])     # (by the tokens' text, not the text sent)
        if body.return_token_ids:
            item["token_ids"] = toks
        yield _sse({**head, "choices": [item], **extra})
    for line in _stream_end(choices, head, ids_list, include_usage):
        yield line


def _stream_end(choices: _Choices, head: dict[str, Any], ids_list: list[list[int]],
                include_usage: bool) -> Iterator[str]:
    """A stream's last events: the error that ended it, or the usage chunk when asked for;
    then ``[DONE]``."""
    if choices.error is not None:
        yield _sse(error_body(choices.error, "server_error"))
    elif include_usage:
        _final_outputs(choices)
        yield _sse({**head, "choices": [], "usage": _usage_of(choices, ids_list)})
    yield "data: [DONE]\n\n"


async def _chat_chunks(srv: _Server, body: ChatRequest, choices: _Choices, queue: asyncio.Queue,
                       ids_list: list[list[int]], rid: str, created: int, t0: float) -> AsyncIterator[str]:
    n = body.n
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": srv.model_name}
    extra = {"usage": None} if include_usage else {}
    for k in range(n):
        yield _sse({**head, "choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}], **extra})
    async for _, k, delta, finish in _stream_events(srv, choices, queue, t0):
        if choices.error is not None:
            break
        toks, lps = _pending(srv, choices, 0, k)
        if not delta and not finish and not toks:
            continue
        item: dict[str, Any] = {"index": k, "delta": {"content": delta} if delta else {},
                                "logprobs": srv.chat_logprobs(lps) if body.logprobs else None,
                                "finish_reason": finish}
        if body.return_token_ids:
            item["token_ids"] = toks
        yield _sse({**head, "choices": [item], **extra})
    for line in _stream_end(choices, head, ids_list, include_usage):
        yield line
