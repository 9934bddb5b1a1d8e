#include "nn/kernel_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace kcpp::nn {

std::string mode_name(uint32_t mode) {
  const bool inf = mode & kInference, train = mode & kTraining;
  KCPP_CHECK(inf != train, "a mode is inference or training (one of them), got bits {}", mode);
  KCPP_CHECK((mode & ~(kInference | kTraining | kGraph)) == 0, "unknown mode bits {}", mode);
  std::string s = inf ? "inference" : "training";
  if (mode & kGraph) s += "|graph";
  return s;
}

uint32_t parse_mode(std::string_view text) {
  uint32_t bits = 0;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t bar = std::min(text.find('|', at), text.size());
    const std::string_view part = text.substr(at, bar - at);
    if (part == "inference") bits |= kInference;
    else if (part == "training") bits |= kTraining;
    else if (part == "graph") bits |= kGraph;
    else KCPP_FAIL("unknown mode '{}' in '{}' (expected inference, training, optionally |graph)", part, text);
    at = bar + 1;
  }
  KCPP_CHECK(((bits & kInference) != 0) != ((bits & kTraining) != 0),
             "mode '{}' must name exactly one of inference and training", text);
  return bits;
}

const std::vector<std::string>& known_layer_names() {
  static const std::vector<std::string> names = {
      "RMSNorm", "LayerNorm", "MLP", "rotary_pos_emb", "Attention", "CrossEntropyLoss", "ForCausalLMLoss",
      "SiLU",    "GeLU",      "GeluTanh", "FastGELU", "NewGELU", "QuickGELU", "SiluAndMul", "GeluAndMul",
      "GeluTanhAndMul", "SelectiveScan", "SelectiveStateUpdate", "CausalConv1d", "CausalConv1dUpdate",
      "MegaBlocksMoeMLP", "Llama4TextMoe", "MultiScaleDeformableAttention"};
  return names;
}

namespace {

constexpr const char* kAcceptedForms =
    "accepted: a mapping {\"RMSNorm\": \"org/repo@>=1.0:Layer\", ...} or a project file "
    "{\"kernel_mapping\": {...}}";

bool is_mode_key(const std::string& k) {
  try {
    parse_mode(k);
    return true;
  } catch (const Error&) {
    return false;
  }
}

// Splits one layer's value into {mode bits (0 = none): device-table-or-reference}.  Mode keys may
// sit at the top ({"training": V}) or inside a device ({"cuda": {"training": V}}); not both at once
// for one device.
std::map<uint32_t, nlohmann::json> split_modes(const nlohmann::json& value, const std::string& where) {
  std::map<uint32_t, nlohmann::json> out;
  if (!value.is_object()) {
    out[0] = value;
    return out;
  }
  bool any_mode = false, any_device = false;
  for (const auto& [k, v] : value.items()) (is_mode_key(k) ? any_mode : any_device) = true;
  if (any_mode && any_device)
    KCPP_FAIL("{}: mixes mode keys and device keys at one level (put the modes inside each device)", where);
  if (any_mode) {
    for (const auto& [k, v] : value.items()) {
      if (v.is_object())
        for (const auto& [dk, dv] : v.items())
          if (is_mode_key(dk)) KCPP_FAIL("{}.{}: a mode inside a mode", where, k);
      out[parse_mode(k)] = v;
    }
    return out;
  }
  for (const auto& [dev, v] : value.items()) {
    const bool modes_inside = v.is_object() && !v.contains("ref");
    if (!modes_inside) {
      out[0][dev] = v;
      continue;
    }
    for (const auto& [k, mv] : v.items()) {
      if (!is_mode_key(k))
        KCPP_FAIL("{}.{}: unknown key '{}' (expected a mode: inference, training, inference|graph, training|graph)", where,
                  dev, k);
      out[parse_mode(k)][dev] = mv;
    }
  }
  return out;
}

void check_sources(const hub::LayerMapping& m, bool use_local, const std::string& where) {
  for (const hub::MappingEntry& e : m.entries()) {
    if (!e.ref) continue;
    if (use_local && !e.ref->is_local())
      KCPP_FAIL("{}: '{}' is a hub reference but use_local_kernel is set (expected /abs/path[:Layer])", where, e.ref->text);
    if (!use_local && e.ref->is_local())
      KCPP_FAIL("{}: '{}' is a local folder; set use_local_kernel to use local packages", where, e.ref->text);
  }
}

}  // namespace

