// The fused decode-layer ops (ops/nn/decode_fused.h) against the f64 oracle: q/k head norms (Llama and
// Gemma casting, an offset), RoPE in both pair layouts and over part of the head, the cache append
// at ragged rows and positions (every other cache entry unchanged), head dims that are not powers of
// two; the residual add with the norm on awkward widths; the gated activation of a packed gate/up;
// the fused projections (add + norm + GEMV, gated activation + GEMV) on 1 to 4 rows (the CUDA kernel
// in bf16 / f16: K a multiple of 8 but not of a warp's 256, odd N) and on what they leave to the
// composition (f32, 5 rows, K not a multiple of 8), and chained without synchronizing (dependent
// launches on sm_90); the f32 residual of add_rms_norm_linear; the Mamba step's fused ops
// (ops/nn/mamba_decode.h) on awkward widths, ranks and state counts, with Falcon-Mamba's norms.
// qk_norm_rope_attention against the oracle and against the composition it fuses.  linear_glu (the
// packed gate/up product and its activation, the Hopper GEMM on sm_90) against the oracle;
// linear_qk_norm_rope_cache (the q / k / v product with the norms, RoPE and the cache write in its
// epilogue) against its composition.
#include <cmath>

#include "oracle.h"
#include "ops/nn/decode_attention.h"
#include "ops/nn/decode_fused.h"
#include "ops/nn/decode_persistent.h"
#include "ops/nn/mamba_decode.h"
#include "ops/ops.h"
#include "test_util.h"
#include "tolerances.h"

namespace kcpp {
namespace {

using test::config_name;
using test::test_generator;
using V = std::vector<double>;

class DecodeFused : public ::testing::TestWithParam<Device> {};

Tensor i32(const std::vector<int64_t>& v, Device dev) {
  return Tensor::from_i64(v, {static_cast<int64_t>(v.size())}, DType::i32, dev);
}

// The values a tensor holds, as f64.
V values(const Tensor& t) { return t.to_f64_vector(); }

struct QkCase {
  int64_t b, hq, hkv, d, rd;
  bool norm, gemma, interleaved;
  double offset;
};

TEST_P(DecodeFused, QkNormRopeCacheMatchesTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  const QkCase cases[] = {{1, 16, 8, 128, 128, true, false, false, 0.0}, {3, 4, 4, 64, 64, false, false, false, 0.0},
                          {2, 6, 2, 96, 32, true, false, true, 0.0},     {4, 12, 2, 40, 40, true, true, false, 1.0},
                          {1, 2, 1, 256, 256, true, false, false, 0.0},  {5, 3, 1, 8, 8, false, false, true, 0.0},
                          {2, 9, 3, 200, 136, true, false, false, 1.0},
                          // Prefill-sized (several rows a CUDA block, a partial last block), rotary part of the head.
                          {1027, 3, 1, 128, 64, true, false, false, 0.0},  {1030, 2, 2, 64, 64, true, true, true, 1.0},
                          {70000, 1, 1, 8, 8, true, false, false, 0.0}};  // more rows than a CUDA grid's y
  for (DType dt : test::float_dtypes(dev))
    for (const QkCase& c : cases) {
      if (c.b > 65535 && !dev.is_cuda()) continue;  // a CUDA launch limit; slow on the CPU's reference path
      const std::string cfg = fmt::format("{} b={} hq={} hkv={} d={} rd={} norm={} gemma={} interleaved={}", config_name(dev, dt),
                                          c.b, c.hq, c.hkv, c.d, c.rd, c.norm, c.gemma, c.interleaved);
      const int64_t heads = c.hq + 2 * c.hkv, r = c.b + 2, cap = 11, d = c.d, rd = c.rd;
      const Tensor qkv = Tensor::randn({c.b, heads, d}, dt, dev, gen);
      // Angles of positions up to a few thousand, as rope_cos_sin makes them.
      std::vector<int64_t> positions(static_cast<size_t>(c.b)), rows(static_cast<size_t>(c.b));
      for (int64_t i = 0; i < c.b; ++i) positions[i] = (i * 5 + 3) % cap, rows[i] = r - 1 - i;
      V pos_angles(static_cast<size_t>(c.b * rd));
      V cs(pos_angles.size()), sn(pos_angles.size());
      for (int64_t i = 0; i < c.b; ++i)
        for (int64_t j = 0; j < rd; ++j) {
          const int64_t pair = c.interleaved ? j / 2 : j % (rd / 2);
          const double a = (positions[i] + 1000.0 * i) * std::pow(10000.0, -2.0 * pair / rd);
          cs[i * rd + j] = std::cos(a), sn[i * rd + j] = std::sin(a);
        }
      const Tensor cos = Tensor::from_f64(cs, {c.b, 1, rd}, dt, dev), sin = Tensor::from_f64(sn, {c.b, 1, rd}, dt, dev);
      ops::QkNormRopeCache opt;
      opt.q_heads = c.hq, opt.kv_heads = c.hkv;
      opt.layout = c.interleaved ? ops::RopeLayout::Interleaved : ops::RopeLayout::RotateHalf;
      if (c.norm) {
        opt.q_norm = Tensor::randn({d}, dt, dev, gen), opt.k_norm = Tensor::randn({d}, dt, dev, gen);
        opt.norm.eps = 1e-6, opt.norm.offset = c.offset;
        opt.norm.casting = c.gemma ? ops::RMSNormCasting::Gemma : ops::RMSNormCasting::Llama;
      }
      const double sentinel = 7.0;
      const Tensor kc = Tensor::full({r, c.hkv, cap, d}, sentinel, dt, dev), vc = Tensor::full({r, c.hkv, cap, d}, sentinel, dt, dev);
      const Tensor q = ops::qk_norm_rope_cache(qkv, opt, cos, sin, kc, vc, i32(rows, dev), i32(positions, dev));
      ASSERT_EQ(q.shape(), (Shape{c.b, c.hq, d})) << cfg;
      // The oracle, in f64 from the values the tensors hold.
      const V x = values(qkv), cv = values(cos), sv = values(sin);
      const V qw = c.norm ? values(opt.q_norm) : V{}, kw = c.norm ? values(opt.k_norm) : V{};
      auto head = [&](int64_t i, int64_t h) { return V(x.begin() + (i * heads + h) * d, x.begin() + (i * heads + h + 1) * d); };
      auto prep = [&](const V& in, const V& w, int64_t i) {
        V y = c.norm ? oracle::rms_norm(in, w, 1, d, 1e-6, c.offset).y : in;
        const V cb(cv.begin() + i * rd, cv.begin() + (i + 1) * rd), sb(sv.begin() + i * rd, sv.begin() + (i + 1) * rd);
        return oracle::rope(y, cb, sb, 1, 1, 1, d, rd, 1, false, c.interleaved);
      };
      V q_ref;
      V k_ref(static_cast<size_t>(r * c.hkv * cap * d), sentinel), v_ref = k_ref;
      for (int64_t i = 0; i < c.b; ++i) {
        for (int64_t h = 0; h < c.hq; ++h) {
          const V y = prep(head(i, h), qw, i);
          q_ref.insert(q_ref.end(), y.begin(), y.end());
        }
        for (int64_t h = 0; h < c.hkv; ++h) {
          const V k = prep(head(i, c.hq + h), kw, i), v = head(i, c.hq + c.hkv + h);
          const int64_t at = ((rows[i] * c.hkv + h) * cap + positions[i]) * d;
          std::copy(k.begin(), k.end(), k_ref.begin() + at);
          std::copy(v.begin(), v.end(), v_ref.begin() + at);
        }
      }
      // A norm, then RoPE, each rounding a few intermediates to the dtype.
      const double tol = test::composite_rel_l2(dt);
      EXPECT_TRUE(test::close_l2(q, q_ref, tol)) << cfg << " (q)";
      EXPECT_TRUE(test::close_l2(kc, k_ref, tol)) << cfg << " (k cache)";
      EXPECT_EQ(values(vc), v_ref) << cfg << " (v cache: a copy)";
      const V kv = values(kc);
      for (size_t e = 0; e < kv.size(); ++e)
        if (k_ref[e] == sentinel) {
          ASSERT_EQ(kv[e], sentinel) << cfg << ": cache entry " << e << " was written";
        }
    }
}

// Equal element by element, NaN equal to NaN (a bad row's output).
::testing::AssertionResult same_values(const V& a, const V& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << a.size() << " values against " << b.size();
  for (size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i]))))
      return ::testing::AssertionFailure() << "element " << i << ": " << a[i] << " against " << b[i];
  return ::testing::AssertionSuccess();
}

