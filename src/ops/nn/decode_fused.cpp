#include "ops/nn/decode_fused.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <optional>
#include <string_view>

#include "ops/check.h"
#include "ops/cuda/launch.h"
#include "ops/nn/decode_attention.h"
#include "ops/ops.h"

namespace kcpp::ops {
namespace {

// A fused gate/up output gu [N, 2I] (gate columns first): checked, its I returned.
int64_t packed_halves(const Tensor& gu, const char* op) {
  check_float(gu, op, "gu");
  check_dims(gu, 2, op, "gu");
  KCPP_CHECK(gu.size(1) % 2 == 0, "op {}: gu has {} columns; it must hold gate and up halves of equal width", op,
             gu.size(1));
  return gu.size(1) / 2;
}

// A fused CUDA kernel covers this call: f32 / bf16 / f16 on a CUDA device.
bool fused_on_cuda(const Tensor& t) {
#if KCPP_WITH_CUDA
  return t.device().is_cuda() && (t.dtype() == DType::f32 || t.dtype() == DType::bf16 || t.dtype() == DType::f16);
#else
  (void)t;
  return false;
#endif
}

bool fused_casting(const RMSNormOptions& o) { return o.casting == RMSNormCasting::Llama || o.casting == RMSNormCasting::Gemma; }

// The fused projection kernel covers this call: bf16 / f16 on CUDA, 1 .. kFusedLinearMaxRows rows,
// rows of K % 8 == 0 elements, every operand contiguous and 16-byte aligned (ops/cuda/decode_gemv.cu).
bool fused_linear_on_cuda(const Tensor& x, DType dtype, int64_t k, std::initializer_list<const Tensor*> operands) {
#if KCPP_WITH_CUDA
  const int64_t n = x.size(0);
  if (!x.device().is_cuda() || (dtype != DType::bf16 && dtype != DType::f16) || n < 1 || n > kFusedLinearMaxRows ||
      k < 8 || k % 8 != 0 || k > (int64_t{1} << 30))
    return false;
  for (const Tensor* t : operands)
    if (t->defined() && (!t->is_contiguous() || reinterpret_cast<uintptr_t>(t->data()) % 16 != 0)) return false;
  return true;
#else
  (void)x, (void)dtype, (void)k, (void)operands;
  return false;
#endif
}

// qk_norm_rope_cache's arguments, checked by name for `op`.
void check_qk_norm_rope_cache(const Tensor& qkv, const QkNormRopeCache& opt, const Tensor& cos, const Tensor& sin,
                              const Tensor& k_cache, const Tensor& v_cache, const Tensor& rows, const Tensor& positions,
                              const char* op) {
  check_float(qkv, op, "qkv");
  check_dims(qkv, 3, op, "qkv");
  const int64_t b = qkv.size(0), hq = opt.q_heads, hkv = opt.kv_heads, d = qkv.size(2);
  KCPP_CHECK(hq > 0 && hkv > 0 && qkv.size(1) == hq + 2 * hkv,
             "op {}: qkv has {} heads; with {} query and {} key/value heads it must have {}", op, qkv.size(1), hq, hkv,
             hq + 2 * hkv);
  KCPP_CHECK(opt.q_norm.defined() == opt.k_norm.defined(), "op {}: give both q_norm and k_norm, or neither", op);
  if (opt.q_norm.defined()) {
    check_same(opt.q_norm, qkv, op, "q_norm", "qkv");
    check_same(opt.k_norm, qkv, op, "k_norm", "qkv");
    check_shape(opt.q_norm, {d}, op, "q_norm");
    check_shape(opt.k_norm, {d}, op, "k_norm");
  }
  check_same(cos, qkv, op, "cos", "qkv");
  check_same(sin, qkv, op, "sin", "qkv");
  check_dims(cos, 3, op, "cos");
  check_shape(sin, cos.shape(), op, "sin");
  const int64_t rd = cos.size(2);
  KCPP_CHECK(cos.size(0) == b && cos.size(1) == 1, "op {}: cos must be [{}, 1, rotary dims] (one position a row), got {}",
             op, b, shape_str(cos.shape()));
  KCPP_CHECK(rd > 0 && rd % 2 == 0 && rd <= d, "op {}: rotary dim {} must be even, > 0 and <= head dim {}", op, rd, d);
  check_same(k_cache, qkv, op, "k_cache", "qkv");
  check_same(v_cache, qkv, op, "v_cache", "qkv");
  check_dims(k_cache, 4, op, "k_cache");
  check_shape(v_cache, k_cache.shape(), op, "v_cache");
  KCPP_CHECK(k_cache.size(1) == hkv && k_cache.size(3) == d, "op {}: the cache {} does not hold {} heads of {}", op,
             shape_str(k_cache.shape()), hkv, d);
  for (const auto& [t, arg] : {std::pair{&rows, "rows"}, std::pair{&positions, "positions"}}) {
    check_defined(*t, op, arg);
    KCPP_CHECK(t->dtype() == DType::i32, "op {}: argument '{}' must be i32, got {}", op, arg, dtype_name(t->dtype()));
    check_shape(*t, {b}, op, arg);
    KCPP_CHECK(t->device() == qkv.device(), "op {}: argument '{}' is on {} but qkv is on {}", op, arg,
               t->device().str(), qkv.device().str());
  }
}

// qk_norm_rope_cache's CUDA kernel (and qk_norm_rope_attention's prologue) covers this call.
bool qk_on_cuda(const Tensor& qkv, const QkNormRopeCache& opt, const Tensor& k_cache, const Tensor& v_cache) {
  return fused_on_cuda(qkv) && (!opt.q_norm.defined() || fused_casting(opt.norm)) && qkv.size(2) <= 256 &&
         k_cache.is_contiguous() && v_cache.is_contiguous();
}

// The norms' weights contiguous, for the kernels.
QkNormRopeCache contiguous_norms(const QkNormRopeCache& opt) {
  QkNormRopeCache o = opt;
  if (o.q_norm.defined()) o.q_norm = o.q_norm.contiguous(), o.k_norm = o.k_norm.contiguous();
  return o;
}

}  // namespace

Tensor qk_norm_rope_cache(const Tensor& qkv, const QkNormRopeCache& opt, const Tensor& cos, const Tensor& sin,
                          const Tensor& k_cache, const Tensor& v_cache, const Tensor& rows, const Tensor& positions) {
  check_qk_norm_rope_cache(qkv, opt, cos, sin, k_cache, v_cache, rows, positions, "qk_norm_rope_cache");
  const int64_t b = qkv.size(0), hq = opt.q_heads, hkv = opt.kv_heads, d = qkv.size(2);
  if (b == 0) return Tensor::empty({0, hq, d}, qkv.dtype(), qkv.device());
  if (qk_on_cuda(qkv, opt, k_cache, v_cache)) {
#if KCPP_WITH_CUDA
    const Tensor q = Tensor::empty({b, hq, d}, qkv.dtype(), qkv.device());
    cuda::qk_norm_rope_cache(q, qkv.contiguous(), contiguous_norms(opt), cos.contiguous(), sin.contiguous(), k_cache,
                             v_cache, rows.contiguous(), positions.contiguous());
    return q;
#endif
  }
  // The composition it fuses (rope over [B, heads, 1, D] with cos [B, 1, rd]).
  Tensor q = qkv.narrow(1, 0, hq).contiguous(), k = qkv.narrow(1, hq, hkv).contiguous();
  if (opt.q_norm.defined()) {
    q = rms_norm_forward(q, opt.q_norm, opt.norm).y;
    k = rms_norm_forward(k, opt.k_norm, opt.norm).y;
  }
  q = rope_forward(q.view({b, hq, 1, d}), cos, sin, opt.layout).view({b, hq, d});
  k = rope_forward(k.view({b, hkv, 1, d}), cos, sin, opt.layout).view({b, hkv, d});
  cache_write(k_cache, v_cache, k, qkv.narrow(1, hq + hkv, hkv).contiguous(), rows, positions);
  return q;
}

namespace {
std::atomic<int64_t> qk_norm_rope_attention_fused{0};  // calls that took the one kernel
}  // namespace

int64_t qk_norm_rope_attention_fused_runs() { return qk_norm_rope_attention_fused.load(std::memory_order_relaxed); }

Tensor qk_norm_rope_attention(const Tensor& qkv, const QkNormRopeCache& opt, const Tensor& cos, const Tensor& sin,
                              const Tensor& k_cache, const Tensor& v_cache, const Tensor& rows, const Tensor& positions,
                              const Tensor& lengths, double scale, int64_t window, int64_t max_length) {
  constexpr const char* op = "qk_norm_rope_attention";
  check_qk_norm_rope_cache(qkv, opt, cos, sin, k_cache, v_cache, rows, positions, op);
  const int64_t b = qkv.size(0), hq = opt.q_heads, d = qkv.size(2);
  check_decode_attention(qkv, "qkv", b, hq, d, k_cache, v_cache, rows, lengths, scale, window, max_length, op);
  // The kernel reads the norms' weights before it waits for the kernel before it (no kernel writes
  // weights): strided ones, which a copy just before would make contiguous, take the composition.
  const bool norms_as_stored = !opt.q_norm.defined() || (opt.q_norm.is_contiguous() && opt.k_norm.is_contiguous());
  if (b > 0 && norms_as_stored && qk_on_cuda(qkv, opt, k_cache, v_cache)) {
#if KCPP_WITH_CUDA
    const Tensor out = Tensor::empty({b, hq, d}, qkv.dtype(), qkv.device());
    // opt.settled holds only for the tensors as given: a copy made contiguous here would be the
    // kernel just before.
    QkNormRopeCache o = opt;
    o.settled = opt.settled && cos.is_contiguous() && sin.is_contiguous() && rows.is_contiguous() &&
                positions.is_contiguous() && lengths.is_contiguous();
    if (cuda::qk_norm_rope_attention(out, qkv.contiguous(), o, cos.contiguous(), sin.contiguous(),
                                     k_cache, v_cache, rows.contiguous(), positions.contiguous(), lengths.contiguous(), scale,
                                     window, max_length > 0 ? max_length : k_cache.size(2))) {
      qk_norm_rope_attention_fused.fetch_add(1, std::memory_order_relaxed);
      return out;
    }
#endif
  }
  return decode_attention(qk_norm_rope_cache(qkv, opt, cos, sin, k_cache, v_cache, rows, positions), k_cache, v_cache, rows,
                          lengths, scale, window, max_length);
}

std::pair<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& delta, const Tensor& w, const RMSNormOptions& opt) {
  constexpr const char* op = "add_rms_norm";
  check_float(x, op, "x");
  check_dims(x, 2, op, "x");
  check_same(delta, x, op, "delta", "x");
  check_shape(delta, x.shape(), op, "delta");
  check_same(w, x, op, "weight", "x");
  check_shape(w, {x.size(1)}, op, "weight");
  KCPP_CHECK(opt.eps >= 0, "op {}: eps {} < 0", op, opt.eps);
  // The kernel reads the weights before it waits for the kernel before it (no kernel writes weights):
  // strided ones, which a copy just before would make contiguous, take the composition.
  if (fused_on_cuda(x) && fused_casting(opt) && x.numel() > 0 && w.is_contiguous()) {
#if KCPP_WITH_CUDA
    const Tensor s = Tensor::empty(x.shape(), x.dtype(), x.device()), y = Tensor::empty(x.shape(), x.dtype(), x.device());
    cuda::add_rms_norm(s, y, x.contiguous(), delta.contiguous(), w, opt);
    return {s, y};
#endif
  }
  const Tensor s = add(x, delta);
  return {s, rms_norm_forward(s, w, opt).y};
}

