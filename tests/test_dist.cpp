// dist::Communicator's collectives (ranks as threads: the local group) and data-parallel training
// over them: a world of 2 or 3 ranks, each with its share of the batch, ends every step with the
// parameters of one process trained on the whole batch; ZeRO stages 1 to 3 with the same parameters
// as stage 0, a share of the optimizer state (and at stage 2 of the gradients, at stage 3 of the
// parameters too), and checkpoints that resume on any number of ranks.
#include <stdlib.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/files.h"
#include "dist/communicator.h"
#include "models/causal_lm.h"
#include "models/config.h"
#include "models/safetensors.h"
#include "ops/ops.h"
#include "test_util.h"
#include "train/data_parallel.h"

namespace kcpp {
namespace {

namespace fs = std::filesystem;
using test::error_of;

// Runs fn(rank, communicator) on a thread per rank of a local group; rethrows the first failure.
template <class F> void on_ranks(int world, F&& fn) {
  auto comms = dist::local_group(world);
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r, *comms[static_cast<size_t>(r)]);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}


std::vector<double> values(int rank, int64_t n, double salt) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = std::sin(0.37 * i + rank * 1.3 + salt) * (1 + rank);
  return v;
}

TEST(Dist, CollectivesOverThreads) {
  for (int world : {1, 2, 3})
    for (DType dt : {DType::f32, DType::bf16, DType::f64}) {
      const int64_t n = 7;  // per rank, odd
      std::vector<std::vector<double>> reduced(static_cast<size_t>(world)), scattered(reduced), gathered(reduced),
          broadcast(reduced);
      on_ranks(world, [&](int r, dist::Communicator& c) {
        EXPECT_EQ(c.rank(), r);
        EXPECT_EQ(c.world_size(), world);
        const Tensor t = Tensor::from_f64(values(r, world * n, 0), {world, n}, dt);
        c.all_reduce(t, dist::ReduceOp::Avg);
        reduced[static_cast<size_t>(r)] = t.to_f64_vector();
        const Tensor in = Tensor::from_f64(values(r, world * n, 1), {world * n}, dt), out = Tensor::zeros({n}, dt);
        c.reduce_scatter(out, in, dist::ReduceOp::Sum);
        scattered[static_cast<size_t>(r)] = out.to_f64_vector();
        const Tensor mine = Tensor::from_f64(values(r, n, 2), {n}, dt), all = Tensor::zeros({world, n}, dt);
        c.all_gather(all, mine);
        gathered[static_cast<size_t>(r)] = all.to_f64_vector();
        const Tensor b = Tensor::from_f64(values(r, n, 3), {n}, dt);
        c.broadcast(b, world - 1);
        broadcast[static_cast<size_t>(r)] = b.to_f64_vector();
      });
      const std::string cfg = fmt::format("world {} {}", world, dtype_name(dt));
      // The expected results from each rank's values as rounded to the dtype, summed in f64.
      auto rounded = [&](int r, int64_t len, double salt) { return Tensor::from_f64(values(r, len, salt), {len}, dt).to_f64_vector(); };
      for (int r = 0; r < world; ++r) {
        for (int64_t i = 0; i < world * n; ++i) {
          double s = 0;
          for (int q = 0; q < world; ++q) s += rounded(q, world * n, 0)[static_cast<size_t>(i)];
          // The mean is the f64 sum times 1 / world, rounded once.
          const double want = Tensor::from_f64(std::vector<double>{s * (1.0 / world)}, {1}, dt).to_f64_vector()[0];
          ASSERT_EQ(reduced[static_cast<size_t>(r)][static_cast<size_t>(i)], want) << cfg << " all_reduce rank " << r << " at " << i;
        }
        for (int64_t i = 0; i < n; ++i) {
          double s = 0;
          for (int q = 0; q < world; ++q) s += rounded(q, world * n, 1)[static_cast<size_t>(r * n + i)];
          const double want = Tensor::from_f64(std::vector<double>{s}, {1}, dt).to_f64_vector()[0];
          ASSERT_EQ(scattered[static_cast<size_t>(r)][static_cast<size_t>(i)], want) << cfg << " reduce_scatter rank " << r;
          for (int q = 0; q < world; ++q)
            ASSERT_EQ(gathered[static_cast<size_t>(r)][static_cast<size_t>(q * n + i)], rounded(q, n, 2)[static_cast<size_t>(i)])
                << cfg << " all_gather rank " << r;
          ASSERT_EQ(broadcast[static_cast<size_t>(r)][static_cast<size_t>(i)], rounded(world - 1, n, 3)[static_cast<size_t>(i)])
              << cfg << " broadcast rank " << r;
        }
      }
    }
}

TEST(Dist, MismatchedArgumentsAreNamedOnEveryRank) {
  std::vector<std::string> messages(2);
  auto comms = dist::local_group(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        comms[static_cast<size_t>(r)]->all_reduce(Tensor::zeros({r == 0 ? 3 : 4}, DType::f32), dist::ReduceOp::Sum);
      } catch (const Error& e) {
        messages[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (const std::string& m : messages) EXPECT_NE(m.find("rank 1 passed f32 [4] but rank 0 passed f32 [3]"), std::string::npos) << m;
  EXPECT_ERROR(dist::local_group(0), "world size 0");
  auto one = dist::local_group(1);
  EXPECT_ERROR(one[0]->broadcast(Tensor::zeros({2}, DType::f32), 1), "root 1 is not a rank of this group of 1");
  EXPECT_ERROR(one[0]->all_reduce(Tensor::zeros({4, 4}, DType::f32).transpose(0, 1), dist::ReduceOp::Sum), "must be contiguous");
}

// A rank that fails before its collective (or calls another one) breaks the group: the other ranks
// get its error instead of waiting for it, and the group refuses what follows.
TEST(Dist, AFailingRankBreaksTheGroup) {
  std::vector<std::string> first(2), later(2);
  {
    auto comms = dist::local_group(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r)
      threads.emplace_back([&, r] {
        const Tensor t = Tensor::zeros({4, 4}, DType::f32);
        first[static_cast<size_t>(r)] =
            error_of([&] { comms[static_cast<size_t>(r)]->all_reduce(r == 1 ? t.transpose(0, 1) : t, dist::ReduceOp::Sum); });
        later[static_cast<size_t>(r)] = error_of([&] { comms[static_cast<size_t>(r)]->broadcast(t, 0); });
      });
    for (auto& t : threads) t.join();
  }
  EXPECT_NE(first[1].find("must be contiguous"), std::string::npos) << first[1];
  EXPECT_NE(first[0].find("rank 1 of the local group failed"), std::string::npos) << first[0];
  for (const std::string& m : later) EXPECT_NE(m.find("the group is broken"), std::string::npos) << m;
  // Different collectives at the same point: both ranks are told.
  std::vector<std::string> kinds(2);
  auto comms = dist::local_group(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      const Tensor t = Tensor::zeros({3}, DType::f32);
      kinds[static_cast<size_t>(r)] = error_of([&] {
        if (r == 0) comms[0]->all_reduce(t, dist::ReduceOp::Sum);
        else comms[1]->broadcast(t, 0);
      });
    });
  for (auto& t : threads) t.join();
  for (const std::string& m : kinds) EXPECT_NE(m.find("rank 1 called broadcast but rank 0 called all_reduce"), std::string::npos) << m;
}

TEST(Dist, LaunchInfoFromTheEnvironment) {
  ::unsetenv("RANK");
  EXPECT_FALSE(dist::launch_info_from_env().has_value());
  ::setenv("RANK", "2", 1);
  ::setenv("WORLD_SIZE", "4", 1);
  ::unsetenv("LOCAL_RANK");
  const auto w = dist::launch_info_from_env();
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->rank, 2);
  EXPECT_EQ(w->world_size, 4);
  EXPECT_EQ(w->local_rank, 2);
  ::setenv("WORLD_SIZE", "2", 1);
  EXPECT_ERROR(dist::launch_info_from_env(), "RANK is 2 but WORLD_SIZE is 2");
  ::setenv("WORLD_SIZE", "two", 1);
  EXPECT_ERROR(dist::launch_info_from_env(), "WORLD_SIZE is 'two'");
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
}

// Data parallelism: the batch's rows split over the ranks (shares with different numbers of
// labelled tokens, one share a single row), three steps; every rank's parameters equal the
// single-process model's after each step, in f32, within the rounding of a different summation
// order.  ZeRO-1 gives stage 0's parameters exactly and keeps a share of the AdamW state.
// The backward hands over each gradient once, whole, the last layer's before the first's; the reduction of
// buckets during the backward (DataParallelOptions::overlap) gives the parameters that reducing after
// the backward gives, bit for bit, with two micro-batches a rank (the hook sees their sum), at every
// ZeRO stage (stages 1 to 3: the buckets reduce-scattered as soon as they are complete).
TEST(Dist, OverlappedReductionEqualsTheReductionAfterTheBackward) {
  const fs::path dir = fs::path(test::fixtures_dir()) / "llama";
  const models::ModelConfig cfg = models::ModelConfig::from_folder(dir);
  Generator gen(5);
  const Tensor ids = Tensor::randint({4, 7}, 0, cfg.vocab_size, DType::i64, Device::cpu(), gen);
  {
    auto model = models::CausalLM::random(cfg, DType::f32, Device::cpu(), 7, 0.5);
    std::vector<std::string> order;
    std::map<std::string, const void*> handed;
    const auto r = model->loss_and_gradients(ids, ids, 1.0, ops::Reduction::Mean, [&](const std::string& n, const Tensor& g) {
      order.push_back(n);
      handed[n] = g.data();
    });
    ASSERT_EQ(order.size(), r.grads.size()) << "each gradient handed over once";
    for (const auto& [n, g] : r.grads) EXPECT_EQ(handed.at(n), g.data()) << n << ": not the tensor the result holds";
    // The final norm (and an untied head) first, then the layers from the last down, the embedding last.
    const size_t head = cfg.tie_word_embeddings ? 1 : 2;
    EXPECT_EQ(order.front(), "model.norm.weight");
    EXPECT_TRUE(order[head].starts_with(fmt::format("model.layers.{}.", cfg.num_hidden_layers - 1))) << order[head];
    EXPECT_TRUE(order[order.size() - 2].starts_with("model.layers.0.")) << order[order.size() - 2];
    EXPECT_EQ(order.back(), "model.embed_tokens.weight");
  }
  train::AdamWOptions o;
  o.lr = 5e-3, o.max_grad_norm = 0.5;
  for (int zero : {0, 1, 2, 3}) {
  std::map<bool, std::vector<std::map<std::string, std::vector<double>>>> got;
  for (bool overlap : {false, true}) {
    got[overlap].resize(2);
    on_ranks(2, [&](int r, dist::Communicator& c) {
      auto model = models::CausalLM::random(cfg, DType::f32, Device::cpu(), 7, 0.5);
      train::DataParallelOptions dp;
      dp.bucket_mib = 0.01, dp.overlap = overlap, dp.zero_stage = zero;
      train::DataParallel trainer(*model, c, o, dp);
      const Tensor mine = ids.narrow(0, 2 * r, 2);
      for (int step = 0; step < 2; ++step)
        (void)trainer.step({{mine.narrow(0, 0, 1).contiguous(), mine.narrow(0, 0, 1).contiguous()},
                            {mine.narrow(0, 1, 1).contiguous(), mine.narrow(0, 1, 1).contiguous()}});
      trainer.gather_parameters();  // stage 3: whole again to read
      for (const auto& [name, p] : model->parameters()) got[overlap][static_cast<size_t>(r)][name] = p.to_f64_vector();
    });
  }
  for (int r = 0; r < 2; ++r)
    for (const auto& [name, v] : got[true][static_cast<size_t>(r)])
      EXPECT_EQ(v, got[false][static_cast<size_t>(r)].at(name)) << "ZeRO-" << zero << " rank " << r << " " << name;
  }
}

