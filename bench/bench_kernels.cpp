// GPU benchmark of the kernel packages against the eager reference, at the Llama-3-8B shapes that
// the anchors use (bench/RESULTS.md; so the figures sit beside eager PyTorch, torch.compile and
// Liger measured in the same call).  Bytes are counted as anchors.py counts them; bandwidth is
// quoted against the device copy bandwidth measured in this same process.  Peak memory is the
// allocator's peak during one call minus what was allocated before it (outputs and gradients
// included, inputs excluded), as anchors.py measures torch's.
//
// Run: build/release/bin/kcpp_bench_kernels [--json FILE] [--only SECTION[,SECTION...]] [--sweep]
// Sections: rms_norm layer_norm swiglu rope cross_entropy activation flce attention decode_attention
// gemv decode_fused embedding prefill (gemv runs decode_fused too).
// KCPP_TIMING_FLUSH=clean times with a clean L2 instead of do_bench's dirty one (core/timing.h).
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <tuple>
#include <utility>

#include "core/allocator.h"
#include "core/cuda_runtime.h"
#include "core/random.h"
#include "core/timing.h"
#include "ops/nn/cross_entropy.h"
#include "ops/nn/rms_norm.h"
#include "ops/nn/rope.h"
#include "ops/cuda/launch.h"
#include "ops/ops.h"
#include <vector>
#include "kernel_params.h"
#include "rms_norm/rms_norm.h"
#include "rms_norm/rms_norm_tuning.h"
#include "layer_norm/layer_norm.h"
#include "fused_linear_ce/fused_linear_ce.h"
#include "ops/nn/layer_norm.h"
#include "glu/glu_tuning.h"
#include "rope/rope_tuning.h"
#include "cross_entropy/cross_entropy_tuning.h"
#include "activation_kernels.h"
#include "attention.h"
#include "ops/nn/attention.h"
#include "ops/nn/decode_attention.h"
#include "ops/nn/decode_fused.h"
#include "built_packages.h"
#include "nn/kernel_call.h"

