// torch binding of the CPU attention kernel: checks what the kernel relies on (layouts,
// dtypes, devices), turns tensors into pointers + element strides, and releases the GIL.
// The argument semantics (values of the index tensors) are checked in Python, by
// the callers (chapters 01 and 05: paged_attention.checks), as for every other backend.
//
// Lighter headers than <torch/extension.h> (which pulls in all of libtorch's C++ API):
// the one-time build compiles less.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <cstring>
#include <tuple>
#include <vector>

#include "attention.h"

namespace {

vfs_cpu::DType to_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return vfs_cpu::DType::F32;
    case at::kBFloat16: return vfs_cpu::DType::BF16;
    case at::kHalf: return vfs_cpu::DType::F16;
    default: TORCH_CHECK(false, "cpu attention: unsupported dtype ", t.scalar_type(), " (float32, bfloat16, float16)");
  }
}

// What the caches store: the query's dtype, int8 or fp8 e4m3 (paged_attention/kv_quant.py).
vfs_cpu::KVDType to_kv_dtype(const at::Tensor& cache, at::ScalarType dtype) {
  if (cache.scalar_type() == at::kChar) return vfs_cpu::KVDType::INT8;
  if (cache.scalar_type() == at::kFloat8_e4m3fn) return vfs_cpu::KVDType::FP8;
  TORCH_CHECK(cache.scalar_type() == dtype, "cpu attention: the caches hold ", cache.scalar_type(), " but the rows are ",
              dtype, " (a cache is the rows' dtype, int8 or float8_e4m3fn)");
  return vfs_cpu::KVDType::SAME;
}

// An 8-bit cache's row: head_dim numbers (per-tensor scales), or head_dim + 4 (its own fp32 scale after them).
bool has_inline_scales(vfs_cpu::KVDType kv, int64_t row, int64_t head_dim, const char* what) {
  const bool inline_scales = kv != vfs_cpu::KVDType::SAME && row == head_dim + 4;
  TORCH_CHECK(row == head_dim || inline_scales, what, ": cache rows hold ", row, " elements for head_dim ", head_dim,
              " (an 8-bit cache with per-row scales holds head_dim + 4)");
  TORCH_CHECK(!inline_scales || head_dim % 4 == 0, what, ": per-row scales need head_dim % 4 == 0 (an aligned fp32)");
  return inline_scales;
}

void check_index(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), "cpu attention: ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kInt, "cpu attention: ", name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, "cpu attention: ", name, " must be ", dim, "-D, got ", t.sizes());
  TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1, "cpu attention: ", name, " must have a unit last stride");
}

