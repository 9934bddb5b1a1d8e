// A matrix product with few rows, y [M, N] = a [M, K] w[N, K]^T for M <= 8 (a decode step's
// projections): the weights are streamed once at the copy rate, where cuBLAS's GEMM tiles, sized for
// many rows, leave most of each tile empty.
//
// One warp (or KS warps over slices of K, for narrow weights) per output column n: each lane reads 8
// consecutive elements of w's row n (one 16-byte load) and the same 8 elements of every row of a
// (through L1: a is small and every warp reads it), kUnroll loads in flight before the first
// product, and keeps M f32 sums; the sums are added by shuffles (and across the slices in shared
// memory) and rounded once to the dtype, as cuBLAS rounds its f32 accumulator.  Launched with
// programmatic dependent launch (ops/cuda/pdl.cuh): the first weight loads overlap the end of the
// kernel before.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "ops/cuda/common.cuh"
#include "ops/cuda/gemv.cuh"
#include "ops/cuda/launch.h"
#include "ops/cuda/pdl.cuh"

namespace kcpp::ops::cuda {
namespace {

using namespace gemv;

// KS warps of a block share a column, each over its own K / KS slice (8 / KS columns a block), so
// that narrow weights still put enough loads in flight; their sums meet in shared memory.  The first
// pass of weight loads is issued before pdl_wait(): the weights are no kernel's output.
template <typename T, int M, int KS>
__global__ void __launch_bounds__(kThreads) gemv_kernel(T* __restrict__ out, const T* __restrict__ a,
                                                        const T* __restrict__ w, int n, int k) {
  __shared__ float part[kWarps][M];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, slice = warp % KS;
  const int col = blockIdx.x * (kWarps / KS) + warp / KS;
  const T* row = w + static_cast<int64_t>(min(col, n - 1)) * k;  // [K]
  uint4 wv[kUnroll];
  load_pass<T, KS>(row, slice * kStep, k, lane, wv);
  pdl_wait();
  pdl_trigger();
  float acc[M] = {};
  for (int base = slice * kStep; base < k; base += kStep * KS * kUnroll) {
    if (base != slice * kStep) load_pass<T, KS>(row, base, k, lane, wv);
    dot_pass<T, M, KS>(a, k, base, k, lane, wv, acc);
  }
  finish_column<T, M, KS>(out, n, col, warp, lane, acc, part);
}

template <typename T, int M, int KS> void launch(const Tensor& out, const Tensor& a, const Tensor& w, int n, int k) {
  constexpr int cols = kWarps / KS;
  launch_pdl("matmul (gemv)", gemv_kernel<T, M, KS>, dim3((n + cols - 1) / cols), dim3(kThreads), 0,
             static_cast<T*>(out.data()), static_cast<const T*>(a.data()), static_cast<const T*>(w.data()), n, k);
}

// The slices a column: where the weights fit one pass (kUnroll loads a lane) of at most half the
// device's warps (16 an SM: two blocks of kThreads), the fewest slices that do, so that every block
// is resident beside the kernel before it (a programmatic dependent launch) and has loaded all its
// weights before pdl_wait(); else slices_for's (larger weights: as many loads in flight as fit).
// Of a decode step's projections this takes Qwen3-0.6B's o (4 MB; slices_for's launch was two waves):
// its step measured 1-3% faster (bench/RESULTS.md, 2026-11-28).
int plain_slices(int64_t n, int64_t k) {
  const int ks = one_pass_slices(n, k, 16);
  return ks > 0 ? ks : slices_for(n, k);
}

template <typename T, int M> void launch_split(const Tensor& out, const Tensor& a, const Tensor& w, int n, int k) {
  switch (plain_slices(n, k)) {
    case 1: launch<T, M, 1>(out, a, w, n, k); break;
    case 2: launch<T, M, 2>(out, a, w, n, k); break;
    case 4: launch<T, M, 4>(out, a, w, n, k); break;
    default: launch<T, M, 8>(out, a, w, n, k); break;
  }
}

template <typename T> void dispatch(int64_t m, const Tensor& out, const Tensor& a, const Tensor& w, int n, int k) {
  switch (m) {
    case 1: launch_split<T, 1>(out, a, w, n, k); break;
    case 2: launch_split<T, 2>(out, a, w, n, k); break;
    case 3: launch_split<T, 3>(out, a, w, n, k); break;
    case 4: launch_split<T, 4>(out, a, w, n, k); break;
    case 5: launch_split<T, 5>(out, a, w, n, k); break;
    case 6: launch_split<T, 6>(out, a, w, n, k); break;
    case 7: launch_split<T, 7>(out, a, w, n, k); break;
    default: launch_split<T, 8>(out, a, w, n, k); break;
  }
}

}  // namespace

bool gemv_small_m(const Tensor& out, const Tensor& a, const Tensor& w, int64_t m, int64_t n, int64_t k) {
  // KCPP_GEMV (ops::gemv_max_rows): one row by default; at eight rows it measured slower than cuBLAS
  // inside a decode step (bench/RESULTS.md, 2026-11-26).
  const int64_t max_rows = std::min(ops::gemv_max_rows(), kGemvMaxRows);
  const DType t = out.dtype();
  if (m < 1 || m > max_rows || k % 8 != 0 || n > (1 << 30) || k > (1 << 30) ||
      (t != DType::bf16 && t != DType::f16) || !kcpp::kernel::cuda::aligned16(a.data()) ||
      !kcpp::kernel::cuda::aligned16(w.data()))
    return false;
  if (t == DType::bf16) dispatch<__nv_bfloat16>(m, out, a, w, static_cast<int>(n), static_cast<int>(k));
  else dispatch<__half>(m, out, a, w, static_cast<int>(n), static_cast<int>(k));
  KCPP_CUDA_CHECK_LAUNCH("matmul (gemv)");
  return true;
}

}  // namespace kcpp::ops::cuda
