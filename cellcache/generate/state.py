"""A Generator's cached prefixes to a file and back: a conversation's history computed once,
kept across restarts (llama.cpp's slot save / restore, as a prefix cache entry).

``save_prefix(gen, tokens, path)`` writes the K/V of ``tokens`` (which the prefix cache must
hold whole: a finished request's prompt and output are stored there when it ends);
``load_prefix(gen, path)`` puts a saved prefix back into the prefix cache, so the next request
that starts with those tokens reads only what follows them.

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

from ..errors import InvalidArgument, InvalidState
from ..seqstate import load_sequence, save_sequence
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
    InvalidState when the prefix cache does not hold all of ``tokens`` (it says how many it
    holds), the generator is busy (requests waiting or running, or a step running: called
    from one of its callbacks or another thread) or has no prefix cache; InvalidArgument for bad tokens or
    path. A refusal changes nothing; a save counts as a use of the prefix (a hit in the
    prefix cache's metrics, its eviction order refreshed)."""
    with _idle_prefix(gen, "save_prefix") as prefix:
        return _save(gen, prefix, tokens, path)


def _save(gen: Any, prefix: Any, tokens: Any, path: Any) -> int:
    # (ids but a list or tuple past the cache's capacity, which it never holds, are refused unread)
    ids = token_ids(tokens, "tokens", gen.vocab, limit=gen.cache.config.capacity)
    held = prefix.peek(ids)
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


def load_prefix(gen: Any, path: Any) -> int:
    """Puts the prefix saved in ``path`` into the generator's prefix cache; returns the tokens
    newly cached (0 when it held them already). Refuses (nothing changed) a file without
    tokens, from another model shape or format version (InvalidArgument), tokens outside the
    model's vocabulary (InvalidArgument), a busy generator (as for :func:`save_prefix`) or
    one without a prefix cache (InvalidState), no room (OutOfMemory)."""
    with _idle_prefix(gen, "load_prefix") as prefix:
        return _load(gen, prefix, path)


def _load(gen: Any, prefix: Any, path: Any) -> int:
    seq, tokens = load_sequence(gen.cache, path)
    try:
        if tokens is None:
            raise InvalidArgument(f"{path!s} holds no tokens: save it with save_prefix (or "
                                  "save_sequence(..., tokens=...))")
        ids = token_ids(tokens, "the file's tokens", gen.vocab)
        if len(ids) != gen.cache.pos(seq):
            raise InvalidArgument(f"{path!s} holds {len(ids)} tokens for {gen.cache.pos(seq)} positions")
        return prefix.give(seq, ids)           # (the tree takes seq, or removes it)
    except BaseException:
        if seq in gen.cache.live_seqs() and not prefix.owns(seq):
            gen.cache.seq_rm(seq)
        raise
