// `kcpp train`: the main job.  With no arguments it trains a small Llama-style model on the embedded
// corpus (train/corpus.h: generated text, byte-level tokens) on the GPU when there is one, else the
// CPU — first with the reference layers, then kernelized — showing progress, loss, tokens/s and peak
// memory, prints the two side by side, and samples text from the kernel-trained model.
//
// --model DIR starts from a Hugging Face folder instead (any family CausalLM loads), --data FILE
// trains on a text or JSON-lines file (train/text_data.h) through the folder's tokenizer.json (or
// --tokenizer; the byte-level one for the generated model), --lr-scheduler / --warmup-steps set the
// learning rate step by step as Transformers' schedulers do (train/schedule.h), --micro-batch splits
// each step into micro-batches whose gradients accumulate, and --kernels-only skips the reference run.
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
// gathered for its forward and its backward at its use, --prefetch: during the use before it;
// every rank gathers them all at the end, for rank 0's sample and save); the gradients are summed in
// buckets during the backward (--no-overlap: after it, and no gather ahead), a bf16 weight's in bf16
// and any other's in f32 (--reduce-dtype f32 / bf16 chooses for all), the embedding's dense (--embedding-grad sparse: as the rows of every GPU's
// tokens; auto: sparse when that moves fewer bytes); --overlap-param-gather defers the all-gather of --zero 1 and 2 to the next
// forward.  The end of a run prints the communication the steps waited for after the backward.
// --vocab gives the generated model rows past its byte-level tokens (Llama-3's 128256).
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
#include "core/files.h"
#include "core/random.h"
#include "core/timing.h"
#include "dist/communicator.h"
#include "hub/hub.h"
#include "models/causal_lm.h"
#include "models/chat_template.h"
#include "models/mamba.h"
#include "models/tokenizer.h"
#include "nn/kernel_config.h"
#include "hub/crypto.h"
#include "train/corpus.h"
#include "train/data_parallel.h"
#include "train/schedule.h"
#include "train/text_data.h"
#include "train/trainer.h"

