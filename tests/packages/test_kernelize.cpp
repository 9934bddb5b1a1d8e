// KernelConfig, layer slots and kernelize (src/nn/), with this build's liger package loaded through
// the hub from its local folder, as a user's `use_local_kernel` config would.
#include <cstring>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include "hub/fs.h"
#include "hub/hub.h"
#include "models/causal_lm.h"
#include "models/safetensors.h"
#include "train/adamw.h"
#include "nn/kernel_config.h"
#include "nn/layers.h"
#include "package_util.h"
#include "test_util.h"

namespace kcpp {
namespace {

using nn::KernelConfig;

// ---- KernelConfig --------------------------------------------------------------------------------

TEST(KernelConfig, SelectsByDeviceCapabilityAndMode) {
  const KernelConfig c = KernelConfig::parse(nlohmann::json::parse(R"({
    "RMSNorm": "acme/norm@^1.2:FastNorm",
    "SiLU": {"cuda": "acme/act:SiLU", "cpu": ""},
    "MLP": {"cuda": [{"ref": "acme/mlp-hopper", "capability": ">=9.0"}, {"ref": "acme/mlp"}]},
    "ForCausalLMLoss": {"cuda": {"training": "acme/loss:Fused", "inference": ""}},
    "Attention": {"training|graph": "acme/attn:Graphable", "training": "acme/attn:Eager"}
  })"));
  using hub::Backend;
  auto ref = [&](const char* layer, uint32_t mode, Backend dev, int major = 0, int minor = 0) -> std::string {
    const auto e = c.select(layer, mode, dev, major, minor);
    if (!e) return "<none>";
    return e->ref ? e->ref->text : "<disabled>";
  };
  EXPECT_EQ(ref("RMSNorm", nn::kTraining, Backend::CPU), "acme/norm@^1.2:FastNorm");
  EXPECT_EQ(ref("RMSNorm", nn::kInference | nn::kGraph, Backend::CUDA), "acme/norm@^1.2:FastNorm");
  EXPECT_EQ(ref("SiLU", nn::kInference, Backend::CUDA), "acme/act:SiLU");
  EXPECT_EQ(ref("SiLU", nn::kInference, Backend::CPU), "<disabled>");
  EXPECT_EQ(ref("SiLU", nn::kInference, Backend::ROCm), "<none>");
  EXPECT_EQ(ref("MLP", nn::kTraining, Backend::CUDA, 9, 0), "acme/mlp-hopper");
  EXPECT_EQ(ref("MLP", nn::kTraining, Backend::CUDA, 8, 0), "acme/mlp");
  EXPECT_EQ(ref("ForCausalLMLoss", nn::kTraining, Backend::CUDA), "acme/loss:Fused");
  EXPECT_EQ(ref("ForCausalLMLoss", nn::kInference, Backend::CUDA), "<disabled>");
  EXPECT_EQ(ref("ForCausalLMLoss", nn::kTraining, Backend::CPU), "<none>");
  // Mode fallback: exact, without graph, inference -> training, no mode.
  EXPECT_EQ(ref("Attention", nn::kTraining | nn::kGraph, Backend::CUDA), "acme/attn:Graphable");
  EXPECT_EQ(ref("Attention", nn::kTraining, Backend::CUDA), "acme/attn:Eager");
  EXPECT_EQ(ref("Attention", nn::kInference, Backend::CUDA), "acme/attn:Eager");
  EXPECT_EQ(ref("Attention", nn::kInference | nn::kGraph, Backend::CUDA), "acme/attn:Graphable");
  EXPECT_EQ(ref("LayerNorm", nn::kTraining, Backend::CUDA), "<none>");
  std::string why;
  c.select("ForCausalLMLoss", nn::kInference, Backend::CUDA, 0, 0, &why);
  EXPECT_EQ(why, "kernel_mapping.ForCausalLMLoss[inference] disables it");
}

TEST(KernelConfig, BadMappingsNameTheKey) {
  auto fails = [](const char* text, const std::string& needle, bool local = false) {
    try {
      KernelConfig::parse_text(text, local);
      return ::testing::AssertionFailure() << "accepted " << text;
    } catch (const Error& e) {
      if (std::string(e.what()).find(needle) == std::string::npos)
        return ::testing::AssertionFailure() << "message '" << e.what() << "' lacks '" << needle << "'";
      return ::testing::AssertionSuccess();
    }
  };
  EXPECT_TRUE(fails(R"({"RMSNrom": "acme/norm"})", "kernel_mapping.RMSNrom: unknown layer name 'RMSNrom' (known: RMSNorm"));
  EXPECT_TRUE(fails(R"({"RMSNorm": {"tpu": "acme/norm"}})", "kernel_mapping.RMSNorm"));
  EXPECT_TRUE(fails(R"({"RMSNorm": "acme/--norm"})", "kernel_mapping.RMSNorm"));
  EXPECT_TRUE(fails(R"({"RMSNorm": 3})", "kernel_mapping.RMSNorm: expected a kernel reference"));
  EXPECT_TRUE(fails(R"({"RMSNorm": {"cuda": "acme/a", "training": "acme/b"}})", "mixes mode keys and device keys"));
  EXPECT_TRUE(fails(R"({"RMSNorm": {"cuda": {"trainng": "acme/a"}}})", "kernel_mapping.RMSNorm.cuda: unknown key 'trainng'"));
  EXPECT_TRUE(fails(R"({"RMSNorm": {"training|inference": "acme/a"}})", "unknown device 'training|inference'"));
  EXPECT_TRUE(fails(R"({"RMSNorm": "/opt/kernels/liger:LigerRMSNorm"})", "set use_local_kernel"));
  EXPECT_TRUE(fails(R"({"RMSNorm": "acme/norm"})", "use_local_kernel is set", true));
  EXPECT_TRUE(fails("[1, 2]", "the mapping must be a JSON object"));
  EXPECT_TRUE(fails("{not json", "not JSON"));
  EXPECT_THROW(nn::LigerSwitches::parse(nlohmann::json::parse(R"({"rope": true, "ropee": false})")), Error);
  EXPECT_THROW(nn::LigerSwitches::parse(nlohmann::json::parse(R"({"cross_entropy": true})")), Error);
}

TEST(KernelConfig, LigerSwitchesMapTheirLayers) {
  const nn::LigerSwitches s = nn::LigerSwitches::parse(nlohmann::json::parse(R"({"rope": false})"));
  const KernelConfig c = nn::liger_kernel_config(s, "kernels-community/liger@^0.1");
  EXPECT_EQ(c.layers(), (std::vector<std::string>{"ForCausalLMLoss", "MLP", "RMSNorm"}));
  EXPECT_EQ(c.select("RMSNorm", nn::kTraining, hub::Backend::CUDA)->ref->text, "kernels-community/liger@^0.1:LigerRMSNorm");
}

// ---- kernelize ------------------------------------------------------------------------------------

// A toy model: three RMSNorm slots.
struct Norms : nn::Module {
  std::vector<std::unique_ptr<nn::RMSNorm>> norms;
  void visit_slots(const std::function<void(nn::Slot&)>& fn) override {
    for (auto& n : norms) fn(*n);
  }
};

nn::KernelLoader local_loader() {
  hub::HubConfig c = hub::HubConfig::from_env();
  c.allow_all_kernels = true;  // this build's packages are unsigned
  c.enabled = true;
  c.lock_file.reset();
  c.cache_dir = std::filesystem::temp_directory_path() / "kcpp-test-kernelize-cache";
  return nn::hub_loader(std::make_shared<hub::Hub>(std::move(c)));
}

class Kernelize : public ::testing::TestWithParam<Device> {};

TEST_P(Kernelize, SlotsTakeTheKernelFallBackAndReport) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  Norms m;
  for (int i = 0; i < 3; ++i)
    m.norms.push_back(std::make_unique<nn::RMSNorm>(Tensor::randn({64}, DType::f32, dev, gen)));
  const std::string liger = test::built_package_dir("liger").string();
  const KernelConfig config = KernelConfig::parse(
      nlohmann::json{{"RMSNorm", liger + ":LigerRMSNorm"}, {"SiLU", liger}}, /*use_local_kernel=*/true);
  const nn::KernelizeReport r = m.kernelize(config, nn::kTraining, dev, local_loader());
  ASSERT_EQ(r.entries.size(), 1u);
  EXPECT_EQ(r.entries[0].slots, 3);
  EXPECT_NE(r.entries[0].kernel.find("liger 0.1.0: LigerRMSNorm (RMSNorm/1)"), std::string::npos) << r.str();
  EXPECT_EQ(r.unused, std::vector<std::string>{"SiLU"});

