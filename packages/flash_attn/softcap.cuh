// Logit soft-capping on the CUDA tensor-core paths (attention.h: s = c tanh(scale q.k / c)), shared by
// attention_cuda.cu's mma.sync kernels and the Hopper ones (sm90_common.cuh).
#pragma once

#include "kcpp/kernel/fast_math.h"

namespace kcpp::flash {

// A thread's raw scores q.k in place to tanh(q.k t_scale), t_scale = scale / c (the caller folds c into
// the exponent's factor): kernel::tanh_approx, 2^x and a reciprocal on the special-function unit, an
// absolute error about 2^-21.  (An odd polynomial on the FMA pipe for warps whose arguments all lie in
// [-1, 1] measured +4% on the head-dim-128 forward and -7% at 256, and made a score depend on its
// warp's others: not kept, bench/RESULTS.md.)
template <int N> __device__ __forceinline__ void cap_scores(float (&s)[N], float t_scale) {
#pragma unroll
  for (int e = 0; e < N; ++e) s[e] = kernel::tanh_approx(s[e] * t_scale);
}
template <int M, int N> __device__ __forceinline__ void cap_scores(float (&s)[M][N], float t_scale) {
  cap_scores(reinterpret_cast<float(&)[M * N]>(s), t_scale);
}

}  // namespace kcpp::flash
