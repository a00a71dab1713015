// Prefill matrix products with 4-bit weights on Hopper's warpgroup tensor cores (wgmma): the same
// products, arguments, tiles and epilogues as gemm_prefill.cu (whose header explains them), a
// different inner loop. The mma.sync kernel there dequantises each weight into a register operand
// of a 16×8×16 product; here one warpgroup (128 threads) issues m64n256k16 products, asynchronous,
// with both operands in shared memory, so the tensor cores work while the threads dequantise the
// next k-tile.
//
// Block tile: 64 token rows (wgmma M) × 256 weight rows (wgmma N), k-tiles of 64 columns (one
// quantisation group). Per k-tile kt:
//   1. cp.async has brought the X tile (64 rows × 128 bytes) and the packed Q4 weights (256 rows
//      × 32 bytes) into stage kt % STAGES, STAGES − 1 k-tiles ahead;
//   2. each thread dequantises weight rows tid and tid + 128 to bf16 (s·q + b, rounded once, as
//      gemm_prefill.cu and MLX compute it) into one of two bf16 weight tiles;
//   3. wait for the products of k-tile kt − 1 (they read the other weight tile and the X stage
//      that is refilled next), refill that stage, then issue the four k16 products of kt.
// Both operand tiles are K-major with the 128-byte swizzle: row r's 16-byte chunk c sits at
// r·128 + ((c ⊕ (r mod 8))·16) in a 1024-byte-aligned tile; a k16 step starts 32 bytes further.
// Shared-memory writes by the threads (cp.async, the dequantised weights) are made visible to the
// tensor cores' asynchronous reads by fence.proxy.async before the barrier that precedes them.
//
// Accumulators (m64n256, fp32): lane (g = lane/4, t = lane%4) of warp w holds, for n8 block i,
// d[4i], d[4i+1] = rows 16w + g, columns 8i + 2t, +1 and d[4i+2], d[4i+3] = rows 16w + g + 8.
// SWIGLU tiles put gate rows j in columns 0..127 and the up rows of the same j in 128..255, so
// one lane holds gate and up of the same (row, j): d[4i + e] and d[4(i + 16) + e].
#include "gemm_prefill.cuh"

