// RMSNorm, as Hugging Face models compute it eagerly.
//
//   rstd[r] = 1 / sqrt(mean_j x[r,j]^2 + eps)          (always in f32; f64 for f64 input)
//   y[r,j]  = x[r,j] * rstd[r] * (offset + w[j])
//
// Casting modes (where the rounding to the input dtype happens):
//   Llama: h = x.f32 * rstd, rounded to dtype, then w * h in dtype (LlamaRMSNorm);
//   Gemma: everything in f32, (offset + w.f32) * h, rounded once at the end (GemmaRMSNorm, offset 1);
//   None:  every step in the input dtype (statistics still accumulated in f32).
// x [..., H], w [H].  Saved for backward: rstd [rows] in f32 (f64 for f64).
// Backward: with n = x*rstd, g = dy * (offset + w):
//   dx = rstd * (g - n * mean_j(g * n)),   dw = sum_rows(dy * n)   (n as the casting mode rounds it)
#pragma once

#include "core/tensor.h"

namespace kcpp::ops {

enum class RMSNormCasting { Llama, Gemma, None };

struct RMSNormOptions {
  double eps = 1e-6;
  double offset = 0.0;  // 1.0 for Gemma's (1 + w)
  RMSNormCasting casting = RMSNormCasting::Llama;
};

struct RMSNormForward {
  Tensor y;     // [..., H], x's dtype
  Tensor rstd;  // [rows]
};
struct RMSNormBackward {
  Tensor dx;  // [..., H]
  Tensor dw;  // [H]
};

RMSNormForward rms_norm_forward(const Tensor& x, const Tensor& w, const RMSNormOptions& opt = {});
RMSNormBackward rms_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                                  const RMSNormOptions& opt = {});

}  // namespace kcpp::ops
