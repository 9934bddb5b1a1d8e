#include "models/causal_lm.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <map>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numbers>
#include <numeric>

#include "core/cuda_graph.h"
#include "core/pending_copy.h"
#include "nn/module.h"
#include "core/error.h"
#include "core/profile.h"
#include "core/random.h"
#include "models/safetensors.h"
#include "ops/nn/attention.h"
#include "ops/nn/decode_attention.h"
#include "ops/nn/decode_persistent.h"
#include "ops/nn/decode_fused.h"
#include "ops/nn/sampling.h"
#include "ops/check.h"
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

// Writes k, v [B, Hkv, S, D] at positions length .. length + S - 1 of the cache storage ck, cv
// [B, Hkv, capacity, D] (allocated, or doubled and copied, when too small; `reserve` positions at
// least) and returns the views of the positions 0 .. length + S - 1.
std::pair<Tensor, Tensor> append_to_cache(Tensor& ck, Tensor& cv, const Tensor& k, const Tensor& v, int64_t length,
                                          int64_t reserve) {
  const int64_t b = k.size(0), h = k.size(1), s = k.size(2), d = k.size(3), need = length + s;
  KCPP_CHECK(!ck.defined() || ck.size(0) == b, "CausalLM: the cache holds batch {}, the input is batch {}", ck.size(0), b);
  if (!ck.defined() || ck.size(2) < need) {
    const int64_t cap = std::max({need, reserve, ck.defined() ? 2 * ck.size(2) : int64_t{0}});
    Tensor nk = Tensor::empty({b, h, cap, d}, k.dtype(), k.device()), nv = Tensor::empty({b, h, cap, d}, v.dtype(), v.device());
    if (length > 0) {
      nk.narrow(2, 0, length).copy_(ck.narrow(2, 0, length));
      nv.narrow(2, 0, length).copy_(cv.narrow(2, 0, length));
    }
    ck = nk, cv = nv;
  }
  ck.narrow(2, length, s).copy_(k);
  cv.narrow(2, length, s).copy_(v);
  return {ck.narrow(2, 0, need), cv.narrow(2, 0, need)};
}

// The MLP of layer_forward (training, and forwards outside the fused decode / prefill ops) with a
// fused gate_up projection: gate and up as the halves of its output and, in the backward, the
// gradient written into one [.., 2I] buffer, no copy either way (GLU/1's rows).  KCPP_MLP_PACKED=0
// copies gate and up out contiguous and concatenates their gradients instead (the layout before
// GLU/1 took strided rows, kept for comparison: bench/RESULTS.md has the two steps side by side).
bool packed_glu() {
  const char* e = std::getenv("KCPP_MLP_PACKED");
  return !(e && std::string(e) == "0");
}

// generate_batch prefills neighbouring prompts together, up to this many (padded) tokens a group:
// enough rows to fill the GEMMs of short prompts, few enough that the activations stay small.
constexpr int64_t kPrefillTokens = 8192;

}  // namespace

std::unique_ptr<CausalLM> CausalLM::from_folder(const std::filesystem::path& folder, DType dtype, Device device,
                                                const LoadOptions& options) {
  std::unique_ptr<CausalLM> m(new CausalLM());
  m->cfg_ = ModelConfig::from_folder(folder);
  m->dtype_ = dtype;
  m->device_ = device;
  const WeightStore w = WeightStore::open_folder(folder);
  // A llama4 folder (Llama4ForConditionalGeneration) names its language model's weights
  // "language_model." + the text model's names.
  const std::string prefix = m->cfg_.multimodal ? "language_model." : "";
  // Transformers 5 ties the head to the embeddings only when the files hold no lm_head.weight or an
  // equal one; a different one is used as an untied head.
  std::string untied;
  bool equal_head = false;
  if (m->cfg_.tie_word_embeddings && w.contains(prefix + "lm_head.weight") && w.contains(prefix + "model.embed_tokens.weight")) {
    equal_head = w.same(prefix + "lm_head.weight", prefix + "model.embed_tokens.weight");
    if (!equal_head) {
      m->cfg_.tie_word_embeddings = false;
      untied = fmt::format("{}: config.json ties the embeddings to lm_head.weight, but the files hold both with different "
                           "values: the head is used untied, as Transformers does (set tie_word_embeddings to false to say so)",
                           folder.string());
    }
  }
  // Every missing weight is collected (a zero placeholder of no storage stands in) and named at once.
  std::vector<std::string> missing;
  m->build([&](const std::string& name, std::vector<int64_t> shape) {
    if (w.contains(prefix + name)) return w.load(prefix + name, dtype, device, &shape);
    missing.push_back(prefix + name);
    return Tensor::zeros(Shape(shape.size(), 1), dtype, device).expand(shape);
  }, [&](const std::string& name) { return w.contains(prefix + name); });
  const std::string f = folder.string(), mt = m->cfg_.model_type;
  const int64_t layers = m->cfg_.num_hidden_layers;
  KCPP_CHECK(missing.empty(), "{}: missing weight{} {} (config.json: {} with {} layers; are model_type and the sizes right?)", f,
             missing.size() > 1 ? "s" : "", name_list(missing), mt, layers);
  auto warn = [&](const std::string& what) {
    if (options.warn) options.warn(what);
    else fmt::print(stderr, "warning: {}\n", what);
  };
  if (!untied.empty()) warn(untied);
  m->unused_weights_ = w.unused();
  if (equal_head) std::erase(m->unused_weights_, prefix + "lm_head.weight");  // the embeddings' copy: tied, as Transformers does
  // A llama4 folder's vision tower and projector are left unread on purpose: not reported.
  if (!prefix.empty()) std::erase_if(m->unused_weights_, [&](const std::string& n) { return !n.starts_with(prefix); });
  if (!m->unused_weights_.empty()) {
    const auto& u = m->unused_weights_;
    const std::string what = fmt::format("{}: {} tensor{} of the weight files {} not used by the model (config.json: {} with {} layers): {}",
                                          f, u.size(), u.size() > 1 ? "s" : "", u.size() > 1 ? "are" : "is", mt, layers, name_list(u));
    KCPP_CHECK(!options.strict, "{}; check num_hidden_layers and the other keys of config.json, or load without strict to ignore them",
               what);
    warn(what + " (ignored)");
  }
  return m;
}

std::unique_ptr<CausalLM> CausalLM::random(const ModelConfig& config, DType dtype, Device device, uint64_t seed,
                                           double initializer_range) {
  config.validate();
  std::unique_ptr<CausalLM> m(new CausalLM());
  m->cfg_ = config;
  m->dtype_ = dtype;
  m->device_ = device;
  Generator gen(seed);
  const double norm_init = config.norm_offset != 0.0 ? 0.0 : 1.0;
  m->build([&](const std::string& name, std::vector<int64_t> shape) {
    if (name.ends_with("norm.weight")) return Tensor::full(shape, norm_init, dtype, device);
    if (name.ends_with(".bias")) return Tensor::zeros(shape, dtype, device);
    return Tensor::randn(shape, dtype, device, gen, 0.0, initializer_range);
  });
  return m;
}

