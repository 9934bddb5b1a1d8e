// The reference ops on strided inputs: random layouts (permuted, narrowed, offset by a selected-away
// dim, expanded along stride-0 dims, size-1 and zero-size dims, sometimes reshaped away and back) fed
// to every reduction, the softmax family, cat, the copies, matmul, the index ops and the elementwise
// ops with operands of different ranks, each checked against a naive f64 reference computed over the
// elements in row-major order by index math.  A failure prints the op, the operands' layouts, the seed
// and the case; KCPP_SEED repeats the run.  Malformed calls must throw a kcpp::Error saying what is wrong.
//
// Tolerances: what only moves or selects data (cat, the copies, embedding, gather / scatter, valid_mask,
// max, argmax_checked) must match exactly.  Sums (sum, mean, sum_dim, sum_leading, matmul's dot
// products, embedding_backward) may add in another order: within 2 n u sum|terms| (sum_tol).  Elementwise
// ops: primitive_rtol (tests/tolerances.h), the math library's error.  The softmax family: a fixed
// number of units of roundoff per term (check_softmax says why).  u is f64's on the CPU, so a wrong,
// missing or extra term is many orders of magnitude over any of these.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "ops/ops.h"
#include "test_util.h"

namespace kcpp {
namespace {

using test::test_generator;
using Rng = std::mt19937_64;

int64_t pick(Rng& rng, int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); }
bool chance(Rng& rng, int percent) { return pick(rng, 0, 99) < percent; }
double uniform(Rng& rng, double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); }
int64_t pick_dim(Rng& rng, int64_t n) {  // a dim in [0, n), written negatively half the time
  const int64_t d = pick(rng, 0, n - 1);
  return chance(rng, 50) ? d - n : d;
}
int64_t wrap(int64_t d, int64_t n) { return d < 0 ? d + n : d; }

// Sizes 0 (only with allow_empty), 1 or 2..5.
Shape random_shape(Rng& rng, int64_t min_rank, int64_t max_rank, bool allow_empty) {
  Shape s(static_cast<size_t>(pick(rng, min_rank, max_rank)));
  for (int64_t& v : s) v = allow_empty && chance(rng, 8) ? 0 : chance(rng, 25) ? 1 : pick(rng, 2, 5);
  return s;
}

// Row-major multi-index iteration over `shape`.
bool next_index(std::vector<int64_t>& idx, const Shape& shape) {
  for (size_t d = shape.size(); d-- > 0;) {
    if (++idx[d] < shape[d]) return true;
    idx[d] = 0;
  }
  return false;
}
std::vector<std::vector<int64_t>> all_indices(const Shape& shape) {
  std::vector<std::vector<int64_t>> out;
  if (shape_numel(shape) == 0) return out;
  std::vector<int64_t> idx(shape.size(), 0);
  do out.push_back(idx);
  while (next_index(idx, shape));
  return out;
}
int64_t row_major(const std::vector<int64_t>& idx, const Shape& shape) {
  int64_t at = 0;
  for (size_t d = 0; d < shape.size(); ++d) at = at * shape[d] + idx[d];
  return at;
}

// A tensor of shape `s` laid out at random over a larger base, and its values in row-major order
// computed by index math over the base (never through the library's copies).
struct Strided {
  Tensor t;
  std::vector<double> v;
  std::string desc;
  double at(const std::vector<int64_t>& idx) const { return v[static_cast<size_t>(row_major(idx, t.shape()))]; }
};

using ValueFn = std::function<double(Rng&)>;
double normal_value(Rng& rng) { return uniform(rng, -3.0, 3.0); }

// The dims of the result in a random order over the base, each widened by a start offset and padding,
// an extra base dim selected away, permuted into place, then expanded along dims that `broadcast`
// made stride 0.  Sometimes reshaped to one dim and back, or unsqueezed and squeezed (the values stay).
Strided make_strided(const Shape& s, bool broadcast, DType dtype, Device dev, Rng& rng, const ValueFn& value = normal_value) {
  const int64_t r = static_cast<int64_t>(s.size());
  Shape src = s;
  std::vector<bool> expanded(static_cast<size_t>(r), false);
  if (broadcast)
    for (int64_t d = 0; d < r; ++d)
      if (s[d] != 1 && chance(rng, 30)) src[d] = 1, expanded[d] = true;
  const bool plain = chance(rng, 20);  // a contiguous tensor now and then, for the contiguous fast paths
  std::vector<int64_t> order(static_cast<size_t>(r));
  std::iota(order.begin(), order.end(), int64_t{0});
  if (!plain) std::shuffle(order.begin(), order.end(), rng);
  Shape base, start(static_cast<size_t>(r));
  for (int64_t j = 0; j < r; ++j) {
    start[j] = plain ? 0 : pick(rng, 0, 2);
    base.push_back(src[order[j]] + start[j] + (plain ? 0 : pick(rng, 0, 1)));
  }
  const bool extra = !plain && chance(rng, 40);
  const int64_t extra_at = pick(rng, 0, r), extra_size = pick(rng, 1, 3), extra_index = pick(rng, 0, extra_size - 1);
  if (extra) base.insert(base.begin() + extra_at, extra_size);

  std::vector<double> bv(static_cast<size_t>(shape_numel(base)));
  for (double& x : bv) x = value(rng);
  Tensor t = Tensor::from_f64(bv, base, dtype, dev);
  bv = t.to_f64_vector();  // the stored values (rounded to the dtype)
  if (extra) t = t.select(extra_at, extra_index);
  for (int64_t j = 0; j < r; ++j) t = t.narrow(j, start[j], src[order[j]]);
  std::vector<int64_t> perm(static_cast<size_t>(r));
  for (int64_t j = 0; j < r; ++j) perm[order[j]] = j;
  t = t.permute(perm);
  if (broadcast) t = t.expand(s);
  std::string how;
  if (t.numel() > 0 && chance(rng, 10)) {
    t = t.reshape({t.numel()}).reshape(s);
    how = ", reshaped flat and back";
  } else if (chance(rng, 10)) {
    const int64_t d = pick(rng, 0, r);
    t = t.unsqueeze(d).squeeze(d);
  }

  Shape bst(base.size(), 1);
  for (size_t d = base.size(); d-- > 1;) bst[d - 1] = bst[d] * base[d];
  Strided out;
  out.t = t;
  for (const auto& idx : all_indices(s)) {
    int64_t pos = 0;
    for (int64_t j = 0; j < r; ++j) {
      const int64_t bd = extra && j >= extra_at ? j + 1 : j;
      pos += (start[j] + (expanded[order[j]] ? 0 : idx[order[j]])) * bst[bd];
    }
    if (extra) pos += extra_index * bst[extra_at];
    out.v.push_back(bv[static_cast<size_t>(pos)]);
  }
  out.desc = fmt::format("{} strides {} offset {}{}", shape_str(t.shape()), shape_str(t.strides()), t.offset(), how);
  return out;
}

