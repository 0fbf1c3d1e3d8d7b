// Kernels that build a step on the device from the device mirror of the cell table.
//
// The mirror: pos[capacity] (int32, -1 = free) and owners[owner_words][capacity] (uint64,
// word-major like the host table). Each step the host uploads, in one copy, a header
// (seq_ids, positions, cells of the step's tokens, int64 each, `width` entries apiece)
// followed by change records {cell, pos, owner words...} for every cell whose pos or owners
// changed since the last step. apply_delta writes the records into the mirror; fill_masks
// then writes cells/positions/read_len and every window's mask rows [0,width) x cols
// [0,read_len), each thread owning 16 consecutive columns: it loads their pos/owner words
// once and sweeps its rows and all windows from registers, with one 16-byte store per row
// and window.
#include <stdint.h>

extern "C" __global__ void apply_delta(const int64_t* __restrict__ records, int64_t n,
                                       int64_t owner_words, int64_t capacity,
                                       int32_t* __restrict__ pos,
                                       uint64_t* __restrict__ owners)
{
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int64_t* rec = records + i * (2 + owner_words);
    int64_t c = rec[0];
    pos[c] = (int32_t)rec[1];
    for (int64_t w = 0; w < owner_words; ++w)
        owners[w * capacity + c] = (uint64_t)rec[2 + w];
}

#define COLS 16
#define MAX_ROWS 64

extern "C" __global__ void __launch_bounds__(128)
fill_masks(const int64_t* __restrict__ header, int32_t width, int64_t read_len,
           const int32_t* __restrict__ pos, const uint64_t* __restrict__ owners,
           int64_t capacity, const int64_t* __restrict__ windows,
           uint8_t* const* __restrict__ masks, int32_t n_windows,
           int64_t* __restrict__ cells_out, int64_t* __restrict__ positions_out,
           int64_t* __restrict__ read_len_out, int32_t rows_per_block)
{
    __shared__ int64_t s_seq[MAX_ROWS];
    __shared__ int64_t s_pos[MAX_ROWS];
    const int64_t* seq_ids = header;
    const int64_t* positions = header + width;
    const int64_t* cells = header + 2 * (int64_t)width;
    int32_t r0 = blockIdx.y * rows_per_block;
    int32_t r1 = min(width, r0 + rows_per_block);
    for (int32_t r = r0 + threadIdx.x; r < r1; r += blockDim.x) {
        s_seq[r - r0] = seq_ids[r];
        s_pos[r - r0] = positions[r];
        if (blockIdx.x == 0) {
            cells_out[r] = cells[r];
            positions_out[r] = positions[r];
        }
    }
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) read_len_out[0] = read_len;
    __syncthreads();

    int64_t col0 = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * COLS;
    if (col0 >= read_len) return;
    int ncols = (int)min((int64_t)COLS, read_len - col0);   // columns this thread writes
    bool full = ncols == COLS && (capacity % COLS) == 0;     // 16-byte aligned rows

    int32_t p[COLS];
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
    uint64_t o[COLS];
    int64_t cur_word = -1;

    for (int32_t r = r0; r < r1; ++r) {
        int64_t s = s_seq[r - r0];
        int64_t qp = s_pos[r - r0];
        int64_t word = s >> 6;
        if (word != cur_word) {
            cur_word = word;
            const uint64_t* ow = owners + word * capacity + col0;
            if (col0 + COLS <= capacity && (word == 0 || (capacity & 1) == 0)) {  // 16-B aligned
                const ulonglong2* src = reinterpret_cast<const ulonglong2*>(ow);
#pragma unroll
                for (int q = 0; q < COLS / 2; ++q) {
                    ulonglong2 v = src[q];
                    o[2 * q] = v.x; o[2 * q + 1] = v.y;
                }
            } else {
#pragma unroll
                for (int k = 0; k < COLS; ++k) o[k] = (col0 + k < capacity) ? ow[k] : 0ull;
            }
        }
        uint64_t bit = 1ull << (s & 63);
        // visible[k]: cell col0+k is owned by s, occupied, and not in the query's future
        uint32_t visible = 0;
#pragma unroll
        for (int k = 0; k < COLS; ++k)
            visible |= (uint32_t)((o[k] & bit) != 0 && p[k] >= 0 && p[k] <= qp) << k;
        for (int32_t wi = 0; wi < n_windows; ++wi) {
            int64_t win = windows[wi];
            int64_t lo = win == 0 ? -1 : qp - win;   // visible positions are > lo
            uint32_t b[4] = {0u, 0u, 0u, 0u};
#pragma unroll
            for (int k = 0; k < COLS; ++k) {
                uint32_t on = ((visible >> k) & 1u) && (p[k] > lo);
                b[k >> 2] |= on << (8 * (k & 3));
            }
            uint8_t* dst = masks[wi] + (int64_t)r * capacity + col0;
            if (full) {
                *reinterpret_cast<uint4*>(dst) = make_uint4(b[0], b[1], b[2], b[3]);
            } else {
                for (int k = 0; k < ncols; ++k) dst[k] = (uint8_t)((b[k >> 2] >> (8 * (k & 3))) & 1u);
            }
        }
    }
}
