// ops/ primitives against the f64 oracle, on every device and floating dtype, with awkward shapes
// and non-contiguous inputs.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "oracle.h"
#include "ops/ops.h"
#include "ops/threads.h"
#include "test_util.h"

namespace kcpp {
namespace {

using ops::Binary;
using ops::Unary;
using test::close_elementwise;
using test::close_l2;
using test::config_name;
using test::test_generator;

class Ops : public ::testing::TestWithParam<Device> {};

double ref_unary(Unary op, double x, double a) {
  switch (op) {
    case Unary::Neg: return -x;
    case Unary::Exp: return std::exp(x);
    case Unary::Log: return std::log(x);
    case Unary::Sqrt: return std::sqrt(x);
    case Unary::Rsqrt: return 1 / std::sqrt(x);
    case Unary::Square: return x * x;
    case Unary::Abs: return std::fabs(x);
    case Unary::Recip: return 1 / x;
    case Unary::Sin: return std::sin(x);
    case Unary::Cos: return std::cos(x);
    case Unary::Tanh: return std::tanh(x);
    case Unary::Sigmoid: return 1 / (1 + std::exp(-x));
    case Unary::Silu: return oracle::silu(x);
    case Unary::Gelu: return oracle::gelu(x);
    case Unary::GeluTanh: return oracle::gelu_tanh(x);
    case Unary::Scale: return a * x;
    case Unary::AddScalar: return x + a;
  }
  return 0;
}

TEST_P(Ops, UnaryMatchesOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  for (DType dt : test::float_dtypes(dev)) {
    // A transposed view: [13, 7] seen as [7, 13], so the strided path runs.
    const Tensor x = Tensor::uniform({13, 7}, dt, dev, gen, -4, 4).transpose(0, 1);
    const Tensor pos = Tensor::uniform({1, 101}, dt, dev, gen, 0.05, 9);  // for log, sqrt, rsqrt, recip
    for (int o = 0; o <= static_cast<int>(Unary::AddScalar); ++o) {
      const Unary op = static_cast<Unary>(o);
      const bool needs_pos = op == Unary::Log || op == Unary::Sqrt || op == Unary::Rsqrt || op == Unary::Recip;
      const Tensor& in = needs_pos ? pos : x;
      const double alpha = op == Unary::Scale ? -1.7 : 0.3;
      auto xv = in.to_f64_vector();
      std::vector<double> ref(xv.size());
      for (size_t i = 0; i < xv.size(); ++i) ref[i] = ref_unary(op, xv[i], alpha);
      // Function error near zeros (sin, tanh, ...) is absolute: allow it at the scale of the input (<= 9).
      EXPECT_TRUE(close_elementwise(ops::unary(op, in, alpha), ref, test::primitive_rtol(dt), 1.0))
          << config_name(dev, dt) << " unary op " << o;
    }
  }
}

TEST_P(Ops, BinaryBroadcastsAndMatchesOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  for (DType dt : test::float_dtypes(dev)) {
    const Tensor a = Tensor::uniform({5, 1, 17}, dt, dev, gen, -3, 3);
    const Tensor b = Tensor::uniform({17, 3}, dt, dev, gen, 0.5, 3).transpose(0, 1);  // [3, 17] strided
    const auto av = a.to_f64_vector(), bv = b.to_f64_vector();
    for (int o = 0; o <= static_cast<int>(Binary::GeluTanhGrad); ++o) {
      const Binary op = static_cast<Binary>(o);
      std::vector<double> ref(5 * 3 * 17);
      for (int i = 0; i < 5; ++i)
        for (int j = 0; j < 3; ++j)
          for (int k = 0; k < 17; ++k) {
            const double x = av[i * 17 + k], y = bv[j * 17 + k];
            double r = 0;
            switch (op) {
              case Binary::Add: r = x + y; break;
              case Binary::Sub: r = x - y; break;
              case Binary::Mul: r = x * y; break;
              case Binary::Div: r = x / y; break;
              case Binary::SiluGrad: r = x * oracle::dsilu(y); break;
              case Binary::GeluGrad: r = x * oracle::dgelu(y); break;
              case Binary::GeluTanhGrad: r = x * oracle::dgelu_tanh(y); break;
            }
            ref[(i * 3 + j) * 17 + k] = r;
          }
      const Tensor out = ops::binary(op, a, b);
      EXPECT_EQ(out.shape(), (Shape{5, 3, 17}));
      EXPECT_TRUE(close_elementwise(out, ref, test::primitive_rtol(dt), 1.0)) << config_name(dev, dt) << " binary op " << o;
    }
  }
}

TEST_P(Ops, ReductionsAndSoftmaxMatchOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  for (DType dt : test::float_dtypes(dev)) {
    for (int64_t n : {1, 7, 111, 4097}) {
      const int64_t rows = 9;
      const Tensor x = Tensor::randn({rows, n}, dt, dev, gen, 0.5, 2.0);
      const auto xv = x.to_f64_vector();
      std::vector<double> s(rows), m(rows), mx(rows), sm(xv.size()), lsm(xv.size());
      for (int64_t r = 0; r < rows; ++r) {
        double acc = 0, hi = -INFINITY;
        for (int64_t j = 0; j < n; ++j) acc += xv[r * n + j], hi = std::max(hi, xv[r * n + j]);
        double z = 0;
        for (int64_t j = 0; j < n; ++j) z += std::exp(xv[r * n + j] - hi);
        for (int64_t j = 0; j < n; ++j) {
          sm[r * n + j] = std::exp(xv[r * n + j] - hi) / z;
          lsm[r * n + j] = xv[r * n + j] - hi - std::log(z);
        }
        s[r] = acc, m[r] = acc / n, mx[r] = hi;
      }
      const std::string cfg = config_name(dev, dt) + " n=" + std::to_string(n);
      // A sum of n terms carries rounding of order sqrt(n) units of the accumulator (f32 for 16-bit).
      const double tol = test::composite_rel_l2(dt);
      EXPECT_TRUE(close_l2(ops::sum(x), s, tol)) << cfg;
      EXPECT_TRUE(close_l2(ops::mean(x, true), m, tol)) << cfg;
      EXPECT_EQ(ops::mean(x, true).shape(), (Shape{rows, 1}));
      EXPECT_TRUE(close_elementwise(ops::max(x), mx, 0.0, 0.0)) << cfg;  // exact
      const Tensor y = ops::softmax(x), ly = ops::log_softmax(x);
      EXPECT_TRUE(close_l2(y, sm, tol)) << cfg;
      EXPECT_TRUE(close_l2(ly, lsm, tol)) << cfg;
      // Backward against the analytic Jacobian-vector products, using the op's own forward output.
      const Tensor dy = Tensor::randn({rows, n}, dt, dev, gen);
      const auto dyv = dy.to_f64_vector(), yv = y.to_f64_vector(), lyv = ly.to_f64_vector();
      std::vector<double> dsm(xv.size()), dlsm(xv.size());
      for (int64_t r = 0; r < rows; ++r) {
        double d1 = 0, d2 = 0;
        for (int64_t j = 0; j < n; ++j) d1 += dyv[r * n + j] * yv[r * n + j], d2 += dyv[r * n + j];
        for (int64_t j = 0; j < n; ++j) {
          dsm[r * n + j] = yv[r * n + j] * (dyv[r * n + j] - d1);
          dlsm[r * n + j] = dyv[r * n + j] - std::exp(lyv[r * n + j]) * d2;
        }
      }
      EXPECT_TRUE(close_l2(ops::softmax_backward(dy, y), dsm, tol)) << cfg;
      EXPECT_TRUE(close_l2(ops::log_softmax_backward(dy, ly), dlsm, tol)) << cfg;
    }
  }
}

// argmax_checked: the first largest value of each row (ties to the lower index, across the threads
// of a CUDA block and across the blocks a long row is split into), and the first non-finite value,
// which never wins.
TEST_P(Ops, ArgmaxCheckedFindsTheFirstLargestAndTheFirstNonFinite) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  for (DType dt : test::float_dtypes(dev)) {
    for (int64_t n : {1, 5, 33, 600, 1024, 1025, 2047, 4097, 151936}) {  // CUDA splits rows into parts of 1024
      const int64_t rows = 6;
      std::vector<double> v(static_cast<size_t>(rows * n));
      gen.fill_uniform(v, -4, 4);
      v = Tensor::from_f64(v, {rows * n}, dt, Device::cpu()).to_f64_vector();  // representable in dt
      auto at = [&](int64_t r, int64_t j) -> double& { return v[static_cast<size_t>(r * n + j)]; };
      // row 1: a tie of the maximum at the last and at a middle position; row 2: NaN at the front and
      // an infinity later; row 3: -inf everywhere but one; row 4: every value equal.
      at(1, n - 1) = 100, at(1, n / 2) = 100;
      at(2, 0) = std::nan(""), at(2, n - 1) = INFINITY;
      for (int64_t j = 0; j < n; ++j) at(3, j) = j == n / 3 ? -7.0 : -INFINITY;
      for (int64_t j = 0; j < n; ++j) at(4, j) = 1.5;
      const Tensor x = Tensor::from_f64(v, {rows, n}, dt, dev);
      const std::vector<int64_t> got = ops::argmax_checked(x).to_i64_vector();
      for (int64_t r = 0; r < rows; ++r) {
        int64_t best = -1, bad = -1;
        for (int64_t j = 0; j < n; ++j) {
          if (!std::isfinite(at(r, j))) {
            if (bad < 0) bad = j;
          } else if (best < 0 || at(r, j) > at(r, best)) {
            best = j;
          }
        }
        const std::string cfg = config_name(dev, dt) + fmt::format(" n={} row {}", n, r);
        EXPECT_EQ(got[static_cast<size_t>(2 * r)], best < 0 ? 0 : best) << cfg;
        EXPECT_EQ(got[static_cast<size_t>(2 * r + 1)], bad) << cfg;
      }
    }
  }
  try {
    ops::argmax_checked(Tensor::zeros({3}, DType::f32, dev));
    FAIL() << "argmax_checked accepted a 1-dim tensor";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("must be [rows, n]"), std::string::npos) << e.what();
  }
}

