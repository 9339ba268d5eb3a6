// torch binding for rejection_sampler.cu: checks tensors, hands raw pointers and the stream
// (as an int) to the launcher. No c10/cuda includes. Built on demand by
// `kernels_cuda.load("rejection_sampler")`; spec_decode/cuda_ops.py converts ids to int32
// and makes every tensor contiguous before calling it.
#include <torch/extension.h>

int vfs_rejection_sample(int32_t* out, const int32_t* cu_num_draft, const int32_t* draft_ids, const float* draft_probs,
                         const float* target_probs, const int32_t* target_argmax, const int32_t* bonus_ids,
                         const int8_t* is_greedy, const float* uniform, const float* inv_exp, int batch, int vocab,
                         int out_stride, int64_t stream);
const char* vfs_rejection_sampler_error_string(int code);

namespace {

void check(const torch::Tensor& t, const char* name, torch::ScalarType dtype, int64_t dim) {
  TORCH_CHECK(t.is_cuda(), "rejection_sample (cuda): ", name, " must be on the GPU");
  TORCH_CHECK(t.scalar_type() == dtype, "rejection_sample (cuda): ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim && t.is_contiguous(), "rejection_sample (cuda): ", name, " must be a contiguous ", dim, "-D tensor");
}

template <typename T>
const T* optional_ptr(const c10::optional<torch::Tensor>& t, const char* name, torch::ScalarType dtype, int64_t dim) {
  if (!t.has_value()) return nullptr;
  check(*t, name, dtype, dim);
  return t->data_ptr<T>();
}

// out [batch, max_spec_len + 1] int32 (written whole); ids int32; probabilities fp32.
void rejection_sample(torch::Tensor out, torch::Tensor cu_num_draft, torch::Tensor draft_ids,
                      c10::optional<torch::Tensor> draft_probs, c10::optional<torch::Tensor> target_probs,
                      c10::optional<torch::Tensor> target_argmax, torch::Tensor bonus_ids,
                      c10::optional<torch::Tensor> is_greedy, torch::Tensor uniform, torch::Tensor inv_exp,
                      int64_t stream) {
  check(out, "out", torch::kInt32, 2);
  check(cu_num_draft, "cu_num_draft_tokens", torch::kInt32, 1);
  check(draft_ids, "draft_token_ids", torch::kInt32, 1);
  check(bonus_ids, "bonus_token_ids", torch::kInt32, 1);
  check(uniform, "uniform_probs", torch::kFloat32, 1);
  check(inv_exp, "inv_exponential", torch::kFloat32, 2);
  const int64_t batch = bonus_ids.size(0), vocab = inv_exp.size(1), num_tokens = draft_ids.size(0);
  TORCH_CHECK(cu_num_draft.size(0) == batch && inv_exp.size(0) == batch && out.size(0) == batch,
              "rejection_sample (cuda): batch sizes disagree");
  TORCH_CHECK(uniform.size(0) == num_tokens, "rejection_sample (cuda): uniform_probs must be [num_draft_total]");
  for (const auto* t : {&draft_probs, &target_probs}) {
    if (t->has_value()) {
      TORCH_CHECK((*t)->size(0) == num_tokens && (*t)->size(1) == vocab,
                  "rejection_sample (cuda): probabilities must be [num_draft_total, vocab]");
    }
  }
  TORCH_CHECK(target_probs.has_value() || is_greedy.has_value(), "rejection_sample (cuda): target_probs needed");
  TORCH_CHECK(!is_greedy.has_value() || target_argmax.has_value(), "rejection_sample (cuda): target_argmax needed");
  const int rc = vfs_rejection_sample(
      out.data_ptr<int32_t>(), cu_num_draft.data_ptr<int32_t>(), draft_ids.data_ptr<int32_t>(),
      optional_ptr<float>(draft_probs, "draft_probs", torch::kFloat32, 2),
      optional_ptr<float>(target_probs, "target_probs", torch::kFloat32, 2),
      optional_ptr<int32_t>(target_argmax, "target_argmax", torch::kInt32, 1), bonus_ids.data_ptr<int32_t>(),
      optional_ptr<int8_t>(is_greedy, "is_greedy", torch::kInt8, 1), uniform.data_ptr<float>(),
      inv_exp.data_ptr<float>(), static_cast<int>(batch), static_cast<int>(vocab), static_cast<int>(out.size(1)), stream);
  TORCH_CHECK(rc == 0, "rejection_sample (cuda) launch failed: ", vfs_rejection_sampler_error_string(rc));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rejection_sample", &rejection_sample,
        "Speculative-decoding rejection sampling: accepted drafts + recovered/bonus token per request");
}
