// `kcpp train`: the main job.  With no arguments it trains a small Llama-style model on the embedded
// corpus (train/corpus.h: generated text, byte-level tokens) on the GPU when there is one, else the
// CPU — first with the reference layers, then kernelized — showing progress, loss, tokens/s and peak
// memory, prints the two side by side, and samples text from the kernel-trained model.
//
// The kernel run's mapping: --kernels MAPPING when given; else, with --liger-kernel-config or
// --packages, the Liger switches over this build's liger package (and flash_attn's attention);
// else the default mapping (nn::default_kernel_config: this project's packages on the hub, falling
// back to this build's), whose attention --attention-kernel decides.
//
// --gpus N (N > 1) trains data-parallel over NCCL, one process per GPU: this process starts N copies
// of itself with RANK, WORLD_SIZE, LOCAL_RANK and KCPP_NCCL_ID set, and waits for them.  A process
// started with RANK set (by --gpus, or by another launcher that also sets KCPP_NCCL_ID) is one rank:
// it trains on GPU LOCAL_RANK with its share of every step's --batch rows (train/data_parallel.h),
// and rank 0 prints.  --zero 1 shards the optimizer state over the ranks (the gradients reduce-scattered,
// the parameters all-gathered), --zero 2 the gradients too, --zero 3 the parameters too (each layer's
// gathered for its forward and its backward; every rank gathers them all at the end, for rank 0's
// sample and save); the gradients are summed in buckets during the backward (--no-overlap: after it).
#include <fmt/format.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <unistd.h>

#include "commands.h"
#include "core/allocator.h"
#include "core/device.h"
#include "core/error.h"
#include "core/random.h"
#include "core/timing.h"
#include "dist/communicator.h"
#include "hub/hub.h"
#include "models/causal_lm.h"
#include "models/tokenizer.h"
#include "nn/kernel_config.h"
#include "train/corpus.h"
#include "train/data_parallel.h"
#include "train/trainer.h"

