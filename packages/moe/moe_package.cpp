// Package "moe": the ABI table (include/kcpp/abi.h) over moe.h.
//
//   MegaBlocksMoeMLP   MoE/1   the whole contract (docs/contracts/MoE.md)
//   Llama4TextMoe      MoE/1   the same entry points: the name Transformers' Llama 4 mapping uses
//   op load_balancing_loss     the auxiliary loss with its gradient (MoE.md)
//
// Each entry point reads its named arguments, checks them with kcpp::kernel::Call (the first problem
// is reported, naming the argument), fills moe::MoeParams and runs the CPU or CUDA kernel on the
// context's stream.  supports() runs the same checks without running anything.  An argument that the
// call does not read (misspelt, or meaningless without another) is refused, naming it (Call::all_read).
#include <cstring>
#include <initializer_list>
#include <utility>

#include "kcpp/abi.h"
#include "kcpp/kernel/abi_args.h"
#include "moe.h"

#ifndef KCPP_WITH_CUDA
#define KCPP_WITH_CUDA 0
#endif

namespace {

namespace kk = kcpp::kernel;
namespace km = kcpp::moe;

constexpr bool kCuda = KCPP_WITH_CUDA != 0;

#if KCPP_WITH_CUDA
cudaStream_t stream_of(const kk::Call& c) { return static_cast<cudaStream_t>(c.context()->stream); }
#define MOE_RUN(c, fn, p) c.finish((c).on_cuda() ? fn##_cuda((p), stream_of(c)) : fn##_cpu(p))
#else
#define MOE_RUN(c, fn, p) c.finish(fn##_cpu(p))
#endif

bool dtype_is(const DLTensor* t, uint8_t code, uint8_t bits) {
  return t->dtype.code == code && t->dtype.bits == bits && t->dtype.lanes == 1;
}
bool is_f32(const DLTensor* t) { return dtype_is(t, kDLFloat, 32); }
bool is_i32(const DLTensor* t) { return dtype_is(t, kDLInt, 32); }
bool is_i64(const DLTensor* t) { return dtype_is(t, kDLInt, 64); }
bool same_dtype(const DLTensor* a, const DLTensor* b) {
  return a->dtype.code == b->dtype.code && a->dtype.bits == b->dtype.bits && a->dtype.lanes == b->dtype.lanes;
}

// A contiguous tensor of exactly n elements (its shape is free: [T, k] or [S], ...).
bool numel_is(kk::Call& c, const DLTensor* t, const char* name, int64_t n, const char* what) {
  if (!t || !c.ok()) return c.ok();
  if (kk::numel(t) != n)
    return c.require(false, "tensor '%s' must have %lld elements (%s), has %lld", name, static_cast<long long>(n), what,
                     static_cast<long long>(kk::numel(t)));
  return c.row_major(t, name);
}

// Element offset of a byte pointer in a tensor (for the up half of a fused gate_up).
void* advance(void* p, int64_t elements, kk::DType d) {
  return static_cast<char*>(p) + elements * kk::dtype_bytes(d);
}

// A 3-dim (per expert) or 2-dim (shared) weight of logical shape [E,] rows x cols; fills a Matrix.
// `rows_expected` may be 0 (then any, returned through *rows).
bool weight(kk::Call& c, const DLTensor* t, const char* name, bool per_expert, int64_t experts, int64_t* rows,
            int64_t cols, const DLTensor* like, km::Matrix* m) {
  if (!t || !c.ok()) return c.ok();
  c.same_dtype(t, name, like, "hidden");
  c.ndim(t, name, per_expert ? 3 : 2);
  if (!c.ok()) return false;
  const int32_t o = per_expert ? 1 : 0;
  char s[128];
  if (per_expert && t->shape[0] != experts)
    return c.require(false, "tensor '%s' has %lld experts (shape %s) but the router has %lld", name,
                     static_cast<long long>(t->shape[0]), kk::Call::shape_str(t, s, sizeof s), static_cast<long long>(experts));
  if ((*rows && t->shape[o] != *rows) || t->shape[o + 1] != cols)
    return c.require(false, "tensor '%s' has shape %s; expected [%s%lld, %lld]", name, kk::Call::shape_str(t, s, sizeof s),
                     per_expert ? "E, " : "", static_cast<long long>(*rows ? *rows : t->shape[o]), static_cast<long long>(cols));
  *rows = t->shape[o];
  m->data = kk::data_ptr(t);
  m->expert_stride = per_expert ? kk::stride(t, 0) : 0;
  m->row_stride = kk::stride(t, o);
  m->col_stride = kk::stride(t, o + 1);
  const bool unit = m->col_stride == 1 || m->row_stride == 1 || t->shape[o] <= 1 || t->shape[o + 1] <= 1;
  if (!unit)
    return c.fail(KCPP_ERROR_UNSUPPORTED, "tensor '%s': one of its last two dims must have stride 1 (strides %lld, %lld)",
                  name, static_cast<long long>(m->row_stride), static_cast<long long>(m->col_stride));
  return true;
}

// The gate and up projections: fused `<prefix>gate_up_proj` [.., 2I, H] or `<prefix>gate_proj` +
// `<prefix>up_proj` [.., I, H].  *inter is I (0: read from the tensor).
bool gate_up(kk::Call& c, const char* fused_name, const char* gate_name, const char* up_name, bool per_expert,
             int64_t experts, int64_t h, const DLTensor* like, kk::DType dt, int64_t* inter, km::Matrix* g,
             km::Matrix* u, bool required, bool* present) {
  DLTensor* fused = c.tensor(fused_name, false);
  DLTensor* gt = c.tensor(gate_name, false);
  DLTensor* ut = c.tensor(up_name, false);
  *present = fused || gt || ut;
  if (!c.ok()) return false;
  if (!*present) return required ? c.require(false, "missing tensor argument '%s' (or '%s' and '%s')", fused_name, gate_name, up_name)
                                 : true;
  if (fused && (gt || ut)) return c.require(false, "give '%s' or '%s' and '%s', not both", fused_name, gate_name, up_name);
  if (fused) {
    int64_t rows = *inter ? 2 * *inter : 0;
    if (!weight(c, fused, fused_name, per_expert, experts, &rows, h, like, g)) return false;
    if (rows % 2 != 0)
      return c.require(false, "tensor '%s' has %lld gate + up rows; expected an even count (2I)", fused_name,
                       static_cast<long long>(rows));
    *inter = rows / 2;
    *u = *g;
    u->data = advance(g->data, *inter * g->row_stride, dt);
    return true;
  }
  if (!gt || !ut) return c.require(false, "'%s' and '%s' go together", gate_name, up_name);
  int64_t rows = *inter;
  if (!weight(c, gt, gate_name, per_expert, experts, &rows, h, like, g)) return false;
  if (!weight(c, ut, up_name, per_expert, experts, &rows, h, like, u)) return false;
  *inter = rows;
  return true;
}

constexpr const char* kRoutings[] = {"softmax", "sigmoid", "given", nullptr};
constexpr const char* kWeightOn[] = {"output", "input", nullptr};

// Everything forward and backward share, and the tensors each direction adds.
bool moe_args(kk::Call& c, bool bwd, km::MoeParams& p) {
  c.device_in(kCuda);
  DLTensor* hidden = c.tensor("hidden");
  p.routing = static_cast<km::Routing>(c.choice("routing", 0, kRoutings));
  p.weight_on = static_cast<km::WeightOn>(c.choice("apply_router_weight", 0, kWeightOn));
  p.normalize = c.integer("normalize", 0) != 0;
  const char* act = c.string("activation", "silu");
  if (c.ok() && !kk::parse_activation(act, &p.act))
    c.require(false, "argument 'activation' is '%s'; expected silu, gelu, gelu_tanh or quick_gelu (or a Transformers alias)", act);
  c.float_dtype(hidden, "hidden", &p.dtype);
  int64_t t = 0, h = 0;
  c.rows(hidden, "hidden", &t, &h, &p.x_stride);
  if (!c.ok()) return false;
  if (h == 0) return c.require(false, "tensor 'hidden' has an empty last dim");
  p.tokens = t, p.hidden = h, p.x = kk::data_ptr(hidden);
  const bool given = p.routing == km::Routing::Given;
  const bool training = (c.context()->mode & KCPP_MODE_TRAINING) != 0;

  // The router, or the host's routing.
  DLTensor* router = c.tensor("router_weight", false);
  DLTensor* ids = c.tensor("topk_ids", false);
  DLTensor* weights = c.tensor("topk_weights", false);
  if (!c.ok()) return false;
  int64_t experts = 0;
  if (given) {
    if (router) return c.require(false, "'router_weight' given with routing 'given' (the host routes); leave one out");
    if (!ids || !weights)
      return c.require(false, "routing 'given' needs the tensors 'topk_ids' and 'topk_weights' (the host's routing)");
    DLTensor* probe = c.tensor("gate_up_proj", false);
    if (!probe) probe = c.tensor("gate_proj", false);
    if (!probe) return c.require(false, "missing tensor argument 'gate_up_proj' (or 'gate_proj' and 'up_proj')");
    if (probe->ndim != 3) return c.require(false, "the experts' projections must be 3-dim [E, rows, H]");
    experts = probe->shape[0];
  } else {
    if (!router) return c.require(false, "missing tensor argument 'router_weight' (required unless routing is 'given')");
    c.same_dtype(router, "router_weight", hidden, "hidden");
    c.ndim(router, "router_weight", 2);
    c.row_major(router, "router_weight");
    if (!c.ok()) return false;
    experts = router->shape[0];
    if (router->shape[1] != h)
      return c.require(false, "tensor 'router_weight' is [%lld, %lld] but 'hidden' rows have %lld elements",
                       static_cast<long long>(experts), static_cast<long long>(router->shape[1]), static_cast<long long>(h));
    p.router = kk::data_ptr(router);
  }
  if (experts == 0) return c.require(false, "no experts (the router or the projections have 0 rows)");
  p.experts = experts;
  int64_t k = c.integer("top_k", 0, !given);
  if (!c.ok()) return false;
  if (given) {
    const int64_t last = ids->ndim > 0 ? ids->shape[ids->ndim - 1] : 1;
    if (k == 0) k = last;
  }
  if (k < 1) return c.require(false, "argument 'top_k' = %lld must be >= 1", static_cast<long long>(k));
  if (!given && k > experts)
    return c.require(false, "argument 'top_k' = %lld exceeds the %lld experts of 'router_weight'", static_cast<long long>(k),
                     static_cast<long long>(experts));
  p.top_k = k;
  const int64_t slots = t * k;

  // The experts.
  bool present = false;
  if (!gate_up(c, "gate_up_proj", "gate_proj", "up_proj", true, experts, h, hidden, p.dtype, &p.inter, &p.gate, &p.up, true,
               &present))
    return false;
  DLTensor* down = c.tensor("down_proj");
  int64_t hrows = h;
  if (down && c.ok() && down->ndim == 3 && down->shape[2] != p.inter)
    return c.require(false, "tensor 'down_proj' has intermediate size %lld but the gate / up projections %lld",
                     static_cast<long long>(down->shape[2]), static_cast<long long>(p.inter));
  if (!weight(c, down, "down_proj", true, experts, &hrows, p.inter, hidden, &p.down)) return false;
  // The shared expert.
  bool shared = false;
  if (!gate_up(c, "shared_gate_up_proj", "shared_gate_proj", "shared_up_proj", false, 0, h, hidden, p.dtype, &p.shared_inter,
               &p.shared_gate, &p.shared_up, false, &shared))
    return false;
  if (shared) {
    DLTensor* sd = c.tensor("shared_down_proj");
    int64_t r = h;
    if (sd && c.ok() && sd->ndim == 2 && sd->shape[1] != p.shared_inter)
      return c.require(false, "tensor 'shared_down_proj' has intermediate size %lld but the shared gate / up %lld",
                       static_cast<long long>(sd->shape[1]), static_cast<long long>(p.shared_inter));
    if (!weight(c, sd, "shared_down_proj", false, 0, &r, p.shared_inter, hidden, &p.shared_down)) return false;
    DLTensor* sg = c.tensor("shared_expert_gate", false);
    if (sg) {
      c.same_dtype(sg, "shared_expert_gate", hidden, "hidden");
      numel_is(c, sg, "shared_expert_gate", h, "the hidden size");
      if (!c.ok()) return false;
      p.shared_expert_gate = kk::data_ptr(sg);
    }
  } else {
    for (const char* n : {"shared_down_proj", "shared_expert_gate"})
      if (c.tensor(n, false)) return c.require(false, "tensor '%s' given without the shared expert's gate / up projections", n);
  }

  // Routing tensors: outputs of the router, inputs with "given" and in backward.
  if (ids) {
    if (given ? !(is_i32(ids) || is_i64(ids)) : !is_i32(ids))
      return c.require(false, "tensor 'topk_ids' is %s; expected %s", kk::dl_dtype_name(ids->dtype), given ? "i32 or i64" : "i32");
    if (!numel_is(c, ids, "topk_ids", slots, "tokens x top_k")) return false;
    p.topk_ids = kk::data_ptr(ids);
    p.ids_i64 = is_i64(ids);
  }
  if (weights) {
    if (given ? !(is_f32(weights) || same_dtype(weights, hidden)) : !is_f32(weights))
      return c.require(false, "tensor 'topk_weights' is %s; expected f32%s", kk::dl_dtype_name(weights->dtype),
                       given ? " or the dtype of 'hidden'" : "");
    if (!numel_is(c, weights, "topk_weights", slots, "tokens x top_k")) return false;
    p.topk_weights = kk::data_ptr(weights);
    p.weights_f32 = is_f32(weights);
  }
  DLTensor* logits = given ? nullptr : c.tensor("router_logits", bwd);
  if (given && c.tensor("router_logits", false))
    return c.require(false, "tensor 'router_logits' given with routing 'given' (there is no router)");
  if (logits) {
    c.same_dtype(logits, "router_logits", hidden, "hidden");
    if (!numel_is(c, logits, "router_logits", t * experts, "tokens x experts")) return false;
    p.router_logits = kk::data_ptr(logits);
  }
  DLTensor* offsets = c.tensor("expert_offsets", bwd);
  DLTensor* sorted = c.tensor("sorted_slots", bwd);
  if (offsets) {
    if (!is_i32(offsets)) return c.require(false, "tensor 'expert_offsets' must be i32, is %s", kk::dl_dtype_name(offsets->dtype));
    if (!numel_is(c, offsets, "expert_offsets", experts + 2, "experts + 2")) return false;
    p.expert_offsets = static_cast<int32_t*>(kk::data_ptr(offsets));
  }
  if (sorted) {
    if (!is_i32(sorted)) return c.require(false, "tensor 'sorted_slots' must be i32, is %s", kk::dl_dtype_name(sorted->dtype));
    if (!numel_is(c, sorted, "sorted_slots", slots, "tokens x top_k")) return false;
    p.sorted_slots = static_cast<int32_t*>(kk::data_ptr(sorted));
  }
  DLTensor* saved = c.tensor("gate_up", false);
  if (saved) {
    c.same_dtype(saved, "gate_up", hidden, "hidden");
    if (!numel_is(c, saved, "gate_up", slots * 2 * p.inter, "tokens x top_k x 2I")) return false;
    p.gate_up = kk::data_ptr(saved);
  }
  if (!c.ok()) return false;
  const kcpp_arg* ow = c.find("overwrite_gate_up");
  if (ow && ow->kind != KCPP_ARG_NONE) {
    if (!bwd)
      return c.require(false, "argument 'overwrite_gate_up' is the backward's (it lets the backward write over the saved 'gate_up')");
    const int64_t v = c.integer("overwrite_gate_up", 0);
    if (!c.ok()) return false;
    if (v != 0 && v != 1) return c.require(false, "argument 'overwrite_gate_up' = %lld; expected 0 or 1", static_cast<long long>(v));
    if (v && !saved)
      return c.require(false, "argument 'overwrite_gate_up' = 1 without the tensor 'gate_up': pass the forward's saved gate_up "
                              "(which this backward may then write over), or leave the flag out");
    p.overwrite_gate_up = v != 0;
  }
  if (!bwd) {
    if (training && !given && (!logits || !ids || !weights))
      return c.require(false, "missing '%s' (required in training mode: backward needs it)",
                       !logits ? "router_logits" : !ids ? "topk_ids" : "topk_weights");
    if (training && (!offsets || !sorted))
      return c.require(false, "missing '%s' (required in training mode: backward needs it)", !offsets ? "expert_offsets" : "sorted_slots");
    DLTensor* out = c.tensor("out");
    c.same_dtype(out, "out", hidden, "hidden");
    c.same_shape(out, "out", hidden, "hidden");
    int64_t r2 = 0, w2 = 0;
    if (c.rows(out, "out", &r2, &w2, &p.out_stride)) p.out = kk::data_ptr(out);
    if (c.ok() && p.out == p.x) return c.require(false, "'out' must not be 'hidden'");
  } else {
    DLTensor* dout = c.tensor("dout");
    DLTensor* dx = c.tensor("dhidden");
    int64_t r2 = 0, w2 = 0;
    for (const auto& [tt, n] : {std::pair{dout, "dout"}, std::pair{dx, "dhidden"}}) {
      c.same_dtype(tt, n, hidden, "hidden");
      c.same_shape(tt, n, hidden, "hidden");
    }
    if (c.rows(dout, "dout", &r2, &w2, &p.dout_stride)) p.dout = kk::data_ptr(dout);
    if (c.rows(dx, "dhidden", &r2, &w2, &p.dx_stride)) p.dx = kk::data_ptr(dx);
    DLTensor* dlog = c.tensor("drouter_logits", false);
    if (dlog) {
      if (given) return c.require(false, "tensor 'drouter_logits' given with routing 'given' (there is no router)");
      if (!(is_f32(dlog) || same_dtype(dlog, hidden)))
        return c.require(false, "tensor 'drouter_logits' is %s; expected f32 or the dtype of 'hidden'", kk::dl_dtype_name(dlog->dtype));
      if (!numel_is(c, dlog, "drouter_logits", t * experts, "tokens x experts")) return false;
      p.drouter_logits = kk::data_ptr(dlog);
      p.drouter_logits_f32 = is_f32(dlog);
    }
    DLTensor* dr = c.tensor("drouter_weight", false);
    if (dr) {
      if (given) return c.require(false, "tensor 'drouter_weight' given with routing 'given' (there is no router)");
      c.same_dtype(dr, "drouter_weight", hidden, "hidden");
      c.same_shape(dr, "drouter_weight", router, "router_weight");
      c.row_major(dr, "drouter_weight");
      if (c.ok()) p.drouter = kk::data_ptr(dr);
    }
    // Expert gradients: named after the weights' form.
    const bool fused = c.find("gate_up_proj") && c.find("gate_up_proj")->kind == KCPP_ARG_TENSOR;
    auto grad_pair = [&](const char* fn, const char* gn, const char* un, bool per_expert, bool fused_form, int64_t inter,
                         km::Matrix* g, km::Matrix* u) {
      DLTensor* f = c.tensor(fn, false);
      DLTensor* gt = c.tensor(gn, false);
      DLTensor* ut = c.tensor(un, false);
      if (!c.ok()) return false;
      if ((fused_form && (gt || ut)) || (!fused_form && f))
        return c.require(false, "the gradients of the gate / up projections take the weights' form: '%s'",
                         fused_form ? fn : "dgate_proj' and 'dup_proj");
      if (f) {
        int64_t rows = 2 * inter;
        if (!weight(c, f, fn, per_expert, experts, &rows, h, hidden, g)) return false;
        *u = *g;
        u->data = advance(g->data, inter * g->row_stride, p.dtype);
        return true;
      }
      int64_t rows = inter;
      if (gt && !weight(c, gt, gn, per_expert, experts, &rows, h, hidden, g)) return false;
      if (ut && !weight(c, ut, un, per_expert, experts, &rows, h, hidden, u)) return false;
      return true;
    };
    if (!grad_pair("dgate_up_proj", "dgate_proj", "dup_proj", true, fused, p.inter, &p.dgate, &p.dup)) return false;
    if (DLTensor* dd = c.tensor("ddown_proj", false)) {
      int64_t rows = h;
      if (!weight(c, dd, "ddown_proj", true, experts, &rows, p.inter, hidden, &p.ddown)) return false;
    }
    const bool sfused = c.find("shared_gate_up_proj") && c.find("shared_gate_up_proj")->kind == KCPP_ARG_TENSOR;
    for (const char* n : {"dshared_gate_up_proj", "dshared_gate_proj", "dshared_up_proj", "dshared_down_proj", "dshared_expert_gate"})
      if (!shared && c.tensor(n, false)) return c.require(false, "tensor '%s' given without a shared expert", n);
    if (shared) {
      if (!grad_pair("dshared_gate_up_proj", "dshared_gate_proj", "dshared_up_proj", false, sfused, p.shared_inter,
                     &p.dshared_gate, &p.dshared_up))
        return false;
      if (DLTensor* dd = c.tensor("dshared_down_proj", false)) {
        int64_t rows = h;
        if (!weight(c, dd, "dshared_down_proj", false, 0, &rows, p.shared_inter, hidden, &p.dshared_down)) return false;
      }
      if (DLTensor* dg = c.tensor("dshared_expert_gate", false)) {
        if (!p.shared_expert_gate) return c.require(false, "tensor 'dshared_expert_gate' given without 'shared_expert_gate'");
        c.same_dtype(dg, "dshared_expert_gate", hidden, "hidden");
        if (!numel_is(c, dg, "dshared_expert_gate", h, "the hidden size")) return false;
        p.dshared_expert_gate = kk::data_ptr(dg);
      }
    }
    if (DLTensor* dw = c.tensor("dtopk_weights", false)) {
      if (!is_f32(dw)) return c.require(false, "tensor 'dtopk_weights' must be f32, is %s", kk::dl_dtype_name(dw->dtype));
      if (!numel_is(c, dw, "dtopk_weights", slots, "tokens x top_k")) return false;
      p.dtopk_weights = static_cast<float*>(kk::data_ptr(dw));
    }
  }
  if (c.ok())
    if (const char* e = km::moe_check(p, bwd)) c.require(false, "%s", e);
  if (c.ok() && c.on_cuda())
    if (const char* e = km::moe_cuda_unsupported(p, bwd)) c.fail(KCPP_ERROR_UNSUPPORTED, "%s", e);
  return c.all_read();  // an argument the call does not read is refused, naming it
}

kcpp_status moe_supports(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "MoE");
  km::MoeParams p;
  moe_args(c, c.find("dout") != nullptr, p);
  return c.status();
}

