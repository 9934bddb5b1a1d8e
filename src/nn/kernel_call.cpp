#include "nn/kernel_call.h"

#include <dlpack/dlpack.h>

#include <exception>
#include <optional>

#include "core/allocator.h"
#include "core/error.h"
#include "hub/package.h"
#if KCPP_WITH_CUDA
#include "core/cuda_runtime.h"
#endif

namespace kcpp::nn {

kcpp_arg& KernelArgs::add(std::string_view name, int32_t kind) {
  Slot& s = slots_.emplace_back();
  s.name = name;
  kcpp_arg& a = args_.emplace_back();
  a.name = s.name.c_str();
  a.kind = kind;
  a.reserved = 0;
  return a;
}

KernelArgs& KernelArgs::tensor(std::string_view name, const Tensor& t) {
  if (!t.defined()) return none(name);
  kcpp_arg& a = add(name, KCPP_ARG_TENSOR);
  Slot& s = slots_.back();
  s.tensor = t;
  s.tensor.fill_dl_tensor(&s.dl);
  a.value.tensor = &s.dl;
  return *this;
}

KernelArgs& KernelArgs::integer(std::string_view name, int64_t v) {
  add(name, KCPP_ARG_INT).value.i = v;
  return *this;
}

KernelArgs& KernelArgs::real(std::string_view name, double v) {
  add(name, KCPP_ARG_FLOAT).value.f = v;
  return *this;
}

KernelArgs& KernelArgs::string(std::string_view name, std::string_view v) {
  kcpp_arg& a = add(name, KCPP_ARG_STRING);
  slots_.back().text = v;
  a.value.s = slots_.back().text.c_str();
  return *this;
}

KernelArgs& KernelArgs::none(std::string_view name) {
  add(name, KCPP_ARG_NONE).value.i = 0;
  return *this;
}

const char* status_name(kcpp_status s) {
  switch (s) {
    case KCPP_OK: return "ok";
    case KCPP_ERROR_INVALID_ARGUMENT: return "invalid argument";
    case KCPP_ERROR_UNSUPPORTED: return "unsupported";
    case KCPP_ERROR_OUT_OF_MEMORY: return "out of memory";
    case KCPP_ERROR_RUNTIME: return "runtime error";
  }
  return "unknown status";
}

namespace {

// The workspace allocator handed to kernels: blocks from the device's allocator, returned when the
// call is over.  Allocation failure is NULL (the kernel reports KCPP_ERROR_OUT_OF_MEMORY), never an
// exception through the C boundary.
struct Workspace {
  Allocator* allocator;
  std::vector<void*> blocks;

  static void* allocate(void* host, size_t bytes) {
    auto* w = static_cast<Workspace*>(host);
    try {
      void* p = w->allocator->allocate(bytes == 0 ? 1 : bytes);
      w->blocks.push_back(p);
      return p;
    } catch (const std::exception&) {
      return nullptr;
    }
  }
  ~Workspace() {
    for (void* p : blocks) allocator->deallocate(p);
  }
};

}  // namespace

KernelStatus call_entry(kcpp_entry_fn fn, const KernelArgs& args, Device device, uint32_t mode, bool deterministic) {
  KCPP_CHECK(fn != nullptr, "call_entry: null entry point");
  Workspace ws{&allocator_for(device), {}};
  char error[1024] = {};
  kcpp_context ctx{};
  ctx.struct_size = sizeof(kcpp_context);
  ctx.mode = mode;
  ctx.device = {device.is_cuda() ? kDLCUDA : kDLCPU, device.index};
  ctx.stream = nullptr;
#if KCPP_WITH_CUDA
  std::optional<cuda::DeviceGuard> guard;
  if (device.is_cuda()) {
    guard.emplace(device.index);
    ctx.stream = cuda::current_stream();
  }
#endif
  ctx.deterministic = deterministic ? 1 : 0;
  ctx.workspace = &Workspace::allocate;
  ctx.workspace_host = &ws;
  ctx.error = error;
  ctx.error_size = sizeof error;
  KernelStatus r;
  r.status = fn(&ctx, args.data(), args.size());
  if (r.status != KCPP_OK) r.message = error[0] ? std::string(error) : std::string("(the kernel gave no message)");
  return r;
}

// ---- KernelLayer -------------------------------------------------------------------------------

KernelLayer KernelLayer::find(std::shared_ptr<const hub::LoadedPackage> package, std::string_view name) {
  KCPP_CHECK(package != nullptr, "KernelLayer::find: null package");
  if (const kcpp_layer* l = package->layer(name)) return KernelLayer(std::move(package), l);
  std::string have;
  const kcpp_package& t = package->table();
  for (int32_t i = 0; i < t.num_layers; ++i) have += (i ? ", " : "") + std::string(t.layers[i].name);
  KCPP_FAIL("package {} has no layer '{}' (it has: {})", package->origin(), name, have.empty() ? "none" : have);
}

std::string KernelLayer::describe() const {
  const kcpp_package& t = package_->table();
  return fmt::format("{} {}: {} ({})", t.name, t.version, layer_->name, layer_->contract);
}

bool KernelLayer::runs_on(Device d) const {
  return (layer_->devices & KCPP_DEVICE_BIT(d.is_cuda() ? kDLCUDA : kDLCPU)) != 0;
}

KernelStatus KernelLayer::supports(const KernelArgs& args, Device device, uint32_t mode) const {
  if (!runs_on(device)) return {KCPP_ERROR_UNSUPPORTED, fmt::format("does not run on {}", device.str())};
  if ((layer_->modes & mode & (KCPP_MODE_INFERENCE | KCPP_MODE_TRAINING)) == 0)
    return {KCPP_ERROR_UNSUPPORTED, "not fit for this mode"};
  if (!layer_->supports) return {};
  return call_entry(layer_->supports, args, device, mode);
}

void KernelLayer::forward(const KernelArgs& args, Device device, uint32_t mode) const {
  const KernelStatus s = call_entry(layer_->forward, args, device, mode);
  if (!s.ok()) KCPP_FAIL("{}: forward failed ({}): {}", describe(), status_name(s.status), s.message);
}

void KernelLayer::backward(const KernelArgs& args, Device device, uint32_t mode) const {
  if (!layer_->backward) KCPP_FAIL("{}: has no backward (an inference-only kernel)", describe());
  const KernelStatus s = call_entry(layer_->backward, args, device, mode);
  if (!s.ok()) KCPP_FAIL("{}: backward failed ({}): {}", describe(), status_name(s.status), s.message);
}

// ---- KernelOp ----------------------------------------------------------------------------------

KernelOp KernelOp::find(std::shared_ptr<const hub::LoadedPackage> package, std::string_view name) {
  KCPP_CHECK(package != nullptr, "KernelOp::find: null package");
  if (const kcpp_op* o = package->op(name)) return KernelOp(std::move(package), o);
  KCPP_FAIL("package {} has no op '{}'", package->origin(), name);
}

void KernelOp::call(const KernelArgs& args, Device device, uint32_t mode) const {
  const KernelStatus s = call_entry(op_->call, args, device, mode);
  if (!s.ok()) KCPP_FAIL("op {}: failed ({}): {}", op_->name, status_name(s.status), s.message);
}

}  // namespace kcpp::nn
