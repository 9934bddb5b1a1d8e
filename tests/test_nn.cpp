// The nn-level reference compositions (ops/nn/) against the f64 oracle: forward and backward, every
// option that changes the maths, awkward shapes, every device and dtype.
#include <cmath>

#include <nlohmann/json.hpp>

#include "nn/kernel_config.h"
#include "nn/layers.h"
#include "oracle.h"
#include "ops/nn/attention.h"
#include "ops/nn/cross_entropy.h"
#include "ops/nn/glu.h"
#include "ops/nn/layer_norm.h"
#include "ops/nn/rms_norm.h"
#include "ops/nn/rope.h"
#include "ops/ops.h"
#include "test_util.h"

namespace kcpp {
namespace {

using test::close_l2;
using test::config_name;
using test::test_generator;

class Nn : public ::testing::TestWithParam<Device> {};

TEST_P(Nn, RMSNormForwardBackward) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  using C = ops::RMSNormCasting;
  for (DType dt : test::float_dtypes(dev))
    for (int64_t h : {1, 7, 111, 4097})
      for (C casting : {C::Llama, C::Gemma, C::None})
        for (double offset : {0.0, 1.0}) {
          const int64_t rows = h > 1000 ? 5 : 23;
          const ops::RMSNormOptions opt{1e-5, offset, casting};
          // x as a [rows, h] view of a wider buffer: non-contiguous rows.
          const Tensor x = Tensor::randn({rows, h + 3}, dt, dev, gen, 0.0, 2.0).narrow(1, 2, h);
          const Tensor w = Tensor::randn({h}, dt, dev, gen, 0.0, 1.0);
          const Tensor dy = Tensor::randn({rows, h}, dt, dev, gen);
          const auto xv = x.to_f64_vector(), wv = w.to_f64_vector();
          const auto ref = oracle::rms_norm(xv, wv, rows, h, opt.eps, offset);
          const auto refg = oracle::rms_norm_backward(dy.to_f64_vector(), xv, wv, rows, h, opt.eps, offset);
          const std::string cfg = fmt::format("{} h={} casting={} offset={}", config_name(dev, dt), h,
                                              static_cast<int>(casting), offset);
          const auto fwd = ops::rms_norm_forward(x, w, opt);
          const double tol = test::composite_rel_l2(dt);
          EXPECT_TRUE(close_l2(fwd.y, ref.y, tol)) << cfg;
          EXPECT_TRUE(close_l2(fwd.rstd, ref.rstd, test::composite_rel_l2(dt == DType::f64 ? dt : DType::f32))) << cfg;
          const auto bwd = ops::rms_norm_backward(dy, x, w, fwd.rstd, opt);
          EXPECT_TRUE(test::close_l2_mag(bwd.dx, refg.dx, refg.dx_mag, tol)) << cfg;
          EXPECT_TRUE(test::close_l2_mag(bwd.dw, refg.dw, refg.dw_mag, tol)) << cfg;
        }
}

TEST_P(Nn, LayerNormForwardBackward) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  for (DType dt : test::float_dtypes(dev))
    for (int64_t h : {2, 7, 111, 4097})
      for (bool bias : {true, false}) {
        const int64_t rows = 13;
        const Tensor x = Tensor::randn({rows, h}, dt, dev, gen, 1.0, 3.0);
        const Tensor w = Tensor::randn({h}, dt, dev, gen), b = bias ? Tensor::randn({h}, dt, dev, gen) : Tensor();
        const Tensor dy = Tensor::randn({rows, h}, dt, dev, gen);
        const auto xv = x.to_f64_vector(), wv = w.to_f64_vector();
        const auto ref = oracle::layer_norm(xv, wv, bias ? b.to_f64_vector() : std::vector<double>{}, rows, h, 1e-5);
        const auto refg = oracle::layer_norm_backward(dy.to_f64_vector(), xv, wv, rows, h, 1e-5);
        const std::string cfg = fmt::format("{} h={} bias={}", config_name(dev, dt), h, bias);
        const double tol = test::composite_rel_l2(dt);
        const auto fwd = ops::layer_norm_forward(x, w, b, 1e-5);
        // Against the magnitude of the terms: x - mean cancels when a row's values are close (a row of
        // two nearly equal values), and its rounding error then scales with |x| + |mean|, not with y.
        std::vector<double> mag(xv.size());
        const auto bv = bias ? b.to_f64_vector() : std::vector<double>(static_cast<size_t>(h), 0.0);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < h; ++j) {
            const size_t at = static_cast<size_t>(r * h + j);
            mag[at] = (std::fabs(xv[at]) + std::fabs(ref.mean[static_cast<size_t>(r)])) * ref.rstd[static_cast<size_t>(r)] *
                          std::fabs(wv[static_cast<size_t>(j)]) + std::fabs(bv[static_cast<size_t>(j)]);
          }
        EXPECT_TRUE(test::close_l2_mag(fwd.y, ref.y, mag, tol)) << cfg;
        const auto bwd = ops::layer_norm_backward(dy, x, w, fwd.mean, fwd.rstd, bias);
        EXPECT_TRUE(test::close_l2_mag(bwd.dx, refg.dx, refg.dx_mag, tol)) << cfg;
        EXPECT_TRUE(test::close_l2_mag(bwd.dw, refg.dw, refg.dw_mag, tol)) << cfg;
        if (bias) EXPECT_TRUE(close_l2(bwd.db, refg.db, tol)) << cfg;
        else EXPECT_FALSE(bwd.db.defined());
      }
}

