#include "oracle.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace kcpp::oracle {

static const double kPi = 3.14159265358979323846;

double silu(double x) { return x / (1.0 + std::exp(-x)); }
double gelu(double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); }
double gelu_tanh(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / kPi) * (x + 0.044715 * x * x * x)));
}
double dsilu(double x) {
  const double s = 1.0 / (1.0 + std::exp(-x));
  return s + x * s * (1.0 - s);
}
double dgelu(double x) { return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))) + x * std::exp(-0.5 * x * x) / std::sqrt(2.0 * kPi); }
double dgelu_tanh(double x) {
  const double c = std::sqrt(2.0 / kPi), u = c * (x + 0.044715 * x * x * x), t = std::tanh(u);
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x);
}

V matmul(const V& a, const V& b, int64_t batch, int64_t m, int64_t n, int64_t k, bool ta, bool tb, bool bcast_b) {
  V c(static_cast<size_t>(batch * m * n));
  for (int64_t p = 0; p < batch; ++p) {
    const double* A = a.data() + p * m * k;
    const double* B = b.data() + (bcast_b ? 0 : p * k * n);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t q = 0; q < k; ++q) s += (ta ? A[q * m + i] : A[i * k + q]) * (tb ? B[j * k + q] : B[q * n + j]);
        c[(p * m + i) * n + j] = s;
      }
  }
  return c;
}

Norm rms_norm(const V& x, const V& w, int64_t rows, int64_t h, double eps, double offset) {
  Norm r{V(x.size()), V(static_cast<size_t>(rows)), {}};
  for (int64_t i = 0; i < rows; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < h; ++j) ss += x[i * h + j] * x[i * h + j];
    const double rs = 1.0 / std::sqrt(ss / h + eps);
    r.rstd[i] = rs;
    for (int64_t j = 0; j < h; ++j) r.y[i * h + j] = x[i * h + j] * rs * (offset + w[j]);
  }
  return r;
}

NormGrad rms_norm_backward(const V& dy, const V& x, const V& w, int64_t rows, int64_t h, double eps, double offset) {
  NormGrad g{V(x.size()), V(static_cast<size_t>(h)), {}, V(x.size()), V(static_cast<size_t>(h))};
  for (int64_t i = 0; i < rows; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < h; ++j) ss += x[i * h + j] * x[i * h + j];
    const double rs = 1.0 / std::sqrt(ss / h + eps);
    // y_j = x_j rs (o + w_j); d rs / d x_k = -rs^3 x_k / h
    double dot = 0, adot = 0;  // sum_j dy_j (o + w_j) x_j, and over absolute values
    for (int64_t j = 0; j < h; ++j) {
      dot += dy[i * h + j] * (offset + w[j]) * x[i * h + j];
      adot += std::fabs(dy[i * h + j] * (offset + w[j]) * x[i * h + j]);
    }
    for (int64_t k = 0; k < h; ++k) {
      const double t1 = dy[i * h + k] * (offset + w[k]) * rs, t2 = rs * rs * rs * x[i * h + k] / h;
      g.dx[i * h + k] = t1 - t2 * dot;
      g.dx_mag[i * h + k] = std::fabs(t1) + std::fabs(t2) * adot;
      g.dw[k] += dy[i * h + k] * x[i * h + k] * rs;
      g.dw_mag[k] += std::fabs(dy[i * h + k] * x[i * h + k] * rs);
    }
  }
  return g;
}

Norm layer_norm(const V& x, const V& w, const V& b, int64_t rows, int64_t h, double eps) {
  Norm r{V(x.size()), V(static_cast<size_t>(rows)), V(static_cast<size_t>(rows))};
  for (int64_t i = 0; i < rows; ++i) {
    double mu = 0, var = 0;
    for (int64_t j = 0; j < h; ++j) mu += x[i * h + j];
    mu /= h;
    for (int64_t j = 0; j < h; ++j) var += (x[i * h + j] - mu) * (x[i * h + j] - mu);
    const double rs = 1.0 / std::sqrt(var / h + eps);
    r.mean[i] = mu;
    r.rstd[i] = rs;
    for (int64_t j = 0; j < h; ++j) r.y[i * h + j] = (x[i * h + j] - mu) * rs * w[j] + (b.empty() ? 0.0 : b[j]);
  }
  return r;
}