// On CUDA in bf16 / f16 the pairs kernel (16-byte norm weights and cos / sin; RotateHalf with rd a
// multiple of 16, or Interleaved) and the 16-byte lanes' kernel with the partners from shared memory
// (taken here by norm weights one element into their storage) give the same bits: at prefill's four
// rows a block and at decode's one, Llama and Gemma casting, part of the head rotated.
TEST_P(DecodeFused, QkNormRopeCachePairsAreTheSameBits) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  if (!dev.is_cuda()) GTEST_SKIP() << "one path on the host";
  Generator gen = test_generator();
  for (DType dt : {DType::bf16, DType::f16})
    for (const auto& [n, hq, hkv, d, rd, interleaved, gemma] :
         {std::tuple{1030, 16, 8, 128, 128, false, false}, std::tuple{7, 16, 8, 128, 128, false, false},
          std::tuple{1100, 4, 2, 64, 32, false, true}, std::tuple{1024, 6, 2, 128, 128, true, false},
          std::tuple{5, 8, 1, 256, 64, false, false}}) {
      const std::string cfg = fmt::format("{} n={} hq={} hkv={} d={} rd={} interleaved={} gemma={}", config_name(dev, dt), n, hq,
                                          hkv, d, rd, interleaved, gemma);
      const int64_t heads = hq + 2 * hkv, cap = 16, slots = (n + cap - 1) / cap;
      const Tensor qkv = Tensor::randn({n, heads, d}, dt, dev, gen);
      const Tensor cos = Tensor::randn({n, 1, rd}, dt, dev, gen), sin = Tensor::randn({n, 1, rd}, dt, dev, gen);
      std::vector<int64_t> rows(static_cast<size_t>(n)), positions(rows.size());
      for (int64_t i = 0; i < n; ++i) rows[static_cast<size_t>(i)] = i / cap, positions[static_cast<size_t>(i)] = i % cap;
      ops::QkNormRopeCache opt;
      opt.q_heads = hq, opt.kv_heads = hkv;
      opt.layout = interleaved ? ops::RopeLayout::Interleaved : ops::RopeLayout::RotateHalf;
      opt.norm.eps = 1e-6, opt.norm.offset = gemma ? 1.0 : 0.0;
      opt.norm.casting = gemma ? ops::RMSNormCasting::Gemma : ops::RMSNormCasting::Llama;
      const Tensor qn = Tensor::randn({d + 1}, dt, dev, gen).narrow(0, 1, d), kn = Tensor::randn({d + 1}, dt, dev, gen).narrow(0, 1, d);
      ops::QkNormRopeCache shifted = opt;
      opt.q_norm = qn.clone(), opt.k_norm = kn.clone();  // 16-byte aligned: the pairs kernel
      shifted.q_norm = qn, shifted.k_norm = kn;           // one element in: the shared-memory partners
      const Tensor kc = Tensor::zeros({slots, hkv, cap, d}, dt, dev), vc = kc.clone(), kc2 = kc.clone(), vc2 = kc.clone();
      const Tensor r = i32(rows, dev), p = i32(positions, dev);
      const Tensor q = ops::qk_norm_rope_cache(qkv, opt, cos, sin, kc, vc, r, p);
      const Tensor q2 = ops::qk_norm_rope_cache(qkv, shifted, cos, sin, kc2, vc2, r, p);
      EXPECT_TRUE(same_values(values(q), values(q2))) << cfg << " (q)";
      EXPECT_TRUE(same_values(values(kc), values(kc2))) << cfg << " (k cache)";
      EXPECT_TRUE(same_values(values(vc), values(vc2))) << cfg << " (v cache)";
    }
}

struct QkAttentionCase {
  int64_t hq, hkv, d, rd;
  bool norm, gemma, interleaved;
  std::vector<int64_t> lengths;
  int64_t window, capacity;
  bool bound_by_capacity;  // max_length 0 (the capacity), as a captured decode step passes
  // Row 0's new key at position lengths[0] - 1 - back (0: the last key, as decoding writes it).
  int64_t back = 0;
  bool bad_row = false, bad_position = false;  // row 1's row index / position out of range (CUDA only)
  bool offset_norms = false;  // the norms' weights one element into their storage (no 16-byte loads)
  int expect_fused = -1;      // on CUDA in bf16 / f16: 1 the one kernel runs, 0 the composition (-1: not checked)
};

// qk_norm_rope_attention is qk_norm_rope_cache followed by decode_attention: against the f64 oracle,
// and against that composition (on CUDA in bf16 / f16 the same bits: the fused kernel's prologue
// rounds as qk_norm_rope_cache does; in f32 its sum of squares adds in another order).  The cases
// take every path: short rows in one block of 16 or 8 warps (Qwen3-0.6B's and Llama-3.2-1B's heads,
// g = 8, head dim 256), one split of 4 warps (a bound of 30 keys; 70 rows; more heads than lane
// groups), a group of 12 query heads that a block does not hold (the composition), a window, a new
// key written before the last position, a row index and a position out of range, part of the head
// rotated in both layouts, element-wise loads of cos / sin and of the norms.  Cache positions past
// each length hold NaN.  On CUDA the cases that name their path (the two models' heads: the one
// kernel; the group of 12: the composition) check that it was the one taken.
TEST_P(DecodeFused, QkNormRopeAttentionIsTheComposition) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  std::vector<int64_t> many(70);
  for (size_t i = 0; i < many.size(); ++i) many[i] = 1 + static_cast<int64_t>(i * 37 % 300);
  const QkAttentionCase cases[] = {
      {16, 8, 128, 128, true, false, false, {100}, 0, 144, true, 0, false, false, false, 1},
      {32, 8, 64, 64, false, false, false, {1, 17, 60}, 0, 144, true, 0, false, false, false, 1},
      {8, 1, 128, 128, true, true, false, {5, 90}, 0, 100, false},
      {4, 2, 256, 256, true, false, false, {50, 3}, 0, 60, false},
      {6, 2, 96, 32, true, false, true, {3, 20}, 0, 30, false},
      {16, 4, 32, 16, true, false, true, many, 0, 301, false},
      {12, 1, 64, 64, false, false, false, {33, 7}, 0, 40, false, 0, false, false, false, 0},
      {8, 2, 64, 64, true, false, false, {40, 100}, 16, 110, false},
      {8, 2, 64, 64, true, false, false, {40, 9}, 0, 50, false, 3},
      {16, 8, 128, 128, true, false, false, {20, 30, 25}, 0, 144, true, 0, true},
      {16, 8, 128, 128, true, false, false, {20, 30}, 0, 144, true, 0, false, true},
      // One split of 4 warps with more heads than lane groups (gc + 2 = 5 heads, 4 groups: two
      // rounds); 8 heads of 256 (GMAX 8, 32 lanes a head); RotateHalf over part of the head; a
      // rotary dim that is not a multiple of 8 and norms that are not 16-byte aligned (element loads).
      {12, 4, 256, 256, true, false, false, {40, 7}, 0, 50, false},
      {8, 1, 256, 256, true, true, false, {20}, 0, 30, false},
      {8, 2, 128, 64, true, false, false, {60, 5}, 0, 80, false},
      {8, 2, 64, 36, true, false, false, {30, 12}, 0, 40, false, 0, false, false, true}};
  for (DType dt : test::float_dtypes(dev))
    for (const QkAttentionCase& c : cases) {
      if ((c.bad_row || c.bad_position) && !dev.is_cuda()) continue;  // refused by name on the CPU
      const int64_t b = static_cast<int64_t>(c.lengths.size()), heads = c.hq + 2 * c.hkv, d = c.d, rd = c.rd;
      const int64_t r = b + 1, cap = c.capacity;
      const std::string cfg = fmt::format("{} hq={} hkv={} d={} rd={} lengths={} window={} capacity={} back={} bad row={} "
                                          "bad position={}",
                                          config_name(dev, dt), c.hq, c.hkv, d, rd, fmt::join(c.lengths, ","), c.window, cap,
                                          c.back, c.bad_row, c.bad_position);
      std::vector<int64_t> rows(static_cast<size_t>(b)), positions(rows.size());
      for (int64_t i = 0; i < b; ++i) rows[i] = r - 1 - i, positions[i] = c.lengths[i] - 1 - (i == 0 ? c.back : 0);
      if (c.bad_row) rows[1] = r;
      if (c.bad_position) positions[1] = cap;
      // The caches: noise at every row's keys, NaN past them.
      V kc0(static_cast<size_t>(r * c.hkv * cap * d), NAN), vc0 = kc0, noise(kc0.size());
      gen.fill_uniform(noise, -2, 2);
      for (int64_t i = 0; i < b; ++i)
        for (int64_t h = 0; h < c.hkv; ++h)
          for (int64_t j = 0; j < c.lengths[i]; ++j)
            for (int64_t e = 0; e < d; ++e) {
              const int64_t row = std::min(rows[i], r - 1);
              const auto at = static_cast<size_t>(((row * c.hkv + h) * cap + j) * d + e);
              kc0[at] = noise[at], vc0[at] = noise[(at * 7 + 3) % noise.size()];
            }
      const Tensor qkv = Tensor::randn({b, heads, d}, dt, dev, gen);
      V cs(static_cast<size_t>(b * rd)), sn(cs.size());
      for (int64_t i = 0; i < b; ++i)
        for (int64_t j = 0; j < rd; ++j) {
          const int64_t pair = c.interleaved ? j / 2 : j % (rd / 2);
          const double a = positions[i] * std::pow(10000.0, -2.0 * pair / rd);
          cs[i * rd + j] = std::cos(a), sn[i * rd + j] = std::sin(a);
        }
      const Tensor cos = Tensor::from_f64(cs, {b, 1, rd}, dt, dev), sin = Tensor::from_f64(sn, {b, 1, rd}, dt, dev);
      ops::QkNormRopeCache opt;
      opt.q_heads = c.hq, opt.kv_heads = c.hkv;
      opt.layout = c.interleaved ? ops::RopeLayout::Interleaved : ops::RopeLayout::RotateHalf;
      if (c.norm) {
        opt.q_norm = Tensor::randn({d}, dt, dev, gen), opt.k_norm = Tensor::randn({d}, dt, dev, gen);
        if (c.offset_norms)
          opt.q_norm = Tensor::randn({d + 1}, dt, dev, gen).narrow(0, 1, d), opt.k_norm = Tensor::randn({d + 1}, dt, dev, gen).narrow(0, 1, d);
        opt.norm.eps = 1e-6, opt.norm.offset = c.gemma ? 1.0 : 0.0;
        opt.norm.casting = c.gemma ? ops::RMSNormCasting::Gemma : ops::RMSNormCasting::Llama;
      }
      const Tensor kc = Tensor::from_f64(kc0, {r, c.hkv, cap, d}, dt, dev), vc = Tensor::from_f64(vc0, {r, c.hkv, cap, d}, dt, dev);
      const Tensor kc2 = kc.clone(), vc2 = vc.clone();
      const double scale = 1.0 / std::sqrt(static_cast<double>(d));
      const int64_t max_length = c.bound_by_capacity ? 0 : *std::max_element(c.lengths.begin(), c.lengths.end());
      const Tensor rows_t = i32(rows, dev), positions_t = i32(positions, dev), lengths_t = i32(c.lengths, dev);
      const int64_t fused_before = ops::qk_norm_rope_attention_fused_runs();
      const Tensor out = ops::qk_norm_rope_attention(qkv, opt, cos, sin, kc, vc, rows_t, positions_t, lengths_t, scale,
                                                     c.window, max_length);
      const char* short_env = std::getenv("KCPP_ATTN_SHORT");  // =0 sends short rows to the split path
      if (dev.is_cuda() && dt != DType::f32 && c.expect_fused >= 0 && !(short_env && std::string(short_env) == "0")) {
        EXPECT_EQ(ops::qk_norm_rope_attention_fused_runs() - fused_before, c.expect_fused)
            << cfg << " (the path: 1 the one kernel, 0 the composition)";
      }
      // Settled (a decode step's promise: only qkv is the previous kernel's output): the indices, cos /
      // sin and the first keys are read before the wait, with the same result.
      {
        const Tensor kc3 = Tensor::from_f64(kc0, {r, c.hkv, cap, d}, dt, dev), vc3 = Tensor::from_f64(vc0, {r, c.hkv, cap, d}, dt, dev);
        const Tensor qkv3 = qkv.clone();  // the kernel just before
        ops::QkNormRopeCache settled = opt;
        settled.settled = true;
        const Tensor out3 = ops::qk_norm_rope_attention(qkv3, settled, cos, sin, kc3, vc3, rows_t, positions_t, lengths_t,
                                                        scale, c.window, max_length);
        EXPECT_TRUE(same_values(values(out3), values(out))) << cfg << " (settled: the same as unsettled)";
        EXPECT_TRUE(same_values(values(kc3), values(kc))) << cfg << " (settled: the k cache)";
        EXPECT_TRUE(same_values(values(vc3), values(vc))) << cfg << " (settled: the v cache)";
      }
      const Tensor q = ops::qk_norm_rope_cache(qkv, opt, cos, sin, kc2, vc2, rows_t, positions_t);
      const Tensor composed = ops::decode_attention(q, kc2, vc2, rows_t, lengths_t, scale, c.window, max_length);
      ASSERT_EQ(out.shape(), (Shape{b, c.hq, d})) << cfg;
      if (dt == DType::f32 && dev.is_cuda()) {
        const double tol = 64 * test::unit_roundoff(DType::f32);
        EXPECT_TRUE(test::close_l2(out, values(composed), tol)) << cfg << " (against the composition)";
        EXPECT_TRUE(test::close_l2(kc, values(kc2), tol)) << cfg << " (k cache against the composition)";
      } else {
        EXPECT_TRUE(same_values(values(out), values(composed))) << cfg << " (against the composition)";
        EXPECT_TRUE(same_values(values(kc), values(kc2))) << cfg << " (k cache against the composition)";
      }
      EXPECT_TRUE(same_values(values(vc), values(vc2))) << cfg << " (v cache against the composition)";
      // The f64 oracle: q and the new key normed and rotated, the new value as is, then each good
      // row's query heads attend over its keys (the caches as stored, the new key and value in place).
      const V x = values(qkv), cv = values(cos), sv = values(sin);
      const V qw = c.norm ? values(opt.q_norm) : V{}, kw = c.norm ? values(opt.k_norm) : V{};
      // The caches' values as stored in the dtype.
      const V ks = values(Tensor::from_f64(kc0, {r, c.hkv, cap, d}, dt, Device::cpu()));
      const V vs = values(Tensor::from_f64(vc0, {r, c.hkv, cap, d}, dt, Device::cpu()));
      auto head = [&](int64_t i, int64_t h) { return V(x.begin() + (i * heads + h) * d, x.begin() + (i * heads + h + 1) * d); };
      auto prep = [&](const V& in, const V& w, int64_t i) {
        V y = c.norm ? oracle::rms_norm(in, w, 1, d, 1e-6, opt.norm.offset).y : in;
        const V cb(cv.begin() + i * rd, cv.begin() + (i + 1) * rd), sb(sv.begin() + i * rd, sv.begin() + (i + 1) * rd);
        return oracle::rope(y, cb, sb, 1, 1, 1, d, rd, 1, false, c.interleaved);
      };
      const V got = values(out);
      for (int64_t i = 0; i < b; ++i) {
        const auto first = static_cast<size_t>(i * c.hq * d);
        if (i == 1 && c.bad_row) {
          for (size_t e = first; e < first + static_cast<size_t>(c.hq * d); ++e) ASSERT_TRUE(std::isnan(got[e])) << cfg;
          continue;
        }
        const int64_t len = c.lengths[i];
        V qi, ki, vi;
        for (int64_t h = 0; h < c.hq; ++h) {
          const V y = prep(head(i, h), qw, i);
          qi.insert(qi.end(), y.begin(), y.end());
        }
        for (int64_t h = 0; h < c.hkv; ++h) {
          const auto from = static_cast<size_t>((rows[i] * c.hkv + h) * cap * d);
          V kh(ks.begin() + from, ks.begin() + from + len * d), vh(vs.begin() + from, vs.begin() + from + len * d);
          if (!(i == 1 && c.bad_position)) {
            const V kn = prep(head(i, c.hq + h), kw, i), vn = head(i, c.hq + c.hkv + h);
            std::copy(kn.begin(), kn.end(), kh.begin() + positions[i] * d);
            std::copy(vn.begin(), vn.end(), vh.begin() + positions[i] * d);
          }
          ki.insert(ki.end(), kh.begin(), kh.end());
          vi.insert(vi.end(), vh.begin(), vh.end());
        }
        const auto o = oracle::attention(qi, ki, vi, nullptr, 1, c.hq, c.hkv, 1, len, d, scale, true, c.window);
        const Tensor row_out = out.narrow(0, i, 1);
        EXPECT_TRUE(test::close_l2(row_out, o.out, test::composite_rel_l2(dt))) << cfg << " row " << i;
      }
    }
  // Checked by name, as both ops check.
  const Tensor qkv = Tensor::zeros({1, 4, 16}, DType::f32, dev), cs = Tensor::zeros({1, 1, 16}, DType::f32, dev);
  const Tensor kc = Tensor::zeros({1, 1, 8, 16}, DType::f32, dev);
  ops::QkNormRopeCache opt;
  opt.q_heads = 2, opt.kv_heads = 1;
  const Tensor zero = i32({0}, dev), one = i32({1}, dev);
  EXPECT_ERROR(ops::qk_norm_rope_attention(qkv, opt, cs, cs, kc, kc.clone(), zero, zero, one.to(DType::i64), 0.25),
               "op qk_norm_rope_attention: argument 'lengths' must be i32");
  EXPECT_ERROR(ops::qk_norm_rope_attention(qkv, opt, cs, cs, kc, kc.clone(), zero, zero, one, 0.25, -1), "window is -1");
  EXPECT_ERROR(ops::qk_norm_rope_attention(qkv, opt, cs, cs, kc, kc.clone(), zero, zero, one, 0.25, 0, 9), "max_length 9");
  EXPECT_ERROR(ops::qk_norm_rope_attention(Tensor::zeros({1, 3, 16}, DType::f32, dev), opt, cs, cs, kc, kc.clone(), zero, zero,
                                           one, 0.25),
               "it must have 4");
}

