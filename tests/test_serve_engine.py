"""The server's app in this process (httpx's ASGI transport, the engine thread started by
hand): a model without a tokenizer serves token ids and refuses text; a generator whose
steps keep failing fails its requests (500, an error event on a stream, /health 500) instead
of retrying forever or taking the process down."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from cellcache.generate import Generator, Sampling, random_model
from cellcache.serve.app import build_app
from cellcache.serve.engine import MAX_FAILED_STEPS, Engine
from cellcache.serve.protocol import ServeLimits
from tests.helpers_serve import wait_until


@pytest.fixture
def served():
    """(app, engine) over a tiny random model without a tokenizer; the engine stopped after."""
    gen = Generator(random_model("llama-tiny"), capacity=1024, eos=[])
    engine = Engine(gen, max_waiting=8)
    app = build_app(engine, model_name="tiny", limits=ServeLimits(capacity=1024, default_max_tokens=8))
    engine.start()
    yield app, engine
    engine.stop(5)


def post(app, path: str, body: dict) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, json=body, timeout=60)
    return asyncio.run(go())


def get(app, path: str, method: str = "GET") -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, path, timeout=60)
    return asyncio.run(go())


def events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.text.split("\n\n") if line.strip()]


def test_without_a_tokenizer_token_ids_are_served_and_text_refused(served):
    app, engine = served
    r = post(app, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0,
                                      "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "" and len(choice["token_ids"]) == 4 and choice["finish_reason"] == "length"
    s = post(app, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "stream": True,
                                      "return_token_ids": True})
    chunks = [json.loads(e) for e in events(s)[:-1]]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    assert events(s)[-1] == "[DONE]"
    for body, param in [({"prompt": "text"}, "prompt"),
                        ({"prompt": [5], "stop": ["x"]}, None)]:
        r = post(app, "/v1/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert engine.live == 0 and engine.waiting == 0


def test_a_generator_that_keeps_failing_fails_its_requests(served, monkeypatch):
    app, engine = served
    calls = []

    def broken() -> bool:
        calls.append(1)
        raise RuntimeError("the forward broke")

    monkeypatch.setattr(engine.gen, "step", broken)
    r = post(app, "/v1/completions", {"prompt": [5, 6], "max_tokens": 4})
    assert r.status_code == 500 and "the forward broke" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "server_error"
    assert len(calls) >= MAX_FAILED_STEPS
    s = post(app, "/v1/completions", {"prompt": [5, 6], "max_tokens": 4, "stream": True})
    got = events(s)
    assert got[-1] == "[DONE]" and "the forward broke" in json.loads(got[-2])["error"]["message"]
    h = get(app, "/health")
    assert h.status_code == 500 and h.json()["status"] == "failed"
    assert engine.live == 0 and engine.waiting == 0
    # once steps produce tokens again the engine is healthy again (a load balancer that
    # took it out of rotation takes it back)
    monkeypatch.undo()
    assert get(app, "/health").status_code == 500                 # nothing has stepped yet
    r = post(app, "/v1/completions", {"prompt": [5, 6], "max_tokens": 4})
    assert r.status_code == 200, r.text
    h = get(app, "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok", h.text


def test_scoring_requests_alone_make_a_failed_engine_healthy_again(served, monkeypatch):
    """After the steps that failed every request, a server that scores prompts alone
    (``max_tokens: 0`` with ``echo``, lm-eval-harness's loglikelihood requests) draws no
    token, yet its steps run: /health says ok again (it said "failed" until a token was
    drawn, and a load balancer kept it out of rotation while it served)."""
    app, engine = served

    def broken() -> bool:
        raise RuntimeError("the forward broke")

    monkeypatch.setattr(engine.gen, "step", broken)
    assert post(app, "/v1/completions", {"prompt": [5, 6], "max_tokens": 4}).status_code == 500
    assert get(app, "/health").status_code == 500
    monkeypatch.undo()
    out = engine.gen.stats["tokens_out"]
    r = post(app, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 0, "echo": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length" and engine.gen.stats["tokens_out"] == out
    h = get(app, "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok", h.text
    assert engine.failed is None and engine.live == 0 and engine.waiting == 0


BAD_BODIES = [b"", b"[]", b"null", b"\xff\xfe", b'{"prompt": null}', b'{"prompt": [[]]}',
              b'{"prompt": [1], "n": 1000000000000000000000000000000}',
              b'{"prompt": [1], "max_tokens": 1e309}',
              b'{"prompt": [1], "seed": 9223372036854775808}', b'{"prompt": [1], "logit_bias": {"1": 1e308}}',
              b'{"prompt": [1], "stop": [1]}', b'{"prompt": [1], "temperature": Infinity}',
              b'{"prompt": [1], "stream_options": {"include_usage": true}}', b'{"prompt": [-1]}',
              b'{"prompt": [1], "max_tokens": 5000}', b'{"prompt": [1], "best_of": 2}',
              b'{"prompt": [1], "top_k": -2}', b'{"prompt": [1], "logprobs": true}']


@pytest.mark.parametrize("body", BAD_BODIES, ids=[b.decode("latin-1")[:40] for b in BAD_BODIES])
def test_a_bad_body_is_a_400_and_queues_nothing(served, body):
    app, engine = served
    steps = engine.gen.stats["steps"]

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    r = asyncio.run(go())
    assert r.status_code == 400, (body, r.text)
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert engine.live == 0 and engine.waiting == 0 and engine.gen.stats["steps"] == steps
    assert not engine.gen.busy


def post_within(app, path: str, body: dict, seconds: float = 30.0) -> httpx.Response:
    """``post``, failing (instead of hanging the suite) when no answer comes in ``seconds``."""
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await asyncio.wait_for(c.post(path, json=body, timeout=seconds), seconds)
    return asyncio.run(go())


def test_a_failure_in_the_engines_own_work_fails_the_requests_not_the_thread(served, monkeypatch):
    app, engine = served

    def broken_step() -> bool:
        raise RuntimeError("the forward broke")

    def broken_cancel(req) -> bool:
        raise RuntimeError("the cache is broken too")

    monkeypatch.setattr(engine.gen, "step", broken_step)
    monkeypatch.setattr(engine.gen, "cancel", broken_cancel)
    r = post_within(app, "/v1/completions", {"prompt": [5, 6], "max_tokens": 4})
    assert r.status_code == 500 and "the forward broke" in r.json()["error"]["message"]
    assert engine.live == 0 and engine.waiting == 0
    # the engine thread still serves: a bookkeeping failure outside the step fails the
    # requests it holds and goes on
    monkeypatch.undo()
    real_refresh = engine._refresh
    calls = []

    def refresh_once_broken() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("a snapshot failed")
        real_refresh()

    monkeypatch.setattr(engine, "_refresh", refresh_once_broken)
    first = post_within(app, "/v1/completions", {"prompt": [5, 6], "max_tokens": 4})
    assert first.status_code in (200, 500), first.text
    again = post_within(app, "/v1/completions", {"prompt": [5, 6], "max_tokens": 4})
    assert again.status_code == 200, again.text
    assert engine.live == 0 and engine.waiting == 0


def test_health_is_500_when_the_engine_thread_is_gone(served, monkeypatch):
    app, engine = served
    ok = get(app, "/health", "HEAD")
    assert ok.status_code == 200 and ok.content == b""
    engine.stop(5)                                     # the thread ends; nothing steps any more
    h = get(app, "/health")
    assert h.status_code == 500 and h.json()["status"] == "failed"
    assert get(app, "/health", "HEAD").status_code == 500
    # a request now would wait forever: refused instead, with nothing queued
    r = post_within(app, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
    assert r.status_code == 503 and "retry-after" in r.headers, r.text
    assert engine.live == 0 and engine.waiting == 0 and not engine.gen.busy


def test_a_batch_larger_than_the_waiting_bound_is_a_400_not_a_429(served):
    app, engine = served
    r = post(app, "/v1/completions", {"prompt": [[5]] * (engine.max_waiting + 1), "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt" and "retry-after" not in r.headers
    ok = post(app, "/v1/completions", {"prompt": [[5]] * engine.max_waiting, "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == engine.max_waiting
    assert engine.live == 0 and engine.waiting == 0


def test_the_snapshot_is_never_older_than_an_event_delivered(served, monkeypatch):
    """/metrics and /health read the snapshot: a client that saw a token must find that
    token's step in it (the engine refreshes it before handing the events over)."""
    app, engine = served
    real_refresh = engine._refresh

    def slow_refresh() -> None:                        # widens the window a late refresh leaves
        time.sleep(0.05)
        real_refresh()

    monkeypatch.setattr(engine, "_refresh", slow_refresh)
    seen: list[tuple[int, int]] = []

    class Watched(asyncio.Queue):
        def put_nowait(self, ev) -> None:
            if ev.kind == "token":
                seen.append((len(seen) + 1, engine.snapshot["stats"]["tokens_out"]))
            super().put_nowait(ev)

    async def go() -> None:
        q = Watched()
        await engine.submit([5, 6, 7], Sampling(max_new_tokens=4), q, tokens=True)
        while True:
            if (await q.get()).kind == "done":
                return

    asyncio.run(asyncio.wait_for(go(), 60))
    assert len(seen) == 4
    assert all(out >= tokens for tokens, out in seen), seen


def test_a_token_id_prompt_is_decoded_only_for_echo(served, monkeypatch):
    """Decoding runs on the event loop: a request that does not echo its prompt never pays
    for it (nor fails by it)."""
    app, engine = served

    def no_decode(ids):
        raise AssertionError("the prompt was decoded")

    monkeypatch.setattr(app.state.server, "decode", no_decode)
    for stream in (False, True):
        r = post(app, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "stream": stream})
        assert r.status_code == 200 and "the prompt was decoded" not in r.text, r.text
    assert engine.live == 0 and engine.waiting == 0


