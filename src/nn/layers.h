// The layer slots (module.h) of the Llama-family models, each with the reference implementation from
// ops/ and the contract (docs/contracts/) a kernel must implement to take its place.  Forward returns
// what backward needs in a Saved struct (filled only when one is passed: training); backward returns
// the gradients.  A kernel that refuses a call (supports()) leaves it to the reference, counted.
#pragma once

#include "core/tensor.h"
#include "nn/module.h"
#include "ops/nn/attention.h"
#include "ops/nn/cross_entropy.h"
#include "ops/nn/glu.h"
#include "ops/nn/rms_norm.h"
#include "ops/nn/rope.h"

namespace kcpp::nn {

// "RMSNorm" / RMSNorm/1: y = x * rstd * (offset + w), rstd = 1 / sqrt(mean(x^2) + eps) (ops/nn/rms_norm.h).
class RMSNorm : public Slot {
 public:
  explicit RMSNorm(Tensor weight, ops::RMSNormOptions options = {});

  struct Saved {
    Tensor x, rstd;
  };
  struct Grads {
    Tensor dx, dweight;
  };
  Tensor forward(const Tensor& x, Saved* saved = nullptr);
  Grads backward(const Tensor& dy, const Saved& saved);

  Tensor weight;
  ops::RMSNormOptions options;
};

// The elementwise activations, by Transformers layer name: "SiLU", "GeLU" (exact), "GeluTanh",
// "FastGELU", "NewGELU" (the tanh form, three spellings), "QuickGELU" (x sigmoid(1.702 x)); contract
// <Name>/1 (docs/contracts/activations.md).  Nothing is saved but x, which the caller keeps.
class Activation : public Slot {
 public:
  enum class Kind { SiLU, GeLU, GeluTanh, FastGELU, NewGELU, QuickGELU };
  explicit Activation(Kind kind);
  static Kind parse(std::string_view hidden_act);  // Transformers' hidden_act ("silu", "gelu_pytorch_tanh", ...)
  Tensor forward(const Tensor& x);
  Tensor backward(const Tensor& dy, const Tensor& x);

  const Kind kind;
};

// "MLP" / GLU/1: the gated activation of a Llama MLP, h = act(gate) * up (the projections around it
// are the model's GEMMs).  Nothing is saved but gate and up, which the caller keeps.  gate and up may
// be views with a row stride (GLU/1's rows: the halves of one [.., 2I] projection); backward with
// `packed` writes dgate and dup into the halves of one [.., 2I] tensor, returned as `packed`.
class MLP : public Slot {
 public:
  explicit MLP(ops::GluActivation activation = ops::GluActivation::Silu);
  struct Grads {
    Tensor dgate, dup;
    Tensor packed;  // [.., 2I] = [dgate, dup] when backward was asked for it
  };
  Tensor forward(const Tensor& gate, const Tensor& up);
  Grads backward(const Tensor& dh, const Tensor& gate, const Tensor& up, bool packed = false);

  ops::GluActivation activation;
};

// "rotary_pos_emb" / rotary_pos_emb/1: q and k [batch, heads, seq, head_dim] rotated by cos / sin
// [batch or 1, seq, rotary_dim] (ops/nn/rope.h); k may be absent.  Nothing is saved but cos and sin.
class RotaryEmbedding : public Slot {
 public:
  explicit RotaryEmbedding(ops::RopeLayout style = ops::RopeLayout::RotateHalf);
  std::pair<Tensor, Tensor> forward(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin);
  std::pair<Tensor, Tensor> backward(const Tensor& dq_out, const Tensor& dk_out, const Tensor& cos, const Tensor& sin);

  ops::RopeLayout style;
};

// "Attention" / Attention/1: softmax(q k^T scale + mask) v with grouped-query heads (ops/nn/attention.h);
// q [B, Hq, Sq, D], k, v [B, Hkv, Skv, D].  Chunked attention (options.chunk, Llama 4) is not in the
// contract: those calls run the reference, counted as fallbacks when a kernel is set.  Saved: a kernel's out and lse (it recomputes the
// probabilities), or the reference's probabilities.
class Attention : public Slot {
 public:
  explicit Attention(ops::AttentionOptions options = {});
  struct Saved {
    Tensor q, k, v, out, lse;       // lse: a kernel's
    ops::AttentionForward reference;  // the reference's (probabilities)
  };
  struct Grads {
    Tensor dq, dk, dv;
  };
  // `out`, when given, is where the result goes ([B, Hq, S, D], any strides with D contiguous, e.g.
  // a transposed [B, S, Hq, D] buffer) and is returned; otherwise a contiguous one is allocated.
  Tensor forward(const Tensor& q, const Tensor& k, const Tensor& v, Saved* saved = nullptr, const Tensor& out = {});
  Grads backward(const Tensor& dout, const Saved& saved);

