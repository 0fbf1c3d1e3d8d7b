"""The width-bucket rule, written once in cellcache.buckets and used by every runner."""

import pytest

from cellcache import CacheConfig, HostCellCache, InvalidArgument, LayerConfig, attention
from cellcache.buckets import bucket_for, check_buckets, default_buckets, default_mixed_buckets
from cellcache.session import Session, SessionConfig


@pytest.mark.parametrize("max_write, largest, expect", [
    (1, None, [1]), (2, None, [1, 2]), (48, None, [1, 2, 4, 8, 16, 32, 48]),
    (64, None, [1, 2, 4, 8, 16, 32, 64]), (4096, 512, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]),
    (100, 512, [1, 2, 4, 8, 16, 32, 64, 100])])
def test_default_buckets_cover_every_width(max_write, largest, expect):
    buckets = default_buckets(max_write, largest)
    assert buckets == expect
    top = min(max_write, largest or max_write)
    for w in range(1, top + 1):
        b = bucket_for(w, buckets)
        assert b is not None and b >= w and all(x < w for x in buckets if x < b)
    assert bucket_for(top + 1, buckets) is None


@pytest.mark.parametrize("bad", [[], [0, 4], [4, 65], [2.0], "8", None, [True]])
def test_bad_buckets_are_refused(bad):
    with pytest.raises(InvalidArgument):
        check_buckets(bad, 64)


def test_check_buckets_sorts_and_drops_repeats():
    assert check_buckets((8, 2, 8, 64), 64) == [2, 8, 64]


def test_session_refuses_bad_buckets_with_the_library_error():
    cfg = CacheConfig(capacity=256, layers=[LayerConfig(1, 4)], max_write=16, dtype="float32")
    cache = HostCellCache(cfg)
    with pytest.raises(InvalidArgument):
        Session(cache, attention.reference_forward, SessionConfig(buckets=[4, 32]))
    assert cache.live_seqs() == [] and cache.rows == 0


@pytest.mark.parametrize("max_write", [1, 8, 16, 17, 1000, 1024, 1500, 8192, 10000])
def test_default_mixed_buckets_pad_by_less_than_1024_rows(max_write):
    buckets = default_mixed_buckets(max_write)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_write
    assert all(1 <= b <= max_write for b in buckets)
    for w in range(1, max_write + 1, max(1, max_write // 97)):
        b = bucket_for(w, buckets)
        assert b is not None and b >= w and (b - w < 1024 or b <= 1024)
