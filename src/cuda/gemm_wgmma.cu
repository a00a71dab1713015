// Prefill matrix products with 4- or 8-bit weights on Hopper's warpgroup tensor cores (wgmma): the same
// products, arguments, tile map, grid and epilogues as gemm_prefill.cu (whose header explains
// them), a different inner loop.
//
// The weights are wgmma's A operand, taken from registers: each thread dequantises its fragment of
// W straight into the registers the product reads (no bf16 copy of the weights anywhere), and the
// tokens are the N side, read by the tensor cores from shared memory. So the block computes Yᵀ:
// D[weight row][token] = Σ_k W[row][k] · X[token][k].
//
// Block (the wide shape; the narrow one below is half of it): 4 warpgroups (512 threads), tile of
// 256 weight rows × up to 128 token rows; warpgroup q owns weight rows 64q..64q+63 and issues m64nNk16 products, N = 128 token rows (64 fp32
// accumulators per thread) or, for a shorter tile (an expert's last few rows), N = 96 or 64. Each
// dequantised weight serves N tokens: the dequantisation (5 instructions per 2 weights in Q4, 7 in
// Q8) is what bounds these kernels, not the tensor cores (bench/NOTES.md v1.21), so the taller tile
// halves it per product. An expert of 129..160 rows is one tile of N = 144 or 160 (72 or 80
// accumulators; its k-loop spills a few registers to L1; one stage less), not a full tile and a
// short one: the grouping's `spill` (moe.cu) gives an expert's last tile up to SPILL more rows.
// Measured 11 % (gate‖up) and 10 % (down) faster at 4K tokens of uniform routing, less than the
// third fewer tiles would give at a constant cost per tile: a short tile costs well under a full
// one (its N = 64 products are half), so the products are a large part of the time too (NOTES
// v1.46).
//
// k-tiles of 64 columns (one quantisation group) stream through STAGES shared-memory stages by
// cp.async: the X tile (N rows × 128 bytes, 128-byte swizzle, the layout
// wgmma reads) and the packed weights (256 rows × 32 bytes in Q4, 64 in Q8); every fourth stage
// also brings four k-tiles' scales and biases into a ring of their own (sb_offset). Per k-tile kt each
// thread dequantises its 16 A registers and issues the four k16 products; while they run, it waits
// for k-tile kt + 1's stage (its copies, a barrier for everyone's) and refills the stage k-tile
// kt − 1 used (every warpgroup has finished those products before the barrier); then it waits for
// its products, whose fragment registers the next k-tile rewrites. (Two sets of fragments, so that
// the next k-tile's dequantisation overlaps the products, cost spilled registers at N = 128 and
// measured slower: NOTES v1.21.)
//
// A fragment (m64k16, bf16, as mma.m16n8k16's A per warp): lane (g = lane/4, t = lane%4) of warp
// w (w % 4 within its warpgroup) holds rows 16w + g and 16w + g + 8 (in the block tile, w = 0..15),
// registers {row g, k 2t..2t+1}, {row g+8, k 2t..}, {row g, k 2t+8..}, {row g+8, k 2t+8..}: both
// nibbles of byte t of Q4 word 2s (k 16s..16s+7) or 2s+1 of the row — exactly what dequant_q4 makes;
// for Q8, bytes 2(t%2), +1 of words 4s + t/2 and 4s + 2 + t/2 (dequant_q8), as in gemm_prefill.cu.
// Accumulators (m64n64, fp32): d[4i + e] = D[row 16w + g + 8(e/2)][token 8i + 2t + e%2].
// SWIGLU tiles put gate row j at tile row 16w + g and the up row of the same j at 16w + g + 8, so a
// thread holds gate and up of the same (j, token): d[4i + e] and d[4i + e + 2].
#include "gemm_prefill.cuh"
#include "wgmma.cuh"

