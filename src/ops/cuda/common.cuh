// Shared pieces of the reference CUDA kernels: dtype dispatch and block reductions.
#pragma once

#include "core/cuda_runtime.h"
#include "core/cuda_types.cuh"
#include "core/tensor.h"

namespace kcpp::ops::cuda {

// Calls f(type_identity<D>) with D the CUDA storage type of a 16/32-bit floating dtype.
template <typename F> void visit_cuda_float(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::f32: f(std::type_identity<float>{}); break;
    case DType::bf16: f(std::type_identity<__nv_bfloat16>{}); break;
    case DType::f16: f(std::type_identity<__half>{}); break;
    default: KCPP_FAIL("op {}: dtype {} is not supported on CUDA", op, dtype_name(t));
  }
}

// Merges (m2, l2, a2) into (m, l, a): two partial softmaxes in base 2 (running maximum m, sum l and
// weighted values a; m = -inf: empty), as the decoding attentions merge their lanes and splits.
template <int N>
__device__ __forceinline__ void softmax_merge(float& m, float& l, float (&a)[N], float m2, float l2, const float (&a2)[N]) {
  const float mm = fmaxf(m, m2);
  const float s1 = m == -INFINITY ? 0.f : exp2f(m - mm), s2 = m2 == -INFINITY ? 0.f : exp2f(m2 - mm);
  l = l * s1 + l2 * s2;
#pragma unroll
  for (int i = 0; i < N; ++i) a[i] = a[i] * s1 + a2[i] * s2;
  m = mm;
}

// softmax_merge of the partial softmax held by lane (this lane ^ o) into this lane's (every lane of
// the warp takes part).
template <int N> __device__ __forceinline__ void softmax_merge_lane(float& m, float& l, float (&a)[N], int o) {
  float a2[N];
#pragma unroll
  for (int i = 0; i < N; ++i) a2[i] = __shfl_xor_sync(0xffffffffu, a[i], o);
  const float m2 = __shfl_xor_sync(0xffffffffu, m, o), l2 = __shfl_xor_sync(0xffffffffu, l, o);
  softmax_merge(m, l, a, m2, l2, a2);
}

// An RMSNorm weight element as the norm's casting applies it (ops/nn/rms_norm.h): Llama (offset + w)
// rounded to T, Gemma (offset + w) in f32.
template <typename T> __device__ __forceinline__ float norm_weight_value(float w, float offset, bool gemma) {
  if (gemma) return w + offset;
  return offset != 0.f ? kcpp::kernel::cuda::round_to<T>(w + offset) : w;
}
template <typename T> __device__ __forceinline__ float norm_weight(const T* w, int e, float offset, bool gemma) {
  return norm_weight_value<T>(kcpp::kernel::cuda::to_f32(w[e]), offset, gemma);
}

// y = rms_norm's output element from s (in f32) as the casting rounds it: Gemma r(s rstd wt),
// Llama r(wt r(s rstd)).
template <typename T> __device__ __forceinline__ float norm_apply(float s, float rstd, float wt, bool gemma) {
  using kcpp::kernel::cuda::round_to;
  return gemma ? round_to<T>(s * rstd * wt) : round_to<T>(wt * round_to<T>(s * rstd));
}

enum class BlockOp { Sum, Max };

template <BlockOp Op> __device__ __forceinline__ float combine(float a, float b) {
  if constexpr (Op == BlockOp::Sum) return a + b;
  else return (a != a || a > b) ? a : b;  // NaN wins, as in PyTorch's max
}

// Reduces v over the block; every thread gets the result.  `scratch` holds 32 floats.
template <BlockOp Op> __device__ float block_reduce(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) v = combine<Op>(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = (blockDim.x + 31) / 32;
  __syncthreads();  // scratch may still be read from a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : (Op == BlockOp::Sum ? 0.0f : -INFINITY);
  for (int o = 16; o > 0; o >>= 1) v = combine<Op>(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// A device flag that kernels set on bad data (e.g. an index out of range): slot 0 counts the bad
// entries, slot 1 holds a position, slot 2 its value.  check() synchronizes and throws.
class DataCheck {
 public:
  explicit DataCheck(Device d) : flag_(Tensor::zeros({3}, DType::i64, d)) {}
  unsigned long long* ptr() const { return static_cast<unsigned long long*>(flag_.data()); }
  void check(const char* op, const char* arg, int64_t limit) const {
    const auto v = flag_.to_i64_vector();
    KCPP_CHECK(v[0] == 0, "op {}: argument '{}'[{}] = {} is out of range [0, {}) ({} bad entries)", op, arg, v[1], v[2],
               limit, v[0]);
  }

 private:
  Tensor flag_;
};

__device__ __forceinline__ void report_bad(unsigned long long* flag, int64_t pos, int64_t value) {
  if (atomicAdd(flag, 1ull) == 0) {
    flag[1] = static_cast<unsigned long long>(pos);
    flag[2] = static_cast<unsigned long long>(value);
  }
}

}  // namespace kcpp::ops::cuda
