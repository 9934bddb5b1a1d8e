// Attention on the CPU (maths and layouts in attention.h).  Forward: blocks of kRows query rows in parallel, each
// key and value row widened to f32 once per block and used by every row of it; the scores of a block
// live in a per-thread buffer of kRows x Skv floats (never the Sq x Skv matrix).  Backward: one task
// per (batch, kv head), so the f32 accumulators of dk and dv have a single writer; dq is finished row
// block by row block.  varlen: the same tasks over (sequence, ...), each reading its sequence's begin
// and lengths (sequence()); a task past its sequence's queries does nothing.
#include <algorithm>
#include <cstdint>
#include <type_traits>
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
  KCPP_KERNEL_REQUIRE((p.cu_seqlens_q == nullptr) == (p.cu_seqlens_k == nullptr),
                      "%s: cu_seqlens_q and cu_seqlens_k come together", op);
  KCPP_KERNEL_REQUIRE(p.total_q >= 0 && p.total_kv >= 0, "%s: negative total token count", op);
  // Batched: the queries are the last Sq positions of the keys.  varlen: per sequence, any lengths.
  if (!p.varlen())
    KCPP_KERNEL_REQUIRE(p.seq_q <= p.seq_kv, "%s: %lld queries but only %lld keys (the queries are the last positions)", op,
                        static_cast<long long>(p.seq_q), static_cast<long long>(p.seq_kv));
  KCPP_KERNEL_REQUIRE(p.window >= 0, "%s: window %lld < 0", op, static_cast<long long>(p.window));
  KCPP_KERNEL_REQUIRE(std::isfinite(p.scale), "%s: scale is not finite", op);
  KCPP_KERNEL_REQUIRE(p.softcap >= 0.0f && std::isfinite(p.softcap), "%s: softcap %g must be >= 0 and finite (0: none)", op,
                      static_cast<double>(p.softcap));
  // The tensor-core paths scale the scores by scale / softcap in f32.
  KCPP_KERNEL_REQUIRE(p.softcap == 0.0f || std::isfinite(p.scale / p.softcap), "%s: scale %g / softcap %g overflows a float", op,
                      static_cast<double>(p.scale), static_cast<double>(p.softcap));
  // No keys: batched, no queries either (nothing to check); varlen may still have queries (out / dq zero).
  const bool keys = p.batch > 0 && p.seq_kv > 0, queries = p.batch > 0 && p.seq_q > 0;
  if (backward && keys) KCPP_KERNEL_REQUIRE(p.dk.data && p.dv.data, "%s: dk or dv is null", op);
  if (!queries) return nullptr;
  KCPP_KERNEL_REQUIRE(p.q.data && p.out.data && (!keys || (p.k.data && p.v.data)), "%s: q, k, v or out is null", op);
  if (backward) {
    KCPP_KERNEL_REQUIRE(p.lse, "%s: lse is null (the forward's, required)", op);
    KCPP_KERNEL_REQUIRE(p.dout.data && p.dq.data, "%s: dout or dq is null", op);
  }
  return nullptr;
}

const char* attention_check_varlen(const AttentionParams& p) {
  if (!p.varlen()) return nullptr;
  const struct {
    const char* name;
    const int32_t* cu;
    int64_t total, max;
    const char* max_name;
  } sides[] = {{"cu_seqlens_q", p.cu_seqlens_q, p.total_q, p.seq_q, "max_seqlen_q"},
               {"cu_seqlens_k", p.cu_seqlens_k, p.total_kv, p.seq_kv, "max_seqlen_k"}};
  for (const auto& x : sides) {
    KCPP_KERNEL_REQUIRE(x.cu[0] == 0, "attention: %s[0] is %d; expected 0", x.name, x.cu[0]);
    for (int64_t b = 0; b < p.batch; ++b) {
      KCPP_KERNEL_REQUIRE(x.cu[b + 1] >= x.cu[b], "attention: %s decreases (entry %lld is %d, entry %lld is %d)",
                          x.name, static_cast<long long>(b), x.cu[b], static_cast<long long>(b + 1), x.cu[b + 1]);
      KCPP_KERNEL_REQUIRE(x.cu[b + 1] - x.cu[b] <= x.max, "attention: sequence %lld has %d tokens in %s, more than %s = %lld",
                          static_cast<long long>(b), x.cu[b + 1] - x.cu[b], x.name, x.max_name, static_cast<long long>(x.max));
    }
    KCPP_KERNEL_REQUIRE(x.cu[p.batch] == x.total, "attention: the last entry of %s is %d but the tensors hold %lld tokens",
                        x.name, x.cu[p.batch], static_cast<long long>(x.total));
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
  const auto rows = static_cast<size_t>(lse_rows(p));
  auto aligned = [](size_t n) { return (n + 255) / 256 * 256; };
  // delta (f32), the generic path's f64 log-sum-exp and delta, the tensor-core path's dq accumulator (f32).
  return aligned(rows * sizeof(float)) + aligned(2 * rows * sizeof(double)) +
         rows * static_cast<size_t>(p.head_dim) * sizeof(float);
}

// ---- CPU ----------------------------------------------------------------------------------------

namespace {

constexpr int64_t kRows = 8;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The keys query i of sequence `sq` sees: [lo, hi] (empty when lo > hi).
struct Range {
  int64_t lo, hi;
};
Range visible(const AttentionParams& p, const Sequence& sq, int64_t i) {
  const int64_t pos = i + sq.seq_kv - sq.seq_q;
  return {p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0,
          p.causal ? pos : sq.seq_kv - 1};
}

// The accumulation type: f64 for f32 inputs (f32's bound, a few units of roundoff against the f64
// oracle, leaves no room for the different summation order of a tiled algorithm), f32 for 16-bit.
template <typename T> using Acc = std::conditional_t<std::is_same_v<T, float>, double, float>;

// The score of t = scale q.k (attention.h): c tanh(t / c) with softcap c, else t.
template <typename A> inline A capped(A t, A c) { return c > A(0) ? c * std::tanh(t / c) : t; }
// d score / d t at score s: 1 - (s / c)^2 with softcap c, else 1.
template <typename A> inline A cap_slope(A s, A c) { return c > A(0) ? A(1) - (s / c) * (s / c) : A(1); }

template <typename A> inline A dot(const A* a, const A* b, int64_t n) {
  A s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t c = 0; c < n; ++c) s += a[c] * b[c];
  return s;
}
template <typename A> inline void axpy(A a, const A* x, A* y, int64_t n) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) y[c] += a * x[c];
}
template <typename T, typename A> inline void load(const T* src, int64_t n, A* dst) {
  for (int64_t c = 0; c < n; ++c) dst[c] = static_cast<A>(kernel::cpu::to_f32(src[c]));
}
template <typename T, typename A> inline void store(const A* src, int64_t n, A scale, T* dst) {
  for (int64_t c = 0; c < n; ++c) dst[c] = kernel::cpu::from_f32<T>(static_cast<float>(src[c] * scale));
}

