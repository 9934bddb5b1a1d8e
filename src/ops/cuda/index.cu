// Reference gathers and scatters.  Indices are checked on the device; a bad one is reported
// through DataCheck (which synchronizes: the host waits for the stream to drain) and the op throws
// instead of reading out of bounds.  embedding and embedding_backward can skip the check (and the
// wait) for ids known to be good; a bad id then never reads or writes out of bounds either.
#include <cub/device/device_radix_sort.cuh>
#include <algorithm>
#include <cstdint>
#include <optional>

#include "ops/cuda/common.cuh"
#include "ops/cuda/launch.h"

namespace kcpp::ops::cuda {
namespace {

using kcpp::cuda::load_as_f64;
using kcpp::cuda::load_as_i64;
using kcpp::cuda::store_f64;
using kcpp::kernel::cuda::from_f32;
using kcpp::kernel::cuda::to_f32;

// One block per id: copies row ids[i] of w [V, H] (elements of `es` bytes, as 16-bit words or bytes).
__global__ void embedding_kernel(char* out, const char* w, const void* ids, DType id_t, int64_t n, int64_t v,
                                 int64_t row_bytes, unsigned long long* flag) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t id = load_as_i64(ids, id_t, i);
    if (id < 0 || id >= v) {
      if (flag) {
        if (threadIdx.x == 0) report_bad(flag, i, id);
      } else {  // unchecked: the row is all-ones bits (NaN), never a read out of bounds
        for (int64_t j = threadIdx.x; j < row_bytes; j += blockDim.x) out[i * row_bytes + j] = static_cast<char>(0xff);
      }
      continue;
    }
    const char* src = w + id * row_bytes;
    char* dst = out + i * row_bytes;
    if (row_bytes % 4 == 0) {
      for (int64_t j = threadIdx.x; j < row_bytes / 4; j += blockDim.x)
        reinterpret_cast<uint32_t*>(dst)[j] = reinterpret_cast<const uint32_t*>(src)[j];
    } else {
      for (int64_t j = threadIdx.x; j < row_bytes; j += blockDim.x) dst[j] = src[j];
    }
  }
}

// The embedding's backward without atomics.  The token positions are sorted by id (CUB's stable
// radix sort, so each run of equal ids lists its positions in increasing order); out-of-range ids
// are reported (when checked) and sorted last under the key v, which no output row has.  The
// sorted rows are cut into tiles of 16, 32 or 64 rows (chosen from n and h alone), and one block
// per (tile, column chunk) sums each run's rows of its tile in position order (f32, kEmbUnroll
// rows loaded ahead of the adds).  A run that lies in one tile is written to its output row there.
// A run that crosses a tile edge leaves each tile's f32 sum in a workspace (slot 0: the tile's
// first run, slot 1: its last), and embedding_spans_kernel adds those sums in a fixed order:
// kEmbGroups contiguous groups of tiles, each summed in tile order, then the groups' sums in group
// order.  Every sum's order depends only on the ids and the shape, never on timing or the device:
// the same inputs give the same bits.  Rows of ids no token has are left to the caller's zero fill.
constexpr int kEmbTile = 64;     // the most sorted rows a block sums
constexpr int kEmbUnroll = 8;    // gradient rows loaded before they are added
constexpr int kEmbThreads = 128; // threads of a tile block (fewer for narrow rows)
constexpr int kEmbGroups = 8;    // warps of a span block, each summing a contiguous group of tiles
// Tile blocks resident at once, as the tile choice assumes: an H100 / H200 (132 SMs) holds 4 of
// 128 threads an SM at the bf16 tiles kernel's 100 registers (sm_90a; f16 and f32: 68-69, 7 an SM).
// Four blocks keep 64 KiB of loads in flight an SM, several times what the memory's bandwidth x
// latency needs.
constexpr int64_t kEmbSlots = 132 * 4;