namespace {

enum Epilogue { STORE = 0, SWIGLU = 1 };
enum Format { Q4 = 0, Q8 = 1 };

constexpr int BM = 128;       // token rows per tile (wgmma N) ...
constexpr int SPILL = 32;     // ... and up to this many more in an expert's last tile
constexpr int BM_MAX = BM + SPILL;
constexpr int BK = 64;        // k-tile: one quantisation group
// Two block shapes, BN weight rows per tile, a warpgroup (wgmma M = 64) per 64 of them:
//   wide   (BN = 256): 4 warpgroups, 6 stages, one block per SM;
//   narrow (BN = 128): 2 warpgroups, 4 stages, two blocks per SM.
// A block's warpgroups meet at a barrier every k-tile, so in a wide block the dequantisation and
// the products of all four take turns rather than overlap. Where the experts have few rows each,
// a tile's products are short and that lockstep is what the time goes to (ncu at 2,330 rows: 41 %
// of issue slots busy, 1.04 eligible warps of 4 per scheduler; neither N = 80 tiles nor a second
// set of fragments helped, bench/NOTES.md v1.84): two independent blocks per SM fill each other's
// gaps there, at twice the X-tile reads per weight.
template <int BN> __host__ __device__ constexpr int threads() { return 2 * BN; }
template <int BN> __host__ __device__ constexpr int base_stages() { return BN == 256 ? 6 : 4; }
// Tiles of N = 160 take one stage less, so that they fit in the shared memory of the 128-row
// stages. Measured against six 160-row stages (a larger allocation, so less L1 beside it): uniform
// 4K gate‖up 0.415 → 0.384 ms, prefill @4K +1.4 % (bench/NOTES.md v1.46). (Short tiles with
// more stages in the same bytes measured no faster on the narrow blocks: v1.84.)
template <int BN, int N> __host__ __device__ constexpr int stages() { return N > BM ? base_stages<BN>() - 1 : base_stages<BN>(); }
// Bytes of one weight row in a k-tile: 32 (Q4) or 64 (Q8).
template <int F> __host__ __device__ constexpr int row_bytes() { return F == Q4 ? BK / 2 : BK; }
// A stage: the X tile (N rows of 128 bytes), then the packed weights (BN rows).
template <int BN, int N, int F> __host__ __device__ constexpr int stage_bytes() { return N * BK * 2 + BN * row_bytes<F>(); }
// The scales and biases of the tile's weight rows: a ring of two slots after the stages, each
// holding SB_KTILES k-tiles' {scale} then {bias} per weight row (8 bytes a row each), copied with
// the stage of the slot's first k-tile. One 8-byte copy per thread every four k-tiles instead of
// four 2-byte global loads per k-tile, whose latency the products waited on (bench/NOTES.md v1.28,
// v1.47). So K must be a multiple of 4 groups (256) and the scales and biases 8-byte aligned.
constexpr int SB_KTILES = 4;
template <int BN> __host__ __device__ constexpr int sb_slot_bytes() { return 2 * BN * SB_KTILES * 2; }
template <int BN, int F> __host__ __device__ constexpr int sb_offset() { return base_stages<BN>() * stage_bytes<BN, BM, F>(); }
// Must match WgmmaShape::shared_bytes in gemm_prefill.rs: the stages, the scale ring and slack to align
// the start to 1024 bytes (the swizzle pattern repeats every 1024).
template <int BN, int F> __host__ __device__ constexpr int smem_bytes() { return sb_offset<BN, F>() + 2 * sb_slot_bytes<BN>() + 1024; }
// Static shared memory of a block: the X and Y row tables and the weight rows' offsets.
template <int BN> __host__ __device__ constexpr int static_bytes() { return 2 * BM_MAX * 4 + BN * 4; }
template <int BN, int F> __host__ __device__ constexpr bool shape_fits() {
    return stage_bytes<BN, 64, F>() % 1024 == 0 && stage_bytes<BN, 96, F>() % 1024 == 0 &&
           stage_bytes<BN, 144, F>() % 1024 == 0 && stage_bytes<BN, BM_MAX, F>() % 1024 == 0 &&
           stages<BN, BM_MAX>() * stage_bytes<BN, BM_MAX, F>() <= base_stages<BN>() * stage_bytes<BN, BM, F>() &&
           (256 / BN) * (smem_bytes<BN, F>() + static_bytes<BN>() + 1024) <= 228 * 1024;
}
static_assert(shape_fits<256, Q4>() && shape_fits<256, Q8>() && shape_fits<128, Q4>() && shape_fits<128, Q8>(),
              "X tiles stay 1024-byte aligned, the taller tiles' stages fit in the 128-row tiles' shared "
              "memory, and a wide block or two narrow ones fit an SM");

// The block's products for a tile of `rows` ≤ N token rows of matrix `mat`: the tables of
// gemm<E> (X row, Y row of each token row; word offset of each weight row) are in place.
template <int BN, int E, int F, int N>
__device__ __forceinline__ void products(const GemmArgs& a, int mat, int rows, const int* a_row_s, const int* c_row_s,
                                         const int* b_off_s) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    constexpr int THREADS = threads<BN>();
    constexpr int X_BYTES = N * BK * 2, STAGE_BYTES = stage_bytes<BN, N, F>(), ROW = row_bytes<F>();
    constexpr int STAGES = stages<BN, N>();  // this tile height's ring
    constexpr int SB_SLOT_BYTES = sb_slot_bytes<BN>();
    constexpr int W_CHUNKS = BN * ROW / 16 / THREADS;  // weight chunks per thread per k-tile: 1 or 2
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int col_tile = blockIdx.y;
    const int ngroups = a.k / 64;
    const u32* wmat = a.w + mat * a.w_mat_words;

