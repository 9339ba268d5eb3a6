// Quantized linears for the CPU, reading the packed integers directly: chapter 10's "cpu" backend.
//
//   WNA16  y = x @ dequantize(W)^T (+ b): W in int4 or int8 (per-group or per-channel scales,
//          symmetric or with zero points), x in fp32 / bf16 / fp16, fp32 accumulation.
//   W8A8   y = (xq @ Wq^T) * x_scale * w_scale (+ b): x quantized to int8 per token on the fly,
//          exact int32 sums of int8 products (AVX-512 VNNI's vpdpbusd where the CPU has it).
//
// Why: a decode step (1-64 rows) reads every weight once per step, so a linear takes the time its
// weights take to arrive from memory (kernels_cpu/csrc/gemm.cpp says more). int8 weights are 4x
// fewer bytes than fp32, int4 8x -- but only if nothing turns them back into a float matrix in
// memory. Here no float weight matrix is ever written: at decode sizes each integer becomes a
// float (WNA16) in a register, right before the multiply-add that uses it; with more rows, a few
// KB of one panel at a time in L1 (below); W8A8 never makes a float weight at all.
//
// Layout (packed once at load time by kernels_cpu/quant_gemm.py, the way vLLM repacks checkpoints
// for its kernels): column panels of NR = 4 vectors of output columns (64 on AVX-512, 32 on AVX2),
//
//   words  int32 [P, K / per_word, NR]   word (p, kk, j) = the per_word = 32 / bits integers of
//                                         output column p*NR + j at inputs kk*per_word ...
//                                         (value i in bits [bits*i, bits*(i+1)), little end first)
//
// i.e. a checkpoint's own int32 words (compressed-tensors packs 8 int4 / 4 int8 consecutive inputs
// of one row into a word; GPTQ's qweight is the same words transposed) regrouped so that one
// vector load brings one word per lane, ONE OUTPUT COLUMN PER LANE. A lane then needs no shuffle
// at all: value i of every lane comes out of the same shifts in all lanes. The packer stores q in
// two's complement (it flips the top bit of each checkpoint value q - qmin), so a left shift that
// puts value i's top bit at the lane's top, then an arithmetic right shift, sign-extends it. On
// AVX-512 int4 it is cheaper still: vpermps reads only the low 4 bits of each index, so permuting
// a 16-entry table of floats BY the word shifted right by 4i turns 16 nibbles into 16 floats in one
// instruction (the table holds each nibble's value, -8..7): one shift, one lookup, one FMA.
//
// WNA16 arithmetic, two paths, both fp32 accumulation and one rounding to x's dtype at the end:
//
//   * at most kRows rows (decode: one row tile; wna16_tile), per panel, per group of inputs:
//       acc[r][n] = sum_{k in group} x[r, k] * (q[n, k] - z[g, n])     one FMA per weight and row
//       out[r][n] += scale[g, n] * acc[r][n]                          once per group
//     q - z is a small integer, exact in fp32 (symmetric: z = 0, no subtraction; asymmetric: one
//     vsubps per vector of weights, shared by the tile's rows), so each product is exactly
//     x * (q - z) and the group's scale multiplies once. An all-zero group (q = z) contributes
//     exactly 0. Why not fold the zero point as scale * zero, or as an offset times the group's
//     sum of x (one FMA fewer for asymmetric schemes)? Then the integer terms no longer cancel
//     exactly: an int8 per-channel weight with z near 0 had its 128 * sum(x) cancel against
//     sum(x * (q + 128)), and the result lost 1e-5 of its value -- more than fp32's sum error.
//   * more rows (wna16_rows_dequantized): each tile would repeat the unpacking (1.5 vector
//     operations per multiply-add instead of 1 at 4 rows), so each chunk of kChunk inputs of a
//     panel is dequantized ONCE, w = (q - z) * s exactly as the reference rounds it, into an L1
//     scratch, and every row tile runs gemm.cpp's fp32 register tile on it.
// Either way: the reference's numbers up to the order of the fp32 sums. (With 16-bit scales the
// reference also rounds each dequantized weight to the scales' dtype; the kernel does not.)
//   * bf16 x and at least 16 rows, in the AMX build: the matrix unit (wna16_gemm_amx below): each
//     weight is dequantized as above and rounded to bf16 (as vLLM's AMX kernel and, with bf16
//     scales, the reference do), products summed in fp32 by the tiles.
//
// W8A8 arithmetic: four int8 activations of a row (one int32 word, broadcast) times one word of
// four int8 weights per lane, summed into the lane's int32:
//   * VNNI (vpdpbusd: unsigned x signed bytes): the activations are stored as xq + 128 (unsigned)
//     and 128 * sum_k w[n, k] (packed with the weights) is subtracted at the end;
//   * AVX-512 without VNNI, AVX2: bytes sign-extended into int16 pairs (two shifts), vpmaddwd
//     (int16 x int16, pairs summed into int32) twice per word: exact for every int8 value.
// The sums are exact; the scaling is the reference's, in double: acc * x_scale * w_scale + bias,
// rounded once to x's dtype. Compiled with -ffp-contract=off (no fused multiply-add there). With
// AMX, from 16 rows, tdpbusd computes the same int32 sums 16 x 16 x 64 at a time (w8a8_rows_amx).
//
// Work split: threads take contiguous ranges of panels (each streams its own share of the weights
// front to back, as gemm.cpp; a second thread only for >= kMinWeightsPerThread weights); rows go in
// blocks of kRowBlock, each panel then in tiles of kRows rows that keep kVecs x kRows accumulators
// in registers. Each output is computed by one thread, the same way whatever the thread count.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec.h"   // the float vectors every kernel here is written against; the integer lanes are below

#if defined(VFS_CPU_SIMDE_AVX512) || (defined(VFS_CPU_AVX512) && defined(__AVX512VNNI__))
#define VFS_CPU_VNNI 1       // vpdpbusd: native, or emulated by SIMDe in the tests' build
#endif
// The matrix unit (amx.h) for many rows: bf16 x in WNA16, and W8A8. Native in the AMX build
// (quant_gemm.py compiles it with -mamx-*), emulated in plain C++ in the SIMDe build (tests).
#if defined(VFS_CPU_SIMDE_AVX512)
#define VFS_CPU_AMX 1
#define VFS_CPU_AMX_EMULATED 1
#elif defined(VFS_CPU_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#define VFS_CPU_AMX 1
#endif
#if defined(VFS_CPU_AMX)
#include "amx.h"
#endif

