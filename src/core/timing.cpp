#include "core/timing.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include <cstdlib>
#include <cstring>

#include "core/cuda_runtime.h"
#include "core/tensor.h"

namespace kcpp {

#if KCPP_WITH_CUDA
namespace {
// The buffer zeroed before each timed GPU run (see time_op); one per device, kept for the process.
void* flush_buffer(int device, size_t bytes) {
  static std::vector<void*> buffers;
  if (buffers.size() <= static_cast<size_t>(device)) buffers.resize(static_cast<size_t>(device) + 1, nullptr);
  if (!buffers[static_cast<size_t>(device)]) KCPP_CUDA_CHECK(cudaMalloc(&buffers[static_cast<size_t>(device)], bytes));
  return buffers[static_cast<size_t>(device)];
}

// KCPP_TIMING_FLUSH (see time_op): zero (the default), clean, none.
enum class Flush { Zero, Clean, None };
Flush flush_mode() {
  const char* no_flush = std::getenv("KCPP_TIMING_NO_FLUSH");
  if (no_flush && *no_flush == '1') return Flush::None;
  const char* m = std::getenv("KCPP_TIMING_FLUSH");
  if (!m || !*m || std::strcmp(m, "zero") == 0) return Flush::Zero;
  if (std::strcmp(m, "clean") == 0) return Flush::Clean;
  if (std::strcmp(m, "none") == 0) return Flush::None;
  throw Error(std::string("KCPP_TIMING_FLUSH: '") + m + "' is not one of zero, clean, none");
}
}  // namespace

namespace detail {
void read_through(void* buffer, size_t bytes, cudaStream_t stream);  // core/timing_cuda.cu
}
#endif

void synchronize(Device device) {
#if KCPP_WITH_CUDA
  if (device.is_cuda()) {
    cuda::DeviceGuard g(device.index);
    KCPP_CUDA_CHECK(cudaDeviceSynchronize());
  }
#else
  (void)device;
#endif
}

Timing time_op(Device device, const std::function<void()>& fn, int warmup, int reps) {
  KCPP_CHECK(reps > 0, "time_op: reps must be > 0");
  for (int i = 0; i < warmup; ++i) fn();
  synchronize(device);
  std::vector<double> ms(static_cast<size_t>(reps));
#if KCPP_WITH_CUDA
  if (device.is_cuda()) {
    cuda::DeviceGuard g(device.index);
    constexpr size_t kFlushBytes = size_t{256} << 20;  // what triton.testing.do_bench zeroes
    const Flush mode = flush_mode();
    void* flush = mode == Flush::None ? nullptr : flush_buffer(device.index, kFlushBytes);
    cudaEvent_t start, stop;
    KCPP_CUDA_CHECK(cudaEventCreate(&start));
    KCPP_CUDA_CHECK(cudaEventCreate(&stop));
    for (double& t : ms) {
      if (flush) KCPP_CUDA_CHECK(cudaMemsetAsync(flush, 0, kFlushBytes, cuda::current_stream()));
      if (mode == Flush::Clean) detail::read_through(flush, kFlushBytes, cuda::current_stream());
      KCPP_CUDA_CHECK(cudaEventRecord(start, cuda::current_stream()));
      fn();
      KCPP_CUDA_CHECK(cudaEventRecord(stop, cuda::current_stream()));
      KCPP_CUDA_CHECK(cudaEventSynchronize(stop));
      float f = 0;
      KCPP_CUDA_CHECK(cudaEventElapsedTime(&f, start, stop));
      t = f;
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  } else
#endif
  {
    for (double& t : ms) {
      const auto t0 = std::chrono::steady_clock::now();
      fn();
      t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    }
  }
  std::vector<double> sorted = ms;
  std::sort(sorted.begin(), sorted.end());
  return {sorted[sorted.size() / 2], sorted.front(), sorted.back(), reps};
}

CopyCeiling measure_copy(Device device, size_t bytes, int reps) {
  const Tensor a = Tensor::full({static_cast<int64_t>(bytes)}, 1.0, DType::u8, device);
  const Tensor b = Tensor::empty({static_cast<int64_t>(bytes)}, DType::u8, device);
  std::function<void()> fn = [&] { std::memcpy(b.data(), a.data(), bytes); };
#if KCPP_WITH_CUDA
  if (device.is_cuda())
    fn = [&] {
      KCPP_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice, cuda::current_stream()));
    };
#endif
  CopyCeiling c;
  c.timing = time_op(device, fn, 3, reps);
  c.gbps = 2.0 * static_cast<double>(bytes) / (c.timing.median_ms * 1e-3) / 1e9;
  return c;
}

}  // namespace kcpp
