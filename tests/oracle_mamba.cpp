#include "oracle_mamba.h"

#include <cmath>

namespace kcpp::oracle {
namespace {

double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double dsoftplus(double x) { return x > 20.0 ? 1.0 : sigmoid(x); }
double silu_(double x) { return x * sigmoid(x); }
double dsilu_(double x) { return sigmoid(x) * (1.0 + x * (1.0 - sigmoid(x))); }
// The magnitude of the terms of dsilu: s (1 + x (1 - s)) cancels to zero near x = -1.278, where a
// kernel's f32 result is off by rounding of the terms, not of the (tiny) sum.
double dsilu_mag(double x) { return sigmoid(x) * (1.0 + std::abs(x) * (1.0 - sigmoid(x))); }

// |v| when measuring magnitudes, else v.
double m(double v, bool mag) { return mag ? std::abs(v) : v; }

// B or C of (b, g) as [L][N], normalised under bc_norm (then rstd [L] set); magnitudes when `mag`.
V rows(const Scan& s, const V& x, int64_t b, int64_t g, bool mag, V* rstd) {
  const int64_t L = s.seqlen, N = s.dstate;
  V out(static_cast<size_t>(L * N));
  if (rstd) rstd->assign(static_cast<size_t>(L), 1.0);
  for (int64_t l = 0; l < L; ++l) {
    double ss = 0;
    for (int64_t n = 0; n < N; ++n) {
      const double v = x[static_cast<size_t>(((b * s.groups + g) * N + n) * L + l)];
      out[static_cast<size_t>(l * N + n)] = v;
      ss += v * v;
    }
    const double r = s.bc_norm ? 1.0 / std::sqrt(ss / static_cast<double>(N) + s.eps) : 1.0;
    for (int64_t n = 0; n < N; ++n) out[static_cast<size_t>(l * N + n)] = m(out[static_cast<size_t>(l * N + n)] * r, mag);
    if (rstd) (*rstd)[static_cast<size_t>(l)] = r;
  }
  return out;
}

}  // namespace

ScanOut selective_scan(const Scan& s, bool mag) {
  const int64_t Bn = s.batch, D = s.dim, L = s.seqlen, N = s.dstate, per_group = D / s.groups;
  ScanOut r;
  r.out.assign(static_cast<size_t>(Bn * D * L), 0.0);
  r.last_state.assign(static_cast<size_t>(Bn * D * N), 0.0);
  for (int64_t b = 0; b < Bn; ++b)
    for (int64_t d = 0; d < D; ++d) {
      const int64_t g = d / per_group;
      const V Bw = rows(s, s.B, b, g, mag, nullptr), Cw = rows(s, s.C, b, g, mag, nullptr);
      V h(static_cast<size_t>(N), 0.0);
      if (!s.h0.empty())
        for (int64_t n = 0; n < N; ++n) h[static_cast<size_t>(n)] = m(s.h0[static_cast<size_t>((b * D + d) * N + n)], mag);
      for (int64_t l = 0; l < L; ++l) {
        const size_t e = static_cast<size_t>((b * D + d) * L + l);
        const double raw = s.delta[e] + (s.delta_bias.empty() ? 0.0 : s.delta_bias[static_cast<size_t>(d)]);
        const double dt = s.softplus ? softplus(raw) : raw, u = m(s.u[e], mag);
        double y = 0;
        for (int64_t n = 0; n < N; ++n) {
          const double a = std::exp(dt * s.A[static_cast<size_t>(d * N + n)]);
          double& hn = h[static_cast<size_t>(n)];
          hn = a * hn + m(dt, mag) * Bw[static_cast<size_t>(l * N + n)] * u;
          y += Cw[static_cast<size_t>(l * N + n)] * hn;
        }
        if (!s.D.empty()) y += m(s.D[static_cast<size_t>(d)], mag) * u;
        if (!s.z.empty()) y *= m(silu_(s.z[e]), mag);
        r.out[e] = y;
      }
      for (int64_t n = 0; n < N; ++n) r.last_state[static_cast<size_t>((b * D + d) * N + n)] = h[static_cast<size_t>(n)];
    }
  return r;
}

ScanGrad selective_scan_backward(const Scan& s, const V& dout, bool mag) {
  const int64_t Bn = s.batch, D = s.dim, L = s.seqlen, N = s.dstate, G = s.groups, per_group = D / G;
  ScanGrad r;
  const size_t seq = static_cast<size_t>(Bn * D * L);
  r.du.assign(seq, 0.0);
  r.ddelta.assign(seq, 0.0);
  r.dA.assign(static_cast<size_t>(D * N), 0.0);
  V dBn(static_cast<size_t>(Bn * G * L * N), 0.0), dCn(dBn.size(), 0.0);  // of the normalised rows, [B, G, L, N]
  if (!s.D.empty()) r.dD.assign(static_cast<size_t>(D), 0.0);
  if (!s.z.empty()) r.dz.assign(seq, 0.0);
  if (!s.delta_bias.empty()) r.ddelta_bias.assign(static_cast<size_t>(D), 0.0);
  for (int64_t b = 0; b < Bn; ++b)
    for (int64_t d = 0; d < D; ++d) {
      const int64_t g = d / per_group;
      const V Bw = rows(s, s.B, b, g, mag, nullptr), Cw = rows(s, s.C, b, g, mag, nullptr);
      const double Dd = s.D.empty() ? 0.0 : m(s.D[static_cast<size_t>(d)], mag);
      // h[l + 1] = the state after position l, h[0] the initial one; a[l] the decays.
      V h(static_cast<size_t>((L + 1) * N), 0.0), a(static_cast<size_t>(L * N)), dt(static_cast<size_t>(L)), raw(dt.size());
      if (!s.h0.empty())
        for (int64_t n = 0; n < N; ++n) h[static_cast<size_t>(n)] = m(s.h0[static_cast<size_t>((b * D + d) * N + n)], mag);
      for (int64_t l = 0; l < L; ++l) {
        const size_t e = static_cast<size_t>((b * D + d) * L + l);
        raw[static_cast<size_t>(l)] = s.delta[e] + (s.delta_bias.empty() ? 0.0 : s.delta_bias[static_cast<size_t>(d)]);
        dt[static_cast<size_t>(l)] = s.softplus ? softplus(raw[static_cast<size_t>(l)]) : raw[static_cast<size_t>(l)];
        for (int64_t n = 0; n < N; ++n) {
          const size_t k = static_cast<size_t>(l * N + n);
          a[k] = std::exp(dt[static_cast<size_t>(l)] * s.A[static_cast<size_t>(d * N + n)]);
          h[k + static_cast<size_t>(N)] = a[k] * h[k] + m(dt[static_cast<size_t>(l)], mag) * Bw[k] * m(s.u[e], mag);
        }
      }
      V carry(static_cast<size_t>(N), 0.0);
      for (int64_t l = L - 1; l >= 0; --l) {
        const size_t e = static_cast<size_t>((b * D + d) * L + l);
        const double u = m(s.u[e], mag), dtl = m(dt[static_cast<size_t>(l)], mag), go = m(dout[e], mag);
        double dy = go;
        if (!s.z.empty()) {
          double y = Dd * u;
          for (int64_t n = 0; n < N; ++n) y += Cw[static_cast<size_t>(l * N + n)] * h[static_cast<size_t>((l + 1) * N + n)];
          r.dz[e] = go * m(y, mag) * (mag ? dsilu_mag(s.z[e]) : dsilu_(s.z[e]));
          dy = go * m(silu_(s.z[e]), mag);
        }
        double ddt = 0, sgb = 0;
        for (int64_t n = 0; n < N; ++n) {
          const size_t k = static_cast<size_t>(l * N + n);
          const double An = m(s.A[static_cast<size_t>(d * N + n)], mag);
          const double gn = dy * Cw[k] + carry[static_cast<size_t>(n)];
          const double x = a[k] * h[k];
          ddt += gn * (An * x + Bw[k] * u);
          sgb += gn * Bw[k];
          r.dA[static_cast<size_t>(d * N + n)] += gn * dtl * x;
          const size_t bk = static_cast<size_t>(((b * G + g) * L + l) * N + n);
          dBn[bk] += gn * dtl * u;
          dCn[bk] += dy * h[k + static_cast<size_t>(N)];
          carry[static_cast<size_t>(n)] = a[k] * gn;
        }
        r.du[e] = Dd * dy + dtl * sgb;
        const double dd = s.softplus ? ddt * dsoftplus(raw[static_cast<size_t>(l)]) : ddt;
        r.ddelta[e] = dd;
        if (!s.D.empty()) r.dD[static_cast<size_t>(d)] += dy * u;
        if (!s.delta_bias.empty()) r.ddelta_bias[static_cast<size_t>(d)] += dd;
      }
    }
  // Back through the norm (when on) into [B, G, N, L].
  r.dB.assign(dBn.size(), 0.0);
  r.dC.assign(dBn.size(), 0.0);
  for (int64_t b = 0; b < Bn; ++b)
    for (int64_t g = 0; g < G; ++g)
      for (int pass = 0; pass < 2; ++pass) {
        V rstd;
        const V nr = rows(s, pass == 0 ? s.B : s.C, b, g, mag, &rstd);
        const V& gsrc = pass == 0 ? dBn : dCn;
        V& dst = pass == 0 ? r.dB : r.dC;
        for (int64_t l = 0; l < L; ++l) {
          double mean = 0;
          for (int64_t n = 0; n < N; ++n)
            mean += gsrc[static_cast<size_t>(((b * G + g) * L + l) * N + n)] * nr[static_cast<size_t>(l * N + n)];
          mean /= static_cast<double>(N);
          for (int64_t n = 0; n < N; ++n) {
            const double gn = gsrc[static_cast<size_t>(((b * G + g) * L + l) * N + n)];
            const double v = !s.bc_norm ? gn
                             : mag      ? rstd[static_cast<size_t>(l)] * (gn + nr[static_cast<size_t>(l * N + n)] * mean)
                                        : rstd[static_cast<size_t>(l)] * (gn - nr[static_cast<size_t>(l * N + n)] * mean);
            dst[static_cast<size_t>(((b * G + g) * N + n) * L + l)] = v;
          }
        }
      }
  return r;
}

V causal_conv1d(const Conv& c, bool mag) {
  const int64_t L = c.seqlen, W = c.width;
  V out(static_cast<size_t>(c.batch * c.dim * L));
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t d = 0; d < c.dim; ++d)
      for (int64_t l = 0; l < L; ++l) {
        double pre = c.bias.empty() ? 0.0 : c.bias[static_cast<size_t>(d)], pm = std::abs(pre);
        for (int64_t k = 0; k < W; ++k) {
          const int64_t src = l - (W - 1) + k;
          if (src < 0) continue;
          const double t = c.w[static_cast<size_t>(d * W + k)] * c.x[static_cast<size_t>((b * c.dim + d) * L + src)];
          pre += t, pm += std::abs(t);
        }
        const double y = c.silu ? silu_(pre) : pre;
        out[static_cast<size_t>((b * c.dim + d) * L + l)] = mag ? (c.silu ? pm * dsilu_mag(pre) + std::abs(y) : pm) : y;
      }
  return out;
}

