// Package "liger": the ABI table (include/kcpp/abi.h) over the kernels of this folder.
//
//   LigerRMSNorm          RMSNorm/1           rms_norm/rms_norm.h
//   LigerAddRMSNorm       AddRMSNorm/1        rms_norm/rms_norm.h (the residual fused in)
//   LigerLayerNorm        LayerNorm/1         layer_norm/layer_norm.h
//   LigerGLU              GLU/1               glu/glu.h        (SwiGLU, GeGLU exact / tanh, QuickGELU-GLU)
//   LigerRotaryEmbedding  rotary_pos_emb/1    rope/rope.h
//   LigerCrossEntropy     CrossEntropyLoss/1  cross_entropy/cross_entropy.h
//   LigerFusedLinearCrossEntropy  ForCausalLMLoss/1  fused_linear_ce/fused_linear_ce.h
//
// Each entry point reads its named arguments (docs/contracts/<contract>.md), checks them with
// kcpp::kernel::Call (the first problem is reported, naming the argument), fills the kernel's params
// struct and runs the CPU or CUDA kernel on the context's stream.  Nothing here synchronizes with the
// host.  supports() runs the same argument checks without running anything, so a refusal and its
// reason are exactly what the call would have said.  An argument that the call does not read (a
// misspelt "epsilon", a backward argument in a forward call, "dbias" without "bias") is refused,
// naming it (Call::all_read), instead of being ignored.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>

#include "cross_entropy/cross_entropy.h"
#include "fused_linear_ce/fused_linear_ce.h"
#include "glu/glu.h"
#include "kcpp/abi.h"
#include "kcpp/kernel/abi_args.h"
#include "layer_norm/layer_norm.h"
#include "rms_norm/rms_norm.h"
#include "rope/rope.h"

#ifndef KCPP_WITH_CUDA
#define KCPP_WITH_CUDA 0
#endif

namespace {

namespace kk = kcpp::kernel;
namespace lg = kcpp::liger;

constexpr bool kCuda = KCPP_WITH_CUDA != 0;

#if KCPP_WITH_CUDA
cudaStream_t stream_of(const kk::Call& c) { return static_cast<cudaStream_t>(c.context()->stream); }
#endif

// Runs the kernel's CPU or CUDA entry point and turns its message into the call's status.
#if KCPP_WITH_CUDA
#define LIGER_RUN(c, fn, p) c.finish((c).on_cuda() ? fn##_cuda((p), stream_of(c)) : fn##_cpu(p))
#else
#define LIGER_RUN(c, fn, p) c.finish(fn##_cpu(p))
#endif

bool is_f32(const DLTensor* t) { return t->dtype.code == kDLFloat && t->dtype.bits == 32 && t->dtype.lanes == 1; }

// A tensor of exactly `n` elements, f32 and contiguous (rstd, a per-row loss).
bool f32_vector(kk::Call& c, const DLTensor* t, const char* name, int64_t n) {
  if (!t || !c.ok()) return c.ok();
  if (!is_f32(t)) return c.require(false, "tensor '%s' must be f32, is %s", name, kk::dl_dtype_name(t->dtype));
  if (kk::numel(t) != n)
    return c.require(false, "tensor '%s' must have %lld elements, has %lld", name, static_cast<long long>(n),
                     static_cast<long long>(kk::numel(t)));
  return c.row_major(t, name);
}

// ---- RMSNorm/1 -----------------------------------------------------------------------------------

constexpr const char* kCastings[] = {"llama", "gemma", "none", nullptr};

// Reads everything both directions share; `bwd` adds dy / dx / dweight; `add` is AddRMSNorm/1
// (forward: residual, residual_out; backward: the saved residual_out in place of x, dresidual_out).
// Returns false on a problem.
bool rms_norm_args(kk::Call& c, bool bwd, bool add, lg::RMSNormParams& p) {
  c.device_in(kCuda);
  const char* xn = add && bwd ? "residual_out" : "x";
  DLTensor* x = c.tensor(xn);
  DLTensor* w = c.tensor("weight");
  p.eps = static_cast<float>(c.real("eps", 1e-6));
  p.offset = static_cast<float>(c.real("offset", 0.0));
  p.casting = static_cast<lg::RMSNormCasting>(c.choice("casting", 0, kCastings));
  int64_t rows = 0, h = 0, xs = 0;
  c.float_dtype(x, xn, &p.dtype);
  c.rows(x, xn, &rows, &h, &xs);
  c.same_dtype(w, "weight", x, xn);
  c.ndim(w, "weight", 1);
  if (c.ok() && w->shape[0] != h)
    c.require(false, "tensor 'weight' has %lld elements but '%s' rows have %lld", static_cast<long long>(w->shape[0]), xn,
              static_cast<long long>(h));
  c.row_major(w, "weight");
  if (c.ok() && h == 0) c.require(false, "tensor '%s' has an empty last dim", xn);
  if (c.ok() && !(std::isfinite(p.eps) && p.eps >= 0)) c.require(false, "argument 'eps' must be finite and >= 0");
  if (!c.ok()) return false;
  p.rows = rows, p.hidden = h, p.x = kk::data_ptr(x), p.x_stride = xs, p.w = kk::data_ptr(w);
  DLTensor* rstd = c.tensor("rstd", bwd);
  f32_vector(c, rstd, "rstd", rows);
  if (rstd) p.rstd = static_cast<float*>(kk::data_ptr(rstd));
  int64_t r2 = 0, h2 = 0;
  if (!bwd) {
    DLTensor* y = c.tensor("y");
    c.same_dtype(y, "y", x, "x");
    c.same_shape(y, "y", x, "x");
    if (c.rows(y, "y", &r2, &h2, &p.y_stride)) p.y = kk::data_ptr(y);
    if (add) {
      DLTensor* res = c.tensor("residual");
      DLTensor* rout = c.tensor("residual_out");
      for (const auto& [t, n] : {std::pair{res, "residual"}, std::pair{rout, "residual_out"}}) {
        c.same_dtype(t, n, x, "x");
        c.same_shape(t, n, x, "x");
      }
      if (c.rows(res, "residual", &r2, &h2, &p.residual_stride)) p.residual = kk::data_ptr(res);
      if (c.rows(rout, "residual_out", &r2, &h2, &p.residual_out_stride)) p.residual_out = kk::data_ptr(rout);
      if (c.ok() && (p.y == p.x || p.y == p.residual || p.y == p.residual_out))
        c.require(false, "'y' must not be 'x', 'residual' or 'residual_out'");
      if (c.ok() && ((p.residual_out == p.x && p.residual_out_stride != xs) ||
                     (p.residual_out == p.residual && p.residual_out_stride != p.residual_stride)))
        c.require(false, "'residual_out' over 'x' or 'residual' must have its strides");
    }
    if (c.ok() && !rstd && (c.context()->mode & KCPP_MODE_TRAINING))
      c.require(false, "missing tensor argument 'rstd' (required in training mode: backward needs it)");
    return c.all_read();
  }
  DLTensor* dy = c.tensor("dy");
  DLTensor* dx = c.tensor("dx");
  DLTensor* dw = c.tensor("dweight", false);
  c.same_dtype(dy, "dy", x, xn);
  c.same_shape(dy, "dy", x, xn);
  c.same_dtype(dx, "dx", x, xn);
  c.same_shape(dx, "dx", x, xn);
  if (c.rows(dy, "dy", &r2, &h2, &p.dy_stride)) p.dy = kk::data_ptr(dy);
  if (c.rows(dx, "dx", &r2, &h2, &p.dx_stride)) p.dx = kk::data_ptr(dx);
  if (c.ok() && p.dx == p.dy && p.dx_stride != p.dy_stride) c.require(false, "in-place 'dx' must have the strides of 'dy'");
  if (DLTensor* dres = add ? c.tensor("dresidual_out", false) : nullptr) {
    c.same_dtype(dres, "dresidual_out", x, xn);
    c.same_shape(dres, "dresidual_out", x, xn);
    if (c.rows(dres, "dresidual_out", &r2, &h2, &p.dres_stride)) p.dresidual_out = kk::data_ptr(dres);
    if (c.ok() && p.dx == p.dresidual_out && p.dx_stride != p.dres_stride)
      c.require(false, "'dx' over 'dresidual_out' must have its strides");
  }
  if (dw) {
    c.same_dtype(dw, "dweight", w, "weight");
    c.same_shape(dw, "dweight", w, "weight");
    c.row_major(dw, "dweight");
    if (c.ok()) p.dw = kk::data_ptr(dw);
  }
  return c.all_read();
}

template <bool Add> kcpp_status rms_norm_supports(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, Add ? "LigerAddRMSNorm" : "LigerRMSNorm");
  lg::RMSNormParams p;
  // supports() may be asked with forward's or backward's arguments.
  const bool bwd = c.find("dy") != nullptr;
  rms_norm_args(c, bwd, Add, p);
  return c.status();
}