// ---- comparison --------------------------------------------------------------------------------

bool same_value(double a, double b) { return a == b || (std::isnan(a) && std::isnan(b)); }

// Failures are counted per op; the first few of each are printed in full.
struct Checker {
  std::string tag;  // " (seed S, case K, device D)"
  std::map<std::string, int> failures;

  void fail(const std::string& op, const std::string& msg) {
    if (++failures[op] <= 3) ADD_FAILURE() << op << ": " << msg << tag;
  }

  // out has `shape` and |out[i] - ref[i]| <= tol[i] (tol empty: exact), NaN where ref is NaN.
  void expect(const std::string& op, const std::string& operands, const Tensor& out, const Shape& shape,
              const std::vector<double>& ref, const std::vector<double>& tol = {}) {
    if (out.shape() != shape) {
      fail(op, fmt::format("shape {}, expected {}; {}", shape_str(out.shape()), shape_str(shape), operands));
      return;
    }
    const std::vector<double> got = out.to_f64_vector();
    for (size_t i = 0; i < got.size(); ++i) {
      const bool ok = tol.empty() ? same_value(got[i], ref[i])
                                  : same_value(got[i], ref[i]) || std::fabs(got[i] - ref[i]) <= tol[i];
      if (!ok) {
        fail(op, fmt::format("element {} is {:.17g}, expected {:.17g} (tolerance {:.3g}); {}", i, got[i], ref[i],
                             tol.empty() ? 0.0 : tol[i], operands));
        return;
      }
    }
  }
};

// Unit roundoff of the computing type: f64 for f64, f32 for everything else.
double acc_u(DType t) { return t == DType::f64 ? test::unit_roundoff(DType::f64) : test::unit_roundoff(DType::f32); }

// A sum of n terms in any order (pairwise, lanes, tree reductions on the device) against the
// sequential f64 sum: each order's error is at most (n - 1) u sum|x| (Higham 4.3), so twice that
// bounds the difference of two orders; plus one rounding of the result.  On the CPU in f64 this is
// a few 1e-16 relative: any wrong or missing or extra term is orders of magnitude larger.
// A result in the dtype's subnormal range is off by up to half the subnormal spacing whatever its
// size (|fl(x) - x| <= u |x| + eta): that floor is added too (it matters for f16 only, 2^-25).
double sum_tol(int64_t n, double abs_sum, double ref, DType t) {
  const double eta = t == DType::f16 ? 0x1p-25 : t == DType::bf16 ? 0x1p-134 : t == DType::f32 ? 0x1p-150 : 0.0;
  return 2.0 * static_cast<double>(std::max<int64_t>(n, 1)) * acc_u(t) * abs_sum + 2.0 * test::unit_roundoff(t) * std::fabs(ref) + eta;
}

// ---- the ops ------------------------------------------------------------------------------------

struct Ctx {
  Device dev;
  DType dtype;
  Rng& rng;
  Checker& chk;
};


