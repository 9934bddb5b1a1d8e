// CUDA copies with conversion.  One kernel for all dtype pairs: the dtype switches are uniform,
// so each warp takes one path; the cost is a few instructions per element of a memory-bound loop.
#include "core/copy.h"
#include "core/cuda_runtime.h"
#include "core/cuda_types.cuh"
#include "core/strided.h"

namespace kcpp::detail {
namespace {

__global__ void copy_kernel(StridedLayout<2> L, int64_t n, void* dst, DType dt, const void* src, DType st) {
  const bool ints = is_integral(dt) && is_integral(st);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t off[2];
    L.offsets(i, off);
    if (ints) cuda::store_i64(dst, dt, off[0], cuda::load_as_i64(src, st, off[1]));
    else cuda::store_f64(dst, dt, off[0], cuda::load_as_f64(src, st, off[1]));
  }
}

__global__ void fill_kernel(StridedLayout<1> L, int64_t n, void* dst, DType dt, double v) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t off[1];
    L.offsets(i, off);
    cuda::store_f64(dst, dt, off[0], v);
  }
}

}  // namespace

void copy_cuda(const Tensor& dst, const Tensor& src) {
  cuda::DeviceGuard g(dst.device().index);
  if (dst.dtype() == src.dtype() && dst.is_contiguous() && src.is_contiguous()) {
    KCPP_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), dst.nbytes(), cudaMemcpyDeviceToDevice,
                                    cuda::current_stream()));
    return;
  }
  const auto L = make_layout<2>(dst.shape(), {&dst.strides(), &src.strides()});
  const int64_t n = dst.numel();
  copy_kernel<<<cuda::grid_for(n, 256), 256, 0, cuda::current_stream()>>>(L, n, dst.data(), dst.dtype(),
                                                                            src.data(), src.dtype());
  KCPP_CUDA_CHECK_LAUNCH("copy");
}

void fill_cuda(const Tensor& dst, double value) {
  cuda::DeviceGuard g(dst.device().index);
  const auto L = make_layout<1>(dst.shape(), {&dst.strides()});
  const int64_t n = dst.numel();
  fill_kernel<<<cuda::grid_for(n, 256), 256, 0, cuda::current_stream()>>>(L, n, dst.data(), dst.dtype(), value);
  KCPP_CUDA_CHECK_LAUNCH("fill");
}

}  // namespace kcpp::detail
