// Gated DeltaNet layer kernels (spec/MODEL.md §3.6): everything between the input projections
// (qkv, z, b, a) and the output projection. Activations bf16 in and out; all arithmetic fp32 or,
// on the tensor cores, as accurate as fp32 (3xTF32, see mma_3xtf32).
//
// Shapes are those of Qwen3.6-35B-A3B, fixed at compile time (gdn.rs checks a config against them):
// conv_dim 8192 = q 2048 ‖ k 2048 ‖ v 4096, conv kernel 4; 16 key heads and 32 value heads of 128;
// value head j reads key head j / 2 (the grouped order of the Hugging Face layout).
//
// State of one sequence and layer (layouts are part of the API, see gdn.rs):
//   ssm  fp32 [32 value heads][128 dk][128 dv]   — the CPU reference's layout, S[d][v]
//   conv bf16 [3][8192]                          — the last 3 pre-conv qkv rows, oldest first
//                                                  (bf16 because the inputs are bf16: lossless)
//
// Where the reference (transformers) rounds to bf16 inside the recurrence — conv output, q/k/v,
// β — these kernels keep fp32, like lily's CPU reference. The gated norm at the end follows the
// reference's roundings (o, the normalised o and the weighted value are rounded to bf16), exactly
// as norm.cu's gated_rmsnorm does, so a fused and an unfused GPU path agree.
//
// Kernels:
//   gdn_decode          one token for each of B sequences (state pools addressed by slot ids)
//   gdn_decode_prep     the same for many sequences, in two kernels: conv, norms and gates,
//   gdn_decode_state      then the state's update and the gated norm
//   gdn_decode_prep_rows  the two for consecutive tokens of one sequence (a verify pass's rows):
//   gdn_decode_state_rows   each token's bits as one-token decoding gives them
//   gdn_prefill_qk      prefill, per (chunk of 64, key head): conv and norms of q, k; gates
//   gdn_prefill_prep    prefill, per (chunk of 64, value head): conv of v, WY form
//   gdn_prefill_state   prefill, per (value head, 32 dv columns): the state carried over chunks
//   gdn_prefill_out     prefill, per (chunk, value head): outputs and the gated norm
//                       (gdn_prefill_out_tf32: the same in plain tf32, measured and off: gdn.rs)
//   gdn_conv_update     prefill: the conv state after the last token
//   gdn_zero_state      zero the states of some slots
#include "common.cuh"
#include "wgmma.cuh"

#define GDN_DK 128
#define GDN_DV 128
#define GDN_VALUE_HEADS 32
#define GDN_KEY_HEADS 16
#define GDN_KEY_DIM 2048    // q (or k) channels: 16 key heads × 128
#define GDN_VALUE_DIM 4096  // v channels: 32 value heads × 128
#define GDN_CONV_DIM 8192   // q ‖ k ‖ v
#define GDN_HIST 3          // conv kernel 4: 3 rows of history
#define GDN_HEAD_STATE (GDN_DK * GDN_DV)
#define GDN_SEQ_STATE (GDN_VALUE_HEADS * GDN_HEAD_STATE)
#define GDN_CONV_STATE (GDN_HIST * GDN_CONV_DIM)
#define L2NORM_EPS 1e-6f    // added to the sum of squares (MODEL.md §3.6.3)

// Launch shapes; gdn.rs has the same numbers.
#define DEC_THREADS 128
#define DEC_COLS 32                     // dv columns of one value head per block
#define DEC_SLICES (GDN_DV / DEC_COLS)  // 4 blocks per value head
#define DEC_CLUSTER (2 * DEC_SLICES)    // 8 blocks per key head: its 2 value heads × 4 slices
#define CHUNK 64                        // prefill chunk length (any length is exact; 64 as the reference)
#define PF_THREADS 256
#define ST_COLS 32                      // dv columns per block of gdn_prefill_state

// Shared-memory row pitches, in floats. A row of 128 values gets 4 floats of padding so that the
// float4 reads down a column of rows (row r, r+1, ... at one offset) fall into distinct banks.
#define PITCH 132
#define LPITCH 68  // 64×64 matrices

// Everything a GDN kernel may need; each kernel reads the fields it documents. Field for field
// the `GdnArgs` struct of gdn.rs.
struct GdnArgs {
    // Projection outputs, row r of each at r·*_stride elements: qkv [8192], z [4096], b [32], a [32].
    const bf16* qkv;
    const bf16* z;
    const bf16* b;
    const bf16* a;
    // Layer weights: conv [8192][4] (tap 3 multiplies the current token), A_log [32], dt_bias [32],
    // gated-norm weight [128] (plain, not 1 + w).
    const float* conv_w;
    const float* a_log;
    const float* dt_bias;
    const float* norm_w;
    // Decode and zeroing: pools of n_slots states, sequence i uses slot slots[i].
    // Prefill: the one sequence's state (n_slots = 1, slots unused).
    // Consecutive tokens of one sequence (gdn_decode_prep_rows, gdn_decode_state_rows,
    // gdn_conv_update): slot slots[0] of the pools when slots is set (a verify pass in a
    // captured graph reads it on the device), else the one state at ssm / conv_state.
    float* ssm;
    bf16* conv_state;
    const int* slots;
    // Output: the out_proj input, [rows][4096].
    bf16* y;
    // Prefill scratch (see gdn_prefill_prep), nc = ceil(rows / 64) chunks:
    float* ws_w;      // [nc][32][64][128]  W  = T·(β k e^G)
    float* ws_u;      // [nc][32][64][128]  U  = T·(β v), replaced by Vnᵀ (Vn = U − W·S) by gdn_prefill_state
    float* ws_h;      // [nc][32][128 dv][128 dk] the state at the start of each chunk, transposed (Sᵀ)
    float* ws_q;      // [nc][16][64][128]  q after conv, SiLU, l2 norm, times 1/√dk (gdn_prefill_qk)
    float* ws_kn;     // [nc][16][64][128]  k after conv, SiLU, l2 norm
    float* ws_beta;   // [nc][32][64]       β
    float* ws_g;      // [nc][32][64]       G, the in-chunk cumulative log-decay
    i64 qkv_stride, z_stride, b_stride, a_stride;
    int rows;  // decode: sequences; prefill: tokens
    int n_slots;
    float eps;  // gated-norm epsilon
    // Decode: read the recurrent state before the PDL wait (its DRAM latency then overlaps the
    // previous kernel). Only when no kernel still in flight can be writing it: gdn.rs decode_in_pass.
    int state_early;
    // gdn_decode_state_rows and gdn_conv_update of a verify pass (null: not kept): the states
    // after each row but the last, [rows − 1][GDN_SEQ_STATE] and [rows − 1][GDN_CONV_STATE], so
    // that keeping fewer rows copies a state instead of stepping one again.
    float* ssm_rows;
    bf16* conv_rows;
};

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

// log(1 + e^x), switching to x above 20 as PyTorch (and the CPU reference) do.
__device__ __forceinline__ float softplusf_(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// The log-decay g = −exp(A_log) · softplus(a + dt_bias) of one value head (MODEL.md §3.6.4).
__device__ __forceinline__ float gdn_decay(float a_log, float dt_bias, float a) {
    return -expf(a_log) * softplusf_(a + dt_bias);
}

__device__ __forceinline__ float bf(bf16 v) { return __bfloat162float(v); }

// ---------------------------------------------------------------------------------------------
// Thread-block clusters (sm_90), through inline PTX so that no cooperative_groups header is needed.

// Arrive on the cluster barrier without ordering anything: "this block has started".
__device__ __forceinline__ void cluster_arrive_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }
// A full cluster barrier: every thread's earlier writes (to any block's shared memory) are visible
// to every thread of the cluster afterwards.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// Stores v into block `rank` of this cluster, at the shared-memory address `local` has in this block.
__device__ __forceinline__ void st_cluster(float* local, u32 rank, float v) {
    const u32 addr = (u32)__cvta_generic_to_shared(local);
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(v) : "memory");
}

// ---------------------------------------------------------------------------------------------
// Pieces of a decode step, shared by gdn_decode and the two kernels of many sequences (which must
// give the same bits: the same operations in the same order).

// The conv's arithmetic for 8 channels from `ch`: history rows h0 (oldest) .. h2, the new row xn.
__device__ __forceinline__ void conv8_taps(const GdnArgs& p, int ch, uint4 h0, uint4 h1, uint4 h2, uint4 xn,
                                           float res[8]) {
    float4 w[8];  // all loads before the first store to shared memory, which could alias them
#pragma unroll
    for (int j = 0; j < 8; ++j) w[j] = reinterpret_cast<const float4*>(p.conv_w)[ch + j];
    float f0[8], f1[8], f2[8], f3[8];
    unpack8(h0, f0);
    unpack8(h1, f1);
    unpack8(h2, f2);
    unpack8(xn, f3);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        float acc = w[j].x * f0[j];
        acc += w[j].y * f1[j];
        acc += w[j].z * f2[j];
        acc += w[j].w * f3[j];
        res[j] = silu(acc);
    }
}

// Conv + SiLU of the 8 channels from `ch` of sequence `seq` (its conv state at `slot`). The old
// history rows h1, h2 and the new row xn are returned for the state's shift (shift_conv_state),
// which comes once nothing reads the old rows any more.
__device__ __forceinline__ uint4* conv8_silu(const GdnArgs& p, int slot, int seq, int ch, uint4& h1, uint4& h2,
                                             uint4& xn, float res[8]) {
    uint4* hist = reinterpret_cast<uint4*>(p.conv_state + (i64)slot * GDN_CONV_STATE + ch);
    const uint4 h0 = hist[0];
    h1 = hist[GDN_CONV_DIM / 8];
    h2 = hist[2 * GDN_CONV_DIM / 8];
    xn = *reinterpret_cast<const uint4*>(p.qkv + seq * p.qkv_stride + ch);
    conv8_taps(p, ch, h0, h1, h2, xn, res);
    return hist;
}

// The slot of consecutive tokens of one sequence (see GdnArgs::slots), or −1 when out of range.
__device__ __forceinline__ int rows_slot(const GdnArgs& p) {
    const int slot = p.slots ? p.slots[0] : 0;
    return slot >= 0 && slot < p.n_slots ? slot : -1;
}

// conv8_silu for token `row` of consecutive tokens of one sequence (gdn_decode_prep_rows): its
// history is the conv state (at `slot`, not yet shifted) for tokens before the first and the
// earlier rows' inputs after it, the same bf16 values the state would hold after their steps.
__device__ __forceinline__ void conv8_silu_row(const GdnArgs& p, int slot, int row, int ch, float res[8]) {
    const uint4* hist = reinterpret_cast<const uint4*>(p.conv_state + (i64)slot * GDN_CONV_STATE + ch);
    uint4 h[GDN_HIST];
#pragma unroll
    for (int j = 0; j < GDN_HIST; ++j) {
        const int src = row - GDN_HIST + j;  // token index; negative: state row src + 3
        h[j] = src < 0 ? hist[(src + GDN_HIST) * (GDN_CONV_DIM / 8)]
                       : *reinterpret_cast<const uint4*>(p.qkv + src * p.qkv_stride + ch);
    }
    const uint4 xn = *reinterpret_cast<const uint4*>(p.qkv + row * p.qkv_stride + ch);
    conv8_taps(p, ch, h[0], h[1], h[2], xn, res);
}

__device__ __forceinline__ void shift_conv_state(uint4* hist, uint4 h1, uint4 h2, uint4 xn) {
    hist[0] = h1;
    hist[GDN_CONV_DIM / 8] = h2;
    hist[2 * GDN_CONV_DIM / 8] = xn;
}

// The l2 norms of one key head's q and k (q also scaled by 1/√dk) as factors rq, rk, and the dot
// product of the raw q and k: thread t of 128 takes q_s[t], k_s[t]; `sums` is [3][4] scratch.
__device__ __forceinline__ void qk_norms(const float* q_s, const float* k_s, float (*sums)[DEC_THREADS / 32],
                                         float& rq, float& rk, float& qk) {
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    {
        const float qv = q_s[tid], kv = k_s[tid];
        const float a0 = warp_sum(qv * qv), a1 = warp_sum(kv * kv), a2 = warp_sum(qv * kv);
        if (lane == 0) {
            sums[0][warp] = a0;
            sums[1][warp] = a1;
            sums[2][warp] = a2;
        }
    }
    __syncthreads();
    float qq = 0.0f, kk = 0.0f;
    qk = 0.0f;
#pragma unroll
    for (int w = 0; w < DEC_THREADS / 32; ++w) {
        qq += sums[0][w];
        kk += sums[1][w];
        qk += sums[2][w];
    }
    rq = rsqrtf(qq + L2NORM_EPS) * rsqrtf((float)GDN_DK);
    rk = rsqrtf(kk + L2NORM_EPS);
}

