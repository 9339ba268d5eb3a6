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
#include <cstring>
#include <string>
#include <tuple>

// The kernels' vector wrapper (AVX-512 / AVX2 / scalar, chosen at compile time). Each op runs a
// row W lanes at a time (loads widen bf16 / fp16 to fp32, `rounded<T>` and the stores round back
// exactly as torch stores a T) and finishes the row's last < W elements one at a time, with the
// same roundings. Why vectors and not plain loops: c10's BFloat16 / Half conversions (a NaN test
// and a branch each) keep GCC from vectorising a loop of them, and exp has no vector form in libm;
// in scalar form RoPE cost 78 us for a decode step's 64 rows of SmolLM2, SiLU-and-mul 57 us.
#include "vec.h"

namespace {

using vfs_cpu::V;
using vfs_cpu::W;

// Elements worth waking a second thread for (at::parallel_for's grain, in rows = this / row
// length): a decode step's few rows are done in less time than a parallel region costs to start
// and join, and on a busy machine the join waits for the slowest, perhaps descheduled, thread.
constexpr int64_t kMinElementsPerThread = 32768;

inline int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(1, row_elements)); }

// The storage type the vector header reads and writes for each torch dtype (same bits).
template <typename T> struct Storage { using type = T; };
template <> struct Storage<c10::BFloat16> { using type = vfs_cpu::bf16; };
template <> struct Storage<c10::Half> { using type = vfs_cpu::fp16; };
template <typename T> using storage_t = typename Storage<T>::type;
template <typename T> storage_t<T>* as_storage(T* p) { return reinterpret_cast<storage_t<T>*>(p); }
template <typename T> const storage_t<T>* as_storage(const T* p) { return reinterpret_cast<const storage_t<T>*>(p); }

// One element (to fp32: vfs_cpu::to_float): a float rounded to T and back (where a torch op would store a T).
template <typename T>
inline float round_to(float v) { T t; vfs_cpu::from_float(v, &t); return vfs_cpu::to_float(t); }
template <typename T>
inline T to(float v) { T t; vfs_cpu::from_float(v, &t); return t; }

// The engine's activation dtypes (mini_vllm/config.py): fp32, bf16, fp16.
#define DISPATCH_ACTIVATION_TYPES(TYPE, NAME, ...)                                                     \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                             \
                                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "cpu layer ops: ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.dim() == 2, "cpu layer ops: ", name, " must be 2-D [rows, hidden], got ", t.sizes());
  TORCH_CHECK(t.stride(1) == 1, "cpu layer ops: ", name, " rows must be contiguous (unit last stride)");
}

