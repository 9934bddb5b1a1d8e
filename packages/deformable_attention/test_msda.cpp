// Multi-scale deformable attention against the f64 oracle (tests/oracle_msda.h), errors against the
// magnitude of the terms (in L2 over each output, and the largest error against the largest
// magnitude).  On CUDA both kernel sets run every case: the grouped kernels (where they take the shape;
// the lane-per-channel ones otherwise) and the lane-per-channel ones.  Shapes: one level, 1 x 1 levels,
// odd sizes, levels that do not tile `value` (a gap), Q = 1, C = 1, 3, 5, 7 (scalar lanes), 4, 8, 16,
// 24, 32, 40, 64, 128, 256 (16-byte lanes where C is a multiple of 16 bytes, in groups of 1 to 32
// lanes, some with idle lanes), 33, 130 (not multiples of 8, more than one register chunk of the
// lane-per-channel kernels), L * P = 33 and 36 (more than one chunk of 32 samples);
// locations uniform over [-0.3, 1.3] (outside the maps too), exactly on the borders (0, 1), on pixel
// centres and cell edges, on the fading band [-1, -1/2] pixels, far outside, and non-finite.  Tensors
// one element off 16-byte alignment take the grouped kernels' scalar lanes.  The oracle's own backward
// is checked by central differences.
#include <algorithm>
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

using Kernels = msda::MsdaCudaKernels;

// Where a case runs: the CPU, or CUDA with the grouped kernels (Grouped: where they take the call, the
// lane-per-channel ones otherwise) or the lane-per-channel ones (Legacy).
struct Backend {
  Device dev;
  Kernels kernels = Kernels::Grouped;
};

#if KCPP_WITH_CUDA
inline const char* finish(const char* e) {
  if (!e) KCPP_CUDA_CHECK(cudaDeviceSynchronize());
  return e;
}
Kernels kernels_for(const Backend& be, const MsdaParams& p, bool backward) {
  if (be.kernels == Kernels::Grouped && msda::msda_grouped_unsupported(p, backward)) return Kernels::Legacy;
  return be.kernels;
}
const char* forward(const Backend& be, const MsdaParams& p) {
  if (!be.dev.is_cuda()) return msda::msda_forward_cpu(p);
  return finish(msda::msda_forward_cuda(p, ::kcpp::cuda::current_stream(), kernels_for(be, p, false)));
}
const char* backward(const Backend& be, const MsdaParams& p) {
  if (!be.dev.is_cuda()) return msda::msda_backward_cpu(p);
  return finish(msda::msda_backward_cuda(p, ::kcpp::cuda::current_stream(), kernels_for(be, p, true)));
}
#else
const char* forward(const Backend&, const MsdaParams& p) { return msda::msda_forward_cpu(p); }
const char* backward(const Backend&, const MsdaParams& p) { return msda::msda_backward_cpu(p); }
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

// A tensor of `shape` one element past an aligned allocation (so not 16-byte aligned), holding `src`
// when given, else NaN.
Tensor off_by_one(const Shape& shape, DType dt, Device dev, const Tensor* src = nullptr) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const Tensor t = Tensor::full({n + 1}, std::nan(""), dt, dev).narrow(0, 1, n).view(shape);
  if (src) t.copy_(*src);
  return t;
}

