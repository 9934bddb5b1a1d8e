// Rotary position embedding (package liger, layer contract "rotary_pos_emb/1"), q and k in one call,
// forward and backward, CPU and CUDA, in place or out of place.
//
// Per token (b, s), per head, per pair (p, q) of the first rd (rotary_dim) elements of head_dim:
//   RotateHalf (Llama, NeoX): p = j, q = j + rd/2;   Interleaved (GPT-J, DeepSeek): p = 2j, q = 2j + 1
//   forward:   y_p = x_p c_p - x_q s_p        backward (the transpose):  dx_p = dy_p c_p + dy_q s_q
//              y_q = x_q c_q + x_p s_q                                    dx_q = dy_q c_q - dy_p s_p
// with c = cos[b', s, :], s = sin[b', s, :] (b' = b, or 0 when cos/sin are shared by the batch); the
// elements rd..head_dim-1 pass through unchanged.  This is exactly HF's `x * cos + rotate_half(x) *
// sin` when cos/sin hold each angle twice the way HF builds them (cat(freqs, freqs) for RotateHalf,
// repeat_interleave for Interleaved); position_ids are honoured by the caller's cos/sin rows.
// f32 inside, one rounding to the dtype.  Nothing is saved.
//
// Layout: any strides for (batch, seq, head) of q, k and outputs, the head_dim contiguous, so both
// [B, S, H, D] and HF's [B, H, S, D] work without a transpose copy.  out == in (same strides) is the
// in-place form; k may be absent (k_heads = 0).  Cost: reads and writes q and k once (cos/sin rows are
// small and come from cache).
#pragma once

#include <cstdint>

#include "kcpp/kernel/types.h"

#if KCPP_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace kcpp::liger {

enum class RopeLayout : int32_t { RotateHalf = 0, Interleaved = 1 };

// One of q, k: input and output with their (batch, seq, head) strides in elements.
struct RopeOperand {
  int64_t heads = 0;
  const void* in = nullptr;
  int64_t in_stride_b = 0, in_stride_s = 0, in_stride_h = 0;
  void* out = nullptr;
  int64_t out_stride_b = 0, out_stride_s = 0, out_stride_h = 0;
};

struct RopeParams {
  kernel::DType dtype = kernel::DType::bf16;  // of q, k, cos, sin and the outputs
  RopeLayout layout = RopeLayout::RotateHalf;
  int64_t batch = 0, seq = 0, head_dim = 0, rotary_dim = 0;
  RopeOperand q, k;
  const void* cos = nullptr;  // [cos_batch, seq, rotary_dim], rows cs_stride_s apart
  const void* sin = nullptr;
  int64_t cs_stride_b = 0;    // 0: one table for the whole batch
  int64_t cs_stride_s = 0;
};

const char* rope_check(const RopeParams& p);
const char* rope_forward_cpu(const RopeParams& p);
const char* rope_backward_cpu(const RopeParams& p);
#if KCPP_WITH_CUDA
const char* rope_forward_cuda(const RopeParams& p, cudaStream_t stream);
const char* rope_backward_cuda(const RopeParams& p, cudaStream_t stream);
#endif

}  // namespace kcpp::liger
