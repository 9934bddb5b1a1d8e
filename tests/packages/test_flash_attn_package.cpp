// Package "flash_attn" (layer FlashAttention, Attention/1) through the ABI against the f64 oracle
// (oracle::attention), held to docs/DESIGN.md's bound: at most twice the error of the eager reference
// (ops::attention_*: scores and probabilities materialized in the dtype) in the same precision.
// Shapes cover both CUDA paths (tensor cores: bf16 / f16, head_dim 64 / 128; generic: the rest),
// partial tiles on every side, grouped-query heads, a KV cache (fewer queries than keys), sliding
// windows, non-causal attention and the [B, S, H, D] layout read through strides; variable-length
// packed sequences (cu_seqlens) against the oracle per sequence and against each sequence run batched.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <deque>
#include <exception>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/platform.h"
#include "hub/package.h"
#include "oracle.h"
#include "ops/nn/attention.h"
#include "package_util.h"
#include "test_util.h"

namespace kcpp {
namespace {

using nn::KernelArgs;
using nn::KernelLayer;

KernelLayer layer() { return KernelLayer::find(test::built_package("flash_attn"), "FlashAttention"); }

struct Case {
  int64_t b, hq, hkv, sq, skv, d;
  bool causal;
  int64_t window;
  double softcap = 0;  // > 0: logit soft-capping (Gemma 2)
};

// q [B, Hq, Sq, D] etc.; `bshd`: made as [B, S, H, D] and viewed as [B, H, S, D] (strided).
Tensor make(int64_t b, int64_t h, int64_t s, int64_t d, DType dt, Device dev, Generator& gen, bool bshd, double sd = 1.0) {
  if (!bshd) return Tensor::randn({b, h, s, d}, dt, dev, gen, 0.0, sd);
  return Tensor::randn({b, s, h, d}, dt, dev, gen, 0.0, sd).transpose(1, 2);
}

struct Result {
  Tensor out, lse, dq, dk, dv;
};

// `narrow`: out and dq are views of columns 1..D of wider rows (2-byte aligned, strides no multiple of
// 8 elements), so the backward's passes around its tensor-core kernels take their any-layout forms.
Result run_both(const KernelLayer& k, const Tensor& q, const Tensor& kk, const Tensor& v, const Tensor& dout, const Case& c,
        Device dev, bool narrow = false) {
  auto like_q = [&] {
    if (!narrow) return Tensor::empty(q.shape(), q.dtype(), dev);
    return Tensor::empty({c.b, c.hq, c.sq, c.d + 1}, q.dtype(), dev).narrow(3, 1, c.d);
  };
  Result r;
  r.out = like_q();
  r.lse = Tensor::empty({c.b, c.hq, c.sq}, DType::f32, dev);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  KernelArgs f;
  f.tensor("q", q).tensor("k", kk).tensor("v", v).tensor("out", r.out).tensor("lse", r.lse);
  f.real("scale", scale).integer("causal", c.causal ? 1 : 0).integer("window", c.window);
  if (c.softcap > 0) f.real("softcap", c.softcap);
  EXPECT_TRUE(k.supports(f, dev, test::kTraining).ok());
  k.forward(f, dev, test::kTraining);
  r.dq = like_q();
  r.dk = Tensor::empty(kk.shape(), kk.dtype(), dev);
  r.dv = Tensor::empty(v.shape(), v.dtype(), dev);
  KernelArgs b;
  b.tensor("dout", dout).tensor("q", q).tensor("k", kk).tensor("v", v).tensor("out", r.out).tensor("lse", r.lse);
  b.real("scale", scale).integer("causal", c.causal ? 1 : 0).integer("window", c.window);
  if (c.softcap > 0) b.real("softcap", c.softcap);
  b.tensor("dq", r.dq).tensor("dk", r.dk).tensor("dv", r.dv);
  k.backward(b, dev, test::kTraining);
  return r;
}

// Runs case `c` in `dt` through the package and holds out, dq, dk, dv and lse to the bounds.
void check_case(const KernelLayer& k, const Case& c, DType dt, Device dev, Generator& gen, bool bshd, bool narrow = false) {
  const std::string cfg = fmt::format("{} b={} hq={} hkv={} sq={} skv={} d={} causal={} window={} softcap={} bshd={} narrow={}",
                                      test::config_name(dev, dt), c.b, c.hq, c.hkv, c.sq, c.skv, c.d, c.causal, c.window,
                                      c.softcap, bshd, narrow);
  // With a cap, queries of standard deviation 4: scale q.k reaches several times the cap, where tanh
  // bends and its slope (the backward's factor) is far from 1.
  const double q_sd = c.softcap > 0 ? 4.0 : 1.0;
  const Tensor q = make(c.b, c.hq, c.sq, c.d, dt, dev, gen, bshd, q_sd), kk = make(c.b, c.hkv, c.skv, c.d, dt, dev, gen, bshd);
  const Tensor v = make(c.b, c.hkv, c.skv, c.d, dt, dev, gen, bshd), dout = make(c.b, c.hq, c.sq, c.d, dt, dev, gen, bshd);
  const Result r = run_both(k, q, kk, v, dout, c, dev, narrow);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  const auto dov = dout.to_f64_vector();
  const oracle::Attn o = oracle::attention(q.to_f64_vector(), kk.to_f64_vector(), v.to_f64_vector(), &dov, c.b, c.hq, c.hkv,
                                           c.sq, c.skv, c.d, scale, c.causal, c.window, 0, c.softcap);
  const ops::AttentionOptions opt{scale, c.causal, c.window, 0, c.softcap};
  const ops::AttentionForward rf = ops::attention_forward(q, kk, v, opt);
  const ops::AttentionBackward rb = ops::attention_backward(dout, q, kk, v, rf, opt);
  const std::pair<const char*, std::pair<Tensor, Tensor>> outs[] = {
      {"out", {r.out, rf.out}}, {"dq", {r.dq, rb.dq}}, {"dk", {r.dk, rb.dk}}, {"dv", {r.dv, rb.dv}}};
  const oracle::V* refs[] = {&o.out, &o.dq, &o.dk, &o.dv};
  for (int i = 0; i < 4; ++i) {
    const double e_ref = test::rel_l2_error(outs[i].second.second, *refs[i]);
    const double e = test::rel_l2_error(outs[i].second.first, *refs[i]);
    EXPECT_LE(e, test::kernel_bound(e_ref, dt)) << cfg << " " << outs[i].first << " (reference error " << e_ref << ")";
    EXPECT_LE(e, test::composite_rel_l2(dt)) << cfg << " " << outs[i].first;
  }
  // lse: log-sum-exp of each query's visible scaled scores, in f64.
  const auto qv = q.to_f64_vector(), kv = kk.to_f64_vector(), lse = r.lse.to_f64_vector();
  double worst = 0;
  std::vector<double> s;
  for (int64_t bi = 0; bi < c.b; ++bi)
    for (int64_t h = 0; h < c.hq; ++h)
      for (int64_t i = 0; i < c.sq; ++i) {
        const int64_t pos = i + c.skv - c.sq, hk = h / (c.hq / c.hkv);
        double mx = -std::numeric_limits<double>::infinity(), sum = 0;
        s.clear();
        for (int64_t j = 0; j < c.skv; ++j) {
          if ((c.causal && j > pos) || (c.window > 0 && pos - j >= c.window)) continue;
          double x = 0;
          for (int64_t e = 0; e < c.d; ++e)
            x += qv[((bi * c.hq + h) * c.sq + i) * c.d + e] * kv[((bi * c.hkv + hk) * c.skv + j) * c.d + e];
          x *= scale;
          if (c.softcap > 0) x = c.softcap * std::tanh(x / c.softcap);
          s.push_back(x);
          mx = std::max(mx, x);
        }
        for (double x : s) sum += std::exp(x - mx);
        worst = std::max(worst, std::abs(lse[(bi * c.hq + h) * c.sq + i] - (mx + std::log(sum))));
      }
  EXPECT_LE(worst, 1e-4 * std::sqrt(static_cast<double>(c.d))) << cfg << " lse";
}

class FlashAttnPackage : public ::testing::TestWithParam<Device> {};

TEST_P(FlashAttnPackage, WithinTwiceTheReferenceError) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer k = layer();
  const Case cases[] = {
      {1, 1, 1, 1, 1, 64, true, 0},      {2, 4, 2, 37, 37, 64, true, 0},    {1, 4, 1, 77, 77, 128, true, 0},
      {2, 2, 2, 5, 70, 128, true, 0},    {1, 2, 1, 130, 130, 64, false, 0}, {1, 2, 2, 100, 100, 64, true, 17},
      {1, 3, 1, 9, 9, 8, true, 0},       {1, 2, 1, 33, 33, 111, true, 0},   {2, 8, 2, 200, 200, 128, true, 0},
      {1, 2, 1, 3, 150, 64, false, 40},  {1, 1, 1, 1, 129, 128, true, 0},
      // Soft-capping (Gemma 2's 50, and caps of 2 and 5 that bend most scores): the tensor-core
      // shapes (head dim 64 / 128, partial tiles, grouped heads, a window) and generic ones (d 8, 111).
      {2, 4, 2, 37, 37, 64, true, 0, 2.0}, {1, 4, 1, 77, 77, 128, true, 0, 5.0}, {1, 2, 2, 100, 100, 64, true, 17, 50.0},
      {1, 2, 1, 130, 130, 64, false, 0, 5.0}, {1, 3, 1, 9, 9, 8, true, 0, 2.0}, {1, 2, 1, 33, 33, 111, true, 0, 5.0},
  };
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (const Case& c : cases)
      for (bool bshd : {false, true}) {
        if (bshd && c.d != 64) continue;
        check_case(k, c, dt, dev, gen, bshd);
      }
}

// Whether the Hopper paths can run here: a compute capability 9.0 GPU and a build with sm_90a.
bool hopper_here() {
  const PlatformInfo pl = detect_platform();
  return !pl.gpus.empty() && pl.gpus[0].cc_major == 9 && pl.gpus[0].cc_minor == 0 &&
         pl.cuda_archs_compiled.find("90a") != std::string::npos;
}

// Skips the current test where hopper_here() does not hold (no GPU, another compute capability, or a
// build without sm_90a).
#define KCPP_REQUIRE_HOPPER(dev)                                                                                  \
  do {                                                                                                            \
    KCPP_REQUIRE_DEVICE(dev);                                                                                     \
    if (!hopper_here()) GTEST_SKIP() << "skipped: needs a compute capability 9.0 GPU and a build with sm_90a"; \
  } while (0)

// For a scope's KCPP_FLASH_ATTN_* settings (the package reads them at each call).
using test::ScopedEnv;

// The Hopper forward (wgmma + TMA, sm_90a), required through KCPP_FLASH_ATTN_FORWARD=hopper so that a
// fallback to another path fails the call: lengths that are no multiple of its 128-row tiles (1, 127,
// 257, 4097), fewer queries than keys, grouped-query heads (32 / 8), causal or not, head_dim 64 / 128 / 256,
// bf16 / f16, the [B, S, H, D] layout, and more work items than SMs (the persistent blocks take
// several each); sliding windows.  The backward (the Hopper one on a Hopper GPU) consumes the lse it
// writes.
TEST(FlashAttnHopper, ForwardOnAwkwardLengths) {
  const Device dev = Device::cuda(0);
  KCPP_REQUIRE_HOPPER(dev);
  const ScopedEnv env("KCPP_FLASH_ATTN_FORWARD", "hopper");
  Generator gen = test::test_generator();
  const KernelLayer k = layer();
  const Case cases[] = {
      {2, 4, 1, 1, 1, 128, true, 0},      {1, 32, 8, 127, 127, 128, true, 0}, {1, 4, 2, 127, 300, 128, true, 0},
      {2, 2, 1, 257, 257, 128, false, 0}, {1, 2, 1, 129, 129, 64, true, 0},   {1, 2, 1, 4097, 4097, 64, true, 0},
      {1, 2, 2, 1, 200, 128, false, 0},
      // More work items (query tiles x heads) than an H100 or H200 has SMs: blocks loop over several.
      {8, 16, 4, 129, 129, 64, true, 0},  {8, 16, 4, 200, 333, 128, false, 0}, {150, 2, 1, 1, 1, 128, true, 0},
      // Head dim 256 (64-key tiles).
      {1, 4, 2, 127, 300, 256, true, 0},  {2, 2, 1, 200, 200, 256, false, 0},  {1, 2, 1, 129, 129, 256, true, 0},
      // Sliding windows: narrower than a tile, of one key, over several tiles with fewer queries than
      // keys, without the causal mask (then keys after the query count), at every head dim.
      {1, 4, 2, 300, 300, 128, true, 17}, {1, 2, 1, 200, 200, 128, true, 1},   {1, 2, 1, 129, 700, 64, true, 200},
      {2, 2, 1, 257, 257, 128, false, 100}, {1, 4, 2, 300, 300, 256, true, 65}, {1, 2, 1, 4097, 4097, 64, true, 1000},
      // Soft-capping at every head dim, with a window, without the causal mask, with fewer queries than keys.
      {1, 32, 8, 127, 127, 128, true, 0, 5.0}, {1, 4, 2, 127, 300, 256, true, 0, 50.0}, {1, 2, 1, 129, 129, 64, true, 0, 2.0},
      {2, 2, 1, 257, 257, 128, false, 100, 5.0}, {1, 4, 2, 300, 300, 256, true, 65, 5.0},
  };
  for (DType dt : {DType::bf16, DType::f16})
    for (const Case& c : cases)
      for (bool bshd : {false, true}) {
        if (bshd && c.sq > 1000) continue;
        if (dt == DType::f16 && c.sq > 1000) continue;
        check_case(k, c, dt, dev, gen, bshd);
      }
  // Head dim 64 on three consumer warpgroups (192-query items; the default from 2,048 queries, pinned
  // here for the short cases too: a last item of 1 to 191 rows, items past a warpgroup's rows) and on
  // two (the default below 2,048 queries, pinned for the long ones).
  for (const char* wgs : {"3", "2"}) {
    const ScopedEnv pin("KCPP_FLASH_ATTN_SM90_FWD_WGS", wgs);
    for (const Case& c : cases)
      if (c.d == 64) check_case(k, c, DType::bf16, dev, gen, false);
  }
}

// The Hopper backward (wgmma + TMA, sm_90a), required through KCPP_FLASH_ATTN_BACKWARD=hopper: head_dim
// 128, 64 and 256 (attention_sm90_bwd256.cu: 64-key blocks, the head dim split between the consumer
// warpgroups, dQ staged in the ring's slots), lengths that are no multiple of its 128-key (64-key) blocks
// or 64-query tiles (1, 63, 65, 127, 129, 190, 4097),
// fewer queries than keys (a KV cache), grouped-query heads (32 / 8, dk / dv summed over the group),
// causal or not, sliding windows, bf16 / f16, the [B, S, H, D] layout, more blocks than SMs.
TEST(FlashAttnHopper, BackwardOnAwkwardLengths) {
  const Device dev = Device::cuda(0);
  KCPP_REQUIRE_HOPPER(dev);
  const ScopedEnv env("KCPP_FLASH_ATTN_BACKWARD", "hopper");
  Generator gen = test::test_generator();
  const KernelLayer k = layer();
  const Case cases[] = {
      {2, 4, 1, 1, 1, 128, true, 0},       {1, 32, 8, 127, 127, 128, true, 0}, {1, 4, 2, 129, 129, 128, true, 0},
      {1, 4, 2, 127, 300, 128, true, 0},   {1, 2, 1, 64, 200, 128, true, 0},   {2, 2, 1, 257, 257, 128, false, 0},
      {1, 2, 2, 1, 200, 128, false, 0},    {1, 4, 1, 190, 190, 128, false, 0}, {8, 16, 4, 200, 333, 128, false, 0},
      {1, 2, 1, 4097, 4097, 128, true, 0},
      // Windows: within a query tile, of one key, across blocks with fewer queries than keys, non-causal.
      {1, 4, 2, 300, 300, 128, true, 17},  {1, 2, 1, 200, 200, 128, true, 1},  {1, 2, 1, 129, 700, 128, true, 200},
      {2, 2, 1, 257, 257, 128, false, 100}, {1, 2, 1, 4097, 4097, 128, true, 1000},
      // Head dim 64: query tiles of 128 (two sub-tiles of 64), each consumer warpgroup's dQ its own 64
      // queries; the second sub-tile wholly past the last query (1 and 257 queries) or partly (127), a KV cache.
      {2, 4, 1, 1, 1, 64, true, 0},        {1, 32, 8, 127, 127, 64, true, 0},  {1, 4, 2, 127, 300, 64, true, 0},
      {2, 2, 1, 257, 257, 64, false, 0},   {8, 16, 4, 200, 333, 64, false, 0}, {1, 2, 1, 4097, 4097, 64, true, 0},
      {1, 4, 2, 300, 300, 64, true, 17},   {2, 2, 1, 257, 257, 64, false, 100},
      // Soft-capping: head dims 128 and 64, grouped heads, a window, non-causal, a KV cache.
      {1, 32, 8, 127, 127, 128, true, 0, 5.0}, {1, 4, 2, 127, 300, 128, true, 0, 50.0}, {2, 2, 1, 257, 257, 128, false, 100, 2.0},
      {1, 4, 2, 300, 300, 64, true, 17, 5.0},  {8, 16, 4, 200, 333, 64, false, 0, 5.0},
      // Head dim 256: one key, one block and a part, a KV cache, grouped heads, non-causal, more blocks
      // than SMs, a long causal sequence, windows, soft-capping.
      {2, 4, 1, 1, 1, 256, true, 0},       {1, 8, 2, 65, 65, 256, true, 0},    {1, 4, 2, 63, 300, 256, true, 0},
      {2, 2, 1, 257, 257, 256, false, 0},  {8, 16, 4, 200, 333, 256, false, 0}, {1, 2, 1, 4097, 4097, 256, true, 0},
      {1, 4, 2, 300, 300, 256, true, 17},  {2, 2, 1, 257, 257, 256, false, 100}, {1, 4, 2, 127, 300, 256, true, 0, 50.0},
      {1, 4, 2, 300, 300, 256, true, 65, 5.0}, {2, 2, 1, 129, 129, 256, false, 0, 2.0},
  };
  for (DType dt : {DType::bf16, DType::f16})
    for (const Case& c : cases)
      for (bool bshd : {false, true}) {
        if (bshd && c.sq > 1000) continue;
        if (dt == DType::f16 && c.sq > 1000) continue;
        check_case(k, c, dt, dev, gen, bshd);
      }
  // The block orders (KCPP_FLASH_ATTN_SM90_BWD_ORDER), each pinned, in bf16; "3": groups of three
  // heads, the last one shorter where the heads are not a multiple of three (B 8 x 4 kv heads: 3 x 10 + 2).
  for (const char* order : {"keys", "heads", "grouped", "3"}) {
    const ScopedEnv by("KCPP_FLASH_ATTN_SM90_BWD_ORDER", order);
    for (const Case& c : cases)
      if (c.sq <= 1000) check_case(k, c, DType::bf16, dev, gen, false);
  }
  // Head dim 128's dQ added from registers (KCPP_FLASH_ATTN_SM90_BWD_DQ=red, a variant for measuring),
  // in both dtypes, the long case too (its rows past a tile's end within a sequence of 4097).
  {
    const ScopedEnv red("KCPP_FLASH_ATTN_SM90_BWD_DQ", "red");
    for (DType dt : {DType::bf16, DType::f16})
      for (const Case& c : cases)
        if (c.d == 128 && (dt == DType::bf16 || c.sq <= 1000)) check_case(k, c, dt, dev, gen, false);
  }
}

// out and dq 2-byte aligned with strides of D + 1 elements: the Hopper backward takes them (its tensor
// maps read q, k, v and dout only), and the passes around its kernel (delta, the accumulator's zeros,
// dq's rounding) run in their any-layout forms (the forward then runs on the generic path).
TEST(FlashAttnHopper, BackwardOnNarrowOutAndDq) {
  const Device dev = Device::cuda(0);
  KCPP_REQUIRE_HOPPER(dev);
  const ScopedEnv env("KCPP_FLASH_ATTN_BACKWARD", "hopper");
  Generator gen = test::test_generator();
  const KernelLayer k = layer();
  for (const Case& c : {Case{1, 4, 2, 127, 300, 128, true, 0}, Case{2, 2, 1, 257, 257, 64, false, 100},
                        Case{1, 4, 2, 63, 300, 256, true, 0}, Case{1, 4, 2, 300, 300, 128, true, 17, 5.0}})
    for (DType dt : {DType::bf16, DType::f16}) check_case(k, c, dt, dev, gen, false, true);
}

// Asking for a forward path that cannot take the call is refused in supports(), naming why.
TEST(FlashAttnHopper, RequiredPathIsRefusedWhereItCannotRun) {
  const Device dev = Device::cuda(0);
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer k = layer();
  const Tensor q = Tensor::randn({1, 2, 8, 64}, DType::bf16, dev, gen), kv = Tensor::randn({1, 1, 8, 64}, DType::bf16, dev, gen);
  const Tensor out = Tensor::empty(q.shape(), q.dtype(), dev);
  KernelArgs a;
  a.tensor("q", q).tensor("k", kv).tensor("v", kv).tensor("out", out).integer("window", 4);
  // f32 is on neither tensor-core forward: the generic kernel takes it, a required one is refused.
  const Tensor qf = q.to(DType::f32), kvf = kv.to(DType::f32), outf = Tensor::empty(q.shape(), DType::f32, dev);
  KernelArgs af;
  af.tensor("q", qf).tensor("k", kvf).tensor("v", kvf).tensor("out", outf);
  for (const char* path : {"hopper", "ampere"}) {
    const ScopedEnv env("KCPP_FLASH_ATTN_FORWARD", path);
    EXPECT_TRUE(k.supports(a, dev, test::kInference).ok()) << path;  // a window is on both
    EXPECT_TRUE(test::refused(k.supports(af, dev, test::kInference), KCPP_ERROR_UNSUPPORTED, "KCPP_FLASH_ATTN_FORWARD=")) << path;
  }
  {
    const ScopedEnv env("KCPP_FLASH_ATTN_FORWARD", "generic");
    EXPECT_TRUE(k.supports(af, dev, test::kInference).ok());
  }
  {
    const ScopedEnv env("KCPP_FLASH_ATTN_FORWARD", "fastest");
    EXPECT_TRUE(test::refused(k.supports(a, dev, test::kInference), KCPP_ERROR_UNSUPPORTED, "'fastest'"));
  }
  // The backward likewise (head dim 96 is on neither tensor-core backward), once the call has dout.
  const Tensor q96 = Tensor::randn({1, 2, 8, 96}, DType::bf16, dev, gen), kv96 = Tensor::randn({1, 1, 8, 96}, DType::bf16, dev, gen);
  const Tensor out96 = Tensor::empty(q96.shape(), q96.dtype(), dev), lse = Tensor::empty({1, 2, 8}, DType::f32, dev);
  const Tensor dq = Tensor::empty(q96.shape(), q96.dtype(), dev);
  const Tensor dk = Tensor::empty(kv96.shape(), kv96.dtype(), dev), dv = Tensor::empty(kv96.shape(), kv96.dtype(), dev);
  KernelArgs bw;
  bw.tensor("dout", out96).tensor("q", q96).tensor("k", kv96).tensor("v", kv96).tensor("out", out96).tensor("lse", lse);
  bw.tensor("dq", dq).tensor("dk", dk).tensor("dv", dv);
  for (const char* path : {"hopper", "ampere"}) {
    const ScopedEnv env("KCPP_FLASH_ATTN_BACKWARD", path);
    EXPECT_TRUE(test::refused(k.supports(bw, dev, test::kTraining), KCPP_ERROR_UNSUPPORTED, "KCPP_FLASH_ATTN_BACKWARD=")) << path;
    EXPECT_TRUE(k.supports(a, dev, test::kInference).ok());  // a forward call does not ask for the backward
  }
  {
    const ScopedEnv env("KCPP_FLASH_ATTN_BACKWARD", "generic");
    EXPECT_TRUE(k.supports(bw, dev, test::kTraining).ok());
  }
  // Head dim 64 in bf16 is on both.
  const Tensor lse64 = Tensor::empty({1, 2, 8}, DType::f32, dev), dq64 = Tensor::empty(q.shape(), q.dtype(), dev);
  const Tensor dk64 = Tensor::empty(kv.shape(), kv.dtype(), dev), dv64 = Tensor::empty(kv.shape(), kv.dtype(), dev);
  KernelArgs bw64;
  bw64.tensor("dout", out).tensor("q", q).tensor("k", kv).tensor("v", kv).tensor("out", out).tensor("lse", lse64);
  bw64.tensor("dq", dq64).tensor("dk", dk64).tensor("dv", dv64).integer("window", 4);
  for (const char* path : {"hopper", "ampere"}) {
    const ScopedEnv env("KCPP_FLASH_ATTN_BACKWARD", path);
    EXPECT_TRUE(k.supports(bw64, dev, test::kTraining).ok()) << path;
  }
  {
    const ScopedEnv env("KCPP_FLASH_ATTN_BACKWARD", "fastest");
    EXPECT_TRUE(test::refused(k.supports(bw, dev, test::kTraining), KCPP_ERROR_UNSUPPORTED, "'fastest'"));
  }
}

// Soft-capping on the mma.sync and generic CUDA paths, each pinned for both passes (on a Hopper GPU the
// automatic choice is the Hopper one, which the FlashAttnHopper tests hold).
TEST(FlashAttnCuda, SoftCappingOnThePinnedPaths) {
  const Device dev = Device::cuda(0);
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer k = layer();
  const Case cases[] = {
      {2, 4, 2, 37, 37, 64, true, 0, 2.0},    {1, 4, 1, 77, 77, 128, true, 0, 5.0},  {1, 2, 2, 100, 100, 64, true, 17, 50.0},
      {1, 2, 1, 130, 130, 64, false, 0, 5.0}, {2, 8, 2, 200, 200, 128, true, 0, 2.0}, {1, 2, 1, 3, 150, 64, false, 40, 5.0},
  };
  for (const char* path : {"ampere", "generic"}) {
    const ScopedEnv fwd("KCPP_FLASH_ATTN_FORWARD", path), bwd("KCPP_FLASH_ATTN_BACKWARD", path);
    for (DType dt : {DType::bf16, DType::f16})
      for (const Case& c : cases) check_case(k, c, dt, dev, gen, false);
  }
}

// A query that sees no key (a window of keys that all lie ahead of it cannot happen; here: no
// queries at all, and sequences of one) and empty batches run and write what the contract says.
TEST_P(FlashAttnPackage, EmptyShapes) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer k = layer();
  // No queries but 5 keys: out empty, dk and dv zero.
  const Case c{1, 2, 1, 0, 5, 64, true, 0};
  const Tensor q = make(1, 2, 0, 64, DType::bf16, dev, gen, false), kk = make(1, 1, 5, 64, DType::bf16, dev, gen, false);
  const Tensor v = make(1, 1, 5, 64, DType::bf16, dev, gen, false), dout = make(1, 2, 0, 64, DType::bf16, dev, gen, false);
  const Result r = run_both(k, q, kk, v, dout, c, dev);
  for (double x : r.dk.to_f64_vector()) ASSERT_EQ(x, 0.0);
  for (double x : r.dv.to_f64_vector()) ASSERT_EQ(x, 0.0);
}

