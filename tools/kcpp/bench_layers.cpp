// `kcpp bench --layers`: every layer slot of a Llama-family model (nn/layers.h), timed with the
// reference layers and then kernelized through the hub exactly as a model is (KernelConfig, the
// package's verified load, its supports() per call), at one model's shapes, on this machine.  It
// answers the question `use_kernels` raises: what does each kernel buy here, in time and memory.
//
//   kcpp bench --layers                          this build's liger and flash_attn packages
//   kcpp bench --layers --kernels MAPPING.json   any packages (hub references or, with
//                                                --use-local-kernel, folders)
//   kcpp bench --layers --mode inference         the forwards alone, kernelized for inference
//   kcpp bench --step [--decoder-layers 4]       a whole training step of a random Llama model at
//                                                these shapes (forward, backward, AdamW), its time
//                                                by slot and by GEMM shape against each one's floor
//
// Defaults: on a GPU the Llama-3-8B shapes of the anchors (bench/RESULTS.md; 8192 tokens of 2048,
// hidden 4096, intermediate 14336, vocabulary 128256, 32 / 8 heads of 128; the cross-entropy on 4096
// rows), bf16; on the CPU 1024 tokens, hidden 4096, vocabulary 32000 (the losses on 256 rows), f32.
// Times are medians (core/timing.h: CUDA events after an L2 flush on a GPU); bandwidth is counted as
// anchors.py counts each layer's bytes and quoted against a device copy measured in the same run;
// peak is the allocator's peak during one forward + backward, beyond what existed before it.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "commands.h"
#include "core/allocator.h"
#include "core/cuda_runtime.h"
#include "core/error.h"
#include "core/profile.h"
#include "core/random.h"
#include "core/tensor.h"
#include "core/timing.h"
#include "hub/hub.h"
#include "models/causal_lm.h"
#include "ceilings.h"
#include "train/adamw.h"
#include "nn/layers.h"
#include "nn/module.h"
#include "ops/nn/rope.h"