  // Forward and backward through the kernel match the reference.
  const Tensor x = Tensor::randn({5, 64}, DType::f32, dev, gen), dy = Tensor::randn({5, 64}, DType::f32, dev, gen);
  nn::RMSNorm& n = *m.norms[0];
  nn::RMSNorm::Saved saved;
  const Tensor y = n.forward(x, &saved);
  const nn::RMSNorm::Grads g = n.backward(dy, saved);
  const auto rf = ops::rms_norm_forward(x, n.weight);
  const auto rb = ops::rms_norm_backward(dy, x, n.weight, rf.rstd);
  EXPECT_TRUE(test::close_l2(y, rf.y.to_f64_vector(), 1e-6));
  EXPECT_TRUE(test::close_l2(g.dx, rb.dx.to_f64_vector(), 1e-5));
  EXPECT_TRUE(test::close_l2(g.dweight, rb.dw.to_f64_vector(), 1e-5));
  EXPECT_EQ(n.stats().kernel_calls, 2);
  EXPECT_EQ(n.stats().fallbacks, 0);

  // A layout the kernel does not take (the last dim strided): supports() refuses, the reference runs,
  // the fallback is counted with the kernel's reason.
  const Tensor xt = Tensor::randn({64, 5}, DType::f32, dev, gen).transpose(0, 1);
  nn::RMSNorm& n1 = *m.norms[1];
  const Tensor yt = n1.forward(xt);
  EXPECT_TRUE(test::close_l2(yt, ops::rms_norm_forward(xt, n1.weight).y.to_f64_vector(), 1e-6));
  EXPECT_EQ(n1.stats().fallbacks, 1);
  EXPECT_NE(n1.stats().last_refusal.find("contiguous"), std::string::npos) << n1.stats().last_refusal;
  const std::string report = m.kernel_report();
  EXPECT_NE(report.find("fallbacks 1"), std::string::npos) << report;