// Why a test of a group of one over NCCL cannot run here ("" when it can).
std::string why_no_gpu_group() {
  if (cuda_device_count() == 0) return "no CUDA device";
  std::string why;
  return dist::nccl_available(&why) ? std::string() : why;
}

// On a GPU with NCCL (a group of one): the buckets summed on the side stream during the backward give
// the parameters that summing after the backward gives, bit for bit, in bf16 with two micro-batches.
TEST(Dist, OverlapOnTheGpuOverNccl) {
  if (const std::string why = why_no_gpu_group(); !why.empty()) GTEST_SKIP() << "skipped: " << why;
  const models::ModelConfig cfg = models::ModelConfig::from_folder(fs::path(test::fixtures_dir()) / "llama");
  Generator gen(9);
  const Tensor ids = Tensor::randint({2, 11}, 0, cfg.vocab_size, DType::i64, Device::cpu(), gen).to(Device::cuda(0));
  train::AdamWOptions o;
  o.lr = 5e-3;
  std::map<bool, std::map<std::string, std::vector<double>>> got;
  for (bool overlap : {false, true}) {
    const auto comm = dist::nccl_communicator({}, dist::nccl_unique_id(), Device::cuda(0));
    auto model = models::CausalLM::random(cfg, DType::bf16, Device::cuda(0), 7, 0.5);
    train::DataParallelOptions dp;
    dp.bucket_mib = 0.01, dp.overlap = overlap;
    train::DataParallel trainer(*model, *comm, o, dp);
    for (int step = 0; step < 2; ++step)
      (void)trainer.step({{ids.narrow(0, 0, 1).contiguous(), ids.narrow(0, 0, 1).contiguous()},
                          {ids.narrow(0, 1, 1).contiguous(), ids.narrow(0, 1, 1).contiguous()}});
    for (const auto& [name, p] : model->parameters()) got[overlap][name] = p.to_f64_vector();
  }
  for (const auto& [name, v] : got[true]) EXPECT_EQ(v, got[false].at(name)) << name;
}

// On a GPU with NCCL (a group of one, bf16): ZeRO-1 and 2 with the parameters' all-gather deferred to
// the next forward on the side stream (each use waiting for its group's event), and the sparse
// embedding gradient, give the parameters of gathering after AdamW and of the dense gradient, bit for
// bit; the step's communication is timed by events.
TEST(Dist, OverlappedParameterGatherOnTheGpuOverNccl) {
  if (const std::string why = why_no_gpu_group(); !why.empty()) GTEST_SKIP() << "skipped: " << why;
  const models::ModelConfig cfg = models::ModelConfig::from_folder(fs::path(test::fixtures_dir()) / "llama");
  Generator gen(23);
  const Tensor ids = Tensor::randint({2, 11}, 0, 6, DType::i64, Device::cpu(), gen).to(Device::cuda(0));  // ids repeat
  const Tensor first = ids.narrow(0, 0, 1).contiguous(), second = ids.narrow(0, 1, 1).contiguous();
  train::AdamWOptions o;
  o.lr = 5e-3;
  for (int zero : {1, 2}) {
    auto run = [&](bool deferred, train::EmbeddingGradient grad, bool two_micro) {
      const auto comm = dist::nccl_communicator({}, dist::nccl_unique_id(), Device::cuda(0));
      auto model = models::CausalLM::random(cfg, DType::bf16, Device::cuda(0), 7, 0.5);
      train::DataParallelOptions dp;
      dp.zero_stage = zero, dp.bucket_mib = 0.01, dp.overlap_parameter_gather = deferred, dp.embedding_gradient = grad;
      train::DataParallel trainer(*model, *comm, o, dp);
      for (int step = 0; step < 3; ++step)
        (void)(two_micro ? trainer.step({{first, first}, {second, second}}) : trainer.step({{ids, ids}}));
      trainer.gather_parameters();
      const auto stats = trainer.comm_stats();
      EXPECT_EQ(stats.timed, 3);
      EXPECT_EQ(stats.sparse_embedding_steps, grad == train::EmbeddingGradient::Sparse ? 3 : 0);
      EXPECT_TRUE(stats.after_backward_ms >= 0 && stats.parameter_gather_ms >= 0);
      std::vector<std::vector<double>> got;
      for (const auto& [name, p] : model->parameters()) got.push_back(p.to_f64_vector());
      return got;
    };
    const auto want = run(false, train::EmbeddingGradient::Dense, true);
    EXPECT_EQ(run(true, train::EmbeddingGradient::Dense, true), want) << "ZeRO-" << zero << " deferred";
    // One rank, one micro-batch: its rows summed in f32 and rounded once, as its dense gradient is.
    const auto dense = run(false, train::EmbeddingGradient::Dense, false);
    EXPECT_EQ(run(false, train::EmbeddingGradient::Sparse, false), dense) << "ZeRO-" << zero << " sparse";
    EXPECT_EQ(run(true, train::EmbeddingGradient::Sparse, false), dense) << "ZeRO-" << zero << " deferred, sparse";
  }
}

// ZeRO-3 on the GPU over NCCL (a group of one, bf16): the gathers on the current stream (no
// overlap), on the side stream at each use, and prefetched during the use before (waited for by an
// event, while the reduce-scatters queued after them run on) give the parameters of ZeRO-2 bit for
// bit, with and without activation checkpointing.
TEST(Dist, ZeroThreePrefetchOnTheGpuOverNccl) {
  if (const std::string why = why_no_gpu_group(); !why.empty()) GTEST_SKIP() << "skipped: " << why;
  const models::ModelConfig cfg = models::ModelConfig::from_folder(fs::path(test::fixtures_dir()) / "llama");
  Generator gen(19);
  const Tensor ids = Tensor::randint({2, 11}, 0, cfg.vocab_size, DType::i64, Device::cpu(), gen).to(Device::cuda(0));
  const Tensor first = ids.narrow(0, 0, 1).contiguous(), second = ids.narrow(0, 1, 1).contiguous();
  train::AdamWOptions o;
  o.lr = 5e-3;
  for (bool checkpoint : {false, true}) {
    auto run = [&](int zero, bool overlap, bool prefetch) {
      const auto comm = dist::nccl_communicator({}, dist::nccl_unique_id(), Device::cuda(0));
      auto model = models::CausalLM::random(cfg, DType::bf16, Device::cuda(0), 7, 0.5);
      model->checkpoint_layers = checkpoint;
      train::DataParallelOptions dp;
      dp.zero_stage = zero, dp.bucket_mib = 0.01, dp.overlap = overlap, dp.prefetch = prefetch;
      train::DataParallel trainer(*model, *comm, o, dp);
      for (int step = 0; step < 3; ++step) (void)trainer.step({{first, first}, {second, second}});
      EXPECT_EQ(trainer.prefetch_stats().issued > 0, zero == 3 && overlap && prefetch);
      trainer.gather_parameters();
      std::vector<std::vector<double>> got;
      for (const auto& [name, p] : model->parameters()) got.push_back(p.to_f64_vector());
      return got;
    };
    const auto want = run(2, true, false);
    EXPECT_EQ(run(3, false, false), want) << "no overlap" << (checkpoint ? ", checkpointed" : "");
    EXPECT_EQ(run(3, true, false), want) << "no prefetch" << (checkpoint ? ", checkpointed" : "");
    EXPECT_EQ(run(3, true, true), want) << "prefetch" << (checkpoint ? ", checkpointed" : "");
  }
}

// The model of the data-parallel tests: the llama fixture with a hidden size of 31, so that its
// parameter count (and most buckets') is a multiple of neither 2 nor 3 and the shards end in padding.
models::ModelConfig odd_llama() {
  models::ModelConfig cfg = models::ModelConfig::from_folder(fs::path(test::fixtures_dir()) / "llama");
  cfg.hidden_size = 31;
  return cfg;
}

TEST(Dist, DataParallelEqualsOneProcessOnTheWholeBatch) {
  const models::ModelConfig cfg = odd_llama();
  const int64_t rows = 5, seq = 9;
  std::vector<Tensor> ids, labels;
  Generator gen(3);
  for (int step = 0; step < 3; ++step) {
    ids.push_back(Tensor::randint({rows, seq}, 0, cfg.vocab_size, DType::i64, Device::cpu(), gen));
    auto lv = ids.back().to_f64_vector();
    for (int64_t i = 0; i < seq; i += 3) lv[static_cast<size_t>(i)] = -100;  // row 0: some tokens ignored
    labels.push_back(Tensor::from_f64(lv, {rows, seq}, DType::i64));
  }
  train::AdamWOptions o;
  o.lr = 5e-3, o.weight_decay = 0.01, o.max_grad_norm = 0.5;  // clipping active: the norm must be the whole batch's
  auto single = models::CausalLM::random(cfg, DType::f32, Device::cpu(), 7, 0.5);
  int64_t numel = 0;
  for (const auto& [name, p] : single->parameters()) numel += p.numel();
  ASSERT_TRUE(numel % 2 != 0 && numel % 3 != 0) << numel << " parameters: the shards would need no padding";
  train::AdamW opt(single->parameters(), o);
  std::vector<std::map<std::string, std::vector<double>>> want(3);
  std::vector<double> want_loss(3), want_norm(3);
  for (int step = 0; step < 3; ++step) {
    const auto r = train::train_step(*single, opt, {{ids[static_cast<size_t>(step)], labels[static_cast<size_t>(step)]}});
    want_loss[static_cast<size_t>(step)] = r.loss, want_norm[static_cast<size_t>(step)] = r.grad_norm;
    for (const auto& [name, p] : single->parameters()) want[static_cast<size_t>(step)][name] = p.to_f64_vector();
  }
  const size_t whole_state = opt.state_bytes(), whole_grads = static_cast<size_t>(numel) * sizeof(float);
  for (int world : {1, 2, 3})
    for (int zero : {0, 1, 2})
      for (bool overlap : {true, false}) {
        const std::string cfg_name = fmt::format("world {} ZeRO-{}{}", world, zero, overlap ? "" : " no overlap");
        std::vector<std::map<std::string, std::vector<double>>> got(static_cast<size_t>(world));
        std::vector<size_t> state(static_cast<size_t>(world)), grads(state);
        on_ranks(world, [&](int r, dist::Communicator& c) {
          // Only rank 0 starts from the single-process model's weights: the trainer broadcasts them.
          auto model = models::CausalLM::random(cfg, DType::f32, Device::cpu(), r == 0 ? 7 : 100 + r, 0.5);
          train::DataParallelOptions dp;
          dp.zero_stage = zero, dp.overlap = overlap;
          dp.bucket_mib = 0.01;  // several buckets
          train::DataParallel trainer(*model, c, o, dp);
          state[static_cast<size_t>(r)] = trainer.optimizer_state_bytes();
          // Rows [lo, hi) of each step's batch: world 2 takes 1 + 4 rows, world 3 takes 2 + 2 + 1.
          const int64_t lo = world == 1 ? 0 : world == 2 ? (r == 0 ? 0 : 1) : r * 2;
          const int64_t hi = world == 1 ? rows : world == 2 ? (r == 0 ? 1 : rows) : std::min<int64_t>(rows, r * 2 + 2);
          for (int step = 0; step < 3; ++step) {
            const auto& i = ids[static_cast<size_t>(step)];
            const auto& l = labels[static_cast<size_t>(step)];
            const auto s = trainer.step({{i.narrow(0, lo, hi - lo).contiguous(), l.narrow(0, lo, hi - lo).contiguous()}});
            EXPECT_NEAR(s.loss, want_loss[static_cast<size_t>(step)], 1e-6 * want_loss[static_cast<size_t>(step)]) << cfg_name;
            EXPECT_NEAR(s.grad_norm, want_norm[static_cast<size_t>(step)], 1e-5 * want_norm[static_cast<size_t>(step)]) << cfg_name;
            EXPECT_EQ(s.tokens, models::CausalLM::labelled_tokens(l)) << cfg_name;
            if (step == 2)
              for (const auto& [name, p] : model->parameters()) got[static_cast<size_t>(r)][name] = p.to_f64_vector();
          }
          grads[static_cast<size_t>(r)] = trainer.gradient_bytes();
        });
        for (int r = 0; r < world; ++r)
          for (const auto& [name, v] : got[static_cast<size_t>(r)]) {
            EXPECT_TRUE(test::close_l2(Tensor::from_f64(v, {static_cast<int64_t>(v.size())}, DType::f64), want[2].at(name), 1e-5))
                << cfg_name << " rank " << r << " " << name;
            if (r > 0) {
              EXPECT_EQ(v, got[0].at(name)) << cfg_name << ": ranks 0 and " << r << " differ in " << name;
            }
          }
        // Stage 0: every rank keeps all the state.  Stages 1 and 2: each element's state on one rank
        // only, a world's share each (up to a bucket's padding).  The gradient buffers kept after the
        // step: the flat buckets at stage 1 (every parameter's, and the padding), a world's share of
        // them at stage 2.
        size_t sum = 0;
        for (int r = 0; r < world; ++r) {
          const size_t st = state[static_cast<size_t>(r)], g = grads[static_cast<size_t>(r)];
          sum += st;
          if (zero == 0) {
            EXPECT_EQ(st, whole_state) << cfg_name;
            EXPECT_EQ(g, 0u) << cfg_name;
            continue;
          }
          EXPECT_NEAR(static_cast<double>(st), static_cast<double>(whole_state) / world, 0.01 * static_cast<double>(whole_state))
              << cfg_name << " rank " << r;
          if (zero == 1) {
            EXPECT_GE(g, whole_grads) << cfg_name;
            EXPECT_LT(g, whole_grads + whole_grads / 100) << cfg_name;
          } else {
            EXPECT_EQ(g, grads[0]) << cfg_name << " rank " << r;  // the same shards on every rank
            EXPECT_NEAR(static_cast<double>(g), static_cast<double>(whole_grads) / world, 0.01 * static_cast<double>(whole_grads))
                << cfg_name << " rank " << r;
          }
        }
        if (zero > 0) {
          EXPECT_EQ(sum, whole_state) << cfg_name;
        }
      }
}