KernelConfig KernelConfig::parse(const nlohmann::json& document, bool use_local_kernel) {
  if (!document.is_object())
    KCPP_FAIL("kernel_mapping: the mapping must be a JSON object, got {} ({})", document.type_name(), kAcceptedForms);
  const nlohmann::json* mapping = &document;
  if (document.contains("kernel_mapping")) {  // a project file; "kernel_mapping" is no layer name
    for (const auto& [key, v] : document.items()) {
      if (key == "use_local_kernel") {
        if (!v.is_boolean()) KCPP_FAIL("use_local_kernel: expected true or false, got {}", v.type_name());
        use_local_kernel = use_local_kernel || v.get<bool>();
      } else if (key != "kernel_mapping") {
        KCPP_FAIL("unknown key '{}' beside kernel_mapping (a project file has kernel_mapping and, optionally, "
                  "use_local_kernel)", key);
      }
    }
    mapping = &document["kernel_mapping"];
    if (!mapping->is_object())
      KCPP_FAIL("kernel_mapping: the mapping must be a JSON object, got {} ({})", mapping->type_name(), kAcceptedForms);
  }
  KernelConfig c;
  c.use_local_ = use_local_kernel;
  const auto& known = known_layer_names();
  for (const auto& [layer, value] : mapping->items()) {
    const std::string where = "kernel_mapping." + layer;
    if (std::find(known.begin(), known.end(), layer) == known.end())
      KCPP_FAIL("{}: unknown layer name '{}' (known: {}; {})", where, layer, fmt::join(known, ", "), kAcceptedForms);
    std::vector<PerMode> per_mode;
    for (auto& [mode, v] : split_modes(value, where)) {
      const std::string w = mode ? fmt::format("{}[{}]", where, mode_name(mode)) : where;
      hub::LayerMapping m = hub::LayerMapping::parse(v, w);
      check_sources(m, use_local_kernel, w);
      per_mode.push_back({mode, std::move(m)});
    }
    c.layers_[layer] = std::move(per_mode);
  }
  return c;
}

KernelConfig KernelConfig::parse_text(std::string_view text, bool use_local_kernel) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    KCPP_FAIL("kernel_mapping: not JSON: {}", e.what());
  }
  return parse(j, use_local_kernel);
}

std::optional<hub::MappingEntry> KernelConfig::select(std::string_view layer, uint32_t mode, hub::Backend device,
                                                      int cc_major, int cc_minor, std::string* why) const {
  const auto it = layers_.find(layer);
  if (it == layers_.end()) return std::nullopt;
  // The lookup order for `mode`: exact, without graph, (inference:) training with and without graph, no mode.
  std::vector<uint32_t> order = {mode};
  if (mode & kGraph) order.push_back(mode & ~kGraph);
  if (mode & kInference) {
    if (mode & kGraph) order.push_back(kTraining | kGraph);
    order.push_back(kTraining);
  }
  order.push_back(0);
  for (uint32_t m : order)
    for (const PerMode& pm : it->second) {
      if (pm.mode != m) continue;
      if (const hub::MappingEntry* e = pm.mapping.select(device, cc_major, cc_minor)) {
        if (why)
          *why = fmt::format("kernel_mapping.{}{}{}", layer, m ? fmt::format("[{}]", mode_name(m)) : std::string(),
                             e->ref ? "" : " disables it");
        return *e;
      }
    }
  return std::nullopt;
}

std::vector<std::pair<std::string, hub::MappingEntry>> KernelConfig::entries() const {
  std::vector<std::pair<std::string, hub::MappingEntry>> out;
  for (const auto& [layer, per_mode] : layers_)
    for (const PerMode& pm : per_mode)
      for (const hub::MappingEntry& e : pm.mapping.entries()) out.emplace_back(layer, e);
  return out;
}

std::vector<std::string> KernelConfig::layers() const {
  std::vector<std::string> out;
  for (const auto& [k, v] : layers_) out.push_back(k);
  return out;
}

