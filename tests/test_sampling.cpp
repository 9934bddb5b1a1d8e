// ops::sample_checked (ops/nn/sampling.h): the drawn frequencies against the filtered softmax computed
// in f64 (temperature, top-k, top-p, ties at the k-th logit broken by id), tokens outside the kept
// set never drawn, the Gumbel-max path with neither filter, the GPU's picks equal to the host's on a
// real vocabulary, and bad input refused or reported.
#include <cmath>
#include <numeric>

#include "core/pending_copy.h"
#include "ops/nn/sampling.h"
#include "ops/ops.h"
#include "test_util.h"

namespace kcpp {
namespace {

using test::config_name;
using test::test_generator;

class Sampling : public ::testing::TestWithParam<Device> {};

// The kept tokens' probabilities, in f64, as sampling.h defines them.
std::vector<double> filtered_softmax(const std::vector<double>& x, double t, int64_t top_k, double top_p) {
  const int64_t v = static_cast<int64_t>(x.size());
  std::vector<int64_t> order(static_cast<size_t>(v));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return x[a] > x[b]; });
  const int64_t k = top_k > 0 ? std::min(top_k, v) : v;
  std::vector<double> p(static_cast<size_t>(v), 0.0);
  double z = 0;
  for (int64_t i = 0; i < k; ++i) z += std::exp((x[order[i]] - x[order[0]]) / t);
  double cum = 0;
  for (int64_t i = 0; i < k; ++i) {
    p[order[i]] = std::exp((x[order[i]] - x[order[0]]) / t);
    cum += p[order[i]];
    if (top_p < 1.0 && cum >= top_p * z) break;
  }
  const double total = std::accumulate(p.begin(), p.end(), 0.0);
  for (double& e : p) e /= total;
  return p;
}

TEST_P(Sampling, FrequenciesMatchTheFilteredSoftmax) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  // Ties at the top-k boundary (ids 2, 3 and 5 share a logit), a clear leader, a negative tail.
  const std::vector<double> x = {0.3, 1.7, 0.9, 0.9, -2.0, 0.9, 0.1, -0.5, 1.2};
  const int64_t v = static_cast<int64_t>(x.size()), draws = 4000, rows = 8;
  struct Case {
    double t;
    int64_t top_k;
    double top_p;
  };
  for (const Case& c : {Case{1.0, 0, 1.0}, Case{0.7, 3, 1.0}, Case{1.3, 0, 0.8}, Case{1.0, 4, 0.9}, Case{2.0, 1, 1.0}, Case{0.5, 9, 0.5}}) {
    const std::string what = fmt::format("{} T={} top_k={} top_p={}", dev.str(), c.t, c.top_k, c.top_p);
    std::vector<double> all;
    for (int64_t r = 0; r < rows; ++r) all.insert(all.end(), x.begin(), x.end());
    const Tensor logits = Tensor::from_f64(all, {rows, v}, DType::f32, dev);
    const std::vector<double> xf = Tensor::from_f64(x, {v}, DType::f32, Device::cpu()).to_f64_vector();
    const std::vector<double> p = filtered_softmax(xf, c.t, c.top_k, c.top_p);
    std::vector<int64_t> count(static_cast<size_t>(v), 0);
    std::vector<uint64_t> seeds(static_cast<size_t>(rows));
    std::vector<int64_t> positions(static_cast<size_t>(rows));
    for (int64_t d = 0; d < draws / rows; ++d) {
      for (int64_t r = 0; r < rows; ++r) seeds[r] = 1000 + r, positions[r] = d;
      const auto picked = ops::sample_checked(logits, {c.t, c.top_k, c.top_p}, seeds, positions).to_i64_vector();
      for (int64_t r = 0; r < rows; ++r) {
        ASSERT_EQ(picked[2 * r + 1], -1) << what;
        ASSERT_GE(picked[2 * r], 0) << what;
        ASSERT_LT(picked[2 * r], v) << what;
        ++count[static_cast<size_t>(picked[2 * r])];
      }
    }
    for (int64_t i = 0; i < v; ++i) {
      const double f = static_cast<double>(count[i]) / draws, sd = std::sqrt(p[i] * (1 - p[i]) / draws);
      if (p[i] == 0.0) EXPECT_EQ(count[i], 0) << what << ": token " << i << " is outside the kept set";
      else EXPECT_NEAR(f, p[i], 5 * sd + 1e-9) << what << ": token " << i;  // fixed seeds: a deterministic check
    }
  }
}

TEST_P(Sampling, RowsAreKeyedBySeedAndPosition) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  const Tensor logits = Tensor::randn({3, 1000}, DType::f32, dev, gen);
  const ops::SampleOptions o{1.0, 50, 0.95};
  const auto a = ops::sample_checked(logits, o, {7, 8, 9}, {4, 4, 4}).to_i64_vector();
  // Row 1 alone, with its seed and position, draws what it drew in the batch.
  const auto alone = ops::sample_checked(logits.narrow(0, 1, 1), o, {8}, {4}).to_i64_vector();
  EXPECT_EQ(alone[0], a[2]);
  // A top_k of 1 is the argmax.
  const auto top1 = ops::sample_checked(logits, {0.3, 1, 1.0}, {1, 2, 3}, {0, 0, 0}).to_i64_vector();
  const auto am = ops::argmax_checked(logits).to_i64_vector();
  for (int r = 0; r < 3; ++r) EXPECT_EQ(top1[2 * r], am[2 * r]) << "row " << r;
}

