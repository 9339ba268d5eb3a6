// Multi-LoRA's two products for the CPU: shrink (x -> the rank-r buffer, through each token's own
// A) and expand (the buffer -> y, through each token's own B, added in place).
//
// vLLM on a CPU runs these as torch ops (vllm/lora/ops/torch_ops/lora_ops.py, called by
// vllm/lora/punica_wrapper/punica_cpu.py): bgmv gathers a copy of the adapter for every token,
// sgmv expands its segments back to per-token indices and does the same. This is the kernel
// those ops stand for. Why it pays:
//
//   * tokens are grouped by adapter first (a counting sort of token_lora: one pass), and a work
//     item is (up to kTokensPerGroup tokens of ONE adapter, one slice[, one block of columns]):
//     the item reads its adapter's matrices once and keeps them in L1/L2 for all its tokens --
//     no per-token copy of an adapter (BGMV) and no Python loop over segments (SGMV);
//   * tokens without an adapter (-1) are skipped entirely: shrink writes their zero rows with
//     a memset and expand never touches their row of y;
//   * shrink is kRows dot products at once, x loaded once for all of them (vec.h: AVX-512, AVX2
//     or scalar; 8 independent accumulator chains keep the FMA units busy); expand first
//     transposes its [columns, rank] block of B into [rank, columns] (kBlockN columns, once per
//     group), so a token's columns are kBlockN independent sums -- rank broadcast-FMAs per
//     vector of columns, no horizontal reductions. Expand then runs at the speed of reading
//     and writing y (a prefill's y is megabytes); shrink at about half a matmul's speed.
//
// Numerics: fp32 arithmetic throughout (bf16 / fp16 inputs are converted on load), one rounding
// to y's dtype per element (round to nearest even, as torch's .to()), so the result differs
// from the reference (lora/reference.py) only in the order of the sums.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "vec.h"

