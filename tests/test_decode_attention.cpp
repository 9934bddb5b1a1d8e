// ops::decode_attention and ops::cache_write (ops/nn/decode_attention.h) against the f64 oracle:
// ragged rows read through a row index, lengths from 1 to a few hundred keys, grouped-query heads
// (g = 1 .. 8, not powers of two), head dims 8 .. 256 not all powers of two, sliding windows, a
// capacity bound below the storage's, short rows (one block of 8 or 16 warps a head group) and long
// ones (split over blocks), and cache positions past every length filled with NaN so that reading
// one shows.
#include <cmath>

#include "oracle.h"
#include "ops/nn/decode_attention.h"
#include "test_util.h"

namespace kcpp {
namespace {

using test::config_name;
using test::test_generator;

class DecodeAttention : public ::testing::TestWithParam<Device> {};

Tensor i32(const std::vector<int64_t>& v, Device dev) {
  return Tensor::from_i64(v, {static_cast<int64_t>(v.size())}, DType::i32, dev);
}
Tensor ones(Shape shape, Device dev) { return Tensor::full(std::move(shape), 1.0, DType::f32, dev); }

struct Case {
  int64_t hq, hkv, d;
  std::vector<int64_t> lengths;
  int64_t window, spare;  // spare: capacity beyond the longest row (max_length is the longest + 1)
  bool bound_by_capacity = false;  // max_length 0 (the capacity), as a captured decode step passes
};

TEST_P(DecodeAttention, MatchesTheOracleOnRaggedRows) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  const Case cases[] = {{4, 4, 64, {1, 7, 300}, 0, 3},   {6, 2, 96, {33, 129}, 5, 0},     {8, 1, 128, {257}, 0, 40},
                        {16, 2, 256, {2, 64}, 0, 1},     {12, 2, 40, {1, 2, 3, 100}, 64, 7}, {2, 1, 8, {5}, 0, 0},
                        {14, 2, 64, {1000, 1}, 0, 24},
                        // g = 16, 12, 9: several query-head blocks per kv head (8, 6 and 3 heads a block)
                        {16, 1, 64, {33, 70}, 0, 5},      {12, 1, 32, {50}, 0, 0},          {9, 1, 16, {20, 3}, 0, 2},
                        // short rows in one block: 16 warps (g = 3, above too), 8 warps (g = 8, d = 128)
                        {8, 1, 128, {100, 7}, 0, 3},      {16, 2, 64, {120, 1}, 0, 0},
                        // sized for a capacity far beyond the lengths: most splits have no keys
                        {8, 2, 128, {5, 40, 1}, 0, 600, true}, {4, 2, 64, {130}, 16, 900, true}};
  for (DType dt : test::float_dtypes(dev))
    for (const Case& c : cases) {
      const int64_t b = static_cast<int64_t>(c.lengths.size()), r = b + 1, d = c.d;
      const int64_t longest = *std::max_element(c.lengths.begin(), c.lengths.end());
      const int64_t cap = longest + 1 + c.spare, max_length = longest + 1;
      // Query i reads cache row r - 1 - i (row 0 and the tails past each length hold NaN).
      std::vector<int64_t> rows(b), lengths(b);
      std::vector<double> kc(static_cast<size_t>(r * c.hkv * cap * d), NAN), vc = kc, noise(kc.size());
      gen.fill_uniform(noise, -2, 2);
      for (int64_t i = 0; i < b; ++i) {
        rows[i] = r - 1 - i, lengths[i] = c.lengths[i];
        for (int64_t h = 0; h < c.hkv; ++h)
          for (int64_t j = 0; j < c.lengths[i]; ++j)
            for (int64_t e = 0; e < d; ++e) {
              const size_t at = static_cast<size_t>(((rows[i] * c.hkv + h) * cap + j) * d + e);
              kc[at] = noise[at], vc[at] = noise[(at * 7 + 3) % noise.size()];
            }
      }
      std::vector<double> qv(static_cast<size_t>(b * c.hq * d));
      gen.fill_uniform(qv, -2, 2);
      const Tensor q = Tensor::from_f64(qv, {b, c.hq, d}, dt, dev);
      const Tensor k_cache = Tensor::from_f64(kc, {r, c.hkv, cap, d}, dt, dev);
      const Tensor v_cache = Tensor::from_f64(vc, {r, c.hkv, cap, d}, dt, dev);
      const double scale = 1.0 / std::sqrt(static_cast<double>(d));
      const Tensor out = ops::decode_attention(q, k_cache, v_cache, i32(rows, dev),
                                               i32(lengths, dev), scale, c.window, c.bound_by_capacity ? 0 : max_length);
      // The oracle: each query as the last of a causal sequence of its row's keys (values as stored).
      const std::vector<double> qs = q.to_f64_vector(), ks = k_cache.to_f64_vector(), vs = v_cache.to_f64_vector();
      std::vector<double> ref;
      for (int64_t i = 0; i < b; ++i) {
        const int64_t len = c.lengths[i];
        std::vector<double> qi(qs.begin() + i * c.hq * d, qs.begin() + (i + 1) * c.hq * d), ki, vi;
        for (int64_t h = 0; h < c.hkv; ++h) {
          const auto from = static_cast<size_t>((rows[i] * c.hkv + h) * cap * d);
          ki.insert(ki.end(), ks.begin() + from, ks.begin() + from + len * d);
          vi.insert(vi.end(), vs.begin() + from, vs.begin() + from + len * d);
        }
        const auto o = oracle::attention(qi, ki, vi, nullptr, 1, c.hq, c.hkv, 1, len, d, scale, true, c.window);
        ref.insert(ref.end(), o.out.begin(), o.out.end());
      }
      // Computed in f32 and rounded once: a unit of the dtype plus f32 roundoff over the sums.
      const double tol = test::unit_roundoff(dt) + 64 * test::unit_roundoff(DType::f32);
      const std::string cfg = fmt::format("{} hq={} hkv={} d={} lengths={} window={} capacity={}", config_name(dev, dt), c.hq,
                                          c.hkv, d, fmt::join(c.lengths, ","), c.window, cap);
      EXPECT_TRUE(test::close_l2(out, ref, tol)) << cfg;
    }
}

TEST_P(DecodeAttention, CacheWriteThenReadIsTheSequence) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  const int64_t r = 3, hkv = 2, cap = 9, d = 24;
  const Tensor k_cache = Tensor::zeros({r, hkv, cap, d}, DType::f32, dev), v_cache = Tensor::zeros({r, hkv, cap, d}, DType::f32, dev);
  // Rows 2 and 0 get a token at positions 4 and 0; row 1 stays zero.
  const Tensor k = Tensor::randn({2, hkv, d}, DType::f32, dev, gen), v = Tensor::randn({2, hkv, d}, DType::f32, dev, gen);
  ops::cache_write(k_cache, v_cache, k, v, i32({2, 0}, dev), i32({4, 0}, dev));
  const auto kc = k_cache.to_f64_vector(), vc = v_cache.to_f64_vector(), ks = k.to_f64_vector(), vs = v.to_f64_vector();
  for (int64_t row = 0; row < r; ++row)
    for (int64_t h = 0; h < hkv; ++h)
      for (int64_t p = 0; p < cap; ++p)
        for (int64_t e = 0; e < d; ++e) {
          const size_t at = static_cast<size_t>(((row * hkv + h) * cap + p) * d + e);
          const int64_t src = row == 2 && p == 4 ? 0 : row == 0 && p == 0 ? 1 : -1;
          const double wk = src < 0 ? 0.0 : ks[static_cast<size_t>((src * hkv + h) * d + e)];
          const double wv = src < 0 ? 0.0 : vs[static_cast<size_t>((src * hkv + h) * d + e)];
          ASSERT_EQ(kc[at], wk) << "k row " << row << " head " << h << " position " << p << " element " << e;
          ASSERT_EQ(vc[at], wv) << "v row " << row << " head " << h << " position " << p << " element " << e;
        }
}

