// Host launchers for the paged decode attention kernels (paged_attention.cuh).
//
// Raw pointers + sizes + strides (elements) + the stream as an int64: no torch headers, so
// `nvcc -cubin` compiles this file on CPU-only CI machines. Compiling it instantiates every
// supported (dtype, head size, block size) kernel, which is what the nvcc test checks for
// register spills. paged_attention_binding.cpp is the torch side.
//
// Mirrors vLLM's csrc/attention/paged_attention_v1.cu and paged_attention_v2.cu; v3
// (paged_attention_v3.cuh) is this project's flash-decoding rung.
#include <type_traits>

#include <cuda_runtime.h>

#include "launch.cuh"
#include "paged_attention.cuh"
#include "paged_attention_v3.cuh"

namespace vfs {

constexpr int NUM_THREADS = 128;      // 4 warps per thread block, as in vLLM
constexpr int PARTITION_SIZE = 512;   // tokens per v2 partition (vLLM's default)
constexpr int kSharedMemoryTooLarge = -2;

// strides[] (elements): block_tables row, q seq, q head, k block, k token, k head, v block, v token, v head
struct DecodeArgs {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int* block_tables;
  const int* seq_lens;
  int num_seqs, num_heads, num_kv_heads, max_num_blocks_per_seq, max_seq_len;
  float scale;
  KVQuantArgs kvq;              // kind kKVCacheFloat: the caches are of the query's dtype
  const int64_t* strides;       // the caches' in their elements (an 8-bit cache: bytes)
  cudaStream_t stream;
};

template <typename T> struct Tag { using type = T; };
template <int N> using Int = std::integral_constant<int, N>;

// Turn runtime (dtype, cache kind, head size, block size) into template arguments:
// f(Tag<T>, Tag<cache_t>, Int<HEAD>, Int<BLOCK>), cache_t = T for a float cache, uint8_t for an
// 8-bit one (int8 and fp8 share that instance: the kind is a runtime argument, so 8-bit reads
// double the instances rather than triple them; vLLM makes the fp8 kind a template argument).
template <typename F>
int dispatch(int dtype, const KVQuantArgs& kvq, int head_size, int block_size, F&& f) {
  if (kvq.kind < kKVCacheFloat || kvq.kind > kKVCacheFp8 || (kvq.per_row && kvq.kind == kKVCacheFloat))
    return kUnsupportedConfig;
  auto by_block = [&](auto tag, auto cache_tag, auto head) -> int {
    switch (block_size) {
      case 8: return f(tag, cache_tag, head, Int<8>{});
      case 16: return f(tag, cache_tag, head, Int<16>{});
      case 32: return f(tag, cache_tag, head, Int<32>{});
      default: return kUnsupportedConfig;
    }
  };
  auto by_head = [&](auto tag, auto cache_tag) -> int {
    switch (head_size) {
      case 64: return by_block(tag, cache_tag, Int<64>{});
      case 128: return by_block(tag, cache_tag, Int<128>{});
      case 256: return by_block(tag, cache_tag, Int<256>{});
      default: return kUnsupportedConfig;
    }
  };
  auto by_cache = [&](auto tag) -> int {
    return kvq.kind == kKVCacheFloat ? by_head(tag, tag) : by_head(tag, Tag<uint8_t>{});
  };
  switch (dtype) {
    case kFloat32: return by_cache(Tag<float>{});
    case kFloat16: return by_cache(Tag<__half>{});
    case kBFloat16: return by_cache(Tag<__nv_bfloat16>{});
    default: return kUnsupportedConfig;
  }
}

// Opt in to more than 48 KB of dynamic shared memory when needed (v1 with long contexts).
template <typename Kernel>
int reserve_shared_memory(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return 0;
  int device = 0, max_optin = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  cudaFuncAttributes attr;
  cudaFuncGetAttributes(&attr, kernel);
  if (bytes + attr.sharedSizeBytes > static_cast<size_t>(max_optin)) return kSharedMemoryTooLarge;
  return static_cast<int>(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

template <typename T, typename C, int HEAD, int BLOCK>
int launch_v1(void* out, const DecodeArgs& a) {
  // The whole sequence's logits live in shared memory, padded to whole blocks.
  const int logits_capacity = divide_round_up(a.max_seq_len, BLOCK) * BLOCK;
  const size_t smem = static_cast<size_t>(logits_capacity) * sizeof(float);
  auto kernel = paged_attention_v1_kernel<T, C, HEAD, BLOCK, NUM_THREADS>;
  if (int rc = reserve_shared_memory(kernel, smem)) return rc;
  const int64_t* s = a.strides;
  VFS_LAUNCH(kernel, dim3(a.num_heads, a.num_seqs, 1), NUM_THREADS, smem, a.stream)(
      static_cast<T*>(out), static_cast<const T*>(a.q), static_cast<const C*>(a.k_cache),
      static_cast<const C*>(a.v_cache), a.num_kv_heads, a.scale, a.kvq, a.block_tables, a.seq_lens,
      a.max_num_blocks_per_seq, s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], logits_capacity);
  return static_cast<int>(cudaGetLastError());
}

template <typename T, typename C, int HEAD, int BLOCK>
int launch_v2(void* out, float* exp_sums, float* max_logits, float* tmp_out, const DecodeArgs& a) {
  const int max_num_partitions = divide_round_up(a.max_seq_len, PARTITION_SIZE);
  const int64_t* s = a.strides;
  const auto partition_kernel = paged_attention_v2_kernel<T, C, HEAD, BLOCK, NUM_THREADS, PARTITION_SIZE>;
  VFS_LAUNCH(partition_kernel, dim3(a.num_heads, a.num_seqs, max_num_partitions), NUM_THREADS,
             PARTITION_SIZE * sizeof(float), a.stream)(
          exp_sums, max_logits, tmp_out, static_cast<const T*>(a.q), static_cast<const C*>(a.k_cache),
          static_cast<const C*>(a.v_cache), a.num_kv_heads, a.scale, a.kvq, a.block_tables, a.seq_lens,
          a.max_num_blocks_per_seq, s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8]);
  if (cudaError_t e = cudaGetLastError()) return static_cast<int>(e);
  auto reduce = paged_attention_v2_reduce_kernel<T, HEAD, NUM_THREADS, PARTITION_SIZE>;
  const size_t smem = static_cast<size_t>(max_num_partitions) * sizeof(float);
  if (int rc = reserve_shared_memory(reduce, smem)) return rc;
  VFS_LAUNCH(reduce, dim3(a.num_heads, a.num_seqs), NUM_THREADS, smem, a.stream)(
      static_cast<T*>(out), exp_sums, max_logits, tmp_out, a.seq_lens, max_num_partitions,
      a.max_num_blocks_per_seq, BLOCK);
  return static_cast<int>(cudaGetLastError());
}

// v3: query heads per thread block. A GQA group of up to V3_GROUP_MAX heads is one thread block
// (the whole group shares each K/V load); a bigger group is cut into equal chunks of at most
// V3_GROUP_MAX heads, each chunk a thread block reading the same K/V (neighbours in the grid, so
// the second read mostly hits L2). MHA (group 1) gets its own instance with 1/4 of the registers.
constexpr int V3_GROUP_MAX = 4;

inline int v3_head_chunks(int group, int group_max) { return divide_round_up(group, group_max); }

template <typename T, typename C, int HEAD, int BLOCK, int GROUP_MAX>
int launch_v3(void* out, float* exp_sums, float* max_logits, float* tmp_out, const DecodeArgs& a) {
  const int group = a.num_heads / a.num_kv_heads;
  const int head_chunks = v3_head_chunks(group, GROUP_MAX);
  const int heads_per_block = divide_round_up(group, head_chunks);
  const bool split = tmp_out != nullptr;
  const int max_num_partitions = split ? divide_round_up(a.max_seq_len, PARTITION_SIZE) : 1;
  const int64_t* s = a.strides;
  const auto kernel = paged_attention_v3_kernel<T, C, HEAD, BLOCK, GROUP_MAX, NUM_THREADS, PARTITION_SIZE>;
  VFS_LAUNCH(kernel, dim3(a.num_kv_heads * head_chunks, a.num_seqs, max_num_partitions), NUM_THREADS, 0, a.stream)(
      static_cast<T*>(out), exp_sums, max_logits, tmp_out, static_cast<const T*>(a.q),
      static_cast<const C*>(a.k_cache), static_cast<const C*>(a.v_cache), a.num_heads, a.num_kv_heads,
      heads_per_block, a.scale, a.kvq, a.block_tables, a.seq_lens, a.max_num_blocks_per_seq, s[0], s[1], s[2], s[3], s[4],
      s[5], s[6], s[7], s[8]);
  if (cudaError_t e = cudaGetLastError()) return static_cast<int>(e);
  if (!split) return 0;
  // The partitions' outputs follow v2's contract (normalised by their own sum; max in natural-log
  // units), so v2's reduce kernel merges them.
  auto reduce = paged_attention_v2_reduce_kernel<T, HEAD, NUM_THREADS, PARTITION_SIZE>;
  const size_t smem = static_cast<size_t>(max_num_partitions) * sizeof(float);
  if (int rc = reserve_shared_memory(reduce, smem)) return rc;
  VFS_LAUNCH(reduce, dim3(a.num_heads, a.num_seqs), NUM_THREADS, smem, a.stream)(
      static_cast<T*>(out), exp_sums, max_logits, tmp_out, a.seq_lens, max_num_partitions,
      a.max_num_blocks_per_seq, BLOCK);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace vfs

int vfs_paged_attention_v1(int dtype, int head_size, int block_size, void* out, const void* q, const void* k_cache,
                           const void* v_cache, const int* block_tables, const int* seq_lens, int num_seqs,
                           int num_heads, int num_kv_heads, int max_num_blocks_per_seq, int max_seq_len,
                           float scale, int kv_cache_kind, bool kv_per_row, float k_scale, float v_scale,
                           const int64_t* strides, int64_t stream) {
  const vfs::DecodeArgs a{q, k_cache, v_cache, block_tables, seq_lens, num_seqs, num_heads, num_kv_heads,
                          max_num_blocks_per_seq, max_seq_len, scale, {kv_cache_kind, kv_per_row, k_scale, v_scale},
                          strides, reinterpret_cast<cudaStream_t>(stream)};
  return vfs::dispatch(dtype, a.kvq, head_size, block_size, [&](auto tag, auto cache_tag, auto head, auto block) {
    return vfs::launch_v1<typename decltype(tag)::type, typename decltype(cache_tag)::type, decltype(head)::value,
                          decltype(block)::value>(out, a);
  });
}

int vfs_paged_attention_v2(int dtype, int head_size, int block_size, void* out, float* exp_sums, float* max_logits,
                           float* tmp_out, const void* q, const void* k_cache, const void* v_cache,
                           const int* block_tables, const int* seq_lens, int num_seqs, int num_heads,
                           int num_kv_heads, int max_num_blocks_per_seq, int max_seq_len, float scale,
                           int kv_cache_kind, bool kv_per_row, float k_scale, float v_scale, const int64_t* strides,
                           int64_t stream) {
  const vfs::DecodeArgs a{q, k_cache, v_cache, block_tables, seq_lens, num_seqs, num_heads, num_kv_heads,
                          max_num_blocks_per_seq, max_seq_len, scale, {kv_cache_kind, kv_per_row, k_scale, v_scale},
                          strides, reinterpret_cast<cudaStream_t>(stream)};
  return vfs::dispatch(dtype, a.kvq, head_size, block_size, [&](auto tag, auto cache_tag, auto head, auto block) {
    return vfs::launch_v2<typename decltype(tag)::type, typename decltype(cache_tag)::type, decltype(head)::value,
                          decltype(block)::value>(out, exp_sums, max_logits, tmp_out, a);
  });
}

// v3 (paged_attention_v3.cuh). exp_sums / max_logits / tmp_out sized as for v2 select the split
// path (PARTITION_SIZE-token partitions + v2's reduce); all three nullptr: one partition per
// sequence, written straight to out.
int vfs_paged_attention_v3(int dtype, int head_size, int block_size, void* out, float* exp_sums, float* max_logits,
                           float* tmp_out, const void* q, const void* k_cache, const void* v_cache,
                           const int* block_tables, const int* seq_lens, int num_seqs, int num_heads,
                           int num_kv_heads, int max_num_blocks_per_seq, int max_seq_len, float scale,
                           int kv_cache_kind, bool kv_per_row, float k_scale, float v_scale, const int64_t* strides,
                           int64_t stream) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return vfs::kUnsupportedConfig;
  if ((tmp_out == nullptr) != (exp_sums == nullptr) || (tmp_out == nullptr) != (max_logits == nullptr))
    return vfs::kUnsupportedConfig;
  const vfs::DecodeArgs a{q, k_cache, v_cache, block_tables, seq_lens, num_seqs, num_heads, num_kv_heads,
                          max_num_blocks_per_seq, max_seq_len, scale, {kv_cache_kind, kv_per_row, k_scale, v_scale},
                          strides, reinterpret_cast<cudaStream_t>(stream)};
  const bool mha = num_heads == num_kv_heads;
  return vfs::dispatch(dtype, a.kvq, head_size, block_size, [&](auto tag, auto cache_tag, auto head, auto block) {
    using T = typename decltype(tag)::type;
    using C = typename decltype(cache_tag)::type;
    constexpr int HEAD = decltype(head)::value, BLOCK = decltype(block)::value;
    return mha ? vfs::launch_v3<T, C, HEAD, BLOCK, 1>(out, exp_sums, max_logits, tmp_out, a)
               : vfs::launch_v3<T, C, HEAD, BLOCK, vfs::V3_GROUP_MAX>(out, exp_sums, max_logits, tmp_out, a);
  });
}

int vfs_paged_attention_v3_group_max() { return vfs::V3_GROUP_MAX; }

int vfs_paged_attention_partition_size() { return vfs::PARTITION_SIZE; }

const char* vfs_paged_attention_error_string(int code) {
  if (code == vfs::kUnsupportedConfig)
    return "unsupported dtype / KV cache kind / head size / block size (not compiled)";
  if (code == vfs::kSharedMemoryTooLarge)
    return "v1 keeps every logit of the longest sequence in shared memory and max_seq_len is too long for it; use v2";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
