#include "nn/layers.h"

#include <cmath>

#include "core/error.h"
#include "core/profile.h"
#include "ops/ops.h"

namespace kcpp::nn {

namespace {

const char* casting_name(ops::RMSNormCasting c) {
  switch (c) {
    case ops::RMSNormCasting::Llama: return "llama";
    case ops::RMSNormCasting::Gemma: return "gemma";
    case ops::RMSNormCasting::None: return "none";
  }
  return "llama";
}

// The rows of a [..., H] tensor.
int64_t rows_of(const Tensor& x) {
  KCPP_CHECK(x.dim() >= 1, "expected a tensor [..., H], got a scalar");
  const int64_t h = x.size(x.dim() - 1);
  return h == 0 ? 0 : x.numel() / h;
}

const char* activation_name(ops::GluActivation a) {
  switch (a) {
    case ops::GluActivation::Silu: return "silu";
    case ops::GluActivation::Gelu: return "gelu";
    case ops::GluActivation::GeluTanh: return "gelu_tanh";
  }
  return "silu";
}

const char* reduction_name(ops::Reduction r) {
  switch (r) {
    case ops::Reduction::Mean: return "mean";
    case ops::Reduction::Sum: return "sum";
    case ops::Reduction::None: return "none";
  }
  return "mean";
}

void ce_options(KernelArgs& a, const ops::CrossEntropyOptions& o) {
  a.integer("ignore_index", o.ignore_index).real("label_smoothing", o.label_smoothing).string("reduction", reduction_name(o.reduction));
}

double bytes(const Tensor& t) { return t.defined() ? static_cast<double>(t.numel() * dtype_size(t.dtype())) : 0.0; }

// A slot call's profile region ("RMSNorm forward", "Attention backward (reference)"): `flops` and
// `moved` (bytes read and written) are its floor's terms (core/profile.h).
#define KCPP_SLOT_REGION(pass, dev, flops, moved)                                                                      \
  const profile::Region kcpp_region_(layer_name(), dev, profile::enabled() ? (flops) : 0.0, profile::enabled() ? (moved) : 0.0, \
                                     kernel() ? pass : pass " (reference)")

// The loss as the slot returns it: f32, whatever the reference computed it in.
Tensor as_f32(const Tensor& t) { return t.dtype() == DType::f32 ? t : t.to(DType::f32); }

}  // namespace

// ---- RMSNorm -------------------------------------------------------------------------------------

RMSNorm::RMSNorm(Tensor w, ops::RMSNormOptions o) : Slot("RMSNorm", "RMSNorm/1"), weight(std::move(w)), options(o) {}

Tensor RMSNorm::forward(const Tensor& x, Saved* saved) {
  KCPP_SLOT_REGION("forward", x.device(), 0, 2 * bytes(x) + bytes(weight));
  if (kernel()) {
    Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
    Tensor rstd = saved ? Tensor::empty({rows_of(x)}, DType::f32, x.device()) : Tensor();
    KernelArgs a;
    a.tensor("x", x).tensor("weight", weight).real("eps", options.eps).real("offset", options.offset);
    a.string("casting", casting_name(options.casting)).tensor("y", y);
    if (saved) a.tensor("rstd", rstd);
    if (run_forward(a, x.device(), saved != nullptr)) {
      if (saved) *saved = {x, rstd};
      return y;
    }
  } else {
    count_reference();
  }
  ops::RMSNormForward f = ops::rms_norm_forward(x, weight, options);
  if (saved) *saved = {x, f.rstd};
  return f.y;
}

RMSNorm::Grads RMSNorm::backward(const Tensor& dy, const Saved& s) {
  KCPP_SLOT_REGION("backward", dy.device(), 0, 3 * bytes(dy) + 2 * bytes(weight));
  KCPP_CHECK(s.x.defined() && s.rstd.defined(), "RMSNorm backward: nothing saved (run forward with a Saved)");
  if (kernel()) {
    Grads g{Tensor::empty(s.x.shape(), s.x.dtype(), s.x.device()), Tensor::empty(weight.shape(), weight.dtype(), weight.device())};
    KernelArgs a;
    a.tensor("dy", dy).tensor("x", s.x).tensor("weight", weight).tensor("rstd", s.rstd).real("eps", options.eps);
    a.real("offset", options.offset).string("casting", casting_name(options.casting));
    a.tensor("dx", g.dx).tensor("dweight", g.dweight);
    if (run_backward(a, s.x.device())) return g;
  } else {
    count_reference();
  }
  ops::RMSNormBackward b = ops::rms_norm_backward(dy, s.x, weight, s.rstd, options);
  return {b.dx, b.dw};
}

// ---- Activation ------------------------------------------------------------------------------------

namespace {
const char* kind_name(Activation::Kind k) {
  switch (k) {
    case Activation::Kind::SiLU: return "SiLU";
    case Activation::Kind::GeLU: return "GeLU";
    case Activation::Kind::GeluTanh: return "GeluTanh";
    case Activation::Kind::FastGELU: return "FastGELU";
    case Activation::Kind::NewGELU: return "NewGELU";
    case Activation::Kind::QuickGELU: return "QuickGELU";
  }
  return "SiLU";
}
constexpr double kQuick = 1.702;
}  // namespace

Activation::Activation(Kind k) : Slot(kind_name(k), std::string(kind_name(k)) + "/1"), kind(k) {}

Activation::Kind Activation::parse(std::string_view a) {
  if (a == "silu" || a == "swish") return Kind::SiLU;
  if (a == "gelu") return Kind::GeLU;
  if (a == "gelu_pytorch_tanh") return Kind::GeluTanh;
  if (a == "gelu_fast") return Kind::FastGELU;
  if (a == "gelu_new") return Kind::NewGELU;
  if (a == "quick_gelu") return Kind::QuickGELU;
  KCPP_FAIL("hidden_act '{}' has no activation slot (silu, swish, gelu, gelu_pytorch_tanh, gelu_fast, gelu_new, quick_gelu)", a);
}

Tensor Activation::forward(const Tensor& x) {
  KCPP_SLOT_REGION("forward", x.device(), 0, 2 * bytes(x));
  if (kernel()) {
    Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
    KernelArgs a;
    a.tensor("x", x).tensor("y", y);
    if (run_forward(a, x.device())) return y;
  } else {
    count_reference();
  }
  switch (kind) {
    case Kind::SiLU: return ops::silu(x);
    case Kind::GeLU: return ops::gelu(x);
    case Kind::QuickGELU: return ops::mul(x, ops::sigmoid(ops::scale(x, kQuick)));
    default: return ops::gelu(x, /*tanh_approx=*/true);
  }
}

Tensor Activation::backward(const Tensor& dy, const Tensor& x) {
  KCPP_SLOT_REGION("backward", x.device(), 0, 3 * bytes(x));
  if (kernel()) {
    Tensor dx = Tensor::empty(x.shape(), x.dtype(), x.device());
    KernelArgs a;
    a.tensor("dy", dy).tensor("x", x).tensor("dx", dx);
    if (run_backward(a, x.device())) return dx;
  } else {
    count_reference();
  }
  switch (kind) {
    case Kind::SiLU: return ops::silu_backward(dy, x);
    case Kind::GeLU: return ops::gelu_backward(dy, x);
    case Kind::QuickGELU: {  // d/dx x s(1.702 x) = s (1 + 1.702 x (1 - s))
      const Tensor s = ops::sigmoid(ops::scale(x, kQuick));
      const Tensor one_minus = ops::add_scalar(ops::neg(s), 1.0);
      return ops::mul(dy, ops::mul(s, ops::add_scalar(ops::mul(ops::scale(x, kQuick), one_minus), 1.0)));
    }
    default: return ops::gelu_backward(dy, x, /*tanh_approx=*/true);
  }
}

// ---- MLP -----------------------------------------------------------------------------------------

MLP::MLP(ops::GluActivation a) : Slot("MLP", "GLU/1"), activation(a) {}

Tensor MLP::forward(const Tensor& gate, const Tensor& up) {
  KCPP_SLOT_REGION("forward", gate.device(), 0, 3 * bytes(gate));
  if (kernel()) {
    Tensor out = Tensor::empty(gate.shape(), gate.dtype(), gate.device());
    KernelArgs a;
    a.tensor("gate", gate).tensor("up", up).string("activation", activation_name(activation)).tensor("out", out);
    if (run_forward(a, gate.device())) return out;
  } else {
    count_reference();
  }
  return ops::glu_forward(gate, up, activation);
}

MLP::Grads MLP::backward(const Tensor& dh, const Tensor& gate, const Tensor& up) {
  KCPP_SLOT_REGION("backward", gate.device(), 0, 5 * bytes(gate));
  if (kernel()) {
    Grads g{Tensor::empty(gate.shape(), gate.dtype(), gate.device()), Tensor::empty(gate.shape(), gate.dtype(), gate.device())};
    KernelArgs a;
    a.tensor("dout", dh).tensor("gate", gate).tensor("up", up).string("activation", activation_name(activation));
    a.tensor("dgate", g.dgate).tensor("dup", g.dup);
    if (run_backward(a, gate.device())) return g;
  } else {
    count_reference();
  }
  ops::GluBackward b = ops::glu_backward(dh, gate, up, activation);
  return {b.dgate, b.dup};
}

// ---- RotaryEmbedding -------------------------------------------------------------------------------

RotaryEmbedding::RotaryEmbedding(ops::RopeLayout s) : Slot("rotary_pos_emb", "rotary_pos_emb/1"), style(s) {}

namespace {
const char* style_name(ops::RopeLayout s) { return s == ops::RopeLayout::Interleaved ? "interleaved" : "rotate_half"; }
}  // namespace

std::pair<Tensor, Tensor> RotaryEmbedding::forward(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin) {
  KCPP_SLOT_REGION("forward", q.device(), 0, 2 * (bytes(q) + bytes(k)));
  if (kernel()) {
    Tensor qo = Tensor::empty(q.shape(), q.dtype(), q.device());
    Tensor ko = k.defined() ? Tensor::empty(k.shape(), k.dtype(), k.device()) : Tensor();
    KernelArgs a;
    a.tensor("q", q).tensor("cos", cos).tensor("sin", sin).string("layout", "bhsd").string("style", style_name(style));
    a.tensor("q_out", qo);
    if (k.defined()) a.tensor("k", k).tensor("k_out", ko);
    if (run_forward(a, q.device())) return {qo, ko};
  } else {
    count_reference();
  }
  return {ops::rope_forward(q, cos, sin, style), k.defined() ? ops::rope_forward(k, cos, sin, style) : Tensor()};
}

std::pair<Tensor, Tensor> RotaryEmbedding::backward(const Tensor& dq_out, const Tensor& dk_out, const Tensor& cos,
                                                    const Tensor& sin) {
  KCPP_SLOT_REGION("backward", dq_out.device(), 0, 2 * (bytes(dq_out) + bytes(dk_out)));
  if (kernel()) {
    Tensor dq = Tensor::empty(dq_out.shape(), dq_out.dtype(), dq_out.device());
    Tensor dk = dk_out.defined() ? Tensor::empty(dk_out.shape(), dk_out.dtype(), dk_out.device()) : Tensor();
    KernelArgs a;
    a.tensor("dq_out", dq_out).tensor("cos", cos).tensor("sin", sin).string("layout", "bhsd").string("style", style_name(style));
    a.tensor("dq", dq);
    if (dk_out.defined()) a.tensor("dk_out", dk_out).tensor("dk", dk);
    if (run_backward(a, dq_out.device())) return {dq, dk};
  } else {
    count_reference();
  }
  return {ops::rope_backward(dq_out, cos, sin, style), dk_out.defined() ? ops::rope_backward(dk_out, cos, sin, style) : Tensor()};
}

// ---- Attention ---------------------------------------------------------------------------------------

Attention::Attention(ops::AttentionOptions o) : Slot("Attention", "Attention/1"), options(o) {}

namespace {
// The forward's multiply-adds of QK^T and PV (4 B Hq Sq Sk D flops), counting only the key positions
// the mask keeps: causal with the queries at the end of the keys, and the sliding window.
double attention_flops(const Tensor& q, const Tensor& k, const ops::AttentionOptions& o) {
  const int64_t sq = q.size(2), sk = k.size(2);
  double pairs = 0;
  for (int64_t i = 0; i < sq; ++i) {
    const int64_t last = o.causal ? sk - sq + i : sk - 1;  // the last key position query i sees
    const int64_t first = o.window > 0 ? std::max<int64_t>(0, last - o.window + 1) : 0;
    pairs += static_cast<double>(std::max<int64_t>(0, last - first + 1));
  }
  return 4.0 * q.size(0) * q.size(1) * pairs * q.size(3);
}

void attention_options(KernelArgs& a, const ops::AttentionOptions& o, int64_t head_dim) {
  a.real("scale", o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(head_dim)));
  a.integer("causal", o.causal ? 1 : 0).integer("window", o.window);
}
}  // namespace

