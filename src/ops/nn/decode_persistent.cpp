#include "ops/nn/decode_persistent.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "ops/check.h"
#include "ops/cuda/launch.h"

namespace kcpp::ops {
namespace {

constexpr const char* kOp = "decode_layers_persistent";


bool power_of_two(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

// The kernel reads every weight and vector with 16-byte accesses or bulk copies.
bool dense16(const Tensor& t) { return t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data()) % 16 == 0; }

}  // namespace

std::optional<std::pair<Tensor, Tensor>> decode_layers_persistent(const Tensor& x, const Tensor& delta_in,
                                                                  const std::vector<PersistentDecodeLayer>& layers,
                                                                  const PersistentDecodeOptions& opt, const Tensor& cos,
                                                                  const Tensor& sin, const Tensor& rows,
                                                                  const Tensor& positions, const Tensor& lengths) {
  check_float(x, kOp, "x");
  check_dims(x, 2, kOp, "x");
  KCPP_CHECK(!layers.empty(), "op {}: no layers", kOp);
  const int64_t b = x.size(0), h = x.size(1), hq = opt.q_heads, hkv = opt.kv_heads;
  KCPP_CHECK(hq > 0 && hkv > 0 && hq % hkv == 0, "op {}: {} query heads and {} kv heads; the query heads must be a multiple of the kv heads",
             kOp, hq, hkv);
  if (delta_in.defined()) {
    check_same(delta_in, x, kOp, "delta_in", "x");
    check_shape(delta_in, x.shape(), kOp, "delta_in");
  }
  const PersistentDecodeLayer& first = layers[0];
  check_dims(first.k_cache, 4, kOp, "k_cache");
  const int64_t d = first.k_cache.size(3), capacity = first.k_cache.size(2);
  const Shape cache_shape = first.k_cache.shape();
  KCPP_CHECK(cache_shape[1] == hkv, "op {}: k_cache {} must have {} kv heads", kOp, shape_str(cache_shape), hkv);
  check_dims(first.w_gate_up, 2, kOp, "w_gate_up");
  KCPP_CHECK(first.w_gate_up.size(0) % 2 == 0, "op {}: w_gate_up {} must stack gate and up rows of equal count", kOp,
             shape_str(first.w_gate_up.shape()));
  const int64_t inter = first.w_gate_up.size(0) / 2;
  for (size_t i = 0; i < layers.size(); ++i) {
    const PersistentDecodeLayer& l = layers[i];
    const std::string at = fmt::format("layers[{}].", i);
    auto same = [&](const Tensor& t, const char* name, const Shape& shape) {
      check_same(t, x, kOp, at + name, "x");
      check_shape(t, shape, kOp, at + name);
    };
    same(l.input_norm, "input_norm", {h});
    same(l.post_norm, "post_norm", {h});
    same(l.wqkv, "wqkv", {(hq + 2 * hkv) * d, h});
    KCPP_CHECK(l.q_norm.defined() == l.k_norm.defined(), "op {}: layer {} has a {} norm without a {} norm", kOp, i,
               l.q_norm.defined() ? "q" : "k", l.q_norm.defined() ? "k" : "q");
    if (l.q_norm.defined()) {
      same(l.q_norm, "q_norm", {d});
      same(l.k_norm, "k_norm", {d});
    }
    same(l.wo, "wo", {h, hq * d});
    same(l.w_gate_up, "w_gate_up", {2 * inter, h});
    same(l.w_down, "w_down", {h, inter});
    same(l.k_cache, "k_cache", cache_shape);
    same(l.v_cache, "v_cache", cache_shape);
    KCPP_CHECK(l.scale >= 0 && l.window >= 0, "op {}: layer {} has scale {} and window {}; neither may be negative", kOp, i,
               l.scale, l.window);
  }
  KCPP_CHECK(cos.defined() && sin.defined() && cos.shape() == sin.shape() && cos.numel() % std::max<int64_t>(b, 1) == 0,
             "op {}: cos and sin must be [{}, 1, rd] or [{}, rd] alike", kOp, b, b);
  const int64_t rd = b > 0 ? cos.numel() / b : 0;
  check_same(cos, x, kOp, "cos", "x");
  check_same(sin, x, kOp, "sin", "x");
  KCPP_CHECK(rd % 2 == 0 && rd <= d, "op {}: the rotary width {} must be even and at most the head dim {}", kOp, rd, d);
  for (const auto& [t, name] : {std::pair{&rows, "rows"}, {&positions, "positions"}, {&lengths, "lengths"}}) {
    KCPP_CHECK(t->defined() && t->dtype() == DType::i32 && t->numel() == b && t->device() == x.device() && t->is_contiguous(),
               "op {}: {} must be i32 [{}] on {}", kOp, name, b, x.device().str());
  }
  KCPP_CHECK(opt.max_length >= 0, "op {}: max_length {} < 0", kOp, opt.max_length);

  // What the kernel covers (see the header); anything else is the caller's to compose.
  if (!decode_persistent_enabled() || !x.device().is_cuda() || (x.dtype() != DType::bf16 && x.dtype() != DType::f16) || b < 1 || b > 4) return std::nullopt;
  if (h % 8 != 0 || inter % 8 != 0 || !power_of_two(d) || d < 8 || d > 256 || hq / hkv > 8) return std::nullopt;
  if (h > (int64_t{1} << 24) || inter > (int64_t{1} << 24) || (hq + 2 * hkv) * d > (int64_t{1} << 24) || capacity > (int64_t{1} << 30) ||
      cache_shape[0] > (int64_t{1} << 30))
    return std::nullopt;
  for (RMSNormCasting c : {opt.norm.casting, opt.qk_norm.casting})
    if (c != RMSNormCasting::Llama && c != RMSNormCasting::Gemma) return std::nullopt;
  if (!dense16(x) || (delta_in.defined() && !dense16(delta_in)) || !cos.is_contiguous() || !sin.is_contiguous()) return std::nullopt;
  for (const PersistentDecodeLayer& l : layers)
    for (const Tensor* t : {&l.input_norm, &l.post_norm, &l.wqkv, &l.q_norm, &l.k_norm, &l.wo, &l.w_gate_up, &l.w_down, &l.k_cache, &l.v_cache})
      if (t->defined() && !dense16(*t)) return std::nullopt;
#if KCPP_WITH_CUDA
  const Tensor x_out = Tensor::empty({b, h}, x.dtype(), x.device());
  const Tensor delta_out = Tensor::empty({b, h}, x.dtype(), x.device());
  if (cuda::decode_layers_persistent(x_out, delta_out, x, delta_in, layers, opt, cos, sin, rows, positions, lengths))
    return std::pair{x_out, delta_out};
#endif
  return std::nullopt;
}

// Off unless KCPP_DECODE_PERSISTENT=1 (bench/RESULTS.md: not yet ahead of the fused ops at every batch).
bool decode_persistent_enabled() {
  const char* e = std::getenv("KCPP_DECODE_PERSISTENT");
  return e && std::strcmp(e, "1") == 0;
}

int64_t decode_persistent_runs() {
#if KCPP_WITH_CUDA
  return cuda::decode_persistent_launches();
#else
  return 0;
#endif
}

}  // namespace kcpp::ops
