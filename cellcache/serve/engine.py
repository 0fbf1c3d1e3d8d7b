"""The engine thread of ``cellcache serve``: the one thread that steps the Generator, and the
bridge from its callbacks (on that thread) to the event loop's coroutines.

::

    event loop (HTTP)                          engine thread
    -----------------                          -------------
    submit(): bound checked (429 / 503),       sleeps on a Condition while gen.busy is False
      gen.add(ids, sampling, on_token,    ──▶  and nothing was submitted (no busy spin)
              on_text)  (thread safe)          gen.step()   (the GPU's work, never the loop's)
      wake the engine                            on_token / on_text (this thread)
                                                   └─ loop.call_soon_threadsafe(queue.put_nowait)
                                                   └─ appended to the step's outbox
    async for event in stream  ◀───────────────  after the step: the outbox handed over in one
                                                   loop.call_soon_threadsafe (one wake-up a step,
                                                   not one a token); requests that are done get a
    disconnect: gen.cancel(req) (thread safe)      "done" event; metrics observed; snapshot refreshed

A request counts as **waiting** from :meth:`Engine.submit` until its first token (or its
end): ``max_waiting`` bounds that number, and a submit past it is refused with 429. While
the server drains (:meth:`Engine.drain`, on SIGTERM) every submit is refused with 503.

Tokenization runs in the loop's default thread pool (:meth:`Engine.encode`), not on the loop
and not on the engine thread: a long prompt's encoding never delays a step or another
request's stream; ``gen.add`` then gets token ids (its own work is host bookkeeping). It
encodes with a copy of the generator's tokenizer, so that the pool's threads never use the
tokenizer object the engine thread decodes with (a Hugging Face fast tokenizer refuses some
concurrent uses: "Already borrowed").
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..generate import Generator, Request, Sampling
from ..generate.prompts import encode_prompt

__all__ = ["Engine", "Event", "Stream"]

log = logging.getLogger("cellcache.serve")

#: Steps between full sweeps of the live requests when no callback said one ended (a
#: request can end without one: a capacity end, an error); the engine also sweeps whenever
#: it goes idle.
FULL_SWEEP_STEPS = 64

#: Consecutive failed steps with no step applied after which every live request is failed
#: (a forward that keeps raising would otherwise be retried forever).
MAX_FAILED_STEPS = 3


@dataclass(slots=True)
class Event:
    """What a request's stream receives: ``"token"`` (continuation ``k``'s ``token``;
    ``logprob`` its TokenLogprob where an engine process sends it), ``"text"`` (its newly
    final ``text``; ``finish`` set on the last one), ``"done"`` (the request is done: no
    event follows), ``"error"`` (the engine failed it: ``text`` says why)."""

    kind: str
    tag: int
    k: int = 0
    token: int = 0
    text: str = ""
    finish: str | None = None
    logprob: Any = None


@dataclass(eq=False)
class Stream:
    """One request's path from the engine thread to the loop: events land in ``queue``
    (shared by the prompts of one batch, told apart by ``tag``)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    tag: int
    request: Any = None                         # a Request (a RemoteRequest in a front end)
    started: bool = False                       # a first token (or the end) was seen
    # the engine thread's hold-back (stream_interval > 1): events not handed over yet, the
    # tokens among them, and whether anything was handed over at all
    held: list[tuple[Stream, Event]] = field(default_factory=list)
    held_tokens: int = 0
    sent: bool = False


def _deliver(batch: list[tuple[Stream, Event]]) -> None:
    """On the loop: each event into its stream's queue, in order."""
    for stream, event in batch:
        stream.queue.put_nowait(event)


