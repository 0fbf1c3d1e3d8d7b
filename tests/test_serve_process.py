"""``cellcache serve`` with its generator in an engine process (the default): the engine is a
process of its own; when it dies, every stream ends with an error, ``/health`` says so and
new requests get 503 (never a hang); when the front end dies, the engine process ends too
(nothing is left holding the model's memory). Its ordinary serving is tested by
``test_serve.py`` and ``test_serve_bounds.py``, which run both ways."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

from tests.helpers_serve import ServerProcess, wait_until
from tests.helpers_text import save_model_and_tokenizer

LONG = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 2000, "temperature": 0,
        "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_and_tokenizer(tmp_path_factory.mktemp("process") / "tiny", "bytelevel")


def start(model_dir, *flags: str) -> ServerProcess:
    return ServerProcess(model_dir, "--device", "cpu", "--dtype", "float32", "--capacity", "8192",
                         "--log-level", "warning", "--served-model-name", "tiny", *flags).start()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"      # (a zombie has ended)
    except OSError:
        return False


def test_one_process_has_no_engine_process(model_dir):
    server = start(model_dir, "--no-engine-process")
    try:
        assert server.engine_pid() is None
        status, body, _ = server.post("/v1/completions", {**LONG, "max_tokens": 3, "stream": False})
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    finally:
        server.stop()


def test_an_engine_that_dies_fails_its_streams_and_the_server_says_so(model_dir):
    server = start(model_dir)
    try:
        pid = server.engine_pid()
        assert pid is not None and pid != server.proc.pid
        metrics = server.metrics()
        assert metrics["cellcache_engine_resident_memory_bytes"] > 0
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", server.url + "/v1/completions", json=LONG) as r:
                assert r.status_code == 200
                lines = (line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: "))
                json.loads(next(lines))                       # streaming
                os.kill(pid, signal.SIGKILL)
                rest = list(lines)                            # the stream ends: no hang
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert error["type"] == "server_error" and "engine process exited" in error["message"]
        status, body, _ = server.get("/health")
        assert status == 500 and "engine process exited" in json.loads(body)["error"]
        status, body, headers = server.post("/v1/completions", {**LONG, "stream": False})
        assert status == 503 and "retry-after" in headers
        assert body["error"]["code"] == "service_unavailable"
        assert server.proc.poll() is None                     # the front end still answers
        server.signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.output()
    finally:
        server.stop()


def test_the_engine_process_ends_with_its_front_end(model_dir):
    server = start(model_dir)
    try:
        pid = server.engine_pid()
        assert pid is not None and alive(pid)
        server.proc.kill()                                    # no drain, no goodbye
        server.proc.wait(30)
        wait_until(lambda: not alive(pid), timeout=60, what="the engine process ending")
    finally:
        server.stop()


def test_sleep_and_wake_reach_the_engine_process(model_dir):
    """``--enable-sleep`` through the engine process: a sleep while a request runs is 409 with
    nothing changed, a bad level 400, a sleep frees the cache (new requests 503, ``/health``
    says asleep), a wake serves again."""
    server = start(model_dir, "--enable-sleep")
    try:
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", server.url + "/v1/completions", json=LONG) as r:
                lines = (line for line in r.iter_lines() if line.startswith("data: "))
                next(lines)                                   # running
                status, body, _ = server.post("/sleep?level=1", b"")
                assert status == 409 and body["error"]["code"] == "conflict"
                assert json.loads(server.get("/is_sleeping")[1]) == {"is_sleeping": False, "level": 0}
            # (the client left: its request is cancelled)
        wait_until(lambda: server.metrics()["cellcache_requests_live"] == 0, what="the request ending")
        status, body, _ = server.post("/sleep?level=3", b"")
        assert status == 400 and body["error"]["param"] == "level"
        assert json.loads(server.get("/is_sleeping")[1]) == {"is_sleeping": False, "level": 0}
        status, body, _ = server.post("/sleep?level=1", b"")
        assert status == 200 and body == {"is_sleeping": True, "level": 1}
        status, body, _ = server.get("/health")
        assert status == 200 and json.loads(body)["status"] == "asleep"
        status, body, headers = server.post("/v1/completions", {**LONG, "max_tokens": 2, "stream": False})
        assert status == 503 and "retry-after" in headers
        status, body, _ = server.post("/wake_up", b"")
        assert status == 200 and body == {"is_sleeping": False, "level": 0}
        status, body, _ = server.post("/v1/completions", {**LONG, "max_tokens": 2, "stream": False})
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    finally:
        server.stop()
