"""A client process of tools/bench_http.py: its share of a run's requests, sent at their
arrival times through the ``openai`` client (``AsyncOpenAI``, streaming completions: what
users run, pydantic objects a chunk) or through ``httpx`` alone (the SSE lines read and
each event parsed with ``json.loads``: a lean client, so that a run can tell the server's
latency from the client's own parsing). A module of its own so that ``multiprocessing``'s
spawned processes import it by name."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

__all__ = ["CLIENTS", "run_client"]

#: The clients a run may send its requests through.
CLIENTS = ("openai", "httpx")
#: How often a client process probes its event loop's lag (seconds; the server's period).
LAG_PERIOD = 0.01


def _chunk(rec: dict[str, Any], n: int, finish: str | None, keep_chunks: bool,
           leave_after: int | None) -> bool:
    """One chunk of ``n`` tokens (and its finish reason) into ``rec``; whether the client
    leaves now (``leave_after`` chunks seen)."""
    if n:
        now = time.time()
        if keep_chunks:
            rec["chunks"].append((now, n))
        if rec["first"] is None:
            rec["first"] = now
        rec["last"] = now
        rec["n_chunks"] += 1
        rec["tokens"] += n
    if finish is not None:
        rec["finish"] = finish
    if leave_after is not None and rec["n_chunks"] >= leave_after:
        rec["left"] = True
        return True
    return False


def _body(ids: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": "bench", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}


async def _one(client: Any, i: int, ids: list[int], max_tokens: int, leave_after: int | None,
               keep_chunks: bool, kind: str = "openai") -> dict[str, Any]:
    """Request ``i``, sent now: its chunks (``(time, tokens)`` each with ``keep_chunks``; else
    only the first's and the last's times and their count), tokens, finish reason, error."""
    rec: dict[str, Any] = {"i": i, "sent": time.time(), "chunks": [], "n_chunks": 0, "first": None,
                           "last": None, "tokens": 0, "error": None, "left": False, "finish": None}
    try:
        if kind == "httpx":
            async with client.stream("POST", "/v1/completions", json=_body(ids, max_tokens)) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choices = json.loads(line[6:]).get("choices")
                    if not choices:
                        continue
                    c = choices[0]
                    if _chunk(rec, len(c.get("token_ids") or []), c.get("finish_reason"), keep_chunks,
                              leave_after):
                        break
        else:
            body = _body(ids, max_tokens)
            stream = await client.completions.create(
                model=body["model"], prompt=ids, max_tokens=max_tokens, temperature=0, stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True})
            async for chunk in stream:
                if not chunk.choices:
                    continue
                c = chunk.choices[0]
                if _chunk(rec, len(getattr(c, "token_ids", None) or []), c.finish_reason, keep_chunks,
                          leave_after):
                    await stream.close()
                    break
    except Exception as e:  # noqa: BLE001 - every failure is a result of the run
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["end"] = time.time()
    return rec


def run_client(url: str, prompts: list[list[int]], jobs: list[tuple[int, int, float, int | None]],
               max_tokens: int, t0: float, keep_chunks: bool = True, kind: str = "openai",
               ) -> list[dict[str, Any]]:
    """A client process: each job ``(i, prompt index, offset, leave after N chunks or None)``
    sent at ``t0 + offset`` (wall clock), concurrently, through ``kind`` (:data:`CLIENTS`);
    their records in job order, each with ``client_lag_ms``: the mean lag of this process's
    event loop over the run (a timer due every :data:`LAG_PERIOD` s, how late it ran)."""
    import httpx

    async def send(client: Any) -> list[dict[str, Any]]:
        tasks = []
        for i, p, offset, leave in sorted(jobs, key=lambda j: j[2]):
            wait = t0 + offset - time.time()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(_one(client, i, prompts[p], max_tokens, leave, keep_chunks,
                                                  kind)))
        return list(await asyncio.gather(*tasks))

    lags: list[float] = []

    async def watch() -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + LAG_PERIOD
            await asyncio.sleep(LAG_PERIOD)
            lags.append(max(0.0, loop.time() - due))

    async def with_client() -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        if kind == "httpx":
            async with httpx.AsyncClient(base_url=url, limits=limits, timeout=3600) as client:
                return await send(client)
        import openai

        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600,
                                      http_client=openai.DefaultAsyncHttpxClient(limits=limits)) as client:
            return await send(client)

    async def main() -> list[dict[str, Any]]:
        probe = asyncio.get_running_loop().create_task(watch())
        try:
            return await with_client()
        finally:
            probe.cancel()

    recs = asyncio.run(main())
    # the process's loop lag over its run, on each of its records: a client busy parsing
    # other streams' chunks reads a first chunk late by about this much
    lag = 1e3 * sum(lags) / len(lags) if lags else None
    for r in recs:
        r["client_lag_ms"] = lag
    return recs
