// Multi-scale deformable attention on the CPU (maths in msda.h).  Forward: (batch, query) rows in
// parallel, the C channels of a head in an f32 accumulator.  Backward: (batch, head) pairs in parallel;
// each owns dvalue[b, :, m, :] as an f32 copy that it adds to in (query, level, point) order and rounds
// once at the end, so the result does not depend on the thread count.
#include <algorithm>
#include <vector>

#include "kcpp/kernel/cpu.h"
#include "kcpp/kernel/error.h"
#include "msda.h"

namespace kcpp::msda {
namespace {

using kernel::cpu::from_f32;
using kernel::cpu::to_f32;

struct Level {
  int64_t h, w, start;
};

// The four corners of a sample: their rows in the level (or -1 outside the map) and weights.
struct Corners {
  int64_t row[4];
  float wt[4];
};

inline Corners corners_of(const Bilinear& s, const Level& lv) {
  Corners k;
  const int64_t r0 = s.i0 * lv.w, r1 = (s.i0 + 1) * lv.w;
  k.row[0] = s.in_i0 && s.in_j0 ? lv.start + r0 + s.j0 : -1;
  k.row[1] = s.in_i0 && s.in_j1 ? lv.start + r0 + s.j0 + 1 : -1;
  k.row[2] = s.in_i1 && s.in_j0 ? lv.start + r1 + s.j0 : -1;
  k.row[3] = s.in_i1 && s.in_j1 ? lv.start + r1 + s.j0 + 1 : -1;
  k.wt[0] = (1 - s.fy) * (1 - s.fx), k.wt[1] = (1 - s.fy) * s.fx, k.wt[2] = s.fy * (1 - s.fx), k.wt[3] = s.fy * s.fx;
  return k;
}

template <typename T>
KCPP_CPU_MULTIVERSION void forward(const MsdaParams& p, const std::vector<Level>& lv) {
  const int64_t S = p.seq, M = p.heads, C = p.channels, Q = p.queries, L = p.levels, P = p.points;
  const T* value = static_cast<const T*>(p.value);
  const T* loc = static_cast<const T*>(p.loc);
  const T* attn = static_cast<const T*>(p.attn);
  T* out = static_cast<T*>(p.out);
#pragma omp parallel
  {
    std::vector<float> acc(static_cast<size_t>(C));
#pragma omp for schedule(static)
    for (int64_t bq = 0; bq < p.batch * Q; ++bq) {
      const int64_t b = bq / Q;
      for (int64_t m = 0; m < M; ++m) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        const int64_t base = (bq * M + m) * L * P;
        for (int64_t l = 0; l < L; ++l)
          for (int64_t pt = 0; pt < P; ++pt) {
            const int64_t i = base + l * P + pt;
            const Bilinear s = bilinear_at(to_f32(loc[2 * i]), to_f32(loc[2 * i + 1]), lv[l].h, lv[l].w);
            if (!s.valid) continue;
            const Corners k = corners_of(s, lv[l]);
            const float a = to_f32(attn[i]);
            for (int corner = 0; corner < 4; ++corner) {
              if (k.row[corner] < 0) continue;
              const float wa = a * k.wt[corner];
              const T* v = value + ((b * S + k.row[corner]) * M + m) * C;
              for (int64_t c = 0; c < C; ++c) acc[c] += wa * to_f32(v[c]);
            }
          }
        T* o = out + (bq * M + m) * C;
        for (int64_t c = 0; c < C; ++c) o[c] = from_f32<T>(acc[c]);
      }
    }
  }
}

template <typename T>
KCPP_CPU_MULTIVERSION void backward(const MsdaParams& p, const std::vector<Level>& lv) {
  const int64_t S = p.seq, M = p.heads, C = p.channels, Q = p.queries, L = p.levels, P = p.points;
  const T* value = static_cast<const T*>(p.value);
  const T* loc = static_cast<const T*>(p.loc);
  const T* attn = static_cast<const T*>(p.attn);
  const T* dout = static_cast<const T*>(p.dout);
  T* dvalue = static_cast<T*>(p.dvalue);
  T* dloc = static_cast<T*>(p.dloc);
  T* dattn = static_cast<T*>(p.dattn);
#pragma omp parallel
  {
    std::vector<float> dv(static_cast<size_t>(S * C)), g(static_cast<size_t>(C));
#pragma omp for schedule(dynamic, 1)
    for (int64_t bm = 0; bm < p.batch * M; ++bm) {
      const int64_t b = bm / M, m = bm % M;
      std::fill(dv.begin(), dv.end(), 0.0f);
      for (int64_t q = 0; q < Q; ++q) {
        kernel::cpu::load_row(dout + ((b * Q + q) * M + m) * C, C, g.data());
        const int64_t base = ((b * Q + q) * M + m) * L * P;
        for (int64_t l = 0; l < L; ++l)
          for (int64_t pt = 0; pt < P; ++pt) {
            const int64_t i = base + l * P + pt;
            const Bilinear s = bilinear_at(to_f32(loc[2 * i]), to_f32(loc[2 * i + 1]), lv[l].h, lv[l].w);
            if (!s.valid) {
              dattn[i] = from_f32<T>(0.0f);
              dloc[2 * i] = dloc[2 * i + 1] = from_f32<T>(0.0f);
              continue;
            }
            const Corners k = corners_of(s, lv[l]);
            const float a = to_f32(attn[i]);
            float d[4] = {0, 0, 0, 0};  // sum_c g_c v_corner,c
            for (int corner = 0; corner < 4; ++corner) {
              if (k.row[corner] < 0) continue;
              const T* v = value + ((b * S + k.row[corner]) * M + m) * C;
              float* dvr = dv.data() + k.row[corner] * C;
              const float wa = a * k.wt[corner];
              float dot = 0.0f;
              for (int64_t c = 0; c < C; ++c) {
                dot += g[c] * to_f32(v[c]);
                dvr[c] += wa * g[c];
              }
              d[corner] = dot;
            }
            dattn[i] = from_f32<T>(k.wt[0] * d[0] + k.wt[1] * d[1] + k.wt[2] * d[2] + k.wt[3] * d[3]);
            const float gx = (1 - s.fy) * (d[1] - d[0]) + s.fy * (d[3] - d[2]);
            const float gy = (1 - s.fx) * (d[2] - d[0]) + s.fx * (d[3] - d[1]);
            dloc[2 * i] = from_f32<T>(a * static_cast<float>(lv[l].w) * gx);
            dloc[2 * i + 1] = from_f32<T>(a * static_cast<float>(lv[l].h) * gy);
          }
      }
      for (int64_t s = 0; s < S; ++s) kernel::cpu::store_row(dv.data() + s * C, C, dvalue + ((b * S + s) * M + m) * C);
    }
  }
}

template <typename F>
void visit(kernel::DType t, F&& f) {
  switch (t) {
    case kernel::DType::f32:
      f(static_cast<float*>(nullptr));
      break;
    case kernel::DType::bf16:
      f(static_cast<kernel::cpu::bf16*>(nullptr));
      break;
    case kernel::DType::f16:
      f(static_cast<kernel::cpu::f16*>(nullptr));
      break;
  }
}

bool valid_dtype(kernel::DType t) { return t == kernel::DType::f32 || t == kernel::DType::bf16 || t == kernel::DType::f16; }

// The levels as host values, checked against S; nullptr or the message naming the level.
const char* levels_of(const MsdaParams& p, std::vector<Level>& lv) {
  lv.resize(static_cast<size_t>(p.levels));
  for (int64_t l = 0; l < p.levels; ++l) {
    const int64_t h = p.spatial_shapes[2 * l], w = p.spatial_shapes[2 * l + 1], st = p.level_start[l];
    KCPP_KERNEL_REQUIRE(h >= 1 && w >= 1,
                        "multi_scale_deformable_attention: level %lld of 'value_spatial_shapes' is %lld x %lld; "
                        "each level must be at least 1 x 1",
                        static_cast<long long>(l), static_cast<long long>(h), static_cast<long long>(w));
    KCPP_KERNEL_REQUIRE(st >= 0 && h <= p.seq && w <= p.seq && st + h * w <= p.seq,
                        "multi_scale_deformable_attention: level %lld (%lld x %lld from row %lld of "
                        "'value_level_start_index') does not fit in the %lld rows of 'value'",
                        static_cast<long long>(l), static_cast<long long>(h), static_cast<long long>(w),
                        static_cast<long long>(st), static_cast<long long>(p.seq));
    lv[static_cast<size_t>(l)] = {h, w, st};
  }
  return nullptr;
}

}  // namespace

