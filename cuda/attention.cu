// Attention over the cache's buffers. No host code and no CUDA headers (NVRTC builds it).
//
// store_kv_T       write the step's K and V rows into a layer's pools at cells[:rows]
//                  (padding rows' cells name the sink row).
// attend_T         dense: one block per (query row, head) over pool rows [0, read_len)
//                  under the layer's bool mask row; float32 q/out. The clear reference
//                  kernel of the demo.
// paged_decode_T_gN    one block per (query row, kv head, split) over a tile-aligned chunk of
//                  the row's kv list (flash-decoding). K/V tiles come through a ring of
//                  cp.async stages in shared memory, the next tile's kv_indices loaded a
//                  tile ahead of its data; thread (tx, ty, tz) holds dims [8tx, 8tx + 8) of
//                  N query heads (ty's) for the rows tz, tz + bdz, ... of each tile. Split
//                  results are merged by paged_merge_T (or written directly with one split).
// prefill_plan     the prefill work list on the device: tiles of qt queries of one run
//                  from qo_indptr and width, by a prefix sum, into a list of n_rows + 1
//                  entries ({count, q0...}); no host sync, so a mixed step can be captured.
// paged_prefill_T  CTA (x, kv head) takes tiles x, x + gridDim.x, ... of the list (CTAs past
//                  the count exit): K/V tiles of the run's list staged once (cp.async, double
//                  buffered) for every (query, head) pair of the tile; then zeros padding rows.
// Every kernel takes any head_dim that is a multiple of 8 up to 256, any q/out element
// strides (q and out are read and written element by element: they are small beside K/V),
// and copies K/V rows in units of `cb` bytes (16, 8, 4 or 2: the host picks the widest the
// pool addresses and row strides allow). Shared-memory reads are of our own aligned layout.
// The paged kernels read qo_indptr/kv_indptr/kv_indices and `width` from the device, so a
// captured graph serves every step; query i of a run of qo_len queries over a list of L
// entries sees entries [i_last - window + 1, i_last], i_last = L - qo_len + i (causal,
// aligned to the end), and padding rows (i >= width) produce zeros without reading the pools.
// Softmax runs in base 2: q is pre-scaled by scale * log2(e), and split states carry log2
// maxima.
#include "abi.h"
#include "dtypes.h"

#define THREADS CC_ATTN_THREADS
#define INFINITY __int_as_float(0x7f800000)
#define MAX_HEAD_DIM 256
#define LOG2E 1.4426950408889634f


__device__ __forceinline__ float ex2(float x) {
    float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;
}

// -- store and the dense reference kernel ------------------------------------------------------

template <typename T>
__device__ void store_kv(const cc_i64* __restrict__ cells, cc_i32 rows,
                         const T* __restrict__ k_in, const T* __restrict__ v_in,
                         cc_i64 s_tok, cc_i64 s_head, T* __restrict__ k_pool,
                         T* __restrict__ v_pool, cc_i32 n_kv_heads, cc_i32 head_dim)
{
    const cc_i32 row = blockIdx.y;
    if (row >= rows) return;
    const cc_i64 c = cells[row];
    const cc_i32 row_elems = n_kv_heads * head_dim;
    for (cc_i32 e = blockIdx.x * blockDim.x + threadIdx.x; e < row_elems; e += gridDim.x * blockDim.x) {
        const cc_i32 h = e / head_dim, d = e % head_dim;
        const cc_i64 src = row * s_tok + h * s_head + d;
        k_pool[c * row_elems + e] = k_in[src];
        v_pool[c * row_elems + e] = v_in[src];
    }
}

__device__ __forceinline__ float block_reduce(float x, float* scratch, bool is_max)
{
    scratch[threadIdx.x] = x;
    __syncthreads();
    for (int s = THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float o = scratch[threadIdx.x + s];
            scratch[threadIdx.x] = is_max ? fmaxf(scratch[threadIdx.x], o) : scratch[threadIdx.x] + o;
        }
        __syncthreads();
    }
    float r = scratch[0];
    __syncthreads();
    return r;
}

