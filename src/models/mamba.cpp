#include "models/mamba.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/cuda_graph.h"
#include "core/error.h"
#include "core/files.h"
#include "core/profile.h"
#include "models/config_json.h"
#include "models/safetensors.h"
#include "ops/nn/decode_fused.h"
#include "ops/nn/mamba_decode.h"
#include "ops/nn/sampling.h"
#include "ops/ops.h"

namespace kcpp::models {

using config_json::Reader;

namespace {

Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b = {}) {
  Tensor y = ops::matmul(x, w, false, true);
  return b.defined() ? ops::add(y, b) : y;
}

// Column sums of dy [N, M] -> [M] (a bias's gradient).
Tensor col_sum(const Tensor& dy) {
  return ops::matmul(Tensor::full({1, dy.size(0)}, 1.0, dy.dtype(), dy.device()), dy).view({dy.size(1)});
}

}  // namespace

// ---- MambaConfig ---------------------------------------------------------------------------------

namespace {
void check_size(const std::string& where, const char* key, int64_t v) {
  constexpr int64_t kMax = int64_t{1} << 24;
  KCPP_CHECK(v >= 1 && v <= kMax, "{}: '{}' must be in [1, {}], is {}", where, key, kMax, v);
}
}  // namespace

void MambaConfig::validate(const std::string& where) const {
  auto size = [&](const char* key, int64_t v) { check_size(where, key, v); };
  size("vocab_size", vocab_size), size("hidden_size", hidden_size), size("state_size", state_size);
  size("num_hidden_layers", num_hidden_layers), size("intermediate_size", intermediate_size);
  size("conv_kernel", conv_kernel), size("time_step_rank", time_step_rank);
  KCPP_CHECK(std::isfinite(layer_norm_epsilon) && layer_norm_epsilon > 0, "{}: 'layer_norm_epsilon' must be finite and positive, is {}",
             where, layer_norm_epsilon);
  if (mixer_rms_eps)
    KCPP_CHECK(std::isfinite(*mixer_rms_eps) && *mixer_rms_eps > 0, "{}: 'mixer_rms_eps' must be finite and positive, is {}", where,
               *mixer_rms_eps);
  KCPP_CHECK(hidden_act == "silu" || hidden_act == "swish",
             "{}: 'hidden_act' is '{}'; the Mamba mixer's convolution supports 'silu' (or 'swish')", where, hidden_act);
  for (const auto* list : {&bos_token_id, &eos_token_id})
    for (int64_t id : *list)
      KCPP_CHECK(id >= 0 && id < vocab_size, "{}: token id {} ({}) is outside the vocabulary [0, {})", where, id,
                 list == &bos_token_id ? "bos_token_id" : "eos_token_id", vocab_size);
}

MambaConfig MambaConfig::from_json(const nlohmann::json& j, const std::string& where) {
  KCPP_CHECK(j.is_object(), "{}: expected a JSON object", where);
  const Reader r{j, where};
  MambaConfig c;
  c.model_type = r.string("model_type", "");
  KCPP_CHECK(c.model_type == "mamba" || c.model_type == "falcon_mamba",
             "{}: model_type '{}' is not a Mamba family (mamba, falcon_mamba)", where, c.model_type);
  c.vocab_size = r.integer("vocab_size", c.vocab_size);
  c.hidden_size = r.integer("hidden_size", c.hidden_size);
  c.state_size = r.integer("state_size", c.state_size);
  c.num_hidden_layers = r.integer("num_hidden_layers", c.num_hidden_layers);
  c.expand = r.integer("expand", c.expand);
  KCPP_CHECK(c.expand >= 1 && c.expand <= 64, "{}: 'expand' must be in [1, 64], is {}", where, c.expand);
  // In range before the defaults below are computed from it (expand x hidden_size, ceil(hidden_size / 16)).
  check_size(where, "hidden_size", c.hidden_size);
  c.intermediate_size = r.integer("intermediate_size", c.expand * c.hidden_size);
  KCPP_CHECK(c.intermediate_size == c.expand * c.hidden_size,
             "{}: 'intermediate_size' is {}, but Transformers sets it to expand x hidden_size = {} x {}{}", where,
             c.intermediate_size, c.expand, c.hidden_size,
             r.has("hidden_size") ? "" : " (there is no 'hidden_size': Transformers' default was taken; give the model's)");
  c.conv_kernel = r.integer("conv_kernel", c.conv_kernel);
  if (r.has("time_step_rank") && j["time_step_rank"].is_string()) {
    KCPP_CHECK(j["time_step_rank"] == "auto", "{}: 'time_step_rank' must be an integer or \"auto\", is {}", where,
               j["time_step_rank"].dump());
    c.time_step_rank = (c.hidden_size + 15) / 16;
  } else {
    c.time_step_rank = r.integer("time_step_rank", (c.hidden_size + 15) / 16);
  }
  c.use_bias = r.boolean("use_bias", c.use_bias);
  c.use_conv_bias = r.boolean("use_conv_bias", c.use_conv_bias);
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", c.tie_word_embeddings);
  c.residual_in_fp32 = r.boolean("residual_in_fp32", c.residual_in_fp32);
  c.layer_norm_epsilon = r.real("layer_norm_epsilon", c.layer_norm_epsilon);
  if (c.model_type == "falcon_mamba") c.mixer_rms_eps = r.real("mixer_rms_eps", 1e-6);
  c.hidden_act = r.string("hidden_act", c.hidden_act);
  c.torch_dtype = r.string("dtype", r.string("torch_dtype", c.torch_dtype));
  c.bos_token_id = r.ids("bos_token_id");
  c.eos_token_id = r.ids("eos_token_id");
  if (r.has("pad_token_id")) c.pad_token_id = r.integer("pad_token_id", 0);
  c.validate(where);
  return c;
}