void CausalLM::build(const std::function<Tensor(const std::string&, std::vector<int64_t>)>& get,
                     const std::function<bool(const std::string&)>& has) {
  const ModelConfig& c = cfg_;
  auto load = [&](const std::string& name, std::vector<int64_t> shape) { return get(name, std::move(shape)); };
  const int64_t h = c.hidden_size, d = c.head_dim, q = c.num_attention_heads * d, kv = c.num_key_value_heads * d;
  const bool l4 = c.is_llama4();
  // Llama 4's dense layers are intermediate_size_mlp wide (its experts intermediate_size); its MLPs
  // are named feed_forward.
  const int64_t inter = l4 ? c.intermediate_size_mlp : c.intermediate_size;
  const std::string mlp = l4 ? "feed_forward." : "mlp.";
  ops::RMSNormOptions norm;
  norm.eps = c.rms_norm_eps;
  norm.offset = c.norm_offset;
  norm.casting = c.model_type == "gemma" ? ops::RMSNormCasting::Gemma : ops::RMSNormCasting::Llama;
  embed_ = load("model.embed_tokens.weight", {c.vocab_size, h});
  layers_.clear();
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
      // One GEMM instead of three (the k and v ones are narrow: N = Hkv D), and in the backward one
      // dx GEMM instead of three GEMMs and two adds; the parts become views of the whole.
      l.wqkv = ops::cat({l.wq, l.wk, l.wv}, 0);
      l.wq = l.wqkv.narrow(0, 0, q), l.wk = l.wqkv.narrow(0, q, kv), l.wv = l.wqkv.narrow(0, q + kv, kv);
      if (l.bq.defined()) {
        l.bqkv = ops::cat({l.bq, l.bk, l.bv}, 0);
        l.bq = l.bqkv.narrow(0, 0, q), l.bk = l.bqkv.narrow(0, q, kv), l.bv = l.bqkv.narrow(0, q + kv, kv);
      }
      l.qkv_from_parts = true;
    }
    l.wo = load(p + "self_attn.o_proj.weight", {h, q});
    if (c.qk_norm) {
      l.q_norm = std::make_unique<nn::RMSNorm>(load(p + "self_attn.q_norm.weight", {d}), norm);
      l.k_norm = std::make_unique<nn::RMSNorm>(load(p + "self_attn.k_norm.weight", {d}), norm);
    }
    if (c.moe_layer(i) && l4) {
      // Llama4TextMoe: router.weight [E, H], the experts' stacks [E, H, 2I] (gate columns, then up
      // columns) and [E, I, H], as the checkpoint holds them, handed to nn::MoE as [E, 2I, H] / [E, H, I]
      // views; a shared expert without a gate.
      const int64_t ne = c.num_experts, mi = c.intermediate_size;
      const std::string f = p + "feed_forward.";
      l.experts_gate_up = load(f + "experts.gate_up_proj", {ne, h, 2 * mi});
      l.experts_down = load(f + "experts.down_proj", {ne, mi, h});
      nn::MoE::Options mo;
      mo.top_k = c.num_experts_per_tok;
      mo.normalize = false;
      mo.activation = glu_activation(c.hidden_act);
      mo.routing = nn::MoE::Routing::Sigmoid;
      mo.weight_on_input = true;
      l.moe = std::make_unique<nn::MoE>(load(f + "router.weight", {ne, h}), l.experts_gate_up.transpose(1, 2),
                                        l.experts_down.transpose(1, 2), mo, "Llama4TextMoe");
      const std::string se = f + "shared_expert.";
      const Tensor sgu = ops::cat({load(se + "gate_proj.weight", {mi, h}), load(se + "up_proj.weight", {mi, h})}, 0);
      l.moe->set_shared_expert(sgu, load(se + "down_proj.weight", {h, mi}));
    } else if (c.moe_layer(i)) {
      // Transformers 5's fused experts when the folder holds them, else the checkpoint's per-expert
      // matrices stacked (gate rows, then up rows, per expert).
      const int64_t ne = c.num_experts, mi = c.moe_intermediate_size;
      const bool mixtral = c.model_type == "mixtral";
      const std::string legacy = p + (mixtral ? "block_sparse_moe." : "mlp.");
      Tensor router, gate_up, down;
      if (!has || has(p + "mlp.experts.gate_up_proj") || !has(legacy + "experts.0." + (mixtral ? "w1" : "gate_proj") + ".weight")) {
        router = load(p + "mlp.gate.weight", {ne, h});
        gate_up = load(p + "mlp.experts.gate_up_proj", {ne, 2 * mi, h});
        down = load(p + "mlp.experts.down_proj", {ne, h, mi});
      } else {
        router = load(legacy + "gate.weight", {ne, h});
        std::vector<Tensor> gu, dn;
        for (int64_t e = 0; e < ne; ++e) {
          const std::string x = fmt::format("{}experts.{}.", legacy, e);
          gu.push_back(load(x + (mixtral ? "w1" : "gate_proj") + ".weight", {mi, h}));
          gu.push_back(load(x + (mixtral ? "w3" : "up_proj") + ".weight", {mi, h}));
          dn.push_back(load(x + (mixtral ? "w2" : "down_proj") + ".weight", {h, mi}));
        }
        gate_up = ops::cat(gu, 0).view({ne, 2 * mi, h});
        down = ops::cat(dn, 0).view({ne, h, mi});
      }
      nn::MoE::Options mo;
      mo.top_k = c.num_experts_per_tok;
      mo.normalize = c.norm_topk_prob;
      mo.activation = glu_activation(c.hidden_act);
      l.moe = std::make_unique<nn::MoE>(router, gate_up, down, mo);
      if (c.shared_expert_intermediate_size > 0) {
        // Qwen2-MoE's shared expert (mlp.shared_expert.{gate,up,down}_proj, as every checkpoint names
        // them) and its gate mlp.shared_expert_gate [1, H]; gate and up one [2Is, H] tensor, as the
        // dense MLP's (the checkpoint's names become views of it).
        const int64_t si = c.shared_expert_intermediate_size;
        const std::string se = p + "mlp.shared_expert.";
        const Tensor sgu = ops::cat({load(se + "gate_proj.weight", {si, h}), load(se + "up_proj.weight", {si, h})}, 0);
        l.moe->set_shared_expert(sgu, load(se + "down_proj.weight", {h, si}), load(p + "mlp.shared_expert_gate.weight", {1, h}));
      }
    } else {
      if (c.fused_gate_up) {
        l.w_gate_up = load(p + "mlp.gate_up_proj.weight", {2 * inter, h});
      } else {
        // One GEMM instead of two, forward and backward; the parts become views of the whole.
        l.w_gate_up = ops::cat({load(p + mlp + "gate_proj.weight", {inter, h}), load(p + mlp + "up_proj.weight", {inter, h})}, 0);
        l.w_gate = l.w_gate_up.narrow(0, 0, inter), l.w_up = l.w_gate_up.narrow(0, inter, inter);
        l.gate_up_from_parts = true;
      }
      l.w_down = load(p + mlp + "down_proj.weight", {h, inter});
    }
    // Llama 4 rotates interleaved pairs (Transformers' view_as_complex over (2j, 2j + 1)).
    l.rope = std::make_unique<nn::RotaryEmbedding>(l4 ? ops::RopeLayout::Interleaved : ops::RopeLayout::RotateHalf);
    l.use_rope = c.rope_layer(i);
    l.temperature = l4 && !l.use_rope && c.attn_temperature_tuning;
    if (l4 && l.use_rope && c.l2_qk_norm)  // Llama4TextL2Norm: x * rsqrt(mean(x^2) + eps) in f32, no weight
      l.l2_norm = std::make_unique<nn::RMSNorm>(Tensor::full({d}, 1.0, dtype_, device_), norm);
    ops::AttentionOptions ao;
    ao.scale = 1.0 / std::sqrt(static_cast<double>(d));
    ao.causal = true;
    ao.window = c.attention_window(i);
    ao.chunk = c.attention_chunk(i);
    l.attn = std::make_unique<nn::Attention>(ao);
    if (!l.moe) l.mlp = std::make_unique<nn::MLP>(glu_activation(c.hidden_act));
    layers_.push_back(std::move(l));
  }
  final_norm_ = std::make_unique<nn::RMSNorm>(load("model.norm.weight", {h}), norm);
  lm_head_ = c.tie_word_embeddings ? embed_ : load("lm_head.weight", {c.vocab_size, h});
  loss_ = std::make_unique<nn::ForCausalLMLoss>();
}

void CausalLM::visit_slots(const std::function<void(nn::Slot&)>& fn) {
  for (Layer& l : layers_) {
    fn(*l.input_norm);
    if (l.q_norm) fn(*l.q_norm), fn(*l.k_norm);
    if (l.use_rope) fn(*l.rope);
    if (l.l2_norm) fn(*l.l2_norm);
    fn(*l.attn);
    fn(*l.post_norm);
    if (l.moe) fn(*l.moe);
    else fn(*l.mlp);
  }
  fn(*final_norm_);
  fn(*loss_);
}

std::vector<std::pair<std::string, Tensor>> CausalLM::parameters() const {
  std::vector<std::pair<std::string, Tensor>> out;
  auto add = [&](const std::string& name, const Tensor& t) {
    if (t.defined()) out.emplace_back(name, t);
  };
  add("model.embed_tokens.weight", embed_);
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    const std::string p = fmt::format("model.layers.{}.", i);
    add(p + "input_layernorm.weight", l.input_norm->weight);
    add(p + "post_attention_layernorm.weight", l.post_norm->weight);
    if (!l.qkv_from_parts) add(p + "self_attn.qkv_proj.weight", l.wqkv);
    add(p + "self_attn.q_proj.weight", l.wq);
    add(p + "self_attn.k_proj.weight", l.wk);
    add(p + "self_attn.v_proj.weight", l.wv);
    add(p + "self_attn.q_proj.bias", l.bq);
    add(p + "self_attn.k_proj.bias", l.bk);
    add(p + "self_attn.v_proj.bias", l.bv);
    add(p + "self_attn.o_proj.weight", l.wo);
    if (l.q_norm) {
      add(p + "self_attn.q_norm.weight", l.q_norm->weight);
      add(p + "self_attn.k_norm.weight", l.k_norm->weight);
    }
    const std::string mlp = cfg_.is_llama4() ? "feed_forward." : "mlp.";
    if (!l.gate_up_from_parts) add(p + "mlp.gate_up_proj.weight", l.w_gate_up);
    add(p + mlp + "gate_proj.weight", l.w_gate);
    add(p + mlp + "up_proj.weight", l.w_up);
    add(p + mlp + "down_proj.weight", l.w_down);
    if (l.moe && cfg_.is_llama4()) {
      const Tensor& sgu = l.moe->shared_gate_up_proj;
      const int64_t si = sgu.size(0) / 2;
      add(p + "feed_forward.router.weight", l.moe->router_weight);
      add(p + "feed_forward.experts.gate_up_proj", l.experts_gate_up);
      add(p + "feed_forward.experts.down_proj", l.experts_down);
      add(p + "feed_forward.shared_expert.gate_proj.weight", sgu.narrow(0, 0, si));
      add(p + "feed_forward.shared_expert.up_proj.weight", sgu.narrow(0, si, si));
      add(p + "feed_forward.shared_expert.down_proj.weight", l.moe->shared_down_proj);
    } else if (l.moe) {
      add(p + "mlp.gate.weight", l.moe->router_weight);
      add(p + "mlp.experts.gate_up_proj", l.moe->gate_up_proj);
      add(p + "mlp.experts.down_proj", l.moe->down_proj);
      if (l.moe->shared_gate_up_proj.defined()) {
        const Tensor& sgu = l.moe->shared_gate_up_proj;
        const int64_t si = sgu.size(0) / 2;
        add(p + "mlp.shared_expert.gate_proj.weight", sgu.narrow(0, 0, si));
        add(p + "mlp.shared_expert.up_proj.weight", sgu.narrow(0, si, si));
        add(p + "mlp.shared_expert.down_proj.weight", l.moe->shared_down_proj);
        add(p + "mlp.shared_expert_gate.weight", l.moe->shared_expert_gate);
      }
    }
  }
  add("model.norm.weight", final_norm_->weight);
  if (!cfg_.tie_word_embeddings) add("lm_head.weight", lm_head_);
  return out;
}