namespace {

constexpr int64_t kTokensPerGroup = 32;  // tokens of one adapter per work item (expand: B's transpose amortised over them)
constexpr int kRows = 8;                 // shrink: rank rows (dot products) per pass over x
constexpr int64_t kBlockN = 64;          // expand: output columns per work item
constexpr int kVecs = kBlockN / vfs_cpu::W;   // ... as vectors (64 is a multiple of every ISA's width)
// Multiply-adds per thread before a second one is woken: a decode step's LoRA products are
// tens of microseconds, less than a parallel region can cost to start and join on a busy machine.
constexpr int64_t kMinMacsPerThread = 1 << 19;

// A run of tokens (positions [begin, end) of the sorted order) that share one adapter slot.
struct Group {
  int64_t slot, begin, end;
};

// Counting sort of the tokens by slot (stable; -1 dropped) into `order`, cut into groups of at
// most kTokensPerGroup tokens of one slot.
std::vector<Group> group_by_adapter(const int64_t* token_lora, int64_t num_tokens, int64_t num_slots,
                                    std::vector<int64_t>& order) {
  std::vector<int64_t> first(num_slots + 1, 0);
  for (int64_t t = 0; t < num_tokens; ++t)
    if (token_lora[t] >= 0) ++first[token_lora[t] + 1];
  for (int64_t i = 0; i < num_slots; ++i) first[i + 1] += first[i];        // slot i's tokens: [first[i], first[i+1])
  order.resize(first[num_slots]);
  std::vector<int64_t> next(first.begin(), first.end() - 1);
  for (int64_t t = 0; t < num_tokens; ++t)
    if (token_lora[t] >= 0) order[next[token_lora[t]]++] = t;
  std::vector<Group> groups;
  for (int64_t i = 0; i < num_slots; ++i)
    for (int64_t b = first[i]; b < first[i + 1]; b += kTokensPerGroup)
      groups.push_back({i, b, std::min(b + kTokensPerGroup, first[i + 1])});
  return groups;
}

// result[j] = x . a[j * n : (j + 1) * n] for j < R: R dot products of length n, x read once.
template <int R, typename T>
inline void dot_rows(const T* x, const T* a, int64_t n, float* result) {
  namespace v = vfs_cpu;                   // (qualified: in the scalar build V is float, and fma would be std's too)
  const v::Mask all = v::first_lanes(v::W);
  v::V acc[R];
  for (int j = 0; j < R; ++j) acc[j] = v::zero();
  int64_t i = 0;
  for (; i + v::W <= n; i += v::W) {
    const v::V xv = v::load(x + i, all);
    for (int j = 0; j < R; ++j) acc[j] = v::fma(xv, v::load(a + j * n + i, all), acc[j]);
  }
  for (int j = 0; j < R; ++j) {
    float sum = v::reduce_add(acc[j]);
    for (int64_t k = i; k < n; ++k) sum += v::to_float(x[k]) * v::to_float(a[j * n + k]);   // the tail
    result[j] = sum;
  }
}

// out[s, t, :] = scales[slot] * A[slot, s] x[t] for the tokens with an adapter; zeros for the rest.
template <typename T>
void shrink_kernel(const T* x, int64_t x_stride, const T* lora_a, const int64_t* token_lora, const float* scales,
                   float* out, int64_t num_tokens, int64_t num_slots, int64_t num_slices, int64_t max_rank,
                   int64_t hidden) {
  for (int64_t t = 0; t < num_tokens; ++t)                                   // no adapter: zero rows
    if (token_lora[t] < 0)
      for (int64_t s = 0; s < num_slices; ++s) std::memset(out + (s * num_tokens + t) * max_rank, 0, max_rank * sizeof(float));
  std::vector<int64_t> order;
  const std::vector<Group> groups = group_by_adapter(token_lora, num_tokens, num_slots, order);
  const int64_t items = static_cast<int64_t>(groups.size()) * num_slices;   // (group, slice)
  const int64_t grain = std::max<int64_t>(1, kMinMacsPerThread / std::max<int64_t>(1, kTokensPerGroup * max_rank * hidden));
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    // ### BEGIN SOLUTION
    for (int64_t item = begin; item < end; ++item) {
      const Group& g = groups[item / num_slices];
      const int64_t s = item % num_slices;
      const T* a = lora_a + (g.slot * num_slices + s) * max_rank * hidden;   // [max_rank, hidden], stays in cache
      const float scale = scales[g.slot];
      for (int64_t p = g.begin; p < g.end; ++p) {
        const int64_t t = order[p];
        const T* xt = x + t * x_stride;
        float* o = out + (s * num_tokens + t) * max_rank;
        int64_t r = 0;
        for (; r + kRows <= max_rank; r += kRows) dot_rows<kRows>(xt, a + r * hidden, hidden, o + r);
        for (; r < max_rank; ++r) dot_rows<1>(xt, a + r * hidden, hidden, o + r);
        for (int64_t j = 0; j < max_rank; ++j) o[j] *= scale;
      }
    }
    // ### END SOLUTION
  });
}

