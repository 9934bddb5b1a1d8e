// Sampling on the GPU (ops/nn/sampling.h): one block of 1024 threads a row.
//
// Top-k: the k-th largest logit is found by a radix select over order-preserving 32-bit keys of the
// logits (four passes of 8-bit digit histograms, most significant first); the k candidates (those
// above it, then the ties in id order) are compacted by a block scan over contiguous chunks, ordered
// by a bitonic sort of (key descending, id ascending) packed in 64 bits; each thread computes one
// candidate's probability in f64, and one thread adds them in order as the host does: top-p, the draw.
// Gumbel-max (no top-k, no top-p): each thread keeps its best x / T + g over a strided share of the
// vocabulary, in f64; a block reduction picks the largest (ties: the lower id).
#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/common.cuh"
#include "ops/cuda/launch.h"
#include "ops/nn/sampling.h"

namespace kcpp::ops::cuda {
namespace {

using kcpp::kernel::cuda::to_f32;

constexpr int kThreads = 1024;
constexpr int kMaxK = 1024;

// Larger float, larger key (-0 and +0 share one).
__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t b = x == 0.f ? 0u : __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) sample_kernel(int64_t* __restrict__ out, const T* __restrict__ logits, int64_t v,
                                                          double temperature, int top_k, double top_p,
                                                          const int64_t* __restrict__ counters) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int bad, hist[256];
  __shared__ uint32_t prefix_s, mask_s;
  __shared__ int remaining_s;
  __shared__ unsigned long long cand[kMaxK];
  __shared__ double p[kMaxK];
  __shared__ double best_v[kThreads / 32];
  __shared__ int64_t best_i[kThreads / 32];
  const int tid = threadIdx.x;
  const int64_t row = blockIdx.x;
  const T* x = logits + static_cast<int64_t>(row) * v;
  const uint64_t seed = static_cast<uint64_t>(counters[2 * row]), pos = static_cast<uint64_t>(counters[2 * row + 1]);
  if (tid == 0) bad = 0x7fffffff;
  __syncthreads();
  for (int64_t i = tid; i < v; i += kThreads)
    if (!isfinite(to_f32(x[i]))) atomicMin(&bad, static_cast<int>(i));
  __syncthreads();
  if (bad != 0x7fffffff) {
    if (tid == 0) out[2 * row] = 0, out[2 * row + 1] = bad;
    return;
  }
  if (top_k == 0) {  // Gumbel-max
    double best = -INFINITY;
    int64_t at = v;
    for (int64_t i = tid; i < v; i += kThreads) {
      const double g = static_cast<double>(to_f32(x[i])) / temperature -
                       ::log(-::log(counter_uniform(seed, pos, static_cast<uint64_t>(i) + 1)));
      // Strided: a thread meets its ids in increasing order; the first is taken even at -inf (a
      // temperature so small that x / T overflows), as the host takes id 0 then.
      if (g > best || at == v) best = g, at = i;
    }
    for (int o = 16; o > 0; o >>= 1) {
      const double bv = __shfl_xor_sync(0xffffffffu, best, o);
      const int64_t bi = __shfl_xor_sync(0xffffffffu, at, o);
      if (bv > best || (bv == best && bi < at)) best = bv, at = bi;
    }
    if (tid % 32 == 0) best_v[tid / 32] = best, best_i[tid / 32] = at;
    __syncthreads();
    if (tid == 0) {
      for (int w = 1; w < kThreads / 32; ++w)
        if (best_v[w] > best || (best_v[w] == best && best_i[w] < at)) best = best_v[w], at = best_i[w];
      out[2 * row] = at, out[2 * row + 1] = -1;
    }
    return;
  }
  const int k = static_cast<int>(top_k < v ? top_k : v);
  // Radix select: the key of the k-th largest logit, 8 bits at a time.
  if (tid == 0) prefix_s = 0, mask_s = 0, remaining_s = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    if (tid < 256) hist[tid] = 0;
    __syncthreads();
    const uint32_t prefix = prefix_s, mask = mask_s;
    for (int64_t i = tid; i < v; i += kThreads) {
      const uint32_t key = order_key(to_f32(x[i]));
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1);
    }
    __syncthreads();
    if (tid == 0) {
      int above = 0, d = 255;
      for (; d > 0 && above + hist[d] < remaining_s; --d) above += hist[d];
      remaining_s -= above;
      prefix_s |= static_cast<uint32_t>(d) << shift;
      mask_s |= 255u << shift;
    }
    __syncthreads();
  }
  const uint32_t kth = prefix_s;
  const int ties = remaining_s;  // the ties with the k-th to take, in id order
  // Compaction over contiguous chunks (chunk order is id order).
  const int64_t chunk = (v + kThreads - 1) / kThreads;
  const int64_t lo = tid * chunk < v ? tid * chunk : v, hi = lo + chunk < v ? lo + chunk : v;
  int gt = 0, eq = 0;
  for (int64_t i = lo; i < hi; ++i) {
    const uint32_t key = order_key(to_f32(x[i]));
    gt += key > kth, eq += key == kth;
  }
  int gt_at, eq_at;
  Scan(scan).ExclusiveSum(gt, gt_at);
  __syncthreads();
  Scan(scan).ExclusiveSum(eq, eq_at);
  const int above = k - ties;  // how many candidates lie above the k-th
  cand[tid] = ~0ull;           // empty slots sort last
  __syncthreads();
  for (int64_t i = lo; i < hi; ++i) {
    const uint32_t key = order_key(to_f32(x[i]));
    int slot = -1;
    if (key > kth) {
      slot = gt_at++;
    } else if (key == kth) {
      if (eq_at < ties) slot = above + eq_at;
      ++eq_at;
    }
    if (slot >= 0) cand[slot] = (static_cast<unsigned long long>(~key) << 32) | static_cast<uint32_t>(i);
  }
  __syncthreads();
  // Bitonic sort of the 1024 slots, ascending: key descending, then id ascending.
  for (int size = 2; size <= kMaxK; size <<= 1)
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      const int partner = tid ^ stride;
      if (partner > tid) {
        const bool up = (tid & size) == 0;
        const unsigned long long a = cand[tid], b = cand[partner];
        if ((a > b) == up) cand[tid] = b, cand[partner] = a;
      }
      __syncthreads();
    }
  // Each candidate's exp((x - x_max) / T) in parallel; one thread adds them in order, in f64, as the
  // host does.
  const double x0 = to_f32(x[cand[0] & 0xffffffffu]);
  if (tid < k) p[tid] = ::exp((static_cast<double>(to_f32(x[cand[tid] & 0xffffffffu])) - x0) / temperature);
  __syncthreads();
  if (tid != 0) return;
  double z = 0;
  for (int i = 0; i < k; ++i) z += p[i];
  int n = k;
  double total = z;
  if (top_p < 1.0) {
    double c = 0;
    for (int i = 0; i < k; ++i) {
      c += p[i];
      if (c >= top_p * z) {
        n = i + 1, total = c;
        break;
      }
    }
  }
  const double target = counter_uniform(seed, pos, 0) * total;
  int pick = n - 1;
  double c = 0;
  for (int i = 0; i < n; ++i) {
    c += p[i];
    if (c > target) {
      pick = i;
      break;
    }
  }
  out[2 * row] = static_cast<int64_t>(cand[pick] & 0xffffffffu), out[2 * row + 1] = -1;
}

// The next decode step's inputs from the picks [B, 2]: a thread a row.
__global__ void advance_kernel(const int64_t* __restrict__ picks, int64_t* __restrict__ ids, int* __restrict__ positions,
                               int* __restrict__ lengths, int b) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= b) return;
  ids[j] = picks[2 * j];
  ++positions[j], ++lengths[j];
}

}  // namespace

void advance_decode_inputs(const Tensor& picks, const Tensor& ids, const Tensor& positions, const Tensor& lengths) {
  kcpp::cuda::DeviceGuard guard(picks.device().index);
  const int b = static_cast<int>(picks.size(0));
  if (b == 0) return;
  advance_kernel<<<(b + 255) / 256, 256, 0, kcpp::cuda::current_stream()>>>(
      static_cast<const int64_t*>(picks.data()), static_cast<int64_t*>(ids.data()), static_cast<int*>(positions.data()),
      static_cast<int*>(lengths.data()), b);
  KCPP_CUDA_CHECK_LAUNCH("advance_decode_inputs");
}

void sample_checked(const Tensor& out, const Tensor& logits, const SampleOptions& opt, const std::vector<uint64_t>& seeds,
                    const std::vector<int64_t>& positions) {
  kcpp::cuda::DeviceGuard guard(logits.device().index);
  const int64_t b = logits.size(0), v = logits.size(1);
  KCPP_CHECK(v <= 0x7fffffff && b <= 0x7fffffff, "op sample: logits [{}, {}] are too large for one launch", b, v);
  KCPP_CHECK(sampling_on_device(opt), "op sample: top_k {} with top_p {} is not sampled on the GPU (top_k 1 to 1024, or "
             "neither filter); sample_checked takes such calls to the host", opt.top_k, opt.top_p);
  std::vector<int64_t> counters(static_cast<size_t>(2 * b));
  for (int64_t i = 0; i < b; ++i)
    counters[2 * i] = static_cast<int64_t>(seeds[i]), counters[2 * i + 1] = positions[i];
  const Tensor c = Tensor::from_i64(counters, {2 * b}, DType::i64, logits.device());
  visit_cuda_float(logits.dtype(), "sample", [&]<typename T>(std::type_identity<T>) {
    sample_kernel<T><<<static_cast<unsigned>(b), kThreads, 0, kcpp::cuda::current_stream()>>>(
        static_cast<int64_t*>(out.data()), static_cast<const T*>(logits.data()), v, opt.temperature,
        static_cast<int>(opt.top_k), opt.top_p, static_cast<const int64_t*>(c.data()));
  });
  KCPP_CUDA_CHECK_LAUNCH("sample");
}

}  // namespace kcpp::ops::cuda
