// The selective scan on the CPU (maths in selective_scan.h).  B and C are widened (and normalised) once
// into position-major f32 buffers [B, G, L, N] that every channel of their group reads.  Forward: a task
// per (batch, channel).  Backward: a task per (batch, block of kBlock channels of one group), which walks
// its channels one by one, each over the chunks from the last: the chunk's states and decays recomputed
// into a buffer from the saved state, then the reverse scan.  The task's dB / dC partial sums [L, N]
// are added over the blocks in block order, and dA, dD, ddelta_bias over the batch in batch order, so
// the results do not depend on the number of threads.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kcpp/kernel/activation.h"
#include "kcpp/kernel/cpu.h"
#include "kcpp/kernel/error.h"
#include "selective_scan.h"

namespace kcpp::mamba {
namespace {

using kernel::cpu::from_f32;
using kernel::cpu::to_f32;

constexpr int64_t kBlock = 128;  // channels a backward task walks (its dB / dC partial sum covers them)

inline float expf_(float x) { return kernel::exp_f32(x); }

// The rows of one (batch, group) of B or C, widened to f32 and normalised when p.bc_norm, as [L, N];
// the reciprocal RMS of each position into rstd ([L]) when it is non-null.
template <typename T>
void load_bc(const SelectiveScanParams& p, const GroupSeq& s, int64_t b, int64_t g, float* out, float* rstd) {
  const int64_t L = p.seqlen, N = p.dstate;
  for (int64_t n = 0; n < N; ++n) {
    const T* row = s.at<T>(b, g, n);
    for (int64_t l = 0; l < L; ++l) out[l * N + n] = to_f32(row[l]);
  }
  if (!p.bc_norm) return;
  for (int64_t l = 0; l < L; ++l) {
    float* v = out + l * N;
    double ss = 0.0;
    for (int64_t n = 0; n < N; ++n) ss += static_cast<double>(v[n]) * v[n];
    const float r = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(N)) + p.bc_eps);
    for (int64_t n = 0; n < N; ++n) v[n] *= r;
    if (rstd) rstd[l] = r;
  }
}

// B and C of every (batch, group): [B, G, L, N] each, plus the reciprocal RMS [B, G, L] each under bc_norm.
struct WideBC {
  std::vector<float> b, c, rb, rc;
};
template <typename T>
WideBC widen_bc(const SelectiveScanParams& p, bool keep_rstd) {
  const int64_t L = p.seqlen, N = p.dstate, bg = p.batch * p.groups;
  WideBC w;
  w.b.resize(static_cast<size_t>(bg * L * N));
  w.c.resize(w.b.size());
  if (keep_rstd && p.bc_norm) w.rb.resize(static_cast<size_t>(bg * L)), w.rc.resize(static_cast<size_t>(bg * L));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < bg; ++i) {
    const int64_t b = i / p.groups, g = i % p.groups;
    load_bc<T>(p, p.B, b, g, w.b.data() + i * L * N, w.rb.empty() ? nullptr : w.rb.data() + i * L);
    load_bc<T>(p, p.C, b, g, w.c.data() + i * L * N, w.rc.empty() ? nullptr : w.rc.data() + i * L);
  }
  return w;
}

inline float step_dt(const SelectiveScanParams& p, float delta, float bias) {
  const float x = delta + bias;
  return p.delta_softplus ? softplus(x) : x;
}