TEST_P(DecodeFused, AddRmsNormMatchesTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  for (DType dt : test::float_dtypes(dev))
    for (const auto& [n, h, gemma, offset] : {std::tuple{1, 1024, false, 0.0}, std::tuple{7, 333, false, 0.0},
                                              std::tuple{3, 4099, true, 1.0}, std::tuple{2, 5000, false, 1.0},
                                              std::tuple{32, 2048, false, 0.0}, std::tuple{1, 1, false, 0.0},
                                              // Prefill-sized; rows of more chunks than a block's threads.
                                              std::tuple{2051, 1024, false, 0.0}, std::tuple{3, 8200, true, 1.0},
                                              std::tuple{2, 40000, false, 0.0}}) {
      const std::string cfg = fmt::format("{} n={} h={} gemma={} offset={}", config_name(dev, dt), n, h, gemma, offset);
      const Tensor x = Tensor::randn({n, h}, dt, dev, gen), delta = Tensor::randn({n, h}, dt, dev, gen);
      const Tensor w = Tensor::randn({h}, dt, dev, gen);
      ops::RMSNormOptions opt;
      opt.eps = 1e-5, opt.offset = offset, opt.casting = gemma ? ops::RMSNormCasting::Gemma : ops::RMSNormCasting::Llama;
      const auto [s, y] = ops::add_rms_norm(x, delta, w, opt);
      const V xv = values(x), dv = values(delta);
      V s_ref(xv.size());
      for (size_t e = 0; e < xv.size(); ++e) s_ref[e] = xv[e] + dv[e];
      // The sum is one rounding; the norm reads the rounded sum, as the composition does.
      EXPECT_TRUE(test::close_elementwise(s, s_ref, test::primitive_rtol(dt), 0.0)) << cfg << " (sum)";
      EXPECT_TRUE(test::close_l2(y, oracle::rms_norm(values(s), values(w), n, h, 1e-5, offset).y, test::composite_rel_l2(dt)))
          << cfg << " (norm)";
    }
}

TEST_P(DecodeFused, GluPackedMatchesTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  for (DType dt : test::float_dtypes(dev))
    for (const auto& [n, inter, act, oact] :
         {std::tuple{1, 3072, ops::GluActivation::Silu, oracle::Act::Silu}, std::tuple{5, 77, ops::GluActivation::Gelu, oracle::Act::Gelu},
          std::tuple{3, 1000, ops::GluActivation::GeluTanh, oracle::Act::GeluTanh},
          std::tuple{70000, 16, ops::GluActivation::Silu, oracle::Act::Silu},
          std::tuple{270000, 8, ops::GluActivation::Silu, oracle::Act::Silu},  // more rows than a CUDA grid's y
          // Prefill-sized; a row split over blocks unevenly.
          std::tuple{2049, 3072, ops::GluActivation::Silu, oracle::Act::Silu}, std::tuple{301, 77, ops::GluActivation::Gelu, oracle::Act::Gelu},
          std::tuple{258, 2056, ops::GluActivation::GeluTanh, oracle::Act::GeluTanh}}) {
      const std::string cfg = fmt::format("{} n={} inter={}", config_name(dev, dt), n, inter);
      const Tensor gu = Tensor::randn({n, 2 * inter}, dt, dev, gen);
      const Tensor out = ops::glu_packed(gu, act);
      ASSERT_EQ(out.shape(), (Shape{n, inter})) << cfg;
      const V g = values(gu.narrow(1, 0, inter).contiguous()), u = values(gu.narrow(1, inter, inter).contiguous());
      EXPECT_TRUE(test::close_l2(out, oracle::glu(g, u, oact), test::composite_rel_l2(dt))) << cfg;
    }
}

