// Package-side helpers for the C ABI (include/kcpp/abi.h): reading named arguments, checking them
// against the layer contract, and reporting the first problem through the context's error buffer.
//
//   kcpp_status forward(kcpp_context* ctx, const kcpp_arg* args, int32_t n) {
//     kcpp::kernel::Call c(ctx, args, n, "SiLU.forward");
//     DLTensor* x = c.tensor("x");
//     DLTensor* y = c.tensor("y");
//     c.same_shape(y, "y", x, "x");
//     c.same_dtype(y, "y", x, "x");
//     c.row_major(x, "x");
//     if (!c.ok()) return c.status();
//     ...
//   }
//
// A Call records only its first failure (later checks are no-ops), so a sequence of checks reads
// straight down and the message names the first thing that was wrong.  Header-only, no exceptions,
// no allocation: it may be included by any package.
#pragma once

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>

#include "kcpp/abi.h"
#include "kcpp/kernel/types.h"

namespace kcpp::kernel {

// Writes "what: message" into ctx->error (when there is a buffer) and returns `status`.
inline kcpp_status vreport(kcpp_context* ctx, kcpp_status status, const char* what, const char* fmt,
                           va_list ap) {
  if (ctx && ctx->error && ctx->error_size > 0) {
    int n = what && *what ? std::snprintf(ctx->error, ctx->error_size, "%s: ", what) : 0;
    if (n < 0) n = 0;
    if (static_cast<size_t>(n) < ctx->error_size)
      std::vsnprintf(ctx->error + n, ctx->error_size - static_cast<size_t>(n), fmt, ap);
  }
  return status;
}

inline kcpp_status report(kcpp_context* ctx, kcpp_status status, const char* what, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vreport(ctx, status, what, fmt, ap);
  va_end(ap);
  return status;
}

inline const char* dl_device_name(int32_t t) {
  switch (t) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return "cuda";
    case kDLCUDAHost: return "cuda_host";
    case kDLROCM: return "rocm";
    case kDLMetal: return "metal";
    case 14: return "xpu";  // kDLOneAPI (DLPack >= 0.7; Debian ships 0.6)
    default: return "device?";
  }
}

// The floating dtypes kernels take; false for anything else (ints, f64, vectors of lanes).
inline bool dtype_from_dl(DLDataType t, DType* out) {
  if (t.lanes != 1) return false;
  if (t.code == kDLFloat && t.bits == 32) return *out = DType::f32, true;
  if (t.code == kDLFloat && t.bits == 16) return *out = DType::f16, true;
  if (t.code == kDLBfloat && t.bits == 16) return *out = DType::bf16, true;
  return false;
}

// "f32", "bf16", "i64", ... for messages.
inline const char* dl_dtype_name(DLDataType t) {
  if (t.lanes != 1) return "vector";
  switch (t.code) {
    case kDLFloat: return t.bits == 64 ? "f64" : t.bits == 32 ? "f32" : t.bits == 16 ? "f16" : "float?";
    case kDLBfloat: return t.bits == 16 ? "bf16" : "bfloat?";
    case kDLInt: return t.bits == 64 ? "i64" : t.bits == 32 ? "i32" : t.bits == 8 ? "i8" : "int?";
    case kDLUInt: return t.bits == 8 ? "u8" : t.bits == 1 ? "bool" : "uint?";
    case 6: return "bool";  // kDLBool (DLPack >= 0.8)
    default: return "dtype?";
  }
}

inline int64_t numel(const DLTensor* t) {
  int64_t n = 1;
  for (int32_t i = 0; i < t->ndim; ++i) n *= t->shape[i];
  return n;
}

// Stride of dim d in elements (DLPack allows strides == NULL for compact row-major tensors).
inline int64_t stride(const DLTensor* t, int32_t d) {
  if (t->strides) return t->strides[d];
  int64_t s = 1;
  for (int32_t i = t->ndim - 1; i > d; --i) s *= t->shape[i];
  return s;
}

inline bool is_row_major(const DLTensor* t) {
  int64_t expect = 1;
  for (int32_t d = t->ndim - 1; d >= 0; --d) {
    if (t->shape[d] != 1 && stride(t, d) != expect) return false;
    expect *= t->shape[d];
  }
  return true;
}

// First element's address.
inline void* data_ptr(const DLTensor* t) { return static_cast<char*>(t->data) + t->byte_offset; }

class Call {
 public:
  Call(kcpp_context* ctx, const kcpp_arg* args, int32_t num_args, const char* what)
      : ctx_(ctx), args_(args), n_(args ? num_args : 0), what_(what) {}

