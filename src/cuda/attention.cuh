// What the attention kernels share (attention.cu, attention_wgmma.cu): the model's attention shape,
// the KV cache argument, and small wrappers over PTX instructions. The fragment layouts they rely on
// are described at the top of attention.cu.
#pragma once
#include "common.cuh"

#define HEAD_DIM 256
#define N_QHEADS 16
#define N_KVHEADS 2
#define GROUP 8           // query heads per KV head
#define ROT_HALF 32       // RoPE rotates the pairs (j, j + 32), j < 32: the first 64 dims
#define QKV_STRIDE 9216   // values per token of the fused projection
#define K_OFFSET 8192     // where k starts within a token's qkv
#define V_OFFSET 8704     // where v starts
// A key, value or query row in shared memory: 512 bytes of data plus 16 bytes of padding, so that
// the 8 rows one ldmatrix matrix reads (same column, consecutive rows) fall in distinct banks.
#define ROW_BYTES 528

#define NEG_INF (-__int_as_float(0x7f800000))

// Kernel argument: the KV cache pool (attention.rs `KvCache`) and the layer being worked on.
struct KvCacheArgs {
    bf16* k;
    bf16* v;
    int slots;
    int layers;
    int layer;
    int capacity;  // tokens per sequence
};

// Element offset of row 0 of (slot, layer, kv_head).
__device__ __forceinline__ u64 cache_offset(const KvCacheArgs& c, int slot, int kvh) {
    return (((u64)slot * c.layers + c.layer) * N_KVHEADS + kvh) * (u64)c.capacity * HEAD_DIM;
}

// Positions and slots of decode steps come from device memory (so a captured CUDA graph can be
// replayed), where the host cannot check them: an out-of-range one is skipped by the cache append
// and turns that sequence's output into NaN, so the error cannot go unnoticed.
__device__ __forceinline__ bool in_cache(const KvCacheArgs& c, int slot, int pos) {
    return slot >= 0 && slot < c.slots && pos >= 0 && pos < c.capacity;
}

// ---------------------------------------------------------------------------------------------
// Small wrappers over the PTX instructions used below.


// 16-byte asynchronous copy global → shared; when !valid the 16 bytes are zero-filled instead
// (nothing is read), which is how tiles past the end of the cache get harmless zero rows.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed copy groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// c += A·B, bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_bf16(float c[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Transposes an 8×8 bf16 matrix held one row pair per lane (lane holds [lane/4][2·(lane%4) ..]).
__device__ __forceinline__ u32 movmatrix_trans(u32 x) {
    u32 y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

// Two floats as a bf16 pair; `lo` is the element with the lower index.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    bf162 p = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&p);
}

// By __fdividef, as silu in common.cuh: no IEEE-division slow path at each of the epilogue's uses.
__device__ __forceinline__ float sigmoid(float v) { return __fdividef(1.0f, 1.0f + expf(-v)); }

// One key tile of the prefill kernels' online softmax, in the log2 domain (scores · scale_log2,
// applied inside the exponent's FFMA). A thread holds TILES accumulator tiles of 8 keys for its rows g
// (s[4n], s[4n + 1]) and g + 8 (s[4n + 2], s[4n + 3]); a row's keys are spread over the 4 lanes of
// its quad. The scores become P in place, (m, l) move on (l: this lane's share, the quad is summed
// at the end), and O (OUT_TILES tiles, the same layout) is rescaled where a row's max moved.
template <int TILES, int OUT_TILES>
__device__ __forceinline__ void online_softmax_tile(float* s, float* o, float scale_log2, float& m_lo, float& m_hi,
                                                    float& l_lo, float& l_hi) {
    float mx_lo = NEG_INF, mx_hi = NEG_INF;
#pragma unroll
    for (int n = 0; n < TILES; ++n) {
        mx_lo = fmaxf(mx_lo, fmaxf(s[4 * n], s[4 * n + 1]));
        mx_hi = fmaxf(mx_hi, fmaxf(s[4 * n + 2], s[4 * n + 3]));
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, off));
        mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, off));
    }
    const float new_lo = fmaxf(m_lo, mx_lo * scale_log2), new_hi = fmaxf(m_hi, mx_hi * scale_log2);
    // A row with no visible key yet keeps max −inf; subtracting 0 instead keeps exp2 at 0, not NaN.
    const float ref_lo = new_lo == NEG_INF ? 0.0f : new_lo, ref_hi = new_hi == NEG_INF ? 0.0f : new_hi;
    const float alpha_lo = exp2f(m_lo - ref_lo), alpha_hi = exp2f(m_hi - ref_hi);
    m_lo = new_lo;
    m_hi = new_hi;
    float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
    for (int n = 0; n < TILES; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            s[4 * n + e] = exp2f(fmaf(s[4 * n + e], scale_log2, -ref_lo));
            s[4 * n + 2 + e] = exp2f(fmaf(s[4 * n + 2 + e], scale_log2, -ref_hi));
            sum_lo += s[4 * n + e];
            sum_hi += s[4 * n + 2 + e];
        }
    }
    l_lo = l_lo * alpha_lo + sum_lo;
    l_hi = l_hi * alpha_hi + sum_hi;
    // Rescale O only when some row's max moved: past the first few thousand keys a new tile rarely
    // holds a new max, and the multiplications are a third of a tile's non-product work. (alpha is
    // exactly 1 when the max stayed, so skipping changes no bit.)
    if (!__all_sync(0xffffffffu, alpha_lo == 1.0f && alpha_hi == 1.0f)) {
#pragma unroll
        for (int n = 0; n < OUT_TILES; ++n) {
            o[4 * n] *= alpha_lo;
            o[4 * n + 1] *= alpha_lo;
            o[4 * n + 2] *= alpha_hi;
            o[4 * n + 3] *= alpha_hi;
        }
    }
}