@pytest.mark.parametrize("upload", ["cut", "whole"])
def test_a_client_gone_while_its_body_is_read_is_no_server_error(served, upload):
    """A client that leaves mid-upload, or after it while its answer is made, is answered 499
    (nobody reads it), counted as a 499, not as a 500 (a server error an operator would be
    paged for), and leaves nothing queued."""
    app, engine = served
    sent: list[dict] = []
    body = b'{"prompt": [5' if upload == "cut" else b'{"prompt": [5, 6], "max_tokens": 200}'

    async def go() -> None:
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions",
                 "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
                 "server": ("t", 80)}
        messages = [{"type": "http.request", "body": body, "more_body": upload == "cut"},
                    {"type": "http.disconnect"}]

        async def receive() -> dict:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        await app(scope, receive, send)

    asyncio.run(go())
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 499
    text = get(app, "/metrics").text
    assert 'cellcache_http_errors_total{status="500"}' not in text
    assert 'cellcache_http_errors_total{status="499"} 1.0' in text
    wait_until(lambda: engine.live == 0 and engine.waiting == 0 and not engine.gen.busy, 10)


def test_nothing_of_a_request_outlives_it(served):
    """A long-running server's memory stays flat: once requests end (whole, streamed,
    cancelled before or while running), no stream, request or queued event of theirs is
    left in the engine or the generator."""
    import gc

    from cellcache.generate import Request
    from cellcache.serve.engine import Stream

    app, engine = served
    # what other tests (in this process) still hold is theirs: held here, so that their ids
    # stay theirs, and left out of the count
    gc.collect()
    theirs = [o for o in gc.get_objects() if type(o) in (Stream, Request)]
    their_ids = {id(o) for o in theirs}
    for _ in range(2):
        assert post(app, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2}).status_code == 200
        s = post(app, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "stream": True, "n": 2})
        assert events(s)[-1] == "[DONE]"

        async def cancelled() -> None:
            q: asyncio.Queue = asyncio.Queue()
            early = await engine.submit([5, 6, 7], Sampling(max_new_tokens=8), q, tag=0, tokens=True)
            engine.cancel(early)                          # before (or as) it runs
            later = await engine.submit([5, 6, 7], Sampling(max_new_tokens=8), q, tag=1, tokens=True)
            while (await q.get()).kind != "token":        # it runs
                pass
            engine.cancel(later)
            done = 0
            while done < 2:
                done += (await q.get()).kind == "done"

        asyncio.run(asyncio.wait_for(cancelled(), 60))
    assert engine.live == 0 and engine.waiting == 0 and not engine.gen.busy

    def left() -> list:
        gc.collect()
        return [o for o in gc.get_objects() if type(o) in (Stream, Request) and id(o) not in their_ids]

    # (the engine thread may still hold the last hand-over's list for a moment: a leak is
    # what stays)
    try:
        wait_until(lambda: not left(), timeout=20, what="every stream and request let go")
    except AssertionError:
        held = [(type(o).__name__, sorted({type(r).__name__ for r in gc.get_referrers(o)}))
                for o in left()[:5]]
        raise AssertionError(f"still held (object, its referrers' types): {held}") from None
    del theirs
    assert engine._outbox == []


