"""The engine in a process of its own: ``cellcache serve``'s default on one process.

In one process the server's two halves share one interpreter lock: every token of every
stream costs the event loop a JSON chunk and a write, and at a few hundred streams the loop
holds the lock for most of each step while the engine thread waits for it to launch the next
one (docs/design/http.md measures it). Here the generator steps in a child process, as vLLM's
engine core and SGLang's scheduler run, and hands the front end each step's events as one
message; the front end (this process: HTTP, tokenization, the streams' chunks) never runs
Python beside the step.

::

    front end (event loop)                       engine process
    ----------------------                       --------------
    EngineClient.submit ── ("add", rid, ids, ──▶ receiver thread: Engine._queue (gen.add)
                             sampling, tokens)        ◀── ("added", rid, error or None)
    EngineClient.cancel ── ("cancel", rid) ────▶      Engine.cancel
    sleep / wake ───────── ("control", ...) ───▶      run between steps ◀── ("control", cid, ...)
    loop reads the pipe ◀── ("step", items,      ◀── engine thread, after each step: every
      when it is readable                            stream's events of the step, the streams that
      -> RemoteRequest updated, Event queued         started, the snapshot (/metrics, /health)

The front end keeps a :class:`RemoteRequest` per request, filled from the messages (tokens,
texts, finish reasons, log-probabilities; the whole outcome with its ``"done"``), so the
routes read it as they read a :class:`~cellcache.generate.Request` in one process. The
child ignores SIGINT and SIGTERM (the front end drains it); when the front end goes away
(its end of the pipe closes) the child cancels everything and exits.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import gc
import itertools
import logging
import multiprocessing
import os
import queue
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

from .._cli import stacks_on_sigusr1
from ..errors import InvalidArgument, InvalidState, OutOfMemory
from ..generate import Sampling
from ..generate.prompts import encode_prompt
from .engine import Engine, Event, Refused, Stream

__all__ = ["EngineClient", "EngineLoadError", "RemoteRequest"]

log = logging.getLogger("cellcache.serve")

#: Seconds at least between two of the engine's messages whose steps had no events (a
#: prompt chunk's step): the snapshot alone need not go every step.
IDLE_SNAPSHOT = 0.1

#: The requests without a first token the engine looks at after a step (the oldest): a
#: backlog of thousands costs a step no more than this many reads.
START_SCAN = 1024

#: Seconds without a step message from an engine that has live requests after which the front
#: end says so in its log (once a stall) and /health fails: a step takes milliseconds, a long
#: prefill seconds.
STALL_WARNING = 30.0
#: The front end reads at most this many MiB of the pipe before it dispatches what came and
#: lets the loop go on (the rest stays readable).
READ_CHUNKS = 16

#: The exceptions a control (sleep, wake) may answer with, by name, raised again in the front end.
_ERRORS: dict[str, type[Exception]] = {"InvalidArgument": InvalidArgument, "InvalidState": InvalidState,
                                       "OutOfMemory": OutOfMemory}


class EngineLoadError(Exception):
    """The engine process could not build its generator: the message is one line for the
    user (a usage error, exit code 2)."""


class RemoteRequest:
    """The front end's copy of a request running in the engine process: what the routes read
    of a :class:`~cellcache.generate.Request` (``outputs``, ``texts``, ``finish_reasons``,
    ``logprobs``, ``prompt_logprobs``, ``cached_tokens``, ``done``, the times the metrics
    observe), filled in from the engine's messages; whole once ``done``."""

    def __init__(self, rid: int, sampling: Sampling):
        n = sampling.n
        self.id = rid
        self.outputs: list[list[int]] = [[] for _ in range(n)]
        self.texts = [""] * n
        self.finish_reasons: list[str | None] = [None] * n
        self.logprobs: list[list[Any]] | None = (
            [[] for _ in range(n)] if sampling.logprobs is not None else None)
        self.prompt_logprobs: list[Any] | None = None
        self.cached_tokens = 0
        self.error: str | None = None
        self.done = False
        self.ttft: float | None = None
        self.arrived = 0.0
        self.finished: float | None = None
        self._itl: list[float] = []

    def itl(self) -> list[float]:
        """The gaps between consecutive tokens (seconds), once done."""
        return self._itl

    def update(self, kind: str, k: int, token: int, text: str, finish: str | None, extra: Any) -> None:
        if kind == "token":
            self.outputs[k].append(token)
            if extra is not None and self.logprobs is not None:
                self.logprobs[k].append(extra)
        elif kind == "text":
            self.texts[k] += text
            if finish is not None:
                self.finish_reasons[k] = finish
        elif kind == "first":
            self.cached_tokens, self.prompt_logprobs = extra
        elif kind == "done" and extra is not None:
            for name, value in extra.items():
                setattr(self, "_itl" if name == "itl" else name, value)
            self.done = True