// sum / mean / max over the last dim, sum_dim, sum_leading, argmax_checked.
void check_reductions(Ctx& c) {
  const Shape s = random_shape(c.rng, 1, 4, true);
  const Strided x = make_strided(s, chance(c.rng, 40), c.dtype, c.dev, c.rng);
  const std::string xs = "x " + x.desc;
  const int64_t r = static_cast<int64_t>(s.size()), n = s.back();

  // Over the last dim.
  const int which = static_cast<int>(pick(c.rng, 0, 2));
  const bool keepdim = chance(c.rng, 50);
  const char* names[] = {"sum", "mean", "max"};
  const std::string op = fmt::format("{}(keepdim={})", names[which], keepdim);
  if (which == 2 && n == 0) {
    const std::string msg = test::error_of([&] { (void)ops::max(x.t, keepdim); });
    if (msg.find("empty last dim") == std::string::npos) c.chk.fail(op, "no error for an empty last dim: '" + msg + "'; " + xs);
  } else {
    Shape lead(s.begin(), s.end() - 1), os = lead;
    if (keepdim) os.push_back(1);
    std::vector<double> ref, tol;
    for (const auto& li : all_indices(lead.empty() ? Shape{} : lead)) {
      std::vector<int64_t> idx = li;
      idx.push_back(0);
      double acc = which == 2 ? -std::numeric_limits<double>::infinity() : 0.0, abs_sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        idx.back() = i;
        const double e = x.at(idx);
        if (which == 2) acc = std::max(acc, e);
        else acc += e, abs_sum += std::fabs(e);
      }
      if (which == 1) acc = acc / static_cast<double>(n);  // 0/0: NaN for an empty row, as in PyTorch
      ref.push_back(acc);
      tol.push_back(which == 2 ? 0.0 : sum_tol(n, abs_sum / (which == 1 ? std::max<int64_t>(n, 1) : 1), acc, c.dtype));
    }
    if (shape_numel(lead) == 0) ref.clear(), tol.clear();
    const Tensor out = which == 0 ? ops::sum(x.t, keepdim) : which == 1 ? ops::mean(x.t, keepdim) : ops::max(x.t, keepdim);
    c.chk.expect(op, xs, out, os, ref, tol);
  }

  // sum_dim over a random dim.
  {
    const int64_t dim = pick_dim(c.rng, r), d = wrap(dim, r);
    const bool kd = chance(c.rng, 50);
    Shape os;
    for (int64_t i = 0; i < r; ++i)
      if (i != d) os.push_back(s[i]);
    std::vector<double> ref, tol;
    for (const auto& oi : all_indices(os)) {
      std::vector<int64_t> idx = oi;
      idx.insert(idx.begin() + d, 0);
      double acc = 0, abs_sum = 0;
      for (int64_t i = 0; i < s[d]; ++i) {
        idx[d] = i;
        acc += x.at(idx), abs_sum += std::fabs(x.at(idx));
      }
      ref.push_back(acc);
      tol.push_back(sum_tol(s[d], abs_sum, acc, c.dtype));
    }
    if (kd) os.insert(os.begin() + d, 1);
    c.chk.expect(fmt::format("sum_dim(dim={}, keepdim={})", dim, kd), xs, ops::sum_dim(x.t, dim, kd), os, ref, tol);
  }

  // sum_leading: [..., H] -> [H].
  {
    const int64_t h = s.back(), rows = h == 0 ? 0 : shape_numel(s) / h;
    std::vector<double> ref(static_cast<size_t>(h), 0.0), abs_sum(static_cast<size_t>(h), 0.0), tol;
    for (const auto& idx : all_indices(s)) {
      ref[static_cast<size_t>(idx.back())] += x.at(idx);
      abs_sum[static_cast<size_t>(idx.back())] += std::fabs(x.at(idx));
    }
    for (int64_t j = 0; j < h; ++j) tol.push_back(sum_tol(rows, abs_sum[j], ref[j], c.dtype));
    c.chk.expect("sum_leading", xs, ops::sum_leading(x.t), {h}, ref, tol);
  }

  // argmax_checked on a [R, n > 0] view, a few values non-finite.
  {
    const Shape s2{pick(c.rng, 0, 4), pick(c.rng, 1, 6)};
    const Strided y = make_strided(s2, chance(c.rng, 40), c.dtype, c.dev, c.rng, [](Rng& g) {
      if (chance(g, 5)) return std::numeric_limits<double>::quiet_NaN();
      if (chance(g, 5)) return chance(g, 50) ? HUGE_VAL : -HUGE_VAL;
      return static_cast<double>(pick(g, -3, 3));  // integers: ties are common
    });
    std::vector<double> ref;
    for (int64_t i = 0; i < s2[0]; ++i) {
      int64_t best = -1, bad = -1;
      for (int64_t j = 0; j < s2[1]; ++j) {
        const double e = y.at({i, j});
        if (!std::isfinite(e)) {
          if (bad < 0) bad = j;
        } else if (best < 0 || e > y.at({i, best})) {
          best = j;
        }
      }
      ref.push_back(static_cast<double>(std::max<int64_t>(best, 0)));
      ref.push_back(static_cast<double>(bad));
    }
    c.chk.expect("argmax_checked", "x " + y.desc, ops::argmax_checked(y.t), {s2[0], 2}, ref);
  }
}