template <bool Add> kcpp_status rms_norm_forward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, Add ? "LigerAddRMSNorm.forward" : "LigerRMSNorm.forward");
  lg::RMSNormParams p;
  if (!rms_norm_args(c, false, Add, p)) return c.status();
  if (!p.rstd) p.rstd = static_cast<float*>(c.workspace(static_cast<size_t>(p.rows > 0 ? p.rows : 1) * sizeof(float)));
  if (!c.ok()) return c.status();
  return LIGER_RUN(c, lg::rms_norm_forward, p);
}

template <bool Add> kcpp_status rms_norm_backward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, Add ? "LigerAddRMSNorm.backward" : "LigerRMSNorm.backward");
  lg::RMSNormParams p;
  if (!rms_norm_args(c, true, Add, p)) return c.status();
  if (!p.dw) p.dw = c.workspace(static_cast<size_t>(p.hidden) * static_cast<size_t>(kk::dtype_bytes(p.dtype)));
#if KCPP_WITH_CUDA
  if (c.on_cuda() && c.ok()) p.workspace = c.workspace(lg::rms_norm_backward_workspace(p, ctx->device.device_id));
#endif
  if (!c.ok()) return c.status();
  return LIGER_RUN(c, lg::rms_norm_backward, p);
}

// ---- LayerNorm/1 ---------------------------------------------------------------------------------

