// The kernels cellcache launches on torch tensors. The native model path's elementwise
// kernels (cellcache/native.py): what a Llama-family decoder layer does between its GEMMs
// and attention, one launch each where transformers' modules launch five to ten.
//
//   add_rms_norm  r = T(x + res) (when add; else r = x), out = T(w * T(r * rsqrt(mean(r^2) + eps)))
//                 one block a row; r is stored into res_out (the residual stream: res_out
//                 may be res, in place)
//   silu_mul      out = T(T(silu(gate)) * up), gate and up the two halves of a gate_up row
//   rotary        q and k heads of a qkv row rotated in place (rotate_half's pairing:
//                 element j with element j + D/2) by the step's cos and sin rows
//   rotary_store  the same, and the row's k and v heads written into the layer's K/V pools
//                 at the step's cell for the row (the attention's K/V write, fused)
//
// Every value is rounded to T where transformers' modules round it (each torch op's output
// is a T tensor), so a forward in T differs from the modules' only by the sum order of the
// RMS reduction. Arithmetic in float32. Vectorized (16-byte) variants for rows whose width,
// strides and addresses are multiples of 8 elements of 2 bytes (VEC 8) or 4 of 4 bytes
// (VEC 4); the host picks (cellcache/cuda/fused.py).
//
// And the host tier's row mover (cellcache/generate/spill.py): every pool's rows of a
// sequence moved between the cache's pools and one packed staging buffer in one launch
// (moving them pool by pool is two launches a layer, which at 256-byte rows cost more than
// the bytes).
//
//   move_rows     to_stage: stage part p row stage_idx[j] = pool p row pool_idx[j]
//                 else:     pool p row pool_idx[j]       = stage part p row stage_idx[j]
//                 for j in [0, n) and every pool p; stage_idx null: row row0 + j
//
// And the logits a forward hands out (cellcache/runner.py's graphs):
//
//   logits_out    out = float32(x) by rows, and ids[r] = the argmax of row r in torch.argmax's
//                 order (a NaN above every number, ties to the lowest id): the float32 copy
//                 and the greedy ids in one read of the model's logits; the copy only while
//                 *write != 0 (null: always), a flag set in stream order, so that one captured
//                 graph serves steps whose draws read the ids alone (a third of the bytes)
//
// And the sampler's draw for rows at a temperature alone (cellcache/generate/sampler.py):
//
//   sample_rows   token = the first j whose running sum of e_j = expf(x_j / T - max) (in
//                 double) exceeds u times the row's sum: what softmax -> cumsum ->
//                 searchsorted computes, in one launch and two reads of the row
#include "abi.h"
#include "dtypes.h"

#define THREADS 256
#define TC_NEG_INF_F __int_as_float(0xff800000)

// x rounded to T and back: where a torch op would have stored a T tensor
template <typename T> __device__ __forceinline__ float rnd(float x) { return to_f(from_f<T>(x)); }

// VEC elements of T at p (16 bytes when VEC * sizeof(T) == 16), as floats, and back
template <typename T, int VEC> struct Vec {
    T v[VEC];
};
template <typename T, int VEC>
__device__ __forceinline__ void load(const T* p, float* f)
{
    Vec<T, VEC> v;
    if (VEC * sizeof(T) == 16) *reinterpret_cast<uint4*>(&v) = *reinterpret_cast<const uint4*>(p);
    else v = *reinterpret_cast<const Vec<T, VEC>*>(p);
#pragma unroll
    for (int i = 0; i < VEC; ++i) f[i] = to_f(v.v[i]);
}
template <typename T, int VEC>
__device__ __forceinline__ void store(T* p, const float* f)
{
    Vec<T, VEC> v;
#pragma unroll
    for (int i = 0; i < VEC; ++i) v.v[i] = from_f<T>(f[i]);
    if (VEC * sizeof(T) == 16) *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(&v);
    else *reinterpret_cast<Vec<T, VEC>*>(p) = v;
}

// scratch: 33 floats (a partial sum a warp, then the total in scratch[32])
__device__ __forceinline__ float block_sum(float x, float* scratch)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    if (warp == 0) {
        x = lane < (int)(blockDim.x >> 5) ? scratch[lane] : 0.f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
        if (lane == 0) scratch[32] = x;
    }
    __syncthreads();
    return scratch[32];
}

