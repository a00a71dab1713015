// Prefill matrix products on the tensor cores: Y[p][n] = Σ_k X[p][k] · W[n][k] for many token rows
// p at once, W in bf16 or MLX affine 4/8-bit (group 64, bf16 scales and biases, spec/MODEL.md §5.1),
// dequantised on its way from shared memory into the mma operands (never into global memory).
// The same kernel serves the dense projections and the experts of a MoE layer (grouped GEMM).
//
// Work split. A block computes a tile of BM = 16·MI rows p (tokens, or an expert's rows) × 256
// weight rows n, marching over K in k-tiles of 64 columns, which is exactly one quantisation group.
// Its 4 warps each own 64 of the 256 weight rows and all BM token rows: a warp tile of BM × 64 is
// MI m16 × 8 n8 mma tiles (mma.m16n8k16, bf16 in, fp32 accumulators). A = X (tokens, row-major),
// B = W (weight rows are B's columns: W[n][k] row-major is exactly the "col" B operand). MI = 4
// (64 rows) for long prompts; MI = 1 or 2 for the experts when each sees few rows (short prompts,
// batched decode steps), where a 64-row tile would be mostly padding: less tensor work per weight
// read, fewer registers, more blocks per SM.
//
// Pipeline. k-tiles stream into shared memory through cp.async, STAGES deep (X tile BM × 64 bf16,
// W tile 256 rows × one k-tile of packed words). Scales and biases (2 bytes each, too small for
// cp.async) are read with ordinary loads one iteration before they are stored to shared memory,
// so their latency hides behind a k-tile of mma work.
//
// Operands. A fragments come from ldmatrix.x4 on the X tile, whose 16-byte chunks are XOR-swizzled
// by row so the 8 rows an ldmatrix matrix reads fall in distinct banks. bf16 weights are read the
// same way. Quantised weights: an mma B register holds W[n][2t], W[n][2t+1] (lane = 4g + t), two
// consecutive columns, i.e. both nibbles of byte t of a Q4 word (element c of a word sits in bits
// 4c..4c+3). One PRMT isolates the byte, one IMAD (×0x1001) copies it 12 bits up, one LOP3 keeps
// the low nibble in the low half and the high nibble in the high half and ORs in 0x4300: the two
// halves are then the bf16 numbers 128 + q, exactly. A bf16x2 subtraction of 128 gives q exactly
// and one bf16x2 FMA gives s·q + b, rounded once to bf16 (as MLX's own kernels compute in bf16).
// A dequantised B register serves the warp's MI m16 tiles. 8-bit values do not fit a bf16 mantissa
// next to a magic exponent, so Q8 goes through fp32: PRMT builds 2²³ + q as an fp32, FADD removes
// 2²³, FFMA applies s and b, one cvt packs two results into bf16x2.
//
// Rows. Which X row and which output row a tile row stands for is read from small tables built at
// the start of the block, so one kernel serves:
//   * dense:    tile rows p0..p0+BM−1 of X and Y (p0 = BM·blockIdx.x; dense products use 64);
//   * grouped:  blockIdx.x indexes a tile map {expert, first position, rows} built on the device
//     (moe.cu: moe_group_*), X rows are gathered (a_rows[p] / a_div: token of pair p) or
//     contiguous, output rows contiguous or scattered (c_rows[p]: the pair's row of `routed`).
//     Blocks past the number of tiles actually used exit at once: the grid is sized for the worst
//     case, so nothing has to come back to the host.
// Epilogues: STORE writes bf16 Y; SWIGLU (for gate‖up stacks: rows [0, I) gate, [I, 2I) up) makes
// each warp's 64 B rows 32 gate rows and the 32 matching up rows, so one lane holds gate and up of
// the same (row, j) and writes act[p][j] = bf16(silu(gate) · up) from the fp32 accumulators.
//
// mma.m16n8k16 fragments (PTX ISA), lane = 4g + t:
//   A: a0 {row g, k 2t..2t+1}, a1 {row g+8, k 2t..}, a2 {row g, k 2t+8..}, a3 {row g+8, k 2t+8..}
//   B: b0 {k 2t..2t+1, col g}, b1 {k 2t+8..2t+9, col g}     C: {row g, cols 2t, 2t+1}, {row g+8, ...}
#include "gemm_prefill.cuh"

