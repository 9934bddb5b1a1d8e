// MoE kernels (moe.h) against the f64 oracle (tests/oracle.h: oracle::moe, oracle::moe_route,
// oracle::load_balancing_loss).
//
// Forward: the router's logits and the block's output are held to docs/DESIGN.md's bound, at most
// twice the error of the eager reference in the same precision (ops/: the router's matmul; the loop
// over experts Transformers runs in eager mode, with its roundings); the routing (ids) must equal the
// oracle's choice on the kernel's own rounded logits, and the permutation the stable grouping by
// expert.  Backward: ops/ has no eager MoE backward to compare with, so every gradient is held to the
// dtype's composite bound (tests/tolerances.h), its error measured against the magnitude of the terms
// that form it (oracle::MoeResult), which a wrong term (an O(1) error) cannot pass.
// Shapes: one token, odd sizes, one expert, top_k = E, experts that receive nothing, both weight
// layouts (Transformers' [E, 2I, H] and Llama 4's [E, H, 2I] seen transposed) and separate gate / up.
// On CUDA every case runs on each path of the experts' GEMMs (moe.h: ExpertGemm): the package's
// kernel, cuBLAS per expert, cuBLAS grouped and cuBLAS strided-batched over zero-padded experts.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <tuple>

#include "core/cuda_runtime.h"
#include "kcpp/kernel/tile_order.h"
#include "moe.h"
#include "ops/nn/glu.h"
#include "ops/ops.h"
#include "oracle.h"
#include "test_util.h"

