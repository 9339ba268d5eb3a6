// Run the CUDA kernels of kernels_cuda/ on the CPU, thread by thread — a test harness.
//
// Why: CI machines have nvcc but no GPU, so `nvcc -cubin` proves the kernels compile but
// not that they compute the right thing. This file compiles the very same device code
// (kernels_cuda/paged_attention.cuh, cache_kernels.cuh) with g++ and executes it with one
// std::thread per CUDA thread:
//   * __syncthreads()            -> a std::barrier over the thread block;
//   * __shfl_xor_sync/__shfl_sync -> an exchange through a per-warp buffer between two
//                                    barriers over the warp (so all 32 lanes must take part,
//                                    as the full 0xffffffff mask promises on a GPU);
//   * __shared__ arrays          -> function-local statics (one thread block runs at a time,
//                                    so "shared by the block" == "shared by the process");
//   * dynamic shared memory      -> a host buffer of the launch's size.
// Thread blocks run one after another. What this cannot catch: memory-ordering or
// timing bugs specific to real hardware, and anything in the .cu launchers (grid sizes are
// re-derived here the same way). It does catch indexing, masking, reduction and
// synchronisation-logic errors, which is what a GPU-less CI can check.
//
// Built by test_cuda_kernels_emulated.py with:
//   g++ -std=c++20 -O1 -shared -fPIC -pthread -I kernels_cuda -I <cuda>/include emulate.cpp
#include <algorithm>
#include <barrier>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

// ---- the CUDA execution model, on host threads
namespace emu {
thread_local dim3 thread_idx, block_idx;
dim3 block_dim, grid_dim;
std::unique_ptr<std::barrier<>> block_barrier;
std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
float warp_buffers[32][32];  // [warp][lane]
std::vector<float> dynamic_smem;

inline void syncthreads() { block_barrier->arrive_and_wait(); }

template <typename F>
float warp_exchange(float value, F src_lane_of) {
  const unsigned warp = thread_idx.x / 32, lane = thread_idx.x % 32;
  warp_buffers[warp][lane] = value;
  warp_barriers[warp]->arrive_and_wait();
  const float got = warp_buffers[warp][src_lane_of(lane)];
  warp_barriers[warp]->arrive_and_wait();
  return got;
}

// Run `kernel()` as a grid of thread blocks; blockIdx/threadIdx are thread-locals.
inline void launch(dim3 grid, dim3 block, size_t smem_bytes, const std::function<void()>& kernel) {
  grid_dim = grid;
  block_dim = block;
  dynamic_smem.assign(smem_bytes / sizeof(float) + 1, std::nanf(""));  // NaN: reading before writing shows
  const unsigned n = block.x;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        block_barrier = std::make_unique<std::barrier<>>(n);
        warp_barriers.clear();
        for (unsigned w = 0; w < (n + 31) / 32; ++w) warp_barriers.push_back(std::make_unique<std::barrier<>>(std::min(32u, n - 32 * w)));
        std::vector<std::thread> threads;
        threads.reserve(n);
        for (unsigned t = 0; t < n; ++t) {
          threads.emplace_back([&, t, x, y, z] {
            thread_idx = dim3(t, 0, 0);
            block_idx = dim3(x, y, z);
            kernel();
          });
        }
        for (auto& th : threads) th.join();
      }
}
}  // namespace emu

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define VFS_DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(emu::dynamic_smem.data())
#define threadIdx emu::thread_idx
#define blockIdx emu::block_idx
#define blockDim emu::block_dim
#define gridDim emu::grid_dim
#define __syncthreads() emu::syncthreads()
inline float __shfl_xor_sync(unsigned, float v, int mask) {
  return emu::warp_exchange(v, [mask](unsigned lane) { return lane ^ static_cast<unsigned>(mask); });
}
inline float __shfl_sync(unsigned, float v, int src) {
  return emu::warp_exchange(v, [src](unsigned) { return static_cast<unsigned>(src); });
}
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, sizeof f); return f; }
using std::max;
using std::min;

#include "cache_kernels.cuh"
#include "paged_attention.cuh"

// ---- the launch logic of kernels_cuda/*.cu, re-derived (same grids and shared memory sizes)
namespace {
constexpr int NUM_THREADS = 128;
constexpr int PARTITION_SIZE = 512;

template <typename T> struct Tag { using type = T; };
template <int N> using Int = std::integral_constant<int, N>;

template <typename F>
int dispatch(int dtype, int head_size, int block_size, F&& f) {
  auto by_block = [&](auto tag, auto head) -> int {
    switch (block_size) {
      case 8: return f(tag, head, Int<8>{});
      case 16: return f(tag, head, Int<16>{});
      case 32: return f(tag, head, Int<32>{});
      default: return vfs::kUnsupportedConfig;
    }
  };
  auto by_head = [&](auto tag) -> int {
    switch (head_size) {
      case 64: return by_block(tag, Int<64>{});
      case 128: return by_block(tag, Int<128>{});
      case 256: return by_block(tag, Int<256>{});
      default: return vfs::kUnsupportedConfig;
    }
  };
  switch (dtype) {
    case vfs::kFloat32: return by_head(Tag<float>{});
    case vfs::kFloat16: return by_head(Tag<__half>{});
    case vfs::kBFloat16: return by_head(Tag<__nv_bfloat16>{});
    default: return vfs::kUnsupportedConfig;
  }
}
}  // namespace

