"""The agreement: one cell-table decision on every rank of a ``torch.distributed`` group.

Every rank runs the same deterministic calls on a cell table of its own (its pools hold only
its heads: :mod:`cellcache.tp.shard`). :class:`TPCache` wraps a rank's cache and makes every
outcome that could differ between ranks (a refusal, an allocation failure, a fault) the same
on all of them before anything changes::

     every rank, the same calls in the same order        agreement (its own gloo group)
     ---------------------------------------------        -------------------------------
     declare_step(ids)    local outcome ───────────────▶  all_reduce MAX [failed, refused]
                          True only if True everywhere;    failed: the first failing rank's
                          a rank that declared drops it    error, on every rank (all_gather)
     prepare_step(...)
       checks + growth plan (nothing changed yet) ─────▶  only when the step grows the pools:
                                                           one rank short of memory -> every
                                                           rank gives its plan back, raises
                                                           the same error
       commit last, grow, place, write buffers ────────▶  all_reduce: a rank that failed here
                                                           -> the others take the step back
       [debug] digest of the step and the table ───────▶  all_gather_object: InvalidState
                                                           naming the first differing rank
     forward                the model's own collectives (its TP plan), on the model's group
     commit_step()        local commit ────────────────▶  all_reduce
     seq_new/clone/rm,    local (deterministic); [debug] results and table summary compared
     rewind, clear

``deferred=True`` (:meth:`TPCache.defer`; the Generator's mode) keeps only the collective
that guards an outcome one rank alone can see before it happens, the growth agreement, and
folds the rest into :meth:`TPCache.exchange`, which the owner of the lockstep runs at least
once a step (the Generator's hand-overs)::

     declare_step         local; its outcome folded into a digest (a function of the table)
     prepare_step         growth: agreed first, as above; no growth: no collective (the
                          checks are deterministic); outcome (read_len, rows) folded
     commit_step          local
     a rank's own failure raised there at once, recorded as a fault
     exchange(values)  ──▶ one all_reduce MAX: the caller's values, the faults, [digest,
                          -digest]: a fault -> its error on every rank, the wrapper refuses
                          from then on; digests that differ -> InvalidState everywhere

Every agreement is the same all_reduce of 15 int64s led by a tag, so ranks that reached
different rounds pair anyway and raise InvalidState instead of mixing them.

Who decides: nobody — every rank runs the same table on the same calls; the agreement only
turns an outcome that one rank alone saw (its allocator failed, a fault) into the same
outcome everywhere, with nothing changed anywhere (deferred: the allocation; a fault after
the step's agreement is raised everywhere at the next round, caches refused from then on).
A caller drives the same calls on every rank (or rank 0 schedules and broadcasts them:
that is the generator's business).

Why deferring is sound: with identical tables, declare_step's outcome and prepare_step's
checks and placement are pure functions of the table and the call, identical on every rank
(the digest and debug mode check this). What one rank alone can hit is (a) an allocation
failure while growing, agreed before anything changes, and (b) a fault after the agreement
(a CUDA error while writing the step buffers or recording the commit, a signal, a bug). A
CUDA error is sticky: the rank's context is dead and no agreement could restore it; the
others learn at the next round (or the group's timeout ends their wait inside the model's
collectives), and nothing continues silently.

A rank that stops answering or dies ends the others' wait within the group's timeout
(:mod:`cellcache.tp.peers`): every other rank raises InvalidState on one line naming the
rank, with its cache as the verb's own failure leaves it (declare_step, a growth, an
exchange: nothing changed; prepare_step's last agreement: the step taken back; commit_step:
committed), and the wrapper refuses every later call at once.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from ..buffers import step_buffers
from ..cache import CellCache, LayerBuffers, Step
from ..config import CacheConfig
from ..errors import CellCacheError, CudaError, InvalidArgument, InvalidState, OutOfMemory, StepTooLarge
from .peers import Peers
from .shard import group_rank

__all__ = ["TPCache"]

#: The library's errors by name: an error one rank raised is raised as the same class on
#: every rank (a subclass outside this list as its nearest listed base).
_ERRORS: dict[str, type[CellCacheError]] = {
    cls.__name__: cls for cls in (StepTooLarge, InvalidArgument, InvalidState, OutOfMemory,
                                  CudaError, CellCacheError)}

#: Every agreement is one ``all_reduce(MAX)`` of this many int64 values, whatever the round
#: (so a rank one round out of step still pairs with the others and is caught by the tag):
#: ``[tag, -tag, failed, refused, fault, digest, -digest]`` then the caller's values.
_VALUES = 8
_HEAD = 7
_TAGS = {"declare_step": 1, "prepare_step": 2, "commit_step": 3, "exchange": 4}
_MOD = (1 << 61) - 1              # the deferred outcome digest is kept mod this prime


def _report(error: BaseException | None) -> tuple | None:
    """What other ranks need to raise ``error`` again: (class name, message, library?, code,
    name) or None."""
    if error is None:
        return None
    for cls in type(error).__mro__:
        if cls.__name__ in _ERRORS and issubclass(cls, CellCacheError):
            return (cls.__name__, str(error), True, getattr(error, "code", None),
                    getattr(error, "name", None))
    return (type(error).__name__, str(error), False, None, None)


def _host(buffer: Any) -> np.ndarray:
    """A host copy (or the array itself) of a cache buffer."""
    if isinstance(buffer, np.ndarray):
        return buffer
    return np.asarray(buffer.copy_to_host())


if TYPE_CHECKING:               # a TPCache stands wherever a CellCache is used (duck-typed)
    _CacheLike = CellCache
else:
    _CacheLike = object


class TPCache(_CacheLike):
    """A rank's cache (``local``: its shard, built from :func:`~cellcache.tp.shard_config`)
    whose every decision is agreed with the other ranks of a process group.

    Every rank must make the same calls in the same order (same ids, widths, ``pad_to``).
    Then:

    - ``declare_step`` returns True only if it is True on every rank (all-reduce MIN of
      the outcome); an error on one rank is the same error on every rank; a rank that had
      declared drops its declaration.
    - ``prepare_step``: a refusal or an allocation failure on one rank (``OutOfMemory``,
      ``StepTooLarge``, any ``CellCacheError``) is raised with the same class and message
      on every rank, after every rank gave its growth plan back: nothing changed anywhere,
      and the same call can be retried. A failure after the agreement (a fault while
      placing or writing the buffers) makes the other ranks take their step back
      (:meth:`CellCache.unprepare_step`), so every rank stands where a local failure leaves
      a cache: pools grown, step declared again. If a rank's pools could not even grow
      (a device copy failed) while the others grew, the ranks differ: every rank raises
      InvalidState and this wrapper refuses every later call (build new caches).
    - ``commit_step``: a failure on one rank is the same error on every rank (a commit only
      orders later work after the forward: ranks that committed stay committed).
    - the sequence verbs run locally: they are deterministic. With ``debug=True`` every verb's
      arguments, result and a table summary are compared across ranks, and every step's
      digest (sha256 of the step, the table's positions and the written step buffers); a
      difference raises InvalidState on every rank naming the first rank that differs from
      rank 0, and this wrapper refuses every later call.

    ``deferred=True`` (or :meth:`defer`): ``declare_step``, ``commit_step`` and a
    ``prepare_step`` that does not grow the pools run no collective (their outcomes are
    functions of the table, folded into a digest); growth is agreed as above; a rank's own
    failure after the agreement is raised there at once and, at the next :meth:`exchange`
    (which the caller runs at least once a step), on every rank with the same class,
    naming the rank, after which the wrapper refuses every call (the others went on);
    digests that differ raise InvalidState on every rank. The module docstring says why
    this keeps the contract. ``rounds`` counts the agreement's collectives.

    An error that is not the library's (a ``KeyboardInterrupt``, a bug) is re-raised as is
    on the rank that had it; the other ranks raise InvalidState naming it. Queries
    (``pos``, ``free_cells``, ``buffer``, ...) are local. The runner's forward uses
    ``local`` (``cellcache.hf.attach(model, tp_cache.local)``).

    ``group``: the ranks that agree (default: the world). Collectives run on a gloo group
    over the same ranks created here with ``group``'s timeout (so every rank must build its
    TPCache at the same point of the program). A rank that does not answer one of them
    within that timeout, or whose connection closes, is named in an InvalidState on every
    other rank (the module docstring says what each verb leaves), and the wrapper refuses
    every later call at once (:attr:`lost`).

    Example
    -------
    >>> cache = TPCache(cellcache.HostCellCache(tp.shard_config(cfg, rank, world)))  # doctest: +SKIP
    >>> a = cache.seq_new(); cache.declare_step([a, a])                          # doctest: +SKIP
    True
    >>> step = cache.prepare_step(); cache.commit_step()                         # doctest: +SKIP
    """

    def __init__(self, local: CellCache, group: Any = None, *, debug: bool = False,
                 deferred: bool = False):
        if not isinstance(local, CellCache):
            raise InvalidArgument(f"local of type {type(local).__name__} is not a cellcache cache")
        for name, flag in (("debug", debug), ("deferred", deferred)):
            if not isinstance(flag, bool):
                raise InvalidArgument(f"{name} of type {type(flag).__name__} is not a bool")
        self.rank, self.world = group_rank(group)
        self.local = local
        self.group = group
        self.debug = debug
        self._peers = Peers(group, self.rank, self.world)   # the agreement's group, its waits
        self._diverged: str | None = None
        self._steps = 0
        self._deferred = deferred
        self._fault: BaseException | None = None   # deferred: a local failure not agreed yet
        self._digest = 0                            # deferred: the outcomes since the start
        self.rounds = 0                             # collectives run by the agreement (not debug's)
        self._flags = torch.zeros(_HEAD + _VALUES, dtype=torch.int64)   # every round's values

    # -- agreement ---------------------------------------------------------------------------
    @contextmanager
    def _usable(self) -> Iterator[None]:
        with self.local.lock:
            if self._peers.lost is not None:
                raise InvalidState(self._peers.lost)
            if self._diverged is not None:
                raise InvalidState(f"the ranks' caches diverged ({self._diverged}); build new caches")
            yield

    def _diverge(self, reason: str) -> InvalidState:
        """Marks the wrapper diverged (every later call refuses); the error to raise."""
        self._diverged = reason
        return InvalidState(f"the ranks' caches diverged: {reason}; build new caches")

    def collective(self, what: str) -> AbstractContextManager[None]:
        """Runs a collective on :attr:`agreement_group` (``what`` names it in the error): a
        rank that does not answer within :attr:`timeout`, or whose connection closes, raises
        :meth:`peer_error`'s InvalidState (one line, naming the rank) instead of the
        backend's error, and this wrapper refuses every later call. Every collective of the
        wrapper runs in one; so should a caller's own on the same group."""
        return self._peers.collective(what)

    def peer_error(self, error: BaseException, what: str = "the model's collectives"
                   ) -> InvalidState | None:
        """The library's error for ``error`` when it is a collective's transport failure
        among this group's ranks (the model's collectives too: a peer that did not answer
        within the timeout, or whose connection closed): InvalidState on one line naming the
        rank (``what``: where it happened), after which this wrapper refuses every call.
        None for any other error (an operation's own failure stays what it is).

        With more than two ranks the rank is found by a roll call through the default
        group's store: every rank that failed reports, and those that did not within the
        group's timeout and a few seconds are named. A CLI prints the result's message."""
        return self._peers.peer_error(error, what)

    def _fold(self, code: int) -> None:
        """Deferred mode: adds an outcome to the digest the next round compares."""
        self._digest = (self._digest * 1_000_003 + code + 1) % _MOD

    def _note_fault(self, error: BaseException) -> None:
        """Deferred mode: a failure the other ranks did not see; they learn at the next round."""
        if self._fault is None:
            self._fault = error

    def _round(self, verb: str, error: BaseException | None = None, refused: bool = False,
               rows: int | None = None, values: Sequence[int] = ()) -> tuple[list[int], bool]:
        """The one collective of every agreement: an all_reduce MAX of ``[tag, -tag, failed,
        refused, fault, digest, -digest, *values]`` (always ``_HEAD + _VALUES`` int64s).
        Raises, the same way on every rank: InvalidState (diverged) when the ranks ran
        different rounds or their deferred digests differ; a deferred fault's error (then
        diverged too: the failing rank went its own way after an agreement); this round's
        agreed error when a rank failed. Returns the reduced ``values`` and whether a rank
        refused."""
        if len(values) > _VALUES:
            raise InvalidArgument(f"an agreement carries at most {_VALUES} values, not {len(values)}")
        tag = _TAGS[verb]
        vec = [tag, -tag, int(error is not None), int(refused), int(self._fault is not None),
               self._digest, -self._digest, *values] + [0] * (_VALUES - len(values))
        flags = self._flags                         # one buffer (the cache's lock is held)
        flags.numpy()[:] = vec
        with self.collective(f"{verb}()'s agreement"):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._peers.group)
        self.rounds += 1
        r = flags.tolist()
        if r[0] != -r[1]:
            raise self._diverge(f"the ranks ran different agreements at once (rank {self.rank}: "
                                f"{verb}); their calls are out of step")
        if r[4]:                                    # a deferred fault somewhere
            fault, self._fault = self._fault, None
            raise self._fault_error(fault)
        if r[5] != -r[6]:
            raise self._diverge("the ranks' cache outcomes (declare_step, prepare_step) differ "
                                f"since the last agreement (rank {self.rank} at {verb})")
        if r[2]:
            raise self._agreed_error(verb, error, rows)
        return r[_HEAD:_HEAD + len(values)], bool(r[3])

    def _agree(self, verb: str, error: BaseException | None, refused: bool = False,
               rows: int | None = None) -> bool:
        """One round: raises the agreed error when a rank failed; True when a rank refused."""
        return self._round(verb, error, refused, rows)[1]

    def exchange(self, values: Sequence[int] = ()) -> list[int]:
        """One agreement round carrying the caller's ``values`` (at most 8 ints in the int64
        range): returns their element-wise maximum over the ranks. It also settles what a
        ``deferred`` wrapper left open: a failure a rank had on its own after a step's
        agreement is raised on every rank (same class, naming the rank) and the wrapper then
        refuses every call; outcomes (declarations, steps) that differ between ranks raise
        InvalidState on every rank. Every rank must call it at the same point (the
        Generator's hand-overs do, once or twice a step)."""
        with self._usable():
            return self._round("exchange", values=values)[0]

    def mark_diverged(self, reason: str) -> None:
        """Marks the ranks' caches as differing (``reason``): every later call raises
        InvalidState. Call it on every rank at the same point (on an agreed finding)."""
        self._diverged = reason

    @property
    def deferred(self) -> bool:
        """Whether the step verbs agree only where a rank could differ (see the class)."""
        return self._deferred

    def defer(self) -> None:
        """Switches to deferred agreement (see the class) from now on. Call it at the same
        point on every rank, then call :meth:`exchange` at least once per step."""
        with self._usable():
            self._deferred = True

    def _needs_growth(self) -> bool:
        """Whether preparing the declared step grows the pools (the cache's own rule:
        ``min(capacity, used_end + width) > rows``): a pure function of the table, so the
        same on every rank whose tables agree."""
        t = self.local.table
        return min(self.local.config.capacity, t.used_end + t.declared_width) > self.local.rows

    def _agreed_error(self, verb: str, error: BaseException | None,
                      rows: int | None) -> BaseException:
        reports: list[Any] = [None] * self.world
        with self.collective(f"the report of {verb}()'s failure"):
            dist.all_gather_object(reports, (_report(error), rows), group=self._peers.group)
        first = next(r for r, (rep, _) in enumerate(reports) if rep is not None)
        name, message, library, code, cuda_name = reports[first][0]
        all_rows = [r_rows for _, r_rows in reports]
        if rows is not None and len(set(all_rows)) > 1:
            self._diverged = (f"{verb} failed on rank {first} after the ranks agreed, and the "
                              f"pools' rows now differ: {all_rows}")
            return InvalidState(f"the ranks' caches diverged: {self._diverged} (rank {first}: "
                                f"{name}: {message}); build new caches")
        if library:
            text = f"{message} [{verb} failed on rank {first} of {self.world}; every rank raised this]"
            cls = _ERRORS[name]
            agreed = (CudaError(text, code, cuda_name) if cls is CudaError else cls(text))
            agreed.__cause__ = error
            agreed.__suppress_context__ = True
            return agreed
        if first == self.rank and error is not None:
            return error
        agreed = InvalidState(f"{verb} failed on rank {first} of {self.world} with {name}: {message}; "
                              f"rank {self.rank} changed nothing")
        agreed.__cause__ = error
        agreed.__suppress_context__ = True
        return agreed

    def _fault_error(self, fault: BaseException | None) -> BaseException:
        """Deferred mode: a rank failed on its own after the ranks agreed on a step (the
        others went on): the first failing rank's error on every rank (library errors keep
        their class, others become InvalidState), and the wrapper refuses from now on."""
        reports: list[Any] = [None] * self.world
        with self.collective("the report of a rank's failure"):
            dist.all_gather_object(reports, _report(fault), group=self._peers.group)
        first = next(r for r, rep in enumerate(reports) if rep is not None)
        name, message, library, code, cuda_name = reports[first]
        self._diverged = (f"rank {first} failed after the ranks agreed on a step ({name}: {message}) "
                          "and the other ranks went on")
        text = (f"{message} [rank {first} of {self.world} failed after the ranks agreed on the step; "
                "the other ranks went on, so the ranks' caches may differ: build new caches]")
        cls = _ERRORS.get(name) if library else None
        if cls is None:
            agreed: BaseException = InvalidState(f"the ranks' caches diverged: {self._diverged}; "
                                                 "build new caches")
        else:
            agreed = CudaError(text, code, cuda_name) if cls is CudaError else cls(text)
        agreed.__cause__ = fault
        agreed.__suppress_context__ = True
        return agreed

    def _same(self, what: str, value: Any) -> None:
        """Debug: ``value`` (picklable) must be equal on every rank; InvalidState naming the
        first rank that differs from rank 0 otherwise (and this wrapper refuses from then)."""
        values: list[Any] = [None] * self.world
        with self.collective(f"debug's comparison at {what}"):
            dist.all_gather_object(values, value, group=self._peers.group)
        for r, v in enumerate(values):
            if v != values[0]:
                self._diverged = f"at {what}, rank {r} has {v!r}, rank 0 {values[0]!r}"
                raise InvalidState(f"the ranks' caches diverged: rank {r} differs from rank 0 at "
                                   f"{what} ({v!r} against {values[0]!r}); build new caches")

    def _summary(self) -> tuple:
        t = self.local.table
        return t.used_end, t.free_cells, tuple(t.live_seqs())

    def _verb(self, verb: str, fn: Callable[..., Any], *args: Any) -> Any:
        with self._usable():
            if not self.debug:
                return fn(*args)
            error: BaseException | None = None
            result = None
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - compared across ranks, then re-raised
                error = e
            outcome = repr(result) if error is None else f"{type(error).__name__}: {error}"
            self._same(verb, (verb, repr(args), outcome, self._summary()))
            if error is not None:
                raise error
            return result

    def step_digest(self, step: Step) -> str:
        """sha256 of what a step decided on this rank: the Step's host copies, the table's
        positions and live ids, and the written part of the step buffers (cells, positions,
        read_len, width, the masks' rows and columns, the paged view). Equal on every rank
        whose tables agree (the pools, which hold each rank's own heads, are left out)."""
        cache = self.local
        h = hashlib.sha256()

        def add(*arrays: Any) -> None:
            for a in arrays:
                a = np.ascontiguousarray(np.asarray(a))
                h.update(f"{a.dtype}{a.shape}".encode())
                h.update(a.tobytes())

        add([step.width, step.pad_to, step.read_len, step.n_runs, step.rows],
            step.cells, step.positions, step.seq_ids)
        if step.qo_indptr is not None and step.kv_indptr is not None:
            add(step.qo_indptr, step.kv_indptr)
        table = cache.table
        add([table.used_end, table.free_cells], table.live_seqs(), table.positions_array())
        mw, pad = cache.config.max_write, step.pad_to
        for spec in step_buffers(cache.config):
            buf = _host(cache.buffer(spec.name))
            if spec.role in ("cells", "positions"):
                add(buf[:pad])
            elif spec.role in ("read_len", "width"):
                add(buf)
            elif spec.role == "mask":
                cols = step.read_len if cache.config.mask_format == "bool" else (step.read_len + 7) // 8
                add(buf.reshape(mw, -1)[:pad, :cols])
            elif spec.role == "kv_indices" and step.kv_indptr is not None:
                add(buf[:int(step.kv_indptr[-1])])
        return h.hexdigest()

    # -- steps -------------------------------------------------------------------------------
    def declare_step(self, seq_ids: Any) -> bool:
        """``local.declare_step(seq_ids)`` agreed: True only if True on every rank; an error
        on one rank is the same error everywhere; a False or an error leaves nothing declared
        on any rank. Deferred: local (the outcome is a function of the table), folded into
        the digest the next round compares."""
        with self._usable():
            error: BaseException | None = None
            ok = False
            try:
                ok = self.local.declare_step(seq_ids)
            except BaseException as e:  # noqa: BLE001 - agreed, then raised on every rank
                error = e
            if self._deferred:
                if error is None:
                    self._fold(int(ok))
                elif isinstance(error, CellCacheError):       # a check: the same everywhere
                    self._fold(2 + zlib.crc32(type(error).__name__.encode()))
                else:                                          # a rank's own failure
                    self._note_fault(error)
                if self.debug:
                    outcome = ok if error is None else type(error).__name__
                    self._same("declare_step", ("declare_step", outcome, self.local.table.declared,
                                                self._summary()))
                if error is not None:
                    raise error
                return ok
            try:
                refused = self._agree("declare_step", error, refused=not ok)
            except BaseException:
                if ok:
                    self.local.undeclare()
                raise
            if refused and ok:
                self.local.undeclare()
            ok = not refused
            if self.debug:
                self._same("declare_step", ("declare_step", ok, self.local.table.declared,
                                            self._summary()))
            return ok

    def prepare_step(self, width: int | None = None, stream: object = None, *,
                     pad_to: int | None = None,
                     agree: Callable[[BaseException | None], None] | None = None) -> Step:
        """``local.prepare_step(...)`` agreed: every rank prepares the step, or every rank
        raises the same error with nothing changed (see the class). ``agree`` must be None
        (the wrapper is the agreement)."""
        if agree is not None:
            raise InvalidArgument("a TPCache agrees its steps itself: call prepare_step() without agree=")
        with self._usable():
            grows = self._needs_growth()
            ran = passed = checked = False

            def agree(error: BaseException | None) -> None:
                # growth is an allocation one rank alone can fail: agreed before it happens
                nonlocal ran, passed, checked
                checked = error is None
                if grows:
                    ran = True
                    self._agree("prepare_step", error)
                    passed = True

            error: BaseException | None = None
            step: Step | None = None
            try:
                step = self.local.prepare_step(width, stream, pad_to=pad_to, agree=agree)
            except BaseException as e:  # noqa: BLE001 - after the agreement: agreed again below
                if ran and not passed:
                    raise                    # every rank raised this one in the agreement
                if self._deferred:
                    if checked or passed or not isinstance(e, CellCacheError):
                        self._note_fault(e)  # after the checks: this rank's own failure
                    else:                    # a check (the same on every rank)
                        self._fold(2 + zlib.crc32(type(e).__name__.encode()))
                    raise
                error = e
            if self._deferred:
                assert step is not None
                self._fold((step.read_len * 4099 + step.rows) * 4099 + step.pad_to)
            else:
                # a rank that failed after the agreement: every other rank takes its step back
                try:
                    self._agree("prepare_step", error, rows=self.local.rows)
                except BaseException:
                    if error is None:
                        self.local.unprepare_step()
                    raise
            assert step is not None
            self._steps += 1
            if self.debug:
                self._same(f"prepare_step (step {self._steps})", self.step_digest(step))
            return step

    def commit_step(self) -> None:
        """``local.commit_step()`` agreed: a failure on one rank is the same error on every
        rank. Deferred: local (a failure is agreed at the next round)."""
        with self._usable():
            error: BaseException | None = None
            try:
                self.local.commit_step()
            except BaseException as e:  # noqa: BLE001 - agreed, then raised on every rank
                error = e
            if self._deferred:
                if error is not None:
                    self._note_fault(error)
                    raise error
                return
            self._agree("commit_step", error)

    def unprepare_step(self) -> None:
        """``local.unprepare_step()``, compared across ranks in debug mode."""
        self._verb("unprepare_step", self.local.unprepare_step)

    # -- verbs: deterministic, run locally (compared in debug mode) ---------------------------
    def seq_new(self) -> int | None:
        """``local.seq_new()``: the lowest id not live (the same on every rank)."""
        return self._verb("seq_new", self.local.seq_new)

    def seq_clone(self, src: int, upto: int | None = None) -> int | None:
        """``local.seq_clone(src, upto)``."""
        return self._verb("seq_clone", self.local.seq_clone, src, upto)

    def seq_rm(self, seq: int) -> bool:
        """``local.seq_rm(seq)``."""
        return self._verb("seq_rm", self.local.seq_rm, seq)

    def rewind(self, seq: int, position: int) -> bool:
        """``local.rewind(seq, position)``."""
        return self._verb("rewind", self.local.rewind, seq, position)

    def clear(self) -> None:
        """``local.clear()``."""
        self._verb("clear", self.local.clear)

    def undeclare(self) -> None:
        """``local.undeclare()``."""
        self._verb("undeclare", self.local.undeclare)

    # -- queries: local ----------------------------------------------------------------------
    @property
    def agreement_group(self) -> Any:
        """The gloo group the agreement runs on (built over ``group``'s ranks): others that
        exchange host values in the same lockstep may use it."""
        return self._peers.group

    @property
    def timeout(self) -> float:
        """Seconds any collective of the agreement waits for a rank: ``group``'s timeout."""
        return self._peers.timeout

    @property
    def lost(self) -> str | None:
        """Why a rank is known not to answer (then every verb raises InvalidState saying so),
        or None."""
        return self._peers.lost

    @property
    def diverged(self) -> str | None:
        """Why the ranks' caches are known to differ (then every verb raises InvalidState),
        or None."""
        return self._diverged

    @property
    def config(self) -> CacheConfig:  # type: ignore[override]  # read-only: the shard's
        """This rank's (sharded) configuration."""
        return self.local.config

    @property
    def capacity(self) -> int:
        return self.local.capacity

    @property
    def max_seqs(self) -> int:
        return self.local.max_seqs

    @property
    def free_cells(self) -> int:
        return self.local.free_cells

    @property
    def used_end(self) -> int:
        return self.local.used_end

    @property
    def rows(self) -> int:
        return self.local.rows

    @property
    def prepared_step(self) -> Step | None:
        return self.local.prepared_step

    @property
    def lock(self) -> Any:
        return self.local.lock

    @property
    def closed(self) -> bool:
        return self.local.closed

    @property
    def clears(self) -> int:
        return self.local.clears

    def pos(self, seq: int) -> int:
        return self.local.pos(seq)

    def seq_len(self, seq: int) -> int:
        return self.local.seq_len(seq)

    def live_seqs(self) -> list[int]:
        return self.local.live_seqs()

    def buffer(self, name: str) -> Any:
        return self.local.buffer(name)

    def layer(self, index: int) -> LayerBuffers:
        return self.local.layer(index)

    def metrics(self) -> dict:
        """The local cache's metrics plus ``rank`` and ``world``."""
        return {**self.local.metrics(), "rank": self.rank, "world": self.world}

    def check_invariants(self) -> None:
        self.local.check_invariants()

    def close(self) -> None:
        """Closes the local cache (no collective: closing is local)."""
        self.local.close()

    def __enter__(self) -> TPCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
