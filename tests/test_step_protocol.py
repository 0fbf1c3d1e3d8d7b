"""The step protocol on the host cache: declare, prepare, commit in order; the checks of
prepare_step and their order, streams, caller code run before the step is read, clear, a verb
cancelling a declaration, rollback of a failed prepare, and padded steps."""

from __future__ import annotations

import numpy as np
import pytest

from cellcache import HostCellCache, InvalidArgument, InvalidState

from .helpers import assert_same, config, run_step, state


def test_prepare_step_checks_in_order():
    cache = HostCellCache(config())
    a = cache.seq_new()
    before = state(cache)
    with pytest.raises(InvalidArgument, match=r"step width 0 is outside \[1, max_write=9\]"):
        cache.prepare_step(width=0)        # width is checked before the declaration
    with pytest.raises(InvalidArgument, match="step width 10"):
        cache.prepare_step(width=10)
    with pytest.raises(InvalidArgument, match="width of type str"):
        cache.prepare_step(width="2")
    with pytest.raises(InvalidState, match="no step is declared"):
        cache.prepare_step()
    assert_same(state(cache), before)
    cache.declare_step([a, a])
    before = state(cache)
    with pytest.raises(InvalidState, match="step width 3 differs from the declared step's 2"):
        cache.prepare_step(width=3)
    for bad, match in [("default", "stream of type str"), (1.5, "stream of type float"),
                       ("7", "stream of type str"), (float("inf"), "stream of type float"),
                       (-1, "stream handle -1 is outside"), (2**64, "is outside \\[0, 2\\*\\*64\\)"),
                       (True, "stream of type bool"), (np.float32(0.5), "stream of type float32"),
                       (np.float64(0), "stream of type float64"), (np.bool_(False), "stream of type bool"),
                       (1j, "stream of type complex")]:
        with pytest.raises(InvalidArgument, match=match):
            cache.prepare_step(stream=bad)
    for pad, match in [(1, "pad_to=1 is outside \\[width=2, max_write=9\\]"),
                       (10, "pad_to=10 is outside"), (0, "pad_to=0 is outside"),
                       (2.0, "pad_to of type float")]:
        with pytest.raises(InvalidArgument, match=match):
            cache.prepare_step(pad_to=pad)
    assert_same(state(cache), before)
    assert cache.prepare_step(width=2).width == 2


def test_caller_code_runs_before_the_step_is_read():
    """A stream whose property re-declares: the step prepared is the one declared when the
    call acts, consistently (width, growth and placement agree)."""
    cache = HostCellCache(config(initial_capacity=2))
    a, b = cache.seq_new(), cache.seq_new()
    cache.declare_step([a])

    class Sneaky:
        @property
        def cuda_stream(self):
            cache.declare_step([b] * 8)
            return 0

    step = cache.prepare_step(stream=Sneaky())
    assert step.width == 8 and step.seq_ids.tolist() == [b] * 8
    assert cache.rows >= cache.used_end == 8
    cache.check_invariants()
    cache.commit_step()
    step = run_step(cache, [a] * 9)            # later growth still works
    assert cache.rows >= cache.used_end == 17

    class SneakyWidth:
        def __index__(self):
            cache.declare_step([a] * 3)
            return 3

    cache.declare_step([a])
    assert cache.prepare_step(width=SneakyWidth()).width == 3
    cache.check_invariants()


def test_streams_are_accepted_in_every_documented_form():
    cache = HostCellCache(config())
    a = cache.seq_new()

    class Torchish:
        cuda_stream = 0

    class Cupyish:
        ptr = 0

    class Coreish:
        handle = 0

    for stream in (None, 0, Torchish(), Cupyish(), Coreish(), np.uint64(0)):
        run_step(cache, [a], stream=stream)


def test_commit_without_step():
    cache = HostCellCache(config())
    with pytest.raises(InvalidState, match="no step is prepared"):
        cache.commit_step()
    a = cache.seq_new()
    run_step(cache, [a])
    before = state(cache)
    with pytest.raises(InvalidState, match="no step is prepared"):
        cache.commit_step()
    assert_same(state(cache), before)