// One block's slice against its key head's k·rk and q·rq (k_s, q_s times rk, rq): Sᵀk and Sᵀq of
// the old state, the thread's 8 rows and 4 columns summed over the block's 128 rows (red:
// [2][4][32] scratch), then for its 4 columns δ = β (v − α Sᵀk) and o = α Sᵀq + δ (k·q). kd: the
// thread's rows of k·rk, for the update (store_state).
__device__ __forceinline__ void slice_step(const float4 s[8], const float* k_s, const float* q_s, float rk, float rq,
                                           const float* v_s, float beta, float alpha, float kq,
                                           float (*red)[DEC_THREADS / 32][DEC_COLS], float kd[8], float delta[4],
                                           float o[4]) {
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, c = tid % 8, r = tid / 8;
    float qd[8], sk[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sq[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        kd[i] = k_s[r + 16 * i] * rk;
        qd[i] = q_s[r + 16 * i] * rq;
        const float sv[4] = {s[i].x, s[i].y, s[i].z, s[i].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            sk[j] += sv[j] * kd[i];
            sq[j] += sv[j] * qd[i];
        }
    }
    // Over the 4 row groups of the warp (lane bits 3, 4), then the 4 warps through shared memory.
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int off = 8; off < 32; off *= 2) {
            sk[j] += __shfl_xor_sync(0xffffffffu, sk[j], off);
            sq[j] += __shfl_xor_sync(0xffffffffu, sq[j], off);
        }
    }
    if (lane < 8) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            red[0][warp][4 * c + j] = sk[j];
            red[1][warp][4 * c + j] = sq[j];
        }
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        float u = 0.0f, pq = 0.0f;
#pragma unroll
        for (int w = 0; w < DEC_THREADS / 32; ++w) {
            u += red[0][w][4 * c + j];
            pq += red[1][w][4 * c + j];
        }
        delta[j] = beta * (v_s[4 * c + j] - alpha * u);
        o[j] = alpha * pq + delta[j] * kq;
    }
}

// The gated RMSNorm's part of a block: o rounded to bf16 (as the reference rounds it) into ob, and
// Σob² over the block's 32 columns (lane bits 0..2 are the column quads).
__device__ __forceinline__ float rounded_square_sum(const float o[4], float ob[4]) {
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        ob[j] = bf16_round(o[j]);
        ss += ob[j] * ob[j];
    }
#pragma unroll
    for (int off = 1; off < 8; off *= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    return ss;
}

// S' = α S + k δᵀ for the thread's 8 rows (at S, row pitch 128) and 4 columns.
// Row i of the thread's 8 of S': α s + kd[i] δ (one place, so that every kernel rounds it alike).
__device__ __forceinline__ float4 state_row(const float4 s, float kd, float alpha, const float delta[4]) {
    float4 n;
    n.x = alpha * s.x + kd * delta[0];
    n.y = alpha * s.y + kd * delta[1];
    n.z = alpha * s.z + kd * delta[2];
    n.w = alpha * s.w + kd * delta[3];
    return n;
}

__device__ __forceinline__ void store_state(float* S, const float4 s[8], const float kd[8], float alpha,
                                            const float delta[4]) {
    const int r = threadIdx.x / 8;
#pragma unroll
    for (int i = 0; i < 8; ++i) *reinterpret_cast<float4*>(S + (r + 16 * i) * GDN_DV) = state_row(s[i], kd[i], alpha, delta);
}

// The gated norm's output of 4 columns (row group 0's threads): w · (o · rinv) · silu(z), rounded
// as the reference rounds, to y at `col` of row `seq`.
__device__ __forceinline__ void write_gated(const GdnArgs& p, int seq, int col, uint2 z4, float4 w4, const float ob[4],
                                            float rinv) {
    const float2 z01 = __bfloat1622float2(*reinterpret_cast<const bf162*>(&z4.x));
    const float2 z23 = __bfloat1622float2(*reinterpret_cast<const bf162*>(&z4.y));
    const float zf[4] = {z01.x, z01.y, z23.x, z23.y};
    const float wv[4] = {w4.x, w4.y, w4.z, w4.w};
    float yv[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) yv[j] = bf16_round(wv[j] * bf16_round(ob[j] * rinv)) * silu(zf[j]);
    const bf162 y01 = __floats2bfloat162_rn(yv[0], yv[1]), y23 = __floats2bfloat162_rn(yv[2], yv[3]);
    uint2 out;
    out.x = *reinterpret_cast<const u32*>(&y01);
    out.y = *reinterpret_cast<const u32*>(&y23);
    *reinterpret_cast<uint2*>(p.y + (i64)seq * GDN_VALUE_DIM + col) = out;
}

// ---------------------------------------------------------------------------------------------
// Decode: one token for each of B sequences. Grid (128, B), clusters of 8 blocks along x.
//
// Each block owns one value head hv and 32 of its dv columns: that slice of the state (128 × 32
// fp32 = 16 KiB) is read once into registers (8 float4 per thread, all issued at the start so their
// DRAM latency overlaps the prologue), updated and written once. 128 blocks per sequence fill the
// 132 SMs at B = 1. The recurrence is column-independent: with u = Sᵀk and p = Sᵀq of the old S,
//     δ = β (v − α u),   S' = α S + k δᵀ,   o = S'ᵀ q = α p + δ (k·q)
// so one pass over the slice gives everything.
//
// The 8 blocks of a cluster are the 2 value heads × 4 slices that share key head kh, which solves
// the two cross-block problems through distributed shared memory:
//   * q and k of kh come from a conv over 256 channels whose state must be updated exactly once:
//     each block convolves (and updates the conv state of) its own 16 q + 16 k channels, plus its
//     own 32 v channels, and pushes the q/k results into every block of the cluster;
//   * the gated RMSNorm needs Σo² over all 128 columns of a head: each block pushes its partial sum
//     to the 4 blocks of its value head.
// Writes go to the other blocks' shared memory (push), so after the last cluster barrier no block
// touches another's memory and all may exit.
//
// Thread t: column quad c = t % 8 (columns v0 + 4c .. +3), row group r = t / 8 (rows d = r + 16i).
extern "C" __global__ void __cluster_dims__(DEC_CLUSTER, 1, 1) __launch_bounds__(DEC_THREADS)
gdn_decode(const GdnArgs p) {
    __shared__ float q_s[GDN_DK], k_s[GDN_DK];  // q and k of key head kh, raw conv outputs
    __shared__ float qk_mine[32];               // this block's 16 q then 16 k conv outputs
    __shared__ float v_s[DEC_COLS];
    __shared__ float red[2][DEC_THREADS / 32][DEC_COLS];
    __shared__ float sums[3][DEC_THREADS / 32];
    __shared__ float norm_part[DEC_SLICES];

    const int tid = threadIdx.x;
    // Clusters tile the grid along x, so the rank in the cluster is blockIdx.x % 8.
    const int rank = blockIdx.x % DEC_CLUSTER;
    const int kh = blockIdx.x / DEC_CLUSTER;
    const int hv = 2 * kh + rank / DEC_SLICES;
    const int v0 = (rank % DEC_SLICES) * DEC_COLS;
    const int seq = blockIdx.y;
    const int slot = p.slots[seq];
    // A slot out of range skips the sequence (e.g. batch padding). All 8 blocks of the cluster
    // serve the same sequence, so they leave together, before any cluster barrier.
    if (slot < 0 || slot >= p.n_slots) return;

    cluster_arrive_relaxed();  // phase 0, waited on before the first remote store

    const int c = tid % 8, r = tid / 8;
    float* S = p.ssm + (i64)slot * GDN_SEQ_STATE + (i64)hv * GDN_HEAD_STATE + v0 + 4 * c;
    float4 s[8];
    auto load_state = [&] {
#pragma unroll
        for (int i = 0; i < 8; ++i) s[i] = *reinterpret_cast<const float4*>(S + (r + 16 * i) * GDN_DV);
    };
    // This block's conv channels (see below), as the conv reads them.
    auto channel = [&] {
        if (tid < 2) return kh * GDN_DK + rank * 16 + tid * 8;
        if (tid < 4) return GDN_KEY_DIM + kh * GDN_DK + rank * 16 + (tid - 2) * 8;
        return 2 * GDN_KEY_DIM + hv * GDN_DV + v0 + (tid - 4) * 8;
    };
    // The slots come from the host before the pass (not from a kernel), so they may be read here.
    // The same argument covers the sequence's conv state (only this layer's step writes it); the
    // conv and norm weights and the head's gate parameters are constants: all pulled into L1.
    if (p.state_early) {
        load_state();
        if (tid < 8) {
            const int ch = channel();
            const bf16* hist = p.conv_state + (i64)slot * GDN_CONV_STATE + ch;
#pragma unroll
            for (int j = 0; j < 3; ++j) prefetch_l1(hist + j * GDN_CONV_DIM);
            prefetch_l1(p.conv_w + 4 * ch);  // 8 channels × 4 taps fp32: one 128-byte line
            prefetch_l1(p.norm_w + v0 + 4 * c);
        } else if (tid == 8) {
            prefetch_l1(p.a_log + hv);
            prefetch_l1(p.dt_bias + hv);
        }
    }
    pdl_wait();
    pdl_launch_dependents();
    if (!p.state_early) load_state();
    // The other inputs, loaded up front too (the cluster barriers below order memory, so loads
    // are not moved across them): the gate inputs, and z and the norm weight of the 4 columns
    // that threads 0..7 will write.
    const float b_raw = bf(p.b[seq * p.b_stride + hv]), a_raw = bf(p.a[seq * p.a_stride + hv]);
    const float a_log = p.a_log[hv], dt_bias = p.dt_bias[hv];
    const int col = hv * GDN_DV + v0 + 4 * c;  // output column of this thread's first value
    uint2 z4 = make_uint2(0u, 0u);
    float4 w4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (tid < 8) {
        z4 = *reinterpret_cast<const uint2*>(p.z + seq * p.z_stride + col);
        w4 = *reinterpret_cast<const float4*>(p.norm_w + v0 + 4 * c);
    }

    // Conv + SiLU for this block's 64 channels, 8 per thread (one 16-byte vector per history row).
    // The shifted conv state is written at the end (see below).
    uint4* hist = nullptr;
    uint4 h1, h2, xn;
    if (tid < 8) {
        float* out = tid < 2 ? qk_mine + tid * 8 : tid < 4 ? qk_mine + 16 + (tid - 2) * 8 : v_s + (tid - 4) * 8;
        float res[8];
        hist = conv8_silu(p, slot, seq, channel(), h1, h2, xn, res);
#pragma unroll
        for (int j = 0; j < 8; ++j) out[j] = res[j];
    }
    __syncthreads();  // qk_mine and v_s written

    // Push the 32 q/k values to all 8 blocks: q_s[rank·16 + e], k_s[rank·16 + e].
    cluster_wait();  // every block of the cluster has started
    {
        const int dst = tid / 16, e = tid % 16;
        st_cluster(&q_s[rank * 16 + e], dst, qk_mine[e]);
        st_cluster(&k_s[rank * 16 + e], dst, qk_mine[16 + e]);
    }
    cluster_sync();  // phase 1: q_s and k_s are complete in every block

    // l2 norms of q and k (q also scaled by 1/√dk), and k·q of the normalised vectors.
    float rq, rk, qk;
    qk_norms(q_s, k_s, sums, rq, rk, qk);
    const float kq = qk * rq * rk;

    const float beta = sigmoidf_(b_raw);
    const float alpha = expf(gdn_decay(a_log, dt_bias, a_raw));

    float kd[8], delta[4], o[4];
    slice_step(s, k_s, q_s, rk, rq, v_s, beta, alpha, kq, red, kd, delta, o);

    // Gated RMSNorm of the head: Σo² of the bf16-rounded o over this block's 32 columns, pushed to
    // the 4 blocks of the value head.
    float ob[4];
    const float ss = rounded_square_sum(o, ob);
    if (tid < DEC_SLICES) st_cluster(&norm_part[rank % DEC_SLICES], (rank / DEC_SLICES) * DEC_SLICES + tid, ss);
    cluster_sync();  // phase 2: norm_part complete; no remote access after this

    // Global stores only now: a cluster barrier's release fence waits for every earlier store of
    // the thread, and none of these is needed before the end.
    store_state(S, s, kd, alpha, delta);
    if (tid < 8) shift_conv_state(hist, h1, h2, xn);
    const float rinv = rsqrtf((norm_part[0] + norm_part[1] + norm_part[2] + norm_part[3]) / GDN_DV + p.eps);
    if (tid < 8) write_gated(p, seq, col, z4, w4, ob, rinv);  // row group 0: one thread per column quad
}

