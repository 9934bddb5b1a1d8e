// Package "mamba": the ABI table (include/kcpp/abi.h) over selective_scan.h and causal_conv1d.h.
//
//   SelectiveScan          SelectiveScan/1          selective_scan/selective_scan.h   forward, backward
//   SelectiveStateUpdate   SelectiveStateUpdate/1   selective_scan/selective_scan.h   inference
//   CausalConv1d           CausalConv1d/1           causal_conv1d/causal_conv1d.h     forward, backward
//   CausalConv1dUpdate     CausalConv1dUpdate/1     causal_conv1d/causal_conv1d.h     inference
//
// The named arguments are those of docs/contracts/SelectiveScan.md, SelectiveStateUpdate.md and
// CausalConv1d.md.  supports() runs the same checks as the call without running it; an argument that
// the call does not read (misspelt, or meaningless without another) is refused, naming it
// (Call::all_read).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>

#include "causal_conv1d/causal_conv1d.h"
#include "kcpp/abi.h"
#include "kcpp/kernel/abi_args.h"
#include "selective_scan/selective_scan.h"

#ifndef KCPP_WITH_CUDA
#define KCPP_WITH_CUDA 0
#endif

namespace {

namespace kk = kcpp::kernel;
namespace km = kcpp::mamba;

constexpr bool kCuda = KCPP_WITH_CUDA != 0;

// A floating tensor of dtype `dt`, the dtype of the argument `of`.
bool dtype_is(kk::Call& c, const DLTensor* t, const char* name, kk::DType dt, const char* of) {
  kk::DType got = dt;
  if (!c.float_dtype(t, name, &got)) return false;
  if (got != dt)
    return c.require(false, "tensor '%s' is %s; expected %s (the dtype of '%s')", name, kk::dl_dtype_name(t->dtype),
                     kk::dtype_name(dt), of);
  return true;
}

// A [B, rows, L] tensor of dtype `dt` (that of `of`) with L contiguous (batch and row strides free).
bool seq(kk::Call& c, const DLTensor* t, const char* name, kk::DType dt, const char* of, int64_t b, int64_t rows, int64_t l,
         km::Seq& s) {
  if (!t || !c.ok()) return c.ok();
  if (!dtype_is(c, t, name, dt, of)) return false;
  if (!c.shape_is(t, name, {b, rows, l})) return false;
  if (l > 1 && kk::stride(t, 2) != 1)
    return c.fail(KCPP_ERROR_UNSUPPORTED, "tensor '%s': the sequence (last) dim must be contiguous (stride %lld)", name,
                  static_cast<long long>(kk::stride(t, 2)));
  s.data = kk::data_ptr(t);
  s.sb = kk::stride(t, 0), s.sr = kk::stride(t, 1);
  return true;
}

// B or C: [B, N, L] (one group) or [B, G, N, L], dtype `dt`, L contiguous.  Sets *groups from the first.
bool group_seq(kk::Call& c, const DLTensor* t, const char* name, kk::DType dt, int64_t b, int64_t n, int64_t l, int64_t* groups,
               km::GroupSeq& s) {
  if (!t || !c.ok()) return c.ok();
  if (!dtype_is(c, t, name, dt, "u")) return false;
  if (t->ndim != 3 && t->ndim != 4) {
    char sh[128];
    return c.require(false, "tensor '%s' has shape %s; expected [B, N, L] or [B, G, N, L]", name,
                     kk::Call::shape_str(t, sh, sizeof sh));
  }
  if (*groups == 0) *groups = t->ndim == 4 ? t->shape[1] : 1;
  if (t->ndim == 3 && *groups != 1)
    return c.require(false, "tensor '%s' has no group dim but 'B' has %lld groups", name, static_cast<long long>(*groups));
  const bool shape_ok = t->ndim == 4 ? c.shape_is(t, name, {b, *groups, n, l}) : c.shape_is(t, name, {b, n, l});
  if (!shape_ok) return false;
  const int32_t ld = t->ndim - 1;
  if (l > 1 && kk::stride(t, ld) != 1)
    return c.fail(KCPP_ERROR_UNSUPPORTED, "tensor '%s': the sequence (last) dim must be contiguous (stride %lld)", name,
                  static_cast<long long>(kk::stride(t, ld)));
  s.data = kk::data_ptr(t);
  s.sb = kk::stride(t, 0);
  s.sg = t->ndim == 4 ? kk::stride(t, 1) : 0;
  s.sn = kk::stride(t, ld - 1);
  return true;
}

// An f32 tensor of the given shape, contiguous.
float* f32_tensor(kk::Call& c, const DLTensor* t, const char* name, std::initializer_list<int64_t> dims) {
  if (!t || !c.ok()) return nullptr;
  if (t->dtype.code != kDLFloat || t->dtype.bits != 32 || t->dtype.lanes != 1) {
    c.require(false, "tensor '%s' must be f32, is %s", name, kk::dl_dtype_name(t->dtype));
    return nullptr;
  }
  if (!c.shape_is(t, name, dims)) return nullptr;
  if (kk::numel(t) > 0 && !c.row_major(t, name)) return nullptr;
  return static_cast<float*>(kk::data_ptr(t));
}

bool distinct(kk::Call& c, const void* out, const char* name, std::initializer_list<const void*> others) {
  if (!c.ok() || !out) return c.ok();
  for (const void* o : others)
    if (o == out) return c.require(false, "tensor '%s' must not overlap an input or another output", name);
  return true;
}

// Optional float `bc_rms_eps`: present turns the B / C norm on.
bool bc_norm_arg(kk::Call& c, bool* on, float* eps) {
  const kcpp_arg* a = c.find("bc_rms_eps");
  *on = a && a->kind != KCPP_ARG_NONE;
  if (!*on) return c.ok();
  const double e = c.real("bc_rms_eps", 1e-6);
  if (c.ok() && !(std::isfinite(e) && e >= 0))
    return c.require(false, "argument 'bc_rms_eps' is %g; expected a finite value >= 0", e);
  *eps = static_cast<float>(e);
  return c.ok();
}

bool flag(kk::Call& c, const char* name, bool* out) {
  const int64_t v = c.integer(name, 0);
  if (c.ok() && v != 0 && v != 1)
    return c.require(false, "argument '%s' is %lld; expected 0 or 1", name, static_cast<long long>(v));
  *out = v == 1;
  return c.ok();
}

// ---- SelectiveScan/1

bool scan_args(kk::Call& c, bool bwd, km::SelectiveScanParams& p) {
  c.device_in(kCuda);
  DLTensor* u = c.tensor("u");
  DLTensor* delta = c.tensor("delta");
  DLTensor* A = c.tensor("A");
  DLTensor* B = c.tensor("B");
  DLTensor* C = c.tensor("C");
  DLTensor* D = c.tensor("D", false);
  DLTensor* z = c.tensor("z", false);
  DLTensor* bias = c.tensor("delta_bias", false);
  DLTensor* states = c.tensor("states", bwd);
  if (!c.ok()) return false;
  c.float_dtype(u, "u", &p.dtype);
  if (!c.ndim(u, "u", 3) || !c.ndim(A, "A", 2)) return false;
  p.batch = u->shape[0], p.dim = u->shape[1], p.seqlen = u->shape[2], p.dstate = A->shape[1];
  if (p.dstate < 1)
    return c.require(false, "tensor 'A' has %lld columns; the state size N must be >= 1", static_cast<long long>(p.dstate));
  const int64_t b = p.batch, d = p.dim, l = p.seqlen, n = p.dstate;
  seq(c, u, "u", p.dtype, "u", b, d, l, p.u);
  seq(c, delta, "delta", p.dtype, "u", b, d, l, p.delta);
  p.A = f32_tensor(c, A, "A", {d, n});
  int64_t groups = 0;
  group_seq(c, B, "B", p.dtype, b, n, l, &groups, p.B);
  group_seq(c, C, "C", p.dtype, b, n, l, &groups, p.C);
  if (!c.ok()) return false;
  if (groups < 1 || d % groups != 0)
    return c.require(false, "B and C have %lld groups, which do not divide the %lld channels", static_cast<long long>(groups),
                     static_cast<long long>(d));
  p.groups = groups;
  if (D) p.D = f32_tensor(c, D, "D", {d});
  if (z) seq(c, z, "z", p.dtype, "u", b, d, l, p.z);
  if (bias) p.delta_bias = f32_tensor(c, bias, "delta_bias", {d});
  flag(c, "delta_softplus", &p.delta_softplus);
  bc_norm_arg(c, &p.bc_norm, &p.bc_eps);
  if (states) p.states = f32_tensor(c, states, "states", {b, d, km::state_chunks(l), n});
  if (!c.ok()) return false;
  const std::initializer_list<const void*> ins = {p.u.data, p.delta.data, p.A, p.B.data, p.C.data, p.D, p.z.data, p.delta_bias};
  if (!bwd) {
    DLTensor* out = c.tensor("out");
    DLTensor* last = c.tensor("last_state", false);
    seq(c, out, "out", p.dtype, "u", b, d, l, p.out);
    if (last) p.last_state = f32_tensor(c, last, "last_state", {b, d, n});
    if (c.ok() && !states && (c.context()->mode & KCPP_MODE_TRAINING))
      return c.require(false, "missing tensor argument 'states' (required in training mode: backward needs it)");
    const bool any = b * d * l > 0;
    if (any) distinct(c, p.out.data, "out", ins);
    if (any) distinct(c, p.states, "states", ins), distinct(c, p.states, "states", {p.out.data});
    if (b * d > 0) distinct(c, p.last_state, "last_state", ins), distinct(c, p.last_state, "last_state", {p.out.data, p.states});
    return c.all_read();
  }
  DLTensor* dout = c.tensor("dout");
  DLTensor* du = c.tensor("du");
  DLTensor* ddelta = c.tensor("ddelta");
  DLTensor* dA = c.tensor("dA");
  DLTensor* dB = c.tensor("dB");
  DLTensor* dC = c.tensor("dC");
  DLTensor* dD = c.tensor("dD", D != nullptr);
  DLTensor* dz = c.tensor("dz", z != nullptr);
  DLTensor* dbias = c.tensor("ddelta_bias", bias != nullptr);
  if (!c.ok()) return false;
  if (dD && !D) return c.require(false, "tensor 'dD' is given but 'D' is not");
  if (dz && !z) return c.require(false, "tensor 'dz' is given but 'z' is not");
  if (dbias && !bias) return c.require(false, "tensor 'ddelta_bias' is given but 'delta_bias' is not");
  seq(c, dout, "dout", p.dtype, "u", b, d, l, p.dout);
  seq(c, du, "du", p.dtype, "u", b, d, l, p.du);
  seq(c, ddelta, "ddelta", p.dtype, "u", b, d, l, p.ddelta);
  p.dA = f32_tensor(c, dA, "dA", {d, n});
  group_seq(c, dB, "dB", p.dtype, b, n, l, &groups, p.dB);
  group_seq(c, dC, "dC", p.dtype, b, n, l, &groups, p.dC);
  if (dD) p.dD = f32_tensor(c, dD, "dD", {d});
  if (dz) seq(c, dz, "dz", p.dtype, "u", b, d, l, p.dz);
  if (dbias) p.ddelta_bias = f32_tensor(c, dbias, "ddelta_bias", {d});
  if (!c.ok()) return false;
  const bool any = b * d * l > 0;
  const std::initializer_list<const void*> all_in = {p.u.data, p.delta.data, p.A,          p.B.data, p.C.data,
                                                     p.D,      p.z.data,     p.delta_bias, p.states, p.dout.data};
  if (any) {
    for (auto [ptr, name] : {std::pair<const void*, const char*>{p.du.data, "du"},
                             {p.ddelta.data, "ddelta"},
                             {p.dB.data, "dB"},
                             {p.dC.data, "dC"},
                             {p.dz.data, "dz"}})
      distinct(c, ptr, name, all_in);
    distinct(c, p.du.data, "du", {p.ddelta.data, p.dB.data, p.dC.data, p.dz.data});
    distinct(c, p.ddelta.data, "ddelta", {p.dB.data, p.dC.data, p.dz.data});
    distinct(c, p.dB.data, "dB", {p.dC.data, p.dz.data});
    distinct(c, p.dC.data, "dC", {p.dz.data});
  }
  if (d > 0) {
    for (auto [ptr, name] : {std::pair<const void*, const char*>{p.dA, "dA"}, {p.dD, "dD"}, {p.ddelta_bias, "ddelta_bias"}})
      distinct(c, ptr, name, all_in);
    distinct(c, p.dA, "dA", {p.dD, p.ddelta_bias});
    distinct(c, p.dD, "dD", {p.ddelta_bias});
  }
  return c.all_read();
}

// On CUDA, the kernels' limits (N <= 16) are UNSUPPORTED: the host runs the reference for that call.
bool scan_cuda_takes(kk::Call& c, const km::SelectiveScanParams& p) {
#if KCPP_WITH_CUDA
  if (c.ok() && c.on_cuda())
    if (const char* why = km::selective_scan_cuda_unsupported(p)) return c.fail(KCPP_ERROR_UNSUPPORTED, "%s", why);
#endif
  (void)p;
  return c.ok();
}

kcpp_status scan_supports(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "SelectiveScan");
  km::SelectiveScanParams p;
  if (scan_args(c, c.find("dout") != nullptr, p)) scan_cuda_takes(c, p);
  return c.status();
}

