// Multi-scale deformable attention against the f64 oracle (tests/oracle_msda.h), errors against the
// magnitude of the terms.  Shapes: one level, 1 x 1 levels, odd sizes, levels that do not tile `value`
// (a gap), Q = 1, C = 1, 33, 130 (not multiples of 8, more than one register chunk on CUDA); locations
// uniform over [-0.3, 1.3] (outside the maps too), exactly on the borders (0, 1), on pixel centres and
// cell edges, on the fading band [-1, -1/2] pixels, far outside, and non-finite.  The oracle's own
// backward is checked by central differences.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/cuda_runtime.h"
#include "core/tensor.h"
#include "kcpp/kernel/types.h"
#include "msda.h"
#include "oracle_msda.h"
#include "test_util.h"
#include "tolerances.h"

namespace kcpp {
namespace {

using msda::MsdaParams;

#if KCPP_WITH_CUDA
inline const char* finish(const char* e) {
  if (!e) KCPP_CUDA_CHECK(cudaDeviceSynchronize());
  return e;
}
#define MSDA_CALL(dev, fn, p) ((dev).is_cuda() ? finish(fn##_cuda((p), ::kcpp::cuda::current_stream())) : fn##_cpu(p))
#else
#define MSDA_CALL(dev, fn, p) (fn##_cpu(p))
#endif

kernel::DType kdtype(DType t) {
  return t == DType::f32 ? kernel::DType::f32 : t == DType::bf16 ? kernel::DType::bf16 : kernel::DType::f16;
}

enum class Locs { Uniform, Edges };

struct Case {
  int64_t b, m, c, q, p;
  std::vector<std::pair<int64_t, int64_t>> levels;
  Locs locs;
  int64_t gap = 0;  // rows of value left between levels (and after the last)
};

struct Inputs {
  oracle::Msda o;
  Tensor value, shapes, starts, loc, attn, dout;
};

// Locations that sit on the sampling's special points: the borders, pixel centres (integer x, where
// floor changes cell), cell edges, the fading band before the first pixel, far outside, NaN / inf.
std::vector<double> edge_values(int64_t w) {
  const double W = static_cast<double>(w);
  return {0.0,
          1.0,
          0.5,
          0.5 / W,
          1.5 / W,
          1.0 - 0.5 / W,
          1.0 / W,
          -0.25 / W,
          -0.5 / W,
          -0.75 / W,
          1.0 + 0.25 / W,
          1.0 + 0.5 / W,
          1.0 + 0.75 / W,
          -0.3,
          1.3,
          7.0,
          -1e30,
          1e30,
          std::numeric_limits<double>::quiet_NaN(),
          std::numeric_limits<double>::infinity()};
}

Inputs make(const Case& k, DType dt, Device dev, Generator& gen) {
  Inputs in;
  oracle::Msda& o = in.o;
  o.batch = k.b, o.heads = k.m, o.channels = k.c, o.queries = k.q, o.points = k.p;
  o.levels = static_cast<int64_t>(k.levels.size());
  int64_t s = 0;
  for (auto [h, w] : k.levels) {
    o.shapes.push_back(h), o.shapes.push_back(w), o.starts.push_back(s);
    s += h * w + k.gap;
  }
  o.seq = s;
  const int64_t L = o.levels;
  in.value = Tensor::randn({k.b, s, k.m, k.c}, dt, dev, gen);
  in.loc = Tensor::uniform({k.b, k.q, k.m, L, k.p, 2}, dt, Device::cpu(), gen, -0.3, 1.3);
  if (k.locs == Locs::Edges) {
    // Every other sample (x and y independently) from the level's edge values.
    std::vector<double> v = in.loc.to_f64_vector();
    const Tensor pick = Tensor::randint({static_cast<int64_t>(v.size())}, 0, 40, DType::i64, Device::cpu(), gen);
    const std::vector<double> pk = pick.to_f64_vector();
    for (size_t i = 0; i < v.size(); ++i) {
      const int64_t l = static_cast<int64_t>(i / 2) / k.p % L;
      const auto ev = edge_values(i % 2 == 0 ? k.levels[l].second : k.levels[l].first);
      const auto j = static_cast<size_t>(pk[i]);
      if (j < ev.size()) v[i] = ev[j];
    }
    in.loc = Tensor::from_f64(v, in.loc.shape(), dt);
  }
  // A pixel coordinate x = loc W - 1/2 within rounding of an integer (but not exactly one) would put the
  // f32 kernel and the f64 oracle on either side of the kink in the slope: such points are moved away.
  // Exact integers stay (both sides agree on them: the edge values are exact in every dtype).
  {
    std::vector<double> v = in.loc.to_f64_vector();
    for (size_t i = 0; i < v.size(); ++i) {
      const int64_t l = static_cast<int64_t>(i / 2) / k.p % L;
      const double n = static_cast<double>(i % 2 == 0 ? k.levels[l].second : k.levels[l].first);
      const double x = v[i] * n - 0.5, off = std::fabs(x - std::round(x));
      if (std::isfinite(x) && off > 0 && off < 1e-4) v[i] = 0.37;
    }
    in.loc = Tensor::from_f64(v, in.loc.shape(), dt);
  }
  in.loc = in.loc.to(dev);
  in.attn = Tensor::uniform({k.b, k.q, k.m, L, k.p}, dt, dev, gen, -0.5, 1.0);
  in.dout = Tensor::randn({k.b, k.q, k.m * k.c}, dt, dev, gen);
  in.shapes = Tensor::from_i64(o.shapes, {L, 2}, DType::i64, dev);
  in.starts = Tensor::from_i64(o.starts, {L}, DType::i64, dev);
  o.value = in.value.to_f64_vector(), o.loc = in.loc.to_f64_vector(), o.attn = in.attn.to_f64_vector();
  return in;
}

MsdaParams params_of(const Inputs& in, DType dt) {
  MsdaParams p;
  p.dtype = kdtype(dt);
  p.batch = in.o.batch, p.seq = in.o.seq, p.heads = in.o.heads, p.channels = in.o.channels;
  p.queries = in.o.queries, p.levels = in.o.levels, p.points = in.o.points;
  p.value = in.value.data();
  p.spatial_shapes = static_cast<const int64_t*>(in.shapes.data());
  p.level_start = static_cast<const int64_t*>(in.starts.data());
  p.loc = in.loc.data(), p.attn = in.attn.data();
  return p;
}

struct Grads {
  Tensor out, dvalue, dloc, dattn, workspace;
};

Grads run(const Inputs& in, DType dt, Device dev) {
  Grads g;
  MsdaParams p = params_of(in, dt);
  g.out = Tensor::full({p.batch, p.queries, p.heads * p.channels}, std::nan(""), dt, dev);
  p.out = g.out.data();
  if (const char* e = MSDA_CALL(dev, msda::msda_forward, p)) throw Error(e);
  g.dvalue = Tensor::full(in.value.shape(), std::nan(""), dt, dev);
  g.dloc = Tensor::full(in.loc.shape(), std::nan(""), dt, dev);
  g.dattn = Tensor::full(in.attn.shape(), std::nan(""), dt, dev);
  p.dout = in.dout.data(), p.dvalue = g.dvalue.data(), p.dloc = g.dloc.data(), p.dattn = g.dattn.data();
  if (const size_t bytes = msda::msda_workspace_bytes(p); bytes > 0 && dev.is_cuda()) {
    g.workspace = Tensor::empty({static_cast<int64_t>(bytes / 4)}, DType::f32, dev);
    p.workspace = static_cast<float*>(g.workspace.data());
  }
  if (const char* e = MSDA_CALL(dev, msda::msda_backward, p)) throw Error(e);
  return g;
}

double bound(DType dt, const oracle::V& mag) {
  return test::unit_roundoff(dt) + 32 * test::unit_roundoff(DType::f32) + test::underflow_allowance(dt, mag);
}

void expect_close(const Tensor& got, const oracle::V& ref, const oracle::V& mag, DType dt, const std::string& what) {
  const double e = test::mag_error(got, ref, mag);
  EXPECT_LE(e, bound(dt, mag)) << what << " (error / magnitude " << e << ")";
}

const std::vector<Case>& cases() {
  static const std::vector<Case> c = {
      {1, 1, 1, 1, 1, {{1, 1}}, Locs::Uniform},
      {1, 1, 1, 7, 3, {{1, 1}}, Locs::Edges},
      {2, 3, 5, 4, 2, {{3, 5}, {1, 1}, {2, 7}}, Locs::Uniform},
      {2, 3, 5, 9, 2, {{3, 5}, {1, 1}, {2, 7}}, Locs::Edges},
      {1, 2, 33, 1, 4, {{8, 8}, {4, 4}, {2, 2}, {1, 1}}, Locs::Edges},
      {2, 8, 32, 50, 4, {{10, 13}, {5, 7}, {3, 4}, {2, 2}}, Locs::Uniform},
      {1, 2, 130, 3, 2, {{4, 3}, {2, 5}}, Locs::Edges},
      {2, 2, 7, 6, 3, {{3, 4}, {2, 2}}, Locs::Uniform, 3},
      {1, 1, 3, 5, 1, {{1, 9}}, Locs::Edges},
  };
  return c;
}

class Msda : public ::testing::TestWithParam<Device> {};

TEST_P(Msda, MatchesTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (const Case& k : cases()) {
      std::string cfg = test::config_name(dev, dt) + " b=" + std::to_string(k.b) + " m=" + std::to_string(k.m) +
                        " c=" + std::to_string(k.c) + " q=" + std::to_string(k.q) + " p=" + std::to_string(k.p) +
                        " levels=" + std::to_string(k.levels.size()) + (k.locs == Locs::Edges ? " edges" : " uniform");
      const Inputs in = make(k, dt, dev, gen);
      const Grads g = run(in, dt, dev);
      expect_close(g.out, oracle::msda_forward(in.o), oracle::msda_forward(in.o, true), dt, cfg + " out");
      const auto dout = in.dout.to_f64_vector();
      const oracle::MsdaGrad r = oracle::msda_backward(in.o, dout), m = oracle::msda_backward(in.o, dout, true);
      expect_close(g.dvalue, r.dvalue, m.dvalue, dt, cfg + " dvalue");
      expect_close(g.dloc, r.dloc, m.dloc, dt, cfg + " dsampling_locations");
      expect_close(g.dattn, r.dattn, m.dattn, dt, cfg + " dattention_weights");
    }
}

// Samples outside the maps (and non-finite ones) give exactly 0 and zero gradients; a 1 x 1 map at its
// centre is the value itself.  (At x = -1 exactly, loc = -1/(2W), the sample is 0 but its slope is not.)
TEST_P(Msda, OutsideSamplesAreZeroAndTheCentreIsExact) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  Inputs in = make({1, 1, 4, 6, 1, {{1, 1}}, Locs::Uniform}, DType::f32, dev, gen);
  const std::vector<double> xs = {0.5, -0.75, 1.5, -1e30, std::numeric_limits<double>::quiet_NaN(), 0.5};
  const std::vector<double> ys = {0.5, 0.5, 0.5, 0.5, 0.5, 1.5};
  std::vector<double> loc;
  for (size_t i = 0; i < xs.size(); ++i) loc.push_back(xs[i]), loc.push_back(ys[i]);
  in.loc = Tensor::from_f64(loc, in.loc.shape(), DType::f32, dev);
  in.attn = Tensor::full(in.attn.shape(), 1.0, DType::f32, dev);
  const Grads g = run(in, DType::f32, dev);
  const auto out = g.out.to_f64_vector(), v = in.value.to_f64_vector(), dl = g.dloc.to_f64_vector(), da = g.dattn.to_f64_vector();
  for (int64_t c = 0; c < 4; ++c) EXPECT_EQ(out[static_cast<size_t>(c)], v[static_cast<size_t>(c)]) << "centre, channel " << c;
  for (size_t q = 1; q < 6; ++q) {
    for (int64_t c = 0; c < 4; ++c) EXPECT_EQ(out[q * 4 + static_cast<size_t>(c)], 0.0) << "query " << q;
    EXPECT_EQ(da[q], 0.0) << "query " << q;
    EXPECT_EQ(dl[2 * q], 0.0) << "query " << q;
    EXPECT_EQ(dl[2 * q + 1], 0.0) << "query " << q;
  }
}

TEST_P(Msda, BackwardIsReproducibleOnTheCpu) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  if (dev.is_cuda()) GTEST_SKIP() << "the CUDA dvalue is summed with float atomics (documented as not reproducible)";
  const Case k{2, 4, 16, 200, 4, {{12, 9}, {6, 5}, {3, 3}}, Locs::Uniform};
  Generator g1 = test::test_generator(), g2 = test::test_generator();
  const Inputs a = make(k, DType::bf16, dev, g1), b = make(k, DType::bf16, dev, g2);
  const Grads ga = run(a, DType::bf16, dev), gb = run(b, DType::bf16, dev);
  EXPECT_EQ(ga.dvalue.to_f64_vector(), gb.dvalue.to_f64_vector());
  EXPECT_EQ(ga.dloc.to_f64_vector(), gb.dloc.to_f64_vector());
}

