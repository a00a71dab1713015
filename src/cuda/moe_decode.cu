// moe_decode_step: the MoE block of one decode token as one persistent kernel (moe_decode.rs;
// bench/NOTES.md "Plan — decode as one persistent kernel" and v1.40): router GEMV, top-k, the
// experts' gate‖up GEMVs, their down GEMVs, with the outputs the launch-per-op path leaves
// (forward/experts.rs): ids and weights [9], routed [9][2048]; the combine that follows is unchanged.
//
// Qwen3.6-35B-A3B's shapes: hidden 2048, expert width I = 512, 256 experts + the shared one (id 256,
// always slot 8), top-8. Router ‖ shared gate: MLX affine Q8 [257][2048]; experts: Q4 gate‖up
// [257][1024][2048] and down [257][2048][512], group 64 (MODEL.md §5.1: value k of a word at bits
// 4k (8k), w = s·q + b with bf16 s and b).
//
// Grid: one block per SM (all resident: the tasks wait on each other). The step is a list of tasks,
// the router, top-k and gate‖up tasks run by block i % gridDim.x, the down tasks in contiguous runs
// (a block's run covers one or two slots, so it builds each slot's SwiGLU input once); each block
// runs its tasks in increasing order:
//   router   68 tasks: 16 rows × 512 columns of the router (4 column splits), partial sums;
//   top-k    1 task: the partial sums added and rounded to bf16 as logits, router_topk_row (moe.cuh);
//   gate‖up  576 tasks: 16 rows × 2048 of one slot's expert (the shared slot first: it needs no ids);
//   down     1152 tasks: 16 rows × 512 of one slot's expert, x = SwiGLU(gate‖up) of that slot.
// A task waits only for tasks of smaller index (counters in global memory, released by each finished
// task, acquired by the waiting block's thread 0), so the order is deadlock-free once every block is
// resident. A task whose weights' addresses are known (all but routed slots before the top-k) has its
// weights loaded into registers while the block still works on, or waits for, the task before:
// that is what separate launches cannot do. The last block to finish resets the counters for the
// next launch (a captured graph replays the same arguments).
//
// Each warp takes 2 of a task's 16 rows, its lanes the columns (gate‖up: 64 each, one quantisation
// group; router and down: 16 each, a quarter group). A dot product is s·Σ q·x + b·Σ x per group
// piece, Σ x precomputed per 16 columns. Outputs are bf16, as the GEMV path writes them.
#include "common.cuh"
#include "moe.cuh"

#define MD_THREADS 256
#define MD_HIDDEN 2048
#define MD_INTER 512
#define MD_EXPERTS 256
#define MD_TOPK 8
#define MD_SLOTS 9                                  // top-8 and the shared expert
#define MD_ROUTER_ROWS 257                          // the router's rows and the shared gate
#define MD_ROUTER_SPLITS 4                          // column splits of the router
#define MD_ROUTER_TASKS (17 * MD_ROUTER_SPLITS)     // ceil(257 / 16) row tiles
#define MD_GU_TASKS_PER_SLOT (2 * MD_INTER / 16)    // 64
#define MD_DOWN_TASKS_PER_SLOT (MD_HIDDEN / 16)     // 128
#define MD_DOWN_FIRST (MD_ROUTER_TASKS + 1 + MD_SLOTS * MD_GU_TASKS_PER_SLOT)  // the first down task
#define MD_TASKS (MD_DOWN_FIRST + MD_SLOTS * MD_DOWN_TASKS_PER_SLOT)
// Counters: router tasks done, top-k done, gate‖up tasks done per slot, blocks done.
#define MD_C_ROUTER 0
#define MD_C_TOPK 1
#define MD_C_GU 2
#define MD_C_DONE (MD_C_GU + MD_SLOTS)
#define MD_COUNTERS (MD_C_DONE + 1)

struct MoeDecodeArgs {
    const bf16* x;        // [2048] the token's normed input
    const u32* r_w;       // router ‖ shared gate, Q8 [257][2048 / 4 words]
    const bf16* r_s;      // [257][32]
    const bf16* r_b;
    const u32* gu_w;      // Q4 [257][1024][2048 / 8 words]
    const bf16* gu_s;     // [257][1024][32]
    const bf16* gu_b;
    const u32* d_w;       // Q4 [257][2048][512 / 8 words]
    const bf16* d_s;      // [257][2048][8]
    const bf16* d_b;
    float* r_part;        // [4][257] the router's partial sums
    bf16* logits;         // [257]
    int* ids;             // [9]
    float* weights;       // [9]
    bf16* gu;             // [9][1024]
    bf16* routed;         // [9][2048]
    unsigned* counters;   // [MD_COUNTERS], zero between launches
};

