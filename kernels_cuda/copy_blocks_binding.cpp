// Torch binding of copy_blocks.cu: checks the tensors, passes raw pointers and the stream.
// torch/extension.h only (no c10/cuda): the Python side passes the current stream as an int.
#include <torch/extension.h>

int copy_blocks_launch(const int64_t* src_ptrs, const int64_t* dst_ptrs, const int64_t* block_mapping,
                       int64_t num_caches, int64_t num_pairs, int64_t bytes_per_block, int64_t vec_bytes,
                       int64_t stream);
const char* copy_blocks_error_string(int err);

// src_ptrs / dst_ptrs: [num_caches] int64 base addresses on the GPU; block_mapping: [num_pairs, 2] int64.
void copy_blocks(torch::Tensor src_ptrs, torch::Tensor dst_ptrs, torch::Tensor block_mapping,
                 int64_t bytes_per_block, int64_t vec_bytes, int64_t stream) {
  for (const auto& t : {src_ptrs, dst_ptrs, block_mapping}) {
    TORCH_CHECK(t.is_cuda(), "copy_blocks: pointer tables and block_mapping must be on the GPU");
    TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.is_contiguous(), "copy_blocks: expected contiguous int64 tensors");
    TORCH_CHECK(t.device() == block_mapping.device(), "copy_blocks: all tensors must be on one GPU");
  }
  TORCH_CHECK(src_ptrs.dim() == 1 && src_ptrs.sizes() == dst_ptrs.sizes(), "copy_blocks: src/dst tables differ");
  TORCH_CHECK(block_mapping.dim() == 2 && block_mapping.size(1) == 2, "copy_blocks: block_mapping must be [num_pairs, 2]");
  TORCH_CHECK(vec_bytes == 1 || vec_bytes == 2 || vec_bytes == 4 || vec_bytes == 8 || vec_bytes == 16,
              "copy_blocks: vec_bytes must be 1, 2, 4, 8 or 16");
  TORCH_CHECK(bytes_per_block > 0 && bytes_per_block % vec_bytes == 0, "copy_blocks: vec_bytes must divide bytes_per_block");
  TORCH_CHECK(block_mapping.size(0) <= INT32_MAX && src_ptrs.size(0) <= 65535, "copy_blocks: launch grid too large");
  const int err = copy_blocks_launch(src_ptrs.data_ptr<int64_t>(), dst_ptrs.data_ptr<int64_t>(),
                                     block_mapping.data_ptr<int64_t>(), src_ptrs.size(0), block_mapping.size(0),
                                     bytes_per_block, vec_bytes, stream);
  TORCH_CHECK(err == 0, "copy_blocks: kernel launch failed: ", copy_blocks_error_string(err));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("copy_blocks", &copy_blocks, "Copy KV blocks (src, dst) in every cache of a pointer table");
}