bool layer_norm_args(kk::Call& c, bool bwd, lg::LayerNormParams& p) {
  c.device_in(kCuda);
  DLTensor* x = c.tensor("x");
  DLTensor* w = c.tensor("weight");
  DLTensor* b = bwd ? nullptr : c.tensor("bias", false);
  p.eps = static_cast<float>(c.real("eps", 1e-5));
  int64_t rows = 0, h = 0, r2 = 0, h2 = 0;
  c.float_dtype(x, "x", &p.dtype);
  c.rows(x, "x", &rows, &h, &p.x_stride);
  for (const auto& [t, n] : {std::pair{w, "weight"}, std::pair{b, "bias"}}) {
    if (!t) continue;
    c.same_dtype(t, n, x, "x");
    c.ndim(t, n, 1);
    if (c.ok() && t->shape[0] != h)
      c.require(false, "tensor '%s' has %lld elements but 'x' rows have %lld", n, static_cast<long long>(t->shape[0]),
                static_cast<long long>(h));
    c.row_major(t, n);
  }
  if (c.ok() && h == 0) c.require(false, "tensor 'x' has an empty last dim");
  if (c.ok() && !(std::isfinite(p.eps) && p.eps >= 0)) c.require(false, "argument 'eps' must be finite and >= 0");
  if (!c.ok()) return false;
  p.rows = rows, p.hidden = h, p.x = kk::data_ptr(x), p.w = kk::data_ptr(w);
  if (b) p.b = kk::data_ptr(b);
  DLTensor* mean = c.tensor("mean", bwd);
  DLTensor* rstd = c.tensor("rstd", bwd);
  f32_vector(c, mean, "mean", rows);
  f32_vector(c, rstd, "rstd", rows);
  if (mean && c.ok()) p.mean = static_cast<float*>(kk::data_ptr(mean));
  if (rstd && c.ok()) p.rstd = static_cast<float*>(kk::data_ptr(rstd));
  if (!bwd) {
    DLTensor* y = c.tensor("y");
    c.same_dtype(y, "y", x, "x");
    c.same_shape(y, "y", x, "x");
    if (c.rows(y, "y", &r2, &h2, &p.y_stride)) p.y = kk::data_ptr(y);
    if (c.ok() && (!mean || !rstd) && (c.context()->mode & KCPP_MODE_TRAINING))
      c.require(false, "missing tensor arguments 'mean' and 'rstd' (required in training mode: backward needs them)");
    return c.all_read();
  }
  DLTensor* dy = c.tensor("dy");
  DLTensor* dx = c.tensor("dx");
  c.same_dtype(dy, "dy", x, "x");
  c.same_shape(dy, "dy", x, "x");
  c.same_dtype(dx, "dx", x, "x");
  c.same_shape(dx, "dx", x, "x");
  if (c.rows(dy, "dy", &r2, &h2, &p.dy_stride)) p.dy = kk::data_ptr(dy);
  if (c.rows(dx, "dx", &r2, &h2, &p.dx_stride)) p.dx = kk::data_ptr(dx);
  if (c.ok() && p.dx == p.dy && p.dx_stride != p.dy_stride) c.require(false, "in-place 'dx' must have the strides of 'dy'");
  for (const auto& [n, out] : {std::pair{"dweight", &p.dw}, std::pair{"dbias", &p.db}}) {
    DLTensor* t = c.tensor(n, false);
    if (!t) continue;
    c.same_dtype(t, n, w, "weight");
    c.same_shape(t, n, w, "weight");
    c.row_major(t, n);
    if (c.ok()) *out = kk::data_ptr(t);
  }
  return c.all_read();
}

kcpp_status layer_norm_supports(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "LigerLayerNorm");
  lg::LayerNormParams p;
  layer_norm_args(c, c.find("dy") != nullptr, p);
  return c.status();
}

kcpp_status layer_norm_forward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "LigerLayerNorm.forward");
  lg::LayerNormParams p;
  if (!layer_norm_args(c, false, p)) return c.status();
  const size_t stats = static_cast<size_t>(p.rows > 0 ? p.rows : 1) * sizeof(float);
  if (!p.mean) p.mean = static_cast<float*>(c.workspace(stats));
  if (!p.rstd) p.rstd = static_cast<float*>(c.workspace(stats));
  if (!c.ok()) return c.status();
  return LIGER_RUN(c, lg::layer_norm_forward, p);
}

kcpp_status layer_norm_backward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "LigerLayerNorm.backward");
  lg::LayerNormParams p;
  if (!layer_norm_args(c, true, p)) return c.status();
  if (!p.dw) p.dw = c.workspace(static_cast<size_t>(p.hidden) * static_cast<size_t>(kk::dtype_bytes(p.dtype)));
#if KCPP_WITH_CUDA
  if (c.on_cuda() && c.ok()) p.workspace = c.workspace(std::max<size_t>(1, lg::layer_norm_backward_workspace(p, ctx->device.device_id)));
#endif
  if (!c.ok()) return c.status();
  return LIGER_RUN(c, lg::layer_norm_backward, p);
}

// ---- GLU/1 ---------------------------------------------------------------------------------------

bool glu_args(kk::Call& c, bool bwd, lg::GluParams& p) {
  c.device_in(kCuda);
  DLTensor* gate = c.tensor("gate");
  DLTensor* up = c.tensor("up");
  const char* act = c.string("activation", "silu");
  if (c.ok() && !kk::parse_activation(act, &p.act))
    c.require(false, "argument 'activation' is '%s'; expected 'silu', 'gelu', 'gelu_tanh' or 'quick_gelu'", act);
  c.float_dtype(gate, "gate", &p.dtype);
  c.same_dtype(up, "up", gate, "gate");
  c.same_shape(up, "up", gate, "gate");
  const char* names[5] = {"gate", "up", "out", nullptr, nullptr};
  if (bwd) names[2] = "dout", names[3] = "dgate", names[4] = "dup";
  DLTensor* t[5] = {gate, up};
  for (int i = 2; i < 5 && names[i]; ++i) {
    t[i] = c.tensor(names[i]);
    c.same_dtype(t[i], names[i], gate, "gate");
    c.same_shape(t[i], names[i], gate, "gate");
  }
  // Each tensor as rows of the last dim's width, with a row stride of its own (GLU/1: the halves of a
  // packed [.., 2I] gate_up and of its gradient).
  int64_t ld[5] = {}, rows = 0, width = 0;
  const bool scalar = gate && gate->ndim == 0;  // one element: flat
  for (int i = 0; i < 5 && names[i]; ++i) scalar ? c.row_major(t[i], names[i]) : c.rows(t[i], names[i], &rows, &width, &ld[i]);
  if (!c.ok()) return false;
  p.n = kk::numel(gate);
  // Rows only where some tensor's rows are apart (else the flat loop over n, as for any contiguous call).
  bool apart = false;
  for (int i = 0; i < 5 && names[i]; ++i) apart = apart || (rows > 1 && ld[i] != width);
  p.cols = scalar || !apart ? 0 : width;
  p.gate = kk::data_ptr(gate), p.gate_ld = ld[0];
  p.up = kk::data_ptr(up), p.up_ld = ld[1];
  if (!bwd) {
    p.out = kk::data_ptr(t[2]), p.out_ld = ld[2];
  } else {
    p.dout = kk::data_ptr(t[2]), p.dout_ld = ld[2];
    p.dgate = kk::data_ptr(t[3]), p.dgate_ld = ld[3];
    p.dup = kk::data_ptr(t[4]), p.dup_ld = ld[4];
    if (p.n > 0 && p.dgate == p.dup) c.require(false, "'dgate' and 'dup' must be different tensors");
  }
  return c.all_read();
}

