"""CUDA C source of the GPU forward's kernels (compiled by NVRTC through cupy).

One source, compiled once per storage type: ``-DTS_HALF`` stores ``scalar_t`` as IEEE
half (kept as ``unsigned short`` and converted with PTX ``cvt``, so no CUDA header is
needed: NVRTC compiles it without an include path), ``-DTS_BF16`` as bfloat16 (the bit
patterns as ``unsigned short``, see ``_storage.py``: widened by a shift, rounded to
nearest even in integer arithmetic, so neither a header nor a bfloat16 instruction is
needed and it compiles for any architecture), else as float. Arithmetic is float;
``rnd`` rounds a float to the storage type where the Hugging Face model's half-precision
forward rounds (each product of the rotation, the activation before its product; its
bfloat16 forward rounds at the same points), so that greedy tokens follow a same-dtype
reference step by step.

Kernels, all ``extern "C"``:

- ``embed``: token rows of the embedding (plus learned position rows, for tiny_lm);
- ``add_norm``: ``residual += delta`` (optional), then RMSNorm times weight (mode 0, the
  Llama family) or LayerNorm without weight (mode 1, tiny_lm) into ``out``;
- ``rope_cache_write``: q/k/v biases (optional), rotary on q and k (Hugging Face's
  half-split pairs; cos and sin tables per position, attention factor included), q to
  its own buffer, k and v into one layer's cache at each token's slot (slot -1: a
  padding row of a captured batch, written nowhere);
- ``activate``: SwiGLU (``silu(gate) * up`` over ``[gate | up]``) or ReLU;
- ``paged_attention``: one block per (token, query head), the token's causal context
  read through its sequence's block table (grouped-query: head ``h`` reads K/V head
  ``h / (heads / kv_heads)``), online softmax in float per warp, warps merged at the
  end; serves decode (one token per sequence) and prefill chunks of several sequences
  in one launch alike;
- ``widen_logits``: the logits as float32 (what the engine samples from), plus a bias
  per vocabulary entry (tiny_lm's), in place where they are float32 already;
- ``argmax_rows``: greedy token of each float32 logits row (the first of equal maxima,
  as numpy's argmax);
- ``sample_rows``: the device sampler (its source and rules in ``_sampling_kernel.py``,
  appended here so that one module holds every kernel).
"""

from __future__ import annotations

from ._sampling_kernel import SAMPLING_SOURCE

KERNEL_NAMES = (
    "embed",
    "add_norm",
    "rope_cache_write",
    "activate",
    "paged_attention",
    "widen_logits",
    "argmax_rows",
    "sample_rows",
)

ATTENTION_WARPS = 4
MAX_HEAD_DIM = 256  # each lane keeps head_dim / 32 accumulators in registers

