// The f64 oracle of the deformable_attention package (tests/oracle.h's rules: plain loops over
// std::vector<double>, written from docs/contracts/MultiScaleDeformableAttention.md, sharing no code with
// the kernels).  Terms::Magnitude gives each result the same formula on the absolute values of every
// term (differences of corner values become sums), the scale against which rounding errors are
// measured.  Terms::PositionRounding bounds, in units of the f32 unit roundoff u, what a kernel's f32
// arithmetic on the sampling position moves each result by: x = lx W - 1/2 (and y) rounded twice moves x
// by up to u (2|x| + 1), 1 - fx and wy wx add a rounding each, so a corner's weight moves by up to
// u (2|x| + 2|y| + 5) (and the slopes of dsampling_locations likewise); each in-range corner's weight is
// replaced by that factor, every other term by its absolute value.  It matters where the in-range
// weights are small (a sample just inside the map's edge): there the result is small and the moved
// weights are not.
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

enum class Terms { Value, Magnitude, PositionRounding };

// out [B, Q, M*C].
V msda_forward(const Msda& o, Terms terms = Terms::Value);

struct MsdaGrad {
  V dvalue, dloc, dattn;
};
// The gradients of sum(dout * out).
MsdaGrad msda_backward(const Msda& o, const V& dout, Terms terms = Terms::Value);

}  // namespace kcpp::oracle
