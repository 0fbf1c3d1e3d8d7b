"""A sequence's cells to a file and back (llama.cpp's ``llama_state_seq_save_file`` /
``load_file``): every layer's K and V at each of the sequence's positions, in a safetensors
file (no pickle) with a versioned header that names the cache's shape, so that a file from
another model is refused with the layer that differs.

Example
-------
>>> n = save_sequence(cache, seq, "chat.kv", tokens=history)        # doctest: +SKIP
>>> seq2, tokens = load_sequence(other_cache, "chat.kv")            # doctest: +SKIP

Both run between steps, on the thread that steps the cache: ``save_sequence`` reads what the
forwards before it wrote (it waits for the device), and ``load_sequence`` places the file's
positions as a step of its own (declared, prepared, K/V written, committed), so graphs,
masks and the paged view see them as any other cells.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Set
from typing import Any

import numpy as np
import torch

from ._checks import bounded_list, check_int, check_seq_id
from .cache import CellCache
from .errors import InvalidArgument, InvalidState, OutOfMemory
from .torch import TorchView, torch_dtype

__all__ = ["FORMAT", "VERSION", "between_steps", "cells_by_position", "length_of", "load_sequence",
           "open_sequence", "place_file", "place_positions", "read_sequence", "save_sequence", "shape_of",
           "write_sequence"]

#: What the header's ``format`` says, and the version this module writes and reads.
FORMAT = "cellcache.sequence"
VERSION = 1


def shape_of(cache: CellCache) -> list[dict[str, Any]]:
    """Per layer: K/V heads, head size, dtype and window: what a file must match."""
    cfg = cache.config
    return [{"n_kv_heads": lc.n_kv_heads, "head_dim": lc.head_dim, "dtype": cfg.dtype, "window": lc.window}
            for lc in cfg.layers]


def _sync(view: TorchView) -> None:
    if view.cuda:
        torch.cuda.synchronize()


def save_sequence(cache: CellCache, seq: Any, path: Any, tokens: Any = None) -> int:
    """Writes sequence ``seq``'s positions and every layer's K/V at them to ``path``, with
    ``tokens`` (the sequence's token ids, optional) beside them; returns the positions
    written. InvalidArgument for a bad id, path or tokens (ids given lazily, a ``range`` or a
    generator, are refused past the cache's capacity before they are read whole; a set or a
    mapping has no order and is refused; a path that is a folder, a device or a pipe);
    InvalidState for a closed cache, a sequence that is not live, or one in a prepared step
    whose forward may not have run. The file is written whole or not at all: a failed save
    leaves what was at ``path`` as it was."""
    from safetensors.torch import save_file

    if not isinstance(cache, CellCache):
        raise InvalidArgument(f"cache of type {type(cache).__name__} is not a cellcache cache")
    seq = check_seq_id(seq, cache.max_seqs)
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgument(f"path of type {type(path).__name__} is not a file path")
    ids = None if tokens is None else _token_tensor(tokens, cache.config.capacity)
    tensors = read_sequence(cache, seq)
    if ids is not None:
        tensors["tokens"] = ids
    header = {"format": FORMAT, "version": str(VERSION), "layers": json.dumps(shape_of(cache))}
    _write_file(tensors, path, header, save_file)
    return int(tensors["positions"].numel())


def _write_file(tensors: dict[str, torch.Tensor], path: Any, header: dict[str, str],
                save_file: Callable[..., None]) -> None:
    """Writes ``tensors`` to ``path`` whole or not at all: into a new file beside it, renamed
    over it once complete (a failure part way, a full disk say, leaves what was there and no
    partial file). A link is written through (its target replaced, the link kept); a path
    that exists and is no regular file (a folder, a device, a pipe) is refused, never
    replaced."""
    from safetensors import SafetensorError

    where = os.fspath(path)
    target = os.path.realpath(where)
    if os.path.exists(target) and not os.path.isfile(target):
        raise InvalidArgument(f"cannot write the sequence to {where!r}: it exists and is not a regular file")
    tmp = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.{os.getpid()}."
                       f"{threading.get_ident()}.tmp")
    try:
        save_file(tensors, tmp, metadata=header)
        os.replace(tmp, target)
    except (OSError, SafetensorError) as e:          # no such folder, no permission, a full disk
        raise InvalidArgument(f"cannot write the sequence to {where!r}: {e}") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _token_tensor(tokens: Any, limit: int) -> torch.Tensor:
    """``tokens`` as an int64 tensor of ids >= 0. A list or tuple is whole and taken as it
    is; anything else holding more than ``limit`` ids (the cache's capacity: no sequence has
    more positions) is refused before it is read whole (``range(10**18)``, an endless
    generator; :func:`~cellcache._checks.bounded_list`). Sets and mappings have no order and
    are refused."""
    what = f"tokens of type {type(tokens).__name__}"
    if isinstance(tokens, (str, bytes, bytearray, Set, Mapping)) or not isinstance(tokens, Iterable):
        raise InvalidArgument(f"{what} are not a sequence of token ids; give a list of ints")
    try:                                            # (a 0-d array or tensor: no sequence)
        items = bounded_list(tokens, what, "token ids", limit)
    except TypeError:
        raise InvalidArgument(f"{what} are not a sequence of token ids; give a list of ints") from None
    return torch.tensor([check_int(t, "token id", 0, 2**63 - 1) for t in items], dtype=torch.int64)


def read_sequence(cache: CellCache, seq: Any) -> dict[str, torch.Tensor]:
    """Sequence ``seq``'s positions and every layer's K and V at them, as CPU tensors
    (``"positions"`` ``[n]`` int64 increasing, ``"k.{layer}"`` and ``"v.{layer}"``
    ``[n, n_kv_heads, head_dim]`` in the cache's dtype; 8-bit pools give the values they stand
    for, and a load stores them scaled again, so a file moves between 8- and 16-bit caches of
    one shape): what a file holds, in memory
    (:func:`write_sequence` brings it back). Refuses as :func:`save_sequence` does."""
    if not isinstance(cache, CellCache):
        raise InvalidArgument(f"cache of type {type(cache).__name__} is not a cellcache cache")
    seq = check_seq_id(seq, cache.max_seqs)
    with cache.lock:
        if seq not in cache.live_seqs():
            raise InvalidState(f"sequence {seq} is not live in this cache")
        step = cache.prepared_step
        if step is not None and seq in step.seq_ids.tolist():
            raise InvalidState(f"sequence {seq} is in the prepared step, whose forward may not have "
                               "written its K/V yet: save after the step")
        cells, positions = cells_by_position(cache, seq)
        view = TorchView(cache)
        _sync(view)
        tensors: dict[str, torch.Tensor] = {"positions": torch.from_numpy(positions.copy())}
        index = torch.from_numpy(cells).to(view.layer(0)[0].device) if len(cells) else None
        dtype = torch_dtype(cache.config.dtype)
        for i in range(len(cache.config.layers)):
            # the values the pools stand for (8-bit pools: times their scales), in the dtype
            k, v = view.dequantized(i, index if index is not None else slice(0, 0), dtype)
            tensors[f"k.{i}"] = k.detach().to("cpu").contiguous()
            tensors[f"v.{i}"] = v.detach().to("cpu").contiguous()
    return tensors


def _read(cache: CellCache, path: Any) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The header and tensors of sequence file ``path``, once its header matches ``cache``
    (checked before any tensor is read: a file of another kind, a model's weights say, is
    refused without reading its gigabytes)."""
    from safetensors import SafetensorError, safe_open

    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgument(f"path of type {type(path).__name__} is not a file path")
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            _check_header(cache, path, meta)
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, SafetensorError) as e:
        raise InvalidArgument(f"{os.fspath(path)!r} is not a readable sequence file: {e}") from None
    return meta, tensors


