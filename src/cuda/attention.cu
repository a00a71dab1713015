// Gated full attention (spec/MODEL.md §3.4-3.5) for Qwen3.6-35B-A3B's shape: 16 query heads,
// 2 KV heads (GQA group 8), head_dim 256, rotate-half RoPE on the first 64 dims. bf16 in and out,
// fp32 math. attention.rs launches these kernels and documents the buffers they take.
//
//   attn_prepare          per token: q/k RMSNorm (effective weight 1+w), RoPE, K/V cache append
//                         (prefill; decode does the same inside attn_decode_split)
//   attn_prefill          T new tokens of one sequence over its cache: causal flash attention
//                         (tensor cores, mma.sync m16n8k16 bf16), output gate fused; for short
//                         chunks at long context also split over the keys
//   attn_prefill_wgmma    the same on Hopper's warpgroup products, for long chunks
//                         (attention_wgmma.cu)
//   attn_decode_split     one new token per sequence: q/k norm, RoPE and the append as above,
//                         then flash-decoding over a chunk of the cache
//   attn_combine          merges the key chunks of a split attn_decode_split or attn_prefill,
//                         applies the output gate
//
// Input of every kernel: the fused projection `qkv` of each token, 9216 bf16 values laid out as
// q_proj's output (16 heads × [query 256 ‖ gate 256]) then k (2 × 256) then v (2 × 256).
//
// The KV cache is one pool of `slots` sequences, K and V in separate buffers of the same layout
// [slot][layer][kv_head][capacity][256] bf16: the keys of one sequence, layer and KV head are one
// contiguous run of rows, which the kernels stream in tiles. Keys are stored post-norm, post-RoPE.
//
// Tensor-core fragments (PTX ISA, mma.m16n8k16 with bf16): lane = 4·g + t (g = lane / 4 its
// "group", t = lane % 4). A (16×16, row-major) holds a0 = A[g][2t,2t+1], a1 = A[g+8][2t..],
// a2 = A[g][8+2t..], a3 = A[g+8][8+2t..]; B (16×8) holds b0 = B[2t,2t+1][g], b1 = B[8+2t..][g];
// C (16×8, fp32) holds c0,c1 = C[g][2t,2t+1], c2,c3 = C[g+8][2t,2t+1]. ldmatrix.x4 gives lane
// the elements [lane/4][2·(lane%4) ..] of four 8×8 matrices whose rows are addressed by lanes
// 0-7, 8-15, 16-23, 24-31 (with .trans, of their transposes).
#include "attention.cuh"

// ---------------------------------------------------------------------------------------------
// attn_prepare: q/k RMSNorm + RoPE, K/V cache append.
//
// One warp per (token, unit), 20 units per token: 16 query heads, 2 key heads, 2 value heads.
// Lane l holds dims 8l .. 8l+7 of its head as one 16-byte vector. The rotated dims 0..63 are on
// lanes 0..7, and the RoPE partner of dim j < 32 (dim j + 32) is on lane l + 4.
//
// Prefill only (decode does this inside attn_decode_split): row r is position start + r of the
// sequence in `slot`.
// Queries go to q_out [rows][16][256]; the gates are not copied (the attention kernels read them
// from qkv).

#define PREP_UNITS 20
#define PREP_WARPS 4

// The rotary inverse frequencies inv_freq[i] = 1 / θ^(2i/64), computed on the host exactly as the
// CPU reference does (in f64, rounded to f32), passed by value. __grid_constant__ lets lanes index
// it at run time in the parameter space instead of a per-thread copy.
struct RopeFreqs {
    float inv_freq[ROT_HALF];
};

// One head's RMSNorm (weight w, effective 1 + stored) and RoPE at position pos: lane l's dims
// 8l .. 8l + 7 of x in, the same dims out (bf16). The whole warp takes part (shuffles).
__device__ __forceinline__ uint4 norm_rope_lane(const bf16* x, const float* __restrict__ w, int pos, int lane,
                                                const RopeFreqs& rope, float eps) {
    float f[8];
    unpack8(reinterpret_cast<const uint4*>(x)[lane], f);
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) ss += f[i] * f[i];
    const float r = rsqrtf(warp_sum(ss) / HEAD_DIM + eps);
    const float4 w0 = reinterpret_cast<const float4*>(w)[2 * lane];
    const float4 w1 = reinterpret_cast<const float4*>(w)[2 * lane + 1];
    const float wv[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = f[i] * r * wv[i];  // (x · r) · w, the reference's order

    // RoPE: x'[j] = x[j]·cos − x[j+32]·sin and x'[j+32] = x[j+32]·cos + x[j]·sin, angle pos·inv_freq[j].
    float partner[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) partner[i] = __shfl_xor_sync(0xffffffffu, f[i], 4);
    if (lane < 8) {
        const float sign = lane < 4 ? -1.0f : 1.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            // The angle is the reference's f32 product; it reaches 2.6e5 rad at 262K tokens, so it
            // is reduced to [−π, π] in f64 (exact enough), where the fast __sincosf is accurate to
            // ~4e-7, without the local-memory slow path of sincosf for large arguments.
            const float ang = (float)pos * rope.inv_freq[8 * (lane & 3) + i];
            const double two_pi = 6.283185307179586;
            const float red = (float)((double)ang - two_pi * rint((double)ang * (1.0 / two_pi)));
            float sn, cs;
            __sincosf(red, &sn, &cs);
            f[i] = f[i] * cs + sign * partner[i] * sn;
        }
    }
    return pack8(f);
}

