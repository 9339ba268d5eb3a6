// Intel AMX (Advanced Matrix Extensions): eight tile registers of up to 16 rows x 64 bytes and a
// matrix unit that multiplies them, the two products chapter 10's kernels use:
//
//   dot_bf16<C, A, B>   C[16 x 16] fp32  += A[16 x 32] bf16  . B          (tdpbf16ps)
//   dot_u8s8<C, A, B>   C[16 x 16] int32 += A[16 x 64] uint8 . B (int8)   (tdpbusd)
//
// B is in "VNNI" order, the layout of the vector dot instructions: row r of B holds, for each of
// the 16 output columns n, the 2 (bf16) or 4 (int8) consecutive inputs k = 2r, 2r + 1 (or 4r ...
// 4r + 3) of that column, side by side -- 64 bytes per row. One tdpbf16ps is 16 x 16 x 32 = 8192
// multiply-adds; an AVX-512 FMA does 16. At a prefill's or a large batch's row counts the matrix
// unit is the difference between a CPU linear that is compute-bound and one that waits for memory.
//
// Where it runs: Sapphire Rapids and later Xeons. The kernel may use the tiles only after Linux
// granted this process the (large) tile state, which `request_permission` asks for once
// (arch_prctl ARCH_REQ_XCOMP_PERM; without it the first tile instruction is SIGILL). The tile
// configuration is per thread: every thread that multiplies calls `configure` first and `release`
// after.
//
// VFS_CPU_AMX_EMULATED (the SIMDe build, for tests on machines without AMX): the same functions in
// plain C++, one thread-local array per tile, to the instructions' definitions -- so the kernels'
// tile logic (layouts, strides, tails) is checked anywhere; the sums' order (and so the last bit of
// a bf16 product's fp32 sum) is the emulation's, the int8 sums are exact either way.
#pragma once

#include <cstdint>
#include <cstring>

#if !defined(VFS_CPU_AMX_EMULATED)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace vfs_cpu::amx {

constexpr int kRows = 16;          // rows of every tile here
constexpr int kRowBytes = 64;      // bytes per tile row: 16 fp32 / int32, 32 bf16, 64 int8

#if defined(VFS_CPU_AMX_EMULATED)

inline bool request_permission() { return true; }
struct Tile { alignas(64) uint8_t bytes[kRows][kRowBytes]; };
inline Tile* tiles() { thread_local Tile t[8]; return t; }
inline void configure() {}
inline void release() {}
template <int T> inline void zero() { std::memset(tiles()[T].bytes, 0, sizeof(Tile)); }
template <int T> inline void load(const void* p, int64_t stride) {
  for (int r = 0; r < kRows; ++r) std::memcpy(tiles()[T].bytes[r], static_cast<const char*>(p) + r * stride, kRowBytes);
}
template <int T> inline void store(void* p, int64_t stride) {
  for (int r = 0; r < kRows; ++r) std::memcpy(static_cast<char*>(p) + r * stride, tiles()[T].bytes[r], kRowBytes);
}
template <typename E> inline E element(int t, int r, int i) {
  E e;
  std::memcpy(&e, tiles()[t].bytes[r] + i * sizeof(E), sizeof(E));
  return e;
}
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
template <int C, int A, int B> inline void dot_bf16() {
  for (int m = 0; m < kRows; ++m)
    for (int n = 0; n < 16; ++n) {
      float c = element<float>(C, m, n);
      for (int r = 0; r < kRows; ++r)                      // input pair r: k = 2r, 2r + 1
        for (int i = 0; i < 2; ++i)
          c += bf16_to_float(element<uint16_t>(A, m, 2 * r + i)) * bf16_to_float(element<uint16_t>(B, r, 2 * n + i));
      std::memcpy(tiles()[C].bytes[m] + 4 * n, &c, 4);
    }
}
template <int C, int A, int B> inline void dot_u8s8() {
  for (int m = 0; m < kRows; ++m)
    for (int n = 0; n < 16; ++n) {
      int32_t c = element<int32_t>(C, m, n);
      for (int r = 0; r < kRows; ++r)                      // input quad r: k = 4r ... 4r + 3
        for (int i = 0; i < 4; ++i)
          c += int32_t(element<uint8_t>(A, m, 4 * r + i)) * int32_t(element<int8_t>(B, r, 4 * n + i));
      std::memcpy(tiles()[C].bytes[m] + 4 * n, &c, 4);
    }
}

#else

// Once per process: Linux hands out the tile state (8 KB per thread) only on request.
inline bool request_permission() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}
// Palette 1, every tile 16 rows x 64 bytes (the layout of ldtilecfg's 64-byte operand).
struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
inline void configure() {
  Config config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = kRowBytes, config.rows[t] = kRows;
  _tile_loadconfig(&config);
}
inline void release() { _tile_release(); }
// The instructions themselves. (GCC's _tile_* macros paste their tile number into the assembly as
// written, so they take a literal, not a template argument; %c prints the constant bare.)
template <int T> inline void zero() { asm volatile("tilezero %%tmm%c0" ::"i"(T)); }
template <int T> inline void load(const void* p, int64_t stride) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T) : "memory");
}
template <int T> inline void store(void* p, int64_t stride) {
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(T) : "memory");
}
template <int C, int A, int B> inline void dot_bf16() {
  asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}
template <int C, int A, int B> inline void dot_u8s8() {
  asm volatile("tdpbusd %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}

#endif

}  // namespace vfs_cpu::amx