namespace kcpp::tools {
namespace {

struct LayersArgs {
  std::string device = "auto", dtype, kernels, packages, only, json_path, mode = "training";
  bool use_local_kernel = false, allow_all = false, quick = false;
  int64_t tokens = 0, seq = 0, hidden = 0, intermediate = 0, vocab = 0, heads = 0, kv_heads = 0, head_dim = 0, loss_rows = 0;
  int reps = 0;
  int64_t decoder_layers = 4;
};

// The slots of one decoder layer and the head, at the benchmark's shapes.
struct Layers : nn::Module {
  nn::RMSNorm norm;
  nn::MLP mlp;
  nn::RotaryEmbedding rope;
  nn::Attention attention;
  nn::CrossEntropyLoss ce;
  nn::ForCausalLMLoss lm_loss;
  explicit Layers(Tensor norm_weight) : norm(std::move(norm_weight)) {}
  void visit_slots(const std::function<void(nn::Slot&)>& fn) override {
    fn(norm), fn(mlp), fn(rope), fn(attention), fn(ce), fn(lm_loss);
  }
};

// One row of the table: a pass of a layer, with the bytes it must move (memory-bound layers) or
// the FLOPs it must do (the rest), for the rate column.
struct Case {
  std::string layer, pass;
  std::function<void()> run;
  double bytes = 0, flops = 0;
  bool fused = false;  // the kernel's forward computes the gradient too (the losses, as Liger's)
};

Tensor random_targets(int64_t n, int64_t v, Device dev, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> pick(0, v - 1);
  std::vector<int64_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = pick(rng);
  return Tensor::from_i64(t, {n}, DType::i64, dev);
}

constexpr const char* kLayerNames[] = {"RMSNorm", "MLP", "rotary_pos_emb", "Attention", "CrossEntropyLoss", "ForCausalLMLoss"};

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

// --only: every name must be one of kLayerNames.
void check_only(const std::string& only) {
  for (const std::string& item : split_list(only)) {
    bool known = false;
    for (const char* n : kLayerNames) known = known || item == n;
    KCPP_CHECK(known, "kcpp bench --layers: --only names '{}', not a layer (RMSNorm, MLP, rotary_pos_emb, Attention, "
               "CrossEntropyLoss, ForCausalLMLoss)", item);
  }
}

bool wanted(const std::string& only, const std::string& layer) {
  if (only.empty()) return true;
  for (const std::string& item : split_list(only))
    if (item == layer) return true;
  return false;
}

nn::KernelConfig default_mapping(const LayersArgs& a, bool cuda) {
  const auto liger = find_built_package(a.packages, "liger");
  KCPP_CHECK(liger.has_value(),
             "kcpp bench --layers: this build's liger package was not found (under --packages, $KCPP_PACKAGES_DIR, or "
             "where the build or `cmake --install` put it beside this binary); name packages with --kernels");
  const std::string p = liger->string();
  nlohmann::json m = {{"RMSNorm", p + ":LigerRMSNorm"},
                      {"MLP", p + ":LigerGLU"},
                      {"rotary_pos_emb", p + ":LigerRotaryEmbedding"},
                      {"CrossEntropyLoss", p + ":LigerCrossEntropy"},
                      {"ForCausalLMLoss", p + ":LigerFusedLinearCrossEntropy"}};
  // flash_attn on a GPU (on the CPU, at these sizes, the reference's BLAS attention is the faster one:
  // README, the main job).
  if (const auto fa = find_built_package(a.packages, "flash_attn"); fa && cuda) m["Attention"] = fa->string();
  return nn::KernelConfig::parse(m, true);
}

int run_layers(LayersArgs a) {
  const Device dev = a.device == "auto" ? (cuda_device_count() > 0 ? Device::cuda(0) : Device::cpu()) : parse_device(a.device);
  const bool gpu = dev.is_cuda();
  check_only(a.only);
  KCPP_CHECK(a.mode == "training" || a.mode == "inference", "kcpp bench --layers: --mode '{}' is not training or inference",
             a.mode);
  const bool training = a.mode == "training";
  // Shapes: given, or the defaults of the header comment (--quick: a smoke test's).
  auto pick = [&](int64_t& v, const char* flag, int64_t quick, int64_t cpu, int64_t cuda) {
    KCPP_CHECK(v >= 0, "kcpp bench --layers: {} {} is negative", flag, v);
    if (v == 0) v = a.quick ? quick : gpu ? cuda : cpu;  // 0: not given
  };
  pick(a.tokens, "--tokens", 128, 1024, 8192);
  pick(a.seq, "--seq", 64, 1024, 2048);
  pick(a.hidden, "--hidden", 256, 4096, 4096);
  pick(a.intermediate, "--intermediate", 512, 11008, 14336);
  pick(a.vocab, "--vocab", 1000, 32000, 128256);
  pick(a.heads, "--heads", 4, 32, 32);
  pick(a.kv_heads, "--kv-heads", 2, 8, 8);
  pick(a.head_dim, "--head-dim", 64, 128, 128);
  pick(a.loss_rows, "--loss-rows", 64, 256, 4096);
  KCPP_CHECK(a.reps >= 0, "kcpp bench --layers: --reps {} is negative", a.reps);
  if (a.reps == 0) a.reps = a.quick ? 2 : gpu ? 25 : 10;  // CPU: fewer than 10 read this shared machine's noise
  KCPP_CHECK(a.tokens % a.seq == 0, "kcpp bench --layers: --tokens {} is not a multiple of --seq {}", a.tokens, a.seq);
  KCPP_CHECK(a.heads % a.kv_heads == 0, "kcpp bench --layers: --heads {} is not a multiple of --kv-heads {}", a.heads, a.kv_heads);
  const DType dt = parse_dtype(a.dtype.empty() ? (gpu ? "bf16" : "f32") : a.dtype);
  const int64_t T = a.tokens, B = a.tokens / a.seq, S = a.seq, H = a.hidden, I = a.intermediate, V = a.vocab, D = a.head_dim;
  const int64_t Hq = a.heads, Hk = a.kv_heads, N = a.loss_rows;
  const double e = static_cast<double>(dtype_size(dt));
  fmt::print("kcpp bench --layers on {}, {}, {}: {} tokens ({} x {}), hidden {}, intermediate {}, vocabulary {}, heads {} / {} of {}, "
             "losses on {} rows\n",
             dev.str(), dtype_name(dt), a.mode, T, B, S, H, I, V, Hq, Hk, D, N);

  // The copy ceiling of this run (a quick one on the CPU).
  const CopyCeiling copy = measure_copy(dev, gpu ? size_t{2} << 30 : size_t{256} << 20, gpu ? 20 : 3);
  fmt::print("device copy {:.0f} GB/s\n", copy.gbps);

  // Inputs (drawn once), as the layers of a training step see them (the gradients unused in inference).
  Generator gen(1);
  Layers model(Tensor::randn({H}, dt, dev, gen, 1.0, 0.1));
  const Tensor x = Tensor::randn({T, H}, dt, dev, gen), dy = Tensor::randn({T, H}, dt, dev, gen);
  const Tensor gate = Tensor::randn({T, I}, dt, dev, gen), up = Tensor::randn({T, I}, dt, dev, gen);
  const Tensor dh = Tensor::randn({T, I}, dt, dev, gen);
  const Tensor q = Tensor::randn({B, Hq, S, D}, dt, dev, gen), k = Tensor::randn({B, Hk, S, D}, dt, dev, gen);
  const Tensor v = Tensor::randn({B, Hk, S, D}, dt, dev, gen), dout = Tensor::randn({B, Hq, S, D}, dt, dev, gen);
  std::vector<int64_t> positions(static_cast<size_t>(S));
  for (int64_t i = 0; i < S; ++i) positions[static_cast<size_t>(i)] = i;
  const auto cs = ops::rope_cos_sin(Tensor::from_i64(positions, {1, S}, DType::i64, dev), ops::rope_inv_freq(D, 500000.0, dev), 1.0, dt);
  const Tensor logits = Tensor::randn({N, V}, dt, dev, gen), targets = random_targets(N, V, dev, 2);
  const Tensor hidden = Tensor::randn({N, H}, dt, dev, gen), lm_weight = Tensor::randn({V, H}, dt, dev, gen, 0.0, 0.02);

  // Each layer's passes.  Training: a forward as training runs it (saving for backward), and forward +
  // backward.  Inference: the forward alone, saving nothing (the losses: the loss alone).
  std::vector<Case> cases;
  auto add = [&](const std::string& layer, std::function<void()> fwd, std::function<void()> both, std::function<void()> infer,
                 double fwd_units, double both_units, double infer_units, bool flops, bool fused = false) {
    if (!wanted(a.only, layer)) return;
    auto unit = [&](double u, bool want_flops) { return flops == want_flops ? u : 0.0; };
    if (!training) {
      cases.push_back({layer, "fwd", std::move(infer), unit(infer_units, false), unit(infer_units, true), false});
      return;
    }
    cases.push_back({layer, "fwd", std::move(fwd), unit(fwd_units, false), unit(fwd_units, true), fused});
    cases.push_back({layer, "fwd+bwd", std::move(both), unit(both_units, false), unit(both_units, true), fused});
  };
  const double th = static_cast<double>(T * H) * e, ti = static_cast<double>(T * I) * e;
  add("RMSNorm", [&] { nn::RMSNorm::Saved s; model.norm.forward(x, &s); },
      [&] { nn::RMSNorm::Saved s; model.norm.forward(x, &s); model.norm.backward(dy, s); }, [&] { model.norm.forward(x); },
      2 * th, 5 * th, 2 * th, false);
  const auto mlp_fwd = [&] { model.mlp.forward(gate, up); };
  add("MLP", mlp_fwd, [&] { model.mlp.forward(gate, up); model.mlp.backward(dh, gate, up); }, mlp_fwd, 3 * ti, 8 * ti, 3 * ti,
      false);
  const double qk = static_cast<double>(q.numel() + k.numel()) * e;
  const auto rope_fwd = [&] { model.rope.forward(q, k, cs.cos, cs.sin); };
  add("rotary_pos_emb", rope_fwd,
      [&] {
        auto [qo, ko] = model.rope.forward(q, k, cs.cos, cs.sin);
        model.rope.backward(qo, ko, cs.cos, cs.sin);
      },
      rope_fwd, 2 * qk, 4 * qk, 2 * qk, false);
  // Causal attention: half of the 4 B Hq S^2 D multiply-adds forward, 2.5 times that forward + backward.
  const double attn = 2.0 * B * Hq * static_cast<double>(S) * S * D;
  add("Attention", [&] { nn::Attention::Saved s; model.attention.forward(q, k, v, &s); },
      [&] {
        nn::Attention::Saved s;
        model.attention.forward(q, k, v, &s);
        model.attention.backward(dout, s);
      },
      [&] { model.attention.forward(q, k, v); }, attn, 3.5 * attn, attn, true);
  // Cross-entropy: the logits read once and the gradient written once, forward + backward (the
  // kernel computes the gradient in its forward).
  const double nv = static_cast<double>(N * V) * e;
  add("CrossEntropyLoss", [&] { nn::CrossEntropyLoss::Saved s; model.ce.forward(logits, targets, &s); },
      [&] {
        nn::CrossEntropyLoss::Saved s;
        model.ce.forward(logits, targets, &s);
        model.ce.backward(1.0, s);
      },
      [&] { model.ce.forward(logits, targets); }, nv, 2 * nv, nv, false, true);
  // The head: three GEMMs of 2 N V H FLOPs (logits, dhidden, dweight) forward + backward, one forward only.
  const double gemm = 2.0 * static_cast<double>(N) * V * H;
  add("ForCausalLMLoss", [&] { nn::ForCausalLMLoss::Saved s; model.lm_loss.forward(hidden, lm_weight, targets, &s); },
      [&] {
        nn::ForCausalLMLoss::Saved s;
        model.lm_loss.forward(hidden, lm_weight, targets, &s);
        model.lm_loss.backward(1.0, s);
      },
      [&] { model.lm_loss.forward(hidden, lm_weight, targets); }, gemm, 3 * gemm, gemm, true, true);

  struct Measured {
    double ms = 0, peak_mib = 0;
  };
  Allocator& alloc = allocator_for(dev);
  auto measure = [&](const Case& c) {
    Measured m;
    const Timing t = time_op(dev, c.run, 1, a.reps);
    m.ms = t.median_ms;
    synchronize(dev);
    const size_t base = alloc.stats().current;
    alloc.reset_peak();
    c.run();
    synchronize(dev);
    m.peak_mib = static_cast<double>(alloc.stats().peak - base) / (1 << 20);
    return m;
  };
  std::vector<Measured> reference, kernel;
  for (const Case& c : cases) reference.push_back(measure(c));

  // Kernelized as a model is: the mapping through the hub's loader, training mode.
  hub::HubConfig hc = hub::HubConfig::from_env();
  nn::KernelConfig config;
  if (a.kernels.empty()) {
    config = default_mapping(a, gpu);
    hc.allow_all_kernels = true;  // this build's own packages, unsigned
    hc.lock_file.reset();
  } else {
    config = nn::KernelConfig::parse_text(kernel_mapping_text(a.kernels), a.use_local_kernel);
    hc.allow_all_kernels = hc.allow_all_kernels || a.allow_all;
  }
  const nn::KernelizeReport report = model.kernelize(config, training ? nn::kTraining : nn::kInference, dev,
                                                     nn::hub_loader(std::make_shared<hub::Hub>(std::move(hc))));
  fmt::print("{}", report.str());
  for (const Case& c : cases) kernel.push_back(measure(c));

  fmt::print("\n{:<17} {:<8} {:>12} {:>12} {:>8} {:>22} {:>20}\n", "layer", "pass", "reference", "kernel", "speedup",
             "kernel rate", "peak ref / kernel");
  nlohmann::json out = nlohmann::json::array();
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const Measured& r = reference[i];
    const Measured& k = kernel[i];
    std::string rate;
    if (c.fused && c.pass == "fwd") {
      rate = "(gradient too)";  // the kernel's forward did the backward's work: compare fwd+bwd
    } else if (c.bytes > 0) {
      const double gbps = c.bytes / (k.ms * 1e-3) / 1e9;
      rate = fmt::format("{:.0f} GB/s {:.1f}%", gbps, 100 * gbps / copy.gbps);
    } else if (c.flops > 0) {
      rate = fmt::format("{:.1f} TFLOP/s", c.flops / (k.ms * 1e-3) / 1e12);
    }
    fmt::print("{:<17} {:<8} {:>9.4f} ms {:>9.4f} ms {:>7.2f}x {:>22} {:>9.1f} / {:.1f} MiB\n", c.layer, c.pass, r.ms, k.ms,
               r.ms / k.ms, rate, r.peak_mib, k.peak_mib);
    out.push_back({{"layer", c.layer}, {"pass", c.pass}, {"mode", a.mode}, {"reference_ms", r.ms}, {"kernel_ms", k.ms},
                   {"reference_peak_MiB", r.peak_mib}, {"kernel_peak_MiB", k.peak_mib}, {"bytes", c.bytes}, {"flops", c.flops},
                   {"copy_GBps", copy.gbps}});
  }
  if (std::any_of(cases.begin(), cases.end(), [](const Case& c) { return c.fused; }))
    fmt::print("(the loss kernels compute the gradient in their forward, as Liger's do: their fwd rows include the "
               "backward's work, compare fwd+bwd)\n");
  // Calls that the kernels refused (supports()) ran the reference: say so, per layer.
  fmt::print("\n{}\n", model.kernel_report());
  if (!a.json_path.empty()) std::ofstream(a.json_path) << out.dump(1) << "\n";
  return 0;
}

// `kcpp bench --step`: training steps of a random Llama model (the --layers shapes; --decoder-layers
// layers), kernelized as --layers kernelizes, with every slot call and GEMM profiled
// (core/profile.h).  Each row's floor is its GEMM flops at this run's measured GEMM rate, or its
// bytes at this run's copy bandwidth; "other" is the step's wall time outside every region
// (elementwise ops, copies, the embedding, host gaps).
int run_step(LayersArgs a) {
  const Device dev = a.device == "auto" ? (cuda_device_count() > 0 ? Device::cuda(0) : Device::cpu()) : parse_device(a.device);
  const bool gpu = dev.is_cuda();
  auto pick = [&](int64_t& v, const char* flag, int64_t quick, int64_t cpu, int64_t cuda) {
    KCPP_CHECK(v >= 0, "kcpp bench --step: {} {} is negative", flag, v);
    if (v == 0) v = a.quick ? quick : gpu ? cuda : cpu;
  };
  pick(a.tokens, "--tokens", 128, 1024, 8192);
  pick(a.seq, "--seq", 64, 256, 2048);
  pick(a.hidden, "--hidden", 256, 1024, 4096);
  pick(a.intermediate, "--intermediate", 512, 2816, 14336);
  pick(a.vocab, "--vocab", 1000, 32000, 128256);
  pick(a.heads, "--heads", 4, 16, 32);
  pick(a.kv_heads, "--kv-heads", 2, 4, 8);
  pick(a.head_dim, "--head-dim", 64, 64, 128);
  KCPP_CHECK(a.decoder_layers > 0, "kcpp bench --step: --decoder-layers {} must be 1 or more", a.decoder_layers);
  KCPP_CHECK(a.tokens % a.seq == 0, "kcpp bench --step: --tokens {} is not a multiple of --seq {}", a.tokens, a.seq);
  KCPP_CHECK(a.heads % a.kv_heads == 0, "kcpp bench --step: --heads {} is not a multiple of --kv-heads {}", a.heads, a.kv_heads);
  if (a.reps == 0) a.reps = a.quick ? 1 : 3;
  const DType dt = parse_dtype(a.dtype.empty() ? (gpu ? "bf16" : "f32") : a.dtype);

  models::ModelConfig c;
  c.model_type = "llama";
  c.vocab_size = a.vocab, c.hidden_size = a.hidden, c.intermediate_size = a.intermediate, c.num_hidden_layers = a.decoder_layers;
  c.num_attention_heads = a.heads, c.num_key_value_heads = a.kv_heads, c.head_dim = a.head_dim;
  c.rms_norm_eps = 1e-5, c.rope_theta = 500000.0, c.max_position_embeddings = std::max<int64_t>(a.seq, 8192);
  fmt::print("kcpp bench --step on {}, {}: {} decoder layers, {} tokens ({} x {}), hidden {}, intermediate {}, vocabulary {}, "
             "heads {} / {} of {}\n",
             dev.str(), dtype_name(dt), a.decoder_layers, a.tokens, a.tokens / a.seq, a.seq, a.hidden, a.intermediate, a.vocab,
             a.heads, a.kv_heads, a.head_dim);

  // This run's ceilings: the copy, and the GEMM rate in the model's dtype.
  const auto ceilings = measure_ceilings(dev, a.quick || !gpu);
  double copy_gbps = 0, gemm_tflops = 0;
  for (const Ceiling& ce : ceilings) {
    if (ce.gbps > 0 && copy_gbps == 0) copy_gbps = ce.gbps;
    const bool same_dtype = ce.name.find(dt == DType::f32 ? "f32" : "bf16") != std::string::npos;
    if (ce.tflops > 0 && same_dtype && gemm_tflops == 0) gemm_tflops = ce.tflops;
  }
  fmt::print("ceilings of this run: copy {:.0f} GB/s, GEMM {:.1f} TFLOP/s\n", copy_gbps, gemm_tflops);

  auto model = models::CausalLM::random(c, dt, dev, 42);
  hub::HubConfig hc = hub::HubConfig::from_env();
  nn::KernelConfig config;
  if (a.kernels.empty()) {
    config = default_mapping(a, gpu);
    hc.allow_all_kernels = true;  // this build's own packages, unsigned
    hc.lock_file.reset();
  } else {
    config = nn::KernelConfig::parse_text(kernel_mapping_text(a.kernels), a.use_local_kernel);
    hc.allow_all_kernels = hc.allow_all_kernels || a.allow_all;
  }
  fmt::print("{}", model->kernelize(config, nn::kTraining, dev, nn::hub_loader(std::make_shared<hub::Hub>(std::move(hc)))).str());
  train::AdamWOptions o;
  o.lr = 1e-4, o.weight_decay = 0.01, o.max_grad_norm = 1.0;
  train::AdamW opt(model->parameters(), o);
  Generator gen(7);
  const Tensor ids = Tensor::randint({a.tokens / a.seq, a.seq}, 0, a.vocab, DType::i64, dev, gen);
  auto step = [&] {
    const auto r = model->loss_and_gradients(ids, ids);
    opt.step(r.grads);
  };
  step();  // warm-up: the allocator's blocks, cuBLAS's handles, the packages' first calls
  synchronize(dev);
  profile::enable(true);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < a.reps; ++i) step();
  synchronize(dev);
  const double step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / a.reps;
  profile::enable(false);
  std::vector<profile::Row> rows = profile::collect();
  std::sort(rows.begin(), rows.end(), [](const profile::Row& x, const profile::Row& y) { return x.ms > y.ms; });

