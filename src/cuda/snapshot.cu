// copy_runs: device-to-device copies of whole runs of bytes in one launch, for the prefix cache's
// snapshots (snapshot.rs): a long sequence's state is ~100 runs (each GDN layer's recurrent state
// and conv window, each attention layer and KV head's keys and values), which as separate
// cuMemcpyDtoDAsync calls cost ≈ 1–1.5 ms of host time on a request's path (bench/NOTES.md v1.83).
//
// Grid (x, runs): run i is table[3i .. 3i + 3] = from, to (device addresses, 16-byte aligned)
// and its length in bytes (a multiple of 16); the x blocks of a run stride over its vectors.
#include "common.cuh"

extern "C" __global__ void copy_runs(const unsigned long long* __restrict__ table) {
    pdl_wait();
    pdl_launch_dependents();
    const unsigned long long* t = table + 3 * blockIdx.y;
    const uint4* from = reinterpret_cast<const uint4*>(t[0]);
    uint4* to = reinterpret_cast<uint4*>(t[1]);
    const u64 n = t[2] / 16;
    const u64 stride = (u64)gridDim.x * blockDim.x;
#pragma unroll 4
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += stride) to[e] = from[e];
}
