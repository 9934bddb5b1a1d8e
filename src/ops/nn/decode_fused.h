// Fused steps of a decoding layer (one new token per row): each op is the composition of reference
// ops it replaces, with the same roundings to the dtype, in one pass over its data.  A decode step is
// dozens of small launches per layer; these cut each layer's non-GEMM work to three launches.
//
// qk_norm_rope_cache — the attention input of a decode step, from the fused projection's output
// qkv [B, Hq + 2 Hkv, D] (heads q, then k, then v, D elements each):
//   q_h = rope(norm_q(qkv[b, h])),              h < Hq           (norm only with a q_norm weight)
//   k_h = rope(norm_k(qkv[b, Hq + h])),         h < Hkv
//   v_h = qkv[b, Hq + Hkv + h]
//   k_cache[rows[b], h, positions[b]] = k_h,  v_cache[rows[b], h, positions[b]] = v_h
//   returns q [B, Hq, D]
// norm: RMSNorm over the head's D elements (ops/nn/rms_norm.h, casting Llama or Gemma);
// rope: ops::rope_forward with cos / sin [B, 1, rd] (ops/nn/rope.h), the eager roundings
//   y = r(r(x cos) + r(rot(x) sin)) on the rotary part, the rest as is (r: rounding to the dtype).
//
// qk_norm_rope_attention — qk_norm_rope_cache, then the attention of its q over the caches
// (ops/nn/decode_attention.h), lengths [B] i32 the keys of each row (the new one included):
//   o = decode_attention(qk_norm_rope_cache(qkv, ...), k_cache, v_cache, rows, lengths, scale, window, max_length)
// On CUDA, where decode_attention runs one block a head group (short rows, or rows few enough for a
// single split of the keys) and that block holds the group's Hq / Hkv query heads (at most 8), one
// kernel: the block makes its q, key and value as qk_norm_rope_cache does (the same bits in bf16 and
// f16; in f32 the norm's sum of squares adds in another order), writes the key and value to the cache
// and attends, the new key taken from shared memory (ops/cuda/decode_attention.cu).  Elsewhere the
// two ops.  Rows must name distinct cache rows (as a decode batch's do): a block reads its row's
// keys while the others write theirs.
//
// add_rms_norm — the residual add and the next norm: s = r(x + delta), y = rms_norm(s, w); returns
// (s, y).  x, delta [N, H].  On CUDA one kernel, a programmatic dependent of the kernel before that
// reads w before it waits: w must not be that kernel's output (weights never are; a strided w takes
// the composition, since the copy that would make it contiguous would be).
//
// glu_packed — the gated activation of a fused gate/up projection gu [N, 2I] (gate columns first):
//   h[n, i] = r(r(act(gu[n, i])) * gu[n, I + i])   (ops::glu_forward of the two halves)
//
// add_rms_norm_linear — the residual add, the next norm and the projection that reads it, for a few
// rows (a decode step's [N, H] with N <= 4): x, delta [N, K], norm weight w [K], projection W [O, K]:
//   s = r(x + delta)                     (s = x without delta: a step's first layer)
//   a = rms_norm(s, w)                   (as add_rms_norm: rounded to the dtype)
//   out[n, o] = r(sum_k a[n, k] W[o, k])  (f32 sums, as ops::matmul(a, W, false, true))
//   returns (s, out [N, O])
// With an f32 residual x beside bf16 / f16 delta and weights (Mamba's residual_in_fp32): s = x +
// delta in f32, unrounded, and a = rms_norm(r(s), w); out in the weights' dtype.
//
// add_rms_norm_linear_glu — add_rms_norm_linear into a packed gate/up projection W [2I, K], then its
// gated activation: (s, glu_packed(out, act)), out [N, 2I] as add_rms_norm_linear makes it:
//   h[n, i] = r(r(act(out[n, i])) * out[n, I + i]),  returns (s, h [N, I])
// so that the down projection reads h with no activation of its own to make (a decode step's MLP).
//
// linear_glu — a packed gate/up projection and its gated activation (a prefill's MLP up to the down
// projection): x [N, K], W [2I, K] (gate rows, then up rows):
//   gu = r(x W^T)  (f32 sums),  h[n, i] = r(r(act(gu[n, i])) * gu[n, I + i])   (glu_packed(matmul(x, W^T)))
// On CUDA devices of compute capability 9.0 (bf16 / f16, a build with sm_90a code, K and I multiples
// of 8, x's rows and W contiguous along K and 16-byte aligned) one kernel: kernel/grouped_gemm_sm90.cuh's
// persistent TMA / wgmma GEMM as one group, the activation in its epilogue on the accumulators (gu is
// never written; the activation in the hardware exp and division, kernel/activation.h's Fast mode,
// before it is rounded).  Elsewhere, and under KCPP_LINEAR_GLU=0, the composition
// glu_packed(matmul(x, W^T)).  Path Auto takes the kernel only where its 128 x 128 tiles of h fill
// at least 80% of the multiprocessors' last wave (fused_gemm_fills_waves): measured on an H200
// (bench/RESULTS.md), it was ahead of cuBLAS + glu_packed at every such shape and behind at the
// others (Qwen3-0.6B's 1,024 rows: 192 tiles on 132 multiprocessors); Kernel takes it wherever it
// can run.
//
// linear_qk_norm_rope_cache — the attention's fused q / k / v projection and qk_norm_rope_cache of its
// output (a prefill's attention input): x [N, K], W [(Hq + 2 Hkv) D, K]:
//   qk_norm_rope_cache(r(x W^T) as [N, Hq + 2 Hkv, D], opt, cos, sin, k_cache, v_cache, rows, positions)
// On CUDA devices of compute capability 9.0 (bf16 / f16, a build with sm_90a code, D 64 or 128,
// rotate-half RoPE over the whole head, norms of Llama or Gemma casting, every tensor contiguous but
// x's row stride, 16-byte aligned) path Kernel runs one kernel: kernel/grouped_gemm_sm90.cuh's GEMM
// with the norms, RoPE and the cache write in its epilogue (qkv is never written).  Path Auto takes
// the composition: on an H200 the kernel measured 0.046 ms against cuBLAS + qk_norm_rope_cache's
// 0.041 at Qwen3-0.6B's 2,048 rows (its epilogue runs on two consumer warpgroups with nothing to hide
// its latency; bench/RESULTS.md); KCPP_LINEAR_QK=1 makes Auto take it where its 128 x 256 tiles fill
// the waves (prefill_layers calls this op).  The norm's sum of squares adds in another order than
// qk_norm_rope_cache's, and the product's sums in another than cuBLAS's: the values agree to the
// dtype's rounding, not bit for bit.  Elsewhere, and under KCPP_LINEAR_QK=0, the composition.
//
// glu_linear — the gated activation of a packed gate/up row and the projection that reads it:
// gu [N, 2I], W [O, I]:
//   h = glu_packed(gu, act)  (rounded to the dtype),  out[n, o] = r(sum_i h[n, i] W[o, i])
//
// On CUDA (bf16, f16; N <= kFusedLinearMaxRows; K % 8 == 0 and 16-byte aligned rows) each is one
// kernel: every block recomputes the norm or the activation of the rows (a few K elements) into
// shared memory and streams its share of W, as ops/cuda/gemv.cu does; one block writes s.
// add_rms_norm_linear_glu's warps take a gate row, then its up row, and apply the activation to the
// two sums: no block recomputes an activation row, which glu_linear's blocks each do (K of them).  There
// the kernels are launched with programmatic dependent launch (ops/cuda/pdl.cuh), so that the
// weights (W, and the norm's weight) are read while the previous kernel ends: neither may be that
// kernel's output (a model's weights never are).  Elsewhere (f32, more rows, a CPU tensor, odd
// widths, an empty product) the composition add_rms_norm + ops::matmul (add_rms_norm_linear_glu:
// add_rms_norm_linear + glu_packed), glu_packed + ops::matmul.
//
// On CUDA (f32, bf16, f16) each of the three ops above is one kernel; elsewhere, and for what the kernels don't cover, the
// composition of the reference ops.  Rows and positions on the device are not read back by the host:
// an out-of-range one skips the cache write (decode_attention then reports NaN for that row), as
// ops::cache_write does.
#pragma once

