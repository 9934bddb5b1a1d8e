// Bulk row loads for persistent row kernels (sm_90): the copy engine brings whole rows from global
// into shared memory (cp.async.bulk), each load completing the phase of an mbarrier that counts its
// bytes.  A kernel keeps a ring of `stages` slots: while it computes the row in slot s, the loads of
// the next stages - 1 rows are in flight, and no thread holds registers for them.
//
// Usage, in one block (see packages/liger/rms_norm/rms_norm_cuda.cu):
//   __shared__ uint64_t full[kMaxStages];
//   if (threadIdx.x == 0) bulk_init(full, stages);
//   __syncthreads();
//   thread 0, for slot s:   bulk_expect(&full[s], bytes); bulk_load(dst, src, bytes, &full[s]) ...
//   every thread, item it:  bulk_wait(&full[ring.slot], ring.parity); read the slot; ring.advance(stages)
//   once every thread has read slot s (a __syncthreads), thread 0 may refill it.
// Loads need 16-byte aligned source and destination and a byte count that is a multiple of 16.
// The helpers compile to nothing below sm_90; hosts pick these kernels on sm_90 only.
#pragma once

#include <cuda/ptx>

#include <cstdint>

namespace kcpp::kernel::cuda {

// Thread 0: one arrival per phase (the thread that calls bulk_expect), then a __syncthreads.
__device__ __forceinline__ void bulk_init(uint64_t* bars, int n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  for (int s = 0; s < n; ++s) ::cuda::ptx::mbarrier_init(&bars[s], 1);
  // The copy engine (async proxy) must see the initialized barriers.
  ::cuda::ptx::fence_mbarrier_init(::cuda::ptx::sem_release, ::cuda::ptx::scope_cluster);
#endif
}

// Arms the barrier's current phase for `bytes` to arrive (the sum of the loads that complete it).
__device__ __forceinline__ void bulk_expect(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  ::cuda::ptx::mbarrier_arrive_expect_tx(::cuda::ptx::sem_release, ::cuda::ptx::scope_cta, ::cuda::ptx::space_shared, bar, bytes);
#endif
}

__device__ __forceinline__ void bulk_load(void* smem_dst, const void* global_src, uint32_t bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  ::cuda::ptx::cp_async_bulk(::cuda::ptx::space_cluster, ::cuda::ptx::space_global, smem_dst, global_src, bytes, bar);
#endif
}

// Where a block is in its ring: the current item's slot (it % stages) and that slot's phase parity
// ((it / stages) & 1), advanced with a compare rather than a 64-bit division a row.
struct RingCursor {
  int slot = 0;
  uint32_t parity = 0;
  __device__ __forceinline__ void advance(int stages) {
    if (++slot == stages) slot = 0, parity ^= 1u;
  }
};

__device__ __forceinline__ void bulk_wait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  while (!::cuda::ptx::mbarrier_try_wait_parity(bar, parity)) {
  }
#endif
}

}  // namespace kcpp::kernel::cuda
