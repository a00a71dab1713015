// moe_decode_step: the MoE block of one decode token as one persistent kernel (moe_decode.rs;
// bench/NOTES.md v1.40–v1.41): router GEMV, top-k, the experts' gate‖up GEMVs, their down GEMVs,
// with the outputs the launch-per-op path leaves (forward/experts.rs): ids and weights [9], routed
// [9][2048]; the combine that follows is unchanged.
//
// Qwen3.6-35B-A3B's shapes: hidden 2048, expert width I = 512, 256 experts + the shared one (id 256,
// always slot 8), top-8. Router ‖ shared gate: MLX affine Q8 [257][2048]; experts: Q4 gate‖up
// [257][1024][2048] and down [257][2048][512], group 64 (MODEL.md §5.1: value k of a word at bits
// 4k (8k), w = s·q + b with bf16 s and b).
//
// Why it is fast: a GEMV launch per op streams a few MB and pays, each time, a ramp (the first bytes
// after ≈ 1–2 µs) and a tail. Here one block per SM runs a fixed list of tasks, each 16 KB of one
// matrix's weights (+ its scales and biases), and every block puts *all* its tasks' weight copies in
// flight at once (TMA bulk copies into shared memory, a stage per task), as soon as their addresses are
// known: the router's and the shared expert's at the start (before the PDL wait: they do not depend on
// the kernels before), the routed experts' right after the top-k. v1.40 loaded one 16 KB task at a
// time into registers and ran at 0.32 TB/s (too few bytes in flight per SM).
//
// Tasks, in this order, block b taking tasks b, b + G, b + 2G, … (G = blocks ≥ 113, so that a block
// has at most 8 tasks, each with a shared-memory stage of its own):
//   router   33 tasks: 8 rows × 2048 of the router (Q8), the logits rounded to bf16;
//   gate‖up  576 tasks: 16 rows × 2048 of one slot's expert (the shared slot first: it needs no ids);
//   down     288 tasks: 64 rows × 512 of one slot's expert, x = SwiGLU(gate‖up) of that slot.
// A task waits only for tasks before it, through counters in global memory that count warps: each
// warp's lane 0 writes the warp's rows and releases; a waiting warp's lane 0 acquires. With every
// block resident and each block's tasks in increasing order, nothing waits in a cycle. Warps move
// through their block's tasks at their own pace: a block-wide barrier only where the block shares
// data (x at the start, a slot's SwiGLU input). v1.41's second form had a barrier per task, and
// warps spent ≈ 40 % of their time in them. There is no top-k task: each block that reaches a routed
// task waits for the router and runs the top-k itself (the same result everywhere; block 0 writes
// ids and weights out), saving a round trip through a counter. The last block out resets the
// counters for the next launch (a captured graph replays the same arguments).
//
// In a task, lane l of a warp covers 32-column pieces l and l + 32 of a 2048-wide row (gate‖up,
// router; x for those pieces lives in its registers for the whole kernel), or piece l % 16 of a
// 512-wide down row (a half-warp per row). A dot product is s·Σ q·x + b·Σ x per piece. Outputs are
// bf16 where the GEMV path rounds: logits, gate‖up, the SwiGLU input, routed.
#include "common.cuh"
#include "moe.cuh"