namespace kcpp {
namespace {

#if KCPP_WITH_CUDA && KCPP_MOE_CUDA
#define MOE_CALL(dev, fn, p) \
  ((dev).is_cuda() ? moe_finish_cuda(fn##_cuda((p), ::kcpp::cuda::current_stream())) : fn##_cpu(p))
const char* moe_finish_cuda(const char* e) {
  if (!e) KCPP_CUDA_CHECK(cudaDeviceSynchronize());
  return e;
}
#else
#define MOE_CALL(dev, fn, p) ((dev).is_cuda() ? "moe: built without CUDA" : fn##_cpu(p))
#endif

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

kernel::DType kdtype(DType t) {
  return t == DType::f32 ? kernel::DType::f32 : t == DType::bf16 ? kernel::DType::bf16 : kernel::DType::f16;
}

// The experts' GEMM paths a device runs: on CUDA the package's kernel and the three cuBLAS paths
// (each case on each), on the CPU its one path.
std::vector<moe::ExpertGemm> gemm_paths(Device dev) {
  if (!dev.is_cuda()) return {moe::ExpertGemm::Auto};
  return {moe::ExpertGemm::Kernel, moe::ExpertGemm::Loop, moe::ExpertGemm::Grouped, moe::ExpertGemm::Padded};
}
const char* gemm_name(moe::ExpertGemm g) {
  switch (g) {
    case moe::ExpertGemm::Kernel: return "kernel";
    case moe::ExpertGemm::Loop: return "loop";
    case moe::ExpertGemm::Grouped: return "grouped";
    case moe::ExpertGemm::Padded: return "padded";
    default: return "auto";
  }
}

enum class Layout { Rows, Transposed, Separate };

struct Case {
  int64_t t, h, e, k, i, si;
  moe::Routing routing;
  bool normalize, input;
  kernel::Activation act;
  Layout layout;
  bool shared_gate, save, extra_dz, strided;
};

std::string describe(const Case& c) {
  return fmt::format("T={} H={} E={} k={} I={} Is={} routing={} normalize={} input={} act={} layout={} shared_gate={} "
                     "save={} extra_dz={} strided={}",
                     c.t, c.h, c.e, c.k, c.i, c.si, static_cast<int>(c.routing), c.normalize, c.input,
                     kernel::activation_name(c.act), static_cast<int>(c.layout), c.shared_gate, c.save, c.extra_dz,
                     c.strided);
}

oracle::Act oracle_act(kernel::Activation a) {
  switch (a) {
    case kernel::Activation::Silu: return oracle::Act::Silu;
    case kernel::Activation::Gelu: return oracle::Act::Gelu;
    case kernel::Activation::GeluTanh: return oracle::Act::GeluTanh;
    case kernel::Activation::QuickGelu: return oracle::Act::QuickGelu;
  }
  return oracle::Act::Silu;
}

// A per-expert [E, rows, cols] weight (or a 2-dim one): `view` is what the kernel reads (possibly a
// transposed view of [E, cols, rows] storage), `logical` its values as a contiguous tensor.
struct Weight {
  Tensor view, logical;
};
Weight make_weight(std::vector<int64_t> shape, bool transposed, DType dt, Device dev, Generator& gen, double sd) {
  const int64_t n = static_cast<int64_t>(shape.size());
  if (!transposed) {
    Tensor t = Tensor::randn(shape, dt, dev, gen, 0, sd);
    return {t, t};
  }
  std::vector<int64_t> st = shape;
  std::swap(st[n - 1], st[n - 2]);
  const Tensor storage = Tensor::randn(st, dt, dev, gen, 0, sd);
  const Tensor v = storage.transpose(n - 1, n - 2);
  return {v, v.contiguous()};
}
// An output of `shape`, poisoned with NaN, in the given layout.
Tensor make_out(std::vector<int64_t> shape, bool transposed, DType dt, Device dev) {
  const int64_t n = static_cast<int64_t>(shape.size());
  if (!transposed) return Tensor::full(shape, kNaN, dt, dev);
  std::vector<int64_t> st = shape;
  std::swap(st[n - 1], st[n - 2]);
  return Tensor::full(st, kNaN, dt, dev).transpose(n - 1, n - 2);
}
moe::Matrix matrix(const Tensor& t, int64_t row_offset = 0) {
  const int64_t n = t.dim();
  moe::Matrix m;
  m.data = static_cast<char*>(t.data()) + row_offset * t.stride(n - 2) * static_cast<int64_t>(t.element_size());
  m.expert_stride = n == 3 ? t.stride(0) : 0;
  m.row_stride = t.stride(n - 2);
  m.col_stride = t.stride(n - 1);
  return m;
}

// Every tensor of one case, and the params over them.
struct Block {
  Case c;
  DType dt;
  Device dev;
  moe::ExpertGemm gemm = moe::ExpertGemm::Auto;
  int gate_up_grads = 3;  // the backward asks for dgate (bit 0) and dup (bit 1); the other's tensor stays NaN
  Tensor x, router, gs;
  Weight gate_up, gate, up, down, sgate_up, sdown;
  Tensor out, logits, ids, weights, offsets, sorted, saved, ws;
  Tensor dout, dx, drouter, dgate_up, dgate, dup, ddown, dsgate_up, dsdown, dgs, dw, dz_extra;
  moe::MoeParams p;

  int64_t slots() const { return c.t * c.k; }

  void build(Generator& gen, const std::vector<int64_t>* given_ids = nullptr, const std::vector<double>* given_w = nullptr,
             bool weights_f32 = true) {
    const bool tr = c.layout == Layout::Transposed;
    const Tensor wide = Tensor::randn({c.t, c.h + (c.strided ? 3 : 0)}, dt, dev, gen);
    x = c.strided ? wide.narrow(1, 1, c.h) : wide;
    const double sh = 1 / std::sqrt(static_cast<double>(c.h));
    if (c.routing != moe::Routing::Given) router = Tensor::randn({c.e, c.h}, dt, dev, gen, 0, 1.5 * sh);
    if (c.layout == Layout::Separate) {
      gate = make_weight({c.e, c.i, c.h}, false, dt, dev, gen, sh);
      up = make_weight({c.e, c.i, c.h}, false, dt, dev, gen, sh);
    } else {
      gate_up = make_weight({c.e, 2 * c.i, c.h}, tr, dt, dev, gen, sh);
    }
    down = make_weight({c.e, c.h, c.i}, tr, dt, dev, gen, 1 / std::sqrt(static_cast<double>(c.i)));
    if (c.si > 0) {
      sgate_up = make_weight({2 * c.si, c.h}, tr, dt, dev, gen, sh);
      sdown = make_weight({c.h, c.si}, tr, dt, dev, gen, 1 / std::sqrt(static_cast<double>(c.si)));
      if (c.shared_gate) gs = Tensor::randn({1, c.h}, dt, dev, gen, 0, sh);
    }
    p = {};
    p.expert_gemm = gemm;
    p.dtype = kdtype(dt);
    p.tokens = c.t, p.hidden = c.h, p.experts = c.e, p.top_k = c.k, p.inter = c.i, p.shared_inter = c.si;
    p.routing = c.routing, p.normalize = c.normalize;
    p.weight_on = c.input ? moe::WeightOn::Input : moe::WeightOn::Output;
    p.act = c.act;
    p.x = x.data(), p.x_stride = x.stride(0);
    if (router.defined()) p.router = router.data();
    if (c.layout == Layout::Separate) {
      p.gate = matrix(gate.view), p.up = matrix(up.view);
    } else {
      p.gate = matrix(gate_up.view), p.up = matrix(gate_up.view, c.i);
    }
    p.down = matrix(down.view);
    if (c.si > 0) {
      p.shared_gate = matrix(sgate_up.view), p.shared_up = matrix(sgate_up.view, c.si);
      p.shared_down = matrix(sdown.view);
      if (gs.defined()) p.shared_expert_gate = gs.data();
    }
    out = Tensor::full({c.t, c.h}, kNaN, dt, dev);
    p.out = out.data(), p.out_stride = c.h;
    if (c.routing == moe::Routing::Given) {
      ids = Tensor::from_i64(*given_ids, {c.t, c.k}, DType::i64, dev);
      weights = Tensor::from_f64(*given_w, {c.t, c.k}, weights_f32 ? DType::f32 : dt, dev);
      p.ids_i64 = true, p.weights_f32 = weights_f32;
    } else {
      logits = Tensor::full({c.t, c.e}, kNaN, dt, dev);
      p.router_logits = logits.data();
      ids = Tensor::full({c.t, c.k}, -1, DType::i32, dev);
      weights = Tensor::full({c.t, c.k}, kNaN, DType::f32, dev);
    }
    p.topk_ids = ids.data(), p.topk_weights = weights.data();
    offsets = Tensor::full({c.e + 2}, -1, DType::i32, dev);
    sorted = Tensor::full({slots()}, -1, DType::i32, dev);
    p.expert_offsets = static_cast<int32_t*>(offsets.data());
    p.sorted_slots = static_cast<int32_t*>(sorted.data());
    if (c.save) {
      saved = Tensor::full({slots(), 2 * c.i}, kNaN, dt, dev);
      p.gate_up = saved.data();
    }
  }

  const char* forward() {
    ws = Tensor::empty({static_cast<int64_t>(moe::moe_workspace(p, false, dev.is_cuda()))}, DType::u8, dev);
    p.workspace = ws.data();
    return MOE_CALL(dev, moe::moe_forward, p);
  }

  const char* backward(Generator& gen) {
    const bool tr = c.layout == Layout::Transposed;
    dout = Tensor::randn({c.t, c.h}, dt, dev, gen);
    dx = Tensor::full({c.t, c.h}, kNaN, dt, dev);
    p.dout = dout.data(), p.dout_stride = c.h;
    p.dx = dx.data(), p.dx_stride = c.h;
    if (router.defined()) {
      drouter = Tensor::full({c.e, c.h}, kNaN, dt, dev);
      p.drouter = drouter.data();
      if (c.extra_dz) {
        dz_extra = Tensor::randn({c.t, c.e}, DType::f32, dev, gen, 0, 0.1);
        p.drouter_logits = dz_extra.data(), p.drouter_logits_f32 = true;
      }
    }
    if (c.layout == Layout::Separate) {
      dgate = make_out({c.e, c.i, c.h}, false, dt, dev);
      dup = make_out({c.e, c.i, c.h}, true, dt, dev);  // a layout unlike the weight's
      p.dgate = matrix(dgate), p.dup = matrix(dup);
    } else {
      dgate_up = make_out({c.e, 2 * c.i, c.h}, tr, dt, dev);
      p.dgate = matrix(dgate_up), p.dup = matrix(dgate_up, c.i);
    }
    if (!(gate_up_grads & 1)) p.dgate = {};
    if (!(gate_up_grads & 2)) p.dup = {};
    ddown = make_out({c.e, c.h, c.i}, !tr, dt, dev);
    p.ddown = matrix(ddown);
    if (c.si > 0) {
      dsgate_up = make_out({2 * c.si, c.h}, tr, dt, dev);
      dsdown = make_out({c.h, c.si}, tr, dt, dev);
      p.dshared_gate = matrix(dsgate_up), p.dshared_up = matrix(dsgate_up, c.si);
      p.dshared_down = matrix(dsdown);
      if (gs.defined()) {
        dgs = Tensor::full({c.h}, kNaN, dt, dev);
        p.dshared_expert_gate = dgs.data();
      }
    }
    dw = Tensor::full({slots()}, kNaN, DType::f32, dev);
    p.dtopk_weights = static_cast<float*>(dw.data());
    return rerun_backward();
  }
  // The backward again over the same tensors.
  const char* rerun_backward() {
    ws = Tensor::empty({static_cast<int64_t>(moe::moe_workspace(p, true, dev.is_cuda()))}, DType::u8, dev);
    p.workspace = ws.data();
    return MOE_CALL(dev, moe::moe_backward, p);
  }

  oracle::MoeSpec spec() const {
    oracle::MoeSpec s;
    s.t = c.t, s.h = c.h, s.e = c.e, s.k = c.k, s.i = c.i, s.si = c.si;
    s.act = oracle_act(c.act);
    s.routing = static_cast<int>(c.routing);
    s.normalize = c.normalize, s.weight_on_input = c.input;
    return s;
  }
  oracle::MoeWeights oracle_weights() const {
    oracle::MoeWeights w;
    w.x = x.to_f64_vector();
    if (router.defined()) w.router = router.to_f64_vector();
    if (c.layout == Layout::Separate) {
      w.gate = gate.logical.to_f64_vector(), w.up = up.logical.to_f64_vector();
    } else {
      w.gate = gate_up.logical.narrow(1, 0, c.i).to_f64_vector();
      w.up = gate_up.logical.narrow(1, c.i, c.i).to_f64_vector();
    }
    w.down = down.logical.to_f64_vector();
    if (c.si > 0) {
      w.sgate = sgate_up.logical.narrow(0, 0, c.si).to_f64_vector();
      w.sup = sgate_up.logical.narrow(0, c.si, c.si).to_f64_vector();
      w.sdown = sdown.logical.to_f64_vector();
      if (gs.defined()) w.sgs = gs.to_f64_vector();
    }
    return w;
  }
  // Expert e's gate (0), up (1) or down (2) projection as a contiguous 2-dim tensor.
  Tensor expert(int which, int64_t e) const {
    if (which == 2) return down.logical.select(0, e);
    if (c.layout == Layout::Separate) return (which == 0 ? gate : up).logical.select(0, e);
    return gate_up.logical.select(0, e).narrow(0, which == 0 ? 0 : c.i, c.i);
  }
};

// Transformers' eager experts loop (MixtralExperts.forward) in the case's dtype, with the kcpp eager
// ops: gather each expert's tokens, two projections, the gated activation, the down projection,
// the routing weight, index_add into the output; plus the shared expert (Qwen2-MoE / Llama 4).
Tensor eager_forward(const Block& m, const std::vector<int64_t>& ids, const std::vector<double>& w) {
  const Case& c = m.c;
  const ops::GluActivation act = c.act == kernel::Activation::Gelu       ? ops::GluActivation::Gelu
                                 : c.act == kernel::Activation::GeluTanh ? ops::GluActivation::GeluTanh
                                                                         : ops::GluActivation::Silu;
  const Tensor x = m.x.contiguous();
  Tensor out = Tensor::zeros({c.t, c.h}, m.dt, m.dev);
  for (int64_t e = 0; e < c.e; ++e) {
    std::vector<int64_t> tok;
    std::vector<double> we;
    for (int64_t s = 0; s < c.t * c.k; ++s)
      if (ids[s] == e) tok.push_back(s / c.k), we.push_back(w[s]);
    if (tok.empty()) continue;
    const int64_t n = static_cast<int64_t>(tok.size());
    const Tensor idx = Tensor::from_i64(tok, {n}, DType::i64, m.dev);
    const Tensor wcol = Tensor::from_f64(we, {n, 1}, m.dt, m.dev);
    Tensor xe = ops::embedding(x, idx);
    if (c.input) xe = ops::mul(xe, wcol);
    const Tensor g = ops::matmul(xe, m.expert(0, e), false, true), u = ops::matmul(xe, m.expert(1, e), false, true);
    Tensor y = ops::matmul(ops::glu_forward(g, u, act), m.expert(2, e), false, true);
    if (!c.input) y = ops::mul(y, wcol);
    out = ops::add(out, ops::embedding_backward(y, idx, c.t));
  }
  if (c.si > 0) {
    const Tensor g = ops::matmul(x, m.sgate_up.logical.narrow(0, 0, c.si), false, true);
    const Tensor u = ops::matmul(x, m.sgate_up.logical.narrow(0, c.si, c.si), false, true);
    Tensor y = ops::matmul(ops::glu_forward(g, u, act), m.sdown.logical, false, true);
    if (m.gs.defined()) y = ops::mul(y, ops::sigmoid(ops::matmul(x, m.gs, false, true)));
    out = ops::add(out, y);
  }
  return out;
}

// A gradient against the oracle, its error measured against the magnitude of the terms that form it
// (a routing gradient is a difference of nearly equal terms where the chosen weights are close).
::testing::AssertionResult close_grad(const Tensor& out, const std::vector<double>& ref, const std::vector<double>& mag,
                                      double tol) {
  return test::close_l2_mag(out, ref, mag, tol);
}

// The stable grouping of the slots by expert (invalid ids last), as the contract defines it.
void expect_permutation(const Block& m, const std::vector<int64_t>& ids, const std::string& cfg) {
  const int64_t e = m.c.e, s = m.slots();
  std::vector<int64_t> off(static_cast<size_t>(e + 2), 0), sorted;
  for (int64_t b = 0; b <= e; ++b) {
    for (int64_t q = 0; q < s; ++q) {
      const bool valid = ids[q] >= 0 && ids[q] < e;
      if ((b < e && ids[q] == b) || (b == e && !valid)) sorted.push_back(q);
    }
    off[b + 1] = static_cast<int64_t>(sorted.size());
  }
  EXPECT_EQ(m.offsets.to_i64_vector(), off) << cfg;
  EXPECT_EQ(m.sorted.to_i64_vector(), sorted) << cfg;
}

const Case kCases[] = {
    // T, H, E, k, I, Is, routing, normalize, input, act, layout, shared_gate, save, extra_dz, strided
    {1, 8, 4, 2, 6, 0, moe::Routing::Softmax, true, false, kernel::Activation::Silu, Layout::Rows, false, true, false, false},
    {7, 13, 5, 2, 9, 0, moe::Routing::Softmax, false, false, kernel::Activation::Silu, Layout::Transposed, false, false, true, true},
    {7, 12, 1, 1, 5, 0, moe::Routing::Softmax, false, false, kernel::Activation::Gelu, Layout::Rows, false, true, false, false},
    {5, 10, 3, 3, 7, 0, moe::Routing::Softmax, true, false, kernel::Activation::GeluTanh, Layout::Separate, false, false, false, false},
    {3, 16, 16, 2, 8, 0, moe::Routing::Softmax, true, false, kernel::Activation::Silu, Layout::Rows, false, true, true, false},
    {9, 16, 6, 1, 8, 10, moe::Routing::Sigmoid, false, true, kernel::Activation::Silu, Layout::Transposed, false, true, false, false},
    {11, 15, 7, 3, 5, 9, moe::Routing::Sigmoid, false, true, kernel::Activation::QuickGelu, Layout::Rows, false, false, false, true},
    {12, 20, 8, 3, 6, 11, moe::Routing::Softmax, false, false, kernel::Activation::GeluTanh, Layout::Separate, true, false, true, false},
    {33, 64, 8, 2, 48, 0, moe::Routing::Softmax, true, false, kernel::Activation::Silu, Layout::Rows, false, true, false, false},
};

class MoeKernels : public ::testing::TestWithParam<Device> {};

TEST_P(MoeKernels, MatchesTheOracle) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (const Case& c : kCases)
      for (moe::ExpertGemm gemm : gemm_paths(dev)) {
        if (dev.is_cuda() && dt == DType::f32) continue;  // CUDA: bf16 / f16 (moe_cuda_unsupported)
        const std::string cfg = test::config_name(dev, dt) + " " + describe(c) + " gemm=" + gemm_name(gemm);
        Block m{c, dt, dev, gemm};
        m.build(gen);
        ASSERT_EQ(m.forward(), nullptr) << cfg;

        // The router's logits: one GEMM rounded once, within twice eager's error.
        const oracle::MoeWeights wt = m.oracle_weights();
        const auto z64 = oracle::matmul(wt.x, wt.router, 1, c.t, c.e, c.h, false, true, false);
        const double ez_ref = test::rel_l2_error(ops::matmul(m.x, m.router, false, true), z64);
        EXPECT_LE(test::rel_l2_error(m.logits, z64), test::kernel_bound(ez_ref, dt)) << cfg << " router_logits";
        // The routing on the kernel's rounded logits: the same experts, the weights to f32 accuracy.
        const oracle::MoeSpec s = m.spec();
        const auto z = m.logits.to_f64_vector();
        std::vector<int64_t> ids;
        std::vector<double> w;
        oracle::moe_route(s, z, ids, w);
        EXPECT_EQ(m.ids.to_i64_vector(), ids) << cfg << " topk_ids";
        EXPECT_TRUE(test::close_l2(m.weights, w, 1e-6)) << cfg << " topk_weights";
        expect_permutation(m, ids, cfg);
        // The output, within twice the error of Transformers' eager loop in this dtype.
        const oracle::MoeResult ref = oracle::moe(s, wt, z, ids, w, nullptr, nullptr);
        const double e_out = test::rel_l2_error(m.out, ref.out);
        if (c.act == kernel::Activation::QuickGelu) {  // no eager GLU of it in ops/
          EXPECT_LE(e_out, test::composite_rel_l2(dt)) << cfg << " out";
        } else {
          // The block rounds three intermediates to the dtype (gate_up, h, the output); on a token's
          // few values the eager loop's error can fall below that by chance, so the bound is at least
          // three roundings.
          const double e_ref = test::rel_l2_error(eager_forward(m, ids, w), ref.out);
          const double bound = std::max(test::kernel_bound(e_ref, dt), 3 * test::unit_roundoff(dt));
          EXPECT_LE(e_out, bound) << cfg << " out (eager error " << e_ref << ")";
        }
        if (c.save) {  // the projections in expert order
          std::vector<double> gu;
          const auto sorted = m.sorted.to_i64_vector();
          for (int64_t q = 0; q < m.slots(); ++q) {
            const int64_t slot = sorted[q], t = slot / c.k, e = ids[slot];
            for (int which = 0; which < 2; ++which)
              for (int64_t a = 0; a < c.i; ++a) {
                const auto& wm = which == 0 ? wt.gate : wt.up;
                double acc = 0;
                for (int64_t col = 0; col < c.h; ++col)
                  acc += wm[(e * c.i + a) * c.h + col] * wt.x[t * c.h + col] * (c.input ? w[slot] : 1.0);
                gu.push_back(acc);
              }
          }
          EXPECT_TRUE(test::close_l2(m.saved, gu, test::composite_rel_l2(dt))) << cfg << " gate_up";
        }

        // Backward.
        ASSERT_EQ(m.backward(gen), nullptr) << cfg;
        const auto dout = m.dout.to_f64_vector();
        std::vector<double> dz_extra;
        if (m.dz_extra.defined()) dz_extra = m.dz_extra.to_f64_vector();
        const oracle::MoeResult g = oracle::moe(s, wt, z, ids, w, &dout, m.dz_extra.defined() ? &dz_extra : nullptr);
        const double tol = test::composite_rel_l2(dt);
        EXPECT_TRUE(close_grad(m.dx, g.dx, g.dx_mag, tol)) << cfg << " dhidden";
        EXPECT_TRUE(close_grad(m.drouter, g.drouter, g.drouter_mag, tol)) << cfg << " drouter_weight";
        EXPECT_TRUE(close_grad(m.dw, g.dw, g.dw_mag, tol)) << cfg << " dtopk_weights";
        if (c.layout == Layout::Separate) {
          EXPECT_TRUE(close_grad(m.dgate, g.dgate, g.dgate_mag, tol)) << cfg << " dgate_proj";
          EXPECT_TRUE(close_grad(m.dup, g.dup, g.dup_mag, tol)) << cfg << " dup_proj";
        } else {
          EXPECT_TRUE(close_grad(m.dgate_up.narrow(1, 0, c.i), g.dgate, g.dgate_mag, tol)) << cfg << " dgate_up_proj (gate)";
          EXPECT_TRUE(close_grad(m.dgate_up.narrow(1, c.i, c.i), g.dup, g.dup_mag, tol)) << cfg << " dgate_up_proj (up)";
        }
        EXPECT_TRUE(close_grad(m.ddown, g.ddown, g.ddown_mag, tol)) << cfg << " ddown_proj";
        if (c.si > 0) {
          EXPECT_TRUE(close_grad(m.dsgate_up.narrow(0, 0, c.si), g.dsgate, g.dsgate_mag, tol)) << cfg << " dshared gate";
          EXPECT_TRUE(close_grad(m.dsgate_up.narrow(0, c.si, c.si), g.dsup, g.dsup_mag, tol)) << cfg << " dshared up";
          EXPECT_TRUE(close_grad(m.dsdown, g.dsdown, g.dsdown_mag, tol)) << cfg << " dshared_down_proj";
          if (m.gs.defined()) EXPECT_TRUE(close_grad(m.dgs, g.dsgs, g.dsgs_mag, tol)) << cfg << " dshared_expert_gate";
        }
      }
}

// Routing given by the host: i64 ids with a repeated expert, Transformers' expert-parallel sentinel
// (id E, taken by no expert), weights in f32 or the dtype; the gradient of the weights comes back.
TEST_P(MoeKernels, GivenRouting) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  for (DType dt : {DType::f32, DType::bf16})
    for (bool input : {false, true})
      for (bool weights_f32 : {true, false})
        for (moe::ExpertGemm gemm : gemm_paths(dev)) {
          if (dev.is_cuda() && dt == DType::f32) continue;
          const Case c{6, 11, 4, 3, 7, 0, moe::Routing::Given, false, input, kernel::Activation::Silu, Layout::Rows,
                       false, !input, false, false};
          const std::string cfg = test::config_name(dev, dt) + " " + describe(c) +
                                  fmt::format(" weights_f32={} gemm={}", weights_f32, gemm_name(gemm));
          const std::vector<int64_t> ids{0, 2, 4, 1, 1, 3, 4, 4, 4, 2, 0, 3, 3, 2, 1, 0, -1, 2};  // 4 = E: a sentinel
          std::vector<double> w(ids.size());
          for (size_t q = 0; q < w.size(); ++q) w[q] = Tensor::from_f64(std::vector<double>{0.1 + 0.05 * static_cast<double>(q)}, {1}, dt).item();
          Block m{c, dt, dev, gemm};
          m.build(gen, &ids, &w, weights_f32);
          ASSERT_EQ(m.forward(), nullptr) << cfg;
          expect_permutation(m, ids, cfg);
          const oracle::MoeSpec s = m.spec();
          const oracle::MoeWeights wt = m.oracle_weights();
          const oracle::MoeResult ref = oracle::moe(s, wt, {}, ids, w, nullptr, nullptr);
          EXPECT_TRUE(test::close_l2(m.out, ref.out, test::composite_rel_l2(dt))) << cfg << " out";
          ASSERT_EQ(m.backward(gen), nullptr) << cfg;
          const auto dout = m.dout.to_f64_vector();
          const oracle::MoeResult g = oracle::moe(s, wt, {}, ids, w, &dout, nullptr);
          const double tol = test::composite_rel_l2(dt);
          EXPECT_TRUE(close_grad(m.dx, g.dx, g.dx_mag, tol)) << cfg << " dhidden";
          EXPECT_TRUE(close_grad(m.dw, g.dw, g.dw_mag, tol)) << cfg << " dtopk_weights";
          EXPECT_TRUE(close_grad(m.dgate_up.narrow(1, 0, c.i), g.dgate, g.dgate_mag, tol)) << cfg << " dgate";
          EXPECT_TRUE(close_grad(m.ddown, g.ddown, g.ddown_mag, tol)) << cfg << " ddown_proj";
          const auto dw = m.dw.to_f64_vector();
          for (size_t q = 0; q < ids.size(); ++q)
            if (ids[q] < 0 || ids[q] >= c.e) EXPECT_EQ(dw[q], 0.0) << cfg << " slot " << q;
        }
}

// Ties go to the lower expert (all logits equal: experts 0 .. k-1), no tokens at all, and the
// same call twice gives the same bits.
TEST_P(MoeKernels, TiesEmptyAndDeterminism) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const Case c{5, 8, 6, 4, 4, 0, moe::Routing::Softmax, true, false, kernel::Activation::Silu, Layout::Rows, false, true,
               false, false};
  Block m{c, DType::bf16, dev};
  m.build(gen);
  m.router.fill_(0.0);
  ASSERT_EQ(m.forward(), nullptr);
  const auto ids = m.ids.to_i64_vector();
  for (int64_t t = 0; t < c.t; ++t)
    for (int64_t j = 0; j < c.k; ++j) EXPECT_EQ(ids[t * c.k + j], j) << "token " << t;
  for (double v : m.weights.to_f64_vector()) EXPECT_NEAR(v, 0.25, 1e-6);

