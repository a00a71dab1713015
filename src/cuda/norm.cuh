// The residual add fused with the next norm, for one row, shared by its kernel (norm.cu) and by the
// decode GEMV that computes its own input this way (gemm.cu), so that both give the same bits:
//   r = bf16(Σ_j weights[j] · parts[j])   (weights null: k = 1, r = parts[0])
//   hn = bf16(h + r), written to `hn` (may be h itself);   y = rmsnorm(hn) · w, of the rounded hn
//   as the reference does.
// With k > 1 this is also the MoE combine: parts are the 8 routed experts' outputs and the shared
// expert's, weights their router probabilities and sigmoid(shared gate). All threads of the block
// take part (thread i: vectors i, i + blockDim.x, ...; each reads back only what it wrote);
// `warp_ss` is shared scratch of blockDim.x / 32 floats. h, hn and y may be global or shared.
#pragma once
#include "common.cuh"

// The 8 values of a vector normalised: bf16(x · r · w) in the reference's order, for w0, w1 the
// norm's fp32 weights of those 8 columns (loaded by the caller: the router's GEMV loads them
// beside x, gemm.cu NORM_IN).
__device__ __forceinline__ uint4 norm_vec8(uint4 x, float4 w0, float4 w1, float r) {
    float f[8];
    unpack8(x, f);
    const float wv[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = f[i] * r * wv[i];
    return pack8(f);
}

// The same for vector v of a row, its weights read from w (rmsnorm in norm.cu and
// residual_rmsnorm_row below).
__device__ __forceinline__ uint4 norm_vec8(uint4 x, const float* __restrict__ w, int v, float r) {
    const float4* w4 = reinterpret_cast<const float4*>(w);
    return norm_vec8(x, w4[2 * v], w4[2 * v + 1], r);
}

// MAX_PARTS: how many parts' loads are put in flight at once, before any is summed (the rest, if
// k is larger, in turn); the kernel of norm.cu takes 9 (the 8 routed experts and the shared one:
// one memory latency instead of nine, bench/NOTES.md v1.47), the decode GEMV 0 (its registers).
template <int MAX_PARTS>
__device__ __forceinline__ void residual_rmsnorm_row(const bf16* h, const bf16* __restrict__ parts,
                                                     const float* __restrict__ weights, int k,
                                                     const float* __restrict__ w, bf16* hn, bf16* y, int n,
                                                     float eps, float* warp_ss) {
    const int nvec = n / 8, threads = blockDim.x;
    const uint4* hr = reinterpret_cast<const uint4*>(h);
    uint4* hw = reinterpret_cast<uint4*>(hn);
    const uint4* pr = reinterpret_cast<const uint4*>(parts);
    uint4* yr = reinterpret_cast<uint4*>(y);
    float ss = 0.0f;
    for (int v = threadIdx.x; v < nvec; v += threads) {
        // The first MAX_PARTS parts' loads issued before any is used; the sum keeps its order.
        uint4 pv[MAX_PARTS > 0 ? MAX_PARTS : 1];
#pragma unroll
        for (int j = 0; j < MAX_PARTS; ++j)
            if (j < k) pv[j] = pr[(u64)j * nvec + v];
        uint4 hv;
        if constexpr (MAX_PARTS > 0) hv = hr[v];
        float acc[8], f[8];
        for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
#pragma unroll
        for (int j = 0; j < MAX_PARTS; ++j) {
            if (j >= k) break;
            const float wj = weights ? weights[j] : 1.0f;
            unpack8(pv[j], f);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[i] += wj * f[i];
        }
        for (int j = MAX_PARTS; j < k; ++j) {  // the parts beyond MAX_PARTS, in turn
            const float wj = weights ? weights[j] : 1.0f;
            unpack8(pr[(u64)j * nvec + v], f);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[i] += wj * f[i];
        }
        unpack8(pack8(acc), acc);  // r in bf16
        if constexpr (MAX_PARTS == 0) hv = hr[v];
        unpack8(hv, f);
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] += acc[i];
        const uint4 sum = pack8(f);
        hw[v] = sum;
        unpack8(sum, f);
#pragma unroll
        for (int i = 0; i < 8; ++i) ss += f[i] * f[i];
    }
    ss = warp_sum(ss);
    if (threadIdx.x % 32 == 0) warp_ss[threadIdx.x / 32] = ss;
    __syncthreads();
    ss = 0.0f;
    for (int i = 0; i < threads / 32; ++i) ss += warp_ss[i];
    const float r = rsqrtf(ss / n + eps);
    // Each thread re-reads only the vectors it wrote itself.
    for (int v = threadIdx.x; v < nvec; v += threads) yr[v] = norm_vec8(hw[v], w, v, r);
}
