#include <limits>

#include "core/profile.h"
#include "ops/check.h"
#include "ops/ops.h"

namespace kcpp::ops {

Tensor cat(const std::vector<Tensor>& xs, int64_t dim) {
  KCPP_CHECK(!xs.empty(), "op cat: no tensors given");
  const profile::Region region("cat", xs[0].device());
  const Tensor& first = xs[0];
  check_defined(first, "cat", "xs[0]");
  KCPP_CHECK(dim >= -first.dim() && dim < first.dim(), "op cat: dim {} out of range for {} dims", dim, first.dim());
  if (dim < 0) dim += first.dim();
  Shape shape = first.shape();
  shape[dim] = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const std::string arg = fmt::format("xs[{}]", i);
    check_same(xs[i], first, "cat", arg, "xs[0]");
    KCPP_CHECK(xs[i].dim() == first.dim(), "op cat: argument '{}' has {} dims, xs[0] has {}", arg, xs[i].dim(),
               first.dim());
    for (int64_t d = 0; d < first.dim(); ++d)
      KCPP_CHECK(d == dim || xs[i].size(d) == first.size(d), "op cat: argument '{}' has shape {}, xs[0] has {}", arg,
                 shape_str(xs[i].shape()), shape_str(first.shape()));
    shape[dim] += xs[i].size(dim);
  }
  Tensor out = Tensor::empty(shape, first.dtype(), first.device());
  int64_t at = 0;
  for (const Tensor& x : xs) {
    out.narrow(dim, at, x.size(dim)).copy_(x);
    at += x.size(dim);
  }
  return out;
}

Tensor attention_mask(int64_t q_len, int64_t kv_len, bool causal, int64_t window, DType dtype, Device device, int64_t chunk) {
  KCPP_CHECK(q_len >= 0 && kv_len >= q_len, "op attention_mask: need 0 <= q_len <= kv_len, got {} and {}", q_len,
             kv_len);
  KCPP_CHECK(window >= 0, "op attention_mask: window {} < 0", window);
  KCPP_CHECK(chunk >= 0, "op attention_mask: chunk {} < 0", chunk);
  std::vector<double> m(static_cast<size_t>(q_len * kv_len));
  const double ninf = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < q_len; ++i) {
    const int64_t pos = i + kv_len - q_len;
    for (int64_t j = 0; j < kv_len; ++j) {
      bool visible = !causal || j <= pos;
      if (window > 0) visible = visible && pos - j < window;
      if (chunk > 0) visible = visible && j / chunk == pos / chunk;
      m[i * kv_len + j] = visible ? 0.0 : ninf;
    }
  }
  return Tensor::from_f64(m, {q_len, kv_len}, dtype, device);
}

}  // namespace kcpp::ops
