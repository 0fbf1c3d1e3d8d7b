"""A client process of tools/bench_http.py: its share of a run's requests, sent through the
``openai`` client (``AsyncOpenAI``, streaming completions) at their arrival times. A module of
its own so that ``multiprocessing``'s spawned processes import it by name."""

from __future__ import annotations

import asyncio
import time
from typing import Any

__all__ = ["run_client"]


async def _one(client: Any, i: int, ids: list[int], max_tokens: int, t0: float, offset: float,
               leave_after: int | None) -> dict[str, Any]:
    """Request ``i`` sent at ``t0 + offset`` (wall clock); its chunk times and tokens."""
    wait = t0 + offset - time.time()
    if wait > 0:
        await asyncio.sleep(wait)
    rec: dict[str, Any] = {"i": i, "sent": time.time(), "chunks": [], "tokens": 0, "error": None,
                           "left": False, "finish": None}
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
                rec["chunks"].append((time.time(), n))
                rec["tokens"] += n
            if c.finish_reason is not None:
                rec["finish"] = c.finish_reason
            if leave_after is not None and len(rec["chunks"]) >= leave_after:
                rec["left"] = True
                await stream.close()
                break
    except Exception as e:  # noqa: BLE001 - every failure is a result of the run
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["end"] = time.time()
    return rec


def run_client(url: str, jobs: list[tuple[int, list[int], float, int | None]], max_tokens: int,
            t0: float) -> list[dict[str, Any]]:
    """A client process: its share of the requests, concurrently."""
    import httpx
    import openai

    async def main() -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600,
                                      http_client=openai.DefaultAsyncHttpxClient(limits=limits)) as client:
            return await asyncio.gather(*(_one(client, i, ids, max_tokens, t0, off, leave)
                                          for i, ids, off, leave in jobs))

    return asyncio.run(main())
