// attn_prefill_wgmma: attn_prefill (attention.cu) on Hopper's warpgroup products (wgmma.cuh), for long
// prefill chunks: causal flash attention of T new tokens of one sequence over its cache rows
// 0 .. start+T-1, output gate fused (attention.rs picks the kernel).
//
// Block: two warpgroups on 16 consecutive tokens × the 8 query heads of one KV head. Warpgroup w
// takes tokens t0 + 8w .. t0 + 8w + 7 as its 64 rows (row r: token t0 + 8w + r/8, head 8·kvh + r%8),
// so warp v's rows g and g + 8 are tokens 2v and 2v + 1 of the warpgroup, as in attn_prefill, and
// the causal mask is one comparison per half. Keys stream in tiles of 64 through two stages of
// cp.async copies that both warpgroups read. Per tile, each warpgroup:
//   S = Q·Kᵀ (64 rows × 64 keys): 16 wgmma m64n64k16, Q and K from shared memory (K-major);
//   mask; online softmax on the S accumulators in the log2 domain, as attn_prefill;
//   O += P·V (64 rows × 256 dims): 4 wgmma m64n256k16, P from registers (the accumulator layout
//   of S is the A-fragment layout of keys 16kk..16kk+15 in n-tiles 2kk, 2kk+1), V from shared
//   memory read MN-major (the transpose bit), O in 128 accumulators per thread.
// Tiles past a warpgroup's last position (the other warpgroup's last 8 keys) are skipped.
//
// Split over keys, as attn_prefill: when the blocks of a chunk would leave the last wave of the
// GPU mostly idle (a turn's few thousand tokens after a long cached prefix: every block streams
// about the same keys, so 292 blocks on 132 SMs are 2.2 waves run as 3), the host launches
// gridDim.z = nsplit > 1 blocks per 16 tokens, block z taking keys [z·chunk, (z+1)·chunk) (chunk a
// multiple of 64), and the blocks write unnormalised partials for attn_combine (row = token).
//
// Each warpgroup reads its Q once into registers (64 per thread) as the A operand of every S product
// (255 registers in all, no spills): with both operands in shared memory (4 KB per m64n64k16
// product) S's reads, V's and the copies came to about the shared memory's whole bandwidth
// (bench/NOTES.md v1.36); Q in registers halves S's reads, 1.6 % faster at 32K (v1.38).
//
// Shared memory: Q (both warpgroups) and two stages of K and V, each a [64 rows][256 dims] matrix
// stored as four 64-dim sub-tiles of 64 rows × 128 bytes, swizzled (wgmma.cuh). K-major (Q, K):
// k-step ks (dims 16ks..) starts at sub-tile ks/4, byte 32·(ks%4). MN-major (V): k-step kk (keys
// 16kk..) starts at row 16kk of sub-tile 0; the next 64 dims are one sub-tile on (leading offset),
// the next 8 keys 1024 bytes on (stride offset).
#include "attention.cuh"
#include "wgmma.cuh"

#define WG_TOKENS 16                       // tokens per block: 8 per warpgroup
#define WG_THREADS 256
#define WG_TILE 64                         // keys per stage
#define WG_SUB_BYTES (64 * 128)            // a 64-dim sub-tile of 64 rows
#define WG_MAT_BYTES (4 * WG_SUB_BYTES)    // 64 rows × 256 dims: 32,768
#define WG_STAGE_BYTES (2 * WG_MAT_BYTES)  // K and V
// Must match PF_WGMMA_SMEM_BYTES in attention.rs: Q of both warpgroups, two stages, and slack to
// align the start to 1024 bytes (the swizzle pattern repeats every 1024).
#define WG_SMEM_BYTES (2 * WG_MAT_BYTES + 2 * WG_STAGE_BYTES + 1024)  // 197,632

// Byte offset of 16-byte chunk `part` (dims 8·part ..) of row r in a [64][256] matrix.
__device__ __forceinline__ u32 swizzled(int r, int part) {
    return (part >> 3) * WG_SUB_BYTES + r * 128 + (((part & 7) ^ (r & 7)) << 4);
}

