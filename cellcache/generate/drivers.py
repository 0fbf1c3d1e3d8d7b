"""Clients that drive a Generator the way traffic does, shared by the tests and
``tools/bench_serve.py``: multi-turn conversations (:func:`chat`) and arrivals at given
times (:func:`poisson_arrivals`, :func:`serve_arrivals`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import InvalidArgument
from .requests import Request, Sampling

__all__ = ["chat", "poisson_arrivals", "serve_arrivals"]


def chat(gen: Any, first: Sequence[Sequence[int]], messages: Sequence[Sequence[Sequence[int]]],
         sampling: Sampling, after_step: Callable[[], None] | None = None
         ) -> list[tuple[int, int, Request]]:
    """Conversations: conversation c opens with ``first[c]``; once turn k's reply is
    complete, turn k + 1 is added at once with the previous prompt + the reply (its first
    continuation) + ``messages[c][k + 1]``; ``len(messages[c])`` turns each. ``after_step``
    runs after every step (checks). Returns (conversation, turn, request) sorted by
    conversation and turn. Stops when every conversation is done, or when a step does
    nothing and no turn completed (nothing could run)."""
    n_conv, turns = len(first), len(messages[0]) if messages else 1
    live = {c: gen.add(first[c], sampling) for c in range(n_conv)}
    turn = dict.fromkeys(range(n_conv), 0)
    done: list[tuple[int, int, Request]] = []
    while live:
        busy = gen.step()
        if after_step is not None:
            after_step()
        progressed = False
        for c, r in list(live.items()):
            if not r.done:
                continue
            progressed = True
            done.append((c, turn[c], r))
            turn[c] += 1
            if turn[c] == turns:
                del live[c]
            else:
                live[c] = gen.add(r.prompt + r.outputs[0] + list(messages[c][turn[c]]), sampling)
        if not busy and not progressed:
            break
    return sorted(done, key=lambda t: t[:2])


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival offsets in seconds of ``n`` requests of a Poisson process with ``rate``
    requests a second (exponential gaps, seeded; the first at its first gap)."""
    if rate <= 0:
        raise ValueError(f"rate={rate} must be > 0")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return np.cumsum(gaps).tolist()


def serve_arrivals(gen: Any, prompts: Sequence[Sequence[int]], offsets: Sequence[float],
                   sampling: Sampling | Sequence[Sampling], clock: Callable[[], float] = time.perf_counter,
                   sleep: Callable[[float], None] = time.sleep) -> list[Request]:
    """Adds prompt i at ``offsets[i]`` seconds after the start, from a client thread (add()
    is thread-safe, so a request arrives while a step runs, as in a server), while this
    thread steps; returns the requests in prompt order once every one is done.
    ``sampling``: one Sampling for every prompt, or one per prompt."""
    samplings = [sampling] * len(prompts) if isinstance(sampling, Sampling) else list(sampling)
    if len(samplings) != len(prompts):
        raise InvalidArgument(f"sampling holds {len(samplings)} Samplings for {len(prompts)} prompts")
    reqs: list[Request | None] = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: offsets[i])
    added = threading.Event()
    failure: list[BaseException] = []
    t0 = clock()

    def client() -> None:
        try:
            for i in order:
                wait = t0 + offsets[i] - clock()
                if wait > 0:
                    sleep(wait)
                reqs[i] = gen.add(prompts[i], samplings[i])
        except BaseException as e:           # handed to the stepping thread
            failure.append(e)
        finally:
            added.set()

    th = threading.Thread(target=client, name="arrivals", daemon=True)
    th.start()
    while True:
        busy = gen.step()
        if failure:
            th.join()
            raise failure[0]
        if not busy:
            if added.is_set() and not gen.busy:
                break
            sleep(2e-4)                      # idle until the next arrival
    th.join()
    return [r for r in reqs if r is not None]
