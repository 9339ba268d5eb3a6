// The decoder's small ops fused for the CPU: RMSNorm (with the residual add), SiLU-and-mul,
// and RoPE applied while q/k/v are split out of the qkv projection.
//
// vLLM's CPU build has the same three (csrc/cpu/layernorm.cpp: rms_norm, fused_add_rms_norm;
// csrc/cpu/activation.cpp: silu_and_mul; csrc/cpu/pos_encoding.cpp: rotary_embedding). Why
// they pay: in PyTorch each is 3-8 separate ops, and each op is a pass over the activations
// (a prefill step's [4096, 576] fp32 rows are 9.4 MB: they do not stay in cache between ops)
// plus a dispatch of a few microseconds (a decode step runs 30 layers x ~20 such ops). A
// fused op reads its input once and writes its output once.
//
// Numerics: each op rounds to the activation dtype exactly where the PyTorch version does
// (HF's order, see mini_vllm/models/layers.py), and RoPE and the residual add use the same roundings
// in the same order, so they are bit for bit the torch result (compiled with
// -ffp-contract=off: no fused multiply-adds the torch ops do not do). The RMSNorm statistics
// (a sum over the row) and exp() in SiLU differ from torch's in the last bits: the sum is
// accumulated in another order, exp is libm's, not torch's vectorised one.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>

// The kernels' vector wrapper (AVX-512 / AVX2 / scalar, chosen at compile time): its exp() is
// what makes SiLU vectorise — libm's expf has no vector form the compiler would call.
#include "vec.h"

namespace {

constexpr int kLanes = 16;   // independent partial sums: lets the compiler vectorise the row sum
// Elements worth waking a second thread for (at::parallel_for's grain, in rows = this / row
// length): a decode step's few rows are done in less time than a parallel region costs to start
// and join, and on a busy machine the join waits for the slowest, perhaps descheduled, thread.
constexpr int64_t kMinElementsPerThread = 32768;

inline int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(1, row_elements)); }

// Rounds a float to the activation dtype and back: where a torch op would store its result.
template <typename T>
inline float round_to(float v) { return static_cast<float>(static_cast<T>(v)); }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "cpu layer ops: ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.dim() == 2, "cpu layer ops: ", name, " must be 2-D [rows, hidden], got ", t.sizes());
  TORCH_CHECK(t.stride(1) == 1, "cpu layer ops: ", name, " rows must be contiguous (unit last stride)");
}

// ------------------------------------------------------------------------------- RMSNorm
// out = weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), statistics in fp32; with `residual`:
// residual += x first (rounded to dtype, as torch's add_) and the norm reads the sum.
template <typename T>
void rms_norm_kernel(T* out, T* x, T* residual, const T* weight, int64_t rows, int64_t hidden, int64_t x_stride,
                     int64_t res_stride, int64_t out_stride, float eps) {
  at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    // ### BEGIN SOLUTION
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * x_stride;
      T* src = xr;
      if (residual != nullptr) {
        T* rr = residual + r * res_stride;
        for (int64_t i = 0; i < hidden; ++i) rr[i] = static_cast<T>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
        src = rr;
      }
      float lanes[kLanes] = {0.f};
      int64_t i = 0;
      for (; i + kLanes <= hidden; i += kLanes)
        for (int l = 0; l < kLanes; ++l) {
          const float v = static_cast<float>(src[i + l]);
          lanes[l] += v * v;
        }
      float sum = 0.f;
      for (; i < hidden; ++i) sum += static_cast<float>(src[i]) * static_cast<float>(src[i]);
      for (int l = 0; l < kLanes; ++l) sum += lanes[l];
      const float inv_rms = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
      T* o = out + r * out_stride;
      for (int64_t j = 0; j < hidden; ++j)
        o[j] = static_cast<T>(static_cast<float>(weight[j]) * round_to<T>(static_cast<float>(src[j]) * inv_rms));
    }
    // ### END SOLUTION
  });
}

// out [T, hidden] = RMSNorm(x) ; with residual: residual += x (in place), out = RMSNorm(residual).
at::Tensor rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                    double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "cpu layer ops: weight must be contiguous [hidden] = [", x.size(1), "], got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "cpu layer ops: weight dtype ", weight.scalar_type(),
              " != x dtype ", x.scalar_type());
  if (residual) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "cpu layer ops: residual must match x (", x.sizes(), ", ", x.scalar_type(), "), got ",
                residual->sizes(), ", ", residual->scalar_type());
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_kernel<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(),
                              residual ? residual->data_ptr<scalar_t>() : nullptr, weight.data_ptr<scalar_t>(),
                              x.size(0), x.size(1), x.stride(0), residual ? residual->stride(0) : 0, out.stride(0),
                              static_cast<float>(eps));
  });
  return out;
}

