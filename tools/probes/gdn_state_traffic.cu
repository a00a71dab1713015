// What DRAM gives the GDN decode step's state traffic (bench/NOTES.md v1.58): each block reads a
// 128 × 32 fp32 slice of one value head's state, scales it and writes it back, for 64 sequences
// (one layer of a 64-row decode pass: 128 MB read, 128 MB written), in three forms:
//   strided   the slice as gdn_decode touches it: 128-byte pieces of 128 rows at a 512-byte pitch
//             (the state's [head][dk][dv] layout), one float4 per thread per row group;
//   cluster   the same in clusters of 8 with one cluster barrier between the loads and the stores,
//             as gdn_decode's exchanges put one there;
//   slices    the same bytes with each block's slice contiguous ([head][slice][dk][32]).
// Build: nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -L<cuda lib dir> -o gdn_state_traffic gdn_state_traffic.cu
// (with the pinned wheels: .venv-cuda/lib/python3.11/site-packages/nvidia/cu13/{bin/nvcc,lib}).
// Run on the GPU machine: ./gdn_state_traffic  (prints GB/s of read + write per form, with any
// number of blocks per SM and with 4).
#include <cstdio>
#include <cuda_runtime.h>

constexpr int SEQS = 64, HEADS = 32, DK = 128, DV = 128, COLS = 32, THREADS = 128;
constexpr long long SEQ_FLOATS = (long long)HEADS * DK * DV;

template <bool CONTIGUOUS>
__device__ __forceinline__ float* slice_base(float* s, int block, int seq) {
    const int hv = block / (DV / COLS), slice = block % (DV / COLS);
    float* head = s + seq * SEQ_FLOATS + (long long)hv * DK * DV;
    return CONTIGUOUS ? head + slice * DK * COLS : head + slice * COLS;
}

template <bool CONTIGUOUS>
__device__ __forceinline__ void body(float* s, bool cluster) {
    const int tid = threadIdx.x, c = tid % 8, r = tid / 8;
    const int pitch = CONTIGUOUS ? COLS : DV;
    float* base = slice_base<CONTIGUOUS>(s, blockIdx.x, blockIdx.y) + 4 * c;
    float4 v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = *reinterpret_cast<const float4*>(base + (r + 16 * i) * pitch);
    if (cluster)
        asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        v[i].x *= 0.999f, v[i].y *= 0.999f, v[i].z *= 0.999f, v[i].w *= 0.999f;
        *reinterpret_cast<float4*>(base + (r + 16 * i) * pitch) = v[i];
    }
}

__global__ void __launch_bounds__(THREADS) strided(float* s) { body<false>(s, false); }
__global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(THREADS) clustered(float* s) { body<false>(s, true); }
__global__ void __launch_bounds__(THREADS) slices(float* s) { body<true>(s, false); }

// `smem`: dynamic shared memory per block, only to limit the blocks resident per SM (52 KB: 4,
// as gdn_decode's registers allow).
template <typename K>
static void time(const char* name, K kernel, float* s, int smem) {
    const dim3 grid(HEADS * DV / COLS, SEQS);
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    for (int i = 0; i < 3; ++i) kernel<<<grid, THREADS, smem>>>(s);
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    const int reps = 50;
    cudaEventRecord(a);
    for (int i = 0; i < reps; ++i) kernel<<<grid, THREADS, smem>>>(s);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, a, b);
    const double us = ms * 1e3 / reps, bytes = 2.0 * SEQS * SEQ_FLOATS * 4;
    const cudaError_t err = cudaGetLastError();
    printf("%-9s %s %8.1f us per layer of 64 sequences, %6.0f GB/s%s%s\n", name,
           smem ? "4 blocks/SM" : "any       ", us, bytes / us * 1e-3, err ? "  error: " : "",
           err ? cudaGetErrorString(err) : "");
}

int main() {
    float* s = nullptr;
    if (cudaMalloc(&s, SEQS * SEQ_FLOATS * 4) != cudaSuccess) return 1;
    cudaMemset(s, 0, SEQS * SEQ_FLOATS * 4);
    for (int round = 0; round < 2; ++round) {
        for (int smem : {0, 52 * 1024}) {
            time("strided", strided, s, smem);
            time("cluster", clustered, s, smem);
            time("slices", slices, s, smem);
        }
    }
    cudaFree(s);
    return 0;
}
