// The selective scan and its decoding step against the f64 oracle (tests/oracle_mamba.h), errors measured
// against the magnitude of the terms (mamba_bound: one rounding to the dtype plus 32 units of f32).
// Shapes: L = 1, odd L, one short of a chunk of saved states (255), exactly one (256), one past it,
// several chunks; N = 1, 3, 4, 16; groups; channels beyond one CPU block (128) and one CUDA block, and
// enough of them that the CUDA blocks take several channels a warp; every option on and off; strided
// views.  On CUDA the default pairing (the state-lane forward, the chunked backward) and each family both
// ways (KCPP_SCAN_LANES=1, KCPP_SCAN_CHUNKED=1, KCPP_SCAN_LEGACY=1) are held to the same oracle.
// The oracle's own backward is checked against finite differences on a tiny f64 case.
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "mamba_test_util.h"
#include "oracle_mamba.h"
#include "selective_scan/selective_scan.h"

namespace kcpp {
namespace {

using mamba::SelectiveScanParams;
using mamba::StateUpdateParams;

struct Case {
  int64_t b, d, l, n, g;
  bool z, skip, bias, softplus, norm, strided;
};

std::string name(const Case& c) {
  return fmt::format("b={} d={} l={} n={} g={} z={} D={} bias={} softplus={} norm={} strided={}", c.b, c.d, c.l, c.n, c.g, c.z,
                     c.skip, c.bias, c.softplus, c.norm, c.strided);
}

struct Inputs {
  Tensor u, delta, A, B, C, D, z, bias;
};

// [B, rows, L], from a wider buffer when strided (channel and batch strides beyond the dense ones).
Tensor seq_tensor(int64_t b, int64_t rows, int64_t l, DType dt, Device dev, Generator& gen, bool strided, double lo, double hi,
                  bool uniform) {
  const int64_t extra = strided ? 3 : 0;
  const Tensor t = uniform ? Tensor::uniform({b, rows + extra, l}, dt, dev, gen, lo, hi)
                           : Tensor::randn({b, rows + extra, l}, dt, dev, gen, lo, hi);
  return strided ? t.narrow(1, 1, rows) : t;
}

// Values as Mamba sees them: A = -exp(U(-5, 2)) (decays from e^-7 per unit step to nearly none), a step
// softplus(N(0, 1) + N(-1, 0.5)) or, without softplus, U(0.01, 0.6).
Inputs make(const Case& c, DType dt, Device dev, Generator& gen) {
  Inputs t;
  t.u = seq_tensor(c.b, c.d, c.l, dt, dev, gen, c.strided, 0, 1, false);
  t.delta = c.softplus ? seq_tensor(c.b, c.d, c.l, dt, dev, gen, c.strided, 0, 1, false)
                       : seq_tensor(c.b, c.d, c.l, dt, dev, gen, c.strided, 0.01, 0.6, true);
  std::vector<double> a(static_cast<size_t>(c.d * c.n));
  gen.fill_uniform(a, -5, 2);
  for (double& v : a) v = -std::exp(v);
  t.A = Tensor::from_f64(a, {c.d, c.n}, DType::f32, dev);
  auto bc = [&] {
    const Tensor x = Tensor::randn({c.b, c.g, c.n + (c.strided ? 2 : 0), c.l}, dt, dev, gen);
    return c.strided ? x.narrow(2, 1, c.n) : x;
  };
  t.B = bc();
  t.C = bc();
  if (c.skip) t.D = Tensor::randn({c.d}, DType::f32, dev, gen);
  if (c.z) t.z = seq_tensor(c.b, c.d, c.l, dt, dev, gen, c.strided, 0, 1.5, false);
  if (c.bias) t.bias = Tensor::randn({c.d}, DType::f32, dev, gen, -1, 0.5);
  return t;
}

oracle::Scan oracle_of(const Case& c, const Inputs& t) {
  oracle::Scan s;
  s.batch = c.b, s.dim = c.d, s.seqlen = c.l, s.dstate = c.n, s.groups = c.g;
  s.u = t.u.to_f64_vector(), s.delta = t.delta.to_f64_vector(), s.A = t.A.to_f64_vector();
  s.B = t.B.to_f64_vector(), s.C = t.C.to_f64_vector();
  if (c.skip) s.D = t.D.to_f64_vector();
  if (c.z) s.z = t.z.to_f64_vector();
  if (c.bias) s.delta_bias = t.bias.to_f64_vector();
  s.softplus = c.softplus, s.bc_norm = c.norm, s.eps = 1e-5;
  return s;
}

SelectiveScanParams params(const Case& c, const Inputs& t, DType dt) {
  SelectiveScanParams p;
  p.dtype = test::mamba_dtype(dt);
  p.batch = c.b, p.dim = c.d, p.seqlen = c.l, p.dstate = c.n, p.groups = c.g;
  p.u = test::seq_of(t.u), p.delta = test::seq_of(t.delta), p.z = test::seq_of(t.z);
  p.B = test::group_seq_of(t.B), p.C = test::group_seq_of(t.C);
  p.A = static_cast<const float*>(t.A.data());
  if (c.skip) p.D = static_cast<const float*>(t.D.data());
  if (c.bias) p.delta_bias = static_cast<const float*>(t.bias.data());
  p.delta_softplus = c.softplus;
  p.bc_norm = c.norm, p.bc_eps = 1e-5f;
  return p;
}

struct ScanRun {
  Tensor out, last, states, du, ddelta, dA, dB, dC, dD, dz, dbias;
};

ScanRun forward(const Case& c, const Inputs& t, DType dt, Device dev) {
  ScanRun r;
  r.out = Tensor::full({c.b, c.d, c.l}, std::nan(""), dt, dev);
  r.last = Tensor::full({c.b, c.d, c.n}, std::nan(""), DType::f32, dev);
  r.states = Tensor::full({c.b, c.d, mamba::state_chunks(c.l), c.n}, std::nan(""), DType::f32, dev);
  SelectiveScanParams p = params(c, t, dt);
  p.out = test::seq_of(r.out);
  p.last_state = static_cast<float*>(r.last.data());
  p.states = static_cast<float*>(r.states.data());
  test::mamba_check(MAMBA_CALL(dev, mamba::selective_scan_forward, p));
  return r;
}

void backward(const Case& c, const Inputs& t, DType dt, Device dev, const Tensor& dout, ScanRun& r) {
  SelectiveScanParams p = params(c, t, dt);
  p.states = static_cast<float*>(r.states.data());
  const double nan = std::nan("");
  r.du = Tensor::full({c.b, c.d, c.l}, nan, dt, dev);
  r.ddelta = Tensor::full({c.b, c.d, c.l}, nan, dt, dev);
  r.dA = Tensor::full({c.d, c.n}, nan, DType::f32, dev);
  r.dB = Tensor::full({c.b, c.g, c.n, c.l}, nan, dt, dev);
  r.dC = Tensor::full({c.b, c.g, c.n, c.l}, nan, dt, dev);
  p.dout = test::seq_of(dout), p.du = test::seq_of(r.du), p.ddelta = test::seq_of(r.ddelta);
  p.dA = static_cast<float*>(r.dA.data());
  p.dB = test::group_seq_of(r.dB), p.dC = test::group_seq_of(r.dC);
  if (c.skip) r.dD = Tensor::full({c.d}, nan, DType::f32, dev), p.dD = static_cast<float*>(r.dD.data());
  if (c.z) r.dz = Tensor::full({c.b, c.d, c.l}, nan, dt, dev), p.dz = test::seq_of(r.dz);
  if (c.bias) r.dbias = Tensor::full({c.d}, nan, DType::f32, dev), p.ddelta_bias = static_cast<float*>(r.dbias.data());
  Tensor ws;
#if KCPP_WITH_CUDA
  if (dev.is_cuda()) {
    ws = Tensor::empty({std::max<int64_t>(1, static_cast<int64_t>(mamba::selective_scan_backward_workspace(p)))}, DType::u8, dev);
    p.workspace = ws.data(), p.workspace_bytes = static_cast<size_t>(ws.numel());
  }
#endif
  test::mamba_check(MAMBA_CALL(dev, mamba::selective_scan_backward, p));
}

// Holds `got` to the oracle's `ref` with magnitudes `mag` in the output dtype `dt`.
void expect_close(const Tensor& got, const oracle::V& ref, const oracle::V& mag, DType dt, const std::string& what) {
  const double e = test::mag_error(got, ref, mag), bound = test::mamba_bound(dt, mag);
  EXPECT_LE(e, bound) << what << " (error / magnitude " << e << ")";
}

void check_case(const Case& c, DType dt, Device dev, Generator& gen) {
  const std::string cfg = test::config_name(dev, dt) + " " + name(c);
  const Inputs t = make(c, dt, dev, gen);
  const Tensor dout = Tensor::randn({c.b, c.d, c.l}, dt, dev, gen);
  ScanRun r = forward(c, t, dt, dev);
  backward(c, t, dt, dev, dout, r);
  const oracle::Scan s = oracle_of(c, t);
  const oracle::ScanOut fo = oracle::selective_scan(s), fm = oracle::selective_scan(s, true);
  expect_close(r.out, fo.out, fm.out, dt, cfg + " out");
  expect_close(r.last, fo.last_state, fm.last_state, DType::f32, cfg + " last_state");
  // The last chunk's saved state is the last state itself.
  const auto st = r.states.to_f64_vector(), last = r.last.to_f64_vector();
  const int64_t chunks = mamba::state_chunks(c.l);
  for (int64_t i = 0; i < c.b * c.d; ++i)
    for (int64_t n = 0; n < c.n; ++n)
      ASSERT_EQ(st[static_cast<size_t>((i * chunks + chunks - 1) * c.n + n)], last[static_cast<size_t>(i * c.n + n)]) << cfg;
  const auto dv = dout.to_f64_vector();
  const oracle::ScanGrad go = oracle::selective_scan_backward(s, dv), gm = oracle::selective_scan_backward(s, dv, true);
  expect_close(r.du, go.du, gm.du, dt, cfg + " du");
  expect_close(r.ddelta, go.ddelta, gm.ddelta, dt, cfg + " ddelta");
  expect_close(r.dA, go.dA, gm.dA, DType::f32, cfg + " dA");
  expect_close(r.dB, go.dB, gm.dB, dt, cfg + " dB");
  expect_close(r.dC, go.dC, gm.dC, dt, cfg + " dC");
  if (c.skip) expect_close(r.dD, go.dD, gm.dD, DType::f32, cfg + " dD");
  if (c.z) expect_close(r.dz, go.dz, gm.dz, dt, cfg + " dz");
  if (c.bias) expect_close(r.dbias, go.ddelta_bias, gm.ddelta_bias, DType::f32, cfg + " ddelta_bias");
}

using test::ScopedEnv;

// Every option on and off over L = 1, 7, 255, 256, 257, 700, 1000, N = 1, 3, 4, 5, 16, groups 1 to 4.
const Case kAwkward[] = {
    {1, 1, 1, 1, 1, false, false, false, false, false, false},    // L = 1, N = 1, nothing optional
    {1, 1, 1, 16, 1, true, true, true, true, true, false},        // L = 1, everything
    {2, 5, 7, 16, 1, true, true, true, true, false, true},        // odd L, strided views
    {2, 9, 255, 4, 1, true, true, true, true, false, false},      // one short of a chunk, N = 4
    {1, 4, 256, 3, 2, true, false, true, true, true, false},      // exactly one chunk, two groups
    {2, 3, 257, 16, 1, false, true, false, false, false, true},   // a chunk and one position
    {1, 6, 700, 5, 3, true, true, true, true, true, false},       // three chunks, three groups
    {1, 20, 1000, 16, 4, true, false, true, true, true, true},    // four chunks, four groups, strided
    {2, 12, 1000, 4, 2, false, true, false, true, false, false},  // no gate, N = 4
    {1, 130, 33, 16, 1, true, true, true, true, false, false},    // more channels than a CPU block
    {3, 2, 513, 1, 2, true, true, false, true, true, true},       // N = 1 (the norm of one value), 3 chunks
};

class SelectiveScan : public ::testing::TestWithParam<Device> {};

// Every awkward shape in each of the dtypes.
void check_awkward(Device dev, Generator& gen, std::initializer_list<DType> dtypes) {
  for (DType dt : dtypes)
    for (const Case& c : kAwkward) check_case(c, dt, dev, gen);
}

TEST_P(SelectiveScan, MatchesTheOracleOnAwkwardShapes) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  check_awkward(dev, gen, {DType::f32, DType::bf16, DType::f16});
}

// The state-lane CUDA kernels both ways (KCPP_SCAN_LANES=1; by default only the forward is theirs; the
// backward where the device gives a block its shared memory, else the chunked one).
TEST_P(SelectiveScan, StateLaneKernelsMatchTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  if (dev.is_cpu()) GTEST_SKIP() << "the state-lane kernels are CUDA's";
  const ScopedEnv lanes("KCPP_SCAN_LANES", "1");
  Generator gen = test::test_generator();
  check_awkward(dev, gen, {DType::f32, DType::bf16, DType::f16});
  // Several backward blocks (96 channels) in each of several groups, the last partly filled: the
  // workspace rows of block cb > 0 of group g > 0.
  const Case wide[] = {
      {2, 400, 300, 16, 2, true, true, true, true, false, false},
      {1, 300, 260, 5, 3, true, true, true, true, true, true},
  };
  for (DType dt : {DType::f32, DType::bf16})
    for (const Case& c : wide) check_case(c, dt, dev, gen);
}

// The chunked CUDA kernels both ways (KCPP_SCAN_CHUNKED=1; by default only the backward is theirs).
TEST_P(SelectiveScan, ChunkedKernelsMatchTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  if (dev.is_cpu()) GTEST_SKIP() << "the chunked kernels are CUDA's";
  const ScopedEnv chunked("KCPP_SCAN_CHUNKED", "1");
  Generator gen = test::test_generator();
  check_awkward(dev, gen, {DType::f32, DType::bf16});
}

// The sequential CUDA kernels (KCPP_SCAN_LEGACY=1), kept for comparison, on the same shapes.
TEST_P(SelectiveScan, LegacyKernelsMatchTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  if (dev.is_cpu()) GTEST_SKIP() << "the legacy kernels are CUDA's";
  const ScopedEnv legacy("KCPP_SCAN_LEGACY", "1");
  Generator gen = test::test_generator();
  check_awkward(dev, gen, {DType::f32, DType::bf16});
}

// Shapes that exercise the CUDA kernels' tiling: channel blocks partly filled, several blocks, tiles of
// positions that end mid-tile, sub-chunks of the backward.
TEST_P(SelectiveScan, MatchesTheOracleOnLargerShapes) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const Case cases[] = {
      {2, 300, 1100, 16, 1, true, true, true, true, false, false},
      {1, 96, 777, 8, 4, true, true, true, true, true, true},
      {2, 70, 300, 13, 1, false, false, false, true, false, false},
  };
  for (DType dt : dev.is_cuda() ? std::vector<DType>{DType::f32, DType::bf16, DType::f16} : std::vector<DType>{DType::bf16})
    for (const Case& c : cases) check_case(c, dt, dev, gen);
}