// -------------------------------------------------------------------------- SiLU and mul
// [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]; silu(g) = g / (1 + exp(-g)) rounded as F.silu's output.
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "cpu layer ops: silu_and_mul needs an even last dim, got ", x.size(1));
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t stride = x.stride(0);
    at::parallel_for(0, rows, grain_rows(2 * inter), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = in + r * stride;
        const scalar_t* up = gate + inter;
        scalar_t* orow = o + r * inter;
        int64_t i = 0;
        float g[vfs_cpu::W], e[vfs_cpu::W];
        for (; i + vfs_cpu::W <= inter; i += vfs_cpu::W) {        // W lanes at a time: exp(-g) as a vector
          for (int l = 0; l < vfs_cpu::W; ++l) g[l] = -static_cast<float>(gate[i + l]);
          const vfs_cpu::Mask all = vfs_cpu::first_lanes(vfs_cpu::W);
          vfs_cpu::store(e, vfs_cpu::exp(vfs_cpu::load(g, all)), all);
          for (int l = 0; l < vfs_cpu::W; ++l) {
            const float silu = round_to<scalar_t>(-g[l] / (1.f + e[l]));
            orow[i + l] = static_cast<scalar_t>(silu * static_cast<float>(up[i + l]));
          }
        }
        for (; i < inter; ++i) {                                   // the tail
          const float x = static_cast<float>(gate[i]);
          const float silu = round_to<scalar_t>(x / (1.f + std::exp(-x)));
          orow[i] = static_cast<scalar_t>(silu * static_cast<float>(up[i]));
        }
      }
    });
  });
  return out;
}

// ------------------------------------------------------------------ RoPE while splitting qkv
// qkv [T, (H + 2 KVH) * D] (rows may be strided) -> q [T, H, D], k [T, KVH, D] rotated, v [T, KVH, D],
// all contiguous. cos/sin [T, D]: each half-angle repeated for both dims of its pair ("neox").
// Rotation as HF writes it: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1), with the
// two products and the sum each rounded to the dtype, as three torch ops would.
template <typename T>
inline void rotate_head(T* dst, const T* src, const T* cos, const T* sin, int64_t half) {
  // ### BEGIN SOLUTION
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = static_cast<float>(src[i]), x2 = static_cast<float>(src[i + half]);
    const float c1 = static_cast<float>(cos[i]), c2 = static_cast<float>(cos[i + half]);
    const float s1 = static_cast<float>(sin[i]), s2 = static_cast<float>(sin[i + half]);
    dst[i] = static_cast<T>(round_to<T>(x1 * c1) + round_to<T>(-x2 * s1));
    dst[i + half] = static_cast<T>(round_to<T>(x2 * c2) + round_to<T>(x1 * s2));
  }
  // ### END SOLUTION
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_split_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                                              const at::Tensor& sin, int64_t num_heads,
                                                              int64_t num_kv_heads, int64_t head_dim) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t T = qkv.size(0);
  TORCH_CHECK(head_dim % 2 == 0, "cpu layer ops: head_dim must be even, got ", head_dim);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim, "cpu layer ops: qkv has ", qkv.size(1),
              " columns, expected (", num_heads, " + 2 x ", num_kv_heads, ") x ", head_dim);
  TORCH_CHECK(cos.size(0) == T && sin.size(0) == T && cos.size(1) == head_dim && sin.size(1) == head_dim,
              "cpu layer ops: cos and sin must be [", T, ", ", head_dim, "], got ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "cpu layer ops: cos/sin dtype must be the activations' (", qkv.scalar_type(), ")");
  at::Tensor q = at::empty({T, num_heads, head_dim}, qkv.options());
  at::Tensor k = at::empty({T, num_kv_heads, head_dim}, qkv.options());
  at::Tensor v = at::empty({T, num_kv_heads, head_dim}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_split_qkv", [&] {
    const scalar_t* in = qkv.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    scalar_t *qp = q.data_ptr<scalar_t>(), *kp = k.data_ptr<scalar_t>(), *vp = v.data_ptr<scalar_t>();
    const int64_t stride = qkv.stride(0), cstride = cos.stride(0), sstride = sin.stride(0), half = head_dim / 2;
    at::parallel_for(0, T, grain_rows(qkv.size(1)), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* row = in + t * stride;
        const scalar_t *c = cp + t * cstride, *s = sp + t * sstride;
        for (int64_t h = 0; h < num_heads; ++h)
          rotate_head(qp + (t * num_heads + h) * head_dim, row + h * head_dim, c, s, half);
        const scalar_t* krow = row + num_heads * head_dim;
        for (int64_t h = 0; h < num_kv_heads; ++h)
          rotate_head(kp + (t * num_kv_heads + h) * head_dim, krow + h * head_dim, c, s, half);
        const scalar_t* vrow = krow + num_kv_heads * head_dim;
        scalar_t* vdst = vp + t * num_kv_heads * head_dim;
        for (int64_t i = 0; i < num_kv_heads * head_dim; ++i) vdst[i] = vrow[i];
      }
    });
  });
  return {q, k, v};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "RMSNorm (+ residual add), SiLU-and-mul and RoPE for the CPU (vLLM: csrc/cpu/)";
  m.def("rms_norm", &rms_norm, "out = RMSNorm(x) [or residual += x; out = RMSNorm(residual)]", py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, "[T, 2I] -> silu(gate) * up [T, I]", py::arg("x"),
        py::call_guard<py::gil_scoped_release>());
  m.def("rope_split_qkv", &rope_split_qkv, "qkv -> (rotated q, rotated k, v), contiguous", py::arg("qkv"),
        py::arg("cos"), py::arg("sin"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
        py::call_guard<py::gil_scoped_release>());
  m.def("isa", [] { return std::string(vfs_cpu::kIsaName); }, "the instruction set this build was compiled for");
}