// x rounded to dt, as a tensor of dt stores it.
V rounded(const V& x, DType dt) {
  return Tensor::from_f64(x, {static_cast<int64_t>(x.size())}, dt, Device::cpu()).to_f64_vector();
}

// out[n, o] = sum_k a[n, k] w[o, k] in f64.
V product(const V& a, const V& w, int64_t n, int64_t k, int64_t o) {
  V out(static_cast<size_t>(n * o));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < o; ++j) {
      double acc = 0;
      for (int64_t e = 0; e < k; ++e) acc += a[i * k + e] * w[j * k + e];
      out[i * o + j] = acc;
    }
  return out;
}

// out [n, o] against the f64 product of a [n, k] and w [o, k], element by element: within one rounding
// to out's dtype, plus 4 sqrt(k) f32 unit roundoffs of the sum of the terms' magnitudes for the f32
// sums (a single output can be a small difference of large terms: relative to the result alone, as a
// whole-vector L2 check measures it, its f32 error is unbounded).
::testing::AssertionResult product_within(const Tensor& out, const V& a, const V& w, int64_t n, int64_t k, int64_t o, DType dt) {
  const V got = values(out);
  const double u = test::unit_roundoff(dt), sums = 4 * std::sqrt(static_cast<double>(k)) * test::unit_roundoff(DType::f32);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < o; ++j) {
      double ref = 0, mag = 0;
      for (int64_t e = 0; e < k; ++e) {
        const double t = a[static_cast<size_t>(i * k + e)] * w[static_cast<size_t>(j * k + e)];
        ref += t, mag += std::fabs(t);
      }
      const double g = got[static_cast<size_t>(i * o + j)];
      if (!(std::fabs(g - ref) <= u * std::fabs(ref) + sums * mag))
        return ::testing::AssertionFailure() << "out[" << i << ", " << j << "] = " << g << ", the f64 product " << ref
                                             << " (terms' magnitudes " << mag << ")";
    }
  return ::testing::AssertionSuccess();
}

struct NormLinearCase {
  int64_t n, k, o;
  bool delta, gemma;
  double offset;
};

TEST_P(DecodeFused, AddRmsNormLinearMatchesTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  const NormLinearCase cases[] = {{1, 1024, 4096, true, false, 0.0}, {1, 1024, 1, false, false, 0.0},
                                  {2, 1000, 333, true, false, 1.0},  {3, 2056, 7, true, true, 1.0},
                                  {4, 8, 129, true, false, 0.0},     {4, 3072, 1024, true, false, 0.0},
                                  {3, 136, 4099, false, true, 1.0},  {5, 64, 33, true, false, 0.0},
                                  {2, 333, 17, true, false, 0.0},
                                  // a warp's row in three passes and a block's several columns: the next
                                  // pass (or column) loaded ahead of the products
                                  {2, 4104, 4500, true, false, 0.0}};
  for (DType dt : test::float_dtypes(dev))
    for (const NormLinearCase& c : cases) {
      const std::string cfg = fmt::format("{} n={} k={} o={} delta={} gemma={} offset={}", config_name(dev, dt), c.n, c.k,
                                          c.o, c.delta, c.gemma, c.offset);
      const Tensor x = Tensor::randn({c.n, c.k}, dt, dev, gen);
      const Tensor delta = c.delta ? Tensor::randn({c.n, c.k}, dt, dev, gen) : Tensor();
      const Tensor wn = Tensor::randn({c.k}, dt, dev, gen), w = Tensor::randn({c.o, c.k}, dt, dev, gen);
      ops::RMSNormOptions opt;
      opt.eps = 1e-6, opt.offset = c.offset, opt.casting = c.gemma ? ops::RMSNormCasting::Gemma : ops::RMSNormCasting::Llama;
      const auto [s, out] = ops::add_rms_norm_linear(x, delta, wn, opt, w);
      ASSERT_EQ(s.shape(), x.shape()) << cfg;
      ASSERT_EQ(out.shape(), (Shape{c.n, c.o})) << cfg;
      V s_ref = values(x);
      if (c.delta) {
        const V dv = values(delta);
        for (size_t e = 0; e < s_ref.size(); ++e) s_ref[e] += dv[e];
      }
      EXPECT_TRUE(test::close_elementwise(s, s_ref, test::primitive_rtol(dt), 0.0)) << cfg << " (sum)";
      // The norm reads the rounded sum and stores its output in the dtype before the product, as the
      // composition does: against the f64 oracle, the normed row; the product of that stored row
      // (ops::rms_norm_forward on the CPU, whose roundings Ops tests pin) in f64 against the output,
      // where only the f32 sums and the output's rounding remain (an output of one column can be a
      // small difference of large terms, which the stored row's roundings alone would dominate).
      const Tensor a = ops::rms_norm_forward(s.to(Device::cpu()), wn.to(Device::cpu()), opt).y;
      EXPECT_TRUE(test::close_l2(a, oracle::rms_norm(values(s), values(wn), c.n, c.k, 1e-6, c.offset).y,
                                 test::composite_rel_l2(dt))) << cfg << " (norm)";
      EXPECT_TRUE(product_within(out, values(a), values(w), c.n, c.k, c.o, dt)) << cfg << " (out)";
    }
}

// The gate/up projection with the gated activation after it.  Against the f64 oracle: the stored
// normed row's product rounded to the dtype (as add_rms_norm_linear stores gu), then the activation
// of the rounded halves; and the same bits as the composition it replaces.
TEST_P(DecodeFused, AddRmsNormLinearGluMatchesTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  struct Case {
    int64_t n, k, inter;
    bool delta, gemma;
    ops::GluActivation act;
    oracle::Act oact;
  };
  const Case cases[] = {{1, 1024, 3072, true, false, ops::GluActivation::Silu, oracle::Act::Silu},
                        {1, 2048, 8192, false, false, ops::GluActivation::Silu, oracle::Act::Silu},
                        {2, 1000, 77, true, true, ops::GluActivation::Gelu, oracle::Act::Gelu},
                        {3, 2056, 1, true, false, ops::GluActivation::GeluTanh, oracle::Act::GeluTanh},
                        {4, 136, 4099, true, false, ops::GluActivation::Silu, oracle::Act::Silu},
                        {5, 64, 33, true, false, ops::GluActivation::Gelu, oracle::Act::Gelu},  // composed on CUDA (5 rows)
                        {2, 4104, 2300, true, false, ops::GluActivation::Silu, oracle::Act::Silu},
                        // K split over warps: one pass of 4 slices, of 2, of 1; 8 slices of several
                        // passes (K beyond one pass of 8)
                        {4, 2056, 64, true, false, ops::GluActivation::GeluTanh, oracle::Act::GeluTanh},
                        {1, 1500, 100, true, false, ops::GluActivation::Gelu, oracle::Act::Gelu},
                        {1, 1024, 1000, true, true, ops::GluActivation::Silu, oracle::Act::Silu},
                        {2, 8200, 32, true, false, ops::GluActivation::Silu, oracle::Act::Silu}};
  for (DType dt : test::float_dtypes(dev))
    for (const Case& c : cases) {
      const std::string cfg = fmt::format("{} n={} k={} inter={} delta={} gemma={}", config_name(dev, dt), c.n, c.k,
                                          c.inter, c.delta, c.gemma);
      const Tensor x = Tensor::randn({c.n, c.k}, dt, dev, gen);
      const Tensor delta = c.delta ? Tensor::randn({c.n, c.k}, dt, dev, gen) : Tensor();
      // Weights of a model's scale (1 / sqrt(K)): gate sums of order 1, where the activations are well
      // conditioned (at sums of order sqrt(K) GELU's 1 + tanh cancels in f32 against the f64 oracle).
      const Tensor wn = Tensor::randn({c.k}, dt, dev, gen);
      const Tensor w = ops::scale(Tensor::randn({2 * c.inter, c.k}, dt, dev, gen), 1.0 / std::sqrt(static_cast<double>(c.k)));
      ops::RMSNormOptions opt;
      opt.eps = 1e-6, opt.offset = c.gemma ? 1.0 : 0.0;
      opt.casting = c.gemma ? ops::RMSNormCasting::Gemma : ops::RMSNormCasting::Llama;
      const auto [s, h] = ops::add_rms_norm_linear_glu(x, delta, wn, opt, w, c.act);
      ASSERT_EQ(s.shape(), x.shape()) << cfg;
      ASSERT_EQ(h.shape(), (Shape{c.n, c.inter})) << cfg;
      const auto [s_ref, gu] = ops::add_rms_norm_linear(x, delta, wn, opt, w);
      EXPECT_TRUE(test::close_elementwise(s, values(s_ref), 0.0, 0.0)) << cfg << " (sum: exact)";
      EXPECT_TRUE(test::close_elementwise(h, values(ops::glu_packed(gu, c.act)), 0.0, 0.0)) << cfg << " (the composition: exact)";
      const Tensor a = ops::rms_norm_forward(s.to(Device::cpu()), wn.to(Device::cpu()), opt).y;
      const V g = rounded(product(values(a), values(w.narrow(0, 0, c.inter).contiguous()), c.n, c.k, c.inter), dt);
      const V u = rounded(product(values(a), values(w.narrow(0, c.inter, c.inter).contiguous()), c.n, c.k, c.inter), dt);
      EXPECT_TRUE(test::close_l2(h, oracle::glu(g, u, c.oact), test::composite_rel_l2(dt))) << cfg << " (oracle)";
    }
  // An f32 residual beside 16-bit weights (s in f32, h in the weights' dtype); an empty product still
  // makes s.
  for (DType dt : test::float_dtypes(dev)) {
    if (dt != DType::bf16 && dt != DType::f16) continue;
    const std::string cfg = fmt::format("{} f32 residual", config_name(dev, dt));
    const Tensor x = Tensor::randn({2, 1024}, DType::f32, dev, gen), delta = Tensor::randn({2, 1024}, dt, dev, gen);
    const Tensor wn = Tensor::randn({1024}, dt, dev, gen), w = Tensor::randn({2 * 300, 1024}, dt, dev, gen);
    const auto [s, h] = ops::add_rms_norm_linear_glu(x, delta, wn, {}, w, ops::GluActivation::Silu);
    const auto [s_ref, gu] = ops::add_rms_norm_linear(x, delta, wn, {}, w);
    ASSERT_EQ(s.dtype(), DType::f32) << cfg;
    EXPECT_TRUE(test::close_elementwise(s, values(s_ref), 0.0, 0.0)) << cfg << " (sum: exact)";
    EXPECT_TRUE(test::close_elementwise(h, values(ops::glu_packed(gu, ops::GluActivation::Silu)), 0.0, 0.0)) << cfg;
    const auto [s0, h0] = ops::add_rms_norm_linear_glu(x, delta, wn, {}, w.narrow(0, 0, 0), ops::GluActivation::Silu);
    ASSERT_EQ(h0.shape(), (Shape{2, 0})) << cfg;
    EXPECT_TRUE(test::close_elementwise(s0, values(s_ref), 0.0, 0.0)) << cfg << " (empty product: the sum still made)";
  }
  // Bad input: an odd number of weight rows.
  const Tensor x = Tensor::randn({1, 16}, DType::f32, dev, gen), wn = Tensor::randn({16}, DType::f32, dev, gen);
  EXPECT_THROW((void)ops::add_rms_norm_linear_glu(x, Tensor(), wn, {}, Tensor::randn({5, 16}, DType::f32, dev, gen),
                                                  ops::GluActivation::Silu),
               Error);
}

