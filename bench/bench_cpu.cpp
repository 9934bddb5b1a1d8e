// Google Benchmark on the CPU at 1024 x 4096: the reference (eager) compositions and the kernel
// packages' CPU kernels side by side.  Issue 4's bar: each kernel at least 3x faster than the
// reference on the 2-core CI machine.  Run: build/release/bin/kcpp_bench_cpu
#include <benchmark/benchmark.h>

#include <string>
#include <utility>
#include <vector>

#include "core/random.h"
#include "ops/nn/glu.h"
#include "ops/nn/layer_norm.h"
#include "ops/nn/rms_norm.h"
#include "ops/ops.h"
#include "kernel_params.h"
#include "cross_entropy/cross_entropy.h"
#include "fused_linear_ce/fused_linear_ce.h"
#include "glu/glu.h"
#include "ops/nn/cross_entropy.h"
#include "ops/nn/rope.h"
#include "rms_norm/rms_norm.h"
#include "rope/rope.h"
#include "built_packages.h"
#include "nn/kernel_call.h"

namespace {
using namespace kcpp;

constexpr int64_t kRows = 1024, kHidden = 4096;

struct RMSNormCase {
  Tensor x, w, dy;
  test::RMSNormTensors t;
  liger::RMSNormParams p;
  explicit RMSNormCase(DType dt) {
    Generator gen(1);
    x = Tensor::randn({kRows, kHidden}, dt, Device::cpu(), gen);
    w = Tensor::randn({kHidden}, dt, Device::cpu(), gen);
    dy = Tensor::randn({kRows, kHidden}, dt, Device::cpu(), gen);
    t = test::rms_norm_tensors(x, w, dy);
    p = test::rms_norm_params(t);
  }
};

void BM_rms_norm_fwd_reference(benchmark::State& st) {
  RMSNormCase c(static_cast<DType>(st.range(0)));
  for (auto _ : st) benchmark::DoNotOptimize(ops::rms_norm_forward(c.x, c.w).y.data());
  st.SetBytesProcessed(st.iterations() * 2 * c.x.nbytes());
}
void BM_rms_norm_fwd_kernel(benchmark::State& st) {
  RMSNormCase c(static_cast<DType>(st.range(0)));
  for (auto _ : st) {
    if (const char* e = liger::rms_norm_forward_cpu(c.p)) st.SkipWithError(e);
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(st.iterations() * 2 * c.x.nbytes());
}
void BM_rms_norm_fwd_bwd_reference(benchmark::State& st) {
  RMSNormCase c(static_cast<DType>(st.range(0)));
  for (auto _ : st) {
    const auto f = ops::rms_norm_forward(c.x, c.w);
    benchmark::DoNotOptimize(ops::rms_norm_backward(c.dy, c.x, c.w, f.rstd).dx.data());
  }
  st.SetBytesProcessed(st.iterations() * 5 * c.x.nbytes());
}
void BM_rms_norm_fwd_bwd_kernel(benchmark::State& st) {
  RMSNormCase c(static_cast<DType>(st.range(0)));
  for (auto _ : st) {
    if (const char* e = liger::rms_norm_forward_cpu(c.p)) st.SkipWithError(e);
    if (const char* e = liger::rms_norm_backward_cpu(c.p)) st.SkipWithError(e);
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(st.iterations() * 5 * c.x.nbytes());
}

#define KCPP_DTYPES ->Arg(static_cast<int>(DType::f32))->Arg(static_cast<int>(DType::bf16))->Unit(benchmark::kMillisecond)
BENCHMARK(BM_rms_norm_fwd_reference) KCPP_DTYPES;
BENCHMARK(BM_rms_norm_fwd_kernel) KCPP_DTYPES;
BENCHMARK(BM_rms_norm_fwd_bwd_reference) KCPP_DTYPES;
BENCHMARK(BM_rms_norm_fwd_bwd_kernel) KCPP_DTYPES;

struct GluCase {
  Tensor g, u, d, out, dg, du;
  explicit GluCase(DType dt) {
    Generator gen(2);
    g = Tensor::randn({kRows, kHidden}, dt, Device::cpu(), gen);
    u = Tensor::randn({kRows, kHidden}, dt, Device::cpu(), gen);
    d = Tensor::randn({kRows, kHidden}, dt, Device::cpu(), gen);
    out = Tensor::empty({kRows, kHidden}, dt);
    dg = Tensor::empty({kRows, kHidden}, dt);
    du = Tensor::empty({kRows, kHidden}, dt);
  }
};

// GLU (package "liger", glu/): SwiGLU, GeGLU exact, GeGLU tanh; registered in main().
struct GluKind {
  const char* name;  // benchmark name stem
  ops::GluActivation act;
};
constexpr GluKind kGlus[] = {{"swiglu", ops::GluActivation::Silu},
                             {"geglu", ops::GluActivation::Gelu},
                             {"geglu_tanh", ops::GluActivation::GeluTanh}};

void glu_fwd_reference(benchmark::State& st, ops::GluActivation act) {
  GluCase c(static_cast<DType>(st.range(0)));
  for (auto _ : st) benchmark::DoNotOptimize(ops::glu_forward(c.g, c.u, act).data());
  st.SetBytesProcessed(st.iterations() * 3 * c.g.nbytes());
}
void glu_fwd_kernel(benchmark::State& st, ops::GluActivation act) {
  GluCase c(static_cast<DType>(st.range(0)));
  const liger::GluParams p = test::glu_params(c.g, c.u, act, c.out);
  for (auto _ : st) {
    if (const char* e = liger::glu_forward_cpu(p)) st.SkipWithError(e);
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(st.iterations() * 3 * c.g.nbytes());
}
void glu_fwd_bwd_reference(benchmark::State& st, ops::GluActivation act) {
  GluCase c(static_cast<DType>(st.range(0)));
  for (auto _ : st) {
    benchmark::DoNotOptimize(ops::glu_forward(c.g, c.u, act).data());
    benchmark::DoNotOptimize(ops::glu_backward(c.d, c.g, c.u, act).dgate.data());
  }
  st.SetBytesProcessed(st.iterations() * 8 * c.g.nbytes());
}
void glu_fwd_bwd_kernel(benchmark::State& st, ops::GluActivation act) {
  GluCase c(static_cast<DType>(st.range(0)));
  const liger::GluParams f = test::glu_params(c.g, c.u, act, c.out);
  const liger::GluParams b = test::glu_params(c.g, c.u, act, {}, c.d, c.dg, c.du);
  for (auto _ : st) {
    if (const char* e = liger::glu_forward_cpu(f)) st.SkipWithError(e);
    if (const char* e = liger::glu_backward_cpu(b)) st.SkipWithError(e);
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(st.iterations() * 8 * c.g.nbytes());
}

// RoPE: 1024 tokens, 32 query and 8 key heads of 128 (HF layout), cos/sin shared by the batch.
struct RopeCase {
  Tensor q, k, qo, ko, cos, sin;
  explicit RopeCase(DType dt) {
    Generator gen(3);
    q = Tensor::randn({1, 32, 1024, 128}, dt, Device::cpu(), gen);
    k = Tensor::randn({1, 8, 1024, 128}, dt, Device::cpu(), gen);
    qo = Tensor::empty(q.shape(), dt);
    ko = Tensor::empty(k.shape(), dt);
    std::vector<int64_t> pos(1024);
    for (int64_t i = 0; i < 1024; ++i) pos[i] = i;
    const auto cs = ops::rope_cos_sin(Tensor::from_i64(pos, {1, 1024}), ops::rope_inv_freq(128, 10000.0, Device::cpu()), 1.0, dt);
    cos = cs.cos;
    sin = cs.sin;
  }
  int64_t bytes() const { return 2 * static_cast<int64_t>(q.nbytes() + k.nbytes()); }
};
void BM_rope_fwd_reference(benchmark::State& st) {
  RopeCase c(static_cast<DType>(st.range(0)));
  for (auto _ : st) {
    benchmark::DoNotOptimize(ops::rope_forward(c.q, c.cos, c.sin).data());
    benchmark::DoNotOptimize(ops::rope_forward(c.k, c.cos, c.sin).data());
  }
  st.SetBytesProcessed(st.iterations() * c.bytes());
}
void BM_rope_fwd_kernel(benchmark::State& st) {
  RopeCase c(static_cast<DType>(st.range(0)));
  const auto p = test::rope_params(c.q, c.qo, c.k, c.ko, c.cos, c.sin, ops::RopeLayout::RotateHalf);
  for (auto _ : st) {
    if (const char* e = liger::rope_forward_cpu(p)) st.SkipWithError(e);
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(st.iterations() * c.bytes());
}
void BM_rope_fwd_bwd_reference(benchmark::State& st) {
  RopeCase c(static_cast<DType>(st.range(0)));
  for (auto _ : st) {
    benchmark::DoNotOptimize(ops::rope_forward(c.q, c.cos, c.sin).data());
    benchmark::DoNotOptimize(ops::rope_forward(c.k, c.cos, c.sin).data());
    benchmark::DoNotOptimize(ops::rope_backward(c.qo, c.cos, c.sin).data());
    benchmark::DoNotOptimize(ops::rope_backward(c.ko, c.cos, c.sin).data());
  }
  st.SetBytesProcessed(st.iterations() * 2 * c.bytes());
}
// The backward rotates the output gradients (here qo / ko stand in for them) into q / k's shapes.
void BM_rope_fwd_bwd_kernel(benchmark::State& st) {
  RopeCase c(static_cast<DType>(st.range(0)));
  const Tensor dq = Tensor::empty(c.q.shape(), c.q.dtype()), dk = Tensor::empty(c.k.shape(), c.k.dtype());
  const auto f = test::rope_params(c.q, c.qo, c.k, c.ko, c.cos, c.sin, ops::RopeLayout::RotateHalf);
  const auto b = test::rope_params(c.qo, dq, c.ko, dk, c.cos, c.sin, ops::RopeLayout::RotateHalf);
  for (auto _ : st) {
    if (const char* e = liger::rope_forward_cpu(f)) st.SkipWithError(e);
    if (const char* e = liger::rope_backward_cpu(b)) st.SkipWithError(e);
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(st.iterations() * 2 * c.bytes());
}
BENCHMARK(BM_rope_fwd_reference) KCPP_DTYPES;
BENCHMARK(BM_rope_fwd_kernel) KCPP_DTYPES;
BENCHMARK(BM_rope_fwd_bwd_reference) KCPP_DTYPES;
BENCHMARK(BM_rope_fwd_bwd_kernel) KCPP_DTYPES;

// Cross-entropy: 256 rows of a 32000-word vocabulary, mean, loss and gradient.
struct CECase {
  Tensor logits, targets, loss, grad;
  explicit CECase(DType dt) {
    Generator gen(4);
    logits = Tensor::randn({256, 32000}, dt, Device::cpu(), gen);
    targets = Tensor::randint({256}, 0, 32000, DType::i64, Device::cpu(), gen);
    loss = Tensor::empty({1}, DType::f32);
    grad = Tensor::empty({256, 32000}, dt);
  }
};
void BM_ce_fwd_bwd_reference(benchmark::State& st) {
  CECase c(static_cast<DType>(st.range(0)));
  const Tensor one = Tensor::full({}, 1.0, c.logits.dtype());
  for (auto _ : st) {
    const auto f = ops::cross_entropy_forward(c.logits, c.targets);
    benchmark::DoNotOptimize(ops::cross_entropy_backward(one, f.log_probs, c.targets).data());
  }
  st.SetBytesProcessed(st.iterations() * 2 * c.logits.nbytes());
}
// The kernel with a softcap (0: none) and label smoothing.
void ce_kernel(benchmark::State& st, double softcap, double smoothing) {
  CECase c(static_cast<DType>(st.range(0)));
  ops::CrossEntropyOptions o;
  o.label_smoothing = smoothing;
  auto p = test::cross_entropy_params(c.logits, c.targets, o, c.loss, c.grad);
  p.softcap = static_cast<float>(softcap);
  for (auto _ : st) {
    if (const char* e = liger::cross_entropy_cpu(p)) st.SkipWithError(e);
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(st.iterations() * 2 * c.logits.nbytes());
}
void BM_ce_fwd_bwd_kernel(benchmark::State& st) { ce_kernel(st, 0.0, 0.0); }
BENCHMARK(BM_ce_fwd_bwd_reference) KCPP_DTYPES;
BENCHMARK(BM_ce_fwd_bwd_kernel) KCPP_DTYPES;

// Cross-entropy with a softcap (Gemma 2's 30) and label smoothing 0.1: the eager composition caps the
// logits (c tanh(z / c)), runs the cross-entropy on them and chains the gradient back through the tanh.
constexpr double kCap = 30.0, kSmooth = 0.1;
void BM_ce_softcap_fwd_bwd_reference(benchmark::State& st) {
  CECase c(static_cast<DType>(st.range(0)));
  const Tensor one = Tensor::full({}, 1.0, c.logits.dtype());
  ops::CrossEntropyOptions o;
  o.label_smoothing = kSmooth;
  for (auto _ : st) {
    const Tensor t = ops::tanh(ops::scale(c.logits, 1.0 / kCap));
    const auto f = ops::cross_entropy_forward(ops::scale(t, kCap), c.targets, o);
    const Tensor g = ops::cross_entropy_backward(one, f.log_probs, c.targets, o);
    benchmark::DoNotOptimize(ops::mul(g, ops::add_scalar(ops::neg(ops::square(t)), 1.0)).data());
  }
  st.SetBytesProcessed(st.iterations() * 2 * c.logits.nbytes());
}
void BM_ce_softcap_fwd_bwd_kernel(benchmark::State& st) { ce_kernel(st, kCap, kSmooth); }
BENCHMARK(BM_ce_softcap_fwd_bwd_reference) KCPP_DTYPES;
BENCHMARK(BM_ce_softcap_fwd_bwd_kernel) KCPP_DTYPES;

// Fused linear cross-entropy, hidden [256, 512] and weight [32000, 512], mean, loss and the gradients
// of hidden and weight, against the eager composition (matmul, cross-entropy forward and backward,
// two matmuls; OpenBLAS under both).  Bytes: not counted (the GEMMs bound it); 6 n h v flops.
struct FlceCase {
  Tensor hidden, weight, targets, loss, dhidden, dweight, ws;
  liger::FusedLinearCEParams p;
  explicit FlceCase(DType dt) {
    const int64_t n = 256, h = 512, v = 32000;
    Generator gen(7);
    hidden = Tensor::randn({n, h}, dt, Device::cpu(), gen);
    weight = ops::scale(Tensor::randn({v, h}, dt, Device::cpu(), gen), 0.05);
    targets = Tensor::randint({n}, 0, v, DType::i64, Device::cpu(), gen);
    loss = Tensor::empty({1}, DType::f32);
    dhidden = Tensor::empty({n, h}, dt);
    dweight = Tensor::empty({v, h}, dt);
    p.dtype = test::kernel_dtype(dt);
    p.n = n, p.h = h, p.v = v;
    p.hidden = hidden.data(), p.hidden_stride = h;
    p.weight = weight.data(), p.weight_stride = h;
    p.targets = targets.data();
    p.loss = static_cast<float*>(loss.data());
    p.dhidden = dhidden.data(), p.dhidden_stride = h;
    p.dweight = dweight.data();
    ws = Tensor::empty({static_cast<int64_t>(liger::fused_linear_ce_workspace(p, false))}, DType::u8);
    p.workspace = ws.data();
  }
  double flops() const { return 6.0 * hidden.size(0) * hidden.size(1) * weight.size(0); }
};
void BM_flce_fwd_bwd_reference(benchmark::State& st) {
  FlceCase c(static_cast<DType>(st.range(0)));
  const Tensor one = Tensor::full({}, 1.0, c.hidden.dtype());
  for (auto _ : st) {
    const auto f = ops::cross_entropy_forward(ops::matmul(c.hidden, c.weight, false, true), c.targets);
    const Tensor g = ops::cross_entropy_backward(one, f.log_probs, c.targets);
    benchmark::DoNotOptimize(ops::matmul(g, c.weight).data());
    benchmark::DoNotOptimize(ops::matmul(g, c.hidden, true, false).data());
  }
  st.counters["flops"] = benchmark::Counter(c.flops(), benchmark::Counter::kIsIterationInvariantRate);
}
void BM_flce_fwd_bwd_kernel(benchmark::State& st) {
  FlceCase c(static_cast<DType>(st.range(0)));
  for (auto _ : st) {
    if (const char* e = liger::fused_linear_ce_cpu(c.p)) st.SkipWithError(e);
    benchmark::ClobberMemory();
  }
  st.counters["flops"] = benchmark::Counter(c.flops(), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_flce_fwd_bwd_reference) KCPP_DTYPES;
BENCHMARK(BM_flce_fwd_bwd_kernel) KCPP_DTYPES;

// Package "activation" through the ABI (as a host calls it): SiluAndMul on x [1024, 2 x 4096] and the
// plain GeluTanh on [1024, 4096], against the eager compositions.
struct ActCase {
  Tensor x, y, dy, dx;
  nn::KernelLayer layer;
  bool gated;
  ActCase(DType dt, const char* name, bool g)
      : layer(nn::KernelLayer::find(test::built_package("activation"), name)), gated(g) {
    Generator gen(5);
    const int64_t xw = g ? 2 * kHidden : kHidden;
    x = Tensor::randn({kRows, xw}, dt, Device::cpu(), gen);
    y = Tensor::empty({kRows, kHidden}, dt);
    dy = Tensor::randn({kRows, kHidden}, dt, Device::cpu(), gen);
    dx = Tensor::empty({kRows, xw}, dt);
  }
  void forward() const {
    nn::KernelArgs a;
    a.tensor("x", x).tensor("y", y);
    layer.forward(a, Device::cpu(), KCPP_MODE_TRAINING);
  }
  void backward() const {
    nn::KernelArgs a;
    a.tensor("dy", dy).tensor("x", x).tensor("dx", dx);
    layer.backward(a, Device::cpu(), KCPP_MODE_TRAINING);
  }
  Tensor gate() const { return gated ? x.narrow(1, 0, kHidden) : x; }
  Tensor up() const { return x.narrow(1, kHidden, kHidden); }
  // Bytes moved: forward reads x and writes y; backward reads dy and x and writes dx.
  int64_t fwd_bytes() const { return static_cast<int64_t>(x.nbytes() + y.nbytes()); }
  int64_t bwd_bytes() const { return static_cast<int64_t>(2 * x.nbytes() + dy.nbytes()); }
};

// Every kernel of the package, against its eager composition (QuickGELU: x * sigmoid(1.702 x) and
// the backward autograd would run, five elementwise ops).  FastGELU and NewGELU are GeluTanh under
// other names (the same kernel), so they are not repeated.  Registered in main().
struct ActKind {
  const char* name;  // benchmark name stem
  const char* layer;
  bool gated;
  ops::GluActivation glu;  // gated: the GLU form of the reference
};
constexpr ActKind kActs[] = {
    {"silu", "SiLU", false, ops::GluActivation::Silu},
    {"gelu", "GeLU", false, ops::GluActivation::Gelu},
    {"gelu_tanh", "GeluTanh", false, ops::GluActivation::GeluTanh},
    {"quick_gelu", "QuickGELU", false, ops::GluActivation::Silu},
    {"silu_and_mul", "SiluAndMul", true, ops::GluActivation::Silu},
    {"gelu_and_mul", "GeluAndMul", true, ops::GluActivation::Gelu},
    {"gelu_tanh_and_mul", "GeluTanhAndMul", true, ops::GluActivation::GeluTanh},
};

Tensor act_reference(const ActKind& k, const ActCase& c) {
  if (k.gated) return ops::glu_forward(c.gate(), c.up(), k.glu);
  switch (k.layer[0]) {
    case 'Q': return ops::mul(c.x, ops::sigmoid(ops::scale(c.x, 1.702)));
    case 'S': return ops::silu(c.x);
    default: return ops::gelu(c.x, k.glu == ops::GluActivation::GeluTanh);
  }
}
Tensor act_reference_backward(const ActKind& k, const ActCase& c) {
  if (k.gated) return ops::glu_backward(c.dy, c.gate(), c.up(), k.glu).dgate;
  switch (k.layer[0]) {
    case 'Q': {  // d/dx x s(a x) = s + a x s (1 - s)
      const Tensor ax = ops::scale(c.x, 1.702), s = ops::sigmoid(ax);
      return ops::mul(c.dy, ops::add(s, ops::mul(ops::mul(ax, s), ops::add_scalar(ops::neg(s), 1.0))));
    }
    case 'S': return ops::silu_backward(c.dy, c.x);
    default: return ops::gelu_backward(c.dy, c.x, k.glu == ops::GluActivation::GeluTanh);
  }
}
void act_fwd_reference(benchmark::State& st, const ActKind& k) {
  ActCase c(static_cast<DType>(st.range(0)), k.layer, k.gated);
  for (auto _ : st) benchmark::DoNotOptimize(act_reference(k, c).data());
  st.SetBytesProcessed(st.iterations() * c.fwd_bytes());
}
void act_fwd_kernel(benchmark::State& st, const ActKind& k) {
  ActCase c(static_cast<DType>(st.range(0)), k.layer, k.gated);
  for (auto _ : st) c.forward();
  st.SetBytesProcessed(st.iterations() * c.fwd_bytes());
}
void act_fwd_bwd_reference(benchmark::State& st, const ActKind& k) {
  ActCase c(static_cast<DType>(st.range(0)), k.layer, k.gated);
  for (auto _ : st) {
    benchmark::DoNotOptimize(act_reference(k, c).data());
    benchmark::DoNotOptimize(act_reference_backward(k, c).data());
  }
  st.SetBytesProcessed(st.iterations() * (c.fwd_bytes() + c.bwd_bytes()));
}
void act_fwd_bwd_kernel(benchmark::State& st, const ActKind& k) {
  ActCase c(static_cast<DType>(st.range(0)), k.layer, k.gated);
  for (auto _ : st) {
    c.forward();
    c.backward();
  }
  st.SetBytesProcessed(st.iterations() * (c.fwd_bytes() + c.bwd_bytes()));
}

// Package "liger" through the ABI: LayerNorm (with bias) and AddRMSNorm at 1024 x 4096, against the
// eager compositions.  Bytes: LayerNorm as RMSNorm (forward 2, forward + backward 5 units of x);
// AddRMSNorm forward reads x and residual and writes r and y (4 units), backward reads dy,
// dresidual_out and r and writes dx (4 units).
struct NormCase {
  Tensor x, res, w, b, dy, dres, y, r, mean, rstd, dx, dw, db;
  nn::KernelLayer layer;
  bool add;
  NormCase(DType dt, bool add_rms)
      : layer(nn::KernelLayer::find(test::built_package("liger"), add_rms ? "LigerAddRMSNorm" : "LigerLayerNorm")),
        add(add_rms) {
    Generator gen(6);
    x = Tensor::randn({kRows, kHidden}, dt, Device::cpu(), gen);
    res = Tensor::randn({kRows, kHidden}, dt, Device::cpu(), gen);
    w = Tensor::randn({kHidden}, dt, Device::cpu(), gen);
    b = Tensor::randn({kHidden}, dt, Device::cpu(), gen);
    dy = Tensor::randn({kRows, kHidden}, dt, Device::cpu(), gen);
    dres = Tensor::randn({kRows, kHidden}, dt, Device::cpu(), gen);
    y = Tensor::empty({kRows, kHidden}, dt);
    r = Tensor::empty({kRows, kHidden}, dt);
    dx = Tensor::empty({kRows, kHidden}, dt);
    dw = Tensor::empty({kHidden}, dt);
    db = Tensor::empty({kHidden}, dt);
    mean = Tensor::empty({kRows}, DType::f32);
    rstd = Tensor::empty({kRows}, DType::f32);
  }
  void forward() const {
    nn::KernelArgs a;
    if (add) a.tensor("x", x).tensor("residual", res).tensor("residual_out", r);
    else a.tensor("x", x).tensor("bias", b).tensor("mean", mean);
    a.tensor("weight", w).tensor("y", y).tensor("rstd", rstd);
    layer.forward(a, Device::cpu(), KCPP_MODE_TRAINING);
  }
  void backward() const {
    nn::KernelArgs a;
    if (add) a.tensor("residual_out", r).tensor("dresidual_out", dres);
    else a.tensor("x", x).tensor("mean", mean).tensor("dbias", db);
    a.tensor("dy", dy).tensor("weight", w).tensor("rstd", rstd).tensor("dx", dx).tensor("dweight", dw);
    layer.backward(a, Device::cpu(), KCPP_MODE_TRAINING);
  }
  int64_t unit() const { return static_cast<int64_t>(x.nbytes()); }
};

void BM_layer_norm_fwd_reference(benchmark::State& st) {
  NormCase c(static_cast<DType>(st.range(0)), false);
  for (auto _ : st) benchmark::DoNotOptimize(ops::layer_norm_forward(c.x, c.w, c.b).y.data());
  st.SetBytesProcessed(st.iterations() * 2 * c.unit());
}
void BM_layer_norm_fwd_kernel(benchmark::State& st) {
  NormCase c(static_cast<DType>(st.range(0)), false);
  for (auto _ : st) c.forward();
  st.SetBytesProcessed(st.iterations() * 2 * c.unit());
}
void BM_layer_norm_fwd_bwd_reference(benchmark::State& st) {
  NormCase c(static_cast<DType>(st.range(0)), false);
  for (auto _ : st) {
    const auto f = ops::layer_norm_forward(c.x, c.w, c.b);
    benchmark::DoNotOptimize(ops::layer_norm_backward(c.dy, c.x, c.w, f.mean, f.rstd, true).dx.data());
  }
  st.SetBytesProcessed(st.iterations() * 5 * c.unit());
}
void BM_layer_norm_fwd_bwd_kernel(benchmark::State& st) {
  NormCase c(static_cast<DType>(st.range(0)), false);
  for (auto _ : st) {
    c.forward();
    c.backward();
  }
  st.SetBytesProcessed(st.iterations() * 5 * c.unit());
}
void BM_add_rms_norm_fwd_reference(benchmark::State& st) {
  NormCase c(static_cast<DType>(st.range(0)), true);
  for (auto _ : st) benchmark::DoNotOptimize(ops::rms_norm_forward(ops::add(c.x, c.res), c.w).y.data());
  st.SetBytesProcessed(st.iterations() * 4 * c.unit());
}
void BM_add_rms_norm_fwd_kernel(benchmark::State& st) {
  NormCase c(static_cast<DType>(st.range(0)), true);
  for (auto _ : st) c.forward();
  st.SetBytesProcessed(st.iterations() * 4 * c.unit());
}
void BM_add_rms_norm_fwd_bwd_reference(benchmark::State& st) {
  NormCase c(static_cast<DType>(st.range(0)), true);
  for (auto _ : st) {
    const Tensor r = ops::add(c.x, c.res);
    const auto f = ops::rms_norm_forward(r, c.w);
    benchmark::DoNotOptimize(ops::add(ops::rms_norm_backward(c.dy, r, c.w, f.rstd).dx, c.dres).data());
  }
  st.SetBytesProcessed(st.iterations() * 8 * c.unit());
}
void BM_add_rms_norm_fwd_bwd_kernel(benchmark::State& st) {
  NormCase c(static_cast<DType>(st.range(0)), true);
  for (auto _ : st) {
    c.forward();
    c.backward();
  }
  st.SetBytesProcessed(st.iterations() * 8 * c.unit());
}
BENCHMARK(BM_layer_norm_fwd_reference) KCPP_DTYPES;
BENCHMARK(BM_layer_norm_fwd_kernel) KCPP_DTYPES;
BENCHMARK(BM_layer_norm_fwd_bwd_reference) KCPP_DTYPES;
BENCHMARK(BM_layer_norm_fwd_bwd_kernel) KCPP_DTYPES;
BENCHMARK(BM_add_rms_norm_fwd_reference) KCPP_DTYPES;
BENCHMARK(BM_add_rms_norm_fwd_kernel) KCPP_DTYPES;
BENCHMARK(BM_add_rms_norm_fwd_bwd_reference) KCPP_DTYPES;
BENCHMARK(BM_add_rms_norm_fwd_bwd_kernel) KCPP_DTYPES;

}  // namespace

// The table-driven kernels (GLU, activations) registered by name, then Google Benchmark's main.
int main(int argc, char** argv) {
  using GluFn = void (*)(benchmark::State&, ops::GluActivation);
  using ActFn = void (*)(benchmark::State&, const ActKind&);
  const std::pair<const char*, GluFn> glu_fns[] = {{"_fwd_reference", glu_fwd_reference},
                                                   {"_fwd_kernel", glu_fwd_kernel},
                                                   {"_fwd_bwd_reference", glu_fwd_bwd_reference},
                                                   {"_fwd_bwd_kernel", glu_fwd_bwd_kernel}};
  const std::pair<const char*, ActFn> act_fns[] = {{"_fwd_reference", act_fwd_reference},
                                                   {"_fwd_kernel", act_fwd_kernel},
                                                   {"_fwd_bwd_reference", act_fwd_bwd_reference},
                                                   {"_fwd_bwd_kernel", act_fwd_bwd_kernel}};
  for (const GluKind& k : kGlus)
    for (const auto& [suffix, fn] : glu_fns)
      benchmark::RegisterBenchmark((std::string("BM_") + k.name + suffix).c_str(), fn, k.act) KCPP_DTYPES;
  for (const ActKind& k : kActs)
    for (const auto& [suffix, fn] : act_fns)
      benchmark::RegisterBenchmark((std::string("BM_") + k.name + suffix).c_str(), fn, k) KCPP_DTYPES;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
