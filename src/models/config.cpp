#include "models/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/files.h"
#include "models/config_json.h"

namespace kcpp::models {

using config_json::Reader;

namespace {

constexpr const char* kFamilies[] = {"llama",   "mistral",   "qwen2",     "qwen3",     "gemma",
                                     "phi3",    "mixtral",   "qwen3_moe", "qwen2_moe", "llama4_text"};

bool is_moe_family(const std::string& t) { return t == "mixtral" || t == "qwen3_moe" || t == "qwen2_moe"; }

// "in [lo, hi]", or ">= lo" when nothing above is out of range.
std::string range(int64_t lo, int64_t hi) {
  return hi == std::numeric_limits<int64_t>::max() ? fmt::format(">= {}", lo) : fmt::format("in [{}, {}]", lo, hi);
}
void check_in(const std::string& where, const char* key, int64_t v, int64_t lo, int64_t hi) {
  KCPP_CHECK(v >= lo && v <= hi, "{}: '{}' must be {}, is {}", where, key, range(lo, hi), v);
}
void check_positive(const std::string& where, const char* key, double v) {
  KCPP_CHECK(std::isfinite(v) && v > 0, "{}: '{}' must be a finite number > 0, is {}", where, key, v);
}

// Sizes (vocabulary, widths, heads, layers) at most 2^24: real models stay far below it, and a
// weight's element count (two sizes multiplied, at most 3 x 2^48) stays far inside int64.
constexpr int64_t kMaxSize = int64_t{1} << 24;
constexpr int64_t kMaxPositions = std::numeric_limits<int32_t>::max();

RopeScaling parse_rope_scaling(const nlohmann::json& r, const std::string& where) {
  RopeScaling s;
  if (r.is_null()) return s;
  const std::string w = where.find("rope_parameters") != std::string::npos ? where : where + ": rope_scaling";
  KCPP_CHECK(r.is_object(), "{} must be an object or null", w);
  const Reader rd{r, w};
  // Transformers accepts "rope_type" and the older "type".
  const std::string type = rd.string("rope_type", rd.string("type", "default"));
  if (type == "default") return s;
  s.factor = rd.real("factor", 1.0);
  if (type == "linear") {
    s.type = RopeScaling::Type::Linear;
  } else if (type == "dynamic") {
    s.type = RopeScaling::Type::Dynamic;
    s.original_max_position_embeddings = rd.integer("original_max_position_embeddings", 0);
    KCPP_CHECK(!rd.has("original_max_position_embeddings") || s.original_max_position_embeddings >= 1,
               "{}: 'original_max_position_embeddings' must be >= 1, is {}", w, s.original_max_position_embeddings);
  } else if (type == "llama3") {
    s.type = RopeScaling::Type::Llama3;
    s.low_freq_factor = rd.real("low_freq_factor", 1.0);
    s.high_freq_factor = rd.real("high_freq_factor", 4.0);
    s.original_max_position_embeddings = rd.integer("original_max_position_embeddings");
  } else {
    KCPP_FAIL("{}: rope_type '{}' is not supported (default, linear, dynamic, llama3)", w, type);
  }
  s.validate(w);
  return s;
}

// The sliding-window keys of each family, as its Transformers 5 configuration class reads them.
void read_sliding_window(const Reader& r, ModelConfig& c) {
  const std::string& t = c.model_type;
  if (t != "mistral" && t != "phi3" && t != "qwen2" && t != "qwen3" && t != "mixtral" && t != "qwen3_moe" && t != "qwen2_moe")
    return;  // llama, gemma: no window
  // The class default when the key is absent (Mistral, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE: 4096; Phi-3,
  // Mixtral: none); null: none.
  if (!r.j.contains("sliding_window")) {
    if (t != "phi3" && t != "mixtral") c.sliding_window = 4096;
  } else if (r.has("sliding_window")) {
    c.sliding_window = r.integer("sliding_window");
  }
  if (t == "qwen3_moe") {  // every layer, with use_sliding_window
    c.use_sliding_window = r.boolean("use_sliding_window", false);
    if (!c.use_sliding_window) c.sliding_window.reset();
  }
  if (t == "mistral" || t == "phi3" || t == "mixtral" || t == "qwen3_moe") {  // every layer
    c.layer_types.assign(static_cast<size_t>(c.num_hidden_layers), c.sliding_window ? "sliding_attention" : "full_attention");
    return;
  }
  c.use_sliding_window = r.boolean("use_sliding_window", false);
  c.max_window_layers = r.integer("max_window_layers", 28);
  if (t == "qwen2_moe") {
    // Qwen2MoeConfig: the window only with use_sliding_window (its sliding_window becomes 0 without);
    // unless the config lists layer_types, layer i slides when use_sliding_window, i < max_window_layers
    // and i is even ((i + 1) % 2 != 0).
    if (!c.use_sliding_window) c.sliding_window.reset();
    if (c.sliding_window) check_in(r.where, "sliding_window", *c.sliding_window, 1, std::numeric_limits<int64_t>::max());
    c.layer_types = r.strings("layer_types");
    if (!r.has("layer_types"))
      for (int64_t i = 0; i < c.num_hidden_layers; ++i)
        c.layer_types.push_back(c.use_sliding_window && (i + 1) % 2 != 0 && i < c.max_window_layers ? "sliding_attention"
                                                                                                    : "full_attention");
    return;
  }
  // Qwen2 / Qwen3: the window only with use_sliding_window; unless the config lists layer_types,
  // layer i slides when i >= max_window_layers.
  if (c.sliding_window) check_in(r.where, "sliding_window", *c.sliding_window, 1, std::numeric_limits<int64_t>::max());
  if (!c.use_sliding_window) c.sliding_window.reset();
  c.layer_types = r.strings("layer_types");
  if (!r.has("layer_types"))
    for (int64_t i = 0; i < c.num_hidden_layers; ++i)
      c.layer_types.push_back(c.sliding_window && i >= c.max_window_layers ? "sliding_attention" : "full_attention");
}

// Llama4TextConfig's own keys, with its defaults and its __post_init__: moe_layers from
// interleave_moe_layer_step, no_rope_layers from no_rope_layer_interval, layer_types from both.
void read_llama4(const Reader& r, ModelConfig& c) {
  const std::string& where = r.where;
  c.num_experts = r.integer("num_local_experts", 16);
  c.num_experts_per_tok = r.integer("num_experts_per_tok", 1);
  c.moe_intermediate_size = c.intermediate_size;  // the experts' and the shared expert's width
  c.intermediate_size_mlp = r.integer("intermediate_size_mlp", 16384);
  c.interleave_moe_layer_step = r.integer("interleave_moe_layer_step", 1);
  check_in(where, "interleave_moe_layer_step", c.interleave_moe_layer_step, 1, kMaxSize);
  if (r.has("moe_layers")) {
    c.moe_layers = r.indices("moe_layers");
  } else {
    for (int64_t i = c.interleave_moe_layer_step - 1; i < c.num_hidden_layers; i += c.interleave_moe_layer_step) c.moe_layers.push_back(i);
  }
  c.no_rope_layer_interval = r.integer("no_rope_layer_interval", 4);
  check_in(where, "no_rope_layer_interval", c.no_rope_layer_interval, 1, kMaxSize);
  c.no_rope_layers = r.indices("no_rope_layers");
  if (c.no_rope_layers.empty())
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) c.no_rope_layers.push_back((i + 1) % c.no_rope_layer_interval != 0 ? 1 : 0);
  // attention_chunk_size: 8192 when absent, null for none.
  if (!r.j.contains("attention_chunk_size")) c.attention_chunk_size = 8192;
  else if (r.has("attention_chunk_size")) c.attention_chunk_size = r.integer("attention_chunk_size");
  c.layer_types = r.strings("layer_types");
  if (!r.has("layer_types") && static_cast<int64_t>(c.no_rope_layers.size()) >= c.num_hidden_layers)
    for (int64_t i = 0; i < c.num_hidden_layers; ++i)
      c.layer_types.push_back(c.no_rope_layers[static_cast<size_t>(i)] != 0 && c.attention_chunk_size ? "chunked_attention" : "full_attention");
  c.l2_qk_norm = r.boolean("use_qk_norm", true);
  // Meta's Llama 4 configs write a number here (4); Transformers tests its truth.
  if (r.has("attn_temperature_tuning") && r.j["attn_temperature_tuning"].is_number())
    c.attn_temperature_tuning = r.j["attn_temperature_tuning"].get<double>() != 0.0;
  else
    c.attn_temperature_tuning = r.boolean("attn_temperature_tuning", true);
  c.floor_scale = r.real("floor_scale", 8192.0);
  c.attn_scale = r.real("attn_scale", 0.1);
  c.router_aux_loss_coef = r.real("router_aux_loss_coef", 0.001);
  c.output_router_logits = r.boolean("output_router_logits", false);
  const double jitter = r.real("router_jitter_noise", 0.0), dropout = r.real("attention_dropout", 0.0);
  KCPP_CHECK(jitter == 0.0, "{}: 'router_jitter_noise' {} is not supported (0 only: the router here adds no noise)", where, jitter);
  KCPP_CHECK(dropout == 0.0, "{}: 'attention_dropout' {} is not supported (0 only: this runtime applies no dropout); set it to 0",
             where, dropout);
  for (const char* key : {"moe_intermediate_size", "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers"})
    KCPP_CHECK(!r.has(key), "{}: '{}' is not a llama4_text key (Llama 4's experts are intermediate_size wide, its MoE layers "
               "moe_layers / interleave_moe_layer_step); remove it", where, key);
}

}  // namespace

