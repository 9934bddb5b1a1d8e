// kcpp::Tensor: a strided view over reference-counted storage on one device.
//
// A tensor is (storage, dtype, shape, strides, offset); strides and offset count elements, not
// bytes.  Views (view, transpose, permute, narrow, select, unsqueeze, expand) share storage and
// never copy; contiguous(), clone(), to(device) and to(dtype) copy when they must and return
// `*this` when nothing needs to change (as PyTorch does).  Storage comes from the device's caching
// allocator (core/allocator.h), so every byte a tensor holds is counted there.
//
// Copies between dtypes round to nearest even; between devices they go through a contiguous
// staging copy.  Every method checks its arguments and throws kcpp::Error naming what was wrong.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <dlpack/dlpack.h>

#include "core/device.h"
#include "core/dtype.h"

namespace kcpp {

using Shape = std::vector<int64_t>;

class Generator;

// Memory owned by the allocator of `device`, or borrowed from elsewhere (DLPack import, a mapped
// weight file) and released through `release`.
//
// A storage can be released while its tensors live (ZeRO-3 keeps only a shard of each parameter
// between uses, train/data_parallel.h): evict() gives the memory back (to the allocator, or through
// `release` for borrowed memory) and keeps nbytes; restore() allocates nbytes again from the
// allocator (contents undefined until written).  Every tensor and view over the storage sees the
// change; while it is evicted, Tensor::data() and the DLPack exports throw kcpp::Error.
struct Storage {
  void* data = nullptr;
  size_t nbytes = 0;
  Device device;
  std::function<void()> release;  // set for borrowed memory; empty for allocator memory
  bool evicted = false;

  void evict();    // no-op when evicted
  void restore();  // no-op unless evicted

  Storage(size_t n, Device d);                                  // allocates
  Storage(void* p, size_t n, Device d, std::function<void()> r)  // borrows
      : data(p), nbytes(n), device(d), release(std::move(r)) {}
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
};

class Tensor {
 public:
  Tensor() = default;  // undefined: defined() is false and most methods throw

  // ---- factories -------------------------------------------------------------------------
  static Tensor empty(Shape shape, DType dtype, Device device = Device::cpu());
  static Tensor zeros(Shape shape, DType dtype, Device device = Device::cpu());
  static Tensor full(Shape shape, double value, DType dtype, Device device = Device::cpu());
  // Host values (row-major) converted to `dtype` and placed on `device`.
  static Tensor from_f64(std::span<const double> values, Shape shape, DType dtype, Device device = Device::cpu());
  static Tensor from_i64(std::span<const int64_t> values, Shape shape, DType dtype = DType::i64,
                         Device device = Device::cpu());
  // Normal(mean, std) and Uniform[lo, hi) drawn on the host from `gen`, then moved to `device`.
  static Tensor randn(Shape shape, DType dtype, Device device, Generator& gen, double mean = 0, double std = 1);
  static Tensor uniform(Shape shape, DType dtype, Device device, Generator& gen, double lo, double hi);
  // Integers uniform in [lo, hi).
  static Tensor randint(Shape shape, int64_t lo, int64_t hi, DType dtype, Device device, Generator& gen);
  // Wraps memory the caller keeps alive for the tensor's lifetime (no copy, no accounting).
  static Tensor from_blob(void* data, Shape shape, DType dtype, Device device, Shape strides = {},
                          std::function<void()> release = {});

  // ---- properties --------------------------------------------------------------------------
  bool defined() const { return static_cast<bool>(storage_); }
  DType dtype() const { return dtype_; }
  Device device() const;
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t offset() const { return offset_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t d) const { return shape_[wrap_dim(d)]; }
  int64_t stride(int64_t d) const { return strides_[wrap_dim(d)]; }
  int64_t numel() const;
  size_t element_size() const { return dtype_size(dtype_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * element_size(); }
  bool is_contiguous() const;
  // True when both share storage (a view of the other, or the same tensor).
  bool shares_storage(const Tensor& other) const { return storage_ == other.storage_; }
  const std::shared_ptr<Storage>& storage() const { return storage_; }

  // Address of element [0, 0, ...]; typed access checks that T is the stored type.
  void* data() const;
  template <typename T> T* data_ptr() const {
    KCPP_CHECK(dtype_of<T>() == dtype_, "data_ptr: tensor is {}, not {}", dtype_name(dtype_),
               dtype_name(dtype_of<T>()));
    return static_cast<T*>(data());
  }

  // ---- views (share storage) -------------------------------------------------------------------
  // New shape over the same elements; one entry may be -1.  Needs strides compatible with the shape
  // (always true for contiguous tensors); reshape() copies when they are not.
  Tensor view(Shape shape) const;
  Tensor reshape(Shape shape) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor permute(std::vector<int64_t> dims) const;
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor select(int64_t dim, int64_t index) const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor squeeze(int64_t dim) const;
  // Broadcast size-1 dims to `shape` with stride 0 (leading dims may be added; -1 keeps a dim's size).
  Tensor expand(Shape shape) const;
  Tensor flatten() const { return reshape({numel()}); }

  // ---- copies --------------------------------------------------------------------------------
  Tensor contiguous() const;
  Tensor clone() const;
  Tensor to(Device device) const;
  Tensor to(DType dtype) const;
  // Copies src into this tensor's elements: same shape (src may broadcast); any dtype or device.
  void copy_(const Tensor& src) const;
  void fill_(double value) const;

  // Host copy in row-major order, converted to double / int64.
  std::vector<double> to_f64_vector() const;
  std::vector<int64_t> to_i64_vector() const;
  double item() const;  // the single element of a one-element tensor

  std::string str() const;  // "Tensor(bf16, cuda:0, [2, 3], strides [3, 1])"

  // ---- DLPack (v0.6 structs; bool uses code 6, as DLPack >= 0.8 defines kDLBool) -------------
  // The returned tensor keeps this tensor's storage alive until its deleter is called.
  DLManagedTensor* to_dlpack() const;
  // Takes ownership of `t` (its deleter runs when the last view of the result is gone).
  static Tensor from_dlpack(DLManagedTensor* t);
  // A borrowed view for a kernel call: no ownership; shape and strides point into this tensor, so
  // it is valid while this tensor object lives unchanged.
  void fill_dl_tensor(DLTensor* out) const;

 private:
  int64_t wrap_dim(int64_t d) const;
  Tensor with(Shape shape, Shape strides, int64_t offset) const;
  Tensor clone_if_borrowed() const;  // a copy when the storage is borrowed memory, else *this

  std::shared_ptr<Storage> storage_;
  DType dtype_ = DType::f32;
  Shape shape_;
  Shape strides_;
  int64_t offset_ = 0;
};

// Row-major strides of a contiguous tensor of this shape.
Shape contiguous_strides(const Shape& shape);
int64_t shape_numel(const Shape& shape);
// Numpy broadcasting of two shapes; throws naming `what` when they do not broadcast.
Shape broadcast_shapes(const Shape& a, const Shape& b, std::string_view what);
std::string shape_str(const Shape& s);

}  // namespace kcpp