namespace {

using namespace vfs_cpu;

constexpr int kVecs = 4;                    // vectors per panel
constexpr int NR = kVecs * W;               // panel width in output columns: 64 (AVX-512), 32 (AVX2), 4 (scalar)
#if defined(VFS_CPU_AVX512)
constexpr int kRows = 4;                    // rows per tile: 4 x 4 accumulators of AVX-512's 32 registers
#else
constexpr int kRows = 2;                    // AVX2 has 16 registers: 2 x 4 accumulators + the words in flight
#endif
constexpr int64_t kRowBlock = 64;           // rows of x per pass over a thread's panels (64 x 1536 x 4 B = 393 KB, L2)
constexpr int64_t kMinWeightsPerThread = 1 << 15;   // a second thread only for >= 32 K weights (gemm.cpp's rule)
constexpr int64_t kMinQuantizeInputsPerThread = 1 << 14;  // W8A8's per-token quantization: 16 K inputs a thread
constexpr int64_t kMaxW8A8Inputs = 1 << 16;         // int32 sums of 255 * 128 * K cannot overflow below this

// ------------------------------------------------------------------------ integer lanes, per ISA
// VI holds W int32 lanes, one packed word of one output column each (vec.h's V holds W floats).
#if defined(VFS_CPU_AVX512)
using VI = __m512i;
inline VI load_words(const int32_t* p) { return _mm512_loadu_si512(p); }
inline void store_words(int32_t* p, VI v) { _mm512_storeu_si512(p, v); }
inline VI zero_words() { return _mm512_setzero_si512(); }
inline VI broadcast_word(int32_t w) { return _mm512_set1_epi32(w); }
template <int S> inline VI shift_right(VI v) { return S == 0 ? v : _mm512_srli_epi32(v, S); }
template <int S> inline VI shift_right_signed(VI v) { return S == 0 ? v : _mm512_srai_epi32(v, S); }
template <int S> inline VI shift_left(VI v) { return S == 0 ? v : _mm512_slli_epi32(v, S); }
inline V to_floats(VI v) { return _mm512_cvtepi32_ps(v); }
#elif defined(VFS_CPU_AVX2)
using VI = __m256i;
inline VI load_words(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void store_words(int32_t* p, VI v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline VI zero_words() { return _mm256_setzero_si256(); }
inline VI broadcast_word(int32_t w) { return _mm256_set1_epi32(w); }
template <int S> inline VI shift_right(VI v) { return S == 0 ? v : _mm256_srli_epi32(v, S); }
template <int S> inline VI shift_right_signed(VI v) { return S == 0 ? v : _mm256_srai_epi32(v, S); }
template <int S> inline VI shift_left(VI v) { return S == 0 ? v : _mm256_slli_epi32(v, S); }
inline V to_floats(VI v) { return _mm256_cvtepi32_ps(v); }
#else
using VI = int32_t;
inline VI load_words(const int32_t* p) { return *p; }
inline void store_words(int32_t* p, VI v) { *p = v; }
inline VI zero_words() { return 0; }
inline VI broadcast_word(int32_t w) { return w; }
template <int S> inline VI shift_right(VI v) { return int32_t(uint32_t(v) >> S); }
template <int S> inline VI shift_right_signed(VI v) { return v >> S; }     // arithmetic on g++
template <int S> inline VI shift_left(VI v) { return int32_t(uint32_t(v) << S); }
inline V to_floats(VI v) { return float(v); }
#endif

// ------------------------------------------------------------------------ WNA16: unpack in registers
// Value I of each lane's word (q, BITS bits of two's complement), as floats.
template <int BITS, int I>
inline V unpack(VI words) {
  constexpr int kLow = BITS * I;                       // value I: bits [kLow, kLow + BITS)
#if defined(VFS_CPU_AVX512)
  if constexpr (BITS == 4) {
    // vpermps takes each lane's index from its low 4 bits only: the shifted word IS the index of
    // its nibble, so a 16-entry table of the nibbles' values converts them without a mask.
    const V table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
    return _mm512_permutexvar_ps(shift_right<kLow>(words), table);
  }
#endif
  // The value's top bit to the lane's top, then an arithmetic shift back down: sign-extended.
  return to_floats(shift_right_signed<32 - BITS>(shift_left<32 - BITS - kLow>(words)));
}

// acc[v][r] += x[r][I] * (value I of w[v] - zero[v]) for every vector v and row r: value I of the
// panel's words for one input, times that input of each row. Like gemm.cpp's tile, each row's x is
// broadcast once and used by kVecs FMAs at once, so no broadcast outlives its row: a loop order
// that reused broadcasts across vectors had g++ keep 32 of them in registers and spill the sums.
template <int BITS, bool ZERO_POINT, int ROWS, int I>
inline void fma_value(const VI (&w)[kVecs], const float* zeros, const float* x, int64_t ldx, V (&acc)[kVecs][ROWS]) {
  const Mask all = first_lanes(W);
  V value[kVecs];
  for (int v = 0; v < kVecs; ++v) {
    value[v] = unpack<BITS, I>(w[v]);
    if constexpr (ZERO_POINT) value[v] = sub(value[v], load(zeros + v * W, all));   // q - z: exact (integers)
  }
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; ++r) {
    const V xr = set1(x[r * ldx + I]);
    for (int v = 0; v < kVecs; ++v) acc[v][r] = vfs_cpu::fma(xr, value[v], acc[v][r]);   // not ::fma (scalar builds)
  }
}
template <int BITS, bool ZERO_POINT, int ROWS, int... I>
inline void fma_words(const VI (&w)[kVecs], const float* zeros, const float* x, int64_t ldx, V (&acc)[kVecs][ROWS],
                      std::integer_sequence<int, I...>) {
  (fma_value<BITS, ZERO_POINT, ROWS, I>(w, zeros, x, ldx, acc), ...);   // unrolled: every shift is an immediate
}

// result[v][r] = sum over one group's inputs k of x[r, k] * (q[n, k] - z[n]), n = lane of vector v.
// `words`: the group's [words_in_group, NR] part of a panel; zeros: the group's [NR] zero points
// (ZERO_POINT only); x: ROWS rows at the group's first input, ldx apart.
template <int BITS, bool ZERO_POINT, int ROWS>
inline void group_sums(const int32_t* words, int64_t words_in_group, const float* zeros, const float* x,
                       int64_t ldx, V (&result)[kVecs][ROWS]) {
  constexpr int kPerWord = 32 / BITS;
  // The sums in a local array, copied out at the end: `result` could alias the floats this loop
  // reads (as far as g++ knows), and it would then store the sums back to it after every FMA.
  V acc[kVecs][ROWS];
  for (int v = 0; v < kVecs; ++v)
    for (int r = 0; r < ROWS; ++r) acc[v][r] = vfs_cpu::zero();
  // ### BEGIN SOLUTION
  for (int64_t kk = 0; kk < words_in_group; ++kk) {
    VI w[kVecs];                                            // one word per lane: kPerWord inputs of a column
    for (int v = 0; v < kVecs; ++v) w[v] = load_words(words + kk * NR + v * W);
    fma_words<BITS, ZERO_POINT, ROWS>(w, zeros, x + kk * kPerWord, ldx, acc,
                                      std::make_integer_sequence<int, kPerWord>{});
  }
  // ### END SOLUTION
  for (int v = 0; v < kVecs; ++v)
    for (int r = 0; r < ROWS; ++r) result[v][r] = acc[v][r];
}

// The operands of one WNA16 call, shared by all its tiles.
struct WNA16Args {
  const float* x;          // [T, K] fp32
  const int32_t* words;    // [P, K / per_word, NR]
  const float* params;     // [P, G, 1 or 2, NR]: scale (, zero point)
  const float* bias;       // [N] fp32, or nullptr
  int64_t K, N, G, group_size;
};

// Output columns that exist in panel p (the last panel is zero-padded to NR).
inline int valid_columns(int64_t p, int64_t N) { return int(std::min<int64_t>(NR, N - p * NR)); }

// y[m0 + r, panel p's columns] = c[r] (+ bias) for r < rows: c holds rows of NR fp32 sums; + bias in
// fp32, then one rounding to y's dtype.
template <typename T>
void store_rows(const float* c, int64_t rows, const WNA16Args& a, int64_t p, int64_t m0, T* y) {
  const int n_valid = valid_columns(p, a.N);
  for (int64_t r = 0; r < rows; ++r) {
    T* yr = y + (m0 + r) * a.N + p * NR;
    for (int j = 0; j < n_valid; ++j) from_float(a.bias ? c[r * NR + j] + a.bias[p * NR + j] : c[r * NR + j], yr + j);
  }
}

// Few rows (one tile: decode): y[r, n] for ROWS rows from m0 and panel p's columns n, every
// integer turned into a float in a register (group_sums) and each group's sums scaled once.
template <int BITS, bool ZERO_POINT, int ROWS, typename T>
void wna16_tile(const WNA16Args& a, int64_t p, int64_t m0, T* y) {
  constexpr int kPerWord = 32 / BITS, kParams = ZERO_POINT ? 2 : 1;
  const Mask all = first_lanes(W);
  const int64_t words_per_group = a.group_size / kPerWord;
  float out[ROWS][NR] = {};                            // the tile's running result, in L1
  const int32_t* panel = a.words + p * (a.K / kPerWord) * NR;
  for (int64_t g = 0; g < a.G; ++g) {
    const float* scale = a.params + (p * a.G + g) * kParams * NR;   // [kParams, NR]: scale (, zero point)
    V acc[kVecs][ROWS];
    group_sums<BITS, ZERO_POINT, ROWS>(panel + g * words_per_group * NR, words_per_group, scale + NR,
                                       a.x + m0 * a.K + g * a.group_size, a.K, acc);
    for (int v = 0; v < kVecs; ++v) {
      const V s = load(scale + v * W, all);
      for (int r = 0; r < ROWS; ++r) store(out[r] + v * W, vfs_cpu::fma(s, acc[v][r], load(out[r] + v * W, all)), all);
    }
  }
  store_rows(out[0], ROWS, a, p, m0, y);
}

// ---- more rows: dequantize a chunk of the panel once into L1, then an fp32 tile per kRows rows
// One tile of rows turns each integer into a float for its own use; with more tiles that work would
// be repeated per tile (1.5 vector operations per multiply-add instead of 1 at 4 rows), so from the
// second tile on each chunk of kChunk inputs of a panel is dequantized ONCE into an L1 scratch and
// every row tile reads it: a few kilobytes of floats that live in L1 for the length of one chunk,
// not a float weight matrix (memory still sees 4 / 8 bits per weight).
constexpr int64_t kChunk = 64;              // inputs per chunk: [64, NR] fp32 = 16 KB (AVX-512), in L1

// chunk[I][v * W ...] = (value I of w[v] - z) * s: the reference's dequantized weight, same rounding.
template <int BITS, bool ZERO_POINT, int I>
inline void dequantize_value(const VI (&w)[kVecs], const float* params, float* chunk) {
  const Mask all = first_lanes(W);
  for (int v = 0; v < kVecs; ++v) {
    V value = unpack<BITS, I>(w[v]);
    if constexpr (ZERO_POINT) value = sub(value, load(params + NR + v * W, all));
    store(chunk + I * NR + v * W, mul(value, load(params + v * W, all)), all);
  }
}
template <int BITS, bool ZERO_POINT, int... I>
inline void dequantize_word(const VI (&w)[kVecs], const float* params, float* chunk, std::integer_sequence<int, I...>) {
  (dequantize_value<BITS, ZERO_POINT, I>(w, params, chunk), ...);
}

// chunk [kc, NR] = the dequantized weights of panel p for inputs [k0, k0 + kc).
template <int BITS, bool ZERO_POINT>
void dequantize_chunk(const WNA16Args& a, int64_t p, int64_t k0, int64_t kc, float* chunk) {
  constexpr int kPerWord = 32 / BITS, kParams = ZERO_POINT ? 2 : 1;
  const int32_t* words = a.words + (p * (a.K / kPerWord) + k0 / kPerWord) * NR;
  for (int64_t kk = 0; kk < kc / kPerWord; ++kk) {
    const int64_t g = (k0 + kk * kPerWord) / a.group_size;     // a word never straddles two groups
    VI w[kVecs];
    for (int v = 0; v < kVecs; ++v) w[v] = load_words(words + kk * NR + v * W);
    dequantize_word<BITS, ZERO_POINT>(w, a.params + (p * a.G + g) * kParams * NR, chunk + kk * kPerWord * NR,
                                      std::make_integer_sequence<int, kPerWord>{});
  }
}

// c[r] += x[r, 0:kc] @ chunk for ROWS rows (x: ldx apart; c: rows of NR): gemm.cpp's register tile,
// kVecs x ROWS sums for the whole chunk.
template <int ROWS>
inline void chunk_tile(const float* x, int64_t ldx, const float* chunk, int64_t kc, float* c) {
  const Mask all = first_lanes(W);
  V acc[kVecs][ROWS];
  for (int v = 0; v < kVecs; ++v)
    for (int r = 0; r < ROWS; ++r) acc[v][r] = load(c + r * NR + v * W, all);
  for (int64_t k = 0; k < kc; ++k) {
    V b[kVecs];
    for (int v = 0; v < kVecs; ++v) b[v] = load(chunk + k * NR + v * W, all);
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r) {
      const V xr = set1(x[r * ldx + k]);
      for (int v = 0; v < kVecs; ++v) acc[v][r] = vfs_cpu::fma(xr, b[v], acc[v][r]);
    }
  }
  for (int v = 0; v < kVecs; ++v)
    for (int r = 0; r < ROWS; ++r) store(c + r * NR + v * W, acc[v][r], all);
}

template <int ROWS, typename F>
inline void for_each_row_tile(int64_t first, int64_t rows, F&& tile);   // (below, with the parallel loop)

// y for `rows` rows from m0 (at most kRowBlock) and panel p, chunk by chunk.
template <int BITS, bool ZERO_POINT, typename T>
void wna16_rows_dequantized(const WNA16Args& a, int64_t p, int64_t m0, int64_t rows, T* y) {
  alignas(64) float chunk[kChunk * NR];
  alignas(64) float c[kRowBlock * NR];                 // the block's running sums (16 KB at 64 rows on AVX-512)
  std::fill(c, c + rows * NR, 0.0f);
  for (int64_t k0 = 0; k0 < a.K; k0 += kChunk) {
    const int64_t kc = std::min(kChunk, a.K - k0);     // a multiple of the values per word, as K is
    dequantize_chunk<BITS, ZERO_POINT>(a, p, k0, kc, chunk);
    for_each_row_tile<kRows>(0, rows, [&](auto tile_rows, int64_t r0) {
      chunk_tile<decltype(tile_rows)::value>(a.x + (m0 + r0) * a.K + k0, a.K, chunk, kc, c + r0 * NR);
    });
  }
  store_rows(c, rows, a, p, m0, y);
}

// ---- bf16 x with many rows: the matrix unit (AMX builds)
// From a prefill's or a large batch's row counts on, the fp32 tile above is compute-bound: 16 FMAs
// per instruction against the matrix unit's 8192 bf16 multiply-adds per tdpbf16ps. With bf16 x
// each panel is dequantized once per block of rows, w = (q - z) * s rounded to bf16 (as vLLM's
// AMX kernel for these checkpoints does, and as the reference does when the scales are bf16),
// straight into the order the tiles read (amx.h's "VNNI" B: one int32 per output column holding
// the bf16 weights of two consecutive inputs), and the rows of x run on the tiles against it, 32 at
// a time (panel_products). fp32 and fp16 x keep the exact paths above (bf16 would round their inputs).
#if defined(VFS_CPU_AMX)
constexpr int64_t kAmxMinRows = 16;         // one tile of rows; fewer stay on the vector paths
constexpr int64_t kAmxRowBlock = 256;       // rows per pass over a thread's panels: x's block (256 x 1536 x 2 B) in L2

// The matrix unit may only be used once Linux granted this process the tile state (amx.h).
bool amx_ready() {
  static const bool ready = amx::request_permission();
  return ready;
}

// Lane n: bf16(hi) << 16 | bf16(lo), each rounded to nearest (ties to even) -- one column's two
// consecutive weights, as a B tile holds them.
#if defined(__AVX512BF16__)
// The AMX build: vcvtne2ps2bf16 rounds both vectors at once (lo's 16 into the low half), and one
// vpermw interleaves the halves.
inline VI bf16_pairs(V lo, V hi) {
  // Element 2i <- i (lo's), 2i + 1 <- 16 + i (hi's); a constant, so it stays in a register.
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
}
#else
// SIMDe's build (no AVX512-BF16 there): the same rounding in integer lanes -- add 0x7FFF plus the
// kept part's lowest bit, keep the top 16 bits. (Exact for the finite weights here; no NaN case.)
inline VI bf16_in_top_half(V w) {
  const VI bits = _mm512_castps_si512(w);
  const VI lowest_kept = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lowest_kept));
}
inline VI bf16_pairs(V lo, V hi) {
  return _mm512_or_si512(_mm512_and_si512(bf16_in_top_half(hi), _mm512_set1_epi32(int32_t(0xFFFF0000u))),
                         _mm512_srli_epi32(bf16_in_top_half(lo), 16));
}
#endif

