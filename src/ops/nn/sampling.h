// Sampling the next token from logits [B, V] on the logits' device, as Transformers' generate()
// filters them: temperature T, then top-k, then top-p (nucleus), then a draw.  For row b:
//
//   order the tokens by logit, largest first (ties: the lower id first); keep the first
//   k = top_k (all V when top_k is 0);
//   p_i = exp((x_i - x_max) / T) over the kept tokens, P_i = p_0 + ... + p_i, Z = P_{k-1};
//   top-p keeps the first n tokens, n the least with P_{n-1} >= top_p Z (all k when top_p is 1);
//   u = U(seed_b, position_b, 0), a uniform in [0, 1); the token is the first i < n with P_i > u P_{n-1}.
//
// With neither top-k nor top-p (top_k 0, top_p 1) the same distribution, softmax(x / T), is drawn
// without ordering the vocabulary: the token is argmax_i (x_i / T + g_i), g_i = -log(-log U(seed_b,
// position_b, i + 1)) (the Gumbel-max trick; ties: the lower id).
//
// U(s, a, b) is a counter-based uniform: splitmix64 (Steele, Lea and Flood, "Fast splittable
// pseudorandom number generators", 2014) applied to the three counters, its top 53 bits over 2^53.
// The draws depend on (seed, position, id) only, so a row gives the same tokens alone or in a batch,
// on the CPU or the GPU (both add the same f64 terms in the same order; the device's exp and log may
// differ from the host's by an ulp, which moves a pick only for a draw within ~1e-16 of a boundary).
//
// Returns [B, 2] i64: the token, then -1, or the id of the first non-finite logit of the row (the
// token is then meaningless; the caller reports it, as ops::argmax_checked's callers do).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

#if defined(__CUDACC__)
#define KCPP_SAMPLING_HD __host__ __device__ __forceinline__
#else
#define KCPP_SAMPLING_HD inline
#endif

namespace kcpp::ops {

struct SampleOptions {
  double temperature = 1.0;  // > 0
  int64_t top_k = 0;         // >= 0; 0: every token
  double top_p = 1.0;        // (0, 1]
};

// logits [B, V] float; seeds, positions [B] i64 on the CPU (host values: one copy a step).
Tensor sample_checked(const Tensor& logits, const SampleOptions& opt, const std::vector<uint64_t>& seeds,
                      const std::vector<int64_t>& positions);

// The next decode step's inputs from this step's picks ([B, 2] i64, as sample_checked and
// ops::argmax_checked return them), in place on their device, without the host: ids [B, 1] i64 =
// picks[:, 0]; positions and lengths [B] i32 each + 1.  A decode loop queues its next step with it
// before it reads the picks back.  Every tensor contiguous, on one device.
void advance_decode_inputs(const Tensor& picks, const Tensor& ids, const Tensor& positions, const Tensor& lengths);

// Whether sample_checked runs on the GPU for these options (else the logits go to the host): top_k
// from 1 to 1024, or neither top_k nor top_p.
bool sampling_on_device(const SampleOptions& opt);

// U(seed, a, b) in [0, 1).
KCPP_SAMPLING_HD uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
KCPP_SAMPLING_HD double counter_uniform(uint64_t seed, uint64_t a, uint64_t b) {
  return static_cast<double>(splitmix64(seed ^ splitmix64(a ^ splitmix64(b))) >> 11) * 0x1.0p-53;
}

}  // namespace kcpp::ops