TEST_P(FlashAttnPackage, BadInputIsRefusedNamingTheArgument) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer k = layer();
  const Tensor q = Tensor::randn({1, 4, 8, 64}, DType::bf16, dev, gen), kv = Tensor::randn({1, 2, 8, 64}, DType::bf16, dev, gen);
  const Tensor out = Tensor::empty(q.shape(), q.dtype(), dev);
  std::vector<std::unique_ptr<KernelArgs>> keep;
  auto args = [&](const Tensor& qq, const Tensor& kk, const Tensor& vv, const Tensor& oo) -> KernelArgs& {
    keep.push_back(std::make_unique<KernelArgs>());
    keep.back()->tensor("q", qq).tensor("k", kk).tensor("v", vv).tensor("out", oo);
    return *keep.back();
  };
  EXPECT_TRUE(k.supports(args(q, kv, kv, out), dev, test::kInference).ok());
  const Tensor k3 = Tensor::randn({1, 3, 8, 64}, DType::bf16, dev, gen);
  EXPECT_TRUE(test::refused(k.supports(args(q, k3, k3, out), dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT,
                            "not a multiple of 3 kv heads"));
  const Tensor kd = Tensor::randn({1, 2, 8, 32}, DType::bf16, dev, gen);
  EXPECT_TRUE(test::refused(k.supports(args(q, kd, kd, out), dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "'k'"));
  const Tensor kf = Tensor::randn({1, 2, 8, 64}, DType::f32, dev, gen);
  EXPECT_TRUE(test::refused(k.supports(args(q, kf, kv, out), dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "'k' is f32"));
  const Tensor ks = Tensor::randn({1, 2, 4, 64}, DType::bf16, dev, gen);
  EXPECT_TRUE(test::refused(k.supports(args(q, ks, ks, out), dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT,
                            "8 queries but only 4 keys"));
  const Tensor vs = Tensor::randn({1, 2, 9, 64}, DType::bf16, dev, gen);
  EXPECT_TRUE(test::refused(k.supports(args(q, kv, vs, out), dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "'v' has 9"));
  const Tensor strided_d = Tensor::randn({1, 2, 64, 8}, DType::bf16, dev, gen).transpose(2, 3);
  EXPECT_TRUE(test::refused(k.supports(args(q, strided_d, kv, out), dev, test::kInference), KCPP_ERROR_UNSUPPORTED,
                            "head_dim must be contiguous"));
  EXPECT_TRUE(test::refused(k.supports(args(q, kv, kv, q), dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT,
                            "'out' must not overlap"));
  KernelArgs& w = args(q, kv, kv, out);
  w.integer("window", -1);
  EXPECT_TRUE(test::refused(k.supports(w, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "'window'"));
  KernelArgs& s = args(q, kv, kv, out);
  s.real("scale", std::numeric_limits<double>::infinity());
  EXPECT_TRUE(test::refused(k.supports(s, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "'scale'"));
  for (double cap : {-1.0, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN(), 1e-40, 1e39}) {
    KernelArgs& c = args(q, kv, kv, out);
    c.real("softcap", cap);
    EXPECT_TRUE(test::refused(k.supports(c, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "'softcap'")) << cap;
  }
  // An argument the call does not read is refused naming it, not ignored: a misspelt one, and
  // max_seqlen_q without the cu_seqlens that give it a meaning.
  KernelArgs& typo = args(q, kv, kv, out);
  typo.real("softcapping", 50.0);
  EXPECT_TRUE(test::refused(k.supports(typo, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "'softcapping'"));
  KernelArgs& lone = args(q, kv, kv, out);
  lone.integer("max_seqlen_q", 8);
  EXPECT_TRUE(test::refused(k.supports(lone, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "'max_seqlen_q'"));
  KernelArgs& cs = args(q, kv, kv, out);  // scale / softcap beyond a float
  cs.real("scale", 1e30).real("softcap", 1e-20);
  EXPECT_TRUE(test::refused(k.supports(cs, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "overflows"));
  // Backward without lse.
  KernelArgs& b = args(q, kv, kv, out);
  const Tensor dq = Tensor::empty(q.shape(), q.dtype(), dev), dk = Tensor::empty(kv.shape(), kv.dtype(), dev),
               dv = Tensor::empty(kv.shape(), kv.dtype(), dev);
  b.tensor("dout", q).tensor("dq", dq).tensor("dk", dk).tensor("dv", dv);
  EXPECT_TRUE(test::refused(k.supports(b, dev, test::kTraining), KCPP_ERROR_INVALID_ARGUMENT, "'lse'"));
}

// ---- variable-length packed sequences (cu_seqlens) ------------------------------------------------

// A varlen case: each sequence's query and key counts (packed end to end), heads, head_dim, mask.
struct VarlenCase {
  std::vector<int64_t> lq, lk;
  int64_t hq, hkv, d;
  bool causal;
  int64_t window;
  double softcap = 0;
};

// int32 prefix sums [B + 1] on `dev`.
Tensor cu_seqlens(const std::vector<int64_t>& lens, Device dev, DType dt = DType::i32) {
  std::vector<int64_t> cu{0};
  for (int64_t n : lens) cu.push_back(cu.back() + n);
  return Tensor::from_i64(cu, {static_cast<int64_t>(cu.size())}, dt, dev);
}

int64_t max_of(const std::vector<int64_t>& v) {
  int64_t m = 0;
  for (int64_t x : v) m = std::max(m, x);
  return m;
}

// Tokens [begin, begin + n) of a packed [total, H, D] tensor as a batched [1, H, n, D] view.
Tensor batched_view(const Tensor& t, int64_t begin, int64_t n) { return t.narrow(0, begin, n).transpose(0, 1).unsqueeze(0); }

// Forward and backward through the package with cu_seqlens: out / dq [total_q, Hq, D], dk / dv
// [total_k, Hkv, D], lse [Hq, total_q].
Result run_varlen(const KernelLayer& k, const Tensor& q, const Tensor& kk, const Tensor& v, const Tensor& dout,
                  const VarlenCase& c, Device dev) {
  const Tensor cuq = cu_seqlens(c.lq, dev), cuk = cu_seqlens(c.lk, dev);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  Result r;
  r.out = Tensor::empty(q.shape(), q.dtype(), dev);
  r.lse = Tensor::empty({c.hq, q.size(0)}, DType::f32, dev);
  auto common = [&](KernelArgs& a) {
    a.tensor("q", q).tensor("k", kk).tensor("v", v).tensor("out", r.out).tensor("lse", r.lse);
    a.tensor("cu_seqlens_q", cuq).tensor("cu_seqlens_k", cuk);
    a.integer("max_seqlen_q", max_of(c.lq)).integer("max_seqlen_k", max_of(c.lk));
    a.real("scale", scale).integer("causal", c.causal ? 1 : 0).integer("window", c.window);
    if (c.softcap > 0) a.real("softcap", c.softcap);
  };
  KernelArgs f;
  common(f);
  const nn::KernelStatus st = k.supports(f, dev, test::kTraining);
  EXPECT_TRUE(st.ok()) << st.message;
  k.forward(f, dev, test::kTraining);
  r.dq = Tensor::empty(q.shape(), q.dtype(), dev);
  r.dk = Tensor::empty(kk.shape(), kk.dtype(), dev);
  r.dv = Tensor::empty(v.shape(), v.dtype(), dev);
  KernelArgs b;
  common(b);
  b.tensor("dout", dout).tensor("dq", r.dq).tensor("dk", r.dk).tensor("dv", r.dv);
  k.backward(b, dev, test::kTraining);
  return r;
}

// Runs a varlen case in `dt` and holds it to (1) the f64 oracle per sequence (out, dq, dk, dv within
// composite_rel_l2, lse within the batched test's bound; queries that see no key give 0 and -inf) and
// (2) each sequence run alone through the batched layout (the same kernels: identical results, up to the
// order of the CUDA backward's f32 atomics in dq).  On CUDA both run on one path: the one a test pinned
// through KCPP_FLASH_ATTN_FORWARD / _BACKWARD, else mma.sync (bf16 / f16 at head dim 64 / 128) or generic.
void check_varlen(const KernelLayer& k, const VarlenCase& c, DType dt, Device dev, Generator& gen) {
  std::unique_ptr<ScopedEnv> pin_fwd, pin_bwd;
  if (dev.is_cuda()) {
    const bool mma = dt != DType::f32 && (c.d == 64 || c.d == 128);  // aligned rows: the tensors are fresh
    if (!std::getenv("KCPP_FLASH_ATTN_FORWARD")) pin_fwd = std::make_unique<ScopedEnv>("KCPP_FLASH_ATTN_FORWARD", mma ? "ampere" : "generic");
    if (!std::getenv("KCPP_FLASH_ATTN_BACKWARD"))
      pin_bwd = std::make_unique<ScopedEnv>("KCPP_FLASH_ATTN_BACKWARD", mma ? "ampere" : "generic");
  }
  std::string lens;
  for (size_t b = 0; b < c.lq.size(); ++b) lens += fmt::format("{}{}/{}", b ? "," : "", c.lq[b], c.lk[b]);
  const std::string cfg = fmt::format("{} varlen q/k=[{}] hq={} hkv={} d={} causal={} window={} softcap={}",
                                      test::config_name(dev, dt), lens, c.hq, c.hkv, c.d, c.causal, c.window, c.softcap);
  int64_t tq = 0, tk = 0;
  for (size_t b = 0; b < c.lq.size(); ++b) tq += c.lq[b], tk += c.lk[b];
  const Tensor q = Tensor::randn({tq, c.hq, c.d}, dt, dev, gen), kk = Tensor::randn({tk, c.hkv, c.d}, dt, dev, gen);
  const Tensor v = Tensor::randn({tk, c.hkv, c.d}, dt, dev, gen), dout = Tensor::randn({tq, c.hq, c.d}, dt, dev, gen);
  const Result r = run_varlen(k, q, kk, v, dout, c, dev);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  const double ninf = -std::numeric_limits<double>::infinity();

  // (1) The oracle, sequence by sequence, scattered into the packed layout.
  oracle::V ref_out(static_cast<size_t>(tq * c.hq * c.d)), ref_dq(ref_out.size()), ref_dk(static_cast<size_t>(tk * c.hkv * c.d)),
      ref_dv(ref_dk.size()), ref_lse(static_cast<size_t>(c.hq * tq), ninf);
  const auto qv = q.to_f64_vector(), kv = kk.to_f64_vector();
  int64_t q0 = 0, k0 = 0;
  for (size_t b = 0; b < c.lq.size(); ++b) {
    const int64_t sq = c.lq[b], skv = c.lk[b];
    // The queries that see no key: the first sq - skv under causal (the queries end with the keys), all
    // of them without keys.  The oracle takes the rest (it needs a visible key per query).
    const int64_t skip = skv == 0 ? sq : c.causal ? std::max<int64_t>(0, sq - skv) : 0, n = sq - skip;
    if (n > 0) {
      const auto dv_seq = batched_view(dout, q0 + skip, n).to_f64_vector();
      const oracle::Attn o = oracle::attention(batched_view(q, q0 + skip, n).to_f64_vector(), batched_view(kk, k0, skv).to_f64_vector(),
                                               batched_view(v, k0, skv).to_f64_vector(), &dv_seq, 1, c.hq, c.hkv, n, skv, c.d,
                                               scale, c.causal, c.window, 0, c.softcap);
      for (int64_t h = 0; h < c.hq; ++h)
        for (int64_t i = 0; i < n; ++i)
          for (int64_t e = 0; e < c.d; ++e) {
            const size_t at = static_cast<size_t>(((q0 + skip + i) * c.hq + h) * c.d + e), from = static_cast<size_t>((h * n + i) * c.d + e);
            ref_out[at] = o.out[from], ref_dq[at] = o.dq[from];
          }
      for (int64_t h = 0; h < c.hkv; ++h)
        for (int64_t j = 0; j < skv; ++j)
          for (int64_t e = 0; e < c.d; ++e) {
            const size_t at = static_cast<size_t>(((k0 + j) * c.hkv + h) * c.d + e), from = static_cast<size_t>((h * skv + j) * c.d + e);
            ref_dk[at] = o.dk[from], ref_dv[at] = o.dv[from];
          }
    }
    // lse in f64 from the packed inputs.
    for (int64_t h = 0; h < c.hq; ++h)
      for (int64_t i = 0; i < sq; ++i) {
        const int64_t pos = i + skv - sq, hk = h / (c.hq / c.hkv);
        double mx = ninf, sum = 0;
        std::vector<double> sc;
        for (int64_t j = 0; j < skv; ++j) {
          if ((c.causal && j > pos) || (c.window > 0 && pos - j >= c.window)) continue;
          double x = 0;
          for (int64_t e = 0; e < c.d; ++e)
            x += qv[static_cast<size_t>(((q0 + i) * c.hq + h) * c.d + e)] * kv[static_cast<size_t>(((k0 + j) * c.hkv + hk) * c.d + e)];
          x *= scale;
          if (c.softcap > 0) x = c.softcap * std::tanh(x / c.softcap);
          sc.push_back(x), mx = std::max(mx, x);
        }
        for (double x : sc) sum += std::exp(x - mx);
        ref_lse[static_cast<size_t>(h * tq + q0 + i)] = sc.empty() ? ninf : mx + std::log(sum);
      }
    q0 += sq, k0 += skv;
  }
  const std::pair<const char*, std::pair<const Tensor*, const oracle::V*>> outs[] = {
      {"out", {&r.out, &ref_out}}, {"dq", {&r.dq, &ref_dq}}, {"dk", {&r.dk, &ref_dk}}, {"dv", {&r.dv, &ref_dv}}};
  for (const auto& [name, tr] : outs) {
    if (tr.first->numel() == 0) continue;
    double norm = 0;
    for (double x : *tr.second) norm += x * x;
    const auto got = tr.first->to_f64_vector();
    if (norm == 0) {  // all zero (no query sees a key): exactly
      for (double x : got) ASSERT_EQ(x, 0.0) << cfg << " " << name;
      continue;
    }
    EXPECT_LE(test::rel_l2_error(*tr.first, *tr.second), test::composite_rel_l2(dt)) << cfg << " " << name;
  }
  const auto lse = r.lse.to_f64_vector();
  double worst = 0;
  for (size_t i = 0; i < lse.size(); ++i) {
    if (ref_lse[i] == ninf) {
      EXPECT_EQ(lse[i], ninf) << cfg << " lse row " << i << " sees no key";
      continue;
    }
    worst = std::max(worst, std::abs(lse[i] - ref_lse[i]));
  }
  EXPECT_LE(worst, 1e-4 * std::sqrt(static_cast<double>(c.d))) << cfg << " lse";

  // (2) Each sequence alone in the batched layout ([1, H, S, D] views of the packed tensors), where the
  // batched layout takes it (queries no more than keys), on the path pinned above.
  q0 = 0, k0 = 0;
  for (size_t b = 0; b < c.lq.size(); q0 += c.lq[b], k0 += c.lk[b], ++b) {
    const int64_t sq = c.lq[b], skv = c.lk[b];
    if (sq > skv || skv == 0) continue;
    const Case one{1, c.hq, c.hkv, sq, skv, c.d, c.causal, c.window, c.softcap};
    const Result a = run_both(k, batched_view(q, q0, sq), batched_view(kk, k0, skv), batched_view(v, k0, skv),
                              batched_view(dout, q0, sq), one, dev);
    const std::string where = fmt::format("{} sequence {} against the batched layout", cfg, b);
    EXPECT_EQ(a.out.to_f64_vector(), batched_view(r.out, q0, sq).to_f64_vector()) << where << " out";
    EXPECT_EQ(a.lse.to_f64_vector(), r.lse.narrow(1, q0, sq).unsqueeze(0).to_f64_vector()) << where << " lse";
    EXPECT_EQ(a.dk.to_f64_vector(), batched_view(r.dk, k0, skv).to_f64_vector()) << where << " dk";
    EXPECT_EQ(a.dv.to_f64_vector(), batched_view(r.dv, k0, skv).to_f64_vector()) << where << " dv";
    const Tensor dq = batched_view(r.dq, q0, sq);
    if (dev.is_cuda() && sq > 0)
      EXPECT_LE(test::rel_l2_error(dq, a.dq.to_f64_vector()), test::composite_rel_l2(dt) / 4) << where << " dq";
    else
      EXPECT_EQ(a.dq.to_f64_vector(), dq.to_f64_vector()) << where << " dq";
  }
}

// Lengths 0, 1, 7, 129 (no multiple of any tile), unequal query and key counts (fewer queries: a
// prefix of keys; more queries: the first ones see no key under causal), grouped-query heads, causal or
// not, sliding windows, no keys at all (max_seqlen_k 0: out and dq zero, lse -inf), head_dim 64 / 128
// (the tensor-core kernels on CUDA for bf16 / f16) and 8 / 40 (the generic ones), f32 / bf16 / f16.
TEST_P(FlashAttnPackage, VarlenMatchesTheOracleAndTheBatchedLayout) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer k = layer();
  const VarlenCase cases[] = {
      {{7, 0, 1, 129, 33}, {7, 0, 1, 129, 33}, 4, 2, 64, true, 0},
      {{1, 7, 129, 0, 70}, {5, 7, 200, 3, 64}, 2, 1, 128, true, 0},
      {{129, 1, 70}, {129, 1, 70}, 2, 2, 64, true, 17},
      {{3, 129, 7}, {150, 129, 0}, 4, 1, 64, false, 40},
      {{9, 0, 20, 1}, {9, 4, 20, 1}, 3, 1, 8, true, 0},
      {{5, 3, 66}, {2, 0, 130}, 2, 1, 40, true, 0},
      {{5, 65}, {2, 64}, 2, 2, 64, true, 0},
      {{4, 7}, {2, 7}, 2, 1, 64, false, 0},
      {{3, 2}, {0, 0}, 2, 1, 64, true, 0},
      {{1, 4}, {0, 0}, 2, 2, 8, false, 0},
      {{7, 0, 1, 129, 33}, {7, 0, 1, 129, 33}, 4, 2, 64, true, 17, 2.0},  // soft-capping
      {{9, 0, 20, 1}, {9, 4, 20, 1}, 3, 1, 8, true, 0, 2.0},
  };
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (const VarlenCase& c : cases) check_varlen(k, c, dt, dev, gen);
}

// On CUDA the generic kernels (forced) take varlen in 16-bit too.
TEST(FlashAttnVarlen, GenericCudaKernels) {
  const Device dev = Device::cuda(0);
  KCPP_REQUIRE_DEVICE(dev);
  const ScopedEnv fwd("KCPP_FLASH_ATTN_FORWARD", "generic"), bwd("KCPP_FLASH_ATTN_BACKWARD", "generic");
  Generator gen = test::test_generator();
  const KernelLayer k = layer();
  const VarlenCase c{{7, 0, 1, 129, 33}, {7, 0, 1, 200, 33}, 4, 2, 64, true, 0};
  // check_varlen keeps this pin for its batched comparison too.
  for (DType dt : {DType::bf16, DType::f16}) check_varlen(k, c, dt, dev, gen);
}

// The Hopper paths (required through the environment, so that a fallback fails the call) on varlen:
// lengths 0, 1, 7 and others no multiple of the 128-row tiles, a sequence's last query tile ending
// inside the next sequence (its rows must not be written), fewer queries than keys and more (the first
// see no key under causal), sequences without keys and with no keys at all, grouped-query heads (32 /
// 8), causal or not, 300 short sequences (many work items without rows), bf16 / f16, the backward's
// three block orders; sliding windows; head dims 64 and 256.
TEST(FlashAttnHopper, VarlenOnAwkwardLengths) {
  const Device dev = Device::cuda(0);
  KCPP_REQUIRE_HOPPER(dev);
  Generator gen = test::test_generator();
  const KernelLayer k = layer();
  std::vector<int64_t> many;  // 300 sequences of 1 to 40 tokens
  for (int i = 0; i < 300; ++i) many.push_back(1 + (i * 37) % 40);
  const VarlenCase both[] = {
      {{7, 0, 1, 129, 33}, {7, 0, 1, 129, 33}, 4, 2, 128, true, 0},
      {{1, 7, 129, 0, 70}, {5, 7, 200, 3, 64}, 2, 1, 128, true, 0},
      {{3, 129, 7}, {150, 129, 0}, 4, 1, 128, false, 0},
      {{300, 65, 1000}, {300, 65, 1000}, 32, 8, 128, true, 0},
      {{5, 65}, {2, 64}, 2, 2, 128, true, 0},
      {{200, 70}, {130, 190}, 2, 1, 128, false, 0},
      {{3, 2}, {0, 0}, 2, 1, 128, true, 0},
      {many, many, 4, 2, 128, true, 0},
      // Sliding windows: narrower than a tile, non-causal, and across tiles with a 32 / 8 head group.
      {{7, 0, 1, 129, 33}, {7, 0, 1, 129, 33}, 4, 2, 128, true, 5},
      {{200, 70}, {130, 190}, 2, 1, 128, false, 50},
      {{300, 65, 1000}, {300, 65, 1000}, 32, 8, 128, true, 257},
      // Head dim 64.
      {{7, 0, 1, 129, 33}, {7, 0, 1, 129, 33}, 4, 2, 64, true, 0},
      {{300, 65}, {300, 100}, 2, 1, 64, false, 0},
      {{300, 65}, {300, 100}, 2, 1, 64, true, 70},
      // Soft-capping.
      {{7, 0, 1, 129, 33}, {7, 0, 1, 129, 33}, 4, 2, 128, true, 0, 2.0},
      {{300, 65}, {300, 100}, 2, 1, 64, true, 70, 5.0},
      // Head dim 256.
      {{1, 7, 129, 0, 70}, {5, 7, 200, 3, 64}, 2, 1, 256, true, 0},
      {{130, 3}, {130, 3}, 2, 2, 256, true, 0, 50.0},
      {{130, 3}, {130, 3}, 2, 2, 256, false, 0},
      {{1, 7, 129, 0, 70}, {5, 7, 200, 3, 64}, 2, 1, 256, true, 33},
  };
  for (DType dt : {DType::bf16, DType::f16}) {
    for (const char* order : {"keys", "heads", "grouped", "3"}) {  // the backward's block orders
      const ScopedEnv fwd("KCPP_FLASH_ATTN_FORWARD", "hopper"), bwd("KCPP_FLASH_ATTN_BACKWARD", "hopper");
      const ScopedEnv by("KCPP_FLASH_ATTN_SM90_BWD_ORDER", order);
      for (const VarlenCase& c : both) check_varlen(k, c, dt, dev, gen);
    }
  }
  // Head dim 128's dQ added from registers (KCPP_FLASH_ATTN_SM90_BWD_DQ=red, a variant for measuring):
  // the packed rows (a plane a head, the sequence's first query), rows past a sequence left out.
  const ScopedEnv fwd("KCPP_FLASH_ATTN_FORWARD", "hopper"), bwd("KCPP_FLASH_ATTN_BACKWARD", "hopper");
  const ScopedEnv red("KCPP_FLASH_ATTN_SM90_BWD_DQ", "red");
  for (const VarlenCase& c : both)
    if (c.d == 128) check_varlen(k, c, DType::bf16, dev, gen);
}

// max_seqlen_q / max_seqlen_k are bounds: any value at least the longest sequence gives the same
// result, also one beyond the token count (which sizes nothing: the package takes the token count).
TEST(FlashAttnVarlen, MaxSeqlenAboveTheLongestChangesNothing) {
  const Device dev = Device::cpu();
  Generator gen = test::test_generator();
  const KernelLayer k = layer();
  const std::vector<int64_t> lens{5, 0, 12};
  const Tensor q = Tensor::randn({17, 4, 16}, DType::f32, dev, gen), kv = Tensor::randn({17, 2, 16}, DType::f32, dev, gen);
  const Tensor cu = cu_seqlens(lens, dev);
  std::vector<std::vector<double>> outs, lses;
  for (int64_t max : {int64_t{12}, int64_t{17}, int64_t{1} << 40}) {
    const Tensor out = Tensor::empty(q.shape(), q.dtype(), dev), lse = Tensor::empty({4, 17}, DType::f32, dev);
    KernelArgs a;
    a.tensor("q", q).tensor("k", kv).tensor("v", kv).tensor("out", out).tensor("lse", lse);
    a.tensor("cu_seqlens_q", cu).tensor("cu_seqlens_k", cu).integer("max_seqlen_q", max).integer("max_seqlen_k", max);
    ASSERT_TRUE(k.supports(a, dev, test::kTraining).ok());
    k.forward(a, dev, test::kTraining);
    outs.push_back(out.to_f64_vector()), lses.push_back(lse.to_f64_vector());
  }
  for (size_t i = 1; i < outs.size(); ++i) {
    EXPECT_EQ(outs[i], outs[0]) << "run " << i;
    EXPECT_EQ(lses[i], lses[0]) << "run " << i;
  }
}

// A call as a host describes it to supports() without memory (kcpp.torch's probes): every tensor
// argument's DLTensor copied onto `device` with a data pointer that points at nothing.
struct Described {
  std::vector<kcpp_arg> args;
  std::deque<DLTensor> tensors;
};

Described described(const KernelArgs& a, DLDevice device) {
  Described d;
  uintptr_t fake = uintptr_t{1} << 44;  // aligned, distinct per tensor, mapped nowhere
  for (int32_t i = 0; i < a.size(); ++i) {
    kcpp_arg x = a.data()[i];
    if (x.kind == KCPP_ARG_TENSOR) {
      DLTensor t = *x.value.tensor;
      t.device = device, t.data = reinterpret_cast<void*>(fake), t.byte_offset = 0;
      fake += uintptr_t{1} << 36;
      d.tensors.push_back(t);
      x.value.tensor = &d.tensors.back();
    }
    d.args.push_back(x);
  }
  return d;
}

// Calls an entry point of the package's table directly, on `device`, with no stream, workspace or
// device guard (nothing that needs a GPU).
nn::KernelStatus call_described(kcpp_entry_fn fn, const Described& d, DLDevice device, uint32_t mode) {
  char error[1024] = {};
  kcpp_context ctx{};
  ctx.struct_size = sizeof ctx, ctx.mode = mode, ctx.device = device, ctx.deterministic = 1;
  ctx.error = error, ctx.error_size = sizeof error;
  nn::KernelStatus s;
  s.status = fn(&ctx, d.args.data(), static_cast<int32_t>(d.args.size()));
  if (s.status != KCPP_OK) s.message = error;
  return s;
}

// supports() decides varlen from the tensors' descriptions, never reading the cu_seqlens: over tensors
// with no memory behind them it answers yes, on the CPU and on CUDA (described: no GPU needed; the
// CUDA variant's paths are chosen without a device), and bad contents pass it (the call refuses them,
// VarlenBadInputIsRefusedNamingTheArgument); a call that breaks the contract is an invalid argument.
TEST(FlashAttnVarlen, SupportsReadsNoMemory) {
  const Device dev = Device::cpu();
  Generator gen = test::test_generator();
  const KernelLayer k = layer();
  const kcpp_layer& table = k.info();
  const Tensor q = Tensor::randn({10, 4, 64}, DType::bf16, dev, gen), kv = Tensor::randn({12, 2, 64}, DType::bf16, dev, gen);
  const Tensor out = Tensor::empty(q.shape(), q.dtype(), dev), lse = Tensor::empty({4, 10}, DType::f32, dev);
  const Tensor dq = Tensor::empty(q.shape(), q.dtype(), dev), dk = Tensor::empty(kv.shape(), kv.dtype(), dev),
               dv = Tensor::empty(kv.shape(), kv.dtype(), dev);
  const Tensor cuq = cu_seqlens({3, 7}, dev), cuk = cu_seqlens({5, 7}, dev), cu64 = cu_seqlens({3, 7}, dev, DType::i64);
  auto fwd = [&](KernelArgs& a, const Tensor& cq) {
    a.tensor("q", q).tensor("k", kv).tensor("v", kv).tensor("out", out).tensor("lse", lse);
    a.tensor("cu_seqlens_q", cq).tensor("cu_seqlens_k", cuk).integer("max_seqlen_q", 7).integer("max_seqlen_k", 7);
  };
  KernelArgs f, b, bad;
  fwd(f, cuq);
  fwd(b, cuq);
  b.tensor("dout", out).tensor("dq", dq).tensor("dk", dk).tensor("dv", dv);
  fwd(bad, cu64);
  const DLDevice cpu{kDLCPU, 0}, cuda{kDLCUDA, 0};

  // The CPU: the answer comes from the shapes alone (a read of the fake pointers would crash here).
  EXPECT_TRUE(call_described(table.supports, described(f, cpu), cpu, test::kTraining).ok());
  EXPECT_TRUE(call_described(table.supports, described(b, cpu), cpu, test::kTraining).ok());
  EXPECT_TRUE(test::refused(call_described(table.supports, described(bad, cpu), cpu, test::kTraining),
                            KCPP_ERROR_INVALID_ARGUMENT, "'cu_seqlens_q' must be i32, is i64"));

  // CUDA: the build's CUDA variant of the package, loaded from its file whether or not a GPU is here.
  std::filesystem::path variant;
  for (const auto& e : std::filesystem::directory_iterator(test::built_package_dir("flash_attn") / "build"))
    if (e.path().filename().string().starts_with("kcpp1-cu")) variant = e.path() / "libflash_attn.so";
  if (variant.empty()) GTEST_SKIP() << "skipped: a build without CUDA";
  const auto cuda_package = hub::LoadedPackage::open_file(variant);
  const kcpp_layer& cuda_table = *cuda_package->layer("FlashAttention");
  ASSERT_NE(cuda_table.devices & KCPP_DEVICE_BIT(kDLCUDA), 0u);
  for (const auto* a : {&f, &b}) {
    const Described d = described(*a, cuda);
    const bool backward = a == &b;
    const nn::KernelStatus st = call_described(cuda_table.supports, d, cuda, test::kTraining);
    EXPECT_TRUE(st.ok()) << (backward ? "backward: " : "forward: ") << st.message;
    // The CUDA variant takes the same call on the CPU.
    EXPECT_TRUE(call_described(cuda_table.supports, described(*a, cpu), cpu, test::kTraining).ok());
  }
  EXPECT_TRUE(test::refused(call_described(cuda_table.supports, described(bad, cuda), cuda, test::kTraining),
                            KCPP_ERROR_INVALID_ARGUMENT, "'cu_seqlens_q' must be i32, is i64"));
}

// Arguments that break the contract: named invalid arguments from supports() (their descriptions) on
// every device; bad cu_seqlens contents (read only by the call) from the CPU forward and backward.
TEST_P(FlashAttnPackage, VarlenBadInputIsRefusedNamingTheArgument) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer k = layer();
  const Tensor q = Tensor::randn({10, 4, 64}, DType::bf16, dev, gen), kv = Tensor::randn({12, 2, 64}, DType::bf16, dev, gen);
  const Tensor out = Tensor::empty(q.shape(), q.dtype(), dev);
  const Tensor cuq = cu_seqlens({3, 7}, dev), cuk = cu_seqlens({5, 7}, dev);
  std::vector<std::unique_ptr<KernelArgs>> keep;
  auto args = [&](const Tensor& cq, const Tensor& ck, int64_t mq = 7, int64_t mk = 7) -> KernelArgs& {
    keep.push_back(std::make_unique<KernelArgs>());
    keep.back()->tensor("q", q).tensor("k", kv).tensor("v", kv).tensor("out", out);
    if (cq.defined()) keep.back()->tensor("cu_seqlens_q", cq);
    if (ck.defined()) keep.back()->tensor("cu_seqlens_k", ck);
    if (mq >= -1) keep.back()->integer("max_seqlen_q", mq);
    keep.back()->integer("max_seqlen_k", mk);
    return *keep.back();
  };
  const auto bad = KCPP_ERROR_INVALID_ARGUMENT;
  EXPECT_TRUE(k.supports(args(cuq, cuk), dev, test::kInference).ok());
  EXPECT_TRUE(test::refused(k.supports(args(cuq, Tensor()), dev, test::kInference), bad, "without 'cu_seqlens_k'"));
  EXPECT_TRUE(test::refused(k.supports(args(Tensor(), cuk), dev, test::kInference), bad, "without 'cu_seqlens_q'"));
  EXPECT_TRUE(test::refused(k.supports(args(cu_seqlens({3, 7}, dev, DType::i64), cuk), dev, test::kInference), bad,
                            "'cu_seqlens_q' must be i32, is i64"));
  EXPECT_TRUE(test::refused(k.supports(args(cuq, cu_seqlens({5, 7}, dev, DType::f32)), dev, test::kInference), bad,
                            "'cu_seqlens_k' must be i32, is f32"));
  EXPECT_TRUE(test::refused(k.supports(args(cuq, cu_seqlens({12}, dev)), dev, test::kInference), bad, "'cu_seqlens_k' has 2 entries"));
  const Tensor cu2d = Tensor::from_i64(std::vector<int64_t>{0, 3, 10, 0}, {2, 2}, DType::i32, dev);
  EXPECT_TRUE(test::refused(k.supports(args(cu2d, cuk), dev, test::kInference), bad, "'cu_seqlens_q' must be [batch + 1]"));
  EXPECT_TRUE(test::refused(k.supports(args(cuq, cuk, -2), dev, test::kInference), bad, "missing integer argument 'max_seqlen_q'"));
  EXPECT_TRUE(test::refused(k.supports(args(cuq, cuk, 7, -1), dev, test::kInference), bad, "'max_seqlen_k' is -1"));
  // Batched tensors with cu_seqlens.
  const Tensor q4 = Tensor::randn({1, 4, 10, 64}, DType::bf16, dev, gen);
  KernelArgs four;
  four.tensor("q", q4).tensor("k", kv).tensor("v", kv).tensor("out", out).tensor("cu_seqlens_q", cuq).tensor("cu_seqlens_k", cuk);
  four.integer("max_seqlen_q", 7).integer("max_seqlen_k", 7);
  EXPECT_TRUE(test::refused(k.supports(four, dev, test::kInference), bad, "'q' must have 3 dims"));
  // lse in the packed layout [Hq, total_q], not the batched one nor transposed.
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{2, 4, 7}, std::vector<int64_t>{10, 4}}) {
    KernelArgs& l = args(cuq, cuk);
    l.tensor("lse", Tensor::empty(shape, DType::f32, dev));
    EXPECT_TRUE(test::refused(k.supports(l, dev, test::kInference), bad, "'lse' must be [4, 10]"));
  }
  if (dev.is_cuda()) return;  // the contents of cu_seqlens stay on the device there (the contract)

  // The contents: supports() does not read them (it answers from the descriptions); the call refuses them.
  auto call_fails = [&](KernelArgs& a, const std::string& needle) {
    EXPECT_TRUE(k.supports(a, dev, test::kInference).ok()) << needle;
    try {
      k.forward(a, dev, test::kInference);
      ADD_FAILURE() << "a forward with bad cu_seqlens ran (expected: " << needle << ")";
    } catch (const std::exception& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("(invalid argument)"), std::string::npos) << what;
      EXPECT_NE(what.find(needle), std::string::npos) << what;
    }
  };
  const Tensor cu_down = Tensor::from_i64(std::vector<int64_t>{0, 8, 3, 10}, {4}, DType::i32, dev), cuk3 = cu_seqlens({5, 0, 7}, dev);
  call_fails(args(cu_down, cuk3, 8), "cu_seqlens_q decreases (entry 1 is 8, entry 2 is 3)");
  call_fails(args(cuq, cu_seqlens({5, 6}, dev)), "the last entry of cu_seqlens_k is 11 but the tensors hold 12 tokens");
  call_fails(args(cu_seqlens({3, 8}, dev), cuk, 8), "the last entry of cu_seqlens_q is 11 but the tensors hold 10 tokens");
  call_fails(args(Tensor::from_i64(std::vector<int64_t>{1, 3, 10}, {3}, DType::i32, dev), cuk), "cu_seqlens_q[0] is 1");
  call_fails(args(Tensor::from_i64(std::vector<int64_t>{0, -5, 10}, {3}, DType::i32, dev), cuk), "cu_seqlens_q decreases");
  call_fails(args(cuq, cuk, 6), "sequence 1 has 7 tokens in cu_seqlens_q, more than max_seqlen_q = 6");
  // The backward checks them likewise.
  const Tensor lse = Tensor::empty({4, 10}, DType::f32, dev), dq = Tensor::empty(q.shape(), q.dtype(), dev);
  const Tensor dk = Tensor::empty(kv.shape(), kv.dtype(), dev), dv = Tensor::empty(kv.shape(), kv.dtype(), dev);
  KernelArgs& bw = args(cuq, cu_seqlens({5, 6}, dev));
  bw.tensor("lse", lse).tensor("dout", out).tensor("dq", dq).tensor("dk", dk).tensor("dv", dv);
  try {
    k.backward(bw, dev, test::kTraining);
    ADD_FAILURE() << "a backward with bad cu_seqlens ran";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("the last entry of cu_seqlens_k is 11"), std::string::npos) << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, FlashAttnPackage, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cuda() ? std::string("cuda") : std::string("cpu"); });

}  // namespace
}  // namespace kcpp
