#include "nn/ssm_layers.h"

#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/profile.h"

namespace kcpp::nn {

namespace {

using V = std::vector<double>;

// The values of `t` in row-major order (any strides, any device), and back.
V host(const Tensor& t) { return t.defined() ? t.to_f64_vector() : V(); }
Tensor device_tensor(const V& v, const Shape& shape, DType dtype, Device device) {
  return Tensor::from_f64(v, shape, dtype, Device::cpu()).to(device);
}

double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double silu(double x) { return x * sigmoid(x); }
double silu_grad(double x) {
  const double s = sigmoid(x);
  return s * (1.0 + x * (1.0 - s));
}

double bytes(const Tensor& t) { return t.defined() ? static_cast<double>(t.numel() * dtype_size(t.dtype())) : 0.0; }

#define KCPP_SLOT_REGION(pass, dev, moved) \
  const profile::Region kcpp_region_(layer_name(), dev, 0.0, profile::enabled() ? (moved) : 0.0, kernel() ? pass : pass " (reference)")

// The scan's inputs on the host, with B and C normalised (Falcon-Mamba) and the step after bias and
// softplus; `rstd_b`, `rstd_c` [B, L] kept for the backward.
struct HostScan {
  int64_t batch, dim, len, n;
  V u, delta, dt, A, B, C, D, z, bias, Bn, Cn, rstd_b, rstd_c;
  bool use_softplus;

  HostScan(const SelectiveScan::Inputs& in, const SelectiveScan::Options& o)
      : batch(in.u.size(0)), dim(in.u.size(1)), len(in.u.size(2)), n(in.A.size(1)), u(host(in.u)), delta(host(in.delta)),
        A(host(in.A)), B(host(in.B)), C(host(in.C)), D(host(in.D)), z(host(in.z)), bias(host(in.delta_bias)),
        use_softplus(o.delta_softplus) {
    dt.resize(u.size());
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t d = 0; d < dim; ++d)
        for (int64_t l = 0; l < len; ++l) {
          const int64_t i = (b * dim + d) * len + l;
          const double x = delta[i] + (bias.empty() ? 0.0 : bias[d]);
          dt[i] = use_softplus ? softplus(x) : x;
        }
    Bn = B, Cn = C;
    rstd_b.assign(batch * len, 1.0), rstd_c.assign(batch * len, 1.0);
    if (o.bc_rms_eps) {
      normalise(Bn, rstd_b, *o.bc_rms_eps);
      normalise(Cn, rstd_c, *o.bc_rms_eps);
    }
  }
  void normalise(V& m, V& rstd, double eps) const {  // m [B, N, L] over N
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t l = 0; l < len; ++l) {
        double ss = 0;
        for (int64_t k = 0; k < n; ++k) ss += m[(b * n + k) * len + l] * m[(b * n + k) * len + l];
        const double r = 1.0 / std::sqrt(ss / static_cast<double>(n) + eps);
        rstd[b * len + l] = r;
        for (int64_t k = 0; k < n; ++k) m[(b * n + k) * len + l] *= r;
      }
  }
  double bn(int64_t b, int64_t k, int64_t l) const { return Bn[(b * n + k) * len + l]; }
  double cn(int64_t b, int64_t k, int64_t l) const { return Cn[(b * n + k) * len + l]; }
};

void check_scan(const SelectiveScan::Inputs& in) {
  KCPP_CHECK(in.u.dim() == 3 && in.delta.shape() == in.u.shape(), "SelectiveScan: u and delta must be [B, D, L] alike");
  KCPP_CHECK(in.A.dim() == 2 && in.A.size(0) == in.u.size(1), "SelectiveScan: A must be [D, N] with D = u's channels");
  const Shape bc{in.u.size(0), in.A.size(1), in.u.size(2)};
  KCPP_CHECK(in.B.shape() == bc && in.C.shape() == bc, "SelectiveScan: B and C must be [B, N, L]");
  KCPP_CHECK(!in.z.defined() || in.z.shape() == in.u.shape(), "SelectiveScan: z must be shaped as u");
}

}  // namespace

