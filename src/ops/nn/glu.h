// Gated linear units of the MLP: out = act(gate) * up (SwiGLU with SiLU, GeGLU with GELU).
//
//   forward:  a = act(gate) (rounded to dtype), out = a * up
//   backward: dup = dout * a (a recomputed),  dgate = act'(gate) * (dout * up)
// gate, up, out: one shape [..., I], one dtype.  Nothing is saved beyond the inputs.
#pragma once

#include "core/tensor.h"

namespace kcpp::ops {

enum class GluActivation { Silu, Gelu, GeluTanh };

struct GluBackward {
  Tensor dgate, dup;
};

Tensor glu_forward(const Tensor& gate, const Tensor& up, GluActivation act);
GluBackward glu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, GluActivation act);

}  // namespace kcpp::ops