__global__ void embedding_keys_kernel(const void* ids, DType id_t, int64_t n, int64_t v, uint32_t* keys, int32_t* pos,
                                      unsigned long long* flag) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t id = load_as_i64(ids, id_t, i);
    const bool ok = id >= 0 && id < v;
    if (!ok && flag) report_bad(flag, i, id);
    keys[i] = static_cast<uint32_t>(ok ? id : v);
    pos[i] = static_cast<int32_t>(i);
  }
}

// V consecutive elements, loaded and stored as one access (16 bytes when V * sizeof(T) is).
template <typename T, int V> struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// Block (tile t, column chunk y); thread x owns columns [c0, c0 + V).  part: [2 * tiles, h] f32.
template <typename T, int V>
__global__ void __launch_bounds__(kEmbThreads) embedding_tiles_kernel(T* out, float* part, const T* g, const uint32_t* keys,
                                                                      const int32_t* pos, int64_t n, uint32_t v, int64_t h, int tile) {
  __shared__ uint32_t sk[kEmbTile];
  __shared__ int32_t sp[kEmbTile];
  const int64_t t = blockIdx.x, b = t * tile;
  const int rows = static_cast<int>(min(n - b, static_cast<int64_t>(tile)));
  for (int r = threadIdx.x; r < rows; r += blockDim.x) sk[r] = keys[b + r], sp[r] = pos[b + r];
  __syncthreads();
  const int64_t c0 = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * V;
  if (c0 >= h) return;  // h % V == 0 when V > 1: a thread's columns are all in the row or all past it
  const bool open_left = b > 0 && keys[b - 1] == sk[0];             // the first run began in an earlier tile
  const bool open_right = b + rows < n && keys[b + rows] == sk[rows - 1];  // the last run goes on
  float acc[V];
#pragma unroll
  for (int k = 0; k < V; ++k) acc[k] = 0.0f;
  int start = 0;  // the current run's first row in the tile
  auto flush = [&](int end) {
    const bool first = start == 0, last = end == rows;
    if ((first && open_left) || (last && open_right)) {
      float* dst = part + (2 * t + (first ? 0 : 1)) * h + c0;
#pragma unroll
      for (int k = 0; k < V; ++k) dst[k] = acc[k];
    } else if (sk[start] < v) {
      Pack<T, V> o;
#pragma unroll
      for (int k = 0; k < V; ++k) o.v[k] = from_f32<T>(acc[k]);
      *reinterpret_cast<Pack<T, V>*>(out + static_cast<int64_t>(sk[start]) * h + c0) = o;
    }
  };
  for (int j0 = 0; j0 < rows; j0 += kEmbUnroll) {
    Pack<T, V> x[kEmbUnroll];
#pragma unroll
    for (int u = 0; u < kEmbUnroll; ++u)
      if (j0 + u < rows) x[u] = *reinterpret_cast<const Pack<T, V>*>(g + static_cast<int64_t>(sp[j0 + u]) * h + c0);
#pragma unroll
    for (int u = 0; u < kEmbUnroll; ++u) {
      const int j = j0 + u;
      if (j >= rows) break;
      if (j > start && sk[j] != sk[j - 1]) {
        flush(j);
        start = j;
#pragma unroll
        for (int k = 0; k < V; ++k) acc[k] = 0.0f;
      }
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] += to_f32(x[u].v[k]);
    }
  }
  flush(rows);
}

