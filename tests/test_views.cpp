// Views of views: random chains of narrow, select, transpose, permute, unsqueeze, squeeze, expand and
// reshape checked against a reference that does the index math by hand.  Checked on every chain: the
// elements in row-major order (through contiguous(), clone() and to(dtype)), view() against the
// reference (a refusal only where no strides exist), is_contiguous() against where the elements lie,
// elementwise ops on strided and broadcast operands, and copy_ / fill_ into a strided view of a base
// tensor (the view's elements change, nothing else does).
#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "ops/ops.h"
#include "test_util.h"

namespace kcpp {
namespace {

using test::test_generator;

constexpr int64_t kMaxRank = 6;

int64_t wrap(int64_t d, int64_t n) { return d < 0 ? d + n : d; }

// The reference: element [i0, i1, ...] is base[table[offset + i0 * strides[0] + i1 * strides[1] ...]].
// Views edit (shape, strides, offset); a reshape gathers the base positions in row-major order into a
// new table and indexes that with row-major strides of the new shape, so it never depends on which
// strides a view of the old layout could take.
struct RefView {
  std::vector<int64_t> table;  // positions in the base tensor
  Shape shape, strides;
  int64_t offset = 0;

  static RefView of_base(const Shape& shape) {
    RefView r;
    r.table.resize(static_cast<size_t>(shape_numel(shape)));
    std::iota(r.table.begin(), r.table.end(), int64_t{0});
    r.reindex(shape);
    return r;
  }

  int64_t numel() const { return shape_numel(shape); }

  // Base positions of the elements in row-major order.
  std::vector<int64_t> positions() const {
    std::vector<int64_t> out;
    const int64_t n = numel();
    out.reserve(static_cast<size_t>(n));
    std::vector<int64_t> idx(shape.size(), 0);
    for (int64_t i = 0; i < n; ++i) {
      int64_t at = offset;
      for (size_t d = 0; d < shape.size(); ++d) at += idx[d] * strides[d];
      out.push_back(table[static_cast<size_t>(at)]);
      for (size_t d = shape.size(); d-- > 0;) {
        if (++idx[d] < shape[d]) break;
        idx[d] = 0;
      }
    }
    return out;
  }

  // The table indexed row-major as `new_shape` (same number of elements).
  void reindex(const Shape& new_shape) {
    shape = new_shape;
    strides.assign(shape.size(), 0);
    int64_t s = 1;
    for (size_t d = shape.size(); d-- > 0;) {
      strides[d] = s;
      s *= shape[d];
    }
    offset = 0;
  }
};

enum class Kind { Narrow, Select, Transpose, Permute, Unsqueeze, Squeeze, Expand, Reshape };

struct ViewOp {
  Kind kind = Kind::Narrow;
  int64_t dim = 0, a = 0, b = 0;  // narrow (dim, start a, length b), select (dim, index a), transpose (dim, a)
  Shape dims;                     // permute's order; expand's and reshape's shape (may hold -1)

  static ViewOp make(Kind kind, int64_t dim = 0, int64_t a = 0, int64_t b = 0, Shape dims = {}) {
    ViewOp op;
    op.kind = kind, op.dim = dim, op.a = a, op.b = b, op.dims = std::move(dims);
    return op;
  }