kcpp_status glu_supports(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "LigerGLU");
  lg::GluParams p;
  glu_args(c, c.find("dout") != nullptr, p);
  return c.status();
}

kcpp_status glu_forward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "LigerGLU.forward");
  lg::GluParams p;
  if (!glu_args(c, false, p)) return c.status();
  return LIGER_RUN(c, lg::glu_forward, p);
}

kcpp_status glu_backward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "LigerGLU.backward");
  lg::GluParams p;
  if (!glu_args(c, true, p)) return c.status();
  return LIGER_RUN(c, lg::glu_backward, p);
}

// ---- rotary_pos_emb/1 ------------------------------------------------------------------------------

constexpr const char* kRopeLayouts[] = {"bhsd", "bshd", nullptr};
constexpr const char* kRopeStyles[] = {"rotate_half", "interleaved", nullptr};

// One of q / k (or their gradients): a 4-D tensor in `layout`, its output of the same shape.
bool rope_operand(kk::Call& c, DLTensor* in, const char* in_name, DLTensor* out, const char* out_name, int layout,
                  const DLTensor* like, lg::RopeOperand& o) {
  if (!in || !c.ok()) return c.ok();
  c.ndim(in, in_name, 4);
  c.same_dtype(in, in_name, like, "q");
  c.same_dtype(out, out_name, in, in_name);
  c.same_shape(out, out_name, in, in_name);
  if (!c.ok()) return false;
  if (in->shape[0] != like->shape[0] || in->shape[layout == 0 ? 2 : 1] != like->shape[layout == 0 ? 2 : 1] ||
      in->shape[3] != like->shape[3])
    return c.require(false, "tensor '%s' must match 'q' in batch, sequence and head_dim", in_name);
  for (const DLTensor* t : {static_cast<const DLTensor*>(in), static_cast<const DLTensor*>(out)})
    if (t->shape[3] > 1 && kk::stride(t, 3) != 1)
      return c.fail(KCPP_ERROR_UNSUPPORTED, "tensor '%s': head_dim must be contiguous", t == in ? in_name : out_name);
  const int hd = layout == 0 ? 1 : 2, sd = layout == 0 ? 2 : 1;
  o.heads = in->shape[hd];
  o.in = kk::data_ptr(in);
  o.in_stride_b = kk::stride(in, 0), o.in_stride_h = kk::stride(in, hd), o.in_stride_s = kk::stride(in, sd);
  o.out = kk::data_ptr(out);
  o.out_stride_b = kk::stride(out, 0), o.out_stride_h = kk::stride(out, hd), o.out_stride_s = kk::stride(out, sd);
  if (o.in == o.out && (o.in_stride_b != o.out_stride_b || o.in_stride_h != o.out_stride_h || o.in_stride_s != o.out_stride_s))
    return c.require(false, "in-place '%s' must have the strides of '%s'", out_name, in_name);
  return true;
}

// Forward reads q, k -> q_out, k_out; backward reads dq_out, dk_out -> dq, dk (the transpose).
bool rope_args(kk::Call& c, bool bwd, lg::RopeParams& p) {
  c.device_in(kCuda);
  const char* qi = bwd ? "dq_out" : "q";
  const char* ki = bwd ? "dk_out" : "k";
  const char* qo = bwd ? "dq" : "q_out";
  const char* ko = bwd ? "dk" : "k_out";
  DLTensor* q = c.tensor(qi);
  DLTensor* k = c.tensor(ki, false);
  DLTensor* q_out = c.tensor(qo);
  DLTensor* k_out = k ? c.tensor(ko) : nullptr;
  DLTensor* cos = c.tensor("cos");
  DLTensor* sin = c.tensor("sin");
  const int layout = c.choice("layout", 0, kRopeLayouts);
  p.layout = static_cast<lg::RopeLayout>(c.choice("style", 0, kRopeStyles));
  c.float_dtype(q, qi, &p.dtype);
  c.ndim(q, qi, 4);
  if (!c.ok()) return false;
  rope_operand(c, q, qi, q_out, qo, layout, q, p.q);
  rope_operand(c, k, ki, k_out, ko, layout, q, p.k);
  p.batch = q->shape[0];
  p.seq = q->shape[layout == 0 ? 2 : 1];
  p.head_dim = q->shape[3];
  // cos / sin: [B or 1, S, rd] or [S, rd], contiguous, the dtype of q.
  c.same_dtype(cos, "cos", q, "q");
  c.same_dtype(sin, "sin", q, "q");
  c.same_shape(sin, "sin", cos, "cos");
  c.row_major(cos, "cos");
  c.row_major(sin, "sin");
  if (!c.ok()) return false;
  if (cos->ndim != 2 && cos->ndim != 3) return c.require(false, "tensor 'cos' must be [batch or 1, seq, rotary_dim] or [seq, rotary_dim]");
  const int64_t cb = cos->ndim == 3 ? cos->shape[0] : 1, cs = cos->shape[cos->ndim - 2], rd = cos->shape[cos->ndim - 1];
  if (cs != p.seq || (cb != 1 && cb != p.batch))
    return c.require(false, "tensor 'cos' must be [%lld or 1, %lld, rotary_dim]", static_cast<long long>(p.batch),
                     static_cast<long long>(p.seq));
  if (rd <= 0 || rd % 2 != 0 || rd > p.head_dim)
    return c.require(false, "rotary_dim (last dim of 'cos') = %lld must be even, > 0 and <= head_dim %lld",
                     static_cast<long long>(rd), static_cast<long long>(p.head_dim));
  p.rotary_dim = rd;
  p.cos = kk::data_ptr(cos);
  p.sin = kk::data_ptr(sin);
  p.cs_stride_b = cb == 1 ? 0 : cs * rd;
  p.cs_stride_s = rd;
  return c.all_read();
}

