// Package "mamba" through the ABI, as a host calls it: the built library loaded, its layers called with
// the named arguments of docs/contracts/SelectiveScan.md, SelectiveStateUpdate.md and CausalConv1d.md,
// results against the f64 oracle (tests/oracle_mamba.h).  The kernels' numerics are covered in depth by
// packages/mamba/*/test_*.cpp; here every argument of every contract is exercised at least once, so that
// a wrong mapping from the contract to the kernel (a stride, a group, an optional tensor) shows up as an
// O(1) error, and bad input is refused with a message naming the argument.
#include <cmath>
#include <string>
#include <vector>

#include "oracle_mamba.h"
#include "package_util.h"
#include "test_util.h"

namespace kcpp {
namespace {

using nn::KernelArgs;
using nn::KernelLayer;

KernelLayer layer(const char* name) { return KernelLayer::find(test::built_package("mamba"), name); }

// ||got - ref|| / ||magnitude|| within one rounding to `dt` and 32 units of f32.
void expect_close(const Tensor& got, const oracle::V& ref, const oracle::V& mag, DType dt, const std::string& what) {
  const double e = test::mag_error(got, ref, mag);
  EXPECT_LE(e, test::unit_roundoff(dt) + 32 * test::unit_roundoff(DType::f32) + test::underflow_allowance(dt, mag))
      << what << " (error / magnitude " << e << ")";
}

class MambaPackage : public ::testing::TestWithParam<Device> {};

TEST_P(MambaPackage, TableNamesEveryLayerAndContract) {
  const auto pkg = test::built_package("mamba");
  EXPECT_STREQ(pkg->table().name, "mamba");
  struct Expect {
    const char* name;
    const char* contract;
    bool backward;
  };
  for (const Expect& e :
       {Expect{"SelectiveScan", "SelectiveScan/1", true}, Expect{"SelectiveStateUpdate", "SelectiveStateUpdate/1", false},
        Expect{"CausalConv1d", "CausalConv1d/1", true}, Expect{"CausalConv1dUpdate", "CausalConv1dUpdate/1", false}}) {
    const KernelLayer l = layer(e.name);
    EXPECT_STREQ(l.info().contract, e.contract) << e.name;
    EXPECT_EQ(l.has_backward(), e.backward) << e.name;
    EXPECT_EQ((l.info().modes & KCPP_MODE_TRAINING) != 0, e.backward) << e.name;
    EXPECT_TRUE(l.runs_on(Device::cpu())) << e.name;
  }
}

// ---- SelectiveScan/1

struct Scan {
  int64_t b, d, l, n, g;
  bool rank3;  // B and C as [B, N, L] (one group) rather than [B, G, N, L]
  bool falcon;
};

TEST_P(MambaPackage, SelectiveScanForwardAndBackward) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer k = layer("SelectiveScan");
  for (const Scan& c : {Scan{2, 6, 300, 16, 1, true, false}, Scan{1, 6, 9, 4, 3, false, true}})
    for (DType dt : {DType::f32, DType::bf16}) {
      const std::string cfg = fmt::format("{} b={} d={} l={} n={} g={} rank3={} falcon={}", test::config_name(dev, dt), c.b, c.d,
                                          c.l, c.n, c.g, c.rank3, c.falcon);
      // u and z as the channel halves of one [B, 2D, L] buffer (as a projection writes them).
      const Tensor xz = Tensor::randn({c.b, 2 * c.d, c.l}, dt, dev, gen);
      const Tensor u = xz.narrow(1, 0, c.d), z = xz.narrow(1, c.d, c.d);
      const Tensor delta = Tensor::randn({c.b, c.d, c.l}, dt, dev, gen);
      std::vector<double> av(static_cast<size_t>(c.d * c.n));
      gen.fill_uniform(av, -4, 1.5);
      for (double& v : av) v = -std::exp(v);
      const Tensor A = Tensor::from_f64(av, {c.d, c.n}, DType::f32, dev);
      const Tensor B4 = Tensor::randn({c.b, c.g, c.n, c.l}, dt, dev, gen), C4 = Tensor::randn({c.b, c.g, c.n, c.l}, dt, dev, gen);
      const Tensor B = c.rank3 ? B4.select(1, 0) : B4, C = c.rank3 ? C4.select(1, 0) : C4;
      const Tensor D = Tensor::randn({c.d}, DType::f32, dev, gen), bias = Tensor::randn({c.d}, DType::f32, dev, gen, -1, 0.5);
      const Tensor out = Tensor::empty({c.b, c.d, c.l}, dt, dev), last = Tensor::empty({c.b, c.d, c.n}, DType::f32, dev);
      const Tensor states = Tensor::empty({c.b, c.d, (c.l + 255) / 256, c.n}, DType::f32, dev);
      auto inputs = [&](KernelArgs& a) {
        a.tensor("u", u).tensor("delta", delta).tensor("A", A).tensor("B", B).tensor("C", C).tensor("D", D).tensor("z", z);
        a.tensor("delta_bias", bias).integer("delta_softplus", 1);
        if (c.falcon) a.real("bc_rms_eps", 1e-5);
      };
      KernelArgs f;
      inputs(f);
      f.tensor("out", out).tensor("last_state", last).tensor("states", states);
      ASSERT_TRUE(k.supports(f, dev, test::kTraining).ok()) << cfg << ": " << k.supports(f, dev, test::kTraining).message;
      k.forward(f, dev, test::kTraining);
      const Tensor dout = Tensor::randn({c.b, c.d, c.l}, dt, dev, gen);
      const Tensor du = Tensor::empty(u.shape(), dt, dev), ddelta = Tensor::empty(u.shape(), dt, dev),
                   dz = Tensor::empty(u.shape(), dt, dev);
      const Tensor dA = Tensor::empty({c.d, c.n}, DType::f32, dev), dD = Tensor::empty({c.d}, DType::f32, dev);
      const Tensor dbias = Tensor::empty({c.d}, DType::f32, dev);
      const Tensor dB = Tensor::empty(B.shape(), dt, dev), dC = Tensor::empty(C.shape(), dt, dev);
      KernelArgs b;
      inputs(b);
      b.tensor("dout", dout).tensor("states", states).tensor("du", du).tensor("ddelta", ddelta).tensor("dA", dA).tensor("dB", dB);
      b.tensor("dC", dC).tensor("dD", dD).tensor("dz", dz).tensor("ddelta_bias", dbias);
      k.backward(b, dev, test::kTraining);

      oracle::Scan s;
      s.batch = c.b, s.dim = c.d, s.seqlen = c.l, s.dstate = c.n, s.groups = c.g;
      s.u = u.to_f64_vector(), s.delta = delta.to_f64_vector(), s.A = av, s.B = B4.to_f64_vector(), s.C = C4.to_f64_vector();
      s.A = A.to_f64_vector();
      s.D = D.to_f64_vector(), s.z = z.to_f64_vector(), s.delta_bias = bias.to_f64_vector();
      s.softplus = true, s.bc_norm = c.falcon, s.eps = 1e-5;
      const oracle::ScanOut fo = oracle::selective_scan(s), fm = oracle::selective_scan(s, true);
      expect_close(out, fo.out, fm.out, dt, cfg + " out");
      expect_close(last, fo.last_state, fm.last_state, DType::f32, cfg + " last_state");
      const auto dv = dout.to_f64_vector();
      const oracle::ScanGrad go = oracle::selective_scan_backward(s, dv), gm = oracle::selective_scan_backward(s, dv, true);
      expect_close(du, go.du, gm.du, dt, cfg + " du");
      expect_close(ddelta, go.ddelta, gm.ddelta, dt, cfg + " ddelta");
      expect_close(dz, go.dz, gm.dz, dt, cfg + " dz");
      expect_close(dA, go.dA, gm.dA, DType::f32, cfg + " dA");
      expect_close(dB, go.dB, gm.dB, dt, cfg + " dB");
      expect_close(dC, go.dC, gm.dC, dt, cfg + " dC");
      expect_close(dD, go.dD, gm.dD, DType::f32, cfg + " dD");
      expect_close(dbias, go.ddelta_bias, gm.ddelta_bias, DType::f32, cfg + " ddelta_bias");

      // Inference: no states needed, the same output.
      const Tensor out2 = Tensor::empty({c.b, c.d, c.l}, dt, dev);
      KernelArgs inf;
      inputs(inf);
      inf.tensor("out", out2);
      k.forward(inf, dev, test::kInference);
      EXPECT_EQ(out2.to_f64_vector(), out.to_f64_vector()) << cfg << " inference forward";
    }
}

// Without the optional arguments (no D, z, delta_bias, softplus): the plain recurrence.
TEST_P(MambaPackage, SelectiveScanWithoutOptions) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer k = layer("SelectiveScan");
  const int64_t b = 2, d = 3, l = 20, n = 5;
  const Tensor u = Tensor::randn({b, d, l}, DType::f32, dev, gen),
               delta = Tensor::uniform({b, d, l}, DType::f32, dev, gen, 0.01, 0.5);
  const Tensor A = Tensor::uniform({d, n}, DType::f32, dev, gen, -3, -0.1);
  const Tensor B = Tensor::randn({b, n, l}, DType::f32, dev, gen), C = Tensor::randn({b, n, l}, DType::f32, dev, gen);
  const Tensor out = Tensor::empty({b, d, l}, DType::f32, dev), states = Tensor::empty({b, d, 1, n}, DType::f32, dev);
  KernelArgs f;
  f.tensor("u", u).tensor("delta", delta).tensor("A", A).tensor("B", B).tensor("C", C).none("D").none("z").tensor("out", out);
  f.tensor("states", states);
  k.forward(f, dev, test::kTraining);
  const Tensor dout = Tensor::randn({b, d, l}, DType::f32, dev, gen);
  const Tensor du = Tensor::empty({b, d, l}, DType::f32, dev), ddelta = Tensor::empty({b, d, l}, DType::f32, dev);
  const Tensor dA = Tensor::empty({d, n}, DType::f32, dev), dB = Tensor::empty({b, n, l}, DType::f32, dev);
  const Tensor dC = Tensor::empty({b, n, l}, DType::f32, dev);
  KernelArgs bw;
  bw.tensor("u", u)
      .tensor("delta", delta)
      .tensor("A", A)
      .tensor("B", B)
      .tensor("C", C)
      .tensor("states", states)
      .tensor("dout", dout);
  bw.tensor("du", du).tensor("ddelta", ddelta).tensor("dA", dA).tensor("dB", dB).tensor("dC", dC);
  k.backward(bw, dev, test::kTraining);
  oracle::Scan s;
  s.batch = b, s.dim = d, s.seqlen = l, s.dstate = n;
  s.u = u.to_f64_vector(), s.delta = delta.to_f64_vector(), s.A = A.to_f64_vector(), s.B = B.to_f64_vector(),
  s.C = C.to_f64_vector();
  expect_close(out, oracle::selective_scan(s).out, oracle::selective_scan(s, true).out, DType::f32, "out");
  const auto dv = dout.to_f64_vector();
  const oracle::ScanGrad go = oracle::selective_scan_backward(s, dv), gm = oracle::selective_scan_backward(s, dv, true);
  expect_close(du, go.du, gm.du, DType::f32, "du");
  expect_close(ddelta, go.ddelta, gm.ddelta, DType::f32, "ddelta");
  expect_close(dA, go.dA, gm.dA, DType::f32, "dA");
  expect_close(dB, go.dB, gm.dB, DType::f32, "dB");
  expect_close(dC, go.dC, gm.dC, DType::f32, "dC");
}