Tensor glu_packed(const Tensor& gu, GluActivation act) {
  constexpr const char* op = "glu_packed";
  [[maybe_unused]] const int64_t n = gu.size(0);  // the CUDA path's
  const int64_t inter = packed_halves(gu, op);
  if (fused_on_cuda(gu) && gu.numel() > 0) {
#if KCPP_WITH_CUDA
    const Tensor h = Tensor::empty({n, inter}, gu.dtype(), gu.device());
    cuda::glu_packed(h, gu.contiguous(), act);
    return h;
#endif
  }
  return glu_forward(gu.narrow(1, 0, inter).contiguous(), gu.narrow(1, inter, inter).contiguous(), act);
}

int64_t gemv_max_rows() {
  static const int64_t rows = [] {
    const char* e = std::getenv("KCPP_GEMV");
    if (!e || !*e) return int64_t{1};
    return std::clamp<int64_t>(std::atoll(e), 0, 8);
  }();
  return rows;
}

bool decode_linear_fused(Device device, DType dtype, int64_t rows) {
#if KCPP_WITH_CUDA
  return device.is_cuda() && (dtype == DType::bf16 || dtype == DType::f16) && rows >= 1 &&
         rows <= std::min(kFusedLinearMaxRows, gemv_max_rows());
#else
  (void)device, (void)dtype, (void)rows;
  return false;
#endif
}