kcpp_status scan_forward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "SelectiveScan.forward");
  km::SelectiveScanParams p;
  if (!scan_args(c, false, p) || !scan_cuda_takes(c, p)) return c.status();
#if KCPP_WITH_CUDA
  if (c.on_cuda()) return c.finish(km::selective_scan_forward_cuda(p, static_cast<cudaStream_t>(ctx->stream)));
#endif
  return c.finish(km::selective_scan_forward_cpu(p));
}

kcpp_status scan_backward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "SelectiveScan.backward");
  km::SelectiveScanParams p;
  if (!scan_args(c, true, p) || !scan_cuda_takes(c, p)) return c.status();
#if KCPP_WITH_CUDA
  if (c.on_cuda()) {
    const size_t bytes = km::selective_scan_backward_workspace(p);
    if (bytes > 0) p.workspace = c.workspace(bytes), p.workspace_bytes = bytes;
    if (!c.ok()) return c.status();
    return c.finish(km::selective_scan_backward_cuda(p, static_cast<cudaStream_t>(ctx->stream)));
  }
#endif
  return c.finish(km::selective_scan_backward_cpu(p));
}

// ---- SelectiveStateUpdate/1

// A [B, D] tensor of dtype `dt`, any strides.
bool matrix(kk::Call& c, const DLTensor* t, const char* name, kk::DType dt, int64_t b, int64_t d, int64_t* sb, int64_t* sd) {
  if (!t || !c.ok()) return c.ok();
  if (!dtype_is(c, t, name, dt, "x")) return false;
  if (!c.shape_is(t, name, {b, d})) return false;
  *sb = kk::stride(t, 0), *sd = kk::stride(t, 1);
  return true;
}

