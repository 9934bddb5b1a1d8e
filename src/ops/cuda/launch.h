// The CUDA side of the reference primitives (ops/cuda/*.cu).  Arguments arrive checked; outputs
// are allocated by the caller.  Each launcher checks its launch and names its op.
#pragma once

#include "core/tensor.h"
#include "ops/nn/decode_fused.h"
#include "ops/nn/decode_persistent.h"
#include "ops/nn/mamba_decode.h"
#include "ops/nn/sampling.h"
#include "ops/ops.h"

namespace kcpp::ops::cuda {

void unary(Unary op, const Tensor& out, const Tensor& x, double alpha);
void binary(Binary op, const Tensor& out, const Tensor& a, const Tensor& b);  // a, b expanded to out's shape
void reduce_last(Reduce op, const Tensor& out, const Tensor& x);              // x contiguous [rows, n]
void argmax_checked(const Tensor& out, const Tensor& x);                       // x contiguous [rows, n], out i64 [rows, 2]
void softmax(Softmax kind, const Tensor& out, const Tensor& x);               // x contiguous [rows, n]
void softmax_backward(Softmax kind, const Tensor& dx, const Tensor& dy, const Tensor& y);
void matmul(const Tensor& out, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b, int64_t batch,
            int64_t m, int64_t n, int64_t k, bool broadcast_b);
// out [M, N] = a [M, K] w [N, K]^T for M <= KCPP_GEMV (default 1, at most kGemvMaxRows) in bf16 / f16
// (ops/cuda/gemv.cu); false when the call is not one it covers (rows, K % 8, alignment, dtype), for
// cuBLAS to take.
constexpr int64_t kGemvMaxRows = 8;
bool gemv_small_m(const Tensor& out, const Tensor& a, const Tensor& w, int64_t m, int64_t n, int64_t k);
// check_ids: a bad id throws (the op synchronizes); else its row is NaN and nothing waits (CUDA graphs).
void embedding(const Tensor& out, const Tensor& weight, const Tensor& ids, bool check_ids);
// out [V, H] zero-filled, in grad's dtype (f32 / bf16 / f16), grad [n, H] contiguous: deterministic (sorted ids).
// check_ids: a bad id throws (the op synchronizes); else its terms are left out and nothing waits.
void embedding_backward(const Tensor& out, const Tensor& grad, const Tensor& ids, bool check_ids);
void gather_last(const Tensor& out, const Tensor& x, const Tensor& idx, int64_t ignore_index);
void scatter_last(const Tensor& out, const Tensor& values, const Tensor& idx, int64_t ignore_index);
void valid_mask(const Tensor& out, const Tensor& idx, int64_t ignore_index);
// ops/nn/decode_attention.h: q [B, Hq, D] contiguous, caches [R, Hkv, C, D], rows / lengths [B] i32.
void decode_attention(const Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& rows,
                      const Tensor& lengths, double scale, int64_t window, int64_t max_length);
void cache_write(const Tensor& k_cache, const Tensor& v_cache, const Tensor& k, const Tensor& v, const Tensor& rows,
                 const Tensor& positions);
// ops/nn/rope.h's rope_cos_sin in one kernel: cos, sin [N, rd] (f32 / bf16 / f16) written from positions [N]
// (i32 / i64) and inv_freq [rd / 2] f32, every tensor contiguous.
void rope_cos_sin(const Tensor& cos, const Tensor& sin, const Tensor& positions, const Tensor& inv_freq, double scaling);
// ops/nn/decode_fused.h, operands checked and contiguous: out [B, Hq, D] written.  False, with nothing
// launched, where the call's attention is not one block a whole head group (the caller composes).
bool qk_norm_rope_attention(const Tensor& out, const Tensor& qkv, const QkNormRopeCache& opt, const Tensor& cos,
                            const Tensor& sin, const Tensor& k_cache, const Tensor& v_cache, const Tensor& rows,
                            const Tensor& positions, const Tensor& lengths, double scale, int64_t window, int64_t max_length);
// ops/nn/decode_fused.h: every tensor contiguous; q [B, Hq, D] written.
void qk_norm_rope_cache(const Tensor& q, const Tensor& qkv, const QkNormRopeCache& opt, const Tensor& cos, const Tensor& sin,
                        const Tensor& k_cache, const Tensor& v_cache, const Tensor& rows, const Tensor& positions);
void add_rms_norm(const Tensor& s, const Tensor& y, const Tensor& x, const Tensor& delta, const Tensor& w,
                  const RMSNormOptions& opt);
void glu_packed(const Tensor& h, const Tensor& gu, GluActivation act);
// ops/nn/decode_fused.h, the fused projections (ops/cuda/decode_gemv.cu): bf16 / f16, 1 ..
// kFusedLinearMaxRows rows, K % 8 == 0, every tensor contiguous and 16-byte aligned; out [N, O]
// written, and s [N, K] where defined (it is with delta).  False, with nothing launched, when the
// rows do not fit in a block's shared memory (the caller composes the op).
bool add_rms_norm_linear(const Tensor& out, const Tensor& s, const Tensor& x, const Tensor& delta, const Tensor& norm_weight,
                         const RMSNormOptions& opt, const Tensor& weight);
bool glu_linear(const Tensor& out, const Tensor& gu, GluActivation act, const Tensor& weight);
// ops/nn/decode_fused.h's linear_glu on the Hopper grouped GEMM (ops/cuda/fused_gemm.cu): x [N, K]
// with rows contiguous along K, weight [2I, K] contiguous, h [N, I] contiguous, bf16 / f16.  Null when
// it launched; else why it cannot (the device, the build, a size or an alignment), nothing launched.
const char* linear_glu(const Tensor& h, const Tensor& x, const Tensor& weight, GluActivation act);
// ops/nn/decode_fused.h's linear_qk_norm_rope_cache on the same GEMM: arguments checked; null when it
// launched, else why it cannot (nothing launched).
const char* linear_qk_norm_rope_cache(const Tensor& q, const Tensor& x, const Tensor& weight, const QkNormRopeCache& opt,
                                      const Tensor& cos, const Tensor& sin, const Tensor& k_cache, const Tensor& v_cache,
                                      const Tensor& rows, const Tensor& positions);
// Null when that GEMM can run on `device` (the build, the compute capability, the driver), else why not.
const char* fused_gemm_unavailable(Device device);
// The multiprocessors of a CUDA device (cached).
int multiprocessors(Device device);
bool add_rms_norm_linear_glu(const Tensor& out, const Tensor& s, const Tensor& x, const Tensor& delta,
                             const Tensor& norm_weight, const RMSNormOptions& opt, const Tensor& weight, GluActivation act);
// The blocks of `kernel` (launched with `threads` threads) resident on the current device at once with
// `smem` bytes of dynamic shared memory, the kernel's limit raised above the default 48 KiB where
// needed; 0 when `smem` does not fit (ops/cuda/decode_gemv.cu).  Cached: decode steps ask every layer.
int resident_blocks(const void* kernel, int threads, size_t smem);
// ops/nn/mamba_decode.h, operands checked (ops/cuda/decode_gemv.cu, ops/cuda/mamba_decode.cu):
// mamba_norm_in_proj writes out, s (with delta) and xc and advances conv_state (false, nothing
// launched, when the rows do not fit in a block's shared memory); mamba_ssm_step writes y and
// advances the SSM state.  (add_rms_norm_linear above takes an f32 x with 16-bit weights too.)
bool mamba_norm_in_proj(const Tensor& out, const Tensor& s, const Tensor& xc, const Tensor& x, const Tensor& delta,
                        const Tensor& norm_weight, const RMSNormOptions& opt, const Tensor& weight, const Tensor& bias,
                        const Tensor& conv_state, const Tensor& conv_w, const Tensor& conv_b);
void mamba_ssm_step(const Tensor& y, const MambaSsmStep& step);
// ops/nn/decode_persistent.h, operands checked and covered: writes x_out and delta_out [B, H]; false
// (nothing launched) when the device or the kernel's build cannot run it, or its shared memory does
// not fit.
bool decode_layers_persistent(const Tensor& x_out, const Tensor& delta_out, const Tensor& x, const Tensor& delta_in,
                              const std::vector<PersistentDecodeLayer>& layers, const PersistentDecodeOptions& opt,
                              const Tensor& cos, const Tensor& sin, const Tensor& rows, const Tensor& positions,
                              const Tensor& lengths);
int64_t decode_persistent_launches();
// ops/nn/sampling.h: picks [B, 2] i64, ids [B, 1] i64, positions and lengths [B] i32, all contiguous.
void advance_decode_inputs(const Tensor& picks, const Tensor& ids, const Tensor& positions, const Tensor& lengths);
// ops/nn/sampling.h: logits [B, V] contiguous, out [B, 2] i64; options sampling_on_device() takes.
void sample_checked(const Tensor& out, const Tensor& logits, const SampleOptions& opt, const std::vector<uint64_t>& seeds,
                    const std::vector<int64_t>& positions);

}  // namespace kcpp::ops::cuda