  bool ok() const { return status_ == KCPP_OK; }
  kcpp_status status() const { return status_; }
  kcpp_context* context() const { return ctx_; }

  // Records a failure (only the first one is kept) and returns false.
  bool fail(kcpp_status s, const char* fmt, ...) {
    if (status_ != KCPP_OK) return false;
    status_ = s;
    va_list ap;
    va_start(ap, fmt);
    vreport(ctx_, s, what_, fmt, ap);
    va_end(ap);
    return false;
  }
  bool require(bool cond, const char* fmt, ...) {
    if (cond || status_ != KCPP_OK) return cond;
    status_ = KCPP_ERROR_INVALID_ARGUMENT;
    va_list ap;
    va_start(ap, fmt);
    vreport(ctx_, status_, what_, fmt, ap);
    va_end(ap);
    return false;
  }

  // The argument named `name` (nullptr when absent); every lookup is remembered for all_read().
  const kcpp_arg* find(const char* name) const {
    for (int32_t i = 0; i < n_; ++i)
      if (args_[i].name && std::strcmp(args_[i].name, name) == 0) {
        if (i < 64) read_ |= uint64_t{1} << i;
        return &args_[i];
      }
    return nullptr;
  }

  // Called once a call's arguments have all been read: fails, naming it, on an argument that no lookup
  // asked for (a misspelt name, one meaningless for this call, or one that a later version of the
  // contract added and this kernel does not know), which would otherwise be ignored without a word.
  // KCPP_ARG_NONE arguments and those past the 64th are not checked.
  bool all_read() {
    for (int32_t i = 0; i < n_ && i < 64 && ok(); ++i)
      if (!(read_ >> i & 1u) && args_[i].name && args_[i].kind != KCPP_ARG_NONE)
        fail(KCPP_ERROR_INVALID_ARGUMENT,
             "argument '%s' is not one this call reads (misspelt, meaningless without another argument, or added "
             "to the contract after this kernel's version): correct its name, drop it, or ask for a newer version "
             "of the package", args_[i].name);
    return ok();
  }

  // A tensor argument on the context's device.  Optional ones return nullptr when absent or NONE.
  DLTensor* tensor(const char* name, bool required = true) {
    const kcpp_arg* a = find(name);
    if (!a || a->kind == KCPP_ARG_NONE) {
      if (required) fail(KCPP_ERROR_INVALID_ARGUMENT, "missing tensor argument '%s'", name);
      return nullptr;
    }
    if (a->kind != KCPP_ARG_TENSOR || !a->value.tensor) {
      fail(KCPP_ERROR_INVALID_ARGUMENT, "argument '%s' must be a tensor", name);
      return nullptr;
    }
    DLTensor* t = a->value.tensor;
    if (!ok()) return t;
    if (t->ndim < 0 || (t->ndim > 0 && !t->shape)) {
      fail(KCPP_ERROR_INVALID_ARGUMENT, "tensor '%s' has no shape", name);
      return nullptr;
    }
    for (int32_t d = 0; d < t->ndim; ++d)
      if (t->shape[d] < 0) {
        fail(KCPP_ERROR_INVALID_ARGUMENT, "tensor '%s' has a negative extent in dim %d", name, d);
        return nullptr;
      }
    if (!t->data && numel(t) > 0) {
      fail(KCPP_ERROR_INVALID_ARGUMENT, "tensor '%s' has no data", name);
      return nullptr;
    }
    if (ctx_ && (t->device.device_type != ctx_->device.device_type ||
                 t->device.device_id != ctx_->device.device_id)) {
      fail(KCPP_ERROR_INVALID_ARGUMENT, "tensor '%s' is on %s:%d but the call runs on %s:%d", name,
           dl_device_name(t->device.device_type), t->device.device_id,
           dl_device_name(ctx_->device.device_type), ctx_->device.device_id);
      return nullptr;
    }
    return t;
  }

  int64_t integer(const char* name, int64_t fallback, bool required = false) {
    const kcpp_arg* a = find(name);
    if (!a || a->kind == KCPP_ARG_NONE) {
      if (required) fail(KCPP_ERROR_INVALID_ARGUMENT, "missing integer argument '%s'", name);
      return fallback;
    }
    if (a->kind != KCPP_ARG_INT) {
      fail(KCPP_ERROR_INVALID_ARGUMENT, "argument '%s' must be an integer", name);
      return fallback;
    }
    return a->value.i;
  }

