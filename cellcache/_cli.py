"""What every command line of the project shares: usage errors as one line and exit code 2,
Ctrl-C as one line and exit code 130, a closed pipe on stdout as a quiet exit code 141, a file
to write at the end of a run checked before the run starts, every thread's stack on SIGUSR1."""

from __future__ import annotations

import argparse
import faulthandler
import io
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

__all__ = ["INTERRUPTED_EXIT", "PIPE_CLOSED_EXIT", "Parser", "at_least", "in_range", "output_file",
           "run_main", "stacks_on_sigusr1"]

#: Exit code after Ctrl-C: 128 + SIGINT, what a shell reports for a process SIGINT ended.
INTERRUPTED_EXIT = 130

#: Exit code when whoever read stdout went away (``| head``): 128 + SIGPIPE, as ``yes | head``.
PIPE_CLOSED_EXIT = 141


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr and exit code 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def in_range(lo: int, hi: int):
    """An argparse type: an int in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is outside [{lo}, {hi}]")
        return value

    return parse


def at_least(lo: int):
    """An argparse type: an int >= lo."""
    return in_range(lo, 2**62)


def output_file(text: str) -> Path:
    """An argparse type: a file to write at the end of a run (a benchmark's ``--json``), checked
    when the arguments are read so that an hour's run does not end in a traceback and lose its
    result: not a directory, under a directory where this process can create a file (folders
    still missing are made when it is written), and writable where it exists already."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory")
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text} is not writable")
    folder = path.absolute().parent
    while not folder.exists():                 # the nearest folder there is: the others get made
        folder = folder.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {folder} is not a directory")
    try:                                       # a file made and gone (/proc says yes to access())
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text}: cannot create a file in {folder} "
                                         f"({e.strerror or e})") from None
    return path


def stacks_on_sigusr1() -> bool:
    """``kill -USR1 <pid>`` prints every thread's stack to stderr (``faulthandler``: from the
    signal itself, even while a thread holds the interpreter lock); the process goes on.
    False, changing nothing, where stderr has no file descriptor (captured) or the platform
    has no SIGUSR1."""
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (AttributeError, ValueError, RuntimeError, io.UnsupportedOperation):
        return False
    return True


def run_main(prog: str, main: Callable[[], int]) -> int:
    """``main()``'s exit code; a Ctrl-C that ``main`` did not catch is one line on stderr and
    :data:`INTERRUPTED_EXIT` instead of a traceback, and a reader of stdout that went away
    (``| head -c1``) is :data:`PIPE_CLOSED_EXIT`, silently (a closed pipe is the reader's
    choice, as for any Unix filter), with stdout pointed at /dev/null so that the
    interpreter's last flush does not raise again on the way out."""
    try:
        return main()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT
    except BrokenPipeError:
        if sys.stdout is not None:
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError, io.UnsupportedOperation):   # captured, no descriptor
                pass
        return PIPE_CLOSED_EXIT