MambaConfig MambaConfig::from_folder(const std::filesystem::path& folder) {
  std::string where;
  const nlohmann::json j = config_json::read(folder, &where);
  return from_json(j, where);
}

nlohmann::json MambaConfig::to_json() const {
  nlohmann::json j = {{"model_type", model_type},
                      {"architectures", {model_type == "mamba" ? "MambaForCausalLM" : "FalconMambaForCausalLM"}},
                      {"vocab_size", vocab_size}, {"hidden_size", hidden_size}, {"state_size", state_size},
                      {"num_hidden_layers", num_hidden_layers}, {"expand", expand}, {"intermediate_size", intermediate_size},
                      {"conv_kernel", conv_kernel}, {"time_step_rank", time_step_rank}, {"use_bias", use_bias},
                      {"use_conv_bias", use_conv_bias}, {"tie_word_embeddings", tie_word_embeddings},
                      {"residual_in_fp32", residual_in_fp32}, {"layer_norm_epsilon", layer_norm_epsilon},
                      {"hidden_act", hidden_act}, {"dtype", torch_dtype}};
  if (mixer_rms_eps) j["mixer_rms_eps"] = *mixer_rms_eps;
  if (bos_token_id.size() == 1) j["bos_token_id"] = bos_token_id[0];
  else if (!bos_token_id.empty()) j["bos_token_id"] = bos_token_id;
  if (eos_token_id.size() == 1) j["eos_token_id"] = eos_token_id[0];
  else if (!eos_token_id.empty()) j["eos_token_id"] = eos_token_id;
  if (pad_token_id) j["pad_token_id"] = *pad_token_id;
  return j;
}

bool is_mamba_folder(const std::filesystem::path& folder) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(folder / "config.json", ec)) return false;  // ModelConfig names what is wrong
  std::ifstream f(folder / "config.json");
  if (!f.good()) return false;
  const nlohmann::json j = nlohmann::json::parse(f, nullptr, false);
  if (!j.is_object() || !j.contains("model_type") || !j["model_type"].is_string()) return false;
  const std::string t = j["model_type"].get<std::string>();
  return t == "mamba" || t == "falcon_mamba";
}

// ---- loading -------------------------------------------------------------------------------------

std::unique_ptr<MambaLM> MambaLM::from_folder(const std::filesystem::path& folder, DType dtype, Device device,
                                              const LoadOptions& options) {
  std::unique_ptr<MambaLM> m(new MambaLM());
  m->cfg_ = MambaConfig::from_folder(folder);
  m->dtype_ = dtype;
  m->device_ = device;
  const MambaConfig& c = m->cfg_;
  const WeightStore w = WeightStore::open_folder(folder);
  std::vector<std::string> missing;
  auto get = [&](const std::string& name, std::vector<int64_t> shape, DType type) {
    if (w.contains(name)) return w.load(name, type, device, &shape);
    missing.push_back(name);
    return Tensor::zeros(Shape(shape.size(), 1), type, device).expand(shape);
  };
  const int64_t h = c.hidden_size, d = c.intermediate_size, n = c.state_size, r = c.time_step_rank, k = c.conv_kernel;
  m->embed_ = get("backbone.embeddings.weight", {c.vocab_size, h}, dtype);
  bool tied = c.tie_word_embeddings;
  if (tied && w.contains("lm_head.weight") && !w.same("lm_head.weight", "backbone.embeddings.weight")) tied = false;
  m->cfg_.tie_word_embeddings = tied;
  m->lm_head_ = tied ? m->embed_ : get("lm_head.weight", {c.vocab_size, h}, dtype);
  if (tied && w.contains("lm_head.weight")) (void)w.load("lm_head.weight", dtype, device);  // the embeddings' copy
  const ops::RMSNormOptions norm{.eps = c.layer_norm_epsilon};
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = fmt::format("backbone.layers.{}.", i);
    Layer l;
    l.norm = std::make_unique<nn::RMSNorm>(get(p + "norm.weight", {h}, dtype), norm);
    l.w_in = get(p + "mixer.in_proj.weight", {2 * d, h}, dtype);
    if (c.use_bias) l.b_in = get(p + "mixer.in_proj.bias", {2 * d}, dtype);
    l.conv_w3 = get(p + "mixer.conv1d.weight", {d, 1, k}, dtype);
    l.conv_w = l.conv_w3.view({d, k});
    if (c.use_conv_bias) l.conv_b = get(p + "mixer.conv1d.bias", {d}, dtype);
    l.w_x = get(p + "mixer.x_proj.weight", {r + 2 * n, d}, dtype);
    l.w_dt = get(p + "mixer.dt_proj.weight", {d, r}, dtype);
    l.b_dt = get(p + "mixer.dt_proj.bias", {d}, DType::f32);  // the scan's delta_bias, f32 as Transformers' .float()
    l.A_log = get(p + "mixer.A_log", {d, n}, DType::f32);
    l.D = get(p + "mixer.D", {d}, DType::f32);
    l.w_out = get(p + "mixer.out_proj.weight", {h, d}, dtype);
    if (c.use_bias) l.b_out = get(p + "mixer.out_proj.bias", {h}, dtype);
    if (c.mixer_rms_eps)
      l.dt_norm = std::make_unique<nn::RMSNorm>(Tensor::full({r}, 1.0, dtype, device), ops::RMSNormOptions{.eps = *c.mixer_rms_eps});
    l.conv = std::make_unique<nn::CausalConv1d>(l.conv_w, l.conv_b, true);
    l.conv_update = std::make_unique<nn::CausalConv1dUpdate>(l.conv_w, l.conv_b, true);
    const nn::SelectiveScan::Options so{.delta_softplus = true, .bc_rms_eps = c.mixer_rms_eps};
    l.scan = std::make_unique<nn::SelectiveScan>(so);
    l.state_update = std::make_unique<nn::SelectiveStateUpdate>(so);
    m->layers_.push_back(std::move(l));
  }
  m->final_norm_ = std::make_unique<nn::RMSNorm>(get("backbone.norm_f.weight", {h}, dtype), norm);
  m->loss_ = std::make_unique<nn::ForCausalLMLoss>();
  KCPP_CHECK(missing.empty(), "{}: missing weight{} {} (config.json: {} with {} layers)", folder.string(), missing.size() > 1 ? "s" : "",
             name_list(missing), c.model_type, c.num_hidden_layers);
  m->unused_weights_ = w.unused();
  if (!m->unused_weights_.empty()) {
    const std::string what = fmt::format("{}: tensors of the weight files not used by the model ({} with {} layers): {}",
                                         folder.string(), c.model_type, c.num_hidden_layers, fmt::join(m->unused_weights_, ", "));
    KCPP_CHECK(!options.strict, "{}", what);
    if (options.warn) options.warn(what + " (ignored)");
    else fmt::print(stderr, "warning: {} (ignored)\n", what);
  }
  return m;
}