  std::string str() const {
    switch (kind) {
      case Kind::Narrow: return fmt::format("narrow({}, {}, {})", dim, a, b);
      case Kind::Select: return fmt::format("select({}, {})", dim, a);
      case Kind::Transpose: return fmt::format("transpose({}, {})", dim, a);
      case Kind::Permute: return fmt::format("permute({})", shape_str(dims));
      case Kind::Unsqueeze: return fmt::format("unsqueeze({})", dim);
      case Kind::Squeeze: return fmt::format("squeeze({})", dim);
      case Kind::Expand: return fmt::format("expand({})", shape_str(dims));
      case Kind::Reshape: return fmt::format("reshape({})", shape_str(dims));
    }
    return "";
  }
};

// `s` with a -1 replaced by what the element count implies.
Shape resolve(Shape s, int64_t numel) {
  int64_t known = 1;
  for (int64_t v : s)
    if (v != -1) known *= v;
  for (int64_t& v : s)
    if (v == -1) v = numel / known;
  return s;
}

// The op on a kcpp tensor; `view` takes view() for a reshape.
Tensor apply(const Tensor& t, const ViewOp& op, bool view = false) {
  switch (op.kind) {
    case Kind::Narrow: return t.narrow(op.dim, op.a, op.b);
    case Kind::Select: return t.select(op.dim, op.a);
    case Kind::Transpose: return t.transpose(op.dim, op.a);
    case Kind::Permute: return t.permute(op.dims);
    case Kind::Unsqueeze: return t.unsqueeze(op.dim);
    case Kind::Squeeze: return t.squeeze(op.dim);
    case Kind::Expand: return t.expand(op.dims);
    case Kind::Reshape: return view ? t.view(op.dims) : t.reshape(op.dims);
  }
  return t;
}

// The op on the reference, by index math.
RefView apply(RefView r, const ViewOp& op) {
  const int64_t n = static_cast<int64_t>(r.shape.size());
  switch (op.kind) {
    case Kind::Narrow: {
      const int64_t d = wrap(op.dim, n);
      r.offset += op.a * r.strides[d];
      r.shape[d] = op.b;
      break;
    }
    case Kind::Select: {
      const int64_t d = wrap(op.dim, n);
      r.offset += wrap(op.a, r.shape[d]) * r.strides[d];
      r.shape.erase(r.shape.begin() + d);
      r.strides.erase(r.strides.begin() + d);
      break;
    }
    case Kind::Transpose: {
      const int64_t d0 = wrap(op.dim, n), d1 = wrap(op.a, n);
      std::swap(r.shape[d0], r.shape[d1]);
      std::swap(r.strides[d0], r.strides[d1]);
      break;
    }
    case Kind::Permute: {
      Shape s, st;
      for (int64_t d : op.dims) {
        s.push_back(r.shape[wrap(d, n)]);
        st.push_back(r.strides[wrap(d, n)]);
      }
      r.shape = s;
      r.strides = st;
      break;
    }
    case Kind::Unsqueeze: {
      const int64_t d = wrap(op.dim, n + 1);
      r.shape.insert(r.shape.begin() + d, 1);
      r.strides.insert(r.strides.begin() + d, 0);  // never stepped
      break;
    }
    case Kind::Squeeze: {
      const int64_t d = wrap(op.dim, n);
      r.shape.erase(r.shape.begin() + d);
      r.strides.erase(r.strides.begin() + d);
      break;
    }
    case Kind::Expand: {
      const size_t lead = op.dims.size() - r.shape.size();
      Shape s(op.dims.size()), st(op.dims.size(), 0);
      for (size_t i = 0; i < s.size(); ++i) {
        s[i] = op.dims[i];
        if (i < lead) continue;
        if (s[i] == -1) s[i] = r.shape[i - lead];
        st[i] = s[i] == r.shape[i - lead] ? r.strides[i - lead] : 0;
      }
      r.shape = s;
      r.strides = st;
      break;
    }
    case Kind::Reshape: {
      r.table = r.positions();
      r.reindex(resolve(op.dims, r.numel()));
      break;
    }
  }
  return r;
}

int64_t pick(std::mt19937_64& rng, int64_t lo, int64_t hi) {  // uniform in [lo, hi]
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}
bool chance(std::mt19937_64& rng, int percent) { return pick(rng, 0, 99) < percent; }
// A dimension index in [0, n), written negatively half the time.
int64_t pick_dim(std::mt19937_64& rng, int64_t n) {
  const int64_t d = pick(rng, 0, n - 1);
  return chance(rng, 50) ? d - n : d;
}

Shape random_shape(std::mt19937_64& rng) {
  Shape s(static_cast<size_t>(pick(rng, 1, 5)));
  for (int64_t& v : s) v = chance(rng, 35) ? 1 : pick(rng, 2, 5);
  return s;
}

// A shape of the same element count: a few merges of neighbours, splits into two factors, size-1
// dims added or removed; or a fresh random factorization.  Sometimes one entry is -1.
Shape random_reshape(const Shape& from, std::mt19937_64& rng) {
  const int64_t numel = shape_numel(from);
  Shape s;
  if (numel > 1 && chance(rng, 25)) {
    for (int64_t left = numel; left > 1;) {
      std::vector<int64_t> divisors;
      for (int64_t f = 2; f <= left; ++f)
        if (left % f == 0) divisors.push_back(f);
      const int64_t f = divisors[static_cast<size_t>(pick(rng, 0, static_cast<int64_t>(divisors.size()) - 1))];
      s.push_back(f);
      left /= f;
    }
    std::shuffle(s.begin(), s.end(), rng);
  } else {
    s = from;
    for (int64_t steps = pick(rng, 1, 3); steps > 0; --steps) {
      const int64_t r = static_cast<int64_t>(s.size());
      switch (pick(rng, 0, 3)) {
        case 0:  // merge two neighbours
          if (r >= 2) {
            const int64_t i = pick(rng, 0, r - 2);
            s[i] *= s[i + 1];
            s.erase(s.begin() + i + 1);
          }
          break;
        case 1: {  // split one dim into two factors
          std::vector<std::pair<int64_t, int64_t>> splits;
          for (int64_t i = 0; i < r; ++i)
            for (int64_t f = 2; f < s[i]; ++f)
              if (s[i] % f == 0) splits.emplace_back(i, f);
          if (!splits.empty()) {
            const auto [i, f] = splits[static_cast<size_t>(pick(rng, 0, static_cast<int64_t>(splits.size()) - 1))];
            s[i] /= f;
            s.insert(s.begin() + i, f);
          }
          break;
        }
        case 2:  // add a size-1 dim
          s.insert(s.begin() + pick(rng, 0, r), 1);
          break;
        case 3: {  // remove a size-1 dim
          const auto one = std::find(s.begin(), s.end(), 1);
          if (one != s.end()) s.erase(one);
          break;
        }
      }
    }
  }
  while (static_cast<int64_t>(s.size()) > kMaxRank) {  // merge the front to stay within the rank limit
    s[1] *= s[0];
    s.erase(s.begin());
  }
  while (chance(rng, 30) && static_cast<int64_t>(s.size()) < kMaxRank) s.insert(s.begin() + pick(rng, 0, s.size()), 1);
  if (numel > 0 && !s.empty() && chance(rng, 20)) s[static_cast<size_t>(pick(rng, 0, s.size() - 1))] = -1;
  return s;
}

// A random view op that is valid for `s`.  Without `expand`, the op never makes a view whose
// elements overlap (so it can be copied into).
ViewOp random_op(const Shape& s, std::mt19937_64& rng, bool expand) {
  const int64_t r = static_cast<int64_t>(s.size());
  for (;;) {
    ViewOp op = ViewOp::make(static_cast<Kind>(pick(rng, 0, 7)));
    switch (op.kind) {
      case Kind::Narrow: {
        if (r == 0) continue;
        op.dim = pick_dim(rng, r);
        const int64_t size = s[wrap(op.dim, r)];
        op.a = pick(rng, 0, size);
        op.b = op.a < size && chance(rng, 95) ? pick(rng, 1, size - op.a) : 0;
        return op;
      }
      case Kind::Select: {
        if (r == 0) continue;
        op.dim = pick_dim(rng, r);
        const int64_t size = s[wrap(op.dim, r)];
        if (size == 0) continue;
        op.a = pick(rng, 0, size - 1);
        if (chance(rng, 30)) op.a -= size;
        return op;
      }
      case Kind::Transpose:
        if (r == 0) continue;
        op.dim = pick_dim(rng, r);
        op.a = pick_dim(rng, r);
        return op;
      case Kind::Permute:
        op.dims.resize(static_cast<size_t>(r));
        std::iota(op.dims.begin(), op.dims.end(), int64_t{0});
        std::shuffle(op.dims.begin(), op.dims.end(), rng);
        for (int64_t& d : op.dims)
          if (chance(rng, 20)) d -= r;
        return op;
      case Kind::Unsqueeze:
        if (r >= kMaxRank) continue;
        op.dim = pick(rng, 0, r);
        if (chance(rng, 50)) op.dim -= r + 1;
        return op;
      case Kind::Squeeze: {
        std::vector<int64_t> ones;
        for (int64_t d = 0; d < r; ++d)
          if (s[d] == 1) ones.push_back(d);
        if (ones.empty()) continue;
        op.dim = ones[static_cast<size_t>(pick(rng, 0, static_cast<int64_t>(ones.size()) - 1))];
        return op;
      }
      case Kind::Expand: {
        if (!expand) continue;
        op.dims = s;
        for (int64_t& v : op.dims) {
          if (v == 1 && chance(rng, 60)) v = pick(rng, 2, 3);
          else if (chance(rng, 30)) v = -1;
        }
        if (r < kMaxRank && chance(rng, 25)) op.dims.insert(op.dims.begin(), pick(rng, 1, 3));
        return op;
      }
      case Kind::Reshape:
        op.dims = random_reshape(s, rng);
        return op;
    }
  }
}

// A kcpp tensor made by a chain of views of a base tensor, the same chain on the reference, and
// the chain written out for failure messages.
struct Chain {
  Tensor root, t;             // the base tensor and the view of it
  RefView ref;
  std::vector<double> base;  // the base tensor's values in row-major order
  std::string trace;