TEST_P(Ops, SumOverOtherDims) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  const Tensor x = Tensor::randn({3, 5, 7}, DType::f32, dev, gen);
  const auto xv = x.to_f64_vector();
  std::vector<double> lead(7), mid(3 * 7);
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 5; ++j)
      for (int k = 0; k < 7; ++k) lead[k] += xv[(i * 5 + j) * 7 + k], mid[i * 7 + k] += xv[(i * 5 + j) * 7 + k];
  EXPECT_TRUE(close_l2(ops::sum_leading(x), lead, 1e-6));
  EXPECT_TRUE(close_l2(ops::sum_dim(x, 1), mid, 1e-6));
  EXPECT_EQ(ops::sum_dim(x, 1, true).shape(), (Shape{3, 1, 7}));
}

TEST_P(Ops, MatmulMatchesOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  struct Case {
    int64_t batch, m, n, k;
    bool ta, tb, bcast;
  };
  const Case cases[] = {{1, 1, 1, 1, false, false, false},  {1, 17, 9, 33, false, false, false},
                        {3, 7, 5, 111, true, false, false},  {2, 13, 11, 4, false, true, false},
                        {4, 5, 3, 19, true, true, false},     {3, 6, 10, 7, false, false, true},
                        {2, 9, 4, 5, true, false, true},
                        // a few rows times a weight [N, K] (on CUDA in 16-bit types: ops/cuda/gemv.cu), K
                        // one warp's step, several, with a tail, K split over 1 to 8 warps, and not a multiple of 8 (cuBLAS);
                        // a warp's row in several passes (the next pass loaded ahead), the last one partial
                        {1, 1, 4096, 1024, false, true, true}, {1, 3, 37, 1000, false, true, true},
                        {2, 4, 100, 264, false, true, true},   {1, 8, 5, 8, false, true, true},
                        {1, 5, 129, 4104, false, true, true},  {1, 2, 9, 33, false, true, true},
                        {1, 9, 17, 64, false, true, true},     {1, 6, 70, 1032, false, true, true},
                        {1, 1, 4500, 4104, false, true, true}, {1, 3, 4300, 2312, false, true, true}};
  for (DType dt : test::float_dtypes(dev)) {
    for (const Case& c : cases) {
      const Tensor a = Tensor::randn(c.ta ? Shape{c.batch, c.k, c.m} : Shape{c.batch, c.m, c.k}, dt, dev, gen);
      Shape bs = c.tb ? Shape{c.n, c.k} : Shape{c.k, c.n};
      if (!c.bcast) bs.insert(bs.begin(), c.batch);
      const Tensor b = Tensor::randn(bs, dt, dev, gen);
      const auto ref = oracle::matmul(a.to_f64_vector(), b.to_f64_vector(), c.batch, c.m, c.n, c.k, c.ta, c.tb, c.bcast);
      const Tensor out = ops::matmul(a, b, c.ta, c.tb);
      EXPECT_EQ(out.shape(), (Shape{c.batch, c.m, c.n}));
      // One rounding of an f32-accumulated dot product of k terms.
      const double tol = std::max(test::primitive_rtol(dt), 1e-6 * std::sqrt(double(c.k))) * 2;
      EXPECT_TRUE(close_l2(out, ref, tol)) << config_name(dev, dt) << " m" << c.m << " n" << c.n << " k" << c.k
                                           << " ta" << c.ta << " tb" << c.tb << " bcast" << c.bcast;
    }
    // A non-contiguous operand is made contiguous first.
    const Tensor at = Tensor::randn({8, 6}, dt, dev, gen).transpose(0, 1);  // [6, 8]
    const Tensor b = Tensor::randn({8, 3}, dt, dev, gen);
    EXPECT_TRUE(close_l2(ops::matmul(at, b), oracle::matmul(at.to_f64_vector(), b.to_f64_vector(), 1, 6, 3, 8, false,
                                                               false, false),
                         std::max(test::primitive_rtol(dt), 1e-6) * 2))
        << config_name(dev, dt);
  }
}

