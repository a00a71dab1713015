// What the two prefill GEMM kernels share: their argument struct (the same for both, so the host
// launches either with the same arguments), the block's tile and row tables, and the copy and
// dequantisation helpers. gemm_prefill.cu (mma.sync) explains the products, tiles and epilogues;
// gemm_wgmma.cu runs them on Hopper's warpgroup instructions.
#pragma once
#include "common.cuh"

// Kernel arguments, mirrored by `GemmArgs` in gemm_prefill.rs (same order, same sizes).
struct GemmArgs {
    const u32* w;         // matrix m starts at w + m·w_mat_words; a row is K·bits/32 words
    const bf16* scales;   // [count][n][K/64] (quantised formats)
    const bf16* biases;   // [count][n][K/64]
    const bf16* x;        // [x_rows][K]
    bf16* y;              // [y_rows][n] (STORE) or [y_rows][n/2] (SWIGLU)
    const int* a_rows;    // null: X row of position p is p; else a_rows[p] / a_div
    const int* c_rows;    // null: Y row of position p is p; else c_rows[p]
    const int4* tiles;    // null: dense; else {matrix, first position, rows, -} per blockIdx.x
    const int* num_tiles; // grouped: valid entries of tiles
    i64 w_mat_words;
    int x_rows;           // dense: the number of positions; always a bound for X rows
    int y_rows;           // a bound for Y rows
    int n;                // weight rows per matrix
    int k;                // columns, a multiple of 64
    int a_div;
    int count;            // matrices in the stack
    int staged_stores;    // wgmma kernels: the epilogue through shared memory (gemm_wgmma.cu)
};

namespace {


// 16 bytes global → shared, bypassing L1; zero-filled (nothing read) when !valid.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
// 8 bytes global → shared (through L1: cp.async's .cg takes only 16), zero-filled when !valid.
__device__ __forceinline__ void cp_async8(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 8 : 0)
                 : "memory");
}
// 4 bytes global → shared (through L1: cp.async's .cg takes only 16), zero-filled when !valid.
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8 × 8 matrices of 16-bit pairs from shared memory (the mma fragment loads).
__device__ __forceinline__ void ldmatrix_x4(u32 r[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ u32 as_u32(bf162 v) { return *reinterpret_cast<u32*>(&v); }
__device__ __forceinline__ bf162 as_bf162(u32 v) { return *reinterpret_cast<bf162*>(&v); }

// Q4: byte t of `w` (selected by `sel` = 0x4440 | t) → {s·q_lo + b, s·q_hi + b} as bf16x2.
__device__ __forceinline__ u32 dequant_q4(u32 w, u32 sel, bf162 s2, bf162 b2) {
    const u32 byte = __byte_perm(w, 0u, sel);  // byte t in bits 0..7, zeros above
    const u32 both = byte * 0x1001u;           // and again in bits 12..19: high nibble at 16..19
    const u32 m = nibble_pair(both);           // {128 + lo, 128 + hi}
    const bf162 q = __hsub2(as_bf162(m), __floats2bfloat162_rn(128.0f, 128.0f));  // exact
    return as_u32(__hfma2(q, s2, b2));
}

// Q8: bytes 2h, 2h+1 of `w` (selectors sel_lo = 0x7440 | 2h, sel_hi = 0x7440 | (2h+1) pick the
// byte and the 0x4B of 0x4B000000: fp32 2²³ + q) → {s·q_lo + b, s·q_hi + b} as bf16x2.
__device__ __forceinline__ u32 dequant_q8(u32 w, u32 sel_lo, u32 sel_hi, float s, float b) {
    const float lo = __uint_as_float(__byte_perm(w, 0x4B000000u, sel_lo)) - 8388608.0f;
    const float hi = __uint_as_float(__byte_perm(w, 0x4B000000u, sel_hi)) - 8388608.0f;
    return as_u32(__floats2bfloat162_rn(fmaf(lo, s, b), fmaf(hi, s, b)));
}

// Physical 16-byte chunk of logical chunk c in row r of a Q8 weight tile (rows of 64 bytes): read
// 8 rows at a time (rows g = 0..7 of a fragment), rows g and g + 2 would share banks unswizzled.
__device__ __forceinline__ int q8_chunk(int c, int r) { return c ^ ((r >> 1) & 3); }

// Epilogue store of two adjacent outputs: y[col], y[col + 1] of a row `n` wide, as one bf16x2
// store when n is even (the pair is then 4-byte aligned), else one by one; columns ≥ n are skipped.
__device__ __forceinline__ void store_pair(bf16* row, int col, int n, float v0, float v1) {
    if (n % 2 == 0 && col + 1 < n) {
        *reinterpret_cast<bf162*>(row + col) = __floats2bfloat162_rn(v0, v1);
    } else {
        if (col < n) row[col] = __float2bfloat16_rn(v0);
        if (col + 1 < n) row[col + 1] = __float2bfloat16_rn(v1);
    }
}

// The block's tile: matrix `mat`, positions p0 .. p0 + rows − 1 (rows ≤ bm), from the grouped tile
// map or, for a dense product, blockIdx.x. False for a grouped block past the tiles in use, which
// then exits before any barrier.
__device__ __forceinline__ bool block_tile(const GemmArgs& a, int bm, int& mat, int& p0, int& rows) {
    mat = 0;
    if (a.tiles) {
        if ((int)blockIdx.x >= *a.num_tiles) return false;
        const int4 tile = a.tiles[blockIdx.x];
        mat = min(max(tile.x, 0), a.count - 1);
        p0 = tile.y;
        rows = min(tile.z, bm);
    } else {
        p0 = blockIdx.x * bm;
        rows = min(bm, a.x_rows - p0);
    }
    return true;
}

// The X row (gathered) and the Y row (scattered) of each of the tile's bm rows, −1 past `rows`.
__device__ __forceinline__ void token_rows(const GemmArgs& a, int bm, int p0, int rows, int* a_row_s, int* c_row_s) {
    for (int r = threadIdx.x; r < bm; r += blockDim.x) {
        int xr = -1, yr = -1;
        if (r < rows) {
            const int p = p0 + r;
            xr = a.a_rows ? a.a_rows[p] / a.a_div : p;
            yr = a.c_rows ? a.c_rows[p] : p;
            xr = min(max(xr, 0), a.x_rows - 1);
            yr = min(max(yr, 0), a.y_rows - 1);
        }
        a_row_s[r] = xr;
        c_row_s[r] = yr;
    }
}

}  // namespace