namespace {

// add_rms_norm_linear(_glu)'s arguments checked; true for an f32 residual x beside 16-bit weights
// (Mamba's residual_in_fp32: delta and the weights in the 16-bit dtype, s in f32, the norm reading s
// rounded).
bool check_norm_linear(const char* op, const Tensor& x, const Tensor& delta, const Tensor& norm_weight,
                       const RMSNormOptions& opt, const Tensor& weight) {
  check_float(x, op, "x");
  check_dims(x, 2, op, "x");
  const int64_t k = x.size(1);
  check_defined(weight, op, "weight");
  const bool wide = x.dtype() == DType::f32 && (weight.dtype() == DType::bf16 || weight.dtype() == DType::f16);
  const Tensor& ref = wide ? weight : x;
  const char* ref_name = wide ? "weight" : "x";
  if (delta.defined()) {
    check_same(delta, ref, op, "delta", ref_name);
    check_shape(delta, x.shape(), op, "delta");
  }
  check_same(norm_weight, ref, op, "norm_weight", ref_name);
  check_shape(norm_weight, {k}, op, "norm_weight");
  if (!wide) check_same(weight, x, op, "weight", "x");
  KCPP_CHECK(weight.device() == x.device(), "op {}: argument 'weight' is on {} but x is on {}", op, weight.device().str(),
             x.device().str());
  check_dims(weight, 2, op, "weight");
  KCPP_CHECK(weight.size(1) == k, "op {}: weight {} must be [out features, {}] to take rows of x {}", op,
             shape_str(weight.shape()), k, shape_str(x.shape()));
  KCPP_CHECK(opt.eps >= 0, "op {}: eps {} < 0", op, opt.eps);
  return wide;
}

#if KCPP_WITH_CUDA
// The one-kernel path of add_rms_norm_linear(_glu): (s, out [N, cols]) from launch(out, s or undefined)
// where the arguments suit it and the kernel takes the call; nothing otherwise (the caller composes).
// An empty product composes too, so that s is still made.
template <typename Launch>
std::optional<std::pair<Tensor, Tensor>> norm_linear_on_cuda(const Tensor& x, const Tensor& delta, const Tensor& norm_weight,
                                                             const RMSNormOptions& opt, const Tensor& weight, int64_t cols,
                                                             Launch&& launch) {
  if (cols == 0 || !fused_casting(opt) || weight.size(0) > (int64_t{1} << 30) ||
      !fused_linear_on_cuda(x, weight.dtype(), x.size(1), {&x, &delta, &norm_weight, &weight}))
    return std::nullopt;
  const Tensor s = delta.defined() ? Tensor::empty(x.shape(), x.dtype(), x.device()) : x;
  const Tensor out = Tensor::empty({x.size(0), cols}, weight.dtype(), x.device());
  if (out.numel() > 0 && !launch(out, delta.defined() ? s : Tensor())) return std::nullopt;
  return std::pair{s, out};
}
#endif

}  // namespace

