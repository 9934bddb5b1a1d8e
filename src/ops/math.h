// The scalar maths of the elementwise ops, shared by the host loops and the CUDA kernels so that
// both compute the same function.  T is float (for f32/bf16/f16) or double (for f64).
#pragma once

#include <cmath>

#include "core/strided.h"  // KCPP_HD
#include "ops/ops.h"

namespace kcpp::ops::math {

template <typename T> KCPP_HD T sigmoid(T x) { return T(1) / (T(1) + std::exp(-x)); }

template <typename T> KCPP_HD T unary(Unary op, T x, T alpha) {
  constexpr T kSqrt2OverPi = T(0.7978845608028654), kInvSqrt2 = T(0.7071067811865476), kC = T(0.044715);
  switch (op) {
    case Unary::Neg: return -x;
    case Unary::Exp: return std::exp(x);
    case Unary::Log: return std::log(x);
    case Unary::Sqrt: return std::sqrt(x);
    case Unary::Rsqrt: return T(1) / std::sqrt(x);
    case Unary::Square: return x * x;
    case Unary::Abs: return std::fabs(x);
    case Unary::Recip: return T(1) / x;
    case Unary::Sin: return std::sin(x);
    case Unary::Cos: return std::cos(x);
    case Unary::Tanh: return std::tanh(x);
    case Unary::Sigmoid: return sigmoid(x);
    case Unary::Silu: return x * sigmoid(x);
    case Unary::Gelu: return T(0.5) * x * (T(1) + std::erf(x * kInvSqrt2));
    case Unary::GeluTanh: return T(0.5) * x * (T(1) + std::tanh(kSqrt2OverPi * (x + kC * x * x * x)));
    case Unary::Scale: return alpha * x;
    case Unary::AddScalar: return x + alpha;
  }
  return x;
}

// A gated activation chosen at run time (Silu, Gelu, GeluTanh; NaN for any other op), each case unary()
// with its op a constant.  A kernel that inlines unary()'s whole switch for a runtime op gets a stack
// frame and a body too large for the instruction cache (bench/RESULTS.md, 2026-11-27 and -28).
template <typename T> KCPP_HD T gated(Unary op, T x) {
  switch (op) {
    case Unary::Silu: return unary(Unary::Silu, x, T(0));
    case Unary::Gelu: return unary(Unary::Gelu, x, T(0));
    case Unary::GeluTanh: return unary(Unary::GeluTanh, x, T(0));
    default: return T(NAN);
  }
}

template <typename T> KCPP_HD T binary(Binary op, T a, T b) {
  constexpr T kSqrt2OverPi = T(0.7978845608028654), kInvSqrt2 = T(0.7071067811865476), kC = T(0.044715);
  constexpr T kInvSqrt2Pi = T(0.3989422804014327);
  switch (op) {
    case Binary::Add: return a + b;
    case Binary::Sub: return a - b;
    case Binary::Mul: return a * b;
    case Binary::Div: return a / b;
    case Binary::SiluGrad: {  // d/dx x s(x) = s (1 + x (1 - s))
      const T s = sigmoid(b);
      return a * s * (T(1) + b * (T(1) - s));
    }
    case Binary::GeluGrad:  // Phi(x) + x phi(x)
      return a * (T(0.5) * (T(1) + std::erf(b * kInvSqrt2)) + b * kInvSqrt2Pi * std::exp(T(-0.5) * b * b));
    case Binary::GeluTanhGrad: {
      const T inner = kSqrt2OverPi * (b + kC * b * b * b);
      const T t = std::tanh(inner);
      return a * (T(0.5) * (T(1) + t) + T(0.5) * b * (T(1) - t * t) * kSqrt2OverPi * (T(1) + T(3) * kC * b * b));
    }
  }
  return a;
}

}  // namespace kcpp::ops::math