namespace kcpp::tools {

namespace {

struct TrainArgs {
  // Unset / "": chosen by the device (run_train): a GPU gets a larger model in bf16.
  std::optional<int64_t> given_steps, given_seq, given_hidden;
  int64_t steps = 0, batch = 16, seq = 0, layers = 4, hidden = 0;  // as run
  double lr = 3e-3;
  std::string device = "auto", dtype, packages, save;
  std::string liger_kernel_config = "{}";  // LigerSwitches as JSON, as TrainingArguments(liger_kernel_config=...)
  // flash_attn's attention: "auto" = on a GPU only (on the CPU, at the main job's sizes, the
  // reference's BLAS attention is faster; the kernel saves memory there, not time), "on", "off".
  std::string attention_kernel = "auto";
  bool reference_only = false;
  uint64_t seed = 1;
  std::string kernels;  // --kernels: a mapping (file or JSON)
  bool use_local_kernel = false, allow_all = false;
  bool liger_given = false;  // --liger-kernel-config or --packages: the Liger switches over this build's liger
  int64_t gpus = 1, zero = 0;
  bool no_overlap = false;
  std::string resume;  // --resume DIR
};

// This process's place in a data-parallel run (rank 0 of 1 when alone).
struct Ranks {
  std::unique_ptr<dist::Communicator> comm;  // null when alone
  int rank = 0, world = 1;
  bool printing() const { return rank == 0; }
};

// What the kernel run kernelizes with: a config and the loader for its references.
struct KernelPlan {
  nn::KernelConfig config;
  nn::KernelLoader loader;
};

struct Run {
  std::string name;
  double tokens_per_s = 0, peak_mib = 0, first_loss = 0, final_loss = 0, seconds = 0;
  // The mean loss of the last tenth of the steps: one step's loss is one batch's, and runs whose
  // sums differ in order (kernels with atomics, another number of GPUs) part after many bf16 steps.
  double tail_loss = 0;
  std::unique_ptr<models::CausalLM> model;
  std::unique_ptr<train::AdamW> opt;         // alone
  std::unique_ptr<train::DataParallel> dp;   // in a group
};

// Where a run resumes: the checkpoint folder (`kcpp train --save`: the model, the optimizer state of
// every rank, trainer_state.json) and the steps already taken.
struct Resume {
  std::filesystem::path folder;
  int64_t steps_done = 0;
};

// trainer_state.json: what a resumed run must match or continue (the data's seed and shape, the steps).
void save_trainer_state(const std::filesystem::path& folder, const TrainArgs& a, int64_t steps_done) {
  const nlohmann::json j{{"steps_done", steps_done}, {"seed", a.seed}, {"batch", a.batch}, {"seq", a.seq}, {"lr", a.lr},
                         {"dtype", a.dtype}};
  std::ofstream(folder / "trainer_state.json") << j.dump(1) << "\n";
}

Resume read_resume(const std::string& folder, const TrainArgs& a) {
  const std::filesystem::path f = std::filesystem::path(folder) / "trainer_state.json";
  std::ifstream in(f);
  KCPP_CHECK(in.good(), "kcpp train: --resume {}: no trainer_state.json (a folder written by kcpp train --save)", folder);
  const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  KCPP_CHECK(j.is_object() && j.contains("steps_done") && j["steps_done"].is_number_integer() && j.contains("seed"),
             "kcpp train: --resume {}: trainer_state.json is not one kcpp train wrote", folder);
  KCPP_CHECK(j.value("batch", int64_t{0}) == a.batch && j.value("seq", int64_t{0}) == a.seq &&
                 j.value("seed", uint64_t{0}) == a.seed,
             "kcpp train: --resume {}: it was trained with --batch {} --seq {} --seed {}; give the same to continue its data",
             folder, j.value("batch", int64_t{0}), j.value("seq", int64_t{0}), j.value("seed", uint64_t{0}));
  KCPP_CHECK(j.value("dtype", std::string()) == a.dtype,
             "kcpp train: --resume {}: it was trained with --dtype {}; give the same (its optimizer state is of those weights)",
             folder, j.value("dtype", std::string("?")));
  return {std::filesystem::path(folder), j["steps_done"].get<int64_t>()};
}

models::ModelConfig small_llama(const TrainArgs& a) {
  models::ModelConfig c;
  c.model_type = "llama";
  c.vocab_size = train::ByteTokenizer::kVocab;
  c.hidden_size = a.hidden;
  c.intermediate_size = a.hidden * 3;
  c.num_hidden_layers = a.layers;
  c.head_dim = a.hidden >= 256 ? 64 : a.hidden / 4;  // 64: the attention kernel's tensor-core path
  c.num_attention_heads = a.hidden / c.head_dim;
  c.num_key_value_heads = c.num_attention_heads / 2;
  c.max_position_embeddings = a.seq;
  c.rms_norm_eps = 1e-5;
  c.bos_token_id = {train::ByteTokenizer::kBos};
  c.eos_token_id = {train::ByteTokenizer::kEos};
  return c;
}

Run run_one(const std::string& name, const TrainArgs& a, Device dev, const std::vector<int64_t>& tokens,
            const KernelPlan* plan, Ranks& ranks, const std::optional<Resume>& resume) {
  Run r;
  r.name = name;
  r.model = resume ? models::CausalLM::from_folder(resume->folder, parse_dtype(a.dtype), dev)
                   : models::CausalLM::random(small_llama(a), parse_dtype(a.dtype), dev, a.seed);
  const auto report = plan ? r.model->kernelize(plan->config, nn::kTraining, dev, plan->loader).str() : std::string();
  if (ranks.printing()) fmt::print("{}", report);
  train::AdamWOptions o;
  o.lr = a.lr, o.weight_decay = 0.01, o.max_grad_norm = 1.0;
  // Alone: one AdamW; in a group: the data-parallel step over this rank's rows of each batch.
  if (ranks.comm) {
    train::DataParallelOptions dpo;
    dpo.zero_stage = static_cast<int>(a.zero);
    dpo.overlap = !a.no_overlap;
    r.dp = std::make_unique<train::DataParallel>(*r.model, *ranks.comm, o, dpo);
    if (resume) r.dp->load_optimizer(resume->folder);
  } else {
    r.opt = std::make_unique<train::AdamW>(r.model->parameters(), o);
    if (resume) train::load_optimizer_state(resume->folder, *r.opt);
  }
  if (resume) {  // the model, the optimizer and the data position of one save
    const int64_t saved = r.dp ? r.dp->optimizer().steps() : r.opt->steps();
    KCPP_CHECK(saved == resume->steps_done,
               "kcpp train: --resume {}: its optimizer state is of step {} but trainer_state.json says {}: a save that "
               "did not finish; resume from another", resume->folder.string(), saved, resume->steps_done);
  }
  train::AdamW* opt = r.opt.get();
  train::DataParallel* dp = r.dp.get();
  const int64_t lo = a.batch * ranks.rank / ranks.world, hi = a.batch * (ranks.rank + 1) / ranks.world;
  Generator gen(a.seed + 1);
  const int64_t span = a.seq;
  const train::TokenWindows windows(tokens, span, a.batch);
  // A resumed run continues the data where the checkpoint left it: the batches it drew are drawn again.
  for (int64_t i = 0; resume && i < resume->steps_done; ++i) (void)windows.next(gen.engine());
  Allocator& alloc = allocator_for(dev);
  synchronize(dev);
  alloc.reset_peak();
  const size_t base = alloc.stats().current;
  const int64_t tail = std::max<int64_t>(1, a.steps / 10);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t step = 1; step <= a.steps; ++step) {
    // Every rank draws the same global batch (the same generator) and trains on its rows.
    const std::vector<int64_t> rows = windows.next(gen.engine());
    const Tensor batch = Tensor::from_i64(std::vector<int64_t>(rows.begin() + lo * span, rows.begin() + hi * span),
                                          {hi - lo, span}, DType::i64, dev);
    const train::StepResult s = dp ? dp->step({{batch, batch}}) : train::train_step(*r.model, *opt, {{batch, batch}});
    if (step == 1) r.first_loss = s.loss;
    r.final_loss = s.loss;
    if (step > a.steps - tail) r.tail_loss += s.loss / static_cast<double>(tail);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // A bar redrawn in place on a terminal; a line every tenth of the run in a log.
    const bool tty = ::isatty(::fileno(stdout)) != 0;
    if (ranks.printing() && (tty || step % std::max<int64_t>(1, a.steps / 10) == 0 || step == a.steps)) {
      const int width = 24, done = static_cast<int>(width * step / a.steps);
      const int64_t before = resume ? resume->steps_done : 0;
      fmt::print("{}  {:<10} [{}{}] step {:>4}/{}  loss {:.4f}  {:>8.0f} tokens/s{}", tty ? "\r" : "", name,
                 std::string(done, '#'), std::string(width - done, ' '), before + step, before + a.steps, s.loss,
                 step * a.batch * span / secs, tty ? "" : "\n");
      std::fflush(stdout);
    }
  }
  synchronize(dev);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.tokens_per_s = static_cast<double>(a.steps * a.batch * span) / r.seconds;
  r.peak_mib = static_cast<double>(alloc.stats().peak - base) / (1 << 20);
  if (ranks.printing())
    fmt::print("{}  {:<10} done: {:.1f} s, peak {:.1f} MiB{}\n", ::isatty(::fileno(stdout)) ? "\n" : "", name, r.seconds,
               r.peak_mib, ranks.world > 1 ? fmt::format(" per GPU ({} GPUs, ZeRO-{})", ranks.world, a.zero) : "");
  return r;
}

// The flags that size the run, each checked by name (the corpus's limits on --seq and --batch are
// checked where the corpus is made).
void check_sizes(const TrainArgs& a) {
  KCPP_CHECK(a.steps > 0, "kcpp train: --steps is {}; it must be a positive number of optimizer steps", a.steps);
  KCPP_CHECK(a.batch > 0, "kcpp train: --batch is {}; it must be a positive number of sequences", a.batch);
  KCPP_CHECK(a.seq > 1, "kcpp train: --seq is {}; a sequence needs at least 2 tokens (each token is trained to predict the "
             "next)", a.seq);
  KCPP_CHECK(a.layers > 0, "kcpp train: --layers is {}; it must be a positive number of decoder layers", a.layers);
  // small_llama's heads: 4 of hidden / 4 (an even size, for RoPE) below 256, else heads of 64 in
  // pairs sharing a key-value head.
  KCPP_CHECK(a.hidden > 0 && a.hidden % 8 == 0 && (a.hidden < 256 || a.hidden % 128 == 0),
             "kcpp train: --hidden is {}; it must be a positive multiple of 8 below 256 (4 attention heads) and a multiple "
             "of 128 from 256 on (heads of 64)", a.hidden);
  KCPP_CHECK(std::isfinite(a.lr) && a.lr > 0, "kcpp train: --lr is {}; the learning rate must be a positive number", a.lr);
}

// Loads every reference `config` selects for training on `dev` once, now (so that a problem shows
// before any training), and returns a loader that hands those out.
nn::KernelLoader preload(const nn::KernelConfig& config, Device dev, const nn::KernelLoader& loader) {
  auto loaded = std::make_shared<std::map<std::string, hub::LoadedKernel>>();
  const hub::Backend backend = dev.is_cuda() ? hub::Backend::CUDA : hub::Backend::CPU;
  for (const std::string& layer : config.layers()) {
    const auto e = config.select(layer, nn::kTraining, backend);
    if (!e || !e->ref || loaded->count(e->ref->text)) continue;
    try {
      (*loaded)[e->ref->text] = loader(*e->ref);
    } catch (const nn::KeepReference&) {
      // kernelize keeps the reference for it and says why
    } catch (const hub::HubDisabled&) {
    }
  }
  return [loaded, loader](const hub::Reference& ref) {
    const auto it = loaded->find(ref.text);
    return it != loaded->end() ? it->second : loader(ref);
  };
}

std::optional<KernelPlan> kernel_plan(const TrainArgs& a, Device dev) {
  const bool attention = a.attention_kernel == "on" || (a.attention_kernel == "auto" && dev.is_cuda());
  if (!a.kernels.empty()) {
    hub::HubConfig hc = hub::HubConfig::from_env();
    hc.allow_all_kernels = hc.allow_all_kernels || a.allow_all;
    nn::KernelConfig c = nn::KernelConfig::parse_text(kernel_mapping_text(a.kernels), a.use_local_kernel);
    return KernelPlan{c, preload(c, dev, nn::hub_loader(std::make_shared<hub::Hub>(std::move(hc))))};
  }
  if (a.liger_given) {
    const auto liger = find_built_package(a.packages, "liger");
    if (!liger) return std::nullopt;
    const auto flash_attn = attention ? find_built_package(a.packages, "flash_attn") : std::nullopt;
    hub::HubConfig hc = hub::HubConfig::from_env();
    hc.allow_all_kernels = true;  // this build's own, unsigned
    hc.lock_file.reset();
    nn::KernelConfig c = nn::liger_kernel_config(nn::LigerSwitches::parse(nlohmann::json::parse(a.liger_kernel_config)),
                                                 liger->string(), true, flash_attn ? flash_attn->string() : "");
    return KernelPlan{c, preload(c, dev, nn::hub_loader(std::make_shared<hub::Hub>(std::move(hc))))};
  }
  // The default mapping, its attention as --attention-kernel says.
  nlohmann::json m = nn::default_kernel_mapping();
  if (a.attention_kernel == "on") m["Attention"] = nlohmann::json(m["Attention"]["cuda"]);  // a copy: not aliased
  else if (a.attention_kernel == "off") m["Attention"] = "";
  hub::HubConfig hc = nn::default_hub_config();
  hc.allow_all_kernels = hc.allow_all_kernels || a.allow_all;
  nn::KernelConfig c = nn::KernelConfig::parse(m);
  return KernelPlan{c, preload(c, dev, nn::default_loader(std::make_shared<hub::Hub>(std::move(hc)),
                                                          [](const std::string& p) { return find_built_package("", p.c_str()); }))};
}

// --gpus N: N copies of this command as ranks 0 .. N-1 of one NCCL group; waits for them all (a rank
// that fails stops the others) and returns the first failure's status.
int launch_ranks(const TrainArgs& a) {
  const int n = static_cast<int>(a.gpus), visible = cuda_device_count();
  KCPP_CHECK(visible >= n, "kcpp train: --gpus {} but {} CUDA device(s) are visible", n, visible);
  std::string why;
  KCPP_CHECK(dist::nccl_available(&why), "kcpp train: --gpus {} needs NCCL: {}", n, why);
  KCPP_CHECK(a.batch >= n, "kcpp train: --batch is {}; with --gpus {} every GPU needs at least one row of each step", a.batch, n);
  const std::string id = dist::nccl_unique_id();
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  const std::string cmdline{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  std::vector<std::string> words;
  for (size_t at = 0; at < cmdline.size();) {
    const size_t end = cmdline.find('\0', at);
    words.push_back(cmdline.substr(at, end - at));
    at = end == std::string::npos ? cmdline.size() : end + 1;
  }
  // Each rank's environment, made before forking (the child of a threaded process only execs).
  std::vector<std::vector<std::string>> envs(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    auto& env = envs[static_cast<size_t>(r)];
    for (char** e = environ; *e; ++e) {
      const std::string_view v(*e);
      if (!v.starts_with("RANK=") && !v.starts_with("WORLD_SIZE=") && !v.starts_with("LOCAL_RANK=") &&
          !v.starts_with("KCPP_NCCL_ID="))
        env.emplace_back(v);
    }
    env.push_back(fmt::format("RANK={}", r));
    env.push_back(fmt::format("WORLD_SIZE={}", n));
    env.push_back(fmt::format("LOCAL_RANK={}", r));
    env.push_back("KCPP_NCCL_ID=" + id);
  }
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  argv.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> alive;  // the ranks not yet reaped
  auto stop_all = [&] {
    for (pid_t p : alive) ::kill(p, SIGTERM);
  };
  const pid_t parent = ::getpid();
  for (int r = 0; r < n; ++r) {
    std::vector<char*> envp;
    for (std::string& e : envs[static_cast<size_t>(r)]) envp.push_back(e.data());
    envp.push_back(nullptr);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);  // a rank does not outlive the launcher
      if (::getppid() != parent) std::_Exit(126);
      ::execve("/proc/self/exe", argv.data(), envp.data());
      std::_Exit(127);
    }
    if (pid < 0) {  // the ranks started so far would wait for ever for this one
      stop_all();
      for (pid_t p : alive) ::waitpid(p, nullptr, 0);
      KCPP_FAIL("kcpp train: could not start rank {} of {}: {}", r, n, std::strerror(errno));
    }
    alive.push_back(pid);
  }
  const std::vector<pid_t> pids = alive;
  int result = 0;
  while (!alive.empty()) {
    int status = 0;
    const pid_t done = ::wait(&status);
    if (done < 0) {
      if (errno == EINTR) continue;
      break;  // no children left
    }
    alive.erase(std::remove(alive.begin(), alive.end(), done), alive.end());
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (code != 0 && result == 0) {
      result = code;
      fmt::print(stderr, "kcpp train: rank {} failed (status {}); stopping the others\n",
                 std::find(pids.begin(), pids.end(), done) - pids.begin(), code);
      stop_all();
    }
  }
  return result;
}

