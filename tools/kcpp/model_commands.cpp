// `kcpp generate`: a model folder, a prompt as text (through the folder's tokenizer.json, printed
// back as text) or as token ids (printed as ids), greedy or sampled continuation with the KV cache,
// optionally with kernels by KernelConfig (a JSON file or inline JSON).
//
//   kcpp generate --model DIR (--prompt TEXT [--tokenizer FILE] | --prompt-ids 1,15,7) [--max-new-tokens 32]
//                 [--temperature 0.8 --top-k 50
//                 --top-p 0.9 --seed 1] [--dtype bf16] [--device cuda] [--kernels MAPPING.json]
//                 [--use-local-kernel] [--allow-all-kernels]
//
// Without --kernels the model gets the default mapping (nn::default_kernel_config: this project's
// packages on the hub, else this build's); --kernels none keeps the reference layers.
#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "commands.h"
#include "core/device.h"
#include "core/error.h"
#include "hub/hub.h"
#include "models/causal_lm.h"
#include "models/mamba.h"
#include "models/tokenizer.h"
#include "nn/kernel_config.h"

namespace kcpp::tools {

namespace {

struct GenerateArgs {
  std::string model, prompt, prompt_ids, tokenizer, dtype = "f32", device = "auto", kernels;
  int64_t max_new_tokens = 32;
  double temperature = 0.0, top_p = 1.0;
  int64_t top_k = 0;
  uint64_t seed = 0;
  bool use_local_kernel = false, allow_all = false;
};

std::vector<int64_t> parse_ids(const std::string& text) {
  std::vector<int64_t> ids;
  std::stringstream ss(text);
  std::string part;
  while (std::getline(ss, part, ',')) {
    try {
      size_t used = 0;
      ids.push_back(std::stoll(part, &used));
      KCPP_CHECK(used == part.size(), "--prompt-ids: '{}' is not an integer", part);
    } catch (const std::logic_error&) {
      KCPP_FAIL("--prompt-ids: '{}' is not an integer", part);
    }
  }
  KCPP_CHECK(!ids.empty(), "--prompt-ids: no token ids");
  return ids;
}

DType float_dtype(const std::string& s) {
  const DType t = parse_dtype(s);
  KCPP_CHECK(t == DType::f32 || t == DType::bf16 || t == DType::f16, "--dtype '{}': expected f32, bf16 or f16", s);
  return t;
}

template <class Model>
int generate_with(std::unique_ptr<Model> model, const GenerateArgs& a, const models::Sampling& s, Device dev);

int run_generate(const GenerateArgs& a) {
  const models::Sampling s{a.temperature, a.top_k, a.top_p, a.seed};
  s.validate();  // before the model is read
  KCPP_CHECK(a.max_new_tokens >= 0, "kcpp generate: --max-new-tokens is {}; it must be 0 or more", a.max_new_tokens);
  const Device dev = a.device == "auto" ? (cuda_device_count() > 0 ? Device::cuda(0) : Device::cpu()) : parse_device(a.device);
  // The model class by config.json's model_type: the state-space families, else the Llama family.
  if (models::is_mamba_folder(a.model)) return generate_with(models::MambaLM::from_folder(a.model, float_dtype(a.dtype), dev), a, s, dev);
  return generate_with(models::CausalLM::from_folder(a.model, float_dtype(a.dtype), dev), a, s, dev);
}

template <class Model>
int generate_with(std::unique_ptr<Model> model, const GenerateArgs& a, const models::Sampling& s, Device dev) {
  const bool kernels = a.kernels != "none";
  if (kernels) {
    const bool by_default = a.kernels.empty();
    hub::HubConfig hc = by_default ? nn::default_hub_config() : hub::HubConfig::from_env();
    hc.allow_all_kernels = hc.allow_all_kernels || a.allow_all;
    auto hub = std::make_shared<hub::Hub>(std::move(hc));
    const auto report = model->kernelize(
        by_default ? nn::default_kernel_config()
                   : nn::KernelConfig::parse_text(kernel_mapping_text(a.kernels), a.use_local_kernel),
        nn::kInference, dev,
        by_default ? nn::default_loader(hub, [](const std::string& p) { return find_built_package("", p.c_str()); })
                   : nn::hub_loader(hub));
    fmt::print(stderr, "{}", report.str());
  }
  KCPP_CHECK(a.prompt.empty() != a.prompt_ids.empty(), "kcpp generate: give either --prompt TEXT or --prompt-ids (exactly one)");
  std::optional<models::Tokenizer> tok;
  std::vector<int64_t> prompt;
  if (!a.prompt.empty()) {
    const std::filesystem::path tf = a.tokenizer.empty() ? std::filesystem::path(a.model) / "tokenizer.json" : std::filesystem::path(a.tokenizer);
    KCPP_CHECK(std::filesystem::exists(tf), "kcpp generate: {} not found (a text prompt needs the model's tokenizer.json; "
               "--tokenizer FILE, or --prompt-ids)", tf.string());
    tok = models::Tokenizer::from_file(tf);
    prompt = tok->encode(a.prompt, true);
    KCPP_CHECK(!prompt.empty(), "kcpp generate: the prompt encodes to no tokens");
  } else {
    prompt = parse_ids(a.prompt_ids);
  }
  const std::vector<int64_t>& eos = model->config().eos_token_id;
  const auto t0 = std::chrono::steady_clock::now();
  models::StopReason why{};
  const auto out = model->generate(prompt, a.max_new_tokens, s, tok && !eos.empty() ? &eos : nullptr, &why);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (tok) fmt::print("{}\n", tok->decode(out, true));
  else fmt::print("{}\n", fmt::join(out, ","));
  const size_t fresh = out.size() - prompt.size();
  if (why == models::StopReason::ContextLength)
    fmt::print(stderr, "kcpp generate: stopped at the model's context length of {} tokens (max_position_embeddings): {} of "
               "--max-new-tokens {} generated after the {}-token prompt\n", model->config().max_position_embeddings, fresh,
               a.max_new_tokens, prompt.size());
  fmt::print(stderr, "{} new tokens in {:.3f} s ({:.1f} tokens/s) on {}\n", fresh, secs, fresh / std::max(secs, 1e-9), dev.str());
  if (kernels) fmt::print(stderr, "{}", model->kernel_report());
  return 0;
}

}  // namespace

std::string kernel_mapping_text(const std::string& arg) {
  // A file when one has that name; otherwise the value itself must be JSON, and an object.
  constexpr const char* kForms =
      "a mapping {\"RMSNorm\": \"org/repo@>=1.0:Layer\"}, a project file {\"kernel_mapping\": {...}}, or the "
      "path of a file holding either";
  std::error_code ec;
  std::string text = arg, source = "--kernels";
  if (std::filesystem::is_regular_file(arg, ec)) {
    std::ifstream in(arg);
    KCPP_CHECK(in.good(), "--kernels: cannot read {}", arg);
    text.assign(std::istreambuf_iterator<char>(in), {});
    source = "--kernels " + arg;
  }
  const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    const size_t b = arg.find_first_not_of(" \t\r\n");
    const bool inline_json = source == "--kernels" && b != std::string::npos && (arg[b] == '{' || arg[b] == '[');
    if (source == "--kernels" && !inline_json)
      KCPP_FAIL("--kernels: '{}' is neither a file nor JSON (expected {})", arg, kForms);
    KCPP_FAIL("{}: not valid JSON (expected {})", source, kForms);
  }
  if (!j.is_object())
    KCPP_FAIL("{}: the mapping must be a JSON object, got {} (expected {})", source, j.type_name(), kForms);
  return text;
}

