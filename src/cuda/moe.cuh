// Router top-k for one token: router_topk_row for its kernel (moe.cu) and the persistent decode MoE
// (moe_decode.cu); router_topk_row_by_probability, the form it replaced, for the router's decode
// GEMV whose last block can rank (gemm.cu, `LILY_FUSED_TOPK=1`): its code is inlined in every GEMV
// kernel, whose speed has moved with any edit of their source (bench/NOTES.md v1.55, v1.65), so
// it stays as it was. Both pick the same experts (the largest logits, the lowest index among equals)
// except where the old form's probabilities underflow to equal zeros, with the same weights to
// rounding. (Their shared-expert slot is written out in each on purpose: a helper for it moved the
// GEMV kernels' register allocation.)
#pragma once
#include "common.cuh"

#define NEG_INF __int_as_float(0xff800000)
#define MAX_EXPERTS_PER_LANE 8  // 256 experts / 32 lanes
#define MAX_TOP_K 16

// One warp: the top `k` of `experts` router logits of `row` (k ≤ 16; the largest, the lowest index
// among equals) and their softmax weights renormalised over the k: the full softmax's denominator
// cancels, w_i = e^(l_i − l_max) / Σ_top e^(l_j − l_max). `shared`: as for the form below. Each round is
// one unsigned max over the warp (redux) of per-logit keys: the bf16 bits made order-preserving
// (negative: all bits flipped; positive: the sign bit set) above 0xFFFF − index. The form below
// ranked probabilities with two reductions and a division per round: 2.9 µs for a token against 1.4
// (bench/NOTES.md v1.65).
__device__ __forceinline__ void router_topk_row(const bf16* __restrict__ row, int experts, int k, int shared,
                                                int* __restrict__ ids, float* __restrict__ weights) {
    const int lane = threadIdx.x % 32;
    u32 key[MAX_EXPERTS_PER_LANE];
#pragma unroll
    for (int j = 0; j < MAX_EXPERTS_PER_LANE; ++j) {
        const int e = lane + 32 * j;
        // Through L2 (__ldcg): the row was written by other blocks.
        const u32 b = e < experts ? __ldcg(reinterpret_cast<const unsigned short*>(row) + e) : 0u;
        const u32 ord = (b & 0x8000u) ? (~b & 0xFFFFu) : (b | 0x8000u);
        key[j] = e < experts ? (ord << 16) | (0xFFFFu - e) : 0u;  // 0: no expert (below every key)
    }
    u32 mine = 0;  // lane r: the key chosen in round r
    for (int r = 0; r < k; ++r) {
        u32 m = max(max(max(key[0], key[1]), max(key[2], key[3])), max(max(key[4], key[5]), max(key[6], key[7])));
        const u32 best = __reduce_max_sync(0xffffffffu, m);
#pragma unroll
        for (int j = 0; j < MAX_EXPERTS_PER_LANE; ++j) key[j] = key[j] == best ? 0u : key[j];
        if (lane == r) mine = best;
    }
    const u32 ord = mine >> 16;
    const u32 bits = (ord & 0x8000u) ? (ord & 0x7FFFu) : (~ord & 0xFFFFu);
    const float logit = __uint_as_float(bits << 16);
    const float top = __shfl_sync(0xffffffffu, logit, 0);
    const float p = lane < k ? expf(logit - top) : 0.0f;
    float sum = p;
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);  // lanes 0..15
    if (lane < k) {
        ids[lane] = (int)(0xFFFFu - (mine & 0xFFFFu));
        weights[lane] = p / sum;
    }
    if (shared && lane == 0) {
        ids[k] = experts;
        const float gate = __bfloat162float(__ushort_as_bfloat16(__ldcg(reinterpret_cast<const unsigned short*>(row) + experts)));
        weights[k] = 1.0f / (1.0f + expf(-gate));
    }
}

// One warp: softmax (fp32) over `experts` router logits of `row`, the top `k` probabilities
// (lowest index on ties), renormalised to sum to 1. With `shared` set, the row has one more value,
// the shared expert's gate logit, and the shared expert becomes slot k: expert id `experts`,
// weight sigmoid(gate logit) (MODEL.md §3.7), so that the experts' GEMVs and the combine treat it
// like a routed one. Writes ids[0 .. k + shared] and weights[...] of this token.
__device__ __forceinline__ void router_topk_row_by_probability(const bf16* __restrict__ row, int experts, int k,
                                                               int shared, int* __restrict__ ids,
                                                               float* __restrict__ weights) {
    const int lane = threadIdx.x % 32;
    float p[MAX_EXPERTS_PER_LANE];
    float mx = NEG_INF;
#pragma unroll
    for (int j = 0; j < MAX_EXPERTS_PER_LANE; ++j) {
        const int e = lane + 32 * j;
        // Through L2 (__ldcg): in the router's GEMV the row was written by other blocks.
        p[j] = e < experts ? __bfloat162float(__ushort_as_bfloat16(__ldcg(reinterpret_cast<const unsigned short*>(row) + e))) : NEG_INF;
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
    // k rounds of a warp-wide argmax (the largest p, the lowest index among equals); the winner is
    // removed from its lane's list (p = −1). Each round: the lane's own best, then one redux for
    // the largest value and one for the lowest index holding it (p ≥ 0 or −1: as int bits, the
    // same order as the floats; two reduxes cost less than a 5-step shuffle argmax of pairs).
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
        const int best = __reduce_max_sync(0xffffffffu, __float_as_int(v));
        e = __reduce_min_sync(0xffffffffu, __float_as_int(v) == best ? (unsigned)e : 0x7fffffffu);
        v = __int_as_float(best);
#pragma unroll
        for (int j = 0; j < MAX_EXPERTS_PER_LANE; ++j) {
            if (lane + 32 * j == e) p[j] = -1.0f;  // taken
        }
        if (lane == r) { chosen_p = v / sum; chosen_e = e; }
        chosen_sum += v / sum;
    }
    if (lane < k) {
        ids[lane] = chosen_e;
        weights[lane] = chosen_p / chosen_sum;
    }
    if (shared && lane == 0) {
        ids[k] = experts;
        const float gate = __bfloat162float(__ushort_as_bfloat16(__ldcg(reinterpret_cast<const unsigned short*>(row) + experts)));
        weights[k] = 1.0f / (1.0f + expf(-gate));
    }
}