class _Loop:
    """What the engine hands over to: each call_soon_threadsafe's batch, recorded."""

    def __init__(self):
        self.batches: list[list] = []

    def call_soon_threadsafe(self, fn, batch):
        self.batches.append([(s.tag, e.kind, e.token) for s, e in batch])


def test_stream_interval_holds_a_streams_tokens_back_but_never_its_first_or_its_end():
    from cellcache.serve.engine import Event, Stream

    gen = Generator(random_model("llama-tiny"), capacity=256, eos=[])
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="stream_interval"):
            Engine(gen, stream_interval=bad)
    engine = Engine(gen, stream_interval=3)
    loop = _Loop()
    a, b = Stream(loop, None, 0), Stream(loop, None, 1)        # type: ignore[arg-type]

    def hand(*events):
        engine._outbox.extend(events)
        engine._hand_over()
        return loop.batches.pop() if loop.batches else []

    tok = lambda s, t: (s, Event("token", s.tag, token=t))
    assert hand(tok(a, 1)) == [(0, "token", 1)]                 # a's first: at once
    assert hand(tok(a, 2), tok(b, 7)) == [(1, "token", 7)]      # a holds 2; b's first goes
    assert hand(tok(a, 3)) == []
    assert hand(tok(a, 4), tok(b, 8)) == [(0, "token", 2), (0, "token", 3), (0, "token", 4)]
    assert hand(tok(a, 5), (b, Event("done", 1))) == [(1, "token", 8), (1, "done", 0)]
    assert hand((a, Event("error", 0, text="x")), (a, Event("done", 0))) == [
        (0, "token", 5), (0, "error", 0), (0, "done", 0)]
    assert not a.held and not b.held and a.held_tokens == 0
    every = Engine(gen)                                          # the default: every step's
    every._outbox.extend([tok(a, 9), tok(a, 10)])
    every._hand_over()
    assert loop.batches.pop() == [(0, "token", 9), (0, "token", 10)]


