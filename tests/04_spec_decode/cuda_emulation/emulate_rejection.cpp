// Run kernels_cuda/rejection_sampler.cuh on the CPU, thread by thread — a test harness.
//
// The same execution model as chapter 01's emulator (tests/01_paged_attention/cuda_emulation):
// the device code is compiled UNCHANGED with g++, one std::thread per CUDA thread;
//   * __syncthreads()   -> a std::barrier over the thread block;
//   * __shfl_xor_sync   -> an exchange through a per-warp buffer between two barriers over the
//                          warp (all 32 lanes must take part, as the full mask promises);
//                          float and int overloads (the argmax reduction shuffles both);
//   * __shared__        -> function-local statics (thread blocks run one after another).
// It needs no CUDA headers (the kernel uses only int/float), so g++ alone builds it.
// What it cannot catch: hardware memory-ordering and timing bugs, the .cu launcher itself
// (its grid is re-derived below: one block per request, 256 threads).
//
// Built by test_cuda_kernel_emulated.py: g++ -std=c++20 -O1 -shared -fPIC -pthread -I kernels_cuda
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace emu {
thread_local dim3 thread_idx, block_idx;
dim3 block_dim, grid_dim;
std::unique_ptr<std::barrier<>> block_barrier;
std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
uint32_t warp_buffers[32][32];  // [warp][lane], raw 32-bit words (float or int)

inline void syncthreads() { block_barrier->arrive_and_wait(); }

template <typename T>
T warp_xor_exchange(T value, int mask) {
  static_assert(sizeof(T) == 4, "32-bit shuffles only");
  const unsigned warp = thread_idx.x / 32, lane = thread_idx.x % 32;
  std::memcpy(&warp_buffers[warp][lane], &value, 4);
  warp_barriers[warp]->arrive_and_wait();
  T got;
  std::memcpy(&got, &warp_buffers[warp][lane ^ static_cast<unsigned>(mask)], 4);
  warp_barriers[warp]->arrive_and_wait();
  return got;
}

inline void launch(dim3 grid, dim3 block, const std::function<void()>& kernel) {
  grid_dim = grid;
  block_dim = block;
  const unsigned n = block.x;
  for (unsigned x = 0; x < grid.x; ++x) {
    block_barrier = std::make_unique<std::barrier<>>(n);
    warp_barriers.clear();
    for (unsigned w = 0; w < (n + 31) / 32; ++w)
      warp_barriers.push_back(std::make_unique<std::barrier<>>(std::min(32u, n - 32 * w)));
    std::vector<std::thread> threads;
    threads.reserve(n);
    for (unsigned t = 0; t < n; ++t) {
      threads.emplace_back([&, t, x] {
        thread_idx = dim3(t, 0, 0);
        block_idx = dim3(x, 0, 0);
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
#define __restrict__
#define __launch_bounds__(...)
#define __shared__ static
#define threadIdx emu::thread_idx
#define blockIdx emu::block_idx
#define blockDim emu::block_dim
#define __syncthreads() emu::syncthreads()
inline float __shfl_xor_sync(unsigned, float v, int mask) { return emu::warp_xor_exchange(v, mask); }
inline int __shfl_xor_sync(unsigned, int v, int mask) { return emu::warp_xor_exchange(v, mask); }
using std::fmaxf;

#include "rejection_sampler.cuh"

extern "C" {

// Same arguments as vfs_rejection_sample in kernels_cuda/rejection_sampler.cu (minus the stream).
int emu_rejection_sample(int32_t* out, const int32_t* cu_num_draft, const int32_t* draft_ids, const float* draft_probs,
                         const float* target_probs, const int32_t* target_argmax, const int32_t* bonus_ids,
                         const int8_t* is_greedy, const float* uniform, const float* inv_exp, int batch, int vocab,
                         int out_stride, int num_threads) {
  if (batch == 0) return 0;
  auto run = [&](auto threads) {
    constexpr int N = decltype(threads)::value;
    emu::launch(dim3(batch), dim3(N), [&] {
      vfs::rejection_sample_kernel<N>(out, cu_num_draft, draft_ids, draft_probs, target_probs, target_argmax,
                                      bonus_ids, is_greedy, uniform, inv_exp, vocab, out_stride);
    });
    return 0;
  };
  switch (num_threads) {
    case 32: return run(std::integral_constant<int, 32>{});
    case 256: return run(std::integral_constant<int, 256>{});   // the launcher's configuration
    default: return -1;
  }
}

}  // extern "C"
