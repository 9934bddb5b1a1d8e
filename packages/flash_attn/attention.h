// Attention without the score matrix (package flash_attn, contract Attention/1,
// docs/contracts/Attention.md): the FlashAttention-2 algorithm (Dao, "FlashAttention-2: Faster
// Attention with Better Parallelism and Work Partitioning", 2023), forward and backward, CPU and CUDA.
//
// Maths, per batch b and query head h (kv head h / (Hq / Hkv), grouped-query attention), query i at
// position pos_i = i + Skv - Sq (the queries are the last Sq positions of the keys):
//   visible(i, j) = (!causal || j <= pos_i) && (window <= 0 || pos_i - j < window)
//   t_ij  = scale * q_i . k_j                          (f32 accumulation)
//   s_ij  = c tanh(t_ij / c) with softcap c > 0 (Gemma 2's logit soft-capping), else t_ij
//   lse_i = log sum_{j visible} exp(s_ij)              (-inf when no key is visible)
//   out_i = sum_j exp(s_ij - lse_i) v_j                 (0 when no key is visible)
// Forward streams the keys in tiles with the running maximum and sum of the online softmax
// (Milakov & Gimelshein 2018), so nothing of size Sq x Skv exists; it saves only lse (f32, [B, Hq, Sq]).
// Backward recomputes p_ij = exp(s_ij - lse_i) tile by tile:
//   delta_i = dout_i . out_i
//   dv_j = sum_i p_ij dout_i                dp_ij = dout_i . v_j
//   ds_ij = p_ij (dp_ij - delta_i) (1 - (s_ij / c)^2)    (the last factor, ds / dt, only with softcap)
//   dq_i = scale sum_j ds_ij k_j            dk_j = scale sum_i ds_ij q_i
// dk and dv summed over each kv head's query heads.  Everything is accumulated in f32; p and ds are
// rounded to the dtype before they meet v, dout, q and k on the tensor cores (as FlashAttention-2).
// Soft-capping on the tensor-core paths (softcap.cuh) takes tanh as 1 - 2 / (2^(2 log2(e) x) + 1) from
// the special function unit's 2^x and reciprocal (kernel::tanh_approx: an absolute error about 2^-21,
// so the capped score's error is c 2^-21, against c 2^-11 for tanh.approx.f32); the generic CUDA and
// CPU paths take tanh in their accumulation type.  The backward recomputes tanh from the scores, so it needs no extra
// saved state: lse is still the only one.
//
// Layout: every tensor is [B, H, S, D] with D contiguous and any strides for B, H and S (so the
// projections' [B, S, H, D] output needs no transpose copy); lse is contiguous [B, Hq, Sq] f32.
// Paths:
//   CPU: any dtype and D; rows in parallel (forward), kv heads in parallel (backward, so dk / dv have
//        one writer each).
//   CUDA forward, Hopper (sm_90a, attention_sm90.cu): FlashAttention-3's scheme, wgmma on tiles brought
//        in by TMA, producer / consumer warpgroups, softmax overlapped with the matrix products: bf16 /
//        f16, D in {64, 128, 256}, causal or not, sliding windows, soft-capping, scale > 0, 16-byte aligned
//        rows and strides, on a compute capability 9.0 device of a build that includes sm_90a.  It writes the same lse, so the
//        backward below consumes it.
//   CUDA backward, Hopper (attention_sm90_bwd.cu): FlashAttention-3's backward, a block per 128 keys of a
//        kv head, dk / dv in registers, wgmma on tiles brought in by TMA, dq added in f32 into the
//        workspace: bf16 / f16, D in {64, 128}, sliding windows, soft-capping, scale > 0, 16-byte aligned
//        rows and strides.
//   CUDA, tensor cores (mma.sync m16n8k16, f32 accumulate): bf16 / f16, D in {64, 128}, scale > 0, 16-byte
//        aligned rows.  Forward: a block of 4 warps per 64 queries, K / V tiles of 64 keys
//        double-buffered in shared memory by cp.async.  Backward: a block per 64 keys of a kv head,
//        looping over the group's query heads and the query tiles that see them; dk, dv in
//        registers, dq added in f32 into a workspace (then scaled and rounded by a last pass).
//   CUDA, generic: everything else (f32, other D up to 256, unaligned rows): a warp per query row
//        (forward, dq) or per key row (dk, dv); correct, not fast.
//   Every path takes every mask and soft-capping.
// Memory: forward none beyond out and lse; backward (CUDA) attention_backward_workspace(p) bytes:
// delta [B, Hq, Sq] f32 and the dq accumulator [B, Hq, Sq, D] f32 (varlen: [Hq, total_q] and
// [Hq, total_q, D]).
//
// Variable-length packed sequences (varlen, cu_seqlens_q / cu_seqlens_k non-null): B sequences packed
// end to end, q / out / dout / dq [total_q, Hq, D] and k / v / dk / dv [total_k, Hkv, D] (any token and
// head strides), sequence b owning tokens [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and
// [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k (int32 prefix sums, cu[0] = 0, cu[B] = total).  Each
// sequence is an attention of its own with Sq = its query count and Skv = its key count, in the maths
// above (so causal aligns its queries to the end of its own keys; a sequence may have more queries than
// keys, its first queries then seeing no key under causal).  lse is [Hq, total_q] f32 contiguous.
// Operands then carry sb = 0 and ss = the token stride: every kernel addresses token `begin + i` of
// sequence b as at(b, h, begin + i), the same code as the batched layout (sequence() and lse_row()
// below give the begin, the lengths and the lse / workspace row for both layouts).  batch, seq_q and
// seq_kv hold B, max_seqlen_q and max_seqlen_k (each at most its token count): the grids cover
// max_seqlen positions per sequence and the positions past a sequence's own length do nothing.  The CPU
// checks the cu_seqlens (attention_check_varlen: named errors) before it uses them; CUDA reads them only
// on the device (the host never waits for them), so there a bad cu_seqlens is not reported: every entry
// is clamped into [0, total] and each length to max_seqlen, which keeps every access inside the tensors
// but leaves the result unspecified.  Every path takes varlen, the Hopper ones within their limits
// above (the backward at head dims 64 and 128).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kcpp/kernel/types.h"

