#include "models/causal_lm.h"

#include <fmt/format.h>

#include <cmath>
#include <numbers>

#include "core/error.h"
#include "models/safetensors.h"
#include "ops/nn/attention.h"
#include "ops/ops.h"

namespace kcpp::models {

namespace {

Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b = {}) {
  Tensor y = ops::matmul(x, w, false, true);
  return b.defined() ? ops::add(y, b) : y;
}

ops::GluActivation glu_activation(const std::string& act) {
  if (act == "silu") return ops::GluActivation::Silu;
  if (act == "gelu") return ops::GluActivation::Gelu;
  return ops::GluActivation::GeluTanh;  // gelu_pytorch_tanh, gelu_new, gelu_fast (config.cpp admits no other)
}

}  // namespace

std::unique_ptr<CausalLM> CausalLM::from_folder(const std::filesystem::path& folder, DType dtype, Device device) {
  std::unique_ptr<CausalLM> m(new CausalLM());
  m->cfg_ = ModelConfig::from_folder(folder);
  m->dtype_ = dtype;
  m->device_ = device;
  const ModelConfig& c = m->cfg_;
  const WeightStore w = WeightStore::open_folder(folder);
  auto load = [&](const std::string& name, std::vector<int64_t> shape) { return w.load(name, dtype, device, &shape); };
  const int64_t h = c.hidden_size, d = c.head_dim, q = c.num_attention_heads * d, kv = c.num_key_value_heads * d;
  const int64_t inter = c.intermediate_size;
  ops::RMSNormOptions norm;
  norm.eps = c.rms_norm_eps;
  norm.offset = c.norm_offset;
  norm.casting = c.model_type == "gemma" ? ops::RMSNormCasting::Gemma : ops::RMSNormCasting::Llama;
  m->embed_ = load("model.embed_tokens.weight", {c.vocab_size, h});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    Layer l;
    l.input_norm = std::make_unique<nn::RMSNorm>(load(p + "input_layernorm.weight", {h}), norm);
    l.post_norm = std::make_unique<nn::RMSNorm>(load(p + "post_attention_layernorm.weight", {h}), norm);
    if (c.fused_qkv) {
      l.wqkv = load(p + "self_attn.qkv_proj.weight", {q + 2 * kv, h});
    } else {
      l.wq = load(p + "self_attn.q_proj.weight", {q, h});
      l.wk = load(p + "self_attn.k_proj.weight", {kv, h});
      l.wv = load(p + "self_attn.v_proj.weight", {kv, h});
      if (c.qkv_bias_only || c.attention_bias) {
        l.bq = load(p + "self_attn.q_proj.bias", {q});
        l.bk = load(p + "self_attn.k_proj.bias", {kv});
        l.bv = load(p + "self_attn.v_proj.bias", {kv});
      }
    }
    l.wo = load(p + "self_attn.o_proj.weight", {h, q});
    if (c.qk_norm) {
      l.q_norm = std::make_unique<nn::RMSNorm>(load(p + "self_attn.q_norm.weight", {d}), norm);
      l.k_norm = std::make_unique<nn::RMSNorm>(load(p + "self_attn.k_norm.weight", {d}), norm);
    }
    if (c.fused_gate_up) {
      l.w_gate_up = load(p + "mlp.gate_up_proj.weight", {2 * inter, h});
    } else {
      l.w_gate = load(p + "mlp.gate_proj.weight", {inter, h});
      l.w_up = load(p + "mlp.up_proj.weight", {inter, h});
    }
    l.w_down = load(p + "mlp.down_proj.weight", {h, inter});
    l.rope = std::make_unique<nn::RotaryEmbedding>();
    l.mlp = std::make_unique<nn::MLP>(glu_activation(c.hidden_act));
    m->layers_.push_back(std::move(l));
  }
  m->final_norm_ = std::make_unique<nn::RMSNorm>(load("model.norm.weight", {h}), norm);
  m->lm_head_ = c.tie_word_embeddings ? m->embed_ : load("lm_head.weight", {c.vocab_size, h});
  m->loss_ = std::make_unique<nn::ForCausalLMLoss>();
  return m;
}

void CausalLM::visit_slots(const std::function<void(nn::Slot&)>& fn) {
  for (Layer& l : layers_) {
    fn(*l.input_norm);
    if (l.q_norm) fn(*l.q_norm), fn(*l.k_norm);
    fn(*l.rope);
    fn(*l.post_norm);
    fn(*l.mlp);
  }
  fn(*final_norm_);
  fn(*loss_);
}

// inv_freq [rd / 2] in f32, by the config's RoPE scaling (Transformers' rope_init functions).
Tensor CausalLM::inv_freq(int64_t seq_len) const {
  const ModelConfig& c = cfg_;
  const int64_t rd = c.rotary_dim();
  const RopeScaling& rs = c.rope_scaling;
  double base = c.rope_theta;
  if (rs.type == RopeScaling::Type::Dynamic) {
    const int64_t orig = rs.original_max_position_embeddings ? rs.original_max_position_embeddings : c.max_position_embeddings;
    if (seq_len > orig)
      base *= std::pow(rs.factor * static_cast<double>(seq_len) / static_cast<double>(orig) - (rs.factor - 1.0),
                       static_cast<double>(rd) / static_cast<double>(rd - 2));
  }
  std::vector<double> f(static_cast<size_t>(rd / 2));
  for (int64_t i = 0; i < rd / 2; ++i) {
    // In f32 as Transformers computes it: base ** (2i / rd), then its reciprocal.
    const float expo = static_cast<float>(2 * i) / static_cast<float>(rd);
    f[i] = 1.0f / std::pow(static_cast<float>(base), expo);
  }
  if (rs.type == RopeScaling::Type::Linear) {
    for (double& x : f) x = static_cast<float>(x / rs.factor);
  } else if (rs.type == RopeScaling::Type::Llama3) {
    const double old = static_cast<double>(rs.original_max_position_embeddings);
    const double low_wavelen = old / rs.low_freq_factor, high_wavelen = old / rs.high_freq_factor;
    for (double& x : f) {
      const double wavelen = 2 * std::numbers::pi / x;
      double y = wavelen > low_wavelen ? x / rs.factor : x;
      if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) {
        const double smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor);
        y = (1 - smooth) * y / rs.factor + smooth * y;
      }
      x = static_cast<float>(y);
    }
  }
  return Tensor::from_f64(f, {rd / 2}, DType::f32, device_);
}