// ---------------------------------------------------------------------------------------------
// Decode of many sequences in two kernels (gdn.rs picks them for large batches). A gdn_decode
// block's rate is its chain between the state's load and its store (the inputs read after the PDL
// wait, the conv, two cluster exchanges, two block reductions), not DRAM: the same state traffic
// alone runs at 3.6 TB/s where gdn_decode reaches 2.1 (bench/NOTES.md v1.58). So what needs no
// state — conv, SiLU, the norms of q and k, k·q, β and α — is done once per (sequence, key head)
// by gdn_decode_prep, into the prefill workspace (ws_q: q·rq, ws_kn: k·rk, ws_u: v, ws_beta: β,
// ws_g: α, all [B][heads][128] or [B][heads]; ws_w: k·q [B][16]); gdn_decode_state then loads the
// state, reads those from L2 and has one exchange left (the gated norm's Σo² over a head's 4
// slices). Both paths run the same pieces (above) in the same order, so they give the same bits
// (cuda_gdn checks).

// Grid (16 key heads, B), 128 threads: threads 0..63 convolve one set of 8 each of the key head's
// 512 channels (q 128 ‖ k 128 ‖ v of its two value heads 256); all 128 then take the norms.
//
// ROWS (gdn_decode_prep_rows): the B rows are consecutive tokens of one sequence, its state that
// of rows_slot; the conv reads its history from the state
// and the rows before (conv8_silu_row) and leaves the state as it is (gdn_conv_update shifts it
// after gdn_decode_state_rows).
template <bool ROWS>
__device__ __forceinline__ void decode_prep(const GdnArgs& p) {
    __shared__ float q_s[GDN_DK], k_s[GDN_DK];
    __shared__ float sums[3][DEC_THREADS / 32];
    const int tid = threadIdx.x;
    const int kh = blockIdx.x, seq = blockIdx.y;
    const int slot = ROWS ? rows_slot(p) : p.slots[seq];
    if (slot < 0 || slot >= p.n_slots) return;
    // Sets 0..15: q channels kh·128 + 8i; 16..31: k; 32..63: v of value heads 2kh, 2kh + 1.
    const int ch = tid < 16   ? kh * GDN_DK + tid * 8
                   : tid < 32 ? GDN_KEY_DIM + kh * GDN_DK + (tid - 16) * 8
                              : 2 * GDN_KEY_DIM + 2 * kh * GDN_DV + (tid - 32) * 8;
    // As in gdn_decode: the conv state (only this layer's step writes it; from DRAM, the weights
    // streamed since have left it in no cache) and the conv weights pulled into L1 before the wait.
    if (p.state_early && tid < 64) {
        const bf16* hist = p.conv_state + (i64)slot * GDN_CONV_STATE + ch;
#pragma unroll
        for (int j = 0; j < 3; ++j) prefetch_l1(hist + j * GDN_CONV_DIM);
        prefetch_l1(p.conv_w + 4 * ch);
    }
    pdl_wait();
    pdl_launch_dependents();
    if (tid < 64) {
        uint4 h1, h2, xn;
        uint4* hist = nullptr;
        float res[8];
        if (ROWS) {
            conv8_silu_row(p, slot, seq, ch, res);
        } else {
            hist = conv8_silu(p, slot, seq, ch, h1, h2, xn, res);
        }
        float* out = tid < 16   ? q_s + tid * 8
                     : tid < 32 ? k_s + (tid - 16) * 8
                                : p.ws_u + ((i64)seq * GDN_VALUE_HEADS + 2 * kh) * GDN_DV + (tid - 32) * 8;
#pragma unroll
        for (int j = 0; j < 8; ++j) out[j] = res[j];
        if (!ROWS) shift_conv_state(hist, h1, h2, xn);
    }
    if (tid < 2) {  // the gates of value heads 2kh + tid
        const int hv = 2 * kh + tid;
        const float b_raw = bf(p.b[seq * p.b_stride + hv]), a_raw = bf(p.a[seq * p.a_stride + hv]);
        p.ws_beta[seq * GDN_VALUE_HEADS + hv] = sigmoidf_(b_raw);
        p.ws_g[seq * GDN_VALUE_HEADS + hv] = expf(gdn_decay(p.a_log[hv], p.dt_bias[hv], a_raw));
    }
    __syncthreads();
    float rq, rk, qk;
    qk_norms(q_s, k_s, sums, rq, rk, qk);
    const i64 at = ((i64)seq * GDN_KEY_HEADS + kh) * GDN_DK + tid;
    p.ws_q[at] = q_s[tid] * rq;
    p.ws_kn[at] = k_s[tid] * rk;
    if (tid == 0) p.ws_w[seq * GDN_KEY_HEADS + kh] = qk * rq * rk;
}

extern "C" __global__ void __launch_bounds__(DEC_THREADS) gdn_decode_prep(const GdnArgs p) { decode_prep<false>(p); }

extern "C" __global__ void __launch_bounds__(DEC_THREADS) gdn_decode_prep_rows(const GdnArgs p) {
    decode_prep<true>(p);
}

// Grid (128, B), clusters of the 4 blocks of one value head; block, thread and state slice as in
// gdn_decode.
extern "C" __global__ void __cluster_dims__(DEC_SLICES, 1, 1) __launch_bounds__(DEC_THREADS)
gdn_decode_state(const GdnArgs p) {
    __shared__ float q_s[GDN_DK], k_s[GDN_DK];  // q·rq and k·rk of key head kh
    __shared__ float v_s[DEC_COLS];
    __shared__ float red[2][DEC_THREADS / 32][DEC_COLS];
    __shared__ float norm_part[DEC_SLICES];

    const int tid = threadIdx.x;
    const int hv = blockIdx.x / DEC_SLICES, kh = hv / 2;
    const int rank = blockIdx.x % DEC_SLICES, v0 = rank * DEC_COLS;
    const int seq = blockIdx.y;
    const int slot = p.slots[seq];
    if (slot < 0 || slot >= p.n_slots) return;  // the whole cluster (one sequence) leaves

    cluster_arrive_relaxed();  // waited on before the remote store

    const int c = tid % 8, r = tid / 8;
    float* S = p.ssm + (i64)slot * GDN_SEQ_STATE + (i64)hv * GDN_HEAD_STATE + v0 + 4 * c;
    float4 s[8];
    auto load_state = [&] {
#pragma unroll
        for (int i = 0; i < 8; ++i) s[i] = *reinterpret_cast<const float4*>(S + (r + 16 * i) * GDN_DV);
    };
    if (p.state_early) {  // as in gdn_decode (gdn.rs decode_in_pass)
        load_state();
        if (tid < 8) prefetch_l1(p.norm_w + v0 + 4 * c);
    }
    pdl_wait();
    pdl_launch_dependents();
    if (!p.state_early) load_state();
    const int col = hv * GDN_DV + v0 + 4 * c;
    uint2 z4 = make_uint2(0u, 0u);
    float4 w4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (tid < 8) {
        z4 = *reinterpret_cast<const uint2*>(p.z + seq * p.z_stride + col);
        w4 = *reinterpret_cast<const float4*>(p.norm_w + v0 + 4 * c);
    }
    const i64 qk_at = ((i64)seq * GDN_KEY_HEADS + kh) * GDN_DK + tid;
    q_s[tid] = __ldcg(p.ws_q + qk_at);
    k_s[tid] = __ldcg(p.ws_kn + qk_at);
    if (tid < DEC_COLS) v_s[tid] = __ldcg(p.ws_u + ((i64)seq * GDN_VALUE_HEADS + hv) * GDN_DV + v0 + tid);
    const float beta = __ldcg(p.ws_beta + seq * GDN_VALUE_HEADS + hv);
    const float alpha = __ldcg(p.ws_g + seq * GDN_VALUE_HEADS + hv);
    const float kq = __ldcg(p.ws_w + seq * GDN_KEY_HEADS + kh);
    __syncthreads();

    // From here as gdn_decode (k_s and q_s hold k·rk and q·rq already).
    float kd[8], delta[4], o[4];
    slice_step(s, k_s, q_s, 1.0f, 1.0f, v_s, beta, alpha, kq, red, kd, delta, o);
    float ob[4];
    const float ss = rounded_square_sum(o, ob);
    cluster_wait();  // every block of the cluster has started
    if (tid < DEC_SLICES) st_cluster(&norm_part[rank], tid, ss);
    cluster_sync();  // norm_part complete; no remote access after this

    store_state(S, s, kd, alpha, delta);
    const float rinv = rsqrtf((norm_part[0] + norm_part[1] + norm_part[2] + norm_part[3]) / GDN_DV + p.eps);
    if (tid < 8) write_gated(p, seq, col, z4, w4, ob, rinv);
}

// gdn_decode_state over p.rows consecutive tokens of one sequence (the state of rows_slot;
// intermediates from gdn_decode_prep_rows), in order: each row is one gdn_decode_state step, the
// state kept in registers from row to row (state_row, as store_state rounds it; fp32 stores and
// loads are exact) and stored once at the end: the same bits as launching the kernel once a
// token, without the launches. Grid (128, 1), clusters of a value head's 4 slices. The
// gated norm's Σo² goes through norm_part by row parity: a block writes row r + 2's parts only
// after the barrier of row r + 1, which every block passes only after reading row r's.
extern "C" __global__ void __cluster_dims__(DEC_SLICES, 1, 1) __launch_bounds__(DEC_THREADS)
gdn_decode_state_rows(const GdnArgs p) {
    __shared__ float q_s[GDN_DK], k_s[GDN_DK];
    __shared__ float v_s[DEC_COLS];
    __shared__ float red[2][DEC_THREADS / 32][DEC_COLS];
    __shared__ float norm_part[2][DEC_SLICES];

    const int tid = threadIdx.x;
    const int hv = blockIdx.x / DEC_SLICES, kh = hv / 2;
    const int rank = blockIdx.x % DEC_SLICES, v0 = rank * DEC_COLS;
    const int slot = rows_slot(p);
    if (slot < 0) return;  // the whole grid leaves
    cluster_arrive_relaxed();  // waited on before the first remote store

    const int c = tid % 8, r = tid / 8;
    const i64 in_state = (i64)hv * GDN_HEAD_STATE + v0 + 4 * c;
    float* S = p.ssm + (i64)slot * GDN_SEQ_STATE + in_state;
    pdl_wait();
    pdl_launch_dependents();
    const int col = hv * GDN_DV + v0 + 4 * c;
    float4 w4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (tid < 8) w4 = *reinterpret_cast<const float4*>(p.norm_w + v0 + 4 * c);
    float4 s[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = *reinterpret_cast<const float4*>(S + (r + 16 * i) * GDN_DV);
    cluster_wait();  // every block of the cluster has started
    for (int seq = 0; seq < p.rows; ++seq) {
        uint2 z4 = make_uint2(0u, 0u);
        if (tid < 8) z4 = *reinterpret_cast<const uint2*>(p.z + seq * p.z_stride + col);
        __syncthreads();  // the previous row's reads of q_s, k_s and v_s are done
        const i64 qk_at = ((i64)seq * GDN_KEY_HEADS + kh) * GDN_DK + tid;
        q_s[tid] = __ldcg(p.ws_q + qk_at);
        k_s[tid] = __ldcg(p.ws_kn + qk_at);
        if (tid < DEC_COLS) v_s[tid] = __ldcg(p.ws_u + ((i64)seq * GDN_VALUE_HEADS + hv) * GDN_DV + v0 + tid);
        const float beta = __ldcg(p.ws_beta + seq * GDN_VALUE_HEADS + hv);
        const float alpha = __ldcg(p.ws_g + seq * GDN_VALUE_HEADS + hv);
        const float kq = __ldcg(p.ws_w + seq * GDN_KEY_HEADS + kh);
        __syncthreads();

        float kd[8], delta[4], o[4];
        slice_step(s, k_s, q_s, 1.0f, 1.0f, v_s, beta, alpha, kq, red, kd, delta, o);
        float ob[4];
        const float ss = rounded_square_sum(o, ob);
        float* part = norm_part[seq % 2];
        if (tid < DEC_SLICES) st_cluster(&part[rank], tid, ss);
        cluster_sync();  // this row's parts complete in every block

#pragma unroll
        for (int i = 0; i < 8; ++i) s[i] = state_row(s[i], kd[i], alpha, delta);
        if (p.ssm_rows && seq + 1 < p.rows) {  // the state after this row, kept for a cut back
            float* kept = p.ssm_rows + (i64)seq * GDN_SEQ_STATE + in_state;
#pragma unroll
            for (int i = 0; i < 8; ++i) *reinterpret_cast<float4*>(kept + (r + 16 * i) * GDN_DV) = s[i];
        }
        const float rinv = rsqrtf((part[0] + part[1] + part[2] + part[3]) / GDN_DV + p.eps);
        if (tid < 8) write_gated(p, seq, col, z4, w4, ob, rinv);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) *reinterpret_cast<float4*>(S + (r + 16 * i) * GDN_DV) = s[i];
}

// ---------------------------------------------------------------------------------------------
// Zeroing: grid (x, rows); entry i of blockIdx.y zeroes slot slots[i] (or slot i when slots is
// null) of the pools; slots out of range are skipped.
extern "C" __global__ void gdn_zero_state(const GdnArgs p) {
    pdl_wait();
    pdl_launch_dependents();
    const int slot = p.slots ? p.slots[blockIdx.y] : (int)blockIdx.y;
    if (slot < 0 || slot >= p.n_slots) return;
    const int stride = gridDim.x * blockDim.x;
    float4* s = reinterpret_cast<float4*>(p.ssm + (i64)slot * GDN_SEQ_STATE);
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < GDN_SEQ_STATE / 4; e += stride)
        s[e] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    uint4* cs = reinterpret_cast<uint4*>(p.conv_state + (i64)slot * GDN_CONV_STATE);
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < GDN_CONV_STATE / 8; e += stride)
        cs[e] = make_uint4(0u, 0u, 0u, 0u);
}

