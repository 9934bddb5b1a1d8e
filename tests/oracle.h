// The f64 oracle: plain loops over std::vector<double>, written from the definitions in the op
// headers and sharing no code with ops/.  Inputs are the tensors' actual values (already rounded to
// their dtype), so the oracle measures only the op's own error.
#pragma once

#include <cstdint>
#include <vector>

namespace kcpp::oracle {

using V = std::vector<double>;

double silu(double x);
double gelu(double x);
double gelu_tanh(double x);
double dsilu(double x);
double dgelu(double x);
double dgelu_tanh(double x);
double quick_gelu(double x);  // x sigmoid(1.702 x)
double dquick_gelu(double x);

// a [batch, M, K] (or [batch, K, M] if ta), b [batch or 1, K, N] (or [.., N, K] if tb).
V matmul(const V& a, const V& b, int64_t batch, int64_t m, int64_t n, int64_t k, bool ta, bool tb, bool bcast_b);

struct Norm {
  V y, rstd, mean;
};
Norm rms_norm(const V& x, const V& w, int64_t rows, int64_t h, double eps, double offset);
// Gradients, plus the magnitude of each: the same formula evaluated on absolute values of every
// term.  A rounding error is proportional to the terms combined, not to their (possibly cancelling)
// sum, so tests bound ||out - ref|| by tol * ||magnitude|| (the standard forward-error bound).
struct NormGrad {
  V dx, dw, db;
  V dx_mag, dw_mag;
};
NormGrad rms_norm_backward(const V& dy, const V& x, const V& w, int64_t rows, int64_t h, double eps, double offset);
Norm layer_norm(const V& x, const V& w, const V& b, int64_t rows, int64_t h, double eps);
NormGrad layer_norm_backward(const V& dy, const V& x, const V& w, int64_t rows, int64_t h, double eps);

// x [B, H, S, D]; cos/sin [cb, S, rd] with cb 1 or B.  Pairs (j, j + rd/2), or (2i, 2i+1) when
// interleaved.
V rope(const V& x, const V& cos, const V& sin, int64_t b, int64_t h, int64_t s, int64_t d, int64_t rd, int64_t cb,
       bool backward, bool interleaved = false);

enum class Act { Silu, Gelu, GeluTanh, QuickGelu };
double act_f(Act a, double x);
double act_d(Act a, double x);
V glu(const V& gate, const V& up, Act act);
void glu_backward(const V& dout, const V& gate, const V& up, Act act, V& dgate, V& dup);
// Magnitudes of the terms behind glu and its gradients (1 + erf and 1 + tanh cancel for very
// negative inputs; here they become 1 + |erf|, 1 + |tanh|).  See NormGrad for why.
struct GluMagnitude {
  V out, dgate, dup;
};
GluMagnitude glu_magnitude(const V& dout, const V& gate, const V& up, Act act);

// Per-row losses (0 for ignored rows) and the count of non-ignored rows.
V cross_entropy_rows(const V& logits, const std::vector<int64_t>& t, int64_t n, int64_t v, int64_t ignore,
                     double smoothing, int64_t& count);
// Gradient of sum_i g[i] * loss[i] with respect to the logits.
// With `magnitude`, also |g| (p + (1 - eps) [j = t] + eps / V): the size of the terms combined.
V cross_entropy_backward(const V& logits, const std::vector<int64_t>& t, const V& g, int64_t n, int64_t v,
                         int64_t ignore, double smoothing, V* magnitude = nullptr);

// Cross-entropy with every option of the liger kernels (packages/liger/cross_entropy/cross_entropy.h
// defines them): logit softcap c (z = c tanh(x / c)), z-loss beta (beta lse^2 per row), class weights
// w [V] (PyTorch's `weight`; the mean divides by the sum of the targets' weights), token weights tau [N].
struct CEOptions {
  int64_t ignore = -100;
  double smoothing = 0, softcap = 0, z_loss = 0;
  V class_weight, token_weight;  // empty: all ones
};
// Per-row losses, and the mean's divisor (sum over non-ignored rows of w_t).
V cross_entropy_rows(const V& logits, const std::vector<int64_t>& t, int64_t n, int64_t v, const CEOptions& o,
                     double& divisor);
// Gradient of sum_i g[i] * loss[i] with respect to the logits (before the softcap), and with
// `magnitude` the size of the terms combined.
V cross_entropy_backward(const V& logits, const std::vector<int64_t>& t, const V& g, int64_t n, int64_t v,
                         const CEOptions& o, V* magnitude = nullptr);

struct Attn {
  V out, dq, dk, dv;
};
// q [B, Hq, Sq, D], k/v [B, Hkv, Skv, D]; with dout given, also the gradients.  chunk > 0: key j is
// visible to the query at position p only when j / chunk == p / chunk (Llama 4's chunked attention).
// softcap c > 0: the scores are c tanh(scale q.k / c) (Gemma 2).
Attn attention(const V& q, const V& k, const V& v, const V* dout, int64_t b, int64_t hq, int64_t hkv, int64_t sq,
               int64_t skv, int64_t d, double scale, bool causal, int64_t window, int64_t chunk = 0, double softcap = 0);

// A mixture-of-experts block (docs/contracts/MoE.md) in f64, without the kernels' intermediate
// roundings.  Routing ids are an input: the caller checks the kernel's choice with moe_route first
// (on the kernel's own rounded logits, so ties are the same) and then evaluates the block for it.
// Weights as logical dense tensors: gate, up [E, I, H], down [E, H, I]; shared sgate, sup [Is, H],
// sdown [H, Is], sgs [H] (empty: no shared expert / no gate).
struct MoeSpec {
  int64_t t = 0, h = 0, e = 0, k = 0, i = 0, si = 0;
  Act act = Act::Silu;
  int routing = 0;  // 0 softmax, 1 sigmoid, 2 given
  bool normalize = false, weight_on_input = false;
};
struct MoeWeights {
  V x, router, gate, up, down, sgate, sup, sdown, sgs;
};
// The top-k of each row of z [T, E] as the contract chooses (softmax or sigmoid: by z, descending,
// ties to the lower index) and the routing weights from z.
void moe_route(const MoeSpec& s, const V& z, std::vector<int64_t>& ids, V& w);
struct MoeResult {
  V out;                                   // [T, H]
  V dx, drouter, dgate, dup, ddown;        // gradients (with dout)
  V dsgate, dsup, dsdown, dsgs, dw;        // shared expert's, and the routing weights' [T, k]
  // The magnitude of the terms behind each gradient (see NormGrad): errors are measured against them.
  V dx_mag, drouter_mag, dgate_mag, dup_mag, ddown_mag, dsgate_mag, dsup_mag, dsdown_mag, dsgs_mag, dw_mag;
};
// z: the router's logits [T, E] (routing 0 / 1; the routing weights are recomputed from them and
// their gradient flows back through them), or w [T, k] (routing 2).  dz_extra [T, E] (optional): an
// extra upstream gradient of the logits.  With dout, the gradients too.
MoeResult moe(const MoeSpec& s, const MoeWeights& wt, const V& z, const std::vector<int64_t>& ids, const V& w_given,
              const V* dout, const V* dz_extra);
// Transformers' load_balancing_loss_func over rows z [R, E] with mask weights m (empty: 1; row r
// reads m[r % m.size()]), p rounded by `round` (to the logits' dtype) before the top-k; and the
// gradient of grad_scale * loss with respect to z.
double load_balancing_loss(const V& z, int64_t rows, int64_t e, int64_t k, const V& m, double (*round)(double),
                           double grad_scale, V* dz);

}  // namespace kcpp::oracle
