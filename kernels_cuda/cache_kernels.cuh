// Writing new K/V rows into the paged cache (device code).
//
// Mirrors vLLM's `reshape_and_cache_flash_kernel` (csrc/cache_kernels.cu): the cache
// layout is the "flash" one, [num_blocks, block_size, num_kv_heads, head_size], so one
// token's K (or V) for all its KV heads is num_kv_heads * head_size contiguous elements
// and the write is a plain strided copy to row `slot`.
#pragma once

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

}  // namespace vfs