// pairs[I / 2][v * W ...] = the bf16 pair of values I and I + 1 of w[v], each (q - z) * s.
template <int BITS, bool ZERO_POINT, int I>
inline void dequantize_pair_bf16(const VI (&w)[kVecs], const float* params, int32_t* pairs) {
  const Mask all = first_lanes(W);
  for (int v = 0; v < kVecs; ++v) {
    V lo = unpack<BITS, I>(w[v]), hi = unpack<BITS, I + 1>(w[v]);
    if constexpr (ZERO_POINT) {
      const V z = load(params + NR + v * W, all);
      lo = sub(lo, z), hi = sub(hi, z);
    }
    const V s = load(params + v * W, all);
    store_words(pairs + (I / 2) * NR + v * W, bf16_pairs(mul(lo, s), mul(hi, s)));
  }
}
template <int BITS, bool ZERO_POINT, int... J>
inline void dequantize_word_bf16(const VI (&w)[kVecs], const float* params, int32_t* pairs,
                                 std::integer_sequence<int, J...>) {
  (dequantize_pair_bf16<BITS, ZERO_POINT, 2 * J>(w, params, pairs), ...);
}

// pairs [K / 2, NR] int32 = panel p's weights as bf16 pairs: row kp holds inputs 2 kp, 2 kp + 1 of
// each of the panel's columns -- B tiles of 16 rows x 16 columns at pairs + kp * NR + 16 j.
template <int BITS, bool ZERO_POINT>
void dequantize_panel_bf16(const WNA16Args& a, int64_t p, int32_t* pairs) {
  constexpr int kPerWord = 32 / BITS, kParams = ZERO_POINT ? 2 : 1;
  const int32_t* words = a.words + p * (a.K / kPerWord) * NR;
  for (int64_t kk = 0; kk < a.K / kPerWord; ++kk) {
    const int64_t g = kk * kPerWord / a.group_size;            // a word never straddles two groups
    VI w[kVecs];
    for (int v = 0; v < kVecs; ++v) w[v] = load_words(words + kk * NR + v * W);
    dequantize_word_bf16<BITS, ZERO_POINT>(w, a.params + (p * a.G + g) * kParams * NR, pairs + kk * (kPerWord / 2) * NR,
                                           std::make_integer_sequence<int, kPerWord / 2>{});
  }
}

