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
// * That split would make lanes load 8 or 16 scattered bytes per row, which costs the load unit
//   4-8x more requests per byte than a coalesced stream and held an earlier version to ~60% of
//   HBM bandwidth. So weights (and scales, biases) travel through shared memory instead: each warp
//   copies its next batches of 16 rows × 4 iterations there with cp.async, 16 contiguous bytes per
//   lane and whole 128-byte lines per request, STAGES batches ahead, and the mma lanes read their
//   pieces from there. Rows are padded in shared memory so those reads hit distinct banks.
// * 8-bit values are split into two nibbles; the high nibble's mma column holds 16·x (exact in
//   bf16), so Q8 needs no other instructions than Q4. Its magic sum is 128·(1 + 16) per column.
// * x is staged once per block in shared memory, already permuted into the order the mma operands
//   need, with the per-group sums Σx. The first batches' copies are issued before that staging,
//   so their DRAM latency overlaps it. Launches of several tokens (the *_multi and *_gathered
//   kernels) first copy all of x into the stage at once and rearrange it there.
// * Blocks are persistent (about one wave of them): each loops over rounds of tiles, and each
//   warp's copy pipeline runs on across round boundaries.
// * Short matrices need more warps than they have tiles: then several warps split K for one tile
//   and reduce through shared memory. The host picks that split and the tiles per block (gemm.rs).
// * Batches: blockIdx.y is a slot; slot s multiplies matrix ids[s] (or s) of a stack (e.g. the
//   experts of a layer) with the x of slot s (or one shared x), writing its own output. Two more
//   ways to fill slots serve passes of more than 8 rows: row chunks (slot s takes rows 8s..8s+7
//   of one x and one matrix: the blocks of all chunks read the same weights at about the same
//   time, so DRAM sends them about once and L2 the rest), and gathered slots (a table on the
//   device, made by moe_slot_table in moe.cu, gives each slot its matrix, its tokens and which
//   rows of x and y they are: an expert's weights are read once for all the rows routed to it).
//
// mma.m16n8k16 operand layout (PTX ISA), lane = 4·g + t:
//   A regs: {row g, k 2t..2t+1}, {row g+8, k 2t..2t+1}, {row g, k 2t+8..9}, {row g+8, k 2t+8..9}
//   B regs: {k 2t..2t+1, col g}, {k 2t+8..9, col g};   C: {row g, col 2t..2t+1}, {row g+8, ...}
// Which weight column sits in which k-slot is free, as long as A and B agree: lane t's k-slots
// always hold lane t's own columns, and x is staged in the matching order.
#include "moe.cuh"
#include "norm.cuh"

namespace {

enum Format { Q4 = 0, Q8 = 1, BF16 = 2 };

constexpr int TILE_ROWS = 16;
constexpr int MAX_TOKENS = 8;  // mma N
constexpr int BATCH = 4;       // iterations whose loads are issued together

constexpr int STAGES = 4;      // batches a warp has in flight (copied ahead into shared memory) ...
constexpr int GATHERED_STAGES = 3;  // ... in the gathered kernels: two blocks fit an SM (see gemv)
constexpr int SLOT_WORDS = 2 + 2 * MAX_TOKENS;  // a gathered slot: {matrix, tokens, x rows[8], y rows[8]}
constexpr int L2_AHEAD = 6;    // byte ranges a launch can pull into L2 for the kernels after it

// WORDS: 32-bit words a lane takes per row per iteration. COLS: columns one iteration covers
// (4 lanes × WORDS words). STAGE: bytes of staged x per weight word. ROW_STRIDE: bytes of one
// row's batch in shared memory, padded so that the 8 rows read at once land on different banks.
// MAGIC: Σ of the bf16 magic offsets per unit of x (see above), for the quantised formats.
template <int F> struct Fmt;
template <> struct Fmt<Q4> {
    static constexpr int WORDS = 2, COLS = 64, STAGE = 16, ROW_STRIDE = 128 + 32;
    static constexpr float MAGIC = 128.0f;
};
template <> struct Fmt<Q8> {
    static constexpr int WORDS = 4, COLS = 64, STAGE = 16, ROW_STRIDE = 256 + 64;
    static constexpr float MAGIC = 128.0f * 17.0f;
};
template <> struct Fmt<BF16> {  // no MAGIC: bf16 weights need no offset
    static constexpr int WORDS = 4, COLS = 32, STAGE = 4, ROW_STRIDE = 256 + 64;
};

// One batch in shared memory: 16 rows of BATCH iterations (ROW_BYTES each, at ROW_STRIDE), then
// for the quantised formats the batch's scales and biases: [2][16 rows][4 groups] bf16.
template <int F> struct Slot {
    static constexpr bool QUANT = F != BF16;
    static constexpr int ROW_BYTES = BATCH * 4 * Fmt<F>::WORDS * 4;
    static constexpr int SCALES = TILE_ROWS * Fmt<F>::ROW_STRIDE;  // offset of the scales
    static constexpr int BYTES = SCALES + (QUANT ? 2 * TILE_ROWS * 8 : 0);
};

}  // namespace