// ---------------------------------------------------------------------------------------------
// Copies of whole states in one launch (a verify pass's cut back: each GDN layer's kept states
// into the slot). Grid (x, n): copy i takes table[4i .. 4i + 4] = recurrent state from, to, conv
// state from, to (device addresses of one sequence's state each).
extern "C" __global__ void gdn_copy_states(const unsigned long long* table) {
    pdl_wait();
    pdl_launch_dependents();
    const unsigned long long* t = table + 4 * blockIdx.y;
    const float4* ssm_from = reinterpret_cast<const float4*>(t[0]);
    float4* ssm_to = reinterpret_cast<float4*>(t[1]);
    const uint4* conv_from = reinterpret_cast<const uint4*>(t[2]);
    uint4* conv_to = reinterpret_cast<uint4*>(t[3]);
    const int stride = gridDim.x * blockDim.x;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < GDN_SEQ_STATE / 4; e += stride) ssm_to[e] = ssm_from[e];
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < GDN_CONV_STATE / 8; e += stride) conv_to[e] = conv_from[e];
}

// ---------------------------------------------------------------------------------------------
// Prefill of T = p.rows tokens of one sequence, in chunks of 64 (MODEL.md §3.6.6). Per value head,
// with G the in-chunk cumulative log-decay and rows padded with zeros to a whole chunk:
//   gdn_prefill_qk     (chunk, key head) in parallel: q, k (conv, SiLU, l2 norm), β, G
//   gdn_prefill_prep   (chunk, head) in parallel:  L = strictly_lower(β k kᵀ ⊙ e^(G_r − G_s)),
//                      solve (I + L)·[U | W] = [β v | β k e^G]
//   gdn_prefill_state  (head, 32 columns) sequential over chunks, the state S in registers:
//                      Vn = U − W·S;  S ← e^(G_last) S + K̃ᵀ Vn  with K̃ = k e^(G_last − G)
//                      (writes each chunk's starting S as Sᵀ, and Vn as Vnᵀ in its slice of the
//                      U tile: the operand layouts of gdn_prefill_out)
//   gdn_prefill_out    (chunk, head) in parallel:  O = (q e^G)·S_chunk + (q kᵀ ⊙ e^(G_r − G_s))_(s≤r)·Vn,
//                      then the gated RMSNorm
//   gdn_conv_update    the conv state after the last token (last: the others read the old one)
// Only gdn_prefill_state is sequential; it splits the dv columns, which evolve independently.
// Precision: the state must match the recurrent form to ~1e-5 over thousands of tokens and the
// outputs must agree with decode, so everything is fp32-accurate: gdn_prefill_prep on the CUDA
// cores, the products of gdn_prefill_state and gdn_prefill_out on the tensor cores in 3xTF32.

__device__ __forceinline__ void cp_async16(u32 s, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    cp_async16((u32)__cvta_generic_to_shared(smem), gmem);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most one group of this thread's copies is still in flight (or none).
__device__ __forceinline__ void cp_async_wait_1() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_0() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// ---------------------------------------------------------------------------------------------
// Tensor cores: mma.m16n8k8 with tf32 operands and fp32 accumulators. Fragments, lane = 4g + t:
//   A (16×8, row-major)  a = {A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4]}
//   B (8×8, k × n)       b = {B[t][g], B[t+4][g]}
//   C, D (16×8)          d = {D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1]}
// A tf32 operand keeps 10 of fp32's 23 mantissa bits, too few here, so every product splits its
// operands as x = hi + lo (both tf32) and sums hi·hi + hi·lo + lo·hi ("3xTF32"): as accurate as
// fp32, at three tensor-core products for one, still several times the fp32 CUDA-core rate.

// d += a·b.
__device__ __forceinline__ void mma_tf32(float d[4], const u32 a[4], const u32 b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The four A values of lane (g, t) for the tile at (m0, k0) of a matrix with element (m, k) at
// x[m · ms + k · ks] (row-major: ms = pitch, ks = 1; transposed storage: ms = 1, ks = pitch).
__device__ __forceinline__ void load_a(float v[4], const float* x, int ms, int ks, int m0, int k0, int g, int t) {
    v[0] = x[(m0 + g) * ms + (k0 + t) * ks];
    v[1] = x[(m0 + g + 8) * ms + (k0 + t) * ks];
    v[2] = x[(m0 + g) * ms + (k0 + t + 4) * ks];
    v[3] = x[(m0 + g + 8) * ms + (k0 + t + 4) * ks];
}
// The two B values of lane (g, t) for the tile at (k0, n0), element (k, n) at x[k · ks + n · ns].
__device__ __forceinline__ void load_b(float v[2], const float* x, int ks, int ns, int k0, int n0, int g, int t) {
    v[0] = x[(k0 + t) * ks + (n0 + g) * ns];
    v[1] = x[(k0 + t + 4) * ks + (n0 + g) * ns];
}

// x = hi + lo with hi tf32 (x rounded to 10 mantissa bits, half an ulp up in magnitude) and lo the
// exact remainder (|lo| ≤ 2⁻¹¹|x|), passed as fp32: the tensor core reads a tf32 operand's top 19
// bits, so lo loses at most 2⁻¹⁰ of itself (≤ 2⁻²¹|x|), as much as a second rounding would. Two
// integer/float instructions and a subtraction, where cvt.rna.tf32 costs four (a compare, an add,
// a select, a mask) per conversion: the splits were most of the 3xTF32 kernels' instructions.
__device__ __forceinline__ void split_tf32(float x, u32& hi, u32& lo) {
    hi = (__float_as_uint(x) + 0x1000u) & 0xFFFFE000u;
    lo = __float_as_uint(x - __uint_as_float(hi));
}

// d += a·b to fp32 accuracy from split operands (the small products first).
__device__ __forceinline__ void mma_3xtf32(float d[4], const u32 ahi[4], const u32 alo[4], const u32 bhi[2], const u32 blo[2]) {
    mma_tf32(d, alo, bhi);
    mma_tf32(d, ahi, blo);
    mma_tf32(d, ahi, bhi);
}

// d += a·b from split operands in PASSES products: 3 (3xTF32, as accurate as fp32) or 1 (the
// rounded tf32 parts alone: 2⁻¹¹ relative per operand; the remainders then go unused and unmade).
template <int PASSES>
__device__ __forceinline__ void mma_passes(float d[4], const u32 ahi[4], const u32 alo[4], const u32 bhi[2],
                                           const u32 blo[2]) {
    static_assert(PASSES == 1 || PASSES == 3, "3xTF32 or plain tf32");
    if constexpr (PASSES == 3) mma_3xtf32(d, ahi, alo, bhi, blo);
    else mma_tf32(d, ahi, bhi);
}

// The split A fragment of the tile at (m0, k0) (see load_a), negated when `neg`.
__device__ __forceinline__ void load_a_split(u32 hi[4], u32 lo[4], const float* x, int ms, int ks, int m0, int k0, int g, int t,
                                             bool neg = false) {
    float v[4];
    load_a(v, x, ms, ks, m0, k0, g, t);
#pragma unroll
    for (int e = 0; e < 4; ++e) split_tf32(neg ? -v[e] : v[e], hi[e], lo[e]);
}
// The split B fragment of the tile at (k0, n0) (see load_b).
__device__ __forceinline__ void load_b_split(u32 hi[2], u32 lo[2], const float* x, int ks, int ns, int k0, int n0, int g, int t) {
    float v[2];
    load_b(v, x, ks, ns, k0, n0, g, t);
    split_tf32(v[0], hi[0], lo[0]);
    split_tf32(v[1], hi[1], lo[1]);
}
// Rows of 128 values read as the k × n operand B of an mma: a pitch of 8 (mod 32) floats spreads
// the lanes' (row t, column g) reads over all banks. SPITCH: gdn_prefill_state's rows of a 32-column
// slice of U.
#define VPITCH 136
#define SPITCH 40

// Conv + SiLU of ROWS rows of the chunk starting at token t0 (rows r0 .. r0 + ROWS − 1 of the
// chunk), channels ch .. ch + 7 (this lane's eight); sink(r, out) takes row r's eight outputs
// (zeros for rows past T), called by every lane for the same r at once (a sink may shuffle).
// The ROWS + 3 input rows a lane needs are all loaded before any is used: one memory latency.
template <int ROWS, typename Sink>
__device__ __forceinline__ void conv_rows(const GdnArgs& p, int t0, int r0, int ch, Sink sink) {
    const int T = p.rows;
    float w[4][8];  // [tap][channel]
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float4 wj = reinterpret_cast<const float4*>(p.conv_w)[ch + j];
        w[0][j] = wj.x;
        w[1][j] = wj.y;
        w[2][j] = wj.z;
        w[3][j] = wj.w;
    }
    // Input row t0 + r0 − 3 + i (token index; −3..−1 are the conv state's rows 0..2), zeros past T.
    uint4 in[ROWS + GDN_HIST];
#pragma unroll
    for (int i = 0; i < ROWS + GDN_HIST; ++i) {
        const int src = t0 + r0 - GDN_HIST + i;
        const bf16* x = src >= 0 ? p.qkv + src * p.qkv_stride : p.conv_state + (src + GDN_HIST) * GDN_CONV_DIM;
        in[i] = src < T ? *reinterpret_cast<const uint4*>(x + ch) : make_uint4(0u, 0u, 0u, 0u);
    }
    float x0[8], x1[8], x2[8], x3[8];  // rows t−3, t−2, t−1, t
    unpack8(in[0], x0);
    unpack8(in[1], x1);
    unpack8(in[2], x2);
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
        unpack8(in[i + GDN_HIST], x3);
        const int r = r0 + i;
        const u32 live = t0 + r < T ? 0xFFFFFFFFu : 0u;  // rows past T: +0 by a mask, not a branch
        float out[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            float acc = w[0][j] * x0[j];
            acc += w[1][j] * x1[j];
            acc += w[2][j] * x2[j];
            acc += w[3][j] * x3[j];
            out[j] = __uint_as_float(__float_as_uint(silu(acc)) & live);
        }
        sink(r, out);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            x0[j] = x1[j];
            x1[j] = x2[j];
            x2[j] = x3[j];
        }
    }
}

// Copies a [64][128] fp32 tile (rows of 128 values, contiguous) into shared rows of PITCH floats.
__device__ __forceinline__ void copy_tile_async(float* dst, const float* src) {
    for (int e = threadIdx.x; e < CHUNK * GDN_DK / 4; e += PF_THREADS) {
        const int r = e / (GDN_DK / 4), d = (e % (GDN_DK / 4)) * 4;
        cp_async16(dst + r * PITCH + d, src + r * GDN_DK + d);
    }
}
// Copies the 64 values of a chunk row (β or G of one value head) into shared memory (16 threads).
__device__ __forceinline__ void copy_row_async(float* dst, const float* src, int lane16) {
    cp_async16(dst + 4 * lane16, src + 4 * lane16);
}