// On a stream being captured into a CUDA graph every path runs the package's GEMM (no host read-back
// there), which needs the workspace sized for it (moe.h: Loop's smaller buffers, Padded's groups).
void kernel_when_captured(const kk::Call& c, km::MoeParams& p) {
#if KCPP_WITH_CUDA
  if (!c.on_cuda()) return;
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream_of(c), &cs) != cudaSuccess) {  // e.g. the legacy stream while another captures
    cudaGetLastError();
    cs = cudaStreamCaptureStatusActive;
  }
  if (cs != cudaStreamCaptureStatusNone) p.expert_gemm = km::ExpertGemm::Kernel;
#else
  (void)c, (void)p;
#endif
}

kcpp_status moe_forward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "MoE.forward");
  km::MoeParams p;
  if (!moe_args(c, false, p)) return c.status();
  kernel_when_captured(c, p);
  p.workspace = c.workspace(km::moe_workspace(p, false, c.on_cuda()));
  if (!c.ok()) return c.status();
  return MOE_RUN(c, km::moe_forward, p);
}

kcpp_status moe_backward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "MoE.backward");
  km::MoeParams p;
  if (!moe_args(c, true, p)) return c.status();
  kernel_when_captured(c, p);
  p.workspace = c.workspace(km::moe_workspace(p, true, c.on_cuda()));
  if (!c.ok()) return c.status();
  return MOE_RUN(c, km::moe_backward, p);
}