def test_a_server_with_a_stream_interval_sends_the_same_tokens_in_fewer_chunks():
    gen = Generator(random_model("llama-tiny"), capacity=1024, eos=[])
    engine = Engine(gen, max_waiting=8, stream_interval=4)
    app = build_app(engine, model_name="tiny", limits=ServeLimits(capacity=1024, default_max_tokens=8))
    engine.start()
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 13, "temperature": 0, "return_token_ids": True}
        whole = post(app, "/v1/completions", body).json()["choices"][0]["token_ids"]
        s = post(app, "/v1/completions", {**body, "stream": True})
        chunks = [json.loads(e) for e in events(s)[:-1]]
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole and len(whole) == 13
        # the first token, then every 4, then the end: at most 5 chunks (the loop may join
        # what it finds queued together, never split it)
        assert len(chunks) <= 1 + 3 + 1
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        engine.stop(5)


def sleepy(gen=None, **kw):
    """(app, engine) serving with the sleep endpoints on (engine started; stop it after)."""
    gen = gen or Generator(random_model("llama-tiny"), capacity=1024, eos=[])
    engine = Engine(gen, max_waiting=8)
    app = build_app(engine, model_name="tiny", limits=ServeLimits(capacity=1024, default_max_tokens=8),
                    **kw)
    engine.start()
    return app, engine


def test_the_sleep_endpoints_are_404_unless_enabled(served):
    app, engine = served
    for path in ("/sleep", "/wake_up"):
        assert post(app, path, {}).status_code == 404
    assert get(app, "/is_sleeping").status_code == 404
    assert engine.gen.asleep == 0


def test_sleep_and_wake_over_http_serve_the_same_tokens_and_refuse_meanwhile():
    app, engine = sleepy(enable_sleep=True)
    try:
        body = {"model": "tiny", "prompt": [5, 9, 33, 2], "max_tokens": 6, "temperature": 0}
        first = post(app, "/v1/completions", body)
        assert first.status_code == 200
        r = post(app, "/sleep?level=1", {})
        assert r.status_code == 200 and r.json() == {"is_sleeping": True, "level": 1}
        assert engine.gen.asleep == 1 and engine.gen.cache.asleep
        assert get(app, "/is_sleeping").json() == {"is_sleeping": True, "level": 1}
        assert get(app, "/health").json() == {"status": "asleep", "level": 1}
        r = post(app, "/v1/completions", body)
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "asleep" in r.text
        assert engine.gen.waiting == [] and engine.live == 0           # nothing queued
        r = post(app, "/sleep?level=2", {})
        assert r.status_code == 409 and "asleep at level 1" in r.json()["error"]["message"]
        assert post(app, "/sleep?level=1", {}).status_code == 200       # again: nothing happens
        r = post(app, "/wake_up", {})
        assert r.status_code == 200 and r.json() == {"is_sleeping": False, "level": 0}
        assert get(app, "/health").json() == {"status": "ok"}
        again = post(app, "/v1/completions", body)
        assert again.status_code == 200
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        for bad in ("/sleep?level=3", "/sleep?level=0", "/sleep?level=x"):
            r = post(app, bad, {})
            assert r.status_code == 400 and "level" in r.json()["error"]["message"], bad
        assert engine.gen.asleep == 0
    finally:
        engine.stop(5)