TEST_P(Nn, RopeForwardBackward) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  struct Case {
    int64_t b, h, s, d, rd;
    bool per_batch_pos;
  };
  for (DType dt : test::float_dtypes(dev))
    for (const Case& c : {Case{1, 1, 1, 2, 2, false}, Case{2, 3, 7, 16, 16, true}, Case{3, 5, 11, 24, 8, true},
                          Case{1, 4, 9, 128, 64, false}}) {
      std::vector<int64_t> pos(static_cast<size_t>(c.b * c.s));
      for (int64_t i = 0; i < c.b; ++i)
        for (int64_t j = 0; j < c.s; ++j) pos[i * c.s + j] = c.per_batch_pos ? 3 * i + j + 1000 * i : j;
      const Tensor position_ids = Tensor::from_i64(pos, {c.b, c.s}, DType::i64, dev);
      const auto cs = ops::rope_cos_sin(position_ids, ops::rope_inv_freq(c.rd, 10000.0, dev), 1.0, dt);
      // cos/sin against their definition.
      const auto cv = cs.cos.to_f64_vector(), sv = cs.sin.to_f64_vector();
      for (int64_t i = 0; i < c.b * c.s; ++i)
        for (int64_t j = 0; j < c.rd; ++j) {
          const double f = static_cast<double>(pos[i]) * std::pow(10000.0, -2.0 * (j % (c.rd / 2)) / c.rd);
          // pos * inv_freq is formed in f32 (as HF does): its rounding moves the angle by up to
          // pos * 2^-24, which bounds the error of cos/sin before the final rounding.
          const double bound = 2 * test::unit_roundoff(dt) + 4 * std::fabs(f) * 0x1p-24 + 1e-7;
          ASSERT_NEAR(cv[i * c.rd + j], std::cos(f), bound) << config_name(dev, dt);
          ASSERT_NEAR(sv[i * c.rd + j], std::sin(f), bound) << config_name(dev, dt);
        }
      // The same bits as the composition that defines it (ops/nn/rope.h; one kernel on CUDA), with i32
      // positions and a scaling too.
      for (const double scaling : {1.0, 0.7}) {
        const Tensor inv = ops::rope_inv_freq(c.rd, 10000.0, dev), p32 = position_ids.to(DType::i32);
        const auto got = ops::rope_cos_sin(p32, inv, scaling, dt);
        const Tensor f = ops::mul(p32.to(DType::f32).unsqueeze(-1), inv.reshape({1, 1, c.rd / 2}));
        const Tensor emb = ops::cat({f, f}, -1);
        EXPECT_EQ(got.cos.to_f64_vector(), ops::scale(ops::cos(emb), scaling).to(dt).to_f64_vector()) << config_name(dev, dt);
        EXPECT_EQ(got.sin.to_f64_vector(), ops::scale(ops::sin(emb), scaling).to(dt).to_f64_vector()) << config_name(dev, dt);
      }
      const Tensor x = Tensor::randn({c.b, c.h, c.s, c.d}, dt, dev, gen);
      const Tensor dy = Tensor::randn({c.b, c.h, c.s, c.d}, dt, dev, gen);
      const auto ref = oracle::rope(x.to_f64_vector(), cv, sv, c.b, c.h, c.s, c.d, c.rd, c.b, false);
      const auto refg = oracle::rope(dy.to_f64_vector(), cv, sv, c.b, c.h, c.s, c.d, c.rd, c.b, true);
      const std::string cfg = fmt::format("{} d={} rd={}", config_name(dev, dt), c.d, c.rd);
      EXPECT_TRUE(close_l2(ops::rope_forward(x, cs.cos, cs.sin), ref, test::composite_rel_l2(dt))) << cfg;
      EXPECT_TRUE(close_l2(ops::rope_backward(dy, cs.cos, cs.sin), refg, test::composite_rel_l2(dt))) << cfg;
      // Interleaved pairs (GPT-J): the same cos/sin tables read pair by pair.
      const auto il = ops::RopeLayout::Interleaved;
      const auto refi = oracle::rope(x.to_f64_vector(), cv, sv, c.b, c.h, c.s, c.d, c.rd, c.b, false, true);
      const auto refgi = oracle::rope(dy.to_f64_vector(), cv, sv, c.b, c.h, c.s, c.d, c.rd, c.b, true, true);
      EXPECT_TRUE(close_l2(ops::rope_forward(x, cs.cos, cs.sin, il), refi, test::composite_rel_l2(dt))) << cfg << " interleaved";
      EXPECT_TRUE(close_l2(ops::rope_backward(dy, cs.cos, cs.sin, il), refgi, test::composite_rel_l2(dt))) << cfg << " interleaved";
    }
}