// Forward, then backward, on `be`; with `misaligned`, value, dout and every output one element off
// 16-byte alignment.
Grads run(const Inputs& in, DType dt, const Backend& be, bool misaligned = false) {
  const Device dev = be.dev;
  Grads g;
  MsdaParams p = params_of(in, dt);
  auto out_like = [&](const Shape& shape) {
    return misaligned ? off_by_one(shape, dt, dev) : Tensor::full(shape, std::nan(""), dt, dev);
  };
  const Tensor value = misaligned ? off_by_one(in.value.shape(), dt, dev, &in.value) : in.value;
  const Tensor dout = misaligned ? off_by_one(in.dout.shape(), dt, dev, &in.dout) : in.dout;
  p.value = value.data();
  g.out = out_like({p.batch, p.queries, p.heads * p.channels});
  p.out = g.out.data();
  if (const char* e = forward(be, p)) throw Error(e);
  g.dvalue = out_like(in.value.shape());
  g.dloc = out_like(in.loc.shape());
  g.dattn = out_like(in.attn.shape());
  p.dout = dout.data(), p.dvalue = g.dvalue.data(), p.dloc = g.dloc.data(), p.dattn = g.dattn.data();
  if (const size_t bytes = msda::msda_workspace_bytes(p); bytes > 0 && dev.is_cuda()) {
    g.workspace = Tensor::empty({static_cast<int64_t>(bytes / 4)}, DType::f32, dev);
    p.workspace = static_cast<float*>(g.workspace.data());
  }
  if (const char* e = backward(be, p)) throw Error(e);
  return g;
}

double bound(DType dt, const oracle::V& mag) {
  return test::unit_roundoff(dt) + 32 * test::unit_roundoff(DType::f32) + test::underflow_allowance(dt, mag);
}

// In L2 against the magnitudes, and in the largest error against the largest magnitude (so that one
// wrong element among many is not lost in the norm), both at the bound of one rounding to the dtype plus
// f32 sums, plus what the f32 rounding of the sampling positions moves the weights by (`moved`,
// oracle::Terms::PositionRounding: it dominates where a sample lies just inside a map's edge, whose
// in-range weights, and so the result, are small).
void expect_close(const Tensor& got, const oracle::V& ref, const oracle::V& mag, const oracle::V& moved, DType dt,
                  const std::string& what) {
  const double u = test::unit_roundoff(dt), u32 = test::unit_roundoff(DType::f32);
  double mag2 = 0, moved2 = 0, top_moved = 0;
  for (size_t i = 0; i < mag.size(); ++i)
    mag2 += mag[i] * mag[i], moved2 += moved[i] * moved[i], top_moved = std::max(top_moved, moved[i]);
  const double e = test::mag_error(got, ref, mag);  // relative to |mag| (absolute where mag is all 0)
  const double position = u32 * (mag2 > 0 ? std::sqrt(moved2 / mag2) : std::sqrt(moved2));
  EXPECT_LE(e, bound(dt, mag) + position) << what << " (error / magnitude " << e << ", of which the positions' rounding may be "
                                          << position << ")";
  const std::vector<double> o = got.to_f64_vector();
  double worst = 0, top = 0;
  size_t at = 0;
  for (size_t i = 0; i < o.size(); ++i) {
    top = std::max(top, mag[i]);
    const double d = std::isnan(ref[i]) ? (std::isnan(o[i]) ? 0.0 : INFINITY) : std::fabs(o[i] - ref[i]);
    if (!(d <= worst)) worst = d, at = i;
  }
  const double eta = 2 * test::underflow_allowance(dt, {1.0});
  EXPECT_LE(worst, 4 * (u + 32 * u32) * top + u32 * top_moved + eta)
      << what << ": the largest error " << worst << " at [" << at << "] (" << (o.empty() ? 0.0 : o[at]) << " against "
      << (o.empty() ? 0.0 : ref[at]) << "), the largest magnitude " << top << " (ratio " << worst / top << ")";
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
      // The grouped kernels' lane layouts: C / V lanes a sample in groups of 1 to 32, idle lanes (24, 40),
      // more than one chunk of 32 samples (L * P = 36, 33), a gap between levels.
      {2, 3, 4, 5, 4, {{7, 9}, {4, 5}}, Locs::Uniform},
      {1, 2, 8, 7, 4, {{5, 11}, {3, 6}, {2, 3}, {1, 1}}, Locs::Edges},
      {2, 2, 16, 9, 3, {{6, 7}, {3, 4}}, Locs::Edges},
      {1, 4, 32, 13, 4, {{9, 14}, {5, 7}, {3, 4}, {2, 2}}, Locs::Edges},
      {2, 2, 32, 6, 3, {{3, 4}, {2, 2}}, Locs::Uniform, 3},
      {2, 3, 24, 6, 2, {{5, 6}}, Locs::Uniform},
      {1, 3, 24, 5, 3, {{4, 5}}, Locs::Edges},
      {1, 2, 40, 5, 3, {{4, 7}, {2, 3}}, Locs::Edges},
      {1, 2, 64, 11, 2, {{6, 5}, {3, 3}}, Locs::Edges},
      {1, 1, 128, 3, 2, {{3, 5}, {2, 2}}, Locs::Edges},
      {1, 1, 256, 2, 1, {{3, 3}}, Locs::Uniform},
      {2, 2, 16, 5, 12, {{5, 6}, {3, 3}, {2, 2}}, Locs::Edges},
      {1, 3, 8, 4, 11, {{4, 4}, {3, 5}, {1, 2}}, Locs::Uniform},
  };
  return c;
}

