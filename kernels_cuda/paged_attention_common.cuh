// Small device helpers shared by the paged-attention and cache kernels.
//
// Plain CUDA (no torch/c10 includes) so `nvcc -cubin` compiles it on machines without a
// GPU. Mirrors the role of vLLM's csrc/attention/attention_dtypes.h + attention_utils.cuh,
// reduced to what our kernels use: fp32/fp16/bf16 <-> float, 16-byte vector loads and the
// warp/block reductions of the softmax.
#pragma once

#include <cfloat>
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace vfs {

// The dtype codes the torch bindings pass in (one int, so no torch types cross into .cu).
enum DTypeCode : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Launchers return 0 on success, a cudaError_t value on a launch error, or this code
// when asked for a configuration that was not compiled (head size / block size).
constexpr int kUnsupportedConfig = -1;

constexpr int WARP_SIZE = 32;

// Dynamic shared memory (its size is a launch argument). A macro only so that the CPU
// emulator (kernels_cuda/emulator) can point it at a host buffer; on the GPU this is
// exactly `extern __shared__ T name[];`.
#ifndef VFS_DYNAMIC_SHARED
#define VFS_DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif

template <typename T> __host__ __device__ constexpr T divide_round_up(T a, T b) { return (a + b - 1) / b; }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// N elements loaded or stored as one aligned access: with N * sizeof(T) == 16 the compiler
// emits a single 128-bit load (ld.global.v4.u32), which is what keeps a warp's reads of
// a KV row coalesced into full 32-byte sectors.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T val[N];
};

// ------------------------------------------------------------------ reading an 8-bit cache
// (paged_attention/kv_quant.py). The read kernels take the cache as bytes (cache_t = uint8_t)
// and this: what the bytes are and where their scales live.
enum KVCacheKind : int { kKVCacheFloat = 0, kKVCacheInt8 = 1, kKVCacheFp8 = 2 };

struct KVQuantArgs {
  int kind;          // KVCacheKind
  bool per_row;      // each (token, KV head) row: head_size bytes, then its fp32 scale; else the layer's:
  float k_scale;     //   K's per-tensor scale
  float v_scale;     //   V's
};

// fp8 e4m3fn byte -> float, exactly (integer arithmetic: the emulator and every GPU agree). The
// writers clamp to +-448, so the NaN codes (S.1111.111) never occur in a cache.
__device__ __forceinline__ float fp8e4m3_to_float(uint8_t b) {
  const unsigned sign = static_cast<unsigned>(b & 0x80u) << 24, exp = (b >> 3) & 0xFu, man = b & 7u;
  if (exp == 0) return __uint_as_float(sign | __float_as_uint(static_cast<float>(man) * 0.001953125f));  // man * 2^-9
  return __uint_as_float(sign | ((exp + 120u) << 23) | (man << 20));    // 2^(exp - 7) * (1 + man / 8)
}

// One cache element as a float, unscaled: a float cache's as it is, an 8-bit cache's byte as
// int8 or fp8 (warp-uniform branch: one kernel instance serves both 8-bit kinds).
template <typename cache_t> __device__ __forceinline__ float kv_to_float(cache_t x, int) { return to_float(x); }
__device__ __forceinline__ float kv_to_float(uint8_t x, int kind) {
  return kind == kKVCacheInt8 ? static_cast<float>(static_cast<int8_t>(x)) : fp8e4m3_to_float(x);
}

// N consecutive cache elements, as stored (converted on use, so that bf16 or 8-bit loads in
// flight cost half or a quarter of the registers floats would). A float cache: one 16-byte
// load. An 8-bit cache: a per-token-head row is head_size + 4 bytes, so rows are only 4-byte
// aligned and the widest load is 4 bytes.
template <typename cache_t, int N>
__device__ __forceinline__ Vec<cache_t, N> load_kv(const cache_t* p) {
  if constexpr (sizeof(cache_t) == 1) {
    constexpr int W = N < 4 ? N : 4;
    Vec<cache_t, N> v;
#pragma unroll
    for (int i = 0; i < N; i += W) {
      const Vec<cache_t, W> w = *reinterpret_cast<const Vec<cache_t, W>*>(p + i);
#pragma unroll
      for (int e = 0; e < W; ++e) v.val[i + e] = w.val[e];
    }
    return v;
  } else {
    return *reinterpret_cast<const Vec<cache_t, N>*>(p);
  }
}

// The scale of one cache row (`row` points at its first element): a per-token-head row carries
// it after its head_size bytes; otherwise the layer's. Only 8-bit caches ask.
template <int HEAD_SIZE>
__device__ __forceinline__ float kv_row_scale(const uint8_t* row, const bool per_row, const float tensor_scale) {
  return per_row ? *reinterpret_cast<const float*>(row + HEAD_SIZE) : tensor_scale;
}

// Sum (or max) over the lanes of a warp whose index differs only in bits [lo, WARP_SIZE):
// with lo = 1 every lane ends with the warp total; with lo = group size, every lane holds
// the total over the lanes that share its position inside a group.
template <int LO = 1>
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int mask = WARP_SIZE / 2; mask >= LO; mask /= 2) x += __shfl_xor_sync(0xffffffffu, x, mask);
  return x;
}

template <int LO = 1>
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int mask = WARP_SIZE / 2; mask >= LO; mask /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, mask));
  return x;
}

// Sum of `x` over all NUM_WARPS * 32 threads of the block; every thread gets the result.
// `red_smem` holds NUM_WARPS floats. Ends with a barrier-free broadcast, so callers may
// reuse red_smem only after their next __syncthreads().
template <int NUM_WARPS>
__device__ __forceinline__ float block_sum(float* red_smem, float x) {
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  x = warp_sum(x);
  if (lane == 0) red_smem[warp] = x;
  __syncthreads();
  x = lane < NUM_WARPS ? red_smem[lane] : 0.f;
#pragma unroll
  for (int mask = NUM_WARPS / 2; mask >= 1; mask /= 2) x += __shfl_xor_sync(0xffffffffu, x, mask);
  return __shfl_sync(0xffffffffu, x, 0);
}

template <int NUM_WARPS>
__device__ __forceinline__ float block_max(float* red_smem, float x) {
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  x = warp_max(x);
  if (lane == 0) red_smem[warp] = x;
  __syncthreads();
  x = lane < NUM_WARPS ? red_smem[lane] : -FLT_MAX;
#pragma unroll
  for (int mask = NUM_WARPS / 2; mask >= 1; mask /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, mask));
  return __shfl_sync(0xffffffffu, x, 0);
}

}  // namespace vfs
