// The example package's one CUDA kernel: the `scale` op (y = alpha * x) on a CUDA device, so that the
// package builder's CUDA variant (kcpp1-cu<XY>-...) is built, indexed and loaded by the tests too.
#include <cuda_runtime.h>

#include <cstdint>

#include "kcpp/kernel/cuda.cuh"
#include "kcpp/kernel/error.h"
#include "kcpp/kernel/types.h"

namespace {

template <typename T>
__global__ void scale_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t n, float alpha) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    y[i] = kcpp::kernel::cuda::from_f32<T>(alpha * kcpp::kernel::cuda::to_f32(x[i]));
}

}  // namespace

// Called by example.cpp; returns nullptr or an error message.
const char* example_scale_cuda(const void* x, void* y, int64_t n, float alpha, int dtype, void* stream) {
  if (n == 0) return nullptr;
  const int threads = 256;
  const int blocks = static_cast<int>(n / threads + 1 < 4096 ? n / threads + 1 : 4096);
  auto s = static_cast<cudaStream_t>(stream);
  switch (static_cast<kcpp::kernel::DType>(dtype)) {
    case kcpp::kernel::DType::f32:
      scale_kernel<<<blocks, threads, 0, s>>>(static_cast<const float*>(x), static_cast<float*>(y), n, alpha);
      break;
    case kcpp::kernel::DType::bf16:
      scale_kernel<<<blocks, threads, 0, s>>>(static_cast<const __nv_bfloat16*>(x), static_cast<__nv_bfloat16*>(y), n,
                                              alpha);
      break;
    case kcpp::kernel::DType::f16:
      scale_kernel<<<blocks, threads, 0, s>>>(static_cast<const __half*>(x), static_cast<__half*>(y), n, alpha);
      break;
  }
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : kcpp::kernel::errorf("scale: CUDA launch failed: %s", cudaGetErrorString(err));
}
