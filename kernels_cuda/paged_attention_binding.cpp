// torch binding for paged_attention.cu (vLLM: csrc/torch_bindings.cpp + the op wrappers in
// vllm/_custom_ops.py). Checks every tensor, then passes raw pointers, sizes, strides and
// the stream (as an int) to the launchers. No c10/cuda includes: the CUDA side lives in the
// .cu file only. Built on demand by `kernels_cuda.load("paged_attention")`.
#include <torch/extension.h>

int vfs_paged_attention_v1(int dtype, int head_size, int block_size, void* out, const void* q, const void* k_cache,
                           const void* v_cache, const int* block_tables, const int* seq_lens, int num_seqs,
                           int num_heads, int num_kv_heads, int max_num_blocks_per_seq, int max_seq_len,
                           float scale, int kv_cache_kind, bool kv_per_row, float k_scale, float v_scale,
                           const int64_t* strides, int64_t stream);
int vfs_paged_attention_v2(int dtype, int head_size, int block_size, void* out, float* exp_sums, float* max_logits,
                           float* tmp_out, const void* q, const void* k_cache, const void* v_cache,
                           const int* block_tables, const int* seq_lens, int num_seqs, int num_heads,
                           int num_kv_heads, int max_num_blocks_per_seq, int max_seq_len, float scale,
                           int kv_cache_kind, bool kv_per_row, float k_scale, float v_scale, const int64_t* strides,
                           int64_t stream);
int vfs_paged_attention_v3(int dtype, int head_size, int block_size, void* out, float* exp_sums, float* max_logits,
                           float* tmp_out, const void* q, const void* k_cache, const void* v_cache,
                           const int* block_tables, const int* seq_lens, int num_seqs, int num_heads,
                           int num_kv_heads, int max_num_blocks_per_seq, int max_seq_len, float scale,
                           int kv_cache_kind, bool kv_per_row, float k_scale, float v_scale, const int64_t* strides,
                           int64_t stream);
int vfs_paged_attention_partition_size();
const char* vfs_paged_attention_error_string(int code);

namespace {

int dtype_code(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return 0;
    case torch::kFloat16: return 1;
    case torch::kBFloat16: return 2;
    default: TORCH_CHECK(false, "paged_attention (cuda): unsupported dtype ", t.scalar_type(), " (float32, float16, bfloat16)");
  }
  return -1;
}

// An 8-bit cache (paged_attention/kv_quant.py): kind 1 int8, 2 fp8 e4m3fn; per_row: each row is
// head_size bytes + its fp32 scale. Kind 0: a float cache of the query's dtype.
struct KVArgs {
  int64_t kind;
  bool per_row;
  double k_scale, v_scale;
};