NormGrad layer_norm_backward(const V& dy, const V& x, const V& w, int64_t rows, int64_t h, double eps) {
  NormGrad g{V(x.size()), V(static_cast<size_t>(h)), V(static_cast<size_t>(h)), V(x.size()),
             V(static_cast<size_t>(h))};
  const Norm f = layer_norm(x, w, {}, rows, h, eps);
  for (int64_t i = 0; i < rows; ++i) {
    const double rs = f.rstd[i], mu = f.mean[i];
    double sg = 0, sgx = 0, asg = 0, asgx = 0;
    for (int64_t j = 0; j < h; ++j) {
      const double xh = (x[i * h + j] - mu) * rs, gj = dy[i * h + j] * w[j];
      sg += gj;
      sgx += gj * xh;
      asg += std::fabs(gj);
      asgx += std::fabs(gj * xh);
      g.dw[j] += dy[i * h + j] * xh;
      g.dw_mag[j] += std::fabs(dy[i * h + j] * xh);
      g.db[j] += dy[i * h + j];
    }
    for (int64_t j = 0; j < h; ++j) {
      const double xh = (x[i * h + j] - mu) * rs, gj = dy[i * h + j] * w[j];
      g.dx[i * h + j] = rs * (gj - sg / h - xh * sgx / h);
      g.dx_mag[i * h + j] = rs * (std::fabs(gj) + asg / h + std::fabs(xh) * asgx / h);
    }
  }
  return g;
}

V rope(const V& x, const V& cs, const V& sn, int64_t b, int64_t h, int64_t s, int64_t d, int64_t rd, int64_t cb,
       bool backward, bool interleaved) {
  V y(x.size());
  const int64_t half = rd / 2;
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t hi = 0; hi < h; ++hi)
      for (int64_t si = 0; si < s; ++si) {
        const double* xr = x.data() + ((bi * h + hi) * s + si) * d;
        double* yr = y.data() + ((bi * h + hi) * s + si) * d;
        const double* c = cs.data() + ((cb == 1 ? 0 : bi) * s + si) * rd;
        const double* sv = sn.data() + ((cb == 1 ? 0 : bi) * s + si) * rd;
        for (int64_t j = 0; j < half; ++j) {
          // Forward, per pair (x1, x2) = (x_p, x_q):  y_p = x1 c_p - x2 s_p,  y_q = x2 c_q + x1 s_q.
          // Backward is the transpose: dx_p = dy_p c_p + dy_q s_q,  dx_q = dy_q c_q - dy_p s_p.
          const int64_t p = interleaved ? 2 * j : j, q = interleaved ? 2 * j + 1 : j + half;
          const double x1 = xr[p], x2 = xr[q];
          if (!backward) {
            yr[p] = x1 * c[p] - x2 * sv[p];
            yr[q] = x2 * c[q] + x1 * sv[q];
          } else {
            yr[p] = x1 * c[p] + x2 * sv[q];
            yr[q] = x2 * c[q] - x1 * sv[p];
          }
        }
        for (int64_t j = rd; j < d; ++j) yr[j] = xr[j];
      }
  return y;
}

double quick_gelu(double x) { return x / (1.0 + std::exp(-1.702 * x)); }
double dquick_gelu(double x) {
  const double s = 1.0 / (1.0 + std::exp(-1.702 * x));
  return s + 1.702 * x * s * (1.0 - s);
}

double act_f(Act a, double x) {
  switch (a) {
    case Act::Silu: return silu(x);
    case Act::Gelu: return gelu(x);
    case Act::GeluTanh: return gelu_tanh(x);
    case Act::QuickGelu: return quick_gelu(x);
  }
  return 0;
}
double act_d(Act a, double x) {
  switch (a) {
    case Act::Silu: return dsilu(x);
    case Act::Gelu: return dgelu(x);
    case Act::GeluTanh: return dgelu_tanh(x);
    case Act::QuickGelu: return dquick_gelu(x);
  }
  return 0;
}

V glu(const V& gate, const V& up, Act act) {
  V o(gate.size());
  for (size_t i = 0; i < o.size(); ++i) o[i] = act_f(act, gate[i]) * up[i];
  return o;
}

void glu_backward(const V& dout, const V& gate, const V& up, Act act, V& dgate, V& dup) {
  dgate.resize(gate.size());
  dup.resize(gate.size());
  for (size_t i = 0; i < gate.size(); ++i) {
    dgate[i] = dout[i] * up[i] * act_d(act, gate[i]);
    dup[i] = dout[i] * act_f(act, gate[i]);
  }
}