// ---- SelectiveScan -------------------------------------------------------------------------------

SelectiveScan::SelectiveScan(Options o) : Slot("SelectiveScan", "SelectiveScan/1"), options(o) {}

Tensor SelectiveScan::forward(const Inputs& in, Tensor* last_state, Saved* saved) {
  check_scan(in);
  KCPP_SLOT_REGION("forward", in.u.device(), 4 * bytes(in.u) + 2 * bytes(in.B));
  const int64_t b_ = in.u.size(0), d_ = in.u.size(1), l_ = in.u.size(2), n_ = in.A.size(1);
  if (kernel()) {
    Tensor out = Tensor::empty(in.u.shape(), in.u.dtype(), in.u.device());
    Tensor last = last_state ? Tensor::empty({b_, d_, n_}, DType::f32, in.u.device()) : Tensor();
    Tensor states = saved ? Tensor::empty({b_, d_, (l_ + 255) / 256, n_}, DType::f32, in.u.device()) : Tensor();
    KernelArgs a;
    a.tensor("u", in.u).tensor("delta", in.delta).tensor("A", in.A).tensor("B", in.B).tensor("C", in.C);
    if (in.D.defined()) a.tensor("D", in.D);
    if (in.z.defined()) a.tensor("z", in.z);
    if (in.delta_bias.defined()) a.tensor("delta_bias", in.delta_bias);
    a.integer("delta_softplus", options.delta_softplus ? 1 : 0);
    if (options.bc_rms_eps) a.real("bc_rms_eps", *options.bc_rms_eps);
    a.tensor("out", out);
    if (last_state) a.tensor("last_state", last);
    if (saved) a.tensor("states", states);
    if (run_forward(a, in.u.device(), saved != nullptr)) {
      if (last_state) *last_state = last;
      if (saved) *saved = {in, states};
      return out;
    }
  } else {
    count_reference();
  }
  const HostScan s(in, options);
  V out(s.u.size()), last(static_cast<size_t>(b_ * d_ * n_));
  std::vector<double> h(static_cast<size_t>(n_));
  for (int64_t b = 0; b < b_; ++b)
    for (int64_t d = 0; d < d_; ++d) {
      std::fill(h.begin(), h.end(), 0.0);
      for (int64_t l = 0; l < l_; ++l) {
        const int64_t i = (b * d_ + d) * l_ + l;
        double y = 0;
        for (int64_t k = 0; k < n_; ++k) {
          h[k] = std::exp(s.dt[i] * s.A[d * n_ + k]) * h[k] + s.dt[i] * s.bn(b, k, l) * s.u[i];
          y += s.cn(b, k, l) * h[k];
        }
        if (!s.D.empty()) y += s.D[d] * s.u[i];
        out[i] = s.z.empty() ? y : y * silu(s.z[i]);
      }
      for (int64_t k = 0; k < n_; ++k) last[(b * d_ + d) * n_ + k] = h[k];
    }
  if (last_state) *last_state = device_tensor(last, {b_, d_, n_}, DType::f32, in.u.device());
  if (saved) *saved = {in, Tensor()};
  return device_tensor(out, in.u.shape(), in.u.dtype(), in.u.device());
}