def test_clear_commits_a_prepared_step_and_keeps_storage(monkeypatch):
    cache = HostCellCache(config())
    commits = []
    monkeypatch.setattr(cache, "_commit", lambda stream: commits.append(stream))
    a = cache.seq_new()
    run_step(cache, [a] * 9)
    commits.clear()
    cache.declare_step([a])
    cache.prepare_step()
    pools = [cache.buffer(n) for n in cache.buffer_names if n.startswith("layer")]
    cache.clear()
    assert commits == [0]                      # its forward stays ordered before what follows
    assert cache.rows == 18 and cache.used_end == 0 and cache.live_seqs() == []
    assert all(cache.buffer(n) is p for n, p in zip(
        [n for n in cache.buffer_names if n.startswith("layer")], pools))
    with pytest.raises(InvalidState, match="no step is prepared"):
        cache.commit_step()
    a = cache.seq_new()
    step = run_step(cache, [a] * 9)
    assert not step.grew and step.cells.tolist() == list(range(9))


def test_verb_on_declared_sequence_cancels_declaration():
    cache = HostCellCache(config())
    a, b = cache.seq_new(), cache.seq_new()
    run_step(cache, [a, b])
    cache.declare_step([a, b])
    cache.rewind(b, 0)
    with pytest.raises(InvalidState, match="no step is declared"):
        cache.prepare_step()


def test_failure_after_placement_rolls_back(monkeypatch):
    cache = HostCellCache(config(initial_capacity=32))     # no growth: only the claims change
    a, b = cache.seq_new(), cache.seq_new()
    run_step(cache, [a, b, a])
    cache.seq_rm(b)
    cache.declare_step([a, a])
    before = state(cache)

    def broken(*args, **kw):
        raise RuntimeError("mask fill failed")

    monkeypatch.setattr(cache, "_write_step", broken)
    with pytest.raises(RuntimeError, match="mask fill failed"):
        cache.prepare_step()
    assert_same(state(cache), before)
    monkeypatch.undo()
    step = cache.prepare_step()
    assert step.cells.tolist() == [1, 3] and step.positions.tolist() == [2, 3]


@pytest.mark.parametrize("fmt", ["bool", "bits"])
def test_padded_step(fmt):
    """Padding rows: cells name the sink, positions and mask rows mirror row 0, `width`
    holds the real width; the sink is no mask column and no entry of a real request."""
    cache = HostCellCache(config(capacity=24, max_write=8, initial_capacity=24, paged=True,
                                 mask_format=fmt))
    a, b = cache.seq_new(), cache.seq_new()
    run_step(cache, [a, a, b])
    step = run_step(cache, [b, a, b], pad_to=7)
    assert (step.width, step.pad_to, step.padded, step.n_runs, step.n_requests) == (3, 7, 4, 3, 7)
    sink = cache.sink
    assert sink == 24
    assert cache.buffer("cells")[:7].tolist() == step.cells.tolist() + [sink] * 4
    assert cache.buffer("positions")[:7].tolist() == [1, 2, 2, 1, 1, 1, 1]
    assert int(cache.buffer("width")[0]) == 3 and int(cache.buffer("read_len")[0]) == 6
    for w in cache.config.windows:
        m = cache.buffer(f"mask_w{w}")
        rows = m[0, 0, :7, :6] if fmt == "bool" else np.unpackbits(m[:7], axis=1, bitorder="little")[:, :6]
        for r in range(3, 7):
            assert rows[r].tolist() == rows[0].tolist()
    qo, kv = step.qo_indptr.tolist(), step.kv_indptr.tolist()
    assert qo == [0, 1, 2, 3, 4, 5, 6, 7]
    indices = cache.buffer("kv_indices")
    real = indices[:kv[3]].tolist()
    assert sink not in real and indices[kv[3]:kv[7]].tolist() == [sink] * 4


def test_forward_of_padded_steps_matches_unpadded():
    """The reference consumer run padded (NaN K/V written at the sink) gives, on the real
    rows, exactly what the same session gives unpadded, and no live row changes."""
    from cellcache import attention
    from cellcache.session import Session, SessionConfig

    results = []
    for buckets in (None, [4, 8]):
        cfg = config(capacity=96, max_write=8, max_seqs=12, paged=True)
        cache = HostCellCache(cfg)
        s = Session(cache, attention.reference_forward,
                    SessionConfig(n_heads=4, max_len=40, prompt=(3, 12), buckets=buckets), seed=5)
        results.append(s.run(60))
    assert results[0]["mismatches"] == results[1]["mismatches"] == 0
    assert results[1]["per_bucket"] and set(results[1]["per_bucket"]) <= {4, 8}
    assert results[0]["max_error"] == results[1]["max_error"]
