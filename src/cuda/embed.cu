// Embedding gather (spec/MODEL.md §3.1): row ids[t] of the table → out[t], bf16. The table is
// bf16 or MLX affine (4/8-bit, group 64, bf16 scales and biases: MLX quantises the embedding too),
// dequantised on the way. One block per token; each thread handles 8 consecutive columns.
#include "common.cuh"

extern "C" __global__ void embed_bf16(const bf16* __restrict__ table, const int* __restrict__ ids,
                                      bf16* __restrict__ out, int rows, int cols) {
    pdl_wait();
    pdl_launch_dependents();
    const int t = blockIdx.x;
    int id = ids[t];
    id = id < 0 ? 0 : (id >= rows ? rows - 1 : id);  // the host validates ids; never read out of bounds
    const uint4* src = reinterpret_cast<const uint4*>(table + (u64)id * cols);
    uint4* dst = reinterpret_cast<uint4*>(out + (u64)t * cols);
    for (int v = threadIdx.x; v < cols / 8; v += blockDim.x) dst[v] = src[v];
}

// bits = 4 or 8: a u32 word holds 32/bits codes, the first in the lowest bits.
extern "C" __global__ void embed_affine(const u32* __restrict__ packed, const bf16* __restrict__ scales,
                                        const bf16* __restrict__ biases, const int* __restrict__ ids,
                                        bf16* __restrict__ out, int rows, int cols, int bits) {
    pdl_wait();
    pdl_launch_dependents();
    const int t = blockIdx.x;
    int id = ids[t];
    id = id < 0 ? 0 : (id >= rows ? rows - 1 : id);
    const int words_per_row = cols * bits / 32, groups = cols / 64, per_word = 32 / bits;
    const u32 mask = (1u << bits) - 1;
    const u32* row = packed + (u64)id * words_per_row;
    uint4* dst = reinterpret_cast<uint4*>(out + (u64)t * cols);
    for (int v = threadIdx.x; v < cols / 8; v += blockDim.x) {
        const int c0 = v * 8, g = c0 / 64;
        const float s = __bfloat162float(scales[(u64)id * groups + g]);
        const float b = __bfloat162float(biases[(u64)id * groups + g]);
        float f[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int c = c0 + i;
            const u32 q = (row[c / per_word] >> (bits * (c % per_word))) & mask;
            f[i] = s * (float)q + b;
        }
        dst[v] = pack8(f);
    }
}