SelectiveScan::Grads SelectiveScan::backward(const Tensor& dout, const Saved& sv) {
  const Inputs& in = sv.in;
  KCPP_CHECK(in.u.defined(), "SelectiveScan backward: nothing saved (run forward with a Saved)");
  KCPP_SLOT_REGION("backward", in.u.device(), 8 * bytes(in.u) + 4 * bytes(in.B));
  const Device dev = in.u.device();
  const DType dt_ = in.u.dtype();
  auto like = [&](const Tensor& t, DType type) { return t.defined() ? Tensor::empty(t.shape(), type, dev) : Tensor(); };
  if (kernel() && sv.states.defined()) {
    Grads g{like(in.u, dt_), like(in.delta, dt_), like(in.A, DType::f32), like(in.B, dt_), like(in.C, dt_),
            like(in.D, DType::f32), like(in.z, dt_), like(in.delta_bias, DType::f32)};
    KernelArgs a;
    a.tensor("dout", dout).tensor("u", in.u).tensor("delta", in.delta).tensor("A", in.A).tensor("B", in.B).tensor("C", in.C);
    if (in.D.defined()) a.tensor("D", in.D).tensor("dD", g.dD);
    if (in.z.defined()) a.tensor("z", in.z).tensor("dz", g.dz);
    if (in.delta_bias.defined()) a.tensor("delta_bias", in.delta_bias).tensor("ddelta_bias", g.ddelta_bias);
    a.integer("delta_softplus", options.delta_softplus ? 1 : 0);
    if (options.bc_rms_eps) a.real("bc_rms_eps", *options.bc_rms_eps);
    a.tensor("states", sv.states).tensor("du", g.du).tensor("ddelta", g.ddelta).tensor("dA", g.dA);
    a.tensor("dB", g.dB).tensor("dC", g.dC);
    if (run_backward(a, dev)) return g;
  } else {
    count_reference();
  }
  const HostScan s(in, options);
  const int64_t b_ = s.batch, d_ = s.dim, l_ = s.len, n_ = s.n;
  const V go = host(dout);
  V du(s.u.size()), ddelta(s.u.size()), dA(s.A.size()), dBn(s.B.size()), dCn(s.C.size()), dD(s.D.size()), dz(s.z.size()),
      dbias(s.bias.size());
  V hs(static_cast<size_t>((l_ + 1) * n_)), g(static_cast<size_t>(n_)), dy(static_cast<size_t>(l_));
  for (int64_t b = 0; b < b_; ++b)
    for (int64_t d = 0; d < d_; ++d) {
      const int64_t row = (b * d_ + d) * l_;
      // hs[(l + 1) N + k]: the state after position l (hs[0..N) the zero state before position 0).
      std::fill(hs.begin(), hs.begin() + n_, 0.0);
      for (int64_t l = 0; l < l_; ++l) {
        const int64_t i = row + l;
        double y = 0;
        for (int64_t k = 0; k < n_; ++k) {
          const double h = std::exp(s.dt[i] * s.A[d * n_ + k]) * hs[l * n_ + k] + s.dt[i] * s.bn(b, k, l) * s.u[i];
          hs[(l + 1) * n_ + k] = h;
          y += s.cn(b, k, l) * h;
        }
        if (!s.D.empty()) y += s.D[d] * s.u[i];
        if (!s.z.empty()) {
          dz[i] = go[i] * y * silu_grad(s.z[i]);
          dy[l] = go[i] * silu(s.z[i]);
        } else {
          dy[l] = go[i];
        }
      }
      std::fill(g.begin(), g.end(), 0.0);
      for (int64_t l = l_ - 1; l >= 0; --l) {
        const int64_t i = row + l;
        double ddt = 0, dui = 0;
        for (int64_t k = 0; k < n_; ++k) {
          const double a_next = l + 1 < l_ ? std::exp(s.dt[i + 1] * s.A[d * n_ + k]) : 0.0;
          g[k] = dy[l] * s.cn(b, k, l) + a_next * g[k];
          const double a = std::exp(s.dt[i] * s.A[d * n_ + k]), hp = hs[l * n_ + k];
          ddt += g[k] * (s.A[d * n_ + k] * a * hp + s.bn(b, k, l) * s.u[i]);
          dui += g[k] * s.bn(b, k, l);
          dA[d * n_ + k] += g[k] * s.dt[i] * a * hp;
          dBn[(b * n_ + k) * l_ + l] += g[k] * s.dt[i] * s.u[i];
          dCn[(b * n_ + k) * l_ + l] += dy[l] * hs[(l + 1) * n_ + k];
        }
        du[i] = s.dt[i] * dui + (s.D.empty() ? 0.0 : s.D[d] * dy[l]);
        if (!s.D.empty()) dD[d] += dy[l] * s.u[i];
        const double pre = s.delta[i] + (s.bias.empty() ? 0.0 : s.bias[d]);
        ddelta[i] = s.use_softplus ? ddt * sigmoid(pre) : ddt;
        if (!s.bias.empty()) dbias[d] += ddelta[i];
      }
    }
  // Through the RMS norm of B and C: the gradient gn of a row bn = b rstd goes to b as
  // rstd (gn - bn mean(gn bn)).
  auto denorm = [&](V& grad, const V& normed, const V& rstd) {
    if (!options.bc_rms_eps) return;
    for (int64_t b = 0; b < b_; ++b)
      for (int64_t l = 0; l < l_; ++l) {
        double dot = 0;
        for (int64_t k = 0; k < n_; ++k) dot += grad[(b * n_ + k) * l_ + l] * normed[(b * n_ + k) * l_ + l];
        dot /= static_cast<double>(n_);
        const double r = rstd[b * l_ + l];
        for (int64_t k = 0; k < n_; ++k) {
          double& x = grad[(b * n_ + k) * l_ + l];
          x = r * (x - normed[(b * n_ + k) * l_ + l] * dot);
        }
      }
  };
  denorm(dBn, s.Bn, s.rstd_b);
  denorm(dCn, s.Cn, s.rstd_c);
  Grads out;
  out.du = device_tensor(du, in.u.shape(), dt_, dev);
  out.ddelta = device_tensor(ddelta, in.u.shape(), dt_, dev);
  out.dA = device_tensor(dA, in.A.shape(), DType::f32, dev);
  out.dB = device_tensor(dBn, in.B.shape(), dt_, dev);
  out.dC = device_tensor(dCn, in.C.shape(), dt_, dev);
  if (in.D.defined()) out.dD = device_tensor(dD, in.D.shape(), DType::f32, dev);
  if (in.z.defined()) out.dz = device_tensor(dz, in.z.shape(), dt_, dev);
  if (in.delta_bias.defined()) out.ddelta_bias = device_tensor(dbias, in.delta_bias.shape(), DType::f32, dev);
  return out;
}

