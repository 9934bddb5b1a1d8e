#include "nn/layers.h"

#include "core/error.h"

namespace kcpp::nn {

namespace {

const char* casting_name(ops::RMSNormCasting c) {
  switch (c) {
    case ops::RMSNormCasting::Llama: return "llama";
    case ops::RMSNormCasting::Gemma: return "gemma";
    case ops::RMSNormCasting::None: return "none";
  }
  return "llama";
}

// The rows of a [..., H] tensor.
int64_t rows_of(const Tensor& x) {
  KCPP_CHECK(x.dim() >= 1, "expected a tensor [..., H], got a scalar");
  const int64_t h = x.size(x.dim() - 1);
  return h == 0 ? 0 : x.numel() / h;
}

}  // namespace

// ---- RMSNorm -------------------------------------------------------------------------------------

RMSNorm::RMSNorm(Tensor w, ops::RMSNormOptions o) : Slot("RMSNorm", "RMSNorm/1"), weight(std::move(w)), options(o) {}

Tensor RMSNorm::forward(const Tensor& x, Saved* saved) {
  if (kernel()) {
    Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
    Tensor rstd = saved ? Tensor::empty({rows_of(x)}, DType::f32, x.device()) : Tensor();
    KernelArgs a;
    a.tensor("x", x).tensor("weight", weight).real("eps", options.eps).real("offset", options.offset);
    a.string("casting", casting_name(options.casting)).tensor("y", y);
    if (saved) a.tensor("rstd", rstd);
    if (run_forward(a, x.device())) {
      if (saved) *saved = {x, rstd};
      return y;
    }
  } else {
    count_reference();
  }
  ops::RMSNormForward f = ops::rms_norm_forward(x, weight, options);
  if (saved) *saved = {x, f.rstd};
  return f.y;
}

RMSNorm::Grads RMSNorm::backward(const Tensor& dy, const Saved& s) {
  KCPP_CHECK(s.x.defined() && s.rstd.defined(), "RMSNorm backward: nothing saved (run forward with a Saved)");
  if (kernel()) {
    Grads g{Tensor::empty(s.x.shape(), s.x.dtype(), s.x.device()), Tensor::empty(weight.shape(), weight.dtype(), weight.device())};
    KernelArgs a;
    a.tensor("dy", dy).tensor("x", s.x).tensor("weight", weight).tensor("rstd", s.rstd).real("eps", options.eps);
    a.real("offset", options.offset).string("casting", casting_name(options.casting));
    a.tensor("dx", g.dx).tensor("dweight", g.dweight);
    if (run_backward(a, s.x.device())) return g;
  } else {
    count_reference();
  }
  ops::RMSNormBackward b = ops::rms_norm_backward(dy, s.x, weight, s.rstd, options);
  return {b.dx, b.dw};
}

}  // namespace kcpp::nn