void CausalLM::save(const std::filesystem::path& folder) const {
  std::filesystem::create_directories(folder);
  ModelConfig c = cfg_;
  c.torch_dtype = dtype_ == DType::bf16 ? "bfloat16" : dtype_ == DType::f16 ? "float16" : "float32";
  nlohmann::json j = c.to_json();
  j["architectures"] = {c.model_type == "llama"     ? "LlamaForCausalLM"
                        : c.model_type == "mistral" ? "MistralForCausalLM"
                        : c.model_type == "qwen2"   ? "Qwen2ForCausalLM"
                        : c.model_type == "qwen3"   ? "Qwen3ForCausalLM"
                        : c.model_type == "gemma"   ? "GemmaForCausalLM"
                        : c.model_type == "mixtral" ? "MixtralForCausalLM"
                        : c.model_type == "qwen3_moe" ? "Qwen3MoeForCausalLM"
                        : c.model_type == "qwen2_moe" ? "Qwen2MoeForCausalLM"
                        : c.model_type == "llama4_text" ? "Llama4ForCausalLM"
                                                    : "Phi3ForCausalLM"};
  const auto tmp = folder / "config.json.tmp";
  {
    std::ofstream out(tmp);
    out << j.dump(2) << "\n";
    KCPP_CHECK(out.good(), "{}: cannot write", tmp.string());
  }
  std::filesystem::rename(tmp, folder / "config.json");
  save_safetensors(folder / "model.safetensors", parameters(), {{"format", "pt"}});
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

struct CausalLM::LayerTape {
  nn::RMSNorm::Saved in_norm, post_norm, q_norm, k_norm, l2_q, l2_k;  // l2_*: Llama 4's L2 q/k norm
  nn::Attention::Saved attn;
  nn::MoE::Saved moe;
  Tensor a, o, m, gate, up, act;  // a, m: the normed inputs [B*S, H]; o: the attention's, [B*S, Hq*D]
};

struct CausalLM::Tape {
  bool checkpoint = false;     // keep only each layer's input (`inputs`), not `layers`
  std::vector<LayerTape> layers;
  std::vector<Tensor> inputs;
  nn::RMSNorm::Saved final_norm;
  Tensor ids, cos, sin;
  Tensor temp_scales;  // Llama 4's attention temperature per position [B, 1, S, 1] f32 (undefined: none)
};

namespace {

// Llama 4's cos / sin: each angle twice in a row ([c0 c0 c1 c1 ...]), the interleaved layout's form of
// rope_cos_sin's [c0 c1 ... c0 c1 ...].
ops::RopeCosSin interleaved(const ops::RopeCosSin& cs) {
  auto pairs = [](const Tensor& t) {
    const int64_t b = t.size(0), s = t.size(1), half = t.size(2) / 2;
    return t.narrow(2, 0, half).unsqueeze(3).expand({b, s, half, 2}).reshape({b, s, 2 * half});
  };
  return {pairs(cs.cos), pairs(cs.sin)};
}

// Llama4TextAttention's temperature tuning at `positions` (one per row of b x s, row-major):
// log1p(floor((p + 1) / floor_scale)) * attn_scale + 1, in f32 as Transformers computes it, [B, 1, S, 1].
Tensor temperature_scales(const ModelConfig& c, const std::vector<int64_t>& positions, int64_t b, int64_t s, Device device) {
  std::vector<double> v(positions.size());
  for (size_t i = 0; i < positions.size(); ++i) {
    const float x = std::floor((static_cast<float>(positions[i]) + 1.0f) / static_cast<float>(c.floor_scale));
    v[i] = std::log1p(x) * static_cast<float>(c.attn_scale) + 1.0f;
  }
  return Tensor::from_f64(v, {b, 1, s, 1}, DType::f32, device);
}

}  // namespace

Tensor CausalLM::layer_forward(size_t li, Tensor h, const ops::RopeCosSin& cs, LayerTape* t, KVCache* cache,
                               const Tensor& temp_scales) {
  const ModelConfig& c = cfg_;
  const int64_t b = h.size(0), s = h.size(1), hdim = c.hidden_size, d = c.head_dim;
  const int64_t hq = c.num_attention_heads, hkv = c.num_key_value_heads;
  Layer& l = layers_[li];
  const Tensor a = l.input_norm->forward(h, t ? &t->in_norm : nullptr).view({b * s, hdim});
  // q, k, v: [B, S, heads, D] views of the one projection's rows (copied once below, into [B, heads, S, D]).
  const Tensor qkv = linear(a, l.wqkv, l.bqkv).view({b, s, hq + 2 * hkv, d});
  Tensor q = qkv.narrow(2, 0, hq), k = qkv.narrow(2, hq, hkv), v = qkv.narrow(2, hq + hkv, hkv);
  if (l.q_norm) {
    q = l.q_norm->forward(q.contiguous(), t ? &t->q_norm : nullptr);
    k = l.k_norm->forward(k.contiguous(), t ? &t->k_norm : nullptr);
  }
  q = q.transpose(1, 2).contiguous(), k = k.transpose(1, 2).contiguous(), v = v.transpose(1, 2).contiguous();
  if (l.use_rope) std::tie(q, k) = l.rope->forward(q, k, cs.cos, cs.sin);
  if (l.l2_norm) {  // Llama 4: after RoPE
    q = l.l2_norm->forward(q, t ? &t->l2_q : nullptr);
    k = l.l2_norm->forward(k, t ? &t->l2_k : nullptr);
  }
  if (l.temperature) {  // Llama 4's NoPE layers: q (as f32) times the position's scale, rounded back
    KCPP_CHECK(temp_scales.defined(), "CausalLM: layer {} tunes the attention temperature but has no scales", li);
    q = ops::mul(q.to(DType::f32), temp_scales).to(dtype_);
  }
  Tensor o;
  if (cache && !cache->rows.empty()) {
    o = ragged_attention(li, q, k, v, *cache);
  } else {
    if (cache) std::tie(k, v) = append_to_cache(cache->k[li], cache->v[li], k, v, cache->length, cache->reserve);
    o = l.attn->forward(q, k, v, t ? &t->attn : nullptr);
  }
  o = o.transpose(1, 2).contiguous().view({b * s, hq * d});
  h = ops::add(h, linear(o, l.wo).view({b, s, hdim}));
  const Tensor m = l.post_norm->forward(h, t ? &t->post_norm : nullptr).view({b * s, hdim});
  if (l.moe) {
    Tensor logits;
    if (router_logits_) router_logits_->push_back(logits = Tensor::empty({b * s, c.num_experts}, dtype_, device_));
    h = ops::add(h, l.moe->forward(m, t ? &t->moe : nullptr, logits).view({b, s, hdim}));
    if (t) t->a = a, t->o = o, t->m = m;
    return h;
  }
  Tensor gate, up;
  if (l.w_gate_up.defined()) {
    const Tensor gu = linear(m, l.w_gate_up);
    const int64_t inter = l.w_down.size(1);
    gate = gu.narrow(1, 0, inter), up = gu.narrow(1, inter, inter);
    if (!packed_glu()) gate = gate.contiguous(), up = up.contiguous();
  } else {
    gate = linear(m, l.w_gate), up = linear(m, l.w_up);
  }
  const Tensor act = l.mlp->forward(gate, up);
  h = ops::add(h, linear(act, l.w_down).view({b, s, hdim}));
  if (t) t->a = a, t->o = o, t->m = m, t->gate = gate, t->up = up, t->act = act;
  return h;
}

Tensor CausalLM::hidden_states(const Tensor& ids, Tape* tape, KVCache* cache, InUse* head) {
  KCPP_CHECK(ids.dim() == 2, "CausalLM: input_ids must be [batch, seq], got {} dims", ids.dim());
  KCPP_CHECK(!(cache && parameter_use), "CausalLM: a forward with a KV cache (generation) is not supported while "
             "parameter_use is set (ZeRO-3 training: gather the parameters and unset it first; ZeRO-1 / 2 with the "
             "parameters' all-gather overlapped: DataParallel::gather_parameters() unsets it)");
  const ModelConfig& c = cfg_;
  const int64_t b = ids.size(0), s = ids.size(1), hdim = c.hidden_size;
  Tensor h;
  {
    InUse embedding(*this, ParameterGroup::Kind::Embedding);
    embedding.acquire();
    // Ids from the host are checked there and copied without waiting for the device; ids on the
    // device are checked by the kernel (which waits), except in a captured step, whose ids are the
    // previous step's picks (in range).
    const bool host_ids = ids.device() != device_;
    if (host_ids) ops::check_range(ids.to_i64_vector(), c.vocab_size, 0, false, "embedding", "ids");
    h = ops::embedding(embed_, host_ids ? ids.to(device_) : ids, !host_ids && !(cache && cache->step_ready));
  }
  if (c.scale_embeddings)  // Gemma: times sqrt(hidden) rounded to the model's dtype, as Transformers does
    h = ops::scale(h, Tensor::full({}, std::sqrt(static_cast<double>(hdim)), dtype_, Device::cpu()).item());
  const bool ragged = cache && !cache->rows.empty();
  const int64_t past = cache ? cache->length : 0;
  KCPP_CHECK(!(tape && (past > 0 || ragged)), "CausalLM: a backward over a cached prefix is not supported");
  if (cache && cache->k.empty()) cache->k.resize(layers_.size()), cache->v.resize(layers_.size());
  std::vector<int64_t> pos(static_cast<size_t>(b * s));
  int64_t end = past + s;  // one past the last position (dynamic RoPE scales by it)
  if (ragged) {
    KCPP_CHECK(s == 1 && (cache->active.empty() ? static_cast<int64_t>(cache->rows.size()) == b
                                                : static_cast<int64_t>(cache->active.size()) == b),
               "CausalLM: a ragged cache takes one token per active row; got input [{}, {}]", b, s);
    if (!cache->step_ready) prepare_ragged_step(*cache, b);
    end = cache->step_max_length;
  } else {
    for (int64_t i = 0; i < b * s; ++i) pos[static_cast<size_t>(i)] = past + i % s;
  }
  // An inference prefill into a cache whose storage holds its positions takes the fused layers; their
  // cache rows and positions and RoPE's positions go to the device in one copy of [2, b * s] i32.
  const bool fused_prefill = cache && !ragged && !tape && decode_fused_possible() && !cache->k.empty() &&
                             cache->k[0].defined() && cache->k[0].size(0) == b && cache->k[0].size(2) >= past + s;
  Tensor prefill_index, position_ids;
  if (ragged) {  // a ragged step's positions are its rows' lengths before the step, already on the device
    position_ids = cache->step_positions.view({b, 1});
  } else if (fused_prefill) {
    std::vector<int32_t> index(static_cast<size_t>(2 * b * s));
    for (int64_t i = 0; i < b * s; ++i)
      index[static_cast<size_t>(i)] = static_cast<int32_t>(i / s), index[static_cast<size_t>(b * s + i)] = static_cast<int32_t>(pos[static_cast<size_t>(i)]);
    const Tensor host = Tensor::from_blob(index.data(), {2, b * s}, DType::i32, Device::cpu());
    prefill_index = device_.is_cpu() ? host.clone() : host.to(device_);
    position_ids = prefill_index.narrow(0, 1, 1).view({b, s});
  } else {
    position_ids = Tensor::from_i64(pos, {b, s}, DType::i64, device_);
  }
  ops::RopeCosSin cs = ops::rope_cos_sin(position_ids, rope_inv_freq(end), 1.0, dtype_);
  Tensor temp_scales;
  if (c.is_llama4()) {
    cs = interleaved(cs);
    if (std::any_of(layers_.begin(), layers_.end(), [](const Layer& l) { return l.temperature; })) {
      if (ragged)  // each row's position: its length before this step
        for (int64_t i = 0; i < b; ++i) {
          const int64_t r = cache->active.empty() ? i : cache->active[static_cast<size_t>(i)];
          pos[static_cast<size_t>(i)] = cache->rows[static_cast<size_t>(r)];
        }
      temp_scales = temperature_scales(c, pos, b, s, device_);
    }
  }
  if (tape) {
    tape->layers.assign(layers_.size(), {});
    tape->inputs.assign(layers_.size(), {});
    tape->ids = ids, tape->cos = cs.cos, tape->sin = cs.sin, tape->temp_scales = temp_scales;
  }
  if (ragged && !tape && decode_fused_possible()) {
    const Tensor out = decode_layers(h.view({b, hdim}), cs, *cache);
    for (int64_t i = 0; i < b; ++i) ++cache->rows[static_cast<size_t>(cache->active.empty() ? i : cache->active[static_cast<size_t>(i)])];
    return out.view({b, 1, hdim});
  }
  if (fused_prefill) {
    const Tensor out = prefill_layers(h.view({b * s, hdim}), b, s, cs, prefill_index, *cache);
    cache->length += s;
    return out.view({b, s, hdim});
  }
  for (size_t li = 0; li < layers_.size(); ++li) {
    // Checkpointing keeps only each layer's input; the backward runs the layer again to get the rest.
    if (tape && tape->checkpoint) tape->inputs[li] = h;
    InUse layer(*this, ParameterGroup::Kind::Layer, li);
    layer.acquire();
    h = layer_forward(li, h, cs, tape && !tape->checkpoint ? &tape->layers[li] : nullptr, cache, temp_scales);
  }
  if (ragged) {
    for (int64_t i = 0; i < b; ++i) ++cache->rows[static_cast<size_t>(cache->active.empty() ? i : cache->active[static_cast<size_t>(i)])];
  } else if (cache) {
    cache->length += s;
  }
  InUse own_head(*this, ParameterGroup::Kind::Head);
  (head ? *head : own_head).acquire();
  return final_norm_->forward(h, tape ? &tape->final_norm : nullptr);
}

void CausalLM::prepare_ragged_step(KVCache& c, int64_t b) {
  std::vector<int64_t> rows(static_cast<size_t>(b)), positions(static_cast<size_t>(b)), lengths(static_cast<size_t>(b));
  int64_t longest = 0;
  for (int64_t i = 0; i < b; ++i) {
    const int64_t r = c.active.empty() ? i : c.active[static_cast<size_t>(i)];
    rows[static_cast<size_t>(i)] = r, positions[static_cast<size_t>(i)] = c.rows[static_cast<size_t>(r)];
    lengths[static_cast<size_t>(i)] = positions[static_cast<size_t>(i)] + 1;
    longest = std::max(longest, lengths[static_cast<size_t>(i)]);
  }
  KCPP_CHECK(!c.k.empty() && c.k[0].defined(), "CausalLM: a ragged cache needs its storage (generate_batch allocates it)");
  if (longest > c.k[0].size(2)) {  // a row is full: double every row's storage, in every layer
    for (size_t l = 0; l < c.k.size(); ++l) {
      Tensor& ck = c.k[l];
      Tensor& cv = c.v[l];
      const int64_t rows_n = ck.size(0), h = ck.size(1), cap = ck.size(2), d = ck.size(3);
      Tensor nk = Tensor::empty({rows_n, h, 2 * cap, d}, ck.dtype(), ck.device());
      Tensor nv = Tensor::empty({rows_n, h, 2 * cap, d}, cv.dtype(), cv.device());
      nk.narrow(2, 0, cap).copy_(ck);
      nv.narrow(2, 0, cap).copy_(cv);
      ck = nk, cv = nv;
    }
  }
  const bool in_place = c.step_rows.defined() && c.step_rows.size(0) == b;
  auto set = [&](Tensor& t, const std::vector<int64_t>& v) {
    if (in_place) t.copy_(Tensor::from_i64(v, {b}, DType::i32, Device::cpu()));
    else t = Tensor::from_i64(v, {b}, DType::i32, device_);
  };
  set(c.step_rows, rows);
  set(c.step_positions, positions);
  set(c.step_lengths, lengths);
  c.step_max_length = longest;
}

Tensor CausalLM::rope_inv_freq(int64_t seq_len) {
  if (cfg_.rope_scaling.type == RopeScaling::Type::Dynamic) return inv_freq(seq_len);
  if (!inv_freq_fixed_.defined()) inv_freq_fixed_ = inv_freq(seq_len);
  return inv_freq_fixed_;
}

bool CausalLM::graph_decode_possible() const {
  if (!device_.is_cuda() || !cuda_graphs_compiled() || profile::enabled()) return false;
  if (const char* env = std::getenv("KCPP_DECODE_GRAPHS"); env && std::string(env) == "0") return false;
  // MoE routing and dynamic RoPE read values on the host; head dims decode_attention lacks on CUDA
  // go row by row with host lengths.
  return cfg_.num_experts == 0 && !cfg_.is_llama4() && cfg_.rope_scaling.type != RopeScaling::Type::Dynamic &&
         ops::decode_attention_supported(device_, cfg_.head_dim);
}

Tensor CausalLM::ragged_attention(size_t li, const Tensor& q, const Tensor& k, const Tensor& v, KVCache& c) {
  const int64_t b = q.size(0), hq = q.size(1), hkv = k.size(1), d = q.size(3);
  Tensor& ck = c.k[li];
  Tensor& cv = c.v[li];
  ops::cache_write(ck, cv, k.reshape({b, hkv, d}), v.reshape({b, hkv, d}), c.step_rows, c.step_positions);
  const int64_t chunk = layers_[li].attn->options.chunk;
  if (chunk > 0 || !ops::decode_attention_supported(q.device(), d)) {  // row by row through the attention slot
    // A chunked layer's query (position n - 1) sees the keys of its chunk: from the chunk's start on,
    // which keeps positions and chunks aligned in the slot's mask (the start is a multiple of chunk).
    std::vector<Tensor> outs;
    for (int64_t i = 0; i < b; ++i) {
      const int64_t r = c.active.empty() ? i : c.active[static_cast<size_t>(i)], n = c.rows[static_cast<size_t>(r)] + 1;
      const int64_t start = chunk > 0 ? (n - 1) / chunk * chunk : 0;
      outs.push_back(layers_[li].attn->forward(q.narrow(0, i, 1), ck.narrow(0, r, 1).narrow(2, start, n - start),
                                               cv.narrow(0, r, 1).narrow(2, start, n - start)));
    }
    return b == 1 ? outs[0] : ops::cat(outs, 0);
  }
  return cached_attention(li, q.reshape({b, hq, d}), c).view({b, hq, 1, d});
}

double CausalLM::attention_scale(size_t li) const {
  const ops::AttentionOptions& opt = layers_[li].attn->options;
  // The decode kernels (ops::decode_attention and the fused ones that call this) have no soft-capping.
  KCPP_CHECK(opt.softcap == 0, "layer {}: the decode attention has no soft-capping (softcap {}): this model cannot generate "
             "in the C++ runtime yet", li, opt.softcap);
  return opt.scale != 0.0 ? opt.scale : 1.0 / std::sqrt(static_cast<double>(cfg_.head_dim));
}

Tensor CausalLM::cached_attention(size_t li, const Tensor& q, KVCache& c) {
  // A captured step is replayed as the rows grow: its bound is the storage's capacity.
  return ops::decode_attention(q, c.k[li], c.v[li], c.step_rows, c.step_lengths, attention_scale(li),
                               layers_[li].attn->options.window, c.step_ready ? 0 : c.step_max_length);
}

bool CausalLM::decode_fused_possible() const {
  if (const char* env = std::getenv("KCPP_DECODE_FUSED"); env && std::string(env) == "0") return false;
  // (Llama 4's NoPE, L2 norm, temperature and chunks are not in the fused ops.)
  return cfg_.num_experts == 0 && !cfg_.is_llama4() && ops::decode_attention_supported(device_, cfg_.head_dim);
}

// Per layer, with the fused projections (ops::decode_linear_fused: bf16 / f16 on CUDA, rows the gemv
// takes): the residual add + input norm + qkv GEMV (one op; the first layer's has no add), q/k norms +
// RoPE + the cache append + the attention (one op, ops::qk_norm_rope_attention: one kernel where the
// attention is one block a head group), the o GEMV, the residual add + post norm + gate/up
// GEMV + the gated activation (one op), the down GEMV; after the last layer the residual add + final
// norm.  Without them (KCPP_DECODE_FUSED=1, other dtypes, more rows, a qkv bias, separate
// gate and up weights) each add + norm and each gated activation is its own op before its GEMM.
// The residual stream is x + delta: delta, the last down projection, is added by the next norm.
Tensor CausalLM::decode_layers(const Tensor& h0, const ops::RopeCosSin& cs, KVCache& cache) {
  const ModelConfig& c = cfg_;
  const int64_t b = h0.size(0), hq = c.num_attention_heads, hkv = c.num_key_value_heads, d = c.head_dim;
  const char* env = std::getenv("KCPP_DECODE_FUSED");
  const bool fused_linear = !(env && std::string(env) == "1") && ops::decode_linear_fused(device_, dtype_, b);
  // KCPP_DECODE_ATTN_FUSED=0: the q/k norms, RoPE and the cache append as their own kernel before the
  // attention (for comparison).
  const char* attn_env = std::getenv("KCPP_DECODE_ATTN_FUSED");
  const bool attention_fused = !(attn_env && std::string(attn_env) == "0");
  Tensor x = h0, delta;
  // s = x + delta (x without delta) and rms_norm(s) through `norm`, as separate ops.
  auto add_norm = [&](nn::RMSNorm& norm) {
    if (!delta.defined()) return norm.forward(x);
    Tensor y;
    std::tie(x, y) = ops::add_rms_norm(x, delta, norm.weight, norm.options);
    return y;
  };
  std::optional<std::pair<Tensor, Tensor>> r;
  if (!(env && std::string(env) == "1") && (r = decode_layers_persistent(x, cs, cache))) {
    std::tie(x, delta) = *r;
    return add_norm(*final_norm_);
  }
  for (size_t li = 0; li < layers_.size(); ++li) {
    Layer& l = layers_[li];
    ops::QkNormRopeCache qo;
    qo.q_heads = hq, qo.kv_heads = hkv, qo.layout = l.rope->style;
    qo.settled = true;  // the step's rows, positions, lengths and cos / sin are made at its start
    if (l.q_norm) qo.q_norm = l.q_norm->weight, qo.k_norm = l.k_norm->weight, qo.norm = l.q_norm->options;
    Tensor qkv;
    if (fused_linear && !l.bqkv.defined())
      std::tie(x, qkv) = ops::add_rms_norm_linear(x, delta, l.input_norm->weight, l.input_norm->options, l.wqkv);
    else
      qkv = linear(add_norm(*l.input_norm), l.wqkv, l.bqkv);
    delta = Tensor();
    const Tensor heads = qkv.view({b, hq + 2 * hkv, d});
    const Tensor o =
        (attention_fused
             ? ops::qk_norm_rope_attention(heads, qo, cs.cos, cs.sin, cache.k[li], cache.v[li], cache.step_rows,
                                           cache.step_positions, cache.step_lengths, attention_scale(li),
                                           l.attn->options.window, cache.step_ready ? 0 : cache.step_max_length)
             : cached_attention(li, ops::qk_norm_rope_cache(heads, qo, cs.cos, cs.sin, cache.k[li], cache.v[li],
                                                            cache.step_rows, cache.step_positions),
                                cache))
            .view({b, hq * d});
    delta = linear(o, l.wo);
    if (fused_linear && l.w_gate_up.defined()) {
      Tensor h;
      std::tie(x, h) = ops::add_rms_norm_linear_glu(x, delta, l.post_norm->weight, l.post_norm->options, l.w_gate_up,
                                                    l.mlp->activation);
      delta = linear(h, l.w_down);
    } else {
      const Tensor m = add_norm(*l.post_norm);
      delta = Tensor();
      const Tensor act = l.w_gate_up.defined() ? ops::glu_packed(linear(m, l.w_gate_up), l.mlp->activation)
                                               : l.mlp->forward(linear(m, l.w_gate), linear(m, l.w_up));
      delta = linear(act, l.w_down);
    }
  }
  return add_norm(*final_norm_);
}

// Every layer in one persistent kernel (ops/nn/decode_persistent.h) where the layers are ones it
// covers (packed qkv and gate/up weights without biases, rotate-half RoPE, one casting of the
// norms) and the op takes the call; nothing otherwise.
std::optional<std::pair<Tensor, Tensor>> CausalLM::decode_layers_persistent(const Tensor& h0, const ops::RopeCosSin& cs,
                                                                            KVCache& cache) {
  const ModelConfig& c = cfg_;
  if (!ops::decode_persistent_enabled() || !device_.is_cuda() || (dtype_ != DType::bf16 && dtype_ != DType::f16) || h0.size(0) > 4)
    return std::nullopt;
  std::vector<ops::PersistentDecodeLayer> pl;
  pl.reserve(layers_.size());
  ops::PersistentDecodeOptions po;
  po.q_heads = c.num_attention_heads, po.kv_heads = c.num_key_value_heads;
  po.max_length = cache.step_ready ? 0 : cache.step_max_length;
  for (size_t li = 0; li < layers_.size(); ++li) {
    const Layer& l = layers_[li];
    if (l.bqkv.defined() || !l.w_gate_up.defined() || !l.mlp || l.rope->style != ops::RopeLayout::RotateHalf ||
        l.attn->options.chunk > 0)
      return std::nullopt;
    const ops::RMSNormOptions& norm = l.input_norm->options;
    if (li == 0) {
      po.norm = norm, po.act = l.mlp->activation;
      if (l.q_norm) po.qk_norm = l.q_norm->options;
    }
    auto same = [](const ops::RMSNormOptions& a, const ops::RMSNormOptions& b) {
      return a.eps == b.eps && a.offset == b.offset && a.casting == b.casting;
    };
    if (!same(norm, po.norm) || !same(l.post_norm->options, po.norm) || l.mlp->activation != po.act ||
        (l.q_norm && !same(l.q_norm->options, po.qk_norm)) || (l.k_norm && !same(l.k_norm->options, po.qk_norm)))
      return std::nullopt;
    ops::PersistentDecodeLayer& p = pl.emplace_back();
    p.input_norm = l.input_norm->weight, p.post_norm = l.post_norm->weight, p.wqkv = l.wqkv;
    if (l.q_norm && l.k_norm) p.q_norm = l.q_norm->weight, p.k_norm = l.k_norm->weight;
    p.wo = l.wo, p.w_gate_up = l.w_gate_up, p.w_down = l.w_down;
    p.k_cache = cache.k[li], p.v_cache = cache.v[li];
    if (l.attn->options.softcap > 0) return std::nullopt;  // (the persistent kernel has no soft-capping)
    p.scale = l.attn->options.scale, p.window = l.attn->options.window;
  }
  return ops::decode_layers_persistent(h0, Tensor(), pl, po, cs.cos, cs.sin, cache.step_rows, cache.step_positions,
                                       cache.step_lengths);
}

// A prefill of [B, S] new tokens at positions cache.length .. into storage that holds them: the ops
// of decode_layers, each token a row (its batch row and position say where its keys go), with the
// prefill's causal attention over the cache's positions 0 .. length + S - 1.  Returns the final
// norm's output [B * S, H].  The attention reads q and writes its output as [B, S, heads, D]
// buffers through transposed views, so no layout copies remain.
Tensor CausalLM::prefill_layers(const Tensor& h0, int64_t b, int64_t s, const ops::RopeCosSin& cs, const Tensor& index,
                                KVCache& cache) {
  const ModelConfig& c = cfg_;
  const int64_t n = b * s, hq = c.num_attention_heads, hkv = c.num_key_value_heads, d = c.head_dim;
  const int64_t past = cache.length, rd = cs.cos.size(2);
  const Tensor rows_t = index.select(0, 0), positions_t = index.select(0, 1);
  const Tensor cos = cs.cos.contiguous().view({n, 1, rd}), sin = cs.sin.contiguous().view({n, 1, rd});
  Tensor x = h0;
  Tensor a = layers_[0].input_norm->forward(x);
  for (size_t li = 0; li < layers_.size(); ++li) {
    Layer& l = layers_[li];
    ops::QkNormRopeCache qo;
    qo.q_heads = hq, qo.kv_heads = hkv, qo.layout = l.rope->style;
    if (l.q_norm) qo.q_norm = l.q_norm->weight, qo.k_norm = l.k_norm->weight, qo.norm = l.q_norm->options;
    const Tensor q = l.bqkv.defined()
                         ? ops::qk_norm_rope_cache(linear(a, l.wqkv, l.bqkv).view({n, hq + 2 * hkv, d}), qo, cos, sin,
                                                   cache.k[li], cache.v[li], rows_t, positions_t)
                         : ops::linear_qk_norm_rope_cache(a, l.wqkv, qo, cos, sin, cache.k[li], cache.v[li], rows_t, positions_t);
    const Tensor k = cache.k[li].narrow(2, 0, past + s), v = cache.v[li].narrow(2, 0, past + s);
    const Tensor o = Tensor::empty({b, s, hq, d}, dtype_, device_);
    l.attn->forward(q.view({b, s, hq, d}).transpose(1, 2), k, v, nullptr, o.transpose(1, 2));
    Tensor m;
    std::tie(x, m) = ops::add_rms_norm(x, linear(o.view({n, hq * d}), l.wo), l.post_norm->weight, l.post_norm->options);
    const Tensor act = l.w_gate_up.defined() ? ops::linear_glu(m, l.w_gate_up, l.mlp->activation)
                                             : l.mlp->forward(linear(m, l.w_gate), linear(m, l.w_up));
    const nn::RMSNorm& next = li + 1 < layers_.size() ? *layers_[li + 1].input_norm : *final_norm_;
    std::tie(x, a) = ops::add_rms_norm(x, linear(act, l.w_down), next.weight, next.options);
  }
  return a;
}

Tensor CausalLM::forward(const Tensor& ids, KVCache* cache) {
  InUse head(*this, ParameterGroup::Kind::Head);
  const Tensor h = hidden_states(ids, nullptr, cache, &head);
  const int64_t b = ids.size(0), s = ids.size(1);
  return ops::matmul(h.view({b * s, cfg_.hidden_size}), lm_head_, false, true).view({b, s, cfg_.vocab_size});
}

Tensor CausalLM::next_token_logits(const Tensor& ids, KVCache* cache) {
  InUse head(*this, ParameterGroup::Kind::Head);
  const Tensor h = hidden_states(ids, nullptr, cache, &head);
  const int64_t b = ids.size(0), s = ids.size(1);
  const Tensor last = s == 1 ? h.view({b, cfg_.hidden_size}) : h.narrow(1, s - 1, 1).contiguous().view({b, cfg_.hidden_size});
  return ops::matmul(last, lm_head_, false, true);
}

void Sampling::validate() const {
  KCPP_CHECK(std::isfinite(temperature) && temperature >= 0.0,
             "sampling: temperature is {}; it must be 0 (greedy) or a positive number", temperature);
  KCPP_CHECK(top_k >= 0, "sampling: top_k is {}; it must be 0 (every token) or a positive number of tokens", top_k);
  KCPP_CHECK(top_p > 0.0 && top_p <= 1.0, "sampling: top_p is {}; it must be above 0 and at most 1 (1 keeps every token)",
             top_p);
}

std::vector<int64_t> CausalLM::generate(const std::vector<int64_t>& prompt, int64_t max_new_tokens, const Sampling& sampling,
                                        const std::vector<int64_t>* stop, StopReason* reason) {
  auto r = generate_batch({prompt}, max_new_tokens, sampling, stop);
  if (reason) *reason = r[0].reason;
  return std::move(r[0].ids);
}

namespace {

// The error of a non-finite logit (`value` as text) for token `id` at `position` of prompt `prompt`.
[[noreturn]] void non_finite_logits(const std::string& value, int64_t id, int64_t position, bool many, size_t prompt) {
  KCPP_FAIL("generate: the model produced non-finite logits ({} for token id {}) at position {}{}; check the weights "
            "(NaN or infinite values in the safetensors) and config.json (rope_theta, rms_norm_eps, ...)", value, id,
            position, many ? fmt::format(" of prompt {}", prompt) : "");
}

}  // namespace

std::vector<int64_t> CausalLM::pick_tokens(const Tensor& logits_all, const Sampling& sampling, bool many,
                                           const std::vector<size_t>& rows, const std::vector<int64_t>& positions) {
  const int64_t n = logits_all.size(0), v = cfg_.vocab_size;
  const Tensor logits = logits_all.size(1) > v ? logits_all.narrow(1, 0, v) : logits_all;
  auto bad_logits = [&](int64_t j, int64_t id, double value) {
    non_finite_logits(fmt::format("{}", value), id, positions[static_cast<size_t>(j)], many, rows[static_cast<size_t>(j)]);
  };
  // On the logits' device, two ids a row back: greedy's argmax, or a draw (ops/nn/sampling.h) keyed
  // by the row's seed (sampling.seed + its prompt's index) and the position of the token it makes.
  Tensor picked_t;
  if (sampling.temperature <= 0.0) {
    picked_t = ops::argmax_checked(logits);
  } else {
    std::vector<uint64_t> seeds(static_cast<size_t>(n));
    std::vector<int64_t> next(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) {
      seeds[static_cast<size_t>(j)] = sampling.seed + rows[static_cast<size_t>(j)];
      next[static_cast<size_t>(j)] = positions[static_cast<size_t>(j)] + 1;
    }
    const ops::SampleOptions so{sampling.temperature, sampling.top_k, sampling.top_p};
    picked_t = ops::sample_checked(ops::sampling_on_device(so) ? logits : logits.to(Device::cpu()), so, seeds, next);
  }
  const std::vector<int64_t> picked = picked_t.to_i64_vector();
  std::vector<int64_t> tokens(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    const int64_t bad = picked[static_cast<size_t>(2 * j + 1)];
    if (bad >= 0) bad_logits(j, bad, logits.narrow(0, j, 1).narrow(1, bad, 1).contiguous().to_f64_vector()[0]);
    tokens[static_cast<size_t>(j)] = picked[static_cast<size_t>(2 * j)];
  }
  return tokens;
}

struct CausalLM::DecodeGraphs {
  struct Step {
    CudaGraph graph;
    Tensor ids, rows, positions, lengths;  // the inputs, overwritten before each replay
    Tensor logits;                         // the output, rewritten by each replay
    int eager_runs = 0;
  };
  std::map<int64_t, Step> by_batch;
  const void* storage = nullptr;  // the cache storage the graphs write (a reallocation invalidates them)
  bool failed = false;            // a capture failed: every later step runs eagerly
};

Tensor CausalLM::graph_step(DecodeGraphs& g, KVCache& cache, const std::vector<int64_t>& ids, int64_t& replays) {
  const int64_t a = static_cast<int64_t>(ids.size());
  // Batches only shrink as rows finish: the graphs of larger ones (and their memory) go.
  g.by_batch.erase(g.by_batch.upper_bound(a), g.by_batch.end());
  DecodeGraphs::Step& st = g.by_batch[a];
  if (!st.ids.defined()) st.ids = Tensor::empty({a, 1}, DType::i64, device_);
  st.ids.copy_(Tensor::from_i64(ids, {a, 1}, DType::i64, Device::cpu()));
  cache.step_rows = st.rows, cache.step_positions = st.positions, cache.step_lengths = st.lengths;
  prepare_ragged_step(cache, a);  // in place once the step's tensors exist; may double the storage
  st.rows = cache.step_rows, st.positions = cache.step_positions, st.lengths = cache.step_lengths;
  if (cache.k[0].data() != g.storage) {  // new storage: every graph wrote the old one; capture again
    g.storage = cache.k[0].data();
    for (auto& [size, other] : g.by_batch) other.graph.reset(), other.logits = Tensor(), other.eager_runs = 0;
  }
  // The step's tensors are made: every run of the step below, eager or recorded, reads them as they are.
  struct Ready {
    KVCache& c;
    explicit Ready(KVCache& cache) : c(cache) { c.step_ready = true; }
    ~Ready() { c.step_ready = false; }
  } ready(cache);
  if (st.eager_runs++ == 0) return next_token_logits(st.ids, &cache);  // warms every kernel and library first
  if (!st.graph.captured()) {
    // Recording runs the host side of the step (which advances the rows' lengths) but no GPU work.
    const std::vector<int64_t> lengths = cache.rows;
    try {
      nn::CaptureScope capturing;
      st.graph.capture(device_, [&] { st.logits = next_token_logits(st.ids, &cache); });
    } catch (const std::exception& e) {
      fmt::print(stderr, "kcpp: decoding without CUDA graphs ({})\n", e.what());
      g.failed = true;
    }
    cache.rows = lengths;
    if (g.failed) {
      st.logits = Tensor();
      return next_token_logits(st.ids, &cache);
    }
  }
  return replay_step(g, cache, a, replays);
}

bool CausalLM::graph_replays_next(const DecodeGraphs& g, const KVCache& cache, int64_t a) const {
  const auto it = g.by_batch.find(a);
  if (g.failed || it == g.by_batch.end() || it->second.eager_runs == 0 || !it->second.graph.captured() ||
      cache.k.empty() || cache.k[0].data() != g.storage)
    return false;
  for (int64_t i = 0; i < a; ++i)  // the step's new keys fit the storage (else it doubles and the graphs go)
    if (cache.rows[static_cast<size_t>(cache.active.empty() ? i : cache.active[static_cast<size_t>(i)])] >= cache.k[0].size(2))
      return false;
  return true;
}

Tensor CausalLM::replay_step(DecodeGraphs& g, KVCache& cache, int64_t a, int64_t& replays) {
  DecodeGraphs::Step& st = g.by_batch.at(a);
  st.graph.replay();
  ++replays;
  for (int64_t i = 0; i < a; ++i) ++cache.rows[static_cast<size_t>(cache.active.empty() ? i : cache.active[static_cast<size_t>(i)])];
  return st.logits;
}

std::vector<CausalLM::Generated> CausalLM::generate_batch(const std::vector<std::vector<int64_t>>& prompts,
                                                          int64_t max_new_tokens, const Sampling& sampling,
                                                          const std::vector<int64_t>* stop,
                                                          const std::function<void(size_t, int64_t)>& on_token,
                                                          GenerationStats* stats) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  auto since = [](clock::time_point t) { return std::chrono::duration<double>(clock::now() - t).count(); };
  KCPP_CHECK(!prompts.empty(), "generate: no prompts");
  KCPP_CHECK(max_new_tokens >= 0, "generate: max_new_tokens is {}; it must be 0 or more", max_new_tokens);
  sampling.validate();
  const size_t n = prompts.size();
  const bool many = n > 1;
  const int64_t context = cfg_.max_position_embeddings;
  for (size_t p = 0; p < n; ++p) {
    const std::vector<int64_t>& prompt = prompts[p];
    const std::string which = many ? fmt::format("prompt {}", p) : "the prompt";
    KCPP_CHECK(!prompt.empty(), "generate: {} has no tokens", which);
    KCPP_CHECK(static_cast<int64_t>(prompt.size()) <= context,
               "generate: {} has {} tokens, more than the model's context length of {} (max_position_embeddings in "
               "config.json); shorten the prompt", which, prompt.size(), context);
    for (size_t i = 0; i < prompt.size(); ++i)
      KCPP_CHECK(prompt[i] >= 0 && prompt[i] < cfg_.vocab_size,
                 "generate: {}'s token id {} (position {}) is outside the model's vocabulary of {} ids (0 to {}); "
                 "were the ids made by another model's tokenizer?", which, prompt[i], i, cfg_.vocab_size, cfg_.vocab_size - 1);
  }
  const std::vector<int64_t>& stops = stop ? *stop : cfg_.eos_token_id;
  std::vector<Generated> out(n);
  std::vector<int64_t> steps(n);  // the new tokens row p may make
  int64_t longest = 0, most = 0;
  for (size_t p = 0; p < n; ++p) {
    const int64_t len = static_cast<int64_t>(prompts[p].size());
    out[p].ids = prompts[p];
    steps[p] = std::min(max_new_tokens, context - len);
    out[p].reason = steps[p] < max_new_tokens ? StopReason::ContextLength : StopReason::MaxNewTokens;
    longest = std::max(longest, len);
    most = std::max(most, len + steps[p]);
  }
  GenerationStats st;
  // Decode steps as CUDA graphs: each batch size's step runs once eagerly, is then captured and
  // replayed (captured again when the cache storage doubles, since a graph writes the old storage).
  std::unique_ptr<DecodeGraphs> graphs = graph_decode_possible() ? std::make_unique<DecodeGraphs>() : nullptr;
  // One cache for every row, positions for the longest prompt and its first steps (the storage
  // doubles when a row fills it).
  KVCache cache;
  const int64_t rows = static_cast<int64_t>(n), hkv = cfg_.num_key_value_heads, d = cfg_.head_dim;
  const int64_t capacity = std::min(most, longest + std::min<int64_t>(max_new_tokens, 256));
  for (size_t l = 0; l < layers_.size(); ++l) {
    cache.k.push_back(Tensor::empty({rows, hkv, capacity, d}, dtype_, device_));
    cache.v.push_back(Tensor::empty({rows, hkv, capacity, d}, dtype_, device_));
  }
  cache.rows.assign(n, 0);
  std::vector<int64_t> next(n, 0);
  std::vector<char> done(n, 1);
  auto emit = [&](size_t p, int64_t token) {  // true when row p is finished
    out[p].ids.push_back(token);
    if (on_token) on_token(p, token);
    if (std::find(stops.begin(), stops.end(), token) != stops.end()) {
      out[p].reason = StopReason::StopToken;
      return true;
    }
    return static_cast<int64_t>(out[p].ids.size() - prompts[p].size()) >= steps[p];
  };
  // Cache slots in order of prompt length, so that prompts of similar lengths are neighbours: slot r
  // holds prompt order[r] (the rows that make nothing last, their slots unused).
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) {
    if ((steps[x] == 0) != (steps[y] == 0)) return steps[y] == 0;
    return prompts[x].size() < prompts[y].size();
  });
  // Prefill: neighbouring prompts together, right-padded to the group's longest; each writes its
  // keys into its slots of the cache (views of the storage).  Causal attention keeps a row's tokens
  // from seeing the padding after them, so each row computes what it would alone; the padding's
  // keys sit past the row's length and are overwritten by its decode steps.  Dynamic RoPE scales by
  // the padded length, so under it only prompts of equal length share a group.
  const bool dynamic_rope = cfg_.rope_scaling.type == RopeScaling::Type::Dynamic;
  for (size_t r0 = 0; r0 < n && steps[order[r0]] > 0;) {
    size_t r1 = r0 + 1;
    while (r1 < n && steps[order[r1]] > 0) {
      const size_t len = prompts[order[r1]].size();
      if (dynamic_rope && len != prompts[order[r0]].size()) break;
      if (static_cast<int64_t>((r1 - r0 + 1) * len) > kPrefillTokens) break;
      ++r1;
    }
    const int64_t g = static_cast<int64_t>(r1 - r0), width = static_cast<int64_t>(prompts[order[r1 - 1]].size());
    std::vector<int64_t> ids(static_cast<size_t>(g * width)), last(static_cast<size_t>(g));
    std::vector<size_t> which(static_cast<size_t>(g));
    std::vector<int64_t> positions(static_cast<size_t>(g));
    for (int64_t j = 0; j < g; ++j) {
      const std::vector<int64_t>& prompt = prompts[order[r0 + static_cast<size_t>(j)]];
      const int64_t len = static_cast<int64_t>(prompt.size());
      for (int64_t t = 0; t < width; ++t) ids[static_cast<size_t>(j * width + t)] = prompt[static_cast<size_t>(std::min(t, len - 1))];
      last[static_cast<size_t>(j)] = j * width + len - 1;
      which[static_cast<size_t>(j)] = order[r0 + static_cast<size_t>(j)];
      positions[static_cast<size_t>(j)] = len - 1;
    }
    KVCache group;
    for (size_t l = 0; l < layers_.size(); ++l) {
      group.k.push_back(cache.k[l].narrow(0, static_cast<int64_t>(r0), g));
      group.v.push_back(cache.v[l].narrow(0, static_cast<int64_t>(r0), g));
    }
    const Tensor h = hidden_states(Tensor::from_i64(ids, {g, width}, DType::i64, Device::cpu()), nullptr, &group);
    const Tensor rows_last = g == 1 && width == static_cast<int64_t>(prompts[which[0]].size())
                                 ? h.narrow(1, width - 1, 1).contiguous().view({1, cfg_.hidden_size})
                                 : ops::embedding(h.view({g * width, cfg_.hidden_size}), Tensor::from_i64(last, {g}, DType::i64, device_), false);
    const Tensor logits = ops::matmul(rows_last, lm_head_, false, true);
    ++st.prefills;
    const std::vector<int64_t> tokens = pick_tokens(logits, sampling, many, which, positions);
    if (st.first_token_seconds == 0) st.first_token_seconds = since(t0);
    for (int64_t j = 0; j < g; ++j) {
      const size_t p = which[static_cast<size_t>(j)];
      cache.rows[r0 + static_cast<size_t>(j)] = static_cast<int64_t>(prompts[p].size());
      done[p] = emit(p, tokens[static_cast<size_t>(j)]);
      next[p] = tokens[static_cast<size_t>(j)];
    }
    r0 = r1;
  }
  st.prefill_seconds = since(t0);
  // Decode: every unfinished row, one token a step, in slot order.  Greedy steps that replay a
  // captured graph are pipelined: while step N's picks travel to the host, step N + 1 is already
  // queued from them on the device (ops::advance_decode_inputs writes its ids, positions and
  // lengths), so the host's work between steps overlaps the device's.  Step N + 1 is queued only
  // where no row reaches its token limit at step N and every row's next key fits the storage; a row
  // that stops at step N (a stop token) has its pick of step N + 1 dropped, and the rows left go on
  // as a smaller batch.  KCPP_DECODE_PIPELINE=0 waits for each step's picks before the next.
  static const bool pipeline = [] {
    const char* e = std::getenv("KCPP_DECODE_PIPELINE");
    return !(e && std::string(e) == "0");
  }();
  struct Flight {  // a queued greedy step whose picks are on their way to the host
    std::vector<size_t> active;      // prompt indices, in slot order
    std::vector<int64_t> positions;  // of each row's last token
    Tensor picks;                    // [rows, 2] on the device
    PendingCopy* copy = nullptr;     // one of `copies`
  };
  // At most two steps are in flight: two copies, made once (pinned memory is slow to allocate and its
  // allocation and release synchronize the device), used in turn.
  PendingCopy copies[2];
  int turn = 0;
  const int64_t vocab = cfg_.vocab_size;
  auto queue_picks = [&](const Tensor& logits, std::unique_ptr<Flight>& f) {
    f->picks = ops::argmax_checked(logits.size(1) > vocab ? logits.narrow(1, 0, vocab) : logits);
    f->copy = &copies[turn];
    turn ^= 1;
    f->copy->start(f->picks);
  };
  // The picks of a queued step, as pick_tokens reads them (the logits' values are gone by then: the
  // error names the token id and position).  A row stopped at the step before is skipped.
  auto take = [&](Flight& f) {
    const std::vector<int64_t> picked = f.copy->wait();
    for (size_t j = 0; j < f.active.size(); ++j)  // every row checked before any is emitted, as pick_tokens does
      if (!done[f.active[j]] && picked[2 * j + 1] >= 0)
        non_finite_logits("NaN or infinite", picked[2 * j + 1], f.positions[j], many, f.active[j]);
    for (size_t j = 0; j < f.active.size(); ++j) {
      const size_t p = f.active[j];
      if (done[p]) continue;
      done[p] = emit(p, picked[2 * j]);
      next[p] = picked[2 * j];
      ++st.decode_tokens;
    }
  };
  std::unique_ptr<Flight> flight;
  const auto t1 = clock::now();
  for (;;) {
    if (!flight) {
      std::vector<size_t> active;
      std::vector<int64_t> ids, positions;
      cache.active.clear();
      for (size_t r = 0; r < n; ++r) {
        const size_t p = order[r];
        if (done[p]) continue;
        active.push_back(p);
        cache.active.push_back(static_cast<int64_t>(r));
        ids.push_back(next[p]);
        positions.push_back(static_cast<int64_t>(out[p].ids.size()) - 1);
      }
      if (active.empty()) break;
      const int64_t a = static_cast<int64_t>(active.size());
      const bool replay = graphs && !graphs->failed && graph_replays_next(*graphs, cache, a);
      const Tensor logits = graphs && !graphs->failed ? graph_step(*graphs, cache, ids, st.graph_replays) :
                                                        next_token_logits(Tensor::from_i64(ids, {a, 1}, DType::i64, device_), &cache);
      if (!(pipeline && replay && sampling.temperature <= 0.0)) {
        const std::vector<int64_t> tokens = pick_tokens(logits, sampling, many, active, positions);
        for (size_t j = 0; j < active.size(); ++j) {
          done[active[j]] = emit(active[j], tokens[j]);
          next[active[j]] = tokens[j];
        }
        st.decode_tokens += a;
        continue;
      }
      flight = std::make_unique<Flight>();
      flight->active = std::move(active), flight->positions = std::move(positions);
      queue_picks(logits, flight);
    }
    // Step N + 1 from step N's picks, where it can be queued before they are read.
    const int64_t a = static_cast<int64_t>(flight->active.size());
    bool chain = graph_replays_next(*graphs, cache, a);
    for (size_t p : flight->active)
      chain = chain && static_cast<int64_t>(out[p].ids.size() - prompts[p].size()) + 1 < steps[p];  // with step N's
    std::unique_ptr<Flight> following;
    if (chain) {
      DecodeGraphs::Step& stp = graphs->by_batch.at(a);
      ops::advance_decode_inputs(flight->picks, stp.ids, stp.positions, stp.lengths);
      const Tensor logits = replay_step(*graphs, cache, a, st.graph_replays);
      following = std::make_unique<Flight>();
      following->active = flight->active;
      following->positions = flight->positions;
      for (int64_t& q : following->positions) ++q;
      queue_picks(logits, following);
    }
    take(*flight);
    flight = std::move(following);
    if (flight) {  // a row stopped at step N: step N + 1's picks of the others stand, the next step is rebuilt
      bool all = true;
      for (size_t p : flight->active) all = all && !done[p];
      if (!all) {
        take(*flight);
        flight.reset();
      }
    }
  }
  st.decode_seconds = since(t1);
  if (stats) *stats = st;
  return out;
}

