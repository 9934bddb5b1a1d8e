#include "train/data_parallel.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <numeric>

#include "core/cuda_runtime.h"
#include "core/error.h"
#include "models/safetensors.h"
#include "ops/ops.h"

namespace kcpp::train {
namespace {

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

std::vector<std::pair<std::string, Tensor>> owned(const std::vector<std::pair<std::string, Tensor>>& params,
                                                  const std::map<std::string, int>& owner, int rank) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [name, p] : params)
    if (owner.at(name) == rank) out.emplace_back(name, p);
  return out;
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

 private:
#if KCPP_WITH_CUDA
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t event_ = nullptr;
#endif
};

DataParallel::~DataParallel() = default;

std::map<std::string, int> DataParallel::assign_owners(const std::vector<std::pair<std::string, Tensor>>& params, int world) {
  // Largest first, each to the rank holding the fewest elements so far (ties: the lower rank);
  // deterministic, so every rank computes the same assignment.
  std::vector<size_t> order(params.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return params[a].second.numel() > params[b].second.numel(); });
  std::vector<int64_t> load(static_cast<size_t>(world), 0);
  std::map<std::string, int> owner;
  for (size_t i : order) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    load[static_cast<size_t>(r)] += params[i].second.numel();
    owner[params[i].first] = r;
  }
  return owner;
}

DataParallel::DataParallel(models::CausalLM& model, dist::Communicator& comm, AdamWOptions adamw, DataParallelOptions o)
    : model_(model),
      comm_(comm),
      options_(o),
      params_(model.parameters()),
      param_of_(params_.begin(), params_.end()),
      owner_([&] {
        KCPP_CHECK(o.zero_stage == 0 || o.zero_stage == 1, "data parallel: ZeRO stage {} is not supported (0 or 1)", o.zero_stage);
        KCPP_CHECK(o.bucket_mib > 0, "data parallel: bucket_mib is {}; it must be positive", o.bucket_mib);
        KCPP_CHECK(o.reduce_dtype == DType::f32 || o.reduce_dtype == DType::f64 || o.reduce_dtype == DType::bf16 ||
                       o.reduce_dtype == DType::f16,
                   "data parallel: reduce_dtype {} is not a floating dtype", dtype_name(o.reduce_dtype));
        // Every replica starts as rank 0's, before AdamW takes its f32 master copies of them.
        for (const auto& [name, p] : params_)
          KCPP_CHECK(p.device() == comm.device(), "data parallel: parameter '{}' is on {} but the communicator is on {}",
                     name, p.device().str(), comm.device().str());
        {
          Group group(comm);
          for (const auto& [name, p] : params_) comm.broadcast(p, 0);
        }
        if (o.zero_stage == 0) {
          std::map<std::string, int> all;
          for (const auto& [name, p] : params_) all[name] = comm.rank();
          return all;
        }
        return assign_owners(params_, comm.world_size());
      }()),
      opt_(owned(params_, owner_, comm.rank()), adamw),
      side_(std::make_unique<SideStream>(comm)) {}

Tensor DataParallel::pack(const std::vector<std::string>& names, const std::map<std::string, Tensor>& grads) const {
  std::vector<Tensor> parts;
  for (const std::string& n : names) parts.push_back(grads.at(n).contiguous().view({grads.at(n).numel()}).to(options_.reduce_dtype));
  Tensor flat = parts.size() == 1 ? parts[0].contiguous() : ops::cat(parts, 0);
  if (parts.size() == 1 && flat.data() == grads.at(names[0]).data()) flat = flat.clone();  // never reduce in place of a view
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

void DataParallel::reduce_gradients(std::map<std::string, Tensor>& grads, const std::vector<char>& anywhere) {
  const size_t bucket_bytes = static_cast<size_t>(options_.bucket_mib * (1 << 20));
  const size_t es = dtype_size(options_.reduce_dtype);
  std::vector<std::string> bucket;
  size_t bytes = 0;
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
    if (!anywhere[i]) {
      grads.erase(name);
      continue;
    }
    auto it = grads.find(name);
    if (it == grads.end()) it = grads.emplace(name, Tensor::zeros(p.shape(), p.dtype(), p.device())).first;
    bucket.push_back(name);
    bytes += static_cast<size_t>(p.numel()) * es;
    if (bytes >= bucket_bytes) flush();
  }
  flush();
}

void save_optimizer_state(const std::filesystem::path& folder, const AdamW& opt, int rank, int world) {
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
  models::save_safetensors(folder / fmt::format("optimizer-rank{}-of-{}.safetensors", rank, world), opt.state_tensors(),
                           {{"steps", std::to_string(opt.steps())}, {"format", "kcpp AdamW state"}});
}

