# Header-only bit helpers shared by the Cython modules.
from libc.stdint cimport uint64_t, int64_t

cdef extern from *:
    """
    static inline int cc_ctz64(unsigned long long x) { return __builtin_ctzll(x); }
    static inline int cc_clz64(unsigned long long x) { return __builtin_clzll(x); }
    """
    int cc_ctz64(unsigned long long x) noexcept nogil
    int cc_clz64(unsigned long long x) noexcept nogil


cdef inline uint64_t bit(int64_t i) noexcept nogil:
    """The word mask of bit ``i % 64``."""
    return (<uint64_t>1) << (i & 63)


cdef inline uint64_t bits_from(int64_t i) noexcept nogil:
    """Mask of bits ``[i % 64, 64)`` of a word."""
    return (~(<uint64_t>0)) << (i & 63)


cdef inline uint64_t bits_below(int64_t i) noexcept nogil:
    """Mask of bits ``[0, i % 64)`` of a word (0 when ``i % 64 == 0``)."""
    return bit(i) - 1
