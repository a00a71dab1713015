// What a dependent launch's boundary costs in a decode-like chain (bench/NOTES.md v1.68): K kernels
// in a CUDA graph, each of G blocks reading the whole 8 KB vector the previous kernel wrote (every
// block of it) and writing its share of the next, timed per kernel in three forms:
//   plain  graph launches without programmatic dependent launch;
//   pdl    each kernel launched early (griddepcontrol.launch_dependents at its start) and waiting
//          in griddepcontrol.wait for the previous grid to complete and flush (lily's decode now);
//   flag   launched early the same way, but waiting on a counter in global memory that each block
//          of the previous kernel bumps (fence, then a release add) after its stores; thread 0
//          polls it (acquire, 32 ns sleeps between polls);
//   spin   the same without the fence (the add's release covers the block after its barrier)
//          and without sleeps;
//   slots  each block of the previous kernel sets its own word (release store, no atomics on one
//          address); warp 0 polls them all (acquire loads, a vote).
// The difference pdl − flag is what counters instead of grid completion could take off each of a
// decode step's ≈ 360 boundaries. Build: nvcc -gencode=arch=compute_90a,code=sm_90a -O3
// -L<cuda lib dir> -o chain_sync chain_sync.cu; run on the GPU machine: ./chain_sync
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <algorithm>
#include <vector>
#include <cuda_runtime.h>

constexpr int N = 2048, THREADS = 256, K = 400;

enum Form { PLAIN, PDL, FLAG, SPIN, SLOTS };
constexpr int MAX_BLOCKS = 528;

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

template <Form F>
__global__ void __launch_bounds__(THREADS) step(const float* in, float* out, const unsigned* ready_in,
                                               unsigned* ready_out, unsigned blocks_before) {
    if (F != PLAIN) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (F == PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
    if (F == FLAG || F == SPIN) {
        if (threadIdx.x == 0)
            while (load_acquire(ready_in) < blocks_before)
                if (F == FLAG) __nanosleep(32);
        __syncthreads();
    }
    if (F == SLOTS) {
        // ready_in: the previous kernel's words, one per block (MAX_BLOCKS apart per kernel).
        if (threadIdx.x < 32) {
            bool all;
            do {
                bool mine = true;
                for (unsigned b = threadIdx.x; b < blocks_before; b += 32) mine &= load_acquire(ready_in + b) != 0;
                all = __all_sync(~0u, mine);
            } while (!all);
        }
        __syncthreads();
    }
    __shared__ float partial[THREADS / 32];
    float s = 0.0f;
    for (int i = threadIdx.x; i < N; i += THREADS) s += __ldcg(in + i);
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(~0u, s, o);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = s;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < THREADS / 32; ++w) total += partial[w];
    const int per = (N + gridDim.x - 1) / gridDim.x;
    for (int i = blockIdx.x * per + threadIdx.x; i < min(N, (int)(blockIdx.x + 1) * per); i += THREADS)
        out[i] = 0.999f * __ldcg(in + (i * 7 + 1) % N) + (0.001f / N) * total;
    if (F == FLAG || F == SPIN || F == SLOTS) {
        __syncthreads();
        if (threadIdx.x == 0) {
            if (F == FLAG) __threadfence();
            if (F == SLOTS)
                asm volatile("st.release.gpu.global.u32 [%0], 1;" ::"l"(ready_out + blockIdx.x) : "memory");
            else
                asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(ready_out) : "memory");
        }
    }
}

template <Form F>
static double per_kernel_us(int blocks, float* buf, unsigned* ready, const std::vector<float>& init,
                            std::vector<float>& result) {
    cudaStream_t st;
    cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    cudaGraph_t graph;
    cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal);
    const int stride = F == SLOTS ? MAX_BLOCKS : 1;  // words per kernel
    cudaMemsetAsync(ready, 0, (K + 1) * stride * sizeof(unsigned), st);
    for (int k = 0; k < K; ++k) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(blocks);
        cfg.blockDim = dim3(THREADS);
        cfg.stream = st;
        cudaLaunchAttribute attr;
        attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = &attr;
        cfg.numAttrs = (F != PLAIN && k > 0) ? 1 : 0;
        // Kernel 0's input is "ready" from the start: its counter is preset by blocks_before = 0.
        cudaLaunchKernelEx(&cfg, step<F>, (const float*)(buf + (k % 2) * N), buf + ((k + 1) % 2) * N,
                           (const unsigned*)(ready + k * stride), ready + (k + 1) * stride,
                           k == 0 ? 0u : (unsigned)blocks);
    }
    cudaStreamEndCapture(st, &graph);
    cudaGraphExec_t exec;
    if (cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) {
        printf("instantiate failed: %s\n", cudaGetErrorString(cudaGetLastError()));
        exit(1);  // no result to compare
    }
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    // One replay from the same start for the check, then the timed ones.
    cudaMemcpy(buf, init.data(), 2 * N * sizeof(float), cudaMemcpyHostToDevice);
    cudaGraphLaunch(exec, st);
    cudaStreamSynchronize(st);
    result.resize(N);
    cudaMemcpy(result.data(), buf + (K % 2) * N, N * sizeof(float), cudaMemcpyDeviceToHost);
    std::vector<double> times;
    for (int rep = 0; rep < 23; ++rep) {
        cudaEventRecord(a, st);
        cudaGraphLaunch(exec, st);
        cudaEventRecord(b, st);
        cudaEventSynchronize(b);
        float ms = 0;
        cudaEventElapsedTime(&ms, a, b);
        if (rep >= 3) times.push_back(ms * 1e3 / K);
    }
    std::sort(times.begin(), times.end());
    const cudaError_t err = cudaGetLastError();
    if (err) printf("error: %s\n", cudaGetErrorString(err));
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(st);
    return times[times.size() / 2];
}

int main() {
    float* buf;
    unsigned* ready;
    cudaMalloc(&buf, 2 * N * sizeof(float));
    cudaMalloc(&ready, (K + 1) * MAX_BLOCKS * sizeof(unsigned));
    std::vector<float> init(2 * N);
    for (int i = 0; i < 2 * N; ++i) init[i] = (float)(rand() % 1000) / 1000.0f;
    printf("µs per kernel in a graph of %d (median of 20 replays)\n", K);
    printf("%8s %8s %8s %8s %8s %8s %12s\n", "blocks", "plain", "pdl", "flag", "spin", "slots", "max |diff|");
    std::vector<float> rp, rd, rf, rs, rl;
    for (int round = 0; round < 2; ++round)
        for (int blocks : {1, 16, 132, 264, 528}) {
            const double p = per_kernel_us<PLAIN>(blocks, buf, ready, init, rp);
            const double d = per_kernel_us<PDL>(blocks, buf, ready, init, rd);
            const double f = per_kernel_us<FLAG>(blocks, buf, ready, init, rf);
            const double sp = per_kernel_us<SPIN>(blocks, buf, ready, init, rs);
            const double sl = per_kernel_us<SLOTS>(blocks, buf, ready, init, rl);
            float diff = 0.0f;  // every chain must compute what the plain one does
            for (int i = 0; i < N; ++i)
                diff = std::max({diff, fabsf(rd[i] - rp[i]), fabsf(rf[i] - rp[i]), fabsf(rs[i] - rp[i]),
                                 fabsf(rl[i] - rp[i])});
            printf("%8d %8.2f %8.2f %8.2f %8.2f %8.2f %12.3g\n", blocks, p, d, f, sp, sl, diff);
        }
    return 0;
}