GluMagnitude glu_magnitude(const V& dout, const V& gate, const V& up, Act act) {
  GluMagnitude m{V(gate.size()), V(gate.size()), V(gate.size())};
  const double k = std::sqrt(2.0 / kPi), c = 0.044715;
  for (size_t i = 0; i < gate.size(); ++i) {
    const double x = gate[i], ax = std::fabs(x);
    double f = 0, df = 0;  // magnitudes of act(x) and act'(x)
    if (act == Act::Silu || act == Act::QuickGelu) {
      const double a = act == Act::Silu ? 1.0 : 1.702, sg = 1.0 / (1.0 + std::exp(-a * x));
      f = ax * sg;
      df = sg + a * ax * sg * (1 - sg);
    } else if (act == Act::Gelu) {
      const double e = std::fabs(std::erf(x / std::sqrt(2.0)));
      f = ax * 0.5 * (1 + e);
      df = 0.5 * (1 + e) + ax * std::exp(-0.5 * x * x) / std::sqrt(2 * kPi);
    } else {
      const double t = std::tanh(k * (x + c * x * x * x)), at = std::fabs(t);
      f = ax * 0.5 * (1 + at);
      df = 0.5 * (1 + at) + 0.5 * ax * (1 - t * t) * k * (1 + 3 * c * x * x);
    }
    m.out[i] = f * std::fabs(up[i]);
    if (!dout.empty()) {
      m.dgate[i] = std::fabs(dout[i] * up[i]) * df;
      m.dup[i] = std::fabs(dout[i]) * f;
    }
  }
  return m;
}

// Returns the row's log-sum-exp.
static double log_probs_row(const double* x, int64_t v, V& lp) {
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < v; ++j) mx = std::max(mx, x[j]);
  double s = 0;
  for (int64_t j = 0; j < v; ++j) s += std::exp(x[j] - mx);
  const double lse = mx + std::log(s);
  lp.resize(static_cast<size_t>(v));
  for (int64_t j = 0; j < v; ++j) lp[j] = x[j] - lse;
  return lse;
}

V cross_entropy_rows(const V& logits, const std::vector<int64_t>& t, int64_t n, int64_t v, int64_t ignore,
                     double smoothing, int64_t& count) {
  V loss(static_cast<size_t>(n));
  count = 0;
  V lp;
  for (int64_t i = 0; i < n; ++i) {
    if (t[i] == ignore) continue;
    ++count;
    log_probs_row(logits.data() + i * v, v, lp);
    double mean_neg = 0;
    for (int64_t j = 0; j < v; ++j) mean_neg -= lp[j];
    mean_neg /= v;
    loss[i] = (1 - smoothing) * -lp[t[i]] + (smoothing > 0 ? smoothing * mean_neg : 0.0);  // no 0 x inf (masked logits)
  }
  return loss;
}

V cross_entropy_backward(const V& logits, const std::vector<int64_t>& t, const V& g, int64_t n, int64_t v,
                         int64_t ignore, double smoothing, V* magnitude) {
  V d(logits.size());
  if (magnitude) magnitude->assign(logits.size(), 0.0);
  V lp;
  for (int64_t i = 0; i < n; ++i) {
    if (t[i] == ignore) continue;
    log_probs_row(logits.data() + i * v, v, lp);
    // d loss / d x_j = softmax_j - (1 - eps) [j = t] - eps / V
    for (int64_t j = 0; j < v; ++j)
    {
      const double hot = (1 - smoothing) * (j == t[i] ? 1.0 : 0.0);
      d[i * v + j] = g[i] * (std::exp(lp[j]) - hot - smoothing / v);
      if (magnitude) (*magnitude)[i * v + j] = std::fabs(g[i]) * (std::exp(lp[j]) + hot + smoothing / v);
    }
  }
  return d;
}

namespace {
// z = c tanh(x / c) (or x), and the log-softmax of z.
// Returns the row's log-sum-exp (not z[0] - lp[0]: that is NaN when z[0] is a masked -inf).
double capped_log_probs(const double* x, int64_t v, double cap, V& z, V& lp) {
  z.assign(x, x + v);
  if (cap > 0)
    for (double& e : z) e = cap * std::tanh(e / cap);
  return log_probs_row(z.data(), v, lp);
}
double weight_of(const V& w, int64_t j) { return w.empty() ? 1.0 : w[static_cast<size_t>(j)]; }
}  // namespace

