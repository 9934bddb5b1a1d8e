#include "core/tensor.h"

#include <dlpack/dlpack.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "core/allocator.h"
#include "core/copy.h"
#include "core/cuda_runtime.h"
#include "core/profile.h"
#include "core/random.h"

namespace kcpp {

// ---- shapes ----------------------------------------------------------------------------------

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape st(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    st[i] = s;
    s *= std::max<int64_t>(shape[i], 1);
  }
  return st;
}

std::string shape_str(const Shape& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

Shape broadcast_shapes(const Shape& a, const Shape& b, std::string_view what) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t x = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t y = i < n - b.size() ? 1 : b[i - (n - b.size())];
    KCPP_CHECK(x == y || x == 1 || y == 1, "{}: shapes {} and {} do not broadcast", what, shape_str(a), shape_str(b));
    out[i] = x == 1 ? y : x;
  }
  return out;
}

// ---- storage ---------------------------------------------------------------------------------

Storage::Storage(size_t n, Device d) : data(allocator_for(d).allocate(n)), nbytes(n), device(d) {}

Storage::~Storage() {
  if (release) release();
  else allocator_for(device).deallocate(data);
}

void Storage::evict() {
  if (evicted) return;
  if (release) {
    release();
    release = {};  // restored memory comes from the allocator
  } else {
    allocator_for(device).deallocate(data);
  }
  data = nullptr;
  evicted = true;
}

void Storage::restore() {
  if (!evicted) return;
  data = allocator_for(device).allocate(nbytes);
  evicted = false;
}

namespace {
[[noreturn]] void throw_evicted(const Storage& s) {
  KCPP_FAIL("use of a tensor whose memory ({} bytes on {}) was released by ZeRO-3: a sharded parameter is whole only "
            "between its layer's gather and release (DataParallel at zero_stage 3; gather_parameters() makes every "
            "parameter whole)", s.nbytes, s.device.str());
}
}  // namespace

// ---- factories -------------------------------------------------------------------------------

Tensor Tensor::empty(Shape shape, DType dtype, Device device) {
  for (int64_t s : shape) KCPP_CHECK(s >= 0, "Tensor::empty: negative size in shape {}", shape_str(shape));
  Tensor t;
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype), device);
  t.strides_ = contiguous_strides(shape);
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype, Device device) { return full(std::move(shape), 0.0, dtype, device); }

Tensor Tensor::full(Shape shape, double value, DType dtype, Device device) {
  Tensor t = empty(std::move(shape), dtype, device);
  t.fill_(value);
  return t;
}

Tensor Tensor::from_f64(std::span<const double> values, Shape shape, DType dtype, Device device) {
  KCPP_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape),
             "Tensor::from_f64: {} values for shape {}", values.size(), shape_str(shape));
  Tensor host = from_blob(const_cast<double*>(values.data()), std::move(shape), DType::f64, Device::cpu());
  return host.to(dtype).to(device).clone_if_borrowed();
}

Tensor Tensor::from_i64(std::span<const int64_t> values, Shape shape, DType dtype, Device device) {
  KCPP_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape),
             "Tensor::from_i64: {} values for shape {}", values.size(), shape_str(shape));
  Tensor host = from_blob(const_cast<int64_t*>(values.data()), std::move(shape), DType::i64, Device::cpu());
  return host.to(dtype).to(device).clone_if_borrowed();
}

Tensor Tensor::randn(Shape shape, DType dtype, Device device, Generator& gen, double mean, double std) {
  std::vector<double> v(static_cast<size_t>(shape_numel(shape)));
  gen.fill_normal(v, mean, std);
  return from_f64(v, std::move(shape), dtype, device);
}

Tensor Tensor::uniform(Shape shape, DType dtype, Device device, Generator& gen, double lo, double hi) {
  std::vector<double> v(static_cast<size_t>(shape_numel(shape)));
  gen.fill_uniform(v, lo, hi);
  return from_f64(v, std::move(shape), dtype, device);
}

Tensor Tensor::randint(Shape shape, int64_t lo, int64_t hi, DType dtype, Device device, Generator& gen) {
  KCPP_CHECK(lo < hi, "Tensor::randint: empty range [{}, {})", lo, hi);
  std::vector<int64_t> v(static_cast<size_t>(shape_numel(shape)));
  gen.fill_int(v, lo, hi);
  return from_i64(v, std::move(shape), dtype, device);
}

