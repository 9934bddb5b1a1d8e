// Cross-entropy with its gradient in one pass over the logits (package liger, "CrossEntropyLoss/1"),
// CPU and CUDA.  The gradient is what backward needs, so it is computed by the forward (as Liger
// does) and may be written in place over the logits: no N x V buffer beyond the logits exists.
//
// Per row i with target t_i (rows with t_i == ignore_index give loss 0 and gradient 0), logits x_ij
// (plus the optional bias b_j), in f32 with a max-shifted, online log-sum-exp:
//   z_ij   = c tanh(x_ij / c) with softcap c > 0 (Gemma 2), else x_ij
//   lse_i  = log sum_j exp(z_ij),  p_ij = exp(z_ij - lse_i)
//   ce_i   = (1 - eps) w_t (lse_i - z_it) + (eps / V) sum_j w_j (lse_i - z_ij)     (label smoothing eps)
//   loss_i = tau_i (ce_i + beta lse_i^2)                                           (z-loss beta)
// with class weights w_j (default 1; PyTorch's `weight`) and per-token weights tau_i (default 1).
// Without options this is (1 - eps)(lse - z_t) + eps (lse - mean_j z_j).  The gradient:
//   dloss_i / dz_ij = tau_i [p_ij ((1 - eps) w_t + eps W / V + 2 beta lse_i) - (1 - eps) w_t [j = t] - eps w_j / V]
//   dloss_i / dx_ij = dloss_i / dz_ij (1 - (z_ij / c)^2)   (softcap; else the same),  W = sum_j w_j.
// Reduction: None -> loss [N]; Sum -> sum_i loss_i; Mean -> sum_i loss_i / D with D = sum over
// non-ignored rows of w_{t_i} (PyTorch's rule; the count of non-ignored rows without class weights;
// NaN when 0, as PyTorch; token weights do not enter D), and the gradient is scaled by 1 / D.  The
// gradient is for an upstream gradient of `grad_scale` (default 1; or scale it by the real one in
// the backward, as Liger does).  An optional bias [v] is added to every row of logits first.
// Reductions are deterministic (fixed order, no atomics) and nothing synchronizes with the host: the
// count and the sum are computed on the device.
// Layout: logits [N, V] with a row stride, V contiguous; targets [N], i64 or i32.
// CUDA paths (cross_entropy_cuda.cu): on sm_90, with 16-byte rows, a thread-block cluster holds each
// row on chip and DRAM sees the logits read once (rows up to 8 x 64 KiB: V <= 262144 for 16-bit
// logits, 131072 for f32), with or without the gradient; elsewhere a block a row reads the row once
// for the loss and again for the gradient (mostly from L2).  Both compute the same maths;
// cross_entropy_tuning.h selects.
// A target outside [0, V) other than ignore_index: the CPU path returns an error naming the row; the
// CUDA path cannot raise one without synchronizing, so it writes NaN into that row's loss and
// gradient (so the loss is NaN, never silently wrong) and counts the row in `bad_targets`, an
// optional device i32 the host can read whenever it synchronizes.
#pragma once

#include <cstdint>

#include "kcpp/kernel/types.h"

#if KCPP_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace kcpp::liger {

enum class CEReduction : int32_t { Mean = 0, Sum = 1, None = 2 };

struct CrossEntropyParams {
  kernel::DType dtype = kernel::DType::bf16;  // of logits and grad
  int64_t n = 0, v = 0;
  const void* logits = nullptr;  // [n, v], rows logits_stride apart
  int64_t logits_stride = 0;
  const void* bias = nullptr;    // optional [v], dtype of the logits: added to every row first (the
                                 // fused linear cross-entropy's output bias)
  const void* targets = nullptr; // [n]
  bool targets_i32 = false;      // else i64
  int64_t ignore_index = -100;
  float label_smoothing = 0.0f;
  float lse_square_scale = 0.0f; // z-loss beta
  float softcap = 0.0f;          // c; 0 = off
  const float* class_weight = nullptr;  // optional [v] f32 (w_j)
  const float* token_weight = nullptr;  // optional [n] f32 (tau_i), rows of this call
  CEReduction reduction = CEReduction::Mean;
  float* loss = nullptr;         // [1] (Mean, Sum) or [n] (None), f32
  void* grad = nullptr;          // [n, v] rows grad_stride apart, or null (loss only); may be logits
  int64_t grad_stride = 0;
  float* lse = nullptr;          // optional [n]: log-sum-exp per row (for a later backward)
  float grad_scale = 1.0f;       // multiplies the gradient (a known upstream gradient, e.g. 1 / accumulation steps)
  void* workspace = nullptr;     // cross_entropy_workspace() bytes (CUDA)
  int32_t* bad_targets = nullptr;  // optional device counter (CUDA), see above
};

// Backward: dlogits = grad * dloss, grad being what the forward wrote (the gradient for an upstream 1).
// dloss is a host number (`scale`) or an f32 device value read by the kernel (no synchronization):
// one value (Mean, Sum) or one per row (None).  dlogits may be grad (same stride).
struct CEScaleParams {
  kernel::DType dtype = kernel::DType::bf16;
  int64_t n = 0, v = 0;
  const void* grad = nullptr;
  int64_t grad_stride = 0;
  void* dlogits = nullptr;
  int64_t dlogits_stride = 0;
  float scale = 1.0f;             // used when dloss is null
  const float* dloss = nullptr;   // [1] or [n] (per_row)
  bool per_row = false;
};

const char* cross_entropy_check(const CrossEntropyParams& p);
const char* cross_entropy_scale_check(const CEScaleParams& p);
const char* cross_entropy_scale_cpu(const CEScaleParams& p);
const char* cross_entropy_cpu(const CrossEntropyParams& p);
#if KCPP_WITH_CUDA
size_t cross_entropy_workspace(const CrossEntropyParams& p);
const char* cross_entropy_cuda(const CrossEntropyParams& p, cudaStream_t stream);
const char* cross_entropy_scale_cuda(const CEScaleParams& p, cudaStream_t stream);
#endif

// ---- Building blocks: the stages of cross_entropy_{cpu,cuda}, for callers that run the rows in
// chunks (the fused linear cross-entropy computes one chunk of logits at a time).  They skip
// cross_entropy_check; the caller checks.
//
// CPU.  Checks every target (the error names the first row out of range) and computes the mean's
// divisor D (the count of rows not ignored, or the sum of their targets' class weights).
const char* cross_entropy_count_cpu(const CrossEntropyParams& p, double* divisor);
// Rows [0, p.n): row i's loss into row_loss[i] (f64), its gradient times `scale` (the whole factor:
// grad_scale, divided by the count for a mean) into p.grad.  Targets must have been checked.
void cross_entropy_rows_cpu(const CrossEntropyParams& p, double* row_loss, float scale);
#if KCPP_WITH_CUDA
// CUDA.  *count = the mean's divisor D (f32, device memory).
const char* cross_entropy_count_cuda(const CrossEntropyParams& p, float* count, cudaStream_t stream);
// Rows [0, p.n): row i's loss into row_loss[i] (p.loss + i for reduction None), its gradient times
// p.grad_scale, divided by *count for a mean.
const char* cross_entropy_rows_cuda(const CrossEntropyParams& p, float* row_loss, const float* count, cudaStream_t stream);
// p.loss[0] = the sum of row_loss[0, p.n), divided by *count for a mean (p.n = 0: NaN for a mean, 0 for a sum).
const char* cross_entropy_reduce_cuda(const CrossEntropyParams& p, const float* row_loss, const float* count,
                                      cudaStream_t stream);
#endif

}  // namespace kcpp::liger
