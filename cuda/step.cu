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
//   apply_step  reads the staging straight from host memory: applies the records to the
//               mirror and writes the small step buffers (cells, positions, read_len, width,
//               ids, indptrs, runs, the padding rows' sink entries).
//   build_step  blocks [0, mask_blocks) write every window's mask rows [0, pad_to) x
//               columns [0, read_len) (bytes or bits), a 32-column word per thread (see
//               mask_tile); the rest fill each run's kv_indices.
#include "abi.h"

// One thread per (record, owner word), then the header's arrays. Records name distinct
// cells and each thread owns one (cell, word), so each (sequence, cell) bit of seqbits is
// flipped by at most one thread, and XOR commutes: unordered atomics give the exact state.
// The staging lies in host memory (every read crosses the bus, ~1-2 us), so the staging
// reads are issued first, side by side: the header, the thread's entry of each per-row
// array for the first block's threads (slot arrays hold max_write entries and pad_to <=
// max_write, so these reads stay inside the slot whatever the step) and, in the loop, the
// first record: one bus round trip for a step of up to CC_APPLY_THREADS rows instead of
// three (records, then the header, then the rows it bounds).
extern "C" __global__ void __launch_bounds__(CC_APPLY_THREADS)
apply_step(const cc_step_params* __restrict__ P, const cc_i64* __restrict__ stage,
           const cc_i64* __restrict__ records, cc_i64 n_records)
{
    const cc_i64 ow = P->owner_words, capacity = P->capacity, mw = P->max_write;
    const bool paged = P->paged != 0;
    const cc_i64 t = (cc_i64)blockIdx.x * blockDim.x + threadIdx.x;
    const cc_i64 stride = (cc_i64)gridDim.x * blockDim.x;
    const cc_i64* s_seq = stage + CC_OFF_SEQ(mw);
    const cc_i64* s_pos = stage + CC_OFF_POS(mw);
    const cc_i64* s_cells = stage + CC_OFF_CELLS(mw);
    const cc_i64* s_qo = stage + CC_OFF_QO(mw);
    const cc_i64* s_kv = stage + CC_OFF_KV(mw);
    const cc_i64* s_rseq = stage + CC_OFF_RUN_SEQ(mw);
    const cc_i64* s_rlast = stage + CC_OFF_RUN_LAST(mw);
    const cc_i64 width = stage[CC_HDR_WIDTH], pad_to = stage[CC_HDR_PAD_TO];
    const cc_i64 sink = stage[CC_HDR_SINK], h_read_len = stage[CC_HDR_READ_LEN];
    const cc_i64 n_runs = stage[CC_HDR_N_RUNS];
    const cc_i64 seq0 = s_seq[0], pos0 = s_pos[0];
    // rows read ahead: block 0's (a decode step's rows all; bounded, since the grid may be
    // sized by many records while pad_to is small)
    const cc_i64 ahead = min(mw, (cc_i64)CC_APPLY_THREADS);
    cc_i64 v_seq = 0, v_pos = 0, v_cell = 0, v_qo = 0, v_kv = 0, v_rseq = 0, v_rlast = 0;
    if (t < ahead) {
        v_seq = s_seq[t];
        v_pos = s_pos[t];
        v_cell = s_cells[t];
    }
    if (paged && t <= ahead) {       // qo/kv hold max_write + 1 entries
        v_qo = s_qo[t];
        v_kv = s_kv[t];
    }
    if (paged && t < ahead) {
        v_rseq = s_rseq[t];
        v_rlast = s_rlast[t];
    }
    cc_i32* pos = (cc_i32*)P->pos;
    cc_u64* owners = (cc_u64*)P->owners;
    unsigned long long* seqbits = (unsigned long long*)P->seqbits;
    for (cc_i64 k = t; k < n_records * ow; k += stride) {
        cc_i64 i = k / ow, w = k % ow;
        const cc_i64* rec = records + i * (2 + ow);
        cc_i64 c = rec[0];
        if (w == 0) pos[c] = (cc_i32)rec[1];
        cc_u64 now = (cc_u64)rec[2 + w];
        cc_u64 diff = owners[w * capacity + c] ^ now;
        owners[w * capacity + c] = now;
        unsigned long long cell_bit = 1ull << (c & 63);
        while (diff) {
            int b = __ffsll((long long)diff) - 1;
            diff &= diff - 1;
            atomicXor(seqbits + (64 * w + b) * P->bit_words + (c >> 6), cell_bit);
        }
    }
    // the engine's grid covers max(records x words, pad_to + 1) threads, so each loop below
    // runs its first iteration (i == t, on the values read above) and no other; the loads
    // in the loops are for a shorter grid only
    cc_i64* cells = (cc_i64*)P->cells;
    cc_i64* positions = (cc_i64*)P->positions;
    cc_i64* seq_ids = (cc_i64*)P->seq_ids;
    for (cc_i64 i = t; i < pad_to; i += stride) {
        const bool real = i < width, mine = i == t && t < ahead;
        cells[i] = real ? (mine ? v_cell : s_cells[i]) : sink;
        positions[i] = real ? (mine ? v_pos : s_pos[i]) : pos0;
        seq_ids[i] = real ? (mine ? v_seq : s_seq[i]) : seq0;
    }
    if (paged) {
        cc_i32* qo = (cc_i32*)P->qo_indptr;
        cc_i32* kv = (cc_i32*)P->kv_indptr;
        cc_i32* kv_indices = (cc_i32*)P->kv_indices;
        for (cc_i64 i = t; i <= pad_to; i += stride) {
            const bool mine = i == t && t <= ahead, mine_run = i == t && t < ahead;
            const cc_i64 e_kv = mine ? v_kv : s_kv[i];
            qo[i] = (cc_i32)(mine ? v_qo : s_qo[i]);
            kv[i] = (cc_i32)e_kv;
            if (i < n_runs) {
                ((cc_i64*)P->run_seq)[i] = mine_run ? v_rseq : s_rseq[i];
                ((cc_i64*)P->run_last)[i] = mine_run ? v_rlast : s_rlast[i];
                ((cc_i64*)P->run_kv)[i] = e_kv;
            }
            // padding row j = i - n_runs (a run of one entry): its kv entry is the sink
            if (i >= n_runs && i < n_runs + pad_to - width) kv_indices[e_kv] = (cc_i32)sink;
        }
    }
    if (t == 0) {
        *(cc_i64*)P->read_len = h_read_len;
        *(cc_i64*)P->width = width;
    }
}

