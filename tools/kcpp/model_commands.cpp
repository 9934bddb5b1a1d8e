// `kcpp generate`: a model folder, a prompt as text (through the folder's tokenizer.json, printed
// back as text) or as token ids (printed as ids), greedy or sampled continuation with the KV cache,
// optionally with kernels by KernelConfig (a JSON file or inline JSON).  One prompt streams its
// tokens as they come; a file of prompts (one a line, text or ids) is generated as one batch and
// printed a line per prompt, in order.
//
//   kcpp generate --model DIR (--prompt TEXT | --prompt-ids 1,15,7 | --prompts FILE | --prompt-ids-file FILE)
//                 [--tokenizer FILE] [--max-new-tokens 32] [--ignore-eos] [--temperature 0.8 --top-k 50
//                 --top-p 0.9 --seed 1] [--dtype bf16] [--device cuda] [--kernels MAPPING.json]
//                 [--use-local-kernel] [--allow-all-kernels] [--stats-json FILE] [--warmup]
//                 [--chat [--system TEXT] [--chat-template FILE] [--chat-kwargs JSON] [--print-prompt]]
//
// Timing goes to stderr: time to the first token, prefill tokens/s, decode tokens/s.  --warmup first
// generates a few tokens of the same prompts untimed and unprinted (the libraries' and kernels' first
// loads, as a server has them behind it), so that the timings are of a warm process.
// Without --kernels the model gets the default mapping (nn::default_kernel_config: this project's
// packages on the hub, else this build's); --kernels none keeps the reference layers.
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <type_traits>
#include <filesystem>
#include <optional>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "commands.h"
#include "core/device.h"
#include "core/error.h"
#include "core/files.h"
#include "hub/hub.h"
#include "models/causal_lm.h"
#include "models/chat_template.h"
#include "models/mamba.h"
#include "models/tokenizer.h"
#include "nn/kernel_config.h"

namespace kcpp::tools {

namespace {

struct GenerateArgs {
  std::string model, prompt, prompt_ids, prompts_file, prompt_ids_file, tokenizer, dtype = "f32", device = "auto", kernels;
  std::string stats_json, system, chat_template, chat_kwargs;
  bool chat = false, print_prompt = false;
  int64_t max_new_tokens = 32;
  double temperature = 0.0, top_p = 1.0;
  int64_t top_k = 0;
  uint64_t seed = 0;
  bool use_local_kernel = false, allow_all = false, ignore_eos = false, warmup = false;
};

// "1,15,7" (spaces around the ids allowed); `where` names the option (and line) in errors.
std::vector<int64_t> parse_ids(const std::string& text, const std::string& where) {
  std::vector<int64_t> ids;
  std::stringstream ss(text);
  std::string part;
  while (std::getline(ss, part, ',')) {
    const size_t b = part.find_first_not_of(" \t\r"), e = part.find_last_not_of(" \t\r");
    part = b == std::string::npos ? "" : part.substr(b, e - b + 1);
    try {
      size_t used = 0;
      ids.push_back(std::stoll(part, &used));
      KCPP_CHECK(used == part.size(), "{}: '{}' is not an integer", where, part);
    } catch (const std::logic_error&) {
      KCPP_FAIL("{}: '{}' is not an integer (expected comma-separated token ids, as 1,15,7)", where, part);
    }
  }
  KCPP_CHECK(!ids.empty(), "{}: no token ids", where);
  return ids;
}

// The non-blank lines of a prompts file, each with its 1-based line number.
std::vector<std::pair<size_t, std::string>> read_lines(const std::string& path, const char* option) {
  check_readable_file(path, option);
  std::ifstream in(path);
  KCPP_CHECK(in.good(), "{}: cannot read {}", option, path);
  std::vector<std::pair<size_t, std::string>> lines;
  std::string line;
  for (size_t no = 1; std::getline(in, line); ++no) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") != std::string::npos) lines.emplace_back(no, line);
  }
  KCPP_CHECK(!lines.empty(), "{}: {} holds no prompts (one a line)", option, path);
  return lines;
}

// The bos / eos / unk / pad tokens of a tokenizer_config.json as strings (a token is a string or an
// object with "content"); an unreadable file gives none.
nlohmann::ordered_json special_tokens_of(const std::filesystem::path& config) {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  std::error_code ec;
  if (!std::filesystem::is_regular_file(config, ec)) return out;
  std::ifstream in(config);
  if (!in.good()) return out;
  const auto j = nlohmann::ordered_json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return out;
  for (const char* key : {"bos_token", "eos_token", "unk_token", "pad_token"}) {
    const auto it = j.find(key);
    if (it == j.end()) continue;
    if (it->is_string()) out[key] = *it;
    else if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) out[key] = (*it)["content"];
  }
  return out;
}

}  // namespace

