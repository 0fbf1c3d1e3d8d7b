// Writes the step's K or V rows into a layer's pool at cells[:width], as a forward does.
// src holds width rows of row_bytes each; cells is the cache's `cells` step buffer.
#include <stdint.h>

extern "C" __global__ void scatter_rows(const int64_t* __restrict__ cells, int32_t width,
                                        const uint8_t* __restrict__ src,
                                        uint8_t* __restrict__ pool, int64_t row_bytes)
{
    int32_t row = blockIdx.y;
    if (row >= width) return;
    const uint8_t* from = src + (int64_t)row * row_bytes;
    uint8_t* to = pool + cells[row] * row_bytes;
    for (int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; b < row_bytes;
         b += (int64_t)gridDim.x * blockDim.x)
        to[b] = from[b];
}