template <typename T>
KCPP_CPU_MULTIVERSION void forward(const SelectiveScanParams& p) {
  const int64_t L = p.seqlen, N = p.dstate, G = p.groups, per_group = p.dim / G, chunks = state_chunks(L);
  const WideBC w = widen_bc<T>(p, false);
#pragma omp parallel
  {
    std::vector<float> h(static_cast<size_t>(N)), a(static_cast<size_t>(N));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < p.batch * p.dim; ++i) {
      const int64_t b = i / p.dim, d = i % p.dim, g = d / per_group;
      const float* A = p.A + d * N;
      const float* Bw = w.b.data() + (b * G + g) * L * N;
      const float* Cw = w.c.data() + (b * G + g) * L * N;
      const float Dd = p.D ? p.D[d] : 0.0f, bias = p.delta_bias ? p.delta_bias[d] : 0.0f;
      const T* u = p.u.at<T>(b, d);
      const T* delta = p.delta.at<T>(b, d);
      const T* z = p.z.data ? p.z.at<T>(b, d) : nullptr;
      T* out = p.out.mut<T>(b, d);
      std::fill(h.begin(), h.end(), 0.0f);
      for (int64_t l = 0; l < L; ++l) {
        const float dt = step_dt(p, to_f32(delta[l]), bias), ul = to_f32(u[l]), dtu = dt * ul;
        const float* Bl = Bw + l * N;
        const float* Cl = Cw + l * N;
        for (int64_t n = 0; n < N; ++n) a[n] = expf_(dt * A[n]);
        float y = 0.0f;
        for (int64_t n = 0; n < N; ++n) {
          h[n] = a[n] * h[n] + dtu * Bl[n];
          y += Cl[n] * h[n];
        }
        y += Dd * ul;
        if (z) y *= silu(to_f32(z[l]));
        out[l] = from_f32<T>(y);
        if (p.states && ((l + 1) % kStateChunk == 0 || l == L - 1))
          std::memcpy(p.states + ((i * chunks) + l / kStateChunk) * N, h.data(), sizeof(float) * N);
      }
      if (p.last_state) std::memcpy(p.last_state + i * N, h.data(), sizeof(float) * N);
    }
  }
}

template <typename T>
KCPP_CPU_MULTIVERSION void backward(const SelectiveScanParams& p) {
  const int64_t L = p.seqlen, N = p.dstate, G = p.groups, per_group = p.dim / G, chunks = state_chunks(L);
  const int64_t blocks = (per_group + kBlock - 1) / kBlock, tasks = p.batch * G * blocks;
  const WideBC w = widen_bc<T>(p, true);
  // Per task: dB and dC partial sums [L, N]; per (batch, channel): dA [N], dD, ddelta_bias, in f64.
  std::vector<float> part_b(static_cast<size_t>(tasks * L * N), 0.0f), part_c(part_b.size(), 0.0f);
  std::vector<double> part_a(static_cast<size_t>(p.batch * p.dim * N)), part_d(static_cast<size_t>(p.batch * p.dim)),
      part_bias(part_d.size());
#pragma omp parallel
  {
    const size_t cn = static_cast<size_t>(kStateChunk * N);
    std::vector<float> hs(cn + static_cast<size_t>(N)), as(cn), dts(kStateChunk), raw(kStateChunk), carry(static_cast<size_t>(N));
    std::vector<double> acc_a(static_cast<size_t>(N));
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t b = t / (G * blocks), g = (t / blocks) % G, blk = t % blocks;
      const float* Bw = w.b.data() + (b * G + g) * L * N;
      const float* Cw = w.c.data() + (b * G + g) * L * N;
      float* pb = part_b.data() + t * L * N;
      float* pc = part_c.data() + t * L * N;
      const int64_t d_end = std::min(per_group, (blk + 1) * kBlock);
      for (int64_t d = g * per_group + blk * kBlock; d < g * per_group + d_end; ++d) {
        const int64_t i = b * p.dim + d;
        const float* A = p.A + d * N;
        const float Dd = p.D ? p.D[d] : 0.0f, bias = p.delta_bias ? p.delta_bias[d] : 0.0f;
        const T* u = p.u.at<T>(b, d);
        const T* delta = p.delta.at<T>(b, d);
        const T* z = p.z.data ? p.z.at<T>(b, d) : nullptr;
        const T* dout = p.dout.at<T>(b, d);
        T* du = p.du.mut<T>(b, d);
        T* ddelta = p.ddelta.mut<T>(b, d);
        T* dz = z ? p.dz.mut<T>(b, d) : nullptr;
        std::fill(carry.begin(), carry.end(), 0.0f);  // a_{l+1} g_{l+1}
        std::fill(acc_a.begin(), acc_a.end(), 0.0);
        double acc_d = 0.0, acc_bias = 0.0;
        for (int64_t c = chunks - 1; c >= 0; --c) {
          const int64_t l0 = c * kStateChunk, len = std::min(kStateChunk, L - l0);
          // The chunk's states: hs[j + 1] = h_{l0 + j}, hs[0] = the state before the chunk.
          if (c == 0)
            std::fill(hs.begin(), hs.begin() + N, 0.0f);
          else
            std::memcpy(hs.data(), p.states + (i * chunks + c - 1) * N, sizeof(float) * N);
          for (int64_t j = 0; j < len; ++j) {
            const int64_t l = l0 + j;
            raw[j] = to_f32(delta[l]) + bias;
            const float dt = p.delta_softplus ? softplus(raw[j]) : raw[j], dtu = dt * to_f32(u[l]);
            dts[j] = dt;
            const float* Bl = Bw + l * N;
            float* aj = as.data() + j * N;
            const float* hp = hs.data() + j * N;
            float* hn = hs.data() + (j + 1) * N;
            for (int64_t n = 0; n < N; ++n) aj[n] = expf_(dt * A[n]);
            for (int64_t n = 0; n < N; ++n) hn[n] = aj[n] * hp[n] + dtu * Bl[n];
          }
          for (int64_t j = len - 1; j >= 0; --j) {
            const int64_t l = l0 + j;
            const float ul = to_f32(u[l]), dt = dts[j], go = to_f32(dout[l]);
            const float* Bl = Bw + l * N;
            const float* Cl = Cw + l * N;
            const float* aj = as.data() + j * N;
            const float* hp = hs.data() + j * N;
            const float* hn = hs.data() + (j + 1) * N;
            float dy = go;
            if (z) {
              float y = 0.0f;
              for (int64_t n = 0; n < N; ++n) y += Cl[n] * hn[n];
              y += Dd * ul;
              const float zl = to_f32(z[l]);
              dz[l] = from_f32<T>(go * y * dsilu(zl));
              dy = go * silu(zl);
            }
            float ddt = 0.0f, sgb = 0.0f;
            const float dtu = dt * ul;
            float* pbl = pb + l * N;
            float* pcl = pc + l * N;
            for (int64_t n = 0; n < N; ++n) {
              const float gn = dy * Cl[n] + carry[n];
              const float x = aj[n] * hp[n];  // a_l h_{l-1}
              ddt += gn * (A[n] * x + Bl[n] * ul);
              sgb += gn * Bl[n];
              acc_a[n] += static_cast<double>(gn * dt) * x;
              pbl[n] += gn * dtu;
              pcl[n] += dy * hn[n];
              carry[n] = aj[n] * gn;
            }
            du[l] = from_f32<T>(Dd * dy + dt * sgb);
            const float dd = p.delta_softplus ? ddt * dsoftplus(raw[j]) : ddt;
            ddelta[l] = from_f32<T>(dd);
            acc_d += static_cast<double>(dy) * ul;
            acc_bias += dd;
          }
        }
        for (int64_t n = 0; n < N; ++n) part_a[i * N + n] = acc_a[n];
        part_d[i] = acc_d;
        part_bias[i] = acc_bias;
      }
    }
  }
  // dB, dC: the blocks' partial sums in block order, then back through the norm.