// Everything every version needs; returns the strides array the launcher takes.
std::array<int64_t, 9> check_decode(const torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                                    const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                                    const torch::Tensor& seq_lens, int64_t max_seq_len, const KVArgs& kv) {
  for (const auto* t : {&out, &query, &key_cache, &value_cache, &block_tables, &seq_lens}) {
    TORCH_CHECK(t->is_cuda(), "paged_attention (cuda): all tensors must be on the GPU");
    TORCH_CHECK(t->device() == query.device(), "paged_attention (cuda): all tensors must be on one device");
  }
  TORCH_CHECK(query.dim() == 3, "query must be [num_seqs, num_heads, head_size]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "key_cache/value_cache must be [num_blocks, block_size, num_kv_heads, head_size]");
  TORCH_CHECK(kv.kind >= 0 && kv.kind <= 2 && (kv.kind != 0 || !kv.per_row), "paged_attention (cuda): bad KV cache kind");
  TORCH_CHECK(key_cache.size(3) == query.size(2) + (kv.per_row ? 4 : 0),
              "head_size of query and cache differ (a per-token-head cache row is head_size + 4 bytes)");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  const auto cache_type = kv.kind == 0 ? query.scalar_type() : kv.kind == 1 ? torch::kInt8 : torch::kFloat8_e4m3fn;
  TORCH_CHECK(key_cache.scalar_type() == cache_type && value_cache.scalar_type() == cache_type &&
                  out.scalar_type() == query.scalar_type(),
              "query and out must share one dtype; the caches are of it, or int8 / float8_e4m3fn (an 8-bit cache)");
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous(), "out must be a contiguous tensor shaped like query");
  TORCH_CHECK(query.stride(2) == 1, "query's head_size dim must be contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == query.size(0) &&
                  block_tables.scalar_type() == torch::kInt32 && block_tables.stride(1) == 1,
              "block_tables must be int32 [num_seqs, max_num_blocks] with contiguous rows");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == query.size(0) && seq_lens.scalar_type() == torch::kInt32 &&
                  seq_lens.is_contiguous(),
              "seq_lens must be a contiguous int32 [num_seqs]");
  TORCH_CHECK(max_seq_len >= 1, "max_seq_len must be >= 1");
  // The kernels read a float cache's rows with 16-byte vector loads, an 8-bit cache's with loads
  // of up to 4 bytes (its per-token-head rows are head_size + 4 bytes).
  const int64_t elem = key_cache.element_size(), align = kv.kind == 0 ? 16 : 4;
  for (const auto* t : {&key_cache, &value_cache}) {
    TORCH_CHECK(t->stride(3) == 1, "the cache's head_size dim must be contiguous");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % align == 0 && (t->stride(0) * elem) % align == 0 &&
                    (t->stride(1) * elem) % align == 0 && (t->stride(2) * elem) % align == 0,
                "paged_attention (cuda): cache rows must be ", align, "-byte aligned (data pointer and strides)");
  }
  return {block_tables.stride(0), query.stride(0),     query.stride(1),     key_cache.stride(0), key_cache.stride(1),
          key_cache.stride(2),    value_cache.stride(0), value_cache.stride(1), value_cache.stride(2)};
}

void check_rc(int rc, const char* what) {
  TORCH_CHECK(rc == 0, what, " (cuda) failed: ", vfs_paged_attention_error_string(rc));
}

void paged_attention_v1(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                        torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t max_seq_len,
                        int64_t kv_cache_kind, bool kv_per_row, double k_scale, double v_scale, int64_t stream) {
  const KVArgs kv{kv_cache_kind, kv_per_row, k_scale, v_scale};
  const auto strides = check_decode(out, query, key_cache, value_cache, block_tables, seq_lens, max_seq_len, kv);
  check_rc(vfs_paged_attention_v1(dtype_code(query), query.size(2), key_cache.size(1), out.data_ptr(), query.data_ptr(),
                                  key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr<int>(),
                                  seq_lens.data_ptr<int>(), query.size(0), query.size(1), key_cache.size(2),
                                  block_tables.size(1), max_seq_len, static_cast<float>(scale), kv.kind, kv.per_row,
                                  static_cast<float>(kv.k_scale), static_cast<float>(kv.v_scale), strides.data(), stream),
           "paged_attention_v1");
}

// The partition scratch v2 and split v3 write (v2's reduce reads it).
void check_partition_scratch(const torch::Tensor& exp_sums, const torch::Tensor& max_logits,
                             const torch::Tensor& tmp_out, const torch::Tensor& query, int64_t max_seq_len) {
  const int64_t partition_size = vfs_paged_attention_partition_size();
  const int64_t max_num_partitions = (max_seq_len + partition_size - 1) / partition_size;
  const std::vector<int64_t> part_shape = {query.size(0), query.size(1), max_num_partitions};
  const std::vector<int64_t> tmp_shape = {query.size(0), query.size(1), max_num_partitions, query.size(2)};
  for (const auto* t : {&exp_sums, &max_logits}) {
    TORCH_CHECK(t->is_cuda() && t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->sizes() == part_shape,
                "exp_sums/max_logits must be contiguous fp32 [num_seqs, num_heads, max_num_partitions]");
  }
  TORCH_CHECK(tmp_out.is_cuda() && tmp_out.scalar_type() == torch::kFloat32 && tmp_out.is_contiguous() &&
                  tmp_out.sizes() == tmp_shape,
              "tmp_out must be contiguous fp32 [num_seqs, num_heads, max_num_partitions, head_size]");
}

