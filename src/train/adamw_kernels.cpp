#include "train/adamw_kernels.h"

#include <cmath>

#include "core/error.h"
#include "core/half.h"

namespace kcpp::train {

#if KCPP_WITH_CUDA
void adamw_update_cuda(const AdamWUpdate& u);
void add_squared_norm_cuda(const Tensor& grad, double* acc);
#endif

namespace {

template <typename P, typename G> void update_cpu(const AdamWUpdate& u) {
  P* param = static_cast<P*>(u.param);
  const G* grad = static_cast<const G*>(u.grad);
  const float decay = 1.0f - u.lr * u.weight_decay, step = u.lr / u.bc1, inv_bc2 = 1.0f / u.bc2;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < u.n; ++i) {
    const float g = kernel::cpu::to_f32(grad[i]) * u.grad_scale;
    const float m = u.beta1 * u.m[i] + (1.0f - u.beta1) * g;
    const float v = u.beta2 * u.v[i] + (1.0f - u.beta2) * g * g;
    u.m[i] = m, u.v[i] = v;
    const float p = u.master ? u.master[i] : kernel::cpu::to_f32(param[i]);
    const float next = p * decay - step * m / (std::sqrt(v * inv_bc2) + u.eps);
    if (u.master) u.master[i] = next;
    param[i] = kernel::cpu::from_f32<P>(next);
  }
}

template <typename P> void by_grad(const AdamWUpdate& u) {
  switch (u.grad_dtype) {
    case DType::f32: return update_cpu<P, float>(u);
    case DType::bf16: return update_cpu<P, bf16>(u);
    case DType::f16: return update_cpu<P, f16>(u);
    default: KCPP_FAIL("adamw: gradient dtype {} is not f32, bf16 or f16", dtype_name(u.grad_dtype));
  }
}

}  // namespace

void adamw_update(const AdamWUpdate& u, Device device) {
  if (u.n == 0) return;
  if (device.is_cuda()) {
#if KCPP_WITH_CUDA
    return adamw_update_cuda(u);
#else
    KCPP_FAIL("adamw: CUDA is not compiled in");
#endif
  }
  switch (u.param_dtype) {
    case DType::f32: return by_grad<float>(u);
    case DType::bf16: return by_grad<bf16>(u);
    case DType::f16: return by_grad<f16>(u);
    default: KCPP_FAIL("adamw: parameter dtype {} is not f32, bf16 or f16", dtype_name(u.param_dtype));
  }
}

void add_squared_norm(const Tensor& grad, double* acc) {
  KCPP_CHECK(grad.is_contiguous(), "add_squared_norm: the gradient must be contiguous");
  if (grad.device().is_cuda()) {
#if KCPP_WITH_CUDA
    return add_squared_norm_cuda(grad, acc);
#else
    KCPP_FAIL("add_squared_norm: CUDA is not compiled in");
#endif
  }
  const int64_t n = grad.numel();
  double s = 0.0;
  auto go = [&]<typename T>(const T* g) {
#pragma omp parallel for reduction(+ : s) schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const double x = kernel::cpu::to_f32(g[i]);
      s += x * x;
    }
  };
  switch (grad.dtype()) {
    case DType::f32: go(static_cast<const float*>(grad.data())); break;
    case DType::bf16: go(static_cast<const bf16*>(grad.data())); break;
    case DType::f16: go(static_cast<const f16*>(grad.data())); break;
    default: KCPP_FAIL("add_squared_norm: dtype {} is not f32, bf16 or f16", dtype_name(grad.dtype()));
  }
  *acc += s;
}

}  // namespace kcpp::train