def _summary(req: Any) -> dict[str, Any]:
    """What the front end's RemoteRequest takes from a request that is done."""
    return {"outputs": [list(o) for o in req.outputs], "texts": list(req.texts) if req.texts else [],
            "finish_reasons": list(req.finish_reasons),
            "logprobs": None if req.logprobs is None else [list(x) for x in req.logprobs],
            "prompt_logprobs": None if req.prompt_logprobs is None else list(req.prompt_logprobs),
            "cached_tokens": req.cached_tokens, "ttft": req.ttft, "itl": req.itl(),
            "arrived": req.arrived, "finished": req.finished,
            "error": None if req.error is None else f"{type(req.error).__name__}: {req.error}"}


def _summary_or_error(req: Any) -> dict[str, Any]:
    """:func:`_summary`, or (it failed: said in the log) what ends the request's stream."""
    try:
        return _summary(req)
    except Exception as e:
        log.exception("summarizing request %s failed", getattr(req, "id", "?"))
        return {"error": f"the engine could not report the request: {type(e).__name__}: {e}"}


# -- the engine process ------------------------------------------------------------------------------

class _ChildEngine(Engine):
    """The engine of the engine process: its streams are the front end's request ids, and
    each step's events go down the pipe in one message (with the streams that started and
    the snapshot) instead of to an event loop."""

    def __init__(self, gen: Any, send: Callable[[Any], None], **kw: Any):
        self._send = send
        self._streams: dict[int, Stream] = {}        # rid -> stream (receiver thread adds)
        self._unstarted: dict[int, Stream] = {}      # rid -> stream without a first token yet
        self._started: list[int] = []
        self._fresh: set[int] = set()                # rids that were sent nothing yet
        self._last_sent = 0.0
        super().__init__(gen, **kw)

    def add(self, rid: int, ids: list[int], sampling: Sampling, tokens: bool) -> None:
        """Queues the front end's request ``rid`` (receiver thread); InvalidArgument propagates."""
        stream = Stream(None, None, rid)             # type: ignore[arg-type]
        with self._lock:
            self._unstarted[rid] = stream
            self._fresh.add(rid)
        self._streams[rid] = stream                  # (before it can end: its "done" pops it)
        try:
            self._queue(stream, ids, sampling, tokens)
        except BaseException:
            with self._lock:
                self._unstarted.pop(rid, None)
                self._fresh.discard(rid)
            self._streams.pop(rid, None)
            raise

    def cancel_rid(self, rid: int) -> None:
        stream = self._streams.get(rid)
        if stream is not None:
            self.cancel(stream)

    def cancel_all(self) -> None:
        """Cancels every request of the front end's (it is going, or gone)."""
        for rid in list(self._streams):
            self.cancel_rid(rid)

    def control(self, send: Callable[[Any], None], cid: int, name: str, args: tuple) -> None:
        """Runs ``gen.sleep(*args)`` or ``gen.wake()`` on the engine thread between steps and
        answers ``("control", cid, ok, result or (error name, status, message))``."""
        gen = self.gen

        def go() -> int:
            if name == "sleep":
                level, keep = args
                gen.sleep(level, keep_prefixes=keep)
            else:
                gen.wake()
            self.asleep = gen.asleep
            return gen.asleep

        def answer(fut: concurrent.futures.Future) -> None:
            e = fut.exception()
            if e is None:
                send(("control", cid, True, fut.result()))
            elif isinstance(e, Refused):
                send(("control", cid, False, ("Refused", e.status, e.message)))
            else:
                send(("control", cid, False, (type(e).__name__, 0, str(e))))

        try:
            fut = self._control(go)
        except Refused as e:
            send(("control", cid, False, ("Refused", e.status, e.message)))
            return
        fut.add_done_callback(answer)

    def _on_token(self, stream: Stream) -> Callable[[Any, int, int], None]:
        outbox = self._outbox
        counts: dict[int, int] = {}

        def on_token(req: Any, k: int, token: int) -> None:
            if not stream.started:
                self._start(stream)
            i = counts.get(k, 0)
            counts[k] = i + 1
            lps = req.logprobs
            lp = lps[k][i] if lps is not None and i < len(lps[k]) else None
            outbox.append((stream, Event("token", stream.tag, k, token=token, logprob=lp)))
            if req.finish_reasons[k] is not None:
                self._ended = True
        return on_token

    def _start(self, stream: Stream) -> None:
        with self._lock:
            if not stream.started:
                stream.started = True
                self._waiting -= 1
                self._unstarted.pop(stream.tag, None)
                self._started.append(stream.tag)

    def _refresh(self) -> None:
        # a request whose first token raised no callback (its text held back) has started all
        # the same: only the ones not started are looked at, the START_SCAN oldest (a backlog
        # starts in about the order it came; one further back is seen once it is nearer)
        if self._unstarted:
            with self._lock:
                waiting = list(itertools.islice(self._unstarted.values(), START_SCAN))
            for s in waiting:
                if s.request is not None and s.request.first_token is not None:
                    self._start(s)
        super()._refresh()

    def _hand_over(self) -> None:
        outbox = self._outbox
        taken = outbox[:]
        del outbox[:len(taken)]
        if self.stream_interval > 1:
            taken = self._hold_back(taken)
        with self._lock:
            started, self._started = self._started, []
        now = time.monotonic()
        if not taken and not started and now - self._last_sent < IDLE_SNAPSHOT:
            return
        items: list[tuple[Any, ...]] = []
        for stream, ev in taken:
            rid = stream.tag
            if rid in self._fresh:
                self._fresh.discard(rid)
                req = stream.request
                if req is not None:
                    items.append((rid, "first", 0, 0, "", None, (req.cached_tokens, req.prompt_logprobs)))
            if ev.kind == "token":
                items.append((rid, "token", ev.k, ev.token, "", None, ev.logprob))
            elif ev.kind == "done":                  # its last event: nothing of it stays
                self._streams.pop(rid, None)
                with self._lock:
                    self._unstarted.pop(rid, None)
                summary = _summary_or_error(stream.request)
                if "outputs" not in summary:         # (the summary failed: the stream says so)
                    items.append((rid, "error", 0, 0, summary["error"], None, None))
                items.append((rid, "done", 0, 0, "", None, summary))
            else:
                items.append((rid, ev.kind, ev.k, 0, ev.text, ev.finish, None))
        self._last_sent = now
        self._send(("step", items, started, self.snapshot))