TEST_P(Nn, GatedActivationsForwardBackward) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  using A = ops::GluActivation;
  for (DType dt : test::float_dtypes(dev))
    for (A act : {A::Silu, A::Gelu, A::GeluTanh})
      for (int64_t n : {1, 7, 4097}) {
        const Tensor g = Tensor::randn({3, n}, dt, dev, gen, 0, 2), u = Tensor::randn({3, n}, dt, dev, gen);
        const Tensor d = Tensor::randn({3, n}, dt, dev, gen);
        const auto oa = act == A::Silu ? oracle::Act::Silu : act == A::Gelu ? oracle::Act::Gelu : oracle::Act::GeluTanh;
        const auto gv = g.to_f64_vector(), uv = u.to_f64_vector();
        std::vector<double> dg, du;
        oracle::glu_backward(d.to_f64_vector(), gv, uv, oa, dg, du);
        const auto mag = oracle::glu_magnitude(d.to_f64_vector(), gv, uv, oa);  // GELU's 1 + erf cancels
        const std::string cfg = fmt::format("{} act={} n={}", config_name(dev, dt), static_cast<int>(act), n);
        const double tol = test::composite_rel_l2(dt);
        EXPECT_TRUE(test::close_l2_mag(ops::glu_forward(g, u, act), oracle::glu(gv, uv, oa), mag.out, tol)) << cfg;
        const auto b = ops::glu_backward(d, g, u, act);
        EXPECT_TRUE(test::close_l2_mag(b.dgate, dg, mag.dgate, tol)) << cfg;
        EXPECT_TRUE(test::close_l2_mag(b.dup, du, mag.dup, tol)) << cfg;
      }
}

TEST_P(Nn, CrossEntropyForwardBackward) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  using R = ops::Reduction;
  for (DType dt : test::float_dtypes(dev))
    for (int64_t v : {1, 3, 50257})
      for (R red : {R::Mean, R::Sum, R::None})
        for (double eps : {0.0, 0.1}) {
          const int64_t n = v > 1000 ? 5 : 17;
          const Tensor logits = Tensor::randn({n, v}, dt, dev, gen, 0, 3);
          std::vector<int64_t> t(static_cast<size_t>(n));
          std::uniform_int_distribution<int64_t> pick(0, v - 1);
          for (int64_t i = 0; i < n; ++i) t[i] = i % 4 == 1 ? -100 : pick(gen.engine());
          const Tensor targets = Tensor::from_i64(t, {n}, DType::i64, dev);
          const ops::CrossEntropyOptions opt{-100, red, eps};
          const auto lv = logits.to_f64_vector();
          int64_t count = 0;
          const auto rows = oracle::cross_entropy_rows(lv, t, n, v, -100, eps, count);
          std::vector<double> ref;
          double total = 0;
          for (double r : rows) total += r;
          if (red == R::None) ref = rows;
          else ref = {red == R::Sum ? total : total / count};
          const std::string cfg = fmt::format("{} V={} reduction={} eps={}", config_name(dev, dt), v, static_cast<int>(red), eps);
          const auto fwd = ops::cross_entropy_forward(logits, targets, opt);
          EXPECT_EQ(fwd.loss.shape(), red == R::None ? Shape{n} : Shape{}) << cfg;
          EXPECT_TRUE(close_l2(fwd.loss, ref, test::composite_rel_l2(dt))) << cfg;
          // Upstream gradient: a random scalar (mean, sum) or vector (none).
          const Tensor dloss = red == R::None ? Tensor::randn({n}, dt, dev, gen) : Tensor::full({}, 0.75, dt, dev);
          const auto dl = dloss.to_f64_vector();
          std::vector<double> g(static_cast<size_t>(n));
          for (int64_t i = 0; i < n; ++i) g[i] = red == R::None ? dl[i] : red == R::Sum ? dl[0] : dl[0] / count;
          std::vector<double> mag;
          const auto refg = oracle::cross_entropy_backward(lv, t, g, n, v, -100, eps, &mag);
          EXPECT_TRUE(test::close_l2_mag(ops::cross_entropy_backward(dloss, fwd.log_probs, targets, opt), refg, mag,
                                         test::composite_rel_l2(dt)))
              << cfg;
        }
}

TEST_P(Nn, CrossEntropyAllIgnoredIsNaNLikePyTorch) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const std::vector<int64_t> t = {-100, -100};
  const auto fwd = ops::cross_entropy_forward(Tensor::zeros({2, 4}, DType::f32, dev),
                                              Tensor::from_i64(t, {2}, DType::i64, dev));
  EXPECT_TRUE(std::isnan(fwd.loss.item()));
}

TEST_P(Nn, AttentionForwardBackward) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  struct Case {
    int64_t b, hq, hkv, sq, skv, d;
    bool causal;
    int64_t window, chunk = 0;
    double softcap = 0;
  };
  // Then three of Llama 4's chunked attention (chunks of 4 over 13 positions; 5 queries at the end of 23
  // keys, the chunk boundary at 20 among them; a chunk longer than the sequence) and three of Gemma 2's
  // soft-capping (caps of 1 and 2 bend the scores of queries of standard deviation 3).
  const Case cases[] = {{1, 1, 1, 1, 1, 8, true, 0},    {2, 4, 2, 13, 13, 16, true, 0}, {1, 6, 2, 7, 19, 32, true, 0},
                        {2, 3, 3, 11, 11, 8, false, 0}, {1, 4, 1, 17, 17, 16, true, 5}, {1, 2, 1, 5, 23, 64, true, 9},
                        {2, 4, 2, 13, 13, 16, true, 0, 4}, {1, 2, 1, 5, 23, 8, true, 0, 5}, {1, 2, 2, 7, 7, 8, true, 0, 64},
                        {2, 4, 2, 13, 13, 16, true, 0, 0, 1.0}, {1, 2, 1, 5, 23, 32, false, 0, 0, 2.0},
                        {1, 4, 1, 17, 17, 16, true, 5, 0, 1.0}};
  for (DType dt : test::float_dtypes(dev))
    for (const Case& c : cases) {
      const Tensor q = Tensor::randn({c.b, c.hq, c.sq, c.d}, dt, dev, gen, 0.0, c.softcap > 0 ? 3.0 : 1.0);
      const Tensor k = Tensor::randn({c.b, c.hkv, c.skv, c.d}, dt, dev, gen);
      const Tensor v = Tensor::randn({c.b, c.hkv, c.skv, c.d}, dt, dev, gen);
      const Tensor dout = Tensor::randn({c.b, c.hq, c.sq, c.d}, dt, dev, gen);
      const ops::AttentionOptions opt{0.0, c.causal, c.window, c.chunk, c.softcap};
      const auto dv = dout.to_f64_vector();
      const auto ref = oracle::attention(q.to_f64_vector(), k.to_f64_vector(), v.to_f64_vector(), &dv, c.b, c.hq,
                                         c.hkv, c.sq, c.skv, c.d, 1.0 / std::sqrt(double(c.d)), c.causal, c.window, c.chunk,
                                         c.softcap);
      const std::string cfg = fmt::format("{} hq={} hkv={} sq={} skv={} d={} causal={} window={} chunk={} softcap={}",
                                          config_name(dev, dt), c.hq, c.hkv, c.sq, c.skv, c.d, c.causal, c.window, c.chunk,
                                          c.softcap);
      const auto fwd = ops::attention_forward(q, k, v, opt);
      const double tol = test::composite_rel_l2(dt);
      EXPECT_TRUE(close_l2(fwd.out, ref.out, tol)) << cfg;
      const auto bwd = ops::attention_backward(dout, q, k, v, fwd, opt);
      EXPECT_TRUE(close_l2(bwd.dq, ref.dq, tol)) << cfg;
      EXPECT_TRUE(close_l2(bwd.dk, ref.dk, tol)) << cfg;
      EXPECT_TRUE(close_l2(bwd.dv, ref.dv, tol)) << cfg;
    }
}

// An nn::MoE with a shared expert against the oracle's result r: its output and every gradient but the
// shared expert's gate (i, si: the experts' and the shared expert's intermediate sizes).
void expect_moe_matches_the_oracle(const Tensor& out, const nn::MoE::Grads& g, const oracle::MoeResult& r, int64_t i, int64_t si,
                                   DType dt, const std::string& cfg) {
  const double tol = test::composite_rel_l2(dt);
  EXPECT_TRUE(close_l2(out, r.out, tol)) << cfg << " out";
  EXPECT_TRUE(test::close_l2_mag(g.dhidden, r.dx, r.dx_mag, tol)) << cfg << " dhidden";
  EXPECT_TRUE(test::close_l2_mag(g.drouter_weight, r.drouter, r.drouter_mag, tol)) << cfg << " drouter_weight";
  EXPECT_TRUE(test::close_l2_mag(g.dgate_up_proj.narrow(1, 0, i), r.dgate, r.dgate_mag, tol)) << cfg << " dgate";
  EXPECT_TRUE(test::close_l2_mag(g.dgate_up_proj.narrow(1, i, i), r.dup, r.dup_mag, tol)) << cfg << " dup";
  EXPECT_TRUE(test::close_l2_mag(g.ddown_proj, r.ddown, r.ddown_mag, tol)) << cfg << " ddown_proj";
  EXPECT_TRUE(test::close_l2_mag(g.dshared_gate_up_proj.narrow(0, 0, si), r.dsgate, r.dsgate_mag, tol)) << cfg << " dshared gate";
  EXPECT_TRUE(test::close_l2_mag(g.dshared_gate_up_proj.narrow(0, si, si), r.dsup, r.dsup_mag, tol)) << cfg << " dshared up";
  EXPECT_TRUE(test::close_l2_mag(g.dshared_down_proj, r.dsdown, r.dsdown_mag, tol)) << cfg << " dshared_down_proj";
}

// nn::MoE's reference (Transformers' eager loop; no kernel) with Qwen2-MoE's shared expert and its
// sigmoid gate, with and without the gate and the renormalization, against the f64 oracle of MoE/1:
// the routing exactly (on the reference's own rounded logits), the output and every gradient (an
// extra upstream gradient of the logits too, as the auxiliary loss gives it).
TEST_P(Nn, MoESharedExpertReferenceMatchesTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  for (DType dt : test::float_dtypes(dev))
    for (bool gated : {true, false})
      for (bool normalize : {false, true}) {
        // The routing probabilities are f32 whatever the dtype (Transformers' softmax(dtype=torch.float)),
        // so f64 holds no f64 precision here.
        if (dt == DType::f64) continue;
        const int64_t t = 11, h = 24, e = 5, k = 3, i = 12, si = 20;
        const double sh = 1 / std::sqrt(static_cast<double>(h));
        const Tensor x = Tensor::randn({t, h}, dt, dev, gen);
        const Tensor router = Tensor::randn({e, h}, dt, dev, gen, 0, 1.5 * sh);
        const Tensor gate_up = Tensor::randn({e, 2 * i, h}, dt, dev, gen, 0, sh);
        const Tensor down = Tensor::randn({e, h, i}, dt, dev, gen, 0, 1 / std::sqrt(static_cast<double>(i)));
        const Tensor sgate_up = Tensor::randn({2 * si, h}, dt, dev, gen, 0, sh);
        const Tensor sdown = Tensor::randn({h, si}, dt, dev, gen, 0, 1 / std::sqrt(static_cast<double>(si)));
        const Tensor sgs = gated ? Tensor::randn({1, h}, dt, dev, gen, 0, sh) : Tensor();
        nn::MoE moe(router, gate_up, down, {k, normalize, ops::GluActivation::Silu});
        moe.set_shared_expert(sgate_up, sdown, sgs);
        nn::MoE::Saved saved;
        const Tensor out = moe.forward(x, &saved);
        const Tensor dout = Tensor::randn({t, h}, dt, dev, gen), dz = Tensor::randn({t, e}, DType::f32, dev, gen, 0, 0.1);
        const nn::MoE::Grads g = moe.backward(dout, saved, dz);
        const std::string cfg = fmt::format("{} gated={} normalize={}", config_name(dev, dt), gated, normalize);

        oracle::MoeSpec sp;
        sp.t = t, sp.h = h, sp.e = e, sp.k = k, sp.i = i, sp.si = si, sp.normalize = normalize;
        oracle::MoeWeights wt;
        wt.x = x.to_f64_vector(), wt.router = router.to_f64_vector(), wt.down = down.to_f64_vector();
        wt.gate = gate_up.narrow(1, 0, i).to_f64_vector(), wt.up = gate_up.narrow(1, i, i).to_f64_vector();
        wt.sgate = sgate_up.narrow(0, 0, si).to_f64_vector(), wt.sup = sgate_up.narrow(0, si, si).to_f64_vector();
        wt.sdown = sdown.to_f64_vector();
        if (gated) wt.sgs = sgs.to_f64_vector();
        const auto z = saved.router_logits.to_f64_vector();
        std::vector<int64_t> ids;
        std::vector<double> w;
        oracle::moe_route(sp, z, ids, w);
        EXPECT_EQ(saved.topk_ids.to_i64_vector(), ids) << cfg;
        const auto dv = dout.to_f64_vector(), dzv = dz.to_f64_vector();
        const oracle::MoeResult r = oracle::moe(sp, wt, z, ids, {}, &dv, &dzv);
        expect_moe_matches_the_oracle(out, g, r, i, si, dt, cfg);
        ASSERT_EQ(g.dshared_expert_gate.defined(), gated) << cfg;
        if (gated) {
          EXPECT_EQ(g.dshared_expert_gate.shape(), (Shape{1, h})) << cfg;
          EXPECT_TRUE(test::close_l2_mag(g.dshared_expert_gate, r.dsgs, r.dsgs_mag, test::composite_rel_l2(dt)))
              << cfg << " dshared_expert_gate";
        }
      }
  // The shared expert's weights must fit the block.
  auto zeros = [&](Shape shape) { return Tensor::zeros(shape, DType::f32, dev); };
  nn::MoE moe(zeros({4, 8}), zeros({4, 6, 8}), zeros({4, 8, 3}), {2, false, ops::GluActivation::Silu});
  EXPECT_ERROR(moe.set_shared_expert(zeros({10, 8}), zeros({8, 4})), "do not fit hidden 8");
  EXPECT_ERROR(moe.set_shared_expert(zeros({10, 8}), zeros({8, 5}), zeros({1, 7})), "shared_expert_gate must have 8 elements");
}

// nn::MoE's reference as Llama 4 runs it (Llama4TextMoe: sigmoid routing weights applied to the expert
// inputs, a shared expert without a gate; the experts given as the transposed views of the
// checkpoint's [E, H, 2I] / [E, I, H] stacks) against the f64 oracle of MoE/1: the routing exactly, the
// output and every gradient.
TEST_P(Nn, MoELlama4ReferenceMatchesTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  for (DType dt : test::float_dtypes(dev))
    for (int64_t k : {1, 2}) {
      if (dt == DType::f64) continue;  // the routing weights are f32 whatever the dtype
      const int64_t t = 13, h = 24, e = 5, i = 12, si = 12;
      const double sh = 1 / std::sqrt(static_cast<double>(h));
      const Tensor x = Tensor::randn({t, h}, dt, dev, gen);
      const Tensor router = Tensor::randn({e, h}, dt, dev, gen, 0, 1.5 * sh);
      const Tensor gate_up_ck = Tensor::randn({e, h, 2 * i}, dt, dev, gen, 0, sh);  // [E, H, 2I]: gate columns, up columns
      const Tensor down_ck = Tensor::randn({e, i, h}, dt, dev, gen, 0, 1 / std::sqrt(static_cast<double>(i)));
      const Tensor sgate_up = Tensor::randn({2 * si, h}, dt, dev, gen, 0, sh);
      const Tensor sdown = Tensor::randn({h, si}, dt, dev, gen, 0, 1 / std::sqrt(static_cast<double>(si)));
      nn::MoE::Options o{k, false, ops::GluActivation::Silu, nn::MoE::Routing::Sigmoid, true};
      nn::MoE moe(router, gate_up_ck.transpose(1, 2), down_ck.transpose(1, 2), o, "Llama4TextMoe");
      EXPECT_EQ(moe.layer_name(), "Llama4TextMoe");
      moe.set_shared_expert(sgate_up, sdown);
      nn::MoE::Saved saved;
      const Tensor out = moe.forward(x, &saved);
      const Tensor dout = Tensor::randn({t, h}, dt, dev, gen);
      const nn::MoE::Grads g = moe.backward(dout, saved);
      const std::string cfg = fmt::format("{} top_k={}", config_name(dev, dt), k);

      oracle::MoeSpec sp;
      sp.t = t, sp.h = h, sp.e = e, sp.k = k, sp.i = i, sp.si = si, sp.routing = 1, sp.weight_on_input = true;
      oracle::MoeWeights wt;
      const Tensor gate_up = gate_up_ck.transpose(1, 2), down = down_ck.transpose(1, 2);  // [E, 2I, H], [E, H, I]
      wt.x = x.to_f64_vector(), wt.router = router.to_f64_vector(), wt.down = down.contiguous().to_f64_vector();
      wt.gate = gate_up.narrow(1, 0, i).contiguous().to_f64_vector(), wt.up = gate_up.narrow(1, i, i).contiguous().to_f64_vector();
      wt.sgate = sgate_up.narrow(0, 0, si).to_f64_vector(), wt.sup = sgate_up.narrow(0, si, si).to_f64_vector();
      wt.sdown = sdown.to_f64_vector();
      const auto z = saved.router_logits.to_f64_vector();
      std::vector<int64_t> ids;
      std::vector<double> w;
      oracle::moe_route(sp, z, ids, w);
      EXPECT_EQ(saved.topk_ids.to_i64_vector(), ids) << cfg;
      const auto dv = dout.to_f64_vector();
      const oracle::MoeResult r = oracle::moe(sp, wt, z, ids, {}, &dv, nullptr);
      expect_moe_matches_the_oracle(out, g, r, i, si, dt, cfg);
      EXPECT_FALSE(g.dshared_expert_gate.defined()) << cfg;
    }
}

