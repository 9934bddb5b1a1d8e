// Cross-entropy kernel against the f64 oracle, held to docs/DESIGN.md's bound: at most twice the error of
// the eager reference (ops::cross_entropy_*) in the same precision, and within the dtype's table.
#include <cmath>
#include <limits>

#include "cross_entropy.h"
#include "core/cuda_runtime.h"
#include "cross_entropy_tuning.h"
#include "kernel_params.h"
#include "oracle.h"
#include "ops/nn/cross_entropy.h"
#include "test_util.h"

namespace kcpp {
namespace {

using ops::Reduction;

// Holds every tensor the params point at: a params struct carries raw pointers, so its tensors must
// outlive the call (a temporary targets tensor here once read back as the next allocation's bytes).
struct CE {
  Device dev;
  Tensor targets, loss, grad, ws;
  liger::CrossEntropyParams params(const Tensor& logits, const Tensor& t, const ops::CrossEntropyOptions& o,
                                   bool in_place) {
    targets = t;
    loss = Tensor::empty({o.reduction == Reduction::None ? logits.size(0) : 1}, DType::f32, dev);
    grad = in_place ? logits : Tensor::empty(logits.shape(), logits.dtype(), dev);
    auto p = test::cross_entropy_params(logits, targets, o, loss, grad);
#if KCPP_WITH_CUDA
    if (dev.is_cuda()) {
      ws = Tensor::empty({static_cast<int64_t>(liger::cross_entropy_workspace(p))}, DType::u8, dev);
      p.workspace = ws.data();
    }
#endif
    return p;
  }
  const char* run(const liger::CrossEntropyParams& p) const { return KCPP_CALL_KERNEL(dev, liger::cross_entropy, p); }
};

class LigerCrossEntropy : public ::testing::TestWithParam<Device> {};

TEST_P(LigerCrossEntropy, WithinTwiceTheReferenceError) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (int64_t v : {1, 3, 4096, 50257})
      for (Reduction red : {Reduction::Mean, Reduction::Sum, Reduction::None})
        for (double eps : {0.0, 0.1})
          for (bool in_place : {false, true}) {
            const int64_t n = v > 1000 ? 5 : 17;
            const Tensor logits = Tensor::randn({n, v}, dt, dev, gen, 0, 3);
            std::vector<int64_t> t(static_cast<size_t>(n));
            std::uniform_int_distribution<int64_t> pick(0, v - 1);
            for (int64_t i = 0; i < n; ++i) t[i] = i % 4 == 1 ? -100 : pick(gen.engine());
            const Tensor targets = Tensor::from_i64(t, {n}, v == 3 ? DType::i32 : DType::i64, dev);
            const ops::CrossEntropyOptions opt{-100, red, eps};
            const auto lv = logits.to_f64_vector();
            int64_t count = 0;
            const auto rows = oracle::cross_entropy_rows(lv, t, n, v, -100, eps, count);
            double total = 0;
            for (double r : rows) total += r;
            const std::vector<double> ref_loss = red == Reduction::None ? rows : std::vector<double>{red == Reduction::Sum ? total : total / count};
            std::vector<double> g(static_cast<size_t>(n), red == Reduction::Mean ? 1.0 / count : 1.0), mag;
            const auto ref_grad = oracle::cross_entropy_backward(lv, t, g, n, v, -100, eps, &mag);
            const std::string cfg = fmt::format("{} v={} reduction={} eps={} in_place={}", test::config_name(dev, dt), v,
                                                static_cast<int>(red), eps, in_place);
            // The eager reference in the same precision, upstream gradient 1.
            const auto rf = ops::cross_entropy_forward(logits, targets, opt);
            const Tensor ones = red == Reduction::None ? Tensor::full({n}, 1.0, dt, dev) : Tensor::full({}, 1.0, dt, dev);
            const Tensor rg = ops::cross_entropy_backward(ones, rf.log_probs, targets, opt);
            const double el_ref = test::rel_l2_error(rf.loss, ref_loss), eg_ref = test::mag_error(rg, ref_grad, mag);

            CE k{dev};
            const Tensor input = in_place ? logits.clone() : logits;
            ASSERT_EQ(k.run(k.params(input, targets, opt, in_place)), nullptr) << cfg;
            const double el = test::rel_l2_error(k.loss, ref_loss), eg = test::mag_error(k.grad, ref_grad, mag);
            EXPECT_LE(el, test::kernel_bound(el_ref, dt)) << cfg << " loss (reference error " << el_ref << ")";
            EXPECT_LE(eg, test::kernel_bound(eg_ref, dt)) << cfg << " grad (reference error " << eg_ref << ")";
            EXPECT_LE(std::max(el, eg), test::composite_rel_l2(dt)) << cfg;
          }
}

// Softcap, z-loss, class weights and token weights, alone and together (with label smoothing and
// ignored rows), against the oracle.  No eager reference implements them, so the bound is the
// dtype's table (tight for f32: a wrong term is an O(1) error).
TEST_P(LigerCrossEntropy, OptionsMatchTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  struct Opt {
    const char* name;
    double softcap, z;
    bool class_w, token_w;
    double eps;
  };
  const Opt opts[] = {{"softcap", 5.0, 0, false, false, 0.0},     {"z-loss", 0, 0.1, false, false, 0.0},
                      {"class weights", 0, 0, true, false, 0.1},  {"class weights, no smoothing", 0, 0, true, false, 0.0},
                      {"token weights", 0, 0, false, true, 0.0},
                      {"all", 5.0, 0.01, true, true, 0.1}};
  for (DType dt : {DType::f32, DType::bf16})
    for (int64_t v : {3, 4097, 50257})
      for (Reduction red : {Reduction::Mean, Reduction::Sum, Reduction::None})
        for (const Opt& o : opts) {
          const int64_t n = v > 1000 ? 6 : 19;
          const std::string cfg = fmt::format("{} v={} reduction={} {}", test::config_name(dev, dt), v, static_cast<int>(red), o.name);
          const Tensor logits = Tensor::randn({n, v}, dt, dev, gen, 0, 3);
          std::vector<int64_t> t(static_cast<size_t>(n));
          std::uniform_int_distribution<int64_t> pick(0, v - 1);
          for (int64_t i = 0; i < n; ++i) t[i] = i % 4 == 1 ? -100 : pick(gen.engine());
          const Tensor targets = Tensor::from_i64(t, {n}, DType::i64, dev);
          oracle::CEOptions oo;
          oo.smoothing = o.eps, oo.softcap = o.softcap, oo.z_loss = o.z;
          const Tensor cw = Tensor::uniform({v}, DType::f32, dev, gen, 0.2, 2.0), tw = Tensor::uniform({n}, DType::f32, dev, gen, 0, 3);
          if (o.class_w) oo.class_weight = cw.to_f64_vector();
          if (o.token_w) oo.token_weight = tw.to_f64_vector();
          const auto lv = logits.to_f64_vector();
          double divisor = 0;
          const auto rows = oracle::cross_entropy_rows(lv, t, n, v, oo, divisor);
          double total = 0;
          for (double r : rows) total += r;
          const std::vector<double> ref_loss =
              red == Reduction::None ? rows : std::vector<double>{red == Reduction::Sum ? total : total / divisor};
          std::vector<double> g(static_cast<size_t>(n), red == Reduction::Mean ? 1.0 / divisor : 1.0), mag;
          const auto ref_grad = oracle::cross_entropy_backward(lv, t, g, n, v, oo, &mag);
          CE k{dev};
          auto p = k.params(logits, targets, {-100, red, o.eps}, false);
          p.softcap = static_cast<float>(o.softcap);
          p.lse_square_scale = static_cast<float>(o.z);
          if (o.class_w) p.class_weight = static_cast<const float*>(cw.data());
          if (o.token_w) p.token_weight = static_cast<const float*>(tw.data());
          ASSERT_EQ(k.run(p), nullptr) << cfg;
          EXPECT_LE(test::rel_l2_error(k.loss, ref_loss), test::composite_rel_l2(dt)) << cfg << " loss";
          EXPECT_TRUE(test::close_l2_mag(k.grad, ref_grad, mag, test::composite_rel_l2(dt))) << cfg << " grad";
        }
}

// Vocabularies past 256k (Gemma 3: 262144): rows far longer than a block's pass, odd length.
TEST_P(LigerCrossEntropy, VocabularyPast256k) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const int64_t n = 3, v = 262147;
  for (DType dt : {DType::f32, DType::bf16}) {
    const Tensor logits = Tensor::randn({n, v}, dt, dev, gen, 0, 3);
    const std::vector<int64_t> t = {0, v - 1, 131072};
    const Tensor targets = Tensor::from_i64(t, {n}, DType::i64, dev);
    const auto lv = logits.to_f64_vector();
    int64_t count = 0;
    const auto rows = oracle::cross_entropy_rows(lv, t, n, v, -100, 0.1, count);
    std::vector<double> g(static_cast<size_t>(n), 1.0 / count), mag;
    const auto ref_grad = oracle::cross_entropy_backward(lv, t, g, n, v, -100, 0.1, &mag);
    CE k{dev};
    ASSERT_EQ(k.run(k.params(logits, targets, {-100, Reduction::Mean, 0.1}, true)), nullptr);
    EXPECT_LE(test::rel_l2_error(k.loss, {(rows[0] + rows[1] + rows[2]) / 3}), test::composite_rel_l2(dt)) << dtype_name(dt);
    EXPECT_TRUE(test::close_l2_mag(k.grad, ref_grad, mag, test::composite_rel_l2(dt))) << dtype_name(dt);
  }
}