namespace {

enum Format { Q4 = 0, Q8 = 1, BF16 = 2 };
enum Epilogue { STORE = 0, SWIGLU = 1 };

constexpr int BN = 256;      // weight rows per block tile
constexpr int BK = 64;       // columns per k-tile (one quantisation group)
constexpr int WARPS = 4;     // warp w owns weight rows 64w..64w+63 of the tile
constexpr int THREADS = 32 * WARPS;
constexpr int A_ROW_BYTES = BK * 2;          // 128: one X row of a k-tile

// Per format: bytes of one weight row in a k-tile, pipeline depth (two blocks per SM of the 64-row
// tiles must fit in 227 KB of shared memory).
template <int F> struct Fmt;
template <> struct Fmt<Q4> { static constexpr int ROW_BYTES = 32, STAGES = 4; };
template <> struct Fmt<Q8> { static constexpr int ROW_BYTES = 64, STAGES = 4; };
template <> struct Fmt<BF16> { static constexpr int ROW_BYTES = 128, STAGES = 2; };

template <int F, int MI> struct Layout {
    static constexpr int BM = 16 * MI;                       // token rows per block tile
    static constexpr int A_BYTES = BM * A_ROW_BYTES;
    static constexpr bool QUANT = F != BF16;
    static constexpr int ROW_BYTES = Fmt<F>::ROW_BYTES;
    static constexpr int CHUNKS = ROW_BYTES / 16;            // 16-byte chunks per weight row
    static constexpr int B_BYTES = BN * ROW_BYTES;
    static constexpr int SB_BYTES = QUANT ? BN * 4 : 0;      // {scale, bias} bf16 pair per row
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES + SB_BYTES;
    static constexpr int STAGES = Fmt<F>::STAGES;
    static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES;  // must match gemm_prefill.rs
    // Blocks per SM the launch bounds ask for: as the accumulators (32·MI registers per lane)
    // allow, as many as fit the shared memory (2 KB each for the static tables and the driver).
    static constexpr int BY_REGISTERS = MI == 1 ? 4 : MI == 2 ? 3 : 2;
    static constexpr int BY_SMEM = 228 * 1024 / (SMEM_BYTES + 2048);
    static constexpr int BLOCKS = BY_REGISTERS < BY_SMEM ? BY_REGISTERS : BY_SMEM;
    static_assert(MI != 4 || BLOCKS == 2, "two blocks of the 64-row tiles per SM must fit");
};

}  // namespace