#define MD_THREADS 256
#define MD_WARPS (MD_THREADS / 32)
#define MD_HIDDEN 2048
#define MD_INTER 512
#define MD_EXPERTS 256
#define MD_TOPK 8
#define MD_SLOTS 9                              // top-8 and the shared expert
#define MD_ROUTER_ROWS 257                      // the router's rows and the shared gate
#define MD_ROUTER_TILE 8                        // rows per router task
#define MD_GU_TILE 16                           // rows per gate‖up task
#define MD_DOWN_TILE 64                         // rows per down task
#define MD_ROUTER_TASKS 33                      // ceil(257 / 8)
#define MD_GU_TASKS_PER_SLOT (2 * MD_INTER / MD_GU_TILE)     // 64
#define MD_DOWN_TASKS_PER_SLOT (MD_HIDDEN / MD_DOWN_TILE)    // 32
#define MD_GU_FIRST MD_ROUTER_TASKS
#define MD_DOWN_FIRST (MD_GU_FIRST + MD_SLOTS * MD_GU_TASKS_PER_SLOT)
#define MD_TASKS (MD_DOWN_FIRST + MD_SLOTS * MD_DOWN_TASKS_PER_SLOT)  // 897
// A stage: 16 KB of weights, then ≤ 1 KB of scales and ≤ 1 KB of biases.
#define MD_W_BYTES 16384
#define MD_SB_BYTES 1024
#define MD_STAGE_BYTES (MD_W_BYTES + 2 * MD_SB_BYTES)
#define MD_STAGES 8                             // ≥ a block's tasks: needs ≥ 113 blocks (897 / 8)
#define MD_SMEM_BYTES (MD_STAGES * MD_STAGE_BYTES)
// Counters: router tasks done, gate‖up tasks done per slot, blocks done.
#define MD_C_ROUTER 0
#define MD_C_GU 1
#define MD_C_DONE (MD_C_GU + MD_SLOTS)
#define MD_COUNTERS (MD_C_DONE + 1)
// A block's trace (tests/cuda_moe.rs prints it): its start on the global timer (ns), then clock64
// at its start, once x is in, after its top-k (0 if it ran none), after each of its first 8 tasks,
// at its end; and its end on the global timer; and clock64 when it saw the router done.
#define MD_TRACE_WORDS 16
#define MD_T_START_NS 0
#define MD_T_START 1
#define MD_T_X 2
#define MD_T_TOPK 3
#define MD_T_TASK 4
#define MD_T_END 12
#define MD_T_END_NS 13
#define MD_T_ROUTER 14

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
    bf16* logits;         // [257]
    int* ids;             // [9]
    float* weights;       // [9]
    bf16* gu;             // [9][1024]
    bf16* routed;         // [9][2048]
    unsigned* counters;   // [MD_COUNTERS], zero between launches
    u64* trace;           // null, or [blocks][MD_TRACE_WORDS]: when each block got where (below)
};

enum TaskKind { ROUTER = 0, GATE_UP = 1, DOWN = 2 };
struct Task {
    int kind, slot, tile;
};

// Task i of the list above; slots in the order 8 (shared), 0, 1, …, 7.
__device__ __forceinline__ Task task_of(int i) {
    if (i < MD_GU_FIRST) return {ROUTER, 0, i};
    const bool gu = i < MD_DOWN_FIRST;
    const int per = gu ? MD_GU_TASKS_PER_SLOT : MD_DOWN_TASKS_PER_SLOT;
    i -= gu ? MD_GU_FIRST : MD_DOWN_FIRST;
    const int s = i / per;
    return {gu ? GATE_UP : DOWN, s == 0 ? MD_TOPK : s - 1, i % per};
}
__device__ __forceinline__ bool routed_slot(const Task& t) { return t.kind != ROUTER && t.slot != MD_TOPK; }