template <typename T> KCPP_CPU_MULTIVERSION void forward(const AttentionParams& p) {
  using A = Acc<T>;
  const A ninf = -std::numeric_limits<A>::infinity();
  const int64_t d = p.head_dim, group = p.heads_q / p.heads_kv, blocks = (p.seq_q + kRows - 1) / kRows;
  const int64_t tasks = p.batch * p.heads_q * blocks;
  const A cap = A(p.softcap);
#pragma omp parallel
  {
    std::vector<A> q(kRows * d), o(kRows * d), kv(d), s(kRows * p.seq_kv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / (p.heads_q * blocks), h = task / blocks % p.heads_q, i0 = task % blocks * kRows;
      const Sequence seq = sequence(p, b);
      if (i0 >= seq.seq_q) continue;  // varlen: past this sequence's queries
      const int64_t rows = std::min(kRows, seq.seq_q - i0), hk = h / group, qb = seq.q_begin, kb = seq.k_begin;
      Range r[kRows];
      int64_t lo = seq.seq_kv, hi = -1;
      for (int64_t a = 0; a < rows; ++a) {
        r[a] = visible(p, seq, i0 + a);
        lo = std::min(lo, r[a].lo), hi = std::max(hi, r[a].hi);
        load(p.q.at<T>(b, h, qb + i0 + a), d, q.data() + a * d);
      }
      std::fill(o.begin(), o.end(), A(0));
      for (int64_t j = lo; j <= hi; ++j) {  // scores
        load(p.k.at<T>(b, hk, kb + j), d, kv.data());
        for (int64_t a = 0; a < rows; ++a)
          s[a * p.seq_kv + j] = j >= r[a].lo && j <= r[a].hi ? capped(A(p.scale) * dot(q.data() + a * d, kv.data(), d), cap) : ninf;
      }
      A inv[kRows];
      for (int64_t a = 0; a < rows; ++a) {  // softmax of each row, lse
        A* sa = s.data() + a * p.seq_kv;
        A mx = ninf;
        for (int64_t j = lo; j <= hi; ++j) mx = std::max(mx, sa[j]);
        double sum = 0.0;
        if (mx != ninf)
          for (int64_t j = lo; j <= hi; ++j) sum += (sa[j] = std::exp(sa[j] - mx));
        else
          for (int64_t j = lo; j <= hi; ++j) sa[j] = A(0);
        inv[a] = sum > 0.0 ? static_cast<A>(1.0 / sum) : A(0);
        // lse rounded once (the backward's p = exp(s - lse) is as exact as this rounding).
        if (p.lse)
          p.lse[lse_row(p, b, h, qb + i0 + a)] = sum > 0.0 ? static_cast<float>(mx + std::log(sum)) : kNegInf;
      }
      for (int64_t j = lo; j <= hi; ++j) {  // out = p v
        load(p.v.at<T>(b, hk, kb + j), d, kv.data());
        for (int64_t a = 0; a < rows; ++a)
          if (const A pj = s[a * p.seq_kv + j]; pj != A(0)) axpy(pj, kv.data(), o.data() + a * d, d);
      }
      for (int64_t a = 0; a < rows; ++a) store(o.data() + a * d, d, inv[a], p.out.mut<T>(b, h, qb + i0 + a));
    }
  }
}