  for (moe::ExpertGemm gemm : gemm_paths(dev))
    for (moe::Routing r : {moe::Routing::Softmax, moe::Routing::Sigmoid}) {
      Case e = c;
      e.routing = r, e.t = 0;
      Block z{e, dev.is_cuda() ? DType::bf16 : DType::f32, dev, gemm};
      z.build(gen);
      ASSERT_EQ(z.forward(), nullptr) << gemm_name(gemm);
      EXPECT_EQ(z.offsets.to_i64_vector(), std::vector<int64_t>(static_cast<size_t>(c.e + 2), 0));
      ASSERT_STREQ(z.backward(gen), nullptr);
      for (const Tensor* t : {&z.drouter, &z.dgate_up, &z.ddown})
        for (double v : t->to_f64_vector()) EXPECT_EQ(v, 0.0) << gemm_name(gemm);
    }

  for (moe::ExpertGemm gemm : gemm_paths(dev)) {
    Case d = c;
    d.t = 37, d.e = 8, d.k = 2, d.i = 24, d.h = 32;
    Block a{d, DType::bf16, dev, gemm};
    a.build(gen);
    ASSERT_EQ(a.forward(), nullptr);
    const auto out1 = a.out.to_f64_vector();
    ASSERT_EQ(a.backward(gen), nullptr);
    const auto dx1 = a.dx.to_f64_vector(), dg1 = a.dgate_up.to_f64_vector();
    ASSERT_EQ(a.forward(), nullptr);
    EXPECT_EQ(a.out.to_f64_vector(), out1) << gemm_name(gemm);
    ASSERT_EQ(a.rerun_backward(), nullptr);
    EXPECT_EQ(a.dx.to_f64_vector(), dx1) << gemm_name(gemm);
    EXPECT_EQ(a.dgate_up.to_f64_vector(), dg1) << gemm_name(gemm);
  }
}

// A block with given routing (m.forward() already run) against the f64 oracle: its output, then its
// backward's gradients; the gate / up / down gradients of the experts without slots (counts[x] 0)
// exactly zero.
void expect_given_routing_matches_the_oracle(Block& m, const std::vector<int64_t>& ids, const std::vector<double>& w,
                                             const std::vector<int64_t>& counts, Generator& gen, const std::string& cfg) {
  const Case& c = m.c;
  const oracle::MoeSpec s = m.spec();
  const oracle::MoeWeights wt = m.oracle_weights();
  const double tol = test::composite_rel_l2(m.dt);
  const oracle::MoeResult ref = oracle::moe(s, wt, {}, ids, w, nullptr, nullptr);
  EXPECT_TRUE(test::close_l2(m.out, ref.out, tol)) << cfg << " out";
  ASSERT_EQ(m.backward(gen), nullptr) << cfg;
  const auto dout = m.dout.to_f64_vector();
  const oracle::MoeResult g = oracle::moe(s, wt, {}, ids, w, &dout, nullptr);
  EXPECT_TRUE(close_grad(m.dx, g.dx, g.dx_mag, tol)) << cfg << " dhidden";
  EXPECT_TRUE(close_grad(m.dw, g.dw, g.dw_mag, tol)) << cfg << " dtopk_weights";
  const bool separate = c.layout == Layout::Separate;
  const Tensor dgate = separate ? m.dgate : m.dgate_up.narrow(1, 0, c.i);
  const Tensor dup = separate ? m.dup : m.dgate_up.narrow(1, c.i, c.i);
  EXPECT_TRUE(close_grad(dgate, g.dgate, g.dgate_mag, tol)) << cfg << " dgate";
  EXPECT_TRUE(close_grad(dup, g.dup, g.dup_mag, tol)) << cfg << " dup";
  EXPECT_TRUE(close_grad(m.ddown, g.ddown, g.ddown_mag, tol)) << cfg << " ddown_proj";
  for (size_t x = 0; x < counts.size(); ++x) {
    if (counts[x] > 0) continue;
    for (const Tensor& grad : {dgate, dup, m.ddown})
      for (double v : grad.select(0, static_cast<int64_t>(x)).to_f64_vector())
        ASSERT_EQ(v, 0.0) << cfg << " expert " << x << " (no slots)";
  }
}

// Group sizes that the grouped GEMMs must take as they come: experts that receive no slot (their
// weight gradients, poisoned with NaN, must come back zero), one slot, odd counts, two experts with
// the same count (one group of a grouped cuBLAS call), top_k 2 with a token choosing one expert twice
// and sentinel slots; H and I no multiple of 8 (unaligned leading dims, the scalar gather and GLU
// kernels) and multiples of 8 (their 16-byte forms); every weight layout, the routing weight on the
// output (gate_up saved) and on the input (recomputed).  On CUDA on each path of the experts' GEMMs.
TEST_P(MoeKernels, AwkwardExpertCounts) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const std::vector<int64_t> counts{0, 1, 5, 0, 3, 3, 12};
  const int64_t e = static_cast<int64_t>(counts.size()), k = 2;
  std::vector<int64_t> ids;
  for (int64_t x = 0; x < e; ++x) ids.insert(ids.end(), static_cast<size_t>(counts[x]), x);
  ids.push_back(e), ids.push_back(-1);  // taken by no expert
  std::shuffle(ids.begin(), ids.end(), gen.engine());
  const int64_t t = static_cast<int64_t>(ids.size()) / k;
  std::vector<double> w(ids.size());
  std::uniform_real_distribution<double> uniform(0.1, 1.0);
  for (double& v : w) v = static_cast<double>(static_cast<float>(uniform(gen.engine())));
  struct Size {
    int64_t h, i;
  };
  for (const Size sz : {Size{37, 19}, Size{64, 40}})
    for (DType dt : {DType::bf16, DType::f16})
      for (Layout layout : {Layout::Rows, Layout::Transposed, Layout::Separate})
        for (bool input : {false, true})
          for (moe::ExpertGemm gemm : gemm_paths(dev)) {
            const Case c{t, sz.h, e, k, sz.i, 0, moe::Routing::Given, false, input, kernel::Activation::Silu, layout, false,
                         !input, false, layout == Layout::Transposed};
            const std::string cfg = test::config_name(dev, dt) + " " + describe(c) + " gemm=" + gemm_name(gemm);
            Block m{c, dt, dev, gemm};
            m.build(gen, &ids, &w, true);
            ASSERT_EQ(m.forward(), nullptr) << cfg;
            expect_permutation(m, ids, cfg);
            expect_given_routing_matches_the_oracle(m, ids, w, counts, gen, cfg);
          }
}