// The loss alone (no gradient: evaluation) is the loss the gradient's call reports, bitwise (the same
// kernel computes it, with or without the gradient), and leaves the logits as they were; with the
// per-element options, ignored rows, every reduction, and the lse.
TEST_P(LigerCrossEntropy, LossAloneIsTheLossWithTheGradient) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  for (DType dt : {DType::f32, DType::bf16})
    for (int64_t v : {3, 4096, 50257, 128256})
      for (Reduction red : {Reduction::Mean, Reduction::None})
        for (bool ext : {false, true}) {
          const int64_t n = v > 10000 ? 6 : 19;
          const std::string cfg = fmt::format("{} v={} {} ext={}", test::config_name(dev, dt), v,
                                              red == Reduction::Mean ? "mean" : "none", ext);
          const Tensor logits = Tensor::randn({n, v}, dt, dev, gen, 0, 3);
          std::vector<int64_t> t(static_cast<size_t>(n));
          std::uniform_int_distribution<int64_t> pick(0, v - 1);
          for (int64_t i = 0; i < n; ++i) t[i] = i % 4 == 2 ? -100 : pick(gen.engine());
          const Tensor targets = Tensor::from_i64(t, {n}, DType::i64, dev);
          const Tensor cw = Tensor::uniform({v}, DType::f32, dev, gen, 0.2, 2.0);
          const auto before = logits.to_f64_vector();
          Tensor lse[2];
          std::vector<double> loss[2];
          for (int with_grad = 0; with_grad < 2; ++with_grad) {
            CE k{dev};
            liger::CrossEntropyParams p = k.params(logits, targets, {-100, red, 0.1}, false);
            if (!with_grad) p.grad = nullptr, p.grad_stride = 0;
            if (ext) p.softcap = 30.0f, p.lse_square_scale = 1e-3f, p.class_weight = static_cast<const float*>(cw.data());
            lse[with_grad] = Tensor::empty({n}, DType::f32, dev);
            p.lse = static_cast<float*>(lse[with_grad].data());
            ASSERT_EQ(k.run(p), nullptr) << cfg;
            loss[with_grad] = k.loss.to_f64_vector();
          }
          EXPECT_EQ(loss[0], loss[1]) << cfg;
          EXPECT_EQ(lse[0].to_f64_vector(), lse[1].to_f64_vector()) << cfg;
          for (double x : loss[0]) EXPECT_TRUE(std::isfinite(x)) << cfg;
          EXPECT_EQ(logits.to_f64_vector(), before) << cfg << ": the logits changed";
        }
}