void MambaLM::visit_slots(const std::function<void(nn::Slot&)>& fn) {
  for (Layer& l : layers_) {
    fn(*l.norm);
    if (l.dt_norm) fn(*l.dt_norm);
    fn(*l.conv), fn(*l.conv_update), fn(*l.scan), fn(*l.state_update);
  }
  fn(*final_norm_);
  fn(*loss_);
}

std::vector<std::pair<std::string, Tensor>> MambaLM::parameters() const {
  std::vector<std::pair<std::string, Tensor>> out{{"backbone.embeddings.weight", embed_}};
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    const std::string p = fmt::format("backbone.layers.{}.", i);
    out.emplace_back(p + "norm.weight", l.norm->weight);
    out.emplace_back(p + "mixer.in_proj.weight", l.w_in);
    if (l.b_in.defined()) out.emplace_back(p + "mixer.in_proj.bias", l.b_in);
    out.emplace_back(p + "mixer.conv1d.weight", l.conv_w3);
    if (l.conv_b.defined()) out.emplace_back(p + "mixer.conv1d.bias", l.conv_b);
    out.emplace_back(p + "mixer.x_proj.weight", l.w_x);
    out.emplace_back(p + "mixer.dt_proj.weight", l.w_dt);
    out.emplace_back(p + "mixer.dt_proj.bias", l.b_dt);
    out.emplace_back(p + "mixer.A_log", l.A_log);
    out.emplace_back(p + "mixer.D", l.D);
    out.emplace_back(p + "mixer.out_proj.weight", l.w_out);
    if (l.b_out.defined()) out.emplace_back(p + "mixer.out_proj.bias", l.b_out);
  }
  out.emplace_back("backbone.norm_f.weight", final_norm_->weight);
  if (!cfg_.tie_word_embeddings) out.emplace_back("lm_head.weight", lm_head_);
  return out;
}

void MambaLM::save(const std::filesystem::path& folder) const {
  std::filesystem::create_directories(folder);
  MambaConfig c = cfg_;
  c.torch_dtype = dtype_ == DType::bf16 ? "bfloat16" : dtype_ == DType::f16 ? "float16" : "float32";
  const auto tmp = folder / "config.json.tmp";
  {
    std::ofstream out(tmp);
    out << c.to_json().dump(2) << "\n";
    KCPP_CHECK(out.good(), "{}: cannot write", tmp.string());
  }
  std::filesystem::rename(tmp, folder / "config.json");
  save_safetensors(folder / "model.safetensors", parameters(), {{"format", "pt"}});
}

// ---- forward -------------------------------------------------------------------------------------

struct MambaLM::LayerTape {
  nn::RMSNorm::Saved norm, dt_norm;
  Tensor a;        // [B S, H] the normed input
  Tensor x;        // [B, D, L] the convolution's input
  Tensor xc;       // [B S, D] its output, token-major (x_proj's input)
  Tensor dt_low;   // [B S, R] dt_proj's input (after the dt norm)
  Tensor y;        // [B S, D] the scan's output, token-major (out_proj's input)
  nn::SelectiveScan::Saved scan;
};