// gdn_prefill_qk's input rows of one chunk in shared memory: the 3 rows before it and its 64, each
// as q ‖ k of the key head (2 × 128 bf16 = 32 pieces of 16 bytes).
#define QK_IN_ROWS (CHUNK + GDN_HIST)
#define QK_PIECES 32
#define QK_SMEM (2 * QK_IN_ROWS * QK_PIECES * 16)  // two buffers

// 16-byte copy, or 16 zero bytes when !valid (cp.async's source size 0).
__device__ __forceinline__ void cp_async16_zfill(u32 s, const void* gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0) : "memory");
}

// Grid (chunk groups, 16 key heads), 256 threads: everything of a chunk that gdn_prefill_prep and
// gdn_prefill_out both need and that depends on the key head or value head alone, once — they each
// recomputed it per value head, ≈ 40 % of their time (bench/NOTES.md v1.46, v1.47):
//   ws_q, ws_kn  q and k of key head kh after conv, SiLU and the l2 norm (q times 1/√dk);
//   ws_beta, ws_g  β and the in-chunk cumulative log-decay G of value heads 2kh, 2kh + 1.
// Padded rows (past T) get q = k = 0, β = 0 and g = 0, so they change nothing. Block x takes chunks
// x, x + gridDim.x, ...: the next chunk's input rows are copied into shared memory (cp.async) while
// this one is computed, so loads, arithmetic and stores overlap (one chunk per block loaded all
// rows, computed, then stored, and ran at ≈ 1.6 TB/s: bench/NOTES.md v1.47). Warp w convolves rows
// 8w .. 8w + 7: lanes 0..15 eight q channels each, lanes 16..31 eight k channels, so a row of one
// head is one half-warp and its l2 norm a half-warp sum.
extern "C" __global__ void __launch_bounds__(PF_THREADS) gdn_prefill_qk(const GdnArgs p) {
    pdl_wait();
    pdl_launch_dependents();
    extern __shared__ uint4 qk_in[];  // [2][QK_IN_ROWS][QK_PIECES]
    __shared__ __align__(16) float g_s[2][CHUNK];
    const int kh = blockIdx.y, tid = threadIdx.x, T = p.rows, nc = (T + CHUNK - 1) / CHUNK;
    const int lane = tid % 32, warp = tid / 32;
    const bool is_k = lane >= 16;
    const int ch = (is_k ? GDN_KEY_DIM : 0) + kh * GDN_DK + (lane % 16) * 8;  // this lane's 8 channels
    const float scale = is_k ? 1.0f : rsqrtf((float)GDN_DK);

    // Chunk c's input rows (tokens t0 − 3 .. t0 + 63; −3..−1 are the conv state's rows 0..2, rows
    // past T zeros) into buffer buf; piece e of row r is channel (e < 16 ? q : k) of head kh.
    // A thread copies piece `lane` (its own channels) of rows warp + 8u.
    const u32 in_s = (u32)__cvta_generic_to_shared(qk_in + warp * QK_PIECES + lane);
    const bf16* qkv_ch = p.qkv + ch;
    const bf16* conv_ch = p.conv_state + ch;
    auto prefetch = [&](int c, int buf) {
#pragma unroll
        for (int u = 0; u < (QK_IN_ROWS + 7) / 8; ++u) {
            const int r = warp + 8 * u, src = c * CHUNK + r - GDN_HIST;
            if (r >= QK_IN_ROWS) break;
            const bf16* x = src >= 0 ? qkv_ch + (i64)min(src, T - 1) * p.qkv_stride : conv_ch + (src + GDN_HIST) * GDN_CONV_DIM;
            cp_async16_zfill(in_s + (u32)(buf * QK_IN_ROWS + 8 * u) * QK_PIECES * 16, x, src < T);
        }
    };

    float w[4][8];  // [tap][channel]
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float4 wj = reinterpret_cast<const float4*>(p.conv_w)[ch + j];
        w[0][j] = wj.x;
        w[1][j] = wj.y;
        w[2][j] = wj.z;
        w[3][j] = wj.w;
    }
    if (blockIdx.x < nc) prefetch(blockIdx.x, 0);
    cp_async_commit();

#pragma unroll 1
    for (int chunk = blockIdx.x, it = 0; chunk < nc; chunk += gridDim.x, ++it) {
        const int t0 = chunk * CHUNK, buf = it % 2;
        if (chunk + gridDim.x < nc) prefetch(chunk + gridDim.x, buf ^ 1);
        cp_async_commit();  // possibly empty: "all but the newest group" is this chunk's

        // The gates' inputs (threads 0..127: value head 2kh + tid / 64, row tid % 64): strided loads,
        // independent of the rows, issued before the wait.
        const int gh = 2 * kh + tid / CHUNK, gt = t0 + tid % CHUNK;
        const bool gate_row = tid < 2 * CHUNK && gt < T;
        const float b_in = gate_row ? bf(p.b[gt * p.b_stride + gh]) : 0.0f;
        const float a_in = gate_row ? bf(p.a[gt * p.a_stride + gh]) : 0.0f;

        cp_async_wait_1();
        __syncthreads();  // this chunk's rows (everyone's copies) are in

        // Conv + SiLU + l2 norm of rows 8w .. 8w + 7 (input rows 8w .. 8w + 10 of the buffer).
        const uint4* in = qk_in + buf * QK_IN_ROWS * QK_PIECES + lane;
        float* dst = (is_k ? p.ws_kn : p.ws_q) + ((i64)chunk * GDN_KEY_HEADS + kh) * CHUNK * GDN_DK + (lane % 16) * 8;
        constexpr int ROWS = CHUNK / (PF_THREADS / 32);
        const int r0 = warp * ROWS;
        float x0[8], x1[8], x2[8], x3[8];  // rows t−3, t−2, t−1, t
        unpack8(in[(r0 + 0) * QK_PIECES], x0);
        unpack8(in[(r0 + 1) * QK_PIECES], x1);
        unpack8(in[(r0 + 2) * QK_PIECES], x2);
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            unpack8(in[(r0 + i + GDN_HIST) * QK_PIECES], x3);
            const int r = r0 + i;
            // Rows past T become +0 through a mask, not a branch around each SiLU (a branch per
            // value cost ≈ 6 instructions of its 22).
            const u32 live = t0 + r < T ? 0xFFFFFFFFu : 0u;
            float out[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                float acc = w[0][j] * x0[j];
                acc += w[1][j] * x1[j];
                acc += w[2][j] * x2[j];
                acc += w[3][j] * x3[j];
                out[j] = __uint_as_float(__float_as_uint(silu(acc)) & live);
            }
            float sq = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j) sq += out[j] * out[j];
#pragma unroll
            for (int o = 8; o > 0; o /= 2) sq += __shfl_xor_sync(0xffffffffu, sq, o);
            const float f = rsqrtf(sq + L2NORM_EPS) * scale;
            float4* d = reinterpret_cast<float4*>(dst + r * GDN_DK);
            d[0] = make_float4(out[0] * f, out[1] * f, out[2] * f, out[3] * f);
            d[1] = make_float4(out[4] * f, out[5] * f, out[6] * f, out[7] * f);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                x0[j] = x1[j];
                x1[j] = x2[j];
                x2[j] = x3[j];
            }
        }

        const i64 gates = ((i64)chunk * GDN_VALUE_HEADS + 2 * kh) * CHUNK;  // this chunk's two rows of β, G
        if (tid < 2 * CHUNK) {
            p.ws_beta[gates + tid] = gate_row ? sigmoidf_(b_in) : 0.0f;
            g_s[tid / CHUNK][tid % CHUNK] = gate_row ? gdn_decay(p.a_log[gh], p.dt_bias[gh], a_in) : 0.0f;
        }
        // Every warp is past its reads of this buffer (the next iteration refills it) and g_s is
        // written (the next iteration writes it again only after its own barrier, which the
        // summing lanes below reach after they have read it).
        __syncthreads();
        if (lane == 0 && warp < 2) {  // sequential, as the reference sums (64 adds); loads first, then the chain
            float g[CHUNK];
#pragma unroll
            for (int i = 0; i < CHUNK; ++i) g[i] = g_s[warp][i];
            float acc = 0.0f;
            float4* out = reinterpret_cast<float4*>(p.ws_g + gates + warp * CHUNK);
#pragma unroll
            for (int i = 0; i < CHUNK; i += 4) {
                float4 v;
                v.x = acc += g[i];
                v.y = acc += g[i + 1];
                v.z = acc += g[i + 2];
                v.w = acc += g[i + 3];
                out[i / 4] = v;
            }
        }
    }
    cp_async_wait_0();
}

// The tiles of a 64 × 64 lower-triangular product x·yᵀ (16 × 8 tiles whose first column is at
// most their row block's last row: 2, 4, 6 and 8 tiles in the row blocks 0..3, 20 in all) spread
// over the 8 warps, at most 3 each; a warp's tiles share a row block, so they share its A
// fragments. Warp w takes row block m0 / 16 and column tiles j0 .. j0 + count − 1:
//   w      0  1  2  3  4  5  6  7
//   m0/16  3  3  3  2  2  1  1  0
//   j0     0  3  6  0  3  0  2  0
//   count  3  3  2  3  3  2  2  2
// (A warp per 16 × 32 quarter gave the busiest warps four tiles and two warps none, which waited
// at the next barrier: bench/NOTES.md v1.47.)
constexpr int TRI_MAX = 3;
__device__ __forceinline__ void tri_tiles(int warp, int& m0, int& j0, int& count) {
    m0 = 16 * ((0x01122333u >> (4 * warp)) & 0xF);
    j0 = (0x02030630u >> (4 * warp)) & 0xF;
    count = (0x22233233u >> (4 * warp)) & 0xF;
}

// acc[jj] = the 16 × 8 tile at rows m0.., columns 8(j0 + jj) of x·yᵀ (jj < count ≤ TRI_MAX), for x
// and y 64 rows of 128 values (shared, pitch PITCH), in PASSES products (mma_passes).
template <int PASSES = 3>
__device__ __forceinline__ void rows_dot_tiles(const float* x, const float* y, int m0, int j0, int count,
                                               float acc[TRI_MAX][4]) {
    const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int j = 0; j < TRI_MAX; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
#pragma unroll 2
    for (int k0 = 0; k0 < GDN_DK; k0 += 8) {
        u32 ahi[4], alo[4];
        load_a_split(ahi, alo, x, PITCH, 1, m0, k0, g, t);
#pragma unroll
        for (int j = 0; j < TRI_MAX; ++j) {
            if (j >= count) continue;  // the same for the whole warp
            u32 bhi[2], blo[2];
            load_b_split(bhi, blo, y, 1, PITCH, k0, 8 * (j0 + j), g, t);  // B = yᵀ: (k, n) at y[n][k]
            mma_passes<PASSES>(acc[j], ahi, alo, bhi, blo);
        }
    }
}

// Dynamic shared memory of gdn_prefill_prep (bytes); gdn.rs has the same formula.
#define PREP_SMEM ((2 * CHUNK * PITCH + CHUNK * LPITCH + 2 * CHUNK) * 4)

