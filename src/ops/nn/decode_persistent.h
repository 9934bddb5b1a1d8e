// The layers of a decode step in one persistent kernel (CUDA, sm_90): the same maths as the fused
// decode ops (ops/nn/decode_fused.h) composed layer by layer, with the same roundings to the dtype,
// in one launch instead of six a layer.
//
// For each layer, with the residual stream carried as x + delta (x: the stream, delta: the last
// projection's output, not yet added), r() rounding to the dtype, f32 sums:
//   s   = r(x + delta)                  (s = x for the first layer without delta_in)
//   a   = rms_norm(s, input_norm)       (as ops::add_rms_norm, Llama or Gemma casting)
//   qkv = r(a Wqkv^T)
//   q_h, k, v = qk_norm_rope_cache(qkv)  per head: the optional q / k RMSNorm over D, then RoPE
//               (rotate-half, the first rd elements), each rounded as ops::qk_norm_rope_cache
//   k, v written to the caches at [rows[b], kv head, positions[b]]
//   o_h = r(softmax(q_h K^T scale) V)   over the row's keys [lo, lengths[b]) of its kv head,
//               lo = max(0, lengths[b] - window) with a window, else 0 (ops::decode_attention)
//   delta = r(o Wo^T),  x = s
//   s   = r(x + delta),  a = rms_norm(s, post_norm),  gu = r(a Wgu^T)
//   h   = r(r(act(gu[:, :I])) gu[:, I:]),  delta = r(h Wdown^T),  x = s
// and returns (x, delta) after the last layer: the caller adds them under the final norm.
//
// How it runs.  One block an SM, all resident at once (a cooperative launch), and a grid-wide
// barrier between the phases of a layer (norm + qkv, attention, o, norm + gate/up, down), except
// between qkv and attention: there each attention item waits only for its kv head's q / k / v rows,
// which the blocks that make them count in global memory.  A
// projection's rows are split evenly over the blocks; in each block one warp streams the block's
// rows of every weight of every layer, in the order they are used, into a ring of shared-memory
// stages with bulk copies (cp.async.bulk, include/kcpp/kernel/bulk.cuh), and seven warps consume
// them, a row a warp.  The weights do not depend on the activations, so the stream runs ahead
// across the barriers and the attention by the depth of the ring: the memory system stays busy
// where a chain of kernels drains and fills the GPU six times a layer.  The attention splits each
// row's keys over the blocks (a split a block and kv head); the o projection's blocks merge the
// splits' partial softmaxes as they build their input row.
//
// Covered: bf16 / f16, 1-4 rows, hidden, intermediate and Hq D multiples of 8, D a power of two
// from 8 to 256, Hq / Hkv <= 8, packed qkv and gate/up weights without biases, rotate-half RoPE;
// on a device of compute capability 9.0 with the kernel built for it.  decode_layers_persistent
// returns nothing for anything else (the caller composes the fused ops), and unless
// KCPP_DECODE_PERSISTENT=1: it is not yet faster than the fused ops at every batch (bench/RESULTS.md).
// Rows and lengths on the device are not read by the host: an out-of-range row or position skips
// the cache write and makes the row's attention output NaN, as the fused ops do.
#pragma once

#include <optional>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "ops/nn/glu.h"
#include "ops/nn/rms_norm.h"

namespace kcpp::ops {

struct PersistentDecodeLayer {
  Tensor input_norm, post_norm;  // [H]
  Tensor wqkv;                   // [(Hq + 2 Hkv) D, H]: q heads, then k, then v
  Tensor q_norm, k_norm;         // [D] each, or both undefined
  Tensor wo;                     // [H, Hq D]
  Tensor w_gate_up;              // [2 I, H]: gate rows, then up
  Tensor w_down;                 // [H, I]
  Tensor k_cache, v_cache;       // [R, Hkv, C, D]
  double scale = 0.0;            // the attention's scale (0: 1 / sqrt(D))
  int64_t window = 0;            // > 0: sliding window of this many keys, the query's own included
};

struct PersistentDecodeOptions {
  int64_t q_heads = 0, kv_heads = 0;
  RMSNormOptions norm;           // input and post norms
  RMSNormOptions qk_norm;        // q / k norms, where the layers have them
  GluActivation act = GluActivation::Silu;
  int64_t max_length = 0;        // a bound on the lengths (0: the caches' capacity)
};

// x [B, H] the first layer's input (delta_in [B, H] or undefined: nothing to add); cos, sin [B, 1, rd]
// or [B, rd] in x's dtype; rows, positions, lengths [B] i32 on x's device.  Returns (x, delta)
// [B, H] each, or nothing when this call is not one the kernel covers (see above).  Throws on
// operands that contradict each other (shapes, devices, dtypes).
std::optional<std::pair<Tensor, Tensor>> decode_layers_persistent(const Tensor& x, const Tensor& delta_in,
                                                                  const std::vector<PersistentDecodeLayer>& layers,
                                                                  const PersistentDecodeOptions& opt, const Tensor& cos,
                                                                  const Tensor& sin, const Tensor& rows,
                                                                  const Tensor& positions, const Tensor& lengths);

// Whether KCPP_DECODE_PERSISTENT=1 (read at each call, so that a process may compare the paths).
bool decode_persistent_enabled();

// How many calls of this process ran the persistent kernel (a CUDA graph's replays not counted).
int64_t decode_persistent_runs();

}  // namespace kcpp::ops