#include <utility>

#include "core/tensor.h"
#include "ops/nn/glu.h"
#include "ops/nn/rms_norm.h"
#include "ops/nn/rope.h"

namespace kcpp::ops {

struct QkNormRopeCache {
  int64_t q_heads = 0, kv_heads = 0;
  Tensor q_norm, k_norm;      // [D] each, or both undefined (no per-head norm)
  RMSNormOptions norm;        // their options (casting Llama or Gemma)
  RopeLayout layout = RopeLayout::RotateHalf;
  // qk_norm_rope_attention's one kernel reads rows, positions, lengths, cos / sin and the caches' keys
  // at other positions before its programmatic-dependent-launch wait where the caller says that none
  // of them is the output of the kernel just before the op (a decode step's are written at its
  // start, its layers' attention follows the qkv projection): the first keys' loads then overlap
  // the end of that kernel.  Otherwise (the default) they are read after the wait.
  bool settled = false;
};

// qkv [B, Hq + 2 Hkv, D] contiguous; cos, sin [B, 1, rd] in qkv's dtype; caches [R, Hkv, C, D];
// rows, positions [B] i32 on qkv's device.  Returns q [B, Hq, D].
Tensor qk_norm_rope_cache(const Tensor& qkv, const QkNormRopeCache& opt, const Tensor& cos, const Tensor& sin,
                          const Tensor& k_cache, const Tensor& v_cache, const Tensor& rows, const Tensor& positions);

// qk_norm_rope_cache's arguments, then decode_attention's (lengths, scale, window, max_length).
// Returns o [B, Hq, D].
Tensor qk_norm_rope_attention(const Tensor& qkv, const QkNormRopeCache& opt, const Tensor& cos, const Tensor& sin,
                              const Tensor& k_cache, const Tensor& v_cache, const Tensor& rows, const Tensor& positions,
                              const Tensor& lengths, double scale, int64_t window = 0, int64_t max_length = 0);

// How many calls of qk_norm_rope_attention in this process ran it as the one kernel (a CUDA graph's
// replays not counted): the tests' way to see which path a case took.
int64_t qk_norm_rope_attention_fused_runs();

// x, delta [N, H] of one dtype, w [H].  Returns (x + delta, rms_norm(x + delta, w)).
std::pair<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& delta, const Tensor& w, const RMSNormOptions& opt);