Tensor Attention::forward(const Tensor& q, const Tensor& k, const Tensor& v, Saved* saved) {
  KCPP_SLOT_REGION("forward", q.device(), attention_flops(q, k, options), 0);
  if (kernel()) {
    Tensor out = Tensor::empty(q.shape(), q.dtype(), q.device());
    Tensor lse = saved ? Tensor::empty({q.size(0), q.size(1), q.size(2)}, DType::f32, q.device()) : Tensor();
    KernelArgs a;
    a.tensor("q", q).tensor("k", k).tensor("v", v).tensor("out", out);
    attention_options(a, options, q.size(3));
    if (saved) a.tensor("lse", lse);
    if (run_forward(a, q.device(), saved != nullptr)) {
      if (saved) *saved = {q, k, v, out, lse, {}};
      return out;
    }
  } else {
    count_reference();
  }
  ops::AttentionForward f = ops::attention_forward(q, k, v, options);
  Tensor out = f.out;
  if (saved) *saved = {q, k, v, out, Tensor(), std::move(f)};
  return out;
}

Attention::Grads Attention::backward(const Tensor& dout, const Saved& s) {
  KCPP_SLOT_REGION("backward", dout.device(), 2.5 * attention_flops(s.q, s.k, options), 0);
  KCPP_CHECK(s.q.defined(), "Attention backward: nothing saved (run forward with a Saved)");
  if (s.lse.defined()) {  // saved by a kernel: its backward recomputes the probabilities
    Grads g{Tensor::empty(s.q.shape(), s.q.dtype(), s.q.device()), Tensor::empty(s.k.shape(), s.k.dtype(), s.k.device()),
            Tensor::empty(s.v.shape(), s.v.dtype(), s.v.device())};
    KernelArgs a;
    a.tensor("dout", dout).tensor("q", s.q).tensor("k", s.k).tensor("v", s.v).tensor("out", s.out).tensor("lse", s.lse);
    attention_options(a, options, s.q.size(3));
    a.tensor("dq", g.dq).tensor("dk", g.dk).tensor("dv", g.dv);
    if (run_backward(a, s.q.device())) return g;
    // The kernel refused its own backward: the reference recomputes what it needs.
    const ops::AttentionForward f = ops::attention_forward(s.q, s.k, s.v, options);
    const ops::AttentionBackward b = ops::attention_backward(dout, s.q, s.k, s.v, f, options);
    return {b.dq, b.dk, b.dv};
  }
  count_reference();
  const ops::AttentionBackward b = ops::attention_backward(dout, s.q, s.k, s.v, s.reference, options);
  return {b.dq, b.dk, b.dv};
}

