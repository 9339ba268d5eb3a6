// The subset of the CUDA runtime and device intrinsics that kernels_cuda/ uses, on host threads.
//
// Why: CI machines have nvcc but no GPU. `nvcc -cubin` proves the kernels compile; this header
// lets g++ compile the very same .cu files — device code AND host launchers, unchanged — and run
// them on the CPU, so CI also checks what they compute and how they are launched (grid sizes,
// dispatch, shared-memory opt-in, error codes). kernels_cuda/emulator/__init__.py builds and
// loads them; the shims in include/ make `#include <cuda_runtime.h>` (and the fp16/bf16
// headers) land here.
//
// The execution model (one launch at a time, synchronous, like a single stream):
//   * a launch checks its configuration as the driver would (block <= 1024 threads, grid
//     limits, dynamic shared memory <= 48 KB unless the kernel opted in with
//     cudaFuncSetAttribute, up to an H100's 227 KB) and records cudaGetLastError();
//   * one std::thread per CUDA thread; thread blocks run one after another, the same threads
//     moving on to the next block together;
//   * __syncthreads()  -> a barrier over the block; a thread that returned no longer holds it
//                         back (as on the GPU);
//   * warp shuffles    -> an exchange through a per-thread slot between two barriers over the
//                         warp; every lane must take part (full mask only), and reading a lane
//                         that did not (it returned or diverged) is reported as a fault;
//   * __shared__       -> function-local statics (blocks run one at a time, so "shared by the
//                         block" == "shared by the process"); dynamic shared memory is a host
//                         buffer of the launch's size, refilled with 0xff bytes (NaN) before
//                         every block, so reading before writing shows;
//   * an exception in a thread (a course stub's throw, __trap(), a fault above) fails the
//     launch: cudaErrorLaunchFailure, and cudaGetErrorString names what was thrown.
// What it cannot catch: memory-ordering or timing bugs of real hardware, register or
// static shared-memory limits (cudaFuncAttributes::sharedSizeBytes is 0 here), and anything
// only nvcc rejects (the nvcc compile test covers that).
#pragma once

#define VFS_CUDA_EMULATOR 1

#include <math.h>

#include <algorithm>
#include <cmath>
#include <cfloat>
#include <climits>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <cxxabi.h>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

// ---------------------------------------------------------------- vector types (vector_types.h)

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };

// ---------------------------------------------------------------- runtime types (driver_types.h values)

enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidMemcpyDirection = 21,
  cudaErrorLaunchFailure = 719,
};
typedef enum cudaError cudaError_t;

struct CUstream_st;
typedef CUstream_st* cudaStream_t;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrWarpSize = 10,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};

enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

struct cudaFuncAttributes {
  size_t sharedSizeBytes, constSizeBytes, localSizeBytes;
  int maxThreadsPerBlock, numRegs, ptxVersion, binaryVersion, cacheModeCA, maxDynamicSharedSizeBytes;
};

// ---------------------------------------------------------------- the emulated device

namespace vfs_emu {

// The limits of the GPU this project is measured on (H100, sm_90).
constexpr int kWarpSize = 32;
constexpr int kMaxThreadsPerBlock = 1024;
constexpr int kDefaultDynamicSharedMemory = 48 * 1024;      // without cudaFuncSetAttribute
constexpr int kMaxSharedMemoryPerBlockOptin = 227 * 1024;   // cudaDevAttrMaxSharedMemoryPerBlockOptin
constexpr int kMultiProcessorCount = 132;

// Misuse the emulator detects (a shuffle nobody answered, a partial mask).
struct Fault : std::logic_error {
  using std::logic_error::logic_error;
};

// A barrier whose participants may leave: a CUDA thread that has returned no longer holds
// back the others' __syncthreads (or shuffles). `on_complete` runs in the last arriver,
// before anyone is released.
class Barrier {
 public:
  void reset(unsigned expected) {
    std::lock_guard<std::mutex> lock(mutex_);
    expected_ = expected;
    arrived_ = 0;
  }
  template <typename F = void (*)()>
  void arrive_and_wait(F on_complete = [] {}) {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t phase = phase_;
    if (++arrived_ >= expected_) {
      on_complete();
      complete(lock);
      return;
    }
    cv_.wait(lock, [&] { return phase_ != phase; });
  }
  void leave() {
    std::unique_lock<std::mutex> lock(mutex_);
    --expected_;
    if (arrived_ > 0 && arrived_ >= expected_) complete(lock);
  }