// One block a row of `hidden` elements. add: the row of x is added to the row of res_in
// (the sum, rounded to T, stored into res_out, which may be res_in: each thread reads its
// own elements before it writes them) and the norm reads the sum; else the norm reads x.
// x, res_in and res_out carry no __restrict__: the second pass reads back what the first
// wrote, which a non-coherent (read-only) load may not.
template <typename T, int VEC>
__device__ void add_rms_norm(const T* x, const T* res_in, T* res_out,
                             const T* __restrict__ w, T* __restrict__ out, cc_i32 hidden,
                             cc_i64 s_x, cc_i64 s_in, cc_i64 s_res, cc_i64 s_out, float eps,
                             cc_i32 add)
{
    __shared__ float scratch[33];
    const cc_i64 row = blockIdx.x;
    const T* xr = x + row * s_x;
    const T* ri = res_in + row * s_in;
    T* rr = res_out + row * s_res;
    T* orow = out + row * s_out;
    float ss = 0.f;
    for (cc_i32 i = threadIdx.x * VEC; i < hidden; i += blockDim.x * VEC) {
        float a[VEC];
        load<T, VEC>(xr + i, a);
        if (add) {
            float b[VEC];
            load<T, VEC>(ri + i, b);
#pragma unroll
            for (int j = 0; j < VEC; ++j) a[j] = rnd<T>(a[j] + b[j]);
            store<T, VEC>(rr + i, a);
        }
#pragma unroll
        for (int j = 0; j < VEC; ++j) ss += a[j] * a[j];
    }
    const float rstd = rsqrtf(block_sum(ss, scratch) / (float)hidden + eps);
    const T* src = add ? (const T*)rr : xr;     // this thread's own elements, written above
    for (cc_i32 i = threadIdx.x * VEC; i < hidden; i += blockDim.x * VEC) {
        float a[VEC], g[VEC];
        load<T, VEC>(src + i, a);
        load<T, VEC>(w + i, g);
#pragma unroll
        for (int j = 0; j < VEC; ++j) a[j] = g[j] * rnd<T>(a[j] * rstd);
        store<T, VEC>(orow + i, a);
    }
}

// grid (rows, column blocks): out[r, i] = T(T(silu(gu[r, i])) * gu[r, inter + i])
template <typename T, int VEC>
__device__ void silu_mul(const T* __restrict__ gu, T* __restrict__ out, cc_i32 inter,
                         cc_i64 s_gu, cc_i64 s_out)
{
    const cc_i64 row = blockIdx.x;
    const cc_i32 i = (blockIdx.y * blockDim.x + threadIdx.x) * VEC;
    if (i >= inter) return;
    float g[VEC], u[VEC];
    load<T, VEC>(gu + row * s_gu + i, g);
    load<T, VEC>(gu + row * s_gu + inter + i, u);
#pragma unroll
    for (int j = 0; j < VEC; ++j) g[j] = rnd<T>(g[j] / (1.f + expf(-g[j]))) * u[j];
    store<T, VEC>(out + row * s_out + i, g);
}

// grid (tokens, pair blocks): heads [0, n_heads) of a token's row, each head_dim wide and
// contiguous from the row's start, rotated in place; cos and sin rows are head_dim wide.
// Products and sums by __fmul_rn/__fadd_rn: never contracted into an fma (float32 rounds
// each product as torch's ops do; 16-bit types round them to T between anyway)
// Pair j of head x (elements j and j + half) rotated by token t's cos and sin, into a and b
template <typename T>
__device__ __forceinline__ void rotate_pair(const T* x, const T* cos_, const T* sin_, cc_i64 t,
                                            cc_i32 j, cc_i32 half, cc_i64 s_cos, cc_i64 s_sin,
                                            T& a, T& b)
{
    const float x1 = to_f(x[j]), x2 = to_f(x[j + half]);
    const float c1 = to_f(cos_[t * s_cos + j]), c2 = to_f(cos_[t * s_cos + j + half]);
    const float s1 = to_f(sin_[t * s_sin + j]), s2 = to_f(sin_[t * s_sin + j + half]);
    // q * cos + rotate_half(q) * sin, rotate_half(q) = cat(-q2, q1): each product a T tensor
    a = from_f<T>(__fadd_rn(rnd<T>(__fmul_rn(x1, c1)), rnd<T>(__fmul_rn(-x2, s1))));
    b = from_f<T>(__fadd_rn(rnd<T>(__fmul_rn(x2, c2)), rnd<T>(__fmul_rn(x1, s2))));
}