  ops::AttentionOptions options;
};

// "MegaBlocksMoeMLP" / "Llama4TextMoe" / MoE/1: a dropless mixture-of-experts MLP over hidden [T, H] (Mixtral's,
// Qwen2-MoE's and Qwen3-MoE's sparse block): router logits z = hidden router_weight^T [T, E],
// p = softmax(z) in f32, each token's top_k experts by p (ties to the lower index) with weights w = p
// (renormalized over the chosen ones with `normalize`), out_t = sum_j w_j down_e(act(gate_e(x_t)) *
// up_e(x_t)) with the fused gate_up_proj [E, 2I, H] and down_proj [E, H, I] of Transformers 5.
// With a shared expert (Qwen2-MoE: set_shared_expert) every token also goes through a gated MLP
// shared_gate_up_proj [2Is, H] (gate rows, then up rows), shared_down_proj [H, Is], its output scaled
// by sigmoid(hidden shared_expert_gate^T) (shared_expert_gate [1, H]; absent: 1) and added:
// out_t += sigma_t m_t, as Qwen2MoeSparseMoeBlock computes it.
// Llama 4 (Llama4TextMoe; Options routing Sigmoid, weight_on_input): the top_k largest logits z, w =
// sigmoid(z) in f32, each chosen expert run on w x_t and its output added unweighted, plus a shared
// expert without a gate; its stacks are passed as the transposed views of its checkpoint's
// gate_up_proj [E, H, 2I] and down_proj [E, I, H] (any strides; the gradients come back contiguous in
// the [E, 2I, H] / [E, H, I] shapes).
// The reference is Transformers' eager loop over the experts that received tokens (routing on the
// host), then the shared expert as Qwen2MoeMLP and the gate as F.sigmoid(F.linear).
// Saved: router_logits (also what the load-balancing loss reads), topk_ids, topk_weights, a kernel's
// permutation (expert_offsets, sorted_slots, gate_up), and the reference's shared-expert activations.
// backward takes the logits' other upstream gradient (the auxiliary loss's) as drouter_logits.
class MoE : public Slot {
 public:
  enum class Routing { Softmax, Sigmoid };  // MoE/1's routing "softmax" / "sigmoid"
  struct Options {
    int64_t top_k = 2;
    bool normalize = true;  // softmax only
    ops::GluActivation activation = ops::GluActivation::Silu;
    Routing routing = Routing::Softmax;
    bool weight_on_input = false;  // MoE/1's apply_router_weight "input" (Llama 4), else "output"
  };
  // `layer_name`: the name kernelize maps ("MegaBlocksMoeMLP"; Llama 4's block is "Llama4TextMoe").
  MoE(Tensor router_weight, Tensor gate_up_proj, Tensor down_proj, Options options, std::string layer_name = "MegaBlocksMoeMLP");
  // The shared expert: gate_up [2Is, H], down [H, Is], and optionally its gate [1, H].
  void set_shared_expert(Tensor gate_up, Tensor down, Tensor gate = {});
  struct Saved {
    Tensor hidden, router_logits, topk_ids, topk_weights;  // [T, H], [T, E], [T, k] i32, [T, k] f32
    Tensor expert_offsets, sorted_slots, gate_up;          // a kernel's
    // The reference's shared expert: its gate and up projections [T, Is] each, the gated product h'
    // [T, Is], its output m [T, H] and sigma [T, 1] (a kernel's backward recomputes them).
    Tensor shared_gate, shared_up, shared_h, shared_out, shared_sigma;
  };
  struct Grads {
    Tensor dhidden, drouter_weight, dgate_up_proj, ddown_proj;
    Tensor dshared_gate_up_proj, dshared_down_proj, dshared_expert_gate;  // with a shared expert
  };
  // hidden [T, H] (contiguous).  `router_logits`: where to write them ([T, E] of the model's dtype,
  // contiguous: a slice of a buffer of every layer's), else allocated; either way in saved.
  Tensor forward(const Tensor& hidden, Saved* saved = nullptr, Tensor router_logits = {});
  // `last_use`: the caller reads `saved` no more after this call, so a kernel's backward may write
  // over its gate_up (MoE/1's overwrite_gate_up), which then holds no activation.
  Grads backward(const Tensor& dout, const Saved& saved, const Tensor& drouter_logits = {}, bool last_use = false);

