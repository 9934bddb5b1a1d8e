#include "ops/nn/rope.h"

#include <cmath>

#include "ops/check.h"
#include "ops/cuda/launch.h"
#include "ops/ops.h"

namespace kcpp::ops {
namespace {

Tensor rotate(const Tensor& x, RopeLayout layout) {
  const int64_t h = x.size(-1) / 2;
  if (layout == RopeLayout::RotateHalf) return cat({neg(x.narrow(-1, h, h)), x.narrow(-1, 0, h)}, -1);
  // Interleaved: view the pairs as a trailing dim of 2 and swap them, negating the new first.
  Shape pairs = x.shape();
  pairs.back() = h;
  pairs.push_back(2);
  const Tensor xp = x.reshape(pairs);
  return cat({neg(xp.select(-1, 1)).unsqueeze(-1), xp.select(-1, 0).unsqueeze(-1)}, -1).reshape(x.shape());
}

// cos/sin [B, S, rd] -> [B, 1, S, rd], checked against x [B, H, S, D].
void check_rope(const Tensor& x, const Tensor& cos, const Tensor& sin, const char* op) {
  check_float(x, op, "x");
  check_dims(x, 4, op, "x");
  check_same(cos, x, op, "cos", "x");
  check_same(sin, x, op, "sin", "x");
  check_dims(cos, 3, op, "cos");
  check_shape(sin, cos.shape(), op, "sin");
  const int64_t rd = cos.size(2);
  KCPP_CHECK(rd % 2 == 0 && rd > 0 && rd <= x.size(3), "op {}: rotary dim {} must be even, > 0 and <= head dim {}", op,
             rd, x.size(3));
  KCPP_CHECK(cos.size(1) == x.size(2), "op {}: cos has {} positions, x has sequence length {}", op, cos.size(1),
             x.size(2));
  KCPP_CHECK(cos.size(0) == 1 || cos.size(0) == x.size(0), "op {}: cos batch {} does not broadcast to x batch {}", op,
             cos.size(0), x.size(0));
}

// Applies y = a * cos - rot(a * sin) (backward) or a * cos + rot(a) * sin (forward) to the rotary
// part of x and keeps the rest.
Tensor rope_apply(const Tensor& x, const Tensor& cos, const Tensor& sin, bool backward, RopeLayout layout) {
  const int64_t rd = cos.size(2), d = x.size(3);
  const Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
  const Tensor xr = rd == d ? x : x.narrow(-1, 0, rd);
  const Tensor yr =
      backward ? sub(mul(xr, c), rotate(mul(xr, s), layout)) : add(mul(xr, c), mul(rotate(xr, layout), s));
  if (rd == d) return yr;
  return cat({yr, x.narrow(-1, rd, d - rd)}, -1);
}

}  // namespace

Tensor rope_inv_freq(int64_t rotary_dim, double theta, Device device) {
  KCPP_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0, "op rope_inv_freq: rotary_dim {} must be even and > 0", rotary_dim);
  KCPP_CHECK(theta > 0, "op rope_inv_freq: theta {} must be > 0", theta);
  std::vector<double> f(static_cast<size_t>(rotary_dim / 2));
  for (size_t i = 0; i < f.size(); ++i)
    f[i] = static_cast<float>(1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(rotary_dim)));
  return Tensor::from_f64(f, {rotary_dim / 2}, DType::f32, device);
}

RopeCosSin rope_cos_sin(const Tensor& position_ids, const Tensor& inv_freq, double attention_scaling, DType dtype) {
  check_index(position_ids, "rope_cos_sin", "position_ids");
  check_dims(position_ids, 2, "rope_cos_sin", "position_ids");
  check_float(inv_freq, "rope_cos_sin", "inv_freq");
  check_dims(inv_freq, 1, "rope_cos_sin", "inv_freq");
  check_device(position_ids, inv_freq, "rope_cos_sin", "position_ids", "inv_freq");
  if (position_ids.device().is_cuda() && inv_freq.dtype() == DType::f32 &&
      (dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16)) {
#if KCPP_WITH_CUDA
    // One kernel (a decode step's table is one row a sequence: the composition's eight launches cost
    // more than its work), the same bits as the composition below.
    const int64_t rd = 2 * inv_freq.size(0);
    RopeCosSin cs{Tensor::empty({position_ids.size(0), position_ids.size(1), rd}, dtype, position_ids.device()),
                  Tensor::empty({position_ids.size(0), position_ids.size(1), rd}, dtype, position_ids.device())};
    cuda::rope_cos_sin(cs.cos, cs.sin, position_ids.contiguous(), inv_freq.contiguous(), attention_scaling);
    return cs;
#endif
  }
  const Tensor pos = position_ids.to(DType::f32).unsqueeze(-1);                            // [B, S, 1]
  const Tensor freqs = mul(pos, inv_freq.to(DType::f32).reshape({1, 1, inv_freq.size(0)}));  // [B, S, rd/2]
  const Tensor emb = cat({freqs, freqs}, -1);
  return {scale(cos(emb), attention_scaling).to(dtype), scale(sin(emb), attention_scaling).to(dtype)};
}

Tensor rope_forward(const Tensor& x, const Tensor& cos, const Tensor& sin, RopeLayout layout) {
  check_rope(x, cos, sin, "rope");
  return rope_apply(x, cos, sin, false, layout);
}

Tensor rope_backward(const Tensor& dy, const Tensor& cos, const Tensor& sin, RopeLayout layout) {
  check_rope(dy, cos, sin, "rope_backward");
  return rope_apply(dy, cos, sin, true, layout);
}

}  // namespace kcpp::ops
