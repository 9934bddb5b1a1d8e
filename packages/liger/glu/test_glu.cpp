// GLU kernels against the f64 oracle, held to docs/DESIGN.md's bound: at most twice the error of the
// eager reference (ops::glu_*) in the same precision, and within the dtype's table.
#include "core/cuda_runtime.h"
#include "ops/ops.h"
#include "glu.h"
#include "glu_tuning.h"
#include "kernel_params.h"
#include "oracle.h"
#include "ops/nn/glu.h"
#include "test_util.h"

namespace kcpp {
namespace {

using ops::GluActivation;

struct GluKernel {
  Device dev;
  static void check(const char* err) { test::check(err); }
  const char* forward_raw(const liger::GluParams& p) const { return KCPP_CALL_KERNEL(dev, liger::glu_forward, p); }
  const char* backward_raw(const liger::GluParams& p) const { return KCPP_CALL_KERNEL(dev, liger::glu_backward, p); }
  Tensor forward(const Tensor& g, const Tensor& u, GluActivation a) const {
    Tensor out = Tensor::empty(g.shape(), g.dtype(), dev);
    check(forward_raw(test::glu_params(g, u, a, out)));
    return out;
  }
  // dgate / dup default to fresh tensors; pass gate / up themselves for the in-place form.
  std::pair<Tensor, Tensor> backward(const Tensor& d, const Tensor& g, const Tensor& u, GluActivation a,
                                     Tensor dgate = {}, Tensor dup = {}) const {
    if (!dgate.defined()) dgate = Tensor::empty(g.shape(), g.dtype(), dev);
    if (!dup.defined()) dup = Tensor::empty(g.shape(), g.dtype(), dev);
    check(backward_raw(test::glu_params(g, u, a, {}, d, dgate, dup)));
    return {dgate, dup};
  }
};

oracle::Act oracle_act(GluActivation a) {
  return a == GluActivation::Silu ? oracle::Act::Silu : a == GluActivation::Gelu ? oracle::Act::Gelu : oracle::Act::GeluTanh;
}

class LigerGlu : public ::testing::TestWithParam<Device> {};

TEST_P(LigerGlu, WithinTwiceTheReferenceError) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const GluKernel k{dev};
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (GluActivation act : {GluActivation::Silu, GluActivation::Gelu, GluActivation::GeluTanh})
      for (int64_t n : {1, 7, 4096, 4097, 3 * 14336 + 5})
        for (bool misaligned : {false, true}) {
          // Misaligned: a view starting one element into its buffer, so the scalar path runs.
          auto make = [&](double sd) {
            const Tensor t = Tensor::randn({n + 1}, dt, dev, gen, 0.0, sd);
            return misaligned ? t.narrow(0, 1, n) : t.narrow(0, 0, n);
          };
          const Tensor g = make(2.0), u = make(1.0), d = make(1.0);
          const auto gv = g.to_f64_vector(), uv = u.to_f64_vector();
          std::vector<double> dg, du;
          oracle::glu_backward(d.to_f64_vector(), gv, uv, oracle_act(act), dg, du);
          const auto fo = oracle::glu(gv, uv, oracle_act(act));
          const auto mag = oracle::glu_magnitude(d.to_f64_vector(), gv, uv, oracle_act(act));
          const std::string cfg = fmt::format("{} act={} n={} misaligned={}", test::config_name(dev, dt),
                                              static_cast<int>(act), n, misaligned);
          const double tol = test::composite_rel_l2(dt);
          const double e_ref = test::mag_error(ops::glu_forward(g, u, act), fo, mag.out);
          const double e = test::mag_error(k.forward(g, u, act), fo, mag.out);
          EXPECT_LE(e, test::kernel_bound(e_ref, dt)) << cfg << " out (reference error " << e_ref << ")";
          EXPECT_LE(e, tol + test::underflow_allowance(dt, mag.out)) << cfg;
          const auto rb = ops::glu_backward(d, g, u, act);
          const auto [kg, ku] = k.backward(d, g, u, act);
          const double eg_ref = test::mag_error(rb.dgate, dg, mag.dgate), eu_ref = test::mag_error(rb.dup, du, mag.dup);
          const double eg = test::mag_error(kg, dg, mag.dgate), eu = test::mag_error(ku, du, mag.dup);
          EXPECT_LE(eg, test::kernel_bound(eg_ref, dt)) << cfg << " dgate (reference error " << eg_ref << ")";
          EXPECT_LE(eu, test::kernel_bound(eu_ref, dt)) << cfg << " dup (reference error " << eu_ref << ")";
          // A one-element f16 gradient may land among the subnormals (d, u and silu(g) all small).
          const double floor = std::max(test::underflow_allowance(dt, mag.dgate), test::underflow_allowance(dt, mag.dup));
          EXPECT_LE(std::max(eg, eu), tol + floor) << cfg;
        }
}

TEST_P(LigerGlu, InPlaceMatchesOutOfPlace) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const GluKernel k{dev};
  const Tensor g = Tensor::randn({3, 1001}, DType::bf16, dev, gen), u = Tensor::randn({3, 1001}, DType::bf16, dev, gen);
  const Tensor d = Tensor::randn({3, 1001}, DType::bf16, dev, gen);
  const auto [dg, du] = k.backward(d, g, u, GluActivation::Silu);
  const Tensor g2 = g.clone(), u2 = u.clone();
  const auto [dg2, du2] = k.backward(d, g2, u2, GluActivation::Silu, g2, u2);  // gradients over the inputs
  EXPECT_TRUE(dg2.shares_storage(g2));
  EXPECT_EQ(dg2.to_f64_vector(), dg.to_f64_vector());
  EXPECT_EQ(du2.to_f64_vector(), du.to_f64_vector());
  const Tensor out = k.forward(g, u, GluActivation::Gelu), g3 = g.clone();
  k.check(k.forward_raw(test::glu_params(g3, u, GluActivation::Gelu, g3)));
  EXPECT_EQ(g3.to_f64_vector(), out.to_f64_vector());
}

