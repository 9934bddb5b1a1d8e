// Mixture-of-experts on the CPU (maths, layout and permutation in moe.h), and the checks and the
// load-balancing loss shared with CUDA's callers.  The GEMMs are OpenBLAS sgemm on f32: f32 weights are
// read in place in either layout (a transposed operand is a CblasTrans), 16-bit ones are widened one
// expert at a time, and only for experts that received tokens.  Each expert's rows are gathered into
// a dense block (scaled by their routing weights for WeightOn::Input), so one expert is a few GEMMs
// over exactly its tokens; the expert outputs land in expert order and are summed per token in slot
// order (no float reductions whose order depends on scheduling).
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kcpp/kernel/cpu.h"
#include "kcpp/kernel/error.h"
#include "moe.h"

namespace kcpp::moe {
namespace {

using kernel::Activation;
using kernel::DType;
using kernel::errorf;
using kernel::cpu::from_f32;
using kernel::cpu::round_to;
using kernel::cpu::to_f32;

constexpr size_t kAlign = 256;

// A bump allocator over the workspace; with a null base it only counts (moe_workspace()).
struct Carve {
  unsigned char* base = nullptr;
  size_t used = 0;
  template <typename U> U* take(int64_t n) {
    const size_t bytes = (static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(U) + kAlign - 1) / kAlign * kAlign;
    U* q = base ? reinterpret_cast<U*>(base + used) : nullptr;
    used += bytes;
    return q;
  }
};

// An f32 matrix for sgemm: logical element (r, c) at p[r * ld + c], or at p[c * ld + r] when t.
struct View {
  const float* p = nullptr;
  int64_t ld = 1;
  bool t = false;
};
View tr(View v) {
  v.t = !v.t;
  return v;
}

// C[m, n] (ldc) = A[m, k] B[k, n] + beta C.
void gemm(int64_t m, int64_t n, int64_t k, View a, View b, float* c, int64_t ldc, float beta) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
    return;
  }
  cblas_sgemm(CblasRowMajor, a.t ? CblasTrans : CblasNoTrans, b.t ? CblasTrans : CblasNoTrans, static_cast<int>(m),
              static_cast<int>(n), static_cast<int>(k), 1.0f, a.p, static_cast<int>(a.ld), b.p, static_cast<int>(b.ld), beta,
              c, static_cast<int>(ldc));
}

// Expert e's rows x cols matrix as an f32 View: in place for f32, else widened into buf (same order).
template <typename T> View expert_view(const Matrix& m, int64_t e, int64_t rows, int64_t cols, float* buf) {
  bool cm = false;
  int64_t ld = 0;
  matrix_storage(rows, cols, m.row_stride, m.col_stride, &cm, &ld);
  const T* base = static_cast<const T*>(m.data) + e * m.expert_stride;
  if constexpr (std::is_same_v<T, float>) {
    return {base, ld, cm};
  } else {
    const int64_t outer = cm ? cols : rows, inner = cm ? rows : cols;
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t i = 0; i < inner; ++i) buf[o * inner + i] = to_f32(base[o * ld + i]);
    return {buf, inner, cm};
  }
}

// Writes the dense f32 [rows, cols] g into expert e's matrix of m (rounded); zeros when g is null.
template <typename T> void store_matrix(const Matrix& m, int64_t e, int64_t rows, int64_t cols, const float* g) {
  T* base = static_cast<T*>(m.data) + e * m.expert_stride;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      base[r * m.row_stride + c * m.col_stride] = from_f32<T>(g ? g[r * cols + c] : 0.0f);
}

// Rows [T, H] of a tensor (ld elements apart) as an f32 View: in place for f32, else widened into buf.
template <typename T> View rows_view(const void* data, int64_t rows, int64_t cols, int64_t ld, float* buf) {
  const T* src = static_cast<const T*>(data);
  if constexpr (std::is_same_v<T, float>) {
    return {src, rows <= 1 ? std::max<int64_t>(cols, 1) : ld, false};
  } else {
#pragma omp parallel for schedule(static) if (rows * cols > (int64_t(1) << 18))
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) buf[r * cols + c] = to_f32(src[r * ld + c]);
    return {buf, std::max<int64_t>(cols, 1), false};
  }
}

template <typename T> void round_inplace(float* v, int64_t n) {
  if constexpr (!std::is_same_v<T, float>)
    for (int64_t i = 0; i < n; ++i) v[i] = round_to<T>(v[i]);
}

template <typename F> void with_activation(Activation a, F&& f) {
  switch (a) {
    case Activation::Silu: f(std::integral_constant<Activation, Activation::Silu>{}); break;
    case Activation::Gelu: f(std::integral_constant<Activation, Activation::Gelu>{}); break;
    case Activation::GeluTanh: f(std::integral_constant<Activation, Activation::GeluTanh>{}); break;
    case Activation::QuickGelu: f(std::integral_constant<Activation, Activation::QuickGelu>{}); break;
  }
}

// h [n, I] = round(act(g) * u) from gu [n, 2I].
template <typename T> void gated(Activation a, const float* gu, int64_t n, int64_t inter, float* h) {
  with_activation(a, [&](auto tag) {
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < inter; ++c) {
        const float g = gu[r * 2 * inter + c], u = gu[r * 2 * inter + inter + c];
        h[r * inter + c] = round_to<T>(kernel::activate<decltype(tag)::value>(g, nullptr) * u);
      }
  });
}

