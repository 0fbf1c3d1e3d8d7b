"""What a prefix cache tells a router: events (a prefix stored, evicted, dropped, or
everything cleared), keyed so that a router computes the same key from a prompt, and
delivered once the operation that queued them has finished, the tree and the cache
consistent."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Operations", "PrefixEvent", "prefix_key"]


def prefix_key(tokens: Any) -> str:
    """The key events carry for a prefix: blake2b-128 (hex) of the tokens as int32
    little-endian bytes. Independent of how a tree splits the prefix into nodes, so a router
    computes the same key from a prompt's first ``length`` tokens."""
    arr = np.ascontiguousarray(np.asarray(tokens, dtype="<i4"))
    return hashlib.blake2b(arr.tobytes(), digest_size=16).hexdigest()


class PrefixEvent:
    """A change of what a prefix cache holds, for a router of several replicas.

    - ``kind``: ``"stored"`` (the prefix ``tokens[:length]`` is now cached; its last ``n``
      tokens are new), ``"evicted"`` (the prefix ``tokens[:length]`` lost its last ``n``
      tokens; ``tokens[:length - n]`` may still be cached), ``"cleared"`` (everything
      dropped by :meth:`PrefixCache.clear`, ``n`` tokens) or ``"invalidated"`` (everything
      forgotten because the cache was cleared underneath, ``n`` tokens) or ``"dropped"`` (as
      ``"evicted"``, for a lent prefix whose lender reclaimed it when no id could be had to
      keep it; pins on those tokens went with them).
    - ``tokens``: the prefix, a read-only int32 array (empty for cleared/invalidated).
    - ``key``: :func:`prefix_key` of ``tokens`` (computed when first read).
    """

    __slots__ = ("_key", "kind", "length", "n", "tokens")

    def __init__(self, kind: str, tokens: np.ndarray, n: int):
        self.kind = kind
        self.tokens = tokens
        self.length = len(tokens)
        self.n = n
        self._key: str | None = None

    @property
    def key(self) -> str:
        if self._key is None:
            self._key = prefix_key(self.tokens)
        return self._key

    def __repr__(self) -> str:
        return f"PrefixEvent({self.kind!r}, length={self.length}, n={self.n})"


class Operations:
    """One operation at a time, and what it leaves to deliver: ``with ops:`` holds the
    lock (re-entrant) for one operation; on the way out, even when the operation raised,
    the events it queued in ``events`` go to ``on_event`` (None: queue none), then the
    first exception it recorded with :meth:`fail` (user code that failed in the middle of
    it, a policy key, say) is raised, unless the operation raised one of its own. The
    first exception of ``on_event`` propagates after every event was delivered."""

    __slots__ = ("events", "failure", "lock", "on_event")

    def __init__(self, on_event: Callable[[PrefixEvent], Any] | None):
        self.lock = threading.RLock()
        self.on_event = on_event
        self.events: list[PrefixEvent] = []
        self.failure: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        """Records ``error`` to raise once the operation is whole (the first one only)."""
        if self.failure is None:
            self.failure = error

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        try:
            if self.events:
                self._deliver()
        finally:
            failure, self.failure = self.failure, None
            self.lock.release()
        if failure is not None and exc[0] is None:
            raise failure

    def _deliver(self) -> None:
        events, self.events = self.events, []
        error: BaseException | None = None
        for ev in events:
            try:
                self.on_event(ev)  # type: ignore[misc]
            except BaseException as e:  # noqa: BLE001 - re-raised below
                if error is None:
                    error = e
        if error is not None:
            raise error
