// KernelConfig: which kernel each layer of a model gets, by Transformers layer name — the C++ form of
// Transformers' `KernelConfig(kernel_mapping=..., use_local_kernel=...)` over the `kernels` library's
// mapping grammar (docs/DESIGN.md, "The hub"):
//
//   {
//     "RMSNorm": "kernels-community/liger@^0.1:LigerRMSNorm",         every device, every mode
//     "SiLU":    {"cuda": "acme/act:SiLU", "cpu": ""},                  per device ("" = keep the reference)
//     "MLP":     {"cuda": [{"ref": "acme/mlp-hopper", "capability": ">=9.0"}, {"ref": "acme/mlp"}]},
//     "ForCausalLMLoss": {"cuda": {"training": "kernels-community/liger:LigerFusedLinearCrossEntropy",
//                                  "inference": ""}}                    per mode, inside a device
//   }
//
// A value is a reference, "" (keep the reference implementation), a table keyed by device, or a table
// keyed by mode ("inference", "training", "inference|graph", "training|graph") — at the top or inside
// a device.  Lookup for a mode falls back as docs/DESIGN.md and Transformers do: the exact mode, the mode
// without "graph", then (for inference) training, then the entry without a mode.  A reference
// without ":Layer" means the package's one layer that implements the slot's contract.
//
// use_local_kernel: references are local package folders ("/abs/path[:Layer]"), as Transformers'
// flag; without it a local path is refused (so a config never silently switches source).
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "hub/reference.h"
#include "hub/variant.h"

namespace kcpp::nn {

// Mode bits, the ABI's (KCPP_MODE_INFERENCE, KCPP_MODE_TRAINING, KCPP_MODE_GRAPH).
enum ModeBits : uint32_t { kInference = 1u << 0, kTraining = 1u << 1, kGraph = 1u << 2 };
// "inference", "training|graph", ...; throws on a set with both or neither of inference / training.
std::string mode_name(uint32_t mode);
uint32_t parse_mode(std::string_view text);  // the inverse; throws naming the text

// The layer names of Transformers' kernel hub integration that this runtime's models, or the Python
// bridge's kernelize (kcpp.torch: MultiScaleDeformableAttention, which no C++ model has), have slots for.
const std::vector<std::string>& known_layer_names();

class KernelConfig {
 public:
  KernelConfig() = default;
  // `document` is the mapping above, or a project file (kcpp.json, what `kcpp lock` reads) holding it:
  // {"kernel_mapping": {...}, "use_local_kernel": false} ("use_local_kernel" optional, or-ed with the
  // argument).  Anything else, a document that is not an object included, is an error that names the
  // key ("kernel_mapping.RMSNorm.cuda: ...") and says which forms are accepted.
  static KernelConfig parse(const nlohmann::json& document, bool use_local_kernel = false);
  static KernelConfig parse_text(std::string_view json_text, bool use_local_kernel = false);

  // What the config says for `layer` in `mode` on `device` (and GPU capability): nullopt when it
  // names nothing (the layer keeps its reference); an entry whose `ref` is nullopt when it disables
  // the layer explicitly.  `why` (optional) gets which key matched.
  std::optional<hub::MappingEntry> select(std::string_view layer, uint32_t mode, hub::Backend device, int cc_major = 0,
                                          int cc_minor = 0, std::string* why = nullptr) const;

  std::vector<std::string> layers() const;
  // Every entry of every layer (each device, capability and mode), with its layer name.
  std::vector<std::pair<std::string, hub::MappingEntry>> entries() const;
  bool use_local_kernel() const { return use_local_; }
  bool empty() const { return layers_.empty(); }

 private:
  struct PerMode {
    uint32_t mode = 0;  // 0: no mode key
    hub::LayerMapping mapping;
  };
  std::map<std::string, std::vector<PerMode>, std::less<>> layers_;
  bool use_local_ = false;
};

// Liger-style switches for training, as Transformers' `TrainingArguments(use_liger_kernel=True,
// liger_kernel_config={...})`: each switch maps its layers to the liger package's kernel.
struct LigerSwitches {
  bool rope = true;                        // rotary_pos_emb
  bool rms_norm = true;                    // RMSNorm
  bool swiglu = true;                      // MLP (the gated activation)
  bool cross_entropy = false;              // CrossEntropyLoss (off when the fused one is on, as Liger)
  bool fused_linear_cross_entropy = true;  // ForCausalLMLoss
  // liger_kernel_config's keys: "rope", "rms_norm", "swiglu", "cross_entropy", "fused_linear_cross_entropy".
  static LigerSwitches parse(const nlohmann::json& j);
};
// `package`: the liger package's reference without a layer ("kernels-community/liger@^0.1", or a
// local folder with use_local_kernel).  `attention`, when not empty, maps the "Attention" layer too
// (Liger has no attention kernel; Transformers pairs it with attn_implementation="<hub repo>"): a
// reference to a package with an Attention/1 layer, such as this project's flash_attn.
KernelConfig liger_kernel_config(const LigerSwitches& s, const std::string& package, bool use_local_kernel = false,
                                 const std::string& attention = "");

// ---- use_kernels with no config ------------------------------------------------------------------
// The hub organization this project publishes its packages to (`kcpp package sign`, then a repo per
// package: kernels-cpp/liger, kernels-cpp/activation, kernels-cpp/flash_attn).
inline constexpr const char* kDefaultKernelOrg = "kernels-cpp";

// The mapping a model gets when kernels are asked for with no mapping (Transformers'
// `use_kernels=True` without a kernel_config; `kcpp generate` / `kcpp train` without --kernels;
// kcpp.default_kernel_config() in Python): this project's packages on the hub, each by the version
// range of this build's package (`^0.1` for 0.1.0, so a compatible release is picked up):
//   RMSNorm, MLP, rotary_pos_emb, ForCausalLMLoss   liger (Liger's default switches: the fused linear
//                                                     cross-entropy, not the plain one)
//   Attention                                        flash_attn on CUDA; the reference on the CPU
//                                                     (its BLAS attention is the faster there)
//   SiLU, GeLU, GeluTanh, FastGELU, NewGELU, QuickGELU, SiluAndMul, GeluAndMul, GeluTanhAndMul   activation
//   MegaBlocksMoeMLP                                 moe on CUDA; the reference on the CPU
//   SelectiveScan, SelectiveStateUpdate, CausalConv1d, CausalConv1dUpdate   mamba
//   MultiScaleDeformableAttention                    deformable_attention (kcpp.torch's Deformable DETR)
// References name the org's repos (`kernels-cpp/liger@^0.1:LigerRMSNorm`); a host loads them with
// default_loader (nn/module.h), which falls back to this build's packages when the hub cannot
// supply them.
nlohmann::json default_kernel_mapping();
KernelConfig default_kernel_config();
// The version range the default mapping asks of each package ("liger" -> "^0.1"): this build's
// package versions, so a default never asks for a release this build's fallback could not be.
const std::map<std::string, std::string>& default_package_constraints();

}  // namespace kcpp::nn