// dgu [n, 2I] = round([dh * u * act'(g), dh * act(g)]); dgu may be gu (each pair is read before it is written).
template <typename T> void gated_backward(Activation a, const float* gu, const float* dh, int64_t n, int64_t inter,
                                          float* dgu) {
  with_activation(a, [&](auto tag) {
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < inter; ++c) {
        const float g = gu[r * 2 * inter + c], u = gu[r * 2 * inter + inter + c], d = dh[r * inter + c];
        float da = 0.0f;
        const float act = kernel::activate<decltype(tag)::value>(g, &da);
        dgu[r * 2 * inter + c] = round_to<T>(d * u * da);
        dgu[r * 2 * inter + inter + c] = round_to<T>(d * act);
      }
  });
}

// The routing of one token from its (rounded) logits z [E]: ids and weights [k]; scratch: E floats
// and E bytes (Softmax leaves p in `score`).
void route(const float* z, int64_t e_count, int64_t k, Routing r, bool normalize, float* score, unsigned char* taken,
           int32_t* ids, float* w) {
  if (r == Routing::Softmax) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t e = 0; e < e_count; ++e) m = std::max(m, z[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < e_count; ++e) sum += score[e] = std::exp(z[e] - m);
    for (int64_t e = 0; e < e_count; ++e) score[e] /= sum;
  }
  std::fill(taken, taken + e_count, static_cast<unsigned char>(0));
  for (int64_t j = 0; j < k; ++j) {  // by z: the order of p, without p's ties between distinct z
    int64_t best = -1;
    for (int64_t e = 0; e < e_count; ++e)
      if (!taken[e] && (best < 0 || z[e] > z[best])) best = e;
    taken[best] = 1;
    ids[j] = static_cast<int32_t>(best);
  }
  if (r == Routing::Softmax) {
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) sum += w[j] = score[ids[j]];
    if (normalize)
      for (int64_t j = 0; j < k; ++j) w[j] /= sum;
  } else {
    for (int64_t j = 0; j < k; ++j) w[j] = 1.0f / (1.0f + std::exp(-z[ids[j]]));
  }
}

// Reads slot s's expert id and weight (router output or the host's "given" tensors).
struct Slots {
  const void* ids;
  bool i64;
  const void* weights;
  bool f32;
  DType dtype;
  int64_t id(int64_t s) const {
    return i64 ? static_cast<const int64_t*>(ids)[s] : static_cast<int64_t>(static_cast<const int32_t*>(ids)[s]);
  }
  float weight(int64_t s) const {
    if (f32) return static_cast<const float*>(weights)[s];
    if (dtype == DType::bf16) return to_f32(static_cast<const kernel::cpu::bf16*>(weights)[s]);
    return to_f32(static_cast<const kernel::cpu::f16*>(weights)[s]);
  }
};

// Counting sort of the slots by expert (invalid ids in the bucket E), stable: offsets [E + 2], sorted
// [S] and its inverse pos [S]; cursor is E + 1 ints of scratch.
void permute(const Slots& sl, int64_t slots, int64_t e_count, int32_t* offsets, int32_t* sorted, int32_t* pos,
             int32_t* cursor) {
  std::fill(cursor, cursor + e_count + 1, 0);
  auto bucket = [&](int64_t s) {
    const int64_t id = sl.id(s);
    return id >= 0 && id < e_count ? id : e_count;
  };
  for (int64_t s = 0; s < slots; ++s) ++cursor[bucket(s)];
  offsets[0] = 0;
  for (int64_t b = 0; b <= e_count; ++b) offsets[b + 1] = offsets[b] + cursor[b];
  std::copy(offsets, offsets + e_count + 1, cursor);
  for (int64_t s = 0; s < slots; ++s) {
    const int32_t p = cursor[bucket(s)]++;
    sorted[p] = static_cast<int32_t>(s);
    if (pos) pos[s] = p;
  }
}

// ---- workspace layout ----------------------------------------------------------------------------

struct Buffers {
  // both directions
  float *xw = nullptr;                    // hidden widened [T, H] (16-bit)
  float *logits = nullptr;                // [T, E] f32
  float *score = nullptr;                 // [E]
  unsigned char* taken = nullptr;         // [E]
  int32_t *ids = nullptr;                 // [S] (router output without a topk_ids tensor)
  float* weights = nullptr;               // [S]
  int32_t *offsets = nullptr, *sorted = nullptr, *pos = nullptr, *cursor = nullptr;
  float *router_w = nullptr;              // [E, H] widened (16-bit)
  float *wg = nullptr, *wu = nullptr, *wd = nullptr;  // one expert's weights widened (16-bit)
  float *xs = nullptr, *gu = nullptr, *h = nullptr;   // [n, H], [n, 2I], [n, I]
  float* y = nullptr;                     // forward: [S, H] expert outputs by position
  // shared expert
  float *swg = nullptr, *swu = nullptr, *swd = nullptr, *sgu = nullptr, *sh = nullptr, *sm = nullptr, *sigma = nullptr;
  // backward
  float *dw = nullptr;                    // weights widened dout [T, H] (16-bit) -> dout view
  float *ds = nullptr, *q = nullptr, *ch = nullptr, *dgu = nullptr;  // [n, H], [n, I], [n, I], [n, 2I] (dgu: over gu)
  float *gw_gu = nullptr, *gw_d = nullptr;  // weight gradients of one expert: [I, H] (x2, reused), [H, I]
  float *dx = nullptr;                    // [S, H] per position
  float *dws = nullptr;                   // [S] routing weight gradients by slot
  float *dz = nullptr;                    // [T, E]
  float *drouter = nullptr;               // [E, H]
  float *dxr = nullptr;                   // [T, H] the router's and shared expert's part of dx
  float *sq = nullptr, *sdgu = nullptr, *sdl = nullptr;  // shared: [T, Is], [T, 2Is] (over sgu), [T]
};

