// A training step of a Llama model with Llama-3-8B dimensions and few layers (issue 5's benchmark):
// the reference layers against the layers kernelized with the Liger switches (this build's liger
// package), bf16 weights with f32 master weights and AdamW, tokens/s and peak memory of a step (the
// allocator's peak minus what was allocated before it: activations, gradients, logits, workspaces;
// the weights and optimizer state are counted separately).  Compare with
// ../shared/anchors/h200-2026-11-22-e2e.txt (Transformers eager / compile / Liger, same shapes).
//
// Run: build/release/bin/kcpp_bench_train [--layers 4] [--batch 4] [--seq 2048] [--steps 3] [--only reference|kcpp]
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include "built_packages.h"
#include "core/allocator.h"
#include "core/cuda_runtime.h"
#include "core/random.h"
#include "core/timing.h"
#include "hub/hub.h"
#include "models/causal_lm.h"
#include "nn/kernel_config.h"
#include "train/adamw.h"

namespace {
using namespace kcpp;

double gib(size_t b) { return static_cast<double>(b) / (1u << 30); }

void run(const std::string& impl, int64_t layers, int64_t batch, int64_t seq, int steps) {
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
    const auto report = model->kernelize(nn::liger_kernel_config(nn::LigerSwitches{}, test::built_package_dir("liger").string(), true),
                                         nn::kTraining, dev, nn::hub_loader(hub));
    std::printf("%s", report.str().c_str());
  }
  train::AdamWOptions o;
  o.lr = 1e-4, o.weight_decay = 0.01, o.max_grad_norm = 1.0;
  train::AdamW opt(model->parameters(), o);
  Generator gen(7);
  const Tensor ids = Tensor::randint({batch, seq}, 0, c.vocab_size, DType::i64, dev, gen);
  auto step = [&] {
    const auto r = model->loss_and_gradients(ids, ids);
    opt.step(r.grads);
    return r.loss.item();
  };
  double loss = step();  // warm-up (also allocates the optimizer state lazily? no: AdamW allocates up front)
  synchronize(dev);
  const size_t resident = a.stats().current - before_model;
  a.reset_peak();
  const size_t base = a.stats().current;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) loss = step();
  synchronize(dev);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / steps;
  const size_t peak = a.stats().peak - base;
  std::printf("%-10s layers %lld  batch %lld x %lld  step %8.1f ms  %9.0f tokens/s  peak %6.2f GiB beyond weights + optimizer (%6.2f GiB)  loss %.4f\n",
              impl.c_str(), static_cast<long long>(layers), static_cast<long long>(batch), static_cast<long long>(seq), s * 1e3,
              static_cast<double>(batch * seq) / s, gib(peak), gib(resident), loss);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t layers = 4, batch = 4, seq = 2048;
  int steps = 3;
  std::string only;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--layers")) layers = std::stoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--batch")) batch = std::stoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--seq")) seq = std::stoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--steps")) steps = std::stoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--only")) only = argv[i + 1];
  }
  try {
    for (const char* impl : {"reference", "kcpp"})
      if (only.empty() || only == impl) run(impl, layers, batch, seq, steps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kcpp_bench_train: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
