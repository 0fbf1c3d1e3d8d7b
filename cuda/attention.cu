// Attention over the cache's buffers. No host code and no CUDA headers (NVRTC builds it).
//
// store_kv_T       write the step's K and V rows into a layer's pools at cells[:rows]
//                  (padding rows' cells name the sink row).
// attend_T         dense: one block per (query row, head) over pool rows [0, read_len)
//                  under the layer's bool mask row; float32 q/out. The clear reference
//                  kernel of the demo.
// paged_decode_T_gG    one block per (query row, kv head, split) over the row's kv list
//                  (flash-decoding): every query head of the kv head's group at once,
//                  16-byte vector loads of each gathered K/V row, online softmax, split
//                  results merged by paged_merge_T (or written directly with one split).
// paged_prefill_T_gG   one block per (16-query tile of one run, kv head): K/V tiles of the
//                  run's list staged in shared memory once for all the tile's queries.
// The paged kernels read qo_indptr/kv_indptr/kv_indices and `width` from the device, so a
// captured graph serves every step; query i of a run of qo_len queries over a list of L
// entries sees entries (i_last - window, i_last], i_last = L - qo_len + i (causal, aligned
// to the end), and padding rows (i >= width) produce zeros without reading the pools.
#include "abi.h"

#define THREADS CC_ATTN_THREADS
#define INFINITY __int_as_float(0x7f800000)
#define MAX_HEAD_DIM 256

struct f16 { unsigned short x; };
struct bf16 { unsigned short x; };

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(f16 h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.x)); return f;
}
__device__ __forceinline__ float to_f(bf16 h) { return __uint_as_float(((cc_u32)h.x) << 16); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ f16 from_f<f16>(float x) {
    f16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.x) : "f"(x)); return h;
}
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) {
    bf16 h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.x) : "f"(x)); return h;
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

// 16 bytes of T
template <typename T> struct Vec { static constexpr int N = 16 / sizeof(T); };

template <typename T>
__device__ __forceinline__ void load_vec(const T* p, float* out)
{
    constexpr int N = Vec<T>::N;
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = to_f(e[k]);
}

// Two consecutive elements of T as floats, in one load (p is aligned to two elements).
__device__ __forceinline__ void load2(const float* p, float& a, float& b)
{
    const float2 v = *reinterpret_cast<const float2*>(p);
    a = v.x; b = v.y;
}
template <typename H>
__device__ __forceinline__ void load2(const H* p, float& a, float& b)
{
    const cc_u32 w = *reinterpret_cast<const cc_u32*>(p);
    H lo, hi;
    lo.x = (unsigned short)(w & 0xFFFFu);
    hi.x = (unsigned short)(w >> 16);
    a = to_f(lo); b = to_f(hi);
}

// Folds (m2, l2, acc2) into (m, l, acc): running max, sum and weighted sum of a softmax.
__device__ __forceinline__ void merge_state(float& m, float& l, float* acc, float m2, float l2,
                                            const float* acc2, int n)
{
    const float mn = fmaxf(m, m2);
    const float a = m == -INFINITY ? 0.f : __expf(m - mn);
    const float b = m2 == -INFINITY ? 0.f : __expf(m2 - mn);
    for (int k = 0; k < n; ++k) acc[k] = acc[k] * a + acc2[k] * b;
    l = l * a + l2 * b;
    m = mn;
}

// One gathered row's contribution to every head of the group (score reduced over the row's
// `lanes` lanes; every lane of the warp calls this, `valid` false for lanes past the end).
template <typename T, int MAXG>
__device__ __forceinline__ void decode_row(int G, int lanes, bool valid, const float* kf,
                                           const float* vf, float (&qv)[MAXG][Vec<T>::N],
                                           float (&acc)[MAXG][Vec<T>::N], float* m, float* l)
{
    constexpr int VEC = Vec<T>::N;
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
        if (g >= G) break;
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < VEC; ++k) s += qv[g][k] * kf[k];
        for (int off = lanes >> 1; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (!valid) continue;
        const float mn = fmaxf(m[g], s);
        const float corr = __expf(m[g] - mn);             // m = -inf: exp(-inf) = 0
        const float p = __expf(s - mn);
        l[g] = l[g] * corr + p;
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[g][k] = acc[g][k] * corr + p * vf[k];
        m[g] = mn;
    }
}