Buffers layout(const MoeParams& p, bool bwd, Carve& cv) {
  Buffers b;
  const bool narrow = p.dtype != DType::f32, router = p.routing != Routing::Given;
  const int64_t t = p.tokens, h = p.hidden, e = p.experts, s = moe_slots(p), i = p.inter, si = p.shared_inter;
  const int64_t nmax = std::min(s, p.routing == Routing::Given ? s : t);  // rows one expert can receive
  if (narrow) b.xw = cv.take<float>(t * h);
  if (router) {
    b.logits = cv.take<float>(t * e);
    b.score = cv.take<float>(e);
    b.taken = cv.take<unsigned char>(e);
    if (narrow) b.router_w = cv.take<float>(e * h);
  }
  if (!bwd && router && !p.topk_ids) b.ids = cv.take<int32_t>(s);
  if (!bwd && router && !p.topk_weights) b.weights = cv.take<float>(s);
  if (bwd || !p.expert_offsets) b.offsets = cv.take<int32_t>(e + 2);
  if (bwd || !p.sorted_slots) b.sorted = cv.take<int32_t>(s);
  b.pos = cv.take<int32_t>(s);
  b.cursor = cv.take<int32_t>(e + 1);
  if (narrow) {
    b.wg = cv.take<float>(i * h);
    b.wu = cv.take<float>(i * h);
    b.wd = cv.take<float>(h * i);
  }
  b.xs = cv.take<float>(nmax * h);
  b.gu = cv.take<float>(nmax * 2 * i);
  b.h = cv.take<float>(nmax * i);
  if (si > 0) {
    if (narrow) {
      b.swg = cv.take<float>(si * h);
      b.swu = cv.take<float>(si * h);
      b.swd = cv.take<float>(h * si);
    }
    b.sgu = cv.take<float>(t * 2 * si);
    b.sh = cv.take<float>(t * si);
    b.sigma = cv.take<float>(t);
  }
  if (!bwd) {
    b.y = cv.take<float>(s * h);
    if (si > 0) b.sm = cv.take<float>(t * h);
    return b;
  }
  if (narrow) b.dw = cv.take<float>(t * h);
  b.ds = cv.take<float>(nmax * h);
  b.q = cv.take<float>(nmax * i);
  b.ch = cv.take<float>(nmax * i);
  b.dgu = b.gu;  // [dg, du] over the [g, u] it is formed from (gated_backward reads each pair before writing it)
  const int64_t wmax = std::max(i, si) * h;
  b.gw_gu = cv.take<float>(wmax);
  b.gw_d = cv.take<float>(wmax);
  b.dx = cv.take<float>(s * h);
  b.dws = cv.take<float>(s);
  if (router) b.dz = cv.take<float>(t * e);
  if (router && p.drouter) b.drouter = cv.take<float>(e * h);
  b.dxr = cv.take<float>(t * h);
  if (si > 0) {
    b.sq = cv.take<float>(t * si);
    b.sdgu = b.sgu;  // likewise over the shared expert's [g', u']
    b.sdl = cv.take<float>(t);
  }
  return b;
}

// ---- forward -------------------------------------------------------------------------------------

// Gathers expert rows [p0, p0 + n) into xs: x_t, or round(w x_t) for WeightOn::Input.
template <typename T> void gather_inputs(const MoeParams& p, const Slots& sl, const int32_t* sorted, int64_t p0, int64_t n,
                                         View x, float* xs) {
  const int64_t h = p.hidden;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t s = sorted[p0 + r], t = s / p.top_k;
    const float* src = x.p + t * x.ld;
    float* dst = xs + r * h;
    if (p.weight_on == WeightOn::Output) {
      std::memcpy(dst, src, static_cast<size_t>(h) * sizeof(float));
    } else {
      const float w = sl.weight(s);
      for (int64_t c = 0; c < h; ++c) dst[c] = round_to<T>(w * src[c]);
    }
  }
}

// gu [n, 2I] = round(xs [Wg; Wu]^T) for gate / up views [I, H].
template <typename T> void project(View xs, int64_t n, int64_t h, int64_t inter, View wg, View wu, float* gu) {
  gemm(n, inter, h, xs, tr(wg), gu, 2 * inter, 0.0f);
  gemm(n, inter, h, xs, tr(wu), gu + inter, 2 * inter, 0.0f);
  round_inplace<T>(gu, n * 2 * inter);
}

// sigma_t = sigmoid(x_t . gs), or 1.
template <typename T> void shared_gate(const MoeParams& p, View x, float* sigma) {
  const T* gs = static_cast<const T*>(p.shared_expert_gate);
  for (int64_t t = 0; t < p.tokens; ++t) {
    if (!gs) {
      sigma[t] = 1.0f;
      continue;
    }
    float dot = 0.0f;
    for (int64_t c = 0; c < p.hidden; ++c) dot += x.p[t * x.ld + c] * to_f32(gs[c]);
    sigma[t] = 1.0f / (1.0f + std::exp(-dot));
  }
}

