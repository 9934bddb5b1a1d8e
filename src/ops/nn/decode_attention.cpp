#include "ops/nn/decode_attention.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops/check.h"
#include "ops/cuda/launch.h"

namespace kcpp::ops {
namespace {

void check_cache(const Tensor& k_cache, const Tensor& v_cache, const Tensor& like, const char* op) {
  check_same(k_cache, like, op, "k_cache", like.dim() == 3 ? "q" : "k");
  check_same(v_cache, like, op, "v_cache", like.dim() == 3 ? "q" : "k");
  check_dims(k_cache, 4, op, "k_cache");
  check_shape(v_cache, k_cache.shape(), op, "v_cache");
  KCPP_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "op {}: the cache storage must be contiguous", op);
}

// rows / lengths / positions: [B] i32 on `dev`.
void check_index_vector(const Tensor& t, int64_t b, Device dev, const char* op, const char* arg) {
  check_defined(t, op, arg);
  KCPP_CHECK(t.dtype() == DType::i32, "op {}: argument '{}' must be i32, got {}", op, arg, dtype_name(t.dtype()));
  check_shape(t, {b}, op, arg);
  KCPP_CHECK(t.device() == dev, "op {}: argument '{}' is on {} but the cache is on {}", op, arg, t.device().str(), dev.str());
}

// On the CPU the indices are read here and checked, naming the first bad entry.
void check_values(const Tensor& t, int64_t lo, int64_t hi, const char* op, const char* arg, const char* what) {
  const Tensor c = t.contiguous();
  const int32_t* p = c.data_ptr<int32_t>();
  for (int64_t i = 0; i < t.numel(); ++i)
    KCPP_CHECK(p[i] >= lo && p[i] <= hi, "op {}: {}[{}] = {} is outside [{}, {}] ({})", op, arg, i, p[i], lo, hi, what);
}

}  // namespace

bool decode_attention_supported(Device device, int64_t head_dim) {
  return !device.is_cuda() || (head_dim > 0 && head_dim % 8 == 0 && head_dim <= 256);
}

void check_decode_attention(const Tensor& like, const char* like_name, int64_t b, int64_t hq, int64_t d,
                            const Tensor& k_cache, const Tensor& v_cache, const Tensor& rows, const Tensor& lengths,
                            double scale, int64_t window, int64_t max_length, const char* op) {
  check_same(k_cache, like, op, "k_cache", like_name);
  check_same(v_cache, like, op, "v_cache", like_name);
  check_dims(k_cache, 4, op, "k_cache");
  check_shape(v_cache, k_cache.shape(), op, "v_cache");
  KCPP_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "op {}: the cache storage must be contiguous", op);
  check_cuda_available(like, op);
  const int64_t hkv = k_cache.size(1), c = k_cache.size(2);
  KCPP_CHECK(k_cache.size(3) == d, "op {}: {} has head dim {} but the cache {}", op, like_name, d, k_cache.size(3));
  KCPP_CHECK(hkv > 0 && hq % hkv == 0, "op {}: {} query heads are not a multiple of the cache's {} kv heads", op, hq, hkv);
  KCPP_CHECK(window >= 0, "op {}: window is {}; it must be 0 (none) or a positive number of keys", op, window);
  KCPP_CHECK(std::isfinite(scale) && scale > 0, "op {}: scale is {}; it must be a positive number", op, scale);
  KCPP_CHECK(max_length >= 0 && max_length <= c, "op {}: max_length {} is outside [0, {}] (the cache's capacity)", op,
             max_length, c);
  check_index_vector(rows, b, like.device(), op, "rows");
  check_index_vector(lengths, b, like.device(), op, "lengths");
  KCPP_CHECK(decode_attention_supported(like.device(), d),
             "op {}: head dim {} is not supported on {} (a multiple of 8, at most 256)", op, d, like.device().str());
}

