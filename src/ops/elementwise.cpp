// Elementwise primitives: argument checks, device dispatch and the host loops.
#include "core/profile.h"
#include "core/strided.h"
#include "ops/check.h"
#include "ops/cuda/launch.h"
#include "ops/math.h"
#include "ops/ops.h"

namespace kcpp::ops {
namespace {

// f64 computes in double; everything else in float, rounded to the stored type at the end.
template <typename T> using opmath_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

const char* unary_name(Unary op) {
  static const char* names[] = {"neg", "exp",     "log",  "sqrt", "rsqrt",     "square", "abs",       "recip", "sin",
                                "cos", "tanh",    "sigmoid", "silu", "gelu", "gelu_tanh", "scale", "add_scalar"};
  return names[static_cast<int>(op)];
}
const char* binary_name(Binary op) {
  static const char* names[] = {"add", "sub", "mul", "div", "silu_backward", "gelu_backward", "gelu_tanh_backward"};
  return names[static_cast<int>(op)];
}

}  // namespace

Tensor unary(Unary op, const Tensor& x, double alpha) {
  const char* name = unary_name(op);
  check_float(x, name, "x");
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (x.device().is_cuda()) {
#if KCPP_WITH_CUDA
    cuda::unary(op, out, x, alpha);
#endif
    return out;
  }
  const auto L = make_layout<2>(out.shape(), {&out.strides(), &x.strides()});
  visit_floating(x.dtype(), name, [&]<typename T>(std::type_identity<T>) {
    using M = opmath_t<T>;
    T* o = out.data_ptr<T>();
    const T* in = static_cast<const T*>(x.data());
    const M a = static_cast<M>(alpha);
    host_for_each(L, out.numel(), [&](const int64_t* off) {
      o[off[0]] = from_f64<T>(math::unary<M>(op, static_cast<M>(to_f64(in[off[1]])), a));
    });
  });
  return out;
}

Tensor binary(Binary op, const Tensor& a, const Tensor& b) {
  const char* name = binary_name(op);
  check_float(a, name, "a");
  check_float(b, name, "b");
  check_same(b, a, name, "b", "a");
  const Shape shape = broadcast_shapes(a.shape(), b.shape(), name);
  const Tensor ae = a.expand(shape), be = b.expand(shape);
  Tensor out = Tensor::empty(shape, a.dtype(), a.device());
  const profile::Region region(name, a.device(), 0, profile::enabled() ? 3.0 * out.numel() * dtype_size(out.dtype()) : 0.0);
  if (a.device().is_cuda()) {
#if KCPP_WITH_CUDA
    cuda::binary(op, out, ae, be);
#endif
    return out;
  }
  const auto L = make_layout<3>(shape, {&out.strides(), &ae.strides(), &be.strides()});
  visit_floating(a.dtype(), name, [&]<typename T>(std::type_identity<T>) {
    using M = opmath_t<T>;
    T* o = out.data_ptr<T>();
    const T* pa = static_cast<const T*>(ae.data());
    const T* pb = static_cast<const T*>(be.data());
    host_for_each(L, out.numel(), [&](const int64_t* off) {
      o[off[0]] = from_f64<T>(math::binary<M>(op, static_cast<M>(to_f64(pa[off[1]])), static_cast<M>(to_f64(pb[off[2]]))));
    });
  });
  return out;
}

}  // namespace kcpp::ops
