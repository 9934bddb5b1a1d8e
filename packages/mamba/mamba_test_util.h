// Shared by the mamba kernel tests: calling an entry point on a device, the params' views of tensors,
// and the error bound the kernels are held to.
#pragma once

#include <string>

#include "core/cuda_runtime.h"
#include "core/tensor.h"
#include "kcpp/kernel/types.h"
#include "selective_scan/selective_scan.h"
#include "test_util.h"

namespace kcpp::test {

// After a CUDA entry point: on success wait for the device (a CUDA error becomes kcpp::Error); the entry
// point's own message passes through for the tests of bad input.
inline const char* mamba_finish(const char* kernel_error) {
#if KCPP_WITH_CUDA
  if (!kernel_error) KCPP_CUDA_CHECK(cudaDeviceSynchronize());
#endif
  return kernel_error;
}
inline void mamba_check(const char* kernel_error) {
  if (kernel_error) throw Error(kernel_error);
}

inline kernel::DType mamba_dtype(DType t) {
  switch (t) {
    case DType::f32:
      return kernel::DType::f32;
    case DType::bf16:
      return kernel::DType::bf16;
    case DType::f16:
      return kernel::DType::f16;
    default:
      throw Error("no kernel dtype for " + std::string(dtype_name(t)));
  }
}

// A [B, rows, L] tensor (L contiguous) and a [B, G, N, L] one as the kernels see them.
inline mamba::Seq seq_of(const Tensor& t) {
  if (!t.defined()) return {};
  if (t.size(2) > 1 && t.stride(2) != 1) throw Error("mamba test: L must be contiguous, got " + t.str());
  return {t.data(), t.stride(0), t.stride(1)};
}
inline mamba::GroupSeq group_seq_of(const Tensor& t) {
  if (t.size(3) > 1 && t.stride(3) != 1) throw Error("mamba test: L must be contiguous, got " + t.str());
  return {t.data(), t.stride(0), t.stride(1), t.stride(2)};
}

// The bound on ||out - oracle|| / ||magnitude||: one rounding to the output dtype, plus 32 units of f32
// for the f32 arithmetic before it (exp, the recurrence, the sums), plus what subnormals can cost.
inline double mamba_bound(DType t, const std::vector<double>& magnitude) {
  return unit_roundoff(t) + 32 * unit_roundoff(DType::f32) + underflow_allowance(t, magnitude);
}

}  // namespace kcpp::test

// MAMBA_CALL(dev, mamba::selective_scan_forward, p): the `_cuda` entry point on the current stream for a
// CUDA device, else the `_cpu` one; evaluates to the entry point's message.
#if KCPP_WITH_CUDA
#define MAMBA_CALL(dev, fn, p) \
  ((dev).is_cuda() ? ::kcpp::test::mamba_finish(fn##_cuda((p), ::kcpp::cuda::current_stream())) : fn##_cpu(p))
#else
#define MAMBA_CALL(dev, fn, p) (fn##_cpu(p))
#endif
