// Activation functions and their derivatives, for host and device code of kernel packages.
//
//   silu(x)       = x s(x),  s = sigmoid = 1 / (1 + e^-x)      silu'(x) = s (1 + x (1 - s))
//   gelu(x)       = x Phi(x) = x (1 + erf(x / sqrt 2)) / 2       gelu'(x) = Phi(x) + x phi(x),
//                                                               phi(x) = e^(-x^2 / 2) / sqrt(2 pi)
//   gelu_tanh(x)  = x (1 + t) / 2,  t = tanh(u),  u = sqrt(2/pi) (x + 0.044715 x^3)
//                   gelu_tanh'(x) = (1 + t) / 2 + x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2) / 2
//                   (PyTorch's gelu(approximate="tanh"); Transformers' GeluTanh, NewGELU and FastGELU
//                   are this same function written in different orders)
//   quick_gelu(x) = x s(1.702 x)                                quick_gelu'(x) = s (1 + 1.702 x (1 - s))
//
// Precision, by MathMode:
//   Accurate: the C library's expf / erff / tanhf (on the device CUDA's, within 2 ulps).
//   FastExp:  as Accurate, but on the host e^x, tanh and GELU's Phi are exp_f32(), tanh_f32() and
//             normal_cdf_f32() below, within 1, 3 and 6 ulps, which the compiler vectorizes where the
//             library functions stay scalar calls.  (Device: = Accurate.)
//   Fast:     trades f32 accuracy (a few ulps; GELU's Phi on the device 1.1e-6 absolute) - far below one
//             rounding to bf16 or f16 - for speed: on the device the hardware __expf and __fdividef, on
//             the host exp_f32; tanh becomes 1 - 2 / (1 + e^2u), whose cancellation near 0 costs
//             absolute, not relative, accuracy.  For 16-bit outputs.
// GELU's Phi(x) = (1 + erf(x / sqrt 2)) / 2: Accurate and the device's FastExp use erff; the host's
// FastExp and Fast modes normal_cdf_f32() below (within 6 ulps of Phi, vectorizable, no cancellation for
// x < 0); the device's Fast mode normal_cdf_fast() (1.1e-6 absolute, 40% fewer instructions than erff).
// NaN propagates through every function (and every derivative) as it does through the formulas.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kcpp/kernel/fast_math.h"

