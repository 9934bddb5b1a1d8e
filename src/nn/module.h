// Layer slots and kernelize: the C++ form of Transformers' `use_kernels` / `kernelize(model, mode, device)`.
//
// A Slot is one place in a model where a layer runs, named by its Transformers layer name ("RMSNorm")
// and the contract its kernels implement ("RMSNorm/1").  It always has the reference implementation
// (ops/); kernelize() may give it a kernel.  Each call asks the kernel's supports() first and runs the
// reference when the kernel refuses, counting the fallback and keeping the reason (Transformers does
// the same per call).  A Module lists its slots; kernelize() resolves each layer name through a
// KernelConfig once per model, loads each package once, and writes a report of what every slot got
// and why.  Modules re-kernelize on train() / eval().
//
//   model.kernelize(config, nn::kTraining, Device::cuda(0), loader);
//   fmt::print("{}", model.kernel_report());
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/device.h"
#include "hub/hub.h"
#include "nn/kernel_call.h"
#include "nn/kernel_config.h"

namespace kcpp::hub {
class Hub;
struct LoadedKernel;
}  // namespace kcpp::hub

namespace kcpp::nn {

// While a CaptureScope lives on a thread, the slot calls it makes are being captured into a CUDA
// graph: they run with kGraph in their mode, and a kernel whose layer does not declare kGraph (no
// host synchronization, no allocation but the workspace's, only the given stream) gives way to the
// reference for that call, counted as a fallback.
class CaptureScope {
 public:
  CaptureScope();
  ~CaptureScope();
  CaptureScope(const CaptureScope&) = delete;
  CaptureScope& operator=(const CaptureScope&) = delete;
  static bool active();

 private:
  bool previous_;
};

class Slot {
 public:
  Slot(std::string layer_name, std::string contract) : layer_(std::move(layer_name)), contract_(std::move(contract)) {}
  virtual ~Slot() = default;
  Slot(const Slot&) = delete;
  Slot& operator=(const Slot&) = delete;

  const std::string& layer_name() const { return layer_; }
  const std::string& contract() const { return contract_; }
  const std::optional<KernelLayer>& kernel() const { return kernel_; }
  uint32_t mode() const { return mode_; }
  // Why the slot has its kernel, or why not ("no mapping for RMSNorm", "disabled by ...").
  const std::string& reason() const { return reason_; }

  void set_kernel(std::optional<KernelLayer> k, uint32_t mode, std::string reason);
  void clear_kernel(std::string reason = "unkernelized");

  struct Stats {
    int64_t kernel_calls = 0, reference_calls = 0, fallbacks = 0;
    std::string last_refusal;  // the kernel's supports() message of the latest fallback
  };
  const Stats& stats() const { return stats_; }
  void reset_stats() { stats_ = {}; }

 protected:
  // True when the kernel ran.  False: no kernel, or its supports() refused (counted, reason kept);
  // the caller then runs the reference.  Kernel failures after supports() accepted throw.
  // `for_backward` false: nothing will be differentiated (no Saved asked for), so the kernel is
  // called in inference mode even in a training model (training mode obliges it to save).
  bool run_forward(const KernelArgs& args, Device device, bool for_backward = true);
  bool run_backward(const KernelArgs& args, Device device);
  void count_reference() { ++stats_.reference_calls; }
  // A call the slot keeps from its kernel itself (an option the kernel's contract lacks, e.g. Llama 4's
  // chunked attention): with a kernel set, a fallback whose refusal is `why`; else a reference call.
  void count_refusal(const std::string& why);

 private:
  bool run(const KernelArgs& args, Device device, bool backward, uint32_t mode);
  std::string layer_, contract_;
  std::optional<KernelLayer> kernel_;
  uint32_t mode_ = kInference;
  std::string reason_ = "not kernelized";
  Stats stats_;
};

// Loads the package a reference names (the hub, a local folder); kernelize() calls it once per
// distinct reference.
using KernelLoader = std::function<hub::LoadedKernel(const hub::Reference&)>;
// A loader over a Hub (its policy: trust, lock file, allow_all_kernels, USE_HUB_KERNELS).
KernelLoader hub_loader(std::shared_ptr<hub::Hub> hub);

// Thrown by a loader that has no kernel for a reference and wants the slot to keep its reference
// implementation (kernelize records the message as the reason) instead of failing: the default
// mapping's loader when neither the hub nor this build has the package.
class KeepReference : public Error {
 public:
  using Error::Error;
};

// The loader of the default mapping (default_kernel_config()): references to this project's org
// (kDefaultKernelOrg/<package>) load from `hub`; when the hub cannot supply a package
// (hub::HubUnavailable: offline without it in the cache, unreachable, not published there) or will
// not load it for lack of trust (hub::Untrusted: the org's publisher is not in the trust store),
// `local(package)`, this build's package folder, loads instead — unsigned, through a hub with
// allow_all_kernels, every file still checked against its manifest — and the LoadedKernel's
// `substituted` says so.  A package neither has keeps the reference (KeepReference).  Anything else
// (a bad signature, a hash or lock mismatch, USE_HUB_KERNELS=0) is the hub's error as it is; other
// references load from `hub` unchanged.  Each package is looked for once per loader, and an
// endpoint that did not answer is not asked again.
using LocalPackageFinder = std::function<std::optional<std::filesystem::path>(const std::string& package)>;
KernelLoader default_loader(std::shared_ptr<hub::Hub> hub, LocalPackageFinder local);
// The hub configuration the default mapping uses: the environment's (HubConfig::from_env), but one
// attempt per request and a 5 s connect timeout unless KCPP_HTTP_RETRIES / KCPP_HTTP_TIMEOUT say
// otherwise — nobody asked for the hub, so an unreachable one must not hold a command up.
hub::HubConfig default_hub_config();

struct KernelizeReport {
  struct Entry {
    std::string layer;       // "RMSNorm"
    int slots = 0;           // how many slots of the model have this layer name
    std::string kernel;      // "liger 0.1.0: LigerRMSNorm (RMSNorm/1)", or "" (the reference)
    std::string reason;
  };
  std::vector<Entry> entries;
  std::vector<std::string> unused;  // layer names the config maps but the model has no slot for
  std::string str() const;
};

class Module {
 public:
  virtual ~Module() = default;
  // Every slot of the model, in a fixed order.
  virtual void visit_slots(const std::function<void(Slot&)>& fn) = 0;

  // Gives each slot the kernel `config` names for it in `mode` on `device` (the reference where it
  // names none, disables it, or the kernel cannot run there: not on that device, not in that mode).
  // Errors (a reference that cannot be resolved or loaded, a kernel implementing another contract,
  // a missing :Layer) throw kcpp::Error naming the layer and the reference.
  KernelizeReport kernelize(const KernelConfig& config, uint32_t mode, Device device, const KernelLoader& loader);
  void unkernelize();
  // Re-kernelize with the last config in training / inference mode (no-op when never kernelized).
  void train();
  void eval();
  bool training() const { return mode_ & kTraining; }
  // Per layer name: the kernel, and calls / fallbacks since the last kernelize with the last reason.
  std::string kernel_report();

 private:
  std::optional<KernelConfig> config_;
  KernelLoader loader_;
  Device device_ = Device::cpu();
  uint32_t mode_ = kInference;
};

}  // namespace kcpp::nn