Tensor decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& rows,
                        const Tensor& lengths, double scale, int64_t window, int64_t max_length) {
  constexpr const char* op = "decode_attention";
  check_float(q, op, "q");
  check_dims(q, 3, op, "q");
  const int64_t b = q.size(0), hq = q.size(1), d = q.size(2);
  check_decode_attention(q, "q", b, hq, d, k_cache, v_cache, rows, lengths, scale, window, max_length, op);
  const int64_t r = k_cache.size(0), hkv = k_cache.size(1), c = k_cache.size(2);
  // The GPU loads 16 bytes at a time: a q that does not start on such a boundary is copied.
  const Tensor qc = q.is_contiguous() && reinterpret_cast<uintptr_t>(q.data()) % 16 == 0 ? q : q.clone();
  Tensor out = Tensor::empty({b, hq, d}, q.dtype(), q.device());
  if (b == 0 || hq == 0 || d == 0) return out;
  if (q.device().is_cuda()) {
#if KCPP_WITH_CUDA
    cuda::decode_attention(out, qc, k_cache, v_cache, rows.contiguous(), lengths.contiguous(), scale, window,
                           max_length > 0 ? max_length : c);
#endif
    return out;
  }
  check_values(rows, 0, r - 1, op, "rows", "a row of the cache");
  check_values(lengths, 1, max_length > 0 ? max_length : c, op, "lengths", "keys of the row; at most max_length");
  const Tensor rows_c = rows.contiguous(), lengths_c = lengths.contiguous();
  const int32_t* rp = rows_c.data_ptr<int32_t>();
  const int32_t* lp = lengths_c.data_ptr<int32_t>();
  const int64_t g = hq / hkv;
  visit_floating(q.dtype(), op, [&]<typename T>(std::type_identity<T>) {
    using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
    const T* qv = qc.data_ptr<T>();
    const T* kv = k_cache.data_ptr<T>();
    const T* vv = v_cache.data_ptr<T>();
    T* ov = out.data_ptr<T>();
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t i = 0; i < b; ++i) {
      for (int64_t h = 0; h < hq; ++h) {
        const int64_t len = lp[i], lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
        const T* qh = qv + (i * hq + h) * d;
        const int64_t base = (static_cast<int64_t>(rp[i]) * hkv + h / g) * c;
        std::vector<A> s(static_cast<size_t>(len - lo)), o(static_cast<size_t>(d), A(0));
        A mx = -std::numeric_limits<A>::infinity();
        for (int64_t j = lo; j < len; ++j) {
          const T* kj = kv + (base + j) * d;
          A dot = 0;
#pragma omp simd reduction(+ : dot)
          for (int64_t e = 0; e < d; ++e) dot += static_cast<A>(to_f64(qh[e])) * static_cast<A>(to_f64(kj[e]));
          s[static_cast<size_t>(j - lo)] = dot * static_cast<A>(scale);
          mx = std::max(mx, s[static_cast<size_t>(j - lo)]);
        }
        A z = 0;
        for (int64_t j = lo; j < len; ++j) {
          const A p = std::exp(s[static_cast<size_t>(j - lo)] - mx);
          z += p;
          const T* vj = vv + (base + j) * d;
          for (int64_t e = 0; e < d; ++e) o[static_cast<size_t>(e)] += p * static_cast<A>(to_f64(vj[e]));
        }
        T* oh = ov + (i * hq + h) * d;
        for (int64_t e = 0; e < d; ++e) oh[e] = from_f64<T>(static_cast<double>(o[static_cast<size_t>(e)] / z));
      }
    }
  });
  return out;
}

void cache_write(const Tensor& k_cache, const Tensor& v_cache, const Tensor& k, const Tensor& v, const Tensor& rows,
                 const Tensor& positions) {
  constexpr const char* op = "cache_write";
  check_float(k, op, "k");
  check_dims(k, 3, op, "k");
  check_shape(v, k.shape(), op, "v");
  check_same(v, k, op, "v", "k");
  check_cache(k_cache, v_cache, k, op);
  check_cuda_available(k, op);
  const int64_t b = k.size(0), hkv = k.size(1), d = k.size(2), r = k_cache.size(0), c = k_cache.size(2);
  KCPP_CHECK(k_cache.size(1) == hkv && k_cache.size(3) == d, "op {}: k [{}, {}, {}] does not fit the cache {}", op, b, hkv,
             d, shape_str(k_cache.shape()));
  check_index_vector(rows, b, k.device(), op, "rows");
  check_index_vector(positions, b, k.device(), op, "positions");
  if (b == 0 || hkv == 0 || d == 0) return;
  if (k.device().is_cuda()) {
#if KCPP_WITH_CUDA
    cuda::cache_write(k_cache, v_cache, k.contiguous(), v.contiguous(), rows.contiguous(), positions.contiguous());
#endif
    return;
  }
  check_values(rows, 0, r - 1, op, "rows", "a row of the cache");
  check_values(positions, 0, c - 1, op, "positions", "a position of the cache's capacity");
  const Tensor rows_c = rows.contiguous(), positions_c = positions.contiguous();
  const int32_t* rp = rows_c.data_ptr<int32_t>();
  const int32_t* pp = positions_c.data_ptr<int32_t>();
  const Tensor kc = k.contiguous(), vc = v.contiguous();
  const size_t row_bytes = static_cast<size_t>(d) * dtype_size(k.dtype());
  auto* kd = static_cast<char*>(k_cache.data());
  auto* vd = static_cast<char*>(v_cache.data());
  const auto* ks = static_cast<const char*>(kc.data());
  const auto* vs = static_cast<const char*>(vc.data());
  for (int64_t i = 0; i < b; ++i)
    for (int64_t h = 0; h < hkv; ++h) {
      const int64_t dst = ((static_cast<int64_t>(rp[i]) * hkv + h) * c + pp[i]) * static_cast<int64_t>(row_bytes);
      const int64_t src = (i * hkv + h) * static_cast<int64_t>(row_bytes);
      std::copy_n(ks + src, row_bytes, kd + dst);
      std::copy_n(vs + src, row_bytes, vd + dst);
    }
}

}  // namespace kcpp::ops