// The products on the tiles, WNA16's and W8A8's alike: sums[r, n] = sum over the inputs of x[r, k] *
// w[n, k] for one panel, `rows` (a multiple of 32) rows of x. Every tile row is 64 bytes: an input
// step is 32 bf16 or 64 int8 inputs, i.e. 64 bytes of each row of x (rows x_stride bytes apart)
// and 16 rows of B (the panel's [steps * 16, NR] int32, each int32 one column's 2 / 4 inputs).
// Per 32 rows and half a panel (32 columns): 4 tiles of 4-byte sums (0-3: 2 x 2 tiles of 16 x 16),
// two of x (4, 5), two of weights (6, 7), 4 products per step -- each tile loaded is used twice.
// The steps go in chunks, every row tile through one chunk before the next: the chunk's weight
// tiles (32 KB) are then read from L1 by every row tile, where a whole panel's (up to 192 KB)
// would come from L2 at a tile per product. The sums wait in `sums` between chunks.
static_assert(NR == 4 * 16, "the AMX kernels take a panel as 4 tiles of 16 columns");
constexpr int64_t kAmxRowTile = 2 * amx::kRows;   // rows per pass: x is padded to a multiple of this
constexpr int64_t kAmxChunkSteps = 8;             // input steps per chunk: 128 B rows x 256 B = 32 KB
enum class Product { kBf16, kInt8 };              // tdpbf16ps (fp32 sums) or tdpbusd (int32 sums)

// The rows the tiles compute for `rows` rows of x: whole passes of kAmxRowTile (x is padded to it).
constexpr int64_t tile_rows(int64_t rows) { return (rows + kAmxRowTile - 1) / kAmxRowTile * kAmxRowTile; }

template <Product P, int C, int A, int B>
inline void dot() {
  if constexpr (P == Product::kBf16) amx::dot_bf16<C, A, B>();
  else amx::dot_u8s8<C, A, B>();
}

