// The few vector operations the CPU attention kernel needs, for one instruction set chosen
// at COMPILE time: AVX-512 (16 fp32 lanes), AVX2 + FMA (8 lanes), or portable scalar code
// (1 lane) -- and, for tests, the AVX-512 branch emulated by SIMDe on a CPU without it. The
// Python loader picks the flags from a runtime check of the CPU (kernels_cpu/build.py),
// so one source builds the best variant each machine can run.
//
// Why a tiny wrapper instead of letting the compiler vectorise plain loops: the two inner
// loops the kernel lives in are a dot product (a reduction, which -O3 will not reorder
// without -ffast-math) and a softmax (exp, which has no vector form in libm). Written
// against `Vec`, each is one loop that reads the same on all three instruction sets.
//
// Loads convert to fp32 on the way in (bf16 is the top half of an fp32; fp16 through
// F16C), so the kernel's arithmetic is fp32 whatever the cache dtype, like the reference.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(VFS_CPU_SIMDE_AVX512)        // tests: the AVX-512 branch, emulated (vec_simde.h)
#define VFS_CPU_AVX512 1
#include "vec_simde.h"
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define VFS_CPU_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VFS_CPU_AVX2 1
#include <immintrin.h>
#else
#define VFS_CPU_SCALAR 1
#endif

namespace vfs_cpu {

// 16-bit float storage types: the kernel only converts them, never computes in them.
struct bf16 { uint16_t bits; };
struct fp16 { uint16_t bits; };

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  uint32_t u = uint32_t(x.bits) << 16;          // bf16 = the high 16 bits of an fp32
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_float(fp16 x) {
#if defined(VFS_CPU_SCALAR)
  _Float16 h;                                    // GCC >= 12: a real half type on x86 and Arm
  std::memcpy(&h, &x.bits, 2);
  return float(h);
#else
  return _cvtsh_ss(x.bits);
#endif
}

inline void from_float(float f, float* dst) { *dst = f; }
inline void from_float(float f, bf16* dst) {
  // Round to nearest even, as torch's .to(torch.bfloat16) does; NaN stays a (quiet) NaN.
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) {
    dst->bits = uint16_t((u >> 16) | 0x40);
    return;
  }
  u += 0x7FFF + ((u >> 16) & 1);
  dst->bits = uint16_t(u >> 16);
}
inline void from_float(float f, fp16* dst) {
#if defined(VFS_CPU_SCALAR)
  _Float16 h = _Float16(f);
  std::memcpy(&dst->bits, &h, 2);
#else
  dst->bits = _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#endif
}

// 8-bit K/V cache storage (paged_attention/kv_quant.py): int8, and fp8 e4m3fn (1 sign bit, 4
// exponent bits biased by 7, 3 mantissa bits, no infinities). Rows are dequantized by their scale
// in the kernel, not here: a load only widens the stored number to fp32.
struct fp8e4m3 { uint8_t bits; };

inline float to_float(int8_t x) { return float(x); }
// The 7 exponent + mantissa bits moved to an fp16's place are the same number times 2^-8 (fp16's
// exponent bias is 15, e4m3's 7), subnormals included; so: widen to fp16, convert, times 256.
inline uint16_t fp8e4m3_as_fp16_bits(uint8_t b) { return uint16_t((b & 0x80) << 8 | (b & 0x7F) << 7); }
inline float to_float(fp8e4m3 x) { return to_float(fp16{fp8e4m3_as_fp16_bits(x.bits)}) * 256.0f; }

// Ask for a cache line ahead of use (a hint: never faults, even on a bad address): into L1,
// or only as far as L2 (for data that is read from there, as the GEMM's weight panels are).
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#if defined(VFS_CPU_AVX512)
// ---------------------------------------------------------------------------------- AVX-512
#if defined(VFS_CPU_SIMDE_AVX512)
constexpr const char* kIsaName = "avx512_simde";
#else
constexpr const char* kIsaName = "avx512";
#endif
constexpr int W = 16;                       // fp32 lanes per vector
using V = __m512;
using Mask = __mmask16;                     // one bit per lane