int run_train(TrainArgs a) {
  KCPP_CHECK(a.gpus >= 1, "kcpp train: --gpus is {}; it must be 1 or more", a.gpus);
  KCPP_CHECK(a.zero >= 0 && a.zero <= 3,
             "kcpp train: --zero is {}; expected 0 (no sharding), 1 (optimizer state sharded), 2 (optimizer state and "
             "gradients sharded) or 3 (optimizer state, gradients and parameters sharded)", a.zero);
  const std::optional<dist::LaunchInfo> launched = dist::launch_info_from_env();
  if (a.gpus > 1 && !launched) return launch_ranks(a);
  Ranks ranks;
  Device dev = a.device == "auto" ? (cuda_device_count() > 0 ? Device::cuda(0) : Device::cpu()) : parse_device(a.device);
  if (launched && launched->world_size > 1) {
    const char* id = std::getenv("KCPP_NCCL_ID");
    KCPP_CHECK(id && *id, "kcpp train: RANK is set (this process is rank {} of {}) but KCPP_NCCL_ID is not; start the ranks "
               "with kcpp train --gpus N, or give every rank the same KCPP_NCCL_ID", launched->rank, launched->world_size);
    dev = Device::cuda(launched->local_rank);
    use_device(dev);  // every launch of this process goes to its GPU
    ranks.comm = dist::nccl_communicator(*launched, id, dev);
    ranks.rank = launched->rank, ranks.world = launched->world_size;
    KCPP_CHECK(a.batch >= ranks.world, "kcpp train: --batch is {}; {} ranks need at least one row each", a.batch, ranks.world);
  }
  a.steps = a.given_steps.value_or(dev.is_cuda() ? 1000 : 60);
  a.hidden = a.given_hidden.value_or(dev.is_cuda() ? 512 : 128);
  a.seq = a.given_seq.value_or(dev.is_cuda() ? 512 : 128);
  if (a.dtype.empty()) a.dtype = dev.is_cuda() ? "bf16" : "f32";
  check_sizes(a);
  try {
    nn::LigerSwitches::parse(nlohmann::json::parse(a.liger_kernel_config));  // a mistake fails before any training
  } catch (const nlohmann::json::exception& e) {
    KCPP_FAIL("kcpp train: --liger-kernel-config is not JSON: {}", e.what());
  }
  KCPP_CHECK(a.attention_kernel == "auto" || a.attention_kernel == "on" || a.attention_kernel == "off",
             "kcpp train: --attention-kernel is '{}'; expected auto, on or off", a.attention_kernel);
  KCPP_CHECK(a.dtype == "f32" || a.dtype == "bf16" || a.dtype == "f16", "kcpp train: --dtype is '{}'; expected f32, bf16 or f16",
             a.dtype);
  const train::ByteTokenizer tok;
  const std::string corpus = train::generated_corpus(400000);
  const std::vector<int64_t> tokens = tok.encode(corpus);
  KCPP_CHECK(a.seq <= train::TokenWindows::max_seq(tokens.size()),
             "kcpp train: --seq is {}; the embedded corpus ({} tokens) allows sequences of at most {}", a.seq, tokens.size(),
             train::TokenWindows::max_seq(tokens.size()));
  KCPP_CHECK(a.batch <= train::TokenWindows::max_batch(tokens.size(), a.seq),
             "kcpp train: --batch is {}; at --seq {} the embedded corpus ({} tokens) allows batches of at most {}", a.batch,
             a.seq, tokens.size(), train::TokenWindows::max_batch(tokens.size(), a.seq));
  if (ranks.printing())
    fmt::print("kcpp train: a {}-layer Llama-style model (hidden {}, byte-level vocabulary {}) on {} bytes of generated text, "
               "{} steps of {} x {} tokens, {} weights{}, AdamW lr {}, on {}{}\n",
               a.layers, a.hidden, train::ByteTokenizer::kVocab, corpus.size(), a.steps, a.batch, a.seq, a.dtype,
               a.dtype == "f32" ? "" : " (f32 master copies)", a.lr, dev.str(),
               ranks.world > 1 ? fmt::format(" and {} more GPUs, data parallel over NCCL", ranks.world - 1) : "");
  // The packages are looked up (and loaded) before any training, so that a bad --packages or
  // mapping fails at once.
  const std::optional<KernelPlan> plan = a.reference_only ? std::nullopt : kernel_plan(a, dev);
  std::vector<Run> runs;
  const std::optional<Resume> resume = a.resume.empty() ? std::nullopt : std::optional<Resume>(read_resume(a.resume, a));
  if (resume && ranks.printing())
    fmt::print("resuming {} after its {} steps (model, optimizer state and data position)\n", a.resume, resume->steps_done);
  runs.push_back(run_one("reference", a, dev, tokens, nullptr, ranks, resume));
  if (!a.reference_only) {
    if (plan) runs.push_back(run_one("kernels", a, dev, tokens, &*plan, ranks, resume));
    else if (ranks.printing()) fmt::print("(no liger package found: build it, or pass --packages DIR; showing the reference only)\n");
  }
  // --save: every rank writes the optimizer state it keeps (then rank 0 the rest, below).
  const int64_t steps_done = (resume ? resume->steps_done : 0) + a.steps;
  if (!a.save.empty()) {
    const Run& last = runs.back();
    if (last.dp) last.dp->save_optimizer(a.save);
    else train::save_optimizer_state(a.save, *last.opt);
  }
  // ZeRO-3: every rank gathers the parameters of the model rank 0 samples from and saves; its trainer
  // goes, leaving the model whole and without the gathering hook.
  if (runs.back().dp && a.zero == 3) {
    runs.back().dp->gather_parameters();
    runs.back().dp.reset();
  }
  if (!ranks.printing()) return 0;  // rank 0 reports, samples and saves
  fmt::print("\n{:<10} {:>12} {:>14} {:>12} {:>12} {:>14}\n", "layers", "tokens/s", "peak MiB", "first loss", "final loss",
             "last 10% mean");
  for (const Run& r : runs)
    fmt::print("{:<10} {:>12.0f} {:>14.1f} {:>12.4f} {:>12.4f} {:>14.4f}\n", r.name, r.tokens_per_s, r.peak_mib, r.first_loss,
               r.final_loss, r.tail_loss);
  if (runs.size() == 2)
    fmt::print("kernels vs reference: {:.2f}x tokens/s, {:.0f}% of the peak memory\n", runs[1].tokens_per_s / runs[0].tokens_per_s,
               100.0 * runs[1].peak_mib / std::max(runs[0].peak_mib, 1e-9));
  models::CausalLM& best = *runs.back().model;
  best.eval();
  // The sample stays inside the context the model was trained on (--seq tokens).
  const std::vector<int64_t> prompt = tok.encode("The ");
  const int64_t room = a.seq - static_cast<int64_t>(prompt.size());
  if (room > 0) {
    const auto out = best.generate(prompt, std::min<int64_t>(160, room), models::Sampling{0.7, 20, 0.95, a.seed});
    fmt::print("\nsample ({}): {}\n", runs.back().name, tok.decode(out));
  } else {
    fmt::print("\n(no sample: --seq {} leaves no room after the {}-token prompt)\n", a.seq, prompt.size());
  }
  if (!a.save.empty()) {
    best.save(a.save);
    std::ofstream(std::filesystem::path(a.save) / "tokenizer.json")
        << models::Tokenizer::byte_level_json(train::ByteTokenizer::kBos, train::ByteTokenizer::kEos);
    save_trainer_state(a.save, a, steps_done);
    fmt::print("saved to {} (config.json, model.safetensors, tokenizer.json, the optimizer state, trainer_state.json) after "
               "{} steps; try: kcpp generate --model {} --prompt 'The ', or continue with kcpp train --resume {}\n",
               a.save, steps_done, a.save, a.save);
  }
  return 0;
}

}  // namespace