def test_a_sleep_over_http_can_keep_the_prefixes_in_the_host_level():
    app, engine = sleepy(enable_sleep=True)                  # no host level: refused
    try:
        r = post(app, "/sleep?level=1&keep_prefixes=true", {})
        assert r.status_code == 400 and "spill_prefixes=True" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "keep_prefixes" and engine.gen.asleep == 0
        r = post(app, "/sleep?level=1&keep_prefixes=maybe", {})
        assert r.status_code == 400 and engine.gen.asleep == 0
        assert r.json()["error"]["param"] == "keep_prefixes"
    finally:
        engine.stop(5)
    gen = Generator(random_model("llama-tiny"), capacity=1024, eos=[], spill_bytes=1 << 28,
                    spill_prefixes=True)
    app, engine = sleepy(gen, enable_sleep=True)
    try:
        body = {"model": "tiny", "prompt": list(range(3, 60)), "max_tokens": 6, "temperature": 0,
                "logprobs": 0}

        def ids(r):                 # (a model without a tokenizer: the ids are in the logprobs)
            return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]

        first = post(app, "/v1/completions", body)
        assert first.status_code == 200
        r = post(app, "/sleep?level=1&keep_prefixes=true", {})
        assert r.status_code == 200 and engine.gen.asleep == 1
        assert len(gen.scheduler.kv.l2) > 0 and gen.prefix.metrics()["cached_tokens"] == 0
        assert post(app, "/wake_up", {}).status_code == 200
        # the conversation's next turn (its history, the reply, a new message) finds it
        turn = dict(body, prompt=body["prompt"] + ids(first) + [7, 8])
        alone = Generator(random_model("llama-tiny"), capacity=1024, eos=[])
        ref = alone.add(turn["prompt"], Sampling(max_new_tokens=6))
        alone.run()
        again = post(app, "/v1/completions", turn)
        assert ids(again) == ref.outputs[0]
        assert gen.stats["l2_found"] == 1 and gen.stats["restored_tokens"] > 0
    finally:
        engine.stop(5)


def test_a_sleep_while_a_request_runs_is_409_and_the_request_finishes(monkeypatch):
    import threading

    gen = Generator(random_model("llama-tiny"), capacity=1024, eos=[])
    gate, entered = threading.Event(), threading.Event()
    real_step = gen.step

    def step():                     # the first step waits until the /sleep is queued
        if not gate.is_set():
            entered.set()
            gate.wait(30)
        return real_step()

    monkeypatch.setattr(gen, "step", step)
    app, engine = sleepy(gen, enable_sleep=True)
    try:
        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                job = asyncio.create_task(c.post("/v1/completions", json={
                    "model": "tiny", "prompt": [1, 2, 3], "max_tokens": 40, "temperature": 0}, timeout=60))
                while not entered.is_set():
                    await asyncio.sleep(0.01)
                nap = asyncio.create_task(c.post("/sleep?level=1", timeout=60))
                while not engine._controls:                # queued behind the step
                    await asyncio.sleep(0.01)
                gate.set()
                return await job, await nap

        done, refused = asyncio.run(go())
        assert refused.status_code == 409 and "queued or running" in refused.json()["error"]["message"]
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 40
        assert engine.gen.asleep == 0
    finally:
        gate.set()
        engine.stop(5)


def test_a_control_whose_caller_went_away_is_not_run_and_fails_nothing():
    import concurrent.futures

    gen = Generator(random_model("llama-tiny"), capacity=1024, eos=[])
    engine = Engine(gen, max_waiting=8)
    ran = []
    gone: concurrent.futures.Future = concurrent.futures.Future()
    gone.cancel()
    kept: concurrent.futures.Future = concurrent.futures.Future()
    engine._controls = [(lambda: ran.append("gone"), gone), (lambda: ran.append("kept") or 7, kept)]
    engine._run_controls()
    assert ran == ["kept"] and kept.result() == 7 and engine.failed is None
    with pytest.raises(Exception, match="not running"):
        engine._control(lambda: None)                 # not started: refused, nothing queued
    assert engine._controls == []


