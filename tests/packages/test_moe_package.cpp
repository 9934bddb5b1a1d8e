// Package "moe" through the ABI, as a host calls it: the built library loaded, MoE/1 and the op
// load_balancing_loss called with named arguments (docs/contracts/MoE.md), results against the f64
// oracle.  The numerics are covered in depth by packages/moe/test_moe.cpp; here every argument of
// the contract is exercised, so that a wrong mapping (a stride of a transposed weight view, the up
// half of a fused gate_up, a layout string) shows up as an O(1) error, and bad input is refused with a
// message naming the argument.
#include <cmath>
#include <functional>
#include <limits>

#include "oracle.h"
#include "package_util.h"
#include "test_util.h"

namespace kcpp {
namespace {

using nn::KernelArgs;
using nn::KernelLayer;
using nn::KernelOp;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

KernelLayer layer(const char* name) { return KernelLayer::find(test::built_package("moe"), name); }

class MoePackage : public ::testing::TestWithParam<Device> {};

TEST_P(MoePackage, TableNamesTheLayersAndTheOp) {
  const auto pkg = test::built_package("moe");
  EXPECT_STREQ(pkg->table().name, "moe");
  for (const char* name : {"MegaBlocksMoeMLP", "Llama4TextMoe"}) {
    const KernelLayer l = layer(name);
    EXPECT_STREQ(l.info().contract, "MoE/1") << name;
    EXPECT_TRUE(l.has_backward()) << name;
    EXPECT_TRUE(l.runs_on(Device::cpu())) << name;
  }
  EXPECT_NO_THROW(KernelOp::find(pkg, "load_balancing_loss"));
}

// One family's block: how Transformers stores its weights and routes.
struct Family {
  const char* name;
  const char* layer;
  const char* routing;
  bool normalize, input, transposed, separate, shared, shared_gate;
  int64_t e, k;
};

const Family kFamilies[] = {
    // Mixtral: softmax, top-2 renormalized, gate_up [E, 2I, H].
    {"mixtral", "MegaBlocksMoeMLP", "softmax", true, false, false, false, false, false, 8, 2},
    // Qwen2-MoE: no renormalization, a sigmoid-gated shared expert; gate / up given separately.
    {"qwen2_moe", "MegaBlocksMoeMLP", "softmax", false, false, false, true, true, true, 6, 3},
    // Llama 4: sigmoid of the top-1 logit on the expert's input, weights [E, H, 2I] seen transposed, shared expert.
    {"llama4", "Llama4TextMoe", "sigmoid", false, true, true, false, true, false, 5, 1},
};

// [rows, cols] per expert, or its transpose's storage seen transposed (Llama 4).
Tensor weight(std::vector<int64_t> shape, bool transposed, DType dt, Device dev, Generator& gen, double sd) {
  if (!transposed) return Tensor::randn(shape, dt, dev, gen, 0, sd);
  const int64_t n = static_cast<int64_t>(shape.size());
  std::swap(shape[n - 1], shape[n - 2]);
  return Tensor::randn(shape, dt, dev, gen, 0, sd).transpose(n - 1, n - 2);
}

TEST_P(MoePackage, FamiliesMatchTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  for (const Family& f : kFamilies)
    for (DType dt : {DType::f32, DType::bf16}) {
      const KernelLayer moe = layer(f.layer);
      if (!moe.runs_on(dev)) GTEST_SKIP() << "the moe package has no " << dev.str() << " variant here";
      const std::string cfg = fmt::format("{} {}", test::config_name(dev, dt), f.name);
      if (dev.is_cuda() && dt == DType::f32) {  // the tensor-core path takes bf16 / f16; the host runs its reference
        KernelArgs a;
        a.tensor("hidden", Tensor::zeros({4, 8}, dt, dev)).tensor("router_weight", Tensor::zeros({2, 8}, dt, dev));
        a.integer("top_k", 1).tensor("gate_up_proj", Tensor::zeros({2, 16, 8}, dt, dev));
        a.tensor("down_proj", Tensor::zeros({2, 8, 8}, dt, dev)).tensor("out", Tensor::empty({4, 8}, dt, dev));
        EXPECT_TRUE(test::refused(moe.supports(a, dev, test::kInference), KCPP_ERROR_UNSUPPORTED, "f32 on CUDA"));
        continue;
      }
      const int64_t b = 2, s = 5, t = b * s, h = 24, e = f.e, k = f.k, i = 16, si = 20;
      const double sh = 1 / std::sqrt(static_cast<double>(h));
      const Tensor hidden = Tensor::randn({b, s, h}, dt, dev, gen);
      const Tensor router = Tensor::randn({e, h}, dt, dev, gen, 0, 1.5 * sh);
      Tensor gate_up, gate, up;
      if (f.separate) {
        gate = weight({e, i, h}, false, dt, dev, gen, sh);
        up = weight({e, i, h}, false, dt, dev, gen, sh);
      } else {
        gate_up = weight({e, 2 * i, h}, f.transposed, dt, dev, gen, sh);
      }
      const Tensor down = weight({e, h, i}, f.transposed, dt, dev, gen, 1 / std::sqrt(static_cast<double>(i)));
      Tensor sgate_up, sdown, sgs;
      if (f.shared) {
        sgate_up = weight({2 * si, h}, f.transposed, dt, dev, gen, sh);
        sdown = weight({h, si}, f.transposed, dt, dev, gen, 1 / std::sqrt(static_cast<double>(si)));
        if (f.shared_gate) sgs = Tensor::randn({1, h}, dt, dev, gen, 0, sh);
      }
      const Tensor out = Tensor::full({b, s, h}, kNaN, dt, dev), logits = Tensor::full({t, e}, kNaN, dt, dev);
      const Tensor ids = Tensor::full({t, k}, -1, DType::i32, dev), w = Tensor::full({t, k}, kNaN, DType::f32, dev);
      const Tensor offsets = Tensor::full({e + 2}, -1, DType::i32, dev), sorted = Tensor::full({t * k}, -1, DType::i32, dev);
      const Tensor saved = Tensor::full({t * k, 2 * i}, kNaN, dt, dev);
      auto common = [&](KernelArgs& a) {
        a.tensor("hidden", hidden).tensor("router_weight", router).string("routing", f.routing).integer("top_k", k);
        a.integer("normalize", f.normalize).string("apply_router_weight", f.input ? "input" : "output");
        a.string("activation", "silu");
        if (f.separate) a.tensor("gate_proj", gate).tensor("up_proj", up);
        else a.tensor("gate_up_proj", gate_up);
        a.tensor("down_proj", down);
        if (f.shared) {
          a.tensor("shared_gate_up_proj", sgate_up).tensor("shared_down_proj", sdown);
          if (sgs.defined()) a.tensor("shared_expert_gate", sgs);
        }
        a.tensor("router_logits", logits).tensor("topk_ids", ids).tensor("topk_weights", w);
        a.tensor("expert_offsets", offsets).tensor("sorted_slots", sorted).tensor("gate_up", saved);
      };
      KernelArgs fw;
      common(fw);
      fw.tensor("out", out);
      ASSERT_TRUE(moe.supports(fw, dev, test::kTraining).ok()) << cfg;
      moe.forward(fw, dev, test::kTraining);

      // The auxiliary loss of this layer (one layer, no mask), its gradient into the backward.
      const Tensor aux = Tensor::full({1}, kNaN, DType::f32, dev), daux = Tensor::full({t, e}, kNaN, DType::f32, dev);
      KernelArgs la;
      la.tensor("router_logits", logits).integer("top_k", k).tensor("loss", aux).tensor("drouter_logits", daux);
      la.real("grad_scale", 0.5);
      KernelOp::find(test::built_package("moe"), "load_balancing_loss").call(la, dev);

      const Tensor dout = Tensor::randn({b, s, h}, dt, dev, gen);
      const Tensor dx = Tensor::full({b, s, h}, kNaN, dt, dev), drouter = Tensor::full({e, h}, kNaN, dt, dev);
      const Tensor dw = Tensor::full({t, k}, kNaN, DType::f32, dev);
      const Tensor ddown = Tensor::full({e, h, i}, kNaN, dt, dev);  // contiguous whatever the weight's layout
      Tensor dgate_up, dgate, dup, dsgate_up, dsdown, dsgs;
      KernelArgs bw;
      common(bw);
      bw.tensor("dout", dout).tensor("drouter_logits", daux).tensor("dhidden", dx).tensor("drouter_weight", drouter);
      if (f.separate) {
        dgate = Tensor::full({e, i, h}, kNaN, dt, dev), dup = Tensor::full({e, i, h}, kNaN, dt, dev);
        bw.tensor("dgate_proj", dgate).tensor("dup_proj", dup);
      } else {
        dgate_up = Tensor::full({e, 2 * i, h}, kNaN, dt, dev);
        bw.tensor("dgate_up_proj", dgate_up);
      }
      bw.tensor("ddown_proj", ddown).tensor("dtopk_weights", dw);
      if (f.shared) {
        dsgate_up = Tensor::full({2 * si, h}, kNaN, dt, dev), dsdown = Tensor::full({h, si}, kNaN, dt, dev);
        bw.tensor("dshared_gate_up_proj", dsgate_up).tensor("dshared_down_proj", dsdown);
        if (sgs.defined()) {
          dsgs = Tensor::full({1, h}, kNaN, dt, dev);
          bw.tensor("dshared_expert_gate", dsgs);
        }
      }
      // Mixtral's backward may write over the saved gate_up (dead after it, as a model's tape is).
      if (std::string(f.name) == "mixtral") bw.integer("overwrite_gate_up", 1);
      ASSERT_TRUE(moe.supports(bw, dev, test::kTraining).ok()) << cfg;
      moe.backward(bw, dev, test::kTraining);

      // The oracle, on the kernel's own rounded logits.
      oracle::MoeSpec sp;
      sp.t = t, sp.h = h, sp.e = e, sp.k = k, sp.i = i, sp.si = f.shared ? si : 0;
      sp.routing = std::string(f.routing) == "sigmoid" ? 1 : 0;
      sp.normalize = f.normalize, sp.weight_on_input = f.input;
      oracle::MoeWeights wt;
      wt.x = hidden.to_f64_vector(), wt.router = router.to_f64_vector();
      wt.gate = f.separate ? gate.to_f64_vector() : gate_up.narrow(1, 0, i).to_f64_vector();
      wt.up = f.separate ? up.to_f64_vector() : gate_up.narrow(1, i, i).to_f64_vector();
      wt.down = down.to_f64_vector();
      if (f.shared) {
        wt.sgate = sgate_up.narrow(0, 0, si).to_f64_vector(), wt.sup = sgate_up.narrow(0, si, si).to_f64_vector();
        wt.sdown = sdown.to_f64_vector();
        if (sgs.defined()) wt.sgs = sgs.to_f64_vector();
      }
      const auto z = logits.to_f64_vector();
      std::vector<int64_t> rid;
      std::vector<double> rw;
      oracle::moe_route(sp, z, rid, rw);
      EXPECT_EQ(ids.to_i64_vector(), rid) << cfg;
      EXPECT_TRUE(test::close_l2(w, rw, 1e-6)) << cfg << " topk_weights";
      const double tol = test::composite_rel_l2(dt);
      std::vector<double> ref_daux;
      auto round = dt == DType::f32 ? +[](double v) { return static_cast<double>(static_cast<float>(v)); }
                                    : +[](double v) { return Tensor::from_f64(std::vector<double>{v}, {1}, DType::bf16).item(); };
      const double ref_aux = oracle::load_balancing_loss(z, t, e, k, {}, round, 0.5, &ref_daux);
      EXPECT_NEAR(aux.item(), ref_aux, 1e-5 * ref_aux) << cfg << " load_balancing_loss";
      // Its gradient is (e / t) p_tj (f_j - sum_i f_i p_ti) (p: softmax of the logits, f: the routed
      // fraction), a difference that a balanced routing cancels to rounding noise: the error is
      // measured against the size of the two terms.
      std::vector<double> daux_mag(static_cast<size_t>(t * e)), routed(static_cast<size_t>(e));
      for (int64_t id : rid) routed[static_cast<size_t>(id)] += 1.0 / static_cast<double>(t);
      for (int64_t r = 0; r < t; ++r) {
        double top = -INFINITY, sum = 0, mixed = 0;
        for (int64_t j = 0; j < e; ++j) top = std::max(top, z[static_cast<size_t>(r * e + j)]);
        std::vector<double> p(static_cast<size_t>(e));
        for (int64_t j = 0; j < e; ++j) sum += p[static_cast<size_t>(j)] = std::exp(z[static_cast<size_t>(r * e + j)] - top);
        for (int64_t j = 0; j < e; ++j) mixed += routed[static_cast<size_t>(j)] * (p[static_cast<size_t>(j)] /= sum);
        for (int64_t j = 0; j < e; ++j)
          daux_mag[static_cast<size_t>(r * e + j)] = 0.5 * static_cast<double>(e) / static_cast<double>(t) *
                                                     p[static_cast<size_t>(j)] * (routed[static_cast<size_t>(j)] + mixed);
      }
      EXPECT_TRUE(test::close_l2_mag(daux, ref_daux, daux_mag, 1e-5)) << cfg << " its drouter_logits";
      const auto dv = dout.to_f64_vector(), dzx = daux.to_f64_vector();
      const oracle::MoeResult g = oracle::moe(sp, wt, z, rid, {}, &dv, &dzx);
      EXPECT_TRUE(test::close_l2(out, g.out, tol)) << cfg << " out";
      EXPECT_TRUE(test::close_l2_mag(dx, g.dx, g.dx_mag, tol)) << cfg << " dhidden";
      EXPECT_TRUE(test::close_l2_mag(drouter, g.drouter, g.drouter_mag, tol)) << cfg << " drouter_weight";
      EXPECT_TRUE(test::close_l2_mag(dw, g.dw, g.dw_mag, tol)) << cfg << " dtopk_weights";
      EXPECT_TRUE(test::close_l2_mag(ddown, g.ddown, g.ddown_mag, tol)) << cfg << " ddown_proj";
      const Tensor dg = f.separate ? dgate : dgate_up.narrow(1, 0, i), du = f.separate ? dup : dgate_up.narrow(1, i, i);
      EXPECT_TRUE(test::close_l2_mag(dg, g.dgate, g.dgate_mag, tol)) << cfg << " dgate";
      EXPECT_TRUE(test::close_l2_mag(du, g.dup, g.dup_mag, tol)) << cfg << " dup";
      if (f.shared) {
        EXPECT_TRUE(test::close_l2_mag(dsgate_up.narrow(0, 0, si), g.dsgate, g.dsgate_mag, tol)) << cfg << " dshared gate";
        EXPECT_TRUE(test::close_l2_mag(dsgate_up.narrow(0, si, si), g.dsup, g.dsup_mag, tol)) << cfg << " dshared up";
        EXPECT_TRUE(test::close_l2_mag(dsdown, g.dsdown, g.dsdown_mag, tol)) << cfg << " dshared_down_proj";
        if (sgs.defined()) {
          EXPECT_TRUE(test::close_l2_mag(dsgs, g.dsgs, g.dsgs_mag, tol)) << cfg << " dshared_expert_gate";
        }
      }
    }
}

// Transformers' ExpertsInterface: the host routed (i64 ids, weights in the model's dtype), inference
// without saved tensors, then training with them and the weights' gradient.
TEST_P(MoePackage, GivenRoutingIsTheExpertsInterface) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer moe = layer("MegaBlocksMoeMLP");
  if (!moe.runs_on(dev)) GTEST_SKIP() << "the moe package has no " << dev.str() << " variant here";
  const DType dt = DType::bf16;
  const int64_t t = 4, h = 12, e = 3, k = 2, i = 8;
  const std::vector<int64_t> rid{0, 2, 1, 2, 2, 0, 1, 0};
  std::vector<double> rw{0.5, 0.25, 0.75, 0.125, 1.0, 0.5, 0.375, 0.625};
  const Tensor hidden = Tensor::randn({t, h}, dt, dev, gen), ids = Tensor::from_i64(rid, {t, k}, DType::i64, dev);
  const Tensor w = Tensor::from_f64(rw, {t, k}, dt, dev);
  const Tensor gate_up = Tensor::randn({e, 2 * i, h}, dt, dev, gen, 0, 0.3), down = Tensor::randn({e, h, i}, dt, dev, gen, 0, 0.3);
  auto common = [&](KernelArgs& a) {
    a.tensor("hidden", hidden).string("routing", "given").tensor("topk_ids", ids).tensor("topk_weights", w);
    a.tensor("gate_up_proj", gate_up).tensor("down_proj", down);
  };
  oracle::MoeSpec sp;
  sp.t = t, sp.h = h, sp.e = e, sp.k = k, sp.i = i, sp.routing = 2;
  oracle::MoeWeights wt;
  wt.x = hidden.to_f64_vector();
  wt.gate = gate_up.narrow(1, 0, i).to_f64_vector(), wt.up = gate_up.narrow(1, i, i).to_f64_vector();
  wt.down = down.to_f64_vector();
  const Tensor dout = Tensor::randn({t, h}, dt, dev, gen);
  const auto dv = dout.to_f64_vector();
  const oracle::MoeResult g = oracle::moe(sp, wt, {}, rid, rw, &dv, nullptr);
  const double tol = test::composite_rel_l2(dt);
  {
    const Tensor out = Tensor::full({t, h}, kNaN, dt, dev);
    KernelArgs a;
    common(a);
    a.tensor("out", out);
    moe.forward(a, dev, test::kInference);
    EXPECT_TRUE(test::close_l2(out, g.out, tol)) << "inference";
  }
  const Tensor out = Tensor::full({t, h}, kNaN, dt, dev);
  const Tensor offsets = Tensor::empty({e + 2}, DType::i32, dev), sorted = Tensor::empty({t * k}, DType::i32, dev);
  KernelArgs fw;
  common(fw);
  fw.tensor("out", out).tensor("expert_offsets", offsets).tensor("sorted_slots", sorted);
  moe.forward(fw, dev, test::kTraining);
  EXPECT_TRUE(test::close_l2(out, g.out, tol)) << "training";
  const Tensor dx = Tensor::empty({t, h}, dt, dev), dw = Tensor::empty({t, k}, DType::f32, dev);
  KernelArgs bw;
  common(bw);
  bw.tensor("expert_offsets", offsets).tensor("sorted_slots", sorted).tensor("dout", dout).tensor("dhidden", dx);
  bw.tensor("dtopk_weights", dw);
  moe.backward(bw, dev, test::kTraining);
  EXPECT_TRUE(test::close_l2_mag(dx, g.dx, g.dx_mag, tol)) << "dhidden";
  EXPECT_TRUE(test::close_l2_mag(dw, g.dw, g.dw_mag, tol)) << "dtopk_weights";
}

TEST_P(MoePackage, Refusals) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const KernelLayer moe = layer("MegaBlocksMoeMLP");
  if (!moe.runs_on(dev)) GTEST_SKIP() << "the moe package has no " << dev.str() << " variant here";
  const DType dt = DType::bf16;
  const int64_t t = 4, h = 8, e = 4, k = 2, i = 6;
  const Tensor hidden = Tensor::zeros({t, h}, dt, dev), router = Tensor::zeros({e, h}, dt, dev);
  const Tensor gate_up = Tensor::zeros({e, 2 * i, h}, dt, dev), down = Tensor::zeros({e, h, i}, dt, dev);
  const Tensor out = Tensor::empty({t, h}, dt, dev);
  struct Base {
    Tensor hidden, router, gate_up, down, out;
  };
  auto expect = [&](const std::function<void(Base&, KernelArgs&)>& edit, uint32_t mode, kcpp_status status,
                    const char* needle) {
    Base b{hidden, router, gate_up, down, out};
    KernelArgs a;
    edit(b, a);
    a.tensor("hidden", b.hidden).tensor("router_weight", b.router).tensor("gate_up_proj", b.gate_up);
    a.tensor("down_proj", b.down).tensor("out", b.out);
    a.integer("top_k", k);
    EXPECT_TRUE(test::refused(moe.supports(a, dev, mode), status, needle)) << needle;
  };
  using test::kInference;
  using test::kTraining;
  expect([](Base&, KernelArgs&) {}, kTraining, KCPP_ERROR_INVALID_ARGUMENT, "'router_logits'");
  expect([&](Base& b, KernelArgs&) { b.gate_up = Tensor::zeros({e + 1, 2 * i, h}, dt, dev); }, kInference,
         KCPP_ERROR_INVALID_ARGUMENT, "'gate_up_proj' has 5 experts");
  expect([&](Base& b, KernelArgs&) { b.down = Tensor::zeros({e, h, i + 1}, dt, dev); }, kInference,
         KCPP_ERROR_INVALID_ARGUMENT, "'down_proj' has intermediate size 7");
  expect([&](Base& b, KernelArgs&) { b.router = Tensor::zeros({e, h}, DType::f32, dev); }, kInference,
         KCPP_ERROR_INVALID_ARGUMENT, "'router_weight' is f32");
  expect([&](Base& b, KernelArgs&) { b.router = Tensor::zeros({e, h + 1}, dt, dev); }, kInference,
         KCPP_ERROR_INVALID_ARGUMENT, "'router_weight' is [4, 9]");
  expect([&](Base& b, KernelArgs&) { b.gate_up = Tensor::zeros({e, 2 * i + 1, h}, dt, dev); }, kInference,
         KCPP_ERROR_INVALID_ARGUMENT, "even count");
  expect([&](Base& b, KernelArgs&) { b.gate_up = Tensor::zeros({e, 2 * i, 2 * h}, dt, dev).narrow(2, 0, h); },
         kInference, KCPP_OK, "");
  expect([&](Base& b, KernelArgs&) {
    // strides (2I 2H, 2H, 2): neither of the last two is 1
    b.gate_up = Tensor::zeros({e, 2 * i, 2 * h}, dt, dev).view({e, 2 * i, h, 2}).select(3, 0);
  },
         kInference, KCPP_ERROR_UNSUPPORTED, "stride 1");
  expect([](Base&, KernelArgs& a) { a.string("routing", "topk"); }, kInference, KCPP_ERROR_INVALID_ARGUMENT, "'routing'");
  expect([](Base&, KernelArgs& a) { a.string("apply_router_weight", "both"); }, kInference, KCPP_ERROR_INVALID_ARGUMENT,
         "'apply_router_weight'");
  expect([](Base&, KernelArgs& a) { a.string("activation", "relu"); }, kInference, KCPP_ERROR_INVALID_ARGUMENT, "'activation'");
  // An argument the call does not read is refused naming it, not ignored: a misspelt option, and a
  // backward output in a forward call.
  expect([](Base&, KernelArgs& a) { a.integer("normalise", 1); }, kInference, KCPP_ERROR_INVALID_ARGUMENT,
         "argument 'normalise' is not one this call reads");
  expect([&](Base&, KernelArgs& a) { a.tensor("dhidden", Tensor::empty({t, h}, dt, dev)); }, kInference,
         KCPP_ERROR_INVALID_ARGUMENT, "argument 'dhidden' is not one this call reads");
  expect([&](Base& b, KernelArgs&) { b.out = hidden; }, kInference, KCPP_ERROR_INVALID_ARGUMENT, "'out' must not be 'hidden'");
  expect([&](Base&, KernelArgs& a) { a.tensor("topk_ids", Tensor::empty({t, k}, DType::i64, dev)); }, kInference,
         KCPP_ERROR_INVALID_ARGUMENT, "'topk_ids' is i64");
  expect([&](Base&, KernelArgs& a) { a.tensor("shared_down_proj", Tensor::zeros({h, 3}, dt, dev)); }, kInference,
         KCPP_ERROR_INVALID_ARGUMENT, "without the shared expert");
  expect([&](Base&, KernelArgs& a) { a.string("routing", "given"); }, kInference, KCPP_ERROR_INVALID_ARGUMENT,
         "'router_weight' given with routing 'given'");
  expect([](Base&, KernelArgs& a) { a.integer("overwrite_gate_up", 1); }, kInference, KCPP_ERROR_INVALID_ARGUMENT,
         "'overwrite_gate_up' is the backward's");
  // The backward's overwrite_gate_up: 0 or 1, and 1 only with the saved gate_up it lets be written over.
  {
    const Tensor logits = Tensor::zeros({t, e}, dt, dev), ids = Tensor::zeros({t, k}, DType::i32, dev);
    const Tensor w = Tensor::zeros({t, k}, DType::f32, dev), offsets = Tensor::zeros({e + 2}, DType::i32, dev);
    const Tensor sorted = Tensor::zeros({t * k}, DType::i32, dev), dx = Tensor::empty({t, h}, dt, dev);
    auto backward_args = [&](KernelArgs& a) {
      a.tensor("hidden", hidden).tensor("router_weight", router).tensor("gate_up_proj", gate_up).tensor("down_proj", down);
      a.integer("top_k", k).tensor("router_logits", logits).tensor("topk_ids", ids).tensor("topk_weights", w);
      a.tensor("expert_offsets", offsets).tensor("sorted_slots", sorted).tensor("dout", hidden).tensor("dhidden", dx);
    };
    KernelArgs none;
    backward_args(none);
    none.integer("overwrite_gate_up", 1);
    EXPECT_TRUE(test::refused(moe.supports(none, dev, kTraining), KCPP_ERROR_INVALID_ARGUMENT,
                              "'overwrite_gate_up' = 1 without the tensor 'gate_up'"));
    KernelArgs two;
    backward_args(two);
    two.tensor("gate_up", Tensor::zeros({t * k, 2 * i}, dt, dev)).integer("overwrite_gate_up", 2);
    EXPECT_TRUE(test::refused(moe.supports(two, dev, kTraining), KCPP_ERROR_INVALID_ARGUMENT, "'overwrite_gate_up' = 2"));
    KernelArgs small;  // a saved gate_up of the wrong size is refused with or without the flag
    backward_args(small);
    small.tensor("gate_up", Tensor::zeros({t * k, i}, dt, dev)).integer("overwrite_gate_up", 1);
    EXPECT_TRUE(test::refused(moe.supports(small, dev, kTraining), KCPP_ERROR_INVALID_ARGUMENT, "'gate_up' must have 96 elements"));
    KernelArgs ok;
    backward_args(ok);
    ok.tensor("gate_up", Tensor::zeros({t * k, 2 * i}, dt, dev)).integer("overwrite_gate_up", 1);
    EXPECT_TRUE(moe.supports(ok, dev, kTraining).ok());
  }
  // top_k beyond the experts, and missing.
  {
    KernelArgs a;
    a.tensor("hidden", hidden).tensor("router_weight", router).tensor("gate_up_proj", gate_up).tensor("down_proj", down);
    a.tensor("out", out).integer("top_k", e + 1);
    EXPECT_TRUE(test::refused(moe.supports(a, dev, kInference), KCPP_ERROR_INVALID_ARGUMENT, "'top_k' = 5 exceeds the 4 experts"));
    KernelArgs m;
    m.tensor("hidden", hidden).tensor("router_weight", router).tensor("gate_up_proj", gate_up).tensor("down_proj", down);
    m.tensor("out", out);
    EXPECT_TRUE(test::refused(moe.supports(m, dev, kInference), KCPP_ERROR_INVALID_ARGUMENT, "'top_k'"));
  }
  // The op: top_k, the mask's length.
  const auto op = KernelOp::find(test::built_package("moe"), "load_balancing_loss");
  const Tensor logits = Tensor::zeros({6, e}, DType::f32, dev), loss = Tensor::empty({1}, DType::f32, dev);
  {
    KernelArgs a;
    a.tensor("router_logits", logits).integer("top_k", e + 1).tensor("loss", loss);
    EXPECT_THROW(op.call(a, dev), Error);
    KernelArgs b;
    b.tensor("router_logits", logits).integer("top_k", 1).tensor("loss", loss);
    b.tensor("attention_mask", Tensor::zeros({4}, DType::i64, dev));
    try {
      op.call(b, dev);
      ADD_FAILURE() << "a mask of 4 tokens for 6 rows was taken";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find("multiple"), std::string::npos) << err.what();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, MoePackage, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cpu() ? std::string("cpu") : std::string("cuda"); });

}  // namespace
}  // namespace kcpp