kcpp_status rope_supports(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "LigerRotaryEmbedding");
  lg::RopeParams p;
  rope_args(c, c.find("dq_out") != nullptr, p);
  return c.status();
}

kcpp_status rope_forward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "LigerRotaryEmbedding.forward");
  lg::RopeParams p;
  if (!rope_args(c, false, p)) return c.status();
  return LIGER_RUN(c, lg::rope_forward, p);
}

kcpp_status rope_backward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "LigerRotaryEmbedding.backward");
  lg::RopeParams p;
  if (!rope_args(c, true, p)) return c.status();
  return LIGER_RUN(c, lg::rope_backward, p);
}

// ---- CrossEntropyLoss/1 ------------------------------------------------------------------------

constexpr const char* kReductions[] = {"mean", "sum", "none", nullptr};

// The loss options shared by CrossEntropyLoss/1 and ForCausalLMLoss/1: z-loss, softcap, class
// weights (`weight_name`: "weight" or "class_weight") and token weights, all f32.
struct LossOptions {
  float lse_square_scale = 0.0f, softcap = 0.0f;
  const float* class_weight = nullptr;
  const float* token_weight = nullptr;
};
bool loss_options(kk::Call& c, const char* weight_name, int64_t rows, int64_t v, LossOptions& o) {
  o.lse_square_scale = static_cast<float>(c.real("lse_square_scale", 0.0));
  o.softcap = static_cast<float>(c.real("softcap", 0.0));
  if (!c.ok()) return false;
  if (!std::isfinite(o.lse_square_scale)) return c.require(false, "argument 'lse_square_scale' must be finite");
  if (!(o.softcap >= 0.0f && std::isfinite(o.softcap)))
    return c.require(false, "argument 'softcap' = %g must be >= 0 and finite (0 = off)", static_cast<double>(o.softcap));
  DLTensor* cw = c.tensor(weight_name, false);
  f32_vector(c, cw, weight_name, v);
  if (cw && c.ok()) o.class_weight = static_cast<const float*>(kk::data_ptr(cw));
  DLTensor* tw = c.tensor("token_weight", false);
  f32_vector(c, tw, "token_weight", rows);
  if (tw && c.ok()) o.token_weight = static_cast<const float*>(kk::data_ptr(tw));
  return c.ok();
}

// The outputs and integer inputs both loss layers share: targets (i64 / i32, one per row), loss
// (one value or one per row), lse and bad_targets (optional).  `rows_of` names the tensor whose rows
// the targets count ("logits", "hidden").
struct LossIo {
  const void* targets = nullptr;
  bool targets_i32 = false;
  float *loss = nullptr, *lse = nullptr;
  int32_t* bad_targets = nullptr;
};
bool loss_io(kk::Call& c, const DLTensor* targets, const DLTensor* loss, const DLTensor* lse, const DLTensor* bad,
             int64_t rows, bool per_row_loss, const char* rows_of, LossIo& io) {
  const bool i64 = targets->dtype.code == kDLInt && targets->dtype.bits == 64 && targets->dtype.lanes == 1;
  const bool i32 = targets->dtype.code == kDLInt && targets->dtype.bits == 32 && targets->dtype.lanes == 1;
  if (!i64 && !i32) return c.require(false, "tensor 'targets' must be i64 or i32, is %s", kk::dl_dtype_name(targets->dtype));
  if (kk::numel(targets) != rows)
    return c.require(false, "tensor 'targets' has %lld elements but '%s' has %lld rows",
                     static_cast<long long>(kk::numel(targets)), rows_of, static_cast<long long>(rows));
  c.row_major(targets, "targets");
  io.targets = kk::data_ptr(targets);
  io.targets_i32 = i32;
  f32_vector(c, loss, "loss", per_row_loss ? rows : 1);
  if (c.ok()) io.loss = static_cast<float*>(kk::data_ptr(loss));
  f32_vector(c, lse, "lse", rows);
  if (lse && c.ok()) io.lse = static_cast<float*>(kk::data_ptr(lse));
  if (bad && c.ok()) {
    if (!(bad->dtype.code == kDLInt && bad->dtype.bits == 32 && kk::numel(bad) == 1))
      return c.require(false, "tensor 'bad_targets' must be one i32");
    io.bad_targets = static_cast<int32_t*>(kk::data_ptr(bad));
  }
  return c.ok();
}

