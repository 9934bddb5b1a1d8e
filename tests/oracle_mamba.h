// The f64 oracle of the mamba package's ops (tests/oracle.h's rules: plain loops over std::vector<double>,
// written from the definitions in packages/mamba/*/ *.h and docs/contracts/SelectiveScan.md,
// CausalConv1d.md, sharing no code with the kernels).  Every function can also give the magnitude of
// its result: the same formula evaluated on the absolute values of every term (see oracle::NormGrad),
// against which the tests measure rounding errors of sums that cancel.
#pragma once

#include <cstdint>
#include <vector>

#include "oracle.h"

namespace kcpp::oracle {

// A selective scan: u, delta, z [B, D, L]; B, C [B, G, N, L]; A [D, N]; D, delta_bias [D]; h0 [B, D, N]
// (the state before position 0; empty: zeros).  Empty z / D / delta_bias: absent.  All contiguous.
struct Scan {
  int64_t batch = 1, dim = 1, seqlen = 1, dstate = 1, groups = 1;
  V u, delta, A, B, C, D, z, delta_bias, h0;
  bool softplus = false, bc_norm = false;
  double eps = 1e-6;
};

struct ScanOut {
  V out, last_state;  // [B, D, L], [B, D, N]
};
// With `magnitude`, the magnitude of out (and of the last state) instead.
ScanOut selective_scan(const Scan& s, bool magnitude = false);

struct ScanGrad {
  V du, ddelta, dA, dB, dC, dD, dz, ddelta_bias;  // dD, dz, ddelta_bias empty when absent
};
// The gradients of sum(dout * out) (h0 is treated as a constant); with `magnitude`, their magnitudes.
ScanGrad selective_scan_backward(const Scan& s, const V& dout, bool magnitude = false);

// A causal depthwise convolution: x [B, D, L], w [D, W], bias [D] (empty: none).
struct Conv {
  int64_t batch = 1, dim = 1, seqlen = 1, width = 1;
  V x, w, bias;
  bool silu = false;
};
V causal_conv1d(const Conv& c, bool magnitude = false);
struct ConvGrad {
  V dx, dw, dbias;
};
ConvGrad causal_conv1d_backward(const Conv& c, const V& dout, bool magnitude = false);

}  // namespace kcpp::oracle
