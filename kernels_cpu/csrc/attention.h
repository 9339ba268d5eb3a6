// Unified paged attention on the CPU: the interface between the torch binding
// (attention_binding.cpp) and the kernel (attention_kernel.cpp).
//
// The kernel sees raw pointers and element strides only, so its translation unit includes
// no torch header: it compiles in about a second with the instruction-set flags, and the
// slow torch-header compile happens once, in the binding.
#pragma once

#include <cstdint>
#include <vector>

namespace vfs_cpu {

enum class DType : int { F32 = 0, BF16 = 1, F16 = 2 };
// What the K/V caches store (paged_attention/kv_quant.py): the query's dtype, or 8 bits.
enum class KVDType : int { SAME = 0, INT8 = 1, FP8 = 2 };

struct AttentionParams {
  // query [num_tokens, num_heads, head_dim]; out has the same shape (both unit last stride)
  const void* query;
  int64_t q_stride_token, q_stride_head;
  void* out;
  int64_t o_stride_token, o_stride_head;
  // key/value cache [num_blocks, block_size, num_kv_heads, head_dim] (unit last stride)
  const void* key_cache;
  const void* value_cache;
  int64_t k_stride_block, k_stride_token, k_stride_head;
  int64_t v_stride_block, v_stride_token, v_stride_head;
  // index tensors, int32, read on the host: block_tables [num_seqs, bt_stride] rows,
  // seq_lens [num_seqs], query_start_loc [num_seqs + 1]
  const int32_t* block_tables;
  int64_t bt_stride;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  int num_seqs, num_heads, num_kv_heads, head_dim, block_size;
  float scale;
  DType dtype;
  // 8-bit caches: rows are head_dim numbers, times k_scale / v_scale (per-tensor fp8), or
  // followed by their own fp32 scale (inline_scales: per token and head; head_dim + 4 bytes).
  // (Defaults: a float cache, so a caller that predates 8-bit caches gets what it got before.)
  KVDType kv_dtype = KVDType::SAME;
  bool inline_scales = false;
  float k_scale = 1.0f, v_scale = 1.0f;
  // Tree verification (EAGLE-2 drafts, chapter 04): request s's new tokens see each other only
  // where its [q_len, q_len] mask (row-major bytes, 1 = visible) at tree_mask + tree_mask_start[s]
  // says so; start -1 (or no tree_mask at all): causal. A mask keeps a subset of causal (a node
  // comes after its ancestors), so the plan's causal KV bounds hold. vLLM: the tree attention bias.
  const uint8_t* tree_mask = nullptr;
  const int64_t* tree_mask_start = nullptr;
  int num_threads;  // OpenMP threads (the binding passes torch's intra-op thread count)
  int kv_splits;    // 0: automatic; k >= 1: split every work item's KV range into k pieces (tests)
  int q_tile;       // 0: automatic; q >= 1: query tokens per work item (tests)
};

// Fills p.out. Never reads a block-table entry past a request's ceil(seq_len / block_size)
// blocks, nor a cache row at or past its seq_len.
void unified_attention(const AttentionParams& p);

// One K or V row [head_dim] of `dtype` -> an 8-bit cache row (int8 / fp8 e4m3), quantized with
// `tensor_scale`, or with its own absmax scale stored after it (inline_scales).
void quantize_row(const void* src, DType dtype, void* dst, KVDType kv_dtype, int head_dim, bool inline_scales,
                  float tensor_scale);

// One work item of the plan, for inspection (tests, teaching): new tokens
// [q_begin, q_begin + q_count) of request `seq`, KV heads [kv_head, kv_head + num_kv_heads),
// KV positions [kv_begin, kv_end); `split`: a piece whose partial result is merged later.
struct PlannedItem {
  int seq, kv_head, num_kv_heads, q_begin, q_count, kv_begin, kv_end;
  bool split;
};
// The items unified_attention(p) runs (only the index pointers, shapes and knobs of p are read).
std::vector<PlannedItem> plan(const AttentionParams& p);

const char* isa_name();   // "avx512" | "avx2" | "scalar": what this build was compiled for
int vector_width();       // fp32 lanes per vector in this build

}  // namespace vfs_cpu