bool ce_forward_args(kk::Call& c, lg::CrossEntropyParams& p) {
  c.device_in(kCuda);
  DLTensor* logits = c.tensor("logits");
  DLTensor* targets = c.tensor("targets");
  DLTensor* loss = c.tensor("loss");
  DLTensor* grad = c.tensor("grad", false);
  DLTensor* lse = c.tensor("lse", false);
  DLTensor* bad = c.tensor("bad_targets", false);
  p.ignore_index = c.integer("ignore_index", -100);
  p.label_smoothing = static_cast<float>(c.real("label_smoothing", 0.0));
  p.reduction = static_cast<lg::CEReduction>(c.choice("reduction", 0, kReductions));
  c.float_dtype(logits, "logits", &p.dtype);
  c.rows(logits, "logits", &p.n, &p.v, &p.logits_stride);
  if (!c.ok()) return false;
  LossOptions o;
  if (!loss_options(c, "weight", p.n, p.v, o)) return false;
  p.lse_square_scale = o.lse_square_scale, p.softcap = o.softcap;
  p.class_weight = o.class_weight, p.token_weight = o.token_weight;
  if (p.v == 0) return c.require(false, "tensor 'logits' has no classes (last dim 0)");
  if (!(p.label_smoothing >= 0.0f && p.label_smoothing <= 1.0f))
    return c.require(false, "argument 'label_smoothing' = %g must be in [0, 1]", static_cast<double>(p.label_smoothing));
  p.logits = kk::data_ptr(logits);
  LossIo io;
  if (!loss_io(c, targets, loss, lse, bad, p.n, p.reduction == lg::CEReduction::None, "logits", io)) return false;
  p.targets = io.targets, p.targets_i32 = io.targets_i32, p.loss = io.loss, p.lse = io.lse, p.bad_targets = io.bad_targets;
  if (grad) {
    int64_t gn = 0, gv = 0;
    c.same_dtype(grad, "grad", logits, "logits");
    c.same_shape(grad, "grad", logits, "logits");
    if (c.rows(grad, "grad", &gn, &gv, &p.grad_stride)) p.grad = kk::data_ptr(grad);
    if (c.ok() && p.grad == p.logits && p.grad_stride != p.logits_stride)
      c.require(false, "in-place 'grad' must have the strides of 'logits'");
  } else if (c.ok() && (c.context()->mode & KCPP_MODE_TRAINING)) {
    c.require(false, "missing tensor argument 'grad' (required in training mode: backward needs it)");
  }
  return c.all_read();
}

bool ce_backward_args(kk::Call& c, lg::CEScaleParams& p) {
  c.device_in(kCuda);
  DLTensor* grad = c.tensor("grad");
  DLTensor* dlogits = c.tensor("dlogits");
  int64_t n2 = 0, v2 = 0;
  c.float_dtype(grad, "grad", &p.dtype);
  c.rows(grad, "grad", &p.n, &p.v, &p.grad_stride);
  c.same_dtype(dlogits, "dlogits", grad, "grad");
  c.same_shape(dlogits, "dlogits", grad, "grad");
  c.rows(dlogits, "dlogits", &n2, &v2, &p.dlogits_stride);
  const kcpp_arg* d = c.find("dloss");
  if (!d || d->kind == KCPP_ARG_NONE) {
    c.require(false, "missing argument 'dloss' (a float, or the loss's gradient as an f32 tensor)");
  } else if (d->kind == KCPP_ARG_TENSOR) {
    DLTensor* dl = c.tensor("dloss");
    if (c.ok() && kk::numel(dl) != 1 && kk::numel(dl) != p.n)
      c.require(false, "tensor 'dloss' must have 1 or %lld (rows) elements, has %lld", static_cast<long long>(p.n),
                static_cast<long long>(kk::numel(dl)));
    if (dl && c.ok()) {
      f32_vector(c, dl, "dloss", kk::numel(dl));
      p.dloss = static_cast<const float*>(kk::data_ptr(dl));
      p.per_row = kk::numel(dl) != 1 || p.n == 1;
    }
  } else {
    p.scale = static_cast<float>(c.real("dloss", 1.0));
  }
  if (!c.ok()) return false;
  p.grad = kk::data_ptr(grad);
  p.dlogits = kk::data_ptr(dlogits);
  if (p.grad == p.dlogits && p.grad_stride != p.dlogits_stride) c.require(false, "in-place 'dlogits' must have the strides of 'grad'");
  return c.all_read();
}

kcpp_status ce_supports(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "LigerCrossEntropy");
  if (c.find("dlogits")) {
    lg::CEScaleParams p;
    ce_backward_args(c, p);
  } else {
    lg::CrossEntropyParams p;
    ce_forward_args(c, p);
  }
  return c.status();
}

kcpp_status ce_forward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "LigerCrossEntropy.forward");
  lg::CrossEntropyParams p;
  if (!ce_forward_args(c, p)) return c.status();
#if KCPP_WITH_CUDA
  if (c.on_cuda()) {
    p.workspace = c.workspace(lg::cross_entropy_workspace(p));
    if (!c.ok()) return c.status();
  }
#endif
  return LIGER_RUN(c, lg::cross_entropy, p);
}

kcpp_status ce_backward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "LigerCrossEntropy.backward");
  lg::CEScaleParams p;
  if (!ce_backward_args(c, p)) return c.status();
  // The gradient is already dlogits: nothing to do.
  if (!p.dloss && p.scale == 1.0f && p.grad == p.dlogits) return KCPP_OK;
  return LIGER_RUN(c, lg::cross_entropy_scale, p);
}

// ---- ForCausalLMLoss/1 ---------------------------------------------------------------------------

constexpr const char* kAccumDtypes[] = {"same", "f32", nullptr};

// One 1-dim tensor of `n` elements of `like`'s dtype (bias, dbias).
bool vector_like(kk::Call& c, const DLTensor* t, const char* name, int64_t n, const DLTensor* like, const char* like_name) {
  if (!t || !c.ok()) return c.ok();
  c.same_dtype(t, name, like, like_name);
  if (c.ok() && (t->ndim != 1 || t->shape[0] != n))
    return c.require(false, "tensor '%s' must be [%lld] (the vocabulary)", name, static_cast<long long>(n));
  return c.row_major(t, name);
}