std::pair<Tensor, Tensor> add_rms_norm_linear(const Tensor& x, const Tensor& delta, const Tensor& norm_weight,
                                              const RMSNormOptions& opt, const Tensor& weight) {
  constexpr const char* op = "add_rms_norm_linear";
  const bool wide = check_norm_linear(op, x, delta, norm_weight, opt, weight);
#if KCPP_WITH_CUDA
  if (auto r = norm_linear_on_cuda(x, delta, norm_weight, opt, weight, weight.size(0), [&](const Tensor& out, const Tensor& s) {
        return cuda::add_rms_norm_linear(out, s, x, delta, norm_weight, opt, weight);
      }))
    return *r;
#endif
  if (wide) {
    const Tensor s = delta.defined() ? add(x, delta.to(DType::f32)) : x;
    return {s, matmul(rms_norm_forward(s.to(weight.dtype()), norm_weight, opt).y, weight, false, true)};
  }
  if (!delta.defined()) return {x, matmul(rms_norm_forward(x, norm_weight, opt).y, weight, false, true)};
  const auto [s, a] = add_rms_norm(x, delta, norm_weight, opt);
  return {s, matmul(a, weight, false, true)};
}

std::pair<Tensor, Tensor> add_rms_norm_linear_glu(const Tensor& x, const Tensor& delta, const Tensor& norm_weight,
                                                  const RMSNormOptions& opt, const Tensor& weight, GluActivation act) {
  constexpr const char* op = "add_rms_norm_linear_glu";
  check_norm_linear(op, x, delta, norm_weight, opt, weight);
  KCPP_CHECK(weight.size(0) % 2 == 0, "op {}: weight {} must have an even number of rows (gate rows, then up rows)", op,
             shape_str(weight.shape()));
#if KCPP_WITH_CUDA
  if (auto r = norm_linear_on_cuda(x, delta, norm_weight, opt, weight, weight.size(0) / 2,
                                   [&](const Tensor& out, const Tensor& s) {
                                     return cuda::add_rms_norm_linear_glu(out, s, x, delta, norm_weight, opt, weight, act);
                                   }))
    return *r;
#endif
  const auto [s, gu] = add_rms_norm_linear(x, delta, norm_weight, opt, weight);
  return {s, glu_packed(gu, act)};
}