  const double n = a.reps;
  fmt::print("\nstep {:.2f} ms = {:.0f} tokens/s (mean of {}; forward, backward and AdamW)\n", step_ms, a.tokens / (step_ms * 1e-3),
             a.reps);
  fmt::print("{:<44} {:>6} {:>10} {:>7} {:>10} {:>9}\n", "region", "calls", "ms", "% step", "floor ms", "of floor");
  double covered = 0, floor_total = 0;
  nlohmann::json out = {{"step_ms", step_ms}, {"copy_GBps", copy_gbps}, {"gemm_TFLOPs", gemm_tflops}, {"rows", nlohmann::json::array()}};
  for (const profile::Row& r : rows) {
    const double ms = r.ms / n;
    const double floor = std::max(gemm_tflops > 0 ? r.flops / n / (gemm_tflops * 1e12) * 1e3 : 0.0,
                                  copy_gbps > 0 ? r.bytes / n / (copy_gbps * 1e9) * 1e3 : 0.0);
    covered += ms, floor_total += floor;
    fmt::print("{:<44} {:>6} {:>10.3f} {:>6.1f}% {:>10.3f} {:>8.1f}%\n", r.name, static_cast<int64_t>(r.calls / n), ms,
               100 * ms / step_ms, floor, floor > 0 ? 100 * floor / ms : 0.0);
    out["rows"].push_back({{"name", r.name}, {"calls", r.calls / n}, {"ms", ms}, {"floor_ms", floor}});
  }
  fmt::print("{:<44} {:>6} {:>10.3f} {:>6.1f}%\n", "other (outside every region)", "", step_ms - covered,
             100 * (step_ms - covered) / step_ms);
  fmt::print("the regions' floors add up to {:.2f} ms: the step runs at {:.1f}% of them\n", floor_total, 100 * floor_total / step_ms);
  fmt::print("\n{}\n", model->kernel_report());
  if (!a.json_path.empty()) std::ofstream(a.json_path) << out.dump(1) << "\n";
  return 0;
}

}  // namespace