// The slots of `counts` (expert x taken counts[x] times, then `extra` ids no expert takes), shuffled,
// and a weight in [0.1, 1) per slot, an f32 value.
void given_slots(const std::vector<int64_t>& counts, const std::vector<int64_t>& extra, Generator& gen, std::vector<int64_t>& ids,
                 std::vector<double>& w) {
  ids.clear();
  for (size_t x = 0; x < counts.size(); ++x) ids.insert(ids.end(), static_cast<size_t>(counts[x]), static_cast<int64_t>(x));
  ids.insert(ids.end(), extra.begin(), extra.end());
  std::shuffle(ids.begin(), ids.end(), gen.engine());
  w.assign(ids.size(), 0.0);
  std::uniform_real_distribution<double> uniform(0.1, 1.0);
  for (double& v : w) v = static_cast<double>(static_cast<float>(uniform(gen.engine())));
}

// A given routing of top-k slots: `counts` per expert, shuffled, with weights (given_slots); with
// `stray` two ids no expert takes (e and -1) among them.  t tokens of k slots.
struct Routing {
  std::vector<int64_t> counts, ids;
  std::vector<double> w;
  int64_t e = 0, k = 0, t = 0;
};
Routing given_routing(std::vector<int64_t> counts, bool stray, Generator& gen, int64_t k = 2) {
  Routing r;
  r.e = static_cast<int64_t>(counts.size()), r.k = k;
  given_slots(counts, stray ? std::vector<int64_t>{r.e, -1} : std::vector<int64_t>{}, gen, r.ids, r.w);
  r.t = static_cast<int64_t>(r.ids.size()) / k;
  r.counts = std::move(counts);
  return r;
}

bool all_nan(const Tensor& t) {
  for (double v : t.to_f64_vector())
    if (!std::isnan(v)) return false;
  return true;
}

using test::ScopedEnv;
// KCPP_MOE_GEMM unset for a scope: ExpertGemm::Auto then means choose_expert_gemm's rule.
struct UnsetMoeGemmEnv : ScopedEnv {
  UnsetMoeGemmEnv() : ScopedEnv("KCPP_MOE_GEMM", nullptr) {}
};

// The forward's products on the Hopper grouped GEMM (moe_gemm_sm90.cuh, where the device and the
// shapes take it: H and I multiples of 8, weights contiguous along K) and on the mma.sync kernel
// (KCPP_MOE_SM90=0), through the package's kernel path and through Auto: counts at the 128-row
// tile's edges (127, 128, 129), a long expert, empty ones and stray slots, and a decode-sized routing
// of 10 slots over 7 experts (both at most kSm90AutoRows an expert: with KCPP_MOE_SM90=1 Auto takes
// the Hopper kernel, in its workspace; with 0, cuBLAS); H = 264 and I = 136 (a 256-column tile of the output
// and 8 more, a 128-column tile of I and 8 more, k-steps of 64 and a part of 8), and H = 128, I = 64;
// SiLU, then the kernel's other activations (GELU, GELU tanh, QuickGELU) at the tile edges, a routing
// of 20 tiles (more than one panel of the kernel's work order) and one of 275 (every block runs
// several work items).
// The output and every gradient (the backward reads the gate_up the forward saved) against the oracle.
TEST_P(MoeKernels, HopperGroupedGemmAtTileEdges) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const Routing tiles = given_routing({0, 1, 127, 128, 129, 300, 5}, true, gen);
  const Routing decode = given_routing({1, 0, 2, 1, 0, 3, 1}, true, gen);
  struct Size {
    int64_t h, i;
  };
  const ScopedEnv sm90_env("KCPP_MOE_SM90", "1");  // set per case below, restored after
  UnsetMoeGemmEnv unset;
  // Where the Hopper kernel can run, KCPP_MOE_SM90=1 requires it (a product it does not take fails
  // the call); elsewhere the kernel path runs mma.sync.
  const char* on = "auto";
#if KCPP_WITH_CUDA && KCPP_MOE_CUDA
  if (dev.is_cuda() && moe::moe_sm90_unavailable() == nullptr) on = "1";
#endif
  for (const Routing* rp : {&tiles, &decode})
    for (const Size sz : {Size{264, 136}, Size{128, 64}})
      for (DType dt : {DType::bf16, DType::f16})
        for (Layout layout : {Layout::Rows, Layout::Separate})
          for (bool input : {false, true})
            for (moe::ExpertGemm gemm : dev.is_cuda() ? std::vector<moe::ExpertGemm>{moe::ExpertGemm::Kernel, moe::ExpertGemm::Auto}
                                                      : std::vector<moe::ExpertGemm>{moe::ExpertGemm::Auto})
              for (const char* sm90 : {on, "0"}) {
                if (!dev.is_cuda() && sm90[0] == '0') continue;
                setenv("KCPP_MOE_SM90", sm90, 1);
                const Routing& r = *rp;
                const Case c{r.t, sz.h, r.e, r.k, sz.i, 0, moe::Routing::Given, false, input, kernel::Activation::Silu, layout, false,
                             !input, false, false};
                const std::string cfg = test::config_name(dev, dt) + " " + describe(c) + " gemm=" + gemm_name(gemm) +
                                        " KCPP_MOE_SM90=" + sm90;
                Block m{c, dt, dev, gemm};
                m.build(gen, &r.ids, &r.w, true);
                ASSERT_EQ(m.forward(), nullptr) << cfg;
                expect_permutation(m, r.ids, cfg);
                expect_given_routing_matches_the_oracle(m, r.ids, r.w, r.counts, gen, cfg);
              }
  // The kernel's other activations (one instantiation each; the loops above are SiLU's), and 20 m
  // tiles: more than one panel of the kernel's work order (kPanel = 16), the last one partial.
  if (dev.is_cuda()) {
    setenv("KCPP_MOE_SM90", on, 1);
    const Routing panels = given_routing({700, 2, 1200, 0, 300}, true, gen);
    // 275 m tiles at H = 128, I = 64 (one n tile a product): every block of a 132-multiprocessor GPU
    // runs two or three work items (the staging tile written again after its bulk stores, the ring
    // running across items), at a fifth of the oracle's work at H = 264, I = 136.
    const Routing many = given_routing({12000, 1, 9000, 0, 12801, 900}, true, gen);
    struct Run {
      const Routing* r;
      kernel::Activation act;
      int64_t h, i;
    };
    const Run runs[] = {{&tiles, kernel::Activation::Gelu, 264, 136},
                        {&tiles, kernel::Activation::GeluTanh, 264, 136},
                        {&tiles, kernel::Activation::QuickGelu, 264, 136},
                        {&panels, kernel::Activation::Silu, 264, 136},
                        {&many, kernel::Activation::Silu, 128, 64}};
    for (const Run& run : runs)
      for (DType dt : {DType::bf16, DType::f16}) {
        const Routing& r = *run.r;
        const Case c{r.t, run.h, r.e, r.k, run.i, 0, moe::Routing::Given, false, false, run.act, Layout::Rows, false, true, false,
                     false};
        const std::string cfg = test::config_name(dev, dt) + " " + describe(c) + " gemm=kernel KCPP_MOE_SM90=" + on;
        Block m{c, dt, dev, moe::ExpertGemm::Kernel};
        m.build(gen, &r.ids, &r.w, true);
        ASSERT_EQ(m.forward(), nullptr) << cfg;
        expect_given_routing_matches_the_oracle(m, r.ids, r.w, r.counts, gen, cfg);
      }
    // KCPP_MOE_SM90=1 where the kernel cannot take a product (I = 36, not a multiple of 8; or a device
    // without it): the call fails, saying why.
    setenv("KCPP_MOE_SM90", "1", 1);
    const Case c{tiles.t, 264, tiles.e, tiles.k, 36, 0, moe::Routing::Given, false, false, kernel::Activation::Silu, Layout::Rows,
                 false, true, false, false};
    Block m{c, DType::bf16, dev, moe::ExpertGemm::Kernel};
    m.build(gen, &tiles.ids, &tiles.w, true);
    const char* err = m.forward();
    ASSERT_NE(err, nullptr);
    EXPECT_NE(std::string(err).find("KCPP_MOE_SM90=1 asks for the Hopper grouped GEMM, which cannot run the gate / up product"),
              std::string::npos)
        << err;
  }
}

// 23 experts, 20 of 8 slots and experts 4, 11 and 19 (between the first and the last) of none: S = 160
// routed slots, and a padded layout of 23 x 8 = 184 rows = floor(23 S / 20), exactly the rows Auto's
// workspace holds (moe.h: padded_rows_cap) and the most its rule takes (15% over the routed rows).
std::vector<int64_t> auto_bound_counts() {
  std::vector<int64_t> c(23, 8);
  for (size_t e : {4, 11, 19}) c[e] = 0;
  return c;
}

// ExpertGemm::Auto on the padded bound (auto_bound_counts, T = 80, top-2, no slot outside the experts):
// on CUDA the rule takes Padded on the counts read back (checked with choose_expert_gemm and this
// device's multiprocessors), and the call runs it within Auto's workspace, smaller than an explicit
// Padded's; forward and backward against the oracle, the three empty experts' weight gradients
// (padding blocks of the strided products) exactly 0.  Every weight layout, the routing weight on the
// output (gate_up saved) and on the input (recomputed).  On the CPU its one path, on the same checks.
TEST_P(MoeKernels, AutoPaddedAtTheBound) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const UnsetMoeGemmEnv unset;
  const ScopedEnv no_sm90("KCPP_MOE_SM90", "0");  // cuBLAS's Auto (on Hopper Auto's forward would take the Hopper kernel)
  const Routing routing = given_routing(auto_bound_counts(), false, gen);
  const auto& [counts, ids, w, e, k, t] = routing;
  ASSERT_EQ(t, 80);
  ASSERT_EQ(moe::padded_rows_cap(t * k, e, false), 184);
  int sms = 0;
#if KCPP_WITH_CUDA && KCPP_MOE_CUDA
  if (dev.is_cuda()) {
    int d = 0;
    ASSERT_EQ(cudaGetDevice(&d), cudaSuccess);
    ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, d), cudaSuccess);
  }
#endif
  const std::vector<DType> dtypes = dev.is_cuda() ? std::vector<DType>{DType::bf16, DType::f16} : std::vector<DType>{DType::f32, DType::bf16};
  for (DType dt : dtypes)
    for (Layout layout : {Layout::Rows, Layout::Transposed, Layout::Separate})
      for (bool input : {false, true}) {
        const Case c{t, 64, e, k, 40, 0, moe::Routing::Given, false, input, kernel::Activation::Silu, layout, false, !input, false,
                     layout == Layout::Transposed};
        const std::string cfg = test::config_name(dev, dt) + " " + describe(c) + " gemm=auto";
        Block m{c, dt, dev, moe::ExpertGemm::Auto};
        m.build(gen, &ids, &w, true);
        if (dev.is_cuda()) {  // Auto's padded rows: floor(23 S / 20), below an explicit Padded's S + S / 4 + 16 E
          moe::MoeParams asked = m.p;
          asked.expert_gemm = moe::ExpertGemm::Padded;
          EXPECT_LT(moe::moe_workspace(m.p, false, true), moe::moe_workspace(asked, false, true)) << cfg;
          EXPECT_LT(moe::moe_workspace(m.p, true, true), moe::moe_workspace(asked, true, true)) << cfg;
        }
        ASSERT_EQ(m.forward(), nullptr) << cfg;
        expect_permutation(m, ids, cfg);
        if (dev.is_cuda()) {  // the path the call took: the rule on the offsets it read back
          const std::vector<int64_t> off = m.offsets.to_i64_vector();
          std::vector<int32_t> off32;
          for (int64_t x = 0; x <= e; ++x) off32.push_back(static_cast<int32_t>(off[static_cast<size_t>(x)]));
          const moe::PaddedLayout l = moe::padded_layout(off32.data(), e);
          EXPECT_EQ(l.experts * l.rows, 184) << cfg;
          EXPECT_EQ(moe::choose_expert_gemm(moe::ExpertGemm::Auto, off32.data(), e, c.h, c.i, t * k, sms), moe::ExpertGemm::Padded)
              << cfg << " (" << sms << " multiprocessors)";
        }
        expect_given_routing_matches_the_oracle(m, ids, w, counts, gen, cfg);
      }
}