// Block (tile t, column chunk y): if the last run of tile t begins in it and goes on into later
// tiles, adds that run's tile sums (slot s of tile t, slot 0 of the tiles after it) and writes its
// row.  Warp w sums the w-th of kEmbGroups contiguous groups of those tiles in tile order; warp 0
// then adds the groups' sums in group order.  Lane l owns columns [c0, c0 + V).
template <typename T, int V>
__global__ void __launch_bounds__(32 * kEmbGroups) embedding_spans_kernel(T* out, const float* part, const uint32_t* keys,
                                                                          int64_t n, uint32_t v, int64_t h, int tile) {
  __shared__ float sums[kEmbGroups][32 * V];
  const int64_t t = blockIdx.x, b = t * tile, e = min(n, b + tile);
  if (e >= n) return;
  const uint32_t id = keys[e - 1];
  if (id >= v || keys[e] != id || (b > 0 && keys[b - 1] == id)) return;
  int64_t lo = e, hi = n;  // the run's end: the first sorted row with a larger key
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (keys[mid] <= id) lo = mid + 1;
    else hi = mid;
  }
  const int64_t count = (lo - 1) / tile - t + 1;  // tiles holding part of the run
  const int slot = keys[b] == id ? 0 : 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.y) * 32 + lane) * V;
  const int64_t per = (count + kEmbGroups - 1) / kEmbGroups;
  const int64_t q0 = min(count, warp * per), q1 = min(count, q0 + per);
  float acc[V];
#pragma unroll
  for (int k = 0; k < V; ++k) acc[k] = 0.0f;
  if (c0 < h) {
    for (int64_t q = q0; q < q1; q += kEmbUnroll) {
      float x[kEmbUnroll][V];
#pragma unroll
      for (int u = 0; u < kEmbUnroll; ++u)
        if (q + u < q1) {
          const float* src = part + (2 * (t + q + u) + (q + u == 0 ? slot : 0)) * h + c0;
          if constexpr (V == 4) {
            const float4 f = *reinterpret_cast<const float4*>(src);
            x[u][0] = f.x, x[u][1] = f.y, x[u][2] = f.z, x[u][3] = f.w;
          } else {
#pragma unroll
            for (int k = 0; k < V; ++k) x[u][k] = src[k];
          }
        }
#pragma unroll
      for (int u = 0; u < kEmbUnroll; ++u)
        if (q + u < q1) {
#pragma unroll
          for (int k = 0; k < V; ++k) acc[k] += x[u][k];
        }
    }
  }
#pragma unroll
  for (int k = 0; k < V; ++k) sums[warp][lane * V + k] = acc[k];
  __syncthreads();
  if (warp != 0 || c0 >= h) return;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    float s = sums[0][lane * V + k];
    for (int w = 1; w < kEmbGroups; ++w) s += sums[w][lane * V + k];
    out[static_cast<int64_t>(id) * h + c0 + k] = from_f32<T>(s);
  }
}

__global__ void gather_kernel(void* out, const void* x, DType t, const void* idx, DType id_t, int64_t n, int64_t v,
                              int64_t ignore, unsigned long long* flag) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = load_as_i64(idx, id_t, i);
    double val = 0.0;
    if (c != ignore) {
      if (c < 0 || c >= v) report_bad(flag, i, c);
      else val = load_as_f64(x, t, i * v + c);
    }
    store_f64(out, t, i, val);
  }
}

__global__ void scatter_kernel(void* out, const void* values, DType t, const void* idx, DType id_t, int64_t n,
                               int64_t v, int64_t ignore, unsigned long long* flag) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = load_as_i64(idx, id_t, i);
    if (c == ignore) continue;
    if (c < 0 || c >= v) report_bad(flag, i, c);
    else store_f64(out, t, i * v + c, load_as_f64(values, t, i));
  }
}

__global__ void valid_kernel(void* out, DType t, const void* idx, DType id_t, int64_t n, int64_t ignore) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store_f64(out, t, i, load_as_i64(idx, id_t, i) != ignore ? 1.0 : 0.0);
}

}  // namespace

void embedding(const Tensor& out, const Tensor& weight, const Tensor& ids, bool check_ids) {
  const int64_t n = ids.numel();
  if (n == 0) return;
  kcpp::cuda::DeviceGuard g(out.device().index);
  std::optional<DataCheck> check;
  if (check_ids) check.emplace(out.device());
  const int64_t row_bytes = weight.size(1) * static_cast<int64_t>(weight.element_size());
  embedding_kernel<<<kcpp::cuda::grid_for(n, 1, 65535 * 16), 128, 0, kcpp::cuda::current_stream()>>>(
      static_cast<char*>(out.data()), static_cast<const char*>(weight.data()), ids.data(), ids.dtype(), n,
      weight.size(0), row_bytes, check ? check->ptr() : nullptr);
  KCPP_CUDA_CHECK_LAUNCH("embedding");
  if (check) check->check("embedding", "ids", weight.size(0));
}