template <typename T> const char* forward(const MoeParams& p) {
  const int64_t tk = p.tokens, h = p.hidden, ne = p.experts, k = p.top_k, inter = p.inter, si = p.shared_inter;
  const int64_t s_count = moe_slots(p);
  Carve cv{static_cast<unsigned char*>(p.workspace)};
  Buffers b = layout(p, false, cv);
  const View x = rows_view<T>(p.x, tk, h, p.x_stride, b.xw);

  // Routing.
  Slots sl{p.topk_ids, p.ids_i64, p.topk_weights, p.weights_f32 || p.dtype == DType::f32, p.dtype};
  if (p.routing != Routing::Given) {
    const View wr = rows_view<T>(p.router, ne, h, h, b.router_w);
    gemm(tk, ne, h, x, tr(wr), b.logits, ne, 0.0f);
    round_inplace<T>(b.logits, tk * ne);
    if (p.router_logits) {
      T* rl = static_cast<T*>(p.router_logits);
      for (int64_t i = 0; i < tk * ne; ++i) rl[i] = from_f32<T>(b.logits[i]);
    }
    int32_t* ids = p.topk_ids ? static_cast<int32_t*>(p.topk_ids) : b.ids;
    float* w = p.topk_weights ? static_cast<float*>(p.topk_weights) : b.weights;
    for (int64_t t = 0; t < tk; ++t)
      route(b.logits + t * ne, ne, k, p.routing, p.normalize, b.score, b.taken, ids + t * k, w + t * k);
    sl = Slots{ids, false, w, true, p.dtype};
  }
  int32_t* offsets = p.expert_offsets ? p.expert_offsets : b.offsets;
  int32_t* sorted = p.sorted_slots ? p.sorted_slots : b.sorted;
  permute(sl, s_count, ne, offsets, sorted, b.pos, b.cursor);

  // Experts, each over exactly its rows.
  for (int64_t e = 0; e < ne; ++e) {
    const int64_t p0 = offsets[e], n = offsets[e + 1] - p0;
    if (n == 0) continue;
    gather_inputs<T>(p, sl, sorted, p0, n, x, b.xs);
    const View wg = expert_view<T>(p.gate, e, inter, h, b.wg), wu = expert_view<T>(p.up, e, inter, h, b.wu);
    const View wd = expert_view<T>(p.down, e, h, inter, b.wd);
    project<T>({b.xs, h, false}, n, h, inter, wg, wu, b.gu);
    if (p.gate_up) {
      T* gu = static_cast<T*>(p.gate_up) + p0 * 2 * inter;
      for (int64_t i = 0; i < n * 2 * inter; ++i) gu[i] = from_f32<T>(b.gu[i]);
    }
    gated<T>(p.act, b.gu, n, inter, b.h);
    float* y = b.y + p0 * h;
    gemm(n, h, inter, {b.h, inter, false}, tr(wd), y, h, 0.0f);
    round_inplace<T>(y, n * h);
  }

  // The shared expert over every token.
  if (si > 0) {
    const View wg = expert_view<T>(p.shared_gate, 0, si, h, b.swg), wu = expert_view<T>(p.shared_up, 0, si, h, b.swu);
    const View wd = expert_view<T>(p.shared_down, 0, h, si, b.swd);
    project<T>(x, tk, h, si, wg, wu, b.sgu);
    gated<T>(p.act, b.sgu, tk, si, b.sh);
    gemm(tk, h, si, {b.sh, si, false}, tr(wd), b.sm, h, 0.0f);
    round_inplace<T>(b.sm, tk * h);
    shared_gate<T>(p, x, b.sigma);
  }

  // out_t = sum_j c_s y_s (+ sigma_t m_t), slots in order.
  T* out = static_cast<T*>(p.out);
#pragma omp parallel for schedule(static) if (tk * h * k > (int64_t(1) << 18))
  for (int64_t t = 0; t < tk; ++t) {
    T* o = out + t * p.out_stride;
    for (int64_t c = 0; c < h; ++c) {
      float acc = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t s = t * k + j, pos = b.pos[s];
        if (pos >= offsets[ne]) continue;  // a slot no expert takes
        const float coef = p.weight_on == WeightOn::Output ? sl.weight(s) : 1.0f;
        acc += coef * b.y[pos * h + c];
      }
      if (si > 0) acc += b.sigma[t] * b.sm[t * h + c];
      o[c] = from_f32<T>(acc);
    }
  }
  return nullptr;
}

// ---- backward ------------------------------------------------------------------------------------

// dz of one token from its slots' dw (Softmax / Sigmoid), over logits z [E] as forward rounded them.
void route_backward(const float* z, int64_t e_count, int64_t k, Routing r, bool normalize, const int32_t* ids,
                    const float* w, const float* dw, float* score, float* dz) {
  std::fill(dz, dz + e_count, 0.0f);
  if (r == Routing::Sigmoid) {
    for (int64_t j = 0; j < k; ++j) dz[ids[j]] += dw[j] * w[j] * (1.0f - w[j]);
    return;
  }
  if (normalize) {
    float dot = 0.0f;
    for (int64_t j = 0; j < k; ++j) dot += w[j] * dw[j];
    for (int64_t j = 0; j < k; ++j) dz[ids[j]] += w[j] * (dw[j] - dot);
    return;
  }
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t e = 0; e < e_count; ++e) m = std::max(m, z[e]);
  float sum = 0.0f;
  for (int64_t e = 0; e < e_count; ++e) sum += score[e] = std::exp(z[e] - m);
  for (int64_t e = 0; e < e_count; ++e) score[e] /= sum;
  float dot = 0.0f;
  for (int64_t j = 0; j < k; ++j) dot += score[ids[j]] * dw[j];
  for (int64_t e = 0; e < e_count; ++e) dz[e] = -score[e] * dot;
  for (int64_t j = 0; j < k; ++j) dz[ids[j]] += score[ids[j]] * dw[j];
}