// Mask rows [r0, r1) x this block's tile of CC_STEP_THREADS * CC_MASK_COLS columns (2048 =
// 64 32-column words = 16 groups of 4 words). The block reads the tile's positions once
// (16-byte loads) and classifies each word: consecutive positions p0, p0 + 1, ..., p0 + 31,
// or not; and per row its sequence's seqbits offset and position. Thread t owns group t % 16 (128 columns) and rows
// r0 + t / 16, + 8, + 16, ...: per row one 16-byte read of the sequence's seqbits (a row's
// reads ROW_BATCH at a time in flight) and per window one 16-byte store of bits (eight of
// bools); a warp stores 2 rows x 256 contiguous bytes of bits. A word's visible columns
// (bit k: the row's sequence owns column k and lo <= pos[k] <= qp) are
//   - none when the sequence owns none of them (most words of most rows): no work;
//   - a bit range when the word is consecutive (cells placed by one sequence's prefill or
//     decode run): [lo - p0, qp - p0], a few integer instructions;
//   - otherwise one unsigned compare per owned column (a bit loop when few are owned).
#define TILE_WORDS (CC_STEP_THREADS * CC_MASK_COLS / 32)    // 32-column words of a block tile
#define GROUP_WORDS 4                                       // words of one thread (16 bytes)
#define TILE_GROUPS (TILE_WORDS / GROUP_WORDS)              // 16
#define ROW_SPLIT (CC_STEP_THREADS / TILE_GROUPS)           // threads sharing a group's rows: 8
#define ROW_BATCH 4                 // seqbits reads a thread has in flight

// Bit k of the result: bit k of own and lo <= p[k] <= lo + span (unsigned compare). wp: the
// word's positions in the mirror (the block read them a moment ago: cache hits); full: all
// 32 lie inside the capacity (else only owned columns, which do, are read).
__device__ __forceinline__ cc_u32 visible_any(const cc_i32* __restrict__ wp, bool full,
                                              cc_u32 own, cc_i32 lo, cc_u32 span)
{
    cc_u32 on = 0;
    if (!full || __popc(own) <= 8) {
        for (cc_u32 m = own; m; m &= m - 1) {
            const int k = __ffs(m) - 1;
            on |= (cc_u32)((cc_u32)__ldg(wp + k) - (cc_u32)lo <= span) << k;
        }
        return on;
    }
#pragma unroll
    for (int q = 0; q < 8; ++q) {
        const int4 v = __ldg(reinterpret_cast<const int4*>(wp) + q);
        on |= (cc_u32)((cc_u32)v.x - (cc_u32)lo <= span) << (4 * q);
        on |= (cc_u32)((cc_u32)v.y - (cc_u32)lo <= span) << (4 * q + 1);
        on |= (cc_u32)((cc_u32)v.z - (cc_u32)lo <= span) << (4 * q + 2);
        on |= (cc_u32)((cc_u32)v.w - (cc_u32)lo <= span) << (4 * q + 3);
    }
    return on & own;
}

