"""CacheConfig and LayerConfig: validation and normalisation; and what the cache refuses as a
whole (a non-config, a bad allocator, step buffers too large for memory, being copied), with
nothing changed."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

from cellcache import (
    CacheConfig,
    HostCellCache,
    InvalidArgument,
    InvalidState,
    LayerConfig,
    OutOfMemory,
)

from .helpers import assert_same, config, run_step, state


@pytest.mark.parametrize("kw,match", [
    (dict(capacity=0), "capacity=0 is outside"),
    (dict(capacity="8"), "capacity of type str is not an int"),
    (dict(layers=[]), "layers is empty"),
    (dict(layers=[(2, 4)]), "layers\\[0\\]=\\(2, 4\\) is not a LayerConfig"),
    (dict(layers="abc"), "layers of type str is not a sequence of LayerConfig"),
    (dict(max_write=0), "max_write=0 is outside \\[1, 32\\]"),
    (dict(max_write=33), "max_write=33 is outside \\[1, 32\\]"),
    (dict(dtype="int8"), "dtype='int8' is not one of float16, bfloat16, float32"),
    (dict(dtype=np.int8), "is not one of float16, bfloat16, float32"),
    (dict(max_seqs=0), "max_seqs=0 is outside"),
    (dict(device=-1), "device=-1 is outside"),
    (dict(paged=1), "paged of type int is not a bool"),
    (dict(max_kv=0), "max_kv=0 is outside"),
    (dict(max_kv=2**31), "max_kv=2147483648 is outside"),
    (dict(mask_format="dense"), "mask_format='dense' is not one of bool, bits, none"),
    # the paged view's indices are int32: the sink (= capacity) and max_kv + max_write fit it
    (dict(capacity=2**31, paged=True), r"capacity=2147483648 is outside \[1, 2\*\*31 - 1\] with "
                                       r"paged=True \(the paged view's cell indices are int32\)"),
    (dict(capacity=2**40, paged=True), "capacity=1099511627776 is outside"),
    (dict(capacity=2**31 - 1, max_write=2**31 - 1, paged=True),
     r"max_write=2147483647 is outside \[1, 2\*\*31 - 2\] with paged=True"),
    (dict(paged=True, max_kv=2**31 - 9), r"max_kv=2147483639 is outside \[1, 2147483638\]"),
    (dict(paged=True, max_kv=2**64), "max_kv=18446744073709551616 is outside"),
])
def test_config_errors(kw, match):
    with pytest.raises(InvalidArgument, match=match):
        config(**kw)


@pytest.mark.parametrize("kw,match", [
    (dict(n_kv_heads=0, head_dim=4), "n_kv_heads=0"),
    (dict(n_kv_heads=1, head_dim=0), "head_dim=0"),
    (dict(n_kv_heads=1, head_dim=4, window=-1), "window=-1"),
])
def test_layer_config_errors(kw, match):
    with pytest.raises(InvalidArgument, match=match):
        LayerConfig(**kw)


def test_config_normalises_what_it_is_given():
    assert config(initial_capacity=0).initial_capacity == 1
    assert config(initial_capacity=1000).initial_capacity == 32
    assert config(layers=[LayerConfig(1, 1, 5), LayerConfig(1, 1, 0), LayerConfig(1, 1, 5)]).windows == (0, 5)
    a, b = config(dtype=np.dtype("float16")), config(dtype="float16")
    assert a == b and hash(a) == hash(b) and a.dtype == "float16"
    assert config(paged=True).max_kv == 4 * 32 + 9 and config(paged=True, max_kv=7).max_kv == 7


def test_config_limits_of_the_paged_view():
    big = config(capacity=2**31 - 1, paged=True)
    assert big.capacity == 2**31 - 1 and big.max_kv == 2**31 - 1 - 9
    assert config(capacity=2**35).capacity == 2**35          # without the paged view: fine


def test_cache_rejects_non_config():
    with pytest.raises(InvalidArgument, match="config of type dict is not a CacheConfig"):
        HostCellCache({"capacity": 8})


# -- refusals of the cache object itself ---------------------------------------------------------

def test_copying_a_cache_is_refused():
    cache = HostCellCache(config())
    a = cache.seq_new()
    run_step(cache, [a, a])
    before = state(cache)
    for attempt in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(InvalidState, match="cannot be"):
            attempt(cache)
    assert_same(state(cache), before)


def test_bad_allocator_is_refused_at_construction():
    with pytest.raises(InvalidArgument, match="allocator of type int has no allocate"):
        HostCellCache(config(), allocator=5)


def test_step_buffers_too_large_for_memory_raise_out_of_memory():
    with pytest.raises(OutOfMemory, match="could not"):
        HostCellCache(CacheConfig(capacity=1 << 26, layers=[LayerConfig(1, 1)], max_write=1 << 26,
                                  initial_capacity=1))