namespace {
using namespace kcpp;

const Device kDev = Device::cuda(0);
nlohmann::json g_rows = nlohmann::json::array();
double g_copy_gbps = 0;

double peak_mib(const std::function<void()>& fn) {
  synchronize(kDev);
  Allocator& a = allocator_for(kDev);
  const size_t base = a.stats().current;
  a.reset_peak();
  fn();
  synchronize(kDev);
  return static_cast<double>(a.stats().peak - base) / (1 << 20);
}

void row(const std::string& op, const std::string& impl, const std::function<void()>& fn, double gbytes) {
  const Timing t = time_op(kDev, fn, 10, 50);
  const double mib = peak_mib(fn);
  const double gbps = gbytes / (t.median_ms * 1e-3);
  std::printf("%-24s %-10s %9.4f ms %8.0f GB/s %5.1f%% of copy  peak %8.1f MiB\n", op.c_str(), impl.c_str(),
              t.median_ms, gbps, 100 * gbps / g_copy_gbps, mib);
  g_rows.push_back({{"op", op}, {"impl", impl}, {"ms", t.median_ms}, {"min_ms", t.min_ms}, {"GBps", gbps},
                    {"pct_copy", 100 * gbps / g_copy_gbps}, {"peak_MiB", mib}});
}

void check(const char* err) {
  if (err) throw Error(err);
}

void bench_copy() {
  const CopyCeiling c = measure_copy(kDev, size_t{2} << 30, 30);
  g_copy_gbps = c.gbps;
  std::printf("%-24s %-10s %9.4f ms %8.0f GB/s\n", "copy d2d 2GiB", "cuda", c.timing.median_ms, g_copy_gbps);
  g_rows.push_back({{"op", "copy d2d 2GiB"}, {"impl", "cuda"}, {"ms", c.timing.median_ms}, {"GBps", g_copy_gbps}});
  // Copies the size of the kernels' traffic, timed the same way (L2 flushed before each run): what a
  // kernel moving that many bytes can reach with this timer.  RMSNorm forward at [8192, 4096] bf16
  // reads 64 MiB and writes 64 MiB, as the 64 MiB copy does.
  for (size_t mib : {64, 80, 128, 256}) {  // 80: RoPE's q and k at the anchors' shape
    const CopyCeiling s = measure_copy(kDev, mib << 20, 50);
    const std::string op = fmt::format("copy d2d {}MiB", mib);
    std::printf("%-24s %-10s %9.4f ms %8.0f GB/s %5.1f%% of copy\n", op.c_str(), "cuda", s.timing.median_ms, s.gbps,
                100 * s.gbps / g_copy_gbps);
    g_rows.push_back({{"op", op}, {"impl", "cuda"}, {"ms", s.timing.median_ms}, {"GBps", s.gbps},
                      {"pct_copy", 100 * s.gbps / g_copy_gbps}});
  }
}

void bench_rms_norm() {
  const int64_t bt = 8192, h = 4096;
  Generator gen(7);
  const Tensor x = Tensor::randn({bt, h}, DType::bf16, kDev, gen), w = Tensor::randn({h}, DType::bf16, kDev, gen);
  const Tensor dy = Tensor::randn({bt, h}, DType::bf16, kDev, gen);
  const double fb = 2.0 * bt * h * 2 / 1e9, bb = 3.0 * bt * h * 2 / 1e9;  // anchors.py's byte counts
  const ops::RMSNormOptions opt;

  row("rmsnorm fwd", "reference", [&] { ops::rms_norm_forward(x, w, opt); }, fb);
  row("rmsnorm fwd+bwd", "reference", [&] {
    const auto f = ops::rms_norm_forward(x, w, opt);
    ops::rms_norm_backward(dy, x, w, f.rstd, opt);
  }, fb + bb);

  // Outputs and workspace allocated inside each timed call, as a framework would (cached blocks).
  auto fresh = [&](bool backward) {
    // The forward allocates y and rstd only; the backward also dx, dw and the workspace.
    const test::RMSNormTensors t =
        backward ? test::rms_norm_tensors(x, w, dy)
                 : test::RMSNormTensors{x, w, Tensor::empty({bt, h}, DType::bf16, kDev), Tensor::empty({bt}, DType::f32, kDev)};
    liger::RMSNormParams q = test::rms_norm_params(t, opt);
    Tensor ws;
    if (backward) {
      ws = Tensor::empty({static_cast<int64_t>(liger::rms_norm_backward_workspace(q, 0))}, DType::u8, kDev);
      q.workspace = ws.data();
    }
    return std::make_tuple(t, q, ws);
  };
  row("rmsnorm fwd", "kcpp", [&] {
    auto [t, q, ws] = fresh(false);
    check(liger::rms_norm_forward_cuda(q, cuda::current_stream()));
  }, fb);
  row("rmsnorm fwd+bwd", "kcpp", [&] {
    auto [t, q, ws] = fresh(true);
    check(liger::rms_norm_forward_cuda(q, cuda::current_stream()));
    check(liger::rms_norm_backward_cuda(q, cuda::current_stream()));
  }, fb + bb);
  {  // AddRMSNorm (the residual fused in): forward reads x and residual, writes r and y (4 units of
     // N x H x 2 B); backward reads dy, dresidual_out and r, writes dx (4 units).  residual_out is
     // written over the residual, as a decoder updates its residual stream.
    const Tensor res = Tensor::randn({bt, h}, DType::bf16, kDev, gen), dres = Tensor::randn({bt, h}, DType::bf16, kDev, gen);
    const double unit = double(bt) * h * 2 / 1e9;
    row("addrmsnorm fwd", "reference", [&] { ops::rms_norm_forward(ops::add(x, res), w, opt); }, 4 * unit);
    row("addrmsnorm fwd+bwd", "reference", [&] {
      const Tensor r = ops::add(x, res);
      const auto f = ops::rms_norm_forward(r, w, opt);
      ops::add(ops::rms_norm_backward(dy, r, w, f.rstd, opt).dx, dres);
    }, 8 * unit);
    const Tensor res_io = res.clone();
    auto add_fwd = [&](const Tensor& y, const Tensor& rstd) {
      liger::RMSNormParams q = test::rms_norm_params({x, w, y, rstd, {}, {}, {}}, opt);
      q.residual = res_io.data(), q.residual_stride = h;
      q.residual_out = res_io.data(), q.residual_out_stride = h;
      check(liger::rms_norm_forward_cuda(q, cuda::current_stream()));
    };
    row("addrmsnorm fwd", "kcpp", [&] {
      add_fwd(Tensor::empty({bt, h}, DType::bf16, kDev), Tensor::empty({bt}, DType::f32, kDev));
    }, 4 * unit);
    row("addrmsnorm fwd+bwd", "kcpp", [&] {
      const Tensor rstd = Tensor::empty({bt}, DType::f32, kDev);
      add_fwd(Tensor::empty({bt, h}, DType::bf16, kDev), rstd);
      const Tensor dx = Tensor::empty({bt, h}, DType::bf16, kDev), dw = Tensor::empty({h}, DType::bf16, kDev);
      liger::RMSNormParams q = test::rms_norm_params({res_io, w, {}, rstd, dy, dx, dw}, opt);
      q.dresidual_out = dres.data(), q.dres_stride = h;
      const Tensor ws = Tensor::empty({static_cast<int64_t>(liger::rms_norm_backward_workspace(q, 0))}, DType::u8, kDev);
      q.workspace = ws.data();
      check(liger::rms_norm_backward_cuda(q, cuda::current_stream()));
    }, 8 * unit);
  }
  {  // The backward alone (the forward's output reused): where the fwd+bwd time goes.
    auto [t, q, ws] = fresh(true);
    check(liger::rms_norm_forward_cuda(q, cuda::current_stream()));
    row("rmsnorm bwd", "kcpp", [&] { check(liger::rms_norm_backward_cuda(q, cuda::current_stream())); }, bb);
  }
}

// LayerNorm with bias at RMSNorm's shape; bytes counted as for RMSNorm (forward 2 x N x H x 2 B,
// backward 3 x N x H x 2 B).
void bench_layer_norm() {
  const int64_t bt = 8192, h = 4096;
  Generator gen(8);
  const Tensor x = Tensor::randn({bt, h}, DType::bf16, kDev, gen), w = Tensor::randn({h}, DType::bf16, kDev, gen);
  const Tensor b = Tensor::randn({h}, DType::bf16, kDev, gen), dy = Tensor::randn({bt, h}, DType::bf16, kDev, gen);
  const double fb = 2.0 * bt * h * 2 / 1e9, bb = 3.0 * bt * h * 2 / 1e9;
  row("layernorm fwd", "reference", [&] { ops::layer_norm_forward(x, w, b); }, fb);
  row("layernorm fwd+bwd", "reference", [&] {
    const auto f = ops::layer_norm_forward(x, w, b);
    ops::layer_norm_backward(dy, x, w, f.mean, f.rstd, true);
  }, fb + bb);
  auto forward = [&](liger::LayerNormParams& p, Tensor& y, Tensor& mean, Tensor& rstd) {
    y = Tensor::empty({bt, h}, DType::bf16, kDev);
    mean = Tensor::empty({bt}, DType::f32, kDev);
    rstd = Tensor::empty({bt}, DType::f32, kDev);
    p.dtype = kernel::DType::bf16, p.rows = bt, p.hidden = h, p.x = x.data(), p.x_stride = h;
    p.w = w.data(), p.b = b.data(), p.y = y.data(), p.y_stride = h;
    p.mean = static_cast<float*>(mean.data()), p.rstd = static_cast<float*>(rstd.data());
    check(liger::layer_norm_forward_cuda(p, cuda::current_stream()));
  };
  row("layernorm fwd", "kcpp", [&] {
    liger::LayerNormParams p;
    Tensor y, mean, rstd;
    forward(p, y, mean, rstd);
  }, fb);
  // The backward's outputs and workspace, set into p (after forward()).
  struct Grads {
    Tensor dx, dw, db, ws;
  };
  auto grads = [&](liger::LayerNormParams& p) {
    Grads g{Tensor::empty({bt, h}, DType::bf16, kDev), Tensor::empty({h}, DType::bf16, kDev),
            Tensor::empty({h}, DType::bf16, kDev), {}};
    p.dy = dy.data(), p.dy_stride = h, p.dx = g.dx.data(), p.dx_stride = h, p.dw = g.dw.data(), p.db = g.db.data();
    g.ws = Tensor::empty({static_cast<int64_t>(liger::layer_norm_backward_workspace(p, 0))}, DType::u8, kDev);
    p.workspace = g.ws.data();
    return g;
  };
  row("layernorm fwd+bwd", "kcpp", [&] {
    liger::LayerNormParams p;
    Tensor y, mean, rstd;
    forward(p, y, mean, rstd);
    const Grads g = grads(p);
    check(liger::layer_norm_backward_cuda(p, cuda::current_stream()));
  }, fb + bb);
  {  // the backward alone (its inputs from one forward, outside the timing)
    liger::LayerNormParams p;
    Tensor y, mean, rstd;
    forward(p, y, mean, rstd);
    const Grads g = grads(p);
    row("layernorm bwd", "kcpp", [&] { check(liger::layer_norm_backward_cuda(p, cuda::current_stream())); }, bb);
  }
}

// The LayerNorm forward's registers path at 2 and 4 vectors a thread (256 and 128 threads a row),
// and the backward's row paths at 1 and 2 (512 and 256 threads a row).
void sweep_layer_norm() {
  const int64_t bt = 8192, h = 4096;
  Generator gen(8);
  const Tensor x = Tensor::randn({bt, h}, DType::bf16, kDev, gen), w = Tensor::randn({h}, DType::bf16, kDev, gen);
  const Tensor b = Tensor::randn({h}, DType::bf16, kDev, gen), y = Tensor::empty({bt, h}, DType::bf16, kDev);
  const Tensor mean = Tensor::empty({bt}, DType::f32, kDev), rstd = Tensor::empty({bt}, DType::f32, kDev);
  liger::LayerNormParams p;
  p.dtype = kernel::DType::bf16, p.rows = bt, p.hidden = h, p.x = x.data(), p.x_stride = h;
  p.w = w.data(), p.b = b.data(), p.y = y.data(), p.y_stride = h;
  p.mean = static_cast<float*>(mean.data()), p.rstd = static_cast<float*>(rstd.data());
  const double fb = 2.0 * bt * h * 2 / 1e9;
  std::printf("sweep layernorm bf16 [%lld, %lld]: vectors a thread\n", (long long)bt, (long long)h);
  for (int items : {2, 4}) {
    const Timing t = time_op(kDev, [&] { check(liger::layer_norm_forward_cuda_with(p, cuda::current_stream(), items)); }, 10, 50);
    const double gbps = fb / (t.median_ms * 1e-3);
    std::printf("  layernorm fwd %d  %8.4f ms %6.0f GB/s %5.1f%%\n", items, t.median_ms, gbps, 100 * gbps / g_copy_gbps);
    g_rows.push_back({{"op", "sweep layernorm fwd"}, {"items", items}, {"ms", t.median_ms}, {"GBps", gbps}});
  }
  check(liger::layer_norm_forward_cuda(p, cuda::current_stream()));
  const Tensor dy = Tensor::randn({bt, h}, DType::bf16, kDev, gen), dx = Tensor::empty({bt, h}, DType::bf16, kDev);
  const Tensor dw = Tensor::empty({h}, DType::bf16, kDev), db = Tensor::empty({h}, DType::bf16, kDev);
  p.dy = dy.data(), p.dy_stride = h, p.dx = dx.data(), p.dx_stride = h, p.dw = dw.data(), p.db = db.data();
  const double bb = 3.0 * bt * h * 2 / 1e9;
  std::printf("sweep layernorm bwd: vectors a thread, blocks an SM (0: as many as fit), cluster (0: default, 1: none)\n");
  for (int items : {1, 2})
    for (int blocks : {0, 1, 2})
      for (int cluster : {1, 2, 4, 8}) {
        const Tensor ws = Tensor::empty({static_cast<int64_t>(liger::layer_norm_backward_workspace_with(p, 0, items, blocks, cluster))},
                                        DType::u8, kDev);
        liger::LayerNormParams q = p;
        q.workspace = ws.data();
        const Timing t = time_op(kDev, [&] { check(liger::layer_norm_backward_cuda_with(q, cuda::current_stream(), items, blocks, cluster)); }, 10, 50);
        const double gbps = bb / (t.median_ms * 1e-3);
        std::printf("  layernorm bwd %d %d %d  %8.4f ms %6.0f GB/s %5.1f%%\n", items, blocks, cluster, t.median_ms, gbps, 100 * gbps / g_copy_gbps);
        g_rows.push_back({{"op", "sweep layernorm bwd"}, {"items", items}, {"blocks_per_sm", blocks}, {"cluster", cluster}, {"ms", t.median_ms}, {"GBps", gbps}});
      }
}

// SwiGLU and both GeGLUs (package liger, glu/); the eager reference for SwiGLU only (anchors_extra.py
// times eager and torch.compile for all three).
void bench_swiglu() {
  const int64_t bt = 8192, inter = 14336;
  Generator gen(11);
  const Tensor a = Tensor::randn({bt, inter}, DType::bf16, kDev, gen), b = Tensor::randn({bt, inter}, DType::bf16, kDev, gen);
  const Tensor dc = Tensor::randn({bt, inter}, DType::bf16, kDev, gen);
  const double unit = double(bt) * inter * 2 / 1e9;  // anchors.py: forward 3 units, forward + backward 8
  row("swiglu fwd", "reference", [&] { ops::glu_forward(a, b, ops::GluActivation::Silu); }, 3 * unit);
  row("swiglu fwd+bwd", "reference", [&] {
    ops::glu_forward(a, b, ops::GluActivation::Silu);
    ops::glu_backward(dc, a, b, ops::GluActivation::Silu);
  }, 8 * unit);
  for (const auto& [name, act] : {std::pair{"swiglu", ops::GluActivation::Silu},
                                  std::pair{"geglu", ops::GluActivation::Gelu},
                                  std::pair{"geglu_tanh", ops::GluActivation::GeluTanh}}) {
    const std::string op = name;
    row(op + " fwd", "kcpp", [&] {
      Tensor out = Tensor::empty({bt, inter}, DType::bf16, kDev);
      check(liger::glu_forward_cuda(test::glu_params(a, b, act, out), cuda::current_stream()));
    }, 3 * unit);
    row(op + " fwd+bwd", "kcpp", [&] {
      Tensor out = Tensor::empty({bt, inter}, DType::bf16, kDev);
      Tensor dg = Tensor::empty({bt, inter}, DType::bf16, kDev), du = Tensor::empty({bt, inter}, DType::bf16, kDev);
      check(liger::glu_forward_cuda(test::glu_params(a, b, act, out), cuda::current_stream()));
      check(liger::glu_backward_cuda(test::glu_params(a, b, act, {}, dc, dg, du), cuda::current_stream()));
    }, 8 * unit);
  }
  // In place, as Liger does: the gradients overwrite gate and up (scratch copies here, so that the
  // inputs above stay intact; their values drift between runs, which does not change the work).
  const Tensor a2 = a.clone(), b2 = b.clone();
  const auto act = ops::GluActivation::Silu;
  row("swiglu fwd+bwd in-place", "kcpp", [&] {
    Tensor out = Tensor::empty({bt, inter}, DType::bf16, kDev);
    check(liger::glu_forward_cuda(test::glu_params(a2, b2, act, out), cuda::current_stream()));
    check(liger::glu_backward_cuda(test::glu_params(a2, b2, act, {}, dc, a2, b2), cuda::current_stream()));
  }, 8 * unit);
}

void bench_rope() {
  // anchors.py: q [4, 32, 2048, 128], k [4, 8, 2048, 128] (HF layout), cos/sin [1, 2048, 128], bf16.
  const int64_t b = 4, s = 2048, hq = 32, hk = 8, d = 128;
  Generator gen(13);
  const Tensor q = Tensor::randn({b, hq, s, d}, DType::bf16, kDev, gen), k = Tensor::randn({b, hk, s, d}, DType::bf16, kDev, gen);
  std::vector<int64_t> pos(static_cast<size_t>(s));
  for (int64_t i = 0; i < s; ++i) pos[i] = i;
  const auto cs = ops::rope_cos_sin(Tensor::from_i64(pos, {1, s}, DType::i64, kDev), ops::rope_inv_freq(d, 500000.0, kDev),
                                    1.0, DType::bf16);
  const double gb = 2.0 * double(q.numel() + k.numel()) * 2 / 1e9;  // anchors.py: forward; forward + backward twice that
  const auto rh = ops::RopeLayout::RotateHalf;
  row("rope fwd", "reference", [&] {
    ops::rope_forward(q, cs.cos, cs.sin);
    ops::rope_forward(k, cs.cos, cs.sin);
  }, gb);
  row("rope fwd+bwd", "reference", [&] {
    ops::rope_forward(q, cs.cos, cs.sin);
    ops::rope_forward(k, cs.cos, cs.sin);
    ops::rope_backward(q, cs.cos, cs.sin);
    ops::rope_backward(k, cs.cos, cs.sin);
  }, 2 * gb);
  row("rope fwd", "kcpp", [&] {
    Tensor qo = Tensor::empty(q.shape(), DType::bf16, kDev), ko = Tensor::empty(k.shape(), DType::bf16, kDev);
    check(liger::rope_forward_cuda(test::rope_params(q, qo, k, ko, cs.cos, cs.sin, rh), cuda::current_stream()));
  }, gb);
  row("rope fwd+bwd", "kcpp", [&] {
    Tensor qo = Tensor::empty(q.shape(), DType::bf16, kDev), ko = Tensor::empty(k.shape(), DType::bf16, kDev);
    check(liger::rope_forward_cuda(test::rope_params(q, qo, k, ko, cs.cos, cs.sin, rh), cuda::current_stream()));
    Tensor dq = Tensor::empty(q.shape(), DType::bf16, kDev), dk = Tensor::empty(k.shape(), DType::bf16, kDev);
    check(liger::rope_backward_cuda(test::rope_params(qo, dq, ko, dk, cs.cos, cs.sin, rh), cuda::current_stream()));
  }, 2 * gb);
  // In place (outputs over the inputs; scratch copies so that q and k stay as drawn).
  const Tensor q2 = q.clone(), k2 = k.clone();
  row("rope fwd+bwd in-place", "kcpp", [&] {
    const auto p = test::rope_params(q2, q2, k2, k2, cs.cos, cs.sin, rh);
    check(liger::rope_forward_cuda(p, cuda::current_stream()));
    check(liger::rope_backward_cuda(p, cuda::current_stream()));
  }, 2 * gb);
  // q and k as the projections give them, [B, S, H, D] (viewed as [B, H, S, D]), in place.
  const Tensor q3 = Tensor::randn({b, s, hq, d}, DType::bf16, kDev, gen).transpose(1, 2);
  const Tensor k3 = Tensor::randn({b, s, hk, d}, DType::bf16, kDev, gen).transpose(1, 2);
  row("rope fwd bshd in-place", "kcpp", [&] {
    check(liger::rope_forward_cuda(test::rope_params(q3, q3, k3, k3, cs.cos, cs.sin, rh), cuda::current_stream()));
  }, gb);
}

void bench_cross_entropy() {
  // anchors.py: logits [4096, 128256] bf16, mean reduction, loss and gradient (fwd+bwd).
  const int64_t n = 4096, v = 128256;
  Generator gen(17);
  const Tensor logits = Tensor::randn({n, v}, DType::bf16, kDev, gen);
  const Tensor targets = Tensor::randint({n}, 0, v, DType::i64, kDev, gen);
  const double gb = 2.0 * n * v * 2 / 1e9;  // anchors.py's count: read the logits, write the gradient
  const ops::CrossEntropyOptions opt;
  const Tensor cw = Tensor::uniform({v}, DType::f32, kDev, gen, 0.5, 1.5);  // class weights (the options row)
  row("ce fwd+bwd", "reference", [&] {
    const auto f = ops::cross_entropy_forward(logits, targets, opt);
    ops::cross_entropy_backward(Tensor::full({}, 1.0, DType::bf16, kDev), f.log_probs, targets, opt);
  }, gb);
  auto call = [&](const Tensor& in, const Tensor& grad, const liger::CrossEntropyConfig& c = {}, bool ext = false) {
    Tensor loss = Tensor::empty({1}, DType::f32, kDev);
    auto p = test::cross_entropy_params(in, targets, opt, loss, grad);
    if (ext) p.softcap = 30.0f, p.lse_square_scale = 1e-4f, p.class_weight = static_cast<const float*>(cw.data());
    Tensor ws = Tensor::empty({static_cast<int64_t>(liger::cross_entropy_workspace(p))}, DType::u8, kDev);
    p.workspace = ws.data();
    check(liger::cross_entropy_cuda_with(p, cuda::current_stream(), c));
  };
  row("ce fwd+bwd", "kcpp", [&] { call(logits, Tensor::empty({n, v}, DType::bf16, kDev)); }, gb);
  // In place over the logits, as Liger does (a scratch copy: its values become gradients after the
  // first run, which does not change the work).
  const Tensor scratch = logits.clone();
  row("ce fwd+bwd in-place", "kcpp", [&] { call(scratch, scratch); }, gb);
  // The per-element options (softcap 30, as Gemma 2; class weights) and the per-row ones (z-loss).
  row("ce fwd+bwd softcap+w+z", "kcpp", [&] { call(logits, Tensor::empty({n, v}, DType::bf16, kDev), {}, true); }, gb);
  // The two-pass loop path (before sm_90, or where the cluster path does not apply).
  row("ce fwd+bwd loop path", "kcpp", [&] { call(logits, Tensor::empty({n, v}, DType::bf16, kDev), {false}); }, gb);
  // The loss alone (evaluation): the logits read once, nothing written; bandwidth of those bytes.
  row("ce fwd (loss alone)", "reference", [&] { ops::cross_entropy_forward(logits, targets, opt); }, gb / 2);
  row("ce fwd (loss alone)", "kcpp", [&] { call(logits, Tensor()); }, gb / 2);
  row("ce fwd loss alone loop", "kcpp", [&] { call(logits, Tensor(), {false}); }, gb / 2);
}

// The cluster path's configurations (cross_entropy_tuning.h): vectors a thread, stages in flight.
void sweep_cross_entropy() {
  const int64_t n = 4096, v = 128256;
  Generator gen(17);
  const Tensor logits = Tensor::randn({n, v}, DType::bf16, kDev, gen);
  const Tensor targets = Tensor::randint({n}, 0, v, DType::i64, kDev, gen);
  const Tensor grad = Tensor::empty({n, v}, DType::bf16, kDev);
  const double gb = 2.0 * n * v * 2 / 1e9;
  // One sweep over configurations: with the gradient (the logits read once, the gradient written once)
  // or the loss alone (read once).
  auto sweep = [&](const char* op, const Tensor& g, double bytes, std::initializer_list<liger::CrossEntropyConfig> configs) {
    for (const liger::CrossEntropyConfig& c : configs) {
      Tensor loss = Tensor::empty({1}, DType::f32, kDev);
      auto p = test::cross_entropy_params(logits, targets, ops::CrossEntropyOptions{}, loss, g);
      Tensor ws = Tensor::empty({static_cast<int64_t>(liger::cross_entropy_workspace(p))}, DType::u8, kDev);
      p.workspace = ws.data();
      const Timing t = time_op(kDev, [&] { check(liger::cross_entropy_cuda_with(p, cuda::current_stream(), c)); }, 5, 30);
      const double gbps = bytes / (t.median_ms * 1e-3);
      std::printf("  %d %4d %2d %d (cluster of %d)  %8.4f ms %6.0f GB/s %5.1f%%\n", c.cluster, c.threads, c.vecs, c.stages,
                  liger::cross_entropy_cluster_size(p, c), t.median_ms, gbps, 100 * gbps / g_copy_gbps);
      g_rows.push_back({{"op", op}, {"cluster", c.cluster}, {"threads", c.threads}, {"vecs", c.vecs}, {"stages", c.stages},
                        {"ms", t.median_ms}, {"GBps", gbps}});
    }
  };
  std::printf("cross-entropy sweep [%lld, %lld] bf16 (cluster, threads, vectors a thread, stages)\n", static_cast<long long>(n),
              static_cast<long long>(v));
  sweep("sweep ce", grad, gb,
        {liger::CrossEntropyConfig{false}, {true, 512, 8, 1}, {true, 512, 8, 2}, {true, 512, 8, 3}, {true, 256, 8, 1},
         {true, 256, 8, 2}, {true, 256, 8, 3}, {true, 1024, 4, 2}, {true, 512, 4, 2}, {true, 512, 4, 4}});
  std::printf("cross-entropy sweep, the loss alone (read once)\n");
  sweep("sweep ce loss alone", Tensor(), gb / 2,
        {liger::CrossEntropyConfig{false}, {true, 256, 8, 1}, {true, 256, 8, 2}, {true, 256, 8, 3}, {true, 256, 8, 4},
         {true, 512, 8, 1}, {true, 512, 8, 2}, {true, 512, 4, 2}, {true, 512, 4, 4}});
  // The per-element options path (softcap 30; then with class weights and z-loss too).
  const Tensor cw = Tensor::uniform({v}, DType::f32, kDev, gen, 0.5, 1.5);
  for (const bool weights : {false, true}) {
    std::printf("cross-entropy sweep, softcap 30%s\n", weights ? " + class weights + z-loss" : "");
    for (const liger::CrossEntropyConfig c : {liger::CrossEntropyConfig{false}, {true, 0, 8, 1}, {true, 512, 8, 2},
                                              {true, 256, 8, 1}, {true, 256, 8, 2}, {true, 1024, 4, 1}, {true, 512, 4, 1},
                                              {true, 512, 4, 2}}) {
      Tensor loss = Tensor::empty({1}, DType::f32, kDev);
      auto p = test::cross_entropy_params(logits, targets, ops::CrossEntropyOptions{}, loss, grad);
      p.softcap = 30.0f;
      if (weights) p.lse_square_scale = 1e-4f, p.class_weight = static_cast<const float*>(cw.data());
      Tensor ws = Tensor::empty({static_cast<int64_t>(liger::cross_entropy_workspace(p))}, DType::u8, kDev);
      p.workspace = ws.data();
      const Timing t = time_op(kDev, [&] { check(liger::cross_entropy_cuda_with(p, cuda::current_stream(), c)); }, 5, 30);
      const double gbps = gb / (t.median_ms * 1e-3);
      std::printf("  %d %4d %2d %d  %8.4f ms %6.0f GB/s %5.1f%%\n", c.cluster, c.threads, c.vecs, c.stages, t.median_ms, gbps,
                  100 * gbps / g_copy_gbps);
      g_rows.push_back({{"op", weights ? "sweep ce softcap+w+z" : "sweep ce softcap"}, {"cluster", c.cluster}, {"threads", c.threads},
                        {"vecs", c.vecs}, {"stages", c.stages}, {"ms", t.median_ms}, {"GBps", gbps}});
    }
  }
}

// A compute-bound row: TFLOP/s instead of bandwidth; the peak also without the `grads_mib` of
// gradients the call returns (the memory bar counts only what is beyond inputs, gradients, loss).
void flop_row(const std::string& op, const std::string& impl, const std::function<void()>& fn, double tflop,
              double grads_mib, int reps = 10) {
  const Timing t = time_op(kDev, fn, 2, reps);
  const double mib = peak_mib(fn);
  std::printf("%-24s %-10s %9.3f ms %7.1f TFLOP/s  peak %8.1f MiB (%8.1f MiB beyond the gradients)\n", op.c_str(),
              impl.c_str(), t.median_ms, tflop / (t.median_ms * 1e-3), mib, mib - grads_mib);
  g_rows.push_back({{"op", op}, {"impl", impl}, {"ms", t.median_ms}, {"min_ms", t.min_ms},
                    {"TFLOPs", tflop / (t.median_ms * 1e-3)}, {"peak_MiB", mib}, {"extra_MiB", mib - grads_mib}});
}

// Fused linear cross-entropy at anchors.py's shape: hidden [8192, 4096], weight [128256, 4096] bf16
// (scaled 0.02), mean loss, gradients of hidden and weight.  Beside it, the three GEMMs it must do,
// through cuBLAS on whole (materialized) matrices, timed in this same process: the bar is 1.2x their
// time; and the eager composition (logits materialized).
void bench_flce(bool sweep) {
  const int64_t n = 8192, h = 4096, v = 128256;
  Generator gen(23);
  const Tensor x = Tensor::randn({n, h}, DType::bf16, kDev, gen);
  const Tensor w = Tensor::randn({v, h}, DType::bf16, kDev, gen, 0, 0.02);
  const Tensor targets = Tensor::randint({n}, 0, v, DType::i64, kDev, gen);
  const double tflop = 3.0 * 2 * n * h * v / 1e12;
  const double grads_mib = static_cast<double>((n + v) * h * 2) / (1 << 20);
  const double logits_mib = static_cast<double>(n * v * 2) / (1 << 20);
  std::printf("flce: bf16 logits would be %.0f MiB; the bar for extra memory is 25%% of it, %.0f MiB\n", logits_mib,
              logits_mib / 4);
  {
    const Tensor g = Tensor::randn({n, v}, DType::bf16, kDev, gen, 0, 1e-4);  // a gradient-sized operand
    const Timing t1 = time_op(kDev, [&] { ops::matmul(x, w, false, true); }, 2, 10);
    const Timing t2 = time_op(kDev, [&] { ops::matmul(g, w); }, 2, 10);
    const Timing t3 = time_op(kDev, [&] { ops::matmul(g, x, true, false); }, 2, 10);
    const double ms = t1.median_ms + t2.median_ms + t3.median_ms;
    std::printf("%-24s %-10s %9.3f ms %7.1f TFLOP/s  (x w^T %.3f, g w %.3f, g^T x %.3f ms)\n", "flce 3 GEMMs", "cublas", ms,
                tflop / (ms * 1e-3), t1.median_ms, t2.median_ms, t3.median_ms);
    g_rows.push_back({{"op", "flce 3 GEMMs"}, {"impl", "cublas"}, {"ms", ms}, {"TFLOPs", tflop / (ms * 1e-3)},
                      {"gemm_ms", {t1.median_ms, t2.median_ms, t3.median_ms}}});
  }
  const ops::CrossEntropyOptions opt;
  flop_row("flce fwd+bwd", "reference", [&] {
    const Tensor logits = ops::matmul(x, w, false, true);
    const auto f = ops::cross_entropy_forward(logits, targets, opt);
    const Tensor g = ops::cross_entropy_backward(Tensor::full({}, 1.0, DType::bf16, kDev), f.log_probs, targets, opt);
    ops::matmul(g, w);
    ops::matmul(g, x, true, false);
  }, tflop, grads_mib, 5);
  auto run = [&](int64_t chunk, bool accum_f32) {
    Tensor loss = Tensor::empty({1}, DType::f32, kDev), dx = Tensor::empty({n, h}, DType::bf16, kDev);
    Tensor dw = Tensor::empty({v, h}, DType::bf16, kDev);
    liger::FusedLinearCEParams p;
    p.n = n, p.h = h, p.v = v;
    p.hidden = x.data(), p.hidden_stride = h, p.weight = w.data(), p.weight_stride = h;
    p.targets = targets.data();
    p.loss = static_cast<float*>(loss.data());
    p.dhidden = dx.data(), p.dhidden_stride = h, p.dweight = dw.data();
    p.chunk_rows = chunk;
    p.accum_f32 = accum_f32;
    Tensor ws = Tensor::empty({static_cast<int64_t>(liger::fused_linear_ce_workspace(p, true))}, DType::u8, kDev);
    p.workspace = ws.data();
    check(liger::fused_linear_ce_cuda(p, cuda::current_stream()));
  };
  flop_row("flce fwd+bwd", "kcpp", [&] { run(0, false); }, tflop, grads_mib);
  if (!sweep) return;
  for (int64_t chunk : {512, 1024, 2048, 4096})
    flop_row(fmt::format("sweep flce chunk {}", chunk), "kcpp", [&] { run(chunk, false); }, tflop, grads_mib);
  flop_row("sweep flce accum f32", "kcpp", [&] { run(0, true); }, tflop, grads_mib);
}

// Attention at anchors.py's shape (B 4, 32 heads, S 4096, D 128, causal, bf16) and at the training
// step's (S 2048, 32 query / 8 kv heads): forward (with lse) and forward + backward.  FLOPs counted
// as anchors.py does: 4 B H S^2 D / 2 for the causal forward, 3.5 times that for forward + backward.
void bench_attention() {
  struct Shape {
    int64_t b, hq, hkv, s;
  };
  for (const Shape& sh : {Shape{4, 32, 32, 4096}, Shape{4, 32, 8, 2048}}) {
    const int64_t d = 128;
    Generator gen(29);
    const Tensor q = Tensor::randn({sh.b, sh.hq, sh.s, d}, DType::bf16, kDev, gen);
    const Tensor k = Tensor::randn({sh.b, sh.hkv, sh.s, d}, DType::bf16, kDev, gen);
    const Tensor v = Tensor::randn({sh.b, sh.hkv, sh.s, d}, DType::bf16, kDev, gen);
    const Tensor dout = Tensor::randn({sh.b, sh.hq, sh.s, d}, DType::bf16, kDev, gen);
    Tensor out = Tensor::empty(q.shape(), q.dtype(), kDev), lse = Tensor::empty({sh.b, sh.hq, sh.s}, DType::f32, kDev);
    Tensor dq = Tensor::empty(q.shape(), q.dtype(), kDev), dk = Tensor::empty(k.shape(), k.dtype(), kDev);
    Tensor dv = Tensor::empty(v.shape(), v.dtype(), kDev);
    auto operand = [](const Tensor& t) {
      return flash::Operand{t.data(), t.stride(0), t.stride(1), t.stride(2)};
    };
    flash::AttentionParams p;
    p.dtype = kernel::DType::bf16;
    p.batch = sh.b, p.heads_q = sh.hq, p.heads_kv = sh.hkv, p.seq_q = sh.s, p.seq_kv = sh.s, p.head_dim = d;
    p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
    p.q = operand(q), p.k = operand(k), p.v = operand(v), p.out = operand(out), p.lse = static_cast<float*>(lse.data());
    p.dout = operand(dout), p.dq = operand(dq), p.dk = operand(dk), p.dv = operand(dv);
    const double fl = 4.0 * sh.b * sh.hq * sh.s * sh.s * d / 2 / 1e12;
    const std::string tag = fmt::format("S={} Hkv={}", sh.s, sh.hkv);
    flop_row("attn causal fwd " + tag, "kcpp", [&] { check(flash::attention_forward_cuda(p, cuda::current_stream())); }, fl, 0);
    flop_row("attn causal fwd+bwd " + tag, "kcpp", [&] {
      check(flash::attention_forward_cuda(p, cuda::current_stream()));
      Tensor ws = Tensor::empty({static_cast<int64_t>(flash::attention_backward_workspace(p))}, DType::u8, kDev);
      flash::AttentionParams b = p;
      b.workspace = ws.data();
      check(flash::attention_backward_cuda(b, cuda::current_stream()));
    }, 3.5 * fl, 0);
    if (sh.s <= 2048) {  // the eager reference materializes B H S^2 probabilities (twice); 4096 does not fit twice
      const ops::AttentionOptions opt;
      flop_row("attn causal fwd+bwd " + tag, "reference", [&] {
        const auto f = ops::attention_forward(q, k, v, opt);
        ops::attention_backward(dout, q, k, v, f, opt);
      }, 3.5 * fl, 0, 3);
    }
  }
}

// Every launch configuration of the loop and registers paths (and the backward's bulk path) at the
// benchmark shape, forward (RMSNorm and AddRMSNorm) and backward (RMSNorm) separately: the measurements behind the defaults
// in rms_norm_cuda.cu.  Columns: items (16-byte vectors a thread; 0: loop path), persistent, stages
// (> 0: bulk path, rows in flight a block), blocks_per_sm (0: as many as fit), cluster (the bulk
// path's dw sums added in clusters of that many blocks; 1: none).
void sweep_rms_norm() {
  const int64_t bt = 8192, h = 4096;
  Generator gen(7);
  const Tensor x = Tensor::randn({bt, h}, DType::bf16, kDev, gen), w = Tensor::randn({h}, DType::bf16, kDev, gen);
  const Tensor dy = Tensor::randn({bt, h}, DType::bf16, kDev, gen);
  const test::RMSNormTensors t = test::rms_norm_tensors(x, w, dy);
  const liger::RMSNormParams p = test::rms_norm_params(t);
  const double fb = 2.0 * bt * h * 2 / 1e9, bb = 3.0 * bt * h * 2 / 1e9;
  std::printf("sweep rmsnorm bf16 [%lld, %lld]: items persistent stages blocks_per_sm cluster (add: AddRMSNorm, 4 units)\n",
              (long long)bt, (long long)h);
  std::vector<liger::RMSNormConfig> configs;
  for (int items : {0, 1, 2, 4})
    for (bool persistent : {false, true}) configs.push_back({items, persistent, 0, 0});
  for (int items : {1, 2})
    for (int stages : {2, 3})
      for (int blocks : {0, 2})
        for (int cluster : {1, 2, 4, 8}) configs.push_back({items, true, stages, blocks, cluster});
  auto report = [&](const char* op, const liger::RMSNormConfig& c, const Timing& t, double gb) {
    const double gbps = gb / (t.median_ms * 1e-3);
    std::printf("  %-22s %d %d %d %d %d  %8.4f ms %6.0f GB/s %5.1f%%\n", op, c.items, c.persistent, c.stages, c.blocks_per_sm,
                c.cluster, t.median_ms, gbps, 100 * gbps / g_copy_gbps);
    g_rows.push_back({{"op", std::string("sweep ") + op}, {"items", c.items}, {"persistent", c.persistent}, {"stages", c.stages},
                      {"blocks_per_sm", c.blocks_per_sm}, {"cluster", c.cluster}, {"ms", t.median_ms}, {"GBps", gbps}});
  };
  const Tensor res = Tensor::randn({bt, h}, DType::bf16, kDev, gen), rout = Tensor::empty({bt, h}, DType::bf16, kDev);
  for (bool add : {false, true})
    for (const liger::RMSNormConfig& c : configs) {
      if (c.stages > 0) continue;  // the bulk path is the backward's
      liger::RMSNormParams q = p;
      if (add) q.residual = res.data(), q.residual_stride = h, q.residual_out = rout.data(), q.residual_out_stride = h;
      const Timing tm = time_op(kDev, [&] { check(liger::rms_norm_forward_cuda_with(q, cuda::current_stream(), c)); }, 10, 50);
      report(add ? "addrmsnorm fwd" : "rmsnorm fwd", c, tm, (add ? 2 : 1) * fb);
    }
  for (const liger::RMSNormConfig& c : configs) {
    if (c.items > 2 || !c.persistent) continue;  // beyond the backward's register budget; always persistent
    Tensor ws = Tensor::empty({static_cast<int64_t>(liger::rms_norm_backward_workspace_with(p, 0, c))}, DType::u8, kDev);
    liger::RMSNormParams q = p;
    q.workspace = ws.data();
    const Timing tm = time_op(kDev, [&] { check(liger::rms_norm_backward_cuda_with(q, cuda::current_stream(), c)); }, 10, 50);
    report("rmsnorm bwd", c, tm, bb);
  }
}

// Package "activation" through the ABI, as a host calls it: the gated kernels on x [8192, 2 x 14336]
// (the Llama-3-8B MLP with a fused gate_up projection), the plain ones on [8192, 14336], bf16.
// Bytes: a gated forward reads x and writes y (3 units of N x I), its backward reads dy and x and
// writes dx (5 units), as anchors.py counts SwiGLU; a plain one 2 and 3 units.
void bench_activation() {
  const int64_t bt = 8192, inter = 14336;
  Generator gen(13);
  const auto pkg = test::built_package("activation");
  const double unit = double(bt) * inter * 2 / 1e9;
  // Every kernel of the package (FastGELU and NewGELU are GeluTanh's kernel under other names); the
  // eager reference for SiluAndMul and GeluTanh (anchors_extra.py times eager and compile for all).
  struct Kind {
    const char* layer;
    const char* op;
    bool gated;
  };
  for (const Kind& kind : {Kind{"SiluAndMul", "silu_and_mul", true}, Kind{"GeluAndMul", "gelu_and_mul", true},
                           Kind{"GeluTanhAndMul", "gelu_tanh_and_mul", true}, Kind{"SiLU", "silu", false},
                           Kind{"GeLU", "gelu", false}, Kind{"GeluTanh", "gelu_tanh", false},
                           Kind{"QuickGELU", "quick_gelu", false}}) {
    const bool gated = kind.gated;
    const std::string op = kind.op;
    const nn::KernelLayer k = nn::KernelLayer::find(pkg, kind.layer);
    const int64_t xw = gated ? 2 * inter : inter;
    const Tensor x = Tensor::randn({bt, xw}, DType::bf16, kDev, gen), dy = Tensor::randn({bt, inter}, DType::bf16, kDev, gen);
    const Tensor gate = gated ? x.narrow(1, 0, inter) : x, up = gated ? x.narrow(1, inter, inter) : Tensor();
    const double fb = (gated ? 3 : 2) * unit, bb = (gated ? 5 : 3) * unit;
    auto forward = [&] {
      const Tensor y = Tensor::empty({bt, inter}, DType::bf16, kDev);
      nn::KernelArgs a;
      a.tensor("x", x).tensor("y", y);
      k.forward(a, kDev, KCPP_MODE_TRAINING);
    };
    auto backward = [&] {
      const Tensor dx = Tensor::empty({bt, xw}, DType::bf16, kDev);
      nn::KernelArgs a;
      a.tensor("dy", dy).tensor("x", x).tensor("dx", dx);
      k.backward(a, kDev, KCPP_MODE_TRAINING);
    };
    if (op == "silu_and_mul") {
      row(op + " fwd", "reference", [&] { ops::glu_forward(gate, up, ops::GluActivation::Silu); }, fb);
      row(op + " fwd+bwd", "reference", [&] {
        ops::glu_forward(gate, up, ops::GluActivation::Silu);
        ops::glu_backward(dy, gate, up, ops::GluActivation::Silu);
      }, fb + bb);
    } else if (op == "gelu_tanh") {
      row(op + " fwd", "reference", [&] { ops::gelu(x, true); }, fb);
      row(op + " fwd+bwd", "reference", [&] {
        ops::gelu(x, true);
        ops::gelu_backward(dy, x, true);
      }, fb + bb);
    }
    row(op + " fwd", "kcpp", forward, fb);
    row(op + " fwd+bwd", "kcpp", [&] {
      forward();
      backward();
    }, fb + bb);
    row(op + " bwd", "kcpp", backward, bb);
  }
}

// SwiGLU launch configurations, one factor at a time around the default (unroll 1, 16 blocks per SM,
// accurate math), then the combinations.
void sweep_swiglu() {
  const int64_t bt = 8192, inter = 14336;
  Generator gen(11);
  const Tensor a = Tensor::randn({bt, inter}, DType::bf16, kDev, gen), b = Tensor::randn({bt, inter}, DType::bf16, kDev, gen);
  const Tensor dc = Tensor::randn({bt, inter}, DType::bf16, kDev, gen);
  Tensor out = Tensor::empty({bt, inter}, DType::bf16, kDev), dg = Tensor::empty({bt, inter}, DType::bf16, kDev);
  Tensor du = Tensor::empty({bt, inter}, DType::bf16, kDev);
  const auto act = ops::GluActivation::Silu;
  const auto pf = test::glu_params(a, b, act, out), pb = test::glu_params(a, b, act, {}, dc, dg, du);
  const double unit = double(bt) * inter * 2 / 1e9;
  std::printf("sweep swiglu bf16 [%lld, %lld]: unroll blocks_per_sm (0: a chunk a block, no loop) fast_math\n", (long long)bt, (long long)inter);
  for (int unroll : {1, 2, 4})
    for (int blocks : {0, 4, 8, 16, 32})
      for (bool fast : {false, true}) {
        const liger::GluConfig c{unroll, blocks, fast};
        const Timing tf = time_op(kDev, [&] { check(liger::glu_forward_cuda_with(pf, cuda::current_stream(), c)); }, 10, 50);
        const Timing tb = time_op(kDev, [&] { check(liger::glu_backward_cuda_with(pb, cuda::current_stream(), c)); }, 10, 50);
        const double gf = 3 * unit / (tf.median_ms * 1e-3), gbw = 5 * unit / (tb.median_ms * 1e-3);
        std::printf("  %d %2d %d  fwd %8.4f ms %5.1f%%   bwd %8.4f ms %5.1f%%\n", unroll, blocks, fast, tf.median_ms,
                    100 * gf / g_copy_gbps, tb.median_ms, 100 * gbw / g_copy_gbps);
        g_rows.push_back({{"op", "sweep swiglu"}, {"unroll", unroll}, {"blocks_per_sm", blocks}, {"fast_math", fast},
                          {"fwd_ms", tf.median_ms}, {"bwd_ms", tb.median_ms}});
      }
}

// RoPE launch configurations at bench_rope()'s shapes (forward and backward, out of place).
void sweep_rope() {
  const int64_t b = 4, s = 2048, hq = 32, hk = 8, d = 128;
  Generator gen(13);
  const Tensor q = Tensor::randn({b, hq, s, d}, DType::bf16, kDev, gen), k = Tensor::randn({b, hk, s, d}, DType::bf16, kDev, gen);
  const Tensor qo = Tensor::empty(q.shape(), DType::bf16, kDev), ko = Tensor::empty(k.shape(), DType::bf16, kDev);
  std::vector<int64_t> pos(static_cast<size_t>(s));
  for (int64_t i = 0; i < s; ++i) pos[i] = i;
  const auto cs = ops::rope_cos_sin(Tensor::from_i64(pos, {1, s}, DType::i64, kDev), ops::rope_inv_freq(d, 500000.0, kDev),
                                    1.0, DType::bf16);
  const auto p = test::rope_params(q, qo, k, ko, cs.cos, cs.sin, ops::RopeLayout::RotateHalf);
  const double gb = 2.0 * double(q.numel() + k.numel()) * 2 / 1e9;
  std::printf("sweep rope bf16: threads blocks_per_sm (0 = one block per token) heads_per_thread (0 = token kernel) order "
              "(1 heads adjacent, 2 tokens adjacent)\n");
  std::vector<liger::RopeConfig> configs;
  for (int threads : {64, 128, 256})
    for (int blocks : {16, 0}) configs.push_back({threads, blocks, 0});  // the token kernel
  for (int order : {1, 2})
    for (const auto& [threads, heads] : {std::pair{64, 1}, {64, 2}, {64, 4}, {128, 1}, {128, 2}, {128, 4}, {160, 2}, {256, 2}})
      configs.push_back({threads, 0, heads, order});
  for (const liger::RopeConfig& c : configs) {
    const int threads = c.threads, blocks = c.blocks_per_sm;
    const Timing tf = time_op(kDev, [&] { check(liger::rope_forward_cuda_with(p, cuda::current_stream(), c)); }, 10, 50);
    const Timing tb = time_op(kDev, [&] { check(liger::rope_backward_cuda_with(p, cuda::current_stream(), c)); }, 10, 50);
    std::printf("  %3d %2d %d %d  fwd %8.4f ms %5.1f%%   bwd %8.4f ms %5.1f%%\n", threads, blocks, c.heads_per_thread, c.order, tf.median_ms,
                100 * gb / (tf.median_ms * 1e-3) / g_copy_gbps, tb.median_ms, 100 * gb / (tb.median_ms * 1e-3) / g_copy_gbps);
    g_rows.push_back({{"op", "sweep rope"}, {"threads", threads}, {"blocks_per_sm", blocks},
                      {"heads_per_thread", c.heads_per_thread}, {"order", c.order}, {"fwd_ms", tf.median_ms},
                      {"bwd_ms", tb.median_ms}});
  }
  // [B, S, H, D] in place (q and k as the projections give them), forward.
  const Tensor q3 = Tensor::randn({b, s, hq, d}, DType::bf16, kDev, gen).transpose(1, 2);
  const Tensor k3 = Tensor::randn({b, s, hk, d}, DType::bf16, kDev, gen).transpose(1, 2);
  const auto p3 = test::rope_params(q3, q3, k3, k3, cs.cos, cs.sin, ops::RopeLayout::RotateHalf);
  std::printf("sweep rope bf16 [B, S, H, D] in place, forward: threads heads_per_thread order\n");
  for (const liger::RopeConfig& c : std::vector<liger::RopeConfig>{
           {128, 0, 0}, {64, 0, 0}, {128, 0, 2, 1}, {128, 0, 2, 2}, {128, 0, 3, 1}, {160, 0, 2, 1}, {64, 0, 4, 2}, {64, 0, 1, 1}}) {
    const Timing tf = time_op(kDev, [&] { check(liger::rope_forward_cuda_with(p3, cuda::current_stream(), c)); }, 10, 50);
    std::printf("  %3d %d %d  fwd %8.4f ms %5.1f%%\n", c.threads, c.heads_per_thread, c.order, tf.median_ms,
                100 * gb / (tf.median_ms * 1e-3) / g_copy_gbps);
    g_rows.push_back({{"op", "sweep rope bshd"}, {"threads", c.threads}, {"heads_per_thread", c.heads_per_thread},
                      {"order", c.order}, {"fwd_ms", tf.median_ms}});
  }
}

// Activation launch configurations (ActConfig): SiluAndMul and GeluTanh, forward and backward, at each.
void sweep_activation() {
  const int64_t bt = 8192, inter = 14336;
  Generator gen(13);
  const Tensor xg = Tensor::randn({bt, 2 * inter}, DType::bf16, kDev, gen), xp = Tensor::randn({bt, inter}, DType::bf16, kDev, gen);
  const Tensor dy = Tensor::randn({bt, inter}, DType::bf16, kDev, gen), y = Tensor::empty({bt, inter}, DType::bf16, kDev);
  const Tensor dxg = Tensor::empty({bt, 2 * inter}, DType::bf16, kDev), dxp = Tensor::empty({bt, inter}, DType::bf16, kDev);
  const double unit = double(bt) * inter * 2 / 1e9;
  auto params = [&](bool gated) {
    activation::ActParams p;
    p.dtype = kernel::DType::bf16;
    p.act = gated ? kernel::Activation::Silu : kernel::Activation::GeluTanh;
    p.gated = gated;
    p.rows = gated ? bt : 1;  // the plain one as the package passes dense rows: one long row
    p.d = gated ? inter : bt * inter;
    p.x = gated ? xg.data() : xp.data();
    p.x_stride = gated ? 2 * inter : p.d;
    p.y = y.data(), p.y_stride = p.d;
    p.dy = dy.data(), p.dy_stride = p.d;
    p.dx = gated ? dxg.data() : dxp.data(), p.dx_stride = p.x_stride;
    return p;
  };
  std::printf("sweep activation bf16 [%lld, %lld]: unroll blocks_per_sm (0 = no cap)\n", (long long)bt, (long long)inter);
  for (bool gated : {true, false})
    for (int unroll : {1, 2, 4})
      for (int blocks : {8, 16, 32, 64, 0}) {
        const activation::ActConfig c{unroll, blocks};
        const auto p = params(gated);
        const Timing tf = time_op(kDev, [&] { check(activation::act_forward_cuda_with(p, cuda::current_stream(), c)); }, 10, 50);
        const Timing tb = time_op(kDev, [&] { check(activation::act_backward_cuda_with(p, cuda::current_stream(), c)); }, 10, 50);
        const double gf = (gated ? 3 : 2) * unit / (tf.median_ms * 1e-3), gbw = (gated ? 5 : 3) * unit / (tb.median_ms * 1e-3);
        std::printf("  %-12s %d %2d  fwd %8.4f ms %5.1f%%   bwd %8.4f ms %5.1f%%\n", gated ? "silu_and_mul" : "gelu_tanh",
                    unroll, blocks, tf.median_ms, 100 * gf / g_copy_gbps, tb.median_ms, 100 * gbw / g_copy_gbps);
        g_rows.push_back({{"op", gated ? "sweep silu_and_mul" : "sweep gelu_tanh"}, {"unroll", unroll},
                          {"blocks_per_sm", blocks}, {"fwd_ms", tf.median_ms}, {"bwd_ms", tb.median_ms}});
      }
}

}  // namespace