// ---- counters between blocks ----
__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void add_release(unsigned* p, unsigned v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
// The calling warp waits until counter c reaches `target` (lane 0 spins). A wait of over ≈ 1 s (a
// block not resident, a counter not reset) traps: a launch error, not a hang.
__device__ __forceinline__ void warp_wait_for(const unsigned* c, unsigned target) {
    if (threadIdx.x % 32 == 0) {
        for (unsigned spins = 0; load_acquire(c) < target; ++spins) {
            if (spins > (1u << 21)) __trap();  // ≈ 2M polls of ≥ 0.5 µs
            __nanosleep(64);
        }
    }
    __syncwarp();
}
// The calling warp's outputs are written (by its lane 0): one release of counter c, by lane 0,
// which orders its own writes before a waiter's acquire.
__device__ __forceinline__ void warp_signal(unsigned* c) {
    __syncwarp();
    if (threadIdx.x % 32 == 0) add_release(c, 1);
}

// ---- TMA bulk copies into a stage, completed on the stage's mbarrier ----
__device__ __forceinline__ void mbar_init(u64* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_expect(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes, u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    u32 done = 0;
    while (!done) {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    }
}

// Where task t's weights, scales and biases are (expert `e` for expert tasks), and their sizes.
struct Pieces {
    const void *w, *s, *b;
    u32 w_bytes, sb_bytes;
};
__device__ __forceinline__ Pieces pieces_of(const MoeDecodeArgs& a, const Task& t, int e) {
    if (t.kind == ROUTER) {
        const int row = MD_ROUTER_TILE * t.tile, rows = min(MD_ROUTER_TILE, MD_ROUTER_ROWS - row);
        return {a.r_w + (u64)row * (MD_HIDDEN / 4), a.r_s + row * (MD_HIDDEN / 64), a.r_b + row * (MD_HIDDEN / 64),
                (u32)(rows * MD_HIDDEN), (u32)(rows * (MD_HIDDEN / 64) * 2)};
    }
    if (t.kind == GATE_UP) {
        const u64 row = (u64)e * (2 * MD_INTER) + MD_GU_TILE * t.tile;
        return {a.gu_w + row * (MD_HIDDEN / 8), a.gu_s + row * (MD_HIDDEN / 64), a.gu_b + row * (MD_HIDDEN / 64),
                MD_GU_TILE * MD_HIDDEN / 2, MD_GU_TILE * (MD_HIDDEN / 64) * 2};
    }
    const u64 row = (u64)e * MD_HIDDEN + MD_DOWN_TILE * t.tile;
    return {a.d_w + row * (MD_INTER / 8), a.d_s + row * (MD_INTER / 64), a.d_b + row * (MD_INTER / 64),
            MD_DOWN_TILE * MD_INTER / 2, MD_DOWN_TILE * (MD_INTER / 64) * 2};
}

// Task t's pieces into `stage`, completing on `bar`; the weights as `splits` equal copies.
__device__ __forceinline__ void issue_task(const MoeDecodeArgs& a, const Task& t, int e, unsigned char* stage, u64* bar,
                                           int splits = 1) {
    const Pieces p = pieces_of(a, t, e);
    mbar_expect(bar, p.w_bytes + 2 * p.sb_bytes);
    const u32 part = p.w_bytes / splits;  // 16-byte multiples for the splits used (1, 8)
    for (int i = 0; i < splits; ++i)
        bulk_copy(stage + i * part, static_cast<const unsigned char*>(p.w) + i * part, part, bar);
    bulk_copy(stage + MD_W_BYTES, p.s, p.sb_bytes, bar);
    bulk_copy(stage + MD_W_BYTES + MD_SB_BYTES, p.b, p.sb_bytes, bar);
}

// Σ (128 + q)·x over the 32 values of a Q4 piece (4 words, value k at bits 4(k % 8) of word k / 8),
// without int→float conversions (a quarter-rate pipe, the limit of v1.41's first form):
// expand_nibbles makes bf16 pairs 128 + q, a shift or a mask makes each an fp32. The caller
// subtracts 128·Σx.
__device__ __forceinline__ float dot_q4_offset(const u32* w, const float* x) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // four chains: a warp's FMAs are not one long wait
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 pairs[4];  // pair j: values 8i + j (low half) and 8i + j + 4 (high half)
        expand_nibbles(w[i], pairs);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            acc[(2 * j) % 4] = fmaf(__uint_as_float(pairs[j] << 16), x[8 * i + j], acc[(2 * j) % 4]);
            acc[(2 * j + 1) % 4] = fmaf(__uint_as_float(pairs[j] & 0xFFFF0000u), x[8 * i + j + 4], acc[(2 * j + 1) % 4]);
        }
    }
    return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}
// Σ q·x over the 32 values of a Q8 piece (8 words, value k in byte k % 4 of word k / 4): each byte
// as 2²³ + q (an fp32 with q in its mantissa) minus 2²³, exact.
__device__ __forceinline__ float dot_q8(const u32* w, const float* x) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int k = 0; k < 32; ++k) {
        const float q = __uint_as_float(0x4B000000u | ((w[k / 4] >> (8 * (k % 4))) & 0xFFu)) - 8388608.0f;
        acc[k % 4] = fmaf(q, x[k], acc[k % 4]);
    }
    return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}
