// The causal depthwise convolution on the CPU (maths in causal_conv1d.h): each row widened to f32 with
// W - 1 zeros in front, so the taps need no bounds tests.
#include <algorithm>
#include <cmath>
#include <vector>

#include "causal_conv1d.h"
#include "kcpp/kernel/cpu.h"
#include "kcpp/kernel/error.h"

namespace kcpp::mamba {
namespace {

using kernel::cpu::from_f32;
using kernel::cpu::to_f32;

// pre_l for l in [0, L) from xp = [W - 1 zeros, x_0 .. x_{L-1}].
inline void conv_row(const float* xp, const float* w, float bias, int64_t L, int64_t W, float* pre) {
  for (int64_t l = 0; l < L; ++l) {
    float s = bias;
    for (int64_t k = 0; k < W; ++k) s += w[k] * xp[l + k];
    pre[l] = s;
  }
}

template <typename T>
KCPP_CPU_MULTIVERSION void forward(const CausalConv1dParams& p) {
  const int64_t L = p.seqlen, W = p.width;
#pragma omp parallel
  {
    std::vector<float> xp(static_cast<size_t>(L + W - 1), 0.0f), pre(static_cast<size_t>(L)), w(static_cast<size_t>(W));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < p.batch * p.dim; ++i) {
      const int64_t b = i / p.dim, d = i % p.dim;
      kernel::cpu::load_row(static_cast<const T*>(p.weight) + d * W, W, w.data());
      const float bias = p.bias ? to_f32(static_cast<const T*>(p.bias)[d]) : 0.0f;
      kernel::cpu::load_row(p.x.at<T>(b, d), L, xp.data() + (W - 1));
      conv_row(xp.data(), w.data(), bias, L, W, pre.data());
      T* out = p.out.mut<T>(b, d);
      for (int64_t l = 0; l < L; ++l) out[l] = from_f32<T>(p.silu ? silu(pre[l]) : pre[l]);
    }
  }
}

template <typename T>
KCPP_CPU_MULTIVERSION void backward(const CausalConv1dParams& p) {
  const int64_t L = p.seqlen, W = p.width;
#pragma omp parallel
  {
    std::vector<float> xp(static_cast<size_t>(L + W - 1), 0.0f), pre(static_cast<size_t>(L)), w(static_cast<size_t>(W));
    std::vector<float> dpre(static_cast<size_t>(L + W - 1), 0.0f), dx(static_cast<size_t>(L));
    std::vector<double> dw(static_cast<size_t>(W));
#pragma omp for schedule(static)
    for (int64_t d = 0; d < p.dim; ++d) {
      kernel::cpu::load_row(static_cast<const T*>(p.weight) + d * W, W, w.data());
      const float bias = p.bias ? to_f32(static_cast<const T*>(p.bias)[d]) : 0.0f;
      std::fill(dw.begin(), dw.end(), 0.0);
      double db = 0.0;
      for (int64_t b = 0; b < p.batch; ++b) {
        kernel::cpu::load_row(p.x.at<T>(b, d), L, xp.data() + (W - 1));
        const T* dout = p.dout.at<T>(b, d);
        // dpre = [dpre_0 .. dpre_{L-1}, W - 1 zeros]
        if (p.silu) {
          conv_row(xp.data(), w.data(), bias, L, W, pre.data());
          for (int64_t l = 0; l < L; ++l) dpre[l] = to_f32(dout[l]) * dsilu(pre[l]);
        } else {
          for (int64_t l = 0; l < L; ++l) dpre[l] = to_f32(dout[l]);
        }
        for (int64_t l = 0; l < L; ++l) {
          float s = 0.0f;
          for (int64_t k = 0; k < W; ++k) s += w[k] * dpre[l + W - 1 - k];
          dx[l] = s;
          db += dpre[l];
        }
        for (int64_t k = 0; k < W; ++k) {
          double s = 0.0;
          for (int64_t l = 0; l < L; ++l) s += static_cast<double>(dpre[l]) * xp[l + k];
          dw[k] += s;
        }
        T* dxo = p.dx.mut<T>(b, d);
        for (int64_t l = 0; l < L; ++l) dxo[l] = from_f32<T>(dx[l]);
      }
      for (int64_t k = 0; k < W; ++k) static_cast<T*>(p.dweight)[d * W + k] = from_f32<T>(static_cast<float>(dw[k]));
      if (p.dbias) static_cast<T*>(p.dbias)[d] = from_f32<T>(static_cast<float>(db));
    }
  }
}

template <typename T>
void update(const ConvUpdateParams& p) {
  const int64_t S = p.seqlen, W = p.width, K = p.state_len;
  if (S == 0) return;  // no new positions: the state stays (and x, empty, may have no data at all)
#pragma omp parallel
  {
    std::vector<float> s(static_cast<size_t>(K + S)), w(static_cast<size_t>(W));
    std::vector<T> outs(static_cast<size_t>(S));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < p.batch * p.dim; ++i) {
      const int64_t b = i / p.dim, d = i % p.dim;
      kernel::cpu::load_row(static_cast<const T*>(p.weight) + d * W, W, w.data());
      const float bias = p.bias ? to_f32(static_cast<const T*>(p.bias)[d]) : 0.0f;
      // (A width-1 filter keeps no state: conv_state is empty and may have no data at all.)
      T* state = K > 0 ? static_cast<T*>(p.conv_state) + b * p.state_sb + d * p.state_sd : nullptr;
      const T* x = static_cast<const T*>(p.x) + b * p.x_sb + d * p.x_sd;
      kernel::cpu::load_row(state, K, s.data());
      for (int64_t t = 0; t < S; ++t) s[K + t] = to_f32(x[t * p.x_sl]);
      for (int64_t t = 0; t < S; ++t) {
        float acc = bias;
        for (int64_t k = 0; k < W; ++k) acc += w[k] * s[K + t - (W - 1) + k];
        outs[t] = from_f32<T>(p.silu ? silu(acc) : acc);
      }
      // The new state holds the stored values themselves (already in the dtype): copied, not rounded again.
      for (int64_t k = 0; k < K; ++k) state[k] = from_f32<T>(s[S + k]);
      T* out = static_cast<T*>(p.out) + b * p.out_sb + d * p.out_sd;
      for (int64_t t = 0; t < S; ++t) out[t * p.out_sl] = outs[t];
    }
  }
}

