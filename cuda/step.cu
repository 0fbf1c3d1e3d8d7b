// Kernels that build a step on the device from the device mirror of the cell table.
//
// The mirror: pos[capacity] (int32, -1 = free); owners[owner_words][capacity] (u64,
// word-major like the host table: the state change records are diffed against); and
// seqbits[max_seqs][bit_words] (one bit per (sequence, cell), sequence-major: what the masks
// and the paged view read; 64 cells of one sequence are one word).
//
// Per step the host writes into pinned staging (layout in abi.h) the header, the
// step's ids, positions and cells, the paged view's runs and indptrs, and one change record
// per cell whose pos or owners changed. Two launches follow:
//   apply_step  reads the staging straight from host memory (one round trip: the sizes
//               come as arguments): applies the records to the mirror and writes the small
//               step buffers (cells, positions, read_len, width, ids, indptrs, runs, the
//               padding rows' sink entries).
//   build_step  blocks [0, mask_blocks) write every window's mask rows [0, pad_to) x
//               columns [0, read_len) (bools, a 32-column word per thread: mask_tile); the
//               rest fill each run's kv_indices. Bit masks launch build_step_bits instead
//               (same arguments and grid; a 64-column word per thread: mask_bits_tile).
#include "abi.h"

// One thread per (record, owner word), then the header's arrays. Records name distinct
// cells and each thread owns one (cell, word), so each (sequence, cell) bit of seqbits is
// flipped by at most one thread, and XOR commutes: unordered atomics give the exact state.
// The staging is pinned host memory read across PCIe: each dependent host read costs a round
// trip (longer than an empty kernel takes), so every size the loops need
// comes as an argument (the host knows them) and each thread issues the host reads of its
// first item of every part before it writes anything: one round trip for any step one pass
// of the grid covers (every decode step), where reading the header first cost four.
extern "C" __global__ void __launch_bounds__(CC_APPLY_THREADS)
apply_step(const cc_step_params* __restrict__ P, const cc_i64* __restrict__ stage,
           const cc_i64* __restrict__ records, cc_i64 n_records, cc_i64 ow, cc_i64 mw,
           cc_i64 width, cc_i64 pad_to, cc_i64 n_runs, cc_i64 read_len, cc_i64 sink, cc_i64 paged)
{
    const cc_i64 t = (cc_i64)blockIdx.x * blockDim.x + threadIdx.x;
    const cc_i64 stride = (cc_i64)gridDim.x * blockDim.x;
    const cc_i64* s_seq = stage + CC_OFF_SEQ(mw);
    const cc_i64* s_pos = stage + CC_OFF_POS(mw);
    const cc_i64* s_cells = stage + CC_OFF_CELLS(mw);
    const cc_i64* s_qo = stage + CC_OFF_QO(mw);
    const cc_i64* s_kv = stage + CC_OFF_KV(mw);
    const cc_i64* s_run_seq = stage + CC_OFF_RUN_SEQ(mw);
    const cc_i64* s_run_last = stage + CC_OFF_RUN_LAST(mw);
    // the first item of each part: every host read issued here, together
    const cc_i64 n_items = n_records * ow;
    cc_i64 r_cell = 0, r_pos = 0, r_now = 0, r_w = 0;
    if (t < n_items) {
        const cc_i64 i = t / ow;
        r_w = t - i * ow;
        const cc_i64* rec = records + i * (2 + ow);
        r_cell = rec[0];
        r_pos = rec[1];
        r_now = rec[2 + r_w];
    }
    cc_i64 a_cell = sink, a_pos = 0, a_seq = 0;
    if (t < pad_to) {
        const bool real = t < width;
        if (real) a_cell = s_cells[t];
        a_pos = s_pos[real ? t : 0];
        a_seq = s_seq[real ? t : 0];
    }
    cc_i64 a_qo = 0, a_kv = 0, a_run_seq = 0, a_run_last = 0, a_pad_kv = 0;
    if (paged) {
        if (t <= pad_to) {
            a_qo = s_qo[t];
            a_kv = s_kv[t];
        }
        if (t < n_runs) {
            a_run_seq = s_run_seq[t];
            a_run_last = s_run_last[t];
        }
        if (t < pad_to - width) a_pad_kv = s_kv[n_runs + t];
    }

    const cc_i64 capacity = P->capacity;
    cc_i32* pos = (cc_i32*)P->pos;
    cc_u64* owners = (cc_u64*)P->owners;
    unsigned long long* seqbits = (unsigned long long*)P->seqbits;
    for (cc_i64 k = t; k < n_items; k += stride) {
        cc_i64 c = r_cell, p = r_pos, w = r_w;
        cc_u64 now = (cc_u64)r_now;
        if (k != t) {
            const cc_i64 i = k / ow;
            w = k - i * ow;
            const cc_i64* rec = records + i * (2 + ow);
            c = rec[0];
            p = rec[1];
            now = (cc_u64)rec[2 + w];
        }
        if (w == 0) pos[c] = (cc_i32)p;
        cc_u64 diff = owners[w * capacity + c] ^ now;
        owners[w * capacity + c] = now;
        unsigned long long cell_bit = 1ull << (c & 63);
        while (diff) {
            int b = __ffsll((long long)diff) - 1;
            diff &= diff - 1;
            atomicXor(seqbits + (64 * w + b) * P->bit_words + (c >> 6), cell_bit);
        }
    }
    cc_i64* cells = (cc_i64*)P->cells;
    cc_i64* positions = (cc_i64*)P->positions;
    cc_i64* seq_ids = (cc_i64*)P->seq_ids;
    for (cc_i64 i = t; i < pad_to; i += stride) {
        if (i == t) {
            cells[i] = a_cell;
            positions[i] = a_pos;
            seq_ids[i] = a_seq;
        } else {
            const bool real = i < width;
            cells[i] = real ? s_cells[i] : sink;
            positions[i] = s_pos[real ? i : 0];
            seq_ids[i] = s_seq[real ? i : 0];
        }
    }
    if (paged) {
        cc_i32* qo = (cc_i32*)P->qo_indptr;
        cc_i32* kv = (cc_i32*)P->kv_indptr;
        cc_i32* kv_indices = (cc_i32*)P->kv_indices;
        for (cc_i64 i = t; i <= pad_to; i += stride) {
            qo[i] = (cc_i32)(i == t ? a_qo : s_qo[i]);
            kv[i] = (cc_i32)(i == t ? a_kv : s_kv[i]);
        }
        for (cc_i64 i = t; i < n_runs; i += stride) {       // (n_runs <= pad_to: a_kv is s_kv[t])
            ((cc_i64*)P->run_seq)[i] = i == t ? a_run_seq : s_run_seq[i];
            ((cc_i64*)P->run_last)[i] = i == t ? a_run_last : s_run_last[i];
            ((cc_i64*)P->run_kv)[i] = i == t ? a_kv : s_kv[i];
        }
        for (cc_i64 i = t; i < pad_to - width; i += stride)
            kv_indices[i == t ? a_pad_kv : s_kv[n_runs + i]] = (cc_i32)sink;
    }
    if (t == 0) {
        *(cc_i64*)P->read_len = read_len;
        *(cc_i64*)P->width = width;
    }
}