namespace kcpp::tools {

namespace {

struct TrainArgs {
  // Unset / "": chosen by the device (run_train): a GPU gets a larger model in bf16.
  std::optional<int64_t> given_steps, given_seq, given_hidden, given_layers, given_vocab;
  int64_t steps = 0, batch = 16, seq = 0, layers = 4, hidden = 0, vocab = 0;  // as run
  int64_t micro_batch = 0;  // rows of a micro-batch; 0: the whole step at once
  double lr = 3e-3;
  std::string model;                     // --model DIR: a Hugging Face folder to start from
  std::string data, text_field = "text", tokenizer;  // --data FILE, its JSON-lines field, --tokenizer FILE
  bool text_field_given = false;
  std::string chat_template;  // --chat-template FILE
  bool assistant_only_loss = false;
  std::string eval_data;  // --eval-data FILE
  int64_t eval_every = 0, eval_windows = 256;
  std::optional<std::string> given_scheduler;
  std::optional<int64_t> given_warmup, given_schedule_steps;
  train::LrSchedule schedule;  // as run
  bool kernels_only = false;
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
  bool no_overlap = false, prefetch = false, overlap_param_gather = false;
  std::string embedding_grad = "dense";  // --embedding-grad: dense, sparse, auto
  std::string reduce_dtype = "auto";    // --reduce-dtype: the gradients' dtype on the wire
  std::string resume;  // --resume DIR
};

// The token stream the windows are drawn from, and what it is, for messages and trainer_state.json.
struct TrainingData {
  std::vector<int64_t> tokens;
  std::vector<int64_t> labels;  // each token's target (-100: not trained); empty: the tokens themselves
  std::string source;  // the --data file, or "" for the embedded corpus
  std::string what;    // "the embedded corpus", "data.jsonl"
  std::string digest;  // sha256 of the tokens (+ of the labels): a resumed run must draw from the same stream
};

// What the command needs of a model folder's config.json, either family's.
struct FolderModel {
  bool mamba = false;
  std::string model_type;
  int64_t layers = 0, hidden = 0, vocab = 0, max_positions = 0;
  std::vector<int64_t> eos;
};
FolderModel folder_model(const std::filesystem::path& folder) {
  FolderModel f;
  f.mamba = models::is_mamba_folder(folder);
  if (f.mamba) {
    const models::MambaConfig c = models::MambaConfig::from_folder(folder);
    f.model_type = c.model_type, f.layers = c.num_hidden_layers, f.hidden = c.hidden_size, f.vocab = c.vocab_size;
    f.max_positions = c.max_position_embeddings, f.eos = c.eos_token_id;
  } else {
    const models::ModelConfig c = models::ModelConfig::from_folder(folder);
    f.model_type = c.model_type, f.layers = c.num_hidden_layers, f.hidden = c.hidden_size, f.vocab = c.vocab_size;
    f.max_positions = c.max_position_embeddings, f.eos = c.eos_token_id;
  }
  return f;
}

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
  double eval_loss = std::nan("");  // on --eval-data after the last step
  int64_t eval_tokens = 0;
  std::unique_ptr<models::CausalLM> model;
  std::unique_ptr<models::MambaLM> mamba;  // a Mamba-family folder's model, instead of `model`
  std::unique_ptr<train::AdamW> opt;         // alone
  std::unique_ptr<train::DataParallel> dp;   // in a group
};

// Where a run resumes: the checkpoint folder (`kcpp train --save`: the model, the optimizer state of
// every rank, trainer_state.json) and the steps already taken.
struct Resume {
  std::filesystem::path folder;
  int64_t steps_done = 0;
  train::TrainerState state;  // its trainer_state.json
};

// trainer_state.json: what a resumed run must match or continue (the data's seed and shape, the steps).
void save_trainer_state(const std::filesystem::path& folder, const TrainArgs& a, const TrainingData& data, int64_t steps_done) {
  train::TrainerState s;
  s.steps_done = steps_done, s.seed = a.seed, s.batch = a.batch, s.seq = a.seq, s.lr = a.lr, s.dtype = a.dtype;
  s.data = data.source, s.data_tokens = static_cast<int64_t>(data.tokens.size()), s.data_sha256 = data.digest;
  s.lr_scheduler = train::lr_schedule_name(a.schedule.kind);
  s.warmup_steps = a.schedule.warmup_steps, s.schedule_steps = a.schedule.total_steps;
  std::ofstream(folder / "trainer_state.json") << s.dump();
}

Resume read_resume(const std::string& folder, const TrainArgs& a) {
  const std::filesystem::path f = std::filesystem::path(folder) / "trainer_state.json";
  std::error_code ec;
  KCPP_CHECK(std::filesystem::is_regular_file(f, ec), "kcpp train: --resume {}: no trainer_state.json (a folder written by kcpp train --save)", folder);
  std::ifstream in(f);
  KCPP_CHECK(in.good(), "kcpp train: --resume {}: cannot read its trainer_state.json", folder);
  const train::TrainerState s =
      train::TrainerState::parse(std::string(std::istreambuf_iterator<char>(in), {}), "kcpp train: --resume " + folder);
  KCPP_CHECK(s.batch == a.batch && s.seq == a.seq && s.seed == a.seed,
             "kcpp train: --resume {}: it was trained with --batch {} --seq {} --seed {}; give the same to continue its data",
             folder, s.batch, s.seq, s.seed);
  KCPP_CHECK(s.dtype == a.dtype,
             "kcpp train: --resume {}: it was trained with --dtype {}; give the same (its optimizer state is of those weights)",
             folder, s.dtype.empty() ? "?" : s.dtype);
  // The data position is found again by drawing the windows of every step taken (TokenWindows::skip):
  // a count no run reaches is a damaged file, not hours of drawing.
  KCPP_CHECK(static_cast<double>(s.steps_done) * static_cast<double>(s.batch) <= 1e10,
             "kcpp train: --resume {}: trainer_state.json says {} steps of {} rows were taken, more windows than any run "
             "draws (10^10); the file is damaged", folder, s.steps_done, s.batch);
  return {std::filesystem::path(folder), s.steps_done, s};
}

// A resumed run continues its checkpoint's data and learning-rate schedule: the same token stream
// (its position is the steps taken) and, unless --lr-scheduler / --warmup-steps say the same again,
// the saved schedule, whose end a decaying one must not pass.  (A checkpoint from before these were
// saved had the embedded corpus and a constant rate.)
void check_resume(const Resume& r, TrainArgs& a, const TrainingData& data) {
  const std::string folder = r.folder.string();
  const std::string& saved_data = r.state.data;
  const std::string& saved_digest = r.state.data_sha256;
  KCPP_CHECK(saved_data == data.source && (saved_digest.empty() || saved_digest == data.digest),
             "kcpp train: --resume {}: it was trained on {} ({} tokens), this run's data is {} ({} tokens){}; give the same "
             "--data to continue where it stopped", folder, saved_data.empty() ? "the embedded corpus" : saved_data,
             r.state.data_tokens, data.what, data.tokens.size(),
             saved_data == data.source ? " and its tokens differ" : "");
  const std::string& name = r.state.lr_scheduler;
  const int64_t warmup = r.state.warmup_steps;
  const int64_t total = r.state.schedule_steps;
  KCPP_CHECK((!a.given_scheduler || *a.given_scheduler == name) && (!a.given_warmup || *a.given_warmup == warmup) &&
                 (!a.given_schedule_steps || *a.given_schedule_steps == total),
             "kcpp train: --resume {}: it was trained with --lr-scheduler {} --warmup-steps {} --schedule-steps {}; give the same, "
             "or none of them, to continue its schedule", folder, name, warmup, total);
  try {
    a.schedule = train::LrSchedule::make(name, warmup, total);
  } catch (const Error& e) {
    KCPP_FAIL("kcpp train: --resume {}: its trainer_state.json holds a schedule this build cannot continue: {}", folder, e.what());
  }
  KCPP_CHECK(!a.schedule.decays() || r.steps_done + a.steps <= total,
             "kcpp train: --resume {}: its {} schedule ends at step {}, {} steps after its {}; --steps {} would go past it",
             folder, name, total, total - r.steps_done, r.steps_done, a.steps);
}

models::ModelConfig small_llama(const TrainArgs& a) {
  models::ModelConfig c;
  c.model_type = "llama";
  c.vocab_size = a.vocab;
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

// Rows [lo, hi) of a step's batch (this rank's share) as micro-batches of at most `micro` rows.
std::vector<train::MicroBatch> micro_batches(const std::vector<int64_t>& rows, const std::vector<int64_t>& labels, int64_t span,
                                             int64_t lo, int64_t hi, int64_t micro, Device dev) {
  std::vector<train::MicroBatch> out;
  for (int64_t b = lo; b < hi; b += micro) {
    const int64_t e = std::min(hi, b + micro);
    auto rows_of = [&](const std::vector<int64_t>& v) {
      return Tensor::from_i64(std::vector<int64_t>(v.begin() + b * span, v.begin() + e * span), {e - b, span}, DType::i64, dev);
    };
    out.push_back({rows_of(rows), rows_of(labels)});
  }
  return out;
}

// The mean loss over the labelled tokens of the eval stream's first `max_windows` consecutive windows
// of `seq` tokens (each token's target is the next, as in training; a window's first label is not
// one), `rows` windows a forward; every rank runs it (ZeRO-3 gathers the parameters for it).
struct EvalResult {
  double loss = 0;
  int64_t tokens = 0;
};
template <class Model>
EvalResult evaluate(Model& model, const TrainingData& d, int64_t seq, int64_t rows, int64_t max_windows, Device dev) {
  const int64_t windows = std::min<int64_t>(max_windows, static_cast<int64_t>(d.tokens.size()) / seq);
  const std::vector<int64_t>& targets = d.labels.empty() ? d.tokens : d.labels;
  double sum = 0;
  int64_t tokens = 0;
  for (int64_t w = 0; w < windows; w += rows) {
    const int64_t n = std::min(rows, windows - w);
    const auto from = [&](const std::vector<int64_t>& v) {
      return Tensor::from_i64(std::vector<int64_t>(v.begin() + w * seq, v.begin() + (w + n) * seq), {n, seq}, DType::i64, dev);
    };
    const Tensor labels = from(targets);
    const int64_t count = models::CausalLM::labelled_tokens(labels);
    if (count == 0) continue;
    sum += model.loss(from(d.tokens), labels).item() * static_cast<double>(count);
    tokens += count;
  }
  return {tokens > 0 ? sum / static_cast<double>(tokens) : std::nan(""), tokens};
}

Run run_one(const std::string& name, const TrainArgs& a, Device dev, const TrainingData& data, const TrainingData* eval,
            const KernelPlan* plan, Ranks& ranks, const std::optional<Resume>& resume) {
  Run r;
  r.name = name;
  const DType dtype = parse_dtype(a.dtype);
  const std::filesystem::path folder = resume ? resume->folder : std::filesystem::path(a.model);
  if (!folder.empty() && models::is_mamba_folder(folder)) r.mamba = models::MambaLM::from_folder(folder, dtype, dev);
  else if (!folder.empty()) r.model = models::CausalLM::from_folder(folder, dtype, dev);
  else r.model = models::CausalLM::random(small_llama(a), dtype, dev, a.seed);
  nn::Module& module = r.model ? static_cast<nn::Module&>(*r.model) : *r.mamba;
  const auto report = plan ? module.kernelize(plan->config, nn::kTraining, dev, plan->loader).str() : std::string();
  if (ranks.printing()) fmt::print("{}", report);
  train::AdamWOptions o;
  o.lr = a.lr, o.weight_decay = 0.01, o.max_grad_norm = 1.0;
  // Alone: one AdamW; in a group: the data-parallel step over this rank's rows of each batch.
  if (ranks.comm) {
    train::DataParallelOptions dpo;
    dpo.zero_stage = static_cast<int>(a.zero);
    dpo.overlap = !a.no_overlap;
    dpo.prefetch = a.prefetch;
    dpo.overlap_parameter_gather = a.overlap_param_gather;
    if (a.reduce_dtype != "auto") dpo.reduce_dtype = a.reduce_dtype == "bf16" ? DType::bf16 : DType::f32;
    dpo.embedding_gradient = a.embedding_grad == "sparse"  ? train::EmbeddingGradient::Sparse
                             : a.embedding_grad == "dense" ? train::EmbeddingGradient::Dense
                                                           : train::EmbeddingGradient::Auto;
    r.dp = r.model ? std::make_unique<train::DataParallel>(*r.model, *ranks.comm, o, dpo)
                   : std::make_unique<train::DataParallel>(*r.mamba, *ranks.comm, o, dpo);
    if (resume) r.dp->load_optimizer(resume->folder);
  } else {
    r.opt = std::make_unique<train::AdamW>(r.model ? r.model->parameters() : r.mamba->parameters(), o);
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
  const train::TokenWindows windows(data.tokens, span, a.batch, data.labels);
  const int64_t micro = a.micro_batch > 0 ? a.micro_batch : a.batch;
  // A resumed run continues the data where the checkpoint left it: the batches it drew are drawn again.
  if (resume) windows.skip(gen.engine(), resume->steps_done);
  Allocator& alloc = allocator_for(dev);
  synchronize(dev);
  alloc.reset_peak();
  const size_t base = alloc.stats().current;
  const int64_t tail = std::max<int64_t>(1, a.steps / 10);
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t before = resume ? resume->steps_done : 0;
  double eval_seconds = 0;
  // The time after the first step (its one-time costs: allocations, NCCL's connections), for the rate
  // without them.
  std::optional<std::chrono::steady_clock::time_point> first_done;
  train::AdamWOptions& rate = dp ? dp->optimizer().options : opt->options;
  for (int64_t step = 1; step <= a.steps; ++step) {
    // Every rank draws the same global batch (the same generator) and trains on its rows.
    std::vector<int64_t> labels;
    const std::vector<int64_t> rows = windows.next(gen.engine(), &labels);
    const std::vector<train::MicroBatch> parts = micro_batches(rows, labels, span, lo, hi, micro, dev);
    rate.lr = a.lr * a.schedule.factor(before + step - 1);
    const train::StepResult s = dp ? dp->step(parts) : r.mamba ? train::train_step(*r.mamba, *opt, parts)
                                                               : train::train_step(*r.model, *opt, parts);
    // The same loss on every rank (summed across them): all stop together, before anything is saved.
    KCPP_CHECK(std::isfinite(s.loss),
               "kcpp train: the {} run's loss is {} at step {}{}: training diverged. Lower --lr (now {:g}) or add "
               "--warmup-steps{}; nothing was saved",
               name, s.loss, before + step, step > 1 ? fmt::format(" (it was {:.4f} at step {})", r.first_loss, before + 1) : "",
               rate.lr, a.dtype == "f32" ? "" : ", or train in f32 (--dtype f32) to see whether 16-bit arithmetic overflowed");
    if (step == 1) {
      r.first_loss = s.loss;
      if (a.steps > 1) {
        synchronize(dev);
        first_done = std::chrono::steady_clock::now();
      }
    }
    r.final_loss = s.loss;
    if (step > a.steps - tail) r.tail_loss += s.loss / static_cast<double>(tail);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() - eval_seconds;
    // A bar redrawn in place on a terminal; a line every tenth of the run in a log.
    const bool tty = ::isatty(::fileno(stdout)) != 0;
    if (ranks.printing() && (tty || step % std::max<int64_t>(1, a.steps / 10) == 0 || step == a.steps)) {
      const int width = 24, done = static_cast<int>(width * step / a.steps);
      fmt::print("{}  {:<10} [{}{}] step {:>4}/{}  loss {:.4f}{}  {:>8.0f} tokens/s{}", tty ? "\r" : "", name,
                 std::string(done, '#'), std::string(width - done, ' '), before + step, before + a.steps, s.loss,
                 a.schedule.varies() ? fmt::format("  lr {:.3g}", rate.lr) : "", step * a.batch * span / secs, tty ? "" : "\n");
      std::fflush(stdout);
    }
    if (eval && a.eval_every > 0 && step % a.eval_every == 0 && step != a.steps) {
      const auto e0 = std::chrono::steady_clock::now();  // evaluation is not training time
      const EvalResult e = r.mamba ? evaluate(*r.mamba, *eval, span, micro, a.eval_windows, dev)
                                   : evaluate(*r.model, *eval, span, micro, a.eval_windows, dev);
      synchronize(dev);
      eval_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - e0).count();
      if (ranks.printing())
        fmt::print("{}  {:<10} eval at step {}: loss {:.4f} (perplexity {:.2f}) over {} tokens\n",
                   ::isatty(::fileno(stdout)) ? "\n" : "", name, before + step, e.loss, std::exp(e.loss), e.tokens);
    }
  }
  // The last step's all-gather, when deferred to a next forward (--overlap-param-gather), in the time.
  if (dp && a.zero < 3) dp->gather_parameters();
  synchronize(dev);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() - eval_seconds;
  r.tokens_per_s = static_cast<double>(a.steps * a.batch * span) / r.seconds;
  const double later_tokens_per_s =
      first_done ? static_cast<double>((a.steps - 1) * a.batch * span) /
                       (std::chrono::duration<double>(std::chrono::steady_clock::now() - *first_done).count() - eval_seconds)
                 : 0;
  r.peak_mib = static_cast<double>(alloc.stats().peak - base) / (1 << 20);
  if (eval) {
    const EvalResult e = r.mamba ? evaluate(*r.mamba, *eval, span, micro, a.eval_windows, dev)
                                 : evaluate(*r.model, *eval, span, micro, a.eval_windows, dev);
    r.eval_loss = e.loss;
    r.eval_tokens = e.tokens;
  }
  std::string comm;  // what the steps waited for of the communication, a step's mean
  if (dp) {
    const train::DataParallel::CommStats c = dp->comm_stats();
    if (c.timed > 0)
      comm = fmt::format("; gradients summed in {}, communication after the backward {:.2f} ms a step{}, embedding gradient {}",
                         dtype_name(dp->reduce_dtype(dtype)), c.after_backward_ms / c.timed,
                         a.zero == 0 || a.zero == 3 ? ""
                         : a.overlap_param_gather ? ", parameter all-gather overlapped with the forward"
                                                  : fmt::format(", parameter all-gather {:.2f} ms", c.parameter_gather_ms / c.timed),
                         c.sparse_embedding_steps == 0 ? "dense" : c.sparse_embedding_steps == c.steps ? "sparse"
                                                             : fmt::format("sparse in {} of {} steps", c.sparse_embedding_steps, c.steps));
  }
  if (ranks.printing())
    fmt::print("{}  {:<10} done: {:.1f} s, {}peak {:.1f} MiB{}{}\n", ::isatty(::fileno(stdout)) ? "\n" : "", name, r.seconds,
               first_done ? fmt::format("{:.0f} tokens/s after the first step, ", later_tokens_per_s) : "", r.peak_mib,
               ranks.world > 1 ? fmt::format(" per GPU ({} GPUs, ZeRO-{})", ranks.world, a.zero) : "", comm);
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
  KCPP_CHECK(a.vocab >= train::ByteTokenizer::kVocab && a.vocab <= INT32_MAX,
             "kcpp train: --vocab is {}; the generated model's vocabulary holds its {} byte-level tokens, so at least that "
             "(and at most 2^31 - 1)", a.vocab, train::ByteTokenizer::kVocab);
  // small_llama's heads: 4 of hidden / 4 (an even size, for RoPE) below 256, else heads of 64 in
  // pairs sharing a key-value head.
  KCPP_CHECK(a.hidden > 0 && a.hidden % 8 == 0 && (a.hidden < 256 || a.hidden % 128 == 0),
             "kcpp train: --hidden is {}; it must be a positive multiple of 8 below 256 (4 attention heads) and a multiple "
             "of 128 from 256 on (heads of 64)", a.hidden);
  KCPP_CHECK(std::isfinite(a.lr) && a.lr > 0, "kcpp train: --lr is {}; the learning rate must be a positive number", a.lr);
  KCPP_CHECK(a.micro_batch >= 0 && a.micro_batch <= a.batch,
             "kcpp train: --micro-batch is {}; it must be between 1 and --batch ({}) rows (0: the whole step at once)",
             a.micro_batch, a.batch);
}

// The token stream: --data through the tokenizer of the model trained (--tokenizer, else the model
// folder's tokenizer.json; the byte-level one for the generated model), or the embedded corpus.
TrainingData training_data(const TrainArgs& a, const std::optional<Resume>& resume, const std::string& file) {
  TrainingData d;
  if (file.empty()) {
    KCPP_CHECK(a.model.empty(), "kcpp train: --model {} needs --data FILE: the embedded corpus is byte-level text for the "
               "generated model, not for this model's vocabulary", a.model);
    d.tokens = train::ByteTokenizer().encode(train::generated_corpus(400000));
    d.what = "the embedded corpus";
  } else {
    const train::TextDocuments docs = train::read_text_documents(file, a.text_field, a.text_field_given);
    // The model's folder (the checkpoint's when resuming); none for the generated model, whose
    // tokenizer is the byte-level one it is saved with.
    const std::string folder = resume ? resume->folder.string() : a.model;
    KCPP_CHECK(!folder.empty() || a.tokenizer.empty(), "kcpp train: --tokenizer is for --model: the generated model's "
               "vocabulary is the byte-level one");
    std::filesystem::path tf;
    models::Tokenizer tok = [&] {
      if (folder.empty())
        return models::Tokenizer::from_json_text(
            models::Tokenizer::byte_level_json(train::ByteTokenizer::kBos, train::ByteTokenizer::kEos), "byte-level tokenizer");
      tf = a.tokenizer.empty() ? std::filesystem::path(folder) / "tokenizer.json" : std::filesystem::path(a.tokenizer);
      KCPP_CHECK(std::filesystem::exists(tf), "kcpp train: {} not found: --data is tokenized by the model's tokenizer.json "
                 "(or give --tokenizer FILE)", tf.string());
      return models::Tokenizer::from_file(tf);
    }();
    int64_t vocab = train::ByteTokenizer::kVocab;
    std::optional<int64_t> eos = train::ByteTokenizer::kEos;
    if (!folder.empty()) {
      const FolderModel cfg = folder_model(folder);
      vocab = cfg.vocab;
      eos = cfg.eos.empty() ? std::nullopt : std::optional<int64_t>(cfg.eos[0]);
    }
    train::Encoder encoder;
    encoder.encode = [&](std::string_view t, bool special) { return tok.encode(t, special); };
    encoder.eos = eos;
    encoder.token_bytes = [&](int64_t id) { return tok.token_bytes(id); };
    encoder.assistant_only = a.assistant_only_loss;
    KCPP_CHECK(!a.assistant_only_loss || docs.count(train::TextDocument::Kind::Messages) > 0,
               "kcpp train: --assistant-only-loss is for conversations ('messages' lines); {} has none", file);
    // Conversations are rendered by the model's chat template (tokenizer_config.json's, or its
    // chat_template.jinja), with no generation prompt: the conversation as written.
    std::optional<models::ChatTemplate> chat;
    if (docs.count(train::TextDocument::Kind::Messages) > 0 &&
        (!a.chat_template.empty() || std::filesystem::exists(std::filesystem::path(folder) / "tokenizer_config.json"))) {
      chat = load_chat_template(folder, a.chat_template, "kcpp train: --data's conversations");
      encoder.chat = [&](const nlohmann::ordered_json& messages) {
        models::ChatTemplate::Rendered r = chat->render_with_generation(messages, /*add_generation_prompt=*/false);
        return train::ChatText{std::move(r.text), std::move(r.generation)};
      };
    }
    train::TokenStream stream = train::tokenize_documents(docs, encoder, file);
    d.tokens = std::move(stream.ids);
    d.labels = std::move(stream.labels);
    for (const int64_t id : d.tokens)
      KCPP_CHECK(id >= 0 && id < vocab, "kcpp train: {} encodes {} to token {}, outside the model's vocabulary of {}; give the "
                 "model's own tokenizer", tf.empty() ? std::string("the byte-level tokenizer") : tf.string(), file, id, vocab);
    d.source = std::filesystem::absolute(file).lexically_normal().string();
    d.what = file;
  }
  auto bytes = [](const std::vector<int64_t>& v) {
    return std::string_view(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(int64_t));
  };
  d.digest = hub::sha256_hex(bytes(d.tokens));  // hashed in place: the stream may be large
  if (!d.labels.empty()) d.digest += "+" + hub::sha256_hex(bytes(d.labels));
  return d;
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
  // Not preloaded: the default mapping names packages for every family (MoE, Mamba), and a package
  // it cannot have is no error (this build's stands in, else the reference), so kernelize loads
  // those of the layers the model has, when it has them.
  return KernelPlan{c, nn::default_loader(std::make_shared<hub::Hub>(std::move(hc)),
                                          [](const std::string& p) { return find_built_package("", p.c_str()); })};
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
  if (!ranks.comm) {  // one device: the data-parallel options have nothing to act on; say so once
    std::vector<std::string> unused;
    if (a.zero != 0) unused.push_back(fmt::format("--zero {}", a.zero));
    if (a.no_overlap) unused.push_back("--no-overlap");
    if (a.prefetch) unused.push_back("--prefetch");
    if (a.overlap_param_gather) unused.push_back("--overlap-param-gather");
    if (a.embedding_grad != "dense") unused.push_back("--embedding-grad " + a.embedding_grad);
    if (a.reduce_dtype != "auto") unused.push_back("--reduce-dtype " + a.reduce_dtype);
    if (!unused.empty())
      fmt::print(stderr, "kcpp train: note: {} act with --gpus N (data parallelism); one device ignores them\n", fmt::join(unused, ", "));
  }
  a.steps = a.given_steps.value_or(dev.is_cuda() ? 1000 : 60);
  a.hidden = a.given_hidden.value_or(dev.is_cuda() ? 512 : 128);
  a.layers = a.given_layers.value_or(4);
  a.vocab = a.given_vocab.value_or(train::ByteTokenizer::kVocab);
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
  KCPP_CHECK(a.reduce_dtype == "auto" || a.reduce_dtype == "f32" || a.reduce_dtype == "bf16",
             "kcpp train: --reduce-dtype is '{}'; expected auto, f32 or bf16", a.reduce_dtype);
  KCPP_CHECK(a.embedding_grad == "auto" || a.embedding_grad == "sparse" || a.embedding_grad == "dense",
             "kcpp train: --embedding-grad is '{}'; expected auto, sparse or dense", a.embedding_grad);
  KCPP_CHECK((a.model.empty() && a.resume.empty()) || (!a.given_hidden && !a.given_layers && !a.given_vocab),
             "kcpp train: --hidden, --layers and --vocab size the generated model; {} brings its own",
             a.resume.empty() ? "--model " + a.model : "--resume " + a.resume);
  KCPP_CHECK(a.model.empty() || a.resume.empty(), "kcpp train: --model and --resume both name the model to train; a resumed run "
             "continues the model its checkpoint holds (give only --resume)");
  // The model folder's config first, so that a wrong folder fails before the data is read.
  std::optional<FolderModel> folder_config;
  if (!a.model.empty()) {
    folder_config = folder_model(a.model);
    KCPP_CHECK(a.seq <= folder_config->max_positions, "kcpp train: --seq is {}; {}'s context length (max_position_embeddings) is {}",
               a.seq, a.model, folder_config->max_positions);
    // What data parallelism cannot do for a Mamba model, before its data and weights are read.
    KCPP_CHECK(!folder_config->mamba || !ranks.comm || a.embedding_grad != "sparse",
               "kcpp train: a {} model's embedding gradient is summed dense: drop --embedding-grad sparse",
               folder_config->model_type);
  }
  // --save's folder made (or found writable) now, not after the training.
  if (!a.save.empty()) {
    const std::filesystem::path dest(a.save);
    std::error_code ec;
    KCPP_CHECK(!std::filesystem::exists(dest, ec) || std::filesystem::is_directory(dest, ec),
               "kcpp train: --save {} is a file; name a folder (it is made if missing)", a.save);
    std::filesystem::create_directories(dest, ec);
    KCPP_CHECK(!ec, "kcpp train: --save {}: cannot make the folder: {}", a.save, ec.message());
    const std::filesystem::path probe = dest / fmt::format(".kcpp-write-check-{}", ::getpid());
    const bool writable = static_cast<bool>(std::ofstream(probe));
    std::filesystem::remove(probe, ec);
    KCPP_CHECK(writable, "kcpp train: --save {}: the folder is not writable", a.save);
  }
  const std::optional<Resume> resume = a.resume.empty() ? std::nullopt : std::optional<Resume>(read_resume(a.resume, a));
  const TrainingData data = training_data(a, resume, a.data);
  const std::optional<TrainingData> eval_data =
      a.eval_data.empty() ? std::nullopt : std::optional<TrainingData>(training_data(a, resume, a.eval_data));
  KCPP_CHECK(!eval_data || static_cast<int64_t>(eval_data->tokens.size()) >= a.seq,
             "kcpp train: --eval-data {} holds {} tokens, fewer than one window of --seq {}", a.eval_data,
             eval_data ? eval_data->tokens.size() : 0, a.seq);
  KCPP_CHECK(a.eval_every >= 0 && a.eval_windows > 0, "kcpp train: --eval-every is {} and --eval-windows {}; give 0 or more "
             "steps (0: at the end only) and 1 or more windows", a.eval_every, a.eval_windows);
  if (resume) {
    check_resume(*resume, a, data);
  } else {
    try {
      a.schedule = train::LrSchedule::make(a.given_scheduler.value_or("constant"), a.given_warmup.value_or(0),
                                           a.given_schedule_steps.value_or(a.steps));
    } catch (const Error& e) {
      KCPP_FAIL("kcpp train: --lr-scheduler / --warmup-steps / --schedule-steps: {}", e.what());
    }
    KCPP_CHECK(a.schedule.total_steps >= a.steps || !a.schedule.decays(),
               "kcpp train: --schedule-steps is {}, fewer than --steps {}: the {} schedule would end before the run does",
               a.schedule.total_steps, a.steps, train::lr_schedule_name(a.schedule.kind));
  }
  const std::vector<int64_t>& tokens = data.tokens;
  KCPP_CHECK(a.seq <= train::TokenWindows::max_seq(tokens.size()),
             "kcpp train: --seq is {}; {} ({} tokens) allows sequences of at most {}", a.seq, data.what, tokens.size(),
             train::TokenWindows::max_seq(tokens.size()));
  KCPP_CHECK(a.batch <= train::TokenWindows::max_batch(tokens.size(), a.seq),
             "kcpp train: --batch is {}; at --seq {} {} ({} tokens) allows batches of at most {}", a.batch, a.seq, data.what,
             tokens.size(), train::TokenWindows::max_batch(tokens.size(), a.seq));
  if (ranks.printing()) {
    const std::string model =
        !a.model.empty()
            ? fmt::format("the {} model of {} (layers {}, hidden {}, vocabulary {})", folder_config->model_type, a.model,
                          folder_config->layers, folder_config->hidden, folder_config->vocab)
        : resume ? fmt::format("the model of {}", a.resume)
                 : fmt::format("a {}-layer Llama-style model (hidden {}, {})", a.layers, a.hidden,
                               a.vocab == train::ByteTokenizer::kVocab
                                   ? fmt::format("byte-level vocabulary {}", a.vocab)
                                   : fmt::format("vocabulary {}, of which the byte-level tokens are the first {}", a.vocab,
                                                 train::ByteTokenizer::kVocab));
    const std::string schedule =
        a.schedule.varies() ? fmt::format(", {} schedule over {} steps ({} of warmup)", train::lr_schedule_name(a.schedule.kind),
                                          a.schedule.total_steps, a.schedule.warmup_steps)
                            : "";
    const int64_t trained = std::count_if(data.labels.begin(), data.labels.end(), [](int64_t l) { return l != -100; });
    fmt::print("kcpp train: {} on {} ({} tokens{}), {} steps of {} x {} tokens{}, {} weights{}, AdamW lr {}{}, on {}{}\n", model,
               data.what, tokens.size(), data.labels.empty() ? "" : fmt::format(", {} of them trained", trained), a.steps,
               a.batch, a.seq,
               a.micro_batch > 0 && a.micro_batch < a.batch ? fmt::format(" in micro-batches of {}", a.micro_batch) : "", a.dtype,
               a.dtype == "f32" ? "" : " (f32 master copies)", a.lr, schedule, dev.str(),
               ranks.world > 1 ? fmt::format(" and {} more GPUs, data parallel over NCCL", ranks.world - 1) : "");
  }
  // The packages are looked up (and loaded) before any training, so that a bad --packages or
  // mapping fails at once.
  const std::optional<KernelPlan> plan = a.reference_only ? std::nullopt : kernel_plan(a, dev);
  KCPP_CHECK(!a.kernels_only || plan, "kcpp train: --kernels-only but no liger package was found (build it, or pass --packages DIR)");
  std::vector<Run> runs;
  if (resume && ranks.printing())
    fmt::print("resuming {} after its {} steps (model, optimizer state, data position and learning-rate schedule)\n", a.resume,
               resume->steps_done);
  const TrainingData* eval = eval_data ? &*eval_data : nullptr;
  if (!a.kernels_only) runs.push_back(run_one("reference", a, dev, data, eval, nullptr, ranks, resume));
  if (!a.reference_only) {
    if (plan) runs.push_back(run_one("kernels", a, dev, data, eval, &*plan, ranks, resume));
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
  fmt::print("\n{:<10} {:>12} {:>14} {:>12} {:>12} {:>14}{}\n", "layers", "tokens/s", "peak MiB", "first loss", "final loss",
             "last 10% mean", eval ? fmt::format(" {:>12}", "eval loss") : "");
  for (const Run& r : runs)
    fmt::print("{:<10} {:>12.0f} {:>14.1f} {:>12.4f} {:>12.4f} {:>14.4f}{}\n", r.name, r.tokens_per_s, r.peak_mib, r.first_loss,
               r.final_loss, r.tail_loss, eval ? fmt::format(" {:>12.4f}", r.eval_loss) : "");
  if (eval)
    fmt::print("eval: {} ({} labelled tokens in at most {} windows of {}), perplexity {:.2f}\n", a.eval_data, runs.back().eval_tokens,
               a.eval_windows, a.seq, std::exp(runs.back().eval_loss));
  if (runs.size() == 2)
    fmt::print("kernels vs reference: {:.2f}x tokens/s, {:.0f}% of the peak memory\n", runs[1].tokens_per_s / runs[0].tokens_per_s,
               100.0 * runs[1].peak_mib / std::max(runs[0].peak_mib, 1e-9));
  Run& best = runs.back();
  (best.model ? static_cast<nn::Module&>(*best.model) : *best.mamba).eval();
  // The folder the model came from, whose tokenizer files go with a save; none for the generated model.
  const std::filesystem::path source = resume ? resume->folder : std::filesystem::path(a.model);
  const std::filesystem::path tokenizer_file =
      !a.tokenizer.empty() ? std::filesystem::path(a.tokenizer) : source.empty() ? std::filesystem::path() : source / "tokenizer.json";
  // The save before the sample, so that a sample's failure loses nothing.
  if (!a.save.empty()) {
    if (best.model) best.model->save(a.save);
    else best.mamba->save(a.save);
    const std::filesystem::path dest(a.save);
    if (tokenizer_file.empty()) {
      std::ofstream(dest / "tokenizer.json")
          << models::Tokenizer::byte_level_json(train::ByteTokenizer::kBos, train::ByteTokenizer::kEos);
    } else {
      // The tokenizer and the files that describe its use, as the model came with them.
      std::error_code ec;
      auto bring = [&](const std::filesystem::path& from, const std::string& name) {
        if (!std::filesystem::exists(from) || std::filesystem::equivalent(from, dest / name, ec)) return;
        std::filesystem::copy_file(from, dest / name, std::filesystem::copy_options::overwrite_existing);
      };
      bring(tokenizer_file, "tokenizer.json");
      for (const char* name : {"tokenizer_config.json", "special_tokens_map.json", "generation_config.json"})
        bring(source / name, name);
    }
    save_trainer_state(a.save, a, data, steps_done);
    fmt::print("saved to {} (config.json, model.safetensors, tokenizer.json, the optimizer state, trainer_state.json) after "
               "{} steps; try: kcpp generate --model {} --prompt TEXT, or continue with kcpp train --resume {}\n",
               a.save, steps_done, a.save, a.save);
  }
  // The sample stays inside the context the model was trained on (--seq tokens).
  std::optional<models::Tokenizer> tok;  // for --data, the one that encoded it
  if (tokenizer_file.empty())
    tok = models::Tokenizer::from_json_text(models::Tokenizer::byte_level_json(train::ByteTokenizer::kBos, train::ByteTokenizer::kEos),
                                            "byte-level tokenizer");
  else if (std::filesystem::exists(tokenizer_file))
    tok = models::Tokenizer::from_file(tokenizer_file);
  if (tok) {
    // The generated model's sample starts as its corpus's sentences do; another starts as its data does.
    const std::vector<int64_t> prompt =
        source.empty() && a.data.empty()
            ? tok->encode("The ", /*add_special_tokens=*/true)
            : std::vector<int64_t>(data.tokens.begin(), data.tokens.begin() + std::min<int64_t>(8, a.seq / 2));
    const int64_t room = a.seq - static_cast<int64_t>(prompt.size());
    if (room > 0) {
      const models::Sampling sampling{0.7, 20, 0.95, a.seed};
      const int64_t n = std::min<int64_t>(160, room);
      auto out = best.model ? best.model->generate(prompt, n, sampling) : best.mamba->generate(prompt, n, sampling);
      // The generated model's rows past the byte-level tokens (--vocab) have no text.
      if (tokenizer_file.empty()) std::erase_if(out, [](int64_t id) { return id >= train::ByteTokenizer::kVocab; });
      fmt::print("\nsample ({}): {}\n", runs.back().name, tok->decode(out, /*skip_special_tokens=*/true));
    } else {
      fmt::print("\n(no sample: --seq {} leaves no room after the {}-token prompt)\n", a.seq, prompt.size());
    }
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
  auto* t = app.add_subcommand("train", "Train a small Llama-style model on the embedded corpus (or a Hugging Face model on your "
                                        "text): reference layers, then kernels, side by side");
  t->add_option("--steps", args->given_steps, "Optimizer steps (default 1000 on a GPU, 60 on the CPU)");
  t->add_option("--batch", args->batch, "Sequences per step")->capture_default_str();
  t->add_option("--seq", args->given_seq, "Tokens per sequence (default 512 on a GPU, 128 on the CPU)");
  t->add_option("--layers", args->given_layers, "Decoder layers of the generated model (default 4)");
  t->add_option("--vocab", args->given_vocab,
                "Vocabulary of the generated model: its byte-level tokens (258, the default) and unused rows up to this "
                "size (128256: Llama-3's)");
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
  t->add_flag("--kernels-only", args->kernels_only, "Skip the reference run")->excludes("--reference-only");
  t->add_option("--model", args->model, "Start from this Hugging Face model folder (config.json, safetensors, tokenizer.json) "
                "instead of a generated model; needs --data");
  t->add_option("--data", args->data, "Train on this text: a .jsonl file, one document a line as TRL's SFTTrainer takes them "
                "(its --text-field; or 'prompt' and 'completion', the completion trained; or 'messages', rendered by the model's "
                "chat template), or any other file as one plain-text document");
  t->add_option("--text-field", args->text_field, "The field of each .jsonl line that holds its text")->capture_default_str();
  t->add_option("--tokenizer", args->tokenizer, "A tokenizer.json other than the model folder's, for --data");
  t->add_option("--eval-data", args->eval_data, "Held-out text in --data's formats: its loss (and perplexity) after training, "
                "and every --eval-every steps");
  t->add_option("--eval-every", args->eval_every, "Evaluate on --eval-data every this many steps too (0: at the end only)")
      ->capture_default_str();
  t->add_option("--eval-windows", args->eval_windows, "The --eval-data windows of --seq tokens evaluated, from its start")
      ->capture_default_str();
  t->add_flag("--assistant-only-loss", args->assistant_only_loss,
              "For --data's conversations: train only on the assistant's tokens, those the chat template renders in "
              "{% generation %} blocks (TRL's assistant_only_loss)");
  t->add_option("--chat-template", args->chat_template, "For --data's conversations: a tokenizer_config.json or a Jinja "
                "template file other than the model folder's");
  t->add_option("--lr-scheduler", args->given_scheduler,
                "The learning rate step by step, as Transformers' lr_scheduler_type: constant (default), constant_with_warmup, "
                "linear or cosine (these two decay to 0 at the end of --schedule-steps)");
  t->add_option("--warmup-steps", args->given_warmup, "Steps over which the rate rises linearly from 0 (default 0)");
  t->add_option("--schedule-steps", args->given_schedule_steps,
                "The steps the schedule spans, when this run takes only the first --steps of it (to --save and --resume the "
                "rest); default: --steps");
  t->add_option("--micro-batch", args->micro_batch,
                "Rows of each micro-batch: every step's --batch rows run in micro-batches whose gradients accumulate (less "
                "memory, the same step); default: the whole batch at once");
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
  t->add_flag("--no-overlap", args->no_overlap, "With --gpus: sum the gradients after the backward, not during it (at --zero 3 "
              "also gather each layer on the compute stream at its use)");
  t->add_flag("--prefetch", args->prefetch,
              "With --gpus --zero 3: gather a layer's parameters during the use before it, not at its use (slower on "
              "the models measured so far)");
  t->add_option("--embedding-grad", args->embedding_grad,
                "With --gpus: how the embedding's gradient is summed: 'sparse' (every GPU's rows of its tokens gathered), "
                "'dense' (the whole [vocab, hidden] gradient reduced) or 'auto' (sparse when it moves fewer bytes; a tied "
                "lm_head is always dense). Dense is the default: on two H200s the sparse path waited longer (bench/RESULTS.md)")
      ->capture_default_str();
  t->add_option("--reduce-dtype", args->reduce_dtype,
                "With --gpus: the dtype the gradients are summed in across the GPUs: f32, bf16 (half the traffic, "
                "rounded at every sum) or auto (a bf16 weight's in bf16, as FSDP2 sums them; any other's in f32)")
      ->capture_default_str();
  t->add_flag("--overlap-param-gather", args->overlap_param_gather,
              "With --gpus --zero 1 or 2: all-gather the updated parameters during the next forward, each layer's waited "
              "for at its use, not after AdamW");
  t->add_option("--zero", args->zero, "With --gpus: the ZeRO stage: 0 replicates everything, 1 shards the optimizer state over the GPUs, "
                "2 the optimizer state and the gradients, 3 the parameters too (gathered a layer at a time)")
      ->capture_default_str();
  auto* text_field_opt = t->get_option("--text-field");
  auto* liger_opt = t->get_option("--liger-kernel-config");
  auto* packages_opt = t->get_option("--packages");
  t->callback([args, &action, liger_opt, packages_opt, text_field_opt] {
    args->liger_given = liger_opt->count() > 0 || packages_opt->count() > 0;
    args->text_field_given = text_field_opt->count() > 0;
    action = [args] { return run_train(*args); };
  });
}

}  // namespace kcpp::tools
