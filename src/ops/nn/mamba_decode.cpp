#include "ops/nn/mamba_decode.h"

#include <cstdint>
#include <cstdlib>
#include <string>

#include "ops/check.h"
#include "ops/cuda/launch.h"
#include "ops/nn/decode_fused.h"

namespace kcpp::ops {
namespace {

constexpr int64_t kMaxConvWidth = 4;  // Mamba's conv_kernel (4 in every released model)

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data()) % 16 == 0; }

// bf16 / f16 on CUDA: the ops' reach (the header).
void check_cuda16(const Tensor& t, const char* op, const char* arg) {
  KCPP_CHECK(t.device().is_cuda() && (t.dtype() == DType::bf16 || t.dtype() == DType::f16),
             "op {}: runs on CUDA in bf16 or f16 only (argument '{}' is {} on {}); mamba_decode_fused() says when, and the "
             "model's slots run the step elsewhere",
             op, arg, dtype_name(t.dtype()), t.device().str());
}

// 1 .. kFusedLinearMaxRows rows.
void check_rows(const Tensor& t, const char* op, const char* arg) {
  KCPP_CHECK(t.size(0) >= 1 && t.size(0) <= kFusedLinearMaxRows, "op {}: {} rows (argument '{}'); it takes 1 to {}", op,
             t.size(0), arg, kFusedLinearMaxRows);
}

void check_contiguous(const Tensor& t, const char* op, const char* arg) {
  KCPP_CHECK(t.is_contiguous(), "op {}: argument '{}' {} must be contiguous", op, arg, shape_str(t.shape()));
}

void check_f32(const Tensor& t, const Tensor& ref, const Shape& shape, const char* op, const char* arg) {
  check_defined(t, op, arg);
  KCPP_CHECK(t.dtype() == DType::f32, "op {}: argument '{}' must be f32, got {}", op, arg, dtype_name(t.dtype()));
  KCPP_CHECK(t.device() == ref.device(), "op {}: argument '{}' is on {} but the step is on {}", op, arg, t.device().str(),
             ref.device().str());
  check_shape(t, shape, op, arg);
  check_contiguous(t, op, arg);
}

}  // namespace

bool mamba_decode_fused(Device device, DType dtype, const MambaDecodeShape& shape) {
#if KCPP_WITH_CUDA
  auto env_is = [](const char* name, const char* value) {
    const char* e = std::getenv(name);
    return e && std::string(e) == value;
  };
  if (env_is("KCPP_MAMBA_DECODE_FUSED", "0") || env_is("KCPP_DECODE_FUSED", "0")) return false;
  const int64_t m = shape.rows;
  return device.is_cuda() && (dtype == DType::bf16 || dtype == DType::f16) && m >= 1 && m <= kFusedLinearMaxRows &&
         shape.hidden % 8 == 0 && 2 * m * shape.hidden <= kMambaRowsBytes && shape.conv_width >= 1 &&
         shape.conv_width <= kMaxConvWidth && 4 * m * (shape.rank + 2 * shape.states) <= kMambaStageBytes;
#else
  (void)device, (void)dtype, (void)shape;
  return false;
#endif
}