  // eval() re-kernelizes in inference mode; unkernelize() goes back to the reference.
  m.eval();
  EXPECT_FALSE(m.training());
  EXPECT_TRUE(n.kernel().has_value());
  EXPECT_EQ(n.mode(), nn::kInference);
  m.unkernelize();
  EXPECT_FALSE(n.kernel().has_value());
  n.forward(x);
  EXPECT_EQ(n.stats().reference_calls, 1);
}

TEST_P(Kernelize, ConfigMistakesAreErrorsNamingTheLayer) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  Norms m;
  m.norms.push_back(std::make_unique<nn::RMSNorm>(Tensor::randn({8}, DType::f32, dev, gen)));
  const std::string liger = test::built_package_dir("liger").string();
  auto error_of = [&](const nlohmann::json& mapping) -> std::string {
    try {
      m.kernelize(KernelConfig::parse(mapping, true), nn::kTraining, dev, local_loader());
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  // A kernel of another contract.
  EXPECT_NE(error_of({{"RMSNorm", liger + ":LigerGLU"}}).find("implements GLU/1, but the RMSNorm slot needs RMSNorm/1"),
            std::string::npos);
  // No such layer in the package.
  EXPECT_NE(error_of({{"RMSNorm", liger + ":NoSuchNorm"}}).find("NoSuchNorm"), std::string::npos);
  // No folder.
  EXPECT_NE(error_of({{"RMSNorm", "/nonexistent/kcpp-package:LigerRMSNorm"}}).find("kernel_mapping.RMSNorm: cannot load"),
            std::string::npos);
  // Without :Layer the package's one RMSNorm/1 layer is used.
  EXPECT_EQ(error_of({{"RMSNorm", liger}}), "");
  EXPECT_EQ(m.norms[0]->kernel()->info().name, std::string("LigerRMSNorm"));
  // Disabled explicitly: the reference, with the reason.
  const auto r = m.kernelize(KernelConfig::parse({{"RMSNorm", ""}}, true), nn::kTraining, dev, local_loader());
  EXPECT_FALSE(m.norms[0]->kernel().has_value());
  EXPECT_EQ(r.entries[0].reason, "kernel_mapping.RMSNorm disables it");
}

// Every slot with a liger kernel against the same slot unkernelized (the reference), f32, forward
// and backward.
struct AllSlots : nn::Module {
  nn::MLP mlp;
  nn::RotaryEmbedding rope;
  nn::CrossEntropyLoss ce;
  nn::ForCausalLMLoss lm_loss;
  void visit_slots(const std::function<void(nn::Slot&)>& fn) override {
    fn(mlp);
    fn(rope);
    fn(ce);
    fn(lm_loss);
  }
};

TEST_P(Kernelize, EverySlotMatchesItsReference) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  AllSlots m;
  const std::string liger = test::built_package_dir("liger").string();
  const nn::KernelizeReport report = m.kernelize(nn::liger_kernel_config(nn::LigerSwitches{}, liger, true), nn::kTraining, dev,
                                                 local_loader());
  const KernelConfig ce_only = KernelConfig::parse({{"CrossEntropyLoss", liger + ":LigerCrossEntropy"}}, true);
  AllSlots ref;  // never kernelized
  for (nn::Slot* s : std::vector<nn::Slot*>{&m.mlp, &m.rope, &m.lm_loss}) EXPECT_TRUE(s->kernel().has_value()) << report.str();
  auto close = [](const Tensor& a, const Tensor& b, const char* what) {
    EXPECT_TRUE(test::close_l2(a, b.to_f64_vector(), 1e-5)) << what;
  };
  // MLP
  const Tensor gate = Tensor::randn({6, 40}, DType::f32, dev, gen), up = Tensor::randn({6, 40}, DType::f32, dev, gen);
  const Tensor dh = Tensor::randn({6, 40}, DType::f32, dev, gen);
  close(m.mlp.forward(gate, up), ref.mlp.forward(gate, up), "mlp out");
  const auto g1 = m.mlp.backward(dh, gate, up), g0 = ref.mlp.backward(dh, gate, up);
  close(g1.dgate, g0.dgate, "mlp dgate");
  close(g1.dup, g0.dup, "mlp dup");
  EXPECT_EQ(m.mlp.stats().kernel_calls, 2);
  // rotary_pos_emb: q [2, 4, 5, 16], k [2, 2, 5, 16], rotary dims 16.
  const Tensor q = Tensor::randn({2, 4, 5, 16}, DType::f32, dev, gen), k = Tensor::randn({2, 2, 5, 16}, DType::f32, dev, gen);
  std::vector<int64_t> pos;
  for (int b = 0; b < 2; ++b)
    for (int s = 0; s < 5; ++s) pos.push_back(3 * b + s);
  const auto cs = ops::rope_cos_sin(Tensor::from_i64(pos, {2, 5}, DType::i64, dev), ops::rope_inv_freq(16, 10000.0, dev), 1.0,
                                    DType::f32);
  const auto [q1, k1] = m.rope.forward(q, k, cs.cos, cs.sin);
  const auto [q0, k0] = ref.rope.forward(q, k, cs.cos, cs.sin);
  close(q1, q0, "rope q");
  close(k1, k0, "rope k");
  const auto [dq1, dk1] = m.rope.backward(q, k, cs.cos, cs.sin);
  const auto [dq0, dk0] = ref.rope.backward(q, k, cs.cos, cs.sin);
  close(dq1, dq0, "rope dq");
  close(dk1, dk0, "rope dk");
  EXPECT_EQ(m.rope.stats().kernel_calls, 2);
  // ForCausalLMLoss: hidden [2, 7, 24] (rows collapse), weight [53, 24].
  const Tensor hidden = Tensor::randn({2, 7, 24}, DType::f32, dev, gen), weight = Tensor::randn({53, 24}, DType::f32, dev, gen, 0, 0.3);
  std::vector<int64_t> t(14);
  for (int i = 0; i < 14; ++i) t[i] = i % 5 == 4 ? -100 : (i * 7) % 53;
  const Tensor targets = Tensor::from_i64(t, {14}, DType::i64, dev);
  nn::ForCausalLMLoss::Saved s1, s0;
  close(m.lm_loss.forward(hidden, weight, targets, &s1), ref.lm_loss.forward(hidden, weight, targets, &s0), "lm loss");
  const auto l1 = m.lm_loss.backward(0.5, s1), l0 = ref.lm_loss.backward(0.5, s0);
  close(l1.dhidden, l0.dhidden, "lm dhidden");
  close(l1.dweight, l0.dweight, "lm dweight");
  EXPECT_EQ(m.lm_loss.stats().kernel_calls, 2);
  // CrossEntropyLoss (off in the Liger switches by default, as Liger: the fused loss replaces it).
  EXPECT_FALSE(m.ce.kernel().has_value());
  m.kernelize(ce_only, nn::kTraining, dev, local_loader());
  ASSERT_TRUE(m.ce.kernel().has_value());
  const Tensor logits = Tensor::randn({14, 53}, DType::f32, dev, gen, 0, 2);
  nn::CrossEntropyLoss::Saved c1, c0;
  close(m.ce.forward(logits, targets, &c1), ref.ce.forward(logits, targets, &c0), "ce loss");
  close(m.ce.backward(2.0, c1), ref.ce.backward(2.0, c0), "ce dlogits");
  EXPECT_EQ(m.ce.stats().kernel_calls, 2);
}

// The activation slots with the activation package, against the same slots unkernelized.
TEST_P(Kernelize, ActivationSlotsMatchTheirReference) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  using K = nn::Activation::Kind;
  struct Acts : nn::Module {
    std::vector<std::unique_ptr<nn::Activation>> acts;
    void visit_slots(const std::function<void(nn::Slot&)>& fn) override {
      for (auto& a : acts) fn(*a);
    }
  } m, ref;
  for (K k : {K::SiLU, K::GeLU, K::GeluTanh, K::FastGELU, K::NewGELU, K::QuickGELU}) {
    m.acts.push_back(std::make_unique<nn::Activation>(k));
    ref.acts.push_back(std::make_unique<nn::Activation>(k));
  }
  const std::string act = test::built_package_dir("activation").string();
  nlohmann::json mapping;
  for (const char* name : {"SiLU", "GeLU", "GeluTanh", "FastGELU", "NewGELU", "QuickGELU"}) mapping[name] = act;
  m.kernelize(KernelConfig::parse(mapping, true), nn::kTraining, dev, local_loader());
  const Tensor x = Tensor::randn({3, 37}, DType::f32, dev, gen, 0, 2), dy = Tensor::randn({3, 37}, DType::f32, dev, gen);
  for (size_t i = 0; i < m.acts.size(); ++i) {
    ASSERT_TRUE(m.acts[i]->kernel().has_value()) << m.acts[i]->layer_name();
    EXPECT_TRUE(test::close_l2(m.acts[i]->forward(x), ref.acts[i]->forward(x).to_f64_vector(), 1e-6)) << m.acts[i]->layer_name();
    EXPECT_TRUE(test::close_l2(m.acts[i]->backward(dy, x), ref.acts[i]->backward(dy, x).to_f64_vector(), 1e-6))
        << m.acts[i]->layer_name();
    EXPECT_EQ(m.acts[i]->stats().kernel_calls, 2) << m.acts[i]->layer_name();
  }
  EXPECT_EQ(nn::Activation::parse("gelu_pytorch_tanh"), K::GeluTanh);
  EXPECT_THROW(nn::Activation::parse("relu"), Error);
}