// B or C of one step: [B, N] or [B, G, N], N contiguous.
bool step_bc(kk::Call& c, const DLTensor* t, const char* name, kk::DType dt, int64_t b, int64_t n, int64_t* groups, int64_t* sb,
             int64_t* sg) {
  if (!t || !c.ok()) return c.ok();
  if (!dtype_is(c, t, name, dt, "x")) return false;
  if (t->ndim != 2 && t->ndim != 3) {
    char sh[128];
    return c.require(false, "tensor '%s' has shape %s; expected [B, N] or [B, G, N]", name,
                     kk::Call::shape_str(t, sh, sizeof sh));
  }
  if (*groups == 0) *groups = t->ndim == 3 ? t->shape[1] : 1;
  if (t->ndim == 2 && *groups != 1)
    return c.require(false, "tensor '%s' has no group dim but 'B' has %lld groups", name, static_cast<long long>(*groups));
  const bool shape_ok = t->ndim == 3 ? c.shape_is(t, name, {b, *groups, n}) : c.shape_is(t, name, {b, n});
  if (!shape_ok) return false;
  if (n > 1 && kk::stride(t, t->ndim - 1) != 1)
    return c.fail(KCPP_ERROR_UNSUPPORTED, "tensor '%s': the state dim N must be contiguous", name);
  *sb = kk::stride(t, 0);
  *sg = t->ndim == 3 ? kk::stride(t, 1) : 0;
  return true;
}