void embedding_backward(const Tensor& out, const Tensor& grad, const Tensor& ids, bool check_ids) {
  const int64_t n = ids.numel();
  if (n == 0) return;
  const int64_t v = out.size(0), h = out.size(1);
  KCPP_CHECK(n <= INT32_MAX, "op embedding_backward: {} ids; at most 2^31 - 1 are supported on CUDA", n);
  KCPP_CHECK(v < INT32_MAX, "op embedding_backward: num_embeddings {}; at most 2^31 - 2 are supported on CUDA", v);
  kcpp::cuda::DeviceGuard dg(out.device().index);
  const Device dev = out.device();
  const cudaStream_t stream = kcpp::cuda::current_stream();
  Tensor keys = Tensor::empty({n}, DType::i32, dev), keys_sorted = Tensor::empty({n}, DType::i32, dev);
  Tensor pos = Tensor::empty({n}, DType::i32, dev), pos_sorted = Tensor::empty({n}, DType::i32, dev);
  std::optional<DataCheck> check;
  if (check_ids) check.emplace(dev);
  embedding_keys_kernel<<<kcpp::cuda::grid_for(n, 256, 4096), 256, 0, stream>>>(
      ids.data(), ids.dtype(), n, v, static_cast<uint32_t*>(keys.data()), static_cast<int32_t*>(pos.data()),
      check ? check->ptr() : nullptr);
  KCPP_CUDA_CHECK_LAUNCH("embedding_backward keys");
  if (h > 0) {
    int bits = 1;  // the keys are at most v (the bad ids' key)
    while (bits < 32 && (uint64_t{1} << bits) <= static_cast<uint64_t>(v)) ++bits;
    const auto* k_in = static_cast<const uint32_t*>(keys.data());
    auto* k_out = static_cast<uint32_t*>(keys_sorted.data());
    const auto* p_in = static_cast<const int32_t*>(pos.data());
    auto* p_out = static_cast<int32_t*>(pos_sorted.data());
    size_t temp_bytes = 0;
    KCPP_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, k_in, k_out, p_in, p_out, static_cast<int>(n), 0,
                                                    bits, stream));
    const Tensor temp = Tensor::empty({static_cast<int64_t>(std::max<size_t>(temp_bytes, 1))}, DType::u8, dev);
    KCPP_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data(), temp_bytes, k_in, k_out, p_in, p_out, static_cast<int>(n), 0,
                                                    bits, stream));
    visit_cuda_float(out.dtype(), "embedding_backward", [&]<typename T>(std::type_identity<T>) {
      int64_t tiles = 1;
      int tile = kEmbTile;
      Tensor part;
      auto launch = [&]<int V>(std::integral_constant<int, V>) {
        const int64_t packs = (h + V - 1) / V;
        const int threads = static_cast<int>(std::min<int64_t>(kEmbThreads, (packs + 31) / 32 * 32));
        const int64_t chunks = (packs + threads - 1) / threads;
        KCPP_CHECK(chunks <= 65535, "op embedding_backward: hidden size {} is too large for CUDA (at most {}); run the embedding on the CPU", h,
                   int64_t{65535} * kEmbThreads * V);
        // The tile: a block's time grows with its rows (plus up to two f32 partial rows written), and the
        // grid runs in waves of kEmbSlots blocks; the tile with the fewest (waves x block time) wins, so
        // a grid just over one wave is split finer.  It depends on n and h only: the same inputs give
        // the same bits on every device.
        int64_t best = -1;
        for (int l : {kEmbTile, kEmbTile / 2, kEmbTile / 4}) {
          const int64_t blocks = (n + l - 1) / l * chunks, cost = (blocks + kEmbSlots - 1) / kEmbSlots * (l + 2);
          if (best < 0 || cost < best) best = cost, tile = l;
        }
        tiles = (n + tile - 1) / tile;
        part = Tensor::empty({2 * tiles, h}, DType::f32, dev);
        embedding_tiles_kernel<T, V><<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(chunks)), threads, 0, stream>>>(
            static_cast<T*>(out.data()), static_cast<float*>(part.data()), static_cast<const T*>(grad.data()), k_out, p_out, n,
            static_cast<uint32_t>(v), h, tile);
        KCPP_CUDA_CHECK_LAUNCH("embedding_backward tiles");
      };
      constexpr int kVec = static_cast<int>(16 / sizeof(T));
      const bool aligned = h % kVec == 0 && reinterpret_cast<uintptr_t>(grad.data()) % 16 == 0 &&
                           reinterpret_cast<uintptr_t>(out.data()) % 16 == 0;
      if (aligned) launch(std::integral_constant<int, kVec>{});
      else launch(std::integral_constant<int, 1>{});
      if (tiles > 1) {
        auto spans = [&]<int V>(std::integral_constant<int, V>) {
          const int64_t chunks = (h + 32 * V - 1) / (32 * V);
          KCPP_CHECK(chunks <= 65535, "op embedding_backward: hidden size {} is too large for CUDA (at most {}); run the embedding on the CPU", h,
                     int64_t{65535} * 32 * V);
          embedding_spans_kernel<T, V><<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(chunks)), 32 * kEmbGroups, 0,
                                         stream>>>(static_cast<T*>(out.data()), static_cast<const float*>(part.data()), k_out,
                                                   n, static_cast<uint32_t>(v), h, tile);
          KCPP_CUDA_CHECK_LAUNCH("embedding_backward spans");
        };
        if (h % 4 == 0) spans(std::integral_constant<int, 4>{});
        else spans(std::integral_constant<int, 1>{});
      }
    });
  }
  if (check) check->check("embedding_backward", "ids", v);
}

