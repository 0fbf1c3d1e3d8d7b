"""A sequence's cells saved to a file and loaded into another cache (cellcache.seqstate), on
the host backend: K/V and positions round-trip bit for bit (a fork's shared cells too, a
file with gaps below its last position), tokens ride along, and every refusal (another
model shape or format version, a file that is not one, a sequence that is not live or is
in a prepared step, a step in progress, no room, no id) is the library's error with nothing
changed."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

import numpy as np  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import cellcache as cc  # noqa: E402
from cellcache import InvalidArgument, InvalidState, OutOfMemory  # noqa: E402
from cellcache.seqstate import (  # noqa: E402
    FORMAT,
    load_sequence,
    read_sequence,
    save_sequence,
    shape_of,
    write_sequence,
)
from cellcache.torch import TorchView  # noqa: E402

from .helpers import FailingAllocator  # noqa: E402

LAYERS = (cc.LayerConfig(n_kv_heads=2, head_dim=8), cc.LayerConfig(n_kv_heads=2, head_dim=8, window=12))


def make(capacity: int = 256, dtype: str = "float32", layers=LAYERS, max_seqs: int = 8) -> cc.CellCache:
    return cc.HostCellCache(cc.CacheConfig(capacity=capacity, layers=layers, max_write=16, dtype=dtype,
                                           max_seqs=max_seqs))


def feed(cache, seq: int, n: int, seed: int) -> None:
    """``n`` tokens of ``seq`` placed in steps, each given random K/V as a forward would."""
    g = torch.Generator().manual_seed(seed)
    done = 0
    while done < n:
        w = min(16, n - done)
        assert cache.declare_step([seq] * w)
        step = cache.prepare_step(w)
        view = TorchView(cache)
        cells = torch.from_numpy(step.cells[:w].astype(np.int64))
        for i in range(len(cache.config.layers)):
            k, v, _ = view.layer(i)
            at = cells.to(k.device)
            k[at] = torch.randn((w, *k.shape[1:]), generator=g).to(k.device, k.dtype)
            v[at] = torch.randn((w, *v.shape[1:]), generator=g).to(v.device, v.dtype)
        cache.commit_step()
        done += w


def kv_at(cache, seq: int) -> dict[int, list[torch.Tensor]]:
    """Position -> every layer's K and V of ``seq`` there."""
    view = TorchView(cache)
    out = {}
    for c in cache.table.seq_cells(seq):
        p = cache.table.cell_pos_at(c)
        out[p] = [t[c].clone() for i in range(len(cache.config.layers)) for t in view.layer(i)[:2]]
    return out


def state(cache) -> tuple:
    live = sorted(cache.live_seqs())
    return cache.free_cells, live, [(s, cache.seq_len(s)) for s in live]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_sequence_round_trips_with_its_tokens(tmp_path, dtype):
    a = make(dtype=dtype)
    s = a.seq_new()
    feed(a, s, 40, seed=1)
    path = tmp_path / "s.kv"
    assert save_sequence(a, s, path, tokens=list(range(100, 140))) == 40
    b = make(dtype=dtype)
    other = b.seq_new()
    feed(b, other, 7, seed=2)                       # the loaded cells land elsewhere
    seq, tokens = load_sequence(b, path)
    assert tokens == list(range(100, 140)) and b.seq_len(seq) == 40 and b.pos(seq) == 40
    mine, theirs = kv_at(a, s), kv_at(b, seq)
    assert sorted(mine) == sorted(theirs) == list(range(40))
    assert all(torch.equal(x, y) for p in mine for x, y in zip(mine[p], theirs[p]))
    b.check_invariants()
    feed(b, seq, 3, seed=3)                          # it goes on as any other sequence
    assert b.seq_len(seq) == 43