// softmax, log_softmax and their backward ops over the last dim.
void check_softmax(Ctx& c) {
  const Shape s = random_shape(c.rng, 1, 4, true);
  // Sometimes far from 0 (the max must be subtracted) and sometimes with -inf entries (masked logits;
  // a row of only -inf is NaN, as in PyTorch).
  const double shift = chance(c.rng, 20) ? uniform(c.rng, -500.0, 500.0) : 0.0;
  const int ninf = chance(c.rng, 20) ? 30 : 0;
  const Strided x = make_strided(s, chance(c.rng, 40), c.dtype, c.dev, c.rng, [&](Rng& g) {
    return chance(g, ninf) ? -HUGE_VAL : shift + uniform(g, -3.0, 3.0);
  });
  const Strided dy = make_strided(s, chance(c.rng, 40), c.dtype, c.dev, c.rng);
  const Strided y = make_strided(s, chance(c.rng, 40), c.dtype, c.dev, c.rng);
  const int64_t n = s.back();
  const Shape lead(s.begin(), s.end() - 1);
  std::vector<double> sm(x.v.size()), lsm(x.v.size()), dsm(x.v.size()), dlsm(x.v.size()), tol(x.v.size());
  for (const auto& li : n == 0 ? std::vector<std::vector<int64_t>>{} : all_indices(lead)) {
    std::vector<int64_t> idx = li;
    idx.push_back(0);
    auto at = [&](const Strided& t, int64_t i) { idx.back() = i; return t.at(idx); };
    auto pos = [&](int64_t i) { idx.back() = i; return static_cast<size_t>(row_major(idx, s)); };
    double mx = -INFINITY, sum = 0, dot = 0, dsum = 0;
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, at(x, i));
    if (mx == -INFINITY) mx = NAN;  // every entry -inf: NaN throughout
    for (int64_t i = 0; i < n; ++i) sum += std::exp(at(x, i) - mx);
    for (int64_t i = 0; i < n; ++i) dot += at(dy, i) * at(y, i), dsum += at(dy, i);
    for (int64_t i = 0; i < n; ++i) {
      sm[pos(i)] = std::exp(at(x, i) - mx) / sum;
      lsm[pos(i)] = at(x, i) - mx - std::log(sum);
      dsm[pos(i)] = at(y, i) * (at(dy, i) - dot);
      dlsm[pos(i)] = at(dy, i) - std::exp(at(y, i)) * dsum;
      // Absolute, in units of the computing type's roundoff.  The backward results are up to ~3 (3 + 9n)
      // for |y|, |dy| <= 3 and come from a dot of n terms (error ~ n u 9n); softmax and log_softmax are
      // O(1) after the max is subtracted, but x - lse loses u |x| when x is far from 0 (up to ~500 u).
      // 240 (n + 4) u covers all of these with room; a wrong term is O(1).  exp and log in f32 (on the
      // device possibly the fast intrinsics) are a few ulps more, hence 4x there.
      // In bf16 and f16 the result is also rounded once to the dtype.
      tol[pos(i)] = 240.0 * static_cast<double>(n + 4) * (c.dtype == DType::f64 ? acc_u(c.dtype) : 4 * acc_u(c.dtype));
      if (c.dtype == DType::bf16 || c.dtype == DType::f16)
        for (const double* r : {&sm[pos(i)], &lsm[pos(i)], &dsm[pos(i)], &dlsm[pos(i)]})
          tol[pos(i)] = std::max(tol[pos(i)], 240.0 * static_cast<double>(n + 4) * 4 * acc_u(c.dtype) + 2 * test::unit_roundoff(c.dtype) * std::fabs(*r));
    }
  }
  const std::string xs = "x " + x.desc, bs = "dy " + dy.desc + "; y " + y.desc;
  c.chk.expect("softmax", xs, ops::softmax(x.t), s, sm, tol);
  c.chk.expect("log_softmax", xs, ops::log_softmax(x.t), s, lsm, tol);
  c.chk.expect("softmax_backward", bs, ops::softmax_backward(dy.t, y.t), s, dsm, tol);
  c.chk.expect("log_softmax_backward", bs, ops::log_softmax_backward(dy.t, y.t), s, dlsm, tol);
}

// cat of 1..3 operands with their own layouts, along a random dim; exact.
void check_cat(Ctx& c) {
  const Shape s = random_shape(c.rng, 1, 4, true);
  const int64_t r = static_cast<int64_t>(s.size()), dim = pick_dim(c.rng, r), d = wrap(dim, r);
  std::vector<Strided> xs;
  std::vector<Tensor> ts;
  std::string desc;
  Shape os = s;
  os[d] = 0;
  for (int64_t k = pick(c.rng, 1, 3); k > 0; --k) {
    Shape si = s;
    si[d] = chance(c.rng, 10) ? 0 : pick(c.rng, 1, 4);
    const bool again = !xs.empty() && chance(c.rng, 5);  // the first operand passed twice
    if (again) si = xs[0].t.shape();
    xs.push_back(again ? xs[0] : make_strided(si, chance(c.rng, 40), c.dtype, c.dev, c.rng));
    ts.push_back(xs.back().t);
    desc += fmt::format("{}xs[{}] {}", desc.empty() ? "" : "; ", xs.size() - 1, xs.back().desc);
    os[d] += si[d];
  }
  std::vector<double> ref;
  for (auto idx : all_indices(os)) {
    size_t k = 0;
    while (idx[d] >= xs[k].t.size(d)) idx[d] -= xs[k++].t.size(d);
    ref.push_back(xs[k].at(idx));
  }
  c.chk.expect(fmt::format("cat(dim={})", dim), desc, ops::cat(ts, dim), os, ref);

  // attention_mask: 0 where query i (at position i + kv - q) sees key j, -inf elsewhere; exact.
  const int64_t q = pick(c.rng, 0, 5), kv = q + pick(c.rng, 0, 4), window = chance(c.rng, 50) ? 0 : pick(c.rng, 1, 4);
  const bool causal = chance(c.rng, 70);
  std::vector<double> mask;
  for (int64_t i = 0; i < q; ++i)
    for (int64_t j = 0; j < kv; ++j) {
      const int64_t p = i + kv - q;
      mask.push_back((!causal || j <= p) && (window == 0 || p - j < window) ? 0.0 : -HUGE_VAL);
    }
  c.chk.expect(fmt::format("attention_mask(q_len={}, kv_len={}, causal={}, window={})", q, kv, causal, window), "",
               ops::attention_mask(q, kv, causal, window, c.dtype, c.dev), {q, kv}, mask);
}