// Mask rows [r0, r1) x this block's CC_STEP_THREADS * CC_MASK_COLS columns (2048). The
// block's 64 32-column words are shared out one per thread, each word to two threads that
// split the rows (thread t: word t % 64, rows r0 + t / 64, r0 + t / 64 + 2, ...), so a warp
// stores 32 consecutive words (128 bytes of bits, 1 KB of bools) of one row at a time. A
// thread loads its 32 positions once, then per row one 32-bit owner word of the row's
// sequence (four rows' words in flight at a time), and sweeps every window from registers:
// a column is on when the row's sequence owns it and lo <= pos <= qp, one unsigned compare.
#define TILE_WORDS (CC_STEP_THREADS * CC_MASK_COLS / 32)    // 32-column words of a block tile
#define ROW_SPLIT (CC_STEP_THREADS / TILE_WORDS)            // threads sharing a word's rows

__device__ __forceinline__ void mask_tile(const cc_step_params* __restrict__ P, cc_i64 bx,
                                          cc_i32 r0, cc_i32 r1, cc_i64 read_len)
{
    __shared__ cc_i64 s_seq[CC_MASK_MAX_ROWS];
    __shared__ cc_i32 s_pos[CC_MASK_MAX_ROWS];
    __shared__ cc_i64 s_win[CC_MAX_WINDOWS];
    __shared__ cc_u64 s_dst[CC_MAX_WINDOWS];
    const cc_i64 capacity = P->capacity;
    const cc_i32 nrows = r1 - r0;
    const cc_i32 n_windows = (cc_i32)P->n_windows;
    for (cc_i32 r = threadIdx.x; r < nrows; r += blockDim.x) {
        s_seq[r] = ((const cc_i64*)P->seq_ids)[r0 + r];
        s_pos[r] = (cc_i32)((const cc_i64*)P->positions)[r0 + r];
    }
    if (threadIdx.x < n_windows) {
        s_win[threadIdx.x] = P->windows[threadIdx.x];
        s_dst[threadIdx.x] = P->masks[threadIdx.x];
    }
    const cc_i32 word = threadIdx.x % TILE_WORDS, half = threadIdx.x / TILE_WORDS;
    const cc_i64 col0 = (bx * TILE_WORDS + word) * 32;
    // this word's positions, loaded before the barrier so the loads overlap the rows'
    cc_i32 p[32];
    if (col0 + 32 <= capacity) {
        const int4* src = reinterpret_cast<const int4*>((const cc_i32*)P->pos + col0);
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            const int4 v = src[q];
            p[4 * q] = v.x; p[4 * q + 1] = v.y; p[4 * q + 2] = v.z; p[4 * q + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int k = 0; k < 32; ++k)
            p[k] = col0 + k < capacity ? ((const cc_i32*)P->pos)[col0 + k] : -1;
    }
    __syncthreads();
    if (col0 >= read_len) return;
    const int ncols = (int)min((cc_i64)32, read_len - col0);
    const cc_u32 col_mask = ncols == 32 ? 0xFFFFFFFFu : ((1u << ncols) - 1u);
    const bool bits_fmt = P->mask_format == CC_MASKS_BITS;
    const cc_i64 row_pitch = bits_fmt ? P->mask_row_bytes : capacity;
    const cc_i64 col_off = bits_fmt ? (col0 >> 3) : col0;
    // seqbits as 32-bit words: the low half of 64-bit word w is cells [64w, 64w + 32)
    const cc_u32* bits32 = (const cc_u32*)P->seqbits + (col0 >> 5);
    const cc_i64 seq_words = 2 * P->bit_words;

    for (cc_i32 rb = half; rb < nrows; rb += 4 * ROW_SPLIT) {
        cc_u32 own[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const cc_i32 r = rb + u * ROW_SPLIT;
            own[u] = r < nrows ? bits32[s_seq[r] * seq_words] & col_mask : 0u;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const cc_i32 r = rb + u * ROW_SPLIT;
            if (r >= nrows) break;
            const cc_i32 qp = s_pos[r];
            const cc_i64 row_off = (cc_i64)(r0 + r) * row_pitch + col_off;
            for (cc_i32 wi = 0; wi < n_windows; ++wi) {
                cc_u32 on = 0;
                if (own[u]) {
                    const cc_i64 win = s_win[wi];
                    // visible positions are [lo, qp]; owned cells are occupied (pos >= 0)
                    const cc_i32 lo = (win == 0 || qp - win + 1 < 0) ? 0 : (cc_i32)(qp - win + 1);
                    const cc_u32 span = (cc_u32)(qp - lo);
#pragma unroll
                    for (int k = 0; k < 32; ++k)
                        on |= (cc_u32)((cc_u32)(p[k] - lo) <= span) << k;
                    on &= own[u];
                }
                cc_u8* dst = (cc_u8*)s_dst[wi] + row_off;
                const cc_u64 addr = (cc_u64)dst;
                if (bits_fmt) {
                    if (ncols == 32 && (addr & 3) == 0) {
                        *reinterpret_cast<cc_u32*>(dst) = on;
                    } else {
                        for (int b = 0; b < (ncols + 7) >> 3; ++b) dst[b] = (cc_u8)(on >> (8 * b));
                    }
                } else {
                    cc_u32 w[8];                          // byte k of the 32 = bit k of on
#pragma unroll
                    for (int q = 0; q < 8; ++q) {
                        const cc_u32 nib = (on >> (4 * q)) & 0xFu;
                        w[q] = (nib & 1u) | ((nib & 2u) << 7) | ((nib & 4u) << 14) | ((nib & 8u) << 21);
                    }
                    if (ncols == 32 && (addr & 15) == 0) {
                        reinterpret_cast<uint4*>(dst)[0] = make_uint4(w[0], w[1], w[2], w[3]);
                        reinterpret_cast<uint4*>(dst)[1] = make_uint4(w[4], w[5], w[6], w[7]);
                    } else if (ncols == 32 && (addr & 3) == 0) {
#pragma unroll
                        for (int q = 0; q < 8; ++q) reinterpret_cast<cc_u32*>(dst)[q] = w[q];
                    } else {
                        for (int k = 0; k < ncols; ++k) dst[k] = (cc_u8)((on >> k) & 1u);
                    }
                }
            }
        }
    }
}

