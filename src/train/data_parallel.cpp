#include "train/data_parallel.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <exception>
#include <cstring>
#include <nlohmann/json.hpp>
#include <numeric>
#include <system_error>
#include <utility>
#include <vector>

#include "core/cuda_runtime.h"
#include "core/error.h"
#include "models/safetensors.h"
#include "ops/ops.h"

namespace kcpp::train {
namespace {

constexpr const char* kEmbedding = "model.embed_tokens.weight";
constexpr const char* kMambaEmbedding = "backbone.embeddings.weight";

// A group of collectives (NCCL's group calls) closed however its scope ends.
struct Group {
  explicit Group(dist::Communicator& c) : comm(c) { comm.begin_group(); }
  ~Group() noexcept(false) {
    if (std::uncaught_exceptions() > 0) {
      try {
        comm.end_group();
      } catch (const Error&) {  // the error under way is the one to report
      }
    } else {
      comm.end_group();
    }
  }
  dist::Communicator& comm;
};

// The parameter a state tensor's name belongs to ("<param>.exp_avg", ".exp_avg_sq", ".master").
std::string param_of_key(const std::string& key) {
  for (const char* suffix : {".exp_avg_sq", ".exp_avg", ".master"})
    if (key.ends_with(suffix)) return key.substr(0, key.size() - std::strlen(suffix));
  return key;
}

}  // namespace

// Collectives beside the current stream's work: over NCCL on a CUDA device, on a stream of their own
// that first waits for what the current stream has queued (an event), so that the current stream
// goes on meanwhile; join() makes the current stream wait for all of them.  Elsewhere (the thread
// group, the CPU) a collective runs where it is called.
class SideStream {
 public:
  explicit SideStream(dist::Communicator& comm) {
#if KCPP_WITH_CUDA
    if (comm.backend() == "nccl" && comm.device().is_cuda()) {
      device_ = comm.device().index;
      kcpp::cuda::DeviceGuard g(device_);
      KCPP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      KCPP_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    }
#else
    (void)comm;
#endif
  }
  ~SideStream() {
#if KCPP_WITH_CUDA
    if (stream_) {
      kcpp::cuda::DeviceGuard g(device_);
      // Not while an exception unwinds: a collective a failed peer never joins would never end
      // (the communicator aborts them; destroying a stream with work queued is safe).
      if (std::uncaught_exceptions() == 0) (void)cudaStreamSynchronize(stream_);
      (void)cudaEventDestroy(event_);
      for (cudaEvent_t e : marks_) (void)cudaEventDestroy(e);
      (void)cudaStreamDestroy(stream_);
    }
#endif
  }
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;

  template <typename F> void run(F&& f) {
#if KCPP_WITH_CUDA
    if (stream_) {
      kcpp::cuda::DeviceGuard g(device_);
      const cudaStream_t main = kcpp::cuda::current_stream();
      KCPP_CUDA_CHECK(cudaEventRecord(event_, main));
      KCPP_CUDA_CHECK(cudaStreamWaitEvent(stream_, event_, 0));
      kcpp::cuda::set_current_stream(stream_);
      struct Back {
        cudaStream_t s;
        ~Back() { kcpp::cuda::set_current_stream(s); }
      } back{main};
      f();
      return;
    }
#endif
    f();
  }
  void join() {
#if KCPP_WITH_CUDA
    if (stream_) {
      kcpp::cuda::DeviceGuard g(device_);
      KCPP_CUDA_CHECK(cudaEventRecord(event_, stream_));
      KCPP_CUDA_CHECK(cudaStreamWaitEvent(kcpp::cuda::current_stream(), event_, 0));
    }
#endif
  }
  // An event after the work queued on the stream so far (-1 where collectives run where they are
  // called), and the current stream made to wait for it only, not for what is queued after it (the
  // event then goes back to the pool; `mark` becomes -1).
  int mark() {
#if KCPP_WITH_CUDA
    if (stream_) {
      kcpp::cuda::DeviceGuard g(device_);
      if (free_.empty()) {
        cudaEvent_t e = nullptr;
        KCPP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        marks_.push_back(e);
        free_.push_back(static_cast<int>(marks_.size()) - 1);
      }
      const int m = free_.back();
      KCPP_CUDA_CHECK(cudaEventRecord(marks_[static_cast<size_t>(m)], stream_));
      free_.pop_back();
      return m;
    }
#endif
    return -1;
  }
  void wait(int& mark) {
    if (mark < 0) return;
#if KCPP_WITH_CUDA
    kcpp::cuda::DeviceGuard g(device_);
    const int m = std::exchange(mark, -1);
    free_.push_back(m);
    KCPP_CUDA_CHECK(cudaStreamWaitEvent(kcpp::cuda::current_stream(), marks_[static_cast<size_t>(m)], 0));
#endif
  }

 private:
#if KCPP_WITH_CUDA
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t event_ = nullptr;
  std::vector<cudaEvent_t> marks_;  // mark()'s events; free_: those not in use
  std::vector<int> free_;
#endif
};

// Points of a step on the compute stream (CUDA events over NCCL on a CUDA device; elsewhere, where
// every collective has ended when its call returns, the host's clock), and the milliseconds between
// two of them once the device has passed both.
class StepClock {
 public:
  static constexpr int kPoints = 4;
  explicit StepClock(dist::Communicator& comm) {
#if KCPP_WITH_CUDA
    if (comm.backend() == "nccl" && comm.device().is_cuda()) {
      device_ = comm.device().index;
      kcpp::cuda::DeviceGuard g(device_);
      for (cudaEvent_t& e : events_) KCPP_CUDA_CHECK(cudaEventCreate(&e));
      cuda_ = true;
    }
#else
    (void)comm;
#endif
  }
  ~StepClock() {
#if KCPP_WITH_CUDA
    if (cuda_) {
      kcpp::cuda::DeviceGuard g(device_);
      for (cudaEvent_t e : events_) (void)cudaEventDestroy(e);
    }
#endif
  }
  StepClock(const StepClock&) = delete;
  StepClock& operator=(const StepClock&) = delete;

  void mark(int point) {
    marked_[point] = true;
#if KCPP_WITH_CUDA
    if (cuda_) {
      kcpp::cuda::DeviceGuard g(device_);
      KCPP_CUDA_CHECK(cudaEventRecord(events_[point], kcpp::cuda::current_stream()));
      return;
    }
#endif
    host_[point] = std::chrono::steady_clock::now();
  }
  bool marked(int point) const { return marked_[point]; }
  // From `from` to `to` (both marked; waits for `to`).
  double ms(int from, int to) const {
#if KCPP_WITH_CUDA
    if (cuda_) {
      kcpp::cuda::DeviceGuard g(device_);
      KCPP_CUDA_CHECK(cudaEventSynchronize(events_[to]));
      float t = 0;
      KCPP_CUDA_CHECK(cudaEventElapsedTime(&t, events_[from], events_[to]));
      return t;
    }
#endif
    return std::chrono::duration<double, std::milli>(host_[to] - host_[from]).count();
  }
  void clear() { marked_.fill(false); }