void add_model_commands(CLI::App& app, Action& action) {
  auto args = std::make_shared<GenerateArgs>();
  auto* g = app.add_subcommand("generate", "Continue a prompt with a Hugging Face model folder (KV cache; greedy or sampled)");
  g->add_option("--model", args->model, "Model folder: config.json + model.safetensors (or the sharded index)")->required();
  g->add_option("--prompt", args->prompt, "The prompt as text (tokenized by the model's tokenizer.json; the output is text)");
  g->add_option("--prompt-ids", args->prompt_ids, "The prompt as comma-separated token ids (the output is ids)");
  g->add_option("--tokenizer", args->tokenizer, "A tokenizer.json other than the model folder's");
  g->add_option("--max-new-tokens", args->max_new_tokens, "Tokens to generate at most")->capture_default_str();
  g->add_option("--temperature", args->temperature, "0 = greedy")->capture_default_str();
  g->add_option("--top-k", args->top_k, "Sample among the k most likely (0 = all)")->capture_default_str();
  g->add_option("--top-p", args->top_p, "Nucleus: the smallest set reaching this probability")->capture_default_str();
  g->add_option("--seed", args->seed, "Sampling seed")->capture_default_str();
  g->add_option("--dtype", args->dtype, "f32, bf16 or f16")->capture_default_str();
  g->add_option("--device", args->device, "cpu, cuda, cuda:N or auto")->capture_default_str();
  g->add_option("--kernels", args->kernels,
                "A KernelConfig kernel_mapping: a JSON file or inline JSON (default: this project's packages on the hub, "
                "kernels-cpp/..., else this build's; 'none': the reference layers)");
  g->add_flag("--use-local-kernel", args->use_local_kernel, "References in --kernels are local package folders");
  g->add_flag("--allow-all-kernels", args->allow_all, "Load unsigned or untrusted packages");
  g->callback([args, &action] { action = [args] { return run_generate(*args); }; });
}

}  // namespace kcpp::tools
