// microbenchmarks: what a tiny kernel's reads of mapped pinned host memory cost
extern "C" __global__ void k_empty(const long long* h, long long* d) {}
extern "C" __global__ void k_h1(const long long* h, long long* d) { if (threadIdx.x == 0) d[0] = h[0]; }
extern "C" __global__ void k_h4dep(const long long* h, long long* d)
{
    if (threadIdx.x == 0) {
        long long a = h[0]; long long b = h[8 + (a & 7)]; long long c = h[16 + (b & 7)]; long long e = h[24 + (c & 7)];
        d[0] = e;
    }
}
extern "C" __global__ void k_h4pages(const long long* h, long long* d)
{
    if (threadIdx.x == 0) {
        long long a = h[0]; long long b = h[512 + (a & 7)]; long long c = h[1024 + (b & 7)]; long long e = h[1536 + (c & 7)];
        d[0] = e;
    }
}
extern "C" __global__ void k_hpar(const long long* h, long long* d) { d[threadIdx.x] = h[threadIdx.x]; }
extern "C" __global__ void k_hpar4k(const long long* h, long long* d) { d[threadIdx.x] = h[threadIdx.x * 8]; }   // 256 threads x 64 B: 16 KB, 4 pages
extern "C" __global__ void k_d4dep(const long long* h, long long* d)
{
    if (threadIdx.x == 0) {
        long long a = d[1000]; long long b = d[1008 + (a & 7)]; long long c = d[1016 + (b & 7)]; long long e = d[1024 + (c & 7)];
        d[0] = e;
    }
}
