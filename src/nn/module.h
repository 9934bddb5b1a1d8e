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

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/device.h"
#include "nn/kernel_call.h"
#include "nn/kernel_config.h"

namespace kcpp::hub {
class Hub;
struct LoadedKernel;
}  // namespace kcpp::hub

namespace kcpp::nn {

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