// A whole model kernelized with the Liger switches (RMSNorm, MLP, RoPE, fused linear cross-entropy)
// and flash_attn's attention: the same logits and loss as Transformers, each family, and every
// kernel actually ran.
TEST_P(Kernelize, KernelizedModelsMatchTransformers) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const std::string liger = test::built_package_dir("liger").string();
  const KernelConfig config =
      nn::liger_kernel_config(nn::LigerSwitches{}, liger, true, test::built_package_dir("flash_attn").string());
  // The *_swa fixtures take flash_attn's sliding-window path, per layer where the family has it.
  for (const char* family :
       {"llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "mistral_swa", "phi3_swa", "qwen2_swa", "qwen3_swa"}) {
    SCOPED_TRACE(family);
    const auto dir = std::filesystem::path(test::fixtures_dir()) / family;
    auto model = models::CausalLM::from_folder(dir, DType::f32, dev);
    model->kernelize(config, nn::kTraining, dev, local_loader());
    const auto e = models::SafetensorsFile::open(dir / "expected.safetensors");
    const Tensor ids = e.view("input_ids"), labels = e.view("labels");
    EXPECT_TRUE(test::close_l2(model->forward(ids), e.view("logits").to_f64_vector(), 1e-5));
    EXPECT_TRUE(test::close_l2(model->loss(ids, labels), e.view("loss").to_f64_vector(), 1e-5));
    // The backward through the kernels: every gradient as Transformers computes it.
    const auto lg = model->loss_and_gradients(ids, labels);
    EXPECT_TRUE(test::close_l2(lg.loss, e.view("loss").to_f64_vector(), 1e-5));
    for (const auto& [name, grad] : lg.grads)
      EXPECT_TRUE(test::close_l2(grad, e.view("grad." + name).to_f64_vector(), 1e-5)) << name;
    // The MLP on the halves of the fused gate_up in place (the default, above) and on contiguous
    // copies (KCPP_MLP_PACKED=0): the same bits, GLU/1 being elementwise.
    {
      const test::ScopedEnv packed("KCPP_MLP_PACKED", "0");
      const auto pg = model->loss_and_gradients(ids, labels);
      EXPECT_EQ(pg.loss.to_f64_vector(), lg.loss.to_f64_vector());
      for (const auto& [name, grad] : lg.grads) EXPECT_EQ(pg.grads.at(name).to_f64_vector(), grad.to_f64_vector()) << name;
    }
    // Every slot kind the config names ran its kernel, none fell back.
    const auto mapped = config.layers();
    model->visit_slots([&](nn::Slot& s) {
      ASSERT_NE(std::find(mapped.begin(), mapped.end(), s.layer_name()), mapped.end()) << s.layer_name();
      EXPECT_TRUE(s.kernel().has_value()) << s.layer_name() << ": " << s.reason();
      EXPECT_GT(s.stats().kernel_calls, 0) << s.layer_name();
      EXPECT_EQ(s.stats().fallbacks, 0) << s.layer_name() << ": " << s.stats().last_refusal;
    });
  }
}