namespace {

enum Epilogue { STORE = 0, SWIGLU = 1 };

constexpr int BM = 64;
constexpr int BN = 256;
constexpr int BK = 64;
constexpr int THREADS = 128;  // one warpgroup
constexpr int STAGES = 4;
constexpr int X_BYTES = BM * BK * 2;     // 8 KB
constexpr int WQ_BYTES = BN * BK / 2;    // 8 KB of packed 4-bit weights
constexpr int STAGE_BYTES = X_BYTES + WQ_BYTES;
constexpr int WB_BYTES = BN * BK * 2;    // 32 KB: one k-tile of weights in bf16
// Must match WGMMA_SMEM_BYTES in gemm_prefill.rs: the stages, two bf16 weight tiles, and slack to
// align the start to 1024 bytes (the swizzle pattern repeats every 1024).
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 2 * WB_BYTES + 1024;
static_assert(STAGE_BYTES % 1024 == 0 && WB_BYTES % 1024 == 0, "tiles stay 1024-byte aligned");
static_assert(SMEM_BYTES <= 227 * 1024, "one block per SM must fit");

// Shared-memory matrix descriptor: start address, leading byte offset (unused with a swizzle: 1),
// stride byte offset 1024 (8 rows of 128 bytes), 128-byte swizzle (mode 1 in bits 62-63).
__device__ __forceinline__ u64 smem_desc(u32 addr) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// d += A·Bᵀ for A = 64 rows × 16 (desc_a) and B = 256 rows × 16 (desc_b), both K-major; with
// accumulate = 0, d = A·Bᵀ.
__device__ __forceinline__ void wgmma_m64n256k16(float d[128], u64 desc_a, u64 desc_b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// Keeps the compiler from moving accumulator reads or writes across the asynchronous products.
__device__ __forceinline__ void fence_accumulators(float d[128]) {
#pragma unroll
    for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Global weight row of tile row r (0..255) in column tile `col_tile`, −1 past the matrix.
template <int E> __device__ __forceinline__ int weight_row(int r, int col_tile, int n) {
    if constexpr (E == STORE) {
        const int row = col_tile * BN + r;
        return row < n ? row : -1;
    } else {
        const int half = n / 2, j = col_tile * (BN / 2) + (r & (BN / 2 - 1));
        if (j >= half) return -1;
        return r < BN / 2 ? j : half + j;
    }
}

template <int E>
__device__ __forceinline__ void gemm(const GemmArgs& a) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ int a_row_s[BM];
    __shared__ int c_row_s[BM];
    __shared__ int b_off_s[BN];  // word offset of each weight row in its matrix, −1: none

    int mat, p0, rows;
    if (!block_tile(a, BM, mat, p0, rows)) return;  // the whole block: before any barrier
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int col_tile = blockIdx.y;
    const int row_words = a.k / 8, ngroups = a.k / 64;
    const u32* wmat = a.w + mat * a.w_mat_words;

    token_rows(a, BM, p0, rows, a_row_s, c_row_s);
    // This thread dequantises tile rows tid and tid + 128: their word offsets and scale/bias index.
    i64 sb_off[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = tid + h * THREADS;
        const int row = weight_row<E>(r, col_tile, a.n);
        b_off_s[r] = row < 0 ? -1 : row * row_words;
        sb_off[h] = row < 0 ? -1 : ((i64)mat * a.n + row) * ngroups;
    }
    __syncthreads();

    // 1024-byte-aligned start: stages, then the two bf16 weight tiles.
    const u32 raw = smem_u32(smem_raw);
    const u32 base = (raw + 1023) & ~1023u;
    unsigned char* smem = smem_raw + (base - raw);
    auto x_tile = [&](int s) { return base + s * STAGE_BYTES; };
    auto wq_tile = [&](int s) { return smem + s * STAGE_BYTES + X_BYTES; };
    auto wb_tile = [&](int b) { return base + STAGES * STAGE_BYTES + b * WB_BYTES; };

    // k-tile kt into stage s: X 64 rows × 8 chunks, swizzled; W 256 rows × 2 chunks, plain. Four
    // of each per thread.
    auto load_tile = [&](int kt, int s) {
        const u32 sx = x_tile(s), sw = smem_u32(wq_tile(s));
#pragma unroll
        for (int u = 0; u < BM * 8 / THREADS; ++u) {
            const int r = tid / 8 + u * (THREADS / 8), c = tid % 8;
            const int xr = a_row_s[r];
            const bf16* src = a.x + (i64)max(xr, 0) * a.k + kt * BK + c * 8;
            cp_async16(sx + r * 128 + ((c ^ (r & 7)) << 4), src, xr >= 0);
        }
#pragma unroll
        for (int u = 0; u < BN * 2 / THREADS; ++u) {
            const int r = tid / 2 + u * (THREADS / 2), c = tid % 2;
            const int off = b_off_s[r];
            const u32* src = wmat + max(off, 0) + kt * 8 + c * 4;
            cp_async16(sw + r * 32 + (c << 4), src, off >= 0);
        }
    };
    // {scale, bias} of this thread's two rows for k-tile kt as bf16 pairs (zeros for absent rows).
    auto load_sb = [&](int kt, u32 out[2]) {
        const unsigned short* s = reinterpret_cast<const unsigned short*>(a.scales);
        const unsigned short* b = reinterpret_cast<const unsigned short*>(a.biases);
#pragma unroll
        for (int h = 0; h < 2; ++h)
            out[h] = sb_off[h] < 0 ? 0u : (u32)__ldg(s + sb_off[h] + kt) | ((u32)__ldg(b + sb_off[h] + kt) << 16);
    };
    // Rows tid, tid + 128 of stage s, dequantised into bf16 weight tile `b`: word w of a row holds
    // columns 8w .. 8w+7, which become its 16-byte chunk w.
    auto dequantise = [&](int s, int b, const u32 sb[2]) {
        unsigned char* dst = smem + (wb_tile(b) - base);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = tid + h * THREADS;
            const uint4* src = reinterpret_cast<const uint4*>(wq_tile(s) + r * 32);
            const uint4 lo = src[0], hi = src[1];
            const u32 words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
            const bf162 s2 = as_bf162(__byte_perm(sb[h], 0u, 0x1010));  // {s, s}
            const bf162 b2 = as_bf162(__byte_perm(sb[h], 0u, 0x3232));  // {b, b}
#pragma unroll
            for (int w = 0; w < 8; ++w) {
                const uint4 v = make_uint4(dequant_q4(words[w], 0x4440u, s2, b2), dequant_q4(words[w], 0x4441u, s2, b2),
                                           dequant_q4(words[w], 0x4442u, s2, b2), dequant_q4(words[w], 0x4443u, s2, b2));
                *reinterpret_cast<uint4*>(dst + r * 128 + ((w ^ (r & 7)) << 4)) = v;
            }
        }
    };

    const int KT = a.k / BK;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) load_tile(s, s);
        cp_async_commit();  // possibly empty: keeps the group count uniform for the waits below
    }
    u32 sb_cur[2], sb_next[2] = {0u, 0u};
    load_sb(0, sb_cur);

    float d[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = 0.0f;

    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<STAGES - 2>();  // this thread's copies of k-tile kt have landed ...
        __syncthreads();              // ... and everyone's
        if (kt + 1 < KT) load_sb(kt + 1, sb_next);
        dequantise(kt % STAGES, kt & 1, sb_cur);
        fence_async_shared();  // this thread's copies and dequantised weights, for the tensor cores
        wgmma_wait_all();      // the products of k-tile kt − 1 are done ...
        fence_accumulators(d);
        __syncthreads();       // ... in every warp, and every thread's weights for kt are written
        const int next = kt + STAGES - 1;
        if (next < KT) load_tile(next, next % STAGES);  // into the stage k-tile kt − 1 used
        cp_async_commit();

        wgmma_fence();
        const u32 xa = x_tile(kt % STAGES), wb = wb_tile(kt & 1);
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) wgmma_m64n256k16(d, smem_desc(xa + ks * 32), smem_desc(wb + ks * 32), 1);
        wgmma_commit();
        fence_accumulators(d);  // nothing may touch them until the wait above, next k-tile
        sb_cur[0] = sb_next[0];
        sb_cur[1] = sb_next[1];
    }
    wgmma_wait_all();
    fence_accumulators(d);
    cp_async_wait<0>();

    // Epilogue: lane holds rows 16w + g (+8) and columns 8i + 2t, +1 (see the top).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = 16 * warp + g + 8 * h;
        if (r >= rows) continue;
        if constexpr (E == STORE) {
            const int n = a.n;
            bf16* yrow = a.y + (i64)c_row_s[r] * n;
#pragma unroll
            for (int i = 0; i < BN / 8; ++i) {
                const int col = col_tile * BN + 8 * i + 2 * t;
                store_pair(yrow, col, n, d[4 * i + 2 * h], d[4 * i + 2 * h + 1]);
            }
        } else {
            const int half = a.n / 2;
            bf16* yrow = a.y + (i64)c_row_s[r] * half;
#pragma unroll
            for (int i = 0; i < BN / 16; ++i) {
                const int col = col_tile * (BN / 2) + 8 * i + 2 * t;
                const int gi = 4 * i + 2 * h, ui = 4 * (i + BN / 16) + 2 * h;
                const float v0 = silu(d[gi]) * d[ui];
                const float v1 = silu(d[gi + 1]) * d[ui + 1];
                store_pair(yrow, col, half, v0, v1);
            }
        }
    }
}

}  // namespace

#define WGMMA_KERNEL(name, E) \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) name(const GemmArgs a) { pdl_wait(); pdl_launch_dependents(); gemm<E>(a); }

WGMMA_KERNEL(wgmma_q4, STORE)
WGMMA_KERNEL(wgmma_swiglu_q4, SWIGLU)
