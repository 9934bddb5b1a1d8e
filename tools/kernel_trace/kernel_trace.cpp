// A CUDA injection library that records when every kernel ran, for the GPU machine where Nsight
// Systems cannot make a report: with CUDA_INJECTION64_PATH=/path/to/libkcpp_kernel_trace.so the CUDA
// driver loads it into any program at its first CUDA call and calls InitializeInjection(), which
// turns on CUPTI's kernel activity records (kernels replayed from CUDA graphs too, each node its own
// record).  At exit the records go to KCPP_TRACE_OUT (default kernel-trace.tsv), one line a kernel
// in the order they started: start and end in ns (the GPU's clock), the stream, the graph id (0
// outside graphs) and the name as CUPTI gives it (mangled; scripts/kernel_trace.py demangles it for
// the timeline scripts).  With
// KCPP_TRACE_API=1 the host's CUDA runtime calls (start and end on the same clock; the name
// "api:<call>") and the copies ("memcpy:<direction>:<bytes>", on the GPU) go to KCPP_TRACE_OUT.api.tsv
// in the same format, which says where the host held the GPU up (scripts/device-prefill-timeline.sh).
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
std::vector<Kernel> kernels, calls;  // calls: runtime API calls and copies, with KCPP_TRACE_API=1
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
  std::vector<Kernel> got, got_calls;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind == CUPTI_ACTIVITY_KIND_RUNTIME) {
      const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(record);
      const char* name = nullptr;
      if (cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, a->cbid, &name) != CUPTI_SUCCESS || name == nullptr) name = "?";
      got_calls.push_back({a->start, a->end, 0, 0, std::string("api:") + name});
      continue;
    }
    if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
      static const char* const kinds[] = {"unknown", "HtoD", "DtoH", "HtoA", "AtoH", "AtoA", "AtoD", "DtoA", "DtoD", "HtoH", "PtoP"};
      const char* dir = m->copyKind < sizeof(kinds) / sizeof(kinds[0]) ? kinds[m->copyKind] : "other";
      got_calls.push_back({m->start, m->end, m->streamId, m->graphId,
                           std::string("memcpy:") + dir + ":" + std::to_string(m->bytes)});
      continue;
    }
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
  calls.insert(calls.end(), got_calls.begin(), got_calls.end());
}

// One line a record, in the order they started.
void write_records(std::vector<Kernel>& records, const std::string& path) {
  std::sort(records.begin(), records.end(), [](const Kernel& a, const Kernel& b) { return a.start < b.start; });
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "kcpp_kernel_trace: cannot write %s\n", path.c_str());
    return;
  }
  for (const Kernel& k : records)
    std::fprintf(f, "%llu\t%llu\t%u\t%u\t%s\n", static_cast<unsigned long long>(k.start), static_cast<unsigned long long>(k.end),
                 k.stream, k.graph, k.name.c_str());
  std::fclose(f);
}

void write_out() {
  report(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "flush");
  const char* env = std::getenv("KCPP_TRACE_OUT");
  const std::string path = env != nullptr ? env : "kernel-trace.tsv";
  const std::lock_guard<std::mutex> lock(mu);
  write_records(kernels, path);
  if (!calls.empty()) write_records(calls, path + ".api.tsv");
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int InitializeInjection(void) {
  report(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "register callbacks");
  report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernel records");
  const char* api = std::getenv("KCPP_TRACE_API");
  if (api != nullptr && api[0] == '1') {
    report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME), "enable runtime API records");
    report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable copy records");
  }
  std::atexit(write_out);
  return 1;
}
