// Deterministic column sums of a [rows, h] f32 matrix (rows of stride `row_stride` floats): the
// second step of a weight gradient that persistent blocks first summed into one workspace row each
// (RMSNorm's and LayerNorm's dw, db).  Bitwise reproducible: every column is added in a fixed order
// that depends only on `rows`, never on scheduling, and no atomics.
//
//   out[c] = sum_{g = 0}^{G - 1} ( sum_{b = g, g + G, g + 2G, ... < rows} part[b, c] )   G = kColumnSumGroups
//
// in the accumulator type Acc (float, or double where the caller wants the order's rounding out of
// the result), rounded once to T.  A block is 32 columns x G row groups: each warp reads 128
// contiguous bytes a row, G warps walk the rows in parallel with several loads in flight each (the
// sum is bound by load latency, not bandwidth: a few MB), and the G partial sums meet in shared
// memory.  It replaced one thread a column over all rows (16 blocks at h = 4096), which took 16 us of
// RMSNorm's 80 us backward on an H200 (bench/RESULTS.md).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "kcpp/kernel/cuda.cuh"

namespace kcpp::kernel::cuda {

constexpr int kColumnSumGroups = 32;
constexpr int kColumnSumUnroll = 8;  // rows a thread has in flight at once

// Columns [0, h) go to out, [h, 2h) to out2 where it is given (two sums of the same rows, e.g.
// LayerNorm's dw and db, in one launch).
template <typename T, typename Acc>
__global__ void __launch_bounds__(32 * kColumnSumGroups) column_sums_kernel(const float* part, int rows, int64_t row_stride,
                                                                            int64_t h, T* out, T* out2) {
  const int64_t cols = out2 ? 2 * h : h;
  griddep_wait();  // launched as a dependent of the kernel that wrote `part` (see column_sums)
  __shared__ Acc partial[kColumnSumGroups][33];
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  const int g = static_cast<int>(threadIdx.y);
  Acc s = 0;
  if (c < cols) {
    // Rows g, g + G, ...: kColumnSumUnroll loads issued together, then added in row order (the
    // order is the same for every launch: it depends on rows only).
    constexpr int kStep = kColumnSumGroups * kColumnSumUnroll;
    int b = g;
    for (; b + (kColumnSumUnroll - 1) * kColumnSumGroups < rows; b += kStep) {
      float v[kColumnSumUnroll];
#pragma unroll
      for (int u = 0; u < kColumnSumUnroll; ++u) v[u] = part[int64_t(b + u * kColumnSumGroups) * row_stride + c];
#pragma unroll
      for (int u = 0; u < kColumnSumUnroll; ++u) s += v[u];
    }
    for (; b < rows; b += kColumnSumGroups) s += part[int64_t(b) * row_stride + c];
  }
  partial[g][threadIdx.x] = s;
  __syncthreads();
  if (g == 0 && c < cols) {
    Acc t = partial[0][threadIdx.x];
#pragma unroll
    for (int k = 1; k < kColumnSumGroups; ++k) t += partial[k][threadIdx.x];
    if (c < h) out[c] = from_f32<T>(static_cast<float>(t));
    else out2[c - h] = from_f32<T>(static_cast<float>(t));
  }
}

// The step before, for persistent blocks launched in thread-block clusters (sm_90): each block of a
// cluster has put its n partial sums in its own shared memory at `stage`; block r adds the cluster's
// values of its 1 / C of the n columns, read through distributed shared memory in rank order
// (deterministic), and writes them to `out_row`, the cluster's row of the workspace.  The workspace,
// and what column_sums reads back, shrink C-fold (at [8192, 4096] on an H200 the 264 blocks of the
// LayerNorm backward wrote 8.6 MB of partial sums; bench/RESULTS.md).  Every thread of every block
// of the cluster calls it; n % 4 == 0, `stage` and `out_row` 16-byte aligned.
template <typename Cluster>
__device__ __forceinline__ void cluster_column_sums(float* stage, int64_t n, float* out_row, const Cluster& cluster) {
  cluster.sync();  // every block's sums staged and visible to the cluster
  const int csize = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
  // Each rank's share: n / C rounded up, then up to a multiple of 4 (float4s); the last may be shorter.
  const int64_t per = ((n + csize - 1) / csize + 3) / 4 * 4, lo = rank * per, hi = n < lo + per ? n : lo + per;
  for (int64_t c = lo + 4 * int64_t(threadIdx.x); c < hi; c += 4 * int64_t(blockDim.x)) {
    float4 acc = *reinterpret_cast<const float4*>(cluster.map_shared_rank(stage + c, 0));
    for (int q = 1; q < csize; ++q) {
      const float4 v = *reinterpret_cast<const float4*>(cluster.map_shared_rank(stage + c, q));
      acc.x += v.x, acc.y += v.y, acc.z += v.z, acc.w += v.w;
    }
    *reinterpret_cast<float4*>(out_row + c) = acc;
  }
  cluster.sync();  // no block leaves (its shared memory with it) while a peer may still read it
}

// ---- Host side of those persistent kernels.

// Blocks a cluster where the caller does not say (RMSNorm's and LayerNorm's bulk backwards): at
// [8192, 4096] bf16 on an H200 (bench/RESULTS.md) clusters of 2, 4 and 8 were level, LayerNorm's
// backward 0.0783 ms without clusters and 0.0640 / 0.0638 / 0.0636 ms with them.
constexpr int kPartialSumCluster = 4;

// A persistent launch: `blocks` blocks in clusters of `cluster` (1: none); its blocks (clusters)
// write partial_rows() rows of partial sums.
struct PersistentGrid {
  int blocks = 1, cluster = 1;
  int partial_rows() const { return blocks / cluster; }
};

inline cudaLaunchConfig_t persistent_config(const PersistentGrid& grid, int threads, size_t smem, cudaLaunchAttribute* attr,
                                            cudaStream_t stream) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(grid.blocks));
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  if (grid.cluster > 1) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = static_cast<unsigned>(grid.cluster);
    attr[0].val.clusterDim.y = attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  return cfg;
}

