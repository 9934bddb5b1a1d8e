#include "core/pending_copy.h"

#include <cstring>

#include "core/cuda_runtime.h"
#include "core/error.h"

namespace kcpp {

struct PendingCopy::Impl {
  Tensor source;                // alive until wait()
  std::vector<int64_t> values;  // a CPU source's values
  bool pending = false;
#if KCPP_WITH_CUDA
  int64_t* pinned = nullptr;
  size_t capacity = 0;  // elements
  cudaEvent_t done = nullptr;
  int device = -1;
  ~Impl() {
    if (done) (void)cudaEventSynchronize(done);  // a copy still in flight lands before its memory goes
    if (pinned) (void)cudaFreeHost(pinned);
    if (done) (void)cudaEventDestroy(done);
  }
#endif
};

PendingCopy::PendingCopy() : impl_(std::make_unique<Impl>()) {}
PendingCopy::~PendingCopy() = default;

bool PendingCopy::pending() const { return impl_->pending; }

void PendingCopy::start(const Tensor& t) {
  KCPP_CHECK(!impl_->pending, "PendingCopy: start() while a copy is in flight (wait() for it first)");
  KCPP_CHECK(t.defined() && t.dtype() == DType::i64 && t.is_contiguous(), "PendingCopy: needs a contiguous i64 tensor");
  Impl& m = *impl_;
  if (!t.device().is_cuda()) {
    m.values = t.to_i64_vector();
    m.pending = true;
    return;
  }
#if KCPP_WITH_CUDA
  cuda::DeviceGuard guard(t.device().index);
  const size_t n = static_cast<size_t>(t.numel());
  if (m.device != t.device().index) {  // the event belongs to its device
    if (m.done) KCPP_CUDA_CHECK(cudaEventDestroy(m.done));
    m.done = nullptr, m.device = t.device().index;
  }
  if (!m.done) KCPP_CUDA_CHECK(cudaEventCreateWithFlags(&m.done, cudaEventDisableTiming));
  if (n > m.capacity) {
    if (m.pinned) KCPP_CUDA_CHECK(cudaFreeHost(m.pinned));
    m.pinned = nullptr;
    KCPP_CUDA_CHECK(cudaMallocHost(&m.pinned, n * sizeof(int64_t)));
    m.capacity = n;
  }
  if (n > 0)
    KCPP_CUDA_CHECK(cudaMemcpyAsync(m.pinned, t.data(), n * sizeof(int64_t), cudaMemcpyDeviceToHost, cuda::current_stream()));
  KCPP_CUDA_CHECK(cudaEventRecord(m.done, cuda::current_stream()));
  m.source = t;
  m.pending = true;
#endif
}

std::vector<int64_t> PendingCopy::wait() {
  KCPP_CHECK(impl_->pending, "PendingCopy: wait() with no copy started");
  Impl& m = *impl_;
  m.pending = false;
  if (!m.source.defined()) return std::move(m.values);
#if KCPP_WITH_CUDA
  KCPP_CUDA_CHECK(cudaEventSynchronize(m.done));
  std::vector<int64_t> out(static_cast<size_t>(m.source.numel()));
  if (!out.empty()) std::memcpy(out.data(), m.pinned, out.size() * sizeof(int64_t));
  m.source = Tensor();
  return out;
#else
  return {};
#endif
}

}  // namespace kcpp