// out [T, H, D] <- attention of query [T, H, D] over the paged caches [N, B, KVH, D].
void unified_attention_out(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale, int64_t kv_splits, int64_t q_tile,
                           double k_scale, double v_scale, const c10::optional<at::Tensor>& tree_mask,
                           const c10::optional<at::Tensor>& tree_mask_start) {
  for (const at::Tensor* t : {&out, &query, &key_cache, &value_cache})
    TORCH_CHECK(t->device().is_cpu(), "cpu attention: tensors must be on the CPU, got ", t->device());
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "cpu attention: query/out must be [T, H, D], got ",
              query.sizes(), " and ", out.sizes());
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "cpu attention: caches must be [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(key_cache.size(2) > 0 && query.size(1) % key_cache.size(2) == 0,
              "cpu attention: num_heads must be a multiple of num_kv_heads");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(out.scalar_type() == dtype && key_cache.scalar_type() == value_cache.scalar_type(),
              "cpu attention: query and out must share one dtype, and the two caches another");
  const vfs_cpu::KVDType kv_dtype = to_kv_dtype(key_cache, dtype);
  const bool inline_scales = has_inline_scales(kv_dtype, key_cache.size(3), query.size(2), "cpu attention");
  TORCH_CHECK(kv_dtype != vfs_cpu::KVDType::SAME || (k_scale == 1.0 && v_scale == 1.0),
              "cpu attention: k_scale / v_scale are for an 8-bit cache");
  for (const at::Tensor* t : {&out, &query, &key_cache, &value_cache})
    TORCH_CHECK(t->stride(-1) == 1, "cpu attention: the head_dim axis must be contiguous (unit stride), got strides ",
                t->strides());
  check_index(block_tables, "block_tables", 2);
  check_index(seq_lens, "seq_lens", 1);
  check_index(query_start_loc, "query_start_loc", 1);
  TORCH_CHECK(seq_lens.is_contiguous() && query_start_loc.is_contiguous(),
              "cpu attention: seq_lens and query_start_loc must be contiguous");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs,
              "cpu attention: index tensors disagree on num_seqs");

  vfs_cpu::AttentionParams p{};
  p.query = query.data_ptr();
  p.q_stride_token = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.out = out.data_ptr();
  p.o_stride_token = out.stride(0);
  p.o_stride_head = out.stride(1);
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.k_stride_block = key_cache.stride(0);
  p.k_stride_token = key_cache.stride(1);
  p.k_stride_head = key_cache.stride(2);
  p.v_stride_block = value_cache.stride(0);
  p.v_stride_token = value_cache.stride(1);
  p.v_stride_head = value_cache.stride(2);
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.bt_stride = block_tables.stride(0);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.num_seqs = int(num_seqs);
  p.num_heads = int(query.size(1));
  p.num_kv_heads = int(key_cache.size(2));
  p.head_dim = int(query.size(2));
  p.block_size = int(key_cache.size(1));
  p.scale = float(scale);
  p.dtype = to_dtype(query);
  p.kv_dtype = kv_dtype;
  p.inline_scales = inline_scales;
  p.k_scale = float(k_scale);
  p.v_scale = float(v_scale);
  // Tree masks: bytes [sum of the masked requests' q_len^2] and int64 starts [num_seqs] (-1: causal).
  // Their values (square, lower-triangular with the diagonal set) are checked in Python.
  TORCH_CHECK(tree_mask.has_value() == tree_mask_start.has_value(), "cpu attention: tree_mask and tree_mask_start "
              "come together");
  if (tree_mask.has_value()) {
    TORCH_CHECK(tree_mask->device().is_cpu() && tree_mask->is_contiguous() && tree_mask->dim() == 1 &&
                    (tree_mask->scalar_type() == at::kByte || tree_mask->scalar_type() == at::kBool),
                "cpu attention: tree_mask must be a contiguous 1-D uint8/bool CPU tensor");
    TORCH_CHECK(tree_mask_start->device().is_cpu() && tree_mask_start->is_contiguous() &&
                    tree_mask_start->scalar_type() == at::kLong && tree_mask_start->dim() == 1 &&
                    tree_mask_start->size(0) == num_seqs,
                "cpu attention: tree_mask_start must be a contiguous int64 [num_seqs] CPU tensor");
    p.tree_mask = static_cast<const uint8_t*>(tree_mask->data_ptr());
    p.tree_mask_start = tree_mask_start->data_ptr<int64_t>();
  }
  p.num_threads = at::get_num_threads();   // torch.set_num_threads is respected
  p.kv_splits = int(kv_splits);
  p.q_tile = int(q_tile);
  if (query.size(0) == 0 || num_seqs == 0) return;
  pybind11::gil_scoped_release no_gil;     // other Python threads may run meanwhile
  vfs_cpu::unified_attention(p);
}