bool update_args(kk::Call& c, km::StateUpdateParams& p) {
  c.device_in(kCuda);
  DLTensor* state = c.tensor("state");
  DLTensor* x = c.tensor("x");
  DLTensor* dt = c.tensor("dt");
  DLTensor* A = c.tensor("A");
  DLTensor* B = c.tensor("B");
  DLTensor* C = c.tensor("C");
  DLTensor* D = c.tensor("D", false);
  DLTensor* z = c.tensor("z", false);
  DLTensor* bias = c.tensor("dt_bias", false);
  DLTensor* out = c.tensor("out");
  if (!c.ok()) return false;
  c.float_dtype(x, "x", &p.dtype);
  if (!c.ndim(x, "x", 2) || !c.ndim(A, "A", 2)) return false;
  p.batch = x->shape[0], p.dim = x->shape[1], p.dstate = A->shape[1];
  if (p.dstate < 1)
    return c.require(false, "tensor 'A' has %lld columns; the state size N must be >= 1", static_cast<long long>(p.dstate));
  const int64_t b = p.batch, d = p.dim, n = p.dstate;
  matrix(c, x, "x", p.dtype, b, d, &p.x_sb, &p.x_sd);
  p.x = kk::data_ptr(x);
  matrix(c, dt, "dt", p.dtype, b, d, &p.dt_sb, &p.dt_sd);
  p.dt = kk::data_ptr(dt);
  p.A = f32_tensor(c, A, "A", {d, n});
  if (!c.ok()) return false;
  if (state->dtype.code != kDLFloat || state->dtype.bits != 32 || state->dtype.lanes != 1)
    return c.require(false, "tensor 'state' must be f32, is %s", kk::dl_dtype_name(state->dtype));
  if (!c.shape_is(state, "state", {b, d, n})) return false;
  if (n > 1 && kk::stride(state, 2) != 1)
    return c.fail(KCPP_ERROR_UNSUPPORTED, "tensor 'state': the state dim N must be contiguous");
  p.state = static_cast<float*>(kk::data_ptr(state));
  p.state_sb = kk::stride(state, 0), p.state_sd = kk::stride(state, 1);
  int64_t groups = 0;
  step_bc(c, B, "B", p.dtype, b, n, &groups, &p.B_sb, &p.B_sg);
  step_bc(c, C, "C", p.dtype, b, n, &groups, &p.C_sb, &p.C_sg);
  if (!c.ok()) return false;
  if (groups < 1 || d % groups != 0)
    return c.require(false, "B and C have %lld groups, which do not divide the %lld channels", static_cast<long long>(groups),
                     static_cast<long long>(d));
  p.groups = groups;
  p.B = kk::data_ptr(B), p.C = kk::data_ptr(C);
  if (D) p.D = f32_tensor(c, D, "D", {d});
  if (z) matrix(c, z, "z", p.dtype, b, d, &p.z_sb, &p.z_sd), p.z = kk::data_ptr(z);
  if (bias) p.dt_bias = f32_tensor(c, bias, "dt_bias", {d});
  flag(c, "dt_softplus", &p.dt_softplus);
  bc_norm_arg(c, &p.bc_norm, &p.bc_eps);
  matrix(c, out, "out", p.dtype, b, d, &p.out_sb, &p.out_sd);
  p.out = kk::data_ptr(out);
  if (c.ok() && b * d > 0) {
    distinct(c, p.out, "out", {p.x, p.dt, p.A, p.B, p.C, p.D, p.z, p.dt_bias, p.state});
    distinct(c, p.state, "state", {p.x, p.dt, p.A, p.B, p.C, p.D, p.z, p.dt_bias});
  }
  return c.all_read();
}

