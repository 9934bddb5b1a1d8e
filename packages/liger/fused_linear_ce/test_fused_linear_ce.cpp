// Fused linear cross-entropy against the f64 oracle (logits = X W^T + b in f64, the oracle's
// cross-entropy and its gradient G, then G W, G^T X, sum_i G_i), held to docs/DESIGN.md's bound: at most
// twice the error of the eager composition (matmul, add, cross_entropy forward and backward, two
// matmuls) in the same precision.  Several chunks per call (chunk_rows well below n) so that the
// chunk boundaries and the accumulation of dW over chunks are exercised.
#include <cmath>
#include <limits>

#include "fused_linear_ce/fused_linear_ce.h"
#include "kernel_params.h"
#include "oracle.h"
#include "ops/nn/cross_entropy.h"
#include "ops/ops.h"
#include "test_util.h"

namespace kcpp {
namespace {

using ops::Reduction;

// Holds every tensor the params point at.
struct Flce {
  Device dev;
  Tensor hidden, weight, bias, targets, loss, lse, dhidden, dweight, dbias, ws;
  liger::FusedLinearCEParams p;

  void setup(Reduction red, bool grads) {
    const int64_t n = hidden.size(0), h = hidden.size(1), v = weight.size(0);
    p.dtype = test::kernel_dtype(hidden.dtype());
    p.n = n, p.h = h, p.v = v;
    p.hidden = hidden.data(), p.hidden_stride = hidden.stride(0);
    p.weight = weight.data(), p.weight_stride = weight.stride(0);
    p.bias = bias.defined() ? bias.data() : nullptr;
    p.targets = targets.data(), p.targets_i32 = targets.dtype() == DType::i32;
    p.reduction = static_cast<liger::CEReduction>(static_cast<int>(red));
    loss = Tensor::full({red == Reduction::None ? n : 1}, std::nan(""), DType::f32, dev);
    lse = Tensor::full({n}, std::nan(""), DType::f32, dev);
    p.loss = static_cast<float*>(loss.data());
    p.lse = static_cast<float*>(lse.data());
    if (grads) {
      dhidden = Tensor::full({n, h}, std::nan(""), hidden.dtype(), dev);
      if (!dweight.defined()) dweight = Tensor::full({v, h}, std::nan(""), hidden.dtype(), dev);
      p.dhidden = dhidden.data(), p.dhidden_stride = h;
      p.dweight = dweight.data();
      if (bias.defined()) {
        if (!dbias.defined()) dbias = Tensor::full({v}, std::nan(""), hidden.dtype(), dev);
        p.dbias = dbias.data();
      }
    }
  }
  const char* run() {
    const bool cuda = dev.is_cuda();
    ws = Tensor::empty({static_cast<int64_t>(liger::fused_linear_ce_workspace(p, cuda))}, DType::u8, dev);
    p.workspace = ws.data();
    return KCPP_CALL_KERNEL(dev, liger::fused_linear_ce, p);
  }
};

struct Case {
  int64_t n, h, v, chunk;
  bool bias;
  double eps;
  Reduction red;
  bool accum_f32, i32, strided;
};

class LigerFusedLinearCE : public ::testing::TestWithParam<Device> {};

TEST_P(LigerFusedLinearCE, WithinTwiceTheReferenceError) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const Case cases[] = {
      {1, 1, 1, 0, false, 0.0, Reduction::Mean, false, false, false},
      {37, 7, 3, 8, true, 0.1, Reduction::Mean, false, true, false},
      {17, 111, 4097, 4, true, 0.0, Reduction::Sum, false, false, true},
      {17, 111, 4097, 4, false, 0.1, Reduction::Mean, true, false, false},
      {29, 64, 1000, 0, true, 0.0, Reduction::Mean, false, false, false},
      {5, 32, 50257, 2, false, 0.0, Reduction::Mean, false, true, true},
      {3, 16, 151936, 2, true, 0.0, Reduction::Mean, false, false, false},
      {23, 48, 300, 5, false, 0.0, Reduction::None, false, false, false},
  };
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (const Case& k : cases) {
      const bool grads = k.red != Reduction::None;
      const std::string cfg = fmt::format("{} n={} h={} v={} chunk={} bias={} eps={} reduction={} accum_f32={} strided={}",
                                          test::config_name(dev, dt), k.n, k.h, k.v, k.chunk, k.bias, k.eps,
                                          static_cast<int>(k.red), k.accum_f32, k.strided);
      Flce f{dev};
      // Logits of standard deviation ~2: a spread softmax, neither uniform nor one-hot.
      const Tensor wide = Tensor::randn({k.n, k.h + (k.strided ? 5 : 0)}, dt, dev, gen, 0, 1);
      f.hidden = k.strided ? wide.narrow(1, 2, k.h) : wide;
      f.weight = Tensor::randn({k.v, k.h}, dt, dev, gen, 0, 2.0 / std::sqrt(static_cast<double>(k.h)));
      if (k.bias) f.bias = Tensor::randn({k.v}, dt, dev, gen, 0, 0.5);
      std::vector<int64_t> t(static_cast<size_t>(k.n));
      std::uniform_int_distribution<int64_t> pick(0, k.v - 1);
      for (int64_t i = 0; i < k.n; ++i) t[i] = i % 4 == 1 ? -100 : pick(gen.engine());
      f.targets = Tensor::from_i64(t, {k.n}, k.i32 ? DType::i32 : DType::i64, dev);
      f.p.label_smoothing = static_cast<float>(k.eps);
      f.p.chunk_rows = k.chunk;
      f.p.accum_f32 = k.accum_f32;
      f.setup(k.red, grads);
      ASSERT_EQ(f.run(), nullptr) << cfg;

      // The oracle.
      const auto xv = f.hidden.contiguous().to_f64_vector(), wv = f.weight.to_f64_vector();
      auto lv = oracle::matmul(xv, wv, 1, k.n, k.v, k.h, false, true, false);
      if (k.bias) {
        const auto bv = f.bias.to_f64_vector();
        for (int64_t i = 0; i < k.n; ++i)
          for (int64_t j = 0; j < k.v; ++j) lv[i * k.v + j] += bv[j];
      }
      int64_t count = 0;
      const auto rows = oracle::cross_entropy_rows(lv, t, k.n, k.v, -100, k.eps, count);
      double total = 0;
      for (double r : rows) total += r;
      const std::vector<double> ref_loss =
          k.red == Reduction::None ? rows : std::vector<double>{k.red == Reduction::Sum ? total : total / count};
      // The eager composition in the same precision, upstream gradient 1.
      Tensor logits = ops::matmul(f.hidden, f.weight, false, true);
      if (k.bias) logits = ops::add(logits, f.bias);
      const ops::CrossEntropyOptions opt{-100, k.red, k.eps};
      const auto rf = ops::cross_entropy_forward(logits, f.targets, opt);
      const double el_ref = test::rel_l2_error(rf.loss, ref_loss), el = test::rel_l2_error(f.loss, ref_loss);
      EXPECT_LE(el, test::kernel_bound(el_ref, dt)) << cfg << " loss (reference error " << el_ref << ")";
      if (!grads) continue;

      std::vector<double> g(static_cast<size_t>(k.n), k.red == Reduction::Mean ? 1.0 / count : 1.0);
      const auto gv = oracle::cross_entropy_backward(lv, t, g, k.n, k.v, -100, k.eps);
      const auto ref_dx = oracle::matmul(gv, wv, 1, k.n, k.h, k.v, false, false, false);
      const auto ref_dw = oracle::matmul(gv, xv, 1, k.v, k.h, k.n, true, false, false);
      std::vector<double> ref_db(static_cast<size_t>(k.v), 0.0);
      for (int64_t i = 0; i < k.n; ++i)
        for (int64_t j = 0; j < k.v; ++j) ref_db[j] += gv[i * k.v + j];
      const Tensor rg = ops::cross_entropy_backward(Tensor::full({}, 1.0, dt, dev), rf.log_probs, f.targets, opt);
      const Tensor rdx = ops::matmul(rg, f.weight), rdw = ops::matmul(rg, f.hidden, true, false);
      // The gradients are sums whose terms may cancel (a bias gradient sums softmax gradients, whose
      // rows sum to 0): errors are measured against the sums of the terms' magnitudes (mag_error),
      // not against the results, which cancellation can make arbitrarily small (measured: a 3-class
      // f32 dbias at 2.2x an eager error that happened to be small, below the dtype floor otherwise).
      auto abs_of = [](std::vector<double> a) {
        for (double& x : a) x = std::fabs(x);
        return a;
      };
      const auto agv = abs_of(gv), awv = abs_of(wv), axv = abs_of(xv);
      const auto mag_dx = oracle::matmul(agv, awv, 1, k.n, k.h, k.v, false, false, false);
      const auto mag_dw = oracle::matmul(agv, axv, 1, k.v, k.h, k.n, true, false, false);
      std::vector<double> mag_db(static_cast<size_t>(k.v), 0.0);
      for (int64_t i = 0; i < k.n; ++i)
        for (int64_t j = 0; j < k.v; ++j) mag_db[j] += agv[i * k.v + j];
      auto check = [&](const char* what, const Tensor& ours, const Tensor& eager, const std::vector<double>& ref,
                       const std::vector<double>& mag) {
        const double e = test::mag_error(ours, ref, mag), e_ref = test::mag_error(eager, ref, mag);
        EXPECT_LE(e, test::kernel_bound(e_ref, dt)) << cfg << " " << what << " (reference error " << e_ref << ")";
      };
      check("dhidden", f.dhidden, rdx, ref_dx, mag_dx);
      check("dweight", f.dweight, rdw, ref_dw, mag_dw);
      if (k.bias) check("dbias", f.dbias, ops::matmul(Tensor::full({1, k.n}, 1.0, dt, dev), rg).view({k.v}), ref_db, mag_db);
      // lse of each row (0 where ignored).
      const auto lse = f.lse.to_f64_vector();
      for (int64_t i = 0; i < k.n; ++i) {
        if (t[i] == -100) {
          EXPECT_EQ(lse[i], 0.0) << cfg << " row " << i;
          continue;
        }
        double m = -std::numeric_limits<double>::infinity(), s = 0;
        for (int64_t j = 0; j < k.v; ++j) m = std::max(m, lv[i * k.v + j]);
        for (int64_t j = 0; j < k.v; ++j) s += std::exp(lv[i * k.v + j] - m);
        EXPECT_NEAR(lse[i], m + std::log(s), 4 * test::unit_roundoff(dt) * (std::abs(m) + 8)) << cfg << " row " << i;
      }
    }
}

// grad_scale, accumulate and the backward's scaling: the gradients of two calls accumulated with
// grad_scale 1/2 equal the mean of the two; the backward multiplies all three by dloss.
TEST_P(LigerFusedLinearCE, AccumulationAndBackwardScale) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const int64_t n = 19, h = 24, v = 77;
  for (bool accum_f32 : {false, true}) {
    Flce a{dev}, b{dev}, both{dev};
    const Tensor w = Tensor::randn({v, h}, DType::f32, dev, gen, 0, 0.4), bias = Tensor::randn({v}, DType::f32, dev, gen);
    for (Flce* f : {&a, &b}) {
      f->hidden = Tensor::randn({n, h}, DType::f32, dev, gen);
      f->weight = w, f->bias = bias;
      f->targets = Tensor::randint({n}, 0, v, DType::i64, dev, gen);
      f->p.chunk_rows = 6;
      f->setup(Reduction::Mean, true);
      ASSERT_EQ(f->run(), nullptr);
    }
    // Both batches into one gradient: first call overwrites, second accumulates, each scaled by 1/2.
    both.weight = w, both.bias = bias;
    both.p.chunk_rows = 6;
    both.p.grad_scale = 0.5f;
    both.p.accum_f32 = accum_f32;
    both.hidden = a.hidden, both.targets = a.targets;
    both.setup(Reduction::Mean, true);
    ASSERT_EQ(both.run(), nullptr);
    both.hidden = b.hidden, both.targets = b.targets;
    both.p.accumulate = true;
    both.setup(Reduction::Mean, true);
    ASSERT_EQ(both.run(), nullptr);
    const auto wa = a.dweight.to_f64_vector(), wb = b.dweight.to_f64_vector();
    std::vector<double> mean_dw(wa.size()), mean_db(static_cast<size_t>(v));
    for (size_t i = 0; i < wa.size(); ++i) mean_dw[i] = 0.5 * (wa[i] + wb[i]);
    const auto ba = a.dbias.to_f64_vector(), bb = b.dbias.to_f64_vector();
    for (int64_t j = 0; j < v; ++j) mean_db[j] = 0.5 * (ba[j] + bb[j]);
    EXPECT_TRUE(test::close_l2(both.dweight, mean_dw, 1e-6)) << "accum_f32 " << accum_f32;
    EXPECT_TRUE(test::close_l2(both.dbias, mean_db, 1e-6)) << "accum_f32 " << accum_f32;
  }
  // Backward: everything times dloss (a host number, then a device value).
  Flce f{dev};
  f.hidden = Tensor::randn({n, h}, DType::bf16, dev, gen);
  f.weight = Tensor::randn({v, h}, DType::bf16, dev, gen, 0, 0.4);
  f.bias = Tensor::randn({v}, DType::bf16, dev, gen);
  f.targets = Tensor::randint({n}, 0, v, DType::i32, dev, gen);
  f.setup(Reduction::Sum, true);
  ASSERT_EQ(f.run(), nullptr);
  const auto dx0 = f.dhidden.to_f64_vector(), dw0 = f.dweight.to_f64_vector(), db0 = f.dbias.to_f64_vector();
  liger::FusedLinearCEScaleParams s;
  s.dtype = kernel::DType::bf16;
  s.n = n, s.h = h, s.v = v;
  s.dhidden = f.dhidden.data(), s.dhidden_stride = h;
  s.dweight = f.dweight.data(), s.dbias = f.dbias.data();
  s.scale = 0.25f;  // a power of two: exact in bf16
  ASSERT_EQ(KCPP_CALL_KERNEL(dev, liger::fused_linear_ce_scale, s), nullptr);
  const Tensor dloss = Tensor::full({1}, 4.0, DType::f32, dev);
  s.dloss = static_cast<const float*>(dloss.data());
  ASSERT_EQ(KCPP_CALL_KERNEL(dev, liger::fused_linear_ce_scale, s), nullptr);  // x 0.25 x 4 = x 1
  EXPECT_EQ(f.dhidden.to_f64_vector(), dx0);
  EXPECT_EQ(f.dweight.to_f64_vector(), dw0);
  EXPECT_EQ(f.dbias.to_f64_vector(), db0);
}