std::string case_name(const Case& k) {
  return " b=" + std::to_string(k.b) + " m=" + std::to_string(k.m) + " c=" + std::to_string(k.c) + " q=" + std::to_string(k.q) +
         " p=" + std::to_string(k.p) + " levels=" + std::to_string(k.levels.size()) + (k.locs == Locs::Edges ? " edges" : " uniform");
}

void expect_matches_oracle(const Inputs& in, const Grads& g, DType dt, const std::string& cfg) {
  using oracle::Terms;
  expect_close(g.out, oracle::msda_forward(in.o), oracle::msda_forward(in.o, Terms::Magnitude),
               oracle::msda_forward(in.o, Terms::PositionRounding), dt, cfg + " out");
  const auto dout = in.dout.to_f64_vector();
  const oracle::MsdaGrad r = oracle::msda_backward(in.o, dout), m = oracle::msda_backward(in.o, dout, Terms::Magnitude),
                         pr = oracle::msda_backward(in.o, dout, Terms::PositionRounding);
  expect_close(g.dvalue, r.dvalue, m.dvalue, pr.dvalue, dt, cfg + " dvalue");
  expect_close(g.dloc, r.dloc, m.dloc, pr.dloc, dt, cfg + " dsampling_locations");
  expect_close(g.dattn, r.dattn, m.dattn, pr.dattn, dt, cfg + " dattention_weights");
}

std::string backend_name(const Backend& be) {
  if (be.dev.is_cpu()) return "cpu";
  return be.kernels == Kernels::Legacy ? "cuda_legacy" : "cuda";
}

class Msda : public ::testing::TestWithParam<Backend> {};

TEST_P(Msda, MatchesTheOracle) {
  const Backend be = GetParam();
  const Device dev = be.dev;
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (const Case& k : cases()) {
      const std::string cfg = backend_name(be) + " " + test::config_name(dev, dt) + case_name(k);
      const Inputs in = make(k, dt, dev, gen);
      expect_matches_oracle(in, run(in, dt, be), dt, cfg);
    }
}

// value, dout and the outputs one element off 16-byte alignment: the grouped kernels take them with
// scalar lanes (16-byte lanes when aligned).
TEST_P(Msda, MisalignedTensorsMatchTheOracle) {
  const Backend be = GetParam();
  const Device dev = be.dev;
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (const Case& k : {Case{2, 3, 32, 7, 3, {{5, 6}, {3, 3}}, Locs::Edges}, Case{1, 2, 16, 9, 4, {{4, 9}, {2, 3}}, Locs::Uniform}}) {
      const std::string cfg = backend_name(be) + " " + test::config_name(dev, dt) + case_name(k) + " misaligned";
      const Inputs in = make(k, dt, dev, gen);
      expect_matches_oracle(in, run(in, dt, be, true), dt, cfg);
    }
}

