"""CUDA C of the device sampler: one kernel, ``sample_rows``, one block per draw.

Appended to the forward's source (``_cuda_source.SOURCE``) and compiled with it. A draw
is one sequence's next token from one float32 logits row, under its own parameters,
read from a packed int32 row (``PARAM_*`` below; the floats as their bits):

0. penalties, when the draw has any (vLLM's, as the host sampler applies them): the row
   is copied to the draw's row of ``scratch`` and each token seen in the prompt or the
   output (``seen``: (token id, times in the output) pairs, distinct ids) is penalised
   there: ``repetition_penalty`` divides a positive logit and multiplies a negative one,
   then ``frequency_penalty * count + presence_penalty * (count > 0)`` is subtracted (in
   double, rounded to float); everything below draws from that copy;
1. greedy (temperature 0, or ``top_k == 1``): the first of the row's maxima, as
   ``argmax_rows``;
2. otherwise the row is scaled, ``s = logit / temperature`` (IEEE float division), and
   a token is kept when it passes every filter asked: min-p (``s >= max(s) +
   log(min_p)``), top-k (``s`` at least the k-th largest ``s``; equal values are all
   kept) and top-p (the probability of the tokens strictly more likely than it, over
   the tokens min-p keeps, below ``top_p`` of their total: the shortest run of most
   likely tokens reaching ``top_p``, ties kept together). The k-th value and the top-p
   boundary are found by radix selection over the scaled values' ordered bits, 8 bits
   a pass, so nothing is sorted;
3. the token is the kept one with the highest ``(s - max(s)) + g``, where ``g =
   -log(-log(u))`` (in double, then rounded to float) and ``u`` a uniform number from
   Philox-4x32-10 keyed by the draw's 64-bit seed, with the counter (token id,
   position of the drawn token in its sequence, stream, 0): a Gumbel-max draw, which is
   a draw from the kept tokens' softmax. Equal scores go to the lowest token id. Each
   token's number depends only on (seed, stream, position, token), not on the batch.

With ``logprobs >= 0`` it also writes the chosen token's log-softmax of the raw logits
(before penalties, as the host reports them)
and the ``logprobs`` most likely tokens' (ranked by logit, the lower id first on ties).

``out`` holds every draw's token first (``out[draw]``: what a step copies back when
nobody asked for logprobs), then per draw ``DETAIL_WIDTH`` ints: the chosen token's
logprob, ``MAX_TOP_LOGPROBS`` token ids, their logprobs (floats as bits).

``_gpu_sampling.reference_draws`` is this arithmetic in numpy, step for step.
"""

from __future__ import annotations

MAX_TOP_LOGPROBS = 20  # as many as a request may ask (the parameter table's MAX_LOGPROBS)
# The packed parameter row of one draw.
PARAM_ROW, PARAM_TOP_K, PARAM_SEED_LOW, PARAM_SEED_HIGH, PARAM_STREAM = 0, 1, 2, 3, 4
PARAM_POSITION, PARAM_LOGPROBS, PARAM_TEMPERATURE, PARAM_TOP_P, PARAM_MIN_P = 5, 6, 7, 8, 9
PARAM_PRESENCE, PARAM_FREQUENCY, PARAM_REPETITION, PARAM_SEEN_AT, PARAM_SEEN = 10, 11, 12, 13, 14
PARAM_WIDTH = 15
DETAIL_WIDTH = 1 + 2 * MAX_TOP_LOGPROBS
SAMPLE_THREADS = 512
PHILOX_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
PHILOX_KEY_STEPS = (0x9E3779B9, 0xBB67AE85)