#pragma omp parallel
  {
    std::vector<float> gb(static_cast<size_t>(N)), gc(static_cast<size_t>(N));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < p.batch * G; ++i) {
      const int64_t b = i / G, g = i % G;
      for (int64_t l = 0; l < L; ++l) {
        for (int64_t n = 0; n < N; ++n) {
          double sb = 0.0, sc = 0.0;
          for (int64_t blk = 0; blk < blocks; ++blk) {
            sb += part_b[((i * blocks + blk) * L + l) * N + n];
            sc += part_c[((i * blocks + blk) * L + l) * N + n];
          }
          gb[n] = static_cast<float>(sb), gc[n] = static_cast<float>(sc);
        }
        if (p.bc_norm) {
          // d raw = rstd (d norm - norm mean(d norm * norm)), norm the f32 normalised row.
          for (int pass = 0; pass < 2; ++pass) {
            float* gr = pass == 0 ? gb.data() : gc.data();
            const float* nr = (pass == 0 ? w.b.data() : w.c.data()) + (i * L + l) * N;
            const float r = (pass == 0 ? w.rb : w.rc)[i * L + l];
            double m = 0.0;
            for (int64_t n = 0; n < N; ++n) m += static_cast<double>(gr[n]) * nr[n];
            const float mean = static_cast<float>(m / static_cast<double>(N));
            for (int64_t n = 0; n < N; ++n) gr[n] = r * (gr[n] - nr[n] * mean);
          }
        }
        for (int64_t n = 0; n < N; ++n) {
          p.dB.mut<T>(b, g, n)[l] = from_f32<T>(gb[n]);
          p.dC.mut<T>(b, g, n)[l] = from_f32<T>(gc[n]);
        }
      }
    }
  }
  // dA, dD, ddelta_bias: over the batch in order.
  for (int64_t d = 0; d < p.dim; ++d) {
    for (int64_t n = 0; n < N; ++n) {
      double s = 0.0;
      for (int64_t b = 0; b < p.batch; ++b) s += part_a[(b * p.dim + d) * N + n];
      p.dA[d * N + n] = static_cast<float>(s);
    }
    double sd = 0.0, sb = 0.0;
    for (int64_t b = 0; b < p.batch; ++b) sd += part_d[b * p.dim + d], sb += part_bias[b * p.dim + d];
    if (p.dD) p.dD[d] = static_cast<float>(sd);
    if (p.ddelta_bias) p.ddelta_bias[d] = static_cast<float>(sb);
  }
}