// One word's visible bits: own (the row's sequence's bits of the word), p0 (the word's first
// position when its positions are consecutive, else -1), wp/full as for visible_any.
__device__ __forceinline__ cc_u32 word_on(cc_u32 own, cc_i32 p0, const cc_i32* __restrict__ wp,
                                          bool full, cc_i32 qp, cc_i32 lo)
{
    if (!own) return 0u;
    if (p0 >= 0) {
        // column k is at position p0 + k: visible for lo - p0 <= k <= qp - p0
        const long long d = (long long)qp - p0;
        const cc_i32 e = lo - p0;                   // lo, p0 >= 0: no overflow
        const cc_u32 hi = d < 0 ? 0u : (d >= 31 ? 0xFFFFFFFFu : (2u << (int)d) - 1u);
        return own & hi & (e <= 0 ? 0xFFFFFFFFu : (e >= 32 ? 0u : 0xFFFFFFFFu << e));
    }
    return visible_any(wp, full, own, lo, (cc_u32)(qp - lo));
}

__device__ __forceinline__ cc_u32 cols_mask(int n)          // bits [0, n), n clamped to [0, 32]
{
    return n >= 32 ? 0xFFFFFFFFu : (n <= 0 ? 0u : (1u << n) - 1u);
}

// A thread's rows of its group (see mask_tile); BITS: packed bits, else bools. A batch of
// the rows' seqbits reads is issued at once and parked in shared memory (s_own, this
// thread's slots only), then the rows are made one by one (a loop, one copy of the code).
template <bool BITS>
__device__ __forceinline__ void mask_rows(
    const cc_u64* __restrict__ bits64, bool wide_bits, cc_i64 bit_words, cc_i64 w64,
    const cc_i32* __restrict__ wps, int full, int4 p0s, int ncols, cc_i32 r0, cc_i32 nrows,
    cc_i32 split, cc_i32 n_windows, cc_i64 row_pitch, cc_i64 col_off, const cc_i64* s_bits,
    const cc_i32* s_qp, const cc_i64* s_win, const cc_u64* s_dst, uint4* s_own)
{
    const uint4 cm = make_uint4(cols_mask(ncols), cols_mask(ncols - 32), cols_mask(ncols - 64),
                                cols_mask(ncols - 96));
    for (cc_i32 rb = split; rb < nrows; rb += ROW_BATCH * ROW_SPLIT) {
#pragma unroll
        for (int u = 0; u < ROW_BATCH; ++u) {
            const cc_i32 r = rb + u * ROW_SPLIT;
            uint4 o = make_uint4(0u, 0u, 0u, 0u);
            if (r < nrows) {
                const cc_u64* src = bits64 + s_bits[r];
                cc_u64 lo64, hi64;
                if (wide_bits) {
                    const ulonglong2 v = __ldg(reinterpret_cast<const ulonglong2*>(src));
                    lo64 = v.x;
                    hi64 = v.y;
                } else {
                    lo64 = __ldg(src);
                    hi64 = w64 + 1 < bit_words ? __ldg(src + 1) : 0ull;
                }
                o = make_uint4((cc_u32)lo64 & cm.x, (cc_u32)(lo64 >> 32) & cm.y,
                               (cc_u32)hi64 & cm.z, (cc_u32)(hi64 >> 32) & cm.w);
            }
            s_own[u * CC_STEP_THREADS + threadIdx.x] = o;
        }
        const int n = min(ROW_BATCH, (nrows - rb + ROW_SPLIT - 1) / ROW_SPLIT);
#pragma unroll 1
        for (int u = 0; u < n; ++u) {
            const cc_i32 r = rb + u * ROW_SPLIT;
            const uint4 o = s_own[u * CC_STEP_THREADS + threadIdx.x];
            const bool any = (o.x | o.y | o.z | o.w) != 0u;
            const cc_i64 row_off = (cc_i64)(r0 + r) * row_pitch + col_off;
            for (cc_i32 wi = 0; wi < n_windows; ++wi) {
                uint4 on = make_uint4(0u, 0u, 0u, 0u);
                if (any) {
                    const cc_i32 qp = s_qp[r];
                    const cc_i64 win = s_win[wi];
                    // visible positions are [lo, qp]; owned cells are occupied (pos >= 0)
                    const cc_i32 lo = (win == 0 || qp - win + 1 < 0) ? 0 : (cc_i32)(qp - win + 1);
                    on.x = word_on(o.x, p0s.x, wps, full > 0, qp, lo);
                    on.y = word_on(o.y, p0s.y, wps + 32, full > 1, qp, lo);
                    on.z = word_on(o.z, p0s.z, wps + 64, full > 2, qp, lo);
                    on.w = word_on(o.w, p0s.w, wps + 96, full > 3, qp, lo);
                }
                cc_u8* dst = (cc_u8*)s_dst[wi] + row_off;
                const cc_u64 addr = (cc_u64)dst;
                if (BITS) {
                    if (ncols == 128 && (addr & 15) == 0) {
                        *reinterpret_cast<uint4*>(dst) = on;
                    } else if (ncols == 128 && (addr & 3) == 0) {
                        reinterpret_cast<cc_u32*>(dst)[0] = on.x;
                        reinterpret_cast<cc_u32*>(dst)[1] = on.y;
                        reinterpret_cast<cc_u32*>(dst)[2] = on.z;
                        reinterpret_cast<cc_u32*>(dst)[3] = on.w;
                    } else {
                        for (int b = 0; b < (ncols + 7) >> 3; ++b) {
                            const int q = b >> 2;
                            const cc_u32 wv = q == 0 ? on.x : (q == 1 ? on.y : (q == 2 ? on.z : on.w));
                            dst[b] = (cc_u8)(wv >> (8 * (b & 3)));
                        }
                    }
                } else {
                    const cc_u32 v4[4] = {on.x, on.y, on.z, on.w};
#pragma unroll
                    for (int g = 0; g < GROUP_WORDS; ++g) {
                        const int nw = min(32, ncols - 32 * g);
                        if (nw <= 0) break;
                        const cc_u32 wv = v4[g];
                        cc_u8* d = dst + 32 * g;
                        cc_u32 w[8];                      // byte k of the 32 = bit k of wv
#pragma unroll
                        for (int q = 0; q < 8; ++q) {
                            // bits 0..3 of the nibble to bits 0, 8, 16, 24 (the shifted
                            // copies 0, 7, 14, 21 do not overlap: no carries)
                            w[q] = (((wv >> (4 * q)) & 0xFu) * 0x00204081u) & 0x01010101u;
                        }
                        if (nw == 32 && (addr & 15) == 0) {
                            reinterpret_cast<uint4*>(d)[0] = make_uint4(w[0], w[1], w[2], w[3]);
                            reinterpret_cast<uint4*>(d)[1] = make_uint4(w[4], w[5], w[6], w[7]);
                        } else if (nw == 32 && (addr & 3) == 0) {
#pragma unroll
                            for (int q = 0; q < 8; ++q) reinterpret_cast<cc_u32*>(d)[q] = w[q];
                        } else {
                            for (int k = 0; k < nw; ++k) d[k] = (cc_u8)((wv >> k) & 1u);
                        }
                    }
                }
            }
        }
    }
}