extern "C" __global__ void __launch_bounds__(32 * PREP_WARPS)
    attn_prepare(const bf16* __restrict__ qkv, const float* __restrict__ q_norm,
                 const float* __restrict__ k_norm, const __grid_constant__ RopeFreqs rope, const KvCacheArgs c,
                 int slot, int start, bf16* __restrict__ q_out, int rows, float eps) {
    const int unit_id = blockIdx.x * PREP_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row = unit_id / PREP_UNITS, unit = unit_id % PREP_UNITS;
    pdl_wait();
    pdl_launch_dependents();
    if (row >= rows) return;
    const int pos = start + row;
    const bool cached = in_cache(c, slot, pos);
    const bf16* src = qkv + (u64)row * QKV_STRIDE;

    if (unit >= N_QHEADS + N_KVHEADS) {  // a value head: copied as it is
        const int vh = unit - N_QHEADS - N_KVHEADS;
        if (!cached) return;
        const uint4 v = reinterpret_cast<const uint4*>(src + V_OFFSET + vh * HEAD_DIM)[lane];
        reinterpret_cast<uint4*>(c.v + cache_offset(c, slot, vh) + (u64)pos * HEAD_DIM)[lane] = v;
        return;
    }
    const bool is_q = unit < N_QHEADS;
    if (!is_q && !cached) return;
    const bf16* x = is_q ? src + unit * 2 * HEAD_DIM : src + K_OFFSET + (unit - N_QHEADS) * HEAD_DIM;
    const uint4 y = norm_rope_lane(x, is_q ? q_norm : k_norm, pos, lane, rope, eps);
    if (is_q) {
        reinterpret_cast<uint4*>(q_out + ((u64)row * N_QHEADS + unit) * HEAD_DIM)[lane] = y;
    } else {
        const int kh = unit - N_QHEADS;
        reinterpret_cast<uint4*>(c.k + cache_offset(c, slot, kh) + (u64)pos * HEAD_DIM)[lane] = y;
    }
}

// ---------------------------------------------------------------------------------------------
// attn_prefill: causal flash attention for T new tokens (positions start .. start+T-1) of one
// sequence over its cache rows 0 .. start+T-1 (attn_prepare has appended the new keys already).
//
// GQA packing: a block takes 8 consecutive tokens × the 8 query heads of one KV head = 64 rows
// (row r: token t0 + r/8, head 8·kvh + r%8), so each K/V tile it loads serves 8 heads. Four
// warps own 16 rows each: warp w's rows g are token t0 + 2w and rows g + 8 token t0 + 2w + 1
// (head 8·kvh + g for both), which makes the causal mask one comparison per half.
// Keys stream in tiles of 32 through a two-stage cp.async pipeline. Per tile and warp:
//   S = Q·Kᵀ (16 rows × 32 keys; Q and K by ldmatrix), scaled into the log2 domain, masked;
//   online softmax in fp32 (row max/sum over the 4 lanes of a quad);
//   O += P·V, P taken straight from the S accumulators as bf16 A fragments, V by ldmatrix.trans.
// O (16 × 256 fp32 per warp) lives in registers: 128 per thread.
// Blocks run in reverse token order, so the longest (latest) rows start first.
//
// Split over keys: a chunk of few tokens at a long context would be a handful of blocks each
// streaming the whole cache. Then the host launches gridDim.z = nsplit > 1 blocks per 8 tokens,
// block z taking keys [z·chunk, (z+1)·chunk) (chunk a multiple of 32, the same for all blocks),
// and the blocks write unnormalised partials like attn_decode_split (row = token) for
// attn_combine. Token i (position start + i) has visible keys in splits 0 .. (start + i) / chunk.

#define PF_THREADS 128
#define PF_TOKENS 8
#define PF_ROWS 64                              // PF_TOKENS × GROUP
#define PF_TILE 32                              // keys per pipeline stage
#define PF_Q_BYTES (PF_ROWS * ROW_BYTES)        // 33,792
#define PF_STAGE_BYTES (2 * PF_TILE * ROW_BYTES)  // K and V: 33,792
#define PF_SMEM_BYTES (PF_Q_BYTES + 2 * PF_STAGE_BYTES)  // 101,376: two blocks per SM