void load_optimizer_state(const std::filesystem::path& folder, AdamW& opt) {
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
  std::vector<models::SafetensorsFile> files;
  for (const auto& [r, path] : ranks) files.push_back(models::SafetensorsFile::open(path));
  int64_t steps = -1;
  for (const auto& f : files) {
    const auto it = f.metadata().find("steps");
    KCPP_CHECK(it != f.metadata().end(), "load_optimizer_state: {} has no step count", folder.string());
    const int64_t s = std::stoll(it->second);
    KCPP_CHECK(steps < 0 || steps == s, "load_optimizer_state: the files in {} are of different steps ({} and {})",
               folder.string(), steps, s);
    steps = s;
  }
  opt.load_state(
      [&](const std::string& name) {
        for (const auto& f : files)
          if (f.contains(name)) return f.load(name, DType::f32, opt.device());
        return Tensor();
      },
      steps);
}

void DataParallel::save_optimizer(const std::filesystem::path& folder) const {
  save_optimizer_state(folder, opt_, comm_.rank(), comm_.world_size());
}

void DataParallel::load_optimizer(const std::filesystem::path& folder) { load_optimizer_state(folder, opt_); }

StepResult DataParallel::step(const std::vector<MicroBatch>& micro) {
  KCPP_CHECK(!micro.empty(), "data parallel: rank {} has no micro-batch (every rank takes a share of each step)", comm_.rank());
  int64_t mine = 0;
  for (const MicroBatch& m : micro) mine += models::CausalLM::labelled_tokens(m.labels);
  // Two all-reduces before the gradients': the step's labelled tokens (which scale every share's
  // gradient), then the shares' losses with, for each parameter, how many ranks have its gradient.
  const Tensor count = Tensor::from_f64(std::vector<double>{static_cast<double>(mine)}, {1}, DType::f64, comm_.device());
  comm_.all_reduce(count, dist::ReduceOp::Sum);
  const int64_t total = static_cast<int64_t>(count.item());
  KCPP_CHECK(total > 0, "data parallel: no labelled token in the step's batch on any of the {} ranks", comm_.world_size());
  // Every share runs its forward and backward, labels or not (a share without labels adds nothing
  // to the loss of the tokens, but an MoE model's auxiliary loss still counts).  Overlapped: buckets
  // in the order the backward finishes parameters (the same on every rank), each summed on the side
  // stream once full, held until the stream is joined.
  const bool overlap = options_.overlap && model_.config().num_experts == 0;
  const size_t bucket_bytes = static_cast<size_t>(options_.bucket_mib * (1 << 20));
  std::vector<std::pair<std::vector<std::string>, Tensor>> in_flight;  // buckets summing on the side stream
  std::vector<std::string> filling;
  std::map<std::string, Tensor> whole;  // the gradients handed over (the result's tensors: summed in place)
  size_t filling_bytes = 0, handed = 0;
  // A step that throws with buckets in flight waits (on the device, not the host) for them before
  // their buffers go back to the allocator.
  struct JoinOnExit {
    SideStream& side;
    ~JoinOnExit() {
      try {
        side.join();
      } catch (const std::exception&) {  // the error under way is the one to report
      }
    }
  } joined{*side_};
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
      whole.emplace(name, g);
      filling.push_back(name);
      filling_bytes += static_cast<size_t>(g.numel()) * dtype_size(options_.reduce_dtype);
      // Full, or the step's last gradient (every parameter has one: no MoE layers).
      if (filling_bytes >= bucket_bytes || ++handed == params_.size()) send();
    };
  Accumulated acc = accumulate_gradients(model_, micro, total, ready);
  if (overlap) {
    send();
    collect();
    for (const auto& [name, g] : whole)  // a gradient unpacked as a new tensor (another dtype)
      if (acc.grads.at(name).data() != g.data()) acc.grads.at(name) = g;
  }
  std::vector<double> info(params_.size() + 1);
  info[0] = acc.loss;
  for (size_t i = 0; i < params_.size(); ++i) info[i + 1] = acc.grads.count(params_[i].first) ? 1.0 : 0.0;
  const Tensor shared = Tensor::from_f64(info, {static_cast<int64_t>(info.size())}, DType::f64, comm_.device());
  comm_.all_reduce(shared, dist::ReduceOp::Sum);
  const std::vector<double> summed = shared.to_f64_vector();
  std::vector<char> anywhere(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) anywhere[i] = summed[i + 1] > 0;
  if (!overlap) reduce_gradients(acc.grads, anywhere);

  std::map<std::string, Tensor> mine_grads;
  std::vector<Tensor> others;
  for (auto& [name, g] : acc.grads) {
    if (owner_.at(name) == comm_.rank()) mine_grads.emplace(name, g);
    else others.push_back(g);
  }
  opt_.step(mine_grads, others);
  if (options_.zero_stage == 1) {  // each owner's updated parameters to every rank
    Group group(comm_);
    for (const auto& [name, p] : params_) comm_.broadcast(p, owner_.at(name));
  }
  StepResult r;
  r.loss = summed[0];
  r.tokens = total;
  r.grad_norm = opt_.grad_norm();
  return r;
}

}  // namespace kcpp::train