    // This thread's two fragment rows, and the row whose scales (tid < BN) or biases (tid ≥ BN)
    // it copies into the scale ring.
    const int r_lo = 16 * warp + g;
    const int sb_row = tile_weight_row<E == SWIGLU, BN>(tid % BN, col_tile, a.n);
    const bf16* sb_src = (tid < BN ? a.scales : a.biases) + (sb_row < 0 ? 0 : ((i64)mat * a.n + sb_row) * ngroups);
    // What this thread copies per k-tile: X chunk c of rows xr0 + X_STEP·u < N (u < X_ROWS), and weight
    // chunk tid % (ROW / 16) of rows tid / (ROW / 16) + u · THREADS / (ROW / 16) (u < W_CHUNKS).
    // The sources are k-tile 0's, each copy's later ones a fixed step on (its row's pointer stays
    // in a register: the per-k-tile 64-bit address arithmetic was ≈ 25 of the k-loop's ≈ 196
    // instructions), and a false `x_ok`/`w_ok` copies zeros.
    constexpr int X_STEP = THREADS / 8, X_ROWS = (N + X_STEP - 1) / X_STEP;
    const int xc = tid % 8, xr0 = tid / 8;
    const bf16* x_src[X_ROWS];
    bool x_ok[X_ROWS];
#pragma unroll
    for (int u = 0; u < X_ROWS; ++u) {
        const int xr = N % X_STEP == 0 || xr0 + X_STEP * u < N ? a_row_s[xr0 + X_STEP * u] : -1;
        x_ok[u] = xr >= 0;
        x_src[u] = a.x + (i64)max(xr, 0) * a.k + xc * 8;
    }
    constexpr int CPR = ROW / 16;  // chunks per weight row
    const int wc = tid % CPR;
    const u32* w_src[W_CHUNKS];
    bool w_ok[W_CHUNKS];
#pragma unroll
    for (int u = 0; u < W_CHUNKS; ++u) {
        const int w_off = b_off_s[tid / CPR + u * (THREADS / CPR)];
        w_ok[u] = w_off >= 0;
        w_src[u] = wmat + max(w_off, 0) + wc * 4;
    }

    // 1024-byte-aligned start of the stages.
    const u32 raw = smem_u32(smem_raw);
    const u32 base = (raw + 1023) & ~1023u;
    const unsigned char* smem = smem_raw + (base - raw);
    auto x_tile = [&](int s) { return base + s * STAGE_BYTES; };