extern "C" __global__ void __launch_bounds__(PF_THREADS, 2)
    attn_prefill(const bf16* __restrict__ q, const bf16* __restrict__ qkv, const KvCacheArgs c, int slot,
                 int start, int T, bf16* __restrict__ out, float scale_log2, int chunk,
                 float* __restrict__ part_o, float* __restrict__ part_ml) {
    pdl_wait();
    pdl_launch_dependents();
    extern __shared__ __align__(16) unsigned char smem[];
    const int mt = gridDim.x - 1 - blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
    const int t0 = mt * PF_TOKENS;
    const int kv_len = start + min(t0 + PF_TOKENS, T);  // keys any row of this block may see
    const int k0 = split * chunk;                        // this block's keys: k0 .. k1 - 1
    if (k0 >= kv_len) return;
    const int k1 = gridDim.z == 1 ? kv_len : min(k0 + chunk, kv_len);
    const int ntiles = (k1 - k0 + PF_TILE - 1) / PF_TILE;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
    const bf16* kg = c.k + cache_offset(c, slot, kvh);
    const bf16* vg = c.v + cache_offset(c, slot, kvh);
    const u32 sq = smem_u32(smem);

    // Q tile: 64 rows × 32 vectors of 16 bytes; rows of tokens ≥ T are zero.
    for (int i = tid; i < PF_ROWS * 32; i += PF_THREADS) {
        const int r = i >> 5, part = i & 31, tok = t0 + r / GROUP;
        const bool ok = tok < T;
        const bf16* src = q + ((u64)(ok ? tok : 0) * N_QHEADS + kvh * GROUP + r % GROUP) * HEAD_DIM + part * 8;
        cp_async16(sq + r * ROW_BYTES + part * 16, src, ok);
    }
    // K/V tile j (keys k0 + 32j ..) into stage s; keys ≥ k1 are zero rows (and masked below).
    auto load_kv = [&](int j, int s) {
        const u32 sk = sq + PF_Q_BYTES + s * PF_STAGE_BYTES, sv = sk + PF_TILE * ROW_BYTES;
        for (int i = tid; i < PF_TILE * 32; i += PF_THREADS) {
            const int r = i >> 5, part = i & 31, key = k0 + j * PF_TILE + r;
            const bool ok = key < k1;
            const u64 off = (u64)(ok ? key : 0) * HEAD_DIM + part * 8;
            cp_async16(sk + r * ROW_BYTES + part * 16, kg + off, ok);
            cp_async16(sv + r * ROW_BYTES + part * 16, vg + off, ok);
        }
    };
    load_kv(0, 0);
    cp_async_commit();  // group 0: Q and the first tile

    float o[32][4];
#pragma unroll
    for (int n = 0; n < 32; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_lo = NEG_INF, m_hi = NEG_INF, l_lo = 0.0f, l_hi = 0.0f;  // rows g and g + 8
    const int pos_lo = start + t0 + 2 * warp, pos_hi = pos_lo + 1;    // their positions

    // Per-lane ldmatrix addresses (see the fragment notes at the top of the file):
    // Q as A: row 16w + lane%16, dims +8 for lanes ≥ 16.
    const u32 q_addr = sq + (warp * 16 + (lane & 15)) * ROW_BYTES + (lane >> 4) * 16;
    // K as B (two 8-key n-tiles per x4): key (lane%8) + 8·(lane/16), dims +8 for lanes 8-15, 24-31.
    const u32 k_lane = ((lane & 7) + (lane >> 4) * 8) * ROW_BYTES + ((lane >> 3) & 1) * 16;
    // V as B, transposed (two 8-dim n-tiles per x4): key (lane%8) + 8·((lane/8)%2), dims +8 for lanes ≥ 16.
    const u32 v_lane = ((lane & 7) + ((lane >> 3) & 1) * 8) * ROW_BYTES + (lane >> 4) * 16;

    for (int j = 0; j < ntiles; ++j) {
        cp_async_wait<0>();
        __syncthreads();  // tile j is in; every warp is done with tile j - 1, whose stage is reused next
        if (j + 1 < ntiles) load_kv(j + 1, (j + 1) & 1);
        cp_async_commit();
        const u32 sk = sq + PF_Q_BYTES + (j & 1) * PF_STAGE_BYTES, sv = sk + PF_TILE * ROW_BYTES;

        // S = Q Kᵀ: 16 rows × 4 n-tiles of 8 keys, 16 k-steps over the head dims.
        float s[4][4];
#pragma unroll
        for (int n = 0; n < 4; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < 16; ++ks) {
            u32 a0, a1, a2, a3;
            ldsm_x4(q_addr + ks * 32, a0, a1, a2, a3);
#pragma unroll
            for (int np = 0; np < 2; ++np) {
                u32 b0, b1, b2, b3;
                ldsm_x4(sk + k_lane + np * 16 * ROW_BYTES + ks * 32, b0, b1, b2, b3);
                mma_bf16(s[2 * np], a0, a1, a2, a3, b0, b1);
                mma_bf16(s[2 * np + 1], a0, a1, a2, a3, b2, b3);
            }
        }
        // Mask: row g sees keys ≤ pos_lo, row g + 8 keys ≤ pos_hi (keys ≥ k1 are beyond both, for
        // every row of a real token). Only tiles reaching past the warp's first row need it (the
        // same for the whole warp: the block's last tiles); the others skip the compares.
        if (k0 + j * PF_TILE + PF_TILE - 1 > pos_lo) {
#pragma unroll
            for (int n = 0; n < 4; ++n) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = k0 + j * PF_TILE + n * 8 + 2 * t + e;
                    if (key > pos_lo) s[n][e] = NEG_INF;
                    if (key > pos_hi) s[n][2 + e] = NEG_INF;
                }
            }
        }
        online_softmax_tile<4, 32>(&s[0][0], &o[0][0], scale_log2, m_lo, m_hi, l_lo, l_hi);

        // O += P V: the S accumulators of n-tiles 2kk, 2kk+1 are exactly the A fragment of k-step kk.
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
            const u32 a0 = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
            const u32 a1 = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
            const u32 a2 = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            const u32 a3 = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int np = 0; np < 16; ++np) {
                u32 b0, b1, b2, b3;
                ldsm_x4_trans(sv + v_lane + kk * 16 * ROW_BYTES + np * 32, b0, b1, b2, b3);
                mma_bf16(o[2 * np], a0, a1, a2, a3, b0, b1);
                mma_bf16(o[2 * np + 1], a0, a1, a2, a3, b2, b3);
            }
        }
    }

    // Epilogue, for the rows of real tokens: out = O / l · sigmoid(gate), or the partials.
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        l_lo += __shfl_xor_sync(0xffffffffu, l_lo, off);
        l_hi += __shfl_xor_sync(0xffffffffu, l_hi, off);
    }
    const int head = kvh * GROUP + g;
    if (gridDim.z > 1) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int tok = t0 + 2 * warp + half;
            // Rows with no visible key here (position < k0) are never read by attn_combine.
            if (tok >= T) continue;
            const u64 entry = ((u64)tok * N_QHEADS + head) * gridDim.z + split;
            float* po = part_o + entry * HEAD_DIM;