// Kernel arguments, mirrored by `GemvArgs` in gemm.rs (same order, same sizes).
struct GemvArgs {
    const u32* w;        // matrix m starts at w + m * w_mat_words; rows are K·bits/32 words
    const bf16* scales;  // [count][rows][K/64] (unused for bf16)
    const bf16* biases;  // [count][rows][K/64] (unused for bf16)
    const bf16* x;       // slot s reads x + (s / slots_per_x)·x_slot_stride, laid out [ntok][K]
    bf16* y;             // slot s writes y + s·ntok·rows, laid out [ntok][rows]
    const int* ids;      // matrix of each slot, clamped to [0, count); null: slot s uses matrix s;
                         // for the *_gathered kernels the slot table [slots][SLOT_WORDS]
    i64 w_mat_words;
    i64 x_slot_stride;
    int rows, cols, ntok, tiles_per_block, warps_per_tile, count;
    int swiglu;          // x rows are gate‖up [2·cols]: the product takes bf16(silu(gate)·up)
    int slots_per_x;     // consecutive slots sharing one x: slot s reads x block s / slots_per_x
    int chunk_rows;      // > 0: row chunks of matrix 0; slot s has min(ntok, chunk_rows − s·ntok) tokens
    int x_rows, y_rows;  // gathered kernels: the table's rows of x (the tokens, or with swiglu the
                         // output rows) and of y are clamped to [0, x_rows) and [0, y_rows)
    // L2 ahead: byte ranges the next kernels will read (range r of the block's matrix m starts at
    // ahead[r] + m·ahead_stride[r]; 0 bytes: unused), pulled into L2 beside the block's own weights.
    const unsigned char* ahead[L2_AHEAD];
    i64 ahead_bytes[L2_AHEAD];
    i64 ahead_stride[L2_AHEAD];
    // Residual input (res_h set; one dense matrix, no ids, no SwiGLU): x is not read but made
    // per token row n as the residual_rmsnorm kernel makes it (norm.cuh): res_h [ntok][K] plus
    // res_k parts [ntok][res_k][K] weighted by res_weights [ntok][res_k] (null: one part), then
    // the norm with res_norm_w. Block (0, 0) writes the sums to res_h_out and x to res_x_out
    // (if set): the residual stream and the normalised rows for later kernels.
    const bf16* res_h;
    const bf16* res_parts;
    const float* res_weights;
    const float* res_norm_w;
    bf16* res_h_out;
    bf16* res_x_out;
    int res_k;
    float res_eps;
    // The ids were final before the previous kernel's PDL wait returned (it read them too, after
    // its wait, as the experts' gate‖up does for their down): read them, and stream the first
    // weights, before this kernel's own wait.
    int ids_ready;
    // Router top-k in the last block (topk_k > 0; the router's GEMV, one slot, y = [ntok][E + 1]):
    // the block that finishes last ranks each token's logits (moe.cuh's
    // router_topk_row_by_probability, with the shared expert) into topk_ids / topk_weights
    // [ntok][k + 1]; topk_counter counts finished blocks and is left at 0 for the next launch.
    int topk_k;
    int topk_experts;
    int* topk_ids;
    float* topk_weights;
    unsigned int* topk_counter;
    // Residual out (the *_res_out kernels: one token's mixer output projection, out_proj or
    // o_proj): each output row r is also added to the residual stream, rout_h[r] = bf16(rout_h[r] +
    // y[r]) as residual_rmsnorm adds it, and the sum of squares of each vector of 8 new values
    // (rows 8v..8v+7, in turn) goes to rout_ss[v], so that the norm after it can be made by its
    // reader in residual_rmsnorm's order (rows of at most 2,048 values: one vector a thread).
    bf16* rout_h;
    float* rout_ss;
    int rout_late;  // start the dependents (the router) at the block's start (0), after its tiles
                    // (1), or as its last batch begins (2)
    // Norm in (the *_norm_in kernels: one token's router GEMV after a residual-out launch): x =
    // rmsnorm(nin_h) · nin_w made while staging, from the residual stream and its vectors' sums
    // of squares nin_ss [cols / 8]: the bits residual_rmsnorm would write. Block (0, 0) also
    // writes x to nin_x_out (the experts' input).
    const bf16* nin_h;
    const float* nin_ss;
    const float* nin_w;
    bf16* nin_x_out;
    float nin_eps;
};

