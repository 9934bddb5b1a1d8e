// Google Benchmark of the reference (eager) compositions on the CPU at 1024 x 4096: the baseline
// that the CPU kernels of issue 4 must beat by 3x.  Run: build/<preset>/bin/bench_reference_cpu
#include <benchmark/benchmark.h>

#include "core/random.h"
#include "ops/nn/glu.h"
#include "ops/nn/rms_norm.h"
#include "ops/ops.h"

namespace {
using namespace kcpp;

void BM_rms_norm_forward(benchmark::State& st) {
  Generator gen(1);
  const DType dt = static_cast<DType>(st.range(0));
  const Tensor x = Tensor::randn({1024, 4096}, dt, Device::cpu(), gen), w = Tensor::randn({4096}, dt, Device::cpu(), gen);
  for (auto _ : st) benchmark::DoNotOptimize(ops::rms_norm_forward(x, w).y.data());
  st.SetBytesProcessed(st.iterations() * 2 * x.nbytes());
}
BENCHMARK(BM_rms_norm_forward)->Arg(static_cast<int>(DType::f32))->Arg(static_cast<int>(DType::bf16))->Unit(benchmark::kMillisecond);

void BM_swiglu_forward(benchmark::State& st) {
  Generator gen(2);
  const DType dt = static_cast<DType>(st.range(0));
  const Tensor g = Tensor::randn({1024, 4096}, dt, Device::cpu(), gen), u = Tensor::randn({1024, 4096}, dt, Device::cpu(), gen);
  for (auto _ : st) benchmark::DoNotOptimize(ops::glu_forward(g, u, ops::GluActivation::Silu).data());
  st.SetBytesProcessed(st.iterations() * 3 * g.nbytes());
}
BENCHMARK(BM_swiglu_forward)->Arg(static_cast<int>(DType::f32))->Arg(static_cast<int>(DType::bf16))->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
