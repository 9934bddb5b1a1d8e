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

// Returns act(x) and writes act'(x) to *d when d is not null.
template <GluActivation A> KCPP_GLU_HD float act(float x, float* d) {
  if constexpr (A == GluActivation::Silu) {
    const float s = 1.0f / (1.0f + expf(-x));
    if (d) *d = s * (1.0f + x * (1.0f - s));
    return x * s;
  } else if constexpr (A == GluActivation::Gelu) {
    const float phi_cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752f));
    if (d) *d = phi_cdf + x * 0.39894228040143268f * expf(-0.5f * x * x);
    return x * phi_cdf;
  } else {
    constexpr float k = 0.79788456080286536f, c = 0.044715f;
    const float t = tanhf(k * (x + c * x * x * x));
    if (d) *d = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * c * x * x);
    return 0.5f * x * (1.0f + t);
  }
}

}  // namespace kcpp::liger::glu_math
