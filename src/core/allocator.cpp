#include "core/allocator.h"

#include <atomic>
#include <bit>
#include <cstring>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/cuda_runtime.h"
#include "core/error.h"

namespace kcpp {

namespace {
std::atomic<bool> g_poison{false};
}
void set_allocator_poison(bool on) { g_poison = on; }
bool allocator_poison() { return g_poison; }

size_t allocator_round_size(size_t n) {
  if (n == 0) return 0;
  constexpr size_t kSmall = 512, kMiB = size_t{1} << 20;
  if (n <= kMiB) return (n + kSmall - 1) / kSmall * kSmall;
  const size_t step = std::bit_floor(n) / 8;  // n in [2^k, 2^(k+1)): step 2^(k-3) <= n / 8
  return (n + step - 1) / step * step;
}

std::string format_bytes(size_t n) {
  if (n >= (size_t{1} << 30)) return fmt::format("{:.2f} GiB", n / double(1 << 30));
  if (n >= (size_t{1} << 20)) return fmt::format("{:.1f} MiB", n / double(1 << 20));
  if (n >= 1024) return fmt::format("{:.1f} KiB", n / 1024.0);
  return fmt::format("{} B", n);
}

namespace {

// Raw memory for one device: no caching, no accounting.
struct Backend {
  virtual ~Backend() = default;
  virtual void* alloc(size_t n) = 0;  // nullptr on failure
  virtual void free(void* p) = 0;
  virtual void poison(void* p, size_t n) = 0;
};

struct HostBackend final : Backend {
  void* alloc(size_t n) override { return std::aligned_alloc(64, (n + 63) / 64 * 64); }
  void free(void* p) override { std::free(p); }
  void poison(void* p, size_t n) override { std::memset(p, 0xff, n); }
};

class CachingAllocator final : public Allocator {
 public:
  CachingAllocator(Device d, std::unique_ptr<Backend> b) : device_(d), backend_(std::move(b)) {}

  void* allocate(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    const size_t size = allocator_round_size(nbytes);
    std::lock_guard lock(mu_);
    void* p = nullptr;
    // The private pool in use serves the thread that set it; other threads keep the common cache.
    const uint64_t pool = active_pool_ && std::this_thread::get_id() == pool_thread_ ? active_pool_ : 0;
    auto& free = pool ? pools_.at(pool) : free_;
    if (auto it = free.find(size); it != free.end() && !it->second.empty()) {
      p = it->second.back();
      it->second.pop_back();
    } else {
      p = backend_->alloc(size);
      if (!p && !pool) {  // release what we hold and try once more (not while capturing: no cudaFree then)
        release_cached_locked();
        p = backend_->alloc(size);
      }
      if (!p)
        throw OutOfMemory(fmt::format("{}: out of memory allocating {} (in use {}, peak {})", device_.str(),
                                      format_bytes(nbytes), format_bytes(stats_.current),
                                      format_bytes(stats_.peak)));
      stats_.backend_allocations++;
      held_ += size;
    }
    if (g_poison) backend_->poison(p, size);
    live_.emplace(p, Block{size, pool});
    stats_.current += size;
    stats_.peak = std::max(stats_.peak, stats_.current);
    stats_.allocations++;
    return p;
  }

  void deallocate(void* p) override {
    if (!p) return;
    std::lock_guard lock(mu_);
    auto it = live_.find(p);
    if (it == live_.end()) return;  // not ours; never free what we did not allocate
    const Block b = it->second;
    live_.erase(it);
    stats_.current -= b.size;
    auto pool = b.pool ? pools_.find(b.pool) : pools_.end();
    (pool != pools_.end() ? pool->second : free_)[b.size].push_back(p);
  }

  uint64_t create_pool() override {
    std::lock_guard lock(mu_);
    const uint64_t id = ++last_pool_;
    pools_[id];
    return id;
  }

  void use_pool(uint64_t id) override {
    std::lock_guard lock(mu_);
    KCPP_CHECK(id == 0 || pools_.count(id), "allocator of {}: memory pool {} does not exist", device_.str(), id);
    active_pool_ = id;
    pool_thread_ = std::this_thread::get_id();
  }

