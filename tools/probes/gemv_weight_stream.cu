// What DRAM gives the decode GEMVs' weight stream, by layout (bench/NOTES.md v1.76). Each warp
// copies whole 16-row tiles of a Q4 matrix with K = 2,048 (1 KB a row; scales and biases bf16,
// [rows][32 groups] each) into a ring of shared-memory batches with cp.async, as gemm.cu's
// kernels do, and does nothing else with them: the rate the copies alone reach. A batch is 16
// rows × 128 bytes (4 groups of 64 columns) plus their 4 scales and 4 biases a row. Two layouts:
//   rows   the checkpoint's (gemm.cu today): a batch is 16 pieces of 128 bytes at a 1 KB pitch,
//          its scales 16 pieces of 8 bytes at a 64-byte pitch (and the biases the same);
//   tiled  the same bytes stored tile by tile, batch by batch: a batch is 2 KB in one run, its
//          scales and biases 256 bytes in another.
// Work: 3,712 tiles (an 8-row decode pass's gathered gate‖up: 58 slots × 64 tiles, 68 MB) and
// 15,520 (lm_head, 286 MB); warps take tiles in turn (tile = warp's index + k × all warps).
// Shapes: two 8-warp blocks a SM with rings of 3 batches (the gathered kernels) and one with 4
// (the one-token kernels). Then, in the checkpoint's layout, with work in each warp between its
// batches: W rounds of ≈ 37.5 SASS instructions (8 chains of shift, and, xor, add on the batch's
// words and 4 FMA chains; counted in the unrolled loop), standing in for the 4-bit loop's ≈ 300 a
// batch (gemm.cu, tools/sass_stats.py): the rate the copies keep as a warp's work per batch grows.
// Build: nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -cudart static -o gemv_weight_stream
// gemv_weight_stream.cu (with the pinned wheels: .venv-cuda/lib/python3.11/site-packages/nvidia/
// cu13/{bin/nvcc,lib} and -L that lib). Run on the GPU machine: ./gemv_weight_stream
#include <cstdio>
#include <cuda_runtime.h>

constexpr int TILE_ROWS = 16, ROW_BYTES = 1024, BATCHES = 8, BATCH_BYTES = 2048, SB_BYTES = 256;
constexpr int GROUPS = 32;  // scales a row
constexpr int MAX_TILES = 15520;
constexpr int SLOT = TILE_ROWS * 160 + SB_BYTES, SB_AT = TILE_ROWS * 160;  // a ring slot as gemm.cu's Q4 (rows padded to 160 bytes)

__device__ __forceinline__ void cp16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp8(unsigned dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait_group() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

template <bool TILED, int RING>
__global__ void __launch_bounds__(256) stream(const unsigned char* w, const unsigned char* sb, int tiles, long long first, int work,
                                              unsigned* sink) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int warps_all = gridDim.x * (blockDim.x / 32);
    const int me = blockIdx.x * (blockDim.x / 32) + warp;
    unsigned char* ring = smem + warp * RING * SLOT;
    const unsigned ring_s = (unsigned)__cvta_generic_to_shared(ring);
    const int my_tiles = tiles > me ? (tiles - me + warps_all - 1) / warps_all : 0;
    const int jobs = my_tiles * BATCHES;
    auto issue = [&](int j) {
        if (j < jobs) {
            const long long tile = first + me + (long long)(j / BATCHES) * warps_all;
            const int batch = j % BATCHES;
            const unsigned dst = ring_s + (j % RING) * SLOT;
            if (TILED) {
                const unsigned char* src = w + (tile * BATCHES + batch) * BATCH_BYTES;
#pragma unroll
                for (int i = 0; i < 4; ++i) cp16(dst + (lane + 32 * i) * 16, src + (lane + 32 * i) * 16);
                cp8(dst + SB_AT + lane * 8, sb + (tile * BATCHES + batch) * SB_BYTES + lane * 8);
            } else {
                const int r = lane / 8, p = lane % 8;
                const unsigned char* src = w + (tile * TILE_ROWS) * ROW_BYTES + batch * 128 + p * 16;
#pragma unroll
                for (int i = 0; i < 4; ++i) cp16(dst + (r + 4 * i) * 160 + p * 16, src + (r + 4 * i) * ROW_BYTES);
                // lanes 0..15: row lane's 4 scales; 16..31: its 4 biases (the biases after all scales)
                const long long half = (long long)MAX_TILES * TILE_ROWS * GROUPS * 2;
                cp8(dst + SB_AT + lane * 8,
                    sb + (lane < 16 ? 0 : half) + ((tile * TILE_ROWS + lane % 16) * GROUPS + batch * 4) * 2);
            }
        }
        commit();
    };
    for (int j = 0; j < RING - 1; ++j) issue(j);
    unsigned acc = 0;
    float facc = 0.0f;
    for (int j = 0; j < jobs; ++j) {
        wait_group<RING - 2>();
        __syncwarp();
        issue(j + RING - 1);
        const unsigned* cur = reinterpret_cast<const unsigned*>(ring + (j % RING) * SLOT);
        acc += cur[lane];
        if (work > 0) {
            unsigned v[8];
            float f[4];
#pragma unroll
            for (int c = 0; c < 8; ++c) v[c] = cur[lane + 32 * c];
#pragma unroll
            for (int c = 0; c < 4; ++c) f[c] = __uint_as_float(v[c] & 0x3fffffffu);
            for (int i = 0; i < work; ++i) {
#pragma unroll
                for (int c = 0; c < 8; ++c) v[c] = ((v[c] >> 4) & 0x000f000fu) + (v[c] ^ 0x43004300u);
#pragma unroll
                for (int c = 0; c < 4; ++c) f[c] = fmaf(f[c], 1.0001f, 0.5f);
            }
#pragma unroll
            for (int c = 0; c < 8; ++c) acc += v[c];
#pragma unroll
            for (int c = 0; c < 4; ++c) facc += f[c];
        }
    }
    if (facc == 1.2345f) sink[1] = acc;
    wait_group<0>();
    if (acc == 0x12345678u) sink[0] = acc;  // keeps the reads
}