// gu [N, 2I] contiguous.  Returns [N, I].
Tensor glu_packed(const Tensor& gu, GluActivation act);

// The most rows the fused CUDA projections below take in one kernel.
constexpr int64_t kFusedLinearMaxRows = 4;

// x, delta [N, K] of one dtype (delta may be undefined: s = x), norm weight [K], weight [O, K]; or x
// f32 with the rest bf16 / f16.  Returns (s, out [N, O]).
std::pair<Tensor, Tensor> add_rms_norm_linear(const Tensor& x, const Tensor& delta, const Tensor& norm_weight,
                                              const RMSNormOptions& opt, const Tensor& weight);

// As add_rms_norm_linear with weight [2I, K] (gate rows, then up rows).  Returns (s, h [N, I]).
std::pair<Tensor, Tensor> add_rms_norm_linear_glu(const Tensor& x, const Tensor& delta, const Tensor& norm_weight,
                                                  const RMSNormOptions& opt, const Tensor& weight, GluActivation act);

// The products with a fused epilogue (linear_glu, linear_qk_norm_rope_cache): Auto takes the one
// kernel where it measured faster (linear_glu: where it runs and its tiles fill the GPU's waves,
// fused_gemm_fills_waves; linear_qk_norm_rope_cache: nowhere yet), Kernel wherever it runs,
// Composition never.
enum class FusedGemmPath { Auto, Kernel, Composition };
enum class FusedGemm { LinearGlu, LinearQkNormRopeCache };

// x [N, K], weight [2I, K] of one dtype.  Returns h [N, I].
Tensor linear_glu(const Tensor& x, const Tensor& weight, GluActivation act, FusedGemmPath path = FusedGemmPath::Auto);

// x [N, K], weight [(Hq + 2 Hkv) D, K] of one dtype (D from the weight's rows); the rest as
// qk_norm_rope_cache takes them for qkv [N, Hq + 2 Hkv, D].  Returns q [N, Hq, D].
Tensor linear_qk_norm_rope_cache(const Tensor& x, const Tensor& weight, const QkNormRopeCache& opt, const Tensor& cos,
                                 const Tensor& sin, const Tensor& k_cache, const Tensor& v_cache, const Tensor& rows,
                                 const Tensor& positions, FusedGemmPath path = FusedGemmPath::Auto);

// Whether a product's output tiles of 128 rows x tile_cols columns, ceil(rows / 128) x ceil(cols /
// tile_cols) of them, fill at least 80% of the last of the waves that `sms` multiprocessors run them
// in (path Auto's rule; linear_glu's tiles are 128 columns of h, linear_qk_norm_rope_cache's 256).
bool fused_gemm_fills_waves(int64_t rows, int64_t cols, int64_t tile_cols, int64_t sms);

// How many calls of `which` in this process ran as the one kernel: the tests' way to see the path.
int64_t fused_gemm_runs(FusedGemm which);

// Null when the one kernel of `which` can run on `device` (given the shapes and alignment), else why
// not: not a CUDA device, its switch off (KCPP_LINEAR_GLU=0, KCPP_LINEAR_QK=0), a build without
// sm_90a code, compute capability other than 9.0.
const char* fused_gemm_unavailable(Device device, FusedGemm which);

// gu [N, 2I], weight [O, I].  Returns [N, O].
Tensor glu_linear(const Tensor& gu, GluActivation act, const Tensor& weight);

// Whether add_rms_norm_linear(_glu) / glu_linear run as one kernel for `rows` rows of `dtype` on `device`
// (the shapes and alignment aside), and the gemv path of ops::matmul takes that many rows
// (KCPP_GEMV, default 1; a decode step uses the fused projections only then).
bool decode_linear_fused(Device device, DType dtype, int64_t rows);

// The most rows ops::matmul sends to its gemv (ops/cuda/gemv.cu) instead of cuBLAS: KCPP_GEMV, 0 to
// 8, default 1 (at more rows cuBLAS measured faster inside a decode step).
int64_t gemv_max_rows();

}  // namespace kcpp::ops