inline Mask first_lanes(int n) {            // lanes [0, n) set; n may be <= 0 or >= W
  return n >= W ? Mask(0xFFFF) : n <= 0 ? Mask(0) : Mask((1u << n) - 1);
}
inline V zero() { return _mm512_setzero_ps(); }
inline V set1(float x) { return _mm512_set1_ps(x); }
// A whole vector (m = every lane, which most callers know at compile time) takes the plain
// load/store, not the masked one. That is not about the instruction's speed: GCC 12 keeps an
// array of vectors in memory when its values pass through a masked-load builtin, and then
// stores every accumulator of a register tile to the stack on each loop iteration — gemm.cpp's
// 4 x 3 tile made 12 64-byte stores per k step (tests/kernels_cpu/test_gemm_codegen.py reads the
// compiled loop; `python -m benchmarks.bench_cpu_gemm` times the kernel).
inline bool every_lane(Mask m) { return m == Mask(0xFFFF); }
inline V load(const float* p, Mask m) { return every_lane(m) ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p); }
inline __m256i load_16bit_lanes(const void* p, Mask m) {    // bf16 / fp16: 16 lanes of 2 bytes
  return every_lane(m) ? _mm256_loadu_si256(static_cast<const __m256i*>(p)) : _mm256_maskz_loadu_epi16(m, p);
}
inline V load(const bf16* p, Mask m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load_16bit_lanes(p, m)), 16));
}
inline V load(const fp16* p, Mask m) { return _mm512_cvtph_ps(load_16bit_lanes(p, m)); }
inline __m128i load_8bit_lanes(const void* p, Mask m) {      // int8 / fp8: 16 lanes of 1 byte
  if (every_lane(m)) return _mm_loadu_si128(static_cast<const __m128i*>(p));
  alignas(16) uint8_t lanes[16] = {};                         // a row's tail: touch only its own bytes
  for (int i = 0; i < 16; ++i)
    if (m >> i & 1) lanes[i] = static_cast<const uint8_t*>(p)[i];
  return _mm_load_si128(reinterpret_cast<const __m128i*>(lanes));
}
inline V load(const int8_t* p, Mask m) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load_8bit_lanes(p, m))); }
inline V load(const fp8e4m3* p, Mask m) {
  const __m256i b = _mm256_cvtepu8_epi16(load_8bit_lanes(p, m));                  // 16 x 16 bits
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));              // see to_float(fp8e4m3)
}
inline void store(float* p, V v, Mask m) {
  if (every_lane(m)) _mm512_storeu_ps(p, v);
  else _mm512_mask_storeu_ps(p, m, v);
}
inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V add(V a, V b) { return _mm512_add_ps(a, b); }
inline V max(V a, V b) { return _mm512_max_ps(a, b); }
inline V select(Mask m, V if_set, V if_clear) { return _mm512_mask_blend_ps(m, if_clear, if_set); }
inline float reduce_add(V v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(V v) { return _mm512_reduce_max_ps(v); }
inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V div(V a, V b) { return _mm512_div_ps(a, b); }
inline V neg(V a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN))); }
// Whole vectors of 16-bit floats out: each lane rounded to nearest even, as from_float does (a
// NaN stays a quiet NaN). bf16 is integer arithmetic on the fp32 bits: + 0x7FFF + the kept
// part's lowest bit, then the top 16 bits.
inline __m512i bf16_bits(V v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}
inline __m256i fp16_bits(V v) { return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline void store(bf16* p, V v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v))); }
inline void store(fp16* p, V v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), fp16_bits(v)); }
inline V rounded_to(V v, bf16) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }
inline V rounded_to(V v, fp16) { return _mm512_cvtph_ps(fp16_bits(v)); }

