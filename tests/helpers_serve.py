"""``cellcache serve`` as a subprocess for the server's tests and tools/bench_http.py: started
on a free port (``--port 0``; the port read from the line it prints once listening), waited
for on ``/health``, stopped in teardown; its output goes to a file (never a pipe that could
fill and block it)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BANNER = re.compile(r"cellcache serve: serving (\S+) on (http://\S+)")


class ServerProcess:
    """``python -m cellcache serve MODEL_DIR --port 0 ARGS...``; :attr:`url` (``http://host:port``)
    and :attr:`name` once :meth:`start` returned."""

    def __init__(self, model_dir: str | Path, *args: str, timeout: float = 120.0,
                 log_path: str | Path | None = None):
        self.model_dir, self.args, self.timeout = str(model_dir), list(args), timeout
        # (a log_path given is the caller's to keep; the default one goes with stop())
        self.keep_log = log_path is not None
        self.log = open(log_path, "w+b") if log_path is not None else \
            tempfile.NamedTemporaryFile("w+b", prefix="cellcache-serve-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.name = ""

    def start(self) -> ServerProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", "cellcache", "serve", self.model_dir, "--port", "0", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            m = BANNER.search(self.output())
            if m:
                self.name, self.url = m.group(1), m.group(2)
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.1)
        else:
            self.stop()
            raise RuntimeError(f"the server did not start in {self.timeout} s:\n{self.output()}")
        while time.monotonic() < deadline:
            if self.get("/health")[0] == 200:
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"/health did not answer 200:\n{self.output()}")

    def output(self) -> str:
        """Everything the server wrote so far."""
        with open(self.log.name, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def get(self, path: str) -> tuple[int, str, dict[str, str]]:
        """GET ``path``: (status, body, headers); status 0 when nothing answers."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as r:
                return r.status, r.read().decode(), _lower(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(), _lower(e.headers)
        except OSError:
            return 0, "", {}

    def post(self, path: str, body: Any) -> tuple[int, Any, dict[str, str]]:
        """POST ``body`` (JSON unless bytes) to ``path``: (status, parsed JSON or text, headers)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                status, text, headers = r.status, r.read().decode(), _lower(r.headers)
        except urllib.error.HTTPError as e:
            status, text, headers = e.code, e.read().decode(), _lower(e.headers)
        try:
            return status, json.loads(text), headers
        except ValueError:
            return status, text, headers

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{name{labels}: value}``."""
        status, text, _ = self.get("/metrics")
        assert status == 200, text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def engine_pid(self) -> int | None:
        """The server's engine process (its child other than multiprocessing's resource
        tracker), or None (Linux /proc)."""
        assert self.proc is not None
        pid = self.proc.pid
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            return None
        for child in children:
            try:
                with open(f"/proc/{child}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if b"resource_tracker" not in cmdline:
                return child
        return None

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> None:
        """Kills the server (if running) and removes its log."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()
        if self.keep_log:
            return
        try:
            os.unlink(self.log.name)
        except OSError:
            pass

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _lower(headers: Any) -> dict[str, str]:
    """Response headers by lower-case name."""
    return {k.lower(): v for k, v in headers.items()}


def wait_until(predicate: Any, timeout: float = 60.0, what: str = "the condition") -> None:
    """Polls ``predicate()`` until it is true; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen in {timeout} s")