// The gate / up weights' gradients asked for in part: neither, up only, gate only (the cuBLAS
// backward then gathers x by row only when one is asked for, and with gate_up saved not at all).
// The routing weight on the output, gate_up saved or recomputed, and on the input; gate and up
// stacked (the asked half alone) and apart; AwkwardExpertCounts' counts.  dx, dw and ddown match the
// oracle, so does what was asked for (the empty experts' exactly 0), and what was not stays untouched
// (NaN).  On CUDA on each path of the experts' GEMMs.
TEST_P(MoeKernels, PartialGateUpGradients) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const Routing routing = given_routing({0, 1, 5, 0, 3, 3, 12}, true, gen);
  const auto& [counts, ids, w, e, k, t] = routing;
  const std::vector<DType> dtypes = dev.is_cuda() ? std::vector<DType>{DType::bf16} : std::vector<DType>{DType::f32, DType::bf16};
  for (DType dt : dtypes)
    for (Layout layout : {Layout::Rows, Layout::Separate})
      for (bool input : {false, true})
        for (bool save : {true, false})
          for (int grads : {0, 2, 1})
            for (moe::ExpertGemm gemm : gemm_paths(dev)) {
              const bool rows = layout == Layout::Rows;
              const Case c{t, rows ? 64 : 37, e, k, rows ? 40 : 19, 0, moe::Routing::Given, false, input, kernel::Activation::Silu,
                           layout, false, save, false, false};
              const std::string cfg = test::config_name(dev, dt) + " " + describe(c) +
                                      fmt::format(" dgate={} dup={} gemm={}", (grads & 1) != 0, (grads & 2) != 0, gemm_name(gemm));
              Block m{c, dt, dev, gemm};
              m.gate_up_grads = grads;
              m.build(gen, &ids, &w, true);
              ASSERT_EQ(m.forward(), nullptr) << cfg;
              const oracle::MoeSpec s = m.spec();
              const oracle::MoeWeights wt = m.oracle_weights();
              const double tol = test::composite_rel_l2(dt);
              EXPECT_TRUE(test::close_l2(m.out, oracle::moe(s, wt, {}, ids, w, nullptr, nullptr).out, tol)) << cfg << " out";
              ASSERT_EQ(m.backward(gen), nullptr) << cfg;
              const auto dout = m.dout.to_f64_vector();
              const oracle::MoeResult g = oracle::moe(s, wt, {}, ids, w, &dout, nullptr);
              EXPECT_TRUE(close_grad(m.dx, g.dx, g.dx_mag, tol)) << cfg << " dhidden";
              EXPECT_TRUE(close_grad(m.dw, g.dw, g.dw_mag, tol)) << cfg << " dtopk_weights";
              EXPECT_TRUE(close_grad(m.ddown, g.ddown, g.ddown_mag, tol)) << cfg << " ddown_proj";
              const Tensor dgate = rows ? m.dgate_up.narrow(1, 0, c.i) : m.dgate;
              const Tensor dup = rows ? m.dgate_up.narrow(1, c.i, c.i) : m.dup;
              for (int half = 0; half < 2; ++half) {
                const Tensor& grad = half ? dup : dgate;
                const char* name = half ? " dup" : " dgate";
                if (!(grads >> half & 1)) {
                  EXPECT_TRUE(all_nan(grad)) << cfg << name << " (not asked for) was written";
                  continue;
                }
                EXPECT_TRUE(close_grad(grad, half ? g.dup : g.dgate, half ? g.dup_mag : g.dgate_mag, tol)) << cfg << name;
                for (int64_t x = 0; x < e; ++x)
                  if (counts[static_cast<size_t>(x)] == 0)
                    for (double v : grad.select(0, x).to_f64_vector()) ASSERT_EQ(v, 0.0) << cfg << name << " expert " << x << " (no slots)";
              }
            }
}

// The backward allowed to write over the saved gate_up (MoeParams::overwrite_gate_up) gives the same
// bits as without: AwkwardExpertCounts' counts (empty experts, one slot, equal counts, sentinels), H and
// I no multiple of 8 and multiples of 8, every weight layout, the routing weight on the output and on
// the input (gate_up saved in both), every path.  The run without the flag is held to the oracle
// first.  On CUDA (every path; Padded copies a group of experts' rows at a time from there) the saved
// tensor was written (it held [dg, du]) and the workspace is smaller; on the CPU it is unread.
// The same values, NaN matching NaN (a saved gate_up's rows past the routed ones are never written).
bool same_values(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return false;
  for (size_t q = 0; q < a.size(); ++q)
    if (!(a[q] == b[q] || (std::isnan(a[q]) && std::isnan(b[q])))) return false;
  return true;
}

TEST_P(MoeKernels, OverwriteGateUpGivesTheSameBits) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const Routing routing = given_routing({0, 1, 5, 0, 3, 3, 12}, true, gen);
  const auto& [counts, ids, w, e, k, t] = routing;
  struct Size {
    int64_t h, i;
  };
  const std::vector<DType> dtypes = dev.is_cuda() ? std::vector<DType>{DType::bf16, DType::f16} : std::vector<DType>{DType::f32, DType::bf16};
  for (const Size sz : {Size{37, 19}, Size{64, 40}})
    for (DType dt : dtypes)
      for (Layout layout : {Layout::Rows, Layout::Transposed, Layout::Separate})
        for (bool input : {false, true})
          for (moe::ExpertGemm gemm : gemm_paths(dev)) {
            const Case c{t, sz.h, e, k, sz.i, 0, moe::Routing::Given, false, input, kernel::Activation::Silu, layout, false,
                         true, false, layout == Layout::Transposed};
            const std::string cfg = test::config_name(dev, dt) + " " + describe(c) + " gemm=" + gemm_name(gemm);
            Block m{c, dt, dev, gemm};
            m.build(gen, &ids, &w, true);
            ASSERT_EQ(m.forward(), nullptr) << cfg;
            const std::vector<double> saved = m.saved.to_f64_vector();
            expect_given_routing_matches_the_oracle(m, ids, w, counts, gen, cfg);
            EXPECT_TRUE(same_values(m.saved.to_f64_vector(), saved)) << cfg << " (gate_up written without the flag)";
            std::vector<Tensor> grads{m.dx, m.dw, m.ddown};
            if (layout == Layout::Separate) grads.insert(grads.end(), {m.dgate, m.dup});
            else grads.push_back(m.dgate_up);
            std::vector<std::vector<double>> before;
            for (const Tensor& g : grads) before.push_back(g.to_f64_vector());
            const size_t plain = moe::moe_workspace(m.p, true, dev.is_cuda());
            m.p.overwrite_gate_up = true;
            const size_t over = moe::moe_workspace(m.p, true, dev.is_cuda());
            for (const Tensor& g : grads) g.fill_(kNaN);
            ASSERT_EQ(m.rerun_backward(), nullptr) << cfg;
            for (size_t q = 0; q < grads.size(); ++q) EXPECT_EQ(grads[q].to_f64_vector(), before[q]) << cfg << " gradient " << q;
            const bool reused = dev.is_cuda();  // Padded too: its [dg, du] by position, copied a group at a time
            if (reused) {
              EXPECT_FALSE(same_values(m.saved.to_f64_vector(), saved)) << cfg << " (the saved gate_up was not written)";
              EXPECT_LT(over, plain) << cfg;
            } else {
              EXPECT_TRUE(same_values(m.saved.to_f64_vector(), saved)) << cfg;
              EXPECT_EQ(over, plain) << cfg;
            }
          }
}

// Loop's smaller buffers (moe.h): with I > H / 2 the training forward forms h in windows of rows (an
// expert's 41 rows over six of them) and the backward forms q, c h and dW_down in chunks of I's
// columns (equal chunks of 16 at I = 96, with 16-byte loads; a last one of 4 at I = 100, without);
// forward and backward against the oracle in every layout, weights on the output and on the input,
// with the saved gate_up overwritten or not, and the workspaces smaller than Grouped's by the rows
// of h and c h they no longer hold.  Padded asked for on the same counts runs Grouped (its layout
// needs more than the workspace's 144 padded rows; expert 0's 48 would not fit a group's 40 either),
// its forward in windows of 80 rows (moe.h: Padded's groups).
TEST_P(MoeKernels, LoopWindowsAndChunks) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  if (!dev.is_cuda()) GTEST_SKIP() << "Loop is a CUDA path";
  Generator gen = test::test_generator();
  const Routing routing = given_routing({41, 3, 0, 18}, true, gen);
  const auto& [counts, ids, w, e, k, t] = routing;
  const int64_t h = 32, s = t * k;
  EXPECT_EQ(moe::loop_window_rows(s, h, 96), 8);
  EXPECT_EQ(moe::loop_chunk_cols(h, 96), 16);
  EXPECT_EQ(moe::loop_chunk_cols(h, 100), 16);
  EXPECT_EQ(moe::padded_group_rows(moe::padded_rows_cap(s, e, true)), 40);
  for (moe::ExpertGemm gemm : {moe::ExpertGemm::Loop, moe::ExpertGemm::Padded})
  for (DType dt : {DType::bf16, DType::f16})
    for (int64_t i : {96, 100})
      for (Layout layout : {Layout::Rows, Layout::Transposed, Layout::Separate})
        for (bool input : {false, true})
          for (bool overwrite : {false, true}) {
            const Case c{t, h, e, k, i, 0, moe::Routing::Given, false, input, kernel::Activation::Silu, layout, false, true, false,
                         layout == Layout::Transposed};
            const std::string cfg = test::config_name(dev, dt) + " " + describe(c) + " gemm=" + gemm_name(gemm) +
                                    " overwrite=" + std::to_string(overwrite);
            Block m{c, dt, dev, gemm};
            m.build(gen, &ids, &w, true);
            m.p.overwrite_gate_up = overwrite;
            if (gemm == moe::ExpertGemm::Padded) {
              ASSERT_EQ(m.forward(), nullptr) << cfg;
              expect_given_routing_matches_the_oracle(m, ids, w, counts, gen, cfg);
              continue;
            }
            moe::MoeParams grouped = m.p;
            grouped.expert_gemm = moe::ExpertGemm::Grouped;
            const int64_t eb = 2;
            EXPECT_EQ(moe::moe_workspace(grouped, false, true) - moe::moe_workspace(m.p, false, true),
                      static_cast<size_t>((s * i * eb + 255) / 256 * 256 - (8 * i * eb + 255) / 256 * 256)) << cfg << " forward";
            EXPECT_EQ(moe::moe_workspace(grouped, true, true) - moe::moe_workspace(m.p, true, true),
                      static_cast<size_t>((s * i * eb + 255) / 256 * 256 - (s * 16 * eb + 255) / 256 * 256)) << cfg << " backward";
            ASSERT_EQ(m.forward(), nullptr) << cfg;
            expect_given_routing_matches_the_oracle(m, ids, w, counts, gen, cfg);
          }
}

// Padded's groups (moe.h) where one expert's padded rows exceed a group: one expert taking all 64
// slots (top-1) has 64 padded rows, within the workspace's 96 but more than a group's 24, so the
// call runs Grouped, its training forward in windows of 48 rows (the expert's rows split in two), its
// backward with [dg, du] over the saved gate_up; against the oracle, overwrite or not.
TEST_P(MoeKernels, PaddedGroupTooSmallRunsGroupedInWindows) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  if (!dev.is_cuda()) GTEST_SKIP() << "Padded is a CUDA path";
  Generator gen = test::test_generator();
  const Routing routing = given_routing({64}, false, gen, 1);
  const auto& [counts, ids, w, e, k, t] = routing;
  ASSERT_EQ(moe::padded_rows_cap(t * k, e, true), 96);
  ASSERT_EQ(moe::padded_group_rows(96), 24);
  for (int64_t i : {24, 20})
    for (Layout layout : {Layout::Rows, Layout::Separate})
      for (bool overwrite : {false, true}) {
        const Case c{t, 32, e, k, i, 0, moe::Routing::Given, false, false, kernel::Activation::Silu, layout, false, true, false, false};
        const std::string cfg = test::config_name(dev, DType::bf16) + " " + describe(c) + " overwrite=" + std::to_string(overwrite);
        Block m{c, DType::bf16, dev, moe::ExpertGemm::Padded};
        m.build(gen, &ids, &w, true);
        m.p.overwrite_gate_up = overwrite;
        ASSERT_EQ(m.forward(), nullptr) << cfg;
        expect_given_routing_matches_the_oracle(m, ids, w, counts, gen, cfg);
      }
}