 private:
  std::array<bool, kPoints> marked_{};
  std::array<std::chrono::steady_clock::time_point, kPoints> host_{};
#if KCPP_WITH_CUDA
  bool cuda_ = false;
  int device_ = 0;
  std::array<cudaEvent_t, kPoints> events_{};
#endif
};

// StepClock's points.
constexpr int kBackwardDone = 0, kReduced = 1, kGatherBegins = 2, kGathered = 3;

DataParallel::~DataParallel() {
  if (options_.zero_stage == 3 || options_.overlap_parameter_gather) parameter_use() = {};
}

size_t DataParallel::layer_count() const {
  return static_cast<size_t>(causal_ ? causal_->config().num_hidden_layers : mamba_->config().num_hidden_layers);
}

bool DataParallel::tied_head() const {
  return causal_ ? causal_->config().tie_word_embeddings : mamba_->config().tie_word_embeddings;
}

models::ParameterUse& DataParallel::parameter_use() const { return causal_ ? causal_->parameter_use : mamba_->parameter_use; }

DataParallel::DataParallel(models::CausalLM& model, dist::Communicator& comm, AdamWOptions adamw, DataParallelOptions o)
    : DataParallel(&model, nullptr, model.parameters(), comm, adamw, o) {}

DataParallel::DataParallel(models::MambaLM& model, dist::Communicator& comm, AdamWOptions adamw, DataParallelOptions o)
    : DataParallel(nullptr, &model, model.parameters(), comm, adamw, o) {}

DataParallel::DataParallel(models::CausalLM* causal, models::MambaLM* mamba, std::vector<std::pair<std::string, Tensor>> params,
                           dist::Communicator& comm, AdamWOptions adamw, DataParallelOptions o)
    : causal_(causal),
      mamba_(mamba),
      comm_(comm),
      options_(o),
      params_(std::move(params)),
      param_of_(params_.begin(), params_.end()),
      opt_(
          [&] {
            KCPP_CHECK(o.zero_stage >= 0 && o.zero_stage <= 3, "data parallel: ZeRO stage {} is not supported (0, 1, 2 or 3)",
                       o.zero_stage);
            KCPP_CHECK(!mamba_ || o.embedding_gradient != EmbeddingGradient::Sparse, "data parallel: a {} model's embedding "
                       "gradient is summed dense (use the dense or the automatic choice)",
                       mamba_ ? mamba_->config().model_type : "");
            KCPP_CHECK(o.zero_stage < 3 || !parameter_use(),
                       "data parallel: ZeRO-3: the model's parameter_use is set already (another ZeRO-3 trainer of it?)");
            KCPP_CHECK(o.bucket_mib > 0, "data parallel: bucket_mib is {}; it must be positive", o.bucket_mib);
            KCPP_CHECK(!o.overlap_parameter_gather || ((o.zero_stage == 1 || o.zero_stage == 2) && o.overlap),
                       "data parallel: overlap_parameter_gather defers the all-gather of ZeRO stages 1 and 2 with overlap; "
                       "this trainer is at stage {}{}", o.zero_stage, o.overlap ? "" : " without overlap");
            KCPP_CHECK(!o.overlap_parameter_gather || !parameter_use(),
                       "data parallel: overlap_parameter_gather: the model's parameter_use is set already (another trainer of it?)");
            KCPP_CHECK(o.embedding_gradient != EmbeddingGradient::Sparse || !tied_head(),
                       "data parallel: a sparse embedding gradient was asked for, but the model's lm_head is tied to the "
                       "embedding, whose gradient is then dense; use the automatic choice or the dense one");
            if (o.reduce_dtype) {
              const DType r = *o.reduce_dtype;
              KCPP_CHECK(r == DType::f32 || r == DType::f64 || r == DType::bf16 || r == DType::f16,
                         "data parallel: reduce_dtype {} is not a floating dtype (f32, f64, bf16 or f16)", dtype_name(r));
            }
            for (size_t i = 0; i < params_.size(); ++i) index_of_[params_[i].first] = i;
            const char* embedding = causal_ ? kEmbedding : kMambaEmbedding;
            KCPP_CHECK(index_of_.count(embedding) > 0, "data parallel: the model has no parameter '{}'", embedding);
            embed_param_ = index_of_.at(embedding);
            for (const auto& [name, p] : params_) {
              KCPP_CHECK(p.device() == comm.device(), "data parallel: parameter '{}' is on {} but the communicator is on {}",
                         name, p.device().str(), comm.device().str());
              KCPP_CHECK(p.is_contiguous(), "data parallel: parameter '{}' is not contiguous", name);
            }
            // Every replica starts as rank 0's, before AdamW takes its f32 master copies of them.
            {
              Group group(comm);
              for (const auto& [name, p] : params_) comm.broadcast(p, 0);
            }
            return o.zero_stage == 0 ? params_ : shard_layout();
          }(),
          adamw, comm.device()),
      side_(std::make_unique<SideStream>(comm)),
      clock_(std::make_unique<StepClock>(comm)) {
  if (options_.zero_stage == 3) release_layout();
}

size_t DataParallel::group_of(const std::string& name) const {
  const size_t layers = layer_count();
  if (name == (causal_ ? kEmbedding : kMambaEmbedding)) return 0;
  size_t layer = 0;
  if (std::sscanf(name.c_str(), causal_ ? "model.layers.%zu." : "backbone.layers.%zu.", &layer) == 1 && layer < layers)
    return 1 + layer;
  return layers + 1;  // the final norm, an untied head
}

void DataParallel::release_layout() {
  groups_.resize(layer_count() + 2);
  for (size_t bi = 0; bi < buckets_.size(); ++bi) groups_[buckets_[bi].group].buckets.push_back(bi);
  // Each storage is released whole: it must hold the parameters of one group and nothing else (the
  // views wq, wk, wv of wqkv fill it together).
  struct Seen {
    size_t group, bytes;
    std::string first;
  };
  std::map<const Storage*, Seen> seen;
  for (const auto& [name, p] : params_) {
    const size_t g = group_of(name);
    const auto [it, fresh] = seen.emplace(p.storage().get(), Seen{g, 0, name});
    KCPP_CHECK(it->second.group == g, "data parallel: ZeRO-3 releases each group's parameters alone, but '{}' and '{}' share "
               "memory across groups", it->second.first, name);
    it->second.bytes += p.nbytes();
    if (fresh) groups_[g].storages.push_back(p.storage());
  }
  for (const auto& [storage, s] : seen)
    KCPP_CHECK(s.bytes == storage->nbytes, "data parallel: ZeRO-3 releases whole storages, but the memory of '{}' holds {} "
               "bytes and its group's parameters in it {}", s.first, storage->nbytes, s.bytes);
  for (const Bucket& b : buckets_) resident_ += b.data.nbytes();
  for (ParamGroup& g : groups_) {
    for (const auto& st : g.storages) g.bytes += st->nbytes;
    for (const auto& st : g.storages) st->evict();
  }
  peak_ = resident_;  // from here on
  const size_t head = groups_.size() - 1;
  parameter_use() = [this, head](const models::ParameterGroup& g, bool in_use) {
    using Kind = models::ParameterGroup::Kind;
    const size_t group = g.kind == Kind::Embedding ? 0 : g.kind == Kind::Layer ? 1 + g.layer : head;
    KCPP_CHECK(group < groups_.size(), "data parallel: ZeRO-3: the model used layer {} of {}", g.layer, groups_.size() - 2);
    if (in_use) {
      begin_use(group);
    } else {
      const std::vector<size_t> groups = groups_of_use(group);
      for (size_t k = groups.size(); k-- > 0;) release(groups[k]);
    }
  };
}

std::vector<size_t> DataParallel::groups_of_use(size_t use) const {
  // A tied head reads the embedding's weight: both gathered, in the same order on every rank.
  if (use == groups_.size() - 1 && tied_head()) return {use, 0};
  return {use};
}

void DataParallel::begin_use(size_t use) {
  bool planned = false;
  if (!plan_.empty()) {
    if (planned_ < plan_.size() && plan_[planned_] == use) {
      ++planned_;
      planned = true;
    } else {  // not the order the prefetch expects: none for the rest of the step
      ++prefetch_stats_.deviations;
      end_plan();
    }
  }
  const std::vector<size_t> groups = groups_of_use(use);
  bool staged = false;
  for (size_t gi : groups) staged = staged || !groups_[gi].staged.empty();
  size_t done = 0;
  try {
    for (; done < groups.size(); ++done) acquire(groups[done]);
  } catch (...) {
    while (done-- > 0) release(groups[done]);
    throw;
  }
  if (planned && staged) ++prefetch_stats_.used;
  if (planned && planned_ < plan_.size()) prefetch(plan_[planned_]);
}

void DataParallel::prefetch(size_t use) {
  bool issued = false;
  for (size_t gi : groups_of_use(use)) {
    ParamGroup& g = groups_[gi];
    if (g.users > 0 || !g.staged.empty()) continue;  // whole already
    g.staged = gather_staged(gi, g.staged_event);
    for (const Tensor& t : g.staged) resident_ += t.nbytes();
    peak_ = std::max(peak_, resident_);
    issued = true;
  }
  if (issued) ++prefetch_stats_.issued;
}

void DataParallel::drop_staged(size_t gi) {
  ParamGroup& g = groups_[gi];
  if (g.staged.empty()) return;
  side_->wait(g.staged_event);  // the gathers done before their buffers go back to the allocator
  for (const Tensor& t : g.staged) resident_ -= t.nbytes();
  g.staged.clear();
}

void DataParallel::end_plan() {
  plan_.clear();
  planned_ = 0;
  for (size_t gi = 0; gi < groups_.size(); ++gi) drop_staged(gi);
}

std::vector<Tensor> DataParallel::gather_staged(size_t gi, int& event) {
  std::vector<Tensor> staged;
  for (size_t bi : groups_[gi].buckets)
    staged.push_back(Tensor::empty({comm_.world_size() * buckets_[bi].shard}, buckets_[bi].dtype, comm_.device()));
  // On the side stream, after what is queued there (every collective of a step is issued in the same
  // order on every rank), while the current stream goes on.
  side_->run([&] {
    for (size_t k = 0; k < staged.size(); ++k) comm_.all_gather(staged[k], buckets_[groups_[gi].buckets[k]].data);
  });
  event = side_->mark();
  return staged;
}

void DataParallel::fill_from(size_t gi, const std::vector<Tensor>& staged) {
  const ParamGroup& g = groups_[gi];
  for (const auto& st : g.storages) st->restore();
  for (size_t k = 0; k < g.buckets.size(); ++k) {
    const Bucket& b = buckets_[g.buckets[k]];
    for (size_t j = 0; j < b.params.size(); ++j) {
      const Tensor& p = params_[b.params[j]].second;
      p.view({p.numel()}).copy_(staged[k].narrow(0, b.offset[j], p.numel()));
    }
  }
}

void DataParallel::acquire(size_t gi) {
  ParamGroup& g = groups_[gi];
  if (g.users++ > 0) return;
  // A prefetch: its gathers waited for (on the device), then copied in; held until copied, so that
  // the peak counts both.
  std::vector<Tensor> staged = std::move(g.staged);
  g.staged.clear();
  size_t staged_bytes = 0;
  for (const Tensor& t : staged) staged_bytes += t.nbytes();
  try {
    if (!staged.empty()) {
      side_->wait(g.staged_event);
      fill_from(gi, staged);
    } else {
      for (const auto& st : g.storages) st->restore();
      for (size_t bi : g.buckets) {
        const Bucket& b = buckets_[bi];
        const Tensor all = Tensor::empty({comm_.world_size() * b.shard}, b.dtype, comm_.device());
        // With overlap on the side stream, behind the overlapped reduce-scatters (every collective of
        // a step is issued on one stream, in the same order on every rank), and waited for: the layer
        // needs it.  Without, on the current stream.
        if (options_.overlap) {
          side_->run([&] { comm_.all_gather(all, b.data); });
          side_->join();
        } else {
          comm_.all_gather(all, b.data);
        }
        for (size_t j = 0; j < b.params.size(); ++j) {
          const Tensor& p = params_[b.params[j]].second;
          p.view({p.numel()}).copy_(all.narrow(0, b.offset[j], p.numel()));
        }
      }
    }
  } catch (...) {
    --g.users;
    for (const auto& st : g.storages) st->evict();
    resident_ -= staged_bytes;
    throw;
  }
  resident_ += g.bytes;
  peak_ = std::max(peak_, resident_);
  resident_ -= staged_bytes;
}

void DataParallel::release(size_t gi) {
  ParamGroup& g = groups_[gi];
  KCPP_CHECK(g.users > 0, "data parallel: ZeRO-3: group {} released more often than gathered", gi);
  if (--g.users > 0) return;
  for (const auto& st : g.storages) st->evict();
  resident_ -= g.bytes;
}

void DataParallel::gather_parameters() {
  if (options_.zero_stage < 3) {
    if (options_.overlap_parameter_gather) {
      finish_gathers();
      parameter_use() = {};
    }
    return;
  }
  for (size_t gi = 0; gi < groups_.size(); ++gi) acquire(gi);
}

void DataParallel::gather_updated() {
  if (options_.overlap_parameter_gather) {
    finish_gathers();
    gathers_due_ = true;
    if (!parameter_use()) {
      const size_t head = layer_count() + 1;
      parameter_use() = [this, head](const models::ParameterGroup& g, bool in_use) {
        using Kind = models::ParameterGroup::Kind;
        if (!in_use) return;
        const size_t group = g.kind == Kind::Embedding ? 0 : g.kind == Kind::Layer ? 1 + g.layer : head;
        KCPP_CHECK(group <= head, "data parallel: the model used layer {} of {}", g.layer, head - 1);
        if (gathers_due_) issue_gathers();
        wait_gathered(group);
        if (group == head && tied_head()) wait_gathered(0);
      };
    }
    return;
  }
  clock_->mark(kGatherBegins);
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    const Bucket& b = buckets_[bi];
    const Tensor mine = Tensor::zeros({b.shard}, b.dtype, comm_.device());
    for (const Piece& pc : pieces_)
      if (pc.bucket == bi) {
        const Tensor& p = params_[pc.param].second;
        mine.narrow(0, pc.at, pc.length).copy_(p.view({p.numel()}).narrow(0, pc.begin, pc.length));
      }
    const Tensor all = Tensor::empty({comm_.world_size() * b.shard}, b.dtype, comm_.device());
    comm_.all_gather(all, mine);
    for (size_t j = 0; j < b.params.size(); ++j) {
      const Tensor& p = params_[b.params[j]].second;
      p.view({p.numel()}).copy_(all.narrow(0, b.offset[j], p.numel()));
    }
  }
  clock_->mark(kGathered);
}