TEST_P(DecodeFused, GluLinearMatchesTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  for (DType dt : test::float_dtypes(dev))
    for (const auto& [n, inter, o, act, oact] :
         {std::tuple{1, 3072, 1024, ops::GluActivation::Silu, oracle::Act::Silu},
          std::tuple{2, 1000, 77, ops::GluActivation::Gelu, oracle::Act::Gelu},
          std::tuple{3, 8, 5, ops::GluActivation::GeluTanh, oracle::Act::GeluTanh},
          std::tuple{4, 2056, 2049, ops::GluActivation::Silu, oracle::Act::Silu},
          std::tuple{1, 77, 9, ops::GluActivation::Silu, oracle::Act::Silu},
          std::tuple{6, 64, 11, ops::GluActivation::Gelu, oracle::Act::Gelu},
          std::tuple{1, 4104, 4500, ops::GluActivation::Silu, oracle::Act::Silu}}) {
      const std::string cfg = fmt::format("{} n={} inter={} o={}", config_name(dev, dt), n, inter, o);
      const Tensor gu = Tensor::randn({n, 2 * inter}, dt, dev, gen), w = Tensor::randn({o, inter}, dt, dev, gen);
      const Tensor out = ops::glu_linear(gu, act, w);
      ASSERT_EQ(out.shape(), (Shape{n, o})) << cfg;
      const V g = values(gu.narrow(1, 0, inter).contiguous()), u = values(gu.narrow(1, inter, inter).contiguous());
      // The gated activation is rounded to the dtype before the product, as the composition stores it.
      EXPECT_TRUE(test::close_l2(out, product(rounded(oracle::glu(g, u, oact), dt), values(w), n, inter, o),
                                 test::composite_rel_l2(dt)))
          << cfg;
    }
}

// linear_glu: the packed gate/up product and its activation, on path Kernel.  On a CUDA device where
// the Hopper kernel runs (fused_gemm_unavailable), the bf16 / f16 cases take it: partial tiles
// of rows (past 128 and 256), of K (not a multiple of the 64 a k-step reads) and of the intermediate
// size (a 128-column tile's part, down to 8), a row stride past K; the others (K not a multiple of 8,
// f32, the CPU) the composition.  Path Auto leaves these few tiles to the composition; its rule on
// the measured shapes.
TEST_P(DecodeFused, LinearGluMatchesTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  const bool kernel_here = ops::fused_gemm_unavailable(dev, ops::FusedGemm::LinearGlu) == nullptr;
  struct Case {
    int64_t n, k, inter, ld;
    ops::GluActivation act;
    oracle::Act oact;
    bool kernel;  // the Hopper kernel takes it where it runs (bf16 / f16)
  };
  const Case cases[] = {{257, 136, 200, 136, ops::GluActivation::Silu, oracle::Act::Silu, true},
                        {520, 1032, 264, 1032, ops::GluActivation::GeluTanh, oracle::Act::GeluTanh, true},
                        {300, 64, 8, 72, ops::GluActivation::Gelu, oracle::Act::Gelu, true},
                        {256, 200, 136, 200, ops::GluActivation::Silu, oracle::Act::Silu, true},
                        {5, 64, 64, 64, ops::GluActivation::Silu, oracle::Act::Silu, true},
                        {300, 100, 64, 100, ops::GluActivation::Silu, oracle::Act::Silu, false}};  // K % 8
  for (DType dt : test::float_dtypes(dev))
    for (const Case& c : cases) {
      const std::string cfg = fmt::format("{} n={} k={} inter={} ld={}", config_name(dev, dt), c.n, c.k, c.inter, c.ld);
      const Tensor x = Tensor::randn({c.n, c.ld}, dt, dev, gen).narrow(1, 0, c.k);
      // Weights of a model's scale (1 / sqrt(K)): gate sums of order 1 (see AddRmsNormLinearGlu...).
      const Tensor w = ops::scale(Tensor::randn({2 * c.inter, c.k}, dt, dev, gen), 1.0 / std::sqrt(static_cast<double>(c.k)));
      const V xv = values(x.contiguous());
      const V g = rounded(product(xv, values(w.narrow(0, 0, c.inter).contiguous()), c.n, c.k, c.inter), dt);
      const V u = rounded(product(xv, values(w.narrow(0, c.inter, c.inter).contiguous()), c.n, c.k, c.inter), dt);
      const V ref = oracle::glu(g, u, c.oact);
      const bool fused = kernel_here && c.kernel && (dt == DType::bf16 || dt == DType::f16);
      for (const ops::FusedGemmPath path : {ops::FusedGemmPath::Kernel, ops::FusedGemmPath::Auto}) {
        const bool kernel_path = path == ops::FusedGemmPath::Kernel;
        const int64_t before = ops::fused_gemm_runs(ops::FusedGemm::LinearGlu);
        const Tensor h = ops::linear_glu(x, w, c.act, path);
        ASSERT_EQ(h.shape(), (Shape{c.n, c.inter})) << cfg;
        EXPECT_EQ(ops::fused_gemm_runs(ops::FusedGemm::LinearGlu) - before, fused && kernel_path ? 1 : 0)
            << cfg << " path " << (kernel_path ? "Kernel" : "Auto (few tiles: the composition)");
        EXPECT_TRUE(test::close_l2(h, ref, test::composite_rel_l2(dt))) << cfg << " (oracle)";
      }
    }
  // Auto's rule at the shapes it was measured on (132 multiprocessors): Qwen3-0.6B's intermediate
  // 3,072 takes the kernel at 2,048 rows, not at 256 to 1,024; Llama-3.2-1B's 8,192 at 256 and up.
  EXPECT_TRUE(ops::fused_gemm_fills_waves(2048, 3072, 128, 132));
  for (int64_t rows : {256, 512, 1024}) EXPECT_FALSE(ops::fused_gemm_fills_waves(rows, 3072, 128, 132)) << rows;
  for (int64_t rows : {256, 512, 1024, 2048}) EXPECT_TRUE(ops::fused_gemm_fills_waves(rows, 8192, 128, 132)) << rows;
  EXPECT_FALSE(ops::fused_gemm_fills_waves(0, 8192, 128, 132));
  // Bad input: an odd number of weight rows, K unlike x's, an integer x.
  const Tensor x = Tensor::randn({4, 16}, DType::f32, dev, gen);
  EXPECT_ERROR(ops::linear_glu(x, Tensor::randn({5, 16}, DType::f32, dev, gen), ops::GluActivation::Silu),
               "gate rows, then up rows");
  EXPECT_ERROR(ops::linear_glu(x, Tensor::randn({6, 8}, DType::f32, dev, gen), ops::GluActivation::Silu), "must be [2 x intermediate, 16]");
  EXPECT_THROW((void)ops::linear_glu(Tensor::zeros({4, 16}, DType::i32, dev), Tensor::randn({6, 16}, DType::f32, dev, gen),
                                     ops::GluActivation::Silu),
               Error);
}