template <typename T> const char* backward(const MoeParams& p) {
  const int64_t tk = p.tokens, h = p.hidden, ne = p.experts, k = p.top_k, inter = p.inter, si = p.shared_inter;
  const int64_t s_count = moe_slots(p);
  Carve cv{static_cast<unsigned char*>(p.workspace)};
  Buffers b = layout(p, true, cv);
  const View x = rows_view<T>(p.x, tk, h, p.x_stride, b.xw);
  const View dout = rows_view<T>(p.dout, tk, h, p.dout_stride, b.dw);
  const Slots sl{p.topk_ids, p.ids_i64, p.topk_weights, p.weights_f32 || p.dtype == DType::f32, p.dtype};
  const int32_t* offsets = p.expert_offsets;
  const int32_t* sorted = p.sorted_slots;
  for (int64_t q = 0; q < s_count; ++q) b.pos[sorted[q]] = static_cast<int32_t>(q);
  std::fill(b.dws, b.dws + s_count, 0.0f);

  for (int64_t e = 0; e < ne; ++e) {
    const int64_t p0 = offsets[e], n = offsets[e + 1] - p0;
    if (n == 0) {  // no token: zero gradients
      if (p.dgate.data) store_matrix<T>(p.dgate, e, inter, h, nullptr);
      if (p.dup.data) store_matrix<T>(p.dup, e, inter, h, nullptr);
      if (p.ddown.data) store_matrix<T>(p.ddown, e, h, inter, nullptr);
      continue;
    }
    gather_inputs<T>(p, sl, sorted, p0, n, x, b.xs);
    for (int64_t r = 0; r < n; ++r)
      std::memcpy(b.ds + r * h, dout.p + (sorted[p0 + r] / k) * dout.ld, static_cast<size_t>(h) * sizeof(float));
    const View wg = expert_view<T>(p.gate, e, inter, h, b.wg), wu = expert_view<T>(p.up, e, inter, h, b.wu);
    const View wd = expert_view<T>(p.down, e, h, inter, b.wd);
    if (p.gate_up) {
      const T* gu = static_cast<const T*>(p.gate_up) + p0 * 2 * inter;
      for (int64_t i = 0; i < n * 2 * inter; ++i) b.gu[i] = to_f32(gu[i]);
    } else {
      project<T>({b.xs, h, false}, n, h, inter, wg, wu, b.gu);
    }
    gated<T>(p.act, b.gu, n, inter, b.h);
    gemm(n, inter, h, {b.ds, h, false}, wd, b.q, inter, 0.0f);  // q = dout Wd
    for (int64_t r = 0; r < n; ++r) {
      const int64_t s = sorted[p0 + r];
      const float c = p.weight_on == WeightOn::Output ? sl.weight(s) : 1.0f;
      float dot = 0.0f;
      for (int64_t j = 0; j < inter; ++j) {
        const float qv = b.q[r * inter + j], hv = b.h[r * inter + j];
        dot += qv * hv;
        b.q[r * inter + j] = round_to<T>(c * qv);  // dh
        b.ch[r * inter + j] = round_to<T>(c * hv);
      }
      if (p.weight_on == WeightOn::Output) b.dws[s] = dot;
    }
    gated_backward<T>(p.act, b.gu, b.q, n, inter, b.dgu);
    if (p.ddown.data) {
      gemm(h, inter, n, tr({b.ds, h, false}), {b.ch, inter, false}, b.gw_d, inter, 0.0f);
      store_matrix<T>(p.ddown, e, h, inter, b.gw_d);
    }
    if (p.dgate.data) {
      gemm(inter, h, n, tr({b.dgu, 2 * inter, false}), {b.xs, h, false}, b.gw_gu, h, 0.0f);
      store_matrix<T>(p.dgate, e, inter, h, b.gw_gu);
    }
    if (p.dup.data) {
      gemm(inter, h, n, tr({b.dgu + inter, 2 * inter, false}), {b.xs, h, false}, b.gw_gu, h, 0.0f);
      store_matrix<T>(p.dup, e, inter, h, b.gw_gu);
    }
    float* dx = b.dx + p0 * h;
    gemm(n, h, inter, {b.dgu, 2 * inter, false}, wg, dx, h, 0.0f);
    gemm(n, h, inter, {b.dgu + inter, 2 * inter, false}, wu, dx, h, 1.0f);
    if (p.weight_on == WeightOn::Input)
      for (int64_t r = 0; r < n; ++r) {
        const int64_t s = sorted[p0 + r];
        const float* xt = x.p + (s / k) * x.ld;
        float dot = 0.0f;
        for (int64_t c = 0; c < h; ++c) dot += dx[r * h + c] * xt[c];
        b.dws[s] = dot;
      }
  }

  // The router: dz from dw (+ drouter_logits), then its two GEMMs.
  std::fill(b.dxr, b.dxr + tk * h, 0.0f);
  if (p.routing != Routing::Given) {
    const T* rl = static_cast<const T*>(p.router_logits);
    const int32_t* ids = static_cast<const int32_t*>(p.topk_ids);
    const float* w = static_cast<const float*>(p.topk_weights);
    for (int64_t i = 0; i < tk * ne; ++i) b.logits[i] = to_f32(rl[i]);
    for (int64_t t = 0; t < tk; ++t) {
      float* dz = b.dz + t * ne;
      route_backward(b.logits + t * ne, ne, k, p.routing, p.normalize, ids + t * k, w + t * k, b.dws + t * k, b.score, dz);
      if (p.drouter_logits)
        for (int64_t e = 0; e < ne; ++e)
          dz[e] += p.drouter_logits_f32 ? static_cast<const float*>(p.drouter_logits)[t * ne + e]
                                        : to_f32(static_cast<const T*>(p.drouter_logits)[t * ne + e]);
    }
    round_inplace<T>(b.dz, tk * ne);
    const View wr = rows_view<T>(p.router, ne, h, h, b.router_w);
    gemm(tk, h, ne, {b.dz, ne, false}, wr, b.dxr, h, 0.0f);
    if (p.drouter) {  // dWr = dz^T x
      gemm(ne, h, tk, tr({b.dz, ne, false}), x, b.drouter, h, 0.0f);
      T* dr = static_cast<T*>(p.drouter);
      for (int64_t i = 0; i < ne * h; ++i) dr[i] = from_f32<T>(b.drouter[i]);
    }
  }

  // The shared expert.
  if (si > 0) {
    const View wg = expert_view<T>(p.shared_gate, 0, si, h, b.swg), wu = expert_view<T>(p.shared_up, 0, si, h, b.swu);
    const View wd = expert_view<T>(p.shared_down, 0, h, si, b.swd);
    project<T>(x, tk, h, si, wg, wu, b.sgu);
    gated<T>(p.act, b.sgu, tk, si, b.sh);
    shared_gate<T>(p, x, b.sigma);
    gemm(tk, si, h, dout, wd, b.sq, si, 0.0f);  // dout Wsd
    for (int64_t t = 0; t < tk; ++t) {
      const float sg = b.sigma[t];
      float dot = 0.0f;
      for (int64_t j = 0; j < si; ++j) {
        const float qv = b.sq[t * si + j], hv = b.sh[t * si + j];
        dot += qv * hv;
        b.sq[t * si + j] = round_to<T>(sg * qv);
        b.sh[t * si + j] = round_to<T>(sg * hv);
      }
      b.sdl[t] = dot * sg * (1.0f - sg);
    }
    gated_backward<T>(p.act, b.sgu, b.sq, tk, si, b.sdgu);
    float* g = b.gw_gu;
    if (p.dshared_down.data) {
      gemm(h, si, tk, tr(dout), {b.sh, si, false}, g, si, 0.0f);
      store_matrix<T>(p.dshared_down, 0, h, si, g);
    }
    if (p.dshared_gate.data) {
      gemm(si, h, tk, tr({b.sdgu, 2 * si, false}), x, g, h, 0.0f);
      store_matrix<T>(p.dshared_gate, 0, si, h, g);
    }
    if (p.dshared_up.data) {
      gemm(si, h, tk, tr({b.sdgu + si, 2 * si, false}), x, g, h, 0.0f);
      store_matrix<T>(p.dshared_up, 0, si, h, g);
    }
    gemm(tk, h, si, {b.sdgu, 2 * si, false}, wg, b.dxr, h, 1.0f);
    gemm(tk, h, si, {b.sdgu + si, 2 * si, false}, wu, b.dxr, h, 1.0f);
    if (p.shared_expert_gate) {
      const T* gs = static_cast<const T*>(p.shared_expert_gate);
      for (int64_t t = 0; t < tk; ++t)
        for (int64_t c = 0; c < h; ++c) b.dxr[t * h + c] += b.sdl[t] * to_f32(gs[c]);
      if (p.dshared_expert_gate) {
        T* dg = static_cast<T*>(p.dshared_expert_gate);
        for (int64_t c = 0; c < h; ++c) {
          float acc = 0.0f;
          for (int64_t t = 0; t < tk; ++t) acc += b.sdl[t] * x.p[t * x.ld + c];
          dg[c] = from_f32<T>(acc);
        }
      }
    }
  }

  // dx_t = sum_j c'_s dx_s (slot order) + the router's and shared expert's parts.
  T* dx = static_cast<T*>(p.dx);
#pragma omp parallel for schedule(static) if (tk * h * k > (int64_t(1) << 18))
  for (int64_t t = 0; t < tk; ++t)
    for (int64_t c = 0; c < h; ++c) {
      float acc = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t s = t * k + j, pos = b.pos[s];
        if (pos >= offsets[ne]) continue;
        const float coef = p.weight_on == WeightOn::Input ? sl.weight(s) : 1.0f;
        acc += coef * b.dx[pos * h + c];
      }
      dx[t * p.dx_stride + c] = from_f32<T>(acc + b.dxr[t * h + c]);
    }
  if (p.dtopk_weights) std::copy(b.dws, b.dws + s_count, p.dtopk_weights);
  return nullptr;
}