// Without clipping (whose norm is summed in another order) the sharded stages give stage 0's
// parameters bit for bit, in f32 and in bf16 (f32 master pieces, the sums rounded to bf16 as stage
// 0 rounds them), on 3 ranks with shards ending in padding; stage 2 keeps a third of stage 1's
// gradient buffers.  Stage 3 (parameters sharded too) as well.
TEST(Dist, ShardedStagesEqualStageZeroBitForBit) {
  const models::ModelConfig cfg = odd_llama();
  Generator gen(11);
  const Tensor ids = Tensor::randint({3, 10}, 0, cfg.vocab_size, DType::i64, Device::cpu(), gen);
  train::AdamWOptions o;
  o.lr = 1e-2, o.weight_decay = 0.1;
  for (DType dt : {DType::f32, DType::bf16}) {
    std::map<int, std::vector<std::vector<std::vector<double>>>> got;
    std::map<int, size_t> grad_bytes;
    for (int zero : {0, 1, 2, 3}) {
      got[zero].resize(3);
      on_ranks(3, [&](int r, dist::Communicator& c) {
        auto model = models::CausalLM::random(cfg, dt, Device::cpu(), 4, 0.5);
        train::DataParallelOptions dp;
        dp.zero_stage = zero, dp.bucket_mib = 0.02;
        train::DataParallel t(*model, c, o, dp);
        const Tensor mine = ids.narrow(0, r, 1).contiguous();
        for (int step = 0; step < 3; ++step) t.step({{mine, mine}});
        t.gather_parameters();
        for (const auto& [name, p] : model->parameters()) got[zero][static_cast<size_t>(r)].push_back(p.to_f64_vector());
        if (r == 0) grad_bytes[zero] = t.gradient_bytes();
      });
    }
    for (int zero : {1, 2, 3})
      for (size_t r = 0; r < 3; ++r) EXPECT_EQ(got[zero][r], got[0][r]) << dtype_name(dt) << " ZeRO-" << zero << " rank " << r;
    EXPECT_EQ(grad_bytes[1], 3 * grad_bytes[2]) << dtype_name(dt);
  }
}

// ZeRO-3: each rank keeps its shard of every parameter and gathers a layer's parameters just before
// the layer's forward and again before its backward.  Three steps of two micro-batches a rank on 2
// and 3 ranks give stage 0's parameters bit for bit (f32), with and without activation
// checkpointing (the recomputed forward gathers again) and overlap, for an untied model (llama), a
// tied one (qwen2: the head gathers the embedding), fused projections (phi3) and MoE layers
// (qwen3_moe; qwen2_moe: tied, with shared experts whose gate and up are views of one tensor;
// llama4_text: experts held as transposed views, NoPE and chunked layers).
// Between steps a rank holds its shards only (1 / world of the parameters, up to a padding element a
// bucket), during them at most one group more (a layer, the embedding, or the head with a tied
// embedding), or with prefetch two (and the next group's padding).
TEST(Dist, ZeroThreeEqualsStageZero) {
  train::AdamWOptions o;
  o.lr = 1e-2, o.weight_decay = 0.1;
  for (const char* family : {"llama", "qwen2", "phi3", "qwen3_moe", "qwen2_moe", "llama4_text"}) {
    const models::ModelConfig cfg = models::ModelConfig::from_folder(fs::path(test::fixtures_dir()) / family);
    Generator gen(12);
    const Tensor ids = Tensor::randint({6, 7}, 0, cfg.vocab_size, DType::i64, Device::cpu(), gen);
    // The bytes of each group's parameters, and of them all.
    size_t total = 0, largest = 0, largest_layer = 0, params = 0;
    {
      auto m = models::CausalLM::random(cfg, DType::f32, Device::cpu(), 4, 0.5);
      std::map<std::string, size_t> group;
      for (const auto& [name, p] : m->parameters()) {
        const std::string g = name.starts_with("model.layers.") ? name.substr(0, name.find('.', 13)) : name == "model.embed_tokens.weight" ? name : "head";
        group[g] += p.nbytes(), total += p.nbytes(), ++params;
        if (g == "head" && cfg.tie_word_embeddings) group[g] += m->parameters()[0].second.nbytes();
      }
      for (const auto& [g, bytes] : group) {
        largest = std::max(largest, bytes);
        if (g.starts_with("model.layers.")) largest_layer = std::max(largest_layer, bytes);
      }
    }
    for (int world : {2, 3}) {
      const int64_t share = 6 / world;
      auto run = [&](int zero, bool checkpoint, bool overlap, bool prefetch) {
        std::vector<std::vector<std::vector<double>>> got(static_cast<size_t>(world));
        on_ranks(world, [&](int r, dist::Communicator& c) {
          auto model = models::CausalLM::random(cfg, DType::f32, Device::cpu(), 4, 0.5);
          model->checkpoint_layers = checkpoint;
          train::DataParallelOptions dp;
          dp.zero_stage = zero, dp.bucket_mib = 0.01, dp.overlap = overlap, dp.prefetch = prefetch;
          train::DataParallel t(*model, c, o, dp);
          const Tensor mine = ids.narrow(0, r * share, share);
          const Tensor first = mine.narrow(0, 0, 1).contiguous(), rest = mine.narrow(0, 1, share - 1).contiguous();
          for (int step = 0; step < 3; ++step) {
            t.step({{first, first}, {rest, rest}});
            if (zero == 3) {
              const size_t shards = t.parameter_bytes();
              EXPECT_GE(shards * static_cast<size_t>(world), total) << family;
              EXPECT_LE(shards, total / static_cast<size_t>(world) + 4 * params) << family;
              EXPECT_GE(t.peak_parameter_bytes(), shards + largest_layer) << family;
              if (overlap && prefetch)  // a use and the next one's staged buckets (a bucket a parameter at most)
                EXPECT_LE(t.peak_parameter_bytes(), shards + 2 * largest + 4 * static_cast<size_t>(world) * params) << family;
              else
                EXPECT_LE(t.peak_parameter_bytes(), shards + largest) << family;
              EXPECT_EQ(t.prefetch_stats().issued > 0, overlap && prefetch) << family;
            }
          }
          const size_t shards = t.parameter_bytes();
          t.gather_parameters();
          if (zero == 3) {
            EXPECT_EQ(t.parameter_bytes(), shards + total) << family;
          }
          for (const auto& [name, p] : model->parameters()) got[static_cast<size_t>(r)].push_back(p.to_f64_vector());
        });
        return got;
      };
      const auto want = run(0, false, true, false);
      for (bool checkpoint : {false, true})
        for (int mode : {0, 1, 2})  // no overlap; overlap without prefetch; with it
          EXPECT_EQ(run(3, checkpoint, mode > 0, mode == 2), want)
              << family << " world " << world << (checkpoint ? " checkpointed" : "")
              << (mode == 0 ? " no overlap" : mode == 1 ? " no prefetch" : "");
    }
  }
}

// The elements of each ZeRO-3 group of `cfg`'s model (data_parallel.h: the embedding, each layer,
// then the final norm with an untied lm_head), in that order.
std::vector<int64_t> group_elements(const models::ModelConfig& cfg) {
  auto m = models::CausalLM::random(cfg, DType::f32, Device::cpu(), 4, 0.5);
  std::vector<int64_t> n(static_cast<size_t>(cfg.num_hidden_layers) + 2);
  for (const auto& [name, p] : m->parameters()) {
    size_t g = n.size() - 1;
    if (name == "model.embed_tokens.weight") g = 0;
    else if (name.starts_with("model.layers.")) g = 1 + std::stoul(name.substr(13));
    n[g] += p.numel();
  }
  return n;
}

// A step's uses of groups in CausalLM's order (two micro-batches): the embedding, the layers, the
// head (with a tied head also the embedding), the layers backwards.
std::vector<std::vector<size_t>> step_uses(size_t layers, bool tied, int micro) {
  std::vector<std::vector<size_t>> uses;
  const size_t head = layers + 1;
  for (int m = 0; m < micro; ++m) {
    uses.push_back({0});
    for (size_t l = 0; l < layers; ++l) uses.push_back({1 + l});
    uses.push_back(tied ? std::vector<size_t>{head, 0} : std::vector<size_t>{head});
    for (size_t l = layers; l-- > 0;) uses.push_back({1 + l});
  }
  return uses;
}

// What a data-parallel run gives on one rank: each step's loss and gradient norm, the parameters
// after the last (gathered).
struct RankRun {
  std::vector<double> losses, norms;
  std::vector<std::vector<double>> params;
};

// Two runs' losses or gradient norms, equal up to the order of their f64 sums: the ranks are threads
// sharing the ops' CPU pool, whose split of a reduction depends on what else runs (measured: the last
// bits of a norm on a 64-core machine; the parameters stay equal bit for bit).
void expect_same_sums(const std::vector<double>& a, const std::vector<double>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-12 * std::abs(b[i])) << what << " step " << i;
}

