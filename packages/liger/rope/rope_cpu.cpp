// RoPE on the CPU (maths in rope.h): tokens in parallel, each head's rotary part widened to f32.
#include <cstring>
#include <vector>

#include "kcpp/kernel/cpu.h"
#include "kcpp/kernel/error.h"
#include "rope.h"

namespace kcpp::liger {
namespace {

using kernel::cpu::load_row;
using kernel::cpu::store_row;

template <typename T, bool Backward> void run(const RopeParams& p) {
  const int64_t d = p.head_dim, rd = p.rotary_dim, half = rd / 2;
  const bool il = p.layout == RopeLayout::Interleaved;
#pragma omp parallel
  {
    std::vector<float> c(rd), s(rd), x(rd), y(rd);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < p.batch * p.seq; ++t) {
      const int64_t b = t / p.seq, si = t % p.seq;
      load_row(static_cast<const T*>(p.cos) + b * p.cs_stride_b + si * p.cs_stride_s, rd, c.data());
      load_row(static_cast<const T*>(p.sin) + b * p.cs_stride_b + si * p.cs_stride_s, rd, s.data());
      for (const RopeOperand* op : {&p.q, &p.k}) {
        for (int64_t h = 0; h < op->heads; ++h) {
          const T* in = static_cast<const T*>(op->in) + b * op->in_stride_b + si * op->in_stride_s + h * op->in_stride_h;
          T* out = static_cast<T*>(op->out) + b * op->out_stride_b + si * op->out_stride_s + h * op->out_stride_h;
          load_row(in, rd, x.data());
          for (int64_t j = 0; j < half; ++j) {
            const int64_t pi = il ? 2 * j : j, qi = il ? 2 * j + 1 : j + half;
            const float a = x[pi], bq = x[qi];
            if (Backward) {
              y[pi] = a * c[pi] + bq * s[qi];
              y[qi] = bq * c[qi] - a * s[pi];
            } else {
              y[pi] = a * c[pi] - bq * s[pi];
              y[qi] = bq * c[qi] + a * s[qi];
            }
          }
          store_row(y.data(), rd, out);
          if (out != in && d > rd) std::memcpy(out + rd, in + rd, static_cast<size_t>(d - rd) * sizeof(T));
        }
      }
    }
  }
}

template <bool Backward> const char* dispatch(const RopeParams& p) {
  if (const char* e = rope_check(p)) return e;
  switch (p.dtype) {
    case kernel::DType::f32: run<float, Backward>(p); break;
    case kernel::DType::bf16: run<kernel::cpu::bf16, Backward>(p); break;
    case kernel::DType::f16: run<kernel::cpu::f16, Backward>(p); break;
  }
  return nullptr;
}

const char* check_operand(const RopeOperand& o, const char* name, int64_t d) {
  if (o.heads == 0) return nullptr;
  KCPP_KERNEL_REQUIRE(o.heads > 0, "rope: argument '%s': heads = %lld < 0", name, static_cast<long long>(o.heads));
  KCPP_KERNEL_REQUIRE(o.in && o.out, "rope: argument '%s': input and output must not be null", name);
  KCPP_KERNEL_REQUIRE(o.in_stride_h >= d || o.heads == 1, "rope: argument '%s': head stride %lld < head_dim %lld", name,
                      static_cast<long long>(o.in_stride_h), static_cast<long long>(d));
  KCPP_KERNEL_REQUIRE(o.out_stride_h >= d || o.heads == 1, "rope: output of '%s': head stride %lld < head_dim %lld", name,
                      static_cast<long long>(o.out_stride_h), static_cast<long long>(d));
  KCPP_KERNEL_REQUIRE(o.in != o.out || (o.in_stride_b == o.out_stride_b && o.in_stride_s == o.out_stride_s &&
                                        o.in_stride_h == o.out_stride_h),
                      "rope: argument '%s': in-place output must have the input's strides", name);
  return nullptr;
}

}  // namespace

const char* rope_check(const RopeParams& p) {
  KCPP_KERNEL_REQUIRE(p.dtype == kernel::DType::f32 || p.dtype == kernel::DType::bf16 || p.dtype == kernel::DType::f16,
                      "rope: unsupported dtype %d", static_cast<int>(p.dtype));
  KCPP_KERNEL_REQUIRE(p.layout == RopeLayout::RotateHalf || p.layout == RopeLayout::Interleaved,
                      "rope: unknown layout %d", static_cast<int>(p.layout));
  KCPP_KERNEL_REQUIRE(p.batch >= 0 && p.seq >= 0, "rope: batch and seq must be >= 0");
  KCPP_KERNEL_REQUIRE(p.rotary_dim > 0 && p.rotary_dim % 2 == 0 && p.rotary_dim <= p.head_dim,
                      "rope: rotary_dim %lld must be even, > 0 and <= head_dim %lld",
                      static_cast<long long>(p.rotary_dim), static_cast<long long>(p.head_dim));
  KCPP_KERNEL_REQUIRE(p.q.heads > 0, "rope: argument 'q' needs at least one head");
  KCPP_KERNEL_REQUIRE((p.q.heads + p.k.heads) * p.head_dim < (int64_t(1) << 30),
                      "rope: %lld heads of %lld per token is more than this kernel indexes",
                      static_cast<long long>(p.q.heads + p.k.heads), static_cast<long long>(p.head_dim));
  KCPP_KERNEL_REQUIRE(p.cos && p.sin, "rope: arguments 'cos' and 'sin' must not be null");
  KCPP_KERNEL_REQUIRE(p.cs_stride_s >= p.rotary_dim || p.seq <= 1, "rope: cos/sin row stride %lld < rotary_dim %lld",
                      static_cast<long long>(p.cs_stride_s), static_cast<long long>(p.rotary_dim));
  if (const char* e = check_operand(p.q, "q", p.head_dim)) return e;
  return check_operand(p.k, "k", p.head_dim);
}

const char* rope_forward_cpu(const RopeParams& p) { return dispatch<false>(p); }
const char* rope_backward_cpu(const RopeParams& p) { return dispatch<true>(p); }

}  // namespace kcpp::liger
