// RMSNorm kernels (package liger, layer contract RMSNorm/1), forward and backward, CPU and CUDA.
//
// Maths, per row r of x [rows, H] (rows may be strided; the last dim is contiguous):
//   rstd[r] = 1 / sqrt(mean_j x[r,j]^2 + eps)       (f32; CUDA: rsqrtf, within 2 ulp, as Liger's)
//   n[r,j]  = x[r,j] * rstd[r]
//   y[r,j]  = n[r,j] * (offset + w[j])        offset = 1 for Gemma's (1 + w), else 0
// Casting modes, matching Hugging Face's eager modules (where the rounding to the dtype happens):
//   Llama: y = round(round(n) * (offset + w))      (LlamaRMSNorm: statistics in f32, n rounded)
//   Gemma: y = round(n * (offset + w))             (GemmaRMSNorm: everything in f32)
//   None:  y = round(round(x * round(rstd)) * (offset + w))   (every step in the dtype)
// Saved for backward: rstd [rows] in f32 only (4 bytes per row).
//
// Backward, with g = dy * (offset + w):
//   dx[r,:] = rstd[r] * (g - n * mean_j(g * n))        (n = x rstd unrounded: the rounding's
//                                                       derivative taken as 1; f32, rounded once)
//   dw[j]   = sum_r dy[r,j] * n[r,j]                   (n as the forward rounded it; f32, rounded once)
// dw is reduced without atomics: each CUDA block sums its rows into its own f32 row of the
// workspace, and a second kernel adds those rows in a fixed order, so results are bitwise
// reproducible run to run.  dx may alias dy (in-place backward).
//
// Cost at [rows, H]: forward reads x once and writes y once (+4 B/row); backward reads dy and x,
// writes dx (+ the workspace, ~2 x blocks x H x 4 B).
//
// AddRMSNorm (layer contract AddRMSNorm/1): with `residual` set, the forward first forms
//   r = round(x + residual)                  (the residual stream, as eager adds it in the dtype)
// writes it to residual_out (which may be x or residual itself) and normalises r instead of x, in
// the same pass (reads x and residual, writes residual_out and y).  Its backward is the RMSNorm
// backward on r (pass residual_out as x) plus the gradient arriving at residual_out:
//   dx = rstd * (g - n * mean(g * n)) + dresidual_out      (the gradient of both x and residual)
// with dresidual_out optional (absent: 0).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kcpp/kernel/types.h"

#if KCPP_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace kcpp::liger {

enum class RMSNormCasting : int32_t { Llama = 0, Gemma = 1, None = 2 };

struct RMSNormParams {
  kernel::DType dtype = kernel::DType::bf16;  // of x, w, y (and dy, dx)
  int64_t rows = 0, hidden = 0;
  float eps = 1e-6f;
  float offset = 0.0f;
  RMSNormCasting casting = RMSNormCasting::Llama;

  const void* x = nullptr;  // [rows, hidden], row stride x_stride (elements)
  int64_t x_stride = 0;
  const void* w = nullptr;  // [hidden]
  void* y = nullptr;        // forward output, row stride y_stride
  int64_t y_stride = 0;
  float* rstd = nullptr;    // [rows]: written by forward, read by backward
  const void* residual = nullptr;  // forward, optional (AddRMSNorm): row stride residual_stride
  int64_t residual_stride = 0;
  void* residual_out = nullptr;    // with residual: r = x + residual; may be x or residual (same stride)
  int64_t residual_out_stride = 0;

  // backward only
  const void* dy = nullptr;  // row stride dy_stride
  int64_t dy_stride = 0;
  void* dx = nullptr;        // row stride dx_stride; may equal dy (same stride)
  int64_t dx_stride = 0;
  void* dw = nullptr;        // [hidden]
  const void* dresidual_out = nullptr;  // optional: added into dx (AddRMSNorm); row stride dres_stride
  int64_t dres_stride = 0;
  void* workspace = nullptr; // rms_norm_backward_workspace() bytes (CUDA only)
};

// CPU (any thread count; dw is deterministic for a given thread count).
const char* rms_norm_forward_cpu(const RMSNormParams& p);
const char* rms_norm_backward_cpu(const RMSNormParams& p);

#if KCPP_WITH_CUDA
// Bytes of device workspace rms_norm_backward_cuda needs for these params on `device`.
size_t rms_norm_backward_workspace(const RMSNormParams& p, int device);
const char* rms_norm_forward_cuda(const RMSNormParams& p, cudaStream_t stream);
const char* rms_norm_backward_cuda(const RMSNormParams& p, cudaStream_t stream);
#endif

// Checks shared by both devices (pointers, sizes, strides, alignment-independent); nullptr if fine.
const char* rms_norm_check(const RMSNormParams& p, bool backward);

}  // namespace kcpp::liger
