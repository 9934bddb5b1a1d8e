// bf16 and f16 storage types with bit-exact conversions (round to nearest even, NaN kept quiet).
//
// Host code stores 16-bit floats in these structs; CUDA code reinterprets the same bits as
// __nv_bfloat16 / __half.  Arithmetic is always done in f32 (as PyTorch does on the CPU).
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>

namespace kcpp {

struct bf16 {
  uint16_t bits = 0;
};
struct f16 {
  uint16_t bits = 0;
};
static_assert(sizeof(bf16) == 2 && sizeof(f16) == 2);

inline float bf16_to_f32(bf16 h) { return std::bit_cast<float>(static_cast<uint32_t>(h.bits) << 16); }

inline bf16 f32_to_bf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x0040u)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return bf16{static_cast<uint16_t>(u >> 16)};
}

inline float f16_to_f32(f16 h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  uint32_t exp = (h.bits >> 10) & 0x1fu;
  uint32_t man = h.bits & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);  // inf / NaN
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);  // normal: rebias 15 -> 127
  } else if (man == 0) {
    u = sign;  // signed zero
  } else {     // subnormal: value = man * 2^-24, normalise it
    int shift = std::countl_zero(man) - 21;  // leading zeros within the 10-bit field
    man = (man << shift) & 0x3ffu;
    u = sign | static_cast<uint32_t>(113 - shift) << 23 | (man << 13);
  }
  return std::bit_cast<float>(u);
}

inline f16 f32_to_f16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return f16{static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu))};  // NaN
  if (a >= 0x477ff000u) return f16{static_cast<uint16_t>(sign | 0x7c00u)};  // rounds to >= 65520: inf
  if (a >= 0x38800000u) {  // normal f16 range (>= 2^-14)
    uint32_t v = a - 0x38000000u;  // rebias exponent 127 -> 15
    v += 0xfffu + ((v >> 13) & 1u);
    return f16{static_cast<uint16_t>(sign | (v >> 13))};
  }
  if (a < 0x33000000u) return f16{sign};  // below half the smallest subnormal (2^-25): zero
  // Subnormal result: shift the full mantissa so that one unit is 2^-24, rounding to nearest even.
  const uint32_t exp = a >> 23;
  const uint32_t man = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126 - exp;  // value = man * 2^(exp-150); one f16 unit = 2^-24; 14 <= shift <= 24
  uint32_t q = man >> shift;
  const uint32_t rem = man & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return f16{static_cast<uint16_t>(sign | q)};
}

}  // namespace kcpp
