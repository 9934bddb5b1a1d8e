// Package "example": the smallest complete kernel package, used by the hub's tests and as a template.
//
// One layer, "SiLU" (contract SiLU/1, docs/contracts/SiLU.md), on the CPU:
//   forward   y  = x * s,                 s = sigmoid(x) = 1 / (1 + exp(-x))
//   backward  dx = dy * s * (1 + x * (1 - s))
// computed in f32 and rounded once to the tensors' dtype (f32, bf16 or f16).  Nothing is saved:
// backward recomputes s from x.  y may alias x and dx may alias dy (elementwise, same index).
// One op, "scale":  y = alpha * x, on the CPU and (in the CUDA variant) on CUDA devices.
//
// The package's name and version come from the build (kcpp_add_package); KCPP_EXAMPLE_ABI_VERSION
// exists only so that the tests can build a copy that claims a different ABI version.
#include <cmath>
#include <cstdint>

#include "kcpp/abi.h"
#include "kcpp/kernel/abi_args.h"
#include "kcpp/kernel/cpu.h"

#ifndef KCPP_WITH_CUDA
#define KCPP_WITH_CUDA 0
#endif
#ifndef KCPP_EXAMPLE_ABI_VERSION
#define KCPP_EXAMPLE_ABI_VERSION KCPP_ABI_VERSION
#endif

#if KCPP_WITH_CUDA
const char* example_scale_cuda(const void* x, void* y, int64_t n, float alpha, int dtype, void* stream);
#endif

namespace {

namespace kk = kcpp::kernel;
using kk::cpu::bf16;
using kk::cpu::f16;

// Calls f.template operator()<T>() with T the storage type of `t`.
template <typename F>
void dispatch(kk::DType t, F&& f) {
  switch (t) {
    case kk::DType::f32: f.template operator()<float>(); break;
    case kk::DType::bf16: f.template operator()<bf16>(); break;
    case kk::DType::f16: f.template operator()<f16>(); break;
  }
}

kcpp_status silu_supports(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "SiLU");
  const DLTensor* x = c.tensor("x", false);
  if (!x) x = c.tensor("dy", false);  // a backward call
  kk::DType t;
  if (x) {
    c.float_dtype(x, "x", &t);
    if (x->device.device_type != kDLCPU)
      c.fail(KCPP_ERROR_UNSUPPORTED, "runs on the CPU only, not on %s", kk::dl_device_name(x->device.device_type));
  }
  return c.status();
}

kcpp_status silu_forward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "SiLU.forward");
  DLTensor* x = c.tensor("x");
  DLTensor* y = c.tensor("y");
  kk::DType t{};
  c.float_dtype(x, "x", &t);
  c.same_dtype(y, "y", x, "x");
  c.same_shape(y, "y", x, "x");
  c.row_major(x, "x");
  c.row_major(y, "y");
  // An argument this call does not read (a misspelt name, "dy" in a forward call) is refused, naming it.
  if (!c.ok() || !c.all_read()) return c.status();
  const int64_t count = kk::numel(x);
  dispatch(t, [&]<typename T>() {
    const T* xs = static_cast<const T*>(kk::data_ptr(x));
    T* ys = static_cast<T*>(kk::data_ptr(y));
    for (int64_t i = 0; i < count; ++i) {
      const float v = kk::cpu::to_f32(xs[i]);
      ys[i] = kk::cpu::from_f32<T>(v / (1.0f + std::exp(-v)));
    }
  });
  return KCPP_OK;
}