// Rows with strides of their own: the halves of a packed [rows, 2I] gate_up (Phi-3's MLP), the
// gradients into the halves of one [rows, 2I] buffer, and row strides wider than both (a slice of a
// wider buffer): the same bits as the kernel on contiguous copies (the maths is elementwise).
TEST_P(LigerGlu, PackedHalvesMatchContiguousCopies) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const GluKernel k{dev};
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (const auto& [rows, inter, pad] : {std::tuple{37, 1024, 0}, std::tuple{5, 1001, 0}, std::tuple{70000, 8, 8},
                                           std::tuple{3, 4104, 3}}) {
      const std::string cfg = fmt::format("{} rows={} inter={} pad={}", test::config_name(dev, dt), rows, inter, pad);
      const Tensor gu = Tensor::randn({rows, 2 * inter + pad}, dt, dev, gen, 0.0, 2.0);
      const Tensor d = Tensor::randn({rows, inter + pad}, dt, dev, gen).narrow(1, 0, inter);
      const Tensor g = gu.narrow(1, 0, inter), u = gu.narrow(1, inter, inter);
      const Tensor out = Tensor::empty({rows, inter}, dt, dev);
      k.check(k.forward_raw(test::glu_rows_params(g, u, GluActivation::Silu, out)));
      const Tensor gc = g.contiguous(), uc = u.contiguous(), dc = d.contiguous();
      EXPECT_EQ(out.to_f64_vector(), k.forward(gc, uc, GluActivation::Silu).to_f64_vector()) << cfg;
      const Tensor dgu = Tensor::full({rows, 2 * inter + pad}, 7.0, dt, dev);
      const Tensor dg = dgu.narrow(1, 0, inter), du = dgu.narrow(1, inter, inter);
      k.check(k.backward_raw(test::glu_rows_params(g, u, GluActivation::GeluTanh, {}, d, dg, du)));
      const auto [rg, ru] = k.backward(dc, gc, uc, GluActivation::GeluTanh);
      EXPECT_EQ(dg.contiguous().to_f64_vector(), rg.to_f64_vector()) << cfg << " dgate";
      EXPECT_EQ(du.contiguous().to_f64_vector(), ru.to_f64_vector()) << cfg << " dup";
      if (pad > 0)  // the padding columns are not written
        EXPECT_EQ(dgu.narrow(1, 2 * inter, pad).contiguous().to_f64_vector(), std::vector<double>(rows * pad, 7.0)) << cfg;
    }
  // A row stride below the row is an error.
  const Tensor g = Tensor::randn({4, 16}, DType::bf16, dev, gen);
  liger::GluParams p = test::glu_rows_params(g, g, GluActivation::Silu, Tensor::empty({4, 16}, DType::bf16, dev));
  p.up_ld = 8;
  EXPECT_TRUE(test::kernel_error_contains(k.forward_raw(p), "a row stride of 8 is below the row's 16 elements"));
}