Tensor Tensor::from_blob(void* data, Shape shape, DType dtype, Device device, Shape strides,
                         std::function<void()> release) {
  if (strides.empty()) strides = contiguous_strides(shape);
  KCPP_CHECK(strides.size() == shape.size(), "Tensor::from_blob: {} strides for {} dims", strides.size(), shape.size());
  int64_t span = 1;  // elements reachable from data, for the storage's byte count
  for (size_t i = 0; i < shape.size(); ++i) {
    KCPP_CHECK(shape[i] >= 0 && strides[i] >= 0, "Tensor::from_blob: negative size or stride");
    if (shape[i] == 0) span = 0;
    if (span) span += (shape[i] - 1) * strides[i];
  }
  Tensor t;
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(data, static_cast<size_t>(span) * dtype_size(dtype), device,
                                         release ? std::move(release) : std::function<void()>([] {}));
  t.shape_ = std::move(shape);
  t.strides_ = std::move(strides);
  return t;
}

// ---- properties ------------------------------------------------------------------------------

Device Tensor::device() const {
  KCPP_CHECK(defined(), "use of an undefined tensor");
  return storage_->device;
}

int64_t Tensor::numel() const { return shape_numel(shape_); }

bool Tensor::is_contiguous() const {
  // Dims of size 1 are never stepped, so their strides do not matter; a tensor without elements is
  // contiguous whatever its strides (contiguous_strides() gives a size-0 dim's outer dims the
  // strides of a size-1 dim, which the product below would not match).
  if (numel() == 0) return true;
  int64_t expected = 1;
  for (size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] == 1) continue;
    if (strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

void* Tensor::data() const {
  KCPP_CHECK(defined(), "use of an undefined tensor");
  if (storage_->evicted) [[unlikely]] throw_evicted(*storage_);
  return static_cast<char*>(storage_->data) + offset_ * static_cast<int64_t>(element_size());
}

int64_t Tensor::wrap_dim(int64_t d) const {
  const int64_t n = dim();
  KCPP_CHECK(d >= -n && d < n, "dimension {} out of range for a tensor of {} dims", d, n);
  return d < 0 ? d + n : d;
}

// ---- views -----------------------------------------------------------------------------------

Tensor Tensor::with(Shape shape, Shape strides, int64_t offset) const {
  Tensor t;
  t.storage_ = storage_;
  t.dtype_ = dtype_;
  t.shape_ = std::move(shape);
  t.strides_ = std::move(strides);
  t.offset_ = offset;
  return t;
}

namespace {
Shape infer_shape(Shape shape, int64_t numel, const Shape& from) {
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      KCPP_CHECK(infer < 0, "view: more than one -1 in {}", shape_str(shape));
      infer = static_cast<int64_t>(i);
    } else {
      KCPP_CHECK(shape[i] >= 0, "view: negative size in {}", shape_str(shape));
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    KCPP_CHECK(known > 0 && numel % known == 0, "view: cannot infer -1 in {} from {} elements", shape_str(shape), numel);
    shape[infer] = numel / known;
  }
  KCPP_CHECK(shape_numel(shape) == numel, "view: shape {} does not hold the {} elements of {}", shape_str(shape),
             numel, shape_str(from));
  return shape;
}

// Strides for viewing (old shape, old strides) as new shape without copying, if possible
// (the algorithm PyTorch documents for view: group dims into contiguous chunks).
bool view_strides(const Shape& os, const Shape& ost, const Shape& ns, Shape& nst) {
  nst.assign(ns.size(), 0);
  if (shape_numel(os) == 0) {
    nst = contiguous_strides(ns);
    return true;
  }
  int64_t vi = static_cast<int64_t>(ns.size()) - 1;
  int64_t chunk = 1;
  int64_t base_stride = 0;
  for (int64_t ti = static_cast<int64_t>(os.size()) - 1; ti >= 0; --ti) {
    chunk *= os[ti];
    if (chunk == os[ti]) base_stride = ost[ti];  // first dim of a new chunk
    // The chunk goes on through dim ti - 1 when that dim steps over the whole chunk so far; a size-1
    // dim's stride says nothing (it is never stepped), so it never ends a chunk, and the test uses the
    // chunk's base stride and size, not dim ti's (which may be such a size-1 dim).
    const bool chunk_end = ti == 0 || (os[ti - 1] != 1 && ost[ti - 1] != chunk * base_stride);
    if (chunk_end) {
      int64_t view_chunk = 1, stride = base_stride;
      while (vi >= 0 && (view_chunk < chunk || ns[vi] == 1)) {
        nst[vi] = stride;
        stride *= ns[vi];
        view_chunk *= ns[vi];
        --vi;
      }
      if (view_chunk != chunk) return false;
      chunk = 1;
    }
  }
  while (vi >= 0) nst[vi--] = 1;  // trailing size-1 dims
  return true;
}
}  // namespace

