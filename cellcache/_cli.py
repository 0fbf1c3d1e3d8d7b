"""What every command line of the project shares: usage errors as one line and exit code 2,
every thread's stack on SIGUSR1."""

from __future__ import annotations

import argparse
import faulthandler
import io
import signal
import sys
from typing import NoReturn

__all__ = ["Parser", "at_least", "in_range", "stacks_on_sigusr1"]


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
