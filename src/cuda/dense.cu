// Dequantisation of an MLX affine matrix (4 or 8 bits, group 64, bf16 scales and biases; spec/MODEL.md
// §5.1) into bf16, for the cuBLAS path of long prefill chunks (dense.rs): w = bf16(s·q + b), fp32
// inside. One thread per 8 consecutive values (one output uint4).
#include "common.cuh"

extern "C" __global__ void dequant_affine(const u32* __restrict__ packed, const bf16* __restrict__ scales,
                                          const bf16* __restrict__ biases, bf16* __restrict__ out, u64 vectors,
                                          int cols, int bits) {
    pdl_wait();
    pdl_launch_dependents();
    const int per_word = 32 / bits, groups = cols / 64;
    const u32 mask = (1u << bits) - 1;
    for (u64 v = blockIdx.x * (u64)blockDim.x + threadIdx.x; v < vectors; v += (u64)gridDim.x * blockDim.x) {
        const u64 first = v * 8, row = first / cols;
        const int col = first % cols, g = col / 64;
        const float s = __bfloat162float(scales[row * groups + g]);
        const float b = __bfloat162float(biases[row * groups + g]);
        // The 8 values are 8 / per_word whole words (cols is a multiple of 64).
        const u32* words = packed + first / per_word;
        float f[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const u32 q = (words[i / per_word] >> (bits * (i % per_word))) & mask;
            f[i] = s * (float)q + b;
        }
        reinterpret_cast<uint4*>(out)[v] = pack8(f);
    }
}

// Rows of `width` values from a buffer whose rows are `pitch` values apart into a packed one: the
// cuBLAS output of a matrix whose row count is no multiple of 8 (the router and the shared
// expert's gate, 257 rows), written at an aligned pitch, where cuBLAS runs its fast kernels
// (dense.rs). One thread per value.
extern "C" __global__ void dense_unpad(const bf16* __restrict__ src, int pitch, bf16* __restrict__ dst, int width,
                                       int rows) {
    pdl_wait();
    pdl_launch_dependents();
    const u64 n = (u64)rows * width;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / width, c = i % width;
        dst[i] = src[r * pitch + c];
    }
}
