// Cross-entropy over the last dim (torch.nn.functional.cross_entropy = log_softmax + nll_loss).
//
//   lp[i,:]  = log_softmax(logits[i,:])                       (in the logits' dtype, f32 accumulation)
//   loss[i]  = (1 - eps) * (-lp[i, t_i]) + eps * mean_j(-lp[i, j])   for t_i != ignore_index, else 0
//   Mean: sum_i loss[i] / #{i : t_i != ignore_index}  (NaN when every target is ignored, as PyTorch)
//   Sum:  sum_i loss[i];   None: loss [N]
// logits [N, V], targets [N] (i32/i64, each in [0, V) or ignore_index).
// Saved for backward: lp [N, V] (what eager autograd keeps).  Backward, with g_i the gradient
// reaching row i (dloss / count, dloss, or dloss[i]; 0 for ignored rows):
//   dlp[i,j] = -g_i * ((1 - eps) [j = t_i] + eps / V),   dlogits = log_softmax_backward(dlp, lp)
#pragma once

#include "core/tensor.h"

namespace kcpp::ops {

enum class Reduction { Mean, Sum, None };

struct CrossEntropyOptions {
  int64_t ignore_index = -100;
  Reduction reduction = Reduction::Mean;
  double label_smoothing = 0.0;
};

struct CrossEntropyForward {
  Tensor loss;       // [] for Mean/Sum, [N] for None; logits' dtype
  Tensor log_probs;  // [N, V]
};

CrossEntropyForward cross_entropy_forward(const Tensor& logits, const Tensor& targets,
                                          const CrossEntropyOptions& opt = {});
// dloss has loss's shape.
Tensor cross_entropy_backward(const Tensor& dloss, const Tensor& log_probs, const Tensor& targets,
                              const CrossEntropyOptions& opt = {});

}  // namespace kcpp::ops
