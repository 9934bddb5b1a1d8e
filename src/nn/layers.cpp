#include "nn/layers.h"

#include <algorithm>
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

MLP::Grads MLP::backward(const Tensor& dh, const Tensor& gate, const Tensor& up, bool packed) {
  KCPP_SLOT_REGION("backward", gate.device(), 0, 5 * bytes(gate));
  Grads g;
  if (packed) {
    Shape shape = gate.shape();
    const int64_t inter = shape.back();
    shape.back() = 2 * inter;
    g.packed = Tensor::empty(shape, gate.dtype(), gate.device());
    const int64_t last = static_cast<int64_t>(shape.size()) - 1;
    g.dgate = g.packed.narrow(last, 0, inter), g.dup = g.packed.narrow(last, inter, inter);
  } else if (kernel()) {
    g.dgate = Tensor::empty(gate.shape(), gate.dtype(), gate.device()), g.dup = Tensor::empty(gate.shape(), gate.dtype(), gate.device());
  }
  if (kernel()) {
    KernelArgs a;
    a.tensor("dout", dh).tensor("gate", gate).tensor("up", up).string("activation", activation_name(activation));
    a.tensor("dgate", g.dgate).tensor("dup", g.dup);
    if (run_backward(a, gate.device())) return g;
  } else {
    count_reference();
  }
  ops::GluBackward b = ops::glu_backward(dh, gate, up, activation);
  if (!packed) return {b.dgate, b.dup, Tensor()};
  g.dgate.copy_(b.dgate), g.dup.copy_(b.dup);
  return g;
}

// ---- MoE -----------------------------------------------------------------------------------------

MoE::MoE(Tensor rw, Tensor gu, Tensor dp, Options o, std::string layer_name)
    : Slot(std::move(layer_name), "MoE/1"), router_weight(std::move(rw)), gate_up_proj(std::move(gu)), down_proj(std::move(dp)), options(o) {
  KCPP_CHECK(router_weight.dim() == 2 && gate_up_proj.dim() == 3 && down_proj.dim() == 3,
             "MoE: router_weight must be [E, H], gate_up_proj [E, 2I, H], down_proj [E, H, I]");
  const int64_t e = router_weight.size(0), h = router_weight.size(1), i2 = gate_up_proj.size(1);
  KCPP_CHECK(gate_up_proj.size(0) == e && down_proj.size(0) == e,
             "MoE: expert count mismatch: router_weight has {} experts, gate_up_proj {}, down_proj {}", e, gate_up_proj.size(0),
             down_proj.size(0));
  KCPP_CHECK(i2 % 2 == 0 && gate_up_proj.size(2) == h && down_proj.size(1) == h && down_proj.size(2) == i2 / 2,
             "MoE: gate_up_proj [{}, {}, {}] and down_proj [{}, {}, {}] do not fit hidden {} (want [E, 2I, H] and [E, H, I])", e, i2,
             gate_up_proj.size(2), e, down_proj.size(1), down_proj.size(2), h);
  KCPP_CHECK(o.top_k >= 1 && o.top_k <= e, "MoE: top_k is {}; it must be in [1, {}] (the number of experts)", o.top_k, e);
}

void MoE::set_shared_expert(Tensor gu, Tensor dn, Tensor gate) {
  const int64_t h = router_weight.size(1);
  KCPP_CHECK(gu.dim() == 2 && dn.dim() == 2 && gu.size(0) % 2 == 0 && gu.size(1) == h && dn.size(0) == h &&
                 dn.size(1) == gu.size(0) / 2,
             "MoE: the shared expert's gate_up [{}] and down [{}] do not fit hidden {} (want [2Is, H] and [H, Is])",
             fmt::join(gu.shape(), ", "), fmt::join(dn.shape(), ", "), h);
  KCPP_CHECK(!gate.defined() || gate.numel() == h, "MoE: shared_expert_gate must have {} elements (the hidden size), has {}", h,
             gate.numel());
  shared_gate_up_proj = std::move(gu), shared_down_proj = std::move(dn), shared_expert_gate = std::move(gate);
}

