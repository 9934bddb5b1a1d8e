// The thin layer over the CUDA runtime that core/ and ops/ share: the check macros, the current
// stream, a device guard.  In a CPU-only build it declares nothing CUDA-specific.
#pragma once

#include "core/error.h"

#if KCPP_WITH_CUDA
#include <cuda_runtime.h>

// KCPP_CUDA_CHECK(expr): evaluates a CUDA runtime call once; throws kcpp::Error with the error name,
// its description, the expression and the location.
#define KCPP_CUDA_CHECK(expr)                                                                       \
  do {                                                                                              \
    const cudaError_t kcpp_err_ = (expr);                                                           \
    if (kcpp_err_ != cudaSuccess) [[unlikely]]                                                      \
      ::kcpp::detail::throw_check_failure(#expr,                                                    \
          KCPP_FORMAT("CUDA error {}: {}", cudaGetErrorName(kcpp_err_), cudaGetErrorString(kcpp_err_)), \
          ::std::source_location::current());                                                      \
  } while (0)

// KCPP_CUDA_CHECK_LAUNCH("op"): after a kernel launch, reports a launch failure naming the op.
#define KCPP_CUDA_CHECK_LAUNCH(op)                                                                  \
  do {                                                                                              \
    const cudaError_t kcpp_err_ = cudaGetLastError();                                               \
    if (kcpp_err_ != cudaSuccess) [[unlikely]]                                                      \
      ::kcpp::detail::throw_check_failure(nullptr,                                                  \
          KCPP_FORMAT("op {}: kernel launch failed: {}: {}", op, cudaGetErrorName(kcpp_err_),     \
                        cudaGetErrorString(kcpp_err_)),                                             \
          ::std::source_location::current());                                                      \
  } while (0)

namespace kcpp::cuda {

// The stream ops launch on for the calling thread (default: the legacy default stream).
cudaStream_t current_stream();
void set_current_stream(cudaStream_t s);

// Makes `device` current for the guard's lifetime.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

}  // namespace kcpp::cuda
#endif