namespace {
std::atomic<int64_t> fused_runs[2]{};

// The environment's switch of `which` (KCPP_LINEAR_GLU, KCPP_LINEAR_QK), read once: "0", "1" or
// anything else (unset).
const char* fused_gemm_switch(FusedGemm which) {
  auto read = [](const char* name) {
    const char* e = std::getenv(name);
    return e ? e : "";
  };
  static const char* const value[2] = {read("KCPP_LINEAR_GLU"), read("KCPP_LINEAR_QK")};
  return value[static_cast<int>(which)];
}

// "0" turns the one kernel off (the composition, for comparing the two).
bool fused_gemm_enabled(FusedGemm which) { return std::string_view(fused_gemm_switch(which)) != "0"; }

// Whether the one kernel of `which` is tried for this call (x's dtype and device, the path, the
// switch, under Auto the tiles against the device's multiprocessors).
bool fused_gemm_tried(FusedGemm which, const Tensor& x, FusedGemmPath path, int64_t rows, int64_t cols, int64_t tile_cols) {
  if (!x.device().is_cuda() || (x.dtype() != DType::bf16 && x.dtype() != DType::f16) || rows <= 0 || cols <= 0 ||
      path == FusedGemmPath::Composition || !fused_gemm_enabled(which))
    return false;
#if KCPP_WITH_CUDA
  if (path == FusedGemmPath::Kernel) return true;
  // Auto: linear_qk_norm_rope_cache's kernel measured behind cuBLAS + qk_norm_rope_cache even where
  // its tiles fill the waves (its epilogue, bench/RESULTS.md): the composition, unless KCPP_LINEAR_QK=1
  // asks for the kernel where the tiles fill the waves (for measuring it in a prefill).
  if (which == FusedGemm::LinearQkNormRopeCache && std::string_view(fused_gemm_switch(which)) != "1") return false;
  return fused_gemm_fills_waves(rows, cols, tile_cols, cuda::multiprocessors(x.device()));
#else
  (void)tile_cols;
  return false;
#endif
}
}  // namespace

int64_t fused_gemm_runs(FusedGemm which) { return fused_runs[static_cast<int>(which)].load(std::memory_order_relaxed); }

const char* fused_gemm_unavailable(Device device, FusedGemm which) {
  if (!device.is_cuda()) return "not a CUDA device";
  if (!fused_gemm_enabled(which)) return which == FusedGemm::LinearGlu ? "KCPP_LINEAR_GLU=0" : "KCPP_LINEAR_QK=0";
#if KCPP_WITH_CUDA
  return cuda::fused_gemm_unavailable(device);
#else
  return "a build without CUDA";
#endif
}

bool fused_gemm_fills_waves(int64_t rows, int64_t cols, int64_t tile_cols, int64_t sms) {
  if (rows <= 0 || cols <= 0 || tile_cols <= 0 || sms <= 0) return false;
  const int64_t tiles = ((rows + 127) / 128) * ((cols + tile_cols - 1) / tile_cols);
  const int64_t waves = (tiles + sms - 1) / sms;
  return 5 * tiles >= 4 * waves * sms;
}

