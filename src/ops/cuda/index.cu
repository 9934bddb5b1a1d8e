// Reference gathers and scatters.  Indices are checked on the device; a bad one is reported
// through DataCheck (which synchronizes) and the op throws instead of reading out of bounds.
#include <cub/device/device_radix_sort.cuh>
#include <optional>

#include "ops/cuda/common.cuh"
#include "ops/cuda/launch.h"

namespace kcpp::ops::cuda {
namespace {

using kcpp::cuda::load_as_f64;
using kcpp::cuda::load_as_i64;
using kcpp::cuda::store_f64;
using kcpp::kernel::cuda::from_f32;
using kcpp::kernel::cuda::to_f32;

// One block per id: copies row ids[i] of w [V, H] (elements of `es` bytes, as 16-bit words or bytes).
__global__ void embedding_kernel(char* out, const char* w, const void* ids, DType id_t, int64_t n, int64_t v,
                                 int64_t row_bytes, unsigned long long* flag) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t id = load_as_i64(ids, id_t, i);
    if (id < 0 || id >= v) {
      if (flag) {
        if (threadIdx.x == 0) report_bad(flag, i, id);
      } else {  // unchecked: the row is all-ones bits (NaN), never a read out of bounds
        for (int64_t j = threadIdx.x; j < row_bytes; j += blockDim.x) out[i * row_bytes + j] = static_cast<char>(0xff);
      }
      continue;
    }
    const char* src = w + id * row_bytes;
    char* dst = out + i * row_bytes;
    if (row_bytes % 4 == 0) {
      for (int64_t j = threadIdx.x; j < row_bytes / 4; j += blockDim.x)
        reinterpret_cast<uint32_t*>(dst)[j] = reinterpret_cast<const uint32_t*>(src)[j];
    } else {
      for (int64_t j = threadIdx.x; j < row_bytes; j += blockDim.x) dst[j] = src[j];
    }
  }
}

// The embedding's backward without atomics: the token positions sorted by id (CUB's stable radix
// sort), then one block per run of equal ids sums that run's gradient rows in position order (f32)
// and writes the id's row once.  Deterministic; rows of ids no token has are left to the caller's
// zero fill.
__global__ void embedding_keys_kernel(const void* ids, DType id_t, int64_t n, int64_t* keys, int32_t* pos) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    keys[i] = load_as_i64(ids, id_t, i), pos[i] = static_cast<int32_t>(i);
}

template <typename T>
__global__ void embedding_runs_kernel(T* out, const T* g, const int64_t* keys, const int32_t* pos, int64_t n, int64_t v,
                                      int64_t h, unsigned long long* flag) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t id = keys[i];
    if (i > 0 && keys[i - 1] == id) continue;  // not the first of its run
    if (id < 0 || id >= v) {
      if (threadIdx.x == 0) report_bad(flag, pos[i], id);
      continue;
    }
    int64_t end = i + 1;
    while (end < n && keys[end] == id) ++end;
    for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
      float s = 0.0f;
      for (int64_t j = i; j < end; ++j) s += to_f32(g[static_cast<int64_t>(pos[j]) * h + c]);
      out[id * h + c] = from_f32<T>(s);
    }
  }
}

__global__ void gather_kernel(void* out, const void* x, DType t, const void* idx, DType id_t, int64_t n, int64_t v,
                              int64_t ignore, unsigned long long* flag) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = load_as_i64(idx, id_t, i);
    double val = 0.0;
    if (c != ignore) {
      if (c < 0 || c >= v) report_bad(flag, i, c);
      else val = load_as_f64(x, t, i * v + c);
    }
    store_f64(out, t, i, val);
  }
}

__global__ void scatter_kernel(void* out, const void* values, DType t, const void* idx, DType id_t, int64_t n,
                               int64_t v, int64_t ignore, unsigned long long* flag) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = load_as_i64(idx, id_t, i);
    if (c == ignore) continue;
    if (c < 0 || c >= v) report_bad(flag, i, c);
    else store_f64(out, t, i * v + c, load_as_f64(values, t, i));
  }
}

__global__ void valid_kernel(void* out, DType t, const void* idx, DType id_t, int64_t n, int64_t ignore) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store_f64(out, t, i, load_as_i64(idx, id_t, i) != ignore ? 1.0 : 0.0);
}

}  // namespace

void embedding(const Tensor& out, const Tensor& weight, const Tensor& ids, bool check_ids) {
  const int64_t n = ids.numel();
  if (n == 0) return;
  kcpp::cuda::DeviceGuard g(out.device().index);
  std::optional<DataCheck> check;
  if (check_ids) check.emplace(out.device());
  const int64_t row_bytes = weight.size(1) * static_cast<int64_t>(weight.element_size());
  embedding_kernel<<<kcpp::cuda::grid_for(n, 1, 65535 * 16), 128, 0, kcpp::cuda::current_stream()>>>(
      static_cast<char*>(out.data()), static_cast<const char*>(weight.data()), ids.data(), ids.dtype(), n,
      weight.size(0), row_bytes, check ? check->ptr() : nullptr);
  KCPP_CUDA_CHECK_LAUNCH("embedding");
  if (check) check->check("embedding", "ids", weight.size(0));
}