kcpp_status update_supports(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "SelectiveStateUpdate");
  km::StateUpdateParams p;
  update_args(c, p);
  return c.status();
}

kcpp_status update_forward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "SelectiveStateUpdate.forward");
  km::StateUpdateParams p;
  if (!update_args(c, p)) return c.status();
#if KCPP_WITH_CUDA
  if (c.on_cuda()) return c.finish(km::selective_state_update_cuda(p, static_cast<cudaStream_t>(ctx->stream)));
#endif
  return c.finish(km::selective_state_update_cpu(p));
}

// ---- CausalConv1d/1, CausalConv1dUpdate/1

bool activation_arg(kk::Call& c, bool* silu) {
  static const char* const kChoices[] = {"none", "silu", "swish", nullptr};
  const int a = c.choice("activation", 0, kChoices);
  *silu = a == 1 || a == 2;
  return c.ok();
}

// weight [D, W] and the optional bias [D], of dtype `dt`, contiguous.
bool conv_weights(kk::Call& c, const DLTensor* w, const DLTensor* bias, kk::DType dt, int64_t d, int64_t* width) {
  if (!c.ok()) return false;
  if (!dtype_is(c, w, "weight", dt, "x") || !c.ndim(w, "weight", 2)) return false;
  *width = w->shape[1];
  if (*width < 1) return c.require(false, "tensor 'weight' has width %lld; expected >= 1", static_cast<long long>(*width));
  if (!c.shape_is(w, "weight", {d, *width}) || (kk::numel(w) > 0 && !c.row_major(w, "weight"))) return false;
  if (bias) {
    c.same_dtype(bias, "bias", w, "weight");
    if (!c.shape_is(bias, "bias", {d}) || (d > 1 && !c.row_major(bias, "bias"))) return false;
  }
#if KCPP_WITH_CUDA
  if (c.ok() && c.on_cuda() && *width > km::kConvMaxWidthCuda)
    return c.fail(KCPP_ERROR_UNSUPPORTED, "width %lld: the CUDA kernels take widths up to %lld", static_cast<long long>(*width),
                  static_cast<long long>(km::kConvMaxWidthCuda));
#endif
  return c.ok();
}

