"""A Generator's cached prefixes to a file and back: a conversation's history computed once,
kept across restarts (llama.cpp's slot save / restore, as a prefix cache entry).

``save_prefix(gen, tokens, path)`` writes the K/V of ``tokens`` (which the prefix cache, or its
host level, must hold whole: a finished request's prompt and output are stored there when it
ends);
``load_prefix(gen, path)`` puts a saved prefix back into the prefix cache (evicting for it when
the cache is full, as an admission does), so the next request that starts with those tokens
reads only what follows them.

Example
-------
>>> req = gen.add(history, Sampling(max_new_tokens=64)); gen.run()          # doctest: +SKIP
>>> save_prefix(gen, req.prompt + req.outputs[0][:-1], "chat.kv")           # doctest: +SKIP
>>> load_prefix(other_gen, "chat.kv")       # in a new process, same model  # doctest: +SKIP

Both run while the generator is idle (no request waiting or running, no step running: not
from a callback of a step, nor from another thread while one runs): the stepping thread owns
the cache while it serves. The file format and its checks are
:mod:`cellcache.seqstate`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import InvalidArgument, InvalidState, OutOfMemory
from ..seqstate import between_steps, length_of, open_sequence, place_file, save_sequence
from .requests import token_ids

__all__ = ["load_prefix", "save_prefix"]


@contextlib.contextmanager
def _idle_prefix(gen: Any, verb: str) -> Iterator[Any]:
    """The generator's prefix cache, the generator held idle for ``verb``
    (:meth:`Generator.held_idle`: refused from inside a step, a callback of its, or while
    another thread steps; no step starts until ``verb`` is done)."""
    prefix = getattr(gen, "prefix", None)
    if prefix is None:
        raise InvalidState(f"{verb} needs the generator's prefix cache (prefix_cache=True)")
    with gen.held_idle(verb):
        yield prefix


def save_prefix(gen: Any, tokens: Any, path: Any) -> int:
    """Writes the cached K/V of ``tokens`` (and the tokens) to ``path``; returns how many.
    A prefix the prefix cache evicted to its host level (``spill_prefixes=True``) is brought
    back to it first (evicting for the cells when the cache is full, as an admission's hit
    there does). InvalidState when neither holds all of ``tokens`` (it says how many the
    prefix cache holds), the host level does but the generator is asleep, the generator is
    busy (requests waiting or running, or a step running: called from one of its callbacks
    or another thread) or has no prefix cache; InvalidArgument for bad tokens or path. A
    refusal changes nothing; a save counts as a use of the prefix (a hit in the prefix
    cache's metrics, its eviction order refreshed)."""
    with _idle_prefix(gen, "save_prefix") as prefix:
        return _save(gen, prefix, tokens, path)


def _save(gen: Any, prefix: Any, tokens: Any, path: Any) -> int:
    # (ids but a list or tuple past the cache's capacity, which it never holds, are refused unread)
    ids = token_ids(tokens, "tokens", gen.vocab, limit=gen.cache.config.capacity)
    held = prefix.peek(ids)
    if held < len(ids):
        held = _from_host(gen, prefix, ids, held)
    if held < len(ids):
        raise InvalidState(f"the prefix cache holds {held} of the {len(ids)} tokens; only a prefix it "
                           "holds whole can be saved")
    seq, n = prefix.match(ids)
    if seq is None or n < len(ids):          # (no free id for the clone)
        if seq is not None:
            gen.cache.seq_rm(seq)
        raise InvalidState("no sequence id is free to read the prefix through; try when fewer are held")
    try:
        return save_sequence(gen.cache, seq, path, tokens=ids)
    finally:
        gen.cache.seq_rm(seq)


def _from_host(gen: Any, prefix: Any, ids: list[int], held: int) -> int:
    """Brings ``ids`` back from the prefix cache's host level (``spill_prefixes=True``) when
    it keeps them whole, as an admission's hit there does: restored past the ``held`` tokens
    the prefix cache holds, onto a clone of them, and given to the prefix cache. Returns
    what the prefix cache then holds of ``ids`` (``held`` when the host level keeps no
    whole copy, or the cells or the prefix cache's id for it cannot be had: checked before
    anything changes, the copy stays kept where it was). InvalidState while the generator
    sleeps (its cache has no memory to restore into; the copy stays kept)."""
    kv = gen.scheduler.kv
    tier = kv.l2
    arr = np.asarray(ids, dtype=np.int32)
    if tier is None or tier.find_whole(arr) is None:
        return held
    if gen.asleep:
        raise InvalidState("the prefix is kept in the host level and the generator is asleep: "
                           "call wake() before save_prefix")
    cache = gen.cache
    pinned = prefix.pin(ids) if held else 0
    try:
        # every refusal before the copy leaves the tier: a spill given (and then dropped) by
        # a placement the prefix cache skips, or an eviction's hook that drops it for room,
        # would lose it
        if not prefix.storable(ids) or _short(cache, prefix, len(ids) - held) is not None:
            return held
        taken = tier.take_whole(arr)
        if taken is None:
            return held
        key, spill = taken
        try:
            seq = _room(cache, prefix, ids, held, len(ids) - held)
        except BaseException as e:              # (a policy key, on_event: user code raising)
            tier.put_back(key, spill)
            if isinstance(e, OutOfMemory):
                return held
            raise
        try:
            kv.spiller.give(spill, seq, held)       # (the copy is dropped either way)
            prefix.give(seq, ids)
        except BaseException:
            if seq in cache.live_seqs() and not prefix.owns(seq):
                cache.seq_rm(seq)
            raise
        return prefix.peek(ids)
    finally:
        if pinned:
            with contextlib.suppress(InvalidState):
                prefix.unpin(ids, pinned)


def load_prefix(gen: Any, path: Any) -> int:
    """Puts the prefix saved in ``path`` into the generator's prefix cache; returns the tokens
    newly cached (0 when it held them already). What the prefix cache holds of them already
    is kept and only the rest is placed; when free cells run short the prefix cache evicts
    for it, as it does for an admission (its policy's order, the held part pinned). Refuses
    (nothing changed) a file without tokens, from another model shape or format version
    (InvalidArgument), tokens outside the model's vocabulary (InvalidArgument), a busy
    generator (as for :func:`save_prefix`) or one without a prefix cache (InvalidState), and
    a prefix larger than the free cells and what the prefix cache can evict together, or
    one the prefix cache has no id for (it holds its ``max_seqs`` prefixes, and can evict
    none that gives one back: with one id, a leaf that shares the file's first tokens and
    goes on past them) (OutOfMemory)."""
    with _idle_prefix(gen, "load_prefix") as prefix:
        return _load(gen, prefix, path)


def _load(gen: Any, prefix: Any, path: Any) -> int:
    cache = gen.cache
    tensors, tokens = open_sequence(cache, path)      # every check of the file: nothing placed yet
    if tokens is None:
        raise InvalidArgument(f"{path!s} holds no tokens: save it with save_prefix (or "
                              "save_sequence(..., tokens=...))")
    ids = token_ids(tokens, "the file's tokens", gen.vocab)
    length = length_of(tensors)
    if len(ids) != length:
        raise InvalidArgument(f"{path!s} holds {len(ids)} tokens for {length} positions")
    between_steps(cache)                              # (before the pin and any eviction)
    held = prefix.pin(ids)                            # (kept while room is made for the rest)
    try:
        if held == length:
            return 0
        if not prefix.storable(ids):                  # (else give would skip it: a silent 0)
            raise OutOfMemory(f"the prefix cache holds its {prefix.max_seqs} prefixes and can evict "
                              "none that gives back a sequence id for this one")
        seq = _room(cache, prefix, ids, held, length - held)
        try:
            place_file(cache, seq, tensors, held)
            return prefix.give(seq, ids)              # (the tree takes seq, or removes it)
        except BaseException:
            if seq in cache.live_seqs() and not prefix.owns(seq):
                cache.seq_rm(seq)
            raise
    finally:
        if held:
            with contextlib.suppress(InvalidState):   # (an invalidation meanwhile dropped every pin)
                prefix.unpin(ids, held)


def _room(cache: Any, prefix: Any, ids: list[int], held: int, need: int) -> int:
    """A sequence holding the first ``held`` of ``ids`` (a clone of the prefix cache's, or a
    new one when ``held`` is 0) with ``need`` free cells beside it, the prefix cache evicting
    for both; OutOfMemory, nothing evicted, when the free cells and what it can evict fall
    short (its count of evictable tokens: cells of its own, the pinned held part excluded)."""
    why = _short(cache, prefix, need)
    if why is not None:
        raise OutOfMemory(why)
    short = need - cache.free_cells
    if short > 0:
        prefix.evict(short)
    for attempt in range(2):
        seq = prefix.match(ids, max_len=held)[0] if held else cache.seq_new()
        if seq is not None:
            break
        if attempt == 0:
            prefix.evict(n_ids=1)
    else:
        raise OutOfMemory("no sequence id is free for the prefix")
    if cache.free_cells < need:                     # (cells a leaf shared with another: kept)
        cache.seq_rm(seq)
        raise OutOfMemory(f"the prefix needs {need} cells; {cache.free_cells} are free after eviction")
    return seq


def _short(cache: Any, prefix: Any, need: int) -> str | None:
    """Why ``need`` cells cannot be had, the free cells and what the prefix cache can evict
    together falling short (None: they can); nothing changes."""
    short = need - cache.free_cells
    if short > 0:
        can = prefix.evictable_tokens(short)
        if can < short:
            return (f"the prefix needs {need} cells: {cache.free_cells} are free and the prefix "
                    f"cache can evict {can}")
    return None