// acc[j] holds W partial sums of dot product j: return the vector (sum(acc[0]), ...,
// sum(acc[W-1])). A transpose-and-add tree: 45 shuffles/adds for 16 dot products,
// instead of a horizontal sum (~8 instructions) per product.
inline V reduce_lanes(const V* acc) {
  V t[8], u[4], x[2];
  for (int i = 0; i < 8; ++i)   // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                         _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
  for (int i = 0; i < 4; ++i)   // per 128-bit lane: [a, b, c, d] partial sums
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)   // add 128-bit lanes pairwise
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// e^x: x = n ln2 + r with |r| <= ln2/2, e^r by its degree-6 Taylor polynomial (relative
// error < 2e-7, about one fp32 ulp), times 2^n by scalef. Inputs below -87.3 give ~1e-38
// rather than 0: callers zero masked lanes with `select`, never through exp(-inf).
inline V exp(V x) {
  x = _mm512_max_ps(_mm512_min_ps(x, set1(88.0f)), set1(-87.3f));
  V n = _mm512_roundscale_ps(_mm512_mul_ps(x, set1(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  V r = _mm512_fnmadd_ps(n, set1(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, set1(1.428606765330187e-06f), r);
  V p = set1(1.0f / 720);
  p = fma(p, r, set1(1.0f / 120));
  p = fma(p, r, set1(1.0f / 24));
  p = fma(p, r, set1(1.0f / 6));
  p = fma(p, r, set1(0.5f));
  p = fma(p, r, set1(1.0f));
  p = fma(p, r, set1(1.0f));
  return _mm512_scalef_ps(p, n);
}

#elif defined(VFS_CPU_AVX2)
// ------------------------------------------------------------------------------------- AVX2
constexpr const char* kIsaName = "avx2";
constexpr int W = 8;
using V = __m256;
using Mask = __m256;                        // all-ones / all-zeros lanes (a compare result)

inline Mask first_lanes(int n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx));
}
inline V zero() { return _mm256_setzero_ps(); }
inline V set1(float x) { return _mm256_set1_ps(x); }
// head_dim is a multiple of 8 (checked by the wrapper), so head_dim chunks are always full:
// the mask argument is only there to share one signature with AVX-512.
inline V load(const float* p, Mask) { return _mm256_loadu_ps(p); }
inline V load(const bf16* p, Mask) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline V load(const fp16* p, Mask) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline V load(const int8_t* p, Mask) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline V load(const fp8e4m3* p, Mask) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));   // 8 x 16 bits
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));              // see to_float(fp8e4m3)
}
inline void store(float* p, V v, Mask) { _mm256_storeu_ps(p, v); }
inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V add(V a, V b) { return _mm256_add_ps(a, b); }
inline V max(V a, V b) { return _mm256_max_ps(a, b); }
inline V select(Mask m, V if_set, V if_clear) { return _mm256_blendv_ps(if_clear, if_set, m); }
inline V sub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V div(V a, V b) { return _mm256_div_ps(a, b); }
inline V neg(V a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
inline __m256i bf16_bits(V v) {              // see the AVX-512 version
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet_nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline __m128i fp16_bits(V v) { return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline void store(bf16* p, V v) {            // 8 x 32 bits -> 8 x 16 (each fits: packus saturates nothing)
  const __m256i b = bf16_bits(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}
inline void store(fp16* p, V v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), fp16_bits(v)); }
inline V rounded_to(V v, bf16) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16)); }
inline V rounded_to(V v, fp16) { return _mm256_cvtph_ps(fp16_bits(v)); }
inline float reduce_add(V v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float reduce_max(V v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline V reduce_lanes(const V* acc) {       // 8 dot products' partials -> one vector of 8 sums
  V t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
  V t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
  V u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);   // per 128-bit half: 4 partials
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
inline V exp(V x) {                          // same scheme as the AVX-512 version
  x = _mm256_max_ps(_mm256_min_ps(x, set1(88.0f)), set1(-87.3f));
  V n = _mm256_round_ps(_mm256_mul_ps(x, set1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  V r = _mm256_fnmadd_ps(n, set1(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, set1(1.428606765330187e-06f), r);
  V p = set1(1.0f / 720);
  p = fma(p, r, set1(1.0f / 120));
  p = fma(p, r, set1(1.0f / 24));
  p = fma(p, r, set1(1.0f / 6));
  p = fma(p, r, set1(0.5f));
  p = fma(p, r, set1(1.0f));
  p = fma(p, r, set1(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));   // n in [-126, 127]: a normal 2^n
}

#else
// ----------------------------------------------------------------------------------- scalar
// One lane: the same kernel, every "vector" a float. Correct anywhere g++ runs; slow.
constexpr const char* kIsaName = "scalar";
constexpr int W = 1;
using V = float;
using Mask = bool;

inline Mask first_lanes(int n) { return n > 0; }
inline V zero() { return 0.0f; }
inline V set1(float x) { return x; }
template <typename T>
inline V load(const T* p, Mask) { return to_float(*p); }
inline void store(float* p, V v, Mask) { *p = v; }
inline V fma(V a, V b, V c) { return std::fma(a, b, c); }
inline V mul(V a, V b) { return a * b; }
inline V add(V a, V b) { return a + b; }
inline V max(V a, V b) { return a > b ? a : b; }
inline V select(Mask m, V if_set, V if_clear) { return m ? if_set : if_clear; }
inline V sub(V a, V b) { return a - b; }
inline V div(V a, V b) { return a / b; }
inline V neg(V a) { return -a; }
inline void store(bf16* p, V v) { from_float(v, p); }
inline void store(fp16* p, V v) { from_float(v, p); }
template <typename T>
inline V rounded_to(V v, T) { T t; from_float(v, &t); return to_float(t); }
inline float reduce_add(V v) { return v; }
inline float reduce_max(V v) { return v; }
inline V reduce_lanes(const V* acc) { return acc[0]; }
inline V exp(V x) { return std::exp(x); }
#endif

// Every instruction set: whole vectors in and out (W lanes; callers finish a row's tail lane by
// lane with to_float / from_float), and `rounded<T>`: each lane rounded to T's precision and
// back, where a torch op would store a T (fp32 lanes are already exact).
template <typename T>
inline V load_all(const T* p) { return load(p, first_lanes(W)); }
inline void store(float* p, V v) { store(p, v, first_lanes(W)); }
inline V rounded_to(V v, float) { return v; }
template <typename T>
inline V rounded(V v) { return rounded_to(v, T{}); }

}  // namespace vfs_cpu