void RopeScaling::validate(const std::string& w) const {
  if (type == Type::None) return;
  KCPP_CHECK(std::isfinite(factor) && factor >= 1.0, "{}: 'factor' must be a finite number >= 1, is {}", w, factor);
  KCPP_CHECK(original_max_position_embeddings >= 0, "{}: 'original_max_position_embeddings' must be >= 1, is {}", w,
             original_max_position_embeddings);
  if (type != Type::Llama3) return;
  check_positive(w, "low_freq_factor", low_freq_factor);
  check_positive(w, "high_freq_factor", high_freq_factor);
  KCPP_CHECK(high_freq_factor > low_freq_factor, "{}: 'high_freq_factor' ({}) must exceed 'low_freq_factor' ({})", w,
             high_freq_factor, low_freq_factor);
  check_in(w, "original_max_position_embeddings", original_max_position_embeddings, 1, kMaxPositions);
}

bool ModelConfig::moe_layer(int64_t layer) const {
  if (num_experts == 0) return false;
  if (is_llama4()) return std::find(moe_layers.begin(), moe_layers.end(), layer) != moe_layers.end();
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) return false;
  return (layer + 1) % decoder_sparse_step == 0;
}

int64_t ModelConfig::attention_window(int64_t layer) const {
  if (!sliding_window) return 0;
  if (layer_types.empty()) return *sliding_window;
  return layer_types.at(static_cast<size_t>(layer)) == "sliding_attention" ? *sliding_window : 0;
}