// ---- SelectiveStateUpdate ------------------------------------------------------------------------

SelectiveStateUpdate::SelectiveStateUpdate(SelectiveScan::Options o)
    : Slot("SelectiveStateUpdate", "SelectiveStateUpdate/1"), options(o) {}

Tensor SelectiveStateUpdate::forward(const Tensor& state, const Tensor& x, const Tensor& dt, const Tensor& A, const Tensor& B,
                                     const Tensor& C, const Tensor& D, const Tensor& z, const Tensor& dt_bias) {
  KCPP_CHECK(state.dim() == 3 && x.dim() == 2 && state.size(0) == x.size(0) && state.size(1) == x.size(1),
             "SelectiveStateUpdate: state must be [B, D, N] and x [B, D]");
  KCPP_SLOT_REGION("forward", x.device(), 2 * bytes(state) + 4 * bytes(x));
  if (kernel()) {
    Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
    KernelArgs a;
    a.tensor("state", state).tensor("x", x).tensor("dt", dt).tensor("A", A).tensor("B", B).tensor("C", C);
    if (D.defined()) a.tensor("D", D);
    if (z.defined()) a.tensor("z", z);
    if (dt_bias.defined()) a.tensor("dt_bias", dt_bias);
    a.integer("dt_softplus", options.delta_softplus ? 1 : 0);
    if (options.bc_rms_eps) a.real("bc_rms_eps", *options.bc_rms_eps);
    a.tensor("out", out);
    if (run_forward(a, x.device(), false)) return out;
  } else {
    count_reference();
  }
  // One position of the scan from the cached state: the scan's reference over L = 1, then the state.
  const int64_t b_ = x.size(0), d_ = x.size(1), n_ = A.size(1);
  SelectiveScan::Inputs in{x.unsqueeze(2), dt.unsqueeze(2), A, B.unsqueeze(2), C.unsqueeze(2), D,
                           z.defined() ? z.unsqueeze(2) : Tensor(), dt_bias};
  const HostScan s(in, options);
  V h = host(state), out(static_cast<size_t>(b_ * d_));
  for (int64_t b = 0; b < b_; ++b)
    for (int64_t d = 0; d < d_; ++d) {
      const int64_t i = b * d_ + d;
      double y = 0;
      for (int64_t k = 0; k < n_; ++k) {
        double& hk = h[i * n_ + k];
        hk = std::exp(s.dt[i] * s.A[d * n_ + k]) * hk + s.dt[i] * s.bn(b, k, 0) * s.u[i];
        y += s.cn(b, k, 0) * hk;
      }
      if (!s.D.empty()) y += s.D[d] * s.u[i];
      out[i] = s.z.empty() ? y : y * silu(s.z[i]);
    }
  state.copy_(device_tensor(h, state.shape(), state.dtype(), state.device()));
  return device_tensor(out, x.shape(), x.dtype(), x.device());
}

