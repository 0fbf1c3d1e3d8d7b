"""``/metrics`` of ``cellcache serve``: Prometheus text from a registry of the server's own
(never the process-global one, so several servers can live in one process).

Gauges read the engine's snapshot at scrape time (refreshed after every step on the engine
thread, so a scrape never waits for a step): requests running / waiting, KV cells used /
free / capacity, the prefix cache's hit rate (cached prompt tokens over prompt tokens since
start), output tokens a second over the last seconds, torch's device memory (CUDA) and the
resident memory of the process that steps the generator, the front end's own resident memory
and CPU time. Counters: prompt, cached and
generated tokens, requests by finish reason, HTTP errors by status. Histograms, observed when
a request ends: time to first token, inter-token latency, end-to-end latency (seconds); and
the front end's event loop lag (how late a timer due every 10 ms ran: a busy loop delays
every request's parsing and every chunk, which no request's own histogram shows).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Latency buckets in seconds, from a CPU-bound token to a long request.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
LAG_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
#: How often the front end's loop is probed for lag (seconds).
LAG_PERIOD = 0.01


class _EngineCollector(Collector):
    """The gauges and the generator's counters, read from the engine at scrape time."""

    def __init__(self, engine: Any):
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        snap = self.engine.snapshot
        stats = snap.get("stats", {})
        cap, free = snap.get("capacity", 0), snap.get("free_cells", 0)
        gauges = (
            ("cellcache_requests_running", "Continuations running in the generator", snap.get("running", 0)),
            ("cellcache_requests_waiting", "Requests accepted without a first token yet",
             snap.get("waiting", 0)),
            ("cellcache_requests_live", "Requests accepted and not done", snap.get("live", 0)),
            ("cellcache_kv_cells_used", "KV cells in use (running sequences and the prefix cache)",
             cap - free),
            ("cellcache_kv_cells_free", "KV cells free", free),
            ("cellcache_kv_cells_capacity", "KV cells in the cache", cap),
            ("cellcache_prefix_hit_rate", "Prompt tokens served from the prefix cache over prompt tokens",
             stats.get("cached_tokens", 0) / stats["prompt_tokens"] if stats.get("prompt_tokens") else 0.0),
            ("cellcache_tokens_per_second", "Output tokens a second over the last 10 s",
             self.engine.tokens_per_second()),
            ("cellcache_draining", "1 while the server shuts down", int(self.engine.draining)),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        # (read by the engine, which may be a process of its own: the front end's torch has
        # no device memory)
        memory = (("cellcache_gpu_memory_allocated_bytes", "torch's allocated device memory (the engine's)",
                   "gpu_allocated_bytes"),
                  ("cellcache_gpu_memory_reserved_bytes", "torch's reserved device memory (the engine's)",
                   "gpu_reserved_bytes"),
                  ("cellcache_engine_resident_memory_bytes",
                   "Resident memory of the process that steps the generator", "rss_bytes"))
        for name, doc, key in memory:
            if key in snap:
                yield GaugeMetricFamily(name, doc, value=snap[key])
        counters = (("cellcache_prompt_tokens", "Prompt tokens admitted", "prompt_tokens"),
                    ("cellcache_cached_prompt_tokens", "Prompt tokens found in the prefix cache",
                     "cached_tokens"),
                    ("cellcache_computed_prompt_tokens", "Prompt tokens computed", "computed_tokens"),
                    ("cellcache_generation_tokens", "Output tokens", "tokens_out"),
                    ("cellcache_steps", "Generator steps", "steps"),
                    ("cellcache_preemptions", "Sequences preempted", "preempted"))
        for name, doc, key in counters:
            yield CounterMetricFamily(name, doc, value=stats.get(key, 0))


class Metrics:
    """The server's registry: the engine's gauges and counters, request histograms, finish
    reasons, HTTP errors. :meth:`observe` records an ended request (any thread)."""

    def __init__(self, engine: Any):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        ProcessCollector(registry=self.registry)      # process_resident_memory_bytes, CPU seconds
        r = self.registry
        self.ttft = Histogram("cellcache_time_to_first_token_seconds", "Time to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        #: A streamed request's handler start to its first token's chunk on the way out: the
        #: engine's TTFT plus the pipe both ways and the front end's loop (not the client's
        #: side of HTTP), so that a TTFT gap can be placed.
        self.http_ttft = Histogram("cellcache_http_time_to_first_token_seconds",
                                   "Request received to its first token's chunk written (streamed)",
                                   buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("cellcache_inter_token_latency_seconds", "Gap between consecutive tokens",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("cellcache_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=E2E_BUCKETS, registry=r)
        self.finished = Counter("cellcache_request_finished", "Continuations ended, by reason",
                                ["reason"], registry=r)
        self.errors = Counter("cellcache_http_errors", "Error responses, by status", ["status"], registry=r)
        self.loop_lag = Histogram("cellcache_event_loop_lag_seconds",
                                  "How late the front end's event loop ran a timer (sampled every 10 ms)",
                                  buckets=LAG_BUCKETS, registry=r)

    async def watch_loop(self, period: float = LAG_PERIOD) -> None:
        """Observes the running loop's lag every ``period`` seconds until cancelled: a sleep
        of ``period`` that ends late by the time the loop was busy with other callbacks."""
        import asyncio

        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + period
            await asyncio.sleep(period)
            self.loop_lag.observe(max(0.0, loop.time() - due))

    def observe(self, req: Any) -> None:
        """Records an ended request: TTFT, every inter-token gap, end-to-end, its reasons."""
        if req.ttft is not None:
            self.ttft.observe(req.ttft)
        for gap in req.itl():
            self.itl.observe(gap)
        if req.finished is not None:
            self.e2e.observe(req.finished - req.arrived)
        for reason in req.finish_reasons:
            self.finished.labels(reason=str(reason)).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
