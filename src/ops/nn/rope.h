// Rotary position embedding, rotate-half layout (Llama, NeoX), as Hugging Face applies it.
//
//   inv_freq[i] = theta^(-2i / rd),  i < rd/2                       (rd = rotary dims, even)
//   freqs[b,s,i] = pos[b,s] * inv_freq[i];  emb = cat(freqs, freqs)  [B, S, rd], in f32
//   cos = (cos(emb) * attention_scaling).to(dtype), sin likewise
//   rotate_half(x) = cat(-x[..., rd/2:rd], x[..., :rd/2])
//   y[..., :rd] = x[..., :rd] * cos + rotate_half(x[..., :rd]) * sin;  y[..., rd:] = x[..., rd:]
// x [B, H, S, D] (heads before sequence, as HF), cos/sin [B or 1, S, rd] broadcast over heads.
// Nothing is saved but cos and sin.  Backward (rotate_half is linear with transpose -rotate_half):
//   dx[..., :rd] = dy * cos - rotate_half(dy * sin);  dx[..., rd:] = dy[..., rd:]
#pragma once

#include "core/tensor.h"

namespace kcpp::ops {

// inv_freq [rd/2] in f32.
Tensor rope_inv_freq(int64_t rotary_dim, double theta, Device device);

struct RopeCosSin {
  Tensor cos, sin;  // [B, S, rd] in `dtype`
};
// position_ids [B, S] (i32/i64), inv_freq [rd/2] f32.
RopeCosSin rope_cos_sin(const Tensor& position_ids, const Tensor& inv_freq, double attention_scaling, DType dtype);

Tensor rope_forward(const Tensor& x, const Tensor& cos, const Tensor& sin);
Tensor rope_backward(const Tensor& dy, const Tensor& cos, const Tensor& sin);

}  // namespace kcpp::ops