def _check_header(cache: CellCache, path: Any, meta: dict[str, str]) -> None:
    """Refuses (InvalidArgument) a header of another format, version or model shape."""
    where = os.fspath(path)
    if meta.get("format") != FORMAT:
        raise InvalidArgument(f"{where!r} is not a cellcache sequence file (format {meta.get('format')!r})")
    if meta.get("version") != str(VERSION):
        raise InvalidArgument(f"{where!r} is version {meta.get('version')} of the sequence format; this "
                              f"cellcache reads version {VERSION}")
    try:
        theirs = json.loads(meta.get("layers", ""))
    except (ValueError, RecursionError):            # (RecursionError: arrays nested past the stack)
        raise InvalidArgument(f"{where!r} has no readable layer shapes in its header") from None
    ours = shape_of(cache)
    if not isinstance(theirs, list) or len(theirs) != len(ours):
        n = len(theirs) if isinstance(theirs, list) else "?"
        raise InvalidArgument(f"{where!r} was saved from a model of {n} attention layers; this cache "
                              f"has {len(ours)}")
    for i, (a, b) in enumerate(zip(theirs, ours)):
        if a != b:
            raise InvalidArgument(f"{where!r} was saved from another model shape: layer {i} there is {a}, "
                                  f"here {b}")


def _check_tokens(tokens: Any, where: str) -> list[int] | None:
    """The file's tokens as ids, or None when it holds none; InvalidArgument for tokens that
    are not a 1-D integer tensor of ids >= 0 (what :func:`save_sequence` writes)."""
    if tokens is None:
        return None
    if (not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype == torch.bool
            or tokens.is_floating_point() or tokens.is_complex()
            or (tokens.numel() and int(tokens.min()) < 0)):
        shown = f"a {tokens.dtype} tensor of shape {list(tokens.shape)}" if isinstance(tokens, torch.Tensor) \
            else type(tokens).__name__
        raise InvalidArgument(f"{where!r}: its tokens are {shown}, not a 1-D tensor of token ids >= 0")
    return [int(t) for t in tokens.tolist()]