TEST_P(Ops, EmbeddingAndBackward) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  for (DType dt : test::float_dtypes(dev)) {
    for (DType it : {DType::i64, DType::i32}) {
      const int64_t v = 37, h = 13;
      const Tensor w = Tensor::randn({v, h}, dt, dev, gen);
      const Tensor ids = Tensor::randint({3, 11}, 0, v, it, dev, gen);
      const auto wv = w.to_f64_vector();
      const auto iv = ids.to_i64_vector();
      std::vector<double> ref(iv.size() * h);
      for (size_t i = 0; i < iv.size(); ++i)
        for (int64_t j = 0; j < h; ++j) ref[i * h + j] = wv[iv[i] * h + j];
      const Tensor e = ops::embedding(w, ids);
      EXPECT_EQ(e.shape(), (Shape{3, 11, h}));
      EXPECT_TRUE(close_elementwise(e, ref, 0.0, 0.0)) << config_name(dev, dt);  // a copy: exact
      const Tensor g = Tensor::randn({3, 11, h}, dt, dev, gen);
      const auto gv = g.to_f64_vector();
      std::vector<double> dref(v * h);
      for (size_t i = 0; i < iv.size(); ++i)
        for (int64_t j = 0; j < h; ++j) dref[iv[i] * h + j] += gv[i * h + j];
      EXPECT_TRUE(close_l2(ops::embedding_backward(g, ids, v), dref, test::primitive_rtol(dt) + 1e-6))
          << config_name(dev, dt);
    }
  }
}

