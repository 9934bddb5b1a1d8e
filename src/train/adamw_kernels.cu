// CUDA side of adamw_kernels.h: one thread per element for the update (grid-stride), a two-stage
// fixed-order reduction for the squared norm.
#include "core/cuda_runtime.h"
#include "core/cuda_types.cuh"
#include "core/error.h"
#include "train/adamw_kernels.h"

namespace kcpp::train {

namespace {

using kcpp::kernel::cuda::from_f32;
using kcpp::kernel::cuda::to_f32;

template <typename P, typename G> __global__ void update_kernel(const AdamWUpdate u) {
  P* param = static_cast<P*>(u.param);
  const G* grad = static_cast<const G*>(u.grad);
  const float decay = 1.0f - u.lr * u.weight_decay, step = u.lr / u.bc1, inv_bc2 = 1.0f / u.bc2;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < u.n; i += int64_t(gridDim.x) * blockDim.x) {
    const float g = to_f32(grad[i]) * u.grad_scale;
    const float m = u.beta1 * u.m[i] + (1.0f - u.beta1) * g;
    const float v = u.beta2 * u.v[i] + (1.0f - u.beta2) * g * g;
    u.m[i] = m, u.v[i] = v;
    const float p = u.master ? u.master[i] : to_f32(param[i]);
    const float next = p * decay - step * m / (sqrtf(v * inv_bc2) + u.eps);
    if (u.master) u.master[i] = next;
    param[i] = from_f32<P>(next);
  }
}

constexpr int kBlocks = 1024, kThreads = 256;

template <typename G> __global__ void partial_squares(const G* g, int64_t n, double* partial) {
  __shared__ double sh[kThreads];
  double s = 0.0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const double x = to_f32(g[i]);
    s += x * x;
  }
  sh[threadIdx.x] = s;
  __syncthreads();
  for (int o = blockDim.x / 2; o > 0; o >>= 1) {
    if (threadIdx.x < o) sh[threadIdx.x] += sh[threadIdx.x + o];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}

__global__ void sum_partials(const double* partial, int count, double* acc) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  double s = 0.0;
  for (int i = 0; i < count; ++i) s += partial[i];
  *acc += s;
}

template <typename F> void by_dtype(DType t, F&& f) {
  switch (t) {
    case DType::f32: return f(static_cast<float*>(nullptr));
    case DType::bf16: return f(static_cast<__nv_bfloat16*>(nullptr));
    case DType::f16: return f(static_cast<__half*>(nullptr));
    default: KCPP_FAIL("adamw: dtype {} is not f32, bf16 or f16", dtype_name(t));
  }
}

}  // namespace

void adamw_update_cuda(const AdamWUpdate& u) {
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>((u.n + 255) / 256, 132 * 32));
  by_dtype(u.param_dtype, [&]<typename P>(P*) {
    by_dtype(u.grad_dtype, [&]<typename G>(G*) { update_kernel<P, G><<<grid, 256, 0, cuda::current_stream()>>>(u); });
  });
  KCPP_CUDA_CHECK_LAUNCH("adamw update");
}

void add_squared_norm_cuda(const Tensor& grad, double* acc) {
  const Tensor partial = Tensor::empty({kBlocks}, DType::f64, grad.device());
  by_dtype(grad.dtype(), [&]<typename G>(G*) {
    partial_squares<G><<<kBlocks, kThreads, 0, cuda::current_stream()>>>(static_cast<const G*>(grad.data()), grad.numel(),
                                                                          static_cast<double*>(partial.data()));
  });
  sum_partials<<<1, 32, 0, cuda::current_stream()>>>(static_cast<const double*>(partial.data()), kBlocks, acc);
  KCPP_CUDA_CHECK_LAUNCH("adamw squared norm");
}

}  // namespace kcpp::train
