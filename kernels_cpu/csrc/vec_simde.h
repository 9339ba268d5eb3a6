// The AVX-512 variant of the vector header on a CPU without AVX-512, for tests: SIMDe
// (kernels_cpu/simde.py says why and where the headers come from) implements each
// _mm512_* intrinsic in portable code, to Intel's specification, so the AVX-512 branch of
// vec.h compiles unchanged and computes what it would on an AVX-512 CPU.
// Included by vec.h when built with -DVFS_CPU_SIMDE_AVX512 (kernels_cpu/build.py's
// "avx512_simde" variant, built with the AVX2 flags, which SIMDe uses underneath).
#pragma once

#include <cstdint>
#include <cstring>

// Native names (_mm512_add_ps, __m512, __mmask16, ...) as aliases of SIMDe's, for every
// instruction set the compiler flags do not enable.
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>

// Five gaps in SIMDe 0.8.2, filled here to Intel's specification:
//
// 1. Masked loads and stores. AVX-512 reads and writes only the lanes whose mask bit is set
//    (and never faults on the others); the kernels rely on it at a row's vector tail, where
//    the next lanes are another head's data or past the end of the tensor. SIMDe 0.8.2 reads
//    all 16 lanes, and its masked store writes ZEROS into the clear ones
//    (simd-everywhere/simde#1204, fixed after 0.8.2 by #1331): with it, head_dim 72 came out
//    with the next head's first 8 dims zeroed. These do it lane by lane.
inline simde__m512 vfs_simde_maskz_loadu_ps(simde__mmask16 k, const void* p) {
  float lanes[16] = {};
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) std::memcpy(&lanes[i], static_cast<const char*>(p) + 4 * i, 4);
  return simde_mm512_loadu_ps(lanes);
}
inline simde__m256i vfs_simde_maskz_loadu_epi16(simde__mmask16 k, const void* p) {
  uint16_t lanes[16] = {};
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) std::memcpy(&lanes[i], static_cast<const char*>(p) + 2 * i, 2);
  return simde_mm256_loadu_si256(lanes);
}
inline void vfs_simde_mask_storeu_ps(void* p, simde__mmask16 k, simde__m512 a) {
  float lanes[16];
  simde_mm512_storeu_ps(lanes, a);
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) std::memcpy(static_cast<char*>(p) + 4 * i, &lanes[i], 4);
}
#undef _mm512_maskz_loadu_ps
#undef _mm256_maskz_loadu_epi16
#undef _mm512_mask_storeu_ps
#define _mm512_maskz_loadu_ps(k, p) vfs_simde_maskz_loadu_ps(k, p)
#define _mm256_maskz_loadu_epi16(k, p) vfs_simde_maskz_loadu_epi16(k, p)
#define _mm512_mask_storeu_ps(p, k, a) vfs_simde_mask_storeu_ps(p, k, a)

// 2. No _mm512_reduce_add_ps. The same tree as GCC's: halves, then quarters, ...
inline float vfs_simde_reduce_add_ps(simde__m512 v) {
  simde__m256 s8 = simde_mm256_add_ps(simde_mm512_castps512_ps256(v), simde_mm512_extractf32x8_ps(v, 1));
  simde__m128 s4 = simde_mm_add_ps(simde_mm256_castps256_ps128(s8), simde_mm256_extractf128_ps(s8, 1));
  s4 = simde_mm_add_ps(s4, simde_mm_movehl_ps(s4, s4));
  s4 = simde_mm_add_ss(s4, simde_mm_movehdup_ps(s4));
  return simde_mm_cvtss_f32(s4);
}
#define _mm512_reduce_add_ps(v) vfs_simde_reduce_add_ps(v)

// 3. No _mm512_cvtepi32_epi8 (vpmovdb) nor _mm512_cvtepi32_epi16 (vpmovdw): the low byte / the
//    low 16 bits of each of the 16 int32 lanes, truncated, packed into 16 bytes / 32 bytes.
//    quant_gemm.cpp's per-token int8 quantization stores its bytes with the first, vec.h's bf16
//    vector store its halves with the second.
template <typename Lane, typename Packed>
inline Packed vfs_simde_narrow_lanes(simde__m512i a) {
  int32_t lanes[16];
  simde_mm512_storeu_si512(lanes, a);
  Lane narrow[16];
  for (int i = 0; i < 16; ++i) narrow[i] = Lane(uint32_t(lanes[i]));
  Packed packed;
  static_assert(sizeof(packed) == sizeof(narrow), "16 lanes fill the packed vector");
  std::memcpy(&packed, narrow, sizeof(narrow));
  return packed;
}
#define _mm512_cvtepi32_epi8(a) vfs_simde_narrow_lanes<uint8_t, simde__m128i>(a)
#define _mm512_cvtepi32_epi16(a) vfs_simde_narrow_lanes<uint16_t, simde__m256i>(a)

// 4. No _mm512_cvtps_ph (16 fp32 lanes to fp16, rounded as `rounding` says): vec.h's fp16 vector
//    store. 8 lanes at a time with F16C, which the SIMDe build's AVX2 flags enable.
#define _mm512_cvtps_ph(a, rounding)                                                              \
  simde_mm256_set_m128i(simde_mm256_cvtps_ph(simde_mm512_extractf32x8_ps(a, 1), (rounding)),      \
                        simde_mm256_cvtps_ph(simde_mm512_castps512_ps256(a), (rounding)))

// 5. No _mm512_cvtepi32_pd (8 int32 -> 8 doubles, exact) nor _mm512_cvtpd_ps (8 doubles -> 8 fp32,
//    rounded to nearest); quant_gemm.cpp's W8A8 scaling runs in them. Four lanes at a time with
//    AVX's, which the SIMDe build's flags enable.
#define _mm512_cvtepi32_pd(a)                                                                            \
  simde_mm512_insertf64x4(simde_mm512_castpd256_pd512(simde_mm256_cvtepi32_pd(simde_mm256_castsi256_si128(a))), \
                          simde_mm256_cvtepi32_pd(simde_mm256_extracti128_si256(a, 1)), 1)
#define _mm512_cvtpd_ps(a)                                                                               \
  simde_mm256_set_m128(simde_mm256_cvtpd_ps(simde_mm512_extractf64x4_pd(a, 1)),                          \
                       simde_mm256_cvtpd_ps(simde_mm512_castpd512_pd256(a)))