// ---- load-balancing loss -------------------------------------------------------------------------

template <typename T> const char* load_balancing(const LoadBalancingParams& p) {
  const int64_t rows = p.rows, ne = p.experts, k = p.top_k;
  Carve cv{static_cast<unsigned char*>(p.workspace)};
  double* count = cv.take<double>(ne);
  double* prob = cv.take<double>(ne);
  float* pr = cv.take<float>(ne);
  unsigned char* taken = cv.take<unsigned char>(ne);
  const T* z = static_cast<const T*>(p.logits);
  auto mask = [&](int64_t r) -> double {
    if (p.mask_type == MaskType::None) return 1.0;
    const int64_t i = r % p.mask_len;
    switch (p.mask_type) {
      case MaskType::U8: return static_cast<const uint8_t*>(p.mask)[i] != 0;
      case MaskType::I32: return static_cast<const int32_t*>(p.mask)[i] != 0;
      case MaskType::I64: return static_cast<const int64_t*>(p.mask)[i] != 0;
      case MaskType::F32: return static_cast<const float*>(p.mask)[i];
      default: return 1.0;
    }
  };
  // p_r = round(softmax(z_r)) and its top-k.
  auto probs = [&](int64_t r) {
    const T* zr = z + r * p.logits_stride;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t e = 0; e < ne; ++e) m = std::max(m, to_f32(zr[e]));
    float sum = 0.0f;
    for (int64_t e = 0; e < ne; ++e) sum += pr[e] = std::exp(to_f32(zr[e]) - m);
    for (int64_t e = 0; e < ne; ++e) pr[e] = round_to<T>(pr[e] / sum);
  };
  std::fill(count, count + ne, 0.0);
  std::fill(prob, prob + ne, 0.0);
  double total = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    const double m = mask(r);
    probs(r);
    std::fill(taken, taken + ne, static_cast<unsigned char>(0));
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < ne; ++e)
        if (!taken[e] && (best < 0 || pr[e] > pr[best])) best = e;
      taken[best] = 1;
      count[best] += m;
    }
    for (int64_t e = 0; e < ne; ++e) prob[e] += m * pr[e];
    total += m;
  }
  double loss = 0.0;
  for (int64_t e = 0; e < ne; ++e) loss += (count[e] / total) * (prob[e] / total);
  *p.loss = static_cast<float>(loss * static_cast<double>(ne));
  if (!p.dlogits) return nullptr;
  // d_{r,e} = grad_scale E f_e m_r / Rt; dz_r = p_r (d_r - p_r . d_r).
  for (int64_t r = 0; r < rows; ++r) {
    const double m = mask(r);
    probs(r);
    const double scale = static_cast<double>(p.grad_scale) * static_cast<double>(ne) * m / (total * total);
    double dot = 0.0;
    for (int64_t e = 0; e < ne; ++e) dot += pr[e] * count[e];
    for (int64_t e = 0; e < ne; ++e) {
      const float g = static_cast<float>(scale * pr[e] * (count[e] - dot));
      if (p.dlogits_f32) static_cast<float*>(p.dlogits)[r * ne + e] = g;
      else static_cast<T*>(p.dlogits)[r * ne + e] = from_f32<T>(g);
    }
  }
  return nullptr;
}

