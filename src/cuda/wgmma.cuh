// Hopper's warpgroup matrix products (wgmma) as the kernels use them (gemm_wgmma.cu,
// attention_wgmma.cu, gdn.cu): shared-memory descriptors of the 128-byte-swizzled layout, the fences
// and commit/wait of the asynchronous products, and the product shapes used (bf16, e4m3 or tf32 in,
// fp32 out).
//
// Shared-memory operands are stored in rows of 128 bytes (64 bf16), 16-byte chunk c of row r at
// r·128 + ((c ^ r%8) << 4) from a 1024-byte-aligned start: the 128-byte swizzle, which both a
// K-major descriptor (rows along M/N, 64 K values per row) and an MN-major one (rows along K, 64
// M/N values per row) read (PTX ISA, "Shared Memory Matrix Layout", canonical layouts).
#pragma once
#include "common.cuh"

namespace {

// Matrix descriptor: start address, leading and stride byte offsets (the next 64 M/N values of an
// MN-major operand, and the next 8 rows), 128-byte swizzle (mode 1 in bits 62-63).
__device__ __forceinline__ u64 wgmma_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) | ((u64)1 << 62);
}
// A K-major operand whose rows follow each other (8-row groups 1024 bytes apart; the leading offset
// is unused with the swizzle).
__device__ __forceinline__ u64 smem_desc(u32 addr) { return wgmma_desc(addr, 16, 1024); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Makes this thread's shared-memory writes (cp.async included, once waited for) visible to the
// tensor cores' reads.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Keeps the compiler from moving accumulator reads or writes across the asynchronous products of
// an m64nN product (N / 2 accumulators per thread).
template <int N> __device__ __forceinline__ void fence_accumulators(float* d) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Global weight row of tile row r (0 .. TILE_N − 1) in column tile `col_tile` of the wgmma GEMMs
// (gemm_wgmma.cu, gemm_fp8.cu), −1 past the matrix. SwiGLU tiles: rows 16w..16w+7 are gate rows
// j = (TILE_N / 2)·col_tile + 8w .. +7, rows 16w+8..16w+15 the up rows of the same j, so a thread
// holds gate and up of one j in its fragment rows g and g + 8.
template <bool SWIGLU, int TILE_N> __device__ __forceinline__ int tile_weight_row(int r, int col_tile, int n) {
    if constexpr (!SWIGLU) {
        const int row = col_tile * TILE_N + r;
        return row < n ? row : -1;
    } else {
        const int half = n / 2, j = col_tile * (TILE_N / 2) + (r / 16) * 8 + (r % 8);
        if (j >= half) return -1;
        return r % 16 < 8 ? j : half + j;
    }
}

// A tile's outputs straight from the accumulators of its m64nN products, as 2-byte stores: thread
// (warp w, g = lane / 4, t = lane % 4) holds d[4i + e] = D[tile row 16w + g + 8(e/2)][token 8i + 2t +
// e%2]. Row `tok` of the tile goes to Y row c_row_s[tok]: column col_tile·TILE_N + tile row of n, or
// with SWIGLU silu(gate)·up at column col_tile·TILE_N/2 + 8w + g of n / 2 (tile_weight_row's
// layout). Tokens past `rows` and columns past the matrix are skipped.
template <bool SWIGLU, int N, int TILE_N>
__device__ __forceinline__ void store_accumulators(bf16* y, int n, const float* d, int rows, int col_tile, const int* c_row_s) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int r_lo = 16 * warp + g;
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
            const int tok = 8 * i + 2 * t + e2;
            if (tok >= rows) continue;
            if constexpr (!SWIGLU) {
                bf16* yrow = y + (i64)c_row_s[tok] * n;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int col = col_tile * TILE_N + r_lo + 8 * h;
                    if (col < n) yrow[col] = __float2bfloat16_rn(d[4 * i + 2 * h + e2]);
                }
            } else {
                const int half = n / 2, j = col_tile * (TILE_N / 2) + 8 * warp + g;
                if (j < half) y[(i64)c_row_s[tok] * half + j] = __float2bfloat16_rn(silu(d[4 * i + e2]) * d[4 * i + 2 + e2]);
            }
        }
    }
}

