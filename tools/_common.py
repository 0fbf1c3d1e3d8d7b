"""What the tools share: the checkout on ``sys.path`` (a tool runs from a checkout whose
extensions were built in place, installed or not), progress lines on stderr, and one way to
say that a tool needs a GPU.

Every tool starts with ``from _common import ...``: running ``python tools/NAME.py`` puts
``tools/`` first on ``sys.path``; tests that load a tool by path put it there themselves.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: Exit code of a GPU tool on a machine without a usable CUDA device.
NO_GPU_EXIT = 3


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
