#include "dist/communicator.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string_view>

#include "core/cuda_runtime.h"
#include "core/error.h"
#include "ops/ops.h"

// NCCL's header comes with NCCL (CUDA's packages, or PyTorch's nvidia-nccl wheel), not with every
// CUDA toolkit: without it this build has no NCCL backend.
#if KCPP_WITH_CUDA && __has_include(<nccl.h>)
#include <nccl.h>
#define KCPP_NCCL 1
#else
#define KCPP_NCCL 0
#endif

namespace kcpp::dist {
namespace {

Tensor flat(const Tensor& t) { return t.view({t.numel()}); }

void check_arg(const Tensor& t, Device dev, const char* op, const char* arg) {
  KCPP_CHECK(t.defined(), "{}: argument '{}' is an undefined tensor", op, arg);
  KCPP_CHECK(t.device() == dev, "{}: argument '{}' is on {}; this communicator's device is {}", op, arg, t.device().str(),
             dev.str());
  KCPP_CHECK(t.is_contiguous(), "{}: argument '{}' must be contiguous", op, arg);
}

// The arguments of reduce_scatter (in: world x out) and all_gather (out: world x in), for every backend.
void check_scatter(const Tensor& out, const Tensor& in, int world, Device dev) {
  check_arg(out, dev, "reduce_scatter", "out");
  check_arg(in, dev, "reduce_scatter", "in");
  KCPP_CHECK(in.numel() == out.numel() * world && in.dtype() == out.dtype(),
             "reduce_scatter: 'in' must hold world ({}) x 'out' ({} elements) of its dtype; got {} elements of {}", world,
             out.numel(), in.numel(), dtype_name(in.dtype()));
}
void check_gather(const Tensor& out, const Tensor& in, int world, Device dev) {
  check_arg(out, dev, "all_gather", "out");
  check_arg(in, dev, "all_gather", "in");
  KCPP_CHECK(out.numel() == in.numel() * world && in.dtype() == out.dtype(),
             "all_gather: 'out' must hold world ({}) x 'in' ({} elements) of its dtype; got {} elements of {}", world,
             in.numel(), out.numel(), dtype_name(out.dtype()));
}

// ---- ranks as threads of one process ---------------------------------------------------------------

// The ranks' meeting point: a barrier that a failing rank breaks, so that the others get its error
// instead of waiting for it for ever (after that the group refuses every collective).
struct LocalShared {
  explicit LocalShared(int w) : world(w), slots(static_cast<size_t>(w)), ops(static_cast<size_t>(w)) {}
  int world;
  std::vector<const Tensor*> slots;  // each rank's argument of the collective under way
  std::vector<const char*> ops;      // and the collective it called