void DataParallel::issue_gathers() {
  gathers_due_ = false;
  const size_t groups = layer_count() + 2;
  // Each group's last bucket in the order of issue (the buckets from the last one down: the
  // embedding's first, the head's last).
  std::vector<size_t> last(groups, buckets_.size());
  for (size_t bi = 0; bi < buckets_.size(); ++bi)
    for (size_t k : buckets_[bi].params) last[group_of(params_[k].first)] = std::min(last[group_of(params_[k].first)], bi);
  // This rank's pieces packed on the current stream, after AdamW; the rest on the side stream.
  std::vector<Tensor> mine(buckets_.size()), all(buckets_.size());
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    mine[bi] = Tensor::zeros({buckets_[bi].shard}, buckets_[bi].dtype, comm_.device());
    all[bi] = Tensor::empty({comm_.world_size() * buckets_[bi].shard}, buckets_[bi].dtype, comm_.device());
  }
  for (const Piece& pc : pieces_) {
    const Tensor& p = params_[pc.param].second;
    mine[pc.bucket].narrow(0, pc.at, pc.length).copy_(p.view({p.numel()}).narrow(0, pc.begin, pc.length));
  }
  gather_marks_.assign(groups, -1);
  side_->run([&] {
    for (size_t bi = buckets_.size(); bi-- > 0;) {
      const Bucket& b = buckets_[bi];
      comm_.all_gather(all[bi], mine[bi]);
      for (size_t j = 0; j < b.params.size(); ++j) {
        const Tensor& p = params_[b.params[j]].second;
        p.view({p.numel()}).copy_(all[bi].narrow(0, b.offset[j], p.numel()));
      }
      for (size_t g = 0; g < groups; ++g)
        if (last[g] == bi) gather_marks_[g] = side_->mark();
    }
  });
  // Held until the current stream has waited for every mark (the side stream is done with them).
  gather_buffers_ = std::move(mine);
  gather_buffers_.insert(gather_buffers_.end(), all.begin(), all.end());
}