// ForCausalLMLoss's shift: position t predicts label t + 1; the last position of each row has none.
// On the model's device, with no copy to the host (the step queues on without waiting here).
Tensor CausalLM::shifted_targets(const Tensor& labels) const {
  KCPP_CHECK(labels.dim() == 2, "CausalLM: labels must be [batch, seq], got {} dims", labels.dim());
  KCPP_CHECK(labels.dtype() == DType::i64 || labels.dtype() == DType::i32, "CausalLM: labels must be i64 or i32, got {}",
             dtype_name(labels.dtype()));
  const int64_t b = labels.size(0), s = labels.size(1);
  Tensor l = labels.device() == device_ ? labels : labels.to(device_);
  if (l.dtype() != DType::i64) l = l.to(DType::i64);
  const Tensor none = Tensor::full({b, 1}, -100, DType::i64, device_);
  return (s > 1 ? ops::cat({l.narrow(1, 1, s - 1), none}, 1) : none).contiguous().view({b * s});
}

nn::LoadBalancingLoss CausalLM::aux_loss(const std::vector<Tensor>& router_logits, double dloss) const {
  nn::LoadBalancingLoss lb = nn::load_balancing_loss(ops::cat(router_logits, 0), cfg_.num_experts_per_tok,
                                                     cfg_.router_aux_loss_coef * dloss);
  lb.loss = ops::scale(lb.loss, cfg_.router_aux_loss_coef);
  return lb;
}