 private:
  void complete(std::unique_lock<std::mutex>& lock) {
    arrived_ = 0;
    ++phase_;
    lock.unlock();       // wake the waiters with the lock free, so they need not block on it again
    cv_.notify_all();
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  unsigned expected_ = 0, arrived_ = 0;
  uint64_t phase_ = 0;
};

// The launch in flight.
struct Grid {
  dim3 grid, block;
  unsigned num_threads = 0, num_warps = 0;
  Barrier block_sync, block_end;
  std::vector<std::unique_ptr<Barrier>> warp_sync;   // [warp]
  std::vector<uint64_t> shuffle_value, shuffle_stamp;  // [thread]: a shuffle's operand, and which shuffle wrote it
  std::byte* dynamic_smem = nullptr;
  size_t dynamic_smem_bytes = 0;
  std::mutex fault_mutex;
  std::string fault;   // the first thread's failure; empty if none
  bool aborted = false;

  unsigned lanes_in_warp(unsigned warp) const { return std::min<unsigned>(kWarpSize, num_threads - warp * kWarpSize); }
  void reset_block() {   // before every block: all threads back in, fresh (poisoned) dynamic shared memory
    block_sync.reset(num_threads);
    for (unsigned w = 0; w < num_warps; ++w) warp_sync[w]->reset(lanes_in_warp(w));
    if (dynamic_smem_bytes) std::memset(dynamic_smem, 0xff, dynamic_smem_bytes);
  }
};

struct ThreadState {
  dim3 thread_idx, block_idx;
  unsigned linear = 0;        // threadIdx flattened: x fastest
  uint64_t shuffles = 0;      // shuffles this thread has made in the current block
};

inline Grid* current = nullptr;
inline thread_local ThreadState self;

struct LastError {
  cudaError_t code = cudaSuccess;
  std::string fault;          // for cudaErrorLaunchFailure: what the kernel threw
  std::string message;        // cudaGetErrorString's buffer
};
inline thread_local LastError last_error;   // per host thread, as in the runtime

inline std::mutex& launch_mutex() {   // one launch at a time: a single, synchronous stream
  static std::mutex m;
  return m;
}

// Per-kernel cudaFuncAttributeMaxDynamicSharedMemorySize (default 48 KB).
inline std::map<const void*, int>& max_dynamic_smem() {
  static std::map<const void*, int> m;
  return m;
}
inline std::mutex& attributes_mutex() {
  static std::mutex m;
  return m;
}
inline int max_dynamic_smem_of(const void* kernel) {
  std::lock_guard<std::mutex> lock(attributes_mutex());
  auto it = max_dynamic_smem().find(kernel);
  return it == max_dynamic_smem().end() ? kDefaultDynamicSharedMemory : it->second;
}

inline std::string demangle(const char* name) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> out(abi::__cxa_demangle(name, nullptr, nullptr, &status), std::free);
  return status == 0 && out ? std::string(out.get()) : std::string(name);
}

// What the current exception is, for the fault message: the type (a course stub throws a
// local struct named after its task) and, for std::exception, what().
inline std::string describe_current_exception() {
  const std::type_info* type = abi::__cxa_current_exception_type();
  std::string what = type ? demangle(type->name()) : "unknown exception";
  try {
    throw;
  } catch (const std::exception& e) {
    what += std::string(": ") + e.what();
  } catch (...) {
  }
  return what;
}

inline std::string block_thread_name() {
  const ThreadState& s = self;
  return "block (" + std::to_string(s.block_idx.x) + "," + std::to_string(s.block_idx.y) + "," +
         std::to_string(s.block_idx.z) + ") thread (" + std::to_string(s.thread_idx.x) + "," +
         std::to_string(s.thread_idx.y) + "," + std::to_string(s.thread_idx.z) + ")";
}

// One CUDA thread's life: every block of the grid in turn (x fastest), in step with the others.
inline void run_thread(Grid& g, unsigned t, const std::function<void()>& kernel) {
  const uint64_t gx = g.grid.x, gy = g.grid.y, num_blocks = gx * gy * g.grid.z;
  const unsigned warp = t / kWarpSize;
  self.linear = t;
  self.thread_idx = dim3(t % g.block.x, (t / g.block.x) % g.block.y, t / (g.block.x * g.block.y));
  for (uint64_t b = 0; b < num_blocks; ++b) {
    self.block_idx = dim3(static_cast<unsigned>(b % gx), static_cast<unsigned>((b / gx) % gy),
                          static_cast<unsigned>(b / (gx * gy)));
    self.shuffles = 0;
    try {
      kernel();
    } catch (...) {
      const std::string what = block_thread_name() + ": " + describe_current_exception();
      std::lock_guard<std::mutex> lock(g.fault_mutex);
      if (g.fault.empty()) g.fault = what;
    }
    g.block_sync.leave();          // returned: no longer expected at __syncthreads
    g.warp_sync[warp]->leave();    // nor at its warp's shuffles
    g.block_end.arrive_and_wait([&] {
      g.aborted = !g.fault.empty();
      if (!g.aborted) g.reset_block();
    });
    if (g.aborted) return;
  }
}

inline cudaError_t set_last_error(cudaError_t code, std::string fault = "") {
  if (code != cudaSuccess) {
    last_error.code = code;
    last_error.fault = std::move(fault);
  }
  return code;
}

// The driver's checks, then the grid. Synchronous: when it returns, the kernel has finished.
inline cudaError_t launch(const void* kernel_key, dim3 grid, dim3 block, size_t smem,
                          const std::function<void()>& kernel) {
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || block.x > 1024 || block.y > 1024 || block.z > 64 ||
      grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > INT_MAX || grid.y > 65535 || grid.z > 65535) {
    return set_last_error(cudaErrorInvalidConfiguration);
  }
  if (smem > static_cast<size_t>(max_dynamic_smem_of(kernel_key))) return set_last_error(cudaErrorInvalidValue);