def test_a_fork_saves_its_shared_cells_and_a_file_may_have_gaps(tmp_path):
    a = make()
    s = a.seq_new()
    feed(a, s, 20, seed=4)
    child = a.seq_clone(s, 12)
    feed(a, child, 5, seed=5)
    save_sequence(a, child, tmp_path / "c.kv")
    seq, tokens = load_sequence(make(), tmp_path / "c.kv")
    assert tokens is None
    b = make()
    seq, _ = load_sequence(b, tmp_path / "c.kv")
    mine, theirs = kv_at(a, child), kv_at(b, seq)
    assert sorted(theirs) == list(range(17))
    assert all(torch.equal(x, y) for p in mine for x, y in zip(mine[p], theirs[p]))
    # positions 3..5 only: 0..2 are placed with zeros (a window let them go)
    shapes = shape_of(b)
    tensors = {"positions": torch.tensor([3, 4, 5])}
    for i, sh in enumerate(shapes):
        for name in "kv":
            tensors[f"{name}.{i}"] = torch.full((3, sh["n_kv_heads"], sh["head_dim"]), float(i + 1))
    import json

    save_file(tensors, str(tmp_path / "g.kv"), metadata={"format": FORMAT, "version": "1",
                                                          "layers": json.dumps(shapes)})
    seq, _ = load_sequence(b, tmp_path / "g.kv")
    got = kv_at(b, seq)
    assert sorted(got) == list(range(6))
    assert all(not t.any() for p in range(3) for t in got[p])
    assert all(bool((t == (j // 2) + 1).all()) for p in range(3, 6) for j, t in enumerate(got[p]))


def test_refusals_are_the_library_errors_and_change_nothing(tmp_path):
    a = make()
    s = a.seq_new()
    feed(a, s, 30, seed=6)
    good = tmp_path / "s.kv"
    save_sequence(a, s, good)
    b = make()
    before = state(b)
    wide = make(layers=(cc.LayerConfig(n_kv_heads=4, head_dim=8), LAYERS[1]))
    with pytest.raises(InvalidArgument, match="another model shape: layer 0"):
        load_sequence(wide, good)
    with pytest.raises(InvalidArgument, match="2 attention layers; this cache has 1"):
        load_sequence(make(layers=LAYERS[:1]), good)
    with pytest.raises(InvalidArgument, match="another model shape"):
        load_sequence(make(dtype="bfloat16"), good)
    import json

    newer = {"format": FORMAT, "version": "2", "layers": json.dumps(shape_of(b))}
    for meta, fragment in [(newer, "version 2"), ({"format": "other"}, "not a cellcache sequence file")]:
        save_file({"positions": torch.tensor([0])}, str(tmp_path / "bad.kv"), metadata=meta)
        with pytest.raises(InvalidArgument, match=fragment):
            load_sequence(b, tmp_path / "bad.kv")
    (tmp_path / "junk.kv").write_bytes(b"not safetensors at all")
    for path, fragment in [(tmp_path / "junk.kv", "not a readable"),
                           (tmp_path / "missing.kv", "not a readable"), (3, "not a file path")]:
        with pytest.raises(InvalidArgument, match=fragment):
            load_sequence(b, path)
    assert state(b) == before
    # room and ids
    tiny = make(capacity=16)
    before = state(tiny)
    with pytest.raises(OutOfMemory, match="needs 30 cells"):
        load_sequence(tiny, good)
    assert state(tiny) == before
    small = make(capacity=32)
    full = make(max_seqs=1)
    full.seq_new()
    before = state(full)
    with pytest.raises(OutOfMemory, match="no sequence id"):
        load_sequence(full, good)
    assert state(full) == before
    # a step in progress, on either side
    assert small.declare_step([small.seq_new()])
    before = state(small)
    with pytest.raises(InvalidState, match="between steps"):
        load_sequence(small, good)
    assert state(small) == before and small.table.declared_width == 1
    step_seq = a.seq_new()
    assert a.declare_step([step_seq, s])
    a.prepare_step(2)
    with pytest.raises(InvalidState, match="prepared step"):
        save_sequence(a, s, tmp_path / "x.kv")
    with pytest.raises(InvalidState, match="not live"):
        save_sequence(a, 7, tmp_path / "x.kv")
    for bad, exc in [("1", InvalidArgument), (-1, InvalidArgument)]:
        with pytest.raises(exc):
            save_sequence(a, bad, tmp_path / "x.kv")
    fresh = b.seq_new()
    for bad in (["a"], [1, 2.5], [-1], 7, [2**63], [2**70]):
        with pytest.raises(InvalidArgument, match="token"):
            save_sequence(b, fresh, tmp_path / "x.kv", tokens=bad)
    assert not (tmp_path / "x.kv").exists()
    # a path that cannot be written: the library's error, no file
    for where in (tmp_path / "no-such-folder" / "x.kv", tmp_path):
        with pytest.raises(InvalidArgument, match="cannot write the sequence"):
            save_sequence(b, fresh, where)
    assert not (tmp_path / "no-such-folder").exists()
    # tensors to write that hold no values to read: refused before anything is placed
    src = make()
    s2 = src.seq_new()
    feed(src, s2, 10, seed=1)
    tensors = read_sequence(src, s2)
    before = state(b)
    for name, make_odd in [("positions", lambda t: t.to_sparse()), ("k.0", lambda t: t.to_sparse()),
                           ("positions", lambda t: t.to("meta")), ("v.1", lambda t: t.to("meta"))]:
        odd = dict(tensors)
        odd[name] = make_odd(odd[name])
        with pytest.raises(InvalidArgument, match=f"{name} is a (sparse_coo|meta) tensor"):
            write_sequence(b, odd)
    assert state(b) == before


def test_a_growth_that_fails_part_way_leaves_nothing_behind(tmp_path):
    """Loading 30 positions 16 a step into pools of 16 rows: the second step's growth fails
    (an injected allocation failure) after the first step committed; the new sequence goes,
    and the same load succeeds once allocations do."""
    a = make()
    s = a.seq_new()
    feed(a, s, 30, seed=8)
    save_sequence(a, s, tmp_path / "s.kv")
    cfg = cc.CacheConfig(capacity=256, layers=LAYERS, max_write=16, initial_capacity=16, max_seqs=8,
                         dtype="float32")
    probe = FailingAllocator()
    first = cc.HostCellCache(cfg, growth="copy", allocator=probe)
    assert first.declare_step([first.seq_new()] * 16)
    first.prepare_step(16)
    first.commit_step()
    b = cc.HostCellCache(cfg, growth="copy", allocator=FailingAllocator(fail_at=probe.calls))
    before = state(b)
    with pytest.raises(OutOfMemory, match="injected"):
        load_sequence(b, tmp_path / "s.kv")
    assert state(b) == before and b.table.declared_width == 0 and b.prepared_step is None
    b.check_invariants()


def test_in_memory_the_same_tensors_a_host_copy_to_spill_to():
    a = make(dtype="bfloat16")
    s = a.seq_new()
    feed(a, s, 21, seed=9)
    held = read_sequence(a, s)
    assert held["positions"].tolist() == list(range(21)) and held["k.0"].dtype == torch.bfloat16
    assert held["k.1"].device.type == "cpu" and tuple(held["v.1"].shape) == (21, 2, 8)
    a.seq_rm(s)                                      # spilled: its cells are free
    back = write_sequence(a, held)
    mine = {p: [held[f"{n}.{i}"][p] for i in range(2) for n in "kv"] for p in range(21)}
    theirs = kv_at(a, back)
    assert all(torch.equal(x, y) for p in mine for x, y in zip(mine[p], theirs[p]))
    before = state(a)
    for bad, fragment in [({**held, "k.0": held["k.0"].float()}, "bfloat16"),
                          ({**held, "v.1": held["v.1"][:3]}, "v.1"),
                          ({k: v for k, v in held.items() if k != "positions"}, "no positions"),
                          ({**held, "positions": held["positions"].flip(0)}, "increasing")]:
        with pytest.raises(InvalidArgument, match=fragment):
            write_sequence(a, bad)
    with pytest.raises(InvalidArgument, match="dict"):
        write_sequence(a, [held])
    assert state(a) == before


def _file(path, meta_layers: str, tokens=None, n: int = 3) -> None:
    """A sequence file of ``n`` positions in make()'s shape, its header's layers ``meta_layers``."""
    tensors = {"positions": torch.arange(n)}
    for i, sh in enumerate(shape_of(make())):
        for name in "kv":
            tensors[f"{name}.{i}"] = torch.ones((n, sh["n_kv_heads"], sh["head_dim"]))
    if tokens is not None:
        tensors["tokens"] = tokens
    save_file(tensors, str(path), metadata={"format": FORMAT, "version": "1", "layers": meta_layers})


def test_a_file_with_odd_tokens_or_a_header_nested_past_the_stack_is_refused_unplaced(tmp_path):
    """A header whose layer shapes nest deeper than Python's stack raised a bare
    RecursionError from json; tokens that are not a 1-D tensor of ids >= 0 (floats, [1, T],
    negative, bool) were handed back as they were (floats, nested lists) with the sequence
    placed."""
    import json

    b = make()
    before = state(b)
    _file(tmp_path / "deep.kv", "[" * 100_000 + "]" * 100_000)
    with pytest.raises(InvalidArgument, match="no readable layer shapes"):
        load_sequence(b, tmp_path / "deep.kv")
    layers = json.dumps(shape_of(b))
    for i, tokens in enumerate([torch.tensor([1.5, 2.0, 3.0]), torch.tensor([[1, 2, 3]]),
                                torch.tensor([-5, 1, 2]), torch.tensor([True, False, True]),
                                torch.zeros(0)]):
        _file(tmp_path / f"t{i}.kv", layers, tokens=tokens)
        with pytest.raises(InvalidArgument, match="not a 1-D tensor of token ids"):
            load_sequence(b, tmp_path / f"t{i}.kv")
    assert state(b) == before
    _file(tmp_path / "ok.kv", layers, tokens=torch.tensor([4, 5, 6], dtype=torch.int32))
    seq, tokens = load_sequence(b, tmp_path / "ok.kv")
    assert tokens == [4, 5, 6] and all(type(t) is int for t in tokens) and b.pos(seq) == 3


def test_a_file_of_another_kind_is_refused_before_its_tensors_are_read(tmp_path, monkeypatch):
    """Pointed at a model's weights (gigabytes of tensors), a load read every tensor into
    memory before it looked at the header."""
    import safetensors

    save_file({"w": torch.ones(64, 64)}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    real = safetensors.safe_open
    read: list[str] = []

    class Counting:
        def __init__(self, *args, **kwargs):
            self.f = real(*args, **kwargs)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Counting)
    b = make()
    before = state(b)
    with pytest.raises(InvalidArgument, match="not a cellcache sequence file"):
        load_sequence(b, tmp_path / "model.safetensors")
    assert read == [] and state(b) == before


@pytest.mark.parametrize("tokens", [range(10**18), range(2**70), "abc", {1, 2, 3}, {1: 2}, torch.tensor(3),
                                    (t for t in iter(int, 1))],
                         ids=["range-1e18", "range-2**70", "str", "set", "dict", "0-d", "endless"])
def test_save_refuses_tokens_that_are_no_sequence_or_too_many_unread(tmp_path, tokens):
    """range(10**18) or an endless generator was read until memory ran out; a set or dict
    (no order) was saved in whatever order it iterates, a 0-d tensor raised a bare TypeError."""
    a = make()
    s = a.seq_new()
    feed(a, s, 5, seed=1)
    with pytest.raises(InvalidArgument, match="tokens of type"):
        save_sequence(a, s, tmp_path / "x.kv", tokens=tokens)
    assert not (tmp_path / "x.kv").exists()
    assert save_sequence(a, s, tmp_path / "x.kv", tokens=iter(range(7))) == 5
    assert load_sequence(make(), tmp_path / "x.kv")[1] == list(range(7))


def test_a_save_is_whole_or_nothing_writes_through_a_link_and_never_replaces_a_special_file(
        tmp_path, monkeypatch):
    """A save failing part way (a full disk) left the file it had begun at the path, over
    what was there, unless the installed safetensors happened to write through a temporary
    of its own; safetensors 0.8's does, and renames it over the path whatever that is: a
    link was replaced by a file (its target left stale) and, as root, /dev/null by a file."""
    import os

    import safetensors.torch

    a = make()
    s = a.seq_new()
    feed(a, s, 12, seed=2)
    path = tmp_path / "s.kv"
    path.write_bytes(b"the previous save")
    real = safetensors.torch.save_file

    def half(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", half)
    with pytest.raises(InvalidArgument, match="cannot write the sequence.*No space left"):
        save_sequence(a, s, path)
    assert path.read_bytes() == b"the previous save" and os.listdir(tmp_path) == ["s.kv"]
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    # through a link: the target gets the sequence, the link stays
    target, link = tmp_path / "target.kv", tmp_path / "link.kv"
    target.write_bytes(b"old")
    link.symlink_to(target)
    assert save_sequence(a, s, link) == 12
    assert link.is_symlink() and load_sequence(make(), target)[0] == 0
    # a pipe (or a device) at the path is refused and left as it is
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(InvalidArgument, match="not a regular file"):
        save_sequence(a, s, fifo)
    assert fifo.is_fifo()
    assert sorted(os.listdir(tmp_path)) == ["link.kv", "pipe", "s.kv", "target.kv"]