// Enough channels that a CUDA block takes several channels a warp (its forward more than 8, its
// backward more than 8 channels and up to 128), the group's last block partly filled.
TEST_P(SelectiveScan, MatchesTheOracleWithManyChannels) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const Case cases[] = {
      {4, 4100, 130, 4, 2, true, true, true, true, true, false},       // 2050 channels a group
      {3, 2004, 300, 16, 1, true, false, true, true, false, false},    // blocks of 16 channels, the last of 4
      {2, 2048, 520, 16, 1, false, true, true, true, false, false},    // three chunks, no gate
  };
  for (DType dt : dev.is_cuda() ? std::vector<DType>{DType::bf16, DType::f32} : std::vector<DType>{DType::bf16})
    for (const Case& c : cases) check_case(c, dt, dev, gen);
}

TEST_P(SelectiveScan, BackwardIsReproducibleAndEmptyShapesWork) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const Case c{2, 200, 600, 16, 2, true, true, true, true, true, false};
  const Inputs t = make(c, DType::bf16, dev, gen);
  const Tensor dout = Tensor::randn({c.b, c.d, c.l}, DType::bf16, dev, gen);
  ScanRun a = forward(c, t, DType::bf16, dev), b = forward(c, t, DType::bf16, dev);
  backward(c, t, DType::bf16, dev, dout, a);
  backward(c, t, DType::bf16, dev, dout, b);
  EXPECT_EQ(a.out.to_f64_vector(), b.out.to_f64_vector());
  for (auto [x, y, what] : {std::tuple{&a.du, &b.du, "du"},
                            {&a.ddelta, &b.ddelta, "ddelta"},
                            {&a.dA, &b.dA, "dA"},
                            {&a.dB, &b.dB, "dB"},
                            {&a.dC, &b.dC, "dC"},
                            {&a.dD, &b.dD, "dD"},
                            {&a.dz, &b.dz, "dz"},
                            {&a.dbias, &b.dbias, "ddelta_bias"}})
    EXPECT_EQ(x->to_f64_vector(), y->to_f64_vector()) << what << " differs between two runs";

  // L = 0: no output, the last state is the initial (zero) state, the parameter gradients are 0.
  const Case e{2, 3, 0, 4, 1, true, true, true, true, false, false};
  const Inputs te = make(e, DType::f32, dev, gen);
  ScanRun r = forward(e, te, DType::f32, dev);
  EXPECT_EQ(r.last.to_f64_vector(), std::vector<double>(2 * 3 * 4, 0.0));
  backward(e, te, DType::f32, dev, Tensor::empty({2, 3, 0}, DType::f32, dev), r);
  EXPECT_EQ(r.dA.to_f64_vector(), std::vector<double>(3 * 4, 0.0));
  EXPECT_EQ(r.dD.to_f64_vector(), std::vector<double>(3, 0.0));
  EXPECT_EQ(r.dbias.to_f64_vector(), std::vector<double>(3, 0.0));
}

