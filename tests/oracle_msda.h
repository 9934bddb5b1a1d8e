// The f64 oracle of the deformable_attention package (tests/oracle.h's rules: plain loops over
// std::vector<double>, written from docs/contracts/MultiScaleDeformableAttention.md, sharing no code with
// the kernels).  With `magnitude`, each result is the same formula on the absolute values of every term
// (differences of corner values become sums), the scale against which rounding errors are measured.
#pragma once

#include <cstdint>
#include <vector>

#include "oracle.h"

namespace kcpp::oracle {

// value [B, S, M, C]; shapes [L, 2] (H, W); starts [L]; loc [B, Q, M, L, P, 2] (x, y); attn [B, Q, M, L, P].
struct Msda {
  int64_t batch = 1, seq = 1, heads = 1, channels = 1, queries = 1, levels = 1, points = 1;
  std::vector<int64_t> shapes, starts;
  V value, loc, attn;
};

// out [B, Q, M*C].
V msda_forward(const Msda& o, bool magnitude = false);

struct MsdaGrad {
  V dvalue, dloc, dattn;
};
// The gradients of sum(dout * out).
MsdaGrad msda_backward(const Msda& o, const V& dout, bool magnitude = false);

}  // namespace kcpp::oracle