namespace {

// Each row's top_k columns of values [R, E] (host), in descending order, ties to the lower index.
std::vector<int64_t> host_topk(const std::vector<double>& v, int64_t rows, int64_t e, int64_t k) {
  std::vector<int64_t> out(static_cast<size_t>(rows * k)), idx(static_cast<size_t>(e));
  for (int64_t r = 0; r < rows; ++r) {
    const double* row = v.data() + r * e;
    for (int64_t j = 0; j < e; ++j) idx[j] = j;
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                      [&](int64_t a, int64_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
    std::copy(idx.begin(), idx.begin() + k, out.begin() + r * k);
  }
  return out;
}

// Expert e's [rows, cols] matrix of a [E, rows, cols] stack.
// (A view of any strides: Llama 4's stacks are transposed views of its checkpoint's [E, H, 2I] / [E, I, H].)
Tensor expert(const Tensor& w, int64_t e) { return w.select(0, e); }

const char* routing_name(MoE::Routing r) { return r == MoE::Routing::Sigmoid ? "sigmoid" : "softmax"; }

// The tokens each expert received and the slots (t k + j) they came in, in slot order.
struct ExpertGroups {
  std::vector<std::vector<int64_t>> tokens, slots;
};
ExpertGroups group(const std::vector<double>& ids, int64_t k, int64_t experts) {
  ExpertGroups r;
  r.tokens.resize(static_cast<size_t>(experts)), r.slots.resize(static_cast<size_t>(experts));
  for (size_t s = 0; s < ids.size(); ++s) {
    const int64_t e = static_cast<int64_t>(ids[s]);
    if (e < 0 || e >= experts) continue;
    r.tokens[e].push_back(static_cast<int64_t>(s) / k), r.slots[e].push_back(static_cast<int64_t>(s));
  }
  return r;
}

}  // namespace

Tensor MoE::forward(const Tensor& hidden, Saved* saved, Tensor router_logits) {
  KCPP_CHECK(hidden.dim() == 2 && hidden.size(1) == router_weight.size(1), "MoE: hidden must be [T, {}]", router_weight.size(1));
  const int64_t t = hidden.size(0), e = router_weight.size(0), k = options.top_k, i = down_proj.size(2);
  const bool shared = shared_gate_up_proj.defined();
  const double is = shared ? static_cast<double>(shared_down_proj.size(1)) : 0.0;
  KCPP_SLOT_REGION("forward", hidden.device(), 2.0 * t * (e + 3.0 * k * i + 3.0 * is + (shared_expert_gate.defined() ? 1 : 0)) * hidden.size(1),
                   2 * bytes(hidden) + bytes(router_weight) + bytes(gate_up_proj) + bytes(down_proj) +
                       (shared ? bytes(shared_gate_up_proj) + bytes(shared_down_proj) : 0));
  if (!router_logits.defined()) router_logits = Tensor::empty({t, e}, hidden.dtype(), hidden.device());
  if (kernel()) {
    Tensor out = Tensor::empty(hidden.shape(), hidden.dtype(), hidden.device());
    Tensor ids = Tensor::empty({t, k}, DType::i32, hidden.device()), w = Tensor::empty({t, k}, DType::f32, hidden.device());
    Tensor offsets, sorted, gu;
    KernelArgs a;
    a.tensor("hidden", hidden).tensor("router_weight", router_weight).string("routing", routing_name(options.routing)).integer("top_k", k);
    a.string("apply_router_weight", options.weight_on_input ? "input" : "output");
    a.integer("normalize", options.normalize ? 1 : 0).string("activation", activation_name(options.activation));
    a.tensor("gate_up_proj", gate_up_proj).tensor("down_proj", down_proj).tensor("out", out).tensor("router_logits", router_logits);
    a.tensor("topk_ids", ids).tensor("topk_weights", w);
    if (shared) {
      a.tensor("shared_gate_up_proj", shared_gate_up_proj).tensor("shared_down_proj", shared_down_proj);
      if (shared_expert_gate.defined()) a.tensor("shared_expert_gate", shared_expert_gate);
    }
    if (saved) {
      offsets = Tensor::empty({e + 2}, DType::i32, hidden.device()), sorted = Tensor::empty({t * k}, DType::i32, hidden.device());
      gu = Tensor::empty({t * k, 2 * i}, hidden.dtype(), hidden.device());
      a.tensor("expert_offsets", offsets).tensor("sorted_slots", sorted).tensor("gate_up", gu);
    }
    if (run_forward(a, hidden.device(), saved != nullptr)) {
      if (saved) *saved = {hidden, router_logits, ids, w, offsets, sorted, gu, {}, {}, {}, {}, {}};
      return out;
    }
  } else {
    count_reference();
  }
  return reference_forward(hidden, saved, router_logits);
}

// Transformers' eager MoE: router, softmax in f32, top-k (renormalized), then each expert that
// received tokens runs its gated MLP on them and adds its weighted output to theirs.  Llama 4
// (Llama4TextMoe): the top-k logits, weights sigmoid(logit) in f32, each expert's input scaled by its
// weight and its output added as it is (Transformers runs every expert on every token, the others'
// inputs scaled by sigmoid(-inf) = 0, which adds exact zeros: only the chosen ones are run here).
Tensor MoE::reference_forward(const Tensor& hidden, Saved* saved, Tensor router_logits) {
  const int64_t t = hidden.size(0), e = router_weight.size(0), k = options.top_k, i = down_proj.size(2);
  const Device dev = hidden.device();
  router_logits.copy_(ops::matmul(hidden, router_weight, false, true));
  const bool sigmoid = options.routing == Routing::Sigmoid, on_input = options.weight_on_input;
  const std::vector<double> p = sigmoid ? router_logits.to(DType::f32).to_f64_vector()
                                        : ops::softmax(router_logits.to(DType::f32)).to_f64_vector();
  const std::vector<int64_t> top = host_topk(p, t, e, k);
  std::vector<double> ids(top.begin(), top.end()), w(static_cast<size_t>(t * k));
  for (int64_t r = 0; r < t && sigmoid; ++r)
    for (int64_t j = 0; j < k; ++j) w[r * k + j] = 1.0f / (1.0f + std::exp(-static_cast<float>(p[r * e + top[r * k + j]])));
  for (int64_t r = 0; r < t && !sigmoid; ++r) {
    float sum = 0;  // in f32, as torch sums the chosen probabilities
    for (int64_t j = 0; j < k; ++j) sum += static_cast<float>(p[r * e + top[r * k + j]]);
    for (int64_t j = 0; j < k; ++j) {
      const float pj = static_cast<float>(p[r * e + top[r * k + j]]);
      w[r * k + j] = options.normalize ? pj / sum : pj;
    }
  }
  const ExpertGroups g = group(ids, k, e);
  Tensor out = Tensor::zeros(hidden.shape(), hidden.dtype(), dev);
  for (int64_t x = 0; x < e; ++x) {
    const auto& tok = g.tokens[x];
    const int64_t n = static_cast<int64_t>(tok.size());
    if (n == 0) continue;
    std::vector<double> wx(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) wx[j] = w[g.slots[x][j]];
    const Tensor tokens = Tensor::from_i64(tok, {n}, DType::i64, dev);
    const Tensor wcol = Tensor::from_f64(wx, {n, 1}, DType::f32, dev);
    Tensor xs = ops::embedding(hidden, tokens);
    if (on_input) xs = ops::mul(xs.to(DType::f32), wcol).to(hidden.dtype());  // routed_in = hidden * score
    const Tensor gu = ops::matmul(xs, expert(gate_up_proj, x), false, true);
    const Tensor h = ops::glu_forward(gu.narrow(1, 0, i).contiguous(), gu.narrow(1, i, i).contiguous(), options.activation);
    const Tensor y = ops::matmul(h, expert(down_proj, x), false, true);
    const Tensor yw = on_input ? y : ops::mul(y.to(DType::f32), wcol).to(hidden.dtype());
    out = ops::add(out, ops::embedding_backward(yw, tokens, t));
  }
  if (saved)
    *saved = {hidden, router_logits, Tensor::from_f64(ids, {t, k}, DType::i32, dev), Tensor::from_f64(w, {t, k}, DType::f32, dev),
              {}, {}, {}, {}, {}, {}, {}, {}};
  // Qwen2MoeSparseMoeBlock: expert_output + sigmoid(shared_expert_gate(x)) * shared_expert(x).
  if (shared_gate_up_proj.defined()) out = ops::add(out, shared_forward(hidden, saved));
  return out;
}

// The shared expert as Qwen2MoeMLP (down(act(gate(x)) * up(x)); gate and up here one GEMM, the same
// dot products), scaled by F.sigmoid(F.linear(x, shared_expert_gate)) when there is a gate.
Tensor MoE::shared_forward(const Tensor& hidden, Saved* saved) const {
  const int64_t h = hidden.size(1), is = shared_down_proj.size(1);
  const Tensor gu = ops::matmul(hidden, shared_gate_up_proj, false, true);  // [T, 2Is]
  const Tensor g = gu.narrow(1, 0, is).contiguous(), u = gu.narrow(1, is, is).contiguous();
  const Tensor act = ops::glu_forward(g, u, options.activation);
  const Tensor m = ops::matmul(act, shared_down_proj, false, true);  // [T, H]
  Tensor sigma;
  if (shared_expert_gate.defined()) sigma = ops::sigmoid(ops::matmul(hidden, shared_expert_gate.view({1, h}), false, true));  // [T, 1]
  if (saved) saved->shared_gate = g, saved->shared_up = u, saved->shared_h = act, saved->shared_out = m, saved->shared_sigma = sigma;
  return sigma.defined() ? ops::mul(sigma, m) : m;
}

// The shared expert's backward: an MLP with upstream gradient sigma dout, and the gate's logit
// getting (dout . m) sigma (1 - sigma) (autograd's mul and sigmoid backward).
void MoE::shared_backward(const Tensor& dout, const Saved& s, Grads& g) const {
  Saved recomputed;
  const Saved* sp = &s;
  if (!s.shared_h.defined()) {  // a kernel's forward, whose backward was refused: recompute the activations
    (void)shared_forward(s.hidden, &recomputed);
    sp = &recomputed;
  }
  const Saved& r = *sp;
  const Tensor& x = s.hidden;
  const int64_t h = x.size(1);
  const Tensor dm = r.shared_sigma.defined() ? ops::mul(dout, r.shared_sigma) : dout;  // [T, H]
  g.dshared_down_proj = ops::matmul(dm, r.shared_h, true, false);                         // [H, Is]
  const ops::GluBackward gb = ops::glu_backward(ops::matmul(dm, shared_down_proj), r.shared_gate, r.shared_up, options.activation);
  const Tensor dgu = ops::cat({gb.dgate, gb.dup}, 1);                                     // [T, 2Is]
  g.dshared_gate_up_proj = ops::matmul(dgu, x, true, false);                              // [2Is, H]
  Tensor dx = ops::matmul(dgu, shared_gate_up_proj);
  if (r.shared_sigma.defined()) {
    const DType dt = x.dtype();
    const Tensor dsigma = ops::sum(ops::mul(dout, r.shared_out), true).to(DType::f32);     // [T, 1]
    const Tensor sig = r.shared_sigma.to(DType::f32);
    const Tensor dl = ops::mul(dsigma, ops::mul(sig, ops::add_scalar(ops::neg(sig), 1.0))).to(dt);
    g.dshared_expert_gate = ops::matmul(dl, x, true, false).view(shared_expert_gate.shape());  // [1, H]
    dx = ops::add(dx, ops::matmul(dl, shared_expert_gate.view({1, h})));
  }
  g.dhidden = ops::add(g.dhidden, dx);
}

MoE::Grads MoE::backward(const Tensor& dout, const Saved& s, const Tensor& drouter_logits, bool last_use) {
  KCPP_CHECK(s.hidden.defined() && s.router_logits.defined() && s.topk_ids.defined(), "MoE backward: nothing saved (run forward with a Saved)");
  const int64_t t = s.hidden.size(0), e = router_weight.size(0), k = options.top_k, i = down_proj.size(2);
  const bool shared = shared_gate_up_proj.defined();
  const double is = shared ? static_cast<double>(shared_down_proj.size(1)) : 0.0;
  KCPP_SLOT_REGION("backward", dout.device(), 4.0 * t * (e + 3.0 * k * i + 3.0 * is + (shared_expert_gate.defined() ? 1 : 0)) * s.hidden.size(1),
                   3 * bytes(dout) + 2 * (bytes(router_weight) + bytes(gate_up_proj) + bytes(down_proj)) +
                       (shared ? 2 * (bytes(shared_gate_up_proj) + bytes(shared_down_proj)) : 0));
  // A kernel's backward needs its own forward's permutation; after a reference forward, the reference.
  if (kernel() && s.expert_offsets.defined()) {
    const Device dev = dout.device();
    Grads g{Tensor::empty(s.hidden.shape(), s.hidden.dtype(), dev), Tensor::empty(router_weight.shape(), router_weight.dtype(), dev),
            Tensor::empty(gate_up_proj.shape(), gate_up_proj.dtype(), dev), Tensor::empty(down_proj.shape(), down_proj.dtype(), dev),
            {}, {}, {}};
    KernelArgs a;
    a.tensor("dout", dout).tensor("hidden", s.hidden).tensor("router_weight", router_weight).string("routing", routing_name(options.routing));
    a.string("apply_router_weight", options.weight_on_input ? "input" : "output");
    a.integer("top_k", k).integer("normalize", options.normalize ? 1 : 0).string("activation", activation_name(options.activation));
    a.tensor("gate_up_proj", gate_up_proj).tensor("down_proj", down_proj);
    a.tensor("router_logits", s.router_logits).tensor("topk_ids", s.topk_ids).tensor("topk_weights", s.topk_weights);
    a.tensor("expert_offsets", s.expert_offsets).tensor("sorted_slots", s.sorted_slots);
    if (s.gate_up.defined()) {
      a.tensor("gate_up", s.gate_up);
      if (last_use) a.integer("overwrite_gate_up", 1);  // dead after this call: the package may put dgate_up there
    }
    if (drouter_logits.defined()) a.tensor("drouter_logits", drouter_logits);
    a.tensor("dhidden", g.dhidden).tensor("drouter_weight", g.drouter_weight).tensor("dgate_up_proj", g.dgate_up_proj);
    a.tensor("ddown_proj", g.ddown_proj);
    if (shared) {
      g.dshared_gate_up_proj = Tensor::empty(shared_gate_up_proj.shape(), shared_gate_up_proj.dtype(), dev);
      g.dshared_down_proj = Tensor::empty(shared_down_proj.shape(), shared_down_proj.dtype(), dev);
      a.tensor("shared_gate_up_proj", shared_gate_up_proj).tensor("shared_down_proj", shared_down_proj);
      a.tensor("dshared_gate_up_proj", g.dshared_gate_up_proj).tensor("dshared_down_proj", g.dshared_down_proj);
      if (shared_expert_gate.defined()) {
        g.dshared_expert_gate = Tensor::empty(shared_expert_gate.shape(), shared_expert_gate.dtype(), dev);
        a.tensor("shared_expert_gate", shared_expert_gate).tensor("dshared_expert_gate", g.dshared_expert_gate);
      }
    }
    if (run_backward(a, dev)) return g;
  } else {
    count_reference();
  }
  return reference_backward(dout, s, drouter_logits);
}

MoE::Grads MoE::reference_backward(const Tensor& dout, const Saved& s, const Tensor& drouter_logits) {
  const Tensor& x = s.hidden;
  const int64_t t = x.size(0), e = router_weight.size(0), k = options.top_k, i = down_proj.size(2);
  const Device dev = x.device();
  const DType dt = x.dtype();
  const std::vector<double> ids = s.topk_ids.to_f64_vector(), w = s.topk_weights.to_f64_vector();
  const bool sigmoid = options.routing == Routing::Sigmoid, on_input = options.weight_on_input;
  const std::vector<double> p = sigmoid ? std::vector<double>() : ops::softmax(s.router_logits.to(DType::f32)).to_f64_vector();
  const ExpertGroups rt = group(ids, k, e);
  const Tensor dy = dout.contiguous().view({t, x.size(1)});
  Grads g{Tensor::zeros(x.shape(), dt, dev), {}, Tensor::zeros(gate_up_proj.shape(), gate_up_proj.dtype(), dev),
          Tensor::zeros(down_proj.shape(), down_proj.dtype(), dev), {}, {}, {}};
  std::vector<double> dw(static_cast<size_t>(t * k), 0.0);
  for (int64_t xe = 0; xe < e; ++xe) {
    const auto& tok = rt.tokens[xe];
    const int64_t n = static_cast<int64_t>(tok.size());
    if (n == 0) continue;
    std::vector<double> wx(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) wx[j] = w[rt.slots[xe][j]];
    const Tensor tokens = Tensor::from_i64(tok, {n}, DType::i64, dev);
    const Tensor wcol = Tensor::from_f64(wx, {n, 1}, DType::f32, dev);
    const Tensor x0 = ops::embedding(x, tokens);                                            // the tokens' hidden
    const Tensor xs = on_input ? ops::mul(x0.to(DType::f32), wcol).to(dt) : x0;             // the experts' input
    const Tensor gu = ops::matmul(xs, expert(gate_up_proj, xe), false, true);
    const Tensor gate = gu.narrow(1, 0, i).contiguous(), up = gu.narrow(1, i, i).contiguous();
    const Tensor h = ops::glu_forward(gate, up, options.activation);
    const Tensor de = ops::embedding(dy, tokens);                                          // dout of its tokens
    const Tensor q = ops::matmul(de, expert(down_proj, xe));                              // [n, I]
    if (on_input) {
      // y = expert(w x): the output unscaled, dx_s = [dg, du] W_gu, dw = dx_s . x, dhidden += w dx_s.
      expert(g.ddown_proj, xe).copy_(ops::matmul(de, h, true, false));
      const ops::GluBackward gb = ops::glu_backward(q, gate, up, options.activation);
      const Tensor dgu = ops::cat({gb.dgate, gb.dup}, 1);
      expert(g.dgate_up_proj, xe).copy_(ops::matmul(dgu, xs, true, false));
      const Tensor dxs = ops::matmul(dgu, expert(gate_up_proj, xe));                       // [n, H]
      const std::vector<double> dws = ops::sum(ops::mul(dxs.to(DType::f32), x0.to(DType::f32))).to_f64_vector();
      for (int64_t j = 0; j < n; ++j) dw[rt.slots[xe][j]] = dws[j];
      g.dhidden = ops::add(g.dhidden, ops::embedding_backward(ops::mul(dxs.to(DType::f32), wcol).to(dt), tokens, t));
      continue;
    }
    const std::vector<double> dws = ops::sum(ops::mul(q.to(DType::f32), h.to(DType::f32))).to_f64_vector();
    for (int64_t j = 0; j < n; ++j) dw[rt.slots[xe][j]] = dws[j];
    const Tensor dyw = ops::mul(de.to(DType::f32), wcol).to(dt);
    expert(g.ddown_proj, xe).copy_(ops::matmul(dyw, h, true, false));
    const ops::GluBackward gb = ops::glu_backward(ops::mul(q.to(DType::f32), wcol).to(dt), gate, up, options.activation);
    const Tensor dgu = ops::cat({gb.dgate, gb.dup}, 1);
    expert(g.dgate_up_proj, xe).copy_(ops::matmul(dgu, xs, true, false));
    g.dhidden = ops::add(g.dhidden, ops::embedding_backward(ops::matmul(dgu, expert(gate_up_proj, xe)), tokens, t));
  }
  // The routing weights' gradient into the logits' (softmax, with the top-k renormalization).
  std::vector<double> dz(static_cast<size_t>(t * e), 0.0);
  for (int64_t r = 0; r < t; ++r) {
    if (sigmoid) {  // w = sigmoid(z) of the chosen logits
      for (int64_t j = 0; j < k; ++j)
        dz[r * e + static_cast<int64_t>(ids[r * k + j])] = dw[r * k + j] * w[r * k + j] * (1.0 - w[r * k + j]);
      continue;
    }
    const double* pr = p.data() + r * e;
    if (options.normalize) {
      double c = 0;
      for (int64_t j = 0; j < k; ++j) c += w[r * k + j] * dw[r * k + j];
      for (int64_t j = 0; j < k; ++j) dz[r * e + static_cast<int64_t>(ids[r * k + j])] = w[r * k + j] * (dw[r * k + j] - c);
    } else {
      double dot = 0;
      for (int64_t j = 0; j < k; ++j) dot += pr[static_cast<int64_t>(ids[r * k + j])] * dw[r * k + j];
      for (int64_t c = 0; c < e; ++c) dz[r * e + c] = -pr[c] * dot;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t c = static_cast<int64_t>(ids[r * k + j]);
        dz[r * e + c] += pr[c] * dw[r * k + j];
      }
    }
  }
  Tensor dzt = Tensor::from_f64(dz, {t, e}, DType::f32, dev);
  if (drouter_logits.defined()) dzt = ops::add(dzt, drouter_logits.contiguous().view({t, e}).to(DType::f32));
  dzt = dzt.to(dt);
  g.drouter_weight = ops::matmul(dzt, x, true, false);
  g.dhidden = ops::add(g.dhidden, ops::matmul(dzt, router_weight));
  if (shared_gate_up_proj.defined()) shared_backward(dy, s, g);
  return g;
}

