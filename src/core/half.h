// bf16 and f16 storage types with bit-exact conversions (round to nearest even, NaN kept quiet).
//
// The one implementation lives in include/kcpp/kernel/cpu.h, which kernel packages use too (they
// may not include src/); core names it here.  Host code stores 16-bit floats in these structs; CUDA
// code reinterprets the same bits as __nv_bfloat16 / __half.  Arithmetic is done in f32.
#pragma once

#include "kcpp/kernel/cpu.h"

namespace kcpp {

using bf16 = kernel::cpu::bf16;
using f16 = kernel::cpu::f16;
static_assert(sizeof(bf16) == 2 && sizeof(f16) == 2);

inline float bf16_to_f32(bf16 h) { return kernel::cpu::to_f32(h); }
inline bf16 f32_to_bf16(float f) { return kernel::cpu::from_f32<bf16>(f); }
inline float f16_to_f32(f16 h) { return kernel::cpu::to_f32(h); }
inline f16 f32_to_f16(float f) { return kernel::cpu::from_f32<f16>(f); }

}  // namespace kcpp