namespace {

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

// cp.async takes shared-memory addresses as 32-bit offsets into the shared window.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));  // .cg: via L2 only
}
__device__ __forceinline__ void cp_async8(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// SwiGLU of 8 gate and 8 up values: bf16(silu(g) · u), fp32 inside (the reference's activation).
__device__ __forceinline__ uint4 swiglu8(uint4 gate, uint4 up) {
    float g[8], u[8];
    unpack8(gate, g);
    unpack8(up, u);
#pragma unroll
    for (int i = 0; i < 8; ++i) g[i] = silu(g[i]) * u[i];
    return pack8(g);
}

// bf16 number k (0..3) of four packed in a uint2, as fp32.
__device__ __forceinline__ float bf16_at(uint2 v, int k) {
    const u32 w = k < 2 ? v.x : v.y;
    return __uint_as_float(k % 2 ? w & 0xFFFF0000u : w << 16);
}

// Vector v (columns 8v..8v+7) of x into its staged row, in the order the mma operands need (as
// stage_x_vec below puts it).
template <int F>
__device__ __forceinline__ void put_staged_vec(uint4 xv, uint4* dst, int v) {
    if constexpr (F == Q4) {
        // One word covers columns 8v..8v+7; pairs {0,4}, {1,5}, {2,6}, {3,7}.
        dst[v] = make_uint4(perm(xv.x, xv.z, 0x5410), perm(xv.x, xv.z, 0x7632), perm(xv.y, xv.w, 0x5410),
                            perm(xv.y, xv.w, 0x7632));
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

// Σ of one vector's 8 values, in the order every staging sums them.
__device__ __forceinline__ float vec_sum8(uint4 xv) {
    float f[8];
    unpack8(xv, f);
    return ((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]));
}

// Vector v (columns 8v..8v+7) of one token's x into its staged row, in the order the mma operands
// need, and for the quantised formats its group's Σx into xsum (all lanes of the warp take part:
// the sum is a shuffle over 8 lanes; `ok` false: a lane past the end, nothing stored). Its body
// repeats put_staged_vec and vec_sum8 rather than call them: the one-token kernels' code, and so
// their speed, moved when it did (bench/NOTES.md v1.55: any edit of theirs is measured first).
template <int F>
__device__ __forceinline__ void stage_x_vec(uint4 xv, unsigned char* stage_row, float* xsum, int tok, int v, bool ok) {
    uint4* dst = reinterpret_cast<uint4*>(stage_row);
    if (ok) {
        if constexpr (F == Q4) {
            // One word covers columns 8v..8v+7; pairs {0,4}, {1,5}, {2,6}, {3,7}.
            dst[v] = make_uint4(perm(xv.x, xv.z, 0x5410), perm(xv.x, xv.z, 0x7632), perm(xv.y, xv.w, 0x5410),
                                perm(xv.y, xv.w, 0x7632));
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
    if constexpr (F != BF16) {
        float f[8];
        unpack8(xv, f);
        float sum = ((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]));
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        sum += __shfl_xor_sync(0xffffffffu, sum, 4);
        if (ok && v % 8 == 0) xsum[(v / 8) * MAX_TOKENS + tok] = sum;
    }
}

// One group (vectors 8·grp .. 8·grp + 7) of one token's x, already in registers, into its staged
// row, and its Σx into xsum: the vectors' sums added as stage_x_vec's shuffles add them (lane r
// gets ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)) for r = 0), so the bits are the same.
template <int F>
__device__ __forceinline__ void stage_x_group(const uint4 xv[8], unsigned char* stage_row, float* xsum, int tok, int grp) {
    float sum[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        sum[j] = vec_sum8(xv[j]);
        put_staged_vec<F>(xv[j], reinterpret_cast<uint4*>(stage_row), 8 * grp + j);
    }
    xsum[grp * MAX_TOKENS + tok] = ((sum[0] + sum[1]) + (sum[2] + sum[3])) + ((sum[4] + sum[5]) + (sum[6] + sum[7]));
}

// Σ v² over 8 lanes' values v (lanes first, first + stride, ...) in turn, as residual_rmsnorm's
// threads sum a vector's squares (RES_OUT's tile sums); every lane of the warp must call it.
__device__ __forceinline__ float lanes_sum_squares8(float v, int first, int stride) {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float u = __shfl_sync(0xffffffffu, v, first + stride * j);
        s = fmaf(u, u, s);
    }
    return s;
}

// Where a warp is: which round (a group of tiles_per_block tiles) and which of its batches.
struct Job {
    int round, batch;
};

// GATHER: the slots come from the table at a.ids; kernels of their own, so that the other
// launches' code carries no branch for it. MULTI: launches of several tokens (x staged at once,
// below), also kernels of their own: every edit of the one-token kernel's code measured has cost
// one-token decode 0.6–3.8 % (bench/NOTES.md v1.55), so that kernel stays exactly as it was.
// RES_OUT, NORM_IN: one token's mixer output projection adding the residual, and the router's
// GEMV normalising it (the arguments above; bench/NOTES.md v1.69), kernels of their own too.
template <int F, bool GATHER, bool MULTI, bool X_EARLY = false, bool RES_OUT = false, bool NORM_IN = false>
__device__ void gemv(const GemvArgs& a) {
    using T = Fmt<F>;
    using S = Slot<F>;
    // Batches in flight per warp. A gathered launch (2–64 rows of experts, 10–100 µs) holds one
    // slot's x for up to 8 tokens beside its rings: with three batches a warp, two 8-warp blocks
    // share an SM where one did with four, and the SM's warps hide each other's latency (the
    // one-token loop issues from 2 warps per scheduler, 34–46 % of its slots, NOTES v1.60).
    constexpr int RING = GATHER ? GATHERED_STAGES : STAGES;
    constexpr bool QUANT = S::QUANT;
    const int K = a.cols;
    const int iters = K / T::COLS, ngroups = K / 64;
    const int words_per_row = iters * 4 * T::WORDS;
    const int kw = a.warps_per_tile, tb = a.tiles_per_block;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int tile_in_round = warp / kw, kwarp = warp % kw;
    const int slot_id = blockIdx.y;
    const u64 trace_start = GATHER ? block_trace_start() : 0;  // timeline builds only (common.cuh)
    if constexpr (X_EARLY) {
        // One token's routed experts' gate‖up (gemm.rs, then_routed_gate_up): its x, the post-mixer
        // norm's output, was final before this kernel started (the top-k before it starts its
        // dependents after its own wait, which returned once the router's GEMV had finished, and
        // that GEMV waited for the norm), so it is staged here, before the wait for the ids,
        // instead of after the ids and the first copies (≈ 2 µs of the launch, NOTES v1.50).
        // Through L2 (__ldcg): an SM's L1 may hold an earlier layer's x at this address.
        extern __shared__ __align__(16) unsigned char smem[];
        float* xsum = reinterpret_cast<float*>(smem + words_per_row * T::STAGE + 16);  // one token
        const uint4* x = reinterpret_cast<const uint4*>(a.x + (slot_id / a.slots_per_x) * a.x_slot_stride);
        for (int v0 = 0; v0 < K / 8; v0 += blockDim.x) {
            const int v = v0 + threadIdx.x;
            const bool ok = v < K / 8;
            stage_x_vec<F>(ok ? __ldcg(x + v) : make_uint4(0, 0, 0, 0), smem, xsum, 0, v, ok);
        }
        if constexpr (QUANT) {
            for (int i = threadIdx.x; i < ngroups * MAX_TOKENS; i += blockDim.x)
                if (i % MAX_TOKENS != 0) xsum[i] = 0.0f;
        }
    }
    // PDL (common.cuh): a fixed matrix can be streamed in before the previous kernel is done; the
    // expert of a slot is known only once the router's ids are written (or were, see ids_ready).
    const bool ids_wait = a.ids && !a.ids_ready;
    u64* timeline = nullptr;  // block 0's timeline entry (common.cuh), in timeline builds
    if (ids_wait) {
        timeline = pdl_wait();
        // A release fence before the trigger orders what this grid's wait made visible (the ids)
        // before the start of the next grid (PTX ISA, griddepcontrol), which may read them before
        // its own wait (ids_ready). Its reads bypass L1 too (__ldcg): no stale line of an earlier
        // layer's ids.
        asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
    }
    if (!(RES_OUT && a.rout_late)) pdl_launch_dependents();
    // This slot's matrix and tokens; for gathered slots also the rows of x and y of each token
    // (gather[n] and gather[MAX_TOKENS + n]). A table slot without tokens has nothing to do.
    __shared__ int gather[2 * MAX_TOKENS];
    int ntok = a.ntok, mat = slot_id;
    if constexpr (GATHER) {
        const int* entry = a.ids + slot_id * SLOT_WORDS;
        ntok = min(__ldcg(entry + 1), MAX_TOKENS);
        if (ntok <= 0) return;
        mat = min(max(__ldcg(entry), 0), a.count - 1);
        // The x row of a token: the token's own row, or through SwiGLU (the experts' down) the
        // gate‖up row made for the same output row.
        if (threadIdx.x < 2 * MAX_TOKENS) {
            const bool is_x = threadIdx.x < MAX_TOKENS;
            const int from = is_x && !a.swiglu ? threadIdx.x : MAX_TOKENS + threadIdx.x % MAX_TOKENS;
            gather[threadIdx.x] = min(max(__ldcg(entry + 2 + from), 0), (is_x ? a.x_rows : a.y_rows) - 1);
        }
        __syncthreads();
    } else if (a.chunk_rows > 0) {
        ntok = min(a.ntok, a.chunk_rows - slot_id * a.ntok);
        mat = 0;
    } else if (a.ids) {
        mat = min(max(__ldcg(a.ids + slot_id), 0), a.count - 1);
    }
    timeline_mark(timeline, 0);  // the matrix known
    const u32* wmat = a.w + mat * a.w_mat_words;
    const bf16* smat = a.scales + (i64)mat * a.rows * ngroups;
    const bf16* bmat = a.biases + (i64)mat * a.rows * ngroups;

    // The block is persistent: it takes rounds blockIdx.x, blockIdx.x + gridDim.x, ... Each warp
    // runs the same number of rounds and, within a round, its slice of K (iters / kw iterations:
    // whole batches, as the host guarantees) batch by batch. A job = (round, batch).
    const int rounds = (a.rows + TILE_ROWS * tb - 1) / (TILE_ROWS * tb);
    const int my_rounds = (rounds - blockIdx.x + gridDim.x - 1) / gridDim.x;
    const int batches = iters / kw / BATCH;
    const int it_begin = kwarp * batches * BATCH;
    const int jobs = my_rounds * batches;
    auto row0_of = [&](int round) { return (round * tb + tile_in_round) * TILE_ROWS; };
    // Advances a job (round, batch) to the next one of this block.
    auto advance = [&](Job& job) {
        if (++job.batch == batches) job.batch = 0, job.round += gridDim.x;
    };

    // Shared memory, in this order (sizes must match shared_bytes in gemm.rs):
    //   staged x  [ntok][words_per_row · STAGE + 16]  (+16: consecutive tokens on other banks)
    //   xsum      [ngroups][MAX_TOKENS] fp32          (quantised formats)
    //   red       [2][warps][MAX_TOKENS · 16] fp32    (only when kw > 1; two, alternating by round)
    //   ring      [warps][RING] Slot<F>               (each warp's batches in flight)
    //   residual  [ntok][K] bf16 x, [K] bf16 sums, [warps] fp32   (only with a residual input)
    extern __shared__ __align__(16) unsigned char smem[];
    const int warps = blockDim.x / 32;
    const int stage_tok = words_per_row * T::STAGE + 16;
    unsigned char* xstage = smem;
    float* xsum = reinterpret_cast<float*>(smem + a.ntok * stage_tok);  // laid out for the launch's ntok
    float* red = xsum + (QUANT ? ngroups * MAX_TOKENS : 0);
    unsigned char* ring = reinterpret_cast<unsigned char*>(red + (kw > 1 ? 2 * warps * MAX_TOKENS * TILE_ROWS : 0));
    ring += warp * RING * S::BYTES;

    // Copies job j (the one at `next_copy`) into its ring slot: 16 rows × BATCH iterations, each
    // lane 16 contiguous bytes per instruction (so each instruction moves whole lines): piece p of
    // rows r, r + ROW_STEP, ... Rows past the end are clamped (copied, never stored). For the
    // quantised formats one more 8-byte copy per lane: 4 groups' scales (lanes 0..15) or biases
    // (16..31) of row lane % 16. The host guarantees the alignment of every piece. One commit
    // group per job, empty past the end: cp.async.wait_group counts groups.
    constexpr int PIECES = S::ROW_BYTES / 16, ROW_STEP = 32 / PIECES;
    const int my_r = lane / PIECES, my_p = lane % PIECES;
    const u32 ring_s = (u32)__cvta_generic_to_shared(ring);
    const u32 dst0 = ring_s + my_r * T::ROW_STRIDE + my_p * 16;
    const bf16* sb_src = lane < 16 ? smat : bmat;
    // The lane's source rows in the round being copied (clamped past the end: copied, never
    // stored), set once per round: rebuilt for every batch, their 64-bit address arithmetic was a
    // fifth of the loop's instructions (tools/sass_stats.py; bench/NOTES.md v1.44).
    constexpr int COPY_ROWS = TILE_ROWS / ROW_STEP;
    const u32* copy_w[COPY_ROWS];
    const bf16* copy_sb;
    auto aim = [&](int round) {
        const int row0 = row0_of(round);
#pragma unroll
        for (int i = 0; i < COPY_ROWS; ++i)
            copy_w[i] = wmat + (i64)min(row0 + my_r + i * ROW_STEP, a.rows - 1) * words_per_row + my_p * 4;
        copy_sb = sb_src + (i64)min(row0 + lane % 16, a.rows - 1) * ngroups;
    };
    Job next_copy{(int)blockIdx.x, 0};
    aim(next_copy.round);
    auto issue = [&](int j) {
        if (j < jobs) {
            const u32 slot = (j % RING) * S::BYTES;
            const int it0 = it_begin + next_copy.batch * BATCH;
            const int col = it0 * 4 * T::WORDS;  // in words
#pragma unroll
            for (int i = 0; i < COPY_ROWS; ++i) cp_async16(dst0 + slot + i * ROW_STEP * T::ROW_STRIDE, copy_w[i] + col);
            if constexpr (QUANT) cp_async8(ring_s + slot + S::SCALES + lane * 8, copy_sb + it0);
            advance(next_copy);
            if (next_copy.batch == 0 && j + 1 < jobs) aim(next_copy.round);
        }
        cp_async_commit();
    };
    // The first batches' copies go out before x is staged, so their DRAM latency overlaps it.
    for (int j = 0; j < RING - 1; ++j) issue(j);
    // L2 ahead: the next kernels' weights, this block's share of each range, as bulk prefetches
    // of ≤ 4 KB (16-byte multiples, as the host guarantees), issued right after the block's own
    // first copies: they stream in beside this kernel's weights and the next GEMVs (which follow
    // kernels that read little: GDN step, attention, norms, top-k) find them in L2.
    for (int r = 0; r < L2_AHEAD; ++r) {
        const i64 bytes = a.ahead_bytes[r];
        if (bytes == 0) continue;
        const unsigned char* base = a.ahead[r] + mat * a.ahead_stride[r];
        const i64 share = (bytes / 16 + gridDim.x - 1) / gridDim.x * 16;
        const i64 end = min(bytes, (i64)(blockIdx.x + 1) * share);
        for (i64 off = blockIdx.x * share + threadIdx.x * 4096ll; off < end; off += blockDim.x * 4096ll)
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(base + off), "r"((u32)min(4096ll, end - off))
                         : "memory");
    }
    if constexpr (NORM_IN) {
        for (int v = threadIdx.x; v < K / 8; v += blockDim.x) prefetch_l1(a.nin_w + 8 * v);
    }
    if (!ids_wait) timeline = pdl_wait();
    // RES_OUT: the residual stream's rows of this block's first round, loaded now (final once the
    // wait returned: its writer ran three launches back) so that the epilogue does not wait for
    // them: kw = 1, rows g and g + 8 of the warp's tile in lanes t = 0; kw > 1, the epilogue's
    // items (two at most, 256 threads apart) that are rows of token 0. Each in a 32-bit register
    // of its own: two bf16 would be packed into one right after the loads, which waits for them.
    u32 hpre0 = 0, hpre1 = 0;
    if constexpr (RES_OUT) {
        const unsigned short* h16 = reinterpret_cast<const unsigned short*>(a.rout_h);
        const int round_row0 = blockIdx.x * tb * TILE_ROWS;
        if (kw == 1) {
            const int r = row0_of(blockIdx.x) + g;
            if (t == 0 && r < a.rows) hpre0 = __ldcg(h16 + r), hpre1 = __ldcg(h16 + r + 8);
        } else {
#pragma unroll
            for (int it = 0; it < 2; ++it) {
                const int i = it * blockDim.x + threadIdx.x, e = i % (MAX_TOKENS * TILE_ROWS);
                const int r = round_row0 + i / (MAX_TOKENS * TILE_ROWS) * TILE_ROWS + e % TILE_ROWS;
                if (i < tb * MAX_TOKENS * TILE_ROWS && e < TILE_ROWS && r < a.rows) (it == 0 ? hpre0 : hpre1) = __ldcg(h16 + r);
            }
        }
    }
    auto h_of = [](u32 bits) { return __ushort_as_bfloat16((unsigned short)bits); };

    // A residual input: each token row's x made here (into shared memory) from the residual
    // stream, exactly as the residual_rmsnorm kernel would have made it.
    bf16* res_x = nullptr;
    if (a.res_h) {
        res_x = reinterpret_cast<bf16*>(ring + (warps - warp) * RING * S::BYTES);  // after the rings
        bf16* res_sum = res_x + ntok * K;
        float* warp_ss = reinterpret_cast<float*>(res_sum + K);
        const bool writer = blockIdx.x == 0 && blockIdx.y == 0;
        for (int n = 0; n < ntok; ++n) {
            residual_rmsnorm_row<0>(a.res_h + (i64)n * K, a.res_parts + (i64)n * a.res_k * K,
                                 a.res_weights ? a.res_weights + n * a.res_k : nullptr, a.res_k, a.res_norm_w,
                                 res_sum, res_x + n * K, K, a.res_eps, warp_ss);
            if (writer) {  // the vectors this thread wrote itself
                for (int v = threadIdx.x; v < K / 8; v += blockDim.x) {
                    reinterpret_cast<uint4*>(a.res_h_out + (i64)n * K)[v] = reinterpret_cast<const uint4*>(res_sum)[v];
                    if (a.res_x_out)
                        reinterpret_cast<uint4*>(a.res_x_out + (i64)n * K)[v] = reinterpret_cast<const uint4*>(res_x + n * K)[v];
                }
            }
            __syncthreads();  // warp_ss and res_sum are reused by the next row; res_x complete
        }
    }

    // Stage x: each thread takes 8 columns (one uint4) per step. 8 consecutive threads cover one
    // group of 64, so Σx of a group is a shuffle over 8 lanes; all lanes run the same number of
    // steps so the shuffle never sees an inactive lane. (X_EARLY: done before the wait.)
    if constexpr (NORM_IN) {
        // x = rmsnorm(h) · w of the one token, as residual_rmsnorm makes it (norm.cuh): there
        // thread v sums vector v's squares, each warp its 32 threads' sums (warp_sum), and the
        // block the warps' in turn; here every warp does all of that from the vectors' sums. h's
        // first vectors and the sums are loaded together (one L2 round trip), through L2: both
        // were written by the launch just before.
        const uint4* hvec = reinterpret_cast<const uint4*>(a.nin_h);
        const float4* wvec = reinterpret_cast<const float4*>(a.nin_w);
        const int nvec = K / 8;
        const bool ok0 = threadIdx.x < nvec;
        uint4 hv = ok0 ? __ldcg(hvec + threadIdx.x) : make_uint4(0, 0, 0, 0);
        float4 w0 = ok0 ? wvec[2 * threadIdx.x] : make_float4(0, 0, 0, 0);  // the norm's weights,
        float4 w1 = ok0 ? wvec[2 * threadIdx.x + 1] : make_float4(0, 0, 0, 0);  // with h
        constexpr int MAX_GROUPS = 8;  // 8 · 32 vectors: rows of up to 2,048 (the host checks)
        float part[MAX_GROUPS];
#pragma unroll
        for (int w = 0; w < MAX_GROUPS; ++w) part[w] = 32 * w + lane < nvec ? __ldcg(a.nin_ss + 32 * w + lane) : 0.0f;
        float q = 0.0f;
#pragma unroll
        for (int w = 0; w < MAX_GROUPS; ++w) q += warp_sum(part[w]);
        const float r = rsqrtf(q / K + a.nin_eps);
        const bool writer = blockIdx.x == 0 && blockIdx.y == 0 && a.nin_x_out;
        for (int v0 = 0; v0 < nvec; v0 += blockDim.x) {
            const int v = v0 + threadIdx.x;
            const bool ok = v < nvec;
            if (v0 > 0 && ok) hv = __ldcg(hvec + v), w0 = wvec[2 * v], w1 = wvec[2 * v + 1];
            const uint4 xv = ok ? norm_vec8(hv, w0, w1, r) : make_uint4(0, 0, 0, 0);
            if (ok && writer) reinterpret_cast<uint4*>(a.nin_x_out)[v] = xv;
            stage_x_vec<F>(xv, xstage, xsum, 0, v, ok);
        }
        if constexpr (QUANT) {
            for (int i = threadIdx.x; i < ngroups * MAX_TOKENS; i += blockDim.x)
                if (i % MAX_TOKENS != 0) xsum[i] = 0.0f;
        }
    } else if constexpr (!X_EARLY) {
        const bf16* x = a.x + (slot_id / a.slots_per_x) * a.x_slot_stride;
        const int x_width = a.swiglu ? 2 * K : K;
        auto x_row = [&](int tok) { return GATHER ? a.x + (i64)gather[tok] * x_width : x + (i64)tok * x_width; };
        const int vec_per_tok = K / 8, total = ntok * vec_per_tok;
        const int steps = (total + blockDim.x - 1) / blockDim.x;
        // Several tokens: the loads below would be L2 round trips in turn, up to 16 of them for 8
        // tokens of K = 4,096 (the compiler does not overlap the steps). Plain x (no SwiGLU, no
        // residual input) is copied into the stage all at once instead (cp.async holds no
        // registers) and rearranged there in place: by whole groups (Q4, Q8; below), or by the
        // loop after them (bf16, and Q8 past two groups a thread), where each thread handles the
        // vectors it copied itself. The wait also covers the ring's first batches.
        // Q8's staged row is twice x (two words per x pair), so x goes into its upper half: the
        // writes of vector v, bytes [32v, 32v + 32), reach only copies of vectors u ≤ v (at
        // 2K + 16u), read in the same step or before; a barrier keeps each step's reads before its
        // writes.
        const bool direct = MULTI && !a.swiglu && !res_x && steps > 1;
        const int x_at = F == Q8 ? 2 * K : 0;
        if (direct) {
            const u32 xstage_s = smem_u32(xstage);
            for (int i = threadIdx.x; i < total; i += blockDim.x) {
                const int tok = i / vec_per_tok, v = i % vec_per_tok;
                cp_async16(xstage_s + tok * stage_tok + x_at + v * 16, reinterpret_cast<const uint4*>(x_row(tok)) + v);
            }
            cp_async_commit();
            cp_async_wait<0>();
        }
        // Copied x (the _multi and _gathered kernels) is rearranged a whole group of 64 columns
        // per thread (8 vectors, their Σx summed in the same order as the lanes' shuffles below),
        // with no shuffles: the loop below took ≈ 0.3 µs a step, 2.4–5 µs of an 8-token launch
        // (bench/NOTES.md v1.75).
        // Threads take the same group of consecutive tokens, whose rows are 16 bytes apart
        // modulo 128 (stage_tok), so a quarter-warp's 16-byte reads fall on distinct banks. A
        // thread reads vectors other threads copied: hence the barrier first.
        bool staged = false;
        if constexpr (F == Q4 && MULTI) {
            if (direct) {
                __syncthreads();  // every thread's copies above, visible to all (each read its own)
                const int groups = vec_per_tok / 8;
                for (int q = threadIdx.x; q < ntok * groups; q += blockDim.x) {
                    const int tok = q % ntok, grp = q / ntok;
                    const uint4* src = reinterpret_cast<const uint4*>(xstage + tok * stage_tok) + grp * 8;
                    uint4 xv[8];
#pragma unroll
                    for (int j = 0; j < 8; ++j) xv[j] = src[j];
                    stage_x_group<F>(xv, xstage + tok * stage_tok, xsum, tok, grp);
                }
                staged = true;
            }
        } else if constexpr (F == Q8 && MULTI) {
            // Q8 the same, except that its staged row is twice x (x copied into its upper half),
            // so a group's output can cover other groups' copies: every thread reads its groups
            // (at most two: up to 8 tokens of K = 4,096; more take the loop below) before any
            // thread writes.
            const int groups = vec_per_tok / 8;
            if (direct && ntok * groups <= 2 * (int)blockDim.x) {
                __syncthreads();  // every thread's copies above, visible to all
                uint4 xv[2][8];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int q = threadIdx.x + h * blockDim.x;
                    if (q < ntok * groups) {
                        const uint4* src = reinterpret_cast<const uint4*>(xstage + (q % ntok) * stage_tok + x_at) + (q / ntok) * 8;
#pragma unroll
                        for (int j = 0; j < 8; ++j) xv[h][j] = src[j];
                    }
                }
                __syncthreads();  // every copy read before the first write over it
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int q = threadIdx.x + h * blockDim.x;
                    if (q < ntok * groups) stage_x_group<F>(xv[h], xstage + (q % ntok) * stage_tok, xsum, q % ntok, q / ntok);
                }
                staged = true;
            }
        }
        for (int s = 0; s < steps && !staged; ++s) {
            const int i = s * blockDim.x + threadIdx.x;
            const bool ok = i < total;
            const int tok = ok ? i / vec_per_tok : 0, v = ok ? i % vec_per_tok : 0;
            uint4 xv = make_uint4(0, 0, 0, 0);
            if (ok && a.swiglu) {
                const uint4* gu = reinterpret_cast<const uint4*>(x_row(tok));
                xv = swiglu8(__ldg(gu + v), __ldg(gu + vec_per_tok + v));
            } else if (ok && res_x) {
                xv = reinterpret_cast<const uint4*>(res_x + tok * K)[v];
            } else if (ok && direct) {
                xv = reinterpret_cast<const uint4*>(xstage + tok * stage_tok + x_at)[v];
            } else if (ok) {
                xv = __ldg(reinterpret_cast<const uint4*>(x_row(tok)) + v);
            }
            if constexpr (F == Q8 && MULTI) {
                if (direct) __syncthreads();  // `direct` is the same for the whole block
            }
            stage_x_vec<F>(xv, xstage + tok * stage_tok, xsum, tok, v, ok);
        }
        if constexpr (QUANT) {
            for (int i = threadIdx.x; i < ngroups * MAX_TOKENS; i += blockDim.x)
                if (i % MAX_TOKENS >= ntok) xsum[i] = 0.0f;
        }
    }
    __syncthreads();
    timeline_mark(timeline, 1);  // x staged

    // acc: the C fragment, {row g, tokens 2t, 2t+1}, {row g+8, tokens 2t, 2t+1}.
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const unsigned char* my_x = xstage + g * stage_tok;  // this lane's B column is token g
    // Token n's output row: consecutive rows of the slot's block of y, or the gathered row.
    bf16* y = a.y + (i64)slot_id * a.ntok * a.rows;
    auto y_row = [&](int n) { return GATHER ? a.y + (i64)gather[MAX_TOKENS + n] * a.rows : y + (i64)n * a.rows; };
    Job job{(int)blockIdx.x, 0};
    for (int j = 0; j < jobs; ++j, advance(job)) {
        // Job j's copies are done once at most RING - 2 newer groups are pending; the warp
        // barrier makes every lane's copies visible to all. Then the slot read in the previous
        // job is free, and the copy of job j + RING - 1 can go into it.
        if (RES_OUT && a.rout_late == 2 && j == jobs - 1) pdl_launch_dependents();
        cp_async_wait<RING - 2>();
        __syncwarp();
        if (j == 0) timeline_mark(timeline, 2);  // the first batch in shared memory
        issue(j + RING - 1);
        const unsigned char* cur = ring + (j % RING) * S::BYTES;
        const int it0 = it_begin + job.batch * BATCH;
        uint2 sc0, sc8, bi0, bi8;  // 4 groups' scales and biases of rows g, g+8
        if constexpr (QUANT) {
            const uint2* sb = reinterpret_cast<const uint2*>(cur + S::SCALES);
            sc0 = sb[g], sc8 = sb[g + 8], bi0 = sb[16 + g], bi8 = sb[16 + g + 8];
        }
#pragma unroll
        for (int k = 0; k < BATCH; ++k) {
            const int it = it0 + k;
            // A operands: this lane's WORDS words of rows g and g+8.
            u32 w0[T::WORDS], w8[T::WORDS];
            const unsigned char* piece = cur + k * 4 * T::WORDS * 4 + t * T::WORDS * 4;
            if constexpr (T::WORDS == 2) {
                const uint2 p0 = *reinterpret_cast<const uint2*>(piece + g * T::ROW_STRIDE);
                const uint2 p8 = *reinterpret_cast<const uint2*>(piece + (g + 8) * T::ROW_STRIDE);
                w0[0] = p0.x, w0[1] = p0.y, w8[0] = p8.x, w8[1] = p8.y;
            } else {
                const uint4 p0 = *reinterpret_cast<const uint4*>(piece + g * T::ROW_STRIDE);
                const uint4 p8 = *reinterpret_cast<const uint4*>(piece + (g + 8) * T::ROW_STRIDE);
                w0[0] = p0.x, w0[1] = p0.y, w0[2] = p0.z, w0[3] = p0.w;
                w8[0] = p8.x, w8[1] = p8.y, w8[2] = p8.z, w8[3] = p8.w;
            }
            // B operands: this lane's staged x for its WORDS words (zeros for absent tokens).
            constexpr int NB = T::WORDS * T::STAGE / 4;
            u32 bx[NB];
            const uint4* src = reinterpret_cast<const uint4*>(my_x + (it * 4 * T::WORDS + t * T::WORDS) * T::STAGE);
#pragma unroll
            for (int q = 0; q < NB / 4; ++q) {
                const uint4 v = g < ntok ? src[q] : make_uint4(0, 0, 0, 0);
                bx[4 * q] = v.x, bx[4 * q + 1] = v.y, bx[4 * q + 2] = v.z, bx[4 * q + 3] = v.w;
            }
            if constexpr (QUANT) {
                float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int q = 0; q < T::WORDS; ++q) {
                    u32 n0[4], n8[4];
                    expand_nibbles(w0[q], n0);
                    expand_nibbles(w8[q], n8);
                    mma(d, n0[0], n8[0], n0[1], n8[1], bx[4 * q], bx[4 * q + 1]);
                    mma(d, n0[2], n8[2], n0[3], n8[3], bx[4 * q + 2], bx[4 * q + 3]);
                }
                // Group `it`: acc += s · (d − MAGIC·Σx) + b · Σx, as three FMAs per value.
                const float s0 = bf16_at(sc0, k), s8 = bf16_at(sc8, k);
                const float b0 = bf16_at(bi0, k), b8 = bf16_at(bi8, k);
                const float2 xs = *reinterpret_cast<const float2*>(xsum + it * MAX_TOKENS + 2 * t);
                acc[0] = fmaf(s0, fmaf(-T::MAGIC, xs.x, d[0]), fmaf(b0, xs.x, acc[0]));
                acc[1] = fmaf(s0, fmaf(-T::MAGIC, xs.y, d[1]), fmaf(b0, xs.y, acc[1]));
                acc[2] = fmaf(s8, fmaf(-T::MAGIC, xs.x, d[2]), fmaf(b8, xs.x, acc[2]));
                acc[3] = fmaf(s8, fmaf(-T::MAGIC, xs.y, d[3]), fmaf(b8, xs.y, acc[3]));
            } else {
                mma(acc, w0[0], w8[0], w0[1], w8[1], bx[0], bx[1]);
                mma(acc, w0[2], w8[2], w0[3], w8[3], bx[2], bx[3]);
            }
        }
        if (job.batch + 1 < batches) continue;

        // End of a round: this tile's outputs.
        const int row0 = row0_of(job.round);
        if (kw == 1 && RES_OUT) {
            // One token (lanes t = 0 hold rows g and g + 8): y, the residual stream, and the sums
            // of squares of the tile's two vectors (rows 0..7, 8..15, each in turn, as
            // residual_rmsnorm's threads sum theirs).
            float hn0 = 0.0f, hn8 = 0.0f;
            if (t == 0 && row0 + g < a.rows) {
                const bool first = job.round == (int)blockIdx.x;
                const bf16 y0 = __float2bfloat16_rn(acc[0]), y8 = __float2bfloat16_rn(acc[2]);
                const bf16 h0 = first ? h_of(hpre0) : __ldcg(a.rout_h + row0 + g);
                const bf16 h8 = first ? h_of(hpre1) : __ldcg(a.rout_h + row0 + g + 8);
                y_row(0)[row0 + g] = y0;
                y_row(0)[row0 + g + 8] = y8;
                hn0 = bf16_round(__bfloat162float(h0) + __bfloat162float(y0));
                hn8 = bf16_round(__bfloat162float(h8) + __bfloat162float(y8));
                a.rout_h[row0 + g] = __float2bfloat16_rn(hn0);
                a.rout_h[row0 + g + 8] = __float2bfloat16_rn(hn8);
            }
            const float s0 = lanes_sum_squares8(hn0, 0, 4), s8 = lanes_sum_squares8(hn8, 0, 4);
            if (lane == 0 && row0 < a.rows) a.rout_ss[row0 / 8] = s0, a.rout_ss[row0 / 8 + 1] = s8;
        } else if (kw == 1) {
            // The warp has the whole sum: store straight from the C fragment.
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int n = 2 * t + i % 2, row = row0 + g + 8 * (i / 2);
                if (n < ntok && row < a.rows) y_row(n)[row] = __float2bfloat16_rn(acc[i]);
            }
        } else {
            // Sum the K-slices through shared memory: red[parity][warp][token][row], then one
            // thread per (tile, token, row). Alternating two buffers by round needs one barrier.
            float* buf = red + (job.round / gridDim.x % 2) * warps * MAX_TOKENS * TILE_ROWS;
            float* mine = buf + warp * MAX_TOKENS * TILE_ROWS;
            mine[(2 * t) * TILE_ROWS + g] = acc[0];
            mine[(2 * t + 1) * TILE_ROWS + g] = acc[1];
            mine[(2 * t) * TILE_ROWS + g + 8] = acc[2];
            mine[(2 * t + 1) * TILE_ROWS + g + 8] = acc[3];
            __syncthreads();
            const int round_row0 = job.round * tb * TILE_ROWS;
            if constexpr (RES_OUT) {
                // One token: its rows summed as below, then the residual stream and the sums of
                // squares of each tile's two vectors (its 16 rows are lanes 0..15 of one warp).
                const bool first = job.round == (int)blockIdx.x;
                constexpr int ITEMS = MAX_TOKENS * TILE_ROWS;
                for (int it = 0; it * (int)blockDim.x < tb * ITEMS; ++it) {
                    const int i = it * blockDim.x + threadIdx.x;
                    const int tl = i / ITEMS, e = i % ITEMS, row = round_row0 + tl * TILE_ROWS + e % TILE_ROWS;
                    float hn = 0.0f;
                    if (i < tb * ITEMS && e < TILE_ROWS && row < a.rows) {
                        float sum = 0.0f;
                        for (int w = 0; w < kw; ++w) sum += buf[(tl * kw + w) * ITEMS + e];
                        const bf16 yv = __float2bfloat16_rn(sum);
                        const bf16 hv = first && it < 2 ? h_of(it == 0 ? hpre0 : hpre1) : __ldcg(a.rout_h + row);
                        y_row(0)[row] = yv;
                        hn = bf16_round(__bfloat162float(hv) + __bfloat162float(yv));
                        a.rout_h[row] = __float2bfloat16_rn(hn);
                    }
                    const int first_lane = i - lane;  // the warp's first item: a tile's row 0, or not
                    if (first_lane % ITEMS == 0 && first_lane < tb * ITEMS) {
                        const float s0 = lanes_sum_squares8(hn, 0, 1), s8 = lanes_sum_squares8(hn, 8, 1);
                        const int tile_row0 = round_row0 + tl * TILE_ROWS;
                        if (lane == 0 && tile_row0 < a.rows) a.rout_ss[tile_row0 / 8] = s0, a.rout_ss[tile_row0 / 8 + 1] = s8;
                    }
                }
            } else {
                for (int i = threadIdx.x; i < tb * MAX_TOKENS * TILE_ROWS; i += blockDim.x) {
                    const int tl = i / (MAX_TOKENS * TILE_ROWS), e = i % (MAX_TOKENS * TILE_ROWS);
                    const int n = e / TILE_ROWS, row = round_row0 + tl * TILE_ROWS + e % TILE_ROWS;
                    if (n >= ntok || row >= a.rows) continue;
                    float sum = 0.0f;
                    for (int w = 0; w < kw; ++w) sum += buf[(tl * kw + w) * MAX_TOKENS * TILE_ROWS + e];
                    y_row(n)[row] = __float2bfloat16_rn(sum);
                }
            }
        }
        acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
    }
    cp_async_wait<0>();  // no copy may still be writing when the block's shared memory is reused
    if (RES_OUT && a.rout_late == 1) pdl_launch_dependents();
    timeline_mark(timeline, 3);  // this thread's tiles done

    if (a.topk_k > 0) {
        __shared__ int last;
        __threadfence();  // each thread's outputs visible device-wide ...
        __syncthreads();  // ... for every thread of the block, before the count says so
        if (threadIdx.x == 0) last = atomicAdd(a.topk_counter, 1u) == gridDim.x * gridDim.y - 1;
        __syncthreads();
        if (last) {
            __threadfence();
            const int slots = a.topk_k + 1;
            for (int n = warp; n < ntok; n += blockDim.x / 32)
                router_topk_row_by_probability(a.y + (i64)n * a.rows, a.topk_experts, a.topk_k, 1,
                                               a.topk_ids + n * slots, a.topk_weights + n * slots);
            if (threadIdx.x == 0) *a.topk_counter = 0u;
        }
    }
    timeline_mark(timeline, 4);  // block 0's end
    if constexpr (GATHER) block_trace_end(trace_start, ntok | a.swiglu << 4 | (a.rows >> 4) << 8);
}

}  // namespace

