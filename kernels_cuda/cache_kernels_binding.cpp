// torch binding for cache_kernels.cu: checks tensors, then hands raw pointers, sizes,
// strides and the stream (as an int) to the launcher. No c10/cuda includes, so the only
// CUDA-aware code is in the .cu file. Built on demand by `kernels_cuda.load("cache_kernels")`.
#include <torch/extension.h>

#include <array>

int vfs_reshape_and_cache(int dtype, bool slot_is_int64, const void* key, const void* value, void* key_cache,
                          void* value_cache, const void* slot_mapping, int64_t num_tokens, int block_size,
                          int num_kv_heads, int head_size, const int64_t* strides, int64_t stream);
int vfs_reshape_and_cache_quant(int dtype, bool slot_is_int64, int cache_kind, bool per_row, const void* key,
                                const void* value, void* key_cache, void* value_cache, const void* slot_mapping,
                                int64_t num_tokens, int block_size, int num_kv_heads, int head_size, float k_scale,
                                float v_scale, const int64_t* strides, int64_t stream);
const char* vfs_cache_kernels_error_string(int code);

namespace {

int dtype_code(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return 0;
    case torch::kFloat16: return 1;
    case torch::kBFloat16: return 2;
    default: TORCH_CHECK(false, "reshape_and_cache (cuda): unsupported dtype ", t.scalar_type(), " (float32, float16, bfloat16)");
  }
  return -1;
}

// key, value:             [num_tokens, num_kv_heads, head_size]   (any strides, last dim contiguous)
// key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size]
// slot_mapping:           [num_tokens] int32/int64, -1 = skip
// Range checks on slot_mapping (a device->host read) live on the Python side so they can
// be skipped on the hot path; shapes, dtypes and devices are checked here, always.
// What both cache writes check (a cache row holds head_size + `row_extra` elements: an 8-bit
// cache's inline scale), and the launchers' strides, in their order.
std::array<int64_t, 10> checked_strides(const torch::Tensor& key, const torch::Tensor& value,
                                        const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                                        const torch::Tensor& slot_mapping, int64_t row_extra) {
  TORCH_CHECK(key.is_cuda() && value.is_cuda() && key_cache.is_cuda() && value_cache.is_cuda() && slot_mapping.is_cuda(),
              "reshape_and_cache (cuda): all tensors must be on the GPU");
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes(), "key/value must be [num_tokens, num_kv_heads, head_size]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "key_cache/value_cache must be [num_blocks, block_size, num_kv_heads, head_size]");
  TORCH_CHECK(key.size(1) == key_cache.size(2) && key.size(2) + row_extra == key_cache.size(3),
              "key rows [num_kv_heads, head_size] do not match the cache's");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0), "slot_mapping must be [num_tokens]");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 || slot_mapping.scalar_type() == torch::kInt32,
              "slot_mapping must be int32 or int64");
  TORCH_CHECK(slot_mapping.is_contiguous(), "slot_mapping must be contiguous");
  for (const auto* t : {&key, &value, &key_cache, &value_cache}) {
    TORCH_CHECK(t->stride(-1) == 1, "reshape_and_cache (cuda): the head_size dim must be contiguous");
  }
  return {key.stride(0),       key.stride(1),       value.stride(0),       value.stride(1),
          key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
          value_cache.stride(0), value_cache.stride(1), value_cache.stride(2)};
}

void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache, torch::Tensor value_cache,
                       torch::Tensor slot_mapping, int64_t stream) {
  const auto strides = checked_strides(key, value, key_cache, value_cache, slot_mapping, 0);
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == key_cache.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "reshape_and_cache (cuda): key, value and both caches must share one dtype");
  const int rc = vfs_reshape_and_cache(
      dtype_code(key), slot_mapping.scalar_type() == torch::kInt64, key.data_ptr(), value.data_ptr(),
      key_cache.data_ptr(), value_cache.data_ptr(), slot_mapping.data_ptr(), key.size(0),
      static_cast<int>(key_cache.size(1)), static_cast<int>(key_cache.size(2)), static_cast<int>(key_cache.size(3)),
      strides.data(), stream);
  TORCH_CHECK(rc == 0, "reshape_and_cache (cuda) launch failed: ", vfs_cache_kernels_error_string(rc));
}

// An 8-bit cache (paged_attention/kv_quant.py; the Python wrapper checked the shapes): int8 or fp8 caches,
// rows of head_size bytes (+ 4 for the per-row fp32 scale).
void reshape_and_cache_quant(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache, torch::Tensor value_cache,
                             torch::Tensor slot_mapping, bool per_row, double k_scale, double v_scale, int64_t stream) {
  const auto strides = checked_strides(key, value, key_cache, value_cache, slot_mapping, per_row ? 4 : 0);
  const auto kind = key_cache.scalar_type();
  TORCH_CHECK(value_cache.scalar_type() == kind && (kind == torch::kInt8 || kind == torch::kFloat8_e4m3fn),
              "reshape_and_cache (cuda): an 8-bit cache is int8 or float8_e4m3fn");
  TORCH_CHECK(value.scalar_type() == key.scalar_type(), "reshape_and_cache (cuda): key and value must share one dtype");
  const int rc = vfs_reshape_and_cache_quant(
      dtype_code(key), slot_mapping.scalar_type() == torch::kInt64, kind == torch::kInt8 ? 1 : 2, per_row,
      key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), slot_mapping.data_ptr(),
      key.size(0), static_cast<int>(key_cache.size(1)), static_cast<int>(key.size(1)), static_cast<int>(key.size(2)),
      static_cast<float>(k_scale), static_cast<float>(v_scale), strides.data(), stream);
  TORCH_CHECK(rc == 0, "reshape_and_cache (cuda) launch failed: ", vfs_cache_kernels_error_string(rc));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("reshape_and_cache", &reshape_and_cache,
        "Scatter new K/V rows into the paged cache by slot mapping (-1 = skip)");
  m.def("reshape_and_cache_quant", &reshape_and_cache_quant,
        "Quantize new K/V rows into an 8-bit paged cache by slot mapping (-1 = skip)");
}
