// Host launcher for the rejection sampler (see rejection_sampler.cuh for the kernel).
//
// Raw pointers, sizes and the CUDA stream as an int64: no torch headers, so CI compiles this
// file with `nvcc -cubin` on CPU-only machines; rejection_sampler_binding.cpp knows tensors.
#include <cuda_runtime.h>

#include "launch.cuh"
#include "rejection_sampler.cuh"

namespace {
constexpr int kNumThreads = 256;   // 8 warps per request: a 50k-150k vocab pass in ~200-600 loads per thread
}

// Nullable: draft_probs (n-gram / greedy drafters), target_probs (all greedy),
// target_argmax and is_greedy (no greedy request). Returns 0 or a cudaError_t.
int vfs_rejection_sample(int32_t* out, const int32_t* cu_num_draft, const int32_t* draft_ids, const float* draft_probs,
                         const float* target_probs, const int32_t* target_argmax, const int32_t* bonus_ids,
                         const int8_t* is_greedy, const float* uniform, const float* inv_exp, int batch, int vocab,
                         int out_stride, int64_t stream) {
  if (batch == 0) return 0;
  const auto kernel = vfs::rejection_sample_kernel<kNumThreads>;
  VFS_LAUNCH(kernel, batch, kNumThreads, 0, reinterpret_cast<cudaStream_t>(stream))(
      out, cu_num_draft, draft_ids, draft_probs, target_probs, target_argmax, bonus_ids, is_greedy, uniform, inv_exp,
      vocab, out_stride);
  return static_cast<int>(cudaGetLastError());
}

const char* vfs_rejection_sampler_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