// linear_qk_norm_rope_cache against the composition it fuses (qk_norm_rope_cache of matmul's output,
// itself tested against the oracle above), on path Kernel: partial tiles of rows, of K and of the
// heads' columns (a 256-column tile past the last head, one holding a k head), head dims 128 and 64,
// no norms, Llama and Gemma casting with an offset, tokens scattered over cache rows and positions.  q and the cache
// entries written agree to the dtype's rounding; every other cache entry is unchanged, bit for bit.
TEST_P(DecodeFused, LinearQkNormRopeCacheIsTheComposition) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  const bool kernel_here = ops::fused_gemm_unavailable(dev, ops::FusedGemm::LinearQkNormRopeCache) == nullptr;
  struct Case {
    int64_t n, k, hq, hkv, d;
    bool norm, gemma;
    double offset;
  };
  const Case cases[] = {{300, 136, 4, 2, 128, true, false, 0.0},
                        {257, 200, 6, 2, 64, false, false, 0.0},
                        {130, 64, 3, 1, 128, true, true, 1.0},
                        {64, 1032, 2, 1, 64, true, false, 0.0},
                        // One partial tile holding q, k and v heads of 64; Llama casting with an offset.
                        {150, 72, 1, 1, 64, true, false, 1.0}};
  for (DType dt : test::float_dtypes(dev))
    for (const Case& c : cases) {
      const std::string cfg = fmt::format("{} n={} k={} hq={} hkv={} d={} norm={} gemma={}", config_name(dev, dt), c.n,
                                          c.k, c.hq, c.hkv, c.d, c.norm, c.gemma);
      const int64_t heads = c.hq + 2 * c.hkv, r = 3, cap = c.n / 3 + 5;
      const Tensor x = Tensor::randn({c.n, c.k}, dt, dev, gen);
      const Tensor w = ops::scale(Tensor::randn({heads * c.d, c.k}, dt, dev, gen), 1.0 / std::sqrt(static_cast<double>(c.k)));
      ops::QkNormRopeCache qo;
      qo.q_heads = c.hq, qo.kv_heads = c.hkv;
      if (c.norm) {
        qo.q_norm = Tensor::randn({c.d}, dt, dev, gen), qo.k_norm = Tensor::randn({c.d}, dt, dev, gen);
        qo.norm.eps = 1e-6, qo.norm.offset = c.offset;
        qo.norm.casting = c.gemma ? ops::RMSNormCasting::Gemma : ops::RMSNormCasting::Llama;
      }
      // Angles of a real RoPE (position x frequency), as cos / sin in the dtype.
      std::vector<double> cv(static_cast<size_t>(c.n * c.d)), sv(cv.size());
      for (int64_t j = 0; j < c.n; ++j)
        for (int64_t e = 0; e < c.d; ++e) {
          const double ang = static_cast<double>(j) * std::pow(10000.0, -2.0 * static_cast<double>(e % (c.d / 2)) / c.d);
          cv[static_cast<size_t>(j * c.d + e)] = std::cos(ang), sv[static_cast<size_t>(j * c.d + e)] = std::sin(ang);
        }
      const Tensor cos = Tensor::from_f64(cv, {c.n, 1, c.d}, dt, dev), sin = Tensor::from_f64(sv, {c.n, 1, c.d}, dt, dev);
      std::vector<int64_t> rows(static_cast<size_t>(c.n)), positions(rows.size());
      for (int64_t j = 0; j < c.n; ++j) rows[static_cast<size_t>(j)] = (j * 2) % r, positions[static_cast<size_t>(j)] = j / r + 2;
      const Tensor rows_t = i32(rows, dev), positions_t = i32(positions, dev);
      const Tensor kc0 = Tensor::randn({r, c.hkv, cap, c.d}, dt, dev, gen), vc0 = Tensor::randn({r, c.hkv, cap, c.d}, dt, dev, gen);
      const Tensor kc = kc0.clone(), vc = vc0.clone(), kc2 = kc0.clone(), vc2 = vc0.clone();
      const int64_t before = ops::fused_gemm_runs(ops::FusedGemm::LinearQkNormRopeCache);
      const Tensor q = ops::linear_qk_norm_rope_cache(x, w, qo, cos, sin, kc, vc, rows_t, positions_t, ops::FusedGemmPath::Kernel);
      const bool fused = kernel_here && (dt == DType::bf16 || dt == DType::f16);
      EXPECT_EQ(ops::fused_gemm_runs(ops::FusedGemm::LinearQkNormRopeCache) - before, fused ? 1 : 0) << cfg << " (the path)";
      const Tensor q2 = ops::linear_qk_norm_rope_cache(x, w, qo, cos, sin, kc2, vc2, rows_t, positions_t,
                                                       ops::FusedGemmPath::Composition);
      ASSERT_EQ(q.shape(), (Shape{c.n, c.hq, c.d})) << cfg;
      EXPECT_TRUE(test::close_l2(q, values(q2), test::composite_rel_l2(dt))) << cfg << " (q)";
      // The cache: the entries the tokens wrote, and every other one unchanged.
      for (const auto& [got, want, orig, name] : {std::tuple{&kc, &kc2, &kc0, "k"}, std::tuple{&vc, &vc2, &vc0, "v"}}) {
        const V g = values(*got), wv = values(*want), o = values(*orig);
        std::vector<char> written(g.size(), 0);
        for (int64_t j = 0; j < c.n; ++j)
          for (int64_t h = 0; h < c.hkv; ++h)
            for (int64_t e = 0; e < c.d; ++e)
              written[static_cast<size_t>(((rows[static_cast<size_t>(j)] * c.hkv + h) * cap + positions[static_cast<size_t>(j)]) * c.d + e)] = 1;
        V gw, ww;
        int64_t changed = 0;
        for (size_t i = 0; i < g.size(); ++i) {
          if (written[i]) gw.push_back(g[i]), ww.push_back(wv[i]);
          else changed += g[i] != o[i];
        }
        EXPECT_EQ(changed, 0) << cfg << " (" << name << " cache entries no token writes)";
        EXPECT_TRUE(test::close_l2(Tensor::from_f64(gw, {static_cast<int64_t>(gw.size())}, DType::f64, Device::cpu()), ww,
                                   test::composite_rel_l2(dt)))
            << cfg << " (" << name << " cache entries written)";
      }
    }
  // Bad input: weight rows that are no whole number of heads.
  const Tensor x = Tensor::randn({4, 16}, DType::f32, dev, gen);
  ops::QkNormRopeCache qo;
  qo.q_heads = 2, qo.kv_heads = 1;
  const Tensor cache = Tensor::zeros({1, 1, 8, 8}, DType::f32, dev);
  EXPECT_ERROR(ops::linear_qk_norm_rope_cache(x, Tensor::randn({33, 16}, DType::f32, dev, gen), qo,
                                              Tensor::zeros({4, 1, 8}, DType::f32, dev), Tensor::zeros({4, 1, 8}, DType::f32, dev),
                                              cache, cache, i32({0, 0, 0, 0}, dev), i32({0, 1, 2, 3}, dev)),
               "(q, k and v heads)");
}

// An f32 residual stream beside bf16 / f16 weights (Mamba's residual_in_fp32): s = x + delta in f32,
// the norm of s rounded to the weights' dtype, the product of that stored row.
TEST_P(DecodeFused, AddRmsNormLinearWithAnF32Residual) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  for (DType dt : {DType::bf16, DType::f16})
    for (const auto& [n, k, o, with_delta] : {std::tuple{1, 2048, 4096, true}, std::tuple{3, 136, 77, true},
                                              std::tuple{4, 24, 96, false}, std::tuple{2, 1000, 9, true}}) {
      const std::string cfg = fmt::format("{} n={} k={} o={} delta={}", config_name(dev, dt), n, k, o, with_delta);
      const Tensor x = Tensor::randn({n, k}, DType::f32, dev, gen);
      const Tensor delta = with_delta ? Tensor::randn({n, k}, dt, dev, gen) : Tensor();
      const Tensor wn = Tensor::randn({k}, dt, dev, gen), w = Tensor::randn({o, k}, dt, dev, gen);
      ops::RMSNormOptions opt;
      opt.eps = 1e-5;
      const auto [s, out] = ops::add_rms_norm_linear(x, delta, wn, opt, w);
      ASSERT_EQ(s.dtype(), DType::f32) << cfg;
      ASSERT_EQ(out.dtype(), dt) << cfg;
      V s_ref = values(x);
      if (with_delta) {
        const V dv = values(delta);
        for (size_t e = 0; e < s_ref.size(); ++e) s_ref[e] += dv[e];
      }
      EXPECT_TRUE(test::close_elementwise(s, s_ref, test::primitive_rtol(DType::f32), 0.0)) << cfg << " (sum, f32)";
      const Tensor a = ops::rms_norm_forward(s.to(Device::cpu()).to(dt), wn.to(Device::cpu()), opt).y;
      EXPECT_TRUE(test::close_l2(a, oracle::rms_norm(values(s), values(wn), n, k, 1e-5, 0.0).y, test::composite_rel_l2(dt)))
          << cfg << " (norm)";
      EXPECT_TRUE(test::close_l2(out, product(values(a), values(w), n, k, o), test::composite_rel_l2(dt))) << cfg << " (out)";
    }
}

struct MambaStepCase {
  int64_t m, h, d, r, n, width, k;  // rows, hidden, channels, dt rank, states, convolution width, state length
  bool f32_residual, with_delta, bias, falcon;
};

