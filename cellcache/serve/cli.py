"""``cellcache serve MODEL_DIR``: the OpenAI-compatible HTTP server (needs the ``serve``
extra: FastAPI, uvicorn, prometheus-client).

The listening socket is bound before the model loads, so a port in use is one line and exit
code 2 (as every usage problem); ``--port 0`` takes a free port. Once serving, one line on
stderr says where: ``cellcache serve: serving NAME on http://HOST:PORT``.

SIGTERM or Ctrl-C: stop admitting (503 with Retry-After, ``/health`` 503), let the running
requests finish for up to ``--shutdown-timeout`` seconds, cancel the rest (their streams end
with finish reason ``"abort"``), close the connections, exit 0. A second signal exits at once.

Tensor parallelism: ``torchrun --nproc-per-node N -m cellcache serve DIR --tp N``: rank 0
serves HTTP and steps; the other ranks step in lockstep with it (rank 0 steps at least once
a second while idle so that they never wait on a collective for long).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

from .._cli import Parser, at_least, in_range, stacks_on_sigusr1
from ..errors import CellCacheError

__all__ = ["build_parser", "main"]

#: What ``serve`` imports beyond the ``hf`` extra: the modules of the ``serve`` extra.
SERVE_EXTRA = ("fastapi", "uvicorn", "prometheus_client", "anyio")


def build_parser() -> Parser:
    """The parser of ``cellcache serve``; the Generator's options keep the names
    ``cellcache generate`` gives them."""
    p = Parser(prog="cellcache serve",
               description="Serve a Hugging Face decoder over HTTP with OpenAI's API (/v1/completions, "
                           "/v1/chat/completions, /v1/models, /health, /metrics).")
    p.add_argument("model_dir", metavar="MODEL_DIR",
                   help="a local Hugging Face checkpoint directory with its tokenizer (no download)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=in_range(0, 65535), default=8000, help="port (default 8000; 0: any free)")
    p.add_argument("--served-model-name", default=None,
                   help="the model's name in requests and /v1/models (default: MODEL_DIR's last part)")
    p.add_argument("--max-waiting", type=in_range(1, 1 << 20), default=1024,
                   help="requests accepted without a first token at most; past it: 429 (default 1024)")
    p.add_argument("--stream-interval", type=in_range(1, 1 << 16), default=1,
                   help="tokens a stream gathers before a chunk is sent; its first token and its end "
                        "go at once (default 1: every step's)")
    p.add_argument("--default-max-tokens", type=in_range(1, 1 << 30), default=4096,
                   help="max_tokens of a request that gives none: what fits, at most this (default 4096)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests may take to finish after SIGTERM (default 30)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--capacity", type=in_range(64, 1 << 30), default=1 << 16, help="cells (default 65536)")
    p.add_argument("--max-seqs", type=in_range(1, 1 << 16), default=256,
                   help="sequences running at once (default 256)")
    p.add_argument("--max-batch-tokens", type=in_range(1, 1 << 16), default=None,
                   help="the token budget of a step (default 8192 on a GPU, 512 on the CPU)")
    p.add_argument("--prefill-chunk", type=in_range(1, 1 << 16), default=None,
                   help="prompt tokens one sequence reads a step (default 2048 on a GPU, 256 on the CPU)")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse cached prompt prefixes (default on)")
    p.add_argument("--admission", choices=["fifo", "lpm"], default="fifo")
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay CUDA graphs for decode steps (default: on CUDA)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model's forward")
    p.add_argument("--attention", choices=["auto", "flashinfer"], default="auto")
    p.add_argument("--native", action="store_true",
                   help="cellcache's own forward of a Llama, Mistral, Qwen2, Qwen3 or Gemma (1, 3) "
                        "model (fused q/k/v and gate/up GEMMs, one launch a norm, rotary and SiLU; "
                        "Gemma's norms and GELU as its modules' ops) instead of the model's modules; "
                        "not with --tp")
    p.add_argument("--kv-dtype", choices=["auto", "fp8"], default="auto",
                   help="K/V storage: the model's dtype, or 8-bit e4m3 with per-head scales "
                        "(half the memory a cell takes)")
    p.add_argument("--spill-gib", type=float, default=0.0,
                   help="pinned host memory for the host tier, GiB: preempted sequences' K/V kept "
                        "there instead of recomputed (default 0: off)")
    p.add_argument("--spill-prefixes", action="store_true",
                   help="the prefix cache's evictions go to the host tier too, and a sleep with "
                        "keep_prefixes=true moves the prefix cache there (needs --spill-gib)")
    p.add_argument("--async-steps", action=argparse.BooleanOptionalAction, default=None,
                   help="launch the next decode step before the last one's ids reach the host "
                        "(default: on CUDA with graphs)")
    p.add_argument("--tp", type=at_least(1), default=1,
                   help="tensor-parallel ranks: run under torchrun --nproc-per-node N (default 1)")
    p.add_argument("--enable-sleep", action="store_true",
                   help="serve POST /sleep?level=1|2[&keep_prefixes=true], POST /wake_up and GET "
                        "/is_sleeping (the generator's sleep: KV memory, and at level 2 the weights, "
                        "given back between uses); off by default: any client could stop the server")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="step the generator in a process of its own, the HTTP front end in this one, "
                        "so that streaming never holds up a step (default: on, off under --tp)")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="info")
    return p


def _missing_extra() -> str | None:
    """The first module of the ``serve`` extra that cannot be imported, or None."""
    import importlib.util

    for name in SERVE_EXTRA:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except (ImportError, ValueError):
            return name
    return None


def _bind(p: Parser, host: str, port: int) -> socket.socket:
    """The listening socket, or a usage error (one line, exit 2)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        p.error(f"--host {host}: {e.strerror or e}")
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        p.error(f"cannot listen on {host}:{port}: {e.strerror or e}")
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> int:
    """``cellcache serve``; returns the exit code (0 after a graceful shutdown)."""
    p = build_parser()
    args = p.parse_args(argv)
    if not (args.shutdown_timeout >= 0 and args.shutdown_timeout < 1e6):
        p.error(f"--shutdown-timeout must be a number of seconds in [0, 1e6), not {args.shutdown_timeout}")
    if args.max_batch_tokens is not None and args.max_batch_tokens > args.capacity:
        p.error("--max-batch-tokens must be at most --capacity")
    if args.enable_sleep and (args.tp > 1 or os.environ.get("WORLD_SIZE", "1") != "1"):
        p.error("--enable-sleep serves one process: its ranks would have to sleep in lockstep")
    if not (args.spill_gib == 0 or 2**-10 <= args.spill_gib <= 4096):
        p.error(f"--spill-gib {args.spill_gib} is outside [1/1024 (1 MiB), 4096], or 0 (off)")
    if args.spill_prefixes and not (args.spill_gib and args.prefix_cache):
        p.error("--spill-prefixes keeps the prefix cache's evictions in the host tier: give --spill-gib "
                "(and leave the prefix cache on)")
    if args.spill_gib and args.tp > 1:
        p.error("--spill-gib does not serve under --tp (each rank would spill its own shard)")
    if args.native and args.tp > 1:
        p.error("--native does not serve under --tp (its forward has no all-reduces)")
    tp = args.tp > 1 or os.environ.get("WORLD_SIZE", "1") != "1"
    if args.engine_process and tp:
        p.error("--engine-process serves one process: under --tp rank 0 steps beside its HTTP front end")
    missing = _missing_extra()
    if missing is not None:
        p.error(f"needs the 'serve' extra (no module named {missing!r}): pip install 'cellcache[serve]'")
    if not os.path.isdir(args.model_dir):
        p.error(f"MODEL_DIR {args.model_dir}: not a directory (nothing is downloaded: give a local "
                "checkpoint)")
    if args.device == "cuda" and not _cuda():
        p.error("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    stacks_on_sigusr1()                        # kill -USR1: every thread's stack
    device = None if args.device == "auto" else args.device
    rank, world, place = 0, 1, device
    if args.tp > 1 or os.environ.get("WORLD_SIZE", "1") != "1":     # under torchrun
        from ..generate.cli import init_tp

        try:
            rank, world, place = init_tp(args.tp, device or ("cuda" if _cuda() else "cpu"))
        except ValueError as e:
            p.error(str(e))
    sock = _bind(p, args.host, args.port) if rank == 0 else None
    if world == 1 and args.engine_process is not False:
        assert sock is not None
        return _serve_split(p, args, device, sock)
    gen = _load(p, args, place if world > 1 else device, world)
    if rank != 0:
        return _follow(gen)
    assert sock is not None
    return _serve(args, gen, sock, world)


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _load(p: Parser, args: Any, device: str | None, world: int) -> Any:
    """The Generator over MODEL_DIR, or a usage error (one line, exit 2)."""
    from .process import EngineLoadError

    try:
        return load_generator(args, device, world)
    except EngineLoadError as e:
        p.error(str(e))


def load_generator(args: Any, device: str | None, world: int = 1) -> Any:
    """The Generator over MODEL_DIR with the options of ``args``, warmed up; EngineLoadError
    (its message one line for the user) when it cannot be (the engine process runs this)."""
    from ..generate import Generator
    from ..generate.cli import is_out_of_memory
    from .process import EngineLoadError

    kwargs: dict[str, Any] = dict(
        capacity=args.capacity, max_seqs=args.max_seqs, max_batch_tokens=args.max_batch_tokens,
        prefill_chunk=args.prefill_chunk, prefix_cache=args.prefix_cache, admission=args.admission,
        graphs=args.graphs, compile=args.compile, attention=args.attention, async_steps=args.async_steps,
        kv_dtype=None if args.kv_dtype == "auto" else "float8_e4m3fn",
        spill_bytes=int(args.spill_gib * (1 << 30)), spill_prefixes=args.spill_prefixes,
        native=args.native)
    if world > 1:
        kwargs["tp"] = world
    try:
        gen = Generator.from_pretrained(args.model_dir, dtype=args.dtype, device=device, **kwargs)
        if gen.tokenizer is None:
            logging.getLogger("cellcache.serve").warning(
                "%s has no tokenizer: only token-id prompts are served, texts are empty", args.model_dir)
        gen.warmup()
    except (CellCacheError, OSError, ValueError) as e:
        raise EngineLoadError(f"cannot serve {args.model_dir}: {type(e).__name__}: "
                              f"{' '.join(str(e).split())}") from None
    except (RuntimeError, MemoryError) as e:
        if not is_out_of_memory(e):
            raise
        raise EngineLoadError(
            f"serving {args.model_dir} ran out of memory; give a smaller --capacity or "
            "--max-batch-tokens, a --dtype of half the size, or a device with more free memory") from None
    return gen


def _follow(gen: Any) -> int:
    """A rank other than 0 under --tp: steps in lockstep with rank 0 until its group ends.
    SIGTERM and Ctrl-C (which torchrun passes to every rank) are rank 0's to act on: this
    rank steps on while rank 0 drains, and ends when rank 0 has left."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    try:
        while True:
            gen.step()
    except (RuntimeError, CellCacheError):           # rank 0 left: the group is gone
        return 0


def _serve(args: Any, gen: Any, sock: socket.socket, world: int) -> int:
    """Serves with the engine thread in this process (``--no-engine-process``, ``--tp``)."""
    from .engine import Engine
    from .protocol import ServeLimits

    max_pos = getattr(getattr(gen.model, "config", None), "max_position_embeddings", None)
    limits = ServeLimits(capacity=gen.cache.config.capacity,
                         max_positions=max_pos if isinstance(max_pos, int) and max_pos > 0 else None,
                         default_max_tokens=args.default_max_tokens)
    engine = Engine(gen, max_waiting=args.max_waiting, idle_tick=1.0 if world > 1 else None,
                    stream_interval=args.stream_interval)
    return _run(args, engine, limits, sock)


def _serve_split(p: Parser, args: Any, device: str | None, sock: socket.socket) -> int:
    """Serves with the generator in an engine process (:mod:`cellcache.serve.process`): the
    tokenizer loads here while the model loads there."""
    from ..errors import InvalidArgument
    from ..generate.prompts import load_tokenizer
    from .process import EngineClient, EngineLoadError
    from .protocol import ServeLimits

    build = functools.partial(load_generator, args, device)
    engine = EngineClient(build, tokenizer=None, max_waiting=args.max_waiting,
                          stream_interval=args.stream_interval, log_level=args.log_level)
    try:
        engine.spawn()
        engine.tokenizer = load_tokenizer(args.model_dir)
        engine.wait_ready()
    except (EngineLoadError, InvalidArgument) as e:
        engine.stop(10)
        p.error(str(e) if isinstance(e, EngineLoadError) else f"cannot serve {args.model_dir}: {e}")
    limits = ServeLimits(capacity=engine.capacity, max_positions=engine.max_positions,
                         default_max_tokens=args.default_max_tokens)
    try:
        return _run(args, engine, limits, sock)
    finally:
        engine.stop(10)


def _run(args: Any, engine: Any, limits: Any, sock: socket.socket) -> int:
    import uvicorn

    from .app import build_app

    name = args.served_model_name or os.path.basename(os.path.normpath(args.model_dir))
    app = build_app(engine, model_name=name, limits=limits, drain_timeout=args.shutdown_timeout,
                    enable_sleep=args.enable_sleep)
    config = uvicorn.Config(app, log_level=args.log_level, lifespan="on", timeout_graceful_shutdown=5,
                            access_log=args.log_level in ("info", "debug"))
    server = _make_server(config, engine, args.shutdown_timeout, f"serving {name} on {_url(sock)}")
    # what start-up built stays: the collector's full passes, which a long-running server's
    # streams trigger, skip it (vLLM freezes the same way)
    gc.collect()
    gc.freeze()
    server.run(sockets=[sock])
    return 0


def _url(sock: socket.socket) -> str:
    """Where ``sock`` listens, as a URL a client can use (an IPv6 address in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _make_server(config: Any, engine: Any, grace: float, banner: str) -> Any:
    """A uvicorn Server whose signals drain the engine (:class:`_Drain`) instead of closing at
    once, which prints ``banner`` once it listens, and which never re-raises the signal it
    caught (so a graceful shutdown exits 0)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with _signals(_Drain(self, engine, grace)):
                yield

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                print(f"cellcache serve: {banner}", file=sys.stderr, flush=True)

    return Server(config)


class _Drain:
    """SIGTERM / SIGINT for a uvicorn server: the first drains the engine (503 for new
    requests, running ones finish or are cancelled after the grace) and then asks uvicorn to
    exit; a second one exits at once."""

    def __init__(self, server: Any, engine: Any, grace: float):
        self.server, self.engine, self.grace = server, engine, grace
        self.task: asyncio.Task | None = None

    def __call__(self, sig: int, frame: Any) -> None:
        if self.task is not None:
            self.server.should_exit = self.server.force_exit = True
            return
        loop = asyncio.get_event_loop()             # (the handler runs on the loop's thread)
        self.task = loop.create_task(self.drain())
        loop.call_soon_threadsafe(lambda: None)     # wakes the loop's select() now

    async def drain(self) -> None:
        try:
            await self.engine.drain(self.grace)
        finally:
            self.server.should_exit = True


@contextlib.contextmanager
def _signals(handler: Any) -> Iterator[None]:
    """``handler`` for SIGTERM and SIGINT inside (main thread only), the old ones restored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)