template <Product P>
void panel_products(const uint8_t* x, int64_t x_stride, const int32_t* b, int64_t steps, int64_t rows, void* sums) {
  constexpr int64_t kSumStride = NR * 4, kStepB = amx::kRows * NR;    // bytes between rows of sums; B per step
  for (int64_t s0 = 0; s0 < steps; s0 += kAmxChunkSteps) {
    const int64_t s1 = std::min(steps, s0 + kAmxChunkSteps);
    for (int64_t m = 0; m < rows; m += kAmxRowTile) {
      const uint8_t* xm = x + m * x_stride;
      for (int64_t n = 0; n < NR; n += 32) {
        int32_t* c = static_cast<int32_t*>(sums) + m * NR + n;       // 4-byte sums, fp32 or int32
        if (s0 == 0) {
          amx::zero<0>(), amx::zero<1>(), amx::zero<2>(), amx::zero<3>();
        } else {
          amx::load<0>(c, kSumStride), amx::load<1>(c + 16, kSumStride);
          amx::load<2>(c + 16 * NR, kSumStride), amx::load<3>(c + 16 * NR + 16, kSumStride);
        }
        for (int64_t step = s0; step < s1; ++step) {
          const int32_t* bs = b + step * kStepB + n;
          amx::load<4>(xm + step * amx::kRowBytes, x_stride);
          amx::load<5>(xm + 16 * x_stride + step * amx::kRowBytes, x_stride);
          amx::load<6>(bs, kSumStride), amx::load<7>(bs + 16, kSumStride);
          dot<P, 0, 4, 6>(), dot<P, 1, 4, 7>(), dot<P, 2, 5, 6>(), dot<P, 3, 5, 7>();
        }
        amx::store<0>(c, kSumStride), amx::store<1>(c + 16, kSumStride);
        amx::store<2>(c + 16 * NR, kSumStride), amx::store<3>(c + 16 * NR + 16, kSumStride);
      }
    }
  }
}

// y[m0 + r, panel p] for r < rows: xb bf16 rows of K (valid through a multiple of 32 rows from m0),
// pairs from dequantize_panel_bf16.
template <typename T>
void wna16_rows_amx(const WNA16Args& a, const bf16* xb, const int32_t* pairs, int64_t p, int64_t m0, int64_t rows,
                    T* y) {
  thread_local std::vector<float> sums;                        // [rows rounded up to 32, NR]
  const int64_t padded = tile_rows(rows);
  sums.resize(padded * NR);
  panel_products<Product::kBf16>(reinterpret_cast<const uint8_t*>(xb + m0 * a.K), a.K * sizeof(bf16), pairs, a.K / 32,
                                 padded, sums.data());
  store_rows(sums.data(), rows, a, p, m0, y);
}
#endif

// ------------------------------------------------------------------------ W8A8: exact int8 dot products
// dot4(acc, x, w): each int32 lane += the dot product of the 4 bytes of x (the same 4 activations in
// every lane: one quantized word of a row, prepared by activations()) with the 4 bytes of its
// weight word (prepared by weights()). kActivationOffset: what quantize_rows adds to each
// activation byte for this dot (128: VNNI's unsigned operand).
#if defined(VFS_CPU_VNNI)
constexpr int kActivationOffset = 128;
struct Activations { VI x; };                 // x + 128 as unsigned bytes, in every lane
struct Weights { VI w; };
inline Activations activations(int32_t word) { return {broadcast_word(word)}; }
inline Weights weights(VI w) { return {w}; }
inline VI dot4(VI acc, const Activations& x, const Weights& w) { return _mm512_dpbusd_epi32(acc, x.x, w.w); }
#elif defined(VFS_CPU_AVX512) || defined(VFS_CPU_AVX2)
// Bytes 0 and 2 / 1 and 3 of each lane sign-extended into its two int16 halves (a left shift puts
// the low byte on top first), then vpmaddwd: 2 int16 products summed into each int32, twice.
// Exact for every int8 value (the byte-wise vpmaddubsw would saturate at 2 * 128 * 128).
constexpr int kActivationOffset = 0;
struct Activations { VI even, odd; };
struct Weights { VI even, odd; };
#if defined(VFS_CPU_AVX512)
inline VI even_bytes(VI v) { return _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8); }
inline VI odd_bytes(VI v) { return _mm512_srai_epi16(v, 8); }
inline VI madd_pairs(VI acc, VI a, VI b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
#else
inline VI even_bytes(VI v) { return _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8); }
inline VI odd_bytes(VI v) { return _mm256_srai_epi16(v, 8); }
inline VI madd_pairs(VI acc, VI a, VI b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
#endif
inline Activations activations(int32_t word) {
  const VI x = broadcast_word(word);
  return {even_bytes(x), odd_bytes(x)};
}
inline Weights weights(VI w) { return {even_bytes(w), odd_bytes(w)}; }
inline VI dot4(VI acc, const Activations& x, const Weights& w) {
  return madd_pairs(madd_pairs(acc, x.even, w.even), x.odd, w.odd);
}
#else
constexpr int kActivationOffset = 0;
struct Activations { int32_t x; };
struct Weights { int32_t w; };
inline Activations activations(int32_t word) { return {word}; }
inline Weights weights(VI w) { return {w}; }
inline VI dot4(VI acc, const Activations& x, const Weights& w) {
  for (int b = 0; b < 4; ++b) acc += int32_t(int8_t(uint32_t(x.x) >> 8 * b)) * int32_t(int8_t(uint32_t(w.w) >> 8 * b));
  return acc;
}
#endif

struct W8A8Args {
  const int32_t* x_words;  // [T, K4]: 4 quantized activations (+ kActivationOffset, as bytes) per word
  const double* x_scale;   // [T]
  const int32_t* words;    // [P, K4, NR]
  const int32_t* row_sums; // [P * NR]: sum_k w[n, k] (VNNI's correction for the offset)
  const double* w_scale;   // [P * NR]
  const double* bias;      // [N], or nullptr
  int64_t K4, N;
};

// W of one row's outputs from their int32 sums: the offset's correction, then the reference's
// scaling in double, ((acc * x_scale) * w_scale + bias, the operations and order of w8a8_store's
// scalar loop) in the double lanes, rounded to fp32 lanes.
#if defined(VFS_CPU_AVX512)
inline V scaled_sums(const int32_t* sums, const int32_t* row_sums, const double* w_scale, const double* bias,
                     double x_scale) {
  const __m512i exact = _mm512_sub_epi32(_mm512_loadu_si512(sums), _mm512_mullo_epi32(
      _mm512_set1_epi32(kActivationOffset), _mm512_loadu_si512(row_sums)));
  __m256 half[2];
  for (int h = 0; h < 2; ++h) {                                  // 8 doubles at a time
    const __m256i part = h ? _mm512_extracti32x8_epi32(exact, 1) : _mm512_castsi512_si256(exact);
    __m512d value = _mm512_mul_pd(_mm512_mul_pd(_mm512_cvtepi32_pd(part), _mm512_set1_pd(x_scale)),
                                  _mm512_loadu_pd(w_scale + 8 * h));
    if (bias) value = _mm512_add_pd(value, _mm512_loadu_pd(bias + 8 * h));
    half[h] = _mm512_cvtpd_ps(value);
  }
  return _mm512_insertf32x8(_mm512_castps256_ps512(half[0]), half[1], 1);
}
#elif defined(VFS_CPU_AVX2)
inline V scaled_sums(const int32_t* sums, const int32_t* row_sums, const double* w_scale, const double* bias,
                     double x_scale) {
  const __m256i exact = _mm256_sub_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums)), _mm256_mullo_epi32(
      _mm256_set1_epi32(kActivationOffset), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row_sums))));
  __m128 half[2];
  for (int h = 0; h < 2; ++h) {                                  // 4 doubles at a time
    const __m128i part = h ? _mm256_extracti128_si256(exact, 1) : _mm256_castsi256_si128(exact);
    __m256d value = _mm256_mul_pd(_mm256_mul_pd(_mm256_cvtepi32_pd(part), _mm256_set1_pd(x_scale)),
                                  _mm256_loadu_pd(w_scale + 4 * h));
    if (bias) value = _mm256_add_pd(value, _mm256_loadu_pd(bias + 4 * h));
    half[h] = _mm256_cvtpd_ps(value);
  }
  return _mm256_set_m128(half[1], half[0]);
}
#endif