def test_a_cancel_on_another_thread_ends_its_stream_after_its_last_text(monkeypatch):
    """A cancel from the loop's thread marks the request done, then makes its last
    ``on_text`` (the finish reason, and any text held back): an engine-thread sweep that
    falls between the two must not end the stream first (its last delta would be lost)."""
    pytest.importorskip("tokenizers")
    from cellcache.serve.engine import Stream
    from tests.helpers_text import make_tokenizer

    gen = Generator(random_model("llama-tiny"), capacity=256, eos=[], tokenizer=make_tokenizer())
    engine = Engine(gen)
    delivered: list = []

    class Loop:
        def call_soon_threadsafe(self, fn, batch):
            delivered.extend((e.kind, e.finish) for _, e in batch)

    stream = Stream(Loop(), None, 0)                     # type: ignore[arg-type]
    engine._queue(stream, [5, 6, 7, 8], Sampling(max_new_tokens=40), False)
    for _ in range(3):
        gen.step()
    engine._sweep()
    engine._hand_over()
    assert delivered and all(kind == "text" for kind, _ in delivered)
    close = gen._close_texts

    def sweep_first(job, all_ended=False):                # the engine thread's turn, mid-cancel
        assert stream.request.done
        engine._sweep()
        engine._hand_over()
        close(job, all_ended)

    monkeypatch.setattr(gen, "_close_texts", sweep_first)
    engine.cancel(stream)
    engine._sweep()
    engine._hand_over()
    assert delivered[-2:] == [("text", "cancelled"), ("done", None)]
    assert delivered.count(("done", None)) == 1


def _engine_seeing_kinds():
    """An Engine over a tiny generator and a stand-in for the event loop that records the
    kinds of the events handed to it: (generator, engine, kinds, loop class)."""
    gen = Generator(random_model("llama-tiny"), capacity=512, eos=[])
    engine = Engine(gen)
    kinds: list = []

    class Loop:
        def call_soon_threadsafe(self, fn, batch):
            kinds.extend(e.kind for _, e in batch)

    return gen, engine, kinds, Loop


def test_a_cancel_made_during_a_step_ends_its_stream_at_the_next_one(monkeypatch):
    """A cancel from another thread after a step's last look at its cancels is applied at
    the next step: the sweep after this one finds the request still running, and the one
    after must still look (not wait for the periodic full sweep, 64 steps later)."""
    import threading

    from cellcache.serve.engine import Stream

    gen, engine, kinds, Loop = _engine_seeing_kinds()
    stream = Stream(Loop(), None, 0)                     # type: ignore[arg-type]
    engine._queue(stream, [5, 6, 7], Sampling(max_new_tokens=200), True)
    gen.add([9, 10, 11], Sampling(max_new_tokens=200))   # (keeps the generator busy)
    failures = [0]
    for _ in range(2):
        engine._iterate(failures)
    release, fired = gen._release, []

    def cancel_from_another_thread() -> None:            # the step's very end, its lock held
        if not fired:
            fired.append(True)
            t = threading.Thread(target=engine.cancel, args=(stream,))
            t.start()
            t.join()
        release()

    monkeypatch.setattr(gen, "_release", cancel_from_another_thread)
    turns = 0
    while "done" not in kinds and turns < 10:
        engine._iterate(failures)
        turns += 1
    assert fired and "done" in kinds and turns == 2
    assert stream.request.finish_reasons == ["cancelled"]


@pytest.fixture(params=["bytelevel", "sentencepiece"])
def texted(request):
    """(app, engine) over a tiny random model with a tokenizer of each kind."""
    pytest.importorskip("tokenizers")
    from tests.helpers_text import make_tokenizer

    tok = make_tokenizer(request.param)
    gen = Generator(random_model("llama-tiny"), capacity=1024, eos=[], tokenizer=tok)
    engine = Engine(gen, max_waiting=8)
    app = build_app(engine, model_name="tiny", limits=ServeLimits(capacity=1024, default_max_tokens=8))
    engine.start()
    yield app, engine
    engine.stop(5)


