// Package "flash_attn" (layer FlashAttention, Attention/1) through the ABI against the f64 oracle
// (oracle::attention), held to docs/DESIGN.md's bound: at most twice the error of the eager reference
// (ops::attention_*: scores and probabilities materialized in the dtype) in the same precision.
// Shapes cover both CUDA paths (tensor cores: bf16 / f16, head_dim 64 / 128; generic: the rest),
// partial tiles on every side, grouped-query heads, a KV cache (fewer queries than keys), sliding
// windows, non-causal attention and the [B, S, H, D] layout read through strides.
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/platform.h"
#include "oracle.h"
#include "ops/nn/attention.h"
#include "package_util.h"
#include "test_util.h"

namespace kcpp {
namespace {

using nn::KernelArgs;
using nn::KernelLayer;

KernelLayer layer() { return KernelLayer::find(test::built_package("flash_attn"), "FlashAttention"); }

struct Case {
  int64_t b, hq, hkv, sq, skv, d;
  bool causal;
  int64_t window;
};

// q [B, Hq, Sq, D] etc.; `bshd`: made as [B, S, H, D] and viewed as [B, H, S, D] (strided).
Tensor make(int64_t b, int64_t h, int64_t s, int64_t d, DType dt, Device dev, Generator& gen, bool bshd, double sd = 1.0) {
  if (!bshd) return Tensor::randn({b, h, s, d}, dt, dev, gen, 0.0, sd);
  return Tensor::randn({b, s, h, d}, dt, dev, gen, 0.0, sd).transpose(1, 2);
}

struct Result {
  Tensor out, lse, dq, dk, dv;
};

Result run_both(const KernelLayer& k, const Tensor& q, const Tensor& kk, const Tensor& v, const Tensor& dout, const Case& c,
        Device dev) {
  Result r;
  r.out = Tensor::empty(q.shape(), q.dtype(), dev);
  r.lse = Tensor::empty({c.b, c.hq, c.sq}, DType::f32, dev);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  KernelArgs f;
  f.tensor("q", q).tensor("k", kk).tensor("v", v).tensor("out", r.out).tensor("lse", r.lse);
  f.real("scale", scale).integer("causal", c.causal ? 1 : 0).integer("window", c.window);
  EXPECT_TRUE(k.supports(f, dev, test::kTraining).ok());
  k.forward(f, dev, test::kTraining);
  r.dq = Tensor::empty(q.shape(), q.dtype(), dev);
  r.dk = Tensor::empty(kk.shape(), kk.dtype(), dev);
  r.dv = Tensor::empty(v.shape(), v.dtype(), dev);
  KernelArgs b;
  b.tensor("dout", dout).tensor("q", q).tensor("k", kk).tensor("v", v).tensor("out", r.out).tensor("lse", r.lse);
  b.real("scale", scale).integer("causal", c.causal ? 1 : 0).integer("window", c.window);
  b.tensor("dq", r.dq).tensor("dk", r.dk).tensor("dv", r.dv);
  k.backward(b, dev, test::kTraining);
  return r;
}

// Runs case `c` in `dt` through the package and holds out, dq, dk, dv and lse to the bounds.
void check_case(const KernelLayer& k, const Case& c, DType dt, Device dev, Generator& gen, bool bshd) {
  const std::string cfg = fmt::format("{} b={} hq={} hkv={} sq={} skv={} d={} causal={} window={} bshd={}",
                                      test::config_name(dev, dt), c.b, c.hq, c.hkv, c.sq, c.skv, c.d, c.causal, c.window,
                                      bshd);
  const Tensor q = make(c.b, c.hq, c.sq, c.d, dt, dev, gen, bshd), kk = make(c.b, c.hkv, c.skv, c.d, dt, dev, gen, bshd);
  const Tensor v = make(c.b, c.hkv, c.skv, c.d, dt, dev, gen, bshd), dout = make(c.b, c.hq, c.sq, c.d, dt, dev, gen, bshd);
  const Result r = run_both(k, q, kk, v, dout, c, dev);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  const auto dov = dout.to_f64_vector();
  const oracle::Attn o = oracle::attention(q.to_f64_vector(), kk.to_f64_vector(), v.to_f64_vector(), &dov, c.b, c.hq, c.hkv,
                                           c.sq, c.skv, c.d, scale, c.causal, c.window);
  const ops::AttentionOptions opt{scale, c.causal, c.window};
  const ops::AttentionForward rf = ops::attention_forward(q, kk, v, opt);
  const ops::AttentionBackward rb = ops::attention_backward(dout, q, kk, v, rf, opt);
  const std::pair<const char*, std::pair<Tensor, Tensor>> outs[] = {
      {"out", {r.out, rf.out}}, {"dq", {r.dq, rb.dq}}, {"dk", {r.dk, rb.dk}}, {"dv", {r.dv, rb.dv}}};
  const oracle::V* refs[] = {&o.out, &o.dq, &o.dk, &o.dv};
  for (int i = 0; i < 4; ++i) {
    const double e_ref = test::rel_l2_error(outs[i].second.second, *refs[i]);
    const double e = test::rel_l2_error(outs[i].second.first, *refs[i]);
    EXPECT_LE(e, test::kernel_bound(e_ref, dt)) << cfg << " " << outs[i].first << " (reference error " << e_ref << ")";
    EXPECT_LE(e, test::composite_rel_l2(dt)) << cfg << " " << outs[i].first;
  }
  // lse: log-sum-exp of each query's visible scaled scores, in f64.
  const auto qv = q.to_f64_vector(), kv = kk.to_f64_vector(), lse = r.lse.to_f64_vector();
  double worst = 0;
  std::vector<double> s;
  for (int64_t bi = 0; bi < c.b; ++bi)
    for (int64_t h = 0; h < c.hq; ++h)
      for (int64_t i = 0; i < c.sq; ++i) {
        const int64_t pos = i + c.skv - c.sq, hk = h / (c.hq / c.hkv);
        double mx = -std::numeric_limits<double>::infinity(), sum = 0;
        s.clear();
        for (int64_t j = 0; j < c.skv; ++j) {
          if ((c.causal && j > pos) || (c.window > 0 && pos - j >= c.window)) continue;
          double x = 0;
          for (int64_t e = 0; e < c.d; ++e)
            x += qv[((bi * c.hq + h) * c.sq + i) * c.d + e] * kv[((bi * c.hkv + hk) * c.skv + j) * c.d + e];
          s.push_back(x * scale);
          mx = std::max(mx, x * scale);
        }
        for (double x : s) sum += std::exp(x - mx);
        worst = std::max(worst, std::abs(lse[(bi * c.hq + h) * c.sq + i] - (mx + std::log(sum))));
      }
  EXPECT_LE(worst, 1e-4 * std::sqrt(static_cast<double>(c.d))) << cfg << " lse";
}

class FlashAttnPackage : public ::testing::TestWithParam<Device> {};

TEST_P(FlashAttnPackage, WithinTwiceTheReferenceError) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer k = layer();
  const Case cases[] = {
      {1, 1, 1, 1, 1, 64, true, 0},      {2, 4, 2, 37, 37, 64, true, 0},    {1, 4, 1, 77, 77, 128, true, 0},
      {2, 2, 2, 5, 70, 128, true, 0},    {1, 2, 1, 130, 130, 64, false, 0}, {1, 2, 2, 100, 100, 64, true, 17},
      {1, 3, 1, 9, 9, 8, true, 0},       {1, 2, 1, 33, 33, 111, true, 0},   {2, 8, 2, 200, 200, 128, true, 0},
      {1, 2, 1, 3, 150, 64, false, 40},  {1, 1, 1, 1, 129, 128, true, 0},
  };
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (const Case& c : cases)
      for (bool bshd : {false, true}) {
        if (bshd && c.d != 64) continue;
        check_case(k, c, dt, dev, gen, bshd);
      }
}

// Sets an environment variable for a scope (the package reads KCPP_FLASH_ATTN_FORWARD at each call).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() { had_ ? ::setenv(name_, old_.c_str(), 1) : ::unsetenv(name_); }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

// The Hopper forward (wgmma + TMA, sm_90a), required through KCPP_FLASH_ATTN_FORWARD=hopper so that a
// fallback to another path fails the call: lengths that are no multiple of its 128-row tiles (1, 127,
// 257, 4097), fewer queries than keys, grouped-query heads (32 / 8), causal or not, head_dim 64 / 128 / 256,
// bf16 / f16, the [B, S, H, D] layout, and more work items than SMs (the persistent blocks take
// several each).  The backward (the Hopper one at head dim 128, else mma.sync or generic) consumes the lse
// it writes.
TEST(FlashAttnHopper, ForwardOnAwkwardLengths) {
  const Device dev = Device::cuda(0);
  KCPP_REQUIRE_DEVICE(dev);
  const PlatformInfo pl = detect_platform();
  if (pl.gpus.empty() || pl.gpus[0].cc_major != 9 || pl.gpus[0].cc_minor != 0 ||
      pl.cuda_archs_compiled.find("90a") == std::string::npos)
    GTEST_SKIP() << "skipped: needs a compute capability 9.0 GPU and a build with sm_90a";
  const ScopedEnv env("KCPP_FLASH_ATTN_FORWARD", "hopper");
  Generator gen = test::test_generator();
  const KernelLayer k = layer();
  const Case cases[] = {
      {2, 4, 1, 1, 1, 128, true, 0},      {1, 32, 8, 127, 127, 128, true, 0}, {1, 4, 2, 127, 300, 128, true, 0},
      {2, 2, 1, 257, 257, 128, false, 0}, {1, 2, 1, 129, 129, 64, true, 0},   {1, 2, 1, 4097, 4097, 64, true, 0},
      {1, 2, 2, 1, 200, 128, false, 0},
      // More work items (query tiles x heads) than an H100 or H200 has SMs: blocks loop over several.
      {8, 16, 4, 129, 129, 64, true, 0},  {8, 16, 4, 200, 333, 128, false, 0}, {150, 2, 1, 1, 1, 128, true, 0},
      // Head dim 256 (64-key tiles; the backward is the generic one).
      {1, 4, 2, 127, 300, 256, true, 0},  {2, 2, 1, 200, 200, 256, false, 0},  {1, 2, 1, 129, 129, 256, true, 0},
  };
  for (DType dt : {DType::bf16, DType::f16})
    for (const Case& c : cases)
      for (bool bshd : {false, true}) {
        if (bshd && c.sq > 1000) continue;
        if (dt == DType::f16 && c.sq > 1000) continue;
        check_case(k, c, dt, dev, gen, bshd);
      }
}

// The Hopper backward (wgmma + TMA, sm_90a), required through KCPP_FLASH_ATTN_BACKWARD=hopper: head_dim
// 128, lengths that are no multiple of its 128-key blocks or 64-query tiles (1, 127, 129, 190, 4097),
// fewer queries than keys (a KV cache), grouped-query heads (32 / 8, dk / dv summed over the group),
// causal or not, bf16 / f16, the [B, S, H, D] layout, more blocks than SMs.
TEST(FlashAttnHopper, BackwardOnAwkwardLengths) {
  const Device dev = Device::cuda(0);
  KCPP_REQUIRE_DEVICE(dev);
  const PlatformInfo pl = detect_platform();
  if (pl.gpus.empty() || pl.gpus[0].cc_major != 9 || pl.gpus[0].cc_minor != 0 ||
      pl.cuda_archs_compiled.find("90a") == std::string::npos)
    GTEST_SKIP() << "skipped: needs a compute capability 9.0 GPU and a build with sm_90a";
  const ScopedEnv env("KCPP_FLASH_ATTN_BACKWARD", "hopper");
  Generator gen = test::test_generator();
  const KernelLayer k = layer();
  const Case cases[] = {
      {2, 4, 1, 1, 1, 128, true, 0},       {1, 32, 8, 127, 127, 128, true, 0}, {1, 4, 2, 129, 129, 128, true, 0},
      {1, 4, 2, 127, 300, 128, true, 0},   {1, 2, 1, 64, 200, 128, true, 0},   {2, 2, 1, 257, 257, 128, false, 0},
      {1, 2, 2, 1, 200, 128, false, 0},    {1, 4, 1, 190, 190, 128, false, 0}, {8, 16, 4, 200, 333, 128, false, 0},
      {1, 2, 1, 4097, 4097, 128, true, 0},
  };
  for (DType dt : {DType::bf16, DType::f16})
    for (const Case& c : cases)
      for (bool bshd : {false, true}) {
        if (bshd && c.sq > 1000) continue;
        if (dt == DType::f16 && c.sq > 1000) continue;
        check_case(k, c, dt, dev, gen, bshd);
      }
}

// Asking for a forward path that cannot take the call is refused in supports(), naming why.
TEST(FlashAttnHopper, RequiredPathIsRefusedWhereItCannotRun) {
  const Device dev = Device::cuda(0);
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer k = layer();
  const Tensor q = Tensor::randn({1, 2, 8, 64}, DType::bf16, dev, gen), kv = Tensor::randn({1, 1, 8, 64}, DType::bf16, dev, gen);
  const Tensor out = Tensor::empty(q.shape(), q.dtype(), dev);
  KernelArgs a;
  a.tensor("q", q).tensor("k", kv).tensor("v", kv).tensor("out", out).integer("window", 4);
  {
    const ScopedEnv env("KCPP_FLASH_ATTN_FORWARD", "hopper");
    EXPECT_TRUE(test::refused(k.supports(a, dev, test::kInference), KCPP_ERROR_UNSUPPORTED, "KCPP_FLASH_ATTN_FORWARD=hopper"));
  }
  {
    const ScopedEnv env("KCPP_FLASH_ATTN_FORWARD", "ampere");
    EXPECT_TRUE(k.supports(a, dev, test::kInference).ok());
  }
  {
    const ScopedEnv env("KCPP_FLASH_ATTN_FORWARD", "fastest");
    EXPECT_TRUE(test::refused(k.supports(a, dev, test::kInference), KCPP_ERROR_UNSUPPORTED, "'fastest'"));
  }
  // The backward likewise (head_dim 64 is not on the Hopper backward), once the call has dout.
  const Tensor lse = Tensor::empty({1, 2, 8}, DType::f32, dev), dq = Tensor::empty(q.shape(), q.dtype(), dev);
  const Tensor dk = Tensor::empty(kv.shape(), kv.dtype(), dev), dv = Tensor::empty(kv.shape(), kv.dtype(), dev);
  KernelArgs bw;
  bw.tensor("dout", out).tensor("q", q).tensor("k", kv).tensor("v", kv).tensor("out", out).tensor("lse", lse);
  bw.tensor("dq", dq).tensor("dk", dk).tensor("dv", dv);
  {
    const ScopedEnv env("KCPP_FLASH_ATTN_BACKWARD", "hopper");
    EXPECT_TRUE(test::refused(k.supports(bw, dev, test::kTraining), KCPP_ERROR_UNSUPPORTED, "KCPP_FLASH_ATTN_BACKWARD=hopper"));
    EXPECT_TRUE(k.supports(a, dev, test::kInference).ok());  // a forward call does not ask for the backward
  }
  {
    const ScopedEnv env("KCPP_FLASH_ATTN_BACKWARD", "ampere");
    EXPECT_TRUE(k.supports(bw, dev, test::kTraining).ok());
  }
  {
    const ScopedEnv env("KCPP_FLASH_ATTN_BACKWARD", "fastest");
    EXPECT_TRUE(test::refused(k.supports(bw, dev, test::kTraining), KCPP_ERROR_UNSUPPORTED, "'fastest'"));
  }
}

// A query that sees no key (a window of keys that all lie ahead of it cannot happen; here: no
// queries at all, and sequences of one) and empty batches run and write what the contract says.
TEST_P(FlashAttnPackage, EmptyShapes) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer k = layer();
  // No queries but 5 keys: out empty, dk and dv zero.
  const Case c{1, 2, 1, 0, 5, 64, true, 0};
  const Tensor q = make(1, 2, 0, 64, DType::bf16, dev, gen, false), kk = make(1, 1, 5, 64, DType::bf16, dev, gen, false);
  const Tensor v = make(1, 1, 5, 64, DType::bf16, dev, gen, false), dout = make(1, 2, 0, 64, DType::bf16, dev, gen, false);
  const Result r = run_both(k, q, kk, v, dout, c, dev);
  for (double x : r.dk.to_f64_vector()) ASSERT_EQ(x, 0.0);
  for (double x : r.dv.to_f64_vector()) ASSERT_EQ(x, 0.0);
}

