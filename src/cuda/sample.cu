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

// ---------------------------------------------------------------------------------------------
// Sampling on the device: penalties, temperature, min-p, top-k, top-p and an inverse-CDF draw,
// exactly as src/sampling/ does them (it is the reference), with no host round trip inside:
// the parameters and all intermediate results live in device memory (SampleParams, SampleState),
// so the launches can go into a captured graph.
//
// The launches, in order (each over SAMPLE_BLOCKS blocks, every block one contiguous slice of the
// vocabulary; the last block to finish a launch does that launch's serial part). One launch draws
// for several rows at once, row blockIdx.y with its own parameters, state and scratch (`at_row`):
// a pass's sampled rows take one set of launches, not one each.
//   sample_load      work = sanitised logits (ids past vocab_limit: -inf); then the penalties.
//   sample_max       the largest logit (lowest id on ties): greedy stops here; the min-p floor.
//   sample_select ×6 top-k, then top-p, each a 3-round radix select over the logits' ordered bits.
//   sample_draw_mass per-slice candidate mass; picks the slice the draw lands in.
//   sample_draw      one block walks that slice in token order to the token.
//
// Every filter keeps the tokens whose key (the logit's bits, ordered as integers) is above a cut,
// plus, for top-p only, the lowest ids among the tokens tied at the cut: min-p and top-k keep whole
// tie groups, top-p orders ties by id (as the CPU's RankKey does). So the candidate set is
// "key > cut_key, or key == cut_key and among the first cut_ties such ids", and the draw can walk
// the vocabulary in token order without sorting anything.
// ---------------------------------------------------------------------------------------------

#define SAMPLE_BLOCKS 128
#define RADIX_BINS 2048  // 11 bits a round: rounds of 11, 11 and 10 bits cover the 32-bit key

// Mirrors `Params` in sample.rs.
struct SampleParams {
    float temperature;
    float top_p;      // 1: off
    float log_min_p;  // ln(min_p), computed on the host as the CPU reference does
    float repetition; // 1: off
    float frequency;
    float presence;
    int top_k;        // 0: off
    int min_p_on;
    int greedy;
    int vocab_limit;  // ids at or past this are never chosen
    int history_len;  // (token, output count) pairs in `history`, from pair `history_at` on
    int row;          // the logits row this draw reads, and the entry of `out` it writes
    int history_at;
    int pad;
    double u;         // the draw, uniform in [0, 1)
};

// Device-side intermediate results; zeroed once at allocation, every launch leaves `arrived` at 0.
struct SampleState {
    u32 arrived;       // blocks that finished the current launch
    int done;          // the token is written (greedy, or no finite logit)
    float lmax;
    u32 floor;         // candidates so far: key >= floor (min-p, then top-k)
    u32 prefix;        // radix select: the key bits chosen so far
    int active;        // radix select: the next round has work
    double above;      // radix select: count or mass of the eligible keys above the prefix
    double goal;       // radix select: k, or top_p times the candidates' mass
    u32 cut_key;       // top-p: keys above this are in, ties at it partly
    u32 cut_ties;      // top-p: how many of the tied tokens (lowest ids first) are in
    double tie_weight; // top-p: the weight of one tied token
    int draw_block;    // the slice the draw lands in
    u32 draw_ties;     // how many tied tokens of that slice are candidates
    double draw_target; // the draw's position inside that slice (unnormalised mass)
};

#define STATE_STRIDE 256  // bytes of one row's SampleState (sample.rs: STATE_BYTES)
static_assert(sizeof(SampleState) <= STATE_STRIDE, "a row's state must fit its stride");
static_assert(sizeof(SampleParams) == 64, "sample.rs's Params has 64 bytes");

// Row blockIdx.y's parameters and state: each kernel moves its pointers to its row first.
__device__ __forceinline__ const SampleParams* at_row(const SampleParams* p) { return p + blockIdx.y; }
__device__ __forceinline__ SampleState* at_row(SampleState* st) {
    return reinterpret_cast<SampleState*>(reinterpret_cast<unsigned char*>(st) + (u64)blockIdx.y * STATE_STRIDE);
}

