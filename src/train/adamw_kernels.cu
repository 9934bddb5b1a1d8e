// CUDA side of adamw_kernels.h: multi-tensor launches (descriptors by value, one chunk of one
// parameter a block), 16-byte vector accesses, and a fixed-order two-stage squared norm.
#include <algorithm>

#include "core/cuda_runtime.h"
#include "core/cuda_types.cuh"
#include "core/error.h"
#include "train/adamw_kernels.h"

namespace kcpp::train {

namespace {

using kcpp::kernel::cuda::load_f32;
using kcpp::kernel::cuda::store_f32;
using kcpp::kernel::cuda::from_f32;
using kcpp::kernel::cuda::to_f32;

constexpr int kThreads = 256;
constexpr int kVec = 4;  // elements per vector access: 16 bytes of f32 state, 8 of a 16-bit parameter or gradient
static_assert(kAdamWChunk % (kThreads * kVec) == 0);

// Up to kAdamWBatch parameters and the first chunk (block) of each; a block finds its parameter by
// binary search over `first`.  About 2 KB: within the 4 KB a kernel argument may take on every
// architecture this builds for.
template <typename Item> struct Batch {
  Item items[kAdamWBatch];
  int32_t first[kAdamWBatch + 1];
  int count;
};

struct NormItem {
  const void* grad;
  int64_t n;
};

template <typename Item> __device__ __forceinline__ int find_item(const Batch<Item>& b) {
  int lo = 0, hi = b.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (static_cast<int32_t>(blockIdx.x) >= b.first[mid]) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ float clip_scale(const AdamWHyper& h) {
  if (h.max_norm <= 0.0f) return 1.0f;
  const double norm = sqrt(*h.sq_norm);
  return norm > h.max_norm ? static_cast<float>(h.max_norm / (norm + 1e-6)) : 1.0f;
}

struct Consts {
  float b1, b2, decay, step, inv_bc2, eps, scale;
  __device__ __forceinline__ float update(float g, float& m, float& v, float p) const {
    g *= scale;
    m = b1 * m + (1.0f - b1) * g;
    v = b2 * v + (1.0f - b2) * g * g;
    return p * decay - step * m / (sqrtf(v * inv_bc2) + eps);
  }
};

template <typename P, typename G> __global__ void __launch_bounds__(kThreads) update_kernel(const Batch<AdamWTensor> b, const AdamWHyper h) {
  const int k = find_item(b);
  const AdamWTensor t = b.items[k];
  const int64_t begin = (static_cast<int64_t>(blockIdx.x) - b.first[k]) * kAdamWChunk;
  const int64_t end = min(begin + kAdamWChunk, t.n);
  P* param = static_cast<P*>(t.param);
  const G* grad = static_cast<const G*>(t.grad);
  const Consts c{h.beta1, h.beta2, 1.0f - h.lr * t.weight_decay, h.lr / h.bc1, 1.0f / h.bc2, h.eps, clip_scale(h)};
  // Vector accesses need every stream 16-byte (f32) / 8-byte (16-bit) aligned at `begin`: chunks
  // start at multiples of kAdamWChunk, so the base pointers decide.
  const bool vec = (reinterpret_cast<uintptr_t>(param) % (sizeof(P) * kVec)) == 0 &&
                   (reinterpret_cast<uintptr_t>(grad) % (sizeof(G) * kVec)) == 0 &&
                   (reinterpret_cast<uintptr_t>(t.m) % 16) == 0 && (reinterpret_cast<uintptr_t>(t.v) % 16) == 0 &&
                   (reinterpret_cast<uintptr_t>(t.master) % 16) == 0;
  int64_t i = begin + threadIdx.x * kVec;
  if (vec) {
    for (; i + kVec <= end; i += kThreads * kVec) {
      float g[kVec], m[kVec], v[kVec], p[kVec];
      load_f32<G, kVec>(grad + i, g);
      load_f32<float, kVec>(t.m + i, m);
      load_f32<float, kVec>(t.v + i, v);
      if (t.master) load_f32<float, kVec>(t.master + i, p);
      else load_f32<P, kVec>(param + i, p);
#pragma unroll
      for (int j = 0; j < kVec; ++j) p[j] = c.update(g[j], m[j], v[j], p[j]);
      store_f32<float, kVec>(t.m + i, m);
      store_f32<float, kVec>(t.v + i, v);
      if (t.master) store_f32<float, kVec>(t.master + i, p);
      store_f32<P, kVec>(param + i, p);
    }
  }
  // The rest element by element: a parameter's last partial vector, or every element of a
  // parameter whose buffers are not aligned for vectors.
  for (i = vec ? i : begin + threadIdx.x * kVec; i < end; i += kThreads * kVec) {
    for (int64_t e = i; e < min(i + kVec, end); ++e) {
      float m = t.m[e], v = t.v[e];
      const float p = c.update(to_f32(grad[e]), m, v, t.master ? t.master[e] : to_f32(param[e]));
      t.m[e] = m, t.v[e] = v;
      if (t.master) t.master[e] = p;
      param[e] = from_f32<P>(p);
    }
  }
}

// Squared norm, stage 1: each block writes its chunk's sum to partial[offset + block] (the chunk's
// elements summed in a fixed order: thread-strided, then a tree over the block).
template <typename G> __global__ void __launch_bounds__(kThreads) partial_squares(const Batch<NormItem> b, double* partial) {
  const int k = find_item(b);
  const NormItem t = b.items[k];
  const int64_t begin = (static_cast<int64_t>(blockIdx.x) - b.first[k]) * kAdamWChunk;
  const int64_t end = min(begin + kAdamWChunk, t.n);
  const G* g = static_cast<const G*>(t.grad);
  double s = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const double x = to_f32(g[i]);
    s += x * x;
  }
  __shared__ double sh[kThreads];
  sh[threadIdx.x] = s;
  __syncthreads();
  for (int o = kThreads / 2; o > 0; o >>= 1) {
    if (threadIdx.x < o) sh[threadIdx.x] += sh[threadIdx.x + o];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}

// Stage 2: one block sums every partial in a fixed order and adds the sum into *acc.
__global__ void __launch_bounds__(1024) sum_partials(const double* partial, int64_t count, double* acc) {
  __shared__ double sh[1024];
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) s += partial[i];
  sh[threadIdx.x] = s;
  __syncthreads();
  for (int o = blockDim.x / 2; o > 0; o >>= 1) {
    if (threadIdx.x < o) sh[threadIdx.x] += sh[threadIdx.x + o];
    __syncthreads();
  }
  if (threadIdx.x == 0) *acc += sh[0];
}

template <typename F> void by_dtype(DType t, const char* what, F&& f) {
  switch (t) {
    case DType::f32: return f(static_cast<float*>(nullptr));
    case DType::bf16: return f(static_cast<__nv_bfloat16*>(nullptr));
    case DType::f16: return f(static_cast<__half*>(nullptr));
    default: KCPP_FAIL("adamw: {} dtype {} is not f32, bf16 or f16", what, dtype_name(t));
  }
}

int64_t chunks(int64_t n) { return (n + kAdamWChunk - 1) / kAdamWChunk; }

// Calls launch(batch, blocks) for each run of up to kAdamWBatch items, skipping empty ones.
template <typename Item, typename Size, typename Launch> void in_batches(const std::vector<Item>& items, Size size, Launch launch) {
  Batch<Item> b{};
  int64_t blocks = 0;
  auto flush = [&] {
    if (b.count == 0) return;
    b.first[b.count] = static_cast<int32_t>(blocks);
    launch(b, blocks);
    b = Batch<Item>{};
    blocks = 0;
  };
  for (const Item& it : items) {
    const int64_t n = size(it);
    if (n == 0) continue;
    // Block indices are int32 within a batch: a parameter alone is limited to 2^31 chunks (2^44 elements).
    if (b.count == kAdamWBatch || blocks + chunks(n) > INT32_MAX) flush();
    b.items[b.count] = it;
    b.first[b.count] = static_cast<int32_t>(blocks);
    ++b.count;
    blocks += chunks(n);
  }
  flush();
}

}  // namespace

void adamw_update_cuda(const std::vector<AdamWTensor>& ts, DType param_dtype, DType grad_dtype, const AdamWHyper& h) {
  by_dtype(param_dtype, "parameter", [&]<typename P>(P*) {
    by_dtype(grad_dtype, "gradient", [&]<typename G>(G*) {
      in_batches(ts, [](const AdamWTensor& t) { return t.n; }, [&](const Batch<AdamWTensor>& b, int64_t blocks) {
        update_kernel<P, G><<<static_cast<unsigned>(blocks), kThreads, 0, cuda::current_stream()>>>(b, h);
        KCPP_CUDA_CHECK_LAUNCH("adamw update");
      });
    });
  });
}

void add_squared_norms_cuda(const std::vector<Tensor>& grads, double* acc, Tensor& scratch) {
  if (grads.empty()) return;
  int64_t total = 0;
  for (const Tensor& g : grads) total += chunks(g.numel());
  if (total == 0) return;
  const Device dev = grads.front().device();
  if (!scratch.defined() || scratch.numel() < total || scratch.device() != dev) scratch = Tensor::empty({total}, DType::f64, dev);
  double* partial = static_cast<double*>(scratch.data());
  int64_t offset = 0;
  // One launch per run of gradients with one dtype and up to kAdamWBatch members, in list order.
  size_t i = 0;
  while (i < grads.size()) {
    const DType dt = grads[i].dtype();
    std::vector<NormItem> run;
    for (; i < grads.size() && grads[i].dtype() == dt; ++i) run.push_back({grads[i].data(), grads[i].numel()});
    by_dtype(dt, "gradient", [&]<typename G>(G*) {
      in_batches(run, [](const NormItem& t) { return t.n; }, [&](const Batch<NormItem>& b, int64_t blocks) {
        partial_squares<G><<<static_cast<unsigned>(blocks), kThreads, 0, cuda::current_stream()>>>(b, partial + offset);
        KCPP_CUDA_CHECK_LAUNCH("adamw squared norm");
        offset += blocks;
      });
    });
  }
  sum_partials<<<1, 1024, 0, cuda::current_stream()>>>(partial, total, acc);
  KCPP_CUDA_CHECK_LAUNCH("adamw squared norm sum");
}

}  // namespace kcpp::train
