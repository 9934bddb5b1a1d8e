// Attention for decoding: one new query token per row of a batch, over a KV cache whose rows hold
// different numbers of tokens (a ragged batch), with every row index and length read from tensors,
// so that a decode step can be captured once as a CUDA graph and replayed as the lengths grow.
//
// Cache storage k_cache, v_cache [R, Hkv, C, D] (R rows, C positions of capacity).  For query b:
//   r = rows[b], L = lengths[b] (keys 0 .. L-1 of cache row r are valid; the query sits at L - 1),
//   J = [max(0, L - window), L) with window > 0, else [0, L),
//   s_j = scale * (q[b, h] . k_cache[r, h / g, j])                 g = Hq / Hkv (grouped-query heads)
//   o[b, h] = sum_{j in J} softmax_J(s)_j * v_cache[r, h / g, j]
// The dot products, the softmax and the sum are f32 (f64 for f64 inputs); o is rounded once to q's
// dtype.  This is the causal attention of the last query of a sequence of L tokens, the same result
// as ops::attention_forward up to where that rounds the scores and probabilities to the dtype.
//
// On the GPU the keys of a row are split into chunks handled by separate blocks and the partial
// softmaxes are merged (flash-decoding: Dao et al., "Flash-Decoding for long-context inference",
// 2023): with a single row the GPU still runs many blocks.  Short rows (at most 16 keys a warp of
// one block) run one block of 8 or 16 warps a group of query heads instead, merged in shared memory.
// Every K and V element is read once for all g query heads of its group.
//
// Row indices and lengths on the device are not read by the host: a row outside [0, R) or a length
// outside [1, max_length] makes that query's output NaN (never an out-of-bounds read).  On the CPU
// they are checked and refused by name.
#pragma once

#include "core/tensor.h"

namespace kcpp::ops {

// q [B, Hq, D]; k_cache, v_cache [R, Hkv, C, D], same dtype and device as q, contiguous; rows and
// lengths [B] i32 on q's device.  max_length (<= C; 0: C) bounds every length: the GPU splits the
// keys by it, so a smaller bound means fewer idle blocks.  Returns o [B, Hq, D] in q's dtype.
Tensor decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& rows,
                        const Tensor& lengths, double scale, int64_t window = 0, int64_t max_length = 0);

// decode_attention's checks of everything but q, for ops that make q [b, hq, d] themselves
// (ops/nn/decode_fused.h): `like` gives the dtype and device the caches must have, named `like_name`.
void check_decode_attention(const Tensor& like, const char* like_name, int64_t b, int64_t hq, int64_t d,
                            const Tensor& k_cache, const Tensor& v_cache, const Tensor& rows, const Tensor& lengths,
                            double scale, int64_t window, int64_t max_length, const char* op);

// Whether decode_attention runs on `device` for this head dim: any on the CPU; on CUDA a multiple of
// 8 up to 256.
bool decode_attention_supported(Device device, int64_t head_dim);

// Writes k, v [B, Hkv, D] into k_cache, v_cache [R, Hkv, C, D] at [rows[b], :, positions[b], :]
// (rows, positions [B] i32 on the cache's device).  On the GPU an out-of-range row or position is
// skipped (decode_attention of that row then reports NaN); on the CPU it is refused by name.
void cache_write(const Tensor& k_cache, const Tensor& v_cache, const Tensor& k, const Tensor& v, const Tensor& rows,
                 const Tensor& positions);

}  // namespace kcpp::ops
