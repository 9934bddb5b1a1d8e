#include "train/adamw.h"

#include <cmath>

#include "core/error.h"
#include "ops/ops.h"
#include "train/adamw_kernels.h"

#include <fmt/format.h>

namespace kcpp::train {

namespace {
// The Trainer's grouping: no weight decay for biases and normalization weights.
bool decays(const std::string& name) {
  return !(name.ends_with(".bias") || name.find("norm") != std::string::npos);
}
}  // namespace

AdamW::AdamW(std::vector<std::pair<std::string, Tensor>> params, AdamWOptions o) : options(o) {
  // The ranges torch.optim.AdamW accepts (eps strictly positive here: it divides), each named; NaN fails every one.
  KCPP_CHECK(o.lr >= 0 && std::isfinite(o.lr), "AdamW: lr is {}; the learning rate must be a finite number, 0 or more", o.lr);
  KCPP_CHECK(o.beta1 >= 0 && o.beta1 < 1, "AdamW: beta1 is {}; it must be in [0, 1)", o.beta1);
  KCPP_CHECK(o.beta2 >= 0 && o.beta2 < 1, "AdamW: beta2 is {}; it must be in [0, 1)", o.beta2);
  KCPP_CHECK(o.eps > 0, "AdamW: eps is {}; it must be positive", o.eps);
  KCPP_CHECK(o.weight_decay >= 0, "AdamW: weight_decay is {}; it must be 0 or more", o.weight_decay);
  KCPP_CHECK(o.max_grad_norm >= 0, "AdamW: max_grad_norm is {}; it must be 0 (no clipping) or more", o.max_grad_norm);
  for (auto& [name, p] : params) {
    KCPP_CHECK(p.defined(), "AdamW: parameter '{}' is undefined", name);
    KCPP_CHECK(p.is_contiguous(), "AdamW: parameter '{}' is not contiguous", name);
    State s;
    s.name = name;
    s.param = p;
    if (p.dtype() != DType::f32) s.master = p.to(DType::f32).clone();
    s.m = Tensor::zeros(p.shape(), DType::f32, p.device());
    s.v = Tensor::zeros(p.shape(), DType::f32, p.device());
    s.decay = decays(name);
    state_.push_back(std::move(s));
  }
}

double AdamW::step(const std::map<std::string, Tensor>& grads) {
  // The global norm: every gradient's sum of squares into one f64 (on the device for CUDA: one read back).
  std::vector<std::pair<State*, Tensor>> work;
  for (State& s : state_) {
    const auto it = grads.find(s.name);
    if (it == grads.end()) continue;
    KCPP_CHECK(it->second.shape() == s.param.shape(), "AdamW: gradient of '{}' has shape [{}], the parameter [{}]", s.name,
               fmt::join(it->second.shape(), ", "), fmt::join(s.param.shape(), ", "));
    KCPP_CHECK(it->second.device() == s.param.device(), "AdamW: gradient of '{}' is on {}, the parameter on {}", s.name,
               it->second.device().str(), s.param.device().str());
    work.emplace_back(&s, it->second.contiguous());
  }
  double total = 0.0;
  if (!work.empty()) {
    const Device dev = work.front().second.device();
    if (dev.is_cuda()) {
      const Tensor acc = Tensor::zeros({1}, DType::f64, dev);
      for (auto& [s, g] : work) add_squared_norm(g, static_cast<double*>(acc.data()));
      total = acc.item();
    } else {
      for (auto& [s, g] : work) add_squared_norm(g, &total);
    }
  }
  const double norm = std::sqrt(total);
  const double clip = options.max_grad_norm > 0 && norm > options.max_grad_norm ? options.max_grad_norm / (norm + 1e-6) : 1.0;
  ++t_;
  for (auto& [s, g] : work) {
    AdamWUpdate u;
    u.n = s->param.numel();
    u.param = s->param.data();
    u.param_dtype = s->param.dtype();
    u.master = s->master.defined() ? static_cast<float*>(s->master.data()) : nullptr;
    u.grad = g.data();
    u.grad_dtype = g.dtype();
    u.m = static_cast<float*>(s->m.data());
    u.v = static_cast<float*>(s->v.data());
    u.lr = static_cast<float>(options.lr);
    u.beta1 = static_cast<float>(options.beta1);
    u.beta2 = static_cast<float>(options.beta2);
    u.eps = static_cast<float>(options.eps);
    u.weight_decay = s->decay ? static_cast<float>(options.weight_decay) : 0.0f;
    u.bc1 = static_cast<float>(1.0 - std::pow(options.beta1, static_cast<double>(t_)));
    u.bc2 = static_cast<float>(1.0 - std::pow(options.beta2, static_cast<double>(t_)));
    u.grad_scale = static_cast<float>(clip);
    adamw_update(u, s->param.device());
  }
  return norm;
}

}  // namespace kcpp::train
