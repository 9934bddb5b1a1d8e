// A training step of a Llama model with Llama-3-8B dimensions and few layers (issue 5's benchmark):
// the reference layers against the layers kernelized with the Liger switches (this build's liger
// package) and flash_attn's attention, bf16 weights with f32 master weights and AdamW, tokens/s and peak memory of a step (the
// allocator's peak minus what was allocated before it: activations, gradients, logits, workspaces;
// the weights and optimizer state are counted separately).  Compare with Transformers' step at the
// same shapes (eager / compile / Liger), quoted in bench/RESULTS.md.
//
// Run: build/release/bin/kcpp_bench_train [--layers 4] [--batch 4] [--seq 2048] [--steps 3] [--only reference|kcpp]
//      [--checkpoint 1] (activation checkpointing per layer) [--attention 0] (kcpp without flash_attn's attention)
//      --only adamw: the optimizer step alone against the copy bandwidth measured in the same run
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>

#include "built_packages.h"
#include "core/allocator.h"
#include "core/cuda_runtime.h"
#include "core/random.h"
#include "core/timing.h"
#include "hub/hub.h"
#include "models/causal_lm.h"
#include "ops/nn/attention.h"
#include "ops/ops.h"
#include "nn/kernel_config.h"
#include "train/adamw.h"

namespace {
using namespace kcpp;

double gib(size_t b) { return static_cast<double>(b) / (1u << 30); }

void run(const std::string& impl, int64_t layers, int64_t batch, int64_t seq, int steps, bool checkpoint, bool attention) {
  const Device dev = cuda_device_count() > 0 ? Device::cuda(0) : Device::cpu();
  models::ModelConfig c;
  c.model_type = "llama";
  c.vocab_size = 128256, c.hidden_size = 4096, c.intermediate_size = 14336, c.num_hidden_layers = layers;
  c.num_attention_heads = 32, c.num_key_value_heads = 8, c.head_dim = 128;
  c.rms_norm_eps = 1e-5, c.rope_theta = 500000.0, c.max_position_embeddings = 8192;
  Allocator& a = allocator_for(dev);
  synchronize(dev);
  const size_t before_model = a.stats().current;
  auto model = models::CausalLM::random(c, DType::bf16, dev, 42);
  if (impl == "kcpp") {
    hub::HubConfig hc = hub::HubConfig::from_env();
    hc.allow_all_kernels = true;
    hc.lock_file.reset();
    hc.cache_dir = std::filesystem::temp_directory_path() / "kcpp-bench-train-cache";
    auto hub = std::make_shared<hub::Hub>(std::move(hc));
    const auto report = model->kernelize(nn::liger_kernel_config(nn::LigerSwitches{}, test::built_package_dir("liger").string(), true,
                                                                 attention ? test::built_package_dir("flash_attn").string() : ""),
                                         nn::kTraining, dev, nn::hub_loader(hub));
    std::printf("%s", report.str().c_str());
  }
  model->checkpoint_layers = checkpoint;
  train::AdamWOptions o;
  o.lr = 1e-4, o.weight_decay = 0.01, o.max_grad_norm = 1.0;
  train::AdamW opt(model->parameters(), o);
  Generator gen(7);
  const Tensor ids = Tensor::randint({batch, seq}, 0, c.vocab_size, DType::i64, dev, gen);
  double t_grad = 0, t_opt = 0;
  auto step = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = model->loss_and_gradients(ids, ids);
    const double l = r.loss.item();
    synchronize(dev);
    const auto t1 = std::chrono::steady_clock::now();
    opt.step(r.grads);
    synchronize(dev);
    t_grad += std::chrono::duration<double>(t1 - t0).count();
    t_opt += std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    return l;
  };
  double loss = step();  // warm-up: the allocator caches its blocks
  synchronize(dev);
  const size_t resident = a.stats().current - before_model;
  a.reset_peak();
  t_grad = t_opt = 0;
  const size_t base = a.stats().current;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) loss = step();
  synchronize(dev);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / steps;
  const size_t peak = a.stats().peak - base;
  std::printf("%-10s%s%s layers %lld  batch %lld x %lld  step %8.1f ms (loss+grads %.1f, AdamW %.1f)  %9.0f tokens/s  peak %6.2f GiB "
              "beyond weights + optimizer (%6.2f GiB)  loss %.4f\n",
              impl.c_str(), checkpoint ? " (checkpointed)" : "", impl == "kcpp" && !attention ? " (no attention kernel)" : "", static_cast<long long>(layers), static_cast<long long>(batch), static_cast<long long>(seq), s * 1e3,
              t_grad / steps * 1e3, t_opt / steps * 1e3, static_cast<double>(batch * seq) / s, gib(peak), gib(resident), loss);
  std::fflush(stdout);
}