// ZeRO-3's prefetch (data_parallel.h: the next use's gathers issued when a use begins) changes only
// when a gather runs.  Three steps of two micro-batches a rank on 2 and 3 ranks give the losses and
// parameters of ZeRO-2 and of ZeRO-3 without prefetch bit for bit, the losses (and the latter's gradient
// norms, of the same buckets) up to the order of their sums, with activation checkpointing and without, for an untied model (llama) and a
// tied one (qwen2: the head's use gathers the embedding too), with groups of several buckets and of
// one.  Every use but a step's last prefetches the next, and each prefetch is taken; nothing staged
// is left between steps.  With a bucket a group the peak parameter bytes are data_parallel.h's: the
// shards plus the largest use without prefetch, and with it at most (for the untied model exactly)
// the shards plus max(bytes(a), bytes(b)) + staged(b) over consecutive uses a, b.
TEST(Dist, ZeroThreePrefetchChangesNothing) {
  train::AdamWOptions o;
  o.lr = 1e-2, o.weight_decay = 0.1;
  for (const char* family : {"llama", "qwen2"}) {
    const models::ModelConfig cfg = models::ModelConfig::from_folder(fs::path(test::fixtures_dir()) / family);
    const bool tied = cfg.tie_word_embeddings;
    ASSERT_EQ(tied, std::string(family) == "qwen2");
    Generator gen(21);
    const Tensor ids = Tensor::randint({6, 7}, 0, cfg.vocab_size, DType::i64, Device::cpu(), gen);
    const std::vector<int64_t> elements = group_elements(cfg);
    const auto uses = step_uses(elements.size() - 2, tied, 2);
    for (int world : {2, 3}) {
      const int64_t share = 6 / world, w = world;
      // A bucket a group (f32): a rank's shards, a use's parameter bytes and its staged bytes.
      size_t shards = 0, largest = 0, bound = 0;
      for (int64_t n : elements) shards += 4 * static_cast<size_t>((n + w - 1) / w);
      auto bytes = [&](const std::vector<size_t>& u) {
        size_t b = 0;
        for (size_t g : u) b += 4 * static_cast<size_t>(elements[g]);
        return b;
      };
      auto staged = [&](const std::vector<size_t>& u) {
        size_t b = 0;
        for (size_t g : u) b += 4 * static_cast<size_t>(w * ((elements[g] + w - 1) / w));
        return b;
      };
      for (const auto& u : uses) largest = std::max(largest, bytes(u));
      for (size_t i = 0; i + 1 < uses.size(); ++i)
        bound = std::max(bound, std::max(bytes(uses[i]), bytes(uses[i + 1])) + staged(uses[i + 1]));
      ASSERT_GT(bound, largest);
      auto run = [&](int zero, bool checkpoint, bool prefetch, double bucket_mib) {
        const std::string what = fmt::format("{} world {} ZeRO-{}{}{} buckets of {} MiB", family, world, zero,
                                             checkpoint ? " checkpointed" : "", prefetch ? " prefetch" : "", bucket_mib);
        std::vector<RankRun> got(static_cast<size_t>(world));
        on_ranks(world, [&](int r, dist::Communicator& c) {
          auto model = models::CausalLM::random(cfg, DType::f32, Device::cpu(), 4, 0.5);
          model->checkpoint_layers = checkpoint;
          train::DataParallelOptions dp;
          dp.zero_stage = zero, dp.bucket_mib = bucket_mib, dp.prefetch = prefetch;
          train::DataParallel t(*model, c, o, dp);
          const size_t before = t.parameter_bytes();
          const Tensor mine = ids.narrow(0, r * share, share);
          const Tensor first = mine.narrow(0, 0, 1).contiguous(), rest = mine.narrow(0, 1, share - 1).contiguous();
          RankRun& out = got[static_cast<size_t>(r)];
          for (int step = 0; step < 3; ++step) {
            const train::StepResult s = t.step({{first, first}, {rest, rest}});
            out.losses.push_back(s.loss), out.norms.push_back(s.grad_norm);
            EXPECT_EQ(t.parameter_bytes(), before) << what << " step " << step;
          }
          if (zero == 3) {
            const train::DataParallel::PrefetchStats st = t.prefetch_stats();
            EXPECT_EQ(st.issued, prefetch ? 3 * (static_cast<int64_t>(uses.size()) - 1) : 0) << what;
            EXPECT_EQ(st.used, st.issued) << what;
            EXPECT_EQ(st.deviations, 0) << what;
            if (bucket_mib > 100) {
              EXPECT_EQ(before, shards) << what;
              if (!prefetch) {
                EXPECT_EQ(t.peak_parameter_bytes(), shards + largest) << what;
              } else {
                if (tied) EXPECT_LE(t.peak_parameter_bytes(), shards + bound) << what;
                else EXPECT_EQ(t.peak_parameter_bytes(), shards + bound) << what;
                EXPECT_GT(t.peak_parameter_bytes(), shards + largest) << what;
              }
            }
          }
          t.gather_parameters();
          for (const auto& [name, p] : model->parameters()) out.params.push_back(p.to_f64_vector());
        });
        return got;
      };
      for (bool checkpoint : {false, true}) {
        const auto zero2 = run(2, checkpoint, false, 0.01);
        for (double mib : {0.01, 1000.0}) {
          const auto plain = run(3, checkpoint, false, mib), ahead = run(3, checkpoint, true, mib);
          for (size_t r = 0; r < static_cast<size_t>(world); ++r) {
            const std::string what = fmt::format("{} world {}{} buckets of {} MiB, rank {}", family, world,
                                                 checkpoint ? " checkpointed" : "", mib, r);
            expect_same_sums(ahead[r].losses, plain[r].losses, what);
            expect_same_sums(ahead[r].norms, plain[r].norms, what);
            EXPECT_EQ(ahead[r].params, plain[r].params) << what;
            expect_same_sums(ahead[r].losses, zero2[r].losses, what);
            EXPECT_EQ(ahead[r].params, zero2[r].params) << what;
          }
        }
      }
    }
  }
}

// A step whose uses deviate from the order the prefetch expects (a hook around the trainer's adds a
// use before layer 1's forward and backward: in the first step layer 1 itself, the prefetched group,
// so that the real use finds the one after it staged; in the second the head) drops what is staged
// and gathers the rest of the step at each use.  The values are those without prefetch (the same
// hook), nothing staged is left after a step, and the next step prefetches again.  A step with every
// group gathered already (gather_parameters()) gathers none ahead.  Two micro-batches, checkpointed.
TEST(Dist, ZeroThreePrefetchFallsBackWhenTheOrderDeviates) {
  train::AdamWOptions o;
  o.lr = 1e-2, o.weight_decay = 0.1;
  using Group = models::CausalLM::ParameterGroup;
  for (const char* family : {"llama", "qwen2"}) {
    const models::ModelConfig cfg = models::ModelConfig::from_folder(fs::path(test::fixtures_dir()) / family);
    Generator gen(22);
    const Tensor ids = Tensor::randint({4, 6}, 0, cfg.vocab_size, DType::i64, Device::cpu(), gen);
    const int64_t each = static_cast<int64_t>(step_uses(static_cast<size_t>(cfg.num_hidden_layers), cfg.tie_word_embeddings, 2).size()) - 1;
    auto run = [&](bool prefetch) {
      std::vector<RankRun> got(2);
      on_ranks(2, [&](int r, dist::Communicator& c) {
        auto model = models::CausalLM::random(cfg, DType::f32, Device::cpu(), 4, 0.5);
        model->checkpoint_layers = true;
        train::DataParallelOptions dp;
        dp.zero_stage = 3, dp.bucket_mib = 0.01, dp.prefetch = prefetch;
        train::DataParallel t(*model, c, o, dp);
        const size_t shards = t.parameter_bytes();
        int step = 0;
        const auto inner = model->parameter_use;
        model->parameter_use = [&step, inner](const Group& g, bool in_use) {
          if (in_use && g.kind == Group::Kind::Layer && g.layer == 1 && step < 2) {
            const Group extra = step == 0 ? g : Group{Group::Kind::Head, 0};
            inner(extra, true);
            inner(extra, false);
          }
          inner(g, in_use);
        };
        const Tensor first = ids.narrow(0, 2 * r, 1).contiguous(), second = ids.narrow(0, 2 * r + 1, 1).contiguous();
        RankRun& out = got[static_cast<size_t>(r)];
        // Per step: uses gathered ahead, prefetches taken, deviations.
        const std::vector<std::array<int64_t, 3>> want = {{3, 2, 1}, {2, 1, 1}, {each, each, 0}, {0, 0, 0}};
        for (step = 0; step < 4; ++step) {
          if (step == 3) t.gather_parameters();
          const train::DataParallel::PrefetchStats before = t.prefetch_stats();
          const train::StepResult s = t.step({{first, first}, {second, second}});
          if (step == 3) t.release_parameters();
          out.losses.push_back(s.loss), out.norms.push_back(s.grad_norm);
          EXPECT_EQ(t.parameter_bytes(), shards) << family << " step " << step;
          const train::DataParallel::PrefetchStats st = t.prefetch_stats();
          const std::array<int64_t, 3> did = {st.issued - before.issued, st.used - before.used, st.deviations - before.deviations};
          const std::array<int64_t, 3> expected = prefetch ? want[static_cast<size_t>(step)] : std::array<int64_t, 3>{};
          EXPECT_EQ(did, expected)
              << family << " step " << step;
        }
        t.gather_parameters();
        for (const auto& [name, p] : model->parameters()) out.params.push_back(p.to_f64_vector());
      });
      return got;
    };
    const auto plain = run(false), ahead = run(true);
    for (size_t r = 0; r < 2; ++r) {
      expect_same_sums(ahead[r].losses, plain[r].losses, fmt::format("{} rank {}", family, r));
      expect_same_sums(ahead[r].norms, plain[r].norms, fmt::format("{} rank {}", family, r));
      EXPECT_EQ(ahead[r].params, plain[r].params) << family << " rank " << r;
    }
  }
}

// A released parameter is an error naming ZeRO-3 (never a crash: reading it, saving the model), as
// is generating from a model training at stage 3, and ranks with different numbers of
// micro-batches; a loss outside the step gathers through the hook; gather_parameters() makes every
// parameter whole until release_parameters(), and save_model() gathers for rank 0's save.
TEST(Dist, ZeroThreeReleasedParametersAreNamed) {
  {  // a storage released under its views, and restored
    const Tensor t = Tensor::zeros({4}, DType::f32);
    const Tensor v = t.narrow(0, 1, 2);
    t.storage()->evict();
    EXPECT_ERROR((void)v.data(), "released by ZeRO-3");
    EXPECT_ERROR(v.to_f64_vector(), "released by ZeRO-3");
    DLTensor dl;
    EXPECT_ERROR(t.fill_dl_tensor(&dl), "released by ZeRO-3");
    EXPECT_ERROR(t.to_dlpack(), "released by ZeRO-3");
    t.storage()->restore();
    v.fill_(2);
    EXPECT_EQ(t.to_f64_vector()[1], 2.0);
  }
  const models::ModelConfig cfg = models::ModelConfig::from_folder(fs::path(test::fixtures_dir()) / "llama");
  train::AdamWOptions o;
  o.lr = 1e-2;
  Generator gen(3);
  const Tensor ids = Tensor::randint({3, 6}, 0, cfg.vocab_size, DType::i64, Device::cpu(), gen);
  on_ranks(2, [&](int r, dist::Communicator& c) {
    auto model = models::CausalLM::random(cfg, DType::f32, Device::cpu(), 4, 0.5);
    train::DataParallelOptions dp;
    dp.zero_stage = 3;
    train::DataParallel t(*model, c, o, dp);
    const Tensor embed = model->parameters()[0].second;
    EXPECT_ERROR(embed.to_f64_vector(), "released by ZeRO-3");
    EXPECT_ERROR(model->generate({1, 2}, 2), "not supported while parameter_use is set");
    EXPECT_ERROR(train::DataParallel(*model, c, o, dp), "parameter_use is set already");
    const Tensor row = ids.narrow(0, r, 1).contiguous();
    if (r == 0) EXPECT_ERROR(t.step({{row, row}, {row, row}}), "same number of micro-batches");
    else EXPECT_ERROR(t.step({{row, row}}), "same number of micro-batches");
    t.step({{row, row}});
    const size_t shards = t.parameter_bytes();
    // Saving needs the parameters whole: named when they are not; save_model gathers them.
    const fs::path dir = fs::temp_directory_path() / fmt::format("kcpp-zero3-save-{}-{}", ::getpid(), r);
    EXPECT_ERROR(model->save(dir), "released by ZeRO-3");
    // A forward outside the trainer's step (evaluation) gathers each group through the hook, as the
    // step does, and gives the loss of the whole parameters.
    const double hooked = model->loss(row, row).item();
    EXPECT_EQ(t.parameter_bytes(), shards);
    t.gather_parameters();
    EXPECT_EQ(model->loss(row, row).item(), hooked);
    t.release_parameters();
    t.save_model(dir);
    EXPECT_EQ(t.parameter_bytes(), shards);
    if (r == 0) {
      auto saved = models::CausalLM::from_folder(dir, DType::f32, Device::cpu());
      EXPECT_EQ(saved->loss(row, row).item(), hooked);
    }
    fs::remove_all(dir);
    t.gather_parameters();
    EXPECT_EQ(embed.to_f64_vector().size(), static_cast<size_t>(embed.numel()));
    EXPECT_GT(t.parameter_bytes(), shards);
    t.release_parameters();
    EXPECT_EQ(t.parameter_bytes(), shards);
    EXPECT_ERROR(embed.to_f64_vector(), "released by ZeRO-3");
  });
}

