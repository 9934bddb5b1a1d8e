// RoPE kernels against the f64 oracle, held to DESIGN.md's bound: at most twice the error of the
// eager reference (ops::rope_*) in the same precision, and within the dtype's table.
#include "kernel_params.h"
#include "oracle.h"
#include "ops/nn/rope.h"
#include "rope.h"
#include "test_util.h"

namespace kcpp {
namespace {

using ops::RopeLayout;

class LigerRope : public ::testing::TestWithParam<Device> {};

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
                test::check(backward ? KCPP_CALL_KERNEL(dev, liger::rope_backward, p) : KCPP_CALL_KERNEL(dev, liger::rope_forward, p));
                for (const auto& [x, out, heads, name] :
                     {std::tuple{q, qo, c.hq, "q"}, std::tuple{k, ko, c.hk, "k"}}) {
                  if (!heads) continue;
                  const auto ref64 = oracle::rope(x.to_f64_vector(), cv, sv, c.b, heads, c.s, c.d, c.rd, cb, backward, il);
                  const Tensor r = backward ? ops::rope_backward(x, cs.cos, cs.sin, layout) : ops::rope_forward(x, cs.cos, cs.sin, layout);
                  const double e_ref = test::rel_l2_error(r, ref64), e = test::rel_l2_error(out, ref64);
                  EXPECT_LE(e, test::kernel_bound(e_ref, dt)) << cfg << " " << name << " backward=" << backward
                                                              << " (reference error " << e_ref << ")";
                  EXPECT_LE(e, test::composite_rel_l2(dt)) << cfg << " " << name << " backward=" << backward;
                }
              }
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
