// Attention on the CPU (maths in attention.h).  Forward: blocks of kRows query rows in parallel, each
// key and value row widened to f32 once per block and used by every row of it; the scores of a block
// live in a per-thread buffer of kRows x Skv floats (never the Sq x Skv matrix).  Backward: one task
// per (batch, kv head), so the f32 accumulators of dk and dv have a single writer; dq is finished row
// block by row block.
#include <algorithm>
#include <cstdint>
#include <cmath>
#include <limits>
#include <vector>

#include "attention.h"
#include "kcpp/kernel/cpu.h"
#include "kcpp/kernel/error.h"

namespace kcpp::flash {

using kernel::DType;

// ---- shared checks ------------------------------------------------------------------------------

const char* attention_check(const AttentionParams& p, bool backward) {
  const char* op = backward ? "attention_backward" : "attention_forward";
  KCPP_KERNEL_REQUIRE(p.batch >= 0 && p.seq_q >= 0 && p.seq_kv >= 0, "%s: negative batch or sequence length", op);
  KCPP_KERNEL_REQUIRE(p.head_dim >= 1, "%s: head_dim %lld < 1", op, static_cast<long long>(p.head_dim));
  KCPP_KERNEL_REQUIRE(p.heads_kv >= 1 && p.heads_q >= p.heads_kv && p.heads_q % p.heads_kv == 0,
                      "%s: %lld query heads are not a multiple of %lld kv heads", op, static_cast<long long>(p.heads_q),
                      static_cast<long long>(p.heads_kv));
  KCPP_KERNEL_REQUIRE(p.seq_q <= p.seq_kv, "%s: %lld queries but only %lld keys (the queries are the last positions)", op,
                      static_cast<long long>(p.seq_q), static_cast<long long>(p.seq_kv));
  KCPP_KERNEL_REQUIRE(p.window >= 0, "%s: window %lld < 0", op, static_cast<long long>(p.window));
  KCPP_KERNEL_REQUIRE(std::isfinite(p.scale), "%s: scale is not finite", op);
  if (p.batch == 0 || p.seq_kv == 0) return nullptr;
  if (backward) KCPP_KERNEL_REQUIRE(p.dk.data && p.dv.data, "%s: dk or dv is null", op);
  if (p.seq_q == 0) return nullptr;
  KCPP_KERNEL_REQUIRE(p.q.data && p.k.data && p.v.data && p.out.data, "%s: q, k, v or out is null", op);
  if (backward) {
    KCPP_KERNEL_REQUIRE(p.lse, "%s: lse is null (the forward's, required)", op);
    KCPP_KERNEL_REQUIRE(p.dout.data && p.dq.data, "%s: dout or dq is null", op);
  }
  return nullptr;
}

bool attention_fast_path(const AttentionParams& p) {
  // The tensor-core forward takes the row maximum of the raw scores: a positive scale.
  if (p.dtype == DType::f32 || (p.head_dim != 64 && p.head_dim != 128) || !(p.scale > 0.0f)) return false;
  // 16-byte rows: every pointer aligned and every stride a multiple of 8 elements.
  for (const Operand* o : {&p.q, &p.k, &p.v, &p.out, &p.dout, &p.dq, &p.dk, &p.dv}) {
    if ((reinterpret_cast<uintptr_t>(o->data) & 15u) != 0) return false;
    if (o->sb % 8 != 0 || o->sh % 8 != 0 || o->ss % 8 != 0) return false;
  }
  return true;
}

size_t attention_backward_workspace(const AttentionParams& p) {
  const auto rows = static_cast<size_t>(p.batch * p.heads_q * p.seq_q);
  const size_t delta = (rows * sizeof(float) + 255) / 256 * 256;
  return delta + rows * static_cast<size_t>(p.head_dim) * sizeof(float);
}

// ---- CPU ----------------------------------------------------------------------------------------

namespace {

using kernel::cpu::load_row;
using kernel::cpu::store_row;
constexpr int64_t kRows = 8;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The keys query i sees: [lo, hi] (empty when lo > hi).
struct Range {
  int64_t lo, hi;
};
Range visible(const AttentionParams& p, int64_t i) {
  const int64_t pos = i + p.seq_kv - p.seq_q;
  return {p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0, p.causal ? pos : p.seq_kv - 1};
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t c = 0; c < n; ++c) s += a[c] * b[c];
  return s;
}
inline void axpy(float a, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) y[c] += a * x[c];
}