def _check_tensors(cache: CellCache, tensors: dict[str, torch.Tensor], where: str) -> torch.Tensor:
    """The positions of ``tensors``, once they have every layer's K/V in ``cache``'s shape."""
    ours = shape_of(cache)
    for key, value in tensors.items():              # values to read: dense, on a real device
        if isinstance(value, torch.Tensor) and (value.layout != torch.strided or value.device.type == "meta"):
            kind = "meta" if value.device.type == "meta" else str(value.layout).removeprefix("torch.")
            raise InvalidArgument(f"{where}: {key} is a {kind} tensor; give dense tensors")
    pos = tensors.get("positions")
    if not isinstance(pos, torch.Tensor) or pos.dim() != 1 or pos.dtype != torch.int64:
        raise InvalidArgument(f"{where} holds no positions")
    n = pos.numel()
    if n and (int(pos[0]) < 0 or bool((pos[1:] <= pos[:-1]).any())):
        raise InvalidArgument(f"{where}: its positions are not increasing from 0 or more")
    dtype = torch_dtype(cache.config.dtype)
    for i, shape in enumerate(ours):
        for name in ("k", "v"):
            t = tensors.get(f"{name}.{i}")
            want = (n, shape["n_kv_heads"], shape["head_dim"])
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or t.dtype != dtype:
                raise InvalidArgument(f"{where}: {name}.{i} is missing or not a {dtype} tensor of "
                                      f"shape {want}")
    return pos


def load_sequence(cache: CellCache, path: Any) -> tuple[int, list[int] | None]:
    """A new sequence of ``cache`` holding the file's K/V at its positions; returns (its id,
    the tokens saved with it or None). Positions the file lacks below its last one (cells a
    window had let go) are placed with zero K/V, which no attention of theirs reads.

    InvalidArgument for a file that is not a sequence file (its header is checked before any
    tensor is read), of another version or another model shape, or whose tokens are not a
    1-D integer tensor of ids >= 0; InvalidState for a closed cache or a step declared or
    prepared and not committed; OutOfMemory when no sequence id or not enough cells are free. Every refusal
    changes nothing."""
    tensors, tokens = open_sequence(cache, path)
    return _write(cache, tensors, tensors["positions"]), tokens


def open_sequence(cache: CellCache, path: Any) -> tuple[dict[str, torch.Tensor], list[int] | None]:
    """The tensors of sequence file ``path`` (``positions``, then ``k.<layer>`` and
    ``v.<layer>`` at them) and the tokens saved with it (or None), every check of
    :func:`load_sequence` passed and nothing placed: what a caller that makes room first
    (:func:`cellcache.generate.load_prefix`) reads before it changes anything."""
    if not isinstance(cache, CellCache):
        raise InvalidArgument(f"cache of type {type(cache).__name__} is not a cellcache cache")
    _, tensors = _read(cache, path)
    _check_tensors(cache, tensors, repr(os.fspath(path)))
    return tensors, _check_tokens(tensors.get("tokens"), os.fspath(path))


def length_of(tensors: dict[str, torch.Tensor]) -> int:
    """The positions a sequence of ``tensors`` spans: its last position + 1 (0 when empty)."""
    pos = tensors["positions"]
    return int(pos[-1]) + 1 if pos.numel() else 0


def between_steps(cache: CellCache) -> None:
    """Refuses (InvalidState) while a step is declared or prepared in ``cache``: positions
    placed now would join it."""
    if cache.table.declared_width or cache.prepared_step is not None:
        raise InvalidState("a step is declared or prepared: load a sequence between steps")