// What a task is: its kind, slot (0..8; stored order puts the shared slot 8 first) and row tile.
enum TaskKind { ROUTER = 0, TOPK = 1, GATE_UP = 2, DOWN = 3 };
struct Task {
    int kind, slot, tile, split;
};

__device__ __forceinline__ Task task_of(int i) {
    if (i < MD_ROUTER_TASKS) return {ROUTER, 0, i / MD_ROUTER_SPLITS, i % MD_ROUTER_SPLITS};
    i -= MD_ROUTER_TASKS;
    if (i == 0) return {TOPK, 0, 0, 0};
    i -= 1;
    // Slot order 8 (shared), 0, 1, ..., 7.
    if (i < MD_SLOTS * MD_GU_TASKS_PER_SLOT) {
        const int s = i / MD_GU_TASKS_PER_SLOT;
        return {GATE_UP, s == 0 ? MD_TOPK : s - 1, i % MD_GU_TASKS_PER_SLOT, 0};
    }
    i -= MD_SLOTS * MD_GU_TASKS_PER_SLOT;
    const int s = i / MD_DOWN_TASKS_PER_SLOT;
    return {DOWN, s == 0 ? MD_TOPK : s - 1, i % MD_DOWN_TASKS_PER_SLOT, 0};
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void add_release(unsigned* p, unsigned v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
// The whole block waits until counter c reaches `target` (thread 0 spins, then a barrier). A wait
// of over ≈ 1 s (a block not resident, a counter not reset) traps: a launch error, not a hang.
__device__ __forceinline__ void wait_for(const unsigned* c, unsigned target) {
    if (threadIdx.x == 0) {
        for (unsigned spins = 0; load_acquire(c) < target; ++spins) {
            if (spins > (1u << 21)) __trap();  // ≈ 2M polls of ≥ 0.5 µs
            __nanosleep(64);
        }
    }
    __syncthreads();
}
// The whole block's writes are done: one release of counter c. The barrier orders every thread's
// writes before thread 0's release, which a waiter's acquire then orders before its reads (the
// pattern of CUTLASS's GenericBarrier: no separate fence).
__device__ __forceinline__ void signal(unsigned* c) {
    __syncthreads();
    if (threadIdx.x == 0) add_release(c, 1);
}

// A lane's share of a task's weights for its two rows: gate‖up 2 × 32 bytes (64 Q4 columns), router
// 2 × 16 bytes (16 Q8 columns), down 2 × 8 bytes (16 Q4 columns); and each row's scale and bias.
struct Loaded {
    uint4 w[2][2];
    bf16 s[2], b[2];
};

// Row of the task's matrix and the lane's first column, for row r (0..15) of the task.
__device__ __forceinline__ void load_task(const MoeDecodeArgs& a, const Task& t, int expert, Loaded& l) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = 16 * t.tile + 2 * warp + h;
        if (t.kind == ROUTER) {
            const int row = min(r, MD_ROUTER_ROWS - 1);  // rows past 256: a real row, not stored
            const int col = t.split * (MD_HIDDEN / MD_ROUTER_SPLITS) + 16 * lane;
            l.w[h][0] = __ldg(reinterpret_cast<const uint4*>(a.r_w + (u64)row * (MD_HIDDEN / 4) + col / 4));
            l.s[h] = a.r_s[row * (MD_HIDDEN / 64) + col / 64];
            l.b[h] = a.r_b[row * (MD_HIDDEN / 64) + col / 64];
        } else if (t.kind == GATE_UP) {
            const u64 row = (u64)expert * (2 * MD_INTER) + r;
            const int col = 64 * lane;
            const uint4* src = reinterpret_cast<const uint4*>(a.gu_w + row * (MD_HIDDEN / 8) + col / 8);
            l.w[h][0] = __ldg(src);
            l.w[h][1] = __ldg(src + 1);
            l.s[h] = a.gu_s[row * (MD_HIDDEN / 64) + lane];
            l.b[h] = a.gu_b[row * (MD_HIDDEN / 64) + lane];
        } else if (t.kind == DOWN) {
            const u64 row = (u64)expert * MD_HIDDEN + r;
            const int col = 16 * lane;
            const uint2 v = __ldg(reinterpret_cast<const uint2*>(a.d_w + row * (MD_INTER / 8) + col / 8));
            l.w[h][0] = make_uint4(v.x, v.y, 0u, 0u);
            l.s[h] = a.d_s[row * (MD_INTER / 64) + col / 64];
            l.b[h] = a.d_b[row * (MD_INTER / 64) + col / 64];
        }
    }
}