template <typename T>
__device__ void rotary(T* __restrict__ qkv, const T* __restrict__ cos_, const T* __restrict__ sin_,
                       cc_i32 n_heads, cc_i32 head_dim, cc_i64 s_tok, cc_i64 s_cos, cc_i64 s_sin)
{
    const cc_i64 t = blockIdx.x;
    const cc_i32 half = head_dim >> 1;
    const cc_i32 p = blockIdx.y * blockDim.x + threadIdx.x;
    if (p >= n_heads * half) return;
    const cc_i32 h = p / half, j = p - h * half;
    T* x = qkv + t * s_tok + (cc_i64)h * head_dim;
    T a, b;
    rotate_pair<T>(x, cos_, sin_, t, j, half, s_cos, s_sin, a, b);
    x[j] = a;
    x[j + half] = b;
}

// grid (tokens, pair blocks): rotary's rotation of token t's q and k heads (n_q, then n_kv,
// head_dim each from the row's start) in place, the k heads also stored into the K pool at
// row cells[t], and the v heads (the n_kv after them) copied into the V pool at that row
// (pools [rows, n_kv, head_dim], contiguous): the K/V write of cellcache.torch's attention
// in the same launch (a padding row's cell is the sink, as the step buffer says)
template <typename T>
__device__ void rotary_store(T* __restrict__ qkv, const T* __restrict__ cos_, const T* __restrict__ sin_,
                             const cc_i64* __restrict__ cells, T* __restrict__ k_pool,
                             T* __restrict__ v_pool, cc_i32 n_q, cc_i32 n_kv, cc_i32 head_dim,
                             cc_i64 s_tok, cc_i64 s_cos, cc_i64 s_sin)
{
    const cc_i64 t = blockIdx.x;
    const cc_i32 half = head_dim >> 1;
    const cc_i32 p = blockIdx.y * blockDim.x + threadIdx.x;
    const cc_i32 pairs = (n_q + n_kv) * half;
    if (p >= pairs + n_kv * half) return;
    T* row = qkv + t * s_tok;
    const cc_i64 at = cells[t] * (cc_i64)n_kv * head_dim;
    if (p >= pairs) {                                 // a pair of a v head: copied
        const cc_i32 i = p - pairs, h = i / half, j = i - h * half;
        const T* v = row + (cc_i64)(n_q + n_kv + h) * head_dim;
        T* dst = v_pool + at + (cc_i64)h * head_dim;
        dst[j] = v[j];
        dst[j + half] = v[j + half];
        return;
    }
    const cc_i32 h = p / half, j = p - h * half;
    T* x = row + (cc_i64)h * head_dim;
    T a, b;
    rotate_pair<T>(x, cos_, sin_, t, j, half, s_cos, s_sin, a, b);
    x[j] = a;
    x[j + half] = b;
    if (h >= n_q) {
        T* dst = k_pool + at + (cc_i64)(h - n_q) * head_dim;
        dst[j] = a;
        dst[j + half] = b;
    }
}

#define NORM(NAME, T, VEC)                                                                     \
    extern "C" __global__ void __launch_bounds__(THREADS)                                      \
    add_rms_norm_##NAME##_v##VEC(const T* x, const T* res_in, T* res_out, const T* w, T* out,  \
                                 cc_i32 hidden, cc_i64 s_x, cc_i64 s_in, cc_i64 s_res,         \
                                 cc_i64 s_out, float eps, cc_i32 add)                          \
    { add_rms_norm<T, VEC>(x, res_in, res_out, w, out, hidden, s_x, s_in, s_res, s_out, eps,   \
                           add); }                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS)                                      \
    silu_mul_##NAME##_v##VEC(const T* gu, T* out, cc_i32 inter, cc_i64 s_gu, cc_i64 s_out)    \
    { silu_mul<T, VEC>(gu, out, inter, s_gu, s_out); }

