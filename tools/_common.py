"""What the tools share: the checkout on ``sys.path`` (a tool runs from a checkout whose
extensions were built in place, installed or not), progress lines on stderr, one way to
say that a tool needs a GPU, and the record a benchmark's JSON opens with (which benchmark,
when, by what command, on what device) with the canonical file it lands in.

Every tool starts with ``from _common import ...``: running ``python tools/NAME.py`` puts
``tools/`` first on ``sys.path``; tests that load a tool by path put it there themselves.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: Exit code of a GPU tool on a machine without a usable CUDA device.
NO_GPU_EXIT = 3

#: Where the current result of each benchmark lives, as ``<benchmark>.json``; its README is
#: the index ``tools/results_index.py`` generates from them.
RESULTS = ROOT / "benchmarks" / "results"


def cell_bytes(model_config: Any, element_bytes: int) -> int:
    """Bytes one cell holds for a transformers decoder config: K and V of every layer, at
    ``element_bytes`` a stored element."""
    cfg = model_config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * element_bytes


def log(msg: str) -> None:
    """A progress line on stderr (stdout stays for results)."""
    print(msg, file=sys.stderr, flush=True)


def cuda_usable() -> tuple[bool, str]:
    """cellcache's probe: (True, "") or (False, the one-line reason)."""
    from cellcache.cuda.probe import cuda_usable as probe

    return probe()


def require_gpu(prog: str, probe: Callable[[], tuple[bool, str]] | None = None) -> int | None:
    """None when a CUDA device is usable; else prints one line saying why and returns
    :data:`NO_GPU_EXIT` for the tool to exit with."""
    ok, why = (probe or cuda_usable)()
    if ok:
        return None
    print(f"{prog}: {why}; this tool needs a GPU (exit {NO_GPU_EXIT})")
    return NO_GPU_EXIT


def device_name(device: str, gpus: int = 1) -> str:
    """What a benchmark ran on, for its record: on ``"cuda"`` the GPU's name as the driver
    gives it (``"NVIDIA H200"``; ``"2 x NVIDIA H200"`` when ``gpus`` > 1), otherwise the
    CPU's architecture and core count. Needs torch for the GPU's name ("unknown GPU"
    without it)."""
    if device == "cuda":
        try:
            import torch

            name = torch.cuda.get_device_name(0)
        except Exception:  # noqa: BLE001 - the record says it does not know
            name = "unknown GPU"
        return name if gpus <= 1 else f"{gpus} x {name}"
    return f"{platform.machine() or 'unknown'} CPU, {os.cpu_count() or '?'} cores"


def run_record(benchmark: str, command: Sequence[str], device: str, gpus: int = 1) -> dict:
    """The fields every result JSON opens with: ``benchmark`` (the stem of its canonical
    file, ``RESULTS / f"{benchmark}.json"``), ``date`` (UTC, ``YYYY-MM-DD``), ``command``
    (the words that ran it, shell-quoted) and ``device`` (:func:`device_name`)."""
    return {"benchmark": benchmark, "date": _dt.datetime.now(_dt.timezone.utc).date().isoformat(),
            "command": shlex.join(command), "device": device_name(device, gpus)}
