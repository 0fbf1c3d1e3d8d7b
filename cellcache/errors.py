"""The exceptions cellcache raises.

Every message says what was wrong, the offending value and what would be accepted.
Each class also derives from the builtin a caller would naturally catch, so
``except ValueError`` around a bad argument or ``except MemoryError`` around a step
keeps working for code that has never heard of cellcache.
"""

from __future__ import annotations

__all__ = [
    "CellCacheError",
    "CudaError",
    "InvalidArgument",
    "InvalidState",
    "OutOfMemory",
    "StepTooLarge",
]


class CellCacheError(Exception):
    """Base class of every error cellcache raises on purpose."""


class InvalidArgument(CellCacheError, ValueError):
    """An argument is out of range or of the wrong type (a bad id, width, config field)."""


class StepTooLarge(InvalidArgument):
    """A declared step would not fit a fixed-size step buffer (the paged view's ``max_kv``).

    Raised by ``declare_step`` with nothing declared; unlike ``False`` (too few free cells)
    it does not go away by freeing cells: split the step, or build the cache with a larger
    ``max_kv``.
    """


class InvalidState(CellCacheError, RuntimeError):
    """The call is well-formed but not allowed now (sequence not live, no declared step)."""


class OutOfMemory(CellCacheError, MemoryError):
    """An allocation failed; the cache is exactly as it was before the call."""


class CudaError(CellCacheError, RuntimeError):
    """A CUDA driver call failed; the message carries the result's code and name."""

    def __init__(self, message: str, code: int | None = None, name: str | None = None):
        super().__init__(message)
        self.code = code
        self.name = name
