// fp8 (e4m3) codec for block-major KV: [num_blocks, num_layers, 2, block_size, heads, dim].
//
// A "group" is the K (or V) of one block in one layer: group_numel = block_size * heads * dim
// consecutive elements, num_groups = num_blocks * num_layers * 2, one float32 scale each.
//   amax  = max |x| over the group (exact: a max of exactly converted values)
//   scale = amax / 448 if amax > 0 else 1        IEEE fp32 division, round to nearest even
//   q     = e4m3(x / scale)                      IEEE fp32 division, then RNE, satfinite
//   y     = out_dtype(float(q) * scale)          IEEE fp32 product, then RNE to the dtype
// Every step is one correctly rounded IEEE operation (the __f*_rn intrinsics are never
// contracted or approximated, whatever the flags), so kvtierd/fp8_codec.py's torch reference
// reproduces the bytes exactly for finite inputs. Non-finite inputs: NaN codes may differ in
// their sign bit (CUDA writes 0x7f, torch keeps the sign).
//
// Launch: quantize with one CUDA block per group (grid-stride over groups) and blockDim.x a
// multiple of 32, at most 1024; dequantize with any 1-D launch (grid-stride over elements).

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#define KV_FP8_E4M3_MAX 448.0f

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

__device__ __forceinline__ void store_rn(__half* out, float y) { *out = __float2half_rn(y); }
__device__ __forceinline__ void store_rn(__nv_bfloat16* out, float y) { *out = __float2bfloat16_rn(y); }
__device__ __forceinline__ void store_rn(float* out, float y) { *out = y; }

// The max of `value` over the CUDA block, returned to every thread.
__device__ float block_max(float value) {
  __shared__ float warp_max[32];
  __shared__ float result;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  for (int offset = 16; offset > 0; offset >>= 1) {
    value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  if (lane == 0) warp_max[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < (int)(blockDim.x >> 5) ? warp_max[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) {
      value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
    }
    if (lane == 0) result = value;
  }
  __syncthreads();
  return result;  // every thread reads before anyone passes the next call's first barrier
}

template <typename T>
__device__ void quantize(const T* __restrict__ blocks, unsigned char* __restrict__ payload,
                         float* __restrict__ scales, long long num_groups, long long group_numel) {
  for (long long group = blockIdx.x; group < num_groups; group += gridDim.x) {
    const T* x = blocks + group * group_numel;
    unsigned char* q = payload + group * group_numel;
    float amax = 0.0f;
    for (long long i = threadIdx.x; i < group_numel; i += blockDim.x) {
      amax = fmaxf(amax, fabsf(to_float(x[i])));
    }
    amax = block_max(amax);
    const float scale = amax > 0.0f ? __fdiv_rn(amax, KV_FP8_E4M3_MAX) : 1.0f;
    if (threadIdx.x == 0) scales[group] = scale;
    for (long long i = threadIdx.x; i < group_numel; i += blockDim.x) {
      q[i] = (unsigned char)__nv_cvt_float_to_fp8(__fdiv_rn(to_float(x[i]), scale),
                                                  __NV_SATFINITE, __NV_E4M3);
    }
  }
}

template <typename T>
__device__ void dequantize(const unsigned char* __restrict__ payload,
                           const float* __restrict__ scales, T* __restrict__ out,
                           long long num_elements, long long group_numel) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < num_elements; i += stride) {
    __half_raw half_bits = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)payload[i], __NV_E4M3);
    const float value = __half2float(__half(half_bits));  // e4m3 -> fp16 -> fp32: both exact
    store_rn(out + i, __fmul_rn(value, scales[i / group_numel]));
  }
}

extern "C" __global__ void fp8_quantize_f16(const __half* blocks, unsigned char* payload,
                                            float* scales, long long num_groups,
                                            long long group_numel) {
  quantize(blocks, payload, scales, num_groups, group_numel);
}

extern "C" __global__ void fp8_quantize_bf16(const __nv_bfloat16* blocks, unsigned char* payload,
                                             float* scales, long long num_groups,
                                             long long group_numel) {
  quantize(blocks, payload, scales, num_groups, group_numel);
}

extern "C" __global__ void fp8_quantize_f32(const float* blocks, unsigned char* payload,
                                            float* scales, long long num_groups,
                                            long long group_numel) {
  quantize(blocks, payload, scales, num_groups, group_numel);
}

extern "C" __global__ void fp8_dequantize_f16(const unsigned char* payload, const float* scales,
                                              __half* out, long long num_elements,
                                              long long group_numel) {
  dequantize(payload, scales, out, num_elements, group_numel);
}

extern "C" __global__ void fp8_dequantize_bf16(const unsigned char* payload, const float* scales,
                                               __nv_bfloat16* out, long long num_elements,
                                               long long group_numel) {
  dequantize(payload, scales, out, num_elements, group_numel);
}

extern "C" __global__ void fp8_dequantize_f32(const unsigned char* payload, const float* scales,
                                              float* out, long long num_elements,
                                              long long group_numel) {
  dequantize(payload, scales, out, num_elements, group_numel);
}