V cross_entropy_rows(const V& logits, const std::vector<int64_t>& t, int64_t n, int64_t v, const CEOptions& o,
                     double& divisor) {
  V loss(static_cast<size_t>(n), 0.0), z, lp;
  divisor = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (t[i] == o.ignore) continue;
    const double wt = weight_of(o.class_weight, t[i]);
    divisor += wt;
    const double lse = capped_log_probs(logits.data() + i * v, v, o.softcap, z, lp);
    double smooth = 0;  // -(1 / V) sum_j w_j log p_j
    for (int64_t j = 0; j < v; ++j) smooth -= weight_of(o.class_weight, j) * lp[j];
    smooth /= static_cast<double>(v);
    // Without smoothing the term is absent (as in PyTorch), not 0 x inf when a logit is -inf (masked).
    const double ce = (1 - o.smoothing) * wt * -lp[t[i]] + (o.smoothing > 0 ? o.smoothing * smooth : 0.0);
    loss[i] = weight_of(o.token_weight, i) * (ce + o.z_loss * lse * lse);
  }
  return loss;
}

V cross_entropy_backward(const V& logits, const std::vector<int64_t>& t, const V& g, int64_t n, int64_t v,
                         const CEOptions& o, V* magnitude) {
  V d(logits.size(), 0.0), z, lp;
  if (magnitude) magnitude->assign(logits.size(), 0.0);
  double wsum = 0;
  for (int64_t j = 0; j < v; ++j) wsum += weight_of(o.class_weight, j);
  for (int64_t i = 0; i < n; ++i) {
    if (t[i] == o.ignore) continue;
    const double lse = capped_log_probs(logits.data() + i * v, v, o.softcap, z, lp), wt = weight_of(o.class_weight, t[i]);
    const double gi = g[i] * weight_of(o.token_weight, i);
    for (int64_t j = 0; j < v; ++j) {
      const double p = std::exp(lp[j]), wj = weight_of(o.class_weight, j), hot = j == t[i] ? 1.0 : 0.0;
      // d ce / d z_j = (1 - eps) w_t (p_j - [j = t]) + (eps / V) (W p_j - w_j); d (beta lse^2) / d z_j = 2 beta lse p_j
      const double dz = (1 - o.smoothing) * wt * (p - hot) + o.smoothing / v * (wsum * p - wj) + 2 * o.z_loss * lse * p;
      const double mz = (1 - o.smoothing) * std::fabs(wt) * (p + hot) + o.smoothing / v * (std::fabs(wsum) * p + std::fabs(wj)) +
                        2 * std::fabs(o.z_loss * lse) * p;
      const double chain = o.softcap > 0 ? 1 - (z[j] / o.softcap) * (z[j] / o.softcap) : 1.0;
      d[i * v + j] = gi * dz * chain;
      if (magnitude) (*magnitude)[i * v + j] = std::fabs(gi) * mz * chain;
    }
  }
  return d;
}