  std::lock_guard<std::mutex> lock(launch_mutex());
  Grid g;
  g.grid = grid;
  g.block = block;
  g.num_threads = static_cast<unsigned>(threads);
  g.num_warps = (g.num_threads + kWarpSize - 1) / kWarpSize;
  for (unsigned w = 0; w < g.num_warps; ++w) g.warp_sync.push_back(std::make_unique<Barrier>());
  g.shuffle_value.assign(g.num_threads, 0);
  g.shuffle_stamp.assign(g.num_threads, 0);
  std::vector<uint4> smem_buffer((smem + sizeof(uint4) - 1) / sizeof(uint4));   // 16-byte aligned, as on the GPU
  g.dynamic_smem = smem ? reinterpret_cast<std::byte*>(smem_buffer.data()) : nullptr;
  g.dynamic_smem_bytes = smem;
  g.block_end.reset(g.num_threads);
  g.reset_block();

  current = &g;
  std::vector<std::thread> workers;
  workers.reserve(g.num_threads);
  for (unsigned t = 0; t < g.num_threads; ++t) workers.emplace_back([&g, t, &kernel] { run_thread(g, t, kernel); });
  for (auto& w : workers) w.join();
  current = nullptr;
  return g.fault.empty() ? cudaSuccess : set_last_error(cudaErrorLaunchFailure, g.fault);
}

// `VFS_LAUNCH(kernel, grid, block, smem, stream)(args...)`: the arguments are converted to the
// kernel's parameter types once, as the runtime does, and every thread gets its own copy.
template <typename... Params>
class Launch {
 public:
  Launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t /*stream: one, synchronous*/)
      : kernel_(kernel), grid_(grid), block_(block), smem_(smem) {}

  template <typename... Args>
  void operator()(Args&&... args) const {
    static_assert(sizeof...(Args) == sizeof...(Params), "kernel launched with the wrong number of arguments");
    const std::tuple<std::decay_t<Params>...> params(std::forward<Args>(args)...);
    auto kernel = kernel_;
    launch(reinterpret_cast<const void*>(kernel_), grid_, block_, smem_, [&params, kernel] {
      std::tuple<std::decay_t<Params>...> mine = params;   // by value, per thread
      std::apply(kernel, mine);
    });
  }

 private:
  void (*kernel_)(Params...);
  dim3 grid_, block_;
  size_t smem_;
};

