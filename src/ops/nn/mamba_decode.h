// A Mamba / Falcon-Mamba mixer's decoding step (one new token per row) in four launches, for the
// CUDA graph of MambaLM::generate.  The slots' step is some fifteen launches a layer (the norm, the
// projections, transposes, the two slots, casts and the residual add); these ops are its
// composition with the same roundings to the dtype T (r below), computed in f32:
//
//   1. mamba_norm_in_proj: the residual add, the norm, in_proj, and the convolution at the new
//      position (CausalConv1dUpdate/1) in the projection's epilogue, column by column:
//        s = x + delta                    (x f32 with residual_in_fp32: unrounded; else r(x + delta))
//        xz = r(r(rms_norm(r(s)) W_in^T) + b_in)          [M, 2D]: x, then z   (b_in: r(.) only without)
//        xc_c = r(silu(b_c + sum_{j<W-1} w_c,j state_c,K-(W-1)+j + w_c,W-1 xz_c)),  c < D
//      and state_c becomes its last K - 1 entries, then xz_c (the state is [M, D, K], K = W - 1 ..
//      4, oldest first).  The column's warp owns channel c, so reading and advancing it in one
//      kernel races with nothing.
//   2. xdbl = r(xc W_x^T) [M, R + 2N] (dt_low, B, C): ops::matmul, the few-row gemv.
//   3. mamba_ssm_step: dt_proj, SelectiveStateUpdate/1 and the gate:
//        dt_low' = r(rms(dt_low))   (Falcon-Mamba, dt_rms_eps: its weightless norm; else dt_low)
//        dt_c = r(dt_low' . W_dt[c]);  dt = softplus(dt_c + dt_bias_c) (softplus when dt_softplus)
//        h_n = exp(dt A_c,n) h_n + dt B_n xc_c        (Falcon-Mamba, bc_rms_eps: B and C
//        y_c = r((sum_n C_n h_n + D_c xc_c) silu(z_c))  RMS-normalised in f32 first)
//      with h the row's SSM state [M, D, N] f32, updated in place.
//   4. out_proj, ops::matmul; its output is the next layer's delta.
//
// M <= kFusedLinearMaxRows (decode_fused.h) rows; bf16 / f16 on CUDA; H (the norm's width) a
// multiple of 8 with 16-byte aligned rows (the gemv's loads).  mamba_decode_fused() says whether a
// model's step can take these ops; elsewhere the model runs its slots, and the ops name where they
// run.
#pragma once

#include <optional>

#include "core/tensor.h"
#include "ops/nn/rms_norm.h"

namespace kcpp::ops {

// The most bytes of in_proj's input rows (16-bit, every row) mamba_norm_in_proj keeps in a block's
// shared memory: 2 M H bytes must fit (well under what an SM gives a block, so that blocks share one).
constexpr int64_t kMambaRowsBytes = 96 * 1024;
// The most bytes of dt_low, B and C (f32, every row) mamba_ssm_step stages in a block's shared memory
// (48 KiB less the kernel's own): 4 M (R + 2N) bytes must fit.
constexpr int64_t kMambaStageBytes = 48 * 1024 - 256;

// A model's step, as the ops see it.
struct MambaDecodeShape {
  int64_t rows = 0, hidden = 0, rank = 0, states = 0, conv_width = 0;
};

// Whether a model's step of `shape` in `dtype` on `device` can take the ops (their limits above; the
// alignment of its tensors the ops check).  The default (faster than the slots' step as a CUDA graph
// at batch 1 on both families, level at Falcon-Mamba-7B's batch 4: bench/RESULTS.md);
// KCPP_MAMBA_DECODE_FUSED=0 or KCPP_DECODE_FUSED=0: never.
bool mamba_decode_fused(Device device, DType dtype, const MambaDecodeShape& shape);

struct MambaNormInProj {
  Tensor s;   // [M, H], the residual stream (x's dtype)
  Tensor xz;  // [M, 2D]
  Tensor xc;  // [M, D]
};

// x [M, H] (f32, or the weights' dtype), delta [M, H] in the weights' dtype or undefined (s = x),
// norm_weight [H], w_in [2D, H], b_in [2D] or undefined, conv_state [M, D, K] (advanced in place),
// conv_w [D, W] (W - 1 <= K <= 4), conv_b [D] or undefined; every tensor but x of one 16-bit dtype.
MambaNormInProj mamba_norm_in_proj(const Tensor& x, const Tensor& delta, const Tensor& norm_weight, const RMSNormOptions& opt,
                                   const Tensor& w_in, const Tensor& b_in, const Tensor& conv_state, const Tensor& conv_w,
                                   const Tensor& conv_b);

struct MambaSsmStep {
  Tensor xz;          // [M, 2D], step 1's: its second half is the gate z
  Tensor xc;          // [M, D], step 1's
  Tensor xdbl;        // [M, R + 2N], step 2's
  Tensor w_dt;        // [D, R]
  Tensor dt_bias;     // [D] f32, or undefined
  Tensor A;           // [D, N] f32 (-exp(A_log))
  Tensor D;           // [D] f32, or undefined
  Tensor ssm_state;   // [M, D, N] f32, updated in place
  bool dt_softplus = true;
  std::optional<double> dt_rms_eps, bc_rms_eps;  // Falcon-Mamba's norms of dt_low and of B, C
};

// Returns y [M, D] (the 16-bit dtype of xz).
Tensor mamba_ssm_step(const MambaSsmStep& step);

}  // namespace kcpp::ops
