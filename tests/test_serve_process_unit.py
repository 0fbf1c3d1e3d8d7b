"""The engine process's two ends without a process: the front end's handling of the engine's
messages (a bad event spoils only itself, a stream always ends at its "done"), a message
that cannot be pickled replaced by one that ends its streams with an error, and an engine
that has gone quiet with requests live reported by /health's ``failed``."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import pytest

from cellcache.generate import Sampling
from cellcache.serve import process
from cellcache.serve.engine import Stream
from cellcache.serve.process import EngineClient, RemoteRequest


def client_with_streams(n: int) -> tuple[EngineClient, list[Stream]]:
    engine = EngineClient(lambda: None, tokenizer=None)
    streams = []
    for rid in range(1, n + 1):
        s = Stream(None, asyncio.Queue(), rid - 1)           # type: ignore[arg-type]
        s.request = RemoteRequest(rid, Sampling(max_new_tokens=4))
        engine._streams[rid] = s
        engine._waiting += 1
        streams.append(s)
    return engine, streams


def drained(stream: Stream) -> list[tuple[str, object]]:
    out = []
    while not stream.queue.empty():
        ev = stream.queue.get_nowait()
        out.append((ev.kind, ev.token if ev.kind == "token" else ev.text))
    return out


def test_a_bad_event_spoils_only_itself_and_done_always_ends_the_stream(caplog):
    engine, (a, b) = client_with_streams(2)
    done_seen = []
    engine.on_done = done_seen.append
    items = [(1, "token", 0, 7, "", None, None),
             (1, "token", 5, 8, "", None, None),               # continuation 5 of n=1: fails
             (2, "token", 0, 9, "", None, None),
             (2, "done", 0, 0, "", None, {"outputs": "not a list of lists", "bogus": 1}),
             (1, "done", 0, 0, "", None, None)]                 # a replaced message's done
    with caplog.at_level(logging.ERROR, logger="cellcache.serve"):
        engine._dispatch(("step", items, [1], {"running": 3}))
    assert "an engine event ('token') failed" in caplog.text
    assert drained(a) == [("token", 7), ("done", "")]
    assert drained(b) == [("token", 9), ("done", "")]
    assert engine._streams == {} and engine.waiting == 0
    assert a.request.done and b.request.done and done_seen == [b.request, a.request]
    assert engine.snapshot["running"] == 3


def test_a_message_without_a_snapshot_keeps_the_last_one():
    engine, (a,) = client_with_streams(1)
    engine._dispatch(("step", [], [], {"running": 5, "asleep": 0}))
    lost = ("step", [(1, "token", 0, 3, "", None, None)], [1], {"x": object()})
    engine._dispatch(process._unpicklable(lost))
    assert engine.snapshot["running"] == 5
    assert [k for k, _ in drained(a)] == ["error", "done"] and engine._streams == {}


def test_an_unpicklable_message_is_replaced_by_errors_for_its_streams():
    bad = ("step", [(4, "token", 0, 1, "", None, lambda: 0), (6, "text", 0, 0, "x", None, None),
                    (4, "done", 0, 0, "", None, None)], [4], {"running": 1})
    with pytest.raises(Exception):
        process._pickle(bad)
    op, items, started, snapshot = process._unpicklable(bad)
    assert op == "step" and started == [4] and snapshot == {}
    assert [(rid, kind) for rid, kind, *_ in items] == [(4, "error"), (4, "done"), (6, "error"), (6, "done")]
    process._pickle((op, items, started, snapshot))             # the replacement itself pickles
    assert process._unpicklable(("added", 9, None))[2].startswith("!")


def test_an_engine_quiet_with_requests_live_fails_health(caplog, monkeypatch):
    engine, _ = client_with_streams(1)
    later: list = []

    class Loop:
        def call_later(self, delay, fn):
            later.append((delay, fn))

    class Alive:
        def is_alive(self):
            return True
        pid = 4242

    signals: list = []
    monkeypatch.setattr(process.os, "kill", lambda pid, sig: signals.append((pid, sig)))
    engine._loop, engine._process = Loop(), Alive()              # type: ignore[assignment]
    engine._last_message = time.monotonic()
    engine._watch()
    assert engine.failed is None and len(later) == 1               # recent: nothing to say
    engine._last_message = time.monotonic() - process.STALL_WARNING - 1
    with caplog.at_level(logging.WARNING, logger="cellcache.serve"):
        engine._watch()
        engine._watch()
    assert caplog.text.count("has sent no step") == 1              # once a stall
    assert signals == [(4242, signal.SIGUSR1)]                     # its stacks asked for, once
    assert "no step" in engine.failed and len(later) == 3
    engine._last_message = time.monotonic()
    engine._watch()
    assert engine.failed is None                                   # it spoke again
    engine._last_message = time.monotonic() - process.STALL_WARNING - 1
    engine._watch()
    assert "no step" in engine.failed
    engine._streams.clear()
    assert engine.failed is None              # nothing live: /health recovers at once
    engine._watch()
    assert engine.failed is None                                   # idle is not a stall
    # a request after an idle spell longer than STALL_WARNING: its first step is not late
    s = Stream(None, asyncio.Queue(), 0)                           # type: ignore[arg-type]
    s.request = RemoteRequest(9, Sampling(max_new_tokens=4))
    engine._track(9, s)
    with caplog.at_level(logging.WARNING, logger="cellcache.serve"):
        engine._watch()
    assert engine.failed is None and caplog.text.count("has sent no step") == 2
    assert engine._streams == {9: s} and engine.waiting == 2


def test_the_engine_looks_for_started_requests_among_the_oldest_only(monkeypatch):
    from cellcache.generate import Generator, random_model

    sent: list = []
    engine = process._ChildEngine(Generator(random_model("llama-tiny"), capacity=256, eos=[]), sent.append)
    monkeypatch.setattr(process, "START_SCAN", 2)

    class Started:
        first_token = 0.5

    for rid in (1, 2, 3):
        stream = Stream(None, None, rid)                           # type: ignore[arg-type]
        stream.request = Started()                                  # type: ignore[assignment]
        engine._unstarted[rid] = stream
        engine._waiting += 1
    engine._refresh()
    assert list(engine._unstarted) == [3] and engine._started == [1, 2]
    engine._refresh()
    assert not engine._unstarted and engine._started == [1, 2, 3] and engine._waiting == 0


def test_the_front_end_never_blocks_on_a_full_pipe():
    """The engine's receiver behind (here: not reading at all): the loop's writes return at
    once, what the pipe does not take waits, and everything arrives in order once it reads;
    a write with no loop running blocks as a plain pipe write does."""
    import multiprocessing
    import threading

    parent, child = multiprocessing.Pipe()
    engine = EngineClient(lambda: None, tokenizer=None)
    engine._conn = parent
    payload, n = list(range(5000)), 300                    # ~ 8 MB in all: more than a pipe holds
    checked = threading.Event()
    got: list = []

    def read() -> None:
        checked.wait(20)                                    # (a blocking write is freed after 20 s)
        got.extend(child.recv() for _ in range(n + 1))

    reader = threading.Thread(target=read)
    reader.start()

    async def main() -> bool:
        engine.start()
        for i in range(n):
            engine._send(("add", i, payload))
        waiting = len(engine._out) > 0                      # the loop went on with the rest queued
        checked.set()
        while engine._out:
            await asyncio.sleep(0.01)
        return waiting

    assert asyncio.run(main())
    engine._send(("stop",))                                 # no loop running: written at once
    reader.join(30)
    assert [m[1] for m in got[:n]] == list(range(n)) and all(m[2] == payload for m in got[:n])
    assert got[n] == ("stop",)


@pytest.mark.parametrize("big", [False, True])
def test_messages_arriving_in_pieces_on_a_non_blocking_pipe_are_read_whole(big):
    """uvloop makes a descriptor it watches non-blocking: a step message that comes in
    pieces is read as far as it came, dispatched once whole, and the engine is not taken
    for gone; the end of the pipe still is."""
    import multiprocessing
    import os
    import select
    import threading

    parent, child = multiprocessing.Pipe()
    engine, (a,) = client_with_streams(1)
    engine._conn = parent
    os.set_blocking(parent.fileno(), False)
    text = "x" * (1 << 20) if big else ""                  # past a pipe's buffer: many reads
    first = process._frame(("step", [(1, "token", 0, 7, text, None, None)], [1], {"running": 1}))
    second = process._frame(("step", [(1, "token", 0, 8, "", None, None)], [1], {"running": 1}))
    cut = 6                                                # the length and a byte of the pickle
    pieces = [first[:cut], first[cut:] + second[:3], second[3:]]
    sent = [threading.Event() for _ in pieces]
    go = [threading.Event() for _ in pieces]
    closing = threading.Event()

    def write() -> None:                                   # gives up after 10 s: never hangs
        out = child.fileno()
        for data, ready, done in zip(pieces, go, sent):
            if not ready.wait(10):
                return
            view = memoryview(data)
            while view:
                if not select.select([], [out], [], 10)[1]:
                    return
                view = view[os.write(out, view):]
            done.set()
        if closing.wait(10):
            child.close()

    async def until(what, seconds: float = 10.0) -> bool:
        end = time.monotonic() + seconds
        while not what() and time.monotonic() < end:
            await asyncio.sleep(0.005)
        return bool(what())

    tokens: list = []

    def took(n: int) -> bool:
        tokens.extend(t for k, t in drained(a) if k == "token")
        return len(tokens) >= n

    async def main() -> list:
        engine.start()
        go[0].set()
        await until(sent[0].is_set)
        await asyncio.sleep(0.05)                          # read as far as it came
        seen = [took(1), engine._lost]
        go[1].set()
        seen.append(await until(lambda: took(1)))
        go[2].set()
        seen += [await until(lambda: took(2)), engine._lost]
        closing.set()
        seen.append(await until(lambda: engine._lost is not None))
        return seen

    os.set_blocking(child.fileno(), False)
    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    seen = asyncio.run(main())
    assert seen == [False, None, True, True, None, True], seen
    assert tokens == [7, 8]
    assert [k for k, _ in drained(a)] == ["error", "done"]   # the pipe's end: its streams end


class _Unpicklable(Exception):
    """Pickles, but does not unpickle (its two arguments are not what it pickled)."""

    def __init__(self, a, b):
        super().__init__(a)


def test_a_message_that_fails_is_lost_alone(monkeypatch, caplog):
    """A message that does not unpickle, or whose dispatch raises, is logged and skipped:
    the messages before and after it are dispatched and nothing stays behind in the buffer."""
    import multiprocessing
    import os

    parent, child = multiprocessing.Pipe()
    engine, (a,) = client_with_streams(1)
    engine._conn = parent
    os.set_blocking(parent.fileno(), False)
    step = lambda token: process._frame(("step", [(1, "token", 0, token, "", None, None)], [1], {}))  # noqa: E731
    real = engine._dispatch

    def dispatch(msg):
        if msg[0] == "step" and msg[1][0][3] == 8:
            raise RuntimeError("injected")
        real(msg)

    monkeypatch.setattr(engine, "_dispatch", dispatch)
    bad = process._frame(("step", _Unpicklable(1, 2)))
    child.send_bytes(b"")                                  # (an empty frame: skipped as well)
    os.write(child.fileno(), step(7) + bad + step(8) + step(9))
    with caplog.at_level(logging.ERROR, logger="cellcache.serve"):
        engine._readable()
    assert [t for k, t in drained(a) if k == "token"] == [7, 9]
    assert "could not be unpickled" in caplog.text and "failed in the front end" in caplog.text
    assert engine._in == bytearray() and engine._lost is None


def test_a_new_streams_first_token_wakes_its_client_before_the_running_ones():
    engine, (a, b, c) = client_with_streams(3)
    woke: list[int] = []

    async def client(stream: Stream) -> None:
        await stream.queue.get()
        woke.append(stream.tag)

    async def main() -> None:
        tasks = [asyncio.create_task(client(s)) for s in (a, b, c)]
        await asyncio.sleep(0)                                      # each waits on its queue
        engine._dispatch(("step", [(1, "token", 0, 5, "", None, None),
                                   (2, "token", 0, 6, "", None, None),
                                   (3, "first", 0, 0, "", None, (0, None)),
                                   (3, "token", 0, 7, "", None, None)], [3], {"running": 3}))
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert woke == [2, 0, 1]                                        # (tags: rid - 1)
    assert [t for k, t in drained(c)] == [] and c.request.outputs[0] == [7]
    assert a.request.outputs[0] == [5] and b.request.outputs[0] == [6]
