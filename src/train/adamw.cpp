#include "train/adamw.h"

#include <cmath>

#include "core/error.h"
#include "ops/ops.h"

namespace kcpp::train {

namespace {
// The Trainer's grouping: no weight decay for biases and normalization weights.
bool decays(const std::string& name) {
  return !(name.ends_with(".bias") || name.find("norm") != std::string::npos);
}
double squared_norm(const Tensor& g) {
  const Tensor f = g.dtype() == DType::f32 ? g : g.to(DType::f32);
  return ops::sum(ops::square(f.contiguous().view({f.numel()}))).to(DType::f64).item();
}
}  // namespace

AdamW::AdamW(std::vector<std::pair<std::string, Tensor>> params, AdamWOptions o) : options(o) {
  KCPP_CHECK(o.lr >= 0 && o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1 && o.eps > 0 && o.weight_decay >= 0 &&
                 o.max_grad_norm >= 0,
             "AdamW: bad options (lr {}, betas ({}, {}), eps {}, weight_decay {}, max_grad_norm {})", o.lr, o.beta1, o.beta2,
             o.eps, o.weight_decay, o.max_grad_norm);
  for (auto& [name, p] : params) {
    KCPP_CHECK(p.defined(), "AdamW: parameter '{}' is undefined", name);
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
  double total = 0.0;
  for (const State& s : state_)
    if (auto it = grads.find(s.name); it != grads.end()) total += squared_norm(it->second);
  const double norm = std::sqrt(total);
  const double clip = options.max_grad_norm > 0 && norm > options.max_grad_norm ? options.max_grad_norm / (norm + 1e-6) : 1.0;
  ++t_;
  const double b1 = options.beta1, b2 = options.beta2;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(t_)), bc2 = 1.0 - std::pow(b2, static_cast<double>(t_));
  for (State& s : state_) {
    const auto it = grads.find(s.name);
    if (it == grads.end()) continue;
    KCPP_CHECK(it->second.shape() == s.param.shape(), "AdamW: gradient of '{}' has the wrong shape", s.name);
    Tensor g = it->second.dtype() == DType::f32 ? it->second : it->second.to(DType::f32);
    if (clip != 1.0) g = ops::scale(g, clip);
    s.m.copy_(ops::add(ops::scale(s.m, b1), ops::scale(g, 1.0 - b1)));
    s.v.copy_(ops::add(ops::scale(s.v, b2), ops::scale(ops::square(g), 1.0 - b2)));
    const Tensor& p = s.master.defined() ? s.master : s.param;
    Tensor next = p;
    if (s.decay && options.weight_decay > 0) next = ops::scale(next, 1.0 - options.lr * options.weight_decay);
    const Tensor denom = ops::add_scalar(ops::sqrt(ops::scale(s.v, 1.0 / bc2)), options.eps);
    next = ops::sub(next, ops::scale(ops::div(s.m, denom), options.lr / bc1));
    if (s.master.defined()) {
      s.master.copy_(next);
      s.param.copy_(next.to(s.param.dtype()));
    } else {
      s.param.copy_(next);
    }
  }
  return norm;
}

}  // namespace kcpp::train