// Blocks have at most 256 threads (gemm.rs); saying so lets ptxas give each thread the registers it
// needs (without it, ptxas plans for 1024 threads and spills).
extern "C" __global__ void __launch_bounds__(256, 1) gemv_q4(const GemvArgs a) { gemv<Q4, false, false>(a); }
extern "C" __global__ void __launch_bounds__(256, 1) gemv_q8(const GemvArgs a) { gemv<Q8, false, false>(a); }
extern "C" __global__ void __launch_bounds__(256, 1) gemv_bf16(const GemvArgs a) { gemv<BF16, false, false>(a); }
// One token's routed experts' gate‖up, x staged before the PDL wait (X_EARLY above).
extern "C" __global__ void __launch_bounds__(256, 1) gemv_q4_x_early(const GemvArgs a) { gemv<Q4, false, false, true>(a); }
extern "C" __global__ void __launch_bounds__(256, 1) gemv_q8_x_early(const GemvArgs a) { gemv<Q8, false, false, true>(a); }
extern "C" __global__ void __launch_bounds__(256, 1) gemv_bf16_x_early(const GemvArgs a) { gemv<BF16, false, false, true>(a); }
// One token's mixer output projection adding the residual (RES_OUT), and the router's GEMV after
// it normalising the residual stream as it stages it (NORM_IN).
extern "C" __global__ void __launch_bounds__(256, 1) gemv_q4_res_out(const GemvArgs a) { gemv<Q4, false, false, false, true>(a); }
extern "C" __global__ void __launch_bounds__(256, 1) gemv_q8_res_out(const GemvArgs a) { gemv<Q8, false, false, false, true>(a); }
extern "C" __global__ void __launch_bounds__(256, 1) gemv_bf16_res_out(const GemvArgs a) { gemv<BF16, false, false, false, true>(a); }
extern "C" __global__ void __launch_bounds__(256, 1) gemv_q4_norm_in(const GemvArgs a) { gemv<Q4, false, false, false, false, true>(a); }
extern "C" __global__ void __launch_bounds__(256, 1) gemv_q8_norm_in(const GemvArgs a) { gemv<Q8, false, false, false, false, true>(a); }
extern "C" __global__ void __launch_bounds__(256, 1) gemv_bf16_norm_in(const GemvArgs a) { gemv<BF16, false, false, false, false, true>(a); }
// Launches of several tokens (batched decode passes: row chunks, expert slots).
extern "C" __global__ void __launch_bounds__(256, 1) gemv_q4_multi(const GemvArgs a) { gemv<Q4, false, true>(a); }
extern "C" __global__ void __launch_bounds__(256, 1) gemv_q8_multi(const GemvArgs a) { gemv<Q8, false, true>(a); }
extern "C" __global__ void __launch_bounds__(256, 1) gemv_bf16_multi(const GemvArgs a) { gemv<BF16, false, true>(a); }
// Gathered slots (passes of 2–64 rows) hold up to 8 tokens each.
extern "C" __global__ void __launch_bounds__(256, 1) gemv_q4_gathered(const GemvArgs a) { gemv<Q4, true, true>(a); }
extern "C" __global__ void __launch_bounds__(256, 1) gemv_q8_gathered(const GemvArgs a) { gemv<Q8, true, true>(a); }
extern "C" __global__ void __launch_bounds__(256, 1) gemv_bf16_gathered(const GemvArgs a) { gemv<BF16, true, true>(a); }