// Decoding attention (ops::decode_attention): one query per row over a KV cache of `ctx` tokens,
// grouped-query heads of Llama-3-8B (32 / 8, head dim 128), bf16.  Traffic: K and V once.  The
// peers (PyTorch SDPA with one query) are in bench/decode_attention.py, run in the same call.
void bench_decode_attention() {
  Generator gen(9);
  for (const auto& [b, ctx] : std::vector<std::pair<int64_t, int64_t>>{{1, 1024}, {1, 4096}, {1, 16384}, {1, 65536},
                                                                        {8, 4096}, {32, 1024}, {32, 4096}, {128, 1024}}) {
    const int64_t hq = 32, hkv = 8, d = 128;
    const Tensor q = Tensor::randn({b, hq, d}, DType::bf16, kDev, gen);
    const Tensor kc = Tensor::randn({b, hkv, ctx, d}, DType::bf16, kDev, gen);
    const Tensor vc = Tensor::randn({b, hkv, ctx, d}, DType::bf16, kDev, gen);
    std::vector<int64_t> rows(static_cast<size_t>(b)), lengths(static_cast<size_t>(b), ctx);
    for (int64_t i = 0; i < b; ++i) rows[static_cast<size_t>(i)] = i;
    const Tensor rt = Tensor::from_i64(rows, {b}, DType::i32, kDev), lt = Tensor::from_i64(lengths, {b}, DType::i32, kDev);
    const double gbytes = 2.0 * b * hkv * ctx * d * 2 / 1e9;
    row(fmt::format("decode_attn b{} ctx{}", b, ctx), "kcpp",
        [&] { (void)ops::decode_attention(q, kc, vc, rt, lt, 1.0 / std::sqrt(128.0), 0, ctx); }, gbytes);
  }
}

