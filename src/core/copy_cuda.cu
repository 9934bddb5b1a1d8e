// CUDA copies with conversion.  One kernel for all dtype pairs: the dtype switches are uniform,
// so each warp takes one path; the cost is a few instructions per element of a memory-bound loop.
#include <cmath>

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

// Same-dtype copies whose innermost dimension is contiguous in both tensors (a transpose of the outer
// dims, a narrow, a strided view): moved as rows of V-byte vectors, the outer offsets computed once
// per vector instead of per element and no conversion.  `L` covers the outer dims; rows are
// `row_vecs` vectors long.
template <int V>
__global__ void copy_rows_kernel(StridedLayout<2> L, int64_t rows, int64_t row_vecs, int64_t elem_bytes, char* dst, const char* src) {
  using Vec = kcpp::kernel::cuda::Vec<unsigned char, V>;
  const int64_t n = rows * row_vecs;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / row_vecs, v = i - row * row_vecs;
    int64_t off[2];
    L.offsets(row, off);
    *reinterpret_cast<Vec*>(dst + off[0] * elem_bytes + v * V) = *reinterpret_cast<const Vec*>(src + off[1] * elem_bytes + v * V);
  }
}

// The widest vector (16, 8 or 4 bytes) that every row start and the row length allow, or 0.
int row_vector_bytes(const Tensor& dst, const Tensor& src) {
  const int64_t d = dst.dim();
  if (d == 0 || dst.strides()[d - 1] != 1 || src.strides()[d - 1] != 1) return 0;
  const int64_t es = static_cast<int64_t>(dtype_size(dst.dtype()));
  for (int v : {16, 8, 4}) {
    bool ok = (dst.size(d - 1) * es) % v == 0 && reinterpret_cast<uintptr_t>(dst.data()) % v == 0 &&
              reinterpret_cast<uintptr_t>(src.data()) % v == 0;
    for (int64_t k = 0; k + 1 < d && ok; ++k) ok = (dst.strides()[k] * es) % v == 0 && (src.strides()[k] * es) % v == 0;
    if (ok) return v;
  }
  return 0;
}

}  // namespace

void copy_cuda(const Tensor& dst, const Tensor& src) {
  cuda::DeviceGuard g(dst.device().index);
  if (dst.dtype() == src.dtype() && dst.is_contiguous() && src.is_contiguous()) {
    KCPP_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), dst.nbytes(), cudaMemcpyDeviceToDevice,
                                    cuda::current_stream()));
    return;
  }
  if (dst.dtype() == src.dtype()) {
    if (const int v = row_vector_bytes(dst, src)) {
      const int64_t d = dst.dim(), es = static_cast<int64_t>(dtype_size(dst.dtype()));
      const Shape outer(dst.shape().begin(), dst.shape().end() - 1);
      const Shape ds(dst.strides().begin(), dst.strides().end() - 1), ss(src.strides().begin(), src.strides().end() - 1);
      const auto L = make_layout<2>(outer, {&ds, &ss});
      const int64_t rows = shape_numel(outer), row_vecs = dst.size(d - 1) * es / v;
      const unsigned grid = cuda::grid_for(rows * row_vecs, 256);
      char* out = static_cast<char*>(dst.data());
      const char* in = static_cast<const char*>(src.data());
      if (v == 16) copy_rows_kernel<16><<<grid, 256, 0, cuda::current_stream()>>>(L, rows, row_vecs, es, out, in);
      else if (v == 8) copy_rows_kernel<8><<<grid, 256, 0, cuda::current_stream()>>>(L, rows, row_vecs, es, out, in);
      else copy_rows_kernel<4><<<grid, 256, 0, cuda::current_stream()>>>(L, rows, row_vecs, es, out, in);
      KCPP_CUDA_CHECK_LAUNCH("copy");
      return;
    }
  }
  const auto L = make_layout<2>(dst.shape(), {&dst.strides(), &src.strides()});
  const int64_t n = dst.numel();
  copy_kernel<<<cuda::grid_for(n, 256), 256, 0, cuda::current_stream()>>>(L, n, dst.data(), dst.dtype(),
                                                                            src.data(), src.dtype());
  KCPP_CUDA_CHECK_LAUNCH("copy");
}

void fill_cuda(const Tensor& dst, double value) {
  cuda::DeviceGuard g(dst.device().index);
  // Zero is all-zero bytes in every dtype: a contiguous zero fill is a memset at the copy engine's rate.
  if (value == 0.0 && !std::signbit(value) && dst.is_contiguous()) {
    KCPP_CUDA_CHECK(cudaMemsetAsync(dst.data(), 0, dst.nbytes(), cuda::current_stream()));
    return;
  }
  const auto L = make_layout<1>(dst.shape(), {&dst.strides()});
  const int64_t n = dst.numel();
  fill_kernel<<<cuda::grid_for(n, 256), 256, 0, cuda::current_stream()>>>(L, n, dst.data(), dst.dtype(), value);
  KCPP_CUDA_CHECK_LAUNCH("fill");
}

}  // namespace kcpp::detail