TEST_P(SelectiveScan, BadParamsAreRefusedByName) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const Case c{1, 4, 9, 3, 2, true, true, true, true, false, false};
  const Inputs t = make(c, DType::f32, dev, gen);
  const Tensor out = Tensor::empty({1, 4, 9}, DType::f32, dev);
  SelectiveScanParams p = params(c, t, DType::f32);
  p.out = test::seq_of(out);
  SelectiveScanParams q = p;
  q.groups = 3;
  EXPECT_TRUE(test::kernel_error_contains(MAMBA_CALL(dev, mamba::selective_scan_forward, q), "not a multiple of the 3 groups"));
  q = p;
  q.dstate = 0;
  EXPECT_TRUE(test::kernel_error_contains(MAMBA_CALL(dev, mamba::selective_scan_forward, q), "state size N must be >= 1"));
  q = p;
  q.bc_norm = true, q.bc_eps = -1;
  EXPECT_TRUE(test::kernel_error_contains(MAMBA_CALL(dev, mamba::selective_scan_forward, q), "'bc_rms_eps'"));
  q = p;
  q.out = {};
  EXPECT_TRUE(test::kernel_error_contains(MAMBA_CALL(dev, mamba::selective_scan_forward, q), "'out' must not be null"));
  // Backward: dz exactly with z, states required.
  ScanRun r = forward(c, t, DType::f32, dev);
  const Tensor dout = Tensor::randn({1, 4, 9}, DType::f32, dev, gen);
  backward(c, t, DType::f32, dev, dout, r);
  q = params(c, t, DType::f32);
  q.states = static_cast<float*>(r.states.data());
  q.dout = test::seq_of(dout), q.du = test::seq_of(r.du), q.ddelta = test::seq_of(r.ddelta), q.dz = test::seq_of(r.dz);
  q.dA = static_cast<float*>(r.dA.data()), q.dB = test::group_seq_of(r.dB), q.dC = test::group_seq_of(r.dC);
  q.dD = static_cast<float*>(r.dD.data()), q.ddelta_bias = static_cast<float*>(r.dbias.data());
  SelectiveScanParams bad = q;
  bad.dz = {};
  EXPECT_TRUE(
      test::kernel_error_contains(MAMBA_CALL(dev, mamba::selective_scan_backward, bad), "'dz' is required exactly when 'z'"));
  bad = q;
  bad.states = nullptr;
  EXPECT_TRUE(test::kernel_error_contains(MAMBA_CALL(dev, mamba::selective_scan_backward, bad), "'states'"));
  bad = q;
  bad.ddelta_bias = nullptr;
  EXPECT_TRUE(test::kernel_error_contains(MAMBA_CALL(dev, mamba::selective_scan_backward, bad), "'ddelta_bias'"));