TEST_P(Nn, BadArgumentsNameOpAndArgument) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  auto expect_msg = [](auto&& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected one containing: " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const Tensor x = Tensor::zeros({4, 8}, DType::f32, dev);
  expect_msg([&] { ops::rms_norm_forward(x, Tensor::zeros({7}, DType::f32, dev)); },
             "op rms_norm: argument 'weight': expected shape [8], got [7]");
  expect_msg([&] { ops::rms_norm_forward(x, Tensor::zeros({8}, DType::bf16, dev)); }, "argument 'weight' is bf16");
  expect_msg([&] { ops::layer_norm_forward(x, Tensor::zeros({8}, DType::f32, dev), Tensor::zeros({9}, DType::f32, dev)); },
             "argument 'bias'");
  expect_msg([&] { ops::glu_forward(x, Tensor::zeros({4, 9}, DType::f32, dev), ops::GluActivation::Silu); },
             "op glu: argument 'up'");
  const std::vector<int64_t> t = {0, 1, 8, 2};
  expect_msg([&] { ops::cross_entropy_forward(x, Tensor::from_i64(t, {4}, DType::i64, dev)); },
             "= 8 is out of range [0, 8)");
  expect_msg([&] { ops::cross_entropy_forward(x, Tensor::zeros({3}, DType::i64, dev)); }, "argument 'targets'");
  const Tensor q = Tensor::zeros({1, 3, 4, 8}, DType::f32, dev), k = Tensor::zeros({1, 2, 4, 8}, DType::f32, dev);
  expect_msg([&] { ops::attention_forward(q, k, k); }, "3 query heads are not a multiple of 2 kv heads");
  const Tensor cs = Tensor::zeros({1, 4, 3}, DType::f32, dev);
  expect_msg([&] { ops::rope_forward(q, cs, cs); }, "rotary dim 3 must be even");
}

INSTANTIATE_TEST_SUITE_P(Devices, Nn, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cpu() ? std::string("cpu") : std::string("cuda"); });

// ---- KernelConfig: the forms a kernel_mapping comes in ----------------------------------------------

::testing::AssertionResult mapping_fails(const std::string& text, const std::string& needle) {
  try {
    nn::KernelConfig::parse_text(text);
  } catch (const Error& e) {
    if (std::string(e.what()).find(needle) != std::string::npos) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "message '" << e.what() << "' lacks '" << needle << "'";
  }
  return ::testing::AssertionFailure() << "accepted " << text;
}

TEST(KernelConfig, AProjectFileIsReadAsWellAsAMapping) {
  // kcpp.json, what `kcpp lock` reads, is also what --kernels takes.
  const auto project = nn::KernelConfig::parse_text(R"({"kernel_mapping": {"RMSNorm": "acme/norm@^1:RMSNorm"}})");
  EXPECT_EQ(project.layers(), std::vector<std::string>{"RMSNorm"});
  EXPECT_EQ(project.select("RMSNorm", nn::kTraining, hub::Backend::CPU)->ref->repo, "acme/norm");
  EXPECT_EQ(nn::KernelConfig::parse_text(R"({"RMSNorm": "acme/norm"})").layers(), project.layers());
  const auto local =
      nn::KernelConfig::parse_text(R"({"kernel_mapping": {"SiLU": "/opt/act:SiLU"}, "use_local_kernel": true})");
  EXPECT_TRUE(local.use_local_kernel());
  ASSERT_EQ(local.entries().size(), 1u);
  EXPECT_EQ(local.entries()[0].first, "SiLU");
  EXPECT_TRUE(local.entries()[0].second.ref->is_local());

  EXPECT_TRUE(mapping_fails("[]", "the mapping must be a JSON object, got array"));
  EXPECT_TRUE(mapping_fails("3", "the mapping must be a JSON object, got number"));
  EXPECT_TRUE(mapping_fails(R"({"kernel_mapping": []})", "the mapping must be a JSON object, got array"));
  EXPECT_TRUE(mapping_fails(R"({"kernel_mapping": {}, "kernels": {}})", "unknown key 'kernels' beside kernel_mapping"));
  EXPECT_TRUE(
      mapping_fails(R"({"kernel_mapping": {}, "use_local_kernel": 1})", "use_local_kernel: expected true or false"));
  // An unknown layer name says which forms are accepted.
  EXPECT_TRUE(mapping_fails(R"({"kernel_mappings": {}})",
                            "unknown layer name 'kernel_mappings' (known: RMSNorm"));
  EXPECT_TRUE(mapping_fails(R"({"kernel_mappings": {}})", "or a project file {\"kernel_mapping\": {...}}"));
}

}  // namespace
}  // namespace kcpp
