// Structured output's last step on the CPU: set to -inf every logit whose token the grammar
// forbids, reading the grammar's packed bitmask (one int32 word per 32 tokens).
//
// vLLM's structured output path (vllm/v1/structured_output/utils.py: apply_grammar_bitmask) hands
// the logits and the packed bitmask to xgrammar's apply_token_bitmask_inplace, which has a CUDA, a
// Triton and a C++ CPU kernel; this is our CPU one. Why a kernel pays at all: the mask is 32x
// smaller than the logits, and the PyTorch path first expands it to one element per token
// (shifts, a bool tensor as wide as the vocabulary) before it can masked_fill. Here each word is
// read once and decides 32 logits at a time:
//
//   * word == -1 (all 32 allowed): skip it -- one compare. A permissive grammar state (free text
//     inside a JSON string) allows almost every token, so almost every word is -1;
//   * word == 0 (none allowed): store -inf into all 32 -- a loop the compiler vectorises. A strict
//     state (after `{"`) allows a handful of tokens, so almost every word is 0;
//   * otherwise: walk only the forbidden bits (count-trailing-zeros, clear lowest bit).
//
// The logits are written as raw storage: -inf is one bit pattern per dtype (fp32 0xFF800000,
// bf16 0xFF80, fp16 0xFC00), so one body serves the three dtypes and allowed logits are never
// touched (not even re-written). Semantics (those of structured_output/reference.py, the oracle):
// mask row i applies to logits row rows[i] (all rows in order when there is no index list); bits
// past the vocabulary are ignored; tokens past the mask's 32 * words are forbidden.
//
// Threads split the vocabulary, not the rows: each thread owns a range of words and walks every
// mask row over it, so when two mask rows name the same logits row (a repeated index) no two
// threads ever write the same logit. A call smaller than kMinElementsPerThread runs on one thread.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "vec.h"    // only for vfs_cpu::kIsaName: the loops below are plain C++, vectorised by -O3

namespace {

// Tokens per thread before a second one is woken (2^18: up to 5 rows of a 49k vocabulary run on
// one thread). A row takes 5-30 us alone; a parallel region costs a few us to start and join, and
// on a busy machine the join waits for a descheduled worker (8 ms stalls were measured on 2 shared
// cores), so only batches big enough to be worth that risk are split.
constexpr int64_t kMinElementsPerThread = 1 << 18;

inline int ctz32(uint32_t x) { return __builtin_ctz(x); }

template <typename Bits>
void apply_kernel(Bits* logits, int64_t row_stride, const int32_t* mask, int64_t mask_row_stride, const int64_t* rows,
                  int64_t num_mask_rows, int64_t vocab_size, int64_t num_words, Bits neg_inf) {
  const int64_t row_words = (vocab_size + 31) / 32;    // words covering one logits row (some may be past the mask)
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerThread / (32 * std::max<int64_t>(1, num_mask_rows)));
  at::parallel_for(0, row_words, grain, [&](int64_t w_begin, int64_t w_end) {
    // ### BEGIN SOLUTION
    for (int64_t i = 0; i < num_mask_rows; ++i) {
      Bits* row = logits + (rows != nullptr ? rows[i] : i) * row_stride;
      const int32_t* words = mask + i * mask_row_stride;
      for (int64_t w = w_begin; w < w_end; ++w) {
        uint32_t allowed = w < num_words ? static_cast<uint32_t>(words[w]) : 0u;   // past the mask: forbidden
        const int64_t base = w * 32;
        const int64_t n = std::min<int64_t>(32, vocab_size - base);               // 1..32 tokens in this word
        if (n < 32) allowed |= ~0u << n;            // bits past the vocabulary: treat as allowed (untouched)
        if (allowed == ~0u) continue;               // the permissive case: nothing to do
        Bits* out = row + base;
        if (allowed == 0u) {                        // the strict case: 32 stores, vectorised
          for (int k = 0; k < 32; ++k) out[k] = neg_inf;
          continue;
        }
        for (uint32_t forbidden = ~allowed; forbidden != 0u; forbidden &= forbidden - 1u)
          out[ctz32(forbidden)] = neg_inf;          // only the forbidden bits, lowest first
      }
    }
    // ### END SOLUTION
  });
}