// The GPU's picks equal the host's (one candidate set, one order, the draw in f64 on both).
TEST(SamplingOnTheGpu, PicksEqualTheHosts) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "skipped: no CUDA device";
  Generator gen = test_generator();
  for (DType dt : {DType::f32, DType::bf16})
    for (const ops::SampleOptions& o : {ops::SampleOptions{1.0, 0, 1.0}, ops::SampleOptions{0.8, 50, 0.9}, ops::SampleOptions{1.1, 1024, 1.0},
                                        ops::SampleOptions{0.6, 7, 0.5}, ops::SampleOptions{1.0, 1, 1.0}}) {
      const Tensor logits = Tensor::randn({5, 151936}, dt, Device::cuda(0), gen);
      const std::vector<uint64_t> seeds = {1, 2, 3, 4, 5};
      for (int64_t step = 0; step < 4; ++step) {
        const std::vector<int64_t> pos(5, step);
        EXPECT_EQ(ops::sample_checked(logits, o, seeds, pos).to_i64_vector(),
                  ops::sample_checked(logits.to(Device::cpu()), o, seeds, pos).to_i64_vector())
            << dtype_name(dt) << " T=" << o.temperature << " top_k=" << o.top_k << " top_p=" << o.top_p << " step " << step;
      }
    }
}

TEST_P(Sampling, BadInputIsRefusedOrReported) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  std::vector<double> x(40, 0.5);
  x[33] = NAN;
  const Tensor logits = Tensor::from_f64(x, {2, 20}, DType::f32, dev);
  for (const ops::SampleOptions& o : {ops::SampleOptions{1.0, 0, 1.0}, ops::SampleOptions{1.0, 5, 0.9}}) {
    const auto got = ops::sample_checked(logits, o, {1, 2}, {0, 0}).to_i64_vector();
    EXPECT_EQ(got[1], -1);
    EXPECT_EQ(got[3], 13) << "the first non-finite logit of row 1";
  }
  const Tensor ok = Tensor::zeros({2, 20}, DType::f32, dev);
  EXPECT_ERROR(ops::sample_checked(ok, {0.0, 0, 1.0}, {1, 2}, {0, 0}), "temperature is 0");
  EXPECT_ERROR(ops::sample_checked(ok, {1.0, -1, 1.0}, {1, 2}, {0, 0}), "top_k is -1");
  EXPECT_ERROR(ops::sample_checked(ok, {1.0, 0, 0.0}, {1, 2}, {0, 0}), "top_p is 0");
  EXPECT_ERROR(ops::sample_checked(ok, {1.0, 0, 1.0}, {1}, {0, 0}), "1 seeds and 2 positions for 2 rows");
  EXPECT_ERROR(ops::sample_checked(Tensor::zeros({2, 0}, DType::f32, dev), {1.0, 0, 1.0}, {1, 2}, {0, 0}), "empty vocabulary");
}

// A decode step's inputs made from the picks on their device (ids, positions + 1, lengths + 1), the
// picks read back through a PendingCopy queued behind it; bad operands refused by name.
TEST_P(Sampling, DecodeInputsAdvanceFromThePicks) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const Tensor ids = Tensor::zeros({3, 1}, DType::i64, dev);
  const Tensor positions = Tensor::from_i64(std::vector<int64_t>{1, 20, 300}, {3}, DType::i32, dev);
  const Tensor lengths = Tensor::from_i64(std::vector<int64_t>{2, 21, 301}, {3}, DType::i32, dev);
  PendingCopy copy;
  EXPECT_FALSE(copy.pending());
  for (int64_t step = 1; step <= 2; ++step) {
    const Tensor picks = Tensor::from_i64(std::vector<int64_t>{5 * step, -1, 7 * step, -1, 9 * step, 3}, {3, 2}, DType::i64, dev);
    ops::advance_decode_inputs(picks, ids, positions, lengths);
    copy.start(ids.view({3}));  // queued behind the kernel that writes ids: it reads what the kernel wrote
    EXPECT_TRUE(copy.pending());
    EXPECT_EQ(copy.wait(), (std::vector<int64_t>{5 * step, 7 * step, 9 * step})) << "step " << step;
    EXPECT_EQ(positions.to_i64_vector(), (std::vector<int64_t>{1 + step, 20 + step, 300 + step})) << "step " << step;
    EXPECT_EQ(lengths.to_i64_vector(), (std::vector<int64_t>{2 + step, 21 + step, 301 + step})) << "step " << step;
  }
  const Tensor picks = Tensor::from_i64(std::vector<int64_t>{5, -1, 7, -1, 9, 3}, {3, 2}, DType::i64, dev);
  EXPECT_ERROR(copy.wait(), "no copy started");
  copy.start(picks);
  EXPECT_ERROR(copy.start(picks), "in flight");
  (void)copy.wait();
  EXPECT_ERROR(copy.start(positions), "i64");
  EXPECT_ERROR(ops::advance_decode_inputs(ids, ids, positions, lengths), "picks must be [B, 2] i64");
  EXPECT_ERROR(ops::advance_decode_inputs(picks, positions, positions, lengths), "ids must be [3, 1] i64");
  EXPECT_ERROR(ops::advance_decode_inputs(picks, ids, lengths.to(DType::i64), lengths), "positions must be [3] i32");
  EXPECT_ERROR(ops::advance_decode_inputs(picks, ids, positions, lengths.narrow(0, 0, 2)), "lengths must be [3] i32");
  EXPECT_ERROR(ops::advance_decode_inputs(picks, Tensor::zeros({3, 2}, DType::i64, dev).narrow(1, 0, 1), positions, lengths),
               "contiguous");
}

INSTANTIATE_TEST_SUITE_P(Devices, Sampling, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cuda() ? std::string("cuda") : std::string("cpu"); });

}  // namespace
}  // namespace kcpp