Tensor MambaLM::layer_forward(size_t li, const Tensor& h, LayerTape* t, Cache* cache) {
  Layer& l = layers_[li];
  const MambaConfig& c = cfg_;
  const int64_t b = h.size(0), s = h.size(1), n = b * s, d = c.intermediate_size, r = c.time_step_rank, st = c.state_size;
  nn::RMSNorm::Saved ns;
  const bool wide = f32_residual();
  const Tensor a = l.norm->forward(wide ? h.to(dtype_) : h, t ? &ns : nullptr).view({n, c.hidden_size});
  // [B, 2D, L], L contiguous: x the first D channels, z the gate.
  const Tensor xz = linear(a, l.w_in, l.b_in).view({b, s, 2 * d}).transpose(1, 2).contiguous();
  const Tensor x = xz.narrow(1, 0, d), z = xz.narrow(1, d, d);
  const bool decode = cache && cache->length > 0;
  Tensor xc;  // [B, D, L]
  if (decode) {
    xc = l.conv_update->forward(x, cache->conv[li]);
  } else {
    xc = l.conv->forward(x);
    if (cache) {  // the last W - 1 inputs (zeros before the first)
      const int64_t k = c.conv_kernel - 1;
      Tensor state = Tensor::zeros({b, d, k}, dtype_, device_);
      const int64_t take = std::min(k, s);
      if (take > 0) state.narrow(2, k - take, take).copy_(x.narrow(2, s - take, take));
      cache->conv[li] = state;
    }
  }
  const Tensor xc_t = xc.transpose(1, 2).contiguous().view({n, d});
  const Tensor xdbl = ops::matmul(xc_t, l.w_x, false, true);  // [B S, R + 2N]
  Tensor dt_low = xdbl.narrow(1, 0, r).contiguous();
  nn::RMSNorm::Saved dns;
  if (l.dt_norm) dt_low = l.dt_norm->forward(dt_low, t ? &dns : nullptr);
  auto channels_first = [&](const Tensor& m, int64_t width) { return m.contiguous().view({b, s, width}).transpose(1, 2).contiguous(); };
  const Tensor dt = channels_first(ops::matmul(dt_low, l.w_dt, false, true), d);  // [B, D, L], before bias and softplus
  const Tensor Bm = channels_first(xdbl.narrow(1, r, st), st), Cm = channels_first(xdbl.narrow(1, r + st, st), st);
  const Tensor A = decode ? cached_A(*cache, li) : ops::neg(ops::exp(l.A_log));
  Tensor y;  // [B, D, L]
  if (decode) {
    auto step = [&](int64_t p) {
      return l.state_update->forward(cache->ssm[li], xc.select(2, p), dt.select(2, p), A, Bm.select(2, p).contiguous(),
                                     Cm.select(2, p).contiguous(), l.D, z.select(2, p), l.b_dt).unsqueeze(2);
    };
    if (s == 1) {
      y = step(0);  // one position (a decoding step): its output is y
    } else {
      y = Tensor::empty({b, d, s}, dtype_, device_);
      for (int64_t p = 0; p < s; ++p) y.narrow(2, p, 1).copy_(step(p));
    }
  } else {
    Tensor last;
    nn::SelectiveScan::Saved ss;
    y = l.scan->forward({xc, dt, A, Bm, Cm, l.D, z, l.b_dt}, cache ? &last : nullptr, t ? &ss : nullptr);
    if (cache) cache->ssm[li] = last;
    if (t) t->scan = std::move(ss);
  }
  const Tensor y_t = y.transpose(1, 2).contiguous().view({n, d});
  const Tensor out = linear(y_t, l.w_out, l.b_out).view({b, s, c.hidden_size});
  if (t) {
    t->norm = std::move(ns), t->dt_norm = std::move(dns);
    t->a = a, t->x = x, t->xc = xc_t, t->dt_low = dt_low, t->y = y_t;
  }
  return ops::add(h, wide ? out.to(DType::f32) : out);
}

bool MambaLM::decode_fused_possible(int64_t rows) const {
  const MambaConfig& c = cfg_;
  return ops::mamba_decode_fused(device_, dtype_, {rows, c.hidden_size, c.time_step_rank, c.state_size, c.conv_kernel});
}

const Tensor& MambaLM::cached_A(Cache& cache, size_t li) const {
  if (cache.A.size() != layers_.size()) cache.A.assign(layers_.size(), Tensor());
  if (!cache.A[li].defined()) cache.A[li] = ops::neg(ops::exp(layers_[li].A_log));
  return cache.A[li];
}

Tensor MambaLM::decode_layers_fused(const Tensor& h, Cache& cache) {
  const MambaConfig& c = cfg_;
  const int64_t b = h.size(0), hd = c.hidden_size;
  // Every layer's A, and contiguous states, before the layers' chain of launches (once, at the first
  // step): the state step reads A before it waits for the kernel ahead of it (ops/cuda/pdl.cuh).
  for (size_t li = 0; li < layers_.size(); ++li) {
    (void)cached_A(cache, li);
    if (!cache.ssm[li].is_contiguous()) cache.ssm[li] = cache.ssm[li].contiguous();
    if (!cache.conv[li].is_contiguous()) cache.conv[li] = cache.conv[li].contiguous();
  }
  ++cache.fused_steps;
  // The residual stream is x + delta: delta, the last out_proj, is added by the next layer's norm.
  Tensor x = h.view({b, hd}), delta;
  for (size_t li = 0; li < layers_.size(); ++li) {
    Layer& l = layers_[li];
    const ops::MambaNormInProj in = ops::mamba_norm_in_proj(x, delta, l.norm->weight, l.norm->options, l.w_in, l.b_in,
                                                            cache.conv[li], l.conv_w, l.conv_b);
    x = in.s;
    ops::MambaSsmStep st;
    st.xz = in.xz, st.xc = in.xc, st.xdbl = ops::matmul(in.xc, l.w_x, false, true), st.w_dt = l.w_dt, st.dt_bias = l.b_dt;
    st.A = cached_A(cache, li), st.D = l.D, st.ssm_state = cache.ssm[li];
    st.dt_softplus = l.scan->options.delta_softplus, st.bc_rms_eps = l.scan->options.bc_rms_eps;
    if (l.dt_norm) st.dt_rms_eps = l.dt_norm->options.eps;
    delta = linear(ops::mamba_ssm_step(st), l.w_out, l.b_out);
  }
  const Tensor out = delta.defined() ? ops::add(x, x.dtype() == delta.dtype() ? delta : delta.to(x.dtype())) : x;
  return out.view({b, 1, hd});
}