void paged_attention_v2(torch::Tensor out, torch::Tensor exp_sums, torch::Tensor max_logits, torch::Tensor tmp_out,
                        torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                        torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t max_seq_len,
                        int64_t kv_cache_kind, bool kv_per_row, double k_scale, double v_scale, int64_t stream) {
  const KVArgs kv{kv_cache_kind, kv_per_row, k_scale, v_scale};
  const auto strides = check_decode(out, query, key_cache, value_cache, block_tables, seq_lens, max_seq_len, kv);
  check_partition_scratch(exp_sums, max_logits, tmp_out, query, max_seq_len);
  check_rc(vfs_paged_attention_v2(dtype_code(query), query.size(2), key_cache.size(1), out.data_ptr(),
                                  exp_sums.data_ptr<float>(), max_logits.data_ptr<float>(), tmp_out.data_ptr<float>(),
                                  query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                                  block_tables.data_ptr<int>(), seq_lens.data_ptr<int>(), query.size(0), query.size(1),
                                  key_cache.size(2), block_tables.size(1), max_seq_len, static_cast<float>(scale),
                                  kv.kind, kv.per_row, static_cast<float>(kv.k_scale), static_cast<float>(kv.v_scale),
                                  strides.data(), stream),
           "paged_attention_v2");
}

// v3 (flash-decoding, one thread block per KV head group): exp_sums, max_logits and tmp_out all
// given (shaped as for v2) = split-KV over 512-token partitions + v2's reduce; all None = no split.
void paged_attention_v3(torch::Tensor out, std::optional<torch::Tensor> exp_sums,
                        std::optional<torch::Tensor> max_logits, std::optional<torch::Tensor> tmp_out,
                        torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                        torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t max_seq_len,
                        int64_t kv_cache_kind, bool kv_per_row, double k_scale, double v_scale, int64_t stream) {
  const KVArgs kv{kv_cache_kind, kv_per_row, k_scale, v_scale};
  const auto strides = check_decode(out, query, key_cache, value_cache, block_tables, seq_lens, max_seq_len, kv);
  const bool split = tmp_out.has_value();
  TORCH_CHECK(exp_sums.has_value() == split && max_logits.has_value() == split,
              "paged_attention_v3: pass exp_sums, max_logits and tmp_out together (split) or none of them");
  if (split) check_partition_scratch(*exp_sums, *max_logits, *tmp_out, query, max_seq_len);
  check_rc(vfs_paged_attention_v3(dtype_code(query), query.size(2), key_cache.size(1), out.data_ptr(),
                                  split ? exp_sums->data_ptr<float>() : nullptr,
                                  split ? max_logits->data_ptr<float>() : nullptr,
                                  split ? tmp_out->data_ptr<float>() : nullptr, query.data_ptr(),
                                  key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr<int>(),
                                  seq_lens.data_ptr<int>(), query.size(0), query.size(1), key_cache.size(2),
                                  block_tables.size(1), max_seq_len, static_cast<float>(scale), kv.kind, kv.per_row,
                                  static_cast<float>(kv.k_scale), static_cast<float>(kv.v_scale), strides.data(), stream),
           "paged_attention_v3");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_v1", &paged_attention_v1, "Paged decode attention, one thread block per (head, seq)");
  m.def("paged_attention_v2", &paged_attention_v2,
        "Paged decode attention over 512-token partitions + a reduce kernel (long contexts)");
  m.def("paged_attention_v3", &paged_attention_v3,
        "Paged decode attention, flash-decoding style: one thread block per (KV head group, seq[, partition])");
  m.def("partition_size", &vfs_paged_attention_partition_size);
}
