// The fused AdamW update and the gradient's squared norm, one pass over each parameter (CPU and
// CUDA).  Composed of elementwise ops the update read and wrote every f32 state tensor a dozen times
// and allocated as many temporaries (1.6 s a step at the Llama-3-8B dimensions, see bench_train);
// fused it moves each byte once.
//
//   g = grad * grad_scale;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p = p (1 - lr wd) - lr (m / bc1) / (sqrt(v / bc2) + eps)        (on the f32 master when given,
//                                                                    then stored rounded into param)
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "core/tensor.h"

namespace kcpp::train {

struct AdamWUpdate {
  int64_t n = 0;
  void* param = nullptr;
  DType param_dtype = DType::f32;
  float* master = nullptr;  // f32 copy of a 16-bit param, or null
  const void* grad = nullptr;
  DType grad_dtype = DType::f32;
  float* m = nullptr;
  float* v = nullptr;
  float lr = 0, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0, bc1 = 1, bc2 = 1, grad_scale = 1;
};

// Runs on the tensors' device (the current stream on CUDA).
void adamw_update(const AdamWUpdate& u, Device device);
// sum(grad^2) in f64, accumulated into *acc: a host double on the CPU, a device double on CUDA.
// Deterministic (fixed block partition and order).
void add_squared_norm(const Tensor& grad, double* acc);

}  // namespace kcpp::train
