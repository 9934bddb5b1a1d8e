#include "ops/nn/glu.h"

#include "ops/check.h"
#include "ops/ops.h"

namespace kcpp::ops {
namespace {

void check_glu(const Tensor& gate, const Tensor& up, const char* op) {
  check_float(gate, op, "gate");
  check_same(up, gate, op, "up", "gate");
  check_shape(up, gate.shape(), op, "up");
}

Tensor activate(const Tensor& x, GluActivation act) {
  switch (act) {
    case GluActivation::Silu: return silu(x);
    case GluActivation::Gelu: return gelu(x, false);
    case GluActivation::GeluTanh: return gelu(x, true);
  }
  return x;
}

}  // namespace

Tensor glu_forward(const Tensor& gate, const Tensor& up, GluActivation act) {
  check_glu(gate, up, "glu");
  return mul(activate(gate, act), up);
}

GluBackward glu_backward(const Tensor& dout, const Tensor& gate, const Tensor& up, GluActivation act) {
  check_glu(gate, up, "glu_backward");
  check_same(dout, gate, "glu_backward", "dout", "gate");
  check_shape(dout, gate.shape(), "glu_backward", "dout");
  const Tensor da = mul(dout, up);
  Tensor dgate;
  switch (act) {
    case GluActivation::Silu: dgate = silu_backward(da, gate); break;
    case GluActivation::Gelu: dgate = gelu_backward(da, gate, false); break;
    case GluActivation::GeluTanh: dgate = gelu_backward(da, gate, true); break;
  }
  return {dgate, mul(dout, activate(gate, act))};
}

}  // namespace kcpp::ops
