#include "models/config.h"

#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace kcpp::models {

namespace {

constexpr const char* kFamilies[] = {"llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"};

// Typed reads of config keys, each error naming the file and the key.
struct Reader {
  const nlohmann::json& j;
  const std::string& where;

  bool has(const char* key) const { return j.contains(key) && !j[key].is_null(); }
  int64_t integer(const char* key) const {
    KCPP_CHECK(has(key), "{}: missing key '{}'", where, key);
    KCPP_CHECK(j[key].is_number_integer(), "{}: '{}' must be an integer, is {}", where, key, j[key].dump());
    return j[key].get<int64_t>();
  }
  int64_t integer(const char* key, int64_t fallback) const { return has(key) ? integer(key) : fallback; }
  int64_t positive(const char* key) const {
    const int64_t v = integer(key);
    KCPP_CHECK(v > 0, "{}: '{}' must be positive, is {}", where, key, v);
    return v;
  }
  double real(const char* key, double fallback) const {
    if (!has(key)) return fallback;
    KCPP_CHECK(j[key].is_number(), "{}: '{}' must be a number, is {}", where, key, j[key].dump());
    return j[key].get<double>();
  }
  bool boolean(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    KCPP_CHECK(j[key].is_boolean(), "{}: '{}' must be true or false, is {}", where, key, j[key].dump());
    return j[key].get<bool>();
  }
  std::string string(const char* key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    KCPP_CHECK(j[key].is_string(), "{}: '{}' must be a string, is {}", where, key, j[key].dump());
    return j[key].get<std::string>();
  }
  std::vector<int64_t> ids(const char* key) const {  // an integer or a list of them
    std::vector<int64_t> out;
    if (!has(key)) return out;
    if (j[key].is_number_integer()) return {j[key].get<int64_t>()};
    KCPP_CHECK(j[key].is_array(), "{}: '{}' must be a token id or a list of them", where, key);
    for (const auto& v : j[key]) {
      KCPP_CHECK(v.is_number_integer(), "{}: '{}' must hold integers", where, key);
      out.push_back(v.get<int64_t>());
    }
    return out;
  }
};

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
  KCPP_CHECK(s.factor >= 1.0, "{}: 'factor' must be >= 1, is {}", w, s.factor);
  if (type == "linear") {
    s.type = RopeScaling::Type::Linear;
  } else if (type == "dynamic") {
    s.type = RopeScaling::Type::Dynamic;
    s.original_max_position_embeddings = rd.integer("original_max_position_embeddings", 0);
  } else if (type == "llama3") {
    s.type = RopeScaling::Type::Llama3;
    s.low_freq_factor = rd.real("low_freq_factor", 1.0);
    s.high_freq_factor = rd.real("high_freq_factor", 4.0);
    s.original_max_position_embeddings = rd.integer("original_max_position_embeddings");
    KCPP_CHECK(s.high_freq_factor > s.low_freq_factor, "{}: high_freq_factor must exceed low_freq_factor", w);
  } else {
    KCPP_FAIL("{}: rope_type '{}' is not supported (default, linear, dynamic, llama3)", w, type);
  }
  return s;
}

}  // namespace

ModelConfig ModelConfig::from_json(const nlohmann::json& j, const std::string& where) {
  KCPP_CHECK(j.is_object(), "{}: expected a JSON object", where);
  const Reader r{j, where};
  ModelConfig c;
  c.model_type = r.string("model_type", "");
  KCPP_CHECK(!c.model_type.empty(), "{}: missing key 'model_type'", where);
  bool known = false;
  for (const char* f : kFamilies) known = known || c.model_type == f;
  KCPP_CHECK(known, "{}: unknown model_type '{}' (supported: {})", where, c.model_type, fmt::join(kFamilies, ", "));
  c.vocab_size = r.positive("vocab_size");
  c.hidden_size = r.positive("hidden_size");
  c.intermediate_size = r.positive("intermediate_size");
  c.num_hidden_layers = r.positive("num_hidden_layers");
  c.num_attention_heads = r.positive("num_attention_heads");
  c.num_key_value_heads = r.integer("num_key_value_heads", c.num_attention_heads);
  KCPP_CHECK(c.num_key_value_heads > 0 && c.num_attention_heads % c.num_key_value_heads == 0,
             "{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", where, c.num_attention_heads,
             c.num_key_value_heads);
  c.head_dim = r.integer("head_dim", 0);
  if (c.head_dim == 0) {
    KCPP_CHECK(c.hidden_size % c.num_attention_heads == 0, "{}: hidden_size {} is not a multiple of num_attention_heads {}",
               where, c.hidden_size, c.num_attention_heads);
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  c.max_position_embeddings = r.integer("max_position_embeddings", 2048);
  c.rms_norm_eps = r.real("rms_norm_eps", 1e-6);
  // Transformers 5 writes "rope_parameters" {rope_theta, rope_type, partial_rotary_factor, factor...};
  // earlier versions "rope_theta", "partial_rotary_factor" and "rope_scaling" at the top.  Both read.
  const bool v5 = r.has("rope_parameters");
  if (v5) KCPP_CHECK(j["rope_parameters"].is_object(), "{}: 'rope_parameters' must be an object", where);
  const nlohmann::json rope = v5 ? j["rope_parameters"] : nlohmann::json::object();
  const Reader rp{rope, where + ": rope_parameters"};
  c.rope_theta = v5 && rp.has("rope_theta") ? rp.real("rope_theta", 10000.0) : r.real("rope_theta", 10000.0);
  c.partial_rotary_factor =
      v5 && rp.has("partial_rotary_factor") ? rp.real("partial_rotary_factor", 1.0) : r.real("partial_rotary_factor", 1.0);
  KCPP_CHECK(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1 && c.rotary_dim() % 2 == 0,
             "{}: partial_rotary_factor {} must give an even rotary dimension in (0, head_dim]", where, c.partial_rotary_factor);
  c.rope_scaling = v5 ? parse_rope_scaling(rope, where + ": rope_parameters")
                      : parse_rope_scaling(j.contains("rope_scaling") ? j["rope_scaling"] : nlohmann::json(), where);
  c.hidden_act = r.string("hidden_act", r.string("hidden_activation", "silu"));
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", c.model_type == "gemma");
  c.attention_bias = r.boolean("attention_bias", false);
  c.mlp_bias = r.boolean("mlp_bias", false);
  c.torch_dtype = r.string("torch_dtype", r.string("dtype", "float32"));
  c.bos_token_id = r.ids("bos_token_id");
  c.eos_token_id = r.ids("eos_token_id");
  if (r.has("pad_token_id")) c.pad_token_id = r.integer("pad_token_id");
  if (r.has("sliding_window")) c.sliding_window = r.integer("sliding_window");
  // What each family fixes.
  if (c.model_type == "qwen2") c.qkv_bias_only = true;
  if (c.model_type == "qwen3") c.qk_norm = true;
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
  return c;
}

ModelConfig ModelConfig::from_folder(const std::filesystem::path& folder) {
  const auto path = folder / "config.json";
  std::ifstream in(path);
  KCPP_CHECK(in.good(), "{}: cannot read (no config.json in the model folder?)", path.string());
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    KCPP_FAIL("{}: not JSON: {}", path.string(), e.what());
  }
  return from_json(j, path.string());
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
  if (sliding_window) j["sliding_window"] = *sliding_window;
  return j;
}

}  // namespace kcpp::models