__device__ __forceinline__ void prefill_wgmma(const bf16* __restrict__ q, const bf16* __restrict__ qkv,
                                              const KvCacheArgs& c, int slot, int start, int T,
                                              bf16* __restrict__ out, float scale_log2, int chunk,
                                              float* __restrict__ part_o, float* __restrict__ part_ml) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 base = (smem_u32(smem_raw) + 1023) & ~1023u;
    const int mt = gridDim.x - 1 - blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;  // the longest rows first
    const int t0 = mt * WG_TOKENS;
    const int kv_len = start + min(t0 + WG_TOKENS, T);  // keys any row of the block may see
    const int k0 = split * chunk;                        // this block's keys: k0 .. k1 - 1
    if (k0 >= kv_len) return;
    const int k1 = gridDim.z == 1 ? kv_len : min(k0 + chunk, kv_len);
    const int ntiles = (k1 - k0 + WG_TILE - 1) / WG_TILE;
    const int tid = threadIdx.x, wg = tid / 128, warp = (tid / 32) % 4, lane = tid % 32, g = lane >> 2, t = lane & 3;
    const bf16* kg = c.k + cache_offset(c, slot, kvh);
    const bf16* vg = c.v + cache_offset(c, slot, kvh);
    const u32 sq = base + wg * WG_MAT_BYTES;  // this warpgroup's Q
    auto stage = [&](int s) { return base + 2 * WG_MAT_BYTES + s * WG_STAGE_BYTES; };  // K, then V

    // Q of both warpgroups: 128 rows × 32 chunks; rows of tokens ≥ T are zero.
    for (int i = tid; i < 128 * 32; i += WG_THREADS) {
        const int row = i >> 5, part = i & 31, w = row >> 6, r = row & 63;
        const int tok = t0 + 8 * w + r / GROUP;
        const bool ok = tok < T;
        const bf16* src = q + ((u64)(ok ? tok : 0) * N_QHEADS + kvh * GROUP + r % GROUP) * HEAD_DIM + part * 8;
        cp_async16(base + w * WG_MAT_BYTES + swizzled(r, part), src, ok);
    }
    // K/V tile j (keys k0 + 64j ..) into stage s; keys ≥ k1 are zero rows (and masked below).
    auto load_kv = [&](int j, int s) {
        const u32 sk = stage(s), sv = sk + WG_MAT_BYTES;
#pragma unroll
        for (int u = 0; u < WG_TILE * 32 / WG_THREADS; ++u) {
            const int i = tid + u * WG_THREADS;
            const int r = i >> 5, part = i & 31, key = k0 + j * WG_TILE + r;
            const bool ok = key < k1;
            const u64 off = (u64)(ok ? key : 0) * HEAD_DIM + part * 8;
            cp_async16(sk + swizzled(r, part), kg + off, ok);
            cp_async16(sv + swizzled(r, part), vg + off, ok);
        }
    };
    load_kv(0, 0);
    cp_async_commit();  // group 0: Q and the first tile

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.0f;
    float m_lo = NEG_INF, m_hi = NEG_INF, l_lo = 0.0f, l_hi = 0.0f;  // rows g and g + 8
    const int pos_lo = start + t0 + 8 * wg + 2 * warp, pos_hi = pos_lo + 1;
    // The warpgroup's last real position; a warpgroup past the chunk's end computes nothing.
    const bool active = t0 + 8 * wg < T;
    const int last = start + min(t0 + 8 * wg + 7, T - 1);

    // This warpgroup's Q as the A operand of S's products, read once from shared memory (ldmatrix:
    // lanes 0-15 address rows 16·warp + lane at dims 16ks.., lanes 16-31 the same rows at dims
    // 16ks + 8..): four registers per k-step, the mma.m16n8k16 A fragment.
    u32 qa[64];
    {
        cp_async_wait<0>();
        __syncthreads();  // Q is in (and tile 0)
        const int row = 16 * warp + (lane & 15);
#pragma unroll
        for (int ks = 0; ks < 16; ++ks)
            ldsm_x4(sq + swizzled(row, 2 * ks + (lane >> 4)), qa[4 * ks], qa[4 * ks + 1], qa[4 * ks + 2], qa[4 * ks + 3]);
    }

    for (int j = 0; j < ntiles; ++j) {
        cp_async_wait<0>();
        fence_async_shared();
        __syncthreads();  // tile j is in for everyone; both warpgroups are done with tile j - 1
        const bool work = active && k0 + j * WG_TILE <= last;  // the same for the whole warpgroup
        const u32 sk = stage(j & 1), sv = sk + WG_MAT_BYTES;

        // S = Q·Kᵀ: s[4i + e] = S[row 16·warp + g + 8(e/2)][key 8i + 2t + e%2].
        float s[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) s[i] = 0.0f;
        if (work) {
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < 16; ++ks) {
                const u32 off = (ks >> 2) * WG_SUB_BYTES + (ks & 3) * 32;
                wgmma_k16<64>(s, &qa[4 * ks], smem_desc(sk + off));
            }
            wgmma_commit();
        }
        // The next tile's copies are issued while S's products run (they were on the critical
        // path before them: ≈ 10 % of the stall samples, bench/NOTES.md v1.49); they refill the
        // stage of tile j − 1, which both warpgroups are past (the barrier above).
        if (j + 1 < ntiles) load_kv(j + 1, (j + 1) & 1);
        cp_async_commit();
        if (!work) continue;
        wgmma_wait<0>();
        fence_accumulators<64>(s);

        // Mask: row g sees keys ≤ pos_lo, row g + 8 keys ≤ pos_hi (keys ≥ k1 are beyond both for
        // every row of a real token). Only the tiles reaching past the warp's first row.
        if (k0 + j * WG_TILE + WG_TILE - 1 > pos_lo) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = k0 + j * WG_TILE + 8 * i + 2 * t + e;
                    if (key > pos_lo) s[4 * i + e] = NEG_INF;
                    if (key > pos_hi) s[4 * i + 2 + e] = NEG_INF;
                }
            }
        }
        online_softmax_tile<8, 32>(s, o, scale_log2, m_lo, m_hi, l_lo, l_hi);

        // O += P·V: P's A fragment for keys 16kk.. is n-tiles 2kk and 2kk + 1 of S.
        u32 p[16];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            p[4 * kk + 0] = pack_bf16(s[8 * kk + 0], s[8 * kk + 1]);
            p[4 * kk + 1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
            p[4 * kk + 2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
            p[4 * kk + 3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
        }
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            wgmma_k16_n256_mn(o, &p[4 * kk], wgmma_desc(sv + kk * 2048, WG_SUB_BYTES, 1024));
        wgmma_commit();
        wgmma_wait<0>();  // before the barrier that lets tile j + 2 overwrite this stage
        fence_accumulators<256>(o);
    }

    // Epilogue, for the rows of real tokens: out = O / l · sigmoid(gate), or the partials.
    // o[4i + 2·half + e] = O[row g + 8·half][dim 8i + 2t + e].
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        l_lo += __shfl_xor_sync(0xffffffffu, l_lo, off);
        l_hi += __shfl_xor_sync(0xffffffffu, l_hi, off);
    }
    const int head = kvh * GROUP + g;
    if (gridDim.z > 1) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int tok = t0 + 8 * wg + 2 * warp + half;
            // Rows with no visible key here (position < k0) are never read by attn_combine.
            if (tok >= T) continue;
            const u64 entry = ((u64)tok * N_QHEADS + head) * gridDim.z + split;
            float* po = part_o + entry * HEAD_DIM;