template <typename T>
__device__ void attend(const cc_i64* __restrict__ read_len_p, const float* __restrict__ q,
                       const T* __restrict__ k_pool, const T* __restrict__ v_pool,
                       const cc_u8* __restrict__ mask, cc_i64 capacity, cc_i32 n_heads,
                       cc_i32 n_kv_heads, cc_i32 head_dim, float* __restrict__ out)
{
    __shared__ float s_q[MAX_HEAD_DIM];
    __shared__ float s_acc[MAX_HEAD_DIM];
    __shared__ float scratch[THREADS];
    const cc_i32 i = blockIdx.x, h = blockIdx.y;
    const cc_i32 kvh = h / (n_heads / n_kv_heads);
    const cc_i64 read_len = *read_len_p;
    const cc_u8* mrow = mask + (cc_i64)i * capacity;
    const float scale = rsqrtf((float)head_dim);
    for (int d = threadIdx.x; d < head_dim; d += THREADS) {
        s_q[d] = q[((cc_i64)i * n_heads + h) * head_dim + d];
        s_acc[d] = 0.f;
    }
    __syncthreads();
    float m = -INFINITY;
    for (cc_i64 j = threadIdx.x; j < read_len; j += THREADS) {
        if (!mrow[j]) continue;
        const T* k = k_pool + (j * n_kv_heads + kvh) * head_dim;
        float s = 0.f;
        for (int d = 0; d < head_dim; ++d) s += s_q[d] * to_f(k[d]);
        m = fmaxf(m, s * scale);
    }
    m = block_reduce(m, scratch, true);
    float l = 0.f;
    for (cc_i64 j = threadIdx.x; j < read_len; j += THREADS) {
        if (!mrow[j]) continue;
        const T* k = k_pool + (j * n_kv_heads + kvh) * head_dim;
        const T* v = v_pool + (j * n_kv_heads + kvh) * head_dim;
        float s = 0.f;
        for (int d = 0; d < head_dim; ++d) s += s_q[d] * to_f(k[d]);
        const float w = __expf(s * scale - m);
        l += w;
        for (int d = 0; d < head_dim; ++d) atomicAdd(&s_acc[d], w * to_f(v[d]));
    }
    l = block_reduce(l, scratch, false);
    for (int d = threadIdx.x; d < head_dim; d += THREADS)
        out[((cc_i64)i * n_heads + h) * head_dim + d] = s_acc[d] / l;
}

// -- the paged kernels -----------------------------------------------------------------------

typedef cc_paged_args PagedArgs;

#define DECODE_STAGES 3            // cp.async stages of the decode ring
#define PREFILL_STAGES 2           // and of the prefill kernel's

// The request that query row i belongs to: qo_indptr[r] <= i < qo_indptr[r + 1].
__device__ __forceinline__ cc_i32 find_run(const cc_i32* __restrict__ qo, cc_i32 n_rows, cc_i32 i)
{
    cc_i32 lo = 0, hi = n_rows;          // qo[lo] <= i < qo[hi]
    while (hi - lo > 1) {
        const cc_i32 mid = (lo + hi) >> 1;
        if (qo[mid] <= i) lo = mid; else hi = mid;
    }
    return lo;
}

// Query row i's run, where its run's list starts, and its visible entries [lo, hi].
__device__ __forceinline__ void visible_range(const PagedArgs& a, cc_i32 i, cc_i32* run,
                                              cc_i64* base, cc_i64* lo, cc_i64* hi)
{
    const cc_i32 r = find_run(a.qo_indptr, a.n_rows, i);
    const cc_i64 q0 = a.qo_indptr[r], q1 = a.qo_indptr[r + 1];
    const cc_i64 k0 = a.kv_indptr[r], k1 = a.kv_indptr[r + 1];
    const cc_i64 last = (k1 - k0) - (q1 - q0) + (i - q0);
    *run = r;
    *base = k0;
    *hi = last;
    *lo = a.window > 0 ? (last - a.window + 1 > 0 ? last - a.window + 1 : 0) : 0;
}

