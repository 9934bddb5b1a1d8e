// The process's one thread policy on the CPU.
//
// Every parallel loop of the library and of its kernel packages is an OpenMP region, and the BLAS
// is OpenBLAS built for OpenMP (Debian's libopenblas-openmp-dev, found by cmake/KcppDeps.cmake and
// loaded through the binaries' run path), so a GEMM runs on the same libgomp team as the loops
// around it.  One pool means no oversubscription: a pthread OpenBLAS beside libgomp keeps two pools
// of `cores` threads each, and whichever pool is idle spin-waits on the cores the other needs.
//
// The team's size is OpenMP's: OMP_NUM_THREADS at start-up, or set_num_threads(); OpenBLAS reads
// omp_get_max_threads() on every call, and runs single-threaded inside a parallel region.
#pragma once

#include <string>

namespace kcpp::ops {

struct ThreadPolicy {
  int threads = 1;             // omp_get_max_threads(): the team size of every parallel region
  std::string blas;            // "OpenBLAS 0.3.21"
  std::string blas_threading;  // "OpenMP" (one pool), "pthreads" (a second pool) or "sequential"
  std::string blas_core;       // the kernel family OpenBLAS picked for this CPU, e.g. "Haswell"
};

ThreadPolicy thread_policy();

// Sets the team size for the library's loops and its BLAS together.  Throws kcpp::Error for n < 1.
void set_num_threads(int n);

// One line for reports: "2 threads, one OpenMP team (OpenBLAS 0.3.21, Haswell, OpenMP)".
std::string thread_policy_str(const ThreadPolicy& p);

}  // namespace kcpp::ops