FORWARD_SOURCE = r"""
#if defined(TS_HALF)
typedef unsigned short scalar_t;
__device__ __forceinline__ float to_f(scalar_t v) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v)); return f;
}
__device__ __forceinline__ scalar_t from_f(float f) {
    scalar_t h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
#elif defined(TS_BF16)
typedef unsigned short scalar_t;
__device__ __forceinline__ float to_f(scalar_t v) {
    return __uint_as_float(((unsigned int)v) << 16);
}
// Round to nearest even: add just under half a unit of the kept bits, plus one when the
// kept part is odd, and truncate (a carry into the exponent rounds up to it, or to
// infinity). A NaN keeps its sign and upper payload and stays a quiet NaN (the rounding
// could carry it into infinity).
__device__ __forceinline__ scalar_t from_f(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (scalar_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (scalar_t)(u >> 16);
}
#else
typedef float scalar_t;
__device__ __forceinline__ float to_f(scalar_t v) { return v; }
__device__ __forceinline__ scalar_t from_f(float f) { return f; }
#endif
__device__ __forceinline__ float rnd(float f) { return to_f(from_f(f)); }

#define ATTENTION_WARPS 4
#define NEG_INF __int_as_float(0xff800000)
#define MAX_LANE_DIMS 8

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The sum of v over the block (any multiple of 32 threads up to 1024), on every thread.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    __shared__ float total;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // partial may still be read by a previous call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < (blockDim.x >> 5) ? partial[lane] : 0.0f;
        w = warp_sum(w);
        if (lane == 0) total = w;
    }
    __syncthreads();
    return total;
}

extern "C" __global__ void embed(
    const int* tokens, const int* positions, const scalar_t* table,
    const scalar_t* position_table, int learned_positions, scalar_t* out, int hidden)
{
    long long row = blockIdx.x;
    const scalar_t* src = table + (long long)tokens[row] * hidden;
    const scalar_t* pos = position_table + (long long)positions[row] * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = to_f(src[i]);
        if (learned_positions) v += to_f(pos[i]);
        out[row * hidden + i] = from_f(v);
    }
}

extern "C" __global__ void add_norm(
    scalar_t* residual, const scalar_t* delta, int has_delta, const scalar_t* weight,
    scalar_t* out, int hidden, float eps, int mode)
{
    long long base = (long long)blockIdx.x * hidden;
    float sum = 0.0f, squares = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = to_f(residual[base + i]);
        if (has_delta) {
            v = rnd(v + to_f(delta[base + i]));
            residual[base + i] = from_f(v);
        }
        sum += v;
        squares += v * v;
    }
    sum = block_sum(sum);
    squares = block_sum(squares);
    float mean = mode == 1 ? sum / hidden : 0.0f;
    float variance = squares / hidden - mean * mean;
    float inverse = rsqrtf(fmaxf(variance, 0.0f) + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = to_f(residual[base + i]);
        float normed = (v - mean) * inverse;
        out[base + i] = mode == 1 ? from_f(normed) : from_f(rnd(normed) * to_f(weight[i]));
    }
}

extern "C" __global__ void rope_cache_write(
    const scalar_t* qkv, const scalar_t* bias, int has_bias,
    const float* cos_table, const float* sin_table, int use_rope,
    const int* positions, const int* slots,
    scalar_t* q_out, scalar_t* k_cache, scalar_t* v_cache,
    int heads, int kv_heads, int head_dim)
{
    long long token = blockIdx.x;
    int width = (heads + 2 * kv_heads) * head_dim;
    int half = head_dim / 2;
    const scalar_t* row = qkv + token * width;
    long long slot = slots[token];
    long long cache_row = slot * kv_heads * head_dim;
    const float* cos_row = cos_table + (long long)positions[token] * half;
    const float* sin_row = sin_table + (long long)positions[token] * half;
    // q and k heads, a rotation pair (i, i + half) per thread.
    for (int p = threadIdx.x; p < (heads + kv_heads) * half; p += blockDim.x) {
        int head = p / half, i = p % half;
        int col = head * head_dim + i;
        float x1 = to_f(row[col]), x2 = to_f(row[col + half]);
        if (has_bias) {
            x1 = rnd(x1 + to_f(bias[col]));
            x2 = rnd(x2 + to_f(bias[col + half]));
        }
        float y1 = x1, y2 = x2;
        if (use_rope) {
            float c = rnd(cos_row[i]), s = rnd(sin_row[i]);
            y1 = rnd(x1 * c) + rnd(-x2 * s);
            y2 = rnd(x2 * c) + rnd(x1 * s);
        }
        if (head < heads) {
            scalar_t* q = q_out + (token * heads + head) * head_dim;
            q[i] = from_f(y1);
            q[i + half] = from_f(y2);
        } else if (slot >= 0) {
            scalar_t* k = k_cache + cache_row + (long long)(head - heads) * head_dim;
            k[i] = from_f(y1);
            k[i + half] = from_f(y2);
        }
    }
    if (slot < 0) return;
    int v_start = (heads + kv_heads) * head_dim;
    for (int d = threadIdx.x; d < kv_heads * head_dim; d += blockDim.x) {
        float v = to_f(row[v_start + d]);
        if (has_bias) v = rnd(v + to_f(bias[v_start + d]));
        v_cache[cache_row + d] = from_f(v);
    }
}

// mode 0: SwiGLU, input rows [gate | up] of 2 * width; mode 1: ReLU, rows of width.
extern "C" __global__ void activate(
    const scalar_t* in, scalar_t* out, long long rows, int width, int mode)
{
    long long total = rows * width;
    for (long long n = blockIdx.x * (long long)blockDim.x + threadIdx.x; n < total;
         n += (long long)gridDim.x * blockDim.x) {
        long long r = n / width;
        int c = n % width;
        if (mode == 0) {
            float gate = to_f(in[r * 2 * width + c]);
            float up = to_f(in[r * 2 * width + width + c]);
            out[n] = from_f(rnd(gate / (1.0f + __expf(-gate))) * up);
        } else {
            out[n] = from_f(fmaxf(to_f(in[n]), 0.0f));
        }
    }
}

extern "C" __global__ void paged_attention(
    const scalar_t* q, scalar_t* out, const scalar_t* k_cache, const scalar_t* v_cache,
    const int* token_rows, const int* positions, const int* block_tables, int table_width,
    int heads, int kv_heads, int head_dim, int block_size, float scale)
{
    __shared__ float warp_max[ATTENTION_WARPS];
    __shared__ float warp_total[ATTENTION_WARPS];
    __shared__ float warp_acc[ATTENTION_WARPS][MAX_LANE_DIMS * 32];
    long long token = blockIdx.x;
    int head = blockIdx.y;
    int kv_head = head / (heads / kv_heads);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int lane_dims = (head_dim + 31) / 32;
    int context = positions[token] + 1;
    const int* table = block_tables + (long long)token_rows[token] * table_width;
    const scalar_t* query = q + (token * heads + head) * head_dim;
    float qv[MAX_LANE_DIMS], acc[MAX_LANE_DIMS];
#pragma unroll
    for (int j = 0; j < MAX_LANE_DIMS; ++j) {
        int d = lane + 32 * j;
        qv[j] = (j < lane_dims && d < head_dim) ? to_f(query[d]) : 0.0f;
        acc[j] = 0.0f;
    }
    float running_max = NEG_INF, total = 0.0f;
    for (int t = warp; t < context; t += ATTENTION_WARPS) {
        long long slot = (long long)table[t / block_size] * block_size + t % block_size;
        long long at = (slot * kv_heads + kv_head) * head_dim;
        float dot = 0.0f;
        // Unrolled over the register arrays' full length (a loop bounded by lane_dims
        // would index them dynamically and put them in local memory).
#pragma unroll
        for (int j = 0; j < MAX_LANE_DIMS; ++j) {
            int d = lane + 32 * j;
            if (j < lane_dims && d < head_dim) dot += qv[j] * to_f(k_cache[at + d]);
        }
        float score = warp_sum(dot) * scale;
        float new_max = fmaxf(running_max, score);
        float kept = __expf(running_max - new_max);
        float weight = __expf(score - new_max);
        total = total * kept + weight;
#pragma unroll
        for (int j = 0; j < MAX_LANE_DIMS; ++j) {
            int d = lane + 32 * j;
            if (j < lane_dims && d < head_dim) acc[j] = acc[j] * kept + weight * to_f(v_cache[at + d]);
        }
        running_max = new_max;
    }
    if (lane == 0) {
        warp_max[warp] = running_max;
        warp_total[warp] = total;
    }
#pragma unroll
    for (int j = 0; j < MAX_LANE_DIMS; ++j) {
        if (j < lane_dims) warp_acc[warp][lane + 32 * j] = acc[j];
    }
    __syncthreads();
    float overall = NEG_INF;
    for (int w = 0; w < ATTENTION_WARPS; ++w) overall = fmaxf(overall, warp_max[w]);
    float denominator = 0.0f;
    for (int w = 0; w < ATTENTION_WARPS; ++w)
        denominator += warp_total[w] * __expf(warp_max[w] - overall);
    scalar_t* result = out + (token * heads + head) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        int j = d / 32, l = d % 32;
        float sum = 0.0f;
        for (int w = 0; w < ATTENTION_WARPS; ++w)
            sum += warp_acc[w][l + 32 * j] * __expf(warp_max[w] - overall);
        result[d] = from_f(sum / denominator);
    }
}

extern "C" __global__ void widen_logits(
    const scalar_t* logits, const float* bias, int has_bias, float* out, long long total,
    int vocab)
{
    for (long long n = blockIdx.x * (long long)blockDim.x + threadIdx.x; n < total;
         n += (long long)gridDim.x * blockDim.x) {
        float v = to_f(logits[n]);
        out[n] = has_bias ? v + bias[n % vocab] : v;
    }
}

extern "C" __global__ void argmax_rows(const float* logits, int* tokens, int vocab)
{
    __shared__ float best_value[32];
    __shared__ int best_index[32];
    const float* row = logits + (long long)blockIdx.x * vocab;
    float value = NEG_INF;
    int index = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = row[i];
        if (v > value || (v == value && i < index)) { value = v; index = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, value, o);
        int oi = __shfl_xor_sync(0xffffffffu, index, o);
        if (ov > value || (ov == value && oi < index)) { value = ov; index = oi; }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { best_value[warp] = value; best_index[warp] = index; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) {
            if (best_value[w] > value || (best_value[w] == value && best_index[w] < index)) {
                value = best_value[w];
                index = best_index[w];
            }
        }
        tokens[blockIdx.x] = index == 0x7fffffff ? 0 : index;
    }
}
"""
SOURCE = FORWARD_SOURCE + SAMPLING_SOURCE