void DataParallel::wait_gathered(size_t group) {
  if (group < gather_marks_.size()) side_->wait(gather_marks_[group]);
  if (std::all_of(gather_marks_.begin(), gather_marks_.end(), [](int m) { return m < 0; })) gather_buffers_.clear();
}

void DataParallel::finish_gathers() {
  if (gathers_due_) issue_gathers();
  for (size_t g = 0; g < gather_marks_.size(); ++g) wait_gathered(g);
  gather_buffers_.clear();
}

void DataParallel::release_parameters() {
  for (size_t gi = 0; gi < groups_.size(); ++gi)
    if (groups_[gi].users > 0) release(gi);
}

void DataParallel::save_model(const std::filesystem::path& folder) {
  if (options_.zero_stage < 3) gather_parameters();  // a deferred all-gather
  const bool gather = options_.zero_stage == 3;
  if (gather) gather_parameters();
  struct Release {
    DataParallel* dp;
    ~Release() {
      if (dp) dp->release_parameters();
    }
  } release{gather ? this : nullptr};
  if (comm_.rank() == 0) causal_ ? causal_->save(folder) : mamba_->save(folder);
}

size_t DataParallel::parameter_bytes() const {
  if (options_.zero_stage == 3) return resident_;
  std::map<const Storage*, size_t> storages;
  for (const auto& [name, p] : params_) storages[p.storage().get()] = p.storage()->nbytes;
  size_t n = 0;
  for (const auto& [s, bytes] : storages) n += bytes;
  return n;
}

size_t DataParallel::peak_parameter_bytes() const { return options_.zero_stage == 3 ? peak_ : parameter_bytes(); }

std::vector<std::pair<std::string, Tensor>> DataParallel::shard_layout() {
  const int64_t world = comm_.world_size(), rank = comm_.rank();
  const size_t bucket_bytes = static_cast<size_t>(options_.bucket_mib * (1 << 20));
  // The model's parameters last first, roughly the order the backward finishes them, so that the
  // first buckets are complete early in it; a new bucket when one is full or the dtype changes (at
  // stage 3 also where the group changes: a bucket is gathered with its group).
  const bool grouped = options_.zero_stage == 3;
  bucket_of_.assign(params_.size(), 0);
  size_t bytes = 0;
  for (size_t k = params_.size(); k-- > 0;) {
    const Tensor& p = params_[k].second;
    const size_t group = grouped ? group_of(params_[k].first) : 0;
    // The embedding alone in its bucket (its gradient may be summed sparse, data_parallel.h).
    const bool alone = k == embed_param_ || (!buckets_.empty() && buckets_.back().params.back() == embed_param_);
    if (buckets_.empty() || bytes >= bucket_bytes || buckets_.back().dtype != p.dtype() || buckets_.back().group != group || alone) {
      buckets_.emplace_back();
      buckets_.back().dtype = p.dtype();
      buckets_.back().group = group;
      bytes = 0;
    }
    Bucket& b = buckets_.back();
    b.params.push_back(k);
    b.offset.push_back(b.numel);
    b.numel += p.numel();
    bytes += static_cast<size_t>(p.numel()) * dtype_size(reduce_dtype(p.dtype()));
    bucket_of_[k] = buckets_.size() - 1;
    if (k == embed_param_) embed_bucket_ = buckets_.size() - 1;
  }
  std::vector<std::pair<std::string, Tensor>> shard;
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    Bucket& b = buckets_[bi];
    b.shard = (b.numel + world - 1) / world;  // the last ranks' shards end in padding
    const int64_t lo = rank * b.shard, hi = lo + b.shard;
    if (grouped) b.data = Tensor::zeros({b.shard}, b.dtype, comm_.device());
    for (size_t j = 0; j < b.params.size(); ++j) {
      const auto& [name, p] = params_[b.params[j]];
      const int64_t from = std::max(lo, b.offset[j]), to = std::min(hi, b.offset[j] + p.numel());
      if (from >= to) continue;
      pieces_.push_back({bi, b.params[j], from - b.offset[j], to - from, from - lo});
      // A view of the parameter's elements (at stage 3 of their copy in the shard, which outlives
      // the whole parameter): AdamW updates them in place (its master, if 16-bit, is of these
      // elements only), under the parameter's name (its weight decay or not).
      const Tensor elements = p.view({p.numel()}).narrow(0, from - b.offset[j], to - from);
      if (grouped) {
        const Tensor kept = b.data.narrow(0, from - lo, to - from);
        kept.copy_(elements);
        shard.emplace_back(name, kept);
      } else {
        shard.emplace_back(name, elements);
      }
    }
    if (options_.zero_stage == 1) {  // kept between steps, reduce-scattered in place
      b.flat = Tensor::zeros({world * b.shard}, reduce_dtype(b.dtype), comm_.device());
      b.grad = b.flat.narrow(0, lo, b.shard);
    } else {
      b.grad = Tensor::zeros({b.shard}, reduce_dtype(b.dtype), comm_.device());
    }
  }
  return shard;
}

size_t DataParallel::gradient_bytes() const {
  size_t n = 0;
  for (const Bucket& b : buckets_) n += b.flat.defined() ? b.flat.nbytes() : b.grad.nbytes();
  return n;
}

StateSlices DataParallel::slices() const {
  StateSlices out;
  for (const Piece& p : pieces_) out[params_[p.param].first] = {p.begin, params_[p.param].second.numel()};
  return out;
}

// The gradients of `names` (parameters whose sums share a dtype, reduce_dtype()) one after another in a
// new flat buffer of that dtype, each converted as it is copied in (one pass over each gradient; never the gradient's own memory, which a view of it
// may share).
Tensor DataParallel::pack(const std::vector<std::string>& names, const std::map<std::string, Tensor>& grads) const {
  int64_t total = 0;
  for (const std::string& n : names) total += grads.at(n).numel();
  const Tensor flat = Tensor::empty({total}, reduce_dtype(param_of_.at(names.front()).dtype()), grads.at(names.front()).device());
  int64_t at = 0;
  for (const std::string& n : names) {
    const Tensor& g = grads.at(n);
    flat.narrow(0, at, g.numel()).copy_(g.reshape({g.numel()}));
    at += g.numel();
  }
  return flat;
}

