// Attention without the score matrix (package flash_attn, contract Attention/1,
// docs/contracts/Attention.md): the FlashAttention-2 algorithm (Dao, "FlashAttention-2: Faster
// Attention with Better Parallelism and Work Partitioning", 2023), forward and backward, CPU and CUDA.
//
// Maths, per batch b and query head h (kv head h / (Hq / Hkv), grouped-query attention), query i at
// position pos_i = i + Skv - Sq (the queries are the last Sq positions of the keys):
//   visible(i, j) = (!causal || j <= pos_i) && (window <= 0 || pos_i - j < window)
//   s_ij  = scale * q_i . k_j                          (f32 accumulation)
//   lse_i = log sum_{j visible} exp(s_ij)              (-inf when no key is visible)
//   out_i = sum_j exp(s_ij - lse_i) v_j                 (0 when no key is visible)
// Forward streams the keys in tiles with the running maximum and sum of the online softmax
// (Milakov & Gimelshein 2018), so nothing of size Sq x Skv exists; it saves only lse (f32, [B, Hq, Sq]).
// Backward recomputes p_ij = exp(s_ij - lse_i) tile by tile:
//   delta_i = dout_i . out_i
//   dv_j = sum_i p_ij dout_i                dp_ij = dout_i . v_j
//   ds_ij = p_ij (dp_ij - delta_i)
//   dq_i = scale sum_j ds_ij k_j            dk_j = scale sum_i ds_ij q_i
// dk and dv summed over each kv head's query heads.  Everything is accumulated in f32; p and ds are
// rounded to the dtype before they meet v, dout, q and k on the tensor cores (as FlashAttention-2).
//
// Layout: every tensor is [B, H, S, D] with D contiguous and any strides for B, H and S (so the
// projections' [B, S, H, D] output needs no transpose copy); lse is contiguous [B, Hq, Sq] f32.
// Paths:
//   CPU: any dtype and D; rows in parallel (forward), kv heads in parallel (backward, so dk / dv have
//        one writer each).
//   CUDA forward, Hopper (sm_90a, attention_sm90.cu): FlashAttention-3's scheme, wgmma on tiles brought
//        in by TMA, producer / consumer warpgroups, softmax overlapped with the matrix products: bf16 /
//        f16, D in {64, 128, 256}, no sliding window, scale > 0, 16-byte aligned rows and strides, on a
//        compute capability 9.0 device of a build that includes sm_90a.  It writes the same lse, so the
//        backward below consumes it.
//   CUDA backward, Hopper (attention_sm90_bwd.cu): FlashAttention-3's backward, a block per 128 keys of a
//        kv head, dk / dv in registers, wgmma on tiles brought in by TMA, dq added in f32 into the
//        workspace: bf16 / f16, D 128, no sliding window, scale > 0, 16-byte aligned rows and strides.
//   CUDA, tensor cores (mma.sync m16n8k16, f32 accumulate): bf16 / f16, D in {64, 128}, scale > 0, 16-byte
//        aligned rows.  Forward: a block of 4 warps per 64 queries, K / V tiles of 64 keys
//        double-buffered in shared memory by cp.async.  Backward: a block per 64 keys of a kv head,
//        looping over the group's query heads and the query tiles that see them; dk, dv in
//        registers, dq added in f32 into a workspace (then scaled and rounded by a last pass).
//   CUDA, generic: everything else (f32, other D up to 256, unaligned rows): a warp per query row
//        (forward, dq) or per key row (dk, dv); correct, not fast.
// Memory: forward none beyond out and lse; backward (CUDA) attention_backward_workspace(p) bytes:
// delta [B, Hq, Sq] f32 and the dq accumulator [B, Hq, Sq, D] f32.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kcpp/kernel/types.h"

#if KCPP_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace kcpp::flash {

// A [B, H, S, D] tensor: its data and the element strides of B, H and S (D is contiguous).
struct Operand {
  const void* data = nullptr;
  int64_t sb = 0, sh = 0, ss = 0;
  template <typename T> const T* at(int64_t b, int64_t h, int64_t s) const {
    return static_cast<const T*>(data) + b * sb + h * sh + s * ss;
  }
  template <typename T> T* mut(int64_t b, int64_t h, int64_t s) const {
    return const_cast<T*>(at<T>(b, h, s));
  }
};

struct AttentionParams {
  kernel::DType dtype = kernel::DType::bf16;
  int64_t batch = 0, heads_q = 0, heads_kv = 0, seq_q = 0, seq_kv = 0, head_dim = 0;
  float scale = 0.0f;  // required (> 0 is not required: any finite value)
  bool causal = true;
  int64_t window = 0;  // > 0: a sliding window of this many keys, the query's own included
  Operand q, k, v;
  Operand out;          // forward: written; backward: read (delta)
  float* lse = nullptr; // forward: written when non-null; backward: read (required)
  // backward
  Operand dout, dq, dk, dv;
  void* workspace = nullptr;  // backward on CUDA: attention_backward_workspace(p) bytes, 256-byte aligned
};

// Checks shapes, strides and pointers; nullptr or the message naming what is wrong.
const char* attention_check(const AttentionParams& p, bool backward);
// True when the CUDA tensor-core path takes these params (else the generic CUDA path runs).
bool attention_fast_path(const AttentionParams& p);
size_t attention_backward_workspace(const AttentionParams& p);

// The CUDA forward's path for these params on the current device: "hopper", "ampere" (the mma.sync
// tensor-core kernel) or "generic", the first that can run.  The environment variable
// KCPP_FLASH_ATTN_FORWARD (hopper | ampere | generic | auto) asks for one: when that one cannot run,
// *error says why (and the call fails), so a test or benchmark knows which path it measured.
const char* attention_forward_path(const AttentionParams& p, const char** error);
// Null when the Hopper forward takes these params on the current device, else why not.
const char* attention_sm90_unsupported(const AttentionParams& p);
// The CUDA backward's path likewise: "hopper", "ampere" or "generic", the first that can run;
// KCPP_FLASH_ATTN_BACKWARD (hopper | ampere | generic | auto) asks for one, *error saying why it cannot.
const char* attention_backward_path(const AttentionParams& p, const char** error);
// Null when the Hopper backward takes these params on the current device, else why not.
const char* attention_sm90_backward_unsupported(const AttentionParams& p);

const char* attention_forward_cpu(const AttentionParams& p);
const char* attention_backward_cpu(const AttentionParams& p);
#if KCPP_WITH_CUDA
const char* attention_forward_cuda(const AttentionParams& p, cudaStream_t stream);
const char* attention_backward_cuda(const AttentionParams& p, cudaStream_t stream);
const char* attention_forward_sm90(const AttentionParams& p, cudaStream_t stream);
// delta and dq_acc: attention_backward_cuda's parts of the workspace (dq_acc zeroed, finished by it).
const char* attention_backward_sm90(const AttentionParams& p, const float* delta, float* dq_acc, cudaStream_t stream);
#endif

}  // namespace kcpp::flash