// ---- CrossEntropyLoss ------------------------------------------------------------------------------

CrossEntropyLoss::CrossEntropyLoss(ops::CrossEntropyOptions o) : Slot("CrossEntropyLoss", "CrossEntropyLoss/1"), options(o) {}

Tensor CrossEntropyLoss::forward(const Tensor& logits, const Tensor& targets, Saved* saved) {
  KCPP_SLOT_REGION("forward", logits.device(), 0, (saved ? 2 : 1) * bytes(logits));
  const int64_t rows = rows_of(logits);
  if (kernel()) {
    Tensor loss = Tensor::empty({options.reduction == ops::Reduction::None ? rows : 1}, DType::f32, logits.device());
    Tensor grad = saved ? Tensor::empty(logits.shape(), logits.dtype(), logits.device()) : Tensor();
    KernelArgs a;
    a.tensor("logits", logits).tensor("targets", targets).tensor("loss", loss);
    ce_options(a, options);
    if (saved) a.tensor("grad", grad);
    if (run_forward(a, logits.device(), saved != nullptr)) {
      if (saved) *saved = {targets, grad, Tensor()};
      return options.reduction == ops::Reduction::None ? loss : loss.view({});
    }
  } else {
    count_reference();
  }
  ops::CrossEntropyForward f = ops::cross_entropy_forward(logits, targets, options);
  if (saved) *saved = {targets, Tensor(), f.log_probs};
  return as_f32(f.loss);
}