  void arrive_and_wait() {
    std::unique_lock lock(mu_);
    if (!broken_.empty()) KCPP_FAIL("{}", broken_);
    const uint64_t generation = generation_;
    if (++arrived_ == world) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != generation || !broken_.empty(); });
    if (generation_ == generation) KCPP_FAIL("{}", broken_);
  }
  void break_with(std::string why) {
    std::lock_guard lock(mu_);
    if (broken_.empty()) broken_ = std::move(why);
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  std::string broken_;  // why the group is broken; empty while it works
};

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(std::shared_ptr<LocalShared> s, int rank) : s_(std::move(s)), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return s_->world; }
  Device device() const override { return Device::cpu(); }
  std::string backend() const override { return "local"; }

  void all_reduce(const Tensor& t, ReduceOp op) override {
    guarded("all_reduce", [&] {
      check_arg(t, device(), "all_reduce", "t");
      post("all_reduce", t);
      same_as_rank0("all_reduce");
      const Tensor r = reduce(0, t.numel(), op);
      s_->arrive_and_wait();  // every rank has read every argument
      flat(t).copy_(r);
    });
  }

  void reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op) override {
    guarded("reduce_scatter", [&] {
      check_scatter(out, in, s_->world, device());
      post("reduce_scatter", in);
      same_as_rank0("reduce_scatter");
      const Tensor r = reduce(rank_ * out.numel(), out.numel(), op);
      s_->arrive_and_wait();
      flat(out).copy_(r);
    });
  }

  void all_gather(const Tensor& out, const Tensor& in) override {
    guarded("all_gather", [&] {
      check_gather(out, in, s_->world, device());
      post("all_gather", in);
      same_as_rank0("all_gather");
      const int64_t n = in.numel();
      for (int i = 0; i < s_->world; ++i) flat(out).narrow(0, i * n, n).copy_(flat(*s_->slots[static_cast<size_t>(i)]));
      s_->arrive_and_wait();
    });
  }

  void broadcast(const Tensor& t, int root) override {
    guarded("broadcast", [&] {
      check_arg(t, device(), "broadcast", "t");
      KCPP_CHECK(root >= 0 && root < s_->world, "broadcast: root {} is not a rank of this group of {}", root, s_->world);
      post("broadcast", t);
      same_as_rank0("broadcast");
      if (rank_ != root) t.copy_(*s_->slots[static_cast<size_t>(root)]);
      s_->arrive_and_wait();
    });
  }

 private:
  // Runs a collective; a rank that fails breaks the group, so that the others fail with its error.
  template <class F> void guarded(const char* op, F&& body) {
    try {
      body();
    } catch (const std::exception& e) {
      s_->break_with(fmt::format("{}: rank {} of the local group failed, so the group is broken: {}", op, rank_, e.what()));
      throw;
    }
  }
  void post(const char* op, const Tensor& t) {
    s_->slots[static_cast<size_t>(rank_)] = &t;
    s_->ops[static_cast<size_t>(rank_)] = op;
    s_->arrive_and_wait();  // every rank's argument is posted (and the previous collective done)
  }
  // Every rank compares every rank's collective and argument with rank 0's, so all of them throw
  // together; only after all have read the arguments (a rank's throw ends the life of its argument).
  void same_as_rank0(const char* op) const {
    const Tensor& a = *s_->slots[0];
    std::string problem;
    for (int i = 1; i < s_->world && problem.empty(); ++i) {
      const Tensor& b = *s_->slots[static_cast<size_t>(i)];
      if (std::string_view(s_->ops[static_cast<size_t>(i)]) != s_->ops[0])
        problem = fmt::format("{}: rank {} called {} but rank 0 called {}; every rank must call the same collectives in "
                              "the same order", op, i, s_->ops[static_cast<size_t>(i)], s_->ops[0]);
      else if (b.shape() != a.shape() || b.dtype() != a.dtype())
        problem = fmt::format("{}: rank {} passed {} {} but rank 0 passed {} {}; every rank must pass the same shape and dtype",
                              op, i, dtype_name(b.dtype()), shape_str(b.shape()), dtype_name(a.dtype()), shape_str(a.shape()));
    }
    if (problem.empty()) return;
    s_->arrive_and_wait();
    KCPP_FAIL("{}", problem);
  }
  // Elements [from, from + n) of every rank's argument reduced in rank order, in f64, rounded once.
  Tensor reduce(int64_t from, int64_t n, ReduceOp op) const {
    Tensor acc;
    for (int i = 0; i < s_->world; ++i) {
      const Tensor x = flat(*s_->slots[static_cast<size_t>(i)]).narrow(0, from, n).to(DType::f64);
      acc = i == 0 ? x.clone() : ops::add(acc, x);
    }
    if (op == ReduceOp::Avg) acc = ops::scale(acc, 1.0 / s_->world);
    return acc.to(s_->slots[0]->dtype());
  }

  std::shared_ptr<LocalShared> s_;
  int rank_;
};

int env_int(const char* name, int fallback, int lo) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  KCPP_CHECK(*end == '\0' && x >= lo && x <= 1 << 20, "{} is '{}'; expected an integer from {}", name, v, lo);
  return static_cast<int>(x);
}

// ---- NCCL --------------------------------------------------------------------------------------------

#if KCPP_NCCL
struct Nccl {
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclReduceScatter) reduce_scatter = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  decltype(&ncclBroadcast) broadcast = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  decltype(&ncclCommAbort) comm_abort = nullptr;
  decltype(&ncclGetVersion) get_version = nullptr;
  std::string why;  // empty when loaded
};