// One block per (query row, kv head, split). A row's head_dim is spread over
// lanes = head_dim / VEC lanes, so a warp gathers 32 / lanes rows at a time, two batches in
// flight. Split results go to part[(row, head, split)] = {m, l, acc[head_dim]} for
// paged_merge, or straight to out with one split.
template <typename T, int MAXG>
__device__ void paged_decode(const PagedArgs a, const T* __restrict__ q,
                             const T* __restrict__ k_pool, const T* __restrict__ v_pool,
                             float* __restrict__ part, T* __restrict__ out)
{
    constexpr int VEC = Vec<T>::N;
    constexpr int WARPS = CC_ATTN_THREADS / 32;
    __shared__ float s_m[WARPS], s_l[WARPS];
    __shared__ float s_acc[WARPS][MAX_HEAD_DIM];
    const cc_i32 i = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, n_splits = gridDim.z;
    const cc_i32 G = a.n_heads / a.n_kv_heads, D = a.head_dim;
    const cc_i32 lanes = D / VEC;
    const cc_i32 rows_per_warp = 32 / lanes;
    const cc_i32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const cc_i32 sub = lane / lanes, dl = lane % lanes;
    const cc_i32 row_elems = a.n_kv_heads * D;
    float* my_part = part + (((cc_i64)i * a.n_heads + kvh * G) * n_splits + split) * (D + 2);
    if (i >= *a.width) {                                     // padding: zeros, no pool reads
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
    const cc_i64 per = n > 0 ? (n + n_splits - 1) / n_splits : 0;
    const cc_i64 s0 = lo + split * per, s1 = min(hi + 1, s0 + per);

    float qv[MAXG][VEC], acc[MAXG][VEC], m[MAXG], l[MAXG];
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
        m[g] = -INFINITY; l[g] = 0.f;
#pragma unroll
        for (int k = 0; k < VEC; ++k) { acc[g][k] = 0.f; qv[g][k] = 0.f; }
        if (g < G) {
            load_vec<T>(q + i * a.q_s_tok + (kvh * G + g) * a.q_s_head + dl * VEC, qv[g]);
#pragma unroll
            for (int k = 0; k < VEC; ++k) qv[g][k] *= a.scale;
        }
    }
    const cc_i32 slots = WARPS * rows_per_warp;
    const cc_i64 head_off = (cc_i64)kvh * D + dl * VEC;
    // warp-uniform loop: every lane runs every iteration (the shuffles need all 32)
    for (cc_i64 e0 = s0 + warp * rows_per_warp; e0 < s1; e0 += 2 * slots) {
        const cc_i64 e1 = e0 + sub, e2 = e0 + slots + sub;
        const bool v1 = e1 < s1, v2 = e2 < s1;
        float k1[VEC] = {}, x1[VEC] = {}, k2[VEC] = {}, x2[VEC] = {};
        const cc_i64 c1 = v1 ? a.kv_indices[base + e1] : 0;
        const cc_i64 c2 = v2 ? a.kv_indices[base + e2] : 0;
        if (v1) { load_vec<T>(k_pool + c1 * row_elems + head_off, k1);
                  load_vec<T>(v_pool + c1 * row_elems + head_off, x1); }
        if (v2) { load_vec<T>(k_pool + c2 * row_elems + head_off, k2);
                  load_vec<T>(v_pool + c2 * row_elems + head_off, x2); }
        decode_row<T, MAXG>(G, lanes, v1, k1, x1, qv, acc, m, l);
        decode_row<T, MAXG>(G, lanes, v2, k2, x2, qv, acc, m, l);
    }
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
        if (g >= G) break;
        for (int off = lanes; off < 32; off <<= 1) {         // the warp's row slots
            const float m2 = __shfl_xor_sync(0xffffffffu, m[g], off);
            const float l2 = __shfl_xor_sync(0xffffffffu, l[g], off);
            float acc2[VEC];
#pragma unroll
            for (int k = 0; k < VEC; ++k) acc2[k] = __shfl_xor_sync(0xffffffffu, acc[g][k], off);
            merge_state(m[g], l[g], acc[g], m2, l2, acc2, VEC);
        }
        if (sub == 0) {
#pragma unroll
            for (int k = 0; k < VEC; ++k) s_acc[warp][dl * VEC + k] = acc[g][k];
            if (dl == 0) { s_m[warp] = m[g]; s_l[warp] = l[g]; }
        }
        __syncthreads();
        for (cc_i32 d = threadIdx.x; d < D; d += blockDim.x) {     // the warps; thread d owns dim d
            float mm = s_m[0], ll = s_l[0], aa = s_acc[0][d];
            for (int w = 1; w < WARPS; ++w) merge_state(mm, ll, &aa, s_m[w], s_l[w], &s_acc[w][d], 1);
            const cc_i32 h = kvh * G + g;
            if (n_splits == 1) {
                out[i * a.o_s_tok + h * a.o_s_head + d] = from_f<T>(ll > 0.f ? aa / ll : 0.f);
            } else {
                float* pp = my_part + (cc_i64)g * n_splits * (D + 2);
                pp[2 + d] = aa;
                if (d == 0) { pp[0] = mm; pp[1] = ll; }
            }
        }
        __syncthreads();
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
        for (cc_i32 s = 0; s < n_splits; ++s) {
            const float* ps = pp + s * (D + 2);
            const float w = ps[0] == -INFINITY ? 0.f : __expf(ps[0] - mx);
            num += w * ps[2 + d];
            den += w * ps[1];
        }
        out[i * a.o_s_tok + h * a.o_s_head + d] = from_f<T>(den > 0.f ? num / den : 0.f);
    }
}

