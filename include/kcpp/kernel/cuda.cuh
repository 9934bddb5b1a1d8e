// Device helpers for kernel packages: 16-byte vector access (and the alignment test for it), float conversion of the storage
// types, warp and block reductions, the launch check.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "kcpp/kernel/error.h"
#include "kcpp/kernel/types.h"

namespace kcpp::kernel::cuda {

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

// Rounds a float to T and back: the value an eager op would have stored as an intermediate.
template <typename T> __device__ __forceinline__ float round_to(float v) { return to_f32(from_f32<T>(v)); }

// Two floats rounded to a 16-bit T and packed in one word, the first in the low half (the lower
// column of a matrix fragment).
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// N elements of T moved as one aligned access (16 bytes when N * sizeof(T) == 16).
template <typename T, int N> struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// A vector already in registers, widened to f32.
template <typename T, int N> __device__ __forceinline__ void widen(const Vec<T, N>& v, float (&out)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_f32(v.v[i]);
}
// bf16 is the upper half of an f32, so a pair packed in a 32-bit word widens with one shift and one
// mask; element by element, the compiler first moves the upper element down (one more instruction
// each), which counts in kernels that issue as many instructions as they move bytes.  Pass a
// vector already in registers (as load_f32 does): read word by word through a reference into global
// memory, one 16-byte load becomes several narrow ones (measured: SwiGLU 1.5x slower).
template <int N> __device__ __forceinline__ void widen(const Vec<__nv_bfloat16, N>& v, float (&out)[N]) {
  if constexpr (N % 2 == 0) {
    uint32_t w[N / 2];
    memcpy(w, &v, sizeof(w));
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_f32(v.v[i]);
  }
}

// Two 16-bit values in one register, for the packed instructions (__hmul2 and kin).  A product of two
// values of T is exact in f32 (8 or 11 significant bits each), so T's paired multiply, which rounds
// the exact product once, gives what r(a * b) in f32 gives; a sum of two values of T is exact in f32
// or, where their exponents lie too far apart for that, too far from a tie of T for the second
// rounding to matter, so the paired add gives r(a + b) too.  Both are the explicitly rounded forms
// (_rn), which the compiler does not contract into a fused multiply-add.
template <typename T> struct Pair;
template <> struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ type round(float lo, float hi) { return __floats2bfloat162_rn(lo, hi); }
  static __device__ __forceinline__ float2 split(type v) { return __bfloat1622float2(v); }
};
template <> struct Pair<__half> {
  using type = __half2;
  static __device__ __forceinline__ type round(float lo, float hi) { return __floats2half2_rn(lo, hi); }
  static __device__ __forceinline__ float2 split(type v) { return __half22float2(v); }
};

// True when a pointer allows 16-byte vector access.
inline bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

