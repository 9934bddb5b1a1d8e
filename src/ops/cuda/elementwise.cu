// Reference elementwise kernels.  The op is a run-time argument (the switch is uniform across the
// grid), which keeps this file to one kernel per dtype and arity; math in ops/math.h is shared
// with the host loops.
#include "core/strided.h"
#include "ops/cuda/common.cuh"
#include "ops/cuda/launch.h"
#include "ops/math.h"

namespace kcpp::ops::cuda {
namespace {

constexpr int kBlock = 256;

template <typename T>
__global__ void unary_kernel(StridedLayout<2> L, int64_t n, T* out, const T* x, Unary op, float alpha) {
  // One merged dim that x steps through by 1 as `out` (a fresh contiguous tensor) does: element i of
  // both is at i.  A stride-0 x (an expanded tensor) takes the offsets, which read x[0] throughout.
  const bool flat = L.ndim == 0 || (L.ndim == 1 && L.strides[1][0] == 1);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t off[2] = {i, i};
    if (!flat) L.offsets(i, off);
    out[off[0]] = kcpp::kernel::cuda::from_f32<T>(math::unary<float>(op, kcpp::kernel::cuda::to_f32(x[off[1]]), alpha));
  }
}

template <typename T>
__global__ void binary_kernel(StridedLayout<3> L, int64_t n, T* out, const T* a, const T* b, Binary op) {
  // As in unary_kernel: flat only when both operands step by 1 through one merged dim; a broadcast
  // operand (stride 0) takes the offsets.
  const bool flat = L.ndim == 0 || (L.ndim == 1 && L.strides[1][0] == 1 && L.strides[2][0] == 1);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t off[3] = {i, i, i};
    if (!flat) L.offsets(i, off);
    out[off[0]] = kcpp::kernel::cuda::from_f32<T>(
        math::binary<float>(op, kcpp::kernel::cuda::to_f32(a[off[1]]), kcpp::kernel::cuda::to_f32(b[off[2]])));
  }
}

// Contiguous operands of one shape: 16-byte vectors (8 elements of a 16-bit type, 4 of f32), the
// tail element by element.
template <typename T>
__global__ void binary_flat_kernel(int64_t n, T* out, const T* a, const T* b, Binary op) {
  constexpr int V = 16 / sizeof(T);
  const int64_t vecs = n / V;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < vecs; i += int64_t(gridDim.x) * blockDim.x) {
    float x[V], y[V];
    kcpp::kernel::cuda::load_f32<T, V>(a + i * V, x);
    kcpp::kernel::cuda::load_f32<T, V>(b + i * V, y);
#pragma unroll
    for (int j = 0; j < V; ++j) x[j] = math::binary<float>(op, x[j], y[j]);
    kcpp::kernel::cuda::store_f32<T, V>(out + i * V, x);
  }
  for (int64_t i = vecs * V + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = kcpp::kernel::cuda::from_f32<T>(math::binary<float>(op, kcpp::kernel::cuda::to_f32(a[i]), kcpp::kernel::cuda::to_f32(b[i])));
}

// ops/nn/rope.h's rope_cos_sin, a thread an element of [N, rd]: the composition it replaces (the
// position converted to f32 times inv_freq, the angles repeated for both halves, cos and sin, the
// scaling, the conversion to T) through the same functions of ops/math.h, so the same bits.
template <typename T, typename I>
__global__ void rope_cos_sin_kernel(T* cos_out, T* sin_out, const I* pos, const float* inv_freq, int64_t n, int rd,
                                    float scaling) {
  const int half = rd / 2;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float angle = math::binary<float>(Binary::Mul, static_cast<float>(pos[i / rd]), inv_freq[i % rd % half]);
    cos_out[i] = kcpp::kernel::cuda::from_f32<T>(
        math::unary<float>(Unary::Scale, math::unary<float>(Unary::Cos, angle, 0.f), scaling));
    sin_out[i] = kcpp::kernel::cuda::from_f32<T>(
        math::unary<float>(Unary::Scale, math::unary<float>(Unary::Sin, angle, 0.f), scaling));
  }
}

}  // namespace

