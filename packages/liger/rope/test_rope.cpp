// RoPE kernels against the f64 oracle, held to docs/DESIGN.md's bound: at most twice the error of the
// eager reference (ops::rope_*) in the same precision, and within the dtype's table.
#include "kernel_params.h"
#include "oracle.h"
#include "ops/nn/rope.h"
#include "rope.h"
#include "rope_tuning.h"
#include "test_util.h"

namespace kcpp {
namespace {

using ops::RopeLayout;

class LigerRope : public ::testing::TestWithParam<Device> {};

// The CUDA configurations every case runs in (index 0: the entry points' default); the CPU has one.
#if KCPP_WITH_CUDA
const liger::RopeConfig kConfigs[] = {{},           {64, 0, 0},    {64, 16, 0},   {128, 0, 0},    {128, 0, 3, 1},
                                      {160, 0, 2, 1}, {64, 0, 1, 2}, {256, 0, 4, 2}, {160, 0, 3, 2}};
#endif
int config_count(Device dev) {
#if KCPP_WITH_CUDA
  if (dev.is_cuda()) return static_cast<int>(std::size(kConfigs));
#endif
  return 1;
}

const char* run_rope(Device dev, const liger::RopeParams& p, bool backward, int config) {
#if KCPP_WITH_CUDA
  if (dev.is_cuda() && config > 0) {
    const cudaStream_t st = cuda::current_stream();
    return test::finish_cuda(backward ? liger::rope_backward_cuda_with(p, st, kConfigs[config])
                                      : liger::rope_forward_cuda_with(p, st, kConfigs[config]));
  }
#endif
  (void)config;
  return backward ? KCPP_CALL_KERNEL(dev, liger::rope_backward, p) : KCPP_CALL_KERNEL(dev, liger::rope_forward, p);
}

struct Case {
  int64_t b, s, hq, hk, d, rd;
};

// A logical [B, H, S, D] tensor stored as [B, S, H, D] (bshd) or as [B, H, S, D].
Tensor make(const Case& c, int64_t heads, bool bshd, DType dt, Device dev, Generator& gen) {
  if (bshd) return Tensor::randn({c.b, c.s, heads, c.d}, dt, dev, gen).transpose(1, 2);
  return Tensor::randn({c.b, heads, c.s, c.d}, dt, dev, gen);
}
Tensor empty_like(const Tensor& t, bool bshd) {
  const int64_t b = t.size(0), h = t.size(1), s = t.size(2), d = t.size(3);
  if (bshd) return Tensor::empty({b, s, h, d}, t.dtype(), t.device()).transpose(1, 2);
  return Tensor::empty({b, h, s, d}, t.dtype(), t.device());
}

TEST_P(LigerRope, WithinTwiceTheReferenceError) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const Case cases[] = {{1, 1, 1, 0, 2, 2}, {2, 7, 3, 1, 16, 16}, {3, 5, 5, 2, 24, 8}, {1, 9, 4, 2, 128, 64},
                        {2, 33, 32, 8, 128, 128}};
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (const Case& c : cases)
      for (RopeLayout layout : {RopeLayout::RotateHalf, RopeLayout::Interleaved})
        for (bool bshd : {true, false})
          for (bool shared_cs : {false, true})
            for (bool in_place : {false, true}) {
              const int64_t cb = shared_cs ? 1 : c.b;
              std::vector<int64_t> pos(static_cast<size_t>(cb * c.s));
              for (int64_t i = 0; i < cb; ++i)
                for (int64_t j = 0; j < c.s; ++j) pos[i * c.s + j] = 7 * i + 3 * j;  // not just 0..S-1
              const auto cs = ops::rope_cos_sin(Tensor::from_i64(pos, {cb, c.s}, DType::i64, dev),
                                                ops::rope_inv_freq(c.rd, 10000.0, dev), 1.0, dt);
              const Tensor q = make(c, c.hq, bshd, dt, dev, gen);
              const Tensor k = c.hk ? make(c, c.hk, bshd, dt, dev, gen) : Tensor();
              const auto cv = cs.cos.to_f64_vector(), sv = cs.sin.to_f64_vector();
              const bool il = layout == RopeLayout::Interleaved;
              const std::string cfg = fmt::format("{} b={} s={} hq={} hk={} d={} rd={} interleaved={} bshd={} shared={} "
                                                  "in_place={}", test::config_name(dev, dt), c.b, c.s, c.hq, c.hk, c.d,
                                                  c.rd, il, bshd, shared_cs, in_place);
              for (int config = 0; config < config_count(dev); ++config)
              for (bool backward : {false, true}) {
                // In place: the kernel overwrites copies in q's physical layout (q and k stay intact).
                const Tensor qx = in_place ? empty_like(q, bshd) : q, kx = in_place && k.defined() ? empty_like(k, bshd) : k;
                if (in_place) {
                  qx.copy_(q);
                  if (k.defined()) kx.copy_(k);
                }
                const Tensor qo = in_place ? qx : empty_like(q, bshd);
                const Tensor ko = k.defined() ? (in_place ? kx : empty_like(k, bshd)) : Tensor();
                auto p = test::rope_params(qx, qo, kx, ko, cs.cos, cs.sin, layout);
                test::check(run_rope(dev, p, backward, config));
                for (const auto& [x, out, heads, name] :
                     {std::tuple{q, qo, c.hq, "q"}, std::tuple{k, ko, c.hk, "k"}}) {
                  if (!heads) continue;
                  const auto ref64 = oracle::rope(x.to_f64_vector(), cv, sv, c.b, heads, c.s, c.d, c.rd, cb, backward, il);
                  const Tensor r = backward ? ops::rope_backward(x, cs.cos, cs.sin, layout) : ops::rope_forward(x, cs.cos, cs.sin, layout);
                  const double e_ref = test::rel_l2_error(r, ref64), e = test::rel_l2_error(out, ref64);
                  EXPECT_LE(e, test::kernel_bound(e_ref, dt)) << cfg << " " << name << " backward=" << backward
                                                              << " config " << config << " (reference error " << e_ref << ")";
                  EXPECT_LE(e, test::composite_rel_l2(dt)) << cfg << " " << name << " backward=" << backward << " config " << config;
                }
              }
            }
}

// NaN and Inf reach exactly the outputs they reach in PyTorch's x cos + rotate_half(x) sin (the eager
// reference): the two elements of their pair, NaN where an infinity meets a zero cos or sin (token 0
// has sin = 0) or an infinity of the other sign; every other element stays finite and within the bound.
TEST_P(LigerRope, NaNAndInfReachOnlyTheirPair) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const int64_t b = 2, s = 5, hq = 4, hk = 2, d = 64;
  for (DType dt : {DType::f32, DType::bf16})
    for (RopeLayout layout : {RopeLayout::RotateHalf, RopeLayout::Interleaved})
      for (int config = 0; config < config_count(dev); ++config)
      for (bool backward : {false, true}) {
        std::vector<int64_t> pos(static_cast<size_t>(s));
        for (int64_t j = 0; j < s; ++j) pos[j] = j;  // token 0: cos = 1, sin = 0
        const auto cs = ops::rope_cos_sin(Tensor::from_i64(pos, {1, s}, DType::i64, dev), ops::rope_inv_freq(d, 10000.0, dev),
                                          1.0, dt);
        std::vector<double> qv = Tensor::randn({b, hq, s, d}, DType::f64, Device::cpu(), gen).to_f64_vector();
        std::vector<double> kv = Tensor::randn({b, hk, s, d}, DType::f64, Device::cpu(), gen).to_f64_vector();
        auto at = [&](int64_t bi, int64_t heads, int64_t h, int64_t si, int64_t e) {
          return static_cast<size_t>(((bi * heads + h) * s + si) * d + e);
        };
        const double inf = std::numeric_limits<double>::infinity();
        qv[at(0, hq, 1, 2, 5)] = std::nan("");  // first half of its pair (RotateHalf), even (Interleaved)
        qv[at(1, hq, 3, 0, 40)] = inf;          // token 0: sin 0, so inf x 0 = NaN in the partner
        qv[at(1, hq, 0, 4, 63)] = -inf;
        kv[at(0, hk, 1, 3, 0)] = inf;
        kv[at(0, hk, 1, 3, 32)] = -inf;         // RotateHalf: the same pair as the one above
        const Tensor q = Tensor::from_f64(qv, {b, hq, s, d}, dt, dev), k = Tensor::from_f64(kv, {b, hk, s, d}, dt, dev);
        const Tensor qo = Tensor::full({b, hq, s, d}, 0.0, dt, dev), ko = Tensor::full({b, hk, s, d}, 0.0, dt, dev);
        const auto p = test::rope_params(q, qo, k, ko, cs.cos, cs.sin, layout);
        test::check(run_rope(dev, p, backward, config));
        const std::string cfg = fmt::format("{} interleaved={} backward={} config {}", test::config_name(dev, dt),
                                            layout == RopeLayout::Interleaved, backward, config);
        int nonfinite = 0;
        for (const auto& [x, out, name] : {std::tuple{q, qo, "q"}, std::tuple{k, ko, "k"}}) {
          const Tensor r = backward ? ops::rope_backward(x, cs.cos, cs.sin, layout) : ops::rope_forward(x, cs.cos, cs.sin, layout);
          const auto want = r.to_f64_vector(), got = out.to_f64_vector();
          for (size_t i = 0; i < want.size(); ++i) {
            if (std::isfinite(want[i])) {
              ASSERT_TRUE(std::isfinite(got[i])) << cfg << " " << name << "[" << i << "] = " << got[i] << ", eager " << want[i];
              EXPECT_NEAR(got[i], want[i], test::composite_rel_l2(dt) * (1 + std::fabs(want[i]))) << cfg << " " << name << i;
            } else {
              ++nonfinite;
              EXPECT_EQ(std::isnan(got[i]), std::isnan(want[i])) << cfg << " " << name << "[" << i << "] = " << got[i]
                                                                 << ", eager " << want[i];
              if (std::isinf(want[i])) EXPECT_EQ(got[i], want[i]) << cfg << " " << name << "[" << i << "]";
            }
          }
        }
        // Both elements of every pair hit: four pairs in RotateHalf (k's two infinities share one), five
        // in Interleaved.
        EXPECT_EQ(nonfinite, layout == RopeLayout::Interleaved ? 10 : 8) << cfg;
      }
}