// ---- op load_balancing_loss ----------------------------------------------------------------------

kcpp_status load_balancing_loss(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "load_balancing_loss");
  c.device_in(kCuda);
  km::LoadBalancingParams p;
  DLTensor* logits = c.tensor("router_logits");
  DLTensor* mask = c.tensor("attention_mask", false);
  DLTensor* loss = c.tensor("loss");
  DLTensor* dlogits = c.tensor("drouter_logits", false);
  p.top_k = c.integer("top_k", 0, true);
  p.grad_scale = static_cast<float>(c.real("grad_scale", 1.0));
  c.float_dtype(logits, "router_logits", &p.dtype);
  c.rows(logits, "router_logits", &p.rows, &p.experts, &p.logits_stride);
  if (!c.ok()) return c.status();
  if (p.experts == 0) return c.fail(KCPP_ERROR_INVALID_ARGUMENT, "tensor 'router_logits' has no experts (last dim 0)"), c.status();
  if (p.top_k < 1 || p.top_k > p.experts)
    return c.fail(KCPP_ERROR_INVALID_ARGUMENT, "argument 'top_k' = %lld must be in [1, %lld] (the experts)",
                  static_cast<long long>(p.top_k), static_cast<long long>(p.experts)), c.status();
  p.logits = kk::data_ptr(logits);
  if (mask) {
    const int64_t len = kk::numel(mask);
    if (dtype_is(mask, kDLUInt, 8) || dtype_is(mask, 6, 8) || dtype_is(mask, kDLInt, 8)) p.mask_type = km::MaskType::U8;
    else if (is_i32(mask)) p.mask_type = km::MaskType::I32;
    else if (is_i64(mask)) p.mask_type = km::MaskType::I64;
    else if (is_f32(mask)) p.mask_type = km::MaskType::F32;
    else
      return c.fail(KCPP_ERROR_INVALID_ARGUMENT, "tensor 'attention_mask' is %s; expected bool, u8, i32, i64 or f32",
                    kk::dl_dtype_name(mask->dtype)), c.status();
    c.row_major(mask, "attention_mask");
    if (c.ok() && (len == 0 || p.rows % len != 0))
      return c.fail(KCPP_ERROR_INVALID_ARGUMENT,
                    "tensor 'attention_mask' has %lld tokens; the %lld rows of 'router_logits' must be a multiple of it",
                    static_cast<long long>(len), static_cast<long long>(p.rows)), c.status();
    p.mask = kk::data_ptr(mask);
    p.mask_len = len;
  }
  if (c.ok() && !(is_f32(loss) && kk::numel(loss) == 1))
    return c.fail(KCPP_ERROR_INVALID_ARGUMENT, "tensor 'loss' must be one f32"), c.status();
  if (loss) p.loss = static_cast<float*>(kk::data_ptr(loss));
  if (dlogits && c.ok()) {
    if (!(is_f32(dlogits) || same_dtype(dlogits, logits)))
      return c.fail(KCPP_ERROR_INVALID_ARGUMENT, "tensor 'drouter_logits' is %s; expected f32 or the dtype of 'router_logits'",
                    kk::dl_dtype_name(dlogits->dtype)), c.status();
    c.same_shape(dlogits, "drouter_logits", logits, "router_logits");
    c.row_major(dlogits, "drouter_logits");
    p.dlogits = kk::data_ptr(dlogits);
    p.dlogits_f32 = is_f32(dlogits);
  }
  if (!c.ok() || !c.all_read()) return c.status();
  if (const char* e = km::load_balancing_check(p)) return c.fail(KCPP_ERROR_INVALID_ARGUMENT, "%s", e), c.status();
  if (c.on_cuda())
    if (const char* e = km::load_balancing_cuda_unsupported(p)) return c.fail(KCPP_ERROR_UNSUPPORTED, "%s", e), c.status();
  if (const size_t bytes = km::load_balancing_workspace(p, c.on_cuda())) p.workspace = c.workspace(bytes);
  if (!c.ok()) return c.status();
  return MOE_RUN(c, km::load_balancing, p);
}

