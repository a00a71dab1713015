// MoE routing and combine on the device (spec/MODEL.md §3.7), so decode never waits on the host.
#include "common.cuh"

#define NEG_INF __int_as_float(0xff800000)
#define MAX_EXPERTS_PER_LANE 8  // 256 experts / 32 lanes
#define MAX_TOP_K 16

// One warp per token: softmax (fp32) over `experts` router logits, the top `k` probabilities
// (lowest index on ties), renormalised to sum to 1. ids [T][k] i32, weights [T][k] f32.
extern "C" __global__ void router_topk(const bf16* __restrict__ logits, int tokens, int experts, int k,
                                       int* __restrict__ ids, float* __restrict__ weights) {
    const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (t >= tokens) return;
    const bf16* row = logits + (u64)t * experts;
    float p[MAX_EXPERTS_PER_LANE];
    float mx = NEG_INF;
#pragma unroll
    for (int j = 0; j < MAX_EXPERTS_PER_LANE; ++j) {
        const int e = lane + 32 * j;
        p[j] = e < experts ? __bfloat162float(row[e]) : NEG_INF;
        mx = fmaxf(mx, p[j]);
    }
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < MAX_EXPERTS_PER_LANE; ++j) {
        p[j] = (lane + 32 * j) < experts ? expf(p[j] - mx) : 0.0f;
        sum += p[j];
    }
    sum = warp_sum(sum);
    // k rounds of a warp-wide argmax; the winner is removed from its lane's list.
    float chosen_p = 0.0f, chosen_sum = 0.0f;
    int chosen_e = 0;
    for (int r = 0; r < k; ++r) {
        float v = -1.0f;
        int e = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < MAX_EXPERTS_PER_LANE; ++j) {
            const int ej = lane + 32 * j;
            if (ej < experts && (p[j] > v || (p[j] == v && ej < e))) { v = p[j]; e = ej; }
        }
        for (int off = 16; off > 0; off >>= 1) {
            const float v2 = __shfl_xor_sync(0xffffffffu, v, off);
            const int e2 = __shfl_xor_sync(0xffffffffu, e, off);
            if (v2 > v || (v2 == v && e2 < e)) { v = v2; e = e2; }
        }
#pragma unroll
        for (int j = 0; j < MAX_EXPERTS_PER_LANE; ++j) {
            if (lane + 32 * j == e) p[j] = -1.0f;  // taken
        }
        if (lane == r) { chosen_p = v / sum; chosen_e = e; }
        chosen_sum += v / sum;
    }
    if (lane < k) {
        ids[(u64)t * k + lane] = chosen_e;
        weights[(u64)t * k + lane] = chosen_p / chosen_sum;
    }
}

// out[t] = bf16( Σ_j w[t][j] · routed[t][j] + sigmoid(gate[t]) · shared[t] ), fp32 inside.
// routed [T][k][n], shared [T][n], gate [T] (the shared-expert gate's logit), out [T][n].
extern "C" __global__ void moe_combine(const bf16* __restrict__ routed, const float* __restrict__ weights,
                                       const bf16* __restrict__ shared, const bf16* __restrict__ gate,
                                       bf16* __restrict__ out, int tokens, int k, int n) {
    const int nvec = n / 8;
    const u64 total = (u64)tokens * nvec;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const int t = i / nvec, v = i % nvec;
        float acc[8], f[8];
        const float g = 1.0f / (1.0f + expf(-__bfloat162float(gate[t])));
        unpack8(reinterpret_cast<const uint4*>(shared + (u64)t * n)[v], f);
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[q] = g * f[q];
        for (int j = 0; j < k; ++j) {
            const float w = weights[(u64)t * k + j];
            unpack8(reinterpret_cast<const uint4*>(routed + ((u64)t * k + j) * n)[v], f);
#pragma unroll
            for (int q = 0; q < 8; ++q) acc[q] += w * f[q];
        }
        reinterpret_cast<uint4*>(out + (u64)t * n)[v] = pack8(acc);
    }
}