void gather_last(const Tensor& out, const Tensor& x, const Tensor& idx, int64_t ignore_index) {
  const int64_t n = idx.numel();
  if (n == 0) return;
  kcpp::cuda::DeviceGuard g(out.device().index);
  DataCheck check(out.device());
  gather_kernel<<<kcpp::cuda::grid_for(n, 256), 256, 0, kcpp::cuda::current_stream()>>>(
      out.data(), x.data(), x.dtype(), idx.data(), idx.dtype(), n, x.size(1), ignore_index, check.ptr());
  KCPP_CUDA_CHECK_LAUNCH("gather_last");
  check.check("gather_last", "idx", x.size(1));
}

void scatter_last(const Tensor& out, const Tensor& values, const Tensor& idx, int64_t ignore_index) {
  const int64_t n = idx.numel();
  if (n == 0) return;
  kcpp::cuda::DeviceGuard g(out.device().index);
  DataCheck check(out.device());
  scatter_kernel<<<kcpp::cuda::grid_for(n, 256), 256, 0, kcpp::cuda::current_stream()>>>(
      out.data(), values.data(), values.dtype(), idx.data(), idx.dtype(), n, out.size(1), ignore_index, check.ptr());
  KCPP_CUDA_CHECK_LAUNCH("scatter_last");
  check.check("scatter_last", "idx", out.size(1));
}

void valid_mask(const Tensor& out, const Tensor& idx, int64_t ignore_index) {
  const int64_t n = idx.numel();
  if (n == 0) return;
  kcpp::cuda::DeviceGuard g(out.device().index);
  valid_kernel<<<kcpp::cuda::grid_for(n, 256), 256, 0, kcpp::cuda::current_stream()>>>(
      out.data(), out.dtype(), idx.data(), idx.dtype(), n, ignore_index);
  KCPP_CUDA_CHECK_LAUNCH("valid_mask");
}

}  // namespace kcpp::ops::cuda
