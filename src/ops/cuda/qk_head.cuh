// One head of qk_norm_rope_cache (ops/nn/decode_fused.h) as a group of lanes computes it: shared by
// its own kernel (ops/cuda/decode_fused.cu) and by the epilogue of the qkv projection that makes the
// heads itself (add_rms_norm_linear_qk, ops/cuda/decode_gemv.cu), so that the two give the same bits.
//
// A head of D elements is held by a group of P lanes (D / V rounded up to a power of two), lane gl of
// the group holding the V consecutive elements from e0 = gl V.  The norm's sum of squares is the
// lane's V products in order, then a butterfly over the group (xor P / 2, ..., 1); RoPE reads each
// element's partner from the group's D floats of shared memory.  Every rounding is where the eager
// composition stores: y = r(w r(x rstd)) (Gemma: r(x rstd w)), then r(r(x cos) + r(rot(x) sin)).
#pragma once

#include <cstdint>

#include "ops/cuda/common.cuh"

namespace kcpp::ops::cuda::qk {

using kcpp::kernel::cuda::round_to;
using kcpp::kernel::cuda::to_f32;

// V elements of T in one aligned chunk (V T = 16 bytes where the callers read 16 bytes at once).
template <typename T, int V> struct alignas(V * sizeof(T) >= 16 ? 16 : V * sizeof(T)) Chunk {
  T v[V];
};

// RoPE of element e (< rd) of a head whose normed values are in sh, each product rounded before the
// add, as the eager ops store them (no fused multiply-add in f32).
template <typename T>
__device__ __forceinline__ float rope_at(float x, const float* sh, int e, int half, bool interleaved, const T* c, const T* s) {
  const float rot = interleaved ? ((e & 1) ? sh[e - 1] : -sh[e + 1]) : (e < half ? -sh[e + half] : sh[e - half]);
  return round_to<T>(__fadd_rn(round_to<T>(__fmul_rn(x, to_f32(c[e]))), round_to<T>(__fmul_rn(rot, to_f32(s[e])))));
}

// Where head `head` of row b goes: its row of q, or its slot of the k or v cache; nullptr for a row or
// position out of range (decode_attention then reports that row as NaN).
template <typename T>
__device__ __forceinline__ T* destination(T* q_out, T* k_cache, T* v_cache, const int* rows, const int* positions, int b,
                                          int head, int hq, int hkv, int d, int r_count, int capacity) {
  if (head < hq) return q_out + (static_cast<int64_t>(b) * hq + head) * d;
  const int row = rows[b], pos = positions[b];
  if (row < 0 || row >= r_count || pos < 0 || pos >= capacity) return nullptr;
  const bool is_v = head >= hq + hkv;
  const int h = is_v ? head - hq - hkv : head - hq;
  return (is_v ? v_cache : k_cache) + ((static_cast<int64_t>(row) * hkv + h) * capacity + pos) * d;
}

// The norm weights of the lane's V elements (as the norm applies them); `wide`: one chunk load.
template <typename T, int V>
__device__ __forceinline__ void load_weights(const T* w, int gl, int e0, float offset, bool gemma, bool wide, float (&wt)[V]) {
  if (wide) {
    const Chunk<T, V> c = reinterpret_cast<const Chunk<T, V>*>(w)[gl];
#pragma unroll
    for (int j = 0; j < V; ++j) wt[j] = norm_weight_value<T>(to_f32(c.v[j]), offset, gemma);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) wt[j] = norm_weight(w, e0 + j, offset, gemma);
  }
}

// One row of a head, in place in v: the norm where `normed` (weights wt), then RoPE where `rotated`
// with the row's cos / sin [rd] (16-byte chunks where `wide`: rd % V == 0 and aligned).  sh: the
// group's D floats of shared memory; `active`: the lane holds elements of the head (gl V < D).  Every
// lane of the warp calls it (the butterfly's shuffles and the __syncwarp()s); the caller
// synchronizes the warp before sh is written again for another row.
template <typename T, int V>
__device__ __forceinline__ void row(float (&v)[V], const float (&wt)[V], bool normed, bool rotated, bool active, int p, int gl,
                                    int d, int rd, float eps, bool gemma, bool interleaved, bool wide, const T* c, const T* s,
                                    float* sh) {
  const int e0 = gl * V;
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < V; ++j) ss += v[j] * v[j];
  for (int o = p / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);  // within the group
  if (normed) {  // RMSNorm over the head: rstd in f32, as ops::rms_norm_forward
    const float rstd = 1.f / sqrtf(ss / static_cast<float>(d) + eps);
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = gemma ? round_to<T>(v[j] * rstd * wt[j]) : round_to<T>(wt[j] * round_to<T>(v[j] * rstd));
  }
  if (active) {
#pragma unroll
    for (int j = 0; j < V; ++j) sh[e0 + j] = v[j];
  }
  __syncwarp();
  if (!rotated || e0 >= rd) return;
  const int half = rd / 2;
  if (wide) {  // all V elements below rd; the partners from shared memory
    const Chunk<T, V> cc = reinterpret_cast<const Chunk<T, V>*>(c)[gl], sc = reinterpret_cast<const Chunk<T, V>*>(s)[gl];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int e = e0 + j;
      const float rot = interleaved ? ((e & 1) ? sh[e - 1] : -sh[e + 1]) : (e < half ? -sh[e + half] : sh[e - half]);
      v[j] = round_to<T>(__fadd_rn(round_to<T>(__fmul_rn(v[j], to_f32(cc.v[j]))), round_to<T>(__fmul_rn(rot, to_f32(sc.v[j])))));
    }
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int e = e0 + j;
      if (e < rd) v[j] = rope_at(v[j], sh, e, half, interleaved, c, s);
    }
  }
}

}  // namespace kcpp::ops::cuda::qk