// contiguous, clone, to(dtype) and cast of any layout (rank 0 included); exact.
void check_copies(Ctx& c) {
  const Shape s = random_shape(c.rng, 0, 4, true);
  const Strided x = make_strided(s, chance(c.rng, 50), c.dtype, c.dev, c.rng);
  const std::string xs = "x " + x.desc;
  c.chk.expect("contiguous", xs, x.t.contiguous(), s, x.v);
  if (!x.t.contiguous().is_contiguous()) c.chk.fail("contiguous", "result is not contiguous; " + xs);
  c.chk.expect("clone", xs, x.t.clone(), s, x.v);
  const DType other = c.dtype == DType::f64 ? DType::f32 : DType::f64;
  if (c.dev.is_cuda()) {
    c.chk.expect("to(cpu)", xs, x.t.to(Device::cpu()), s, x.v);
  } else {
    std::vector<double> ref = x.v;
    if (other == DType::f32)
      for (double& e : ref) e = static_cast<float>(e);
    c.chk.expect(fmt::format("to({})", dtype_name(other)), xs, ops::cast(x.t, other), s, ref);
  }
}

// matmul of strided (and broadcast) operands, each possibly transposed, batched or with a 2-D b.
void check_matmul(Ctx& c) {
  Shape batch = random_shape(c.rng, 0, 2, true);
  for (int64_t& b : batch) b = std::min<int64_t>(b, 3);
  const int64_t m = pick(c.rng, 0, 5) == 0 && chance(c.rng, 30) ? 0 : pick(c.rng, 1, 5);
  const int64_t k = chance(c.rng, 5) ? 0 : pick(c.rng, 1, 6), n = pick(c.rng, 1, 5);
  const bool ta = chance(c.rng, 50), tb = chance(c.rng, 50), b2 = !batch.empty() && chance(c.rng, 30);
  Shape sa = batch, sb = b2 ? Shape{} : batch;
  sa.push_back(ta ? k : m), sa.push_back(ta ? m : k);
  sb.push_back(tb ? n : k), sb.push_back(tb ? k : n);
  const Strided a = make_strided(sa, chance(c.rng, 40), c.dtype, c.dev, c.rng);
  const Strided b = make_strided(sb, chance(c.rng, 40), c.dtype, c.dev, c.rng);
  Shape os = batch;
  os.push_back(m), os.push_back(n);
  std::vector<double> ref, tol;
  for (const auto& oi : all_indices(os)) {
    std::vector<int64_t> ia(oi.begin(), oi.end() - 2), ib = b2 ? std::vector<int64_t>{} : ia;
    ia.push_back(0), ia.push_back(0), ib.push_back(0), ib.push_back(0);
    const int64_t i = oi[oi.size() - 2], j = oi.back();
    double acc = 0, mag = 0;
    for (int64_t p = 0; p < k; ++p) {
      ia[ia.size() - 2] = ta ? p : i, ia.back() = ta ? i : p;
      ib[ib.size() - 2] = tb ? j : p, ib.back() = tb ? p : j;
      acc += a.at(ia) * b.at(ib), mag += std::fabs(a.at(ia) * b.at(ib));
    }
    ref.push_back(acc);
    tol.push_back(sum_tol(k + 1, mag, acc, c.dtype));  // k products and k - 1 additions in any order
  }
  c.chk.expect(fmt::format("matmul(trans_a={}, trans_b={})", ta, tb), "a " + a.desc + "; b " + b.desc,
               ops::matmul(a.t, b.t, ta, tb), os, ref, tol);
}

