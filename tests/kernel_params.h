// Host-side glue from kcpp::Tensor to the kernel packages' params structs: what the C ABI layer
// will do (issue 3), shared until then by the packages' tests and benchmarks.  Header-only; needs
// no test framework.
#pragma once

#include "core/cuda_runtime.h"
#include "core/tensor.h"
#include "ops/nn/rms_norm.h"
#include "cross_entropy/cross_entropy.h"
#include "glu/glu.h"
#include "ops/nn/cross_entropy.h"
#include "ops/nn/glu.h"
#include "ops/nn/rope.h"
#include "rms_norm/rms_norm.h"
#include "rope/rope.h"

namespace kcpp::test {

// After a CUDA entry point returned: on success wait for the device and turn a CUDA error into
// kcpp::Error; the entry point's own message (nullptr on success) is passed through so that tests
// of bad input can read it.
inline const char* finish_cuda(const char* kernel_error) {
#if KCPP_WITH_CUDA
  if (!kernel_error) KCPP_CUDA_CHECK(cudaDeviceSynchronize());
#endif
  return kernel_error;
}
inline void check(const char* kernel_error) {
  if (kernel_error) throw Error(kernel_error);
}

}  // namespace kcpp::test

// KCPP_CALL_KERNEL(dev, liger::rms_norm_forward, params): the `_cuda` entry point on the current
// stream for a CUDA device, else the `_cpu` one; evaluates to the entry point's message.
#if KCPP_WITH_CUDA
#define KCPP_CALL_KERNEL(dev, fn, p) \
  ((dev).is_cuda() ? ::kcpp::test::finish_cuda(fn##_cuda((p), ::kcpp::cuda::current_stream())) : fn##_cpu(p))
#else
#define KCPP_CALL_KERNEL(dev, fn, p) (fn##_cpu(p))
#endif

namespace kcpp::test {

inline kernel::DType kernel_dtype(DType t) {
  switch (t) {
    case DType::f32: return kernel::DType::f32;
    case DType::bf16: return kernel::DType::bf16;
    case DType::f16: return kernel::DType::f16;
    default: throw Error("no kernel dtype for " + std::string(dtype_name(t)));
  }
}

// RMSNorm params over 2-D tensors [rows, hidden] (rows may be strided).  Outputs and backward
// tensors may be left undefined when the call does not use them.
struct RMSNormTensors {
  Tensor x, w, y, rstd, dy, dx, dw;
};

inline liger::RMSNormParams rms_norm_params(const RMSNormTensors& t, const ops::RMSNormOptions& o = {}) {
  liger::RMSNormParams p;
  p.dtype = kernel_dtype(t.x.dtype());
  p.rows = t.x.size(0);
  p.hidden = t.x.size(1);
  p.eps = static_cast<float>(o.eps);
  p.offset = static_cast<float>(o.offset);
  p.casting = static_cast<liger::RMSNormCasting>(static_cast<int>(o.casting));
  p.x = t.x.data();
  p.x_stride = t.x.stride(0);
  p.w = t.w.data();
  if (t.y.defined()) p.y = t.y.data(), p.y_stride = t.y.stride(0);
  if (t.rstd.defined()) p.rstd = static_cast<float*>(t.rstd.data());
  if (t.dy.defined()) p.dy = t.dy.data(), p.dy_stride = t.dy.stride(0);
  if (t.dx.defined()) p.dx = t.dx.data(), p.dx_stride = t.dx.stride(0);
  if (t.dw.defined()) p.dw = t.dw.data();
  return p;
}

// Every tensor of a forward + backward at [rows, hidden], outputs uninitialised.
inline RMSNormTensors rms_norm_tensors(const Tensor& x, const Tensor& w, const Tensor& dy) {
  const Device d = x.device();
  return {x, w, Tensor::empty(x.shape(), x.dtype(), d), Tensor::empty({x.size(0)}, DType::f32, d), dy,
          Tensor::empty(x.shape(), x.dtype(), d), Tensor::empty({x.size(1)}, x.dtype(), d)};
}

// RoPE params from logical [B, H, S, D] views (any strides, D contiguous) of q and k (k may be
// undefined) and their outputs (the inputs themselves for the in-place form); cos/sin [1 or B, S, rd].
inline liger::RopeParams rope_params(const Tensor& q, const Tensor& q_out, const Tensor& k, const Tensor& k_out,
                                     const Tensor& cos, const Tensor& sin, ops::RopeLayout layout) {
  auto operand = [](const Tensor& in, const Tensor& out) {
    liger::RopeOperand o;
    if (!in.defined()) return o;
    if (in.stride(3) != 1 || out.stride(3) != 1) throw Error("rope kernel: head_dim must be contiguous, got " + in.str());
    o.heads = in.size(1);
    o.in = in.data();
    o.in_stride_b = in.stride(0), o.in_stride_h = in.stride(1), o.in_stride_s = in.stride(2);
    o.out = out.data();
    o.out_stride_b = out.stride(0), o.out_stride_h = out.stride(1), o.out_stride_s = out.stride(2);
    return o;
  };
  if (!cos.is_contiguous() || !sin.is_contiguous()) throw Error("rope kernel: cos/sin must be contiguous");
  liger::RopeParams p;
  p.dtype = kernel_dtype(q.dtype());
  p.layout = layout == ops::RopeLayout::Interleaved ? liger::RopeLayout::Interleaved : liger::RopeLayout::RotateHalf;
  p.batch = q.size(0);
  p.seq = q.size(2);
  p.head_dim = q.size(3);
  p.rotary_dim = cos.size(2);
  p.q = operand(q, q_out);
  p.k = operand(k, k_out);
  p.cos = cos.data();
  p.sin = sin.data();
  p.cs_stride_b = cos.size(0) == 1 ? 0 : cos.stride(0);
  p.cs_stride_s = cos.stride(1);
  return p;
}

// Cross-entropy params: logits [N, V] (V contiguous), targets [N] i32/i64, loss f32 ([1] or [N]),
// grad [N, V] (undefined: loss only; logits itself: in place), workspace for CUDA.
inline liger::CrossEntropyParams cross_entropy_params(const Tensor& logits, const Tensor& targets,
                                                      const ops::CrossEntropyOptions& o, const Tensor& loss,
                                                      const Tensor& grad, const Tensor& workspace = {}) {
  if (logits.stride(1) != 1) throw Error("cross_entropy kernel: classes must be contiguous, got " + logits.str());
  if (!targets.is_contiguous()) throw Error("cross_entropy kernel: targets must be contiguous");
  liger::CrossEntropyParams p;
  p.dtype = kernel_dtype(logits.dtype());
  p.n = logits.size(0);
  p.v = logits.size(1);
  p.logits = logits.data();
  p.logits_stride = logits.stride(0);
  p.targets = targets.data();
  p.targets_i32 = targets.dtype() == DType::i32;
  p.ignore_index = o.ignore_index;
  p.label_smoothing = static_cast<float>(o.label_smoothing);
  p.reduction = o.reduction == ops::Reduction::Mean  ? liger::CEReduction::Mean
                : o.reduction == ops::Reduction::Sum ? liger::CEReduction::Sum
                                                     : liger::CEReduction::None;
  p.loss = static_cast<float*>(loss.data());
  if (grad.defined()) p.grad = grad.data(), p.grad_stride = grad.stride(0);
  if (workspace.defined()) p.workspace = workspace.data();
  return p;
}

// GLU params over tensors of one shape (pointers, dtype, activation, n); the layout is the caller's.
inline liger::GluParams glu_pointers(const Tensor& gate, const Tensor& up, ops::GluActivation act, const Tensor& out,
                                     const Tensor& dout, const Tensor& dgate, const Tensor& dup) {
  liger::GluParams p;
  p.dtype = kernel_dtype(gate.dtype());
  p.act = static_cast<liger::GluActivation>(static_cast<int>(act));
  p.n = gate.numel();
  p.gate = gate.data();
  p.up = up.data();
  if (out.defined()) p.out = out.data();
  if (dout.defined()) p.dout = dout.data();
  if (dgate.defined()) p.dgate = dgate.data();
  if (dup.defined()) p.dup = dup.data();
  return p;
}

// GLU params over tensors of one shape; each must be contiguous (the kernel's flat layout).
inline liger::GluParams glu_params(const Tensor& gate, const Tensor& up, ops::GluActivation act, const Tensor& out,
                                   const Tensor& dout = {}, const Tensor& dgate = {}, const Tensor& dup = {}) {
  for (const Tensor* t : {&gate, &up, &out, &dout, &dgate, &dup})
    if (t->defined() && !t->is_contiguous()) throw Error("glu kernel: tensors must be contiguous, got " + t->str());
  return glu_pointers(gate, up, act, out, dout, dgate, dup);
}

// The same over 2-D [rows, cols] tensors with the last dim contiguous and a row stride each (e.g. the
// halves of a packed [rows, 2 cols] gate_up): GluParams' rows form.
inline liger::GluParams glu_rows_params(const Tensor& gate, const Tensor& up, ops::GluActivation act, const Tensor& out,
                                        const Tensor& dout = {}, const Tensor& dgate = {}, const Tensor& dup = {}) {
  liger::GluParams p = glu_pointers(gate, up, act, out, dout, dgate, dup);
  p.cols = gate.size(1);
  const Tensor* ts[6] = {&gate, &up, &out, &dout, &dgate, &dup};
  int64_t* lds[6] = {&p.gate_ld, &p.up_ld, &p.out_ld, &p.dout_ld, &p.dgate_ld, &p.dup_ld};
  for (int i = 0; i < 6; ++i) {
    if (!ts[i]->defined()) continue;
    if (ts[i]->dim() != 2 || ts[i]->stride(1) != 1) throw Error("glu kernel: 2-D tensors with a contiguous last dim, got " + ts[i]->str());
    *lds[i] = ts[i]->stride(0);
  }
  return p;
}

}  // namespace kcpp::test
