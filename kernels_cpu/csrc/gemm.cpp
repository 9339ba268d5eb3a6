// y = x @ W^T (+ b) for the CPU engine's linears, fp32, on weights packed once into column
// panels: the matmul a decode step is made of.
//
// Why not oneDNN (what vLLM's CPU backend calls, kernels_cpu/gemm.py's "onednn")? A decode step
// has 1-64 rows, and then a linear is a stream over its weights: each weight is used once per
// row, so with few rows the time is the time to read the weights, and oneDNN reads them well
// below the machine's memory bandwidth (`python -m benchmarks.bench_cpu_gemm` times both, and
// F.linear). The layout makes the stream fast:
//
//   packed [P, K, NR]:  panel p holds output columns [p*NR, p*NR + NR) of W^T, k-major, so
//                       computing those NR outputs for a block of rows reads one contiguous
//                       K*NR*4-byte range (SmolLM2 on AVX2: 55 KB at K = 576, 147 KB at
//                       1536; it stays in L2 while the row blocks re-read it). The last panel
//                       is padded with zero columns.
//
// The micro-kernel keeps a kMaxRows x NR tile of C in registers (4 x 3 vectors = 12 of the 16
// AVX2 registers), and per k loads 3 vectors of the panel and broadcasts 4 values of x: 12
// FMAs per 7 loads. Threads split the panels (each streams its own contiguous share of the
// weights); rows go in blocks of kRowBlock so a prefill chunk's x block stays in L2 too.
//
// While a panel's row tiles compute (from L2, after the first tile brought it in), each tile
// also prefetches a share of the thread's NEXT panel, one cache line per k step: the DRAM
// reads of the weights then overlap the arithmetic instead of waiting for the next panel's
// first tile (`python -m benchmarks.bench_cpu_gemm` times it against its "ours, no prefetch"
// side). At 1-4 rows (one tile) it is off, see panel_gemm. The lines are spread one per k step:
// issued in a burst before each tile, they would queue up in front of the tile's own loads.
//
// On AVX-512 (NR = 48) the same tile, which stays in registers only because the vector header
// (vec.h) loads whole vectors without a mask: behind the masked load GCC 12 spilled this tile's
// accumulators to the stack on every k step (tests/kernels_cpu/test_gemm_codegen.py reads the k
// loop's assembly).
//
// Numerics: each output is one fp32 FMA chain over k in order, then + bias: the same sum as
// F.linear up to the order of additions (the BLAS blocks k), i.e. last-bit differences.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>

#include "vec.h"   // the vector wrapper the attention kernel uses too: AVX-512 / AVX2 / scalar, chosen at compile time

namespace {

using namespace vfs_cpu;

constexpr int kVectorsPerPanel = 3;
constexpr int NR = kVectorsPerPanel * W;    // panel width in output columns: 24 (AVX2), 48 (AVX-512), 3 (scalar)
constexpr int kMaxRows = 4;                 // rows of the register tile
constexpr int64_t kRowBlock = 96;           // rows of x per pass over a thread's panels (96 x 1536 x 4 B = 590 KB)
constexpr int64_t kMinWeightsPerThread = 1 << 15;   // a second thread only for >= 128 KB of weights
constexpr int64_t kCacheLine = 64;                   // bytes
// The tuning story, each step a build of this file (`python -m kernels_cpu.dev.gemm` builds, checks
// and times both; the engine builds the last): 1 = the register tile alone, 2 = + each tile
// prefetches a share of its thread's next panel (see the top).
#ifndef VFS_CPU_GEMM_VERSION
#define VFS_CPU_GEMM_VERSION 2
#endif
constexpr bool kPrefetchNextPanel = VFS_CPU_GEMM_VERSION >= 2;

// The part of the thread's next panel not yet prefetched, handed out to the tiles in shares.
struct NextPanel {
  const char* cursor = nullptr;    // first line not yet handed out
  const char* end = nullptr;
  int64_t lines_per_tile = 0;      // at most K: a tile prefetches one line per k step

  // The next share: (first line, number of lines) for one tile to prefetch.
  std::pair<const char*, int64_t> take() {
    const int64_t n = std::min<int64_t>(lines_per_tile, (end - cursor) / kCacheLine);
    const char* first = cursor;
    cursor += n * kCacheLine;
    return {first, n};
  }
};

// C[r, 0:n_valid] = A[r, :] . panel[:, 0:n_valid] for r < ROWS. A: ROWS rows of K floats, lda
// apart; panel: [K, NR]; C: ROWS rows, ldc apart. The tile lives in registers for the whole k loop.
// Also prefetches (into L2) `fetch_lines` lines from `fetch`, one per k step: see the top.
template <int ROWS>
inline void tile(const float* A, int64_t lda, const float* panel, int64_t K, float* C, int64_t ldc, int n_valid,
                 const char* fetch, int64_t fetch_lines) {
  const Mask all = first_lanes(W);
  V acc[ROWS][kVectorsPerPanel];
  // ### BEGIN SOLUTION
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < kVectorsPerPanel; ++v) acc[r][v] = zero();
  for (int64_t k = 0; k < K; ++k) {
    if (kPrefetchNextPanel && k < fetch_lines) prefetch_l2(fetch + k * kCacheLine);
    V b[kVectorsPerPanel];                                  // panel row k: NR weights, contiguous
    for (int v = 0; v < kVectorsPerPanel; ++v) b[v] = load(panel + k * NR + v * W, all);
    for (int r = 0; r < ROWS; ++r) {
      const V a = set1(A[r * lda + k]);                     // x[r, k] in every lane
      for (int v = 0; v < kVectorsPerPanel; ++v) acc[r][v] = vfs_cpu::fma(a, b[v], acc[r][v]);   // not ::fma (scalar builds)
    }
  }
  // ### END SOLUTION
  if (n_valid == NR) {
    for (int r = 0; r < ROWS; ++r)
      for (int v = 0; v < kVectorsPerPanel; ++v) store(C + r * ldc + v * W, acc[r][v], all);
    return;
  }
  float last[NR];                                           // the padded last panel: keep the real columns
  for (int r = 0; r < ROWS; ++r) {
    for (int v = 0; v < kVectorsPerPanel; ++v) store(last + v * W, acc[r][v], all);
    std::copy(last, last + n_valid, C + r * ldc);
  }
}