def place_file(cache: CellCache, seq: int, tensors: dict[str, torch.Tensor], start: int) -> None:
    """Positions ``[start, length)`` of ``tensors`` (as :func:`open_sequence` returns them) on
    live sequence ``seq``, which holds ``[0, start)`` already (a prefix cache's clone of the
    part it holds), as :func:`place_positions` places them: a failure leaves ``seq`` with
    the steps committed before it (the caller removes ``seq``)."""
    with cache.lock:
        between_steps(cache)
        _place(cache, seq, tensors["positions"], tensors, length_of(tensors), start)


def write_sequence(cache: CellCache, tensors: dict[str, torch.Tensor]) -> int:
    """A new sequence of ``cache`` holding ``tensors`` (as :func:`read_sequence` returns them,
    in this cache's shape); returns its id. Refuses as :func:`load_sequence` does."""
    if not isinstance(cache, CellCache):
        raise InvalidArgument(f"cache of type {type(cache).__name__} is not a cellcache cache")
    if not isinstance(tensors, dict):
        raise InvalidArgument(f"tensors of type {type(tensors).__name__} is not a dict of tensors")
    return _write(cache, tensors, _check_tensors(cache, tensors, "the sequence"))


def _write(cache: CellCache, tensors: dict[str, torch.Tensor], pos: torch.Tensor) -> int:
    length = length_of(tensors)
    with cache.lock:
        between_steps(cache)
        if length > cache.free_cells:
            raise OutOfMemory(f"the sequence needs {length} cells; {cache.free_cells} are free")
        seq = cache.seq_new()
        if seq is None:
            raise OutOfMemory("no sequence id is free")
        try:
            _place(cache, seq, pos, tensors, length)
        except BaseException:
            cache.seq_rm(seq)
            raise
    return seq


def cells_by_position(cache: CellCache, seq: int, below: int | None = None
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(cells, positions) of live sequence ``seq``, int64, in increasing position (only
    positions below ``below`` when given): a window may have let some positions go."""
    cells = np.asarray(cache.table.seq_cells(seq), dtype=np.int64)
    positions = cache.table.positions_array()[cells]
    if below is not None:
        keep = positions < below
        cells, positions = cells[keep], positions[keep]
    order = np.argsort(positions, kind="stable")
    return cells[order], positions[order]


def place_positions(cache: CellCache, seq: int, start: int, length: int,
                    write: Callable[[int, int, np.ndarray], None], stream: Any = None) -> None:
    """Places positions ``[start, length)`` of ``seq`` (which holds ``[0, start)``) as steps
    of their own, ``max_write`` at a time: each declared, prepared (on ``stream``), given its
    K/V by ``write(first position, width, the step's cells)`` and committed. A failure
    takes back the step in flight (OutOfMemory when no cells are free) and propagates; the
    steps committed before it stay (the caller removes or rewinds ``seq``)."""
    width = cache.config.max_write
    for lo in range(start, length, width):
        w = min(width, length - lo)
        if not cache.declare_step([seq] * w):
            raise OutOfMemory(f"no {w} free cells for positions {lo}..{lo + w - 1}")
        try:
            step = cache.prepare_step(w, stream)   # (growth may fail: the declaration goes too)
        except BaseException:
            cache.undeclare()
            raise
        try:
            write(lo, w, np.asarray(step.cells[:w], dtype=np.int64))
        except BaseException:
            cache.unprepare_step()
            cache.undeclare()
            raise
        cache.commit_step()


def _place(cache: CellCache, seq: int, pos: torch.Tensor, tensors: dict[str, torch.Tensor],
           length: int, start: int = 0) -> None:
    """Positions ``[start, length)`` of ``seq`` given the file's K/V (zeros where it has none)."""
    view = TorchView(cache)
    have = torch.full((length,), -1, dtype=torch.int64)
    have[pos] = torch.arange(pos.numel())

    def write(lo: int, w: int, step_cells: np.ndarray) -> None:
        nonlocal view
        view = view if not view.stale() else TorchView(cache)
        cells = torch.from_numpy(step_cells).to(view.device)
        rows = have[lo:lo + w]
        some = rows >= 0
        for i in range(len(cache.config.layers)):
            blocks = []
            for name in ("k", "v"):
                src = tensors[f"{name}.{i}"]
                block = torch.zeros((w, *src.shape[1:]), dtype=src.dtype)
                block[some] = src[rows[some]]
                blocks.append(block.to(view.device))
            view.write_rows(i, cells, blocks[0], blocks[1])   # (8-bit pools: scaled as a forward's write)
        _sync(view)

    place_positions(cache, seq, start, length, write)
