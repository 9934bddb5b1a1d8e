#include "ops/nn/layer_norm.h"

#include "ops/check.h"
#include "ops/ops.h"

namespace kcpp::ops {
namespace {
DType stat_type(DType t) { return t == DType::f64 ? DType::f64 : DType::f32; }
Shape keep_shape(const Tensor& x) {
  Shape s = x.shape();
  s.back() = 1;
  return s;
}
}  // namespace

LayerNormForward layer_norm_forward(const Tensor& x, const Tensor& w, const Tensor& b, double eps) {
  check_float(x, "layer_norm", "x");
  KCPP_CHECK(x.dim() >= 1, "op layer_norm: argument 'x' needs at least 1 dim");
  check_same(w, x, "layer_norm", "weight", "x");
  check_shape(w, {x.size(-1)}, "layer_norm", "weight");
  if (b.defined()) {
    check_same(b, x, "layer_norm", "bias", "x");
    check_shape(b, {x.size(-1)}, "layer_norm", "bias");
  }
  KCPP_CHECK(eps >= 0, "op layer_norm: eps {} < 0", eps);
  const DType st = stat_type(x.dtype());
  const Tensor h = x.to(st);
  const Tensor mu = mean(h, true);
  const Tensor xc = sub(h, mu);
  const Tensor rstd = rsqrt(add_scalar(mean(square(xc), true), eps));
  Tensor y = mul(mul(xc, rstd), w.to(st));
  if (b.defined()) y = add(y, b.to(st));
  return {y.to(x.dtype()), mu.reshape({-1}), rstd.reshape({-1})};
}

LayerNormBackward layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& mu,
                                      const Tensor& rstd, bool has_bias) {
  check_float(x, "layer_norm_backward", "x");
  check_same(dy, x, "layer_norm_backward", "dy", "x");
  check_shape(dy, x.shape(), "layer_norm_backward", "dy");
  check_shape(w, {x.size(-1)}, "layer_norm_backward", "weight");
  const DType st = stat_type(x.dtype());
  const int64_t rows = x.numel() / std::max<int64_t>(x.size(-1), 1);
  check_shape(mu, {rows}, "layer_norm_backward", "mean");
  check_shape(rstd, {rows}, "layer_norm_backward", "rstd");
  const Tensor r = rstd.reshape(keep_shape(x)), m = mu.reshape(keep_shape(x));
  const Tensor xhat = mul(sub(x.to(st), m), r);
  const Tensor dyf = dy.to(st);
  const Tensor g = mul(dyf, w.to(st));
  const Tensor dx = mul(r, sub(sub(g, mean(g, true)), mul(xhat, mean(mul(g, xhat), true))));
  LayerNormBackward out{dx.to(x.dtype()), sum_leading(mul(dyf, xhat)).to(x.dtype()), Tensor()};
  if (has_bias) out.db = sum_leading(dyf).to(x.dtype());
  return out;
}

}  // namespace kcpp::ops