// Run `run`'s kv list, for this block's chunk of seqbits words: every cell of the run's
// sequence at a position <= the run's last goes to kv_indices[offset + position], so the
// list comes out in position order whatever order the cells lie in.
__device__ __forceinline__ void paged_chunk(const cc_step_params* __restrict__ P, cc_i64 run,
                                            cc_i64 chunk, cc_i64 read_len)
{
    const cc_i64 s = ((const cc_i64*)P->run_seq)[run];
    const cc_i64 last = ((const cc_i64*)P->run_last)[run];
    const cc_i64 off = ((const cc_i64*)P->run_kv)[run];
    const cc_i64 words = (read_len + 63) >> 6;
    const cc_i64 w0 = chunk * (CC_STEP_THREADS * CC_PAGED_WORDS);
    const cc_u64* bits = (const cc_u64*)P->seqbits + s * P->bit_words;
    const cc_i32* pos = (const cc_i32*)P->pos;
    cc_i32* kv_indices = (cc_i32*)P->kv_indices;
#pragma unroll 4
    for (int k = 0; k < CC_PAGED_WORDS; ++k) {
        const cc_i64 w = w0 + (cc_i64)k * CC_STEP_THREADS + threadIdx.x;
        if (w >= words) break;
        cc_u64 word = bits[w];
        while (word) {
            const int b = __ffsll((long long)word) - 1;
            word &= word - 1;
            const cc_i64 c = (w << 6) + b;
            const cc_i64 p = pos[c];
            if (p <= last) kv_indices[off + p] = (cc_i32)c;
        }
    }
}

