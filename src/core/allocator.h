// Caching allocators, one per device, with the byte counts every benchmark quotes.
//
// Design: a block is never split.  A request is rounded up (to 512 B below 1 MiB; above that to one
// eighth of the power of two below it, so at most 12.5% is lost) and served from a free list of blocks
// of exactly that size, else from the backend (64-byte aligned host memory or cudaMalloc).  When
// the backend fails, the cache is emptied and the request retried once before OutOfMemory is thrown.
// `current` counts the rounded size of live blocks (as PyTorch's memory_allocated does); `peak` is
// its maximum since the last reset_peak(); `reserved` adds the cached free blocks.
//
// CUDA blocks are used on the device's current stream only (core/cuda_runtime.h); a block freed
// while a kernel on another stream still reads it would need stream tracking, which this does not do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/device.h"

namespace kcpp {

struct MemoryStats {
  size_t current = 0;           // bytes in live blocks
  size_t peak = 0;              // max of `current` since the last reset_peak()
  size_t reserved = 0;          // bytes held from the backend: live + cached
  uint64_t allocations = 0;     // allocate() calls that returned memory
  uint64_t backend_allocations = 0;  // of those, how many reached malloc / cudaMalloc
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  // Returns nbytes of memory (nullptr for 0 bytes); throws OutOfMemory naming the device and sizes.
  virtual void* allocate(size_t nbytes) = 0;
  // Returns a block from allocate() to the cache.  nullptr is ignored.
  virtual void deallocate(void* p) = 0;
  virtual MemoryStats stats() const = 0;
  virtual void reset_peak() = 0;
  // Returns every cached free block to the backend.
  virtual void empty_cache() = 0;
  virtual Device device() const = 0;

  // Private pools, for CUDA graphs: while pool `id` is in use (use_pool(id); 0 = none), the
  // allocations of the thread that set it come from that pool's free blocks or the backend (other
  // threads keep the common cache), and every block it handed out returns to it when freed, whenever
  // that is.  An allocation that fails in a pool does not empty the cache (no cudaFree while a
  // graph is being captured): it throws OutOfMemory.  So memory a captured graph reads and writes is never handed to
  // anything else while the graph lives.  release_pool(id) gives the pool's free blocks to the
  // common cache (its live blocks follow when freed).  The host allocator has no pools (ids are 0).
  virtual uint64_t create_pool() { return 0; }
  virtual void use_pool(uint64_t id) { (void)id; }
  virtual uint64_t pool_in_use() const { return 0; }
  virtual void release_pool(uint64_t id) { (void)id; }
};

// A private pool of a device's allocator, in use for the lifetime of a PoolScope, released at
// destruction.  Create it before the capture; keep it as long as the graph.
class PrivatePool {
 public:
  explicit PrivatePool(Device d) : device_(d), id_(allocator_for_pool(d).create_pool()) {}
  ~PrivatePool() { allocator_for_pool(device_).release_pool(id_); }
  PrivatePool(const PrivatePool&) = delete;
  PrivatePool& operator=(const PrivatePool&) = delete;
  uint64_t id() const { return id_; }
  Device device() const { return device_; }

 private:
  static Allocator& allocator_for_pool(Device d);
  Device device_;
  uint64_t id_;
};

// Puts a pool in use for its lifetime, then the one in use before.
class PoolScope {
 public:
  explicit PoolScope(const PrivatePool& p);
  ~PoolScope();
  PoolScope(const PoolScope&) = delete;
  PoolScope& operator=(const PoolScope&) = delete;

 private:
  Device device_;
  uint64_t previous_;
};

// The process-wide allocator of a device (created on first use, never destroyed, so tensors that
// outlive static destruction still free safely).  Throws for a CUDA device that does not exist.
Allocator& allocator_for(Device d);

inline MemoryStats memory_stats(Device d) { return allocator_for(d).stats(); }
inline void reset_peak(Device d) { allocator_for(d).reset_peak(); }
inline void empty_cache(Device d) { allocator_for(d).empty_cache(); }

// When on, every block handed out is first filled with 0xFF bytes (NaN in every floating dtype), so
// an op that leaves an output element unwritten is caught by tests instead of reading stale data
// from a reused block.  Off by default; the test runner turns it on.
void set_allocator_poison(bool on);
bool allocator_poison();

// The rounding rule above, exposed for tests.
size_t allocator_round_size(size_t nbytes);

std::string format_bytes(size_t n);

}  // namespace kcpp