// ---- warp shuffles: every lane of the warp writes its operand, then reads its source lane's.
inline uint64_t exchange(unsigned mask, uint64_t bits, unsigned src_lane) {
  if (mask != 0xffffffffu) throw Fault("only full-warp shuffles (mask 0xffffffff) are emulated");
  Grid& g = *current;
  const unsigned t = self.linear, warp = t / kWarpSize;
  const uint64_t stamp = ++self.shuffles;
  g.shuffle_value[t] = bits;
  g.shuffle_stamp[t] = stamp;
  g.warp_sync[warp]->arrive_and_wait();
  if (src_lane >= g.lanes_in_warp(warp)) {
    throw Fault("shuffle from lane " + std::to_string(src_lane) + ", which this partial warp does not have");
  }
  const unsigned src = warp * kWarpSize + src_lane;
  if (g.shuffle_stamp[src] != stamp) {
    throw Fault("shuffle from lane " + std::to_string(src_lane) +
                ", which is not at this shuffle (it returned, or took another branch)");
  }
  const uint64_t got = g.shuffle_value[src];
  g.warp_sync[warp]->arrive_and_wait();
  return got;
}

template <typename T>
T shuffle(unsigned mask, T var, unsigned src_lane) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffles move 32- or 64-bit values");
  uint64_t bits = 0;
  std::memcpy(&bits, &var, sizeof(T));
  bits = exchange(mask, bits, src_lane);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

inline unsigned lane_id() { return self.linear % kWarpSize; }

inline void* dynamic_shared_memory() { return current->dynamic_smem; }

}  // namespace vfs_emu

// ---------------------------------------------------------------- the launch seam (see kernels_cuda/launch.cuh)

#define VFS_LAUNCH(kernel, grid, block, smem, stream) ::vfs_emu::Launch((kernel), (grid), (block), (smem), (stream))

// ---------------------------------------------------------------- runtime API

inline cudaError_t cudaGetLastError() {
  const cudaError_t code = vfs_emu::last_error.code;
  vfs_emu::last_error.code = cudaSuccess;
  return code;
}
inline cudaError_t cudaPeekAtLastError() { return vfs_emu::last_error.code; }

inline const char* cudaGetErrorString(cudaError_t code) {
  switch (code) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorLaunchFailure:
      vfs_emu::last_error.message = "unspecified launch failure";
      if (!vfs_emu::last_error.fault.empty()) vfs_emu::last_error.message += " (emulator: " + vfs_emu::last_error.fault + ")";
      return vfs_emu::last_error.message.c_str();
    default: return "unrecognized error code";
  }
}

inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0) return vfs_emu::set_last_error(cudaErrorInvalidValue);
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = vfs_emu::kMaxThreadsPerBlock; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = vfs_emu::kDefaultDynamicSharedMemory; return cudaSuccess;
    case cudaDevAttrWarpSize: *value = vfs_emu::kWarpSize; return cudaSuccess;
    case cudaDevAttrMultiProcessorCount: *value = vfs_emu::kMultiProcessorCount; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = vfs_emu::kMaxSharedMemoryPerBlockOptin; return cudaSuccess;
  }
  return vfs_emu::set_last_error(cudaErrorInvalidValue);
}

template <typename T>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, T* kernel) {
  *attr = cudaFuncAttributes{};
  attr->maxThreadsPerBlock = vfs_emu::kMaxThreadsPerBlock;
  attr->maxDynamicSharedSizeBytes = vfs_emu::max_dynamic_smem_of(reinterpret_cast<const void*>(kernel));
  return cudaSuccess;   // sharedSizeBytes (static __shared__) is not measured here: 0
}

template <typename T>
cudaError_t cudaFuncSetAttribute(T* kernel, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 || value > vfs_emu::kMaxSharedMemoryPerBlockOptin) {
    return vfs_emu::set_last_error(cudaErrorInvalidValue);
  }
  std::lock_guard<std::mutex> lock(vfs_emu::attributes_mutex());
  vfs_emu::max_dynamic_smem()[reinterpret_cast<const void*>(kernel)] = value;
  return cudaSuccess;
}