namespace {

__device__ __forceinline__ void mma(float d[4], const u32 a[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Physical 16-byte chunk of logical chunk c in row r of a weight tile (see the bank notes below).
template <int F> __device__ __forceinline__ int b_chunk(int c, int r) {
    if constexpr (F == Q4) return c;                    // lds.64 of 8 rows × 32 B: no conflict
    else if constexpr (F == Q8) return q8_chunk(c, r);  // 8 rows × 64 B: rows g, g+2 would collide
    else return c ^ (r & 7);                            // ldmatrix: 8 rows × 128 B
}

template <int E> __device__ __forceinline__ int weight_row(int r, int col_tile, int n) {
    if constexpr (E == STORE) {
        const int row = col_tile * BN + r;
        return row < n ? row : -1;
    } else {
        // Warp w's rows 64w..64w+31 are gate rows j, 64w+32..64w+63 the up rows I + j of the same j.
        const int half = n / 2, within = r & 63;
        const int j = col_tile * (BN / 2) + (r >> 6) * 32 + (within & 31);
        if (j >= half) return -1;
        return within < 32 ? j : half + j;
    }
}

template <int F, int E, int MI>
__device__ __forceinline__ void gemm(const GemmArgs& a) {
    using L = Layout<F, MI>;
    constexpr int STAGES = L::STAGES, BM = L::BM, A_BYTES = L::A_BYTES;
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ int a_row_s[BM];  // X row of each tile row, -1: none
    __shared__ int c_row_s[BM];  // Y row of each tile row, -1: none
    __shared__ int b_off_s[BN];  // word offset of each weight row in its matrix, -1: none

    // Which tile: a dense run of rows, or an entry of the grouped tile map.
    int mat, p0, rows;
    if (!block_tile(a, BM, mat, p0, rows)) return;  // the whole block: before any barrier
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int col_tile = blockIdx.y;
    const int row_words = a.k / (F == Q4 ? 8 : F == Q8 ? 4 : 2);
    const int ngroups = a.k / 64;
    const u32* wmat = a.w + mat * a.w_mat_words;

    token_rows(a, BM, p0, rows, a_row_s, c_row_s);
    // Scale/bias index of this thread's two weight rows (tid, tid + 128) for the SB loads.
    i64 sb_off[2] = {-1, -1};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = tid + h * THREADS;
        const int row = weight_row<E>(r, col_tile, a.n);
        b_off_s[r] = row < 0 ? -1 : row * row_words;
        if (row >= 0) sb_off[h] = ((i64)mat * a.n + row) * ngroups;
    }
    __syncthreads();

    auto stage_a = [&](int s) { return smem + s * L::STAGE_BYTES; };
    auto stage_b = [&](int s) { return smem + s * L::STAGE_BYTES + A_BYTES; };
    auto stage_sb = [&](int s) { return reinterpret_cast<u32*>(smem + s * L::STAGE_BYTES + A_BYTES + L::B_BYTES); };

    // One k-tile into stage `s`: X BM rows × 8 chunks (MI per thread), W 256 rows × CHUNKS chunks.
    auto load_tile = [&](int kt, int s) {
        const u32 sa = smem_u32(stage_a(s)), sbase = smem_u32(stage_b(s));
#pragma unroll
        for (int u = 0; u < BM * 8 / THREADS; ++u) {
            const int r = tid / 8 + u * (THREADS / 8), c = tid % 8;
            const int xr = a_row_s[r];
            const bf16* src = a.x + (i64)max(xr, 0) * a.k + kt * BK + c * 8;
            cp_async16(sa + r * A_ROW_BYTES + ((c ^ (r & 7)) << 4), src, xr >= 0);
        }
#pragma unroll
        for (int u = 0; u < BN * L::CHUNKS / THREADS; ++u) {
            const int r = tid / L::CHUNKS + u * (THREADS / L::CHUNKS), c = tid % L::CHUNKS;
            const int off = b_off_s[r];
            const u32* src = wmat + max(off, 0) + kt * (L::ROW_BYTES / 4) + c * 4;
            cp_async16(sbase + r * L::ROW_BYTES + (b_chunk<F>(c, r) << 4), src, off >= 0);
        }
    };
    // {scale, bias} of this thread's two rows for k-tile kt, as bf16 pairs (zeros for absent rows).
    auto load_sb = [&](int kt, u32 out[2]) {
        const unsigned short* s = reinterpret_cast<const unsigned short*>(a.scales);
        const unsigned short* b = reinterpret_cast<const unsigned short*>(a.biases);
#pragma unroll
        for (int h = 0; h < 2; ++h)
            out[h] = sb_off[h] < 0 ? 0u : (u32)__ldg(s + sb_off[h] + kt) | ((u32)__ldg(b + sb_off[h] + kt) << 16);
    };
    auto store_sb = [&](int s, const u32 v[2]) {
        stage_sb(s)[tid] = v[0];
        stage_sb(s)[tid + THREADS] = v[1];
    };

    const int KT = a.k / BK;
    u32 pending[2] = {0u, 0u};
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) {
            load_tile(s, s);
            if constexpr (L::QUANT) {
                load_sb(s, pending);
                store_sb(s, pending);
            }
        }
        cp_async_commit();  // possibly empty: keeps the group count uniform for the waits below
    }
    if constexpr (L::QUANT) {
        if (STAGES - 1 < KT) load_sb(STAGES - 1, pending);
    }