    // k-tile kt into stage s: X N rows × 8 chunks (swizzled), W BN rows × ROW / 16 chunks (plain).
    auto load_tile = [&](int kt, int s) {
#pragma unroll
        for (int u = 0; u < X_ROWS; ++u) {
            const int r = xr0 + X_STEP * u;
            if (N % X_STEP != 0 && r >= N) continue;  // the last piece of N = 160 (or 144, 96)
            cp_async16(x_tile(s) + r * 128 + ((xc ^ (r & 7)) << 4), x_src[u] + kt * BK, x_ok[u]);
        }
#pragma unroll
        for (int u = 0; u < W_CHUNKS; ++u) {
            const int r = tid / CPR + u * (THREADS / CPR);
            const int pc = F == Q4 ? wc : q8_chunk(wc, r);
            cp_async16(x_tile(s) + X_BYTES + r * ROW + (pc << 4), w_src[u] + kt * (ROW / 4), w_ok[u]);
        }
        if (kt % SB_KTILES == 0) {
            const u32 slot = base + sb_offset<BN, F>() + (kt / SB_KTILES) % 2 * SB_SLOT_BYTES;
            cp_async8(slot + tid * (SB_KTILES * 2), sb_src + kt, sb_row >= 0);
        }
    };
    // {scale, bias} of this thread's two rows for k-tile kt from the ring, as the bf16 pairs
    // dequantise takes: its slot came with an earlier stage, already waited for.
    auto read_sb = [&](int kt, u32 sb[2]) {
        const unsigned char* slot = smem + sb_offset<BN, F>() + (kt / SB_KTILES) % 2 * SB_SLOT_BYTES + (kt % SB_KTILES) * 2;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = (r_lo + 8 * h) * (SB_KTILES * 2);
            sb[h] = (u32)*reinterpret_cast<const unsigned short*>(slot + r) |
                    ((u32)*reinterpret_cast<const unsigned short*>(slot + BN * SB_KTILES * 2 + r) << 16);
        }
    };

    // This thread's 16 A registers (four k16 steps) of the k-tile in stage `stage`, with {scale,
    // bias} sb of the thread's two rows.
    auto dequantise = [&](int stage, const u32 sb[2], u32 frag[16]) {
        const unsigned char* wq = smem + stage * STAGE_BYTES + X_BYTES;
        if constexpr (F == Q4) {
            // Rows r_lo and r_lo + 8 of the stage's packed weights: words 0..7 = k 8w..8w+7.
            const uint4 lo0 = *reinterpret_cast<const uint4*>(wq + r_lo * 32);
            const uint4 lo1 = *reinterpret_cast<const uint4*>(wq + r_lo * 32 + 16);
            const uint4 hi0 = *reinterpret_cast<const uint4*>(wq + (r_lo + 8) * 32);
            const uint4 hi1 = *reinterpret_cast<const uint4*>(wq + (r_lo + 8) * 32 + 16);
            const u32 wlo[8] = {lo0.x, lo0.y, lo0.z, lo0.w, lo1.x, lo1.y, lo1.z, lo1.w};
            const u32 whi[8] = {hi0.x, hi0.y, hi0.z, hi0.w, hi1.x, hi1.y, hi1.z, hi1.w};
            const bf162 s_lo = as_bf162(__byte_perm(sb[0], 0u, 0x1010)), b_lo = as_bf162(__byte_perm(sb[0], 0u, 0x3232));
            const bf162 s_hi = as_bf162(__byte_perm(sb[1], 0u, 0x1010)), b_hi = as_bf162(__byte_perm(sb[1], 0u, 0x3232));
            const u32 sel = 0x4440u | t;
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) {
                frag[4 * ks + 0] = dequant_q4(wlo[2 * ks], sel, s_lo, b_lo);
                frag[4 * ks + 1] = dequant_q4(whi[2 * ks], sel, s_hi, b_hi);
                frag[4 * ks + 2] = dequant_q4(wlo[2 * ks + 1], sel, s_lo, b_lo);
                frag[4 * ks + 3] = dequant_q4(whi[2 * ks + 1], sel, s_hi, b_hi);
            }
        } else {
            // k 16ks + 2t, +1 are bytes 2(t%2), +1 of word 4ks + t/2; k 16ks + 8 + 2t, +1 the same
            // bytes of word 4ks + 2 + t/2: both in chunk ks of the row.
            const float s_lo = __uint_as_float(sb[0] << 16), b_lo = __uint_as_float(sb[0] & 0xFFFF0000u);
            const float s_hi = __uint_as_float(sb[1] << 16), b_hi = __uint_as_float(sb[1] & 0xFFFF0000u);
            const u32 sel_lo = 0x7440u | (2 * (t % 2)), sel_hi = sel_lo + 1;
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) {
                const uint4 lo = *reinterpret_cast<const uint4*>(wq + r_lo * ROW + (q8_chunk(ks, r_lo) << 4));
                const uint4 hi = *reinterpret_cast<const uint4*>(wq + (r_lo + 8) * ROW + (q8_chunk(ks, r_lo + 8) << 4));
                const bool odd = t & 2;  // t / 2: words 1 and 3 of the chunk, else 0 and 2
                frag[4 * ks + 0] = dequant_q8(odd ? lo.y : lo.x, sel_lo, sel_hi, s_lo, b_lo);
                frag[4 * ks + 1] = dequant_q8(odd ? hi.y : hi.x, sel_lo, sel_hi, s_hi, b_hi);
                frag[4 * ks + 2] = dequant_q8(odd ? lo.w : lo.z, sel_lo, sel_hi, s_lo, b_lo);
                frag[4 * ks + 3] = dequant_q8(odd ? hi.w : hi.z, sel_lo, sel_hi, s_hi, b_hi);
            }
        }
    };
    float d[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) d[i] = 0.0f;
    // The four k16 products of the k-tile in stage `stage`, asynchronous (one commit group).
    auto issue = [&](int stage, const u32 frag[16]) {
        wgmma_fence();
        const u32 xb = x_tile(stage);
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) wgmma_k16<N>(d, &frag[4 * ks], smem_desc(xb + ks * 32));
        wgmma_commit();
        fence_accumulators<N>(d);
    };

    const int KT = a.k / BK;
    u32 frag[16];
    u32 sb[2];
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) load_tile(s, s);
        cp_async_commit();  // possibly empty: keeps the group count uniform for the waits below
    }
    cp_async_wait<STAGES - 2>();  // k-tile 0 has landed (this thread's copies) ...
    fence_async_shared();         // ... is visible to the tensor cores ...
    __syncthreads();              // ... and so is everyone's
    // stage = kt % STAGES; the refill of k-tile kt + STAGES − 1 goes to the stage of kt − 1.
    int stage = 0, refill = STAGES - 1;
