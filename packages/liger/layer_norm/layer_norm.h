// LayerNorm kernels (package liger, layer contract LayerNorm/1), forward and backward, CPU and CUDA.
//
// Maths, per row r of x [rows, H] (rows may be strided; the last dim is contiguous), as PyTorch's
// fused kernel computes it (statistics and normalisation in f32, one rounding to the dtype):
//   mean[r] = mean_j x[r,j]
//   rstd[r] = 1 / sqrt(mean_j (x[r,j] - mean[r])^2 + eps)        (no cancellation: two passes, or
//                                                                   Chan's pairwise merge of partial
//                                                                   means and squared deviations)
//   xhat    = (x - mean) * rstd
//   y       = xhat * w + b                                         (b optional)
// Saved for backward: mean and rstd, [rows] f32 (8 bytes per row).
// Backward, with g = dy * w:
//   dx = rstd * (g - mean_j(g) - xhat * mean_j(g * xhat))          (f32, rounded once)
//   dw = sum_rows dy * xhat,   db = sum_rows dy                    (f32, rounded once)
// dw and db are reduced without atomics (per-block partial rows in the workspace, added in block
// order): bitwise reproducible.  dx may alias dy.
// Cost at [rows, H]: forward reads x once (the CUDA kernel holds rows up to 8192 bf16 / 4096 f32 in
// registers; wider rows are re-read from L2) and writes y; backward reads dy and x, writes dx.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kcpp/kernel/types.h"

#if KCPP_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace kcpp::liger {

struct LayerNormParams {
  kernel::DType dtype = kernel::DType::bf16;  // of x, w, b, y (and dy, dx, dw, db)
  int64_t rows = 0, hidden = 0;
  float eps = 1e-5f;

  const void* x = nullptr;  // [rows, hidden], row stride x_stride (elements)
  int64_t x_stride = 0;
  const void* w = nullptr;  // [hidden]
  const void* b = nullptr;  // [hidden] or null
  void* y = nullptr;        // forward output, row stride y_stride
  int64_t y_stride = 0;
  float* mean = nullptr;    // [rows]: written by forward, read by backward
  float* rstd = nullptr;    // [rows]

  // backward only
  const void* dy = nullptr;
  int64_t dy_stride = 0;
  void* dx = nullptr;  // may equal dy (same stride)
  int64_t dx_stride = 0;
  void* dw = nullptr;         // [hidden]
  void* db = nullptr;         // [hidden] or null (no bias gradient)
  void* workspace = nullptr;  // layer_norm_backward_workspace() bytes (CUDA only)
};

const char* layer_norm_check(const LayerNormParams& p, bool backward);
const char* layer_norm_forward_cpu(const LayerNormParams& p);
const char* layer_norm_backward_cpu(const LayerNormParams& p);
#if KCPP_WITH_CUDA
size_t layer_norm_backward_workspace(const LayerNormParams& p, int device);
const char* layer_norm_forward_cuda(const LayerNormParams& p, cudaStream_t stream);
// As layer_norm_forward_cuda with the registers path's 16-byte vectors a thread given (1, 2 or 4;
// others, or too few for the row: the default): for the sweep of bench/bench_kernels.cpp.
const char* layer_norm_forward_cuda_with(const LayerNormParams& p, cudaStream_t stream, int items);
const char* layer_norm_backward_cuda(const LayerNormParams& p, cudaStream_t stream);
// As the two above with the backward's row paths' 16-byte vectors a thread (1 or 2; other values, or
// a row beyond them: the default), resident blocks an SM (> 0: at most that many) and the bulk path's
// cluster size (1, 2, 4 or 8; 1: no cluster; 0: the default) given: for the sweep of
// bench/bench_kernels.cpp and the tests.
size_t layer_norm_backward_workspace_with(const LayerNormParams& p, int device, int items, int blocks_per_sm, int cluster);
const char* layer_norm_backward_cuda_with(const LayerNormParams& p, cudaStream_t stream, int items, int blocks_per_sm, int cluster);
#endif

}  // namespace kcpp::liger