Tensor CausalLM::loss(const Tensor& ids, const Tensor& labels) {
  KCPP_CHECK(labels.shape() == ids.shape(), "CausalLM::loss: labels [{}] must match input_ids [{}]", fmt::join(labels.shape(), ", "),
             fmt::join(ids.shape(), ", "));
  std::vector<Tensor> logits;
  struct Sink {
    std::vector<Tensor>*& slot;
    ~Sink() { slot = nullptr; }
  } sink{router_logits_};
  if (aux_loss_on()) router_logits_ = &logits;
  InUse head(*this, ParameterGroup::Kind::Head);
  const Tensor h = hidden_states(ids, nullptr, nullptr, &head).view({ids.numel(), cfg_.hidden_size});
  router_logits_ = nullptr;
  const Tensor l = loss_->forward(h, lm_head_, shifted_targets(labels));
  return logits.empty() ? l : ops::add(l, aux_loss(logits, 1.0).loss);
}

int64_t CausalLM::labelled_tokens(const Tensor& labels) {
  KCPP_CHECK(labels.dim() == 2, "labels must be [batch, seq], got {} dims", labels.dim());
  const int64_t b = labels.size(0), s = labels.size(1);
  const auto lv = labels.to_f64_vector();
  int64_t n = 0;
  for (int64_t i = 0; i < b; ++i)
    for (int64_t t = 1; t < s; ++t) n += lv[i * s + t] != -100 ? 1 : 0;
  return n;
}