  static Chain of_base(const Shape& shape, DType dtype, Device dev, double first, double step) {
    Chain c;
    c.base.resize(static_cast<size_t>(shape_numel(shape)));
    for (size_t i = 0; i < c.base.size(); ++i) c.base[i] = first + step * static_cast<double>(i);
    c.root = c.t = Tensor::from_f64(c.base, shape, dtype, dev);
    c.ref = RefView::of_base(shape);
    c.trace = "base " + shape_str(shape);
    return c;
  }

  void apply_op(const ViewOp& op, bool view = false) {
    trace += " -> " + (view && op.kind == Kind::Reshape ? "view(" + shape_str(op.dims) + ")" : op.str());
    t = apply(t, op, view);
    ref = apply(ref, op);
    if (!t.shares_storage(root)) {  // a reshape that copied: the copy is a new contiguous base
      base = values();
      root = t;
      ref = RefView::of_base(t.shape());
      trace += " (copied)";
    }
  }

  // The reference's elements in row-major order.
  std::vector<double> values() const {
    std::vector<double> v;
    for (int64_t p : ref.positions()) v.push_back(base[static_cast<size_t>(p)]);
    return v;
  }
};

// A chain over a new base whose result has shape `s`, with some dims 1 when `broadcast`: the dims
// in a random order and widened, narrowed back, an extra dim selected away, permuted into place, and
// sometimes reshaped to another shape and back.
Chain view_of_shape(Shape s, bool broadcast, DType dtype, Device dev, double first, std::mt19937_64& rng) {
  if (broadcast)
    for (int64_t& v : s)
      if (chance(rng, 25)) v = 1;
  const int64_t r = static_cast<int64_t>(s.size());
  std::vector<int64_t> order(static_cast<size_t>(r));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::shuffle(order.begin(), order.end(), rng);
  Shape base(static_cast<size_t>(r)), start(static_cast<size_t>(r));
  for (int64_t j = 0; j < r; ++j) {
    start[j] = pick(rng, 0, 2);
    base[j] = s[order[j]] + start[j] + pick(rng, 0, 1);
  }
  const bool extra = chance(rng, 50);
  const int64_t extra_at = pick(rng, 0, r), extra_size = pick(rng, 1, 3);
  if (extra) base.insert(base.begin() + extra_at, extra_size);
  Chain c = Chain::of_base(base, dtype, dev, first, 1.0);
  if (extra) c.apply_op(ViewOp::make(Kind::Select, extra_at, pick(rng, 0, extra_size - 1)));
  for (int64_t j = 0; j < r; ++j) c.apply_op(ViewOp::make(Kind::Narrow, j, start[j], s[order[j]]));
  ViewOp permute = ViewOp::make(Kind::Permute);
  permute.dims.resize(static_cast<size_t>(r));
  for (int64_t j = 0; j < r; ++j) permute.dims[order[j]] = j;
  c.apply_op(permute);
  if (chance(rng, 30)) {
    c.apply_op(ViewOp::make(Kind::Reshape, 0, 0, 0, random_reshape(s, rng)));
    c.apply_op(ViewOp::make(Kind::Reshape, 0, 0, 0, s));
  }
  return c;
}

// Whether some strides over `shape` give `positions` (base positions in row-major order), each
// stride read off as the step from element 0 to the next element along that dim: then view() must
// find them.
bool has_view_strides(const Shape& shape, const std::vector<int64_t>& positions) {
  if (positions.empty()) return true;
  const int64_t r = static_cast<int64_t>(shape.size());
  Shape st(static_cast<size_t>(r), 0), step(static_cast<size_t>(r), 1);  // step: row-major strides
  for (int64_t d = r - 1; d > 0; --d) step[d - 1] = step[d] * shape[d];
  for (int64_t d = 0; d < r; ++d)
    if (shape[d] > 1) st[d] = positions[static_cast<size_t>(step[d])] - positions[0];
  std::vector<int64_t> idx(static_cast<size_t>(r), 0);
  for (size_t i = 0; i < positions.size(); ++i) {
    int64_t at = positions[0];
    for (int64_t d = 0; d < r; ++d) at += idx[d] * st[d];
    if (at != positions[i]) return false;
    for (int64_t d = r; d-- > 0;) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
  return true;
}

bool laid_out_contiguously(const std::vector<int64_t>& positions) {
  for (size_t i = 0; i < positions.size(); ++i)
    if (positions[i] != positions[0] + static_cast<int64_t>(i)) return false;
  return true;
}

std::vector<double> negated(std::vector<double> v) {
  for (double& e : v) e = -e;
  return v;
}

// view(shape) of the chain's result either refuses (and then no strides give its elements) or shares
// the storage and holds the reference's elements; reshape(shape) always holds them.
void check_view(const Chain& c, const Shape& shape, const std::string& what) {
  const RefView viewed = apply(c.ref, ViewOp::make(Kind::Reshape, 0, 0, 0, shape));
  const std::vector<double> want = c.values();
  const std::string call = fmt::format("({}) of {}", shape_str(shape), what);
  EXPECT_EQ(c.t.reshape(shape).contiguous().to_f64_vector(), want) << "reshape" << call;
  Tensor v;
  const std::string refused = test::error_of([&] { v = c.t.view(shape); });
  if (refused.empty()) {
    EXPECT_TRUE(v.shares_storage(c.t)) << "view" << call;
    EXPECT_EQ(v.shape(), viewed.shape) << "view" << call;
    EXPECT_EQ(v.contiguous().to_f64_vector(), want) << "view" << call;
  } else {
    EXPECT_FALSE(has_view_strides(viewed.shape, viewed.positions())) << "view" << call << " refused: " << refused;
  }
}

// The chain's elements broadcast to `shape`, on the reference.
std::vector<double> broadcast_values(Chain c, const Shape& shape) {
  c.ref = apply(c.ref, ViewOp::make(Kind::Expand, 0, 0, 0, shape));
  return c.values();
}

// One random case; `at` says which chain is being checked, for errors thrown.
void check_case(Device dev, DType dtype, std::mt19937_64& rng, const std::string& tag, std::string& at) {
  Chain x = Chain::of_base(random_shape(rng), dtype, dev, 1.0, 1.0);
  for (int64_t n = pick(rng, 1, 5); n > 0; --n) {
    const ViewOp op = random_op(x.t.shape(), rng, true);
    at = x.trace + " -> " + op.str() + tag;
    if (op.kind == Kind::Reshape) check_view(x, op.dims, x.trace + tag);
    x.apply_op(op);
    ASSERT_EQ(x.t.shape(), x.ref.shape) << x.trace << tag;
  }
  const std::string what = x.trace + " = " + x.t.str() + tag;
  at = what;
  const std::vector<double> want = x.values();
  const std::vector<int64_t> positions = x.ref.positions();

  // The elements, through each kind of copy.
  EXPECT_EQ(x.t.contiguous().to_f64_vector(), want) << what;
  EXPECT_EQ(x.t.clone().to_f64_vector(), want) << what;
  EXPECT_TRUE(x.t.clone().is_contiguous()) << what;
  EXPECT_EQ(x.t.to(dev.is_cpu() ? DType::f32 : DType::i32).to_f64_vector(), want) << what;
  if (!positions.empty()) {
    EXPECT_EQ(x.t.is_contiguous(), laid_out_contiguously(positions)) << what;
  }
  check_view(x, random_reshape(x.t.shape(), rng), what);

  // Elementwise ops on this operand and another chain of the same shape (or one that broadcasts).
  const Chain y = view_of_shape(x.t.shape(), chance(rng, 30), dtype, dev, 1.0, rng);
  const std::string pair = what + "; y: " + y.trace + " = " + y.t.str();
  at = pair;
  const std::vector<double> yv = broadcast_values(y, x.t.shape());
  std::vector<double> sum(want.size()), prod(want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    sum[i] = want[i] + yv[i];
    // One rounding to the computing type (f32 products of these integers can exceed 2^24).
    prod[i] = dtype == DType::f64 ? want[i] * yv[i] : static_cast<float>(want[i]) * static_cast<float>(yv[i]);
  }
  EXPECT_EQ(ops::add(x.t, y.t).to_f64_vector(), sum) << pair;
  EXPECT_EQ(ops::mul(y.t, x.t).to_f64_vector(), prod) << pair;
  EXPECT_EQ(ops::neg(x.t).to_f64_vector(), negated(want)) << what;

  // copy_ and fill_ into a view (no expand, no copying reshape) of a base: the view's elements
  // change, no other element of the base does.
  Chain dst = Chain::of_base(random_shape(rng), dtype, dev, -1.0, -1.0);
  for (int64_t n = pick(rng, 1, 5); n > 0; --n) {
    const ViewOp op = random_op(dst.t.shape(), rng, false);
    at = dst.trace + " -> " + op.str() + tag;
    if (op.kind == Kind::Reshape && !test::error_of([&] { (void)dst.t.view(op.dims); }).empty()) continue;
    dst.apply_op(op, true);
  }
  const Chain src = view_of_shape(dst.t.shape(), chance(rng, 30), dtype, dev, 1.0, rng);
  Tensor from = src.t;
  if (chance(rng, 30)) from = dev.is_cpu() ? from.to(DType::f32) : from.to(Device::cpu());
  const std::string into = dst.trace + " = " + dst.t.str() + "; src: " + src.trace + " = " + from.str() + tag;
  at = into;
  ASSERT_TRUE(dst.t.shares_storage(dst.root)) << into;
  const std::vector<int64_t> written = dst.ref.positions();
  const std::vector<double> srcv = broadcast_values(src, dst.t.shape());
  std::vector<double> expect = dst.base;
  for (size_t i = 0; i < written.size(); ++i) expect[static_cast<size_t>(written[i])] = srcv[i];
  dst.t.copy_(from);
  EXPECT_EQ(dst.root.to_f64_vector(), expect) << "copy_ into " << into;
  for (int64_t p : written) expect[static_cast<size_t>(p)] = 0.5;
  dst.t.fill_(0.5);
  EXPECT_EQ(dst.root.to_f64_vector(), expect) << "fill_ of " << into;
}

class Views : public ::testing::TestWithParam<Device> {};

// Thousands of random chains.  A failure writes the chain out; KCPP_SEED repeats the run.
TEST_P(Views, RandomChainsMatchTheReference) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const DType dtype = dev.is_cpu() ? DType::f64 : DType::f32;  // the values are integers below 2^24
  Generator gen = test_generator();
  const int cases = dev.is_cpu() ? 3000 : 1000;
  for (int k = 0; k < cases && !HasFailure(); ++k) {
    std::string at;
    try {
      check_case(dev, dtype, gen.engine(), fmt::format(" (seed {}, case {})", test::run_seed(), k), at);
    } catch (const Error& e) {
      ADD_FAILURE() << "kcpp::Error '" << e.what() << "' at " << at;
    }
  }
}

// The cases the property test found, minimized.
TEST_P(Views, EmptyAndFullyBroadcastLayouts) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const DType dtype = dev.is_cpu() ? DType::f64 : DType::f32;
  // A tensor without elements is contiguous whatever its strides: a fresh [3, 0, 5] (strides [5, 5, 1])
  // and a transposed one narrowed to nothing.
  EXPECT_TRUE(Tensor::empty({3, 0, 5}, dtype, dev).is_contiguous());
  EXPECT_TRUE(Tensor::empty({2, 3}, dtype, dev).transpose(0, 1).narrow(1, 0, 0).is_contiguous());
  // Operands broadcast in every dim merge into one dim of stride 0: each element reads the one value.
  const Tensor three = Tensor::full({1, 1}, 3.0, dtype, dev), two = Tensor::full({1}, 2.0, dtype, dev);
  EXPECT_EQ(ops::neg(three.expand({4, 8})).to_f64_vector(), std::vector<double>(32, -3.0));
  EXPECT_EQ(ops::add(three.expand({4, 8}), three.expand({4, 8})).to_f64_vector(), std::vector<double>(32, 6.0));
  EXPECT_EQ(ops::mul(two.expand({32}), three.expand({1, 32})).to_f64_vector(), std::vector<double>(32, 6.0));
  // -1 keeps an existing dim's size only; no size is negative.
  EXPECT_ERROR(two.expand({-1, 4}), "new leading dim");
  EXPECT_ERROR(two.expand({-3}), "cannot be expanded");
  EXPECT_EQ(three.expand({2, -1, 4}).shape(), (Shape{2, 1, 4}));
}

INSTANTIATE_TEST_SUITE_P(Devices, Views, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cpu() ? std::string("cpu") : std::string("cuda"); });

}  // namespace
}  // namespace kcpp