// One vector load into registers first, then widen() (see there).
template <typename T, int N> __device__ __forceinline__ void load_f32(const T* p, float (&out)[N]) {
  const Vec<T, N> v = *reinterpret_cast<const Vec<T, N>*>(p);
  widen(v, out);
}
template <typename T, int N> __device__ __forceinline__ void store_f32(T* p, const float (&in)[N]) {
  Vec<T, N> v;
#pragma unroll
  for (int i = 0; i < N; ++i) v.v[i] = from_f32<T>(in[i]);
  if constexpr (sizeof(v) == 16) {  // one 16-byte store: a struct copy was once split into 2-byte stores
    uint4 u;
    memcpy(&u, &v, sizeof(u));
    *reinterpret_cast<uint4*>(p) = u;
  } else {
    *reinterpret_cast<Vec<T, N>*>(p) = v;
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sums over the block, returned to every thread, with one barrier, for a loop that reduces once an
// iteration: call k uses half (k & 1) of `scratch` (64 floats for one sum, 128 for two), so call k + 2
// writes that half only after every thread has passed call k + 1's barrier, which each thread reaches
// after its reads of call k.  Every thread of the block must make every call, with `phase` = k & 1.
__device__ __forceinline__ float block_sum_alternating(float v, float* scratch, uint32_t phase) {
  v = warp_sum(v);
  if (blockDim.x <= 32) return v;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* half = scratch + 32 * phase;
  if (lane == 0) half[warp] = v;
  __syncthreads();
  return warp_sum(lane < static_cast<int>(blockDim.x >> 5) ? half[lane] : 0.0f);
}

// Two sums at once (one barrier for both), each added in the same order as the one-sum form.
__device__ __forceinline__ float2 block_sum2_alternating(float a, float b, float* scratch, uint32_t phase) {
  a = warp_sum(a);
  b = warp_sum(b);
  if (blockDim.x <= 32) return make_float2(a, b);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* half = scratch + 64 * phase;
  if (lane == 0) half[warp] = a, half[32 + warp] = b;
  __syncthreads();
  const bool in = lane < static_cast<int>(blockDim.x >> 5);
  return make_float2(warp_sum(in ? half[lane] : 0.0f), warp_sum(in ? half[32 + lane] : 0.0f));
}

// Sum over the block, returned to every thread.  `scratch`: 32 floats of shared memory, which the
// call leaves free for reuse (a second barrier after the reads).
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  v = block_sum_alternating(v, scratch, 0);
  if (blockDim.x > 32) __syncthreads();
  return v;
}

// Two sums over the block at once, each added in the same order as block_sum adds it.  `scratch`:
// 64 floats of shared memory, left free for reuse.
__device__ __forceinline__ float2 block_sum2(float a, float b, float* scratch) {
  const float2 r = block_sum2_alternating(a, b, scratch, 0);
  if (blockDim.x > 32) __syncthreads();
  return r;
}

// Programmatic dependent launch (sm_90; no-ops elsewhere and when the launch did not ask for it).
// A kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization may start while the
// kernel before it in the stream is finishing; griddep_wait() holds it until that kernel has
// completed and its writes are visible.  griddep_launch_dependents() in the kernel before lets the
// dependent grid start launching once every block has called it (else when each block exits).
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...) with the launch attributes attrs[0 .. n) (n may be
// 0).  The launch's error (nothing is left in the sticky error).
template <typename... Params, typename... Args>
cudaError_t launch_ex(const cudaLaunchAttribute* attrs, unsigned n, void (*kernel)(Params...), dim3 grid, dim3 block,
                      size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = const_cast<cudaLaunchAttribute*>(attrs);
  cfg.numAttrs = n;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, static_cast<Args&&>(args)...);
  if (e != cudaSuccess) (void)cudaGetLastError();
  return e;
}

// Whether programmatic dependent launches are allowed: not where KCPP_PDL=0 (the process-wide switch
// for comparing with ordinary launches; read once).
inline bool dependent_launch_enabled() {
  static const bool enabled = [] {
    const char* e = std::getenv("KCPP_PDL");
    return !(e != nullptr && std::strcmp(e, "0") == 0);
  }();
  return enabled;
}

// The launch attribute that makes a kernel a programmatic dependent of the kernel before it in the
// stream: the kernel calls griddep_wait() before its first read of what an earlier kernel wrote and
// before its first write.
inline cudaLaunchAttribute dependent_launch() {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  return a;
}

// A device attribute (cached per thread, device and attribute): e.g. cudaDevAttrComputeCapabilityMajor,
// cudaDevAttrMaxSharedMemoryPerBlockOptin.  0 when the query fails (not cached: asked again next time).
inline int device_attribute(cudaDeviceAttr attr, int device) {
  struct Entry {
    int device;
    cudaDeviceAttr attr;
    int value;
  };
  constexpr int kSlots = 16;
  static thread_local Entry cache[kSlots] = {};
  static thread_local int used = 0, next = 0;  // filled slots; the slot the next miss replaces
  for (int k = 0; k < used; ++k)
    if (cache[k].device == device && cache[k].attr == attr) return cache[k].value;
  int v = 0;
  if (cudaDeviceGetAttribute(&v, attr, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  cache[next] = {device, attr, v};
  next = (next + 1) % kSlots;
  if (used < kSlots) ++used;
  return v;
}

// The device's multiprocessor count (at least 1).
inline int sm_count(int device) {
  const int n = device_attribute(cudaDevAttrMultiProcessorCount, device);
  return n > 0 ? n : 1;
}

inline const char* launch_error(const char* op) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return nullptr;
  return errorf("%s: kernel launch failed: %s", op, cudaGetErrorString(e));
}

// Host side: f(static_cast<T*>(nullptr)) for the storage type T of `t` (f32, bf16, f16), so that one
// generic lambda, `[&]<typename T>(T*) -> const char* {...}`, launches the kernels of each; `what`
// names the op in the error for any other dtype.
template <typename F> const char* with_float_dtype(DType t, const char* what, F&& f) {
  switch (t) {
    case DType::f32: return f(static_cast<float*>(nullptr));
    case DType::bf16: return f(static_cast<__nv_bfloat16*>(nullptr));
    case DType::f16: return f(static_cast<__half*>(nullptr));
  }
  return errorf("%s: unsupported dtype %d (f32, bf16 and f16 are)", what, static_cast<int>(t));
}

}  // namespace kcpp::kernel::cuda