// reshape_and_cache for the CPU: key/value [T, KVH, D] rows copied to the cache rows their slots name
// (slot = block * block_size + offset; -1: skip), as vLLM's csrc/cpu/cache.cpp does. The torch path
// (cache_ops.py) builds index tensors and runs two index_put_s per layer, which at a decode step's few
// rows cost more than the copy itself; this is a row copy per token and head. Every slot is
// range-checked BEFORE anything is written — a bad slot raises and the cache is untouched — whatever
// the caller's check_values says: here a bad slot would write outside the cache.
template <typename Index>
void copy_rows(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
               const at::Tensor& value_cache, const at::Tensor& slot_mapping, double k_scale, double v_scale) {
  const Index* slots = slot_mapping.data_ptr<Index>();
  const int64_t slot_stride = slot_mapping.stride(0);
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1);
  const int64_t block_size = key_cache.size(1), num_slots = key_cache.size(0) * block_size;
  for (int64_t i = 0; i < num_tokens; ++i) {
    const int64_t slot = slots[i * slot_stride];
    TORCH_CHECK(slot >= -1 && slot < num_slots, "reshape_and_cache: slot_mapping[", i, "] = ", slot,
                " is outside the cache's slots [0, ", num_slots, ") and not -1 (skip); nothing was written");
  }
  const int64_t elem = key.element_size(), row_bytes = key.size(2) * elem;
  // An 8-bit cache (paged_attention/kv_quant.py): each row is quantized on its way in.
  const vfs_cpu::KVDType kv = to_kv_dtype(key_cache, key.scalar_type());
  const bool inline_scales = has_inline_scales(kv, key_cache.size(3), key.size(2), "reshape_and_cache");
  const vfs_cpu::DType dtype = kv == vfs_cpu::KVDType::SAME ? vfs_cpu::DType::F32 : to_dtype(key);
  const int head_dim = int(key.size(2));
  const int64_t cache_elem = key_cache.element_size();
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  // Byte offsets: row h of token i, and of cache slot (block, offset).
  auto src = [elem](const at::Tensor& t, int64_t i, int64_t h) { return (i * t.stride(0) + h * t.stride(1)) * elem; };
  auto dst = [cache_elem](const at::Tensor& t, int64_t block, int64_t offset, int64_t h) {
    return (block * t.stride(0) + offset * t.stride(1) + h * t.stride(2)) * cache_elem;
  };
  const int64_t k_head = src(key, 0, 1), v_head = src(value, 0, 1);
  const int64_t kc_head = dst(key_cache, 0, 0, 1), vc_head = dst(value_cache, 0, 0, 1);
  // A decode step's few rows stay on this thread; a prefill chunk's thousands are split.
  at::parallel_for(0, num_tokens, 512, [&](int64_t begin, int64_t end) {
    // ### BEGIN SOLUTION
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = slots[i * slot_stride];
      if (slot < 0) continue;
      const int64_t block = slot / block_size, offset = slot % block_size;
      const char* k_row = k + src(key, i, 0);
      const char* v_row = v + src(value, i, 0);
      char* kc_row = kc + dst(key_cache, block, offset, 0);
      char* vc_row = vc + dst(value_cache, block, offset, 0);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        if (kv == vfs_cpu::KVDType::SAME) {
          std::memcpy(kc_row + h * kc_head, k_row + h * k_head, row_bytes);
          std::memcpy(vc_row + h * vc_head, v_row + h * v_head, row_bytes);
        } else {
          vfs_cpu::quantize_row(k_row + h * k_head, dtype, kc_row + h * kc_head, kv, head_dim, inline_scales, float(k_scale));
          vfs_cpu::quantize_row(v_row + h * v_head, dtype, vc_row + h * vc_head, kv, head_dim, inline_scales, float(v_scale));
        }
      }
    }
    // ### END SOLUTION
  });
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& slot_mapping, double k_scale, double v_scale) {
  for (const at::Tensor* t : {&key, &value, &key_cache, &value_cache, &slot_mapping})
    TORCH_CHECK(t->device().is_cpu(), "reshape_and_cache: tensors must be on the CPU, got ", t->device());
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes(), "reshape_and_cache: key/value must be [T, KVH, D]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() && key_cache.size(2) == key.size(1),
              "reshape_and_cache: caches must be [num_blocks, block_size, KVH, D] matching key's rows");
  const auto dtype = key.scalar_type();
  TORCH_CHECK(value.scalar_type() == dtype && key_cache.scalar_type() == value_cache.scalar_type(),
              "reshape_and_cache: key and value must share one dtype, and the two caches another");
  has_inline_scales(to_kv_dtype(key_cache, dtype), key_cache.size(3), key.size(2), "reshape_and_cache");
  for (const at::Tensor* t : {&key, &value, &key_cache, &value_cache})
    TORCH_CHECK(t->stride(-1) == 1, "reshape_and_cache: the head_dim axis must be contiguous, got strides ",
                t->strides());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0),
              "reshape_and_cache: slot_mapping must be [num_tokens]");
  pybind11::gil_scoped_release no_gil;
  if (slot_mapping.scalar_type() == at::kLong)
    return copy_rows<int64_t>(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kInt, "reshape_and_cache: slot_mapping must be int32 or int64");
  copy_rows<int32_t>(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale);
}