void DataParallel::unpack(const std::vector<std::string>& names, const Tensor& flat, std::map<std::string, Tensor>& grads) const {
  int64_t at = 0;
  // Back in the parameter's dtype on every rank (a local gradient of another dtype would round
  // differently from rank to rank): into the gradient's own memory when it has that dtype and shape
  // (no second copy of the gradients alive), else as a new tensor.
  for (const std::string& n : names) {
    Tensor& g = grads.at(n);
    const int64_t k = g.numel();
    const Tensor& p = param_of_.at(n);
    const Tensor part = flat.narrow(0, at, k).view(p.shape());
    if (g.dtype() == p.dtype() && g.shape() == p.shape()) g.copy_(part);
    else g = part.to(p.dtype()).contiguous();
    at += k;
  }
}

void DataParallel::reduce_gradients(std::map<std::string, Tensor>& grads, const std::vector<char>& anywhere, size_t skip) {
  const size_t bucket_bytes = static_cast<size_t>(options_.bucket_mib * (1 << 20));
  std::vector<std::string> bucket;
  size_t bytes = 0;
  DType summed_in = DType::f32;  // the bucket's sums' dtype
  auto flush = [&] {
    if (bucket.empty()) return;
    const Tensor flat = pack(bucket, grads);
    comm_.all_reduce(flat, dist::ReduceOp::Sum);
    unpack(bucket, flat, grads);
    bucket.clear();
    bytes = 0;
  };
  // In the parameters' order (the same on every rank).  A parameter with a gradient on some rank but
  // not here gets zeros, so every rank reduces the same buckets; one with a gradient on no rank is
  // left out, as a single process's AdamW skips it.
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& [name, p] = params_[i];
    if (i == skip) continue;
    if (!anywhere[i]) {
      grads.erase(name);
      continue;
    }
    auto it = grads.find(name);
    if (it == grads.end()) it = grads.emplace(name, Tensor::zeros(p.shape(), p.dtype(), p.device())).first;
    if (!bucket.empty() && reduce_dtype(p.dtype()) != summed_in) flush();  // one dtype of sums a bucket
    summed_in = reduce_dtype(p.dtype());
    bucket.push_back(name);
    bytes += static_cast<size_t>(p.numel()) * dtype_size(summed_in);
    if (bytes >= bucket_bytes) flush();
  }
  flush();
}

void save_optimizer_state(const std::filesystem::path& folder, const AdamW& opt, int rank, int world, const StateSlices& slices) {
  KCPP_CHECK(rank >= 0 && rank < world, "save_optimizer_state: rank {} of a world of {}", rank, world);
  std::error_code ec;
  std::filesystem::create_directories(folder, ec);
  KCPP_CHECK(!ec, "save_optimizer_state: cannot create {}: {}", folder.string(), ec.message());
  // A file of an earlier save by another world size would be read back with these: remove them.
  if (rank == 0)
    for (const auto& e : std::filesystem::directory_iterator(folder))
      if (e.path().filename().string().starts_with("optimizer-rank") && e.path().extension() == ".safetensors" &&
          !e.path().filename().string().ends_with(fmt::format("-of-{}.safetensors", world)))
        std::filesystem::remove(e.path());
  std::map<std::string, std::string> meta{{"steps", std::to_string(opt.steps())}, {"format", "kcpp AdamW state"}};
  // A shard's pieces: each tensor holds elements [begin, begin + its numel) of its parameter's state.
  if (!slices.empty()) {
    nlohmann::json j = nlohmann::json::object();
    for (const auto& [name, s] : slices) j[name] = {s.begin, s.full};
    meta["slices"] = j.dump();
  }
  models::save_safetensors(folder / fmt::format("optimizer-rank{}-of-{}.safetensors", rank, world), opt.state_tensors(), meta);
}

namespace {

// One file of a save, with the slices its metadata names.
struct SavedState {
  models::SafetensorsFile file;
  StateSlices slices;
};

// Elements [begin, begin + count) of the state tensor `key` of a parameter of `full` elements, in
// f32 on `device`, assembled from the files' whole tensors and slices of it (overlaps, as every
// rank's copy of stage 0, are read once); undefined when no file has it.
Tensor read_state(const std::vector<SavedState>& saved, const std::string& key, int64_t begin, int64_t count, int64_t full,
                  Device device) {
  struct Part {
    int64_t begin, numel;
    const SavedState* from;
  };
  std::vector<Part> parts;
  const std::string param = param_of_key(key);
  for (const SavedState& s : saved) {
    if (!s.file.contains(key)) continue;
    const Tensor t = s.file.view(key);
    const auto it = s.slices.find(param);
    const StateSlice slice = it != s.slices.end() ? it->second : StateSlice{0, t.numel()};
    KCPP_CHECK(slice.full == full && slice.begin >= 0 && t.numel() <= full && slice.begin <= full - t.numel(),
               "AdamW: the saved '{}' is of a parameter of {} elements ({} from element {} in {}); this one has {}", key,
               slice.full, t.numel(), slice.begin, s.file.path().string(), full);
    parts.push_back({slice.begin, t.numel(), &s});
  }
  if (parts.empty()) return Tensor();
  std::stable_sort(parts.begin(), parts.end(), [](const Part& a, const Part& b) { return a.begin < b.begin; });
  const Tensor out = Tensor::empty({count}, DType::f32, device);
  int64_t at = begin;  // the first element not yet read
  const int64_t end = begin + count;
  for (const Part& p : parts) {
    if (at == end) break;
    if (p.begin + p.numel <= at) continue;
    KCPP_CHECK(p.begin <= at, "load_optimizer_state: no file holds elements [{}, {}) of '{}'", at, p.begin, key);
    const int64_t n = std::min(end, p.begin + p.numel) - at;
    out.narrow(0, at - begin, n).copy_(p.from->file.view(key).view({p.numel}).narrow(0, at - p.begin, n));
    at += n;
  }
  KCPP_CHECK(at == end, "load_optimizer_state: no file holds elements [{}, {}) of '{}'", at, end, key);
  return out;
}

}  // namespace