Tensor MambaLM::final_norm_forward(const Tensor& h, nn::RMSNorm::Saved* saved, Cache* cache) {
  if (!f32_residual()) return final_norm_->forward(h, saved);
  Tensor w;
  if (cache) {
    if (!cache->final_weight_f32.defined()) cache->final_weight_f32 = final_norm_->weight.to(DType::f32);
    w = cache->final_weight_f32;
  } else {
    w = final_norm_->weight.to(DType::f32);
  }
  const ops::RMSNormForward f = ops::rms_norm_forward(h, w, final_norm_->options);
  if (saved) *saved = {h, f.rstd};
  return f.y.to(dtype_);
}

nn::RMSNorm::Grads MambaLM::final_norm_backward(const Tensor& dy, const nn::RMSNorm::Saved& saved) {
  if (!f32_residual()) return final_norm_->backward(dy, saved);
  const ops::RMSNormBackward b = ops::rms_norm_backward(dy.to(DType::f32), saved.x, final_norm_->weight.to(DType::f32),
                                                        saved.rstd, final_norm_->options);
  return {b.dx, b.dw.to(dtype_)};
}

Tensor MambaLM::hidden_states(const Tensor& ids, std::vector<LayerTape>* tapes, nn::RMSNorm::Saved* final_saved, Cache* cache,
                              std::vector<Tensor>* inputs, GroupInUse* head) {
  KCPP_CHECK(ids.dim() == 2, "MambaLM: input_ids must be [batch, seq], got {} dims", ids.dim());
  KCPP_CHECK(!(cache && parameter_use), "MambaLM: a forward with a cache (generation) is not supported while "
             "parameter_use is set (ZeRO-3 training: gather the parameters and unset it first; ZeRO-1 / 2 with the "
             "parameters' all-gather deferred: DataParallel::gather_parameters() unsets it)");
  const Tensor ids_dev = ids.device() == device_ ? ids : ids.to(device_);
  Tensor h;
  {
    GroupInUse embedding(parameter_use, ParameterGroup::Kind::Embedding);
    embedding.acquire();
    h = ops::embedding(embed_, ids_dev, !(cache && cache->picked_ids));
  }
  if (f32_residual()) h = h.to(DType::f32);
  if (cache && cache->length == 0) {
    cache->conv.assign(layers_.size(), Tensor()), cache->ssm.assign(layers_.size(), Tensor());
    cache->A.clear(), cache->final_weight_f32 = Tensor();  // made again from this model's weights
  }
  if (tapes) tapes->resize(layers_.size());
  if (inputs) inputs->resize(layers_.size());
  if (cache && cache->length > 0 && ids.size(1) == 1 && !tapes && !inputs && decode_fused_possible(ids.size(0))) {
    h = decode_layers_fused(h, *cache);
  } else {
    for (size_t li = 0; li < layers_.size(); ++li) {
      if (inputs) (*inputs)[li] = h;
      GroupInUse layer(parameter_use, ParameterGroup::Kind::Layer, li);
      layer.acquire();
      h = layer_forward(li, h, tapes ? &(*tapes)[li] : nullptr, cache);
    }
  }
  if (cache) cache->length += ids.size(1);
  GroupInUse own_head(parameter_use, ParameterGroup::Kind::Head);
  (head ? *head : own_head).acquire();
  return final_norm_forward(h, final_saved, cache);
}

Tensor MambaLM::forward(const Tensor& ids, Cache* cache) {
  GroupInUse head(parameter_use, ParameterGroup::Kind::Head);
  const Tensor h = hidden_states(ids, nullptr, nullptr, cache, nullptr, &head);
  const int64_t b = ids.size(0), s = ids.size(1);
  return ops::matmul(h.view({b * s, cfg_.hidden_size}), lm_head_, false, true).view({b, s, cfg_.vocab_size});
}

std::vector<int64_t> MambaLM::generate(const std::vector<int64_t>& prompt, int64_t max_new_tokens, const Sampling& sampling,
                                       const std::vector<int64_t>* stop, StopReason* reason, CausalLM::GenerationStats* stats) {
  KCPP_CHECK(!prompt.empty(), "generate: the prompt has no tokens");
  auto r = generate_batch({prompt}, max_new_tokens, sampling, stop, {}, stats);
  if (reason) *reason = r[0].reason;
  return std::move(r[0].ids);
}