def _child_main(conn: Any, build: Callable[[], Any], options: dict[str, Any], log_level: str) -> None:
    """The engine process: builds the generator (``build()``), answers ``("ready", info)`` or
    ``("refused", message)``, then serves the front end's messages until it says stop or
    goes away."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)           # the front end drains us
    stacks_on_sigusr1()                        # kill -USR1: every thread's stack
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # Messages go out through a thread of their own: the engine thread only queues them, so it
    # never blocks on a full pipe while the front end is busy (pickling and the write happen
    # there, the write with the interpreter lock released).
    outgoing: queue.SimpleQueue = queue.SimpleQueue()

    def send(msg: Any) -> None:
        outgoing.put(msg)

    def sender() -> None:
        while True:
            msg = outgoing.get()
            if msg is None:
                return
            try:
                data = _pickle(msg)
            except Exception:                    # said, and its streams end with an error
                log.exception("a %r message to the front end could not be pickled", msg[0])
                data = _pickle(_unpicklable(msg))
            try:
                conn.send_bytes(data)
            except Exception:
                # the front end is gone, or the pipe failed: either way nothing more can reach
                # it, and a process that keeps stepping for nobody would hide that
                log.exception("writing to the front end failed: the engine process exits")
                os._exit(1)

    writer = threading.Thread(target=sender, name="cellcache-engine-sender", daemon=True)
    writer.start()
    try:
        _engine_main(conn, build, options, send)
    finally:
        outgoing.put(None)
        writer.join(30)


def _engine_main(conn: Any, build: Callable[[], Any], options: dict[str, Any],
                 send: Callable[[Any], None]) -> None:

    try:
        gen = build()
        engine = _ChildEngine(gen, send, **options)
        max_pos = getattr(getattr(gen.model, "config", None), "max_position_embeddings", None)
        info = {"vocab": gen.vocab, "capacity": gen.cache.config.capacity,
                "max_positions": max_pos if isinstance(max_pos, int) and max_pos > 0 else None,
                "snapshot": engine.snapshot}
    except EngineLoadError as e:
        send(("refused", str(e)))
        return
    except BaseException as e:
        send(("refused", f"the engine process failed while loading: {type(e).__name__}: {e}"))
        raise
    # what was built stays: the collector's full passes skip it (as vLLM freezes after start-up)
    gc.collect()
    gc.freeze()
    send(("ready", info))
    engine.start()
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                log.warning("the front end went away: cancelling every request")
                break
            if msg[0] == "stop":
                break
            try:
                _receive(engine, send, msg)
            except Exception:                        # one message's failure is not the engine's
                log.exception("the front end's %r failed", msg[0])
    finally:
        engine.cancel_all()
        engine.stop(30.0)
        try:
            send(("stopped",))
        except (OSError, ValueError):
            pass


def _pickle(msg: Any) -> bytes:
    return bytes(ForkingPickler.dumps(msg))


def _frame(msg: Any) -> bytes:
    """``msg`` as ``Connection.send`` writes it, for the other end's ``recv``: a big-endian
    int32 length (-1 and a uint64 past 2 GiB), then the pickle."""
    data = _pickle(msg)
    n = len(data)
    return (struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)) + data


def _unframe(buf: bytearray) -> list[Any]:
    """The whole messages at the start of ``buf`` (as :func:`_frame` writes them), taken out
    of it; a message not whole yet stays, one that does not unpickle is logged and skipped."""
    out, at = [], 0
    while len(buf) - at >= 4:
        (n,) = struct.unpack_from("!i", buf, at)
        head = 4
        if n == -1:
            if len(buf) - at < 12:
                break
            (n,) = struct.unpack_from("!Q", buf, at + 4)
            head = 12
        if len(buf) - at - head < n:
            break
        try:
            out.append(ForkingPickler.loads(buf[at + head:at + head + n]))
        except Exception:                # (one message lost, not the pipe: the rest still read)
            log.exception("a message from the engine process could not be unpickled")
        at += head + n
    del buf[:at]
    return out


def _unpicklable(msg: Any) -> Any:
    """What replaces a message that could not be pickled: every stream it spoke of ends with
    an error (a "step" message), or the request it answered is refused (an "added" one)."""
    if msg[0] == "step":
        why = "the engine could not send this request's events (see the server's log)"
        rids = dict.fromkeys(item[0] for item in msg[1])
        items = [x for rid in rids for x in ((rid, "error", 0, 0, why, None, None),
                                             (rid, "done", 0, 0, "", None, None))]
        return ("step", items, [int(r) for r in msg[2]], {})
    if msg[0] == "added":
        return ("added", msg[1], "!the engine could not answer this request (see the server's log)")
    return ("noop",)


def _receive(engine: _ChildEngine, send: Callable[[Any], None], msg: Any) -> None:
    """One message of the front end's (the receiver thread)."""
    op = msg[0]
    if op == "add":
        _, rid, ids, sampling, tokens = msg
        error: str | None = None
        try:
            engine.add(rid, ids, sampling, tokens)
        except InvalidArgument as e:
            error = str(e)
        except Exception as e:                       # (a 500 in the front end)
            log.exception("queuing request %d failed", rid)
            error = f"!{type(e).__name__}: {e}"
        send(("added", rid, error))
    elif op == "cancel":
        engine.cancel_rid(msg[1])
    elif op == "control":
        engine.control(send, *msg[1:])