// Issue 5's convergence bar: 100 AdamW steps with the Liger kernels and flash_attn's attention track
// the reference layers' loss curve within 1e-5 relative in f32 and 1e-2 absolute in bf16.
TEST_P(Kernelize, TrainingWithKernelsTracksTheReference) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const auto dir = std::filesystem::path(test::fixtures_dir()) / "llama";
  const auto e = models::SafetensorsFile::open(dir / "expected.safetensors");
  const Tensor ids = e.view("input_ids"), labels = e.view("labels");
  const KernelConfig config = nn::liger_kernel_config(nn::LigerSwitches{}, test::built_package_dir("liger").string(), true,
                                                      test::built_package_dir("flash_attn").string());
  for (DType dt : {DType::f32, DType::bf16}) {
    auto curve = [&](bool kernels) {
      auto model = models::CausalLM::from_folder(dir, dt, dev);
      if (kernels) model->kernelize(config, nn::kTraining, dev, local_loader());
      train::AdamWOptions o;
      o.lr = 3e-3, o.weight_decay = 0.01, o.max_grad_norm = 1.0;
      train::AdamW opt(model->parameters(), o);
      std::vector<double> losses;
      for (int step = 0; step < 100; ++step) {
        const auto r = model->loss_and_gradients(ids, labels);
        losses.push_back(r.loss.item());
        opt.step(r.grads);
      }
      return losses;
    };
    const auto ref = curve(false), ker = curve(true);
    EXPECT_LT(ref.back(), 0.5 * ref.front()) << dtype_name(dt);
    for (size_t i = 0; i < ref.size(); ++i) {
      if (dt == DType::f32) EXPECT_NEAR(ker[i], ref[i], 1e-5 * std::abs(ref[i])) << "step " << i;
      else EXPECT_NEAR(ker[i], ref[i], 1e-2) << "bf16 step " << i;
    }
  }
}