#if KCPP_WITH_CUDA
  if (dev.is_cuda()) {  // a workspace smaller than the call needs is refused, not overrun
    const size_t need = mamba::selective_scan_backward_workspace(q);
    const Tensor ws = Tensor::empty({static_cast<int64_t>(need)}, DType::u8, dev);
    bad = q;
    bad.workspace = ws.data(), bad.workspace_bytes = need - 1;
    EXPECT_TRUE(test::kernel_error_contains(MAMBA_CALL(dev, mamba::selective_scan_backward, bad), "the workspace holds"));
  }
#endif
}

// ---- the decoding step

struct Step {
  int64_t b, d, n, g;
  bool z, skip, bias, softplus, norm;
};

// One step from a random state: out and the new state against the oracle's one-position scan from it.
TEST_P(SelectiveScan, StateUpdateMatchesOneStepOfTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const Step steps[] = {{1, 1, 1, 1, false, false, false, false, false},
                        {3, 7, 16, 1, true, true, true, true, false},
                        {2, 6, 5, 3, true, false, true, true, true},
                        {2, 300, 16, 2, true, true, true, true, true}};
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (const Step& s : steps) {
      const std::string cfg =
          fmt::format("{} b={} d={} n={} g={} z={} D={} bias={} softplus={} norm={}", test::config_name(dev, dt), s.b, s.d, s.n,
                      s.g, s.z, s.skip, s.bias, s.softplus, s.norm);
      const Case c{s.b, s.d, 1, s.n, s.g, s.z, s.skip, s.bias, s.softplus, s.norm, false};
      const Inputs t = make(c, dt, dev, gen);
      // x, dt, z as [B, D] columns of wider buffers (strided); B, C [B, G, N]; the state strided too.
      const Tensor x = Tensor::randn({s.b, s.d + 2}, dt, dev, gen).narrow(1, 2, s.d);
      const Tensor delta = t.delta.select(2, 0), z = s.z ? t.z.select(2, 0) : Tensor();
      const Tensor Bs = t.B.select(3, 0).contiguous(), Cs = t.C.select(3, 0).contiguous();
      const Tensor state = Tensor::randn({s.b, s.d + 1, s.n}, DType::f32, dev, gen).narrow(1, 0, s.d);
      const Tensor out = Tensor::full({s.b, s.d}, std::nan(""), dt, dev);
      oracle::Scan o = oracle_of(c, t);
      o.u = x.to_f64_vector(), o.B = Bs.to_f64_vector(), o.C = Cs.to_f64_vector(), o.h0 = state.to_f64_vector();
      const oracle::ScanOut fo = oracle::selective_scan(o), fm = oracle::selective_scan(o, true);
      StateUpdateParams p;
      p.dtype = test::mamba_dtype(dt);
      p.batch = s.b, p.dim = s.d, p.dstate = s.n, p.groups = s.g;
      p.state = static_cast<float*>(state.data()), p.state_sb = state.stride(0), p.state_sd = state.stride(1);
      p.x = x.data(), p.x_sb = x.stride(0), p.x_sd = x.stride(1);
      p.dt = delta.data(), p.dt_sb = delta.stride(0), p.dt_sd = delta.stride(1);
      if (s.z) p.z = z.data(), p.z_sb = z.stride(0), p.z_sd = z.stride(1);
      p.B = Bs.data(), p.B_sb = Bs.stride(0), p.B_sg = Bs.stride(1);
      p.C = Cs.data(), p.C_sb = Cs.stride(0), p.C_sg = Cs.stride(1);
      p.A = static_cast<const float*>(t.A.data());
      if (s.skip) p.D = static_cast<const float*>(t.D.data());
      if (s.bias) p.dt_bias = static_cast<const float*>(t.bias.data());
      p.dt_softplus = s.softplus, p.bc_norm = s.norm, p.bc_eps = 1e-5f;
      p.out = out.data(), p.out_sb = out.stride(0), p.out_sd = out.stride(1);
      test::mamba_check(MAMBA_CALL(dev, mamba::selective_state_update, p));
      expect_close(out, fo.out, fm.out, dt, cfg + " out");
      expect_close(state, fo.last_state, fm.last_state, DType::f32, cfg + " state");
    }
}