TEST_P(LigerCrossEntropy, EdgeCasesAndBadInput) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  CE k{dev};
  // Every target ignored: mean is NaN (as PyTorch), the gradient all zeros.
  const std::vector<int64_t> ignored = {-100, -100};
  const Tensor logits = Tensor::full({2, 8}, 0.5, DType::bf16, dev);
  ASSERT_EQ(k.run(k.params(logits, Tensor::from_i64(ignored, {2}, DType::i64, dev), {}, false)), nullptr);
  EXPECT_TRUE(std::isnan(k.loss.item()));
  for (double x : k.grad.to_f64_vector()) EXPECT_EQ(x, 0.0);
  // A target out of range: an error on the CPU; on CUDA (no synchronization to raise it) the loss is
  // NaN and the row is counted in bad_targets.
  const std::vector<int64_t> bad = {3, 8};
  auto p = k.params(logits, Tensor::from_i64(bad, {2}, DType::i64, dev), {}, false);
  if (dev.is_cpu()) {
    EXPECT_TRUE(test::kernel_error_contains(k.run(p), "'targets'[1] = 8 is out of range [0, 8)"));
  } else {
    const Tensor counter = Tensor::zeros({1}, DType::i32, dev);
    p.bad_targets = static_cast<int32_t*>(counter.data());
    ASSERT_EQ(k.run(p), nullptr);
    EXPECT_TRUE(std::isnan(k.loss.item()));
    EXPECT_EQ(counter.item(), 1.0);
  }
  // An empty batch: the mean of no rows is NaN (as PyTorch), the sum 0.
  for (const ops::Reduction red : {ops::Reduction::Mean, ops::Reduction::Sum}) {
    const Tensor none = Tensor::empty({0, 8}, DType::bf16, dev);
    ASSERT_EQ(k.run(k.params(none, Tensor::empty({0}, DType::i64, dev), {-100, red, 0.0}, false)), nullptr);
    if (red == ops::Reduction::Mean) EXPECT_TRUE(std::isnan(k.loss.item()));
    else EXPECT_EQ(k.loss.item(), 0.0);
  }
  // A NaN logit makes its row's loss and gradient NaN (as PyTorch), and only that row's.
  std::vector<double> lv(2 * 40, 0.25);
  lv[40 + 17] = std::numeric_limits<double>::quiet_NaN();
  const Tensor with_nan = Tensor::from_f64(lv, {2, 40}, DType::bf16, dev);
  const std::vector<int64_t> t2 = {1, 2};
  ASSERT_EQ(k.run(k.params(with_nan, Tensor::from_i64(t2, {2}, DType::i64, dev), {-100, ops::Reduction::None, 0.0}, false)),
            nullptr);
  const auto rl = k.loss.to_f64_vector(), gv = k.grad.to_f64_vector();
  EXPECT_FALSE(std::isnan(rl[0]));
  EXPECT_TRUE(std::isnan(rl[1]));
  for (int j = 0; j < 40; ++j) {
    EXPECT_FALSE(std::isnan(gv[j])) << "row 0, column " << j;
    EXPECT_TRUE(std::isnan(gv[40 + j])) << "row 1, column " << j;
  }
  // Masked logits (-inf) without smoothing: a finite loss (the smoothing term is absent, not 0 x inf)
  // and exactly zero gradient where masked, as PyTorch.
  std::vector<double> mv(2 * 40);
  for (int j = 0; j < 80; ++j) mv[j] = j < 16 ? -std::numeric_limits<double>::infinity() : 0.1 * (j % 7);
  const Tensor masked = Tensor::from_f64(mv, {2, 40}, DType::f32, dev);
  const std::vector<int64_t> tm = {20, 39};
  ASSERT_EQ(k.run(k.params(masked, Tensor::from_i64(tm, {2}, DType::i64, dev), {-100, ops::Reduction::None, 0.0}, false)),
            nullptr);
  int64_t mcount = 0;
  const auto mref = oracle::cross_entropy_rows(masked.to_f64_vector(), tm, 2, 40, -100, 0.0, mcount);
  const auto ml = k.loss.to_f64_vector(), mg = k.grad.to_f64_vector();
  for (int i = 0; i < 2; ++i) EXPECT_NEAR(ml[size_t(i)], mref[size_t(i)], 1e-5 * std::fabs(mref[size_t(i)])) << "masked row " << i;
  for (int j = 0; j < 16; ++j) EXPECT_EQ(mg[size_t(j)], 0.0) << "masked column " << j;
  auto expect_error = [&](const liger::CrossEntropyParams& b, const char* needle) {
    EXPECT_TRUE(test::kernel_error_contains(k.run(b), needle));
  };
  auto good = k.params(logits, Tensor::from_i64(ignored, {2}, DType::i64, dev), {}, false);
  auto b = good;
  b.label_smoothing = 1.5f;
  expect_error(b, "label_smoothing 1.5 outside [0, 1]");
  b = good;
  b.reduction = static_cast<liger::CEReduction>(9);
  expect_error(b, "unknown reduction 9");
  b = good;
  b.softcap = -1.0f;
  expect_error(b, "softcap -1 must be >= 0");
  b = good;
  b.logits_stride = 3;
  expect_error(b, "logits row stride 3 < v 8");
  b = good;
  b.loss = nullptr;
  expect_error(b, "must not be null");
}