// Σ q·x over `n` values of 4 or 8 bits packed in `w` (value k at bits BITS·k of word k / (32 / BITS)),
// x from shared memory.
template <int BITS, int N>
__device__ __forceinline__ float dot_codes(const u32* w, const float* x) {
    constexpr int PER = 32 / BITS;
    constexpr u32 MASK = (1u << BITS) - 1;
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < N; ++k) acc = fmaf((float)((w[k / PER] >> (BITS * (k % PER))) & MASK), x[k], acc);
    return acc;
}

// Task k of this block (−1 past its last): round robin up to the down tasks, then a contiguous run.
__device__ __forceinline__ int block_task(int k) {
    const int b = blockIdx.x, g = gridDim.x;
    const int before = b < MD_DOWN_FIRST ? (MD_DOWN_FIRST - b + g - 1) / g : 0;
    if (k < before) return b + k * g;
    constexpr int DOWN = MD_TASKS - MD_DOWN_FIRST;
    const int j = DOWN * b / g + (k - before);
    return j < DOWN * (b + 1) / g ? MD_DOWN_FIRST + j : -1;
}

// Loads task t's weights into l if their addresses are known: router tasks, the shared slot's, and
// the routed slots' once `ids_known` (a.ids then holds every slot's expert). Whether it did.
__device__ __forceinline__ bool preload(const MoeDecodeArgs& a, const Task& t, bool ids_known, Loaded& l) {
    if (t.kind == TOPK) return true;  // no weights
    if (t.kind == ROUTER || t.slot == MD_TOPK) {
        load_task(a, t, MD_EXPERTS, l);
        return true;
    }
    if (!ids_known) return false;
    load_task(a, t, min(max(__ldcg(a.ids + t.slot), 0), MD_EXPERTS), l);
    return true;
}

