// The layer slots of the state-space models (Mamba, Falcon-Mamba), each with a reference and the
// contract a kernel must implement to take its place (docs/contracts/SelectiveScan.md,
// SelectiveStateUpdate.md, CausalConv1d.md; the `mamba` package implements all four).  The
// references are plain loops in f64 on the host over the contracts' maths (the model's tensors are
// copied there and the result back), written for parity with Transformers' slow path, not for speed.
#pragma once

#include <optional>

#include "core/tensor.h"
#include "nn/module.h"

namespace kcpp::nn {

// "SelectiveScan" / SelectiveScan/1: u, delta, z [B, D, L] (L contiguous); A [D, N] f32; B, C
// [B, N, L]; D, delta_bias [D] f32.  Returns out [B, D, L] in u's dtype and, when `last_state` is
// given, the state after the last position ([B, D, N] f32).
class SelectiveScan : public Slot {
 public:
  struct Options {
    bool delta_softplus = true;
    std::optional<double> bc_rms_eps;  // Falcon-Mamba: B and C RMS-normalised over N
  };
  explicit SelectiveScan(Options options);
  struct Inputs {
    Tensor u, delta, A, B, C, D, z, delta_bias;
  };
  struct Saved {
    Inputs in;
    Tensor states;  // a kernel's chunk states; empty for the reference (it recomputes)
  };
  struct Grads {
    Tensor du, ddelta, dA, dB, dC, dD, dz, ddelta_bias;
  };
  Tensor forward(const Inputs& in, Tensor* last_state = nullptr, Saved* saved = nullptr);
  Grads backward(const Tensor& dout, const Saved& saved);

  Options options;
};

// "SelectiveStateUpdate" / SelectiveStateUpdate/1: one decoding step from `state` ([B, D, N] f32,
// updated in place); x, dt, z [B, D]; B, C [B, N].  Returns out [B, D].
class SelectiveStateUpdate : public Slot {
 public:
  explicit SelectiveStateUpdate(SelectiveScan::Options options);
  Tensor forward(const Tensor& state, const Tensor& x, const Tensor& dt, const Tensor& A, const Tensor& B, const Tensor& C,
                 const Tensor& D, const Tensor& z, const Tensor& dt_bias);

  SelectiveScan::Options options;
};

// "CausalConv1d" / CausalConv1d/1: the depthwise causal convolution of x [B, D, L] (L contiguous)
// with weight [D, W] and bias [D] (may be absent), then SiLU when `silu`.  Nothing is saved but x,
// which the caller keeps.
class CausalConv1d : public Slot {
 public:
  CausalConv1d(Tensor weight, Tensor bias, bool silu);
  struct Grads {
    Tensor dx, dweight, dbias;
  };
  Tensor forward(const Tensor& x);
  Grads backward(const Tensor& dout, const Tensor& x);

  Tensor weight, bias;
  bool silu;
};

// "CausalConv1dUpdate" / CausalConv1dUpdate/1: x [B, D, S] continuing the inputs kept in
// conv_state [B, D, K] (K >= W - 1, the last K inputs, oldest first; updated in place).
class CausalConv1dUpdate : public Slot {
 public:
  CausalConv1dUpdate(Tensor weight, Tensor bias, bool silu);
  Tensor forward(const Tensor& x, const Tensor& conv_state);

  Tensor weight, bias;
  bool silu;
};

}  // namespace kcpp::nn
