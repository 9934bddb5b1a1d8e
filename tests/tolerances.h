// Tolerances, per dtype, as code (docs/DESIGN.md "Numerics and testing").  Two kinds:
//
//  - primitive_rtol: an op that computes in f32 (f64 for f64) and rounds once to its dtype is off by
//    at most half an ulp of the dtype plus the f32 function error; we allow two units of roundoff
//    elementwise (relative), plus an absolute floor of the same size times the data's scale.
//  - composite_rel_l2: a composition of eager ops rounds several intermediates to the dtype; its
//    relative L2 error against the f64 oracle must stay within a few units of roundoff.  A wrong
//    formula shows up as an O(1) error, and subtle ones (a wrong divisor, a missing eps) are caught by
//    the f64 and f32 runs, whose bounds are tight.
#pragma once

#include <algorithm>

#include "core/dtype.h"

namespace kcpp::test {

// Unit roundoff u = 2^-p of each dtype (half an ulp of 1).
inline double unit_roundoff(DType t) {
  switch (t) {
    case DType::f64: return 0x1p-53;
    case DType::f32: return 0x1p-24;
    case DType::bf16: return 0x1p-8;
    case DType::f16: return 0x1p-11;
    default: return 0.0;
  }
}

inline double primitive_rtol(DType t) {
  switch (t) {
    case DType::f64: return 1e-13;   // libm's double functions are within an ulp or two
    case DType::f32: return 1e-6;    // ~8 ulps of float: covers expf / erff / tanhf error
    default: return 2 * unit_roundoff(t);
  }
}

inline double composite_rel_l2(DType t) {
  switch (t) {
    case DType::f64: return 1e-11;
    case DType::f32: return 2e-5;
    case DType::bf16: return 2e-2;   // ~5 u: a handful of roundings of intermediates
    case DType::f16: return 3e-3;    // ~6 u
    default: return 0.0;
  }
}

// docs/DESIGN.md's bound for a kernel: its error against the f64 oracle is at most twice the error of the
// reference (eager) implementation run in the same precision.  Where the reference is nearly exact
// (f32 rows of a few elements), rounding noise decides: kernels compute in f32 whatever the storage
// dtype, so the floor is one rounding to the dtype plus a few f32 roundings (4 units of f32).
inline double kernel_bound(double reference_error, DType t) {
  return std::max(2.0 * reference_error, unit_roundoff(t) + 4 * unit_roundoff(DType::f32));
}

}  // namespace kcpp::test