bool conv_args(kk::Call& c, bool bwd, km::CausalConv1dParams& p) {
  c.device_in(kCuda);
  DLTensor* x = c.tensor("x");
  DLTensor* w = c.tensor("weight");
  DLTensor* bias = c.tensor("bias", false);
  if (!c.ok()) return false;
  c.float_dtype(x, "x", &p.dtype);
  if (!c.ndim(x, "x", 3)) return false;
  p.batch = x->shape[0], p.dim = x->shape[1], p.seqlen = x->shape[2];
  const int64_t b = p.batch, d = p.dim, l = p.seqlen;
  seq(c, x, "x", p.dtype, "x", b, d, l, p.x);
  conv_weights(c, w, bias, p.dtype, d, &p.width);
  activation_arg(c, &p.silu);
  if (!c.ok()) return false;
  p.weight = kk::data_ptr(w);
  p.bias = bias ? kk::data_ptr(bias) : nullptr;
  const bool any = b * d * l > 0;
  if (!bwd) {
    seq(c, c.tensor("out"), "out", p.dtype, "x", b, d, l, p.out);
    if (any) distinct(c, p.out.data, "out", {p.x.data, p.weight, p.bias});
    return c.all_read();
  }
  DLTensor* dout = c.tensor("dout");
  DLTensor* dx = c.tensor("dx");
  DLTensor* dw = c.tensor("dweight");
  DLTensor* db = c.tensor("dbias", false);
  if (!c.ok()) return false;
  if (db && !bias) return c.require(false, "tensor 'dbias' is given but 'bias' is not");
  seq(c, dout, "dout", p.dtype, "x", b, d, l, p.dout);
  seq(c, dx, "dx", p.dtype, "x", b, d, l, p.dx);
  c.same_dtype(dw, "dweight", w, "weight");
  if (!c.shape_is(dw, "dweight", {d, p.width}) || (kk::numel(dw) > 0 && !c.row_major(dw, "dweight"))) return false;
  p.dweight = kk::data_ptr(dw);
  if (db) {
    c.same_dtype(db, "dbias", w, "weight");
    if (!c.shape_is(db, "dbias", {d}) || (d > 1 && !c.row_major(db, "dbias"))) return false;
    p.dbias = kk::data_ptr(db);
  }
  const std::initializer_list<const void*> ins = {p.x.data, p.weight, p.bias, p.dout.data};
  if (any) distinct(c, p.dx.data, "dx", ins), distinct(c, p.dx.data, "dx", {p.dweight, p.dbias});
  if (d > 0)
    distinct(c, p.dweight, "dweight", ins), distinct(c, p.dbias, "dbias", ins), distinct(c, p.dweight, "dweight", {p.dbias});
  return c.all_read();
}