// y[t, off_s + n] (+)= sum_r buffer[s, t, r] * B[slot, s, n, r] for n < size_s, tokens with an adapter.
template <typename T>
void expand_kernel(const float* buffer, const T* lora_b, const int64_t* token_lora, T* y, int64_t y_stride,
                   const int64_t* offsets, const int64_t* sizes, bool add_inputs, int64_t num_tokens,
                   int64_t num_slots, int64_t num_slices, int64_t max_out, int64_t max_rank) {
  std::vector<int64_t> order;
  const std::vector<Group> groups = group_by_adapter(token_lora, num_tokens, num_slots, order);
  const int64_t blocks = (*std::max_element(sizes, sizes + num_slices) + kBlockN - 1) / kBlockN;
  const int64_t items = static_cast<int64_t>(groups.size()) * num_slices * blocks;   // (group, slice, block)
  const int64_t grain = std::max<int64_t>(1, kMinMacsPerThread / std::max<int64_t>(1, kTokensPerGroup * kBlockN * max_rank));
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> bt(std::max<int64_t>(1, max_rank) * kBlockN);      // B's block, transposed: [rank][kBlockN]
    const vfs_cpu::Mask all = vfs_cpu::first_lanes(vfs_cpu::W);
    // ### BEGIN SOLUTION
    for (int64_t item = begin; item < end; ++item) {
      const Group& g = groups[item / (num_slices * blocks)];
      const int64_t s = item / blocks % num_slices;
      const int64_t n0 = item % blocks * kBlockN;
      const int64_t nb = std::min(kBlockN, sizes[s] - n0);                    // columns of this block
      if (nb <= 0) continue;                                                  // past a narrower slice
      const T* b = lora_b + ((g.slot * num_slices + s) * max_out + n0) * max_rank;   // [nb, max_rank]
      std::fill(bt.begin(), bt.end(), 0.0f);
      for (int64_t n = 0; n < nb; ++n)
        for (int64_t r = 0; r < max_rank; ++r) bt[r * kBlockN + n] = vfs_cpu::to_float(b[n * max_rank + r]);
      for (int64_t p = g.begin; p < g.end; ++p) {
        const int64_t t = order[p];
        const float* u = buffer + (s * num_tokens + t) * max_rank;           // the token's rank-r vector
        vfs_cpu::V acc[kVecs];                                               // kBlockN sums, in registers
        for (int i = 0; i < kVecs; ++i) acc[i] = vfs_cpu::zero();
        for (int64_t r = 0; r < max_rank; ++r) {
          const vfs_cpu::V ur = vfs_cpu::set1(u[r]);
          const float* row = bt.data() + r * kBlockN;
          for (int i = 0; i < kVecs; ++i) acc[i] = vfs_cpu::fma(ur, vfs_cpu::load(row + i * vfs_cpu::W, all), acc[i]);
        }
        float sums[kBlockN];
        for (int i = 0; i < kVecs; ++i) vfs_cpu::store(sums + i * vfs_cpu::W, acc[i], all);
        T* yt = y + t * y_stride + offsets[s] + n0;
        for (int64_t n = 0; n < nb; ++n)                                     // one rounding to y's dtype
          vfs_cpu::from_float(add_inputs ? vfs_cpu::to_float(yt[n]) + sums[n] : sums[n], yt + n);
      }
    }
    // ### END SOLUTION
  });
}

template <typename F>
void dispatch(at::ScalarType dtype, const char* what, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(vfs_cpu::bf16{}); break;
    case at::kHalf: f(vfs_cpu::fp16{}); break;
    default: TORCH_CHECK(false, "cpu lora ops: ", what, " must be float32, bfloat16 or float16, got ", dtype);
  }
}

void check_token_lora(const at::Tensor& token_lora, int64_t num_tokens, int64_t num_slots) {
  TORCH_CHECK(token_lora.device().is_cpu() && token_lora.dim() == 1 && token_lora.scalar_type() == at::kLong &&
                  token_lora.is_contiguous() && token_lora.size(0) == num_tokens,
              "cpu lora ops: token_lora must be contiguous int64 [", num_tokens, "], got ", token_lora.sizes(), " ",
              token_lora.scalar_type());
  const int64_t* p = token_lora.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(p[t] >= -1 && p[t] < num_slots, "cpu lora ops: token_lora[", t, "] = ", p[t], " is not in [-1, ",
                num_slots, ")");
}

// x [T, in] (unit column stride), lora_a contiguous [slots, slices, rank, in] of x's dtype,
// token_lora int64 [T], scales float32 [slots], out contiguous float32 [slices, T, rank] (written).
void lora_shrink(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& token_lora,
                 const at::Tensor& scales, at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && lora_a.device().is_cpu() && out.device().is_cpu(), "cpu lora ops: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && (x.size(1) <= 1 || x.stride(1) == 1), "cpu lora ops: x must be 2-D with contiguous rows");
  TORCH_CHECK(lora_a.dim() == 4 && lora_a.is_contiguous() && lora_a.scalar_type() == x.scalar_type() &&
                  lora_a.size(3) == x.size(1),
              "cpu lora ops: lora_a must be contiguous [slots, slices, rank, ", x.size(1), "] of x's dtype, got ",
              lora_a.sizes(), " ", lora_a.scalar_type());
  const int64_t T = x.size(0), num_slots = lora_a.size(0), num_slices = lora_a.size(1), max_rank = lora_a.size(2);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 3 && out.size(0) == num_slices &&
                  out.size(1) == T && out.size(2) == max_rank,
              "cpu lora ops: out must be contiguous float32 [", num_slices, ", ", T, ", ", max_rank, "], got ", out.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == num_slots,
              "cpu lora ops: scales must be float32 [", num_slots, "]");
  check_token_lora(token_lora, T, num_slots);
  if (T == 0 || num_slices == 0 || max_rank == 0) return;
  dispatch(x.scalar_type(), "x", [&](auto tag) {
    using T_ = decltype(tag);
    shrink_kernel<T_>(static_cast<const T_*>(x.data_ptr()), x.stride(0), static_cast<const T_*>(lora_a.data_ptr()),
                      token_lora.data_ptr<int64_t>(), scales.data_ptr<float>(), out.data_ptr<float>(), T, num_slots,
                      num_slices, max_rank, x.size(1));
  });
}