// The Mamba step's fused ops against the f64 oracle, each from the stored outputs of the one before
// (as the composition stores them): the residual add, the norm and in_proj (with its bias), the
// convolution at the new position and its state's advance; dt_proj, the state update and the gate
// (Falcon-Mamba: dt_low's weightless norm, B and C normalised) and the SSM state after the step.
// Off CUDA the ops name where they run.
TEST_P(DecodeFused, MambaStepMatchesTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  auto bad_call = [&](int64_t rows, int64_t h, int64_t width, int64_t k, DType xt) {
    const Tensor w_in = Tensor::randn({32, h}, DType::bf16, dev, gen);
    return ops::mamba_norm_in_proj(Tensor::randn({rows, h}, xt, dev, gen), Tensor(), Tensor::randn({h}, DType::bf16, dev, gen),
                                   ops::RMSNormOptions{}, w_in, Tensor(), Tensor::zeros({rows, 16, k}, DType::bf16, dev),
                                   Tensor::randn({16, width}, DType::bf16, dev, gen), Tensor());
  };
  if (!dev.is_cuda()) {
    EXPECT_ERROR(bad_call(1, 24, 4, 3, DType::f32), "runs on CUDA in bf16 or f16 only");
    return;
  }
  const MambaStepCase cases[] = {{1, 24, 48, 3, 8, 4, 3, true, true, true, false},     {3, 136, 64, 12, 5, 4, 3, false, true, false, true},
                                 {4, 1000, 2056, 129, 17, 3, 4, true, false, true, true}, {2, 8, 8, 1, 1, 2, 1, false, true, false, false},
                                 {1, 2048, 4096, 128, 16, 4, 3, true, true, false, false}, {2, 24, 48, 3, 8, 4, 3, true, true, true, true},
                                 {1, 64, 40, 300, 16, 1, 0, false, true, false, true}};
  for (DType dt : {DType::bf16, DType::f16})
    for (const MambaStepCase& c : cases) {
      const std::string cfg = fmt::format("{} m={} h={} d={} r={} n={} width={} k={} f32_residual={} delta={} bias={} falcon={}",
                                          config_name(dev, dt), c.m, c.h, c.d, c.r, c.n, c.width, c.k, c.f32_residual, c.with_delta,
                                          c.bias, c.falcon);
      const int64_t m = c.m, hd = c.h, d = c.d, r = c.r, n = c.n, w = c.width, k = c.k, o = r + 2 * n;
      // Weights scaled as trained ones are (unit-sized products), so that dt and the states stay in range.
      auto scaled = [&](const Shape& shape, double fan_in) {
        return ops::scale(Tensor::randn(shape, dt, dev, gen), 1.0 / std::sqrt(fan_in));
      };
      const Tensor x = Tensor::randn({m, hd}, c.f32_residual ? DType::f32 : dt, dev, gen);
      const Tensor delta = c.with_delta ? Tensor::randn({m, hd}, dt, dev, gen) : Tensor();
      const Tensor wn = Tensor::randn({hd}, dt, dev, gen), w_in = scaled({2 * d, hd}, static_cast<double>(hd));
      const Tensor b_in = c.bias ? Tensor::randn({2 * d}, dt, dev, gen) : Tensor();
      const Tensor conv_state = Tensor::randn({m, d, k}, dt, dev, gen), conv_w = scaled({d, w}, 2.0);
      const Tensor conv_b = c.bias ? Tensor::randn({d}, dt, dev, gen) : Tensor();
      const Tensor w_x = scaled({o, d}, static_cast<double>(d)), w_dt = scaled({d, r}, static_cast<double>(r));
      const Tensor A = ops::neg(ops::exp(Tensor::randn({d, n}, DType::f32, dev, gen)));
      const Tensor skip = Tensor::randn({d}, DType::f32, dev, gen), dt_bias = Tensor::randn({d}, DType::f32, dev, gen);
      const Tensor ssm = Tensor::randn({m, d, n}, DType::f32, dev, gen);
      const V cs0 = values(conv_state), ssm0 = values(ssm), cw = values(conv_w);
      const V cb = c.bias ? values(conv_b) : V(static_cast<size_t>(d), 0.0);
      ops::RMSNormOptions opt;
      opt.eps = 1e-5;

      const ops::MambaNormInProj in = ops::mamba_norm_in_proj(x, delta, wn, opt, w_in, b_in, conv_state, conv_w, conv_b);
      ASSERT_EQ(in.s.dtype(), x.dtype()) << cfg;
      ASSERT_EQ(in.xz.shape(), (Shape{m, 2 * d})) << cfg;
      ASSERT_EQ(in.xc.shape(), (Shape{m, d})) << cfg;
      // The sum, then the norm of the sum as stored (rounded to dt), then in_proj of the normed row.
      V s_ref = values(x);
      if (c.with_delta) {
        const V dv = values(delta);
        for (size_t e = 0; e < s_ref.size(); ++e) s_ref[e] += dv[e];
      }
      EXPECT_TRUE(test::close_elementwise(in.s, s_ref, test::primitive_rtol(x.dtype()), 0.0)) << cfg << " (sum)";
      const Tensor a = ops::rms_norm_forward(in.s.to(Device::cpu()).to(dt), wn.to(Device::cpu()), opt).y;
      V xz_ref = product(values(a), values(w_in), m, hd, 2 * d);
      if (c.bias) {
        xz_ref = rounded(xz_ref, dt);  // linear() rounds the product, then adds the bias
        const V bv = values(b_in);
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < 2 * d; ++j) xz_ref[i * 2 * d + j] += bv[j];
      }
      EXPECT_TRUE(test::close_l2(in.xz, xz_ref, test::composite_rel_l2(dt))) << cfg << " (xz)";
      EXPECT_TRUE(test::close_elementwise(in.xz, xz_ref, 2 * test::primitive_rtol(dt), 1.0)) << cfg << " (xz, elementwise)";
      // The convolution of the stored x, and the state it leaves: the oldest entry out, x in.
      const V xz = values(in.xz);
      V xc_ref(static_cast<size_t>(m * d)), cs_ref = cs0;
      for (int64_t i = 0; i < m; ++i)
        for (int64_t ch = 0; ch < d; ++ch) {
          double acc = cb[ch];
          for (int64_t j = 0; j + 1 < w; ++j) acc += cw[ch * w + j] * cs0[(i * d + ch) * k + k - (w - 1) + j];
          acc += cw[ch * w + w - 1] * xz[i * 2 * d + ch];
          xc_ref[i * d + ch] = acc / (1.0 + std::exp(-acc));
          double* st = cs_ref.data() + (i * d + ch) * k;
          for (int64_t j = 0; j + 1 < k; ++j) st[j] = st[j + 1];
          if (k > 0) st[k - 1] = xz[i * 2 * d + ch];
        }
      EXPECT_TRUE(test::close_elementwise(in.xc, xc_ref, test::primitive_rtol(dt), 1.0)) << cfg << " (xc)";
      EXPECT_EQ(values(conv_state), cs_ref) << cfg << " (the convolution's state)";

      const Tensor xdbl = ops::matmul(in.xc, w_x, false, true);
      ops::MambaSsmStep st;
      st.xz = in.xz, st.xc = in.xc, st.xdbl = xdbl, st.w_dt = w_dt, st.dt_bias = dt_bias, st.A = A, st.D = skip, st.ssm_state = ssm;
      if (c.falcon) st.dt_rms_eps = 1e-6, st.bc_rms_eps = 1e-6;
      const Tensor y = ops::mamba_ssm_step(st);
      ASSERT_EQ(y.shape(), (Shape{m, d})) << cfg;
      // The oracle from the stored xc and xdbl.
      const V xcv = values(in.xc), xd = values(xdbl), wdt = values(w_dt), av = values(A), sk = values(skip), bias = values(dt_bias);
      V y_ref(static_cast<size_t>(m * d)), ssm_ref = ssm0;
      auto rms_scale = [](V& v) {
        double ss = 0;
        for (double e : v) ss += e * e;
        const double rstd = 1.0 / std::sqrt(ss / static_cast<double>(v.size()) + 1e-6);
        for (double& e : v) e *= rstd;
      };
      for (int64_t i = 0; i < m; ++i) {
        V low(xd.begin() + i * o, xd.begin() + i * o + r), bv(xd.begin() + i * o + r, xd.begin() + i * o + r + n),
            cv(xd.begin() + i * o + r + n, xd.begin() + (i + 1) * o);
        if (c.falcon) {
          rms_scale(low);
          low = rounded(low, dt);  // the dt norm's output, stored in the dtype
          rms_scale(bv), rms_scale(cv);
        }
        const V dts = rounded(product(low, wdt, 1, r, d), dt);  // dt_proj's output, stored in the dtype
        for (int64_t ch = 0; ch < d; ++ch) {
          const double raw = dts[ch] + bias[ch], step = raw > 20 ? raw : std::log1p(std::exp(raw));
          const double xv = xcv[i * d + ch];
          double acc = 0;
          for (int64_t q = 0; q < n; ++q) {
            double& hv = ssm_ref[(i * d + ch) * n + q];
            hv = std::exp(step * av[ch * n + q]) * hv + step * bv[q] * xv;
            acc += cv[q] * hv;
          }
          const double z = xz[i * 2 * d + d + ch];
          y_ref[i * d + ch] = (acc + sk[ch] * xv) * z / (1.0 + std::exp(-z));
        }
      }
      EXPECT_TRUE(test::close_l2(y, y_ref, test::composite_rel_l2(dt))) << cfg << " (y)";
      EXPECT_TRUE(test::close_l2(ssm, ssm_ref, test::composite_rel_l2(dt))) << cfg << " (the SSM state)";
    }
  // Bad input: named errors.
  EXPECT_ERROR(bad_call(1, 24, 4, 2, DType::bf16), "K <= 4");
  EXPECT_ERROR(bad_call(1, 24, 5, 4, DType::bf16), "width 1 to 4");
  EXPECT_ERROR(bad_call(5, 24, 4, 3, DType::bf16), "5 rows");
  EXPECT_ERROR(bad_call(1, 12, 4, 3, DType::bf16), "row(s) of 12 elements");
  EXPECT_ERROR(bad_call(1, 24, 4, 3, DType::f16), "x is f16");
  ops::MambaSsmStep st;
  st.xz = Tensor::randn({1, 16}, DType::bf16, dev, gen), st.xc = Tensor::randn({1, 8}, DType::bf16, dev, gen);
  st.xdbl = Tensor::randn({1, 4 + 2 * 16}, DType::bf16, dev, gen), st.w_dt = Tensor::randn({8, 4}, DType::bf16, dev, gen);
  st.A = Tensor::randn({8, 16}, DType::bf16, dev, gen), st.ssm_state = Tensor::zeros({1, 8, 16}, DType::f32, dev);
  EXPECT_ERROR(ops::mamba_ssm_step(st), "argument 'A' must be f32");
  st.A = Tensor::randn({8, 16}, DType::f32, dev, gen), st.ssm_state = Tensor::zeros({1, 8, 15}, DType::f32, dev);
  EXPECT_ERROR(ops::mamba_ssm_step(st), "ssm_state");
}