// y[m0 + r, panel p's columns] for r < rows from the int32 sums (rows of NR): scaled_sums W columns
// at a time, stored in y's dtype, the rest one at a time. (One output at a time, this took 87 us of
// the 712 of a 64-row call of SmolLM2's four W8A8 linears, weights from DRAM, 2 threads.)
template <typename T>
void w8a8_store(const int32_t* sums, int64_t rows, const W8A8Args& a, int64_t p, int64_t m0, T* y) {
  const int n_valid = valid_columns(p, a.N);
  const int32_t* row_sums = a.row_sums + p * NR;
  const double* w_scale = a.w_scale + p * NR;
  const double* bias = a.bias ? a.bias + p * NR : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* sr = sums + r * NR;
    const double x_scale = a.x_scale[m0 + r];
    T* yr = y + (m0 + r) * a.N + p * NR;
    int j = 0;
#if defined(VFS_CPU_AVX512) || defined(VFS_CPU_AVX2)
    for (; j + W <= n_valid; j += W)
      store(yr + j, scaled_sums(sr + j, row_sums + j, w_scale + j, bias ? bias + j : nullptr, x_scale));
#endif
    for (; j < n_valid; ++j) {
      const int32_t exact = sr[j] - kActivationOffset * row_sums[j];
      double value = double(exact) * x_scale * w_scale[j];        // the reference's order: (acc * xs) * ws
      if (bias) value += bias[j];
      from_float(float(value), yr + j);
    }
  }
}

// y[r, n] for ROWS rows from m0 and panel p's columns: the int32 sums, then the reference's scaling.
template <int ROWS, typename T>
void w8a8_tile(const W8A8Args& a, int64_t p, int64_t m0, T* y) {
  VI acc[kVecs][ROWS];
  for (int v = 0; v < kVecs; ++v)
    for (int r = 0; r < ROWS; ++r) acc[v][r] = zero_words();
  const int32_t* panel = a.words + p * a.K4 * NR;
  const int32_t* x = a.x_words + m0 * a.K4;
  for (int64_t kk = 0; kk < a.K4; ++kk) {
    Activations xs[ROWS];                              // each row's 4 activations, ready for every vector
    for (int r = 0; r < ROWS; ++r) xs[r] = activations(x[r * a.K4 + kk]);
    for (int v = 0; v < kVecs; ++v) {
      const Weights w = weights(load_words(panel + kk * NR + v * W));
      for (int r = 0; r < ROWS; ++r) acc[v][r] = dot4(acc[v][r], xs[r], w);
    }
  }
  int32_t sums[ROWS][NR];
  for (int v = 0; v < kVecs; ++v)
    for (int r = 0; r < ROWS; ++r) store_words(sums[r] + v * W, acc[v][r]);
  w8a8_store(sums[0], ROWS, a, p, m0, y);
}

#if defined(VFS_CPU_AMX)
// Many rows on the matrix unit: tdpbusd is vpdpbusd's product (unsigned activation bytes, signed
// weight bytes, 4 per int32) on 16 x 16 x 64 at once, and pack_w8a8's panels are already the
// order its B tiles read (4 consecutive inputs of one column per int32). x_words holds a multiple
// of 32 rows from m0; K4 a multiple of 16. Exact int32 sums, so the same bits as w8a8_tile.
template <typename T>
void w8a8_rows_amx(const W8A8Args& a, int64_t p, int64_t m0, int64_t rows, T* y) {
  thread_local std::vector<int32_t> sums;                      // [rows rounded up to 32, NR]
  const int64_t padded = tile_rows(rows);
  sums.resize(padded * NR);
  panel_products<Product::kInt8>(reinterpret_cast<const uint8_t*>(a.x_words + m0 * a.K4), a.K4 * sizeof(int32_t),
                                 a.words + p * a.K4 * NR, a.K4 / amx::kRows, padded, sums.data());
  w8a8_store(sums.data(), rows, a, p, m0, y);
}
#endif

// max |x[k]| for k < K, x in its own dtype: a maximum is exact in any order, so W lanes at a time
// (a scalar loop is one chain of dependent max instructions, a microsecond per row of SmolLM2's).
template <typename S>
float absmax_of(const S* x, int64_t K) {
  const Mask all = first_lanes(W);
  V m = zero();
  int64_t k = 0;
  for (; k + W <= K; k += W) {
    const V v = load(x + k, all);
    m = vfs_cpu::max(m, vfs_cpu::max(v, sub(zero(), v)));
  }
  float absmax = reduce_max(m);
  for (; k < K; ++k) absmax = std::max(absmax, std::fabs(to_float(x[k])));
  return absmax;
}

// One row of x [K] (fp32 / bf16 / fp16) on its own int8 grid, as reference.quantize_per_token_int8:
// scale = max|x| / 127 (1 for a zero row), q = round-half-even(x / scale) clamped to [-128, 127],
// written as bytes q + kActivationOffset (the pad up to 4 * K4 holds q = 0). Returns the scale.
// x / scale is a true division, as the reference's: x * (1 / scale) would round differently.
template <typename S>
float quantize_row(const S* x, int64_t K, int64_t K4, uint8_t* bytes) {
  const float absmax = absmax_of(x, K);
  const float scale = absmax == 0.0f ? 1.0f : absmax / 127.0f;      // fp32 division, as torch
  int64_t k = 0;
#if defined(VFS_CPU_AVX512)
  // 16 at a time: vdivps, vrndscaleps (nearest, ties to even), clamp, vcvtps2dq, vpmovdb.
  const Mask all = first_lanes(W);
  const V s = set1(scale), lowest = set1(-128.0f), highest = set1(127.0f);
  const __m512i offset = _mm512_set1_epi32(kActivationOffset);
  for (; k + W <= K; k += W) {
    const V q = _mm512_roundscale_ps(_mm512_div_ps(load(x + k, all), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const V clamped = _mm512_min_ps(_mm512_max_ps(q, lowest), highest);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(bytes + k),
                     _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(clamped), offset)));
  }
#endif
  for (; k < K; ++k) {
    const float q = std::min(std::max(std::nearbyint(to_float(x[k]) / scale), -128.0f), 127.0f);   // half to even
    bytes[k] = uint8_t(int32_t(q) + kActivationOffset);
  }
  std::fill(bytes + K, bytes + 4 * K4, uint8_t(kActivationOffset));
  return scale;
}

// Each row of x [T, K] quantized (quantize_row) into x_words [T, K4], its scale into x_scale [T].
// Rows split between threads from kMinQuantizeInputsPerThread inputs (a decode batch's 64 rows of
// SmolLM2's 576 inputs took ~20 us on one thread: a true division per input).
template <typename S>
void quantize_rows(const S* x, int64_t T, int64_t K, int64_t K4, int32_t* x_words, double* x_scale) {
  const int64_t grain = std::max<int64_t>(1, kMinQuantizeInputsPerThread / std::max<int64_t>(1, K));
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      x_scale[t] = quantize_row(x + t * K, K, K4, reinterpret_cast<uint8_t*>(x_words + t * K4));
  });
}