std::vector<CausalLM::Generated> MambaLM::generate_batch(const std::vector<std::vector<int64_t>>& prompts, int64_t max_new_tokens,
                                                         const Sampling& sampling, const std::vector<int64_t>* stop,
                                                         const std::function<void(size_t, int64_t)>& on_token,
                                                         CausalLM::GenerationStats* stats) {
  KCPP_CHECK(!prompts.empty(), "generate: no prompts were given");
  KCPP_CHECK(max_new_tokens >= 0, "generate: max_new_tokens is {}; it must be 0 or more", max_new_tokens);
  sampling.validate();
  const bool many = prompts.size() > 1;
  auto which = [&](size_t i) { return many ? fmt::format("prompt {}'s ", i) : std::string("the prompt's "); };
  for (size_t i = 0; i < prompts.size(); ++i) {
    KCPP_CHECK(!prompts[i].empty(), "generate: {}has no tokens", many ? fmt::format("prompt {} ", i) : std::string("the prompt "));
    for (size_t j = 0; j < prompts[i].size(); ++j)
      KCPP_CHECK(prompts[i][j] >= 0 && prompts[i][j] < cfg_.vocab_size,
                 "generate: {}token id {} (position {}) is outside the model's vocabulary of {} ids (0 to {})", which(i),
                 prompts[i][j], j, cfg_.vocab_size, cfg_.vocab_size - 1);
  }
  const std::vector<int64_t>& stops = stop ? *stop : cfg_.eos_token_id;
  const size_t rows = prompts.size();
  std::vector<CausalLM::Generated> out(rows);
  for (size_t i = 0; i < rows; ++i) out[i].ids = prompts[i];
  CausalLM::GenerationStats st;
  if (max_new_tokens == 0) {
    if (stats) *stats = st;
    return out;
  }
  const ops::SampleOptions so{sampling.temperature, sampling.top_k, sampling.top_p};
  std::vector<bool> done(rows, false);  // a row that made a stop token
  // The rows of the batch as it stands (prompt indices): all of them, fewer once rows finish.
  std::vector<size_t> active(rows);
  for (size_t i = 0; i < rows; ++i) active[i] = i;
  // The batch's rows' next tokens from logits [active rows, V] on their device, as CausalLM picks
  // (ops/nn/sampling.h; prompt i's seed is sampling.seed + i, its position the new token's).
  auto pick = [&](const Tensor& logits_all) {
    const size_t n = active.size();
    const Tensor logits = logits_all.narrow(1, 0, cfg_.vocab_size);
    std::vector<uint64_t> seeds(n);
    std::vector<int64_t> positions(n);
    for (size_t j = 0; j < n; ++j) seeds[j] = sampling.seed + active[j], positions[j] = static_cast<int64_t>(out[active[j]].ids.size());
    const std::vector<int64_t> picked =
        (sampling.temperature <= 0.0
             ? ops::argmax_checked(logits.contiguous())
             : ops::sample_checked(ops::sampling_on_device(so) ? logits : logits.to(Device::cpu()), so, seeds, positions))
            .to_i64_vector();
    std::vector<int64_t> tokens(n);
    for (size_t j = 0; j < n; ++j) {
      const size_t i = active[j];
      if (done[i]) {  // a finished row's pick is dropped, whatever its logits
        tokens[j] = out[i].ids.back();
        continue;
      }
      if (const int64_t bad = picked[2 * j + 1]; bad >= 0)
        KCPP_FAIL("generate: the model produced non-finite logits ({} for token id {}) at position {}{}; check the weights "
                  "(NaN or infinite values in the safetensors) and config.json",
                  logits.narrow(0, static_cast<int64_t>(j), 1).narrow(1, bad, 1).contiguous().to_f64_vector()[0], bad,
                  out[i].ids.size() - 1, many ? fmt::format(" of prompt {}", i) : std::string());
      tokens[j] = picked[2 * j];
    }
    return tokens;
  };
  // Timings: each step's pick reads the tokens back to the host, so the clock sees the device's work.
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  // The prompts' forwards, each alone (a state-space model takes no padding: the scan would carry it
  // into the state), into caches of one row, then the rows' states side by side in one cache.
  Cache cache;
  std::vector<Tensor> last(rows);
  {
    std::vector<Cache> alone(rows);
    for (size_t i = 0; i < rows; ++i) {
      const int64_t n = static_cast<int64_t>(prompts[i].size());
      const Tensor logits = forward(Tensor::from_i64(prompts[i], {1, n}, DType::i64, device_), &alone[i]);
      last[i] = logits.narrow(1, n - 1, 1).contiguous().view({1, logits.size(2)});
    }
    if (rows == 1) {
      cache = std::move(alone[0]);
    } else {
      cache.conv.resize(layers_.size()), cache.ssm.resize(layers_.size());
      for (size_t li = 0; li < layers_.size(); ++li) {
        std::vector<Tensor> conv, ssm;
        for (const Cache& c : alone) conv.push_back(c.conv[li]), ssm.push_back(c.ssm[li]);
        cache.conv[li] = ops::cat(conv, 0).contiguous(), cache.ssm[li] = ops::cat(ssm, 0).contiguous();
      }
      cache.final_weight_f32 = alone[0].final_weight_f32;
      // Only length > 0 matters to a forward (the rows' own lengths differ; no position enters the model).
      for (const Cache& c : alone) cache.length = std::max(cache.length, c.length);
    }
  }
  cache.picked_ids = true;  // every forward after the prompts' takes picked tokens
  size_t live = rows;
  // Appends the picks of the rows still generating; a row stops at a token of `stops`.
  auto take = [&](const std::vector<int64_t>& tokens) {
    for (size_t j = 0; j < active.size(); ++j) {
      const size_t i = active[j];
      if (done[i]) continue;
      out[i].ids.push_back(tokens[j]);
      if (on_token) on_token(i, tokens[j]);
      if (std::find(stops.begin(), stops.end(), tokens[j]) != stops.end()) {
        out[i].reason = StopReason::StopToken;
        done[i] = true;
        --live;
      }
    }
  };
  take(pick(rows == 1 ? last[0] : ops::cat(last, 0)));
  const auto t1 = clock::now();
  st.first_token_seconds = st.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  st.prefills = static_cast<int64_t>(rows);
  // One-token steps for the batch's rows together, as a CUDA graph on CUDA (KCPP_DECODE_GRAPHS=0
  // turns graphs off, as for CausalLM): a batch's first step runs eagerly (warming every kernel and
  // library), its second is captured, every later one replays it.  A step writes its conv and SSM
  // states in place, so the graph's addresses stay the cache's; its tokens come in through
  // `step_ids`, overwritten before each replay, and its logits come out in the tensor the capture
  // returned.  A finished row keeps its place (its picks dropped) until half the batch has finished;
  // then the batch keeps its live rows' states only, and the smaller batch gets a graph of its own.
  // A capture the runtime refuses leaves the steps eager.
  auto env_is = [](const char* name, const char* value) {
    const char* e = std::getenv(name);
    return e && std::string(e) == value;
  };
  bool graphs = device_.is_cuda() && cuda_graphs_compiled() && !profile::enabled() && !env_is("KCPP_DECODE_GRAPHS", "0");
  CudaGraph graph;
  Tensor step_ids, step_logits;
  auto decode_step = [&](const std::vector<int64_t>& tokens) -> Tensor {
    const int64_t b = static_cast<int64_t>(tokens.size());
    const Tensor host = Tensor::from_i64(tokens, {b, 1}, DType::i64, Device::cpu());
    if (!graphs) return forward(host.to(device_), &cache);
    if (!step_ids.defined()) {
      step_ids = host.to(device_);
      return forward(step_ids, &cache);
    }
    step_ids.copy_(host);
    if (!graph.captured()) {
      const int64_t length = cache.length;  // recording runs the host side (which advances it) but no GPU work
      try {
        nn::CaptureScope capturing;
        graph.capture(device_, [&] { step_logits = forward(step_ids, &cache); });
      } catch (const std::exception& e) {
        fmt::print(stderr, "kcpp: decoding without CUDA graphs ({})\n", e.what());
        graphs = false;
      }
      cache.length = length;
      if (!graphs) {
        step_logits = Tensor();
        return forward(step_ids, &cache);
      }
    }
    graph.replay();
    ++st.graph_replays;
    ++cache.length;
    return step_logits;
  };
  // The live rows' states only, in the batch's order; the graph of the larger batch dropped.
  auto compact = [&] {
    std::vector<int64_t> keep;
    std::vector<size_t> rest;
    for (size_t j = 0; j < active.size(); ++j)
      if (!done[active[j]]) keep.push_back(static_cast<int64_t>(j)), rest.push_back(active[j]);
    auto rows_of = [&](const Tensor& t) {
      std::vector<Tensor> parts;
      for (int64_t j : keep) parts.push_back(t.narrow(0, j, 1));
      return ops::cat(parts, 0).contiguous();
    };
    graph.reset();
    step_ids = Tensor(), step_logits = Tensor();
    for (size_t li = 0; li < layers_.size(); ++li) cache.conv[li] = rows_of(cache.conv[li]), cache.ssm[li] = rows_of(cache.ssm[li]);
    active = std::move(rest);
  };
  for (int64_t step = 1; step < max_new_tokens && live > 0; ++step) {
    if (live <= active.size() / 2) compact();
    std::vector<int64_t> tokens(active.size());
    for (size_t j = 0; j < active.size(); ++j) tokens[j] = out[active[j]].ids.back();
    const Tensor logits = decode_step(tokens);
    const size_t before = live;
    take(pick(logits.view({static_cast<int64_t>(active.size()), logits.size(2)})));
    st.decode_tokens += static_cast<int64_t>(before);
  }
  st.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  if (stats) *stats = st;
  return out;
}