// Grid (chunks, 32 value heads), 256 threads. Writes W and U of its (chunk, head).
extern "C" __global__ void __launch_bounds__(PF_THREADS, 2) gdn_prefill_prep(const GdnArgs p) {
    pdl_wait();
    pdl_launch_dependents();
    extern __shared__ float4 smem4[];
    float* k_s = reinterpret_cast<float*>(smem4);  // k, then W
    float* v_s = k_s + CHUNK * PITCH;               // v, then U
    float* L_s = v_s + CHUNK * PITCH;
    float* beta_s = L_s + CHUNK * LPITCH;
    float* G_s = beta_s + CHUNK;
    const int chunk = blockIdx.x, hv = blockIdx.y, kh = hv / 2, t0 = chunk * CHUNK, tid = threadIdx.x;

    // k, β and G from gdn_prefill_qk, in flight while the block convolves its head's v: warp w
    // rows 8w + 4·(lane / 16) .. +3, each half-warp a row of 128 channels.
    const i64 gates = ((i64)chunk * GDN_VALUE_HEADS + hv) * CHUNK;
    copy_tile_async(k_s, p.ws_kn + ((i64)chunk * GDN_KEY_HEADS + kh) * CHUNK * GDN_DK);
    if (tid < 16) copy_row_async(beta_s, p.ws_beta + gates, tid);
    else if (tid < 32) copy_row_async(G_s, p.ws_g + gates, tid - 16);
    cp_async_commit();
    {
        const int lane = tid % 32, r0 = (tid / 32) * 8 + (lane / 16) * 4;
        float* vrow = v_s + (lane % 16) * 8;
        conv_rows<4>(p, t0, r0, 2 * GDN_KEY_DIM + hv * GDN_DV + (lane % 16) * 8, [&](int r, const float out[8]) {
            float4* d = reinterpret_cast<float4*>(vrow + r * PITCH);
            d[0] = make_float4(out[0], out[1], out[2], out[3]);
            d[1] = make_float4(out[4], out[5], out[6], out[7]);
        });
    }
    cp_async_wait_0();
    __syncthreads();

    // L[r][s] = β_r (k_r·k_s) e^(G_r − G_s) for s < r (the reference's order of factors), else 0,
    // in the tiles of tri_tiles (C-fragment layout, see mma_tf32); the substitution reads L[r][s]
    // for s ≤ its row block's last row only, so the tiles right of that are never written.
    {
        const int g = tid % 32 / 4, t = tid % 4;
        int m0, j0, count;
        tri_tiles(tid / 32, m0, j0, count);
        float acc[TRI_MAX][4];
        rows_dot_tiles(k_s, k_s, m0, j0, count, acc);
#pragma unroll
        for (int j = 0; j < TRI_MAX; ++j) {
            if (j >= count) continue;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = m0 + g + 8 * (e / 2), s = 8 * (j0 + j) + 2 * t + e % 2;
                L_s[r * LPITCH + s] = s < r ? beta_s[r] * acc[j][e] * expf(G_s[r] - G_s[s]) : 0.0f;
            }
        }
    }
    const i64 tile = ((i64)chunk * GDN_VALUE_HEADS + hv) * CHUNK * GDN_DK;  // this (chunk, head) in ws_*
    __syncthreads();  // L complete; k_s no longer read by other threads
    // G_s becomes e^G (the W columns' right-hand side factor), computed once per row here rather
    // than 64 times by each W thread, which left the U half of the block waiting at the barrier
    // after the substitution (bench/NOTES.md v1.28).
    if (tid < CHUNK) G_s[tid] = expf(G_s[tid]);
    __syncthreads();

    // Forward substitution (I + L)·X = B, one column per thread: threads 0..127 the columns of W
    // (right-hand side β k e^G), 128..255 those of U (β v), in place. Blocked by 16 rows: for row
    // block i, X_i = B_i − L_(i,<i)·X_(<i) on the tensor cores (3xTF32), then the 16-row triangle
    // L_(i,i) substituted per column. A warp's 32 columns are its own lanes' (and its product's
    // tiles), so only __syncwarp orders the steps. Substituting all 64 rows per column took 2,016
    // FMAs per thread and bound the kernel by the FMA pipe; blocked, 480 (bench/NOTES.md v1.47).
    {
        const int lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
        const bool is_w = tid < GDN_DK;
        float* R = (is_w ? k_s : v_s) + 32 * (warp % 4);  // the warp's 32 columns
        float* X = R + lane;                                 // this thread's column
#pragma unroll 8
        for (int r = 0; r < CHUNK; ++r) X[r * PITCH] *= is_w ? beta_s[r] * G_s[r] : beta_s[r];  // G_s: e^G
        __syncwarp();
#pragma unroll
        for (int i = 0; i < CHUNK / 16; ++i) {
            if (i > 0) {
                float acc[4][4];
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
#pragma unroll
                for (int ks = 0; ks < 2 * i; ++ks) {
                    u32 ahi[4], alo[4];
                    load_a_split(ahi, alo, L_s, LPITCH, 1, 16 * i, 8 * ks, g, t);
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        u32 bhi[2], blo[2];
                        load_b_split(bhi, blo, R, PITCH, 1, 8 * ks, 8 * j, g, t);
                        mma_3xtf32(acc[j], ahi, alo, bhi, blo);
                    }
                }
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) R[(16 * i + g + 8 * (e / 2)) * PITCH + 8 * j + 2 * t + e % 2] -= acc[j][e];
                __syncwarp();
            }
            float x[16];
#pragma unroll
            for (int rr = 0; rr < 16; ++rr) {
                const int r = 16 * i + rr;
                float acc = X[r * PITCH], acc1 = 0.0f, acc2 = 0.0f, acc3 = 0.0f;
                const float* Lr = L_s + r * LPITCH + 16 * i;
#pragma unroll
                for (int s = 0; s < rr; s += 4) {
                    const float4 l = *reinterpret_cast<const float4*>(Lr + s);
                    acc -= l.x * x[s];
                    if (s + 1 < rr) acc1 -= l.y * x[s + 1];
                    if (s + 2 < rr) acc2 -= l.z * x[s + 2];
                    if (s + 3 < rr) acc3 -= l.w * x[s + 3];
                }
                x[rr] = (acc + acc1) + (acc2 + acc3);
            }
#pragma unroll
            for (int rr = 0; rr < 16; ++rr) X[(16 * i + rr) * PITCH] = x[rr];
            __syncwarp();
        }
    }
    __syncthreads();
    for (int e = tid; e < CHUNK * GDN_DK / 4; e += PF_THREADS) {
        const int r = e / (GDN_DK / 4), d = (e % (GDN_DK / 4)) * 4;
        reinterpret_cast<float4*>(p.ws_w + tile)[e] = *reinterpret_cast<const float4*>(k_s + r * PITCH + d);
        reinterpret_cast<float4*>(p.ws_u + tile)[e] = *reinterpret_cast<const float4*>(v_s + r * PITCH + d);
    }
}

// The swizzled operands of gdn_prefill_state's products (wgmma.cuh's 128-byte swizzle, K-major):
// a matrix of `rows` rows (the N side) by K fp32 values is stored as K / 32 blocks of rows × 128
// bytes one after another, row n of a block holding k = 32b .. 32b + 31, 16-byte chunk c at
// chunk c ^ (n % 8). Byte offset of element (n, k):
__device__ __forceinline__ u32 swizzled_offset(int n, int k, int rows) {
    return (u32)((k / 32) * rows * 128 + n * 128 + ((((k % 32) / 4) ^ (n % 8)) << 4) + (k % 4) * 4);
}
// The descriptor of rows n0 .. of such a matrix at k-step k0 (a multiple of 8; n0 a multiple of 8).
__device__ __forceinline__ u64 swizzled_desc(u32 base, int n0, int k0, int rows) {
    return smem_desc(base + (k0 / 32) * rows * 128 + n0 * 128 + (k0 % 32) * 4);
}
// Stores x split into tf32 hi and lo parts at element (n, k) of two such matrices.
__device__ __forceinline__ void store_split_swizzled(unsigned char* hi, unsigned char* lo, int n, int k, int rows, float x) {
    u32 h, l;
    split_tf32(x, h, l);
    const u32 at = swizzled_offset(n, k, rows);
    *reinterpret_cast<u32*>(hi + at) = h;
    *reinterpret_cast<u32*>(lo + at) = l;
}

// Dynamic shared memory of gdn_prefill_state (bytes): slack to align to 1024, Sᵀ and Vnᵀ split
// (hi and lo parts, swizzled), two buffers of W, k, U and G, K̃'s row factors.
#define ST_SWIZZLED (2 * ST_COLS * GDN_DK * 4 + 2 * ST_COLS * CHUNK * 4)
#define XPITCH 24  // W·S's halves exchanged between the warpgroups: 16 columns and padding
#define STATE_SMEM \
    (1024 + ST_SWIZZLED + (2 * (CHUNK * PITCH + CHUNK * VPITCH + CHUNK * SPITCH + CHUNK) + CHUNK + 2 * CHUNK * XPITCH) * 4)

// Grid (4 column slices, 32 value heads), 256 threads = 2 warpgroups; sequential over the chunks.
// The block's state slice S[128 d][32 v] stays in the accumulators of the tensor-core products:
// warp w holds rows 16w..16w+15 (warpgroup w / 4 the rows 64(w / 4)..+63 of an m64n32 product).
// Both products are wgmma in 3xTF32 (fp32 accuracy: the state is carried over thousands of
// tokens), the A operand split in registers, the B operand kept split in shared memory by the
// thread that made each value (Sᵀ and Vnᵀ, K-major as tf32 products need):
//   Vn = U − W·S               m64n32 per warpgroup over its half of k = 128 dk, the halves
//                              summed through shared memory (a chain of 24 products, not 48)
//   S ← e^(G_last) S + K̃ᵀ·Vn   m64n32 per warpgroup (its 64 of the 128 rows), k = 64 chunk rows
// Measured against the mma.sync form it replaced: 0.271 → 0.216 ms a 4K-token layer on the H200
// (bench/NOTES.md v1.73, with ws_h written from the split copy as whole rows); the kernel is bound
// by its chain per chunk (barriers, the products' waits, the copies' issue), not by a pipe.
// The next chunk's W, k, U and G are prefetched with cp.async while the current one is computed.
// K̃ = k e^(G_last − G) is made here from gdn_prefill_qk's k (rows scaled as the A fragments are
// loaded), not read from a copy per value head that gdn_prefill_prep wrote.
extern "C" __global__ void __launch_bounds__(PF_THREADS, 1) gdn_prefill_state(const GdnArgs p) {
    pdl_wait();
    pdl_launch_dependents();
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 raw = smem_u32(smem_raw), base = (raw + 1023) & ~1023u;
    unsigned char* Shi = smem_raw + (base - raw);  // Sᵀ [32 v][128 dk], hi parts
    unsigned char* Slo = Shi + ST_COLS * GDN_DK * 4;
    unsigned char* Vhi = Slo + ST_COLS * GDN_DK * 4;  // Vnᵀ [32 v][64 rows], hi parts
    unsigned char* Vlo = Vhi + ST_COLS * CHUNK * 4;
    const u32 shi_a = smem_u32(Shi), slo_a = smem_u32(Slo), vhi_a = smem_u32(Vhi), vlo_a = smem_u32(Vlo);
    float* W_s = reinterpret_cast<float*>(Shi + ST_SWIZZLED);  // [2][64][PITCH]
    float* K_s = W_s + 2 * CHUNK * PITCH;                       // [2][64][VPITCH]
    float* U_s = K_s + 2 * CHUNK * VPITCH;                      // [2][64][SPITCH]
    float* G_s = U_s + 2 * CHUNK * SPITCH;                      // [2][64], G
    float* F_s = G_s + 2 * CHUNK;                               // [64], e^(G_last − G_r)
    float* X_s = F_s + CHUNK;                                   // [2][64][XPITCH], W·S's halves
    const int hv = blockIdx.y, kh = hv / 2, v0 = blockIdx.x * ST_COLS, tid = threadIdx.x;
    const int warp = tid / 32, g = tid % 32 / 4, t = tid % 4, wg = warp / 4, wr = warp % 4;
    const int nc = (p.rows + CHUNK - 1) / CHUNK;

    // Copies chunk c's W, k (whole), U (this slice) and G into buffer `buf`: 8 + 8 + 2 vectors per
    // thread, and one more for threads 0..15. A thread copies W and k rows cr + 8u (u < 8) at float
    // column cd and U rows ur + 32u (u < 2) at column uv of this slice: offsets that are the same in
    // every chunk's tile, so per chunk only the tile's start moves (the per-chunk address arithmetic
    // was as many instructions as the products, bench/NOTES.md v1.46).
    constexpr int CP_ROWS = PF_THREADS / 32;
    constexpr i64 CHUNK_STRIDE = (i64)GDN_VALUE_HEADS * CHUNK * GDN_DK;  // floats between chunks' tiles
    constexpr i64 KEY_CHUNK_STRIDE = (i64)GDN_KEY_HEADS * CHUNK * GDN_DK;
    static_assert(CHUNK * ST_COLS / 4 == 2 * PF_THREADS, "two U vectors per thread");
    static_assert(PF_THREADS == 256 && ST_COLS == 32 && CHUNK == 64 && GDN_DK == 128, "the wgmma shapes below");
    const int cr = tid / 32, cd = 4 * (tid % 32), ur = tid / 8, uv = 4 * (tid % 8);
    const float* w_src = p.ws_w + (i64)hv * CHUNK * GDN_DK + cr * GDN_DK + cd;
    const float* k_src = p.ws_kn + (i64)kh * CHUNK * GDN_DK + cr * GDN_DK + cd;
    const float* u_src = p.ws_u + (i64)hv * CHUNK * GDN_DK + ur * GDN_DV + v0 + uv;
    const float* g_src = p.ws_g + (i64)hv * CHUNK + 4 * (tid % 16);
    const u32 w_dst = smem_u32(W_s + cr * PITCH + cd);
    const u32 k_dst = smem_u32(K_s + cr * VPITCH + cd);
    const u32 u_dst = smem_u32(U_s + ur * SPITCH + uv);
    const u32 g_dst = smem_u32(G_s + 4 * (tid % 16));
    auto prefetch = [&](int c, int buf) {
        const i64 at = c * CHUNK_STRIDE, key_at = c * KEY_CHUNK_STRIDE;
#pragma unroll
        for (int u = 0; u < CHUNK / CP_ROWS; ++u) {
            cp_async16(w_dst + 4 * (buf * CHUNK + CP_ROWS * u) * PITCH, w_src + at + CP_ROWS * u * GDN_DK);
            cp_async16(k_dst + 4 * (buf * CHUNK + CP_ROWS * u) * VPITCH, k_src + key_at + CP_ROWS * u * GDN_DK);
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) cp_async16(u_dst + 4 * (buf * CHUNK + 32 * u) * SPITCH, u_src + at + 32 * u * GDN_DV);
        if (tid < 16) cp_async16(g_dst + 4 * buf * CHUNK, g_src + (i64)c * GDN_VALUE_HEADS * CHUNK);
    };
    prefetch(0, 0);
    cp_async_commit();

    // S[d][v] for d = 16·warp + g (+8), v = 8j + 2t (+1): s[4j + 2h + e] = S[d0 + g + 8h][8j + 2t + e],
    // the accumulator layout of an m64n32 product.
    const int d0 = 16 * warp;
    float* state = p.ssm + (i64)hv * GDN_HEAD_STATE + v0;
    float s[16];
    // Sᵀ from the accumulators, split, for the next W·S (visible to the tensor cores after a barrier).
    auto store_state = [&]() {
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                store_split_swizzled(Shi, Slo, 8 * j + 2 * t + e % 2, d0 + g + 8 * (e / 2), ST_COLS, s[4 * j + e]);
        fence_async_shared();
    };
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float2 x = *reinterpret_cast<const float2*>(state + (d0 + g + 8 * h) * GDN_DV + 8 * j + 2 * t);
            s[4 * j + 2 * h] = x.x;
            s[4 * j + 2 * h + 1] = x.y;
        }
    store_state();