TEST_P(Msda, BadParamsAreRefusedByName) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const Inputs in = make({1, 2, 3, 4, 2, {{2, 3}, {1, 2}}, Locs::Uniform}, DType::f32, dev, gen);
  Grads g = run(in, DType::f32, dev);
  MsdaParams p = params_of(in, DType::f32);
  p.out = g.out.data();
  MsdaParams q = p;
  q.out = nullptr;
  EXPECT_TRUE(test::kernel_error_contains(MSDA_CALL(dev, msda::msda_forward, q), "'out' must not be null"));
  q = p;
  q.levels = 0;
  EXPECT_TRUE(test::kernel_error_contains(MSDA_CALL(dev, msda::msda_forward, q), "at least one level"));
  q = p;
  q.dout = in.dout.data(), q.dloc = g.dloc.data(), q.dattn = g.dattn.data();
  EXPECT_TRUE(test::kernel_error_contains(MSDA_CALL(dev, msda::msda_backward, q), "'dvalue' must not be null"));
  if (dev.is_cpu()) {  // the index tensors' contents: checked on the CPU only (CUDA reads them on the device)
    const std::vector<int64_t> big = {2, 3, 2, 2}, zero = {2, 3, 0, 2}, late = {0, 7};
    const Tensor tb = Tensor::from_i64(big, {2, 2}), tz = Tensor::from_i64(zero, {2, 2}), tl = Tensor::from_i64(late, {2});
    q = p;
    q.spatial_shapes = static_cast<const int64_t*>(tb.data());
    EXPECT_TRUE(test::kernel_error_contains(MSDA_CALL(dev, msda::msda_forward, q), "level 1 (2 x 2 from row 6"));
    q = p;
    q.spatial_shapes = static_cast<const int64_t*>(tz.data());
    EXPECT_TRUE(test::kernel_error_contains(MSDA_CALL(dev, msda::msda_forward, q), "level 1 of 'value_spatial_shapes' is 0 x 2"));
    q = p;
    q.level_start = static_cast<const int64_t*>(tl.data());
    EXPECT_TRUE(test::kernel_error_contains(MSDA_CALL(dev, msda::msda_forward, q), "does not fit in the 8 rows"));
  }
}

