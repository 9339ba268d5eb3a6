// swap_blocks: move KV blocks between a GPU cache and a (pinned) CPU cache — swap
// preemption [Kwon 2025, §3.4.5]. Deliberately NOT a kernel: like vLLM's swap_blocks
// (csrc/cache_kernels.cu), it issues one cudaMemcpyAsync per block pair. Host<->device
// copies are the DMA copy engines' job; with a pinned host buffer they run asynchronously
// on the stream and overlap with compute. The cost model: one block of B tokens moves
// B * num_kv_heads * head_dim * dtype_bytes bytes per cache at PCIe bandwidth, plus a
// per-call overhead that dominates for small blocks [Kwon 2025, Fig. 3.19a].
// The zero-copy alternative (one Triton kernel reading pinned memory) is in
// 02_kvcache/triton_ops.py; benchmarks/bench_kvcache_swap.py compares them.
//
// No torch includes (nvcc compiles this on CPU-only machines); binding in swap_blocks_binding.cpp.
#include <cuda_runtime.h>

#include <cstdint>

// src/dst: base addresses of one cache each (device or host memory); block_mapping: HOST
// array [num_pairs, 2] of (src block, dst block). Returns a cudaError_t (0 = success).
int swap_blocks_launch(const char* src, char* dst, const int64_t* block_mapping, int64_t num_pairs,
                       int64_t bytes_per_block, bool src_on_device, bool dst_on_device, int64_t stream) {
  cudaMemcpyKind kind;
  if (src_on_device && dst_on_device) {
    kind = cudaMemcpyDeviceToDevice;
  } else if (src_on_device) {
    kind = cudaMemcpyDeviceToHost;
  } else if (dst_on_device) {
    kind = cudaMemcpyHostToDevice;
  } else {
    return static_cast<int>(cudaErrorInvalidValue);   // host to host: not this op's job
  }
  auto s = reinterpret_cast<cudaStream_t>(stream);
  for (int64_t i = 0; i < num_pairs; ++i) {
    const int64_t src_block = block_mapping[2 * i];
    const int64_t dst_block = block_mapping[2 * i + 1];
    const cudaError_t err = cudaMemcpyAsync(dst + dst_block * bytes_per_block, src + src_block * bytes_per_block,
                                            static_cast<size_t>(bytes_per_block), kind, s);
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  return 0;
}

const char* swap_blocks_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }
