// The causal depthwise convolution and its update against the f64 oracle (tests/oracle_mamba.h), errors
// against the magnitude of the terms (mamba_bound).  Shapes: L = 1, L below the width, odd lengths,
// widths 1 to 4 (and 5 on the CPU), many channels and batches (the backward's sums of dweight over
// them), strided views; the update with states of W - 1, W and more positions, one and several new ones.
#include <cmath>
#include <string>
#include <vector>

#include "causal_conv1d/causal_conv1d.h"
#include "mamba_test_util.h"
#include "oracle_mamba.h"

namespace kcpp {
namespace {

using mamba::CausalConv1dParams;
using mamba::ConvUpdateParams;

struct Case {
  int64_t b, d, l, w;
  bool bias, silu, strided;
};

struct ConvRun {
  Tensor x, w, bias, out, dout, dx, dw, db;
};

ConvRun run(const Case& c, DType dt, Device dev, Generator& gen) {
  ConvRun r;
  const Tensor xb = Tensor::randn({c.b, c.d + (c.strided ? 5 : 0), c.l}, dt, dev, gen);
  r.x = c.strided ? xb.narrow(1, 2, c.d) : xb;
  r.w = Tensor::randn({c.d, c.w}, dt, dev, gen, 0, 0.5);
  if (c.bias) r.bias = Tensor::randn({c.d}, dt, dev, gen);
  r.out = Tensor::full({c.b, c.d, c.l}, std::nan(""), dt, dev);
  r.dout = Tensor::randn({c.b, c.d, c.l}, dt, dev, gen);
  r.dx = Tensor::full({c.b, c.d, c.l}, std::nan(""), dt, dev);
  r.dw = Tensor::full({c.d, c.w}, std::nan(""), dt, dev);
  if (c.bias) r.db = Tensor::full({c.d}, std::nan(""), dt, dev);
  CausalConv1dParams p;
  p.dtype = test::mamba_dtype(dt);
  p.batch = c.b, p.dim = c.d, p.seqlen = c.l, p.width = c.w, p.silu = c.silu;
  p.x = test::seq_of(r.x);
  p.weight = r.w.data();
  if (c.bias) p.bias = r.bias.data();
  p.out = test::seq_of(r.out);
  test::mamba_check(MAMBA_CALL(dev, mamba::causal_conv1d_forward, p));
  p.dout = test::seq_of(r.dout), p.dx = test::seq_of(r.dx);
  p.dweight = r.dw.data();
  if (c.bias) p.dbias = r.db.data();
  test::mamba_check(MAMBA_CALL(dev, mamba::causal_conv1d_backward, p));
  return r;
}

oracle::Conv oracle_of(const Case& c, const ConvRun& r) {
  oracle::Conv o;
  o.batch = c.b, o.dim = c.d, o.seqlen = c.l, o.width = c.w, o.silu = c.silu;
  o.x = r.x.to_f64_vector(), o.w = r.w.to_f64_vector();
  if (c.bias) o.bias = r.bias.to_f64_vector();
  return o;
}

void expect_close(const Tensor& got, const oracle::V& ref, const oracle::V& mag, DType dt, const std::string& what) {
  const double e = test::mag_error(got, ref, mag);
  EXPECT_LE(e, test::mamba_bound(dt, mag)) << what << " (error / magnitude " << e << ")";
}

class CausalConv1d : public ::testing::TestWithParam<Device> {};

TEST_P(CausalConv1d, MatchesTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const Case cases[] = {
      {1, 1, 1, 1, false, false, false}, {1, 1, 1, 4, true, true, false},    {2, 5, 7, 4, true, true, true},
      {1, 3, 3, 4, false, true, false},  {2, 17, 130, 2, true, false, true}, {3, 64, 1000, 3, true, true, false},
      {1, 9, 129, 4, true, true, true},  {5, 40, 513, 4, false, true, true}, {2, 3, 11, 5, true, true, false},
  };
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (const Case& c : cases) {
      if (dev.is_cuda() && c.w > 4) continue;  // the CUDA kernels take W <= 4 (the package refuses wider)
      const std::string cfg = fmt::format("{} b={} d={} l={} w={} bias={} silu={} strided={}", test::config_name(dev, dt), c.b,
                                          c.d, c.l, c.w, c.bias, c.silu, c.strided);
      const ConvRun r = run(c, dt, dev, gen);
      const oracle::Conv o = oracle_of(c, r);
      expect_close(r.out, oracle::causal_conv1d(o), oracle::causal_conv1d(o, true), dt, cfg + " out");
      const auto dv = r.dout.to_f64_vector();
      const oracle::ConvGrad g = oracle::causal_conv1d_backward(o, dv), m = oracle::causal_conv1d_backward(o, dv, true);
      expect_close(r.dx, g.dx, m.dx, dt, cfg + " dx");
      expect_close(r.dw, g.dw, m.dw, dt, cfg + " dweight");
      if (c.bias) expect_close(r.db, g.dbias, m.dbias, dt, cfg + " dbias");
    }
}

TEST_P(CausalConv1d, BackwardIsReproducible) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const Case c{8, 33, 2048, 4, true, true, false};
  Generator g1 = test::test_generator(), g2 = test::test_generator();
  const ConvRun a = run(c, DType::bf16, dev, g1), b = run(c, DType::bf16, dev, g2);
  EXPECT_EQ(a.dw.to_f64_vector(), b.dw.to_f64_vector());
  EXPECT_EQ(a.db.to_f64_vector(), b.db.to_f64_vector());
  EXPECT_EQ(a.dx.to_f64_vector(), b.dx.to_f64_vector());
}

struct UpdateCase {
  int64_t b, d, k, s, w;
  bool bias, silu, rank3;
};

TEST_P(CausalConv1d, UpdateMatchesTheConvolutionOfStateAndInput) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const UpdateCase cases[] = {{1, 1, 0, 1, 1, false, false, false}, {2, 5, 4, 1, 4, true, true, true},
                              {2, 5, 3, 1, 4, true, true, false},   {3, 70, 6, 3, 4, false, true, true},
                              {1, 8, 2, 2, 2, true, false, true},   {2, 300, 4, 1, 4, true, true, true}};
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (const UpdateCase& u : cases) {
      const std::string cfg = fmt::format("{} b={} d={} k={} s={} w={} bias={} silu={}", test::config_name(dev, dt), u.b, u.d,
                                          u.k, u.s, u.w, u.bias, u.silu);
      // x [B, D, S] (or [B, D]) as a strided view; the state [B, D, K] with a wider channel stride.
      const Tensor xb = Tensor::randn({u.b, u.s, u.d}, dt, dev, gen);
      const Tensor x3 = xb.transpose(1, 2), x = u.rank3 ? x3 : x3.select(2, 0);
      const Tensor state = Tensor::randn({u.b, u.d + 1, u.k}, dt, dev, gen).narrow(1, 0, u.d);
      const Tensor w = Tensor::randn({u.d, u.w}, dt, dev, gen, 0, 0.5);
      const Tensor bias = u.bias ? Tensor::randn({u.d}, dt, dev, gen) : Tensor();
      const Tensor out = u.rank3 ? Tensor::empty({u.b, u.d, u.s}, dt, dev) : Tensor::empty({u.b, u.d}, dt, dev);
      // The oracle: the convolution of [state, x] over K + S positions, its last S outputs.
      const auto sv = state.to_f64_vector(), xv = x3.to_f64_vector();
      oracle::Conv o;
      o.batch = u.b, o.dim = u.d, o.seqlen = u.k + u.s, o.width = u.w, o.silu = u.silu;
      o.w = w.to_f64_vector();
      if (u.bias) o.bias = bias.to_f64_vector();
      o.x.resize(static_cast<size_t>(u.b * u.d * (u.k + u.s)));
      for (int64_t i = 0; i < u.b * u.d; ++i)
        for (int64_t t = 0; t < u.k + u.s; ++t)
          o.x[static_cast<size_t>(i * (u.k + u.s) + t)] =
              t < u.k ? sv[static_cast<size_t>(i * u.k + t)] : xv[static_cast<size_t>(i * u.s + t - u.k)];
      const auto full = oracle::causal_conv1d(o), full_mag = oracle::causal_conv1d(o, true);
      oracle::V ref, mag, state_ref;
      for (int64_t i = 0; i < u.b * u.d; ++i) {
        for (int64_t t = 0; t < u.s; ++t) {
          ref.push_back(full[static_cast<size_t>(i * (u.k + u.s) + u.k + t)]);
          mag.push_back(full_mag[static_cast<size_t>(i * (u.k + u.s) + u.k + t)]);
        }
        for (int64_t t = 0; t < u.k; ++t) state_ref.push_back(o.x[static_cast<size_t>(i * (u.k + u.s) + u.s + t)]);
      }
      // A state of W - 2 positions is one short: refused by name.
      if (u.k < u.w - 1) continue;
      ConvUpdateParams p;
      p.dtype = test::mamba_dtype(dt);
      p.batch = u.b, p.dim = u.d, p.seqlen = u.s, p.width = u.w, p.state_len = u.k, p.silu = u.silu;
      p.x = x3.data(), p.x_sb = x3.stride(0), p.x_sd = x3.stride(1), p.x_sl = x3.stride(2);
      p.conv_state = state.data(), p.state_sb = state.stride(0), p.state_sd = state.stride(1);
      p.weight = w.data();
      if (u.bias) p.bias = bias.data();
      const Tensor out3 = u.rank3 ? out : out.unsqueeze(2);
      p.out = out3.data(), p.out_sb = out3.stride(0), p.out_sd = out3.stride(1), p.out_sl = out3.stride(2);
      test::mamba_check(MAMBA_CALL(dev, mamba::causal_conv1d_update, p));
      expect_close(out, ref, mag, dt, cfg + " out");
      EXPECT_EQ(state.to_f64_vector(), state_ref) << cfg << " the new state is the last K positions, unchanged";
    }
}

TEST_P(CausalConv1d, BadParamsAreRefusedByName) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const ConvRun r = run({1, 2, 5, 3, true, true, false}, DType::f32, dev, gen);
  CausalConv1dParams p;
  p.dtype = kernel::DType::f32;
  p.batch = 1, p.dim = 2, p.seqlen = 5, p.width = 3;
  p.x = test::seq_of(r.x), p.weight = r.w.data(), p.out = test::seq_of(r.out);
  CausalConv1dParams q = p;
  q.width = 0;
  EXPECT_TRUE(test::kernel_error_contains(MAMBA_CALL(dev, mamba::causal_conv1d_forward, q), "width W must be >= 1"));
  q = p;
  q.out = {};
  EXPECT_TRUE(test::kernel_error_contains(MAMBA_CALL(dev, mamba::causal_conv1d_forward, q), "'out' must not be null"));
  q = p;
  q.dout = test::seq_of(r.dout), q.dx = test::seq_of(r.dx), q.dweight = r.dw.data(), q.dbias = r.db.data();
  EXPECT_TRUE(test::kernel_error_contains(MAMBA_CALL(dev, mamba::causal_conv1d_backward, q), "'dbias' needs 'bias'"));
  ConvUpdateParams u;
  u.dtype = kernel::DType::f32;
  u.batch = 1, u.dim = 2, u.seqlen = 1, u.width = 4, u.state_len = 2;
  u.x = r.x.data(), u.conv_state = r.dx.data(), u.weight = r.w.data(), u.out = r.out.data();
  EXPECT_TRUE(test::kernel_error_contains(MAMBA_CALL(dev, mamba::causal_conv1d_update, u), "width 4 needs at least 3"));
}

INSTANTIATE_TEST_SUITE_P(Devices, CausalConv1d, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cpu() ? std::string("cpu") : std::string("cuda"); });

}  // namespace
}  // namespace kcpp