class Engine:
    """Owns ``gen`` (a :class:`~cellcache.generate.Generator`) and the thread that steps it.

    ``max_waiting``: requests accepted and without a first token at most (more: 429).
    Thread rules: :meth:`submit`, :meth:`cancel`, :meth:`drain` run on the event loop;
    everything else of the generator runs on the engine thread. :attr:`snapshot` (running,
    waiting, free cells, the generator's stats) is refreshed after every step for
    ``/metrics`` and ``/health``, so neither reads the generator while it steps.
    ``on_done(request)`` (optional) is called on the engine thread when a request ends.
    ``idle_tick`` (seconds, tensor parallelism): the idle engine still steps that often, so
    that the other ranks, stepping in lockstep, never wait long on a collective.
    """

    def __init__(self, gen: Generator, *, max_waiting: int = 1024,
                 on_done: Callable[[Request], Any] | None = None, idle_tick: float | None = None,
                 stream_interval: int = 1):
        self.gen = gen
        self.idle_tick = idle_tick
        if isinstance(stream_interval, bool) or not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval {stream_interval!r} is not an int >= 1")
        #: Tokens a stream's events gather on the engine thread before they are handed over
        #: (1: every step's); a stream's first token and its end go at once.
        self.stream_interval = stream_interval
        self.max_waiting = max_waiting
        self.on_done = on_done
        self.draining = False
        self.failed: BaseException | None = None
        self._cond = threading.Condition()
        self._lock = threading.Lock()           # _live, _waiting
        self._live: dict[int, Stream] = {}
        self._waiting = 0
        self._submitted = False
        self._stop = False
        self._ended = False                     # a callback saw a request end
        self._cancelled: set[int] = set()       # requests cancelled and not swept yet (ids)
        # live requests that end with no callback (ids): they draw nothing (max_new_tokens 0)
        # and stream no text (no tokenizer), so only a look at them after a step sees the end
        self._silent: set[int] = set()
        self._unswept = 0                       # steps since the last full sweep
        self._thread: threading.Thread | None = None
        # work the loop asks of the engine thread between steps (sleep, wake), with its future
        self._controls: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        #: 0, or the level of the generator's sleep (set on the engine thread; new requests
        #: get 503 meanwhile).
        self.asleep = 0
        self._falling_asleep = 0                # sleeps asked for and not yet answered (loop thread)
        #: The generator as of its last step (read by /metrics and /health from the loop).
        self.snapshot: dict[str, Any] = {}
        self._rate: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)
        self._outbox: list[tuple[Stream, Event]] = []      # the engine thread's, until handed over
        self._memory: dict[str, int] = {}                  # _memory(), refreshed with the rate
        # the tokenizer the pool encodes with: never the object the engine thread decodes with
        self._encoder: Any = None
        if gen.tokenizer is not None:
            try:
                self._encoder = copy.deepcopy(gen.tokenizer)
            except Exception:                   # a tokenizer that cannot be copied: shared
                log.warning("the tokenizer cannot be copied: encoding shares it with the engine")
        self._refresh()

    # -- the loop's side -------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        """Requests accepted that have no first token yet."""
        return self._waiting

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs (False before :meth:`start` and after :meth:`stop`)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def live(self) -> int:
        """Requests accepted and not done."""
        return len(self._live)

    async def encode(self, prompt: str | list[dict[str, str]]) -> list[int]:
        """``prompt`` (text or chat messages) as ``gen.encode`` gives it, computed in the
        loop's thread pool with the engine's own copy of the tokenizer; InvalidArgument as
        ``gen.encode`` raises it."""
        loop = asyncio.get_running_loop()
        if self._encoder is None:
            return await loop.run_in_executor(None, self.gen.encode, prompt)
        return await loop.run_in_executor(None, encode_prompt, self._encoder, prompt, self.gen.vocab)

    def check_admission(self, count: int = 1) -> None:
        """Raises :class:`Refused` (503 while draining or when the engine thread is not
        running, 429 when ``count`` more requests would pass ``max_waiting``) or returns."""
        if self.draining:
            raise Refused(503, "the server is shutting down")
        if self.asleep or self._falling_asleep:
            raise Refused(503, "the server is asleep (POST /wake_up wakes it)")
        if self._stop or not self.alive:       # nothing would step it: the client would wait forever
            raise Refused(503, "the engine is not running")
        if self._waiting + count > self.max_waiting:
            self._recount()
        if self._waiting + count > self.max_waiting:
            raise Refused(429, f"{self._waiting} requests are waiting (the server's bound is "
                          f"--max-waiting {self.max_waiting}); retry later")

    def _recount(self) -> None:
        """Marks started the requests that have a first token no callback reported (their
        text held back, no ``"token"`` events asked for): O(live), only near the bound."""
        with self._lock:
            for s in self._live.values():
                if not s.started and s.request is not None and s.request.first_token is not None:
                    s.started = True
                    self._waiting -= 1

    @property
    def tokenizer(self) -> Any:
        """The generator's tokenizer (None: token ids only)."""
        return self.gen.tokenizer

    async def submit(self, ids: list[int], sampling: Sampling, queue: asyncio.Queue, tag: int = 0,
                     tokens: bool = False) -> Stream:
        """Queues ``ids`` with ``sampling`` on the generator; its events go to ``queue``
        tagged ``tag``: ``"text"`` ones, and ``"token"`` ones when ``tokens`` is true or the
        generator has no tokenizer (an ``on_token`` callback a token costs the engine thread
        a call and an event: asked for only when ids or log-probabilities are sent). Raises
        :class:`Refused` (see :meth:`check_admission`), or the generator's InvalidArgument
        with nothing queued. Loop thread only."""
        self.check_admission()
        return self._queue(Stream(asyncio.get_running_loop(), queue, tag), ids, sampling, tokens)

    def _queue(self, stream: Stream, ids: list[int], sampling: Sampling, tokens: bool) -> Stream:
        """``gen.add`` for ``stream`` (counted waiting, then live), the engine thread woken;
        any thread. The generator's InvalidArgument propagates with nothing queued."""
        with self._lock:
            self._waiting += 1
        try:
            # (text streams only with a tokenizer: without one the tokens alone are streamed)
            texted = self.gen.tokenizer is not None
            on_text = self._on_text(stream) if texted else None
            on_token = self._on_token(stream) if tokens or not texted else None
            req = self.gen.add(ids, sampling, on_token=on_token, on_text=on_text)
        except BaseException:
            with self._lock:
                self._waiting -= 1
            raise
        stream.request = req
        with self._lock:
            self._live[req.id] = stream
            if sampling.max_new_tokens == 0 and on_text is None:
                self._silent.add(req.id)
        with self._cond:
            self._submitted = True
            self._cond.notify()
        return stream

    def cancel(self, stream: Stream) -> None:
        """Cancels ``stream``'s request (a client gone, a drain past its grace): its cells
        are freed at the next step boundary at the latest. Nothing when it is done."""
        req = stream.request
        if req is not None and not req.done:
            self.gen.cancel(req)
            # swept after every step until it has ended (a cancel made during a step may take
            # effect only at the next one)
            with self._lock:
                self._cancelled.add(req.id)
            with self._cond:
                self._submitted = True          # the sweep reports it done
                self._cond.notify()

    async def drain(self, timeout: float) -> None:
        """Stops admitting (503), lets the live requests run up to ``timeout`` seconds, then
        cancels the rest and waits (briefly) for their ends to reach their streams."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self._live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        with self._lock:
            rest = list(self._live.values())
        for stream in rest:
            self.cancel(stream)
        deadline = time.monotonic() + 10.0
        while self._live and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def sleep(self, level: int, keep_prefixes: bool = False) -> int:
        """``gen.sleep(level, keep_prefixes=...)`` on the engine thread, between steps; returns
        the level. The generator's InvalidArgument (a bad level, keep_prefixes without the
        prefix cache's host level) and InvalidState (requests queued or running, asleep at
        another level) propagate with nothing changed."""
        def go() -> int:
            self.gen.sleep(level, keep_prefixes=keep_prefixes)
            self.asleep = self.gen.asleep
            return self.asleep
        self._falling_asleep += 1           # new requests: 503 from now (a level-2 sleep is long)
        try:
            return await asyncio.wrap_future(self._control(go))
        finally:
            self._falling_asleep -= 1

    async def wake(self) -> None:
        """``gen.wake()`` on the engine thread, between steps (OutOfMemory propagates, the
        server still asleep)."""
        def go() -> None:
            self.gen.wake()
            self.asleep = 0
        await asyncio.wrap_future(self._control(go))

    def _control(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stop or not self.alive:   # (under the lock: the thread sees it or refuses)
                raise Refused(503, "the engine is not running")
            self._controls.append((fn, fut))
            self._cond.notify()
        return fut

    def _run_controls(self) -> None:
        with self._cond:
            controls, self._controls = self._controls, []
        for fn, fut in controls:
            if not fut.set_running_or_notify_cancel():
                continue                    # its caller went away (a cancelled await): not run
            try:
                result = fn()
            except BaseException as e:      # the caller's to see (a 409, a 400)
                fut.set_exception(e)
            else:
                fut.set_result(result)

    # -- the engine thread -----------------------------------------------------------------------
    def start(self) -> None:
        """Starts the engine thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cellcache-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Ends the engine thread once the generator is idle (call :meth:`drain` first)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _on_token(self, stream: Stream) -> Callable[[Request, int, int], None]:
        outbox = self._outbox

        def on_token(req: Request, k: int, token: int) -> None:
            if not stream.started:
                self._start(stream)
            outbox.append((stream, Event("token", stream.tag, k, token=token)))
            if req.finish_reasons[k] is not None:
                self._ended = True
        return on_token

    def _on_text(self, stream: Stream) -> Callable[[Request, int, str], None]:
        outbox = self._outbox

        def on_text(req: Request, k: int, delta: str) -> None:
            if not stream.started:
                self._start(stream)
            finish = req.finish_reasons[k]
            outbox.append((stream, Event("text", stream.tag, k, text=delta, finish=finish)))
            if finish is not None:
                self._ended = True
        return on_text

    def _start(self, stream: Stream) -> None:
        """``stream`` waits no more (its first token, or its end); once, from any thread."""
        with self._lock:
            if not stream.started:
                stream.started = True
                self._waiting -= 1

    def _hand_over(self) -> None:
        """The outbox to the loop(s), one call each (engine thread). A closed loop drops it."""
        outbox = self._outbox
        if not outbox:
            return
        # taken by a copy and a cut, each atomic: an event a cancel's last on_text appends
        # from the loop's thread meanwhile stays for the next hand-over (the callbacks hold
        # this very list, so it is never replaced)
        taken = outbox[:]
        del outbox[:len(taken)]
        if self.stream_interval > 1:
            taken = self._hold_back(taken)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, Event]]] = {}
        for item in taken:
            by_loop.setdefault(item[0].loop, []).append(item)
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:                # the loop closed: nobody listens any more
                pass

    def _hold_back(self, taken: list[tuple[Stream, Event]]) -> list[tuple[Stream, Event]]:
        """What of ``taken`` goes to the loops now, ``stream_interval > 1``: a stream's events
        wait on the stream until they carry ``stream_interval`` tokens; a stream that was
        never handed anything, an end (a finish reason, ``done``, ``error``) and everything
        held before it go at once (engine thread)."""
        every = self.stream_interval
        unit = "text" if self.gen.tokenizer is not None else "token"    # one per token
        out: list[tuple[Stream, Event]] = []
        seen: list[Stream] = []
        for item in taken:
            stream, ev = item
            if not stream.sent:
                seen.append(stream)
                out.append(item)                # its first hand-over: at once (TTFT)
                continue
            stream.held.append(item)
            if ev.kind == unit:
                stream.held_tokens += 1
            if ev.kind in ("done", "error") or ev.finish is not None or stream.held_tokens >= every:
                out += stream.held
                stream.held, stream.held_tokens = [], 0
        for stream in seen:
            stream.sent = True
        return out

    def _run(self) -> None:
        # The thread never ends but by stop(): a client waits on it for every event, so an
        # exception in the engine's own work (not the step's) fails the live requests (an
        # "error" and a "done" each) and the loop goes on.
        failures = [0]
        while True:
            try:
                if not self._iterate(failures):
                    return
            except Exception as e:
                log.exception("the engine's own work failed")
                try:
                    self._fail_all(e)
                    self._hand_over()
                except Exception:
                    log.exception("failing the live requests failed")

    def _iterate(self, failures: list[int]) -> bool:
        """One turn of the engine thread: waits for work, steps, sweeps, refreshes the
        snapshot, hands the events over. False once stopped."""
        gen = self.gen
        tick = False
        with self._cond:
            # (asleep, a request that slipped in before the 503 waits for the wake)
            while not ((gen.busy and not gen.asleep) or self._submitted or self._stop or tick
                       or self._controls):
                tick = not self._cond.wait(self.idle_tick) and self.idle_tick is not None
            self._submitted = False
            if self._stop and (not gen.busy or gen.asleep):
                controls, self._controls = self._controls, []
                for _, fut in controls:
                    if fut.set_running_or_notify_cancel():
                        fut.set_exception(Refused(503, "the server is shutting down"))
                return False
        if self._controls:
            self._run_controls()
        if (gen.busy or tick) and not gen.asleep:
            # (progress is a step applied, not a token drawn: a request that scores its prompt
            # draws none, and a server that scores alone would never be seen to serve again)
            applied = gen.stats["steps"]
            try:
                gen.step()
                failures[0] = 0
                if self.failed is not None and gen.stats["steps"] > applied:
                    # it serves again (the failure was a request's or passed): /health with it
                    log.warning("the engine steps again after: %s", self.failed)
                    self.failed = None
            except Exception as e:          # a request's own code, or the step itself
                log.exception("a generator step failed")
                failures[0] = failures[0] + 1 if gen.stats["steps"] == applied else 0
                if failures[0] >= MAX_FAILED_STEPS:
                    failures[0] = 0
                    self._fail_all(e)
        # a sweep reads every live request: only when one may have ended
        if self._silent and not self._ended:
            self._ended = self._silent_ended()
        self._unswept += 1
        if self._ended or self._cancelled or self._unswept >= FULL_SWEEP_STEPS or not gen.busy:
            self._ended = False
            self._unswept = 0
            self._sweep()
        # the snapshot before the events: a client that saw a token finds its step in
        # /metrics and /health
        self._refresh()
        self._hand_over()
        return True

    def _silent_ended(self) -> bool:
        """Whether a request that ends with no callback (``_silent``) is complete, or gone
        from the live ones (engine thread): O(those requests), not O(live)."""
        with self._lock:
            streams = [self._live.get(rid) for rid in self._silent]
        return any(s is None or (s.request is not None and s.request.complete) for s in streams)

    def _sweep(self) -> None:
        """Ends the streams of the requests that are done (engine thread)."""
        with self._lock:
            # complete, not only done: a cancel from another thread marks a request done
            # before it makes its last on_text
            ended = [(rid, s) for rid, s in self._live.items()
                     if s.request is not None and s.request.complete]
            for rid, s in ended:
                del self._live[rid]
                if not s.started:
                    s.started = True
                    self._waiting -= 1
            if self._cancelled:                 # (one that ended before it was counted too)
                self._cancelled.intersection_update(self._live)
            if self._silent:
                self._silent.intersection_update(self._live)
        for _, s in ended:
            req = s.request
            assert req is not None
            if req.error is not None and "error" in req.finish_reasons:
                why = f"{type(req.error).__name__}: {req.error}"
                self._outbox.append((s, Event("error", s.tag, text=why)))
            self._outbox.append((s, Event("done", s.tag)))
            if self.on_done is not None:
                try:
                    self.on_done(req)
                except Exception:
                    log.exception("on_done failed")

    def _fail_all(self, e: BaseException) -> None:
        """Ends every live request with an error event (their generator requests cancelled)."""
        self.failed = e
        with self._lock:
            rest = list(self._live.items())
            self._live.clear()
            self._cancelled.clear()
            self._silent.clear()
        for _, s in rest:
            if s.request is not None and not s.request.done:
                try:
                    self.gen.cancel(s.request)
                except Exception:               # its stream is ended all the same
                    log.exception("cancelling request %d failed", s.request.id)
            if not s.started:
                self._start(s)
            why = f"the engine failed: {type(e).__name__}: {e}"
            self._outbox.append((s, Event("error", s.tag, text=why)))
            self._outbox.append((s, Event("done", s.tag)))

    def _refresh(self) -> None:
        """The snapshot /metrics and /health read (engine thread, or before it starts)."""
        gen = self.gen
        now = time.monotonic()
        stats = dict(gen.stats)
        cache = gen.cache
        rate = self._rate
        if not rate or now - rate[-1][0] >= 0.25:
            rate.append((now, stats.get("tokens_out", 0)))
            self._memory = _memory()
        self.snapshot = {"running": len(gen.running), "waiting": self._waiting,
                         "scheduler_waiting": len(gen.waiting), "live": len(self._live),
                         "free_cells": cache.free_cells, "capacity": cache.config.capacity,
                         "stats": stats, "time": now, "asleep": self.asleep,
                         "failed": None if self.failed is None else str(self.failed), **self._memory}

    def tokens_per_second(self, window: float = 10.0) -> float:
        """Output tokens a second over about the last ``window`` seconds of steps."""
        rate = list(self._rate)
        if len(rate) < 2:
            return 0.0
        t1, n1 = rate[-1]
        older = [(t, n) for t, n in rate if t1 - t <= window]
        t0, n0 = older[0]
        if time.monotonic() - t1 > window or t1 <= t0:
            return 0.0
        return (n1 - n0) / (t1 - t0)


def _memory() -> dict[str, int]:
    """This process's resident bytes and, once it uses CUDA, torch's device memory: read with
    the token rate (four times a second at most), not every step."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/statm") as f:
            out["rss_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass                                    # not Linux: the gauge is left out
    torch: Any = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["gpu_allocated_bytes"] = torch.cuda.memory_allocated()
        out["gpu_reserved_bytes"] = torch.cuda.memory_reserved()
    return out


class Refused(Exception):
    """A request the server will not take now: ``status`` 429 (too many waiting) or 503
    (shutting down); the client should retry after ``retry_after`` seconds."""

    def __init__(self, status: int, message: str, retry_after: int = 1):
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after
