// The layer slots (module.h) of the Llama-family models, each with the reference implementation from
// ops/ and the contract (docs/contracts/) a kernel must implement to take its place.  Forward returns
// what backward needs in a Saved struct (filled only when one is passed: training); backward returns
// the gradients.  A kernel that refuses a call (supports()) leaves it to the reference, counted.
#pragma once

#include "core/tensor.h"
#include "nn/module.h"
#include "ops/nn/rms_norm.h"

namespace kcpp::nn {

// "RMSNorm" / RMSNorm/1: y = x * rstd * (offset + w), rstd = 1 / sqrt(mean(x^2) + eps) (ops/nn/rms_norm.h).
class RMSNorm : public Slot {
 public:
  explicit RMSNorm(Tensor weight, ops::RMSNormOptions options = {});

  struct Saved {
    Tensor x, rstd;
  };
  struct Grads {
    Tensor dx, dweight;
  };
  Tensor forward(const Tensor& x, Saved* saved = nullptr);
  Grads backward(const Tensor& dy, const Saved& saved);

  Tensor weight;
  ops::RMSNormOptions options;
};

}  // namespace kcpp::nn