// embedding_backward at the id distributions that decide its CUDA schedule: one id for every token
// (a run spanning every tile of sorted rows), a few runs of 5,000+ rows among singletons, uniform
// ids, and hidden sizes that are not a multiple of the 16-byte vector width.  The gradients are
// multiples of 1/4 in [-2, 2]: every partial sum of at most 40,000 of them is a multiple of 1/4 of
// at most 80,000 in magnitude (fewer than 2^24 quarters), exact in f32 in any order, so each element must equal the f64 sum rounded once to the
// dtype, exactly; a wrong, missing or extra row fails.  With random normal gradients (inexact
// sums) two calls must give the same bits: the sums' order is fixed.
TEST_P(Ops, EmbeddingBackwardSkewedIds) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  std::mt19937_64 rng(7);
  struct Case {
    const char* name;
    int64_t v, h;
    std::vector<int64_t> ids;
  };
  std::vector<Case> cases;
  cases.push_back({"one id", 50, 40, std::vector<int64_t>(12000, 17)});
  {
    std::vector<int64_t> ids;
    for (int64_t r = 0; r < 3; ++r) ids.insert(ids.end(), 5000 + 97 * r, 4000 - r * 1500);  // ids 4000, 2500, 1000
    for (int64_t i = 0; i < 3000; ++i) ids.push_back(1 + i);  // singletons, two of them in the long runs' ids
    std::shuffle(ids.begin(), ids.end(), rng);
    cases.push_back({"long runs and singletons", 4001, 24, ids});
  }
  for (int64_t h : {1, 13, 67, 1030, 4104}) {  // 1030: 9 column chunks of 128; 4104: 5 of 1024 bf16 columns
    std::vector<int64_t> ids;
    for (int64_t i = 0; i < 700; ++i) ids.push_back(i % 3 == 0 ? 5 : static_cast<int64_t>(rng() % 300));
    cases.push_back({"mixed", 300, h, ids});
  }
  {
    std::vector<int64_t> ids;
    for (int64_t i = 0; i < 5000; ++i) ids.push_back(static_cast<int64_t>(rng() % 20000));
    cases.push_back({"uniform", 20000, 16, ids});
  }
  if (dev.is_cuda()) {
    // Grids of whole waves, where CUDA takes tiles of 32 rows (16,896 rows of 512) and of 64
    // (33,792 rows of 1024; the cases above take 16 or 32): half the tokens one id, a quarter 16
    // ids, a quarter uniform over 50,000.
    for (const auto& [n, h] : {std::pair<int64_t, int64_t>{16896, 512}, {33792, 1024}}) {
      std::vector<int64_t> ids;
      for (int64_t i = 0; i < n; ++i) {
        const auto r = rng() % 4;
        ids.push_back(r < 2 ? 7 : r == 2 ? static_cast<int64_t>(rng() % 16) : static_cast<int64_t>(rng() % 50000));
      }
      cases.push_back({"skewed, large", 50000, h, ids});
    }
  }
  for (DType dt : test::float_dtypes(dev)) {
    for (const Case& c : cases) {
      const auto n = static_cast<int64_t>(c.ids.size());
      const Tensor ids = Tensor::from_i64(c.ids, {n}, DType::i64, dev);
      std::vector<double> gv(static_cast<size_t>(n * c.h)), ref(static_cast<size_t>(c.v * c.h));
      for (double& x : gv) x = static_cast<double>(static_cast<int64_t>(rng() % 17) - 8) / 4;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < c.h; ++j) ref[c.ids[i] * c.h + j] += gv[i * c.h + j];
      const Tensor g = Tensor::from_f64(gv, {n, c.h}, dt, dev);
      const Tensor out = ops::embedding_backward(g, ids, c.v);
      ASSERT_EQ(out.shape(), (Shape{c.v, c.h}));
      const auto ov = out.to_f64_vector(), rv = Tensor::from_f64(ref, {c.v, c.h}, dt).to_f64_vector();
      int64_t bad = 0, first = -1;
      for (size_t k = 0; k < rv.size(); ++k)
        if (ov[k] != rv[k]) ++bad, first = first < 0 ? static_cast<int64_t>(k) : first;
      EXPECT_EQ(bad, 0) << config_name(dev, dt) << " " << c.name << " h=" << c.h << ": first at row " << first / c.h
                        << " column " << first % c.h << ": " << (first < 0 ? 0.0 : ov[first]) << " vs "
                        << (first < 0 ? 0.0 : rv[first]);
      const Tensor gr = Tensor::randn({n, c.h}, dt, dev, gen);
      EXPECT_EQ(ops::embedding_backward(gr, ids, c.v).to_f64_vector(), ops::embedding_backward(gr, ids, c.v).to_f64_vector())
          << config_name(dev, dt) << " " << c.name << " h=" << c.h;
    }
  }
  // An out-of-range id among long runs is reported (on CUDA once the device is done) and the device
  // stays usable.
  std::vector<int64_t> ids(12000, 3);
  for (int64_t i = 0; i < 6000; ++i) ids[i * 2] = i % 5;
  ids[7001] = 5;
  const Tensor t = Tensor::from_i64(ids, {12000}, DType::i64, dev);
  EXPECT_ERROR(ops::embedding_backward(Tensor::zeros({12000, 8}, DType::f32, dev), t, 5),
               "op embedding_backward: argument 'ids'[7001] = 5 is out of range [0, 5)");
  ids[7001] = -2;
  EXPECT_ERROR(ops::embedding_backward(Tensor::zeros({12000, 8}, DType::f32, dev), Tensor::from_i64(ids, {12000}, DType::i32, dev), 5),
               "'ids'[7001] = -2 is out of range [0, 5)");
  if (dev.is_cuda()) {  // unchecked: the bad id's terms are left out, nothing throws
    std::vector<double> ones(12000 * 8, 1.0), ref(5 * 8, 0.0);
    for (int64_t i = 0; i < 12000; ++i)
      for (int64_t j = 0; j < 8 && i != 7001; ++j) ref[ids[i] * 8 + j] += 1.0;
    EXPECT_EQ(ops::embedding_backward(Tensor::from_f64(ones, {12000, 8}, DType::f32, dev), t, 5, false).to_f64_vector(), ref);
  }
  EXPECT_EQ(ops::sum(Tensor::full({4}, 1.0, DType::f32, dev)).item(), 4.0);
}