// All memory is host memory here, so every direction is a memcpy.
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind, cudaStream_t = nullptr) {
  if (static_cast<int>(kind) < cudaMemcpyHostToHost || static_cast<int>(kind) > cudaMemcpyDefault) {
    return vfs_emu::set_last_error(cudaErrorInvalidMemcpyDirection);
  }
  if (count) std::memcpy(dst, src, count);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  return cudaMemcpyAsync(dst, src, count, kind);
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }   // launches are synchronous
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }

// ---------------------------------------------------------------- fp16 / bf16 (cuda_fp16.h, cuda_bf16.h)

struct __half {
  unsigned short __x;   // the raw bits, as __half_raw
};
struct __nv_bfloat16 {
  unsigned short __x;
};

inline float __half2float(__half h) {
  _Float16 f;
  std::memcpy(&f, &h.__x, 2);
  return static_cast<float>(f);
}
inline __half __float2half_rn(float x) {   // IEEE round to nearest even, by the compiler
  const _Float16 f = static_cast<_Float16>(x);
  __half h;
  std::memcpy(&h.__x, &f, 2);
  return h;
}
inline __half __float2half(float x) { return __float2half_rn(x); }

inline float __bfloat162float(__nv_bfloat16 b) {
  const uint32_t bits = uint32_t(b.__x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float x) {   // round to nearest even; NaN -> canonical NaN, as CUDA
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  __nv_bfloat16 b;
  if (std::isnan(x)) {
    b.__x = 0x7fff;
  } else {
    b.__x = static_cast<unsigned short>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  }
  return b;
}
inline __nv_bfloat16 __float2bfloat16(float x) { return __float2bfloat16_rn(x); }

// ---------------------------------------------------------------- device intrinsics

inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }

// CUDA's min/max accept mixed integer types (int and int64_t, ...), unlike std::min.
template <typename A, typename B>
constexpr std::common_type_t<A, B> min(A a, B b) { return b < a ? b : a; }
template <typename A, typename B>
constexpr std::common_type_t<A, B> max(A a, B b) { return a < b ? b : a; }

[[noreturn]] inline void __trap() { throw vfs_emu::Fault("__trap()"); }

inline void __syncthreads() { vfs_emu::current->block_sync.arrive_and_wait(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  if (mask != 0xffffffffu) throw vfs_emu::Fault("only full-warp __syncwarp is emulated");
  vfs_emu::current->warp_sync[vfs_emu::self.linear / vfs_emu::kWarpSize]->arrive_and_wait();
}

template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = vfs_emu::kWarpSize) {
  const unsigned lane = vfs_emu::lane_id(), base = lane / width * width;
  return vfs_emu::shuffle(mask, var, base + static_cast<unsigned>(src_lane) % width);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = vfs_emu::kWarpSize) {
  const unsigned lane = vfs_emu::lane_id(), src = lane ^ static_cast<unsigned>(lane_mask);
  return vfs_emu::shuffle(mask, var, src < (lane / width + 1) * width ? src : lane);   // later groups: own value
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = vfs_emu::kWarpSize) {
  const unsigned lane = vfs_emu::lane_id(), src = lane + delta;
  return vfs_emu::shuffle(mask, var, src < (lane / width + 1) * width ? src : lane);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = vfs_emu::kWarpSize) {
  const unsigned lane = vfs_emu::lane_id(), base = lane / width * width;
  return vfs_emu::shuffle(mask, var, lane >= base + delta ? lane - delta : lane);
}

inline constexpr int warpSize = vfs_emu::kWarpSize;

// ---------------------------------------------------------------- qualifiers and built-in variables
// (last, so that nothing above is rewritten by them)

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define VFS_DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(::vfs_emu::dynamic_shared_memory())
#define threadIdx (::vfs_emu::self.thread_idx)
#define blockIdx (::vfs_emu::self.block_idx)
#define blockDim (::vfs_emu::current->block)
#define gridDim (::vfs_emu::current->grid)