TEST_P(MambaPackage, SelectiveScanRefusesBadInputByName) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const KernelLayer k = layer("SelectiveScan");
  const int64_t b = 1, d = 4, l = 6, n = 3;
  const Tensor u = Tensor::zeros({b, d, l}, DType::bf16, dev), A = Tensor::zeros({d, n}, DType::f32, dev);
  const Tensor B = Tensor::zeros({b, n, l}, DType::bf16, dev), out = Tensor::empty({b, d, l}, DType::bf16, dev);
  auto base = [&](KernelArgs& a) {
    a.tensor("u", u).tensor("delta", u.clone()).tensor("A", A).tensor("B", B).tensor("C", B.clone()).tensor("out", out);
  };
  auto refused = [&](KernelArgs& a, uint32_t mode, kcpp_status s, const std::string& needle) {
    EXPECT_TRUE(test::refused(k.supports(a, dev, mode), s, needle)) << needle;
  };
  {
    KernelArgs a;
    base(a);
    EXPECT_TRUE(k.supports(a, dev, test::kInference).ok());
    refused(a, test::kTraining, KCPP_ERROR_INVALID_ARGUMENT, "missing tensor argument 'states' (required in training mode");
  }
  {  // an argument the call does not read (misspelt) is refused naming it, not ignored
    KernelArgs a;
    base(a);
    a.integer("softplus", 1);
    refused(a, test::kInference, KCPP_ERROR_INVALID_ARGUMENT, "argument 'softplus' is not one this call reads");
  }
  {
    KernelArgs a;
    a.tensor("u", u)
        .tensor("delta", Tensor::zeros({b, d, l}, DType::f16, dev))
        .tensor("A", A)
        .tensor("B", B)
        .tensor("C", B)
        .tensor("out", out);
    refused(a, test::kInference, KCPP_ERROR_INVALID_ARGUMENT, "tensor 'delta' is f16; expected bf16");
  }
  {
    KernelArgs a;
    a.tensor("u", u)
        .tensor("delta", u)
        .tensor("A", Tensor::zeros({d, n}, DType::bf16, dev))
        .tensor("B", B)
        .tensor("C", B)
        .tensor("out", out);
    refused(a, test::kInference, KCPP_ERROR_INVALID_ARGUMENT, "tensor 'A' must be f32");
  }
  {
    KernelArgs a;
    a.tensor("u", u).tensor("delta", u).tensor("A", A).tensor("B", Tensor::zeros({b, n + 1, l}, DType::bf16, dev)).tensor("C", B);
    a.tensor("out", out);
    refused(a, test::kInference, KCPP_ERROR_INVALID_ARGUMENT, "tensor 'B' has shape [1, 4, 6]; expected [1, 3, 6]");
  }
  {
    KernelArgs a;
    const Tensor g3 = Tensor::zeros({b, 3, n, l}, DType::bf16, dev);
    a.tensor("u", u).tensor("delta", u).tensor("A", A).tensor("B", g3).tensor("C", g3).tensor("out", out);
    refused(a, test::kInference, KCPP_ERROR_INVALID_ARGUMENT, "3 groups, which do not divide the 4 channels");
  }
  {
    KernelArgs a;
    const Tensor g2 = Tensor::zeros({b, 2, n, l}, DType::bf16, dev);
    a.tensor("u", u).tensor("delta", u).tensor("A", A).tensor("B", g2).tensor("C", B).tensor("out", out);
    refused(a, test::kInference, KCPP_ERROR_INVALID_ARGUMENT, "tensor 'C' has no group dim but 'B' has 2 groups");
  }
  {
    KernelArgs a;
    a.tensor("u", Tensor::zeros({b, l, d}, DType::bf16, dev).transpose(1, 2))
        .tensor("delta", u)
        .tensor("A", A)
        .tensor("B", B)
        .tensor("C", B);
    a.tensor("out", out);
    refused(a, test::kInference, KCPP_ERROR_UNSUPPORTED, "tensor 'u': the sequence (last) dim must be contiguous");
  }
  {
    KernelArgs a;
    base(a);
    a.integer("delta_softplus", 2);
    refused(a, test::kInference, KCPP_ERROR_INVALID_ARGUMENT, "argument 'delta_softplus' is 2; expected 0 or 1");
  }
  {
    KernelArgs a;
    base(a);
    a.real("bc_rms_eps", -1.0);
    refused(a, test::kInference, KCPP_ERROR_INVALID_ARGUMENT, "argument 'bc_rms_eps' is -1");
  }
  {
    KernelArgs a;
    base(a);
    a.tensor("states", Tensor::empty({b, d, 2, n}, DType::f32, dev));
    refused(a, test::kTraining, KCPP_ERROR_INVALID_ARGUMENT, "tensor 'states' has shape [1, 4, 2, 3]; expected [1, 4, 1, 3]");
  }
  {
    KernelArgs a;
    a.tensor("u", u).tensor("delta", u.clone()).tensor("A", A).tensor("B", B).tensor("C", B).tensor("out", u);
    refused(a, test::kInference, KCPP_ERROR_INVALID_ARGUMENT, "tensor 'out' must not overlap");
  }
  {
    KernelArgs a;
    base(a);
    a.tensor("states", Tensor::empty({b, d, 1, n}, DType::f32, dev)).tensor("dout", out).tensor("du", u.clone());
    a.tensor("ddelta", u.clone())
        .tensor("dA", A.clone())
        .tensor("dB", B.clone())
        .tensor("dC", B.clone())
        .tensor("dD", Tensor::empty({d}, DType::f32, dev));
    refused(a, test::kTraining, KCPP_ERROR_INVALID_ARGUMENT, "tensor 'dD' is given but 'D' is not");
  }
  {
    KernelArgs a;
    base(a);
    a.tensor("z", u.clone())
        .tensor("states", Tensor::empty({b, d, 1, n}, DType::f32, dev))
        .tensor("dout", out)
        .tensor("du", u.clone());
    a.tensor("ddelta", u.clone()).tensor("dA", A.clone()).tensor("dB", B.clone()).tensor("dC", B.clone());
    refused(a, test::kTraining, KCPP_ERROR_INVALID_ARGUMENT, "missing tensor argument 'dz'");
  }
  if (dev.is_cuda()) {  // the CUDA kernels hold N <= 16 states a channel
    KernelArgs a;
    const Tensor A17 = Tensor::zeros({d, 17}, DType::f32, dev), B17 = Tensor::zeros({b, 17, l}, DType::bf16, dev);
    a.tensor("u", u).tensor("delta", u.clone()).tensor("A", A17).tensor("B", B17).tensor("C", B17.clone()).tensor("out", out);
    refused(a, test::kInference, KCPP_ERROR_UNSUPPORTED, "N <= 16");
  }
}