TEST_P(FlashAttnPackage, BadInputIsRefusedNamingTheArgument) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer k = layer();
  const Tensor q = Tensor::randn({1, 4, 8, 64}, DType::bf16, dev, gen), kv = Tensor::randn({1, 2, 8, 64}, DType::bf16, dev, gen);
  const Tensor out = Tensor::empty(q.shape(), q.dtype(), dev);
  std::vector<std::unique_ptr<KernelArgs>> keep;
  auto args = [&](const Tensor& qq, const Tensor& kk, const Tensor& vv, const Tensor& oo) -> KernelArgs& {
    keep.push_back(std::make_unique<KernelArgs>());
    keep.back()->tensor("q", qq).tensor("k", kk).tensor("v", vv).tensor("out", oo);
    return *keep.back();
  };
  EXPECT_TRUE(k.supports(args(q, kv, kv, out), dev, test::kInference).ok());
  const Tensor k3 = Tensor::randn({1, 3, 8, 64}, DType::bf16, dev, gen);
  EXPECT_TRUE(test::refused(k.supports(args(q, k3, k3, out), dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT,
                            "not a multiple of 3 kv heads"));
  const Tensor kd = Tensor::randn({1, 2, 8, 32}, DType::bf16, dev, gen);
  EXPECT_TRUE(test::refused(k.supports(args(q, kd, kd, out), dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "'k'"));
  const Tensor kf = Tensor::randn({1, 2, 8, 64}, DType::f32, dev, gen);
  EXPECT_TRUE(test::refused(k.supports(args(q, kf, kv, out), dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "'k' is f32"));
  const Tensor ks = Tensor::randn({1, 2, 4, 64}, DType::bf16, dev, gen);
  EXPECT_TRUE(test::refused(k.supports(args(q, ks, ks, out), dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT,
                            "8 queries but only 4 keys"));
  const Tensor vs = Tensor::randn({1, 2, 9, 64}, DType::bf16, dev, gen);
  EXPECT_TRUE(test::refused(k.supports(args(q, kv, vs, out), dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "'v' has 9"));
  const Tensor strided_d = Tensor::randn({1, 2, 64, 8}, DType::bf16, dev, gen).transpose(2, 3);
  EXPECT_TRUE(test::refused(k.supports(args(q, strided_d, kv, out), dev, test::kInference), KCPP_ERROR_UNSUPPORTED,
                            "head_dim must be contiguous"));
  EXPECT_TRUE(test::refused(k.supports(args(q, kv, kv, q), dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT,
                            "'out' must not overlap"));
  KernelArgs& w = args(q, kv, kv, out);
  w.integer("window", -1);
  EXPECT_TRUE(test::refused(k.supports(w, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "'window'"));
  KernelArgs& s = args(q, kv, kv, out);
  s.real("scale", std::numeric_limits<double>::infinity());
  EXPECT_TRUE(test::refused(k.supports(s, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "'scale'"));
  // Backward without lse.
  KernelArgs& b = args(q, kv, kv, out);
  const Tensor dq = Tensor::empty(q.shape(), q.dtype(), dev), dk = Tensor::empty(kv.shape(), kv.dtype(), dev),
               dv = Tensor::empty(kv.shape(), kv.dtype(), dev);
  b.tensor("dout", q).tensor("dq", dq).tensor("dk", dk).tensor("dv", dv);
  EXPECT_TRUE(test::refused(k.supports(b, dev, test::kTraining), KCPP_ERROR_INVALID_ARGUMENT, "'lse'"));
}

INSTANTIATE_TEST_SUITE_P(Devices, FlashAttnPackage, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cuda() ? std::string("cuda") : std::string("cpu"); });

}  // namespace
}  // namespace kcpp