// 16-bit weights: AdamW keeps f32 master copies, taken after the replicas start as rank 0's, so the
// ranks (started from different weights here) hold the same bf16 parameters after every step.
TEST(Dist, Bf16ReplicasStayTheSame) {
  const models::ModelConfig cfg = models::ModelConfig::from_folder(fs::path(test::fixtures_dir()) / "llama");
  Generator gen(8);
  const Tensor ids = Tensor::randint({2, 8}, 0, cfg.vocab_size, DType::i64, Device::cpu(), gen);
  train::AdamWOptions o;
  o.lr = 1e-2;
  for (int zero : {0, 1, 2, 3}) {
    std::vector<std::vector<double>> params(2);
    on_ranks(2, [&](int r, dist::Communicator& c) {
      auto model = models::CausalLM::random(cfg, DType::bf16, Device::cpu(), 20 + r, 0.5);
      train::DataParallelOptions dp;
      dp.zero_stage = zero;
      train::DataParallel t(*model, c, o, dp);
      for (int step = 0; step < 3; ++step) {
        const Tensor mine = ids.narrow(0, r, 1).contiguous();
        t.step({{mine, mine}});
      }
      t.gather_parameters();
      for (const auto& [name, p] : model->parameters()) {
        const auto v = p.to_f64_vector();
        params[static_cast<size_t>(r)].insert(params[static_cast<size_t>(r)].end(), v.begin(), v.end());
      }
    });
    EXPECT_EQ(params[0], params[1]) << "ZeRO-" << zero << ": the bf16 replicas differ";
  }
}

// The dtype of the sums across ranks: unset, bf16 for a bf16 model (half stage 1's flat buffers of
// f32 sums, up to padding) and f32 for an f32 one, a bf16 Mamba model's f32 parameters' in f32; given, the one given.  Summed in bf16 the step's gradient norm
// stays within bf16's rounding of the f32 sums' on 3 ranks.
TEST(Dist, ReduceDtypeFollowsTheParameters) {
  const models::ModelConfig cfg = odd_llama();
  Generator gen(12);
  const Tensor ids = Tensor::randint({3, 8}, 0, cfg.vocab_size, DType::i64, Device::cpu(), gen);
  train::AdamWOptions o;
  o.lr = 1e-2;
  struct Got {
    DType reduce;
    size_t grad_bytes;
    std::vector<double> norms;
  };
  auto run = [&](DType weights, std::optional<DType> reduce) {
    std::vector<Got> got(3);
    on_ranks(3, [&](int r, dist::Communicator& c) {
      auto model = models::CausalLM::random(cfg, weights, Device::cpu(), 4, 0.5);
      train::DataParallelOptions dp;
      dp.zero_stage = 1, dp.bucket_mib = 0.02, dp.reduce_dtype = reduce;
      train::DataParallel t(*model, c, o, dp);
      Got& g = got[static_cast<size_t>(r)];
      g.reduce = t.reduce_dtype(weights), g.grad_bytes = t.gradient_bytes();
      const Tensor mine = ids.narrow(0, r, 1).contiguous();
      for (int step = 0; step < 2; ++step) g.norms.push_back(t.step({{mine, mine}}).grad_norm);
    });
    return got[0];
  };
  const Got bf16 = run(DType::bf16, std::nullopt), f32_sums = run(DType::bf16, DType::f32), f32 = run(DType::f32, std::nullopt);
  EXPECT_EQ(bf16.reduce, DType::bf16);
  EXPECT_EQ(f32_sums.reduce, DType::f32);
  EXPECT_EQ(f32.reduce, DType::f32);
  // (Buckets of about bucket_mib of sums: their boundaries, and so their padding, follow the dtype.)
  EXPECT_NEAR(2.0 * static_cast<double>(bf16.grad_bytes), static_cast<double>(f32_sums.grad_bytes), 0.01 * f32_sums.grad_bytes);
  EXPECT_EQ(f32.grad_bytes, f32_sums.grad_bytes);
  for (size_t s = 0; s < 2; ++s) {
    EXPECT_GT(f32_sums.norms[s], 0.0);
    EXPECT_NEAR(bf16.norms[s], f32_sums.norms[s], 1e-2 * f32_sums.norms[s]) << "step " << s;
  }
  EXPECT_ERROR(run(DType::bf16, DType::i32), "reduce_dtype i32 is not a floating dtype");

  // A bf16 Mamba model keeps A_log, D and dt_proj's bias in f32: those sums in f32, the rest in bf16,
  // at stage 0 (its buckets cut where the dtype of the sums changes) and at stage 1 (buckets of one
  // parameter dtype).
  const fs::path dir = fs::path(test::fixtures_dir()) / "mamba";
  const Tensor mamba_ids = Tensor::randint({3, 8}, 0, models::MambaConfig::from_folder(dir).vocab_size, DType::i64, Device::cpu(), gen);
  auto mamba = [&](int zero, std::optional<DType> reduce, int world = 3) {
    std::vector<Got> got(3);
    std::vector<std::vector<double>> params(3);
    on_ranks(world, [&](int r, dist::Communicator& c) {
      auto model = models::MambaLM::from_folder(dir, DType::bf16, Device::cpu());
      train::DataParallelOptions dp;
      dp.zero_stage = zero, dp.bucket_mib = 0.005, dp.reduce_dtype = reduce;
      train::DataParallel t(*model, c, o, dp);
      Got& g = got[static_cast<size_t>(r)];
      EXPECT_EQ(t.reduce_dtype(DType::f32), reduce.value_or(DType::f32));
      g.reduce = t.reduce_dtype(DType::bf16), g.grad_bytes = t.gradient_bytes();
      const Tensor mine = mamba_ids.narrow(0, r, 1).contiguous();
      for (int step = 0; step < 2; ++step) g.norms.push_back(t.step({{mine, mine}}).grad_norm);
      t.gather_parameters();
      for (const auto& [name, p] : model->parameters()) {
        const auto v = p.to_f64_vector();
        params[static_cast<size_t>(r)].insert(params[static_cast<size_t>(r)].end(), v.begin(), v.end());
      }
    });
    for (int r = 1; r < world; ++r) EXPECT_EQ(params[static_cast<size_t>(r)], params[0]) << "ZeRO-" << zero;
    return std::make_pair(got[0], params[0]);
  };
  for (int zero : {0, 1}) {
    // One rank: a sum of one changes nothing, so the f32 parameters' gradients reach AdamW unrounded
    // only if they travel in f32: the same parameters as with f32 sums throughout, bit for bit.
    EXPECT_EQ(mamba(zero, std::nullopt, 1).second, mamba(zero, DType::f32, 1).second) << "Mamba ZeRO-" << zero;
    const Got mixed = mamba(zero, std::nullopt).first, all_f32 = mamba(zero, DType::f32).first;
    EXPECT_EQ(mixed.reduce, DType::bf16);
    EXPECT_EQ(all_f32.reduce, DType::f32);
    if (zero == 1) {  // most of the parameters are bf16: a little over half the f32 sums' buffers
      EXPECT_GT(static_cast<double>(mixed.grad_bytes), 0.5 * static_cast<double>(all_f32.grad_bytes));
      EXPECT_LT(static_cast<double>(mixed.grad_bytes), 0.6 * static_cast<double>(all_f32.grad_bytes));
    }
    for (size_t s = 0; s < 2; ++s) {
      EXPECT_GT(all_f32.norms[s], 0.0);
      EXPECT_NEAR(mixed.norms[s], all_f32.norms[s], 1e-2 * all_f32.norms[s]) << "Mamba ZeRO-" << zero << " step " << s;
    }
  }
}