// Where a step's time goes: the reference attention and one layer's GEMMs at the same shapes.
void breakdown(int64_t batch, int64_t seq) {
  const Device dev = Device::cuda(0);
  Generator gen(3);
  const Tensor q = Tensor::randn({batch, 32, seq, 128}, DType::bf16, dev, gen), k = Tensor::randn({batch, 8, seq, 128}, DType::bf16, dev, gen);
  const Tensor v = Tensor::randn({batch, 8, seq, 128}, DType::bf16, dev, gen);
  auto ms = [&](const std::function<void()>& fn) {
    fn();
    synchronize(dev);
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    synchronize(dev);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e3;
  };
  ops::AttentionForward f;
  const double fwd = ms([&] { f = ops::attention_forward(q, k, v); });
  const double bwd = ms([&] { ops::attention_backward(q, q, k, v, f); });
  const Tensor x = Tensor::randn({batch * seq, 4096}, DType::bf16, dev, gen), w = Tensor::randn({14336, 4096}, DType::bf16, dev, gen);
  const double gemm = ms([&] { ops::matmul(x, w, false, true); });
  const Tensor y = Tensor::randn({batch * seq, 14336}, DType::bf16, dev, gen);
  const double add = ms([&] { ops::add(y, y); });
  std::printf("breakdown: reference attention fwd %.1f ms, bwd %.1f ms (one layer); GEMM [%lld x 4096] x [4096 x 14336] %.2f ms; "
              "add of [%lld x 14336] bf16 %.2f ms\n",
              fwd, bwd, static_cast<long long>(batch * seq), gemm, static_cast<long long>(batch * seq), add);
}

// AdamW's step alone (squared norm + update of every parameter) at these dimensions, its bytes
// (adamw_kernels.h: 30 a bf16 element with its f32 master and a bf16 gradient) against the device
// copy measured in the same process.
void adamw_bandwidth(int64_t layers) {
  const Device dev = Device::cuda(0);
  models::ModelConfig c;
  c.model_type = "llama";
  c.vocab_size = 128256, c.hidden_size = 4096, c.intermediate_size = 14336, c.num_hidden_layers = layers;
  c.num_attention_heads = 32, c.num_key_value_heads = 8, c.head_dim = 128;
  auto model = models::CausalLM::random(c, DType::bf16, dev, 42);
  const auto params = model->parameters();
  train::AdamWOptions o;
  o.lr = 1e-4, o.weight_decay = 0.01, o.max_grad_norm = 1.0;
  train::AdamW opt(params, o);
  Generator gen(5);
  std::map<std::string, Tensor> grads;
  double bytes = 0, elements = 0;
  for (const auto& [name, p] : params) {
    grads[name] = Tensor::randn(p.shape(), DType::bf16, dev, gen, 0.0, 1e-3);
    const double n = static_cast<double>(p.numel());
    elements += n;
    bytes += n * (2 + 2 + 4 * 4 + (p.dtype() == DType::f32 ? 8 : 8 + 2));
  }
  const CopyCeiling copy = measure_copy(dev, size_t{2} << 30);
  const Timing t = time_op(dev, [&] { opt.step(grads); }, 2, 10);
  const double gbps = bytes / (t.median_ms * 1e-3) / 1e9;
  std::printf("adamw: %zu parameters, %.3f G elements, %.1f GB a step: %.2f ms (min %.2f, max %.2f), %.0f GB/s = %.1f%% of the copy "
              "(%.0f GB/s, 2 GiB, same run)\n",
              params.size(), elements / 1e9, bytes / 1e9, t.median_ms, t.min_ms, t.max_ms, gbps, 100.0 * gbps / copy.gbps, copy.gbps);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t layers = 4, batch = 4, seq = 2048;
  int steps = 3;
  std::string only;
  bool checkpoint = false, attention = true;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--layers")) layers = std::stoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--batch")) batch = std::stoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--seq")) seq = std::stoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--steps")) steps = std::stoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--only")) only = argv[i + 1];
    else if (!std::strcmp(argv[i], "--checkpoint")) checkpoint = std::string(argv[i + 1]) == "1";
    else if (!std::strcmp(argv[i], "--attention")) attention = std::string(argv[i + 1]) == "1";
  }
  try {
    if (only == "adamw") {
      adamw_bandwidth(layers);
      return 0;
    }
    if (cuda_device_count() > 0) breakdown(batch, seq);
    for (const char* impl : {"reference", "kcpp"})
      if (only.empty() || only == impl) run(impl, layers, batch, seq, steps, checkpoint, attention);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kcpp_bench_train: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
