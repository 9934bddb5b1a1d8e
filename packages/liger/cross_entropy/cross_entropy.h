// Cross-entropy with its gradient in one pass over the logits (package liger, "CrossEntropyLoss/1"),
// CPU and CUDA.  The gradient is what backward needs, so it is computed by the forward (as Liger
// does) and may be written in place over the logits: no N x V buffer beyond the logits exists.
//
// Per row i with target t_i (rows with t_i == ignore_index give loss 0 and gradient 0):
//   lse_i  = log sum_j exp(x_ij)                                   (f32, max-shifted, online)
//   loss_i = (1 - eps) (lse_i - x_it) + eps (lse_i - mean_j x_ij)  (label smoothing eps)
//   dloss_i / dx_ij = softmax_ij - (1 - eps) [j = t_i] - eps / V
// Reduction: None -> loss [N]; Sum -> sum_i loss_i; Mean -> sum_i loss_i / count, count = number of
// non-ignored rows (NaN when 0, as PyTorch), and the gradient is scaled by 1 / count.  The gradient
// is for an upstream gradient of `grad_scale` (default 1; or scale it by the real one in the backward,
// as Liger does).  An optional bias [v] is added to every row of logits first (logits_ij + b_j).
// Reductions are deterministic (fixed order, no atomics) and nothing synchronizes with the host: the
// count and the sum are computed on the device.
// Layout: logits [N, V] with a row stride, V contiguous; targets [N], i64 or i32.
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
// CPU.  Checks every target (the error names the first row out of range) and counts the rows that
// are not ignored.
const char* cross_entropy_count_cpu(const CrossEntropyParams& p, int64_t* count);
// Rows [0, p.n): row i's loss into row_loss[i] (f64), its gradient times `scale` (the whole factor:
// grad_scale, divided by the count for a mean) into p.grad.  Targets must have been checked.
void cross_entropy_rows_cpu(const CrossEntropyParams& p, double* row_loss, float scale);
#if KCPP_WITH_CUDA
// CUDA.  *count = the number of rows not ignored (f32, device memory).
const char* cross_entropy_count_cuda(const CrossEntropyParams& p, float* count, cudaStream_t stream);
// Rows [0, p.n): row i's loss into row_loss[i] (p.loss + i for reduction None), its gradient times
// p.grad_scale, divided by *count for a mean.
const char* cross_entropy_rows_cuda(const CrossEntropyParams& p, float* row_loss, const float* count, cudaStream_t stream);
// p.loss[0] = the sum of row_loss[0, p.n), divided by *count for a mean (p.n = 0: NaN for a mean, 0 for a sum).
const char* cross_entropy_reduce_cuda(const CrossEntropyParams& p, const float* row_loss, const float* count,
                                      cudaStream_t stream);
#endif

}  // namespace kcpp::liger