// A Mamba-family model hands each gradient over once, as the backward makes it whole: an untied
// head's and the final norm's first, the layers from the last down, the embedding last; it uses its
// parameter groups in parameter_use.h's order; and it trains data-parallel at every stage: on 2 and 3
// ranks, shares of unequal rows and one row with no labelled token, three steps with the buckets
// summed during the backward and after it, the all-gather of stages 1 and 2 deferred into the next
// forward, stage 3's groups gathered at their use (with the next use prefetched, with activation
// checkpointing) give the single process's parameters on the whole batch (clipping active: the norm
// is the whole gradient's), every rank the same bit for bit; a sparse embedding gradient is refused
// by name.
TEST(Dist, MambaDataParallelEqualsOneProcessOnTheWholeBatch) {
  // Both fixtures have an untied head; Mamba's default ties it to the embedding: a tied copy of the
  // mamba fixture (its config's tie_word_embeddings on, its weights without lm_head.weight) too.
  std::string tmpl = (fs::temp_directory_path() / "kcpp-dp-mamba-tied-XXXXXX").string();
  const fs::path tied = ::mkdtemp(tmpl.data());
  {
    const fs::path src = fs::path(test::fixtures_dir()) / "mamba";
    nlohmann::json config = nlohmann::json::parse(read_whole_file(src / "config.json", "the fixture's config"));
    config["tie_word_embeddings"] = true;
    std::ofstream(tied / "config.json") << config.dump(2);
    std::vector<std::pair<std::string, Tensor>> weights = models::MambaLM::from_folder(src, DType::f32, Device::cpu())->parameters();
    std::erase_if(weights, [](const auto& w) { return w.first == "lm_head.weight"; });
    models::save_safetensors(tied / "model.safetensors", weights);
  }
  for (const fs::path& dir : {fs::path(test::fixtures_dir()) / "mamba", fs::path(test::fixtures_dir()) / "falcon_mamba", tied}) {
    const models::MambaConfig cfg = models::MambaConfig::from_folder(dir);
    const std::string family = dir == tied ? "mamba, tied head" : cfg.model_type;
    ASSERT_EQ(cfg.tie_word_embeddings, dir == tied) << family;
    {
      auto model = models::MambaLM::from_folder(dir, DType::f32, Device::cpu());
      Generator g0(3);
      const Tensor ids = Tensor::randint({2, 6}, 0, cfg.vocab_size, DType::i64, Device::cpu(), g0);
      std::vector<std::string> order;
      std::map<std::string, const void*> handed;
      const auto r = model->loss_and_gradients(ids, ids, 1.0, ops::Reduction::Mean, [&](const std::string& n, const Tensor& g) {
        order.push_back(n);
        handed[n] = g.data();
      });
      ASSERT_EQ(order.size(), r.grads.size()) << family << ": each gradient handed over once";
      ASSERT_EQ(order.size(), model->parameters().size()) << family;
      for (const auto& [n, g] : r.grads) EXPECT_EQ(handed.at(n), g.data()) << n << ": not the tensor the result holds";
      const size_t first_layer = cfg.tie_word_embeddings ? 1 : 2;
      EXPECT_EQ(order[first_layer - 1], "backbone.norm_f.weight") << family;
      EXPECT_TRUE(order[first_layer].starts_with(fmt::format("backbone.layers.{}.", cfg.num_hidden_layers - 1))) << order[first_layer];
      EXPECT_TRUE(order[order.size() - 2].starts_with("backbone.layers.0.")) << order[order.size() - 2];
      EXPECT_EQ(order.back(), "backbone.embeddings.weight") << family;
      // The groups' uses: the embedding, the layers up, the head (held through the loss and its
      // backward), the layers down; each released before the next is taken.
      std::vector<std::string> uses;
      int held = 0;
      model->parameter_use = [&](const models::ParameterGroup& g, bool in_use) {
        held += in_use ? 1 : -1;
        ASSERT_TRUE(held == 0 || held == 1) << family << ": two groups in use at once";
        if (in_use) uses.push_back(g.kind == models::ParameterGroup::Kind::Embedding ? "E"
                                   : g.kind == models::ParameterGroup::Kind::Head ? "H" : std::to_string(g.layer));
      };
      for (bool ckpt : {false, true}) {
        uses.clear();
        model->checkpoint_layers = ckpt;
        model->loss_and_gradients(ids, ids);
        std::vector<std::string> want{"E"};
        for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) want.push_back(std::to_string(l));
        want.push_back("H");
        for (int64_t l = cfg.num_hidden_layers; l-- > 0;) want.push_back(std::to_string(l));
        EXPECT_EQ(uses, want) << family << (ckpt ? " with checkpointing" : "");
        EXPECT_EQ(held, 0) << family;
      }
      model->checkpoint_layers = false;
      std::string err;
      try {
        models::MambaLM::Cache cache;
        model->forward(ids, &cache);
      } catch (const Error& e) {
        err = e.what();
      }
      EXPECT_NE(err.find("not supported while parameter_use is set"), std::string::npos) << family << ": " << err;
      model->parameter_use = {};
    }
    const int64_t rows = 5, seq = 7;
    std::vector<Tensor> ids, labels;
    Generator gen(31);
    for (int step = 0; step < 3; ++step) {
      ids.push_back(Tensor::randint({rows, seq}, 0, cfg.vocab_size, DType::i64, Device::cpu(), gen));
      auto lv = ids.back().to_f64_vector();
      for (int64_t i = 0; i < seq; ++i) lv[static_cast<size_t>(i)] = -100;  // row 0: no labelled token
      labels.push_back(Tensor::from_f64(lv, {rows, seq}, DType::i64));
    }
    train::AdamWOptions o;
    o.lr = 5e-3, o.weight_decay = 0.01, o.max_grad_norm = 0.5;
    auto single = models::MambaLM::from_folder(dir, DType::f32, Device::cpu());
    train::AdamW opt(single->parameters(), o);
    std::vector<double> want_loss;
    for (int step = 0; step < 3; ++step)
      want_loss.push_back(train::train_step(*single, opt, {{ids[static_cast<size_t>(step)], labels[static_cast<size_t>(step)]}}).loss);
    std::map<std::string, std::vector<double>> want;
    for (const auto& [name, p] : single->parameters()) want[name] = p.to_f64_vector();
    struct Run {
      int zero;
      bool overlap, deferred_gather, prefetch, checkpoint;
    };
    std::vector<Run> runs;
    for (int zero : {0, 1, 2, 3})
      for (bool overlap : {true, false}) runs.push_back({zero, overlap, false, false, false});
    runs.push_back({1, true, true, false, false});
    runs.push_back({2, true, true, false, false});
    runs.push_back({3, true, false, true, false});
    runs.push_back({3, true, false, true, true});
    runs.push_back({3, false, false, false, true});
    for (int world : {2, 3})
      for (const Run& run : runs) {
        const std::string what = fmt::format("{} world {} ZeRO-{}{}{}{}{}", family, world, run.zero, run.overlap ? "" : " no overlap",
                                             run.deferred_gather ? " deferred gather" : "", run.prefetch ? " prefetch" : "",
                                             run.checkpoint ? " checkpointing" : "");
        std::vector<std::map<std::string, std::vector<double>>> got(static_cast<size_t>(world));
        on_ranks(world, [&](int r, dist::Communicator& c) {
          auto model = models::MambaLM::from_folder(dir, DType::f32, Device::cpu());
          model->checkpoint_layers = run.checkpoint;
          train::DataParallelOptions dp;
          dp.zero_stage = run.zero, dp.bucket_mib = 0.005, dp.overlap = run.overlap;  // several buckets
          dp.overlap_parameter_gather = run.deferred_gather, dp.prefetch = run.prefetch;
          train::DataParallel trainer(*model, c, o, dp);
          // Rank 0 takes row 0 alone (no labelled token) on 2 ranks; rows 0-1, 2-3, 4 on 3.
          const int64_t lo = world == 2 ? (r == 0 ? 0 : 1) : r * 2;
          const int64_t hi = world == 2 ? (r == 0 ? 1 : rows) : std::min<int64_t>(rows, r * 2 + 2);
          for (int step = 0; step < 3; ++step) {
            const auto& i = ids[static_cast<size_t>(step)];
            const auto& l = labels[static_cast<size_t>(step)];
            const auto s = trainer.step({{i.narrow(0, lo, hi - lo).contiguous(), l.narrow(0, lo, hi - lo).contiguous()}});
            EXPECT_NEAR(s.loss, want_loss[static_cast<size_t>(step)], 1e-6 * want_loss[static_cast<size_t>(step)]) << what;
          }
          if (run.prefetch) {  // every use prefetched as planned: the model's order is the plan's
            const train::DataParallel::PrefetchStats st = trainer.prefetch_stats();
            EXPECT_GT(st.issued, 0) << what;
            EXPECT_EQ(st.used, st.issued) << what;
            EXPECT_EQ(st.deviations, 0) << what;
          }
          trainer.gather_parameters();
          for (const auto& [name, p] : model->parameters()) got[static_cast<size_t>(r)][name] = p.to_f64_vector();
        });
        for (int r = 0; r < world; ++r)
          for (const auto& [name, v] : got[static_cast<size_t>(r)]) {
            EXPECT_TRUE(test::close_l2(Tensor::from_f64(v, {static_cast<int64_t>(v.size())}, DType::f64),
                                       want.at(name), 1e-5))
                << what << " rank " << r << " " << name;
            if (r > 0) {
              EXPECT_EQ(v, got[0].at(name)) << what << ": ranks 0 and " << r << " differ in " << name;
            }
          }
      }
    auto refused = [&](int zero, bool deferred, train::EmbeddingGradient grad) {
      std::string err;
      on_ranks(1, [&](int, dist::Communicator& c) {
        auto model = models::MambaLM::from_folder(dir, DType::f32, Device::cpu());
        train::DataParallelOptions dp;
        dp.zero_stage = zero, dp.overlap_parameter_gather = deferred, dp.embedding_gradient = grad;
        try {
          train::DataParallel trainer(*model, c, o, dp);
        } catch (const Error& e) {
          err = e.what();
        }
      });
      return err;
    };
    EXPECT_NE(refused(1, false, train::EmbeddingGradient::Sparse).find("summed dense"), std::string::npos) << family;
  }
  fs::remove_all(tied);
}

// A Mamba model's data-parallel checkpoint resumes on another world size and stage: two steps on 2
// ranks at ZeRO-2, the model and the optimizer saved, two more on 3 ranks at ZeRO-1 give the single
// process's four steps on the whole batch.
TEST(Dist, MambaCheckpointsResumeOnAnyWorldSize) {
  const fs::path dir = fs::path(test::fixtures_dir()) / "falcon_mamba";
  const int64_t vocab = models::MambaConfig::from_folder(dir).vocab_size;
  Generator gen(17);
  std::vector<Tensor> ids;
  for (int step = 0; step < 4; ++step) ids.push_back(Tensor::randint({6, 5}, 0, vocab, DType::i64, Device::cpu(), gen));
  train::AdamWOptions o;
  o.lr = 5e-3, o.weight_decay = 0.01, o.max_grad_norm = 0.5;
  auto straight = models::MambaLM::from_folder(dir, DType::f32, Device::cpu());
  {
    train::AdamW opt(straight->parameters(), o);
    for (const Tensor& i : ids) train::train_step(*straight, opt, {{i, i}});
  }
  std::string tmpl = (fs::temp_directory_path() / "kcpp-dp-mamba-ckpt-XXXXXX").string();
  const fs::path ckpt = ::mkdtemp(tmpl.data());
  auto run = [&](int world, int zero, int from, int to, bool load, bool save) {
    std::vector<std::vector<double>> got;
    on_ranks(world, [&](int r, dist::Communicator& c) {
      auto model = models::MambaLM::from_folder(load ? ckpt : dir, DType::f32, Device::cpu());
      train::DataParallelOptions dp;
      dp.zero_stage = zero;
      train::DataParallel t(*model, c, o, dp);
      if (load) t.load_optimizer(ckpt);
      EXPECT_EQ(t.optimizer().steps(), from);
      const int64_t share = 6 / world;
      for (int step = from; step < to; ++step) {
        const Tensor mine = ids[static_cast<size_t>(step)].narrow(0, r * share, share).contiguous();
        t.step({{mine, mine}});
      }
      if (save) {
        t.save_model(ckpt);
        t.save_optimizer(ckpt);
      }
      t.gather_parameters();
      if (r == 0)
        for (const auto& [name, p] : model->parameters()) got.push_back(p.to_f64_vector());
    });
    return got;
  };
  (void)run(2, 2, 0, 2, false, true);
  const auto resumed = run(3, 1, 2, 4, true, false);
  const auto want = straight->parameters();
  ASSERT_EQ(resumed.size(), want.size());
  for (size_t k = 0; k < want.size(); ++k)
    EXPECT_TRUE(test::close_l2(Tensor::from_f64(resumed[k], {static_cast<int64_t>(resumed[k].size())}, DType::f64),
                               want[k].second.to_f64_vector(), 1e-5))
        << want[k].first;
  fs::remove_all(ckpt);
}

// The sparse embedding gradient's parts: with sparse_embedding_gradient an untied model returns the
// gradient of the embedding's output (its rows summed by token are the dense gradient, bit for bit)
// and hands no embedding gradient to `ready`; a tied model's embedding gradient stays dense.  A
// layer's MLP and post-attention norm gradients are handed over before its attention's.
TEST(Dist, SparseEmbeddingRowsAreTheDenseGradientsTerms) {
  for (const char* family : {"llama", "qwen2"}) {
    const models::ModelConfig cfg = models::ModelConfig::from_folder(fs::path(test::fixtures_dir()) / family);
    Generator gen(6);
    const Tensor ids = Tensor::randint({2, 7}, 0, 5, DType::i64, Device::cpu(), gen);  // ids repeat
    auto model = models::CausalLM::random(cfg, DType::f32, Device::cpu(), 7, 0.5);
    const auto dense = model->loss_and_gradients(ids, ids, 1.0, ops::Reduction::Mean);
    EXPECT_FALSE(dense.embedding_rows.defined()) << family;
    model->sparse_embedding_gradient = true;
    std::vector<std::string> order;
    const auto sparse = model->loss_and_gradients(ids, ids, 1.0, ops::Reduction::Mean,
                                                  [&](const std::string& n, const Tensor&) { order.push_back(n); });
    const std::string embed = "model.embed_tokens.weight";
    if (cfg.tie_word_embeddings) {
      EXPECT_FALSE(sparse.embedding_rows.defined()) << family;
      EXPECT_EQ(sparse.grads.at(embed).to_f64_vector(), dense.grads.at(embed).to_f64_vector()) << family;
      EXPECT_EQ(order.back(), embed) << family;
      continue;
    }
    ASSERT_TRUE(sparse.embedding_rows.defined()) << family;
    EXPECT_EQ(sparse.embedding_rows.shape(), (Shape{ids.numel(), cfg.hidden_size})) << family;
    EXPECT_EQ(sparse.grads.count(embed), 0u) << family;
    EXPECT_EQ(std::count(order.begin(), order.end(), embed), 0) << family;
    EXPECT_EQ(order.size(), dense.grads.size() - 1) << family;
    const Tensor summed = ops::embedding_backward(sparse.embedding_rows, ids.view({ids.numel()}), cfg.vocab_size);
    EXPECT_EQ(summed.to_f64_vector(), dense.grads.at(embed).to_f64_vector()) << family;
    for (const auto& [name, g] : dense.grads)
      if (name != embed) {
        EXPECT_EQ(sparse.grads.at(name).to_f64_vector(), g.to_f64_vector()) << family << " " << name;
      }
    // Layer 0: the MLP's, the post-attention norm's and o_proj's before the attention's backward.
    const auto at = [&](const std::string& n) { return std::find(order.begin(), order.end(), n) - order.begin(); };
    for (const char* early : {"mlp.down_proj.weight", "mlp.gate_proj.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight"})
      for (const char* late : {"self_attn.q_proj.weight", "self_attn.v_proj.weight", "input_layernorm.weight"})
        EXPECT_LT(at(fmt::format("model.layers.0.{}", early)), at(fmt::format("model.layers.0.{}", late))) << family << " " << early;
    EXPECT_LT(at("model.layers.1.input_layernorm.weight"), at("model.layers.0.mlp.down_proj.weight")) << family;
  }
}