#define ROTARY(NAME, T)                                                                        \
    extern "C" __global__ void __launch_bounds__(THREADS)                                      \
    rotary_##NAME(T* qkv, const T* c, const T* s, cc_i32 n_heads, cc_i32 head_dim,             \
                  cc_i64 s_tok, cc_i64 s_cos, cc_i64 s_sin)                                    \
    { rotary<T>(qkv, c, s, n_heads, head_dim, s_tok, s_cos, s_sin); }                         \
    extern "C" __global__ void __launch_bounds__(THREADS)                                      \
    rotary_store_##NAME(T* qkv, const T* c, const T* s, const cc_i64* cells, T* k_pool,        \
                        T* v_pool, cc_i32 n_q, cc_i32 n_kv, cc_i32 head_dim, cc_i64 s_tok,     \
                        cc_i64 s_cos, cc_i64 s_sin)                                            \
    { rotary_store<T>(qkv, c, s, cells, k_pool, v_pool, n_q, n_kv, head_dim, s_tok, s_cos,     \
                      s_sin); }

// every element type with its scalar and its 16-byte variant: X(name, T, VEC)
#define BY_DTYPE_AND_VEC(X)                                                                    \
    X(float32, float, 1) X(float32, float, 4) X(float16, f16, 1) X(float16, f16, 8)            \
    X(bfloat16, bf16, 1) X(bfloat16, bf16, 8)

BY_DTYPE_AND_VEC(NORM)
ROTARY(float32, float)
ROTARY(float16, f16)
ROTARY(bfloat16, bf16)

// A pool of the row mover: its base address, its row's bytes, and the bytes of a row of every
// pool before it (part p of a stage of R rows starts at stage + R * cum_bytes).
struct RowPool {
    cc_u64 base;
    cc_i64 row_bytes, cum_bytes;
};

// grid (blocks, pools): block (x, p) moves a grid-stride share of pool p's n * row_bytes / V
// units of V bytes (V 16: every row_bytes, base and the stage a multiple of 16; the host
// picks). Unit i is byte (i % W) * V of row i / W (W units a row; the host keeps n * W below
// 2^31). Plain loads: the pools were written by kernels earlier in the stream.
template <typename U>
__device__ void move_rows(const RowPool* __restrict__ pools, cc_u64 stage, cc_i64 stage_rows,
                          const cc_i64* __restrict__ pool_idx, const cc_i64* __restrict__ stage_idx,
                          cc_i64 row0, cc_i32 n, cc_i32 to_stage)
{
    const RowPool pool = pools[blockIdx.y];
    const cc_i32 w = (cc_i32)(pool.row_bytes / (cc_i64)sizeof(U));
    const cc_u32 total = (cc_u32)n * (cc_u32)w;
    const cc_u64 part = stage + (cc_u64)(stage_rows * pool.cum_bytes);
    for (cc_u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const cc_u32 j = i / (cc_u32)w, u = i - j * (cc_u32)w;
        const cc_i64 s = stage_idx ? stage_idx[j] : row0 + (cc_i64)j;
        U* a = reinterpret_cast<U*>(pool.base + (cc_u64)(pool_idx[j] * pool.row_bytes)) + u;
        U* b = reinterpret_cast<U*>(part + (cc_u64)(s * pool.row_bytes)) + u;
        if (to_stage) *b = *a;
        else *a = *b;
    }
}

#define MOVE_ROWS(V, U)                                                                        \
    extern "C" __global__ void __launch_bounds__(THREADS)                                      \
    move_rows_v##V(const RowPool* pools, cc_u64 stage, cc_i64 stage_rows, const cc_i64* pool_idx, \
                   const cc_i64* stage_idx, cc_i64 row0, cc_i32 n, cc_i32 to_stage)            \
    { move_rows<U>(pools, stage, stage_rows, pool_idx, stage_idx, row0, n, to_stage); }