TEST_P(LigerGlu, NaNPropagatesAndBadInputIsAnError) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const GluKernel k{dev};
  std::vector<double> gv(16, 0.5);
  gv[3] = std::nan("");
  const Tensor g = Tensor::from_f64(gv, {16}, DType::bf16, dev), u = Tensor::full({16}, 1.0, DType::bf16, dev);
  const auto out = k.forward(g, u, GluActivation::Silu).to_f64_vector();
  EXPECT_TRUE(std::isnan(out[3]));
  EXPECT_FALSE(std::isnan(out[4]));
  liger::GluParams p = test::glu_params(g, u, GluActivation::Silu, Tensor::empty({16}, DType::bf16, dev));
  auto expect_error = [&](const liger::GluParams& q, const char* needle, bool backward) {
    EXPECT_TRUE(test::kernel_error_contains(backward ? k.backward_raw(q) : k.forward_raw(q), needle));
  };
  liger::GluParams q = p;
  q.up = nullptr;
  expect_error(q, "'gate' and 'up' must not be null", false);
  q = p;
  q.act = static_cast<liger::GluActivation>(5);
  expect_error(q, "unknown activation 5", false);
  q = p;
  q.n = -3;
  expect_error(q, "n = -3 < 0", false);
  expect_error(p, "'dout', 'dgate' and 'dup' must not be null", true);
  EXPECT_THROW(test::glu_params(Tensor::zeros({4, 6}, DType::bf16, dev).transpose(0, 1), u, GluActivation::Silu, u),
               Error);  // non-contiguous: refused before the kernel
}

#if KCPP_WITH_CUDA
// Every launch configuration the sweep can choose stays within the bound (fast math included).
TEST(LigerGluCuda, EveryConfigurationWithinTheBound) {
  const Device dev = Device::cuda(0);
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  for (DType dt : {DType::bf16, DType::f16, DType::f32})
    for (GluActivation act : {GluActivation::Silu, GluActivation::Gelu, GluActivation::GeluTanh}) {
      const int64_t n = 8 * 4099;  // aligned, not a multiple of a block's work
      const Tensor g = Tensor::randn({n}, dt, dev, gen, 0.0, 2.0), u = Tensor::randn({n}, dt, dev, gen);
      const Tensor d = Tensor::randn({n}, dt, dev, gen);
      const auto gv = g.to_f64_vector(), uv = u.to_f64_vector(), dv = d.to_f64_vector();
      std::vector<double> dg, du;
      oracle::glu_backward(dv, gv, uv, oracle_act(act), dg, du);
      const auto fo = oracle::glu(gv, uv, oracle_act(act));
      const auto mag = oracle::glu_magnitude(dv, gv, uv, oracle_act(act));
      const auto rb = ops::glu_backward(d, g, u, act);
      const double bf = test::kernel_bound(test::mag_error(ops::glu_forward(g, u, act), fo, mag.out), dt);
      const double bg = test::kernel_bound(test::mag_error(rb.dgate, dg, mag.dgate), dt);
      const double bu = test::kernel_bound(test::mag_error(rb.dup, du, mag.dup), dt);
      for (int unroll : {1, 2, 4})
        for (int blocks : {0, 1, 16})  // 0: a chunk a block
          for (bool fast : {false, true}) {
            const liger::GluConfig c{unroll, blocks, fast};
            const std::string cfg = fmt::format("{} act={} unroll={} blocks={} fast={}", dtype_name(dt),
                                                static_cast<int>(act), unroll, blocks, fast);
            Tensor out = Tensor::empty({n}, dt, dev), dgk = Tensor::empty({n}, dt, dev), duk = Tensor::empty({n}, dt, dev);
            test::check(test::finish_cuda(liger::glu_forward_cuda_with(test::glu_params(g, u, act, out), cuda::current_stream(), c)));
            test::check(test::finish_cuda(
                liger::glu_backward_cuda_with(test::glu_params(g, u, act, {}, d, dgk, duk), cuda::current_stream(), c)));
            EXPECT_LE(test::mag_error(out, fo, mag.out), bf) << cfg;
            EXPECT_LE(test::mag_error(dgk, dg, mag.dgate), bg) << cfg;
            EXPECT_LE(test::mag_error(duk, du, mag.dup), bu) << cfg;
          }
    }
}
#endif

INSTANTIATE_TEST_SUITE_P(Devices, LigerGlu, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cpu() ? std::string("cpu") : std::string("cuda"); });

}  // namespace
}  // namespace kcpp