// The embedding's gradient summed from every rank's rows (sparse) gives the parameters of summing
// the dense gradients and of one process on the whole batch (f32, clipping active), at every ZeRO
// stage, with and without overlap, on 2 and 3 ranks whose shares differ in size (the padding rows)
// and hold several micro-batches, with ids repeated inside each rank and across ranks.  Every rank
// ends with the same parameters.  A tied model (its embedding's gradient dense) takes the dense
// path by itself and refuses a forced sparse one.  The automatic choice is the one of fewer bytes.
TEST(Dist, SparseEmbeddingGradientEqualsTheDenseOne) {
  const int64_t rows = 7, seq = 9;
  train::AdamWOptions o;
  o.lr = 5e-3, o.weight_decay = 0.01, o.max_grad_norm = 0.5;
  for (bool tied : {false, true}) {
    models::ModelConfig cfg = odd_llama();
    cfg.tie_word_embeddings = tied;
    std::vector<Tensor> ids;
    Generator gen(21);
    for (int step = 0; step < 3; ++step) {
      // Half the tokens from the ids 3 .. 6 (repeated inside every rank's rows and across ranks), the
      // rest anywhere in the vocabulary.
      const auto few = Tensor::randint({rows, seq}, 3, 7, DType::i64, Device::cpu(), gen).to_f64_vector();
      auto any = Tensor::randint({rows, seq}, 0, cfg.vocab_size, DType::i64, Device::cpu(), gen).to_f64_vector();
      for (size_t i = 0; i < any.size(); i += 2) any[i] = few[i];
      ids.push_back(Tensor::from_f64(any, {rows, seq}, DType::i64));
    }
    auto single = models::CausalLM::random(cfg, DType::f32, Device::cpu(), 7, 0.5);
    train::AdamW opt(single->parameters(), o);
    for (const Tensor& batch : ids) train::train_step(*single, opt, {{batch, batch}});
    std::map<std::string, std::vector<double>> want;
    for (const auto& [name, p] : single->parameters()) want[name] = p.to_f64_vector();
    for (int world : {2, 3})
      for (int zero : {0, 1, 2, 3})
        for (bool overlap : {true, false})
          for (auto mode : {train::EmbeddingGradient::Sparse, train::EmbeddingGradient::Dense, train::EmbeddingGradient::Auto}) {
            if (tied && mode == train::EmbeddingGradient::Sparse) continue;
            const char* mode_name = mode == train::EmbeddingGradient::Sparse  ? "sparse"
                                    : mode == train::EmbeddingGradient::Dense ? "dense"
                                                                              : "auto";
            const std::string what = fmt::format("{} world {} ZeRO-{}{} {}", tied ? "tied" : "untied", world, zero,
                                                 overlap ? "" : " no overlap", mode_name);
            std::vector<std::map<std::string, std::vector<double>>> got(static_cast<size_t>(world));
            std::vector<train::DataParallel::CommStats> stats(static_cast<size_t>(world));
            on_ranks(world, [&](int r, dist::Communicator& c) {
              auto model = models::CausalLM::random(cfg, DType::f32, Device::cpu(), 7, 0.5);
              train::DataParallelOptions dp;
              dp.zero_stage = zero, dp.overlap = overlap, dp.bucket_mib = 0.01, dp.embedding_gradient = mode;
              train::DataParallel t(*model, c, o, dp);
              // Rows 0..1 | 2..6 on 2 ranks, 0..1 | 2..3 | 4..6 on 3, each share as two micro-batches
              // (its first row, the rest).
              const int64_t lo = 2 * r, hi = r == world - 1 ? rows : 2 * r + 2;
              for (const Tensor& batch : ids) {
                const Tensor first = batch.narrow(0, lo, 1).contiguous(), rest = batch.narrow(0, lo + 1, hi - lo - 1).contiguous();
                (void)t.step({{first, first}, {rest, rest}});
              }
              t.gather_parameters();
              for (const auto& [name, p] : model->parameters()) got[static_cast<size_t>(r)][name] = p.to_f64_vector();
              stats[static_cast<size_t>(r)] = t.comm_stats();
            });
            // Auto: sparse where a rank receives fewer bytes: the largest share is 27 tokens on 3
            // ranks (3 rows of 9), 45 on 2, each a row of 31 f32 values and an 8-byte id, against the
            // 97 x 31 f32 values reduced: on 3 ranks 2 x 27 x 132 = 7128 bytes against 2 x 2/3 x
            // 12028 = 16037 (stage 0, an all-reduce) and 8019 (a reduce-scatter); on 2 ranks 45 x 132
            // = 5940 against 12028 and 6014.  A tied head: dense.
            const bool sparse = !tied && mode != train::EmbeddingGradient::Dense;
            for (int r = 0; r < world; ++r) {
              EXPECT_EQ(stats[static_cast<size_t>(r)].steps, 3) << what;
              EXPECT_EQ(stats[static_cast<size_t>(r)].sparse_embedding_steps, sparse ? 3 : 0) << what;
              EXPECT_EQ(stats[static_cast<size_t>(r)].timed, 3) << what;
              for (const auto& [name, v] : got[static_cast<size_t>(r)]) {
                EXPECT_TRUE(test::close_l2(Tensor::from_f64(v, {static_cast<int64_t>(v.size())}, DType::f64), want.at(name), 1e-5))
                    << what << " rank " << r << " " << name;
                if (r > 0) {
                  EXPECT_EQ(v, got[0].at(name)) << what << ": ranks 0 and " << r << " differ in " << name;
                }
              }
            }
          }
    if (tied) {
      const std::string err = error_of([&] {
        on_ranks(2, [&](int, dist::Communicator& c) {
          auto model = models::CausalLM::random(cfg, DType::f32, Device::cpu(), 7, 0.5);
          train::DataParallelOptions dp;
          dp.embedding_gradient = train::EmbeddingGradient::Sparse;
          train::DataParallel t(*model, c, o, dp);
        });
      });
      EXPECT_NE(err.find("tied"), std::string::npos) << err;
    }
  }
}

// Without clipping, the sparse embedding gradient gives stage 0's parameters bit for bit at stages 1
// to 3 (each rank sums the rows of its shard in the order stage 0 sums them), in f32 and bf16, on 3
// ranks whose ids repeat; and the automatic choice follows the bytes: a share of 200 tokens on 3
// ranks moves 2 x 200 x (31 x 4 + 8) = 52800 bytes of rows, more than the 16037 (stage 0) or 8019
// bytes of the dense gradient: dense.
TEST(Dist, SparseEmbeddingStagesEqualStageZeroBitForBit) {
  const models::ModelConfig cfg = odd_llama();
  Generator gen(13);
  const Tensor ids = Tensor::randint({3, 10}, 0, 9, DType::i64, Device::cpu(), gen);
  train::AdamWOptions o;
  o.lr = 1e-2, o.weight_decay = 0.1;
  for (DType dt : {DType::f32, DType::bf16}) {
    std::map<int, std::vector<std::vector<std::vector<double>>>> got;
    for (int zero : {0, 1, 2, 3}) {
      got[zero].resize(3);
      on_ranks(3, [&](int r, dist::Communicator& c) {
        auto model = models::CausalLM::random(cfg, dt, Device::cpu(), 4, 0.5);
        train::DataParallelOptions dp;
        dp.zero_stage = zero, dp.bucket_mib = 0.02, dp.embedding_gradient = train::EmbeddingGradient::Sparse;
        train::DataParallel t(*model, c, o, dp);
        const Tensor mine = ids.narrow(0, r, 1).contiguous();
        for (int step = 0; step < 3; ++step) t.step({{mine, mine}});
        EXPECT_EQ(t.comm_stats().sparse_embedding_steps, 3);
        t.gather_parameters();
        for (const auto& [name, p] : model->parameters()) got[zero][static_cast<size_t>(r)].push_back(p.to_f64_vector());
      });
    }
    for (int zero : {0, 1, 2, 3})
      for (size_t r = 0; r < 3; ++r) {
        EXPECT_EQ(got[zero][r], got[0][0]) << dtype_name(dt) << " ZeRO-" << zero << " rank " << r;
      }
  }
  const Tensor long_ids = Tensor::randint({4, 50}, 0, cfg.vocab_size, DType::i64, Device::cpu(), gen);
  for (int zero : {0, 1}) {
    on_ranks(3, [&](int, dist::Communicator& c) {
      auto model = models::CausalLM::random(cfg, DType::f32, Device::cpu(), 4, 0.5);
      train::DataParallelOptions dp;
      dp.zero_stage = zero;
      train::DataParallel t(*model, c, o, dp);
      t.step({{long_ids, long_ids}});
      EXPECT_EQ(t.comm_stats().sparse_embedding_steps, 0) << "ZeRO-" << zero;
    });
  }
}

// ZeRO-1 and 2 with the parameters' all-gather deferred to the next forward: the same parameters as
// gathering after AdamW, bit for bit, on 2 and 3 ranks.  Between steps the other ranks' shards are
// those of the step before until a forward (a collective: every rank runs it) or gather_parameters();
// a loss between steps equals the one without deferral; a forward with a KV cache is refused while
// the hook is set, and runs after gather_parameters().  Stages 0 and 3, or no overlap: an error.
TEST(Dist, OverlappedParameterGatherEqualsTheGatherAfterAdamW) {
  const models::ModelConfig cfg = odd_llama();
  Generator gen(17);
  const Tensor ids = Tensor::randint({6, 8}, 0, cfg.vocab_size, DType::i64, Device::cpu(), gen);
  const Tensor probe = Tensor::randint({1, 8}, 0, cfg.vocab_size, DType::i64, Device::cpu(), gen);
  train::AdamWOptions o;
  o.lr = 1e-2, o.weight_decay = 0.1, o.max_grad_norm = 0.5;
  for (int world : {2, 3})
    for (int zero : {1, 2}) {
      const int64_t share = 6 / world;
      struct Result {
        std::vector<std::vector<double>> params, stale;
        std::vector<double> losses;
      };
      auto run = [&](bool deferred) {
        std::vector<Result> got(static_cast<size_t>(world));
        on_ranks(world, [&](int r, dist::Communicator& c) {
          auto model = models::CausalLM::random(cfg, DType::f32, Device::cpu(), 4, 0.5);
          train::DataParallelOptions dp;
          dp.zero_stage = zero, dp.bucket_mib = 0.01, dp.overlap_parameter_gather = deferred;
          train::DataParallel t(*model, c, o, dp);
          Result& res = got[static_cast<size_t>(r)];
          const Tensor mine = ids.narrow(0, r * share, share).contiguous();
          for (int step = 0; step < 3; ++step) {
            t.step({{mine, mine}});
            EXPECT_EQ(static_cast<bool>(model->parameter_use), deferred);
            if (step == 0)
              for (const auto& [name, p] : model->parameters()) res.stale.push_back(p.to_f64_vector());
            if (step == 1) res.losses.push_back(model->loss(probe, probe).item());
          }
          if (deferred) {
            models::CausalLM::KVCache cache;
            const std::string err = error_of([&] { (void)model->forward(probe, &cache); });
            EXPECT_NE(err.find("gather_parameters"), std::string::npos) << err;
          }
          t.gather_parameters();
          EXPECT_FALSE(model->parameter_use);
          models::CausalLM::KVCache cache;
          (void)model->forward(probe, &cache);
          for (const auto& [name, p] : model->parameters()) res.params.push_back(p.to_f64_vector());
        });
        return got;
      };
      const std::string what = fmt::format("world {} ZeRO-{}", world, zero);
      const auto want = run(false), got = run(true);
      for (size_t r = 0; r < static_cast<size_t>(world); ++r) {
        EXPECT_EQ(got[r].params, want[r].params) << what << " rank " << r;
        EXPECT_EQ(got[r].losses, want[r].losses) << what << " rank " << r;
        EXPECT_NE(got[r].stale, want[r].stale) << what << " rank " << r << ": the all-gather was not deferred";
      }
    }
  const auto model = models::CausalLM::random(odd_llama(), DType::f32, Device::cpu(), 4, 0.5);
  for (int zero : {0, 1, 3})
    on_ranks(1, [&](int, dist::Communicator& c) {
      train::DataParallelOptions dp;
      dp.zero_stage = zero, dp.overlap = zero != 1, dp.overlap_parameter_gather = true;
      const std::string err = error_of([&] { train::DataParallel t(*model, c, o, dp); });
      EXPECT_NE(err.find("overlap_parameter_gather"), std::string::npos) << "ZeRO-" << zero << ": " << err;
    });
}

