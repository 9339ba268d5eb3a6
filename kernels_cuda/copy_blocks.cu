// copy_blocks: copy whole KV blocks (src -> dst) in every layer's key and value cache,
// all layers and all pairs in ONE launch. Used by copy-on-write ([Kwon 2025, §3.4.4]; [Kwon 2025, §3.5.1]
// "fused block copy"): many small, scattered copies, which as separate cudaMemcpyAsync
// calls would each pay a launch. Mirrors vLLM's copy_blocks_kernel (csrc/cache_kernels.cu).
//
// The caches are separate tensors, so the kernel gets a table of their base addresses
// (int64, on the device) and casts each back to a pointer. Blocks are moved as opaque
// words (uint4 = 16 bytes when the block size and every base address allow it): a copy
// does not care what the bits mean, so one kernel serves every dtype.
//
// No torch includes: nvcc compiles this file on CPU-only machines (the compile test);
// the torch binding lives in copy_blocks_binding.cpp and is built on a GPU machine.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "launch.cuh"

namespace vfs {

// grid = (num_pairs, num_caches); each CUDA block copies one block of one cache.
template <typename Word>
__global__ void copy_blocks_kernel(const int64_t* __restrict__ src_ptrs,   // [num_caches] base addresses
                                   const int64_t* __restrict__ dst_ptrs,   // [num_caches] base addresses
                                   const int64_t* __restrict__ block_mapping,  // [num_pairs, 2] (src, dst)
                                   int64_t words_per_block) {
  const int64_t pair = blockIdx.x;
  const int cache = blockIdx.y;
  // ### BEGIN SOLUTION
  const int64_t src_block = block_mapping[2 * pair];
  const int64_t dst_block = block_mapping[2 * pair + 1];
  const Word* src = reinterpret_cast<const Word*>(src_ptrs[cache]) + src_block * words_per_block;
  Word* dst = reinterpret_cast<Word*>(dst_ptrs[cache]) + dst_block * words_per_block;
  // Consecutive threads touch consecutive words: fully coalesced reads and writes.
  for (int64_t i = threadIdx.x; i < words_per_block; i += blockDim.x) {
    dst[i] = src[i];
  }
  // ### END SOLUTION
}

template <typename Word>
cudaError_t launch(const int64_t* src_ptrs, const int64_t* dst_ptrs, const int64_t* block_mapping,
                   int64_t num_caches, int64_t num_pairs, int64_t words_per_block, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(num_pairs), static_cast<unsigned>(num_caches));
  const dim3 block(static_cast<unsigned>(std::min<int64_t>(1024, words_per_block)));
  const auto kernel = copy_blocks_kernel<Word>;
  VFS_LAUNCH(kernel, grid, block, 0, stream)(src_ptrs, dst_ptrs, block_mapping, words_per_block);
  return cudaGetLastError();
}

}  // namespace vfs

// Host launcher. All pointers are device pointers. vec_bytes in {16, 8, 4, 2, 1} must divide
// bytes_per_block and every base address (the caller picks the widest that does).
// Returns a cudaError_t (0 = success).
int copy_blocks_launch(const int64_t* src_ptrs, const int64_t* dst_ptrs, const int64_t* block_mapping,
                       int64_t num_caches, int64_t num_pairs, int64_t bytes_per_block, int64_t vec_bytes,
                       int64_t stream) {
  if (num_pairs == 0) return 0;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const int64_t words = bytes_per_block / vec_bytes;
  switch (vec_bytes) {
    case 16: return vfs::launch<uint4>(src_ptrs, dst_ptrs, block_mapping, num_caches, num_pairs, words, s);
    case 8: return vfs::launch<uint2>(src_ptrs, dst_ptrs, block_mapping, num_caches, num_pairs, words, s);
    case 4: return vfs::launch<uint32_t>(src_ptrs, dst_ptrs, block_mapping, num_caches, num_pairs, words, s);
    case 2: return vfs::launch<uint16_t>(src_ptrs, dst_ptrs, block_mapping, num_caches, num_pairs, words, s);
    case 1: return vfs::launch<uint8_t>(src_ptrs, dst_ptrs, block_mapping, num_caches, num_pairs, words, s);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

const char* copy_blocks_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }
