// Paged attention over a varlen batch: connectors/paged_attention.py's
// paged_attention_reference in one launch.
//
// Inputs (the wrapper, connectors/paged_attention_cuda.py, validates every one):
//   query  [num_tokens, num_heads, head_dim], contiguous; out has the same shape and dtype.
//   key_cache, value_cache  [num_blocks, block_size, num_kv_heads, head_dim], strided views of
//     the block-major pool (pool[:, layer, 0] and pool[:, layer, 1]): element (b, r, h, d) is
//     at b * block_stride + r * row_stride + h * head_stride + d (strides in elements, the
//     same for K and V; the last dim is contiguous).
//   block_tables [num_seqs, max_blocks_per_seq] int32: token t of sequence s is in block
//     block_tables[s, t / block_size], row t % block_size.
//   query_start_loc [num_seqs + 1] int32, non-decreasing from 0 to num_tokens: sequence s owns
//     query rows query_start_loc[s] .. query_start_loc[s + 1] - 1.
//   context_lens [num_seqs] int32: the tokens of s with KV in the cache, its queries included;
//     query i of s sits at position context_lens[s] - num_queries_s + i and attends to keys
//     0 .. position (causal, bottom-right aligned).
// Query head h reads KV head h / (num_heads / num_kv_heads) (grouped-query attention).
// Scores, softmax and the weighted sum of values are fp32; the output is rounded to T once.
//
// Launch: grid (num_tokens, num_heads), one CUDA block per (query token, head); blockDim.x a
// multiple of 32, at most 32 * PA_MAX_WARPS. Warp w takes keys w, w + num_warps, ... and keeps
// its own online (streaming) softmax: running max m, sum l = sum exp(s - m) and accumulator
// acc = sum exp(s - m) * v. Lane `lane` holds dims lane + 32 j of q and acc (j < 8, so head_dim
// <= 256); a key's score is a warp all-reduce. At the end the warps' (m, l, acc) are merged
// through shared memory. Nothing grows with the context: memory is O(head_dim) per block.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define PA_WARP_SIZE 32
#define PA_MAX_HEAD_DIM 256
#define PA_DIMS_PER_LANE (PA_MAX_HEAD_DIM / PA_WARP_SIZE)
#define PA_MAX_WARPS 8
// -inf without math.h (NVRTC has no INFINITY): exp(-inf) = 0 makes an empty warp weigh nothing.
#define PA_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ void store_rn(float* out, float y) { *out = y; }
__device__ __forceinline__ void store_rn(__half* out, float y) { *out = __float2half_rn(y); }
__device__ __forceinline__ void store_rn(__nv_bfloat16* out, float y) { *out = __float2bfloat16_rn(y); }

// The sum of `value` over the warp, the same bits in every lane (each butterfly step adds the
// same two partial sums in every lane, and fp32 addition is commutative).
__device__ __forceinline__ float warp_sum(float value) {
  for (int offset = PA_WARP_SIZE / 2; offset > 0; offset >>= 1) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}

// The sequence that owns query row `token`: the last s with query_start_loc[s] <= token
// (sequences without queries share their start with the next one and are skipped).
__device__ __forceinline__ int sequence_of(const int* __restrict__ query_start_loc, int num_seqs,
                                           int token) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (query_start_loc[mid] <= token) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

