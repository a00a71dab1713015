// Decode matrix-vector products: y[n][r] = Σ_c W[r][c] · x[n][c] for up to 8 tokens n at once,
// with W in bf16 or in MLX affine 4/8-bit form (spec/MODEL.md §5.1), dequantised inside the product.
//
// How it works (one warp = one tile of 16 rows × a slice of K; fp32 accumulation throughout):
//
// * The products run on the tensor cores (mma.m16n8k16, bf16 in, fp32 out): A = 16 weight rows,
//   B = up to 8 token vectors (batch-1 decode uses one column of 8). This costs far fewer
//   instructions than scalar FMAs, which matters because a 4-bit GEMV must turn ~25 weights per SM
//   per clock into products to keep up with HBM.
// * A 4-bit value q becomes a bf16 with one AND/OR: (q | 0x4300) is the bf16 number 128 + q, exactly.
//   Two nibbles land in one 32-bit register (one per half), ready as an mma operand. The extra
//   128·x per product is removed afterwards from the fp32 sum, using Σx of the group.
// * The scale and bias are applied per group of 64 columns, to the fp32 sum of that group:
//       Σ_c (s·q_c + b)·x_c = s · (Σ_c (128 + q_c)·x_c − 128·Σ_c x_c) + b · Σ_c x_c
//   so every mma's 16 k-values must come from one group: in a tile iteration the 4 lanes of an mma
//   quad share one group, each lane taking a quarter of it (Q4: 8 bytes per row, Q8 and bf16: 16).
// * 8-bit values are split into two nibbles; the high nibble's mma column holds 16·x (exact in
//   bf16), so Q8 needs no other instructions than Q4. Its magic sum is 128·(1 + 16) per column.
// * x is staged once per block in shared memory, already permuted into the order the mma operands
//   need, with the per-group sums Σx; the tile's scales and biases are staged there too, read from
//   DRAM as one contiguous block. The first batch of weight loads is issued before that staging so
//   their DRAM latency overlaps it.
// * Several warps split K for one tile (more loads in flight for short matrices) and reduce
//   through shared memory; a block may hold several tiles. The host picks both (gemm.rs).
// * Batches: blockIdx.y is a slot; slot s multiplies matrix ids[s] (or s) of a stack (e.g. the
//   experts of a layer) with the x of slot s (or one shared x), writing its own output.
//
// mma.m16n8k16 operand layout (PTX ISA), lane = 4·g + t:
//   A regs: {row g, k 2t..2t+1}, {row g+8, k 2t..2t+1}, {row g, k 2t+8..9}, {row g+8, k 2t+8..9}
//   B regs: {k 2t..2t+1, col g}, {k 2t+8..9, col g};   C: {row g, col 2t..2t+1}, {row g+8, ...}
// Which weight column sits in which k-slot is free, as long as A and B agree: lane t's k-slots
// always hold lane t's own columns, and x is staged in the matching order.
#include "common.cuh"

namespace {

enum Format { Q4 = 0, Q8 = 1, BF16 = 2 };

constexpr int TILE_ROWS = 16;
constexpr int MAX_TOKENS = 8;  // mma N
constexpr int BATCH = 4;       // iterations whose loads are issued together

// WORDS: 32-bit words a lane loads per row per iteration. COLS: columns one iteration covers
// (4 lanes × WORDS words). STAGE: bytes of staged x per weight word. MAGIC: Σ of the bf16 magic
// offsets per unit of x (see above), for the quantised formats.
template <int F> struct Fmt;
template <> struct Fmt<Q4> {
    static constexpr int WORDS = 2, COLS = 64, STAGE = 16;
    static constexpr float MAGIC = 128.0f;
};
template <> struct Fmt<Q8> {
    static constexpr int WORDS = 4, COLS = 64, STAGE = 16;
    static constexpr float MAGIC = 128.0f * 17.0f;
};
template <> struct Fmt<BF16> {
    static constexpr int WORDS = 4, COLS = 32, STAGE = 4;  // no MAGIC: bf16 weights need no offset
};

}  // namespace