// Eight consecutive elements of shared memory as floats (p 16-byte aligned).
__device__ __forceinline__ void load8(const float* p, float* f)
{
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
__device__ __forceinline__ void unpack2(cc_u32 w, bf16, float* f)
{
    f[0] = __uint_as_float(w << 16); f[1] = __uint_as_float(w & 0xFFFF0000u);
}
__device__ __forceinline__ void unpack2(cc_u32 w, f16, float* f)
{
    f16 lo, hi;
    lo.x = (unsigned short)(w & 0xFFFFu); hi.x = (unsigned short)(w >> 16);
    f[0] = to_f(lo); f[1] = to_f(hi);
}
template <typename H>
__device__ __forceinline__ void load8(const H* p, float* f)
{
    const uint4 r = *reinterpret_cast<const uint4*>(p);
    unpack2(r.x, H(), f); unpack2(r.y, H(), f + 2); unpack2(r.z, H(), f + 4); unpack2(r.w, H(), f + 6);
}
// Four consecutive elements (p aligned to four elements).
__device__ __forceinline__ void load4(const float* p, float* f)
{
    const float4 a = *reinterpret_cast<const float4*>(p);
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
}
template <typename H>
__device__ __forceinline__ void load4(const H* p, float* f)
{
    const uint2 r = *reinterpret_cast<const uint2*>(p);
    unpack2(r.x, H(), f); unpack2(r.y, H(), f + 2);
}

// -- cp.async: K/V rows gathered into a ring of shared-memory stages --------------------------

__device__ __forceinline__ cc_u32 smem_u32(const void* p)
{
    cc_u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// `cb` bytes (16, 8 or 4: cp.async; 2: through a register) from global to shared memory.
__device__ __forceinline__ void copy_unit(void* dst, const void* src, cc_i32 cb)
{
    const cc_u32 d = smem_u32(dst);
    if (cb == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d), "l"(src) : "memory");
    else if (cb == 8)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" :: "r"(d), "l"(src) : "memory");
    else if (cb == 4)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(d), "l"(src) : "memory");
    else
        *reinterpret_cast<unsigned short*>(dst) = *reinterpret_cast<const unsigned short*>(src);
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

// S stages of `tile` K rows then `tile` V rows (`pitch` bytes apart) of one kv head, for
// list entries [e0, e1) of idx (tile t = entries e0 + t * tile ...), and the cells of each
// staged tile (s_idx[S][tile]). Use:
//     ring.start();                       // tiles 0 .. S-2 in flight, S-1's indices loading
//     for t < n_tiles: ring.next(t); ...read tile t at ring.k(t), ring.v(t)...
//     ring.finish();
// next(t) stores the indices of tile t + S - 1 (loaded in registers during tile t - 1, a tile
// ahead of their data), issues that tile's copies, starts loading tile t + S's indices, and
// waits for tile t. Every thread of the block calls every method (they hold barriers).
template <int S>
struct KvRing {
    unsigned char* smem;
    cc_i32* s_idx;
    const unsigned char* k_pool;
    const unsigned char* v_pool;
    const cc_i32* idx;
    cc_i64 row_bytes, head_off, e0, e1;
    cc_i32 tile, pitch, rb, cb, n_tiles, nidx;

    __device__ __forceinline__ unsigned char* k(cc_i32 t) const
    { return smem + (cc_i64)(t % S) * 2 * tile * pitch; }
    __device__ __forceinline__ unsigned char* v(cc_i32 t) const { return k(t) + tile * pitch; }
    __device__ __forceinline__ cc_i32 rows(cc_i32 t) const
    { return (cc_i32)min((cc_i64)tile, e1 - e0 - (cc_i64)t * tile); }
    __device__ __forceinline__ cc_i32 load_idx(cc_i32 t) const
    {
        const cc_i64 e = e0 + (cc_i64)t * tile + threadIdx.x;
        return (t < n_tiles && (cc_i32)threadIdx.x < tile && e < e1) ? idx[e] : 0;
    }
    __device__ __forceinline__ void issue(cc_i32 t)
    {
        if (t < n_tiles) {
            const cc_i32 n = rows(t), per_row = rb / cb;
            const cc_i32* ix = s_idx + (t % S) * tile;
            unsigned char* dk = k(t);
            unsigned char* dv = dk + tile * pitch;
            for (cc_i32 c = threadIdx.x; c < n * per_row; c += THREADS) {
                const cc_i32 r = c / per_row, o = (c - r * per_row) * cb;
                const cc_i64 off = (cc_i64)ix[r] * row_bytes + head_off + o;
                copy_unit(dk + r * pitch + o, k_pool + off, cb);
                copy_unit(dv + r * pitch + o, v_pool + off, cb);
            }
        }
        cp_commit();                      // empty groups too: the wait counts stay uniform
    }
    __device__ __forceinline__ void start()
    {
#pragma unroll
        for (int s = 0; s < S - 1; ++s) {
            const cc_i32 x = load_idx(s);
            if ((cc_i32)threadIdx.x < tile) s_idx[s * tile + threadIdx.x] = x;
        }
        __syncthreads();
#pragma unroll
        for (int s = 0; s < S - 1; ++s) issue(s);
        nidx = load_idx(S - 1);
    }
    __device__ __forceinline__ void next(cc_i32 t)
    {
        // the slot and stage of tile t + S - 1 last served tile t - 1: free after the barrier
        if ((cc_i32)threadIdx.x < tile) s_idx[((t + S - 1) % S) * tile + threadIdx.x] = nidx;
        __syncthreads();
        issue(t + S - 1);
        nidx = load_idx(t + S);
        cp_wait<S - 1>();
        __syncthreads();
    }
    __device__ __forceinline__ void finish()
    {
        cp_wait<0>();
        __syncthreads();
    }
};

// Row pitch of a staged K/V row: the row's bytes rounded up to 16 (decode: lanes read
// consecutive 16-byte pieces of one row) or to an odd multiple of 16 (prefill: lanes read
// the same piece of consecutive rows, which then fall in distinct banks).
__device__ __forceinline__ cc_i32 stage_pitch(cc_i32 rb, bool odd)
{
    cc_i32 p = (rb + 15) / 16;
    if (odd && (p & 1) == 0) p += 1;
    return p * 16;
}

// -- decode -------------------------------------------------------------------------------------

// One block per (query row, kv head, split). Thread (tx, ty, tz) = threadIdx.x split as
// (bdx, bdy, bdz), bdx * bdy * bdz = THREADS: dims [8 tx, 8 tx + 8) (lanes past head_dim
// idle), query heads ty * GPT ... of the group, rows tz, tz + bdz, ... of each K/V tile.
// Split `split` of n_splits takes entries [lo + split * per, ...) of the row's visible range,
// per = ceil(n / n_splits) rounded up to whole tiles. Results go to out (one split) or to
// part[(row, head, split)] = {m (log2), l, acc[head_dim]} for paged_merge.
template <typename T, int GPT>
__device__ void paged_decode(const PagedArgs a, cc_i32 bdx, cc_i32 bdy, cc_i32 tile, cc_i32 cb,
                             const T* __restrict__ q, const T* __restrict__ k_pool,
                             const T* __restrict__ v_pool, float* __restrict__ part,
                             T* __restrict__ out)
{
    extern __shared__ __align__(16) unsigned char smem[];
    const cc_i32 i = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, n_splits = gridDim.z;
    const cc_i32 G = a.n_heads / a.n_kv_heads, D = a.head_dim;
    const cc_i32 bdz = THREADS / (bdx * bdy);
    const cc_i32 tx = threadIdx.x % bdx, ty = (threadIdx.x / bdx) % bdy, tz = threadIdx.x / (bdx * bdy);
    const cc_i32 d0 = tx * 8;
    const bool dim_ok = d0 < D;
    if (i >= *a.width) {                                     // padding: zeros, no pool reads
        float* my_part = part + (((cc_i64)i * a.n_heads + kvh * G) * n_splits + split) * (D + 2);
        if (n_splits == 1)
            for (cc_i32 e = threadIdx.x; e < G * D; e += blockDim.x)
                out[i * a.o_s_tok + (kvh * G + e / D) * a.o_s_head + e % D] = from_f<T>(0.f);
        else
            for (cc_i32 e = threadIdx.x; e < G * (D + 2); e += blockDim.x)
                my_part[(cc_i64)(e / (D + 2)) * n_splits * (D + 2) + e % (D + 2)] =
                    e % (D + 2) == 0 ? -INFINITY : 0.f;
        return;
    }
    cc_i32 run; cc_i64 base, lo, hi;
    visible_range(a, i, &run, &base, &lo, &hi);
    const cc_i64 n = hi - lo + 1;
    cc_i64 per = n > 0 ? (n + n_splits - 1) / n_splits : 0;
    per = (per + tile - 1) / tile * tile;
    const cc_i64 s0 = lo + split * per, s1 = min(hi + 1, s0 + per);

    float qf[GPT][8], acc[GPT][8], m[GPT], l[GPT];
    const float qscale = a.scale * LOG2E;
#pragma unroll
    for (int g = 0; g < GPT; ++g) {
        m[g] = -INFINITY; l[g] = 0.f;
        const cc_i32 hh = ty * GPT + g;
        const T* qrow = q + i * a.q_s_tok + (kvh * G + hh) * a.q_s_head;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            acc[g][k] = 0.f;
            qf[g][k] = (hh < G && dim_ok) ? to_f(qrow[d0 + k]) * qscale : 0.f;
        }
    }

    KvRing<DECODE_STAGES> ring;
    const cc_i32 pitch = stage_pitch(D * (cc_i32)sizeof(T), false);
    ring.smem = smem;
    ring.s_idx = reinterpret_cast<cc_i32*>(smem + (cc_i64)DECODE_STAGES * 2 * tile * pitch);
    ring.k_pool = reinterpret_cast<const unsigned char*>(k_pool);
    ring.v_pool = reinterpret_cast<const unsigned char*>(v_pool);
    ring.idx = a.kv_indices + base;
    ring.row_bytes = (cc_i64)a.n_kv_heads * D * sizeof(T);
    ring.head_off = (cc_i64)kvh * D * sizeof(T);
    ring.e0 = s0; ring.e1 = s1;
    ring.tile = tile; ring.pitch = pitch; ring.rb = D * (cc_i32)sizeof(T); ring.cb = cb;
    ring.n_tiles = s1 > s0 ? (cc_i32)((s1 - s0 + tile - 1) / tile) : 0;
    const cc_i32 pe = pitch / (cc_i32)sizeof(T);             // elements between staged rows
    const cc_i32 rpt = tile / bdz;                           // rows per thread per tile
    ring.start();
    for (cc_i32 t = 0; t < ring.n_tiles; ++t) {
        ring.next(t);
        const cc_i32 nk = ring.rows(t);
        const T* sk = reinterpret_cast<const T*>(ring.k(t));
        const T* sv = reinterpret_cast<const T*>(ring.v(t));
        for (cc_i32 u0 = 0; u0 < rpt; u0 += 4) {             // four rows per softmax update
            float s[4][GPT];
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                if (u0 + c >= rpt) break;                    // uniform: shuffles stay full
                const cc_i32 j = tz + bdz * (u0 + c);
                const bool ok = j < nk;
                float kf[8];
                if (ok && dim_ok) load8(sk + j * pe + d0, kf);
                else {
#pragma unroll
                    for (int k = 0; k < 8; ++k) kf[k] = 0.f;
                }
#pragma unroll
                for (int g = 0; g < GPT; ++g) {
                    float x = 0.f;
#pragma unroll
                    for (int k = 0; k < 8; ++k) x += qf[g][k] * kf[k];
                    for (cc_i32 off = bdx >> 1; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
                    s[c][g] = ok ? x : -INFINITY;
                }
            }
#pragma unroll
            for (int g = 0; g < GPT; ++g) {
                float mx = m[g];
#pragma unroll
                for (int c = 0; c < 4; ++c) if (u0 + c < rpt) mx = fmaxf(mx, s[c][g]);
                if (mx == -INFINITY) continue;                // nothing visible yet
                const float corr = ex2(m[g] - mx);          // m = -inf: 0
                m[g] = mx;
                l[g] *= corr;
#pragma unroll
                for (int k = 0; k < 8; ++k) acc[g][k] *= corr;
            }
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                if (u0 + c >= rpt) break;
                const cc_i32 j = tz + bdz * (u0 + c);
                if (j >= nk) continue;
                float vf[8];
                if (dim_ok) load8(sv + j * pe + d0, vf);
                else {
#pragma unroll
                    for (int k = 0; k < 8; ++k) vf[k] = 0.f;
                }
#pragma unroll
                for (int g = 0; g < GPT; ++g) {
                    const float p = ex2(s[c][g] - m[g]);       // m finite: j is a visible entry
                    l[g] += p;
#pragma unroll
                    for (int k = 0; k < 8; ++k) acc[g][k] += p * vf[k];
                }
            }
        }
    }
    ring.finish();

    // the bdz row slots' states merge through shared memory (the ring is free now)
    const cc_i32 HH = bdy * GPT, DD = bdx * 8;
    float* s_acc = reinterpret_cast<float*>(smem);           // [bdz][HH][DD]
    float* s_ml = s_acc + bdz * HH * DD;                     // [bdz][HH][2]