def test_logprob_tokens_are_their_own_text_and_streamed_offsets_are_the_whole_answers(texted):
    """A token's string is its own bytes where they are whole characters (a SentencePiece
    token keeps its leading space: its string and its bytes agree, and the completion's
    tokens join to its text); a streamed completion's text offsets are the unstreamed
    answer's, with and without echo."""
    app, engine = texted
    # the output held to whole words (a random model's own draws are mostly parts of characters)
    words = engine.gen.tokenizer.encode(" hello world there", add_special_tokens=False)
    body = {"prompt": "hello world, hello there", "max_tokens": 12, "temperature": 0, "logprobs": 0,
            "ignore_eos": True, "logit_bias": {str(t): 100 for t in words}}
    free = {k: v for k, v in body.items() if k != "logit_bias"}     # parts of characters too
    for held, echo in ((True, False), (True, True), (False, False), (False, True)):
        sent = {**(body if held else free), "echo": echo}
        whole = post(app, "/v1/completions", sent)
        assert whole.status_code == 200, whole.text
        choice = whole.json()["choices"][0]
        lp = choice["logprobs"]
        streamed = post(app, "/v1/completions", {**sent, "stream": True})
        chunks = [json.loads(e) for e in events(streamed)[:-1]]
        got = [o for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
               for o in c["choices"][0]["logprobs"]["text_offset"]]
        assert got == lp["text_offset"], (held, echo, got, lp["text_offset"])
        assert got == sorted(got)
        if held:
            n = len(lp["tokens"]) - 12
            assert all(" " not in t[1:] for t in lp["tokens"][n:]) and "".join(lp["tokens"][n:]).strip()
        if held and not echo:   # (an echoed prompt's BOS and first space are not in its text)
            assert "".join(lp["tokens"]) == choice["text"], (lp["tokens"], choice["text"])
    r = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there"}],
                                           "max_tokens": 12, "temperature": 0, "logprobs": True,
                                           "top_logprobs": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    whole_chars = [e for e in content if "\ufffd" not in e["token"]]
    assert whole_chars and all(e["bytes"] == list(e["token"].encode()) for e in whole_chars)


def test_null_takes_the_default_as_openais_api_reads_it(texted):
    app, engine = texted
    nulls = {"temperature": None, "top_p": None, "n": None, "presence_penalty": None,
             "frequency_penalty": None, "stream": None, "seed": None, "stop": None, "top_k": None}
    plain = {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "seed": 3}
    a = post(app, "/v1/completions", {**plain, **nulls, "echo": None, "logprobs": None, "seed": 3})
    b = post(app, "/v1/completions", plain)
    assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
    c = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                           **nulls, "logprobs": None, "top_logprobs": None})
    assert c.status_code == 200, c.text
    for body in ({"prompt": None}, {"messages": None}):     # a required field stays required
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        r = post(app, path, {**body, "max_tokens": 2})
        assert r.status_code == 400, r.text
    assert engine.live == 0 and engine.waiting == 0 and not engine.gen.busy


