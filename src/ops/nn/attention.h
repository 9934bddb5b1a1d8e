// Scaled dot-product attention as Hugging Face's eager path runs it (eager_attention_forward).
//
//   k, v repeated to the query heads (GQA: query head h reads kv head h / (Hq / Hkv))
//   s = (q @ k^T) * scale + mask          [B, Hq, Sq, Skv], in the input dtype
//       (softcap c > 0, Gemma 2: c * tanh(s / c) before the mask)
//   p = softmax(s in f32).to(dtype)        mask: causal, sliding window and/or chunk (ops::attention_mask)
//   o = p @ v                              [B, Hq, Sq, D]
// q [B, Hq, Sq, D], k and v [B, Hkv, Skv, D], Hq a multiple of Hkv, Sq <= Skv (queries are the last
// Sq positions).  Saved for backward: p (dtype) and p in f32, as eager autograd keeps them.
// Backward: dp = do @ v^T, dv = p^T @ do, ds = p * (dp - sum_j(dp * p)) (f32), with softcap
// ds *= 1 - tanh^2 (tanh recomputed, in the dtype), dq = ds*scale @ k, dk = (ds*scale)^T @ q, with dk, dv
// summed over each kv head's group of query heads.
#pragma once

#include "core/tensor.h"

namespace kcpp::ops {

struct AttentionOptions {
  double scale = 0.0;   // 0: 1 / sqrt(D)
  bool causal = true;
  int64_t window = 0;   // > 0: sliding window of this many keys (the query's own included)
  int64_t chunk = 0;    // > 0: chunked attention (Llama 4): a query sees only the keys of its own chunk of
                        // `chunk` positions (key j, query at position p: j / chunk == p / chunk)
  double softcap = 0.0; // > 0: logit soft-capping, s = softcap * tanh(s / softcap) (Gemma 2)
};

struct AttentionForward {
  Tensor out;       // [B, Hq, Sq, D]
  Tensor probs;     // [B, Hq, Sq, Skv], dtype
  Tensor probs_f32; // same, f32
};
struct AttentionBackward {
  Tensor dq, dk, dv;
};

AttentionForward attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& opt = {});
AttentionBackward attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                     const AttentionForward& saved, const AttentionOptions& opt = {});

}  // namespace kcpp::ops