Tensor CausalLM::hidden_states(const Tensor& ids) {
  KCPP_CHECK(ids.dim() == 2, "CausalLM: input_ids must be [batch, seq], got {} dims", ids.dim());
  const ModelConfig& c = cfg_;
  const int64_t b = ids.size(0), s = ids.size(1), hdim = c.hidden_size, d = c.head_dim;
  const int64_t hq = c.num_attention_heads, hkv = c.num_key_value_heads;
  Tensor h = ops::embedding(embed_, ids.device() == device_ ? ids : ids.to(device_));
  if (c.scale_embeddings)  // Gemma: times sqrt(hidden) rounded to the model's dtype, as Transformers does
    h = ops::scale(h, Tensor::full({}, std::sqrt(static_cast<double>(hdim)), dtype_, Device::cpu()).item());
  std::vector<int64_t> pos(static_cast<size_t>(b * s));
  for (int64_t i = 0; i < b * s; ++i) pos[i] = i % s;
  const ops::RopeCosSin cs = ops::rope_cos_sin(Tensor::from_i64(pos, {b, s}, DType::i64, device_), inv_freq(s), 1.0, dtype_);
  ops::AttentionOptions attn;
  attn.scale = 1.0 / std::sqrt(static_cast<double>(d));
  attn.causal = true;
  attn.window = c.sliding_window && c.model_type == "mistral" ? *c.sliding_window : 0;
  auto heads = [&](const Tensor& x, int64_t n) { return x.contiguous().view({b, s, n, d}); };
  for (Layer& l : layers_) {
    const Tensor a = l.input_norm->forward(h).view({b * s, hdim});
    Tensor q, k, v;
    if (l.wqkv.defined()) {
      const Tensor qkv = linear(a, l.wqkv);
      q = qkv.narrow(1, 0, hq * d), k = qkv.narrow(1, hq * d, hkv * d), v = qkv.narrow(1, (hq + hkv) * d, hkv * d);
    } else {
      q = linear(a, l.wq, l.bq), k = linear(a, l.wk, l.bk), v = linear(a, l.wv, l.bv);
    }
    q = heads(q, hq), k = heads(k, hkv), v = heads(v, hkv);
    if (l.q_norm) q = l.q_norm->forward(q), k = l.k_norm->forward(k);
    q = q.transpose(1, 2).contiguous(), k = k.transpose(1, 2).contiguous(), v = v.transpose(1, 2).contiguous();
    std::tie(q, k) = l.rope->forward(q, k, cs.cos, cs.sin);
    const Tensor o = ops::attention_forward(q, k, v, attn).out.transpose(1, 2).contiguous().view({b * s, hq * d});
    h = ops::add(h, linear(o, l.wo).view({b, s, hdim}));
    const Tensor m = l.post_norm->forward(h).view({b * s, hdim});
    Tensor gate, up;
    if (l.w_gate_up.defined()) {
      const Tensor gu = linear(m, l.w_gate_up);
      const int64_t inter = c.intermediate_size;
      gate = gu.narrow(1, 0, inter).contiguous(), up = gu.narrow(1, inter, inter).contiguous();
    } else {
      gate = linear(m, l.w_gate), up = linear(m, l.w_up);
    }
    h = ops::add(h, linear(l.mlp->forward(gate, up), l.w_down).view({b, s, hdim}));
  }
  return final_norm_->forward(h);
}

Tensor CausalLM::forward(const Tensor& ids) {
  const Tensor h = hidden_states(ids);
  const int64_t b = ids.size(0), s = ids.size(1);
  return ops::matmul(h.view({b * s, cfg_.hidden_size}), lm_head_, false, true).view({b, s, cfg_.vocab_size});
}

Tensor CausalLM::loss(const Tensor& ids, const Tensor& labels) {
  KCPP_CHECK(labels.shape() == ids.shape(), "CausalLM::loss: labels [{}] must match input_ids [{}]", fmt::join(labels.shape(), ", "),
             fmt::join(ids.shape(), ", "));
  const int64_t b = ids.size(0), s = ids.size(1);
  // ForCausalLMLoss's shift: position t predicts label t + 1; the last position of each row has none.
  const auto lv = labels.to_f64_vector();
  std::vector<int64_t> shifted(static_cast<size_t>(b * s), -100);
  for (int64_t i = 0; i < b; ++i)
    for (int64_t t = 0; t + 1 < s; ++t) shifted[i * s + t] = static_cast<int64_t>(lv[i * s + t + 1]);
  const Tensor h = hidden_states(ids).view({b * s, cfg_.hidden_size});
  return loss_->forward(h, lm_head_, Tensor::from_i64(shifted, {b * s}, DType::i64, device_));
}

}  // namespace kcpp::models
