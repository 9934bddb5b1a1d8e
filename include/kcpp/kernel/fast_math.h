// Hardware-approximate math shared by the kernel packages' host and device code.
#pragma once

#include <cmath>

// Always inlined: on the host a call left in a loop (GCC's inliner gives up on the larger
// instantiations) keeps the whole loop scalar.
#if defined(__CUDACC__)
#define KCPP_KERNEL_INLINE __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define KCPP_KERNEL_INLINE inline __attribute__((always_inline))
#else
#define KCPP_KERNEL_INLINE inline
#endif

namespace kcpp::kernel {

// 2^x: on the device the special-function unit's ex2.approx.ftz, one instruction (relative error
// about 2^-22; results below 2^-126 flushed to 0; 2^-inf = 0); on the host exp2f (for tests of the
// functions built on it).
KCPP_KERNEL_INLINE float exp2_approx(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::exp2(x);
#endif
}

// 1 / x: on the device rcp.approx.ftz (within one unit in the last place; subnormals flushed to 0); on
// the host the division.
KCPP_KERNEL_INLINE float rcp_approx(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return 1.0f / x;
#endif
}

// tanh x = 1 - 2 / (e^(2x) + 1) from exp2_approx and rcp_approx (two special-function instructions on
// the device).  Its error is absolute, about 2^-21 over the whole line: 2^x's relative 2^-22 and the
// reciprocal's ulp, each scaled by at most 2 / (e^(2x) + 1)^2 <= 1/2 or by the reciprocal's value.  It is
// exactly +-1 once e^(2x) overflows or flushes to 0 (|x| beyond about 44), and tanh(+-inf) = +-1.
// (tanh.approx.f32, one instruction, is accurate only to a relative 2^-11.)
KCPP_KERNEL_INLINE float tanh_approx(float x) {
  return 1.0f - 2.0f * rcp_approx(exp2_approx(2.8853900817779268f * x) + 1.0f);
}

}  // namespace kcpp::kernel
