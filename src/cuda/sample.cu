// Greedy sampling on the device: the index of the largest logit (lowest index on ties), so a
// decode step brings back 4 bytes instead of the 248,320 logits. Two passes: blocks reduce their
// slice to (value, index) pairs, one block reduces those.
#include "common.cuh"

#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ void better(float& v, int& i, float v2, int i2) {
    if (v2 > v || (v2 == v && i2 < i)) { v = v2; i = i2; }
}

__device__ void block_argmax(float v, int i, float* sv, int* si, float* out_v, int* out_i) {
    for (int off = 16; off > 0; off >>= 1) {
        better(v, i, __shfl_xor_sync(0xffffffffu, v, off), __shfl_xor_sync(0xffffffffu, i, off));
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) { sv[warp] = v; si[warp] = i; }
    __syncthreads();
    if (warp == 0) {
        v = lane < blockDim.x / 32 ? sv[lane] : NEG_INF;
        i = lane < blockDim.x / 32 ? si[lane] : 0x7fffffff;
        for (int off = 16; off > 0; off >>= 1) {
            better(v, i, __shfl_xor_sync(0xffffffffu, v, off), __shfl_xor_sync(0xffffffffu, i, off));
        }
        if (lane == 0) { *out_v = v; *out_i = i; }
    }
}

// Pass 1: block b reduces logits[b*chunk .. (b+1)*chunk) of row blockIdx.y.
extern "C" __global__ void argmax_partial(const bf16* __restrict__ logits, int n, int chunk,
                                          float* __restrict__ part_v, int* __restrict__ part_i) {
    pdl_wait();
    pdl_launch_dependents();
    __shared__ float sv[32];
    __shared__ int si[32];
    const bf16* row = logits + (u64)blockIdx.y * n;
    float v = NEG_INF;
    int i = 0x7fffffff;
    const int end = min(n, (blockIdx.x + 1) * chunk);
    for (int c = blockIdx.x * chunk + threadIdx.x; c < end; c += blockDim.x) {
        better(v, i, __bfloat162float(row[c]), c);
    }
    const int slot = blockIdx.y * gridDim.x + blockIdx.x;
    block_argmax(v, i, sv, si, &part_v[slot], &part_i[slot]);
}

// Pass 2: one block per row reduces that row's partial results.
extern "C" __global__ void argmax_final(const float* __restrict__ part_v, const int* __restrict__ part_i,
                                        int parts, int* __restrict__ out) {
    pdl_wait();
    pdl_launch_dependents();
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ float rv;
    float v = NEG_INF;
    int i = 0x7fffffff;
    for (int p = threadIdx.x; p < parts; p += blockDim.x) {
        better(v, i, part_v[blockIdx.x * parts + p], part_i[blockIdx.x * parts + p]);
    }
    block_argmax(v, i, sv, si, &rv, &out[blockIdx.x]);
}