// ---- SelectiveStateUpdate/1

TEST_P(MambaPackage, SelectiveStateUpdateIsOneStepOfTheScan) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer k = layer("SelectiveStateUpdate");
  for (bool falcon : {false, true})
    for (DType dt : {DType::f32, DType::bf16}) {
      const int64_t b = 3, d = 8, n = 16, g = falcon ? 2 : 1;
      const std::string cfg = fmt::format("{} falcon={}", test::config_name(dev, dt), falcon);
      // x and z as halves of one [B, 2D] row (Transformers passes such views), dt a column of [B, D, 1].
      const Tensor xz = Tensor::randn({b, 2 * d}, dt, dev, gen);
      const Tensor x = xz.narrow(1, 0, d), z = xz.narrow(1, d, d), delta = Tensor::randn({b, d, 1}, dt, dev, gen).select(2, 0);
      const Tensor A = Tensor::uniform({d, n}, DType::f32, dev, gen, -8, -0.05);
      const Tensor Bt = falcon ? Tensor::randn({b, g, n}, dt, dev, gen) : Tensor::randn({b, n}, dt, dev, gen);
      const Tensor Ct = falcon ? Tensor::randn({b, g, n}, dt, dev, gen) : Tensor::randn({b, n}, dt, dev, gen);
      const Tensor D = Tensor::randn({d}, DType::f32, dev, gen), bias = Tensor::randn({d}, DType::f32, dev, gen, -1, 0.5);
      const Tensor state = Tensor::randn({b, d, n}, DType::f32, dev, gen), out = Tensor::empty({b, d}, dt, dev);
      oracle::Scan s;
      s.batch = b, s.dim = d, s.seqlen = 1, s.dstate = n, s.groups = g;
      s.u = x.to_f64_vector(), s.delta = delta.to_f64_vector(), s.A = A.to_f64_vector(), s.B = Bt.to_f64_vector();
      s.C = Ct.to_f64_vector(), s.D = D.to_f64_vector(), s.z = z.to_f64_vector(), s.delta_bias = bias.to_f64_vector();
      s.h0 = state.to_f64_vector(), s.softplus = true, s.bc_norm = falcon, s.eps = 1e-5;
      KernelArgs a;
      a.tensor("state", state).tensor("x", x).tensor("dt", delta).tensor("A", A).tensor("B", Bt).tensor("C", Ct).tensor("D", D);
      a.tensor("z", z).tensor("dt_bias", bias).integer("dt_softplus", 1).tensor("out", out);
      if (falcon) a.real("bc_rms_eps", 1e-5);
      ASSERT_TRUE(k.supports(a, dev, test::kInference).ok()) << cfg << ": " << k.supports(a, dev, test::kInference).message;
      k.forward(a, dev, test::kInference);
      const oracle::ScanOut fo = oracle::selective_scan(s), fm = oracle::selective_scan(s, true);
      expect_close(out, fo.out, fm.out, dt, cfg + " out");
      expect_close(state, fo.last_state, fm.last_state, DType::f32, cfg + " state");
    }
  // Refusals.
  const Tensor x = Tensor::zeros({2, 4}, DType::bf16, dev), A = Tensor::zeros({4, 3}, DType::f32, dev);
  const Tensor Bt = Tensor::zeros({2, 3}, DType::bf16, dev), out = Tensor::empty({2, 4}, DType::bf16, dev);
  KernelArgs bad;
  bad.tensor("state", Tensor::zeros({2, 4, 3}, DType::bf16, dev)).tensor("x", x).tensor("dt", x).tensor("A", A).tensor("B", Bt);
  bad.tensor("C", Bt).tensor("out", out);
  EXPECT_TRUE(test::refused(k.supports(bad, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "tensor 'state' must be f32"));
  KernelArgs shape;
  shape.tensor("state", Tensor::zeros({2, 4, 2}, DType::f32, dev)).tensor("x", x).tensor("dt", x).tensor("A", A).tensor("B", Bt);
  shape.tensor("C", Bt).tensor("out", out);
  EXPECT_TRUE(
      test::refused(k.supports(shape, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "tensor 'state' has shape [2, 4, 2]"));
}

// ---- CausalConv1d/1, CausalConv1dUpdate/1

TEST_P(MambaPackage, CausalConv1dForwardAndBackward) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer k = layer("CausalConv1d");
  for (const char* act : {"silu", "swish", "none", ""})
    for (bool bias : {true, false}) {
      const DType dt = DType::bf16;
      const int64_t b = 2, d = 7, l = 45, w = 4;
      const std::string cfg = fmt::format("{} activation='{}' bias={}", test::config_name(dev, dt), act, bias);
      const Tensor x = Tensor::randn({b, d + 2, l}, dt, dev, gen).narrow(1, 1, d);
      const Tensor wt = Tensor::randn({d, w}, dt, dev, gen, 0, 0.5), bt = Tensor::randn({d}, dt, dev, gen);
      const Tensor out = Tensor::empty({b, d, l}, dt, dev), dout = Tensor::randn({b, d, l}, dt, dev, gen);
      const Tensor dx = Tensor::empty({b, d, l}, dt, dev), dw = Tensor::empty({d, w}, dt, dev), db = Tensor::empty({d}, dt, dev);
      KernelArgs f;
      f.tensor("x", x).tensor("weight", wt).tensor("out", out);
      if (bias) f.tensor("bias", bt);
      if (*act) f.string("activation", act);
      k.forward(f, dev, test::kTraining);
      KernelArgs bw;
      bw.tensor("x", x).tensor("weight", wt).tensor("dout", dout).tensor("dx", dx).tensor("dweight", dw);
      if (bias) bw.tensor("bias", bt).tensor("dbias", db);
      if (*act) bw.string("activation", act);
      k.backward(bw, dev, test::kTraining);
      oracle::Conv o;
      o.batch = b, o.dim = d, o.seqlen = l, o.width = w, o.silu = std::string(act) == "silu" || std::string(act) == "swish";
      o.x = x.to_f64_vector(), o.w = wt.to_f64_vector();
      if (bias) o.bias = bt.to_f64_vector();
      expect_close(out, oracle::causal_conv1d(o), oracle::causal_conv1d(o, true), dt, cfg + " out");
      const auto dv = dout.to_f64_vector();
      const oracle::ConvGrad g = oracle::causal_conv1d_backward(o, dv), m = oracle::causal_conv1d_backward(o, dv, true);
      expect_close(dx, g.dx, m.dx, dt, cfg + " dx");
      expect_close(dw, g.dw, m.dw, dt, cfg + " dweight");
      if (bias) expect_close(db, g.dbias, m.dbias, dt, cfg + " dbias");
    }
  const Tensor x = Tensor::zeros({1, 2, 5}, DType::f32, dev), w = Tensor::zeros({2, 3}, DType::f32, dev);
  const Tensor out = Tensor::empty({1, 2, 5}, DType::f32, dev);
  auto refused = [&](KernelArgs& a, kcpp_status s, const std::string& needle) {
    EXPECT_TRUE(test::refused(k.supports(a, dev, test::kInference), s, needle)) << needle;
  };
  KernelArgs act;
  act.tensor("x", x).tensor("weight", w).tensor("out", out).string("activation", "gelu");
  refused(act, KCPP_ERROR_INVALID_ARGUMENT, "argument 'activation' is 'gelu'; expected one of 'none', 'silu', 'swish'");
  KernelArgs wdt;
  wdt.tensor("x", x).tensor("weight", Tensor::zeros({2, 3}, DType::bf16, dev)).tensor("out", out);
  refused(wdt, KCPP_ERROR_INVALID_ARGUMENT, "tensor 'weight' is bf16; expected f32");
  KernelArgs wsh;
  wsh.tensor("x", x).tensor("weight", Tensor::zeros({3, 3}, DType::f32, dev)).tensor("out", out);
  refused(wsh, KCPP_ERROR_INVALID_ARGUMENT, "tensor 'weight' has shape [3, 3]; expected [2, 3]");
  KernelArgs db;
  db.tensor("x", x).tensor("weight", w).tensor("dout", out).tensor("dx", Tensor::empty({1, 2, 5}, DType::f32, dev));
  db.tensor("dweight", Tensor::empty({2, 3}, DType::f32, dev)).tensor("dbias", Tensor::empty({2}, DType::f32, dev));
  refused(db, KCPP_ERROR_INVALID_ARGUMENT, "tensor 'dbias' is given but 'bias' is not");
  if (dev.is_cuda()) {
    KernelArgs wide;
    wide.tensor("x", x).tensor("weight", Tensor::zeros({2, 5}, DType::f32, dev)).tensor("out", out);
    refused(wide, KCPP_ERROR_UNSUPPORTED, "widths up to 4");
  }
}

