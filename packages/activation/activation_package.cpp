// Package "activation": the ABI table (include/kcpp/abi.h) over activation_kernels.h.
//
//   SiLU, GeLU, GeluTanh, FastGELU, NewGELU, QuickGELU     contracts <Name>/1: x -> y; dy, x -> dx
//   SiluAndMul, GeluAndMul, GeluTanhAndMul                 contracts <Name>/1: x [..., 2d] -> y [..., d]
// (docs/contracts/activations.md).  GeluTanh, FastGELU and NewGELU are one function (Transformers
// writes the same tanh approximation three ways); here they share one kernel.
#include <cstdio>
#include <cstring>

#include "activation_kernels.h"
#include "kcpp/abi.h"
#include "kcpp/kernel/abi_args.h"

#ifndef KCPP_WITH_CUDA
#define KCPP_WITH_CUDA 0
#endif

namespace {

namespace kk = kcpp::kernel;
namespace ka = kcpp::activation;

constexpr bool kCuda = KCPP_WITH_CUDA != 0;

// What a layer computes: the activation, and whether it is the gated form.
struct Kind {
  const char* layer;
  kk::Activation act;
  bool gated;
};

// Reads and checks the arguments of a forward (x, y) or backward (dy, x, dx) call.
bool act_args(kk::Call& c, const Kind& k, bool bwd, ka::ActParams& p) {
  p.act = k.act;
  p.gated = k.gated;
  c.device_in(kCuda);
  DLTensor* x = c.tensor("x");
  DLTensor* out = c.tensor(bwd ? "dx" : "y");
  DLTensor* dy = bwd ? c.tensor("dy") : nullptr;
  c.float_dtype(x, "x", &p.dtype);
  int64_t xw = 0, rows = 0, r2 = 0, w2 = 0;
  c.rows(x, "x", &rows, &xw, &p.x_stride);
  if (!c.ok()) return false;
  if (k.gated && xw % 2 != 0)
    return c.require(false, "tensor 'x' has an odd last dim %lld; %s takes [..., 2d]", static_cast<long long>(xw), k.layer);
  p.rows = rows;
  p.d = k.gated ? xw / 2 : xw;
  p.x = kk::data_ptr(x);
  // y and dy are [..., d]: x's leading dims and d; dx has x's shape.
  const DLTensor* narrow = bwd ? dy : out;
  const char* narrow_name = bwd ? "dy" : "y";
  c.same_dtype(narrow, narrow_name, x, "x");
  if (c.ok()) {
    bool same = narrow->ndim == x->ndim;
    for (int32_t i = 0; same && i + 1 < x->ndim; ++i) same = narrow->shape[i] == x->shape[i];
    same = same && narrow->shape[narrow->ndim - 1] == p.d;
    if (!same) {
      char sx[128], sn[128];
      return c.require(false, "tensor '%s' has shape %s; for 'x' of shape %s it must be [..., %lld]", narrow_name,
                       kk::Call::shape_str(narrow, sn, sizeof sn), kk::Call::shape_str(x, sx, sizeof sx),
                       static_cast<long long>(p.d));
    }
  }
  if (bwd) {
    if (c.rows(dy, "dy", &r2, &w2, &p.dy_stride)) p.dy = kk::data_ptr(dy);
    c.same_dtype(out, "dx", x, "x");
    c.same_shape(out, "dx", x, "x");
    if (c.rows(out, "dx", &r2, &w2, &p.dx_stride)) p.dx = kk::data_ptr(out);
    if (c.ok() && p.dx == p.dy && (k.gated || p.dx_stride != p.dy_stride))
      c.require(false, "'dx' may be 'dy' only for a plain activation with the same strides");
    if (c.ok() && p.dx == p.x && p.dx_stride != p.x_stride) c.require(false, "in-place 'dx' must have the strides of 'x'");
  } else {
    if (c.rows(out, "y", &r2, &w2, &p.y_stride)) p.y = kk::data_ptr(out);
    if (c.ok() && p.y == p.x && (k.gated || p.y_stride != p.x_stride))
      c.require(false, "'y' may be 'x' only for a plain activation with the same strides");
  }
  // A plain activation over dense rows is one long row (the kernels then skip the row arithmetic).
  const bool dense = p.x_stride == p.d && (bwd ? p.dy_stride == p.d && p.dx_stride == p.d : p.y_stride == p.d);
  if (c.ok() && !k.gated && dense && p.rows > 1) {
    p.d *= p.rows;
    p.rows = 1;
    p.x_stride = p.y_stride = p.dy_stride = p.dx_stride = p.d;
  }
  return c.all_read();  // an argument the call does not read is refused, naming it
}

#if KCPP_WITH_CUDA
#define ACT_RUN(c, fn, p) \
  ((c).on_cuda() ? fn##_cuda((p), static_cast<cudaStream_t>((c).context()->stream)) : fn##_cpu(p))
#else
#define ACT_RUN(c, fn, p) fn##_cpu(p)
#endif

template <const Kind& K> kcpp_status supports(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, K.layer);
  ka::ActParams p;
  act_args(c, K, c.find("dy") != nullptr, p);
  return c.status();
}

template <const Kind& K, bool Bwd> kcpp_status entry(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  char what[64];
  std::snprintf(what, sizeof what, "%s.%s", K.layer, Bwd ? "backward" : "forward");
  kk::Call c(ctx, args, n, what);
  ka::ActParams p;
  if (!act_args(c, K, Bwd, p)) return c.status();
  const char* err = Bwd ? ACT_RUN(c, ka::act_backward, p) : ACT_RUN(c, ka::act_forward, p);
  if (err) c.fail(KCPP_ERROR_INVALID_ARGUMENT, "%s", err);
  return c.status();
}

constexpr Kind kSiLU{"SiLU", kk::Activation::Silu, false};
constexpr Kind kGeLU{"GeLU", kk::Activation::Gelu, false};
constexpr Kind kGeluTanh{"GeluTanh", kk::Activation::GeluTanh, false};
constexpr Kind kFastGELU{"FastGELU", kk::Activation::GeluTanh, false};
constexpr Kind kNewGELU{"NewGELU", kk::Activation::GeluTanh, false};
constexpr Kind kQuickGELU{"QuickGELU", kk::Activation::QuickGelu, false};
constexpr Kind kSiluAndMul{"SiluAndMul", kk::Activation::Silu, true};
constexpr Kind kGeluAndMul{"GeluAndMul", kk::Activation::Gelu, true};
constexpr Kind kGeluTanhAndMul{"GeluTanhAndMul", kk::Activation::GeluTanh, true};

constexpr uint32_t kDevices = KCPP_DEVICE_BIT(kDLCPU) | (kCuda ? KCPP_DEVICE_BIT(kDLCUDA) : 0u);
constexpr uint32_t kModes = KCPP_MODE_INFERENCE | KCPP_MODE_TRAINING | KCPP_MODE_GRAPH;

template <const Kind& K> constexpr kcpp_layer layer(const char* contract, const char* doc) {
  return {sizeof(kcpp_layer), kModes, kDevices, 0, K.layer, contract, doc, supports<K>, entry<K, false>, entry<K, true>};
}

const kcpp_layer kLayers[] = {
    layer<kSiLU>("SiLU/1", "x * sigmoid(x)"),
    layer<kGeLU>("GeLU/1", "x * Phi(x), exact (erf)"),
    layer<kGeluTanh>("GeluTanh/1", "tanh-approximated GELU (PyTorch's approximate='tanh')"),
    layer<kFastGELU>("FastGELU/1", "tanh-approximated GELU (Transformers' FastGELUActivation)"),
    layer<kNewGELU>("NewGELU/1", "tanh-approximated GELU (Transformers' NewGELUActivation)"),
    layer<kQuickGELU>("QuickGELU/1", "x * sigmoid(1.702 x)"),
    layer<kSiluAndMul>("SiluAndMul/1", "silu(x[..., :d]) * x[..., d:]"),
    layer<kGeluAndMul>("GeluAndMul/1", "gelu(x[..., :d]) * x[..., d:], exact GELU"),
    layer<kGeluTanhAndMul>("GeluTanhAndMul/1", "gelu_tanh(x[..., :d]) * x[..., d:]"),
};

const kcpp_package kPackage = {
    .struct_size = sizeof(kcpp_package),
    .abi_version = KCPP_ABI_VERSION,
    .name = KCPP_PACKAGE_NAME,
    .version = KCPP_PACKAGE_VERSION,
    .layers = kLayers,
    .num_layers = static_cast<int32_t>(sizeof kLayers / sizeof kLayers[0]),
    .num_ops = 0,
    .ops = nullptr,
};

}  // namespace

extern "C" KCPP_EXPORT const kcpp_package* kcpp_package_v1(void) { return &kPackage; }