// embedding (+ backward), gather_last, scatter_last and valid_mask with strided indices; exact but for
// embedding_backward's sums.
void check_index(Ctx& c) {
  const DType it = chance(c.rng, 50) ? DType::i64 : DType::i32;
  const int64_t v = pick(c.rng, 1, 5), h = chance(c.rng, 10) ? 0 : pick(c.rng, 1, 4);
  const Strided w = make_strided({v, h}, chance(c.rng, 30), c.dtype, c.dev, c.rng);
  const Shape is = random_shape(c.rng, 0, 3, true);
  const Strided ids = make_strided(is, chance(c.rng, 40), it, c.dev, c.rng, [v](Rng& g) { return double(pick(g, 0, v - 1)); });
  const std::string ws = "weight " + w.desc + "; ids " + ids.desc + " " + std::string(dtype_name(it));
  Shape os = is;
  os.push_back(h);
  std::vector<double> ref;
  for (double id : ids.v)
    for (int64_t j = 0; j < h; ++j) ref.push_back(w.at({static_cast<int64_t>(id), j}));
  c.chk.expect("embedding", ws, ops::embedding(w.t, ids.t), os, ref);

  {
    const Strided g = make_strided(os, chance(c.rng, 40), c.dtype, c.dev, c.rng);
    std::vector<double> acc(static_cast<size_t>(v * h), 0.0), mag(acc.size(), 0.0), tol;
    for (const auto& idx : all_indices(os)) {
      std::vector<int64_t> id_idx(idx.begin(), idx.end() - 1);
      const auto row = static_cast<int64_t>(ids.at(id_idx));
      acc[static_cast<size_t>(row * h + idx.back())] += g.at(idx);
      mag[static_cast<size_t>(row * h + idx.back())] += std::fabs(g.at(idx));
    }
    for (size_t i = 0; i < acc.size(); ++i) tol.push_back(sum_tol(shape_numel(is), mag[i], acc[i], c.dtype));
    c.chk.expect("embedding_backward", "grad " + g.desc + "; ids " + ids.desc, ops::embedding_backward(g.t, ids.t, v),
                 {v, h}, acc, tol);
  }

  // gather_last / scatter_last over [N, V] with some rows ignored (ignore_index sometimes in range).
  const int64_t rows = pick(c.rng, 0, 5), classes = pick(c.rng, 1, 5);
  const int64_t ignore = chance(c.rng, 70) ? -100 : pick(c.rng, 0, classes - 1);
  const Strided x = make_strided({rows, classes}, chance(c.rng, 30), c.dtype, c.dev, c.rng);
  const Strided idx = make_strided({rows}, chance(c.rng, 20), it, c.dev, c.rng, [&](Rng& g) {
    return chance(g, 25) ? double(ignore) : double(pick(g, 0, classes - 1));
  });
  const Strided vals = make_strided({rows}, chance(c.rng, 20), c.dtype, c.dev, c.rng);
  const std::string gs = fmt::format("x {}; idx {} {}; ignore_index {}", x.desc, idx.desc, dtype_name(it), ignore);
  std::vector<double> gref, sref(static_cast<size_t>(rows * classes), 0.0), mref;
  for (int64_t i = 0; i < rows; ++i) {
    const auto j = static_cast<int64_t>(idx.v[i]);
    gref.push_back(j == ignore ? 0.0 : x.at({i, j}));
    if (j != ignore) sref[static_cast<size_t>(i * classes + j)] = vals.v[i];
    mref.push_back(j == ignore ? 0.0 : 1.0);
  }
  c.chk.expect("gather_last", gs, ops::gather_last(x.t, idx.t, ignore), {rows}, gref);
  c.chk.expect("scatter_last", "values " + vals.desc + "; " + gs, ops::scatter_last(vals.t, idx.t, classes, ignore),
               {rows, classes}, sref);
  c.chk.expect("valid_mask", gs, ops::valid_mask(idx.t, ignore, c.dtype), {rows}, mref);
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Every unary op on a strided operand, every binary op on two operands of different ranks that
// broadcast against each other.  The f64 reference evaluates each textbook formula in double;
// tolerance primitive_rtol of the dtype (libm's error in f64, float functions' in f32).
void check_elementwise(Ctx& c) {
  const Shape s = random_shape(c.rng, 0, 4, true);
  const auto op = static_cast<ops::Unary>(pick(c.rng, 0, static_cast<int64_t>(ops::Unary::AddScalar)));
  const bool positive = op == ops::Unary::Log || op == ops::Unary::Sqrt || op == ops::Unary::Rsqrt || op == ops::Unary::Recip;
  const Strided x = make_strided(s, chance(c.rng, 40), c.dtype, c.dev, c.rng,
                                 [positive](Rng& g) { return positive ? uniform(g, 0.25, 4.0) : uniform(g, -3.0, 3.0); });
  const double alpha = uniform(c.rng, -2.0, 2.0);
  const double rtol = test::primitive_rtol(c.dtype);
  auto unary_ref = [&](double v) {
    switch (op) {
      case ops::Unary::Neg: return -v;
      case ops::Unary::Exp: return std::exp(v);
      case ops::Unary::Log: return std::log(v);
      case ops::Unary::Sqrt: return std::sqrt(v);
      case ops::Unary::Rsqrt: return 1.0 / std::sqrt(v);
      case ops::Unary::Square: return v * v;
      case ops::Unary::Abs: return std::fabs(v);
      case ops::Unary::Recip: return 1.0 / v;
      case ops::Unary::Sin: return std::sin(v);
      case ops::Unary::Cos: return std::cos(v);
      case ops::Unary::Tanh: return std::tanh(v);
      case ops::Unary::Sigmoid: return sigmoid(v);
      case ops::Unary::Silu: return v * sigmoid(v);
      case ops::Unary::Gelu: return 0.5 * v * std::erfc(-v / std::sqrt(2.0));
      case ops::Unary::GeluTanh: return 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
      case ops::Unary::Scale: return alpha * v;
      case ops::Unary::AddScalar: return v + alpha;
    }
    return v;
  };
  std::vector<double> ref, tol;
  for (double v : x.v) {
    ref.push_back(unary_ref(v));
    // Relative to the result and to the operand (sin near pi, gelu near 0 lose relative accuracy).
    tol.push_back(rtol * (std::fabs(ref.back()) + std::fabs(v) + 1.0));
  }
  const Tensor got = ops::unary(op, x.t, alpha);
  c.chk.expect(fmt::format("unary({}, alpha={})", static_cast<int>(op), alpha), "x " + x.desc, got, s, ref, tol);

  // Binary: the result's shape s.  b is a random suffix of s (a lower rank) with some dims 1; a has
  // the rank of s, with dims 1 only where b supplies the size.  The arguments are passed either way round.
  const auto bop = static_cast<ops::Binary>(pick(c.rng, 0, static_cast<int64_t>(ops::Binary::GeluTanhGrad)));
  Shape sb(s.end() - pick(c.rng, 0, static_cast<int64_t>(s.size())), s.end());
  for (int64_t& e : sb)
    if (chance(c.rng, 25)) e = 1;
  Shape sa = s;
  for (size_t i = s.size() - sb.size(); i < s.size(); ++i)
    if (sb[i - (s.size() - sb.size())] == s[i] && chance(c.rng, 25)) sa[i] = 1;
  const bool swap_args = chance(c.rng, 50);
  const Strided a = make_strided(sa, chance(c.rng, 40), c.dtype, c.dev, c.rng);
  const Strided b = make_strided(sb, chance(c.rng, 40), c.dtype, c.dev, c.rng, [&](Rng& g) {
    const double m = uniform(g, 0.25, 3.0);  // divisors kept away from 0
    return bop == ops::Binary::Div ? (chance(g, 50) ? -m : m) : uniform(g, -3.0, 3.0);
  });
  const Strided& lhs = swap_args ? b : a;
  const Strided& rhs = swap_args ? a : b;
  std::vector<double> bref, btol;
  for (const auto& idx : all_indices(s)) {
    auto val = [&](const Strided& t) {
      const Shape& ts = t.t.shape();
      std::vector<int64_t> ti(ts.size());
      for (size_t i = 0; i < ts.size(); ++i) ti[i] = ts[i] == 1 ? 0 : idx[s.size() - ts.size() + i];
      return t.at(ti);
    };
    const double p = val(lhs), q = val(rhs);
    double e = 0;
    switch (bop) {
      case ops::Binary::Add: e = p + q; break;
      case ops::Binary::Sub: e = p - q; break;
      case ops::Binary::Mul: e = p * q; break;
      case ops::Binary::Div: e = p / q; break;
      case ops::Binary::SiluGrad: e = p * (sigmoid(q) + q * sigmoid(q) * (1 - sigmoid(q))); break;
      case ops::Binary::GeluGrad:
        e = p * (0.5 * std::erfc(-q / std::sqrt(2.0)) + q * std::exp(-0.5 * q * q) / std::sqrt(2 * M_PI));
        break;
      case ops::Binary::GeluTanhGrad: {
        const double k0 = std::sqrt(2 / M_PI), t = std::tanh(k0 * (q + 0.044715 * q * q * q));
        e = p * (0.5 * (1 + t) + 0.5 * q * (1 - t * t) * k0 * (1 + 3 * 0.044715 * q * q));
        break;
      }
    }
    bref.push_back(e);
    btol.push_back(rtol * (std::fabs(e) + std::fabs(p) * (std::fabs(q) + 1) + 1.0));
  }
  if (c.dtype != DType::f64 && bop == ops::Binary::Div)  // a quotient of roundings of both operands: 1 ulp each
    for (double& t : btol) t *= 4;
  c.chk.expect(fmt::format("binary({})", static_cast<int>(bop)), "a " + lhs.desc + "; b " + rhs.desc,
               ops::binary(bop, lhs.t, rhs.t), s, bref, btol);
}

class OpsStrided : public ::testing::TestWithParam<Device> {};

// Thousands of random cases over every family of ops; KCPP_SEED repeats a failing run.
TEST_P(OpsStrided, RandomLayoutsMatchTheReference) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  Checker chk;
  const int cases = dev.is_cpu() ? 3000 : 1000;
  const char* families[] = {"reductions", "softmax", "cat", "copies", "matmul", "index", "elementwise"};
  for (int k = 0; k < cases; ++k) {
    const int fam = k % 7;
    // Half the CPU cases in f64 (nearly exact); a quarter in f32, which exercises the f32 host loops
    // and the f32 tolerances the CUDA run relies on; the rest in bf16 and f16 (computed in f32, each
    // result rounded once to the dtype).
    const DType cpu_types[] = {DType::f64, DType::bf16, DType::f64, DType::f32, DType::f64, DType::f16, DType::f64, DType::f32};
    const DType dtype = dev.is_cpu() ? cpu_types[k % 8] : DType::f32;
    chk.tag = fmt::format(" (seed {}, case {}, {}, {} {})", test::run_seed(), k, families[fam], dev.str(), dtype_name(dtype));
    Ctx c{dev, dtype, gen.engine(), chk};
    try {
      switch (fam) {
        case 0: check_reductions(c); break;
        case 1: check_softmax(c); break;
        case 2: check_cat(c); break;
        case 3: check_copies(c); break;
        case 4: check_matmul(c); break;
        case 5: check_index(c); break;
        case 6: check_elementwise(c); break;
      }
    } catch (const Error& e) {
      chk.fail(families[fam], fmt::format("unexpected kcpp::Error '{}'", e.what()));
    }
  }
  for (const auto& [op, n] : chk.failures) ADD_FAILURE() << op << ": " << n << " failing cases (seed " << test::run_seed() << ")";
}