// A prefill by the scan (its last state) then decoding steps reproduce the scan over the whole sequence.
TEST_P(SelectiveScan, PrefillThenStepsMatchOneScan) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const int64_t prefill = 300, total = 306;
  const Case c{2, 10, total, 16, 2, true, true, true, true, true, false};
  const Case pc{2, 10, prefill, 16, 2, true, true, true, true, true, false};
  const DType dt = DType::bf16;
  const Inputs t = make(c, dt, dev, gen);
  Inputs tp = t;
  for (Tensor* x : {&tp.u, &tp.delta, &tp.z}) *x = x->narrow(2, 0, prefill);
  tp.B = t.B.narrow(3, 0, prefill), tp.C = t.C.narrow(3, 0, prefill);
  const ScanRun pre = forward(pc, tp, dt, dev);
  const Tensor state = pre.last.clone();
  const oracle::Scan s = oracle_of(c, t);
  const oracle::ScanOut fo = oracle::selective_scan(s), fm = oracle::selective_scan(s, true);
  const auto pre_out = pre.out.to_f64_vector();
  std::vector<double> out_ref, out_mag, got;
  for (int64_t l = prefill; l < total; ++l) {
    const Tensor out = Tensor::empty({c.b, c.d}, dt, dev);
    const Tensor x = t.u.select(2, l), delta = t.delta.select(2, l), z = t.z.select(2, l);
    const Tensor Bs = t.B.select(3, l).contiguous(), Cs = t.C.select(3, l).contiguous();
    StateUpdateParams p;
    p.dtype = test::mamba_dtype(dt);
    p.batch = c.b, p.dim = c.d, p.dstate = c.n, p.groups = c.g;
    p.state = static_cast<float*>(state.data()), p.state_sb = state.stride(0), p.state_sd = state.stride(1);
    p.x = x.data(), p.x_sb = x.stride(0), p.x_sd = x.stride(1);
    p.dt = delta.data(), p.dt_sb = delta.stride(0), p.dt_sd = delta.stride(1);
    p.z = z.data(), p.z_sb = z.stride(0), p.z_sd = z.stride(1);
    p.B = Bs.data(), p.B_sb = Bs.stride(0), p.B_sg = Bs.stride(1);
    p.C = Cs.data(), p.C_sb = Cs.stride(0), p.C_sg = Cs.stride(1);
    p.A = static_cast<const float*>(t.A.data()), p.D = static_cast<const float*>(t.D.data());
    p.dt_bias = static_cast<const float*>(t.bias.data());
    p.dt_softplus = true, p.bc_norm = true, p.bc_eps = 1e-5f;
    p.out = out.data(), p.out_sb = out.stride(0), p.out_sd = out.stride(1);
    test::mamba_check(MAMBA_CALL(dev, mamba::selective_state_update, p));
    const auto o = out.to_f64_vector();
    for (int64_t i = 0; i < c.b * c.d; ++i) {
      got.push_back(o[static_cast<size_t>(i)]);
      out_ref.push_back(fo.out[static_cast<size_t>(i * total + l)]);
      out_mag.push_back(fm.out[static_cast<size_t>(i * total + l)]);
    }
  }
  const Tensor steps = Tensor::from_f64(got, {static_cast<int64_t>(got.size())}, DType::f64);
  EXPECT_LE(test::mag_error(steps, out_ref, out_mag), test::mamba_bound(dt, out_mag)) << "decoded outputs";
  expect_close(state, fo.last_state, fm.last_state, DType::f32, "state after the steps");
}