#pragma unroll
            for (int n = 0; n < 32; ++n)
                *reinterpret_cast<float2*>(po + n * 8 + 2 * t) = make_float2(o[n][2 * half], o[n][2 * half + 1]);
            if (t == 0) {
                part_ml[entry * 2] = half ? m_hi : m_lo;
                part_ml[entry * 2 + 1] = half ? l_hi : l_lo;
            }
        }
        return;
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int tok = t0 + 2 * warp + half;
        if (tok >= T) continue;
        const float inv = 1.0f / (half ? l_hi : l_lo);
        const bf16* gate = qkv + (u64)tok * QKV_STRIDE + head * 2 * HEAD_DIM + HEAD_DIM;
        bf16* dst = out + ((u64)tok * N_QHEADS + head) * HEAD_DIM;
#pragma unroll
        for (int n = 0; n < 32; ++n) {
            const int d = n * 8 + 2 * t;
            const float2 gv = __bfloat1622float2(*reinterpret_cast<const bf162*>(gate + d));
            const float y0 = o[n][2 * half] * inv * sigmoid(gv.x);
            const float y1 = o[n][2 * half + 1] * inv * sigmoid(gv.y);
            *reinterpret_cast<bf162*>(dst + d) = __floats2bfloat162_rn(y0, y1);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// attn_decode_split: flash-decoding. Grid (max_splits, 2 KV heads, batch). Block (split, kvh, b)
// makes the 8 query heads of KV head kvh of sequence b from qkv (attn_prepare's norm and RoPE; the
// block of the last chunk also appends the step's key and value to the cache: one launch less
// per layer than a separate attn_prepare), attends them over one chunk of its len = pos + 1
// cached keys and writes unnormalised partial results for attn_combine:
//   part_o [batch][16][max_splits][256]: Σ_k exp2(s_k − m) v_k       (fp32)
//   part_ml[batch][16][max_splits][2]:   m (running max, log2 domain) and l = Σ_k exp2(s_k − m)
//
// Split rule (split_chunk; the host sizes the grid, attention.rs `decode_splits`): the chunk is
// ceil(len / max_splits), at least min_chunk, rounded up to whole tiles of 64 keys, and nsplit =
// ceil(len / chunk) ≤ max_splits; blocks with split ≥ nsplit exit at once. Because len is read on the device, the
// same launch (a captured graph) serves every length.
//
// GQA packing with the 8 heads on the mma's N = 8 side (no padding): per tile of 64 keys, warp w
// takes keys 16w .. 16w+15 and computes
//   Sᵀ = K·Qᵀ   (M = 16 keys, N = 8 heads, K = 256 dims; K by ldmatrix, Qᵀ kept in registers)
//   online softmax per head (a head's keys are spread over the 8 lanes sharing t)
//   Oᵀ += Vᵀ·Pᵀ (M = 256 dims in 16 m-tiles, N = 8 heads, K = 16 keys; V by ldmatrix.trans;
//                Pᵀ from the Sᵀ accumulators by movmatrix, which transposes an 8×8 bf16 block)
// Each warp keeps its own (m, l, Oᵀ) over its keys; the 4 warps are merged at the end through
// shared memory. Lane (g, t) always holds heads 2t and 2t+1, in S and in O alike.
// Keys stream through a three-stage cp.async pipeline: every key is read once per KV head.

#define DEC_WARPS 4
#define DEC_THREADS (32 * DEC_WARPS)
#define DEC_TILE 64                                   // keys per stage, 16 per warp
#define DEC_STAGES 3
#define DEC_STAGE_BYTES (2 * DEC_TILE * ROW_BYTES)    // K and V: 67,584
#define DEC_SMEM_BYTES (DEC_STAGES * DEC_STAGE_BYTES)  // 202,752
#define DEC_MAX_SPLITS 256                            // = COMBINE_THREADS
#define DEC_OSTRIDE 260  // floats per head row of the merge buffer: 4 heads 2t apart hit distinct banks

__device__ __forceinline__ int split_chunk(int len, int max_splits, int min_chunk) {
    const int per = max((len + max_splits - 1) / max_splits, min_chunk);
    return (per + DEC_TILE - 1) / DEC_TILE * DEC_TILE;
}

extern "C" __global__ void __launch_bounds__(DEC_THREADS, 1)
    attn_decode_split(const bf16* __restrict__ qkv, const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                      const __grid_constant__ RopeFreqs rope, float eps, bf16* __restrict__ q_out, const KvCacheArgs c,
                      const int* __restrict__ slots, const int* __restrict__ positions, float* __restrict__ part_o,
                      float* __restrict__ part_ml, int max_splits, float scale_log2, int min_chunk, int early,
                      int one_seq) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ float s_m[DEC_WARPS][GROUP], s_l[DEC_WARPS][GROUP];
    __shared__ __align__(16) bf16 q_s[GROUP * HEAD_DIM];  // the block's 8 query heads, normed and rotated
    const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    // Slots and positions come from host copies before the pass, which no kernel overlaps.
    const int slot = slots[b], pos = positions[b];
    if (!in_cache(c, slot, pos)) return;  // attn_combine writes NaN for this sequence
    // The pass's first new key: this row's own, or (one_seq: the rows are consecutive tokens of
    // one sequence, a verify pass) row 0's, whose keys this row sees too.
    const int first = one_seq ? max(pos - b, 0) : pos;  // max: a bad caller reads no row < 0
    const int len = pos + 1, chunk = split_chunk(len, max_splits, min_chunk);
    const int k0 = split * chunk;
    if (k0 >= len) return;
    const int k1 = min(k0 + chunk, len);
    const int ntiles = (k1 - k0 + DEC_TILE - 1) / DEC_TILE;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
    bf16* const kg = c.k + cache_offset(c, slot, kvh);
    bf16* const vg = c.v + cache_offset(c, slot, kvh);
    const u32 s0 = smem_u32(smem);
    prefetch_l1(q_norm + 8 * lane);
    if (warp == 0) prefetch_l1(k_norm + 8 * lane);

    // K/V tile j (keys k0 + 64j ..) into stage s; keys ≥ k1 are zero rows (and masked below).
    auto load_kv = [&](int j, int s) {
        const u32 sk = s0 + s * DEC_STAGE_BYTES, sv = sk + DEC_TILE * ROW_BYTES;
        for (int i = tid; i < DEC_TILE * 32; i += DEC_THREADS) {
            const int r = i >> 5, part = i & 31, key = k0 + j * DEC_TILE + r;
            const bool ok = key < k1;
            const u64 off = (u64)(ok ? key : 0) * HEAD_DIM + part * 8;
            cp_async16(sk + r * ROW_BYTES + part * 16, kg + off, ok);
            cp_async16(sv + r * ROW_BYTES + part * 16, vg + off, ok);
        }
    };
    // With `early`, the first stages whose keys are all older than the pass's go out before the
    // wait: those rows were written by earlier passes, and no kernel of this pass writes any of
    // them (the pass's own keys are written by this kernel, below). The rest go out after the
    // wait and the append.
    auto older_than_pos = [&](int j) { return min(k0 + (j + 1) * DEC_TILE, k1) <= first; };
    int issued = 0;
    for (; early && issued < DEC_STAGES - 1 && issued < ntiles && older_than_pos(issued); ++issued) {
        load_kv(issued, issued);
        cp_async_commit();
    }
    pdl_wait();
    pdl_launch_dependents();
    // What attn_prepare does for a prefill, for this block's share: its 8 query heads (warp w:
    // heads 2w, 2w + 1 of the group), and the append of the pass's keys and values in its chunk
    // (the step's own, in the block whose chunk ends with it; one_seq, also the earlier rows'
    // that fall in the chunk: every block reading such a key writes it, the same bytes, so that
    // no block waits for another).
    const bf16* src = qkv + (u64)b * QKV_STRIDE;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int hg = 2 * warp + i;
        reinterpret_cast<uint4*>(q_s + hg * HEAD_DIM)[lane] =
            norm_rope_lane(src + (kvh * GROUP + hg) * 2 * HEAD_DIM, q_norm, pos, lane, rope, eps);
    }
    const int new_lo = max(k0, first), n_new = max(k1 - new_lo, 0);
    for (int u = warp; u < 2 * n_new; u += DEC_WARPS) {  // even u: a key, odd: its value
        const int key = new_lo + u / 2;
        const bf16* row = qkv + (u64)(b - (pos - key)) * QKV_STRIDE;  // key's row of the pass
        if (u % 2 == 0)
            reinterpret_cast<uint4*>(kg + (u64)key * HEAD_DIM)[lane] =
                norm_rope_lane(row + K_OFFSET + kvh * HEAD_DIM, k_norm, key, lane, rope, eps);
        else
            reinterpret_cast<uint4*>(vg + (u64)key * HEAD_DIM)[lane] =
                reinterpret_cast<const uint4*>(row + V_OFFSET + kvh * HEAD_DIM)[lane];
    }
    if (n_new > 0) __threadfence_block();
    __syncthreads();  // q_s complete; the appended row visible to the block's copies below
    if (split == 0)  // the queries, as attn_prepare writes them (q_out [batch][16][256], for tests)
        for (int i = tid; i < GROUP * HEAD_DIM / 8; i += DEC_THREADS)
            reinterpret_cast<uint4*>(q_out + ((u64)b * N_QHEADS + kvh * GROUP) * HEAD_DIM)[i] =
                reinterpret_cast<const uint4*>(q_s)[i];
    for (int s = issued; s < DEC_STAGES - 1; ++s) {
        if (s < ntiles) load_kv(s, s);
        cp_async_commit();  // empty groups too, so that the wait count below stays uniform
    }

    // Qᵀ as the B operand, all 16 k-steps: b0 = Q[head g][16ks + 2t ..], b1 = Q[g][16ks + 8 + 2t ..].
    const bf16* qb = q_s + g * HEAD_DIM + 2 * t;
    u32 qf[16][2];