// ------------------------------------------------------------------------ the parallel loop, both kernels
// tile(rows, r0) for tiles of kRows rows from `first` (as many as fit), then one smaller tile for
// the rest; `rows` is a std::integral_constant, so each tile size is its own compiled loop.
template <int ROWS, typename F>
inline void for_each_row_tile(int64_t first, int64_t rows, F&& tile) {
  int64_t r = 0;
  for (; r + ROWS <= rows; r += ROWS) tile(std::integral_constant<int, ROWS>{}, first + r);
  if constexpr (ROWS > 1) {
    if (r < rows) for_each_row_tile<ROWS - 1>(first + r, rows - r, tile);
  }
}

// block(p, m0, rows) for every panel p and block of at most kRowBlock rows: threads split the
// panels (a contiguous share of the packed weights each), each thread goes through its panels once
// per block of rows (so a prefill chunk's rows of x stay in L2 while the panels pass).
template <typename F>
void for_each_panel_block(int64_t P, int64_t T, int64_t weights_per_panel, F&& block, int64_t row_block = kRowBlock) {
  const int64_t grain = std::max<int64_t>(1, kMinWeightsPerThread / weights_per_panel);
  at::parallel_for(0, P, grain, [&](int64_t p_begin, int64_t p_end) {
    for (int64_t m0 = 0; m0 < T; m0 += row_block) {
      const int64_t rows = std::min(row_block, T - m0);
      for (int64_t p = p_begin; p < p_end; ++p) block(p, m0, rows);
    }
  });
}

template <typename F>
void dispatch_dtype(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(bf16{}); break;
    case at::kHalf: f(fp16{}); break;
    default: TORCH_CHECK(false, "cpu quant gemm: x must be float32, bfloat16 or float16, got ", dtype);
  }
}

// f(bits, zero_point) with both as compile-time constants (std::integral_constant).
template <typename F>
void dispatch_scheme(int64_t num_bits, bool symmetric, F&& f) {
  using Four = std::integral_constant<int, 4>;
  using Eight = std::integral_constant<int, 8>;
  if (num_bits == 4) symmetric ? f(Four{}, std::false_type{}) : f(Four{}, std::true_type{});
  else symmetric ? f(Eight{}, std::false_type{}) : f(Eight{}, std::true_type{});
}

#if defined(VFS_CPU_AMX)
// Whether a call with T rows runs on the matrix unit: enough rows, and Linux lets this process.
bool use_amx(int64_t T) { return T >= kAmxMinRows && amx_ready(); }

// x as the tiles read it: zero rows appended up to tile_rows (their results are dropped).
at::Tensor padded_to_tiles(const at::Tensor& x) {
  const int64_t extra = tile_rows(x.size(0)) - x.size(0);
  return extra ? at::constant_pad_nd(x, {0, 0, 0, extra}) : x;
}

// wna16_gemm with bf16 x on the tiles: each panel dequantized to bf16 pairs once per block of rows.
void wna16_gemm_amx(const at::Tensor& x, const WNA16Args& a, int64_t P, int64_t num_bits, bool symmetric,
                    at::Tensor& y) {
  const at::Tensor xb = padded_to_tiles(x);
  const bf16* xp = static_cast<const bf16*>(xb.data_ptr());
  bf16* out = static_cast<bf16*>(y.data_ptr());
  dispatch_scheme(num_bits, symmetric, [&](auto bits, auto zero_point) {
    for_each_panel_block(P, x.size(0), a.K * NR, [&](int64_t p, int64_t m0, int64_t rows) {
      thread_local std::vector<int32_t> pairs;                 // [K / 2, NR]: 192 KB at K = 1536, in L2
      pairs.resize(a.K / 2 * NR);
      dequantize_panel_bf16<decltype(bits)::value, decltype(zero_point)::value>(a, p, pairs.data());
      amx::configure();
      wna16_rows_amx(a, xp, pairs.data(), p, m0, rows, out);
      amx::release();
    }, kAmxRowBlock);
  });
}
#endif

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(),
              "cpu quant gemm: x must be a contiguous 2-D CPU tensor [T, in], got ", x.sizes());
  TORCH_CHECK(x.size(1) == K, "cpu quant gemm: x has ", x.size(1), " input features, the weight ", K);
}

// The data of a contiguous 1-D tensor of `dtype` and length n (a TORCH_CHECK names `what` otherwise).
template <typename S>
const S* vector_data(const at::Tensor& v, at::ScalarType dtype, int64_t n, const char* what) {
  TORCH_CHECK(v.scalar_type() == dtype && v.dim() == 1 && v.size(0) == n && v.is_contiguous(),
              "cpu quant gemm: ", what, " must be contiguous ", dtype, " [", n, "], got ", v.scalar_type(), " ",
              v.sizes());
  return v.data_ptr<S>();
}

// x [T, K] @ dequantize(W)^T (+ bias) -> [T, N] in x's dtype. words [P, K / per_word, NR] int32,
// params [P, G, 1 or 2, NR] float32 (scale; zero point when not symmetric), bias fp32 [N] or None.
at::Tensor wna16_gemm(const at::Tensor& x, const at::Tensor& words, const at::Tensor& params,
                      const std::optional<at::Tensor>& bias, int64_t num_bits, int64_t group_size, bool symmetric,
                      int64_t N) {
  TORCH_CHECK(num_bits == 4 || num_bits == 8, "cpu quant gemm: num_bits must be 4 or 8, got ", num_bits);
  const int64_t per_word = 32 / num_bits;
  TORCH_CHECK(words.scalar_type() == at::kInt && words.dim() == 3 && words.size(2) == NR && words.is_contiguous(),
              "cpu quant gemm: the weight is not a pack_wna16() result of this build (panel width ", NR, "), got ",
              words.scalar_type(), " ", words.sizes());
  const int64_t P = words.size(0), K = words.size(1) * per_word;
  check_x(x, K);
  TORCH_CHECK(N > (P - 1) * NR && N <= P * NR, "cpu quant gemm: ", N, " outputs do not fit ", P, " panels of ", NR);
  TORCH_CHECK(group_size > 0 && group_size % per_word == 0 && K % group_size == 0,
              "cpu quant gemm: group_size ", group_size, " must divide ", K, " and be a multiple of ", per_word);
  const int64_t G = K / group_size, kParams = symmetric ? 1 : 2;
  TORCH_CHECK(params.scalar_type() == at::kFloat && params.is_contiguous() && params.dim() == 4 &&
                  params.size(0) == P && params.size(1) == G && params.size(2) == kParams && params.size(3) == NR,
              "cpu quant gemm: params must be contiguous float32 [", P, ", ", G, ", ", kParams, ", ", NR, "], got ",
              params.sizes());
  const float* bias_ptr = bias ? vector_data<float>(*bias, at::kFloat, N, "bias") : nullptr;
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  const int64_t T = x.size(0);
  if (T == 0) return y;
#if defined(VFS_CPU_AMX)
  if (x.scalar_type() == at::kBFloat16 && K % 32 == 0 && use_amx(T)) {
    const WNA16Args args{nullptr, words.data_ptr<int32_t>(), params.data_ptr<float>(), bias_ptr, K, N, G, group_size};
    wna16_gemm_amx(x, args, P, num_bits, symmetric, y);
    return y;
  }
#endif
  const at::Tensor xf = x.to(at::kFloat).contiguous();     // once per call: T x K, nothing next to T x K x N
  const WNA16Args args{xf.data_ptr<float>(), words.data_ptr<int32_t>(), params.data_ptr<float>(), bias_ptr, K, N, G,
                       group_size};
  dispatch_dtype(x.scalar_type(), [&](auto tag) {
    using T_ = decltype(tag);
    T_* out = static_cast<T_*>(y.data_ptr());
    dispatch_scheme(num_bits, symmetric, [&](auto bits, auto zero_point) {
      constexpr int kBits = decltype(bits)::value;
      constexpr bool kZeroPoint = decltype(zero_point)::value;
      for_each_panel_block(P, T, K * NR, [&](int64_t p, int64_t m0, int64_t rows) {
        if (rows > kRows) {                              // several row tiles: dequantize each chunk once
          wna16_rows_dequantized<kBits, kZeroPoint>(args, p, m0, rows, out);
          return;
        }
        for_each_row_tile<kRows>(m0, rows, [&](auto tile_rows, int64_t r0) {
          wna16_tile<kBits, kZeroPoint, decltype(tile_rows)::value>(args, p, r0, out);
        });
      });
    });
  });
  return y;
}