SAMPLING_SOURCE = r"""
#define MAX_TOP_LOGPROBS 20
#define PARAM_WIDTH 15
#define DETAIL_WIDTH (1 + 2 * MAX_TOP_LOGPROBS)

// Philox-4x32-10's first output word for counter (c0, c1, c2, c3) under key (k0, k1).
__device__ unsigned int philox_first(
    unsigned int c0, unsigned int c1, unsigned int c2, unsigned int c3,
    unsigned int k0, unsigned int k1)
{
    for (int round = 0; round < 10; ++round) {
        unsigned int hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        unsigned int hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0; c1 = lo1; c2 = hi0 ^ c3 ^ k1; c3 = lo0;
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
    return c0;
}

// A float's bits, ordered as the floats are (NaN aside).
__device__ __forceinline__ unsigned int ordered(float f) {
    unsigned int bits = __float_as_uint(f);
    return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

__device__ float block_max_of(float v) {
    __shared__ float partial[32];
    __shared__ float result;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) v = fmaxf(v, partial[w]);
        result = v;
    }
    __syncthreads();
    return result;
}

// The first index of the highest value over the block (value, index per thread).
__device__ int block_argmax(float value, int index) {
    __shared__ float best_value[32];
    __shared__ int best_index[32];
    __shared__ int result;
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, value, o);
        int oi = __shfl_xor_sync(0xffffffffu, index, o);
        if (ov > value || (ov == value && oi < index)) { value = ov; index = oi; }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) { best_value[warp] = value; best_index[warp] = index; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) {
            if (best_value[w] > value || (best_value[w] == value && best_index[w] < index)) {
                value = best_value[w];
                index = best_index[w];
            }
        }
        result = index == 0x7fffffff ? 0 : index;
    }
    __syncthreads();
    return result;
}

// The ordered bits of the k-th largest of row / temperature (1 <= k <= vocab).
__device__ unsigned int kth_largest(const float* row, int vocab, float temperature, int k) {
    __shared__ unsigned int count[256];
    __shared__ unsigned int chosen, left;
    unsigned int prefix = 0, mask = 0, remaining = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int d = threadIdx.x; d < 256; d += blockDim.x) count[d] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            unsigned int key = ordered(row[i] / temperature);
            if ((key & mask) == prefix) atomicAdd(&count[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int d = 255;
            for (; d > 0 && count[d] < remaining; --d) remaining -= count[d];
            chosen = d;
            left = remaining;
        }
        __syncthreads();
        prefix |= chosen << shift;
        mask |= 255u << shift;
        remaining = left;
        __syncthreads();
    }
    return prefix;
}

// The ordered bits of the least likely token top-p keeps: of the tokens at or above
// `floor` (min-p's cut), weights exp(s - top), total `total`.
__device__ unsigned int top_p_boundary(
    const float* row, int vocab, float temperature, float floor, float top, float target)
{
    __shared__ unsigned int count[256];
    __shared__ float mass[256];
    __shared__ unsigned int chosen;
    __shared__ float chosen_before;
    unsigned int prefix = 0, mask = 0;
    float above = 0.0f;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int d = threadIdx.x; d < 256; d += blockDim.x) { count[d] = 0; mass[d] = 0.0f; }
        __syncthreads();
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            float s = row[i] / temperature;
            unsigned int key = ordered(s);
            if (s >= floor && (key & mask) == prefix) {
                unsigned int d = (key >> shift) & 255u;
                atomicAdd(&count[d], 1u);
                atomicAdd(&mass[d], expf(s - top));
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float before = above, kept_before = above;
            int kept = -1;
            for (int d = 255; d >= 0; --d) {
                if (count[d] == 0) continue;
                if (kept >= 0 && before >= target) break;
                kept = d;
                kept_before = before;
                before += mass[d];
            }
            chosen = kept;
            chosen_before = kept_before;
        }
        __syncthreads();
        prefix |= chosen << shift;
        mask |= 255u << shift;
        above = chosen_before;
        __syncthreads();
    }
    return prefix;
}

// The draw's row with its penalties, in its row of scratch (see the module docstring).
__device__ const float* penalised(
    const float* raw, float* scratch, int vocab, const int* p, const int* seen)
{
    float presence = __int_as_float(p[10]), frequency = __int_as_float(p[11]);
    float repetition = __int_as_float(p[12]);
    float* row = scratch + (long long)blockIdx.x * vocab;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) row[i] = raw[i];
    __syncthreads();
    const int* pairs = seen + 2 * (long long)p[13];
    for (int j = threadIdx.x; j < p[14]; j += blockDim.x) {
        int token = pairs[2 * j], count = pairs[2 * j + 1];
        float v = row[token];
        if (repetition != 1.0f) v = v > 0.0f ? v / repetition : v * repetition;
        double cut = (double)frequency * count + (count > 0 ? (double)presence : 0.0);
        row[token] = (float)((double)v - cut);
    }
    __syncthreads();
    return row;
}

extern "C" __global__ void sample_rows(
    const float* logits, int vocab, const int* params, const int* seen, float* scratch,
    int* out, int draws)
{
    __shared__ float total_shared;
    const int* p = params + (long long)blockIdx.x * PARAM_WIDTH;
    const float* raw = logits + (long long)p[0] * vocab;
    const float* row = raw;
    if (p[14] > 0) row = penalised(raw, scratch, vocab, p, seen);
    int top_k = p[1], logprobs = p[6];
    float temperature = __int_as_float(p[7]), top_p = __int_as_float(p[8]);
    float min_p = __int_as_float(p[9]);
    int token;
    if (temperature <= 0.0f || top_k == 1) {
        float value = NEG_INF;
        int index = 0x7fffffff;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            float v = row[i];
            if (v > value) { value = v; index = i; }
        }
        token = block_argmax(value, index);
    } else {
        float top = NEG_INF;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x)
            top = fmaxf(top, row[i] / temperature);
        top = block_max_of(top);
        float floor = min_p > 0.0f ? top + (float)log((double)min_p) : NEG_INF;
        unsigned int k_key = 0;
        if (top_k > 0 && top_k < vocab) k_key = kth_largest(row, vocab, temperature, top_k);
        unsigned int p_key = 0;
        if (top_p < 1.0f) {
            float total = 0.0f;
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
                float s = row[i] / temperature;
                if (s >= floor) total += expf(s - top);
            }
            total = block_sum(total);
            p_key = top_p_boundary(row, vocab, temperature, floor, top, top_p * total);
        }
        unsigned int k0 = (unsigned int)p[2], k1 = (unsigned int)p[3];
        unsigned int position = (unsigned int)p[5], stream = (unsigned int)p[4];
        float value = NEG_INF;
        int index = 0x7fffffff;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            float s = row[i] / temperature;
            unsigned int key = ordered(s);
            if (s < floor || key < k_key || key < p_key) continue;
            unsigned int bits = philox_first((unsigned int)i, position, stream, 0u, k0, k1);
            double u = ((double)bits + 0.5) * 2.3283064365386963e-10;  // (0, 1)
            float score = (s - top) + (float)(-log(-log(u)));
            if (score > value) { value = score; index = i; }
        }
        token = block_argmax(value, index);
    }
    if (threadIdx.x == 0) out[blockIdx.x] = token;
    if (logprobs < 0) return;
    // Log-softmax of the raw logits: the chosen token's, then the most likely ones'.
    float peak = NEG_INF;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) peak = fmaxf(peak, raw[i]);
    peak = block_max_of(peak);
    float total = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) total += expf(raw[i] - peak);
    total = block_sum(total);
    if (threadIdx.x == 0) total_shared = peak + logf(total);
    __syncthreads();
    float norm = total_shared;
    int* detail = out + draws + (long long)blockIdx.x * DETAIL_WIDTH;
    if (threadIdx.x == 0) detail[0] = __float_as_int(raw[token] - norm);
    float last_value = __int_as_float(0x7f800000);  // +inf: nothing listed yet
    int last_index = -1;
    for (int n = 0; n < logprobs && n < MAX_TOP_LOGPROBS; ++n) {
        float value = NEG_INF;
        int index = 0x7fffffff;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            float v = raw[i];
            bool after = v < last_value || (v == last_value && i > last_index);
            if (after && (v > value || (v == value && i < index))) { value = v; index = i; }
        }
        last_index = block_argmax(value, index);
        last_value = raw[last_index];
        if (threadIdx.x == 0) {
            detail[1 + n] = last_index;
            detail[1 + MAX_TOP_LOGPROBS + n] = __float_as_int(last_value - norm);
        }
    }
}
"""