Attn attention(const V& q, const V& k, const V& v, const V* dout, int64_t b, int64_t hq, int64_t hkv, int64_t sq,
               int64_t skv, int64_t d, double scale, bool causal, int64_t window, int64_t chunk, double softcap) {
  Attn r{V(q.size()), V(q.size()), V(k.size()), V(v.size())};
  const int64_t g = hq / hkv;
  // A task per (batch, kv head): it alone writes that head's dk, dv and its query heads' out, dq, in
  // the order of one thread (query heads, then queries), so the results do not depend on the threads.
#pragma omp parallel for schedule(dynamic)
  for (int64_t bk = 0; bk < b * hkv; ++bk) {
    const int64_t bi = bk / hkv, kh = bk % hkv;
    V p(static_cast<size_t>(skv)), dp(static_cast<size_t>(skv)), slope(static_cast<size_t>(skv), 1.0);
    for (int64_t h = kh * g; h < (kh + 1) * g; ++h) {
      for (int64_t i = 0; i < sq; ++i) {
        const int64_t pos = i + skv - sq;
        const double* qi = q.data() + ((bi * hq + h) * sq + i) * d;
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < skv; ++j) {
          const bool vis = (!causal || j <= pos) && (window <= 0 || pos - j < window) && (chunk <= 0 || j / chunk == pos / chunk);
          if (!vis) {
            p[j] = -std::numeric_limits<double>::infinity();
            continue;
          }
          const double* kj = k.data() + ((bi * hkv + kh) * skv + j) * d;
          double s = 0;
          for (int64_t c = 0; c < d; ++c) s += qi[c] * kj[c];
          p[j] = s * scale;
          if (softcap > 0) {
            const double u = std::tanh(p[j] / softcap);
            p[j] = softcap * u, slope[j] = 1 - u * u;
          }
          mx = std::max(mx, p[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j < skv; ++j) sum += (p[j] = std::exp(p[j] - mx));
        for (int64_t j = 0; j < skv; ++j) p[j] /= sum;
        double* oi = r.out.data() + ((bi * hq + h) * sq + i) * d;
        for (int64_t j = 0; j < skv; ++j) {
          const double* vj = v.data() + ((bi * hkv + kh) * skv + j) * d;
          for (int64_t c = 0; c < d; ++c) oi[c] += p[j] * vj[c];
        }
        if (!dout) continue;
        const double* doi = dout->data() + ((bi * hq + h) * sq + i) * d;
        double dot = 0;
        for (int64_t j = 0; j < skv; ++j) {
          const double* vj = v.data() + ((bi * hkv + kh) * skv + j) * d;
          double s = 0;
          for (int64_t c = 0; c < d; ++c) s += doi[c] * vj[c];
          dp[j] = s;
          dot += p[j] * s;
        }
        double* dqi = r.dq.data() + ((bi * hq + h) * sq + i) * d;
        for (int64_t j = 0; j < skv; ++j) {
          const double ds = p[j] * (dp[j] - dot) * slope[j] * scale;
          const double* kj = k.data() + ((bi * hkv + kh) * skv + j) * d;
          double* dkj = r.dk.data() + ((bi * hkv + kh) * skv + j) * d;
          double* dvj = r.dv.data() + ((bi * hkv + kh) * skv + j) * d;
          for (int64_t c = 0; c < d; ++c) {
            dqi[c] += ds * kj[c];
            dkj[c] += ds * qi[c];
            dvj[c] += p[j] * doi[c];
          }
        }
      }
    }
  }
  return r;
}

// ---- mixture of experts ------------------------------------------------------------------------

namespace {
// Routing weights of the chosen ids from the logits z (softmax, optionally renormalized, or sigmoid).
V route_weights(const MoeSpec& s, const V& z, const std::vector<int64_t>& ids) {
  V w(static_cast<size_t>(s.t * s.k), 0.0);
  for (int64_t t = 0; t < s.t; ++t) {
    const double* zt = z.data() + t * s.e;
    double m = zt[0], sum = 0, chosen = 0;
    for (int64_t e = 0; e < s.e; ++e) m = std::max(m, zt[e]);
    for (int64_t e = 0; e < s.e; ++e) sum += std::exp(zt[e] - m);
    for (int64_t j = 0; j < s.k; ++j) {
      const double zj = zt[ids[t * s.k + j]];
      w[t * s.k + j] = s.routing == 1 ? 1 / (1 + std::exp(-zj)) : std::exp(zj - m) / sum;
      chosen += w[t * s.k + j];
    }
    if (s.routing == 0 && s.normalize)
      for (int64_t j = 0; j < s.k; ++j) w[t * s.k + j] /= chosen;
  }
  return w;
}
}  // namespace

void moe_route(const MoeSpec& s, const V& z, std::vector<int64_t>& ids, V& w) {
  ids.assign(static_cast<size_t>(s.t * s.k), 0);
  w.assign(static_cast<size_t>(s.t * s.k), 0.0);
  std::vector<char> taken(static_cast<size_t>(s.e));
  for (int64_t t = 0; t < s.t; ++t) {
    const double* zt = z.data() + t * s.e;
    std::fill(taken.begin(), taken.end(), 0);
    for (int64_t j = 0; j < s.k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < s.e; ++e)
        if (!taken[e] && (best < 0 || zt[e] > zt[best])) best = e;
      taken[best] = 1;
      ids[t * s.k + j] = best;
    }
  }
  w = route_weights(s, z, ids);
}

