// Activations on the CPU (maths in activation_kernels.h): (row, column chunk) tasks in parallel; each
// chunk widened to f32, computed in a loop the compiler vectorizes (exp_f32, no library calls) and
// rounded back.  Every input of a chunk is loaded before any output of it is stored (in-place safe).
#include <algorithm>

#include "activation_kernels.h"
#include "kcpp/kernel/cpu.h"
#include "kcpp/kernel/error.h"

namespace kcpp::activation {
namespace {

namespace kk = kcpp::kernel;
using kk::cpu::load_row;
using kk::cpu::store_row;
constexpr int64_t kChunk = 2048;
// 16-bit outputs take Fast; f32 FastExp (exp_f32, tanh_f32, normal_cdf_f32: within 1, 3, 6 ulps).
template <typename T> constexpr kk::MathMode kMode = sizeof(T) == 2 ? kk::MathMode::Fast : kk::MathMode::FastExp;

template <typename T, kk::Activation A, bool Gated, bool Bwd> KCPP_CPU_MULTIVERSION void run(const ActParams& p) {
  const int64_t chunks = (p.d + kChunk - 1) / kChunk, tasks = p.rows * chunks;
#pragma omp parallel
  {
    float a[kChunk], b[kChunk], g[kChunk];
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t r = task / chunks, j0 = (task % chunks) * kChunk, m = std::min(kChunk, p.d - j0);
      const T* x = static_cast<const T*>(p.x) + r * p.x_stride + j0;
      load_row(x, m, a);
      if constexpr (Gated) load_row(x + p.d, m, b);
      if constexpr (Bwd) load_row(static_cast<const T*>(p.dy) + r * p.dy_stride + j0, m, g);
      if constexpr (!Bwd) {
        T* y = static_cast<T*>(p.y) + r * p.y_stride + j0;
        for (int64_t i = 0; i < m; ++i) {
          const float f = kk::activate<A, kMode<T>>(a[i], nullptr);
          a[i] = Gated ? f * b[i] : f;
        }
        store_row(a, m, y);
      } else {
        T* dx = static_cast<T*>(p.dx) + r * p.dx_stride + j0;
        for (int64_t i = 0; i < m; ++i) {
          float da;
          const float f = kk::activate<A, kMode<T>>(a[i], &da);
          if constexpr (Gated) {
            a[i] = g[i] * b[i] * da;  // d gate
            b[i] = g[i] * f;          // d up
          } else {
            a[i] = g[i] * da;
          }
        }
        store_row(a, m, dx);
        if constexpr (Gated) store_row(b, m, dx + p.d);
      }
    }
  }
}

template <bool Bwd> const char* dispatch(const ActParams& p) {
  if (const char* e = act_check(p, Bwd)) return e;
  auto by_act = [&]<typename T, bool G>() {
    switch (p.act) {
      case kk::Activation::Silu: run<T, kk::Activation::Silu, G, Bwd>(p); break;
      case kk::Activation::Gelu: run<T, kk::Activation::Gelu, G, Bwd>(p); break;
      case kk::Activation::GeluTanh: run<T, kk::Activation::GeluTanh, G, Bwd>(p); break;
      case kk::Activation::QuickGelu: run<T, kk::Activation::QuickGelu, G, Bwd>(p); break;
    }
  };
  auto by_gated = [&]<typename T>() {
    if (p.gated) by_act.template operator()<T, true>();
    else by_act.template operator()<T, false>();
  };
  switch (p.dtype) {
    case kk::DType::f32: by_gated.template operator()<float>(); break;
    case kk::DType::bf16: by_gated.template operator()<kk::cpu::bf16>(); break;
    case kk::DType::f16: by_gated.template operator()<kk::cpu::f16>(); break;
  }
  return nullptr;
}

}  // namespace

const char* act_check(const ActParams& p, bool backward) {
  const char* op = backward ? "activation backward" : "activation forward";
  KCPP_KERNEL_REQUIRE(p.dtype == kernel::DType::f32 || p.dtype == kernel::DType::bf16 || p.dtype == kernel::DType::f16,
                      "%s: unsupported dtype %d", op, static_cast<int>(p.dtype));
  KCPP_KERNEL_REQUIRE(static_cast<int32_t>(p.act) >= 0 && static_cast<int32_t>(p.act) <= 3, "%s: unknown activation %d",
                      op, static_cast<int>(p.act));
  KCPP_KERNEL_REQUIRE(p.rows >= 0 && p.d >= 0, "%s: rows and d must be >= 0", op);
  if (p.rows == 0 || p.d == 0) return nullptr;
  const int64_t xw = p.gated ? 2 * p.d : p.d;
  KCPP_KERNEL_REQUIRE(p.x != nullptr, "%s: argument 'x' is null", op);
  KCPP_KERNEL_REQUIRE(p.rows == 1 || p.x_stride >= xw, "%s: 'x' row stride %lld < width %lld", op,
                      static_cast<long long>(p.x_stride), static_cast<long long>(xw));
  if (!backward) {
    KCPP_KERNEL_REQUIRE(p.y != nullptr, "%s: argument 'y' is null", op);
    KCPP_KERNEL_REQUIRE(p.rows == 1 || p.y_stride >= p.d, "%s: 'y' row stride below d", op);
    KCPP_KERNEL_REQUIRE(p.y != p.x || p.y_stride == p.x_stride, "%s: in-place 'y' must have the strides of 'x'", op);
    KCPP_KERNEL_REQUIRE(!p.gated || p.y != p.x, "%s: a gated activation cannot write 'y' over 'x'", op);
  } else {
    KCPP_KERNEL_REQUIRE(p.dy && p.dx, "%s: arguments 'dy' and 'dx' must not be null", op);
    KCPP_KERNEL_REQUIRE(p.rows == 1 || (p.dy_stride >= p.d && p.dx_stride >= xw), "%s: row stride below the width", op);
    KCPP_KERNEL_REQUIRE(p.dx != p.dy || (!p.gated && p.dx_stride == p.dy_stride),
                        "%s: 'dx' may alias 'dy' only for a plain activation with the same strides", op);
    KCPP_KERNEL_REQUIRE(p.dx != p.x || p.dx_stride == p.x_stride, "%s: in-place 'dx' must have the strides of 'x'", op);
  }
  return nullptr;
}

const char* act_forward_cpu(const ActParams& p) { return dispatch<false>(p); }
const char* act_backward_cpu(const ActParams& p) { return dispatch<true>(p); }

}  // namespace kcpp::activation
