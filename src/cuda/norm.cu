// Normalisation and gating kernels (spec/MODEL.md §3.2, §3.6.7, §3.7). bf16 in and out, fp32 inside.
//
// The norms run one warp per row: rows are short (128..2048 values), a warp reduces with shuffles
// alone, and each lane reads its share as 16-byte vectors. A row is read twice (sum of squares,
// then scale); the second read hits L1. The host checks n % 8 == 0 and 16-byte alignment.
#include "norm.cuh"

#define NORM_ROWS_PER_BLOCK 4  // warps per block; must match ROWS_PER_BLOCK in norm.rs

__device__ __forceinline__ int norm_row() { return blockIdx.x * NORM_ROWS_PER_BLOCK + threadIdx.x / 32; }

__device__ __forceinline__ float sum_squares(const uint4* x, int nvec, int lane) {
    float ss = 0.0f;
    for (int v = lane; v < nvec; v += 32) {
        float f[8];
        unpack8(x[v], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) ss += f[i] * f[i];
    }
    return warp_sum(ss);
}

// y = x * rsqrt(mean(x²) + eps) * w, rows of n values. `w` is the effective fp32 multiplier:
// (1 + stored weight) for the zero-centred norms of this model, computed once at load time.
extern "C" __global__ void rmsnorm(const bf16* __restrict__ x, const float* __restrict__ w,
                                   bf16* __restrict__ y, int rows, int n, float eps) {
    const int row = norm_row(), lane = threadIdx.x % 32, nvec = n / 8;
    if (rows <= DECODE_ROWS)
        for (int v = lane; v < nvec; v += 32) prefetch_l1(w + 8 * v);
    pdl_wait();
    pdl_launch_dependents();
    if (row >= rows) return;
    const uint4* xr = reinterpret_cast<const uint4*>(x + (u64)row * n);
    uint4* yr = reinterpret_cast<uint4*>(y + (u64)row * n);
    const float r = rsqrtf(sum_squares(xr, nvec, lane) / n + eps);
    for (int v = lane; v < nvec; v += 32) yr[v] = norm_vec8(xr[v], w, v, r);
}

// The residual add fused with the next norm, one block of RES_THREADS per row (norm.cuh).
#define RES_THREADS 256  // must match RES_THREADS in norm.rs
extern "C" __global__ void __launch_bounds__(RES_THREADS)
residual_rmsnorm(bf16* __restrict__ h, const bf16* __restrict__ parts, const float* __restrict__ weights, int k,
                 const float* __restrict__ w, bf16* __restrict__ y, int rows, int n, float eps) {
    if (rows <= DECODE_ROWS)
        for (int v = threadIdx.x; v < n / 8; v += RES_THREADS) prefetch_l1(w + 8 * v);
    pdl_wait();
    pdl_launch_dependents();
    __shared__ float warp_ss[RES_THREADS / 32];
    const int row = blockIdx.x;
    bf16* hr = h + (u64)row * n;
    residual_rmsnorm_row<9>(hr, parts + (u64)row * k * n, weights ? weights + (u64)row * k : nullptr, k, w, hr,
                         y + (u64)row * n, n, eps, warp_ss);
}

// The GDN output norm (MODEL.md §3.6.7), per value head (row of n = 128 values):
//   t = bf16(o * rsqrt(mean(o²) + eps));  u = bf16(w * t);  y = bf16(u * silu(z))
// `w` is the plain stored weight (this norm is not zero-centred), as fp32. The two intermediate
// roundings to bf16 are the reference's; keeping them makes the result match it more closely.
extern "C" __global__ void gated_rmsnorm(const bf16* __restrict__ o, const bf16* __restrict__ z,
                                         const float* __restrict__ w, bf16* __restrict__ y, int rows,
                                         int n, float eps) {
    pdl_wait();
    pdl_launch_dependents();
    const int row = norm_row(), lane = threadIdx.x % 32, nvec = n / 8;
    if (row >= rows) return;
    const uint4* orow = reinterpret_cast<const uint4*>(o + (u64)row * n);
    const uint4* zrow = reinterpret_cast<const uint4*>(z + (u64)row * n);
    uint4* yr = reinterpret_cast<uint4*>(y + (u64)row * n);
    const float r = rsqrtf(sum_squares(orow, nvec, lane) / n + eps);
    for (int v = lane; v < nvec; v += 32) {
        float f[8], g[8];
        unpack8(orow[v], f);
        unpack8(zrow[v], g);
        const float4 w0 = reinterpret_cast<const float4*>(w)[2 * v];
        const float4 w1 = reinterpret_cast<const float4*>(w)[2 * v + 1];
        const float wv[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = bf16_round(wv[i] * bf16_round(f[i] * r)) * silu(g[i]);
        yr[v] = pack8(f);
    }
}
