"""Width buckets: the padded widths a runner captures one CUDA graph for.

A step of width ``w`` runs at the smallest bucket ``B >= w`` (``prepare_step(pad_to=B)``),
so one graph per bucket serves every step. The rule and the default list live here, once:
the simulated session, the demo, :class:`cellcache.runner.ModelRunner` and the graph tool all
ask this module.

>>> default_buckets(48)
[1, 2, 4, 8, 16, 32, 48]
>>> bucket_for(5, [1, 2, 4, 8])
8
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ._checks import check_int
from .errors import InvalidArgument

__all__ = ["bucket_for", "check_buckets", "default_buckets", "default_mixed_buckets"]


def default_buckets(max_write: int, largest: int | None = None) -> list[int]:
    """Powers of two below ``min(max_write, largest)``, then that width itself, so every
    width up to it has a bucket."""
    top = check_int(max_write, "max_write", 1)
    if largest is not None:
        top = min(top, check_int(largest, "largest", 1))
    out = []
    b = 1
    while b < top:
        out.append(b)
        b *= 2
    return out + [top]


def default_mixed_buckets(max_write: int) -> list[int]:
    """Token-count buckets for mixed steps (prompt chunks beside decode rows): powers of two
    from 16 to 1024, then every multiple of 1024, up to ``max_write`` (itself included), so
    a step above 1024 tokens pads by less than 1024 rows.

    >>> default_mixed_buckets(4096)
    [16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4096]
    """
    top = check_int(max_write, "max_write", 1)
    out = {b for b in (16, 32, 64, 128, 256, 512, 1024) if b < top}
    out.update(range(2048, top, 1024))
    out.add(top)
    return sorted(out)


def check_buckets(buckets: Iterable[int], max_write: int) -> list[int]:
    """``buckets`` sorted without repeats; InvalidArgument (naming the value) unless they
    are ints in ``[1, max_write]``, at least one."""
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Iterable):
        raise InvalidArgument(f"buckets of type {type(buckets).__name__} is not a list of widths")
    out = sorted({check_int(b, "bucket", 1, max_write) for b in buckets})
    if not out:
        raise InvalidArgument(f"buckets is empty; give widths in [1, max_write={max_write}]")
    return out


def bucket_for(width: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding ``width`` rows (``buckets`` ascending); None when none
    does."""
    return next((b for b in buckets if b >= width), None)
