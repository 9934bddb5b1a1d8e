// A CUDA injection library that records when every kernel ran, for the GPU machine where Nsight
// Systems cannot make a report: with CUDA_INJECTION64_PATH=/path/to/libkcpp_kernel_trace.so the CUDA
// driver loads it into any program at its first CUDA call and calls InitializeInjection(), which
// turns on CUPTI's kernel activity records (kernels replayed from CUDA graphs too, each node its own
// record).  At exit the records go to KCPP_TRACE_OUT (default kernel-trace.tsv), one line a kernel
// in the order they started: start and end in ns (the GPU's clock), the stream, the graph id (0
// outside graphs) and the demangled name.  scripts/device-decode-timeline.sh reads it.
#include <cupti.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct Kernel {
  uint64_t start, end;
  uint32_t stream, graph;
  std::string name;
};

std::mutex mu;
std::vector<Kernel> kernels;
constexpr size_t kBufferBytes = 8 << 20;

void report(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  std::fprintf(stderr, "kcpp_kernel_trace: %s: %s\n", what, msg ? msg : "unknown CUPTI error");
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer != nullptr ? kBufferBytes : 0;
  *max_records = 0;  // as many as fit
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  std::vector<Kernel> got;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && record->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
    got.push_back({k->start, k->end, k->streamId, k->graphId, k->name != nullptr ? k->name : "?"});
  }
  size_t dropped = 0;
  cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
  if (dropped > 0) std::fprintf(stderr, "kcpp_kernel_trace: %zu records dropped\n", dropped);
  std::free(buffer);
  const std::lock_guard<std::mutex> lock(mu);
  kernels.insert(kernels.end(), got.begin(), got.end());
}

void write_out() {
  report(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "flush");
  const char* path = std::getenv("KCPP_TRACE_OUT");
  const std::lock_guard<std::mutex> lock(mu);
  std::sort(kernels.begin(), kernels.end(), [](const Kernel& a, const Kernel& b) { return a.start < b.start; });
  FILE* f = std::fopen(path != nullptr ? path : "kernel-trace.tsv", "w");
  if (f == nullptr) {
    std::fprintf(stderr, "kcpp_kernel_trace: cannot write %s\n", path != nullptr ? path : "kernel-trace.tsv");
    return;
  }
  for (const Kernel& k : kernels)
    std::fprintf(f, "%llu\t%llu\t%u\t%u\t%s\n", static_cast<unsigned long long>(k.start), static_cast<unsigned long long>(k.end),
                 k.stream, k.graph, k.name.c_str());
  std::fclose(f);
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int InitializeInjection(void) {
  report(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "register callbacks");
  report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernel records");
  std::atexit(write_out);
  return 1;
}
