// Helpers shared by lily's kernels.
//
// Every .cu file must stay valid for both nvcc (build.rs) and NVRTC (spec/TOOLCHAIN.md §3.4):
// no host headers, our own integer typedefs, only <cuda_bf16.h>, `extern "C" __global__` entry points.
#pragma once
#include <cuda_bf16.h>

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
typedef __nv_bfloat16 bf16;
typedef __nv_bfloat162 bf162;

// Sum over the 32 lanes of a warp; every lane gets the result.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// 8 bf16 values travel as one 16-byte vector (uint4): the widest load a thread can issue.
__device__ __forceinline__ void unpack8(uint4 v, float f[8]) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 p = __bfloat1622float2(*reinterpret_cast<const bf162*>(&w[i]));
        f[2 * i] = p.x;
        f[2 * i + 1] = p.y;
    }
}

__device__ __forceinline__ uint4 pack8(const float f[8]) {
    u32 w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        bf162 p = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
        w[i] = *reinterpret_cast<u32*>(&p);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// (w & 0x000F000F) | 0x43004300: two nibbles as two bf16 numbers 128 + q (0x4300 = 128.0).
// Written as one lop3 because the compiler otherwise emits two (LOP3 takes only one immediate).
__device__ __forceinline__ u32 nibble_pair(u32 w) {
    u32 r;
    asm("lop3.b32 %0, %1, 0x000F000F, 0x43004300, 0xEA;\n" : "=r"(r) : "r"(w));  // 0xEA: (a & b) | c
    return r;
}

// Four bf16 pairs (128 + nibble) from one word: nibbles {0,4}, {1,5}, {2,6}, {3,7}, the lower
// nibble in the lower half. For Q8 that is {lo0,lo2}, {hi0,hi2}, {lo1,lo3}, {hi1,hi3} (bytes 0..3).
// bf16 has 7 mantissa bits, so a nibble must sit in bits 0..3 of its half: hence the shifts.
__device__ __forceinline__ void expand_nibbles(u32 w, u32 out[4]) {
    out[0] = nibble_pair(w);
    out[1] = nibble_pair(w >> 4);
    out[2] = nibble_pair(w >> 8);
    out[3] = nibble_pair(w >> 12);
}

// A shared-memory pointer as the 32-bit address PTX's shared-memory instructions take.
__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// x · sigmoid(x). The quotient as x · rcp.approx(1 + e^−x) (≤ 2 ulp): an IEEE division adds a
// slow-path branch and call at every use, which made up 17 % of gdn_prefill_out's code (5,592 →
// 4,640 SASS instructions, prep 7,024 → 6,288: its instruction cache overflowed, bench/NOTES.md
// v1.28). This is __fdividef's arithmetic without its guards for denominators below 2⁻¹²⁶ (three
// instructions a value; ours is ≥ 1); past 2¹²⁶ both give ±0, where the true value is below 1e-36.
__device__ __forceinline__ float silu(float v) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + expf(-v)));
    return v * r;
}

// Programmatic dependent launch (pdl.rs). Every kernel calls pdl_wait() before it reads anything an
// earlier kernel wrote or writes anything an earlier kernel reads, and pdl_launch_dependents() once
// it has started, so that the next kernel's blocks can be scheduled and run their independent
// prologue (e.g. streaming weights) while this one finishes. Both are no-ops without the attribute.
// Three reads come before the wait where the order of a forward pass makes them safe, each argued
// where it is made: the GDN decode step's state and conv state (gdn.rs, decode_in_pass), the
// split-KV decode's key tiles older than the step's own key (attention.cu, attn_decode_split) and
// the experts' down GEMV's ids (gemm.rs, then_ids_ready).
//
// Decode timeline (timeline.rs, `lily bench --timeline`): the decode kernels' modules are built a
// second time with LILY_TIMELINE (build.rs), and a device opened for a timeline loads those. In
// them, while the host has set `lily_timeline`, block 0 of each kernel stamps {global timer as it
// reached its wait, as the wait returned, grid size}: the gap between two kernels' returns is what
// the first one cost the step in its CUDA graph, and a kernel that reached its wait after its
// predecessor finished was late. The stamp's slot is taken before the wait, where the atomic's
// round trip overlaps the wait; slots may then be out of launch order, which the host restores
// from the stamps. A separate build because any check in the plain kernels, even of a pointer in
// constant memory, cost decode 5–7 % (a load before every wait: bench/NOTES.md v1.50).
// A kernel may also mark points of its own work in block 0's entry (timeline_mark: up to
// TIMELINE_MARKS, the global timer at each): where its time goes after the wait.
#define TIMELINE_MARKS 5
#ifdef LILY_TIMELINE
extern "C" __device__ u64* lily_timeline = nullptr;  // [0] slots taken, then TIMELINE_WORDS a slot
constexpr u64 TIMELINE_CAPACITY = 1ull << 21;         // slots (timeline.rs: CAPACITY)
constexpr u64 TIMELINE_WORDS = 3 + TIMELINE_MARKS;   // reached, released, grid, marks (timeline.rs: WORDS)