models::ChatTemplate load_chat_template(const std::filesystem::path& model, const std::string& given, const std::string& user) {
  const std::filesystem::path config = model / "tokenizer_config.json";
  const std::filesystem::path src = given.empty() ? config : std::filesystem::path(given);
  KCPP_CHECK(std::filesystem::is_regular_file(src), "{}: {} not found ({})", user, src.string(),
             given.empty() ? "the model's chat template is in its tokenizer_config.json; --chat-template FILE names another"
                           : "--chat-template names a tokenizer_config.json or a template file");
  if (src.extension() == ".json") return models::ChatTemplate::from_tokenizer_config(src);
  check_readable_file(src, "--chat-template");
  std::ifstream in(src);
  KCPP_CHECK(in.good(), "--chat-template: cannot read {}", src.string());
  models::ChatTemplate t = models::ChatTemplate::parse(std::string(std::istreambuf_iterator<char>(in), {}), src.string());
  t.set_special_tokens(special_tokens_of(config));
  return t;
}

namespace {

// The length of the longest prefix of `s` that ends on a whole UTF-8 character, so that a stream
// never prints half of one (byte-level tokens can split a character).
size_t utf8_complete(const std::string& s) {
  size_t i = s.size();
  for (size_t back = 0; back < 4 && i > 0; ++back) {
    const auto c = static_cast<unsigned char>(s[i - 1]);
    if (c < 0x80) return s.size();  // ASCII: complete
    if ((c & 0xC0) == 0xC0) {       // a lead byte: complete when its continuation bytes are all here
      const size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
      return back + 1 >= need ? s.size() : i - 1;
    }
    --i;  // a continuation byte
  }
  return s.size();  // not UTF-8 at all: print as is
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
  const int given = !a.prompt.empty() + !a.prompt_ids.empty() + !a.prompts_file.empty() + !a.prompt_ids_file.empty();
  KCPP_CHECK(given == 1, "kcpp generate: give exactly one of --prompt TEXT, --prompt-ids 1,15,7, --prompts FILE and "
             "--prompt-ids-file FILE (got {})", given);
  const bool text = !a.prompt.empty() || !a.prompts_file.empty();
  std::optional<models::Tokenizer> tok;
  if (text) {
    const std::filesystem::path tf = a.tokenizer.empty() ? std::filesystem::path(a.model) / "tokenizer.json" : std::filesystem::path(a.tokenizer);
    KCPP_CHECK(std::filesystem::exists(tf), "kcpp generate: {} not found (a text prompt needs the model's tokenizer.json; "
               "--tokenizer FILE, or token ids)", tf.string());
    tok = models::Tokenizer::from_file(tf);
  }
  // --chat: each text prompt is a user message (after --system's), rendered by the model's chat
  // template with the assistant's turn opened, and tokenized as Transformers' apply_chat_template
  // does (the template writes the special tokens itself).
  std::optional<models::ChatTemplate> chat;
  nlohmann::ordered_json chat_kwargs;
  if (a.chat) {
    KCPP_CHECK(text, "kcpp generate: --chat takes text (--prompt or --prompts), not token ids");
    chat = load_chat_template(a.model, a.chat_template, "kcpp generate: --chat");
    if (!a.chat_kwargs.empty()) {
      chat_kwargs = nlohmann::ordered_json::parse(a.chat_kwargs, nullptr, /*allow_exceptions=*/false);
      KCPP_CHECK(chat_kwargs.is_object(), "--chat-kwargs: expected a JSON object such as {{\"enable_thinking\": false}}, got '{}'",
                 a.chat_kwargs);
    }
  } else {
    KCPP_CHECK(a.system.empty() && a.chat_template.empty() && a.chat_kwargs.empty(),
               "kcpp generate: --system, --chat-template and --chat-kwargs go with --chat");
  }
  auto encode = [&](const std::string& user) {
    if (!chat) return tok->encode(user, true);
    nlohmann::ordered_json messages = nlohmann::ordered_json::array();
    if (!a.system.empty()) messages.push_back({{"role", "system"}, {"content", a.system}});
    messages.push_back({{"role", "user"}, {"content", user}});
    const std::string rendered = chat->render(messages, /*add_generation_prompt=*/true, chat_kwargs);
    if (a.print_prompt) fmt::print(stderr, "{}\n", rendered);
    return tok->encode(rendered, false);
  };
  std::vector<std::vector<int64_t>> prompts;
  if (!a.prompt.empty()) {
    prompts.push_back(encode(a.prompt));
    KCPP_CHECK(!prompts[0].empty(), "kcpp generate: the prompt encodes to no tokens");
  } else if (!a.prompt_ids.empty()) {
    prompts.push_back(parse_ids(a.prompt_ids, "--prompt-ids"));
  } else {
    const bool ids = !a.prompt_ids_file.empty();
    const std::string& path = ids ? a.prompt_ids_file : a.prompts_file;
    const char* option = ids ? "--prompt-ids-file" : "--prompts";
    for (const auto& [no, line] : read_lines(path, option)) {
      prompts.push_back(ids ? parse_ids(line, fmt::format("{} {} line {}", option, path, no)) : encode(line));
      KCPP_CHECK(!prompts.back().empty(), "{}: line {} of {} encodes to no tokens", option, no, path);
    }
  }
  // Kernels after the prompts are read, so that a bad prompt file fails before the packages load.
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
  // Stops: the config's eos_token_id; in a chat also the template's end-of-turn (eos_token), which
  // some configs lack.
  std::vector<int64_t> stops = model->config().eos_token_id;
  if (chat && chat->special_tokens().contains("eos_token"))
    if (const auto id = tok->token_to_id(chat->special_tokens()["eos_token"].template get<std::string>()))
      if (std::find(stops.begin(), stops.end(), *id) == stops.end()) stops.push_back(*id);
  const std::vector<int64_t> none;
  const std::vector<int64_t>* stop = a.ignore_eos ? &none : &stops;

  // One prompt streams: its text (or ids) with the first new token (so that a prompt the model
  // refuses prints nothing before the error), then every new token as it comes.  Byte-level
  // decoding concatenates, so only the tokens not yet printed are decoded; they are held back while
  // their bytes end inside a UTF-8 character.
  const bool stream = prompts.size() == 1;
  std::vector<int64_t> seen;
  size_t printed = 0;  // tokens of `seen` already printed
  auto show = [&](bool last) {
    if (tok) {
      const std::string t = tok->decode(std::vector<int64_t>(seen.begin() + static_cast<int64_t>(printed), seen.end()), true);
      if (last || utf8_complete(t) == t.size()) {
        fmt::print("{}", t);
        printed = seen.size();
      }
    } else {
      for (; printed < seen.size(); ++printed) fmt::print("{}{}", printed ? "," : "", seen[printed]);
    }
    std::fflush(stdout);
  };
  if (stream && !chat) seen = prompts[0];  // a chat prints the answer only
  const auto on_token = [&](size_t, int64_t token) {
    seen.push_back(token);
    show(false);
  };

  if (a.warmup) (void)model->generate_batch(prompts, std::min<int64_t>(a.max_new_tokens, 4), s, &none);
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  models::CausalLM::GenerationStats st;
  std::vector<models::CausalLM::Generated> out;
  out = model->generate_batch(prompts, a.max_new_tokens, s, stop, stream ? std::function<void(size_t, int64_t)>(on_token)
                                                                         : std::function<void(size_t, int64_t)>(), &st);
  const double secs = std::chrono::duration<double>(clock::now() - t0).count();
  if (stream) {
    show(true);
    fmt::print("\n");
  } else {
    for (size_t p = 0; p < out.size(); ++p) {
      const auto& ids = out[p].ids;
      if (chat) fmt::print("{}\n", tok->decode(std::vector<int64_t>(ids.begin() + static_cast<int64_t>(prompts[p].size()), ids.end()), true));
      else if (tok) fmt::print("{}\n", tok->decode(ids, true));
      else fmt::print("{}\n", fmt::join(ids, ","));
    }
    std::fflush(stdout);  // the results, then the timings on stderr
  }
  int64_t fresh = 0, prompt_tokens = 0;
  for (size_t p = 0; p < out.size(); ++p) {
    fresh += static_cast<int64_t>(out[p].ids.size() - prompts[p].size());
    prompt_tokens += static_cast<int64_t>(prompts[p].size());
    if (out[p].reason == models::StopReason::ContextLength)
      fmt::print(stderr, "kcpp generate: {}stopped at the model's context length of {} tokens (max_position_embeddings): {} "
                 "of --max-new-tokens {} generated after the {}-token prompt\n",
                 out.size() > 1 ? fmt::format("prompt {} ", p + 1) : "", model->config().max_position_embeddings,
                 out[p].ids.size() - prompts[p].size(), a.max_new_tokens, prompts[p].size());
  }
  fmt::print(stderr, "{} new tokens for {} prompt{} in {:.3f} s on {}", fresh, out.size(), out.size() > 1 ? "s" : "", secs, dev.str());
  if (st.prefills || std::is_same_v<Model, models::CausalLM>) {
    fmt::print(stderr, ": first token after {:.1f} ms (prefill {:.0f} tokens/s); decode {} tokens in {:.3f} s ({:.1f} tokens/s{})",
               1e3 * st.first_token_seconds, prompt_tokens / std::max(st.prefill_seconds, 1e-9), st.decode_tokens,
               st.decode_seconds, st.decode_tokens / std::max(st.decode_seconds, 1e-9),
               st.graph_replays ? fmt::format(", {} steps replayed as CUDA graphs", st.graph_replays) : "");
  }
  fmt::print(stderr, "\n");
  if (!a.stats_json.empty()) {
    nlohmann::json j{{"prompts", out.size()}, {"prompt_tokens", prompt_tokens}, {"new_tokens", fresh}, {"seconds", secs},
                     {"device", dev.str()}};
    j["ids"] = nlohmann::json::array();
    for (const auto& g : out) j["ids"].push_back(g.ids);
    {
      j["first_token_seconds"] = st.first_token_seconds;
      j["prefill_seconds"] = st.prefill_seconds;
      j["prefills"] = st.prefills;
      j["decode_tokens"] = st.decode_tokens;
      j["decode_seconds"] = st.decode_seconds;
      j["graph_replays"] = st.graph_replays;
    }
    std::ofstream f(a.stats_json);
    KCPP_CHECK(f.good(), "--stats-json: cannot write {}", a.stats_json);
    f << j.dump() << "\n";
  }
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
  g->add_option("--prompt", args->prompt, "The prompt as text (tokenized by the model's tokenizer.json; the output is text)")
      ->check([](const std::string& v) { return v.empty() ? std::string("the prompt is empty: give some text") : std::string(); });
  g->add_option("--prompt-ids", args->prompt_ids, "The prompt as comma-separated token ids (the output is ids)");
  g->add_option("--prompts", args->prompts_file, "A file of text prompts, one a line, generated as one batch");
  g->add_option("--prompt-ids-file", args->prompt_ids_file, "A file of token-id prompts (1,15,7), one a line, as one batch");
  g->add_flag("--ignore-eos", args->ignore_eos, "Do not stop at the model's end-of-sequence tokens");
  g->add_option("--stats-json", args->stats_json, "Write timings and the generated ids to this JSON file");
  g->add_flag("--warmup", args->warmup, "Generate a few tokens of the same prompts first, untimed and unprinted");
  g->add_flag("--chat", args->chat,
              "The text is a user message: render it with the model's chat template (tokenizer_config.json) and print "
              "the answer");
  g->add_option("--system", args->system, "With --chat: a system message before the user's");
  g->add_option("--chat-template", args->chat_template,
                "With --chat: a tokenizer_config.json or a Jinja template file instead of the model's");
  g->add_option("--chat-kwargs", args->chat_kwargs, "With --chat: variables for the template, as JSON ({\"enable_thinking\": false})");
  g->add_flag("--print-prompt", args->print_prompt, "With --chat: print the rendered prompt to stderr");
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