__device__ __forceinline__ void mask_tile(const cc_step_params* __restrict__ P, cc_i64 bx,
                                          cc_i32 r0, cc_i32 r1, cc_i64 read_len)
{
    __shared__ __align__(16) cc_i32 s_p0[TILE_WORDS];         // first position, or -1
    __shared__ __align__(16) uint4 s_own[ROW_BATCH * CC_STEP_THREADS];
    __shared__ cc_i64 s_bits[CC_MASK_MAX_ROWS];               // row's seqbits row (u64 words)
    __shared__ cc_i32 s_qp[CC_MASK_MAX_ROWS];
    __shared__ cc_i64 s_win[CC_MAX_WINDOWS];
    __shared__ cc_u64 s_dst[CC_MAX_WINDOWS];
    const cc_i64 capacity = P->capacity, bit_words = P->bit_words;
    const cc_i32 nrows = r1 - r0;
    const cc_i32 n_windows = (cc_i32)P->n_windows;
    const cc_i64 tile0 = bx * (TILE_WORDS * 32);
    const cc_i32* pos = (const cc_i32*)P->pos;
    const cc_i64* ids = (const cc_i64*)P->seq_ids;
    const cc_i64* qpos = (const cc_i64*)P->positions;
    // The tile's positions, once: thread j of a pass loads columns 4j .. 4j + 3 (word j / 8);
    // the 8 lanes of a word (lanes 8m .. 8m + 7 of a warp: 128 threads, 512 loads, every
    // lane in every pass) check their 4 against the word's first position.
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int pass = 0; pass < TILE_WORDS * 8 / CC_STEP_THREADS; ++pass) {
        const int j = pass * CC_STEP_THREADS + threadIdx.x;
        const cc_i64 c = tile0 + 4 * j;
        int4 v;
        if (c + 4 <= capacity) {
            v = __ldg(reinterpret_cast<const int4*>(pos + c));
        } else {
            v.x = c < capacity ? pos[c] : -1;
            v.y = c + 1 < capacity ? pos[c + 1] : -1;
            v.z = c + 2 < capacity ? pos[c + 2] : -1;
            v.w = -1;
        }
        const cc_u32 x = (cc_u32)v.x, base = x - 4u * (cc_u32)(j & 7);
        const cc_u32 base0 = __shfl_sync(0xFFFFFFFFu, base, lane & ~7);
        const bool ok = (cc_u32)v.y == x + 1u && (cc_u32)v.z == x + 2u && (cc_u32)v.w == x + 3u
                        && base == base0;
        const cc_u32 all = __ballot_sync(0xFFFFFFFFu, ok) >> (lane & ~7);
        if ((lane & 7) == 0)
            s_p0[j >> 3] = ((all & 0xFFu) == 0xFFu && base0 <= 0x7FFFFFFFu - 31u) ? (cc_i32)base0 : -1;
    }
    for (cc_i32 r = threadIdx.x; r < nrows; r += blockDim.x) {
        s_bits[r] = ids[r0 + r] * bit_words;
        s_qp[r] = (cc_i32)qpos[r0 + r];
    }
    if (threadIdx.x < n_windows) {
        s_win[threadIdx.x] = P->windows[threadIdx.x];
        s_dst[threadIdx.x] = P->masks[threadIdx.x];
    }
    __syncthreads();

    const cc_i32 group = threadIdx.x % TILE_GROUPS, split = threadIdx.x / TILE_GROUPS;
    const cc_i64 col0 = tile0 + 32 * GROUP_WORDS * group;
    if (col0 >= read_len) return;
    const int ncols = (int)min((cc_i64)(32 * GROUP_WORDS), read_len - col0);
    const int4 p0s = *reinterpret_cast<const int4*>(s_p0 + GROUP_WORDS * group);
    const cc_i32* wps = pos + col0;
    // words of the group whose 32 positions all lie inside the capacity
    const int full = (int)min((cc_i64)GROUP_WORDS, (capacity - col0) >> 5);
    // the group's two seqbits words: one 16-byte read where every row's pair is aligned and
    // inside the row
    const cc_i64 w64 = col0 >> 6;
    const bool wide_bits = (bit_words & 1) == 0 && w64 + 2 <= bit_words;
    const cc_u64* bits64 = (const cc_u64*)P->seqbits + w64;
    if (P->mask_format == CC_MASKS_BITS)
        mask_rows<true>(bits64, wide_bits, bit_words, w64, wps, full, p0s, ncols, r0, nrows,
                        split, n_windows, P->mask_row_bytes, col0 >> 3, s_bits, s_qp, s_win,
                        s_dst, s_own);
    else
        mask_rows<false>(bits64, wide_bits, bit_words, w64, wps, full, p0s, ncols, r0, nrows,
                         split, n_windows, capacity, col0, s_bits, s_qp, s_win, s_dst, s_own);
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

extern "C" __global__ void __launch_bounds__(CC_STEP_THREADS, 8)
build_step(const cc_step_params* __restrict__ P, cc_i64 pad_to, cc_i64 read_len,
           cc_i64 mask_gx, cc_i64 mask_blocks, cc_i32 rows_per_block, cc_i64 paged_chunks)
{
    const cc_i64 b = blockIdx.x;
    if (b < mask_blocks) {
        const cc_i64 bx = b % mask_gx, by = b / mask_gx;
        const cc_i32 r0 = (cc_i32)(by * rows_per_block);
        const cc_i32 r1 = (cc_i32)min(pad_to, (cc_i64)r0 + rows_per_block);
        mask_tile(P, bx, r0, r1, read_len);
    } else {
        const cc_i64 pb = b - mask_blocks;
        paged_chunk(P, pb / paged_chunks, pb % paged_chunks, read_len);
    }
}