#pragma unroll
    for (int ks = 0; ks < 16; ++ks) {
        qf[ks][0] = *reinterpret_cast<const u32*>(qb + ks * 16);
        qf[ks][1] = *reinterpret_cast<const u32*>(qb + ks * 16 + 8);
    }

    // Oᵀ: m-tile i holds dims 16i + g (regs 0, 1) and 16i + g + 8 (regs 2, 3), heads 2t, 2t + 1.
    float o[16][4];
#pragma unroll
    for (int i = 0; i < 16; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;  // heads 2t, 2t + 1

    // K as A: key 16w + lane%16, dims +8 for lanes ≥ 16.
    const u32 k_lane = (warp * 16 + (lane & 15)) * ROW_BYTES + (lane >> 4) * 16;
    // Vᵀ as A, transposed load: key 16w + lane%8 + 8·(lane/16), dims +8 for lanes 8-15, 24-31.
    const u32 v_lane = (warp * 16 + (lane & 7) + (lane >> 4) * 8) * ROW_BYTES + ((lane >> 3) & 1) * 16;

    for (int j = 0; j < ntiles; ++j) {
        cp_async_wait<DEC_STAGES - 2>();
        __syncthreads();  // tile j is in; every warp is done with tile j - 1, whose stage is refilled now
        if (j + DEC_STAGES - 1 < ntiles) load_kv(j + DEC_STAGES - 1, (j + DEC_STAGES - 1) % DEC_STAGES);
        cp_async_commit();
        const u32 sk = s0 + (j % DEC_STAGES) * DEC_STAGE_BYTES, sv = sk + DEC_TILE * ROW_BYTES;

        // Sᵀ[key][head] for this warp's 16 keys: s[0], s[1] key 16w + g, s[2], s[3] key 16w + g + 8.
        // Even and odd k-steps accumulate separately: two dependency chains of 8 mma, not one of 16.
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s_odd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int ks = 0; ks < 16; ks += 2) {
            u32 a0, a1, a2, a3;
            ldsm_x4(sk + k_lane + ks * 32, a0, a1, a2, a3);
            mma_bf16(s, a0, a1, a2, a3, qf[ks][0], qf[ks][1]);
            ldsm_x4(sk + k_lane + (ks + 1) * 32, a0, a1, a2, a3);
            mma_bf16(s_odd, a0, a1, a2, a3, qf[ks + 1][0], qf[ks + 1][1]);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) s[e] += s_odd[e];
        const int key_a = k0 + j * DEC_TILE + warp * 16 + g, key_b = key_a + 8;
        s[0] = key_a < k1 ? s[0] * scale_log2 : NEG_INF;
        s[1] = key_a < k1 ? s[1] * scale_log2 : NEG_INF;
        s[2] = key_b < k1 ? s[2] * scale_log2 : NEG_INF;
        s[3] = key_b < k1 ? s[3] * scale_log2 : NEG_INF;

        // Online softmax per head over this warp's keys: reduce over the 8 lanes with the same t.
        float mx0 = fmaxf(s[0], s[2]), mx1 = fmaxf(s[1], s[3]);
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
        }
        const float new0 = fmaxf(m0, mx0), new1 = fmaxf(m1, mx1);
        // No visible key yet (max −inf): subtract 0 instead, which keeps exp2 at 0 rather than NaN.
        const float ref0 = new0 == NEG_INF ? 0.0f : new0, ref1 = new1 == NEG_INF ? 0.0f : new1;
        const float alpha0 = exp2f(m0 - ref0), alpha1 = exp2f(m1 - ref1);
        m0 = new0;
        m1 = new1;
        s[0] = exp2f(s[0] - ref0);
        s[1] = exp2f(s[1] - ref1);
        s[2] = exp2f(s[2] - ref0);
        s[3] = exp2f(s[3] - ref1);
        l0 = l0 * alpha0 + s[0] + s[2];  // this lane's share; summed over the lanes at the end
        l1 = l1 * alpha1 + s[1] + s[3];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            o[i][0] *= alpha0;
            o[i][1] *= alpha1;
            o[i][2] *= alpha0;
            o[i][3] *= alpha1;
        }

        // Pᵀ as the B operand: lane holds P[key g][heads 2t, 2t+1] (and key g + 8), the row-pair
        // layout of an 8×8 block; transposed it is P[head g][keys 2t, 2t+1] = b0 (b1: keys + 8).
        const u32 pb0 = movmatrix_trans(pack_bf16(s[0], s[1]));
        const u32 pb1 = movmatrix_trans(pack_bf16(s[2], s[3]));
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            u32 a0, a1, a2, a3;
            ldsm_x4_trans(sv + v_lane + i * 32, a0, a1, a2, a3);
            mma_bf16(o[i], a0, a1, a2, a3, pb0, pb1);
        }
    }

    // Merge the 4 warps. A warp's l is spread over its 8 lanes per t.
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, off);
        l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    }
    cp_async_wait<0>();
    __syncthreads();  // the stages are free for the merge buffer
    if (g == 0) {
        s_m[warp][2 * t] = m0;
        s_m[warp][2 * t + 1] = m1;
        s_l[warp][2 * t] = l0;
        s_l[warp][2 * t + 1] = l1;
    }
    __syncthreads();
    float mm0 = NEG_INF, mm1 = NEG_INF;