// The counting sort at scale: 72,000 slots (282 chunks of 256: several warps and two passes of the
// per-expert scan) over 128 experts and the sentinels (129 buckets: the offsets' scan over five warps'
// worth), against the host's stable sort.
TEST_P(MoeKernels, PermutationAtScale) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const int64_t e = 128, k = 8, t = 9000;
  std::vector<int64_t> ids(static_cast<size_t>(t * k));
  std::vector<double> w(ids.size(), 0.5);
  std::uniform_int_distribution<int64_t> pick(-1, e);  // -1 and e: taken by no expert
  for (int64_t& id : ids) id = pick(gen.engine());
  const Case c{t, 8, e, k, 8, 0, moe::Routing::Given, false, false, kernel::Activation::Silu, Layout::Rows, false, true, false, false};
  Block m{c, DType::bf16, dev, moe::ExpertGemm::Kernel};
  m.build(gen, &ids, &w, true);
  ASSERT_EQ(m.forward(), nullptr);
  expect_permutation(m, ids, test::config_name(dev, DType::bf16) + " " + describe(c));
}

// ExpertGemm::Auto where one expert's weight fills the device (H 2048 x I 1536: 192 tiles of 128 x 128,
// at least one per multiprocessor): its rule takes Loop whatever the counts, so its workspace holds no
// padded rows (the same bytes as Loop's), and with overwrite_gate_up none for [dg, du] either; the
// forward and the backward (which writes over the saved gate_up) against the oracle, the empty
// expert's gradients exactly 0.  CUDA only (the CPU has one path).
TEST_P(MoeKernels, AutoWhereLoopAlwaysHoldsNoPaddedRows) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  if (!dev.is_cuda()) GTEST_SKIP() << "the paths are CUDA's";
  Generator gen = test::test_generator();
  const UnsetMoeGemmEnv unset;
  int sms = 0;
#if KCPP_WITH_CUDA && KCPP_MOE_CUDA
  int d = 0;
  ASSERT_EQ(cudaGetDevice(&d), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, d), cudaSuccess);
#endif
  const int64_t h = 2048, i = 1536, k = 2;
  if (!moe::auto_always_loop(h, i, sms)) GTEST_SKIP() << sms << " multiprocessors: more than H x I's 192 tiles";
  const std::vector<int64_t> counts{5, 0, 9, 2};
  const int64_t e = static_cast<int64_t>(counts.size());
  std::vector<int64_t> ids;
  std::vector<double> w;
  given_slots(counts, {}, gen, ids, w);
  const int64_t t = static_cast<int64_t>(ids.size()) / k;
  const Case c{t, h, e, k, i, 0, moe::Routing::Given, false, false, kernel::Activation::Silu, Layout::Rows, false, true, false, false};
  const std::string cfg = test::config_name(dev, DType::bf16) + " " + describe(c) + " gemm=auto";
  Block m{c, DType::bf16, dev, moe::ExpertGemm::Auto};
  m.build(gen, &ids, &w, true);
  moe::MoeParams loop = m.p;
  loop.expert_gemm = moe::ExpertGemm::Loop;
  for (bool bwd : {false, true}) EXPECT_EQ(moe::moe_workspace(m.p, bwd, true), moe::moe_workspace(loop, bwd, true)) << cfg << " bwd=" << bwd;
  const size_t plain = moe::moe_workspace(m.p, true, true);
  m.p.overwrite_gate_up = true;
  EXPECT_EQ(moe::moe_workspace(m.p, true, true) + static_cast<size_t>((t * k * 2 * i * 2 + 255) / 256 * 256), plain) << cfg;
  ASSERT_EQ(m.forward(), nullptr) << cfg;
  const std::vector<double> saved = m.saved.to_f64_vector();
  expect_given_routing_matches_the_oracle(m, ids, w, counts, gen, cfg);
  EXPECT_FALSE(same_values(m.saved.to_f64_vector(), saved)) << cfg << " (the saved gate_up was not written)";
}

#if KCPP_WITH_CUDA && KCPP_MOE_CUDA
// The CUDA backward's workspace (host arithmetic, no device needed for the paths asked for by name), at
// Mixtral-8x7B's dimensions (8192 tokens, top-2, H 4096, I 14336, bf16) and a small odd block: with
// the saved gate_up and overwrite_gate_up it holds S x 2I elements fewer on Kernel, Loop and Grouped,
// the same on Padded; recomputing gate_up costs no more than saving it (the recomputed [g, u] holds
// [dg, du] after).  Auto holds no padded rows where its rule takes Loop whatever the counts (Mixtral),
// floor(23 S / 20) elsewhere (Qwen3-30B-A3B).
TEST(MoeWorkspace, OverwriteGateUpFreesTheGradientRows) {
  struct Dims {
    int64_t t, h, e, k, i;
  };
  constexpr int64_t kMiB = int64_t(1) << 20;
  for (const Dims d : {Dims{8192, 4096, 8, 2, 14336}, Dims{13, 37, 7, 3, 19}})
    for (kernel::DType dt : {kernel::DType::bf16, kernel::DType::f16})
      for (bool input : {false, true}) {
        moe::MoeParams p;
        p.dtype = dt;
        p.tokens = d.t, p.hidden = d.h, p.experts = d.e, p.top_k = d.k, p.inter = d.i;
        p.routing = moe::Routing::Given;
        p.weight_on = input ? moe::WeightOn::Input : moe::WeightOn::Output;
        const int64_t s = d.t * d.k;
        const size_t rows = static_cast<size_t>((s * 2 * d.i * 2 + 255) / 256 * 256);  // S x 2I, 256-byte aligned
        static char token;  // a saved gate_up's address: only whether there is one counts here
        for (moe::ExpertGemm g : {moe::ExpertGemm::Kernel, moe::ExpertGemm::Loop, moe::ExpertGemm::Grouped, moe::ExpertGemm::Padded}) {
          const std::string cfg = fmt::format("T={} H={} I={} input={} gemm={}", d.t, d.h, d.i, input, gemm_name(g));
          p.expert_gemm = g;
          p.gate_up = nullptr, p.overwrite_gate_up = false;
          const size_t recomputed = moe::moe_workspace(p, true, true);
          p.gate_up = &token;
          const size_t saved = moe::moe_workspace(p, true, true);
          p.overwrite_gate_up = true;
          const size_t over = moe::moe_workspace(p, true, true);
          EXPECT_EQ(recomputed, saved) << cfg;
          // Padded's groups (moe.h): [dg, du] over the saved gate_up, a group's padded rows held.
          const int64_t cap = moe::padded_rows_cap(s, d.e, true);
          const size_t group = static_cast<size_t>((moe::padded_group_rows(cap) * 2 * d.i * 2 + 255) / 256 * 256);
          const size_t padded_dgu = static_cast<size_t>((cap * 2 * d.i * 2 + 255) / 256 * 256);  // Padded's [dg, du] rows
          if (g == moe::ExpertGemm::Padded) EXPECT_EQ(over + padded_dgu - group, saved) << cfg;
          else EXPECT_EQ(over + rows, saved) << cfg;
          if (g == moe::ExpertGemm::Padded) {  // the training forward: [g, u] and h a group at a time
            const size_t fwd_saved = moe::moe_workspace(p, false, true);
            p.gate_up = nullptr;
            const size_t fwd_inference = moe::moe_workspace(p, false, true);
            p.gate_up = &token;
            EXPECT_EQ(fwd_saved + padded_dgu, fwd_inference + group) << cfg;
          }
          if (d.t == 8192 && g == moe::ExpertGemm::Loop && !input) {
            // Loop's chunks of c h [S, 2048] 64 MiB + x / dout / dx by row [S, H] 128 MiB + cuBLAS's 32 MiB
            // + q . h's row sums (S x 112 tiles of f32, 7 MiB) and small buffers; the forward: Loop's
            // window of h [2336, I] 64 MiB + y by row 128 MiB + cuBLAS's 32 MiB.  With the saved gate_up
            // (S x 2I, 896 MiB) either stays under Transformers' grouped_mm's 1152 MiB (bench/RESULTS.md).
            EXPECT_EQ(saved - over, static_cast<size_t>(896 * kMiB)) << cfg;
            EXPECT_LT(over, static_cast<size_t>(232 * kMiB)) << cfg;
            EXPECT_GT(over, static_cast<size_t>(231 * kMiB)) << cfg;
            const size_t fwd = moe::moe_workspace(p, false, true);
            EXPECT_LT(fwd, static_cast<size_t>(225 * kMiB)) << cfg;
            EXPECT_LT(896 * kMiB + std::max(fwd, over), static_cast<size_t>(1152 * kMiB)) << cfg;
          }
        }
      }
  EXPECT_TRUE(moe::auto_always_loop(4096, 14336, 132));
  EXPECT_EQ(moe::loop_window_rows(16384, 4096, 14336), 2336);
  EXPECT_EQ(moe::loop_chunk_cols(4096, 14336), 2048);
  EXPECT_EQ(moe::padded_group_rows(75366), 18848);  // Qwen3-30B-A3B under Auto: 55 MiB of [g, u] rows
  EXPECT_EQ(moe::padded_group_rows(1), 8);
  EXPECT_EQ(moe::loop_chunk_cols(2048, 768), 768);  // Qwen3-30B-A3B: one chunk
  EXPECT_EQ(moe::loop_chunk_cols(64, 40), 24);      // 24 + 16
  EXPECT_EQ(moe::loop_chunk_cols(37, 19), 16);      // 16 + 3
  EXPECT_EQ(moe::loop_window_rows(100, 4096, 2048), 100);  // I <= H / 2: all rows
  EXPECT_EQ(moe::loop_window_rows(100, 8192, 14336), 24);
  EXPECT_EQ(moe::loop_window_rows(5, 16, 4096), 5);  // at least 8 rows, at most all
  EXPECT_EQ(moe::workspace_padded_rows(moe::ExpertGemm::Auto, 16384, 8, 4096, 14336, 132), 0);
  EXPECT_FALSE(moe::auto_always_loop(2048, 768, 132));
  EXPECT_EQ(moe::workspace_padded_rows(moe::ExpertGemm::Auto, 65536, 128, 2048, 768, 132), 75366);
  EXPECT_EQ(moe::workspace_padded_rows(moe::ExpertGemm::Padded, 16384, 8, 4096, 14336, 132), 16384 + 4096 + 128);
  for (moe::ExpertGemm g : {moe::ExpertGemm::Kernel, moe::ExpertGemm::Loop, moe::ExpertGemm::Grouped})
    EXPECT_EQ(moe::workspace_padded_rows(g, 65536, 128, 2048, 768, 132), 0) << gemm_name(g);
  // Auto's rule where it holds no padded rows: Loop on any counts (a skewed routing, one expert alone, none).
  for (const std::vector<int32_t>& off : {std::vector<int32_t>{0, 2048, 4096, 6144, 8192, 10240, 12288, 14336, 16384},
                                          std::vector<int32_t>{0, 16000, 16100, 16200, 16300, 16384, 16384, 16384, 16384},
                                          std::vector<int32_t>{0, 0, 0, 0, 1, 1, 1, 1, 1},
                                          std::vector<int32_t>(9, 0)})
    EXPECT_EQ(moe::choose_expert_gemm(moe::ExpertGemm::Auto, off.data(), 8, 4096, 14336, off.back(), 132), moe::ExpertGemm::Loop);
}
#endif

