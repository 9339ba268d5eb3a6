// Writing new K/V rows into the paged cache (device code).
//
// Mirrors vLLM's `reshape_and_cache_flash_kernel` (csrc/cache_kernels.cu): the cache
// layout is the "flash" one, [num_blocks, block_size, num_kv_heads, head_size], so one
// token's K (or V) for all its KV heads is num_kv_heads * head_size contiguous elements
// and the write is a plain strided copy to row `slot`.
#pragma once

#include <type_traits>

#include "paged_attention_common.cuh"

namespace vfs {

// Grid: one thread block per new token. Block: up to 512 threads striding over the
// token's num_kv_heads * head_size elements, so consecutive threads touch consecutive
// addresses on both the read and the write side (coalesced).
template <typename scalar_t, typename slot_t>
__global__ void reshape_and_cache_kernel(
    const scalar_t* __restrict__ key,      // [num_tokens, num_kv_heads, head_size] (strided)
    const scalar_t* __restrict__ value,    // [num_tokens, num_kv_heads, head_size] (strided)
    scalar_t* __restrict__ key_cache,      // [num_blocks, block_size, num_kv_heads, head_size] (strided)
    scalar_t* __restrict__ value_cache,    // same shape as key_cache
    const slot_t* __restrict__ slot_mapping,  // [num_tokens], -1 = skip
    const int block_size, const int num_kv_heads, const int head_size,
    const int64_t key_token_stride, const int64_t key_head_stride,
    const int64_t value_token_stride, const int64_t value_head_stride,
    const int64_t k_cache_block_stride, const int64_t k_cache_token_stride, const int64_t k_cache_head_stride,
    const int64_t v_cache_block_stride, const int64_t v_cache_token_stride, const int64_t v_cache_head_stride) {
  const int64_t token_idx = blockIdx.x;
  // ### BEGIN SOLUTION
  const int64_t slot = static_cast<int64_t>(slot_mapping[token_idx]);
  if (slot < 0) return;  // padding token (e.g. a CUDA-graph batch padded to a captured size)
  const int64_t block_idx = slot / block_size;
  const int64_t block_offset = slot % block_size;

  const scalar_t* k_src = key + token_idx * key_token_stride;
  const scalar_t* v_src = value + token_idx * value_token_stride;
  scalar_t* k_dst = key_cache + block_idx * k_cache_block_stride + block_offset * k_cache_token_stride;
  scalar_t* v_dst = value_cache + block_idx * v_cache_block_stride + block_offset * v_cache_token_stride;

  const int n = num_kv_heads * head_size;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int head = i / head_size;
    const int d = i % head_size;
    k_dst[head * k_cache_head_stride + d] = k_src[head * key_head_stride + d];
    v_dst[head * v_cache_head_stride + d] = v_src[head * value_head_stride + d];
  }
  // ### END SOLUTION
}

// ------------------------------------------------------------------------- an 8-bit cache

// fp32 -> fp8 e4m3fn byte, rounding to nearest even as torch's cast (|x| <= 448: the caller clamps).
// Integer arithmetic, so the emulator and every GPU give the same bytes (kernels_cpu and the Triton
// kernel do the same; paged_attention/kv_quant.py is the reference).
__device__ __forceinline__ uint8_t fp8e4m3_from_float(float x) {
  const unsigned bits = __float_as_uint(x);
  const unsigned sign = (bits >> 24) & 0x80u;
  const float a = fabsf(x);
  if (a < 0.015625f) {                                  // below 2^-6: subnormal steps of 2^-9
    const float steps = (a * 512.0f + 8388608.0f) - 8388608.0f;   // rounds to an integer, ties to even
    return static_cast<uint8_t>(sign | static_cast<unsigned>(steps));
  }
  unsigned b = bits & 0x7FFFFFFFu;
  b += 0x7FFFFu + ((b >> 20) & 1u);                     // 23 mantissa bits -> 3, ties to even
  return static_cast<uint8_t>(sign | (((b >> 23) - 120u) << 3) | ((b >> 20) & 7u));
}

// One K or V row of one (token, head) -> its cache row, by one warp: the absmax over the row
// (warp_max), the scale (per row, stored after the row as an fp32; or the layer's), then each
// lane quantizes its elements. cache_t: int8_t, or uint8_t holding fp8 e4m3fn bytes.
template <typename scalar_t, typename cache_t>
__device__ void quantize_row(const scalar_t* __restrict__ src, cache_t* __restrict__ dst, const int head_size,
                             const bool per_row, const float tensor_scale) {
  constexpr bool kInt8 = std::is_same<cache_t, int8_t>::value;
  constexpr float kQMax = kInt8 ? 127.0f : 448.0f;
  float scale = tensor_scale;
  if (per_row) {
    float amax = 0.0f;
    for (int d = threadIdx.x; d < head_size; d += WARP_SIZE) amax = fmaxf(amax, fabsf(to_float(src[d])));
    scale = fmaxf(warp_max(amax) / kQMax, 1e-6f);
    if (threadIdx.x == 0) *reinterpret_cast<float*>(dst + head_size) = scale;
  }
  const float inv = 1.0f / scale;
  for (int d = threadIdx.x; d < head_size; d += WARP_SIZE) {
    const float y = to_float(src[d]) * inv;
    if constexpr (kInt8) {
      dst[d] = static_cast<int8_t>(fminf(fmaxf(y >= 0.0f ? y + 0.5f : y - 0.5f, -128.0f), 127.0f));
    } else {
      dst[d] = fp8e4m3_from_float(fminf(fmaxf(y, -448.0f), 448.0f));
    }
  }
}

// Grid: (num_tokens, num_kv_heads); block: one warp. vLLM: the per-token-head path of
// triton_reshape_and_cache_flash (one program per (token, head)) and reshape_and_cache_flash's
// fp8 path (per-tensor scale).
template <typename scalar_t, typename cache_t, typename slot_t>
__global__ void reshape_and_cache_quant_kernel(
    const scalar_t* __restrict__ key, const scalar_t* __restrict__ value,
    cache_t* __restrict__ key_cache, cache_t* __restrict__ value_cache,   // rows of head_size (+ 4) bytes
    const slot_t* __restrict__ slot_mapping, const int block_size, const int head_size, const bool per_row,
    const float k_scale, const float v_scale,
    const int64_t key_token_stride, const int64_t key_head_stride,
    const int64_t value_token_stride, const int64_t value_head_stride,
    const int64_t k_cache_block_stride, const int64_t k_cache_token_stride, const int64_t k_cache_head_stride,
    const int64_t v_cache_block_stride, const int64_t v_cache_token_stride, const int64_t v_cache_head_stride) {
  const int64_t token = blockIdx.x, head = blockIdx.y;
  const int64_t slot = static_cast<int64_t>(slot_mapping[token]);
  if (slot < 0) return;
  const int64_t block_idx = slot / block_size, block_offset = slot % block_size;
  quantize_row(key + token * key_token_stride + head * key_head_stride,
               key_cache + block_idx * k_cache_block_stride + block_offset * k_cache_token_stride +
                   head * k_cache_head_stride,
               head_size, per_row, k_scale);
  quantize_row(value + token * value_token_stride + head * value_head_stride,
               value_cache + block_idx * v_cache_block_stride + block_offset * v_cache_token_stride +
                   head * v_cache_head_stride,
               head_size, per_row, v_scale);
}

}  // namespace vfs