// One block per (tile, kv head): a tile is `qt` consecutive query rows of one run, starting
// at tile_q0[tile] (the host lists them), with qt * G <= CC_PREFILL_PAIRS. K/V tiles of the
// run's list are staged in shared memory once for every (query, head) pair of the tile.
// Dynamic shared memory: q and out accumulators (pairs x D floats each), K and V tiles
// (CC_PREFILL_K x D of T each), probabilities (pairs x CC_PREFILL_K) and 3 x pairs floats.
template <typename T>
__device__ void paged_prefill(const PagedArgs a, cc_i32 qt, const cc_i32* __restrict__ tile_q0,
                              const T* __restrict__ q, const T* __restrict__ k_pool,
                              const T* __restrict__ v_pool, T* __restrict__ out)
{
    extern __shared__ float smem[];
    const cc_i32 G = a.n_heads / a.n_kv_heads, D = a.head_dim, kvh = blockIdx.y;
    const cc_i32 q0 = tile_q0[blockIdx.x];
    const cc_i32 row_elems = a.n_kv_heads * D;
    const cc_i32 pairs = qt * G;
    float* s_q = smem;                                       // [pairs][D], pre-scaled
    float* s_o = s_q + pairs * D;                            // [pairs][D] accumulators
    float* s_p = s_o + pairs * D;                            // [pairs][K] probabilities
    float* s_m = s_p + pairs * CC_PREFILL_K;                 // [pairs]
    float* s_l = s_m + pairs;
    float* s_c = s_l + pairs;                                // this tile's rescale
    T* s_k = reinterpret_cast<T*>(s_c + pairs);              // [K][D]
    T* s_v = s_k + CC_PREFILL_K * D;
    cc_i32 run; cc_i64 base, lo0, hi0;
    visible_range(a, q0, &run, &base, &lo0, &hi0);
    const cc_i64 end = min((cc_i64)a.qo_indptr[run + 1], *a.width);
    const cc_i32 nq = (cc_i32)min((cc_i64)qt, end - q0);     // real queries of this tile
    if (nq <= 0) return;
    for (cc_i32 e = threadIdx.x; e < pairs * D; e += blockDim.x) {
        const cc_i32 pr = e / D, d = e % D, qi = pr / G, g = pr % G;
        s_q[e] = qi < nq ? to_f(q[(q0 + qi) * a.q_s_tok + (kvh * G + g) * a.q_s_head + d]) * a.scale : 0.f;
        s_o[e] = 0.f;
    }
    for (cc_i32 pr = threadIdx.x; pr < pairs; pr += blockDim.x) { s_m[pr] = -INFINITY; s_l[pr] = 0.f; }
    const cc_i64 hi_last = hi0 + nq - 1;        // the tile's last query sees up to here
    __syncthreads();
    for (cc_i64 t0 = lo0; t0 <= hi_last; t0 += CC_PREFILL_K) {
        const cc_i32 nk = (cc_i32)min((cc_i64)CC_PREFILL_K, hi_last + 1 - t0);
        for (cc_i32 e = threadIdx.x; e < nk * D; e += blockDim.x) {
            const cc_i32 r = e / D, d = e % D;
            const cc_i64 cell = a.kv_indices[base + t0 + r];
            s_k[e] = k_pool[cell * row_elems + kvh * D + d];
            s_v[e] = v_pool[cell * row_elems + kvh * D + d];
        }
        __syncthreads();
        for (cc_i32 pr = threadIdx.x; pr < pairs; pr += blockDim.x) {
            const cc_i32 qi = pr / G;
            const cc_i64 qhi = hi0 + qi;
            const cc_i64 qlo = a.window > 0 ? (qhi - a.window + 1 > 0 ? qhi - a.window + 1 : 0) : 0;
            const float* qq = s_q + pr * D;
            float mx = s_m[pr];
            for (cc_i32 r = 0; r < CC_PREFILL_K; ++r) {
                const cc_i64 idx = t0 + r;
                float s = -INFINITY;
                if (r < nk && qi < nq && idx >= qlo && idx <= qhi) {
                    s = 0.f;
                    const T* kk = s_k + r * D;
                    for (cc_i32 d = 0; d < D; d += 2) {   // pairs, loaded as one word each
                        float k0, k1;
                        load2(kk + d, k0, k1);
                        const float2 q2 = *reinterpret_cast<const float2*>(qq + d);
                        s += q2.x * k0 + q2.y * k1;
                    }
                }
                s_p[pr * CC_PREFILL_K + r] = s;
                mx = fmaxf(mx, s);
            }
            float sum = 0.f;
            for (cc_i32 r = 0; r < CC_PREFILL_K; ++r) {
                const float s = s_p[pr * CC_PREFILL_K + r];
                const float p = s == -INFINITY ? 0.f : __expf(s - mx);
                s_p[pr * CC_PREFILL_K + r] = p;
                sum += p;
            }
            const float c = s_m[pr] == -INFINITY ? 0.f : __expf(s_m[pr] - mx);
            s_c[pr] = c;
            s_l[pr] = s_l[pr] * c + sum;
            s_m[pr] = mx;
        }
        __syncthreads();
        for (cc_i32 e = threadIdx.x; e < pairs * D; e += blockDim.x) {
            const cc_i32 pr = e / D, d = e % D;
            const float* pp = s_p + pr * CC_PREFILL_K;
            float v = s_o[e] * s_c[pr];
            // probabilities four at a time, loaded as one 16-byte vector (s_p rows are
            // 128-byte aligned and the padded entries of a short tile are zero)
            for (cc_i32 r = 0; r < nk; r += 4) {
                const float4 p4 = *reinterpret_cast<const float4*>(pp + r);
                v += p4.x * to_f(s_v[r * D + d]);
                if (r + 1 < nk) v += p4.y * to_f(s_v[(r + 1) * D + d]);
                if (r + 2 < nk) v += p4.z * to_f(s_v[(r + 2) * D + d]);
                if (r + 3 < nk) v += p4.w * to_f(s_v[(r + 3) * D + d]);
            }
            s_o[e] = v;
        }
        __syncthreads();
    }
    for (cc_i32 e = threadIdx.x; e < pairs * D; e += blockDim.x) {
        const cc_i32 pr = e / D, d = e % D, qi = pr / G, g = pr % G;
        if (qi < nq)
            out[(q0 + qi) * a.o_s_tok + (kvh * G + g) * a.o_s_head + d] =
                from_f<T>(s_l[pr] > 0.f ? s_o[e] / s_l[pr] : 0.f);
    }
}

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
    const PagedArgs a, cc_i32 qt, const cc_i32* tile_q0, const T* q, const T* k_pool,         \
    const T* v_pool, T* out)                                                                  \
{ paged_prefill<T>(a, qt, tile_q0, q, k_pool, v_pool, out); }                                 \
DECODE(SUFFIX, T, 1) DECODE(SUFFIX, T, 2) DECODE(SUFFIX, T, 4) DECODE(SUFFIX, T, 8)          \
DECODE(SUFFIX, T, 16)

// paged_decode_T_gG handles groups of up to G query heads per kv head
#define DECODE(SUFFIX, T, G)                                                                   \
extern "C" __global__ void __launch_bounds__(THREADS) paged_decode_##SUFFIX##_g##G(           \
    const PagedArgs a, const T* q, const T* k_pool, const T* v_pool, float* part, T* out)     \
{ paged_decode<T, G>(a, q, k_pool, v_pool, part, out); }

INSTANTIATE(float32, float)
INSTANTIATE(float16, f16)
INSTANTIATE(bfloat16, bf16)