// The Hopper GEMM's work order (kernel/tile_order.h: panel_item): every (m tile, n tile) pair is the
// item of exactly one index, at tile counts below, at and past a panel's (16) and its multiples, and
// within a panel the n tiles go outer (the panel's m tiles inner).
// The offsets' check that the host runs once they are read back and the planning kernel on the device.
TEST(MoeGemmOrder, OffsetsGroupTheSlots) {
  const std::vector<int32_t> good{0, 3, 3, 8, 12}, empty{0, 0, 0}, short_of_s{0, 2, 5};
  EXPECT_TRUE(moe::offsets_group_slots(good.data(), 4, 12));
  EXPECT_TRUE(moe::offsets_group_slots(empty.data(), 2, 12));
  EXPECT_TRUE(moe::offsets_group_slots(short_of_s.data(), 2, 12));  // slots no expert takes
  const std::vector<int32_t> past_s{0, 3, 3, 8, 20}, late_start{1, 3, 3, 8, 12}, decreasing{0, 5, 3, 8, 12};
  EXPECT_FALSE(moe::offsets_group_slots(past_s.data(), 4, 12));
  EXPECT_FALSE(moe::offsets_group_slots(late_start.data(), 4, 12));
  EXPECT_FALSE(moe::offsets_group_slots(decreasing.data(), 4, 12));
}

TEST(MoeGemmOrder, PanelItemsCoverEveryTileOnce) {
  for (int panel : {1, 3, 16})
    for (int m_tiles : {1, 2, 15, 16, 17, 31, 32, 33, 151})
      for (int n_tiles : {1, 2, 6, 112}) {
        std::vector<int> seen(static_cast<size_t>(m_tiles) * static_cast<size_t>(n_tiles), 0);
        int prev_mt = -1, prev_nt = -1;
        for (int64_t w = 0; w < static_cast<int64_t>(m_tiles) * n_tiles; ++w) {
          int mt = -1, nt = -1;
          kernel::panel_item(w, m_tiles, n_tiles, panel, &mt, &nt);
          ASSERT_TRUE(mt >= 0 && mt < m_tiles && nt >= 0 && nt < n_tiles)
              << "panel " << panel << " " << m_tiles << " x " << n_tiles << " item " << w << ": (" << mt << ", " << nt << ")";
          ++seen[static_cast<size_t>(mt) * static_cast<size_t>(n_tiles) + static_cast<size_t>(nt)];
          if (w % (static_cast<int64_t>(panel) * n_tiles) != 0) {  // within a panel: m inner, n outer
            EXPECT_EQ(mt / panel, prev_mt / panel) << "panel " << panel << " item " << w;
            EXPECT_GE(nt, prev_nt) << "panel " << panel << " item " << w;
          }
          prev_mt = mt, prev_nt = nt;
        }
        for (int v : seen) ASSERT_EQ(v, 1) << "panel " << panel << " " << m_tiles << " x " << n_tiles;
      }
}

// How the experts' GEMMs are chosen on CUDA: KCPP_MOE_GEMM when ExpertGemm is Auto (an unknown value
// is an error that names it), and without it cuBLAS (Loop, Grouped or Padded by the experts' counts);
// every choice matches the oracle on a block of 200 tokens.
TEST_P(MoeKernels, ExpertGemmChoice) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  if (!dev.is_cuda()) GTEST_SKIP() << "the choice is CUDA's";
  Generator gen = test::test_generator();
  const Case c{200, 96, 8, 2, 80, 0, moe::Routing::Softmax, true, false, kernel::Activation::Silu, Layout::Rows, false, true,
               false, false};
  const char* before = std::getenv("KCPP_MOE_GEMM");
  const std::string saved = before ? before : "";
  for (const char* env : {"bogus", "kernel", "loop", "grouped", "padded", "auto", ""}) {
    const std::string cfg = fmt::format("KCPP_MOE_GEMM='{}'", env);
    setenv("KCPP_MOE_GEMM", env, 1);
    Block m{c, DType::bf16, dev};
    m.build(gen);
    if (std::string(env) == "bogus") {
      EXPECT_TRUE(test::kernel_error_contains(m.forward(), "KCPP_MOE_GEMM='bogus'")) << cfg;
      continue;
    }
    ASSERT_EQ(m.forward(), nullptr) << cfg;
    const oracle::MoeSpec s = m.spec();
    const oracle::MoeWeights wt = m.oracle_weights();
    const auto z = m.logits.to_f64_vector();
    std::vector<int64_t> ids;
    std::vector<double> w;
    oracle::moe_route(s, z, ids, w);
    EXPECT_EQ(m.ids.to_i64_vector(), ids) << cfg;
    const double tol = test::composite_rel_l2(DType::bf16);
    EXPECT_TRUE(test::close_l2(m.out, oracle::moe(s, wt, z, ids, w, nullptr, nullptr).out, tol)) << cfg << " out";
    ASSERT_EQ(m.backward(gen), nullptr) << cfg;
    const auto dout = m.dout.to_f64_vector();
    const oracle::MoeResult g = oracle::moe(s, wt, z, ids, w, &dout, nullptr);
    EXPECT_TRUE(close_grad(m.dx, g.dx, g.dx_mag, tol)) << cfg << " dhidden";
    EXPECT_TRUE(close_grad(m.drouter, g.drouter, g.drouter_mag, tol)) << cfg << " drouter_weight";
    EXPECT_TRUE(close_grad(m.dgate_up.narrow(1, 0, c.i), g.dgate, g.dgate_mag, tol)) << cfg << " dgate";
    EXPECT_TRUE(close_grad(m.ddown, g.ddown, g.ddown_mag, tol)) << cfg << " ddown_proj";
  }
  if (before) setenv("KCPP_MOE_GEMM", saved.c_str(), 1);
  else unsetenv("KCPP_MOE_GEMM");
}

// The cuBLAS path chosen from the counts read back (moe.h: choose_expert_gemm), a host function:
// Loop for a few large experts; Padded when padding every expert from the first to the last with
// tokens to the largest count (a multiple of 8) adds at most 15% rows; Grouped beyond, or when a
// Padded call asked for would not fit the workspace's padded rows.
TEST(MoeExpertGemmRule, PaddedOrGrouped) {
  using moe::ExpertGemm;
  auto offsets_of = [](const std::vector<int64_t>& counts) {
    std::vector<int32_t> o{0};
    for (int64_t c : counts) o.push_back(o.back() + static_cast<int32_t>(c));
    return o;
  };
  auto choose = [&](ExpertGemm asked, const std::vector<int64_t>& counts, int64_t h, int64_t i, int64_t slots) {
    const std::vector<int32_t> o = offsets_of(counts);
    return moe::choose_expert_gemm(asked, o.data(), static_cast<int64_t>(counts.size()), h, i, slots, 132);
  };
  // Qwen3-30B-A3B's experts (H 2048, I 768, 128 experts, 8192 tokens top-8): 512 each is no padding.
  std::vector<int64_t> even(128, 512);
  EXPECT_EQ(choose(ExpertGemm::Auto, even, 2048, 768, 65536), ExpertGemm::Padded);
  // The largest 584 (M 584: 14.1% over the routed rows) still Padded; 592 (15.6%) Grouped, which an
  // explicit Padded still takes (within S + S / 4 + 16 E rows); 1024 neither.  Auto's workspace holds
  // floor(23 S / 20) rows, what its rule takes; an explicit Padded's the larger bound.
  EXPECT_EQ(moe::padded_rows_cap(65536, 128, false), 75366);
  EXPECT_EQ(moe::padded_rows_cap(65536, 128, true), 65536 + 16384 + 2048);
  for (const auto& [most, autom, asked] : {std::tuple{584, ExpertGemm::Padded, ExpertGemm::Padded},
                                           std::tuple{592, ExpertGemm::Grouped, ExpertGemm::Padded},
                                           std::tuple{1024, ExpertGemm::Grouped, ExpertGemm::Grouped}}) {
    std::vector<int64_t> skew(128, 0);
    skew[5] = most;
    const int64_t rest = (65536 - most) / 127;
    int64_t total = most;
    for (size_t e = 0; e < skew.size(); ++e)
      if (e != 5) skew[e] = rest, total += rest;
    skew[0] += 65536 - total;
    ASSERT_LE(skew[0], most);
    const moe::PaddedLayout l = moe::padded_layout(offsets_of(skew).data(), 128);
    EXPECT_EQ(l.first, 0);
    EXPECT_EQ(l.experts, 128);
    EXPECT_EQ(l.rows, (most + 7) / 8 * 8);
    EXPECT_EQ(choose(ExpertGemm::Auto, skew, 2048, 768, 65536), autom) << most;
    EXPECT_EQ(choose(ExpertGemm::Padded, skew, 2048, 768, 65536), asked) << most;
  }
  // Mixtral-8x7B's (H 4096, I 14336, 8 experts): Loop, as before.
  EXPECT_EQ(choose(ExpertGemm::Auto, std::vector<int64_t>(8, 2048), 4096, 14336, 16384), ExpertGemm::Loop);
  // Decode: one token's 8 experts spread over 128, each one row: the range 3 .. 120 padded to 8 rows
  // is 118 x 8 rows for 8 routed ones: Grouped unless asked for (it fits 8 + 2 + 16 x 128 rows).
  std::vector<int64_t> decode(128, 0);
  for (int e : {3, 17, 40, 41, 77, 90, 101, 120}) decode[static_cast<size_t>(e)] = 1;
  const moe::PaddedLayout d = moe::padded_layout(offsets_of(decode).data(), 128);
  EXPECT_EQ(d.first, 3);
  EXPECT_EQ(d.experts, 118);
  EXPECT_EQ(d.rows, 8);
  EXPECT_EQ(choose(ExpertGemm::Auto, decode, 2048, 768, 8), ExpertGemm::Grouped);
  EXPECT_EQ(choose(ExpertGemm::Padded, decode, 2048, 768, 8), ExpertGemm::Padded);
  // AwkwardExpertCounts' counts (26 slots, two taken by no expert): experts 1 .. 6 of 16 rows, and
  // Padded runs when asked for (that case's CUDA runs cover the padded path).
  const std::vector<int64_t> awkward{0, 1, 5, 0, 3, 3, 12};
  const moe::PaddedLayout a = moe::padded_layout(offsets_of(awkward).data(), 7);
  EXPECT_EQ(a.first, 1);
  EXPECT_EQ(a.experts, 6);
  EXPECT_EQ(a.rows, 16);
  EXPECT_EQ(choose(ExpertGemm::Padded, awkward, 37, 19, 26), ExpertGemm::Padded);
  EXPECT_EQ(choose(ExpertGemm::Auto, awkward, 37, 19, 26), ExpertGemm::Grouped);
  // AutoPaddedAtTheBound's counts (E 23, S 160, experts 4, 11 and 19 empty): 23 x 8 = 184 padded rows,
  // exactly floor(23 S / 20), Auto's workspace and the most its rule takes: Padded.  One slot fewer
  // (an expert of 7, S 159) keeps the layout at 184 rows over a bound of 182: Grouped under Auto, Padded
  // asked for (within S + S / 4 + 16 E).
  std::vector<int64_t> bound = auto_bound_counts();
  const moe::PaddedLayout b = moe::padded_layout(offsets_of(bound).data(), 23);
  EXPECT_EQ(b.first, 0);
  EXPECT_EQ(b.experts, 23);
  EXPECT_EQ(b.rows, 8);
  EXPECT_EQ(moe::padded_rows_cap(160, 23, false), 184);
  EXPECT_EQ(choose(ExpertGemm::Auto, bound, 64, 40, 160), ExpertGemm::Padded);
  EXPECT_EQ(choose(ExpertGemm::Padded, bound, 64, 40, 160), ExpertGemm::Padded);
  bound[22] = 7;
  EXPECT_EQ(moe::padded_rows_cap(159, 23, false), 182);
  EXPECT_EQ(choose(ExpertGemm::Auto, bound, 64, 40, 159), ExpertGemm::Grouped);
  EXPECT_EQ(choose(ExpertGemm::Padded, bound, 64, 40, 159), ExpertGemm::Padded);
  // No slot at all: an empty layout; Loop and Grouped asked for stay.
  const std::vector<int64_t> none(6, 0);
  EXPECT_EQ(moe::padded_layout(offsets_of(none).data(), 6).experts, 0);
  EXPECT_EQ(choose(ExpertGemm::Padded, none, 8, 4, 20), ExpertGemm::Padded);
  EXPECT_EQ(choose(ExpertGemm::Loop, even, 2048, 768, 65536), ExpertGemm::Loop);
  EXPECT_EQ(choose(ExpertGemm::Grouped, even, 2048, 768, 65536), ExpertGemm::Grouped);
}

