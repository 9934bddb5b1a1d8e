// Rotary position embedding, as Hugging Face applies it, in two pair layouts:
//   RotateHalf (Llama, NeoX): element j pairs with j + rd/2;  Interleaved (GPT-J, DeepSeek): 2i with 2i+1.
//
//   inv_freq[i] = theta^(-2i / rd),  i < rd/2                       (rd = rotary dims, even)
//   freqs[b,s,i] = pos[b,s] * inv_freq[i];  emb = cat(freqs, freqs)  [B, S, rd], in f32
//   cos = (cos(emb) * attention_scaling).to(dtype), sin likewise
//   (on CUDA one kernel that computes each element through the same functions: the same bits)
//   rotate_half(x) = cat(-x[..., rd/2:rd], x[..., :rd/2])          (RotateHalf)
//   rotate_every_two(x)[2i, 2i+1] = (-x[2i+1], x[2i])              (Interleaved; cos/sin then hold
//                                                                     each angle twice: [c0 c0 c1 c1 ...])
//   y[..., :rd] = x[..., :rd] * cos + rot(x[..., :rd]) * sin;  y[..., rd:] = x[..., rd:]
// x [B, H, S, D] (heads before sequence, as HF), cos/sin [B or 1, S, rd] broadcast over heads.
// Nothing is saved but cos and sin.  Backward (rot is linear with transpose -rot, in both layouts):
//   dx[..., :rd] = dy * cos - rot(dy * sin);  dx[..., rd:] = dy[..., rd:]
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

enum class RopeLayout { RotateHalf, Interleaved };

Tensor rope_forward(const Tensor& x, const Tensor& cos, const Tensor& sin, RopeLayout layout = RopeLayout::RotateHalf);
Tensor rope_backward(const Tensor& dy, const Tensor& cos, const Tensor& sin,
                     RopeLayout layout = RopeLayout::RotateHalf);

}  // namespace kcpp::ops