# -- the front end -----------------------------------------------------------------------------------

class EngineClient:
    """The front end's engine: the loop-side API of :class:`~cellcache.serve.engine.Engine`
    (``submit``, ``cancel``, ``drain``, ``sleep``, ``wake``, ``check_admission``, ``encode``,
    ``snapshot``, ``tokens_per_second``) over an engine process.

    :meth:`launch` starts the process and waits (blocking, before the server listens) until
    the generator is built: ``build`` is a picklable callable the child runs, which raises
    :class:`EngineLoadError` for a usage problem. ``tokenizer``: the front end's own copy,
    loaded from the same files (encodes prompts, names log-probabilities' tokens)."""

    def __init__(self, build: Callable[[], Any], *, tokenizer: Any, max_waiting: int = 1024,
                 stream_interval: int = 1, log_level: str = "info"):
        self._tokenizer: Any = None
        self._encoder: Any = None
        self.tokenizer = tokenizer
        self.max_waiting = max_waiting
        self.on_done: Callable[[Any], Any] | None = None
        self.draining = False
        self.asleep = 0
        self._falling_asleep = 0
        self._build, self._log_level = build, log_level
        self._options = {"max_waiting": max_waiting, "stream_interval": stream_interval}
        self._process: Any = None
        self._conn: Any = None
        self._sock: socket.socket | None = None      # the pipe's end again, for writes that never block
        self._out = bytearray()                      # what the loop could not write yet
        self._in = bytearray()                       # what the loop read of a message not whole yet
        self._send_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._streams: dict[int, Stream] = {}
        self._acks: dict[int, asyncio.Future] = {}
        self._controls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._waiting = 0
        self._lost: str | None = None
        self._stopping = False
        self._snapshot: dict[str, Any] = {}
        self._last_message = 0.0
        self._stalled = False
        self._rate: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)
        self.vocab: int | None = None
        self.capacity = 0
        self.max_positions: int | None = None

    @property
    def tokenizer(self) -> Any:
        """The front end's tokenizer (None: token ids only)."""
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        # encoding runs in the loop's thread pool with a copy: a fast tokenizer refuses some
        # concurrent uses ("Already borrowed"), and the loop decodes with the tokenizer itself
        self._tokenizer, self._encoder = tokenizer, tokenizer
        if tokenizer is not None:
            try:
                self._encoder = copy.deepcopy(tokenizer)
            except Exception:
                log.warning("the tokenizer cannot be copied: encoding shares it with the loop")

    # -- the process -----------------------------------------------------------------------------
    def launch(self, timeout: float | None = None) -> None:
        """Starts the engine process and waits for its generator; :class:`EngineLoadError`
        when it refuses (or dies) before it is ready."""
        self.spawn()
        self.wait_ready(timeout)

    def spawn(self) -> None:
        """Starts the engine process, which builds its generator (:meth:`wait_ready` waits
        for it; this process may do its own loading meanwhile)."""
        ctx = multiprocessing.get_context("spawn")   # (CUDA does not survive a fork)
        parent, child = ctx.Pipe()
        self._process = ctx.Process(target=_child_main, name="cellcache-engine",
                                    args=(child, self._build, self._options, self._log_level), daemon=True)
        self._process.start()
        child.close()
        self._conn = parent

    def wait_ready(self, timeout: float | None = None) -> None:
        """Waits until the engine process's generator is built; :class:`EngineLoadError` when
        it refuses (or dies, or ``timeout`` seconds pass) first."""
        parent = self._conn
        deadline = None if timeout is None else time.monotonic() + timeout
        while not parent.poll(0.2):
            if not self._process.is_alive() and not parent.poll(0):
                raise EngineLoadError(f"the engine process exited (code {self._process.exitcode}) "
                                      "before its model was ready")
            if deadline is not None and time.monotonic() > deadline:
                self._process.kill()
                raise EngineLoadError("the engine process was not ready in time")
        try:
            msg = parent.recv()
        except (EOFError, OSError):
            raise EngineLoadError(f"the engine process exited (code {self._process.exitcode}) "
                                  "before its model was ready") from None
        if msg[0] == "refused":
            self._process.join(10)
            raise EngineLoadError(msg[1])
        info = msg[1]
        self.vocab, self.capacity, self.max_positions = info["vocab"], info["capacity"], info["max_positions"]
        self._snapshot = info["snapshot"]

    @property
    def pid(self) -> int | None:
        """The engine process's id (None before :meth:`launch`)."""
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        """Starts reading the engine's messages on the running loop (the loop that serves): it
        reads the pipe when it is readable, so no thread hands them over."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop_thread = threading.get_ident()
            self._loop.add_reader(self._conn.fileno(), self._readable)
            self._last_message = time.monotonic()
            self._loop.call_later(STALL_WARNING / 4, self._watch)

    def _watch(self) -> None:
        """Says (once a stall) when the engine has sent nothing for STALL_WARNING seconds
        while requests are live (counted from its last step, or from the first request
        after an idle spell: an idle engine sends nothing): the log then tells an operator
        where to look."""
        if self._lost is not None or self._stopping or self._loop is None:
            return
        quiet = time.monotonic() - self._last_message
        if self._streams and quiet > STALL_WARNING:
            if not self._stalled:
                self._stalled = True
                alive = self._process.is_alive()
                log.warning("the engine process (pid %s, alive: %s) has sent no step for %.0f s with "
                            "%d requests live%s", self.pid, alive, quiet, len(self._streams),
                            ": its threads' stacks follow" if alive else "")
                if alive:
                    self._dump_stacks()
        else:
            self._stalled = False
        self._loop.call_later(STALL_WARNING / 4, self._watch)

    def _dump_stacks(self) -> None:
        # the engine process's faulthandler prints every thread's stack to its stderr (the
        # server's log) from the signal itself: it answers even when a thread holds the GIL
        try:
            os.kill(self._process.pid, signal.SIGUSR1)
        except (OSError, AttributeError):
            log.warning("the engine process's stacks could not be asked for")

    def stop(self, timeout: float = 30.0) -> None:
        """Asks the engine process to end (its requests cancelled) and waits for it (any
        thread)."""
        self._stopping = True
        try:
            self._send(("stop",))
        except Refused:
            pass
        if self._process is not None:
            self._process.join(timeout)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5)
        loop = self._loop
        if self._sock is not None and not (loop is not None and loop.is_running()):
            self._sock.close()                       # (with a loop running its reader closes it)

    def _send(self, msg: Any) -> None:
        """``msg`` to the engine process. On the loop it never blocks: what the pipe does not
        take now (the engine's receiver behind) waits in ``_out`` and goes when the pipe is
        writable, so /health and /metrics answer whatever the engine does. From another
        thread while the loop runs it is handed to the loop; with no loop running, written
        (blocking)."""
        if self._conn is None or self._lost is not None:
            raise Refused(503, "the engine is not running")
        data = _frame(msg)
        loop = self._loop
        try:
            if loop is not None and threading.get_ident() == self._loop_thread:
                self._write(data)
            elif loop is not None and loop.is_running():
                loop.call_soon_threadsafe(self._write_soon, data)
            else:
                with self._send_lock:
                    sock = self._socket()
                    sock.setblocking(True)           # (a loop that watched it may have left it not)
                    sock.sendall(bytes(self._out) + data)
                    self._out.clear()
        except (OSError, ValueError):
            raise Refused(503, "the engine is not running") from None

    def _socket(self) -> socket.socket:
        if self._sock is None:
            # the same socket (a duplicate descriptor): MSG_DONTWAIT makes single writes
            # non-blocking without making the Connection's reads so
            self._sock = socket.socket(fileno=os.dup(self._conn.fileno()))
        return self._sock

    def _write(self, data: bytes) -> None:
        """On the loop: ``data`` written as far as the pipe takes it now, the rest queued."""
        if self._out:                                # (behind what waits: the order is kept)
            self._out += data
            return
        sent = self._write_now(data)
        if sent < len(data):
            self._out += memoryview(data)[sent:]
            assert self._loop is not None
            self._loop.add_writer(self._socket().fileno(), self._writable)

    def _write_soon(self, data: bytes) -> None:
        if self._lost is not None:                   # (handed over before the engine was gone)
            return
        try:
            self._write(data)
        except OSError:
            pass                                     # (the reader sees the engine gone)

    def _write_now(self, data: bytes | bytearray) -> int:
        sock, view, sent = self._socket(), memoryview(data), 0
        while sent < len(view):
            try:
                sent += sock.send(view[sent:], socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
        return sent

    def _writable(self) -> None:
        """On the loop, the pipe writable again: what waits in ``_out``, as far as it goes."""
        assert self._loop is not None
        try:
            sent = self._write_now(self._out)
        except OSError:                              # the engine is gone: the reader says so
            sent = len(self._out)
        del self._out[:sent]
        if not self._out:
            self._loop.remove_writer(self._socket().fileno())

    def _readable(self) -> None:
        """On the loop: what the pipe holds now, read without waiting (a message not whole
        yet stays in ``_in`` until its rest comes), each whole message dispatched. The pipe's
        descriptor may be non-blocking: uvloop (libuv) makes a descriptor it watches so, and
        then ``Connection.recv`` would fail half-way through a message."""
        ended = False
        try:
            sock = self._socket()
            for _ in range(READ_CHUNKS):           # (then the loop's other work: the rest stays readable)
                data = sock.recv(1 << 20, socket.MSG_DONTWAIT)
                if not data:
                    ended = True
                    break
                self._in += data
        except BlockingIOError:
            pass
        except OSError:
            ended = True
        for msg in _unframe(self._in):
            if msg[0] == "stopped":
                ended = True
                break
            if msg[0] == "step":
                self._last_message = time.monotonic()
            try:
                self._dispatch(msg)
            except Exception:                      # (the messages after it still dispatched)
                log.exception("an engine message (%r) failed in the front end", msg[0])
        if ended:
            assert self._loop is not None
            self._loop.remove_reader(self._conn.fileno())
            self._gone()

    def _gone(self) -> None:
        """The engine process ended (or was asked to): every live stream ends with an error
        unless it was stopped."""
        code = None if self._process is None else self._process.exitcode
        self._lost = "the engine process exited" + ("" if code is None else f" (code {code})")
        sock, self._sock = self._sock, None
        if sock is not None:
            # (on the loop's thread: its writer goes before its descriptor, as uvloop needs)
            if self._out and self._loop is not None and sock.fileno() >= 0:
                self._loop.remove_writer(sock.fileno())
            sock.close()
        self._out.clear()
        if not self._stopping:
            log.error("%s", self._lost)
        for rid, stream in list(self._streams.items()):
            self._end(rid, stream, f"the engine failed: {self._lost}")
        for fut in list(self._acks.values()) + list(self._controls.values()):
            if not fut.done():
                fut.set_exception(Refused(503, "the engine is not running"))

    def _end(self, rid: int, stream: Stream, why: str) -> None:
        self._streams.pop(rid, None)
        self._mark_started(stream)
        req = stream.request
        if req is not None:
            req.done = True
            req.finish_reasons = [r or "error" for r in req.finish_reasons]
        stream.queue.put_nowait(Event("error", stream.tag, text=why))
        stream.queue.put_nowait(Event("done", stream.tag))

    def _mark_started(self, stream: Stream) -> None:
        if not stream.started:
            stream.started = True
            self._waiting -= 1

    def _dispatch(self, msg: Any) -> None:
        """One engine message, on the loop."""
        op = msg[0]
        if op == "step":
            _, items, started, snapshot = msg
            streams = self._streams
            fresh = {item[0] for item in items if item[1] == "first"}
            if fresh and len(fresh) < len(items):
                # new streams' events first: the loop writes the chunks in the order their
                # streams wake, and a first token waiting behind every running stream's next
                # chunk is what a client reads as time to first token
                items = [x for x in items if x[0] in fresh] + [x for x in items if x[0] not in fresh]
            for rid in started:
                s = streams.get(rid)
                if s is not None:
                    self._mark_started(s)
            for item in items:
                try:
                    self._item(*item)
                except Exception:                        # one item's failure is not the others'
                    log.exception("an engine event (%r) failed", item[1])
            if not snapshot:                             # (a message that replaced a lost one)
                return
            self._snapshot = snapshot
            stats = snapshot.get("stats", {})
            now = time.monotonic()
            if not self._rate or now - self._rate[-1][0] >= 0.25:
                self._rate.append((now, stats.get("tokens_out", 0)))
            if not self._falling_asleep:
                self.asleep = snapshot.get("asleep", 0)
        elif op == "added":
            fut = self._acks.pop(msg[1], None)
            if fut is not None and not fut.done():
                fut.set_result(msg[2])
        elif op == "control":
            _, cid, ok, value = msg
            fut = self._controls.pop(cid, None)
            if fut is None or fut.done():
                return
            if ok:
                fut.set_result(value)
            elif value[0] == "Refused":
                fut.set_exception(Refused(value[1], value[2]))
            else:
                fut.set_exception(_ERRORS.get(value[0], RuntimeError)(value[2]))

    def _item(self, rid: int, kind: str, k: int, token: int, text: str, finish: str | None,
              extra: Any) -> None:
        """One event of a step message: the request's copy updated, its stream told."""
        stream = self._streams.get(rid)
        if stream is None:
            return                                       # (ended: cancelled and gone)
        req = stream.request
        if kind == "done":                               # its last: the stream ends whatever happens
            del self._streams[rid]
            self._mark_started(stream)                   # (its "error" came before it)
            try:
                req.update(kind, k, token, text, finish, extra)
            finally:
                req.done = True
                stream.queue.put_nowait(Event("done", stream.tag))
            if self.on_done is not None:
                try:
                    self.on_done(req)
                except Exception:
                    log.exception("on_done failed")
            return
        req.update(kind, k, token, text, finish, extra)
        if kind == "token":
            stream.queue.put_nowait(Event("token", stream.tag, k, token=token))
        elif kind == "error":
            stream.queue.put_nowait(Event("error", stream.tag, text=text))
        elif kind != "first":
            stream.queue.put_nowait(Event(kind, stream.tag, k, text=text, finish=finish))

    # -- the loop's side (as Engine's) -----------------------------------------------------------
    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def live(self) -> int:
        return len(self._streams)

    @property
    def alive(self) -> bool:
        return (self._process is not None and self._process.is_alive() and self._lost is None
                and not self._stopping)

    @property
    def failed(self) -> str | None:
        """Why the engine cannot serve (``/health`` answers 500): it exited, it failed, or it
        has sent no step for STALL_WARNING seconds while requests are live."""
        if self._stalled and self._streams:
            return (f"the engine process has sent no step for {STALL_WARNING:.0f} s or more with "
                    f"{len(self._streams)} requests live")
        return self._lost or self._snapshot.get("failed")

    @property
    def snapshot(self) -> dict[str, Any]:
        return {**self._snapshot, "waiting": self._waiting, "live": len(self._streams)}

    def tokens_per_second(self, window: float = 10.0) -> float:
        return Engine.tokens_per_second(self, window)          # type: ignore[arg-type]

    async def encode(self, prompt: Any) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, encode_prompt, self._encoder, prompt, self.vocab)

    def check_admission(self, count: int = 1) -> None:
        if self.draining:
            raise Refused(503, "the server is shutting down")
        if self.asleep or self._falling_asleep:
            raise Refused(503, "the server is asleep (POST /wake_up wakes it)")
        if not self.alive:
            raise Refused(503, "the engine is not running")
        if self._waiting + count > self.max_waiting:
            raise Refused(429, f"{self._waiting} requests are waiting (the server's bound is "
                          f"--max-waiting {self.max_waiting}); retry later")

    def _track(self, rid: int, stream: Stream) -> None:
        """A new request's stream, live and waiting from now on. After an idle spell (no
        stream live: an idle engine sends nothing) a stall counts from here."""
        if not self._streams:
            self._last_message = time.monotonic()
        self._streams[rid] = stream
        self._waiting += 1

    async def submit(self, ids: list[int], sampling: Sampling, queue: asyncio.Queue, tag: int = 0,
                     tokens: bool = False) -> Stream:
        """As :meth:`Engine.submit`: the request queued in the engine process (its answer
        awaited: InvalidArgument with nothing queued)."""
        self.check_admission()
        rid = next(self._ids)
        stream = Stream(asyncio.get_running_loop(), queue, tag)
        stream.request = RemoteRequest(rid, sampling)
        self._track(rid, stream)
        fut = asyncio.get_running_loop().create_future()
        self._acks[rid] = fut
        try:
            self._send(("add", rid, ids, sampling, tokens))
            error = await fut
        except BaseException:
            self._acks.pop(rid, None)
            if self._streams.pop(rid, None) is not None:
                self._mark_started(stream)
                try:
                    self._send(("cancel", rid))
                except Refused:
                    pass
            raise
        if error is not None:
            if self._streams.pop(rid, None) is not None:
                self._mark_started(stream)
            if error.startswith("!"):
                raise RuntimeError(error[1:])
            raise InvalidArgument(error)
        return stream

    def cancel(self, stream: Stream) -> None:
        req = stream.request
        if req is not None and not req.done and req.id in self._streams:
            try:
                self._send(("cancel", req.id))
            except Refused:
                pass

    async def drain(self, timeout: float) -> None:
        self.draining = True
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for stream in list(self._streams.values()):
            self.cancel(stream)
        deadline = time.monotonic() + 10.0
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def _control(self, name: str, args: tuple) -> Any:
        cid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._controls[cid] = fut
        try:
            self._send(("control", cid, name, args))
            return await fut
        finally:
            self._controls.pop(cid, None)

    async def sleep(self, level: int, keep_prefixes: bool = False) -> int:
        self._falling_asleep += 1
        try:
            self.asleep = await self._control("sleep", (level, keep_prefixes))
            return self.asleep
        finally:
            self._falling_asleep -= 1

    async def wake(self) -> None:
        await self._control("wake", ())
        self.asleep = 0