#if KCPP_WITH_CUDA
// The CUDA one-pass cluster path (cross_entropy_cuda.cu) at vocabularies that select each cluster
// size, in each configuration of cross_entropy_tuning.h, with one or two clusters so that every
// block runs many rows through its stages (phase parity wrapping, stages re-armed after ignored rows,
// exchange slots reused), the options on and off, in place and not, masked (-inf) logits, against
// the oracle (and, without the options, within twice the eager reference's error).
TEST(LigerCrossEntropyCuda, ClusterPathAgainstTheOracle) {
  const Device dev = Device::cuda(0);
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const liger::CrossEntropyConfig configs[] = {{true, 512, 8, 2, 2}, {true, 512, 4, 2, 1}, {true, 1024, 4, 1, 1}, {true, 512, 4, 4, 3},
                                               {true, 256, 8, 1, 2}};
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (int64_t v : {8, 4096, 65544, 128256, 151936})
      for (int ci = 0; ci < 5; ++ci)
        for (bool ext : {false, true}) {
          // Keep the oracle's time down; the default-like configurations (0: 512 x 8, 4: 256 x 8, the
          // default where the row fits) stay at the large vocabularies.
          if (v >= 65544 && (dt == DType::f16 || ci >= 2) && !((ci == 0 || ci == 4) && !ext)) continue;
          const liger::CrossEntropyConfig& c = configs[ci];
          const int64_t n = v > 100000 ? 9 : v > 10000 ? 17 : 41;
          const Reduction red = ext ? Reduction::Sum : Reduction::Mean;
          const double eps = ci % 2 ? 0.0 : 0.1;
          const bool in_place = ci % 2 == 1;
          std::vector<double> lv = Tensor::randn({n, v}, dt, dev, gen, 0, 3).to_f64_vector();
          // Masked logits (without smoothing: with it the loss is +inf, as in PyTorch): a row's first
          // min(v, 64) columns at -inf (whole 16-byte vectors; for v = 8 the whole row but its
          // target), plus scattered ones.
          const bool masked = eps == 0.0;
          if (masked) {
            for (int64_t j = 0; j < std::min<int64_t>(v, 64); ++j) lv[size_t(2 * v + j)] = -std::numeric_limits<double>::infinity();
            for (int64_t i = 0; i < n; i += 3) lv[size_t(i * v + (i * 7919) % v)] = -std::numeric_limits<double>::infinity();
          }
          std::vector<int64_t> t(static_cast<size_t>(n));
          std::uniform_int_distribution<int64_t> pick(0, v - 1);
          for (int64_t i = 0; i < n; ++i) t[i] = i % 5 == 1 ? -100 : pick(gen.engine());
          t[0] = v - 1;
          t[2] = std::min<int64_t>(v, 64);  // past the masked columns (v = 8: t = 8 would be out of range)
          if (v == 8) t[2] = 7;
          for (int64_t i = 0; i < n; ++i)
            if (t[i] >= 0 && std::isinf(lv[size_t(i * v + t[i])])) lv[size_t(i * v + t[i])] = 0.5;  // a finite target logit
          const Tensor logits = Tensor::from_f64(lv, {n, v}, dt, dev);
          const Tensor targets = Tensor::from_i64(t, {n}, DType::i64, dev);
          const Tensor cw = Tensor::uniform({v}, DType::f32, dev, gen, 0.2, 2.0), tw = Tensor::uniform({n}, DType::f32, dev, gen, 0, 3);
          oracle::CEOptions oo;
          oo.smoothing = eps;
          if (ext) {
            oo.softcap = 20.0, oo.z_loss = 1e-3;
            oo.class_weight = cw.to_f64_vector(), oo.token_weight = tw.to_f64_vector();
          }
          const auto lq = logits.to_f64_vector();
          double divisor = 0;
          const auto rows = oracle::cross_entropy_rows(lq, t, n, v, oo, divisor);
          double total = 0;
          for (double r : rows) total += r;
          const std::vector<double> ref_loss{red == Reduction::Sum ? total : total / divisor};
          std::vector<double> g(static_cast<size_t>(n), red == Reduction::Mean ? 1.0 / divisor : 1.0), mag;
          const auto ref_grad = oracle::cross_entropy_backward(lq, t, g, n, v, oo, &mag);

          CE k{dev};
          const Tensor input = in_place ? logits.clone() : logits;
          const ops::CrossEntropyOptions opt{-100, red, eps};
          auto p = k.params(input, targets, opt, in_place);
          if (ext) {
            p.softcap = 20.0f, p.lse_square_scale = 1e-3f;
            p.class_weight = static_cast<const float*>(cw.data()), p.token_weight = static_cast<const float*>(tw.data());
          }
          const int csize = liger::cross_entropy_cluster_size(p, c);
          const std::string cfg = fmt::format("{} v={} config={} (cluster of {}) ext={}", test::config_name(dev, dt), v, ci, csize, ext);
          // The path applies wherever a row fits 8 blocks' registers (threads x vecs 16-byte vectors a block).
          const int64_t slice_max = int64_t{c.threads} * c.vecs * (16 / static_cast<int64_t>(dtype_size(dt)));
          EXPECT_EQ(csize > 0, (v + 7) / 8 <= slice_max) << cfg;
          ASSERT_EQ(liger::cross_entropy_cuda_with(p, cuda::current_stream(), c), nullptr) << cfg;
          const double el = test::rel_l2_error(k.loss, ref_loss), eg = test::mag_error(k.grad, ref_grad, mag);
          EXPECT_LE(std::max(el, eg), test::composite_rel_l2(dt))
              << cfg << " loss " << k.loss.item() << " (oracle " << ref_loss[0] << ", error " << el << ") grad error " << eg;
          if (!ext) {  // the eager reference in the same precision, upstream gradient 1 (no masked logits there:
                       // its bound needs the same inputs, and it handles -inf as we do)
            const auto rf = ops::cross_entropy_forward(logits, targets, opt);
            const Tensor rg = ops::cross_entropy_backward(Tensor::full({}, 1.0, dt, dev), rf.log_probs, targets, opt);
            EXPECT_LE(el, test::kernel_bound(test::rel_l2_error(rf.loss, ref_loss), dt)) << cfg << " loss";
            EXPECT_LE(eg, test::kernel_bound(test::mag_error(rg, ref_grad, mag), dt)) << cfg << " grad";
          }
          if (masked) {  // masked columns get exactly zero gradient
            const auto gv = k.grad.to_f64_vector();
            for (int64_t j = 0; j < std::min<int64_t>(v, 64); ++j)
              if (j != t[2]) ASSERT_EQ(gv[size_t(2 * v + j)], 0.0) << cfg << " column " << j;
          }
        }
}
#endif

INSTANTIATE_TEST_SUITE_P(Devices, LigerCrossEntropy, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cpu() ? std::string("cpu") : std::string("cuda"); });

}  // namespace
}  // namespace kcpp