__device__ __forceinline__ void load_words(const unsigned char* p, u32* w, int n16) {
#pragma unroll
    for (int i = 0; i < n16; ++i) {
        const uint4 v = *reinterpret_cast<const uint4*>(p + 16 * i);
        w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
}
__device__ __forceinline__ float sb(const unsigned char* p, int i) {
    return __bfloat162float(reinterpret_cast<const bf16*>(p)[i]);
}

// Vectors the lanes read by 32-value pieces (x: 64 pieces, the SwiGLU input: 16) sit in shared
// memory as fp32, piece P at P·MD_PIECE_STRIDE: a stride of 36 words puts the 8 lanes of a float4
// read phase on distinct banks. Each is loaded once per block with one coalesced 16-byte read per
// thread: v1.41's first form had every lane read its pieces from L2, 132 blocks × 8 warps on the
// same few lines, and x took 5 µs to arrive.
#define MD_PIECE_STRIDE 36
// Thread t's 8 values, the t-th 8 of a bf16 vector, into their pieces (t < n / 8 of n values).
__device__ __forceinline__ void stage8(float* dst, int t, const float v[8]) {
    float* d = dst + (t / 4) * MD_PIECE_STRIDE + 8 * (t % 4);
    *reinterpret_cast<float4*>(d) = make_float4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<float4*>(d + 4) = make_float4(v[4], v[5], v[6], v[7]);
}
// Piece P's 32 values into registers; returns their sum.
__device__ __forceinline__ float read_piece(const float* src, int piece, float* v) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float4 f = *reinterpret_cast<const float4*>(src + piece * MD_PIECE_STRIDE + 4 * i);
        v[4 * i] = f.x, v[4 * i + 1] = f.y, v[4 * i + 2] = f.z, v[4 * i + 3] = f.w;
        s += (f.x + f.y) + (f.z + f.w);
    }
    return s;
}