// A decode step's projections (ops::matmul with M <= 8 rows: ops/cuda/gemv.cu), bf16, at the
// Qwen3-0.6B and Llama-3.2-1B dimensions.  Traffic: the weight once.  The peer (PyTorch's F.linear,
// cuBLAS) is in bench/gemv.py, run in the same call.
void bench_gemv() {
  Generator gen(10);
  struct Shape3 {
    int64_t m, n, k;
    const char* what;
  };
  for (const Shape3& c : {Shape3{1, 4096, 1024, "qwen3 qkv"}, Shape3{1, 1024, 2048, "qwen3 o"}, Shape3{1, 6144, 1024, "qwen3 gate_up"},
                          Shape3{1, 1024, 3072, "qwen3 down"}, Shape3{1, 151936, 1024, "qwen3 lm_head"},
                          Shape3{1, 3072, 2048, "llama qkv"}, Shape3{1, 16384, 2048, "llama gate_up"},
                          Shape3{1, 2048, 8192, "llama down"}, Shape3{8, 6144, 1024, "qwen3 gate_up"},
                          Shape3{8, 16384, 2048, "llama gate_up"}}) {
    const Tensor a = Tensor::randn({c.m, c.k}, DType::bf16, kDev, gen), w = Tensor::randn({c.n, c.k}, DType::bf16, kDev, gen);
    row(fmt::format("gemv m{} {}x{} {}", c.m, c.n, c.k, c.what), "kcpp", [&] { (void)ops::matmul(a, w, false, true); },
        2.0 * c.n * c.k / 1e9);
  }
}