// A fresh empty folder (an empty hub cache), removed afterwards.
class EmptyDir {
 public:
  EmptyDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "kcpp-test-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data());
  }
  ~EmptyDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// use_kernels with no config: the default mapping names this project's org, every package by this
// build's version range, and only layer names the runtime knows.
TEST(DefaultMapping, NamesThisProjectsPackagesAtThisBuildsVersions) {
  const nlohmann::json m = nn::default_kernel_mapping();
  const KernelConfig c = nn::default_kernel_config();  // parses: known layer names, valid references
  EXPECT_EQ(c.layers().size(), m.size());
  for (const auto& [layer, e] : c.entries()) {
    if (!e.ref) continue;
    SCOPED_TRACE(e.ref->text);
    ASSERT_TRUE(e.ref->repo.starts_with(std::string(nn::kDefaultKernelOrg) + "/"));
    const std::string package = e.ref->repo.substr(std::strlen(nn::kDefaultKernelOrg) + 1);
    ASSERT_TRUE(e.ref->constraint.has_value());
    const auto manifest = hub::Manifest::parse(hub::read_file(test::built_package_dir(package) / "manifest.json"), package);
    EXPECT_TRUE(e.ref->constraint->matches(hub::Version::parse(manifest.version))) << manifest.version;
    EXPECT_FALSE(e.ref->layer.empty());
  }
  // The CPU keeps the reference attention; CUDA gets flash_attn's.
  EXPECT_FALSE(c.select("Attention", nn::kTraining, hub::Backend::CPU)->ref.has_value());
  EXPECT_EQ(c.select("Attention", nn::kTraining, hub::Backend::CUDA)->ref->repo, "kernels-cpp/flash_attn");
  // Deformable DETR's sampling core on every device (a layer name of the Python bridge's; no C++ model has it).
  for (const hub::Backend b : {hub::Backend::CPU, hub::Backend::CUDA})
    EXPECT_EQ(c.select("MultiScaleDeformableAttention", nn::kTraining, b)->ref->text,
              "kernels-cpp/deformable_attention@^0.1:MultiScaleDeformableAttention");
}

// With the hub offline and the org's packages not in the cache, the default mapping kernelizes a
// model with this build's packages, says so, and the model still computes what Transformers does.
TEST_P(Kernelize, DefaultMappingFallsBackToThisBuildsPackagesOffline) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const EmptyDir cache;
  hub::HubConfig hc = hub::HubConfig::from_env();
  hc.offline = true;
  hc.cache_dir = cache.path();
  hc.lock_file.reset();
  hc.allow_all_kernels = false;
  const auto dir = std::filesystem::path(test::fixtures_dir()) / "llama";
  auto model = models::CausalLM::from_folder(dir, DType::f32, dev);
  const nn::KernelizeReport r = model->kernelize(
      nn::default_kernel_config(), nn::kTraining, dev,
      nn::default_loader(std::make_shared<hub::Hub>(std::move(hc)),
                         [](const std::string& p) { return std::optional(test::built_package_dir(p)); }));
  for (const auto& e : r.entries) {
    if (e.layer == "Attention" && dev.is_cpu()) continue;  // the reference on the CPU, by the mapping
    EXPECT_FALSE(e.kernel.empty()) << e.layer << ": " << e.reason;
    EXPECT_NE(e.reason.find("this build's "), std::string::npos) << e.reason;
    EXPECT_NE(e.reason.find("HF_HUB_OFFLINE"), std::string::npos) << e.reason;
  }
  const auto ex = models::SafetensorsFile::open(dir / "expected.safetensors");
  const auto lg = model->loss_and_gradients(ex.view("input_ids"), ex.view("labels"));
  EXPECT_TRUE(test::close_l2(lg.loss, ex.view("loss").to_f64_vector(), 1e-5));
  model->visit_slots([&](nn::Slot& s) {
    if (s.kernel()) {
      EXPECT_GT(s.stats().kernel_calls, 0) << s.layer_name();
    }
  });
}

// Neither the hub nor this build has the package: the slot keeps its reference, saying why.
TEST(DefaultMapping, NoPackageAnywhereKeepsTheReference) {
  const EmptyDir cache;
  hub::HubConfig hc = hub::HubConfig::from_env();
  hc.offline = true;
  hc.cache_dir = cache.path();
  hc.lock_file.reset();
  Norms m;
  m.norms.push_back(std::make_unique<nn::RMSNorm>(Tensor::full({8}, 1.0, DType::f32, Device::cpu())));
  const nn::KernelizeReport r =
      m.kernelize(nn::default_kernel_config(), nn::kInference, Device::cpu(),
                  nn::default_loader(std::make_shared<hub::Hub>(std::move(hc)),
                                     [](const std::string&) { return std::optional<std::filesystem::path>(); }));
  ASSERT_EQ(r.entries.size(), 1u);
  EXPECT_TRUE(r.entries[0].kernel.empty());
  EXPECT_NE(r.entries[0].reason.find("this build has no package liger"), std::string::npos) << r.entries[0].reason;
}