  uint64_t pool_in_use() const override {
    std::lock_guard lock(mu_);
    return active_pool_;
  }

  void release_pool(uint64_t id) override {
    std::lock_guard lock(mu_);
    auto pool = pools_.find(id);
    if (pool == pools_.end()) return;
    for (auto& [size, blocks] : pool->second) free_[size].insert(free_[size].end(), blocks.begin(), blocks.end());
    pools_.erase(pool);
    if (active_pool_ == id) active_pool_ = 0;
  }

  MemoryStats stats() const override {
    std::lock_guard lock(mu_);
    MemoryStats s = stats_;
    s.reserved = held_;
    return s;
  }

  void reset_peak() override {
    std::lock_guard lock(mu_);
    stats_.peak = stats_.current;
  }

  void empty_cache() override {
    std::lock_guard lock(mu_);
    release_cached_locked();
  }

  Device device() const override { return device_; }

 private:
  // The common cache only: a private pool's free blocks stay its own.
  void release_cached_locked() {
    for (auto& [size, blocks] : free_) {
      for (void* p : blocks) backend_->free(p);
      held_ -= size * blocks.size();
    }
    free_.clear();
  }

  struct Block {
    size_t size;
    uint64_t pool;  // 0: the common cache
  };
  using FreeLists = std::map<size_t, std::vector<void*>>;

  const Device device_;
  std::unique_ptr<Backend> backend_;
  mutable std::mutex mu_;
  std::unordered_map<void*, Block> live_;
  FreeLists free_;
  std::map<uint64_t, FreeLists> pools_;
  uint64_t active_pool_ = 0, last_pool_ = 0;
  std::thread::id pool_thread_;  // the thread active_pool_ serves
  size_t held_ = 0;  // live + cached bytes from the backend
  MemoryStats stats_;
};

#if KCPP_WITH_CUDA
struct CudaBackend final : Backend {
  explicit CudaBackend(int dev) : dev_(dev) {}
  void* alloc(size_t n) override {
    cuda::DeviceGuard g(dev_);
    void* p = nullptr;
    if (cudaMalloc(&p, n) != cudaSuccess) {
      (void)cudaGetLastError();  // out-of-memory is not sticky; clear it so later checks stay clean
      return nullptr;
    }
    return p;
  }
  void free(void* p) override {
    cuda::DeviceGuard g(dev_);
    (void)cudaFree(p);
  }
  void poison(void* p, size_t n) override {
    cuda::DeviceGuard g(dev_);
    KCPP_CUDA_CHECK(cudaMemsetAsync(p, 0xff, n, cuda::current_stream()));
  }
  int dev_;
};
#endif

}  // namespace

Allocator& allocator_for(Device d) {
  static std::mutex mu;
  // Leaked on purpose: tensors in static storage may be freed after main() returns.
  static auto* host = new CachingAllocator(Device::cpu(), std::make_unique<HostBackend>());
  if (d.is_cpu()) return *host;
#if KCPP_WITH_CUDA
  static auto* cuda_allocs = new std::vector<std::unique_ptr<CachingAllocator>>();
  std::lock_guard lock(mu);
  const int n = cuda_device_count();
  KCPP_CHECK(d.index >= 0 && d.index < n, "device {} does not exist ({} CUDA device(s) visible)", d.str(), n);
  if (cuda_allocs->empty()) cuda_allocs->resize(n);
  auto& a = (*cuda_allocs)[d.index];
  if (!a) a = std::make_unique<CachingAllocator>(d, std::make_unique<CudaBackend>(d.index));
  return *a;
#else
  (void)mu;
  KCPP_FAIL("device {}: this build of kernels.cpp has no CUDA support (configure with nvcc present)", d.str());
#endif
}

Allocator& PrivatePool::allocator_for_pool(Device d) { return allocator_for(d); }

PoolScope::PoolScope(const PrivatePool& p) : device_(p.device()), previous_(allocator_for(device_).pool_in_use()) {
  allocator_for(device_).use_pool(p.id());
}
PoolScope::~PoolScope() {
  try {
    allocator_for(device_).use_pool(previous_);
  } catch (const Error&) {  // the previous pool was released meanwhile
    allocator_for(device_).use_pool(0);
  }
}

}  // namespace kcpp