// logits [num_rows, vocab] fp32/bf16/fp16 with unit column stride (written in place); bitmask
// [num_mask_rows, words] int32 with unit column stride; rows: None, or int64 [num_mask_rows], each
// in [0, num_rows).
void apply_token_bitmask_inplace(at::Tensor& logits, const at::Tensor& bitmask, const c10::optional<at::Tensor>& rows) {
  TORCH_CHECK(logits.device().is_cpu() && bitmask.device().is_cpu(), "cpu token bitmask: CPU tensors only");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1,
              "cpu token bitmask: logits must be 2-D with contiguous rows, got ", logits.sizes(), " strides ",
              logits.strides());
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && (bitmask.size(1) <= 1 || bitmask.stride(1) == 1),
              "cpu token bitmask: bitmask must be 2-D int32 with contiguous rows, got ", bitmask.sizes(), " ",
              bitmask.scalar_type());
  const int64_t num_mask_rows = bitmask.size(0);
  const int64_t* row_ptr = nullptr;
  if (rows) {
    TORCH_CHECK(rows->dim() == 1 && rows->scalar_type() == at::kLong && rows->is_contiguous() &&
                    rows->size(0) == num_mask_rows,
                "cpu token bitmask: rows must be contiguous int64 [", num_mask_rows, "], got ", rows->sizes(), " ",
                rows->scalar_type());
    row_ptr = rows->data_ptr<int64_t>();
    for (int64_t i = 0; i < num_mask_rows; ++i)
      TORCH_CHECK(row_ptr[i] >= 0 && row_ptr[i] < logits.size(0), "cpu token bitmask: row index ", row_ptr[i],
                  " out of range for ", logits.size(0), " logits rows");
  } else {
    TORCH_CHECK(num_mask_rows == logits.size(0), "cpu token bitmask: ", num_mask_rows, " mask rows for ",
                logits.size(0), " logits rows and no row indices");
  }
  if (num_mask_rows == 0 || logits.size(1) == 0) return;
  const int32_t* mask = bitmask.data_ptr<int32_t>();
  switch (logits.scalar_type()) {
    case at::kFloat:
      apply_kernel<uint32_t>(static_cast<uint32_t*>(logits.data_ptr()), logits.stride(0), mask, bitmask.stride(0),
                             row_ptr, num_mask_rows, logits.size(1), bitmask.size(1), 0xFF800000u);
      break;
    case at::kBFloat16:
      apply_kernel<uint16_t>(static_cast<uint16_t*>(logits.data_ptr()), logits.stride(0), mask, bitmask.stride(0),
                             row_ptr, num_mask_rows, logits.size(1), bitmask.size(1), uint16_t{0xFF80});
      break;
    case at::kHalf:
      apply_kernel<uint16_t>(static_cast<uint16_t*>(logits.data_ptr()), logits.stride(0), mask, bitmask.stride(0),
                             row_ptr, num_mask_rows, logits.size(1), bitmask.size(1), uint16_t{0xFC00});
      break;
    default:
      TORCH_CHECK(false, "cpu token bitmask: logits must be float32, bfloat16 or float16, got ", logits.scalar_type());
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "apply a packed token bitmask to logits in place (-inf where forbidden), for the CPU";
  m.def("apply_token_bitmask_inplace", &apply_token_bitmask_inplace,
        "logits[rows[i]] = -inf wherever bit t % 32 of bitmask[i, t // 32] is 0", py::arg("logits"),
        py::arg("bitmask"), py::arg("rows"), py::call_guard<py::gil_scoped_release>());
  m.def("isa", [] { return std::string(vfs_cpu::kIsaName); }, "the instruction set this build was compiled for");
}