// ---- the table -------------------------------------------------------------------------------------

constexpr uint32_t kDevices = KCPP_DEVICE_BIT(kDLCPU) | (kCuda ? KCPP_DEVICE_BIT(kDLCUDA) : 0u);
constexpr uint32_t kModes = KCPP_MODE_INFERENCE | KCPP_MODE_TRAINING | KCPP_MODE_GRAPH;

const kcpp_layer kLayers[] = {
    {sizeof(kcpp_layer), kModes, kDevices, 0, "MegaBlocksMoeMLP", "MoE/1",
     "dropless MoE block: router (softmax / sigmoid top-k) or given routing, grouped expert GEMMs with the gated "
     "activation fused, optional shared expert; backward to hidden, router and experts; deterministic",
     moe_supports, moe_forward, moe_backward},
    {sizeof(kcpp_layer), kModes, kDevices, 0, "Llama4TextMoe", "MoE/1",
     "MoE/1 under Llama 4's mapping name (routing 'sigmoid', apply_router_weight 'input', a shared expert)",
     moe_supports, moe_forward, moe_backward},
};

const kcpp_op kOps[] = {
    {sizeof(kcpp_op), kDevices, "load_balancing_loss",
     "router_logits [..., E], top_k, attention_mask? -> loss (f32), drouter_logits?: Transformers' "
     "load_balancing_loss_func and its gradient (grad_scale)",
     load_balancing_loss},
};

const kcpp_package kPackage = {
    .struct_size = sizeof(kcpp_package),
    .abi_version = KCPP_ABI_VERSION,
    .name = KCPP_PACKAGE_NAME,
    .version = KCPP_PACKAGE_VERSION,
    .layers = kLayers,
    .num_layers = static_cast<int32_t>(sizeof kLayers / sizeof kLayers[0]),
    .num_ops = static_cast<int32_t>(sizeof kOps / sizeof kOps[0]),
    .ops = kOps,
};

}  // namespace

extern "C" KCPP_EXPORT const kcpp_package* kcpp_package_v1(void) { return &kPackage; }