#pragma unroll 1
    for (int kt = 0; kt < KT; ++kt) {
        read_sb(kt, sb);
        dequantise(stage, sb, frag);
        issue(stage, frag);
        // While the products run: the next k-tile's stage ready for everyone, and a refill.
        if (kt + 1 < KT) {
            cp_async_wait<STAGES - 3>();  // this thread's copies of k-tile kt + 1 have landed ...
            fence_async_shared();
            __syncthreads();  // ... and everyone's; every warpgroup is past k-tile kt − 1's products
            const int next = kt + STAGES - 1;
            if (next < KT) load_tile(next, refill);  // into the stage of k-tile kt − 1
            cp_async_commit();
        }
        refill = stage;
        stage = stage + 1 == STAGES ? 0 : stage + 1;
        wgmma_wait<0>();  // the fragments are free again
        fence_accumulators<N>(d);
    }
    wgmma_wait<0>();
    fence_accumulators<N>(d);
    cp_async_wait<0>();

    // Epilogue: d[4i + e] = D[tile row r_lo + 8(e/2)][token 8i + 2t + e%2] (see the top).
    if (a.staged_stores) {
        // Staged stores (a.staged_stores, under trial: bench/NOTES.md v1.39): the outputs go through
        // shared memory (the stages are free once every warpgroup is past its products), [token]
        // [column], then to Y as 16-byte pieces of token rows; straight from the registers (below)
        // they are 2-byte stores, 16 useful bytes per 32-byte sector.
        constexpr int OUT_COLS = E == STORE ? BN : BN / 2;  // output columns of the tile
        constexpr int OUT_PITCH = OUT_COLS + 8;              // bf16; rows stay 16-byte aligned
        static_assert(N * OUT_PITCH * 2 <= STAGES * STAGE_BYTES, "the tile's outputs fit in the stages");
        bf16* out_s = reinterpret_cast<bf16*>(smem_raw + (base - raw));
        __syncthreads();  // every warpgroup's products have read their last stage
#pragma unroll
        for (int i = 0; i < N / 8; ++i) {
#pragma unroll
            for (int e2 = 0; e2 < 2; ++e2) {
                const int tok = 8 * i + 2 * t + e2;
                if constexpr (E == STORE) {
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        out_s[tok * OUT_PITCH + r_lo + 8 * h] = __float2bfloat16_rn(d[4 * i + 2 * h + e2]);
                } else {
                    out_s[tok * OUT_PITCH + 8 * warp + g] = __float2bfloat16_rn(silu(d[4 * i + e2]) * d[4 * i + 2 + e2]);
                }
            }
        }
        __syncthreads();
        // Y rows of `width` values; whole 16-byte pieces where the row pitch and Y's start allow.
        const int width = E == STORE ? a.n : a.n / 2, col0 = col_tile * OUT_COLS;
        const bool vectors = width % 8 == 0 && (reinterpret_cast<u64>(a.y) & 15) == 0;
        for (int v = tid; v < rows * (OUT_COLS / 8); v += THREADS) {
            const int tok = v / (OUT_COLS / 8), c = v % (OUT_COLS / 8) * 8, col = col0 + c;
            if (col >= width) continue;
            bf16* dst = a.y + (i64)c_row_s[tok] * width + col;
            const bf16* src = out_s + tok * OUT_PITCH + c;
            if (vectors && col + 8 <= width) {
                *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
            } else {
                for (int k = 0; k < 8 && col + k < width; ++k) dst[k] = src[k];
            }
        }
        return;
    }
    store_accumulators<E == SWIGLU, N, BN>(a.y, a.n, d, rows, col_tile, c_row_s);
}