// ---- CausalConv1d --------------------------------------------------------------------------------

namespace {
// pre[b, d, l] = bias_d + sum_k w[d, k] x[l - (W - 1) + k] over x [B, D, L] (zeros before 0).
V conv_pre(const V& x, const V& w, const V& bias, int64_t b_, int64_t d_, int64_t l_, int64_t w_) {
  V pre(x.size());
  for (int64_t b = 0; b < b_; ++b)
    for (int64_t d = 0; d < d_; ++d)
      for (int64_t l = 0; l < l_; ++l) {
        double acc = bias.empty() ? 0.0 : bias[d];
        for (int64_t k = 0; k < w_; ++k) {
          const int64_t src = l - (w_ - 1) + k;
          if (src >= 0) acc += w[d * w_ + k] * x[(b * d_ + d) * l_ + src];
        }
        pre[(b * d_ + d) * l_ + l] = acc;
      }
  return pre;
}
}  // namespace

CausalConv1d::CausalConv1d(Tensor w, Tensor b, bool s)
    : Slot("CausalConv1d", "CausalConv1d/1"), weight(std::move(w)), bias(std::move(b)), silu(s) {}

Tensor CausalConv1d::forward(const Tensor& x) {
  KCPP_CHECK(x.dim() == 3 && weight.dim() == 2 && x.size(1) == weight.size(0), "CausalConv1d: x must be [B, D, L], weight [D, W]");
  KCPP_SLOT_REGION("forward", x.device(), 2 * bytes(x) + bytes(weight));
  if (kernel()) {
    Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
    KernelArgs a;
    a.tensor("x", x).tensor("weight", weight);
    if (bias.defined()) a.tensor("bias", bias);
    a.string("activation", silu ? "silu" : "none").tensor("out", out);
    if (run_forward(a, x.device())) return out;
  } else {
    count_reference();
  }
  V pre = conv_pre(host(x), host(weight), host(bias), x.size(0), x.size(1), x.size(2), weight.size(1));
  if (silu)
    for (double& v : pre) v = nn::silu(v);
  return device_tensor(pre, x.shape(), x.dtype(), x.device());
}