Tensor Tensor::view(Shape shape) const {
  shape = infer_shape(std::move(shape), numel(), shape_);
  Shape st;
  KCPP_CHECK(view_strides(shape_, strides_, shape, st),
             "view: {} with strides {} cannot be viewed as {} without a copy (use reshape)", shape_str(shape_),
             shape_str(strides_), shape_str(shape));
  return with(std::move(shape), std::move(st), offset_);
}

Tensor Tensor::reshape(Shape shape) const {
  shape = infer_shape(std::move(shape), numel(), shape_);
  Shape st;
  if (view_strides(shape_, strides_, shape, st)) return with(std::move(shape), std::move(st), offset_);
  return contiguous().view(std::move(shape));
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  d0 = wrap_dim(d0);
  d1 = wrap_dim(d1);
  Shape s = shape_, st = strides_;
  std::swap(s[d0], s[d1]);
  std::swap(st[d0], st[d1]);
  return with(std::move(s), std::move(st), offset_);
}

Tensor Tensor::permute(std::vector<int64_t> dims) const {
  KCPP_CHECK(static_cast<int64_t>(dims.size()) == dim(), "permute: {} dims given for a tensor of {} dims",
             dims.size(), dim());
  Shape s(dims.size()), st(dims.size());
  std::vector<bool> seen(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) {
    const int64_t d = wrap_dim(dims[i]);
    KCPP_CHECK(!seen[d], "permute: dimension {} repeated", d);
    seen[d] = true;
    s[i] = shape_[d];
    st[i] = strides_[d];
  }
  return with(std::move(s), std::move(st), offset_);
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  d = wrap_dim(d);
  KCPP_CHECK(start >= 0 && length >= 0 && start + length <= shape_[d],
             "narrow: range [{}, {}) out of bounds for dim {} of size {}", start, start + length, d, shape_[d]);
  Shape s = shape_;
  s[d] = length;
  return with(std::move(s), strides_, offset_ + start * strides_[d]);
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  d = wrap_dim(d);
  KCPP_CHECK(index >= -shape_[d] && index < shape_[d], "select: index {} out of range for dim {} of size {}", index,
             d, shape_[d]);
  if (index < 0) index += shape_[d];
  Shape s = shape_, st = strides_;
  s.erase(s.begin() + d);
  st.erase(st.begin() + d);
  return with(std::move(s), std::move(st), offset_ + index * strides_[d]);
}

Tensor Tensor::unsqueeze(int64_t d) const {
  const int64_t n = dim() + 1;
  KCPP_CHECK(d >= -n && d < n, "unsqueeze: dimension {} out of range for {} dims", d, dim());
  if (d < 0) d += n;
  Shape s = shape_, st = strides_;
  const int64_t stride = d < dim() ? strides_[d] * shape_[d] : 1;
  s.insert(s.begin() + d, 1);
  st.insert(st.begin() + d, stride);
  return with(std::move(s), std::move(st), offset_);
}

Tensor Tensor::squeeze(int64_t d) const {
  d = wrap_dim(d);
  KCPP_CHECK(shape_[d] == 1, "squeeze: dimension {} has size {}, not 1", d, shape_[d]);
  Shape s = shape_, st = strides_;
  s.erase(s.begin() + d);
  st.erase(st.begin() + d);
  return with(std::move(s), std::move(st), offset_);
}

Tensor Tensor::expand(Shape shape) const {
  KCPP_CHECK(shape.size() >= shape_.size(), "expand: cannot expand {} to fewer dims {}", shape_str(shape_),
             shape_str(shape));
  const size_t lead = shape.size() - shape_.size();
  Shape st(shape.size(), 0);
  for (size_t i = 0; i < shape.size(); ++i) {
    // -1 keeps a dim's size, so it is no size for a new leading dim.
    if (i < lead) {
      KCPP_CHECK(shape[i] >= 0, "expand: {} cannot be expanded to {} (a new leading dim needs a size >= 0)",
                 shape_str(shape_), shape_str(shape));
      continue;
    }
    const int64_t have = shape_[i - lead];
    if (shape[i] == -1) shape[i] = have;
    KCPP_CHECK(shape[i] >= 0 && (have == shape[i] || have == 1), "expand: {} cannot be expanded to {}",
               shape_str(shape_), shape_str(shape));
    st[i] = have == shape[i] ? strides_[i - lead] : 0;
  }
  return with(std::move(shape), std::move(st), offset_);
}

// ---- copies ----------------------------------------------------------------------------------

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  return clone();
}