void rope_cos_sin(const Tensor& cos, const Tensor& sin, const Tensor& positions, const Tensor& inv_freq, double scaling) {
  const int64_t n = cos.numel();
  if (n == 0) return;
  kcpp::cuda::DeviceGuard g(cos.device().index);
  const int rd = static_cast<int>(2 * inv_freq.numel());
  visit_cuda_float(cos.dtype(), "rope_cos_sin", [&]<typename T>(std::type_identity<T>) {
    const auto launch = [&]<typename I>(const I* pos) {
      rope_cos_sin_kernel<T, I><<<kcpp::cuda::grid_for(n, kBlock), kBlock, 0, kcpp::cuda::current_stream()>>>(
          static_cast<T*>(cos.data()), static_cast<T*>(sin.data()), pos, static_cast<const float*>(inv_freq.data()), n, rd,
          static_cast<float>(scaling));
    };
    if (positions.dtype() == DType::i32) launch(static_cast<const int32_t*>(positions.data()));
    else launch(static_cast<const int64_t*>(positions.data()));
  });
  KCPP_CUDA_CHECK_LAUNCH("rope_cos_sin");
}

void unary(Unary op, const Tensor& out, const Tensor& x, double alpha) {
  const int64_t n = out.numel();
  if (n == 0) return;
  kcpp::cuda::DeviceGuard g(out.device().index);
  const auto L = make_layout<2>(out.shape(), {&out.strides(), &x.strides()});
  visit_cuda_float(out.dtype(), "unary", [&]<typename T>(std::type_identity<T>) {
    unary_kernel<T><<<kcpp::cuda::grid_for(n, kBlock), kBlock, 0, kcpp::cuda::current_stream()>>>(
        L, n, static_cast<T*>(out.data()), static_cast<const T*>(x.data()), op, static_cast<float>(alpha));
  });
  KCPP_CUDA_CHECK_LAUNCH("unary");
}

void binary(Binary op, const Tensor& out, const Tensor& a, const Tensor& b) {
  const int64_t n = out.numel();
  if (n == 0) return;
  kcpp::cuda::DeviceGuard g(out.device().index);
  const bool flat = out.is_contiguous() && a.is_contiguous() && b.is_contiguous() && a.shape() == out.shape() && b.shape() == out.shape() &&
                    kcpp::kernel::cuda::aligned16(out.data()) && kcpp::kernel::cuda::aligned16(a.data()) &&
                    kcpp::kernel::cuda::aligned16(b.data());
  if (flat) {
    visit_cuda_float(out.dtype(), "binary", [&]<typename T>(std::type_identity<T>) {
      binary_flat_kernel<T><<<kcpp::cuda::grid_for(n / (16 / sizeof(T)) + 1, kBlock), kBlock, 0, kcpp::cuda::current_stream()>>>(
          n, static_cast<T*>(out.data()), static_cast<const T*>(a.data()), static_cast<const T*>(b.data()), op);
    });
    KCPP_CUDA_CHECK_LAUNCH("binary");
    return;
  }
  const auto L = make_layout<3>(out.shape(), {&out.strides(), &a.strides(), &b.strides()});
  visit_cuda_float(out.dtype(), "binary", [&]<typename T>(std::type_identity<T>) {
    binary_kernel<T><<<kcpp::cuda::grid_for(n, kBlock), kBlock, 0, kcpp::cuda::current_stream()>>>(
        L, n, static_cast<T*>(out.data()), static_cast<const T*>(a.data()), static_cast<const T*>(b.data()), op);
  });
  KCPP_CUDA_CHECK_LAUNCH("binary");
}

}  // namespace kcpp::ops::cuda
