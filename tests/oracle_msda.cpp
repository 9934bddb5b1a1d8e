#include "oracle_msda.h"

#include <cmath>

namespace kcpp::oracle {
namespace {

// The bilinear sample of one level at normalized (lx, ly): for each of the four corners (i0 | i0+1,
// j0 | j0+1) its row in value (or -1 when outside the map, zero padding) and weight, and the
// derivatives of the weights with respect to the pixel coordinates x and y.
// Under Terms::PositionRounding each in-range corner's weight and slopes are the bound on how far f32
// rounding moves them, in units of u (oracle_msda.h).
struct Sample {
  int64_t row[4] = {-1, -1, -1, -1};
  double w[4] = {0, 0, 0, 0}, dwx[4] = {0, 0, 0, 0}, dwy[4] = {0, 0, 0, 0};
};

Sample sample_at(double lx, double ly, int64_t h, int64_t w, int64_t start, Terms terms) {
  Sample s;
  const double x = lx * static_cast<double>(w) - 0.5, y = ly * static_cast<double>(h) - 0.5;
  const double moved = 2 * std::fabs(x) + 2 * std::fabs(y) + 5;
  // Far outside (or not finite): every corner is outside the map.
  if (!std::isfinite(x) || !std::isfinite(y) || std::fabs(x) > 1e15 || std::fabs(y) > 1e15) return s;
  const double x0 = std::floor(x), y0 = std::floor(y), fx = x - x0, fy = y - y0;
  for (int di = 0; di < 2; ++di)
    for (int dj = 0; dj < 2; ++dj) {
      const int k = 2 * di + dj;
      const int64_t i = static_cast<int64_t>(y0) + di, j = static_cast<int64_t>(x0) + dj;
      if (i < 0 || i >= h || j < 0 || j >= w) continue;
      const double wy = di ? fy : 1 - fy, wx = dj ? fx : 1 - fx;
      s.row[k] = start + i * w + j;
      s.w[k] = wy * wx;
      s.dwx[k] = wy * (dj ? 1.0 : -1.0);
      s.dwy[k] = wx * (di ? 1.0 : -1.0);
      if (terms == Terms::PositionRounding) s.w[k] = s.dwx[k] = s.dwy[k] = moved;
    }
  return s;
}

}  // namespace

V msda_forward(const Msda& o, Terms terms) {
  const bool mag = terms != Terms::Value;
  const int64_t B = o.batch, S = o.seq, M = o.heads, C = o.channels, Q = o.queries, L = o.levels, P = o.points;
  V out(static_cast<size_t>(B * Q * M * C), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t q = 0; q < Q; ++q)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t l = 0; l < L; ++l)
          for (int64_t p = 0; p < P; ++p) {
            const size_t i = static_cast<size_t>((((b * Q + q) * M + m) * L + l) * P + p);
            const Sample s = sample_at(o.loc[2 * i], o.loc[2 * i + 1], o.shapes[2 * l], o.shapes[2 * l + 1], o.starts[l], terms);
            const double a = mag ? std::fabs(o.attn[i]) : o.attn[i];
            for (int k = 0; k < 4; ++k) {
              if (s.row[k] < 0) continue;
              for (int64_t c = 0; c < C; ++c) {
                const double v = o.value[static_cast<size_t>(((b * S + s.row[k]) * M + m) * C + c)];
                out[static_cast<size_t>(((b * Q + q) * M + m) * C + c)] += a * s.w[k] * (mag ? std::fabs(v) : v);
              }
            }
          }
  return out;
}

MsdaGrad msda_backward(const Msda& o, const V& dout, Terms terms) {
  const bool mag = terms != Terms::Value;
  const int64_t B = o.batch, S = o.seq, M = o.heads, C = o.channels, Q = o.queries, L = o.levels, P = o.points;
  MsdaGrad g;
  g.dvalue.assign(o.value.size(), 0.0);
  g.dloc.assign(o.loc.size(), 0.0);
  g.dattn.assign(o.attn.size(), 0.0);
  auto f = [mag](double v) { return mag ? std::fabs(v) : v; };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t q = 0; q < Q; ++q)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t l = 0; l < L; ++l)
          for (int64_t p = 0; p < P; ++p) {
            const size_t i = static_cast<size_t>((((b * Q + q) * M + m) * L + l) * P + p);
            const int64_t h = o.shapes[2 * l], w = o.shapes[2 * l + 1];
            const Sample s = sample_at(o.loc[2 * i], o.loc[2 * i + 1], h, w, o.starts[l], terms);
            const double a = f(o.attn[i]);
            double da = 0, dx = 0, dy = 0;
            for (int k = 0; k < 4; ++k) {
              if (s.row[k] < 0) continue;
              for (int64_t c = 0; c < C; ++c) {
                const double gc = f(dout[static_cast<size_t>(((b * Q + q) * M + m) * C + c)]);
                const size_t vi = static_cast<size_t>(((b * S + s.row[k]) * M + m) * C + c);
                const double v = f(o.value[vi]);
                da += gc * s.w[k] * v;
                dx += gc * f(s.dwx[k]) * v;
                dy += gc * f(s.dwy[k]) * v;
                g.dvalue[vi] += a * s.w[k] * gc;
              }
            }
            g.dattn[i] = da;
            g.dloc[2 * i] = a * static_cast<double>(w) * dx;
            g.dloc[2 * i + 1] = a * static_cast<double>(h) * dy;
          }
  return g;
}

}  // namespace kcpp::oracle