// The kernel's work items for these index tensors, as tuples
// (seq, kv_head, num_kv_heads, q_begin, q_count, kv_begin, kv_end, split).
std::vector<std::tuple<int, int, int, int, int, int, int, bool>> plan_items(
    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t num_heads, int64_t num_kv_heads,
    int64_t num_threads, int64_t kv_splits, int64_t q_tile) {
  check_index(seq_lens, "seq_lens", 1);
  check_index(query_start_loc, "query_start_loc", 1);
  TORCH_CHECK(seq_lens.is_contiguous() && query_start_loc.is_contiguous() &&
                  query_start_loc.size(0) == seq_lens.size(0) + 1,
              "cpu attention plan: contiguous seq_lens [S] and query_start_loc [S + 1] expected");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  vfs_cpu::AttentionParams p{};
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.num_seqs = int(seq_lens.size(0));
  p.num_heads = int(num_heads);
  p.num_kv_heads = int(num_kv_heads);
  p.num_threads = num_threads > 0 ? int(num_threads) : at::get_num_threads();
  p.kv_splits = int(kv_splits);
  p.q_tile = int(q_tile);
  std::vector<std::tuple<int, int, int, int, int, int, int, bool>> out;
  for (const auto& w : vfs_cpu::plan(p))
    out.emplace_back(w.seq, w.kv_head, w.num_kv_heads, w.q_begin, w.q_count, w.kv_begin, w.kv_end, w.split);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Unified paged attention for the CPU (see kernels_cpu/attention.py)";
  m.def("unified_attention_out", &unified_attention_out, "out <- paged attention (varlen, causal with context)",
        pybind11::arg("out"), pybind11::arg("query"), pybind11::arg("key_cache"), pybind11::arg("value_cache"),
        pybind11::arg("block_tables"), pybind11::arg("seq_lens"), pybind11::arg("query_start_loc"),
        pybind11::arg("scale"), pybind11::arg("kv_splits") = 0, pybind11::arg("q_tile") = 0,
        pybind11::arg("k_scale") = 1.0, pybind11::arg("v_scale") = 1.0, pybind11::arg("tree_mask") = pybind11::none(),
        pybind11::arg("tree_mask_start") = pybind11::none());
  m.def("plan", &plan_items, "the work items unified_attention_out would run", pybind11::arg("seq_lens"),
        pybind11::arg("query_start_loc"), pybind11::arg("num_heads"), pybind11::arg("num_kv_heads"),
        pybind11::arg("num_threads") = 0, pybind11::arg("kv_splits") = 0, pybind11::arg("q_tile") = 0);
  m.def("reshape_and_cache", &reshape_and_cache, "key/value rows -> the cache rows their slots name (-1: skip)",
        pybind11::arg("key"), pybind11::arg("value"), pybind11::arg("key_cache"), pybind11::arg("value_cache"),
        pybind11::arg("slot_mapping"), pybind11::arg("k_scale") = 1.0, pybind11::arg("v_scale") = 1.0);
  m.def("isa", &vfs_cpu::isa_name, "instruction set this build targets");
  m.def("vector_width", &vfs_cpu::vector_width, "fp32 lanes per vector in this build");
}