Tensor CrossEntropyLoss::backward(double dloss, const Saved& s) {
  KCPP_SLOT_REGION("backward", (s.grad.defined() ? s.grad : s.log_probs).device(), 0, 0);
  KCPP_CHECK(options.reduction != ops::Reduction::None, "CrossEntropyLoss backward: reduction 'none' needs a per-row dloss");
  if (s.grad.defined()) {  // the kernel's gradient, for an upstream 1
    Tensor dlogits = s.grad;
    KernelArgs a;
    a.real("dloss", dloss).tensor("grad", s.grad).tensor("dlogits", dlogits);
    if (run_backward(a, s.grad.device())) return dlogits;
    return ops::scale(s.grad, dloss);  // the backward refused: the scaling is all there is to do
  }
  KCPP_CHECK(s.log_probs.defined(), "CrossEntropyLoss backward: nothing saved (run forward with a Saved)");
  count_reference();
  return ops::cross_entropy_backward(Tensor::full({}, dloss, s.log_probs.dtype(), s.log_probs.device()), s.log_probs,
                                     s.targets, options);
}

// ---- ForCausalLMLoss -------------------------------------------------------------------------------

ForCausalLMLoss::ForCausalLMLoss(ops::CrossEntropyOptions o) : Slot("ForCausalLMLoss", "ForCausalLMLoss/1"), options(o) {}