// As many blocks of `kernel` as can be resident (at most `blocks_per_sm` an SM where > 0, at most
// `rows`), in clusters of `cluster` (1, 2, 4 or 8; 1: none) where there are at least two clusters'
// worth and the device can hold them.  The occupancy queries cost host time on every launch and
// their answers never change: they are kept per (kernel, threads, smem, device, cluster), so the
// workspace size and the launch always agree.
template <typename Kernel>
PersistentGrid persistent_grid(Kernel kernel, int threads, size_t smem, int device, int64_t rows, int blocks_per_sm, int cluster) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, size_t, int, int>, int> cache;
  auto cached = [&](int c, auto&& query) {  // 0 where the query failed
    const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), threads, smem, device, c);
    {
      std::lock_guard lock(mu);
      if (auto it = cache.find(key); it != cache.end()) return it->second;
    }
    const int v = query();
    if (v == 0) (void)cudaGetLastError();
    std::lock_guard lock(mu);
    return cache[key] = v;
  };
  int per_sm = std::max(1, cached(0, [&] {
    int n = 0;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) == cudaSuccess ? n : 0;
  }));
  if (blocks_per_sm > 0) per_sm = std::min(per_sm, blocks_per_sm);
  PersistentGrid grid{static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(rows, int64_t(sm_count(device)) * per_sm))), 1};
  if (cluster > 1 && grid.blocks >= 2 * cluster) {
    const int clusters = cached(cluster, [&] {
      cudaLaunchAttribute attr[1];
      const cudaLaunchConfig_t cfg = persistent_config(PersistentGrid{grid.blocks / cluster * cluster, cluster}, threads, smem, attr, nullptr);
      int n = 0;
      return cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) == cudaSuccess ? n : 0;
    });
    if (clusters > 0) grid = PersistentGrid{std::min(grid.blocks / cluster, clusters) * cluster, cluster};  // else no clusters
  }
  return grid;
}

// Enqueues kernel<<<grid>>>(args...), as a cluster launch where grid.cluster > 1; errors are left
// for the caller's check.
template <typename... Params, typename... Args>
void launch_persistent(void (*kernel)(Params...), const PersistentGrid& grid, int threads, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  if (grid.cluster > 1) {
    cudaLaunchAttribute attr[1];
    const cudaLaunchConfig_t cfg = persistent_config(grid, threads, smem, attr, stream);
    (void)cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  } else {
    kernel<<<grid.blocks, threads, smem, stream>>>(std::forward<Args>(args)...);
  }
}

// Enqueues out[0, h) = column sums of part (see above), and out2[0, h) = those of columns [h, 2h)
// where out2 is given; launch errors are left for the caller's check.  On sm_90 it is launched as a
// programmatic dependent of the kernel before it in the stream (which wrote `part`): its blocks start
// while that kernel's last blocks finish, instead of after a launch gap (the kernel before may call
// griddep_launch_dependents once its rows are done).
template <typename T, typename Acc = float>
void column_sums(const float* part, int rows, int64_t row_stride, int64_t h, T* out, cudaStream_t stream, T* out2 = nullptr) {
  const int64_t blocks = ((out2 ? 2 * h : h) + 31) / 32;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(std::max<int64_t>(1, blocks)));
  cfg.blockDim = dim3(32, kColumnSumGroups);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  int device = 0;
  if (cudaGetDevice(&device) == cudaSuccess && device_attribute(cudaDevAttrComputeCapabilityMajor, device) >= 9) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  (void)cudaLaunchKernelEx(&cfg, column_sums_kernel<T, Acc>, part, rows, row_stride, h, out, out2);
}

}  // namespace kcpp::kernel::cuda