// Kernel arguments, mirrored by `GemvArgs` in gemm.rs (same order, same sizes).
struct GemvArgs {
    const u32* w;        // matrix m starts at w + m * w_mat_words; rows are K·bits/32 words
    const bf16* scales;  // [count][rows][K/64] (unused for bf16)
    const bf16* biases;  // [count][rows][K/64] (unused for bf16)
    const bf16* x;       // slot s reads x + s·x_slot_stride, laid out [ntok][K]
    bf16* y;             // slot s writes y + s·ntok·rows, laid out [ntok][rows]
    const int* ids;      // matrix of each slot, clamped to [0, count); null: slot s uses matrix s
    i64 w_mat_words;
    i64 x_slot_stride;
    int rows, cols, ntok, tiles_per_block, warps_per_tile, count;
};

namespace {

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

__device__ __forceinline__ void mma(float d[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 perm(u32 a, u32 b, u32 sel) { return __byte_perm(a, b, sel); }

__device__ __forceinline__ u32 times16(u32 pair) {
    bf162 p = __hmul2(*reinterpret_cast<bf162*>(&pair), __floats2bfloat162_rn(16.0f, 16.0f));
    return *reinterpret_cast<u32*>(&p);
}

// The weights of BATCH iterations for the two rows (g, g+8) a lane feeds into the mma.
template <int F> struct Batch {
    u32 w[BATCH][2][Fmt<F>::WORDS];
};

template <int F>
__device__ __forceinline__ void load_batch(Batch<F>& b, const u32* row_g, const u32* row_g8, int it0, int it_end, int t) {
    constexpr int W = Fmt<F>::WORDS;
#pragma unroll
    for (int k = 0; k < BATCH; ++k) {
        if (it0 + k >= it_end) break;
        const int off = (it0 + k) * 4 * W + t * W;
        if constexpr (W == 2) {
            const uint2 a = __ldg(reinterpret_cast<const uint2*>(row_g + off));
            const uint2 c = __ldg(reinterpret_cast<const uint2*>(row_g8 + off));
            b.w[k][0][0] = a.x, b.w[k][0][1] = a.y, b.w[k][1][0] = c.x, b.w[k][1][1] = c.y;
        } else {
            const uint4 a = __ldg(reinterpret_cast<const uint4*>(row_g + off));
            const uint4 c = __ldg(reinterpret_cast<const uint4*>(row_g8 + off));
            b.w[k][0][0] = a.x, b.w[k][0][1] = a.y, b.w[k][0][2] = a.z, b.w[k][0][3] = a.w;
            b.w[k][1][0] = c.x, b.w[k][1][1] = c.y, b.w[k][1][2] = c.z, b.w[k][1][3] = c.w;
        }
    }
}

template <int F>
__device__ void gemv(const GemvArgs& a) {
    using T = Fmt<F>;
    constexpr bool QUANT = F != BF16;
    const int K = a.cols, ntok = a.ntok;
    const int iters = K / T::COLS, ngroups = K / 64;
    const int words_per_row = iters * 4 * T::WORDS;
    const int kw = a.warps_per_tile, tb = a.tiles_per_block;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int tile = warp / kw, kwarp = warp % kw;
    const int slot = blockIdx.y;
    const int mat = a.ids ? min(max(a.ids[slot], 0), a.count - 1) : slot;
    const int block_row0 = blockIdx.x * tb * TILE_ROWS;
    const int row0 = block_row0 + tile * TILE_ROWS;
    // Rows past the end are clamped for loading and never stored.
    const int rg = min(row0 + g, a.rows - 1), rg8 = min(row0 + g + 8, a.rows - 1);
    const u32* wmat = a.w + mat * a.w_mat_words;

    // This warp's contiguous run of iterations.
    const int per_warp = (iters + kw - 1) / kw;
    const int it_begin = kwarp * per_warp, it_end = min(iters, it_begin + per_warp);
    const u32* row_g = wmat + (i64)rg * words_per_row;
    const u32* row_g8 = wmat + (i64)rg8 * words_per_row;
    Batch<F> cur;
    load_batch<F>(cur, row_g, row_g8, it_begin, it_end, t);

    // Shared memory, in this order (sizes must match gemv_smem_bytes in gemm.rs):
    //   staged x  [ntok][words_per_row · STAGE + 16]  (+16: consecutive tokens on other banks)
    //   xsum      [ngroups][MAX_TOKENS] fp32          (quantised formats)
    //   sb        [tb·16 rows][ngroups + 1] fp32 (scale, bias) (quantised; +1: rows g and g+1
    //             on neighbouring banks, else the 8 rows a warp reads would share one bank)
    //   red       [warps][MAX_TOKENS · 16] fp32
    extern __shared__ __align__(16) unsigned char smem[];
    const int stage_tok = words_per_row * T::STAGE + 16;
    unsigned char* xstage = smem;
    float* xsum = reinterpret_cast<float*>(smem + ntok * stage_tok);
    float2* sb = reinterpret_cast<float2*>(xsum + (QUANT ? ngroups * MAX_TOKENS : 0));
    const int sb_stride = ngroups + 1;
    float* red = reinterpret_cast<float*>(sb + (QUANT ? tb * TILE_ROWS * sb_stride : 0));

    // Stage x: each thread takes 8 columns (one uint4) per step. 8 consecutive threads cover one
    // group of 64, so Σx of a group is a shuffle over 8 lanes; all lanes run the same number of
    // steps so the shuffle never sees an inactive lane.
    {
        const bf16* x = a.x + slot * a.x_slot_stride;
        const int vec_per_tok = K / 8, total = ntok * vec_per_tok;
        const int steps = (total + blockDim.x - 1) / blockDim.x;
        for (int s = 0; s < steps; ++s) {
            const int i = s * blockDim.x + threadIdx.x;
            const bool ok = i < total;
            const int tok = ok ? i / vec_per_tok : 0, v = ok ? i % vec_per_tok : 0;
            const uint4 xv = ok ? __ldg(reinterpret_cast<const uint4*>(x + (i64)tok * K) + v) : make_uint4(0, 0, 0, 0);
            uint4* dst = reinterpret_cast<uint4*>(xstage + tok * stage_tok);
            if (ok) {
                if constexpr (F == Q4) {
                    // One word covers columns 8v..8v+7; pairs {0,4}, {1,5}, {2,6}, {3,7}.
                    dst[v] = make_uint4(perm(xv.x, xv.z, 0x5410), perm(xv.x, xv.z, 0x7632),
                                        perm(xv.y, xv.w, 0x5410), perm(xv.y, xv.w, 0x7632));
                } else if constexpr (F == Q8) {
                    // Two words (columns 8v..8v+3, 8v+4..8v+7); per word {x0,x2}, 16·{x0,x2}, {x1,x3}, 16·{x1,x3}.
                    const u32 p02 = perm(xv.x, xv.y, 0x5410), p13 = perm(xv.x, xv.y, 0x7632);
                    const u32 p46 = perm(xv.z, xv.w, 0x5410), p57 = perm(xv.z, xv.w, 0x7632);
                    dst[2 * v] = make_uint4(p02, times16(p02), p13, times16(p13));
                    dst[2 * v + 1] = make_uint4(p46, times16(p46), p57, times16(p57));
                } else {
                    dst[v] = xv;  // bf16 pairs are already in column order
                }
            }
            if constexpr (QUANT) {
                float f[8];
                unpack8(xv, f);
                float sum = ((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]));
                sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                sum += __shfl_xor_sync(0xffffffffu, sum, 2);
                sum += __shfl_xor_sync(0xffffffffu, sum, 4);
                if (ok && v % 8 == 0) xsum[(v / 8) * MAX_TOKENS + tok] = sum;
            }
        }
        if constexpr (QUANT) {
            for (int i = threadIdx.x; i < ngroups * MAX_TOKENS; i += blockDim.x)
                if (i % MAX_TOKENS >= ntok) xsum[i] = 0.0f;
            const bf16* s = a.scales + (i64)mat * a.rows * ngroups;
            const bf16* b = a.biases + (i64)mat * a.rows * ngroups;
            for (int i = threadIdx.x; i < tb * TILE_ROWS * ngroups; i += blockDim.x) {
                const i64 at = (i64)min(block_row0 + i / ngroups, a.rows - 1) * ngroups + i % ngroups;
                sb[(i / ngroups) * sb_stride + i % ngroups] = make_float2(__bfloat162float(s[at]), __bfloat162float(b[at]));
            }
        }
    }
    __syncthreads();

    // Main loop. acc: C fragment, {row g, tokens 2t, 2t+1}, {row g+8, tokens 2t, 2t+1}.
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const unsigned char* my_x = xstage + g * stage_tok;  // this lane's B column is token g
    for (int it0 = it_begin; it0 < it_end; it0 += BATCH) {
        Batch<F> next;
        if (it0 + BATCH < it_end) load_batch<F>(next, row_g, row_g8, it0 + BATCH, it_end, t);
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            const int it = it0 + k;
            if (it >= it_end) break;
            // B operands: this lane's staged x for its WORDS words (zeros for absent tokens).
            constexpr int NB = T::WORDS * T::STAGE / 4;
            u32 bx[NB];
            const uint4* src = reinterpret_cast<const uint4*>(my_x + (it * 4 * T::WORDS + t * T::WORDS) * T::STAGE);
#pragma unroll
            for (int j = 0; j < NB / 4; ++j) {
                const uint4 v = g < ntok ? src[j] : make_uint4(0, 0, 0, 0);
                bx[4 * j] = v.x, bx[4 * j + 1] = v.y, bx[4 * j + 2] = v.z, bx[4 * j + 3] = v.w;
            }
            const u32(*wr)[T::WORDS] = cur.w[k];
            if constexpr (QUANT) {
                float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int j = 0; j < T::WORDS; ++j) {
                    u32 q[4], q8[4];
                    expand_nibbles(wr[0][j], q);
                    expand_nibbles(wr[1][j], q8);
                    mma(d, q[0], q8[0], q[1], q8[1], bx[4 * j], bx[4 * j + 1]);
                    mma(d, q[2], q8[2], q[3], q8[3], bx[4 * j + 2], bx[4 * j + 3]);
                }
                // Group `it`: scale and bias of rows g, g+8; Σx of tokens 2t, 2t+1.
                // acc += s · (d − MAGIC·Σx) + b · Σx, as three FMAs.
                const float2 sb0 = sb[(tile * TILE_ROWS + g) * sb_stride + it];
                const float2 sb8 = sb[(tile * TILE_ROWS + g + 8) * sb_stride + it];
                const float2 xs = *reinterpret_cast<const float2*>(xsum + it * MAX_TOKENS + 2 * t);
                acc[0] = fmaf(sb0.x, fmaf(-T::MAGIC, xs.x, d[0]), fmaf(sb0.y, xs.x, acc[0]));
                acc[1] = fmaf(sb0.x, fmaf(-T::MAGIC, xs.y, d[1]), fmaf(sb0.y, xs.y, acc[1]));
                acc[2] = fmaf(sb8.x, fmaf(-T::MAGIC, xs.x, d[2]), fmaf(sb8.y, xs.x, acc[2]));
                acc[3] = fmaf(sb8.x, fmaf(-T::MAGIC, xs.y, d[3]), fmaf(sb8.y, xs.y, acc[3]));
            } else {
                mma(acc, wr[0][0], wr[1][0], wr[0][1], wr[1][1], bx[0], bx[1]);
                mma(acc, wr[0][2], wr[1][2], wr[0][3], wr[1][3], bx[2], bx[3]);
            }
        }
        cur = next;
    }