// The fused decode projections (ops/nn/decode_fused.h) at one row, bf16, beside the composition
// they replace (add_rms_norm + gemv, glu_packed + gemv) at the Qwen3-0.6B and Llama-3.2-1B decode
// shapes: add + norm + qkv and add + norm + gate/up, gated activation + down.  Traffic: the weight
// once plus the rows read and written.
void bench_decode_fused() {
  Generator gen(11);
  struct Model {
    const char* name;
    int64_t hidden, qkv, inter;
  };
  ops::RMSNormOptions opt;
  opt.eps = 1e-6;
  for (const Model& m : {Model{"qwen3", 1024, 4096, 3072}, Model{"llama", 2048, 3072, 8192}}) {
    const int64_t h = m.hidden;
    const Tensor x = Tensor::randn({1, h}, DType::bf16, kDev, gen), delta = Tensor::randn({1, h}, DType::bf16, kDev, gen);
    const Tensor wn = Tensor::randn({h}, DType::bf16, kDev, gen);
    for (const auto& [what, n] : {std::pair{"qkv", m.qkv}, std::pair{"gate_up", 2 * m.inter}}) {
      const Tensor w = Tensor::randn({n, h}, DType::bf16, kDev, gen);
      const double gb = (2.0 * n * h + 2.0 * 4 * h + 2.0 * n) / 1e9;
      const std::string op = fmt::format("add_norm_gemv {}x{} {} {}", n, h, m.name, what);
      row(op, "fused", [&] { (void)ops::add_rms_norm_linear(x, delta, wn, opt, w); }, gb);
      row(op, "unfused", [&] { (void)ops::matmul(ops::add_rms_norm(x, delta, wn, opt).second, w, false, true); }, gb);
    }
    const Tensor gu = Tensor::randn({1, 2 * m.inter}, DType::bf16, kDev, gen);
    const Tensor wd = Tensor::randn({h, m.inter}, DType::bf16, kDev, gen);
    const double gb = (2.0 * h * m.inter + 2.0 * 2 * m.inter + 2.0 * h) / 1e9;
    const std::string op = fmt::format("glu_gemv {}x{} {} down", h, m.inter, m.name);
    row(op, "fused", [&] { (void)ops::glu_linear(gu, ops::GluActivation::Silu, wd); }, gb);
    row(op, "unfused", [&] { (void)ops::matmul(ops::glu_packed(gu, ops::GluActivation::Silu), wd, false, true); }, gb);
  }
}

