// Kernels that build a step on the device from the device mirror of the cell table.
//
// The mirror: pos[capacity] (int32, -1 = free); owners[owner_words][capacity] (uint64,
// word-major like the host table: the state the change records are diffed against); and
// seqbits[max_seqs][bit_words] (one bit per (sequence, cell), sequence-major, what the masks
// read: 16 columns of one sequence are 16 bits of one word).
//
// Each step the host uploads, in one copy, a header (seq_ids, positions, cells of the step's
// tokens, int64 each, `width` entries apiece) followed by change records {cell, pos, owner
// words...} for every cell whose pos or owners changed since the last step. apply_delta
// writes each record into pos/owners and flips, in seqbits, the bits that differ from the
// old owner words. Records name distinct cells and each thread owns one (cell, word), so each
// (sequence, cell) bit is flipped by at most one thread, and XOR commutes: the unordered
// atomics give the exact state.
//
// fill_masks then writes cells/positions/read_len and every window's mask rows [0,width) x
// cols [0,read_len): each thread owns 16 consecutive columns and sweeps its rows; a row whose
// sequence owns none of the 16 cells (the common case) stores zeros without touching pos.
#include <stdint.h>

// One thread per (record, owner word): every load is independent, so a step's records cost
// about one memory round trip whatever max_seqs is.
extern "C" __global__ void apply_delta(const int64_t* __restrict__ records, int64_t n,
                                       int64_t owner_words, int64_t capacity,
                                       int32_t* __restrict__ pos,
                                       uint64_t* __restrict__ owners,
                                       unsigned long long* __restrict__ seqbits,
                                       int64_t bit_words)
{
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    int64_t i = t / owner_words, w = t % owner_words;
    if (i >= n) return;
    const int64_t* rec = records + i * (2 + owner_words);
    int64_t c = rec[0];
    if (w == 0) pos[c] = (int32_t)rec[1];
    uint64_t now = (uint64_t)rec[2 + w];
    uint64_t diff = owners[w * capacity + c] ^ now;
    owners[w * capacity + c] = now;
    unsigned long long cell_bit = 1ull << (c & 63);
    while (diff) {
        int b = __ffsll((long long)diff) - 1;
        diff &= diff - 1;
        atomicXor(seqbits + (64 * w + b) * bit_words + (c >> 6), cell_bit);
    }
}

#define COLS 16
#define MAX_ROWS 64
#define MAX_WINDOWS 16
#define THREADS 128
#define BLOCK_WORDS (THREADS * COLS / 64)   // seqbits words one block's columns span

extern "C" __global__ void __launch_bounds__(THREADS)
fill_masks(const int64_t* __restrict__ header, int32_t width, int64_t read_len,
           const int32_t* __restrict__ pos, const uint64_t* __restrict__ seqbits,
           int64_t bit_words, int64_t capacity, const int64_t* __restrict__ windows,
           uint8_t* const* __restrict__ masks, int32_t n_windows,
           int64_t* __restrict__ cells_out, int64_t* __restrict__ positions_out,
           int64_t* __restrict__ read_len_out, int32_t rows_per_block)
{
    __shared__ int64_t s_seq[MAX_ROWS];
    __shared__ int64_t s_pos[MAX_ROWS];
    __shared__ uint64_t s_bits[MAX_ROWS][BLOCK_WORDS];   // this block's columns, per row
    __shared__ int64_t s_win[MAX_WINDOWS];
    __shared__ uint8_t* s_mask[MAX_WINDOWS];
    const int64_t* seq_ids = header;
    const int64_t* positions = header + width;
    const int64_t* cells = header + 2 * (int64_t)width;
    int32_t r0 = blockIdx.y * rows_per_block;
    int32_t r1 = min(width, r0 + rows_per_block);
    int32_t nrows = r1 - r0;
    for (int32_t r = r0 + threadIdx.x; r < r1; r += blockDim.x) {
        s_seq[r - r0] = seq_ids[r];
        s_pos[r - r0] = positions[r];
        if (blockIdx.x == 0) {
            cells_out[r] = cells[r];
            positions_out[r] = positions[r];
        }
    }
    for (int32_t k = threadIdx.x; k < n_windows; k += blockDim.x) {
        s_win[k] = windows[k];
        s_mask[k] = masks[k];
    }
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) read_len_out[0] = read_len;
    __syncthreads();
    // every row's bit words for this block's 2048 columns, loaded once, coalesced
    int64_t word0 = (int64_t)blockIdx.x * BLOCK_WORDS;
    for (int32_t idx = threadIdx.x; idx < nrows * BLOCK_WORDS; idx += blockDim.x) {
        int32_t r = idx / BLOCK_WORDS, j = idx % BLOCK_WORDS;
        int64_t w = word0 + j;
        s_bits[r][j] = w < bit_words ? seqbits[s_seq[r] * bit_words + w] : 0ull;
    }
    __syncthreads();

    int64_t col0 = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * COLS;
    if (col0 >= read_len) return;
    int ncols = (int)min((int64_t)COLS, read_len - col0);   // columns this thread writes
    bool full = ncols == COLS && (capacity % COLS) == 0;     // 16-byte aligned rows
    uint32_t col_mask = ncols == COLS ? 0xFFFFu : ((1u << ncols) - 1u);
    int my_word = threadIdx.x >> 2;                          // 4 threads per 64-bit word
    int shift = (threadIdx.x & 3) * COLS;

    int32_t p[COLS];
    bool have_pos = false;
#pragma unroll 4
    for (int32_t r = r0; r < r1; ++r) {
        int64_t qp = s_pos[r - r0];
        uint32_t owned = (uint32_t)(s_bits[r - r0][my_word] >> shift) & col_mask;
        uint32_t visible = 0;
        if (owned) {
            if (!have_pos) {
                have_pos = true;
                if (col0 + COLS <= capacity) {
                    const int4* src = reinterpret_cast<const int4*>(pos + col0);
#pragma unroll
                    for (int q = 0; q < COLS / 4; ++q) {
                        int4 v = src[q];
                        p[4 * q] = v.x; p[4 * q + 1] = v.y; p[4 * q + 2] = v.z; p[4 * q + 3] = v.w;
                    }
                } else {
#pragma unroll
                    for (int k = 0; k < COLS; ++k) p[k] = (col0 + k < capacity) ? pos[col0 + k] : -1;
                }
            }
            // owned cells are occupied; visible: not in the query's future
#pragma unroll
            for (int k = 0; k < COLS; ++k)
                visible |= (uint32_t)(((owned >> k) & 1u) && p[k] <= qp) << k;
        }
        for (int32_t wi = 0; wi < n_windows; ++wi) {
            uint32_t b[4] = {0u, 0u, 0u, 0u};
            if (visible) {
                int64_t win = s_win[wi];
                int64_t lo = win == 0 ? -1 : qp - win;   // visible positions are > lo
#pragma unroll
                for (int k = 0; k < COLS; ++k) {
                    uint32_t on = ((visible >> k) & 1u) && (p[k] > lo);
                    b[k >> 2] |= on << (8 * (k & 3));
                }
            }
            uint8_t* dst = s_mask[wi] + (int64_t)r * capacity + col0;
            if (full) {
                *reinterpret_cast<uint4*>(dst) = make_uint4(b[0], b[1], b[2], b[3]);
            } else {
                for (int k = 0; k < ncols; ++k) dst[k] = (uint8_t)((b[k >> 2] >> (8 * (k & 3))) & 1u);
            }
        }
    }
}