template <template <typename> class F, typename P> const char* dispatch(DType d, const P& p) {
  switch (d) {
    case DType::f32: return F<float>::run(p);
    case DType::bf16: return F<kernel::cpu::bf16>::run(p);
    case DType::f16: return F<kernel::cpu::f16>::run(p);
  }
  return "moe: unknown dtype";
}
template <typename T> struct Fwd {
  static const char* run(const MoeParams& p) { return forward<T>(p); }
};
template <typename T> struct Bwd {
  static const char* run(const MoeParams& p) { return backward<T>(p); }
};
template <typename T> struct Lb {
  static const char* run(const LoadBalancingParams& p) { return load_balancing<T>(p); }
};

bool matrix_ok(const Matrix& m, int64_t rows, int64_t cols) {
  bool cm = false;
  int64_t ld = 0;
  return m.data && matrix_storage(rows, cols, m.row_stride, m.col_stride, &cm, &ld);
}

}  // namespace

const char* moe_check(const MoeParams& p, bool bwd) {
  const char* op = bwd ? "moe backward" : "moe forward";
  KCPP_KERNEL_REQUIRE(p.tokens >= 0 && p.hidden > 0 && p.experts > 0 && p.inter > 0 && p.shared_inter >= 0,
                      "%s: sizes T=%lld H=%lld E=%lld I=%lld must be >= 0 (T) and > 0", op, static_cast<long long>(p.tokens),
                      static_cast<long long>(p.hidden), static_cast<long long>(p.experts), static_cast<long long>(p.inter));
  KCPP_KERNEL_REQUIRE(p.top_k >= 1, "%s: top_k = %lld must be >= 1", op, static_cast<long long>(p.top_k));
  KCPP_KERNEL_REQUIRE(p.routing == Routing::Given || p.top_k <= p.experts, "%s: top_k = %lld exceeds the %lld experts", op,
                      static_cast<long long>(p.top_k), static_cast<long long>(p.experts));
  KCPP_KERNEL_REQUIRE(moe_slots(p) < (int64_t(1) << 31), "%s: T * top_k = %lld slots exceed the i32 permutation", op,
                      static_cast<long long>(moe_slots(p)));
  KCPP_KERNEL_REQUIRE(p.routing == Routing::Given || p.router, "%s: routing needs the router weight", op);
  KCPP_KERNEL_REQUIRE(p.x || p.tokens == 0, "%s: no hidden states", op);
  KCPP_KERNEL_REQUIRE(p.x_stride >= p.hidden || p.tokens <= 1, "%s: hidden rows overlap (stride %lld < %lld)", op,
                      static_cast<long long>(p.x_stride), static_cast<long long>(p.hidden));
  KCPP_KERNEL_REQUIRE(matrix_ok(p.gate, p.inter, p.hidden) && matrix_ok(p.up, p.inter, p.hidden),
                      "%s: gate / up projections must have a unit row or column stride", op);
  KCPP_KERNEL_REQUIRE(matrix_ok(p.down, p.hidden, p.inter), "%s: down projection must have a unit row or column stride", op);
  if (p.shared_inter > 0) {
    KCPP_KERNEL_REQUIRE(matrix_ok(p.shared_gate, p.shared_inter, p.hidden) && matrix_ok(p.shared_up, p.shared_inter, p.hidden) &&
                            matrix_ok(p.shared_down, p.hidden, p.shared_inter),
                        "%s: shared expert projections must have a unit row or column stride", op);
  }
  if (p.routing == Routing::Given || bwd)
    KCPP_KERNEL_REQUIRE((p.topk_ids && p.topk_weights) || p.tokens == 0, "%s: needs topk_ids and topk_weights", op);
  if (!bwd) {
    KCPP_KERNEL_REQUIRE(p.out || p.tokens == 0, "%s: no output", op);
    return nullptr;
  }
  KCPP_KERNEL_REQUIRE(p.routing == Routing::Given || p.router_logits || p.tokens == 0, "%s: needs router_logits", op);
  KCPP_KERNEL_REQUIRE(p.expert_offsets && (p.sorted_slots || moe_slots(p) == 0), "%s: needs expert_offsets and sorted_slots", op);
  KCPP_KERNEL_REQUIRE(p.dout || p.tokens == 0, "%s: no dout", op);
  KCPP_KERNEL_REQUIRE(p.dx || p.tokens == 0, "%s: no dhidden", op);
  KCPP_KERNEL_REQUIRE(!p.overwrite_gate_up || p.gate_up || moe_slots(p) == 0,
                      "%s: overwrite_gate_up without the saved gate_up (pass the forward's gate_up, or leave the flag out)", op);
  for (const Matrix* m : {&p.dgate, &p.dup})
    KCPP_KERNEL_REQUIRE(!m->data || matrix_ok(*m, p.inter, p.hidden), "%s: gate / up gradients need a unit stride", op);
  KCPP_KERNEL_REQUIRE(!p.ddown.data || matrix_ok(p.ddown, p.hidden, p.inter), "%s: down gradient needs a unit stride", op);
  return nullptr;
}