#pragma unroll
    for (int g = 0; g < GPT; ++g) {
        const cc_i32 hh = ty * GPT + g;
#pragma unroll
        for (int k = 0; k < 8; ++k) s_acc[(tz * HH + hh) * DD + d0 + k] = acc[g][k];
        if (tx == 0) { s_ml[(tz * HH + hh) * 2] = m[g]; s_ml[(tz * HH + hh) * 2 + 1] = l[g]; }
    }
    __syncthreads();
    for (cc_i32 e = threadIdx.x; e < G * D; e += blockDim.x) {
        const cc_i32 hh = e / D, d = e % D;
        float mx = -INFINITY;
        for (cc_i32 z = 0; z < bdz; ++z) mx = fmaxf(mx, s_ml[(z * HH + hh) * 2]);
        float num = 0.f, den = 0.f;
        if (mx != -INFINITY)
            for (cc_i32 z = 0; z < bdz; ++z) {
                const float w = ex2(s_ml[(z * HH + hh) * 2] - mx);
                num += w * s_acc[(z * HH + hh) * DD + d];
                den += w * s_ml[(z * HH + hh) * 2 + 1];
            }
        const cc_i32 h = kvh * G + hh;
        if (n_splits == 1) {
            out[i * a.o_s_tok + h * a.o_s_head + d] = from_f<T>(den > 0.f ? num / den : 0.f);
        } else {
            float* pp = part + (((cc_i64)i * a.n_heads + h) * n_splits + split) * (D + 2);
            pp[2 + d] = num;
            if (d == 0) { pp[0] = mx; pp[1] = den; }
        }
    }
}