  // Floats accept integer arguments too (eps = 0).
  double real(const char* name, double fallback, bool required = false) {
    const kcpp_arg* a = find(name);
    if (!a || a->kind == KCPP_ARG_NONE) {
      if (required) fail(KCPP_ERROR_INVALID_ARGUMENT, "missing float argument '%s'", name);
      return fallback;
    }
    if (a->kind == KCPP_ARG_INT) return static_cast<double>(a->value.i);
    if (a->kind != KCPP_ARG_FLOAT) {
      fail(KCPP_ERROR_INVALID_ARGUMENT, "argument '%s' must be a float", name);
      return fallback;
    }
    return a->value.f;
  }

  const char* string(const char* name, const char* fallback, bool required = false) {
    const kcpp_arg* a = find(name);
    if (!a || a->kind == KCPP_ARG_NONE) {
      if (required) fail(KCPP_ERROR_INVALID_ARGUMENT, "missing string argument '%s'", name);
      return fallback;
    }
    if (a->kind != KCPP_ARG_STRING || !a->value.s) {
      fail(KCPP_ERROR_INVALID_ARGUMENT, "argument '%s' must be a string", name);
      return fallback;
    }
    return a->value.s;
  }

  // ---- checks (no-ops after the first failure, and on null tensors: a missing one already failed)

  bool float_dtype(const DLTensor* t, const char* name, DType* out) {
    if (!t || !ok()) return false;
    if (dtype_from_dl(t->dtype, out)) return true;
    return fail(KCPP_ERROR_UNSUPPORTED, "tensor '%s' has dtype %s; this kernel takes f32, bf16 or f16", name,
                dl_dtype_name(t->dtype));
  }
  bool same_dtype(const DLTensor* a, const char* an, const DLTensor* b, const char* bn) {
    if (!a || !b || !ok()) return ok();
    if (a->dtype.code == b->dtype.code && a->dtype.bits == b->dtype.bits && a->dtype.lanes == b->dtype.lanes)
      return true;
    return fail(KCPP_ERROR_INVALID_ARGUMENT, "tensor '%s' is %s but '%s' is %s", an, dl_dtype_name(a->dtype), bn,
                dl_dtype_name(b->dtype));
  }
  bool same_shape(const DLTensor* a, const char* an, const DLTensor* b, const char* bn) {
    if (!a || !b || !ok()) return ok();
    bool same = a->ndim == b->ndim;
    for (int32_t d = 0; same && d < a->ndim; ++d) same = a->shape[d] == b->shape[d];
    if (same) return true;
    char sa[128], sb[128];
    return fail(KCPP_ERROR_INVALID_ARGUMENT, "tensor '%s' has shape %s but '%s' has shape %s", an,
                shape_str(a, sa, sizeof sa), bn, shape_str(b, sb, sizeof sb));
  }
  bool ndim(const DLTensor* t, const char* name, int32_t n) {
    if (!t || !ok()) return ok();
    if (t->ndim == n) return true;
    char s[128];
    return fail(KCPP_ERROR_INVALID_ARGUMENT, "tensor '%s' must have %d dims, has shape %s", name, n,
                shape_str(t, s, sizeof s));
  }
  // Row-major and dense (the kernel walks it as a flat array).
  bool row_major(const DLTensor* t, const char* name) {
    if (!t || !ok()) return ok();
    if (is_row_major(t)) return true;
    return fail(KCPP_ERROR_UNSUPPORTED, "tensor '%s' is not contiguous (row-major); this kernel needs it", name);
  }

  // A tensor [..., W] seen as rows of W elements: the last dim contiguous, the leading dims
  // collapsing to one row stride (any contiguous tensor, a row slice of a wider one, ...).
  bool rows(const DLTensor* t, const char* name, int64_t* rows, int64_t* width, int64_t* row_stride) {
    if (!t || !ok()) return false;
    if (t->ndim < 1) return require(false, "tensor '%s' must have at least one dim", name);
    const int32_t last = t->ndim - 1;
    *width = t->shape[last];
    *rows = 1;
    for (int32_t d = 0; d < last; ++d) *rows *= t->shape[d];
    if (*width > 1 && stride(t, last) != 1)
      return fail(KCPP_ERROR_UNSUPPORTED, "tensor '%s': the last dim must be contiguous (stride 1, got %lld)", name,
                  static_cast<long long>(stride(t, last)));
    *row_stride = *width;
    int64_t expect = -1;  // the stride the next-outer dim must have to collapse
    for (int32_t d = last - 1; d >= 0; --d) {
      if (t->shape[d] == 1) continue;
      if (expect < 0) *row_stride = stride(t, d);
      else if (stride(t, d) != expect)
        return fail(KCPP_ERROR_UNSUPPORTED, "tensor '%s': leading dims do not collapse to rows of one stride", name);
      expect = stride(t, d) * t->shape[d];
    }
    if (*rows > 1 && *row_stride < *width)
      return fail(KCPP_ERROR_UNSUPPORTED, "tensor '%s': rows overlap (row stride %lld < width %lld)", name,
                  static_cast<long long>(*row_stride), static_cast<long long>(*width));
    return true;
  }