ConvGrad causal_conv1d_backward(const Conv& c, const V& dout, bool mag) {
  const int64_t L = c.seqlen, W = c.width;
  ConvGrad r;
  r.dx.assign(static_cast<size_t>(c.batch * c.dim * L), 0.0);
  r.dw.assign(static_cast<size_t>(c.dim * W), 0.0);
  r.dbias.assign(static_cast<size_t>(c.dim), 0.0);
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t d = 0; d < c.dim; ++d) {
      V dpre(static_cast<size_t>(L));
      for (int64_t l = 0; l < L; ++l) {
        double pre = c.bias.empty() ? 0.0 : c.bias[static_cast<size_t>(d)];
        for (int64_t k = 0; k < W; ++k) {
          const int64_t src = l - (W - 1) + k;
          if (src >= 0) pre += c.w[static_cast<size_t>(d * W + k)] * c.x[static_cast<size_t>((b * c.dim + d) * L + src)];
        }
        const double go = dout[static_cast<size_t>((b * c.dim + d) * L + l)];
        dpre[static_cast<size_t>(l)] = c.silu ? (mag ? std::abs(go) * dsilu_mag(pre) : go * dsilu_(pre)) : m(go, mag);
      }
      for (int64_t l = 0; l < L; ++l) {
        const double gp = dpre[static_cast<size_t>(l)];
        r.dbias[static_cast<size_t>(d)] += gp;
        for (int64_t k = 0; k < W; ++k) {
          const int64_t src = l - (W - 1) + k;
          if (src < 0) continue;
          const size_t xe = static_cast<size_t>((b * c.dim + d) * L + src);
          r.dx[xe] += m(c.w[static_cast<size_t>(d * W + k)], mag) * gp;
          r.dw[static_cast<size_t>(d * W + k)] += gp * m(c.x[xe], mag);
        }
      }
    }
  return r;
}

}  // namespace kcpp::oracle