// A decode layer's chain of fused projections, each reading the one before, queued without a
// synchronization (on sm_90 each may start before the previous one ends): every step gives what
// the composition gives from the same inputs, computed afterwards.
TEST_P(DecodeFused, FusedProjectionsChainedMatchTheComposition) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  for (DType dt : test::float_dtypes(dev))
    for (int64_t n : {1, 3}) {
      const int64_t h = 1024, inter = 1536, layers = 6;
      const std::string cfg = fmt::format("{} n={}", config_name(dev, dt), n);
      ops::RMSNormOptions opt;
      opt.eps = 1e-6;
      const Tensor wn = Tensor::randn({h}, dt, dev, gen), w_up = Tensor::randn({2 * inter, h}, dt, dev, gen);
      const Tensor w_down = ops::scale(Tensor::randn({h, inter}, dt, dev, gen), 0.03);
      std::vector<Tensor> xs{Tensor::randn({n, h}, dt, dev, gen)}, deltas{Tensor()}, gus;
      for (int64_t l = 0; l < layers; ++l) {
        auto [s, gu] = ops::add_rms_norm_linear(xs.back(), deltas.back(), wn, opt, w_up);
        xs.push_back(s), gus.push_back(gu);
        deltas.push_back(ops::glu_linear(gu, ops::GluActivation::Silu, w_down));
      }
      for (int64_t l = 0; l < layers; ++l) {
        const size_t i = static_cast<size_t>(l);
        const Tensor s = deltas[i].defined() ? ops::add(xs[i], deltas[i]) : xs[i];
        EXPECT_TRUE(test::close_elementwise(xs[i + 1], s.to_f64_vector(), test::primitive_rtol(dt), 0.0)) << cfg << " layer " << l;
        const Tensor gu = ops::matmul(ops::rms_norm_forward(xs[i + 1], wn, opt).y, w_up, false, true);
        EXPECT_TRUE(test::close_l2(gus[i], gu.to_f64_vector(), test::composite_rel_l2(dt))) << cfg << " layer " << l << " (gate/up)";
        const Tensor down = ops::matmul(ops::glu_packed(gus[i], ops::GluActivation::Silu), w_down, false, true);
        EXPECT_TRUE(test::close_l2(deltas[i + 1], down.to_f64_vector(), test::composite_rel_l2(dt))) << cfg << " layer " << l << " (down)";
      }
    }
}

TEST_P(DecodeFused, BadInputIsRefused) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const Tensor qkv = Tensor::zeros({2, 8, 16}, DType::f32, dev), cos = Tensor::zeros({2, 1, 16}, DType::f32, dev);
  const Tensor kc = Tensor::zeros({3, 2, 5, 16}, DType::f32, dev), rows = i32({0, 1}, dev), pos = i32({0, 4}, dev);
  ops::QkNormRopeCache opt;
  opt.q_heads = 4, opt.kv_heads = 2;
  EXPECT_NO_THROW(ops::qk_norm_rope_cache(qkv, opt, cos, cos, kc, kc.clone(), rows, pos));
  ops::QkNormRopeCache three = opt;
  three.q_heads = 3;
  EXPECT_ERROR(ops::qk_norm_rope_cache(qkv, three, cos, cos, kc, kc.clone(), rows, pos), "it must have 7");
  EXPECT_ERROR(ops::qk_norm_rope_cache(qkv, opt, cos.narrow(2, 0, 15), cos.narrow(2, 0, 15), kc, kc.clone(), rows, pos),
               "rotary dim 15 must be even");
  EXPECT_ERROR(ops::qk_norm_rope_cache(qkv, opt, cos, cos, kc, kc.clone(), rows.to(DType::i64), pos), "'rows' must be i32");
  EXPECT_ERROR(ops::qk_norm_rope_cache(qkv, opt, cos, cos, Tensor::zeros({3, 3, 5, 16}, DType::f32, dev),
                                       Tensor::zeros({3, 3, 5, 16}, DType::f32, dev), rows, pos),
               "does not hold 2 heads of 16");
  ops::QkNormRopeCache half = opt;
  half.q_norm = Tensor::full({16}, 1.0, DType::f32, dev);
  EXPECT_ERROR(ops::qk_norm_rope_cache(qkv, half, cos, cos, kc, kc.clone(), rows, pos), "both q_norm and k_norm");
  const Tensor x = Tensor::zeros({2, 6}, DType::f32, dev);
  EXPECT_ERROR(ops::add_rms_norm(x, Tensor::zeros({2, 5}, DType::f32, dev), Tensor::full({6}, 1.0, DType::f32, dev), {}), "delta");
  EXPECT_ERROR(ops::add_rms_norm(x, x, Tensor::full({5}, 1.0, DType::f32, dev), {}), "weight");
  EXPECT_ERROR(ops::glu_packed(Tensor::zeros({2, 7}, DType::f32, dev), ops::GluActivation::Silu), "halves of equal width");
  const Tensor w8 = Tensor::zeros({3, 8}, DType::f32, dev), one8 = Tensor::full({8}, 1.0, DType::f32, dev);
  const Tensor x8 = Tensor::zeros({2, 8}, DType::f32, dev);
  EXPECT_NO_THROW(ops::add_rms_norm_linear(x8, x8, one8, {}, w8));
  EXPECT_ERROR(ops::add_rms_norm_linear(x8, x8, one8, {}, Tensor::zeros({3, 6}, DType::f32, dev)),
               "must be [out features, 8]");
  EXPECT_ERROR(ops::add_rms_norm_linear(x8, x8, Tensor::full({6}, 1.0, DType::f32, dev), {}, w8), "norm_weight");
  EXPECT_ERROR(ops::add_rms_norm_linear(x8, Tensor::zeros({1, 8}, DType::f32, dev), one8, {}, w8), "delta");
  EXPECT_ERROR(ops::glu_linear(Tensor::zeros({2, 16}, DType::f32, dev), ops::GluActivation::Silu, w8.narrow(1, 0, 4)),
               "(half of gu's 16 columns)");
  EXPECT_ERROR(ops::glu_linear(Tensor::zeros({2, 15}, DType::f32, dev), ops::GluActivation::Silu, w8), "halves of equal width");
  if (dev.is_cuda()) {  // an out-of-range row or position: no cache write, q still computed
    const Tensor kk = Tensor::full({3, 2, 5, 16}, 2.0, DType::f32, dev), vv = kk.clone();
    const Tensor q = ops::qk_norm_rope_cache(Tensor::full({2, 8, 16}, 1.0, DType::f32, dev), opt, Tensor::full({2, 1, 16}, 1.0, DType::f32, dev),
                                             Tensor::zeros({2, 1, 16}, DType::f32, dev), kk, vv, i32({3, -1}, dev), i32({0, 5}, dev));
    for (double e : values(kk)) ASSERT_EQ(e, 2.0);
    for (double e : values(vv)) ASSERT_EQ(e, 2.0);
    for (double e : values(q)) ASSERT_EQ(e, 1.0);
  }
}

// The persistent decode step's operands: contradictions are errors that name the layer and the
// operand; a call the kernel does not cover (here: f32, or a CPU tensor) returns nothing, for the
// caller to compose the fused ops.
TEST_P(DecodeFused, PersistentDecodeChecksItsOperands) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const int64_t h = 16, hq = 4, hkv = 2, d = 8, inter = 24;
  auto z = [&](Shape s) { return Tensor::zeros(s, DType::f32, dev); };
  ops::PersistentDecodeLayer l;
  l.input_norm = z({h}), l.post_norm = z({h}), l.wqkv = z({(hq + 2 * hkv) * d, h}), l.wo = z({h, hq * d});
  l.w_gate_up = z({2 * inter, h}), l.w_down = z({h, inter}), l.k_cache = z({2, hkv, 5, d}), l.v_cache = z({2, hkv, 5, d});
  ops::PersistentDecodeOptions opt;
  opt.q_heads = hq, opt.kv_heads = hkv;
  const Tensor x = z({2, h}), cs = z({2, 1, d}), rows = i32({0, 1}, dev), pos = i32({0, 4}, dev), len = i32({1, 5}, dev);
  ::setenv("KCPP_DECODE_PERSISTENT", "1", 1);
  EXPECT_FALSE(ops::decode_layers_persistent(x, Tensor(), {l, l}, opt, cs, cs, rows, pos, len).has_value());  // f32
  ops::PersistentDecodeLayer bad = l;
  bad.wqkv = z({(hq + 2 * hkv) * d, h + 8});
  EXPECT_ERROR(ops::decode_layers_persistent(x, Tensor(), {l, bad}, opt, cs, cs, rows, pos, len), "layers[1].wqkv");
  bad = l;
  bad.q_norm = z({d});
  EXPECT_ERROR(ops::decode_layers_persistent(x, Tensor(), {bad}, opt, cs, cs, rows, pos, len), "layer 0 has a q norm without a k norm");
  bad = l;
  bad.v_cache = z({2, hkv, 6, d});
  EXPECT_ERROR(ops::decode_layers_persistent(x, Tensor(), {bad}, opt, cs, cs, rows, pos, len), "layers[0].v_cache");
  EXPECT_ERROR(ops::decode_layers_persistent(x, Tensor(), {l}, opt, cs, cs, rows.to(DType::i64), pos, len), "rows must be i32 [2]");
  EXPECT_ERROR(ops::decode_layers_persistent(x, Tensor(), {l}, opt, z({2, 1, d + 2}), z({2, 1, d + 2}), rows, pos, len),
               "rotary width 10 must be even and at most the head dim 8");
  ops::PersistentDecodeOptions three = opt;
  three.kv_heads = 3;
  EXPECT_ERROR(ops::decode_layers_persistent(x, Tensor(), {l}, three, cs, cs, rows, pos, len), "multiple of the kv heads");
  EXPECT_ERROR(ops::decode_layers_persistent(x, Tensor(), {}, opt, cs, cs, rows, pos, len), "no layers");
  ::unsetenv("KCPP_DECODE_PERSISTENT");
}

INSTANTIATE_TEST_SUITE_P(Devices, DecodeFused, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cuda() ? std::string("cuda") : std::string("cpu"); });

}  // namespace
}  // namespace kcpp