#pragma unroll
    for (int w = 0; w < DEC_WARPS; ++w) {
        mm0 = fmaxf(mm0, s_m[w][2 * t]);
        mm1 = fmaxf(mm1, s_m[w][2 * t + 1]);
    }
    // Key k0 is always visible to warp 0, so the block max is finite; a warp that saw no key has
    // m = −inf and weight 0.
    const float f0 = exp2f(m0 - mm0), f1 = exp2f(m1 - mm1);
    float* so = reinterpret_cast<float*>(smem);  // [DEC_WARPS][GROUP][DEC_OSTRIDE]
    float* so0 = so + (warp * GROUP + 2 * t) * DEC_OSTRIDE;
    float* so1 = so0 + DEC_OSTRIDE;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        so0[16 * i + g] = o[i][0] * f0;
        so1[16 * i + g] = o[i][1] * f1;
        so0[16 * i + g + 8] = o[i][2] * f0;
        so1[16 * i + g + 8] = o[i][3] * f1;
    }
    __syncthreads();
    const u64 row0 = (u64)b * N_QHEADS + kvh * GROUP;  // (sequence, first head of the group)
    for (int idx = tid; idx < GROUP * HEAD_DIM; idx += DEC_THREADS) {
        const int h = idx / HEAD_DIM, d = idx % HEAD_DIM;
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; ++w) sum += so[(w * GROUP + h) * DEC_OSTRIDE + d];
        part_o[((row0 + h) * max_splits + split) * HEAD_DIM + d] = sum;
    }
    if (tid < GROUP) {
        float mm = NEG_INF, ll = 0.0f;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; ++w) mm = fmaxf(mm, s_m[w][tid]);