LoadBalancingLoss load_balancing_loss(const Tensor& logits, int64_t top_k, double grad_scale) {
  KCPP_CHECK(logits.dim() == 2, "load_balancing_loss: router_logits must be [rows, experts]");
  const int64_t r = logits.size(0), e = logits.size(1);
  KCPP_CHECK(top_k >= 1 && top_k <= e, "load_balancing_loss: top_k is {}; it must be in [1, {}]", top_k, e);
  // softmax in f32, rounded to the logits' dtype (Transformers' softmax in that dtype).
  const std::vector<double> p = ops::softmax(logits.to(DType::f32)).to(logits.dtype()).to_f64_vector();
  const std::vector<int64_t> top = host_topk(p, r, e, top_k);
  std::vector<double> f(static_cast<size_t>(e), 0.0), pm(static_cast<size_t>(e), 0.0);
  for (int64_t x : top) f[x] += 1.0;
  for (int64_t row = 0; row < r; ++row)
    for (int64_t c = 0; c < e; ++c) pm[c] += p[row * e + c];
  double loss = 0;
  for (int64_t c = 0; c < e; ++c) f[c] /= static_cast<double>(r), pm[c] /= static_cast<double>(r), loss += f[c] * pm[c];
  loss *= static_cast<double>(e);
  std::vector<double> dz(static_cast<size_t>(r * e));
  for (int64_t row = 0; row < r; ++row) {
    const double* pr = p.data() + row * e;
    double dot = 0;
    for (int64_t c = 0; c < e; ++c) dot += pr[c] * grad_scale * e * f[c] / r;
    for (int64_t c = 0; c < e; ++c) dz[row * e + c] = pr[c] * (grad_scale * e * f[c] / r - dot);
  }
  return {Tensor::from_f64(std::vector<double>{loss}, {}, DType::f32, logits.device()),
          Tensor::from_f64(dz, {r, e}, DType::f32, logits.device())};
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
    int64_t first = o.window > 0 ? std::max<int64_t>(0, last - o.window + 1) : 0;
    if (o.chunk > 0) first = std::max(first, last / o.chunk * o.chunk);
    pairs += static_cast<double>(std::max<int64_t>(0, last - first + 1));
  }
  return 4.0 * q.size(0) * q.size(1) * pairs * q.size(3);
}