    // Per-lane constants for the fragments.
    const int q = lane / 8, rr = lane % 8;
    // A ldmatrix: matrix q = {rows +8·(q&1), k chunk +(q>>1)} of an m16k16 tile; row rr of it.
    const u32 a_lane = (rr + 8 * (q & 1)) * A_ROW_BYTES;
    const int a_hi = q >> 1;
    // bf16 B ldmatrix (two n8 tiles per x4): matrix q = {n8 tile +(q>>1), k chunk +(q&1)}.
    const u32 b_lane = (warp * 64 + 8 * (q >> 1) + rr) * L::ROW_BYTES;
    const int b_hi = q & 1;
    // Quantised B: this lane's weight row within an n8 tile is g; its columns 2t, 2t+1.
    const u32 sel4 = 0x4440u | t;
    const u32 sel8_lo = 0x7440u | (2 * (t & 1)), sel8_hi = 0x7440u | (2 * (t & 1) + 1);

    float acc[MI][8][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<STAGES - 2>();  // this thread's copies of k-tile kt have landed ...
        __syncthreads();              // ... and everyone's; stage (kt-1) % STAGES is free again
        const int next = kt + STAGES - 1;
        if (next < KT) {
            if constexpr (L::QUANT) store_sb(next % STAGES, pending);  // loaded one k-tile ago
            load_tile(next, next % STAGES);
        }
        cp_async_commit();
        if constexpr (L::QUANT) {
            if (next + 1 < KT) load_sb(next + 1, pending);
        }

        const int s = kt % STAGES;
        const u32 sa = smem_u32(stage_a(s));
        const unsigned char* sb_bytes = stage_b(s);
        const u32 sbm = smem_u32(sb_bytes);

        // This k-tile's scale and bias of the lane's 8 weight rows (one per n8 tile).
        bf162 s2[8], b2[8];
        float sf[8], bfv[8];
        if constexpr (L::QUANT) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const u32 v = stage_sb(s)[warp * 64 + j * 8 + g];
                if constexpr (F == Q4) {
                    s2[j] = as_bf162(__byte_perm(v, 0u, 0x1010));  // {s, s}
                    b2[j] = as_bf162(__byte_perm(v, 0u, 0x3232));  // {b, b}
                } else {
                    sf[j] = __uint_as_float(v << 16);
                    bfv[j] = __uint_as_float(v & 0xFFFF0000u);
                }
            }
        }

#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {  // k16 steps of the k-tile
            u32 af[MI][4];
