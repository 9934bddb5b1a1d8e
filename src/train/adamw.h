// AdamW (Loshchilov & Hutter, decoupled weight decay) with global-norm gradient clipping, as
// torch.optim.AdamW and the Transformers Trainer run it:
//   g     = grad * min(1, max_norm / (||all grads||_2 + 1e-6))        (clip_grad_norm_)
//   m     = b1 m + (1 - b1) g,   v = b2 v + (1 - b2) g^2
//   p     = p - lr wd p  (decay: not for biases and norm weights, as the Trainer groups them)
//   p     = p - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
// State (m, v) in f32.  16-bit parameters get an f32 master copy: the update runs on it and the
// parameter receives it rounded (bf16 weights with f32 master weights).  m, v and the master copies
// are each one flat f32 buffer, every parameter's state a view of it in the parameters' order (so a
// data-parallel rank's shard of the state is three flat buffers: train/data_parallel.h).  A step is two passes over
// all parameters (adamw_kernels.h: the squared norm, then the fused update), a few multi-tensor
// launches on CUDA, with no host synchronization: the clipping factor is computed on the device and
// the norm is read back only when grad_norm() asks for it.
#pragma once

#include <functional>
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
  // The parameters by name (handles into the model: updated in place with copy_), all on one device;
  // `device` is that device when there are none (a data-parallel rank whose shard is only padding).
  AdamW(std::vector<std::pair<std::string, Tensor>> params, AdamWOptions options, Device device = Device::cpu());

  // One step with these gradients (by the parameters' names; a parameter without one is skipped).
  // Queued on the parameters' device; returns without waiting for it.  `norm_only`: gradients of
  // parameters another optimizer updates (a data-parallel shard's peers) that count toward the
  // clipping norm, so that every shard clips by the norm of the whole gradient.
  // `reduce_sq_norm`: when given, the squared norm of these gradients (an f64 [1] on the parameters'
  // device) is handed to it before the update reads it, to be summed in place with the other shards'
  // (a data-parallel group's all-reduce); it is called even when this optimizer has no gradient.
  void step(const std::map<std::string, Tensor>& grads, const std::vector<Tensor>& norm_only = {},
            const std::function<void(const Tensor&)>& reduce_sq_norm = {});
  // The last step's global L2 norm of the gradients before clipping (waits for that step on CUDA).
  double grad_norm() const;

  AdamWOptions options;
  int64_t steps() const { return t_; }
  Device device() const { return device_; }

 private:
  struct State {
    std::string name;
    Tensor param, master, m, v;  // master: f32 copy of a 16-bit parameter (else undefined)
    bool decay = true;
  };
  std::vector<State> state_;
  Device device_;
  Tensor flat_m_, flat_v_, flat_master_;  // [elements] f32 each (master: of the 16-bit parameters only)

 public:
  // Bytes of optimizer state: m, v and the f32 master copies.
  size_t state_bytes() const;
  // The state by parameter name, as torch.optim.AdamW's state_dict names it: "<name>.exp_avg",
  // "<name>.exp_avg_sq" and, for a 16-bit parameter, "<name>.master" (f32 tensors, views of the state).
  std::vector<std::pair<std::string, Tensor>> state_tensors() const;
  // Restores what state_tensors gave (from any source: `get` returns the tensor of a name, or an
  // undefined one when absent) and the step count.  Every parameter's state must be there, of its
  // shape; a master copy also becomes the parameter (rounded to its dtype).
  void load_state(const std::function<Tensor(const std::string&)>& get, int64_t steps);

 private:
  int64_t t_ = 0;
  Tensor sq_norm_;  // f64 [1] on the parameters' device: the last step's squared norm
  Tensor scratch_;  // the squared norm's per-chunk partials (CUDA)
};

}  // namespace kcpp::train