// Integer order = float order (for non-NaN values); -inf is the smallest key any logit gets.
__device__ __forceinline__ u32 float_key(float f) {
    const u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_float(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
#define NEG_INF_KEY 0x007fffffu  // float_key(-inf)

// As the CPU's sanitize(): NaN never wins, +inf becomes the largest finite value.
__device__ __forceinline__ float sanitize(float l) {
    return l != l ? NEG_INF : fminf(l, 3.402823466e38f);
}

// exp((l - lmax) / T) in f64, the same operations as the CPU's softmax_weight (no contraction).
__device__ __forceinline__ double sample_weight(float l, float lmax, float t) {
    return exp((double)__fdiv_rn(__fsub_rn(l, lmax), t));
}

// This block's slice of the vocabulary.
__device__ __forceinline__ void slice_of(int block, int n, int& begin, int& end) {
    const int chunk = (n + SAMPLE_BLOCKS - 1) / SAMPLE_BLOCKS;
    begin = min(n, block * chunk);
    end = min(n, begin + chunk);
}

// True in the last block to finish this launch; every block's earlier global writes are visible
// to it (read them with __ldcg: L1 is not coherent). Resets the counter for the next launch.
__device__ bool last_block(SampleState* st) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(&st->arrived, 1u) == gridDim.x - 1;
        if (last) st->arrived = 0;
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

// Exclusive prefix sum over the block's threads, in thread order; `total` gets the block's sum.
// Needs blockDim.x a multiple of 32, at most 1024.
__device__ double block_exclusive_scan(double v, double* total) {
    __shared__ double warp_sums[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    double x = v;
    for (int off = 1; off < 32; off <<= 1) {
        const double y = __shfl_up_sync(0xffffffffu, x, off);
        if (lane >= off) x += y;
    }
    __syncthreads();  // warp_sums may still be read by a previous call
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        double w = lane < warps ? warp_sums[lane] : 0.0;
        for (int off = 1; off < 32; off <<= 1) {
            const double y = __shfl_up_sync(0xffffffffu, w, off);
            if (lane >= off) w += y;
        }
        warp_sums[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    *total = warp_sums[warps - 1];
    return x - v + (warp > 0 ? warp_sums[warp - 1] : 0.0);
}

// work[t] = the logit as the CPU sampler sees it; then the penalties, as Penalties::apply does
// them (history holds each token at most once, so no two threads touch one logit).
extern "C" __global__ void sample_load(const bf16* __restrict__ logits, int n, const SampleParams* p,
                                       const u32* __restrict__ history, float* __restrict__ work,
                                       SampleState* st) {
    p = at_row(p);
    st = at_row(st);
    logits += (u64)p->row * n;
    history += 2 * (u64)p->history_at;
    work += (u64)blockIdx.y * n;
    int begin, end;
    slice_of(blockIdx.x, n, begin, end);
    const int limit = p->vocab_limit;
    for (int t = begin + threadIdx.x; t < end; t += blockDim.x) {
        work[t] = t < limit ? sanitize(__bfloat162float(logits[t])) : NEG_INF;
    }
    if (!last_block(st)) return;
    const float r = p->repetition, freq = p->frequency, pres = p->presence;
    const bool repeat = r != 1.0f, count_based = freq != 0.0f || pres != 0.0f;
    if (!repeat && !count_based) return;
    for (int i = threadIdx.x; i < p->history_len; i += blockDim.x) {
        const u32 token = history[2 * i], count = history[2 * i + 1];
        if (token >= (u32)n) continue;
        float l = __ldcg(&work[token]);
        if (repeat) l = l > 0.0f ? __fdiv_rn(l, r) : __fmul_rn(l, r);
        if (count_based && count > 0) l = __fsub_rn(l, __fadd_rn(__fmul_rn((float)count, freq), pres));
        work[token] = l;
    }
}

// The largest logit and its lowest id. Greedy: that is the token. Otherwise the min-p floor.
extern "C" __global__ void sample_max(const float* __restrict__ work, int n, const SampleParams* p,
                                      SampleState* st, float* __restrict__ block_v,
                                      int* __restrict__ block_i, int* __restrict__ out) {
    __shared__ float sv[32];
    __shared__ int si[32];
    p = at_row(p);
    st = at_row(st);
    work += (u64)blockIdx.y * n;
    block_v += blockIdx.y * SAMPLE_BLOCKS;
    block_i += blockIdx.y * SAMPLE_BLOCKS;
    out += p->row;
    int begin, end;
    slice_of(blockIdx.x, n, begin, end);
    float v = NEG_INF;
    int i = 0x7fffffff;
    for (int t = begin + threadIdx.x; t < end; t += blockDim.x) better(v, i, work[t], t);
    block_argmax(v, i, sv, si, &block_v[blockIdx.x], &block_i[blockIdx.x]);
    if (!last_block(st)) return;
    __shared__ float rv;
    __shared__ int ri;
    v = NEG_INF;
    i = 0x7fffffff;
    for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x) better(v, i, __ldcg(&block_v[b]), __ldcg(&block_i[b]));
    __syncthreads();
    block_argmax(v, i, sv, si, &rv, &ri);
    __syncthreads();
    if (threadIdx.x != 0) return;
    const float lmax = rv;
    st->lmax = lmax;
    st->done = 0;
    if (lmax == NEG_INF) {  // nothing can be chosen: the caller reports the error
        *out = -1;
        st->done = 1;
    } else if (p->greedy) {
        *out = ri;
        st->done = 1;
    } else {
        u32 floor = NEG_INF_KEY + 1;  // finite logits only
        if (p->min_p_on) {
            // The CPU keeps l >= threshold: with a threshold of zero that includes -0.
            const float threshold = __fadd_rn(lmax, __fmul_rn(p->temperature, p->log_min_p));
            floor = max(floor, float_key(threshold == 0.0f ? -0.0f : threshold));
        }
        st->floor = floor;
    }
}

// One round of a radix select over the keys of the current candidates (key >= floor).
// mode 0 (top-k): find the k-th largest key, then floor = that key (ties at it all stay).
// mode 1 (top-p): find the key where the mass, largest keys first, reaches top_p of the total;
// then how many of the tokens tied at it (lowest ids first) it takes to get there.
// A select runs when its parameter is on; rounds 1 and 2 only when the last round said so.
extern "C" __global__ void sample_select(const float* __restrict__ work, int n, const SampleParams* p,
                                         SampleState* st, u32* __restrict__ hist_count,
                                         double* __restrict__ hist_mass, int mode, int round) {
    __shared__ u32 s_count[RADIX_BINS];
    __shared__ double s_mass[RADIX_BINS];
    p = at_row(p);
    st = at_row(st);
    work += (u64)blockIdx.y * n;
    hist_count += blockIdx.y * RADIX_BINS;
    hist_mass += blockIdx.y * RADIX_BINS;
    if (st->done) return;
    const bool off = mode == 0 ? p->top_k <= 0 : p->top_p >= 1.0f;
    if (off || (round > 0 && !st->active)) return;
    const int shift = round == 0 ? 21 : round == 1 ? 10 : 0;
    const u32 digits = round == 2 ? 1024u : 2048u;
    const u32 high = round == 0 ? 0u : round == 1 ? 0xffe00000u : 0xfffffc00u;
    const u32 prefix = round == 0 ? 0u : st->prefix;
    const u32 floor = st->floor;
    const float lmax = st->lmax, temp = p->temperature;
    const double above = round == 0 ? 0.0 : st->above, set_goal = st->goal;

    for (int d = threadIdx.x; d < RADIX_BINS; d += blockDim.x) { s_count[d] = 0; s_mass[d] = 0.0; }
    __syncthreads();
    int begin, end;
    slice_of(blockIdx.x, n, begin, end);
    for (int t = begin + threadIdx.x; t < end; t += blockDim.x) {
        const float l = work[t];
        const u32 key = float_key(l);
        if (key < floor || (key & high) != prefix) continue;
        const u32 d = (key >> shift) & (digits - 1);
        atomicAdd(&s_count[d], 1u);
        if (mode == 1) atomicAdd(&s_mass[d], sample_weight(l, lmax, temp));
    }
    __syncthreads();
    for (int d = threadIdx.x; d < (int)digits; d += blockDim.x) {
        if (s_count[d] == 0) continue;
        atomicAdd(&hist_count[d], s_count[d]);
        if (mode == 1) atomicAdd(&hist_mass[d], s_mass[d]);
    }
    if (!last_block(st)) return;
    if (threadIdx.x == 0) st->active = 0;  // unless a digit is found below (the scan syncs first)

    // The last block: read the merged histogram (and clear it for the next round), highest digit
    // first. Thread j owns `per` consecutive digits, thread 0 the highest.
    const int per = (digits + blockDim.x - 1) / blockDim.x;
    const int top = (int)digits - 1 - threadIdx.x * per;
    double mine = 0.0;
    for (int j = 0; j < per && top - j >= 0; ++j) {
        const int d = top - j;
        s_count[d] = __ldcg(&hist_count[d]);
        s_mass[d] = mode == 1 ? __ldcg(&hist_mass[d]) : 0.0;
        hist_count[d] = 0;
        hist_mass[d] = 0.0;
        mine += mode == 1 ? s_mass[d] : (double)s_count[d];
    }
    double total;
    const double before = block_exclusive_scan(mine, &total);
    double goal = set_goal;
    if (round == 0) {
        goal = mode == 0 ? (double)p->top_k : (double)p->top_p * total;
        if (mode == 0 && total <= goal) return;  // k or fewer candidates: top-k keeps them all
        if (threadIdx.x == 0) st->goal = goal;
    }
    // Rounding can leave the mass a hair short of the goal: then the last digit with any takes it.
    goal = fmin(goal, above + total);
    double acc = above + before;
    for (int j = 0; j < per && top - j >= 0; ++j) {
        const int d = top - j;
        const double here = mode == 1 ? s_mass[d] : (double)s_count[d];
        if (acc < goal && acc + here >= goal) {
            const u32 key = prefix | ((u32)d << shift);
            st->prefix = key;
            st->above = acc;
            st->active = round < 2;
            if (round == 2) {
                if (mode == 0) {
                    st->floor = key;
                } else {
                    const double w = sample_weight(key_float(key), lmax, temp);
                    const u32 tied = s_count[d];
                    const double need = w > 0.0 ? ceil((goal - acc) / w) : (double)tied;
                    st->cut_key = key;
                    st->cut_ties = (u32)fmin(fmax(need, 1.0), (double)tied);
                    st->tie_weight = w;
                }
            }
        }
        acc += here;
    }
}

// The candidates: key > cut, or key == cut and among the first `ties` tied ids.
__device__ __forceinline__ void candidate_cut(const SampleParams* p, const SampleState* st, u32& cut, u32& ties) {
    if (p->top_p < 1.0f) {
        cut = st->cut_key;
        ties = st->cut_ties;
    } else {
        cut = st->floor - 1;
        ties = 0;
    }
}

// Per slice: the mass of its candidates above the cut and its count of tied tokens. The last
// block then walks the slices in order (the ties go to the lowest ids first) to the one where
// the cumulative mass passes u times the total.
extern "C" __global__ void sample_draw_mass(const float* __restrict__ work, int n, const SampleParams* p,
                                            SampleState* st, double* __restrict__ block_mass,
                                            u32* __restrict__ block_ties) {
    p = at_row(p);
    st = at_row(st);
    work += (u64)blockIdx.y * n;
    block_mass += blockIdx.y * SAMPLE_BLOCKS;
    block_ties += blockIdx.y * SAMPLE_BLOCKS;
    if (st->done) return;
    u32 cut, ties;
    candidate_cut(p, st, cut, ties);
    const float lmax = st->lmax, temp = p->temperature;
    int begin, end;
    slice_of(blockIdx.x, n, begin, end);
    double mass = 0.0;
    u32 tied = 0;
    for (int t = begin + threadIdx.x; t < end; t += blockDim.x) {
        const float l = work[t];
        const u32 key = float_key(l);
        if (key > cut) mass += sample_weight(l, lmax, temp);
        tied += key == cut;
    }
    double sum;
    block_exclusive_scan(mass, &sum);
    double tied_sum;
    block_exclusive_scan((double)tied, &tied_sum);
    if (threadIdx.x == 0) {
        block_mass[blockIdx.x] = sum;
        block_ties[blockIdx.x] = (u32)tied_sum;
    }
    if (!last_block(st) || threadIdx.x != 0) return;
    const double w_tie = ties > 0 ? st->tie_weight : 0.0;
    double z = 0.0;
    u32 seen = 0;
    for (int b = 0; b < gridDim.x; ++b) {
        const u32 here = __ldcg(&block_ties[b]);
        const u32 taken = min(here, ties - min(ties, seen));
        seen += here;
        z += __ldcg(&block_mass[b]) + taken * w_tie;
    }
    const double target = p->u * z;
    double acc = 0.0;
    seen = 0;
    int chosen = -1;
    for (int b = 0; b < gridDim.x; ++b) {
        const u32 here = __ldcg(&block_ties[b]);
        const u32 taken = min(here, ties - min(ties, seen));
        const double m = __ldcg(&block_mass[b]) + taken * w_tie;
        if (m > 0.0) {
            // Rounding can put the target at or past the total: the last slice with mass takes it.
            chosen = b;
            st->draw_ties = taken;
            st->draw_target = target - acc;
            if (acc + m > target) break;
        }
        acc += m;
        seen += here;
    }
    st->draw_block = chosen;
}

#define WALK_THREADS 1024

// One block walks the chosen slice in token order: the first candidate whose cumulative weight
// passes the target (the last one with any weight if rounding leaves the target past the end).
// Thread j takes `per` consecutive tokens, so thread order is token order; the scan's prefix sums
// split the target's range between the threads, so exactly one of them walks its tokens.
extern "C" __global__ void sample_draw(const float* __restrict__ work, int n, const SampleParams* p,
                                       const SampleState* st, int* __restrict__ out) {
    __shared__ double starts[WALK_THREADS + 1];
    __shared__ int chosen, last;
    p = at_row(p);
    st = reinterpret_cast<const SampleState*>(reinterpret_cast<const unsigned char*>(st) + (u64)blockIdx.y * STATE_STRIDE);
    work += (u64)blockIdx.y * n;
    out += p->row;
    if (st->done) return;
    if (st->draw_block < 0) {  // no candidate at all (cannot happen with a finite maximum)
        if (threadIdx.x == 0) *out = -1;
        return;
    }
    if (threadIdx.x == 0) { chosen = 0x7fffffff; last = -1; }
    u32 cut, ties;
    candidate_cut(p, st, cut, ties);
    const u32 allowed = st->draw_ties;
    const float lmax = st->lmax, temp = p->temperature;
    const double target = st->draw_target;
    int begin, end;
    slice_of(st->draw_block, n, begin, end);
    const int per = (end - begin + blockDim.x - 1) / blockDim.x;
    const int from = min(end, begin + (int)threadIdx.x * per), to = min(end, from + per);

    // Tied tokens are candidates in id order: this thread's first one has rank `rank0`.
    u32 tied = 0;
    for (int t = from; t < to; ++t) tied += float_key(work[t]) == cut;
    double unused;
    const u32 rank0 = (u32)block_exclusive_scan((double)tied, &unused);
    double mass = 0.0;
    int my_last = -1;  // this thread's last candidate with any weight
    u32 rank = rank0;
    for (int t = from; t < to; ++t) {
        const float l = work[t];
        const u32 key = float_key(l);
        if (!(key > cut || (key == cut && rank++ < allowed))) continue;
        const double w = sample_weight(l, lmax, temp);
        mass += w;
        if (w > 0.0) my_last = t;
    }
    double total;
    const double start = block_exclusive_scan(mass, &total);
    starts[threadIdx.x] = start;
    if (threadIdx.x == 0) starts[blockDim.x] = total;
    __syncthreads();
    if (my_last >= 0 && start <= target && target < starts[threadIdx.x + 1]) {
        double acc = start;
        int pick = my_last;
        rank = rank0;
        for (int t = from; t < to; ++t) {
            const float l = work[t];
            const u32 key = float_key(l);
            if (!(key > cut || (key == cut && rank++ < allowed))) continue;
            const double w = sample_weight(l, lmax, temp);
            if (w > 0.0 && acc + w > target) { pick = t; break; }
            acc += w;
        }
        atomicMin(&chosen, pick);  // one thread, unless rounding made two ranges overlap
    }
    if (my_last >= 0) atomicMax(&last, my_last);
    __syncthreads();
    if (threadIdx.x == 0) *out = chosen != 0x7fffffff ? chosen : last;
}