template <int BN, int E, int F>
__device__ __forceinline__ void gemm(const GemmArgs& a) {
    __shared__ int a_row_s[BM_MAX];
    __shared__ int c_row_s[BM_MAX];
    __shared__ int b_off_s[BN];  // word offset of each weight row in its matrix, −1: none

    // Grouped tiles may be up to BM_MAX rows (their five stages fit the same shared memory; dense: BM).
    const int bm = a.tiles ? BM_MAX : BM;
    int mat, p0, rows;
    if (!block_tile(a, bm, mat, p0, rows)) return;  // the whole block: before any barrier
    const int tid = threadIdx.x;
    token_rows(a, bm, p0, rows, a_row_s, c_row_s);
    if (tid < BN) {
        const int row = tile_weight_row<E == SWIGLU, BN>(tid, blockIdx.y, a.n);
        b_off_s[tid] = row < 0 ? -1 : row * (a.k * row_bytes<F>() / BK / 4);  // words per row
    }
    __syncthreads();
    // The tile's height decides N for the whole block, in steps of 16 or 32 rows above 64: the
    // products' time follows N, and an expert's rows rarely fill a tile (uniform routing of 4K
    // tokens gives a routed expert 128 ± 11 rows: tiles of 97..160 rows, NOTES v1.49).
    if (rows > 144) products<BN, E, F, BM_MAX>(a, mat, rows, a_row_s, c_row_s, b_off_s);
    else if (rows > BM) products<BN, E, F, 144>(a, mat, rows, a_row_s, c_row_s, b_off_s);
    else if (rows > 96) products<BN, E, F, 128>(a, mat, rows, a_row_s, c_row_s, b_off_s);
    else if (rows > 64) products<BN, E, F, 96>(a, mat, rows, a_row_s, c_row_s, b_off_s);
    else products<BN, E, F, 64>(a, mat, rows, a_row_s, c_row_s, b_off_s);
}

}  // namespace

#define WGMMA_KERNEL(name, BN, E, F)                                                                         \
    extern "C" __global__ void __launch_bounds__(threads<BN>(), 256 / BN) name(const GemmArgs a) { \
        pdl_wait();                                                                                  \
        pdl_launch_dependents();                                                                     \
        gemm<BN, E, F>(a);                                                                           \
    }

WGMMA_KERNEL(wgmma_q4, 256, STORE, Q4)
WGMMA_KERNEL(wgmma_swiglu_q4, 256, SWIGLU, Q4)
WGMMA_KERNEL(wgmma_q8, 256, STORE, Q8)
WGMMA_KERNEL(wgmma_swiglu_q8, 256, SWIGLU, Q8)
WGMMA_KERNEL(wgmma_narrow_q4, 128, STORE, Q4)
WGMMA_KERNEL(wgmma_narrow_swiglu_q4, 128, SWIGLU, Q4)
WGMMA_KERNEL(wgmma_narrow_q8, 128, STORE, Q8)
WGMMA_KERNEL(wgmma_narrow_swiglu_q8, 128, SWIGLU, Q8)