// The prefill's elementwise kernels (ops/nn/decode_fused.h) at one 2,048-token prompt of the
// Qwen3-0.6B and Llama-3.2-1B dimensions, bf16: the q / k norms + RoPE + cache append, the gated
// activation of the fused gate/up and the residual add + norm; then the gate/up product with its
// activation (linear_glu) beside cuBLAS at 256 to 2,048 rows, and the q / k / v product with the
// norms, RoPE and the cache write (linear_qk_norm_rope_cache) beside cuBLAS + qk_norm_rope_cache.  Traffic: every input read once and
// every output written once.  Timed as do_bench does (the L2 dirty, as after the projection that
// feeds each kernel in a prefill).
void bench_prefill() {
  Generator gen(12);
  struct Model {
    const char* name;
    int64_t hidden, hq, hkv, d, inter;
    bool qk_norm;
  };
  ops::RMSNormOptions opt;
  opt.eps = 1e-6;
  const int64_t n = 2048;
  for (const Model& m : {Model{"qwen3", 1024, 16, 8, 128, 3072, true}, Model{"llama", 2048, 32, 8, 64, 8192, false}}) {
    const int64_t heads = m.hq + 2 * m.hkv;
    const Tensor qkv = Tensor::randn({n, heads, m.d}, DType::bf16, kDev, gen);
    ops::QkNormRopeCache qo;
    qo.q_heads = m.hq, qo.kv_heads = m.hkv;
    if (m.qk_norm) qo.q_norm = Tensor::randn({m.d}, DType::bf16, kDev, gen), qo.k_norm = Tensor::randn({m.d}, DType::bf16, kDev, gen);
    qo.norm = opt;
    const Tensor cos = Tensor::randn({n, 1, m.d}, DType::bf16, kDev, gen), sin = Tensor::randn({n, 1, m.d}, DType::bf16, kDev, gen);
    const Tensor kc = Tensor::empty({1, m.hkv, n, m.d}, DType::bf16, kDev), vc = Tensor::empty({1, m.hkv, n, m.d}, DType::bf16, kDev);
    std::vector<int64_t> pos(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) pos[static_cast<size_t>(i)] = i;
    const Tensor rows = Tensor::zeros({n}, DType::i32, kDev), positions = Tensor::from_i64(pos, {n}, DType::i32, kDev);
    row(fmt::format("prefill qk_norm_rope_cache {}", m.name), "kcpp",
        [&] { (void)ops::qk_norm_rope_cache(qkv, qo, cos, sin, kc, vc, rows, positions); },
        (2.0 * 2 * n * heads * m.d + 2.0 * 2 * n * m.d) / 1e9);
    const Tensor gu = Tensor::randn({n, 2 * m.inter}, DType::bf16, kDev, gen);
    row(fmt::format("prefill glu_packed {}", m.name), "kcpp", [&] { (void)ops::glu_packed(gu, ops::GluActivation::Silu); },
        2.0 * 3 * n * m.inter / 1e9);
    const Tensor x = Tensor::randn({n, m.hidden}, DType::bf16, kDev, gen), delta = Tensor::randn({n, m.hidden}, DType::bf16, kDev, gen);
    const Tensor w = Tensor::randn({m.hidden}, DType::bf16, kDev, gen);
    row(fmt::format("prefill add_rms_norm {}", m.name), "kcpp", [&] { (void)ops::add_rms_norm(x, delta, w, opt); },
        2.0 * 4 * n * m.hidden / 1e9);
    // The MLP's gate/up projection and its activation: linear_glu's one kernel (the Hopper GEMM with
    // the activation in its epilogue) against cuBLAS's product + glu_packed, and cuBLAS's product
    // alone, at a prompt's rows.
    const Tensor wgu = ops::scale(Tensor::randn({2 * m.inter, m.hidden}, DType::bf16, kDev, gen), 0.03);
    for (const int64_t rows : {int64_t{256}, int64_t{512}, int64_t{1024}, n}) {
      const Tensor xr = x.narrow(0, 0, rows);
      const double tflop = 2.0 * rows * m.hidden * 2 * m.inter / 1e12;
      const std::string op = fmt::format("prefill gate_up {} {}", m.name, rows);
      flop_row(op, "linear_glu", [&] { (void)ops::linear_glu(xr, wgu, ops::GluActivation::Silu, ops::FusedGemmPath::Kernel); },
               tflop, 0.0);
      flop_row(op, "cublas+glu", [&] { (void)ops::glu_packed(ops::matmul(xr, wgu, false, true), ops::GluActivation::Silu); },
               tflop, 0.0);
      flop_row(op, "cublas", [&] { (void)ops::matmul(xr, wgu, false, true); }, tflop, 0.0);
    }
    // The attention's q / k / v product with the norms, RoPE and the cache write: one kernel
    // (linear_qk_norm_rope_cache) against cuBLAS + qk_norm_rope_cache, and cuBLAS alone.
    const Tensor wqkv = ops::scale(Tensor::randn({heads * m.d, m.hidden}, DType::bf16, kDev, gen), 0.03);
    const double qkv_tflop = 2.0 * n * m.hidden * heads * m.d / 1e12;
    const std::string qop = fmt::format("prefill qkv {} {}", m.name, n);
    flop_row(qop, "fused", [&] {
      (void)ops::linear_qk_norm_rope_cache(x, wqkv, qo, cos, sin, kc, vc, rows, positions, ops::FusedGemmPath::Kernel);
    }, qkv_tflop, 0.0);
    flop_row(qop, "cublas+qk", [&] {
      (void)ops::qk_norm_rope_cache(ops::matmul(x, wqkv, false, true).view({n, heads, m.d}), qo, cos, sin, kc, vc, rows, positions);
    }, qkv_tflop, 0.0);
    flop_row(qop, "cublas", [&] { (void)ops::matmul(x, wqkv, false, true); }, qkv_tflop, 0.0);
  }
}