TEST_P(LigerRope, BadInputIsAnError) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const Tensor q = Tensor::zeros({1, 2, 3, 8}, DType::bf16, dev), cs = Tensor::zeros({1, 3, 8}, DType::bf16, dev);
  const liger::RopeParams p = test::rope_params(q, q, {}, {}, cs, cs, RopeLayout::RotateHalf);
  ASSERT_EQ(KCPP_CALL_KERNEL(dev, liger::rope_forward, p), nullptr);
  auto expect_error = [&](const liger::RopeParams& b, const char* needle) {
    EXPECT_TRUE(test::kernel_error_contains(KCPP_CALL_KERNEL(dev, liger::rope_forward, b), needle));
  };
  liger::RopeParams b = p;
  b.rotary_dim = 7;
  expect_error(b, "rotary_dim 7 must be even");
  b = p;
  b.rotary_dim = 16;
  expect_error(b, "<= head_dim 8");
  b = p;
  b.cos = nullptr;
  expect_error(b, "'cos' and 'sin' must not be null");
  b = p;
  b.q.in_stride_h = 4;
  expect_error(b, "head stride 4 < head_dim 8");
  b = p;
  b.q.out_stride_s = 99;
  expect_error(b, "in-place output must have the input's strides");
  b = p;
  b.layout = static_cast<liger::RopeLayout>(3);
  expect_error(b, "unknown layout 3");
  EXPECT_THROW(test::rope_params(Tensor::zeros({1, 2, 8, 3}, DType::bf16, dev).transpose(2, 3), q, {}, {}, cs, cs,
                                 RopeLayout::RotateHalf),
               Error);  // head_dim not contiguous: refused before the kernel
}

INSTANTIATE_TEST_SUITE_P(Devices, LigerRope, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cpu() ? std::string("cpu") : std::string("cuda"); });

}  // namespace
}  // namespace kcpp