TEST_P(Ops, GatherScatterMaskAndCat) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  const Tensor x = Tensor::randn({6, 9}, DType::f32, dev, gen);
  const std::vector<int64_t> idx = {3, -100, 0, 8, -100, 5};
  const Tensor t = Tensor::from_i64(idx, {6}, DType::i64, dev);
  const auto xv = x.to_f64_vector();
  std::vector<double> g(6), mask(6);
  for (int i = 0; i < 6; ++i) g[i] = idx[i] < 0 ? 0.0 : xv[i * 9 + idx[i]], mask[i] = idx[i] < 0 ? 0 : 1;
  EXPECT_TRUE(close_elementwise(ops::gather_last(x, t, -100), g, 0, 0));
  EXPECT_TRUE(close_elementwise(ops::valid_mask(t, -100, DType::bf16), mask, 0, 0));
  const Tensor vals = Tensor::randn({6}, DType::f32, dev, gen);
  const auto vv = vals.to_f64_vector();
  std::vector<double> sc(6 * 9);
  for (int i = 0; i < 6; ++i)
    if (idx[i] >= 0) sc[i * 9 + idx[i]] = vv[i];
  EXPECT_TRUE(close_elementwise(ops::scatter_last(vals, t, 9, -100), sc, 0, 0));
  const Tensor c = ops::cat({x.narrow(1, 0, 2), x.narrow(1, 5, 4)}, 1);
  const auto cv = c.to_f64_vector();
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(cv[i * 6 + 1], xv[i * 9 + 1]);
    EXPECT_EQ(cv[i * 6 + 2], xv[i * 9 + 5]);
  }
  const auto m = ops::attention_mask(3, 5, true, 2, DType::f32, dev).to_f64_vector();
  // query 0 is at position 2: sees keys 1 and 2 with a window of 2.
  EXPECT_TRUE(std::isinf(m[0]));
  EXPECT_EQ(m[1], 0.0);
  EXPECT_EQ(m[2], 0.0);
  EXPECT_TRUE(std::isinf(m[3]));
  // Chunks of 2 (Llama 4): the queries at positions 2, 3, 4 see keys {2}, {2, 3}, {4}.
  const auto mc = ops::attention_mask(3, 5, true, 0, DType::f32, dev, 2).to_f64_vector();
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t j = 0; j < 5; ++j) {
      const bool visible = (i == 0 && j == 2) || (i == 1 && (j == 2 || j == 3)) || (i == 2 && j == 4);
      EXPECT_EQ(mc[static_cast<size_t>(i * 5 + j)] == 0.0, visible) << i << " " << j;
    }
  EXPECT_ERROR(ops::attention_mask(3, 5, true, 0, DType::f32, dev, -1), "chunk -1 < 0");
}