const Nccl& nccl() {
  static const Nccl n = [] {
    Nccl r;
    void* h = ::dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = ::dlerror();
      r.why = fmt::format("libnccl.so.2 could not be loaded ({}); put NCCL's library directory on LD_LIBRARY_PATH "
                          "(CUDA's, or PyTorch's site-packages/nvidia/nccl/lib)", e ? e : "not found");
      return r;
    }
    auto load = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(h, name));
      if (!fn && r.why.empty()) r.why = fmt::format("libnccl.so.2 has no {} (NCCL 2.10 or later is needed)", name);
    };
    load(r.get_unique_id, "ncclGetUniqueId");
    load(r.comm_init_rank, "ncclCommInitRank");
    load(r.comm_destroy, "ncclCommDestroy");
    load(r.all_reduce, "ncclAllReduce");
    load(r.reduce_scatter, "ncclReduceScatter");
    load(r.all_gather, "ncclAllGather");
    load(r.broadcast, "ncclBroadcast");
    load(r.group_start, "ncclGroupStart");
    load(r.group_end, "ncclGroupEnd");
    load(r.error_string, "ncclGetErrorString");
    load(r.comm_abort, "ncclCommAbort");
    load(r.get_version, "ncclGetVersion");
    int version = 0;
    if (r.why.empty() && (r.get_version(&version) != ncclSuccess || version < 21000))
      r.why = fmt::format("libnccl.so.2 is NCCL {}; 2.10 or later is needed (bf16 sums and ncclAvg)", version);
    return r;
  }();
  return n;
}

void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) KCPP_FAIL("NCCL {} failed: {}", what, nccl().error_string ? nccl().error_string(r) : "?");
}

ncclDataType_t nccl_dtype(DType t, const char* op) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
    case DType::f64: return ncclFloat64;
    case DType::i64: return ncclInt64;
    case DType::i32: return ncclInt32;
    default: KCPP_FAIL("{}: dtype {} has no NCCL type", op, dtype_name(t));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::Sum ? ncclSum : ncclAvg; }

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const LaunchInfo& who, const ncclUniqueId& id, Device dev) : who_(who), dev_(dev) {
    cuda::DeviceGuard g(dev.index);
    nccl_check(nccl().comm_init_rank(&comm_, who.world_size, id, who.rank), "ncclCommInitRank");
  }
  // Destroying flushes what was queued, which waits for the peers; while an exception unwinds (a
  // rank that gave up mid-step) the peers may never come, so the communicator is aborted instead.
  ~NcclCommunicator() override {
    if (!comm_) return;
    if (std::uncaught_exceptions() > 0) (void)nccl().comm_abort(comm_);
    else (void)nccl().comm_destroy(comm_);
  }
  int rank() const override { return who_.rank; }
  int world_size() const override { return who_.world_size; }
  Device device() const override { return dev_; }
  std::string backend() const override { return "nccl"; }

  void all_reduce(const Tensor& t, ReduceOp op) override {
    check_arg(t, dev_, "all_reduce", "t");
    cuda::DeviceGuard g(dev_.index);
    nccl_check(nccl().all_reduce(t.data(), t.data(), static_cast<size_t>(t.numel()), nccl_dtype(t.dtype(), "all_reduce"),
                                 nccl_op(op), comm_, cuda::current_stream()),
               "all_reduce");
  }
  void reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op) override {
    check_scatter(out, in, who_.world_size, dev_);
    cuda::DeviceGuard g(dev_.index);
    nccl_check(nccl().reduce_scatter(in.data(), out.data(), static_cast<size_t>(out.numel()),
                                     nccl_dtype(in.dtype(), "reduce_scatter"), nccl_op(op), comm_, cuda::current_stream()),
               "reduce_scatter");
  }
  void all_gather(const Tensor& out, const Tensor& in) override {
    check_gather(out, in, who_.world_size, dev_);
    cuda::DeviceGuard g(dev_.index);
    nccl_check(nccl().all_gather(in.data(), out.data(), static_cast<size_t>(in.numel()), nccl_dtype(in.dtype(), "all_gather"),
                                 comm_, cuda::current_stream()),
               "all_gather");
  }
  void broadcast(const Tensor& t, int root) override {
    check_arg(t, dev_, "broadcast", "t");
    KCPP_CHECK(root >= 0 && root < who_.world_size, "broadcast: root {} is not a rank of this group of {}", root,
               who_.world_size);
    cuda::DeviceGuard g(dev_.index);
    nccl_check(nccl().broadcast(t.data(), t.data(), static_cast<size_t>(t.numel()), nccl_dtype(t.dtype(), "broadcast"), root,
                                comm_, cuda::current_stream()),
               "broadcast");
  }
  void begin_group() override { nccl_check(nccl().group_start(), "ncclGroupStart"); }
  void end_group() override { nccl_check(nccl().group_end(), "ncclGroupEnd"); }

 private:
  LaunchInfo who_;
  Device dev_;
  ncclComm_t comm_ = nullptr;
};
#endif

}  // namespace