// The CUDA kernels' softplus (softplus_fast: e^-|x| on the special-function unit and a short series for
// log1p) against the exact value in f64, over [-127, 30] and both sides of the threshold: within 4e-7
// relative with the host's correctly rounded operations (the bound its comment states; log1pf's own
// error is about 1e-7).
TEST(MambaMath, FastSoftplusIsWithinItsBound) {
  double worst = 0.0, at = 0.0;
  auto check = [&](float x) {
    const double exact = x > 20.0f ? static_cast<double>(x) : std::log1p(std::exp(static_cast<double>(x)));
    if (exact < 1e-37) {  // below f32's normal range (x < -85): 0 or a subnormal
      EXPECT_LT(mamba::softplus_fast(x), 1e-37f) << "at x = " << x;
      return;
    }
    const double err = std::fabs(static_cast<double>(mamba::softplus_fast(x)) - exact) / exact;
    if (err > worst) worst = err, at = x;
  };
  for (int i = 0; i <= 700000; ++i) check(-40.0f + 70.0f * static_cast<float>(i) / 700000.0f);
  for (int e = -30; e <= 4; ++e)
    for (float m : {1.0f, 1.37f, 2.5f, 7.9f}) check(m * std::ldexp(1.0f, e)), check(-m * std::ldexp(1.0f, e));
  for (float x : {0.0f, 20.0f, std::nextafter(20.0f, 0.0f), std::nextafter(20.0f, 30.0f), -87.0f, -103.0f}) check(x);
  EXPECT_LT(worst, 4e-7) << "at x = " << at;
  EXPECT_EQ(mamba::softplus_fast(25.0f), 25.0f);
  // The ends: 0 below the range (not the NaN that -inf's exponent arithmetic would give), inf, NaN kept.
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(mamba::softplus_fast(-inf), 0.0f);
  EXPECT_EQ(mamba::softplus_fast(-3e38f), 0.0f);
  EXPECT_EQ(mamba::softplus_fast(inf), inf);
  EXPECT_TRUE(std::isnan(mamba::softplus_fast(std::numeric_limits<float>::quiet_NaN())));
}

