// Prefill matrix products of an FP8 checkpoint on Hopper's FP8 tensor cores (issue 11): weights as
// the checkpoint ships them (e4m3, one fp32 multiplier per 128 × 128 block, MODEL.md §5.3) and the
// activations quantised per token and group of 128 columns (quantize_fp8_rows), the scheme of
// transformers' FP8 layers and of vLLM for this checkpoint:
//
//     y[tok][row] = Σ_kb  ws[row / 128][kb] · xs[tok][kb] · Σ_(k in block kb) w[row][k] · x[tok][k]
//
// The same arguments, tile map, grid and epilogues as gemm_wgmma.cu (tables from
// gemm_prefill.cuh), with no dequantisation: both operands go to the tensor cores as they are.
//
// Block: 2 warpgroups (256 threads), tile of 128 weight rows (one scale block) × up to 128 token
// rows; warpgroup q owns weight rows 64q..64q+63 and issues m64nNk32 products (N = 128 tokens, or
// 64 for a tile of at most 64 rows). k-tiles of 128 columns (one scale block along K) stream
// through STAGES shared-memory stages by cp.async: the X tile (N rows × 128 bytes) and the weight
// tile (128 rows × 128 bytes), both K-major in the 128-byte swizzle (wgmma reads both through
// descriptors), the tile's token scales and its weight scales. Per k-tile each warpgroup runs its
// four k32 products into t (the first with scale-d 0) and adds t · ws · xs to the running sum d:
// the k-tile's scales differ, so each block's products are summed apart (DeepSeek-V3's
// "promotion"; it also bounds how many products the tensor cores sum at their reduced internal
// precision). k-tiles go in pairs into two register sets, so the first one's promotion runs
// beside the second one's products.
//
// Accumulators (m64nN): d[4i + e] = D[row 16w + g + 8(e/2)][token 8i + 2t + e%2].
// SWIGLU tiles put gate row j at tile row 16w + g and the up row of the same j at 16w + g + 8.
#include "gemm_prefill.cuh"
#include "wgmma.cuh"

namespace {

enum Epilogue { STORE = 0, SWIGLU = 1 };

constexpr int BM = 128;       // token rows per tile, at most (wgmma N)
constexpr int BN = 128;       // weight rows per tile: 2 warpgroups × wgmma M = 64; one scale block
constexpr int BK = 128;       // k-tile: one scale block, 128 bytes per row
constexpr int QBLOCK = 128;   // FP8 scale blocks: weights 128 × 128, activations 1 × 128
constexpr int THREADS = 256;  // 2 warpgroups
constexpr int STAGES = 6;      // k-tiles in shared memory: 3 pairs
constexpr int PAIRS_AHEAD = STAGES / 2 - 1;  // pairs loading while one is multiplied
constexpr int X_BYTES = BM * BK;
constexpr int W_OFF = X_BYTES;                // weight tile
constexpr int XS_OFF = W_OFF + BN * BK;       // token scales [BM] fp32
constexpr int WS_OFF = XS_OFF + BM * 4;       // weight scales [2] fp32: gate (or only) and up block
constexpr int STAGE_BYTES = (WS_OFF + 16 + 1023) / 1024 * 1024;  // tiles stay 1024-byte aligned
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 1024;          // gemm_fp8.rs: SHARED_BYTES
static_assert(SMEM_BYTES + 1024 <= 227 * 1024, "one block per SM must fit");

// Four values as e4m3 bytes (v0 in the lowest), nearest even, saturating at ±448.
__device__ __forceinline__ u32 e4m3x4(float v0, float v1, float v2, float v3) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(v1), "f"(v0));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(v3), "f"(v2));
    return (u32)lo | ((u32)hi << 16);
}

}  // namespace

// Kernel arguments, mirrored by `Fp8GemmArgs` in gemm_fp8.rs: the table fields of GemmArgs (its
// w, scales, biases and x unused), then the FP8 operands.
struct Fp8GemmArgs {
    GemmArgs g;
    const unsigned char* wq;  // [count][n][k] e4m3
    const float* ws;          // [count][ceil(n / 128)][k / 128]
    const unsigned char* xq;  // [x_rows][k] e4m3 (quantize_fp8_rows)
    const float* xs;          // [x_rows][k / 128]
};

namespace {

// The block's products for a tile of `rows` ≤ N token rows of matrix `mat` (row tables in place).
template <int E, int N>
__device__ __forceinline__ void products(const Fp8GemmArgs& a, int mat, int rows, const int* a_row_s,
                                         const int* c_row_s) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    constexpr int X_CHUNKS = N * (BK / 16) / THREADS;   // X chunks per thread per k-tile: 4 or 2
    constexpr int W_CHUNKS = BN * (BK / 16) / THREADS;  // 4
    const int tid = threadIdx.x, warp = tid / 32, t = tid % 4;
    const int col_tile = blockIdx.y, n = a.g.n, k = a.g.k, kb = k / BK;
    const unsigned char* wmat = a.wq + (i64)mat * n * k;