TEST_P(Ops, OutOfRangeIndicesThrowNamingTheOp) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const Tensor w = Tensor::zeros({10, 4}, DType::f32, dev);
  const std::vector<int64_t> bad = {1, 10, 2};
  const Tensor ids = Tensor::from_i64(bad, {3}, DType::i64, dev);
  try {
    ops::embedding(w, ids);
    FAIL() << "embedding accepted an out-of-range id";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("op embedding"), std::string::npos) << msg;
    EXPECT_NE(msg.find("= 10 is out of range [0, 10)"), std::string::npos) << msg;
  }
  EXPECT_THROW(ops::embedding_backward(Tensor::zeros({3, 4}, DType::f32, dev), ids, 10), Error);
  const std::vector<int64_t> neg = {-1, 0};
  const Tensor t = Tensor::from_i64(neg, {2}, DType::i64, dev);
  EXPECT_THROW(ops::gather_last(Tensor::zeros({2, 5}, DType::f32, dev), t, -100), Error);
  EXPECT_THROW(ops::scatter_last(Tensor::zeros({2}, DType::f32, dev), t, 5, -100), Error);
  // The device is still usable after a reported error.
  EXPECT_EQ(ops::sum(Tensor::full({4}, 1.0, DType::f32, dev)).item(), 4.0);
}