// The embedding's backward at the data-parallel trainer's sparse path: 16,384 gradient rows of
// 4096 bf16 summed into Llama-3's 128,256 rows.  Ids: uniform over the vocabulary (mostly
// singletons); byte-level text (256 distinct ids, Zipf-like: the r-th most frequent has weight
// 1 / r, its runs thousands of rows); one id for every token.  "kernel": the launcher, ids
// unchecked (no wait for the device), on an output zeroed once (it writes only the touched rows),
// bytes the gradient read once and the touched rows written once.  "op": ops::embedding_backward as
// the models call it (ids checked: the host waits for the device), which also zero-fills the
// [V, H] result, bytes the gradient read once and [V, H] written once.
void bench_embedding() {
  const int64_t n = 16384, h = 4096, v = 128256;
  Generator gen(17);
  const Tensor g = Tensor::randn({n, h}, DType::bf16, kDev, gen);
  std::mt19937_64 rng(5);
  std::vector<double> cdf;
  double total = 0;
  for (int r = 1; r <= 256; ++r) cdf.push_back(total += 1.0 / r);
  struct Dist {
    const char* name;
    std::vector<int64_t> ids;
  };
  std::vector<Dist> dists(3);
  dists[0].name = "uniform", dists[1].name = "zipf256", dists[2].name = "one id";
  for (int64_t i = 0; i < n; ++i) {
    dists[0].ids.push_back(static_cast<int64_t>(rng() % v));
    const double x = std::uniform_real_distribution<double>(0, total)(rng);
    const auto r = std::lower_bound(cdf.begin(), cdf.end(), x) - cdf.begin();
    dists[1].ids.push_back(1000 + 397 * r);  // 256 ids spread over the vocabulary
    dists[2].ids.push_back(128000);
  }
  for (const Dist& d : dists) {
    std::vector<char> seen(static_cast<size_t>(v));
    int64_t touched = 0;
    for (int64_t id : d.ids) touched += seen[id] ? 0 : (seen[id] = 1);
    const Tensor ids = Tensor::from_i64(d.ids, {n}, DType::i64, kDev);
    const Tensor out = Tensor::zeros({v, h}, DType::bf16, kDev);
    const double grad_gb = double(n) * h * 2 / 1e9;
    std::printf("embedding bwd %s: %lld distinct ids\n", d.name, static_cast<long long>(touched));
    row(fmt::format("emb bwd {} kernel", d.name), "reference", [&] { ops::cuda::embedding_backward(out, g, ids, false); },
        grad_gb + double(touched) * h * 2 / 1e9);
    row(fmt::format("emb bwd {} op", d.name), "reference", [&] { (void)ops::embedding_backward(g, ids, v); },
        grad_gb + double(v) * h * 2 / 1e9);
  }
}