// Merges the splits of one (query row, head).
template <typename T>
__device__ void paged_merge(const PagedArgs a, cc_i32 n_splits, const float* __restrict__ part,
                            T* __restrict__ out)
{
    const cc_i32 i = blockIdx.x, h = blockIdx.y, D = a.head_dim;
    const float* pp = part + ((cc_i64)i * a.n_heads + h) * n_splits * (D + 2);
    float mx = -INFINITY;
    for (cc_i32 s = 0; s < n_splits; ++s) mx = fmaxf(mx, pp[s * (D + 2)]);
    for (cc_i32 d = threadIdx.x; d < D; d += blockDim.x) {
        float num = 0.f, den = 0.f;
        if (mx != -INFINITY)
            for (cc_i32 s = 0; s < n_splits; ++s) {
                const float* ps = pp + s * (D + 2);
                const float w = ex2(ps[0] - mx);            // ps[0] = -inf: 0
                num += w * ps[2 + d];
                den += w * ps[1];
            }
        out[i * a.o_s_tok + h * a.o_s_head + d] = from_f<T>(den > 0.f ? num / den : 0.f);
    }
}

// -- prefill --------------------------------------------------------------------------------------

#define PLAN_THREADS 1024

// The prefill work list: tiles[0] = number of tiles, tiles[1 + k] = first query row of tile
// k; a tile is up to qt consecutive real rows (< width) of one run. At most n_rows tiles
// (each holds a real row), so the list has n_rows + 1 entries. One block.
extern "C" __global__ void __launch_bounds__(PLAN_THREADS)
prefill_plan(const PagedArgs a, cc_i32 qt, cc_i32* __restrict__ tiles)
{
    __shared__ cc_i32 s_warp[PLAN_THREADS / 32];
    const cc_i32 n = a.n_rows;
    const cc_i32 width = (cc_i32)min((cc_i64)n, *a.width);
    const cc_i32 per = (n + PLAN_THREADS - 1) / PLAN_THREADS;
    const cc_i32 r0 = min(n, (cc_i32)threadIdx.x * per), r1 = min(n, r0 + per);
    cc_i32 count = 0;
    for (cc_i32 r = r0; r < r1; ++r) {
        const cc_i32 q0 = a.qo_indptr[r], q1 = min(a.qo_indptr[r + 1], width);
        if (q1 > q0) count += (q1 - q0 + qt - 1) / qt;
    }
    // inclusive prefix sum over the block: within warps, then over the warps' totals
    const cc_i32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    cc_i32 incl = count;
    for (cc_i32 off = 1; off < 32; off <<= 1) {
        const cc_i32 y = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += y;
    }
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        cc_i32 w = s_warp[lane];
        for (cc_i32 off = 1; off < 32; off <<= 1) {
            const cc_i32 y = __shfl_up_sync(0xffffffffu, w, off);
            if (lane >= off) w += y;
        }
        s_warp[lane] = w;
    }
    __syncthreads();
    if (warp > 0) incl += s_warp[warp - 1];
    cc_i32 k = incl - count;
    for (cc_i32 r = r0; r < r1; ++r) {
        const cc_i32 q0 = a.qo_indptr[r], q1 = min(a.qo_indptr[r + 1], width);
        for (cc_i32 x = q0; x < q1; x += qt) tiles[1 + k++] = x;
    }
    if (threadIdx.x == PLAN_THREADS - 1) tiles[0] = incl;
}