void embedding_backward(const Tensor& out, const Tensor& grad, const Tensor& ids) {
  const int64_t n = ids.numel();
  if (n == 0) return;
  KCPP_CHECK(n <= INT32_MAX, "op embedding_backward: {} ids; at most 2^31 - 1 are supported on CUDA", n);
  kcpp::cuda::DeviceGuard g(out.device().index);
  const Device dev = out.device();
  const cudaStream_t stream = kcpp::cuda::current_stream();
  Tensor keys = Tensor::empty({n}, DType::i64, dev), keys_sorted = Tensor::empty({n}, DType::i64, dev);
  Tensor pos = Tensor::empty({n}, DType::i32, dev), pos_sorted = Tensor::empty({n}, DType::i32, dev);
  embedding_keys_kernel<<<kcpp::cuda::grid_for(n, 256, 4096), 256, 0, stream>>>(ids.data(), ids.dtype(), n,
                                                                                 static_cast<int64_t*>(keys.data()),
                                                                                 static_cast<int32_t*>(pos.data()));
  KCPP_CUDA_CHECK_LAUNCH("embedding_backward keys");
  size_t temp_bytes = 0;
  KCPP_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, static_cast<const int64_t*>(keys.data()),
                                                  static_cast<int64_t*>(keys_sorted.data()), static_cast<const int32_t*>(pos.data()),
                                                  static_cast<int32_t*>(pos_sorted.data()), static_cast<int>(n), 0, 64, stream));
  const Tensor temp = Tensor::empty({static_cast<int64_t>(std::max<size_t>(temp_bytes, 1))}, DType::u8, dev);
  KCPP_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data(), temp_bytes, static_cast<const int64_t*>(keys.data()),
                                                  static_cast<int64_t*>(keys_sorted.data()), static_cast<const int32_t*>(pos.data()),
                                                  static_cast<int32_t*>(pos_sorted.data()), static_cast<int>(n), 0, 64, stream));
  DataCheck check(dev);
  visit_cuda_float(out.dtype(), "embedding_backward", [&]<typename T>(std::type_identity<T>) {
    embedding_runs_kernel<T><<<kcpp::cuda::grid_for(n, 1, 65535 * 16), 128, 0, stream>>>(
        static_cast<T*>(out.data()), static_cast<const T*>(grad.data()), static_cast<const int64_t*>(keys_sorted.data()),
        static_cast<const int32_t*>(pos_sorted.data()), n, out.size(0), out.size(1), check.ptr());
  });
  KCPP_CUDA_CHECK_LAUNCH("embedding_backward");
  check.check("embedding_backward", "ids", out.size(0));
}

void gather_last(const Tensor& out, const Tensor& x, const Tensor& idx, int64_t ignore_index) {
  const int64_t n = idx.numel();
  if (n == 0) return;
  kcpp::cuda::DeviceGuard g(out.device().index);
  DataCheck check(out.device());
  gather_kernel<<<kcpp::cuda::grid_for(n, 256), 256, 0, kcpp::cuda::current_stream()>>>(
      out.data(), x.data(), x.dtype(), idx.data(), idx.dtype(), n, x.size(1), ignore_index, check.ptr());
  KCPP_CUDA_CHECK_LAUNCH("gather_last");
  check.check("gather_last", "idx", x.size(1));
}

void scatter_last(const Tensor& out, const Tensor& values, const Tensor& idx, int64_t ignore_index) {
  const int64_t n = idx.numel();
  if (n == 0) return;
  kcpp::cuda::DeviceGuard g(out.device().index);
  DataCheck check(out.device());
  scatter_kernel<<<kcpp::cuda::grid_for(n, 256), 256, 0, kcpp::cuda::current_stream()>>>(
      out.data(), values.data(), values.dtype(), idx.data(), idx.dtype(), n, out.size(1), ignore_index, check.ptr());
  KCPP_CUDA_CHECK_LAUNCH("scatter_last");
  check.check("scatter_last", "idx", out.size(1));
}

void valid_mask(const Tensor& out, const Tensor& idx, int64_t ignore_index) {
  const int64_t n = idx.numel();
  if (n == 0) return;
  kcpp::cuda::DeviceGuard g(out.device().index);
  valid_kernel<<<kcpp::cuda::grid_for(n, 256), 256, 0, kcpp::cuda::current_stream()>>>(
      out.data(), out.dtype(), idx.data(), idx.dtype(), n, ignore_index);
  KCPP_CUDA_CHECK_LAUNCH("valid_mask");
}

}  // namespace kcpp::ops::cuda