// The cases the property test found, minimized.
TEST_P(OpsStrided, EmptyReductions) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const DType dt = dev.is_cpu() ? DType::f64 : DType::f32;
  // A last dim of 0 under non-empty leading dims: one result per row, 0 for a sum and NaN for a mean
  // (the CPU left these rows unwritten).
  const Tensor e = Tensor::empty({3, 0}, dt, dev);
  EXPECT_EQ(ops::sum(e).to_f64_vector(), std::vector<double>(3, 0.0));
  EXPECT_EQ(ops::sum(e, true).shape(), (Shape{3, 1}));
  for (double m : ops::mean(e).to_f64_vector()) EXPECT_TRUE(std::isnan(m));
  EXPECT_EQ(ops::sum_dim(Tensor::empty({0}, dt, dev), 0).to_f64_vector(), std::vector<double>{0.0});
  EXPECT_EQ(ops::sum_dim(Tensor::empty({2, 0, 4}, dt, dev).transpose(0, 2), 1).to_f64_vector(),
            std::vector<double>(8, 0.0));
  // sum_leading over no rows is zeros [H]; over no columns it is [0] (the row count was inferred
  // with -1, which fails for H = 0).
  EXPECT_EQ(ops::sum_leading(Tensor::empty({0, 4}, dt, dev)).to_f64_vector(), std::vector<double>(4, 0.0));
  EXPECT_EQ(ops::sum_leading(Tensor::empty({2, 1, 0}, dt, dev)).shape(), (Shape{0}));
  EXPECT_EQ(ops::sum_leading(Tensor::empty({0, 0}, dt, dev)).shape(), (Shape{0}));
}