extern "C" __global__ void __launch_bounds__(MD_THREADS, 1) moe_decode_step(const MoeDecodeArgs a) {
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ u64 bars[MD_STAGES];
    __shared__ int ids_s[MD_SLOTS];
    __shared__ float weights_s[MD_SLOTS];
    __shared__ __align__(16) float x_s[MD_HIDDEN / 32 * MD_PIECE_STRIDE];
    __shared__ __align__(16) float act_s[MD_INTER / 32 * MD_PIECE_STRIDE];
    int act_slot = -1;  // the slot whose SwiGLU input act_s holds
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    unsigned* c = a.counters;
    // At most MD_STAGES tasks per block (moe_decode.rs checks the SM count), so each task has a
    // stage of its own, used once: no refills, every mbarrier in its phase 0.
    const int ntasks = (MD_TASKS - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
    auto task_k = [&](int k) { return task_of(blockIdx.x + k * gridDim.x); };
    u64* trace = a.trace ? a.trace + blockIdx.x * MD_TRACE_WORDS : nullptr;
    auto mark = [&](int at) {
        if (trace && tid == 0) trace[at] = clock64();
    };
    auto mark_ns = [&](int at) {
        if (trace && tid == 0) {
            u64 ns;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
            trace[at] = ns;
        }
    };
    if (trace && tid == 0)
        for (int i = 0; i < MD_TRACE_WORDS; ++i) trace[i] = 0;
    mark_ns(MD_T_START_NS);
    mark(MD_T_START);

    // Thread 0 issues the copies of every task whose weights' addresses it knows: before the top-k
    // the router's and the shared expert's (before the PDL wait: they do not depend on the kernels
    // before), after it the rest (experts from warp 0's top-k).
    auto issue = [&](bool ids_known) {
        for (int k = 0; k < ntasks; ++k) {
            const Task t = task_k(k);
            if (routed_slot(t) != ids_known) continue;
            const int e = t.kind == ROUTER ? 0 : t.slot == MD_TOPK ? MD_EXPERTS : ids_s[t.slot];
            issue_task(a, t, e, ring + k * MD_STAGE_BYTES, bars + k);
        }
    };
    if (tid == 0) {
        for (int i = 0; i < MD_STAGES; ++i) mbar_init(bars + i);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        issue(false);
    }
    pdl_wait();
    pdl_launch_dependents();

    // x of this lane's two pieces (columns 32·lane and 32·(lane + 32)) and their sums. (The
    // barrier also publishes the mbarriers' initialisation.)
    {
        float v[8];
        unpack8(__ldcg(reinterpret_cast<const uint4*>(a.x) + tid), v);  // 256 threads × 8 = 2048
        stage8(x_s, tid, v);
    }
    __syncthreads();
    float x[2][32], xsum[2];
#pragma unroll
    for (int p = 0; p < 2; ++p) xsum[p] = read_piece(x_s, lane + 32 * p, x[p]);
    // (The test on x makes the clock read wait for x.)
    if (trace && tid == 0 && xsum[0] + xsum[1] != 0.5f) trace[MD_T_X] = clock64();

    // Each warp goes through the block's tasks at its own pace (its rows of each), waiting only for
    // what it reads: counters count warps, released by each warp's lane 0, which writes the warp's
    // outputs. Block-wide barriers remain only where the block shares data (x, the top-k, a slot's
    // SwiGLU input), at points every warp passes alike.
    bool ids_known = false;
    for (int k = 0; k < ntasks; ++k) {
        const Task t = task_k(k);
        if (routed_slot(t) && !ids_known) {
            // The top-k, by warp 0 once the router is done (the other warps wait at the barrier:
            // eight warps each running it took twice as long); thread 0 then issues the routed
            // copies.
            if (warp == 0) {
                warp_wait_for(c + MD_C_ROUTER, MD_ROUTER_TASKS * MD_WARPS);
                mark(MD_T_ROUTER);
                router_topk_row(a.logits, MD_EXPERTS, MD_TOPK, 1, ids_s, weights_s);
                __syncwarp();
                if (lane == 0) issue(true);
                if (blockIdx.x == 0 && lane < MD_SLOTS) {
                    a.ids[lane] = ids_s[lane];
                    a.weights[lane] = weights_s[lane];
                }
            }
            __syncthreads();
            ids_known = true;
            mark(MD_T_TOPK);
        }
        unsigned char* stage = ring + k * MD_STAGE_BYTES;
        const unsigned char* sc = stage + MD_W_BYTES;
        const unsigned char* bi = sc + MD_SB_BYTES;

        if (t.kind == ROUTER) {
            // One row per warp; Q8 pieces of 32 columns = 32 bytes.
            mbar_wait(bars + k, 0);
            const int r = warp, row = MD_ROUTER_TILE * t.tile + r;
            if (row < MD_ROUTER_ROWS) {
                float v = 0.0f;
#pragma unroll
                for (int p = 0; p < 2; ++p) {
                    const int piece = lane + 32 * p;
                    u32 w[8];
                    load_words(stage + r * MD_HIDDEN + 32 * piece, w, 2);
                    const int g = r * (MD_HIDDEN / 64) + piece / 2;
                    v += sb(sc, g) * dot_q8(w, x[p]) + sb(bi, g) * xsum[p];
                }
                v = warp_sum(v);
                if (lane == 0) a.logits[row] = __float2bfloat16_rn(v);
            }
            warp_signal(c + MD_C_ROUTER);
        } else if (t.kind == GATE_UP) {
            // Two rows per warp; Q4 pieces of 32 columns = 16 bytes.
            mbar_wait(bars + k, 0);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = 2 * warp + h;
                float v = 0.0f;
#pragma unroll
                for (int p = 0; p < 2; ++p) {
                    const int piece = lane + 32 * p;
                    u32 w[4];
                    load_words(stage + r * (MD_HIDDEN / 2) + 16 * piece, w, 1);
                    const int g = r * (MD_HIDDEN / 64) + piece / 2;
                    v += sb(sc, g) * (dot_q4_offset(w, x[p]) - 128.0f * xsum[p]) + sb(bi, g) * xsum[p];
                }
                v = warp_sum(v);
                if (lane == 0) a.gu[t.slot * (2 * MD_INTER) + MD_GU_TILE * t.tile + r] = __float2bfloat16_rn(v);
            }
            warp_signal(c + MD_C_GU + t.slot);
        } else {
            // The slot's SwiGLU input, rounded to bf16 as the GEMV path stages it, once per slot a
            // block meets: every warp waits for the slot's gate‖up, then the block stages it.
            if (t.slot != act_slot) {
                warp_wait_for(c + MD_C_GU + t.slot, MD_GU_TASKS_PER_SLOT * MD_WARPS);
                __syncthreads();  // every warp is done with the previous slot's act_s
                if (tid < MD_INTER / 8) {
                    float g[8], u[8];
                    unpack8(__ldcg(reinterpret_cast<const uint4*>(a.gu + t.slot * (2 * MD_INTER)) + tid), g);
                    unpack8(__ldcg(reinterpret_cast<const uint4*>(a.gu + t.slot * (2 * MD_INTER) + MD_INTER) + tid), u);
#pragma unroll
                    for (int i = 0; i < 8; ++i) g[i] = bf16_round(silu(g[i]) * u[i]);
                    stage8(act_s, tid, g);
                }
                __syncthreads();
                act_slot = t.slot;
            }
            mbar_wait(bars + k, 0);
            // Eight rows per warp, a half-warp per row, lane j of a half the piece j.
            const int j = lane % 16;
            float act[32];
            const float asum = read_piece(act_s, j, act);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = 8 * warp + 2 * i + lane / 16;
                u32 w[4];
                load_words(stage + r * (MD_INTER / 2) + 16 * j, w, 1);
                const int g = r * (MD_INTER / 64) + j / 2;
                float v = sb(sc, g) * (dot_q4_offset(w, act) - 128.0f * asum) + sb(bi, g) * asum;
#pragma unroll
                for (int off = 8; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
                if (j == 0) a.routed[t.slot * MD_HIDDEN + MD_DOWN_TILE * t.tile + r] = __float2bfloat16_rn(v);
            }
        }
        if (k < 8) mark(MD_T_TASK + k);
    }

    // The last block out resets the counters for the next launch.
    __syncthreads();
    mark(MD_T_END);
    mark_ns(MD_T_END_NS);
    if (tid == 0) {
        __threadfence();
        if (atomicAdd(c + MD_C_DONE, 1u) == gridDim.x - 1) {
            for (int i = 0; i < MD_COUNTERS; ++i) c[i] = 0u;
            __threadfence();
        }
    }
}

