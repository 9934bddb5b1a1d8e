#include "train/adamw_kernels.h"

#include <cmath>

#include "core/cuda_runtime.h"
#include "core/error.h"
#include "core/half.h"

namespace kcpp::train {

#if KCPP_WITH_CUDA
void adamw_update_cuda(const std::vector<AdamWTensor>& ts, DType param_dtype, DType grad_dtype, const AdamWHyper& h);
void add_squared_norms_cuda(const std::vector<Tensor>& grads, double* acc, Tensor& scratch);
#endif

namespace {

template <typename P, typename G> void update_cpu(const AdamWTensor& t, const AdamWHyper& h, float scale) {
  P* param = static_cast<P*>(t.param);
  const G* grad = static_cast<const G*>(t.grad);
  const float decay = 1.0f - h.lr * t.weight_decay, step = h.lr / h.bc1, inv_bc2 = 1.0f / h.bc2;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < t.n; ++i) {
    const float g = kernel::cpu::to_f32(grad[i]) * scale;
    const float m = h.beta1 * t.m[i] + (1.0f - h.beta1) * g;
    const float v = h.beta2 * t.v[i] + (1.0f - h.beta2) * g * g;
    t.m[i] = m, t.v[i] = v;
    const float p = t.master ? t.master[i] : kernel::cpu::to_f32(param[i]);
    const float next = p * decay - step * m / (std::sqrt(v * inv_bc2) + h.eps);
    if (t.master) t.master[i] = next;
    param[i] = kernel::cpu::from_f32<P>(next);
  }
}

template <typename F> void by_dtype(DType t, const char* what, F&& f) {
  switch (t) {
    case DType::f32: return f(static_cast<float*>(nullptr));
    case DType::bf16: return f(static_cast<bf16*>(nullptr));
    case DType::f16: return f(static_cast<f16*>(nullptr));
    default: KCPP_FAIL("adamw: {} dtype {} is not f32, bf16 or f16", what, dtype_name(t));
  }
}

}  // namespace

void adamw_update(const std::vector<AdamWTensor>& ts, DType param_dtype, DType grad_dtype, const AdamWHyper& h, Device device) {
  KCPP_CHECK(h.max_norm <= 0 || h.sq_norm, "adamw: clipping (max_norm {}) needs the squared norm", h.max_norm);
  if (device.is_cuda()) {
#if KCPP_WITH_CUDA
    cuda::DeviceGuard guard(device.index);  // the launch goes to the parameters' device, whatever is current
    return adamw_update_cuda(ts, param_dtype, grad_dtype, h);
#else
    KCPP_FAIL("adamw: CUDA is not compiled in");
#endif
  }
  float scale = 1.0f;
  if (h.max_norm > 0) {
    const double norm = std::sqrt(*h.sq_norm);
    if (norm > h.max_norm) scale = static_cast<float>(h.max_norm / (norm + 1e-6));
  }
  by_dtype(param_dtype, "parameter", [&]<typename P>(P*) {
    by_dtype(grad_dtype, "gradient", [&]<typename G>(G*) {
      for (const AdamWTensor& t : ts) update_cpu<P, G>(t, h, scale);
    });
  });
}

void add_squared_norms(const std::vector<Tensor>& grads, double* acc, Tensor& scratch) {
  for (const Tensor& g : grads) {
    KCPP_CHECK(g.is_contiguous(), "add_squared_norms: the gradients must be contiguous");
    KCPP_CHECK(g.device() == grads.front().device(), "add_squared_norms: the gradients are on {} and {}; they must share a device",
               grads.front().device().str(), g.device().str());
  }
  if (!grads.empty() && grads.front().device().is_cuda()) {
#if KCPP_WITH_CUDA
    cuda::DeviceGuard guard(grads.front().device().index);
    return add_squared_norms_cuda(grads, acc, scratch);
#else
    KCPP_FAIL("add_squared_norms: CUDA is not compiled in");
#endif
  }
  for (const Tensor& grad : grads) {
    const int64_t n = grad.numel();
    double s = 0.0;
    by_dtype(grad.dtype(), "gradient", [&]<typename T>(T*) {
      const T* g = static_cast<const T*>(grad.data());
#pragma omp parallel for reduction(+ : s) schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        const double x = kernel::cpu::to_f32(g[i]);
        s += x * x;
      }
    });
    *acc += s;
  }
}

}  // namespace kcpp::train