template <typename T> void forward(const AttentionParams& p) {
  const int64_t d = p.head_dim, group = p.heads_q / p.heads_kv, blocks = (p.seq_q + kRows - 1) / kRows;
  const int64_t tasks = p.batch * p.heads_q * blocks;
#pragma omp parallel
  {
    std::vector<float> q(kRows * d), o(kRows * d), kv(d), s(kRows * p.seq_kv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / (p.heads_q * blocks), h = task / blocks % p.heads_q, i0 = task % blocks * kRows;
      const int64_t rows = std::min(kRows, p.seq_q - i0), hk = h / group;
      Range r[kRows];
      int64_t lo = p.seq_kv, hi = -1;
      for (int64_t a = 0; a < rows; ++a) {
        r[a] = visible(p, i0 + a);
        lo = std::min(lo, r[a].lo), hi = std::max(hi, r[a].hi);
        load_row(p.q.at<T>(b, h, i0 + a), d, q.data() + a * d);
      }
      std::fill(o.begin(), o.end(), 0.0f);
      for (int64_t j = lo; j <= hi; ++j) {  // scores
        load_row(p.k.at<T>(b, hk, j), d, kv.data());
        for (int64_t a = 0; a < rows; ++a)
          s[a * p.seq_kv + j] = j >= r[a].lo && j <= r[a].hi ? p.scale * dot(q.data() + a * d, kv.data(), d) : kNegInf;
      }
      float inv[kRows];
      for (int64_t a = 0; a < rows; ++a) {  // softmax of each row, lse
        float* sa = s.data() + a * p.seq_kv;
        float mx = kNegInf;
        for (int64_t j = lo; j <= hi; ++j) mx = std::max(mx, sa[j]);
        double sum = 0.0;
        if (mx != kNegInf)
          for (int64_t j = lo; j <= hi; ++j) sum += (sa[j] = std::exp(sa[j] - mx));
        else
          for (int64_t j = lo; j <= hi; ++j) sa[j] = 0.0f;
        inv[a] = sum > 0.0 ? static_cast<float>(1.0 / sum) : 0.0f;
        // lse rounded once (the backward's p = exp(s - lse) is as exact as this rounding).
        if (p.lse) p.lse[(b * p.heads_q + h) * p.seq_q + i0 + a] = sum > 0.0 ? static_cast<float>(mx + std::log(sum)) : kNegInf;
      }
      for (int64_t j = lo; j <= hi; ++j) {  // out = p v
        load_row(p.v.at<T>(b, hk, j), d, kv.data());
        for (int64_t a = 0; a < rows; ++a)
          if (const float pj = s[a * p.seq_kv + j]; pj != 0.0f) axpy(pj, kv.data(), o.data() + a * d, d);
      }
      for (int64_t a = 0; a < rows; ++a) {
        float* oa = o.data() + a * d;
        for (int64_t c = 0; c < d; ++c) oa[c] *= inv[a];
        store_row(oa, d, p.out.mut<T>(b, h, i0 + a));
      }
    }
  }
}

