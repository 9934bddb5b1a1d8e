// Package "flash_attn": the ABI table (include/kcpp/abi.h) over attention.h.
//
//   FlashAttention   Attention/1   attention.h   (causal / sliding window, grouped-query heads, logit
//                                                 soft-capping, lse saved, variable-length packed sequences)
//
// On CUDA the forward runs the first path of attention.h's that takes the call (Hopper, then the
// mma.sync kernel, then the generic one); KCPP_FLASH_ATTN_FORWARD names one to require, and supports()
// refuses a call it cannot take.  An argument the call does not read (a misspelt name, max_seqlen_q
// without cu_seqlens, a backward argument in a forward call) is refused naming it (Call::all_read), so
// that a host's argument is never ignored without a word.
//
// The named arguments are those of docs/contracts/Attention.md.  Every tensor is [B, H, S, D] with D
// contiguous and any other strides; with cu_seqlens_q / cu_seqlens_k (variable-length packed sequences)
// [total, H, D] instead, lse [Hq, total_q].  supports() runs the same checks as the call without
// running it, from the tensors' descriptions alone: it never reads a tensor's memory (a host such as
// kcpp.torch asks it over tensors with no memory behind them), so the contents of the cu_seqlens are
// checked by the CPU forward and backward (attention_check_varlen), which refuse bad ones naming them; on
// CUDA they stay on the device, unchecked (attention.h).  Every path takes varlen, windows and
// soft-capping (the Hopper backward at head dims 64 and 128).
#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <utility>

#include "attention.h"
#include "kcpp/abi.h"
#include "kcpp/kernel/abi_args.h"

#ifndef KCPP_WITH_CUDA
#define KCPP_WITH_CUDA 0
#endif