kcpp_status silu_backward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "SiLU.backward");
  DLTensor* dy = c.tensor("dy");
  DLTensor* x = c.tensor("x");
  DLTensor* dx = c.tensor("dx");
  kk::DType t{};
  c.float_dtype(x, "x", &t);
  c.same_dtype(dy, "dy", x, "x");
  c.same_dtype(dx, "dx", x, "x");
  c.same_shape(dy, "dy", x, "x");
  c.same_shape(dx, "dx", x, "x");
  c.row_major(x, "x");
  c.row_major(dy, "dy");
  c.row_major(dx, "dx");
  if (!c.ok() || !c.all_read()) return c.status();
  const int64_t count = kk::numel(x);
  dispatch(t, [&]<typename T>() {
    const T* xs = static_cast<const T*>(kk::data_ptr(x));
    const T* dys = static_cast<const T*>(kk::data_ptr(dy));
    T* dxs = static_cast<T*>(kk::data_ptr(dx));
    for (int64_t i = 0; i < count; ++i) {
      const float v = kk::cpu::to_f32(xs[i]);
      const float s = 1.0f / (1.0f + std::exp(-v));
      dxs[i] = kk::cpu::from_f32<T>(kk::cpu::to_f32(dys[i]) * s * (1.0f + v * (1.0f - s)));
    }
  });
  return KCPP_OK;
}

kcpp_status scale_call(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "scale");
  DLTensor* x = c.tensor("x");
  DLTensor* y = c.tensor("y");
  const double alpha = c.real("alpha", 0.0, /*required=*/true);
  kk::DType t{};
  c.float_dtype(x, "x", &t);
  c.same_dtype(y, "y", x, "x");
  c.same_shape(y, "y", x, "x");
  c.row_major(x, "x");
  c.row_major(y, "y");
  const bool on_cuda = x && x->device.device_type == kDLCUDA;
  if (x && x->device.device_type != kDLCPU && !(KCPP_WITH_CUDA && on_cuda))
    c.fail(KCPP_ERROR_UNSUPPORTED, "runs on the CPU%s only, not on %s", KCPP_WITH_CUDA ? " and CUDA" : "",
           kk::dl_device_name(x->device.device_type));
  if (!c.ok() || !c.all_read()) return c.status();
  const int64_t count = kk::numel(x);
  const float a = static_cast<float>(alpha);
#if KCPP_WITH_CUDA
  if (on_cuda) {
    if (const char* e = example_scale_cuda(kk::data_ptr(x), kk::data_ptr(y), count, a, static_cast<int>(t),
                                          ctx ? ctx->stream : nullptr))
      return kk::report(ctx, KCPP_ERROR_RUNTIME, "", "%s", e);
    return KCPP_OK;
  }
#endif
  dispatch(t, [&]<typename T>() {
    const T* xs = static_cast<const T*>(kk::data_ptr(x));
    T* ys = static_cast<T*>(kk::data_ptr(y));
    for (int64_t i = 0; i < count; ++i) ys[i] = kk::cpu::from_f32<T>(a * kk::cpu::to_f32(xs[i]));
  });
  return KCPP_OK;
}

const kcpp_layer kLayers[] = {{
    .struct_size = sizeof(kcpp_layer),
    .modes = KCPP_MODE_INFERENCE | KCPP_MODE_TRAINING,
    .devices = KCPP_DEVICE_BIT(kDLCPU),
    .reserved = 0,
    .name = "SiLU",
    .contract = "SiLU/1",
    .doc = "y = x * sigmoid(x), f32 maths, one rounding; CPU",
    .supports = silu_supports,
    .forward = silu_forward,
    .backward = silu_backward,
}};

const kcpp_op kOps[] = {{
    .struct_size = sizeof(kcpp_op),
    .devices = KCPP_DEVICE_BIT(kDLCPU) | (KCPP_WITH_CUDA ? KCPP_DEVICE_BIT(kDLCUDA) : 0u),
    .name = "scale",
    .doc = "scale(x, y, alpha): y = alpha * x",
    .call = scale_call,
}};

const kcpp_package kPackage = {
    .struct_size = sizeof(kcpp_package),
    .abi_version = KCPP_EXAMPLE_ABI_VERSION,
    .name = KCPP_PACKAGE_NAME,
    .version = KCPP_PACKAGE_VERSION,
    .layers = kLayers,
    .num_layers = 1,
    .num_ops = 1,
    .ops = kOps,
};

}  // namespace

extern "C" KCPP_EXPORT const kcpp_package* kcpp_package_v1(void) { return &kPackage; }