// The mixture-of-experts families with the moe package's MegaBlocksMoeMLP (and the Liger kernels and
// flash_attn's attention elsewhere): logits, loss with the router auxiliary loss, and every gradient
// (Qwen2-MoE's shared expert and its gate included: MoE/1 takes them) as Transformers computes them;
// every mapped slot ran its kernel.
KernelConfig moe_model_config() {
  const std::string liger = test::built_package_dir("liger").string();
  return KernelConfig::parse({{"RMSNorm", liger + ":LigerRMSNorm"},
                              {"MLP", liger + ":LigerGLU"},
                              {"rotary_pos_emb", liger + ":LigerRotaryEmbedding"},
                              {"ForCausalLMLoss", liger + ":LigerFusedLinearCrossEntropy"},
                              {"Attention", test::built_package_dir("flash_attn").string()},
                              {"MegaBlocksMoeMLP", test::built_package_dir("moe").string() + ":MegaBlocksMoeMLP"},
                              {"Llama4TextMoe", test::built_package_dir("moe").string() + ":Llama4TextMoe"}},
                             true);
}

TEST_P(Kernelize, KernelizedMoEModelsMatchTransformers) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const KernelConfig config = moe_model_config();
  for (const char* family : {"mixtral", "qwen3_moe", "qwen2_moe"}) {
    SCOPED_TRACE(family);
    const auto dir = std::filesystem::path(test::fixtures_dir()) / family;
    auto model = models::CausalLM::from_folder(dir, DType::f32, dev);
    model->kernelize(config, nn::kTraining, dev, local_loader());
    const auto e = models::SafetensorsFile::open(dir / "expected.safetensors");
    const Tensor ids = e.view("input_ids"), labels = e.view("labels");
    EXPECT_TRUE(test::close_l2(model->forward(ids), e.view("logits").to_f64_vector(), 1e-5));
    EXPECT_TRUE(test::close_l2(model->loss(ids, labels), e.view("loss").to_f64_vector(), 1e-5));
    const auto lg = model->loss_and_gradients(ids, labels);
    EXPECT_TRUE(test::close_l2(lg.loss, e.view("loss").to_f64_vector(), 1e-5));
    for (const auto& [name, grad] : lg.grads)
      EXPECT_TRUE(test::close_l2(grad, e.view("grad." + name).to_f64_vector(), 1e-5)) << name;
    const auto mapped = config.layers();
    int moe_slots = 0;
    model->visit_slots([&](nn::Slot& s) {
      ASSERT_NE(std::find(mapped.begin(), mapped.end(), s.layer_name()), mapped.end()) << s.layer_name();
      EXPECT_TRUE(s.kernel().has_value()) << s.layer_name() << ": " << s.reason();
      const bool moe = s.layer_name() == "MegaBlocksMoeMLP";
      moe_slots += moe;
      if (moe && dev.is_cuda()) {  // the CUDA experts are bf16 / f16 GEMMs: f32 calls run the reference, saying so
        EXPECT_GT(s.stats().fallbacks, 0);
        EXPECT_NE(s.stats().last_refusal.find("f32 on CUDA"), std::string::npos) << s.stats().last_refusal;
        return;
      }
      EXPECT_GT(s.stats().kernel_calls, 0) << s.layer_name();
      EXPECT_EQ(s.stats().fallbacks, 0) << s.layer_name() << ": " << s.stats().last_refusal;
    });
    EXPECT_EQ(moe_slots, std::string(family) == "qwen3_moe" ? 1 : 2);
  }
}

