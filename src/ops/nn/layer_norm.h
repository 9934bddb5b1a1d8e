// LayerNorm (torch.nn.functional.layer_norm): statistics and normalisation in f32 (f64 for f64
// input), one rounding to the input dtype at the end, as PyTorch's fused CPU/CUDA kernel does.
//
//   mean[r] = mean_j x[r,j],  rstd[r] = 1 / sqrt(mean_j (x[r,j] - mean[r])^2 + eps)
//   y[r,j]  = (x[r,j] - mean[r]) * rstd[r] * w[j] + b[j]
// x [..., H], w [H], b [H] or undefined.  Saved: mean and rstd, [rows], f32.
// Backward, with xhat = (x - mean) * rstd and g = dy * w:
//   dx = rstd * (g - mean_j(g) - xhat * mean_j(g * xhat)),  dw = sum_rows(dy * xhat),  db = sum_rows(dy)
#pragma once

#include "core/tensor.h"

namespace kcpp::ops {

struct LayerNormForward {
  Tensor y, mean, rstd;
};
struct LayerNormBackward {
  Tensor dx, dw, db;  // db undefined when the forward had no bias
};

LayerNormForward layer_norm_forward(const Tensor& x, const Tensor& w, const Tensor& b, double eps = 1e-5);
LayerNormBackward layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& mean,
                                      const Tensor& rstd, bool has_bias);

}  // namespace kcpp::ops