// buffer contiguous float32 [slices, T, rank], lora_b contiguous [slots, slices, max_out, rank] of
// y's dtype, y [T, total_out] (unit column stride; written in place), offsets / sizes int64 [slices].
void lora_expand(const at::Tensor& buffer, const at::Tensor& lora_b, const at::Tensor& token_lora, at::Tensor& y,
                 const at::Tensor& offsets, const at::Tensor& sizes, bool add_inputs) {
  TORCH_CHECK(buffer.device().is_cpu() && lora_b.device().is_cpu() && y.device().is_cpu(), "cpu lora ops: CPU tensors only");
  TORCH_CHECK(y.dim() == 2 && (y.size(1) <= 1 || y.stride(1) == 1), "cpu lora ops: y must be 2-D with contiguous rows");
  TORCH_CHECK(lora_b.dim() == 4 && lora_b.is_contiguous() && lora_b.scalar_type() == y.scalar_type(),
              "cpu lora ops: lora_b must be contiguous [slots, slices, max_out, rank] of y's dtype, got ", lora_b.sizes(),
              " ", lora_b.scalar_type());
  const int64_t T = y.size(0), num_slots = lora_b.size(0), num_slices = lora_b.size(1), max_out = lora_b.size(2),
                max_rank = lora_b.size(3);
  TORCH_CHECK(buffer.scalar_type() == at::kFloat && buffer.is_contiguous() && buffer.dim() == 3 &&
                  buffer.size(0) == num_slices && buffer.size(1) == T && buffer.size(2) == max_rank,
              "cpu lora ops: buffer must be contiguous float32 [", num_slices, ", ", T, ", ", max_rank, "], got ",
              buffer.sizes());
  for (const at::Tensor* v : {&offsets, &sizes})
    TORCH_CHECK(v->scalar_type() == at::kLong && v->is_contiguous() && v->numel() == num_slices,
                "cpu lora ops: slice offsets and sizes must be int64 [", num_slices, "]");
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* size = sizes.data_ptr<int64_t>();
  for (int64_t s = 0; s < num_slices; ++s)
    TORCH_CHECK(size[s] >= 0 && size[s] <= max_out && off[s] >= 0 && off[s] + size[s] <= y.size(1),
                "cpu lora ops: slice ", s, " [", off[s], ", ", off[s] + size[s], ") does not fit y or lora_b");
  check_token_lora(token_lora, T, num_slots);
  if (T == 0 || num_slices == 0) return;
  dispatch(y.scalar_type(), "y", [&](auto tag) {
    using T_ = decltype(tag);
    expand_kernel<T_>(buffer.data_ptr<float>(), static_cast<const T_*>(lora_b.data_ptr()),
                      token_lora.data_ptr<int64_t>(), static_cast<T_*>(y.data_ptr()), y.stride(0), off, size,
                      add_inputs, T, num_slots, num_slices, max_out, max_rank);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "multi-LoRA shrink and expand (tokens grouped by adapter), for the CPU";
  m.def("lora_shrink", &lora_shrink, "out[s, t] = scales[i] * lora_a[i, s] @ x[t], i = token_lora[t] (zeros for -1)",
        py::arg("x"), py::arg("lora_a"), py::arg("token_lora"), py::arg("scales"), py::arg("out"),
        py::call_guard<py::gil_scoped_release>());
  m.def("lora_expand", &lora_expand,
        "y[t, off_s:off_s+size_s] (+)= lora_b[i, s, :size_s] @ buffer[s, t] for tokens with an adapter i",
        py::arg("buffer"), py::arg("lora_b"), py::arg("token_lora"), py::arg("y"), py::arg("offsets"),
        py::arg("sizes"), py::arg("add_inputs"), py::call_guard<py::gil_scoped_release>());
  m.def("isa", [] { return std::string(vfs_cpu::kIsaName); }, "the instruction set this build was compiled for");
}
