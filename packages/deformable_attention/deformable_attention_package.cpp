// Package "deformable_attention": the ABI table (include/kcpp/abi.h) over msda.h.
//
//   MultiScaleDeformableAttention   MultiScaleDeformableAttention/1   msda.h   forward, backward
//
// The named arguments are those of docs/contracts/MultiScaleDeformableAttention.md.  supports() runs the
// same checks as the call without running it.
#include <cstdio>
#include <initializer_list>

#include "kcpp/abi.h"
#include "kcpp/kernel/abi_args.h"
#include "msda.h"

#ifndef KCPP_WITH_CUDA
#define KCPP_WITH_CUDA 0
#endif

namespace {

namespace kk = kcpp::kernel;
namespace km = kcpp::msda;

constexpr bool kCuda = KCPP_WITH_CUDA != 0;

// A contiguous tensor of the dtype of 'value' and the given shape.
const void* like_value(kk::Call& c, const DLTensor* t, const char* name, const DLTensor* value,
                       std::initializer_list<int64_t> dims) {
  if (!t || !c.ok()) return nullptr;
  if (!c.same_dtype(t, name, value, "value") || !c.shape_is(t, name, dims)) return nullptr;
  if (kk::numel(t) > 0 && !c.row_major(t, name)) return nullptr;
  return kk::data_ptr(t);
}

const int64_t* index_tensor(kk::Call& c, const DLTensor* t, const char* name, std::initializer_list<int64_t> dims) {
  if (!t || !c.ok()) return nullptr;
  if (t->dtype.code != kDLInt || t->dtype.bits != 64 || t->dtype.lanes != 1) {
    c.require(false, "tensor '%s' must be int64, is %s", name, kk::dl_dtype_name(t->dtype));
    return nullptr;
  }
  if (!c.shape_is(t, name, dims) || (kk::numel(t) > 0 && !c.row_major(t, name))) return nullptr;
  return static_cast<const int64_t*>(kk::data_ptr(t));
}

bool distinct(kk::Call& c, const void* out, const char* name, std::initializer_list<const void*> others) {
  if (!c.ok() || !out) return c.ok();
  for (const void* o : others)
    if (o == out) return c.require(false, "tensor '%s' must not overlap an input or another output", name);
  return true;
}

bool msda_args(kk::Call& c, bool bwd, km::MsdaParams& p) {
  c.device_in(kCuda);
  DLTensor* value = c.tensor("value");
  DLTensor* shapes = c.tensor("value_spatial_shapes");
  DLTensor* starts = c.tensor("value_level_start_index");
  DLTensor* loc = c.tensor("sampling_locations");
  DLTensor* attn = c.tensor("attention_weights");
  c.integer("im2col_step", 64);  // accepted, not used
  if (!c.ok()) return false;
  c.float_dtype(value, "value", &p.dtype);
  if (!c.ndim(value, "value", 4) || !c.ndim(loc, "sampling_locations", 6)) return false;
  p.batch = value->shape[0], p.seq = value->shape[1], p.heads = value->shape[2], p.channels = value->shape[3];
  p.queries = loc->shape[1], p.levels = loc->shape[3], p.points = loc->shape[4];
  const int64_t B = p.batch, Q = p.queries, M = p.heads, L = p.levels, P = p.points, C = p.channels;
  if (!c.require(L >= 1, "tensor 'sampling_locations' has no levels (dim 3 is 0)")) return false;
  if (kk::numel(value) > 0 && !c.row_major(value, "value")) return false;
  p.value = kk::data_ptr(value);
  p.spatial_shapes = index_tensor(c, shapes, "value_spatial_shapes", {L, 2});
  p.level_start = index_tensor(c, starts, "value_level_start_index", {L});
  p.loc = like_value(c, loc, "sampling_locations", value, {B, Q, M, L, P, 2});
  p.attn = like_value(c, attn, "attention_weights", value, {B, Q, M, L, P});
  if (!c.ok()) return false;
  if (!bwd) {
    p.out = const_cast<void*>(like_value(c, c.tensor("out"), "out", value, {B, Q, M * C}));
    if (B * Q * M * C > 0) distinct(c, p.out, "out", {p.value, p.loc, p.attn});
    return c.all_read();  // an argument the call does not read is refused, naming it
  }
  p.dout = like_value(c, c.tensor("dout"), "dout", value, {B, Q, M * C});
  p.dvalue = const_cast<void*>(like_value(c, c.tensor("dvalue"), "dvalue", value, {B, p.seq, M, C}));
  p.dloc = const_cast<void*>(like_value(c, c.tensor("dsampling_locations"), "dsampling_locations", value, {B, Q, M, L, P, 2}));
  p.dattn = const_cast<void*>(like_value(c, c.tensor("dattention_weights"), "dattention_weights", value, {B, Q, M, L, P}));
  if (!c.ok()) return false;
  const std::initializer_list<const void*> ins = {p.value, p.loc, p.attn, p.dout};
  if (B * p.seq * M * C > 0) distinct(c, p.dvalue, "dvalue", ins), distinct(c, p.dvalue, "dvalue", {p.dloc, p.dattn});
  if (B * Q * M * P > 0)
    distinct(c, p.dloc, "dsampling_locations", ins), distinct(c, p.dattn, "dattention_weights", ins),
        distinct(c, p.dloc, "dsampling_locations", {p.dattn});
  return c.all_read();
}

kcpp_status msda_supports(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "MultiScaleDeformableAttention");
  km::MsdaParams p;
  msda_args(c, c.find("dout") != nullptr, p);
  return c.status();
}

kcpp_status msda_forward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "MultiScaleDeformableAttention.forward");
  km::MsdaParams p;
  if (!msda_args(c, false, p)) return c.status();
#if KCPP_WITH_CUDA
  if (c.on_cuda()) return c.finish(km::msda_forward_cuda(p, static_cast<cudaStream_t>(ctx->stream)));
#endif
  return c.finish(km::msda_forward_cpu(p));
}

kcpp_status msda_backward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
  kk::Call c(ctx, args, n, "MultiScaleDeformableAttention.backward");
  km::MsdaParams p;
  if (!msda_args(c, true, p)) return c.status();
#if KCPP_WITH_CUDA
  if (c.on_cuda()) {
    if (const size_t bytes = km::msda_workspace_bytes(p)) {
      p.workspace = static_cast<float*>(c.workspace(bytes));
      if (!p.workspace) return c.status();
    }
    return c.finish(km::msda_backward_cuda(p, static_cast<cudaStream_t>(ctx->stream)));
  }
#endif
  return c.finish(km::msda_backward_cpu(p));
}

constexpr uint32_t kDevices = KCPP_DEVICE_BIT(kDLCPU) | (kCuda ? KCPP_DEVICE_BIT(kDLCUDA) : 0u);
constexpr uint32_t kModes = KCPP_MODE_INFERENCE | KCPP_MODE_TRAINING | KCPP_MODE_GRAPH;

const kcpp_layer kLayers[] = {
    {sizeof(kcpp_layer), kModes, kDevices, 0, "MultiScaleDeformableAttention", "MultiScaleDeformableAttention/1",
     "Deformable DETR's multi-scale deformable attention: bilinear samples (grid_sample, align_corners=False, zero "
     "padding) over multi-level value maps weighted per query and head; CUDA dvalue by f32 atomics (not bitwise "
     "reproducible), CPU reproducible",
     msda_supports, msda_forward, msda_backward},
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