Tensor Tensor::clone() const {
  Tensor out = empty(shape_, dtype_, device());
  const profile::Region region("copy", device(), 0, profile::enabled() ? 2.0 * numel() * dtype_size(dtype_) : 0.0);
  detail::copy_same_device(out, *this);
  return out;
}

Tensor Tensor::clone_if_borrowed() const {
  if (storage_ && storage_->release) return clone();
  return *this;
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == dtype_) return *this;
  Tensor out = empty(shape_, dtype, device());
  detail::copy_same_device(out, *this);
  return out;
}

Tensor Tensor::to(Device d) const {
  if (d == device()) return *this;
  Tensor out = empty(shape_, dtype_, d);
  out.copy_(*this);
  return out;
}

void Tensor::copy_(const Tensor& src) const {
  KCPP_CHECK(defined() && src.defined(), "copy_: undefined tensor");
  const Tensor s = src.shape_ == shape_ ? src : src.expand(shape_);
  if (s.device() == device()) return detail::copy_same_device(*this, s);
#if KCPP_WITH_CUDA
  // Across devices: make a contiguous copy in the destination dtype on the source device, move the
  // bytes, then scatter into this tensor's layout on its own device.
  const Tensor staged = (s.dtype() == dtype_ && s.is_contiguous()) ? s : s.to(dtype_).contiguous();
  const Tensor target = is_contiguous() ? *this : empty(shape_, dtype_, device());
  const Device cuda_dev = device().is_cuda() ? device() : s.device();
  cuda::DeviceGuard g(cuda_dev.index);
  if (target.nbytes()) {
    KCPP_CUDA_CHECK(cudaMemcpyAsync(target.data(), staged.data(), target.nbytes(), cudaMemcpyDefault,
                                    cuda::current_stream()));
    // The host side may reuse or free its buffer as soon as we return.  From pageable memory to the
    // device, cudaMemcpyAsync has already taken the bytes (staged by the driver) when it returns, so
    // the stream runs on: the GPU keeps its queue (a prefill's ids and positions used to drain it).
    // A copy to the host, or from page-locked memory the caller may rewrite, waits for the stream.
    // Under stream capture the copy would be a graph node that reads the host buffer at every replay:
    // the wait stays, and fails the capture.
    bool wait = true;
    if (device().is_cuda() && !s.device().is_cuda()) {
      cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
      KCPP_CUDA_CHECK(cudaStreamIsCapturing(cuda::current_stream(), &capturing));
      cudaPointerAttributes attr{};
      KCPP_CUDA_CHECK(cudaPointerGetAttributes(&attr, staged.data()));
      wait = capturing != cudaStreamCaptureStatusNone || attr.type != cudaMemoryTypeUnregistered;
    }
    if (wait) KCPP_CUDA_CHECK(cudaStreamSynchronize(cuda::current_stream()));
  }
  if (!target.shares_storage(*this)) detail::copy_same_device(*this, target);
#else
  KCPP_FAIL("copy_: {} to {} needs CUDA, which this build does not have", s.device().str(), device().str());
#endif
}

void Tensor::fill_(double value) const {
  KCPP_CHECK(defined(), "fill_: undefined tensor");
  detail::fill_same_device(*this, value);
}

std::vector<double> Tensor::to_f64_vector() const {
  const Tensor h = to(Device::cpu()).to(DType::f64).contiguous();
  const double* p = static_cast<const double*>(h.data());
  return std::vector<double>(p, p + h.numel());
}

std::vector<int64_t> Tensor::to_i64_vector() const {
  const Tensor h = to(Device::cpu()).to(DType::i64).contiguous();
  const int64_t* p = static_cast<const int64_t*>(h.data());
  return std::vector<int64_t>(p, p + h.numel());
}

double Tensor::item() const {
  KCPP_CHECK(numel() == 1, "item: tensor has {} elements, not 1", numel());
  return to_f64_vector()[0];
}

std::string Tensor::str() const {
  if (!defined()) return "Tensor(undefined)";
  return fmt::format("Tensor({}, {}, {}, strides {})", dtype_name(dtype_), device().str(), shape_str(shape_),
                     shape_str(strides_));
}

// ---- DLPack ----------------------------------------------------------------------------------