// A build kernel's blocks: [0, mask_blocks) make mask tiles with TILE (bool or bits), the
// rest fill the runs' kv_indices. LAST_FIRST orders the mask blocks tile by tile from the
// last tile (its row ranges together): the last tile usually holds the step's fresh cells,
// whose words are not runs and take longest, and blocks that start first get their reads
// served first.
template <void (*TILE)(const cc_step_params* __restrict__, cc_i64, cc_i32, cc_i32, cc_i64),
          bool LAST_FIRST>
__device__ __forceinline__ void build_blocks(const cc_step_params* __restrict__ P, cc_i64 pad_to,
                                             cc_i64 read_len, cc_i64 mask_gx, cc_i64 mask_blocks,
                                             cc_i32 rows_per_block, cc_i64 paged_chunks)
{
    const cc_i64 b = blockIdx.x;
    if (b < mask_blocks) {
        const cc_i64 gy = mask_blocks / mask_gx;
        const cc_i64 bx = LAST_FIRST ? mask_gx - 1 - b / gy : b % mask_gx;
        const cc_i64 by = LAST_FIRST ? b % gy : b / mask_gx;
        const cc_i32 r0 = (cc_i32)(by * rows_per_block);
        const cc_i32 r1 = (cc_i32)min(pad_to, (cc_i64)r0 + rows_per_block);
        TILE(P, bx, r0, r1, read_len);
    } else {
        const cc_i64 pb = b - mask_blocks;
        paged_chunk(P, pb / paged_chunks, pb % paged_chunks, read_len);
    }
}

extern "C" __global__ void __launch_bounds__(CC_STEP_THREADS, 8)
build_step(const cc_step_params* __restrict__ P, cc_i64 pad_to, cc_i64 read_len,
           cc_i64 mask_gx, cc_i64 mask_blocks, cc_i32 rows_per_block, cc_i64 paged_chunks)
{
    build_blocks<mask_tile, false>(P, pad_to, read_len, mask_gx, mask_blocks, rows_per_block,
                                   paged_chunks);
}

