// 16-bit element types of the kernels and their conversions to and from float32 (round to
// nearest even), shared by cuda/attention.cu and cuda/fused.cu. The conversions are inline
// PTX, so no CUDA header is needed (NVRTC compiles these files alone).
#ifndef CELLCACHE_DTYPES_H
#define CELLCACHE_DTYPES_H

struct f16 { unsigned short x; };
struct bf16 { unsigned short x; };

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(f16 h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.x)); return f;
}
__device__ __forceinline__ float to_f(bf16 h) { return __uint_as_float(((unsigned int)h.x) << 16); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ f16 from_f<f16>(float x) {
    f16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.x) : "f"(x)); return h;
}
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) {
    bf16 h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.x) : "f"(x)); return h;
}

#endif