namespace {

namespace kk = kcpp::kernel;
namespace fa = kcpp::flash;

constexpr bool kCuda = KCPP_WITH_CUDA != 0;

// Where an operand keeps its positions and head_dim: [B, H, S, D], or [total, H, D] for packed
// sequences (varlen), whose operands get sb = 0 (the kernels add the sequence's begin to the position).
struct Dims {
  int32_t rank, seq, head_dim;
};
constexpr Dims kBatched{4, 2, 3}, kPacked{3, 0, 2};

// An operand with D contiguous; `like` (when given) fixes dtype, B (batched) and D; `heads` H.
bool operand(kk::Call& c, const DLTensor* t, const char* name, const DLTensor* like, const char* like_name, int64_t heads,
             const Dims& dims, fa::Operand& o) {
  if (!t || !c.ok()) return c.ok();
  if (!c.ndim(t, name, dims.rank)) return false;
  const int32_t dd = dims.head_dim;
  if (like) {
    c.same_dtype(t, name, like, like_name);
    if (!c.ok()) return false;
    if ((dims.rank == 4 && t->shape[0] != like->shape[0]) || t->shape[dd] != like->shape[dd] ||
        (heads > 0 && t->shape[1] != heads)) {
      char shape[128];
      return c.require(false, "tensor '%s' %s does not match '%s' in batch, heads or head_dim", name,
                       kk::Call::shape_str(t, shape, sizeof shape), like_name);
    }
  }
  if (t->shape[dd] > 1 && kk::stride(t, dd) != 1)
    return c.fail(KCPP_ERROR_UNSUPPORTED, "tensor '%s': head_dim must be contiguous (stride %lld)", name,
                  static_cast<long long>(kk::stride(t, dd)));
  o.data = kk::data_ptr(t);
  o.sb = dims.rank == 4 ? kk::stride(t, 0) : 0, o.sh = kk::stride(t, 1), o.ss = kk::stride(t, dims.seq);
  return true;
}

bool same_seq(kk::Call& c, const DLTensor* t, const char* name, int64_t s, const Dims& dims) {
  if (!t || !c.ok() || t->shape[dims.seq] == s) return c.ok();
  return c.require(false, "tensor '%s' has %lld positions, expected %lld", name,
                   static_cast<long long>(t->shape[dims.seq]), static_cast<long long>(s));
}

// varlen's arguments: cu_seqlens_q / cu_seqlens_k int32 [B + 1] (contiguous, on the call's device),
// max_seqlen_q / max_seqlen_k (required, as in FlashAttention's varlen API: a kernel may size its work by
// them without reading the cu_seqlens).  Their contents are not read here (supports() reads no memory);
// the CPU entry points check them.  A max_seqlen above the token count is taken as the token count (no
// sequence can be longer), so that it never sizes a buffer beyond the tensors.
bool varlen_args(kk::Call& c, const DLTensor* cuq, const DLTensor* cuk, const DLTensor* q, const DLTensor* k,
                 fa::AttentionParams& p) {
  if (!cuq || !cuk)
    return c.require(false, "'%s' is given without '%s' (variable-length sequences take both)",
                     cuq ? "cu_seqlens_q" : "cu_seqlens_k", cuq ? "cu_seqlens_k" : "cu_seqlens_q");
  for (const auto& [t, name] : {std::pair{cuq, "cu_seqlens_q"}, std::pair{cuk, "cu_seqlens_k"}}) {
    if (t->dtype.code != kDLInt || t->dtype.bits != 32 || t->dtype.lanes != 1)
      return c.require(false, "tensor '%s' must be i32, is %s", name, kk::dl_dtype_name(t->dtype));
    if (t->ndim != 1 || t->shape[0] < 1) {
      char shape[128];
      return c.require(false, "tensor '%s' must be [batch + 1], has shape %s", name, kk::Call::shape_str(t, shape, sizeof shape));
    }
    if (!c.row_major(t, name)) return false;
  }
  if (cuk->shape[0] != cuq->shape[0])
    return c.require(false, "tensor 'cu_seqlens_k' has %lld entries but 'cu_seqlens_q' has %lld",
                     static_cast<long long>(cuk->shape[0]), static_cast<long long>(cuq->shape[0]));
  const int64_t max_q = c.integer("max_seqlen_q", 0, true), max_k = c.integer("max_seqlen_k", 0, true);
  if (!c.ok()) return false;
  if (max_q < 0 || max_k < 0)
    return c.require(false, "argument '%s' is %lld; expected >= 0", max_q < 0 ? "max_seqlen_q" : "max_seqlen_k",
                     static_cast<long long>(max_q < 0 ? max_q : max_k));
  p.total_q = q->shape[0], p.total_kv = k->shape[0];
  p.batch = cuq->shape[0] - 1, p.seq_q = std::min(max_q, p.total_q), p.seq_kv = std::min(max_k, p.total_kv);
  p.cu_seqlens_q = static_cast<const int32_t*>(kk::data_ptr(cuq));
  p.cu_seqlens_k = static_cast<const int32_t*>(kk::data_ptr(cuk));
  return true;
}

bool distinct(kk::Call& c, const void* out, const char* name, std::initializer_list<const void*> inputs) {
  if (!c.ok() || !out) return c.ok();
  for (const void* in : inputs)
    if (in == out) return c.require(false, "tensor '%s' must not overlap an input (no in-place attention)", name);
  return true;
}

bool attention_args(kk::Call& c, bool bwd, fa::AttentionParams& p) {
  c.device_in(kCuda);
  DLTensor* q = c.tensor("q");
  DLTensor* k = c.tensor("k");
  DLTensor* v = c.tensor("v");
  DLTensor* out = c.tensor("out");
  DLTensor* lse = c.tensor("lse", bwd);
  const DLTensor* cuq = c.tensor("cu_seqlens_q", false);
  const DLTensor* cuk = c.tensor("cu_seqlens_k", false);
  if (!c.ok()) return false;
  const bool varlen = cuq || cuk;
  const Dims dims = varlen ? kPacked : kBatched;
  c.float_dtype(q, "q", &p.dtype);
  if (!c.ndim(q, "q", dims.rank) || !c.ndim(k, "k", dims.rank)) return false;
  p.heads_q = q->shape[1], p.head_dim = q->shape[dims.head_dim], p.heads_kv = k->shape[1];
  if (!varlen) p.batch = q->shape[0], p.seq_q = q->shape[2], p.seq_kv = k->shape[2];
  // The positions each operand holds: Sq / Skv batched, total_q / total_k packed.
  const int64_t nq = q->shape[dims.seq], nk = k->shape[dims.seq];
  operand(c, q, "q", nullptr, nullptr, 0, dims, p.q);
  operand(c, k, "k", q, "q", 0, dims, p.k);
  operand(c, v, "v", k, "k", p.heads_kv, dims, p.v);
  same_seq(c, v, "v", nk, dims);
  operand(c, out, "out", q, "q", p.heads_q, dims, p.out);
  same_seq(c, out, "out", nq, dims);
  if (!c.ok()) return false;
  if (p.heads_kv < 1 || p.heads_q % p.heads_kv != 0)
    return c.require(false, "%lld query heads are not a multiple of %lld kv heads", static_cast<long long>(p.heads_q),
                     static_cast<long long>(p.heads_kv));
  if (varlen && !varlen_args(c, cuq, cuk, q, k, p)) return false;
  if (!varlen && p.seq_q > p.seq_kv)
    return c.require(false, "%lld queries but only %lld keys (queries are the last positions of the keys)",
                     static_cast<long long>(p.seq_q), static_cast<long long>(p.seq_kv));
  const double scale = c.real("scale", 1.0 / std::sqrt(static_cast<double>(p.head_dim > 0 ? p.head_dim : 1)));
  const int64_t causal = c.integer("causal", 1);
  p.window = c.integer("window", 0);
  const double softcap = c.real("softcap", 0.0);
  if (!c.ok()) return false;
  if (!std::isfinite(scale)) return c.require(false, "argument 'scale' is not finite");
  if (causal != 0 && causal != 1) return c.require(false, "argument 'causal' is %lld; expected 0 or 1", static_cast<long long>(causal));
  if (p.window < 0) return c.require(false, "argument 'window' is %lld; expected >= 0", static_cast<long long>(p.window));
  // A cap must be a normal float (as a subnormal or an overflow it would be 0 or infinite).
  if (!(softcap == 0.0 || (softcap >= std::numeric_limits<float>::min() && softcap <= std::numeric_limits<float>::max())))
    return c.require(false, "argument 'softcap' is %g; expected 0 (none) or a positive finite value (Gemma 2: 50)", softcap);
  p.softcap = static_cast<float>(softcap);
  if (p.softcap > 0.0f && !std::isfinite(static_cast<float>(scale) / p.softcap))
    return c.require(false, "argument 'softcap' is %g: scale %g / softcap overflows a float; give a larger softcap or a smaller scale",
                     softcap, scale);
  p.scale = static_cast<float>(scale);
  p.causal = causal == 1;
  if (lse) {
    if (lse->dtype.code != kDLFloat || lse->dtype.bits != 32 || lse->dtype.lanes != 1)
      return c.require(false, "tensor 'lse' must be f32, is %s", kk::dl_dtype_name(lse->dtype));
    if (varlen && (lse->ndim != 2 || lse->shape[0] != p.heads_q || lse->shape[1] != p.total_q)) {
      char shape[128];
      return c.require(false, "tensor 'lse' must be [%lld, %lld] (heads, total_q), has shape %s",
                       static_cast<long long>(p.heads_q), static_cast<long long>(p.total_q),
                       kk::Call::shape_str(lse, shape, sizeof shape));
    }
    if (!varlen && kk::numel(lse) != p.batch * p.heads_q * p.seq_q)
      return c.require(false, "tensor 'lse' must be [%lld, %lld, %lld]", static_cast<long long>(p.batch),
                       static_cast<long long>(p.heads_q), static_cast<long long>(p.seq_q));
    if (kk::numel(lse) > 0 && !c.row_major(lse, "lse")) return false;
    p.lse = static_cast<float*>(kk::data_ptr(lse));
  }
  if (!bwd) return distinct(c, p.out.data, "out", {p.q.data, p.k.data, p.v.data}) &&
                   (!p.lse || distinct(c, p.lse, "lse", {p.q.data, p.k.data, p.v.data, p.out.data})) && c.all_read();
  DLTensor* dout = c.tensor("dout");
  DLTensor* dq = c.tensor("dq");
  DLTensor* dk = c.tensor("dk");
  DLTensor* dv = c.tensor("dv");
  operand(c, dout, "dout", q, "q", p.heads_q, dims, p.dout);
  same_seq(c, dout, "dout", nq, dims);
  operand(c, dq, "dq", q, "q", p.heads_q, dims, p.dq);
  same_seq(c, dq, "dq", nq, dims);
  operand(c, dk, "dk", k, "k", p.heads_kv, dims, p.dk);
  same_seq(c, dk, "dk", nk, dims);
  operand(c, dv, "dv", k, "k", p.heads_kv, dims, p.dv);
  same_seq(c, dv, "dv", nk, dims);
  const std::initializer_list<const void*> ins = {p.q.data, p.k.data, p.v.data, p.out.data, p.dout.data, p.lse};
  distinct(c, p.dq.data, "dq", ins);
  distinct(c, p.dk.data, "dk", ins);
  distinct(c, p.dv.data, "dv", ins);
  if (c.ok() && nk > 0 && p.dk.data == p.dv.data) c.require(false, "'dk' and 'dv' must be different tensors");
  if (c.ok() && nq > 0 && (p.dq.data == p.dk.data || p.dq.data == p.dv.data))
    c.require(false, "'dq' must differ from 'dk' and 'dv'");
  return c.all_read();
}

// On CUDA, the forward path that KCPP_FLASH_ATTN_FORWARD asks for must be able to run (attention.h).
bool forward_path_runs(kk::Call& c, const fa::AttentionParams& p) {
#if KCPP_WITH_CUDA
  if (!c.ok() || !c.on_cuda()) return c.ok();
  const char* error = nullptr;
  fa::attention_forward_path(p, &error);
  if (error) return c.fail(KCPP_ERROR_UNSUPPORTED, "%s", error);
#endif
  (void)p;
  return c.ok();
}

// Likewise the backward path that KCPP_FLASH_ATTN_BACKWARD asks for.
bool backward_path_runs(kk::Call& c, const fa::AttentionParams& p) {
#if KCPP_WITH_CUDA
  if (!c.ok() || !c.on_cuda()) return c.ok();
  const char* error = nullptr;
  fa::attention_backward_path(p, &error);
  if (error) return c.fail(KCPP_ERROR_UNSUPPORTED, "%s", error);
#endif
  (void)p;
  return c.ok();
}

kcpp_status attention_supports(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "FlashAttention");
  fa::AttentionParams p;
  const bool backward = c.find("dout") != nullptr;
  if (attention_args(c, backward, p) && forward_path_runs(c, p) && backward) backward_path_runs(c, p);
  return c.status();
}

