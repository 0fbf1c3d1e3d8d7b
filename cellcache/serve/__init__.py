"""``cellcache serve``: an OpenAI-compatible HTTP server over the Generator (the ``serve``
extra: FastAPI, uvicorn, prometheus-client).

Modules, by concern: ``protocol`` (request and response bodies, their checks and their
mapping onto :class:`~cellcache.generate.Sampling`, OpenAI-style errors), ``engine`` (the
one thread that steps the Generator, the bridge of its callbacks to the event loop,
admission bounds, cancel on disconnect, drain), ``metrics`` (Prometheus), ``app`` (the
FastAPI routes), ``cli`` (``cellcache serve`` and the graceful shutdown).
docs/design/http.md has the picture.
"""

from __future__ import annotations

from .cli import main

__all__ = ["main"]