template <typename T>
__device__ void paged_attention(T* __restrict__ out, const T* __restrict__ query,
                                const T* __restrict__ key_cache, const T* __restrict__ value_cache,
                                const int* __restrict__ block_tables,
                                const int* __restrict__ context_lens,
                                const int* __restrict__ query_start_loc, float scale, int num_seqs,
                                int num_heads, int num_kv_heads, int head_dim, int block_size,
                                int max_blocks_per_seq, long long block_stride,
                                long long row_stride, long long head_stride) {
  __shared__ float warp_max[PA_MAX_WARPS];
  __shared__ float warp_denominator[PA_MAX_WARPS];
  __shared__ float warp_acc[PA_MAX_WARPS][PA_MAX_HEAD_DIM];

  const int token = blockIdx.x;
  const int head = blockIdx.y;
  const int lane = threadIdx.x % PA_WARP_SIZE;
  const int warp = threadIdx.x / PA_WARP_SIZE;
  const int num_warps = blockDim.x / PA_WARP_SIZE;

  const int seq = sequence_of(query_start_loc, num_seqs, token);
  const int first_query = query_start_loc[seq];
  const int num_queries = query_start_loc[seq + 1] - first_query;
  const int position = context_lens[seq] - num_queries + (token - first_query);
  const int num_keys = position + 1;  // >= 1: the wrapper checks num_queries <= context_len
  const int kv_head = head / (num_heads / num_kv_heads);
  const int* block_table = block_tables + (long long)seq * max_blocks_per_seq;
  const long long query_offset = ((long long)token * num_heads + head) * head_dim;

  float q[PA_DIMS_PER_LANE];
  float acc[PA_DIMS_PER_LANE];
#pragma unroll
  for (int j = 0; j < PA_DIMS_PER_LANE; ++j) {
    const int d = lane + j * PA_WARP_SIZE;
    q[j] = d < head_dim ? to_float(query[query_offset + d]) * scale : 0.0f;
    acc[j] = 0.0f;
  }

  float running_max = PA_NEG_INF;  // the first key's correction is exp(-inf) = 0
  float denominator = 0.0f;
  for (int key = warp; key < num_keys; key += num_warps) {
    const long long block = block_table[key / block_size];
    const long long offset = block * block_stride + (long long)(key % block_size) * row_stride +
                             (long long)kv_head * head_stride;
    const T* k = key_cache + offset;
    const T* v = value_cache + offset;
    float partial = 0.0f;
#pragma unroll
    for (int j = 0; j < PA_DIMS_PER_LANE; ++j) {
      const int d = lane + j * PA_WARP_SIZE;
      if (d < head_dim) partial += q[j] * to_float(k[d]);
    }
    const float score = warp_sum(partial);
    const float new_max = fmaxf(running_max, score);
    const float correction = expf(running_max - new_max);
    const float weight = expf(score - new_max);
    denominator = denominator * correction + weight;
#pragma unroll
    for (int j = 0; j < PA_DIMS_PER_LANE; ++j) {
      const int d = lane + j * PA_WARP_SIZE;
      if (d < head_dim) acc[j] = acc[j] * correction + weight * to_float(v[d]);
    }
    running_max = new_max;
  }

  // Merge the warps: a warp that saw no key has max -inf and sum 0, so its weight is 0.
  if (lane == 0) {
    warp_max[warp] = running_max;
    warp_denominator[warp] = denominator;
  }
#pragma unroll
  for (int j = 0; j < PA_DIMS_PER_LANE; ++j) {
    const int d = lane + j * PA_WARP_SIZE;
    if (d < head_dim) warp_acc[warp][d] = acc[j];
  }
  __syncthreads();

  float block_max = PA_NEG_INF;
  for (int w = 0; w < num_warps; ++w) block_max = fmaxf(block_max, warp_max[w]);
  float warp_weight[PA_MAX_WARPS];
  float total = 0.0f;
  for (int w = 0; w < num_warps; ++w) {
    warp_weight[w] = expf(warp_max[w] - block_max);
    total += warp_denominator[w] * warp_weight[w];
  }
  T* out_row = out + query_offset;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float sum = 0.0f;
    for (int w = 0; w < num_warps; ++w) sum += warp_acc[w][d] * warp_weight[w];
    store_rn(out_row + d, sum / total);
  }
}

// One entry point per dtype; query, caches and out share it.
#define PAGED_ATTENTION_ENTRY(NAME, T)                                                            \
  extern "C" __global__ void __launch_bounds__(PA_WARP_SIZE * PA_MAX_WARPS)                        \
  NAME(T* out, const T* query, const T* key_cache, const T* value_cache, const int* block_tables,  \
       const int* context_lens, const int* query_start_loc, float scale, int num_seqs,             \
       int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks_per_seq,      \
       long long block_stride, long long row_stride, long long head_stride) {                      \
    paged_attention(out, query, key_cache, value_cache, block_tables, context_lens,                \
                    query_start_loc, scale, num_seqs, num_heads, num_kv_heads, head_dim,           \
                    block_size, max_blocks_per_seq, block_stride, row_stride, head_stride);        \
  }

PAGED_ATTENTION_ENTRY(paged_attention_f32, float)
PAGED_ATTENTION_ENTRY(paged_attention_f16, __half)
PAGED_ATTENTION_ENTRY(paged_attention_bf16, __nv_bfloat16)