kcpp_status attention_forward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "FlashAttention.forward");
  fa::AttentionParams p;
  if (!attention_args(c, false, p) || !forward_path_runs(c, p)) return c.status();
#if KCPP_WITH_CUDA
  if (c.on_cuda()) return c.finish(fa::attention_forward_cuda(p, static_cast<cudaStream_t>(ctx->stream)));
#endif
  return c.finish(fa::attention_forward_cpu(p));
}

kcpp_status attention_backward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "FlashAttention.backward");
  fa::AttentionParams p;
  if (!attention_args(c, true, p) || !backward_path_runs(c, p)) return c.status();
#if KCPP_WITH_CUDA
  if (c.on_cuda()) {
    if (p.batch > 0 && p.seq_kv > 0) p.workspace = c.workspace(fa::attention_backward_workspace(p));
    if (!c.ok()) return c.status();
    return c.finish(fa::attention_backward_cuda(p, static_cast<cudaStream_t>(ctx->stream)));
  }
#endif
  return c.finish(fa::attention_backward_cpu(p));
}

constexpr uint32_t kDevices = KCPP_DEVICE_BIT(kDLCPU) | (kCuda ? KCPP_DEVICE_BIT(kDLCUDA) : 0u);
constexpr uint32_t kModes = KCPP_MODE_INFERENCE | KCPP_MODE_TRAINING | KCPP_MODE_GRAPH;

const kcpp_layer kLayers[] = {
    {sizeof(kcpp_layer), kModes, kDevices, 0, "FlashAttention", "Attention/1",
     "FlashAttention-2: causal / sliding-window attention with grouped-query heads and logit soft-capping, no score "
     "matrix; saves lse; variable-length packed sequences (cu_seqlens); "
     "tensor cores for bf16 / f16 head_dim 64 / 128 on CUDA (on sm_90a wgmma and TMA, the forward also at head_dim 256)",
     attention_supports, attention_forward, attention_backward},
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
