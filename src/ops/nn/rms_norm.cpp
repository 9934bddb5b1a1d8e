// RMSNorm composed from primitives, one PyTorch-eager op at a time (see rms_norm.h).
#include "ops/nn/rms_norm.h"

#include "ops/check.h"
#include "ops/ops.h"

namespace kcpp::ops {
namespace {

DType stat_type(DType t) { return t == DType::f64 ? DType::f64 : DType::f32; }

void check_args(const Tensor& x, const Tensor& w, const char* op) {
  check_float(x, op, "x");
  check_same(w, x, op, "weight", "x");
  KCPP_CHECK(x.dim() >= 1, "op {}: argument 'x' needs at least 1 dim", op);
  check_shape(w, {x.size(-1)}, op, "weight");
}

// (offset + w) in `t`.
Tensor scaled_weight(const Tensor& w, double offset, DType t) {
  const Tensor wt = w.to(t);
  return offset != 0.0 ? add_scalar(wt, offset) : wt;
}

}  // namespace

RMSNormForward rms_norm_forward(const Tensor& x, const Tensor& w, const RMSNormOptions& opt) {
  check_args(x, w, "rms_norm");
  KCPP_CHECK(opt.eps >= 0, "op rms_norm: eps {} < 0", opt.eps);
  const DType dt = x.dtype(), st = stat_type(dt);
  const Tensor h = x.to(st);
  const Tensor rstd = rsqrt(add_scalar(mean(square(h), true), opt.eps));  // [..., 1]
  Tensor y;
  switch (opt.casting) {
    case RMSNormCasting::Llama: y = mul(scaled_weight(w, opt.offset, dt), mul(h, rstd).to(dt)); break;
    case RMSNormCasting::Gemma: y = mul(mul(h, rstd), scaled_weight(w, opt.offset, st)).to(dt); break;
    case RMSNormCasting::None: y = mul(mul(x, rstd.to(dt)), scaled_weight(w, opt.offset, dt)); break;
  }
  return {y, rstd.reshape({-1})};
}

RMSNormBackward rms_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                                  const RMSNormOptions& opt) {
  check_args(x, w, "rms_norm_backward");
  check_same(dy, x, "rms_norm_backward", "dy", "x");
  check_shape(dy, x.shape(), "rms_norm_backward", "dy");
  const DType dt = x.dtype(), st = stat_type(dt);
  const int64_t rows = x.numel() / std::max<int64_t>(x.size(-1), 1);
  check_shape(rstd, {rows}, "rms_norm_backward", "rstd");
  KCPP_CHECK(rstd.dtype() == st, "op rms_norm_backward: argument 'rstd' must be {}", dtype_name(st));
  Shape keep = x.shape();
  keep.back() = 1;
  const Tensor r = rstd.reshape(keep);
  const Tensor h = x.to(st);
  const double hdim = static_cast<double>(x.size(-1));
  // Gradient with respect to n = h * rstd, in the statistics type.
  Tensor n = mul(h, r), dn, dw;
  switch (opt.casting) {
    case RMSNormCasting::Llama: {
      const Tensor nd = n.to(dt);
      dw = sum_leading(mul(dy, nd));
      dn = mul(dy, scaled_weight(w, opt.offset, dt)).to(st);
      break;
    }
    case RMSNormCasting::Gemma: {
      const Tensor dyf = dy.to(st);
      dw = sum_leading(mul(dyf, n)).to(dt);
      dn = mul(dyf, scaled_weight(w, opt.offset, st));
      break;
    }
    case RMSNormCasting::None: {
      n = mul(x, r.to(dt));
      dw = sum_leading(mul(dy, n));
      dn = mul(dy, scaled_weight(w, opt.offset, dt)).to(st);
      n = n.to(st);
      break;
    }
  }
  // dx = rstd * (dn - n * mean(dn * n))   (mean(dn * h) * rstd^2 * h, rewritten with n = h * rstd)
  const Tensor proj = scale(sum(mul(dn, n), true), 1.0 / hdim);
  const Tensor dx = mul(r, sub(dn, mul(n, proj))).to(dt);
  return {dx, dw};
}

}  // namespace kcpp::ops