#pragma unroll
            for (int i = 0; i < MI; ++i)
                ldmatrix_x4(af[i], sa + a_lane + i * 16 * A_ROW_BYTES + (((2 * ks + a_hi) ^ rr) << 4));
            if constexpr (F == BF16) {
#pragma unroll
                for (int j = 0; j < 8; j += 2) {
                    u32 bf[4];
                    ldmatrix_x4(bf, sbm + b_lane + j * 8 * L::ROW_BYTES + (((2 * ks + b_hi) ^ rr) << 4));
#pragma unroll
                    for (int i = 0; i < MI; ++i) {
                        mma(acc[i][j], af[i], bf[0], bf[1]);
                        mma(acc[i][j + 1], af[i], bf[2], bf[3]);
                    }
                }
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int row = warp * 64 + j * 8 + g;
                    const unsigned char* rowp = sb_bytes + row * L::ROW_BYTES;
                    u32 b0, b1;
                    if constexpr (F == Q4) {
                        // Words 2ks (columns 16ks..16ks+7) and 2ks+1 (the next 8), chunk ks/2.
                        const uint2 w = *reinterpret_cast<const uint2*>(rowp + (b_chunk<Q4>(ks / 2, row) << 4) + (ks % 2) * 8);
                        b0 = dequant_q4(w.x, sel4, s2[j], b2[j]);
                        b1 = dequant_q4(w.y, sel4, s2[j], b2[j]);
                    } else {
                        // Columns 16ks + 2t, +1 are in word 4ks + t/2 (bytes 2(t&1), +1), columns
                        // 16ks + 8 + 2t, +1 in word 4ks + 2 + t/2: both in chunk ks.
                        const u32* cw = reinterpret_cast<const u32*>(rowp + (b_chunk<Q8>(ks, row) << 4));
                        b0 = dequant_q8(cw[t / 2], sel8_lo, sel8_hi, sf[j], bfv[j]);
                        b1 = dequant_q8(cw[2 + t / 2], sel8_lo, sel8_hi, sf[j], bfv[j]);
                    }
#pragma unroll
                    for (int i = 0; i < MI; ++i) mma(acc[i][j], af[i], b0, b1);
                }
            }
        }
    }

    // Epilogue: lane holds rows 16i + g (+8) and weight columns 8j + 2t, +1 of the warp's 64.
    if constexpr (E == STORE) {
        const int n = a.n;
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = i * 16 + g + h * 8;
                if (r >= rows) continue;
                bf16* yrow = a.y + (i64)c_row_s[r] * n;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int col = col_tile * BN + warp * 64 + j * 8 + 2 * t;
                    store_pair(yrow, col, n, acc[i][j][2 * h], acc[i][j][2 * h + 1]);
                }
            }
    } else {
        const int half = a.n / 2;
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = i * 16 + g + h * 8;
                if (r >= rows) continue;
                bf16* yrow = a.y + (i64)c_row_s[r] * half;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int col = col_tile * (BN / 2) + warp * 32 + j * 8 + 2 * t;
                    const float v0 = silu(acc[i][j][2 * h]) * acc[i][j + 4][2 * h];
                    const float v1 = silu(acc[i][j][2 * h + 1]) * acc[i][j + 4][2 * h + 1];
                    store_pair(yrow, col, half, v0, v1);
                }
            }
    }
}

}  // namespace

// The 64 × 64 fp32 warp tile of MI = 4 needs 128 accumulator registers per lane: two blocks per
// SM; the shorter tiles leave room for more (Layout::BLOCKS).
#define GEMM_KERNEL(name, F, E, MI)                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS, (Layout<F, MI>::BLOCKS)) name(const GemmArgs a) { \
        pdl_wait();                                                                            \
        pdl_launch_dependents();                                                               \
        gemm<F, E, MI>(a);                                                                     \
    }
// Every format and epilogue in tiles of 64, 32 and 16 rows (gemm_prefill.rs picks by name).
#define GEMM_KERNELS(suffix, MI)                     \
    GEMM_KERNEL(gemm_q4##suffix, Q4, STORE, MI)          \
    GEMM_KERNEL(gemm_q8##suffix, Q8, STORE, MI)          \
    GEMM_KERNEL(gemm_bf16##suffix, BF16, STORE, MI)      \
    GEMM_KERNEL(gemm_swiglu_q4##suffix, Q4, SWIGLU, MI)  \
    GEMM_KERNEL(gemm_swiglu_q8##suffix, Q8, SWIGLU, MI)  \
    GEMM_KERNEL(gemm_swiglu_bf16##suffix, BF16, SWIGLU, MI)

GEMM_KERNELS(, 4)
GEMM_KERNELS(_m32, 2)
GEMM_KERNELS(_m16, 1)