// The oracle's backward against central differences of its forward: the gradients the kernels are held
// to are the derivatives of what they compute.
TEST(SelectiveScanOracle, BackwardMatchesFiniteDifferences) {
  Generator gen = test::test_generator();
  for (bool all : {true, false}) {
    Case c{1, 4, 7, 3, 2, all, all, all, all, all, false};
    const Inputs t = make(c, DType::f32, Device::cpu(), gen);
    oracle::Scan s = oracle_of(c, t);
    oracle::V dout(static_cast<size_t>(c.b * c.d * c.l));
    gen.fill_normal(dout, 0, 1);
    const oracle::ScanGrad g = oracle::selective_scan_backward(s, dout);
    auto loss = [&](const oracle::Scan& x) {
      const oracle::V out = oracle::selective_scan(x).out;
      double l = 0;
      for (size_t i = 0; i < out.size(); ++i) l += out[i] * dout[i];
      return l;
    };
    auto check = [&](oracle::V oracle::Scan::*field, const oracle::V& grad, const char* what) {
      ASSERT_EQ((s.*field).size(), grad.size()) << what;
      for (size_t i = 0; i < grad.size(); ++i) {
        oracle::Scan plus = s, minus = s;
        const double h = 1e-6 * std::max(1.0, std::abs((s.*field)[i]));
        (plus.*field)[i] += h;
        (minus.*field)[i] -= h;
        const double fd = (loss(plus) - loss(minus)) / (2 * h);
        EXPECT_NEAR(grad[i], fd, 1e-6 * std::max(1.0, std::abs(fd))) << what << "[" << i << "] all=" << all;
      }
    };
    check(&oracle::Scan::u, g.du, "du");
    check(&oracle::Scan::delta, g.ddelta, "ddelta");
    check(&oracle::Scan::A, g.dA, "dA");
    check(&oracle::Scan::B, g.dB, "dB");
    check(&oracle::Scan::C, g.dC, "dC");
    if (all) {
      check(&oracle::Scan::D, g.dD, "dD");
      check(&oracle::Scan::z, g.dz, "dz");
      check(&oracle::Scan::delta_bias, g.ddelta_bias, "ddelta_bias");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, SelectiveScan, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cpu() ? std::string("cpu") : std::string("cuda"); });

}  // namespace
}  // namespace kcpp