template <typename T> KCPP_CPU_MULTIVERSION void backward(const AttentionParams& p) {
  using A = Acc<T>;
  const int64_t d = p.head_dim, group = p.heads_q / p.heads_kv, tasks = p.batch * p.heads_kv;
  const A cap = A(p.softcap);
#pragma omp parallel
  {
    std::vector<A> dk(p.seq_kv * d), dv(p.seq_kv * d), q(kRows * d), dout(kRows * d), dq(kRows * d), kr(d), vr(d), tmp(d);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / p.heads_kv, hk = task % p.heads_kv;
      const Sequence seq = sequence(p, b);
      const int64_t qb = seq.q_begin, kb = seq.k_begin;
      std::fill(dk.begin(), dk.end(), A(0));
      std::fill(dv.begin(), dv.end(), A(0));
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
        for (int64_t i0 = 0; i0 < seq.seq_q; i0 += kRows) {
          const int64_t rows = std::min(kRows, seq.seq_q - i0);
          Range r[kRows];
          A lse[kRows], delta[kRows];
          int64_t lo = seq.seq_kv, hi = -1;
          for (int64_t a = 0; a < rows; ++a) {
            r[a] = visible(p, seq, i0 + a);
            lo = std::min(lo, r[a].lo), hi = std::max(hi, r[a].hi);
            load(p.q.at<T>(b, h, qb + i0 + a), d, q.data() + a * d);
            load(p.dout.at<T>(b, h, qb + i0 + a), d, dout.data() + a * d);
            load(p.out.at<T>(b, h, qb + i0 + a), d, tmp.data());
            delta[a] = dot(dout.data() + a * d, tmp.data(), d);
            lse[a] = p.lse[lse_row(p, b, h, qb + i0 + a)];
          }
          if constexpr (std::is_same_v<T, float>) {
            // f32: the log-sum-exp again in f64.  The saved one is rounded to f32, an error of
            // u |lse| in every p, which f32's bound (a few units of roundoff) cannot absorb.
            for (int64_t a = 0; a < rows; ++a) {
              if (lse[a] == -std::numeric_limits<A>::infinity()) continue;
              A mx = -std::numeric_limits<A>::infinity(), sum = 0;
              for (int64_t j = r[a].lo; j <= r[a].hi; ++j) {  // online: one dot per key
                load(p.k.at<T>(b, hk, kb + j), d, kr.data());
                const A x = capped(A(p.scale) * dot(q.data() + a * d, kr.data(), d), cap);
                if (x > mx) sum = sum * std::exp(mx - x) + 1, mx = x;
                else sum += std::exp(x - mx);
              }
              lse[a] = mx + std::log(sum);
            }
          }
          std::fill(dq.begin(), dq.end(), A(0));
          for (int64_t j = lo; j <= hi; ++j) {
            load(p.k.at<T>(b, hk, kb + j), d, kr.data());
            load(p.v.at<T>(b, hk, kb + j), d, vr.data());
            for (int64_t a = 0; a < rows; ++a) {
              if (j < r[a].lo || j > r[a].hi || lse[a] == -std::numeric_limits<A>::infinity()) continue;
              const A* qa = q.data() + a * d;
              const A* da = dout.data() + a * d;
              const A sj = capped(A(p.scale) * dot(qa, kr.data(), d), cap), pj = std::exp(sj - lse[a]);
              const A ds = pj * (dot(da, vr.data(), d) - delta[a]) * cap_slope(sj, cap);
              axpy(ds, kr.data(), dq.data() + a * d, d);
              axpy(ds, qa, dk.data() + j * d, d);
              axpy(pj, da, dv.data() + j * d, d);
            }
          }
          for (int64_t a = 0; a < rows; ++a) store(dq.data() + a * d, d, A(p.scale), p.dq.mut<T>(b, h, qb + i0 + a));
        }
      for (int64_t j = 0; j < seq.seq_kv; ++j) {
        store(dk.data() + j * d, d, A(p.scale), p.dk.mut<T>(b, hk, kb + j));
        store(dv.data() + j * d, d, A(1), p.dv.mut<T>(b, hk, kb + j));
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
  if (const char* e = attention_check_varlen(p)) return e;
  if (p.batch == 0 || p.seq_q == 0) return nullptr;
  return dispatch<Forward>(p);
}

const char* attention_backward_cpu(const AttentionParams& p) {
  if (const char* e = attention_check(p, true)) return e;
  if (const char* e = attention_check_varlen(p)) return e;
  // Batched, no keys means no queries: nothing to write.  varlen with no keys at all (max_seqlen_k 0) may
  // still have queries, whose dq is zero: the tasks write it.
  if (p.batch == 0 || (p.seq_kv == 0 && !p.varlen())) return nullptr;
  return dispatch<Backward>(p);
}

}  // namespace kcpp::flash