__device__ __forceinline__ u64 global_timer() {
    u64 now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    return now;
}

// Returns block 0's entry (null elsewhere, or with no timeline), for timeline_mark.
__device__ __forceinline__ u64* pdl_wait() {
    u64* const timeline = *const_cast<u64* volatile*>(&lily_timeline);
    const bool stamp = timeline != nullptr && (threadIdx.x | threadIdx.y | blockIdx.x | blockIdx.y | blockIdx.z) == 0;
    u64 slot = 0, reached = 0;
    if (stamp) {
        reached = global_timer();
        slot = atomicAdd(timeline, 1ull);
    }
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    if (stamp && slot < TIMELINE_CAPACITY) {
        u64* entry = timeline + 1 + TIMELINE_WORDS * slot;
        entry[0] = reached;
        entry[1] = global_timer();
        entry[2] = (u64)gridDim.x * gridDim.y * gridDim.z;
        return entry;
    }
    return nullptr;
}

__device__ __forceinline__ void timeline_mark(u64* entry, int mark) {
    if (entry != nullptr) entry[3 + mark] = global_timer();
}

// Block trace (timeline.rs, the same builds): while the host has set `lily_block_trace`, every
// block of the kernels that call these records {grid id, start, end, where}: which blocks of a
// launch end last, on which SMs, after starting when (bench/NOTES.md v1.76).
extern "C" __device__ u64* lily_block_trace = nullptr;  // [0] records taken, then BLOCK_TRACE_WORDS each
constexpr u64 BLOCK_TRACE_CAPACITY = 1ull << 20;       // records (timeline.rs: BLOCK_CAPACITY)
constexpr u64 BLOCK_TRACE_WORDS = 4;

// Thread 0's global timer at the block's start (0 elsewhere, or with no trace).
__device__ __forceinline__ u64 block_trace_start() {
    u64* const trace = *const_cast<u64* volatile*>(&lily_block_trace);
    return trace != nullptr && threadIdx.x == 0 ? global_timer() : 0;
}

// At the block's end, reached by all its threads: a barrier (the block's work done), then thread
// 0 records {%gridid, start, end, sm | blockIdx.x << 8 | blockIdx.y << 24 | what << 40}.
__device__ __forceinline__ void block_trace_end(u64 start, u32 what) {
    u64* const trace = *const_cast<u64* volatile*>(&lily_block_trace);
    if (trace == nullptr) return;
    __syncthreads();
    if (threadIdx.x != 0) return;
    const u64 end = global_timer();
    const u64 slot = atomicAdd(trace, 1ull);
    if (slot >= BLOCK_TRACE_CAPACITY) return;
    u64 grid;
    u32 sm;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(grid));
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    u64* e = trace + 1 + BLOCK_TRACE_WORDS * slot;
    e[0] = grid;
    e[1] = start;
    e[2] = end;
    e[3] = (u64)(sm & 0xff) | (u64)(blockIdx.x & 0xffff) << 8 | (u64)(blockIdx.y & 0xffff) << 24 | (u64)(what & 0xffffff) << 40;
}
#else
__device__ __forceinline__ u64 block_trace_start() { return 0; }
__device__ __forceinline__ void block_trace_end(u64, u32) {}
__device__ __forceinline__ u64* pdl_wait() {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    return nullptr;
}
__device__ __forceinline__ void timeline_mark(u64*, int) {}
#endif
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

// A line a kernel will read after its wait but that no kernel of the step writes (a norm's
// weights, the conv weights, a sequence's own conv state), pulled into L1 before the wait: the
// step's 1.8 GB weight stream evicts them from L2, so otherwise each is a DRAM round trip on the
// kernel's critical path (bench/NOTES.md v1.51). Only a hint: nothing waits for it. Decode
// launches only (a few rows): in prefill's thousands of rows the hints cost ≈ 2 % of the pass.
constexpr int DECODE_ROWS = 64;  // launches of at most this many rows take the hints (decode passes)
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p)); }
