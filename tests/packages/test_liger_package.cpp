// Package "liger" through the ABI, as a host calls it: the built library loaded, its layers called
// with named arguments (docs/contracts/), results against the f64 oracle.  The kernels' numerics are
// covered in depth by packages/liger/*/test_*.cpp (every tuning variant, the 2x-reference bound); here
// every argument of every contract is exercised at least once, so that a wrong mapping from the
// contract to the kernel (a stride, a layout string, an alias) shows up as an O(1) error, and bad
// input is refused with a message naming the argument.
#include <functional>
#include <random>

#include "core/allocator.h"
#include "core/cuda_runtime.h"
#include "oracle.h"
#include "ops/nn/cross_entropy.h"
#include "ops/nn/glu.h"
#include "ops/nn/rms_norm.h"
#include "ops/nn/rope.h"
#include "ops/ops.h"
#include "package_util.h"
#include "test_util.h"

namespace kcpp {
namespace {

using nn::KernelArgs;
using nn::KernelLayer;

KernelLayer layer(const char* name) { return KernelLayer::find(test::built_package("liger"), name); }

class LigerPackage : public ::testing::TestWithParam<Device> {};

TEST_P(LigerPackage, TableNamesEveryLayerAndContract) {
  const auto pkg = test::built_package("liger");
  EXPECT_STREQ(pkg->table().name, "liger");
  const std::pair<const char*, const char*> expect[] = {{"LigerRMSNorm", "RMSNorm/1"},
                                                        {"LigerAddRMSNorm", "AddRMSNorm/1"},
                                                        {"LigerLayerNorm", "LayerNorm/1"},
                                                        {"LigerGLU", "GLU/1"},
                                                        {"LigerRotaryEmbedding", "rotary_pos_emb/1"},
                                                        {"LigerCrossEntropy", "CrossEntropyLoss/1"},
                                                        {"LigerFusedLinearCrossEntropy", "ForCausalLMLoss/1"}};
  for (const auto& [name, contract] : expect) {
    const KernelLayer l = layer(name);
    EXPECT_STREQ(l.info().contract, contract) << name;
    EXPECT_TRUE(l.has_backward()) << name;
    EXPECT_TRUE(l.runs_on(Device::cpu())) << name;
  }
  EXPECT_THROW(layer("LigerNoSuchLayer"), Error);
}

// Each package is staged in its own memory file; dlopen must not mistake the second for the first
// (it did, when the file's /proc/self/fd path was reused after the first load).
TEST(PackageLoading, TwoPackagesInOneProcessStayDistinct) {
  const auto liger = test::built_package("liger"), activation = test::built_package("activation");
  EXPECT_STREQ(liger->table().name, "liger");
  EXPECT_STREQ(activation->table().name, "activation");
  EXPECT_NE(&liger->table(), &activation->table());
}

// ---- RMSNorm/1 ---------------------------------------------------------------------------------

TEST_P(LigerPackage, RMSNormMatchesTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer norm = layer("LigerRMSNorm");
  const char* castings[] = {"llama", "gemma", "none"};
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (int64_t h : {1, 7, 111, 4097})
      for (int c = 0; c < 3; ++c)
        for (double offset : {0.0, 1.0}) {
          // x is [2, 3, h] viewed from a wider buffer (rows strided), dy is [6, h]-compatible 3-D.
          const Tensor x = Tensor::randn({2, 3, h + 5}, dt, dev, gen, 0.1, 1.5).narrow(2, 0, h);
          const Tensor w = Tensor::randn({h}, dt, dev, gen);
          const Tensor dy = Tensor::randn({2, 3, h}, dt, dev, gen);
          const Tensor y = Tensor::empty({2, 3, h}, dt, dev), rstd = Tensor::empty({6}, DType::f32, dev);
          const std::string cfg = fmt::format("{} h={} casting={} offset={}", test::config_name(dev, dt), h, castings[c], offset);
          KernelArgs f;
          f.tensor("x", x).tensor("weight", w).real("eps", 1e-5).real("offset", offset).string("casting", castings[c]);
          f.tensor("y", y).tensor("rstd", rstd);
          ASSERT_TRUE(norm.supports(f, dev, test::kTraining).ok()) << cfg;
          norm.forward(f, dev, test::kTraining);
          const auto xv = x.to_f64_vector(), wv = w.to_f64_vector();
          const auto fo = oracle::rms_norm(xv, wv, 6, h, 1e-5, offset);
          EXPECT_LE(test::rel_l2_error(y, fo.y), test::composite_rel_l2(dt)) << cfg << " y";
          EXPECT_LE(test::rel_l2_error(rstd, fo.rstd), test::composite_rel_l2(DType::f32)) << cfg << " rstd";

          // Backward in place (dx over dy) and out of place give the same bits.
          const auto bo = oracle::rms_norm_backward(dy.to_f64_vector(), xv, wv, 6, h, 1e-5, offset);
          const Tensor dx = Tensor::empty({2, 3, h}, dt, dev), dw = Tensor::empty({h}, dt, dev);
          const Tensor dy2 = dy.clone(), dw2 = Tensor::empty({h}, dt, dev);
          for (const auto& [dxt, dyt, dwt] : {std::tuple{dx, dy, dw}, std::tuple{dy2, dy2, dw2}}) {
            KernelArgs b;
            b.tensor("dy", dyt).tensor("x", x).tensor("weight", w).tensor("rstd", rstd).real("eps", 1e-5);
            b.real("offset", offset).string("casting", castings[c]).tensor("dx", dxt).tensor("dweight", dwt);
            norm.backward(b, dev, test::kTraining);
          }
          EXPECT_TRUE(test::close_l2_mag(dx, bo.dx, bo.dx_mag, test::composite_rel_l2(dt))) << cfg << " dx";
          EXPECT_TRUE(test::close_l2_mag(dw, bo.dw, bo.dw_mag, test::composite_rel_l2(dt))) << cfg << " dweight";
          EXPECT_EQ(dy2.to_f64_vector(), dx.to_f64_vector()) << cfg << " in-place dx";
          EXPECT_EQ(dw2.to_f64_vector(), dw.to_f64_vector()) << cfg << " dweight beside the in-place dx";
        }
}

TEST_P(LigerPackage, RMSNormOptionalOutputsAndRefusals) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer norm = layer("LigerRMSNorm");
  const Tensor x = Tensor::randn({5, 64}, DType::bf16, dev, gen), w = Tensor::randn({64}, DType::bf16, dev, gen);
  const auto ref = ops::rms_norm_forward(x, w);
  {  // Inference without rstd (the kernel takes scratch from the workspace), defaults for eps / casting.
    const Tensor y = Tensor::empty({5, 64}, DType::bf16, dev);
    KernelArgs a;
    a.tensor("x", x).tensor("weight", w).tensor("y", y).none("rstd");
    norm.forward(a, dev, test::kInference);
    EXPECT_TRUE(test::close_l2(y, ref.y.to_f64_vector(), test::composite_rel_l2(DType::bf16)));
  }
  {  // Training without rstd: backward would need it.
    KernelArgs a;
    a.tensor("x", x).tensor("weight", w).tensor("y", Tensor::empty({5, 64}, DType::bf16, dev));
    EXPECT_TRUE(test::refused(norm.supports(a, dev, test::kTraining), KCPP_ERROR_INVALID_ARGUMENT, "'rstd'"));
  }
  const Tensor y = Tensor::empty({5, 64}, DType::bf16, dev), rstd = Tensor::empty({5}, DType::f32, dev);
  auto args = [&](KernelArgs& a, const Tensor& xx, const Tensor& ww, const Tensor& yy, const char* casting) {
    a.tensor("x", xx).tensor("weight", ww).tensor("y", yy).tensor("rstd", rstd).string("casting", casting);
  };
  struct Bad {
    Tensor x, w, y;
    const char* casting;
    kcpp_status status;
    const char* needle;
  };
  const Bad bad[] = {
      {x, Tensor::randn({63}, DType::bf16, dev, gen), y, "llama", KCPP_ERROR_INVALID_ARGUMENT, "'weight' has 63"},
      {x, w.to(DType::f32), y, "llama", KCPP_ERROR_INVALID_ARGUMENT, "'weight' is f32"},
      {x, w, Tensor::empty({5, 65}, DType::bf16, dev), "llama", KCPP_ERROR_INVALID_ARGUMENT, "'y' has shape [5, 65]"},
      {x, w, y, "mistral", KCPP_ERROR_INVALID_ARGUMENT, "'casting' is 'mistral'"},
      {x.transpose(0, 1), Tensor::randn({5}, DType::bf16, dev, gen), Tensor::empty({64, 5}, DType::bf16, dev), "llama",
       KCPP_ERROR_UNSUPPORTED, "last dim must be contiguous"},
      {x.to(DType::f64), w, y, "llama", KCPP_ERROR_UNSUPPORTED, "dtype f64"},
  };
  for (const Bad& b : bad) {
    KernelArgs a;
    args(a, b.x, b.w, b.y, b.casting);
    EXPECT_TRUE(test::refused(norm.supports(a, dev, test::kTraining), b.status, b.needle));
    try {
      norm.forward(a, dev, test::kTraining);
      ADD_FAILURE() << "forward accepted a call supports() refused: " << b.needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(b.needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("liger 0.1.0: LigerRMSNorm (RMSNorm/1)"), std::string::npos) << e.what();
    }
  }
  KernelArgs missing;
  missing.tensor("x", x).tensor("y", y);
  EXPECT_TRUE(test::refused(norm.supports(missing, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT,
                            "missing tensor argument 'weight'"));
  // An argument the call does not read is refused naming it, not ignored: a misspelt "eps" (the norm
  // would otherwise run with the default), and a backward output in a forward call.
  for (const char* unread : {"epsilon", "dx"}) {
    KernelArgs a;
    args(a, x, w, y, "llama");
    if (std::string(unread) == "dx") a.tensor("dx", Tensor::empty({5, 64}, DType::bf16, dev));
    else a.real(unread, 1e-5);
    const std::string needle = std::string("argument '") + unread + "' is not one this call reads";
    EXPECT_TRUE(test::refused(norm.supports(a, dev, test::kTraining), KCPP_ERROR_INVALID_ARGUMENT, needle));
    EXPECT_THROW(norm.forward(a, dev, test::kTraining), Error) << unread;
  }
  if (dev.is_cpu()) {  // a tensor on the wrong device
    KernelArgs a;
    args(a, x, w, y, "llama");
    // The CPU variant does not run on CUDA at all; the CUDA variant refuses CPU tensors in a CUDA call.
    const nn::KernelStatus s = norm.supports(a, Device::cuda(0), test::kTraining);
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message.find("cuda"), std::string::npos) << s.message;
  }
}

// ---- LayerNorm/1 --------------------------------------------------------------------------------

TEST_P(LigerPackage, LayerNormMatchesTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer norm = layer("LigerLayerNorm");
  for (DType dt : {DType::f32, DType::bf16})
    for (int64_t h : {1, 7, 4096, 4097})
      for (bool bias : {false, true}) {
        const std::string cfg = fmt::format("{} h={} bias={}", test::config_name(dev, dt), h, bias);
        const Tensor x = Tensor::randn({2, 3, h}, dt, dev, gen, 1.0, 2.0), w = Tensor::randn({h}, dt, dev, gen);
        const Tensor b = bias ? Tensor::randn({h}, dt, dev, gen) : Tensor();
        const Tensor dy = Tensor::randn({2, 3, h}, dt, dev, gen), y = Tensor::empty({2, 3, h}, dt, dev);
        const Tensor mean = Tensor::empty({6}, DType::f32, dev), rstd = Tensor::empty({6}, DType::f32, dev);
        KernelArgs f;
        f.tensor("x", x).tensor("weight", w).tensor("bias", b).real("eps", 1e-5).tensor("y", y);
        f.tensor("mean", mean).tensor("rstd", rstd);
        norm.forward(f, dev, test::kTraining);
        const auto xv = x.to_f64_vector(), wv = w.to_f64_vector();
        const auto fo = oracle::layer_norm(xv, wv, bias ? b.to_f64_vector() : oracle::V{}, 6, h, 1e-5);
        EXPECT_LE(test::rel_l2_error(y, fo.y), test::composite_rel_l2(dt)) << cfg << " y";
        EXPECT_LE(test::rel_l2_error(mean, fo.mean), 1e-5) << cfg << " mean";
        const auto bo = oracle::layer_norm_backward(dy.to_f64_vector(), xv, wv, 6, h, 1e-5);
        const Tensor dx = Tensor::empty({2, 3, h}, dt, dev), dw = Tensor::empty({h}, dt, dev), db = Tensor::empty({h}, dt, dev);
        KernelArgs bw;
        bw.tensor("dy", dy).tensor("x", x).tensor("weight", w).tensor("mean", mean).tensor("rstd", rstd);
        bw.tensor("dx", dx).tensor("dweight", dw).tensor("dbias", db);
        norm.backward(bw, dev, test::kTraining);
        EXPECT_TRUE(test::close_l2_mag(dx, bo.dx, bo.dx_mag, test::composite_rel_l2(dt))) << cfg << " dx";
        EXPECT_TRUE(test::close_l2_mag(dw, bo.dw, bo.dw_mag, test::composite_rel_l2(dt))) << cfg << " dweight";
        EXPECT_LE(test::rel_l2_error(db, bo.db), test::composite_rel_l2(dt)) << cfg << " dbias";
      }
  const Tensor x = Tensor::randn({3, 8}, DType::bf16, dev, gen), w = Tensor::randn({8}, DType::bf16, dev, gen);
  KernelArgs no_stats;
  no_stats.tensor("x", x).tensor("weight", w).tensor("y", Tensor::empty({3, 8}, DType::bf16, dev));
  EXPECT_TRUE(test::refused(norm.supports(no_stats, dev, test::kTraining), KCPP_ERROR_INVALID_ARGUMENT, "'mean' and 'rstd'"));
  KernelArgs bad_bias;
  bad_bias.tensor("x", x).tensor("weight", w).tensor("bias", Tensor::zeros({9}, DType::bf16, dev));
  bad_bias.tensor("y", Tensor::empty({3, 8}, DType::bf16, dev));
  EXPECT_TRUE(test::refused(norm.supports(bad_bias, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "'bias' has 9"));
}

// ---- AddRMSNorm/1 -----------------------------------------------------------------------------

TEST_P(LigerPackage, AddRMSNormMatchesTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer norm = layer("LigerAddRMSNorm");
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (int64_t h : {1, 7, 111, 4096, 4097})
      for (bool in_place : {false, true})  // residual_out written over residual (the residual stream in place)
        for (bool strided : {false, true}) {
          const int64_t rows = h >= 4096 ? 5 : 23;
          const std::string cfg = fmt::format("{} h={} in_place={} strided={}", test::config_name(dev, dt), h, in_place, strided);
          const Tensor x = strided ? Tensor::randn({rows, h + 3}, dt, dev, gen).narrow(1, 0, h) : Tensor::randn({rows, h}, dt, dev, gen);
          const Tensor res = Tensor::randn({rows, h}, dt, dev, gen, 0.2, 2.0), w = Tensor::randn({h}, dt, dev, gen);
          const Tensor dy = Tensor::randn({rows, h}, dt, dev, gen), dres = Tensor::randn({rows, h}, dt, dev, gen);
          const Tensor r_ref = ops::add(x, res);  // eager: one rounding to the dtype
          const Tensor res_io = res.clone();
          const Tensor rout = in_place ? res_io : Tensor::empty({rows, h}, dt, dev);
          const Tensor y = Tensor::empty({rows, h}, dt, dev), rstd = Tensor::empty({rows}, DType::f32, dev);
          KernelArgs f;
          f.tensor("x", x).tensor("residual", res_io).tensor("weight", w).tensor("y", y).tensor("residual_out", rout);
          f.tensor("rstd", rstd).real("eps", 1e-6);
          norm.forward(f, dev, test::kTraining);
          EXPECT_EQ(rout.to_f64_vector(), r_ref.to_f64_vector()) << cfg << " residual_out must be round(x + residual)";
          const auto rv = r_ref.to_f64_vector(), wv = w.to_f64_vector();
          const auto fo = oracle::rms_norm(rv, wv, rows, h, 1e-6, 0.0);
          EXPECT_LE(test::rel_l2_error(y, fo.y), test::composite_rel_l2(dt)) << cfg << " y";
          // Backward: dx = the RMSNorm gradient at r + dresidual_out.
          auto bo = oracle::rms_norm_backward(dy.to_f64_vector(), rv, wv, rows, h, 1e-6, 0.0);
          const auto dv = dres.to_f64_vector();
          for (size_t i = 0; i < bo.dx.size(); ++i) {
            bo.dx[i] += dv[i];
            bo.dx_mag[i] += std::fabs(dv[i]);
          }
          const Tensor dx = Tensor::empty({rows, h}, dt, dev), dw = Tensor::empty({h}, dt, dev);
          KernelArgs b;
          b.tensor("dy", dy).tensor("dresidual_out", dres).tensor("residual_out", rout).tensor("weight", w);
          b.tensor("rstd", rstd).real("eps", 1e-6).tensor("dx", dx).tensor("dweight", dw);
          norm.backward(b, dev, test::kTraining);
          EXPECT_TRUE(test::close_l2_mag(dx, bo.dx, bo.dx_mag, test::composite_rel_l2(dt))) << cfg << " dx";
          EXPECT_TRUE(test::close_l2_mag(dw, bo.dw, bo.dw_mag, test::composite_rel_l2(dt))) << cfg << " dweight";
        }
  const Tensor x = Tensor::randn({3, 8}, DType::bf16, dev, gen), w = Tensor::randn({8}, DType::bf16, dev, gen);
  KernelArgs no_residual;
  no_residual.tensor("x", x).tensor("weight", w).tensor("y", Tensor::empty({3, 8}, DType::bf16, dev));
  no_residual.tensor("residual_out", Tensor::empty({3, 8}, DType::bf16, dev));
  EXPECT_TRUE(test::refused(norm.supports(no_residual, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT,
                            "missing tensor argument 'residual'"));
  KernelArgs alias;
  alias.tensor("x", x).tensor("residual", x.clone()).tensor("weight", w).tensor("y", x).tensor("residual_out", Tensor::empty({3, 8}, DType::bf16, dev));
  EXPECT_TRUE(test::refused(norm.supports(alias, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "'y' must not be"));
}

// ---- GLU/1 -----------------------------------------------------------------------------------------

TEST_P(LigerPackage, GLUMatchesTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer glu = layer("LigerGLU");
  const std::pair<const char*, oracle::Act> acts[] = {{"silu", oracle::Act::Silu},
                                                      {"gelu", oracle::Act::Gelu},
                                                      {"gelu_tanh", oracle::Act::GeluTanh},
                                                      {"gelu_pytorch_tanh", oracle::Act::GeluTanh},
                                                      {"quick_gelu", oracle::Act::QuickGelu}};
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (const auto& [name, act] : acts)
      for (int64_t n : {1, 7, 4097}) {
        const std::string cfg = fmt::format("{} act={} n={}", test::config_name(dev, dt), name, n);
        const Tensor g = Tensor::randn({3, n}, dt, dev, gen, 0, 2), u = Tensor::randn({3, n}, dt, dev, gen);
        const Tensor d = Tensor::randn({3, n}, dt, dev, gen), out = Tensor::empty({3, n}, dt, dev);
        KernelArgs f;
        f.tensor("gate", g).tensor("up", u).string("activation", name).tensor("out", out);
        glu.forward(f, dev, test::kTraining);
        const auto gv = g.to_f64_vector(), uv = u.to_f64_vector(), dv = d.to_f64_vector();
        const auto mag = oracle::glu_magnitude(dv, gv, uv, act);
        EXPECT_TRUE(test::close_l2_mag(out, oracle::glu(gv, uv, act), mag.out, test::composite_rel_l2(dt))) << cfg;
        // Backward with the gradients written over gate and up (Liger's memory saving).
        oracle::V dg, du;
        oracle::glu_backward(dv, gv, uv, act, dg, du);
        const Tensor g2 = g.clone(), u2 = u.clone();
        KernelArgs b;
        b.tensor("dout", d).tensor("gate", g2).tensor("up", u2).string("activation", name);
        b.tensor("dgate", g2).tensor("dup", u2);
        glu.backward(b, dev, test::kTraining);
        EXPECT_TRUE(test::close_l2_mag(g2, dg, mag.dgate, test::composite_rel_l2(dt))) << cfg << " dgate";
        EXPECT_TRUE(test::close_l2_mag(u2, du, mag.dup, test::composite_rel_l2(dt))) << cfg << " dup";
      }
  const Tensor g = Tensor::zeros({4, 6}, DType::bf16, dev);
  KernelArgs a;
  a.tensor("gate", g).tensor("up", g).string("activation", "relu").tensor("out", g);
  EXPECT_TRUE(test::refused(glu.supports(a, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "'activation' is 'relu'"));
  KernelArgs t;
  t.tensor("gate", g.transpose(0, 1)).tensor("up", Tensor::zeros({6, 4}, DType::bf16, dev)).tensor("out", Tensor::zeros({6, 4}, DType::bf16, dev));
  EXPECT_TRUE(test::refused(glu.supports(t, dev, test::kInference), KCPP_ERROR_UNSUPPORTED,
                            "tensor 'gate': the last dim must be contiguous"));
  // The halves of a packed [rows, 2I] gate_up (Phi-3's MLP) are taken as rows with a stride, the
  // gradients written into the halves of one buffer.
  {
    Generator gen = test::test_generator();
    const Tensor gu = Tensor::randn({5, 2, 24}, DType::f32, dev, gen), d = Tensor::randn({5, 2, 12}, DType::f32, dev, gen);
    const Tensor gate = gu.narrow(2, 0, 12), up = gu.narrow(2, 12, 12), out = Tensor::empty({5, 2, 12}, DType::f32, dev);
    KernelArgs f;
    f.tensor("gate", gate).tensor("up", up).string("activation", "silu").tensor("out", out);
    glu.forward(f, dev, test::kTraining);
    const auto gv = gate.contiguous().to_f64_vector(), uv = up.contiguous().to_f64_vector(), dv = d.to_f64_vector();
    const auto mag = oracle::glu_magnitude(dv, gv, uv, oracle::Act::Silu);
    EXPECT_TRUE(test::close_l2_mag(out, oracle::glu(gv, uv, oracle::Act::Silu), mag.out, test::composite_rel_l2(DType::f32)));
    const Tensor dgu = Tensor::empty({5, 2, 24}, DType::f32, dev);
    KernelArgs b;
    b.tensor("dout", d).tensor("gate", gate).tensor("up", up).string("activation", "silu");
    b.tensor("dgate", dgu.narrow(2, 0, 12)).tensor("dup", dgu.narrow(2, 12, 12));
    glu.backward(b, dev, test::kTraining);
    oracle::V dg, du;
    oracle::glu_backward(dv, gv, uv, oracle::Act::Silu, dg, du);
    EXPECT_TRUE(test::close_l2_mag(dgu.narrow(2, 0, 12).contiguous(), dg, mag.dgate, test::composite_rel_l2(DType::f32)));
    EXPECT_TRUE(test::close_l2_mag(dgu.narrow(2, 12, 12).contiguous(), du, mag.dup, test::composite_rel_l2(DType::f32)));
  }
  KernelArgs same;
  same.tensor("dout", g).tensor("gate", g).tensor("up", g).tensor("dgate", g).tensor("dup", g);
  EXPECT_TRUE(test::refused(glu.supports(same, dev, test::kTraining), KCPP_ERROR_INVALID_ARGUMENT, "different tensors"));
}

// ---- rotary_pos_emb/1 ----------------------------------------------------------------------------

TEST_P(LigerPackage, RotaryEmbeddingMatchesTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer rope = layer("LigerRotaryEmbedding");
  const int64_t b = 2, s = 5, hq = 4, hk = 2, d = 24;
  for (DType dt : {DType::f32, DType::bf16})
    for (const char* layout : {"bhsd", "bshd"})
      for (const char* style : {"rotate_half", "interleaved"})
        for (int64_t rd : {24, 8})
          for (bool in_place : {false, true}) {
            const bool bshd = std::string(layout) == "bshd", il = std::string(style) == "interleaved";
            const std::string cfg = fmt::format("{} layout={} style={} rd={} in_place={}", test::config_name(dev, dt),
                                                layout, style, rd, in_place);
            std::vector<int64_t> pos(static_cast<size_t>(b * s));
            for (int64_t i = 0; i < b * s; ++i) pos[i] = 3 * i + 1;
            const auto cs = ops::rope_cos_sin(Tensor::from_i64(pos, {b, s}, DType::i64, dev), ops::rope_inv_freq(rd, 10000.0, dev), 1.0, dt);
            auto make = [&](int64_t h) {
              return bshd ? Tensor::randn({b, s, h, d}, dt, dev, gen) : Tensor::randn({b, h, s, d}, dt, dev, gen);
            };
            // The oracle takes [B, H, S, D]: bshd tensors are transposed views of their data.
            auto bhsd = [&](const Tensor& t) { return bshd ? t.transpose(1, 2) : t; };
            for (bool backward : {false, true}) {
              const Tensor q = make(hq), k = make(hk);
              const auto qv = bhsd(q).to_f64_vector(), kv = bhsd(k).to_f64_vector();
              const Tensor qo = in_place ? q : Tensor::empty(q.shape(), dt, dev), ko = in_place ? k : Tensor::empty(k.shape(), dt, dev);
              KernelArgs a;
              a.tensor(backward ? "dq_out" : "q", q).tensor(backward ? "dk_out" : "k", k).tensor("cos", cs.cos).tensor("sin", cs.sin);
              a.string("layout", layout).string("style", style).tensor(backward ? "dq" : "q_out", qo).tensor(backward ? "dk" : "k_out", ko);
              backward ? rope.backward(a, dev, test::kTraining) : rope.forward(a, dev, test::kTraining);
              const auto cv = cs.cos.to_f64_vector(), sv = cs.sin.to_f64_vector();
              EXPECT_LE(test::rel_l2_error(bhsd(qo), oracle::rope(qv, cv, sv, b, hq, s, d, rd, b, backward, il)),
                        test::composite_rel_l2(dt)) << cfg << " q backward=" << backward;
              EXPECT_LE(test::rel_l2_error(bhsd(ko), oracle::rope(kv, cv, sv, b, hk, s, d, rd, b, backward, il)),
                        test::composite_rel_l2(dt)) << cfg << " k backward=" << backward;
            }
          }
  // q alone (k absent), cos / sin shared by the batch as [S, rd].
  const Tensor q = Tensor::randn({b, hq, s, d}, DType::f32, dev, gen), qo = Tensor::empty({b, hq, s, d}, DType::f32, dev);
  std::vector<int64_t> pos(static_cast<size_t>(s));
  for (int64_t i = 0; i < s; ++i) pos[i] = i;
  const auto cs = ops::rope_cos_sin(Tensor::from_i64(pos, {1, s}, DType::i64, dev), ops::rope_inv_freq(d, 10000.0, dev), 1.0, DType::f32);
  const Tensor c2 = cs.cos.view({s, d}), s2 = cs.sin.view({s, d});
  KernelArgs a;
  a.tensor("q", q).tensor("cos", c2).tensor("sin", s2).tensor("q_out", qo);
  rope.forward(a, dev, test::kInference);
  EXPECT_LE(test::rel_l2_error(qo, oracle::rope(q.to_f64_vector(), c2.to_f64_vector(), s2.to_f64_vector(), b, hq, s, d, d, 1, false)),
            test::composite_rel_l2(DType::f32));
  KernelArgs bad;
  bad.tensor("q", q).tensor("cos", Tensor::zeros({s, 7}, DType::f32, dev)).tensor("sin", Tensor::zeros({s, 7}, DType::f32, dev)).tensor("q_out", qo);
  EXPECT_TRUE(test::refused(rope.supports(bad, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "rotary_dim"));
  KernelArgs bad_layout;
  bad_layout.tensor("q", q).tensor("cos", c2).tensor("sin", s2).tensor("q_out", qo).string("layout", "sbhd");
  EXPECT_TRUE(test::refused(rope.supports(bad_layout, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "'layout' is 'sbhd'"));
  KernelArgs bad_k;
  bad_k.tensor("q", q).tensor("k", Tensor::zeros({b, 2, s + 1, d}, DType::f32, dev)).tensor("cos", c2).tensor("sin", s2);
  bad_k.tensor("q_out", qo).tensor("k_out", Tensor::zeros({b, 2, s + 1, d}, DType::f32, dev));
  EXPECT_TRUE(test::refused(rope.supports(bad_k, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "must match 'q'"));
}

// ---- CrossEntropyLoss/1 --------------------------------------------------------------------------

TEST_P(LigerPackage, CrossEntropyMatchesTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer ce = layer("LigerCrossEntropy");
  for (DType dt : {DType::f32, DType::bf16})
    for (int64_t v : {1, 3, 50257})
      for (const char* red : {"mean", "sum", "none"})
        for (double eps : {0.0, 0.1})
          for (bool in_place : {false, true}) {
            const int64_t n = v > 1000 ? 5 : 13;
            const std::string cfg = fmt::format("{} v={} reduction={} eps={} in_place={}", test::config_name(dev, dt), v, red, eps, in_place);
            const Tensor logits = Tensor::randn({n, v}, dt, dev, gen, 0, 3);
            std::vector<int64_t> t(static_cast<size_t>(n));
            std::uniform_int_distribution<int64_t> pick(0, v - 1);
            for (int64_t i = 0; i < n; ++i) t[i] = i % 4 == 1 ? -7 : pick(gen.engine());
            const Tensor targets = Tensor::from_i64(t, {n}, v == 3 ? DType::i32 : DType::i64, dev);
            const auto lv = logits.to_f64_vector();
            int64_t count = 0;
            const auto rows = oracle::cross_entropy_rows(lv, t, n, v, -7, eps, count);
            double total = 0;
            for (double r : rows) total += r;
            const bool none = std::string(red) == "none", mean = std::string(red) == "mean";
            const std::vector<double> ref_loss = none ? rows : std::vector<double>{mean ? total / count : total};
            // Backward with dloss = 0.5 (a float) or a per-row tensor (reduction none).
            std::vector<double> dl(static_cast<size_t>(n), 0.5);
            if (none)
              for (int64_t i = 0; i < n; ++i) dl[i] = 0.25 * static_cast<double>(i % 3 + 1);
            std::vector<double> g = dl, mag;
            if (mean)
              for (double& x : g) x /= static_cast<double>(count);
            const auto ref_grad = oracle::cross_entropy_backward(lv, t, g, n, v, -7, eps, &mag);

            const Tensor work = in_place ? logits.clone() : logits;
            const Tensor grad = in_place ? work : Tensor::empty({n, v}, dt, dev);
            const Tensor loss = Tensor::empty({none ? n : 1}, DType::f32, dev);
            KernelArgs f;
            f.tensor("logits", work).tensor("targets", targets).integer("ignore_index", -7).real("label_smoothing", eps);
            f.string("reduction", red).tensor("loss", loss).tensor("grad", grad);
            ce.forward(f, dev, test::kTraining);
            EXPECT_LE(test::rel_l2_error(loss, ref_loss), test::composite_rel_l2(dt)) << cfg << " loss";
            KernelArgs b;
            const Tensor dloss = none ? Tensor::from_f64(dl, {n}, DType::f32, dev) : Tensor();
            if (none) b.tensor("dloss", dloss);
            else b.real("dloss", 0.5);
            b.tensor("grad", grad).tensor("dlogits", grad);
            ce.backward(b, dev, test::kTraining);
            EXPECT_TRUE(test::close_l2_mag(grad, ref_grad, mag, test::composite_rel_l2(dt))) << cfg << " dlogits";
          }
}

// z-loss, softcap, class weights ("weight") and token weights through the ABI, for both loss layers.
TEST_P(LigerPackage, LossOptionsMatchTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const int64_t n = 11, h = 24, v = 97;
  const Tensor hidden = Tensor::randn({n, h}, DType::f32, dev, gen), weight = Tensor::randn({v, h}, DType::f32, dev, gen, 0, 0.5);
  const Tensor cw = Tensor::uniform({v}, DType::f32, dev, gen, 0.5, 1.5), tw = Tensor::uniform({n}, DType::f32, dev, gen, 0, 2);
  std::vector<int64_t> t(static_cast<size_t>(n));
  std::uniform_int_distribution<int64_t> pick(0, v - 1);
  for (int64_t i = 0; i < n; ++i) t[i] = i % 3 == 2 ? -100 : pick(gen.engine());
  const Tensor targets = Tensor::from_i64(t, {n}, DType::i64, dev);
  oracle::CEOptions o;
  o.smoothing = 0.1, o.softcap = 4.0, o.z_loss = 0.02, o.class_weight = cw.to_f64_vector(), o.token_weight = tw.to_f64_vector();
  const auto xv = hidden.to_f64_vector(), wv = weight.to_f64_vector();
  const auto lv = oracle::matmul(xv, wv, 1, n, v, h, false, true, false);
  double divisor = 0;
  const auto rows = oracle::cross_entropy_rows(lv, t, n, v, o, divisor);
  double total = 0;
  for (double r : rows) total += r;
  std::vector<double> g(static_cast<size_t>(n), 1.0 / divisor);
  const auto ref_grad = oracle::cross_entropy_backward(lv, t, g, n, v, o);
  auto options = [&](KernelArgs& a, const char* class_weight_name) {
    a.real("label_smoothing", 0.1).real("softcap", 4.0).real("lse_square_scale", 0.02);
    a.tensor(class_weight_name, cw).tensor("token_weight", tw);
  };
  {  // CrossEntropyLoss/1 on the materialized logits
    const Tensor logits = ops::matmul(hidden, weight, false, true), grad = Tensor::empty({n, v}, DType::f32, dev);
    const Tensor loss = Tensor::empty({1}, DType::f32, dev);
    KernelArgs f;
    f.tensor("logits", logits).tensor("targets", targets).tensor("loss", loss).tensor("grad", grad);
    options(f, "weight");
    layer("LigerCrossEntropy").forward(f, dev, test::kTraining);
    EXPECT_LE(test::rel_l2_error(loss, {total / divisor}), 1e-5);
    EXPECT_LE(test::rel_l2_error(grad, ref_grad), 1e-5);
  }
  {  // ForCausalLMLoss/1
    const Tensor loss = Tensor::empty({1}, DType::f32, dev), dhidden = Tensor::empty({n, h}, DType::f32, dev);
    const Tensor dweight = Tensor::empty({v, h}, DType::f32, dev);
    KernelArgs f;
    f.tensor("hidden", hidden).tensor("weight", weight).tensor("targets", targets).tensor("loss", loss);
    f.tensor("dhidden", dhidden).tensor("dweight", dweight).integer("chunk_rows", 4);
    options(f, "class_weight");
    layer("LigerFusedLinearCrossEntropy").forward(f, dev, test::kTraining);
    EXPECT_LE(test::rel_l2_error(loss, {total / divisor}), 1e-5);
    EXPECT_LE(test::rel_l2_error(dhidden, oracle::matmul(ref_grad, wv, 1, n, h, v, false, false, false)), 1e-5);
    EXPECT_LE(test::rel_l2_error(dweight, oracle::matmul(ref_grad, xv, 1, v, h, n, true, false, false)), 1e-5);
  }
}

TEST_P(LigerPackage, CrossEntropyRefusals) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const KernelLayer ce = layer("LigerCrossEntropy");
  const Tensor logits = Tensor::zeros({4, 10}, DType::bf16, dev), loss = Tensor::empty({1}, DType::f32, dev);
  const Tensor targets = Tensor::from_i64(std::vector<int64_t>{1, 2, 3, 4}, {4}, DType::i64, dev);
  auto base = [&](KernelArgs& a) { a.tensor("logits", logits).tensor("targets", targets).tensor("loss", loss); };
  {
    KernelArgs a;
    base(a);
    a.real("softcap", -30.0);
    EXPECT_TRUE(test::refused(ce.supports(a, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "'softcap' = -30"));
  }
  {
    KernelArgs a;
    base(a);
    const Tensor w9 = Tensor::full({9}, 1.0, DType::f32, dev);
    a.tensor("weight", w9);
    EXPECT_TRUE(test::refused(ce.supports(a, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "'weight' must have 10"));
  }
  {
    KernelArgs a;
    base(a);
    const Tensor tw = Tensor::full({4}, 1.0, DType::bf16, dev);
    a.tensor("token_weight", tw);
    EXPECT_TRUE(test::refused(ce.supports(a, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "'token_weight' must be f32"));
  }
  {
    KernelArgs a;
    base(a);
    EXPECT_TRUE(test::refused(ce.supports(a, dev, test::kTraining), KCPP_ERROR_INVALID_ARGUMENT, "'grad'"));
  }
  {
    KernelArgs a;
    a.tensor("logits", logits).tensor("targets", targets.to(DType::f32)).tensor("loss", loss);
    EXPECT_TRUE(test::refused(ce.supports(a, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "i64 or i32"));
  }
  {
    KernelArgs a;
    a.tensor("logits", logits).tensor("targets", targets.narrow(0, 0, 3)).tensor("loss", loss);
    EXPECT_TRUE(test::refused(ce.supports(a, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "3 elements"));
  }
  {
    KernelArgs a;
    a.tensor("logits", logits).tensor("targets", targets).tensor("loss", loss).string("reduction", "none");
    EXPECT_TRUE(test::refused(ce.supports(a, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "'loss' must have 4"));
  }
  {
    KernelArgs a;
    a.tensor("grad", logits).tensor("dlogits", logits);
    EXPECT_TRUE(test::refused(ce.supports(a, dev, test::kTraining), KCPP_ERROR_INVALID_ARGUMENT, "'dloss'"));
  }
  if (dev.is_cpu()) {  // a target out of range: an error naming the row (CUDA: NaN loss, see cross_entropy.h)
    const Tensor bad = Tensor::from_i64(std::vector<int64_t>{1, 2, 10, 4}, {4}, DType::i64, dev);
    KernelArgs a;
    a.tensor("logits", logits).tensor("targets", bad).tensor("loss", loss);
    try {
      ce.forward(a, dev, test::kInference);
      ADD_FAILURE() << "an out-of-range target was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'targets'[2] = 10 is out of range"), std::string::npos) << e.what();
    }
  }
}

// ---- ForCausalLMLoss/1 -------------------------------------------------------------------------

// Every argument of the contract once: 3-D hidden (rows collapse), bias, i32 targets, a custom
// ignore_index, label smoothing, chunk_rows (several chunks), accum_dtype, grad_scale, accumulate,
// lse, and the backward with dloss a float and a device tensor.
TEST_P(LigerPackage, FusedLinearCrossEntropyMatchesTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer flce = layer("LigerFusedLinearCrossEntropy");
  const int64_t b = 3, s = 7, n = b * s, h = 40, v = 301;
  for (DType dt : {DType::f32, DType::bf16})
    for (const char* red : {"mean", "sum"})
      for (const char* accum : {"same", "f32"}) {
        const std::string cfg = fmt::format("{} reduction={} accum_dtype={}", test::config_name(dev, dt), red, accum);
        const Tensor hidden = Tensor::randn({b, s, h}, dt, dev, gen);
        const Tensor weight = Tensor::randn({v, h}, dt, dev, gen, 0, 0.3), bias = Tensor::randn({v}, dt, dev, gen);
        std::vector<int64_t> t(static_cast<size_t>(n));
        std::uniform_int_distribution<int64_t> pick(0, v - 1);
        for (int64_t i = 0; i < n; ++i) t[i] = i % 5 == 2 ? -7 : pick(gen.engine());
        const Tensor targets = Tensor::from_i64(t, {n}, DType::i32, dev);
        const Tensor loss = Tensor::empty({1}, DType::f32, dev), lse = Tensor::empty({n}, DType::f32, dev);
        const Tensor dhidden = Tensor::empty({b, s, h}, dt, dev);
        // dweight / dbias start at 1: accumulate adds to them.
        const Tensor dweight = Tensor::full({v, h}, 1.0, dt, dev), dbias = Tensor::full({v}, 1.0, dt, dev);
        KernelArgs f;
        f.tensor("hidden", hidden).tensor("weight", weight).tensor("bias", bias).tensor("targets", targets);
        f.integer("ignore_index", -7).real("label_smoothing", 0.05).string("reduction", red).real("grad_scale", 2.0);
        f.integer("accumulate", 1).string("accum_dtype", accum).integer("chunk_rows", 4);
        f.tensor("loss", loss).tensor("lse", lse).tensor("dhidden", dhidden).tensor("dweight", dweight).tensor("dbias", dbias);
        ASSERT_TRUE(flce.supports(f, dev, test::kTraining).ok()) << cfg;
        flce.forward(f, dev, test::kTraining);
        // Backward: x 0.25 (a float), then x 2 (a device value): the gradients end at grad_scale x 0.5 = 1.
        KernelArgs bw;
        bw.real("dloss", 0.25).tensor("dhidden", dhidden).tensor("dweight", dweight).tensor("dbias", dbias);
        flce.backward(bw, dev, test::kTraining);
        const Tensor two = Tensor::full({1}, 2.0, DType::f32, dev);
        KernelArgs bw2;
        bw2.tensor("dloss", two).tensor("dhidden", dhidden).tensor("dweight", dweight).tensor("dbias", dbias);
        flce.backward(bw2, dev, test::kTraining);

        const auto xv = hidden.to_f64_vector(), wv = weight.to_f64_vector(), bv = bias.to_f64_vector();
        auto lv = oracle::matmul(xv, wv, 1, n, v, h, false, true, false);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < v; ++j) lv[i * v + j] += bv[j];
        int64_t count = 0;
        const auto rows = oracle::cross_entropy_rows(lv, t, n, v, -7, 0.05, count);
        double total = 0;
        for (double r : rows) total += r;
        const bool mean = std::string(red) == "mean";
        EXPECT_LE(test::rel_l2_error(loss, {mean ? total / count : total}), test::composite_rel_l2(dt)) << cfg << " loss";
        std::vector<double> g(static_cast<size_t>(n), mean ? 1.0 / count : 1.0);
        const auto gv = oracle::cross_entropy_backward(lv, t, g, n, v, -7, 0.05);
        const auto ref_dx = oracle::matmul(gv, wv, 1, n, h, v, false, false, false);
        // The accumulated gradients were 1 before the call, and were scaled by 0.5 by the backward.
        auto ref_dw = oracle::matmul(gv, xv, 1, v, h, n, true, false, false);
        for (double& x : ref_dw) x += 0.5;
        std::vector<double> ref_db(static_cast<size_t>(v), 0.5);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < v; ++j) ref_db[j] += gv[i * v + j];
        EXPECT_LE(test::rel_l2_error(dhidden, ref_dx), test::composite_rel_l2(dt)) << cfg << " dhidden";
        EXPECT_LE(test::rel_l2_error(dweight, ref_dw), test::composite_rel_l2(dt)) << cfg << " dweight";
        EXPECT_LE(test::rel_l2_error(dbias, ref_db), test::composite_rel_l2(dt)) << cfg << " dbias";
        std::vector<double> ref_lse(static_cast<size_t>(n), 0.0);
        for (int64_t i = 0; i < n; ++i) {
          if (t[i] == -7) continue;
          double m = -1e300, z = 0;
          for (int64_t j = 0; j < v; ++j) m = std::max(m, lv[i * v + j]);
          for (int64_t j = 0; j < v; ++j) z += std::exp(lv[i * v + j] - m);
          ref_lse[i] = m + std::log(z);
        }
        EXPECT_LE(test::rel_l2_error(lse, ref_lse), test::composite_rel_l2(dt)) << cfg << " lse";
      }
  // Inference: the loss alone (reduction none), no gradient arguments.
  const Tensor hidden = Tensor::randn({6, 16}, DType::f32, dev, gen), weight = Tensor::randn({9, 16}, DType::f32, dev, gen);
  const std::vector<int64_t> t = {0, 8, 3, -100, 5, 1};
  const Tensor targets = Tensor::from_i64(t, {6}, DType::i64, dev), loss = Tensor::empty({6}, DType::f32, dev);
  KernelArgs f;
  f.tensor("hidden", hidden).tensor("weight", weight).tensor("targets", targets).string("reduction", "none").tensor("loss", loss);
  flce.forward(f, dev, test::kInference);
  int64_t count = 0;
  const auto rows =
      oracle::cross_entropy_rows(oracle::matmul(hidden.to_f64_vector(), weight.to_f64_vector(), 1, 6, 9, 16, false, true, false),
                                 t, 6, 9, -100, 0.0, count);
  EXPECT_LE(test::rel_l2_error(loss, rows), test::composite_rel_l2(DType::f32));
}

TEST_P(LigerPackage, FusedLinearCrossEntropyRefusals) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const KernelLayer flce = layer("LigerFusedLinearCrossEntropy");
  const Tensor hidden = Tensor::zeros({4, 8}, DType::bf16, dev), weight = Tensor::zeros({10, 8}, DType::bf16, dev);
  const Tensor loss = Tensor::empty({1}, DType::f32, dev), dhidden = Tensor::empty({4, 8}, DType::bf16, dev);
  const Tensor targets = Tensor::from_i64(std::vector<int64_t>{1, 2, 3, 4}, {4}, DType::i64, dev);
  // The four required tensors, which an edit may replace, and the edit's extra arguments.
  struct Base {
    Tensor hidden, weight, targets, loss;
  };
  auto expect = [&](const std::function<void(Base&, KernelArgs&)>& edit, uint32_t mode, kcpp_status status,
                    const char* needle) {
    Base b{hidden, weight, targets, loss};
    KernelArgs a;
    edit(b, a);
    a.tensor("hidden", b.hidden).tensor("weight", b.weight).tensor("targets", b.targets).tensor("loss", b.loss);
    EXPECT_TRUE(test::refused(flce.supports(a, dev, mode), status, needle)) << needle;
  };
  expect([](Base&, KernelArgs& a) { a.real("softcap", -1.0); }, test::kInference, KCPP_ERROR_INVALID_ARGUMENT, "'softcap'");
  expect([&](Base&, KernelArgs& a) { a.tensor("class_weight", loss); }, test::kInference, KCPP_ERROR_INVALID_ARGUMENT,
         "'class_weight' must have 10");
  expect([](Base&, KernelArgs&) {}, test::kTraining, KCPP_ERROR_INVALID_ARGUMENT, "'dhidden'");
  expect([&](Base&, KernelArgs& a) { a.tensor("dhidden", dhidden).string("reduction", "none"); }, test::kTraining,
         KCPP_ERROR_INVALID_ARGUMENT, "'loss' must have 4");
  const Tensor loss4 = Tensor::empty({4}, DType::f32, dev);
  expect([&](Base& b, KernelArgs& a) {
    a.tensor("dhidden", dhidden).string("reduction", "none");
    b.loss = loss4;
  }, test::kTraining, KCPP_ERROR_UNSUPPORTED, "reduction 'none' with gradients");
  const Tensor w7 = Tensor::zeros({10, 7}, DType::bf16, dev);
  expect([&](Base& b, KernelArgs&) { b.weight = w7; }, test::kInference, KCPP_ERROR_INVALID_ARGUMENT, "'weight' is [10, 7]");
  const Tensor wf = Tensor::zeros({10, 8}, DType::f32, dev);
  expect([&](Base& b, KernelArgs&) { b.weight = wf; }, test::kInference, KCPP_ERROR_INVALID_ARGUMENT, "'weight' is f32");
  const Tensor b9 = Tensor::zeros({9}, DType::bf16, dev);
  expect([&](Base&, KernelArgs& a) { a.tensor("bias", b9); }, test::kInference, KCPP_ERROR_INVALID_ARGUMENT,
         "'bias' must be [10]");
  expect([&](Base&, KernelArgs& a) { a.tensor("dhidden", dhidden).tensor("dbias", b9); }, test::kTraining,
         KCPP_ERROR_INVALID_ARGUMENT, "'dbias' given without 'bias'");
  expect([](Base&, KernelArgs& a) { a.string("accum_dtype", "f64"); }, test::kInference, KCPP_ERROR_INVALID_ARGUMENT,
         "'accum_dtype'");
  expect([](Base&, KernelArgs& a) { a.integer("chunk_rows", -2); }, test::kInference, KCPP_ERROR_INVALID_ARGUMENT,
         "'chunk_rows'");
  const Tensor t3 = targets.narrow(0, 0, 3);
  expect([&](Base& b, KernelArgs&) { b.targets = t3; }, test::kInference, KCPP_ERROR_INVALID_ARGUMENT, "3 elements");
  {
    KernelArgs a;
    a.tensor("dhidden", dhidden).string("dloss", "one");
    EXPECT_TRUE(test::refused(flce.supports(a, dev, test::kTraining), KCPP_ERROR_INVALID_ARGUMENT, "'dloss'"));
  }
  if (dev.is_cpu()) {  // a target out of range: an error naming the row (CUDA: NaN loss, see cross_entropy.h)
    const Tensor bad = Tensor::from_i64(std::vector<int64_t>{1, 2, 10, 4}, {4}, DType::i64, dev);
    KernelArgs a;
    a.tensor("hidden", hidden).tensor("weight", weight).tensor("targets", bad).tensor("loss", loss).tensor("dhidden", dhidden);
    try {
      flce.forward(a, dev, test::kTraining);
      ADD_FAILURE() << "a target out of range was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'targets'[2] = 10 is out of range [0, 10)"), std::string::npos) << e.what();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, LigerPackage, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cpu() ? std::string("cpu") : std::string("cuda"); });

}  // namespace
}  // namespace kcpp