    // What this thread copies per k-tile: X chunk tid % 8 of rows tid / 8 + 32u, weight chunk
    // tid % 8 of rows tid / 8 + 32u, the token scale of tile row tid (tid < N) and, in the last
    // two threads, the weight scales of the tile's gate (or only) block and its up block.
    const int c = tid % 8, r0 = tid / 8;
    // Sources at k-tile 0 (each k-tile is BK bytes further) and destinations within a stage,
    // computed once: rebuilt per k-tile they were a third of the loop's instructions.
    const unsigned char* x_src[X_CHUNKS];
    const unsigned char* w_src[W_CHUNKS];
    bool x_ok[X_CHUNKS], w_ok[W_CHUNKS];
#pragma unroll
    for (int u = 0; u < X_CHUNKS; ++u) {
        const int xr = a_row_s[r0 + 32 * u];
        x_ok[u] = xr >= 0;
        x_src[u] = a.xq + (i64)max(xr, 0) * k + c * 16;
    }
#pragma unroll
    for (int u = 0; u < W_CHUNKS; ++u) {
        const int wr = tile_weight_row<E == SWIGLU, BN>(r0 + 32 * u, col_tile, n);
        w_ok[u] = wr >= 0;
        w_src[u] = wmat + (i64)max(wr, 0) * k + c * 16;
    }
    // Chunk c of tile row r sits at r·128 + ((c ^ r % 8) << 4); rows r0 + 32u share r % 8.
    const u32 chunk_dst = r0 * 128 + ((c ^ (r0 & 7)) << 4);
    const int xs_row = tid < N ? a_row_s[tid] : -1;
    const float* xs_src = a.xs + (i64)max(xs_row, 0) * kb;
    const float* ws_src = a.ws;
    bool ws_ok = false;  // the last two threads: the tile's gate (or only) and up block scales
    if (tid >= THREADS - 2) {
        const int h = tid - (THREADS - 2);
        const int row = tile_weight_row<E == SWIGLU, BN>(E == SWIGLU && h == 1 ? 8 : 0, col_tile, n);
        ws_ok = row >= 0;
        ws_src += (i64)(mat * ((n + QBLOCK - 1) / QBLOCK) + max(row, 0) / QBLOCK) * kb;
    }

    const u32 raw = smem_u32(smem_raw);
    const u32 base = (raw + 1023) & ~1023u;
    const unsigned char* smem = smem_raw + (base - raw);
    auto stage = [&](int s) { return base + s * STAGE_BYTES; };

    auto load_tile = [&](int kt, int s) {
        const u32 st = stage(s);
#pragma unroll
        for (int u = 0; u < X_CHUNKS; ++u) cp_async16(st + chunk_dst + u * 32 * 128, x_src[u] + kt * BK, x_ok[u]);
#pragma unroll
        for (int u = 0; u < W_CHUNKS; ++u) cp_async16(st + W_OFF + chunk_dst + u * 32 * 128, w_src[u] + kt * BK, w_ok[u]);
        if (tid < N) cp_async4(st + XS_OFF + tid * 4, xs_src + kt, xs_row >= 0);
        if (tid >= THREADS - 2) cp_async4(st + WS_OFF + (tid - (THREADS - 2)) * 4, ws_src + kt, ws_ok);
    };

    // Warpgroup q's A operand: weight rows 64q..64q+63 of the stage's tile, K-major in the same
    // 128-byte swizzle as X (a multiple of 1024 bytes in, so the swizzle phase is unchanged).
    const u32 a_off = W_OFF + (warp / 4) * 64 * BK;

    const int KT = kb;
    // Two accumulator sets: k-tile 2j runs into acc0 and 2j + 1 into acc1, issued together; acc0
    // is promoted while the tensor cores still run acc1's products. (Overlap across turns of the
    // loop — k-tile kt + 1 issued before kt's promotion — makes ptxas serialize every wgmma: it
    // does not follow which group a wait retires across the loop's back edge.)
    float d[N / 2], acc0[N / 2], acc1[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) d[i] = 0.0f;