template <typename T> void backward(const AttentionParams& p) {
  const int64_t d = p.head_dim, group = p.heads_q / p.heads_kv, tasks = p.batch * p.heads_kv;
#pragma omp parallel
  {
    std::vector<float> dk(p.seq_kv * d), dv(p.seq_kv * d), q(kRows * d), dout(kRows * d), dq(kRows * d), kr(d), vr(d),
        tmp(d);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / p.heads_kv, hk = task % p.heads_kv;
      std::fill(dk.begin(), dk.end(), 0.0f);
      std::fill(dv.begin(), dv.end(), 0.0f);
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
        for (int64_t i0 = 0; i0 < p.seq_q; i0 += kRows) {
          const int64_t rows = std::min(kRows, p.seq_q - i0);
          Range r[kRows];
          float lse[kRows], delta[kRows];
          int64_t lo = p.seq_kv, hi = -1;
          for (int64_t a = 0; a < rows; ++a) {
            r[a] = visible(p, i0 + a);
            lo = std::min(lo, r[a].lo), hi = std::max(hi, r[a].hi);
            load_row(p.q.at<T>(b, h, i0 + a), d, q.data() + a * d);
            load_row(p.dout.at<T>(b, h, i0 + a), d, dout.data() + a * d);
            load_row(p.out.at<T>(b, h, i0 + a), d, tmp.data());
            delta[a] = dot(dout.data() + a * d, tmp.data(), d);
            lse[a] = p.lse[(b * p.heads_q + h) * p.seq_q + i0 + a];
          }
          std::fill(dq.begin(), dq.end(), 0.0f);
          for (int64_t j = lo; j <= hi; ++j) {
            load_row(p.k.at<T>(b, hk, j), d, kr.data());
            load_row(p.v.at<T>(b, hk, j), d, vr.data());
            for (int64_t a = 0; a < rows; ++a) {
              if (j < r[a].lo || j > r[a].hi || lse[a] == kNegInf) continue;
              const float* qa = q.data() + a * d;
              const float* da = dout.data() + a * d;
              const float s = p.scale * dot(qa, kr.data(), d);  // as the forward rounded it
              const auto pj = static_cast<float>(std::exp(static_cast<double>(s) - lse[a]));
              const float ds = pj * (dot(da, vr.data(), d) - delta[a]);
              axpy(ds, kr.data(), dq.data() + a * d, d);
              axpy(ds, qa, dk.data() + j * d, d);
              axpy(pj, da, dv.data() + j * d, d);
            }
          }
          for (int64_t a = 0; a < rows; ++a) {
            float* g = dq.data() + a * d;
            for (int64_t c = 0; c < d; ++c) g[c] *= p.scale;
            store_row(g, d, p.dq.mut<T>(b, h, i0 + a));
          }
        }
      for (int64_t j = 0; j < p.seq_kv; ++j) {
        float* g = dk.data() + j * d;
        for (int64_t c = 0; c < d; ++c) g[c] *= p.scale;
        store_row(g, d, p.dk.mut<T>(b, hk, j));
        store_row(dv.data() + j * d, d, p.dv.mut<T>(b, hk, j));
      }
    }
  }
}

template <template <typename> class Fn> const char* dispatch(const AttentionParams& p) {
  switch (p.dtype) {
    case DType::f32: Fn<float>{}(p); return nullptr;
    case DType::bf16: Fn<kernel::cpu::bf16>{}(p); return nullptr;
    case DType::f16: Fn<kernel::cpu::f16>{}(p); return nullptr;
  }
  return "attention: unknown dtype";
}
template <typename T> struct Forward {
  void operator()(const AttentionParams& p) const { forward<T>(p); }
};
template <typename T> struct Backward {
  void operator()(const AttentionParams& p) const { backward<T>(p); }
};

}  // namespace

const char* attention_forward_cpu(const AttentionParams& p) {
  if (const char* e = attention_check(p, false)) return e;
  if (p.batch == 0 || p.seq_q == 0) return nullptr;
  return dispatch<Forward>(p);
}

const char* attention_backward_cpu(const AttentionParams& p) {
  if (const char* e = attention_check(p, true)) return e;
  if (p.batch == 0 || p.seq_kv == 0) return nullptr;  // with no queries, dk and dv are zeros
  return dispatch<Backward>(p);
}

}  // namespace kcpp::flash
