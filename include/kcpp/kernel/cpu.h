// Host helpers for kernel packages: 16-bit storage types with round-to-nearest-even conversion,
// and row loads / stores that widen to f32 (loops the compiler vectorizes).
#pragma once

#include <bit>
#include <cstdint>

#include "kcpp/kernel/types.h"

// A hot CPU function built twice, for baseline x86-64 and for AVX2, the loader choosing by the CPU it
// runs on (GCC's target_clones): one package binary, 8-wide float loops where the machine allows.
// Elsewhere (not x86-64, or clang, which takes no target_clones on function templates: the fuzz
// build) the plain build.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KCPP_CPU_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define KCPP_CPU_MULTIVERSION
#endif

namespace kcpp::kernel::cpu {

struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

inline float to_f32(float v) { return v; }
inline float to_f32(bf16 v) { return std::bit_cast<float>(static_cast<uint32_t>(v.bits) << 16); }
inline float to_f32(f16 h) {
  // IEEE half -> float, including subnormals, inf and NaN.
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t exp = (h.bits >> 10) & 0x1fu, man = h.bits & 0x3ffu;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (man << 13));
  if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112) << 23) | (man << 13));
  const float mag = static_cast<float>(man) * 0x1p-24f;  // subnormal or zero, exact
  return sign ? -mag : mag;
}

template <typename T> inline T from_f32(float v);
template <> inline float from_f32<float>(float v) { return v; }
template <> inline bf16 from_f32<bf16>(float v) {
  uint32_t u = std::bit_cast<uint32_t>(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}
template <> inline f16 from_f32<f16>(float v) {
  const uint32_t u = std::bit_cast<uint32_t>(v);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return f16{static_cast<uint16_t>(sign | 0x7e00u)};
  if (a >= 0x477ff000u) return f16{static_cast<uint16_t>(sign | 0x7c00u)};
  if (a >= 0x38800000u) {
    uint32_t r = a - 0x38000000u;
    r += 0xfffu + ((r >> 13) & 1u);
    return f16{static_cast<uint16_t>(sign | (r >> 13))};
  }
  // Subnormal: scale so one unit is 2^-24 and let the FPU round to nearest even.
  const float scaled = std::bit_cast<float>(a) * 0x1p24f;  // exact (power of two), < 1024
  const float rounded = (scaled + 0x1p23f) - 0x1p23f;      // round to an integer, ties to even
  return f16{static_cast<uint16_t>(sign | static_cast<uint16_t>(rounded))};
}

template <typename T> inline float round_to(float v) { return to_f32(from_f32<T>(v)); }

template <typename T> inline void load_row(const T* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f32(src[i]);
}
template <typename T> inline void store_row(const float* src, int64_t n, T* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_f32<T>(src[i]);
}

// Calls f(static_cast<T*>(nullptr)) with T the host storage type of a float dtype (f32, bf16,
// f16); false, and f not called, for any other dtype.
template <typename F> inline bool visit_float(DType t, F&& f) {
  switch (t) {
    case DType::f32: f(static_cast<float*>(nullptr)); return true;
    case DType::bf16: f(static_cast<bf16*>(nullptr)); return true;
    case DType::f16: f(static_cast<f16*>(nullptr)); return true;
    default: return false;
  }
}

}  // namespace kcpp::kernel::cpu