template <bool TILED, int RING>
float run(const unsigned char* w, const unsigned char* sb, int tiles, unsigned* sink, int blocks, int work = 0) {
    const int smem = 8 * RING * SLOT;
    cudaFuncSetAttribute(stream<TILED, RING>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    // Successive launches read other tiles where there is room, so that L2 keeps none of them.
    const int regions = MAX_TILES / tiles;
    for (int i = 0; i < 3; ++i) stream<TILED, RING><<<blocks, 256, smem>>>(w, sb, tiles, 0, work, sink);
    const int reps = 48;
    cudaEventRecord(a);
    for (int i = 0; i < reps; ++i)
        stream<TILED, RING><<<blocks, 256, smem>>>(w, sb, tiles, (long long)(i % regions) * tiles, work, sink);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    const double bytes = (double)tiles * BATCHES * (BATCH_BYTES + SB_BYTES);
    return (float)(bytes * reps / (ms * 1e-3) / 1e12);  // TB/s
}

int main() {
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    const int max_tiles = MAX_TILES;
    // Tile-major and row-major copies of the same size (the values do not matter).
    const size_t wbytes = (size_t)max_tiles * BATCHES * BATCH_BYTES, sbytes = (size_t)max_tiles * BATCHES * SB_BYTES;
    unsigned char *w, *sb;
    unsigned* sink;
    if (cudaMalloc(&w, wbytes) || cudaMalloc(&sb, sbytes) || cudaMalloc(&sink, 8)) {
        printf("allocation failed\n");
        return 1;
    }
    cudaMemset(w, 1, wbytes);
    cudaMemset(sb, 1, sbytes);
    printf("| tiles (MB) | shape | rows TB/s | tiled TB/s |\n|---:|---|---:|---:|\n");
    for (int tiles : {3712, 15520}) {
        const double mb = (double)tiles * BATCHES * (BATCH_BYTES + SB_BYTES) / 1e6;
        printf("| %d (%.0f) | 2 blocks/SM, ring 3 | %.2f | %.2f |\n", tiles, mb, run<false, 3>(w, sb, tiles, sink, 2 * sms),
               run<true, 3>(w, sb, tiles, sink, 2 * sms));
        printf("| %d (%.0f) | 1 block/SM, ring 4 | %.2f | %.2f |\n", tiles, mb, run<false, 4>(w, sb, tiles, sink, sms),
               run<true, 4>(w, sb, tiles, sink, sms));
    }
    printf("\n| work a batch (≈ instructions) | 2 blocks/SM, ring 3, TB/s | 1 block/SM, ring 4, TB/s |\n|---:|---:|---:|\n");
    for (int work : {0, 2, 4, 6, 8, 10, 12}) {
        printf("| %.0f | %.2f | %.2f |\n", 37.5 * work, run<false, 3>(w, sb, 3712, sink, 2 * sms, work),
               run<false, 4>(w, sb, 3712, sink, sms, work));
    }
    const cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
        printf("CUDA error: %s\n", cudaGetErrorString(e));
        return 1;
    }
    return 0;
}