void add_bench_layers_options(CLI::App& bench, Action& action, const std::string& device, const bool& quick,
                              const std::string& json_path) {
  auto args = std::make_shared<LayersArgs>();
  auto layers = std::make_shared<bool>(false), step = std::make_shared<bool>(false);
  bench.add_flag("--step", *step, "Profile whole training steps of a random Llama model: time by slot and GEMM against each one's floor");
  bench.add_option("--decoder-layers", args->decoder_layers, "--step: decoder layers of the model")->capture_default_str();
  bench.add_flag("--layers", *layers,
                 "Time every layer slot (RMSNorm, MLP, rotary_pos_emb, Attention, CrossEntropyLoss, ForCausalLMLoss) "
                 "with the reference and kernelized");
  bench.add_option("--kernels", args->kernels, "--layers: a KernelConfig kernel_mapping (JSON file or inline); default: "
                                               "this build's liger and flash_attn packages");
  bench.add_flag("--use-local-kernel", args->use_local_kernel, "--layers: references in --kernels are local package folders");
  bench.add_flag("--allow-all-kernels", args->allow_all, "--layers: load unsigned or untrusted packages");
  bench.add_option("--packages", args->packages, "--layers: folder holding this build's packages (default: next to this binary)");
  bench.add_option("--only", args->only, "--layers: a comma-separated list of layer names");
  bench.add_option("--dtype", args->dtype, "--layers: f32, bf16 or f16 (default: bf16 on a GPU, f32 on the CPU)");
  bench.add_option("--tokens", args->tokens, "--layers: tokens of the batch");
  bench.add_option("--seq", args->seq, "--layers: sequence length (attention, rotary)");
  bench.add_option("--hidden", args->hidden, "--layers: hidden size");
  bench.add_option("--intermediate", args->intermediate, "--layers: MLP intermediate size");
  bench.add_option("--vocab", args->vocab, "--layers: vocabulary");
  bench.add_option("--heads", args->heads, "--layers: query heads");
  bench.add_option("--kv-heads", args->kv_heads, "--layers: key / value heads");
  bench.add_option("--head-dim", args->head_dim, "--layers: head dimension");
  bench.add_option("--loss-rows", args->loss_rows, "--layers: rows of the two losses");
  bench.add_option("--reps", args->reps, "--layers: timed runs a row (median)");
  bench.add_option("--mode", args->mode, "--layers: training (forward saving for backward, and forward + backward) or "
                                         "inference (the forward alone)")->capture_default_str();
  bench.final_callback([&action, &device, &quick, &json_path, args, layers, step] {
    if (!*layers && !*step) return;
    args->device = device, args->quick = quick, args->json_path = json_path;
    if (*step) action = [args] { return run_step(*args); };
    else action = [args] { return run_layers(*args); };
  });
}

}  // namespace kcpp::tools
