// MoE routing and combine on the device (spec/MODEL.md §3.7), so decode never waits on the host.
#include "moe.cuh"

// One warp per token: router_topk_row (moe.cuh). logits [T][pitch], each row experts + shared
// values then padding (cuBLAS's aligned output, dense.rs); ids [T][k + shared] i32, weights f32.
extern "C" __global__ void router_topk(const bf16* __restrict__ logits, int pitch, int tokens, int experts, int k,
                                       int shared, int* __restrict__ ids, float* __restrict__ weights) {
    // Dependents start only after this wait: the experts' gate‖up after it reads its x (written
    // two launches back) before its own wait (gemm.rs, then_routed_gate_up).
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
// does not depend on scheduling), and a map of row tiles {expert, first position, rows}. Two
// small launches, no host round trip:
//   1. moe_group_count:   per chunk of GROUP_CHUNK pairs, how many go to each expert;
//   2. moe_group_scatter: per chunk, every chunk's counts summed per expert (the chunks before
//                         this one, and all): each expert's first position (an exclusive sum over
//                         experts) plus this chunk's start within it; each pair's rank among the
//                         same expert's pairs of the chunk before it (within its warp by
//                         __match_any_sync, across warps by per-warp counts) gives its position;
//                         sorted[position] = p. Block 0 also writes the tile map. (Every block
//                         repeats the sums, a few loads per thread: cheaper than a one-block scan
//                         launch between the two, whose loop over the chunks was a latency chain.)
// Positions: expert e's pairs occupy [offset_e, offset_e + count_e), ordered by p, hence by token.
#define GROUP_CHUNK 1024     // pairs per block of both launches (one per thread)
#define GROUP_MAX_EXPERTS 288  // 256 routed + the shared expert, rounded up to whole warps
#define GROUP_WARPS (GROUP_CHUNK / 32)

// Pair p's expert, clamped. Through L2 (__ldcg), as the GEMVs read the slot table: the ids were
// written by the launch just before, and a read-only (non-coherent) load could find a line of an
// earlier layer's ids in this SM's L1.
__device__ __forceinline__ int expert_of(const int* ids, int p, int experts) {
    return min(max(__ldcg(ids + p), 0), experts - 1);
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

// Exclusive sum over the block (one value per thread, any whole number of warps ≤ 32); `total`
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

// The tile map of one grouping, from thread e's expert (e < experts) count and first position:
// tiles[i] = {expert, first position, rows, 0} for every tile of tile_rows rows, experts in order,
// where an expert's last tile also takes a remainder of up to `spill` rows (rather than a tile of
// its own); *num_tiles = how many. Every thread of the block calls it.
__device__ void write_tiles(int count, int offset, int experts, int tile_rows, int spill, int max_tiles, int* scratch,
                            int4* tiles, int* num_tiles) {
    const int e = threadIdx.x;
    // ⌈(count − spill) / tile_rows⌉ tiles, at least one for a non-empty expert (C division
    // truncates toward zero, so a negative numerator gives 0 or less).
    const int ntiles = count == 0 ? 0 : max(1, (count - spill + tile_rows - 1) / tile_rows);
    int total_tiles;
    const int first_tile = block_exclusive_sum(ntiles, scratch, &total_tiles);
    if (e < experts) {
        for (int i = 0; i < ntiles && first_tile + i < max_tiles; ++i)
            tiles[first_tile + i] =
                make_int4(e, offset + i * tile_rows, i + 1 < ntiles ? tile_rows : count - i * tile_rows, 0);
    }
    if (e == 0) *num_tiles = min(total_tiles, max_tiles);
}

// sorted[position of pair p] = p, and (block 0) the tile map. Grid: chunks; block: GROUP_CHUNK
// threads; counts [chunks][experts] from moe_group_count.
extern "C" __global__ void moe_group_scatter(const int* __restrict__ ids, int pairs, int experts,
                                             const int* __restrict__ counts, int tile_rows, int spill,
                                             int max_tiles, int4* __restrict__ tiles, int* __restrict__ num_tiles,
                                             int* __restrict__ sorted) {
    __shared__ int warp_counts[GROUP_WARPS][GROUP_MAX_EXPERTS];  // pairs of each warp per expert
    __shared__ int before_s[GROUP_MAX_EXPERTS], total_s[GROUP_MAX_EXPERTS];
    __shared__ int scratch[GROUP_WARPS];
    for (int i = threadIdx.x; i < GROUP_WARPS * GROUP_MAX_EXPERTS; i += blockDim.x) (&warp_counts[0][0])[i] = 0;
    for (int e = threadIdx.x; e < GROUP_MAX_EXPERTS; e += blockDim.x) before_s[e] = total_s[e] = 0;
    // The ids came from router_topk, two launches back: moe_group_count has waited for it before
    // this grid could start, so this chunk's ranks are made before the wait for the counts.
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int p = blockIdx.x * GROUP_CHUNK + threadIdx.x;
    const bool valid = p < pairs;
    const int e = valid ? expert_of(ids, p, experts) : -1;  // -1: a group of its own, never stored
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const int rank = __popc(peers & ((1u << lane) - 1u));  // same-expert lanes below this one
    __syncthreads();
    if (valid && rank == 0) warp_counts[warp][e] = __popc(peers);
    pdl_wait();
    pdl_launch_dependents();
    // Per expert: the pairs of the chunks before this one, and of all; SCAN_BATCH independent
    // loads in flight per thread.
    constexpr int SCAN_BATCH = 4;
    const int n = gridDim.x * experts;
    for (int i0 = threadIdx.x; i0 < n; i0 += SCAN_BATCH * GROUP_CHUNK) {
        int v[SCAN_BATCH];
#pragma unroll
        for (int j = 0; j < SCAN_BATCH; ++j) {
            const int i = i0 + j * GROUP_CHUNK;
            v[j] = i < n ? counts[i] : 0;
        }
#pragma unroll
        for (int j = 0; j < SCAN_BATCH; ++j) {
            const int i = i0 + j * GROUP_CHUNK;
            if (i >= n || v[j] == 0) continue;
            const int c = i / experts, ex = i - c * experts;
            atomicAdd(&total_s[ex], v[j]);
            if (c < (int)blockIdx.x) atomicAdd(&before_s[ex], v[j]);
        }
    }
    __syncthreads();
    const int count = threadIdx.x < experts ? total_s[threadIdx.x] : 0;
    int total_pairs;
    const int offset = block_exclusive_sum(count, scratch, &total_pairs);
    if (threadIdx.x < experts) before_s[threadIdx.x] += offset;  // this chunk's first position per expert
    if (blockIdx.x == 0) write_tiles(count, offset, experts, tile_rows, spill, max_tiles, scratch, tiles, num_tiles);
    __syncthreads();
    if (valid) {
        int before = 0;
        for (int w = 0; w < warp; ++w) before += warp_counts[w][e];
        sorted[before_s[e] + before + rank] = p;
    }
}

// ---- Slots of the decode GEMVs' gathered mode (gemm.cu) for a pass of a few dozen rows ----
//
// T tokens route P = T·S pairs p = token·S + slot (ids [T][S], the shared expert included). Each
// expert's pairs, in token order, are cut into GEMV slots of at most SLOT_TOKENS (the mma's N):
// table[s] = {expert, tokens, token of each (its row of x for gate‖up), pair of each (its row of
// the outputs)}, experts in order; slots from the count up to max_slots get 0 tokens. An expert's
// tokens are one bit each in a mask, so a pair's rank among its expert's pairs is a popcount. The
// mask words are 32-bit: shared-memory atomicOr on 64-bit words is a compare-and-swap loop, which
// the shared expert's pairs (one a token, all on one word) ran in turn (bench/NOTES.md v1.77).
// One block of GROUP_MAX_EXPERTS threads (thread e counts expert e); T ≤ SLOT_MAX_TOKENS.
#define SLOT_TOKENS 8
#define SLOT_WORDS (2 + 2 * SLOT_TOKENS)
#define SLOT_MAX_TOKENS 256
#define SLOT_MASK_WORDS (SLOT_MAX_TOKENS / 32)

extern "C" __global__ void moe_slot_table(const int* __restrict__ ids, int tokens, int per_token, int experts,
                                          int max_slots, int* __restrict__ table) {
    pdl_wait();
    pdl_launch_dependents();
    __shared__ unsigned int mask[GROUP_MAX_EXPERTS][SLOT_MASK_WORDS];
    __shared__ int first_slot[GROUP_MAX_EXPERTS], count[GROUP_MAX_EXPERTS];
    __shared__ int scratch[GROUP_MAX_EXPERTS / 32];
    for (int i = threadIdx.x; i < GROUP_MAX_EXPERTS * SLOT_MASK_WORDS; i += blockDim.x) (&mask[0][0])[i] = 0u;
    __syncthreads();
    const int pairs = min(tokens, SLOT_MAX_TOKENS) * per_token;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int n = p / per_token;
        atomicOr(&mask[expert_of(ids, p, experts)][n / 32], 1u << (n % 32));
    }
    __syncthreads();
    const int e = threadIdx.x;
    int c = 0;
    if (e < experts) {
#pragma unroll
        for (int w = 0; w < SLOT_MASK_WORDS; ++w) c += __popc(mask[e][w]);
        count[e] = c;
    }
    int total;
    const int first = block_exclusive_sum((c + SLOT_TOKENS - 1) / SLOT_TOKENS, scratch, &total);
    if (e < experts) first_slot[e] = first;
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int n = p / per_token, ex = expert_of(ids, p, experts);
        int rank = __popc(mask[ex][n / 32] & ((1u << (n % 32)) - 1u));
        for (int w = 0; w < n / 32; ++w) rank += __popc(mask[ex][w]);
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