TEST_P(Ops, MismatchedArgumentsThrow) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const Tensor a = Tensor::zeros({2, 3}, DType::f32, dev), b = Tensor::zeros({2, 4}, DType::f32, dev);
  EXPECT_THROW(ops::add(a, b), Error);
  EXPECT_THROW(ops::add(a, a.to(DType::bf16)), Error);
  EXPECT_THROW(ops::matmul(a, a), Error);
  EXPECT_THROW(ops::exp(Tensor::zeros({2}, DType::i64, dev)), Error);
  EXPECT_THROW(ops::cat({a, b}, 0), Error);
  if (dev.is_cpu() && cuda_device_count() > 0) {
    EXPECT_THROW(ops::add(a, a.to(Device::cuda(0))), Error);
  }
  try {
    ops::matmul(a, b);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("op matmul: inner dimensions differ"), std::string::npos) << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, Ops, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cpu() ? std::string("cpu") : std::string("cuda"); });

// One pool of CPU threads (ops/threads.h): OpenBLAS runs on the OpenMP team, so a GEMM and the
// library's loops never keep two pools spin-waiting on the same cores.
TEST(ThreadPolicy, BlasRunsOnTheOpenMPTeam) {
  const ops::ThreadPolicy p = ops::thread_policy();
  EXPECT_EQ(p.blas_threading, "OpenMP") << ops::thread_policy_str(p);
  EXPECT_EQ(p.threads, omp_get_max_threads());
}

TEST(ThreadPolicy, SetNumThreadsSetsTheLoopsAndTheBlas) {
  const int before = omp_get_max_threads();
  ops::set_num_threads(1);
  EXPECT_EQ(ops::thread_policy().threads, 1);
  EXPECT_EQ(openblas_get_num_threads(), 1);
  auto gen = test_generator();
  const Tensor a = Tensor::randn({67, 129}, DType::f64, Device::cpu(), gen);
  const Tensor b = Tensor::randn({129, 33}, DType::f64, Device::cpu(), gen);
  const std::vector<double> one_thread = ops::matmul(a, b).to_f64_vector();
  ops::set_num_threads(before);
  EXPECT_EQ(ops::thread_policy().threads, before);
  EXPECT_TRUE(close_l2(ops::matmul(a, b), one_thread, 1e-14));
  EXPECT_THROW(ops::set_num_threads(0), Error);
}

}  // namespace
}  // namespace kcpp
