#include "core/pending_copy.h"

#include <cstdlib>
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
  cudaEvent_t ready = nullptr;  // the source written, on the caller's stream
  cudaEvent_t done = nullptr;   // the copy landed, on `side`
  cudaStream_t side = nullptr;  // the copies' own stream (of `device`)
  int device = -1;
  void release() {
    if (done) (void)cudaEventSynchronize(done);  // a copy still in flight lands before its memory goes
    if (side) (void)cudaStreamDestroy(side);
    if (ready) (void)cudaEventDestroy(ready);
    if (done) (void)cudaEventDestroy(done);
    side = nullptr, ready = nullptr, done = nullptr;
  }
  ~Impl() {
    release();
    if (pinned) (void)cudaFreeHost(pinned);
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
  if (m.device != t.device().index) {  // the events and the stream belong to their device
    m.release();
    m.device = t.device().index;
  }
  if (!m.done) {
    KCPP_CUDA_CHECK(cudaEventCreateWithFlags(&m.ready, cudaEventDisableTiming));
    KCPP_CUDA_CHECK(cudaEventCreateWithFlags(&m.done, cudaEventDisableTiming));
    KCPP_CUDA_CHECK(cudaStreamCreateWithFlags(&m.side, cudaStreamNonBlocking));
  }
  if (n > m.capacity) {
    if (m.pinned) KCPP_CUDA_CHECK(cudaFreeHost(m.pinned));
    m.pinned = nullptr;
    KCPP_CUDA_CHECK(cudaMallocHost(&m.pinned, n * sizeof(int64_t)));
    m.capacity = n;
  }
  // On the side stream once the caller's stream has written the source, so that the caller's next
  // kernels do not wait behind the copy; under stream capture, on the caller's stream.
  const cudaStream_t caller = cuda::current_stream();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  KCPP_CUDA_CHECK(cudaStreamIsCapturing(caller, &capture));
  // KCPP_COPY_SIDE=0: on the caller's stream always (a measuring switch).
  static const bool side_off = [] {
    const char* e = std::getenv("KCPP_COPY_SIDE");
    return e != nullptr && e[0] == '0';
  }();
  const cudaStream_t on = capture == cudaStreamCaptureStatusNone && !side_off ? m.side : caller;
  if (on != caller) {
    KCPP_CUDA_CHECK(cudaEventRecord(m.ready, caller));
    KCPP_CUDA_CHECK(cudaStreamWaitEvent(on, m.ready, 0));
  }
  if (n > 0) KCPP_CUDA_CHECK(cudaMemcpyAsync(m.pinned, t.data(), n * sizeof(int64_t), cudaMemcpyDeviceToHost, on));
  KCPP_CUDA_CHECK(cudaEventRecord(m.done, on));
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