int main(int argc, char** argv) {
  ::setenv("KCPP_GEMV", "8", 0);  // bench_gemv's eight-row shapes on the gemv path (default: one row)
  std::string json_path, only;
  bool sweep = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc) json_path = argv[i + 1];
    if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc) only = argv[i + 1];  // sections, e.g. rms_norm,rope
    if (std::strcmp(argv[i], "--sweep") == 0) sweep = true;
  }
  auto want = [&](const char* section) { return only.empty() || ("," + only + ",").find(fmt::format(",{},", section)) != std::string::npos; };
  try {
    if (cuda_device_count() == 0) {
      std::puts("kcpp_bench_kernels: skipped: no CUDA device");
      return 0;
    }
    bench_copy();
    if (want("rms_norm")) bench_rms_norm();
    if (want("layer_norm")) bench_layer_norm();
    if (want("swiglu")) bench_swiglu();
    if (want("rope")) bench_rope();
    if (want("cross_entropy")) bench_cross_entropy();
    if (want("activation")) bench_activation();
    if (want("flce")) bench_flce(sweep);
    if (want("attention")) bench_attention();
    if (want("decode_attention")) bench_decode_attention();
    if (want("gemv")) bench_gemv();
    if (want("gemv") || want("decode_fused")) bench_decode_fused();
    if (want("embedding")) bench_embedding();
    if (want("prefill")) bench_prefill();
    if (sweep) {
      if (want("rms_norm")) sweep_rms_norm();
      if (want("swiglu")) sweep_swiglu();
      if (want("rope")) sweep_rope();
      if (want("layer_norm")) sweep_layer_norm();
      if (want("cross_entropy")) sweep_cross_entropy();
      if (want("activation")) sweep_activation();
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kcpp_bench_kernels: error: %s\n", e.what());
    return 1;
  }
  if (!json_path.empty()) std::ofstream(json_path) << g_rows.dump(1) << "\n";
  return 0;
}
