// The host side of the kernel ABI (include/kcpp/abi.h): named arguments built from Tensors, the call
// context (device, stream, workspace from the device's allocator, mode, error buffer), and a loaded
// package's layer kept alive with its library.
//
//   KernelLayer norm = KernelLayer::find(package, "LigerRMSNorm");
//   KernelArgs a;
//   a.tensor("x", x).tensor("weight", w).real("eps", 1e-6).tensor("y", y).tensor("rstd", rstd);
//   if (auto s = norm.supports(a, dev, KCPP_MODE_TRAINING); !s.ok()) ... fall back, s.message says why
//   norm.forward(a, dev, KCPP_MODE_TRAINING);   // throws kcpp::Error naming package, layer and argument
//
// Workspace: every block a kernel asks for comes from allocator_for(device), so memory statistics
// count it, and goes back to it when the call returns.  That is stream-ordered for the current
// stream, which is the only stream kernels are given here (core/allocator.h).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"
#include "kcpp/abi.h"

namespace kcpp::hub {
class LoadedPackage;
}

namespace kcpp::nn {

// The named arguments of one call.  Tensors are borrowed views (the KernelArgs keeps the Tensor
// objects, and so their storage, alive); an undefined Tensor is passed as "not given".
class KernelArgs {
 public:
  KernelArgs() = default;
  KernelArgs(const KernelArgs&) = delete;  // the kcpp_arg array points into this object
  KernelArgs& operator=(const KernelArgs&) = delete;

  KernelArgs& tensor(std::string_view name, const Tensor& t);
  KernelArgs& integer(std::string_view name, int64_t v);
  KernelArgs& real(std::string_view name, double v);
  KernelArgs& string(std::string_view name, std::string_view v);
  KernelArgs& none(std::string_view name);

  const kcpp_arg* data() const { return args_.data(); }
  int32_t size() const { return static_cast<int32_t>(args_.size()); }

 private:
  struct Slot {
    std::string name;
    Tensor tensor;
    DLTensor dl{};
    std::string text;
  };
  kcpp_arg& add(std::string_view name, int32_t kind);
  std::deque<Slot> slots_;  // stable addresses: args_ points at names, DLTensors and strings here
  std::vector<kcpp_arg> args_;
};

// What an entry point returned.
struct KernelStatus {
  kcpp_status status = KCPP_OK;
  std::string message;  // the kernel's message when status != KCPP_OK
  bool ok() const { return status == KCPP_OK; }
};

const char* status_name(kcpp_status s);

// Calls an entry point on `device` (for CUDA: the current stream) with mode bits `mode`.
KernelStatus call_entry(kcpp_entry_fn fn, const KernelArgs& args, Device device, uint32_t mode,
                        bool deterministic = true);

// A layer of a loaded package; copying it shares the library, which stays loaded while any copy lives.
class KernelLayer {
 public:
  // Throws kcpp::Error when the package has no layer of that name (listing the ones it has).
  static KernelLayer find(std::shared_ptr<const hub::LoadedPackage> package, std::string_view layer);

  const kcpp_layer& info() const { return *layer_; }
  // "liger 0.1.0: LigerRMSNorm (RMSNorm/1)", for messages and reports.
  std::string describe() const;
  bool has_backward() const { return layer_->backward != nullptr; }
  bool runs_on(Device d) const;

  // supports() as the kernel answers it (a refusal is a status, not an exception).
  KernelStatus supports(const KernelArgs& args, Device device, uint32_t mode) const;
  // Throw kcpp::Error with describe(), the entry point and the kernel's message on any failure.
  void forward(const KernelArgs& args, Device device, uint32_t mode) const;
  void backward(const KernelArgs& args, Device device, uint32_t mode) const;

 private:
  KernelLayer(std::shared_ptr<const hub::LoadedPackage> p, const kcpp_layer* l) : package_(std::move(p)), layer_(l) {}
  std::shared_ptr<const hub::LoadedPackage> package_;
  const kcpp_layer* layer_;
};

// An op (free function) of a loaded package.
class KernelOp {
 public:
  static KernelOp find(std::shared_ptr<const hub::LoadedPackage> package, std::string_view op);
  const kcpp_op& info() const { return *op_; }
  void call(const KernelArgs& args, Device device, uint32_t mode = KCPP_MODE_INFERENCE) const;

 private:
  KernelOp(std::shared_ptr<const hub::LoadedPackage> p, const kcpp_op* o) : package_(std::move(p)), op_(o) {}
  std::shared_ptr<const hub::LoadedPackage> package_;
  const kcpp_op* op_;
};

}  // namespace kcpp::nn