// Llama 4 (text) kernelized by the default slots' packages and the moe package's Llama4TextMoe (routing
// "sigmoid", the weight on the expert input, a shared expert): logits, loss and every gradient as
// Transformers computes them.  The MoE blocks, norms (the L2 q/k norm as RMSNorm of weight 1), the
// interleaved RoPE, the MLPs and the loss run their kernels; the attention kernel runs on the NoPE layer
// and the chunked layers keep to the reference (Attention/1 has no chunk), counted as fallbacks saying so.
TEST_P(Kernelize, KernelizedLlama4MatchesTransformers) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const std::string liger = test::built_package_dir("liger").string();
  const KernelConfig config = KernelConfig::parse({{"RMSNorm", liger + ":LigerRMSNorm"},
                                                   {"MLP", liger + ":LigerGLU"},
                                                   {"rotary_pos_emb", liger + ":LigerRotaryEmbedding"},
                                                   {"ForCausalLMLoss", liger + ":LigerFusedLinearCrossEntropy"},
                                                   {"Attention", test::built_package_dir("flash_attn").string()},
                                                   {"Llama4TextMoe", test::built_package_dir("moe").string() + ":Llama4TextMoe"}},
                                                  true);
  const auto dir = std::filesystem::path(test::fixtures_dir()) / "llama4_text";
  auto model = models::CausalLM::from_folder(dir, DType::f32, dev);
  model->kernelize(config, nn::kTraining, dev, local_loader());
  const auto e = models::SafetensorsFile::open(dir / "expected.safetensors");
  const Tensor ids = e.view("input_ids"), labels = e.view("labels");
  EXPECT_TRUE(test::close_l2(model->forward(ids), e.view("logits").to_f64_vector(), 1e-5));
  EXPECT_TRUE(test::close_l2(model->loss(ids, labels), e.view("loss").to_f64_vector(), 1e-5));
  const auto lg = model->loss_and_gradients(ids, labels);
  EXPECT_TRUE(test::close_l2(lg.loss, e.view("loss").to_f64_vector(), 1e-5));
  size_t expected = 0;
  for (const auto& [name, entry] : e.entries()) expected += name.starts_with("grad.");
  EXPECT_EQ(lg.grads.size(), expected);
  for (const auto& [name, grad] : lg.grads)
    EXPECT_TRUE(test::close_l2(grad, e.view("grad." + name).to_f64_vector(), 1e-5)) << name;
  int moe_slots = 0, chunked = 0, full = 0;
  model->visit_slots([&](nn::Slot& s) {
    EXPECT_TRUE(s.kernel().has_value()) << s.layer_name() << ": " << s.reason();
    if (s.layer_name() == "Attention" && static_cast<nn::Attention&>(s).options.chunk > 0) {
      ++chunked;
      EXPECT_EQ(s.stats().kernel_calls, 0);
      EXPECT_GT(s.stats().fallbacks, 0);
      EXPECT_NE(s.stats().last_refusal.find("chunked attention"), std::string::npos) << s.stats().last_refusal;
      return;
    }
    full += s.layer_name() == "Attention";
    const bool moe = s.layer_name() == "Llama4TextMoe";
    moe_slots += moe;
    if (moe && dev.is_cuda()) {  // the CUDA experts are bf16 / f16 GEMMs: f32 calls run the reference, saying so
      EXPECT_NE(s.stats().last_refusal.find("f32 on CUDA"), std::string::npos) << s.stats().last_refusal;
      return;
    }
    EXPECT_GT(s.stats().kernel_calls, 0) << s.layer_name();
    EXPECT_EQ(s.stats().fallbacks, 0) << s.layer_name() << ": " << s.stats().last_refusal;
  });
  EXPECT_EQ(moe_slots, 2);
  EXPECT_EQ(chunked, 3);
  EXPECT_EQ(full, 1);
}

// The convergence bar for the MoE families: 100 AdamW steps with the kernels (the moe package's
// experts) track the reference layers' loss curve (router auxiliary loss included) within 1e-5
// relative in f32 and 1e-2 absolute in bf16.  Llama 4 too (its chunked layers' attention the
// reference on both sides).
TEST_P(Kernelize, MoETrainingWithKernelsTracksTheReference) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const KernelConfig config = moe_model_config();
  for (const char* family : {"mixtral", "qwen3_moe", "qwen2_moe", "llama4_text"}) {
    const auto dir = std::filesystem::path(test::fixtures_dir()) / family;
    const auto e = models::SafetensorsFile::open(dir / "expected.safetensors");
    const Tensor ids = e.view("input_ids"), labels = e.view("labels");
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(std::string(family) + " " + std::string(dtype_name(dt)));
      auto curve = [&](bool kernels) {
        auto model = models::CausalLM::from_folder(dir, dt, dev);
        if (kernels) model->kernelize(config, nn::kTraining, dev, local_loader());
        train::AdamWOptions o;
        o.lr = 3e-3, o.weight_decay = 0.01, o.max_grad_norm = 1.0;
        train::AdamW opt(model->parameters(), o);
        std::vector<double> losses;
        // bf16 on the CPU is the slow half of this test: fewer steps there (the f32 curves show convergence).
        const int steps = dt == DType::f32 ? 100 : 40;
        for (int step = 0; step < steps; ++step) {
          const auto r = model->loss_and_gradients(ids, labels);
          losses.push_back(r.loss.item());
          opt.step(r.grads);
        }
        return losses;
      };
      const auto ref = curve(false), ker = curve(true);
      if (dt == DType::f32) EXPECT_LT(ref.back(), 0.5 * ref.front());
      else EXPECT_LT(ref.back(), ref.front());
      for (size_t i = 0; i < ref.size(); ++i) {
        if (dt == DType::f32) EXPECT_NEAR(ker[i], ref[i], 1e-5 * std::abs(ref[i])) << "step " << i;
        else EXPECT_NEAR(ker[i], ref[i], 1e-2) << "bf16 step " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, Kernelize, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cpu() ? std::string("cpu") : std::string("cuda"); });

}  // namespace
}  // namespace kcpp