namespace {
constexpr uint8_t kDLBoolCode = 6;  // kDLBool in DLPack >= 0.8; Debian's header is 0.6

DLDataType to_dl(DType t) {
  switch (t) {
    case DType::f64: return {kDLFloat, 64, 1};
    case DType::f32: return {kDLFloat, 32, 1};
    case DType::bf16: return {kDLBfloat, 16, 1};
    case DType::f16: return {kDLFloat, 16, 1};
    case DType::i64: return {kDLInt, 64, 1};
    case DType::i32: return {kDLInt, 32, 1};
    case DType::u8: return {kDLUInt, 8, 1};
    case DType::boolean: return {kDLBoolCode, 8, 1};
  }
  return {kDLFloat, 32, 1};
}

DType from_dl(DLDataType t) {
  KCPP_CHECK(t.lanes == 1, "from_dlpack: vector types (lanes = {}) are not supported", t.lanes);
  if (t.code == kDLFloat && t.bits == 64) return DType::f64;
  if (t.code == kDLFloat && t.bits == 32) return DType::f32;
  if (t.code == kDLFloat && t.bits == 16) return DType::f16;
  if (t.code == kDLBfloat && t.bits == 16) return DType::bf16;
  if (t.code == kDLInt && t.bits == 64) return DType::i64;
  if (t.code == kDLInt && t.bits == 32) return DType::i32;
  if (t.code == kDLUInt && t.bits == 8) return DType::u8;
  if (t.code == kDLBoolCode && t.bits == 8) return DType::boolean;
  KCPP_FAIL("from_dlpack: unsupported dtype (code {}, {} bits)", t.code, t.bits);
}

struct DLContext {
  Tensor tensor;  // keeps the storage alive
  std::vector<int64_t> shape, strides;
  DLManagedTensor managed{};
};
}  // namespace

DLManagedTensor* Tensor::to_dlpack() const {
  KCPP_CHECK(defined(), "to_dlpack: undefined tensor");
  if (storage_->evicted) [[unlikely]] throw_evicted(*storage_);
  auto* ctx = new DLContext{*this, shape_, strides_, {}};
  DLTensor& t = ctx->managed.dl_tensor;
  t.data = storage_->data;
  t.byte_offset = static_cast<uint64_t>(offset_) * element_size();
  const Device d = device();
  t.device = {d.is_cuda() ? kDLCUDA : kDLCPU, d.index};
  t.ndim = static_cast<int32_t>(shape_.size());
  t.dtype = to_dl(dtype_);
  t.shape = ctx->shape.data();
  t.strides = ctx->strides.data();
  ctx->managed.manager_ctx = ctx;
  ctx->managed.deleter = [](DLManagedTensor* self) { delete static_cast<DLContext*>(self->manager_ctx); };
  return &ctx->managed;
}

void Tensor::fill_dl_tensor(DLTensor* t) const {
  KCPP_CHECK(defined(), "fill_dl_tensor: undefined tensor");
  if (storage_->evicted) [[unlikely]] throw_evicted(*storage_);
  const Device d = device();
  t->data = storage_->data;
  t->byte_offset = static_cast<uint64_t>(offset_) * element_size();
  t->device = {d.is_cuda() ? kDLCUDA : kDLCPU, d.index};
  t->ndim = static_cast<int32_t>(shape_.size());
  t->dtype = to_dl(dtype_);
  t->shape = const_cast<int64_t*>(shape_.data());
  t->strides = const_cast<int64_t*>(strides_.data());
}

Tensor Tensor::from_dlpack(DLManagedTensor* m) {
  KCPP_CHECK(m != nullptr, "from_dlpack: null tensor");
  // Adopt first so that the deleter runs even when a check below throws.
  auto release = [m] { if (m->deleter) m->deleter(m); };
  struct Guard {
    std::function<void()> f;
    ~Guard() { if (f) f(); }
  } guard{release};
  const DLTensor& t = m->dl_tensor;
  Device dev;
  if (t.device.device_type == kDLCPU) dev = Device::cpu();
  else if (t.device.device_type == kDLCUDA) dev = Device::cuda(t.device.device_id);
  else KCPP_FAIL("from_dlpack: unsupported device type {}", static_cast<int>(t.device.device_type));
  KCPP_CHECK(t.ndim >= 0 && t.ndim <= 64, "from_dlpack: bad ndim {}", t.ndim);
  const DType dtype = from_dl(t.dtype);
  Shape shape(t.shape, t.shape + t.ndim);
  Shape strides = t.strides ? Shape(t.strides, t.strides + t.ndim) : contiguous_strides(shape);
  KCPP_CHECK(t.byte_offset % dtype_size(dtype) == 0, "from_dlpack: byte_offset {} not a multiple of the element size",
             t.byte_offset);
  Tensor out = from_blob(t.data, shape, dtype, dev, strides, release);
  guard.f = nullptr;  // the storage owns the release now
  out.offset_ = static_cast<int64_t>(t.byte_offset / dtype_size(dtype));
  return out;
}

}  // namespace kcpp