TEST_P(DecodeAttention, BadInputIsRefusedOrMarked) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const Tensor q = ones({2, 4, 16}, dev);
  const Tensor kc = ones({3, 2, 8, 16}, dev), vc = ones({3, 2, 8, 16}, dev);
  const Tensor rows = i32({0, 1}, dev), lengths = i32({3, 8}, dev);
  EXPECT_ERROR(ops::decode_attention(q, kc, vc, rows, lengths.to(DType::i64), 0.25), "'lengths' must be i32");
  EXPECT_ERROR(ops::decode_attention(ones({2, 3, 16}, dev), kc, vc, rows, lengths, 0.25), "not a multiple");
  EXPECT_ERROR(ops::decode_attention(q, kc, vc, rows, lengths, 0.25, 0, 9), "max_length 9");
  EXPECT_ERROR(ops::decode_attention(q, kc, vc, rows, lengths, -1.0), "scale");
  EXPECT_ERROR(ops::cache_write(kc, vc, ones({2, 3, 16}, dev), ones({2, 3, 16}, dev),
                                    rows, lengths), "does not fit the cache");
  const Tensor bad_rows = i32({0, 3}, dev), bad_lengths = i32({0, 8}, dev);
  if (dev.is_cpu()) {
    EXPECT_ERROR(ops::decode_attention(q, kc, vc, bad_rows, lengths, 0.25), "rows[1] = 3 is outside [0, 2]");
    EXPECT_ERROR(ops::decode_attention(q, kc, vc, rows, bad_lengths, 0.25), "lengths[0] = 0 is outside [1, 8]");
    EXPECT_ERROR(ops::decode_attention(q, kc, vc, rows, lengths, 0.25, 0, 7), "lengths[1] = 8 is outside [1, 7]");
    EXPECT_ERROR(ops::cache_write(kc, vc, q.narrow(1, 0, 2), q.narrow(1, 0, 2), rows, i32({8, 0}, dev)), "positions[0] = 8 is outside [0, 7]");
  } else {  // the device does not read indices back: the bad query's output is NaN, the other is exact
    // ... also where the keys are split over blocks and merged (a longer cache).
    const Tensor long_k = ones({3, 2, 300, 16}, dev), long_v = ones({3, 2, 300, 16}, dev);
    for (const auto& [rw, ln] : {std::pair{i32({0, 3}, dev), i32({3, 250}, dev)}, std::pair{i32({0, 1}, dev), i32({301, 250}, dev)}}) {
      const auto o = ops::decode_attention(q, long_k, long_v, rw, ln, 0.25).to_f64_vector();
      for (int64_t e = 0; e < 64; ++e) {
        const bool first_bad = ln.to_i64_vector()[0] == 301;
        EXPECT_EQ(std::isnan(o[static_cast<size_t>(e)]), first_bad) << "row 0, split cache";
        EXPECT_EQ(std::isnan(o[static_cast<size_t>(64 + e)]), !first_bad) << "row 1, split cache";
      }
    }
    for (const auto& [rw, ln] : {std::pair{bad_rows, lengths}, std::pair{rows, bad_lengths}}) {
      const auto o = ops::decode_attention(q, kc, vc, rw, ln, 0.25).to_f64_vector();
      const bool first_bad = rw.to_i64_vector()[0] == 3 || ln.to_i64_vector()[0] == 0;
      for (int64_t i = 0; i < 2; ++i)
        for (int64_t e = 0; e < 4 * 16; ++e) {
          const double x = o[static_cast<size_t>(i * 64 + e)];
          if ((i == 0) == first_bad) EXPECT_TRUE(std::isnan(x)) << "row " << i;
          else EXPECT_EQ(x, 1.0) << "row " << i;
        }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, DecodeAttention, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cuda() ? std::string("cuda") : std::string("cpu"); });

}  // namespace
}  // namespace kcpp
