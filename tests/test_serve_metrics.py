"""The server's metrics that no request observes: the front end's event loop lag."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("prometheus_client")

from cellcache.serve.metrics import Metrics  # noqa: E402


class _Idle:
    snapshot: dict = {}
    draining = False

    def tokens_per_second(self) -> float:
        return 0.0


def _lag(m: Metrics) -> tuple[float, float]:
    """(count, sum in seconds) of the loop lag histogram."""
    samples = {s.name: s.value for fam in m.registry.collect() for s in fam.samples
               if fam.name == "cellcache_event_loop_lag_seconds"}
    return samples["cellcache_event_loop_lag_seconds_count"], samples["cellcache_event_loop_lag_seconds_sum"]


def test_a_blocked_loop_shows_as_lag_and_the_probe_stops_when_cancelled():
    m = Metrics(_Idle())

    async def run() -> None:
        probe = asyncio.get_running_loop().create_task(m.watch_loop(0.01))
        await asyncio.sleep(0.05)
        time.sleep(0.2)                     # a callback holding the loop: the probe's timer waits
        await asyncio.sleep(0.05)
        probe.cancel()
        with pytest.raises(asyncio.CancelledError):
            await probe

    asyncio.run(run())
    count, total = _lag(m)
    assert count >= 3 and total >= 0.15, (count, total)
    assert b"cellcache_event_loop_lag_seconds_bucket" in m.render()
    # cancelled: nothing observed afterwards
    asyncio.run(asyncio.sleep(0.05))
    assert _lag(m)[0] == count