// What a resumed run must equal: the random model of seed 9 trained by one process, a step on each
// batch of `ids` (inputs and labels alike).
std::unique_ptr<models::CausalLM> uninterrupted(const models::ModelConfig& cfg, const std::vector<Tensor>& ids,
                                                const train::AdamWOptions& o) {
  auto model = models::CausalLM::random(cfg, DType::f32, Device::cpu(), 9, 0.5);
  train::AdamW opt(model->parameters(), o);
  for (const Tensor& batch : ids) train::train_step(*model, opt, {{batch, batch}});
  return model;
}

// Every parameter of `got` equals the one of `want` of the same index (1e-4 relative L2).  Runs over
// different numbers of ranks sum a batch's gradients in different orders, and AdamW's normalized step
// turns those rounding-level differences into up to a few percent of a step for an element whose
// gradient is near zero (2.7e-5 relative L2 seen on o_proj with OpenBLAS on an AVX-512 machine); a
// resume without the optimizer's state is off by 5e-3 to 1.2e-2 on every parameter.
void expect_same_parameters(models::CausalLM& got_model, models::CausalLM& want_model, const std::string& what) {
  const auto want = want_model.parameters();
  const auto got = got_model.parameters();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_TRUE(test::close_l2(got[i].second, want[i].second.to_f64_vector(), 1e-4)) << what << " " << got[i].first;
}

// Checkpoints of the optimizer do not depend on the world size: two steps, a save, two more steps
// give the four steps of one uninterrupted process, whether the run is saved by one process and
// resumed by three ranks (ZeRO-1, each reading the pieces of the state of its shard) or saved by
// three ranks and resumed by one.
TEST(Dist, OptimizerCheckpointsResumeOnAnyWorldSize) {
  const fs::path dir = fs::path(test::fixtures_dir()) / "llama";
  const models::ModelConfig cfg = models::ModelConfig::from_folder(dir);
  const int64_t rows = 3, seq = 8;
  Generator gen(5);
  std::vector<Tensor> ids;
  for (int step = 0; step < 4; ++step) ids.push_back(Tensor::randint({rows, seq}, 0, cfg.vocab_size, DType::i64, Device::cpu(), gen));
  train::AdamWOptions o;
  o.lr = 5e-3, o.weight_decay = 0.01, o.max_grad_norm = 0.5;
  const auto straight = uninterrupted(cfg, ids, o);
  auto expect_straight = [&](models::CausalLM& m, const std::string& what) { expect_same_parameters(m, *straight, what); };
  std::string tmpl = (fs::temp_directory_path() / "kcpp-dp-ckpt-XXXXXX").string();
  const fs::path ckpt = ::mkdtemp(tmpl.data());
  const int64_t share = 1;  // world 3: a row each
  {  // one process saves after two steps; three ranks resume
    auto m = models::CausalLM::random(cfg, DType::f32, Device::cpu(), 9, 0.5);
    train::AdamW opt(m->parameters(), o);
    for (int step = 0; step < 2; ++step) train::train_step(*m, opt, {{ids[static_cast<size_t>(step)], ids[static_cast<size_t>(step)]}});
    m->save(ckpt);
    train::save_optimizer_state(ckpt, opt);
    on_ranks(3, [&](int r, dist::Communicator& c) {
      auto resumed = models::CausalLM::from_folder(ckpt, DType::f32, Device::cpu());
      train::DataParallelOptions dp;
      dp.zero_stage = 1;
      train::DataParallel t(*resumed, c, o, dp);
      t.load_optimizer(ckpt);
      EXPECT_EQ(t.optimizer().steps(), 2);
      for (int step = 2; step < 4; ++step) {
        const Tensor mine = ids[static_cast<size_t>(step)].narrow(0, r * share, share).contiguous();
        t.step({{mine, mine}});
      }
      if (r == 2) expect_straight(*resumed, "saved by 1, resumed by 3");
    });
  }
  {  // three ranks save after two steps; one process resumes
    std::vector<std::unique_ptr<models::CausalLM>> models(3);
    on_ranks(3, [&](int r, dist::Communicator& c) {
      models[static_cast<size_t>(r)] = models::CausalLM::random(cfg, DType::f32, Device::cpu(), 9, 0.5);
      train::DataParallelOptions dp;
      dp.zero_stage = 1;
      train::DataParallel t(*models[static_cast<size_t>(r)], c, o, dp);
      for (int step = 0; step < 2; ++step) {
        const Tensor mine = ids[static_cast<size_t>(step)].narrow(0, r * share, share).contiguous();
        t.step({{mine, mine}});
      }
      t.save_optimizer(ckpt);
    });
    models[0]->save(ckpt);
    auto resumed = models::CausalLM::from_folder(ckpt, DType::f32, Device::cpu());
    train::AdamW opt(resumed->parameters(), o);
    train::load_optimizer_state(ckpt, opt);
    EXPECT_EQ(opt.steps(), 2);
    for (int step = 2; step < 4; ++step) train::train_step(*resumed, opt, {{ids[static_cast<size_t>(step)], ids[static_cast<size_t>(step)]}});
    expect_straight(*resumed, "saved by 3, resumed by 1");
    // The single process's earlier file is gone: only the three ranks' files are read.
    EXPECT_FALSE(fs::exists(ckpt / "optimizer-rank0-of-1.safetensors"));
    // The files of two saves, or a save missing a rank, are refused.
    fs::copy_file(ckpt / "optimizer-rank0-of-3.safetensors", ckpt / "optimizer-rank0-of-1.safetensors");
    EXPECT_ERROR(train::load_optimizer_state(ckpt, opt), "saves by 2 different numbers of ranks");
    fs::remove(ckpt / "optimizer-rank0-of-1.safetensors");
    fs::rename(ckpt / "optimizer-rank2-of-3.safetensors", ckpt / "moved.safetensors");
    EXPECT_ERROR(train::load_optimizer_state(ckpt, opt), "holds 2 of the 3 rank files");
    fs::rename(ckpt / "moved.safetensors", ckpt / "optimizer-rank2-of-3.safetensors");
  }
  // A checkpoint of another model is refused by name.
  auto other = models::ModelConfig::from_folder(fs::path(test::fixtures_dir()) / "qwen3");
  auto m = models::CausalLM::random(other, DType::f32, Device::cpu(), 1, 0.5);
  train::AdamW opt(m->parameters(), o);
  EXPECT_ERROR(train::load_optimizer_state(ckpt, opt), "AdamW: the saved");
  fs::remove_all(ckpt);
}

// A sharded save resumes anywhere: two steps on 2 ranks at ZeRO-1, 2 or 3 (each rank writes the
// pieces of the state it owns, with their places in their parameters; at stage 3 the parameters
// gathered for the model's save), a save, then two more steps by one process, or by 3 ranks at
// stage 0, 1, 2 or 3 (other shards: each reads its pieces out of the 2 ranks' files), give the four
// steps of one uninterrupted process.
TEST(Dist, ShardedCheckpointsResumeOnAnyWorldSize) {
  const models::ModelConfig cfg = odd_llama();
  const int64_t rows = 6, seq = 8;
  Generator gen(6);
  std::vector<Tensor> ids;
  for (int step = 0; step < 4; ++step) ids.push_back(Tensor::randint({rows, seq}, 0, cfg.vocab_size, DType::i64, Device::cpu(), gen));
  train::AdamWOptions o;
  o.lr = 5e-3, o.weight_decay = 0.01, o.max_grad_norm = 0.5;
  const auto straight = uninterrupted(cfg, ids, o);
  auto expect_straight = [&](models::CausalLM& m, const std::string& what) { expect_same_parameters(m, *straight, what); };
  auto rows_of = [&](int step, int r, int world) {
    const int64_t share = rows / world;
    return ids[static_cast<size_t>(step)].narrow(0, r * share, share).contiguous();
  };
  std::string tmpl = (fs::temp_directory_path() / "kcpp-zero-ckpt-XXXXXX").string();
  const fs::path ckpt = ::mkdtemp(tmpl.data());
  for (int saved_at : {1, 2, 3}) {
    std::vector<std::unique_ptr<models::CausalLM>> models(2);
    on_ranks(2, [&](int r, dist::Communicator& c) {
      models[static_cast<size_t>(r)] = models::CausalLM::random(cfg, DType::f32, Device::cpu(), 9, 0.5);
      train::DataParallelOptions dp;
      dp.zero_stage = saved_at, dp.bucket_mib = 0.01;
      train::DataParallel t(*models[static_cast<size_t>(r)], c, o, dp);
      for (int step = 0; step < 2; ++step) t.step({{rows_of(step, r, 2), rows_of(step, r, 2)}});
      t.save_optimizer(ckpt);
      t.save_model(ckpt);  // rank 0's (at stage 3 gathered for it)
    });
    const std::string saved = fmt::format("saved by 2 ranks at ZeRO-{}", saved_at);
    {
      auto resumed = models::CausalLM::from_folder(ckpt, DType::f32, Device::cpu());
      train::AdamW opt(resumed->parameters(), o);
      train::load_optimizer_state(ckpt, opt);
      EXPECT_EQ(opt.steps(), 2);
      for (int step = 2; step < 4; ++step) train::train_step(*resumed, opt, {{ids[static_cast<size_t>(step)], ids[static_cast<size_t>(step)]}});
      expect_straight(*resumed, saved + ", resumed by 1");
    }
    for (int resumed_at : {0, 1, 2, 3})
      on_ranks(3, [&](int r, dist::Communicator& c) {
        auto resumed = models::CausalLM::from_folder(ckpt, DType::f32, Device::cpu());
        train::DataParallelOptions dp;
        dp.zero_stage = resumed_at, dp.bucket_mib = 0.004;  // other buckets than the save's
        train::DataParallel t(*resumed, c, o, dp);
        t.load_optimizer(ckpt);
        EXPECT_EQ(t.optimizer().steps(), 2);
        for (int step = 2; step < 4; ++step) t.step({{rows_of(step, r, 3), rows_of(step, r, 3)}});
        t.gather_parameters();
        if (r == 1) expect_straight(*resumed, fmt::format("{}, resumed by 3 at ZeRO-{}", saved, resumed_at));
      });
  }
  // A shard's file alone does not hold every element: the loader names the gap.
  fs::rename(ckpt / "optimizer-rank1-of-2.safetensors", ckpt / "moved.safetensors");
  fs::copy_file(ckpt / "optimizer-rank0-of-2.safetensors", ckpt / "optimizer-rank0-of-1.safetensors");
  fs::remove(ckpt / "optimizer-rank0-of-2.safetensors");
  auto m = models::CausalLM::random(cfg, DType::f32, Device::cpu(), 9, 0.5);
  train::AdamW opt(m->parameters(), o);
  EXPECT_ERROR(train::load_optimizer_state(ckpt, opt), "no file holds elements");
  fs::remove_all(ckpt);
}

}  // namespace
}  // namespace kcpp