// ---- loss and backward ---------------------------------------------------------------------------

Tensor MambaLM::shifted_targets(const Tensor& labels) const {
  KCPP_CHECK(labels.dim() == 2, "MambaLM: labels must be [batch, seq], got {} dims", labels.dim());
  const int64_t b = labels.size(0), s = labels.size(1);
  Tensor l = labels.device() == device_ ? labels : labels.to(device_);
  if (l.dtype() != DType::i64) l = l.to(DType::i64);
  const Tensor none = Tensor::full({b, 1}, -100, DType::i64, device_);
  return (s > 1 ? ops::cat({l.narrow(1, 1, s - 1), none}, 1) : none).contiguous().view({b * s});
}

Tensor MambaLM::loss(const Tensor& ids, const Tensor& labels) {
  KCPP_CHECK(labels.shape() == ids.shape(), "MambaLM::loss: labels must match input_ids");
  GroupInUse head(parameter_use, ParameterGroup::Kind::Head);
  const Tensor h = hidden_states(ids, nullptr, nullptr, nullptr, nullptr, &head).view({ids.numel(), cfg_.hidden_size});
  return loss_->forward(h, lm_head_, shifted_targets(labels));
}

CausalLM::Gradients MambaLM::loss_and_gradients(const Tensor& ids, const Tensor& labels, double dloss, ops::Reduction reduction,
                                                const CausalLM::GradientReady& ready) {
  KCPP_CHECK(labels.shape() == ids.shape(), "MambaLM: labels must match input_ids");
  const nn::ForCausalLMLoss::ReductionScope scope(*loss_, reduction);
  const MambaConfig& c = cfg_;
  const int64_t b = ids.size(0), s = ids.size(1), n = b * s, hd = c.hidden_size, d = c.intermediate_size;
  std::vector<LayerTape> tapes;
  std::vector<Tensor> inputs;  // checkpointing: each layer's input, its tape made again in the backward
  nn::RMSNorm::Saved fs;
  const bool ckpt = checkpoint_layers;
  const bool wide = f32_residual();
  GroupInUse head(parameter_use, ParameterGroup::Kind::Head);
  const Tensor hf = hidden_states(ids, ckpt ? nullptr : &tapes, &fs, nullptr, ckpt ? &inputs : nullptr, &head).view({n, hd});
  nn::ForCausalLMLoss::Saved ls;
  CausalLM::Gradients out;
  out.loss = loss_->forward(hf, lm_head_, shifted_targets(labels), &ls);
  const nn::ForCausalLMLoss::Grads lg = loss_->backward(dloss, ls);
  auto& g = out.grads;
  const std::string embedding = "backbone.embeddings.weight";
  std::vector<std::string> pending;  // made since the last hand-over, in their order
  auto acc = [&](const std::string& name, const Tensor& t) {
    auto it = g.find(name);
    if (it == g.end()) g.emplace(name, t), pending.push_back(name);
    else it->second = ops::add(it->second, t);
  };
  // The gradients made since the last call are whole (a tied head's embedding only at the end).
  auto hand_over = [&](bool last) {
    if (!ready) return;
    for (const std::string& name : pending)
      if (last || name != embedding) ready(name, g.at(name));
    std::erase_if(pending, [&](const std::string& name) { return last || name != embedding; });
  };
  acc(c.tie_word_embeddings ? embedding : "lm_head.weight", lg.dweight);
  auto fn = final_norm_backward(lg.dhidden.view({b, s, hd}), fs);
  acc("backbone.norm_f.weight", fn.dweight);
  head.release();
  hand_over(false);
  Tensor dh = fn.dx;
  // [B, D, L] from a token-major [B S, D], and back.
  auto channels_first = [&](const Tensor& m, int64_t width) { return m.contiguous().view({b, s, width}).transpose(1, 2).contiguous(); };
  auto token_major = [&](const Tensor& m) { return m.transpose(1, 2).contiguous().view({n, m.size(1)}); };
  for (int64_t li = static_cast<int64_t>(layers_.size()) - 1; li >= 0; --li) {
    Layer& l = layers_[li];
    GroupInUse in_use(parameter_use, ParameterGroup::Kind::Layer, static_cast<size_t>(li));
    in_use.acquire();
    LayerTape recomputed;
    if (ckpt) {
      layer_forward(static_cast<size_t>(li), inputs[li], &recomputed, nullptr);
      inputs[li] = Tensor();  // its activations now live in `recomputed`
    }
    LayerTape& t = ckpt ? recomputed : tapes[li];
    const std::string p = fmt::format("backbone.layers.{}.mixer.", li);
    // With residual_in_fp32 dh is f32: the mixer's output was added widened, so its gradient is dh
    // rounded to the dtype.
    const Tensor dy_out = (wide ? dh.to(dtype_) : dh).contiguous().view({n, hd});
    acc(p + "out_proj.weight", ops::matmul(dy_out, t.y, true, false));
    if (l.b_out.defined()) acc(p + "out_proj.bias", col_sum(dy_out));
    const Tensor dy = channels_first(ops::matmul(dy_out, l.w_out), d);
    const nn::SelectiveScan::Grads sg = l.scan->backward(dy, t.scan);
    // A = -exp(A_log): dA_log = dA * A.
    acc(p + "A_log", ops::mul(sg.dA, t.scan.in.A));
    acc(p + "D", sg.dD);
    acc(p + "dt_proj.bias", sg.ddelta_bias);
    const Tensor ddt = token_major(sg.ddelta);  // [B S, D]
    acc(p + "dt_proj.weight", ops::matmul(ddt, t.dt_low, true, false));
    Tensor ddt_low = ops::matmul(ddt, l.w_dt);  // [B S, R]
    if (l.dt_norm) ddt_low = l.dt_norm->backward(ddt_low, t.dt_norm).dx;
    const Tensor dxdbl = ops::cat({ddt_low, token_major(sg.dB), token_major(sg.dC)}, 1);  // [B S, R + 2N]
    acc(p + "x_proj.weight", ops::matmul(dxdbl, t.xc, true, false));
    const Tensor dxc = ops::add(channels_first(ops::matmul(dxdbl, l.w_x), d), sg.du);  // [B, D, L]
    const nn::CausalConv1d::Grads cg = l.conv->backward(dxc, t.x);
    acc(p + "conv1d.weight", cg.dweight.view({d, 1, c.conv_kernel}));
    if (cg.dbias.defined()) acc(p + "conv1d.bias", cg.dbias);
    const Tensor dxz = token_major(ops::cat({cg.dx, sg.dz}, 1));  // [B S, 2D]
    acc(p + "in_proj.weight", ops::matmul(dxz, t.a, true, false));
    if (l.b_in.defined()) acc(p + "in_proj.bias", col_sum(dxz));
    const auto nb = l.norm->backward(ops::matmul(dxz, l.w_in).view({b, s, hd}), t.norm);
    acc(fmt::format("backbone.layers.{}.norm.weight", li), nb.dweight);
    // The norm read h rounded to the dtype; layer 0's h is the embedding's output widened, whose
    // gradient adds the residual's (rounded) and the norm's in the dtype, as autograd does.
    if (!wide) dh = ops::add(dh, nb.dx);
    else if (li > 0) dh = ops::add(dh, nb.dx.to(DType::f32));
    else dh = ops::add(dh.to(dtype_), nb.dx);
    hand_over(false);
  }
  const Tensor ids_dev = ids.device() == device_ ? ids : ids.to(device_);
  acc(embedding, ops::embedding_backward(dh.contiguous(), ids_dev, c.vocab_size));
  hand_over(true);
  return out;
}

}  // namespace kcpp::models
