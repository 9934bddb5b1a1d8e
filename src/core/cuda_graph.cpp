#include "core/cuda_graph.h"

#include "core/cuda_runtime.h"
#include "core/error.h"

namespace kcpp {

#if KCPP_WITH_CUDA

struct CudaGraph::Impl {
  Device device = Device::cpu();
  std::unique_ptr<PrivatePool> pool;
  cudaGraphExec_t exec = nullptr;
  void reset() {
    if (exec) (void)cudaGraphExecDestroy(exec);
    exec = nullptr;
    pool.reset();
  }
  ~Impl() { reset(); }
};

CudaGraph::CudaGraph() : impl_(std::make_unique<Impl>()) {}
CudaGraph::~CudaGraph() = default;

bool CudaGraph::captured() const { return impl_->exec != nullptr; }
void CudaGraph::reset() { impl_->reset(); }

void CudaGraph::capture(Device device, const std::function<void()>& body) {
  KCPP_CHECK(device.is_cuda(), "CUDA graph: capture needs a CUDA device, got {}", device.str());
  impl_->reset();
  cuda::DeviceGuard guard(device.index);
  auto pool = std::make_unique<PrivatePool>(device);
  cudaStream_t stream = nullptr;
  // A blocking stream: work a library puts on the legacy default stream during the capture is then
  // refused (an error, so no graph) instead of running once outside it.
  KCPP_CUDA_CHECK(cudaStreamCreate(&stream));
  const cudaStream_t previous = cuda::current_stream();
  // What the previous stream queued (the inputs' copies) comes first.
  KCPP_CUDA_CHECK(cudaStreamSynchronize(previous));
  cuda::set_current_stream(stream);
  cudaGraph_t graph = nullptr;
  std::string failure;
  {
    PoolScope scope(*pool);
    // Relaxed: the allocator may take fresh memory from cudaMalloc while the body is recorded.
    cudaError_t e = cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed);
    if (e == cudaSuccess) {
      try {
        body();
      } catch (const std::exception& ex) {
        failure = ex.what();
      }
      e = cudaStreamEndCapture(stream, &graph);
      if (e != cudaSuccess && failure.empty()) failure = fmt::format("{}: {}", cudaGetErrorName(e), cudaGetErrorString(e));
    } else {
      failure = fmt::format("{}: {}", cudaGetErrorName(e), cudaGetErrorString(e));
    }
  }
  cuda::set_current_stream(previous);
  (void)cudaGetLastError();  // a refused call inside the capture leaves its error behind
  if (failure.empty() && graph) {
    const cudaError_t e = cudaGraphInstantiate(&impl_->exec, graph, 0);
    if (e != cudaSuccess) failure = fmt::format("{}: {}", cudaGetErrorName(e), cudaGetErrorString(e));
  }
  if (graph) (void)cudaGraphDestroy(graph);
  (void)cudaStreamDestroy(stream);
  if (!failure.empty()) {
    impl_->exec = nullptr;
    KCPP_FAIL("CUDA graph capture failed: {}", failure);
  }
  impl_->device = device;
  impl_->pool = std::move(pool);
}

void CudaGraph::replay() {
  KCPP_CHECK(impl_->exec, "CUDA graph: replay before a successful capture");
  cuda::DeviceGuard guard(impl_->device.index);
  KCPP_CUDA_CHECK(cudaGraphLaunch(impl_->exec, cuda::current_stream()));
}

bool cuda_graphs_compiled() { return true; }

#else

struct CudaGraph::Impl {};
CudaGraph::CudaGraph() : impl_(std::make_unique<Impl>()) {}
CudaGraph::~CudaGraph() = default;
bool CudaGraph::captured() const { return false; }
void CudaGraph::reset() {}
void CudaGraph::capture(Device device, const std::function<void()>&) {
  KCPP_FAIL("CUDA graph: this build of kernels.cpp has no CUDA support (capture on {})", device.str());
}
void CudaGraph::replay() { KCPP_FAIL("CUDA graph: this build of kernels.cpp has no CUDA support"); }
bool cuda_graphs_compiled() { return false; }

#endif

}  // namespace kcpp
