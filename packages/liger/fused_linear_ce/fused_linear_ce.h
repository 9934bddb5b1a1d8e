// Fused linear cross-entropy (package liger, "ForCausalLMLoss/1"), CPU and CUDA: the loss of a language
// model's head, logits = hidden @ weight^T (+ bias), against integer targets, and the gradients of
// hidden, weight and bias, without ever holding the N x V logits.
//
// Maths (cross_entropy.h has the per-row loss and its gradient G = dloss / dlogits, [N, V]):
//   logits  = X W^T + b                    X = hidden [N, H], W = weight [V, H], b = bias [V]
//   loss    = CE(logits, targets)          mean over non-ignored rows, or sum (or per row, no gradients),
//                                          with every option of cross_entropy.h (z-loss, softcap, class and token weights)
//   dX      = G W                          [N, H]
//   dW      = G^T X                        [V, H]
//   db      = sum_i G_i                    [V]
// with G scaled by grad_scale (an upstream gradient the caller knows, e.g. 1 / accumulation steps).
//
// Schedule: the rows are taken C at a time (C = chunk_rows, or the largest count whose logits fit a
// fixed budget: 256 MiB on CUDA, 32 MiB of f32 on the CPU).  Per chunk: one GEMM writes the chunk's
// logits L [C, V]; the cross-entropy row kernel turns L into G_c in place (loss per row to a workspace
// vector); one GEMM writes dX_c = G_c W into dhidden's rows; one GEMM adds G_c^T X_c into dW; a column
// sum adds G_c into db.  So the three GEMMs of the unfused computation, plus one read and one write of
// each chunk's logits, and memory beyond the inputs, the gradients and the loss is
//   C V (logits chunk, input dtype; f32 on the CPU) + 4 N (row losses) + 4 V (db, f32)
//   + the GEMM library's workspace (32 MiB on CUDA; on the CPU, f32 copies of C and 512 rows of width H)
// and with accum_f32 also 4 V H (an f32 dW accumulator).  The count of non-ignored rows (for the
// mean) is computed on the device first, so the gradients are final when the forward returns and
// nothing synchronizes with the host (CUDA).
//
// Precision.  GEMMs accumulate in f32 (cuBLAS with CUBLAS_COMPUTE_32F, no TF32; OpenBLAS sgemm on f32
// copies).  Logits are stored in the input dtype (on the CPU in f32), as eager does.  dW accumulates
// across chunks in its own dtype (one rounding per chunk, as Liger's default), or in f32 with
// accum_f32 (one rounding in all).
//
// Layout: hidden rows hidden_stride apart (H contiguous); weight [V, H] rows weight_stride apart;
// dhidden rows dhidden_stride apart; dweight [V, H] contiguous (stride H); bias, dbias [V] contiguous;
// targets [N] i64 or i32.  hidden, weight, bias, dhidden, dweight and dbias share one dtype.
// Bad targets: as cross_entropy.h (CPU: an error naming the row; CUDA: NaN loss and gradients, the
// row counted in bad_targets).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cross_entropy/cross_entropy.h"
#include "kcpp/kernel/types.h"

#if KCPP_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace kcpp::liger {