namespace {
// One evaluation of the block.  With `mag`, every gradient is instead the magnitude of the terms that
// form it: each factor taken by its absolute value and each difference as a sum (the nonlinear
// functions evaluated at the real values, then made absolute).  See NormGrad for why.
MoeResult moe_pass(const MoeSpec& s, const MoeWeights& wt, const V& z, const std::vector<int64_t>& ids, const V& w_given,
                   const V* dout, const V* dz_extra, bool mag) {
  const int64_t T = s.t, H = s.h, E = s.e, K = s.k, I = s.i, SI = s.si;
  const V w = s.routing == 2 ? w_given : route_weights(s, z, ids);
  auto A = [mag](double v) { return mag ? std::fabs(v) : v; };
  MoeResult r;
  r.out.assign(static_cast<size_t>(T * H), 0.0);
  const bool grads = dout != nullptr;
  if (grads) {
    r.dx.assign(static_cast<size_t>(T * H), 0.0);
    r.dgate.assign(static_cast<size_t>(E * I * H), 0.0);
    r.dup.assign(r.dgate.size(), 0.0);
    r.ddown.assign(static_cast<size_t>(E * H * I), 0.0);
    r.dw.assign(static_cast<size_t>(T * K), 0.0);
  }
  // One gated MLP on input xs, weights gate / up [I', H], down [H, I']; adds coef * y to out_t.  With
  // grads, back-propagates the upstream gradient coef * dout_t into dxs and the weight gradients and
  // returns the gradient of coef, dout_t . y, written as (dout_t Wd) . h.
  auto mlp = [&](const double* xs, const double* g_w, const double* u_w, const double* d_w, int64_t inter, double coef,
                 double* out_t, const double* dout_t, double* dxs, double* dg_w, double* du_w, double* dd_w) {
    V g(static_cast<size_t>(inter)), u(g.size()), hh(g.size());
    for (int64_t a = 0; a < inter; ++a) {
      double gs = 0, us = 0;
      for (int64_t c = 0; c < H; ++c) gs += xs[c] * g_w[a * H + c], us += xs[c] * u_w[a * H + c];
      g[a] = gs, u[a] = us, hh[a] = act_f(s.act, gs) * us;
    }
    for (int64_t c = 0; c < H; ++c) {
      double acc = 0;
      for (int64_t a = 0; a < inter; ++a) acc += hh[a] * d_w[c * inter + a];
      out_t[c] += coef * acc;
    }
    if (!dout_t) return 0.0;
    double dcoef = 0;
    for (int64_t a = 0; a < inter; ++a) {
      double q = 0;
      for (int64_t c = 0; c < H; ++c) q += A(dout_t[c]) * A(d_w[c * inter + a]);
      dcoef += q * A(hh[a]);
      const double dh = A(coef) * q;
      const double dg = dh * A(u[a]) * A(act_d(s.act, g[a])), du = dh * A(act_f(s.act, g[a]));
      for (int64_t c = 0; c < H; ++c) {
        dd_w[c * inter + a] += A(coef) * A(dout_t[c]) * A(hh[a]);
        dg_w[a * H + c] += dg * A(xs[c]);
        du_w[a * H + c] += du * A(xs[c]);
        dxs[c] += dg * A(g_w[a * H + c]) + du * A(u_w[a * H + c]);
      }
    }
    return dcoef;
  };
  // A task per expert (OpenMP): it alone writes its weight gradients, adding its slots (t, j) in the
  // order of one thread, and each slot's share of out_t and dx_t goes to a buffer of its own, added
  // below in slot order: the results do not depend on the threads.
  const int64_t n_slots = T * K;
  V out_slot(static_cast<size_t>(n_slots * H), 0.0), dx_slot(grads ? out_slot.size() : 0, 0.0);
  std::vector<std::vector<int64_t>> slots_of(static_cast<size_t>(E));
  for (int64_t sl = 0; sl < n_slots; ++sl)
    if (ids[sl] >= 0 && ids[sl] < E) slots_of[static_cast<size_t>(ids[sl])].push_back(sl);
#pragma omp parallel for schedule(dynamic)
  for (int64_t e = 0; e < E; ++e) {
    V xs(static_cast<size_t>(H)), dxs(static_cast<size_t>(H));
    for (const int64_t sl : slots_of[static_cast<size_t>(e)]) {
      const int64_t t = sl / K;
      const double wj = w[sl];
      const double* xt = wt.x.data() + t * H;
      for (int64_t c = 0; c < H; ++c) xs[c] = s.weight_on_input ? wj * xt[c] : xt[c];
      std::fill(dxs.begin(), dxs.end(), 0.0);
      const double coef = s.weight_on_input ? 1.0 : wj;
      const double dcoef = mlp(xs.data(), wt.gate.data() + e * I * H, wt.up.data() + e * I * H, wt.down.data() + e * H * I,
                               I, coef, out_slot.data() + sl * H, grads ? dout->data() + t * H : nullptr, dxs.data(),
                               grads ? r.dgate.data() + e * I * H : nullptr, grads ? r.dup.data() + e * I * H : nullptr,
                               grads ? r.ddown.data() + e * H * I : nullptr);
      if (!grads) continue;
      double dwj = s.weight_on_input ? 0.0 : dcoef;
      for (int64_t c = 0; c < H; ++c) {
        dx_slot[static_cast<size_t>(sl * H + c)] = (s.weight_on_input ? A(wj) : 1.0) * dxs[c];
        if (s.weight_on_input) dwj += dxs[c] * A(xt[c]);
      }
      r.dw[sl] = dwj;
    }
  }
  for (int64_t sl = 0; sl < n_slots; ++sl) {
    if (ids[sl] < 0 || ids[sl] >= E) continue;
    const int64_t t = sl / K;
    for (int64_t c = 0; c < H; ++c) {
      r.out[t * H + c] += out_slot[static_cast<size_t>(sl * H + c)];
      if (grads) r.dx[t * H + c] += dx_slot[static_cast<size_t>(sl * H + c)];
    }
  }
  V dxs(static_cast<size_t>(H));
  if (SI > 0) {
    if (grads) {
      r.dsgate.assign(static_cast<size_t>(SI * H), 0.0);
      r.dsup.assign(r.dsgate.size(), 0.0);
      r.dsdown.assign(static_cast<size_t>(H * SI), 0.0);
      if (!wt.sgs.empty()) r.dsgs.assign(static_cast<size_t>(H), 0.0);
    }
    for (int64_t t = 0; t < T; ++t) {
      const double* xt = wt.x.data() + t * H;
      double sg = 1;
      if (!wt.sgs.empty()) {
        double dot = 0;
        for (int64_t c = 0; c < H; ++c) dot += xt[c] * wt.sgs[c];
        sg = 1 / (1 + std::exp(-dot));
      }
      std::fill(dxs.begin(), dxs.end(), 0.0);
      const double dsg = mlp(xt, wt.sgate.data(), wt.sup.data(), wt.sdown.data(), SI, sg, r.out.data() + t * H,
                             grads ? dout->data() + t * H : nullptr, dxs.data(), grads ? r.dsgate.data() : nullptr,
                             grads ? r.dsup.data() : nullptr, grads ? r.dsdown.data() : nullptr);
      if (!grads) continue;
      for (int64_t c = 0; c < H; ++c) r.dx[t * H + c] += dxs[c];
      if (!wt.sgs.empty()) {
        const double dl = dsg * sg * (1 - sg);
        for (int64_t c = 0; c < H; ++c) {
          r.dsgs[c] += dl * A(xt[c]);
          r.dx[t * H + c] += dl * A(wt.sgs[c]);
        }
      }
    }
  }
  if (!grads || s.routing == 2) return r;
  // The router: dz per token, then dWr = dz^T x, dx += dz Wr.
  r.drouter.assign(static_cast<size_t>(E * H), 0.0);
  V dz(static_cast<size_t>(E)), p(static_cast<size_t>(E));
  const double sign = mag ? 1.0 : -1.0;  // differences become sums for the magnitudes
  for (int64_t t = 0; t < T; ++t) {
    const double* zt = z.data() + t * E;
    std::fill(dz.begin(), dz.end(), 0.0);
    if (s.routing == 1) {
      for (int64_t j = 0; j < K; ++j) {
        const double wj = w[t * K + j];
        dz[ids[t * K + j]] += r.dw[t * K + j] * wj * (1 - wj);
      }
    } else {
      double m = zt[0], sum = 0;
      for (int64_t e = 0; e < E; ++e) m = std::max(m, zt[e]);
      for (int64_t e = 0; e < E; ++e) sum += p[e] = std::exp(zt[e] - m);
      for (int64_t e = 0; e < E; ++e) p[e] /= sum;
      // w_j = p_j / c (c = 1, or the chosen sum): dp_i = dw_i / c - [normalize] sum_j dw_j p_j / c^2.
      double c = 1, dot = 0;
      if (s.normalize) {
        c = 0;
        for (int64_t j = 0; j < K; ++j) c += p[ids[t * K + j]];
        for (int64_t j = 0; j < K; ++j) dot += r.dw[t * K + j] * p[ids[t * K + j]];
      }
      V dp(static_cast<size_t>(E), 0.0);
      for (int64_t j = 0; j < K; ++j) dp[ids[t * K + j]] += r.dw[t * K + j] / c;
      if (s.normalize)
        for (int64_t j = 0; j < K; ++j) dp[ids[t * K + j]] += sign * dot / (c * c);
      double pdp = 0;
      for (int64_t e = 0; e < E; ++e) pdp += p[e] * dp[e];
      for (int64_t e = 0; e < E; ++e) dz[e] = p[e] * (dp[e] + sign * pdp);
      if (mag)
        for (int64_t e = 0; e < E; ++e) dz[e] = std::fabs(dz[e]);
    }
    if (dz_extra)
      for (int64_t e = 0; e < E; ++e) dz[e] += A((*dz_extra)[t * E + e]);
    const double* xt = wt.x.data() + t * H;
    for (int64_t e = 0; e < E; ++e)
      for (int64_t c = 0; c < H; ++c) {
        r.drouter[e * H + c] += dz[e] * A(xt[c]);
        r.dx[t * H + c] += dz[e] * A(wt.router[e * H + c]);
      }
  }
  return r;
}
}  // namespace