    // Sum the K-slices of each tile: red[warp][token][row], then one thread per (tile, token, row).
    float* mine = red + warp * MAX_TOKENS * TILE_ROWS;
    mine[(2 * t) * TILE_ROWS + g] = acc[0];
    mine[(2 * t + 1) * TILE_ROWS + g] = acc[1];
    mine[(2 * t) * TILE_ROWS + g + 8] = acc[2];
    mine[(2 * t + 1) * TILE_ROWS + g + 8] = acc[3];
    __syncthreads();
    bf16* y = a.y + (i64)slot * ntok * a.rows;
    for (int i = threadIdx.x; i < tb * MAX_TOKENS * TILE_ROWS; i += blockDim.x) {
        const int tl = i / (MAX_TOKENS * TILE_ROWS), e = i % (MAX_TOKENS * TILE_ROWS);
        const int n = e / TILE_ROWS, row = block_row0 + tl * TILE_ROWS + e % TILE_ROWS;
        if (n >= ntok || row >= a.rows) continue;
        float sum = 0.0f;
        for (int w = 0; w < kw; ++w) sum += red[(tl * kw + w) * MAX_TOKENS * TILE_ROWS + e];
        y[(i64)n * a.rows + row] = __float2bfloat16_rn(sum);
    }
}

}  // namespace

extern "C" __global__ void gemv_q4(const GemvArgs a) { gemv<Q4>(a); }
extern "C" __global__ void gemv_q8(const GemvArgs a) { gemv<Q8>(a); }
extern "C" __global__ void gemv_bf16(const GemvArgs a) { gemv<BF16>(a); }
