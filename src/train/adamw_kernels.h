// The fused AdamW update and the gradients' squared norm, every parameter of a model in a few
// launches (CPU and CUDA).  Each byte of a parameter's state moves once a step:
//
//   clip = max_norm / (sqrt(sq_norm) + 1e-6)  if max_norm > 0 and sqrt(sq_norm) > max_norm, else 1
//   g = grad * clip;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p = p (1 - lr wd) - lr (m / bc1) / (sqrt(v / bc2) + eps)        (on the f32 master when given,
//                                                                    then stored rounded into param)
//
// The clipping factor is computed where the update runs, from the squared norm in that device's
// memory: a step reads nothing back to the host (the norm is read only when asked for).
//
// Bytes a step moves per element (bf16 parameter with an f32 master, bf16 gradient): the squared
// norm reads the gradient (2); the update reads gradient, m, v, master (14) and writes m, v, master,
// parameter (14): 30 bytes, the floor against which bench_train reports the update's bandwidth.
//
// CUDA: a "multi-tensor" launch covers up to kAdamWBatch parameters, its descriptors passed by
// value as the kernel's argument (so a step can be captured in a CUDA graph with no host-side
// table); each block takes one chunk of kAdamWChunk elements of one parameter, 16-byte vector
// accesses where the pointers allow and scalar ones at a parameter's unaligned tail.  The squared
// norm is a fixed-order two-stage sum (per-chunk partials, then one block), so it is bitwise the
// same from run to run.
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace kcpp::train {

// One parameter: its buffers and its weight decay (0 for biases and norm weights).
struct AdamWTensor {
  void* param = nullptr;
  float* master = nullptr;  // f32 copy of a 16-bit param, or null
  const void* grad = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  int64_t n = 0;
  float weight_decay = 0;
};

// The step's scalars.  sq_norm: the gradients' squared norm in the memory of the tensors' device
// (a device pointer on CUDA); read only when max_norm > 0.
struct AdamWHyper {
  float lr = 0, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, bc1 = 1, bc2 = 1;
  float max_norm = 0;
  const double* sq_norm = nullptr;
};

inline constexpr int kAdamWBatch = 32;        // parameters per CUDA launch
inline constexpr int64_t kAdamWChunk = 8192;  // elements per CUDA block

// Updates every tensor in `ts`; all share param_dtype and grad_dtype and live on `device` (the
// current stream on CUDA).
void adamw_update(const std::vector<AdamWTensor>& ts, DType param_dtype, DType grad_dtype, const AdamWHyper& h, Device device);

// Adds sum(g^2) over every gradient of `grads` (contiguous, one dtype each, all on one device) into
// *acc in f64: a host double on the CPU, a device double on CUDA.  Deterministic: a fixed partition
// and order (on CUDA for a given list of sizes).  `scratch` holds the CUDA per-chunk partials (grown
// when too small; keep it between steps to reuse it).
void add_squared_norms(const std::vector<Tensor>& grads, double* acc, Tensor& scratch);

}  // namespace kcpp::train