// All `rows` rows against one panel: tiles of kMaxRows, then one smaller tile for the rest;
// each tile prefetches its share of `next`.
template <int ROWS = kMaxRows>
void rows_times_panel(const float* A, int64_t K, const float* panel, float* C, int64_t ldc, int n_valid,
                      int64_t rows, NextPanel& next) {
  int64_t r = 0;
  for (; r + ROWS <= rows; r += ROWS) {
    const auto [fetch, lines] = next.take();
    tile<ROWS>(A + r * K, K, panel, K, C + r * ldc, ldc, n_valid, fetch, lines);
  }
  if constexpr (ROWS > 1) {
    if (r < rows) rows_times_panel<ROWS - 1>(A + r * K, K, panel, C + r * ldc, ldc, n_valid, rows - r, next);
  }
}

void check_weight(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2,
              "cpu gemm: the weight must be a 2-D fp32 CPU tensor [out, in], got ", w.scalar_type(), " ",
              w.sizes(), " on ", w.device());
  TORCH_CHECK(w.size(0) > 0 && w.size(1) > 0, "cpu gemm: empty weight ", w.sizes());
}

// [N, K] -> [ceil(N / NR), K, NR]: panel p, row k holds W[p*NR + j, k] for j < NR (zero past N).
at::Tensor pack_panels(const at::Tensor& weight) {
  check_weight(weight);
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + NR - 1) / NR;
  at::Tensor packed = at::zeros({P, K, NR}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int j = 0; j < NR && p * NR + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * NR + j] = src[(p * NR + j) * K + k];
  });
  return packed;
}

// x [M, K] @ W^T (+ bias) -> [M, N], W given as pack_panels(W).
at::Tensor panel_gemm(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      int64_t N, bool prefetch_next_panel) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "cpu gemm: x must be a 2-D fp32 CPU tensor [rows, in], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.size(2) == NR && packed.is_contiguous(),
              "cpu gemm: the weight is not a pack_panels() result of this build (panel width ", NR, "), got ",
              packed.sizes());
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "cpu gemm: x has ", K, " input features, the weight ", packed.size(1));
  TORCH_CHECK(N > (P - 1) * NR && N <= P * NR, "cpu gemm: ", N, " outputs do not fit ", P, " panels of ", NR);
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N,
                "cpu gemm: bias must be fp32 [", N, "], got ", bias->scalar_type(), " ", bias->sizes());
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* A = xc.data_ptr<float>();
  const float* B = packed.data_ptr<float>();
  float* C = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kMinWeightsPerThread / (K * NR));
  at::parallel_for(0, P, grain, [&](int64_t p_begin, int64_t p_end) {    // this thread's panels
    const int64_t panel_lines = K * NR * int64_t(sizeof(float)) / kCacheLine;
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, M - m0);
      const int64_t tiles = (rows + kMaxRows - 1) / kMaxRows;
      for (int64_t p = p_begin; p < p_end; ++p) {
        const int n_valid = int(std::min<int64_t>(NR, N - p * NR));
        const char* following = reinterpret_cast<const char*>(B + (p + 1) * K * NR);   // this thread's next panel
        // One tile (1-4 rows) has no arithmetic to hide the fetch behind: it streams its panel
        // once, the hardware prefetcher ahead of it, and a second stream would only compete.
        const bool fetch = kPrefetchNextPanel && prefetch_next_panel && tiles >= 2 && p + 1 < p_end;
        NextPanel next{following, fetch ? following + panel_lines * kCacheLine : following,
                       std::min<int64_t>(K, (panel_lines + tiles - 1) / tiles)};
        rows_times_panel(A + m0 * K, K, B + p * K * NR, C + m0 * N + p * NR, N, n_valid, rows, next);
      }
    }
  });
  if (bias) y.add_(*bias);
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fp32 GEMM on column-panel-packed weights for the CPU engine's linears";
  m.attr("panel_width") = NR;
  m.def("isa", [] { return std::string(kIsaName); });
  m.def("pack_panels", &pack_panels, "[N, K] -> [ceil(N/NR), K, NR]", py::arg("weight"),
        py::call_guard<py::gil_scoped_release>());
  m.def("panel_gemm", &panel_gemm, "x [M, K] @ W^T (+ bias) -> [M, N]", py::arg("x"), py::arg("packed"),
        py::arg("bias"), py::arg("n_out"), py::arg("prefetch_next_panel") = true,
        py::call_guard<py::gil_scoped_release>());
}
