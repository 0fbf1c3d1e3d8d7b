"""The agreement's own gloo group, and every wait on it bounded.

A :class:`cellcache.tp.TPCache` agrees over a gloo group of its own (:func:`agreement_group`),
never the model's: the values are host decisions (with NCCL a per-step collective on the
device group would need a device round trip), and a group apart from the model's means an
agreement never pairs with a model collective. A rank that fails on its own between two
agreements then waits in the agreement while the others wait in the model's collectives,
and the timeout ends both (on a shared group the two collectives could pair with each other).

Every wait is bounded by the timeout ``group`` was made with (``init_process_group(timeout=)``
or ``new_group(timeout=)``; :func:`group_timeout`): the agreement's group is made with the
same one, and gloo applies it to each wait of a collective. A rank that stops answering
(stopped, hung, out of step) ends the others' wait after the timeout; a rank that dies closes
its connections and ends it at once. Either way every other rank raises InvalidState on one
line naming the rank (:meth:`Peers.lost_error`; with more than two ranks the rank is found
by a roll call through the default group's store), and :attr:`Peers.lost` keeps the line:
the wrapper refuses every later call with it. :meth:`Peers.peer_error` says the same of a
failure inside the model's collectives.
"""

from __future__ import annotations

import datetime
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from ..errors import CellCacheError, InvalidState

__all__ = ["Peers", "agreement_group", "group_timeout"]

#: With more than two ranks, a rank whose collective failed waits for the others' reports of
#: their own failure until this many seconds past the moment every rank still alive has
#: failed too (the timeout after the collective began); the ranks that sent none are named.
ROLL_CALL_GRACE = 2.0

#: What gloo (or another backend) says when a peer is gone or silent, as opposed to an error
#: of the operation itself.
TRANSPORT = re.compile(r"gloo/transport|timed out|connection (?:closed|reset|refused)|"
                       r"broken pipe|pair closure", re.IGNORECASE)


def group_timeout(group: Any) -> datetime.timedelta:
    """The timeout ``group`` (None: the default group) was made with, read from its backend;
    torch's default for gloo when no backend tells (torch made the group without one)."""
    pg: Any = dist.group.WORLD if group is None else group
    for device in getattr(pg, "_device_types", None) or (torch.device("cpu"),):
        try:
            timeout = pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            return timeout
    return default_pg_timeout                    # what torch gives a gloo group without one


def agreement_group(group: Any, timeout: datetime.timedelta) -> Any:
    """A gloo group of its own over ``group``'s ranks, with ``group``'s timeout (created
    collectively: every rank builds its TPCache at the same point). Never the model's group,
    even when that one is gloo (the module docstring says why). torch gives a group made
    without a timeout its backend's default (30 minutes for gloo), not the default group's."""
    ranks = None if group is None else dist.get_process_group_ranks(group)
    return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)


def transport_detail(error: BaseException) -> str:
    """The backend's own words about a transport failure, on one line: the source location
    and the advice after the first sentence left out."""
    text = " ".join(str(error).split())
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", text)
    return text.split(". ")[0][:200] or type(error).__name__


class Peers:
    """Rank ``rank`` of ``world`` on the agreement's group over ``group``'s ranks (made here,
    collectively, with ``group``'s timeout): the group, its :attr:`timeout`, and why another
    rank is known not to answer (:attr:`lost`, None until then).

    Every collective on :attr:`group` runs inside :meth:`collective`, which turns a
    transport failure into :meth:`lost_error`'s one-line InvalidState naming the rank.

    Example
    -------
    >>> peers = Peers(None, dist.get_rank(), dist.get_world_size())      # doctest: +SKIP
    >>> with peers.collective("a broadcast"):                             # doctest: +SKIP
    ...     dist.broadcast(values, 0, group=peers.group)
    """

    def __init__(self, group: Any, rank: int, world: int):
        self.rank, self.world = rank, world
        self._timeout = group_timeout(group)
        self.group = agreement_group(group, self._timeout)
        #: Why a rank is known not to answer (then every wait is refused with it), or None.
        self.lost: str | None = None

    @property
    def timeout(self) -> float:
        """Seconds any collective on :attr:`group` waits for a rank: ``group``'s timeout."""
        return self._timeout.total_seconds()

    @contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """Runs a collective on :attr:`group` (``what`` names it in the error): a rank that
        does not answer within :attr:`timeout`, or whose connection closes, raises
        :meth:`lost_error`'s InvalidState instead of the backend's error. Any other error
        (the operation's own failure, a bug) is raised as it is."""
        try:
            yield
        except RuntimeError as e:
            if isinstance(e, CellCacheError) or not (isinstance(e, dist.DistError)
                                                     or TRANSPORT.search(str(e))):
                raise                        # the operation's own failure (a bug): as it is
            raise self.lost_error(e, what, own=True) from None

    def peer_error(self, error: BaseException, what: str) -> InvalidState | None:
        """:meth:`lost_error` of ``error`` when it is a collective's transport failure among
        the group's ranks (on any group over them: the model's collectives too); None for
        any other error."""
        if isinstance(error, CellCacheError):
            return None
        transport = isinstance(error, dist.DistNetworkError) or (
            isinstance(error, RuntimeError) and TRANSPORT.search(str(error)) is not None)
        return self.lost_error(error, what, own=False) if transport else None

    def lost_error(self, error: BaseException, what: str, own: bool) -> InvalidState:
        """The InvalidState for a collective's transport failure ``error`` during ``what``: one
        line naming the rank that did not answer or closed its connection; :attr:`lost` is
        set to it (the first reason stays). ``own``: the collective ran on :attr:`group`
        (whose timeout the message can state)."""
        if self.lost is not None:
            return InvalidState(self.lost)
        detail = transport_detail(error)
        silent = re.search(r"timed out|timeout", str(error), re.IGNORECASE) is not None
        others = [r for r in range(self.world) if r != self.rank]
        missing = others if self.world == 2 else self._roll_call(silent)
        if missing:
            who = (f"rank {missing[0]}" if len(missing) == 1 else
                   "ranks " + ", ".join(map(str, missing))) + f" of {self.world}"
        else:
            who = f"a rank of {self.world} other than rank {self.rank}"
        within = f"the group's timeout ({self.timeout:g} s)" if own else "its group's timeout"
        if silent:
            what_happened = (f"{who} did not answer {what} within {within}: it stopped, hangs or "
                             "is out of step")
        else:
            what_happened = f"{who} closed its connection during {what}: the process died or left"
        self.lost = f"{what_happened}; rank {self.rank} ends its wait: build new caches [{detail}]"
        return InvalidState(self.lost)

    def _roll_call(self, silent: bool) -> list[int] | None:
        """After this rank's collective failed: the group's other ranks that did not report
        a failure of their own through the default store before every rank still alive has
        failed too (``ROLL_CALL_GRACE`` past the timeout after the collective began: it
        began a timeout ago when it timed out, now when a connection closed); None when the
        store does not answer by then."""
        deadline = time.monotonic() + (0.0 if silent else self.timeout) + ROLL_CALL_GRACE
        prefix = f"cellcache.tp/{self.group.group_name}/failed/"
        found: list[list[int]] = []

        def call() -> None:
            try:
                store = dist.distributed_c10d._get_default_store()
                store.set(f"{prefix}{self.rank}", "1")
                waiting = [r for r in range(self.world) if r != self.rank]
                while waiting and time.monotonic() < deadline:
                    time.sleep(0.05)
                    waiting = [r for r in waiting if not store.check([f"{prefix}{r}"])]
                found.append(waiting)
            except Exception:  # noqa: BLE001 - no store: the rank stays unnamed
                pass

        # a thread of its own: a store whose host is the rank that stopped never answers
        caller = threading.Thread(target=call, name="cellcache-tp-roll-call", daemon=True)
        caller.start()
        caller.join(max(0.0, deadline - time.monotonic()) + 1.0)
        return found[0] if found else None