#define PREFILL_MAXP 16            // pairs one thread scores per K/V tile (pairs / (THREADS / kt))

// CTA (x, kv head) takes tiles x, x + gridDim.x, ... of the work list (prefill_plan's);
// a tile's qt queries x G heads = `pairs` (query, head) pairs share every staged K/V tile
// of kt rows. Scores: thread t takes key t % kt for pairs t / kt, t / kt + THREADS / kt, ...;
// the tile's softmax reduces over those kt lanes; then each thread updates four output dims
// of some pairs. Shared memory (dynamic): the ring, then q (pre-scaled) and the output
// accumulators as floats [pairs][D], probabilities [pairs][kt], then m, l and the rescale
// per pair. Afterwards, CTA x zeros padding rows width + x, width + x + gridDim.x, ...
template <typename T>
__device__ void paged_prefill(const PagedArgs a, cc_i32 qt, cc_i32 kt, cc_i32 cb,
                              const cc_i32* __restrict__ tiles, const T* __restrict__ q,
                              const T* __restrict__ k_pool, const T* __restrict__ v_pool,
                              T* __restrict__ out)
{
    extern __shared__ __align__(16) unsigned char smem[];
    const cc_i32 G = a.n_heads / a.n_kv_heads, D = a.head_dim, kvh = blockIdx.y;
    const cc_i32 pairs = qt * G;
    const cc_i32 pitch = stage_pitch(D * (cc_i32)sizeof(T), true);
    const cc_i32 pe = pitch / (cc_i32)sizeof(T);
    cc_i32* s_idx = reinterpret_cast<cc_i32*>(smem + (cc_i64)PREFILL_STAGES * 2 * kt * pitch);
    float* s_q = reinterpret_cast<float*>(s_idx + PREFILL_STAGES * kt);
    float* s_o = s_q + pairs * D;
    float* s_p = s_o + pairs * D;
    float* s_m = s_p + pairs * kt;
    float* s_l = s_m + pairs;
    float* s_c = s_l + pairs;
    const cc_i32 width = (cc_i32)min((cc_i64)a.n_rows, *a.width);
    const cc_i32 count = tiles[0];
    const float qscale = a.scale * LOG2E;
    const cc_i32 r = threadIdx.x % kt, slot = threadIdx.x / kt, nslot = THREADS / kt;
    const cc_i32 D4 = D / 4;

    for (cc_i32 x = blockIdx.x; x < count; x += gridDim.x) {
        const cc_i32 q0 = tiles[1 + x];
        cc_i32 run; cc_i64 base, lo0, hi0;
        visible_range(a, q0, &run, &base, &lo0, &hi0);
        const cc_i32 end = min(a.qo_indptr[run + 1], width);
        const cc_i32 nq = min(qt, end - q0);                 // real queries of this tile (>= 1)
        for (cc_i32 e = threadIdx.x; e < pairs * D; e += THREADS) {
            const cc_i32 pr = e / D, d = e % D, qi = pr / G, g = pr % G;
            s_q[e] = qi < nq ? to_f(q[(q0 + qi) * a.q_s_tok + (kvh * G + g) * a.q_s_head + d]) * qscale : 0.f;
            s_o[e] = 0.f;
        }
        for (cc_i32 pr = threadIdx.x; pr < pairs; pr += THREADS) { s_m[pr] = -INFINITY; s_l[pr] = 0.f; }
        const cc_i64 hi_last = hi0 + nq - 1;                 // the tile's last query sees up to here

        KvRing<PREFILL_STAGES> ring;
        ring.smem = smem; ring.s_idx = s_idx;
        ring.k_pool = reinterpret_cast<const unsigned char*>(k_pool);
        ring.v_pool = reinterpret_cast<const unsigned char*>(v_pool);
        ring.idx = a.kv_indices + base;
        ring.row_bytes = (cc_i64)a.n_kv_heads * D * sizeof(T);
        ring.head_off = (cc_i64)kvh * D * sizeof(T);
        ring.e0 = lo0; ring.e1 = hi_last + 1;
        ring.tile = kt; ring.pitch = pitch; ring.rb = D * (cc_i32)sizeof(T); ring.cb = cb;
        ring.n_tiles = (cc_i32)((ring.e1 - ring.e0 + kt - 1) / kt);
        ring.start();                                        // its barrier also covers s_q/s_o
        for (cc_i32 t = 0; t < ring.n_tiles; ++t) {
            ring.next(t);
            const cc_i32 nk = ring.rows(t);
            const cc_i64 idx = lo0 + (cc_i64)t * kt + r;     // this lane's key (list entry)
            const T* sk = reinterpret_cast<const T*>(ring.k(t));
            const T* sv = reinterpret_cast<const T*>(ring.v(t));
            float sc[PREFILL_MAXP];
#pragma unroll
            for (int j = 0; j < PREFILL_MAXP; ++j) sc[j] = 0.f;
            if (r < nk) {
                for (cc_i32 d = 0; d < D; d += 8) {
                    float kf[8];
                    load8(sk + r * pe + d, kf);
#pragma unroll
                    for (int j = 0; j < PREFILL_MAXP; ++j) {
                        const cc_i32 pr = slot + j * nslot;
                        if (pr < pairs) {
                            float qv[8];
                            load8(s_q + pr * D + d, qv);
#pragma unroll
                            for (int k = 0; k < 8; ++k) sc[j] += qv[k] * kf[k];
                        }
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < PREFILL_MAXP; ++j) {
                const cc_i32 pr = slot + j * nslot;
                if (j * nslot >= pairs) break;               // uniform over the block
                const bool real = pr < pairs;
                const cc_i32 qi = pr / G;
                const cc_i64 qhi = hi0 + qi;
                const cc_i64 qlo = a.window > 0 ? (qhi - a.window + 1 > 0 ? qhi - a.window + 1 : 0) : 0;
                const bool vis = real && qi < nq && r < nk && idx >= qlo && idx <= qhi;
                const float s = vis ? sc[j] : -INFINITY;
                const float m_old = real ? s_m[pr] : -INFINITY;
                float mx = s;
                for (cc_i32 off = kt >> 1; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
                const float m_new = fmaxf(m_old, mx);
                const float p = vis ? ex2(s - m_new) : 0.f;
                float sum = p;
                for (cc_i32 off = kt >> 1; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
                if (real) {
                    s_p[pr * kt + r] = p;
                    if (r == 0) {                            // every lane read s_m before the shuffles
                        const float c = m_old == -INFINITY ? 0.f : ex2(m_old - m_new);
                        s_c[pr] = c;
                        s_l[pr] = s_l[pr] * c + sum;
                        s_m[pr] = m_new;
                    }
                }
            }
            __syncthreads();
            for (cc_i32 e = threadIdx.x; e < pairs * D4; e += THREADS) {
                const cc_i32 pr = e / D4, d = (e % D4) * 4;
                float4 o = *reinterpret_cast<float4*>(s_o + pr * D + d);
                const float c = s_c[pr];
                o.x *= c; o.y *= c; o.z *= c; o.w *= c;
                const float* pp = s_p + pr * kt;
                cc_i32 rr = 0;
                for (; rr + 4 <= nk; rr += 4) {
                    const float4 p4 = *reinterpret_cast<const float4*>(pp + rr);
                    float v0[4], v1[4], v2[4], v3[4];
                    load4(sv + rr * pe + d, v0);
                    load4(sv + (rr + 1) * pe + d, v1);
                    load4(sv + (rr + 2) * pe + d, v2);
                    load4(sv + (rr + 3) * pe + d, v3);
                    o.x += p4.x * v0[0] + p4.y * v1[0] + p4.z * v2[0] + p4.w * v3[0];
                    o.y += p4.x * v0[1] + p4.y * v1[1] + p4.z * v2[1] + p4.w * v3[1];
                    o.z += p4.x * v0[2] + p4.y * v1[2] + p4.z * v2[2] + p4.w * v3[2];
                    o.w += p4.x * v0[3] + p4.y * v1[3] + p4.z * v2[3] + p4.w * v3[3];
                }
                for (; rr < nk; ++rr) {
                    float v0[4];
                    load4(sv + rr * pe + d, v0);
                    const float p = pp[rr];
                    o.x += p * v0[0]; o.y += p * v0[1]; o.z += p * v0[2]; o.w += p * v0[3];
                }
                *reinterpret_cast<float4*>(s_o + pr * D + d) = o;
            }
            // the next ring.next() holds the barrier before this tile's stage is refilled
        }
        ring.finish();
        for (cc_i32 e = threadIdx.x; e < pairs * D; e += THREADS) {
            const cc_i32 pr = e / D, d = e % D, qi = pr / G, g = pr % G;
            if (qi < nq)
                out[(q0 + qi) * a.o_s_tok + (kvh * G + g) * a.o_s_head + d] =
                    from_f<T>(s_l[pr] > 0.f ? s_o[e] / s_l[pr] : 0.f);
        }
        __syncthreads();                                     // before the next tile's set-up
    }
    for (cc_i32 i = width + blockIdx.x; i < a.n_rows; i += gridDim.x)
        for (cc_i32 e = threadIdx.x; e < G * D; e += THREADS)
            out[i * a.o_s_tok + (kvh * G + e / D) * a.o_s_head + e % D] = from_f<T>(0.f);
}

// The launch constants the host needs (read by cellcache.cuda.kernels through
// cuModuleGetGlobal, so they have one source): {decode stages, prefill stages, pairs one
// prefill thread scores, prefill_plan threads}.
extern "C" __device__ const cc_i32 attention_config[4] = {DECODE_STAGES, PREFILL_STAGES,
                                                          PREFILL_MAXP, PLAN_THREADS};

#define INSTANTIATE(SUFFIX, T)                                                                 \
extern "C" __global__ void __launch_bounds__(THREADS) store_kv_##SUFFIX(                      \
    const cc_i64* cells, cc_i32 rows, const T* k_in, const T* v_in, cc_i64 s_tok,            \
    cc_i64 s_head, T* k_pool, T* v_pool, cc_i32 n_kv_heads, cc_i32 head_dim)                  \
{ store_kv<T>(cells, rows, k_in, v_in, s_tok, s_head, k_pool, v_pool, n_kv_heads, head_dim); } \
extern "C" __global__ void __launch_bounds__(THREADS) attend_##SUFFIX(                        \
    const cc_i64* read_len, const float* q, const T* k_pool, const T* v_pool,                 \
    const cc_u8* mask, cc_i64 capacity, cc_i32 n_heads, cc_i32 n_kv_heads,                   \
    cc_i32 head_dim, float* out)                                                              \
{ attend<T>(read_len, q, k_pool, v_pool, mask, capacity, n_heads, n_kv_heads, head_dim, out); } \
extern "C" __global__ void __launch_bounds__(THREADS) paged_merge_##SUFFIX(                   \
    const PagedArgs a, cc_i32 n_splits, const float* part, T* out)                            \
{ paged_merge<T>(a, n_splits, part, out); }                                                   \
extern "C" __global__ void __launch_bounds__(THREADS) paged_prefill_##SUFFIX(                 \
    const PagedArgs a, cc_i32 qt, cc_i32 kt, cc_i32 cb, const cc_i32* tiles, const T* q,      \
    const T* k_pool, const T* v_pool, T* out)                                                 \
{ paged_prefill<T>(a, qt, kt, cb, tiles, q, k_pool, v_pool, out); }                           \
DECODE(SUFFIX, T, 1) DECODE(SUFFIX, T, 2) DECODE(SUFFIX, T, 4)

// paged_decode_T_gN: each thread holds N query heads (bdy * N >= the group)
#define DECODE(SUFFIX, T, N)                                                                   \
extern "C" __global__ void __launch_bounds__(THREADS, 4) paged_decode_##SUFFIX##_g##N(        \
    const PagedArgs a, cc_i32 bdx, cc_i32 bdy, cc_i32 tile, cc_i32 cb, const T* q,            \
    const T* k_pool, const T* v_pool, float* part, T* out)                                    \
{ paged_decode<T, N>(a, bdx, bdy, tile, cb, q, k_pool, v_pool, part, out); }

INSTANTIATE(float32, float)
INSTANTIATE(float16, f16)
INSTANTIATE(bfloat16, bf16)
