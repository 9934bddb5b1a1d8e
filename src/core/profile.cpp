#include "core/profile.h"

#include <chrono>
#include <map>

#include "core/cuda_runtime.h"

namespace kcpp::profile {

namespace {

struct Record {
  std::string name;
  Device device = Device::cpu();
  double flops = 0, bytes = 0;
  std::chrono::steady_clock::time_point t0, t1;  // CPU
#if KCPP_WITH_CUDA
  cudaEvent_t e0 = nullptr, e1 = nullptr;  // CUDA
#endif
};

bool on = false;
int depth = 0;
std::vector<Record> records;
#if KCPP_WITH_CUDA
std::vector<cudaEvent_t> spare;  // events of collected records, reused

cudaEvent_t event() {
  if (!spare.empty()) {
    cudaEvent_t e = spare.back();
    spare.pop_back();
    return e;
  }
  cudaEvent_t e;
  KCPP_CUDA_CHECK(cudaEventCreate(&e));
  return e;
}
#endif

}  // namespace

void enable(bool v) { on = v; }
bool enabled() { return on; }

Region::Region(std::string_view name, Device device, double flops, double bytes, std::string_view detail) {
  if (!on) return;
  counted_ = true;
  if (depth++ > 0) return;
  index_ = static_cast<int>(records.size());
  Record& r = records.emplace_back();
  r.name = detail.empty() ? std::string(name) : std::string(name) + " " + std::string(detail);
  r.device = device, r.flops = flops, r.bytes = bytes;
  if (device.is_cuda()) {
#if KCPP_WITH_CUDA
    r.e0 = event(), r.e1 = event();
    KCPP_CUDA_CHECK(cudaEventRecord(r.e0, cuda::current_stream()));
#endif
  } else {
    r.t0 = std::chrono::steady_clock::now();
  }
}

Region::~Region() {
  if (!counted_) return;
  if (depth > 0) --depth;
  if (index_ < 0 || index_ >= static_cast<int>(records.size())) return;
  Record& r = records[index_];
  if (r.device.is_cuda()) {
#if KCPP_WITH_CUDA
    cudaEventRecord(r.e1, cuda::current_stream());  // no throw from a destructor: collect() reports failures
#endif
  } else {
    r.t1 = std::chrono::steady_clock::now();
  }
}

std::vector<Row> collect() {
  std::vector<Row> rows;
  std::map<std::string, size_t> at;
  for (Record& r : records) {
    double ms = 0;
    if (r.device.is_cuda()) {
#if KCPP_WITH_CUDA
      float f = 0;
      KCPP_CUDA_CHECK(cudaEventSynchronize(r.e1));
      KCPP_CUDA_CHECK(cudaEventElapsedTime(&f, r.e0, r.e1));
      ms = f;
      spare.push_back(r.e0), spare.push_back(r.e1);
#endif
    } else {
      ms = std::chrono::duration<double, std::milli>(r.t1 - r.t0).count();
    }
    auto [it, fresh] = at.emplace(r.name, rows.size());
    if (fresh) rows.push_back({r.name});
    Row& row = rows[it->second];
    ++row.calls, row.ms += ms, row.flops += r.flops, row.bytes += r.bytes;
  }
  records.clear();
  depth = 0;
  return rows;
}

}  // namespace kcpp::profile
