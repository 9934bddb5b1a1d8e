#include "train/adamw.h"

#include <cmath>

#include "core/error.h"
#include "core/profile.h"
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

AdamW::AdamW(std::vector<std::pair<std::string, Tensor>> params, AdamWOptions o, Device device)
    : options(o), device_(params.empty() ? device : params.front().second.device()) {
  // The ranges torch.optim.AdamW accepts (eps strictly positive here: it divides), each named; NaN fails every one.
  KCPP_CHECK(o.lr >= 0 && std::isfinite(o.lr), "AdamW: lr is {}; the learning rate must be a finite number, 0 or more", o.lr);
  KCPP_CHECK(o.beta1 >= 0 && o.beta1 < 1, "AdamW: beta1 is {}; it must be in [0, 1)", o.beta1);
  KCPP_CHECK(o.beta2 >= 0 && o.beta2 < 1, "AdamW: beta2 is {}; it must be in [0, 1)", o.beta2);
  KCPP_CHECK(o.eps > 0, "AdamW: eps is {}; it must be positive", o.eps);
  KCPP_CHECK(o.weight_decay >= 0, "AdamW: weight_decay is {}; it must be 0 or more", o.weight_decay);
  KCPP_CHECK(o.max_grad_norm >= 0, "AdamW: max_grad_norm is {}; it must be 0 (no clipping) or more", o.max_grad_norm);
  int64_t total = 0, total_master = 0;
  for (auto& [name, p] : params) {
    KCPP_CHECK(p.defined(), "AdamW: parameter '{}' is undefined", name);
    KCPP_CHECK(p.is_contiguous(), "AdamW: parameter '{}' is not contiguous", name);
    KCPP_CHECK(p.device() == params.front().second.device(), "AdamW: parameter '{}' is on {}, '{}' on {}", name,
               p.device().str(), params.front().first, params.front().second.device().str());
    total += p.numel();
    if (p.dtype() != DType::f32) total_master += p.numel();
  }
  if (params.empty()) return;
  const Device dev = device_;
  flat_m_ = Tensor::zeros({total}, DType::f32, dev);
  flat_v_ = Tensor::zeros({total}, DType::f32, dev);
  if (total_master > 0) flat_master_ = Tensor::empty({total_master}, DType::f32, dev);
  int64_t at = 0, at_master = 0;
  for (auto& [name, p] : params) {
    State s;
    s.name = name;
    s.param = p;
    const int64_t n = p.numel();
    if (p.dtype() != DType::f32) {
      s.master = flat_master_.narrow(0, at_master, n).view(p.shape());
      s.master.copy_(p);
      at_master += n;
    }
    s.m = flat_m_.narrow(0, at, n).view(p.shape());
    s.v = flat_v_.narrow(0, at, n).view(p.shape());
    at += n;
    s.decay = decays(name);
    state_.push_back(std::move(s));
  }
}

std::vector<std::pair<std::string, Tensor>> AdamW::state_tensors() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const State& s : state_) {
    out.emplace_back(s.name + ".exp_avg", s.m);
    out.emplace_back(s.name + ".exp_avg_sq", s.v);
    if (s.master.defined()) out.emplace_back(s.name + ".master", s.master);
  }
  return out;
}

void AdamW::load_state(const std::function<Tensor(const std::string&)>& get, int64_t steps) {
  KCPP_CHECK(steps >= 0, "AdamW: a saved step count of {}; it must be 0 or more", steps);
  auto take = [&](const std::string& key, const Tensor& into) {
    const Tensor t = get(key);
    KCPP_CHECK(t.defined(), "AdamW: the saved optimizer state has no '{}' (saved for other parameters, or another model?)", key);
    KCPP_CHECK(t.shape() == into.shape(), "AdamW: the saved '{}' has shape {}, the parameter's state {}", key, shape_str(t.shape()),
               shape_str(into.shape()));
    into.copy_(t);
  };
  for (State& s : state_) {
    take(s.name + ".exp_avg", s.m);
    take(s.name + ".exp_avg_sq", s.v);
    if (s.master.defined()) {
      take(s.name + ".master", s.master);
      s.param.copy_(s.master);
    }
  }
  t_ = steps;
}

size_t AdamW::state_bytes() const {
  size_t n = 0;
  for (const State& s : state_) n += s.m.nbytes() + s.v.nbytes() + (s.master.defined() ? s.master.nbytes() : 0);
  return n;
}

void AdamW::step(const std::map<std::string, Tensor>& grads, const std::vector<Tensor>& norm_only,
                 const std::function<void(const Tensor&)>& reduce_sq_norm) {
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
  ++t_;
  if (work.empty() && norm_only.empty() && !reduce_sq_norm) {
    sq_norm_ = Tensor();
    return;
  }
  // The global norm: every gradient's sum of squares into one f64 on the parameters' device.
  const Device dev = !work.empty() ? work.front().second.device() : !norm_only.empty() ? norm_only.front().device() : device();
  double moved = 0;  // bytes the two passes read and write (adamw_kernels.h)
  if (profile::enabled())
    for (auto& [s, g] : work)
      moved += static_cast<double>(s->param.numel()) *
               (2.0 * dtype_size(g.dtype()) + 16 + (s->master.defined() ? 8 + dtype_size(s->param.dtype()) : 2 * dtype_size(s->param.dtype())));
  const profile::Region region("AdamW", dev, 0, moved);
  sq_norm_ = Tensor::zeros({1}, DType::f64, dev);
  std::vector<Tensor> gs;
  gs.reserve(work.size());
  for (auto& [s, g] : work) gs.push_back(g);
  for (const Tensor& g : norm_only) {
    KCPP_CHECK(g.device() == dev, "AdamW: a norm-only gradient is on {}, the parameters on {}", g.device().str(), dev.str());
    gs.push_back(g.contiguous());
  }
  add_squared_norms(gs, static_cast<double*>(sq_norm_.data()), scratch_);
  if (reduce_sq_norm) reduce_sq_norm(sq_norm_);
  if (work.empty()) return;

  AdamWHyper h;
  h.lr = static_cast<float>(options.lr);
  h.beta1 = static_cast<float>(options.beta1);
  h.beta2 = static_cast<float>(options.beta2);
  h.eps = static_cast<float>(options.eps);
  h.bc1 = static_cast<float>(1.0 - std::pow(options.beta1, static_cast<double>(t_)));
  h.bc2 = static_cast<float>(1.0 - std::pow(options.beta2, static_cast<double>(t_)));
  h.max_norm = static_cast<float>(options.max_grad_norm);
  h.sq_norm = static_cast<const double*>(sq_norm_.data());
  // One multi-tensor update per (parameter dtype, gradient dtype) group, in the parameters' order.
  std::map<std::pair<DType, DType>, std::vector<AdamWTensor>> groups;
  for (auto& [s, g] : work) {
    AdamWTensor t;
    t.param = s->param.data();
    t.master = s->master.defined() ? static_cast<float*>(s->master.data()) : nullptr;
    t.grad = g.data();
    t.m = static_cast<float*>(s->m.data());
    t.v = static_cast<float*>(s->v.data());
    t.n = s->param.numel();
    t.weight_decay = s->decay ? static_cast<float>(options.weight_decay) : 0.0f;
    groups[{s->param.dtype(), g.dtype()}].push_back(t);
  }
  for (const auto& [dtypes, ts] : groups) adamw_update(ts, dtypes.first, dtypes.second, h, dev);
}

double AdamW::grad_norm() const { return sq_norm_.defined() ? std::sqrt(sq_norm_.item()) : 0.0; }

}  // namespace kcpp::train