void load_optimizer_state(const std::filesystem::path& folder, AdamW& opt, const StateSlices& slices) {
  // The files of one save: optimizer-rank<r>-of-<world>.safetensors for one world and every r.
  std::map<int, std::map<int, std::filesystem::path>> by_world;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(folder, ec)) {
    int r = -1, w = -1;
    char tail = 0;
    const std::string name = e.path().filename().string();
    if (std::sscanf(name.c_str(), "optimizer-rank%d-of-%d.safetensor%c", &r, &w, &tail) == 3 && tail == 's' &&
        name == fmt::format("optimizer-rank{}-of-{}.safetensors", r, w) && r >= 0 && r < w)
      by_world[w][r] = e.path();
  }
  KCPP_CHECK(!by_world.empty(), "load_optimizer_state: no optimizer-rank<r>-of-<world>.safetensors in {} (saved by "
             "save_optimizer_state?)", folder.string());
  KCPP_CHECK(by_world.size() == 1, "load_optimizer_state: {} holds the files of saves by {} different numbers of ranks; "
             "keep those of one save", folder.string(), by_world.size());
  const auto& [world, ranks] = *by_world.begin();
  KCPP_CHECK(static_cast<int>(ranks.size()) == world, "load_optimizer_state: {} holds {} of the {} rank files of its save",
             folder.string(), ranks.size(), world);
  std::vector<SavedState> saved;
  for (const auto& [r, path] : ranks) {
    SavedState s{models::SafetensorsFile::open(path), {}};
    const auto it = s.file.metadata().find("slices");
    if (it != s.file.metadata().end()) {
      const auto j = nlohmann::json::parse(it->second, nullptr, /*allow_exceptions=*/false);
      KCPP_CHECK(j.is_object(), "load_optimizer_state: {} has unreadable slices in its metadata", path.string());
      for (const auto& [name, v] : j.items()) {
        KCPP_CHECK(v.is_array() && v.size() == 2 && v[0].is_number_integer() && v[1].is_number_integer(),
                   "load_optimizer_state: {}: the slice of '{}' is not [begin, elements]", path.string(), name);
        s.slices[name] = {v[0].get<int64_t>(), v[1].get<int64_t>()};
      }
    }
    saved.push_back(std::move(s));
  }
  int64_t steps = -1;
  for (const auto& s : saved) {
    const auto it = s.file.metadata().find("steps");
    KCPP_CHECK(it != s.file.metadata().end(), "load_optimizer_state: {} has no step count", folder.string());
    // A whole number of steps, nothing before or after it (std::stoll threw std::invalid_argument).
    const std::string& text = it->second;
    int64_t n = -1;
    const auto [end, err] = std::from_chars(text.data(), text.data() + text.size(), n);
    KCPP_CHECK(err == std::errc() && end == text.data() + text.size() && n >= 0,
               "load_optimizer_state: {}: the step count '{}' is not a whole number of steps (0 or more)",
               s.file.path().string(), text);
    KCPP_CHECK(steps < 0 || steps == n, "load_optimizer_state: the files in {} are of different steps ({} and {})",
               folder.string(), steps, n);
    steps = n;
  }
  std::map<std::string, Tensor> mine;  // the state tensors opt reads into, by name
  for (auto& [key, t] : opt.state_tensors()) mine.emplace(key, t);
  opt.load_state(
      [&](const std::string& key) {
        const auto it = mine.find(key);
        if (it == mine.end()) return Tensor();
        const auto s = slices.find(param_of_key(key));
        const StateSlice want = s != slices.end() ? s->second : StateSlice{0, it->second.numel()};
        const Tensor t = read_state(saved, key, want.begin, it->second.numel(), want.full, opt.device());
        return t.defined() ? t.view(it->second.shape()) : t;
      },
      steps);
}

void DataParallel::save_optimizer(const std::filesystem::path& folder) const {
  save_optimizer_state(folder, opt_, comm_.rank(), comm_.world_size(), slices());
}

void DataParallel::load_optimizer(const std::filesystem::path& folder) { load_optimizer_state(folder, opt_, slices()); }

namespace {

// A step that throws with collectives in flight on the side stream waits (on the device, not the
// host) for them before their buffers go back to the allocator.
struct JoinOnExit {
  SideStream& side;
  ~JoinOnExit() {
    try {
      side.join();
    } catch (const std::exception&) {  // the error under way is the one to report
    }
  }
};

}  // namespace

StepResult DataParallel::step(const std::vector<MicroBatch>& micro) {
  KCPP_CHECK(!micro.empty(), "data parallel: rank {} has no micro-batch (every rank takes a share of each step)", comm_.rank());
  int64_t mine = 0, rows = 0;
  for (const MicroBatch& m : micro) mine += models::CausalLM::labelled_tokens(m.labels), rows += m.input_ids.numel();
  // Before the gradients: every rank's labelled tokens (which scale every share's gradient), tokens
  // and micro-batches; then the shares' losses with, for each parameter, how many ranks have its
  // gradient (step_replicated, step_sharded).
  const int64_t world = comm_.world_size();
  // A deferred all-gather issued by a forward since the last step (not yet waited for by it all) ends
  // before the collectives below start on the current stream; one still due stays due.
  for (size_t g = 0; g < gather_marks_.size(); ++g) wait_gathered(g);
  const Tensor counts = Tensor::from_f64(std::vector<double>{static_cast<double>(mine), static_cast<double>(rows),
                                                             static_cast<double>(micro.size())},
                                         {3}, DType::f64, comm_.device());
  const Tensor all_counts = Tensor::empty({3 * world}, DType::f64, comm_.device());
  comm_.all_gather(all_counts, counts);
  const std::vector<double> v = all_counts.to_f64_vector();
  read_clock();  // the last step's points are behind the device now
  int64_t total = 0;
  rows_max_ = 0;
  for (int64_t r = 0; r < world; ++r) {
    total += static_cast<int64_t>(v[static_cast<size_t>(3 * r)]);
    rows_max_ = std::max(rows_max_, static_cast<int64_t>(v[static_cast<size_t>(3 * r + 1)]));
    // ZeRO-3: every forward and backward gathers each layer (collectives): the same number on every rank.
    KCPP_CHECK(options_.zero_stage < 3 || v[static_cast<size_t>(3 * r + 2)] == v[2],
               "data parallel: ZeRO-3 gathers the parameters in every micro-batch's forward and backward, so every rank "
               "needs the same number of micro-batches; rank 0 has {}, rank {} has {}", v[2], r, v[static_cast<size_t>(3 * r + 2)]);
  }
  KCPP_CHECK(total > 0, "data parallel: no labelled token in the step's batch on any of the {} ranks", world);
  ++stats_.steps;
  all_ids_.clear();
  if (sparse_embedding(rows_max_)) {
    ++stats_.sparse_embedding_steps;
    std::vector<double> ids;
    ids.reserve(static_cast<size_t>(rows_max_));
    for (const MicroBatch& m : micro)
      for (double id : m.input_ids.to_f64_vector()) ids.push_back(id);
    ids.resize(static_cast<size_t>(rows_max_), -1.0);  // the padding's rows are zeros, of no token
    const Tensor sent = Tensor::from_f64(ids, {rows_max_}, DType::f64, comm_.device());
    const Tensor gathered = Tensor::empty({world * rows_max_}, DType::f64, comm_.device());
    comm_.all_gather(gathered, sent);
    for (double id : gathered.to_f64_vector()) all_ids_.push_back(static_cast<int64_t>(id));
  }
  struct Flag {  // the model hands over its embedding's output gradient during this step only
    bool& flag;
    ~Flag() { flag = false; }
  };
  bool unused = false;
  Flag flag{causal_ ? causal_->sparse_embedding_gradient : unused};
  flag.flag = !all_ids_.empty();
  return options_.zero_stage == 0 ? step_replicated(micro, total) : step_sharded(micro, total);
}

bool DataParallel::sparse_embedding(int64_t rows_max) const {
  if (!causal_ || causal_->config().tie_word_embeddings || options_.embedding_gradient == EmbeddingGradient::Dense) return false;
  if (options_.embedding_gradient == EmbeddingGradient::Sparse) return true;
  // The bytes a rank receives either way (data_parallel.h); ids travel as f64.
  const Tensor& e = params_[embed_param_].second;
  const double w = static_cast<double>(comm_.world_size()), v = static_cast<double>(e.size(0)), h = static_cast<double>(e.size(1));
  const double sparse = (w - 1) * static_cast<double>(rows_max) * (h * static_cast<double>(e.element_size()) + 8);
  const double dense = (options_.zero_stage == 0 ? 2 : 1) * (w - 1) / w * v * h * static_cast<double>(dtype_size(reduce_dtype(e.dtype())));
  return sparse < dense;
}

