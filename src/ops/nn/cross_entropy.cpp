#include "ops/nn/cross_entropy.h"

#include "ops/check.h"
#include "ops/ops.h"

namespace kcpp::ops {
namespace {

void check_ce(const Tensor& x, const Tensor& targets, const CrossEntropyOptions& opt, const char* op,
              const char* xname) {
  check_float(x, op, xname);
  check_dims(x, 2, op, xname);
  check_index(targets, op, "targets");
  check_device(targets, x, op, "targets", xname);
  check_shape(targets, {x.size(0)}, op, "targets");
  KCPP_CHECK(x.size(1) > 0, "op {}: argument '{}' has no classes", op, xname);
  KCPP_CHECK(opt.label_smoothing >= 0.0 && opt.label_smoothing <= 1.0, "op {}: label_smoothing {} outside [0, 1]", op,
             opt.label_smoothing);
}

}  // namespace

CrossEntropyForward cross_entropy_forward(const Tensor& logits, const Tensor& targets, const CrossEntropyOptions& opt) {
  check_ce(logits, targets, opt, "cross_entropy", "logits");
  const DType dt = logits.dtype();
  const double eps = opt.label_smoothing;
  const Tensor lp = log_softmax(logits);
  const Tensor valid = valid_mask(targets, opt.ignore_index, dt);               // [N]
  Tensor loss = neg(gather_last(lp, targets, opt.ignore_index));                // [N], 0 where ignored
  if (eps > 0.0) {
    const Tensor smooth = mul(neg(mean(lp)), valid);  // mean_j(-lp) (a sum would overflow f16), 0 where ignored
    loss = add(scale(loss, 1.0 - eps), scale(smooth, eps));
  }
  switch (opt.reduction) {
    case Reduction::None: break;
    case Reduction::Sum: loss = sum(loss); break;
    case Reduction::Mean: loss = div(sum(loss), sum(valid)); break;
  }
  return {loss, lp};
}

Tensor cross_entropy_backward(const Tensor& dloss, const Tensor& lp, const Tensor& targets,
                              const CrossEntropyOptions& opt) {
  check_ce(lp, targets, opt, "cross_entropy_backward", "log_probs");
  check_same(dloss, lp, "cross_entropy_backward", "dloss", "log_probs");
  const int64_t n = lp.size(0);
  const Shape expected = opt.reduction == Reduction::None ? Shape{n} : Shape{};
  check_shape(dloss, expected, "cross_entropy_backward", "dloss");
  const DType dt = lp.dtype();
  const double eps = opt.label_smoothing, v = static_cast<double>(lp.size(1));
  const Tensor valid = valid_mask(targets, opt.ignore_index, dt);
  Tensor g;  // [N]: gradient reaching each row's loss
  switch (opt.reduction) {
    case Reduction::None: g = mul(dloss, valid); break;
    case Reduction::Sum: g = mul(valid, dloss); break;
    case Reduction::Mean: g = mul(valid, div(dloss, sum(valid))); break;
  }
  Tensor dlp = scatter_last(scale(g, -(1.0 - eps)), targets, lp.size(1), opt.ignore_index);
  if (eps > 0.0) dlp = add(dlp, scale(g, -eps / v).unsqueeze(-1));
  return log_softmax_backward(dlp, lp);
}

}  // namespace kcpp::ops