// x [T, K] -> per-token int8, @ Wq^T in int32, scaled -> [T, N] in x's dtype. words [P, K4, NR]
// int32 (4 int8 weights each; K4 = ceil(K / 4)), row_sums int32 [P * NR], w_scale float64 [P * NR],
// bias float64 [N].
at::Tensor w8a8_gemm(const at::Tensor& x, const at::Tensor& words, const at::Tensor& row_sums,
                     const at::Tensor& w_scale, const std::optional<at::Tensor>& bias, int64_t K, int64_t N) {
  TORCH_CHECK(words.scalar_type() == at::kInt && words.dim() == 3 && words.size(2) == NR && words.is_contiguous(),
              "cpu quant gemm: the weight is not a pack_w8a8() result of this build (panel width ", NR, "), got ",
              words.scalar_type(), " ", words.sizes());
  const int64_t P = words.size(0), K4 = words.size(1);
  TORCH_CHECK((K + 3) / 4 == K4, "cpu quant gemm: ", K, " inputs do not fit ", K4, " words of 4");
  check_x(x, K);
  TORCH_CHECK(K <= kMaxW8A8Inputs, "cpu quant gemm: W8A8 takes at most ", kMaxW8A8Inputs, " inputs (int32 sums), got ",
              K);
  TORCH_CHECK(N > (P - 1) * NR && N <= P * NR, "cpu quant gemm: ", N, " outputs do not fit ", P, " panels of ", NR);
  const int32_t* sums_ptr = vector_data<int32_t>(row_sums, at::kInt, P * NR, "row_sums");
  const double* scale_ptr = vector_data<double>(w_scale, at::kDouble, P * NR, "w_scale");
  const double* bias_ptr = bias ? vector_data<double>(*bias, at::kDouble, N, "bias") : nullptr;
  const int64_t T = x.size(0);
  at::Tensor y = at::empty({T, N}, x.options());
  if (T == 0) return y;
  bool tiles = false;
  int64_t rows_allocated = T;
#if defined(VFS_CPU_AMX)
  static_assert(kActivationOffset == 128, "tdpbusd reads the activations as unsigned bytes, as vpdpbusd");
  tiles = K4 % amx::kRows == 0 && use_amx(T);             // 64 inputs per tile step
  // The tiles read x 32 rows at a time: the rows past T hold q = 0 (their results are dropped).
  if (tiles) rows_allocated = tile_rows(T);
#endif
  at::Tensor x_words = at::empty({rows_allocated, K4}, words.options());
  at::Tensor x_scale = at::empty({T}, w_scale.options());
  dispatch_dtype(x.scalar_type(), [&](auto tag) {        // x read in its own dtype: no fp32 copy of it
    quantize_rows(static_cast<const decltype(tag)*>(x.data_ptr()), T, K, K4, x_words.data_ptr<int32_t>(),
                  x_scale.data_ptr<double>());
  });
  int32_t* padding = x_words.data_ptr<int32_t>() + T * K4;
  std::fill(padding, padding + (rows_allocated - T) * K4, int32_t(0x01010101u * kActivationOffset));
  const W8A8Args args{x_words.data_ptr<int32_t>(), x_scale.data_ptr<double>(), words.data_ptr<int32_t>(), sums_ptr,
                      scale_ptr, bias_ptr, K4, N};
  dispatch_dtype(x.scalar_type(), [&](auto tag) {
    using T_ = decltype(tag);
    T_* out = static_cast<T_*>(y.data_ptr());
#if defined(VFS_CPU_AMX)
    if (tiles) {
      for_each_panel_block(P, T, 4 * K4 * NR, [&](int64_t p, int64_t m0, int64_t rows) {
        amx::configure();
        w8a8_rows_amx(args, p, m0, rows, out);
        amx::release();
      }, kAmxRowBlock);
      return;
    }
#endif
    for_each_panel_block(P, T, 4 * K4 * NR, [&](int64_t p, int64_t m0, int64_t rows) {
      for_each_row_tile<kRows>(m0, rows, [&](auto tile_rows, int64_t r0) {
        w8a8_tile<decltype(tile_rows)::value>(args, p, r0, out);
      });
    });
  });
  return y;
}

// Whether linears with many rows run on the matrix unit: an AMX build (or the SIMDe build's
// emulation of it) in a process Linux lets use the tiles.
bool uses_amx() {
#if defined(VFS_CPU_AMX)
  return amx_ready();
#else
  return false;
#endif
}

bool uses_vnni() {
#if defined(VFS_CPU_VNNI)
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "quantized linears (int4 / int8 weights read packed; int8 activations) for the CPU";
  m.attr("panel_width") = NR;
  m.attr("rows_per_tile") = kRows;
  m.def("isa", [] { return std::string(kIsaName); }, "the instruction set this build was compiled for");
  m.def("amx", &uses_amx, "whether bf16 WNA16 and W8A8 run on AMX tiles from 16 rows (or SIMDe's build's emulation)");
  m.def("vnni", &uses_vnni, "whether W8A8 runs on vpdpbusd (AVX-512 VNNI, or SIMDe's emulation of it)");
  m.def("wna16_gemm", &wna16_gemm, "x [T, K] @ dequantize(W)^T (+ bias) -> [T, N], W packed by pack_wna16",
        py::arg("x"), py::arg("words"), py::arg("params"), py::arg("bias"), py::arg("num_bits"),
        py::arg("group_size"), py::arg("symmetric"), py::arg("n_out"), py::call_guard<py::gil_scoped_release>());
  m.def("w8a8_gemm", &w8a8_gemm, "int8(x) @ Wq^T * scales (+ bias) -> [T, N], W packed by pack_w8a8", py::arg("x"),
        py::arg("words"), py::arg("row_sums"), py::arg("w_scale"), py::arg("bias"), py::arg("n_in"), py::arg("n_out"),
        py::call_guard<py::gil_scoped_release>());
}