template <typename T>
void state_update(const StateUpdateParams& p) {
  const int64_t N = p.dstate, per_group = p.dim / p.groups;
#pragma omp parallel
  {
    std::vector<float> bn(static_cast<size_t>(N)), cn(static_cast<size_t>(N));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < p.batch * p.dim; ++i) {
      const int64_t b = i / p.dim, d = i % p.dim, g = d / per_group;
      const T* Bp = static_cast<const T*>(p.B) + b * p.B_sb + g * p.B_sg;
      const T* Cp = static_cast<const T*>(p.C) + b * p.C_sb + g * p.C_sg;
      double sb = 0.0, sc = 0.0;
      for (int64_t n = 0; n < N; ++n) {
        bn[n] = to_f32(Bp[n]), cn[n] = to_f32(Cp[n]);
        sb += static_cast<double>(bn[n]) * bn[n], sc += static_cast<double>(cn[n]) * cn[n];
      }
      if (p.bc_norm) {
        const float rb = 1.0f / std::sqrt(static_cast<float>(sb / static_cast<double>(N)) + p.bc_eps);
        const float rc = 1.0f / std::sqrt(static_cast<float>(sc / static_cast<double>(N)) + p.bc_eps);
        for (int64_t n = 0; n < N; ++n) bn[n] *= rb, cn[n] *= rc;
      }
      const float raw = to_f32(static_cast<const T*>(p.dt)[b * p.dt_sb + d * p.dt_sd]) + (p.dt_bias ? p.dt_bias[d] : 0.0f);
      const float dt = p.dt_softplus ? softplus(raw) : raw;
      const float x = to_f32(static_cast<const T*>(p.x)[b * p.x_sb + d * p.x_sd]), dtu = dt * x;
      float* h = p.state + b * p.state_sb + d * p.state_sd;
      const float* A = p.A + d * N;
      float y = 0.0f;
      for (int64_t n = 0; n < N; ++n) {
        h[n] = expf_(dt * A[n]) * h[n] + dtu * bn[n];
        y += cn[n] * h[n];
      }
      y += (p.D ? p.D[d] : 0.0f) * x;
      if (p.z) y *= silu(to_f32(static_cast<const T*>(p.z)[b * p.z_sb + d * p.z_sd]));
      static_cast<T*>(p.out)[b * p.out_sb + d * p.out_sd] = from_f32<T>(y);
    }
  }
}

bool valid_dtype(kernel::DType t) { return t == kernel::DType::f32 || t == kernel::DType::bf16 || t == kernel::DType::f16; }

}  // namespace