kcpp_status conv_supports(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "CausalConv1d");
  km::CausalConv1dParams p;
  conv_args(c, c.find("dout") != nullptr, p);
  return c.status();
}

kcpp_status conv_forward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "CausalConv1d.forward");
  km::CausalConv1dParams p;
  if (!conv_args(c, false, p)) return c.status();
#if KCPP_WITH_CUDA
  if (c.on_cuda()) return c.finish(km::causal_conv1d_forward_cuda(p, static_cast<cudaStream_t>(ctx->stream)));
#endif
  return c.finish(km::causal_conv1d_forward_cpu(p));
}

kcpp_status conv_backward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "CausalConv1d.backward");
  km::CausalConv1dParams p;
  if (!conv_args(c, true, p)) return c.status();
#if KCPP_WITH_CUDA
  if (c.on_cuda()) return c.finish(km::causal_conv1d_backward_cuda(p, static_cast<cudaStream_t>(ctx->stream)));
#endif
  return c.finish(km::causal_conv1d_backward_cpu(p));
}

// x / out [B, D] or [B, D, S], any strides.
bool step_seq(kk::Call& c, const DLTensor* t, const char* name, kk::DType dt, int64_t b, int64_t d, int64_t s, int32_t ndim,
              int64_t* sb, int64_t* sd, int64_t* sl) {
  if (!t || !c.ok()) return c.ok();
  if (!dtype_is(c, t, name, dt, "x")) return false;
  if (ndim == 2 ? !c.shape_is(t, name, {b, d}) : !c.shape_is(t, name, {b, d, s})) return false;
  *sb = kk::stride(t, 0), *sd = kk::stride(t, 1), *sl = ndim == 3 ? kk::stride(t, 2) : 1;
  return true;
}

