// Activation kernels (package "activation"): the elementwise activations and the fused gated
// "AndMul" forms, forward and backward, CPU and CUDA.
//
// Over rows of a [..., W] tensor (the last dim contiguous, rows `*_stride` elements apart), with
// act / act' from kcpp/kernel/activation.h (silu, gelu, gelu_tanh, quick_gelu):
//   plain   (W = d):   y[r, j]  = act(x[r, j])                       dx[r, j] = dy[r, j] act'(x[r, j])
//   gated   (x: W = 2d, y: d), the vLLM / kernels-community "silu_and_mul" layout:
//           y[r, j]      = act(x[r, j]) * x[r, d + j]
//           dx[r, j]     = dy[r, j] * x[r, d + j] * act'(x[r, j])
//           dx[r, d + j] = dy[r, j] * act(x[r, j])
// f32 inside, one rounding to the dtype (f32, bf16, f16); nothing is saved (backward recomputes act
// from x).  In place: y may be x (plain), dx may be dy (plain) or x (gated), with the same strides:
// each thread reads all it needs of a position before writing it.  NaN propagates as the formulas do.
// 16-bit dtypes use MathMode::Fast (hardware exp on the GPU, the vectorizable exp_f32 on the CPU; GELU's
// Phi from normal_cdf_fast on the GPU, normal_cdf_f32 on the CPU); f32 uses the accurate functions, with
// exp_f32, tanh_f32 and normal_cdf_f32 on the CPU (MathMode::FastExp).
// Cost: plain forward reads and writes n elements, backward reads 2n and writes n; gated forward
// reads 2n and writes n (n = rows * d), backward reads 3n and writes 2n.
#pragma once

#include <cstdint>

#include "kcpp/kernel/activation.h"
#include "kcpp/kernel/types.h"

#if KCPP_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace kcpp::activation {

struct ActParams {
  kernel::DType dtype = kernel::DType::bf16;
  kernel::Activation act = kernel::Activation::Silu;
  bool gated = false;
  int64_t rows = 0, d = 0;  // d: width of y (x is 2d wide when gated)
  const void* x = nullptr;
  int64_t x_stride = 0;
  void* y = nullptr;        // forward
  int64_t y_stride = 0;
  const void* dy = nullptr; // backward: [rows, d]
  int64_t dy_stride = 0;
  void* dx = nullptr;       // backward: shaped like x
  int64_t dx_stride = 0;
};

const char* act_check(const ActParams& p, bool backward);
const char* act_forward_cpu(const ActParams& p);
const char* act_backward_cpu(const ActParams& p);
#if KCPP_WITH_CUDA
const char* act_forward_cuda(const ActParams& p, cudaStream_t stream);
const char* act_backward_cuda(const ActParams& p, cudaStream_t stream);

// Launch configuration of the CUDA kernels, for the benchmark's sweep; the entry points above use the
// defaults (bench/RESULTS.md has the sweep behind them).
// Defaults: the sweep on an H200 at [8192, 14336] bf16 (commit 6a21ab4): one vector a thread and no
// cap (one pass over the data) was best or within 3% of best for all four kernels: SiluAndMul forward
// 0.1662 ms (100% of copy) against 0.1796 ms at unroll 2 / 32 blocks per SM.
struct ActConfig {
  int unroll = 1;         // 16-byte vectors a thread per loop iteration, loads first: 1, 2 or 4
  int blocks_per_sm = 0;  // grid cap in blocks of 256 threads per multiprocessor; 0 = one pass, no cap
};
const char* act_forward_cuda_with(const ActParams& p, cudaStream_t stream, const ActConfig& c);
const char* act_backward_cuda_with(const ActParams& p, cudaStream_t stream, const ActConfig& c);
#endif

}  // namespace kcpp::activation