bool ModelConfig::rope_layer(int64_t layer) const {
  if (!is_llama4()) return true;
  // Llama4TextConfig: an empty no_rope_layers is replaced by the interval's.
  if (no_rope_layers.empty()) return (layer + 1) % no_rope_layer_interval != 0;
  return no_rope_layers.at(static_cast<size_t>(layer)) != 0;
}

int64_t ModelConfig::attention_chunk(int64_t layer) const {
  if (!is_llama4() || !attention_chunk_size) return 0;
  if (layer_types.empty()) return rope_layer(layer) ? *attention_chunk_size : 0;
  return layer_types.at(static_cast<size_t>(layer)) == "chunked_attention" ? *attention_chunk_size : 0;
}

void ModelConfig::validate(const std::string& where) const {
  bool known = false;
  for (const char* f : kFamilies) known = known || model_type == f;
  KCPP_CHECK(known, "{}: unknown model_type '{}' (supported: {})", where, model_type, fmt::join(kFamilies, ", "));
  check_in(where, "vocab_size", vocab_size, 1, kMaxSize);
  check_in(where, "hidden_size", hidden_size, 1, kMaxSize);
  check_in(where, "intermediate_size", intermediate_size, 1, kMaxSize);
  check_in(where, "num_hidden_layers", num_hidden_layers, 1, kMaxSize);
  check_in(where, "num_attention_heads", num_attention_heads, 1, kMaxSize);
  check_in(where, "num_key_value_heads", num_key_value_heads, 1, num_attention_heads);
  KCPP_CHECK(num_attention_heads % num_key_value_heads == 0, "{}: num_attention_heads {} is not a multiple of num_key_value_heads {}",
             where, num_attention_heads, num_key_value_heads);
  check_in(where, "head_dim", head_dim, 1, kMaxSize);
  KCPP_CHECK(num_attention_heads * head_dim <= kMaxSize, "{}: num_attention_heads x head_dim must be at most {}, is {} x {}",
             where, kMaxSize, num_attention_heads, head_dim);
  check_in(where, "max_position_embeddings", max_position_embeddings, 1, kMaxPositions);
  check_positive(where, "rms_norm_eps", rms_norm_eps);
  check_positive(where, "rope_theta", rope_theta);
  KCPP_CHECK(partial_rotary_factor > 0 && partial_rotary_factor <= 1 && rotary_dim() > 0 && rotary_dim() % 2 == 0,
             "{}: 'partial_rotary_factor' must be in (0, 1] and give an even rotary dimension (head_dim {} x factor), is {}",
             where, head_dim, partial_rotary_factor);
  rope_scaling.validate(where + ": rope_scaling");
  // Dynamic NTK raises the base to rotary_dim / (rotary_dim - 2).
  KCPP_CHECK(rope_scaling.type != RopeScaling::Type::Dynamic || rotary_dim() > 2,
             "{}: dynamic RoPE scaling needs a rotary dimension above 2, is {}", where, rotary_dim());
  if (sliding_window) check_in(where, "sliding_window", *sliding_window, 1, std::numeric_limits<int64_t>::max());
  KCPP_CHECK(max_window_layers >= 0, "{}: 'max_window_layers' must be >= 0, is {}", where, max_window_layers);
  KCPP_CHECK(layer_types.empty() || static_cast<int64_t>(layer_types.size()) == num_hidden_layers,
             "{}: 'layer_types' must list one type per layer ({}), lists {}", where, num_hidden_layers, layer_types.size());
  for (size_t i = 0; i < layer_types.size(); ++i) {
    const std::string& t = layer_types[i];
    if (is_llama4()) {  // Llama 4's layers are full or chunked
      KCPP_CHECK(t == "full_attention" || t == "chunked_attention",
                 "{}: 'layer_types' entry {} is '{}'; llama4_text layers are 'full_attention' or 'chunked_attention'", where, i, t);
      KCPP_CHECK(t == "full_attention" || attention_chunk_size,
                 "{}: layer {} is 'chunked_attention' but 'attention_chunk_size' is null (set it, or make the layer 'full_attention')",
                 where, i);
      continue;
    }
    KCPP_CHECK(t == "full_attention" || t == "sliding_attention",
               "{}: 'layer_types' entry {} is '{}', must be 'full_attention' or 'sliding_attention'", where, i, t);
    KCPP_CHECK(t == "full_attention" || sliding_window,
               "{}: layer {} is 'sliding_attention' but the config sets no sliding window (sliding_window{})", where, i,
               model_type == "qwen2" || model_type == "qwen3" || model_type == "qwen2_moe" ? " with use_sliding_window true" : "");
  }
  if (is_moe_family(model_type)) {
    const char* experts_key = model_type == "mixtral" ? "num_local_experts" : "num_experts";
    check_in(where, experts_key, num_experts, 1, int64_t{1} << 16);
    check_in(where, "num_experts_per_tok", num_experts_per_tok, 1, num_experts);
    check_in(where, model_type == "mixtral" ? "intermediate_size" : "moe_intermediate_size", moe_intermediate_size, 1, kMaxSize);
    check_in(where, "decoder_sparse_step", decoder_sparse_step, 1, kMaxSize);
    for (int64_t l : mlp_only_layers) check_in(where, "mlp_only_layers", l, 0, num_hidden_layers - 1);
    KCPP_CHECK(std::isfinite(router_aux_loss_coef) && router_aux_loss_coef >= 0,
               "{}: 'router_aux_loss_coef' must be a finite number >= 0, is {}", where, router_aux_loss_coef);
  } else if (is_llama4()) {
    check_in(where, "num_local_experts", num_experts, 1, int64_t{1} << 16);
    check_in(where, "num_experts_per_tok", num_experts_per_tok, 1, num_experts);
    check_in(where, "intermediate_size_mlp", intermediate_size_mlp, 1, kMaxSize);
    check_in(where, "interleave_moe_layer_step", interleave_moe_layer_step, 1, kMaxSize);
    check_in(where, "no_rope_layer_interval", no_rope_layer_interval, 1, kMaxSize);
    for (int64_t l : moe_layers) check_in(where, "moe_layers", l, 0, num_hidden_layers - 1);
    KCPP_CHECK(no_rope_layers.empty() || static_cast<int64_t>(no_rope_layers.size()) >= num_hidden_layers,
               "{}: 'no_rope_layers' must hold one entry per layer ({}), holds {}", where, num_hidden_layers, no_rope_layers.size());
    for (int64_t f : no_rope_layers)
      KCPP_CHECK(f == 0 || f == 1, "{}: 'no_rope_layers' entries must be 1 (RoPE) or 0 (NoPE), holds {}", where, f);
    if (attention_chunk_size) check_in(where, "attention_chunk_size", *attention_chunk_size, 1, std::numeric_limits<int64_t>::max());
    check_positive(where, "floor_scale", floor_scale);
    check_positive(where, "attn_scale", attn_scale);
    KCPP_CHECK(std::isfinite(router_aux_loss_coef) && router_aux_loss_coef >= 0,
               "{}: 'router_aux_loss_coef' must be a finite number >= 0, is {}", where, router_aux_loss_coef);
    KCPP_CHECK(!attention_bias, "{}: 'attention_bias' true is not supported for llama4_text (its o_proj bias is not implemented): "
               "set it to false or remove the biases", where);
    KCPP_CHECK(!mlp_bias && !qkv_bias_only && !qk_norm && norm_offset == 0.0 && !scale_embeddings && !fused_qkv && !fused_gate_up,
               "{}: llama4_text has no MLP bias, q/k/v bias, weighted q/k norm, norm offset, scaled embeddings or fused projections",
               where);
    KCPP_CHECK(partial_rotary_factor == 1.0,
               "{}: 'partial_rotary_factor' {} is not supported for llama4_text (its RoPE rotates the whole head: 1 only)", where,
               partial_rotary_factor);
    KCPP_CHECK(!sliding_window, "{}: llama4_text has no sliding window (its local layers are chunked: attention_chunk_size)", where);
  } else {
    KCPP_CHECK(num_experts == 0, "{}: model_type '{}' has no experts, num_experts is {} (use mixtral, qwen3_moe, qwen2_moe or llama4_text)",
               where, model_type, num_experts);
  }
  if (model_type == "qwen2_moe") {
    check_in(where, "shared_expert_intermediate_size", shared_expert_intermediate_size, 1, kMaxSize);
    // Its rotary embedding spans the whole head: Transformers' default RoPE ignores the factor and the
    // other RoPE types would not fit the head (an error there).
    KCPP_CHECK(partial_rotary_factor == 1.0,
               "{}: 'partial_rotary_factor' {} is not supported for qwen2_moe (its attention rotates the whole head: 1 only)", where,
               partial_rotary_factor);
  } else {
    KCPP_CHECK(shared_expert_intermediate_size == 0,
               "{}: model_type '{}' has no shared expert, shared_expert_intermediate_size is {} (use qwen2_moe)", where, model_type,
               shared_expert_intermediate_size);
  }
  for (int64_t id : bos_token_id) check_in(where, "bos_token_id", id, 0, vocab_size - 1);
  for (int64_t id : eos_token_id) check_in(where, "eos_token_id", id, 0, vocab_size - 1);
  // torch's Embedding takes a padding index in [-vocab_size, vocab_size).
  if (pad_token_id) check_in(where, "pad_token_id", *pad_token_id, -vocab_size, vocab_size - 1);
}

