// Random weights generated in device memory: a full-size synthetic model (19 GB at 4 bits) is
// ready in about a second instead of minutes of host generation and upload. Values come from a
// counter-based hash (SplitMix64 of seed + index), so they do not depend on the launch shape.
#include "common.cuh"

__device__ __forceinline__ u64 mix64(u64 z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ float unit(u64 h) { return ((h >> 40) + 0.5f) * (1.0f / 16777216.0f); }

extern "C" __global__ void fill_u32(u32* __restrict__ p, u64 n, u64 seed) {
    pdl_wait();
    pdl_launch_dependents();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        p[i] = (u32)mix64(seed ^ (i * 0x2545F4914F6CDD1Dull));
    }
}

// Uniform in [-a, a].
extern "C" __global__ void fill_bf16_uniform(bf16* __restrict__ p, u64 n, u64 seed, float a) {
    pdl_wait();
    pdl_launch_dependents();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        p[i] = __float2bfloat16_rn(a * (2.0f * unit(mix64(seed ^ (i * 0x2545F4914F6CDD1Dull))) - 1.0f));
    }
}

// Scales and biases of affine groups whose codes are uniform in 0..2^bits-1: the dequantised
// weights then have mean 0 and standard deviation ≈ std (scale jittered by ±20 %).
extern "C" __global__ void fill_affine_groups(bf16* __restrict__ scales, bf16* __restrict__ biases, u64 n,
                                              u64 seed, float std, int bits) {
    pdl_wait();
    pdl_launch_dependents();
    const float levels = (float)((1 << bits) - 1);
    const float base = std * 3.4641016f / levels;  // uniform codes: std = scale · levels / √12
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const float s = base * (0.8f + 0.4f * unit(mix64(seed ^ (i * 0x2545F4914F6CDD1Dull))));
        scales[i] = __float2bfloat16_rn(s);
        biases[i] = __float2bfloat16_rn(-0.5f * levels * s);
    }
}

// Random e4m3 bytes, four to a word: bit 3 of each byte cleared, so that no byte is the NaN code
// S.1111.111 (exponents 0, 2, .., 14: magnitudes up to 240).
extern "C" __global__ void fill_e4m3(u32* __restrict__ p, u64 n, u64 seed) {
    pdl_wait();
    pdl_launch_dependents();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        p[i] = (u32)mix64(seed ^ (i * 0x2545F4914F6CDD1Dull)) & 0xF7F7F7F7u;
    }
}

extern "C" __global__ void fill_f32(float* __restrict__ p, u64 n, float v) {
    pdl_wait();
    pdl_launch_dependents();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) p[i] = v;
}