bool flce_forward_args(kk::Call& c, lg::FusedLinearCEParams& p) {
  c.device_in(kCuda);
  DLTensor* hidden = c.tensor("hidden");
  DLTensor* weight = c.tensor("weight");
  DLTensor* bias = c.tensor("bias", false);
  DLTensor* targets = c.tensor("targets");
  DLTensor* loss = c.tensor("loss");
  DLTensor* lse = c.tensor("lse", false);
  DLTensor* dhidden = c.tensor("dhidden", false);
  DLTensor* dweight = c.tensor("dweight", false);
  DLTensor* dbias = c.tensor("dbias", false);
  DLTensor* bad = c.tensor("bad_targets", false);
  p.ignore_index = c.integer("ignore_index", -100);
  p.label_smoothing = static_cast<float>(c.real("label_smoothing", 0.0));
  p.reduction = static_cast<lg::CEReduction>(c.choice("reduction", 0, kReductions));
  p.grad_scale = static_cast<float>(c.real("grad_scale", 1.0));
  p.accumulate = c.integer("accumulate", 0) != 0;
  p.accum_f32 = c.choice("accum_dtype", 0, kAccumDtypes) == 1;
  p.chunk_rows = c.integer("chunk_rows", 0);
  if (!c.ok()) return false;
  c.float_dtype(hidden, "hidden", &p.dtype);
  c.rows(hidden, "hidden", &p.n, &p.h, &p.hidden_stride);
  c.same_dtype(weight, "weight", hidden, "hidden");
  c.ndim(weight, "weight", 2);
  int64_t wh = 0;
  c.rows(weight, "weight", &p.v, &wh, &p.weight_stride);
  if (!c.ok()) return false;
  if (wh != p.h) return c.require(false, "tensor 'weight' is [%lld, %lld] but 'hidden' rows have %lld elements",
                                  static_cast<long long>(p.v), static_cast<long long>(wh), static_cast<long long>(p.h));
  if (p.v == 0 || p.h == 0) return c.require(false, "tensor 'weight' is empty (vocabulary or hidden size 0)");
  if (!(p.label_smoothing >= 0.0f && p.label_smoothing <= 1.0f))
    return c.require(false, "argument 'label_smoothing' = %g must be in [0, 1]", static_cast<double>(p.label_smoothing));
  if (p.chunk_rows < 0) return c.require(false, "argument 'chunk_rows' = %lld must be >= 0", static_cast<long long>(p.chunk_rows));
  p.hidden = kk::data_ptr(hidden);
  p.weight = kk::data_ptr(weight);
  LossOptions o;
  if (!loss_options(c, "class_weight", p.n, p.v, o)) return false;
  p.lse_square_scale = o.lse_square_scale, p.softcap = o.softcap;
  p.class_weight = o.class_weight, p.token_weight = o.token_weight;
  vector_like(c, bias, "bias", p.v, hidden, "hidden");
  if (bias && c.ok()) p.bias = kk::data_ptr(bias);
  LossIo io;
  if (!loss_io(c, targets, loss, lse, bad, p.n, p.reduction == lg::CEReduction::None, "hidden", io)) return false;
  p.targets = io.targets, p.targets_i32 = io.targets_i32, p.loss = io.loss, p.lse = io.lse, p.bad_targets = io.bad_targets;
  const bool training = (c.context()->mode & KCPP_MODE_TRAINING) != 0;
  if (dhidden) {
    int64_t dn = 0, dh = 0;
    c.same_dtype(dhidden, "dhidden", hidden, "hidden");
    c.same_shape(dhidden, "dhidden", hidden, "hidden");
    if (c.rows(dhidden, "dhidden", &dn, &dh, &p.dhidden_stride)) p.dhidden = kk::data_ptr(dhidden);
  } else if (c.ok() && training && p.reduction != lg::CEReduction::None) {
    c.require(false, "missing tensor argument 'dhidden' (required in training mode: the gradients are computed by forward)");
  }
  if (dweight) {
    c.same_dtype(dweight, "dweight", weight, "weight");
    c.same_shape(dweight, "dweight", weight, "weight");
    c.row_major(dweight, "dweight");
    if (c.ok()) p.dweight = kk::data_ptr(dweight);
  }
  if (dbias && c.ok() && !bias) return c.require(false, "tensor 'dbias' given without 'bias'");
  vector_like(c, dbias, "dbias", p.v, hidden, "hidden");
  if (dbias && c.ok()) p.dbias = kk::data_ptr(dbias);
  if (c.ok() && (dhidden || dweight || dbias) && p.reduction == lg::CEReduction::None)
    return c.fail(KCPP_ERROR_UNSUPPORTED,
                  "reduction 'none' with gradients: they would need each row's upstream gradient (the host runs the reference)");
  if (c.ok())
    if (const char* e = lg::fused_linear_ce_check(p)) c.require(false, "%s", e);
  return c.all_read();
}