Tensor ForCausalLMLoss::forward(const Tensor& hidden, const Tensor& weight, const Tensor& targets, Saved* saved) {
  KCPP_SLOT_REGION("forward", hidden.device(), (saved ? 6.0 : 2.0) * rows_of(hidden) * weight.size(0) * weight.size(1), 0);
  if (kernel()) {
    const int64_t rows = rows_of(hidden);
    Tensor loss = Tensor::empty({options.reduction == ops::Reduction::None ? rows : 1}, DType::f32, hidden.device());
    Tensor dh = saved ? Tensor::empty(hidden.shape(), hidden.dtype(), hidden.device()) : Tensor();
    Tensor dw = saved ? Tensor::empty(weight.shape(), weight.dtype(), weight.device()) : Tensor();
    KernelArgs a;
    a.tensor("hidden", hidden).tensor("weight", weight).tensor("targets", targets).tensor("loss", loss);
    ce_options(a, options);
    if (saved) a.tensor("dhidden", dh).tensor("dweight", dw);
    if (run_forward(a, hidden.device(), saved != nullptr)) {
      if (saved) *saved = {hidden, weight, targets, dh, dw, Tensor()};
      return options.reduction == ops::Reduction::None ? loss : loss.view({});
    }
  } else {
    count_reference();
  }
  // As Transformers' ForCausalLMLoss: the logits in the model's dtype, upcast to f32 for the loss.
  const Tensor logits = ops::matmul(hidden.reshape({-1, hidden.size(-1)}), weight, false, true).to(DType::f32);
  ops::CrossEntropyForward f = ops::cross_entropy_forward(logits, targets, options);
  if (saved) *saved = {hidden, weight, targets, Tensor(), Tensor(), f.log_probs};
  return as_f32(f.loss);
}

ForCausalLMLoss::Grads ForCausalLMLoss::backward(double dloss, const Saved& s) {
  KCPP_SLOT_REGION("backward", (s.dhidden.defined() ? s.dhidden : s.hidden).device(), s.dhidden.defined() ? 0.0 : 4.0 * rows_of(s.hidden) * s.weight.size(0) * s.weight.size(1), 0);
  KCPP_CHECK(options.reduction != ops::Reduction::None, "ForCausalLMLoss backward: reduction 'none' needs a per-row dloss");
  if (s.dhidden.defined()) {  // the kernel's gradients, for an upstream 1
    KernelArgs a;
    a.real("dloss", dloss).tensor("dhidden", s.dhidden).tensor("dweight", s.dweight);
    if (!run_backward(a, s.dhidden.device()))
      return {ops::scale(s.dhidden, dloss), ops::scale(s.dweight, dloss)};
    return {s.dhidden, s.dweight};
  }
  KCPP_CHECK(s.log_probs.defined(), "ForCausalLMLoss backward: nothing saved (run forward with a Saved)");
  count_reference();
  const Tensor dlogits = ops::cross_entropy_backward(Tensor::full({}, dloss, s.log_probs.dtype(), s.log_probs.device()),
                                                     s.log_probs, s.targets, options)
                            .to(s.hidden.dtype());  // the upcast's backward
  const Tensor h2 = s.hidden.reshape({-1, s.hidden.size(-1)});
  return {ops::matmul(dlogits, s.weight).reshape(s.hidden.shape()), ops::matmul(dlogits, h2, true, false)};
}

}  // namespace kcpp::nn
