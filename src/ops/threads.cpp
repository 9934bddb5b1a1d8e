#include "ops/threads.h"

#include <cblas.h>
#include <omp.h>

#include <fmt/format.h>

#include "core/error.h"

namespace kcpp::ops {

ThreadPolicy thread_policy() {
  ThreadPolicy p;
  p.threads = omp_get_max_threads();
  // openblas_get_config() reads "OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY Haswell MAX_THREADS=64".
  const std::string config = openblas_get_config();
  const size_t version_end = config.find(' ', config.find(' ') + 1);
  p.blas = config.substr(0, version_end);
  p.blas_core = openblas_get_corename();
  switch (openblas_get_parallel()) {
    case 0: p.blas_threading = "sequential"; break;
    case 1: p.blas_threading = "pthreads"; break;
    case 2: p.blas_threading = "OpenMP"; break;
    default: p.blas_threading = "unknown"; break;
  }
  return p;
}

void set_num_threads(int n) {
  KCPP_CHECK(n >= 1, "the number of CPU threads must be at least 1, got {}", n);
  omp_set_num_threads(n);
  openblas_set_num_threads(n);  // a pthread or sequential OpenBLAS does not read the OpenMP setting
}

std::string thread_policy_str(const ThreadPolicy& p) {
  const bool one_pool = p.blas_threading == "OpenMP" || p.blas_threading == "sequential";
  return fmt::format("{} thread{}, {} ({}, {}, {})", p.threads, p.threads == 1 ? "" : "s",
                     one_pool ? "one OpenMP team" : "OpenMP beside a second BLAS pool", p.blas, p.blas_core,
                     p.blas_threading);
}

}  // namespace kcpp::ops
