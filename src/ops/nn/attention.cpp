#include "ops/nn/attention.h"

#include <cmath>

#include "ops/check.h"
#include "ops/ops.h"

namespace kcpp::ops {
namespace {

void check_attention(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& opt, const char* op) {
  check_float(q, op, "q");
  check_same(k, q, op, "k", "q");
  check_same(v, q, op, "v", "q");
  check_dims(q, 4, op, "q");
  check_dims(k, 4, op, "k");
  check_shape(v, k.shape(), op, "v");
  KCPP_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(3),
             "op {}: k {} does not match q {} in batch or head dim", op, shape_str(k.shape()), shape_str(q.shape()));
  KCPP_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "op {}: {} query heads are not a multiple of {} kv heads", op,
             q.size(1), k.size(1));
  KCPP_CHECK(q.size(2) <= k.size(2), "op {}: {} queries but only {} keys", op, q.size(2), k.size(2));
  KCPP_CHECK(opt.window >= 0, "op {}: window {} < 0", op, opt.window);
  KCPP_CHECK(opt.chunk >= 0, "op {}: chunk {} < 0", op, opt.chunk);
  KCPP_CHECK(opt.softcap >= 0 && std::isfinite(opt.softcap), "op {}: softcap {} must be >= 0 and finite (0: none)", op,
             opt.softcap);
}

// [B, Hkv, S, D] -> [B, Hkv * g, S, D] (HF repeat_kv: each kv head repeated g times, materialized).
Tensor repeat_kv(const Tensor& x, int64_t g) {
  if (g == 1) return x;
  const int64_t b = x.size(0), h = x.size(1), s = x.size(2), d = x.size(3);
  return x.unsqueeze(2).expand({b, h, g, s, d}).reshape({b, h * g, s, d});
}

// Inverse of repeat_kv for gradients: sum each group.
Tensor sum_groups(const Tensor& x, int64_t g) {
  if (g == 1) return x;
  const int64_t b = x.size(0), hq = x.size(1), s = x.size(2), d = x.size(3);
  return sum_dim(x.reshape({b, hq / g, g, s, d}), 2);
}

double scale_of(const Tensor& q, const AttentionOptions& opt) {
  return opt.scale != 0.0 ? opt.scale : 1.0 / std::sqrt(static_cast<double>(q.size(3)));
}

// tanh(q k^T scale / softcap) in the dtype: the capped scores over softcap.
Tensor capped_unit(const Tensor& q, const Tensor& kr, const AttentionOptions& opt) {
  return tanh(scale(scale(matmul(q, kr, false, true), scale_of(q, opt)), 1.0 / opt.softcap));
}

}  // namespace

AttentionForward attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& opt) {
  check_attention(q, k, v, opt, "attention");
  const int64_t g = q.size(1) / k.size(1);
  Tensor s = opt.softcap > 0 ? scale(capped_unit(q, repeat_kv(k, g), opt), opt.softcap)
                             : scale(matmul(q, repeat_kv(k, g), false, true), scale_of(q, opt));
  if (opt.causal || opt.window > 0 || opt.chunk > 0)
    s = add(s, attention_mask(q.size(2), k.size(2), opt.causal, opt.window, q.dtype(), q.device(), opt.chunk));
  const Tensor p32 = softmax(s.to(q.dtype() == DType::f64 ? DType::f64 : DType::f32));
  const Tensor p = p32.to(q.dtype());
  return {matmul(p, repeat_kv(v, g)), p, p32};
}

AttentionBackward attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                     const AttentionForward& saved, const AttentionOptions& opt) {
  check_attention(q, k, v, opt, "attention_backward");
  check_same(dout, q, "attention_backward", "dout", "q");
  check_shape(dout, q.shape(), "attention_backward", "dout");
  check_shape(saved.probs, {q.size(0), q.size(1), q.size(2), k.size(2)}, "attention_backward", "probs");
  const int64_t g = q.size(1) / k.size(1);
  const Tensor kr = repeat_kv(k, g), vr = repeat_kv(v, g);
  const Tensor dp = matmul(dout, vr, false, true);             // [B, Hq, Sq, Skv]
  const Tensor dvr = matmul(saved.probs, dout, true, false);   // [B, Hq, Skv, D]
  Tensor ds = softmax_backward(dp.to(saved.probs_f32.dtype()), saved.probs_f32).to(q.dtype());
  if (opt.softcap > 0) {
    const Tensor u = capped_unit(q, kr, opt);
    ds = mul(ds, add_scalar(scale(square(u), -1.0), 1.0));
  }
  const Tensor dsc = scale(ds, scale_of(q, opt));
  const Tensor dq = matmul(dsc, kr);                            // [B, Hq, Sq, D]
  const Tensor dkr = matmul(dsc, q, true, false);               // [B, Hq, Skv, D]
  return {dq, sum_groups(dkr, g), sum_groups(dvr, g)};
}

}  // namespace kcpp::ops
