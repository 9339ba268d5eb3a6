// Host launcher for reshape_and_cache (see cache_kernels.cuh for the kernel).
//
// Takes raw pointers, sizes, strides (in elements) and the CUDA stream as an int64, so this
// file needs no torch headers: CI compiles it with `nvcc -cubin` on CPU-only machines, and
// cache_kernels_binding.cpp is the only part that knows about torch tensors.
#include <algorithm>

#include <cuda_runtime.h>

#include "cache_kernels.cuh"
#include "launch.cuh"

namespace vfs {

template <typename scalar_t, typename slot_t>
static int launch_reshape_and_cache(const void* key, const void* value, void* key_cache, void* value_cache,
                                    const void* slot_mapping, int64_t num_tokens, int block_size,
                                    int num_kv_heads, int head_size, const int64_t* strides, cudaStream_t stream) {
  if (num_tokens == 0) return 0;
  const dim3 grid(static_cast<unsigned>(num_tokens));
  const dim3 block(std::min(num_kv_heads * head_size, 512));
  const auto kernel = reshape_and_cache_kernel<scalar_t, slot_t>;
  VFS_LAUNCH(kernel, grid, block, 0, stream)(
      static_cast<const scalar_t*>(key), static_cast<const scalar_t*>(value),
      static_cast<scalar_t*>(key_cache), static_cast<scalar_t*>(value_cache),
      static_cast<const slot_t*>(slot_mapping), block_size, num_kv_heads, head_size,
      strides[0], strides[1], strides[2], strides[3],
      strides[4], strides[5], strides[6], strides[7], strides[8], strides[9]);
  return static_cast<int>(cudaGetLastError());
}

template <typename scalar_t>
static int dispatch_slot_type(bool slot_is_int64, const void* key, const void* value, void* key_cache,
                              void* value_cache, const void* slot_mapping, int64_t num_tokens, int block_size,
                              int num_kv_heads, int head_size, const int64_t* strides, cudaStream_t stream) {
  return slot_is_int64
      ? launch_reshape_and_cache<scalar_t, int64_t>(key, value, key_cache, value_cache, slot_mapping, num_tokens,
                                                    block_size, num_kv_heads, head_size, strides, stream)
      : launch_reshape_and_cache<scalar_t, int32_t>(key, value, key_cache, value_cache, slot_mapping, num_tokens,
                                                    block_size, num_kv_heads, head_size, strides, stream);
}

template <typename scalar_t, typename cache_t, typename slot_t>
static int launch_quant(const void* key, const void* value, void* key_cache, void* value_cache,
                        const void* slot_mapping, int64_t num_tokens, int block_size, int num_kv_heads,
                        int head_size, bool per_row, float k_scale, float v_scale, const int64_t* strides,
                        cudaStream_t stream) {
  if (num_tokens == 0) return 0;
  const dim3 grid(static_cast<unsigned>(num_tokens), static_cast<unsigned>(num_kv_heads));
  const auto kernel = reshape_and_cache_quant_kernel<scalar_t, cache_t, slot_t>;
  VFS_LAUNCH(kernel, grid, dim3(WARP_SIZE), 0, stream)(
      static_cast<const scalar_t*>(key), static_cast<const scalar_t*>(value), static_cast<cache_t*>(key_cache),
      static_cast<cache_t*>(value_cache), static_cast<const slot_t*>(slot_mapping), block_size, head_size, per_row,
      k_scale, v_scale, strides[0], strides[1], strides[2], strides[3], strides[4], strides[5], strides[6],
      strides[7], strides[8], strides[9]);
  return static_cast<int>(cudaGetLastError());
}

template <typename scalar_t, typename cache_t>
static int quant_slot_type(bool slot_is_int64, const void* key, const void* value, void* key_cache,
                           void* value_cache, const void* slot_mapping, int64_t num_tokens, int block_size,
                           int num_kv_heads, int head_size, bool per_row, float k_scale, float v_scale,
                           const int64_t* strides, cudaStream_t stream) {
  return slot_is_int64
      ? launch_quant<scalar_t, cache_t, int64_t>(key, value, key_cache, value_cache, slot_mapping, num_tokens,
                                                 block_size, num_kv_heads, head_size, per_row, k_scale, v_scale,
                                                 strides, stream)
      : launch_quant<scalar_t, cache_t, int32_t>(key, value, key_cache, value_cache, slot_mapping, num_tokens,
                                                 block_size, num_kv_heads, head_size, per_row, k_scale, v_scale,
                                                 strides, stream);
}

template <typename scalar_t>
static int quant_cache_type(int cache_kind, bool slot_is_int64, const void* key, const void* value, void* key_cache,
                            void* value_cache, const void* slot_mapping, int64_t num_tokens, int block_size,
                            int num_kv_heads, int head_size, bool per_row, float k_scale, float v_scale,
                            const int64_t* strides, cudaStream_t stream) {
  if (cache_kind == kKVCacheInt8)
    return quant_slot_type<scalar_t, int8_t>(slot_is_int64, key, value, key_cache, value_cache, slot_mapping,
                                             num_tokens, block_size, num_kv_heads, head_size, per_row, k_scale,
                                             v_scale, strides, stream);
  if (cache_kind == kKVCacheFp8)
    return quant_slot_type<scalar_t, uint8_t>(slot_is_int64, key, value, key_cache, value_cache, slot_mapping,
                                              num_tokens, block_size, num_kv_heads, head_size, per_row, k_scale,
                                              v_scale, strides, stream);
  return kUnsupportedConfig;
}

}  // namespace vfs