MoeResult moe(const MoeSpec& s, const MoeWeights& wt, const V& z, const std::vector<int64_t>& ids, const V& w_given,
              const V* dout, const V* dz_extra) {
  MoeResult r = moe_pass(s, wt, z, ids, w_given, dout, dz_extra, false);
  if (!dout) return r;
  MoeResult m = moe_pass(s, wt, z, ids, w_given, dout, dz_extra, true);
  r.dx_mag = std::move(m.dx), r.drouter_mag = std::move(m.drouter), r.dgate_mag = std::move(m.dgate);
  r.dup_mag = std::move(m.dup), r.ddown_mag = std::move(m.ddown), r.dsgate_mag = std::move(m.dsgate);
  r.dsup_mag = std::move(m.dsup), r.dsdown_mag = std::move(m.dsdown), r.dsgs_mag = std::move(m.dsgs);
  r.dw_mag = std::move(m.dw);
  return r;
}

double load_balancing_loss(const V& z, int64_t rows, int64_t e, int64_t k, const V& m, double (*round)(double),
                           double grad_scale, V* dz) {
  V p(static_cast<size_t>(rows * e)), count(static_cast<size_t>(e), 0.0), prob(static_cast<size_t>(e), 0.0);
  double total = 0;
  std::vector<char> taken(static_cast<size_t>(e));
  auto mask = [&](int64_t r) { return m.empty() ? 1.0 : m[static_cast<size_t>(r) % m.size()]; };
  for (int64_t r = 0; r < rows; ++r) {
    const double* zr = z.data() + r * e;
    double* pr = p.data() + r * e;
    double mx = zr[0], sum = 0;
    for (int64_t a = 0; a < e; ++a) mx = std::max(mx, zr[a]);
    for (int64_t a = 0; a < e; ++a) sum += std::exp(zr[a] - mx);
    for (int64_t a = 0; a < e; ++a) pr[a] = round(std::exp(zr[a] - mx) / sum);
    std::fill(taken.begin(), taken.end(), 0);
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t a = 0; a < e; ++a)
        if (!taken[a] && (best < 0 || pr[a] > pr[best])) best = a;
      taken[best] = 1;
      count[best] += mask(r);
    }
    for (int64_t a = 0; a < e; ++a) prob[a] += mask(r) * pr[a];
    total += mask(r);
  }
  double loss = 0;
  for (int64_t a = 0; a < e; ++a) loss += (count[a] / total) * (prob[a] / total);
  if (dz) {
    dz->assign(static_cast<size_t>(rows * e), 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      const double* pr = p.data() + r * e;
      V d(static_cast<size_t>(e));
      double dot = 0;
      for (int64_t a = 0; a < e; ++a) {
        d[a] = grad_scale * e * (count[a] / total) * mask(r) / total;
        dot += pr[a] * d[a];
      }
      for (int64_t a = 0; a < e; ++a) (*dz)[r * e + a] = pr[a] * (d[a] - dot);
    }
  }
  return loss * static_cast<double>(e);
}

}  // namespace kcpp::oracle