TEST_P(MambaPackage, CausalConv1dUpdateRollsTheState) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer k = layer("CausalConv1dUpdate");
  for (bool rank3 : {false, true}) {
    const DType dt = DType::f32;
    const int64_t b = 2, d = 5, kk = 4, w = 4, s = rank3 ? 2 : 1;
    const Tensor x3 = Tensor::randn({b, d, s}, dt, dev, gen), x = rank3 ? x3 : x3.select(2, 0);
    const Tensor state = Tensor::randn({b, d, kk}, dt, dev, gen), wt = Tensor::randn({d, w}, dt, dev, gen),
                 bt = Tensor::randn({d}, dt, dev, gen);
    const Tensor out = rank3 ? Tensor::empty({b, d, s}, dt, dev) : Tensor::empty({b, d}, dt, dev);
    const auto sv = state.to_f64_vector(), xv = x3.to_f64_vector();
    KernelArgs a;
    a.tensor("x", x)
        .tensor("conv_state", state)
        .tensor("weight", wt)
        .tensor("bias", bt)
        .string("activation", "silu")
        .tensor("out", out);
    k.forward(a, dev, test::kInference);
    oracle::Conv o;
    o.batch = b, o.dim = d, o.seqlen = kk + s, o.width = w, o.silu = true, o.w = wt.to_f64_vector(), o.bias = bt.to_f64_vector();
    for (int64_t i = 0; i < b * d; ++i) {
      for (int64_t t = 0; t < kk; ++t) o.x.push_back(sv[static_cast<size_t>(i * kk + t)]);
      for (int64_t t = 0; t < s; ++t) o.x.push_back(xv[static_cast<size_t>(i * s + t)]);
    }
    const auto full = oracle::causal_conv1d(o), mag = oracle::causal_conv1d(o, true);
    oracle::V ref, m, st;
    for (int64_t i = 0; i < b * d; ++i) {
      for (int64_t t = 0; t < s; ++t)
        ref.push_back(full[static_cast<size_t>(i * (kk + s) + kk + t)]),
            m.push_back(mag[static_cast<size_t>(i * (kk + s) + kk + t)]);
      for (int64_t t = 0; t < kk; ++t) st.push_back(o.x[static_cast<size_t>(i * (kk + s) + s + t)]);
    }
    expect_close(out, ref, m, dt, fmt::format("rank3={} out", rank3));
    EXPECT_EQ(state.to_f64_vector(), st) << "rank3=" << rank3 << " state";
  }
  KernelArgs shortstate;
  const Tensor x = Tensor::zeros({2, 5}, DType::f32, dev);
  shortstate.tensor("x", x)
      .tensor("conv_state", Tensor::zeros({2, 5, 2}, DType::f32, dev))
      .tensor("weight", Tensor::zeros({5, 4}, DType::f32, dev));
  shortstate.tensor("out", Tensor::empty({2, 5}, DType::f32, dev));
  EXPECT_TRUE(test::refused(k.supports(shortstate, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT,
                            "tensor 'conv_state' keeps 2 positions; width 4 needs at least 3"));
}

INSTANTIATE_TEST_SUITE_P(Devices, MambaPackage, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cpu() ? std::string("cpu") : std::string("cuda"); });

}  // namespace
}  // namespace kcpp
