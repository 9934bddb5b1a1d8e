#include "ops/nn/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "ops/check.h"
#include "ops/cuda/launch.h"

namespace kcpp::ops {
namespace {

constexpr int64_t kDeviceTopK = 1024;

// One row on the host, in f64 (sampling.h's definition).
void sample_row(const double* x, int64_t v, const SampleOptions& opt, uint64_t seed, int64_t position, int64_t* out) {
  out[0] = 0, out[1] = -1;
  for (int64_t i = 0; i < v; ++i)
    if (!std::isfinite(x[i])) {
      out[1] = i;
      return;
    }
  const auto pos = static_cast<uint64_t>(position);
  if (opt.top_k == 0 && opt.top_p >= 1.0) {  // Gumbel-max over the whole vocabulary
    double best = -INFINITY;
    for (int64_t i = 0; i < v; ++i) {
      const double g = x[i] / opt.temperature - std::log(-std::log(counter_uniform(seed, pos, static_cast<uint64_t>(i) + 1)));
      if (g > best) best = g, out[0] = i;
    }
    return;
  }
  const int64_t k = opt.top_k > 0 ? std::min(opt.top_k, v) : v;
  std::vector<int64_t> order(static_cast<size_t>(v));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int64_t a, int64_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
  std::vector<double> cum(static_cast<size_t>(k));
  double z = 0;
  for (int64_t i = 0; i < k; ++i) cum[static_cast<size_t>(i)] = z += std::exp((x[order[i]] - x[order[0]]) / opt.temperature);
  int64_t n = k;
  if (opt.top_p < 1.0)
    for (int64_t i = 0; i < k; ++i)
      if (cum[static_cast<size_t>(i)] >= opt.top_p * z) {
        n = i + 1;
        break;
      }
  const double target = counter_uniform(seed, pos, 0) * cum[static_cast<size_t>(n - 1)];
  int64_t pick = n - 1;
  for (int64_t i = 0; i < n; ++i)
    if (cum[static_cast<size_t>(i)] > target) {
      pick = i;
      break;
    }
  out[0] = order[pick];
}

}  // namespace

void advance_decode_inputs(const Tensor& picks, const Tensor& ids, const Tensor& positions, const Tensor& lengths) {
  constexpr const char* op = "advance_decode_inputs";
  KCPP_CHECK(picks.defined() && picks.dtype() == DType::i64 && picks.dim() == 2 && picks.size(1) == 2,
             "op {}: picks must be [B, 2] i64 (what argmax_checked and sample_checked return)", op);
  const int64_t b = picks.size(0);
  KCPP_CHECK(ids.defined() && ids.dtype() == DType::i64 && ids.shape() == Shape({b, 1}), "op {}: ids must be [{}, 1] i64", op, b);
  for (const auto& [t, name] : {std::pair{&positions, "positions"}, std::pair{&lengths, "lengths"}})
    KCPP_CHECK(t->defined() && t->dtype() == DType::i32 && t->shape() == Shape({b}), "op {}: {} must be [{}] i32", op, name, b);
  for (const Tensor* t : {&picks, &ids, &positions, &lengths}) {
    KCPP_CHECK(t->is_contiguous(), "op {}: every tensor must be contiguous", op);
    KCPP_CHECK(t->device() == picks.device(), "op {}: every tensor must be on the picks' device {}, got {}", op,
               picks.device().str(), t->device().str());
  }
  if (picks.device().is_cuda()) {
#if KCPP_WITH_CUDA
    cuda::advance_decode_inputs(picks, ids, positions, lengths);
    return;
#endif
  }
  const int64_t* pk = picks.data_ptr<int64_t>();
  int64_t* id = ids.data_ptr<int64_t>();
  int32_t* ps = positions.data_ptr<int32_t>();
  int32_t* ln = lengths.data_ptr<int32_t>();
  for (int64_t j = 0; j < b; ++j) id[j] = pk[2 * j], ++ps[j], ++ln[j];
}

bool sampling_on_device(const SampleOptions& opt) {
  return (opt.top_k >= 1 && opt.top_k <= kDeviceTopK) || (opt.top_k == 0 && opt.top_p >= 1.0);
}

Tensor sample_checked(const Tensor& logits, const SampleOptions& opt, const std::vector<uint64_t>& seeds,
                      const std::vector<int64_t>& positions) {
  constexpr const char* op = "sample";
  check_float(logits, op, "logits");
  check_dims(logits, 2, op, "logits");
  const int64_t b = logits.size(0), v = logits.size(1);
  KCPP_CHECK(v > 0, "op {}: logits have no columns (an empty vocabulary)", op);
  KCPP_CHECK(std::isfinite(opt.temperature) && opt.temperature > 0, "op {}: temperature is {}; it must be a positive number",
             op, opt.temperature);
  KCPP_CHECK(opt.top_k >= 0, "op {}: top_k is {}; it must be 0 (every token) or positive", op, opt.top_k);
  KCPP_CHECK(opt.top_p > 0 && opt.top_p <= 1, "op {}: top_p is {}; it must be above 0 and at most 1", op, opt.top_p);
  KCPP_CHECK(static_cast<int64_t>(seeds.size()) == b && static_cast<int64_t>(positions.size()) == b,
             "op {}: {} seeds and {} positions for {} rows of logits", op, seeds.size(), positions.size(), b);
  if (logits.device().is_cuda() && sampling_on_device(opt) && b > 0) {
#if KCPP_WITH_CUDA
    const Tensor out = Tensor::empty({b, 2}, DType::i64, logits.device());
    cuda::sample_checked(out, logits.contiguous(), opt, seeds, positions);
    return out;
#endif
  }
  const std::vector<double> x = logits.contiguous().to_f64_vector();
  std::vector<int64_t> picked(static_cast<size_t>(2 * b));
  for (int64_t i = 0; i < b; ++i)
    sample_row(x.data() + i * v, v, opt, seeds[static_cast<size_t>(i)], positions[static_cast<size_t>(i)], picked.data() + 2 * i);
  return Tensor::from_i64(picked, {b, 2}, DType::i64, Device::cpu());
}

}  // namespace kcpp::ops