namespace kcpp::kernel {

enum class Activation : int32_t { Silu = 0, Gelu = 1, GeluTanh = 2, QuickGelu = 3 };

// "silu", "gelu", "gelu_tanh", "quick_gelu"; the spelling contracts use.
inline const char* activation_name(Activation a) {
  switch (a) {
    case Activation::Silu: return "silu";
    case Activation::Gelu: return "gelu";
    case Activation::GeluTanh: return "gelu_tanh";
    case Activation::QuickGelu: return "quick_gelu";
  }
  return "?";
}

// Parses a contract's activation string; false if unknown.  "gelu_pytorch_tanh", "gelu_new" and
// "gelu_fast" (Transformers' hidden_act names for the tanh form) are accepted as gelu_tanh.
inline bool parse_activation(const char* s, Activation* out) {
  struct Name {
    const char* name;
    Activation a;
  };
  static constexpr Name kNames[] = {{"silu", Activation::Silu},          {"swish", Activation::Silu},
                                    {"gelu", Activation::Gelu},          {"gelu_tanh", Activation::GeluTanh},
                                    {"gelu_pytorch_tanh", Activation::GeluTanh}, {"gelu_new", Activation::GeluTanh},
                                    {"gelu_fast", Activation::GeluTanh}, {"quick_gelu", Activation::QuickGelu}};
  for (const Name& n : kNames)
    if (s && std::strcmp(s, n.name) == 0) return *out = n.a, true;
  return false;
}

enum class MathMode { Accurate, FastExp, Fast };

// e^x in f32 without branches or library calls, so loops over it vectorize (host Fast mode).
// x = k ln2 + r with |r| <= ln2 / 2 (Cody-Waite: ln2 in two parts, so r is exact to f32), e^r by its
// degree-7 Taylor polynomial (truncation < 6e-9 relative), and 2^k applied as two exact powers of two so
// that overflow gives inf and underflow goes through the subnormals to 0 as expf does.  Measured
// against expf: within 1 ulp where the result is normal (tests/test_kernel_helpers.cpp holds [-103, 88.7] to 2).
KCPP_KERNEL_INLINE float exp_f32(float x) {
  constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693145751953125f, kLn2Lo = 1.42860682030941723e-6f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer (ties to even)
  // Comparisons written so that NaN passes through unchanged (x < lo is false for NaN).
  x = x < -104.0f ? -104.0f : x;
  x = x > 89.0f ? 89.0f : x;
  const float kf = (x * kLog2e + kRound) - kRound;  // round(x / ln2), |kf| <= 150
  const float r = (x - kf * kLn2Hi) - kf * kLn2Lo;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t k = static_cast<int32_t>(kf);  // NaN: any k; p is NaN already
  const int32_t k1 = k / 2, k2 = k - k1;      // each in [-75, 75]: a normal power of two
  const int32_t b1 = (k1 + 127) << 23, b2 = (k2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, 4);
  std::memcpy(&s2, &b2, 4);
  return p * s1 * s2;
}

// tanh(u) in f32 without branches or library calls (host FastExp mode).  |u| < 0.4: the odd Taylor
// series to u^15 (the first omitted term is below 2e-9 there); beyond: sign(u) (1 - 2 / (1 + e^2|u|))
// with exp_f32, where t >= 0.38 keeps the cancellation to a factor of 2.6.  Within 3 ulps of tanhf
// (tests/test_kernel_helpers.cpp).
KCPP_KERNEL_INLINE float tanh_f32(float u) {
  const float a = u < 0.0f ? -u : u;  // NaN: stays NaN through both forms
  const float a2 = a * a;
  float p = -929569.0f / 638512875.0f;
  p = p * a2 + 21844.0f / 6081075.0f;
  p = p * a2 - 1382.0f / 155925.0f;
  p = p * a2 + 62.0f / 2835.0f;
  p = p * a2 - 17.0f / 315.0f;
  p = p * a2 + 2.0f / 15.0f;
  p = p * a2 - 1.0f / 3.0f;
  const float small = a + a * a2 * p;
  const float large = 1.0f - 2.0f / (1.0f + exp_f32(2.0f * a));
  const float t = a < 0.4f ? small : large;
  return u < 0.0f ? -t : t;
}

// The standard normal distribution function Phi(x) = P(X <= x), X ~ N(0, 1), in f32 without branches
// or library calls (host FastExp and Fast modes: GELU's x Phi(x), which erff would keep scalar).  Also
// writes e = exp(-x^2 / 2), the density's exponential, which GELU's derivative needs.
//   |x| < 1:   Phi = 1/2 + x P(x^2), P of degree 5.
//   |x| >= 1:  the tail Q(z) = Phi(-z), z = |x|, as e S(z), where S = Q e^(z^2 / 2) is Mills' ratio over
//              sqrt(2 pi), smooth and ~ 1 / (z sqrt(2 pi)) far out, written as t T(t) with t = 1 / (1 + z / 2)
//              and T of degree 7 (the form of Hastings' approximation, Abramowitz & Stegun 26.2.17).
//              Phi = Q for x < 0 and 1 - Q otherwise, so the lower tail keeps its relative accuracy
//              where 1 + erf(x / sqrt 2) cancels.
// P and T were fitted here (Lawson's iteratively weighted least squares on the relative error, against
// mpmath's ncdf).  e is exp(-h^2 / 2) exp(-(z - h)(z + h) / 2), h = z cut to its top 12 significant
// bits, the second factor a polynomial (its exponent is small): h^2 is exact, so the exponent carries
// no rounding error of z^2 (which at z = 12 alone would cost about 60 ulps of the tail).  Measured:
// within 6 ulps of Phi, 1 ulp for x > 0 (tests/test_kernel_helpers.cpp); NaN in, NaN out;
// Phi(-inf) = 0, Phi(inf) = 1.
KCPP_KERNEL_INLINE float normal_cdf_f32(float x, float* e_out) {
  const float a = x < 0.0f ? -x : x;       // NaN stays NaN through every comparison below
  const float z = a > 16.0f ? 16.0f : a;   // past 16 the tail is 0 in f32 (and inf - inf would be NaN)
  uint32_t bits;
  std::memcpy(&bits, &z, 4);
  bits &= 0xFFFFF000u;
  float h;
  std::memcpy(&h, &bits, 4);
  // e = e^(-h^2 / 2) e^w, w = -(z - h)(z + h) / 2 in [-1/8, 0] (z - h < 2^-11 z): e^w by its degree-5
  // Taylor polynomial (truncation below 6e-9 relative).
  const float w = -0.5f * ((z - h) * (z + h));
  const float ew = 1.0f + w * (1.0f + w * (0.5f + w * (1.0f / 6.0f + w * (1.0f / 24.0f + w * (1.0f / 120.0f)))));
  const float e = exp_f32(-0.5f * (h * h)) * ew;
  const float u = x * x;
  float p = -7.65423829e-06f;
  p = p * u + 0.000113486458f;
  p = p * u - 0.00118632999f;
  p = p * u + 0.0099733239f;
  p = p * u - 0.0664903596f;
  p = p * u + 0.398942292f;
  const float small = 0.5f + x * p;
  const float t = 1.0f / (1.0f + 0.5f * z);
  float s = -0.127560005f;
  s = s * t + 0.37360546f;
  s = s * t - 0.340606838f;
  s = s * t + 0.0054509975f;
  s = s * t + 0.0387384668f;
  s = s * t + 0.150517061f;
  s = s * t + 0.199448571f;
  s = s * t + 0.199470416f;
  const float q = e * (t * s);
  const float tail = x < 0.0f ? q : 1.0f - q;
  if (e_out) *e_out = e;
  return a < 1.0f ? small : tail;
}

// Phi(x) for the device's Fast mode (16-bit outputs), in 16 instructions where erff takes about 27 (its
// polynomial's coefficients are selected per range, one select each): the tail Q(z) = Phi(-z), z = |x|,
// as 2^(R(s) - z^2 / (2 ln 2)), s = 2 z / 13.2 - 1, R of degree 10 in s (fitted here on [0, 13.2] to
// log2 Q(z) + z^2 / (2 ln 2) by Lawson's weighted least squares against mpmath; s in [-1, 1] keeps the
// f32 Horner sum well conditioned), then Phi = Q for x < 0 and 1 - Q otherwise.  Error (host, exp2f;
// tests/test_kernel_helpers.cpp): 1.1e-6 absolute, 5.2e-5 relative in the lower tail down to the f32
// underflow - far below one rounding to bf16 (2^-9) or f16 (2^-12).  Past z = 13.2 the exponent stays
// below -130 (checked to 1e6; at inf it is -inf), so Q is flushed to 0 without a clamp.  NaN in, NaN out.
KCPP_KERNEL_INLINE float normal_cdf_fast(float x) {
  const float z = std::fabs(x);
  const float s = z * (2.0f / 13.2f) - 1.0f;
  float r = -0.00927551184f;
  r = r * s - 0.0514620543f;
  r = r * s + 0.119144849f;
  r = r * s - 0.0472467355f;
  r = r * s + 0.0410785489f;
  r = r * s - 0.171189412f;
  r = r * s + 0.265883803f;
  r = r * s - 0.37519443f;
  r = r * s + 0.634509861f;
  r = r * s - 1.38312817f;
  r = r * s - 4.0795598f;
  const float q = exp2_approx(r - 0.72134752f * z * z);  // 1 / (2 ln 2)
  return x < 0.0f ? q : 1.0f - q;
}

template <MathMode M> KCPP_KERNEL_INLINE float exp_(float x) {
#if defined(__CUDA_ARCH__)
  if constexpr (M == MathMode::Fast) return __expf(x);
#else
  if constexpr (M != MathMode::Accurate) return exp_f32(x);
#endif
  return expf(x);
}
template <MathMode M> KCPP_KERNEL_INLINE float div_(float a, float b) {
#if defined(__CUDA_ARCH__)
  if constexpr (M == MathMode::Fast) return __fdividef(a, b);
#endif
  return a / b;
}
// tanh(u); Fast: 1 - 2 / (1 + e^2u), exact in the limits (e^2u = inf gives 1, 0 gives -1).
template <MathMode M> KCPP_KERNEL_INLINE float tanh_(float u) {
  if constexpr (M == MathMode::Fast) return 1.0f - div_<M>(2.0f, 1.0f + exp_<M>(2.0f * u));
#if !defined(__CUDA_ARCH__)
  if constexpr (M == MathMode::FastExp) return tanh_f32(u);
#endif
  return tanhf(u);
}

// Returns act(x) and writes act'(x) to *d when d is not null.
template <Activation A, MathMode M = MathMode::Accurate> KCPP_KERNEL_INLINE float activate(float x, float* d) {
  if constexpr (A == Activation::Silu || A == Activation::QuickGelu) {
    constexpr float a = A == Activation::Silu ? 1.0f : 1.702f;
    const float s = div_<M>(1.0f, 1.0f + exp_<M>(-a * x));
    if (d) *d = s * (1.0f + a * x * (1.0f - s));
    return x * s;
  } else if constexpr (A == Activation::Gelu) {
#if defined(__CUDA_ARCH__)
    if constexpr (M == MathMode::Fast) {
      const float cdf = normal_cdf_fast(x);
      if (d) *d = cdf + x * 0.39894228040143268f * exp_<M>(-0.5f * x * x);
      return x * cdf;
    }
#else
    if constexpr (M != MathMode::Accurate) {
      float e;
      const float cdf = normal_cdf_f32(x, &e);
      if (d) *d = cdf + x * 0.39894228040143268f * e;
      return x * cdf;
    }
#endif
    const float cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752f));
    if (d) *d = cdf + x * 0.39894228040143268f * exp_<M>(-0.5f * x * x);
    return x * cdf;
  } else {
    constexpr float k = 0.79788456080286536f, c = 0.044715f;
    const float t = tanh_<M>(k * (x + c * x * x * x));
    if (d) *d = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * c * x * x);
    return 0.5f * x * (1.0f + t);
  }
}

}  // namespace kcpp::kernel