// Measurement only (tests/cuda_moe.rs, MoeDecode::probe_stream): the step's weight stream alone, no
// compute and no counters, the routed slots' experts taken from a.ids (left by a step before).
// mode 0: the copies as the step issues them (thread 0, one bulk copy per piece); 1: task k's by
// warp k % 8's lane 0; 2: each task's weights as 8 bulk copies of 2 KB; 3: no TMA, every thread
// loading 16-byte pieces of each task into registers.
extern "C" __global__ void __launch_bounds__(MD_THREADS, 1) moe_decode_stream_probe(const MoeDecodeArgs a, int mode) {
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ u64 bars[MD_STAGES];
    __shared__ int ids_s[MD_SLOTS];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int ntasks = (MD_TASKS - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
    auto task_k = [&](int k) { return task_of(blockIdx.x + k * gridDim.x); };
    pdl_wait();
    pdl_launch_dependents();
    if (tid < MD_SLOTS) ids_s[tid] = tid == MD_TOPK ? MD_EXPERTS : min(max(__ldcg(a.ids + tid), 0), MD_EXPERTS - 1);
    if (tid == 0) {
        for (int i = 0; i < MD_STAGES; ++i) mbar_init(bars + i);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    auto expert = [&](const Task& t) { return t.kind == ROUTER ? 0 : ids_s[t.slot]; };
    if (mode == 3) {
        u32 acc = 0;
        for (int k = 0; k < ntasks; ++k) {
            const Task t = task_k(k);
            const Pieces p = pieces_of(a, t, expert(t));
            for (u32 off = 16 * tid; off < p.w_bytes; off += 16 * MD_THREADS)
                acc ^= __ldg(reinterpret_cast<const uint4*>(static_cast<const unsigned char*>(p.w) + off)).x;
            for (u32 off = 16 * tid; off < p.sb_bytes; off += 16 * MD_THREADS)
                acc ^= __ldg(reinterpret_cast<const uint4*>(static_cast<const unsigned char*>(p.s) + off)).x ^
                       __ldg(reinterpret_cast<const uint4*>(static_cast<const unsigned char*>(p.b) + off)).x;
        }
        if (acc == 0x12345678u) a.counters[MD_C_DONE] = 0u;  // (keeps the loads; never true in practice)
        return;
    }
    for (int k = 0; k < ntasks; ++k) {
        const Task t = task_k(k);
        if (mode == 1 ? (warp == k % MD_WARPS && lane == 0) : tid == 0)
            issue_task(a, t, expert(t), ring + k * MD_STAGE_BYTES, bars + k, mode == 2 ? 8 : 1);
    }
    for (int k = 0; k < ntasks; ++k) mbar_wait(bars + k, 0);
}