    auto issue = [&](int kt, float* acc) {
        const u32 st = stage(kt % STAGES);
        wgmma_fence();  // after this thread's last reads of acc (its promotion)
#pragma unroll
        for (int s = 0; s < 4; ++s) wgmma_fp8_k32<N>(acc, smem_desc(st + a_off + s * 32), smem_desc(st + s * 32), s);
        wgmma_commit();
    };
    // d += t · ws · xs, the row's block scale times the token's group scale.
    auto promote = [&](int kt, float* acc) {
        fence_accumulators<N>(acc);
        const float* scales = reinterpret_cast<const float*>(smem + (kt % STAGES) * STAGE_BYTES);
        const float w_lo = scales[WS_OFF / 4], w_hi = scales[WS_OFF / 4 + (E == SWIGLU ? 1 : 0)];
#pragma unroll
        for (int i = 0; i < N / 8; ++i) {
            const float2 xs = *reinterpret_cast<const float2*>(scales + XS_OFF / 4 + 8 * i + 2 * t);
            d[4 * i + 0] += acc[4 * i + 0] * (w_lo * xs.x);
            d[4 * i + 1] += acc[4 * i + 1] * (w_lo * xs.y);
            d[4 * i + 2] += acc[4 * i + 2] * (w_hi * xs.x);
            d[4 * i + 3] += acc[4 * i + 3] * (w_hi * xs.y);
        }
    };
    // k-tiles move in pairs, one cp.async group each, PAIRS_AHEAD pairs in flight. Pair j has
    // landed everywhere once this thread has at most PAIRS_AHEAD − 1 newer groups pending and the
    // block has met; every warp is then past pair j − 1's promotions, whose stages take pair
    // j + PAIRS_AHEAD.
    auto load_pair = [&](int j) {
        if (2 * j < KT) load_tile(2 * j, (2 * j) % STAGES);
        if (2 * j + 1 < KT) load_tile(2 * j + 1, (2 * j + 1) % STAGES);
        cp_async_commit();  // possibly empty: keeps the group count uniform for the waits
    };
    auto arrive = [&](int j) {
        cp_async_wait<PAIRS_AHEAD - 1>();
        fence_async_shared();  // the copies visible to the tensor cores
        __syncthreads();
        load_pair(j + PAIRS_AHEAD);
    };
#pragma unroll
    for (int j = 0; j < PAIRS_AHEAD; ++j) load_pair(j);
#pragma unroll 1
    for (int j = 0; j < KT / 2; ++j) {
        arrive(j);
        issue(2 * j, acc0);
        issue(2 * j + 1, acc1);
        wgmma_wait<1>();
        promote(2 * j, acc0);
        wgmma_wait<0>();
        promote(2 * j + 1, acc1);
    }
    if (KT % 2 == 1) {  // a last, single k-tile
        arrive(KT / 2);
        issue(KT - 1, acc0);
        wgmma_wait<0>();
        promote(KT - 1, acc0);
    }
    cp_async_wait<0>();

    store_accumulators<E == SWIGLU, N, BN>(a.g.y, n, d, rows, col_tile, c_row_s);
}

template <int E>
__device__ __forceinline__ void gemm(const Fp8GemmArgs& a) {
    __shared__ int a_row_s[BM];
    __shared__ int c_row_s[BM];
    int mat, p0, rows;
    if (!block_tile(a.g, BM, mat, p0, rows)) return;  // the whole block: before any barrier
    token_rows(a.g, BM, p0, rows, a_row_s, c_row_s);
    __syncthreads();
    // The tile's height decides N for the whole block.
    if (rows > 64) products<E, 128>(a, mat, rows, a_row_s, c_row_s);
    else products<E, 64>(a, mat, rows, a_row_s, c_row_s);
}

}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS, 1) wgmma_fp8(const Fp8GemmArgs a) {
    pdl_wait();
    pdl_launch_dependents();
    gemm<STORE>(a);
}
extern "C" __global__ void __launch_bounds__(THREADS, 1) wgmma_swiglu_fp8(const Fp8GemmArgs a) {
    pdl_wait();
    pdl_launch_dependents();
    gemm<SWIGLU>(a);
}

// x bf16 [rows][k] → xq e4m3 [rows][k] and xs fp32 [rows][k / 128], one warp per (row, group of 128
// columns): xs = max(amax, 1e-10) / 448, xq = e4m3(x / xs), nearest even, saturating (the amax floor
// keeps an all-zero group finite). e4m3_from_f32 in checkpoint/fp8.rs is the CPU's same rounding.
extern "C" __global__ void quantize_fp8_rows(const bf16* x, unsigned char* xq, float* xs, int rows, int k) {
    pdl_wait();
    pdl_launch_dependents();
    const int groups = k / QBLOCK;
    const i64 gid = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (gid >= (i64)rows * groups) return;  // whole warps
    const int lane = threadIdx.x % 32;
    const i64 at = gid / groups * k + gid % groups * QBLOCK + lane * 4;
    const uint2 raw = *reinterpret_cast<const uint2*>(x + at);
    const float2 v01 = __bfloat1622float2(*reinterpret_cast<const bf162*>(&raw.x));
    const float2 v23 = __bfloat1622float2(*reinterpret_cast<const bf162*>(&raw.y));
    float amax = fmaxf(fmaxf(fabsf(v01.x), fabsf(v01.y)), fmaxf(fabsf(v23.x), fabsf(v23.y)));
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    const float scale = fmaxf(amax, 1e-10f) / 448.0f;
    *reinterpret_cast<u32*>(xq + at) = e4m3x4(v01.x / scale, v01.y / scale, v23.x / scale, v23.y / scale);
    if (lane == 0) xs[gid] = scale;
}