CausalConv1d::Grads CausalConv1d::backward(const Tensor& dout, const Tensor& x) {
  KCPP_SLOT_REGION("backward", x.device(), 3 * bytes(x) + 2 * bytes(weight));
  if (kernel()) {
    Grads g{Tensor::empty(x.shape(), x.dtype(), x.device()), Tensor::empty(weight.shape(), weight.dtype(), weight.device()),
            bias.defined() ? Tensor::empty(bias.shape(), bias.dtype(), bias.device()) : Tensor()};
    KernelArgs a;
    a.tensor("dout", dout).tensor("x", x).tensor("weight", weight);
    if (bias.defined()) a.tensor("bias", bias).tensor("dbias", g.dbias);
    a.string("activation", silu ? "silu" : "none").tensor("dx", g.dx).tensor("dweight", g.dweight);
    if (run_backward(a, x.device())) return g;
  } else {
    count_reference();
  }
  const int64_t b_ = x.size(0), d_ = x.size(1), l_ = x.size(2), w_ = weight.size(1);
  const V xv = host(x), w = host(weight), go = host(dout);
  V dpre = conv_pre(xv, w, host(bias), b_, d_, l_, w_);
  for (size_t i = 0; i < dpre.size(); ++i) dpre[i] = silu ? go[i] * silu_grad(dpre[i]) : go[i];
  V dx(xv.size()), dw(w.size()), db(bias.defined() ? static_cast<size_t>(d_) : 0);
  for (int64_t b = 0; b < b_; ++b)
    for (int64_t d = 0; d < d_; ++d)
      for (int64_t l = 0; l < l_; ++l) {
        const double g = dpre[(b * d_ + d) * l_ + l];
        if (!db.empty()) db[d] += g;
        for (int64_t k = 0; k < w_; ++k) {
          const int64_t src = l - (w_ - 1) + k;
          if (src < 0) continue;
          dw[d * w_ + k] += g * xv[(b * d_ + d) * l_ + src];
          dx[(b * d_ + d) * l_ + src] += g * w[d * w_ + k];
        }
      }
  Grads g;
  g.dx = device_tensor(dx, x.shape(), x.dtype(), x.device());
  g.dweight = device_tensor(dw, weight.shape(), weight.dtype(), weight.device());
  if (bias.defined()) g.dbias = device_tensor(db, bias.shape(), bias.dtype(), bias.device());
  return g;
}

// ---- CausalConv1dUpdate --------------------------------------------------------------------------

CausalConv1dUpdate::CausalConv1dUpdate(Tensor w, Tensor b, bool s)
    : Slot("CausalConv1dUpdate", "CausalConv1dUpdate/1"), weight(std::move(w)), bias(std::move(b)), silu(s) {}

Tensor CausalConv1dUpdate::forward(const Tensor& x, const Tensor& conv_state) {
  KCPP_CHECK(x.dim() == 3 && conv_state.dim() == 3 && conv_state.size(2) >= weight.size(1) - 1,
             "CausalConv1dUpdate: x must be [B, D, S] and conv_state [B, D, K] with K >= W - 1");
  KCPP_SLOT_REGION("forward", x.device(), 2 * bytes(x) + 2 * bytes(conv_state));
  if (kernel()) {
    Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
    KernelArgs a;
    a.tensor("x", x).tensor("conv_state", conv_state).tensor("weight", weight);
    if (bias.defined()) a.tensor("bias", bias);
    a.string("activation", silu ? "silu" : "none").tensor("out", out);
    if (run_forward(a, x.device(), false)) return out;
  } else {
    count_reference();
  }
  // The convolution over [conv_state, x], its last S outputs; the state keeps the last K inputs.
  const int64_t s = x.size(2), k = conv_state.size(2);
  const Tensor all = Tensor::empty({x.size(0), x.size(1), k + s}, x.dtype(), x.device());
  all.narrow(2, 0, k).copy_(conv_state);
  all.narrow(2, k, s).copy_(x);
  V pre = conv_pre(host(all), host(weight), host(bias), x.size(0), x.size(1), k + s, weight.size(1));
  V out(static_cast<size_t>(x.numel()));
  for (int64_t r = 0; r < x.size(0) * x.size(1); ++r)
    for (int64_t t = 0; t < s; ++t) {
      const double v = pre[r * (k + s) + k + t];
      out[r * s + t] = silu ? nn::silu(v) : v;
    }
  conv_state.copy_(all.narrow(2, s, k));
  return device_tensor(out, x.shape(), x.dtype(), x.device());
}

}  // namespace kcpp::nn