// The oracle's gradients are those of its forward: central differences of sum(dout * out) in f64, at
// locations away from the pixel centres where the slope jumps.
TEST(MsdaOracle, BackwardMatchesFiniteDifferences) {
  Generator gen = test::test_generator();
  Inputs in = make({2, 2, 3, 3, 2, {{3, 4}, {1, 1}, {2, 3}}, Locs::Uniform}, DType::f64, Device::cpu(), gen);
  oracle::Msda& o = in.o;
  const auto dout = in.dout.to_f64_vector();
  auto loss = [&](const oracle::Msda& x) {
    const auto out = oracle::msda_forward(x);
    double s = 0;
    for (size_t i = 0; i < out.size(); ++i) s += out[i] * dout[i];
    return s;
  };
  const oracle::MsdaGrad g = oracle::msda_backward(o, dout);
  const double h = 1e-6;
  auto check = [&](oracle::V& x, const oracle::V& grad, const char* what, bool is_loc) {
    for (size_t i = 0; i < x.size(); ++i) {
      if (is_loc) {  // skip a point within h of a kink (integer pixel coordinate)
        const int64_t l = static_cast<int64_t>(i / 2) / o.points % o.levels;
        const double px = x[i] * static_cast<double>(o.shapes[2 * l + (i % 2 == 0 ? 1 : 0)]) - 0.5;
        if (std::fabs(px - std::round(px)) < 1e-4) continue;
      }
      const double keep = x[i];
      x[i] = keep + h;
      const double up = loss(o);
      x[i] = keep - h;
      const double down = loss(o);
      x[i] = keep;
      EXPECT_NEAR(grad[i], (up - down) / (2 * h), 1e-6 * (1 + std::fabs(grad[i]))) << what << " [" << i << "]";
    }
  };
  check(o.value, g.dvalue, "dvalue", false);
  check(o.loc, g.dloc, "dloc", true);
  check(o.attn, g.dattn, "dattn", false);
}

INSTANTIATE_TEST_SUITE_P(Devices, Msda, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cpu() ? std::string("cpu") : std::string("cuda"); });

}  // namespace
}  // namespace kcpp