// Attention/1 has no chunk argument: chunked layers keep to the reference.
constexpr const char* kChunkRefusal = "chunked attention (Llama 4's attention_chunk_size) is not part of Attention/1: the reference runs";

void attention_options(KernelArgs& a, const ops::AttentionOptions& o, int64_t head_dim) {
  a.real("scale", o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(head_dim)));
  a.integer("causal", o.causal ? 1 : 0).integer("window", o.window);
  if (o.softcap > 0) a.real("softcap", o.softcap);
}
}  // namespace

Tensor Attention::forward(const Tensor& q, const Tensor& k, const Tensor& v, Saved* saved, const Tensor& out_into) {
  KCPP_SLOT_REGION("forward", q.device(), attention_flops(q, k, options), 0);
  if (out_into.defined())
    KCPP_CHECK(out_into.shape() == q.shape() && out_into.dtype() == q.dtype() && out_into.device() == q.device(),
               "Attention: `out` must have q's shape, dtype and device");
  if (options.chunk > 0) {
    count_refusal(kChunkRefusal);
  } else if (kernel()) {
    Tensor out = out_into.defined() ? out_into : Tensor::empty(q.shape(), q.dtype(), q.device());
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
  if (out_into.defined()) {
    Tensor target = out_into;
    target.copy_(out);
    out = target;
  }
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
  if (options.chunk > 0) count_refusal(kChunkRefusal);
  else count_reference();
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

ForCausalLMLoss::ReductionScope::ReductionScope(ForCausalLMLoss& slot, ops::Reduction reduction)
    : slot_(slot), saved_(slot.options.reduction) {
  KCPP_CHECK(reduction != ops::Reduction::None, "loss_and_gradients: reduction 'none' has no scalar loss to differentiate");
  slot.options.reduction = reduction;
}

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