MambaNormInProj mamba_norm_in_proj(const Tensor& x, const Tensor& delta, const Tensor& norm_weight, const RMSNormOptions& opt,
                                   const Tensor& w_in, const Tensor& b_in, const Tensor& conv_state, const Tensor& conv_w,
                                   const Tensor& conv_b) {
  constexpr const char* op = "mamba_norm_in_proj";
  check_defined(w_in, op, "w_in");
  check_dims(w_in, 2, op, "w_in");
  check_cuda16(w_in, op, "w_in");
  check_contiguous(w_in, op, "w_in");
  check_defined(x, op, "x");
  check_dims(x, 2, op, "x");
  KCPP_CHECK(x.dtype() == w_in.dtype() || x.dtype() == DType::f32, "op {}: x is {}; it must be f32 or w_in's {}", op,
             dtype_name(x.dtype()), dtype_name(w_in.dtype()));
  KCPP_CHECK(x.device() == w_in.device(), "op {}: argument 'x' is on {} but w_in is on {}", op, x.device().str(),
             w_in.device().str());
  check_contiguous(x, op, "x");
  check_rows(x, op, "x");
  const int64_t m = x.size(0), h = x.size(1);
  KCPP_CHECK(w_in.size(1) == h && w_in.size(0) % 2 == 0 && w_in.size(0) > 0,
             "op {}: w_in {} must be [2 D, {}] to take rows of x {}", op, shape_str(w_in.shape()), h, shape_str(x.shape()));
  const int64_t d = w_in.size(0) / 2;
  if (delta.defined()) {
    check_same(delta, w_in, op, "delta", "w_in");
    check_shape(delta, x.shape(), op, "delta");
    check_contiguous(delta, op, "delta");
  }
  check_same(norm_weight, w_in, op, "norm_weight", "w_in");
  check_shape(norm_weight, {h}, op, "norm_weight");
  check_contiguous(norm_weight, op, "norm_weight");
  KCPP_CHECK(opt.eps >= 0, "op {}: eps {} < 0", op, opt.eps);
  KCPP_CHECK(opt.casting == RMSNormCasting::Llama || opt.casting == RMSNormCasting::Gemma,
             "op {}: the norm's casting must be Llama's or Gemma's", op);
  if (b_in.defined()) {
    check_same(b_in, w_in, op, "b_in", "w_in");
    check_shape(b_in, {2 * d}, op, "b_in");
    check_contiguous(b_in, op, "b_in");
  }
  check_same(conv_w, w_in, op, "conv_w", "w_in");
  check_dims(conv_w, 2, op, "conv_w");
  check_contiguous(conv_w, op, "conv_w");
  const int64_t width = conv_w.size(1);
  KCPP_CHECK(conv_w.size(0) == d && width >= 1 && width <= kMaxConvWidth,
             "op {}: conv_w {} must be [{}, width] with width 1 to {}", op, shape_str(conv_w.shape()), d, kMaxConvWidth);
  check_same(conv_state, w_in, op, "conv_state", "w_in");
  check_dims(conv_state, 3, op, "conv_state");
  check_contiguous(conv_state, op, "conv_state");
  KCPP_CHECK(conv_state.size(0) == m && conv_state.size(1) == d && conv_state.size(2) >= width - 1 &&
                 conv_state.size(2) <= kMaxConvWidth,
             "op {}: conv_state {} must be [{}, {}, K] with {} <= K <= {} (the convolution's width - 1 at least)", op,
             shape_str(conv_state.shape()), m, d, width - 1, kMaxConvWidth);
  if (conv_b.defined()) {
    check_same(conv_b, w_in, op, "conv_b", "w_in");
    check_shape(conv_b, {d}, op, "conv_b");
    check_contiguous(conv_b, op, "conv_b");
  }
  KCPP_CHECK(h % 8 == 0 && 2 * m * h <= kMambaRowsBytes,
             "op {}: x has {} row(s) of {} elements; the kernel takes widths that are multiples of 8, and up to {} bytes of "
             "rows in all",
             op, m, h, kMambaRowsBytes);
  KCPP_CHECK(d <= (int64_t{1} << 29), "op {}: {} channels is more than the kernel indexes", op, d);
  for (const auto& [t, arg] : {std::pair{&x, "x"}, std::pair{&w_in, "w_in"}, std::pair{&norm_weight, "norm_weight"},
                               std::pair{&delta, "delta"}})
    KCPP_CHECK(!t->defined() || aligned16(*t), "op {}: argument '{}' must start on a 16-byte boundary (the kernel's vector loads)",
               op, arg);
  MambaNormInProj r;
  r.s = delta.defined() ? Tensor::empty(x.shape(), x.dtype(), x.device()) : x;
  r.xz = Tensor::empty({m, 2 * d}, w_in.dtype(), x.device());
  r.xc = Tensor::empty({m, d}, w_in.dtype(), x.device());
#if KCPP_WITH_CUDA
  KCPP_CHECK(cuda::mamba_norm_in_proj(r.xz, delta.defined() ? r.s : Tensor(), r.xc, x, delta, norm_weight, opt, w_in, b_in,
                                      conv_state, conv_w, conv_b),
             "op {}: rows of {} elements x {} do not fit in a block's shared memory", op, h, m);
#endif
  return r;
}

Tensor mamba_ssm_step(const MambaSsmStep& s) {
  constexpr const char* op = "mamba_ssm_step";
  check_defined(s.xz, op, "xz");
  check_dims(s.xz, 2, op, "xz");
  check_cuda16(s.xz, op, "xz");
  check_rows(s.xz, op, "xz");
  check_contiguous(s.xz, op, "xz");
  const int64_t m = s.xz.size(0), d = s.xz.size(1) / 2;
  KCPP_CHECK(s.xz.size(1) == 2 * d, "op {}: xz has {} columns; it must hold x and z halves of equal width", op, s.xz.size(1));
  check_same(s.xc, s.xz, op, "xc", "xz");
  check_shape(s.xc, {m, d}, op, "xc");
  check_contiguous(s.xc, op, "xc");
  check_same(s.w_dt, s.xz, op, "w_dt", "xz");
  check_dims(s.w_dt, 2, op, "w_dt");
  check_contiguous(s.w_dt, op, "w_dt");
  const int64_t r = s.w_dt.size(1);
  KCPP_CHECK(s.w_dt.size(0) == d && r >= 1, "op {}: w_dt {} must be [{}, rank]", op, shape_str(s.w_dt.shape()), d);
  check_defined(s.A, op, "A");
  check_dims(s.A, 2, op, "A");
  const int64_t n = s.A.size(1);
  KCPP_CHECK(n >= 1, "op {}: A {} has no states", op, shape_str(s.A.shape()));
  check_f32(s.A, s.xz, {d, n}, op, "A");
  if (s.dt_bias.defined()) check_f32(s.dt_bias, s.xz, {d}, op, "dt_bias");
  if (s.D.defined()) check_f32(s.D, s.xz, {d}, op, "D");
  check_f32(s.ssm_state, s.xz, {m, d, n}, op, "ssm_state");
  check_same(s.xdbl, s.xz, op, "xdbl", "xz");
  check_shape(s.xdbl, {m, r + 2 * n}, op, "xdbl");
  check_contiguous(s.xdbl, op, "xdbl");
  for (const auto& [eps, name] : {std::pair{s.dt_rms_eps, "dt_rms_eps"}, std::pair{s.bc_rms_eps, "bc_rms_eps"}})
    KCPP_CHECK(!eps || *eps >= 0, "op {}: {} is {}; it must be >= 0", op, name, *eps);
  KCPP_CHECK(static_cast<int64_t>(sizeof(float)) * m * (r + 2 * n) <= kMambaStageBytes && d <= (int64_t{1} << 30),
             "op {}: rank {} and {} states over {} rows exceed the kernel's {} bytes of staging", op, r, n, m, kMambaStageBytes);
  const Tensor y = Tensor::empty({m, d}, s.xz.dtype(), s.xz.device());
#if KCPP_WITH_CUDA
  if (d > 0) cuda::mamba_ssm_step(y, s);
#endif
  return y;
}

}  // namespace kcpp::ops