  Tensor router_weight, gate_up_proj, down_proj;
  Tensor shared_gate_up_proj, shared_down_proj, shared_expert_gate;  // undefined without a shared expert
  Options options;

 private:
  Tensor reference_forward(const Tensor& hidden, Saved* saved, Tensor router_logits);
  Grads reference_backward(const Tensor& dout, const Saved& saved, const Tensor& drouter_logits);
  // The shared expert's part of forward (sigma m, added to `out`) and of backward (into g).
  Tensor shared_forward(const Tensor& hidden, Saved* saved) const;
  void shared_backward(const Tensor& dout, const Saved& saved, Grads& g) const;
};

// Transformers' load_balancing_loss_func over router logits [R, E] (every MoE layer's rows
// together, no attention mask): p = softmax(z) rounded to the logits' dtype, the top_k experts of
// each row, f_e = the rows choosing e / R, P_e = the mean of p_e, loss = E sum_e f_e P_e (f32 scalar),
// and dlogits, the gradient of grad_scale * loss ([R, E] f32; the counts f are constant).
struct LoadBalancingLoss {
  Tensor loss, dlogits;
};
LoadBalancingLoss load_balancing_loss(const Tensor& router_logits, int64_t top_k, double grad_scale);

// "CrossEntropyLoss" / CrossEntropyLoss/1: the loss of logits [N, V] against targets [N] (f32, one
// element for mean / sum).  Saved: the kernel's gradient (for an upstream 1) or the reference's
// log-probabilities.
class CrossEntropyLoss : public Slot {
 public:
  explicit CrossEntropyLoss(ops::CrossEntropyOptions options = {});
  struct Saved {
    Tensor targets, grad, log_probs;  // grad (kernel) or log_probs (reference)
  };
  Tensor forward(const Tensor& logits, const Tensor& targets, Saved* saved = nullptr);
  // dloss: the loss's upstream gradient (mean / sum).
  Tensor backward(double dloss, const Saved& saved);

  ops::CrossEntropyOptions options;
};

// "ForCausalLMLoss" / ForCausalLMLoss/1: the lm_head GEMM and the cross-entropy of its logits,
// hidden [N, H] @ weight [V, H]^T against targets [N] (shifted by the caller).  The kernel computes
// the gradients in forward and never holds the logits; the reference materializes them (in the
// model's dtype, upcast to f32 for the loss, as Transformers' ForCausalLMLoss does).
class ForCausalLMLoss : public Slot {
 public:
  explicit ForCausalLMLoss(ops::CrossEntropyOptions options = {});
  struct Saved {
    Tensor hidden, weight, targets;
    Tensor dhidden, dweight;  // kernel: the gradients for an upstream 1
    Tensor log_probs;         // reference
  };
  struct Grads {
    Tensor dhidden, dweight;
  };
  Tensor forward(const Tensor& hidden, const Tensor& weight, const Tensor& targets, Saved* saved = nullptr);
  Grads backward(double dloss, const Saved& saved);

  // options.reduction set to `reduction` (mean or sum: a scalar to differentiate) for the scope of
  // this object, then restored: a model's loss_and_gradients.
  class ReductionScope {
   public:
    ReductionScope(ForCausalLMLoss& slot, ops::Reduction reduction);
    ~ReductionScope() { slot_.options.reduction = saved_; }
    ReductionScope(const ReductionScope&) = delete;
    ReductionScope& operator=(const ReductionScope&) = delete;

   private:
    ForCausalLMLoss& slot_;
    ops::Reduction saved_;
  };

  ops::CrossEntropyOptions options;
};

}  // namespace kcpp::nn