CausalLM::Gradients CausalLM::loss_and_gradients(const Tensor& ids, const Tensor& labels, double dloss, ops::Reduction reduction,
                                                  const GradientReady& ready) {
  const nn::ForCausalLMLoss::ReductionScope scope(*loss_, reduction);
  KCPP_CHECK(labels.shape() == ids.shape(), "CausalLM: labels [{}] must match input_ids [{}]", fmt::join(labels.shape(), ", "),
             fmt::join(ids.shape(), ", "));
  const ModelConfig& c = cfg_;
  const int64_t b = ids.size(0), s = ids.size(1), n = b * s, hdim = c.hidden_size, d = c.head_dim;
  const int64_t hq = c.num_attention_heads, hkv = c.num_key_value_heads;
  Tape tape;
  tape.checkpoint = checkpoint_layers;
  std::vector<Tensor> router_logits;  // the MoE layers', in layer order
  struct Sink {
    std::vector<Tensor>*& slot;
    ~Sink() { slot = nullptr; }
  } sink{router_logits_};
  if (aux_loss_on()) router_logits_ = &router_logits;
  InUse head(*this, ParameterGroup::Kind::Head);
  const Tensor hf = hidden_states(ids, &tape, nullptr, &head).view({n, hdim});
  router_logits_ = nullptr;
  nn::ForCausalLMLoss::Saved ls;
  Gradients out;
  out.loss = loss_->forward(hf, lm_head_, shifted_targets(labels), &ls);
  // The auxiliary loss and each MoE layer's share of its gradient (the rows of its logits).
  std::vector<Tensor> drouter(layers_.size());
  if (!router_logits.empty()) {
    const nn::LoadBalancingLoss lb = aux_loss(router_logits, dloss);
    out.loss = ops::add(out.loss, lb.loss);
    int64_t row = 0;
    for (size_t li = 0; li < layers_.size(); ++li)
      if (layers_[li].moe) drouter[li] = lb.dlogits.narrow(0, row, n), row += n;
  }
  const nn::ForCausalLMLoss::Grads lg = loss_->backward(dloss, ls);
  auto& g = out.grads;
  auto acc = [&](const std::string& name, const Tensor& t) {
    auto it = g.find(name);
    if (it == g.end()) g.emplace(name, t);
    else it->second = ops::add(it->second, t);
  };
  acc(c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight", lg.dweight);
  auto fn = final_norm_->backward(lg.dhidden.view({b, s, hdim}), tape.final_norm);
  acc("model.norm.weight", fn.dweight);
  head.release();
  if (ready) {  // whole already: the final norm's, and an untied head's
    ready("model.norm.weight", g.at("model.norm.weight"));
    if (!c.tie_word_embeddings) ready("lm_head.weight", g.at("lm_head.weight"));
  }
  Tensor dh = fn.dx;  // [B, S, H]: the gradient of the residual stream
  std::vector<std::string> handed_early;  // a layer's gradients handed to `ready` after its MLP's backward
  // Gradients of a linear layer y = x W^T (+ bias): dx = dy W, dW = dy^T x, db = column sums of dy.
  auto col_sum = [&](const Tensor& dy) { return ops::matmul(Tensor::full({1, dy.size(0)}, 1.0, dy.dtype(), dy.device()), dy).view({dy.size(1)}); };
  for (int64_t li = static_cast<int64_t>(layers_.size()) - 1; li >= 0; --li) {
    Layer& l = layers_[li];
    InUse in_use(*this, ParameterGroup::Kind::Layer, static_cast<size_t>(li));
    in_use.acquire();
    LayerTape recomputed;
    if (tape.checkpoint) layer_forward(li, tape.inputs[li], {tape.cos, tape.sin}, &recomputed, nullptr, tape.temp_scales);
    LayerTape& t = tape.checkpoint ? recomputed : tape.layers[li];
    const std::string p = fmt::format("model.layers.{}.", li);
    const bool l4 = c.is_llama4();
    const std::string mlp = l4 ? "feed_forward." : "mlp.";
    // MLP: h += down(act(gate(m)) * up(m)), or h += MoE(m)
    const Tensor dy = dh.contiguous().view({n, hdim});
    Tensor dm;
    if (l.moe) {
      const nn::MoE::Grads mg = l.moe->backward(dy, t.moe, drouter[li], /*last_use=*/true);  // the tape's only use
      if (l4) {  // the checkpoint's layouts [E, H, 2I] and [E, I, H]
        acc(p + "feed_forward.router.weight", mg.drouter_weight);
        acc(p + "feed_forward.experts.gate_up_proj", mg.dgate_up_proj.transpose(1, 2).contiguous());
        acc(p + "feed_forward.experts.down_proj", mg.ddown_proj.transpose(1, 2).contiguous());
      } else {
        acc(p + "mlp.gate.weight", mg.drouter_weight);
        acc(p + "mlp.experts.gate_up_proj", mg.dgate_up_proj);
        acc(p + "mlp.experts.down_proj", mg.ddown_proj);
      }
      if (mg.dshared_gate_up_proj.defined()) {
        const int64_t si = mg.dshared_gate_up_proj.size(0) / 2;
        acc(p + mlp + "shared_expert.gate_proj.weight", mg.dshared_gate_up_proj.narrow(0, 0, si));
        acc(p + mlp + "shared_expert.up_proj.weight", mg.dshared_gate_up_proj.narrow(0, si, si));
        acc(p + mlp + "shared_expert.down_proj.weight", mg.dshared_down_proj);
        if (mg.dshared_expert_gate.defined()) acc(p + "mlp.shared_expert_gate.weight", mg.dshared_expert_gate);
      }
      dm = mg.dhidden;
    } else {
      acc(p + mlp + "down_proj.weight", ops::matmul(dy, t.act, true, false));
      const bool packed = l.w_gate_up.defined() && packed_glu();
      const nn::MLP::Grads mg = l.mlp->backward(ops::matmul(dy, l.w_down), t.gate, t.up, packed);
      if (l.w_gate_up.defined()) {
        const Tensor dgu = packed ? mg.packed : ops::cat({mg.dgate, mg.dup}, 1);
        const Tensor dw = ops::matmul(dgu, t.m, true, false);
        if (l.gate_up_from_parts) {
          const int64_t inter = l.w_down.size(1);
          acc(p + mlp + "gate_proj.weight", dw.narrow(0, 0, inter));
          acc(p + mlp + "up_proj.weight", dw.narrow(0, inter, inter));
        } else {
          acc(p + "mlp.gate_up_proj.weight", dw);
        }
        dm = ops::matmul(dgu, l.w_gate_up);
      } else {
        acc(p + "mlp.gate_proj.weight", ops::matmul(mg.dgate, t.m, true, false));
        acc(p + "mlp.up_proj.weight", ops::matmul(mg.dup, t.m, true, false));
        dm = ops::add(ops::matmul(mg.dgate, l.w_gate), ops::matmul(mg.dup, l.w_up));
      }
    }
    const auto pn = l.post_norm->backward(dm.view({b, s, hdim}), t.post_norm);
    acc(p + "post_attention_layernorm.weight", pn.dweight);
    dh = ops::add(dh, pn.dx);
    // Attention: h += o_proj(attention(rope(q), rope(k), v))
    const Tensor dy2 = dh.contiguous().view({n, hdim});
    acc(p + "self_attn.o_proj.weight", ops::matmul(dy2, t.o, true, false));
    if (ready) {  // the MLP's, the post-attention norm's and o_proj's are whole: summed during the attention's backward
      for (auto it = g.lower_bound(p); it != g.end() && it->first.starts_with(p); ++it)
        if (!it->first.starts_with(p + "input_layernorm.") &&
            (!it->first.starts_with(p + "self_attn.") || it->first == p + "self_attn.o_proj.weight")) {
          handed_early.push_back(it->first);
          ready(it->first, it->second);
        }
    }
    const Tensor dattn = ops::matmul(dy2, l.wo).view({b, s, hq, d}).transpose(1, 2).contiguous();
    const nn::Attention::Grads ab = l.attn->backward(dattn, t.attn);
    Tensor dq = ab.dq, dk = ab.dk;                                           // [B, heads, S, D]
    if (l.temperature) dq = ops::mul(dq.to(DType::f32), tape.temp_scales).to(dtype_);
    if (l.l2_norm) dq = l.l2_norm->backward(dq, t.l2_q).dx, dk = l.l2_norm->backward(dk, t.l2_k).dx;
    if (l.use_rope) std::tie(dq, dk) = l.rope->backward(dq, dk, tape.cos, tape.sin);
    dq = dq.transpose(1, 2), dk = dk.transpose(1, 2);                    // [B, S, heads, D] views
    if (l.q_norm) {
      const auto qn = l.q_norm->backward(dq.contiguous(), t.q_norm), kn = l.k_norm->backward(dk.contiguous(), t.k_norm);
      acc(p + "self_attn.q_norm.weight", qn.dweight);
      acc(p + "self_attn.k_norm.weight", kn.dweight);
      dq = qn.dx, dk = kn.dx;
    }
    // The gradient of the one projection's output, [B, S, Hq + 2 Hkv, D]: dq, dk, dv copied once each.
    const Tensor dqkv4 = Tensor::empty({b, s, hq + 2 * hkv, d}, dtype_, device_);
    dqkv4.narrow(2, 0, hq).copy_(dq);
    dqkv4.narrow(2, hq, hkv).copy_(dk);
    dqkv4.narrow(2, hq + hkv, hkv).copy_(ab.dv.transpose(1, 2));
    const Tensor dqkv = dqkv4.view({n, (hq + 2 * hkv) * d});
    const Tensor dw = ops::matmul(dqkv, t.a, true, false);
    if (l.qkv_from_parts) {
      acc(p + "self_attn.q_proj.weight", dw.narrow(0, 0, hq * d));
      acc(p + "self_attn.k_proj.weight", dw.narrow(0, hq * d, hkv * d));
      acc(p + "self_attn.v_proj.weight", dw.narrow(0, (hq + hkv) * d, hkv * d));
    } else {
      acc(p + "self_attn.qkv_proj.weight", dw);
    }
    if (l.bqkv.defined()) {
      const Tensor db = col_sum(dqkv);
      acc(p + "self_attn.q_proj.bias", db.narrow(0, 0, hq * d));
      acc(p + "self_attn.k_proj.bias", db.narrow(0, hq * d, hkv * d));
      acc(p + "self_attn.v_proj.bias", db.narrow(0, (hq + hkv) * d, hkv * d));
    }
    const Tensor da = ops::matmul(dqkv, l.wqkv);
    const auto in = l.input_norm->backward(da.view({b, s, hdim}), t.in_norm);
    acc(p + "input_layernorm.weight", in.dweight);
    dh = ops::add(dh, in.dx);
    in_use.release();
    if (ready) {  // the rest of this layer's gradients are whole
      for (auto it = g.lower_bound(p); it != g.end() && it->first.starts_with(p); ++it)
        if (std::find(handed_early.begin(), handed_early.end(), it->first) == handed_early.end()) ready(it->first, it->second);
      handed_early.clear();
    }
  }
  if (c.scale_embeddings)
    dh = ops::scale(dh, Tensor::full({}, std::sqrt(static_cast<double>(hdim)), dtype_, Device::cpu()).item());
  if (sparse_embedding_gradient && !c.tie_word_embeddings) {
    out.embedding_rows = dh.contiguous().view({n, hdim});
  } else {
    const Tensor ids_dev = ids.device() == device_ ? ids : ids.to(device_);
    acc("model.embed_tokens.weight", ops::embedding_backward(dh.contiguous(), ids_dev, c.vocab_size));
  }
  if (ready)  // the embedding, and whatever else lies outside the layers and was not handed over above
    for (const auto& [name, grad] : g)
      if (!name.starts_with("model.layers.") && name != "model.norm.weight" && (c.tie_word_embeddings || name != "lm_head.weight"))
        ready(name, grad);
  return out;
}

}  // namespace kcpp::models
