"""``cellcache serve`` at its bounds, on a server of its own (no prefix cache, so that a freed
request gives every cell back; one running sequence at most; one waiting request at most;
half a second of grace at shutdown): a client that leaves mid-stream cancels its request and
frees its cells, the waiting bound answers 429 with Retry-After and changes nothing, SIGTERM
answers 503 while draining, ends the running stream ("abort") and exits 0."""

from __future__ import annotations

import json
import signal
import socket

import httpx
import pytest

from tests.helpers_serve import ServerProcess, wait_until
from tests.helpers_text import save_model_and_tokenizer

CANCELLED = 'cellcache_request_finished_total{reason="cancelled"}'
LONG = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 2000, "temperature": 0,
        "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module", params=["engine-process", "no-engine-process"])
def server(tmp_path_factory, request):
    """A server of its own, both ways (an engine process, the default; one process)."""
    model_dir = save_model_and_tokenizer(tmp_path_factory.mktemp("bounds") / "tiny", "bytelevel")
    srv = ServerProcess(model_dir, "--device", "cpu", "--dtype", "float32", "--capacity", "4096",
                        "--no-prefix-cache", "--max-seqs", "1", "--max-waiting", "1",
                        "--shutdown-timeout", "0.5", "--log-level", "warning", "--served-model-name", "tiny",
                        f"--{request.param}")
    srv.start()
    yield srv
    srv.stop()


def data_lines(response: httpx.Response):
    """The ``data:`` payloads of an SSE response, as they arrive."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


def opened(response: httpx.Response):
    """The response's ``data:`` payloads once its first arrived (the stream's one iterator:
    dropping a partly read iterator closes the connection)."""
    assert response.status_code == 200, response.read()
    lines = data_lines(response)
    json.loads(next(lines))
    return lines


def test_a_client_that_leaves_mid_stream_frees_its_cells(server):
    before = server.metrics()
    assert before["cellcache_kv_cells_free"] == before["cellcache_kv_cells_capacity"]
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=LONG) as r:
            lines = opened(r)
            during = server.metrics()
            assert during["cellcache_requests_live"] == 1
            assert during["cellcache_kv_cells_free"] < before["cellcache_kv_cells_free"]
            assert next(lines)
        # the stream is closed here: the client has gone
    wait_until(lambda: server.metrics()["cellcache_requests_live"] == 0, what="the request ending")
    after = server.metrics()
    assert after.get(CANCELLED, 0) == before.get(CANCELLED, 0) + 1
    assert after["cellcache_kv_cells_free"] == before["cellcache_kv_cells_free"]
    assert after["cellcache_requests_running"] == 0


def test_a_client_that_leaves_before_a_whole_answer_cancels_it(server):
    before = server.metrics()
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({**LONG, "stream": False}).encode()
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        # the client leaves once its request holds cells and produces (not while it waits)
        wait_until(lambda: server.metrics()["cellcache_generation_tokens_total"]
                   > before["cellcache_generation_tokens_total"], what="the request running")
        assert server.metrics()["cellcache_kv_cells_free"] < before["cellcache_kv_cells_free"]
    wait_until(lambda: server.metrics()["cellcache_requests_live"] == 0, what="the request ending")
    after = server.metrics()
    assert after.get(CANCELLED, 0) == before.get(CANCELLED, 0) + 1
    assert after["cellcache_kv_cells_free"] == before["cellcache_kv_cells_free"]


def test_past_the_waiting_bound_is_429_and_changes_nothing(server):
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=LONG) as a:
            lines = opened(a)                         # running: it has its first token
            with http.stream("POST", server.url + "/v1/completions", json=LONG) as b:
                assert b.status_code == 200           # accepted, waiting (one sequence runs at most)
                wait_until(lambda: server.metrics()["cellcache_requests_waiting"] == 1, what="b waiting")
                before = server.metrics()
                status, body, headers = server.post("/v1/completions", {**LONG, "stream": False})
                assert status == 429 and int(headers["retry-after"]) >= 1
                assert body["error"]["code"] == "rate_limit_exceeded"
                assert "--max-waiting 1" in body["error"]["message"]
                status, body, headers = server.post(
                    "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
                assert status == 429 and "retry-after" in headers
                after = server.metrics()
                for key in ("cellcache_requests_live", "cellcache_requests_waiting",
                            "cellcache_prompt_tokens_total"):
                    assert after[key] == before[key], key
                assert after['cellcache_http_errors_total{status="429"}'] == 2
                assert next(lines)                    # a still streams
    wait_until(lambda: server.metrics()["cellcache_requests_live"] == 0, what="both requests ending")
    assert server.metrics()["cellcache_kv_cells_free"] == 4096


def test_sigterm_drains_answers_503_and_exits_0(server):
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=LONG) as r:
            lines = opened(r)
            server.signal(signal.SIGTERM)
            wait_until(lambda: server.get("/health")[0] == 503, what="/health answering 503")
            status, body, headers = server.post("/v1/completions", {**LONG, "stream": False})
            assert status == 503 and "retry-after" in headers
            assert body["error"]["code"] == "service_unavailable"
            rest = list(lines)                         # the stream ends (cancelled after the grace)
    assert rest[-1] == "[DONE]"
    last = json.loads(rest[-2])
    assert last["choices"][0]["finish_reason"] == "abort"
    assert server.proc is not None and server.proc.wait(60) == 0, server.output()