  // A string argument that must be one of `choices` (a null-terminated list); returns its index, or
  // `fallback` when absent.  Unknown values are INVALID_ARGUMENT naming the choices.
  int choice(const char* name, int fallback, const char* const* choices) {
    const char* s = string(name, nullptr);
    if (!s || !ok()) return fallback;
    for (int i = 0; choices[i]; ++i)
      if (std::strcmp(s, choices[i]) == 0) return i;
    char list[160] = {};
    size_t at = 0;
    for (int i = 0; choices[i] && at < sizeof list; ++i)
      at += static_cast<size_t>(std::snprintf(list + at, sizeof list - at, i ? ", '%s'" : "'%s'", choices[i]));
    fail(KCPP_ERROR_INVALID_ARGUMENT, "argument '%s' is '%s'; expected one of %s", name, s, list);
    return fallback;
  }

  // The context's device is CPU, or CUDA when `cuda` is true; anything else is UNSUPPORTED.
  bool device_in(bool cuda) {
    if (!ok()) return false;
    if (!ctx_) return fail(KCPP_ERROR_INVALID_ARGUMENT, "no call context");
    const int32_t t = ctx_->device.device_type;
    if (t == kDLCPU || (cuda && t == kDLCUDA)) return true;
    return fail(KCPP_ERROR_UNSUPPORTED, "runs on the CPU%s, not on %s", cuda ? " and CUDA" : "", dl_device_name(t));
  }
  bool on_cuda() const { return ctx_ && ctx_->device.device_type == kDLCUDA; }

  // `bytes` of workspace from the host (nullptr after recording the failure).
  void* workspace(size_t bytes) {
    if (!ok()) return nullptr;
    if (!ctx_ || !ctx_->workspace) {
      fail(KCPP_ERROR_UNSUPPORTED, "needs a workspace allocator (%zu bytes) and the context has none", bytes);
      return nullptr;
    }
    void* p = ctx_->workspace(ctx_->workspace_host, bytes);
    if (!p) fail(KCPP_ERROR_OUT_OF_MEMORY, "the workspace allocator could not give %zu bytes", bytes);
    return p;
  }

  // A tensor `t` (named `name` in the message) of exactly the shape `dims`; true, and nothing
  // checked, when `t` is absent or an earlier check failed.
  bool shape_is(const DLTensor* t, const char* name, std::initializer_list<int64_t> dims) {
    if (!t || !ok()) return ok();
    bool same = t->ndim == static_cast<int32_t>(dims.size());
    int32_t i = 0;
    for (int64_t d : dims) same = same && t->shape[i++] == d;
    if (same) return true;
    char want[160], got[160];
    size_t at = static_cast<size_t>(std::snprintf(want, sizeof want, "["));
    i = 0;
    for (int64_t d : dims)
      if (at < sizeof want)
        at += static_cast<size_t>(std::snprintf(want + at, sizeof want - at, i++ ? ", %lld" : "%lld", static_cast<long long>(d)));
    if (at < sizeof want) std::snprintf(want + at, sizeof want - at, "]");
    return require(false, "tensor '%s' has shape %s; expected %s", name, shape_str(t, got, sizeof got), want);
  }

  // The call's status after a kernel-level entry point returned `err` (an error message, or null):
  // a message is recorded as an invalid argument.
  kcpp_status finish(const char* err) {
    if (err) fail(KCPP_ERROR_INVALID_ARGUMENT, "%s", err);
    return status();
  }

  static const char* shape_str(const DLTensor* t, char* buf, size_t size) {
    size_t at = 0;
    at += static_cast<size_t>(std::snprintf(buf, size, "["));
    for (int32_t d = 0; d < t->ndim && at < size; ++d)
      at += static_cast<size_t>(std::snprintf(buf + at, size - at, d ? ", %lld" : "%lld",
                                              static_cast<long long>(t->shape[d])));
    if (at < size) std::snprintf(buf + at, size - at, "]");
    return buf;
  }

 private:
  kcpp_context* ctx_;
  const kcpp_arg* args_;
  int32_t n_;
  const char* what_;
  kcpp_status status_ = KCPP_OK;
  mutable uint64_t read_ = 0;  // bit i: args_[i] was looked up (find)
};

}  // namespace kcpp::kernel