bool conv_update_args(kk::Call& c, km::ConvUpdateParams& p) {
  c.device_in(kCuda);
  DLTensor* x = c.tensor("x");
  DLTensor* state = c.tensor("conv_state");
  DLTensor* w = c.tensor("weight");
  DLTensor* bias = c.tensor("bias", false);
  DLTensor* out = c.tensor("out");
  if (!c.ok()) return false;
  c.float_dtype(x, "x", &p.dtype);
  if (!c.ok()) return false;
  if (x->ndim != 2 && x->ndim != 3) {
    char sh[128];
    return c.require(false, "tensor 'x' has shape %s; expected [B, D] or [B, D, S]", kk::Call::shape_str(x, sh, sizeof sh));
  }
  p.batch = x->shape[0], p.dim = x->shape[1], p.seqlen = x->ndim == 3 ? x->shape[2] : 1;
  const int64_t b = p.batch, d = p.dim;
  step_seq(c, x, "x", p.dtype, b, d, p.seqlen, x->ndim, &p.x_sb, &p.x_sd, &p.x_sl);
  step_seq(c, out, "out", p.dtype, b, d, p.seqlen, x->ndim, &p.out_sb, &p.out_sd, &p.out_sl);
  conv_weights(c, w, bias, p.dtype, d, &p.width);
  activation_arg(c, &p.silu);
  if (!c.ok()) return false;
  if (!dtype_is(c, state, "conv_state", p.dtype, "x") || !c.ndim(state, "conv_state", 3)) return false;
  p.state_len = state->shape[2];
  if (!c.shape_is(state, "conv_state", {b, d, p.state_len})) return false;
  if (p.state_len < p.width - 1)
    return c.require(false, "tensor 'conv_state' keeps %lld positions; width %lld needs at least %lld",
                     static_cast<long long>(p.state_len), static_cast<long long>(p.width), static_cast<long long>(p.width - 1));
  if (p.state_len > 1 && kk::stride(state, 2) != 1)
    return c.fail(KCPP_ERROR_UNSUPPORTED, "tensor 'conv_state': the positions (last dim) must be contiguous");
  p.conv_state = kk::data_ptr(state);
  p.state_sb = kk::stride(state, 0), p.state_sd = kk::stride(state, 1);
  p.x = kk::data_ptr(x), p.out = kk::data_ptr(out);
  p.weight = kk::data_ptr(w), p.bias = bias ? kk::data_ptr(bias) : nullptr;
  if (b * d * p.seqlen > 0) distinct(c, p.out, "out", {p.x, p.conv_state, p.weight, p.bias});
  if (b * d > 0) distinct(c, p.conv_state, "conv_state", {p.x, p.weight, p.bias});
  return c.all_read();
}

kcpp_status conv_update_supports(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "CausalConv1dUpdate");
  km::ConvUpdateParams p;
  conv_update_args(c, p);
  return c.status();
}

kcpp_status conv_update_forward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "CausalConv1dUpdate.forward");
  km::ConvUpdateParams p;
  if (!conv_update_args(c, p)) return c.status();
#if KCPP_WITH_CUDA
  if (c.on_cuda()) return c.finish(km::causal_conv1d_update_cuda(p, static_cast<cudaStream_t>(ctx->stream)));
#endif
  return c.finish(km::causal_conv1d_update_cpu(p));
}

constexpr uint32_t kDevices = KCPP_DEVICE_BIT(kDLCPU) | (kCuda ? KCPP_DEVICE_BIT(kDLCUDA) : 0u);
constexpr uint32_t kModes = KCPP_MODE_INFERENCE | KCPP_MODE_TRAINING | KCPP_MODE_GRAPH;
constexpr uint32_t kInference = KCPP_MODE_INFERENCE | KCPP_MODE_GRAPH;

const kcpp_layer kLayers[] = {
    {sizeof(kcpp_layer), kModes, kDevices, 0, "SelectiveScan", "SelectiveScan/1",
     "Mamba's selective scan (delta bias / softplus, D skip, z gate, Falcon-Mamba's B / C RMS norm), states saved "
     "every 256 positions; CUDA for N <= 16",
     scan_supports, scan_forward, scan_backward},
    {sizeof(kcpp_layer), kInference, kDevices, 0, "SelectiveStateUpdate", "SelectiveStateUpdate/1",
     "one decoding step of the selective scan on a cached f32 state, in place", update_supports, update_forward, nullptr},
    {sizeof(kcpp_layer), kModes, kDevices, 0, "CausalConv1d", "CausalConv1d/1",
     "depthwise causal 1-D convolution with optional bias and SiLU; CUDA for widths up to 4", conv_supports, conv_forward,
     conv_backward},
    {sizeof(kcpp_layer), kInference, kDevices, 0, "CausalConv1dUpdate", "CausalConv1dUpdate/1",
     "one decoding step of the causal convolution over a rolling state, in place", conv_update_supports, conv_update_forward,
     nullptr},
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
