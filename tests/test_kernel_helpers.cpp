// The package-side helpers of include/kcpp/kernel/: the vectorizable exp and the activations built
// on it, and the argument checks of abi_args.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>

#include "kcpp/kernel/abi_args.h"
#include "kcpp/kernel/activation.h"
#include "kcpp/kernel/fast_math.h"
#include "oracle.h"

namespace kcpp {
namespace {

namespace kk = kcpp::kernel;

// Distance in units in the last place between two finite floats of the same sign, or both zero.
int64_t ulps(float a, float b) {
  auto key = [](float f) {
    const int32_t i = std::bit_cast<int32_t>(f);
    return i < 0 ? int64_t{INT32_MIN} - i : int64_t{i};
  };
  return std::llabs(key(a) - key(b));
}

TEST(KernelHelpers, ExpWithinTwoUlpsOfTheLibrary) {
  int64_t worst = 0;
  float worst_x = 0;
  // Every 97th float of [0, 88.7] and of [-103, 0] (about 2.2e7 values), walked by bit pattern: past
  // -103 the result is subnormal, where ulps are absolute and the two round differently by design.
  const std::pair<uint32_t, uint32_t> ranges[] = {{0u, std::bit_cast<uint32_t>(88.7f)},
                                                  {0x80000000u, std::bit_cast<uint32_t>(-103.0f)}};
  for (const auto& [lo, hi] : ranges)
    for (uint32_t b = lo; b <= hi; b += 97) {
      const float x = std::bit_cast<float>(b), want = std::exp(x), got = kk::exp_f32(x);
      const int64_t u = ulps(got, want);
      if (u > worst) worst = u, worst_x = x;
    }
  EXPECT_LE(worst, 2) << "at x = " << worst_x;
}

TEST(KernelHelpers, TanhWithinThreeUlpsOfTheLibrary) {
  int64_t worst = 0;
  float worst_x = 0;
  for (const auto& [lo, hi] : {std::pair<uint32_t, uint32_t>{std::bit_cast<uint32_t>(1e-30f), std::bit_cast<uint32_t>(12.0f)}})
    for (uint32_t b = lo; b <= hi; b += 251)
      for (const float x : {std::bit_cast<float>(b), -std::bit_cast<float>(b)}) {
        const int64_t u = ulps(kk::tanh_f32(x), std::tanh(x));
        if (u > worst) worst = u, worst_x = x;
      }
  EXPECT_LE(worst, 3) << "at x = " << worst_x;
  RecordProperty("worst_ulps", static_cast<int>(worst));
  EXPECT_EQ(kk::tanh_f32(0.0f), 0.0f);
  EXPECT_EQ(kk::tanh_f32(100.0f), 1.0f);
  EXPECT_EQ(kk::tanh_f32(-std::numeric_limits<float>::infinity()), -1.0f);
  EXPECT_TRUE(std::isnan(kk::tanh_f32(std::numeric_limits<float>::quiet_NaN())));
}

// Phi(x) against the f64 one (erfc, no cancellation), walked by bit pattern over [2^-40, 16] and its
// negatives: Phi from 0.5 down to its f32 underflow (x = -14) and up to 1.
// The soft-capped attention's tanh (packages/flash_attn/softcap.cuh): 1 - 2 / (e^2x + 1) within 1e-6
// of tanh everywhere and exactly +-1 far out.  (On the host 2^x and the reciprocal are the library's, so
// this holds the formula in f32; the device tests hold its use.)
TEST(KernelHelpers, SoftcapTanhWithinItsBound) {
  double worst_approx = 0;
  for (int i = -100000; i <= 100000; ++i) {
    const float x = static_cast<float>(i) / 1000.0f;  // [-100, 100]
    worst_approx = std::max(worst_approx, std::abs(static_cast<double>(kk::tanh_approx(x)) - std::tanh(static_cast<double>(x))));
  }
  EXPECT_LE(worst_approx, 1e-6);
  EXPECT_EQ(kk::tanh_approx(std::numeric_limits<float>::infinity()), 1.0f);
  EXPECT_EQ(kk::tanh_approx(-std::numeric_limits<float>::infinity()), -1.0f);
  EXPECT_EQ(kk::tanh_approx(100.0f), 1.0f);
}

TEST(KernelHelpers, NormalCdfWithinEightUlps) {
  int64_t worst = 0;
  float worst_x = 0;
  for (uint32_t b = std::bit_cast<uint32_t>(0x1p-40f); b <= std::bit_cast<uint32_t>(16.0f); b += 61)
    for (const float x : {std::bit_cast<float>(b), -std::bit_cast<float>(b)}) {
      const double want = 0.5 * std::erfc(-static_cast<double>(x) / std::sqrt(2.0));
      float e = 0;
      const float got = kk::normal_cdf_f32(x, &e);
      if (want < 0x1p-126) {  // f32 subnormals: ulps are absolute there
        EXPECT_LE(std::fabs(got - want), 0x1p-140) << "x = " << x;
        continue;
      }
      const int64_t u = ulps(got, static_cast<float>(want));
      if (u > worst) worst = u, worst_x = x;
      const double want_e = std::exp(-0.5 * static_cast<double>(x) * x);
      if (want_e > 0x1p-126) {
        EXPECT_LE(ulps(e, static_cast<float>(want_e)), 3) << "exp(-x^2/2) at x = " << x;
      }
    }
  EXPECT_LE(worst, 8) << "at x = " << worst_x;
  RecordProperty("worst_ulps", static_cast<int>(worst));
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(kk::normal_cdf_f32(0.0f, nullptr), 0.5f);
  EXPECT_EQ(kk::normal_cdf_f32(inf, nullptr), 1.0f);
  EXPECT_EQ(kk::normal_cdf_f32(-inf, nullptr), 0.0f);
  EXPECT_EQ(kk::normal_cdf_f32(-30.0f, nullptr), 0.0f);
  EXPECT_TRUE(std::isnan(kk::normal_cdf_f32(std::numeric_limits<float>::quiet_NaN(), nullptr)));
}

// The device's Fast-mode Phi (here through exp2f in place of ex2.approx): absolute error against the f64
// Phi over [-14, 9], relative error where the lower tail is a normal f32.
TEST(KernelHelpers, FastNormalCdfWithinItsBound) {
  double worst_abs = 0, worst_rel = 0;
  for (uint32_t b = std::bit_cast<uint32_t>(0x1p-30f); b <= std::bit_cast<uint32_t>(14.0f); b += 97)
    for (const float x : {std::bit_cast<float>(b), -std::bit_cast<float>(b)}) {
      if (x > 9.0f) continue;
      const double want = 0.5 * std::erfc(-static_cast<double>(x) / std::sqrt(2.0));
      const double got = kk::normal_cdf_fast(x);
      worst_abs = std::max(worst_abs, std::fabs(got - want));
      if (x < 0 && want > 0x1p-126) worst_rel = std::max(worst_rel, std::fabs(got - want) / want);
    }
  EXPECT_LE(worst_abs, 1.2e-6);
  EXPECT_LE(worst_rel, 6e-5);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3g absolute, %.3g relative", worst_abs, worst_rel);
  RecordProperty("worst", buf);
  const float inf = std::numeric_limits<float>::infinity();
  for (const float x : {13.2f, 13.3f, 20.0f, 1e3f, 1e6f, 1e30f, inf}) {  // past the fit: no clamp
    EXPECT_EQ(kk::normal_cdf_fast(x), 1.0f) << x;
    EXPECT_LT(kk::normal_cdf_fast(-x), 0x1p-126f) << x;
  }
  EXPECT_TRUE(std::isnan(kk::normal_cdf_fast(std::numeric_limits<float>::quiet_NaN())));
}

TEST(KernelHelpers, ExpEdgeCases) {
  EXPECT_EQ(kk::exp_f32(0.0f), 1.0f);
  EXPECT_EQ(kk::exp_f32(-0.0f), 1.0f);
  EXPECT_TRUE(std::isinf(kk::exp_f32(89.0f)));
  EXPECT_TRUE(std::isinf(kk::exp_f32(std::numeric_limits<float>::infinity())));
  EXPECT_EQ(kk::exp_f32(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_EQ(kk::exp_f32(-200.0f), 0.0f);
  EXPECT_TRUE(std::isnan(kk::exp_f32(std::numeric_limits<float>::quiet_NaN())));
}

TEST(KernelHelpers, ActivationsMatchTheOracleInBothModes) {
  const std::pair<kk::Activation, oracle::Act> acts[] = {{kk::Activation::Silu, oracle::Act::Silu},
                                                         {kk::Activation::Gelu, oracle::Act::Gelu},
                                                         {kk::Activation::GeluTanh, oracle::Act::GeluTanh},
                                                         {kk::Activation::QuickGelu, oracle::Act::QuickGelu}};
  for (const auto& [a, o] : acts)
    for (float x = -30.0f; x <= 30.0f; x += 0.0137f) {
      float d_acc = 0, d_fast = 0;
      float f_acc = 0, f_fast = 0;
      switch (a) {
        case kk::Activation::Silu:
          f_acc = kk::activate<kk::Activation::Silu>(x, &d_acc);
          f_fast = kk::activate<kk::Activation::Silu, kk::MathMode::Fast>(x, &d_fast);
          break;
        case kk::Activation::Gelu:
          f_acc = kk::activate<kk::Activation::Gelu>(x, &d_acc);
          f_fast = kk::activate<kk::Activation::Gelu, kk::MathMode::Fast>(x, &d_fast);
          break;
        case kk::Activation::GeluTanh:
          f_acc = kk::activate<kk::Activation::GeluTanh>(x, &d_acc);
          f_fast = kk::activate<kk::Activation::GeluTanh, kk::MathMode::Fast>(x, &d_fast);
          break;
        case kk::Activation::QuickGelu:
          f_acc = kk::activate<kk::Activation::QuickGelu>(x, &d_acc);
          f_fast = kk::activate<kk::Activation::QuickGelu, kk::MathMode::Fast>(x, &d_fast);
          break;
      }
      const double f = oracle::act_f(o, x), d = oracle::act_d(o, x);
      // Accurate: a few f32 roundings.  Fast: an absolute error of a few f32 ulps of the terms (1 + tanh
      // cancels for very negative x), still far below a bf16 / f16 rounding of the result.
      const double scale_f = std::fabs(x) + 1, scale_d = 1 + std::fabs(x) * 1.702;
      EXPECT_NEAR(f_acc, f, 4e-7 * scale_f) << kk::activation_name(a) << " x=" << x;
      EXPECT_NEAR(d_acc, d, 4e-7 * scale_d) << kk::activation_name(a) << "' x=" << x;
      EXPECT_NEAR(f_fast, f, 1e-6 * scale_f) << kk::activation_name(a) << " fast x=" << x;
      EXPECT_NEAR(d_fast, d, 1e-6 * scale_d) << kk::activation_name(a) << "' fast x=" << x;
    }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  float d = 0;
  EXPECT_TRUE(std::isnan(kk::activate<kk::Activation::Silu, kk::MathMode::Fast>(nan, &d)) && std::isnan(d));
  EXPECT_TRUE(std::isnan(kk::activate<kk::Activation::GeluTanh, kk::MathMode::Fast>(nan, &d)) && std::isnan(d));
  const float inf = std::numeric_limits<float>::infinity();
  const float at_inf = kk::activate<kk::Activation::GeluTanh, kk::MathMode::Fast>(inf, nullptr);
  EXPECT_EQ(at_inf, inf);
}

TEST(KernelHelpers, ParseActivationNames) {
  kk::Activation a{};
  EXPECT_TRUE(kk::parse_activation("gelu_pytorch_tanh", &a));
  EXPECT_EQ(a, kk::Activation::GeluTanh);
  EXPECT_TRUE(kk::parse_activation("quick_gelu", &a));
  EXPECT_EQ(a, kk::Activation::QuickGelu);
  EXPECT_FALSE(kk::parse_activation("relu", &a));
  EXPECT_FALSE(kk::parse_activation(nullptr, &a));
}

// A DLTensor over no data, for the layout checks.
struct Dl {
  std::vector<int64_t> shape, strides;
  DLTensor t{};
  Dl(std::vector<int64_t> sh, std::vector<int64_t> st) : shape(std::move(sh)), strides(std::move(st)) {
    static float dummy[1];
    t.data = dummy;
    t.device = {kDLCPU, 0};
    t.ndim = static_cast<int32_t>(shape.size());
    t.dtype = {kDLFloat, 32, 1};
    t.shape = shape.data();
    t.strides = strides.empty() ? nullptr : strides.data();
  }
};

TEST(KernelHelpers, RowsCollapsesLeadingDims) {
  char err[256];
  kcpp_context ctx{};
  ctx.struct_size = sizeof ctx;
  ctx.error = err;
  ctx.error_size = sizeof err;
  struct Case {
    Dl t;
    bool ok;
    int64_t rows, width, stride;
  };
  Case cases[] = {
      {Dl({2, 3, 8}, {}), true, 6, 8, 8},               // contiguous
      {Dl({2, 3, 8}, {30, 10, 1}), true, 6, 8, 10},      // rows of a wider buffer
      {Dl({4, 1, 8}, {8, 99, 1}), true, 4, 8, 8},        // a size-1 dim's stride is irrelevant
      {Dl({2, 3, 8}, {40, 10, 1}), false, 0, 0, 0},      // leading dims do not collapse
      {Dl({3, 8}, {1, 3}), false, 0, 0, 0},              // last dim strided
      {Dl({3, 8}, {4, 1}), false, 0, 0, 0},              // rows overlap
      {Dl({8}, {}), true, 1, 8, 8},
  };
  for (Case& c : cases) {
    kk::Call call(&ctx, nullptr, 0, "t");
    int64_t r = 0, w = 0, s = 0;
    EXPECT_EQ(call.rows(&c.t.t, "x", &r, &w, &s), c.ok) << err;
    if (c.ok) {
      EXPECT_EQ(r, c.rows);
      EXPECT_EQ(w, c.width);
      EXPECT_EQ(s, c.stride);
    } else {
      EXPECT_EQ(call.status(), KCPP_ERROR_UNSUPPORTED);
      EXPECT_NE(std::string(err).find("tensor 'x'"), std::string::npos) << err;
    }
  }
}

// Call::all_read names the first argument that no lookup asked for; NONE arguments do not count.
TEST(KernelHelpers, AllReadNamesAnArgumentNoLookupAskedFor) {
  char err[256];
  kcpp_context ctx{};
  ctx.struct_size = sizeof ctx;
  ctx.error = err;
  ctx.error_size = sizeof err;
  kcpp_arg a[3]{};
  a[0].name = "scale", a[0].kind = KCPP_ARG_FLOAT, a[0].value.f = 0.5;
  a[1].name = "sofcap", a[1].kind = KCPP_ARG_FLOAT, a[1].value.f = 50.0;
  a[2].name = "lse", a[2].kind = KCPP_ARG_NONE;
  kk::Call partial(&ctx, a, 3, "t");
  EXPECT_EQ(partial.real("scale", 1.0), 0.5);
  EXPECT_EQ(partial.real("softcap", 0.0), 0.0);  // absent under its right name
  EXPECT_FALSE(partial.all_read());
  EXPECT_EQ(partial.status(), KCPP_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(err).find("argument 'sofcap' is not one this call reads"), std::string::npos) << err;
  kk::Call full(&ctx, a, 3, "t");
  full.real("scale", 1.0), full.real("sofcap", 0.0);
  EXPECT_TRUE(full.all_read());  // 'lse' is NONE
}

TEST(KernelHelpers, ChoiceNamesTheAlternatives) {
  char err[256];
  kcpp_context ctx{};
  ctx.struct_size = sizeof ctx;
  ctx.error = err;
  ctx.error_size = sizeof err;
  kcpp_arg a{};
  a.name = "casting";
  a.kind = KCPP_ARG_STRING;
  a.value.s = "gemma";
  static constexpr const char* kChoices[] = {"llama", "gemma", "none", nullptr};
  kk::Call ok(&ctx, &a, 1, "t");
  EXPECT_EQ(ok.choice("casting", 0, kChoices), 1);
  EXPECT_EQ(ok.choice("absent", 2, kChoices), 2);
  a.value.s = "mistral";
  kk::Call bad(&ctx, &a, 1, "t");
  bad.choice("casting", 0, kChoices);
  EXPECT_EQ(bad.status(), KCPP_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(err, "t: argument 'casting' is 'mistral'; expected one of 'llama', 'gemma', 'none'");
}

}  // namespace
}  // namespace kcpp