// ---- Bit masks: build_step_bits ----------------------------------------------------------
// The engine launches build_step_bits in place of build_step when the masks are bits: same
// arguments, same grid (mask blocks of 2048 columns x rows_per_block rows, then the paged
// blocks), a kernel of its own so that neither path's registers or shared memory weigh on
// the other (build_step's bool path keeps its code and its occupancy).
//
// A mask block's 2048 columns are 16 pairs of 64-column words: lane l of a warp owns pair
// l % 16 (128 columns, one 16-byte store per row and window) and the warp's two half-warps
// take two rows at a time, the block's eight half-warps splitting its rows (half-warp k:
// rows r0 + k, r0 + k + 8, ...), so one store instruction writes 256 consecutive bytes of
// each of two rows. Every global read of the block is issued before the rows are made, and
// none is left to registers the compiler may sink past a barrier (ptxas moved the previous
// kernel's four register-held seqbits reads behind both of its barriers):
//   1. all threads: the tile's positions, cp.async into shared memory (16 bytes a thread
//      and pass, coalesced; the 16-byte chunks of word w rotated by (w / 2) & 7, so that
//      lanes reading their own word pairs meet no bank conflict);
//   2. warp 0: the rows' ids and positions (two rows a lane) and the rows' distinct
//      sequences (match.any), each row's slot in that compact list;
//   3. barrier, then all threads: each distinct sequence's 32 seqbits words of the tile
//      once, cp.async into shared memory (32 sequences a batch; more in the rare block whose
//      rows hold more than 32 sequences, batch by batch);
//   4. the positions' wait and barrier, then a vote: does word w run p0, p0 + 1, ...,
//      p0 + 63 (cells placed by one run)? Then the seqbits' wait and barrier.
// A row's words then come from shared memory: a word the row's sequence does not own is a
// zero store; an owned run word is visible on the bit range [lo - p0, qp - p0]; any other
// owned word takes one unsigned compare per owned column when the row owns BITS_SPARSE or
// fewer of its columns, else one per column, as in mask_tile. The mask blocks go tile by
// tile from the last tile (build_blocks' LAST_FIRST).
#define BITS_WORDS 32                                       // 64-column words of a tile
#define BITS_PAIRS (BITS_WORDS / 2)                         // a lane's two words
#define BITS_TILE_COLS (BITS_WORDS * 64)
#define BITS_HALVES (CC_STEP_THREADS / 16)                  // half-warps sharing a tile's rows
#define BITS_SPARSE 8                                       // owned columns tested one by one
#define BITS_SLOTS 32                                       // sequences staged at a time
#define BITS_CHUNKS (BITS_TILE_COLS / 4 / CC_STEP_THREADS)  // 16-byte position loads a thread
#define BITS_MIN_BLOCKS 12                                  // resident blocks an SM (registers)
static_assert(CC_STEP_THREADS * CC_MASK_COLS == BITS_TILE_COLS, "bits tile = engine tile");
static_assert(CC_MASK_MAX_ROWS <= 64, "warp 0 reads two rows a lane");
static_assert(BITS_SLOTS * BITS_PAIRS % CC_STEP_THREADS == 0, "whole staging passes");

// Bits [a, b] of a 64-bit word (none when a > b), a and b clamped to [0, 63].
__device__ __forceinline__ cc_u64 bit_range(cc_i64 a, cc_i64 b)
{
    a = a < 0 ? 0 : a;
    b = b > 63 ? 63 : b;
    return a > b ? 0ull : (~0ull << a) & (~0ull >> (63 - b));
}

// The first ncols bits of `on` to dst (bytes [0, ceil(ncols / 8))) when dst is not 8-byte
// aligned or the word is the last, short one: the widest units the alignment allows.
__device__ __forceinline__ void store_bits_slow(cc_u8* dst, cc_u64 on, int ncols)
{
    const cc_u64 addr = (cc_u64)dst;
    if (ncols == 64 && (addr & 3) == 0) {
        reinterpret_cast<cc_u32*>(dst)[0] = (cc_u32)on;
        reinterpret_cast<cc_u32*>(dst)[1] = (cc_u32)(on >> 32);
    } else if (ncols == 64 && (addr & 1) == 0) {
        for (int h = 0; h < 4; ++h)
            reinterpret_cast<unsigned short*>(dst)[h] = (unsigned short)(on >> (16 * h));
    } else {
        for (int b = 0; b < (ncols + 7) >> 3; ++b) dst[b] = (cc_u8)(on >> (8 * b));
    }
}

// Word `on` of `ncols` columns (1..64) to dst: one 8-byte store when it can.
__device__ __forceinline__ void store_bits_word(cc_u8* dst, cc_u64 on, int ncols)
{
    if (ncols == 64 && ((cc_u64)dst & 7) == 0) *reinterpret_cast<cc_u64*>(dst) = on;
    else store_bits_slow(dst, on, ncols);
}