const char* selective_scan_check(const SelectiveScanParams& p, bool backward) {
  const char* op = backward ? "selective_scan backward" : "selective_scan forward";
  KCPP_KERNEL_REQUIRE(valid_dtype(p.dtype), "%s: unsupported dtype %d", op, static_cast<int>(p.dtype));
  KCPP_KERNEL_REQUIRE(p.batch >= 0 && p.dim >= 0 && p.seqlen >= 0, "%s: negative batch, dim or seqlen", op);
  KCPP_KERNEL_REQUIRE(p.dstate >= 1, "%s: the state size N must be >= 1 (A is [D, N])", op);
  KCPP_KERNEL_REQUIRE(p.groups >= 1 && p.dim % p.groups == 0, "%s: D = %lld is not a multiple of the %lld groups of B and C", op,
                      static_cast<long long>(p.dim), static_cast<long long>(p.groups));
  KCPP_KERNEL_REQUIRE(!p.bc_norm || (std::isfinite(p.bc_eps) && p.bc_eps >= 0), "%s: 'bc_rms_eps' must be finite and >= 0", op);
  const bool any = p.batch * p.dim * p.seqlen > 0;
  KCPP_KERNEL_REQUIRE(!any || (p.u.data && p.delta.data && p.B.data && p.C.data),
                      "%s: 'u', 'delta', 'B' and 'C' must not be null", op);
  KCPP_KERNEL_REQUIRE(p.dim == 0 || p.A, "%s: 'A' must not be null", op);
  if (!backward) {
    KCPP_KERNEL_REQUIRE(!any || p.out.data, "%s: 'out' must not be null", op);
    return nullptr;
  }
  KCPP_KERNEL_REQUIRE(!any || (p.dout.data && p.du.data && p.ddelta.data && p.dB.data && p.dC.data),
                      "%s: 'dout', 'du', 'ddelta', 'dB' and 'dC' must not be null", op);
  KCPP_KERNEL_REQUIRE(p.dim == 0 || p.dA, "%s: 'dA' must not be null", op);
  KCPP_KERNEL_REQUIRE(!any || p.states, "%s: 'states' (saved by the forward) must not be null", op);
  KCPP_KERNEL_REQUIRE(!p.z.data == !p.dz.data || !any, "%s: 'dz' is required exactly when 'z' is given", op);
  KCPP_KERNEL_REQUIRE(!p.D == !p.dD || p.dim == 0, "%s: 'dD' is required exactly when 'D' is given", op);
  KCPP_KERNEL_REQUIRE(!p.delta_bias == !p.ddelta_bias || p.dim == 0,
                      "%s: 'ddelta_bias' is required exactly when 'delta_bias' is given", op);
  return nullptr;
}

const char* state_update_check(const StateUpdateParams& p) {
  const char* op = "selective_state_update";
  KCPP_KERNEL_REQUIRE(valid_dtype(p.dtype), "%s: unsupported dtype %d", op, static_cast<int>(p.dtype));
  KCPP_KERNEL_REQUIRE(p.batch >= 0 && p.dim >= 0, "%s: negative batch or dim", op);
  KCPP_KERNEL_REQUIRE(p.dstate >= 1, "%s: the state size N must be >= 1", op);
  KCPP_KERNEL_REQUIRE(p.groups >= 1 && p.dim % p.groups == 0, "%s: D = %lld is not a multiple of the %lld groups of B and C", op,
                      static_cast<long long>(p.dim), static_cast<long long>(p.groups));
  KCPP_KERNEL_REQUIRE(!p.bc_norm || (std::isfinite(p.bc_eps) && p.bc_eps >= 0), "%s: 'bc_rms_eps' must be finite and >= 0", op);
  KCPP_KERNEL_REQUIRE(p.batch * p.dim == 0 || (p.state && p.x && p.dt && p.A && p.B && p.C && p.out),
                      "%s: 'state', 'x', 'dt', 'A', 'B', 'C' and 'out' must not be null", op);
  return nullptr;
}

const char* selective_scan_forward_cpu(const SelectiveScanParams& p) {
  if (const char* e = selective_scan_check(p, false)) return e;
  kernel::cpu::visit_float(p.dtype, [&]<typename T>(T*) { forward<T>(p); });
  return nullptr;
}

const char* selective_scan_backward_cpu(const SelectiveScanParams& p) {
  if (const char* e = selective_scan_check(p, true)) return e;
  kernel::cpu::visit_float(p.dtype, [&]<typename T>(T*) { backward<T>(p); });
  return nullptr;
}

const char* selective_state_update_cpu(const StateUpdateParams& p) {
  if (const char* e = state_update_check(p)) return e;
  kernel::cpu::visit_float(p.dtype, [&]<typename T>(T*) { state_update<T>(p); });
  return nullptr;
}

}  // namespace kcpp::mamba
