"""A client process of tools/bench_http.py: its share of a run's requests, sent through the
``openai`` client (``AsyncOpenAI``, streaming completions) at their arrival times. A module of
its own so that ``multiprocessing``'s spawned processes import it by name."""

from __future__ import annotations

import asyncio
import time
from typing import Any

__all__ = ["run_client"]


async def _one(client: Any, i: int, ids: list[int], max_tokens: int, leave_after: int | None,
               keep_chunks: bool) -> dict[str, Any]:
    """Request ``i``, sent now: its chunks (``(time, tokens)`` each with ``keep_chunks``; else
    only the first's and the last's times and their count), tokens, finish reason, error."""
    rec: dict[str, Any] = {"i": i, "sent": time.time(), "chunks": [], "n_chunks": 0, "first": None,
                           "last": None, "tokens": 0, "error": None, "left": False, "finish": None}
    try:
        stream = await client.completions.create(
            model="bench", prompt=ids, max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        async for chunk in stream:
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            n = len(getattr(c, "token_ids", None) or [])
            if n:
                now = time.time()
                if keep_chunks:
                    rec["chunks"].append((now, n))
                if rec["first"] is None:
                    rec["first"] = now
                rec["last"] = now
                rec["n_chunks"] += 1
                rec["tokens"] += n
            if c.finish_reason is not None:
                rec["finish"] = c.finish_reason
            if leave_after is not None and rec["n_chunks"] >= leave_after:
                rec["left"] = True
                await stream.close()
                break
    except Exception as e:  # noqa: BLE001 - every failure is a result of the run
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["end"] = time.time()
    return rec


def run_client(url: str, prompts: list[list[int]], jobs: list[tuple[int, int, float, int | None]],
               max_tokens: int, t0: float, keep_chunks: bool = True) -> list[dict[str, Any]]:
    """A client process: each job ``(i, prompt index, offset, leave after N chunks or None)``
    sent at ``t0 + offset`` (wall clock), concurrently; their records in job order."""
    import httpx
    import openai

    async def main() -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        tasks = []
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600,
                                      http_client=openai.DefaultAsyncHttpxClient(limits=limits)) as client:
            for i, p, offset, leave in sorted(jobs, key=lambda j: j[2]):
                wait = t0 + offset - time.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                tasks.append(asyncio.create_task(_one(client, i, prompts[p], max_tokens, leave, keep_chunks)))
            return list(await asyncio.gather(*tasks))

    return asyncio.run(main())