#pragma unroll
        for (int w = 0; w < DEC_WARPS; ++w) ll += exp2f(s_m[w][tid] - mm) * s_l[w][tid];
        float* ml = part_ml + ((row0 + tid) * max_splits + split) * 2;
        ml[0] = mm;
        ml[1] = ll;
    }
}

// ---------------------------------------------------------------------------------------------
// attn_combine: grid (16 heads, 4 quarters of the head's dims, rows), 256 threads. Merges the
// partial results of one (row, head) over the key chunks that hold keys it sees: with M = max m_s and w_s = exp2(m_s − M),
//   o = Σ w_s part_o_s / Σ w_s l_s,   out[row][256·h + d] = bf16(o[d] · sigmoid(gate[row][h][d])).
// Decode (positions given): row b is a sequence at positions[b], chunks as split_chunk picks them
// (with `chunk` passed as attn_decode_split's min_chunk).
// Prefill (positions null): row i is token i at position start + i, chunks of `chunk` keys.
// Either way the row's position pos sees chunks 0 .. pos / chunk.
// Thread s first holds split s's (m, l) for the block-wide max and sum; then 16 groups of 16
// threads, one float4 of the block's 64 dims each, sum every 16th split, and group 0 adds the 16
// up. Every load is issued right after the wait (the partial outputs of a thread's first 4 splits
// do not depend on the weights): one L2 round trip, where a block per head and 16 splits per
// thread took four in turn (bench/NOTES.md v1.51).

#define COMBINE_THREADS 256
#define COMBINE_DIMS 64                             // dims per block
#define COMBINE_GROUPS (COMBINE_THREADS * 4 / COMBINE_DIMS)  // split groups: 16
#define COMBINE_AHEAD 4                             // splits per thread loaded before the weights

__device__ __forceinline__ float block_max(float v, float* scratch) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    __syncthreads();
    float r = scratch[0];
#pragma unroll
    for (int w = 1; w < COMBINE_THREADS / 32; ++w) r = fmaxf(r, scratch[w]);
    __syncthreads();  // scratch may be reused right after
    return r;
}

__device__ __forceinline__ float block_sum(float v, float* scratch) {
    v = warp_sum(v);
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    __syncthreads();
    float r = 0.0f;
#pragma unroll
    for (int w = 0; w < COMBINE_THREADS / 32; ++w) r += scratch[w];
    __syncthreads();
    return r;
}