// Samples outside the maps (and non-finite ones) give exactly 0 and zero gradients; a 1 x 1 map at its
// centre is the value itself.  (At x = -1 exactly, loc = -1/(2W), the sample is 0 but its slope is not.)
TEST_P(Msda, OutsideSamplesAreZeroAndTheCentreIsExact) {
  const Backend be = GetParam();
  const Device dev = be.dev;
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  for (int64_t c : {4, 5}) {  // 16-byte lanes and scalar ones on CUDA
    Inputs in = make({1, 1, c, 6, 1, {{1, 1}}, Locs::Uniform}, DType::f32, dev, gen);
    const std::vector<double> xs = {0.5, -0.75, 1.5, -1e30, std::numeric_limits<double>::quiet_NaN(), 0.5};
    const std::vector<double> ys = {0.5, 0.5, 0.5, 0.5, 0.5, 1.5};
    std::vector<double> loc;
    for (size_t i = 0; i < xs.size(); ++i) loc.push_back(xs[i]), loc.push_back(ys[i]);
    in.loc = Tensor::from_f64(loc, in.loc.shape(), DType::f32, dev);
    in.attn = Tensor::full(in.attn.shape(), 1.0, DType::f32, dev);
    const Grads g = run(in, DType::f32, be);
    const auto out = g.out.to_f64_vector(), v = in.value.to_f64_vector(), dl = g.dloc.to_f64_vector(), da = g.dattn.to_f64_vector();
    const size_t C = static_cast<size_t>(c);
    for (size_t ch = 0; ch < C; ++ch) EXPECT_EQ(out[ch], v[ch]) << "C " << c << ", centre, channel " << ch;
    for (size_t q = 1; q < 6; ++q) {
      for (size_t ch = 0; ch < C; ++ch) EXPECT_EQ(out[q * C + ch], 0.0) << "C " << c << ", query " << q;
      EXPECT_EQ(da[q], 0.0) << "C " << c << ", query " << q;
      EXPECT_EQ(dl[2 * q], 0.0) << "C " << c << ", query " << q;
      EXPECT_EQ(dl[2 * q + 1], 0.0) << "C " << c << ", query " << q;
    }
  }
}

TEST_P(Msda, BackwardIsReproducibleOnTheCpu) {
  const Backend be = GetParam();
  const Device dev = be.dev;
  KCPP_REQUIRE_DEVICE(dev);
  if (dev.is_cuda()) GTEST_SKIP() << "the CUDA dvalue is summed with float atomics (documented as not reproducible)";
  const Case k{2, 4, 16, 200, 4, {{12, 9}, {6, 5}, {3, 3}}, Locs::Uniform};
  Generator g1 = test::test_generator(), g2 = test::test_generator();
  const Inputs a = make(k, DType::bf16, dev, g1), b = make(k, DType::bf16, dev, g2);
  const Grads ga = run(a, DType::bf16, be), gb = run(b, DType::bf16, be);
  EXPECT_EQ(ga.dvalue.to_f64_vector(), gb.dvalue.to_f64_vector());
  EXPECT_EQ(ga.dloc.to_f64_vector(), gb.dloc.to_f64_vector());
}