Tensor linear_glu(const Tensor& x, const Tensor& weight, GluActivation act, FusedGemmPath path) {
  constexpr const char* op = "linear_glu";
  check_float(x, op, "x");
  check_dims(x, 2, op, "x");
  check_same(weight, x, op, "weight", "x");
  check_dims(weight, 2, op, "weight");
  KCPP_CHECK(weight.size(1) == x.size(1) && weight.size(0) % 2 == 0,
             "op {}: weight {} must be [2 x intermediate, {}] (gate rows, then up rows) for x {}", op,
             shape_str(weight.shape()), x.size(1), shape_str(x.shape()));
  const int64_t n = x.size(0), inter = weight.size(0) / 2;
  if (fused_gemm_tried(FusedGemm::LinearGlu, x, path, n, inter, 128)) {
#if KCPP_WITH_CUDA
    const Tensor h = Tensor::empty({n, inter}, x.dtype(), x.device());
    if (cuda::linear_glu(h, x, weight, act) == nullptr) {
      fused_runs[static_cast<int>(FusedGemm::LinearGlu)].fetch_add(1, std::memory_order_relaxed);
      return h;
    }
#endif
  }
  return glu_packed(matmul(x, weight, false, true), act);
}

Tensor linear_qk_norm_rope_cache(const Tensor& x, const Tensor& weight, const QkNormRopeCache& opt, const Tensor& cos,
                                 const Tensor& sin, const Tensor& k_cache, const Tensor& v_cache, const Tensor& rows,
                                 const Tensor& positions, FusedGemmPath path) {
  constexpr const char* op = "linear_qk_norm_rope_cache";
  check_float(x, op, "x");
  check_dims(x, 2, op, "x");
  check_same(weight, x, op, "weight", "x");
  check_dims(weight, 2, op, "weight");
  const int64_t heads = opt.q_heads + 2 * opt.kv_heads, n = x.size(0);
  KCPP_CHECK(opt.q_heads > 0 && opt.kv_heads > 0 && weight.size(1) == x.size(1) && weight.size(0) % heads == 0,
             "op {}: weight {} must be [({} + 2 x {}) x head dim, {}] (q, k and v heads) for x {}", op,
             shape_str(weight.shape()), opt.q_heads, opt.kv_heads, x.size(1), shape_str(x.shape()));
  const int64_t d = weight.size(0) / heads;
  // qk_norm_rope_cache's checks, on qkv's shape without making it (a view of one element).
  const Tensor qkv_shape = Tensor::empty({1, 1, 1}, x.dtype(), x.device()).expand({n, heads, d});
  check_qk_norm_rope_cache(qkv_shape, opt, cos, sin, k_cache, v_cache, rows, positions, op);
  const bool rotary_whole = cos.size(2) == d && opt.layout == RopeLayout::RotateHalf;
  if (rotary_whole && (!opt.q_norm.defined() || fused_casting(opt.norm)) &&
      fused_gemm_tried(FusedGemm::LinearQkNormRopeCache, x, path, n, heads * d, 256)) {
#if KCPP_WITH_CUDA
    const Tensor q = Tensor::empty({n, opt.q_heads, d}, x.dtype(), x.device());
    if (cuda::linear_qk_norm_rope_cache(q, x, weight, contiguous_norms(opt), cos, sin, k_cache, v_cache, rows, positions) ==
        nullptr) {
      fused_runs[static_cast<int>(FusedGemm::LinearQkNormRopeCache)].fetch_add(1, std::memory_order_relaxed);
      return q;
    }
#endif
  }
  return qk_norm_rope_cache(matmul(x, weight, false, true).view({n, heads, d}), opt, cos, sin, k_cache, v_cache, rows,
                            positions);
}

Tensor glu_linear(const Tensor& gu, GluActivation act, const Tensor& weight) {
  constexpr const char* op = "glu_linear";
  [[maybe_unused]] const int64_t n = gu.size(0);  // the CUDA path's
  const int64_t inter = packed_halves(gu, op);
  check_same(weight, gu, op, "weight", "gu");
  check_dims(weight, 2, op, "weight");
  KCPP_CHECK(weight.size(1) == inter, "op {}: weight {} must be [out features, {}] (half of gu's {} columns)", op,
             shape_str(weight.shape()), inter, gu.size(1));
  if (weight.size(0) <= (int64_t{1} << 30) && fused_linear_on_cuda(gu, gu.dtype(), inter, {&gu, &weight})) {
#if KCPP_WITH_CUDA
    const Tensor out = Tensor::empty({n, weight.size(0)}, gu.dtype(), gu.device());
    if (out.numel() == 0 || cuda::glu_linear(out, gu, act, weight)) return out;
#endif
  }
  return matmul(glu_packed(gu, act), weight, false, true);
}

}  // namespace kcpp::ops