MOVE_ROWS(16, uint4)
MOVE_ROWS(1, unsigned char)

// grid (rows), LOGIT_THREADS threads: row r of x (V elements of T, rows sx apart) copied to
// float32 into row r of out (rows so apart) and its argmax written to ids[r]. (v, i) beats
// (bv, bi) in torch.argmax's order: a NaN beats every number (the first NaN wins), otherwise
// the larger value, ties to the lower id; so a row of -inf gives 0, as torch's does.
#define LOGIT_THREADS 1024

__device__ __forceinline__ bool beats(float v, int i, float bv, int bi)
{
    const bool vn = v != v, bn = bv != bv;
    if (vn || bn) return vn && (!bn || i < bi);
    return v > bv || (v == bv && i < bi);
}

template <typename T, int VEC>
__device__ void logits_out(const T* __restrict__ x, cc_i64 sx, float* __restrict__ out, cc_i64 so,
                           cc_i64* __restrict__ ids, const cc_i32* __restrict__ write, cc_i32 V)
{
    const bool copy = write == nullptr || *write != 0;
    __shared__ float s_v[LOGIT_THREADS / 32];
    __shared__ int s_i[LOGIT_THREADS / 32];
    const cc_i64 row = blockIdx.x;
    const T* xr = x + row * sx;
    float* orow = out + row * so;
    float bv = TC_NEG_INF_F;
    int bi = 0x7fffffff;
    for (cc_i32 i = threadIdx.x * VEC; i < V; i += blockDim.x * VEC) {
        float a[VEC];
        load<T, VEC>(xr + i, a);
        if (copy && VEC % 4 == 0) {
#pragma unroll
            for (int j = 0; j < VEC; j += 4) {
                float4 f;
                f.x = a[j]; f.y = a[j + 1]; f.z = a[j + 2]; f.w = a[j + 3];
                *reinterpret_cast<float4*>(orow + i + j) = f;
            }
        } else if (copy) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) orow[i + j] = a[j];
        }