Tensor DataParallel::sparse_embedding_rows(const std::vector<Tensor>& rows, int64_t lo, int64_t hi) {
  const Tensor& e = params_[embed_param_].second;
  const int64_t h = e.size(1), world = comm_.world_size();
  const DType dt = rows.empty() ? e.dtype() : rows[0].dtype();
  // This rank's rows in its micro-batches' order (that of its ids), then zeros up to the largest share.
  const Tensor send = Tensor::empty({rows_max_, h}, dt, comm_.device());
  int64_t at = 0;
  for (const Tensor& r : rows) {
    KCPP_CHECK(r.dim() == 2 && r.size(1) == h && at + r.size(0) <= rows_max_ && r.dtype() == dt,
               "data parallel: the embedding's output gradient has shape [{}] ({}), not rows of {} of its tokens",
               fmt::join(r.shape(), ", "), dtype_name(r.dtype()), h);
    send.narrow(0, at, r.size(0)).copy_(r);
    at += r.size(0);
  }
  if (at < rows_max_) send.narrow(0, at, rows_max_ - at).fill_(0);
  const Tensor all = Tensor::empty({world * rows_max_, h}, dt, comm_.device());
  // On the side stream, behind the buckets' sums (the same order of collectives on every rank).
  side_->run([&] { comm_.all_gather(all, send); });
  side_->join();
  // The rows of the tokens in [lo, hi), in rank order, then token order.
  std::vector<int64_t> pick, local;
  for (size_t j = 0; j < all_ids_.size(); ++j)
    if (all_ids_[j] >= lo && all_ids_[j] < hi) pick.push_back(static_cast<int64_t>(j)), local.push_back(all_ids_[j] - lo);
  if (pick.empty()) return Tensor::zeros({hi - lo, h}, dt, comm_.device());
  const int64_t n = static_cast<int64_t>(pick.size());
  const Tensor picked = n == all.size(0) ? all
                                         : ops::embedding(all, Tensor::from_i64(pick, {n}, DType::i64, comm_.device()),
                                                          /*check_ids=*/false);
  // local is in [0, hi - lo) by construction: no id check, so no wait for the device.
  return ops::embedding_backward(picked, Tensor::from_i64(local, {n}, DType::i64, comm_.device()), hi - lo,
                                 /*check_ids=*/false);
}

void DataParallel::read_clock() {
  StepClock& c = *clock_;
  if (c.marked(kBackwardDone) && c.marked(kReduced)) {
    ++stats_.timed;
    stats_.after_backward_ms += c.ms(kBackwardDone, kReduced);
    if (c.marked(kGatherBegins) && c.marked(kGathered)) stats_.parameter_gather_ms += c.ms(kGatherBegins, kGathered);
  }
  c.clear();
}

DType DataParallel::reduce_dtype(DType param) const {
  if (options_.reduce_dtype) return *options_.reduce_dtype;
  return param == DType::bf16 ? DType::bf16 : DType::f32;
}

DataParallel::CommStats DataParallel::comm_stats() {
  read_clock();
  return stats_;
}

void DataParallel::reduce_scatter_bucket(size_t bi, const std::map<std::string, Tensor>& grads, std::vector<Tensor>& keep) {
  Bucket& b = buckets_[bi];
  // [world * shard] in reduce_dtype: the parameters' gradients (zeros for one this rank has none
  // of), then zeros to the end.  Stage 1 packs into its kept buffer, stage 2 into one for this step.
  Tensor flat = b.flat.defined() ? b.flat : Tensor::empty({comm_.world_size() * b.shard}, b.grad.dtype(), comm_.device());
  for (size_t j = 0; j < b.params.size(); ++j) {
    const auto& [name, p] = params_[b.params[j]];
    const Tensor part = flat.narrow(0, b.offset[j], p.numel()).view(p.shape());
    const auto it = grads.find(name);
    if (it == grads.end()) {
      part.fill_(0);
    } else {
      KCPP_CHECK(it->second.numel() == p.numel(), "data parallel: the gradient of '{}' has {} elements, the parameter {}", name,
                 it->second.numel(), p.numel());
      part.copy_(it->second.shape() == p.shape() ? it->second : it->second.reshape(p.shape()));
    }
  }
  if (!b.flat.defined() && flat.numel() > b.numel) flat.narrow(0, b.numel, flat.numel() - b.numel).fill_(0);
  side_->run([&] { comm_.reduce_scatter(b.grad, flat, dist::ReduceOp::Sum); });
  if (!b.flat.defined()) keep.push_back(std::move(flat));  // until the side stream is joined
}

