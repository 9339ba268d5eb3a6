// Torch binding of swap_blocks.cu: checks the tensors (bounds included — the mapping is on
// the host, so checking it is free), passes raw pointers and the stream.
#include <torch/extension.h>

int swap_blocks_launch(const char* src, char* dst, const int64_t* block_mapping, int64_t num_pairs,
                       int64_t bytes_per_block, bool src_on_device, bool dst_on_device, int64_t stream);
const char* swap_blocks_error_string(int err);

// src: [num_src_blocks, ...], dst: [num_dst_blocks, ...] (same block shape and dtype; one of
// them on the GPU); block_mapping: CPU int64 [num_pairs, 2].
void swap_blocks(torch::Tensor src, torch::Tensor dst, torch::Tensor block_mapping, int64_t stream) {
  TORCH_CHECK(src.is_cuda() || dst.is_cuda(), "swap_blocks: one side must be on the GPU");
  TORCH_CHECK(src.is_contiguous() && dst.is_contiguous(), "swap_blocks: caches must be contiguous");
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), "swap_blocks: dtype mismatch");
  TORCH_CHECK(src.dim() >= 1 && dst.dim() == src.dim() && src.sizes().slice(1) == dst.sizes().slice(1),
              "swap_blocks: block shapes differ");
  TORCH_CHECK(block_mapping.device().is_cpu() && block_mapping.scalar_type() == torch::kInt64 &&
                  block_mapping.is_contiguous() && block_mapping.dim() == 2 && block_mapping.size(1) == 2,
              "swap_blocks: block_mapping must be a contiguous CPU int64 tensor [num_pairs, 2]");
  const int64_t* mapping = block_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < block_mapping.size(0); ++i) {
    TORCH_CHECK(mapping[2 * i] >= 0 && mapping[2 * i] < src.size(0), "swap_blocks: source block out of range");
    TORCH_CHECK(mapping[2 * i + 1] >= 0 && mapping[2 * i + 1] < dst.size(0), "swap_blocks: destination block out of range");
  }
  const int64_t bytes_per_block = src.stride(0) * src.element_size();
  const int err = swap_blocks_launch(static_cast<const char*>(src.data_ptr()), static_cast<char*>(dst.data_ptr()),
                                     mapping, block_mapping.size(0), bytes_per_block, src.is_cuda(), dst.is_cuda(),
                                     stream);
  TORCH_CHECK(err == 0, "swap_blocks: cudaMemcpyAsync failed: ", swap_blocks_error_string(err));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("swap_blocks", &swap_blocks, "Copy KV blocks between a GPU cache and a CPU cache (cudaMemcpyAsync per pair)");
}
