// GLU on the CPU (maths in glu.h): pieces of rows in parallel, each widened to f32, computed in a
// loop the compiler vectorizes, and rounded back.
#include <algorithm>
#include <vector>

#include "glu.h"
#include "kcpp/kernel/activation.h"
#include "kcpp/kernel/cpu.h"
#include "kcpp/kernel/error.h"

namespace kcpp::liger {
namespace {

using kernel::cpu::load_row;
using kernel::cpu::store_row;
constexpr int64_t kChunk = 4096;
// 16-bit outputs take Fast; f32 FastExp (the vectorizable exp_f32, tanh_f32 and normal_cdf_f32, within
// 1, 3 and 6 ulps of expf, tanhf and Phi).
template <typename T> constexpr kernel::MathMode fast_for() {
  return sizeof(T) == 2 ? kernel::MathMode::Fast : kernel::MathMode::FastExp;
}

// The work as rows of `cols` elements (one row of n when flat), cut into pieces of at most kChunk.
struct Rows {
  int64_t rows, cols, pieces_a_row;
  Rows(const GluParams& p)
      : rows(p.cols > 0 ? p.n / p.cols : 1), cols(p.cols > 0 ? p.cols : p.n), pieces_a_row((cols + kChunk - 1) / kChunk) {}
  int64_t pieces() const { return rows * pieces_a_row; }
};
// Element offset of (row r, column c) in a tensor whose rows are `ld` apart (flat: r is 0).
inline int64_t at(const GluParams& p, int64_t ld, int64_t r, int64_t c) { return (p.cols > 0 ? r * ld : 0) + c; }

template <typename T, GluActivation A> KCPP_CPU_MULTIVERSION void forward(const GluParams& p) {
  const Rows w(p);
#pragma omp parallel
  {
    float g[kChunk], u[kChunk];
#pragma omp for schedule(static)
    for (int64_t k = 0; k < w.pieces(); ++k) {
      const int64_t r = k / w.pieces_a_row, b = (k % w.pieces_a_row) * kChunk, m = std::min(kChunk, w.cols - b);
      load_row(static_cast<const T*>(p.gate) + at(p, p.gate_ld, r, b), m, g);
      load_row(static_cast<const T*>(p.up) + at(p, p.up_ld, r, b), m, u);
      for (int64_t i = 0; i < m; ++i) g[i] = kernel::activate<A, fast_for<T>()>(g[i], nullptr) * u[i];
      store_row(g, m, static_cast<T*>(p.out) + at(p, p.out_ld, r, b));
    }
  }
}

template <typename T, GluActivation A> KCPP_CPU_MULTIVERSION void backward(const GluParams& p) {
  const Rows w(p);
#pragma omp parallel
  {
    float g[kChunk], u[kChunk], d[kChunk];
#pragma omp for schedule(static)
    for (int64_t k = 0; k < w.pieces(); ++k) {
      const int64_t r = k / w.pieces_a_row, b = (k % w.pieces_a_row) * kChunk, m = std::min(kChunk, w.cols - b);
      load_row(static_cast<const T*>(p.gate) + at(p, p.gate_ld, r, b), m, g);
      load_row(static_cast<const T*>(p.up) + at(p, p.up_ld, r, b), m, u);
      load_row(static_cast<const T*>(p.dout) + at(p, p.dout_ld, r, b), m, d);
      for (int64_t i = 0; i < m; ++i) {  // all three read before either output is written (in-place safe)
        float da;
        const float a = kernel::activate<A, fast_for<T>()>(g[i], &da);
        g[i] = d[i] * u[i] * da;  // dgate
        u[i] = d[i] * a;          // dup
      }
      store_row(g, m, static_cast<T*>(p.dgate) + at(p, p.dgate_ld, r, b));
      store_row(u, m, static_cast<T*>(p.dup) + at(p, p.dup_ld, r, b));
    }
  }
}

template <bool Backward> const char* run(const GluParams& p) {
  if (const char* e = glu_check(p, Backward)) return e;
  auto go = [&]<typename T>(T*) {
    switch (p.act) {
      case GluActivation::Silu: Backward ? backward<T, GluActivation::Silu>(p) : forward<T, GluActivation::Silu>(p); break;
      case GluActivation::Gelu: Backward ? backward<T, GluActivation::Gelu>(p) : forward<T, GluActivation::Gelu>(p); break;
      case GluActivation::GeluTanh:
        Backward ? backward<T, GluActivation::GeluTanh>(p) : forward<T, GluActivation::GeluTanh>(p);
        break;
      case GluActivation::QuickGelu:
        Backward ? backward<T, GluActivation::QuickGelu>(p) : forward<T, GluActivation::QuickGelu>(p);
        break;
    }
  };
  switch (p.dtype) {
    case kernel::DType::f32: go(static_cast<float*>(nullptr)); break;
    case kernel::DType::bf16: go(static_cast<kernel::cpu::bf16*>(nullptr)); break;
    case kernel::DType::f16: go(static_cast<kernel::cpu::f16*>(nullptr)); break;
  }
  return nullptr;
}

}  // namespace

const char* glu_check(const GluParams& p, bool backward) {
  const char* op = backward ? "glu backward" : "glu forward";
  KCPP_KERNEL_REQUIRE(p.dtype == kernel::DType::f32 || p.dtype == kernel::DType::bf16 || p.dtype == kernel::DType::f16,
                      "%s: unsupported dtype %d", op, static_cast<int>(p.dtype));
  KCPP_KERNEL_REQUIRE(static_cast<int32_t>(p.act) >= 0 && static_cast<int32_t>(p.act) <= 3, "%s: unknown activation %d",
                      op, static_cast<int>(p.act));
  KCPP_KERNEL_REQUIRE(p.n >= 0, "%s: n = %lld < 0", op, static_cast<long long>(p.n));
  if (p.n == 0) return nullptr;
  KCPP_KERNEL_REQUIRE(p.gate && p.up, "%s: arguments 'gate' and 'up' must not be null", op);
  if (!backward) KCPP_KERNEL_REQUIRE(p.out != nullptr, "%s: argument 'out' is null", op);
  else KCPP_KERNEL_REQUIRE(p.dout && p.dgate && p.dup, "%s: arguments 'dout', 'dgate' and 'dup' must not be null", op);
  if (backward)
    KCPP_KERNEL_REQUIRE(p.dgate != p.dup, "%s: 'dgate' and 'dup' must be different buffers", op);
  KCPP_KERNEL_REQUIRE(p.cols >= 0, "%s: cols = %lld < 0", op, static_cast<long long>(p.cols));
  if (p.cols > 0) {
    KCPP_KERNEL_REQUIRE(p.n % p.cols == 0, "%s: n = %lld is not a whole number of rows of %lld", op, static_cast<long long>(p.n),
                        static_cast<long long>(p.cols));
    const int64_t lds[] = {p.gate_ld, p.up_ld, backward ? p.dout_ld : p.out_ld, backward ? p.dgate_ld : p.cols,
                           backward ? p.dup_ld : p.cols};
    for (int64_t ld : lds)
      KCPP_KERNEL_REQUIRE(p.n == p.cols || ld >= p.cols, "%s: a row stride of %lld is below the row's %lld elements", op,
                          static_cast<long long>(ld), static_cast<long long>(p.cols));
  }
  return nullptr;
}

const char* glu_forward_cpu(const GluParams& p) { return run<false>(p); }
const char* glu_backward_cpu(const GluParams& p) { return run<true>(p); }

}  // namespace kcpp::liger