TEST_P(Msda, BadParamsAreRefusedByName) {
  const Backend be = GetParam();
  const Device dev = be.dev;
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const Inputs in = make({1, 2, 3, 4, 2, {{2, 3}, {1, 2}}, Locs::Uniform}, DType::f32, dev, gen);
  Grads g = run(in, DType::f32, be);
  MsdaParams p = params_of(in, DType::f32);
  p.out = g.out.data();
  MsdaParams q = p;
  q.out = nullptr;
  EXPECT_TRUE(test::kernel_error_contains(forward(be, q), "'out' must not be null"));
  q = p;
  q.levels = 0;
  EXPECT_TRUE(test::kernel_error_contains(forward(be, q), "at least one level"));
  q = p;
  q.dout = in.dout.data(), q.dloc = g.dloc.data(), q.dattn = g.dattn.data();
  EXPECT_TRUE(test::kernel_error_contains(backward(be, q), "'dvalue' must not be null"));
  if (dev.is_cpu()) {  // the index tensors' contents: checked on the CPU only (CUDA reads them on the device)
    const std::vector<int64_t> big = {2, 3, 2, 2}, zero = {2, 3, 0, 2}, late = {0, 7};
    const Tensor tb = Tensor::from_i64(big, {2, 2}), tz = Tensor::from_i64(zero, {2, 2}), tl = Tensor::from_i64(late, {2});
    q = p;
    q.spatial_shapes = static_cast<const int64_t*>(tb.data());
    EXPECT_TRUE(test::kernel_error_contains(forward(be, q), "level 1 (2 x 2 from row 6"));
    q = p;
    q.spatial_shapes = static_cast<const int64_t*>(tz.data());
    EXPECT_TRUE(test::kernel_error_contains(forward(be, q), "level 1 of 'value_spatial_shapes' is 0 x 2"));
    q = p;
    q.level_start = static_cast<const int64_t*>(tl.data());
    EXPECT_TRUE(test::kernel_error_contains(forward(be, q), "does not fit in the 8 rows"));
  }
#if KCPP_WITH_CUDA
  if (dev.is_cuda()) {  // the grouped kernels asked for where they do not take the call
    q = p;
    q.channels = 132;  // f32: 33 lanes of 4 channels
    EXPECT_TRUE(test::kernel_error_contains(msda::msda_forward_cuda(q, ::kcpp::cuda::current_stream(), Kernels::Grouped),
                                            "the grouped kernels do not take this call: more channels a head than 32 lanes"));
  }
#endif
}

#if KCPP_WITH_CUDA
// Which lanes the grouped kernels choose (host logic only, no device needed; the pointers are never
// read): 16-byte lanes for Deformable DETR's shapes when aligned and C a multiple of 16 bytes, scalar
// lanes otherwise, none beyond 32 lanes.
TEST(MsdaGrouped, LanesForTheShapes) {
  alignas(16) static char buf[64];
  MsdaParams p;
  p.batch = 8, p.seq = 22223, p.heads = 8, p.queries = 22223, p.levels = 4, p.points = 4;
  p.value = p.loc = p.attn = p.dout = buf;
  p.out = p.dvalue = p.dloc = p.dattn = buf;
  p.workspace = reinterpret_cast<float*>(buf);
  for (auto [dt, size] : {std::pair{kernel::DType::f32, 4}, {kernel::DType::bf16, 2}, {kernel::DType::f16, 2}}) {
    p.dtype = dt;
    const int full = 16 / size;
    for (int64_t c : {8, 16, 32, 64}) {
      p.channels = c;
      const int want = c % full == 0 ? full : 1;
      EXPECT_EQ(msda::msda_grouped_vector(p, false), want) << "forward, C " << c << ", " << size << "-byte elements";
      EXPECT_EQ(msda::msda_grouped_vector(p, true), want) << "backward, C " << c << ", " << size << "-byte elements";
    }
    p.channels = 32;
    p.value = buf + size;  // off 16-byte alignment
    EXPECT_EQ(msda::msda_grouped_vector(p, false), 1);
    p.value = buf;
    p.dout = buf + size;
    EXPECT_EQ(msda::msda_grouped_vector(p, true), 1);
    EXPECT_EQ(msda::msda_grouped_vector(p, false), full);
    p.dout = buf;
    p.channels = 32 * full + full;
    EXPECT_EQ(msda::msda_grouped_vector(p, false), 0);
    EXPECT_NE(msda::msda_grouped_unsupported(p, false), nullptr);
    p.channels = 33;
    EXPECT_EQ(msda::msda_grouped_vector(p, false), 0);
    p.channels = 31;
    EXPECT_EQ(msda::msda_grouped_vector(p, false), 1);
  }
  p.channels = 32, p.seq = int64_t{1} << 27;
  EXPECT_NE(msda::msda_grouped_unsupported(p, false), nullptr);
}
#endif

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

INSTANTIATE_TEST_SUITE_P(Devices, Msda,
                         ::testing::Values(Backend{Device::cpu()}, Backend{Device::cuda(0), Kernels::Grouped},
                                           Backend{Device::cuda(0), Kernels::Legacy}),
                         [](const auto& info) { return backend_name(info.param); });

}  // namespace
}  // namespace kcpp