size_t moe_workspace(const MoeParams& p, bool backward, bool cuda) {
#if KCPP_WITH_CUDA
  if (cuda) return moe_workspace_cuda(p, backward);
#else
  (void)cuda;
#endif
  Carve cv;
  layout(p, backward, cv);
  return cv.used;
}

const char* moe_forward_cpu(const MoeParams& p) {
  if (const char* e = moe_check(p, false)) return e;
  return dispatch<Fwd>(p.dtype, p);
}

const char* moe_backward_cpu(const MoeParams& p) {
  if (const char* e = moe_check(p, true)) return e;
  return dispatch<Bwd>(p.dtype, p);
}

const char* load_balancing_check(const LoadBalancingParams& p) {
  KCPP_KERNEL_REQUIRE(p.experts > 0 && p.rows >= 0, "load_balancing_loss: %lld rows of %lld experts", static_cast<long long>(p.rows),
                      static_cast<long long>(p.experts));
  KCPP_KERNEL_REQUIRE(p.top_k >= 1 && p.top_k <= p.experts, "load_balancing_loss: top_k = %lld must be in [1, %lld]",
                      static_cast<long long>(p.top_k), static_cast<long long>(p.experts));
  KCPP_KERNEL_REQUIRE(p.mask_type == MaskType::None || (p.mask && p.mask_len > 0 && p.rows % p.mask_len == 0),
                      "load_balancing_loss: %lld rows are not a multiple of the mask's %lld tokens",
                      static_cast<long long>(p.rows), static_cast<long long>(p.mask_len));
  KCPP_KERNEL_REQUIRE(p.loss, "load_balancing_loss: no loss output");
  return nullptr;
}

size_t load_balancing_workspace(const LoadBalancingParams& p, bool cuda) {
#if KCPP_WITH_CUDA
  if (cuda) return load_balancing_workspace_cuda(p);
#else
  (void)cuda;
#endif
  Carve cv;
  cv.take<double>(p.experts);
  cv.take<double>(p.experts);
  cv.take<float>(p.experts);
  cv.take<unsigned char>(p.experts);
  return cv.used;
}

int64_t workspace_padded_rows(ExpertGemm asked, int64_t slots, int64_t experts, int64_t hidden, int64_t inter, int64_t sms) {
  if (asked == ExpertGemm::Padded) return padded_rows_cap(slots, experts, true);
  if (asked == ExpertGemm::Auto && !auto_always_loop(hidden, inter, sms)) return padded_rows_cap(slots, experts, false);
  return 0;
}

int64_t loop_window_rows(int64_t rows, int64_t hidden, int64_t inter) {
  if (rows <= 0 || inter <= 0 || 2 * inter <= hidden) return rows;
  const int64_t r = std::max<int64_t>(rows * hidden / (2 * inter) / 8 * 8, 8);
  return std::min(r, rows);
}

int64_t padded_group_rows(int64_t padded_rows) { return ((padded_rows + 3) / 4 + 7) / 8 * 8; }

int64_t loop_chunk_cols(int64_t hidden, int64_t inter) {
  const int64_t c = std::max<int64_t>(hidden / 2 / 8 * 8, 8);
  if (inter <= c) return inter;
  const int64_t n = (inter + c - 1) / c;
  return ((inter + n - 1) / n + 7) / 8 * 8;
}

const char* moe_cuda_unsupported(const MoeParams& p, bool /*backward: the same limits*/) {
  if (p.dtype == DType::f32) return "f32 on CUDA: the expert GEMMs are bf16 / f16 tensor-core ones";
  if (p.experts > 1024) return errorf("%lld experts on CUDA (at most 1024)", static_cast<long long>(p.experts));
  auto same = [](const Matrix& a, const Matrix& b) {
    return !a.data || !b.data || (a.expert_stride == b.expert_stride && a.row_stride == b.row_stride && a.col_stride == b.col_stride);
  };
  if (!same(p.gate, p.up) || !same(p.shared_gate, p.shared_up))
    return "gate and up projections with different strides on CUDA (give them fused, or with one layout)";
  // A matrix's unit stride must be its own (the CPU also takes a dim of extent 1 with any stride).
  auto strict = [](const Matrix& m, int64_t rows, int64_t cols) {
    if (!m.data) return true;
    if (m.col_stride == 1) return rows <= 1 || m.row_stride >= cols;
    return m.row_stride == 1 && (cols <= 1 || m.col_stride >= rows);
  };
  const int64_t h = p.hidden, i = p.inter, si = p.shared_inter;
  const bool layouts = strict(p.gate, i, h) && strict(p.up, i, h) && strict(p.down, h, i) &&
                       (si == 0 || (strict(p.shared_gate, si, h) && strict(p.shared_up, si, h) && strict(p.shared_down, h, si)));
  if (!layouts) return "a weight whose unit stride is on a dim of extent 1 on CUDA (give it contiguous)";
  if (moe_slots(p) / 128 + p.experts > 65535)
    return errorf("%lld slots on CUDA (the grouped GEMM's grid holds about 8M)", static_cast<long long>(moe_slots(p)));
  return nullptr;
}

const char* load_balancing_cuda_unsupported(const LoadBalancingParams& p) {
  if (p.experts > 1024) return errorf("%lld experts on CUDA (at most 1024)", static_cast<long long>(p.experts));
  return nullptr;
}

const char* load_balancing_cpu(const LoadBalancingParams& p) {
  if (const char* e = load_balancing_check(p)) return e;
  return dispatch<Lb>(p.dtype, p);
}

}  // namespace kcpp::moe
