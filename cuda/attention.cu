// A small attention forward over the cache's buffers: the CUDA twin of
// cellcache.attention (the reference consumer), used by tools/capture_graph.py.
//
// store_kv_*: write the step's K and V rows (float32 inputs) into a layer's pools at
//             cells[:width], converting to the pool's dtype.
// attend_*:   one block per (query row, head): attend over pool rows [0, read_len) under the
//             layer's mask row, float32 softmax, grouped-query heads. read_len is read from
//             its device buffer, so a captured graph sees each step's value.
#include <stdint.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define THREADS 128
#define MAX_HEAD_DIM 256

template <typename T> __device__ __forceinline__ float to_f(T x);
template <> __device__ __forceinline__ float to_f<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename T>
__device__ void store_kv(const int64_t* __restrict__ cells, int32_t width,
                         const float* __restrict__ k_in, const float* __restrict__ v_in,
                         T* __restrict__ k_pool, T* __restrict__ v_pool, int32_t row_elems)
{
    int32_t row = blockIdx.y;
    if (row >= width) return;
    int64_t c = cells[row];
    for (int32_t e = blockIdx.x * blockDim.x + threadIdx.x; e < row_elems; e += gridDim.x * blockDim.x) {
        k_pool[c * row_elems + e] = from_f<T>(k_in[(int64_t)row * row_elems + e]);
        v_pool[c * row_elems + e] = from_f<T>(v_in[(int64_t)row * row_elems + e]);
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
__device__ void attend(const int64_t* __restrict__ read_len_p, const float* __restrict__ q,
                       const T* __restrict__ k_pool, const T* __restrict__ v_pool,
                       const uint8_t* __restrict__ mask, int64_t capacity, int32_t n_heads,
                       int32_t n_kv_heads, int32_t head_dim, float* __restrict__ out)
{
    __shared__ float s_q[MAX_HEAD_DIM];
    __shared__ float s_acc[MAX_HEAD_DIM];
    __shared__ float scratch[THREADS];
    int32_t i = blockIdx.x, h = blockIdx.y;
    int32_t kvh = h / (n_heads / n_kv_heads);
    int64_t read_len = *read_len_p;
    const uint8_t* mrow = mask + (int64_t)i * capacity;
    float scale = rsqrtf((float)head_dim);
    for (int d = threadIdx.x; d < head_dim; d += THREADS) {
        s_q[d] = q[((int64_t)i * n_heads + h) * head_dim + d];
        s_acc[d] = 0.f;
    }
    __syncthreads();
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j < read_len; j += THREADS) {
        if (!mrow[j]) continue;
        const T* k = k_pool + (j * n_kv_heads + kvh) * head_dim;
        float s = 0.f;
        for (int d = 0; d < head_dim; ++d) s += s_q[d] * to_f<T>(k[d]);
        m = fmaxf(m, s * scale);
    }
    m = block_reduce(m, scratch, true);
    float l = 0.f;
    for (int64_t j = threadIdx.x; j < read_len; j += THREADS) {
        if (!mrow[j]) continue;
        const T* k = k_pool + (j * n_kv_heads + kvh) * head_dim;
        const T* v = v_pool + (j * n_kv_heads + kvh) * head_dim;
        float s = 0.f;
        for (int d = 0; d < head_dim; ++d) s += s_q[d] * to_f<T>(k[d]);
        float w = __expf(s * scale - m);
        l += w;
        for (int d = 0; d < head_dim; ++d) atomicAdd(&s_acc[d], w * to_f<T>(v[d]));
    }
    l = block_reduce(l, scratch, false);
    for (int d = threadIdx.x; d < head_dim; d += THREADS)
        out[((int64_t)i * n_heads + h) * head_dim + d] = s_acc[d] / l;
}

#define INSTANTIATE(SUFFIX, T)                                                                 \
extern "C" __global__ void __launch_bounds__(THREADS) store_kv_##SUFFIX(                      \
    const int64_t* cells, int32_t width, const float* k_in, const float* v_in,                \
    T* k_pool, T* v_pool, int32_t row_elems)                                                  \
{ store_kv<T>(cells, width, k_in, v_in, k_pool, v_pool, row_elems); }                         \
extern "C" __global__ void __launch_bounds__(THREADS) attend_##SUFFIX(                        \
    const int64_t* read_len, const float* q, const T* k_pool, const T* v_pool,                \
    const uint8_t* mask, int64_t capacity, int32_t n_heads, int32_t n_kv_heads,               \
    int32_t head_dim, float* out)                                                             \
{ attend<T>(read_len, q, k_pool, v_pool, mask, capacity, n_heads, n_kv_heads, head_dim, out); }

INSTANTIATE(float32, float)
INSTANTIATE(float16, __half)
INSTANTIATE(bfloat16, __nv_bfloat16)
