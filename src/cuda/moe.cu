// MoE routing and combine on the device (spec/MODEL.md §3.7), so decode never waits on the host.
#include "moe.cuh"

// One warp per token: router_topk_row (moe.cuh). logits [T][pitch], each row experts + shared
// values then padding (cuBLAS's aligned output, dense.rs); ids [T][k + shared] i32, weights f32.
extern "C" __global__ void router_topk(const bf16* __restrict__ logits, int pitch, int tokens, int experts, int k,
                                       int shared, int* __restrict__ ids, float* __restrict__ weights) {
    pdl_wait();
    pdl_launch_dependents();
    const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (t >= tokens) return;
    const int out = t * (k + shared);
    router_topk_row(logits + (u64)t * pitch, experts, k, shared, ids + out, weights + out);
}

// ---- Grouping (token, slot) pairs by expert for the grouped expert GEMMs (gemm_prefill.cu) ----
//
// A prefill chunk of T tokens routes P = T·k pairs p = token·k + slot (ids [T][k] from
// router_topk). The expert GEMMs want each expert's pairs contiguous, in token order (so the result
// does not depend on scheduling), and a map of row tiles {expert, first position, rows}. Three
// small launches, no host round trip:
//   1. moe_group_count:   per chunk of GROUP_CHUNK pairs, how many go to each expert;
//   2. moe_group_scan:    one block: per expert, the exclusive sums over chunks; over experts, the
//                         first position of each expert and of its tiles; writes the tile map;
//   3. moe_group_scatter: per chunk, each pair's rank among the same expert's pairs before it
//                         (within its warp by __match_any_sync, across warps by per-warp counts),
//                         giving its position; sorted[position] = p.
// Positions: expert e's pairs occupy [offset_e, offset_e + count_e), ordered by p, hence by token.
#define GROUP_CHUNK 1024     // pairs per block of passes 1 and 3 (one per thread)
#define GROUP_MAX_EXPERTS 288  // 256 routed + the shared expert, rounded up to whole warps
#define GROUP_WARPS (GROUP_CHUNK / 32)

__device__ __forceinline__ int expert_of(const int* ids, int p, int experts) {
    return min(max(ids[p], 0), experts - 1);
}

// counts[c][e] = pairs of chunk c routed to expert e. Grid: chunks; block: GROUP_CHUNK threads.
extern "C" __global__ void moe_group_count(const int* __restrict__ ids, int pairs, int experts,
                                           int* __restrict__ counts) {
    pdl_wait();
    pdl_launch_dependents();
    __shared__ int hist[GROUP_MAX_EXPERTS];
    for (int e = threadIdx.x; e < experts; e += blockDim.x) hist[e] = 0;
    __syncthreads();
    const int p = blockIdx.x * GROUP_CHUNK + threadIdx.x;
    if (p < pairs) atomicAdd(&hist[expert_of(ids, p, experts)], 1);
    __syncthreads();
    for (int e = threadIdx.x; e < experts; e += blockDim.x) counts[blockIdx.x * experts + e] = hist[e];
}

// Exclusive sum over the block (one value per thread, blockDim.x = GROUP_MAX_EXPERTS); `total`
// gets the sum of all. `scratch` holds one int per warp; the caller's barriers separate uses.
__device__ int block_exclusive_sum(int v, int* scratch, int* total) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    int x = v;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, off);
        if (lane >= off) x += y;
    }
    if (lane == 31) scratch[warp] = x;
    __syncthreads();
    int before = 0, all = 0;
    for (int w = 0; w < warps; ++w) {
        const int s = scratch[w];
        if (w < warp) before += s;
        all += s;
    }
    __syncthreads();  // scratch may be reused right after
    *total = all;
    return before + x - v;
}

// One block of GROUP_MAX_EXPERTS threads (thread e = expert e). In place, counts[c][e] becomes the
// position of chunk c's first pair for expert e. tiles[i] = {expert, first position, rows, 0} for
// every tile of tile_rows rows, experts in order, where an expert's last tile also takes a
// remainder of up to `spill` rows (rather than a tile of its own); *num_tiles = how many.
extern "C" __global__ void moe_group_scan(int* __restrict__ counts, int chunks, int experts, int tile_rows,
                                          int spill, int max_tiles, int4* __restrict__ tiles,
                                          int* __restrict__ num_tiles) {
    pdl_wait();
    pdl_launch_dependents();
    __shared__ int scratch[GROUP_MAX_EXPERTS / 32];
    const int e = threadIdx.x;
    const bool real = e < experts;
    // Two passes over the chunks, SCAN_BATCH loads in flight at a time (independent loads issued
    // together, then used: one memory latency per batch, not per chunk): the expert's total, then,
    // once the offsets are known, the exclusive sums written back with the offset added.
    constexpr int SCAN_BATCH = 8;
    int count = 0;
    if (real) {
        for (int c0 = 0; c0 < chunks; c0 += SCAN_BATCH) {
            int v[SCAN_BATCH];
#pragma unroll
            for (int i = 0; i < SCAN_BATCH; ++i) v[i] = c0 + i < chunks ? counts[(c0 + i) * experts + e] : 0;
#pragma unroll
            for (int i = 0; i < SCAN_BATCH; ++i) count += v[i];
        }
    }
    // ⌈(count − spill) / tile_rows⌉ tiles, at least one for a non-empty expert (C division
    // truncates toward zero, so a negative numerator gives 0 or less).
    const int ntiles = count == 0 ? 0 : max(1, (count - spill + tile_rows - 1) / tile_rows);
    int total_pairs, total_tiles;
    const int offset = block_exclusive_sum(count, scratch, &total_pairs);
    const int first_tile = block_exclusive_sum(ntiles, scratch, &total_tiles);
    if (real) {
        int position = offset;
        for (int c0 = 0; c0 < chunks; c0 += SCAN_BATCH) {
            int v[SCAN_BATCH];
#pragma unroll
            for (int i = 0; i < SCAN_BATCH; ++i) v[i] = c0 + i < chunks ? counts[(c0 + i) * experts + e] : 0;
#pragma unroll
            for (int i = 0; i < SCAN_BATCH; ++i) {
                if (c0 + i < chunks) counts[(c0 + i) * experts + e] = position;
                position += v[i];
            }
        }
        for (int i = 0; i < ntiles && first_tile + i < max_tiles; ++i)
            tiles[first_tile + i] =
                make_int4(e, offset + i * tile_rows, i + 1 < ntiles ? tile_rows : count - i * tile_rows, 0);
    }
    if (e == 0) *num_tiles = min(total_tiles, max_tiles);
}