// ------------------------------------------------------------------------------- RMSNorm
// out = weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), statistics in fp32; with `residual`:
// residual += x first (rounded to dtype, as torch's add_) and the norm reads the sum.
// T: float, vfs_cpu::bf16 or vfs_cpu::fp16.
template <typename T>
void rms_norm_kernel(T* out, T* x, T* residual, const T* weight, int64_t rows, int64_t hidden, int64_t x_stride,
                     int64_t res_stride, int64_t out_stride, float eps) {
  using namespace vfs_cpu;
  const int64_t body = hidden / W * W;                 // whole vectors; then the tail, one at a time
  at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    // ### BEGIN SOLUTION
    for (int64_t r = begin; r < end; ++r) {
      T* src = x + r * x_stride;
      if (residual != nullptr) {                       // residual += x, rounded to T
        T* rr = residual + r * res_stride;
        for (int64_t i = 0; i < body; i += W) store(rr + i, rounded<T>(add(load_all(rr + i), load_all(src + i))));
        for (int64_t i = body; i < hidden; ++i) rr[i] = to<T>(vfs_cpu::to_float(rr[i]) + vfs_cpu::to_float(src[i]));
        src = rr;
      }
      V squares = zero();                              // W partial sums of x^2
      for (int64_t i = 0; i < body; i += W) {
        const V v = load_all(src + i);
        squares = add(squares, mul(v, v));
      }
      float sum = reduce_add(squares);
      for (int64_t i = body; i < hidden; ++i) sum += vfs_cpu::to_float(src[i]) * vfs_cpu::to_float(src[i]);
      const float inv_rms = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
      T* o = out + r * out_stride;
      for (int64_t i = 0; i < body; i += W)            // weight * (x * inv_rms).to(T), stored as T
        store(o + i, mul(load_all(weight + i), rounded<T>(mul(load_all(src + i), set1(inv_rms)))));
      for (int64_t i = body; i < hidden; ++i) o[i] = to<T>(vfs_cpu::to_float(weight[i]) * round_to<T>(vfs_cpu::to_float(src[i]) * inv_rms));
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
  DISPATCH_ACTIVATION_TYPES(x.scalar_type(), "rms_norm", [&] {
    rms_norm_kernel(as_storage(out.data_ptr<scalar_t>()), as_storage(x.data_ptr<scalar_t>()),
                    residual ? as_storage(residual->data_ptr<scalar_t>()) : nullptr,
                    as_storage(weight.data_ptr<scalar_t>()), x.size(0), x.size(1), x.stride(0),
                    residual ? residual->stride(0) : 0, out.stride(0), static_cast<float>(eps));
  });
  return out;
}

// -------------------------------------------------------------------------- SiLU and mul
// [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]; silu(g) = g / (1 + exp(-g)) rounded as F.silu's output.
template <typename T>
void silu_and_mul_kernel(T* out, const T* in, int64_t rows, int64_t inter, int64_t stride) {
  using namespace vfs_cpu;
  const int64_t body = inter / W * W;
  at::parallel_for(0, rows, grain_rows(2 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in + r * stride;
      const T* up = gate + inter;
      T* o = out + r * inter;
      for (int64_t i = 0; i < body; i += W) {
        const V g = load_all(gate + i);
        const V silu = rounded<T>(div(g, add(set1(1.f), vfs_cpu::exp(neg(g)))));
        store(o + i, mul(silu, load_all(up + i)));
      }
      for (int64_t i = body; i < inter; ++i) {                    // the tail
        const float g = vfs_cpu::to_float(gate[i]);
        o[i] = to<T>(round_to<T>(g / (1.f + std::exp(-g))) * vfs_cpu::to_float(up[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "cpu layer ops: silu_and_mul needs an even last dim, got ", x.size(1));
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, x.options());
  DISPATCH_ACTIVATION_TYPES(x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_kernel(as_storage(out.data_ptr<scalar_t>()), as_storage(x.data_ptr<scalar_t>()), rows, inter,
                        x.stride(0));
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
  using namespace vfs_cpu;
  // ### BEGIN SOLUTION
  const int64_t body = half / W * W;
  for (int64_t i = 0; i < body; i += W) {
    const V x1 = load_all(src + i), x2 = load_all(src + half + i);
    store(dst + i, add(rounded<T>(mul(x1, load_all(cos + i))), rounded<T>(mul(neg(x2), load_all(sin + i)))));
    store(dst + half + i, add(rounded<T>(mul(x2, load_all(cos + half + i))), rounded<T>(mul(x1, load_all(sin + half + i)))));
  }
  for (int64_t i = body; i < half; ++i) {
    const float x1 = vfs_cpu::to_float(src[i]), x2 = vfs_cpu::to_float(src[i + half]);
    dst[i] = to<T>(round_to<T>(x1 * vfs_cpu::to_float(cos[i])) + round_to<T>(-x2 * vfs_cpu::to_float(sin[i])));
    dst[i + half] = to<T>(round_to<T>(x2 * vfs_cpu::to_float(cos[i + half])) + round_to<T>(x1 * vfs_cpu::to_float(sin[i + half])));
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
  DISPATCH_ACTIVATION_TYPES(qkv.scalar_type(), "rope_split_qkv", [&] {
    using S = storage_t<scalar_t>;
    const S* in = as_storage(qkv.data_ptr<scalar_t>());
    const S* cp = as_storage(cos.data_ptr<scalar_t>());
    const S* sp = as_storage(sin.data_ptr<scalar_t>());
    S *qp = as_storage(q.data_ptr<scalar_t>()), *kp = as_storage(k.data_ptr<scalar_t>()), *vp = as_storage(v.data_ptr<scalar_t>());
    const int64_t stride = qkv.stride(0), cstride = cos.stride(0), sstride = sin.stride(0), half = head_dim / 2;
    at::parallel_for(0, T, grain_rows(qkv.size(1)), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const S* row = in + t * stride;
        const S *c = cp + t * cstride, *s = sp + t * sstride;
        for (int64_t h = 0; h < num_heads; ++h)
          rotate_head(qp + (t * num_heads + h) * head_dim, row + h * head_dim, c, s, half);
        const S* krow = row + num_heads * head_dim;
        for (int64_t h = 0; h < num_kv_heads; ++h)
          rotate_head(kp + (t * num_kv_heads + h) * head_dim, krow + h * head_dim, c, s, half);
        std::memcpy(vp + t * num_kv_heads * head_dim, krow + num_kv_heads * head_dim,
                    sizeof(S) * num_kv_heads * head_dim);                  // v: copied as it is
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