const char* msda_check(const MsdaParams& p, bool backward) {
  const char* op = backward ? "multi_scale_deformable_attention backward" : "multi_scale_deformable_attention forward";
  KCPP_KERNEL_REQUIRE(valid_dtype(p.dtype), "%s: unsupported dtype %d", op, static_cast<int>(p.dtype));
  KCPP_KERNEL_REQUIRE(p.batch >= 0 && p.seq >= 0 && p.heads >= 0 && p.channels >= 0 && p.queries >= 0 && p.points >= 0,
                      "%s: negative batch, rows, heads, channels, queries or points", op);
  KCPP_KERNEL_REQUIRE(p.levels >= 1, "%s: at least one level is needed ('value_spatial_shapes' is [L, 2], L >= 1)", op);
  KCPP_KERNEL_REQUIRE(p.spatial_shapes && p.level_start,
                      "%s: 'value_spatial_shapes' and 'value_level_start_index' must not be null", op);
  const bool any_out = p.batch * p.queries * p.heads * p.channels > 0;
  const bool any_sample = p.batch * p.queries * p.heads * p.points > 0;
  KCPP_KERNEL_REQUIRE(!(any_sample && p.channels > 0) || (p.value && p.loc && p.attn),
                      "%s: 'value', 'sampling_locations' and 'attention_weights' must not be null", op);
  if (!backward) {
    KCPP_KERNEL_REQUIRE(!any_out || p.out, "%s: 'out' must not be null", op);
    return nullptr;
  }
  KCPP_KERNEL_REQUIRE(!any_out || p.dout, "%s: 'dout' must not be null", op);
  KCPP_KERNEL_REQUIRE(p.batch * p.seq * p.heads * p.channels == 0 || p.dvalue, "%s: 'dvalue' must not be null", op);
  KCPP_KERNEL_REQUIRE(!any_sample || (p.dloc && p.dattn && p.loc && p.attn),
                      "%s: 'dsampling_locations' and 'dattention_weights' must not be null", op);
  return nullptr;
}

const char* msda_forward_cpu(const MsdaParams& p) {
  if (const char* e = msda_check(p, false)) return e;
  std::vector<Level> lv;
  if (const char* e = levels_of(p, lv)) return e;
  visit(p.dtype, [&]<typename T>(T*) { forward<T>(p, lv); });
  return nullptr;
}

const char* msda_backward_cpu(const MsdaParams& p) {
  if (const char* e = msda_check(p, true)) return e;
  std::vector<Level> lv;
  if (const char* e = levels_of(p, lv)) return e;
  visit(p.dtype, [&]<typename T>(T*) { backward<T>(p, lv); });
  return nullptr;
}

}  // namespace kcpp::msda