struct FusedLinearCEParams {
  kernel::DType dtype = kernel::DType::bf16;
  int64_t n = 0, h = 0, v = 0;
  const void* hidden = nullptr;  // [n, h]
  int64_t hidden_stride = 0;
  const void* weight = nullptr;  // [v, h]
  int64_t weight_stride = 0;
  const void* bias = nullptr;    // optional [v]
  const void* targets = nullptr; // [n]
  bool targets_i32 = false;      // else i64
  int64_t ignore_index = -100;
  float label_smoothing = 0.0f;
  float lse_square_scale = 0.0f;        // z-loss (cross_entropy.h)
  float softcap = 0.0f;                 // 0 = off
  const float* class_weight = nullptr;  // optional [v] f32
  const float* token_weight = nullptr;  // optional [n] f32
  CEReduction reduction = CEReduction::Mean;  // None: loss per row, and no gradients
  float grad_scale = 1.0f;
  float* loss = nullptr;         // [1] (Mean, Sum) or [n] (None), f32
  float* lse = nullptr;          // optional [n]: log-sum-exp of each row's logits (0 for ignored rows)
  void* dhidden = nullptr;       // [n, h]; with dhidden, dweight and dbias all null: no gradients (the loss only)
  int64_t dhidden_stride = 0;
  void* dweight = nullptr;       // [v, h] contiguous, or null (weight frozen)
  void* dbias = nullptr;         // [v], or null
  bool accumulate = false;       // add into dweight / dbias (gradient accumulation) instead of overwriting
  bool accum_f32 = false;        // accumulate dweight over the chunks in f32 (4 v h bytes more workspace)
  int64_t chunk_rows = 0;        // rows per chunk; 0 picks from the budget above
  void* workspace = nullptr;     // fused_linear_ce_workspace() bytes, 256-byte aligned
  int32_t* bad_targets = nullptr;  // optional device counter (CUDA)
};

// Whether the call computes gradients (any of dhidden, dweight, dbias given; dhidden is then required
// unless n = 0).
inline bool fused_linear_ce_grads(const FusedLinearCEParams& p) { return p.dhidden || p.dweight || p.dbias; }
// The cross-entropy of the whole call (every row) with this call's loss options: what both paths run
// chunk by chunk, each chunk overriding n, logits, targets, loss, lse and token_weight.
inline CrossEntropyParams fused_linear_ce_loss_params(const FusedLinearCEParams& p) {
  CrossEntropyParams ce;
  ce.dtype = p.dtype;
  ce.n = p.n, ce.v = p.v;
  ce.targets = p.targets, ce.targets_i32 = p.targets_i32;
  ce.ignore_index = p.ignore_index;
  ce.label_smoothing = p.label_smoothing;
  ce.reduction = p.reduction;
  ce.lse_square_scale = p.lse_square_scale, ce.softcap = p.softcap;
  ce.class_weight = p.class_weight, ce.token_weight = p.token_weight;
  ce.grad_scale = p.grad_scale;
  ce.bias = p.bias;
  ce.bad_targets = p.bad_targets;
  ce.loss = p.loss;
  return ce;
}

// Checks the params; nullptr or the message.
const char* fused_linear_ce_check(const FusedLinearCEParams& p);
// The rows per chunk that the call will use (on CUDA when `cuda`).
int64_t fused_linear_ce_chunk_rows(const FusedLinearCEParams& p, bool cuda);
// Workspace bytes the call needs (on CUDA when `cuda`).
size_t fused_linear_ce_workspace(const FusedLinearCEParams& p, bool cuda);

const char* fused_linear_ce_cpu(const FusedLinearCEParams& p);
#if KCPP_WITH_CUDA
const char* fused_linear_ce_cuda(const FusedLinearCEParams& p, cudaStream_t stream);
#endif

// Backward: the forward already wrote the gradients for an upstream gradient of grad_scale; this
// multiplies dhidden, dweight and dbias by `scale` (a host number) or *dloss (one f32 on the device,
// read by the kernel).  Not for gradients accumulated over calls (pass grad_scale to the forward).
struct FusedLinearCEScaleParams {
  kernel::DType dtype = kernel::DType::bf16;
  int64_t n = 0, h = 0, v = 0;
  void* dhidden = nullptr;
  int64_t dhidden_stride = 0;
  void* dweight = nullptr;  // optional
  void* dbias = nullptr;    // optional
  float scale = 1.0f;
  const float* dloss = nullptr;  // [1], overrides scale
};
const char* fused_linear_ce_scale_cpu(const FusedLinearCEScaleParams& p);
#if KCPP_WITH_CUDA
const char* fused_linear_ce_scale_cuda(const FusedLinearCEScaleParams& p, cudaStream_t stream);
#endif

}  // namespace kcpp::liger