StepResult DataParallel::step_sharded(const std::vector<MicroBatch>& micro, int64_t total) {
  // Overlapped: the buckets in their order, each as soon as the backward has handed over all of its
  // parameters' gradients (every parameter has one: no MoE layers) and those before it are sent.
  const bool overlap = options_.overlap && (mamba_ || causal_->config().num_experts == 0);
  std::map<std::string, Tensor> grads;  // handed over and not yet packed
  // With the sparse embedding gradient, the embedding's bucket is not reduce-scattered: each rank
  // sums its shard from every rank's rows after the backward.
  const bool sparse = !all_ids_.empty();
  std::vector<size_t> waiting(buckets_.size());
  for (size_t bi = 0; bi < buckets_.size(); ++bi) waiting[bi] = sparse && bi == embed_bucket_ ? 0 : buckets_[bi].params.size();
  size_t next = 0;           // the next bucket to send
  std::vector<Tensor> keep;  // stage 2's flat buckets until the side stream is joined
  JoinOnExit joined{*side_};
  // Stage 3 prefetch: the step's order of uses (data_parallel.h), followed until it ends or deviates;
  // whatever is staged still when the step ends (by an error) is dropped.
  struct EndPlan {
    DataParallel* dp;
    ~EndPlan() {
      try {
        dp->end_plan();
      } catch (const std::exception&) {  // the error under way is the one to report
      }
    }
  } end_plan{this};
  if (options_.zero_stage == 3 && options_.overlap && options_.prefetch) {
    const size_t layers = groups_.size() - 2, head = groups_.size() - 1;
    plan_.clear();
    for (size_t m = 0; m < micro.size(); ++m) {
      plan_.push_back(0);
      for (size_t l = 0; l < layers; ++l) plan_.push_back(1 + l);
      plan_.push_back(head);
      for (size_t l = layers; l-- > 0;) plan_.push_back(1 + l);
    }
    planned_ = 0;
  }
  auto send = [&](size_t bi) {
    if (sparse && bi == embed_bucket_) return;
    // At most two flat buckets of stage 2 alive: the one before this one has had the backward of a
    // bucket's worth of layers to finish.
    if (!keep.empty()) {
      side_->join();
      keep.clear();
    }
    reduce_scatter_bucket(bi, grads, keep);
    for (size_t k : buckets_[bi].params) grads.erase(params_[k].first);
  };
  models::CausalLM::GradientReady ready;
  if (overlap)
    ready = [&](const std::string& name, const Tensor& g) {
      const auto it = index_of_.find(name);
      KCPP_CHECK(it != index_of_.end(), "data parallel: the backward handed over a gradient of '{}', not a parameter", name);
      grads.emplace(name, g);
      --waiting[bucket_of_[it->second]];
      while (next < buckets_.size() && waiting[next] == 0) send(next++);
    };
  Accumulated acc = causal_ ? accumulate_gradients(*causal_, micro, total, ready) : accumulate_gradients(*mamba_, micro, total, ready);
  clock_->mark(kBackwardDone);
  std::vector<double> info(params_.size() + 1);
  info[0] = acc.loss;
  for (size_t i = 0; i < params_.size(); ++i) info[i + 1] = acc.grads.count(params_[i].first) ? 1.0 : 0.0;
  if (sparse) info[embed_param_ + 1] = 1.0;
  // The rest of the buckets (all of them without overlap), from the backward's gradients.
  for (auto& [name, g] : acc.grads)
    if (next < buckets_.size() && bucket_of_[index_of_.at(name)] >= next) grads.emplace(name, g);
  acc.grads.clear();
  while (next < buckets_.size()) send(next++);
  grads.clear();
  if (sparse) {
    // This rank's shard of the embedding's bucket (the embedding alone, then padding), from the
    // rows of the tokens whose embedding rows it covers.
    Bucket& b = buckets_[embed_bucket_];
    const int64_t h = params_[embed_param_].second.size(1);
    const int64_t lo = std::min(b.numel, comm_.rank() * b.shard), hi = std::min(b.numel, lo + b.shard);
    const int64_t first = lo / h, last = (hi + h - 1) / h;  // the embedding rows elements [lo, hi) lie in
    const Tensor summed = sparse_embedding_rows(acc.embedding_rows, first, last);
    if (hi > lo) b.grad.narrow(0, 0, hi - lo).copy_(summed.view({summed.numel()}).narrow(0, lo - first * h, hi - lo));
    if (hi - lo < b.shard) b.grad.narrow(0, hi - lo, b.shard - (hi - lo)).fill_(0);
    acc.embedding_rows.clear();
  }
  side_->join();
  keep.clear();
  clock_->mark(kReduced);
  const Tensor shared = Tensor::from_f64(info, {static_cast<int64_t>(info.size())}, DType::f64, comm_.device());
  comm_.all_reduce(shared, dist::ReduceOp::Sum);
  const std::vector<double> summed = shared.to_f64_vector();

  // AdamW on this rank's pieces, with their sums in the parameter's dtype (as stage 0 and a single
  // process give AdamW the gradients); a parameter with a gradient on no rank is skipped.
  std::map<std::string, Tensor> shard_grads;
  for (const Piece& pc : pieces_) {
    const Tensor& p = params_[pc.param].second;
    if (summed[pc.param + 1] == 0) continue;
    const Tensor g = buckets_[pc.bucket].grad.narrow(0, pc.at, pc.length);
    shard_grads.emplace(params_[pc.param].first, g.dtype() == p.dtype() ? g : g.to(p.dtype()));
  }
  finish_gathers();  // the last step's deferred all-gather (waited for by this step's forward already)
  opt_.step(shard_grads, {}, [&](const Tensor& sq_norm) { comm_.all_reduce(sq_norm, dist::ReduceOp::Sum); });
  // Stages 1 and 2: every rank's updated shard into every rank's parameters (stage 3: the updated
  // shards are the parameters; the next forward gathers them).
  if (options_.zero_stage < 3) gather_updated();
  StepResult r;
  r.loss = summed[0];
  r.tokens = total;
  r.grad_norm = opt_.grad_norm();
  return r;
}

StepResult DataParallel::step_replicated(const std::vector<MicroBatch>& micro, int64_t total) {
  // Every share runs its forward and backward, labels or not (a share without labels adds nothing
  // to the loss of the tokens, but an MoE model's auxiliary loss still counts).  Overlapped: buckets
  // in the order the backward finishes parameters (the same on every rank), each summed on the side
  // stream once full, held until the stream is joined.
  const bool overlap = options_.overlap && (mamba_ || causal_->config().num_experts == 0);
  const size_t bucket_bytes = static_cast<size_t>(options_.bucket_mib * (1 << 20));
  std::vector<std::pair<std::vector<std::string>, Tensor>> in_flight;  // buckets summing on the side stream
  std::vector<std::string> filling;
  std::map<std::string, Tensor> whole;  // the gradients handed over (the result's tensors: summed in place)
  size_t filling_bytes = 0, handed = 0;
  JoinOnExit joined{*side_};
  // The buckets summed before the one about to be sent come back first: the current stream waits
  // for them (they had the backward of a bucket's worth of layers to finish) and at most two
  // buckets' buffers are alive at once.
  auto collect = [&] {
    if (in_flight.empty()) return;
    side_->join();
    for (const auto& [names, flat] : in_flight) unpack(names, flat, whole);
    in_flight.clear();
  };
  auto send = [&] {
    if (filling.empty()) return;
    collect();
    Tensor flat = pack(filling, whole);
    side_->run([&] { comm_.all_reduce(flat, dist::ReduceOp::Sum); });
    in_flight.emplace_back(std::move(filling), std::move(flat));
    filling.clear();
    filling_bytes = 0;
  };
  models::CausalLM::GradientReady ready;
  if (overlap)
    ready = [&](const std::string& name, const Tensor& g) {
      const DType sums = reduce_dtype(param_of_.at(name).dtype());
      if (!filling.empty() && sums != reduce_dtype(param_of_.at(filling.front()).dtype())) send();  // one dtype a bucket
      whole.emplace(name, g);
      filling.push_back(name);
      filling_bytes += static_cast<size_t>(g.numel()) * dtype_size(sums);
      // Full, or the step's last gradient (every parameter has one: no MoE layers).
      if (filling_bytes >= bucket_bytes || ++handed == params_.size()) send();
    };
  Accumulated acc = causal_ ? accumulate_gradients(*causal_, micro, total, ready) : accumulate_gradients(*mamba_, micro, total, ready);
  clock_->mark(kBackwardDone);
  if (overlap) {
    send();
    collect();
    for (const auto& [name, g] : whole)  // a gradient unpacked as a new tensor (another dtype)
      if (acc.grads.at(name).data() != g.data()) acc.grads.at(name) = g;
  }
  const bool sparse = !all_ids_.empty();
  if (sparse) {  // every rank's rows summed into the whole embedding's gradient
    const Tensor& e = params_[embed_param_].second;
    acc.grads[kEmbedding] = sparse_embedding_rows(acc.embedding_rows, 0, e.size(0)).to(e.dtype());
    acc.embedding_rows.clear();
  }
  std::vector<double> info(params_.size() + 1);
  info[0] = acc.loss;
  for (size_t i = 0; i < params_.size(); ++i) info[i + 1] = acc.grads.count(params_[i].first) ? 1.0 : 0.0;
  const Tensor shared = Tensor::from_f64(info, {static_cast<int64_t>(info.size())}, DType::f64, comm_.device());
  comm_.all_reduce(shared, dist::ReduceOp::Sum);
  const std::vector<double> summed = shared.to_f64_vector();
  std::vector<char> anywhere(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) anywhere[i] = summed[i + 1] > 0;
  if (!overlap) reduce_gradients(acc.grads, anywhere, sparse ? embed_param_ : params_.size());
  clock_->mark(kReduced);

  opt_.step(acc.grads);
  StepResult r;
  r.loss = summed[0];
  r.tokens = total;
  r.grad_norm = opt_.grad_norm();
  return r;
}

}  // namespace kcpp::train