#if KCPP_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace kcpp::flash {

// Helpers that run on the host and in kernels.
#if defined(__CUDACC__)
#define KCPP_FLASH_HD __host__ __device__ __forceinline__
#else
#define KCPP_FLASH_HD inline
#endif

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
  float softcap = 0.0f;  // c > 0: logit soft-capping, s = c tanh(scale q.k / c); 0: none
  Operand q, k, v;
  Operand out;          // forward: written; backward: read (delta)
  float* lse = nullptr; // forward: written when non-null; backward: read (required)
  // backward
  Operand dout, dq, dk, dv;
  void* workspace = nullptr;  // backward on CUDA: attention_backward_workspace(p) bytes, 256-byte aligned
  // varlen (both or neither): int32 [batch + 1] on the tensors' device; total_q / total_kv tokens.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int64_t total_q = 0, total_kv = 0;
  KCPP_FLASH_HD bool varlen() const { return cu_seqlens_q != nullptr; }
};

// Sequence b: its first query and key token (0 in the batched layout) and its lengths.
struct Sequence {
  int64_t q_begin, k_begin, seq_q, seq_kv;
};
// Reads cu_seqlens where they live (host memory on the CPU path, device memory in a kernel), each entry
// clamped into [0, total] and each length to max_seqlen (a no-op on checked input; it keeps every access
// inside the tensors).
KCPP_FLASH_HD int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }
KCPP_FLASH_HD Sequence sequence(const AttentionParams& p, int64_t b) {
  if (!p.varlen()) return {0, 0, p.seq_q, p.seq_kv};
  const int64_t q0 = clamp64(p.cu_seqlens_q[b], 0, p.total_q), k0 = clamp64(p.cu_seqlens_k[b], 0, p.total_kv);
  const int64_t q1 = clamp64(p.cu_seqlens_q[b + 1], q0, p.total_q), k1 = clamp64(p.cu_seqlens_k[b + 1], k0, p.total_kv);
  return {q0, k0, clamp64(q1 - q0, 0, p.seq_q), clamp64(k1 - k0, 0, p.seq_kv)};
}
// The index of query token s (sequence begin included) of batch b and head h in lse, delta and the dq
// accumulator: (b Hq + h) Sq + s batched, h total_q + s varlen.  A head's tokens are consecutive rows.
KCPP_FLASH_HD int64_t lse_row(const AttentionParams& p, int64_t b, int64_t h, int64_t s) {
  return p.varlen() ? h * p.total_q + s : (b * p.heads_q + h) * p.seq_q + s;
}
// The number of such rows.
KCPP_FLASH_HD int64_t lse_rows(const AttentionParams& p) {
  return p.varlen() ? p.heads_q * p.total_q : p.batch * p.heads_q * p.seq_q;
}
// Row `row` of lse_row's numbering back to (b, h, s); b is 0 for varlen (its operands ignore b: sb = 0).
// I: the index type, int64_t, or uint32_t where every row number fits it (cheaper divisions on a GPU).
template <typename I> KCPP_FLASH_HD void lse_row_index(const AttentionParams& p, I row, I& b, I& h, I& s) {
  const auto per_head = static_cast<I>(p.varlen() ? p.total_q : p.seq_q), hq = static_cast<I>(p.heads_q);
  s = row % per_head, h = row / per_head % hq, b = p.varlen() ? 0 : row / (per_head * hq);  // per_head * hq <= the rows
}

// Checks shapes, strides and pointers; nullptr or the message naming what is wrong.
const char* attention_check(const AttentionParams& p, bool backward);
// varlen on host memory (the CPU path): cu_seqlens start at 0, do not decrease, end at the totals, and
// no sequence is longer than max_seqlen (seq_q / seq_kv); nullptr or the message.  A no-op otherwise.
const char* attention_check_varlen(const AttentionParams& p);
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
// The same at head dim 256 (attention_sm90_bwd256.cu), which attention_backward_sm90 calls.
const char* attention_backward_sm90_d256(const AttentionParams& p, const float* delta, float* dq_acc, cudaStream_t stream);
#endif

}  // namespace kcpp::flash