// sorted[position of pair p] = p. Grid: chunks; block: GROUP_CHUNK threads. `base` from moe_group_scan.
extern "C" __global__ void moe_group_scatter(const int* __restrict__ ids, int pairs, int experts,
                                             const int* __restrict__ base, int* __restrict__ sorted) {
    pdl_wait();
    pdl_launch_dependents();
    __shared__ int warp_counts[GROUP_WARPS][GROUP_MAX_EXPERTS];  // pairs of each warp per expert
    for (int i = threadIdx.x; i < GROUP_WARPS * GROUP_MAX_EXPERTS; i += blockDim.x) (&warp_counts[0][0])[i] = 0;
    __syncthreads();
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int p = blockIdx.x * GROUP_CHUNK + threadIdx.x;
    const bool valid = p < pairs;
    const int e = valid ? expert_of(ids, p, experts) : -1;  // -1: a group of its own, never stored
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const int rank = __popc(peers & ((1u << lane) - 1u));  // same-expert lanes below this one
    if (valid && rank == 0) warp_counts[warp][e] = __popc(peers);
    __syncthreads();
    if (valid) {
        int before = 0;
        for (int w = 0; w < warp; ++w) before += warp_counts[w][e];
        sorted[base[blockIdx.x * experts + e] + before + rank] = p;
    }
}

// ---- Slots of the decode GEMVs' gathered mode (gemm.cu) for a pass of a few dozen rows ----
//
// T tokens route P = T·S pairs p = token·S + slot (ids [T][S], the shared expert included). Each
// expert's pairs, in token order, are cut into GEMV slots of at most SLOT_TOKENS (the mma's N):
// table[s] = {expert, tokens, token of each (its row of x for gate‖up), pair of each (its row of
// the outputs)}, experts in order; slots from the count up to max_slots get 0 tokens. An expert's
// tokens are one bit each in a mask, so a pair's rank among its expert's pairs is a popcount.
// One block of GROUP_MAX_EXPERTS threads (thread e counts expert e); T ≤ SLOT_MAX_TOKENS.
#define SLOT_TOKENS 8
#define SLOT_WORDS (2 + 2 * SLOT_TOKENS)
#define SLOT_MAX_TOKENS 256
#define SLOT_MASK_WORDS (SLOT_MAX_TOKENS / 64)

extern "C" __global__ void moe_slot_table(const int* __restrict__ ids, int tokens, int per_token, int experts,
                                          int max_slots, int* __restrict__ table) {
    pdl_wait();
    pdl_launch_dependents();
    __shared__ unsigned long long mask[GROUP_MAX_EXPERTS][SLOT_MASK_WORDS];
    __shared__ int first_slot[GROUP_MAX_EXPERTS], count[GROUP_MAX_EXPERTS];
    __shared__ int scratch[GROUP_MAX_EXPERTS / 32];
    for (int i = threadIdx.x; i < GROUP_MAX_EXPERTS * SLOT_MASK_WORDS; i += blockDim.x) (&mask[0][0])[i] = 0ull;
    __syncthreads();
    const int pairs = min(tokens, SLOT_MAX_TOKENS) * per_token;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int n = p / per_token;
        atomicOr(&mask[expert_of(ids, p, experts)][n / 64], 1ull << (n % 64));
    }
    __syncthreads();
    const int e = threadIdx.x;
    int c = 0;
    if (e < experts) {
#pragma unroll
        for (int w = 0; w < SLOT_MASK_WORDS; ++w) c += __popcll(mask[e][w]);
        count[e] = c;
    }
    int total;
    const int first = block_exclusive_sum((c + SLOT_TOKENS - 1) / SLOT_TOKENS, scratch, &total);
    if (e < experts) first_slot[e] = first;
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int n = p / per_token, ex = expert_of(ids, p, experts);
        int rank = __popcll(mask[ex][n / 64] & ((1ull << (n % 64)) - 1ull));
        for (int w = 0; w < n / 64; ++w) rank += __popcll(mask[ex][w]);
        const int slot = first_slot[ex] + rank / SLOT_TOKENS, pos = rank % SLOT_TOKENS;
        if (slot >= max_slots) continue;
        int* entry = table + slot * SLOT_WORDS;
        entry[2 + pos] = n;
        entry[2 + SLOT_TOKENS + pos] = p;
        if (pos == 0) {
            entry[0] = ex;
            entry[1] = min(SLOT_TOKENS, count[ex] - rank);
        }
    }
    for (int s = total + threadIdx.x; s < max_slots; s += blockDim.x) table[s * SLOT_WORDS + 1] = 0;
}
