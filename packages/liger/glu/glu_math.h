// The activation and its derivative, shared by the CPU and CUDA code of glu (maths in glu.h).
#pragma once

#include <cmath>

#include "glu.h"

#if defined(__CUDACC__)
#define KCPP_GLU_HD __host__ __device__ __forceinline__
#else
#define KCPP_GLU_HD inline
#endif

namespace kcpp::liger::glu_math {

// exp and division: the accurate ones, or (FAST, CUDA only) the hardware approximations, whose
// error (a few f32 ulps) is far below one rounding to bf16/f16; only used for 16-bit outputs.
template <bool FAST> KCPP_GLU_HD float exp_(float x) {
#if defined(__CUDA_ARCH__)
  if constexpr (FAST) return __expf(x);
#endif
  return expf(x);
}
template <bool FAST> KCPP_GLU_HD float div_(float a, float b) {
#if defined(__CUDA_ARCH__)
  if constexpr (FAST) return __fdividef(a, b);
#endif
  return a / b;
}

// Returns act(x) and writes act'(x) to *d when d is not null.
template <GluActivation A, bool FAST = false> KCPP_GLU_HD float act(float x, float* d) {
  if constexpr (A == GluActivation::Silu) {
    const float s = div_<FAST>(1.0f, 1.0f + exp_<FAST>(-x));
    if (d) *d = s * (1.0f + x * (1.0f - s));
    return x * s;
  } else if constexpr (A == GluActivation::Gelu) {
    const float phi_cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752f));
    if (d) *d = phi_cdf + x * 0.39894228040143268f * exp_<FAST>(-0.5f * x * x);
    return x * phi_cdf;
  } else {
    constexpr float k = 0.79788456080286536f, c = 0.044715f;
    const float t = tanhf(k * (x + c * x * x * x));
    if (d) *d = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * c * x * x);
    return 0.5f * x * (1.0f + t);
  }
}

}  // namespace kcpp::liger::glu_math