#pragma unroll
            for (int i = 0; i < 32; ++i)
                *reinterpret_cast<float2*>(po + i * 8 + 2 * t) = make_float2(o[4 * i + 2 * half], o[4 * i + 2 * half + 1]);
            if (t == 0) {
                part_ml[entry * 2] = half ? m_hi : m_lo;
                part_ml[entry * 2 + 1] = half ? l_hi : l_lo;
            }
        }
        return;
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int tok = t0 + 8 * wg + 2 * warp + half;
        if (tok >= T) continue;
        const float inv = 1.0f / (half ? l_hi : l_lo);
        const bf16* gate = qkv + (u64)tok * QKV_STRIDE + head * 2 * HEAD_DIM + HEAD_DIM;
        bf16* dst = out + ((u64)tok * N_QHEADS + head) * HEAD_DIM;
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const int d = i * 8 + 2 * t;
            const float2 gv = __bfloat1622float2(*reinterpret_cast<const bf162*>(gate + d));
            const float y0 = o[4 * i + 2 * half] * inv * sigmoid(gv.x);
            const float y1 = o[4 * i + 2 * half + 1] * inv * sigmoid(gv.y);
            *reinterpret_cast<bf162*>(dst + d) = __floats2bfloat162_rn(y0, y1);
        }
    }
}

extern "C" __global__ void __launch_bounds__(WG_THREADS, 1)
    attn_prefill_wgmma(const bf16* __restrict__ q, const bf16* __restrict__ qkv, const KvCacheArgs c, int slot,
                       int start, int T, bf16* __restrict__ out, float scale_log2, int chunk,
                       float* __restrict__ part_o, float* __restrict__ part_ml) {
    pdl_wait();
    pdl_launch_dependents();
    prefill_wgmma(q, qkv, c, slot, start, T, out, scale_log2, chunk, part_o, part_ml);
}