LigerSwitches LigerSwitches::parse(const nlohmann::json& j) {
  KCPP_CHECK(j.is_object(), "liger_kernel_config: expected an object of switches, got {}", j.type_name());
  LigerSwitches s;
  for (const auto& [k, v] : j.items()) {
    KCPP_CHECK(v.is_boolean(), "liger_kernel_config.{}: expected true or false, got {}", k, v.type_name());
    const bool b = v.get<bool>();
    if (k == "rope") s.rope = b;
    else if (k == "rms_norm") s.rms_norm = b;
    else if (k == "swiglu") s.swiglu = b;
    else if (k == "cross_entropy") s.cross_entropy = b;
    else if (k == "fused_linear_cross_entropy") s.fused_linear_cross_entropy = b;
    else
      KCPP_FAIL("liger_kernel_config: unknown switch '{}' (expected rope, rms_norm, swiglu, cross_entropy, "
                "fused_linear_cross_entropy)", k);
  }
  KCPP_CHECK(!(s.cross_entropy && s.fused_linear_cross_entropy),
             "liger_kernel_config: cross_entropy and fused_linear_cross_entropy are exclusive (as in Liger)");
  return s;
}

KernelConfig liger_kernel_config(const LigerSwitches& s, const std::string& package, bool use_local_kernel,
                                 const std::string& attention) {
  nlohmann::json m = nlohmann::json::object();
  if (s.rope) m["rotary_pos_emb"] = package + ":LigerRotaryEmbedding";
  if (s.rms_norm) m["RMSNorm"] = package + ":LigerRMSNorm";
  if (s.swiglu) m["MLP"] = package + ":LigerGLU";
  if (s.cross_entropy) m["CrossEntropyLoss"] = package + ":LigerCrossEntropy";
  if (s.fused_linear_cross_entropy) m["ForCausalLMLoss"] = package + ":LigerFusedLinearCrossEntropy";
  if (!attention.empty()) m["Attention"] = attention;
  return KernelConfig::parse(m, use_local_kernel);
}

const std::map<std::string, std::string>& default_package_constraints() {
  // The packages' versions, as packages/*/CMakeLists.txt set them (tests/packages checks that they
  // agree with the built manifests).
  static const std::map<std::string, std::string> c = {
      {"liger", "^0.1"}, {"activation", "^0.1"}, {"flash_attn", "^0.2"}, {"moe", "^0.1"}, {"mamba", "^0.1"},
      {"deformable_attention", "^0.1"}};
  return c;
}

nlohmann::json default_kernel_mapping() {
  const auto ref = [](const std::string& package, const std::string& layer) {
    return fmt::format("{}/{}@{}:{}", kDefaultKernelOrg, package, default_package_constraints().at(package), layer);
  };
  nlohmann::json m = {
      {"RMSNorm", ref("liger", "LigerRMSNorm")},
      {"MLP", ref("liger", "LigerGLU")},
      {"rotary_pos_emb", ref("liger", "LigerRotaryEmbedding")},
      {"ForCausalLMLoss", ref("liger", "LigerFusedLinearCrossEntropy")},
      {"Attention", {{"cuda", ref("flash_attn", "FlashAttention")}, {"cpu", ""}}},
  };
  for (const char* act : {"SiLU", "GeLU", "GeluTanh", "FastGELU", "NewGELU", "QuickGELU", "SiluAndMul", "GeluAndMul",
                          "GeluTanhAndMul"})
    m[act] = ref("activation", act);
  // Mixture-of-experts blocks on a GPU (where the package's grouped GEMMs were measured; the CPU keeps
  // the reference's loop over experts), and Mamba's scan and convolution everywhere.
  m["MegaBlocksMoeMLP"] = {{"cuda", ref("moe", "MegaBlocksMoeMLP")}, {"cpu", ""}};
  m["Llama4TextMoe"] = {{"cuda", ref("moe", "Llama4TextMoe")}, {"cpu", ""}};
  for (const char* ssm : {"SelectiveScan", "SelectiveStateUpdate", "CausalConv1d", "CausalConv1dUpdate"}) m[ssm] = ref("mamba", ssm);
  // Deformable DETR's sampling core everywhere (the CPU kernel included: it is faster than the reference's
  // grid_sample per level); no C++ model has the slot, kcpp.torch swaps Transformers' module.
  m["MultiScaleDeformableAttention"] = ref("deformable_attention", "MultiScaleDeformableAttention");
  return m;
}

KernelConfig default_kernel_config() { return KernelConfig::parse(default_kernel_mapping()); }

}  // namespace kcpp::nn