// sums[g] = Σ v[16g .. 16g + 15] for N values in shared memory, by the whole block (ends with a
// barrier): the Σ x of the dot products' bias terms.
template <int N>
__device__ __forceinline__ void segment_sums(const float* v, float* sums) {
    for (int g = threadIdx.x; g < N / 16; g += MD_THREADS) {
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < 16; ++k) s += v[16 * g + k];
        sums[g] = s;
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(MD_THREADS, 1) moe_decode_step(const MoeDecodeArgs a) {
    __shared__ float x_s[MD_HIDDEN];      // the input, fp32
    __shared__ float xsum_s[MD_HIDDEN / 16];  // Σ x per 16 columns
    __shared__ float act_s[MD_INTER];     // a down task's SwiGLU input
    __shared__ float actsum_s[MD_INTER / 16];
    __shared__ int expert_s;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    unsigned* c = a.counters;

    // The first task's weights before the PDL wait (they do not depend on the kernels before).
    Loaded cur, next;
    bool ids_known = false;  // this block has seen the top-k done: every slot's expert is known
    int act_slot = -1;       // the slot whose SwiGLU input act_s holds
    bool cur_loaded = block_task(0) >= 0 && preload(a, task_of(block_task(0)), ids_known, cur);
    pdl_wait();
    pdl_launch_dependents();
    for (int k = tid; k < MD_HIDDEN; k += MD_THREADS) x_s[k] = __bfloat162float(a.x[k]);
    __syncthreads();
    segment_sums<MD_HIDDEN>(x_s, xsum_s);

    for (int k = 0; block_task(k) >= 0; ++k) {
        const Task t = task_of(block_task(k));
        // Dependencies, then (if not loaded ahead) the weights.
        int expert = MD_EXPERTS;  // the shared slot's
        if (t.kind == TOPK) wait_for(c + MD_C_ROUTER, MD_ROUTER_TASKS);
        if ((t.kind == GATE_UP || t.kind == DOWN) && t.slot != MD_TOPK) {
            if (!ids_known) {
                wait_for(c + MD_C_TOPK, 1);
                ids_known = true;
            }
            if (tid == 0) expert_s = min(max(__ldcg(a.ids + t.slot), 0), MD_EXPERTS);
            __syncthreads();
            expert = expert_s;
            __syncthreads();  // expert_s read by everyone before the next task writes it
        }
        if (!cur_loaded) load_task(a, t, expert, cur);
        if (t.kind == DOWN) wait_for(c + MD_C_GU + t.slot, MD_GU_TASKS_PER_SLOT);

        // The next task's weights, if their addresses are known now: they stream in while this
        // task computes (its own were loaded the same way during the task before).
        const int ni = block_task(k + 1);
        cur_loaded = ni >= 0 && preload(a, task_of(ni), ids_known, next);

        if (t.kind == ROUTER) {
            const int col = t.split * (MD_HIDDEN / MD_ROUTER_SPLITS) + 16 * lane;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = 16 * t.tile + 2 * warp + h;
                const u32 w[4] = {cur.w[h][0].x, cur.w[h][0].y, cur.w[h][0].z, cur.w[h][0].w};
                const float v = __bfloat162float(cur.s[h]) * dot_codes<8, 16>(w, x_s + col) +
                                __bfloat162float(cur.b[h]) * xsum_s[col / 16];
                const float sum = warp_sum(v);
                if (lane == 0 && r < MD_ROUTER_ROWS) a.r_part[t.split * MD_ROUTER_ROWS + r] = sum;
            }
            signal(c + MD_C_ROUTER);
        } else if (t.kind == TOPK) {
            // The logits as the GEMV path has them (bf16), then its top-k.
            for (int r = tid; r < MD_ROUTER_ROWS; r += MD_THREADS) {
                float s = 0.0f;
#pragma unroll
                for (int sp = 0; sp < MD_ROUTER_SPLITS; ++sp) s += __ldcg(a.r_part + sp * MD_ROUTER_ROWS + r);
                a.logits[r] = __float2bfloat16_rn(s);
            }
            __threadfence_block();
            __syncthreads();
            if (warp == 0) router_topk_row(a.logits, MD_EXPERTS, MD_TOPK, 1, a.ids, a.weights);
            signal(c + MD_C_TOPK);
        } else if (t.kind == GATE_UP) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = 16 * t.tile + 2 * warp + h;
                const u32 w[8] = {cur.w[h][0].x, cur.w[h][0].y, cur.w[h][0].z, cur.w[h][0].w,
                                  cur.w[h][1].x, cur.w[h][1].y, cur.w[h][1].z, cur.w[h][1].w};
                const float xs = xsum_s[4 * lane] + xsum_s[4 * lane + 1] + xsum_s[4 * lane + 2] + xsum_s[4 * lane + 3];
                const float v = __bfloat162float(cur.s[h]) * dot_codes<4, 64>(w, x_s + 64 * lane) +
                                __bfloat162float(cur.b[h]) * xs;
                const float sum = warp_sum(v);
                if (lane == 0) a.gu[t.slot * (2 * MD_INTER) + r] = __float2bfloat16_rn(sum);
            }
            signal(c + MD_C_GU + t.slot);
        } else {
            // x = SwiGLU(gate, up) of the slot, rounded to bf16 as the GEMV path stages it; once
            // per slot of the block's run.
            if (t.slot != act_slot) {
                for (int j = tid; j < MD_INTER; j += MD_THREADS) {
                    const float g = __bfloat162float(__ldcg(a.gu + t.slot * (2 * MD_INTER) + j));
                    const float u = __bfloat162float(__ldcg(a.gu + t.slot * (2 * MD_INTER) + MD_INTER + j));
                    act_s[j] = bf16_round(silu(g) * u);
                }
                __syncthreads();
                segment_sums<MD_INTER>(act_s, actsum_s);
                act_slot = t.slot;
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = 16 * t.tile + 2 * warp + h;
                const u32 w[2] = {cur.w[h][0].x, cur.w[h][0].y};
                const float v = __bfloat162float(cur.s[h]) * dot_codes<4, 16>(w, act_s + 16 * lane) +
                                __bfloat162float(cur.b[h]) * actsum_s[lane];
                const float sum = warp_sum(v);
                if (lane == 0) a.routed[t.slot * MD_HIDDEN + r] = __float2bfloat16_rn(sum);
            }
            __syncthreads();  // act_s read by everyone before a next slot rewrites it
        }
        cur = next;
    }

    // The last block out resets the counters for the next launch.
    __syncthreads();
    if (tid == 0) {
        __threadfence();
        if (atomicAdd(c + MD_C_DONE, 1u) == gridDim.x - 1) {
            for (int k = 0; k < MD_COUNTERS; ++k) c[k] = 0u;
            __threadfence();
        }
    }
}
