// AdamW (Loshchilov & Hutter, decoupled weight decay) with global-norm gradient clipping, as
// torch.optim.AdamW and the Transformers Trainer run it:
//   g     = grad * min(1, max_norm / (||all grads||_2 + 1e-6))        (clip_grad_norm_)
//   m     = b1 m + (1 - b1) g,   v = b2 v + (1 - b2) g^2
//   p     = p - lr wd p  (decay: not for biases and norm weights, as the Trainer groups them)
//   p     = p - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
// State (m, v) in f32.  16-bit parameters get an f32 master copy: the update runs on it and the
// parameter receives it rounded (bf16 weights with f32 master weights).  One fused pass per
// parameter (adamw_kernels.h), CPU or CUDA; the clipping norm is read back once a step.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace kcpp::train {

struct AdamWOptions {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  double max_grad_norm = 0.0;  // 0: no clipping
};

class AdamW {
 public:
  // The parameters by name (handles into the model: updated in place with copy_).
  AdamW(std::vector<std::pair<std::string, Tensor>> params, AdamWOptions options);

  // One step with these gradients (by the parameters' names; a parameter without one is skipped).
  // Returns the gradients' global L2 norm before clipping.
  double step(const std::map<std::string, Tensor>& grads);

  AdamWOptions options;
  int64_t steps() const { return t_; }

 private:
  struct State {
    std::string name;
    Tensor param, master, m, v;  // master: f32 copy of a 16-bit parameter (else undefined)
    bool decay = true;
  };
  std::vector<State> state_;
  int64_t t_ = 0;
};

}  // namespace kcpp::train