// The visible columns of an owned word `o` for a row at qp seeing positions [lo, qp]: a run
// word (p0 >= 0) by its bit range, any other by the positions of its owned columns when they
// are few (BITS_SPARSE or fewer), else by all 64 (wp: the word's chunks in shared memory,
// rotated by sw).
__device__ __forceinline__ cc_u64 visible_bits(cc_u64 o, cc_i32 p0, cc_i32 lo, cc_i32 qp,
                                               const int4* wp, int sw)
{
    if (p0 >= 0) return bit_range((cc_i64)lo - p0, (cc_i64)qp - p0) & o;
    const cc_u32 span = (cc_u32)(qp - lo);
    if (__popcll(o) <= BITS_SPARSE) {
        // few owned columns (a decode step's fresh cells, where every row's sequence owns
        // one or two of the word's 64): test those only. The 64 compares below made the
        // tile holding a step's new cells the kernel's slowest block by 2x (its lane's
        // half-warp waited on them for every row and window).
        const cc_i32* wp32 = reinterpret_cast<const cc_i32*>(wp);
        cc_u64 on = 0ull, m = o;
        while (m) {
            const int j = __ffsll((long long)m) - 1;
            m &= m - 1ull;
            const cc_i32 v = wp32[4 * ((j >> 2) ^ sw) + (j & 3)];
            if ((cc_u32)(v - lo) <= span) on |= 1ull << j;
        }
        return on;
    }
    cc_u32 half[2] = {0u, 0u};
#pragma unroll
    for (int q = 0; q < 16; ++q) {
        const int4 v = wp[q ^ sw];
        const cc_u32 nib = (cc_u32)((cc_u32)(v.x - lo) <= span)
                         | (cc_u32)((cc_u32)(v.y - lo) <= span) << 1
                         | (cc_u32)((cc_u32)(v.z - lo) <= span) << 2
                         | (cc_u32)((cc_u32)(v.w - lo) <= span) << 3;
        half[q >> 3] |= nib << (4 * (q & 7));
    }
    return ((cc_u64)half[0] | ((cc_u64)half[1] << 32)) & o;
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
                 :: "r"((cc_u32)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async8(void* dst, const void* src)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n"
                 :: "r"((cc_u32)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
}

// Slots [b0, b0 + BITS_SLOTS) of the block's sequence list (ids in s_slot_seq, nd of them):
// tile bx's seqbits words below read_len of each, to s_bits[slot - b0][word]; the last
// tile's words past read_len are not read and stay as they were (every reader masks them).
__device__ __forceinline__ void stage_seqbits(const cc_step_params* __restrict__ P, cc_i64 bx,
                                              cc_i64 read_len, cc_u64* s_bits,
                                              const cc_i64* s_slot_seq, int b0, int nd)
{
    const cc_u64* bits = (const cc_u64*)P->seqbits + bx * BITS_WORDS;
    const cc_i64 bit_words = P->bit_words;
    const cc_i64 nwords = (read_len + 63) / 64 - bx * BITS_WORDS;     // >= 1
    const int n = min(BITS_SLOTS, nd - b0) * BITS_PAIRS;
#pragma unroll 1
    for (int i = threadIdx.x; i < n; i += CC_STEP_THREADS) {
        const int k = i / BITS_PAIRS, w = 2 * (i % BITS_PAIRS);
        if (w >= nwords) continue;
        const cc_u64* src = bits + s_slot_seq[b0 + k] * bit_words + w;
        cc_u64* dst = s_bits + k * BITS_WORDS + w;
        if (w + 1 < nwords && ((cc_u64)src & 15) == 0) {
            cp_async16(dst, src);
        } else {                              // an odd bit_words row, or the last word
            cp_async8(dst, src);
            if (w + 1 < nwords) cp_async8(dst + 1, src + 1);
        }
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

__device__ __forceinline__ void mask_bits_tile(const cc_step_params* __restrict__ P, cc_i64 bx,
                                               cc_i32 r0, cc_i32 r1, cc_i64 read_len)
{
    __shared__ __align__(16) cc_i32 s_pos[BITS_TILE_COLS];    // chunk q of word w at q ^ sw(w)
    __shared__ __align__(16) cc_u64 s_bits[BITS_SLOTS * BITS_WORDS];  // [slot][word]
    __shared__ __align__(8) cc_i32 s_p0[BITS_WORDS];        // a run's first position, else -1
    __shared__ cc_i64 s_slot_seq[CC_MASK_MAX_ROWS];          // the block's distinct sequences
    __shared__ cc_i32 s_qp[CC_MASK_MAX_ROWS];                // row r0 + r's position, slot
    __shared__ cc_u8 s_slot[CC_MASK_MAX_ROWS];
    __shared__ cc_i64 s_win[CC_MAX_WINDOWS];
    __shared__ cc_u64 s_dst[CC_MAX_WINDOWS];
    __shared__ int s_nd;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const cc_i64 tile0 = bx * BITS_TILE_COLS;
    const cc_i32 nrows = r1 - r0;
    // 1. the tile's positions, straight to shared memory (cp.async: no registers held): pass
    // j of thread t copies chunk i = t + CC_STEP_THREADS * j, columns tile0 + 4i .. 4i + 3
    // (-1 past read_len)
    {
        const cc_i32* pos = (const cc_i32*)P->pos;
        int4* s_pos4 = reinterpret_cast<int4*>(s_pos);
#pragma unroll
        for (int j = 0; j < BITS_CHUNKS; ++j) {
            const int i = threadIdx.x + CC_STEP_THREADS * j, w = i >> 4, q = i & 15;
            const cc_i64 c = tile0 + 4 * i;
            int4* d = s_pos4 + (w << 4) + (q ^ ((w >> 1) & 7));
            if (c + 4 <= read_len) {
                cp_async16(d, pos + c);
            } else {
                int4 v;
                v.x = c < read_len ? pos[c] : -1;
                v.y = c + 1 < read_len ? pos[c + 1] : -1;
                v.z = c + 2 < read_len ? pos[c + 2] : -1;
                v.w = c + 3 < read_len ? pos[c + 3] : -1;
                *d = v;
            }
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    // 2. warp 0: rows r0 + lane (a) and r0 + 32 + lane (b); ids are >= 0, -1 marks no row.
    // A row's slot is its sequence's index in the block's list of distinct sequences, listed
    // in order of first row.
    if (warp == 0) {
        const cc_i64* ids = (const cc_i64*)P->seq_ids + r0;
        const cc_i64* qps = (const cc_i64*)P->positions + r0;
        const bool va = lane < nrows, vb = lane + 32 < nrows;
        const cc_i64 ia = va ? ids[lane] : -1, ib = vb ? ids[lane + 32] : -1;
        if (va) s_qp[lane] = (cc_i32)qps[lane];
        if (vb) s_qp[lane + 32] = (cc_i32)qps[lane + 32];
        const int la = __ffs(__match_any_sync(0xFFFFFFFFu, ia)) - 1;    // a's first row
        const cc_u32 lead_a = __ballot_sync(0xFFFFFFFFu, va && la == lane);
        const int na = __popc(lead_a);
        int fb = -1;                                                    // an a row with b's id
        if (nrows > 32) {
#pragma unroll 1
            for (int k = 0; k < 32; ++k) {
                const cc_i64 x = __shfl_sync(0xFFFFFFFFu, ia, k);
                if (fb < 0 && vb && x == ib) fb = k;
            }
        }
        const bool nb = vb && fb < 0;                                   // b's sequence is new
        const int lb = __ffs(__match_any_sync(0xFFFFFFFFu, nb ? ib : -1)) - 1;
        const cc_u32 lead_b = __ballot_sync(0xFFFFFFFFu, nb && lb == lane);
        const int sa = __popc(lead_a & ((1u << la) - 1u));
        const int sb = fb >= 0 ? __popc(lead_a & ((1u << fb) - 1u))
                               : na + __popc(lead_b & ((1u << lb) - 1u));
        if (va) s_slot[lane] = (cc_u8)sa;
        if (vb) s_slot[lane + 32] = (cc_u8)sb;
        if (va && la == lane) s_slot_seq[sa] = ia;
        if (nb && lb == lane) s_slot_seq[sb] = ib;
        if (lane == 0) s_nd = na + __popc(lead_b);
    } else if (warp == 1 && lane < P->n_windows) {
        s_win[lane] = P->windows[lane];
        s_dst[lane] = P->masks[lane];
    }
    __syncthreads();
    // 3. the first batch of the sequences' words
    const int nd = s_nd;
    stage_seqbits(P, bx, read_len, s_bits, s_slot_seq, 0, nd);
    // 4. the positions are in: does word t / 4 run p0, p0 + 1, ..., p0 + 63? Thread t
    // checks four of its chunks (an odd word's threads in the other order, so the eight
    // lanes of a shared-memory phase meet eight banks), the word's four threads vote
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
    __syncthreads();
    {
        const int w = threadIdx.x >> 2, sw = (w >> 1) & 7, i = threadIdx.x & 3;
        const int4* wp = reinterpret_cast<const int4*>(s_pos) + (w << 4);
        const cc_i32 first = wp[sw].x;                   // chunk 0 lies at 0 ^ sw
        bool run = first >= 0;
#pragma unroll
        for (int qq = 0; qq < 4; ++qq) {
            const int q = 4 * (qq ^ (w & 1)) + i;
            const int4 v = wp[q ^ sw];
            const cc_i32 e = first + 4 * q;
            run = run && v.x == e && v.y == e + 1 && v.z == e + 2 && v.w == e + 3;
        }
        const cc_u32 vote = (__ballot_sync(0xFFFFFFFFu, run) >> (lane & 28)) & 0xFu;
        if (i == 0) s_p0[w] = vote == 0xFu ? first : -1;
    }
    // the rows: lane l of half-warp hw makes word pair l % 16 of rows hw, hw + 8, ...
    const int hw = threadIdx.x >> 4, pr = threadIdx.x & 15, sw = pr & 7;
    const cc_i64 col0 = tile0 + 128 * pr;
    const cc_i64 left = read_len - col0;
    const int n0 = left <= 0 ? 0 : (left >= 64 ? 64 : (int)left);
    const int n1 = left <= 64 ? 0 : (left >= 128 ? 64 : (int)(left - 64));
    const cc_u64 cm0 = n0 == 64 ? ~0ull : ((1ull << n0) - 1ull);
    const cc_u64 cm1 = n1 == 64 ? ~0ull : ((1ull << n1) - 1ull);
    const int4* wp0 = reinterpret_cast<const int4*>(s_pos) + (pr << 5);
    const int4* wp1 = wp0 + 16;
    const cc_i32 n_windows = (cc_i32)P->n_windows;
    const cc_i64 pitch = P->mask_row_bytes;
    const cc_i64 off0 = (cc_i64)(r0 + hw) * pitch + (col0 >> 3);      // row r0 + hw's bytes
#pragma unroll 1
    for (int b0 = 0;; b0 += BITS_SLOTS) {
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        __syncthreads();                   // s_bits' batch and (first time) s_p0 are in
        if (n0 > 0) {
            const int2 p0 = reinterpret_cast<const int2*>(s_p0)[pr];
            cc_i64 off = off0 - BITS_HALVES * pitch;
#pragma unroll 1
            for (cc_i32 r = hw; r < nrows; r += BITS_HALVES) {
                off += BITS_HALVES * pitch;
                const cc_u32 k = (cc_u32)s_slot[r] - (cc_u32)b0;
                if (k >= BITS_SLOTS) continue;                  // another batch's row
                const ulonglong2 own =
                    reinterpret_cast<const ulonglong2*>(s_bits + k * BITS_WORDS)[pr];
                const cc_u64 o0 = own.x & cm0, o1 = own.y & cm1;
                const cc_i32 qp = s_qp[r];
#pragma unroll 1
                for (cc_i32 wi = 0; wi < n_windows; ++wi) {
                    const cc_i64 win = s_win[wi];
                    // visible positions are [lo, qp]; owned cells are occupied (pos >= 0)
                    const cc_i32 lo = (win == 0 || qp - win + 1 < 0) ? 0 : (cc_i32)(qp - win + 1);
                    const cc_u64 on0 = o0 ? visible_bits(o0, p0.x, lo, qp, wp0, sw) : 0ull;
                    const cc_u64 on1 = o1 ? visible_bits(o1, p0.y, lo, qp, wp1, sw) : 0ull;
                    cc_u8* dst = (cc_u8*)s_dst[wi] + off;
                    if (n1 == 64 && ((cc_u64)dst & 15) == 0) {
                        *reinterpret_cast<ulonglong2*>(dst) = make_ulonglong2(on0, on1);
                    } else {
                        store_bits_word(dst, on0, n0);
                        if (n1 > 0) store_bits_word(dst + 8, on1, n1);
                    }
                }
            }
        }
        if (b0 + BITS_SLOTS >= nd) break;
        __syncthreads();                   // every row of this batch is made: restage
        stage_seqbits(P, bx, read_len, s_bits, s_slot_seq, b0 + BITS_SLOTS, nd);
    }
}

extern "C" __global__ void __launch_bounds__(CC_STEP_THREADS, BITS_MIN_BLOCKS)
build_step_bits(const cc_step_params* __restrict__ P, cc_i64 pad_to, cc_i64 read_len,
                cc_i64 mask_gx, cc_i64 mask_blocks, cc_i32 rows_per_block, cc_i64 paged_chunks)
{
    build_blocks<mask_bits_tile, true>(P, pad_to, read_len, mask_gx, mask_blocks,
                                       rows_per_block, paged_chunks);
}