ModelConfig ModelConfig::from_json(const nlohmann::json& j, const std::string& where) {
  KCPP_CHECK(j.is_object(), "{}: expected a JSON object", where);
  const Reader r{j, where};
  ModelConfig c;
  c.model_type = r.string("model_type", "");
  KCPP_CHECK(!c.model_type.empty(), "{}: missing key 'model_type'", where);
  bool known = false;
  for (const char* f : kFamilies) known = known || c.model_type == f;
  KCPP_CHECK(known || c.model_type == "llama4",
             "{}: unknown model_type '{}' (supported: {}, llama4 for its text model, and the state-space mamba and falcon_mamba)",
             where, c.model_type, fmt::join(kFamilies, ", "));
  if (c.model_type == "llama4") {
    // Llama4ForConditionalGeneration: the language model is its text_config (a llama4_text config);
    // the vision tower is not loaded.
    KCPP_CHECK(r.has("text_config") && j["text_config"].is_object(),
               "{}: model_type 'llama4' needs a 'text_config' object (the language model's configuration)", where);
    nlohmann::json text = j["text_config"];
    const std::string inner = text.value("model_type", std::string("llama4_text"));
    KCPP_CHECK(inner == "llama4_text", "{}: text_config's model_type is '{}'; a llama4 model's text_config must be llama4_text", where,
               inner);
    text["model_type"] = "llama4_text";
    ModelConfig t = from_json(text, where + ": text_config");
    t.multimodal = true;
    return t;
  }
  const bool llama4 = c.is_llama4();
  // The sizes are checked at once: what follows divides by them and sizes lists by them.
  for (auto [key, field] : {std::pair{"vocab_size", &c.vocab_size}, {"hidden_size", &c.hidden_size},
                            {"intermediate_size", &c.intermediate_size}, {"num_hidden_layers", &c.num_hidden_layers},
                            {"num_attention_heads", &c.num_attention_heads}}) {
    *field = r.integer(key);
    check_in(where, key, *field, 1, kMaxSize);
  }
  c.num_key_value_heads = r.integer("num_key_value_heads", c.num_attention_heads);
  if (r.has("head_dim")) {
    c.head_dim = r.integer("head_dim");
  } else if (llama4) {
    c.head_dim = 128;  // Llama4TextConfig's default
  } else if (c.model_type == "gemma" || c.model_type == "qwen3") {  // (not qwen3_moe: hidden / heads)
    c.head_dim = c.model_type == "gemma" ? 256 : 128;  // GemmaConfig's and Qwen3Config's defaults
  } else {
    KCPP_CHECK(c.hidden_size % c.num_attention_heads == 0,
               "{}: hidden_size {} is not a multiple of num_attention_heads {} (or give head_dim)", where, c.hidden_size,
               c.num_attention_heads);
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  c.max_position_embeddings = r.integer("max_position_embeddings", llama4 ? 4096 * 32 : 2048);
  c.rms_norm_eps = r.real("rms_norm_eps", llama4 ? 1e-5 : 1e-6);
  // Transformers 5 writes "rope_parameters" {rope_theta, rope_type, partial_rotary_factor, factor...};
  // earlier versions "rope_theta", "partial_rotary_factor" and "rope_scaling" at the top.  Both read.
  const bool v5 = r.has("rope_parameters");
  if (v5) KCPP_CHECK(j["rope_parameters"].is_object(), "{}: 'rope_parameters' must be an object", where);
  const nlohmann::json rope = v5 ? j["rope_parameters"] : nlohmann::json::object();
  const Reader rp{rope, where + ": rope_parameters"};
  const double theta = llama4 ? 500000.0 : 10000.0;  // Llama4TextConfig's default_theta
  c.rope_theta = v5 && rp.has("rope_theta") ? rp.real("rope_theta", theta) : r.real("rope_theta", theta);
  c.partial_rotary_factor =
      v5 && rp.has("partial_rotary_factor") ? rp.real("partial_rotary_factor", 1.0) : r.real("partial_rotary_factor", 1.0);
  c.rope_scaling = v5 ? parse_rope_scaling(rope, where + ": rope_parameters")
                      : parse_rope_scaling(j.contains("rope_scaling") ? j["rope_scaling"] : nlohmann::json(), where);
  c.hidden_act = r.string("hidden_act", r.string("hidden_activation", "silu"));
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", c.model_type == "gemma");
  c.attention_bias = r.boolean("attention_bias", false);
  c.mlp_bias = r.boolean("mlp_bias", false);
  c.torch_dtype = r.string("torch_dtype", r.string("dtype", "float32"));
  c.bos_token_id = r.ids("bos_token_id");
  c.eos_token_id = r.ids("eos_token_id");
  if (llama4 && !r.j.contains("bos_token_id")) c.bos_token_id = {1};  // Llama4TextConfig's defaults
  if (llama4 && !r.j.contains("eos_token_id")) c.eos_token_id = {2};
  if (r.has("pad_token_id")) c.pad_token_id = r.integer("pad_token_id");
  read_sliding_window(r, c);
  // What each family fixes.
  if (c.model_type == "qwen2") c.qkv_bias_only = true;
  if (c.model_type == "qwen2_moe") {
    // Qwen2MoeAttention: q/k/v biases as qkv_bias says (default true), none on o; its modeling code
    // reads neither attention_bias nor mlp_bias.
    c.qkv_bias_only = r.boolean("qkv_bias", true);
    c.attention_bias = c.mlp_bias = false;
  }
  if (c.model_type == "qwen3" || c.model_type == "qwen3_moe") c.qk_norm = true;
  if (is_moe_family(c.model_type)) {
    // Mixtral: num_local_experts, the experts of intermediate_size, always renormalized; Qwen3-MoE:
    // num_experts (Transformers 5 writes num_local_experts, its attribute_map reads both); Qwen2-MoE:
    // num_experts alone (no attribute_map), and the shared expert.  Defaults: each configuration class's.
    const bool mixtral = c.model_type == "mixtral", qwen2_moe = c.model_type == "qwen2_moe";
    if (qwen2_moe) c.num_experts = r.integer("num_experts", 60);
    else c.num_experts = r.has("num_local_experts") ? r.integer("num_local_experts") : r.integer("num_experts", mixtral ? 8 : 128);
    c.num_experts_per_tok = r.integer("num_experts_per_tok", mixtral ? 2 : qwen2_moe ? 4 : 8);
    c.moe_intermediate_size = mixtral ? c.intermediate_size : r.integer("moe_intermediate_size", qwen2_moe ? 1408 : 768);
    if (qwen2_moe) c.shared_expert_intermediate_size = r.integer("shared_expert_intermediate_size", 5632);
    c.norm_topk_prob = mixtral ? true : r.boolean("norm_topk_prob", false);
    c.decoder_sparse_step = mixtral ? 1 : r.integer("decoder_sparse_step", 1);
    c.mlp_only_layers = mixtral ? std::vector<int64_t>{} : r.ids("mlp_only_layers");
    c.router_aux_loss_coef = r.real("router_aux_loss_coef", 0.001);
    c.output_router_logits = r.boolean("output_router_logits", false);
    KCPP_CHECK(qwen2_moe || r.real("router_jitter_noise", 0.0) == 0.0, "{}: 'router_jitter_noise' {} is not supported (0 only)",
               where, r.real("router_jitter_noise", 0.0));
  }
  if (llama4) read_llama4(r, c);
  if (c.model_type == "gemma") {
    c.norm_offset = 1.0;
    c.scale_embeddings = true;
    // Transformers' Gemma runs the tanh GELU whatever hidden_act says, unless hidden_activation names one.
    c.hidden_act = r.string("hidden_activation", "gelu_pytorch_tanh");
  }
  if (c.model_type == "phi3") c.fused_qkv = c.fused_gate_up = true;
  const char* acts[] = {"silu", "gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast"};
  bool act_ok = false;
  for (const char* a : acts) act_ok = act_ok || c.hidden_act == a;
  KCPP_CHECK(act_ok, "{}: hidden_act '{}' is not supported (silu, gelu, gelu_pytorch_tanh, gelu_new, gelu_fast)", where,
             c.hidden_act);
  c.validate(where);
  return c;
}

ModelConfig ModelConfig::from_folder(const std::filesystem::path& folder) {
  std::string where;
  const nlohmann::json j = config_json::read(folder, &where);
  return from_json(j, where);
}

nlohmann::json ModelConfig::to_json() const {
  nlohmann::json j = {{"model_type", model_type},
                      {"vocab_size", vocab_size},
                      {"hidden_size", hidden_size},
                      {"intermediate_size", intermediate_size},
                      {"num_hidden_layers", num_hidden_layers},
                      {"num_attention_heads", num_attention_heads},
                      {"num_key_value_heads", num_key_value_heads},
                      {"head_dim", head_dim},
                      {"max_position_embeddings", max_position_embeddings},
                      {"rms_norm_eps", rms_norm_eps},
                      {"hidden_act", hidden_act},
                      {"tie_word_embeddings", tie_word_embeddings},
                      {"attention_bias", attention_bias},
                      {"mlp_bias", mlp_bias},
                      {"torch_dtype", torch_dtype}};
  if (model_type == "gemma") j["hidden_activation"] = hidden_act;  // what Gemma reads (it ignores hidden_act)
  // As Transformers 5 writes it.
  nlohmann::json rope = {{"rope_theta", rope_theta}, {"rope_type", "default"}};
  if (partial_rotary_factor != 1.0) rope["partial_rotary_factor"] = partial_rotary_factor;
  switch (rope_scaling.type) {
    case RopeScaling::Type::None: break;
    case RopeScaling::Type::Linear: rope["rope_type"] = "linear", rope["factor"] = rope_scaling.factor; break;
    case RopeScaling::Type::Dynamic:
      rope["rope_type"] = "dynamic", rope["factor"] = rope_scaling.factor;
      if (rope_scaling.original_max_position_embeddings)
        rope["original_max_position_embeddings"] = rope_scaling.original_max_position_embeddings;
      break;
    case RopeScaling::Type::Llama3:
      rope["rope_type"] = "llama3", rope["factor"] = rope_scaling.factor;
      rope["low_freq_factor"] = rope_scaling.low_freq_factor, rope["high_freq_factor"] = rope_scaling.high_freq_factor;
      rope["original_max_position_embeddings"] = rope_scaling.original_max_position_embeddings;
      break;
  }
  j["rope_parameters"] = rope;
  auto ids = [](const std::vector<int64_t>& v) -> nlohmann::json {
    if (v.empty()) return nullptr;
    if (v.size() == 1) return v[0];
    return v;
  };
  j["bos_token_id"] = ids(bos_token_id);
  j["eos_token_id"] = ids(eos_token_id);
  if (pad_token_id) j["pad_token_id"] = *pad_token_id;
  // Written for the families that read it (null where Transformers' default would be a window).
  if (is_moe_family(model_type)) {
    j[model_type == "mixtral" ? "num_local_experts" : "num_experts"] = num_experts;
    j["num_experts_per_tok"] = num_experts_per_tok;
    j["router_aux_loss_coef"] = router_aux_loss_coef;
    j["output_router_logits"] = output_router_logits;
    if (model_type == "qwen3_moe" || model_type == "qwen2_moe") {
      j["moe_intermediate_size"] = moe_intermediate_size;
      j["norm_topk_prob"] = norm_topk_prob;
      j["decoder_sparse_step"] = decoder_sparse_step;
      j["mlp_only_layers"] = mlp_only_layers;
      j["use_sliding_window"] = sliding_window.has_value();
    }
    if (model_type == "qwen2_moe") {  // its keys; attention_bias and mlp_bias are not (Qwen2-MoE ignores them)
      j["shared_expert_intermediate_size"] = shared_expert_intermediate_size;
      j["qkv_bias"] = qkv_bias_only;
      j.erase("attention_bias"), j.erase("mlp_bias");
    }
  }
  if (is_llama4()) {  // Llama4TextConfig's keys
    j["num_local_experts"] = num_experts;
    j["num_experts_per_tok"] = num_experts_per_tok;
    j["intermediate_size_mlp"] = intermediate_size_mlp;
    j["moe_layers"] = moe_layers;
    j["interleave_moe_layer_step"] = interleave_moe_layer_step;
    std::vector<int64_t> rope_flags;
    for (int64_t i = 0; i < num_hidden_layers; ++i) rope_flags.push_back(rope_layer(i) ? 1 : 0);
    j["no_rope_layers"] = rope_flags;
    j["no_rope_layer_interval"] = no_rope_layer_interval;
    j["attention_chunk_size"] = attention_chunk_size ? nlohmann::json(*attention_chunk_size) : nlohmann::json(nullptr);
    std::vector<std::string> types;
    for (int64_t i = 0; i < num_hidden_layers; ++i) types.push_back(attention_chunk(i) > 0 ? "chunked_attention" : "full_attention");
    j["layer_types"] = types;
    j["use_qk_norm"] = l2_qk_norm;
    j["attn_temperature_tuning"] = attn_temperature_tuning;
    // Llama4TextConfig types floor_scale as an int: written as one when it is whole.
    j["floor_scale"] = std::floor(floor_scale) == floor_scale && std::abs(floor_scale) < 9e15 ? nlohmann::json(static_cast<int64_t>(floor_scale))
                                                                                             : nlohmann::json(floor_scale);
    j["attn_scale"] = attn_scale;
    j["router_aux_loss_coef"] = router_aux_loss_coef;
    j["output_router_logits"] = output_router_logits;
    j.erase("mlp_bias");  // not a Llama 4 key
    return j;
  }
  if (model_type == "mistral" || model_type == "phi3" || model_type == "mixtral" || model_type == "qwen3_moe") {
    j["sliding_window"] = sliding_window ? nlohmann::json(*sliding_window) : nlohmann::json(nullptr);
    if (model_type == "mixtral" || model_type == "qwen3_moe") return j;
  }
  if (model_type == "mistral" || model_type == "phi3" || model_type == "qwen2" || model_type == "qwen3" || model_type == "qwen2_moe") {
    j["sliding_window"] = sliding_window ? nlohmann::json(*sliding_window) : nlohmann::json(nullptr);
    const bool uniform = std::all_of(layer_types.begin(), layer_types.end(), [&](const std::string& t) { return t == layer_types[0]; });
    if (model_type == "mistral" || model_type == "phi3") {
      KCPP_CHECK(!sliding_window || uniform, "ModelConfig::to_json: {} slides in every layer or none; layer_types mixes them", model_type);
      if (sliding_window && !layer_types.empty() && layer_types[0] == "full_attention") j["sliding_window"] = nullptr;
    } else {
      j["use_sliding_window"] = sliding_window.has_value();
      j["max_window_layers"] = max_window_layers;
      std::vector<std::string> types = layer_types;
      for (int64_t i = static_cast<int64_t>(types.size()); i < num_hidden_layers; ++i)
        types.push_back(sliding_window ? "sliding_attention" : "full_attention");
      j["layer_types"] = types;
    }
  }
  return j;
}

}  // namespace kcpp::models