extern "C" __global__ void __launch_bounds__(COMBINE_THREADS)
    attn_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml, const bf16* __restrict__ qkv,
                 const KvCacheArgs c, const int* __restrict__ slots, const int* __restrict__ positions,
                 bf16* __restrict__ out, int max_splits, int start, int chunk) {
    pdl_wait();
    pdl_launch_dependents();
    __shared__ float s_w[DEC_MAX_SPLITS];
    __shared__ float4 s_acc[COMBINE_GROUPS][COMBINE_DIMS / 4];
    __shared__ float scratch[COMBINE_THREADS / 32];
    const int h = blockIdx.x, quarter = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
    const int grp = tid / (COMBINE_DIMS / 4), d4 = tid % (COMBINE_DIMS / 4);  // split group, float4 of dims
    const int dim0 = quarter * COMBINE_DIMS;
    bf16* dst = out + (u64)b * N_QHEADS * HEAD_DIM + h * HEAD_DIM + dim0;
    int pos = start + b;
    if (positions) {
        pos = positions[b];
        if (!in_cache(c, slots[b], pos)) {
            if (tid < COMBINE_DIMS) dst[tid] = __float2bfloat16_rn(__int_as_float(0x7fc00000));  // NaN: see in_cache
            return;
        }
        chunk = split_chunk(pos + 1, max_splits, chunk);  // decode: `chunk` is the split's min_chunk
    }
    const int nsplit = pos / chunk + 1;
    const u64 row = (u64)b * N_QHEADS + h;

    // Every load up front: (m, l) of split tid, the first COMBINE_AHEAD partial outputs of this
    // thread's splits grp, grp + 16, ... (they do not depend on the weights), the output gate.
    float m = NEG_INF, l = 0.0f;
    if (tid < nsplit) {
        m = part_ml[(row * max_splits + tid) * 2];
        l = part_ml[(row * max_splits + tid) * 2 + 1];
    }
    const float4* po = reinterpret_cast<const float4*>(part_o + row * max_splits * HEAD_DIM + dim0) + d4;
    float4 ahead[COMBINE_AHEAD];
#pragma unroll
    for (int i = 0; i < COMBINE_AHEAD; ++i) {
        const int s = grp + i * COMBINE_GROUPS;
        ahead[i] = s < nsplit ? po[(u64)s * (HEAD_DIM / 4)] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    float2 g01 = make_float2(0.0f, 0.0f), g23 = g01;
    if (tid < COMBINE_DIMS / 4) {
        const bf16* gate = qkv + (u64)b * QKV_STRIDE + h * 2 * HEAD_DIM + HEAD_DIM + dim0 + 4 * d4;
        g01 = __bfloat1622float2(*reinterpret_cast<const bf162*>(gate));
        g23 = __bfloat1622float2(*reinterpret_cast<const bf162*>(gate + 2));
    }

    const float mm = block_max(m, scratch);  // finite: every split saw at least one key
    const float w = tid < nsplit ? exp2f(m - mm) : 0.0f;
    s_w[tid] = w;
    const float ll = block_sum(w * l, scratch);  // its barriers also publish s_w

    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    auto add = [&](int s, float4 v) {
        const float ws = s_w[s];
        acc.x += ws * v.x;
        acc.y += ws * v.y;
        acc.z += ws * v.z;
        acc.w += ws * v.w;
    };
#pragma unroll
    for (int i = 0; i < COMBINE_AHEAD; ++i)
        if (grp + i * COMBINE_GROUPS < nsplit) add(grp + i * COMBINE_GROUPS, ahead[i]);
#pragma unroll 4
    for (int s = grp + COMBINE_AHEAD * COMBINE_GROUPS; s < nsplit; s += COMBINE_GROUPS) add(s, po[(u64)s * (HEAD_DIM / 4)]);
    s_acc[grp][d4] = acc;
    __syncthreads();
    if (tid < COMBINE_DIMS / 4) {
        float4 a = s_acc[0][d4];
#pragma unroll
        for (int j = 1; j < COMBINE_GROUPS; ++j) {
            const float4 v = s_acc[j][d4];
            a.x += v.x, a.y += v.y, a.z += v.z, a.w += v.w;
        }
        const float inv = 1.0f / ll;
        const float y0 = a.x * inv * sigmoid(g01.x);
        const float y1 = a.y * inv * sigmoid(g01.y);
        const float y2 = a.z * inv * sigmoid(g23.x);
        const float y3 = a.w * inv * sigmoid(g23.y);
        bf162* d = reinterpret_cast<bf162*>(dst + 4 * d4);
        d[0] = __floats2bfloat162_rn(y0, y1);
        d[1] = __floats2bfloat162_rn(y2, y3);
    }
}

// ---------------------------------------------------------------------------------------------
// attn_combine_few: attn_combine for prefill chunks split in at most FEW_SPLITS key chunks (the
// wgmma prefill's splits, attention_wgmma.cu). attn_combine spreads one (row, head) over four
// 256-thread blocks, 16 split groups each: with 3 splits most of its threads idle and a 2,330-token
// chunk makes 149K blocks that are mostly latency (≈ 0.25 ms a layer, bench/NOTES.md v1.83). Here a
// warp takes one (row, head), each lane 8 of its 256 dims, every load issued at once: block
// (8 warps) i takes entries 8i .. 8i + 7 of row·16 + head. Row i is token i at position start + i
// and sees chunks 0 .. pos / chunk; the merge is attn_combine's.
#define FEW_SPLITS 4

extern "C" __global__ void __launch_bounds__(256)
    attn_combine_few(const float* __restrict__ part_o, const float* __restrict__ part_ml, const bf16* __restrict__ qkv,
                     bf16* __restrict__ out, int rows, int splits, int start, int chunk) {
    pdl_wait();
    pdl_launch_dependents();
    const int lane = threadIdx.x % 32;
    const int entry = blockIdx.x * 8 + threadIdx.x / 32;  // row · 16 + head
    if (entry >= rows * N_QHEADS) return;
    const int b = entry / N_QHEADS, h = entry % N_QHEADS;
    const int nsplit = min((start + b) / chunk + 1, splits);
    float m[FEW_SPLITS], l[FEW_SPLITS];
    float4 v[FEW_SPLITS][2];
#pragma unroll
    for (int s = 0; s < FEW_SPLITS; ++s) {
        m[s] = NEG_INF, l[s] = 0.0f;
        v[s][0] = v[s][1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (s < nsplit) {
            const u64 e = (u64)entry * splits + s;
            m[s] = part_ml[e * 2];
            l[s] = part_ml[e * 2 + 1];
            const float4* po = reinterpret_cast<const float4*>(part_o + e * HEAD_DIM) + 2 * lane;
            v[s][0] = po[0];
            v[s][1] = po[1];
        }
    }
    const uint4 gate = *reinterpret_cast<const uint4*>(qkv + (u64)b * QKV_STRIDE + h * 2 * HEAD_DIM + HEAD_DIM + 8 * lane);
    float mm = m[0];  // finite: every split a row reads saw at least one key
#pragma unroll
    for (int s = 1; s < FEW_SPLITS; ++s) mm = fmaxf(mm, m[s]);
    float ll = 0.0f, acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int s = 0; s < FEW_SPLITS; ++s) {
        if (s >= nsplit) break;
        const float w = exp2f(m[s] - mm);
        ll += w * l[s];
        const float f[8] = {v[s][0].x, v[s][0].y, v[s][0].z, v[s][0].w, v[s][1].x, v[s][1].y, v[s][1].z, v[s][1].w};
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += w * f[i];
    }
    float g[8];
    unpack8(gate, g);
    const float inv = 1.0f / ll;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = acc[i] * inv * sigmoid(g[i]);
    *reinterpret_cast<uint4*>(out + (u64)entry * HEAD_DIM + 8 * lane) = pack8(acc);
}