// The accumulator operands of a wgmma instruction: d[0..n) as "+f" constraints, and the
// instruction's {%0, ..., %n−1} list naming them (its other operands follow from %n).
#define WGMMA_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define WGMMA_D32 WGMMA_D8(0), WGMMA_D8(8), WGMMA_D8(16), WGMMA_D8(24)
#define WGMMA_D48 WGMMA_D32, WGMMA_D8(32), WGMMA_D8(40)
#define WGMMA_D64 WGMMA_D48, WGMMA_D8(48), WGMMA_D8(56)
#define WGMMA_D72 WGMMA_D64, WGMMA_D8(64)
#define WGMMA_D80 WGMMA_D72, WGMMA_D8(72)
#define WGMMA_D128 WGMMA_D64, WGMMA_D8(64), WGMMA_D8(72), WGMMA_D8(80), WGMMA_D8(88), WGMMA_D8(96), WGMMA_D8(104), WGMMA_D8(112), WGMMA_D8(120)
#define WGMMA_REGS32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WGMMA_REGS48 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}"
#define WGMMA_REGS64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define WGMMA_REGS72 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71}"
#define WGMMA_REGS80 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79}"
#define WGMMA_REGS128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"

// d += A·B for A = 64 rows × 16 in registers (a: the mma.m16n8k16 A fragment of each warp's 16
// rows) and B = 16 × N from shared memory, K-major (desc_b); d holds N / 2 accumulators.
template <int N> __device__ __forceinline__ void wgmma_k16(float* d, const u32 a[4], u64 desc_b);
// One specialisation per N: the instruction's shape, its accumulator list (WGMMA_D*) with their
// {%0, ...} names (WGMMA_REGS*), and the names of the A registers and the descriptor after them.
#define WGMMA_K16(N, D, REGS, A_DESC)                                                                \
    template <> __device__ __forceinline__ void wgmma_k16<N>(float* d, const u32 a[4], u64 desc_b) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                     \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 " REGS ", " A_DESC     \
                     ", p, 1, 1, 0;\n}\n"                                                             \
                     : D                                                                             \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));                     \
    }
WGMMA_K16(64, WGMMA_D32, WGMMA_REGS32, "{%32, %33, %34, %35}, %36")
WGMMA_K16(96, WGMMA_D48, WGMMA_REGS48, "{%48, %49, %50, %51}, %52")
WGMMA_K16(128, WGMMA_D64, WGMMA_REGS64, "{%64, %65, %66, %67}, %68")
WGMMA_K16(144, WGMMA_D72, WGMMA_REGS72, "{%72, %73, %74, %75}, %76")
WGMMA_K16(160, WGMMA_D80, WGMMA_REGS80, "{%80, %81, %82, %83}, %84")
#undef WGMMA_K16

// d += A·B for A = 64 rows × 16 (registers, as wgmma_k16) and B = 16 × 256 from shared memory,
// MN-major (the transpose bit; desc_b with the leading offset to the next 64 columns).
__device__ __forceinline__ void wgmma_k16_n256_mn(float* d, const u32 a[4], u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        WGMMA_REGS128 ", "
        "{%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
        : WGMMA_D128
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

// t = A·B (accumulate = 0) or t += A·B for A = 64 rows × 32 e4m3 (desc_a) and B = 32 × N e4m3
// (desc_b), both from shared memory, K-major (8-bit operands have no transposed form).
template <int N> __device__ __forceinline__ void wgmma_fp8_k32(float* d, u64 desc_a, u64 desc_b, int accumulate);
template <> __device__ __forceinline__ void wgmma_fp8_k32<64>(float* d, u64 desc_a, u64 desc_b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
        WGMMA_REGS32 ", "
        "%32, %33, p, 1, 1;\n}\n"
        : WGMMA_D32
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}
template <> __device__ __forceinline__ void wgmma_fp8_k32<128>(float* d, u64 desc_a, u64 desc_b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        WGMMA_REGS64 ", "
        "%64, %65, p, 1, 1;\n}\n"
        : WGMMA_D64
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// d += A·B in tf32 for A = 64 rows × 8 in registers (a: each warp's 16 rows as the mma.m16n8k8
// tf32 A fragment) and B = 8 × N from shared memory, K-major (32-bit operands have no transposed
// form); d holds N / 2 accumulators. A tf32 operand is read as its top 19 bits.
template <int N> __device__ __forceinline__ void wgmma_tf32_k8(float* d, const u32 a[4], u64 desc_b);
template <> __device__ __forceinline__ void wgmma_tf32_k8<16>(float* d, const u32 a[4], u64 desc_b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k8.f32.tf32.tf32 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1;\n}\n"
                 : WGMMA_D8(0)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}
template <> __device__ __forceinline__ void wgmma_tf32_k8<32>(float* d, const u32 a[4], u64 desc_b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
                 "{%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
                 : WGMMA_D8(0), WGMMA_D8(8)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

template <> __device__ __forceinline__ void wgmma_tf32_k8<64>(float* d, const u32 a[4], u64 desc_b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 " WGMMA_REGS32 ", "
                 "{%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
                 : WGMMA_D32
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

}  // namespace