bool flce_backward_args(kk::Call& c, lg::FusedLinearCEScaleParams& p) {
  c.device_in(kCuda);
  DLTensor* dhidden = c.tensor("dhidden");
  DLTensor* dweight = c.tensor("dweight", false);
  DLTensor* dbias = c.tensor("dbias", false);
  c.float_dtype(dhidden, "dhidden", &p.dtype);
  c.rows(dhidden, "dhidden", &p.n, &p.h, &p.dhidden_stride);
  if (dweight) {
    int64_t wh = 0, ws = 0;
    c.same_dtype(dweight, "dweight", dhidden, "dhidden");
    c.ndim(dweight, "dweight", 2);
    c.row_major(dweight, "dweight");
    c.rows(dweight, "dweight", &p.v, &wh, &ws);
    if (c.ok() && wh != p.h) c.require(false, "tensor 'dweight' rows have %lld elements but 'dhidden' rows %lld",
                                       static_cast<long long>(wh), static_cast<long long>(p.h));
    if (c.ok()) p.dweight = kk::data_ptr(dweight);
  }
  if (dbias) {
    c.same_dtype(dbias, "dbias", dhidden, "dhidden");
    c.row_major(dbias, "dbias");
    if (c.ok() && p.v && kk::numel(dbias) != p.v)
      c.require(false, "tensor 'dbias' has %lld elements but 'dweight' %lld rows", static_cast<long long>(kk::numel(dbias)),
                static_cast<long long>(p.v));
    if (c.ok()) {
      p.v = kk::numel(dbias);
      p.dbias = kk::data_ptr(dbias);
    }
  }
  if (p.v == 0) p.v = 1;  // neither dweight nor dbias: only dhidden is scaled
  const kcpp_arg* d = c.find("dloss");
  if (!d || d->kind == KCPP_ARG_NONE) {
    c.require(false, "missing argument 'dloss' (a float, or the loss's gradient as one f32 on the device)");
  } else if (d->kind == KCPP_ARG_TENSOR) {
    DLTensor* dl = c.tensor("dloss");
    f32_vector(c, dl, "dloss", 1);
    if (dl && c.ok()) p.dloss = static_cast<const float*>(kk::data_ptr(dl));
  } else {
    p.scale = static_cast<float>(c.real("dloss", 1.0));
  }
  if (!c.ok()) return false;
  p.dhidden = kk::data_ptr(dhidden);
  return c.all_read();
}

kcpp_status flce_supports(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "LigerFusedLinearCrossEntropy");
  if (c.find("dloss")) {
    lg::FusedLinearCEScaleParams p;
    flce_backward_args(c, p);
  } else {
    lg::FusedLinearCEParams p;
    flce_forward_args(c, p);
  }
  return c.status();
}

kcpp_status flce_forward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "LigerFusedLinearCrossEntropy.forward");
  lg::FusedLinearCEParams p;
  if (!flce_forward_args(c, p)) return c.status();
  p.workspace = c.workspace(lg::fused_linear_ce_workspace(p, c.on_cuda()));
  if (!c.ok()) return c.status();
  return LIGER_RUN(c, lg::fused_linear_ce, p);
}

kcpp_status flce_backward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "LigerFusedLinearCrossEntropy.backward");
  lg::FusedLinearCEScaleParams p;
  if (!flce_backward_args(c, p)) return c.status();
  if (!p.dloss && p.scale == 1.0f) return KCPP_OK;  // the gradients are already final
  return LIGER_RUN(c, lg::fused_linear_ce_scale, p);
}

// ---- the table -------------------------------------------------------------------------------------

constexpr uint32_t kDevices = KCPP_DEVICE_BIT(kDLCPU) | (kCuda ? KCPP_DEVICE_BIT(kDLCUDA) : 0u);
constexpr uint32_t kModes = KCPP_MODE_INFERENCE | KCPP_MODE_TRAINING | KCPP_MODE_GRAPH;

const kcpp_layer kLayers[] = {
    {sizeof(kcpp_layer), kModes, kDevices, 0, "LigerRMSNorm", "RMSNorm/1",
     "RMSNorm (llama / gemma / none casting, offset), one pass; saves rstd; deterministic dweight",
     rms_norm_supports<false>, rms_norm_forward<false>, rms_norm_backward<false>},
    {sizeof(kcpp_layer), kModes, kDevices, 0, "LigerAddRMSNorm", "AddRMSNorm/1",
     "residual add + RMSNorm in one pass (residual_out written, may overwrite x or residual); backward adds dresidual_out",
     rms_norm_supports<true>, rms_norm_forward<true>, rms_norm_backward<true>},
    {sizeof(kcpp_layer), kModes, kDevices, 0, "LigerLayerNorm", "LayerNorm/1",
     "LayerNorm (weight, optional bias), two-pass statistics in f32; saves mean and rstd; deterministic dweight / dbias",
     layer_norm_supports, layer_norm_forward, layer_norm_backward},
    {sizeof(kcpp_layer), kModes, kDevices, 0, "LigerGLU", "GLU/1",
     "act(gate) * up for silu / gelu / gelu_tanh / quick_gelu; backward recomputes act, may overwrite gate and up",
     glu_supports, glu_forward, glu_backward},
    {sizeof(kcpp_layer), kModes, kDevices, 0, "LigerRotaryEmbedding", "rotary_pos_emb/1",
     "RoPE on q and k in one launch, rotate-half or interleaved, partial rotary_dim, any head/seq strides, in place",
     rope_supports, rope_forward, rope_backward},
    {sizeof(kcpp_layer), kModes, kDevices, 0, "LigerCrossEntropy", "CrossEntropyLoss/1",
     "cross-entropy with its gradient in one pass (in place over the logits): ignore_index, label smoothing, z-loss, "
     "softcap, class and token weights",
     ce_supports, ce_forward, ce_backward},
    {sizeof(kcpp_layer), kModes, kDevices, 0, "LigerFusedLinearCrossEntropy", "ForCausalLMLoss/1",
     "lm_head GEMM + cross-entropy in row chunks (cuBLAS / OpenBLAS): loss and the gradients of hidden, weight and bias "
     "without the N x V logits",
     flce_supports, flce_forward, flce_backward},
};

const kcpp_package kPackage = {
    .struct_size = sizeof(kcpp_package),
    .abi_version = KCPP_ABI_VERSION,
    .name = KCPP_PACKAGE_NAME,
    .version = KCPP_PACKAGE_VERSION,
    .layers = kLayers,
    .num_layers = static_cast<int32_t>(sizeof kLayers / sizeof kLayers[0]),
    .num_ops = 0,
    .ops = nullptr,
};

}  // namespace

extern "C" KCPP_EXPORT const kcpp_package* kcpp_package_v1(void) { return &kPackage; }