def test_stop_token_ids_end_the_text_before_their_token(texted):
    app, engine = texted
    word = engine.gen.tokenizer.encode(" hello", add_special_tokens=False)[-1]
    body = {"prompt": "a b c", "max_tokens": 6, "temperature": 0, "stop_token_ids": [word], "min_tokens": 2,
            "logit_bias": {str(word): 100}, "return_token_ids": True}
    r = post(app, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = choice["token_ids"]
    assert len(ids) == 3 and ids[-1] == word and choice["finish_reason"] == "stop"
    head = post(app, "/v1/completions", {**body, "max_tokens": 2, "stop_token_ids": None, "min_tokens": 0,
                                         "logit_bias": {str(word): -100}})     # (as the mask)
    assert head.json()["choices"][0]["token_ids"] == ids[:2]
    assert choice["text"] == head.json()["choices"][0]["text"]        # the text of the two before it
    s = post(app, "/v1/completions", {**body, "stream": True})
    chunks = [json.loads(e) for e in events(s)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]


def test_max_tokens_zero_with_echo_scores_the_prompt(texted):
    """``max_tokens: 0`` with ``echo`` (a loglikelihood request of lm-eval-harness): the
    prompt echoed with its log-probabilities (the first null), those a ``max_tokens: 1``
    request echoes for its prompt, no token, finish "length", no completion tokens in the
    usage; streamed, the same text, tokens and values, then the end and the usage; a batch
    with n > 1 echoes each prompt in each choice; without echo it is a 400 that queues
    nothing."""
    app, engine = texted
    body = {"prompt": "hello world, hello there", "max_tokens": 0, "echo": True, "logprobs": 2,
            "temperature": 0}
    r = post(app, "/v1/completions", body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    usage = r.json()["usage"]
    n = usage["prompt_tokens"]
    assert choice["text"] == body["prompt"] and choice["finish_reason"] == "length"
    assert usage["completion_tokens"] == 0 and usage["total_tokens"] == n
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == n and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and all(len(t) >= 2 for t in lp["top_logprobs"][1:])
    one = post(app, "/v1/completions", {**body, "max_tokens": 1}).json()["choices"][0]["logprobs"]
    assert lp["tokens"] == one["tokens"][:n] and lp["text_offset"] == one["text_offset"][:n]
    assert lp["token_logprobs"][1:] == pytest.approx(one["token_logprobs"][1:n], abs=1e-5)
    for mine, theirs in zip(lp["top_logprobs"][1:], one["top_logprobs"][1:n]):
        assert mine.keys() == theirs.keys()
        assert list(mine.values()) == pytest.approx(list(theirs.values()), abs=1e-5)

    s = post(app, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events(s)[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events(s)[:-1]]
    parts = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(p["text"] for p in parts) == choice["text"]
    assert [p["finish_reason"] for p in parts if p["finish_reason"]] == ["length"]
    streamed = [p["logprobs"] for p in parts if p["logprobs"] and p["logprobs"]["tokens"]]
    assert [t for x in streamed for t in x["tokens"]] == lp["tokens"]
    values = [v for x in streamed for v in x["token_logprobs"]]       # (read again into other cells)
    assert values[0] is None and values[1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-5)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 0
    assert chunks[-1]["usage"]["prompt_tokens"] == n

    batch = post(app, "/v1/completions", {"prompt": ["hello there", "a b c"], "max_tokens": 0, "echo": True,
                                          "n": 2, "return_token_ids": True})
    assert batch.status_code == 200, batch.text
    got = batch.json()
    assert [c["text"] for c in got["choices"]] == ["hello there"] * 2 + ["a b c"] * 2
    assert all(c["finish_reason"] == "length" and c["token_ids"] == [] and c["logprobs"] is None
               for c in got["choices"])
    assert got["usage"]["completion_tokens"] == 0
    assert got["usage"]["prompt_tokens"] == sum(len(ids) for ids in got["prompt_token_ids"])

    for path, refused in (("/v1/completions", {k: v for k, v in body.items() if k != "echo"}),
                          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 0})):
        r = post(app, path, refused)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert engine.live == 0 and engine.waiting == 0 and not engine.gen.busy


def test_max_tokens_zero_without_a_tokenizer(served):
    """A server without a tokenizer scores token ids too: streamed and not, the prompt's
    log-probabilities come back (its text empty) with no token."""
    app, engine = served
    body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 0, "echo": True, "logprobs": 0, "return_token_ids": True}
    r = post(app, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == [] and choice["finish_reason"] == "length" and choice["text"] == ""
    lp = choice["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in body["prompt"]] and lp["token_logprobs"][0] is None
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
    s = post(app, "/v1/completions", {**body, "stream": True})
    chunks = [json.loads(e) for e in events(s)[:-1]]
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    values = [v for x in streamed for v in x["token_logprobs"]]       # (read again into other cells)
    assert values[0] is None and values[1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-5)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert engine.live == 0 and engine.waiting == 0


def test_a_request_that_draws_nothing_ends_its_stream_at_the_step_that_reads_its_prompt():
    """Without a tokenizer a request that draws nothing gets no callback at all (no token,
    no text), and its end is seen by looking at it: after the step that read its prompt,
    while another request keeps the generator busy, not at the full sweep 64 steps later."""
    from cellcache.serve.engine import Stream

    gen, engine, kinds, Loop = _engine_seeing_kinds()
    gen.add([9, 10, 11], Sampling(max_new_tokens=200))   # (keeps the generator busy)
    stream = Stream(Loop(), None, 0)                     # type: ignore[arg-type]
    engine._queue(stream, [5, 6, 7], Sampling(max_new_tokens=0, prompt_logprobs=0), True)
    assert engine.waiting == 1
    failures = [0]
    turns = 0
    while "done" not in kinds and turns < 100:
        engine._iterate(failures)
        turns += 1
    assert kinds == ["done"] and turns == 1 and gen.busy
    assert stream.request.finish_reasons == ["length"] and None not in stream.request.prompt_logprobs[1:]
    assert engine.live == 0 and engine.waiting == 0 and not engine._silent
