// Launch configurations of the CUDA cross-entropy, for the tuning sweep of bench/bench_kernels.cpp
// and for tests that cover every variant.  The ordinary entry points pick a configuration themselves.
#pragma once

#include "cross_entropy.h"

namespace kcpp::liger {

struct CrossEntropyConfig {
  bool cluster = true;  // the one-pass cluster path where it applies (sm_90, 16-byte rows, a row
                        // within 8 blocks' registers); false: the two-pass loop path
  int threads = 0;      // a block of the cluster path: 256, 512 or 1024; 0: the default (256 x 8
                        // where the row fits 8 such blocks and there are no per-element options,
                        // else 512 x 8; cross_entropy_cuda.cu)
  int vecs = 8;         // 16-byte vectors a thread holds: 512 x 8 and 1024 x 4 = 64 KiB slices, one
                        // block per SM; 512 x 4 and 256 x 8 = 32 KiB slices, two blocks per SM
  int stages = 1;       // rows whose loads a block keeps in flight (1..4; 1 measured fastest, bench/RESULTS.md)
  int max_clusters = 0; // 0: as many clusters as fit at once; tests set a few, so that each block
                        // runs many rows through its stages
};

#if KCPP_WITH_CUDA
// As cross_entropy_cuda, with the configuration given (falls back to the loop path where the
// cluster path does not apply).
const char* cross_entropy_cuda_with(const CrossEntropyParams& p, cudaStream_t stream, const CrossEntropyConfig& c);
// Whether p would take the cluster path under c on the current device, and with how many blocks a cluster.
int cross_entropy_cluster_size(const CrossEntropyParams& p, const CrossEntropyConfig& c);
#endif

}  // namespace kcpp::liger