#pragma unroll 1
    for (int c = 0; c < nc; ++c) {
        const int buf = c % 2;
        if (c + 1 < nc) prefetch(c + 1, buf ^ 1);
        cp_async_commit();  // possibly empty: keeps "all but the newest group" meaning chunk c
        cp_async_wait_1();
        __syncthreads();  // chunk c's buffers (everyone's copies) and Sᵀ are ready
        const float* W = W_s + buf * CHUNK * PITCH;
        const float* K = K_s + buf * CHUNK * VPITCH;
        const float* U = U_s + buf * CHUNK * SPITCH;
        const i64 tile = ((i64)c * GDN_VALUE_HEADS + hv) * CHUNK * GDN_DK;
        // e^(G_last) and K̃'s row factors. Padded rows have g = 0, so G_last = G[63] is the last
        // real row's G. F_s is read after the next barrier (the previous chunk's reads are done).
        const float* G = G_s + buf * CHUNK;
        const float decay = expf(G[CHUNK - 1]);
        if (tid < CHUNK) F_s[tid] = expf(G[CHUNK - 1] - G[tid]);

        // The state at the start of chunk c for gdn_prefill_out, as Sᵀ (the K-major operand its
        // products read) from the split copy: hi + lo is the value exactly (split_tf32). Thread
        // (row tid / 8, chunk tid % 8) writes 16 bytes of each 128-byte block of its row.
        {
            const int v = tid / 8, c8 = tid % 8;
            float* h = p.ws_h + ((i64)c * GDN_VALUE_HEADS + hv) * GDN_HEAD_STATE + (i64)(v0 + v) * GDN_DK + 4 * c8;
#pragma unroll
            for (int kb = 0; kb < GDN_DK / 32; ++kb) {
                const u32 at = swizzled_offset(v, 32 * kb + 4 * c8, ST_COLS);
                const float4 hi = *reinterpret_cast<const float4*>(Shi + at), lo = *reinterpret_cast<const float4*>(Slo + at);
                *reinterpret_cast<float4*>(h + 32 * kb) = make_float4(hi.x + lo.x, hi.y + lo.y, hi.z + lo.z, hi.w + lo.w);
            }
        }

        // Vn = U − W·S, with −W as the A operand: warpgroup wg sums k = 64wg .. 64wg + 63 for all
        // 32 columns (rows 16wr + g (+8), columns 8j + 2t (+1): acc[4j + 2h + e]), warpgroup 0's
        // onto U; each then hands the other the half of the columns the other owns (16wg ..
        // 16wg + 15 are warpgroup wg's), through X_s, and adds the half it got to its own.
        {
            float acc[16];
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const float2 u = wg == 0 ? *reinterpret_cast<const float2*>(U + (16 * wr + g + 8 * hh) * SPITCH + 8 * j + 2 * t)
                                             : make_float2(0.0f, 0.0f);
                    acc[4 * j + 2 * hh] = u.x;
                    acc[4 * j + 2 * hh + 1] = u.y;
                }
            constexpr int KS = GDN_DK / 16;  // k-steps per warpgroup
            u32 ahi[KS][4], alo[KS][4];
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) load_a_split(ahi[ks], alo[ks], W, PITCH, 1, 16 * wr, 64 * wg + 8 * ks, g, t, true);
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
                const int k0 = 64 * wg + 8 * ks;
                wgmma_tf32_k8<32>(acc, alo[ks], swizzled_desc(shi_a, 0, k0, ST_COLS));
                wgmma_tf32_k8<32>(acc, ahi[ks], swizzled_desc(slo_a, 0, k0, ST_COLS));
                wgmma_tf32_k8<32>(acc, ahi[ks], swizzled_desc(shi_a, 0, k0, ST_COLS));
            }
            wgmma_commit();
            fence_accumulators<32>(acc);
            wgmma_wait<0>();
            fence_accumulators<32>(acc);
            // The other warpgroup's columns to X_s[wg], then ours from X_s[1 − wg]: the sum is
            // warpgroup 0's part plus warpgroup 1's in either order (the same bits).
#pragma unroll
            for (int jj = 0; jj < 2; ++jj)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int r = 16 * wr + g + 8 * hh, i = 4 * jj + 2 * hh;  // accumulator i: column tile jj
                    *reinterpret_cast<float2*>(X_s + (wg * CHUNK + r) * XPITCH + 8 * jj + 2 * t) =
                        wg == 0 ? make_float2(acc[8 + i], acc[8 + i + 1]) : make_float2(acc[i], acc[i + 1]);
                }
            __syncthreads();  // both halves handed over
            // Vnᵀ split for K̃ᵀ·Vn (and, after the barrier, for gdn_prefill_out).
#pragma unroll
            for (int jj = 0; jj < 2; ++jj)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int r = 16 * wr + g + 8 * hh, v = 16 * wg + 8 * jj + 2 * t, i = 4 * jj + 2 * hh;
                    const float2 o = *reinterpret_cast<const float2*>(X_s + ((1 - wg) * CHUNK + r) * XPITCH + 8 * jj + 2 * t);
                    const float2 m = wg == 0 ? make_float2(acc[i], acc[i + 1]) : make_float2(acc[8 + i], acc[8 + i + 1]);
                    const float2 x = make_float2(m.x + o.x, m.y + o.y);
                    store_split_swizzled(Vhi, Vlo, v, r, ST_COLS, x.x);
                    store_split_swizzled(Vhi, Vlo, v + 1, r, ST_COLS, x.y);
                }
            fence_async_shared();
        }
        __syncthreads();  // Vnᵀ complete; every W·S read of Sᵀ done

        // Vn for gdn_prefill_out, as Vnᵀ in this block's own slice of the U tile (read a chunk
        // ago, by the prefetch, and by no other block): row v0 + j's 64 values at
        // (2j + r / 32)·128 + v0 + r % 32, so a slab of 32 rows r of Vnᵀ row v is 128 contiguous
        // bytes. From the split copy (hi + lo is the value exactly), 16 bytes a thread twice.
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int i = tid + PF_THREADS * u, j = i / 16, kb = i % 16 / 8, c8 = i % 8;
            const u32 at = swizzled_offset(j, 32 * kb + 4 * c8, ST_COLS);
            const float4 hi = *reinterpret_cast<const float4*>(Vhi + at), lo = *reinterpret_cast<const float4*>(Vlo + at);
            *reinterpret_cast<float4*>(p.ws_u + tile + (2 * j + kb) * GDN_DV + v0 + 4 * c8) =
                make_float4(hi.x + lo.x, hi.y + lo.y, hi.z + lo.z, hi.w + lo.w);
        }

        // S ← e^(G_last) S + K̃ᵀ Vn: A = K̃ᵀ (element (d, r) = k[r][d] · F[r]), B = Vn.
#pragma unroll
        for (int i = 0; i < 16; ++i) s[i] *= decay;
        {
            u32 ahi[CHUNK / 8][4], alo[CHUNK / 8][4];
#pragma unroll
            for (int ks = 0; ks < CHUNK / 8; ++ks) {
                const int k0 = 8 * ks;
                float a[4];
                load_a(a, K, 1, VPITCH, d0, k0, g, t);  // a[0], a[1] from row k0 + t; a[2], a[3] from k0 + t + 4
                const float f0 = F_s[k0 + t], f1 = F_s[k0 + t + 4];
                split_tf32(a[0] * f0, ahi[ks][0], alo[ks][0]);
                split_tf32(a[1] * f0, ahi[ks][1], alo[ks][1]);
                split_tf32(a[2] * f1, ahi[ks][2], alo[ks][2]);
                split_tf32(a[3] * f1, ahi[ks][3], alo[ks][3]);
            }
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < CHUNK / 8; ++ks) {
                wgmma_tf32_k8<32>(s, alo[ks], swizzled_desc(vhi_a, 0, 8 * ks, ST_COLS));
                wgmma_tf32_k8<32>(s, ahi[ks], swizzled_desc(vlo_a, 0, 8 * ks, ST_COLS));
                wgmma_tf32_k8<32>(s, ahi[ks], swizzled_desc(vhi_a, 0, 8 * ks, ST_COLS));
            }
            wgmma_commit();
            fence_accumulators<32>(s);
            wgmma_wait<0>();
            fence_accumulators<32>(s);
        }
        store_state();
        __syncthreads();  // Sᵀ updated; this chunk's buffers free for the prefetch of chunk c + 2
    }
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
            *reinterpret_cast<float2*>(state + (d0 + g + 8 * hh) * GDN_DV + 8 * j + 2 * t) =
                make_float2(s[4 * j + 2 * hh], s[4 * j + 2 * hh + 1]);
}

// Dynamic shared memory of gdn_prefill_out (bytes): slack to align to 1024, A (then a 32-row slab
// of Sᵀ, split), q, k/Vn, G.
#define OUT_SLAB (2 * GDN_DV * 32 * 4)
#define OUT_SMEM (1024 + OUT_SLAB + (CHUNK * PITCH + CHUNK * VPITCH + CHUNK) * 4)
static_assert(CHUNK * LPITCH * 4 <= OUT_SLAB, "A fits where the slabs go");