#if KCPP_WITH_CUDA && KCPP_MOE_CUDA

// pf's forward and pb's backward, each with a workspace of its own, captured on a stream of their
// own into `graph`: their errors and the end of the capture's (cudaSuccess: the capture was valid).
struct CapturedCalls {
  Tensor fws, bws;
  cudaStream_t st = nullptr;
  cudaGraph_t graph = nullptr;
  const char *ef = nullptr, *eb = nullptr;
  cudaError_t begun = cudaErrorUnknown, ended = cudaErrorUnknown;
  CapturedCalls(moe::MoeParams pf, moe::MoeParams pb, Device dev)
      : fws(Tensor::empty({static_cast<int64_t>(moe::moe_workspace(pf, false, true))}, DType::u8, dev)),
        bws(Tensor::empty({static_cast<int64_t>(moe::moe_workspace(pb, true, true))}, DType::u8, dev)) {
    pf.workspace = fws.data(), pb.workspace = bws.data();
    if (cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) != cudaSuccess) return;
    if ((begun = cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal)) != cudaSuccess) return;
    ef = moe::moe_forward_cuda(pf, st);
    eb = moe::moe_backward_cuda(pb, st);
    ended = cudaStreamEndCapture(st, &graph);
  }
  CapturedCalls(const CapturedCalls&) = delete;
  CapturedCalls& operator=(const CapturedCalls&) = delete;
  ~CapturedCalls() {
    if (graph) cudaGraphDestroy(graph);
    if (st) cudaStreamDestroy(st);
  }
};

// Captured into a CUDA graph, a call that asks for cuBLAS takes the package's kernel (a host
// read-back cannot be captured): forward + backward replay bit for bit as the kernel's direct run.
TEST_P(MoeKernels, GraphCaptureTakesTheKernel) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  if (!dev.is_cuda()) GTEST_SKIP() << "CUDA graphs";
  Generator gen = test::test_generator();
  const Case c{100, 64, 8, 2, 48, 0, moe::Routing::Softmax, true, false, kernel::Activation::Silu, Layout::Rows, false, true,
               false, false};
  Block m{c, DType::bf16, dev, moe::ExpertGemm::Kernel};
  m.build(gen);
  ASSERT_EQ(m.forward(), nullptr);
  ASSERT_EQ(m.backward(gen), nullptr);
  const std::vector<Tensor> outs{m.out, m.logits, m.offsets, m.sorted, m.saved, m.dx, m.drouter, m.dgate_up, m.ddown, m.dw};
  std::vector<std::vector<double>> direct;
  for (const Tensor& o : outs) direct.push_back(o.to_f64_vector());

  moe::MoeParams pf = m.p, pb = m.p;
  pf.expert_gemm = pb.expert_gemm = moe::ExpertGemm::Grouped;
  const CapturedCalls cap(pf, pb, dev);
  ASSERT_EQ(cap.begun, cudaSuccess);
  ASSERT_EQ(cap.ended, cudaSuccess) << "the capture was invalidated";
  ASSERT_EQ(cap.ef, nullptr);
  ASSERT_EQ(cap.eb, nullptr);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, cap.graph, 0), cudaSuccess);
  for (int replay = 0; replay < 2; ++replay) {
    for (const Tensor& o : outs) ASSERT_EQ(cudaMemsetAsync(o.data(), 0xff, o.nbytes(), cap.st), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, cap.st), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(cap.st), cudaSuccess);
    for (size_t q = 0; q < outs.size(); ++q) EXPECT_EQ(outs[q].to_f64_vector(), direct[q]) << "output " << q << ", replay " << replay;
  }
  cudaGraphExecDestroy(exec);
}

// Captured into a CUDA graph, a call whose workspace holds Loop's smaller buffers (Loop asked for,
// I > H / 2, gate_up saved) cannot take the package's kernel, which needs whole ones: the forward and
// the backward are refused by name before anything is launched, and the capture stays valid.
TEST_P(MoeKernels, GraphCaptureRefusesLoopsSmallerBuffers) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  if (!dev.is_cuda()) GTEST_SKIP() << "CUDA graphs";
  Generator gen = test::test_generator();
  const Case c{100, 32, 8, 2, 96, 0, moe::Routing::Softmax, true, false, kernel::Activation::Silu, Layout::Rows, false, true,
               false, false};
  Block m{c, DType::bf16, dev, moe::ExpertGemm::Loop};
  m.build(gen);
  ASSERT_EQ(m.forward(), nullptr);
  ASSERT_EQ(m.backward(gen), nullptr);
  const CapturedCalls cap(m.p, m.p, dev);
  ASSERT_EQ(cap.begun, cudaSuccess);
  ASSERT_EQ(cap.ended, cudaSuccess) << "the capture was invalidated";
  for (const char* e : {cap.ef, cap.eb}) {
    ASSERT_NE(e, nullptr);
    EXPECT_NE(std::string(e).find("under CUDA graph capture"), std::string::npos) << e;
    EXPECT_NE(std::string(e).find("expert_gemm = Kernel"), std::string::npos) << e;
  }
}

// Expert offsets given to the backward that are no grouping of the S slots (expert_offsets[E] past S:
// positions past sorted_slots, rows past the workspace's) are refused by the cuBLAS paths after the
// read-back, before any row is written past the workspace; the rows gathered before the read-back
// (over the layout planned on the device) are none for such offsets.
TEST_P(MoeKernels, OffsetsPastTheSlotsAreRefused) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  if (!dev.is_cuda()) GTEST_SKIP() << "the cuBLAS paths' read-back";
  Generator gen = test::test_generator();
  const int64_t e = 4, k = 2;
  std::vector<int64_t> ids;
  std::vector<double> w;
  given_slots({3, 0, 5, 4}, {}, gen, ids, w);
  const int64_t t = static_cast<int64_t>(ids.size()) / k;
  const Case c{t, 32, e, k, 24, 0, moe::Routing::Given, false, false, kernel::Activation::Silu, Layout::Rows, false, true, false,
               false};
  for (moe::ExpertGemm gemm : {moe::ExpertGemm::Loop, moe::ExpertGemm::Grouped, moe::ExpertGemm::Padded}) {
    Block m{c, DType::bf16, dev, gemm};
    m.build(gen, &ids, &w, true);
    ASSERT_EQ(m.forward(), nullptr) << gemm_name(gemm);
    const std::vector<int32_t> bad{0, 3, 3, 8, 12 + 8, 12};  // expert 3 given 12 positions, 8 past S = 12
    ASSERT_EQ(cudaMemcpy(m.offsets.data(), bad.data(), bad.size() * sizeof(int32_t), cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_TRUE(test::kernel_error_contains(m.backward(gen), "expert_offsets are not a grouping of the 12 slots")) << gemm_name(gemm);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << gemm_name(gemm);
  }
}
#endif

TEST_P(MoeKernels, BadParams) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const Case c{4, 8, 3, 2, 4, 0, moe::Routing::Softmax, false, false, kernel::Activation::Silu, Layout::Rows, false, false,
               false, false};
  auto expect = [&](const std::function<void(moe::MoeParams&)>& edit, const char* needle) {
    Block m{c, DType::f32, dev};
    m.build(gen);
    edit(m.p);
    m.ws = Tensor::empty({1 << 16}, DType::u8, dev);
    m.p.workspace = m.ws.data();
    EXPECT_TRUE(test::kernel_error_contains(MOE_CALL(dev, moe::moe_forward, m.p), needle)) << needle;
  };
  expect([](moe::MoeParams& p) { p.top_k = 4; }, "exceeds the 3 experts");
  expect([](moe::MoeParams& p) { p.top_k = 0; }, "top_k = 0");
  expect([](moe::MoeParams& p) { p.router = nullptr; }, "router weight");
  expect([](moe::MoeParams& p) { p.gate.col_stride = 2; }, "unit row or column stride");
  expect([](moe::MoeParams& p) { p.x_stride = 3; }, "rows overlap");
  // The backward told it may write over a saved gate_up it was not given.
  Block m{c, dev.is_cuda() ? DType::bf16 : DType::f32, dev};
  m.build(gen);
  ASSERT_EQ(m.forward(), nullptr);
  m.p.overwrite_gate_up = true;
  EXPECT_TRUE(test::kernel_error_contains(m.backward(gen), "overwrite_gate_up without the saved gate_up"));
}

// Transformers' load_balancing_loss_func: several layers' logits as one [L, T, E] tensor, with and
// without an attention mask, and its gradient.
TEST_P(MoeKernels, LoadBalancingLoss) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  for (DType dt : {DType::f32, DType::bf16})
    for (int mask_kind : {0, 1, 2}) {
      const int64_t layers = 3, t = 7, e = 8, k = 2, rows = layers * t;
      const std::string cfg = fmt::format("{} mask={}", test::config_name(dev, dt), mask_kind);
      // bf16: logits spread so that no two rounded probabilities of a row tie (the top-k of tied
      // probabilities is the lower index, tested above); f32: random.
      Tensor z;
      if (dt == DType::f32) {
        z = Tensor::randn({layers, t, e}, dt, dev, gen);
      } else {
        std::vector<double> v(static_cast<size_t>(rows * e));
        std::vector<int64_t> perm(static_cast<size_t>(e));
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t a = 0; a < e; ++a) perm[a] = a;
          std::shuffle(perm.begin(), perm.end(), gen.engine());
          for (int64_t a = 0; a < e; ++a) v[r * e + a] = 0.5 * static_cast<double>(perm[a]);
        }
        z = Tensor::from_f64(v, {layers, t, e}, dt, dev);
      }
      std::vector<double> mv;
      Tensor mask;
      if (mask_kind == 1) {
        mv = {1, 1, 0, 1, 1, 1, 0};
        mask = Tensor::from_i64(std::vector<int64_t>{1, 1, 0, 1, 1, 1, 0}, {1, t}, DType::i64, dev);
      } else if (mask_kind == 2) {
        mv = {1, 0.5, 0, 1, 2, 1, 0};
        mask = Tensor::from_f64(mv, {t}, DType::f32, dev);
      }
      const Tensor loss = Tensor::full({1}, kNaN, DType::f32, dev);
      const Tensor dz = Tensor::full({layers, t, e}, kNaN, DType::f32, dev);
      moe::LoadBalancingParams p;
      p.dtype = kdtype(dt);
      p.rows = rows, p.experts = e, p.top_k = k;
      p.logits = z.data(), p.logits_stride = e;
      if (mask.defined()) {
        p.mask = mask.data(), p.mask_len = t;
        p.mask_type = mask_kind == 1 ? moe::MaskType::I64 : moe::MaskType::F32;
      }
      p.grad_scale = 0.02f;
      p.loss = static_cast<float*>(loss.data());
      p.dlogits = dz.data();
      const Tensor ws = Tensor::empty({static_cast<int64_t>(moe::load_balancing_workspace(p, dev.is_cuda())) + 1}, DType::u8, dev);
      p.workspace = ws.data();
      ASSERT_EQ(MOE_CALL(dev, moe::load_balancing, p), nullptr) << cfg;
      auto round = dt == DType::f32 ? +[](double v) { return static_cast<double>(static_cast<float>(v)); }
                                    : +[](double v) { return Tensor::from_f64(std::vector<double>{v}, {1}, DType::bf16).item(); };
      std::vector<double> ref_dz;
      const double ref = oracle::load_balancing_loss(z.to_f64_vector(), rows, e, k, mv, round, 0.02, &ref_dz);
      EXPECT_NEAR(loss.item(), ref, 1e-5 * std::abs(ref)) << cfg;
      EXPECT_TRUE(test::close_l2(dz, ref_dz, 1e-5)) << cfg << " drouter_logits";
    }
}

INSTANTIATE_TEST_SUITE_P(Devices, MoeKernels, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cpu() ? std::string("cpu") : std::string("cuda"); });

}  // namespace
}  // namespace kcpp