extern "C" {

// Same arguments as vfs_paged_attention_v1 in kernels_cuda/paged_attention.cu (minus the stream).
int emu_paged_attention_v1(int dtype, int head_size, int block_size, void* out, const void* q, const void* k_cache,
                           const void* v_cache, const int* block_tables, const int* seq_lens, int num_seqs,
                           int num_heads, int num_kv_heads, int max_num_blocks_per_seq, int max_seq_len, float scale,
                           const int64_t* s) {
  return dispatch(dtype, head_size, block_size, [&](auto tag, auto head, auto block) {
    using T = typename decltype(tag)::type;
    constexpr int HEAD = decltype(head)::value, BLOCK = decltype(block)::value;
    const int logits_capacity = vfs::divide_round_up(max_seq_len, BLOCK) * BLOCK;
    emu::launch(dim3(num_heads, num_seqs, 1), dim3(NUM_THREADS, 1, 1), logits_capacity * sizeof(float), [&] {
      vfs::paged_attention_v1_kernel<T, HEAD, BLOCK, NUM_THREADS>(
          static_cast<T*>(out), static_cast<const T*>(q), static_cast<const T*>(k_cache),
          static_cast<const T*>(v_cache), num_kv_heads, scale, block_tables, seq_lens, max_num_blocks_per_seq,
          s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], logits_capacity);
    });
    return 0;
  });
}

int emu_paged_attention_v2(int dtype, int head_size, int block_size, void* out, float* exp_sums, float* max_logits,
                           float* tmp_out, const void* q, const void* k_cache, const void* v_cache,
                           const int* block_tables, const int* seq_lens, int num_seqs, int num_heads,
                           int num_kv_heads, int max_num_blocks_per_seq, int max_seq_len, float scale,
                           const int64_t* s) {
  return dispatch(dtype, head_size, block_size, [&](auto tag, auto head, auto block) {
    using T = typename decltype(tag)::type;
    constexpr int HEAD = decltype(head)::value, BLOCK = decltype(block)::value;
    const int max_num_partitions = vfs::divide_round_up(max_seq_len, PARTITION_SIZE);
    emu::launch(dim3(num_heads, num_seqs, max_num_partitions), dim3(NUM_THREADS, 1, 1), PARTITION_SIZE * sizeof(float), [&] {
      vfs::paged_attention_v2_kernel<T, HEAD, BLOCK, NUM_THREADS, PARTITION_SIZE>(
          exp_sums, max_logits, tmp_out, static_cast<const T*>(q), static_cast<const T*>(k_cache),
          static_cast<const T*>(v_cache), num_kv_heads, scale, block_tables, seq_lens, max_num_blocks_per_seq,
          s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8]);
    });
    emu::launch(dim3(num_heads, num_seqs, 1), dim3(NUM_THREADS, 1, 1), max_num_partitions * sizeof(float), [&] {
      vfs::paged_attention_v2_reduce_kernel<T, HEAD, NUM_THREADS, PARTITION_SIZE>(
          static_cast<T*>(out), exp_sums, max_logits, tmp_out, seq_lens, max_num_partitions, max_num_blocks_per_seq,
          BLOCK);
    });
    return 0;
  });
}

// Same arguments as vfs_reshape_and_cache in kernels_cuda/cache_kernels.cu (minus the stream).
int emu_reshape_and_cache(int dtype, bool slot_is_int64, const void* key, const void* value, void* key_cache,
                          void* value_cache, const void* slot_mapping, int64_t num_tokens, int block_size,
                          int num_kv_heads, int head_size, const int64_t* s) {
  auto run = [&](auto tag, auto slot_tag) {
    using T = typename decltype(tag)::type;
    using S = typename decltype(slot_tag)::type;
    if (num_tokens == 0) return;
    emu::launch(dim3(num_tokens, 1, 1), dim3(std::min(num_kv_heads * head_size, 512), 1, 1), 0, [&] {
      vfs::reshape_and_cache_kernel<T, S>(static_cast<const T*>(key), static_cast<const T*>(value),
                                          static_cast<T*>(key_cache), static_cast<T*>(value_cache),
                                          static_cast<const S*>(slot_mapping), block_size, num_kv_heads, head_size,
                                          s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9]);
    });
  };
  auto by_slot = [&](auto tag) {
    if (slot_is_int64) run(tag, Tag<int64_t>{}); else run(tag, Tag<int32_t>{});
  };
  switch (dtype) {
    case vfs::kFloat32: by_slot(Tag<float>{}); return 0;
    case vfs::kFloat16: by_slot(Tag<__half>{}); return 0;
    case vfs::kBFloat16: by_slot(Tag<__nv_bfloat16>{}); return 0;
    default: return vfs::kUnsupportedConfig;
  }
}

}  // extern "C"
