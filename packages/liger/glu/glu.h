// Gated linear units of the MLP (package liger, layer contract MLP activation part, "GLU/1"):
// SwiGLU (SiLU gate), GeGLU (GELU gate, exact or tanh), forward and backward, CPU and CUDA.
//
//   forward:  out = act(gate) * up                       (f32 inside, one rounding to the dtype)
//   backward: dgate = dout * up * act'(gate),  dup = dout * act(gate)
//             (act recomputed from gate: nothing is saved beyond the inputs)
//   act and act' as kcpp/kernel/activation.h gives them (silu, gelu, gelu_tanh, quick_gelu); the hardware
//   exp / division (MathMode::Fast) for 16-bit dtypes, the accurate ones for f32.
// Layout: gate, up, out, dout, dgate, dup hold n elements of one dtype: contiguous arrays, or with
// `cols` > 0, n / cols rows of cols contiguous elements, each tensor's rows its own `*_ld` elements
// apart (the two halves of a packed [.., 2I] gate_up projection, as Phi-3's MLP makes it, with their
// gradients written into the halves of one [.., 2I] buffer).  In-place is allowed element for
// element: out may be gate or up; dgate may be gate and dup may be up (Liger's memory saving: no new
// buffers in the backward).  NaN and Inf propagate as the formulas do.
// Cost: forward reads 2n and writes n elements; backward reads 3n and writes 2n.
#pragma once

#include <cstdint>

#include "kcpp/kernel/activation.h"
#include "kcpp/kernel/types.h"

#if KCPP_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace kcpp::liger {

// silu, gelu, gelu_tanh or quick_gelu (maths in kcpp/kernel/activation.h).
using GluActivation = kernel::Activation;

struct GluParams {
  kernel::DType dtype = kernel::DType::bf16;
  GluActivation act = GluActivation::Silu;
  int64_t n = 0;
  const void* gate = nullptr;
  const void* up = nullptr;
  void* out = nullptr;         // forward
  const void* dout = nullptr;  // backward
  void* dgate = nullptr;
  void* dup = nullptr;
  // Rows (above): 0 = flat; else n is a multiple of cols and, with more than one row, every *_ld of
  // a tensor in use >= cols.
  int64_t cols = 0;
  int64_t gate_ld = 0, up_ld = 0, out_ld = 0, dout_ld = 0, dgate_ld = 0, dup_ld = 0;
};

const char* glu_check(const GluParams& p, bool backward);
const char* glu_forward_cpu(const GluParams& p);
const char* glu_backward_cpu(const GluParams& p);
#if KCPP_WITH_CUDA
const char* glu_forward_cuda(const GluParams& p, cudaStream_t stream);
const char* glu_backward_cuda(const GluParams& p, cudaStream_t stream);
#endif

}  // namespace kcpp::liger
