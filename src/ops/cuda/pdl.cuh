// Programmatic dependent launch (PDL, sm_90 and later) for the decode step's chain of short kernels.
//
// A kernel launched by launch_pdl() may start while the kernel before it on the stream is still
// running, once every block of that one has called pdl_trigger() (or finished).  It must call
// pdl_wait() before its first global write and before its first read of anything an earlier kernel
// of the stream wrote; what nobody writes during the step (weights) it may read before, which is the
// point: the weights of a projection stream in while the previous kernel finishes.  pdl_wait()
// returns once the previous kernel has finished and its writes are visible, and every kernel here
// calls it in every thread, so a finished kernel implies that all before it finished too.  And every
// kernel here calls pdl_trigger() only after its pdl_wait() (a kernel launched without the attribute
// starts once the one before has finished), so when a kernel starts, every kernel before the previous
// one has finished: what those wrote may be read before the wait too (qk_norm_rope_attention's
// settled inputs, ops/nn/decode_fused.h).
//
// Where PDL is not available the launch is an ordinary one and both calls do nothing: devices below
// sm_90, a kernel whose loaded binary is built for an architecture below sm_90 (its pdl_wait() is
// empty, so it must not start early), and KCPP_PDL=0.  Under CUDA graph stream capture the attribute
// becomes a programmatic edge of the graph (CUDA 12.3 and later).
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <utility>

#include "core/cuda_runtime.h"
#include "kcpp/kernel/cuda.cuh"

namespace kcpp::ops::cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether `kernel`, as loaded for the current device, waits in pdl_wait() (its binary is for sm_90
// or later) and KCPP_PDL is not 0.  Cached a (device, kernel).
inline bool pdl_usable(const void* kernel) {
  if (!kcpp::kernel::cuda::dependent_launch_enabled()) return false;
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, bool> known;
  int dev = 0;
  KCPP_CUDA_CHECK(cudaGetDevice(&dev));
  const std::lock_guard<std::mutex> lock(mu);
  const auto [it, fresh] = known.try_emplace({dev, kernel}, false);
  if (fresh) {
    cudaFuncAttributes attr{};
    KCPP_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    int major = 0;
    KCPP_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    it->second = major >= 9 && attr.binaryVersion >= 90;
  }
  return it->second;
}

// kernel<<<grid, block, smem, current stream>>>(args...), with programmatic stream serialization
// where pdl_usable(kernel).  Throws naming `op` if the launch fails.
template <typename... Params, typename... Args>
void launch_pdl(const char* op, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, Args&&... args) {
  const cudaLaunchAttribute attr = kcpp::kernel::cuda::dependent_launch();
  const cudaError_t err = kcpp::kernel::cuda::launch_ex(&attr, pdl_usable(reinterpret_cast<const void*>(kernel)) ? 1 : 0, kernel,
                                                        grid, block, smem, kcpp::cuda::current_stream(), std::forward<Args>(args)...);
  if (err != cudaSuccess)
    KCPP_FAIL("op {}: kernel launch failed: {}: {}", op, cudaGetErrorName(err), cudaGetErrorString(err));
}

}  // namespace kcpp::ops::cuda