// Malformed calls: a kcpp::Error naming the op and what is wrong, never a crash.
TEST_P(OpsStrided, MalformedCallsThrow) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const DType dt = dev.is_cpu() ? DType::f64 : DType::f32;
  const Tensor x = Tensor::zeros({2, 3}, dt, dev), xt = x.transpose(0, 1);
  EXPECT_ERROR(ops::add(x, xt), "shapes [2, 3] and [3, 2] do not broadcast");
  EXPECT_ERROR(ops::add(x, Tensor::zeros({2, 3}, dt == DType::f32 ? DType::bf16 : DType::f32, dev)),
               fmt::format("but 'a' is {}", dtype_name(dt)));
  EXPECT_ERROR(ops::exp(Tensor::zeros({2}, DType::i32, dev).expand({3, 2})), "expected a floating dtype, got i32");
  EXPECT_ERROR(ops::valid_mask(xt, -100, dt), "expected i64 or i32");
  EXPECT_ERROR(ops::attention_mask(3, 2, true, 0, dt, dev), "need 0 <= q_len <= kv_len");
  EXPECT_ERROR(ops::sum(Tensor::zeros({}, dt, dev)), "at least 1 dim");
  EXPECT_ERROR(ops::max(Tensor::zeros({3, 0}, dt, dev)), "empty last dim");
  EXPECT_ERROR(ops::sum_dim(x, 2), "dim 2 out of range");
  EXPECT_ERROR(ops::sum_dim(x, -3), "dim -3 out of range");
  EXPECT_ERROR(ops::argmax_checked(Tensor::zeros({3}, dt, dev)), "must be [rows, n]");
  EXPECT_ERROR(ops::argmax_checked(Tensor::zeros({3, 0}, dt, dev)), "n > 0");
  EXPECT_ERROR(ops::softmax_backward(x, xt), "argument 'dy': expected shape [3, 2], got [2, 3]");
  EXPECT_ERROR(ops::cat({x, xt}, 0), "has shape [3, 2]");
  EXPECT_ERROR(ops::cat({x, Tensor::zeros({2}, dt, dev)}, 0), "has 1 dims");
  EXPECT_ERROR(ops::cat({x}, 2), "dim 2 out of range");
  EXPECT_ERROR(ops::cat({}, 0), "no tensors");
  EXPECT_ERROR(ops::matmul(x, x), "inner dimensions differ");
  EXPECT_ERROR(ops::matmul(Tensor::zeros({2, 2, 3}, dt, dev), Tensor::zeros({3, 3, 2}, dt, dev)), "batch dims differ");
  EXPECT_ERROR(ops::matmul(Tensor::zeros({3}, dt, dev), x), "at least 2 dims");
  const Tensor ids = Tensor::from_i64(std::vector<int64_t>{0, 5}, {2}, DType::i64, dev);
  EXPECT_ERROR(ops::embedding(xt, Tensor::zeros({2}, dt, dev)), "expected i64 or i32");
  EXPECT_ERROR(ops::embedding(Tensor::zeros({3}, dt, dev), ids), "expected 2 dims");
  EXPECT_ERROR(ops::embedding_backward(Tensor::zeros({3, 2}, dt, dev), ids, 6), "does not match ids");
  EXPECT_ERROR(ops::gather_last(x, Tensor::zeros({3}, DType::i64, dev), -100), "expected shape [2]");
  EXPECT_ERROR(ops::scatter_last(Tensor::zeros({2}, dt, dev), ids, -1, -100), "op scatter_last: num_classes -1 < 0");
  if (dev.is_cpu()) {  // out-of-range indices are checked on the host; a CUDA id check waits for the device
    EXPECT_ERROR(ops::embedding(xt, ids), "'ids'[1] = 5 is out of range [0, 3)");
    const Tensor neg = Tensor::from_i64(std::vector<int64_t>{-1, 0}, {2}, DType::i32);
    EXPECT_ERROR(ops::embedding(xt, neg), "'ids'[0] = -1 is out of range [0, 3)");
    EXPECT_ERROR(ops::embedding(xt, neg.expand({2, 2}).transpose(0, 1)), "'ids'[0] = -1 is out of range");
    EXPECT_ERROR(ops::embedding_backward(Tensor::zeros({2, 4}, dt), ids, 5), "'ids'[1] = 5 is out of range [0, 5)");
    EXPECT_ERROR(ops::gather_last(x, ids, -100), "'idx'[1] = 5 is out of range [0, 3)");
    EXPECT_ERROR(ops::scatter_last(Tensor::zeros({2}, dt), ids, 3, -100), "'idx'[1] = 5 is out of range [0, 3)");
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, OpsStrided, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cpu() ? std::string("cpu") : std::string("cuda"); });

}  // namespace
}  // namespace kcpp