#pragma unroll
        for (int j = 0; j < VEC; ++j)
            if (beats(a[j], i + j, bv, bi)) { bv = a[j]; bi = i + j; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (beats(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) { s_v[warp] = bv; s_i[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        const bool live = lane < (int)(blockDim.x >> 5);
        bv = live ? s_v[lane] : TC_NEG_INF_F;
        bi = live ? s_i[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (beats(ov, oi, bv, bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) ids[row] = bi;
    }
}

#define LOGITS_OUT(NAME, T, VEC)                                                               \
    extern "C" __global__ void __launch_bounds__(LOGIT_THREADS)                                \
    logits_out_##NAME##_v##VEC(const T* x, cc_i64 sx, float* out, cc_i64 so, cc_i64* ids,      \
                               const cc_i32* write, cc_i32 V)                                  \
    { logits_out<T, VEC>(x, sx, out, so, ids, write, V); }

BY_DTYPE_AND_VEC(LOGITS_OUT)

// grid (slots), SAMPLE_THREADS threads, ceil(V / 128) doubles of dynamic shared memory.
// Slot s draws from row rows[s] (null: s) of x (float32, row stride sx elements, V columns)
// at temperature (float)temp[s] with uniform unif[s] in [0, 1):
//   xr_j = x_j / T (a float32 division, as torch's), m = max xr, e_j = expf(xr_j - m);
//   out[s] = the first j with e_0 + ... + e_j > u * (e_0 + ... + e_{V-1}), V - 1 when no j
//   does (a sum rounded) or the row has a NaN or no finite maximum (where torch's softmax
//   gives NaN and its search runs off the end, clamped to V - 1).
// The row is read in warp tiles of 128 elements (4 rows of 32, coalesced): a pass for the
// maximum, a pass for each tile's sum, a scan of the tile sums, then one warp reads the one
// tile where the running sum crosses u times the total again, element by element.
#define SAMPLE_THREADS 512
#define SAMPLE_TILE 128

__device__ __forceinline__ double warp_sum_d(double v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_rows(const float* __restrict__ x, cc_i64 sx, const cc_i64* __restrict__ rows,
            const double* __restrict__ temp, const double* __restrict__ unif, cc_i64* __restrict__ out,
            cc_i32 V)
{
    extern __shared__ double tile_sum[];
    __shared__ float s_max[SAMPLE_THREADS / 32];
    __shared__ double s_part[SAMPLE_THREADS / 32];
    __shared__ int s_tile;
    const int s = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const float* xs = x + (rows ? rows[s] : (cc_i64)s) * sx;
    const float T = (float)temp[s];
    const int tiles = (V + SAMPLE_TILE - 1) / SAMPLE_TILE;

    // the maximum of x / T, and whether the row has a NaN
    float m = TC_NEG_INF_F;
    int nan = 0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const float v = __fdiv_rn(xs[j], T);
        nan |= v != v;
        m = fmaxf(m, v);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) s_max[warp] = m;
    nan = __syncthreads_or(nan);
    m = s_max[0];
    for (int w = 1; w < warps; ++w) m = fmaxf(m, s_max[w]);
    if (nan || !(m > TC_NEG_INF_F && m < -TC_NEG_INF_F)) {
        if (threadIdx.x == 0) out[s] = V - 1;
        return;
    }

    // each tile's sum of e (double), a warp a tile
    for (int t = warp; t < tiles; t += warps) {
        double acc = 0.0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int j = t * SAMPLE_TILE + k * 32 + lane;
            if (j < V) acc += (double)expf(__fdiv_rn(xs[j], T) - m);
        }
        acc = warp_sum_d(acc);
        if (lane == 0) tile_sum[t] = acc;
    }
    __syncthreads();

    // inclusive prefix sums of the tiles, in place: each thread a run of tiles in order
    const int per = (tiles + blockDim.x - 1) / blockDim.x;
    const int t0 = threadIdx.x * per, t1 = min(tiles, t0 + per);
    double own = 0.0;
    for (int t = t0; t < t1; ++t) own += tile_sum[t];
    double inc = own;                                 // inclusive scan of the threads' runs
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const double v = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += v;
    }
    if (lane == 31) s_part[warp] = inc;
    __syncthreads();
    double before = 0.0;
    for (int w = 0; w < warp; ++w) before += s_part[w];
    double run = before + inc - own;                  // the sum of the tiles before t0
    for (int t = t0; t < t1; ++t) {
        run += tile_sum[t];
        tile_sum[t] = run;
    }
    if (threadIdx.x == 0) s_tile = tiles;
    __syncthreads();
    const double target = unif[s] * tile_sum[tiles - 1];
    // the first tile whose running sum passes the target (the sums do not decrease but for
    // rounding where one thread's run of tiles meets the next: the least such tile wins)
    for (int t = t0; t < t1; ++t)
        if (tile_sum[t] > target && (t == 0 || !(tile_sum[t - 1] > target))) atomicMin(&s_tile, t);
    __syncthreads();
    const int c = s_tile;
    if (warp != 0) return;
    if (c == tiles) {                                 // the total rounded below the target
        if (lane == 0) out[s] = V - 1;
        return;
    }
    double carry = c > 0 ? tile_sum[c - 1] : 0.0;
    int last = V - 1;                                 // the tile's last id with e > 0 so far
    for (int k = 0; k < 4; ++k) {
        const int j = c * SAMPLE_TILE + k * 32 + lane;
        const double ej = j < V ? (double)expf(__fdiv_rn(xs[j], T) - m) : 0.0;
        double e = ej;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const double v = __shfl_up_sync(0xffffffffu, e, o);
            if (lane >= o) e += v;
        }
        const unsigned hit = __ballot_sync(0xffffffffu, j < V && carry + e > target);
        if (hit) {
            if (lane == 0) out[s] = c * SAMPLE_TILE + k * 32 + (__ffs(hit) - 1);
            return;
        }
        const unsigned some = __ballot_sync(0xffffffffu, ej > 0.0);
        if (some) last = c * SAMPLE_TILE + k * 32 + (31 - __clz(some));
        carry += __shfl_sync(0xffffffffu, e, 31);
    }
    // the tile's own sum rounded below the target its tiles' sums passed: its last id that
    // has any probability
    if (lane == 0) out[s] = last;
}