TEST_P(LigerFusedLinearCE, EdgeCasesAndBadInput) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const int64_t h = 8, v = 10;
  auto make = [&](std::vector<int64_t> t) {
    Flce f{dev};
    const int64_t n = static_cast<int64_t>(t.size());
    f.hidden = n ? Tensor::randn({n, h}, DType::bf16, dev, gen) : Tensor::empty({0, h}, DType::bf16, dev);
    f.weight = Tensor::randn({v, h}, DType::bf16, dev, gen);
    f.bias = Tensor::randn({v}, DType::bf16, dev, gen);
    f.targets = n ? Tensor::from_i64(t, {n}, DType::i64, dev) : Tensor::empty({0}, DType::i64, dev);
    return f;
  };
  // Every target ignored: the mean is NaN (as PyTorch), every gradient zero.
  {
    Flce f = make({-100, -100, -100});
    f.setup(Reduction::Mean, true);
    ASSERT_EQ(f.run(), nullptr);
    EXPECT_TRUE(std::isnan(f.loss.item()));
    for (const Tensor* g : {&f.dhidden, &f.dweight, &f.dbias})
      for (double x : g->to_f64_vector()) EXPECT_EQ(x, 0.0);
  }
  // No rows: NaN mean / 0 sum, and zero weight and bias gradients (overwritten, not left stale).
  for (Reduction red : {Reduction::Mean, Reduction::Sum}) {
    Flce f = make({});
    f.setup(red, true);
    { const char* e = f.run(); ASSERT_EQ(e, nullptr) << e; }
    if (red == Reduction::Mean) EXPECT_TRUE(std::isnan(f.loss.item()));
    else EXPECT_EQ(f.loss.item(), 0.0);
    for (const Tensor* g : {&f.dweight, &f.dbias})
      for (double x : g->to_f64_vector()) EXPECT_EQ(x, 0.0);
  }
  // A target out of range: an error naming the row (CPU); NaN loss and a count (CUDA).
  {
    Flce f = make({3, 10});
    f.setup(Reduction::Mean, true);
    if (dev.is_cpu()) {
      EXPECT_TRUE(test::kernel_error_contains(f.run(), "'targets'[1] = 10 is out of range [0, 10)"));
    } else {
      const Tensor counter = Tensor::zeros({1}, DType::i32, dev);
      f.p.bad_targets = static_cast<int32_t*>(counter.data());
      ASSERT_EQ(f.run(), nullptr);
      EXPECT_TRUE(std::isnan(f.loss.item()));
      EXPECT_EQ(counter.item(), 1.0);
    }
  }
  Flce f = make({1, 2});
  f.setup(Reduction::Mean, true);
  const auto good = f.p;
  auto expect_error = [&](const char* needle) {
    EXPECT_TRUE(test::kernel_error_contains(f.run(), needle)) << needle;
    f.p = good;
  };
  f.p.reduction = liger::CEReduction::None;
  expect_error("reduction 'none' gives no gradients");
  f.p.dhidden = nullptr;
  expect_error("'dweight' and 'dbias' need 'dhidden'");
  f.p.bias = nullptr;
  expect_error("'dbias' without 'bias'");
  f.p.hidden_stride = 3;
  expect_error("hidden row stride 3 < h 8");
  f.p.label_smoothing = -0.5f;
  expect_error("label_smoothing -0.5 outside [0, 1]");
  f.p.h = 0;
  expect_error("need n >= 0, h > 0 and v > 0");
  f.p.weight = nullptr;
  expect_error("must not be null");
  f.p.chunk_rows = -1;
  expect_error("chunk_rows -1 < 0");
}

INSTANTIATE_TEST_SUITE_P(Devices, LigerFusedLinearCE, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cpu() ? std::string("cpu") : std::string("cuda"); });

}  // namespace
}  // namespace kcpp
