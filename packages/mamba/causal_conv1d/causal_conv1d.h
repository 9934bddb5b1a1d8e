// Depthwise causal 1-D convolution (package mamba, contracts CausalConv1d/1 and CausalConv1dUpdate/1,
// docs/contracts/CausalConv1d.md), forward, backward and the one-step update; CPU and CUDA.
//
// Maths, per batch b and channel d, weight w [D, W], in f32 with one rounding to the dtype:
//   pre_l = bias_d + sum_{k<W} w_d,k x_{l-(W-1)+k}      (x_{<0} = 0)
//   out_l = silu(pre_l) or pre_l
// Backward (pre recomputed from x: nothing saved):
//   dpre_l = dout_l silu'(pre_l) (or dout_l)
//   dx_l = sum_k w_d,k dpre_{l+(W-1)-k}  (dpre_{>=L} = 0),  dw_d,k = sum_{b,l} dpre_l x_{l-(W-1)+k},
//   dbias_d = sum_{b,l} dpre_l; dw and dbias per channel in a fixed order (reproducible bit for bit).
// Update: s = [conv_state (K positions), x (S positions)], out_t = act(bias + sum_k w_k s_{K+t-(W-1)+k}),
// then conv_state = the last K positions of s (K >= W - 1).
// Layout: x, out, dout, dx are [B, D, L] with L contiguous (kcpp::mamba::Seq); weight [D, W], bias [D],
// dweight, dbias contiguous.  The update's x and out are [B, D, S] with any strides, conv_state
// [B, D, K] with K contiguous.
// Paths: CPU: (batch, channel) rows in parallel (the backward: channels in parallel, each summing its
// dw over the batch).  CUDA (causal_conv1d_cuda.cu): W <= 4; forward a thread per 4 positions of a row,
// backward a warp per channel over the batch (dw in registers, reduced in the warp), update a thread
// per (batch, channel).
#pragma once

#include <cstdint>

#include "kcpp/kernel/types.h"
#include "selective_scan/selective_scan.h"  // Seq

#if KCPP_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace kcpp::mamba {

struct CausalConv1dParams {
  kernel::DType dtype = kernel::DType::bf16;
  int64_t batch = 0, dim = 0, seqlen = 0, width = 0;
  bool silu = false;
  Seq x;
  const void* weight = nullptr;  // [D, W]
  const void* bias = nullptr;    // [D] or null
  Seq out;                       // forward
  // backward
  Seq dout, dx;
  void* dweight = nullptr;  // [D, W]
  void* dbias = nullptr;    // [D] or null (requires bias)
};

struct ConvUpdateParams {
  kernel::DType dtype = kernel::DType::bf16;
  int64_t batch = 0, dim = 0, seqlen = 0, width = 0, state_len = 0;
  bool silu = false;
  const void* x = nullptr;  // [B, D, S]
  int64_t x_sb = 0, x_sd = 0, x_sl = 0;
  void* conv_state = nullptr;  // [B, D, K], K contiguous
  int64_t state_sb = 0, state_sd = 0;
  const void* weight = nullptr;
  const void* bias = nullptr;
  void* out = nullptr;  // [B, D, S]
  int64_t out_sb = 0, out_sd = 0, out_sl = 0;
};

const char* causal_conv1d_check(const CausalConv1dParams& p, bool backward);
const char* conv_update_check(const ConvUpdateParams& p);
const char* causal_conv1d_forward_cpu(const CausalConv1dParams& p);
const char* causal_conv1d_backward_cpu(const CausalConv1dParams& p);
const char* causal_conv1d_update_cpu(const ConvUpdateParams& p);
#if KCPP_WITH_CUDA
constexpr int64_t kConvMaxWidthCuda = 4;
const char* causal_conv1d_forward_cuda(const CausalConv1dParams& p, cudaStream_t stream);
const char* causal_conv1d_backward_cuda(const CausalConv1dParams& p, cudaStream_t stream);
const char* causal_conv1d_update_cuda(const ConvUpdateParams& p, cudaStream_t stream);
#endif

}  // namespace kcpp::mamba