std::optional<std::filesystem::path> find_built_package(const std::string& given, const char* name) {
  std::vector<std::filesystem::path> candidates;
  std::error_code ec;
  if (!given.empty()) {  // a folder the user named is the only place looked in
    if (!std::filesystem::is_directory(given, ec))
      KCPP_FAIL("--packages {}: no such folder (this build's packages are in <build>/kernels)", given);
    candidates.emplace_back(given);
  } else {
    if (const char* env = std::getenv("KCPP_PACKAGES_DIR"); env && *env) candidates.emplace_back(env);
    const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (!ec) {
      candidates.push_back(exe.parent_path().parent_path() / "kernels");  // the build tree: bin/../kernels
#ifdef KCPP_INSTALLED_PACKAGES_FROM_BIN
      candidates.push_back(exe.parent_path() / KCPP_INSTALLED_PACKAGES_FROM_BIN);  // installed
#endif
    }
  }
  for (const auto& c : candidates)
    if (std::filesystem::exists(c / name / "manifest.json")) return std::filesystem::absolute(c / name);
  return std::nullopt;
}

void add_train_command(CLI::App& app, Action& action) {
  auto args = std::make_shared<TrainArgs>();
  auto* t = app.add_subcommand("train", "Train a small Llama-style model on the embedded corpus: reference layers, then kernels, side by side");
  t->add_option("--steps", args->given_steps, "Optimizer steps (default 1000 on a GPU, 60 on the CPU)");
  t->add_option("--batch", args->batch, "Sequences per step")->capture_default_str();
  t->add_option("--seq", args->given_seq, "Tokens per sequence (default 512 on a GPU, 128 on the CPU)");
  t->add_option("--layers", args->layers, "Decoder layers")->capture_default_str();
  t->add_option("--hidden", args->given_hidden,
                "Hidden size: a multiple of 8 below 256 (4 heads), of 128 from 256 on (heads of 64) (default 512 on a GPU: 8 "
                "heads of 64; 128 on the CPU: 4 heads)");
  t->add_option("--dtype", args->dtype, "Weights: f32, bf16 or f16 (16-bit with f32 master copies; default bf16 on a GPU, f32 on the CPU)");
  t->add_option("--lr", args->lr, "AdamW learning rate")->capture_default_str();
  t->add_option("--seed", args->seed, "Initialization and data seed")->capture_default_str();
  t->add_option("--device", args->device, "cpu, cuda, cuda:N or auto")->capture_default_str();
  t->add_option("--packages", args->packages, "Folder holding the built liger and flash_attn packages (default: next to this binary)");
  t->add_option("--save", args->save, "Save the trained model here as a Hugging Face folder");
  t->add_flag("--reference-only", args->reference_only, "Skip the kernel run");
  t->add_option("--liger-kernel-config", args->liger_kernel_config,
                "Liger switches as JSON, e.g. '{\"rope\": false}' (rope, rms_norm, swiglu, cross_entropy, fused_linear_cross_entropy)")
      ->capture_default_str();
  t->add_option("--attention-kernel", args->attention_kernel,
                "flash_attn's attention in the kernel run: auto (on a GPU only), on, off")->capture_default_str();
  t->add_option("--kernels", args->kernels,
                "The kernel run's KernelConfig kernel_mapping (a JSON file or inline JSON); default: this project's packages "
                "on the hub (kernels-cpp/...), else this build's (or, with --liger-kernel-config / --packages, the Liger "
                "switches over this build's liger)");
  t->add_flag("--use-local-kernel", args->use_local_kernel, "References in --kernels are local package folders");
  t->add_flag("--allow-all-kernels", args->allow_all, "Load unsigned or untrusted packages");
  t->add_option("--resume", args->resume,
                "Continue from a folder kcpp train --save wrote (model, optimizer state, data position), for --steps more; "
                "any number of GPUs");
  t->add_option("--gpus", args->gpus, "Train data-parallel on this many GPUs (one process each, NCCL)")->capture_default_str();
  t->add_flag("--no-overlap", args->no_overlap, "With --gpus: sum the gradients after the backward, not during it");
  t->add_option("--zero", args->zero, "With --gpus: the ZeRO stage: 0 replicates everything, 1 shards the optimizer state over the GPUs, "
                "2 the optimizer state and the gradients, 3 the parameters too (gathered a layer at a time)")
      ->capture_default_str();
  auto* liger_opt = t->get_option("--liger-kernel-config");
  auto* packages_opt = t->get_option("--packages");
  t->callback([args, &action, liger_opt, packages_opt] {
    args->liger_given = liger_opt->count() > 0 || packages_opt->count() > 0;
    action = [args] { return run_train(*args); };
  });
}

}  // namespace kcpp::tools