std::vector<std::unique_ptr<Communicator>> local_group(int world) {
  KCPP_CHECK(world >= 1, "local_group: world size {}; it must be at least 1", world);
  auto shared = std::make_shared<LocalShared>(world);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < world; ++r) out.push_back(std::make_unique<LocalCommunicator>(shared, r));
  return out;
}

std::optional<LaunchInfo> launch_info_from_env() {
  const char* rank = std::getenv("RANK");
  if (!rank || !*rank) return std::nullopt;
  LaunchInfo w;
  w.rank = env_int("RANK", 0, 0);
  w.world_size = env_int("WORLD_SIZE", 1, 1);
  w.local_rank = env_int("LOCAL_RANK", w.rank, 0);
  KCPP_CHECK(w.rank < w.world_size, "RANK is {} but WORLD_SIZE is {}; ranks go from 0 to WORLD_SIZE - 1", w.rank, w.world_size);
  return w;
}

#if KCPP_NCCL
bool nccl_available(std::string* why) {
  if (why) *why = nccl().why;
  return nccl().why.empty();
}

std::string nccl_unique_id() {
  std::string why;
  KCPP_CHECK(nccl_available(&why), "NCCL: {}", why);
  ncclUniqueId id;
  nccl_check(nccl().get_unique_id(&id), "ncclGetUniqueId");
  std::string hex;
  for (char c : id.internal) hex += fmt::format("{:02x}", static_cast<unsigned char>(c));
  return hex;
}

std::unique_ptr<Communicator> nccl_communicator(const LaunchInfo& who, const std::string& unique_id, Device device) {
  std::string why;
  KCPP_CHECK(nccl_available(&why), "NCCL: {}", why);
  KCPP_CHECK(device.is_cuda(), "NCCL: a communicator needs a CUDA device, got {}", device.str());
  KCPP_CHECK(unique_id.size() == 2 * NCCL_UNIQUE_ID_BYTES, "NCCL: the group id must be {} hex digits (nccl_unique_id), got {}",
             2 * NCCL_UNIQUE_ID_BYTES, unique_id.size());
  ncclUniqueId id;
  for (size_t i = 0; i < NCCL_UNIQUE_ID_BYTES; ++i) {
    const std::string byte = unique_id.substr(2 * i, 2);
    KCPP_CHECK(byte.find_first_not_of("0123456789abcdefABCDEF") == std::string::npos, "NCCL: the group id is not hex ('{}')",
               byte);
    id.internal[i] = static_cast<char>(std::stoi(byte, nullptr, 16));
  }
  return std::make_unique<NcclCommunicator>(who, id, device);
}
#else
namespace {
constexpr const char* kNoNccl = KCPP_WITH_CUDA ? "this build of kernels.cpp found no nccl.h (install NCCL's headers and rebuild)"
                                               : "this build of kernels.cpp has no CUDA support";
}
bool nccl_available(std::string* why) {
  if (why) *why = kNoNccl;
  return false;
}
std::string nccl_unique_id() { KCPP_FAIL("NCCL: {}", kNoNccl); }
std::unique_ptr<Communicator> nccl_communicator(const LaunchInfo&, const std::string&, Device) {
  KCPP_FAIL("NCCL: {}", kNoNccl);
}
#endif

}  // namespace kcpp::dist