bool valid_dtype(kernel::DType t) { return t == kernel::DType::f32 || t == kernel::DType::bf16 || t == kernel::DType::f16; }

}  // namespace

const char* causal_conv1d_check(const CausalConv1dParams& p, bool backward) {
  const char* op = backward ? "causal_conv1d backward" : "causal_conv1d forward";
  KCPP_KERNEL_REQUIRE(valid_dtype(p.dtype), "%s: unsupported dtype %d", op, static_cast<int>(p.dtype));
  KCPP_KERNEL_REQUIRE(p.batch >= 0 && p.dim >= 0 && p.seqlen >= 0, "%s: negative batch, dim or seqlen", op);
  KCPP_KERNEL_REQUIRE(p.width >= 1, "%s: the kernel width W must be >= 1 (weight is [D, W])", op);
  const bool any = p.batch * p.dim * p.seqlen > 0;
  KCPP_KERNEL_REQUIRE(p.dim == 0 || p.weight, "%s: 'weight' must not be null", op);
  KCPP_KERNEL_REQUIRE(!any || p.x.data, "%s: 'x' must not be null", op);
  if (!backward) {
    KCPP_KERNEL_REQUIRE(!any || p.out.data, "%s: 'out' must not be null", op);
    return nullptr;
  }
  KCPP_KERNEL_REQUIRE(!any || (p.dout.data && p.dx.data), "%s: 'dout' and 'dx' must not be null", op);
  KCPP_KERNEL_REQUIRE(p.dim == 0 || p.dweight, "%s: 'dweight' must not be null", op);
  KCPP_KERNEL_REQUIRE(!p.dbias || p.bias, "%s: 'dbias' needs 'bias'", op);
  return nullptr;
}

const char* conv_update_check(const ConvUpdateParams& p) {
  const char* op = "causal_conv1d_update";
  KCPP_KERNEL_REQUIRE(valid_dtype(p.dtype), "%s: unsupported dtype %d", op, static_cast<int>(p.dtype));
  KCPP_KERNEL_REQUIRE(p.batch >= 0 && p.dim >= 0 && p.seqlen >= 0, "%s: negative batch, dim or positions", op);
  KCPP_KERNEL_REQUIRE(p.width >= 1, "%s: the kernel width W must be >= 1", op);
  KCPP_KERNEL_REQUIRE(p.state_len >= p.width - 1, "%s: 'conv_state' keeps %lld positions; width %lld needs at least %lld", op,
                      static_cast<long long>(p.state_len), static_cast<long long>(p.width), static_cast<long long>(p.width - 1));
  KCPP_KERNEL_REQUIRE(p.batch * p.dim == 0 ||
                          ((p.x || p.seqlen == 0) && (p.conv_state || p.state_len == 0) && p.weight && (p.out || p.seqlen == 0)),
                      "%s: 'x', 'conv_state', 'weight' and 'out' must not be null", op);
  return nullptr;
}

const char* causal_conv1d_forward_cpu(const CausalConv1dParams& p) {
  if (const char* e = causal_conv1d_check(p, false)) return e;
  kernel::cpu::visit_float(p.dtype, [&]<typename T>(T*) { forward<T>(p); });
  return nullptr;
}

const char* causal_conv1d_backward_cpu(const CausalConv1dParams& p) {
  if (const char* e = causal_conv1d_check(p, true)) return e;
  kernel::cpu::visit_float(p.dtype, [&]<typename T>(T*) { backward<T>(p); });
  return nullptr;
}

const char* causal_conv1d_update_cpu(const ConvUpdateParams& p) {
  if (const char* e = conv_update_check(p)) return e;
  kernel::cpu::visit_float(p.dtype, [&]<typename T>(T*) { update<T>(p); });
  return nullptr;
}

}  // namespace kcpp::mamba