// Grid (chunks, 32 value heads), 256 threads = 2 warpgroups, two blocks per SM. The products run
// on the tensor cores in PASSES products: gdn_prefill_out in 3xTF32 (prefill then agrees with
// decode as closely as fp32 allows); gdn_prefill_out_tf32 in plain tf32, a third of the products
// and none of the remainders, at noise of ~1e-3 of a head's rms in the outputs, 1/3 of their bf16
// rounding (the reference's chunked kernels take these products in bf16; under trial,
// bench/NOTES.md v1.37). Warp w computes rows 16(w % 4)..+15 of the chunk's outputs, columns
// 64(w / 4)..+63 (warpgroup w / 4's half of an m64n128 product):
//   A = (q kᵀ ⊙ e^(G_r − G_s))_(s≤r)      mma.sync, the lower triangle's tiles only
//   O = A·Vn + (q e^G)·S_chunk             wgmma (m64n64k8 per warpgroup) over k = 64 + 128: Vnᵀ
//                                          and Sᵀ streamed through shared memory 32 k at a time
//                                          (six slabs), split into tf32 hi and lo parts (the
//                                          K-major B operand); A and q e^G split in registers
// (bench/NOTES.md v1.73: 0.218 ms a 4K-token layer on mma.sync, 0.184 now; the plain-tf32 variant
// has ptxas serialise its products within a slab, which costs it little.)
// The outputs go through shared memory to the gated norm, a warp per row.
template <int PASSES>
__device__ __forceinline__ void prefill_out(const GdnArgs& p) {
    extern __shared__ __align__(1024) unsigned char out_smem[];
    const u32 raw = smem_u32(out_smem), base = (raw + 1023) & ~1023u;
    unsigned char* slab = out_smem + (base - raw);  // [128 dv][32 dk] hi parts, then lo parts (swizzled)
    float* q_s = reinterpret_cast<float*>(slab + OUT_SLAB);  // [64][PITCH]: q, then q e^G, then the outputs
    float* kv_s = q_s + CHUNK * PITCH;                        // [64][PITCH] k
    float* A_s = kv_s;                                        // [64][LPITCH] A, once k is read
    float* G_s = kv_s + CHUNK * VPITCH;
    const u32 slab_hi = smem_u32(slab), slab_lo = slab_hi + OUT_SLAB / 2;
    const int chunk = blockIdx.x, hv = blockIdx.y, kh = hv / 2, t0 = chunk * CHUNK, tid = threadIdx.x;
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4, wg = warp / 4;
    const int m0 = 16 * (warp % 4), n_base = 64 * wg;

    // q, k and G from gdn_prefill_qk.
    const i64 qk_tile = ((i64)chunk * GDN_KEY_HEADS + kh) * CHUNK * GDN_DK;
    copy_tile_async(q_s, p.ws_q + qk_tile);
    copy_tile_async(kv_s, p.ws_kn + qk_tile);
    if (tid < 16) copy_row_async(G_s, p.ws_g + ((i64)chunk * GDN_VALUE_HEADS + hv) * CHUNK, tid);
    cp_async_commit();
    cp_async_wait_0();
    __syncthreads();

    // A[r][s] = (q_r·k_s) e^(G_r − G_s) for s ≤ r, in the tiles of tri_tiles, written into k's
    // room once every warp is done with k. The tiles right of the diagonal are never written: the
    // A fragments below read them as zeros.
    {
        int am0, j0, count;
        tri_tiles(warp, am0, j0, count);
        float acc[TRI_MAX][4];
        rows_dot_tiles<PASSES>(q_s, kv_s, am0, j0, count, acc);
        __syncthreads();  // k no longer read
#pragma unroll
        for (int j = 0; j < TRI_MAX; ++j) {
            if (j >= count) continue;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = am0 + g + 8 * (e / 2), s = 8 * (j0 + j) + 2 * t + e % 2;
                A_s[r * LPITCH + s] = s <= r ? acc[j][e] * expf(G_s[r] - G_s[s]) : 0.0f;
            }
        }
    }

    // The B operand in six slabs of 128 rows (dv) × 32 (k), each loaded into registers a slab
    // ahead: thread (row tid / 8 + 32u, chunk tid % 8) holds 16 bytes of each row. Slabs 0, 1:
    // Vnᵀ's rows 0..31 and 32..63 (the state kernel's layout in the U tile: row v's 64 values at
    // (2(v % 32) + r / 32)·128 + 32(v / 32) + r % 32); slabs 2..5: Sᵀ, 32 dk each.
    const i64 tile = ((i64)chunk * GDN_VALUE_HEADS + hv) * CHUNK * GDN_DK;
    const float* vsrc = p.ws_u + tile + 2 * (tid / 8) * GDN_DV + 4 * (tid % 8);
    const float* hsrc = p.ws_h + ((i64)chunk * GDN_VALUE_HEADS + hv) * GDN_HEAD_STATE + (tid / 8) * GDN_DK + 4 * (tid % 8);
    constexpr int SLAB_VECS = GDN_DV * 32 / 4 / PF_THREADS;  // float4 per thread per slab
    constexpr int SLABS = CHUNK / 32 + GDN_DK / 32;
    float4 held[SLAB_VECS];
    auto load_slab = [&](int sl) {
#pragma unroll
        for (int u = 0; u < SLAB_VECS; ++u)
            held[u] = sl < CHUNK / 32 ? *reinterpret_cast<const float4*>(vsrc + sl * GDN_DV + 32 * u)
                                      : *reinterpret_cast<const float4*>(hsrc + 32 * u * GDN_DK + 32 * (sl - CHUNK / 32));
    };
    load_slab(0);

#pragma unroll
    for (int e = tid; e < CHUNK * GDN_DK / 4; e += PF_THREADS) {
        const int r = e / (GDN_DK / 4), d = (e % (GDN_DK / 4)) * 4;
        float4* qr = reinterpret_cast<float4*>(q_s + r * PITCH + d);
        const float f = expf(G_s[r]);
        float4 q = *qr;
        q.x *= f;
        q.y *= f;
        q.z *= f;
        q.w *= f;
        *qr = q;
    }

    // d[4j + e] = O[m0 + g + 8(e / 2)][n_base + 8j + 2t + e % 2], the accumulator layout of the
    // warpgroup's m64n64 products: O = A·Vn (slabs 0, 1) + (q e^G)·S_chunk (slabs 2..5).
    float acc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = 0.0f;
#pragma unroll 1
    for (int sl = 0; sl < SLABS; ++sl) {
        __syncthreads();  // the previous slab no longer read (the first time: A and q e^G in place)
#pragma unroll
        for (int u = 0; u < SLAB_VECS; ++u) {
            const int v = tid / 8 + 32 * u, c8 = tid % 8;
            const u32 at = swizzled_offset(v, 4 * c8, GDN_DV);
            uint4 hi, lo;
            split_tf32(held[u].x, hi.x, lo.x);
            split_tf32(held[u].y, hi.y, lo.y);
            split_tf32(held[u].z, hi.z, lo.z);
            split_tf32(held[u].w, hi.w, lo.w);
            *reinterpret_cast<uint4*>(slab + at) = hi;
            if constexpr (PASSES == 3) *reinterpret_cast<uint4*>(slab + OUT_SLAB / 2 + at) = lo;
        }
        fence_async_shared();
        __syncthreads();  // the slab in place for the tensor cores
        if (sl + 1 < SLABS) load_slab(sl + 1);
        u32 ahi[4][4], alo[4][4];
        if (sl < CHUNK / 32) {
            // A's rows m0.., columns 32sl + 8ks..: zero right of the diagonal.
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) {
                const int k0 = 32 * sl + 8 * ks;
                float a[4];
                load_a(a, A_s, LPITCH, 1, m0, k0, g, t);
                a[0] = k0 + t <= m0 + g ? a[0] : 0.0f;
                a[1] = k0 + t <= m0 + g + 8 ? a[1] : 0.0f;
                a[2] = k0 + t + 4 <= m0 + g ? a[2] : 0.0f;
                a[3] = k0 + t + 4 <= m0 + g + 8 ? a[3] : 0.0f;
#pragma unroll
                for (int e = 0; e < 4; ++e) split_tf32(a[e], ahi[ks][e], alo[ks][e]);
            }
        } else {
#pragma unroll
            for (int ks = 0; ks < 4; ++ks)
                load_a_split(ahi[ks], alo[ks], q_s, PITCH, 1, m0, 32 * (sl - CHUNK / 32) + 8 * ks, g, t);
        }
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            if constexpr (PASSES == 3) {
                wgmma_tf32_k8<64>(acc, alo[ks], swizzled_desc(slab_hi, n_base, 8 * ks, GDN_DV));
                wgmma_tf32_k8<64>(acc, ahi[ks], swizzled_desc(slab_lo, n_base, 8 * ks, GDN_DV));
            }
            wgmma_tf32_k8<64>(acc, ahi[ks], swizzled_desc(slab_hi, n_base, 8 * ks, GDN_DV));
        }
        wgmma_commit();
        fence_accumulators<64>(acc);
        wgmma_wait<0>();
        fence_accumulators<64>(acc);
    }
    __syncthreads();  // every warp is done with q_s, which takes the outputs now
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
            *reinterpret_cast<float2*>(q_s + (m0 + g + 8 * hh) * PITCH + n_base + 8 * j + 2 * t) =
                make_float2(acc[4 * j + 2 * hh], acc[4 * j + 2 * hh + 1]);
    __syncthreads();

    // Gated RMSNorm per row (as in gdn_decode), a warp per row, lane l on columns 4l..4l+3;
    // written for the real rows only.
    const float4 w4 = *reinterpret_cast<const float4*>(p.norm_w + 4 * lane);
    const int col = hv * GDN_DV + 4 * lane;
    constexpr int NORM_ROWS = CHUNK / (PF_THREADS / 32);  // rows per warp
    uint2 zrow[NORM_ROWS];  // the gate inputs of the warp's rows, loaded before any is needed
#pragma unroll
    for (int i = 0; i < NORM_ROWS; ++i) {
        const int tok = t0 + warp + i * (PF_THREADS / 32);
        zrow[i] = tok < p.rows ? *reinterpret_cast<const uint2*>(p.z + tok * p.z_stride + col) : make_uint2(0u, 0u);
    }
#pragma unroll
    for (int i = 0; i < NORM_ROWS; ++i) {
        const int r = warp + i * (PF_THREADS / 32);
        const float4 o4 = *reinterpret_cast<const float4*>(q_s + r * PITCH + 4 * lane);
        const float ob[4] = {bf16_round(o4.x), bf16_round(o4.y), bf16_round(o4.z), bf16_round(o4.w)};
        const float rinv = rsqrtf(warp_sum(ob[0] * ob[0] + ob[1] * ob[1] + ob[2] * ob[2] + ob[3] * ob[3]) / GDN_DV + p.eps);
        const int tok = t0 + r;
        if (tok < p.rows) write_gated(p, tok, col, zrow[i], w4, ob, rinv);
    }
}

extern "C" __global__ void __launch_bounds__(PF_THREADS, 2) gdn_prefill_out(const GdnArgs p) {
    pdl_wait();
    pdl_launch_dependents();
    prefill_out<3>(p);
}
extern "C" __global__ void __launch_bounds__(PF_THREADS, 2) gdn_prefill_out_tf32(const GdnArgs p) {
    pdl_wait();
    pdl_launch_dependents();
    prefill_out<1>(p);
}

// The conv state after T = p.rows tokens: the last 3 rows of (old state ‖ inputs). One thread per
// 8 channels; it reads all three old rows before writing, so T < 3 (which keeps some old rows)
// works in place. With p.conv_rows, also the state after each token but the last (a verify pass).
// The state is that of rows_slot.
extern "C" __global__ void gdn_conv_update(const GdnArgs p) {
    pdl_wait();
    pdl_launch_dependents();
    const int v = blockIdx.x * blockDim.x + threadIdx.x;
    const int slot = rows_slot(p);
    if (v >= GDN_CONV_DIM / 8 || slot < 0) return;
    uint4* hist = reinterpret_cast<uint4*>(p.conv_state + (i64)slot * GDN_CONV_STATE) + v;
    const uint4 old0 = hist[0], old1 = hist[GDN_CONV_DIM / 8], old2 = hist[2 * GDN_CONV_DIM / 8];
    // The history after `tokens` tokens, row i (i < 3).
    auto after = [&](int tokens, int i) {
        const int src = tokens - GDN_HIST + i;  // token index; negative: old row src + 3
        const uint4 keep = src == -3 ? old0 : src == -2 ? old1 : old2;
        return src < 0 ? keep : *reinterpret_cast<const uint4*>(p.qkv + src * p.qkv_stride + v * 8);
    };
    if (p.conv_rows)
        for (int t = 1; t < p.rows; ++t) {
            uint4* kept = reinterpret_cast<uint4*>(p.conv_rows + (i64)(t - 1) * GDN_CONV_STATE) + v;
#pragma unroll
            for (int i = 0; i < GDN_HIST; ++i) kept[i * (GDN_CONV_DIM / 8)] = after(t, i);
        }
#pragma unroll
    for (int i = 0; i < GDN_HIST; ++i) hist[i * (GDN_CONV_DIM / 8)] = after(p.rows, i);
}