// An 8-bit cache (paged_attention/kv_quant.py): cache_kind a KVCacheKind, int8 or fp8 e4m3fn (stored as bytes);
// per_row: each row's fp32 scale after its head_size bytes (else k_scale / v_scale). Strides as below,
// the caches' in bytes.
int vfs_reshape_and_cache_quant(int dtype, bool slot_is_int64, int cache_kind, bool per_row, const void* key,
                                const void* value, void* key_cache, void* value_cache, const void* slot_mapping,
                                int64_t num_tokens, int block_size, int num_kv_heads, int head_size, float k_scale,
                                float v_scale, const int64_t* strides, int64_t stream) {
  auto s = reinterpret_cast<cudaStream_t>(stream);
  switch (dtype) {
    case vfs::kFloat32:
      return vfs::quant_cache_type<float>(cache_kind, slot_is_int64, key, value, key_cache, value_cache, slot_mapping,
                                          num_tokens, block_size, num_kv_heads, head_size, per_row, k_scale, v_scale,
                                          strides, s);
    case vfs::kFloat16:
      return vfs::quant_cache_type<__half>(cache_kind, slot_is_int64, key, value, key_cache, value_cache,
                                           slot_mapping, num_tokens, block_size, num_kv_heads, head_size, per_row,
                                           k_scale, v_scale, strides, s);
    case vfs::kBFloat16:
      return vfs::quant_cache_type<__nv_bfloat16>(cache_kind, slot_is_int64, key, value, key_cache, value_cache,
                                                  slot_mapping, num_tokens, block_size, num_kv_heads, head_size,
                                                  per_row, k_scale, v_scale, strides, s);
    default:
      return vfs::kUnsupportedConfig;
  }
}

// strides (elements), in this order: key token, key head, value token, value head,
// key_cache block, token, head, value_cache block, token, head. The last dim of every
// tensor is contiguous (the binding checks).
int vfs_reshape_and_cache(int dtype, bool slot_is_int64, const void* key, const void* value, void* key_cache,
                          void* value_cache, const void* slot_mapping, int64_t num_tokens, int block_size,
                          int num_kv_heads, int head_size, const int64_t* strides, int64_t stream) {
  auto s = reinterpret_cast<cudaStream_t>(stream);
  switch (dtype) {
    case vfs::kFloat32:
      return vfs::dispatch_slot_type<float>(slot_is_int64, key, value, key_cache, value_cache, slot_mapping,
                                            num_tokens, block_size, num_kv_heads, head_size, strides, s);
    case vfs::kFloat16:
      return vfs::dispatch_slot_type<__half>(slot_is_int64, key, value, key_cache, value_cache, slot_mapping,
                                             num_tokens, block_size, num_kv_heads, head_size, strides, s);
    case vfs::kBFloat16:
      return vfs::dispatch_slot_type<__nv_bfloat16>(slot_is_int64, key, value, key_cache, value_cache, slot_mapping,
                                                    num_tokens, block_size, num_kv_heads, head_size, strides, s);
    default:
      return vfs::kUnsupportedConfig;
  }
}

const char* vfs_cache_kernels_error_string(int code) {
  return code == vfs::kUnsupportedConfig ? "unsupported dtype" : cudaGetErrorString(static_cast<cudaError_t>(code));
}
