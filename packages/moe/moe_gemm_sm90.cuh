// The experts' forward GEMMs on Hopper (sm_90a): the grouped products of moe_gemm.cuh's MGroup
// scheduling (group g = expert g, its rows the positions [offsets[g], offsets[g + 1]) of a buffer by
// position) on the persistent warp-specialized TMA / wgmma kernel of kernel/grouped_gemm_sm90.cuh
// (its head comment has the design).  Internal to moe_cuda.cu; the mma.sync kernel (moe_gemm.cuh)
// runs whatever this one does not take (unsupported below).
//
//   Glu    [g | u] = A [Wg; Wu]^T of the group's rows, then gate_up (saved, optional) = round([g, u])
//          and h = round(act(round g) round u), both by position
//   Store  C = round(A W^T) by position
//
// A is a buffer by position [rows, K] (contiguous along K: the gathered token rows, or h); W is a
// weight stack [E, N, K], contiguous along K (Transformers' gate_up_proj [E, 2I, H] and down_proj [E,
// H, I], as the forward applies them).  The tiles of every group are the prefix sum of ceil(rows /
// 128) that the permutation already wrote (tile_offsets), read on the device: no group size comes to
// the host.
#pragma once

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "kcpp/kernel/grouped_gemm_sm90.cuh"
#include "moe.h"
#include "moe_gemm.cuh"

namespace kcpp::moe::gemm::sm90 {

namespace sm90gemm = kernel::sm90gemm;
using kernel::sm90::sm_count;
static_assert(sm90gemm::kBM == BM, "the tile offsets (scan_buckets) count tiles of moe_gemm.cuh's BM rows");

// KCPP_MOE_SM90: 0 leaves every product to the mma.sync kernel (for comparing the two); 1 requires
// this kernel for every product of the package's forward path that it is built for (the call fails,
// saying why, where it cannot take one: so a test or benchmark knows what it ran); unset or anything
// else, this kernel wherever it can run.
enum class Mode { Off, Auto, Required };
inline Mode mode() {
  const char* env = std::getenv("KCPP_MOE_SM90");
  if (env && std::strcmp(env, "0") == 0) return Mode::Off;
  if (env && std::strcmp(env, "1") == 0) return Mode::Required;
  return Mode::Auto;
}

// Null when the kernel can run on this device, else why not: a build with sm_90a code, a device of
// compute capability 9.0, the driver's tensor-map encoder.
inline const char* device_unavailable() {
#if defined(KCPP_MOE_HAS_SM90)
  return sm90gemm::device_unavailable(true);
#else
  return "the package was built without sm_90a code";
#endif
}
// The same, and KCPP_MOE_SM90 not 0.
inline const char* unavailable() { return mode() == Mode::Off ? "KCPP_MOE_SM90=0" : device_unavailable(); }
inline bool enabled() { return unavailable() == nullptr; }

// The product `a` (moe_gemm.cuh's arguments, A a buffer of a_rows rows) as the kernel's.
template <typename T> sm90gemm::GroupedGemm<T> product(const Args<T>& a, Epi e, int64_t a_rows) {
  sm90gemm::GroupedGemm<T> g;
  g.epilogue = e == Epi::Glu ? sm90gemm::GemmEpilogue::Glu : sm90gemm::GemmEpilogue::Store;
  g.act = a.act;
  g.groups = a.groups, g.offsets = a.offsets, g.tile_offsets = a.tile_offsets;
  g.a = a.a, g.a_rows = a_rows, g.lda = a.lda, g.k = a.K;
  g.b0 = a.b0, g.b1 = a.b1, g.ldb = a.ldb, g.b_gstride = a.b_gstride;
  if (e == Epi::Glu) g.n = a.inter, g.h = a.h, g.gu_out = a.gu_out;
  else g.n = a.N, g.c = static_cast<T*>(a.c), g.ldc = a.ldc;
  return g;
}

// Null when this kernel takes the product `a` (moe_gemm.cuh's arguments) with its A buffer of a_rows
// rows, else why not: the kernel available here, bf16 / f16, MGroup, Glu (gate and up two matrices, or
// halves of one stack: Split::Dual) or Store (no split, in the dtype, not added to), A and W
// contiguous along K and not gathered, with 16-byte aligned bases and strides (TMA) and outputs.
template <typename T> const char* unsupported(const Args<T>& a, Epi e, int64_t a_rows) {
  if (const char* why = unavailable()) return why;
  if (a.grouping != Grouping::MGroup || a_rows <= 0 || a_rows > INT32_MAX) return "not a grouping of 1 to 2^31 - 1 rows by expert";
  if (!a.a_kcontig || !a.b_kcontig || a.a_gather || a.b_gather) return "an operand is gathered or not contiguous along K";
  if (e == Epi::Glu) {
    if (a.split != Split::Dual || !a.b1 || !a.h) return "not a gate / up product into h";
  } else if (e == Epi::Store) {
    if (a.split != Split::None || a.c_f32 || a.c_add || !a.c) return "not a product stored in the dtype";
  } else {
    return "an epilogue this kernel does not have";
  }
  return sm90gemm::unsupported(product(a, e, a_rows));
}

// Launches the product (unsupported must have said null).  Null when it launched; else why nothing
// runs: the driver refused a tensor map or the kernel's shared-memory size, or the launch failed (its
// CUDA error named).  The caller then runs the mma.sync kernel, or under KCPP_MOE_SM90=1 fails the
// call with that reason.
template <typename T> const char* launch(const Args<T>& a, Epi e, int64_t a_rows, cudaStream_t st) {
  cudaError_t err = cudaSuccess;
  if (!sm90gemm::launch(product(a, e, a_rows), st, &err))
    return "the driver refused a tensor map or the kernel's shared-memory size";
  if (err == cudaSuccess) return nullptr;
  static thread_local char why[192];
  std::snprintf(why, sizeof(why), "the launch failed: %s: %s", cudaGetErrorName(err), cudaGetErrorString(err));
  return why;
}

}  // namespace kcpp::moe::gemm::sm90
